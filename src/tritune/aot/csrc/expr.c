/* The run spec's integer expressions; the same grammar, checks and messages as tritune/aot/expr.py.
 *
 * Like expr.py, the whole text is tokenized first and parsed for syntax before anything is evaluated, so the
 * same expression fails with the same first error in both: expr := term (('+'|'-') term)*;
 * term := unary (('*'|'/'|'%') unary)*; unary := '-' unary | primary;
 * primary := NUMBER | NAME | FUNC '(' args ')' | '(' expr ')'. */
#include "expr.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { TOK_NUM, TOK_NAME, TOK_OP, TOK_END } tok_kind;

typedef struct {
    tok_kind kind;
    int pos; /* 0-based offset of its first character */
    int len;
} token;

/* SYNTAX: parse only; SCAN: also call lookup, ignore arithmetic; EVAL: compute the value. */
typedef enum { MODE_SYNTAX, MODE_SCAN, MODE_EVAL } parse_mode;

typedef struct {
    const char *text;
    token *toks;
    int i;
    int depth;
    parse_mode mode;
    expr_lookup_fn lookup;
    void *ctx;
    char *err;
    size_t errlen;
    int failed;
} parser;

static const char *const FUNCTIONS[] = {"cdiv", "min", "max", "numel", "first"};
#define NUM_FUNCTIONS ((int)(sizeof FUNCTIONS / sizeof FUNCTIONS[0]))

static void fail(parser *p, int pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void fail(parser *p, int pos, const char *fmt, ...) {
    if (p->failed) return;
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errlen, "expression \"%s\", column %d: %s", p->text, pos + 1, what);
    p->failed = 1;
}

static int is_ident_start(char c) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

static int is_digit(char c) {
    return c >= '0' && c <= '9';
}

static int tokenize(parser *p) {
    const char *t = p->text;
    int n = 0;
    size_t len = strlen(t);
    p->toks = malloc((len + 1) * sizeof *p->toks);
    if (p->toks == NULL) {
        fail(p, 0, "out of memory");
        return -1;
    }
    for (int i = 0; t[i];) {
        char c = t[i];
        int start = i;
        if (c == ' ' || c == '\t') {
            i++;
            continue;
        }
        if (is_digit(c)) {
            while (is_digit(t[i])) i++;
            p->toks[n++] = (token){TOK_NUM, start, i - start};
        } else if (is_ident_start(c)) {
            while (is_ident_start(t[i]) || is_digit(t[i])) i++;
            p->toks[n++] = (token){TOK_NAME, start, i - start};
        } else if (strchr("+-*/%(),", c) != NULL) {
            p->toks[n++] = (token){TOK_OP, start, 1};
            i++;
        } else {
            fail(p, i, "unexpected character '%c'", c);
            return -1;
        }
    }
    p->toks[n] = (token){TOK_END, (int)len, 0};
    return 0;
}

static const token *peek(const parser *p) {
    return &p->toks[p->i];
}

static const token *take(parser *p) {
    const token *tok = &p->toks[p->i];
    if (tok->kind != TOK_END) p->i++;
    return tok;
}

static int is_op(const token *tok, const parser *p, char op) {
    return tok->kind == TOK_OP && p->text[tok->pos] == op;
}

/* "the end" or 'tok', as expr.py's _describe. */
static const char *describe(const parser *p, const token *tok, char *buf, size_t buflen) {
    if (tok->kind == TOK_END) return "the end";
    snprintf(buf, buflen, "'%.*s'", tok->len, p->text + tok->pos);
    return buf;
}

static int64_t checked(parser *p, int overflow, int64_t value, int pos) {
    if (overflow && p->mode == MODE_EVAL) fail(p, pos, "64-bit integer overflow");
    return overflow ? 0 : value;
}

static int64_t parse_expr(parser *p);

/* -a, with INT64_MIN (whose negation does not exist, and is undefined in C) an overflow. */
static int64_t negate(parser *p, int64_t a, int pos) {
    return a == INT64_MIN ? checked(p, 1, 0, pos) : -a;
}

static int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static int64_t floor_mod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

static int64_t binary(parser *p, char op, int64_t a, int64_t b, int pos) {
    int64_t out = 0;
    int overflow;
    if (p->mode != MODE_EVAL) return 0;
    if (op == '+' || op == '-' || op == '*') {
        if (op == '+')
            overflow = __builtin_add_overflow(a, b, &out);
        else if (op == '-')
            overflow = __builtin_sub_overflow(a, b, &out);
        else
            overflow = __builtin_mul_overflow(a, b, &out);
        return checked(p, overflow, out, pos);
    }
    if (b == 0) {
        fail(p, pos, "division by zero");
        return 0;
    }
    if (b == -1) /* INT64_MIN / -1 overflows; INT64_MIN % -1 is 0 (and undefined in C) */
        return op == '/' ? negate(p, a, pos) : 0;
    return op == '/' ? floor_div(a, b) : floor_mod(a, b);
}

static int64_t call_lookup(parser *p, expr_lookup_kind kind, const token *name_tok, int pos, const char *fname) {
    char name[EXPR_MAX_NAME + 1];
    char reason[384] = "";
    int64_t value = 0;
    if (name_tok->len > EXPR_MAX_NAME) {
        fail(p, name_tok->pos, "name longer than %d characters", EXPR_MAX_NAME);
        return 0;
    }
    memcpy(name, p->text + name_tok->pos, (size_t)name_tok->len);
    name[name_tok->len] = '\0';
    if (p->mode == MODE_SYNTAX) return 0;
    if (p->lookup == NULL) {
        if (kind == EXPR_NAME)
            fail(p, pos, "unknown name '%s'", name);
        else
            fail(p, pos, "%s() is not available here", fname);
        return 0;
    }
    if (p->lookup(p->ctx, kind, name, &value, reason, sizeof reason) != 0) {
        if (kind == EXPR_NAME)
            fail(p, pos, "%s", reason);
        else
            fail(p, pos, "%s(%s): %s", fname, name, reason);
        return 0;
    }
    return value;
}

static int64_t parse_call(parser *p, const token *name_tok) {
    int pos = name_tok->pos;
    int f = -1;
    for (int k = 0; k < NUM_FUNCTIONS; k++)
        if ((int)strlen(FUNCTIONS[k]) == name_tok->len && strncmp(FUNCTIONS[k], p->text + pos, (size_t)name_tok->len) == 0)
            f = k;
    if (f < 0) {
        fail(p, pos, "unknown function '%.*s' (known: cdiv, min, max, numel, first)", name_tok->len, p->text + pos);
        return 0;
    }
    const char *fname = FUNCTIONS[f];
    char buf[300];
    take(p); /* '(' */
    if (f >= 3) { /* numel, first: an argument's name */
        const token *arg = take(p);
        if (arg->kind != TOK_NAME || !is_op(peek(p), p, ')')) {
            fail(p, arg->pos, "%s() takes one argument name", fname);
            return 0;
        }
        take(p);
        return call_lookup(p, f == 3 ? EXPR_NUMEL : EXPR_FIRST, arg, pos, fname);
    }
    int64_t args[2] = {0, 0};
    int nargs = 0;
    if (!is_op(peek(p), p, ')')) {
        for (;;) {
            int64_t v = parse_expr(p);
            if (p->failed) return 0;
            if (nargs < 2) args[nargs] = v;
            nargs++;
            if (!is_op(peek(p), p, ',')) break;
            take(p);
        }
    }
    const token *close = take(p);
    if (!is_op(close, p, ')')) {
        fail(p, close->pos, "expected ')', got %s", describe(p, close, buf, sizeof buf));
        return 0;
    }
    if (nargs != 2) {
        fail(p, pos, "%s() takes 2 arguments, got %d", fname, nargs);
        return 0;
    }
    if (p->mode != MODE_EVAL) return 0;
    int64_t a = args[0], b = args[1];
    if (f == 1) return a < b ? a : b;
    if (f == 2) return a > b ? a : b;
    if (b == 0) {
        fail(p, pos, "division by zero in cdiv()");
        return 0;
    }
    if (b == -1) return negate(p, a, pos);
    int64_t q = a / b; /* ceil(a / b) for every sign, as -(-a // b) in expr.py */
    return (a % b != 0 && ((a < 0) == (b < 0))) ? q + 1 : q;
}

static int64_t parse_unary(parser *p);

static int64_t parse_primary(parser *p) {
    const token *tok = take(p);
    char buf[300];
    if (tok->kind == TOK_NUM) {
        int64_t value = 0;
        for (int k = 0; k < tok->len; k++) {
            int digit = p->text[tok->pos + k] - '0';
            if (value > (INT64_MAX - digit) / 10) {
                fail(p, tok->pos, "number %.*s does not fit in 64 bits", tok->len, p->text + tok->pos);
                return 0;
            }
            value = value * 10 + digit;
        }
        return value;
    }
    if (tok->kind == TOK_NAME) {
        if (is_op(peek(p), p, '(')) return parse_call(p, tok);
        return call_lookup(p, EXPR_NAME, tok, tok->pos, "");
    }
    if (is_op(tok, p, '(')) {
        int64_t value = parse_expr(p);
        if (p->failed) return 0;
        const token *close = take(p);
        if (!is_op(close, p, ')')) fail(p, close->pos, "expected ')', got %s", describe(p, close, buf, sizeof buf));
        return value;
    }
    fail(p, tok->pos, "expected a number, a name or '(', got %s", describe(p, tok, buf, sizeof buf));
    return 0;
}

static int64_t parse_unary(parser *p) {
    const token *tok = peek(p);
    int64_t value;
    if (++p->depth > EXPR_MAX_DEPTH) {
        fail(p, tok->pos, "nested more than %d deep", EXPR_MAX_DEPTH);
        p->depth--;
        return 0;
    }
    if (is_op(tok, p, '-')) {
        take(p);
        int64_t inner = parse_unary(p);
        value = p->failed ? 0 : negate(p, inner, tok->pos);
    } else {
        value = parse_primary(p);
    }
    p->depth--;
    return value;
}

static int64_t parse_term(parser *p) {
    int64_t value = parse_unary(p);
    while (!p->failed && (is_op(peek(p), p, '*') || is_op(peek(p), p, '/') || is_op(peek(p), p, '%'))) {
        const token *op = take(p);
        int64_t rhs = parse_unary(p);
        if (p->failed) return 0;
        value = binary(p, p->text[op->pos], value, rhs, op->pos);
    }
    return value;
}

static int64_t parse_expr(parser *p) {
    int64_t value = parse_term(p);
    while (!p->failed && (is_op(peek(p), p, '+') || is_op(peek(p), p, '-'))) {
        const token *op = take(p);
        int64_t rhs = parse_term(p);
        if (p->failed) return 0;
        value = binary(p, p->text[op->pos], value, rhs, op->pos);
    }
    return value;
}

static int64_t run(parser *p, parse_mode mode) {
    p->mode = mode;
    p->i = 0;
    p->depth = 0;
    int64_t value = parse_expr(p);
    if (!p->failed && peek(p)->kind != TOK_END) {
        char buf[300];
        fail(p, peek(p)->pos, "unexpected %s after the expression", describe(p, peek(p), buf, sizeof buf));
    }
    return value;
}

static int drive(const char *text, expr_lookup_fn lookup, void *ctx, parse_mode mode, int64_t *value, char *err,
                 size_t errlen) {
    parser p = {.text = text, .lookup = lookup, .ctx = ctx, .err = err, .errlen = errlen};
    int64_t result = 0;
    if (tokenize(&p) == 0) {
        run(&p, MODE_SYNTAX);
        if (!p.failed) result = run(&p, mode);
    }
    free(p.toks);
    if (p.failed) return -1;
    if (value != NULL) *value = result;
    return 0;
}

int expr_eval(const char *text, expr_lookup_fn lookup, void *ctx, int64_t *value, char *err, size_t errlen) {
    return drive(text, lookup, ctx, MODE_EVAL, value, err, errlen);
}

int expr_scan(const char *text, expr_lookup_fn lookup, void *ctx, char *err, size_t errlen) {
    return drive(text, lookup, ctx, lookup ? MODE_SCAN : MODE_SYNTAX, NULL, err, errlen);
}
