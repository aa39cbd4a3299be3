"""Dense GEMM (bf16/fp16, or fp8 with per-token and per-channel scales) in Gluon, persistent, with output tiles whose
width is not a power of two.

Why. On the H100 the gap between Triton's bf16 GEMM and cuBLAS sits mostly in the wave count (eleventh session,
RESULTS.md): 288 tiles of 128x128 on 132 SMs run three waves where cuBLAS's 144-wide tile makes two, and Triton
tensors must be powers of two on every side. A tile here is BLOCK_N = BN0 + BN1 columns wide (192 = 128 + 64, 96 =
64 + 32): one A tile in shared memory feeds two wgmma per K step, one into each accumulator, and C leaves through two
TMA stores. The tile loop is persistent: the next tile's first K blocks load while this tile's last MMAs run (EARLY;
without it they load after the last MMA, under the epilogue: H100, 24 held-out points, EARLY 0.985-1.001x the time
in geomean per tile, 0.89-1.11x point by point), and a tile's C store is waited for only before the next one's.

What it measured (H100, twenty-sixth session, RESULTS.md): per SM, no faster than Triton's persistent TMA kernel on
the same tile; fp8 per-token 64x192 and 64x128 win where their waves fill the GPU and Triton's tiles leave a wave
mostly empty (the rule table takes them there); bf16 192-wide tiles run slower per SM than 128 or 256 (the A tile
read by two MMAs), so bf16 takes them only where the tuner finds them best.

Hopper only (TMA, wgmma).
"""

from __future__ import annotations

import torch
import triton

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER, descriptor

if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from tritune.kernels.gluon_blockscale import _grid_tiles, _tile_coords, _tma_load, _tma_store

    @gluon.jit
    def _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, g, k, off_m, off_n, pred,
               STAGES: gl.constexpr, BN1: gl.constexpr):
        """The program's K step g (K block k of the tile at off_m, off_n) into stage g % STAGES, where `pred`: A's
        rows, B's first BN0 rows and (BN1 > 0) the BN1 after them."""
        s = g % STAGES
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN0: gl.constexpr = b0_desc.block_type.shape[0]
        if BN1 > 0:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b0_desc.block_type.nbytes + b1_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b0_desc.block_type.nbytes
        mbarrier.expect(ready.index(s), nbytes, pred=pred)
        _tma_load(a_desc, [off_m, k * BK], ready.index(s), a_smem.index(s), pred=pred)
        _tma_load(b0_desc, [off_n, k * BK], ready.index(s), b0_smem.index(s), pred=pred)
        if BN1 > 0:
            _tma_load(b1_desc, [off_n + BN0, k * BK], ready.index(s), b1_smem.index(s), pred=pred)

    @gluon.jit
    def _epilogue(acc, c_desc, c_smem, off_m, off_n, as_ptr, bs_ptr, M, N, SCALED: gl.constexpr):
        """One accumulator's columns: scaled (SCALED: row scale of A times column scale of B), converted and sent
        out through TMA once the previous tile's store has left `c_smem`."""
        if SCALED:
            BM: gl.constexpr = acc.type.shape[0]
            BN: gl.constexpr = acc.type.shape[1]
            offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
            a_s = gl.load(as_ptr + offs_m, mask=offs_m < M, other=0.0)
            b_s = gl.load(bs_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc * a_s[:, None] * b_s[None, :]
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [off_m, off_n], c_smem)

    @gluon.jit(do_not_specialize=["M", "programs"])
    def gemm_kernel(a_desc, b0_desc, b1_desc, c0_desc, c1_desc, as_ptr, bs_ptr, M, N, K, programs,
                    BN1: gl.constexpr, SCALED: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    WARPS: gl.constexpr, EARLY: gl.constexpr = True):
        """C [M, N] = A [M, K] · B [N, K]ᵀ (times as[m] · bs[n] where SCALED), A and B through TMA in [BM, BK] and
        [BN0, BK] (+ [BN1, BK]) blocks, C out in [BM, BN0] (+ [BM, BN1]) blocks; BN1 0: one accumulator, and the
        b1 / c1 descriptors are not read. Program p takes output tiles p, p + programs, ... of width BN0 + BN1 in the
        grouped order (GROUP_M tiles down M, for L2 reuse of B). Grid: (programs,)."""
        BM: gl.constexpr = c0_desc.block_type.shape[0]
        BN0: gl.constexpr = c0_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth  # 16 for 16-bit operands, 32 for fp8
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN0 + BN1, BK, programs)

        layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BN0, INSTR_K])
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b0_smem = gl.allocate_shared_memory(b0_desc.dtype, [STAGES, BN0, BK], b0_desc.layout)
        c0_smem = gl.allocate_shared_memory(c0_desc.dtype, [BM, BN0], c0_desc.layout)
        if BN1 > 0:
            layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN1, INSTR_K])
            b1_smem = gl.allocate_shared_memory(b1_desc.dtype, [STAGES, BN1, BK], b1_desc.layout)
            c1_smem = gl.allocate_shared_memory(c1_desc.dtype, [BM, BN1], c1_desc.layout)
        else:
            b1_smem = b0_smem
            c1_smem = c0_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
        for i in gl.static_range(STAGES):  # every stage filled before the first MMA
            _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, i, i, pid_m * BM,
                   pid_n * (BN0 + BN1), i < k_tiles, STAGES, BN1)

        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * (BN0 + BN1)
            nm, nn = _tile_coords(pid + (t + 1) * programs, num_pid_m, num_pid_n, GROUP_M)
            has_next = t + 1 < my_tiles
            g0 = t * k_tiles  # this tile's first K step among the program's
            acc0 = gl.zeros([BM, BN0], gl.float32, layout0)
            if BN1 > 0:
                acc1 = gl.zeros([BM, BN1], gl.float32, layout1)
            for ki in range(k_tiles):
                g = g0 + ki
                s = g % STAGES
                mbarrier.wait(ready.index(s), phase=(g // STAGES) & 1)
                acc0 = warpgroup_mma(a_smem.index(s), b0_smem.index(s).permute((1, 0)), acc0, is_async=True)
                if BN1 > 0:
                    acc1 = warpgroup_mma(a_smem.index(s), b1_smem.index(s).permute((1, 0)), acc1, is_async=True)
                    # this step's two stay in flight; the previous step's are done, so its stage is free
                    acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                else:
                    acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0,))
                j = ki - 1 + STAGES  # into step ki-1's stage
                if EARLY:  # past this tile's K: the next tile's first blocks, so its first MMA need not wait
                    mine = j < k_tiles
                    _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, g0 + j,
                           gl.where(mine, j, j - k_tiles), gl.where(mine, off_m, nm * BM),
                           gl.where(mine, off_n, nn * (BN0 + BN1)), (ki > 0) & (mine | has_next), STAGES, BN1)
                else:
                    _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, g0 + j, j, off_m, off_n,
                           (ki > 0) & (j < k_tiles), STAGES, BN1)
            if BN1 > 0:
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            else:
                acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
            if EARLY:  # the last step's stage is free: the next tile's block STAGES - 1 (the loop loaded the rest)
                _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, g0 + k_tiles + STAGES - 1,
                       STAGES - 1, nm * BM, nn * (BN0 + BN1), has_next, STAGES, BN1)
            else:  # every stage is free: the next tile's first STAGES blocks load now, under this tile's epilogue
                for i in gl.static_range(STAGES):
                    _load2(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, g0 + k_tiles + i, i, nm * BM,
                           nn * (BN0 + BN1), (i < k_tiles) & has_next, STAGES, BN1)
            tma.store_wait(pendings=0)  # the previous tile's C has left shared memory
            _epilogue(acc0, c0_desc, c0_smem, off_m, off_n, as_ptr, bs_ptr, M, N, SCALED)
            if BN1 > 0:
                _epilogue(acc1, c1_desc, c1_smem, off_m, off_n + BN0, as_ptr, bs_ptr, M, N, SCALED)
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


def split_width(block_n: int) -> tuple[int, int]:
    """(BN0, BN1) of a tile `block_n` wide: the largest power of two in it and the rest, itself a power of two or 0
    (192 -> 128 + 64, 96 -> 64 + 32, 128 -> 128 + 0); ValueError for a width with no such split (160, 224)."""
    if block_n < 16:
        raise ValueError(f"BLOCK_N {block_n}: at least 16")
    bn0 = 1 << (block_n.bit_length() - 1)
    bn1 = block_n - bn0
    if bn1 and (bn1 & (bn1 - 1) or bn1 < 16):
        raise ValueError(f"BLOCK_N {block_n} is not a power of two or the sum of two (at least 16): "
                         f"the Gluon GEMM splits a tile into two power-of-two MMAs")
    return bn0, bn1


def block_k(dtype: torch.dtype) -> int:
    """K per pipeline step: 128 bytes of an operand row (the widest shared-memory swizzle)."""
    return 128 // dtype.itemsize


def descriptors(a, b, out, block_m: int, block_n: int) -> tuple:
    """`gemm_kernel`'s five descriptors: A [M, K], B [N, K]'s two row blocks, C [M, N]'s two column blocks (the
    second repeats the first where the tile is one power of two wide)."""
    bn0, bn1 = split_width(block_n)
    bk = block_k(a.dtype)
    b0 = descriptor(b, [bn0, bk])
    c0 = descriptor(out, [block_m, bn0])
    return (descriptor(a, [block_m, bk]), b0, descriptor(b, [bn1, bk]) if bn1 else b0, c0,
            descriptor(out, [block_m, bn1]) if bn1 else c0)


def stages_for(stages: int, K: int, dtype: torch.dtype) -> int:
    """The pipeline stages `gemm_kernel` runs: at most the K steps, so that EARLY loads the next tile's first blocks
    within this tile's loop."""
    return max(1, min(stages, triton.cdiv(K, block_k(dtype))))


def constexprs(kernel: str, K: int, dtype: torch.dtype, cfg) -> tuple:
    """`gemm_kernel`'s compile-time arguments for `kernel` ("bf16" or "a8w8") with GemmConfig `cfg` (BN1, SCALED,
    GROUP_M, STAGES, WARPS, EARLY), shared by the bound launch and compile_only."""
    return (split_width(cfg.BLOCK_SIZE_N)[1], kernel != "bf16", cfg.GROUP_SIZE_M,
            stages_for(cfg.num_stages, K, dtype), cfg.num_warps, True)


def smem_bytes(block_m: int, block_n: int, stages: int, in_bytes: int = 2, out_bytes: int = 2) -> int:
    """Shared memory of one program: the A and B stages (128-byte K steps) and C's tile (barriers aside)."""
    return stages * (block_m + block_n) * 128 + block_m * block_n * out_bytes


def programs_for(tiles: int, sm_count: int) -> int:
    """The persistent grid: a program a SM (a 16-bit tile of these sizes takes most of one SM's shared memory)."""
    return max(1, min(tiles, sm_count))


def gluon_gemm(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None = None,
               b_scale: torch.Tensor | None = None, block_m: int = 128, block_n: int = 128, stages: int = 4,
               group_m: int = 8, num_warps: int = 8, programs: int | None = None, early: bool = True,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = A [M, K] · B [N, K]ᵀ (bf16/fp16 operands, or fp8 with a_scale [M] and b_scale [N] fp32), launched
    through Triton's own launcher (the probes' path)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"gluon_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is Triton "
                           f"{triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    scaled = a_scale is not None
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16 if scaled else a.dtype)
    _, bn1 = split_width(block_n)
    stages = stages_for(stages, K, a.dtype)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if programs is None:
        programs = programs_for(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count)
    s_a = a_scale if scaled else a
    s_b = b_scale if scaled else a
    gemm_kernel[(programs,)](*descriptors(a, b, out, block_m, block_n), s_a, s_b, M, N, K, programs,
                             BN1=bn1, SCALED=scaled, GROUP_M=group_m, STAGES=stages, WARPS=num_warps,
                             EARLY=early, num_warps=num_warps)
    return out
