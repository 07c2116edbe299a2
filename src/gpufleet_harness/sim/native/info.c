/* The board, PCIe, firmware and counter getters a real H200 answered with driver 580.159.04
 * (tests/realgpu/h200-580.159.04/nvml-probe.json): values from machine.json, and the counters that move on
 * a real GPU (energy) derived from the clock so that they only grow. A getter whose machine.json entry is
 * null answers NOT_SUPPORTED, as older GPUs do (machine.py decides per architecture, from nvml.h's "For
 * <architecture> or newer" notes). */
#include "sim.h"

#include <stdio.h>
#include <string.h>

#define ENTER(d)                                                                                        \
    do {                                                                                                \
        nvmlReturn_t r_ = sim_enter_dev(d);                                                             \
        if (r_ != NVML_SUCCESS) return r_;                                                              \
    } while (0)
#define NEED(cond)                                                                                      \
    do {                                                                                                \
        if (!(cond)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);                                     \
    } while (0)
#define SUPPORTED(cond)                                                                                 \
    do {                                                                                                \
        if (!(cond)) return sim_leave(NVML_ERROR_NOT_SUPPORTED);                                        \
    } while (0)

/* An `unsigned int` getter: the value of `expr` (of `device`) when `ok`, else NOT_SUPPORTED. */
#define UINT_GETTER(fn, ok, expr)                                                                       \
    nvmlReturn_t DECLDIR fn(nvmlDevice_t device, unsigned int *value)                                   \
    {                                                                                                   \
        ENTER(device);                                                                                  \
        NEED(value);                                                                                    \
        SUPPORTED(ok);                                                                                  \
        *value = (expr);                                                                                \
        return sim_leave(NVML_SUCCESS);                                                                 \
    }

static int mig_enabled(const struct nvmlDevice_st *d)
{
    const struct nvmlDevice_st *g = d->is_mig ? d->parent : d;
    return g->has_mig && g->mig_current == NVML_DEVICE_MIG_ENABLE;
}

/* ------------------------------------------------------------------------------------ board identity */

UINT_GETTER(nvmlDeviceGetBoardId, 1, device->board_id)
UINT_GETTER(nvmlDeviceGetModuleId, 1, device->module_id)
UINT_GETTER(nvmlDeviceGetIrqNum, 1, device->irq)
UINT_GETTER(nvmlDeviceGetMemoryBusWidth, device->has_bus_width, device->bus_width)
/* nvml.h: NOT_SUPPORTED "if this query is not supported by the device or a mig device" */
UINT_GETTER(nvmlDeviceGetNumGpuCores, device->has_cores && !device->is_mig, device->cores)
UINT_GETTER(nvmlDeviceGetNumFans, 1, device->fans)
/* The infoROM's configuration checksum: 0 on the recorded H200. */
UINT_GETTER(nvmlDeviceGetInforomConfigurationChecksum, 1, 0)

nvmlReturn_t DECLDIR nvmlDeviceGetPdi(nvmlDevice_t device, simPdiArg_t *arg)
{
    simPdi_t *pdi = (simPdi_t *)arg;
    ENTER(device);
    NEED(pdi);
    /* pynvml 13.615.71 passes the struct without setting its version (0): the real driver answers that
     * too. Other versions than v1 are refused as nvml.h documents. */
    if (pdi->version != 0 && pdi->version != SIM_PDI_V1) return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    pdi->value = device->pdi;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPlatformInfo(nvmlDevice_t device, simPlatformInfoArg_t *arg)
{
    simPlatformInfo_t *info = (simPlatformInfo_t *)arg;
    unsigned version;
    ENTER(device);
    NEED(info);
    version = info->version;
    if (version != SIM_PLATFORM_INFO_V1 && version != SIM_PLATFORM_INFO_V2)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    SUPPORTED(device->has_platform);
    /* Outside an NVLink rack there is no IB GUID, chassis serial, slot or tray; the recorded VM says host
     * 1, module 8 (its module id). */
    memset(info, 0, sizeof *info);
    info->version = version;
    info->hostId = (unsigned char)device->platform_host_id;
    info->moduleId = (unsigned char)device->module_id;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetBusType(nvmlDevice_t device, nvmlBusType_t *type)
{
    ENTER(device);
    NEED(type);
    *type = NVML_BUS_TYPE_PCIE;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerSource(nvmlDevice_t device, nvmlPowerSource_t *powerSource)
{
    ENTER(device);
    NEED(powerSource);
    *powerSource = NVML_POWER_SOURCE_AC;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ memory */

nvmlReturn_t DECLDIR nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory)
{
    ENTER(device);
    NEED(bar1Memory);
    {
        /* the driver's own mappings, plus what the GPU's processes map (load.c): BAR1 grows with them, as
         * recorded (1.625 MiB idle, 1552.5 MiB with a process of 1542 MiB) */
        const struct nvmlDevice_st *g = device->is_mig ? device->parent : device;
        unsigned long long used = g->bar1_used + sim_load_bar1(g);
        if (used > g->bar1_total) used = g->bar1_total;
        bar1Memory->bar1Total = g->bar1_total;
        bar1Memory->bar1Used = used;
        bar1Memory->bar1Free = g->bar1_total - used;
    }
    return sim_leave(NVML_SUCCESS);
}

/* Without confidential computing nothing is protected: all memory the driver does not reserve is
 * unprotected (the recording: 146591680 KiB = total - reserved). */
nvmlReturn_t DECLDIR nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device, simConfComputeMemSizeInfoArg_t *arg)
{
    simConfComputeMemSizeInfo_t *info = (simConfComputeMemSizeInfo_t *)arg;
    ENTER(device);
    NEED(info);
    SUPPORTED(device->has_cc);
    info->protectedMemSizeKib = device->cc_protected_kib;
    info->unprotectedMemSizeKib = (device->mem_total - device->mem_reserved) / 1024 - device->cc_protected_kib;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred)
{
    ENTER(device);
    NEED(corrRows && uncRows && isPending && failureOccurred);
    /* nvml.h: NOT_SUPPORTED "If MIG is enabled or if the device doesn't support this feature". */
    SUPPORTED(device->has_remapped && !mig_enabled(device));
    *corrRows = device->remapped[0];
    *uncRows = device->remapped[1];
    *isPending = device->remapped[2];
    *failureOccurred = device->remapped[3];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetRepairStatus(nvmlDevice_t device, simRepairStatusArg_t *arg)
{
    simRepairStatus_t *status = (simRepairStatus_t *)arg;
    ENTER(device);
    NEED(status);
    /* As for the PDI, pynvml leaves the version 0 and the real driver answers. */
    if (status->version != 0 && status->version != SIM_REPAIR_STATUS_V1)
        return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    SUPPORTED(device->has_repair);
    status->bChannelRepairPending = device->repair[0];
    status->bTpcRepairPending = device->repair[1];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetAddressingMode(nvmlDevice_t device, simAddressingModeArg_t *arg)
{
    simAddressingMode_t *mode = (simAddressingMode_t *)arg;
    ENTER(device);
    NEED(mode);
    if (mode->version != SIM_ADDRESSING_MODE_V1) return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    SUPPORTED(device->has_addressing);
    mode->value = device->addressing_mode; /* NVML_DEVICE_ADDRESSING_MODE_NONE: neither HMM nor ATS */
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetC2cModeInfoV(nvmlDevice_t device, simC2cModeInfoArg_t *arg)
{
    simC2cModeInfo_t *info = (simC2cModeInfo_t *)arg;
    ENTER(device);
    NEED(info);
    SUPPORTED(device->has_c2c);
    info->isC2cEnabled = device->c2c_enabled; /* no chip-to-chip link outside Grace Hopper */
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ modes, firmware */

nvmlReturn_t DECLDIR nvmlDeviceGetAccountingMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    ENTER(device);
    NEED(mode);
    *mode = NVML_FEATURE_DISABLED;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGspFirmwareMode(nvmlDevice_t device, unsigned int *isEnabled,
                                                 unsigned int *defaultMode)
{
    ENTER(device);
    NEED(isEnabled && defaultMode);
    *isEnabled = *defaultMode = device->gsp ? 1 : 0;
    return sim_leave(NVML_SUCCESS);
}

/* The GSP firmware ships with the driver: its version is the driver's (580.159.04 on the recording). */
nvmlReturn_t DECLDIR nvmlDeviceGetGspFirmwareVersion(nvmlDevice_t device, char *version)
{
    ENTER(device);
    NEED(version);
    SUPPORTED(device->gsp);
    /* No length argument: NVML_GSP_FIRMWARE_VERSION_BUF_SIZE (0x40) is the caller's buffer. */
    {
        size_t n = strnlen(g_sim.driver_version, 0x3F);
        memcpy(version, g_sim.driver_version, n);
        version[n] = '\0';
    }
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ PCIe */

/* NVML_PCIE_LINK_MAX_SPEED_*: 1 = 2500 MBPS (gen 1) ... 5 = 32000 MBPS (gen 5): the generation. */
UINT_GETTER(nvmlDeviceGetPcieLinkMaxSpeed, 1, device->pcie_max_gen)
UINT_GETTER(nvmlDeviceGetPcieSpeed, 1, device->pcie_speed)
UINT_GETTER(nvmlDeviceGetPcieReplayCounter, 1, 0)

nvmlReturn_t DECLDIR nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter,
                                                unsigned int *value)
{
    ENTER(device);
    NEED(value && (counter == NVML_PCIE_UTIL_TX_BYTES || counter == NVML_PCIE_UTIL_RX_BYTES));
    /* KB/s over the last 20 ms: an idle GPU's driver traffic (the recording: 697 TX, -q 600-1800), more
     * while a workload runs (load.c). */
    {
        sim_reading now;
        sim_read(device, &now);
        *value = counter == NVML_PCIE_UTIL_TX_BYTES ? now.pcie_tx : now.pcie_rx;
    }
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ counters */

/* Energy since the driver loaded, in mJ: the integral of the GPU's power since boot on the sim clock
 * (CLOCK_BOOTTIME, one clock for every process of the host), workloads included (load.c), so it only grows
 * and grows with power, as on a real GPU. */
nvmlReturn_t DECLDIR nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    sim_reading now;
    ENTER(device);
    NEED(energy);
    SUPPORTED(device->has_energy && !device->is_mig);
    sim_read(device, &now);
    *energy = now.energy_mj;
    return sim_leave(NVML_SUCCESS);
}

enum { ENGINE_ENCODER, ENGINE_DECODER, ENGINE_JPG, ENGINE_OFA };

/* Video engines: what the running workloads drive (none by default; no workload drives the JPEG or optical
 * flow engines); the sampling period is the driver's 100 ms (the H200 recorded [0, 100000] for all four).
 * nvml.h: not supported with MIG on; JPG and OFA: Turing or newer. */
static nvmlReturn_t engine_utilization(nvmlDevice_t device, unsigned int *utilization, unsigned int *periodUs,
                                       int engine)
{
    sim_reading now;
    ENTER(device);
    NEED(utilization && periodUs);
    SUPPORTED(!mig_enabled(device));
    SUPPORTED(engine < ENGINE_JPG || device->arch >= NVML_DEVICE_ARCH_TURING);
    sim_read(device, &now);
    *utilization = engine == ENGINE_DECODER ? now.dec : engine == ENGINE_ENCODER ? now.enc : 0;
    *periodUs = 100000;
    return sim_leave(NVML_SUCCESS);
}

#define ENGINE_GETTER(fn, engine)                                                                       \
    nvmlReturn_t DECLDIR fn(nvmlDevice_t device, unsigned int *utilization, unsigned int *samplingPeriodUs) \
    {                                                                                                   \
        return engine_utilization(device, utilization, samplingPeriodUs, engine);                       \
    }
ENGINE_GETTER(nvmlDeviceGetEncoderUtilization, ENGINE_ENCODER)
ENGINE_GETTER(nvmlDeviceGetDecoderUtilization, ENGINE_DECODER)
ENGINE_GETTER(nvmlDeviceGetJpgUtilization, ENGINE_JPG)
ENGINE_GETTER(nvmlDeviceGetOfaUtilization, ENGINE_OFA)

/* ------------------------------------------------------------------------------------ supported clocks */

/* count in: the array's size; out: the clocks there are (INSUFFICIENT_SIZE when the array is too small). */
static nvmlReturn_t copy_clocks(const unsigned int *have, unsigned int n, unsigned int *count, unsigned int *out)
{
    unsigned int k;
    if (n == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (!out || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (k = 0; k < n; k++) out[k] = have[k];
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count,
                                                       unsigned int *clocksMHz)
{
    ENTER(device);
    NEED(count);
    return sim_leave(copy_clocks(device->mem_clocks, device->nmem_clocks, count, clocksMHz));
}

/* The same graphics clocks at every memory clock (as the recorded H200 lists them); NOT_FOUND for a memory
 * clock the GPU does not have, as nvml.h documents. */
nvmlReturn_t DECLDIR nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t device, unsigned int memoryClockMHz,
                                                         unsigned int *count, unsigned int *clocksMHz)
{
    unsigned int k;
    ENTER(device);
    NEED(count);
    for (k = 0; k < device->nmem_clocks && device->mem_clocks[k] != memoryClockMHz; k++)
        ;
    if (k == device->nmem_clocks) return sim_leave(device->nmem_clocks ? NVML_ERROR_NOT_FOUND : NVML_ERROR_NOT_SUPPORTED);
    return sim_leave(copy_clocks(device->gfx_clocks, device->ngfx_clocks, count, clocksMHz));
}
