/* NVML event sets over the sim root's append-only `events` file.
 *
 * A set remembers the file offset at its creation, so it delivers only events appended later. Waiting
 * reads new complete lines from that offset; when none matches it blocks in poll() on an inotify watch
 * of the sim root, never holding the global lock, so other threads keep calling NVML meanwhile. */
#include "sim.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SET_MAGIC 0x47465354u /* "GFST": tells our sets from stray pointers */

struct nvmlEventSet_st {
    unsigned magic;
    pthread_mutex_t lock;          /* guards offset (two threads may wait on one set) */
    long long offset;              /* next unread byte of the events file */
    int inotify_fd;
    char events_path[PATH_MAX + 16];
    unsigned long long mask[SIM_MAX_GPUS];
};

static long long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : 0;
}

nvmlReturn_t DECLDIR nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct nvmlEventSet_st *s;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!set) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    s = calloc(1, sizeof *s);
    if (!s) return sim_leave(NVML_ERROR_MEMORY);
    s->magic = SET_MAGIC;
    pthread_mutex_init(&s->lock, NULL);
    sim_path(s->events_path, sizeof s->events_path, "events");
    s->offset = file_size(s->events_path);
    /* Watch the directory, not the file: it sees appends and a file created or replaced later. */
    s->inotify_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (s->inotify_fd >= 0)
        inotify_add_watch(s->inotify_fd, g_sim.root, IN_MODIFY | IN_CLOSE_WRITE | IN_CREATE | IN_MOVED_TO);
    *set = s;
    return sim_leave(NVML_SUCCESS);
}

static int valid_set(nvmlEventSet_t set)
{
    return set && set->magic == SET_MAGIC;
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    nvmlReturn_t r = sim_enter_dev(device);
    if (r != NVML_SUCCESS) return r;
    if (!eventTypes) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = device->supported_events;
    return sim_leave(NVML_SUCCESS);
}

nvmlReturn_t DECLDIR nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    nvmlReturn_t r = sim_enter_dev(device);
    if (r != NVML_SUCCESS) return r;
    if (!valid_set(set)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    /* As NVML: asking for any type the device cannot deliver refuses the whole registration. */
    if (eventTypes & ~device->supported_events) return sim_leave(NVML_ERROR_NOT_SUPPORTED);
    pthread_mutex_lock(&set->lock);
    set->mask[device->index] |= eventTypes;
    pthread_mutex_unlock(&set->lock);
    return sim_leave(NVML_SUCCESS);
}

/* Parse one event line; 0 if it is not an event we know. `xid GPU CODE GI CI` is an XID inside a MIG
 * device: NVML reports it on the parent GPU with the instance ids set. */
static int parse_event(const char *line, unsigned *gpu, unsigned long long *type, unsigned long long *data,
                       unsigned *gi, unsigned *ci)
{
    char kind[16];
    unsigned long long value;
    *gi = *ci = 0xFFFFFFFFu; /* not attributable to a MIG instance */
    if (sscanf(line, "%15s %u %llu %u %u", kind, gpu, &value, gi, ci) < 3) return 0;
    if (strcmp(kind, "xid") == 0) {
        *type = nvmlEventTypeXidCriticalError;
        *data = value;
        return 1;
    }
    *gi = *ci = 0xFFFFFFFFu;
    if (strcmp(kind, "ecc-dbe") == 0) {
        *type = nvmlEventTypeDoubleBitEccError;
        *data = 0; /* NVML: eventData is 0 for everything but XIDs */
        return 1;
    }
    return 0;
}

/* Consume complete lines after the set's offset until one matches; 1 and `out` filled if found. */
static int take_event(struct nvmlEventSet_st *s, nvmlEventData_t *out, unsigned ngpus)
{
    FILE *f;
    char line[256];
    int found = 0;
    pthread_mutex_lock(&s->lock);
    if (file_size(s->events_path) < s->offset) s->offset = 0; /* truncated: a fresh log */
    f = fopen(s->events_path, "r");
    if (f && fseeko(f, (off_t)s->offset, SEEK_SET) == 0) {
        while (!found && fgets(line, sizeof line, f)) {
            size_t n = strlen(line);
            unsigned gpu, gi, ci;
            unsigned long long type, data;
            if (n == 0 || line[n - 1] != '\n') break; /* a line still being written: read it next time */
            s->offset += (long long)n;
            if (!parse_event(line, &gpu, &type, &data, &gi, &ci) || gpu >= ngpus || !(s->mask[gpu] & type))
                continue;
            out->device = &g_sim.gpus[gpu];
            out->eventType = type;
            out->eventData = data;
            out->gpuInstanceId = gi;
            out->computeInstanceId = ci;
            found = 1;
        }
    }
    if (f) fclose(f);
    pthread_mutex_unlock(&s->lock);
    return found;
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

nvmlReturn_t DECLDIR nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    long long deadline = now_ms() + timeoutms;
    unsigned ngpus;
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    ngpus = g_sim.ngpus;
    if (!valid_set(set) || !data) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    sim_leave(NVML_SUCCESS); /* blocking below runs without the global lock */

    for (;;) {
        long long left;
        struct pollfd pfd;
        if (take_event(set, data, ngpus)) return NVML_SUCCESS;
        left = deadline - now_ms();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        /* inotify wakes us on every change in the root; the 500 ms cap re-checks even if a
         * notification was missed (e.g. the root is on a filesystem without inotify support). */
        pfd.fd = set->inotify_fd;
        pfd.events = POLLIN;
        pfd.revents = 0;
        if (set->inotify_fd >= 0) {
            if (poll(&pfd, 1, (int)(left < 500 ? left : 500)) > 0) {
                char buf[4096];
                while (read(set->inotify_fd, buf, sizeof buf) > 0) {
                }
            }
        } else {
            struct timespec ts = {0, (left < 100 ? left : 100) * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
}

nvmlReturn_t DECLDIR nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t DECLDIR nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t r = sim_enter();
    if (r != NVML_SUCCESS) return r;
    if (!valid_set(set)) return sim_leave(NVML_ERROR_INVALID_ARGUMENT);
    set->magic = 0;
    if (set->inotify_fd >= 0) close(set->inotify_fd);
    pthread_mutex_destroy(&set->lock);
    free(set);
    return sim_leave(NVML_SUCCESS);
}

unsigned long long sim_events_dbe_total(unsigned int gpu)
{
    char path[PATH_MAX + 16], line[256];
    unsigned long long total = 0;
    FILE *f;
    sim_path(path, sizeof path, "events");
    f = fopen(path, "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        char kind[16];
        unsigned g;
        unsigned long long n;
        if (sscanf(line, "%15s %u %llu", kind, &g, &n) == 3 && g == gpu && strcmp(kind, "ecc-dbe") == 0) total += n;
    }
    fclose(f);
    return total;
}
