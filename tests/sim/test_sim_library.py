"""The built library: exported symbols, stubs, the build cache and its error messages."""

from __future__ import annotations

import ctypes
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet_harness.sim import build as simbuild

HEADER = Path("/usr/include/nvml.h")


def _header_functions() -> list[str]:
    return sorted(set(re.findall(r"\bDECLDIR\s+\*?\s*(nvml\w+)\s*\(", HEADER.read_text(errors="replace"))))


def _exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def test_every_header_function_is_exported(sim_lib: Path) -> None:
    names = _header_functions()
    assert len(names) > 250 and "nvmlInit" in names and "nvmlDeviceGetPciInfo" in names  # incl. unversioned
    exported = _exported(sim_lib)
    assert set(names) - exported == set()
    lib = ctypes.CDLL(str(sim_lib))
    assert all(hasattr(lib, name) for name in names)


def test_only_nvml_symbols_are_exported(sim_lib: Path) -> None:
    exported = _exported(sim_lib)
    assert {s for s in exported if not s.startswith("nvml")} == set()
    assert {"nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetNumaNodeId",
            "nvmlErrorString"} <= exported


def test_names_pynvml_uses_for_the_core_calls_resolve(sim_lib: Path) -> None:
    import pynvml

    used = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', Path(pynvml.__file__).read_text()))
    core = {"nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion",
            "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2",
            "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
            "nvmlDeviceGetSerial",
            "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetArchitecture",
            "nvmlDeviceGetBrand", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetPersistenceMode",
            "nvmlDeviceGetMigMode", "nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemoteDeviceType",
            "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetIndex",
            "nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlDeviceGetSupportedEventTypes",
            "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlDeviceGetComputeRunningProcesses_v3"}
    assert core <= used  # the names above are the ones this pynvml really asks for
    assert core <= _exported(sim_lib)


def test_error_strings_cover_every_code(sim_lib: Path) -> None:
    lib = ctypes.CDLL(str(sim_lib))
    lib.nvmlErrorString.restype = ctypes.c_char_p
    assert lib.nvmlErrorString(0) == b"Success"
    assert lib.nvmlErrorString(9) == b"Driver Not Loaded"
    assert lib.nvmlErrorString(15) == b"GPU is lost"
    known = [lib.nvmlErrorString(code) for code in [*range(31), 999]]
    assert all(known) and b"Unknown Error" not in known[:-1]
    assert lib.nvmlErrorString(12345) == b"Unknown Error"


def test_stubs_return_not_supported(sim_lib: Path) -> None:
    lib = ctypes.CDLL(str(sim_lib))
    # Unimplemented functions answer NOT_SUPPORTED (3) without touching their arguments.
    assert lib.nvmlDeviceGetFanSpeed(None, None) == 3
    assert lib.nvmlDeviceSetPersistenceMode(None, 0) == 3


def test_build_is_cached(sim_lib: Path) -> None:
    t = time.monotonic()
    assert simbuild.build_library() == sim_lib
    assert time.monotonic() - t < 1.0
    assert sim_lib.parent.name == simbuild.build_key(simbuild.find_compiler(), simbuild.find_header())


def test_build_names_the_missing_header(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUFLEET_NVML_H", str(tmp_path / "nvml.h"))
    with pytest.raises(simbuild.BuildError, match="apt-get install libnvidia-ml-dev"):
        simbuild.build_library()


def test_build_names_the_missing_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc-here")
    with pytest.raises(simbuild.BuildError, match="no C compiler"):
        simbuild.build_library()


def test_build_main_prints_the_path(capsys: pytest.CaptureFixture[str], sim_lib: Path) -> None:
    assert simbuild.main([]) == 0
    assert capsys.readouterr().out.strip() == str(sim_lib)
