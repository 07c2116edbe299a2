#!/usr/bin/env python3
"""The MIG profile table gpufleet's MIG module reads from a real GPU, against its fallback table: read-only
(MIG mode, GPU-instance profile infos and placements, process counts; nothing is created or changed).
stdlib + pynvml; run from a checkout (it imports plugins/module_utils/mig_layout.py, as the module and the
boot applier do). Prints one JSON object per GPU and exits 1 when a GPU's NVML table is missing or differs
from gpufleet's table for its model (where gpufleet has one).

    python3 tests/realgpu/mig_table_check.py
"""

import json
import os
import sys

import pynvml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "plugins", "module_utils"))
import mig_layout  # noqa: E402

pynvml.nvmlInit()
bad = 0
for gpu in mig_layout.MigNvml(pynvml).gpus():
    fallback = mig_layout.profile_table(gpu["model"])
    nvml = gpu.get("profiles")
    same = None if fallback is None or nvml is None else nvml == fallback
    bad += gpu["mig_supported"] and (nvml is None or same is False)
    print(json.dumps({"index": gpu["index"], "model": gpu["model"], "mig_supported": gpu["mig_supported"],
                      "mig": [gpu["current"], gpu["pending"]], "nvml_table": nvml,
                      "fallback_table": fallback, "equal": same}))  # fmt: skip
pynvml.nvmlShutdown()
sys.exit(1 if bad else 0)
