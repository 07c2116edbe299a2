"""The pure decision function: sizing rules, host decisions, and the full VM-settings matrix."""

from __future__ import annotations

import itertools

import pytest
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    KEY_HIDE_HYPERVISOR,
    KEY_MMIO_SIZE,
    KEY_USE_64BIT_MMIO,
    GpuRequest,
    Options,
    PlanError,
    describe_state,
    mmio_size_gb,
    normalize_pci_id,
    plan,
    required_memory_mb,
    signed16,
    unsigned16,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_vsphere import host_pci
from esxi_lab import A100_80GB, RTX_2080_TI, make_lab
from esxi_standin import HOST_SYSTEM_ID, apply_spec
from pyVmomi import SoapAdapter, vim

TWO_A100 = (GpuRequest(memory_gb=80, pci_id="0000:3b:00.0"), GpuRequest(memory_gb=80, pci_id="0000:5e:00.0"))


# --- sizing rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_memory", "expected"),
    [
        ([16], 32),  # one 16 GB V100: 2 x 16 = 32, already a power of two
        ([16, 16], 64),  # VMware's worked example: two 16 GB GPUs -> 64
        ([24, 24], 128),  # two 24 GB cards: 96 -> 128
        ([11], 32),  # RTX 2080 Ti from the seed walkthrough: 22 -> 32
        ([32, 32], 128),  # the seed's V100 + V100S (32 GB each)
        ([80], 256),
        ([80] * 8, 2048),  # HGX A100 80GB, all eight in one VM
        ([1], 2),
    ],
)
def test_mmio_size_follows_the_documented_examples(gpu_memory: list[int], expected: int) -> None:
    assert mmio_size_gb(sum(gpu_memory)) == expected


def test_mmio_size_is_the_smallest_power_of_two_at_least_twice_the_gpu_memory() -> None:
    for total in range(1, 4097):
        size = mmio_size_gb(total)
        assert size & (size - 1) == 0, total
        assert size >= 2 * total, total
        assert size // 2 < 2 * total, total


def test_mmio_size_rejects_no_memory() -> None:
    with pytest.raises(PlanError):
        mmio_size_gb(0)


@pytest.mark.parametrize(
    ("gpu_gb", "memory_mb"), [(1, 2048), (11, 17408), (16, 24576), (80, 122880), (160, 245760)]
)
def test_required_memory_is_one_and_a_half_times_rounded_up_to_a_gb(gpu_gb: int, memory_mb: int) -> None:
    assert required_memory_mb(gpu_gb) == memory_mb


def test_required_memory_is_the_smallest_whole_gb_covering_one_and_a_half_times() -> None:
    for total in range(1, 2049):
        mb = required_memory_mb(total)
        assert mb % 1024 == 0
        assert 2 * mb >= 3 * total * 1024
        assert 2 * (mb - 1024) < 3 * total * 1024


@pytest.mark.parametrize(
    ("given", "normal"),
    [("0000:3B:00.0", "0000:3b:00.0"), ("3b:00.0", "0000:3b:00.0"), (" 0001:af:1f.7 ", "0001:af:1f.7")],
)
def test_pci_ids_are_normalised_to_esxi_spelling(given: str, normal: str) -> None:
    assert normalize_pci_id(given) == normal


@pytest.mark.parametrize("bad", ["", "3b:00", "0000:3b:00.8", "gpu0", "0000:3b:00.0.1"])
def test_malformed_pci_ids_are_refused(bad: str) -> None:
    with pytest.raises(PlanError, match="not a PCI address"):
        normalize_pci_id(bad)


def test_signed_and_unsigned_pci_ids_round_trip() -> None:
    for value in range(0x10000):
        assert unsigned16(signed16(value)) == value
        assert -0x8000 <= signed16(value) < 0x8000


# --- the VM settings matrix ----------------------------------------------------------------------

EXTRA_STATES = {
    "absent": {},
    "right": {KEY_USE_64BIT_MMIO: "TRUE", KEY_MMIO_SIZE: "512"},
    "lowercase": {KEY_USE_64BIT_MMIO: "true", KEY_MMIO_SIZE: "512"},
    "wrong": {KEY_USE_64BIT_MMIO: "FALSE", KEY_MMIO_SIZE: "64"},
}


def _attached(pci_id: str, key: int) -> vim.vm.device.VirtualPCIPassthrough:
    backing = vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo(
        id=pci_id, deviceId="20b5", systemId=HOST_SYSTEM_ID, vendorId=0x10DE, deviceName="A100"
    )
    return vim.vm.device.VirtualPCIPassthrough(key=key, backing=backing)


def _kind(text: str) -> str:
    for key in (KEY_USE_64BIT_MMIO, KEY_MMIO_SIZE, KEY_HIDE_HYPERVISOR):
        if text.startswith(f"{key} = "):
            return key
    for word, kind in (
        ("attach", "attach"),
        ("firmware", "firmware"),
        ("Secure Boot", "secure"),
        ("reserve", "reserve"),
    ):
        if word in text:
            return kind
    raise AssertionError(f"unclassified change {text!r}")


MATRIX = list(
    itertools.product(
        ["bios", "efi"],  # firmware now
        [False, True],  # secure boot now
        [False, True],  # secure boot wanted
        [False, True],  # memory reservation locked now
        list(EXTRA_STATES),  # MMIO extraConfig now
        [False, True],  # hide_hypervisor wanted
        [None, "FALSE", "TRUE"],  # hypervisor.cpuid.v0 now
        [0, 1, 2],  # GPUs already attached
    )
)


@pytest.mark.parametrize(
    ("firmware", "secure_now", "secure_wanted", "locked", "extra_state", "hide", "cpuid_now", "attached"),
    MATRIX,
)
def test_plan_changes_exactly_what_differs_and_converges(
    firmware: str,
    secure_now: bool,
    secure_wanted: bool,
    locked: bool,
    extra_state: str,
    hide: bool,
    cpuid_now: str | None,
    attached: int,
) -> None:
    extra = dict(EXTRA_STATES[extra_state])
    if cpuid_now is not None:
        extra[KEY_HIDE_HYPERVISOR] = cpuid_now
    devices = [_attached(pid, 13000 + i) for i, pid in enumerate(["0000:3b:00.0", "0000:5e:00.0"][:attached])]
    lab = make_lab(firmware=firmware, secure_boot=secure_now, locked=locked, extra=extra, devices=devices)
    options = Options(gpus=TWO_A100, secure_boot=secure_wanted, hide_hypervisor=hide)
    host = host_pci(lab.vm)
    result = plan(lab.vm.config, host, options)

    expected = []
    expected += ["attach"] * (2 - attached)
    expected += ["firmware"] if firmware != "efi" else []
    expected += ["secure"] if secure_now != secure_wanted else []
    expected += ["reserve"] if not locked else []
    expected += [KEY_USE_64BIT_MMIO, KEY_MMIO_SIZE] if extra_state in ("absent", "wrong") else []
    expected += [KEY_HIDE_HYPERVISOR] if hide and cpuid_now != "FALSE" else []
    assert sorted(_kind(c.text) for c in result.vm_changes) == sorted(expected)
    assert result.power_off_required == any(k != "reserve" for k in expected)
    assert result.host_config == [] and not result.host_reboot_required and result.deferred == []
    assert (result.spec is None) == (not expected)

    if result.spec is not None:
        SoapAdapter.Serialize(result.spec)
        config, _ = apply_spec(lab.vm.config, result.spec, 14000)
    else:
        config = lab.vm.config
    assert describe_state(config, host, options) == result.after
    again = plan(config, host, options)
    assert again.changes == [] and again.spec is None
    assert again.before == again.after == result.after
    # hypervisor.cpuid.v0 is never written unless asked
    if not hide:
        assert all(
            opt.key != KEY_HIDE_HYPERVISOR for opt in (result.spec.extraConfig if result.spec else []) or []
        )


# --- memory ---------------------------------------------------------------------------------------


def test_too_little_memory_fails_with_the_numbers() -> None:
    lab = make_lab(memory_mb=128 * 1024)
    with pytest.raises(PlanError) as err:
        plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100))
    message = str(err.value)
    assert "131072 MB" in message and "245760 MB" in message and "1.5 x 160 GB" in message
    assert "adjust_memory" in message


def test_adjust_memory_raises_memory_to_exactly_the_minimum() -> None:
    lab = make_lab(memory_mb=128 * 1024)
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100, adjust_memory=True))
    assert result.spec.memoryMB == 245760
    assert any(c.text == "memory 131072 MB -> 245760 MB" for c in result.vm_changes)
    assert result.power_off_required


@pytest.mark.parametrize("memory_mb", [245760, 245760 + 4, 512 * 1024])
def test_enough_memory_is_left_alone(memory_mb: int) -> None:
    lab = make_lab(memory_mb=memory_mb, firmware="efi", locked=True)
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100, adjust_memory=True))
    assert result.spec.memoryMB is None


# --- host passthrough -----------------------------------------------------------------------------


def test_host_passthrough_off_is_enabled_and_attach_waits_for_a_reboot() -> None:
    lab = make_lab(enabled=False)
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100))
    assert [(c.id, c.passthruEnabled) for c in result.host_config] == [
        ("0000:3b:00.0", True),
        ("0000:5e:00.0", True),
    ]
    assert all(isinstance(c, vim.host.PciPassthruConfig) for c in result.host_config)
    assert result.host_reboot_required
    assert len(result.deferred) == 2 and "reboot" in result.deferred[0]
    assert not any("attach" in c.text for c in result.vm_changes)
    assert result.after["host_passthrough_enabled"] == ["0000:3b:00.0", "0000:5e:00.0"]


def test_enabled_but_inactive_passthrough_needs_only_a_reboot() -> None:
    lab = make_lab(enabled=True, active=False)
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100))
    assert result.host_config == [] and result.host_reboot_required and len(result.deferred) == 2


def test_unknown_pci_address_lists_the_hosts_nvidia_devices() -> None:
    lab = make_lab()
    with pytest.raises(PlanError, match=r"0000:99:00.0 not found .*0000:3b:00.0, 0000:5e:00.0"):
        plan(lab.vm.config, host_pci(lab.vm), Options(gpus=(GpuRequest(memory_gb=80, pci_id="99:00.0"),)))


def test_device_not_capable_of_passthrough_points_at_the_bios() -> None:
    lab = make_lab()
    lab.host.gpus[0].capable = False
    with pytest.raises(PlanError, match="VT-d"):
        plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100))


def test_device_taken_by_another_vm_is_refused() -> None:
    lab = make_lab()
    host = host_pci(lab.vm)
    host = type(host)(name=host.name, devices=host.devices, passthru=host.passthru, targets=host.targets[1:])
    with pytest.raises(PlanError, match="another VM"):
        plan(lab.vm.config, host, Options(gpus=TWO_A100))


def test_directpath_backing_carries_the_hosts_ids() -> None:
    lab = make_lab(device_id=0x8123, gpu_count=1)  # a device id above 0x7fff arrives negative
    result = plan(
        lab.vm.config, host_pci(lab.vm), Options(gpus=(GpuRequest(memory_gb=16, pci_id="0000:3b:00.0"),))
    )
    backing = result.spec.deviceChange[0].device.backing
    assert isinstance(backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo)
    assert (backing.id, backing.deviceId, backing.systemId, backing.vendorId) == (
        "0000:3b:00.0",
        "8123",
        HOST_SYSTEM_ID,
        0x10DE,
    )
    assert result.spec.deviceChange[0].operation == vim.vm.device.VirtualDeviceSpec.Operation.add
    assert result.spec.deviceChange[0].device.key < 0


# --- Dynamic DirectPath ---------------------------------------------------------------------------


def _dynamic(count: int, device_id: int = A100_80GB) -> tuple[GpuRequest, ...]:
    return tuple(GpuRequest(memory_gb=80, device_id=device_id) for _ in range(count))


@pytest.mark.parametrize(
    ("host_gpus", "enabled_before", "wanted", "to_enable"),
    [
        (2, [False, False], 1, ["0000:3b:00.0"]),
        (2, [False, False], 2, ["0000:3b:00.0", "0000:5e:00.0"]),
        (2, [False, True], 1, []),
        (3, [True, False, False], 2, ["0000:5e:00.0"]),
        (2, [True, True], 2, []),
    ],
)
def test_dynamic_directpath_enables_just_enough_devices_of_the_model(
    host_gpus: int, enabled_before: list[bool], wanted: int, to_enable: list[str]
) -> None:
    lab = make_lab(gpu_count=host_gpus)
    for gpu, enabled in zip(lab.host.gpus, enabled_before, strict=True):
        gpu.enabled = gpu.active = enabled
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=_dynamic(wanted)))
    assert [c.id for c in result.host_config] == to_enable
    assert result.host_reboot_required == (sum(enabled_before) < wanted)
    adds = [c.device for c in result.spec.deviceChange]
    assert len(adds) == wanted
    for device in adds:
        assert isinstance(device.backing, vim.vm.device.VirtualPCIPassthrough.DynamicBackingInfo)
        assert [(a.vendorId, a.deviceId) for a in device.backing.allowedDevice] == [(0x10DE, A100_80GB)]
    assert result.deferred == []  # Dynamic DirectPath picks a device at power-on


def test_dynamic_directpath_reuses_devices_already_on_the_vm() -> None:
    lab = make_lab()
    first = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=_dynamic(2), secure_boot=False))
    config, _ = apply_spec(lab.vm.config, first.spec, 14000)
    again = plan(config, host_pci(lab.vm), Options(gpus=_dynamic(2)))
    assert again.spec is None
    assert again.after["gpus"] == ["dynamic:10de:20b5", "dynamic:10de:20b5"]


def test_dynamic_directpath_with_too_few_devices_fails() -> None:
    lab = make_lab(gpu_count=1)
    with pytest.raises(PlanError, match=r"2 Dynamic DirectPath GPU.*has 1"):
        plan(lab.vm.config, host_pci(lab.vm), Options(gpus=_dynamic(2)))


# --- unlisted devices, overrides, validation ------------------------------------------------------


def test_unlisted_passthrough_devices_are_kept_with_a_warning_or_removed_when_exclusive() -> None:
    lab = make_lab(devices=[_attached("0000:5e:00.0", 13000)], firmware="efi", locked=True)
    one = (GpuRequest(memory_gb=80, pci_id="0000:3b:00.0"),)
    kept = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=one))
    assert any("0000:5e:00.0" in w for w in kept.warnings)
    assert all(c.operation == "add" for c in kept.spec.deviceChange)
    removed = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=one, exclusive=True))
    ops = sorted((c.operation, c.device.key) for c in removed.spec.deviceChange)
    assert ops[0][0] == "add" and ops[1] == ("remove", 13000)
    config, _ = apply_spec(lab.vm.config, removed.spec, 14000)
    assert describe_state(config, host_pci(lab.vm), Options(gpus=one))["gpus"] == ["0000:3b:00.0"]


def test_mmio_override_wins_and_warns_when_below_the_rule() -> None:
    lab = make_lab()
    result = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=TWO_A100, mmio_size_gb=128))
    values = {o.key: o.value for o in result.spec.extraConfig}
    assert values[KEY_MMIO_SIZE] == "128" and result.mmio_size_gb == 128
    assert any("below the 512 GB" in w for w in result.warnings)


def test_consumer_gpu_gets_the_cpuid_flag_only_when_asked() -> None:
    lab = make_lab(device_id=RTX_2080_TI, name="GeForce RTX 2080 Ti", gpu_count=1, memory_mb=32 * 1024)
    gpu = (GpuRequest(memory_gb=11, pci_id="0000:3b:00.0"),)
    plain = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=gpu))
    assert KEY_HIDE_HYPERVISOR not in {o.key for o in plain.spec.extraConfig}
    hidden = plan(lab.vm.config, host_pci(lab.vm), Options(gpus=gpu, hide_hypervisor=True))
    assert {o.key: o.value for o in hidden.spec.extraConfig}[KEY_HIDE_HYPERVISOR] == "FALSE"
    assert {o.key: o.value for o in hidden.spec.extraConfig}[KEY_MMIO_SIZE] == "32"


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ((), "at least one GPU"),
        ((GpuRequest(memory_gb=0, pci_id="0000:3b:00.0"),), "positive"),
        (
            (GpuRequest(memory_gb=8, pci_id="3b:00.0"), GpuRequest(memory_gb=8, pci_id="0000:3b:00.0")),
            "twice",
        ),
        ((GpuRequest(memory_gb=8),), "needs device_id"),
        ((GpuRequest(memory_gb=8, pci_id="0000:3b:00.0", device_id=1),), "not both"),
    ],
)
def test_invalid_requests_are_refused(gpus: tuple[GpuRequest, ...], message: str) -> None:
    lab = make_lab()
    with pytest.raises(PlanError, match=message):
        plan(lab.vm.config, host_pci(lab.vm), Options(gpus=gpus))
