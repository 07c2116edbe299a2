/* Device queries of the simulated NVML: handles, identity, PCI, memory, topology, NVLink, fabric and
 * the telemetry that nvidia-smi-like tools, exporters and device plugins read. Static values come from
 * machine.json; the moving ones (power, temperature, clocks, utilization, processes, memory in use) from
 * the workloads of the sim root at the sim clock's now (load.c). */
#include "sim.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define ENTER(d)                                                                                        \
    do {                                                                                                \
        nvmlReturn_t r_ = sim_enter_dev(d);                                                             \
        if (r_ != NVML_SUCCESS) return r_;                                                              \
    } while (0)
#define NEED(cond)                                                                                      \
    do {                                                                                                \
        if (!(cond)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);                                     \
    } while (0)

/* ------------------------------------------------------------------------------------ handles */

nvmlReturn_t DECLDIR nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    NEED(deviceCount);
    /* Lost GPUs still count: nvidia-smi lists them as "Unable to determine the device handle". */
    *deviceCount = g_sim.ngpus;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    NEED(device && index < g_sim.ngpus);
    if (g_sim.lost[index]) return sim_leave(NVML_ERROR_GPU_IS_LOST);
    *device = &g_sim.gpus[index];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static nvmlReturn_t handle_for(int idx, nvmlDevice_t *device)
{
    if (idx < 0) return sim_leave(NVML_ERROR_NOT_FOUND);
    if (g_sim.lost[idx]) return sim_leave(NVML_ERROR_GPU_IS_LOST);
    *device = &g_sim.gpus[idx];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    unsigned i;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    NEED(uuid && device);
    for (i = 0; i < g_sim.ngpus; i++)
        if (strcasecmp(uuid, g_sim.gpus[i].uuid) == 0) return handle_for((int)i, device);
    /* MIG-<uuid>: the MIG device handle, as NVML resolves MIG UUIDs too. */
    for (i = 0; i < g_sim.ngpus; i++) {
        unsigned k;
        for (k = 0; k < g_sim.nmigdevs[i]; k++)
            if (strcasecmp(uuid, g_sim.migdevs[i][k].uuid) == 0) {
                if (g_sim.lost[i]) return sim_leave(NVML_ERROR_GPU_IS_LOST);
                *device = &g_sim.migdevs[i][k];
                return sim_leave(NVML_SUCCESS);
            }
    }
    return sim_leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device)
{
    unsigned i;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    NEED(serial && device);
    for (i = 0; i < g_sim.ngpus; i++)
        if (strcmp(serial, g_sim.gpus[i].serial) == 0) return handle_for((int)i, device);
    return sim_leave(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    int idx;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    NEED(pciBusId && device);
    idx = sim_find_bus_id(pciBusId);
    NEED(idx != -2);
    return handle_for(idx, device);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ------------------------------------------------------------------------------------ identity */

nvmlReturn_t DECLDIR nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    ENTER(device);
    NEED(index);
    *index = device->index;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    ENTER(device);
    NEED(minorNumber);
    *minorNumber = device->minor;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER(device);
    return sim_leave(sim_copy_str(name, length, device->name));
}

nvmlReturn_t DECLDIR nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER(device);
    return sim_leave(sim_copy_str(uuid, length, device->uuid));
}

nvmlReturn_t DECLDIR nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    ENTER(device);
    return sim_leave(sim_copy_str(serial, length, device->serial));
}

nvmlReturn_t DECLDIR nvmlDeviceGetBoardPartNumber(nvmlDevice_t device, char *partNumber, unsigned int length)
{
    ENTER(device);
    if (!device->board_part[0]) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    return sim_leave(sim_copy_str(partNumber, length, device->board_part));
}

nvmlReturn_t DECLDIR nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    ENTER(device);
    return sim_leave(sim_copy_str(version, length, device->vbios));
}

nvmlReturn_t DECLDIR nvmlDeviceGetInforomImageVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    ENTER(device);
    return sim_leave(sim_copy_str(version, length, device->inforom_image));
}

nvmlReturn_t DECLDIR nvmlDeviceGetInforomVersion(nvmlDevice_t device, nvmlInforomObject_t object, char *version,
                                                unsigned int length)
{
    const char *v;
    ENTER(device);
    switch (object) {
    case NVML_INFOROM_OEM: v = "2.1"; break;
    case NVML_INFOROM_ECC: v = device->ecc ? device->inforom_ecc : NULL; break;
    case NVML_INFOROM_POWER: return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    default: return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (!v) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    return sim_leave(sim_copy_str(version, length, v));
}

nvmlReturn_t DECLDIR nvmlDeviceValidateInforom(nvmlDevice_t device)
{
    ENTER(device);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    ENTER(device);
    NEED(type);
    *type = (nvmlBrandType_t)device->brand;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
    ENTER(device);
    NEED(arch);
    *arch = device->arch;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    ENTER(device);
    NEED(major && minor);
    *major = device->cc_major;
    *minor = device->cc_minor;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMultiGpuBoard(nvmlDevice_t device, unsigned int *multiGpuBool)
{
    ENTER(device);
    NEED(multiGpuBool);
    *multiGpuBool = 0;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *mode)
{
    ENTER(device);
    NEED(mode);
    *mode = g_sim.passthrough ? NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH : NVML_GPU_VIRTUALIZATION_MODE_NONE;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ PCI */

static void fill_pci(nvmlPciInfo_t *pci, unsigned domain, unsigned bus, unsigned dev, unsigned devid,
                     unsigned subsys)
{
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, domain, bus, dev);
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, domain, bus, dev);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = devid;
    pci->pciSubSystemId = subsys;
}

/* The v1/v2 structures end before the 32-byte busId: write only that prefix, so old callers' smaller
 * buffers are not overrun. Their busId (first field) uses the 4-digit-domain legacy form. */
#define PCI_LEGACY_PREFIX offsetof(nvmlPciInfo_t, busId)

nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER(device);
    NEED(pci);
    fill_pci(pci, device->domain, device->bus, device->device, device->pci_device_id, device->pci_subsystem_id);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlPciInfo_t full;
    ENTER(device);
    NEED(pci);
    fill_pci(&full, device->domain, device->bus, device->device, device->pci_device_id, device->pci_subsystem_id);
    memcpy(pci, &full, PCI_LEGACY_PREFIX);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

/* PCIe link generation and width (machine.json `pcie`; the link trains to its maximum, as recorded). */
#define PCIE_GETTER(fn, field)                                                                          \
    nvmlReturn_t DECLDIR fn(nvmlDevice_t device, unsigned int *value)                                   \
    {                                                                                                   \
        ENTER(device);                                                                                  \
        NEED(value);                                                                                    \
        *value = device->field;                                                                         \
        return sim_leave(NVML_SUCCESS);                                                                 \
    }
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_max_gen)
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_max_width)
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)

/* ------------------------------------------------------------------------------------ memory */

/* Memory in use by clients: the fixture's, plus the running workloads' (with their contexts), never more
 * than there is. */
static unsigned long long used_memory(nvmlDevice_t device)
{
    unsigned long long room = device->mem_total - device->mem_reserved;
    unsigned long long used = device->mem_used + sim_load_memory(device);
    return used < room ? used : room;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENTER(device);
    NEED(memory);
    /* v1 has no "reserved": the driver counts it as used. */
    memory->total = device->mem_total;
    memory->used = device->mem_reserved + used_memory(device);
    memory->free = device->mem_total - memory->used;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER(device);
    NEED(memory);
    if (memory->version != nvmlMemory_v2) return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = device->mem_total;
    memory->reserved = device->mem_reserved;
    memory->used = used_memory(device);
    memory->free = device->mem_total - device->mem_reserved - memory->used;
    return sim_leave(NVML_SUCCESS);
}

/* Running processes: the compute workloads of the sim root (load.c); no graphics or MPS processes run.
 * nvml.h: *infoCount 0 (or too small) asks for the size: INSUFFICIENT_SIZE with the count, or SUCCESS and 0
 * when none run. v1 has no instance ids; a process outside MIG has 0xFFFFFFFF for both. */
#define SIM_MAX_PROCS 256
static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t size,
                                   int with_ids, int graphics)
{
    const sim_load *found[SIM_MAX_PROCS];
    unsigned n = graphics ? 0 : sim_running(device, found, SIM_MAX_PROCS), k;
    if (n > SIM_MAX_PROCS) n = SIM_MAX_PROCS;
    if (n == 0) {
        *infoCount = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (k = 0; k < n; k++) {
        nvmlProcessInfo_v2_t p;
        memset(&p, 0, sizeof p);
        p.pid = found[k]->pid;
        p.usedGpuMemory = found[k]->memory_mib << 20;
        p.gpuInstanceId = found[k]->gi;
        p.computeInstanceId = found[k]->ci;
        if (with_ids) memcpy((char *)infos + k * size, &p, size);
        else {
            nvmlProcessInfo_v1_t v1 = {.pid = p.pid, .usedGpuMemory = p.usedGpuMemory};
            memcpy((char *)infos + k * size, &v1, size);
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

#define PROCESS_GETTER(fn, type, with_ids, graphics)                                                   \
    nvmlReturn_t DECLDIR fn(nvmlDevice_t device, unsigned int *infoCount, type *infos)                  \
    {                                                                                                   \
        ENTER(device);                                                                                  \
        NEED(infoCount);                                                                                \
        return sim_leave(list_processes(device, infoCount, infos, sizeof(type), with_ids, graphics));   \
    }
PROCESS_GETTER(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, 0, 0)
PROCESS_GETTER(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, 1, 0)
PROCESS_GETTER(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, 1, 0)
PROCESS_GETTER(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, 0, 1)
PROCESS_GETTER(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t, 1, 1)
PROCESS_GETTER(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, 1, 1)
PROCESS_GETTER(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t, 0, 1)
PROCESS_GETTER(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, 1, 1)
PROCESS_GETTER(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, 1, 1)

/* ------------------------------------------------------------------------------------ NUMA, affinity */

nvmlReturn_t DECLDIR nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    ENTER(device);
    NEED(node);
    /* Real NVML: "only applies to platforms where the GPUs are NUMA nodes" (coherent GPU memory). On
     * PCIe/SXM x86 boxes it is NOT_SUPPORTED; the CPU-side node comes from sysfs or the affinity calls. */
    if (!device->has_gpu_numa) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *node = device->gpu_numa_node;
    return sim_leave(NVML_SUCCESS);
}

static void set_bits(unsigned long *set, unsigned size, int lo, int hi)
{
    const int bits = (int)(8 * sizeof(unsigned long));
    int b;
    for (b = lo; b <= hi; b++)
        if (b >= 0 && b / bits < (int)size) set[b / bits] |= 1UL << (b % bits);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                unsigned long *nodeSet, nvmlAffinityScope_t scope)
{
    ENTER(device);
    NEED(nodeSet && nodeSetSize > 0 && scope <= NVML_AFFINITY_SCOPE_SOCKET);
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    if (device->numa_node >= 0)
        set_bits(nodeSet, nodeSetSize, device->numa_node, device->numa_node);
    else /* no node of its own (sysfs numa_node -1, as in VMs): the real H200 VM answered node 0, its only one */
        set_bits(nodeSet, nodeSetSize, 0, g_sim.nnuma ? (int)g_sim.nnuma - 1 : 0);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                        unsigned long *cpuSet, nvmlAffinityScope_t scope)
{
    int n;
    ENTER(device);
    NEED(cpuSet && cpuSetSize > 0 && scope <= NVML_AFFINITY_SCOPE_SOCKET);
    memset(cpuSet, 0, cpuSetSize * sizeof *cpuSet);
    n = device->numa_node;
    if (n >= 0 && (unsigned)n < g_sim.nnuma)
        set_bits(cpuSet, cpuSetSize, g_sim.numa_cpu_lo[n], g_sim.numa_cpu_hi[n]);
    else /* no affinity: every CPU is as close as any other */
        set_bits(cpuSet, cpuSetSize, 0, g_sim.ncpus - 1);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet)
{
    return nvmlDeviceGetCpuAffinityWithinScope(device, cpuSetSize, cpuSet, NVML_AFFINITY_SCOPE_NODE);
}

/* ------------------------------------------------------------------------------------ modes */

nvmlReturn_t DECLDIR nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    ENTER(device);
    NEED(mode);
    *mode = device->persistence ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

/* MIG mode, MIG device handles and instances: mig.c */

nvmlReturn_t DECLDIR nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    ENTER(device);
    NEED(mode);
    *mode = NVML_COMPUTEMODE_DEFAULT;
    return sim_leave(NVML_SUCCESS);
}

/* The H200 answers display mode 1 (its -q: "Requested functionality has been deprecated") and active 0. */
nvmlReturn_t DECLDIR nvmlDeviceGetDisplayMode(nvmlDevice_t device, nvmlEnableState_t *display)
{
    ENTER(device);
    NEED(display);
    *display = device->display_mode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetDisplayActive(nvmlDevice_t device, nvmlEnableState_t *isActive)
{
    ENTER(device);
    NEED(isActive);
    *isActive = NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending)
{
    ENTER(device);
    NEED(current && pending);
    if (!device->ecc) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *current = *pending = NVML_FEATURE_ENABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    ENTER(device);
    NEED(eccCounts && errorType < NVML_MEMORY_ERROR_TYPE_COUNT && counterType < NVML_ECC_COUNTER_TYPE_COUNT);
    if (!device->ecc) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    /* Uncorrected (double-bit) errors are what `inject ecc-dbe` appends; nothing injects corrected ones. */
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? sim_events_dbe_total(device->index) : 0;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ telemetry */

nvmlReturn_t DECLDIR nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                             unsigned int *temp)
{
    ENTER(device);
    NEED(temp && sensorType == NVML_TEMPERATURE_GPU);
    {
        sim_reading now;
        sim_read(device, &now);
        *temp = now.temp_c;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    ENTER(device);
    NEED(power);
    {
        sim_reading now; /* nvml.h: on Ampere and later, the average over the last second */
        sim_read(device, &now);
        *power = now.power_mw;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    ENTER(device);
    NEED(limit);
    *limit = device->power_limit_mw;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *defaultLimit)
{
    return nvmlDeviceGetPowerManagementLimit(device, defaultLimit);
}

nvmlReturn_t DECLDIR nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    return nvmlDeviceGetPowerManagementLimit(device, limit);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                                 unsigned int *maxLimit)
{
    ENTER(device);
    NEED(minLimit && maxLimit);
    *minLimit = device->power_min_mw;
    *maxLimit = device->power_limit_mw;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    ENTER(device);
    NEED(utilization);
    {
        const struct nvmlDevice_st *g = device->is_mig ? device->parent : device;
        sim_reading now;
        /* nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not currently supported." */
        if (g->has_mig && g->mig_current == NVML_DEVICE_MIG_ENABLE) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
        sim_read(device, &now);
        utilization->gpu = now.util;
        utilization->memory = now.mem_util;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPerformanceState(nvmlDevice_t device, nvmlPstates_t *pState)
{
    ENTER(device);
    NEED(pState);
    *pState = (nvmlPstates_t)device->pstate;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerState(nvmlDevice_t device, nvmlPstates_t *pState)
{
    return nvmlDeviceGetPerformanceState(device, pState);
}

nvmlReturn_t DECLDIR nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    ENTER(device);
    NEED(clock && type < NVML_CLOCK_COUNT);
    {
        sim_reading now;
        sim_read(device, &now);
        switch (type) {
        case NVML_CLOCK_GRAPHICS:
        case NVML_CLOCK_SM: *clock = now.sm_mhz; break;
        case NVML_CLOCK_VIDEO: *clock = now.video_mhz; break;
        default: *clock = device->clocks[type]; break; /* memory: one clock, as recorded under load */
        }
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock)
{
    ENTER(device);
    NEED(clock && type < NVML_CLOCK_COUNT);
    *clock = device->max_clocks[type];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMaxCustomerBoostClock(nvmlDevice_t device, nvmlClockType_t clockType,
                                                       unsigned int *clockMHz)
{
    return nvmlDeviceGetMaxClockInfo(device, clockType, clockMHz);
}

/* Clock-event reasons ("throttle reasons" before R535 renamed them; both names are exported). */
static nvmlReturn_t clock_reasons(nvmlDevice_t device, unsigned long long *reasons, int supported)
{
    ENTER(device);
    NEED(reasons);
    if (supported) {
        *reasons = nvmlClocksThrottleReasonAll;
    } else {
        sim_reading now;
        sim_read(device, &now);
        *reasons = now.reasons;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *clocksThrottleReasons)
{
    return clock_reasons(device, clocksThrottleReasons, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t device,
                                                                unsigned long long *supportedClocksThrottleReasons)
{
    return clock_reasons(device, supportedClocksThrottleReasons, 1);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return clock_reasons(device, reasons, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return clock_reasons(device, reasons, 1);
}

/* ------------------------------------------------------------------------------------ topology */

nvmlReturn_t DECLDIR nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                        nvmlGpuTopologyLevel_t *pathInfo)
{
    nvmlReturn_t r;
    ENTER(device1);
    r = sim_check_dev(device2);
    if (r != NVML_SUCCESS) return sim_leave(r);
    NEED(pathInfo);
    *pathInfo = (nvmlGpuTopologyLevel_t)g_sim.topo[device1->index][device2->index];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level,
                                                     unsigned int *count, nvmlDevice_t *deviceArray)
{
    unsigned i, n = 0, cap;
    ENTER(device);
    NEED(count);
    cap = deviceArray ? *count : 0;
    for (i = 0; i < g_sim.ngpus; i++) {
        if (i == device->index || g_sim.topo[device->index][i] > (unsigned)level) continue;
        if (n < cap) deviceArray[n] = &g_sim.gpus[i];
        n++;
    }
    /* count 0 (or no array) asks for the size; a non-zero count is filled up to its capacity. */
    *count = cap && n > cap ? cap : n;
    return sim_leave(NVML_SUCCESS);
}

static int link_active(const struct nvmlDevice_st *d, unsigned link)
{
    /* Links into an NVSwitch fabric are trained by nv-fabricmanager: without it they stay down. */
    return !(d->links[link].remote_type == NVML_NVLINK_DEVICE_TYPE_SWITCH && g_sim.fm_required && !g_sim.fm_running);
}

static int nvlink_peer(const struct nvmlDevice_st *a, const struct nvmlDevice_st *b)
{
    unsigned i, j;
    for (i = 0; i < a->nlinks; i++) {
        if (!link_active(a, i)) continue;
        if (a->links[i].remote_type == NVML_NVLINK_DEVICE_TYPE_SWITCH) {
            for (j = 0; j < b->nlinks; j++)
                if (b->links[j].remote_type == NVML_NVLINK_DEVICE_TYPE_SWITCH && link_active(b, j)) return 1;
        } else {
            char bid[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
            snprintf(bid, sizeof bid, NVML_DEVICE_PCI_BUS_ID_FMT, b->domain, b->bus, b->device);
            if (strcasecmp(bid, a->links[i].remote_bus_id) == 0) return 1;
        }
    }
    return 0;
}

nvmlReturn_t DECLDIR nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                           nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus)
{
    nvmlReturn_t r;
    int nv, level;
    ENTER(device1);
    r = sim_check_dev(device2);
    if (r != NVML_SUCCESS) return sim_leave(r);
    NEED(p2pStatus && p2pIndex < NVML_P2P_CAPS_INDEX_UNKNOWN);
    nv = nvlink_peer(device1, device2);
    level = g_sim.topo[device1->index][device2->index];
    if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK)
        *p2pStatus = nv ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    else if (device1 == device2 || nv || level <= NVML_TOPOLOGY_HOSTBRIDGE)
        *p2pStatus = NVML_P2P_STATUS_OK;
    else /* PCIe P2P across host bridges / sockets is what chipsets refuse */
        *p2pStatus = NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ NVLink */

#define ENTER_LINK(d, link)                                                                             \
    do {                                                                                                \
        ENTER(d);                                                                                       \
        if ((d)->nlinks == 0) return sim_leave(NVML_ERROR_NOT_SUPPORTED);                               \
        NEED((link) < (d)->nlinks);                                                                     \
    } while (0)

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    ENTER_LINK(device, link);
    NEED(isActive);
    *isActive = link_active(device, link) ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)
{
    ENTER_LINK(device, link);
    NEED(version);
    switch (device->arch) {
    case NVML_DEVICE_ARCH_HOPPER: *version = 4; break;
    case NVML_DEVICE_ARCH_AMPERE: *version = 3; break;
    case NVML_DEVICE_ARCH_VOLTA: *version = 2; break;
    default: *version = 1; break;
    }
    return sim_leave(NVML_SUCCESS);
}

static void remote_pci(const sim_link *l, nvmlPciInfo_t *pci)
{
    unsigned d = 0, b = 0, v = 0, f = 0;
    sscanf(l->remote_bus_id, "%x:%x:%x.%x", &d, &b, &v, &f);
    fill_pci(pci, d, b, v, l->remote_device_id, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    ENTER_LINK(device, link);
    NEED(pci);
    remote_pci(&device->links[link], pci);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    nvmlPciInfo_t full;
    ENTER_LINK(device, link);
    NEED(pci);
    remote_pci(&device->links[link], &full);
    memcpy(pci, &full, PCI_LEGACY_PREFIX);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                        nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    ENTER_LINK(device, link);
    NEED(pNvLinkDeviceType);
    *pNvLinkDeviceType = (nvmlIntNvLinkDeviceType_t)device->links[link].remote_type;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link,
                                                  nvmlNvLinkCapability_t capability, unsigned int *capResult)
{
    ENTER_LINK(device, link);
    NEED(capResult && capability < NVML_NVLINK_CAP_COUNT);
    /* P2P, system memory access, atomics: yes; SLI bridge / valid-link: the link exists. */
    *capResult = 1;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ GPU fabric */

static void fabric_values(const struct nvmlDevice_st *d, unsigned *state, nvmlReturn_t *status)
{
    if (!d->fabric_member) { /* Hopper without an NVSwitch fabric, as the recorded H200 VM answers */
        *state = SIM_GPU_FABRIC_STATE_NOT_SUPPORTED;
        *status = NVML_SUCCESS;
    } else if (g_sim.fm_required && !g_sim.fm_running) {
        *state = SIM_GPU_FABRIC_STATE_NOT_STARTED;
        *status = (nvmlReturn_t)SIM_ERROR_NOT_READY;
    } else {
        *state = SIM_GPU_FABRIC_STATE_COMPLETED;
        *status = NVML_SUCCESS;
    }
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, simGpuFabricInfoArg_t *arg)
{
    simGpuFabricInfo_t *info = (simGpuFabricInfo_t *)arg;
    ENTER(device);
    NEED(info);
    if (!device->has_fabric) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    memset(info, 0, sizeof *info);
    fabric_values(device, &info->state, &info->status);
    if (info->state == SIM_GPU_FABRIC_STATE_COMPLETED) {
        memcpy(info->clusterUuid, device->cluster_uuid, sizeof info->clusterUuid);
        info->cliqueId = device->clique_id;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, simGpuFabricInfoVArg_t *arg)
{
    simGpuFabricInfoV_t *info = (simGpuFabricInfoV_t *)arg;
    unsigned version;
    size_t size;
    ENTER(device);
    NEED(info);
    version = info->version;
    if (version == SIM_GPU_FABRIC_INFO_V3) size = sizeof(simGpuFabricInfoV_t);
    else if (version == SIM_GPU_FABRIC_INFO_V2) size = offsetof(simGpuFabricInfoV_t, healthSummary);
    else return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (!device->has_fabric) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    {
        simGpuFabricInfoV_t v;
        memset(&v, 0, sizeof v);
        v.version = version;
        fabric_values(device, &v.state, &v.status);
        if (v.state == SIM_GPU_FABRIC_STATE_COMPLETED) {
            memcpy(v.clusterUuid, device->cluster_uuid, sizeof v.clusterUuid);
            v.cliqueId = device->clique_id;
            v.healthSummary = 1; /* NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY */
        }
        memcpy(info, &v, size); /* a v2 caller's struct is 4 bytes shorter */
    }
    return sim_leave(NVML_SUCCESS);
}
