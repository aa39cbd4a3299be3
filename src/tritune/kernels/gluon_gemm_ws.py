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

    from tritune.kernels.gluon_blockscale import _blockscale_tile, _grid_tiles, _load, _tile_coords, _tma_load
    from tritune.kernels.gluon_gemm import _epilogue

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
            g0 = t * k_tiles
            acc = gl.zeros([BM, BN], gl.float32, layout)
            for ki in range(k_tiles):
                g = g0 + ki
                s = g % STAGES
                mbarrier.wait(ready.index(s), phase=(g // STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=ki > 0)  # step g - 1 retired
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((g0 + k_tiles - 1) % STAGES))
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
    def _split_offsets(off_n, BN0: gl.constexpr, BN1: gl.constexpr):
        """`split_offsets` in the kernel: where a split tile's BN0 and BN1 columns start."""
        swap = (off_n % 128) + BN0 > 128
        return gl.where(swap, off_n + BN1, off_n), gl.where(swap, off_n, off_n + BN0)

    @gluon.jit
    def _ws_loader_split(a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, empty, M, N, K, programs,
                         GROUP_M: gl.constexpr):
        """`_ws_loader` for a split tile: each K block's A rows and B's two row parts (`_split_offsets`) into the
        ring."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN0: gl.constexpr = b0_desc.block_type.shape[0]
        BN1: gl.constexpr = b1_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b0_desc.block_type.nbytes + b1_desc.block_type.nbytes
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN0 + BN1, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            off_b0, off_b1 = _split_offsets(pid_n * (BN0 + BN1), BN0, BN1)
            for ki in range(k_tiles):
                g = t * k_tiles + ki
                s = g % STAGES
                mbarrier.wait(empty.index(s), phase=((g // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [pid_m * BM, ki * BK], ready.index(s), a_smem.index(s))
                _tma_load(b0_desc, [off_b0, ki * BK], ready.index(s), b0_smem.index(s))
                _tma_load(b1_desc, [off_b1, ki * BK], ready.index(s), b1_smem.index(s))

    @gluon.jit
    def _issue_split(a_smem, b0_smem, b1_smem, ready, r0, r1, k, STAGES: gl.constexpr):
        """Block k's two MMAs (one a column part) from zero into `r0` / `r1`'s registers, once its stage landed."""
        s = k % STAGES
        mbarrier.wait(ready.index(s), phase=(k // STAGES) & 1)
        p = warpgroup_mma(a_smem.index(s), b0_smem.index(s).permute((1, 0)), r0, use_acc=False, is_async=True)
        q = warpgroup_mma(a_smem.index(s), b1_smem.index(s).permute((1, 0)), r1, use_acc=False, is_async=True)
        return p, q

    @gluon.jit
    def _scale_split(a_s_ptrs, m_ok, b0_s_ptr, b1_s_ptr, b0_ok, b1_ok, k, stride_ask, stride_bsk, row1: gl.constexpr):
        """Block k's rescale of each row of the two parts: the row's activation scale times each part's weight scale
        (0 for a part wholly past N); the second in `row1`, its accumulator's row layout."""
        a_s = gl.load(a_s_ptrs + k * stride_ask, mask=m_ok, other=0.0)
        s0 = a_s * gl.load(b0_s_ptr + k * stride_bsk, mask=b0_ok, other=0.0)
        s1 = a_s * gl.load(b1_s_ptr + k * stride_bsk, mask=b1_ok, other=0.0)
        return s0, gl.convert_layout(s1, row1)

    @gluon.jit
    def _blockscale_split_tile(a_smem, b0_smem, b1_smem, ready, empty, g0, k_tiles, a_s_ptrs, m_ok, b0_s_ptr,
                               b1_s_ptr, b0_ok, b1_ok, stride_ask, stride_bsk, acc0, acc1, STAGES: gl.constexpr):
        """`_blockscale_tile` (WS) on a split tile: two MMAs a K block, block k-1's pair rescaled while block k's
        runs, each retired block's stage handed back to the loader."""
        row1: gl.constexpr = gl.SliceLayout(1, acc1.type.layout)
        p0, q0 = _issue_split(a_smem, b0_smem, b1_smem, ready, acc0, acc1, g0, STAGES)
        s0, t0 = _scale_split(a_s_ptrs, m_ok, b0_s_ptr, b1_s_ptr, b0_ok, b1_ok, 0, stride_ask, stride_bsk, row1)
        for ki in range(1, k_tiles - 1, 2):
            p1, q1 = _issue_split(a_smem, b0_smem, b1_smem, ready, acc0 * 0.0, acc1 * 0.0, g0 + ki, STAGES)
            s1, t1 = _scale_split(a_s_ptrs, m_ok, b0_s_ptr, b1_s_ptr, b0_ok, b1_ok, ki, stride_ask, stride_bsk, row1)
            d0, d1 = warpgroup_mma_wait(num_outstanding=2, deps=(p0, q0))  # block ki-1
            acc0 = acc0 + d0 * s0[:, None]
            acc1 = acc1 + d1 * t0[:, None]
            mbarrier.arrive(empty.index((g0 + ki - 1) % STAGES))
            p0, q0 = _issue_split(a_smem, b0_smem, b1_smem, ready, acc0 * 0.0, acc1 * 0.0, g0 + ki + 1, STAGES)
            s0, t0 = _scale_split(a_s_ptrs, m_ok, b0_s_ptr, b1_s_ptr, b0_ok, b1_ok, ki + 1, stride_ask, stride_bsk,
                                  row1)
            d0, d1 = warpgroup_mma_wait(num_outstanding=2, deps=(p1, q1))  # block ki
            acc0 = acc0 + d0 * s1[:, None]
            acc1 = acc1 + d1 * t1[:, None]
            mbarrier.arrive(empty.index((g0 + ki) % STAGES))
        if k_tiles % 2 == 0:  # one block left after the pairs: k_tiles - 1
            p1, q1 = _issue_split(a_smem, b0_smem, b1_smem, ready, acc0 * 0.0, acc1 * 0.0, g0 + k_tiles - 1, STAGES)
            s1, t1 = _scale_split(a_s_ptrs, m_ok, b0_s_ptr, b1_s_ptr, b0_ok, b1_ok, k_tiles - 1, stride_ask,
                                  stride_bsk, row1)
            d0, d1 = warpgroup_mma_wait(num_outstanding=2, deps=(p0, q0))
            acc0 = acc0 + d0 * s0[:, None]
            acc1 = acc1 + d1 * t0[:, None]
            mbarrier.arrive(empty.index((g0 + k_tiles - 2) % STAGES))
            d0, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1, q1))
            acc0 = acc0 + d0 * s1[:, None]
            acc1 = acc1 + d1 * t1[:, None]
        else:
            d0, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, q0))
            acc0 = acc0 + d0 * s0[:, None]
            acc1 = acc1 + d1 * t0[:, None]
        mbarrier.arrive(empty.index((g0 + k_tiles - 1) % STAGES))
        return acc0, acc1

    @gluon.jit
    def _ws_blockscale_split(a_desc, c0_desc, c1_desc, a_smem, b0_smem, b1_smem, c0_smem, c1_smem, ready, empty,
                             as_ptr, bs_ptr, M, N, K, programs, stride_asm, stride_ask, stride_bsn, stride_bsk,
                             GROUP_M: gl.constexpr):
        """The consumer of a split tile: `_blockscale_split_tile` per tile, each part stored through its own C
        descriptor."""
        BM: gl.constexpr = c0_desc.block_type.shape[0]
        BN0: gl.constexpr = c0_desc.block_type.shape[1]
        BN1: gl.constexpr = c1_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]  # 128: one scale a row (and weight block) and K block
        STAGES: gl.constexpr = a_smem.type.shape[0]
        layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                          instr_shape=[16, BN0, 32])
        layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                          instr_shape=[16, BN1, 32])
        pid = gl.program_id(0)
        num_pid_m, num_pid_n, k_tiles, my_tiles = _grid_tiles(M, N, K, BM, BN0 + BN1, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_b0, off_b1 = _split_offsets(pid_n * (BN0 + BN1), BN0, BN1)
            offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout0))
            acc0, acc1 = _blockscale_split_tile(
                a_smem, b0_smem, b1_smem, ready, empty, t * k_tiles, k_tiles, as_ptr + offs_m * stride_asm,
                offs_m < M, bs_ptr + (off_b0 // BK) * stride_bsn, bs_ptr + (off_b1 // BK) * stride_bsn, off_b0 < N,
                off_b1 < N, stride_ask, stride_bsk, gl.zeros([BM, BN0], gl.float32, layout0),
                gl.zeros([BM, BN1], gl.float32, layout1), STAGES)
            tma.store_wait(pendings=0)  # the previous tile's parts have left shared memory
            _epilogue(acc0, c0_desc, c0_smem, off_m, off_b0, as_ptr, bs_ptr, M, N, False)
            _epilogue(acc1, c1_desc, c1_smem, off_m, off_b1, as_ptr, bs_ptr, M, N, False)
        tma.store_wait(pendings=0)

    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_asm", "stride_ask", "stride_bsn", "stride_bsk", "programs"])
    def ws_blockscale_split_kernel(a_desc, b0_desc, b1_desc, c0_desc, c1_desc, as_ptr, bs_ptr, M, N, K, stride_asm,
                                   stride_ask, stride_bsn, stride_bsk, programs, GROUP_M: gl.constexpr,
                                   STAGES: gl.constexpr, LOADER_REGS: gl.constexpr):
        """Block-scaled C [M, N] = A [M, K] · B [N, K]ᵀ (fp8, scales as `ws_gemm_kernel`'s MODE 2) in tiles
        BN0 + BN1 wide (96 = 64 + 32): two MMAs a K block on one A tile, each column part placed inside one
        128-column weight-scale block (`split_offsets`), so its rescale keeps one weight scale a K block. Warp
        specialised as `ws_gemm_kernel`. Grid: (programs,)."""
        BM: gl.constexpr = c0_desc.block_type.shape[0]
        BN0: gl.constexpr = c0_desc.block_type.shape[1]
        BN1: gl.constexpr = c1_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN0 + BN1 <= 128)  # each part within one weight-scale block: see split_offsets
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b0_smem = gl.allocate_shared_memory(b0_desc.dtype, [STAGES, BN0, BK], b0_desc.layout)
        b1_smem = gl.allocate_shared_memory(b1_desc.dtype, [STAGES, BN1, BK], b1_desc.layout)
        c0_smem = gl.allocate_shared_memory(c0_desc.dtype, [BM, BN0], c0_desc.layout)
        c1_smem = gl.allocate_shared_memory(c1_desc.dtype, [BM, BN1], c1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_ws_blockscale_split, (a_desc, c0_desc, c1_desc, a_smem, b0_smem, b1_smem, c0_smem, c1_smem, ready,
                                    empty, as_ptr, bs_ptr, M, N, K, programs, stride_asm, stride_ask, stride_bsn,
                                    stride_bsk, GROUP_M)),
            (_ws_loader_split, (a_desc, b0_desc, b1_desc, a_smem, b0_smem, b1_smem, ready, empty, M, N, K, programs,
                                GROUP_M)),
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
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
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


def split_constexprs(cfg) -> tuple:
    """`ws_blockscale_split_kernel`'s compile-time arguments (GROUP_M, STAGES, LOADER_REGS) for GemmConfig `cfg`."""
    return cfg.GROUP_SIZE_M, cfg.num_stages, WS_LOADER_REGS


def ws_descriptors(a, b, out, block_m: int, block_n: int) -> tuple:
    """`ws_gemm_kernel`'s descriptors: A [M, K] and B [N, K] in 128-byte K blocks, C [M, N] in output tiles."""
    bk = 128 // a.dtype.itemsize
    return descriptor(a, [block_m, bk]), descriptor(b, [block_n, bk]), descriptor(out, [block_m, block_n])


def split_offsets(off_n: int, bn0: int, bn1: int) -> tuple[int, int]:
    """Where the BN0 and BN1 columns of a split block-scaled tile at column off_n start: BN0 first, unless its
    columns would cross a 128-column weight-scale block, then BN1 first (96 = 64 + 32: a tile at 96 j starts 0, 32,
    64 or 96 into a block; at 96 the 32 go first). Each part then has one weight scale a K block, as the
    power-of-two tiles do. The kernel's `_split_offsets` is this rule."""
    swap = off_n % 128 + bn0 > 128
    return (off_n + bn1, off_n) if swap else (off_n, off_n + bn0)


def split_descriptors(a, b, out, block_m: int, block_n: int) -> tuple:
    """`ws_blockscale_split_kernel`'s five descriptors: A [M, K] and B [N, K]'s two row parts in 128-wide K blocks,
    C [M, N]'s two column parts (`gluon_gemm.split_width`: 96 -> 64 + 32)."""
    from tritune.kernels.gluon_gemm import split_width

    bn0, bn1 = split_width(block_n)
    if not bn1 or block_n > 128:
        raise ValueError(f"a split block-scaled tile is two powers of two within 128 columns, not {block_n}")
    bk = 128 // a.dtype.itemsize
    return (descriptor(a, [block_m, bk]), descriptor(b, [bn0, bk]), descriptor(b, [bn1, bk]),
            descriptor(out, [block_m, bn0]), descriptor(out, [block_m, bn1]))


def ws_maxnreg(num_warps: int) -> int:
    """The registers a thread the kernel launches with: the consumer's num_warps and the loader's warp group share
    the SM's 65536 (a multiple of 8, as setmaxnreg wants; at most 248)."""
    return min(248, 65536 // (32 * (num_warps + WS_LOADER_WARPS)) // 8 * 8)


def ws_gemm(a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor | None = None,
            b_scale: torch.Tensor | None = None, block_scaled: bool = False, block_m: int = 128,
            block_n: int = 128, stages: int = 4, group_m: int = 8, num_warps: int = 8,
            loader_regs: int = WS_LOADER_REGS, programs: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] = A [M, K] · B [N, K]ᵀ: bf16/fp16 operands; fp8 with a_scale [M] and b_scale [N] fp32; or
    (block_scaled) fp8 with a_scale [M, ⌈K/128⌉] and b_scale [⌈N/128⌉, ⌈K/128⌉]. Launched through Triton's own
    launcher (the probes' path)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"ws_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is Triton "
                           f"{triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    scaled = a_scale is not None
    if block_scaled and not scaled:
        raise ValueError("ws_gemm: block_scaled needs a_scale and b_scale")
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16 if scaled else a.dtype)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if programs is None:
        programs = min(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count)
    s_a = a_scale if scaled else a
    s_b = b_scale if scaled else a
    strides = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1)) if block_scaled else (
        0, 0, 0, 0)
    if block_n & (block_n - 1):  # 96: two column parts, block-scaled only
        if not block_scaled:
            raise ValueError(f"ws_gemm: a tile {block_n} wide is the block-scaled kernel's only")
        ws_blockscale_split_kernel[(programs,)](*split_descriptors(a, b, out, block_m, block_n), s_a, s_b, M, N, K,
                                                *strides, programs, GROUP_M=group_m, STAGES=stages,
                                                LOADER_REGS=loader_regs, num_warps=num_warps,
                                                maxnreg=ws_maxnreg(num_warps))
        return out
    ws_gemm_kernel[(programs,)](*ws_descriptors(a, b, out, block_m, block_n), s_a, s_b, M, N, K, *strides, programs,
                                MODE=2 if block_scaled else int(scaled), GROUP_M=group_m, STAGES=stages,
                                LOADER_REGS=loader_regs, num_warps=num_warps, maxnreg=ws_maxnreg(num_warps))
    return out
