"""Kernel entry points for the AOT compiler where a kernel takes a constexpr Triton's AOT signature cannot
express (a string): a thin @triton.jit wrapper maps an integer constexpr onto it and calls the kernel inline,
so the artifact runs the same code the JIT launches."""

import triton
import triton.language as tl

from tritune.kernels.gemm import _gemm_kernel


@triton.jit(do_not_specialize=["M", "stride_ck"])
def gemm_entry(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K, k_per_split,
    stride_am, stride_bn, stride_cm, stride_ck, stride_asm, stride_bsn,
    QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_KSPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    CACHE_CG: tl.constexpr,  # 1: cache_modifier ".cg", 0: ""
):
    # Unsplit (AOT artifacts never split K): A stands for the split-K output and lock pointers, never read; no
    # tiles split past the full waves (dp_tiles 0, TAIL_SPLIT off).
    if CACHE_CG:
        _gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, a_ptr, a_ptr, M, N, K, k_per_split,
                     stride_am, stride_bn, stride_cm, stride_ck, stride_asm, stride_bsn, 0, QUANT,
                     BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_KSPLIT, EVEN_K, ".cg")
    else:
        _gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, a_ptr, a_ptr, M, N, K, k_per_split,
                     stride_am, stride_bn, stride_cm, stride_ck, stride_asm, stride_bsn, 0, QUANT,
                     BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, NUM_KSPLIT, EVEN_K, "")
