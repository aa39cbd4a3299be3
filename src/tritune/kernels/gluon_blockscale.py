"""Block-scaled fp8 GEMM (1x128 activation scales, 128x128 weight scales) in Gluon, with the per-K-block rescale
taken off the tensor core's critical path.

Why Gluon. Each 128-deep K block of a block-scaled GEMM ends with a rescale: acc += (A_k · B_k) · a_s ⊗ b_s. In
Triton's `tl.dot` form the product must be complete before the multiply, so the compiler retires every wgmma at
every K block (`wgmma.wait_group 0`; counted by `benchmarks/ir_census.py --scaled-dots` in the eighth session), and
no placement of the rescale in the source changes that. The Triton kernels peaked at 0.66-0.72x of cuBLAS's
row-wise `_scaled_mm` (RESULTS.md, issue 15). Gluon (`triton.experimental.gluon`, Triton >= 3.5) exposes the
asynchronous wgmma and its wait count: this kernel issues block k's MMA into a fresh accumulator, then waits for
block k-1's alone (`warpgroup_mma_wait(num_outstanding=1)`) and rescales it into the running sum while block k's MMA
runs; the TMA refill of k-1's shared-memory stage follows.

Hopper only (TMA, wgmma). Three fp32 tiles are live (the sum and two partials in flight), so a 128x128 tile on
8 warps holds 192 accumulator registers a thread.
"""

from __future__ import annotations

import torch
import triton

try:  # Gluon's Hopper API (Triton >= 3.5); absent on older Triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON_HOPPER = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON_HOPPER = False

SCALE_BLOCK = 128  # K (and weight N) elements per scale

if HAS_GLUON_HOPPER:

    @gluon.jit
    def _issue(a_smem, b_smem, ready, regs, k, STAGES: gl.constexpr):
        """Block k's MMA from zero into `regs`' registers (their value unread), once its stage has landed; returns
        the in-flight partial."""
        s = k % STAGES
        mbarrier.wait(ready.index(s), phase=(k // STAGES) & 1)
        return warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), regs, use_acc=False, is_async=True)

    @gluon.jit
    def _scale(a_s_ptrs, m_ok, b_s_ptr, k, stride_ask, stride_bsk):
        """Block k's rescale of each tile row: its 1x128 activation scale times the tile's 128x128 weight scale."""
        return gl.load(a_s_ptrs + k * stride_ask, mask=m_ok, other=0.0) * gl.load(b_s_ptr + k * stride_bsk)

    @gluon.jit
    def _refill(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, done, k_tiles, STAGES: gl.constexpr):
        """Block `done`'s stage, retired, loads block done + STAGES (if there is one)."""
        s = done % STAGES
        k = done + STAGES
        more = k < k_tiles
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=more)
        tma.async_copy_global_to_shared(a_desc, [off_m, k * 128], ready.index(s), a_smem.index(s), pred=more)
        tma.async_copy_global_to_shared(b_desc, [off_n, k * 128], ready.index(s), b_smem.index(s), pred=more)

    @gluon.jit
    def _blockscale_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
                           stride_asm, stride_ask, stride_bsn, stride_bsk,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, K_TILES: gl.constexpr,
                           num_warps: gl.constexpr):
        """C [M, N] (bf16) = Σ_k (A_k · B_kᵀ) · a_s[:, k] · b_s[n // 128, k] for A [M, K] and B [N, K] fp8 through
        TMA, a_s [M, ⌈K/128⌉] and b_s [⌈N/128⌉, ⌈K/128⌉] fp32. One output tile a program, grouped GROUP_M tiles
        down M for L2 reuse of B. Grid: (⌈M/BM⌉ · ⌈N/BN⌉,)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)  # one weight scale a tile and K block
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m
        off_m = pid_m * BM
        off_n = pid_n * BN

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        k_tiles = gl.cdiv(K, BK)
        for i in gl.static_range(STAGES):  # every stage filled before the first MMA
            fill = i < k_tiles
            mbarrier.expect(ready.index(i), nbytes, pred=fill)
            tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(i), a_smem.index(i), pred=fill)
            tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], ready.index(i), b_smem.index(i), pred=fill)

        offs_m = off_m + gl.arange(0, BM, layout=row_layout)
        m_ok = offs_m < M
        a_s_ptrs = as_ptr + offs_m * stride_asm
        b_s_ptr = bs_ptr + (off_n // 128) * stride_bsn
        zero = gl.zeros([BM, BN], gl.float32, mma_layout)
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)

        if K_TILES > 0:  # K known at compile time: the K loop unrolled, so no partial is ever copied
            p_prev = _issue(a_smem, b_smem, ready, zero, 0, STAGES)
            s_prev = _scale(a_s_ptrs, m_ok, b_s_ptr, 0, stride_ask, stride_bsk)
            for ki in gl.static_range(1, K_TILES):
                p_cur = _issue(a_smem, b_smem, ready, zero, ki, STAGES)
                s_cur = _scale(a_s_ptrs, m_ok, b_s_ptr, ki, stride_ask, stride_bsk)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p_prev,)) * s_prev[:, None]
                _refill(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, ki - 1, K_TILES, STAGES)
                p_prev = p_cur
                s_prev = s_cur
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p_prev,)) * s_prev[:, None]
        else:
            # Two partials alternate (the loop body is two K blocks). Each MMA is handed acc * 0 as its (unread,
            # use_acc False) accumulator: that orders the rescale before the issue, so the partial's registers are
            # free and reused, and no copy touches a partial while its MMA is in flight. ptxas serializes every
            # wgmma of a kernel where one does (C7514).
            p0 = _issue(a_smem, b_smem, ready, zero, 0, STAGES)
            s0 = _scale(a_s_ptrs, m_ok, b_s_ptr, 0, stride_ask, stride_bsk)
            d1 = zero
            for ki in range(1, k_tiles - 1, 2):
                p1 = _issue(a_smem, b_smem, ready, acc * 0.0, ki, STAGES)
                s1 = _scale(a_s_ptrs, m_ok, b_s_ptr, ki, stride_ask, stride_bsk)
                d0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))  # block ki-1
                acc = acc + d0 * s0[:, None]
                _refill(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, ki - 1, k_tiles, STAGES)
                p0 = _issue(a_smem, b_smem, ready, acc * 0.0, ki + 1, STAGES)
                s0 = _scale(a_s_ptrs, m_ok, b_s_ptr, ki + 1, stride_ask, stride_bsk)
                d1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))  # block ki
                acc = acc + d1 * s1[:, None]
                _refill(a_desc, b_desc, a_smem, b_smem, ready, off_m, off_n, ki, k_tiles, STAGES)
            if k_tiles % 2 == 0:  # one block left after the pairs: k_tiles - 1
                p1 = _issue(a_smem, b_smem, ready, d1, k_tiles - 1, STAGES)
                s1 = _scale(a_s_ptrs, m_ok, b_s_ptr, k_tiles - 1, stride_ask, stride_bsk)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,)) * s0[:, None]
                acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p1,)) * s1[:, None]
            else:
                acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p0,)) * s0[:, None]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)


def _descriptors(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bm: int, bn: int) -> tuple:
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor.from_tensor(a, [bm, SCALE_BLOCK], gl.NVMMASharedLayout.get_default_for([bm, SCALE_BLOCK],
                                                                                                       fp8))
    b_desc = TensorDescriptor.from_tensor(b, [bn, SCALE_BLOCK], gl.NVMMASharedLayout.get_default_for([bn, SCALE_BLOCK],
                                                                                                       fp8))
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16))
    return a_desc, b_desc, c_desc


def gluon_blockscale_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                          block_m: int = 128, block_n: int = 128, stages: int = 4, group_m: int = 8,
                          num_warps: int = 8, unroll: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = A [M, K] fp8 · B [N, K]ᵀ fp8 with a_scale [M, ⌈K/128⌉] and b_scale [⌈N/128⌉, ⌈K/128⌉] (fp32)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"gluon_blockscale_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is "
                           f"Triton {triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    a_desc, b_desc, c_desc = _descriptors(a, b, out, block_m, block_n)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _blockscale_kernel[grid](a_desc, b_desc, c_desc, a_scale, b_scale, M, N, K, a_scale.stride(0),
                             a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), GROUP_M=group_m, STAGES=stages,
                             K_TILES=triton.cdiv(K, SCALE_BLOCK) if unroll else 0, num_warps=num_warps)
    return out
