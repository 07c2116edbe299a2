/* nvmlDeviceGetFieldValues: many readings in one call, each with its own return code (nvml.h: the call
 * succeeds "if any values in values were populated"; each value's nvmlReturn must be checked).
 *
 * Two ways to answer, by machine.json's `field_values` (docs/simulator.md, "Field values"):
 *
 * - the recorded H200 (`h200-580.159.04`: firecracker-vm-h200, hgx-h200) answers every id as a real H200
 *   with driver 580.159.04 did (tests/realgpu/h200-580.159.04-host4-fields/fields-check.json): the same
 *   nvmlReturn and value type for every id 1..319, the recorded value where it is a fact of the model or
 *   driver (limits, capabilities, counts of a healthy GPU), and the simulator's own reading where it moves
 *   (the getter the field mirrors, at the same sim clock);
 * - every other fixture keeps the rules written before that recording (the fields whose meaning nvml.h
 *   defines as a getter the simulator implements; NOT_SUPPORTED otherwise; INVALID_ARGUMENT for 0 and ids
 *   from 310), with the value types the 580 driver uses, since NVML, not the GPU, picks a field's type
 *   (recorded on the H200 only: a guess for the 535 fixtures).
 *
 * The ids are nvml.h's; the 11.8 header lacks most of them, so they are spelled out here. */
#include "sim.h"

#include <string.h>
#include <time.h>

#define FI_ECC_CURRENT 1
#define FI_ECC_PENDING 2
#define FI_ECC_SBE_VOL_TOTAL 3
#define FI_ECC_DBE_VOL_TOTAL 4
#define FI_ECC_SBE_AGG_TOTAL 5
#define FI_ECC_DBE_AGG_TOTAL 6
#define FI_PERF_POLICY_POWER 74              /* ns the power cap held the clocks */
#define FI_PERF_POLICY_LOW_UTILIZATION 78    /* ns low utilization held them */
#define FI_PERF_POLICY_TOTAL_APP_CLOCKS 80   /* ns below application clocks */
#define FI_PERF_POLICY_TOTAL_BASE_CLOCKS 81  /* ns below base clocks */
#define FI_MEMORY_TEMP 82
#define FI_TOTAL_ENERGY_CONSUMPTION 83
#define FI_PCIE_REPLAY_COUNTER 94
#define FI_NVLINK_THROUGHPUT_DATA_TX 138 /* 138-141: data TX, data RX, raw TX, raw RX, KiB */
#define FI_NVLINK_THROUGHPUT_RAW_RX 141
#define FI_REMAPPED_COR 142
#define FI_REMAPPED_UNC 143
#define FI_REMAPPED_PENDING 144
#define FI_REMAPPED_FAILURE 145
#define FI_PCIE_L0_TO_RECOVERY_COUNTER 169
#define FI_PCIE_COUNT_CORRECTABLE_ERRORS 173 /* 173-183: the PCIe error counters */
#define FI_PCIE_COUNT_LANE_ERROR 183
#define FI_IS_RESETLESS_MIG_SUPPORTED 184
#define FI_POWER_AVERAGE 185
#define FI_POWER_INSTANT 186
#define FI_POWER_MIN_LIMIT 187
#define FI_POWER_MAX_LIMIT 188
#define FI_POWER_DEFAULT_LIMIT 189
#define FI_POWER_CURRENT_LIMIT 190
#define FI_ENERGY 191
#define FI_POWER_REQUESTED_LIMIT 192
#define FI_PCIE_COUNT_TX_BYTES 197
#define FI_PCIE_COUNT_RX_BYTES 198
#define FI_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE 199
#define FI_MAX 310 /* NVML_FI_MAX of the 13.x header: the default rules' first unknown id */

/* The power fields' scopeId (nvml.h NVML_POWER_SCOPE_*): the GPU, the module (an NVIDIA CPU and the GPU),
 * the GPU's memory. */
#define POWER_SCOPE_GPU 0
#define POWER_SCOPE_MODULE 1
#define POWER_SCOPE_MEMORY 2

#define VT_DOUBLE NVML_VALUE_TYPE_DOUBLE
#define VT_UINT NVML_VALUE_TYPE_UNSIGNED_INT
#define VT_ULL NVML_VALUE_TYPE_UNSIGNED_LONG_LONG

/* ---------------------------------------------------------------------- the 580 driver's field table */

enum { FK_ANSWER, FK_NOT_SUPPORTED, FK_UNTOUCHED, FK_UNKNOWN };

typedef struct {
    unsigned short first, last;
    unsigned char kind, type;
} fi_range;

/* What the H200 with driver 580.159.04 answered for each id 1..319, idle, in one call asking for all of
 * them: FK_ANSWER (SUCCESS, a value of `type`), FK_NOT_SUPPORTED (NOT_SUPPORTED with `type` set),
 * FK_UNTOUCHED (SUCCESS with neither type nor value written: the caller's zeros), FK_UNKNOWN
 * (INVALID_ARGUMENT: ids the driver does not know, though the 13.x header names most of them). */
static const fi_range H200_580[] = {
    {1, 6, FK_ANSWER, VT_ULL},            /* ECC mode current/pending, volatile and aggregate totals */
    {7, 31, FK_NOT_SUPPORTED, VT_ULL},    /* ECC by location (L1, L2, device, registers, texture, CBU), retired pages */
    {32, 73, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink error counters and bandwidth, links 0-5 */
    {74, 81, FK_ANSWER, VT_ULL},          /* perf policy (violation time) counters, ns */
    {82, 82, FK_ANSWER, VT_UINT},         /* memory temperature */
    {83, 83, FK_ANSWER, VT_ULL},          /* total energy */
    {84, 90, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink speeds */
    {91, 91, FK_NOT_SUPPORTED, VT_UINT},  /* NVLink count */
    {92, 93, FK_NOT_SUPPORTED, VT_ULL},   /* retired pages pending */
    {94, 95, FK_ANSWER, VT_UINT},         /* PCIe replays and their rollovers */
    {96, 137, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink counters, links 6-11 */
    {138, 141, FK_NOT_SUPPORTED, VT_ULL}, /* NVLink throughput (no NVLink in the VM) */
    {142, 145, FK_ANSWER, VT_ULL},        /* remapped rows */
    {146, 146, FK_NOT_SUPPORTED, VT_UINT}, /* remote NVLink id */
    {147, 147, FK_UNTOUCHED, 0},          /* NVSwitches' connected links */
    {148, 160, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink ECC */
    {161, 163, FK_NOT_SUPPORTED, VT_ULL}, /* NVLink DL errors */
    {164, 168, FK_NOT_SUPPORTED, VT_UINT}, /* NVLink speed, state, version, power */
    {169, 169, FK_ANSWER, VT_UINT},       /* PCIe L0 -> recovery */
    {170, 172, FK_NOT_SUPPORTED, VT_UINT}, /* C2C */
    {173, 186, FK_ANSWER, VT_UINT},       /* PCIe error counters, resetless MIG, power average/instant */
    {187, 190, FK_UNTOUCHED, 0},          /* power limits: written only in a short call (below) */
    {191, 191, FK_ANSWER, VT_ULL},        /* energy (an unsigned int in a short call) */
    {192, 196, FK_UNTOUCHED, 0},          /* requested power limit; T.Limit thresholds */
    {197, 199, FK_ANSWER, VT_UINT},       /* PCIe TX/RX bytes, MIG-mode-independent MIG query */
    {200, 200, FK_NOT_SUPPORTED, VT_UINT},
    {201, 222, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink 5 counters */
    {223, 225, FK_NOT_SUPPORTED, VT_UINT},
    {226, 230, FK_ANSWER, VT_UINT},       /* reset status, drain and reset, PCIe atomics, recovery action */
    {231, 234, FK_NOT_SUPPORTED, VT_UINT}, /* C2C errors and power */
    {235, 250, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink FEC history */
    {251, 268, FK_UNTOUCHED, 0},          /* power smoothing */
    {269, 269, FK_ANSWER, VT_ULL},        /* SW thermal slowdown time */
    {270, 273, FK_UNTOUCHED, 0},          /* HW thermal / power brake slowdown, power sync balancing */
    {274, 274, FK_UNKNOWN, 0},            /* EDPp multiplier */
    {275, 288, FK_UNTOUCHED, 0},          /* power smoothing */
    {289, 293, FK_UNKNOWN, 0},
    {294, 295, FK_NOT_SUPPORTED, VT_DOUBLE}, /* NVLink PLR blocks */
    {296, 300, FK_UNKNOWN, 0},
    {301, 302, FK_ANSWER, VT_ULL},        /* inactive remapped rows */
    {303, 319, FK_UNKNOWN, 0},
};

/* The recorded H200's PCIe counters (fields 169, 173-183; the GPU's own history, no error injected since). */
static const unsigned H200_PCIE_ERRORS[] = {0, 0, 67, 74, 66, 0, 0, 0, 0, 0, 62};
#define H200_L0_TO_RECOVERY 700
/* Bytes the recorded H200 had moved over PCIe by then (the driver's load, its firmware among them). */
#define H200_PCIE_TX_BOOT 1722550744ULL
#define H200_PCIE_RX_BOOT 2894415168ULL
/* The perf-policy counters when recorded ~33.9 s after the driver loaded, idle since: 12.3 s below
 * application and base clocks, 21.6 s of low utilization, sum 33.9 s. Modelled: the first 12.3 s after boot
 * count below application/base clocks (the driver's start), every idle ms after them as low utilization,
 * and every ms the power cap holds the clocks as power and below application/base clocks. */
#define H200_CLOCKS_START_MS 12319LL

/* A call asking for more values than this leaves the power limits (187-190, 192) untouched and answers the
 * energy (191) as an unsigned long long: the recorded H200 did so in its call for all 319 ids and wrote
 * them (as unsigned ints) in a call of 24. Where in 25..319 the real rule changes, or whether it is the
 * call's size at all, is not recorded (tests/realgpu/fields_batch_check.py asks). */
#define H200_LARGE_CALL 64

static const fi_range *lookup(const fi_range *table, size_t n, unsigned id)
{
    size_t k;
    for (k = 0; k < n; k++)
        if (table[k].first <= id && id <= table[k].last) return &table[k];
    return NULL;
}

#define H200_LOOKUP(id) lookup(H200_580, sizeof H200_580 / sizeof H200_580[0], (id))

/* ---------------------------------------------------------------------- writing one value */

static void put_uint(nvmlFieldValue_t *v, unsigned value)
{
    v->valueType = VT_UINT;
    v->value.uiVal = value;
    v->nvmlReturn = NVML_SUCCESS;
}

static void put_ull(nvmlFieldValue_t *v, unsigned long long value)
{
    v->valueType = VT_ULL;
    v->value.ullVal = value;
    v->nvmlReturn = NVML_SUCCESS;
}

/* A value in the type the driver's table gives the field (ull for the ECC and remapped-row counts). */
static void put_typed(nvmlFieldValue_t *v, unsigned char type, unsigned long long value)
{
    if (type == VT_ULL) put_ull(v, value);
    else put_uint(v, (unsigned)value);
}

static void not_supported(nvmlFieldValue_t *v, unsigned char type)
{
    v->valueType = type;
    v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
}

static int mig_on(const struct nvmlDevice_st *g)
{
    return g->has_mig && g->mig_current == NVML_DEVICE_MIG_ENABLE;
}

/* GA100 (A100, A30, A800: PCI device ids 0x20B0-0x20FF) lacks the one-second power average: nvml.h,
 * NVML_FI_DEV_POWER_AVERAGE "supported on Ampere (except GA100) or newer architectures". */
static int has_power_average(const struct nvmlDevice_st *g)
{
    unsigned id = g->pci_device_id >> 16;
    if (g->arch < NVML_DEVICE_ARCH_AMPERE) return 0;
    return !(g->arch == NVML_DEVICE_ARCH_AMPERE && id >= 0x20B0 && id <= 0x20FF);
}

/* The readings both ways share: the getter each field mirrors, at the call's sim clock. 0 when the field is
 * not one of them. */
static int common_reading(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g, const sim_reading *now,
                          unsigned id, unsigned char type, nvmlFieldValue_t *v)
{
    switch (id) {
    case FI_ECC_CURRENT:
    case FI_ECC_PENDING:
        if (g->ecc) put_typed(v, type, 1);
        else not_supported(v, type);
        return 1;
    case FI_ECC_SBE_VOL_TOTAL:
    case FI_ECC_SBE_AGG_TOTAL:
        if (g->ecc) put_typed(v, type, 0); /* nothing injects corrected errors */
        else not_supported(v, type);
        return 1;
    case FI_ECC_DBE_VOL_TOTAL:
    case FI_ECC_DBE_AGG_TOTAL:
        if (g->ecc) put_typed(v, type, sim_events_dbe_total(g->index));
        else not_supported(v, type);
        return 1;
    case FI_MEMORY_TEMP:
        if (g->has_mem_temp) put_uint(v, now->mem_temp_c);
        else not_supported(v, type);
        return 1;
    case FI_TOTAL_ENERGY_CONSUMPTION:
        if (g->has_energy && !device->is_mig) put_ull(v, now->energy_mj);
        else not_supported(v, type);
        return 1;
    case FI_PCIE_REPLAY_COUNTER: /* nvmlDeviceGetPcieReplayCounter's */
        put_uint(v, 0);
        return 1;
    case FI_REMAPPED_COR:
    case FI_REMAPPED_UNC:
    case FI_REMAPPED_PENDING:
    case FI_REMAPPED_FAILURE:
        if (g->has_remapped && !mig_on(g)) put_typed(v, type, g->remapped[id - FI_REMAPPED_COR]);
        else not_supported(v, type);
        return 1;
    default:
        return 0;
    }
}

/* The power fields (185-192) at `scope`, as both ways answer them at the GPU's scope; `energy_type` is the
 * energy's value type. */
static void power_field(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g, const sim_reading *now,
                        unsigned id, unsigned char energy_type, nvmlFieldValue_t *v)
{
    switch (id) {
    case FI_POWER_AVERAGE:
        if (has_power_average(g)) put_uint(v, now->power_mw);
        else not_supported(v, VT_UINT);
        break;
    case FI_POWER_INSTANT:
        put_uint(v, now->instant_mw);
        break;
    case FI_POWER_MIN_LIMIT:
        put_uint(v, g->power_min_mw);
        break;
    case FI_ENERGY:
        if (g->has_energy && !device->is_mig) put_typed(v, energy_type, now->energy_mj);
        else not_supported(v, energy_type);
        break;
    default: /* max = default = current (enforced) = requested */
        put_uint(v, g->power_limit_mw);
        break;
    }
}

/* NVLink traffic (fields 138-141) on a GPU with NVLinks; nothing recorded it (the recorded H200 VM has none):
 * while the GPU is not idle each of its links carries NVLINK_KIB_PER_MS of data each way (1 GiB/s, a small
 * part of NVLink 3's and 4's 25 GB/s per link and direction), and the raw counters add an eighth for the
 * protocol. KiB since boot, as nvml.h's "NVLink TX Data throughput in KiB"; scope all links (0xFFFFFFFF) or
 * one link. Whether a link is trained is not modelled here. 0 when the field is not one of them. */
#define NVLINK_KIB_PER_MS 1024ULL
static int nvlink_throughput(const struct nvmlDevice_st *g, const sim_reading *now, nvmlFieldValue_t *v)
{
    unsigned long long busy_ms, kib;
    if (v->fieldId < FI_NVLINK_THROUGHPUT_DATA_TX || v->fieldId > FI_NVLINK_THROUGHPUT_RAW_RX) return 0;
    if (g->nlinks == 0) {
        not_supported(v, VT_ULL);
        return 1;
    }
    if (v->scopeId != 0xFFFFFFFFu && v->scopeId >= g->nlinks) {
        v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return 1;
    }
    busy_ms = now->now_ms > 0 && (unsigned long long)now->now_ms > now->idle_ms
                  ? (unsigned long long)now->now_ms - now->idle_ms : 0;
    kib = busy_ms * NVLINK_KIB_PER_MS * (v->scopeId == 0xFFFFFFFFu ? g->nlinks : 1);
    if (v->fieldId >= FI_NVLINK_THROUGHPUT_DATA_TX + 2) kib += kib / 8;
    put_ull(v, kib);
    return 1;
}

/* ---------------------------------------------------------------------- the default rules */

static void default_field(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g,
                          const sim_reading *now, nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId;
    const fi_range *row;
    unsigned char type;
    if (id == 0 || id >= FI_MAX) {
        v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return;
    }
    row = H200_LOOKUP(id);
    type = row && row->kind != FK_UNTOUCHED && row->kind != FK_UNKNOWN ? row->type : VT_UINT;
    if (common_reading(device, g, now, id, type, v) || nvlink_throughput(g, now, v)) return;
    if (id >= FI_POWER_AVERAGE && id <= FI_POWER_REQUESTED_LIMIT) {
        if (v->scopeId != POWER_SCOPE_GPU) not_supported(v, VT_UINT); /* no module, no memory reading */
        else power_field(device, g, now, id, VT_UINT, v);
        return;
    }
    not_supported(v, row ? row->type : 0); /* the NVLink throughput counters among them */
}

/* ---------------------------------------------------------------------- the recorded H200 */

static int is_power_limit(unsigned id)
{
    return id >= FI_POWER_MIN_LIMIT && id <= FI_POWER_REQUESTED_LIMIT && id != FI_ENERGY;
}

/* 1: the driver writes only the entry's return code (unknown ids, the fields it leaves untouched). */
static int h200_skips(const nvmlFieldValue_t *v, int large)
{
    const fi_range *row = H200_LOOKUP(v->fieldId);
    if (!row || row->kind == FK_UNKNOWN) return 1;
    if (v->fieldId >= FI_POWER_AVERAGE && v->fieldId <= FI_POWER_REQUESTED_LIMIT)
        return large && v->scopeId == POWER_SCOPE_GPU && is_power_limit(v->fieldId);
    return row->kind == FK_UNTOUCHED;
}

static void h200_power_field(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g,
                             const sim_reading *now, int large, nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId;
    switch (v->scopeId) {
    case POWER_SCOPE_GPU:
        if (large && is_power_limit(id)) v->nvmlReturn = NVML_SUCCESS; /* untouched: see H200_LARGE_CALL */
        else power_field(device, g, now, id, large ? VT_ULL : VT_UINT, v);
        return;
    case POWER_SCOPE_MEMORY: /* recorded: the average answers (-q's "GPU Memory Power Readings"), the limits
                              * are refused, the instant power and energy are not supported */
        if (id == FI_POWER_AVERAGE && g->has_mem_power) put_uint(v, now->mem_power_mw);
        else if (is_power_limit(id)) v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        else not_supported(v, id == FI_POWER_INSTANT ? VT_DOUBLE : VT_UINT);
        return;
    default: /* the module (no NVIDIA CPU here): recorded NOT_SUPPORTED; scope 3 (GPU base) and beyond: not
              * recorded */
        not_supported(v, VT_UINT);
        return;
    }
}

static unsigned long long ns(unsigned long long ms)
{
    return ms * 1000000ULL;
}

static void h200_field(const struct nvmlDevice_st *device, const struct nvmlDevice_st *g, const sim_reading *now,
                       int large, nvmlFieldValue_t *v)
{
    unsigned id = v->fieldId;
    const fi_range *row = H200_LOOKUP(id);
    unsigned long long start;
    if (!row || row->kind == FK_UNKNOWN) {
        v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return;
    }
    if (id >= FI_POWER_AVERAGE && id <= FI_POWER_REQUESTED_LIMIT) {
        h200_power_field(device, g, now, large, v);
        return;
    }
    if (nvlink_throughput(g, now, v)) return; /* the VM's recorded NOT_SUPPORTED where it has no NVLink */
    if (row->kind == FK_NOT_SUPPORTED) {
        not_supported(v, row->type);
        return;
    }
    if (row->kind == FK_UNTOUCHED) {
        v->nvmlReturn = NVML_SUCCESS;
        return;
    }
    if (common_reading(device, g, now, id, row->type, v)) return;
    start = now->now_ms < H200_CLOCKS_START_MS ? (unsigned long long)now->now_ms : H200_CLOCKS_START_MS;
    switch (id) {
    case FI_PERF_POLICY_POWER:
        put_ull(v, ns(now->capped_ms));
        break;
    case FI_PERF_POLICY_LOW_UTILIZATION:
        put_ull(v, now->idle_ms > start ? ns(now->idle_ms - start) : 0);
        break;
    case FI_PERF_POLICY_TOTAL_APP_CLOCKS:
    case FI_PERF_POLICY_TOTAL_BASE_CLOCKS:
        put_ull(v, ns(start + now->capped_ms));
        break;
    case FI_PCIE_L0_TO_RECOVERY_COUNTER:
        put_uint(v, H200_L0_TO_RECOVERY);
        break;
    case FI_IS_RESETLESS_MIG_SUPPORTED:
    case FI_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE:
        put_uint(v, 1);
        break;
    case FI_PCIE_COUNT_TX_BYTES: /* nvml.h: "Value can be wrapped" (an unsigned int) */
        put_uint(v, (unsigned)(H200_PCIE_TX_BOOT + now->pcie_tx_bytes));
        break;
    case FI_PCIE_COUNT_RX_BYTES:
        put_uint(v, (unsigned)(H200_PCIE_RX_BOOT + now->pcie_rx_bytes));
        break;
    default:
        if (id >= FI_PCIE_COUNT_CORRECTABLE_ERRORS && id <= FI_PCIE_COUNT_LANE_ERROR)
            put_uint(v, H200_PCIE_ERRORS[id - FI_PCIE_COUNT_CORRECTABLE_ERRORS]);
        else /* the other perf-policy counters, replay rollovers, reset and recovery states, atomics masks, SW
              * thermal slowdown, inactive remapped rows: nothing in the simulator moves them */
            put_typed(v, row->type, 0);
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
        int h200 = g->field_table == SIM_FIELDS_H200_580, large = valuesCount > H200_LARGE_CALL;
        if (!(h200 && h200_skips(v, large))) {
            memset(&v->value, 0, sizeof v->value);
            v->timestamp = stamp;
            v->latencyUsec = 0;
        }
        if (h200) h200_field(device, g, &now, large, v);
        else default_field(device, g, &now, v);
    }
    return sim_leave(NVML_SUCCESS);
}
