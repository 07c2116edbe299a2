"""Regenerate the Python modules of the kubelet APIs (api.proto, podresources.proto) with grpcio-tools.

Run `python -m gpufleet.deviceplugin.api.regen` after editing a .proto, then commit the output.
protoc runs from the source root so each descriptor is registered under its package path (e.g.
"gpufleet/deviceplugin/api/api.proto"; a bare "api.proto" could collide in protobuf's global pool) and the
generated grpc modules import their message modules by their package paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE_ROOT = HERE.parents[2]
PROTOS = ("api.proto", "podresources.proto")


def main() -> int:
    """Run protoc (bundled with grpcio-tools) on every .proto of PROTOS."""
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
            *(str(HERE / proto) for proto in PROTOS),
        ]
    )
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    # The stubs serve type checkers; pyproject's lint exclusion covers only the .py files, and a
    # generated file is not ours to restyle.
    for proto in PROTOS:
        stub = HERE / proto.replace(".proto", "_pb2.pyi")
        text = stub.read_text()
        if not text.startswith("# ruff: noqa"):
            stub.write_text("# ruff: noqa\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
