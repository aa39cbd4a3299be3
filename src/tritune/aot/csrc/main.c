/* The generic main of docs/AOT.md: linked with one artifact's glue and Triton launcher, it reads the kernel's
 * run spec, loads the data files, checks the artifact's output against the expected one, and times it.
 *
 *   bin/<id> --bundle DIR --spec FILE [--reps N=100] [--warmup W=10] [--flush-bytes B=209715200] [--dry-run]
 *
 * Exit codes: 0 valid; 1 wrong output; 2 usage or spec error (a spec that does not parse or evaluate);
 * 3 a data file missing or malformed; 4 a CUDA error; 5 the spec does not fit the artifact (kernel name,
 * arguments, specialization hints, grid). Everything before CUDA mirrors tritune/aot/spec.py's resolve and
 * check_specialization, so a bundle is checked at build time exactly as it will be run.
 *
 * Never calls exit(): the launcher's exit() may be routed to tritune_launcher_exit (see tritune_artifact.h),
 * and when the build force-includes the header here too, exit() would mean that hook. */
#define TRITUNE_NO_EXIT_HOOK
#include "tritune_artifact.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>

#include "expr.h"
#include "tdat.h"

unsigned int tritune_grid[3];

enum { EXIT_VALID = 0, EXIT_WRONG = 1, EXIT_USAGE = 2, EXIT_DATA = 3, EXIT_CUDA = 4, EXIT_FIT = 5 };

#define SPEC_HEADER "tritune-spec 1"
#define MAX_SPEC_BYTES (16L << 20)
#define CHUNK_REPS 32 /* timed reps queued behind one hold of the stream; far below the driver's queue depth */
#define ERR_LEN 1024

typedef enum { ROLE_IN, ROLE_OUT, ROLE_SCRATCH, ROLE_I32, ROLE_I64, ROLE_F32, NUM_ROLES } role_t;
static const char *const ROLE_NAMES[NUM_ROLES] = {"in", "out", "scratch", "i32", "i64", "f32"};

typedef enum { LINE_VALUE, LINE_ARG, LINE_GRID } line_kind;

typedef struct {
    line_kind kind;
    int lineno;
    char *name;    /* value or arg */
    role_t role;   /* arg */
    char *text;    /* value expr; arg FILE, EXPR or NUMBER */
    char *grid[3]; /* grid exprs */
    /* filled while resolving, in file order */
    int defined;
    int64_t ivalue; /* value, i32/i64, or scratch bytes */
    double fvalue;  /* f32 */
    char *path;     /* in/out */
    tdat_tensor tensor;
    CUdeviceptr dptr;
    size_t dbytes;
} spec_line;

typedef struct {
    const char *source;
    char *kernel;
    double tol[4]; /* atol, rtol, max_mismatch_ratio, max_rel_l2 */
    int have_tol;
    spec_line *lines;
    int num_lines;
    int grid_index;
} spec_t;

typedef struct {
    double max_abs_err, mismatch_ratio, rel_l2;
    int ok;
    char why[512];
} check_result;

typedef union {
    CUdeviceptr p;
    int32_t i;
    int64_t l;
    float f;
} arg_slot;

typedef struct {
    /* options */
    const char *bundle;
    const char *spec_arg;
    long reps, warmup;
    unsigned long long flush_bytes;
    int dry_run;
    /* spec and what it resolves to */
    spec_t spec;
    int current_line; /* line being checked, for "used before its definition" */
    unsigned int grid[3];
    int *arg_line; /* tritune_args[i] -> index in spec.lines */
    /* CUDA */
    CUdevice dev;
    int ctx_retained;
    CUstream stream;
    CUdeviceptr flush;
    void *flag_host;
    CUdeviceptr flag_dev;
    uint32_t held_value; /* nonzero while the stream waits on the flag for this value */
    CUevent events[2 * CHUNK_REPS];
    int num_events;
    arg_slot *slots;
    void **values;
    unsigned char **host_out; /* per spec line; out args only */
    /* result */
    check_result check;
    float *times_us;
    long reps_done;
    char error[ERR_LEN];
    int printed;
} run_t;

static run_t *g_run; /* for tritune_launcher_exit */

/* ---------------------------------------------------------------- messages and JSON */

static int complain(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* One line on stderr, kept as the run's error (the first wins) unless code is 0 (a note); returns code so
 * callers can `return complain(EXIT_..., ...)`. */
static int complain(int code, const char *fmt, ...) {
    char what[ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fprintf(stderr, "tritune: %s\n", what);
    if (code && g_run && g_run->error[0] == '\0') snprintf(g_run->error, sizeof g_run->error, "%s", what);
    return code;
}

static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", f);
        else if (*p == '\t')
            fputs("\\t", f);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

/* Shortest of %.15g/%.17g that reads back as the same double, always with a '.' or an exponent so readers see
 * a float (0.0, not 0); null for NaN/Inf, which JSON lacks. */
static void json_double(FILE *f, double x) {
    char buf[64];
    if (!isfinite(x)) {
        fputs("null", f);
        return;
    }
    snprintf(buf, sizeof buf, "%.15g", x);
    if (strtod(buf, NULL) != x) snprintf(buf, sizeof buf, "%.17g", x);
    if (strpbrk(buf, ".e") == NULL) strcat(buf, ".0");
    fputs(buf, f);
}

static double median(float *v, long n) {
    /* insertion sort: n is a few hundred at most */
    for (long i = 1; i < n; i++) {
        float x = v[i];
        long j = i;
        for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];
        v[j] = x;
    }
    return n % 2 ? v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + (double)v[n / 2]);
}

/* The result line of docs/AOT.md, printed once, as the last line of stdout. */
static void print_result(run_t *r) {
    if (r->printed || r->dry_run) return;
    r->printed = 1;
    double med = 0, lo = 0, hi = 0;
    if (r->reps_done > 0) {
        lo = hi = r->times_us[0];
        for (long i = 0; i < r->reps_done; i++) {
            lo = fmin(lo, r->times_us[i]);
            hi = fmax(hi, r->times_us[i]);
        }
        med = median(r->times_us, r->reps_done);
    }
    int valid = r->error[0] == '\0';
    FILE *f = stdout;
    fputs("TRITUNE_RESULT {\"artifact\": ", f);
    json_string(f, tritune_artifact_id);
    fprintf(f, ", \"valid\": %s, \"max_abs_err\": ", valid ? "true" : "false");
    json_double(f, r->check.max_abs_err);
    fputs(", \"mismatch_ratio\": ", f);
    json_double(f, r->check.mismatch_ratio);
    fputs(", \"rel_l2\": ", f);
    json_double(f, r->check.rel_l2);
    fputs(", \"median_us\": ", f);
    json_double(f, med);
    fputs(", \"min_us\": ", f);
    json_double(f, lo);
    fputs(", \"max_us\": ", f);
    json_double(f, hi);
    fprintf(f, ", \"reps\": %ld, \"grid\": [%u, %u, %u], \"error\": ", r->reps_done, r->grid[0], r->grid[1],
            r->grid[2]);
    json_string(f, r->error);
    fputs("}\n", f);
    fflush(f);
}

/* Records why the run is not valid (the first reason wins) and returns code. */
static int set_error(run_t *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int set_error(run_t *r, int code, const char *fmt, ...) {
    if (r->error[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->error, sizeof r->error, fmt, ap);
        va_end(ap);
    }
    return code;
}

static const char *cuda_text(CUresult rc) {
    const char *text = NULL;
    if (cuGetErrorString(rc, &text) != CUDA_SUCCESS || text == NULL) text = "unknown CUDA error";
    return text;
}

/* ---------------------------------------------------------------- the spec */

static int is_name(const char *s) {
    if (!(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z'))) return 0;
    for (s++; *s; s++)
        if (!(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9')))
            return 0;
    return 1;
}

/* [+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?, as spec.py's _NUMBER, within float32's range. */
static int parse_number(const char *s, double *out) {
    const char *p = s;
    int digits = 0;
    if (*p == '+' || *p == '-') p++;
    while (*p >= '0' && *p <= '9') p++, digits++;
    if (*p == '.') {
        p++;
        while (*p >= '0' && *p <= '9') p++, digits++;
    }
    if (!digits) return -1;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-') p++;
        if (!(*p >= '0' && *p <= '9')) return -1;
        while (*p >= '0' && *p <= '9') p++;
    }
    if (*p) return -1;
    *out = strtod(s, NULL);
    return fabs(*out) > (double)FLT_MAX ? -2 : 0;
}

static int spec_error(const spec_t *s, int lineno, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int spec_error(const spec_t *s, int lineno, const char *fmt, ...) {
    char what[ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (lineno > 0) return complain(EXIT_USAGE, "%s:%d: %s", s->source, lineno, what);
    return complain(EXIT_USAGE, "%s: %s", s->source, what);
}

static spec_line *find_line(const spec_t *s, const char *name) {
    for (int i = 0; i < s->num_lines; i++)
        if (s->lines[i].kind != LINE_GRID && strcmp(s->lines[i].name, name) == 0) return &s->lines[i];
    return NULL;
}

static int check_number(const spec_t *s, int lineno, const char *what, const char *text, double *out) {
    int rc = parse_number(text, out);
    if (rc == -1) return spec_error(s, lineno, "%s '%s' is not a decimal number", what, text);
    if (rc == -2) return spec_error(s, lineno, "%s '%s' does not fit in a float32", what, text);
    return 0;
}

static int check_syntax(const spec_t *s, int lineno, const char *what, const char *text) {
    char err[ERR_LEN];
    if (expr_scan(text, NULL, NULL, err, sizeof err) != 0) return spec_error(s, lineno, "%s: %s", what, err);
    return 0;
}

/* One non-blank, non-comment line; fields already split on TAB. */
static int parse_line(spec_t *s, int lineno, char **fields, int nfields) {
    static const struct {
        const char *keyword;
        int fields; /* the keyword included */
    } KINDS[] = {{"kernel", 2}, {"value", 3}, {"arg", 4}, {"grid", 4}, {"tolerance", 5}};
    const char *kw = fields[0];
    int want = 0;
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (!strcmp(kw, KINDS[i].keyword)) want = KINDS[i].fields;
    if (!want) return spec_error(s, lineno, "unknown line kind '%s' (want kernel, value, arg, grid, tolerance)", kw);
    if (nfields != want)
        return spec_error(s, lineno, "'%s' takes %d TAB-separated fields, got %d", kw, want - 1, nfields - 1);
    for (int i = 0; i < nfields; i++)
        if (!fields[i][0]) return spec_error(s, lineno, "empty field (two TABs in a row, or a trailing TAB)");
    if ((!strcmp(kw, "kernel") && s->kernel) || (!strcmp(kw, "grid") && s->grid_index >= 0) ||
        (!strcmp(kw, "tolerance") && s->have_tol))
        return spec_error(s, lineno, "second '%s' line", kw);
    if (!strcmp(kw, "kernel")) {
        if (!is_name(fields[1])) return spec_error(s, lineno, "kernel name '%s' is not an identifier", fields[1]);
        s->kernel = strdup(fields[1]);
        return 0;
    }
    if (!strcmp(kw, "tolerance")) {
        for (int i = 0; i < 4; i++) {
            char what[32];
            snprintf(what, sizeof what, "tolerance field %d", i + 1);
            if (check_number(s, lineno, what, fields[i + 1], &s->tol[i])) return EXIT_USAGE;
            if (s->tol[i] < 0) return spec_error(s, lineno, "%s=%s must be >= 0", what, fields[i + 1]);
        }
        s->have_tol = 1;
        return 0;
    }
    spec_line line = {.lineno = lineno};
    if (!strcmp(kw, "grid")) {
        for (int i = 0; i < 3; i++) {
            char what[16];
            snprintf(what, sizeof what, "grid[%d]", i);
            if (check_syntax(s, lineno, what, fields[i + 1])) return EXIT_USAGE;
        }
        line.kind = LINE_GRID;
        for (int i = 0; i < 3; i++) line.grid[i] = strdup(fields[i + 1]);
        s->grid_index = s->num_lines;
    } else {
        line.kind = !strcmp(kw, "value") ? LINE_VALUE : LINE_ARG;
        const char *name = fields[1];
        if (!is_name(name)) return spec_error(s, lineno, "%s name '%s' is not an identifier", kw, name);
        const spec_line *prior = find_line(s, name);
        if (prior) return spec_error(s, lineno, "'%s' already defined on line %d", name, prior->lineno);
        if (line.kind == LINE_ARG) {
            int role = -1;
            for (int i = 0; i < NUM_ROLES; i++)
                if (!strcmp(fields[2], ROLE_NAMES[i])) role = i;
            if (role < 0)
                return spec_error(s, lineno, "unknown role '%s' (want one of in out scratch i32 i64 f32)", fields[2]);
            line.role = (role_t)role;
        }
        const char *text = fields[nfields - 1];
        char what[300];
        snprintf(what, sizeof what, "%s '%s'", kw, name);
        if (line.kind == LINE_VALUE || line.role == ROLE_SCRATCH || line.role == ROLE_I32 || line.role == ROLE_I64) {
            if (check_syntax(s, lineno, what, text)) return EXIT_USAGE;
        } else if (line.role == ROLE_F32) {
            if (check_number(s, lineno, what, text, &line.fvalue)) return EXIT_USAGE;
        }
        line.name = strdup(name);
        line.text = strdup(text);
    }
    spec_line *grown = realloc(s->lines, (size_t)(s->num_lines + 1) * sizeof *grown);
    if (grown == NULL) return complain(EXIT_USAGE, "out of memory");
    s->lines = grown;
    s->lines[s->num_lines++] = line;
    return 0;
}

static int is_int_role(role_t role) {
    return role == ROLE_I32 || role == ROLE_I64;
}

/* expr_scan callback at parse time: a name must be defined on an earlier line (or be an artifact parameter,
 * checked when evaluating); numel()/first() take an in/out argument from an earlier line. */
static int check_reference(void *ctx, expr_lookup_kind kind, const char *name, int64_t *value, char *err,
                           size_t errlen) {
    run_t *r = ctx;
    const spec_line *def = find_line(&r->spec, name);
    *value = 0;
    if (kind == EXPR_NAME) {
        if (def == NULL) return 0;
        if (def->kind == LINE_ARG && !is_int_role(def->role)) {
            snprintf(err, errlen, "'%s' is a %s argument, not an integer (use numel() or first())", name,
                     ROLE_NAMES[def->role]);
            return -1;
        }
    } else {
        if (def == NULL || def->kind != LINE_ARG) {
            snprintf(err, errlen, "'%s' is not an argument", name);
            return -1;
        }
        if (def->role != ROLE_IN && def->role != ROLE_OUT) {
            snprintf(err, errlen, "'%s' is a %s argument (want in or out)", name, ROLE_NAMES[def->role]);
            return -1;
        }
    }
    if (def->lineno >= r->current_line) {
        snprintf(err, errlen, "'%s' is used before its definition on line %d", name, def->lineno);
        return -1;
    }
    return 0;
}

static int check_references(run_t *r) {
    spec_t *s = &r->spec;
    char err[ERR_LEN];
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        r->current_line = l->lineno;
        for (int k = 0; k < 3; k++) {
            const char *text = l->kind == LINE_GRID ? l->grid[k]
                               : (k == 0 && (l->kind == LINE_VALUE || l->role == ROLE_SCRATCH || is_int_role(l->role)))
                                   ? l->text
                                   : NULL;
            if (text && expr_scan(text, check_reference, r, err, sizeof err) != 0)
                return spec_error(s, l->lineno, "%s", err);
        }
    }
    return 0;
}

static int parse_spec(run_t *r, char *text) {
    spec_t *s = &r->spec;
    s->grid_index = -1;
    int lineno = 0;
    for (char *line = text; line != NULL;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = '\0';
        lineno++;
        size_t len = strlen(line);
        while (len > 0 && line[len - 1] == '\r') line[--len] = '\0';
        if (lineno == 1) {
            if (strcmp(line, SPEC_HEADER) != 0)
                return spec_error(s, 1, "first line must be '%s', got '%.40s'", SPEC_HEADER, line);
        } else {
            int blank = 1;
            for (const char *p = line; *p; p++)
                if (!(*p == ' ' || (*p >= '\t' && *p <= '\r'))) blank = 0;
            if (!blank && line[0] != '#') {
                char *fields[8];
                int nfields = 0;
                for (char *f = line;;) {
                    char *tab = strchr(f, '\t');
                    if (nfields < 8) fields[nfields] = f;
                    nfields++;
                    if (!tab) break;
                    *tab = '\0';
                    f = tab + 1;
                }
                int rc = parse_line(s, lineno, fields, nfields); /* checks the count before using fields[5..] */
                if (rc) return rc;
            }
        }
        line = next;
    }
    if (!s->kernel) return spec_error(s, 0, "no 'kernel' line");
    if (s->grid_index < 0) return spec_error(s, 0, "no 'grid' line");
    if (!s->have_tol) return spec_error(s, 0, "no 'tolerance' line");
    return check_references(r);
}

static int read_spec(run_t *r) {
    const char *path = r->spec_arg;
    char joined[4096];
    FILE *f = fopen(path, "rb");
    if (f == NULL && errno == ENOENT && path[0] != '/') { /* specs/<kernel>.spec relative to the bundle */
        snprintf(joined, sizeof joined, "%s/%s", r->bundle, path);
        f = fopen(joined, "rb");
        if (f) path = joined;
    }
    if (f == NULL) return complain(EXIT_USAGE, "%s: cannot open the spec: %s", r->spec_arg, strerror(errno));
    char *text = malloc(MAX_SPEC_BYTES + 1);
    size_t n = text ? fread(text, 1, MAX_SPEC_BYTES + 1, f) : 0;
    fclose(f);
    if (text == NULL || n > MAX_SPEC_BYTES) {
        free(text);
        return complain(EXIT_USAGE, "%s: spec too large or out of memory", path);
    }
    text[n] = '\0';
    if (strlen(text) != n) {
        free(text);
        return complain(EXIT_USAGE, "%s: spec holds a NUL byte", path);
    }
    r->spec.source = r->spec_arg;
    int rc = parse_spec(r, text);
    free(text);
    return rc;
}

/* ---------------------------------------------------------------- resolving, as spec.resolve */

static const tritune_param *find_param(const char *name) {
    for (int i = 0; i < tritune_num_params; i++)
        if (strcmp(tritune_params[i].name, name) == 0) return &tritune_params[i];
    return NULL;
}

/* `{NAME}` placeholders replaced by the artifact's parameters, as spec.substitute. */
static int substitute(const char *tpl, char *out, size_t outlen, char *err, size_t errlen) {
    size_t n = 0;
    for (size_t i = 0; tpl[i];) {
        char piece[64];
        const char *add = piece;
        if (tpl[i] == '{') {
            const char *end = strchr(tpl + i, '}');
            if (!end) {
                snprintf(err, errlen, "\"%s\": unclosed { at column %zu", tpl, i + 1);
                return -1;
            }
            char name[256];
            size_t len = (size_t)(end - (tpl + i)) - 1;
            snprintf(name, sizeof name, "%.*s", (int)(len < 255 ? len : 255), tpl + i + 1);
            if (len > 255 || !is_name(name)) {
                snprintf(err, errlen, "\"%s\": placeholder {%s} is not a name", tpl, name);
                return -1;
            }
            const tritune_param *p = find_param(name);
            if (!p) {
                snprintf(err, errlen, "\"%s\": no artifact parameter %s for {%s}", tpl, name, name);
                return -1;
            }
            snprintf(piece, sizeof piece, "%lld", p->value);
            i = (size_t)(end - tpl) + 1;
        } else if (tpl[i] == '}') {
            snprintf(err, errlen, "\"%s\": stray } at column %zu", tpl, i + 1);
            return -1;
        } else {
            piece[0] = tpl[i++];
            piece[1] = '\0';
        }
        size_t len = strlen(add);
        if (n + len + 1 > outlen) {
            snprintf(err, errlen, "\"%s\": path too long", tpl);
            return -1;
        }
        memcpy(out + n, add, len);
        n += len;
    }
    out[n] = '\0';
    return 0;
}

/* expr_eval callback: names are earlier values and integer args, then the artifact's parameters. */
static int lookup(void *ctx, expr_lookup_kind kind, const char *name, int64_t *value, char *err, size_t errlen) {
    run_t *r = ctx;
    const spec_line *def = find_line(&r->spec, name);
    if (kind == EXPR_NAME) {
        if (def && def->defined && (def->kind == LINE_VALUE || is_int_role(def->role))) {
            *value = def->ivalue;
            return 0;
        }
        const tritune_param *p = find_param(name);
        if (p) {
            *value = p->value;
            return 0;
        }
        snprintf(err, errlen, "unknown name '%s'", name);
        return -1;
    }
    if (def == NULL || !def->defined || (def->role != ROLE_IN && def->role != ROLE_OUT)) {
        snprintf(err, errlen, "unknown argument '%s'", name);
        return -1;
    }
    const tdat_tensor *t = &def->tensor;
    if (kind == EXPR_NUMEL) {
        *value = t->numel;
        return 0;
    }
    if (t->dtype != TDAT_INT32 && t->dtype != TDAT_INT64) {
        snprintf(err, errlen, "%s: first element wanted from a %s tensor (want int32 or int64)", def->path,
                 tdat_dtype_name(t->dtype));
        return -1;
    }
    if (t->numel == 0) {
        snprintf(err, errlen, "%s: first element wanted from an empty tensor", def->path);
        return -1;
    }
    *value = tdat_get_int(t, 0);
    return 0;
}

static int evaluate(run_t *r, const spec_line *l, const char *what, const char *text, int64_t *out) {
    char err[ERR_LEN];
    if (expr_eval(text, lookup, r, out, err, sizeof err) != 0)
        return complain(EXIT_USAGE, "%s:%d: %s: %s", r->spec.source, l->lineno, what, err);
    return 0;
}

/* Loads data files and evaluates every line in file order. */
static int resolve(run_t *r) {
    spec_t *s = &r->spec;
    if (strcmp(s->kernel, tritune_kernel_name) != 0)
        return complain(EXIT_FIT, "%s: spec is for kernel '%s', the artifact %s is '%s'", s->source, s->kernel,
                        tritune_artifact_id, tritune_kernel_name);
    for (int i = 0; i < s->num_lines; i++)
        if (s->lines[i].kind != LINE_GRID && find_param(s->lines[i].name))
            return complain(EXIT_FIT, "%s:%d: spec name '%s' is also an artifact parameter", s->source,
                            s->lines[i].lineno, s->lines[i].name);
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        char what[300];
        snprintf(what, sizeof what, "%s '%s'", l->kind == LINE_VALUE ? "value" : "arg", l->name ? l->name : "");
        if (l->kind == LINE_GRID) {
            for (int k = 0; k < 3; k++) {
                int64_t v;
                snprintf(what, sizeof what, "grid[%d]", k);
                if (evaluate(r, l, what, l->grid[k], &v)) return EXIT_USAGE;
                if (v < 1 || v > (k == 0 ? INT32_MAX : 65535))
                    return complain(EXIT_FIT, "%s:%d: grid[%d] = %lld is outside 1..%d", s->source, l->lineno, k,
                                    (long long)v, k == 0 ? INT32_MAX : 65535);
                r->grid[k] = (unsigned int)v;
            }
            continue;
        }
        if (l->kind == LINE_VALUE || l->role == ROLE_SCRATCH || is_int_role(l->role)) {
            if (evaluate(r, l, what, l->text, &l->ivalue)) return EXIT_USAGE;
            if (l->role == ROLE_I32 && l->kind == LINE_ARG && (l->ivalue < INT32_MIN || l->ivalue > INT32_MAX))
                return complain(EXIT_USAGE, "%s:%d: %s: %lld does not fit in an i32", s->source, l->lineno, what,
                                (long long)l->ivalue);
            if (l->role == ROLE_SCRATCH && l->kind == LINE_ARG && l->ivalue < 0)
                return complain(EXIT_USAGE, "%s:%d: %s: %lld bytes", s->source, l->lineno, what, (long long)l->ivalue);
        } else if (l->role == ROLE_IN || l->role == ROLE_OUT) {
            char rel[4096], err[ERR_LEN];
            if (substitute(l->text, rel, sizeof rel, err, sizeof err) != 0)
                return complain(EXIT_USAGE, "%s:%d: %s: %s", s->source, l->lineno, what, err);
            size_t len = strlen(r->bundle) + strlen(rel) + 2;
            l->path = malloc(len);
            if (l->path == NULL) return complain(EXIT_DATA, "out of memory");
            if (rel[0] == '/')
                snprintf(l->path, len, "%s", rel);
            else
                snprintf(l->path, len, "%s/%s", r->bundle, rel);
            if (tdat_read(l->path, &l->tensor, err, sizeof err) != 0)
                return complain(EXIT_DATA, "%s:%d: %s: %s", s->source, l->lineno, what, err);
        }
        l->defined = 1;
    }
    /* Triton's launcher multiplies the dims as unsigned ints and launches nothing when the product is 0. */
    if (((uint64_t)r->grid[0] * r->grid[1] * r->grid[2]) % (1ULL << 32) == 0)
        return complain(EXIT_FIT, "grid %ux%ux%u has 2**32 * k blocks, which Triton's launcher reads as empty",
                        r->grid[0], r->grid[1], r->grid[2]);
    return 0;
}

/* tritune_args against the spec's args, as spec.check_specialization. */
static int match_args(run_t *r) {
    spec_t *s = &r->spec;
    r->arg_line = calloc((size_t)tritune_num_args + 1, sizeof *r->arg_line);
    if (r->arg_line == NULL) return complain(EXIT_FIT, "out of memory");
    for (int i = 0; i < tritune_num_args; i++) {
        const tritune_argdesc *d = &tritune_args[i];
        const spec_line *l = find_line(s, d->name);
        if (l == NULL || l->kind != LINE_ARG)
            return complain(EXIT_FIT, "%s: artifact argument '%s' has no spec arg", s->source, d->name);
        r->arg_line[i] = (int)(l - s->lines);
        int fits = d->type == 'p'   ? (l->role == ROLE_IN || l->role == ROLE_OUT || l->role == ROLE_SCRATCH)
                   : d->type == 'i' ? l->role == ROLE_I32
                   : d->type == 'l' ? l->role == ROLE_I64
                   : d->type == 'f' ? l->role == ROLE_F32
                                    : -1;
        if (fits < 0) return complain(EXIT_FIT, "artifact argument '%s' has unknown type '%c'", d->name, d->type);
        if (!fits)
            return complain(EXIT_FIT, "%s:%d: artifact argument '%s' (type '%c') is given a spec arg of role %s",
                            s->source, l->lineno, d->name, d->type, ROLE_NAMES[l->role]);
        if (d->hint != 0 && d->hint != 1 && d->hint != 16)
            return complain(EXIT_FIT, "artifact argument '%s' has unknown hint %d", d->name, d->hint);
        if (is_int_role(l->role)) {
            if (d->hint == 16 && l->ivalue % 16 != 0)
                return complain(EXIT_FIT,
                                "%s:%d: arg '%s' = %lld breaks the artifact's specialization (divisible by 16)",
                                s->source, l->lineno, d->name, (long long)l->ivalue);
            if (d->hint == 1 && l->ivalue != 1)
                return complain(EXIT_FIT, "%s:%d: arg '%s' = %lld breaks the artifact's specialization (equal to 1)",
                                s->source, l->lineno, d->name, (long long)l->ivalue);
        } else if (d->hint == 1 || (d->hint == 16 && d->type == 'f')) {
            return complain(EXIT_FIT, "artifact argument '%s' (type '%c') cannot have hint %d", d->name, d->type,
                            d->hint);
        }
    }
    for (int i = 0; i < s->num_lines; i++) {
        const spec_line *l = &s->lines[i];
        if (l->kind != LINE_ARG) continue;
        int found = 0;
        for (int k = 0; k < tritune_num_args; k++) found |= !strcmp(tritune_args[k].name, l->name);
        if (!found)
            return complain(EXIT_FIT, "%s:%d: spec arg '%s' is not an argument of the artifact", s->source, l->lineno,
                            l->name);
    }
    return 0;
}

static void print_dry_run(const run_t *r) {
    const spec_t *s = &r->spec;
    FILE *f = stdout;
    fputs("TRITUNE_DRYRUN {\"artifact\": ", f);
    json_string(f, tritune_artifact_id);
    fputs(", \"kernel\": ", f);
    json_string(f, tritune_kernel_name);
    fputs(", \"params\": {", f);
    for (int i = 0; i < tritune_num_params; i++) {
        fputs(i ? ", " : "", f);
        json_string(f, tritune_params[i].name);
        fprintf(f, ": %lld", tritune_params[i].value);
    }
    const char *sep = "";
    fputs("}, \"values\": {", f);
    for (int i = 0; i < s->num_lines; i++) {
        if (s->lines[i].kind != LINE_VALUE) continue;
        fputs(sep, f);
        sep = ", ";
        json_string(f, s->lines[i].name);
        fprintf(f, ": %lld", (long long)s->lines[i].ivalue);
    }
    sep = "";
    fputs("}, \"args\": {", f);
    for (int i = 0; i < s->num_lines; i++) {
        const spec_line *l = &s->lines[i];
        if (l->kind != LINE_ARG || !(is_int_role(l->role) || l->role == ROLE_F32)) continue;
        fputs(sep, f);
        sep = ", ";
        json_string(f, l->name);
        fputs(": ", f);
        if (l->role == ROLE_F32)
            json_double(f, l->fvalue);
        else
            fprintf(f, "%lld", (long long)l->ivalue);
    }
    fprintf(f, "}, \"grid\": [%u, %u, %u]}\n", r->grid[0], r->grid[1], r->grid[2]);
    fflush(f);
}

/* ---------------------------------------------------------------- the accuracy check */

/* One out arg: `got` (bytes from the device) against its expected file, as docs/AOT.md says. */
static void compare(const spec_line *l, const unsigned char *got, const double tol[4], check_result *res) {
    const tdat_tensor *ref = &l->tensor;
    tdat_tensor out = *ref;
    out.data = (void *)got;
    int64_t n = ref->numel, mismatches = 0, nonfinite = 0;
    double max_abs = 0, diff_sq = 0, ref_sq = 0;
    int is_float = tdat_is_float(ref->dtype);
    for (int64_t i = 0; i < n; i++) {
        double o = tdat_get_double(&out, i), e = tdat_get_double(ref, i);
        double d = fabs(o - e);
        if (is_float) {
            nonfinite += !isfinite(o);
            if (!isfinite(o) || !(d <= tol[0] + tol[1] * fabs(e))) mismatches++;
        } else if (tdat_get_int(&out, i) != tdat_get_int(ref, i)) {
            mismatches++;
        }
        max_abs = isfinite(o) ? fmax(max_abs, d) : INFINITY;
        diff_sq += (o - e) * (o - e);
        ref_sq += e * e;
    }
    double ratio = n ? (double)mismatches / (double)n : 0.0;
    /* With ||ref|| == 0 the relative error is undefined and not checked; the absolute norm is reported. */
    double rel = ref_sq == 0 ? sqrt(diff_sq) : sqrt(diff_sq) / sqrt(ref_sq);
    /* NaN/Inf in the output (an unwritten, still poisoned element, say) fails whatever the tolerance: its
     * rel_l2 is NaN/Inf too, and saying so is clearer than a failed comparison. */
    int ok = is_float ? nonfinite == 0 && ratio <= tol[2] && (ref_sq == 0 || rel <= tol[3]) : mismatches == 0;
    res->max_abs_err = fmax(res->max_abs_err, max_abs);
    if (isnan(max_abs)) res->max_abs_err = NAN;
    res->mismatch_ratio = fmax(res->mismatch_ratio, ratio);
    res->rel_l2 = isnan(rel) || isnan(res->rel_l2) ? NAN : fmax(res->rel_l2, rel);
    if (!ok && res->ok) {
        res->ok = 0;
        snprintf(res->why, sizeof res->why,
                 "wrong output '%s': %lld of %lld elements mismatch (ratio %.3g, allowed %.3g), %lld NaN/Inf, "
                 "rel_l2 %.3g (allowed %.3g), max_abs_err %.3g",
                 l->name, (long long)mismatches, (long long)n, ratio, is_float ? tol[2] : 0.0, (long long)nonfinite,
                 rel, is_float ? tol[3] : 0.0, max_abs);
    }
}

/* ---------------------------------------------------------------- CUDA */

/* Reports a failed CUDA call (`call` is its source text; the function's name is shown); returns EXIT_CUDA. */
static int cuda_failed(run_t *r, const char *call, CUresult rc) {
    int len = (int)strcspn(call, "(");
    return set_error(r, complain(EXIT_CUDA, "%.*s failed: CUDA error %d: %s", len, call, (int)rc, cuda_text(rc)),
                     "CUDA error %d in %.*s", (int)rc, len, call);
}

#define CU(call)                                                                                                      \
    do {                                                                                                              \
        CUresult rc_ = (call);                                                                                        \
        if (rc_ != CUDA_SUCCESS) return cuda_failed(r, #call, rc_);                                                   \
    } while (0)

static void release_stream(run_t *r) {
    if (r->held_value) {
        __atomic_store_n((uint32_t *)r->flag_host, r->held_value, __ATOMIC_SEQ_CST);
        r->held_value = 0;
    }
}

static int setup(run_t *r) {
    spec_t *s = &r->spec;
    CUcontext ctx;
    CU(cuInit(0));
    CU(cuDeviceGet(&r->dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, r->dev));
    r->ctx_retained = 1;
    CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&r->stream, CU_STREAM_NON_BLOCKING));
    r->host_out = calloc((size_t)s->num_lines, sizeof *r->host_out);
    r->slots = calloc((size_t)tritune_num_args + 1, sizeof *r->slots);
    r->values = calloc((size_t)tritune_num_args + 1, sizeof *r->values);
    if (!r->host_out || !r->slots || !r->values) return set_error(r, EXIT_CUDA, "out of host memory");
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        if (l->kind != LINE_ARG || !(l->role == ROLE_IN || l->role == ROLE_OUT || l->role == ROLE_SCRATCH)) continue;
        l->dbytes = l->role == ROLE_SCRATCH ? (size_t)l->ivalue : l->tensor.nbytes;
        CU(cuMemAlloc(&l->dptr, l->dbytes ? l->dbytes : 1)); /* a zero-byte allocation is an error */
        if (l->role == ROLE_IN && l->dbytes) CU(cuMemcpyHtoD(l->dptr, l->tensor.data, l->dbytes));
        if (l->role == ROLE_OUT && (r->host_out[i] = malloc(l->dbytes ? l->dbytes : 1)) == NULL)
            return set_error(r, EXIT_CUDA, "out of host memory");
    }
    for (int i = 0; i < tritune_num_args; i++) {
        const spec_line *l = &s->lines[r->arg_line[i]];
        arg_slot *slot = &r->slots[i];
        switch (l->role) {
        case ROLE_I32: slot->i = (int32_t)l->ivalue; break;
        case ROLE_I64: slot->l = l->ivalue; break;
        case ROLE_F32: slot->f = (float)l->fvalue; break;
        default: slot->p = l->dptr; break;
        }
        r->values[i] = slot;
    }
    if (r->flush_bytes) CU(cuMemAlloc(&r->flush, (size_t)r->flush_bytes));
    for (; r->num_events < 2 * CHUNK_REPS; r->num_events++) CU(cuEventCreate(&r->events[r->num_events], 0));
    memcpy(tritune_grid, r->grid, sizeof tritune_grid);
    return 0;
}

/* Poison the outputs (0xFF bytes: NaN or -1), zero the scratch, launch once, copy back and compare. */
static int checked_launch(run_t *r, const char *when) {
    spec_t *s = &r->spec;
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        if (l->kind == LINE_ARG && (l->role == ROLE_OUT || l->role == ROLE_SCRATCH) && l->dbytes)
            CU(cuMemsetD8Async(l->dptr, l->role == ROLE_OUT ? 0xFF : 0, l->dbytes, r->stream));
    }
    CU(tritune_launch(r->stream, r->values));
    CU(cuStreamSynchronize(r->stream));
    r->check = (check_result){.ok = 1};
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        if (l->kind != LINE_ARG || l->role != ROLE_OUT) continue;
        if (l->dbytes) CU(cuMemcpyDtoH(r->host_out[i], l->dptr, l->dbytes));
        compare(l, r->host_out[i], s->tol, &r->check);
    }
    if (!r->check.ok) {
        complain(EXIT_WRONG, "%s (%s)", r->check.why, when);
        return set_error(r, EXIT_WRONG, "%s (%s)", r->check.why, when);
    }
    return 0;
}

static int no_hold(void) {
    complain(0, "stream memory operations are not supported here: timing without holding the stream, so the "
                "host's launch gaps may be timed");
    return 0;
}

/* Queues up to CHUNK_REPS reps behind a host flag, so the host's launch gaps are not timed, then releases them. */
static int time_reps(run_t *r) {
    int hold = 1;
    CUresult rc = cuMemHostAlloc(&r->flag_host, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP);
    if (rc == CUDA_SUCCESS) rc = cuMemHostGetDevicePointer(&r->flag_dev, r->flag_host, 0);
    if (rc == CUDA_ERROR_NOT_SUPPORTED)
        hold = no_hold();
    else if (rc != CUDA_SUCCESS)
        return cuda_failed(r, "cuMemHostAlloc (timing flag)", rc);
    if (hold) __atomic_store_n((uint32_t *)r->flag_host, 0, __ATOMIC_SEQ_CST);
    r->times_us = malloc((size_t)r->reps * sizeof *r->times_us);
    if (r->times_us == NULL) return set_error(r, EXIT_CUDA, "out of host memory");
    uint32_t epoch = 0;
    for (long start = 0; start < r->reps; start += CHUNK_REPS) {
        long n = r->reps - start < CHUNK_REPS ? r->reps - start : CHUNK_REPS;
        if (hold) {
            rc = cuStreamWaitValue32(r->stream, r->flag_dev, epoch + 1, CU_STREAM_WAIT_VALUE_GEQ);
            if (rc == CUDA_ERROR_NOT_SUPPORTED) {
                hold = no_hold();
            } else if (rc != CUDA_SUCCESS) {
                return cuda_failed(r, "cuStreamWaitValue32", rc);
            } else {
                r->held_value = epoch + 1;
            }
        }
        for (long k = 0; k < n; k++) {
            if (r->flush) CU(cuMemsetD8Async(r->flush, (unsigned char)k, (size_t)r->flush_bytes, r->stream));
            CU(cuEventRecord(r->events[2 * k], r->stream));
            CU(tritune_launch(r->stream, r->values));
            CU(cuEventRecord(r->events[2 * k + 1], r->stream));
        }
        if (r->held_value) epoch = r->held_value;
        release_stream(r);
        CU(cuStreamSynchronize(r->stream));
        for (long k = 0; k < n; k++) {
            float ms = 0;
            CU(cuEventElapsedTime(&ms, r->events[2 * k], r->events[2 * k + 1]));
            r->times_us[start + k] = ms * 1000.0f;
        }
    }
    r->reps_done = r->reps;
    return 0;
}

static int run_cuda(run_t *r) {
    int rc = setup(r);
    if (!rc) rc = checked_launch(r, "first launch");
    for (long i = 0; !rc && i < r->warmup; i++) {
        CUresult cr = tritune_launch(r->stream, r->values);
        if (cr != CUDA_SUCCESS) rc = cuda_failed(r, "tritune_launch (warmup)", cr);
    }
    if (!rc && r->warmup) {
        CUresult cr = cuStreamSynchronize(r->stream);
        if (cr != CUDA_SUCCESS) rc = cuda_failed(r, "cuStreamSynchronize (warmup)", cr);
    }
    if (!rc) rc = time_reps(r);
    if (!rc) rc = checked_launch(r, "after timing");
    release_stream(r); /* a failure while the stream was held must not leave it waiting */
    return rc;
}

/* Best effort: after a fault the context is gone and these fail, which changes nothing. */
static void cleanup_cuda(run_t *r) {
    spec_t *s = &r->spec;
    release_stream(r);
    if (r->stream) cuStreamSynchronize(r->stream);
    for (int i = 0; i < s->num_lines; i++) {
        if (s->lines[i].dptr) cuMemFree(s->lines[i].dptr);
        if (r->host_out) free(r->host_out[i]);
    }
    if (r->flush) cuMemFree(r->flush);
    if (r->flag_host) cuMemFreeHost(r->flag_host);
    for (int i = 0; i < r->num_events; i++) cuEventDestroy(r->events[i]);
    if (r->stream) cuStreamDestroy(r->stream);
    if (r->ctx_retained) cuDevicePrimaryCtxRelease(r->dev);
    free(r->host_out);
    free(r->slots);
    free(r->values);
}

static void free_spec(run_t *r) {
    spec_t *s = &r->spec;
    for (int i = 0; i < s->num_lines; i++) {
        spec_line *l = &s->lines[i];
        free(l->name);
        free(l->text);
        free(l->path);
        for (int k = 0; k < 3; k++) free(l->grid[k]);
        tdat_free(&l->tensor);
    }
    free(s->lines);
    free(s->kernel);
    free(r->arg_line);
}

/* Triton's launcher calls exit(CUresult) when loading or launching fails (see tritune_artifact.h). */
void tritune_launcher_exit(int status) __attribute__((noreturn));

void tritune_launcher_exit(int status) {
    /* Triton's template prints its error with a literal "\\n", not a newline: end that line so the result line
     * stands on its own. */
    fputc('\n', stdout);
    fflush(stdout);
    const char *text = cuda_text((CUresult)status);
    complain(EXIT_CUDA, "Triton's launcher stopped on CUDA error %d: %s", status, text);
    if (g_run) {
        set_error(g_run, EXIT_CUDA, "CUDA error %d in Triton's launcher (module load or launch): %s", status, text);
        release_stream(g_run);
        print_result(g_run);
    }
    (exit)(EXIT_CUDA);
}

/* Someone called the C library's exit() (a launcher built without the hook): leave a result line at least. */
static void exited_early(void) {
    if (g_run && !g_run->printed && !g_run->dry_run) {
        fputc('\n', stdout); /* whatever was printed last may lack its newline */
        set_error(g_run, EXIT_CUDA, "the process exited inside the artifact (Triton's launcher?)");
        release_stream(g_run);
        print_result(g_run);
    }
}

/* ---------------------------------------------------------------- command line */

static int usage(void) {
    return complain(EXIT_USAGE, "usage: %s --bundle DIR --spec FILE [--reps N] [--warmup W] [--flush-bytes B] "
                                "[--dry-run]",
                    tritune_artifact_id);
}

static int parse_count(const char *opt, const char *text, long long lo, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < lo)
        return complain(EXIT_USAGE, "%s wants an integer >= %lld, got '%s'", opt, lo, text);
    *out = v;
    return 0;
}

static int parse_args(run_t *r, int argc, char **argv) {
    long long reps = 100, warmup = 10, flush = 209715200;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--dry-run")) {
            r->dry_run = 1;
            continue;
        }
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            printf("usage: %s --bundle DIR --spec FILE [--reps N=100] [--warmup W=10] [--flush-bytes B=209715200] "
                   "[--dry-run]\n", argv[0]);
            return -1;
        }
        int known = !strcmp(opt, "--bundle") || !strcmp(opt, "--spec") || !strcmp(opt, "--reps") ||
                    !strcmp(opt, "--warmup") || !strcmp(opt, "--flush-bytes");
        if (!known) {
            complain(EXIT_USAGE, "unknown option '%s'", opt);
            return usage();
        }
        if (i + 1 >= argc) return complain(EXIT_USAGE, "%s wants a value", opt);
        const char *val = argv[++i];
        int rc = 0;
        if (!strcmp(opt, "--bundle"))
            r->bundle = val;
        else if (!strcmp(opt, "--spec"))
            r->spec_arg = val;
        else if (!strcmp(opt, "--reps"))
            rc = parse_count(opt, val, 1, &reps);
        else if (!strcmp(opt, "--warmup"))
            rc = parse_count(opt, val, 0, &warmup);
        else
            rc = parse_count(opt, val, 0, &flush);
        if (rc) return rc;
    }
    if (!r->bundle || !r->spec_arg) {
        complain(EXIT_USAGE, "--bundle and --spec are required");
        return usage();
    }
    if (reps > 1000000 || warmup > 1000000) return complain(EXIT_USAGE, "--reps and --warmup are at most 1000000");
    r->reps = (long)reps;
    r->warmup = (long)warmup;
    r->flush_bytes = (unsigned long long)flush;
    return 0;
}

int main(int argc, char **argv) {
    static run_t run;
    run_t *r = &run;
    int rc = parse_args(r, argc, argv);
    if (rc) return rc < 0 ? EXIT_VALID : rc;
    g_run = r;
    atexit(exited_early);
    rc = read_spec(r);
    if (!rc) rc = resolve(r);
    if (!rc) rc = match_args(r);
    if (rc) {
        set_error(r, rc, "spec does not run with this artifact (exit %d)", rc);
    } else if (r->dry_run) {
        print_dry_run(r);
    } else {
        rc = run_cuda(r);
        cleanup_cuda(r);
    }
    print_result(r);
    g_run = NULL;
    free(r->times_us);
    free_spec(r);
    return rc;
}
