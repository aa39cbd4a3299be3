/* Reader of the .tdat tensor file (docs/AOT.md); the same checks, in the same order, as tritune/aot/tdat.py. */
#include "tdat.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tdat payloads are little-endian and are copied as they are: this host is big-endian"
#endif

#define TDAT_MAGIC "TRITUNE-TENSOR 1\n"
#define TDAT_MAX_HEADER_BYTES (1L << 20) /* a longer header means a wrong file; tdat.py stops here too */

static const char *const DTYPE_NAMES[TDAT_NUM_DTYPES] = {"bf16", "fp16", "fp32", "int32", "int64", "uint8"};
static const size_t ITEMSIZES[TDAT_NUM_DTYPES] = {2, 2, 4, 4, 8, 1};

size_t tdat_itemsize(tdat_dtype dtype) {
    return (unsigned)dtype < TDAT_NUM_DTYPES ? ITEMSIZES[dtype] : 0;
}

const char *tdat_dtype_name(tdat_dtype dtype) {
    return (unsigned)dtype < TDAT_NUM_DTYPES ? DTYPE_NAMES[dtype] : "?";
}

int tdat_is_float(tdat_dtype dtype) {
    return dtype == TDAT_BF16 || dtype == TDAT_FP16 || dtype == TDAT_FP32;
}

void tdat_free(tdat_tensor *t) {
    if (t == NULL) return;
    free(t->name);
    free(t->data);
    memset(t, 0, sizeof *t);
}

/* State of one read, so every error path frees the same things. */
typedef struct {
    const char *path;
    char *err;
    size_t errlen;
    char *line;       /* current header line, NUL-terminated without its '\n' */
    size_t line_cap;
    char **keys;      /* keys seen so far, to refuse a repeated one */
    int *key_lines;
    int num_keys;
} reader;

static int fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(reader *r, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(r->err, r->errlen, "%s: %s", r->path, what);
    return -1;
}

/* Reads one '\n'-terminated line into r->line. Returns 1, 0 at a line cut short by the end of the file, or -1
 * when the header grows past TDAT_MAX_HEADER_BYTES. */
static int read_line(reader *r, FILE *f, long *offset) {
    size_t n = 0;
    for (;;) {
        int c = getc(f);
        if (c == EOF) return 0;
        if (++*offset > TDAT_MAX_HEADER_BYTES) return -1;
        if (n + 1 >= r->line_cap) {
            size_t cap = r->line_cap ? 2 * r->line_cap : 256;
            char *grown = realloc(r->line, cap);
            if (grown == NULL) return -1;
            r->line = grown;
            r->line_cap = cap;
        }
        if (c == '\n') break;
        r->line[n++] = (char)c;
    }
    r->line[n] = '\0';
    return 1;
}

static int parse_shape(reader *r, int lineno, const char *text, tdat_tensor *out) {
    int64_t numel = 1;
    int ndim = 0;
    const char *p = text;
    for (;;) {
        while (*p && isspace((unsigned char)*p)) p++;
        if (!*p) break;
        int64_t dim = 0;
        while (*p && !isspace((unsigned char)*p)) {
            if (*p < '0' || *p > '9')
                return fail(r, "line %d: bad shape '%.60s' (want space-separated non-negative integers)", lineno, text);
            if (dim > (INT64_MAX - 9) / 10) return fail(r, "line %d: shape '%.60s' is too large", lineno, text);
            dim = dim * 10 + (*p - '0');
            p++;
        }
        if (dim != 0 && numel > INT64_MAX / dim) return fail(r, "line %d: shape '%.60s' is too large", lineno, text);
        numel *= dim;
        ndim++;
    }
    size_t itemsize = tdat_itemsize(out->dtype);
    if (numel > INT64_MAX / (int64_t)itemsize) return fail(r, "line %d: shape '%.60s' is too large", lineno, text);
    out->ndim = ndim;
    out->numel = numel;
    out->nbytes = (size_t)numel * itemsize;
    return 0;
}

static int remember_key(reader *r, const char *key, int lineno) {
    for (int i = 0; i < r->num_keys; i++)
        if (strcmp(r->keys[i], key) == 0)
            return fail(r, "line %d: key '%.100s' repeated (first on line %d)", lineno, key, r->key_lines[i]);
    char **keys = realloc(r->keys, (size_t)(r->num_keys + 1) * sizeof *keys);
    if (keys == NULL) return fail(r, "out of memory");
    r->keys = keys;
    int *lines = realloc(r->key_lines, (size_t)(r->num_keys + 1) * sizeof *lines);
    if (lines == NULL) return fail(r, "out of memory");
    r->key_lines = lines;
    if ((r->keys[r->num_keys] = strdup(key)) == NULL) return fail(r, "out of memory");
    r->key_lines[r->num_keys++] = lineno;
    return 0;
}

static int read_file(reader *r, FILE *f, tdat_tensor *out) {
    char magic[sizeof TDAT_MAGIC] = {0};
    size_t got = fread(magic, 1, sizeof TDAT_MAGIC - 1, f);
    if (got != sizeof TDAT_MAGIC - 1 || memcmp(magic, TDAT_MAGIC, sizeof TDAT_MAGIC - 1) != 0) {
        for (size_t i = 0; i < got; i++)
            if (magic[i] == '\n' || (unsigned char)magic[i] < 0x20 || (unsigned char)magic[i] > 0x7e) magic[i] = '\0';
        if (strncmp(magic, "TRITUNE-TENSOR ", 15) == 0)
            return fail(r, "unsupported version line '%s' (want 'TRITUNE-TENSOR 1')", magic);
        return fail(r, "bad magic '%s' (not a tdat file; want 'TRITUNE-TENSOR 1')", magic);
    }
    long offset = (long)(sizeof TDAT_MAGIC - 1);
    char *shape = NULL;
    int shape_line = 0, dtype_line = 0, have_dtype = 0;
    int rc = -1;
    for (int lineno = 2;; lineno++) {
        int status = read_line(r, f, &offset);
        if (status < 0) {
            fail(r, "header longer than %ld bytes (no 'end' line?)", TDAT_MAX_HEADER_BYTES);
            goto done;
        }
        if (status == 0) {
            fail(r, "line %d: header ends before its 'end' line", lineno);
            goto done;
        }
        char *line = r->line;
        if (strcmp(line, "end") == 0) break;
        char *colon = strchr(line, ':');
        size_t keylen = colon ? (size_t)(colon - line) : 0;
        int key_ok = keylen > 0;
        for (size_t i = 0; i < keylen; i++)
            if (!((line[i] >= 'a' && line[i] <= 'z') || (line[i] >= '0' && line[i] <= '9') || line[i] == '_')) key_ok = 0;
        if (!key_ok) {
            fail(r, "line %d: want 'key: value' with key [a-z0-9_]+, got '%.60s'", lineno, line);
            goto done;
        }
        *colon = '\0';
        const char *value = colon[1] == ' ' ? colon + 2 : colon + 1;
        if (remember_key(r, line, lineno) != 0) goto done;
        if (strcmp(line, "name") == 0) {
            if ((out->name = strdup(value)) == NULL) {
                fail(r, "out of memory");
                goto done;
            }
        } else if (strcmp(line, "dtype") == 0) {
            have_dtype = 0;
            for (int d = 0; d < TDAT_NUM_DTYPES; d++) {
                if (strcmp(value, DTYPE_NAMES[d]) == 0) {
                    out->dtype = (tdat_dtype)d;
                    have_dtype = 1;
                }
            }
            if (!have_dtype) {
                fail(r, "line %d: unknown dtype '%.40s' (want one of bf16 fp16 fp32 int32 int64 uint8)", lineno, value);
                goto done;
            }
            dtype_line = lineno;
        } else if (strcmp(line, "shape") == 0) {
            if ((shape = strdup(value)) == NULL) {
                fail(r, "out of memory");
                goto done;
            }
            shape_line = lineno;
        }
    }
    if (out->name == NULL || !dtype_line || !shape_line) {
        char missing[64] = "";
        if (out->name == NULL) strcat(missing, "name, ");
        if (!dtype_line) strcat(missing, "dtype, ");
        if (!shape_line) strcat(missing, "shape, ");
        missing[strlen(missing) - 2] = '\0';
        fail(r, "header lacks required key(s) %s", missing);
        goto done;
    }
    if (parse_shape(r, shape_line, shape, out) != 0) goto done;

    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        fail(r, "cannot stat: %s", strerror(errno));
        goto done;
    }
    long long payload = (long long)st.st_size - offset;
    if (payload != (long long)out->nbytes) {
        fail(r, "payload too %s: %lld bytes, expected %zu (shape [%.60s] x %s %zu bytes)",
             payload < (long long)out->nbytes ? "short" : "long", payload, out->nbytes, shape,
             tdat_dtype_name(out->dtype), tdat_itemsize(out->dtype));
        goto done;
    }
    out->data = malloc(out->nbytes ? out->nbytes : 1);
    if (out->data == NULL) {
        fail(r, "out of memory for the payload");
        goto done;
    }
    if (out->nbytes && fread(out->data, 1, out->nbytes, f) != out->nbytes) {
        fail(r, "payload cut short while reading");
        goto done;
    }
    rc = 0;
done:
    free(shape);
    return rc;
}

int tdat_read(const char *path, tdat_tensor *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    reader r = {.path = path, .err = err, .errlen = errlen};
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        if (errno == ENOENT) return fail(&r, "no such file");
        return fail(&r, "cannot open: %s", strerror(errno));
    }
    int rc = read_file(&r, f, out);
    fclose(f);
    for (int i = 0; i < r.num_keys; i++) free(r.keys[i]);
    free(r.keys);
    free(r.key_lines);
    free(r.line);
    if (rc != 0) tdat_free(out);
    return rc;
}

static double half_to_double(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double value;
    if (exp == 0)
        value = ldexp((double)mant, -24); /* zero or subnormal */
    else if (exp == 31)
        value = mant ? NAN : INFINITY;
    else
        value = ldexp((double)(mant + 1024), exp - 25);
    return sign ? -value : value;
}

double tdat_get_double(const tdat_tensor *t, int64_t i) {
    const unsigned char *p = (const unsigned char *)t->data + (size_t)i * tdat_itemsize(t->dtype);
    switch (t->dtype) {
    case TDAT_BF16: {
        uint16_t bits16;
        memcpy(&bits16, p, 2);
        uint32_t bits = (uint32_t)bits16 << 16; /* bf16 is the top half of an fp32 */
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    case TDAT_FP16: {
        uint16_t bits16;
        memcpy(&bits16, p, 2);
        return half_to_double(bits16);
    }
    case TDAT_FP32: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    default:
        return (double)tdat_get_int(t, i);
    }
}

int64_t tdat_get_int(const tdat_tensor *t, int64_t i) {
    const unsigned char *p = (const unsigned char *)t->data + (size_t)i * tdat_itemsize(t->dtype);
    switch (t->dtype) {
    case TDAT_INT32: {
        int32_t v;
        memcpy(&v, p, 4);
        return v;
    }
    case TDAT_INT64: {
        int64_t v;
        memcpy(&v, p, 8);
        return v;
    }
    case TDAT_UINT8:
        return p[0];
    default:
        return 0;
    }
}
