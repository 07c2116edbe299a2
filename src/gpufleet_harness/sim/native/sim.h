/* Shared state of the simulated libnvidia-ml.so.1 (gpufleet GPU simulator).
 *
 * Compiled against NVIDIA's own nvml.h so struct layouts, enum values and symbol names are the real
 * ones. NVML_NO_UNVERSIONED_FUNC_DEFS makes the header declare the old unversioned entry points
 * (nvmlInit, nvmlDeviceGetCount, ...) instead of #defining them to the _v2 names: we export both. */
#ifndef GPUFLEET_SIM_H
#define GPUFLEET_SIM_H

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <limits.h>
#include <pthread.h>
#include <sys/types.h>

#define SIM_MAX_GPUS 64
#define SIM_MAX_LINKS NVML_NVLINK_MAX_LINKS
#define SIM_MAX_SWITCHES 16
#define SIM_MAX_NUMA 16
#define SIM_DEFAULT_ROOT "/etc/gpufleet-sim"
#define SIM_HUNG_FOREVER (-1LL)

/* ---- types newer than the CUDA 11.8 header; layouts follow nvidia-ml-py's ctypes structures ---- */

#define SIM_GPU_FABRIC_UUID_LEN 16
#define SIM_GPU_FABRIC_STATE_NOT_SUPPORTED 0
#define SIM_GPU_FABRIC_STATE_NOT_STARTED 1
#define SIM_GPU_FABRIC_STATE_IN_PROGRESS 2
#define SIM_GPU_FABRIC_STATE_COMPLETED 3
#define SIM_ERROR_NOT_READY 27 /* NVML_ERROR_NOT_READY, added after 11.8 */

/* nvmlGpuFabricInfo_t (R535). Real headers type `state` as unsigned char, pynvml as c_uint: writing
 * the value as a 32-bit little-endian integer satisfies both. */
typedef struct {
    unsigned char clusterUuid[SIM_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} simGpuFabricInfo_t;

/* nvmlGpuFabricInfo_v2_t / _v3_t (the "V" call): a version word first; v3 adds healthSummary. */
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[SIM_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary;
} simGpuFabricInfoV_t;

#define SIM_GPU_FABRIC_INFO_V2 0x02000024u /* sizeof v2 (36) | 2 << 24 */
#define SIM_GPU_FABRIC_INFO_V3 0x03000028u /* sizeof v3 (40) | 3 << 24 */

/* Newer headers (R535 on) declare the fabric calls with their own structs, whose layouts the sim types
 * above match byte for byte (`state` is an unsigned char there, followed by padding): the functions
 * take the header's types and fill the sim view of the same memory. The 11.8 header declares none of
 * them, so the sim types stand in and we declare the prototypes ourselves. */
#ifdef NVML_GPU_FABRIC_UUID_LEN
typedef nvmlGpuFabricInfo_t simGpuFabricInfoArg_t;
typedef nvmlGpuFabricInfoV_t simGpuFabricInfoVArg_t;
_Static_assert(sizeof(nvmlGpuFabricInfo_t) == sizeof(simGpuFabricInfo_t), "nvmlGpuFabricInfo_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfoV_t) == sizeof(simGpuFabricInfoV_t), "nvmlGpuFabricInfoV_t layout");
#else
typedef simGpuFabricInfo_t simGpuFabricInfoArg_t;
typedef simGpuFabricInfoV_t simGpuFabricInfoVArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, simGpuFabricInfo_t *info);
nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, simGpuFabricInfoV_t *info);
nvmlReturn_t DECLDIR nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node);
#endif

/* ---- structs of calls newer than the 11.8 header (R550-R580); layouts follow nvidia-ml-py's ctypes
 * structures and, where the header declares them, are checked against it byte for byte ---- */

typedef struct {
    unsigned int version;
    unsigned long long value;
} simPdi_t;                                       /* nvmlPdi_v1_t */
typedef struct {
    unsigned int version, bChannelRepairPending, bTpcRepairPending;
} simRepairStatus_t;                              /* nvmlRepairStatus_v1_t */
typedef struct {
    unsigned int version, value;
} simAddressingMode_t;                            /* nvmlDeviceAddressingMode_v1_t */
typedef struct {
    unsigned int isC2cEnabled;
} simC2cModeInfo_t;                               /* nvmlC2cModeInfo_v1_t (no version word) */
typedef struct {
    unsigned int version;
    unsigned char ibGuid[16], chassisSerialNumber[16];
    unsigned char slotNumber, trayIndex, hostId, peerType, moduleId;
} simPlatformInfo_t;                              /* nvmlPlatformInfo_v2_t (v1: same layout, older names) */
typedef struct {
    unsigned int version;
    char branch[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
} simDriverBranchInfo_t;                          /* nvmlSystemDriverBranchInfo_v1_t */
typedef struct {
    unsigned long long protectedMemSizeKib, unprotectedMemSizeKib;
} simConfComputeMemSizeInfo_t;                    /* nvmlConfComputeMemSizeInfo_t */

/* NVML_STRUCT_VERSION(name, v): sizeof | v << 24 */
#define SIM_PDI_V1 0x01000010u
#define SIM_REPAIR_STATUS_V1 0x0100000Cu
#define SIM_ADDRESSING_MODE_V1 0x01000008u
#define SIM_PLATFORM_INFO_V1 0x0100002Cu
#define SIM_PLATFORM_INFO_V2 0x0200002Cu
#define SIM_DRIVER_BRANCH_V1 0x01000054u
_Static_assert(sizeof(simPdi_t) == (SIM_PDI_V1 & 0xFFFFFF), "simPdi_t layout");
_Static_assert(sizeof(simRepairStatus_t) == (SIM_REPAIR_STATUS_V1 & 0xFFFFFF), "simRepairStatus_t layout");
_Static_assert(sizeof(simAddressingMode_t) == (SIM_ADDRESSING_MODE_V1 & 0xFFFFFF), "simAddressingMode_t layout");
_Static_assert(sizeof(simPlatformInfo_t) == (SIM_PLATFORM_INFO_V2 & 0xFFFFFF), "simPlatformInfo_t layout");
_Static_assert(sizeof(simDriverBranchInfo_t) == (SIM_DRIVER_BRANCH_V1 & 0xFFFFFF), "driver branch layout");

/* Each call takes the header's struct when the header has it (same layout, asserted), else the sim's,
 * with a prototype declared here. */
#define SIM_HEADER_TYPE(sim, hdr) _Static_assert(sizeof(hdr) == sizeof(sim), #hdr " layout")
#ifdef nvmlPdi_v1
typedef nvmlPdi_t simPdiArg_t;
SIM_HEADER_TYPE(simPdi_t, nvmlPdi_t);
#else
typedef simPdi_t simPdiArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetPdi(nvmlDevice_t device, simPdi_t *pdi);
#endif
#ifdef nvmlRepairStatus_v1
typedef nvmlRepairStatus_t simRepairStatusArg_t;
SIM_HEADER_TYPE(simRepairStatus_t, nvmlRepairStatus_t);
#else
typedef simRepairStatus_t simRepairStatusArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetRepairStatus(nvmlDevice_t device, simRepairStatus_t *repairStatus);
#endif
#ifdef nvmlDeviceAddressingMode_v1
typedef nvmlDeviceAddressingMode_t simAddressingModeArg_t;
SIM_HEADER_TYPE(simAddressingMode_t, nvmlDeviceAddressingMode_t);
#else
typedef simAddressingMode_t simAddressingModeArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetAddressingMode(nvmlDevice_t device, simAddressingMode_t *mode);
#endif
#ifdef nvmlC2cModeInfo_v1
typedef nvmlC2cModeInfo_v1_t simC2cModeInfoArg_t;
SIM_HEADER_TYPE(simC2cModeInfo_t, nvmlC2cModeInfo_v1_t);
#else
typedef simC2cModeInfo_t simC2cModeInfoArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetC2cModeInfoV(nvmlDevice_t device, simC2cModeInfo_t *c2cModeInfo);
#endif
#ifdef nvmlPlatformInfo_v2
typedef nvmlPlatformInfo_t simPlatformInfoArg_t;
SIM_HEADER_TYPE(simPlatformInfo_t, nvmlPlatformInfo_t);
#else
typedef simPlatformInfo_t simPlatformInfoArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetPlatformInfo(nvmlDevice_t device, simPlatformInfo_t *platformInfo);
#endif
#ifdef nvmlSystemDriverBranchInfo_v1
typedef nvmlSystemDriverBranchInfo_t simDriverBranchInfoArg_t;
SIM_HEADER_TYPE(simDriverBranchInfo_t, nvmlSystemDriverBranchInfo_t);
#else
typedef simDriverBranchInfo_t simDriverBranchInfoArg_t;
nvmlReturn_t DECLDIR nvmlSystemGetDriverBranch(simDriverBranchInfo_t *branchInfo, unsigned int length);
#endif
#ifdef NVML_CC_SYSTEM_CPU_CAPS_NONE
typedef nvmlConfComputeMemSizeInfo_t simConfComputeMemSizeInfoArg_t;
SIM_HEADER_TYPE(simConfComputeMemSizeInfo_t, nvmlConfComputeMemSizeInfo_t);
#else
typedef simConfComputeMemSizeInfo_t simConfComputeMemSizeInfoArg_t;
nvmlReturn_t DECLDIR nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device, simConfComputeMemSizeInfo_t *memInfo);
#endif
/* Calls of plain types: a prototype repeated from a newer header is a compatible redeclaration. */
nvmlReturn_t DECLDIR nvmlDeviceGetModuleId(nvmlDevice_t device, unsigned int *moduleId);
nvmlReturn_t DECLDIR nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons);
nvmlReturn_t DECLDIR nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons);
nvmlReturn_t DECLDIR nvmlDeviceGetJpgUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                 unsigned int *samplingPeriodUs);
nvmlReturn_t DECLDIR nvmlDeviceGetOfaUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                 unsigned int *samplingPeriodUs);

/* ---- simulated machine ---- */

typedef struct {
    char remote_bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int remote_device_id; /* pciDeviceId of the far end (NVSwitch or GPU) */
    int remote_type;               /* nvmlIntNvLinkDeviceType_t */
} sim_link;

/* ---- MIG ---- */

#define SIM_MIG_MAX_PROFILES 12
#define SIM_MIG_MEM_SLICES 8      /* memory slices of an A100 / H100 */
#define SIM_MIG_COMPUTE_SLICES 7  /* compute slices: at most seven instances, seven MIG devices */
#define SIM_MIG_MAX_GI_ID 14      /* GPU-instance ids 0..13 (see mig.c) */
#define SIM_MIG_MAX_CI 8          /* compute-instance ids 0..7 within one GPU instance */

typedef struct {
    unsigned profile;              /* NVML_GPU_INSTANCE_PROFILE_* index */
    unsigned id;                   /* profile id (nvmlGpuInstanceProfileInfo_t.id) */
    char name[32];                 /* "1g.10gb" */
    unsigned slices, size, instances, sm, ce, dec, enc, jpeg, ofa;
    unsigned long long memory_mib;
    unsigned nplacements;
    unsigned placements[SIM_MIG_MEM_SLICES];
} sim_mig_profile;

/* nvmlGpuInstance_t / nvmlComputeInstance_t point into static tables indexed by id, so a handle stays
 * the same object for the lifetime of the instance (and is reused, as NVML reuses ids). */
struct nvmlGpuInstance_st {
    int used;
    unsigned gpu, id;
    int prof;                      /* index into the GPU's profile table */
    unsigned start, size;          /* memory-slice placement */
};

struct nvmlComputeInstance_st {
    int used;
    struct nvmlGpuInstance_st *gi;
    unsigned id, profile;          /* NVML_COMPUTE_INSTANCE_PROFILE_* (= its profile id) */
    unsigned start, size;          /* compute-slice placement within the GPU instance */
};

/* The opaque nvmlDevice_t of the real header: handles point into a static array, so a handle held
 * across nvmlShutdown/nvmlInit never dangles. */
struct nvmlDevice_st {
    unsigned int index, minor;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
    unsigned long long mem_total, mem_reserved, mem_used;
    int numa_node;                 /* CPU-side NUMA node (sysfs numa_node), -1 = none */
    int has_gpu_numa;              /* GPU memory is a NUMA node (coherent platforms) */
    unsigned int gpu_numa_node;
    int brand;
    unsigned int arch;
    int cc_major, cc_minor;
    int persistence;
    int has_mig;
    unsigned int mig_current, mig_pending;
    unsigned int mig_default_current, mig_default_pending; /* machine.json's, before the mig file */
    int mig_reset_required;        /* Ampere: a mode change waits for a GPU reset */
    unsigned nmig_profiles;
    sim_mig_profile mig_profiles[SIM_MIG_MAX_PROFILES];
    /* MIG device handles (one per compute instance): */
    int is_mig;
    struct nvmlDevice_st *parent;
    struct nvmlComputeInstance_st *ci;
    int ecc;
    unsigned int nlinks;
    sim_link links[SIM_MAX_LINKS];
    int has_fabric;
    unsigned char cluster_uuid[SIM_GPU_FABRIC_UUID_LEN];
    unsigned int clique_id;
    char board_part[NVML_DEVICE_PART_NUMBER_BUFFER_SIZE];
    char vbios[NVML_DEVICE_VBIOS_VERSION_BUFFER_SIZE];
    char inforom_image[NVML_DEVICE_INFOROM_VERSION_BUFFER_SIZE];
    unsigned int power_limit_mw, power_min_mw, power_usage_mw, temperature, pstate;
    int has_mem_temp;              /* the memory's temperature sensor (HBM boards); else NOT_SUPPORTED */
    unsigned int mem_temperature;  /* idle memory temperature, C */
    int has_mem_power;             /* the memory's power reading (field POWER_AVERAGE, scope MEMORY) */
    unsigned int mem_power_idle_mw, mem_power_busy_mw; /* idle, and at 100 % memory utilization */
    int field_table;               /* SIM_FIELDS_*: how nvmlDeviceGetFieldValues answers (fields.c) */
    unsigned int clocks[NVML_CLOCK_COUNT], max_clocks[NVML_CLOCK_COUNT];
    unsigned long long supported_events;
    /* identity and board (machine.json; a getter whose `has_` flag is 0 answers NOT_SUPPORTED) */
    char inforom_ecc[NVML_DEVICE_INFOROM_VERSION_BUFFER_SIZE];
    int fabric_member;             /* in an NVSwitch fabric (cluster UUID, clique); else state NOT_SUPPORTED */
    unsigned long long bar1_total, bar1_used;
    unsigned int board_id, module_id, irq;
    unsigned long long pdi;
    int has_bus_width, has_cores;
    unsigned int bus_width, cores, fans;
    int display_mode, gsp;
    unsigned int pcie_max_gen, pcie_gen, pcie_max_width, pcie_width, pcie_speed, pcie_tx, pcie_rx;
    int has_c2c, has_cc, has_platform, has_addressing, has_repair, has_remapped, has_energy;
    unsigned int c2c_enabled, platform_host_id, addressing_mode, repair[2], remapped[4];
    unsigned long long cc_protected_kib;
    unsigned long long clock_event_reasons;
    unsigned int nmem_clocks, ngfx_clocks;
    unsigned int mem_clocks[8], gfx_clocks[256];
    /* the power model of workloads (machine.json `load`, see load.c) */
    unsigned int load_idle_mw, load_cap_mw, load_full_mw, load_linger_mw;
    unsigned int load_membound_mw; /* what a 100 % memory-bound load draws (below the cap on the H200) */
    long long load_linger_ms;
};

/* What nvmlDeviceGetFieldValues answers (machine.json `field_values`): the rules written before any
 * recording, or a recorded GPU model's table (fields.c). */
enum { SIM_FIELDS_DEFAULT, SIM_FIELDS_H200_580 };

/* ---- workloads (load.c): the sim root's workloads/state, and each GPU's timeline derived from it ---- */

#define SIM_NO_INSTANCE 0xFFFFFFFFu
#define SIM_LOAD_NAME 64

/* What a workload's kernels do (the last word of a state line; absent: compute). */
enum { SIM_KIND_COMPUTE, SIM_KIND_MEMBOUND };

typedef struct {
    unsigned long long id;
    unsigned gpu;
    long long start, end;          /* sim clock, ms since boot; end -1: running until stopped */
    unsigned util, mem_util, enc, dec, pid;
    unsigned long long memory_mib;
    unsigned gi, ci;               /* a MIG device's instance ids, else SIM_NO_INSTANCE */
    char name[SIM_LOAD_NAME];
    int kind;                      /* SIM_KIND_* */
} sim_load;

enum { SIM_GPU_IDLE, SIM_GPU_BUSY, SIM_GPU_LINGER };

/* A stretch of a GPU's timeline over which its instantaneous state is constant. */
typedef struct {
    long long at;                  /* ms: the stretch starts here and lasts until the next one */
    int state;                     /* SIM_GPU_* */
    unsigned power_mw;             /* instantaneous power */
    unsigned util, mem_util, enc, dec;
    unsigned util_compute, util_membound; /* the running workloads' util by kind (before the 100 % cap) */
    long long extra_uj;            /* energy above idle from the timeline's origin to `at` */
    double temp_fast, temp_slow;   /* the temperature's two lags at `at`, in degrees above idle */
    double mtemp_fast, mtemp_slow; /* the memory temperature's, likewise */
    int capped;                    /* busy and held by the power cap (clock-event reason SW power cap) */
    unsigned pcie_tx, pcie_rx;     /* PCIe throughput, KB/s */
    /* counters since boot at `at`: ms idle, ms held by the cap, PCIe bytes (KB/s x ms), and the memory
     * utilization's integral since the timeline's origin (% x ms) */
    long long idle_ms, capped_ms, tx_bytes, rx_bytes, mem_util_ms;
} sim_seg;

typedef struct {
    long long origin;              /* where the timeline starts: a `settled` line's time, else 0 */
    long long settled_uj;          /* energy above idle before the origin */
    int has_counters;              /* a `counters` line gave the counters at the origin */
    long long origin_idle_ms, origin_capped_ms, origin_tx_bytes, origin_rx_bytes;
    unsigned nseg;
    sim_seg *segs;
    unsigned long long last_energy_mj; /* the largest energy this process reported: never less */
} sim_timeline;

/* What a GPU reads at the sim clock's now. */
typedef struct {
    int state;
    unsigned power_mw, util, mem_util, enc, dec, temp_c, sm_mhz, video_mhz, pcie_tx, pcie_rx;
    unsigned instant_mw;           /* the instantaneous power (power_mw is its average over a second) */
    unsigned mem_temp_c;           /* the memory temperature (GPUs with the sensor) */
    unsigned mem_power_mw;         /* the memory's power, averaged over the last second (GPUs with it) */
    unsigned long long energy_mj, reasons;
    long long now_ms;              /* the sim clock the reading was taken at */
    /* since boot: ms idle, ms held by the power cap, bytes over PCIe */
    unsigned long long idle_ms, capped_ms, pcie_tx_bytes, pcie_rx_bytes;
} sim_reading;

typedef struct {
    pthread_mutex_t lock;          /* guards everything below; never held while blocking */
    int refcount;                  /* nvmlInit* minus nvmlShutdown */
    char root[PATH_MAX];

    /* machine.json */
    unsigned int ngpus;
    struct nvmlDevice_st gpus[SIM_MAX_GPUS];
    unsigned char topo[SIM_MAX_GPUS][SIM_MAX_GPUS];
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char kmod_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda_version;
    int has_branch;
    char driver_branch[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int fm_required;
    int passthrough;               /* a hypervisor passes the GPUs through */
    unsigned int nnuma;
    int numa_cpu_lo[SIM_MAX_NUMA], numa_cpu_hi[SIM_MAX_NUMA];
    int ncpus;

    /* control file, re-read when its identity changes */
    int ctl_valid;
    dev_t ctl_dev;
    ino_t ctl_ino;
    off_t ctl_size;
    long long ctl_mtime_ns;
    int driver_loaded, fm_running;
    unsigned char lost[SIM_MAX_GPUS];
    /* control `gpu N hung [UNTIL]` / `driver hung [UNTIL]`: calls on the GPU's handle (every call of the
     * library) block until the line goes or UNTIL (CLOCK_REALTIME ms) passes; SIM_HUNG_FOREVER: no UNTIL */
    long long hung_until[SIM_MAX_GPUS]; /* 0: not hung */
    long long driver_hung_until;
    int clock_frozen;              /* control `clock MS`: the sim clock stands at clock_ms */
    long long clock_ms;

    /* workloads/state, re-read when its identity changes (load.c) */
    int wl_valid;
    dev_t wl_dev;
    ino_t wl_ino;
    off_t wl_size;
    long long wl_mtime_ns;
    unsigned nloads;
    sim_load *loads;
    sim_timeline timelines[SIM_MAX_GPUS];

    /* MIG state (the `mig` file of the sim root), re-read when its identity changes */
    int mig_valid;
    dev_t mig_dev;
    ino_t mig_ino;
    off_t mig_size;
    long long mig_mtime_ns;
    struct nvmlGpuInstance_st gis[SIM_MAX_GPUS][SIM_MIG_MAX_GI_ID];
    struct nvmlComputeInstance_st cis[SIM_MAX_GPUS][SIM_MIG_MAX_GI_ID][SIM_MIG_MAX_CI];
    struct nvmlDevice_st migdevs[SIM_MAX_GPUS][SIM_MIG_COMPUTE_SLICES];
    unsigned nmigdevs[SIM_MAX_GPUS];
} sim_state;

extern sim_state g_sim;

/* Lock, check initialized + driver loaded (re-reading control): NVML_SUCCESS with the lock held, or
 * an error with the lock released. */
nvmlReturn_t sim_enter(void);
/* sim_enter plus: the handle is one of ours (INVALID_ARGUMENT) and its GPU is not lost (GPU_IS_LOST). */
nvmlReturn_t sim_enter_dev(nvmlDevice_t device);
/* Check a second handle while the lock is held (no locking, same errors as sim_enter_dev). */
nvmlReturn_t sim_check_dev(nvmlDevice_t device);
/* Unlock and pass a return code through. */
nvmlReturn_t sim_leave(nvmlReturn_t ret);
/* Copy a string into a caller buffer of `length` bytes (INSUFFICIENT_SIZE if it does not fit). */
nvmlReturn_t sim_copy_str(char *dst, unsigned int length, const char *src);
/* Path of a file in the sim root. */
void sim_path(char *out, size_t outlen, const char *name);

/* Re-read the sim root's `mig` file if it changed (force: always). Lock held. */
void sim_mig_refresh(int force);

/* Index of the GPU with this PCI bus id (any accepted form); -1 none, -2 malformed. Lock held. */
int sim_find_bus_id(const char *text);

/* The sim clock: ms since boot (CLOCK_BOOTTIME, or the frozen clock of `control`). Lock held. */
long long sim_now_ms(void);
/* Re-read workloads/state if it changed and rebuild the timelines (force: always). Lock held. */
void sim_load_refresh(int force);
/* A GPU's (or MIG device's parent's) readings now. Lock held. */
void sim_read(const struct nvmlDevice_st *device, sim_reading *out);
/* The workloads running now on a GPU, or in a MIG device (its instance's only): up to `cap` into `out`,
 * returns how many there are. Lock held. */
unsigned sim_running(const struct nvmlDevice_st *device, const sim_load **out, unsigned cap);
/* Bytes of GPU memory the running workloads of a GPU or MIG device use (with their contexts). Lock held. */
unsigned long long sim_load_memory(const struct nvmlDevice_st *device);
/* Bytes of BAR1 the running workloads of a GPU map (their memory, contexts, and a page table each). Lock
 * held. */
unsigned long long sim_load_bar1(const struct nvmlDevice_st *device);

/* Sum of `ecc-dbe GPU COUNT` lines for a GPU in the events file. */
unsigned long long sim_events_dbe_total(unsigned int gpu);

#endif
