"""gpu-feature-discovery's labels (`gpufleet.deviceplugin.gfd`): on the recorded real H200 exactly what GFD
v0.20.0 wrote there, GFD's rules for MIG, sharing and mixed nodes, who else writes `nvidia.com/`, and the
publisher's part (`labels.gfd`: auto, on, off).

The H200 test runs the device plugin's real discovery (`NvmlDeviceSource`: gpufleet.gpu's NVML reader and
sysfs) on NVML's recorded answers (`gpufleet_harness.realgpu.replay_pynvml`, from
tests/realgpu/h200-580.159.04/nvml-probe.json, copied verbatim from the lead's recording of 2026-11-28, see
tests/realgpu/README.md) and a host root holding the GPU's recorded sysfs entry (pci.txt).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dp_helpers import make_inventory, wait_for

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin import gfd
from gpufleet.deviceplugin.app import gfd_sharing
from gpufleet.deviceplugin.gfd import Sharing, gfd_labels
from gpufleet.deviceplugin.labels import GFD_MIG_NAMES, GFD_NAMES, NodePublisher, node_labels, node_patch
from gpufleet.deviceplugin.rm.model import GIB, MIB, GpuInfo, MigDeviceInfo, NodeInventory, VgpuDevice
from gpufleet_harness import realgpu

H200 = realgpu.H200


def recorded_gfd_labels() -> dict[str, str]:
    """gfd-labels.txt: what GFD v0.20.0 (--oneshot) wrote on the recorded host, `key=value` a line."""
    lines = (H200 / "gfd-labels.txt").read_text(encoding="utf-8").splitlines()
    return dict(line.split("=", 1) for line in lines if line)


@pytest.fixture
def recorded_h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeInventory]:
    """The device plugin's inventory of the recorded H200: its discovery on the replayed NVML answers."""
    from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource

    monkeypatch.setitem(sys.modules, "pynvml", realgpu.replay_pynvml(realgpu.load_probe(H200)))
    source = NvmlDeviceSource(str(realgpu.host_root(tmp_path / "host", H200)))
    try:
        yield source.inventory()
    finally:
        source.close()


# ----- the recorded H200 ----------------------------------------------------------------------------------


def test_the_recorded_h200_gets_exactly_the_labels_gfd_wrote_there(recorded_h200: NodeInventory) -> None:
    """The whole set, nothing excluded: GFD's one label that depends on the time of capture,
    nvidia.com/gfd.timestamp, is not in the recording (and the plugin never writes it)."""
    want = recorded_gfd_labels()
    assert len(want) == 25 and gfd.TIMESTAMP_LABEL not in want
    assert gfd_labels(recorded_h200) == want
    # Strategies and sharing as configured by default (what the recorded GFD ran with) give the same.
    cfg = configuration.build(environ={})
    assert gfd_labels(recorded_h200, cfg.mig_strategy, gfd_sharing(cfg)) == want


def test_the_simulated_h200_gets_the_same_labels(sim_library: str, tmp_path: Path) -> None:
    """The simulator's firecracker-vm-h200 fixture, read by the plugin's discovery through the unmodified
    pynvml in a child process (as the DaemonSet runs it), labels its node exactly as GFD labelled the real
    host: the fixture and the recording agree wherever a label looks."""
    import json
    import os
    import subprocess

    from dp_helpers import materialize_sim

    env = {**os.environ, **materialize_sim("firecracker-vm-h200", str(tmp_path / "sim"))}
    code = (
        "import json, os\n"
        "from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource\n"
        "from gpufleet.deviceplugin.gfd import gfd_labels\n"
        "source = NvmlDeviceSource(os.environ['GPUFLEET_HOST_ROOT'])\n"
        "print(json.dumps(gfd_labels(source.inventory())))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == recorded_gfd_labels()


def test_what_the_recording_says_reaches_the_labels(recorded_h200: NodeInventory) -> None:
    """The inventory holds the recorded facts the labels come from (a replay that lost one would show)."""
    (gpu,) = recorded_h200.gpus
    assert (gpu.model, gpu.memory_bytes // MIB, gpu.cc) == ("NVIDIA H200", 143771, (9, 0))
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.pci_class) == (True, False, 0x030200)
    assert gpu.virtualization_mode == 1  # passthrough, as nvidia-smi -q says (Pass-Through)
    assert (recorded_h200.driver_version, recorded_h200.cuda_driver_version) == ("580.159.04", 13000)
    assert recorded_h200.machine is None  # the microVM has no DMI: gpu.machine=unknown, as GFD wrote
    assert recorded_h200.vgpu == ()  # configuration space unread here: NVML's passthrough says no vGPU


def test_no_gpufleet_label_uses_a_gfd_name_with_another_meaning(recorded_h200: NodeInventory) -> None:
    """Where a gpufleet.io label and a GFD label share a name after the domain, the values agree on the
    real H200 (gpufleet.io/cuda.driver.major used to say 13 where GFD's says 580)."""
    ours = {k.removeprefix("gpufleet.io/"): v for k, v in node_labels(recorded_h200).items()}
    theirs = {k.removeprefix("nvidia.com/"): v for k, v in recorded_gfd_labels().items()}
    shared = sorted(set(ours) & set(theirs))
    assert shared == [
        "cuda.runtime-version.major", "cuda.runtime-version.minor", "gpu.compute.major", "gpu.compute.minor",
        "gpu.count", "gpu.memory", "gpu.product",
    ]  # fmt: skip
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    assert not any(k.startswith("cuda.driver") for k in ours)


def test_the_replay_answers_only_what_was_recorded() -> None:
    nv = realgpu.replay_pynvml(realgpu.load_probe(H200))
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetName(handle) == "NVIDIA H200"
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetNumaNodeId(handle)  # NOT_SUPPORTED in the VM, as recorded
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(realgpu.RecordingLacks, match="nvmlDeviceGetNvLinkState of GPU 0 link 1"):
        nv.nvmlDeviceGetNvLinkState(handle, 1)
    assert not hasattr(nv, "nvmlDeviceGetClockInfo")  # recorded with arguments only: not replayed


# ----- GFD's rules ----------------------------------------------------------------------------------------


def test_product_names_and_families_as_gfd_spells_them() -> None:
    assert gfd.sanitise("NVIDIA H200") == "NVIDIA-H200"
    assert gfd.sanitise("NVIDIA  GeForce RTX 4090 (D)") == "NVIDIA-GeForce-RTX-4090-D"  # dropped, not "-"
    assert gfd.sanitise("Tesla V100-SXM2-16GB") == "Tesla-V100-SXM2-16GB"
    families = {(7, 0): "volta", (7, 5): "turing", (8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada-lovelace",
                (9, 0): "hopper", (10, 0): "blackwell", (12, 0): "blackwell", (13, 0): "rubin",
                (6, 0): "pascal", (4, 0): "undefined"}  # fmt: skip
    assert {cc: gfd.family(*cc) for cc in families} == families
    assert gfd.gfd_profile("1g.18gb+me") == "1g.18gb.me"


def _gpus(n: int = 2, **kwargs: Any) -> NodeInventory:
    inv = make_inventory(n, 80)
    h200 = {"model": "NVIDIA H200", "cc": (9, 0), "pci_class": 0x030200, "mig_capable": True}
    gpus = tuple(replace(g, **h200, **kwargs) for g in inv.gpus)
    return replace(inv, gpus=gpus, driver_version="580.159.04", cuda_driver_version=13000, vgpu=())


def _mig(gpu: GpuInfo, profiles: list[str], attributes: bool = True) -> GpuInfo:
    """`gpu` in MIG mode with MIG devices of these profiles (H200's memory; attributes as NVML's)."""
    sizes = {"1g.18gb": 16384, "1g.18gb+me": 16384, "3g.71gb": 71424}
    devices = []
    for k, profile in enumerate(profiles):
        found = {"memory": sizes[profile], "multiprocessors": 16, "slices.gi": 1, "slices.ci": 1,
                 "engines.copy": 1, "engines.decoder": 1, "engines.encoder": 0, "engines.jpeg": 1,
                 "engines.ofa": int(profile.endswith("+me"))}  # fmt: skip
        known = tuple(found.items()) if attributes else ()
        mib = sizes[profile] * MIB
        devices.append(MigDeviceInfo(f"MIG-{gpu.index}-{k}", gpu.uuid, k, k + 1, 0, profile, mib, known))
    return replace(gpu, mig_enabled=True, mig_devices=tuple(devices))


def test_time_slicing_shares_the_product_unless_renamed() -> None:
    inv = _gpus()
    shared = gfd_labels(inv, sharing=Sharing("time-slicing", 4))
    assert {k: shared[k] for k in ("nvidia.com/gpu.product", "nvidia.com/gpu.replicas")} == {
        "nvidia.com/gpu.product": "NVIDIA-H200-SHARED",
        "nvidia.com/gpu.replicas": "4",
    }
    assert shared["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert shared["nvidia.com/gpu.count"] == "2"  # GPUs, not replicas
    renamed = gfd_labels(inv, sharing=Sharing("time-slicing", 4, renamed=True))
    assert renamed["nvidia.com/gpu.product"] == "NVIDIA-H200"
    one = gfd_labels(inv, sharing=Sharing("time-slicing", 1))
    assert (one["nvidia.com/gpu.replicas"], one["nvidia.com/gpu.sharing-strategy"]) == ("1", "none")
    assert gfd_labels(inv)["nvidia.com/mps.capable"] == "false"


def test_the_plugins_sharing_modes_in_gfd_terms() -> None:
    sliced = configuration.build(environ={}, file_values={"sharing.mode": "time-slicing",
                                                          "sharing.time_slicing.replicas": 3})  # fmt: skip
    assert gfd_sharing(sliced) == Sharing("time-slicing", 3, False)
    memory = configuration.build(
        environ={}, file_values={"sharing.mode": "memory", "node_name": "n", "sharing.memory.mps": True}
    )
    assert gfd_sharing(memory) == Sharing()  # GPU-memory shares: not a GFD strategy, nvidia.com/gpu unshared


def test_mixed_strategy_labels_each_profile_with_its_attributes() -> None:
    inv = _gpus()
    inv = replace(inv, gpus=(_mig(inv.gpus[0], ["1g.18gb", "1g.18gb", "1g.18gb+me"]), inv.gpus[1]))
    labels = gfd_labels(inv, "mixed")
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/gpu.count"] == "2"
    me = {k.removeprefix("nvidia.com/mig-1g.18gb.me."): v for k, v in labels.items()
          if k.startswith("nvidia.com/mig-1g.18gb.me.")}  # fmt: skip
    assert me == {
        "product": "NVIDIA-H200-MIG-1g.18gb.me", "count": "1", "replicas": "1", "sharing-strategy": "none",
        "memory": "16384", "multiprocessors": "16", "slices.gi": "1", "slices.ci": "1", "engines.copy": "1",
        "engines.decoder": "1", "engines.encoder": "0", "engines.jpeg": "1", "engines.ofa": "1",
    }  # fmt: skip
    assert labels["nvidia.com/mig-1g.18gb.count"] == "2"
    assert all(gfd.is_gfd_label(k) for k in labels)
    # Without NVML's attributes only memory (from the MIG device's memory info) joins the base labels.
    bare = replace(inv, gpus=(_mig(inv.gpus[0], ["3g.71gb"], attributes=False), inv.gpus[1]))
    assert {k for k in gfd_labels(bare, "mixed") if k.startswith("nvidia.com/mig-")} == {
        f"nvidia.com/mig-3g.71gb.{n}" for n in ("product", "count", "replicas", "sharing-strategy", "memory")
    }
    assert gfd_labels(bare, "mixed")["nvidia.com/mig-3g.71gb.memory"] == "71424"


def test_single_strategy_describes_the_mig_devices_or_says_invalid() -> None:
    inv = _gpus()
    single = replace(inv, gpus=tuple(_mig(g, ["1g.18gb"] * 7) for g in inv.gpus))
    labels = gfd_labels(single, "single")
    names = ("product", "count", "replicas", "memory", "slices.gi")
    want = ["NVIDIA-H200-MIG-1g.18gb", "14", "1", "16384", "1"]
    assert [labels[f"nvidia.com/gpu.{k}"] for k in names] == want
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)
    # One GPU in MIG mode, one not: GFD's invalid labels.
    half = replace(inv, gpus=(_mig(inv.gpus[0], ["1g.18gb"]), inv.gpus[1]))
    bad = gfd_labels(half, "single")
    names = ("product", "count", "replicas", "sharing-strategy", "memory")
    assert [bad[f"nvidia.com/gpu.{k}"] for k in names] == ["NVIDIA-H200-MIG-INVALID", "0", "0", "", "0"]
    two = replace(inv, gpus=(_mig(inv.gpus[0], ["1g.18gb"]), _mig(inv.gpus[1], ["3g.71gb"])))
    assert gfd_labels(two, "single")["nvidia.com/gpu.product"] == "NVIDIA-H200-MIG-INVALID"
    empty = replace(inv, gpus=tuple(_mig(g, []) for g in inv.gpus))
    assert gfd_labels(empty, "single")["nvidia.com/gpu.count"] == "0"
    # No GPU in MIG mode: whole GPUs, as strategy none, plus the strategy.
    plain = gfd_labels(inv, "single")
    assert plain == {**gfd_labels(inv), "nvidia.com/mig.strategy": "single"}


def test_gpus_all_in_mig_mode_are_labelled_without_sharing() -> None:
    inv = _gpus()
    labels = gfd_labels(replace(inv, gpus=tuple(_mig(g, ["1g.18gb"]) for g in inv.gpus)))
    assert (labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.count"]) == ("0", "2")
    assert "nvidia.com/mig.strategy" not in labels


def test_a_mixed_node_is_labelled_with_its_first_gpus_model() -> None:
    """GFD picks one model at random there; the plugin the first GPU's, so a selector never flaps."""
    inv = _gpus(3)
    other = replace(inv.gpus[0], model="NVIDIA H100 80GB HBM3", memory_bytes=80 * GIB)
    labels = gfd_labels(replace(inv, gpus=(other, *inv.gpus[1:])))
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.count"]) == (
        "NVIDIA-H100-80GB-HBM3",
        "1",
    )
    assert labels["nvidia.com/gpu.memory"] == str(80 * 1024)


def _cases() -> dict[str, tuple[NodeInventory, str, Sharing]]:
    """Every kind of node whose GFD labels differ from the plain one-GPU case: (inventory, MIG strategy,
    sharing, as the plugin's configuration gives it to GFD's rules (:func:`gfd_sharing`; the plugin refuses
    MIG with sharing at start, docs/deviceplugin.md "MIG")."""
    inv = _gpus(4)
    mps = configuration.build(
        environ={}, file_values={"sharing.mode": "memory", "node_name": "n", "sharing.memory.mps": True}
    )
    h100 = replace(inv.gpus[0], model="NVIDIA H100 80GB HBM3", memory_bytes=80 * GIB, cc=(9, 0))
    small = replace(inv.gpus[1], model="NVIDIA A100-SXM4-40GB", memory_bytes=40 * GIB, cc=(8, 0))
    one, two = inv.gpus[:1], inv.gpus[:2]
    single = tuple(_mig(g, ["1g.18gb"] * 7) for g in two)
    return {
        "one GPU": (replace(inv, gpus=one), "none", Sharing()),
        "four GPUs": (inv, "none", Sharing()),
        "memory shares with MPS": (inv, "none", gfd_sharing(mps)),
        "time-sliced x4": (inv, "none", Sharing("time-slicing", 4)),
        "time-sliced, renamed": (inv, "none", Sharing("time-slicing", 4, renamed=True)),
        "mixed models": (replace(inv, gpus=(h100, small, *inv.gpus[2:])), "none", Sharing()),
        "mixed models, time-sliced": (replace(inv, gpus=(small, h100)), "none", Sharing("time-slicing", 2)),
        "MIG single": (replace(inv, gpus=single), "single", Sharing()),
        "MIG single, half the GPUs": (replace(inv, gpus=(single[0], inv.gpus[1])), "single", Sharing()),
        "MIG single, two profiles": (
            replace(inv, gpus=(_mig(two[0], ["1g.18gb"]), _mig(two[1], ["3g.71gb"]))),
            "single",
            Sharing(),
        ),
        "MIG single, an empty GPU": (replace(inv, gpus=(single[0], _mig(two[1], []))), "single", Sharing()),
        "MIG single, no GPU in MIG mode": (inv, "single", Sharing()),
        "MIG mixed": (
            replace(inv, gpus=(_mig(two[0], ["1g.18gb", "1g.18gb+me", "3g.71gb"]), *inv.gpus[1:])),
            "mixed",
            Sharing(),
        ),
        "MIG mixed, two models": (
            replace(inv, gpus=(_mig(h100, ["1g.18gb"]), _mig(two[1], ["1g.18gb"]))),
            "mixed",
            Sharing(),
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_every_gpufleet_label_under_a_gfd_name_has_gfds_value(case: str) -> None:
    """Item 4 of issue 33, on every kind of node: a gpufleet.io label whose name (after the domain) GFD
    also writes carries GFD's value, and the labels with gpufleet's own meanings have names GFD never
    writes. Before, time-slicing (`-SHARED`), several models (`mixed`, the smallest memory) and an invalid
    MIG single layout (count 0, `-MIG-INVALID`) gave other values under the same names."""
    inv, strategy, sharing = _cases()[case]
    ours = {
        k.removeprefix("gpufleet.io/"): v
        for k, v in node_labels(inv, "gpufleet.io", strategy, sharing).items()
    }
    theirs = {k.removeprefix("nvidia.com/"): v for k, v in gfd_labels(inv, strategy, sharing).items()}
    named = {k for k in ours if gfd.is_gfd_label(f"nvidia.com/{k}")}
    assert {k: ours[k] for k in named} == {k: theirs.get(k) for k in named}
    assert set(ours) - named == {
        "gpu.present", "gpu.model", "gpu.nvlink", "gpu.nvswitch", "driver.version", "driver.major",
    }  # fmt: skip
    # Every GFD label of the names gpufleet writes is written: none left out where GFD has one.
    mig = {k for k in theirs if k.startswith("mig-") and k.rpartition(".")[2] in GFD_MIG_NAMES}
    assert {k for k in theirs if k in GFD_NAMES} | mig == named


def test_the_cases_cover_every_value_that_used_to_differ() -> None:
    """The cases above are the ones where gpufleet.io's values used to differ from GFD's: each differing
    value shows up in them."""
    seen = {(name, ours[f"gpufleet.io/{name}"]) for inv, strategy, sharing in _cases().values()
            for ours in [node_labels(inv, "gpufleet.io", strategy, sharing)]
            for name in ("gpu.product", "gpu.count", "gpu.memory", "gpu.model")}  # fmt: skip
    assert {
        ("gpu.product", "NVIDIA-H200-SHARED"),
        ("gpu.product", "NVIDIA-H200-MIG-INVALID"),
        ("gpu.product", "NVIDIA-H100-80GB-HBM3"),  # one model's on a node of several
        ("gpu.product", "NVIDIA-A100-SXM4-40GB-SHARED"),
        ("gpu.count", "0"),
        ("gpu.memory", "0"),
        ("gpu.count", "1"),  # the first GPU's model's GPUs on a node of several
        ("gpu.model", "mixed"),  # gpufleet's own meaning, under its own name
        ("gpu.model", "NVIDIA-H200"),  # never -SHARED or -MIG-...
    } <= seen
    assert not any(v.endswith("SHARED") or "-MIG-" in v for name, v in seen if name == "gpu.model")


def test_mode_clique_vgpu_versions_and_machine() -> None:
    inv = _gpus()
    assert gfd_labels(inv)["nvidia.com/gpu.mode"] == "compute"
    vga = replace(inv, gpus=tuple(replace(g, pci_class=0x030000) for g in inv.gpus))
    assert gfd_labels(vga)["nvidia.com/gpu.mode"] == "graphics"
    mixed_classes = replace(inv, gpus=(inv.gpus[0], replace(inv.gpus[1], pci_class=0x030000)))
    assert gfd_labels(mixed_classes)["nvidia.com/gpu.mode"] == "unknown"
    clique = "d4f7e7f5-1b2c-4d5e-8f90-0123456789ab.32766"
    fabric = replace(inv, gpus=tuple(replace(g, clique=clique) for g in inv.gpus))
    assert gfd_labels(fabric)["nvidia.com/gpu.clique"] == clique
    split = replace(fabric, gpus=(fabric.gpus[0], replace(fabric.gpus[1], clique=clique[:-1] + "7")))
    assert "nvidia.com/gpu.clique" not in gfd_labels(split)
    guest = replace(inv, vgpu=(VgpuDevice("0000:02:00.0", "550.54.10", "r550_00"),))
    assert {k: v for k, v in gfd_labels(guest).items() if "vgpu" in k} == {
        "nvidia.com/vgpu.present": "true",
        "nvidia.com/vgpu.host-driver-version": "550.54.10",
        "nvidia.com/vgpu.host-driver-branch": "r550_00",
    }
    assert not any("vgpu" in k for k in gfd_labels(replace(inv, vgpu=None)))  # could not tell: none
    two_part = gfd_labels(replace(inv, driver_version="580.65", cuda_driver_version=0))
    assert (two_part["nvidia.com/cuda.driver.rev"], two_part["nvidia.com/cuda.driver-version.revision"]) == (
        "",
        "",
    )
    assert not any(k.startswith("nvidia.com/cuda.runtime") for k in two_part)
    dgx = gfd_labels(replace(inv, machine="DGX H100 (rev 2)"))
    assert dgx["nvidia.com/gpu.machine"] == "DGX-H100-rev-2"
    assert "nvidia.com/gpu.machine" not in gfd_labels(replace(inv, machine="x" * 64))  # not a label value
    assert gfd_labels(replace(inv, gpus=())) == {}


# ----- who else writes nvidia.com/ -----------------------------------------------------------------------


def test_gfd_running_elsewhere_is_recognised() -> None:
    assert gfd.gfd_elsewhere({}, {}) == ""
    assert "GPU operator" in gfd.gfd_elsewhere({gfd.OPERATOR_GFD_LABEL: "true"}, {})
    assert gfd.gfd_elsewhere({gfd.OPERATOR_GFD_LABEL: "false"}, {}) == ""
    assert "gfd.timestamp" in gfd.gfd_elsewhere({gfd.TIMESTAMP_LABEL: "1764352179"}, {})
    nfd = {
        "nfd.node.kubernetes.io/feature-labels": "cpu-model.id,nvidia.com/gpu.product,nvidia.com/mig.capable"
    }
    assert "node-feature-discovery" in gfd.gfd_elsewhere({}, nfd)
    instance = {"gpu.nfd.node.kubernetes.io/feature-labels": "nvidia.com/cuda.driver.major"}
    assert gfd.nfd_managed(instance) == {"nvidia.com/cuda.driver.major"}
    # NFD managing other nvidia.com labels (none of GFD's) is not GFD.
    assert gfd.gfd_elsewhere({}, {"nfd.node.kubernetes.io/feature-labels": "nvidia.com/gpu.present"}) == ""


def test_the_patch_deletes_only_gfd_labels_the_plugin_wrote() -> None:
    previous = {
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "nvidia.com/mig-1g.18gb.count": "7",  # ours, gone from the new set
        "nvidia.com/mig-3g.71gb.count": "2",  # ours, but NFD manages it now
        "nvidia.com/gpu.deploy.device-plugin": "true",  # the GPU operator's
        "nvidia.com/mig.config": "all-1g.18gb",  # the MIG manager's
    }
    annotations = {
        gfd.OWNED_ANNOTATION: ",".join([*previous, "kubernetes.io/hostname"]),  # garbage is never obeyed
        gfd.NFD_FEATURE_LABELS: "nvidia.com/mig-3g.71gb.count",
    }
    patch = node_patch(
        {}, "[]", previous, "gpufleet.io", {"nvidia.com/gpu.product": "NVIDIA-H200"}, annotations
    )
    assert patch["metadata"]["labels"] == {"nvidia.com/mig-1g.18gb.count": None}
    assert patch["metadata"]["annotations"] == {
        "gpufleet.io/gpus": "[]",
        gfd.OWNED_ANNOTATION: "nvidia.com/gpu.product",
    }
    # Nothing wanted: the record goes too; gfd_labels None: nvidia.com/ is not touched at all.
    off = node_patch({}, "[]", previous, "gpufleet.io", {}, annotations)["metadata"]
    assert off["annotations"][gfd.OWNED_ANNOTATION] is None
    assert off["labels"] == {"nvidia.com/gpu.product": None, "nvidia.com/mig-1g.18gb.count": None}
    assert node_patch({}, "[]", previous, "gpufleet.io")["metadata"]["labels"] == {}


class Node:
    """A fake CoreV1Api over one node that applies merge patches (None deletes)."""

    def __init__(
        self, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
    ) -> None:
        self.labels, self.annotations = dict(labels or {}), dict(annotations or {})
        self.patches = 0

    def read_node(self, name: str) -> Any:
        return SimpleNamespace(
            metadata=SimpleNamespace(labels=dict(self.labels), annotations=dict(self.annotations))
        )

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        for have, change in (
            (self.labels, body["metadata"]["labels"]),
            (self.annotations, body["metadata"]["annotations"]),
        ):
            for key, value in change.items():
                if value is None:
                    have.pop(key, None)
                else:
                    have[key] = value
        self.patches += 1


NO_SHARING = Sharing()


def publish(node: Node, inv: NodeInventory, mode: str, sharing: Sharing = NO_SHARING) -> None:
    pub = NodePublisher(
        node, "n1", "gpufleet.io", lambda: (inv, {}), gfd_mode=lambda: mode, sharing=lambda: sharing
    )
    before = node.patches
    pub.start()
    try:
        wait_for(lambda: node.patches > before, "a patch")
    finally:
        pub.stop()


def test_the_publisher_writes_gfds_labels_where_gfd_does_not_run() -> None:
    inv = _gpus()
    node = Node()
    publish(node, inv, "auto")
    nvidia = {k: v for k, v in node.labels.items() if k.startswith("nvidia.com/")}
    assert nvidia == gfd_labels(inv)
    assert node.annotations[gfd.OWNED_ANNOTATION].split(",") == sorted(nvidia)
    assert node.labels["gpufleet.io/gpu.product"] == "NVIDIA-H200"
    # The node changes: time-sliced now; a stale label of ours would go, the new values land.
    publish(node, inv, "auto", Sharing("time-slicing", 2))
    assert node.labels["nvidia.com/gpu.product"] == "NVIDIA-H200-SHARED"
    # off: ours removed, the record too, gpufleet.io untouched.
    publish(node, inv, "off")
    assert not any(k.startswith("nvidia.com/") for k in node.labels)
    assert gfd.OWNED_ANNOTATION not in node.annotations and "gpufleet.io/gpu.count" in node.labels


def test_auto_hands_over_to_gfd_and_on_writes_anyway() -> None:
    inv = _gpus()
    node = Node()
    publish(node, inv, "auto")
    # NFD now applies GFD's labels (a subset here); the operator's GFD is scheduled on the node.
    managed = ["nvidia.com/gpu.product", "nvidia.com/gpu.count"]
    node.annotations[gfd.NFD_FEATURE_LABELS] = ",".join(managed)
    node.labels[gfd.OPERATOR_GFD_LABEL] = "true"
    publish(node, replace(inv, driver_version="580.159.05"), "auto")
    assert sorted(
        k for k in node.labels if k.startswith("nvidia.com/gpu.") and k != gfd.OPERATOR_GFD_LABEL
    ) == sorted(managed)
    assert not any(k.startswith("nvidia.com/cuda.") for k in node.labels)  # ours, not NFD's: gone
    assert gfd.OWNED_ANNOTATION not in node.annotations
    publish(node, inv, "on")  # on: written anyway (and logged as contested)
    assert {k: v for k, v in node.labels.items() if k in gfd_labels(inv)} == gfd_labels(inv)


def test_labels_gfd_is_a_setting_and_nvidia_com_is_not_a_prefix() -> None:
    assert configuration.build(environ={}).labels_gfd == "auto"
    assert configuration.build(environ={"GPUFLEET_DP_LABELS_GFD": "off"}).labels_gfd == "off"
    with pytest.raises(configuration.ConfigError, match="LABELS_GFD: expected one of auto, on, off"):
        configuration.build(environ={"GPUFLEET_DP_LABELS_GFD": "yes"})
    with pytest.raises(configuration.ConfigError, match="gpu-feature-discovery's domain"):
        configuration.build(environ={"GPUFLEET_DP_LABELS_PREFIX": "nvidia.com"})
