/* The run spec's integer expressions (docs/AOT.md), evaluated exactly as tritune/aot/expr.py does:
 * int64 with overflow as an error, floor / and %, unary minus binding tighter than * / %,
 * cdiv/min/max, and numel(ARG)/first(ARG) answered by callbacks. */
#ifndef TRITUNE_EXPR_H
#define TRITUNE_EXPR_H

#include <stddef.h>
#include <stdint.h>

#define EXPR_MAX_DEPTH 64   /* nesting limit, the same as expr.py's MAX_DEPTH */
#define EXPR_MAX_NAME 255   /* longest identifier */

typedef enum { EXPR_NAME, EXPR_NUMEL, EXPR_FIRST } expr_lookup_kind;

/* Answers a name (EXPR_NAME) or numel()/first() of an argument. Returns 0 and sets *value, or -1 with a short
 * reason in err (e.g. "unknown name 'x'"); the evaluator adds the expression and the column. */
typedef int (*expr_lookup_fn)(void *ctx, expr_lookup_kind kind, const char *name, int64_t *value, char *err,
                              size_t errlen);

/* Evaluate text. Returns 0 and sets *value, or -1 with a one-line message quoting the expression in err. */
int expr_eval(const char *text, expr_lookup_fn lookup, void *ctx, int64_t *value, char *err, size_t errlen);

/* Syntax only: calls lookup for every name and argument (in order) but ignores arithmetic errors and the
 * values, so a caller can check references. lookup may be NULL. Returns 0 or -1 with err. */
int expr_scan(const char *text, expr_lookup_fn lookup, void *ctx, char *err, size_t errlen);

#endif /* TRITUNE_EXPR_H */
