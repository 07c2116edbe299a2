/* Recursive-descent JSON parser; see simjson.h. */
#include "simjson.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SJ_MAX_DEPTH 64

typedef struct {
    const char *start, *p, *end;
    char *err;
    size_t errlen;
    int depth;
} sj_parser;

static int fail(sj_parser *ps, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (ps->err && ps->errlen) {
        size_t n;
        snprintf(ps->err, ps->errlen, "at byte %ld: ", (long)(ps->p - ps->start));
        n = strlen(ps->err);
        vsnprintf(ps->err + n, ps->errlen - n, fmt, ap);
    }
    va_end(ap);
    return -1;
}

static void skip_ws(sj_parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static int parse_value(sj_parser *ps, sj_value *out);

/* Append one UTF-8 encoded code point. */
static size_t put_utf8(char *dst, unsigned cp)
{
    if (cp < 0x80) { dst[0] = (char)cp; return 1; }
    if (cp < 0x800) { dst[0] = (char)(0xC0 | (cp >> 6)); dst[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12)); dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18)); dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); dst[3] = (char)(0x80 | (cp & 0x3F)); return 4;
}

static int hex4(sj_parser *ps, unsigned *cp)
{
    unsigned v = 0;
    int i;
    if (ps->end - ps->p < 4) return fail(ps, "short \\u escape");
    for (i = 0; i < 4; i++) {
        char c = *ps->p++;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return fail(ps, "bad hex digit in \\u escape");
    }
    *cp = v;
    return 0;
}

static int parse_string(sj_parser *ps, char **out)
{
    /* Escapes only shrink text (\uXXXX → at most 4 bytes for 6, pairs 4 for 12), so the raw length bounds
     * the decoded one. */
    const char *start = ++ps->p;
    const char *q = start;
    char *buf, *w;
    while (q < ps->end && *q != '"') {
        if (*q == '\\') q++;
        q++;
    }
    if (q >= ps->end) return fail(ps, "unterminated string");
    buf = malloc((size_t)(q - start) + 1);
    if (!buf) return fail(ps, "out of memory");
    w = buf;
    while (*ps->p != '"') {
        char c = *ps->p++;
        if ((unsigned char)c < 0x20) { free(buf); return fail(ps, "control character in string"); }
        if (c != '\\') { *w++ = c; continue; }
        c = *ps->p++;
        switch (c) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (hex4(ps, &cp)) { free(buf); return -1; }
            if (cp >= 0xD800 && cp < 0xDC00 && ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u') {
                ps->p += 2;
                if (hex4(ps, &lo)) { free(buf); return -1; }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            w += put_utf8(w, cp);
            break;
        }
        default:
            free(buf);
            return fail(ps, "bad escape \\%c", c);
        }
    }
    ps->p++;
    *w = '\0';
    *out = buf;
    return 0;
}

static int parse_number(sj_parser *ps, sj_value *out)
{
    char tmp[64];
    const char *s = ps->p;
    size_t n;
    char *endp;
    while (ps->p < ps->end && strchr("+-0123456789.eE", *ps->p)) ps->p++;
    n = (size_t)(ps->p - s);
    if (n == 0 || n >= sizeof tmp) return fail(ps, "bad number");
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    out->type = SJ_NUM;
    out->number = strtod(tmp, &endp);
    if (*endp) return fail(ps, "bad number '%s'", tmp);
    /* Byte sizes exceed 2^53 in principle: keep an exact integer when the text is one. */
    out->integer = strchr(tmp, '.') || strchr(tmp, 'e') || strchr(tmp, 'E') ? (long long)out->number
                                                                               : strtoll(tmp, NULL, 10);
    return 0;
}

static int parse_literal(sj_parser *ps, const char *word, sj_value *out, sj_type t, int b)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return fail(ps, "unexpected token");
    ps->p += n;
    out->type = t;
    out->boolean = b;
    out->integer = b;
    return 0;
}

/* Grow a container by one slot; returns the new slot. */
static sj_value *push(sj_parser *ps, sj_value *c, size_t *cap, int with_key)
{
    if (c->len == *cap) {
        size_t ncap = *cap ? *cap * 2 : 8;
        sj_value *items = realloc(c->items, ncap * sizeof *items);
        if (!items) { fail(ps, "out of memory"); return NULL; }
        c->items = items;
        if (with_key) {
            char **keys = realloc(c->keys, ncap * sizeof *keys);
            if (!keys) { fail(ps, "out of memory"); return NULL; }
            c->keys = keys;
        }
        *cap = ncap;
    }
    memset(&c->items[c->len], 0, sizeof c->items[0]);
    if (with_key) c->keys[c->len] = NULL;
    return &c->items[c->len++];
}

static int parse_array(sj_parser *ps, sj_value *out)
{
    size_t cap = 0;
    out->type = SJ_ARR;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') { ps->p++; return 0; }
    for (;;) {
        sj_value *slot = push(ps, out, &cap, 0);
        if (!slot || parse_value(ps, slot)) return -1;
        skip_ws(ps);
        if (ps->p >= ps->end) return fail(ps, "unterminated array");
        if (*ps->p == ',') { ps->p++; continue; }
        if (*ps->p == ']') { ps->p++; return 0; }
        return fail(ps, "expected ',' or ']'");
    }
}

static int parse_object(sj_parser *ps, sj_value *out)
{
    size_t cap = 0;
    out->type = SJ_OBJ;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') { ps->p++; return 0; }
    for (;;) {
        char *key;
        sj_value *slot;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"') return fail(ps, "expected a key");
        if (parse_string(ps, &key)) return -1;
        slot = push(ps, out, &cap, 1);
        if (!slot) { free(key); return -1; }
        out->keys[out->len - 1] = key;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != ':') return fail(ps, "expected ':'");
        ps->p++;
        if (parse_value(ps, slot)) return -1;
        skip_ws(ps);
        if (ps->p >= ps->end) return fail(ps, "unterminated object");
        if (*ps->p == ',') { ps->p++; continue; }
        if (*ps->p == '}') { ps->p++; return 0; }
        return fail(ps, "expected ',' or '}'");
    }
}

static int parse_value(sj_parser *ps, sj_value *out)
{
    int rc;
    skip_ws(ps);
    if (ps->p >= ps->end) return fail(ps, "unexpected end of input");
    if (++ps->depth > SJ_MAX_DEPTH) return fail(ps, "nested too deeply");
    switch (*ps->p) {
    case '{': rc = parse_object(ps, out); break;
    case '[': rc = parse_array(ps, out); break;
    case '"': out->type = SJ_STR; rc = parse_string(ps, &out->str); break;
    case 't': rc = parse_literal(ps, "true", out, SJ_BOOL, 1); break;
    case 'f': rc = parse_literal(ps, "false", out, SJ_BOOL, 0); break;
    case 'n': rc = parse_literal(ps, "null", out, SJ_NULL, 0); break;
    default: rc = parse_number(ps, out); break;
    }
    ps->depth--;
    return rc;
}

int sj_parse(const char *text, size_t n, sj_value *out, char *err, size_t errlen)
{
    sj_parser ps = {text, text, text + n, err, errlen, 0};
    memset(out, 0, sizeof *out);
    if (parse_value(&ps, out)) { sj_free(out); return -1; }
    skip_ws(&ps);
    if (ps.p != ps.end) { fail(&ps, "trailing data"); sj_free(out); return -1; }
    return 0;
}

void sj_free(sj_value *v)
{
    size_t i;
    if (!v) return;
    for (i = 0; i < v->len; i++) {
        sj_free(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    memset(v, 0, sizeof *v);
}

const sj_value *sj_get(const sj_value *obj, const char *key)
{
    size_t i;
    if (!obj || obj->type != SJ_OBJ) return NULL;
    for (i = 0; i < obj->len; i++)
        if (obj->keys[i] && strcmp(obj->keys[i], key) == 0) return &obj->items[i];
    return NULL;
}

const sj_value *sj_at(const sj_value *arr, size_t i)
{
    if (!arr || arr->type != SJ_ARR || i >= arr->len) return NULL;
    return &arr->items[i];
}

long long sj_int(const sj_value *v, long long dflt)
{
    return v && (v->type == SJ_NUM || v->type == SJ_BOOL) ? v->integer : dflt;
}

const char *sj_str(const sj_value *v, const char *dflt)
{
    return v && v->type == SJ_STR ? v->str : dflt;
}

int sj_is_null(const sj_value *v)
{
    return !v || v->type == SJ_NULL;
}
