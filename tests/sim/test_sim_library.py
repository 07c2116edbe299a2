"""The built library: exported symbols, stubs, the build cache and its error messages."""

from __future__ import annotations

import ctypes
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet_harness.sim import build as simbuild

DEBIAN_HEADER = Path("/usr/include/nvml.h")


def _header_functions(header: Path | None = None) -> list[str]:
    text = (header or simbuild.find_header()).read_text(errors="replace")
    return sorted(set(re.findall(r"\bDECLDIR\s+\*?\s*(nvml\w+)\s*\(", text)))


# Calls the simulator implements that Debian's 11.8 header does not declare (it declares their prototypes
# itself, with layouts from pynvml's ctypes structures): exported whichever header it is built against.
NEWER_THAN_11_8 = {
    "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetPdi",
    "nvmlDeviceGetRepairStatus", "nvmlDeviceGetAddressingMode", "nvmlDeviceGetC2cModeInfoV",
    "nvmlDeviceGetPlatformInfo",
    "nvmlSystemGetDriverBranch", "nvmlDeviceGetConfComputeMemSizeInfo", "nvmlDeviceGetModuleId",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetSupportedClocksEventReasons",
}


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


def test_exports_are_exactly_the_header_functions_plus_the_implemented(sim_lib: Path) -> None:
    """The export count covers every function the chosen header declares, and nothing else but the few
    implemented names a header may lack (nvmlErrorString; fabric/NUMA calls on the 11.8 header)."""
    gen = simbuild._gen_stubs_module()
    header = simbuild.find_header()
    declared = set(gen.header_names(header.read_text(errors="replace")))
    sources = [p.read_text() for p in sorted(simbuild.NATIVE_DIR.glob("*.c"))]
    implemented = gen.implemented_names(sources)
    _, stubbed = gen.stubs_source(header.read_text(errors="replace"), sources)
    exported = _exported(sim_lib)
    assert exported == declared | implemented
    assert len(exported) == len(declared) + len(implemented - declared)
    assert set(stubbed) == declared - implemented
    assert implemented - declared <= {"nvmlErrorString", "nvmlDeviceGetNumaNodeId", *NEWER_THAN_11_8}


def test_header_order_env_then_package_then_debian(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "nvml.h"
    fake.write_text("/* empty */\n")
    monkeypatch.setenv("GPUFLEET_NVML_H", str(fake))
    assert simbuild.find_header() == fake
    monkeypatch.delenv("GPUFLEET_NVML_H")
    packaged = simbuild.packaged_header()
    if packaged is not None:
        assert packaged.name == "nvml.h" and "site-packages" in str(packaged)
        assert simbuild.find_header() == packaged
    monkeypatch.setattr(simbuild, "packaged_header", lambda: None)
    monkeypatch.setattr(simbuild, "DEFAULT_HEADER", fake)
    assert simbuild.find_header() == fake


def test_packaged_header_is_the_newest_api() -> None:
    packaged = simbuild.packaged_header()
    if packaged is None:
        pytest.skip("nvidia-nvml-dev is not installed (pip install -e .[harness])")
    m = re.search(r"#define\s+NVML_API_VERSION\s+(\d+)", packaged.read_text(errors="replace"))
    assert m and int(m.group(1)) >= 13
    names = _header_functions(packaged)
    # MIG and the handle/fabric calls NVIDIA's k8s-device-plugin links are declared there.
    assert {"nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuFabricInfoV",
            "nvmlDeviceGetHandleByUUIDV", "nvmlDeviceGetGpuInstanceProfileInfoV", "nvmlInit",
            "nvmlDeviceGetPciInfo"} <= set(names)
    if DEBIAN_HEADER.is_file():
        assert len(names) > len(_header_functions(DEBIAN_HEADER))


@pytest.mark.parametrize("which", ["debian", "package"])
def test_builds_with_werror_against_both_headers(which: str, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    header = DEBIAN_HEADER if which == "debian" else simbuild.packaged_header()
    if header is None or not header.is_file():
        pytest.skip(f"no {which} nvml.h here")
    monkeypatch.setenv("GPUFLEET_NVML_H", str(header))
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    lib = simbuild.build_library()
    assert lib.is_relative_to(tmp_path)
    assert "-Werror" in simbuild.CFLAGS
    exported = _exported(lib)
    assert set(_header_functions(header)) <= exported
    assert {"nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetMigDeviceHandleByIndex",
            "nvmlErrorString", *NEWER_THAN_11_8} <= exported
