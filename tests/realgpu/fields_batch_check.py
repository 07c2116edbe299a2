#!/usr/bin/env python3
"""When does a real GPU leave field values untouched? A follow-up to fields_check.py, whose call for all 319
ids got SUCCESS with no value type and no value for 46 fields (147, the power limits 187-190/192, the T.Limit
thresholds 193-196, power smoothing 251-268/275-288, 270-273) and the energy 191 as an unsigned long long,
while its later call of 24 power fields got the limits (200/700 W) and 191 as an unsigned int. The simulator
guesses "a call of more than 64 values" (src/gpufleet_harness/sim/native/fields.c, H200_LARGE_CALL); this
tells the rule apart from "the process's first call" and "too many fields of one driver call".

Read-only (nvmlDeviceGetFieldValues only); stdlib + pynvml; a few seconds. Every array is pre-filled with a
marker (valueType 99, value 0x5A5A5A5A5A5A5A5A, timestamp -1, latency -1, nvmlReturn 99), so an entry the
driver did not touch at all shows the marker. Each row: [fieldId, scopeId, nvmlReturn, valueType, value as an
unsigned 64-bit integer, timestamp, latencyUsec].

    python3 fields_batch_check.py OUTDIR     # writes OUTDIR/fields-batch.json

Records:
- `first_short`: a fresh process's first call: the 46 fields plus 185/186/191, 49 values;
- `first_all_twice`: a fresh process's first two calls, each for all ids 1..319;
- `sizes`: in one process (after a warm-up call of all 319), the power fields 185-192 followed by field 82
  repeated up to N values, N from 9 to 319: where the limits stop being written;
- `group_alone` / `group_padded`: the 46 fields alone, and the same 46 followed by field 82 up to 319 values.
"""

import ctypes
import json
import os
import subprocess
import sys

import pynvml as N

MARK_TYPE, MARK_VALUE, MARK_RETURN = 99, 0x5A5A5A5A5A5A5A5A, 99
GROUP = [147, 187, 188, 189, 190, 192, 193, 194, 195, 196, *range(251, 269), 270, 271, 272, 273,
         *range(275, 289)]
POWER = list(range(185, 193))
SIZES = (9, 16, 24, 25, 32, 33, 46, 47, 48, 49, 64, 65, 70, 71, 72, 96, 128, 129, 160, 192, 255, 256, 257,
         300, 318, 319)


def call(h, ids):
    """One nvmlDeviceGetFieldValues over (id, scope 0) pairs, every entry marked first."""
    values = (N.c_nvmlFieldValue_t * len(ids))()
    for k, fid in enumerate(ids):
        v = values[k]
        v.fieldId, v.scopeId = fid, 0
        v.valueType, v.nvmlReturn, v.timestamp, v.latencyUsec = MARK_TYPE, MARK_RETURN, -1, -1
        v.value.ullVal = MARK_VALUE
    rc = N.nvmlLib.nvmlDeviceGetFieldValues(h, ctypes.c_int(len(ids)), values)
    rows = [[v.fieldId, v.scopeId, v.nvmlReturn, v.valueType, v.value.ullVal, v.timestamp, v.latencyUsec]
            for v in values]
    return {"rc": rc, "rows": rows}


def only(result, wanted):
    """The rows of `result` for the ids in `wanted` (first occurrence each)."""
    seen, out = set(), []
    for row in result["rows"]:
        if row[0] in wanted and row[0] not in seen:
            seen.add(row[0])
            out.append(row)
    return {"rc": result["rc"], "rows": out}


def child(mode):
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    if mode == "first_short":
        return call(h, [*GROUP, 185, 186, 191])
    if mode == "first_all_twice":
        every = list(range(1, 320))
        return [call(h, every), call(h, every)]
    raise SystemExit(f"unknown mode {mode}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    doc = {}
    for mode in ("first_short", "first_all_twice"):  # fresh processes: their first calls
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode],
                              capture_output=True, text=True, timeout=120, check=False)
        doc[mode] = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    doc["driver"] = N.nvmlSystemGetDriverVersion()
    doc["name"] = N.nvmlDeviceGetName(h)
    doc["warm_up"] = only(call(h, list(range(1, 320))), set(POWER))
    doc["sizes"] = {str(n): only(call(h, POWER + [82] * (n - len(POWER))), set(POWER)) for n in SIZES}
    doc["group_alone"] = call(h, GROUP)
    doc["group_padded"] = only(call(h, GROUP + [82] * (319 - len(GROUP))), set(GROUP))
    path = os.path.join(out, "fields-batch.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    written = [n for n, r in doc["sizes"].items() if r["rows"][2][3] == 1]  # 187 typed unsigned int
    print(f"wrote {path}: the power limits written in calls of {', '.join(written) or 'no size'} values")


if __name__ == "__main__":
    main()
