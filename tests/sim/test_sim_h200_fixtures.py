"""The H200 fixtures (the recorded VM and the HGX board derived from it), the getters added for them on the
other fixtures, MIG device attributes, and the fixtures the simulator refuses."""

from __future__ import annotations

import json
import os
import re
import stat
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_sim_h200_contract import compare, run_probe

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import miglayout

RECORDING = Path(__file__).resolve().parents[1] / "realgpu" / "h200-580.159.04"
Roots = Callable[[str], Path]
Runner = Callable[..., Any]


def recorded(name: str) -> str:
    """A recorded command's output without the recorder's trailing `rc=N` line."""
    text = (RECORDING / name).read_text()
    return re.sub(r"rc=\d+\n\Z", "", text)


# -- the recorded VM's host files ------------------------------------------------------------------------


def test_vm_host_files_are_the_recorded_ones(sim_root: Roots) -> None:
    root = sim_root("firecracker-vm-h200")
    host = root / "host"
    info = host / "proc/driver/nvidia/gpus/0000:00:06.0/information"
    assert f"## /{info.relative_to(host)}\n{info.read_text()}" == recorded("proc-gpus.txt")
    assert (host / "proc/driver/nvidia/version").read_text() == recorded("proc-version.txt")
    dev = host / "sys/bus/pci/devices/0000:00:06.0"
    values = {f: (dev / f).read_text().strip() for f in ("class", "device", "numa_node")}
    line = f"/sys/bus/pci/devices/0000:00:06.0 class={values['class']} device={values['device']} " \
           f"numa={values['numa_node']} driver=nvidia\n"
    assert line == recorded("pci.txt")
    assert (dev / "driver").resolve().name == "nvidia"
    # /dev as `ls -l` showed it: no nvidia-modeset in the VM, nvidia-uvm on major 238, the two MIG caps
    names = {p.name for p in (host / "dev").iterdir()}
    assert {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"} <= names
    assert "nvidia-modeset" not in names
    uvm = (host / "dev/nvidia-uvm").lstat()
    if stat.S_ISCHR(uvm.st_mode):  # mknod allowed here
        assert os.major(uvm.st_rdev) == 238
        assert os.major((host / "dev/nvidia-caps/nvidia-cap1").lstat().st_rdev) == 241
    assert not (host / "sys/class/dmi").exists() and not (host / "sys/firmware/efi").exists()
    assert (host / "proc/sys/kernel/osrelease").read_text() == "6.18.44-fc-v657-gpu\n"
    assert "hypervisor" in (host / "proc/cpuinfo").read_text()


def test_vm_machine_document(sim_root: Roots) -> None:
    m = simmachine.load_machine(sim_root("firecracker-vm-h200"))
    assert (m["driver_version"], m["nvml_version"], m["cuda_driver_version"], m["driver_branch"]) == (
        "580.159.04", "13.580.159.04", 13000, "r582_49")
    (g,) = m["gpus"]
    assert g["numa_node"] == -1 and g["persistence_mode"] == 1
    assert g["mig_mode"] == {"current": 0, "pending": 0}
    assert g["memory"] == {"total": 150754820096, "reserved": 644939776, "used": 0}
    assert g["bar1"] == {"total": 262144 << 20, "used": 1703936}
    assert [p["name"] for p in g["mig"]["profiles"]] == [
        "1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert g["fabric"] == {} and g["nvlinks"] == [] and m["nvswitches"] == []


# -- the HGX H200 ----------------------------------------------------------------------------------------


def test_hgx_h200_is_the_recorded_model_on_an_nvswitch_board(sim_root: Roots, nvml: Runner) -> None:
    vm = simmachine.expand("firecracker-vm-h200")["gpus"][0]
    hgx = simmachine.expand("hgx-h200")
    model = ("name", "pci", "memory", "bar1", "board_part_number", "vbios_version", "inforom_image_version",
             "cuda_cores", "memory_bus_width", "supported_events", "max_clocks", "mig")
    for g in hgx["gpus"]:
        assert {k: g[k] for k in model if k != "pci"} == {k: vm[k] for k in model if k != "pci"}
        assert (g["pci"]["device_id"], g["pci"]["subsystem_id"]) == (vm["pci"]["device_id"],
                                                                    vm["pci"]["subsystem_id"])
    assert len({g["uuid"] for g in hgx["gpus"]} | {vm["uuid"]}) == 9  # the recorded GPU's identity stays its
    assert [g["module_id"] for g in hgx["gpus"]] == list(range(1, 9))
    assert hgx["fabricmanager_required"] and len(hgx["nvswitches"]) == 4
    r = nvml(sim_root("hgx-h200"), """
        n.nvmlInit()
        got = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            f = n.c_nvmlGpuFabricInfo_t()
            n.nvmlDeviceGetGpuFabricInfo(h, byref(f))
            links = [n.nvmlDeviceGetNvLinkRemoteDeviceType(h, k) for k in range(18)]
            got.append([n.nvmlDeviceGetName(h), f.state, f.status, f.cliqueId, links,
                        n.nvmlDeviceGetNvLinkVersion(h, 0), n.nvmlDeviceGetModuleId(h),
                        n.nvmlDeviceGetTopologyCommonAncestor(h, n.nvmlDeviceGetHandleByIndex(0))])
        out([n.nvmlSystemGetNVMLVersion(), got])
    """)
    version, gpus = r
    assert version == "13.580.159.04"
    for i, (name, state, status, clique, links, nvlink, module, topo) in enumerate(gpus):
        assert name == "NVIDIA H200" and (state, status, clique) == (3, 0, 32766)  # COMPLETED, SUCCESS
        assert links == [2] * 18 and nvlink == 4 and module == i + 1
        assert topo == (0 if i == 0 else 40 if i < 4 else 50)


# -- the contract against the other header ---------------------------------------------------------------


def test_contract_holds_when_built_against_debians_11_8_header(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls newer than the 11.8 header take the simulator's own structs there: same answers, except
    two calls that header does not declare and the H200 does not support: not exported at all there (what a
    consumer of the real 11.8-era library would see too), so pynvml cannot find them."""
    header = Path("/usr/include/nvml.h")
    assert header.is_file(), "Debian's libnvidia-ml-dev (/usr/include/nvml.h) is needed for this test"
    monkeypatch.setenv("GPUFLEET_NVML_H", str(header))
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path / "cache"))
    lib = simbuild.build_library()
    root = simmachine.materialize("firecracker-vm-h200", tmp_path / "root", library=lib)
    real = json.loads((RECORDING / "nvml-probe.json").read_text())
    assert compare(real, run_probe(root)) == [
        f"devices[0]/{name}: recorded ('err', 'NVML_ERROR_NOT_SUPPORTED'), simulated "
        "('err', 'NVML_ERROR_FUNCTION_NOT_FOUND')"
        for name in ("nvmlDeviceGetDramEncryptionMode", "nvmlDeviceGetHostname_v1")]
    declared = header.read_text(errors="replace")
    assert "nvmlDeviceGetDramEncryptionMode" not in declared and "nvmlDeviceGetHostname_v1" not in declared


# -- the new getters on the other fixtures ---------------------------------------------------------------

GETTERS = """
def s(v):
    return v.decode() if isinstance(v, bytes) else v
def one(h):
    def c2c():
        return n.nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled
    def platform():
        p = n.c_nvmlPlatformInfo_v2_t()
        p.version = n.nvmlPlatformInfo_v2
        n.nvmlDeviceGetPlatformInfo(h, byref(p))
        return [ord(p.hostId), ord(p.moduleId)]
    def cc():
        i = n.nvmlDeviceGetConfComputeMemSizeInfo(h)
        return [i.protectedMemSizeKib, i.unprotectedMemSizeKib]
    def fabric():
        f = n.c_nvmlGpuFabricInfo_v3_t()
        f.version = n.nvmlGpuFabricInfo_v3
        n.nvmlDeviceGetGpuFabricInfoV(h, byref(f))
        return [f.state, f.status]
    def bar1():
        b = n.nvmlDeviceGetBAR1MemoryInfo(h)
        return [b.bar1Total, b.bar1Used, b.bar1Free]
    calls = {"c2c": c2c, "platform": platform, "cc": cc, "bar1": bar1,
             "addressing": lambda: n.nvmlDeviceGetAddressingMode(h),
             "remapped": lambda: list(n.nvmlDeviceGetRemappedRows(h)),
             "repair": lambda: n.nvmlDeviceGetRepairStatus(h),
             "energy": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
             "decoder": lambda: n.nvmlDeviceGetDecoderUtilization(h),
             "cores": lambda: n.nvmlDeviceGetNumGpuCores(h),
             "width": lambda: n.nvmlDeviceGetMemoryBusWidth(h),
             "gsp": lambda: n.nvmlDeviceGetGspFirmwareMode(h),
             "gsp_version": lambda: s(n.nvmlDeviceGetGspFirmwareVersion(h)),
             "pcie": lambda: [n.nvmlDeviceGetCurrPcieLinkGeneration(h), n.nvmlDeviceGetPcieLinkMaxSpeed(h),
                              n.nvmlDeviceGetPcieSpeed(h)],
             "board": lambda: [n.nvmlDeviceGetBoardId(h), n.nvmlDeviceGetIrqNum(h),
                               n.nvmlDeviceGetBusType(h)],
             "fabric": fabric,
             "branch": lambda: s(n.nvmlSystemGetDriverBranch().branch)}
    got = {}
    for k, f in calls.items():
        try:
            got[k] = f()
        except n.NVMLError as e:
            got[k] = type(e).__name__
    return got
n.nvmlInit()
"""


def getters(nvml: Runner, root: Path, code: str = "out(one(n.nvmlDeviceGetHandleByIndex(0)))") -> Any:
    return nvml(root, GETTERS + textwrap.dedent(code))


def test_older_generations_lack_the_newer_getters(sim_root: Roots, nvml: Runner) -> None:
    """Per nvml.h's "For <architecture> or newer": Volta lacks addressing mode, Turing remapped rows and
    repair status, Ampere the C2C and platform calls; a 535 driver reports no branch."""
    ns = "NVMLError_NotSupported"
    v100 = getters(nvml, sim_root("esxi-vm-2x-v100"))
    t4 = getters(nvml, sim_root("pcie-2x-t4"))
    a100 = getters(nvml, sim_root("dgx-a100"))
    lacking = ("addressing", "remapped", "repair", "c2c", "platform", "cc", "branch")
    assert [v100[k] for k in lacking] == [ns] * 7
    assert isinstance(v100["energy"], int) and v100["energy"] > 0
    assert t4["addressing"] == 0 and [t4[k] for k in ("remapped", "repair", "c2c", "platform")] == [ns] * 4
    assert t4["pcie"] == [3, 3, 8000] and t4["cores"] == 2560 and t4["width"] == 256
    assert a100["remapped"] == [0, 0, 0, 0] and a100["repair"] == [0, 0] and a100["cc"][0] == 0
    assert [a100[k] for k in ("c2c", "platform", "fabric")] == [ns] * 3
    assert a100["gsp"] == [0, 0] and a100["gsp_version"] == ns  # GSP firmware: the fixtures say Hopper on
    assert a100["pcie"] == [4, 4, 16000] and a100["board"] == [0x700, 80, 2]  # bus 07, PCIe
    gib = 1 << 30
    assert a100["bar1"][0] == 128 * gib and a100["bar1"][0] == a100["bar1"][1] + a100["bar1"][2]


def test_h100_answers_the_hopper_getters(sim_root: Roots, nvml: Runner) -> None:
    h100 = getters(nvml, sim_root("hgx-h100"))
    assert h100["c2c"] == 0 and h100["platform"] == [1, 1] and h100["gsp"] == [1, 1]
    assert h100["gsp_version"] == "535.261.03" and h100["branch"] == "NVMLError_NotSupported"
    assert h100["pcie"] == [5, 5, 32000]


def test_energy_only_grows_with_power(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("hgx-h200"), """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        first = n.nvmlDeviceGetTotalEnergyConsumption(h)
        t0 = time.monotonic()
        time.sleep(0.3)
        second = n.nvmlDeviceGetTotalEnergyConsumption(h)
        out([first, second, time.monotonic() - t0, n.nvmlDeviceGetPowerUsage(h)])
    """)
    first, second, seconds, power_mw = r
    assert first < second
    # mJ gained over the interval is the power (mW) times the time, within the 1 ms clock step
    assert abs((second - first) - power_mw * seconds) <= power_mw * 0.05


# -- MIG devices' attributes -----------------------------------------------------------------------------


def test_mig_devices_have_attributes_full_gpus_do_not(fresh_root: Roots, nvml: Runner) -> None:
    """nvml.h: nvmlDeviceGetAttributes "currently only supports MIG device handles": per MIG device, its
    GPU instance's engines, slices and memory and its compute instance's SMs."""
    root = fresh_root("firecracker-vm-h200")
    r = nvml(root, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        full = err(n.nvmlDeviceGetAttributes, h)
        n.nvmlDeviceSetMigMode(h, 1)
        gi3 = n.nvmlDeviceCreateGpuInstance(h, 9)     # 3g.71gb
        n.nvmlGpuInstanceCreateComputeInstance(gi3, 1)  # a 2c of it
        n.nvmlGpuInstanceCreateComputeInstance(gi3, 0)  # and a 1c
        gi1 = n.nvmlDeviceCreateGpuInstance(h, 15)    # 1g.35gb
        n.nvmlGpuInstanceCreateComputeInstance(gi1, 0)
        got = []
        for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except n.NVMLError_NotFound:
                continue
            a = n.nvmlDeviceGetAttributes(m)
            name = n.nvmlDeviceGetName(m)
            got.append([name.decode() if isinstance(name, bytes) else name, a.multiprocessorCount,
                        a.sharedCopyEngineCount, a.sharedDecoderCount, a.sharedJpegCount, a.sharedOfaCount,
                        a.gpuInstanceSliceCount, a.computeInstanceSliceCount, a.memorySizeMB])
        out([full, got])
    """)
    full, got = r
    assert full == "NVMLError_NotSupported"
    assert sorted(got) == sorted([
        ["NVIDIA H200 MIG 1c.3g.71gb", 16, 3, 3, 3, 0, 3, 1, 71424],
        ["NVIDIA H200 MIG 2c.3g.71gb", 32, 3, 3, 3, 0, 3, 2, 71424],
        ["NVIDIA H200 MIG 1g.35gb", 26, 1, 1, 1, 0, 1, 1, 33280],
    ])


def test_miglayout_takes_the_gpus_own_profile_names(fresh_root: Roots) -> None:
    root = fresh_root("firecracker-vm-h200")
    made = miglayout.make_layout(root, {0: ["1g.18gb", "3g.71gb"]})[0]
    assert sorted(d["mem"] >> 20 for d in made) == [16384, 71424]


def test_miglayout_refuses_a_profile_the_gpu_does_not_offer(fresh_root: Roots) -> None:
    root = fresh_root("firecracker-vm-h200")
    with pytest.raises(miglayout.LayoutError) as e:
        miglayout.make_layout(root, {0: ["1g.10gb"]})
    assert str(e.value) == ("GPU 0 (NVIDIA H200) has no MIG profile '1g.10gb'; it offers 1g.18gb, "
                            "1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb")
    assert not (root / "mig").exists()  # refused before MIG was turned on
    with pytest.raises(miglayout.LayoutError, match="has GPUs 0-0"):
        miglayout.make_layout(root, {3: ["1g.18gb"]})
    t4 = fresh_root("pcie-2x-t4")
    with pytest.raises(miglayout.LayoutError, match=re.escape("GPU 1 (Tesla T4) has no MIG profile '1g.5gb'; "
                                                              "it has no MIG")):
        miglayout.make_layout(t4, {1: ["1g.5gb"]})


# -- fixtures the simulator refuses ----------------------------------------------------------------------

VM = (simmachine.FIXTURE_DIR / "firecracker-vm-h200.yaml").read_text()


def _expand_text(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "fixture.yaml"
    path.write_text(text)
    return simmachine.expand(path)


@pytest.mark.parametrize("field", simmachine.IDENTITY_FIELDS)
def test_a_fixture_without_an_identity_field_is_refused_naming_it(tmp_path: Path, field: str) -> None:
    text = re.sub(rf"^  {field}: .*\n", "", VM, count=1, flags=re.M)
    assert text != VM
    with pytest.raises(simmachine.FixtureError, match=rf"fixture: gpu\.{field} is missing: every fixture "
                                                      r"names the GPU's identity \(name, pci_device_id"):
        _expand_text(tmp_path, text)


def test_a_fixture_without_its_memory_size_is_refused(tmp_path: Path) -> None:
    text = VM.replace("  memory_bytes: 150754820096                 # 143771 MiB\n", "")
    with pytest.raises(simmachine.FixtureError, match=r"gpu\.memory_mib \(or gpu\.memory_bytes\) is missing"):
        _expand_text(tmp_path, text)


@pytest.mark.parametrize(("old", "new", "message"), [
    ('      serial: "1654024075654"\n', "",
     r"gpus\[0\]\.identity\.serial is missing: a recorded GPU's identity needs uuid and serial"),
    ("      uuid: GPU-3710040f-331e-b1cd-ae09-04a71f007081\n", "", r"gpus\[0\]\.identity\.uuid is missing"),
    ("GPU-3710040f", "GPU-3710040F", r"identity\.uuid must look like GPU-xxxxxxxx"),
    ('"1654024075654"', '"16540-24075654"', r"identity\.serial must be digits"),
    ("      irq: 41\n", "      irq: 41\n      colour: blue\n",
     r"unknown field\(s\) colour; known: uuid, serial"),
    ("  - buses: [0x00]\n", "  - buses: [0x00, 0x01]\n", r"identity describes one GPU; the group has 2"),
])
def test_a_recorded_identity_is_checked(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in VM
    with pytest.raises(simmachine.FixtureError, match=message):
        _expand_text(tmp_path, VM.replace(old, new, 1))


def test_like_names_another_bundled_fixture(tmp_path: Path) -> None:
    hgx = (simmachine.FIXTURE_DIR / "hgx-h200.yaml").read_text()
    with pytest.raises(simmachine.FixtureError, match=r"gpu\.like must name another bundled fixture .*"
                                                      r"got 'no-such-gpu'"):
        _expand_text(tmp_path, hgx.replace("like: firecracker-vm-h200", "like: no-such-gpu"))
    # what the fixture gives itself wins over the copied model
    m = _expand_text(tmp_path, hgx.replace("  like: firecracker-vm-h200", "  like: firecracker-vm-h200\n"
                                                                          "  power_limit_w: 600"))
    assert {g["power_limit_mw"] for g in m["gpus"]} == {600000}
    assert {g["name"] for g in m["gpus"]} == {"NVIDIA H200"}
