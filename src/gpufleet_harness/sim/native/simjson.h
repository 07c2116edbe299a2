/* A small JSON reader for machine.json: whole document into a tree, no streaming, no writer.
 * machine.json is written by gpufleet_harness.sim.machine, so the parser favours clear errors over speed. */
#ifndef GPUFLEET_SIMJSON_H
#define GPUFLEET_SIMJSON_H

#include <stddef.h>

typedef enum { SJ_NULL, SJ_BOOL, SJ_NUM, SJ_STR, SJ_ARR, SJ_OBJ } sj_type;

typedef struct sj_value {
    sj_type type;
    int boolean;
    long long integer;        /* numbers: the integer part (exact for integers up to 2^63) */
    double number;
    char *str;                /* SJ_STR */
    size_t len;               /* SJ_ARR / SJ_OBJ: element count */
    struct sj_value *items;   /* SJ_ARR elements, SJ_OBJ values */
    char **keys;              /* SJ_OBJ keys, parallel to items */
} sj_value;

/* Parse text[0..n); 0 on success, -1 with a message in err on failure. */
int sj_parse(const char *text, size_t n, sj_value *out, char *err, size_t errlen);
void sj_free(sj_value *v);

const sj_value *sj_get(const sj_value *obj, const char *key);   /* NULL if absent or not an object */
const sj_value *sj_at(const sj_value *arr, size_t i);           /* NULL if out of range */
long long sj_int(const sj_value *v, long long dflt);             /* dflt unless a number (or bool) */
const char *sj_str(const sj_value *v, const char *dflt);         /* dflt unless a string */
int sj_is_null(const sj_value *v);                               /* absent or JSON null */

#endif
