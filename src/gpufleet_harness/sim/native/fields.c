/* nvmlDeviceGetFieldValues: many readings in one call, each with its own return code (nvml.h: the call
 * succeeds "if any values in values were populated"; each value's nvmlReturn must be checked).
 *
 * Answered: the fields whose meaning nvml.h defines as one of the getters the simulator implements (the
 * memory temperature, ECC mode and counts, energy, PCIe replays, remapped rows, power average, instant and
 * limits), with the getter's value at the same sim clock and its NOT_SUPPORTED rules. Every other field id
 * the driver knows answers NOT_SUPPORTED in its own nvmlReturn; the NVLink throughput counters too (the
 * H200 in its VM, without NVLink, answered NOT_SUPPORTED; what a GPU with NVLinks answers is not recorded).
 * An id the driver does not know (0, or past NVML_FI_MAX) answers INVALID_ARGUMENT. The value types are
 * the ones of the getters' C types (not recorded on a real GPU: tests/realgpu/fields_check.py records them).
 *
 * The ids are nvml.h's; the 11.8 header lacks the newer ones, so they are spelled out here. */
#include "sim.h"

#include <string.h>
#include <time.h>

#define FI_ECC_CURRENT 1
#define FI_ECC_PENDING 2
#define FI_ECC_SBE_VOL_TOTAL 3
#define FI_ECC_DBE_VOL_TOTAL 4
#define FI_ECC_SBE_AGG_TOTAL 5
#define FI_ECC_DBE_AGG_TOTAL 6
#define FI_MEMORY_TEMP 82
#define FI_TOTAL_ENERGY_CONSUMPTION 83
#define FI_PCIE_REPLAY_COUNTER 94
#define FI_NVLINK_THROUGHPUT_RAW_TX 140
#define FI_NVLINK_THROUGHPUT_RAW_RX 141
#define FI_REMAPPED_COR 142
#define FI_REMAPPED_UNC 143
#define FI_REMAPPED_PENDING 144
#define FI_REMAPPED_FAILURE 145
#define FI_POWER_AVERAGE 185
#define FI_POWER_INSTANT 186
#define FI_POWER_MIN_LIMIT 187
#define FI_POWER_MAX_LIMIT 188
#define FI_POWER_DEFAULT_LIMIT 189
#define FI_POWER_CURRENT_LIMIT 190
#define FI_ENERGY 191
#define FI_POWER_REQUESTED_LIMIT 192
#define FI_MAX 310 /* NVML_FI_MAX of the 13.x header (driver 580): one past the last id */

#define POWER_SCOPE_GPU 0 /* the power fields' scopeId: 0 the GPU, 1 the module (NVIDIA CPU + GPU), 2 GPU base */

/* GA100 (A100, A30, A800: PCI device ids 0x20B0-0x20FF) lacks the one-second power average: nvml.h,
 * NVML_FI_DEV_POWER_AVERAGE "supported on Ampere (except GA100) or newer architectures". */
static int has_power_average(const struct nvmlDevice_st *g)
{
    unsigned id = g->pci_device_id >> 16;
    if (g->arch < NVML_DEVICE_ARCH_AMPERE) return 0;
    return !(g->arch == NVML_DEVICE_ARCH_AMPERE && id >= 0x20B0 && id <= 0x20FF);
}

static void put_uint(nvmlFieldValue_t *v, unsigned value)
{
    v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
    v->value.uiVal = value;
    v->nvmlReturn = NVML_SUCCESS;
}

static void put_ull(nvmlFieldValue_t *v, unsigned long long value)
{
    v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    v->value.ullVal = value;
    v->nvmlReturn = NVML_SUCCESS;
}

static int mig_on(const struct nvmlDevice_st *g)
{
    return g->has_mig && g->mig_current == NVML_DEVICE_MIG_ENABLE;
}

/* One field of `device` (a GPU or a MIG device; `g` its GPU), with `now` read once for the whole call. */
static void field(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g, const sim_reading *now,
                  nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId;
    v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    if (id == 0 || id >= FI_MAX) {
        v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return;
    }
    switch (id) {
    case FI_ECC_CURRENT:
    case FI_ECC_PENDING:
        if (g->ecc) put_uint(v, 1);
        break;
    case FI_ECC_SBE_VOL_TOTAL:
    case FI_ECC_SBE_AGG_TOTAL:
        if (g->ecc) put_ull(v, 0); /* nothing injects corrected errors */
        break;
    case FI_ECC_DBE_VOL_TOTAL:
    case FI_ECC_DBE_AGG_TOTAL:
        if (g->ecc) put_ull(v, sim_events_dbe_total(g->index));
        break;
    case FI_MEMORY_TEMP:
        if (g->has_mem_temp) put_uint(v, now->mem_temp_c);
        break;
    case FI_TOTAL_ENERGY_CONSUMPTION:
    case FI_ENERGY:
        if (g->has_energy && !device->is_mig) put_ull(v, now->energy_mj);
        break;
    case FI_PCIE_REPLAY_COUNTER:
        put_uint(v, 0);
        break;
    case FI_REMAPPED_COR:
    case FI_REMAPPED_UNC:
    case FI_REMAPPED_PENDING:
    case FI_REMAPPED_FAILURE:
        if (g->has_remapped && !mig_on(g)) put_uint(v, g->remapped[id - FI_REMAPPED_COR]);
        break;
    case FI_POWER_AVERAGE:
    case FI_POWER_INSTANT:
    case FI_POWER_MIN_LIMIT:
    case FI_POWER_MAX_LIMIT:
    case FI_POWER_DEFAULT_LIMIT:
    case FI_POWER_CURRENT_LIMIT:
    case FI_POWER_REQUESTED_LIMIT:
        if (v->scopeId != POWER_SCOPE_GPU) break; /* no module (Grace) and no base power on these boards */
        if (id == FI_POWER_AVERAGE && has_power_average(g)) put_uint(v, now->power_mw);
        else if (id == FI_POWER_INSTANT) put_uint(v, now->instant_mw);
        else if (id == FI_POWER_MIN_LIMIT) put_uint(v, g->power_min_mw);
        else if (id != FI_POWER_AVERAGE) put_uint(v, g->power_limit_mw); /* max = default = current = requested */
        break;
    default: /* the NVLink throughput counters among them */
        break;
    }
}

nvmlReturn_t DECLDIR nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    const struct nvmlDevice_st *g;
    sim_reading now;
    struct timespec ts;
    long long stamp;
    int k;
    nvmlReturn_t r = sim_enter_dev(device);
    if (r != NVML_SUCCESS) return r;
    if (!values || valuesCount <= 0) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    g = device->is_mig ? device->parent : device;
    sim_read(device, &now);
    clock_gettime(CLOCK_REALTIME, &ts);
    stamp = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000; /* µs since 1970 */
    for (k = 0; k < valuesCount; k++) {
        nvmlFieldValue_t *v = &values[k];
        memset(&v->value, 0, sizeof v->value);
        v->timestamp = stamp;
        v->latencyUsec = 0;
        field(device, g, &now, v);
    }
    return sim_leave(NVML_SUCCESS);
}
