"""Warp-specialised GEMM in Gluon for Hopper: a loader warp group streams every K block through TMA while the MMA
warps only wait, multiply, rescale and store.

Why. The persistent Gluon and Triton GEMMs issue the next tile's loads from the warps that run the MMAs and the
epilogue: a refill waits behind the wgmma wait and the rescale, and the whole ring waits behind the epilogue. cuBLAS's
Hopper kernels split the roles (RESULTS.md, twenty-fifth session: its nvjet kernels are warp specialised). Here a
worker partition (one warp group, 40 registers a thread; one of its threads issues) walks the program's tiles and
puts each K block into a ring of shared-memory stages, waiting only for a stage's `empty` barrier; the default
partition (the kernel's num_warps, 4 or 8) waits on a stage's `ready` barrier (the TMA's bytes), issues its wgmma,
and once `warpgroup_mma_wait` has retired the previous step's MMA frees that step's stage (one arrival, after Triton's
barrier over the partition's warps). The loader thus runs up to STAGES blocks ahead across tile boundaries, under
the epilogue too. Registers: the kernel launches at `ws_maxnreg` a thread so that all warps fit the SM's 65536; the
loader gives its share back (setmaxnreg) to the MMA warps (232 on 8 warps).

Two forms share the loader: dense (bf16/fp16, or fp8 scaled per token and per channel in the epilogue) and block
scaled (fp8, 1x128 activation scales, 128x128 weight scales, the rescale of block k-1 while block k's MMA runs, as in
`gluon_blockscale`). The op runs every form (GemmConfig GLUON + WARP_SPECIALIZE + PERSISTENT_TMA); the rule table
takes the block-scaled one, the tuner may take any.

Measured (H100, twenty-eighth session, RESULTS.md): block-scaled 128x128 on 8 warps, 5 stages: 0.833 → 0.908x
`_scaled_mm`'s time in geomean on issue 15's three (N, K) from M 1024; 0.78-0.98x the one-kernel Gluon tile's time
at 14 of 15 points from M 256 (1.01x at the 15th). The dense forms ran about even with the one-kernel Gluon GEMM
(H200, untuned: bf16 0.90-1.01x cuBLAS; fp8 per-token 128x128 1.03-1.12x `_scaled_mm` at M 1024 on four of six
(N, K)), so they are the tuner's to take.
Two MMA warp groups in ping-pong (each its own partition, taking alternate tiles, so that one's epilogue runs under
the other's MMAs) compiled but died on the GPU with an unspecified launch failure (Triton 3.6; a single MMA
partition with the same loader runs correctly), so the MMAs stay in the default partition.

K split (`ws_splitk_kernel`, every form): where a grid of tiles leaves most of a wave empty (1536 x 7168 at M 1024:
96 tiles of 128x128 on 132 SMs), each tile's K blocks are cut into 2-4 work units, run split by split so that the
programs in flight read the same K blocks (the twenty-ninth session's stream-K gave every program its own K offset
and lost 1.13-1.6x); the unit that completes a tile adds its fp32 slots in split order. Not yet run on a GPU
(thirtieth session): off in the rule and the tuner.

Hopper only (TMA, wgmma, setmaxnreg).
"""

from __future__ import annotations

import torch
import triton

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER, descriptor

WS_LOADER_WARPS = 4  # the loader's partition: one warp issues, but register counts are set a warp group at a time
WS_LOADER_REGS = 40  # the loader's registers a thread (addresses and counters); the MMA warps get the rest

if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from tritune.kernels.gluon_blockscale import _blockscale_tile, _grid_tiles, _load, _stage_barriers, _tile_coords
    from tritune.kernels.gluon_gemm import _epilogue

    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6's name; 3.7+ renamed it

    @gluon.jit
    def _ws_loader(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, GROUP_M: gl.constexpr):
        """Every K block of the program's tiles, in order, into the ring: step g into stage g % STAGES once the
        consumer of step g - STAGES has freed it."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            for ki in range(k_tiles):
                g = t * k_tiles + ki
                # a fresh barrier counts as having completed the phase before its first: round 0 passes at once
                mbarrier.wait(empty.index(g % STAGES), phase=((g // STAGES) & 1) ^ 1)
                _load(a_desc, b_desc, a_smem, b_smem, ready, g, ki, pid_m * BM, pid_n * BN, True, STAGES)

    @gluon.jit
    def _dense_tile(a_smem, b_smem, ready, empty, g0, k_tiles, acc, STAGES: gl.constexpr):
        """One tile's K blocks from the program's step g0, MMA'd into `acc` from the ring (one wgmma in flight; the
        previous step's stage handed back to the loader as this one's is issued); the dense forms' K loop."""
        for ki in range(k_tiles):
            g = g0 + ki
            s = g % STAGES
            mbarrier.wait(ready.index(s), phase=(g // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=ki > 0)  # step g - 1 retired
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((g0 + k_tiles - 1) % STAGES))
        return acc

    @gluon.jit
    def _ws_dense(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K, programs,
                  GROUP_M: gl.constexpr, SCALED: gl.constexpr):
        """The consumer: each of the program's tiles' K blocks MMA'd from the ring (one wgmma in flight; the previous
        step's stage freed as this one's is issued), then stored (SCALED: times as[m] · bs[n])."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, INSTR_K])
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            acc = _dense_tile(a_smem, b_smem, ready, empty, t * k_tiles, k_tiles,
                              gl.zeros([BM, BN], gl.float32, layout), STAGES)
            tma.store_wait(pendings=0)  # the previous tile's C has left c_smem
            _epilogue(acc, c_desc, c_smem, pid_m * BM, pid_n * BN, as_ptr, bs_ptr, M, N, SCALED)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _ws_blockscale(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K,
                       programs, stride_asm, stride_ask, stride_bsn, stride_bsk, GROUP_M: gl.constexpr):
        """The consumer, block-scaled: `blockscale_kernel`'s K loop (`_blockscale_tile`), each retired block's stage
        handed back to the loader."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        pid = gl.program_id(0)
        BK: gl.constexpr = a_desc.block_type.shape[1]  # 128: one activation scale a row and K block
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            offs_m = off_m + gl.arange(0, BM, layout=row_layout)
            m_ok = offs_m < M
            a_s_ptrs = as_ptr + offs_m * stride_asm
            b_s_ptr = bs_ptr + (off_n // BK) * stride_bsn  # BN ≤ 128: one weight scale a tile
            acc = _blockscale_tile(a_desc, b_desc, a_smem, b_smem, ready, t * k_tiles, k_tiles, off_m, off_n,
                                   a_s_ptrs, m_ok, b_s_ptr, stride_ask, stride_bsk,
                                   gl.zeros([BM, BN], gl.float32, layout), STAGES, empty, True)
            tma.store_wait(pendings=0)
            _epilogue(acc, c_desc, c_smem, off_m, off_n, as_ptr, bs_ptr, M, N, False)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _ws_consumer(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K,
                     programs, stride_asm, stride_ask, stride_bsn, stride_bsk, GROUP_M: gl.constexpr,
                     MODE: gl.constexpr):
        """The consumer: MODE 0 dense, 1 dense scaled per token and channel, 2 block-scaled."""
        if MODE == 2:
            _ws_blockscale(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K,
                           programs, stride_asm, stride_ask, stride_bsn, stride_bsk, GROUP_M)
        else:
            _ws_dense(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K,
                      programs, GROUP_M, MODE == 1)

    @gluon.jit
    def _split_unit(u, tiles, k_tiles, num_pid_m, num_pid_n, SPLITS: gl.constexpr, GROUP_M: gl.constexpr):
        """Work unit u of a split-K grid: (pid_m, pid_n, tile, split, first K block, K blocks). Units run split by
        split (u = split · tiles + tile), so the programs in flight share K blocks, as the unsplit grid's do."""
        split = u // tiles
        tile = u % tiles
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        per = gl.cdiv(k_tiles, SPLITS)
        kb0 = split * per
        return pid_m, pid_n, tile, split, kb0, gl.minimum(k_tiles - kb0, per)

    @gluon.jit
    def _ws_loader_splitk(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, SPLITS: gl.constexpr,
                          GROUP_M: gl.constexpr):
        """`_ws_loader` over the program's work units: each unit's K blocks, in order, into the ring."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        tiles = num_pid_m * num_pid_n
        g = 0
        for i in range(gl.cdiv(tiles * SPLITS - pid, programs)):
            pid_m, pid_n, tile, split, kb0, nk = _split_unit(pid + i * programs, tiles, k_tiles, num_pid_m,
                                                             num_pid_n, SPLITS, GROUP_M)
            for kk in range(nk):
                mbarrier.wait(empty.index(g % STAGES), phase=((g // STAGES) & 1) ^ 1)
                _load(a_desc, b_desc, a_smem, b_smem, ready, g, kb0 + kk, pid_m * BM, pid_n * BN, True, STAGES)
                g += 1

    @gluon.jit
    def _ws_splitk(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, part_ptr, cnt_ptr,
                   M, N, K, programs, stride_asm, stride_ask, stride_bsn, stride_bsk, MODE: gl.constexpr,
                   SPLITS: gl.constexpr, GROUP_M: gl.constexpr):
        """The consumer of a split-K grid: each unit's K blocks (`_blockscale_tile` for MODE 2, else `_dense_tile`),
        its fp32 sum into the tile's slot of `part_ptr`, then the tile's count at `cnt_ptr` raised; the unit that
        raises it to SPLITS adds the tile's slots in split order (one result whichever unit finishes last), zeroes the
        count and stores C (MODE 1: times as[m] · bs[n])."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, INSTR_K])
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        tiles = num_pid_m * num_pid_n
        slot = gl.arange(0, BM, layout=rows)[:, None] * BN + gl.arange(0, BN, layout=cols)[None, :]
        g0 = 0
        for i in range(gl.cdiv(tiles * SPLITS - pid, programs)):
            pid_m, pid_n, tile, split, kb0, nk = _split_unit(pid + i * programs, tiles, k_tiles, num_pid_m,
                                                             num_pid_n, SPLITS, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            offs_m = off_m + gl.arange(0, BM, layout=rows)
            if MODE == 2:
                acc = _blockscale_tile(a_desc, b_desc, a_smem, b_smem, ready, g0, nk, off_m, off_n,
                                       as_ptr + offs_m * stride_asm + kb0 * stride_ask, offs_m < M,
                                       bs_ptr + (off_n // BK) * stride_bsn + kb0 * stride_bsk, stride_ask,
                                       stride_bsk, gl.zeros([BM, BN], gl.float32, layout), STAGES, empty, True)
            else:
                acc = _dense_tile(a_smem, b_smem, ready, empty, g0, nk, gl.zeros([BM, BN], gl.float32, layout),
                                  STAGES)
            g0 += nk
            gl.store(part_ptr + (tile * SPLITS + split) * (BM * BN) + slot, acc)
            _cta_barrier()  # every thread's share stored before the count says so (release: one thread)
            if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                acc = gl.zeros([BM, BN], gl.float32, layout)
                for j in range(SPLITS):  # every split's sum, this one's too, in split order: one result
                    acc = acc + gl.load(part_ptr + (tile * SPLITS + j) * (BM * BN) + slot, cache_modifier=".cg")
                gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
                tma.store_wait(pendings=0)
                _epilogue(acc, c_desc, c_smem, off_m, off_n, as_ptr, bs_ptr, M, N, MODE == 1)
        tma.store_wait(pendings=0)

    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_asm", "stride_ask", "stride_bsn", "stride_bsk", "programs"])
    def ws_splitk_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, part_ptr, cnt_ptr, M, N, K, stride_asm, stride_ask,
                         stride_bsn, stride_bsk, programs, MODE: gl.constexpr, SPLITS: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr):
        """`ws_gemm_kernel` (MODE 0 bf16/fp16, 1 fp8 per token, 2 block-scaled) with each tile's K blocks split
        SPLITS ways: tiles x SPLITS work units over `programs` programs, so a grid of fewer tiles than SMs still
        fills them. part_ptr: fp32 [tiles · SPLITS, BM · BN]; cnt_ptr: int32 [tiles], zero at launch and left zero.
        Every split must hold a K block (`split_k_fits`). Launch with maxnreg `ws_maxnreg(num_warps)`. Grid:
        (programs,)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        if MODE == 2:
            gl.static_assert(BK == 128)
            gl.static_assert(BN <= 128)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready, empty = _stage_barriers(STAGES)
        gl.warp_specialize([
            (_ws_splitk, (a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, part_ptr,
                          cnt_ptr, M, N, K, programs, stride_asm, stride_ask, stride_bsn, stride_bsk, MODE, SPLITS,
                          GROUP_M)),
            (_ws_loader_splitk, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, SPLITS, GROUP_M)),
        ], [4], [LOADER_REGS])

    # no integer argument specialized: a constant 1 would reach the partitions as a Python int, which they refuse
    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_asm", "stride_ask", "stride_bsn", "stride_bsk", "programs"])
    def ws_gemm_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K, stride_asm, stride_ask, stride_bsn,
                       stride_bsk, programs, MODE: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       LOADER_REGS: gl.constexpr):
        """C [M, N] = A [M, K] · B [N, K]ᵀ: MODE 0 bf16/fp16; 1 fp8 times as[m] · bs[n]; 2 fp8 block-scaled (as
        [M, ⌈K/128⌉] with strides stride_asm/ask, bs [⌈N/128⌉, ⌈K/128⌉] with stride_bsn/bsk). A and B through TMA
        in [BM, BK] / [BN, BK] blocks, C out in [BM, BN]. Program p takes output tiles p, p + programs, ... in the
        grouped order. The consumer runs on the kernel's num_warps (4 or 8), the loader on a warp group of its own
        with LOADER_REGS registers a thread; launch with maxnreg (`ws_maxnreg`) so that all fit the SM.
        Grid: (programs,)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready, empty = _stage_barriers(STAGES)
        gl.warp_specialize([
            (_ws_consumer, (a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, M, N, K,
                            programs, stride_asm, stride_ask, stride_bsn, stride_bsk, GROUP_M, MODE)),
            (_ws_loader, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, GROUP_M)),
        ], [4], [LOADER_REGS])  # a whole warp group (WS_LOADER_WARPS): setmaxnreg acts on warp groups


MODES = {"bf16": 0, "a8w8": 1, "a8w8_blockscale": 2}  # the op's GEMM kernels -> ws_gemm_kernel's MODE


def constexprs(kernel: str, cfg) -> tuple:
    """`ws_gemm_kernel`'s compile-time arguments for the op's `kernel` with GemmConfig `cfg` (MODE, GROUP_M, STAGES,
    LOADER_REGS), shared by the op's bound launch and compile_only."""
    return MODES[kernel], cfg.GROUP_SIZE_M, cfg.num_stages, WS_LOADER_REGS


def ws_descriptors(a, b, out, block_m: int, block_n: int) -> tuple:
    """`ws_gemm_kernel`'s descriptors: A [M, K] and B [N, K] in 128-byte K blocks, C [M, N] in output tiles."""
    bk = 128 // a.dtype.itemsize
    return descriptor(a, [block_m, bk]), descriptor(b, [block_n, bk]), descriptor(out, [block_m, block_n])


def ws_maxnreg(num_warps: int) -> int:
    """The registers a thread the kernel launches with: the consumer's num_warps and the loader's warp group share
    the SM's 65536 (a multiple of 8, as setmaxnreg wants; at most 248)."""
    return min(248, 65536 // (32 * (num_warps + WS_LOADER_WARPS)) // 8 * 8)


def split_k_fits(K: int, splits: int, block_k: int = 128) -> bool:
    """Whether `splits` K splits of `block_k`-wide blocks each hold at least one block (the split kernel's
    precondition; its blocks are 128 bytes of an operand row: 128 fp8 or 64 16-bit elements)."""
    k_tiles = triton.cdiv(K, block_k)
    return 1 <= splits <= k_tiles and (splits - 1) * triton.cdiv(k_tiles, splits) < k_tiles


def split_k_workspace(M: int, N: int, block_m: int, block_n: int, splits: int) -> tuple[int, int]:
    """(fp32 elements of the split kernel's partial sums, int32 counts): a slot per tile and split, a count per
    tile. ValueError where a slot's offset would pass 32 bits."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if tiles * splits * block_m * block_n >= 2**31:
        raise ValueError(f"split-K partial sums of {tiles} tiles x {splits} splits pass 32-bit offsets")
    return tiles * splits * block_m * block_n, tiles


def splitk_constexprs(kernel: str, cfg) -> tuple:
    """`ws_splitk_kernel`'s compile-time arguments for the op's `kernel` (MODE, SPLITS, GROUP_M, STAGES,
    LOADER_REGS)."""
    return MODES[kernel], cfg.NUM_KSPLIT, cfg.GROUP_SIZE_M, cfg.num_stages, WS_LOADER_REGS


def ws_gemm(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None = None,
            b_scale: torch.Tensor | None = None, block_scaled: bool = False, block_m: int = 128,
            block_n: int = 128, stages: int = 4, group_m: int = 8, num_warps: int = 8,
            loader_regs: int = WS_LOADER_REGS, programs: int | None = None, splits: int = 1,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = A [M, K] · B [N, K]ᵀ: bf16/fp16 operands; fp8 with a_scale [M] and b_scale [N] fp32; or
    (block_scaled) fp8 with a_scale [M, ⌈K/128⌉] and b_scale [⌈N/128⌉, ⌈K/128⌉]; K split `splits` ways
    (`ws_splitk_kernel`) when above 1. Launched through Triton's own launcher (the probes' path)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"ws_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is Triton "
                           f"{triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    scaled = a_scale is not None
    if block_scaled and not scaled:
        raise ValueError("ws_gemm: block_scaled needs a_scale and b_scale")
    if splits != 1 and not split_k_fits(K, splits, 128 // a.element_size()):
        raise ValueError(f"ws_gemm: splits={splits} leaves a split without a K block (K={K})")
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16 if scaled else a.dtype)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if programs is None:
        programs = min(tiles * splits, torch.cuda.get_device_properties(a.device).multi_processor_count)
    s_a = a_scale if scaled else a
    s_b = b_scale if scaled else a
    strides = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1)) if block_scaled else (
        0, 0, 0, 0)
    if splits > 1:
        part_n, cnt_n = split_k_workspace(M, N, block_m, block_n, splits)
        part = torch.empty(part_n, device=a.device, dtype=torch.float32)
        counts = torch.zeros(cnt_n, device=a.device, dtype=torch.int32)
        ws_splitk_kernel[(programs,)](*ws_descriptors(a, b, out, block_m, block_n), s_a, s_b, part, counts, M, N, K,
                                      *strides, programs, MODE=2 if block_scaled else int(scaled), SPLITS=splits,
                                      GROUP_M=group_m, STAGES=stages, LOADER_REGS=loader_regs, num_warps=num_warps,
                                      maxnreg=ws_maxnreg(num_warps))
        return out
    ws_gemm_kernel[(programs,)](*ws_descriptors(a, b, out, block_m, block_n), s_a, s_b, M, N, K, *strides, programs,
                                MODE=2 if block_scaled else int(scaled), GROUP_M=group_m, STAGES=stages,
                                LOADER_REGS=loader_regs, num_warps=num_warps, maxnreg=ws_maxnreg(num_warps))
    return out
