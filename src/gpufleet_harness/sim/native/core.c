/* Library lifetime (reference-counted init/shutdown), machine.json loading, the control file, error
 * strings and system-level queries of the simulated NVML. */
#include "sim.h"
#include "simjson.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

sim_state g_sim = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int g_warned; /* the "cannot load machine.json" message is printed once per process */

void sim_path(char *out, size_t outlen, const char *name)
{
    snprintf(out, outlen, "%s/%s", g_sim.root, name);
}

nvmlReturn_t sim_copy_str(char *dst, unsigned int length, const char *src)
{
    size_t n = strlen(src);
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (n + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------ control file */

static void control_defaults(void)
{
    g_sim.driver_loaded = 1;
    g_sim.fm_running = 1;
    g_sim.clock_frozen = 0;
    g_sim.clock_ms = 0;
    memset(g_sim.lost, 0, sizeof g_sim.lost);
    memset(g_sim.hung_until, 0, sizeof g_sim.hung_until);
    g_sim.driver_hung_until = 0;
}

/* A control line's `hung [UNTIL]` tail: UNTIL in CLOCK_REALTIME ms, else until the line goes. */
static long long hung_until(const char *until)
{
    char *end;
    long long ms;
    if (!*until) return SIM_HUNG_FOREVER;
    ms = strtoll(until, &end, 10);
    return *end == '\0' && ms > 0 ? ms : SIM_HUNG_FOREVER;
}

static void control_parse(char *text)
{
    char *save = NULL, *line;
    control_defaults();
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char word[32] = "", arg1[32] = "", arg2[32] = "", arg3[32] = "";
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        if (sscanf(line, "%31s %31s %31s %31s", word, arg1, arg2, arg3) < 2) continue;
        if (strcmp(word, "driver") == 0 && strcmp(arg1, "hung") == 0) {
            g_sim.driver_hung_until = hung_until(arg2);
        } else if (strcmp(word, "driver") == 0) {
            g_sim.driver_loaded = strcmp(arg1, "unloaded") != 0;
        } else if (strcmp(word, "clock") == 0) {
            /* `clock MS`: the sim clock stands still at MS (tests step it); absent: CLOCK_BOOTTIME */
            char *end;
            long long ms = strtoll(arg1, &end, 10);
            if (*end == '\0' && ms >= 0) {
                g_sim.clock_frozen = 1;
                g_sim.clock_ms = ms;
            }
        } else if (strcmp(word, "fabricmanager") == 0) {
            g_sim.fm_running = strcmp(arg1, "stopped") != 0;
        } else if (strcmp(word, "gpu") == 0) {
            char *end;
            long idx = strtol(arg1, &end, 10);
            if (*end == '\0' && idx >= 0 && idx < SIM_MAX_GPUS) {
                if (strcmp(arg2, "lost") == 0) g_sim.lost[idx] = 1;
                else if (strcmp(arg2, "hung") == 0) g_sim.hung_until[idx] = hung_until(arg3);
            }
        }
        /* Unknown lines are ignored: newer tooling may write settings an older library predates. */
    }
}

/* Re-read the control file if its identity (inode, size, mtime) changed; one stat() per call. The
 * writer replaces the file by rename, so a changed inode catches same-size, same-mtime rewrites. */
static void control_refresh(int force)
{
    char path[PATH_MAX + 16];
    struct stat st;
    long long mtime_ns;
    sim_path(path, sizeof path, "control");
    if (stat(path, &st) != 0) {
        /* No control file: a plain installed simulation with nothing injected. */
        g_sim.ctl_valid = 0;
        control_defaults();
        return;
    }
    mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    if (!force && g_sim.ctl_valid && st.st_ino == g_sim.ctl_ino && st.st_dev == g_sim.ctl_dev &&
        st.st_size == g_sim.ctl_size && mtime_ns == g_sim.ctl_mtime_ns)
        return;
    {
        FILE *f = fopen(path, "r");
        char buf[8192];
        size_t n = 0;
        if (f) {
            n = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
        }
        buf[n] = '\0';
        control_parse(buf);
    }
    g_sim.ctl_valid = 1;
    g_sim.ctl_dev = st.st_dev;
    g_sim.ctl_ino = st.st_ino;
    g_sim.ctl_size = st.st_size;
    g_sim.ctl_mtime_ns = mtime_ns;
}

/* ------------------------------------------------------------------------------------ machine.json */

static int fail_load(char *err, size_t errlen, const char *what)
{
    snprintf(err, errlen, "%s", what);
    return -1;
}

static void copy_field(char *dst, size_t dstlen, const sj_value *v, const char *dflt)
{
    snprintf(dst, dstlen, "%s", sj_str(v, dflt));
}

static void parse_uuid_bytes(const char *text, unsigned char out[SIM_GPU_FABRIC_UUID_LEN])
{
    size_t i = 0;
    memset(out, 0, SIM_GPU_FABRIC_UUID_LEN);
    for (; *text && i < 2 * SIM_GPU_FABRIC_UUID_LEN; text++) {
        int v;
        char c = *text;
        if (c >= '0' && c <= '9') v = c - '0';
        else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
        else continue; /* dashes */
        out[i / 2] = (unsigned char)(out[i / 2] | (v << (i % 2 ? 0 : 4)));
        i++;
    }
}

/* Identity, board and the getters newer drivers answer (machine.json keys written by machine.py). */
static void load_board(struct nvmlDevice_st *g, const sj_value *j)
{
    const sj_value *bar1 = sj_get(j, "bar1"), *pcie = sj_get(j, "pcie"), *v;
    unsigned k;
    copy_field(g->inforom_ecc, sizeof g->inforom_ecc, sj_get(j, "inforom_ecc_version"), "6.16");
    g->bar1_total = (unsigned long long)sj_int(sj_get(bar1, "total"), 256LL << 20);
    g->bar1_used = (unsigned long long)sj_int(sj_get(bar1, "used"), 0);
    if (g->bar1_used > g->bar1_total) g->bar1_used = g->bar1_total;
    g->board_id = (unsigned)sj_int(sj_get(j, "board_id"), (long long)(g->bus << 8 | g->device));
    g->module_id = (unsigned)sj_int(sj_get(j, "module_id"), g->index + 1);
    g->irq = (unsigned)sj_int(sj_get(j, "irq"), 0);
    g->pdi = (unsigned long long)sj_int(sj_get(j, "pdi"), 0);
    g->has_bus_width = !sj_is_null(sj_get(j, "memory_bus_width"));
    g->bus_width = (unsigned)sj_int(sj_get(j, "memory_bus_width"), 0);
    g->has_cores = !sj_is_null(sj_get(j, "cuda_cores"));
    g->cores = (unsigned)sj_int(sj_get(j, "cuda_cores"), 0);
    g->fans = (unsigned)sj_int(sj_get(j, "fans"), 0);
    g->display_mode = (int)sj_int(sj_get(j, "display_mode"), 0);
    g->gsp = (int)sj_int(sj_get(j, "gsp_firmware"), 0);
    g->pcie_max_gen = (unsigned)sj_int(sj_get(pcie, "max_generation"), 3);
    g->pcie_gen = (unsigned)sj_int(sj_get(pcie, "generation"), g->pcie_max_gen);
    g->pcie_max_width = (unsigned)sj_int(sj_get(pcie, "max_width"), 16);
    g->pcie_width = (unsigned)sj_int(sj_get(pcie, "width"), g->pcie_max_width);
    g->pcie_speed = (unsigned)sj_int(sj_get(pcie, "speed_mbps"), 8000);
    g->pcie_tx = (unsigned)sj_int(sj_get(pcie, "tx_kbps"), 0);
    g->pcie_rx = (unsigned)sj_int(sj_get(pcie, "rx_kbps"), 0);
    g->has_c2c = !sj_is_null(sj_get(j, "c2c_enabled"));
    g->c2c_enabled = (unsigned)sj_int(sj_get(j, "c2c_enabled"), 0);
    v = sj_get(j, "conf_compute");
    g->has_cc = !sj_is_null(v);
    g->cc_protected_kib = (unsigned long long)sj_int(sj_get(v, "protected_kib"), 0);
    v = sj_get(j, "platform_info");
    g->has_platform = !sj_is_null(v);
    g->platform_host_id = (unsigned)sj_int(sj_get(v, "host_id"), 0);
    g->has_addressing = !sj_is_null(sj_get(j, "addressing_mode"));
    g->addressing_mode = (unsigned)sj_int(sj_get(j, "addressing_mode"), 0);
    v = sj_get(j, "repair_status");
    g->has_repair = !sj_is_null(v);
    for (k = 0; k < 2; k++) g->repair[k] = (unsigned)sj_int(sj_at(v, k), 0);
    v = sj_get(j, "remapped_rows");
    g->has_remapped = !sj_is_null(v);
    for (k = 0; k < 4; k++) g->remapped[k] = (unsigned)sj_int(sj_at(v, k), 0);
    g->has_energy = (int)sj_int(sj_get(j, "energy"), 0);
    g->clock_event_reasons = (unsigned long long)sj_int(sj_get(j, "clock_event_reasons"), 1);
    v = sj_get(sj_get(j, "supported_clocks"), "memory");
    g->nmem_clocks = v && v->type == SJ_ARR ? (unsigned)v->len : 0;
    if (g->nmem_clocks > 8) g->nmem_clocks = 8;
    for (k = 0; k < g->nmem_clocks; k++) g->mem_clocks[k] = (unsigned)sj_int(sj_at(v, k), 0);
    v = sj_get(sj_get(j, "supported_clocks"), "graphics");
    g->ngfx_clocks = v && v->type == SJ_ARR ? (unsigned)v->len : 0;
    if (g->ngfx_clocks > 256) g->ngfx_clocks = 256;
    for (k = 0; k < g->ngfx_clocks; k++) g->gfx_clocks[k] = (unsigned)sj_int(sj_at(v, k), 0);
}

/* The power model of workloads (load.c): machine.json's `load`, else derived from the power fields by
 * the rule of workload.derive_params (roots materialized before it). */
static void load_params(struct nvmlDevice_st *g, const sj_value *j)
{
    unsigned idle = g->power_usage_mw, limit = g->power_limit_mw;
    unsigned cap = limit * 988ULL / 1000 > idle ? (unsigned)(limit * 988ULL / 1000) : idle;
    g->load_idle_mw = (unsigned)sj_int(sj_get(j, "idle_mw"), idle);
    g->load_cap_mw = (unsigned)sj_int(sj_get(j, "cap_mw"), cap);
    g->load_full_mw = (unsigned)sj_int(sj_get(j, "full_mw"), idle + (cap - idle) * 4ULL / 3);
    g->load_linger_mw = (unsigned)sj_int(sj_get(j, "linger_mw"), idle + (limit > idle ? limit - idle : 0) * 3ULL / 40);
    g->load_linger_ms = sj_int(sj_get(j, "linger_ms"), 2500);
    /* a model that would move below idle or above the limit is taken as none */
    if (g->load_cap_mw < g->load_idle_mw || g->load_cap_mw > limit) g->load_cap_mw = g->load_idle_mw;
    if (g->load_full_mw < g->load_idle_mw) g->load_full_mw = g->load_idle_mw;
    if (g->load_linger_mw < g->load_idle_mw || g->load_linger_mw > limit) g->load_linger_mw = g->load_idle_mw;
    if (g->load_linger_ms < 0) g->load_linger_ms = 0;
    /* a memory-bound load (a memset loop) draws 72.44 % of the way from idle to the cap (recorded: 522.9 W) */
    g->load_membound_mw = (unsigned)sj_int(sj_get(j, "membound_mw"),
                                           g->load_idle_mw + (g->load_cap_mw - g->load_idle_mw) * 7244ULL / 10000);
    if (g->load_membound_mw < g->load_idle_mw) g->load_membound_mw = g->load_idle_mw;
}

static int load_gpu(struct nvmlDevice_st *g, const sj_value *j, unsigned i, const sj_value *switches,
                    char *err, size_t errlen)
{
    static const char *clock_names[NVML_CLOCK_COUNT] = {"graphics", "sm", "memory", "video"};
    const sj_value *pci = sj_get(j, "pci"), *mem = sj_get(j, "memory"), *cc = sj_get(j, "cuda_cc");
    const sj_value *mig = sj_get(j, "mig_mode"), *links = sj_get(j, "nvlinks"), *fab = sj_get(j, "fabric");
    const sj_value *gnuma = sj_get(j, "gpu_numa_node");
    unsigned k, c;
    memset(g, 0, sizeof *g);
    if (!pci || !mem || !sj_str(sj_get(j, "uuid"), NULL) || !sj_str(sj_get(j, "name"), NULL))
        return fail_load(err, errlen, "a gpu lacks pci, memory, uuid or name");
    g->index = (unsigned)sj_int(sj_get(j, "index"), i);
    g->minor = (unsigned)sj_int(sj_get(j, "minor"), i);
    copy_field(g->uuid, sizeof g->uuid, sj_get(j, "uuid"), "");
    copy_field(g->serial, sizeof g->serial, sj_get(j, "serial"), "");
    copy_field(g->name, sizeof g->name, sj_get(j, "name"), "");
    g->domain = (unsigned)sj_int(sj_get(pci, "domain"), 0);
    g->bus = (unsigned)sj_int(sj_get(pci, "bus"), 0);
    g->device = (unsigned)sj_int(sj_get(pci, "device"), 0);
    g->pci_device_id = (unsigned)sj_int(sj_get(pci, "device_id"), 0);
    g->pci_subsystem_id = (unsigned)sj_int(sj_get(pci, "subsystem_id"), 0);
    g->mem_total = (unsigned long long)sj_int(sj_get(mem, "total"), 0);
    g->mem_reserved = (unsigned long long)sj_int(sj_get(mem, "reserved"), 0);
    g->mem_used = (unsigned long long)sj_int(sj_get(mem, "used"), 0);
    g->numa_node = (int)sj_int(sj_get(j, "numa_node"), -1);
    g->has_gpu_numa = !sj_is_null(gnuma);
    g->gpu_numa_node = (unsigned)sj_int(gnuma, 0);
    g->brand = (int)sj_int(sj_get(j, "brand"), NVML_BRAND_UNKNOWN);
    g->arch = (unsigned)sj_int(sj_get(j, "architecture"), NVML_DEVICE_ARCH_UNKNOWN);
    g->cc_major = (int)sj_int(sj_at(cc, 0), 0);
    g->cc_minor = (int)sj_int(sj_at(cc, 1), 0);
    g->persistence = (int)sj_int(sj_get(j, "persistence_mode"), 1);
    g->has_mig = !sj_is_null(mig);
    g->mig_current = g->mig_default_current = (unsigned)sj_int(sj_get(mig, "current"), 0);
    g->mig_pending = g->mig_default_pending = (unsigned)sj_int(sj_get(mig, "pending"), 0);
    if (g->has_mig) {
        const sj_value *migj = sj_get(j, "mig"), *profs = sj_get(migj, "profiles");
        g->mig_reset_required = (int)sj_int(sj_get(migj, "reset_required"), 1);
        g->nmig_profiles = profs && profs->type == SJ_ARR ? (unsigned)profs->len : 0;
        if (g->nmig_profiles > SIM_MIG_MAX_PROFILES) return fail_load(err, errlen, "too many MIG profiles");
        for (k = 0; k < g->nmig_profiles; k++) {
            const sj_value *p = sj_at(profs, k), *pl = sj_get(p, "placements");
            sim_mig_profile *m = &g->mig_profiles[k];
            m->profile = (unsigned)sj_int(sj_get(p, "profile"), 0);
            m->id = (unsigned)sj_int(sj_get(p, "id"), 0);
            copy_field(m->name, sizeof m->name, sj_get(p, "name"), "");
            m->slices = (unsigned)sj_int(sj_get(p, "slices"), 1);
            m->size = (unsigned)sj_int(sj_get(p, "size"), 1);
            m->instances = (unsigned)sj_int(sj_get(p, "instances"), 1);
            m->sm = (unsigned)sj_int(sj_get(p, "sm"), 0);
            m->ce = (unsigned)sj_int(sj_get(p, "ce"), 0);
            m->dec = (unsigned)sj_int(sj_get(p, "dec"), 0);
            m->enc = (unsigned)sj_int(sj_get(p, "enc"), 0);
            m->jpeg = (unsigned)sj_int(sj_get(p, "jpeg"), 0);
            m->ofa = (unsigned)sj_int(sj_get(p, "ofa"), 0);
            m->memory_mib = (unsigned long long)sj_int(sj_get(p, "memory_mib"), 0);
            m->nplacements = pl && pl->type == SJ_ARR ? (unsigned)pl->len : 0;
            if (m->nplacements > SIM_MIG_MEM_SLICES || m->slices == 0 || m->slices > SIM_MIG_COMPUTE_SLICES ||
                (m->size != 1 && m->size != 2 && m->size != 4 && m->size != 8))
                return fail_load(err, errlen, "a MIG profile has bad slices, size or placements");
            for (c = 0; c < m->nplacements; c++) m->placements[c] = (unsigned)sj_int(sj_at(pl, c), 0);
        }
    }
    g->ecc = (int)sj_int(sj_get(j, "ecc"), 1);
    g->nlinks = links && links->type == SJ_ARR ? (unsigned)links->len : 0;
    if (g->nlinks > SIM_MAX_LINKS) return fail_load(err, errlen, "a gpu has more NVLinks than NVML allows");
    for (k = 0; k < g->nlinks; k++) {
        const sj_value *l = sj_at(links, k);
        copy_field(g->links[k].remote_bus_id, sizeof g->links[k].remote_bus_id, sj_get(l, "remote_bus_id"), "");
        g->links[k].remote_type = (int)sj_int(sj_get(l, "remote_device_type"), NVML_NVLINK_DEVICE_TYPE_UNKNOWN);
        g->links[k].remote_device_id = 0;
        /* The far end's PCI device id: from the switch table (or a GPU's own entry, filled later). */
        for (c = 0; switches && c < switches->len; c++) {
            const sj_value *s = sj_at(switches, c);
            if (strcasecmp(sj_str(sj_get(s, "bus_id"), ""), g->links[k].remote_bus_id) == 0)
                g->links[k].remote_device_id = (unsigned)sj_int(sj_get(s, "device_id"), 0);
        }
    }
    /* fabric: null → the call is NOT_SUPPORTED (pre-Hopper); {} → state NOT_SUPPORTED (no NVSwitch);
     * {cluster_uuid, clique_id} → a member of the fabric. */
    g->has_fabric = !sj_is_null(fab);
    g->fabric_member = g->has_fabric && !sj_is_null(sj_get(fab, "clique_id"));
    if (g->fabric_member) {
        parse_uuid_bytes(sj_str(sj_get(fab, "cluster_uuid"), ""), g->cluster_uuid);
        g->clique_id = (unsigned)sj_int(sj_get(fab, "clique_id"), 0);
    }
    copy_field(g->board_part, sizeof g->board_part, sj_get(j, "board_part_number"), "");
    copy_field(g->vbios, sizeof g->vbios, sj_get(j, "vbios_version"), "");
    copy_field(g->inforom_image, sizeof g->inforom_image, sj_get(j, "inforom_image_version"), "");
    load_board(g, j);
    g->power_limit_mw = (unsigned)sj_int(sj_get(j, "power_limit_mw"), 300000);
    g->power_min_mw = (unsigned)sj_int(sj_get(j, "power_min_mw"), g->power_limit_mw / 2);
    g->power_usage_mw = (unsigned)sj_int(sj_get(j, "power_usage_mw"), 50000);
    load_params(g, sj_get(j, "load"));
    g->temperature = (unsigned)sj_int(sj_get(j, "temperature_c"), 30);
    g->has_mem_temp = !sj_is_null(sj_get(j, "memory_temperature_c"));
    g->mem_temperature = (unsigned)sj_int(sj_get(j, "memory_temperature_c"), 0);
    {
        const sj_value *mp = sj_get(j, "memory_power_mw");
        g->has_mem_power = !sj_is_null(mp);
        g->mem_power_idle_mw = (unsigned)sj_int(sj_get(mp, "idle"), 0);
        g->mem_power_busy_mw = (unsigned)sj_int(sj_get(mp, "busy"), g->mem_power_idle_mw);
        if (g->mem_power_busy_mw < g->mem_power_idle_mw) g->mem_power_busy_mw = g->mem_power_idle_mw;
    }
    /* a field table this library does not know (a newer machine.json) answers by the default rules */
    g->field_table = strcmp(sj_str(sj_get(j, "field_values"), ""), "h200-580.159.04") == 0 ? SIM_FIELDS_H200_580
                                                                                           : SIM_FIELDS_DEFAULT;
    g->pstate = (unsigned)sj_int(sj_get(j, "performance_state"), 0);
    for (c = 0; c < NVML_CLOCK_COUNT; c++) {
        g->clocks[c] = (unsigned)sj_int(sj_get(sj_get(j, "clocks"), clock_names[c]), 0);
        g->max_clocks[c] = (unsigned)sj_int(sj_get(sj_get(j, "max_clocks"), clock_names[c]), 0);
    }
    g->supported_events = (unsigned long long)sj_int(sj_get(j, "supported_events"), 0);
    return 0;
}

static int load_machine(char *err, size_t errlen)
{
    char path[PATH_MAX + 16], jerr[200];
    FILE *f;
    char *text;
    long size;
    sj_value doc;
    const sj_value *gpus, *topo, *numa, *switches, *host;
    unsigned i, j;
    int rc = -1;

    sim_path(path, sizeof path, "machine.json");
    f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    fseek(f, 0, SEEK_END);
    size = ftell(f);
    fseek(f, 0, SEEK_SET);
    text = size >= 0 ? malloc((size_t)size + 1) : NULL;
    if (!text || fread(text, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        free(text);
        snprintf(err, errlen, "cannot read %s", path);
        return -1;
    }
    fclose(f);
    text[size] = '\0';
    if (sj_parse(text, (size_t)size, &doc, jerr, sizeof jerr) != 0) {
        snprintf(err, errlen, "%s is not valid JSON (%s)", path, jerr);
        free(text);
        return -1;
    }
    free(text);

    if (sj_int(sj_get(&doc, "schema"), 0) != 1) {
        snprintf(err, errlen, "%s: unsupported schema (want 1)", path);
        goto out;
    }
    gpus = sj_get(&doc, "gpus");
    topo = sj_get(&doc, "topology");
    switches = sj_get(&doc, "nvswitches");
    host = sj_get(&doc, "host");
    if (!gpus || gpus->type != SJ_ARR || gpus->len > SIM_MAX_GPUS) {
        snprintf(err, errlen, "%s: 'gpus' must be a list of at most %d GPUs", path, SIM_MAX_GPUS);
        goto out;
    }
    copy_field(g_sim.driver_version, sizeof g_sim.driver_version, sj_get(&doc, "driver_version"), "535.261.03");
    copy_field(g_sim.kmod_version, sizeof g_sim.kmod_version, sj_get(&doc, "kernel_module_version"),
               g_sim.driver_version);
    copy_field(g_sim.nvml_version, sizeof g_sim.nvml_version, sj_get(&doc, "nvml_version"), "12.535.261.03");
    g_sim.cuda_version = (int)sj_int(sj_get(&doc, "cuda_driver_version"), 12020);
    g_sim.has_branch = sj_str(sj_get(&doc, "driver_branch"), NULL) != NULL;
    copy_field(g_sim.driver_branch, sizeof g_sim.driver_branch, sj_get(&doc, "driver_branch"), "");
    g_sim.fm_required = (int)sj_int(sj_get(&doc, "fabricmanager_required"), 0);
    g_sim.passthrough = !sj_is_null(sj_get(host, "hypervisor"));
    g_sim.ncpus = (int)sj_int(sj_get(host, "cpus"), 1);
    numa = sj_get(&doc, "numa_cpus");
    g_sim.nnuma = numa && numa->type == SJ_ARR ? (unsigned)numa->len : 0;
    if (g_sim.nnuma > SIM_MAX_NUMA) g_sim.nnuma = SIM_MAX_NUMA;
    for (i = 0; i < g_sim.nnuma; i++) {
        g_sim.numa_cpu_lo[i] = (int)sj_int(sj_at(sj_at(numa, i), 0), 0);
        g_sim.numa_cpu_hi[i] = (int)sj_int(sj_at(sj_at(numa, i), 1), 0);
    }
    for (i = 0; i < gpus->len; i++) {
        char gerr[200];
        if (load_gpu(&g_sim.gpus[i], sj_at(gpus, i), i, switches, gerr, sizeof gerr)) {
            snprintf(err, errlen, "%s: gpus[%u]: %s", path, i, gerr);
            goto out;
        }
    }
    /* Links to GPUs (direct NVLink, no switch) take the peer's device id from its entry. */
    for (i = 0; i < gpus->len; i++)
        for (j = 0; j < g_sim.gpus[i].nlinks; j++) {
            unsigned k;
            for (k = 0; k < gpus->len; k++) {
                char b[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
                snprintf(b, sizeof b, "%08X:%02X:%02X.0", g_sim.gpus[k].domain, g_sim.gpus[k].bus,
                         g_sim.gpus[k].device);
                if (strcasecmp(b, g_sim.gpus[i].links[j].remote_bus_id) == 0)
                    g_sim.gpus[i].links[j].remote_device_id = g_sim.gpus[k].pci_device_id;
            }
        }
    for (i = 0; i < gpus->len; i++)
        for (j = 0; j < gpus->len; j++)
            g_sim.topo[i][j] = (unsigned char)sj_int(sj_at(sj_at(topo, i), j),
                                                     i == j ? NVML_TOPOLOGY_INTERNAL : NVML_TOPOLOGY_SYSTEM);
    g_sim.ngpus = (unsigned)gpus->len;
    rc = 0;
out:
    sj_free(&doc);
    return rc;
}

/* ------------------------------------------------------------------------------------ entry checks */

nvmlReturn_t sim_leave(nvmlReturn_t ret)
{
    pthread_mutex_unlock(&g_sim.lock);
    return ret;
}

/* Whether a hang (an entry of hung_until) holds now. */
static int hang_holds(long long until)
{
    struct timespec ts;
    if (until == 0) return 0;
    if (until == SIM_HUNG_FOREVER) return 1;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 < until;
}

/* A hung call as its caller sees it: it does not return. The lock is dropped while it waits (other
 * threads, other GPUs go on) and taken again before the control file is looked at anew. Lock held. */
static void hang_wait(void)
{
    struct timespec ts = {0, 20 * 1000000L};
    pthread_mutex_unlock(&g_sim.lock);
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&g_sim.lock);
    control_refresh(0);
}

nvmlReturn_t sim_enter(void)
{
    pthread_mutex_lock(&g_sim.lock);
    if (g_sim.refcount <= 0) return sim_leave(NVML_ERROR_UNINITIALIZED);
    control_refresh(0);
    while (hang_holds(g_sim.driver_hung_until)) {
        hang_wait();
        if (g_sim.refcount <= 0) return sim_leave(NVML_ERROR_UNINITIALIZED);
    }
    if (!g_sim.driver_loaded) return sim_leave(NVML_ERROR_DRIVER_NOT_LOADED);
    sim_mig_refresh(0);
    return NVML_SUCCESS;
}

nvmlReturn_t sim_check_dev(nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)&g_sim.gpus[0];
    uintptr_t mbase = (uintptr_t)&g_sim.migdevs[0][0];
    if (device && p >= base && p < (uintptr_t)&g_sim.gpus[g_sim.ngpus] &&
        (p - base) % sizeof(struct nvmlDevice_st) == 0) {
        /* a full GPU */
    } else if (device && p >= mbase &&
               p < (uintptr_t)(&g_sim.migdevs[0][0] + SIM_MAX_GPUS * SIM_MIG_COMPUTE_SLICES) &&
               (p - mbase) % sizeof(struct nvmlDevice_st) == 0 && device->is_mig) {
        /* a MIG device handle whose compute instance exists */
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (g_sim.lost[device->index]) return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

nvmlReturn_t sim_enter_dev(nvmlDevice_t device)
{
    for (;;) {
        nvmlReturn_t r = sim_enter();
        if (r != NVML_SUCCESS) return r;
        r = sim_check_dev(device);
        if (r != NVML_SUCCESS) return sim_leave(r);
        if (!hang_holds(g_sim.hung_until[device->index])) return NVML_SUCCESS;
        /* a hung GPU: wait, then check everything again (the driver may have gone, the GPU been lost) */
        hang_wait();
        sim_leave(NVML_SUCCESS);
    }
}

/* ------------------------------------------------------------------------------------ init / shutdown */

nvmlReturn_t DECLDIR nvmlInitWithFlags(unsigned int flags)
{
    const char *root;
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing: every fixture has GPUs, attaching is free */
    pthread_mutex_lock(&g_sim.lock);
    if (g_sim.refcount == 0) {
        char err[3 * PATH_MAX]; /* room for the path plus the reason */
        root = getenv("GPUFLEET_SIM_ROOT");
        snprintf(g_sim.root, sizeof g_sim.root, "%s", root && *root ? root : SIM_DEFAULT_ROOT);
        if (load_machine(err, sizeof err) != 0) {
            if (!g_warned) {
                g_warned = 1;
                fprintf(stderr, "gpufleet-sim: %s (set GPUFLEET_SIM_ROOT to a sim root, see "
                                "`gpufleet sim env`)\n", err);
            }
            return sim_leave(NVML_ERROR_DRIVER_NOT_LOADED);
        }
    }
    control_refresh(1);
    while (hang_holds(g_sim.driver_hung_until)) hang_wait(); /* a wedged driver: opening it blocks too */
    if (!g_sim.driver_loaded) return sim_leave(NVML_ERROR_DRIVER_NOT_LOADED);
    if (g_sim.refcount == 0) {
        sim_mig_refresh(1);
        sim_load_refresh(1);
    }
    /* A kernel module that does not match the library is refused, as the real library does. */
    if (strcmp(g_sim.kmod_version, g_sim.driver_version) != 0)
        return sim_leave(NVML_ERROR_LIB_RM_VERSION_MISMATCH);
    g_sim.refcount++;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t DECLDIR nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t DECLDIR nvmlShutdown(void)
{
    pthread_mutex_lock(&g_sim.lock);
    if (g_sim.refcount <= 0) return sim_leave(NVML_ERROR_UNINITIALIZED);
    g_sim.refcount--;
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ error strings */

const DECLDIR char *nvmlErrorString(nvmlReturn_t result)
{
    switch ((int)result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "GPU access blocked by the operating system";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "Driver/library version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "The requested vgpu operation is not available on target "
                                                  "device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "The requested frequency is not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch between the argument and the API";
    case 26: return "Deprecated API";
    case SIM_ERROR_NOT_READY: return "System is not ready for the request";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------------------------ system queries */

nvmlReturn_t DECLDIR nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    return sim_leave(sim_copy_str(version, length, g_sim.driver_version));
}

nvmlReturn_t DECLDIR nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    /* Real NVML answers this without nvmlInit: it is the library's own version. */
    nvmlReturn_t r;
    pthread_mutex_lock(&g_sim.lock);
    r = sim_copy_str(version, length, g_sim.nvml_version[0] ? g_sim.nvml_version : "12.535.261.03");
    return sim_leave(r);
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!cudaDriverVersion) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = g_sim.cuda_version;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

nvmlReturn_t DECLDIR nvmlSystemGetDriverBranch(simDriverBranchInfoArg_t *arg, unsigned int length)
{
    simDriverBranchInfo_t *info = (simDriverBranchInfo_t *)arg;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!info) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* Drivers before the call existed (the 535 fixtures) have no branch to report. */
    if (!g_sim.has_branch) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    if (info->version != SIM_DRIVER_BRANCH_V1) return sim_leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (length > sizeof info->branch) length = sizeof info->branch;
    return sim_leave(sim_copy_str(info->branch, length, g_sim.driver_branch));
}

nvmlReturn_t DECLDIR nvmlGetExcludedDeviceCount(unsigned int *deviceCount)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!deviceCount) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = 0; /* no GPU is excluded (NVreg_ExcludedGpus is empty, as recorded) */
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlUnitGetCount(unsigned int *unitCount)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!unitCount) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *unitCount = 0; /* S-class units are long gone */
    return sim_leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ bus id parsing */

/* Accept "dddddddd:bb:dd.f", "dddd:bb:dd.f" and "bb:dd.f", hex in either case. */
static int parse_bus_id(const char *text, unsigned *domain, unsigned *bus, unsigned *dev, unsigned *fn)
{
    char tail;
    if (sscanf(text, "%x:%x:%x.%x%c", domain, bus, dev, fn, &tail) == 4) return 0;
    *domain = 0;
    if (sscanf(text, "%x:%x.%x%c", bus, dev, fn, &tail) == 3) return 0;
    return -1;
}

int sim_find_bus_id(const char *text)
{
    unsigned d, b, v, f, i;
    if (!text || parse_bus_id(text, &d, &b, &v, &f) != 0) return -2;
    for (i = 0; i < g_sim.ngpus; i++)
        if (g_sim.gpus[i].domain == d && g_sim.gpus[i].bus == b && g_sim.gpus[i].device == v && f == 0)
            return (int)i;
    return -1;
}
