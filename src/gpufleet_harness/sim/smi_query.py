"""`nvidia-smi -q`, `-q -x` and `mig -lgip` / `-lgipp` / `-lgi` of the nvidia-smi stand-in, in the layout of
nvidia-smi 580.159.04 as a real H200 printed them (tests/realgpu/h200-580.159.04/smi-q.txt, smi-qx.txt,
smi-mig-lgip.txt, smi-mig-lgipp.txt, smi-mig-lgi.txt).

Values come from NVML (pynvml); what the simulated NVML does not answer prints "N/A" where the real one
printed a value, so the layout (field names, order, nesting, columns) stays the recording's. Standard
library and pynvml only: the lab's hosts run this from a few copied sources (lab/hostsetup._SMI_SOURCES).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

NA = "N/A"
MIB = 1 << 20
LABEL_WIDTH = 55  # -q pads "    Label" to this many columns before ": value"
PROCESS_LABEL_WIDTH = 42  # ... but the Processes section to this many (recorded with a process running)
INDENT = "    "
BRANDS = {1: "Quadro", 2: "Tesla", 3: "NVS", 5: "GeForce", 6: "TITAN", 13: "NVIDIA RTX", 14: "NVIDIA"}
ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
                 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell"}
VIRTUALIZATION = {0: "None", 1: "Pass-Through", 2: "VGPU", 3: "Host VGPU", 4: "Host VSGA"}
ADDRESSING = {0: "None", 1: "HMM", 2: "ATS"}
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
FABRIC_STATES = {1: "Not Started", 2: "In Progress", 3: "Completed"}
# nvml.h field ids (nvmlDeviceGetFieldValues) nvidia-smi's readings come from, and nvmlValueType_t -> the
# member of nvmlValue_t holding the value
FI_MEMORY_TEMP, FI_POWER_AVERAGE, FI_POWER_INSTANT = 82, 185, 186
POWER_SCOPE_MEMORY = 2  # the power fields' scopeId for the GPU's memory (nvml.h NVML_POWER_SCOPE_MEMORY)
FIELD_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# NVML_CLOCKS_EVENT_REASON_* bits
IDLE, APP_CLOCKS, SW_POWER_CAP, HW_SLOWDOWN, SYNC_BOOST = 0x1, 0x2, 0x4, 0x8, 0x10
SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE, DISPLAY_CLOCKS = 0x20, 0x40, 0x80, 0x100


class Reader:
    """NVML getters of one device through pynvml: the value, or None where NVML answers an error."""

    def __init__(self, nv: Any, handle: Any) -> None:
        self.nv = nv
        self.handle = handle

    def get(self, name: str, *args: Any) -> Any:
        fn = getattr(self.nv, name, None)
        if fn is None:
            return None
        try:
            value = fn(self.handle, *args)
        except self.nv.NVMLError:
            return None
        return value.decode() if isinstance(value, bytes) else value

    def field(self, field_id: int, scope: int = 0) -> Any:
        """One nvmlDeviceGetFieldValues field's value, or None where NVML answers an error for it."""
        fn = getattr(self.nv, "nvmlDeviceGetFieldValues", None)
        if fn is None:
            return None
        try:
            [value] = fn(self.handle, [(field_id, scope)])
        except self.nv.NVMLError:
            return None
        member = FIELD_VALUE_MEMBERS.get(int(value.valueType))
        if int(value.nvmlReturn) != 0 or member is None:
            return None
        return getattr(value.value, member)

    def struct(self, struct_name: str, fn_name: str, version_name: str | None) -> Any:
        """A call that fills a caller-made structure (pynvml passes it as given)."""
        cls, fn = getattr(self.nv, struct_name, None), getattr(self.nv, fn_name, None)
        if cls is None or fn is None:
            return None
        st = cls()
        if version_name:
            st.version = getattr(self.nv, version_name)
        try:
            fn(self.handle, ctypes.byref(st))
        except self.nv.NVMLError:
            return None
        return st


@dataclass(frozen=True)
class Process:
    """A compute process on a GPU, as nvidia-smi lists it."""

    pid: int
    name: str | None
    used_bytes: int | None
    gi: int | None  # GPU- and compute-instance ids inside MIG, else None
    ci: int | None


_NO_INSTANCE = 0xFFFFFFFF


def processes(r: Reader) -> list[Process]:
    """The GPU's running compute processes (nvmlDeviceGetComputeRunningProcesses) with their names
    (nvmlSystemGetProcessName)."""
    found = []
    for p in r.get("nvmlDeviceGetComputeRunningProcesses") or []:
        try:
            name = r.nv.nvmlSystemGetProcessName(p.pid)
        except r.nv.NVMLError:
            name = None
        gi, ci = getattr(p, "gpuInstanceId", _NO_INSTANCE), getattr(p, "computeInstanceId", _NO_INSTANCE)
        found.append(Process(int(p.pid), name.decode() if isinstance(name, bytes) else name,
                             None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                             None if gi == _NO_INSTANCE else int(gi),
                             None if ci == _NO_INSTANCE else int(ci)))
    return found


def _process_nodes(r: Reader) -> list[Node]:
    """-q's Processes: "None", or per process its instance ids, pid, type, name and memory, the labels padded
    to 42 columns rather than 55 (as a real H200 printed them with a process running:
    tests/realgpu/h200-580.159.04-host3-process/smi-q-busy.txt, smi-qx-busy.txt)."""
    procs = processes(r)
    if not procs:
        return [F("Processes", None, "None"), G(None, "processes")]
    width = PROCESS_LABEL_WIDTH
    text = G("Processes", None, *[node for p in procs for node in (
        F("GPU instance ID", None, p.gi, width=width), F("Compute instance ID", None, p.ci, width=width),
        F("Process ID", None, p.pid, width=width), F("Type", None, "C", deeper=True, width=width),
        F("Name", None, p.name, deeper=True, width=width),
        F("Used GPU Memory", None, _mib(p.used_bytes), deeper=True, width=width))])
    xml = G(None, "processes", *[G(None, "process_info", F(None, "gpu_instance_id", p.gi),
                                   F(None, "compute_instance_id", p.ci), F(None, "pid", p.pid),
                                   F(None, "type", "C"), F(None, "process_name", p.name),
                                   F(None, "used_memory", _mib(p.used_bytes))) for p in procs])
    return [text, xml]


# -- a -q document: one tree, two renderings -------------------------------------------------------------

Value = str | tuple[str, str]  # the same in both renderings, or (text, xml)


@dataclass
class Node:
    """A -q field: `label` in the text rendering (None: XML only), `tag` in XML (None: text only), and a
    value or children. `deeper` indents a text line one more level without nesting it in XML (nvidia-smi
    shows the HW slowdown reasons under "HW Slowdown" but lists them as siblings in XML)."""

    label: str | None
    tag: str | None
    value: Value | None = None
    children: list[Node] = field(default_factory=list)
    deeper: bool = False
    empty_text: str | None = None  # XML text of a childless group ("None" for mig_devices), else open/close
    width: int = LABEL_WIDTH  # the text rendering pads "    Label" to this many columns


def F(label: str | None, tag: str | None, value: Any, deeper: bool = False, width: int = LABEL_WIDTH) -> Node:
    """A leaf; None prints N/A."""
    if value is None:
        value = NA
    return Node(label, tag, value if isinstance(value, tuple) else str(value), deeper=deeper, width=width)


def G(label: str | None, tag: str | None, *children: Node, empty_text: str | None = None) -> Node:
    return Node(label, tag, children=list(children), empty_text=empty_text)


def render_text(nodes: Sequence[Node], depth: int) -> list[str]:
    lines = []
    for node in nodes:
        if node.label is None:
            continue
        pad = INDENT * (depth + node.deeper)
        if node.value is None:
            lines.append(pad + node.label)
            lines.extend(render_text(node.children, depth + 1))
            continue
        value = node.value[0] if isinstance(node.value, tuple) else node.value
        lines.append(f"{pad + node.label:<{node.width}}: {value}")
    return lines


def render_xml(nodes: Sequence[Node], depth: int) -> list[str]:
    lines = []
    pad = "\t" * depth
    for node in nodes:
        if node.tag is None:
            continue
        if node.value is None:
            lines.append(f"{pad}<{node.tag}>")
            if node.children:
                lines.extend(render_xml(node.children, depth + 1))
            elif node.empty_text is not None:
                lines.append(f"{pad}\t{escape(node.empty_text)}")
            lines.append(f"{pad}</{node.tag}>")
            continue
        value = node.value[1] if isinstance(node.value, tuple) else node.value
        lines.append(f"{pad}<{node.tag}>{escape(value)}</{node.tag}>")
    return lines


# -- formatting helpers -----------------------------------------------------------------------------------


def _mib(value: int | None, rounding: Callable[[float], int] = round) -> str | None:
    return None if value is None else f"{rounding(value / MIB)} MiB"


def _enabled(value: Any) -> str | None:
    return None if value is None else ("Enabled" if value else "Disabled")


def _yes(value: Any) -> str | None:
    return None if value is None else ("Yes" if value else "No")


def _unit(value: Any, unit: str) -> str | None:
    return None if value is None else f"{value} {unit}"


def _watts(milliwatts: Any) -> str | None:
    return None if milliwatts is None else f"{milliwatts / 1000:.2f} W"


def _active(reasons: int | None, bit: int) -> str | None:
    return None if reasons is None else ("Active" if reasons & bit else "Not Active")


def _pair(value: Any, index: int) -> Any:
    return None if value is None else value[index]


def _hex_both(value: int | None, width: int) -> tuple[str, str] | None:
    """-q's "0x06" and -q -x's "06"."""
    return None if value is None else (f"0x{value:0{width}X}", f"{value:0{width}X}")


# -- the -q tree of one GPU -------------------------------------------------------------------------------


def gpu_nodes(r: Reader, driver_version: str, nvml_major: int, part_number: str | None = None) -> list[Node]:
    """The fields nvidia-smi 580 prints for one GPU, in its order. `part_number`: the GPU part number, which
    no NVML getter answers (nvidia-smi has it from the driver; the stand-in from the machine)."""
    pci = r.get("nvmlDeviceGetPciInfo")
    mig = r.get("nvmlDeviceGetMigMode")
    mem = _memory_v2(r)
    bar1 = r.get("nvmlDeviceGetBAR1MemoryInfo")
    ecc = r.get("nvmlDeviceGetEccMode")
    reasons = r.get("nvmlDeviceGetCurrentClocksEventReasons")
    util = r.get("nvmlDeviceGetUtilizationRates")
    power_limits = r.get("nvmlDeviceGetPowerManagementLimitConstraints")
    remapped = r.get("nvmlDeviceGetRemappedRows")
    repair = r.get("nvmlDeviceGetRepairStatus")
    pstate = r.get("nvmlDeviceGetPerformanceState")
    pstate_text = None if pstate is None else f"P{pstate}"
    clocks = [r.get("nvmlDeviceGetClockInfo", k) for k in range(4)]
    max_clocks = [r.get("nvmlDeviceGetMaxClockInfo", k) for k in range(4)]
    power = r.get("nvmlDeviceGetPowerUsage")
    limit = r.get("nvmlDeviceGetEnforcedPowerLimit")
    cc_mem = r.get("nvmlDeviceGetConfComputeMemSizeInfo")
    fabric = r.struct("c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV", "nvmlGpuFabricInfo_v3")
    gsp_version = r.get("nvmlDeviceGetGspFirmwareVersion")
    pdi = r.get("nvmlDeviceGetPdi")
    board_id = r.get("nvmlDeviceGetBoardId")
    c2c = r.get("nvmlDeviceGetC2cModeInfoV")
    pcie = [r.get(f"nvmlDeviceGet{name}") for name in ("MaxPcieLinkGeneration", "CurrPcieLinkGeneration",
                                                       "MaxPcieLinkWidth", "CurrPcieLinkWidth")]
    pci_class = None if pci is None else (0x3, 0x2)  # "3D controller"
    fans = r.get("nvmlDeviceGetFanSpeed")
    ecc_counts = {(et, ct): r.get("nvmlDeviceGetTotalEccErrors", et, ct) for et in (0, 1) for ct in (0, 1)}
    deprecated_display = nvml_major >= 13  # R580 deprecated the display-mode query
    total_mib = None if mem is None else mem.total // MIB

    def ecc_set(counter: int) -> list[Node]:
        on = bool(ecc and ecc[0])
        zero = "0" if on else None
        return [F("SRAM Correctable", "sram_correctable", zero),
                F("SRAM Uncorrectable Parity", "sram_uncorrectable_parity", zero),
                F("SRAM Uncorrectable SEC-DED", "sram_uncorrectable_secded", zero),
                F("DRAM Correctable", "dram_correctable", ecc_counts[(0, counter)] if on else None),
                F("DRAM Uncorrectable", "dram_uncorrectable", ecc_counts[(1, counter)] if on else None)]

    fabric_state = None if fabric is None or fabric.state == 0 else FABRIC_STATES.get(fabric.state, NA)
    member = fabric_state is not None
    health = ["summary", "bandwidth", "route_recovery_in_progress", "route_unhealthy",
              "access_timeout_recovery", "incorrect_configuration", "partition_assigned"]
    health_labels = ["Summary", "Bandwidth", "Route Recovery in progress", "Route Unhealthy",
                     "Access Timeout Recovery", "Incorrect Configuration", "Partition Assigned"]
    health_values: list[str | None] = [None] * len(health)
    if member and fabric is not None and fabric.healthSummary:
        health_values = ["Healthy", "Full", "False", "False", "False", "False", "False"]
    return [
        F("Product Name", "product_name", r.get("nvmlDeviceGetName")),
        F("Product Brand", "product_brand", BRANDS.get(r.get("nvmlDeviceGetBrand"))),
        F("Product Architecture", "product_architecture",
          ARCHITECTURES.get(r.get("nvmlDeviceGetArchitecture"))),
        F("Display Mode", "display_mode", "Requested functionality has been deprecated" if deprecated_display
          else _enabled(r.get("nvmlDeviceGetDisplayMode"))),
        F("Display Attached", "display_attached", _yes(r.get("nvmlDeviceGetDisplayMode"))),
        F("Display Active", "display_active", _enabled(r.get("nvmlDeviceGetDisplayActive"))),
        F("Persistence Mode", "persistence_mode", _enabled(r.get("nvmlDeviceGetPersistenceMode"))),
        F("Addressing Mode", "addressing_mode", ADDRESSING.get(_addressing(r))),
        G("MIG Mode", "mig_mode", F("Current", "current_mig", _enabled(_pair(mig, 0))),
          F("Pending", "pending_mig", _enabled(_pair(mig, 1)))),
        _mig_devices(r, mig),
        F("Accounting Mode", "accounting_mode", _enabled(r.get("nvmlDeviceGetAccountingMode"))),
        F("Accounting Mode Buffer Size", "accounting_mode_buffer_size", 4000),
        G("Driver Model", "driver_model", F("Current", "current_dm", None), F("Pending", "pending_dm", None)),
        F("Serial Number", "serial", r.get("nvmlDeviceGetSerial")),
        F("GPU UUID", "uuid", r.get("nvmlDeviceGetUUID")),
        F("GPU PDI", "pdi", None if pdi is None else f"0x{pdi:016x}"),
        F("Minor Number", "minor_number", r.get("nvmlDeviceGetMinorNumber")),
        F("VBIOS Version", "vbios_version", r.get("nvmlDeviceGetVbiosVersion")),
        F("MultiGPU Board", "multigpu_board", _yes(r.get("nvmlDeviceGetMultiGpuBoard"))),
        F("Board ID", "board_id", None if board_id is None else f"0x{board_id:x}"),
        F("Board Part Number", "board_part_number", r.get("nvmlDeviceGetBoardPartNumber")),
        F("GPU Part Number", "gpu_part_number", part_number),
        F("FRU Part Number", "gpu_fru_part_number", None),
        G("Platform Info", "platformInfo", F("Chassis Serial Number", "chassis_serial_number", None),
          F("Slot Number", "slot_number", None), F("Tray Index", "tray_index", None),
          F("Host ID", "host_id", None), F("Peer Type", "peer_type", None),
          F("Module Id", "module_id", r.get("nvmlDeviceGetModuleId")),
          F("GPU Fabric GUID", "gpu_fabric_guid", None)),
        G("Inforom Version", "inforom_version",
          F("Image Version", "img_version", r.get("nvmlDeviceGetInforomImageVersion")),
          F("OEM Object", "oem_object", r.get("nvmlDeviceGetInforomVersion", 0)),
          F("ECC Object", "ecc_object", r.get("nvmlDeviceGetInforomVersion", 1)),
          F("Power Management Object", "pwr_object", r.get("nvmlDeviceGetInforomVersion", 2))),
        G("Inforom BBX Object Flush", "inforom_bbx_flush", F("Latest Timestamp", "latest_timestamp", None),
          F("Latest Duration", "latest_duration", None)),
        G("GPU Operation Mode", "gpu_operation_mode", F("Current", "current_gom", None),
          F("Pending", "pending_gom", None)),
        F("GPU C2C Mode", "c2c_mode", None if c2c is None else _enabled(c2c.isC2cEnabled)),
        G("GPU Virtualization Mode", "gpu_virtualization_mode",
          F("Virtualization Mode", "virtualization_mode",
            VIRTUALIZATION.get(r.get("nvmlDeviceGetVirtualizationMode"))),
          F("Host VGPU Mode", "host_vgpu_mode", None),
          F("vGPU Heterogeneous Mode", "vgpu_heterogeneous_mode", None)),
        F("GPU Recovery Action", "gpu_recovery_action", "None"),
        F("GSP Firmware Version", "gsp_firmware_version", gsp_version),
        G("IBMNPU", "ibmnpu", F("Relaxed Ordering Mode", "relaxed_ordering_mode", None)),
        G("PCI", "pci",
          F("Bus", "pci_bus", _hex_both(_attr(pci, "bus"), 2)),
          F("Device", "pci_device", _hex_both(_attr(pci, "device"), 2)),
          F("Domain", "pci_domain", _hex_both(_attr(pci, "domain"), 4)),
          F("Base Classcode", "pci_base_class", None if pci_class is None else (f"0x{pci_class[0]:X}",
                                                                               f"{pci_class[0]:X}")),
          F("Sub Classcode", "pci_sub_class", None if pci_class is None else (f"0x{pci_class[1]:X}",
                                                                             f"{pci_class[1]:X}")),
          F("Device Id", "pci_device_id", _hex_both(_attr(pci, "pciDeviceId"), 8)),
          F("Bus Id", "pci_bus_id", _text(_attr(pci, "busId"))),
          F("Sub System Id", "pci_sub_system_id", _hex_both(_attr(pci, "pciSubSystemId"), 8)),
          G("GPU Link Info", "pci_gpu_link_info",
            G("PCIe Generation", "pcie_gen", F("Max", "max_link_gen", pcie[0]),
              F("Current", "current_link_gen", pcie[1]),
              F("Device Current", "device_current_link_gen", pcie[1]),
              F("Device Max", "max_device_link_gen", pcie[0]), F("Host Max", "max_host_link_gen", None)),
            G("Link Width", "link_widths",
              F("Max", "max_link_width", None if pcie[2] is None else f"{pcie[2]}x"),
              F("Current", "current_link_width", None if pcie[3] is None else f"{pcie[3]}x"))),
          G("Bridge Chip", "pci_bridge_chip", F("Type", "bridge_chip_type", None),
            F("Firmware", "bridge_chip_fw", None)),
          F("Replays Since Reset", "replay_counter", r.get("nvmlDeviceGetPcieReplayCounter")),
          F("Replay Number Rollovers", "replay_rollover_counter", 0),
          F("Tx Throughput", "tx_util", _unit(r.get("nvmlDeviceGetPcieThroughput", 0), "KB/s")),
          F("Rx Throughput", "rx_util", _unit(r.get("nvmlDeviceGetPcieThroughput", 1), "KB/s")),
          F("Atomic Caps Outbound", "atomic_caps_outbound", None),
          F("Atomic Caps Inbound", "atomic_caps_inbound", None)),
        F("Fan Speed", "fan_speed", _unit(fans, "%")),
        F("Performance State", "performance_state", pstate_text),
        G("Clocks Event Reasons", "clocks_event_reasons",
          F("Idle", "clocks_event_reason_gpu_idle", _active(reasons, IDLE)),
          F("Applications Clocks Setting", "clocks_event_reason_applications_clocks_setting",
            _active(reasons, APP_CLOCKS)),
          F("SW Power Cap", "clocks_event_reason_sw_power_cap", _active(reasons, SW_POWER_CAP)),
          F("HW Slowdown", "clocks_event_reason_hw_slowdown", _active(reasons, HW_SLOWDOWN)),
          F("HW Thermal Slowdown", "clocks_event_reason_hw_thermal_slowdown", _active(reasons, HW_THERMAL),
            deeper=True),
          F("HW Power Brake Slowdown", "clocks_event_reason_hw_power_brake_slowdown",
            _active(reasons, HW_POWER_BRAKE), deeper=True),
          F("Sync Boost", "clocks_event_reason_sync_boost", _active(reasons, SYNC_BOOST)),
          F("SW Thermal Slowdown", "clocks_event_reason_sw_thermal_slowdown", _active(reasons, SW_THERMAL)),
          F("Display Clock Setting", "clocks_event_reason_display_clocks_setting",
            _active(reasons, DISPLAY_CLOCKS))),
        G("Clocks Event Reasons Counters", "clocks_event_reasons_counters",
          *[F(label, f"clocks_event_reasons_counters_{tag}", "0 us") for label, tag in (
              ("SW Power Capping", "sw_power_cap"), ("Sync Boost", "sync_boost"),
              ("SW Thermal Slowdown", "sw_therm_slowdown"), ("HW Thermal Slowdown", "hw_therm_slowdown"),
              ("HW Power Braking", "hw_power_brake"))]),
        F("Sparse Operation Mode", "sparse_operation_mode", "Disabled"),
        G("FB Memory Usage", "fb_memory_usage",
          F("Total", "total", None if total_mib is None else f"{total_mib} MiB"),
          # each figure rounded up, as recorded (reserved 615.06 -> 616; busy: used 1550.81 -> 1551, free
          # 141605.19 -> 141606 MiB)
          F("Reserved", "reserved", _mib(_attr(mem, "reserved"), math.ceil)),
          F("Used", "used", _mib(_attr(mem, "used"), math.ceil)),
          F("Free", "free", _mib(_attr(mem, "free"), math.ceil))),
        G("BAR1 Memory Usage", "bar1_memory_usage",  # whole MiB used, the rest free (1 / 262143 recorded)
          F("Total", "total", _mib(_attr(bar1, "bar1Total"), math.floor)),
          F("Used", "used", _mib(_attr(bar1, "bar1Used"), math.floor)),
          F("Free", "free", None if bar1 is None else f"{bar1.bar1Total // MIB - bar1.bar1Used // MIB} MiB")),
        G("Conf Compute Protected Memory Usage", "cc_protected_memory_usage",
          F("Total", "total", None if cc_mem is None else f"{cc_mem.protectedMemSizeKib // 1024} MiB"),
          F("Used", "used", None if cc_mem is None else "0 MiB"),
          F("Free", "free", None if cc_mem is None else f"{cc_mem.protectedMemSizeKib // 1024} MiB")),
        F("Compute Mode", "compute_mode", COMPUTE_MODES.get(r.get("nvmlDeviceGetComputeMode"))),
        G("Utilization", "utilization",
          F("GPU", "gpu_util", None if util is None else f"{util.gpu} %"),
          F("Memory", "memory_util", None if util is None else f"{util.memory} %"),
          F("Encoder", "encoder_util", _unit(_pair(r.get("nvmlDeviceGetEncoderUtilization"), 0), "%")),
          F("Decoder", "decoder_util", _unit(_pair(r.get("nvmlDeviceGetDecoderUtilization"), 0), "%")),
          F("JPEG", "jpeg_util", _unit(_pair(r.get("nvmlDeviceGetJpgUtilization"), 0), "%")),
          F("OFA", "ofa_util", _unit(_pair(r.get("nvmlDeviceGetOfaUtilization"), 0), "%"))),
        G("Encoder Stats", "encoder_stats", F("Active Sessions", "session_count", 0),
          F("Average FPS", "average_fps", 0), F("Average Latency", "average_latency", 0)),
        G("FBC Stats", "fbc_stats", F("Active Sessions", "session_count", 0),
          F("Average FPS", "average_fps", 0), F("Average Latency", "average_latency", 0)),
        G("DRAM Encryption Mode", "dram_encryption_mode", F("Current", "current_dram_encryption", None),
          F("Pending", "pending_dram_encryption", None)),
        G("ECC Mode", "ecc_mode", F("Current", "current_ecc", _enabled(_pair(ecc, 0))),
          F("Pending", "pending_ecc", _enabled(_pair(ecc, 1)))),
        G("ECC Errors", "ecc_errors",
          G("Volatile", "volatile", *ecc_set(0)),
          G("Aggregate", "aggregate", *ecc_set(1), F("SRAM Threshold Exceeded", "sram_threshold_exceeded",
                                                    "No" if ecc and ecc[0] else None)),
          G("Aggregate Uncorrectable SRAM Sources", "aggregate_uncorrectable_sram_sources",
            *[F(label, tag, "0" if ecc and ecc[0] else None) for label, tag in (
                ("SRAM L2", "sram_l2"), ("SRAM SM", "sram_sm"),
                ("SRAM Microcontroller", "sram_microcontroller"),
                ("SRAM PCIE", "sram_pcie"), ("SRAM Other", "sram_other"))]),
          F("Channel Repair Pending", "channel_repair_pending", _yes(_pair(repair, 0))),
          F("TPC Repair Pending", "tpc_repair_pending", _yes(_pair(repair, 1))),
          F("Unrepairable Memory", "unrepairable_memory", "No")),
        G("Retired Pages", "retired_pages",
          F("Single Bit ECC", None, None), F("Double Bit ECC", None, None),
          F("Pending Page Blacklist", None, None),
          G(None, "multiple_single_bit_retirement", F(None, "retired_count", None),
            F(None, "retired_pagelist", None)),
          G(None, "double_bit_retirement", F(None, "retired_count", None), F(None, "retired_pagelist", None)),
          F(None, "pending_blacklist", None), F(None, "pending_retirement", None)),
        G("Remapped Rows", "remapped_rows",
          F("Correctable Error", "remapped_row_corr", _pair(remapped, 0)),
          F("Inactive Correctable Error", "remapped_row_corr_inactive", None if remapped is None else 0),
          F("Uncorrectable Error", "remapped_row_unc", _pair(remapped, 1)),
          F("Inactive Uncorrectable Error", "remapped_row_unc_inactive", None if remapped is None else 0),
          F("Pending", "remapped_row_pending", _yes(_pair(remapped, 2))),
          F("Remapping Failure Occurred", "remapped_row_failure", _yes(_pair(remapped, 3))),
          G("Bank Remap Availability Histogram", "row_remapper_histogram",
            *[F(label, f"row_remapper_histogram_{label.lower()}", None) for label in (
                "Max", "High", "Partial", "Low", "None")])),
        G("Temperature", "temperature",
          F("GPU Current Temp", "gpu_temp", _unit(r.get("nvmlDeviceGetTemperature", 0), "C")),
          F("GPU T.Limit Temp", "gpu_temp_tlimit", None),
          F("GPU Shutdown T.Limit Temp", "gpu_temp_max_tlimit_threshold", None),
          F("GPU Slowdown T.Limit Temp", "gpu_temp_slow_tlimit_threshold", None),
          F("GPU Max Operating T.Limit Temp", "gpu_temp_max_gpu_tlimit_threshold", None),
          F("GPU Target Temperature", "gpu_target_temperature", None),
          F("Memory Current Temp", "memory_temp", _unit(r.field(FI_MEMORY_TEMP), "C")),
          F("Memory Max Operating T.Limit Temp", "gpu_temp_max_mem_tlimit_threshold", None)),
        G(None, "supported_gpu_target_temp", F(None, "gpu_target_temp_min", None),
          F(None, "gpu_target_temp_max", None)),
        G("GPU Power Readings", "gpu_power_readings", F(None, "power_state", pstate_text),
          F("Average Power Draw", "average_power_draw", _watts(power)),
          F("Instantaneous Power Draw", "instant_power_draw", _watts(r.field(FI_POWER_INSTANT))),
          F("Current Power Limit", "current_power_limit", _watts(limit)),
          F("Requested Power Limit", "requested_power_limit",
            _watts(r.get("nvmlDeviceGetPowerManagementLimit"))),
          F("Default Power Limit", "default_power_limit",
            _watts(r.get("nvmlDeviceGetPowerManagementDefaultLimit"))),
          F("Min Power Limit", "min_power_limit", _watts(_pair(power_limits, 0))),
          F("Max Power Limit", "max_power_limit", _watts(_pair(power_limits, 1)))),
        G("GPU Memory Power Readings ", "gpu_memory_power_readings",  # (sic: the trailing space is real)
          F("Average Power Draw", "average_power_draw",
            _watts(r.field(FI_POWER_AVERAGE, POWER_SCOPE_MEMORY))),
          F("Instantaneous Power Draw", "instant_power_draw",
            _watts(r.field(FI_POWER_INSTANT, POWER_SCOPE_MEMORY)))),
        G("Module Power Readings", "module_power_readings", F(None, "power_state", pstate_text),
          *[F(label, tag, None) for label, tag in _POWER_FIELDS]),
        F("Power Smoothing", "power_smoothing", None),
        G("Workload Power Profiles", "power_profiles",
          F("Requested Profiles", "power_profile_requested_profiles", None),
          F("Enforced Profiles", "power_profile_enforced_profiles", None)),
        G("Clocks", "clocks", *_clock_fields(clocks)),
        G("Applications Clocks", "applications_clocks", F("Graphics", "graphics_clock", _mhz(max_clocks[0])),
          F("Memory", "mem_clock", _mhz(max_clocks[2]))),
        G("Default Applications Clocks", "default_applications_clocks",
          F("Graphics", "graphics_clock", _mhz(max_clocks[0])),
          F("Memory", "mem_clock", _mhz(max_clocks[2]))),
        G("Deferred Clocks", "deferred_clocks", F("Memory", "mem_clock", None)),
        G("Max Clocks", "max_clocks", *_clock_fields(max_clocks)),
        G("Max Customer Boost Clocks", "max_customer_boost_clocks",
          F("Graphics", "graphics_clock", _mhz(r.get("nvmlDeviceGetMaxCustomerBoostClock", 0)))),
        G("Clock Policy", "clock_policy", F("Auto Boost", "auto_boost", None),
          F("Auto Boost Default", "auto_boost_default", None)),
        G("Fabric", "fabric",
          F("State", "state", fabric_state),
          F("Status", "status",
            ("Success" if fabric.status == 0 else "Not Ready") if member and fabric else None),
          F("CliqueId", "cliqueId", fabric.cliqueId if member and fabric else None),
          F("ClusterUUID", "clusterUuid", _uuid(bytes(fabric.clusterUuid)) if member and fabric else None),
          G("Health", "health", *[F(label, tag, value) for label, tag, value in zip(
              health_labels, health, health_values, strict=True)])),
        G(None, "supported_clocks", *[
            G(None, "supported_mem_clock", F(None, "value", _mhz(mem)),
              *[F(None, "supported_graphics_clock", _mhz(mhz))
                for mhz in r.get("nvmlDeviceGetSupportedGraphicsClocks", mem) or []])
            for mem in r.get("nvmlDeviceGetSupportedMemoryClocks") or []], empty_text=NA),
        *_process_nodes(r),
        G(None, "accounted_processes"),
        G("Capabilities", "capabilities", F("EGM", "egm", "disabled")),
    ]


_POWER_FIELDS = (("Average Power Draw", "average_power_draw"),
                 ("Instantaneous Power Draw", "instant_power_draw"),
                 ("Current Power Limit", "current_power_limit"),
                 ("Requested Power Limit", "requested_power_limit"),
                 ("Default Power Limit", "default_power_limit"), ("Min Power Limit", "min_power_limit"),
                 ("Max Power Limit", "max_power_limit"))


def _memory_v2(r: Reader) -> Any:
    try:
        return r.nv.nvmlDeviceGetMemoryInfo(r.handle, version=r.nv.nvmlMemory_v2)
    except (r.nv.NVMLError, AttributeError, TypeError):
        return None


def _addressing(r: Reader) -> int | None:
    value = r.get("nvmlDeviceGetAddressingMode")
    return value if isinstance(value, int) else None


def _mig_devices(r: Reader, mig: Any) -> Node:
    """-q -x's mig_devices: "None" unless MIG devices exist (then their ids; not recorded on a real GPU)."""
    devices = []
    if mig is not None and mig[0]:
        count = r.get("nvmlDeviceGetMaxMigDeviceCount") or 0
        for k in range(count):
            handle = r.get("nvmlDeviceGetMigDeviceHandleByIndex", k)
            if handle is None:
                continue
            m = Reader(r.nv, handle)
            devices.append(G(None, "mig_device", F(None, "index", k),
                             F(None, "gpu_instance_id", m.get("nvmlDeviceGetGpuInstanceId")),
                             F(None, "compute_instance_id", m.get("nvmlDeviceGetComputeInstanceId")),
                             F(None, "uuid", m.get("nvmlDeviceGetUUID"))))
    return G(None, "mig_devices", *devices, empty_text="None")


def _attr(obj: Any, name: str) -> Any:
    return None if obj is None else getattr(obj, name)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _mhz(value: Any) -> str | None:
    return _unit(value, "MHz")


def _clock_fields(values: Sequence[Any]) -> list[Node]:
    return [F("Graphics", "graphics_clock", _mhz(values[0])), F("SM", "sm_clock", _mhz(values[1])),
            F("Memory", "mem_clock", _mhz(values[2])), F("Video", "video_clock", _mhz(values[3]))]


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# -- the documents ----------------------------------------------------------------------------------------


@dataclass
class QueryGpu:
    """One GPU of a -q: its bus id, reader (None: the GPU is lost) and part number (None: N/A)."""

    bus_id: str
    reader: Reader | None
    part_number: str | None = None


def query_text(timestamp: str, driver: str, cuda: str, nvml_major: int, gpus: Sequence[QueryGpu]) -> str:
    lines = ["", "==============NVSMI LOG==============", "",
             f"{'Timestamp':<{LABEL_WIDTH}}: {timestamp}", f"{'Driver Version':<{LABEL_WIDTH}}: {driver}",
             f"{'CUDA Version':<{LABEL_WIDTH}}: {cuda}", "",
             f"{'Attached GPUs':<{LABEL_WIDTH}}: {len(gpus)}"]
    for gpu in gpus:
        lines.append(f"GPU {gpu.bus_id}")
        if gpu.reader is None:
            lines.append(f"{INDENT}Unable to determine the device handle for GPU{gpu.bus_id}: GPU is lost")
        else:
            lines.extend(render_text(gpu_nodes(gpu.reader, driver, nvml_major, gpu.part_number), 1))
        lines.append("")
    return "\n".join(lines) + "\n"


def query_xml(timestamp: str, driver: str, cuda: str, nvml_major: int, gpus: Sequence[QueryGpu]) -> str:
    lines = ['<?xml version="1.0" ?>', '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">',
             "<nvidia_smi_log>", f"\t<timestamp>{escape(timestamp)}</timestamp>",
             f"\t<driver_version>{escape(driver)}</driver_version>",
             f"\t<cuda_version>{escape(cuda)}</cuda_version>",
             f"\t<attached_gpus>{len(gpus)}</attached_gpus>"]
    for gpu in gpus:
        lines.append(f'\t<gpu id="{escape(gpu.bus_id)}">')
        if gpu.reader is not None:
            lines.extend(render_xml(gpu_nodes(gpu.reader, driver, nvml_major, gpu.part_number), 2))
        lines.append("\t</gpu>")
    lines += ["", "</nvidia_smi_log>"]
    return "\n".join(lines) + "\n"


# -- mig -lgip / -lgipp / -lgi ----------------------------------------------------------------------------

LGIP_RULE = "+" + "-" * 79 + "+"


@dataclass
class MigGpu:
    """A MIG-capable GPU: its index and reader."""

    index: int
    reader: Reader


def _profiles(r: Reader) -> list[Any]:
    """The GPU's GPU-instance profile infos (MIG on or off), in nvidia-smi's order: by compute slices, then
    memory, then NVML's profile index (1g.18gb before 1g.18gb+me before 1g.35gb)."""
    found = []
    for p in range(getattr(r.nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 18)):
        info = r.get("nvmlDeviceGetGpuInstanceProfileInfo", p)
        if info is not None:
            found.append((info.sliceCount, info.memorySizeMB, p, info))
    return [info for *_key, info in sorted(found, key=lambda item: item[:3])]


def list_gpu_instance_profiles(gpus: Sequence[MigGpu]) -> str:
    """`mig -lgip`: one table, two lines per profile (name, id, instances free/total, memory GiB, P2P, SM,
    DEC, ENC; then CE, JPEG, OFA)."""
    lines = [LGIP_RULE, f"| {'GPU instance profiles:':<78}|",
             "| GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC  |",
             "|                                Free/Total   GiB              CE    JPEG  OFA  |",
             "|" + "=" * 79 + "|"]
    for gpu in gpus:
        mig = gpu.reader.get("nvmlDeviceGetMigMode")
        for info in _profiles(gpu.reader):
            total = info.instanceCount
            free = None
            if mig and mig[0]:
                free = gpu.reader.get("nvmlDeviceGetGpuInstanceRemainingCapacity", info.id)
            free = total if free is None else free  # MIG off: every instance is still to be made
            name = _text(info.name)
            gib = f"{info.memorySizeMB / 1024:.2f}"
            p2p = "Yes" if getattr(info, "isP2pSupported", 0) else "No"
            instances = f"{free}/{total}"
            lines.append(f"| {gpu.index:>3}  {name:<18}{info.id:>4}     {instances:<11}{gib:<11}{p2p:<7}"
                         f"{info.multiprocessorCount:<7}{info.decoderCount:<6}{info.encoderCount:<4}|")
            lines.append(f"|{'':63}{info.copyEngineCount:<6}{info.jpegCount:<6}{info.ofaCount:<4}|")
            lines.append(LGIP_RULE)
    return "\n".join(lines) + "\n"


def list_gpu_instance_placements(gpus: Sequence[MigGpu]) -> str:
    """`mig -lgipp`: "GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1", singular for one placement."""
    nv = gpus[0].reader.nv if gpus else None
    lines = []
    for gpu in gpus:
        for info in _profiles(gpu.reader):
            count = ctypes.c_uint(0)
            try:
                nv.nvmlDeviceGetGpuInstancePossiblePlacements(gpu.reader.handle, info.id, None,
                                                              ctypes.byref(count))
                array = (nv.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
                nv.nvmlDeviceGetGpuInstancePossiblePlacements(gpu.reader.handle, info.id, array,
                                                              ctypes.byref(count))
            except nv.NVMLError:
                continue
            starts = ",".join(str(array[k].start) for k in range(count.value))
            size = array[0].size if count.value else 0
            word = "Placements:" if count.value > 1 else "Placement :"
            lines.append(f"GPU {gpu.index:>2} Profile ID {info.id:>2} {word} {{{starts}}}:{size}")
    return "\n".join(lines) + "\n"


LGI_RULE = "+" + "-" * 55 + "+"


def list_gpu_instances(gpus: Sequence[MigGpu]) -> str:
    """`mig -lgi`: the GPU instances of MIG-enabled GPUs ("No MIG-enabled devices found." as recorded when
    none is; the table's layout is the MIG user guide's, not recorded on a real GPU)."""
    nv = gpus[0].reader.nv if gpus else None
    rows = []
    for gpu in gpus:
        mig = gpu.reader.get("nvmlDeviceGetMigMode")
        if not mig or not mig[0]:
            continue
        for info in _profiles(gpu.reader):
            array = (nv.c_nvmlGpuInstance_t * 8)()
            count = ctypes.c_uint(0)
            try:
                nv.nvmlDeviceGetGpuInstances(gpu.reader.handle, info.id, array, ctypes.byref(count))
            except nv.NVMLError:
                continue
            for k in range(count.value):
                gi = nv.nvmlGpuInstanceGetInfo(array[k])
                rows.append((gpu.index, _text(info.name), info.id, gi.id, gi.placement.start,
                             gi.placement.size))
    if not rows and not any((g.reader.get("nvmlDeviceGetMigMode") or (0,))[0] for g in gpus):
        return "No MIG-enabled devices found.\n"
    lines = [LGI_RULE, f"| {'GPU instances:':<54}|",
             "| GPU   Name             Profile  Instance   Placement  |",
             "|                          ID       ID       Start:Size |", "|" + "=" * 55 + "|"]
    for index, name, pid, gid, start, size in sorted(rows, key=lambda row: (row[0], row[3])):
        lines.append(f"| {index:>3}  {name:<16}{pid:>5}{gid:>9}{f'{start}:{size}':>12}     |")
        lines.append(LGI_RULE)
    return "\n".join(lines) + "\n"
