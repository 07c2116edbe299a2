/* Multi-Instance GPU in the simulated NVML: MIG mode (current / pending), GPU-instance and
 * compute-instance profiles, placements, creation and destruction, and the MIG device handles that
 * compute instances expose. The state lives in the sim root's `mig` file, so every process of the
 * simulated host sees one configuration, as every process sees the driver's:
 *
 *     mode GPU CURRENT PENDING
 *     gi GPU GI_ID PROFILE_ID START
 *     ci GPU GI_ID CI_ID CI_PROFILE START
 *
 * The library rewrites it (temp file + rename) after every change and re-reads it when its identity
 * changes, like `control`. `gpufleet sim inject ROOT gpu N reset` (control.py) applies a pending mode
 * and drops the GPU's instances, as a GPU reset does. */
#include "sim.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ENTER(d)                                                                                        \
    do {                                                                                                \
        nvmlReturn_t r_ = sim_enter_dev(d);                                                             \
        if (r_ != NVML_SUCCESS) return r_;                                                              \
    } while (0)
#define NEED(cond)                                                                                      \
    do {                                                                                                \
        if (!(cond)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);                                     \
    } while (0)
/* A full GPU's handle (a MIG device handle is not a parent of instances). */
#define ENTER_GPU(d)                                                                                    \
    do {                                                                                                \
        ENTER(d);                                                                                       \
        NEED(!(d)->is_mig);                                                                             \
    } while (0)

#define SIM_GI_PROFILE_COUNT 0x12 /* NVML_GPU_INSTANCE_PROFILE_COUNT of the R580 header */
#define SIM_CI_PROFILE_COUNT 0x9  /* NVML_COMPUTE_INSTANCE_PROFILE_COUNT likewise */
#define SIM_GI_PROFILE_INFO_V2 0x02000098u
#define SIM_GI_PROFILE_INFO_V3 0x03000098u
#define SIM_CI_PROFILE_INFO_V2 0x02000088u
#define SIM_CI_PROFILE_INFO_V3 0x0300008Cu

/* nvmlGpuInstanceProfileInfo_v3_t / nvmlComputeInstanceProfileInfo_v3_t (not in the 11.8 header). */
typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount,
        encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} simGpuInstanceProfileInfo_v3_t;

typedef struct {
    unsigned int version, id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} simComputeInstanceProfileInfo_v3_t;

_Static_assert(sizeof(simGpuInstanceProfileInfo_v3_t) == (SIM_GI_PROFILE_INFO_V3 & 0xFFFFFF), "GI v3 size");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == (SIM_GI_PROFILE_INFO_V2 & 0xFFFFFF), "GI v2 size");
_Static_assert(sizeof(simComputeInstanceProfileInfo_v3_t) == (SIM_CI_PROFILE_INFO_V3 & 0xFFFFFF), "CI v3 size");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v2_t) == (SIM_CI_PROFILE_INFO_V2 & 0xFFFFFF), "CI v2 size");

/* ------------------------------------------------------------------------------------ helpers */

static struct nvmlDevice_st *gpu_of(nvmlDevice_t d)
{
    return d->is_mig ? d->parent : d;
}

static int mig_on(const struct nvmlDevice_st *g)
{
    return g->has_mig && g->mig_current == NVML_DEVICE_MIG_ENABLE;
}

static const sim_mig_profile *profile_by_index(const struct nvmlDevice_st *g, unsigned profile)
{
    unsigned k;
    for (k = 0; k < g->nmig_profiles; k++)
        if (g->mig_profiles[k].profile == profile) return &g->mig_profiles[k];
    return NULL;
}

static int profile_by_id(const struct nvmlDevice_st *g, unsigned id)
{
    unsigned k;
    for (k = 0; k < g->nmig_profiles; k++)
        if (g->mig_profiles[k].id == id) return (int)k;
    return -1;
}

/* GPU-instance ids are a function of the memory-slice placement, modelled on what A100 drivers show:
 * the whole GPU is 0, the two halves 1-2, the quarters 3-6, the eighths 7-13. */
static unsigned gi_id_for(unsigned size, unsigned start)
{
    switch (size) {
    case 8: return 0;
    case 4: return 1 + start / 4;
    case 2: return 3 + start / 2;
    default: return 7 + start;
    }
}

/* Compute-instance profiles (NVML_COMPUTE_INSTANCE_PROFILE_* index = profile id) by compute slices. */
static unsigned ci_slices(unsigned profile)
{
    static const unsigned slices[] = {1, 2, 3, 4, 7};
    return profile < sizeof slices / sizeof slices[0] ? slices[profile] : 0;
}

static int ci_supported(const struct nvmlGpuInstance_st *gi, const struct nvmlDevice_st *g, unsigned profile)
{
    unsigned n = ci_slices(profile), gs = g->mig_profiles[gi->prof].slices;
    /* A GPU instance offers its own size and the smaller power-of-two-ish splits (7g: 1,2,3,4,7;
     * 4g: 1,2,4; 3g: 1,2,3; 2g: 1,2; 1g: 1). */
    return n && n <= gs && (n == gs || n <= 2 || (n == 3 && gs == 7) || (n == 4 && gs == 7));
}

static unsigned ci_sm(const struct nvmlGpuInstance_st *gi, const struct nvmlDevice_st *g, unsigned profile)
{
    const sim_mig_profile *p = &g->mig_profiles[gi->prof], *one = profile_by_index(g, 0);
    unsigned n = ci_slices(profile);
    if (n == p->slices) return p->sm;
    return n * (one ? one->sm : p->sm / p->slices);
}

static unsigned gpu_index(const struct nvmlDevice_st *g)
{
    return (unsigned)(g - g_sim.gpus);
}

static int gi_valid(nvmlGpuInstance_t gi)
{
    uintptr_t p = (uintptr_t)gi, base = (uintptr_t)&g_sim.gis[0][0];
    if (!gi || p < base || p >= (uintptr_t)(&g_sim.gis[0][0] + SIM_MAX_GPUS * SIM_MIG_MAX_GI_ID) ||
        (p - base) % sizeof(struct nvmlGpuInstance_st) != 0)
        return 0;
    return gi->used && gi->gpu < g_sim.ngpus && mig_on(&g_sim.gpus[gi->gpu]);
}

static int ci_valid(nvmlComputeInstance_t ci)
{
    uintptr_t p = (uintptr_t)ci, base = (uintptr_t)&g_sim.cis[0][0][0];
    if (!ci || p < base || p >= (uintptr_t)(&g_sim.cis[0][0][0] + SIM_MAX_GPUS * SIM_MIG_MAX_GI_ID * SIM_MIG_MAX_CI) ||
        (p - base) % sizeof(struct nvmlComputeInstance_st) != 0)
        return 0;
    return ci->used && gi_valid(ci->gi);
}

/* Lock + init checks + a valid GPU instance whose GPU is not lost. */
static nvmlReturn_t enter_gi(nvmlGpuInstance_t gi)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!gi_valid(gi)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g_sim.lost[gi->gpu]) return sim_leave(NVML_ERROR_GPU_IS_LOST);
    return NVML_SUCCESS;
}

static nvmlReturn_t enter_ci(nvmlComputeInstance_t ci)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!ci_valid(ci)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g_sim.lost[ci->gi->gpu]) return sim_leave(NVML_ERROR_GPU_IS_LOST);
    return NVML_SUCCESS;
}

static void clear_instances(unsigned gpu)
{
    memset(g_sim.gis[gpu], 0, sizeof g_sim.gis[gpu]);
    memset(g_sim.cis[gpu], 0, sizeof g_sim.cis[gpu]);
}

/* A stable MIG UUID from the parent's UUID and the instance ids (FNV-1a, formatted as a UUID). */
static void mig_uuid(char *out, size_t outlen, const char *parent, unsigned gi, unsigned ci)
{
    unsigned long long h1 = 0xcbf29ce484222325ULL, h2 = 0x84222325cbf29ce4ULL;
    unsigned char b[16];
    const char *p;
    unsigned k;
    char seed[160];
    snprintf(seed, sizeof seed, "%s/gi%u/ci%u", parent, gi, ci);
    for (p = seed; *p; p++) {
        h1 = (h1 ^ (unsigned char)*p) * 0x100000001b3ULL;
        h2 = (h2 ^ (unsigned char)*p) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
    }
    for (k = 0; k < 8; k++) {
        b[k] = (unsigned char)(h1 >> (8 * k));
        b[8 + k] = (unsigned char)(h2 >> (8 * k));
    }
    b[6] = (unsigned char)((b[6] & 0x0F) | 0x40); /* version 4 */
    b[8] = (unsigned char)((b[8] & 0x3F) | 0x80); /* RFC 4122 variant */
    snprintf(out, outlen, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The MIG device name of a compute instance: "1g.10gb", or "1c.3g.40gb" for a CI smaller than its GI. */
static void ci_profile_name(char *out, size_t outlen, const struct nvmlDevice_st *g,
                            const struct nvmlGpuInstance_st *gi, unsigned profile)
{
    const sim_mig_profile *p = &g->mig_profiles[gi->prof];
    if (ci_slices(profile) == p->slices) snprintf(out, outlen, "%s", p->name);
    else snprintf(out, outlen, "%uc.%s", ci_slices(profile), p->name);
}

/* Rebuild the MIG device handles of every GPU: one per compute instance, ordered by GPU-instance
 * placement, then compute-instance placement. */
static void rebuild_mig_devices(void)
{
    unsigned g;
    for (g = 0; g < g_sim.ngpus; g++) {
        struct nvmlDevice_st *gpu = &g_sim.gpus[g];
        unsigned n = 0, s, gid, cid, cs;
        memset(g_sim.migdevs[g], 0, sizeof g_sim.migdevs[g]);
        if (mig_on(gpu))
            for (s = 0; s < SIM_MIG_MEM_SLICES; s++)
                for (gid = 0; gid < SIM_MIG_MAX_GI_ID; gid++) {
                    struct nvmlGpuInstance_st *gi = &g_sim.gis[g][gid];
                    if (!gi->used || gi->start != s) continue;
                    for (cs = 0; cs < SIM_MIG_COMPUTE_SLICES; cs++)
                        for (cid = 0; cid < SIM_MIG_MAX_CI; cid++) {
                            struct nvmlComputeInstance_st *ci = &g_sim.cis[g][gid][cid];
                            struct nvmlDevice_st *m;
                            char pname[48];
                            if (!ci->used || ci->start != cs || n >= SIM_MIG_COMPUTE_SLICES) continue;
                            m = &g_sim.migdevs[g][n++];
                            *m = *gpu;
                            m->is_mig = 1;
                            m->parent = gpu;
                            m->ci = ci;
                            mig_uuid(m->uuid, sizeof m->uuid, gpu->uuid, gid, cid);
                            ci_profile_name(pname, sizeof pname, gpu, gi, ci->profile);
                            snprintf(m->name, sizeof m->name, "%s MIG %s", gpu->name, pname);
                            m->mem_total = gpu->mig_profiles[gi->prof].memory_mib * 1024ULL * 1024ULL;
                            m->mem_reserved = 0;
                            m->mem_used = 0;
                            m->nlinks = 0;
                        }
                }
        g_sim.nmigdevs[g] = n;
    }
}

/* ------------------------------------------------------------------------------------ the mig file */

static void mig_defaults(void)
{
    unsigned g;
    for (g = 0; g < g_sim.ngpus; g++) {
        g_sim.gpus[g].mig_current = g_sim.gpus[g].mig_default_current;
        g_sim.gpus[g].mig_pending = g_sim.gpus[g].mig_default_pending;
        clear_instances(g);
    }
}

static void mig_parse(char *text)
{
    char *save = NULL, *line;
    mig_defaults();
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char word[16] = "";
        unsigned a[5] = {0};
        int n = sscanf(line, "%15s %u %u %u %u %u", word, &a[0], &a[1], &a[2], &a[3], &a[4]);
        struct nvmlDevice_st *g;
        if (n < 4 || a[0] >= g_sim.ngpus) continue;
        g = &g_sim.gpus[a[0]];
        if (!g->has_mig) continue;
        if (strcmp(word, "mode") == 0) {
            g->mig_current = a[1] ? 1 : 0;
            g->mig_pending = a[2] ? 1 : 0;
        } else if (strcmp(word, "gi") == 0 && n >= 5 && a[1] < SIM_MIG_MAX_GI_ID) {
            int k = profile_by_id(g, a[2]);
            struct nvmlGpuInstance_st *gi = &g_sim.gis[a[0]][a[1]];
            if (k < 0) continue;
            gi->used = 1;
            gi->gpu = a[0];
            gi->id = a[1];
            gi->prof = k;
            gi->start = a[3];
            gi->size = g->mig_profiles[k].size;
        } else if (strcmp(word, "ci") == 0 && n >= 6 && a[1] < SIM_MIG_MAX_GI_ID && a[2] < SIM_MIG_MAX_CI) {
            struct nvmlGpuInstance_st *gi = &g_sim.gis[a[0]][a[1]];
            struct nvmlComputeInstance_st *ci = &g_sim.cis[a[0]][a[1]][a[2]];
            if (!gi->used || !ci_slices(a[3])) continue;
            ci->used = 1;
            ci->gi = gi;
            ci->id = a[2];
            ci->profile = a[3];
            ci->start = a[4];
            ci->size = ci_slices(a[3]);
        }
    }
    rebuild_mig_devices();
}

static int mig_stat(struct stat *st)
{
    char path[PATH_MAX + 16];
    sim_path(path, sizeof path, "mig");
    return stat(path, st);
}

static void mig_remember(const struct stat *st)
{
    g_sim.mig_valid = 1;
    g_sim.mig_dev = st->st_dev;
    g_sim.mig_ino = st->st_ino;
    g_sim.mig_size = st->st_size;
    g_sim.mig_mtime_ns = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
}

void sim_mig_refresh(int force)
{
    struct stat st;
    long long mtime_ns;
    if (mig_stat(&st) != 0) {
        if (force || g_sim.mig_valid) {
            g_sim.mig_valid = 0;
            mig_defaults();
            rebuild_mig_devices();
        }
        return;
    }
    mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    if (!force && g_sim.mig_valid && st.st_ino == g_sim.mig_ino && st.st_dev == g_sim.mig_dev &&
        st.st_size == g_sim.mig_size && mtime_ns == g_sim.mig_mtime_ns)
        return;
    {
        char path[PATH_MAX + 16], *buf = malloc(65536);
        FILE *f;
        size_t n = 0;
        if (!buf) return;
        sim_path(path, sizeof path, "mig");
        f = fopen(path, "r");
        if (f) {
            n = fread(buf, 1, 65535, f);
            fclose(f);
        }
        buf[n] = '\0';
        mig_parse(buf);
        free(buf);
    }
    mig_remember(&st);
}

/* Write the whole MIG state (temp file + rename); NVML_ERROR_UNKNOWN if the root is not writable. */
static nvmlReturn_t mig_save(void)
{
    char path[PATH_MAX + 16], tmp[PATH_MAX + 48];
    unsigned g, gid, cid;
    struct stat st;
    FILE *f;
    sim_path(path, sizeof path, "mig");
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    f = fopen(tmp, "w");
    if (!f) return NVML_ERROR_UNKNOWN;
    fprintf(f, "# MIG state of the simulated driver (gpufleet GPU simulator); rewritten by libnvidia-ml\n");
    for (g = 0; g < g_sim.ngpus; g++) {
        const struct nvmlDevice_st *gpu = &g_sim.gpus[g];
        if (!gpu->has_mig) continue;
        fprintf(f, "mode %u %u %u\n", g, gpu->mig_current, gpu->mig_pending);
        for (gid = 0; gid < SIM_MIG_MAX_GI_ID; gid++) {
            const struct nvmlGpuInstance_st *gi = &g_sim.gis[g][gid];
            if (!gi->used) continue;
            fprintf(f, "gi %u %u %u %u\n", g, gid, gpu->mig_profiles[gi->prof].id, gi->start);
            for (cid = 0; cid < SIM_MIG_MAX_CI; cid++) {
                const struct nvmlComputeInstance_st *ci = &g_sim.cis[g][gid][cid];
                if (ci->used) fprintf(f, "ci %u %u %u %u %u\n", g, gid, cid, ci->profile, ci->start);
            }
        }
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return NVML_ERROR_UNKNOWN;
    }
    if (mig_stat(&st) == 0) mig_remember(&st);
    rebuild_mig_devices();
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------ MIG mode */

nvmlReturn_t DECLDIR nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    const struct nvmlDevice_st *g;
    ENTER(device);
    NEED(currentMode && pendingMode);
    g = gpu_of(device);
    if (!g->has_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = g->mig_current;
    *pendingMode = g->mig_pending;
    return sim_leave(NVML_SUCCESS);
}

/* Ampere: the new mode stays pending and activationStatus is IN_USE, the answer of a DGX whose GPUs
 * are held by other clients (fabric manager, DCGM, persistenced): the mode applies at the next GPU
 * reset (`gpufleet sim inject ROOT gpu N reset`). Hopper: applied at once. Disabling drops the GPU's
 * instances. */
nvmlReturn_t DECLDIR nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus)
{
    struct nvmlDevice_st *g;
    ENTER_GPU(device);
    NEED(activationStatus && (mode == NVML_DEVICE_MIG_DISABLE || mode == NVML_DEVICE_MIG_ENABLE));
    g = device;
    if (!g->has_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    g->mig_pending = mode;
    if (g->mig_current == mode) {
        *activationStatus = NVML_SUCCESS;
    } else if (g->mig_reset_required) {
        *activationStatus = NVML_ERROR_IN_USE;
    } else {
        g->mig_current = mode;
        clear_instances(gpu_index(g));
        *activationStatus = NVML_SUCCESS;
    }
    return sim_leave(mig_save());
}

nvmlReturn_t DECLDIR nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    ENTER(device);
    NEED(isMigDevice);
    *isMigDevice = device->is_mig ? 1 : 0;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    ENTER_GPU(device);
    NEED(count);
    /* nvml.h: "Returns zero if MIG is not supported or enabled"; NOT_SUPPORTED is not among its codes. */
    *count = mig_on(device) ? SIM_MIG_COMPUTE_SLICES : 0;
    return sim_leave(NVML_SUCCESS);
}

/* nvml.h: NOT_SUPPORTED "if this query is not supported by the device" (no MIG), INVALID_ARGUMENT for
 * an invalid index, NOT_FOUND "if no valid MIG device was found at index" (consumers skip those). */
nvmlReturn_t DECLDIR nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice)
{
    unsigned g;
    ENTER_GPU(device);
    NEED(migDevice);
    if (!device->has_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    NEED(index < SIM_MIG_COMPUTE_SLICES);
    g = gpu_index(device);
    if (!mig_on(device) || index >= g_sim.nmigdevs[g]) return sim_leave(NVML_ERROR_NOT_FOUND);
    *migDevice = &g_sim.migdevs[g][index];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    ENTER(migDevice);
    NEED(device && migDevice->is_mig);
    *device = migDevice->parent;
    return sim_leave(NVML_SUCCESS);
}

/* nvml.h: "This API currently only supports MIG device handles" (a full GPU: NOT_SUPPORTED, as the real
 * H200 answers): the engines, slices and memory of the MIG device's compute instance and GPU instance. */
nvmlReturn_t DECLDIR nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    const struct nvmlDevice_st *g;
    const struct nvmlGpuInstance_st *gi;
    const sim_mig_profile *p;
    ENTER(device);
    NEED(attributes);
    if (!device->is_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    g = device->parent;
    gi = device->ci->gi;
    p = &g->mig_profiles[gi->prof];
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = ci_sm(gi, g, device->ci->profile);
    attributes->sharedCopyEngineCount = p->ce;
    attributes->sharedDecoderCount = p->dec;
    attributes->sharedEncoderCount = p->enc;
    attributes->sharedJpegCount = p->jpeg;
    attributes->sharedOfaCount = p->ofa;
    attributes->gpuInstanceSliceCount = p->slices;
    attributes->computeInstanceSliceCount = ci_slices(device->ci->profile);
    attributes->memorySizeMB = p->memory_mib;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER(device);
    NEED(id);
    if (!device->is_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *id = device->ci->gi->id;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER(device);
    NEED(id);
    if (!device->is_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    *id = device->ci->id;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ GPU instances */

/* The fields every version of the GPU instance profile info shares (same names in v1, v2 and v3), set from
 * the simulated profile `p`. */
#define GI_PROFILE_FIELDS(info, p)                  \
    do {                                            \
        (info)->id = (p)->id;                       \
        (info)->sliceCount = (p)->slices;           \
        (info)->instanceCount = (p)->instances;     \
        (info)->multiprocessorCount = (p)->sm;      \
        (info)->copyEngineCount = (p)->ce;          \
        (info)->decoderCount = (p)->dec;            \
        (info)->encoderCount = (p)->enc;            \
        (info)->jpegCount = (p)->jpeg;              \
        (info)->ofaCount = (p)->ofa;                \
        (info)->memorySizeMB = (p)->memory_mib;     \
    } while (0)

/* The profile of `profile` (an NVML_GPU_INSTANCE_PROFILE_* index) on a MIG-capable GPU, or an error. MIG
 * need not be enabled: the real H200 lists its profiles with MIG off (`nvidia-smi mig -lgip`, NVML's
 * profile infos in the recording). */
static nvmlReturn_t gi_profile(nvmlDevice_t device, unsigned profile, const sim_mig_profile **out)
{
    if (!device->has_mig) return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= SIM_GI_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    *out = profile_by_index(device, profile);
    return *out ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                        nvmlGpuInstanceProfileInfo_t *info)
{
    const sim_mig_profile *p;
    nvmlReturn_t r;
    ENTER_GPU(device);
    NEED(info);
    r = gi_profile(device, profile, &p);
    if (r != NVML_SUCCESS) return sim_leave(r);
    memset(info, 0, sizeof *info); /* isP2pSupported: 0 */
    GI_PROFILE_FIELDS(info, p);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const sim_mig_profile *p;
    nvmlReturn_t r;
    unsigned version;
    ENTER_GPU(device);
    NEED(info);
    version = info->version;
    NEED(version == SIM_GI_PROFILE_INFO_V2 || version == SIM_GI_PROFILE_INFO_V3);
    r = gi_profile(device, profile, &p);
    if (r != NVML_SUCCESS) return sim_leave(r);
    /* v2 keeps v1's isP2pSupported after the id, v3 drops it and adds capabilities (0 here): three layouts
     * with the same field names, hence the macro. The real driver clears the whole struct, `version`
     * included (the recorded H200 hands back version 0), and so does the simulator. */
    if (version == SIM_GI_PROFILE_INFO_V2) {
        memset(info, 0, sizeof *info);
        GI_PROFILE_FIELDS(info, p);
        snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    } else {
        simGpuInstanceProfileInfo_v3_t *v3 = (simGpuInstanceProfileInfo_v3_t *)info;
        memset(v3, 0, sizeof *v3);
        GI_PROFILE_FIELDS(v3, p);
        snprintf(v3->name, sizeof v3->name, "MIG %s", p->name);
    }
    return sim_leave(NVML_SUCCESS);
}

/* Placements are listed whether or not MIG is enabled (nvml.h), on MIG-capable GPUs. */
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                  nvmlGpuInstancePlacement_t *placements,
                                                                  unsigned int *count)
{
    const sim_mig_profile *p;
    unsigned k;
    int idx;
    ENTER_GPU(device);
    NEED(count);
    if (!device->has_mig) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    idx = profile_by_id(device, profileId);
    if (idx < 0) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    p = &device->mig_profiles[idx];
    if (placements) {
        if (*count < p->nplacements) {
            *count = p->nplacements;
            return sim_leave(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (k = 0; k < p->nplacements; k++) {
            placements[k].start = p->placements[k];
            placements[k].size = p->size;
        }
    }
    *count = p->nplacements;
    return sim_leave(NVML_SUCCESS);
}

/* Why a GPU instance of profile k cannot go at `start`: 0 = it can. */
static nvmlReturn_t gi_fits(const struct nvmlDevice_st *g, int k, unsigned start)
{
    const sim_mig_profile *p = &g->mig_profiles[k];
    unsigned gpu = gpu_index(g), gid, slices = 0, same = 0;
    for (gid = 0; gid < SIM_MIG_MAX_GI_ID; gid++) {
        const struct nvmlGpuInstance_st *gi = &g_sim.gis[gpu][gid];
        if (!gi->used) continue;
        slices += g->mig_profiles[gi->prof].slices;
        same += gi->prof == k;
        if (start < gi->start + gi->size && gi->start < start + p->size) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    }
    if (same >= p->instances || slices + p->slices > SIM_MIG_COMPUTE_SLICES)
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    return NVML_SUCCESS;
}

static nvmlReturn_t gi_create(struct nvmlDevice_st *g, unsigned profileId, const nvmlGpuInstancePlacement_t *want,
                              nvmlGpuInstance_t *out)
{
    const sim_mig_profile *p;
    struct nvmlGpuInstance_st *gi;
    unsigned k, gpu = gpu_index(g), start = 0;
    int idx;
    nvmlReturn_t r = NVML_ERROR_INSUFFICIENT_RESOURCES;
    if (!g->has_mig || !mig_on(g)) return NVML_ERROR_NOT_SUPPORTED;
    idx = profile_by_id(g, profileId);
    if (idx < 0) return NVML_ERROR_INVALID_ARGUMENT;
    p = &g->mig_profiles[idx];
    if (want) {
        int ok = want->size == p->size;
        for (k = 0; ok && k < p->nplacements && p->placements[k] != want->start; k++)
            ;
        if (!ok || k == p->nplacements) return NVML_ERROR_INVALID_ARGUMENT;
        start = want->start;
        r = gi_fits(g, idx, start);
    } else {
        /* No placement asked for: the simulator takes the highest free one (a deterministic choice;
         * consumers that care use CreateGpuInstanceWithPlacement). */
        for (k = p->nplacements; k-- > 0;) {
            r = gi_fits(g, idx, p->placements[k]);
            if (r == NVML_SUCCESS) {
                start = p->placements[k];
                break;
            }
        }
    }
    if (r != NVML_SUCCESS) return r;
    gi = &g_sim.gis[gpu][gi_id_for(p->size, start)];
    memset(gi, 0, sizeof *gi);
    gi->used = 1;
    gi->gpu = gpu;
    gi->id = gi_id_for(p->size, start);
    gi->prof = idx;
    gi->start = start;
    gi->size = p->size;
    memset(g_sim.cis[gpu][gi->id], 0, sizeof g_sim.cis[gpu][gi->id]);
    r = mig_save();
    if (r != NVML_SUCCESS) {
        gi->used = 0;
        return r;
    }
    *out = gi;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                nvmlGpuInstance_t *gpuInstance)
{
    ENTER_GPU(device);
    NEED(gpuInstance);
    return sim_leave(gi_create(device, profileId, NULL, gpuInstance));
}

nvmlReturn_t DECLDIR nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                             const nvmlGpuInstancePlacement_t *placement,
                                                             nvmlGpuInstance_t *gpuInstance)
{
    ENTER_GPU(device);
    NEED(gpuInstance && placement);
    return sim_leave(gi_create(device, profileId, placement, gpuInstance));
}

/* A GPU instance with compute instances is in use (nvml.h: IN_USE); destroy those first. */
nvmlReturn_t DECLDIR nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    unsigned cid;
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    for (cid = 0; cid < SIM_MIG_MAX_CI; cid++)
        if (g_sim.cis[gpuInstance->gpu][gpuInstance->id][cid].used) return sim_leave(NVML_ERROR_IN_USE);
    gpuInstance->used = 0;
    return sim_leave(mig_save());
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                              unsigned int *count)
{
    unsigned k, n = 0;
    int idx;
    ENTER_GPU(device);
    NEED(count);
    if (!device->has_mig || !mig_on(device)) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    idx = profile_by_id(device, profileId);
    if (idx < 0) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    /* Greedy from the top, as creation places them. */
    {
        struct nvmlGpuInstance_st saved[SIM_MIG_MAX_GI_ID];
        const sim_mig_profile *p = &device->mig_profiles[idx];
        unsigned gpu = gpu_index(device);
        memcpy(saved, g_sim.gis[gpu], sizeof saved);
        for (k = p->nplacements; k-- > 0;) {
            if (gi_fits(device, idx, p->placements[k]) != NVML_SUCCESS) continue;
            struct nvmlGpuInstance_st *gi = &g_sim.gis[gpu][gi_id_for(p->size, p->placements[k])];
            gi->used = 1;
            gi->prof = idx;
            gi->start = p->placements[k];
            gi->size = p->size;
            n++;
        }
        memcpy(g_sim.gis[gpu], saved, sizeof saved);
    }
    *count = n;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                              nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    unsigned gid, n = 0, gpu;
    int idx;
    ENTER_GPU(device);
    NEED(count && gpuInstances);
    if (!device->has_mig || !mig_on(device)) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    idx = profile_by_id(device, profileId);
    NEED(idx >= 0);
    gpu = gpu_index(device);
    for (gid = 0; gid < SIM_MIG_MAX_GI_ID; gid++)
        if (g_sim.gis[gpu][gid].used && g_sim.gis[gpu][gid].prof == idx) gpuInstances[n++] = &g_sim.gis[gpu][gid];
    *count = n;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                 nvmlGpuInstance_t *gpuInstance)
{
    unsigned gpu;
    ENTER_GPU(device);
    NEED(gpuInstance);
    if (!device->has_mig || !mig_on(device)) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    NEED(id < SIM_MIG_MAX_GI_ID);
    gpu = gpu_index(device);
    if (!g_sim.gis[gpu][id].used) return sim_leave(NVML_ERROR_NOT_FOUND);
    *gpuInstance = &g_sim.gis[gpu][id];
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(info);
    info->device = &g_sim.gpus[gpuInstance->gpu];
    info->id = gpuInstance->id;
    info->profileId = g_sim.gpus[gpuInstance->gpu].mig_profiles[gpuInstance->prof].id;
    info->placement.start = gpuInstance->start;
    info->placement.size = gpuInstance->size;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ compute instances */

static nvmlReturn_t ci_profile_check(nvmlGpuInstance_t gi, unsigned profile)
{
    if (profile >= SIM_CI_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    return ci_supported(gi, &g_sim.gpus[gi->gpu], profile) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

static void ci_fill(nvmlGpuInstance_t gi, unsigned profile, unsigned *id, unsigned *slices, unsigned *count,
                    unsigned *sm, unsigned *ce, unsigned *dec, unsigned *jpeg, unsigned *ofa, char *name, size_t len)
{
    const struct nvmlDevice_st *g = &g_sim.gpus[gi->gpu];
    const sim_mig_profile *p = &g->mig_profiles[gi->prof];
    char pname[48];
    *id = profile;
    *slices = ci_slices(profile);
    *count = p->slices / ci_slices(profile);
    *sm = ci_sm(gi, g, profile);
    *ce = p->ce;
    *dec = p->dec;
    *jpeg = p->jpeg;
    *ofa = p->ofa;
    if (name) {
        ci_profile_name(pname, sizeof pname, g, gi, profile);
        snprintf(name, len, "MIG %s", pname);
    }
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                 unsigned int engProfile,
                                                                 nvmlComputeInstanceProfileInfo_t *info)
{
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(info && engProfile == NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED);
    r = ci_profile_check(gpuInstance, profile);
    if (r != NVML_SUCCESS) return sim_leave(r);
    memset(info, 0, sizeof *info);
    ci_fill(gpuInstance, profile, &info->id, &info->sliceCount, &info->instanceCount, &info->multiprocessorCount,
            &info->sharedCopyEngineCount, &info->sharedDecoderCount, &info->sharedJpegCount, &info->sharedOfaCount,
            NULL, 0);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance,
                                                                  unsigned int profile, unsigned int engProfile,
                                                                  nvmlComputeInstanceProfileInfo_v2_t *info)
{
    unsigned version;
    simComputeInstanceProfileInfo_v3_t v;
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(info && engProfile == NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED);
    version = info->version;
    NEED(version == SIM_CI_PROFILE_INFO_V2 || version == SIM_CI_PROFILE_INFO_V3);
    r = ci_profile_check(gpuInstance, profile);
    if (r != NVML_SUCCESS) return sim_leave(r);
    memset(&v, 0, sizeof v);
    v.version = version;
    ci_fill(gpuInstance, profile, &v.id, &v.sliceCount, &v.instanceCount, &v.multiprocessorCount,
            &v.sharedCopyEngineCount, &v.sharedDecoderCount, &v.sharedJpegCount, &v.sharedOfaCount, v.name,
            sizeof v.name);
    memcpy(info, &v, version & 0xFFFFFF); /* a v2 caller's struct lacks `capabilities` */
    return sim_leave(NVML_SUCCESS);
}

/* CI placements are multiples of their size within the GPU instance's compute slices. */
static nvmlReturn_t ci_create(nvmlGpuInstance_t gi, unsigned profile, nvmlComputeInstance_t *out)
{
    const struct nvmlDevice_st *g = &g_sim.gpus[gi->gpu];
    unsigned gs = g->mig_profiles[gi->prof].slices, n = ci_slices(profile), used = 0, cid, start, free_id = 99;
    struct nvmlComputeInstance_st *cis = g_sim.cis[gi->gpu][gi->id], *ci;
    nvmlReturn_t r = ci_profile_check(gi, profile);
    if (r == NVML_ERROR_INVALID_ARGUMENT) return r;
    if (r != NVML_SUCCESS) return NVML_ERROR_NOT_SUPPORTED;
    for (cid = 0; cid < SIM_MIG_MAX_CI; cid++) {
        if (cis[cid].used) used += cis[cid].size;
        else if (free_id == 99) free_id = cid;
    }
    if (used + n > gs || free_id == 99) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    for (start = 0; start + n <= gs; start += n) {
        int clash = 0;
        for (cid = 0; cid < SIM_MIG_MAX_CI; cid++)
            if (cis[cid].used && start < cis[cid].start + cis[cid].size && cis[cid].start < start + n) clash = 1;
        if (!clash) break;
    }
    if (start + n > gs) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    ci = &cis[free_id];
    ci->used = 1;
    ci->gi = gi;
    ci->id = free_id;
    ci->profile = profile;
    ci->start = start;
    ci->size = n;
    r = mig_save();
    if (r != NVML_SUCCESS) {
        ci->used = 0;
        return r;
    }
    *out = ci;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                         nvmlComputeInstance_t *computeInstance)
{
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(computeInstance);
    return sim_leave(ci_create(gpuInstance, profileId, computeInstance));
}

nvmlReturn_t DECLDIR nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    nvmlReturn_t r = enter_ci(computeInstance);
    if (r != NVML_SUCCESS) return r;
    computeInstance->used = 0;
    return sim_leave(mig_save());
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                       unsigned int profileId, unsigned int *count)
{
    unsigned gs, used = 0, cid;
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(count);
    r = ci_profile_check(gpuInstance, profileId);
    if (r != NVML_SUCCESS) return sim_leave(r);
    gs = g_sim.gpus[gpuInstance->gpu].mig_profiles[gpuInstance->prof].slices;
    for (cid = 0; cid < SIM_MIG_MAX_CI; cid++)
        if (g_sim.cis[gpuInstance->gpu][gpuInstance->id][cid].used)
            used += g_sim.cis[gpuInstance->gpu][gpuInstance->id][cid].size;
    *count = (gs - used) / ci_slices(profileId);
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                       nvmlComputeInstance_t *computeInstances, unsigned int *count)
{
    unsigned cid, n = 0;
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(count && computeInstances);
    r = ci_profile_check(gpuInstance, profileId);
    if (r != NVML_SUCCESS) return sim_leave(r);
    for (cid = 0; cid < SIM_MIG_MAX_CI; cid++) {
        struct nvmlComputeInstance_st *ci = &g_sim.cis[gpuInstance->gpu][gpuInstance->id][cid];
        if (ci->used && ci->profile == profileId) computeInstances[n++] = ci;
    }
    *count = n;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                          nvmlComputeInstance_t *computeInstance)
{
    nvmlReturn_t r = enter_gi(gpuInstance);
    if (r != NVML_SUCCESS) return r;
    NEED(computeInstance && id < SIM_MIG_MAX_CI);
    if (!g_sim.cis[gpuInstance->gpu][gpuInstance->id][id].used) return sim_leave(NVML_ERROR_NOT_FOUND);
    *computeInstance = &g_sim.cis[gpuInstance->gpu][gpuInstance->id][id];
    return sim_leave(NVML_SUCCESS);
}

static nvmlReturn_t ci_info(nvmlComputeInstance_t ci, nvmlComputeInstanceInfo_t *info, int with_placement)
{
    nvmlReturn_t r = enter_ci(ci);
    if (r != NVML_SUCCESS) return r;
    NEED(info);
    info->device = &g_sim.gpus[ci->gi->gpu];
    info->gpuInstance = ci->gi;
    info->id = ci->id;
    info->profileId = ci->profile;
    if (with_placement) {
        info->placement.start = ci->start;
        info->placement.size = ci->size;
    }
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                  nvmlComputeInstanceInfo_t *info)
{
    return ci_info(computeInstance, info, 1);
}

/* The v1 call predates the placement field. */
nvmlReturn_t DECLDIR nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info)
{
    return ci_info(computeInstance, info, 0);
}
