# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Apply the node's MIG layout without Ansible: the boot applier of the role gpufleet.nvidia.nvidia_mig.

GPU and compute instances do not survive a reboot (the MIG mode does), so gpufleet-mig.service runs this
before the kubelet and the device plugin start. It is the module gpufleet.nvidia.gpu_mig_layout's logic:
the role installs plugins/module_utils/mig_layout.py beside this file, unchanged, and this file only reads
the arguments, calls it, and logs one event per line (a JSON object) on stdout, for the journal. Exit 0
when the layout is in place, 1 when it could not be applied (the event says why), 2 on bad arguments.

    python3 gpufleet_mig_apply.py --config /etc/gpufleet/mig/config.yaml \
        --layout-file /etc/gpufleet/mig/layout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The module_utils file the role installs beside this one.
import mig_layout


def _log(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _reset(index: int) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise mig_layout.LayoutError(f"GPU {index}: a GPU reset is needed and nvidia-smi is not on PATH")
    proc = subprocess.run(
        [smi, "--gpu-reset", "-i", str(index)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise mig_layout.LayoutError(
            f"GPU {index}: nvidia-smi --gpu-reset failed (rc {proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()}"
        )


def _layout_name(args: argparse.Namespace) -> str:
    if args.layout:
        return str(args.layout)
    try:
        with open(args.layout_file, encoding="utf-8") as f:
            name = f.read().strip()
    except OSError as exc:
        raise mig_layout.LayoutError(f"cannot read {args.layout_file}: {exc.strerror}") from None
    if not name:
        raise mig_layout.LayoutError(f"{args.layout_file} names no layout")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Apply a MIG layout (a mig-parted config) to the GPUs.")
    parser.add_argument("--config", required=True, help="mig-parted config file (YAML)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--layout", help="layout name in the config's mig-configs")
    which.add_argument("--layout-file", help="file holding the layout name (the role writes it)")
    parser.add_argument("--check", action="store_true", help="report what would change, change nothing")
    args = parser.parse_args(argv)

    try:
        import pynvml
    except ImportError:
        _log("failed", error="pynvml (nvidia-ml-py) is not installed for " + sys.executable)
        return 1
    result: dict = {"changed": False, "gpus": []}
    try:
        layout = _layout_name(args)
        layouts = mig_layout.load_layouts(layout, args.config)
        pynvml.nvmlInit()
    except mig_layout.LayoutError as exc:
        _log("failed", error=str(exc))
        return 1
    except pynvml.NVMLError as exc:
        _log("failed", layout=layout, error=f"NVML init: {exc}")
        return 1
    try:
        mig_layout.run_layout(pynvml, layouts, layout, result, check_mode=args.check, reset=_reset)
    except (mig_layout.LayoutError, pynvml.NVMLError) as exc:
        for gpu in result["gpus"]:
            _log("gpu", index=gpu["index"], changed=gpu["changed"], actions=gpu["actions"])
        _log("failed", layout=layout, error=str(exc))
        return 1
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    for gpu in result["gpus"]:
        _log("gpu", index=gpu["index"], changed=gpu["changed"], actions=gpu["actions"], after=gpu["after"])
    _log("applied" if not args.check else "checked", layout=layout, changed=result["changed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
