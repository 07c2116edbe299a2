"""Regenerate api_pb2.py / api_pb2_grpc.py from api.proto with grpcio-tools.

Run `python -m gpufleet.deviceplugin.api.regen` after editing api.proto, then commit the output.
protoc runs from the source root so the descriptor is registered as "gpufleet/deviceplugin/api/api.proto"
(a bare "api.proto" could collide in protobuf's global pool) and the generated grpc module imports
its message module by its package path.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE_ROOT = HERE.parents[2]


def main() -> int:
    """Run protoc (bundled with grpcio-tools) on api.proto."""
    from grpc_tools import protoc  # dev dependency, imported here so the package never needs it

    include = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{SOURCE_ROOT}",
            f"-I{include}",
            f"--python_out={SOURCE_ROOT}",
            f"--pyi_out={SOURCE_ROOT}",
            f"--grpc_python_out={SOURCE_ROOT}",
            str(HERE / "api.proto"),
        ]
    )
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    # The stub serves type checkers; pyproject's lint exclusion covers only the .py files, and a
    # generated file is not ours to restyle.
    stub = HERE / "api_pb2.pyi"
    stub.write_text("# ruff: noqa\n" + stub.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
