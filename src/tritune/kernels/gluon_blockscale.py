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

    # Triton 3.7 renamed the TMA copies (3.6 has only the old names, 3.9 refuses them)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAS_GLUON_HOPPER = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAS_GLUON_HOPPER = False

SCALE_BLOCK = 128  # K (and weight N) elements per scale

if HAS_GLUON_HOPPER:

    @gluon.jit
    def _stage_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr = 1):
        """A warp-specialised ring's barriers, initialised: `ready` a stage (its TMA bytes, and READY_COUNT
        arrivals) and `empty` a stage (the MMA warps' one arrival once they are done with it)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=READY_COUNT)
            mbarrier.init(empty.index(i), count=1)
        return ready, empty

    @gluon.jit
    def _issue(a_smem, b_smem, ready, regs, k, STAGES: gl.constexpr):
        """Block k's MMA from zero into `regs`' registers (their value unread), once its stage has landed; returns
        the in-flight partial."""
        s = k % STAGES
        mbarrier.wait(ready.index(s), phase=(k // STAGES) & 1)
        return warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), regs, use_acc=False, is_async=True)

    @gluon.jit
    def _scale(a_s_ptrs, m_ok, b_s_ptr, k, stride_ask, stride_bsk):
        """Block k's rescale of each tile row: its 1x128 activation scale (0 past M where `m_ok` is given; None: every
        row is real, as the MoE's padded blocks are) times the tile's 128x128 weight scale."""
        if m_ok is None:
            a_s = gl.load(a_s_ptrs + k * stride_ask)
        else:
            a_s = gl.load(a_s_ptrs + k * stride_ask, mask=m_ok, other=0.0)
        return a_s * gl.load(b_s_ptr + k * stride_bsk)

    @gluon.jit
    def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        """(pid_m, pid_n) of output tile `tile` in the grouped order: GROUP_M tiles down M, then across N."""
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m

    @gluon.jit
    def _grid_tiles(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, programs):
        """A persistent GEMM grid's counts: (tiles down M, tiles across N, K blocks, the tiles of this program, which
        takes tiles p, p + programs, ...)."""
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        return num_pid_m, num_pid_n, gl.cdiv(K, BK), gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), programs)

    @gluon.jit
    def _load(a_desc, b_desc, a_smem, b_smem, ready, g, k, off_m, off_n, pred, STAGES: gl.constexpr):
        """The program's K step g (its tiles' steps back to back: K block k, of the descriptors' block width, of the
        tile at off_m, off_n) into stage g % STAGES, where `pred`."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        s = g % STAGES
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [off_m, k * BK], ready.index(s), a_smem.index(s), pred=pred)
        _tma_load(b_desc, [off_n, k * BK], ready.index(s), b_smem.index(s), pred=pred)

    @gluon.jit
    def _blockscale_tile(a_desc, b_desc, a_smem, b_smem, ready, g0, k_tiles, off_m, b_row, a_s_ptrs, m_ok, b_s_ptr,
                         stride_ask, stride_bsk, acc, STAGES: gl.constexpr, empty=None, WS: gl.constexpr = False):
        """One tile's K loop from the program's step g0 (its first STAGES blocks already loading): Σ_k partial_k ·
        a_s[:, k] · b_s[k] added to the zero `acc`, one MMA a K block, block k-1 rescaled while block k's runs; a
        retired block's stage refilled with block k-1+STAGES of this tile (B's rows from `b_row`), or (WS) handed back
        to a loader partition through its `empty` barrier. The block-scaled GEMMs' (one-kernel and warp-specialised)
        and the fused MoE's stage 2 loop.

        Two partials alternate (the loop body is two K blocks). Each MMA is handed acc * 0 as its (unread, use_acc
        False) accumulator: that orders the rescale before the issue, so the partial's registers are free and reused,
        and no copy touches a partial while its MMA is in flight. ptxas serializes every wgmma of a kernel where one
        does (C7514); a branch or more live registers in the loop can bring that back, so the loop only refills this
        tile's own blocks."""
        p0 = _issue(a_smem, b_smem, ready, acc, g0, STAGES)
        s0 = _scale(a_s_ptrs, m_ok, b_s_ptr, 0, stride_ask, stride_bsk)
        for ki in range(1, k_tiles - 1, 2):
            p1 = _issue(a_smem, b_smem, ready, acc * 0.0, g0 + ki, STAGES)
            s1 = _scale(a_s_ptrs, m_ok, b_s_ptr, ki, stride_ask, stride_bsk)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,)) * s0[:, None]  # block ki-1
            j = ki - 1 + STAGES  # into block ki-1's stage, free now
            if WS:
                mbarrier.arrive(empty.index((g0 + ki - 1) % STAGES))
            else:
                _load(a_desc, b_desc, a_smem, b_smem, ready, g0 + j, j, off_m, b_row, j < k_tiles, STAGES)
            p0 = _issue(a_smem, b_smem, ready, acc * 0.0, g0 + ki + 1, STAGES)
            s0 = _scale(a_s_ptrs, m_ok, b_s_ptr, ki + 1, stride_ask, stride_bsk)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p1,)) * s1[:, None]  # block ki
            if WS:
                mbarrier.arrive(empty.index((g0 + ki) % STAGES))
            else:
                _load(a_desc, b_desc, a_smem, b_smem, ready, g0 + j + 1, j + 1, off_m, b_row, j + 1 < k_tiles, STAGES)
        if k_tiles % 2 == 0:  # one block left after the pairs: k_tiles - 1
            p1 = _issue(a_smem, b_smem, ready, acc * 0.0, g0 + k_tiles - 1, STAGES)
            s1 = _scale(a_s_ptrs, m_ok, b_s_ptr, k_tiles - 1, stride_ask, stride_bsk)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,)) * s0[:, None]
            if WS:
                mbarrier.arrive(empty.index((g0 + k_tiles - 2) % STAGES))
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p1,)) * s1[:, None]
        else:
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p0,)) * s0[:, None]
        if WS:
            mbarrier.arrive(empty.index((g0 + k_tiles - 1) % STAGES))
        return acc

    @gluon.jit(do_not_specialize=["M", "programs"])
    def blockscale_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K,
                          stride_asm, stride_ask, stride_bsn, stride_bsk, programs,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
        """C [M, N] (c_desc's dtype) = Σ_k (A_k · B_kᵀ) · a_s[:, k] · b_s[n // 128, k] for A [M, K] and B [N, K]
        fp8 through TMA, a_s [M, ⌈K/128⌉] and b_s [⌈N/128⌉, ⌈K/128⌉] fp32. Program p takes output tiles p,
        p + programs, ... in the grouped order (GROUP_M tiles down M, for L2 reuse of B); the next tile's first
        STAGES K blocks load during this tile's epilogue, and the C tile's TMA store is waited for only before the
        next one. programs = the tile count: one tile a
        program; fewer: persistent. Grid: (programs,)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)  # one weight scale a tile and K block
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN, BK, programs)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
        for i in gl.static_range(STAGES):  # every stage filled before the first MMA
            _load(a_desc, b_desc, a_smem, b_smem, ready, i, i, pid_m * BM, pid_n * BN, i < k_tiles, STAGES)

        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            g0 = t * k_tiles  # this tile's first K step among the program's
            offs_m = off_m + gl.arange(0, BM, layout=row_layout)
            m_ok = offs_m < M
            a_s_ptrs = as_ptr + offs_m * stride_asm
            b_s_ptr = bs_ptr + (off_n // 128) * stride_bsn
            acc = _blockscale_tile(a_desc, b_desc, a_smem, b_smem, ready, g0, k_tiles, off_m, off_n, a_s_ptrs, m_ok,
                                   b_s_ptr, stride_ask, stride_bsk, gl.zeros([BM, BN], gl.float32, mma_layout), STAGES)
            # Every stage is free: the program's next tile, if any, starts loading now, under this tile's epilogue.
            pid_m, pid_n = _tile_coords(pid + (t + 1) * programs, num_pid_m, num_pid_n, GROUP_M)
            for i in gl.static_range(STAGES):
                _load(a_desc, b_desc, a_smem, b_smem, ready, g0 + k_tiles + i, i, pid_m * BM, pid_n * BN,
                      (i < k_tiles) & (t + 1 < my_tiles), STAGES)
            tma.store_wait(pendings=0)  # the previous tile's C has left c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


def descriptor(t, block: list[int]):
    """A Gluon TMA descriptor of 2-D `t` (fp8, bf16 or fp16, row-major; Triton's MockTensor too: only its dtype and
    shape matter when compiling) in `block` tiles, with the default NVMMA shared layout of that tile."""
    dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, dtype))


def descriptors(a, b, out, block_m: int, block_n: int) -> tuple:
    """`blockscale_kernel`'s descriptors of A [M, K] and B [N, K] (fp8) and C [M, N] (bf16 or fp16)."""
    return (descriptor(a, [block_m, SCALE_BLOCK]), descriptor(b, [block_n, SCALE_BLOCK]),
            descriptor(out, [block_m, block_n]))


def smem_bytes(block_m: int, block_n: int, stages: int, out_bytes: int = 2) -> int:
    """Shared memory of one program: the fp8 A and B stages and the C tile of the epilogue (barriers aside)."""
    return stages * (block_m + block_n) * SCALE_BLOCK + block_m * block_n * out_bytes


def programs_for(tiles: int, sm_count: int, block_m: int, block_n: int, stages: int, persistent: bool) -> int:
    """`blockscale_kernel`'s grid: one program a tile, or (persistent) as many as fit on the GPU at once: two a SM
    where two fit in its shared memory (228 KB) and registers (64-row tiles on 4 warps), else one."""
    if not persistent:
        return tiles
    per_sm = 2 if block_m == 64 and 2 * (smem_bytes(block_m, block_n, stages) + 1024) <= 228 * 1024 else 1
    return max(1, min(tiles, per_sm * sm_count))


def gluon_blockscale_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                          block_m: int = 128, block_n: int = 128, stages: int = 4, group_m: int = 8,
                          num_warps: int = 8, persistent: bool = False,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = A [M, K] fp8 · B [N, K]ᵀ fp8 with a_scale [M, ⌈K/128⌉] and b_scale [⌈N/128⌉, ⌈K/128⌉] (fp32),
    launched through Triton's own launcher (the probes' path; the op binds it once in `kernels.gemm.GemmLaunch`)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"gluon_blockscale_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is "
                           f"Triton {triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = programs_for(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count, block_m,
                            block_n, stages, persistent)
    blockscale_kernel[(programs,)](*descriptors(a, b, out, block_m, block_n), a_scale, b_scale, M, N, K,
                                   a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
                                   programs, GROUP_M=group_m, STAGES=stages, WARPS=num_warps, num_warps=num_warps)
    return out
