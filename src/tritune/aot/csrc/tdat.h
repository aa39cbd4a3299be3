/* Reader of the .tdat tensor file (docs/AOT.md): a "key: value" text header, then raw little-endian bytes.
 * Mirrors tritune/aot/tdat.py, which writes these files and refuses the same malformed ones. */
#ifndef TRITUNE_TDAT_H
#define TRITUNE_TDAT_H

#include <stddef.h>
#include <stdint.h>

typedef enum { TDAT_BF16, TDAT_FP16, TDAT_FP32, TDAT_INT32, TDAT_INT64, TDAT_UINT8, TDAT_NUM_DTYPES } tdat_dtype;

typedef struct {
    char *name;      /* the header's name (malloc'd) */
    tdat_dtype dtype;
    int ndim;
    int64_t numel;   /* product of the shape (1 for a 0-d tensor) */
    size_t nbytes;   /* numel * itemsize */
    void *data;      /* nbytes of payload (malloc'd, at least 1 byte so it is never NULL) */
} tdat_tensor;

/* Element size in bytes; 0 for an invalid dtype. */
size_t tdat_itemsize(tdat_dtype dtype);
/* The format's name ("bf16", ...); "?" for an invalid dtype. */
const char *tdat_dtype_name(tdat_dtype dtype);
/* 1 for bf16/fp16/fp32, 0 for the integer dtypes. */
int tdat_is_float(tdat_dtype dtype);

/* Read the file at path into *out. Returns 0, or -1 with a one-line message naming the file in err. */
int tdat_read(const char *path, tdat_tensor *out, char *err, size_t errlen);
void tdat_free(tdat_tensor *t);

/* Element i as a double (bf16/fp16 widened exactly; int64 rounded to nearest). */
double tdat_get_double(const tdat_tensor *t, int64_t i);
/* Element i of an integer tensor as int64 (uint8 zero-extended). */
int64_t tdat_get_int(const tdat_tensor *t, int64_t i);

#endif /* TRITUNE_TDAT_H */
