/* Workloads: how the simulated GPUs' counters move (docs/simulator.md, "Workloads").
 *
 * The sim root's workloads/state (written by gpufleet_harness.sim.workload: `gpufleet sim inject ROOT load`,
 * the GPU burner) lists workloads with their GPU, start and end on the sim clock, utilization and process.
 * Everything that moves is a function of those records and the time, so every process reading one root sees
 * the same GPU and nothing runs in the background:
 *
 * - The instantaneous power is a step function: idle without work; with work idle plus the load's share of
 *   what a full load would draw, held at the power cap's plateau (the H200 recording: 691 of 700 W); for
 *   LINGER ms after the last workload a little above idle (125 W recorded) with the clocks still up.
 * - NVML's power reading is its one-second average (nvml.h: "power averaged over 1 sec interval" on Ampere
 *   and later), which gives the recorded one-second ramps; the energy counter is its integral, in integers
 *   (mW x ms = µJ) by the same rule as workload.py, so the two agree to the µJ and it never goes back.
 * - A GPU held by the cap runs its SM clock at max x (cap - idle) / (demand - idle), on a supported clock
 *   step, with clock-event reason SW power cap; an idle GPU runs its idle clocks with reason GPU idle.
 * - The temperature follows the power through two lags (fast: 17 C in 0.2 s, slow: 3.5 C in 3 s at the
 *   cap, fitted to the recording's 32 -> 46/50/52/53 C rise and 43/38/36/35/34/33 C fall). The memory
 *   temperature (HBM boards) follows the power and the memory's own activity through two slower lags.
 * - A workload is compute-bound (matrix products: the cap holds its clocks) or memory-bound (a memset loop:
 *   522.9 W on the H200, below the cap, clocks at their maximum, memory 100 % busy); their demands add up.
 *
 * Each GPU's records become a timeline of stretches with constant state, precomputed when the file changes
 * (energy and the temperature lags at each stretch's start), so a reading is a binary search. */
#include "sim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define TEMP_FAST_C 17.0
#define TEMP_FAST_MS 200.0
#define TEMP_SLOW_C 3.5
#define TEMP_SLOW_MS 3000.0
#define POWER_WINDOW_MS 1000   /* NVML's power reading: the average over the last second */
/* Memory temperature: a fast lag that follows mostly the memory's own activity and a slow one that follows
 * mostly the power, least-squares fitted to two H200s together: the fourth host's memset loop sampled every
 * 0.5 s (36 -> 47 C 0.3 s in, 52 at 1.3 s, 55-56 at 5-12 s; 43 C 0.5 s after, 40 at 1.5 s, 37 at 5.5 s) and
 * the first host's matrix products at 25 % memory (dmon, 1 s: 34 -> 40/43 ... 46 C over 19 s; 41/39/38/37 C
 * after). Each lag heads for POWER_C x the power's share of the cap + MEMORY_C x the memory utilization. */
#define MTEMP_FAST_POWER_C 1.7
#define MTEMP_FAST_MEMORY_C 13.1
#define MTEMP_FAST_MS 280.0
#define MTEMP_SLOW_POWER_C 6.4
#define MTEMP_SLOW_MEMORY_C 1.45
#define MTEMP_SLOW_MS 4800.0
#define CONTEXT_KIB 9024ULL    /* the driver's share of each process's context: 8.8125 MiB (recorded: v1 used
                                * 2271084544 B = reserved 615.0625 + process 1542 + 8.8125 MiB) */
#define BAR1_PROCESS_KIB 64ULL /* BAR1 maps a process's memory, its context and 64 KiB more (recorded: 1.625 ->
                                * 1552.5 MiB with one process of 1542 MiB) */
/* KB/s per % busy (recorded: matrix products ~7.5 MB/s TX, ~15 MB/s RX; a memset loop 15-17 / 38-39 MB/s) */
#define PCIE_TX_PER_UTIL 70
#define PCIE_RX_PER_UTIL 145
#define PCIE_TX_PER_UTIL_MEMBOUND 150
#define PCIE_RX_PER_UTIL_MEMBOUND 384
#define MAX_STATE_BYTES (8 << 20)
#define REASON_GPU_IDLE 0x1ULL
#define REASON_SW_POWER_CAP 0x4ULL

long long sim_now_ms(void)
{
    struct timespec ts;
    if (g_sim.clock_frozen) return g_sim.clock_ms;
    if (clock_gettime(CLOCK_BOOTTIME, &ts) != 0) return 0;
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000L;
}

/* ------------------------------------------------------------------------------------ the model */

/* What `uc` % of compute-bound and `um` % of memory-bound work would draw without the cap: each kind its
 * share of the way from idle to its full draw, scaled down together when they ask for more than 100 %
 * (workload.py's demand, the same integers). */
static unsigned long long demand_mw(const struct nvmlDevice_st *g, unsigned uc, unsigned um)
{
    unsigned long long scale = uc + um > 100 ? uc + um : 100;
    return g->load_idle_mw + ((unsigned long long)(g->load_full_mw - g->load_idle_mw) * uc +
                              (unsigned long long)(g->load_membound_mw - g->load_idle_mw) * um) / scale;
}

/* PCIe throughput (KB/s) of a stretch: the idle driver traffic and each kind's, scaled down with the rest when
 * the workloads ask for more than 100 % (workload.py's pcie_at, the same integers). */
static void pcie_rates(const struct nvmlDevice_st *g, unsigned uc, unsigned um, unsigned *tx, unsigned *rx)
{
    unsigned scale = uc + um > 100 ? uc + um : 100;
    *tx = g->pcie_tx + (PCIE_TX_PER_UTIL * uc + PCIE_TX_PER_UTIL_MEMBOUND * um) * 100 / scale;
    *rx = g->pcie_rx + (PCIE_RX_PER_UTIL * uc + PCIE_RX_PER_UTIL_MEMBOUND * um) * 100 / scale;
}

/* The instantaneous state of `gpu` at `t` from its records (workload.py's power_at, the same integers). */
static void state_at(const struct nvmlDevice_st *g, long long t, sim_seg *s)
{
    unsigned i, util = 0, mem = 0, enc = 0, dec = 0, uc = 0, um = 0;
    int active = 0, ended = 0;
    long long last_end = 0;
    for (i = 0; i < g_sim.nloads; i++) {
        const sim_load *l = &g_sim.loads[i];
        if (l->gpu != g->index) continue;
        if (l->start <= t && (l->end < 0 || t < l->end)) {
            active = 1;
            util += l->util;
            if (l->kind == SIM_KIND_MEMBOUND) um += l->util;
            else uc += l->util;
            mem += l->mem_util;
            enc += l->enc;
            dec += l->dec;
        } else if (l->end >= 0 && l->end <= t && (!ended || l->end > last_end)) {
            ended = 1;
            last_end = l->end;
        }
    }
    memset(s, 0, sizeof *s);
    s->at = t;
    if (active) {
        unsigned long long demand;
        s->state = SIM_GPU_BUSY;
        s->util = util > 100 ? 100 : util;
        s->mem_util = mem > 100 ? 100 : mem;
        s->enc = enc > 100 ? 100 : enc;
        s->dec = dec > 100 ? 100 : dec;
        s->util_compute = uc;
        s->util_membound = um;
        demand = demand_mw(g, uc, um);
        s->power_mw = (unsigned)(demand < g->load_cap_mw ? demand : g->load_cap_mw);
        s->capped = demand > g->load_cap_mw;
    } else if (ended && t < last_end + g->load_linger_ms) {
        s->state = SIM_GPU_LINGER;
        s->power_mw = g->load_linger_mw;
    } else {
        s->state = SIM_GPU_IDLE;
        s->power_mw = g->load_idle_mw;
    }
    pcie_rates(g, uc, um, &s->pcie_tx, &s->pcie_rx);
}

static int cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}

static double lag(double from, double target, double dt_ms, double tau_ms)
{
    return target + (from - target) * exp(-dt_ms / tau_ms);
}

/* x: how far the power is from idle towards the cap (1 at the cap). */
static double heat(const struct nvmlDevice_st *g, unsigned power_mw)
{
    if (g->load_cap_mw <= g->load_idle_mw) return 0.0;
    return ((double)power_mw - g->load_idle_mw) / (double)(g->load_cap_mw - g->load_idle_mw);
}

/* Where the memory temperature's lags head during a stretch (degrees above idle). */
static double mtemp_fast_target(const struct nvmlDevice_st *g, const sim_seg *s)
{
    return MTEMP_FAST_POWER_C * heat(g, s->power_mw) + MTEMP_FAST_MEMORY_C * s->mem_util / 100.0;
}

static double mtemp_slow_target(const struct nvmlDevice_st *g, const sim_seg *s)
{
    return MTEMP_SLOW_POWER_C * heat(g, s->power_mw) + MTEMP_SLOW_MEMORY_C * s->mem_util / 100.0;
}

/* The counters at `t` within stretch `s` (which starts at or before `t`). */
static void counters_at(const sim_seg *s, long long t, long long *idle, long long *capped, long long *tx,
                        long long *rx)
{
    long long dt = t - s->at;
    *idle = s->idle_ms + (s->state == SIM_GPU_IDLE ? dt : 0);
    *capped = s->capped_ms + (s->capped ? dt : 0);
    *tx = s->tx_bytes + (long long)s->pcie_tx * dt;
    *rx = s->rx_bytes + (long long)s->pcie_rx * dt;
}

static void build_timeline(unsigned gpu)
{
    const struct nvmlDevice_st *g = &g_sim.gpus[gpu];
    sim_timeline *tl = &g_sim.timelines[gpu];
    long long *points;
    unsigned i, n = 0, k, nseg = 0;
    free(tl->segs);
    tl->segs = NULL;
    tl->nseg = 0;
    points = malloc(sizeof *points * (3 * (size_t)g_sim.nloads + 1));
    if (!points) return;
    points[n++] = tl->origin;
    for (i = 0; i < g_sim.nloads; i++) {
        const sim_load *l = &g_sim.loads[i];
        long long cand[3];
        unsigned c, nc = 0;
        if (l->gpu != gpu) continue;
        cand[nc++] = l->start;
        if (l->end >= 0) {
            cand[nc++] = l->end;
            cand[nc++] = l->end + g->load_linger_ms;
        }
        for (c = 0; c < nc; c++)
            if (cand[c] > tl->origin) points[n++] = cand[c];
    }
    qsort(points, n, sizeof *points, cmp_ll);
    tl->segs = malloc(sizeof *tl->segs * n);
    if (!tl->segs) {
        free(points);
        return;
    }
    for (k = 0; k < n; k++) {
        sim_seg *s;
        if (k > 0 && points[k] == points[k - 1]) continue;
        s = &tl->segs[nseg];
        state_at(g, points[k], s);
        if (nseg == 0) {
            s->extra_uj = 0;
            /* the origin is a settled (cool) GPU or boot */
            s->temp_fast = s->temp_slow = s->mtemp_fast = s->mtemp_slow = 0.0;
            s->mem_util_ms = 0;
            if (tl->has_counters) {
                s->idle_ms = tl->origin_idle_ms;
                s->capped_ms = tl->origin_capped_ms;
                s->tx_bytes = tl->origin_tx_bytes;
                s->rx_bytes = tl->origin_rx_bytes;
            } else { /* no record of what came before: an idle GPU since boot */
                s->idle_ms = s->at;
                s->capped_ms = 0;
                s->tx_bytes = (long long)g->pcie_tx * s->at;
                s->rx_bytes = (long long)g->pcie_rx * s->at;
            }
        } else {
            const sim_seg *p = &tl->segs[nseg - 1];
            double dt = (double)(s->at - p->at), x = heat(g, p->power_mw);
            s->extra_uj = p->extra_uj + ((long long)p->power_mw - (long long)g->load_idle_mw) * (s->at - p->at);
            s->temp_fast = lag(p->temp_fast, TEMP_FAST_C * x, dt, TEMP_FAST_MS);
            s->temp_slow = lag(p->temp_slow, TEMP_SLOW_C * x, dt, TEMP_SLOW_MS);
            s->mtemp_fast = lag(p->mtemp_fast, mtemp_fast_target(g, p), dt, MTEMP_FAST_MS);
            s->mtemp_slow = lag(p->mtemp_slow, mtemp_slow_target(g, p), dt, MTEMP_SLOW_MS);
            counters_at(p, s->at, &s->idle_ms, &s->capped_ms, &s->tx_bytes, &s->rx_bytes);
            s->mem_util_ms = p->mem_util_ms + (long long)p->mem_util * (s->at - p->at);
        }
        nseg++;
    }
    free(points);
    tl->nseg = nseg;
}

/* The stretch `t` falls in; NULL before the timeline's origin. */
static const sim_seg *seg_at(const sim_timeline *tl, long long t)
{
    unsigned lo = 0, hi = tl->nseg;
    if (!tl->nseg || t < tl->segs[0].at) return NULL;
    while (hi - lo > 1) {
        unsigned mid = lo + (hi - lo) / 2;
        if (tl->segs[mid].at <= t) lo = mid;
        else hi = mid;
    }
    return &tl->segs[lo];
}

/* Energy since boot in µJ at `t` (workload.py's energy_mj x 1000, before its division). */
static long long energy_uj(const struct nvmlDevice_st *g, const sim_timeline *tl, long long t)
{
    const sim_seg *s = seg_at(tl, t);
    long long e = (long long)g->load_idle_mw * t + tl->settled_uj;
    if (s) e += s->extra_uj + ((long long)s->power_mw - (long long)g->load_idle_mw) * (t - s->at);
    return e;
}

/* The memory utilization's integral (% x ms) from the timeline's origin to `t` (0 before it). */
static long long mem_util_ms(const sim_timeline *tl, long long t)
{
    const sim_seg *s = seg_at(tl, t);
    return s ? s->mem_util_ms + (long long)s->mem_util * (t - s->at) : 0;
}

/* ------------------------------------------------------------------------------------ the state file */

static void parse_state(char *text)
{
    char *save = NULL, *line;
    unsigned cap = 0, i;
    free(g_sim.loads);
    g_sim.loads = NULL;
    g_sim.nloads = 0;
    for (i = 0; i < SIM_MAX_GPUS; i++) {
        g_sim.timelines[i].origin = 0;
        g_sim.timelines[i].settled_uj = 0;
        g_sim.timelines[i].has_counters = 0;
    }
    for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        sim_load l;
        int gi, ci, n;
        unsigned gpu;
        long long at, uj;
        char tail, kind[16];
        memset(&l, 0, sizeof l);
        if (sscanf(line, "settled %u %lld %lld %c", &gpu, &at, &uj, &tail) == 3) {
            if (gpu < g_sim.ngpus && at >= 0) {
                g_sim.timelines[gpu].origin = at;
                g_sim.timelines[gpu].settled_uj = uj;
            }
            continue;
        }
        {
            /* the counters of a folded history at the same instant (a writer puts it after its `settled`) */
            long long idle, capped, tx, rx;
            if (sscanf(line, "counters %u %lld %lld %lld %lld %lld %c", &gpu, &at, &idle, &capped, &tx, &rx,
                       &tail) == 6) {
                sim_timeline *tl = gpu < g_sim.ngpus ? &g_sim.timelines[gpu] : NULL;
                if (tl && at == tl->origin && idle >= 0 && capped >= 0 && tx >= 0 && rx >= 0) {
                    tl->has_counters = 1;
                    tl->origin_idle_ms = idle;
                    tl->origin_capped_ms = capped;
                    tl->origin_tx_bytes = tx;
                    tl->origin_rx_bytes = rx;
                }
                continue;
            }
        }
        n = sscanf(line, "load %llu %u %lld %lld %u %u %u %u %u %llu %d %d %63s %15s", &l.id, &l.gpu, &l.start,
                   &l.end, &l.util, &l.mem_util, &l.enc, &l.dec, &l.pid, &l.memory_mib, &gi, &ci, l.name, kind);
        if (n != 13 && n != 14) continue; /* comments, `next`, lines a newer writer added */
        /* the kind: absent (a line of an older writer) or unknown (a newer one's) is compute */
        l.kind = n == 14 && strcmp(kind, "membound") == 0 ? SIM_KIND_MEMBOUND : SIM_KIND_COMPUTE;
        if (l.gpu >= g_sim.ngpus || l.start < 0 || (l.end >= 0 && l.end < l.start)) continue;
        if (l.util > 100) l.util = 100;
        if (l.mem_util > 100) l.mem_util = 100;
        if (l.enc > 100) l.enc = 100;
        if (l.dec > 100) l.dec = 100;
        if (l.end < 0) l.end = -1;
        l.gi = gi < 0 ? SIM_NO_INSTANCE : (unsigned)gi;
        l.ci = ci < 0 ? SIM_NO_INSTANCE : (unsigned)ci;
        if (g_sim.nloads == cap) {
            unsigned ncap = cap ? 2 * cap : 64;
            sim_load *grown = realloc(g_sim.loads, sizeof *grown * ncap);
            if (!grown) break;
            g_sim.loads = grown;
            cap = ncap;
        }
        g_sim.loads[g_sim.nloads++] = l;
    }
}

void sim_load_refresh(int force)
{
    char path[PATH_MAX + 32];
    struct stat st;
    long long mtime_ns;
    unsigned i;
    snprintf(path, sizeof path, "%s/workloads/state", g_sim.root);
    if (stat(path, &st) != 0) {
        if (!force && !g_sim.wl_valid) return; /* still no file (nvmlInit built the idle timelines) */
        g_sim.wl_valid = 0;
        parse_state((char[]){""});
    } else {
        mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        if (!force && g_sim.wl_valid && st.st_ino == g_sim.wl_ino && st.st_dev == g_sim.wl_dev &&
            st.st_size == g_sim.wl_size && mtime_ns == g_sim.wl_mtime_ns)
            return;
        {
            FILE *f = fopen(path, "r");
            size_t size = st.st_size > MAX_STATE_BYTES ? MAX_STATE_BYTES : (size_t)st.st_size;
            char *buf = malloc(size + 1);
            size_t n = 0;
            if (buf) {
                if (f) n = fread(buf, 1, size, f);
                buf[n] = '\0';
                parse_state(buf);
                free(buf);
            }
            if (f) fclose(f);
        }
        g_sim.wl_valid = 1;
        g_sim.wl_dev = st.st_dev;
        g_sim.wl_ino = st.st_ino;
        g_sim.wl_size = st.st_size;
        g_sim.wl_mtime_ns = mtime_ns;
    }
    for (i = 0; i < g_sim.ngpus; i++) build_timeline(i);
}

/* ------------------------------------------------------------------------------------ readings */

/* The largest supported graphics clock at or below `mhz` (the idle clock at least). */
static unsigned clock_step(const struct nvmlDevice_st *g, unsigned mhz)
{
    unsigned k, best = 0;
    if (!g->ngfx_clocks) return mhz;
    for (k = 0; k < g->ngfx_clocks; k++)
        if (g->gfx_clocks[k] <= mhz && g->gfx_clocks[k] > best) best = g->gfx_clocks[k];
    return best ? best : g->clocks[NVML_CLOCK_SM];
}

void sim_read(const struct nvmlDevice_st *device, sim_reading *r)
{
    const struct nvmlDevice_st *g = &g_sim.gpus[device->index];
    sim_timeline *tl = &g_sim.timelines[device->index];
    long long t, from;
    const sim_seg *s;
    sim_seg origin;
    double x, temp;
    unsigned max_sm = g->max_clocks[NVML_CLOCK_SM];
    sim_load_refresh(0);
    t = sim_now_ms();
    s = seg_at(tl, t);
    if (!s) { /* before the timeline (a frozen clock set back): the idle GPU */
        state_at(g, t, &origin);
        origin.idle_ms = t;
        origin.tx_bytes = (long long)g->pcie_tx * t;
        origin.rx_bytes = (long long)g->pcie_rx * t;
        s = &origin;
    }
    memset(r, 0, sizeof *r);
    r->state = s->state;
    r->util = s->util;
    r->mem_util = s->mem_util;
    r->enc = s->enc;
    r->dec = s->dec;
    /* energy, and power as its average over the last second */
    {
        long long e = energy_uj(g, tl, t), e0;
        unsigned long long mj;
        from = t > POWER_WINDOW_MS ? t - POWER_WINDOW_MS : 0;
        e0 = energy_uj(g, tl, from);
        r->power_mw = t > from ? (unsigned)((e - e0) / (t - from)) : s->power_mw;
        mj = e > 0 ? (unsigned long long)e / 1000ULL : 0;
        if (mj < tl->last_energy_mj) mj = tl->last_energy_mj;
        tl->last_energy_mj = mj;
        r->energy_mj = mj;
    }
    if (r->power_mw > g->power_limit_mw) r->power_mw = g->power_limit_mw;
    r->instant_mw = s->power_mw;
    /* temperatures: the lags from the stretch's start */
    x = heat(g, s->power_mw);
    temp = g->temperature + lag(s->temp_fast, TEMP_FAST_C * x, (double)(t - s->at), TEMP_FAST_MS) +
           lag(s->temp_slow, TEMP_SLOW_C * x, (double)(t - s->at), TEMP_SLOW_MS);
    r->temp_c = temp > 0 ? (unsigned)lround(temp) : 0;
    temp = g->mem_temperature + lag(s->mtemp_fast, mtemp_fast_target(g, s), (double)(t - s->at), MTEMP_FAST_MS) +
           lag(s->mtemp_slow, mtemp_slow_target(g, s), (double)(t - s->at), MTEMP_SLOW_MS);
    r->mem_temp_c = temp > 0 ? (unsigned)lround(temp) : 0;
    /* the memory's power: idle + its share of the way to busy by the memory utilization, averaged over the
     * last second like the GPU's */
    {
        long long m = mem_util_ms(tl, t) - mem_util_ms(tl, from);
        unsigned long long span = g->mem_power_busy_mw - g->mem_power_idle_mw;
        unsigned avg = t > from ? (unsigned)(m / (t - from)) : s->mem_util;
        r->mem_power_mw = g->mem_power_idle_mw + (unsigned)(span * avg / 100);
    }
    /* counters since boot */
    {
        long long idle, capped, tx, rx;
        counters_at(s, t, &idle, &capped, &tx, &rx);
        r->idle_ms = (unsigned long long)idle;
        r->capped_ms = (unsigned long long)capped;
        r->pcie_tx_bytes = (unsigned long long)tx;
        r->pcie_rx_bytes = (unsigned long long)rx;
    }
    r->now_ms = t;
    /* clocks and their reasons */
    if (s->state == SIM_GPU_IDLE) {
        r->sm_mhz = g->clocks[NVML_CLOCK_SM];
        r->video_mhz = g->clocks[NVML_CLOCK_VIDEO];
        r->reasons = g->clock_event_reasons;
    } else {
        unsigned long long demand = demand_mw(g, s->util_compute, s->util_membound);
        r->sm_mhz = max_sm;
        r->reasons = 0;
        if (s->state == SIM_GPU_BUSY && demand > g->load_cap_mw) {
            r->sm_mhz = clock_step(g, (unsigned)((unsigned long long)max_sm * (g->load_cap_mw - g->load_idle_mw) /
                                                 (demand - g->load_idle_mw)));
            r->reasons = REASON_SW_POWER_CAP;
        }
        r->video_mhz = max_sm ? (unsigned)((unsigned long long)g->max_clocks[NVML_CLOCK_VIDEO] * r->sm_mhz / max_sm)
                              : g->clocks[NVML_CLOCK_VIDEO];
    }
    r->pcie_tx = s->pcie_tx;
    r->pcie_rx = s->pcie_rx;
}

static int runs_in(const sim_load *l, const struct nvmlDevice_st *device)
{
    if (l->gpu != device->index) return 0;
    if (!device->is_mig) return 1;
    return device->ci && l->gi == device->ci->gi->id && l->ci == device->ci->id;
}

unsigned sim_running(const struct nvmlDevice_st *device, const sim_load **out, unsigned cap)
{
    unsigned i, n = 0;
    long long t;
    sim_load_refresh(0);
    t = sim_now_ms();
    for (i = 0; i < g_sim.nloads; i++) {
        const sim_load *l = &g_sim.loads[i];
        if (!runs_in(l, device) || l->start > t || (l->end >= 0 && t >= l->end)) continue;
        if (n < cap) out[n] = l;
        n++;
    }
    return n;
}

/* The memory the running workloads of a GPU or MIG device use, each with `extra_kib` on top. */
static unsigned long long running_memory(const struct nvmlDevice_st *device, unsigned long long extra_kib)
{
    unsigned i;
    unsigned long long used = 0;
    long long t;
    sim_load_refresh(0);
    t = sim_now_ms();
    for (i = 0; i < g_sim.nloads; i++) {
        const sim_load *l = &g_sim.loads[i];
        if (runs_in(l, device) && l->start <= t && (l->end < 0 || t < l->end))
            used += (l->memory_mib << 20) + (extra_kib << 10);
    }
    return used;
}

unsigned long long sim_load_memory(const struct nvmlDevice_st *device)
{
    return running_memory(device, CONTEXT_KIB);
}

unsigned long long sim_load_bar1(const struct nvmlDevice_st *device)
{
    return running_memory(device, CONTEXT_KIB + BAR1_PROCESS_KIB);
}

/* ------------------------------------------------------------------------------------ process names */

nvmlReturn_t DECLDIR nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    unsigned i;
    const sim_load *found = NULL;
    long long t;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!name || length == 0) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    sim_load_refresh(0);
    t = sim_now_ms();
    /* the running workload of that pid, else its latest record: the simulated process table */
    for (i = 0; i < g_sim.nloads; i++) {
        const sim_load *l = &g_sim.loads[i];
        int running = l->end < 0 || t < l->end, found_running;
        if (l->pid != pid || l->start > t) continue;
        found_running = found && (found->end < 0 || t < found->end);
        if (!found || (running && !found_running) || (running == found_running && l->start > found->start))
            found = l;
    }
    if (!found) return sim_leave(NVML_ERROR_NOT_FOUND);
    /* nvml.h: a name longer than the buffer is truncated, not refused */
    snprintf(name, length, "%s", found->name);
    return sim_leave(NVML_SUCCESS);
}
