"""OCI runtime wrapper for the test clusters' and the lab's runtimes: clamp a negative ``oom_score_adj``,
exec runc.

The build machines lack CAP_SYS_RESOURCE, so runc cannot apply the -998/-997 that dockershim requests for
sandboxes and Guaranteed pods (it fails with ``can't get final child's PID from pipe: EOF``). This file
is run by path from a generated shim (``python3 -I -S``), so it must use the standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def bundle_of(args: list[str]) -> Path | None:
    """The ``--bundle``/``-b`` directory among runc's arguments, if any."""
    for i, arg in enumerate(args):
        if arg.startswith("--bundle="):
            return Path(arg.split("=", 1)[1])
        if arg in ("--bundle", "-b") and i + 1 < len(args):
            return Path(args[i + 1])
    return None


def clamp_oom_score_adj(config: Path) -> bool:
    """Rewrite ``process.oomScoreAdj`` to 0 when negative; True if the file changed."""
    spec = json.loads(config.read_text())
    process = spec.get("process") or {}
    if int(process.get("oomScoreAdj") or 0) >= 0:
        return False
    process["oomScoreAdj"] = 0
    tmp = config.with_name(config.name + ".tmp")
    tmp.write_text(json.dumps(spec))
    tmp.replace(config)
    return True


def main(runc: str, args: list[str] | None = None) -> None:
    """Clamp the bundle's config (for ``create``/``run``), then replace this process with ``runc``."""
    args = sys.argv[1:] if args is None else args
    bundle = bundle_of(args)
    if bundle is not None and (bundle / "config.json").is_file():
        clamp_oom_score_adj(bundle / "config.json")
    os.execv(runc, [runc, *args])


def shim(runc: str, python: str = sys.executable) -> str:
    """Text of an executable that runs this file's :func:`main` with ``runc`` as the real runtime."""
    return (
        f"#!{python} -IS\nimport runpy\nrunpy.run_path({str(Path(__file__).resolve())!r})['main']({runc!r})\n"
    )
