/* The interface between an artifact's glue (artifacts/<id>/glue.c) and the generic main (docs/AOT.md).
 *
 * Also force-included (-include tritune_artifact.h) when compiling Triton's generated launcher, whose
 * template calls exit() and friends without including <stdlib.h>; hence the includes below.
 */
#ifndef TRITUNE_ARTIFACT_H
#define TRITUNE_ARTIFACT_H

#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name;
    long long value;
} tritune_param;

typedef struct {
    const char *name;
    char type; /* 'p' pointer (CUdeviceptr), 'i' int32_t, 'l' int64_t, 'f' float */
    int hint;  /* 0 none, 16 divisible by 16, 1 compiled in as the constant 1 (not passed to the launcher) */
} tritune_argdesc;

extern const char *const tritune_artifact_id;  /* config id, e.g. moe_stage1_BM64_BN128_BK64_GM8_W4_S3 */
extern const char *const tritune_kernel_name;  /* the spec's kernel, e.g. moe_stage1 */
extern const char *const tritune_target;       /* cuda:90 */
extern const tritune_param tritune_params[];   /* BLOCK_* and every other config parameter, num_warps, num_stages */
extern const int tritune_num_params;
extern const tritune_argdesc tritune_args[];   /* every runtime argument in kernel order */
extern const int tritune_num_args;
extern unsigned int tritune_grid[3];           /* set by the main; Triton's launcher reads it (--grid) */

/* values[i] points at the value of tritune_args[i]. */
CUresult tritune_launch(CUstream stream, void *const *values);

/* Triton's launcher exits the process with a CUresult as the status when a CUDA call fails (a module that
 * does not load on this GPU, say). Routed here, the main prints its result line and exits 4 as docs/AOT.md
 * promises, instead of an arbitrary status (CUDA_ERROR_INVALID_VALUE would read as "wrong output").
 * Define TRITUNE_NO_EXIT_HOOK before including to keep the C library's exit(). */
#ifndef TRITUNE_NO_EXIT_HOOK
void tritune_launcher_exit(int status) __attribute__((noreturn));
#define exit(status) tritune_launcher_exit(status)
#endif

#endif /* TRITUNE_ARTIFACT_H */
