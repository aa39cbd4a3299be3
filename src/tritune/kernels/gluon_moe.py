"""The fused MoE's two GEMM stages with per_1x128 fp8 in Gluon: the schedule of `kernels/gluon_blockscale.py` (block
k's MMA into a fresh partial while block k-1's is rescaled into the sum) on the MoE's sorted rows.

Why. Each 128-deep K block of a per_1x128 GEMM ends with a rescale; in `tl.dot` form it retires the MMA every block
(the Triton stage kernels). Here the rescale runs while the next block's MMA does. Measured on the H100 (RESULTS.md,
twenty-fifth and twenty-sixth sessions) against the op's Triton stage kernels: stage 1 1.02-1.35x faster at 1024-8192
tokens on three shapes, stage 2 1.14-1.19x at 4096-8192.

- Stage 1 (`moe_stage1_kernel`): A is the activation rows gathered into the sort's order (the op's GATHER_A copy),
  read through TMA like w1's gate and up tiles, or (GATHER) each pair's token row copied by the kernel itself with
  cp.async; two MMA groups a K block (gate, up); silu(gate) · up leaves through TMA into the intermediate in the
  sort's order (SORTED_INTER 2). One 128-wide MMA over the gate and up rows instead (a kernel of the twenty-sixth
  session) measured 1.00-1.04x its time and was removed.
- `moe_stage1_q_kernel` (stage 1 with QUANT_OUT 1): the same for the 128 columns of one scale group (two 64-wide
  tiles in turn), quantized in the epilogue to fp8 with a scale a row, in place of the op's quantization launch
  (bit-equal to it: the bf16-rounded values, the same scale and clamp). Compiled for sm_90; not yet run on a GPU.
- `moe_stage1_persistent_kernel` (GLUON 1 with PERSISTENT 1 on stage 1): the same from a program a SM; measured no
  faster (0.98-1.04x the whole op with the copied rows, 1.06-1.13x gathering its own): in the tuner's pairs only.
- Stage 2 (`moe_stage2_kernel`): A is that intermediate quantized (per 1x128), through TMA; each row goes back to its
  (token, slot) pair with its routing weight, for the op's top-k sum.
- `moe_stage2_persistent_kernel` (GLUON 1 with PERSISTENT 1): stage 2 from a program a SM walking the filled
  blocks' tiles, the next tile's loads under this one's epilogue (0.95-0.99x the one-tile kernel alone, 0.97-1.00x
  the whole op's time).
- The warp-specialised forms (WARP_SPEC 1, persistent; kernels/gluon_gemm_ws.py's scheme): a loader warp group
  streams every K block of the program's tiles while the MMA warps multiply, rescale and store.
  `moe_stage1_ws_kernel` (rows copied, or gathered by the loader's cp.async) and `moe_stage2_ws_kernel` are the
  rule's pair since the twenty-ninth session. Stage 2's rows leave by 16-byte stores (`_stage2_store`).

Both: BLOCK_K 128, BLOCK_N at most 128 (one weight scale a tile and K block), BLOCK_M 16 rows a warp; programs past
the sort's blocks return. Hopper only (TMA, wgmma); no interpreter.
"""

from __future__ import annotations

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from tritune.kernels.gluon_blockscale import (
        _blockscale_tile,
        _load,
        _stage_barriers,
        _tile_coords,
        _tma_load,
        _tma_store,
    )

    # cp.async into shared memory: `async_copy_global_to_shared` in Triton 3.6, `async_load` later (the old name
    # raises there)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g, k, off_m, gate_row, up_row, pred,
               STAGES: gl.constexpr, GATHER: gl.constexpr, a_ptr, a_rows, a_ok, a_cols, K):
        """The program's K step g (K block k of the tile at off_m) of A's rows and w1's gate and up rows into stage
        g % STAGES, where `pred`. A through TMA, or (GATHER) each row from its token's row of a_ptr (`a_rows`: element
        offsets, `a_ok`: a real pair) by cp.async, every thread's copies arriving on the stage's barrier when they
        land."""
        s = g % STAGES
        if GATHER:
            mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes, pred=pred)
        else:
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
            _tma_load(a_desc, [off_m, k * 128], ready.index(s), a_smem.index(s), pred=pred)
        _tma_load(w_desc, [gate_row, k * 128], ready.index(s), g_smem.index(s), pred=pred)
        _tma_load(w_desc, [up_row, k * 128], ready.index(s), u_smem.index(s), pred=pred)
        if GATHER:
            if pred:
                cols = k * 128 + a_cols
                _cp_async(a_smem.index(s), a_ptr + a_rows[:, None] + cols[None, :],
                          mask=a_ok[:, None] & (cols < K)[None, :])
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _issue2(a_smem, g_smem, u_smem, ready, regs_g, regs_u, g, STAGES: gl.constexpr, GATHER: gl.constexpr):
        """Step g's gate and up MMAs from zero (into the registers of `regs_*`, unread), once its stage landed (rows
        copied by cp.async made visible to the MMA's proxy first)."""
        s = g % STAGES
        mbarrier.wait(ready.index(s), phase=(g // STAGES) & 1)
        if GATHER:
            fence_async_shared()
        pg = warpgroup_mma(a_smem.index(s), g_smem.index(s).permute((1, 0)), regs_g, use_acc=False, is_async=True)
        pu = warpgroup_mma(a_smem.index(s), u_smem.index(s).permute((1, 0)), regs_u, use_acc=False, is_async=True)
        return pg, pu

    @gluon.jit
    def _gather_rows(sorted_ids_ptr, off_m, num_pairs, stride_am, BM: gl.constexpr, BK: gl.constexpr,
                     WARPS: gl.constexpr, TOPK: gl.constexpr):
        """For GATHER: the block's rows as element offsets of their tokens' rows, whether each is a real pair, and
        the K block's columns, in the copy layout (each warp 16 whole rows, so a warp group copies the 64 its own MMA
        reads; 16 bytes a cp.async)."""
        copy_layout: gl.constexpr = gl.BlockedLayout([BM // (4 * WARPS), 16], [4, 8], [WARPS, 1], [1, 0])
        ids = gl.load(sorted_ids_ptr + off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, copy_layout)))
        ok = ids < num_pairs
        return gl.where(ok, ids // TOPK, 0) * stride_am, ok, gl.arange(0, BK, layout=gl.SliceLayout(0, copy_layout))

    @gluon.jit
    def _init_ready(ready, STAGES: gl.constexpr, GATHER: gl.constexpr, WARPS: gl.constexpr):
        for i in gl.static_range(STAGES):
            if GATHER:  # the weights' expect-arrive and every thread's cp.async arrive
                mbarrier.init(ready.index(i), count=1 + 32 * WARPS)
            else:
                mbarrier.init(ready.index(i), count=1)

    @gluon.jit
    def _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g0, k_tiles, off_m, gate_row, up_row, a_s_ptrs,
                     wg_s_ptr, wu_s_ptr, stride_ask, stride_wsk, acc_g, acc_u, STAGES: gl.constexpr,
                     GATHER: gl.constexpr, a_ptr, a_rows, a_ok, a_cols, K, empty=None, WS: gl.constexpr = False):
        """One stage-1 tile's K loop from the program's step g0 (its first STAGES blocks already loading; later ones
        loaded into stages as they free up): (Σ gate partials · scale, Σ up partials · scale), added to the zero
        `acc_g`, `acc_u`. Two MMA groups a K block (gate, up): waiting for at most two outstanding retires the
        previous block's pair while this block's pair runs. The partials alternate and take acc * 0 as their unread
        accumulators, as in the dense kernel, so no register copy touches an in-flight partial. WS: a loader
        partition fills the stages; a retired block's stage is handed back through its `empty` barrier instead."""
        g0_, u0 = _issue2(a_smem, g_smem, u_smem, ready, acc_g, acc_u, g0, STAGES, GATHER)
        a0 = gl.load(a_s_ptrs)
        sg0 = a0 * gl.load(wg_s_ptr)
        su0 = a0 * gl.load(wu_s_ptr)
        for ki in range(1, k_tiles - 1, 2):
            g1_, u1 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, g0 + ki, STAGES, GATHER)
            a1 = gl.load(a_s_ptrs + ki * stride_ask)
            sg1 = a1 * gl.load(wg_s_ptr + ki * stride_wsk)
            su1 = a1 * gl.load(wu_s_ptr + ki * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g0_, u0))  # block ki-1's pair
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
            j = ki - 1 + STAGES  # into block ki-1's stage, free now
            if WS:
                mbarrier.arrive(empty.index((g0 + ki - 1) % STAGES))
            else:
                _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g0 + j, j, off_m, gate_row, up_row, j < k_tiles,
                       STAGES, GATHER, a_ptr, a_rows, a_ok, a_cols, K)
            g0_, u0 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, g0 + ki + 1, STAGES, GATHER)
            a0 = gl.load(a_s_ptrs + (ki + 1) * stride_ask)
            sg0 = a0 * gl.load(wg_s_ptr + (ki + 1) * stride_wsk)
            su0 = a0 * gl.load(wu_s_ptr + (ki + 1) * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g1_, u1))  # block ki's pair
            acc_g = acc_g + dg * sg1[:, None]
            acc_u = acc_u + du * su1[:, None]
            if WS:
                mbarrier.arrive(empty.index((g0 + ki) % STAGES))
            else:
                _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g0 + j + 1, j + 1, off_m, gate_row, up_row,
                       j + 1 < k_tiles, STAGES, GATHER, a_ptr, a_rows, a_ok, a_cols, K)
        if k_tiles % 2 == 0:
            g1_, u1 = _issue2(a_smem, g_smem, u_smem, ready, acc_g * 0.0, acc_u * 0.0, g0 + k_tiles - 1, STAGES,
                              GATHER)
            a1 = gl.load(a_s_ptrs + (k_tiles - 1) * stride_ask)
            sg1 = a1 * gl.load(wg_s_ptr + (k_tiles - 1) * stride_wsk)
            su1 = a1 * gl.load(wu_s_ptr + (k_tiles - 1) * stride_wsk)
            dg, du = warpgroup_mma_wait(num_outstanding=2, deps=(g0_, u0))
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
            if WS:
                mbarrier.arrive(empty.index((g0 + k_tiles - 2) % STAGES))
            dg, du = warpgroup_mma_wait(num_outstanding=0, deps=(g1_, u1))
            acc_g = acc_g + dg * sg1[:, None]
            acc_u = acc_u + du * su1[:, None]
        else:
            dg, du = warpgroup_mma_wait(num_outstanding=0, deps=(g0_, u0))
            acc_g = acc_g + dg * sg0[:, None]
            acc_u = acc_u + du * su0[:, None]
        if WS:
            mbarrier.arrive(empty.index((g0 + k_tiles - 1) % STAGES))
        return acc_g, acc_u

    @gluon.jit
    def _filled_tiles(num_post_ptr, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, programs):
        """A persistent stage kernel's counts: (the blocks the sort filled, its padded count being a multiple of BM;
        tiles across N; K blocks; the tiles of this program, which takes tiles p, p + programs, ...)."""
        used_m = gl.load(num_post_ptr) // BM
        num_pid_n = gl.cdiv(N, BN)
        return used_m, num_pid_n, gl.cdiv(K, BK), gl.cdiv(used_m * num_pid_n - gl.program_id(0), programs)

    @gluon.jit
    def _a_scales(as_ptr, sorted_ids_ptr, rows, num_pairs, stride_asm, GATHER: gl.constexpr, TOPK: gl.constexpr):
        """The rows' activation-scale pointers: by row of the gathered copy, or (GATHER) by token."""
        if GATHER:
            ids = gl.load(sorted_ids_ptr + rows)
            return as_ptr + gl.where(ids < num_pairs, ids // TOPK, 0) * stride_asm
        return as_ptr + rows * stride_asm

    @gluon.jit
    def _stage1_buffers(a_desc, w_desc, STAGES: gl.constexpr, GATHER: gl.constexpr, WARPS: gl.constexpr):
        """Stage 1's STAGES-deep A, gate and up tiles and their ready barriers (initialized)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        g_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        u_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        _init_ready(ready, STAGES, GATHER, WARPS)
        return a_smem, g_smem, u_smem, ready

    @gluon.jit
    def _w1_scales(ws_ptr, expert, off_n, N_INTER, stride_wse, stride_wsn):
        """The weight-scale pointers (K block 0) of expert `expert`'s gate rows and up rows from column off_n."""
        base = ws_ptr + expert * stride_wse
        return base + (off_n // 128) * stride_wsn, base + ((N_INTER + off_n) // 128) * stride_wsn

    @gluon.jit
    def _silu(acc_g, acc_u):
        """silu(gate) · up."""
        return acc_g / (1.0 + gl.exp(-acc_g)) * acc_u

    @gluon.jit
    def moe_stage1_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, expert_ids_ptr, num_post_ptr, a_ptr, sorted_ids_ptr,
                          N_INTER, K, max_blocks, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, num_pairs,
                          stride_am, GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                          GATHER: gl.constexpr, TOPK: gl.constexpr):
        """inter[row, n] = silu(Σ_k A_k[row]·G_kᵀ · s) · (Σ_k A_k[row]·U_kᵀ · s) for the sorted rows of a block whose
        expert is e (G = w1[e, n], U = w1[e, I + n] with I = N_INTER, s = a_s[row, k] · w_s[e, n // 128, k]).
        A: a_desc's rows in the sort's order (the op's GATHER_A copy, with a_s beside it), or (GATHER) each sorted
        pair's token row of a_ptr [tokens, K] (row stride stride_am; a_desc then only gives the tile and its shared
        layout, a_s is by token) copied by cp.async. Grid: (max_blocks · ⌈I/BN⌉,); programs past the sort's blocks
        return."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)
        pid_m, pid_n = _tile_coords(gl.program_id(0), max_blocks, gl.cdiv(N_INTER, BN), GROUP_M)
        if pid_m * BM >= gl.load(num_post_ptr):
            return
        expert = gl.load(expert_ids_ptr + pid_m)
        off_m = pid_m * BM
        off_n = pid_n * BN
        gate_row = expert * 2 * N_INTER + off_n
        up_row = gate_row + N_INTER
        k_tiles = gl.cdiv(K, BK)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_smem, g_smem, u_smem, ready = _stage1_buffers(a_desc, w_desc, STAGES, GATHER, WARPS)
        a_rows, a_ok, a_cols = _gather_rows(sorted_ids_ptr, off_m, num_pairs, stride_am, BM, BK, WARPS, TOPK)
        for i in gl.static_range(STAGES):
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, i, i, off_m, gate_row, up_row, i < k_tiles, STAGES,
                   GATHER, a_ptr, a_rows, a_ok, a_cols, K)

        a_s_ptrs = _a_scales(as_ptr, sorted_ids_ptr, off_m + gl.arange(0, BM, layout=row_layout), num_pairs,
                             stride_asm, GATHER, TOPK)
        wg_s_ptr, wu_s_ptr = _w1_scales(ws_ptr, expert, off_n, N_INTER, stride_wse, stride_wsn)
        acc_g, acc_u = _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, 0, k_tiles, off_m, gate_row,
                                    up_row, a_s_ptrs, wg_s_ptr, wu_s_ptr, stride_ask, stride_wsk,
                                    gl.zeros([BM, BN], gl.float32, mma_layout),
                                    gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, GATHER, a_ptr, a_rows, a_ok,
                                    a_cols, K)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        h = _silu(acc_g, acc_u)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        c_smem.store(h.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _silu_mul(acc_g, acc_u, FP16: gl.constexpr):
        """silu(gate) · up, rounded to the 16-bit type the intermediate would hold (bf16, or fp16 for fp16
        activations), so that quantizing it here matches the op's quantization launch bit for bit."""
        h = _silu(acc_g, acc_u)
        if FP16:
            return h.to(gl.float16).to(gl.float32)
        return h.to(gl.bfloat16).to(gl.float32)

    @gluon.jit
    def moe_stage1_q_kernel(a_desc, w_desc, q_desc, as_ptr, ws_ptr, expert_ids_ptr, num_post_ptr, a_ptr,
                            sorted_ids_ptr, qs_ptr, N_INTER, K, max_blocks, stride_asm, stride_ask, stride_wse,
                            stride_wsn, stride_wsk, num_pairs, stride_am, stride_qs, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, WARPS: gl.constexpr, GATHER: gl.constexpr, TOPK: gl.constexpr,
                            FP16: gl.constexpr):
        """`moe_stage1_kernel`'s silu(gate) · up quantized in its epilogue (QUANT_OUT): a program takes the 128
        columns of one scale group as two 64-wide tiles one after the other (the second's first K blocks loading
        under the first's epilogue, the first's rows waiting in shared memory), then writes them in fp8 through TMA
        (q_desc: [rows, I]) with one fp32 scale a row (qs_ptr: [rows, I/128], row stride stride_qs): what the op's
        quantization launch writes from the 16-bit intermediate (fp16 where FP16, else bf16), which it replaces.
        w_desc's block is [64, 128].
        Grid: (max_blocks · I/128,); programs past the sort's blocks return."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN == 64)
        pid_m, pid_q = _tile_coords(gl.program_id(0), max_blocks, gl.cdiv(N_INTER, 2 * BN), GROUP_M)
        if pid_m * BM >= gl.load(num_post_ptr):
            return
        expert = gl.load(expert_ids_ptr + pid_m)
        off_m = pid_m * BM
        off_n = pid_q * 2 * BN
        gate_row = expert * 2 * N_INTER + off_n
        up_row = gate_row + N_INTER
        k_tiles = gl.cdiv(K, BK)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_smem, g_smem, u_smem, ready = _stage1_buffers(a_desc, w_desc, STAGES, GATHER, WARPS)
        h_smem = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        a_rows, a_ok, a_cols = _gather_rows(sorted_ids_ptr, off_m, num_pairs, stride_am, BM, BK, WARPS, TOPK)
        for i in gl.static_range(STAGES):
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, i, i, off_m, gate_row, up_row, i < k_tiles, STAGES,
                   GATHER, a_ptr, a_rows, a_ok, a_cols, K)

        rows = off_m + gl.arange(0, BM, layout=row_layout)
        a_s_ptrs = _a_scales(as_ptr, sorted_ids_ptr, rows, num_pairs, stride_asm, GATHER, TOPK)
        # both 64-wide tiles lie in one 128-row block of w1's gate rows and one of its up rows: one scale each
        wg_s_ptr, wu_s_ptr = _w1_scales(ws_ptr, expert, off_n, N_INTER, stride_wse, stride_wsn)
        acc_g, acc_u = _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, 0, k_tiles, off_m, gate_row,
                                    up_row, a_s_ptrs, wg_s_ptr, wu_s_ptr, stride_ask, stride_wsk,
                                    gl.zeros([BM, BN], gl.float32, mma_layout),
                                    gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, GATHER, a_ptr, a_rows, a_ok,
                                    a_cols, K)
        for i in gl.static_range(STAGES):  # the second tile's first blocks, under the first one's epilogue
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, k_tiles + i, i, off_m, gate_row + BN, up_row + BN,
                   i < k_tiles, STAGES, GATHER, a_ptr, a_rows, a_ok, a_cols, K)
        h = _silu_mul(acc_g, acc_u, FP16)
        amax = gl.max(gl.abs(h), axis=1)
        h_smem.store(h)
        acc_g, acc_u = _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, k_tiles, k_tiles, off_m,
                                    gate_row + BN, up_row + BN, a_s_ptrs, wg_s_ptr, wu_s_ptr, stride_ask, stride_wsk,
                                    gl.zeros([BM, BN], gl.float32, mma_layout),
                                    gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, GATHER, a_ptr, a_rows, a_ok,
                                    a_cols, K)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        h2 = _silu_mul(acc_g, acc_u, FP16)
        scale = gl.maximum(gl.maximum(amax, gl.max(gl.abs(h2), axis=1)), 1e-10) / 448.0  # as quant.quant_tile
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BM, BN], q_desc.layout)
        q_smem.index(1).store(gl.minimum(gl.maximum(h2 / scale[:, None], -448.0), 448.0).to(q_desc.dtype))
        h = h_smem.load(mma_layout)
        q_smem.index(0).store(gl.minimum(gl.maximum(h / scale[:, None], -448.0), 448.0).to(q_desc.dtype))
        fence_async_shared()
        _tma_store(q_desc, [off_m, off_n], q_smem.index(0))
        _tma_store(q_desc, [off_m, off_n + BN], q_smem.index(1))
        gl.store(qs_ptr + rows * stride_qs + pid_q, scale)
        tma.store_wait(pendings=0)

    @gluon.jit(do_not_specialize=["programs"])
    def moe_stage1_persistent_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, expert_ids_ptr, num_post_ptr, a_ptr,
                                     sorted_ids_ptr, N_INTER, K, max_blocks, stride_asm, stride_ask, stride_wse,
                                     stride_wsn, stride_wsk, num_pairs, stride_am, programs, GROUP_M: gl.constexpr,
                                     STAGES: gl.constexpr, WARPS: gl.constexpr, GATHER: gl.constexpr,
                                     TOPK: gl.constexpr):
        """`moe_stage1_kernel`'s result from `programs` programs that walk the sort's filled blocks' tiles (tile p,
        p + programs, ... in the grouped order): the next tile's first STAGES K blocks load before this tile's
        epilogue, whose TMA store leaves while the next tile's K loop runs. Same arguments, and `programs` (the
        grid). Measured on the H100 (twenty-seventh session): 0.98-1.04x the one-tile kernel's whole-op time with the
        copied rows, 1.06-1.13x with its own gather; in no rule, in the tuner's pairs."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)
        pid = gl.program_id(0)
        used_m, num_pid_n, k_tiles, my_tiles = _filled_tiles(num_post_ptr, N_INTER, K, BM, BN, BK, programs)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        a_smem, g_smem, u_smem, ready = _stage1_buffers(a_desc, w_desc, STAGES, GATHER, WARPS)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        pid_m, pid_n = _tile_coords(pid, used_m, num_pid_n, GROUP_M)
        pid_m = gl.maximum(gl.minimum(pid_m, max_blocks - 1), 0)  # a program with no tile loads nothing (pred)
        expert = gl.load(expert_ids_ptr + pid_m)
        a_rows, a_ok, a_cols = _gather_rows(sorted_ids_ptr, pid_m * BM, num_pairs, stride_am, BM, BK, WARPS, TOPK)
        for i in gl.static_range(STAGES):  # the first tile's first blocks
            _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, i, i, pid_m * BM,
                   expert * 2 * N_INTER + pid_n * BN, expert * 2 * N_INTER + N_INTER + pid_n * BN,
                   (i < k_tiles) & (my_tiles > 0), STAGES, GATHER, a_ptr, a_rows, a_ok, a_cols, K)

        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, used_m, num_pid_n, GROUP_M)
            expert = gl.load(expert_ids_ptr + pid_m)
            off_m = pid_m * BM
            off_n = pid_n * BN
            gate_row = expert * 2 * N_INTER + off_n
            up_row = gate_row + N_INTER
            a_rows, a_ok, a_cols = _gather_rows(sorted_ids_ptr, off_m, num_pairs, stride_am, BM, BK, WARPS, TOPK)
            a_s_ptrs = _a_scales(as_ptr, sorted_ids_ptr, off_m + gl.arange(0, BM, layout=row_layout), num_pairs,
                                 stride_asm, GATHER, TOPK)
            wg_s_ptr, wu_s_ptr = _w1_scales(ws_ptr, expert, off_n, N_INTER, stride_wse, stride_wsn)
            g0 = t * k_tiles  # this tile's first K step among the program's
            acc_g, acc_u = _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g0, k_tiles, off_m, gate_row,
                                        up_row, a_s_ptrs, wg_s_ptr, wu_s_ptr, stride_ask, stride_wsk,
                                        gl.zeros([BM, BN], gl.float32, mma_layout),
                                        gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, GATHER, a_ptr, a_rows,
                                        a_ok, a_cols, K)
            # Every stage is free: the next tile's first blocks load now, under this tile's epilogue.
            nm, nn = _tile_coords(pid + (t + 1) * programs, used_m, num_pid_n, GROUP_M)
            nm = gl.maximum(gl.minimum(nm, max_blocks - 1), 0)
            has_next = t + 1 < my_tiles
            n_expert = gl.load(expert_ids_ptr + nm)
            n_rows, n_ok, a_cols = _gather_rows(sorted_ids_ptr, nm * BM, num_pairs, stride_am, BM, BK, WARPS, TOPK)
            for i in gl.static_range(STAGES):
                _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g0 + k_tiles + i, i, nm * BM,
                       n_expert * 2 * N_INTER + nn * BN, n_expert * 2 * N_INTER + N_INTER + nn * BN,
                       (i < k_tiles) & has_next, STAGES, GATHER, a_ptr, n_rows, n_ok, a_cols, K)
            h = _silu(acc_g, acc_u)
            tma.store_wait(pendings=0)  # the previous tile's rows have left c_smem
            c_smem.store(h.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def _ws_loader(a_desc, w_desc, a_smem, g_smem, u_smem, ready, empty, expert_ids_ptr, num_post_ptr, N, K, programs,
                   a_ptr, sorted_ids_ptr, num_pairs, stride_am, GROUP_M: gl.constexpr, GATED: gl.constexpr,
                   GATHER: gl.constexpr, TOPK: gl.constexpr):
        """The loader partition of the warp-specialised stage kernels: every K block of the program's tiles (A's
        sorted rows and the expert's weight rows: GATED, stage 1's gate and up rows of w1 [E, 2N, K]; else w2
        [E, N, K] into `g_smem`) into the ring, step g into stage g % STAGES once its consumer has freed it. A's
        rows come through TMA, or (GATHER, stage 1) copied from their tokens' rows of a_ptr by this warp group's
        cp.async, each thread's copies arriving on the stage's barrier."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        pid = gl.program_id(0)
        used_m, num_pid_n, k_tiles, my_tiles = _filled_tiles(num_post_ptr, N, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, used_m, num_pid_n, GROUP_M)
            expert = gl.load(expert_ids_ptr + pid_m)
            if GATHER:  # this warp group's share of the tile's token rows
                # 16-byte copies need what a partition's arguments no longer tell the compiler: rows 16-byte aligned
                # and K a multiple of 16 (TMA's rule too), restated as products of 16
                a_rows, a_ok, a_cols = _gather_rows(sorted_ids_ptr, pid_m * BM, num_pairs, stride_am // 16 * 16, BM,
                                                    BK, gl.num_warps(), TOPK)
            else:
                a_rows, a_ok, a_cols = 0, 0, 0
            for ki in range(k_tiles):
                g = t * k_tiles + ki
                # a fresh barrier counts as having completed the phase before its first: round 0 passes at once
                mbarrier.wait(empty.index(g % STAGES), phase=((g // STAGES) & 1) ^ 1)
                if GATED:
                    gate_row = expert * 2 * N + pid_n * BN
                    _load3(a_desc, w_desc, a_smem, g_smem, u_smem, ready, g, ki, pid_m * BM, gate_row, gate_row + N,
                           True, STAGES, GATHER, a_ptr, a_rows, a_ok, a_cols, K // 16 * 16)
                else:
                    _load(a_desc, w_desc, a_smem, g_smem, ready, g, ki, pid_m * BM, expert * N + pid_n * BN, True,
                          STAGES)

    @gluon.jit
    def _ws_stage1_mma(a_desc, w_desc, c_desc, a_smem, g_smem, u_smem, c_smem, ready, empty, as_ptr, ws_ptr,
                       expert_ids_ptr, num_post_ptr, sorted_ids_ptr, N_INTER, K, stride_asm, stride_ask, stride_wse,
                       stride_wsn, stride_wsk, num_pairs, programs, GROUP_M: gl.constexpr, GATHER: gl.constexpr,
                       TOPK: gl.constexpr):
        """The MMA partition of `moe_stage1_ws_kernel` (the kernel's warps): each tile's K loop from the ring, its
        stages handed back as their MMAs retire, then silu(gate) · up out through TMA."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        pid = gl.program_id(0)
        used_m, num_pid_n, k_tiles, my_tiles = _filled_tiles(num_post_ptr, N_INTER, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, used_m, num_pid_n, GROUP_M)
            expert = gl.load(expert_ids_ptr + pid_m)
            off_m = pid_m * BM
            off_n = pid_n * BN
            gate_row = expert * 2 * N_INTER + off_n
            a_s_ptrs = _a_scales(as_ptr, sorted_ids_ptr, off_m + gl.arange(0, BM, layout=row_layout), num_pairs,
                                 stride_asm, GATHER, TOPK)
            wg_s_ptr, wu_s_ptr = _w1_scales(ws_ptr, expert, off_n, N_INTER, stride_wse, stride_wsn)
            # GATHER: the loader's cp.async rows made visible to the MMA's proxy after each stage's wait (_issue2)
            acc_g, acc_u = _stage1_tile(a_desc, w_desc, a_smem, g_smem, u_smem, ready, t * k_tiles, k_tiles, off_m,
                                        gate_row, gate_row + N_INTER, a_s_ptrs, wg_s_ptr, wu_s_ptr, stride_ask,
                                        stride_wsk, gl.zeros([BM, BN], gl.float32, mma_layout),
                                        gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, GATHER, 0, 0, 0, 0, K,
                                        empty, True)
            h = _silu(acc_g, acc_u)
            tma.store_wait(pendings=0)  # the previous tile's rows have left c_smem
            c_smem.store(h.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)

    # No integer argument that may be 1 specialized: a constant 1 would reach the partitions as a Python int, which
    # they refuse. A's row stride (K, a multiple of 128) keeps its divisibility, which the loader's 16-byte cp.async
    # needs.
    @gluon.jit(do_not_specialize=["N_INTER", "K", "max_blocks", "stride_asm", "stride_ask", "stride_wse",
                                  "stride_wsn", "stride_wsk", "num_pairs", "programs"])
    def moe_stage1_ws_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, expert_ids_ptr, num_post_ptr, a_ptr,
                             sorted_ids_ptr, N_INTER, K, max_blocks, stride_asm, stride_ask, stride_wse, stride_wsn,
                             stride_wsk, num_pairs, stride_am, programs, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             WARPS: gl.constexpr, GATHER: gl.constexpr, TOPK: gl.constexpr,
                             LOADER_REGS: gl.constexpr = 40):
        """`moe_stage1_persistent_kernel`'s result (same arguments) with the loads in a partition of their own
        (kernels/gluon_gemm_ws.py's scheme): a loader warp group streams every K block of the program's tiles into
        the ring (the weights through TMA; A's rows through TMA from the copy, or with GATHER by its own cp.async from
        the tokens' rows), across tile boundaries and under the epilogue, while the kernel's WARPS warps only wait,
        multiply, rescale and store. Launch with maxnreg `ws_maxnreg(WARPS)`."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        g_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        u_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        # the weights' expect-arrive, and with GATHER every loader thread's copies too
        ready, empty = _stage_barriers(STAGES, 1 + 32 * 4 if GATHER else 1)
        gl.warp_specialize([
            (_ws_stage1_mma, (a_desc, w_desc, c_desc, a_smem, g_smem, u_smem, c_smem, ready, empty, as_ptr, ws_ptr,
                              expert_ids_ptr, num_post_ptr, sorted_ids_ptr, N_INTER, K, stride_asm, stride_ask,
                              stride_wse, stride_wsn, stride_wsk, num_pairs, programs, GROUP_M, GATHER, TOPK)),
            (_ws_loader, (a_desc, w_desc, a_smem, g_smem, u_smem, ready, empty, expert_ids_ptr, num_post_ptr, N_INTER,
                          K, programs, a_ptr, sorted_ids_ptr, num_pairs, stride_am, GROUP_M, True, GATHER, TOPK)),
        ], [4], [LOADER_REGS])  # a whole warp group (WS_LOADER_WARPS): setmaxnreg acts on warp groups

    @gluon.jit
    def _stage2_store(acc, out_ptr, sorted_ids_ptr, weights_ptr, rows, cols, numel, N, stride_om,
                      ATOMIC_TOPK: gl.constexpr = 0):
        """Each real row of the tile times its routing weight, to its (token, slot) pair's row of out. The rows leave
        in a blocked layout, 8 columns a thread (16-byte stores), through a shared-memory conversion of the rounded
        tile: from the MMA's layout each thread would store 2 columns at a time. H200, twenty-ninth session: stage 2
        alone 0.93x (persistent) and 0.91x (warp-specialised) its time at E 64 top-6 I 1536, 4096 tokens.
        ATOMIC_TOPK (the top-k count; TOPK_ATOMIC plans): out is the [T, D] accumulator the sort zeroed, and each
        row is added into its token's row (pair // ATOMIC_TOPK): no [pairs, D] rows, no top-k sum launch; the order of
        the adds is the GPU's. An fp32 accumulator takes two columns an atomic from the MMA's layout
        (`add.v2.f32`); a 16-bit one the rounded rows eight columns an atomic from the blocked layout
        (`add.noftz.v8.bf16`)."""
        pairs = gl.load(sorted_ids_ptr + rows)
        acc = acc * gl.load(weights_ptr + pairs, mask=pairs < numel, other=0.0)[:, None]
        if ATOMIC_TOPK and out_ptr.dtype.element_ty == gl.float32:
            ptrs = out_ptr + (pairs // ATOMIC_TOPK).to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.atomic_add(ptrs, acc, mask=(pairs < numel)[:, None] & (cols < N)[None, :], sem="relaxed")
        else:
            BN: gl.constexpr = acc.shape[1]
            TN: gl.constexpr = BN // 8  # threads across a row
            rowwise: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [gl.num_warps(), 1], [1, 0])
            h = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), rowwise)
            pairs = gl.load(sorted_ids_ptr + gl.convert_layout(rows, gl.SliceLayout(1, rowwise)))
            cols = gl.convert_layout(cols, gl.SliceLayout(0, rowwise))
            ok = (pairs < numel)[:, None] & (cols < N)[None, :]
            if ATOMIC_TOPK:
                ptrs = out_ptr + (pairs // ATOMIC_TOPK).to(gl.int64)[:, None] * stride_om + cols[None, :]
                gl.atomic_add(ptrs, h, mask=ok, sem="relaxed")
            else:
                gl.store(out_ptr + pairs.to(gl.int64)[:, None] * stride_om + cols[None, :], h, mask=ok)

    @gluon.jit
    def moe_stage2_kernel(a_desc, w_desc, out_ptr, as_ptr, ws_ptr, sorted_ids_ptr, expert_ids_ptr, weights_ptr,
                          num_post_ptr, numel, N, K, max_blocks, stride_asm, stride_ask, stride_wse, stride_wsn,
                          stride_wsk, stride_om, GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                          ATOMIC_TOPK: gl.constexpr = 0):
        """out[pair, n] = w[pair] · Σ_k (A_k[row] · W2[e]_kᵀ) · a_s[row, k] · w_s[e, n // 128, k] for each sorted
        row of a block whose expert is e (ATOMIC_TOPK: added into out[pair // ATOMIC_TOPK, n], fp32). Grid:
        (max_blocks · ⌈N/BN⌉,); programs past the sort's blocks return."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        num_pid_n = gl.cdiv(N, BN)
        pid_m, pid_n = _tile_coords(gl.program_id(0), max_blocks, num_pid_n, GROUP_M)
        if pid_m * BM >= gl.load(num_post_ptr):
            return
        expert = gl.load(expert_ids_ptr + pid_m)
        off_m = pid_m * BM
        off_n = pid_n * BN
        w_row = expert * N + off_n
        k_tiles = gl.cdiv(K, BK)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(STAGES):
            _load(a_desc, w_desc, a_smem, b_smem, ready, i, i, off_m, w_row, i < k_tiles, STAGES)

        rows = off_m + gl.arange(0, BM, layout=row_layout)
        a_s_ptrs = as_ptr + rows * stride_asm
        w_s_ptr = ws_ptr + expert * stride_wse + (off_n // 128) * stride_wsn
        acc = _blockscale_tile(a_desc, w_desc, a_smem, b_smem, ready, 0, k_tiles, off_m, w_row, a_s_ptrs, None,
                               w_s_ptr, stride_ask, stride_wsk, gl.zeros([BM, BN], gl.float32, mma_layout), STAGES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        _stage2_store(acc, out_ptr, sorted_ids_ptr, weights_ptr, rows, off_n + gl.arange(0, BN, layout=col_layout),
                      numel, N, stride_om, ATOMIC_TOPK)

    @gluon.jit(do_not_specialize=["programs"])
    def moe_stage2_persistent_kernel(a_desc, w_desc, out_ptr, as_ptr, ws_ptr, sorted_ids_ptr, expert_ids_ptr,
                                     weights_ptr, num_post_ptr, numel, N, K, max_blocks, stride_asm, stride_ask,
                                     stride_wse, stride_wsn, stride_wsk, stride_om, programs,
                                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                                     ATOMIC_TOPK: gl.constexpr = 0):
        """`moe_stage2_kernel`'s result from `programs` programs that walk the sort's filled blocks' tiles (tile p,
        p + programs, ... in the grouped order), the next tile's first STAGES K blocks loading under this tile's
        epilogue. Same arguments, and `programs` (the grid)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        pid = gl.program_id(0)
        used_m, num_pid_n, k_tiles, my_tiles = _filled_tiles(num_post_ptr, N, K, BM, BN, BK, programs)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        pid_m, pid_n = _tile_coords(pid, used_m, num_pid_n, GROUP_M)
        expert = gl.load(expert_ids_ptr + gl.minimum(pid_m, max_blocks - 1))
        for i in gl.static_range(STAGES):  # the first tile's first blocks
            _load(a_desc, w_desc, a_smem, b_smem, ready, i, i, pid_m * BM, expert * N + pid_n * BN,
                  (i < k_tiles) & (my_tiles > 0), STAGES)

        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, used_m, num_pid_n, GROUP_M)
            expert = gl.load(expert_ids_ptr + pid_m)
            off_m = pid_m * BM
            off_n = pid_n * BN
            w_row = expert * N + off_n
            g0 = t * k_tiles  # this tile's first K step among the program's
            rows = off_m + gl.arange(0, BM, layout=row_layout)
            a_s_ptrs = as_ptr + rows * stride_asm
            w_s_ptr = ws_ptr + expert * stride_wse + (off_n // 128) * stride_wsn
            acc = _blockscale_tile(a_desc, w_desc, a_smem, b_smem, ready, g0, k_tiles, off_m, w_row, a_s_ptrs, None,
                                   w_s_ptr, stride_ask, stride_wsk, gl.zeros([BM, BN], gl.float32, mma_layout),
                                   STAGES)
            # Every stage is free: the next tile's first blocks load now, under this tile's epilogue.
            nm, nn = _tile_coords(pid + (t + 1) * programs, used_m, num_pid_n, GROUP_M)
            has_next = t + 1 < my_tiles
            n_expert = gl.load(expert_ids_ptr + gl.minimum(nm, max_blocks - 1))
            for i in gl.static_range(STAGES):
                _load(a_desc, w_desc, a_smem, b_smem, ready, g0 + k_tiles + i, i, nm * BM, n_expert * N + nn * BN,
                      (i < k_tiles) & has_next, STAGES)
            _stage2_store(acc, out_ptr, sorted_ids_ptr, weights_ptr, rows, off_n + gl.arange(0, BN, layout=col_layout),
                          numel, N, stride_om, ATOMIC_TOPK)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def _ws_stage2_mma(a_desc, w_desc, a_smem, b_smem, ready, empty, out_ptr, as_ptr, ws_ptr, sorted_ids_ptr,
                       expert_ids_ptr, weights_ptr, num_post_ptr, numel, N, K, stride_asm, stride_ask, stride_wse,
                       stride_wsn, stride_wsk, stride_om, programs, GROUP_M: gl.constexpr,
                       ATOMIC_TOPK: gl.constexpr):
        """The MMA partition of `moe_stage2_ws_kernel` (the kernel's warps): each tile's K loop from the ring, its
        stages handed back as their MMAs retire, then each row to its (token, slot) pair with its routing weight."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                              instr_shape=[16, BN, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        pid = gl.program_id(0)
        used_m, num_pid_n, k_tiles, my_tiles = _filled_tiles(num_post_ptr, N, K, BM, BN, BK, programs)
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(pid + t * programs, used_m, num_pid_n, GROUP_M)
            expert = gl.load(expert_ids_ptr + pid_m)
            off_m = pid_m * BM
            off_n = pid_n * BN
            rows = off_m + gl.arange(0, BM, layout=row_layout)
            w_s_ptr = ws_ptr + expert * stride_wse + (off_n // BK) * stride_wsn
            acc = _blockscale_tile(a_desc, w_desc, a_smem, b_smem, ready, t * k_tiles, k_tiles, off_m,
                                   expert * N + off_n, as_ptr + rows * stride_asm, None, w_s_ptr, stride_ask,
                                   stride_wsk, gl.zeros([BM, BN], gl.float32, mma_layout), STAGES, empty, True)
            _stage2_store(acc, out_ptr, sorted_ids_ptr, weights_ptr, rows, off_n + gl.arange(0, BN, layout=col_layout),
                          numel, N, stride_om, ATOMIC_TOPK)

    # No integer argument that may be 1 specialized: a constant 1 would reach the partitions as a Python int, which
    # they refuse. D (N) and out's row stride keep theirs: D is a multiple of 128 where the Gluon stages run
    # (D = 1 would not compile), and without it the rows left 2 bytes a store (1.33x the kernel's time, H200).
    @gluon.jit(do_not_specialize=["numel", "K", "max_blocks", "stride_asm", "stride_ask", "stride_wse",
                                  "stride_wsn", "stride_wsk", "programs"])
    def moe_stage2_ws_kernel(a_desc, w_desc, out_ptr, as_ptr, ws_ptr, sorted_ids_ptr, expert_ids_ptr, weights_ptr,
                             num_post_ptr, numel, N, K, max_blocks, stride_asm, stride_ask, stride_wse, stride_wsn,
                             stride_wsk, stride_om, programs, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             WARPS: gl.constexpr, ATOMIC_TOPK: gl.constexpr = 0, LOADER_REGS: gl.constexpr = 40):
        """`moe_stage2_persistent_kernel`'s result (same arguments) with the loads in a partition of their own: a
        loader warp group streams the sorted intermediate's rows and w2's rows of every tile's K blocks into the
        ring, across tiles and under the row scatter, while the kernel's WARPS warps wait, multiply, rescale and
        scatter. Launch with maxnreg `ws_maxnreg(WARPS)`."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        ready, empty = _stage_barriers(STAGES)
        gl.warp_specialize([
            (_ws_stage2_mma, (a_desc, w_desc, a_smem, b_smem, ready, empty, out_ptr, as_ptr, ws_ptr, sorted_ids_ptr,
                              expert_ids_ptr, weights_ptr, num_post_ptr, numel, N, K, stride_asm, stride_ask,
                              stride_wse, stride_wsn, stride_wsk, stride_om, programs, GROUP_M, ATOMIC_TOPK)),
            (_ws_loader, (a_desc, w_desc, a_smem, b_smem, b_smem, ready, empty, expert_ids_ptr, num_post_ptr, N, K,
                          programs, out_ptr, sorted_ids_ptr, numel, stride_om, GROUP_M, False, False, 1)),
        ], [4], [LOADER_REGS])  # a whole warp group: setmaxnreg acts on warp groups
