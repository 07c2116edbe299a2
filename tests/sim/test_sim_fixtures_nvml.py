"""Every fixture, as the unmodified pynvml sees it: identity, memory, PCI, topology, NVLink, fabric, NUMA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import machine as simmachine

FIXTURES = ["dgx-a100", "hgx-h100", "pcie-2x-t4", "esxi-vm-2x-v100", "node-40-gpus"]

# One child interpreter per fixture dumps everything the tests below check.
DUMP = """
def s(v):
    return v.decode() if isinstance(v, bytes) else v
n.nvmlInit()
count = n.nvmlDeviceGetCount()
hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
gpus = []
for i, h in enumerate(hs):
    p = n.nvmlDeviceGetPciInfo(h)
    m1 = n.nvmlDeviceGetMemoryInfo(h)
    m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    links, link_err = [], None
    for l in range(n.NVML_NVLINK_MAX_LINKS + 1):
        try:
            state = n.nvmlDeviceGetNvLinkState(h, l)
        except n.NVMLError as e:
            link_err = type(e).__name__
            break
        rp = n.nvmlDeviceGetNvLinkRemotePciInfo(h, l)
        links.append({"active": state, "remote": s(rp.busId), "remote_device_id": rp.pciDeviceId,
                      "type": n.nvmlDeviceGetNvLinkRemoteDeviceType(h, l)})
    try:
        f = n.c_nvmlGpuFabricInfo_t()
        n.nvmlDeviceGetGpuFabricInfo(h, byref(f))
        fabric = {"state": f.state, "status": f.status, "clique": f.cliqueId,
                  "uuid": bytes(f.clusterUuid).hex()}
    except n.NVMLError as e:
        fabric = type(e).__name__
    try:
        mem_aff = list(n.nvmlDeviceGetMemoryAffinity(h, 1, n.NVML_AFFINITY_SCOPE_NODE))
    except n.NVMLError as e:
        mem_aff = type(e).__name__
    try:
        mig = list(n.nvmlDeviceGetMigMode(h))
    except n.NVMLError as e:
        mig = type(e).__name__
    try:
        mig_max = n.nvmlDeviceGetMaxMigDeviceCount(h)
    except n.NVMLError as e:
        mig_max = type(e).__name__
    mig_index = [err(n.nvmlDeviceGetMigDeviceHandleByIndex, h, k) for k in (0, 6, 7)]
    gpus.append({
        "index": n.nvmlDeviceGetIndex(h), "minor": n.nvmlDeviceGetMinorNumber(h),
        "name": n.nvmlDeviceGetName(h), "uuid": n.nvmlDeviceGetUUID(h), "serial": n.nvmlDeviceGetSerial(h),
        "bus_id": s(p.busId), "bus_id_legacy": s(p.busIdLegacy), "domain": p.domain, "bus": p.bus,
        "device": p.device, "pci_device_id": p.pciDeviceId, "pci_subsystem_id": p.pciSubSystemId,
        "mem_v1": [m1.total, m1.free, m1.used], "mem_v2": [m2.total, m2.reserved, m2.free, m2.used],
        "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)), "arch": n.nvmlDeviceGetArchitecture(h),
        "brand": n.nvmlDeviceGetBrand(h), "numa_id": err(n.nvmlDeviceGetNumaNodeId, h), "mem_aff": mem_aff,
        "persistence": n.nvmlDeviceGetPersistenceMode(h), "mig": mig,
        "mig_max": mig_max, "mig_index": mig_index,
        "is_mig": getattr(n.nvmlDeviceIsMigDeviceHandle(h), "value", None),
        "topo": [n.nvmlDeviceGetTopologyCommonAncestor(h, o) for o in hs],
        "links": links, "link_err": link_err, "fabric": fabric,
        "virt": n.nvmlDeviceGetVirtualizationMode(h),
        "events": n.nvmlDeviceGetSupportedEventTypes(h),
        "by_uuid": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(h))),
        "by_bus_v2": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(s(p.busId))),
        "by_bus_legacy": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(s(p.busIdLegacy).lower())),
    })
out({"count": count, "driver": n.nvmlSystemGetDriverVersion(), "nvml": n.nvmlSystemGetNVMLVersion(),
     "cuda": n.nvmlSystemGetCudaDriverVersion(), "cuda_v2": n.nvmlSystemGetCudaDriverVersion_v2(),
     "gpus": gpus})
"""

_dumps: dict[str, Any] = {}

Roots = Callable[[str], Path]  # fixture name → sim root
Dump = Callable[[str], dict[str, Any]]  # fixture name → DUMP result


@pytest.fixture
def dump(sim_root: Roots, nvml: Callable[..., Any]) -> Callable[[str], dict[str, Any]]:
    """`dump(fixture)`: everything DUMP collects, one child process per fixture and session."""

    def get(fixture: str) -> dict[str, Any]:
        if fixture not in _dumps:
            _dumps[fixture] = nvml(sim_root(fixture), DUMP)
        return _dumps[fixture]

    return get


@pytest.mark.parametrize("fixture", FIXTURES)
def test_identity_memory_and_pci_match_the_fixture(fixture: str, dump: Dump) -> None:
    d = dump(fixture)
    m = simmachine.expand(fixture)
    assert d["count"] == len(m["gpus"])
    assert (d["driver"], d["nvml"], d["cuda"], d["cuda_v2"]) == ("535.261.03", "12.535.261.03", 12020, 12020)
    for g, e in zip(d["gpus"], m["gpus"], strict=True):
        assert g["index"] == g["minor"] == e["index"]
        assert g["name"] == e["name"]
        assert g["uuid"] == e["uuid"] == simmachine.gpu_uuid(fixture, e["index"])
        assert g["serial"] == e["serial"] and len(g["serial"]) == 13
        assert g["bus_id"] == e["bus_id"]
        assert g["bus_id_legacy"] == e["bus_id"][4:]  # 4-digit domain form
        assert (g["domain"], g["bus"], g["device"]) == (0, e["pci"]["bus"], 0)
        assert g["pci_device_id"] == e["pci"]["device_id"] and g["pci_device_id"] & 0xFFFF == 0x10DE
        assert g["pci_subsystem_id"] == e["pci"]["subsystem_id"]
        total, reserved = e["memory"]["total"], e["memory"]["reserved"]
        assert g["mem_v1"] == [total, total - reserved, reserved]
        assert g["mem_v2"] == [total, reserved, total - reserved, 0]
        assert g["cc"] == e["cuda_cc"] and g["arch"] == e["architecture"] and g["brand"] == e["brand"]
        assert g["persistence"] == 1
        assert g["by_uuid"] == g["by_bus_v2"] == g["by_bus_legacy"] == e["index"]
        assert g["events"] & 0x8  # XID critical errors


@pytest.mark.parametrize(("fixture", "count", "name", "device", "mib", "cc", "arch"), [
    ("dgx-a100", 8, "NVIDIA A100-SXM4-80GB", 0x20B2, 81920, [8, 0], 7),
    ("hgx-h100", 8, "NVIDIA H100 80GB HBM3", 0x2330, 81559, [9, 0], 9),
    ("pcie-2x-t4", 2, "Tesla T4", 0x1EB8, 15360, [7, 5], 6),
    ("esxi-vm-2x-v100", 2, "Tesla V100-PCIE-32GB", 0x1DB6, 32768, [7, 0], 5),
    ("node-40-gpus", 40, "NVIDIA L4", 0x27B8, 23034, [8, 9], 8),
])
def test_fixture_models(fixture: str, count: int, name: str, device: int, mib: int, cc: list[int], arch: int,
                        dump: Dump) -> None:
    d = dump(fixture)
    assert d["count"] == count
    assert {g["name"] for g in d["gpus"]} == {name}
    assert {g["pci_device_id"] >> 16 for g in d["gpus"]} == {device}
    assert {g["mem_v1"][0] for g in d["gpus"]} == {mib << 20}
    assert all(g["cc"] == cc and g["arch"] == arch for g in d["gpus"])
    assert len({g["uuid"] for g in d["gpus"]}) == count


def _topo(d: dict[str, Any]) -> list[list[int]]:
    return [g["topo"] for g in d["gpus"]]


def test_dgx_a100_topology_pairs_nodes_system(dump: Dump) -> None:
    t = _topo(dump("dgx-a100"))
    for i in range(8):
        for j in range(8):
            if i == j:
                want = 0
            elif i // 2 == j // 2:
                want = 10  # SINGLE: same PCIe switch
            elif i // 4 == j // 4:
                want = 40  # NODE
            else:
                want = 50  # SYSTEM
            assert t[i][j] == want, (i, j)


def test_hgx_h100_topology_node_within_socket(dump: Dump) -> None:
    t = _topo(dump("hgx-h100"))
    assert t[0][1] == t[4][7] == 40 and t[0][4] == t[3][7] == 50 and t[5][5] == 0


def test_pcie_t4_and_vm_topology(dump: Dump) -> None:
    assert _topo(dump("pcie-2x-t4")) == [[0, 40], [40, 0]]  # separate host bridges, one NUMA node
    assert _topo(dump("esxi-vm-2x-v100")) == [[0, 30], [30, 0]]  # PHB under VMware's host bridge


def test_node_40_topology_levels(dump: Dump) -> None:
    t = _topo(dump("node-40-gpus"))
    assert t[0][4] == 10 and t[0][5] == 40 and t[0][10] == 50 and t[39][35] == 10


@pytest.mark.parametrize("fixture", FIXTURES)
def test_topology_is_symmetric_and_matches_machine_json(fixture: str,
                                                        dump: Dump) -> None:
    t = _topo(dump(fixture))
    assert t == simmachine.expand(fixture)["topology"]
    assert all(t[i][j] == t[j][i] for i in range(len(t)) for j in range(len(t)))


def test_dgx_a100_nvlinks_two_per_switch(dump: Dump) -> None:
    d = dump("dgx-a100")
    switches = [f"00000000:{b:02X}:00.0" for b in (0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9)]
    for g in d["gpus"]:
        # link 12 is past the end
        assert len(g["links"]) == 12 and g["link_err"] == "NVMLError_InvalidArgument"
        assert [link["remote"] for link in g["links"]] == [s for s in switches for _ in range(2)]
        assert all(link["active"] == 1 and link["type"] == 2 for link in g["links"])
        assert {link["remote_device_id"] for link in g["links"]} == {0x1AF110DE}
        assert g["fabric"] == "NVMLError_NotSupported"  # Ampere
        assert g["mig"] == [0, 0]


@pytest.mark.parametrize("fixture", ["dgx-a100", "hgx-h100"])
def test_mig_device_handle_by_index_is_not_found_on_mig_gpus(fixture: str, dump: Dump) -> None:
    """nvml.h: NOT_FOUND "if no valid MIG device was found at index" (consumers skip those),
    INVALID_ARGUMENT for an index past the maximum; the handles themselves are full GPUs."""
    for g in dump(fixture)["gpus"]:
        assert g["mig_max"] == 0  # nvml.h: zero while MIG is not enabled (the fixtures start with it off)
        assert g["mig_index"] == ["NVMLError_NotFound", "NVMLError_NotFound", "NVMLError_InvalidArgument"]
        assert g["is_mig"] == 0


def test_hgx_h100_nvlinks_and_fabric(dump: Dump) -> None:
    d = dump("hgx-h100")
    uuids = set()
    for g in d["gpus"]:
        remotes = [link["remote"][9:11] for link in g["links"]]
        assert len(g["links"]) == 18
        assert remotes == ["E5"] * 5 + ["E6"] * 4 + ["E7"] * 4 + ["E8"] * 5
        assert g["fabric"]["state"] == 3 and g["fabric"]["status"] == 0 and g["fabric"]["clique"] == 32766
        uuids.add(g["fabric"]["uuid"])
    assert len(uuids) == 1 and uuids != {"0" * 32}  # one cluster


@pytest.mark.parametrize("fixture", ["pcie-2x-t4", "esxi-vm-2x-v100", "node-40-gpus"])
def test_pcie_fixtures_have_no_nvlink_fabric_or_mig(fixture: str, dump: Dump) -> None:
    for g in dump(fixture)["gpus"]:
        assert g["links"] == [] and g["link_err"] == "NVMLError_NotSupported"
        assert g["fabric"] == "NVMLError_NotSupported"
        assert g["mig"] == "NVMLError_NotSupported"
        assert g["mig_index"] == ["NVMLError_NotSupported"] * 3  # "not supported by the device"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_numa(fixture: str, dump: Dump, sim_root: Roots) -> None:
    """GetNumaNodeId is for GPU-memory NUMA nodes only; the CPU node matches sysfs and memory affinity."""
    root = sim_root(fixture)
    for g in dump(fixture)["gpus"]:
        assert g["numa_id"] == "NVMLError_NotSupported"
        sysfs = int((root / "host/sys/bus/pci/devices" / simmachine.sysfs_name(g["bus_id"]) / "numa_node")
                    .read_text())
        if sysfs < 0:  # no node of its own: every node of the host (the real H200 VM: node 0, its only one)
            assert g["mem_aff"] == [(1 << simmachine.expand(fixture)["host"]["numa_nodes"]) - 1]
        else:
            assert g["mem_aff"] == [1 << sysfs]


def test_numa_nodes_per_fixture(sim_root: Roots) -> None:
    def nodes(fixture: str) -> list[int]:
        m = simmachine.expand(fixture)
        return [g["numa_node"] for g in m["gpus"]]

    assert nodes("dgx-a100") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes("hgx-h100") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes("pcie-2x-t4") == [0, 0]
    assert nodes("esxi-vm-2x-v100") == [-1, -1]
    assert sorted(set(nodes("node-40-gpus"))) == [0, 1, 2, 3]


def test_vm_is_passthrough(dump: Dump) -> None:
    assert {g["virt"] for g in dump("esxi-vm-2x-v100")["gpus"]} == {1}  # PASSTHROUGH
    assert {g["virt"] for g in dump("dgx-a100")["gpus"]} == {0}
    assert [g["bus_id"] for g in dump("esxi-vm-2x-v100")["gpus"]] == ["00000000:0B:00.0", "00000000:13:00.0"]


def test_extras_nvidia_smi_and_device_plugins_read(sim_root: Roots, nvml: Callable[..., Any]) -> None:
    r = nvml(sim_root("dgx-a100"), """
        n.nvmlInit()
        h0, h1, h4 = (n.nvmlDeviceGetHandleByIndex(i) for i in (0, 1, 4))
        READ = 0  # pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (a stray comma)
        near = [n.nvmlDeviceGetIndex(h) for h in n.nvmlDeviceGetTopologyNearestGpus(h0, n.NVML_TOPOLOGY_NODE)]
        cpus = list(n.nvmlDeviceGetCpuAffinity(h4, 4))
        small = ctypes.create_string_buffer(8)
        short = n.nvmlLib.nvmlDeviceGetName(h0, small, ctypes.c_uint(8))
        out({"near": near, "cpus": cpus, "short": short,
             "p2p_pcie": [n.nvmlDeviceGetP2PStatus(h0, h, READ) for h in (h1, h4)],
             "p2p_nvlink": n.nvmlDeviceGetP2PStatus(h0, h4, n.NVML_P2P_CAPS_INDEX_NVLINK),
             "temp": n.nvmlDeviceGetTemperature(h0, n.NVML_TEMPERATURE_GPU),
             "power": [n.nvmlDeviceGetPowerUsage(h0), n.nvmlDeviceGetEnforcedPowerLimit(h0)],
             "util": [n.nvmlDeviceGetUtilizationRates(h0).gpu, n.nvmlDeviceGetUtilizationRates(h0).memory],
             "modes": [n.nvmlDeviceGetComputeMode(h0), n.nvmlDeviceGetDisplayMode(h0),
                       list(n.nvmlDeviceGetEccMode(h0)), n.nvmlDeviceGetPerformanceState(h0)],
             "ecc": n.nvmlDeviceGetTotalEccErrors(h0, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                  n.NVML_VOLATILE_ECC),
             "procs": [n.nvmlDeviceGetComputeRunningProcesses(h0),
                       n.nvmlDeviceGetGraphicsRunningProcesses(h0)],
             "clocks": [n.nvmlDeviceGetClockInfo(h0, n.NVML_CLOCK_SM),
                        n.nvmlDeviceGetMaxClockInfo(h0, n.NVML_CLOCK_SM)],
             "ids": [n.nvmlDeviceGetBoardPartNumber(h0), n.nvmlDeviceGetVbiosVersion(h0),
                     n.nvmlDeviceGetInforomVersion(h0, n.NVML_INFOROM_OEM)],
             "fan": err(n.nvmlDeviceGetFanSpeed, h0)})
    """)
    assert r["near"] == [1, 2, 3]  # same NUMA node or closer
    assert r["cpus"][:2] == [0, 0] and r["cpus"][2] == r["cpus"][3] == 2**64 - 1  # CPUs 128-255
    assert r["short"] == 7  # NVML_ERROR_INSUFFICIENT_SIZE
    assert r["p2p_pcie"] == [0, 0] and r["p2p_nvlink"] == 0  # through the NVSwitch fabric
    assert 20 <= r["temp"] <= 90 and 0 < r["power"][0] < r["power"][1] == 400000
    assert r["util"] == [0, 0] and r["modes"] == [0, 0, [1, 1], 0] and r["ecc"] == 0
    assert r["procs"] == [[], []] and r["clocks"] == [210, 1410]
    assert r["ids"] == ["692-2G506-0210-002", "92.00.45.00.06", "2.1"]
    assert r["fan"] == "NVMLError_NotSupported"  # SXM boards have no fan: a generated stub


def test_t4_pcie_p2p_across_host_bridges_is_refused(sim_root: Roots, nvml: Callable[..., Any]) -> None:
    r = nvml(sim_root("pcie-2x-t4"), """
        n.nvmlInit()
        a, b = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
        out([n.nvmlDeviceGetP2PStatus(a, b, 0),  # NVML_P2P_CAPS_INDEX_READ
             n.nvmlDeviceGetP2PStatus(a, b, n.NVML_P2P_CAPS_INDEX_NVLINK)])
    """)
    assert r == [1, 5]  # CHIPSET_NOT_SUPPORTED, NOT_SUPPORTED
