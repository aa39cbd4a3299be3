"""Fused-MoE kernels: stage 1 (gate-up GEMM + activation), stage 2 (down GEMM + weighted top-k sum), and a
1-stage kernel doing both in one launch; bf16/fp16, fp8 per token (per-channel weights) and fp8 per 1×128
(128×128 weight blocks); split-K for small token counts.

Layout: hidden [T, D]; w1 [E, 2I, D] (gate rows then up rows; [E, I, D] without gate-up fusion); w2 [E, D, I];
topk_weights fp32 [T, topk]; topk_ids [T, topk]. A "pair" is p = t·topk + s; the intermediate is [T·topk, I]
in pair order, so it does not depend on BLOCK_SIZE_M, or with the plan-level SORTED_INTER [padded length, I] in the
sort's order (`MoeLaunch` only). Configs, names and checks live in `fused_moe_config`, the epilogue kernels in
`fused_moe_epilogue`; both are re-exported here. Kernels take a config and launch; they never tune.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.fused_moe_config import (  # noqa: F401 (KERNELS, FP8_QUANTS, check_config, check_plan: re-exported)
    ACTIVATIONS,
    ALL_QUANTS,
    FP8_QUANTS,
    KERNELS,
    MXFP4,
    MXFP4_A8,
    MXFP4_QUANTS,
    PLAN_FIELDS,
    QUANT_TYPES,
    SCALE_BLOCK,
    MoeConfig,
    act_group,
    check_config,
    check_plan,
    weight_tma_view,
)
from tritune.kernels.fused_moe_epilogue import _activation, _amax_out, _stage1_finish_kernel, _topk_sum_kernel
from tritune.kernels.moe_align import MoeSorting, gemm_blocks
from tritune.kernels.mxfp4 import (
    decode_e2m1,
    k32_permute_triton,
    k32_position,
    k32_unscale,
    mxfp4_codes,
    mxfp4_decode_k32,
    mxfp4_dot_scaled,
    mxfp4_scale_codes,
    mxfp4_tile,
    mxfp4_tile_k32,
)
from tritune.kernels.mxfp4_format import quantize_mxfp4
from tritune.kernels.mxfp4_records import (
    RECORD_ROWS,
    Mxfp4Scales,
    records_box,
    records_shape,
    records_view,
    scale_records,
    split_scales,
)
from tritune.kernels.mxfp4_swizzle import (
    TILE_BLOCK_K,
    TILE_ROWS,
    Mxfp4Weights,
    check_prepared_device,
    split_weights,
    tile_box,
    tile_major_bytes,
    tile_view,
)
from tritune.kernels.pdl import pdl_start
from tritune.kernels.quant import FP8, _round_to_e4m3, quantize_blocks, quantize_fp8, quantize_rows

_ACT_ID = {"silu": 0, "gelu": 1, "none": 2}
_QUANT_ID = {"none": 0, "per_token": 1, "per_1x128": 2, MXFP4: 3, MXFP4_A8: 5}
# MXFP4's GEMM: QUANT 3 decodes each weight tile in registers (`mxfp4_tile`) before tl.dot; QUANT 4 hands the packed
# codes and scales to tl.dot_scaled (`mxfp4_dot_scaled`). dot_scaled it is: on the H100 (Triton 3.6, gpt-oss-120b's
# shape, bench_mxfp4_stages.py) its stage pair ran 113 / 842 / 1849 us at 1 / 16 / 64 tokens against the register
# decode's 127 / 1002 / 2190. The decode stays as the switch's other side (tests run both).
MXFP4_DOT_SCALED = True


def k32_input(config: MoeConfig, quant: str, prepared: bool = False) -> bool:
    """Whether a stage kernel with `config` reads its A in the K32 order (kernels/mxfp4.py): the swapped MXFP4 GEMM on
    standard packed bytes. Not on `prepared` weights, stored so that they meet A in K order (mxfp4_swizzle)."""
    return quant == MXFP4 and bool(config.SWAP_AB) and not prepared


def quant_id(quant: str) -> int:
    """The kernels' QUANT constexpr for `quant` (MXFP4: 3, or 4 with MXFP4_DOT_SCALED)."""
    return 4 if quant == MXFP4 and MXFP4_DOT_SCALED else _QUANT_ID[quant]
FP8_TL = tl.constexpr(tl.float8e4nv)  # the e4m3 type in kernels (FP8 is torch's)


@triton.jit
def _pid_mn(num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    return _tile_mn(tl.program_id(0), num_pid_m, num_pid_n, GROUP_SIZE_M)


@triton.jit
def _tile_mn(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    # Grouped ordering: GROUP_SIZE_M row-blocks (mostly of one expert) share weight columns while hot in L2.
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _gated_dot(a, a_rows, w_base, offs_n, offs_k, k, K, N, stride_wn,
               a_scale_ptr, stride_asm, w_scale_ptr, stride_wsn, GATED: tl.constexpr, QUANT: tl.constexpr,
               EVEN_K: tl.constexpr, acc_g, acc_u, w_desc, tma_row, USE_TMA: tl.constexpr,
               A_QUANT_ON_LOAD: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
               SWAP_AB: tl.constexpr = False, SCALE_TMA: tl.constexpr = False, W_SWIZZLED: tl.constexpr = False):
    """One K step of the (gate, up) accumulators; w rows `offs_n` (gate) and `offs_n + N` (up).

    SWAP_AB: the accumulators are transposed, [BLOCK_N, BLOCK_M] = w · aᵀ, so a wgmma's 64 rows come from the
    weight's N instead of a block of fewer than 64 pairs (the caller transposes them back once). With MXFP4 weights
    (QUANT 3 or 4) the tile is decoded by packed PTX in the K32 order and is the dot's left operand
    (`_mxfp4_swap_dot`): `a` must hold its columns in that order too (`k32_input`).

    QUANT 3 (per_1x32): w is MXFP4 (packed e2m1 [.., K/2], e8m0 scales [.., K/32] at w_scale_ptr, row stride
    stride_wsn) and each tile is decoded into A's dtype before the dot (Hopper has no fp4 MMA; kernels/mxfp4.py);
    QUANT 4: the same operands through tl.dot_scaled. QUANT 5 (per_1x32_a8): fp8 A (per-token scales, applied by
    the caller) times MXFP4 w through tl.dot_scaled.

    With USE_TMA the weight tiles come through `w_desc` (rows tma_row.. of the [E·N_W, K] view; TMA zero-fills
    past K, and rows past this expert's N are read but never stored). With A_QUANT_ON_LOAD (per_1x128) `a` is
    unquantized and `a_scale_ptr` holds each 1×128 group's amax: the tile is quantized here exactly as
    `quant_tile` would have (the K step lies in one group, BLOCK_K dividing 128).
    SCALE_TMA (swapped MXFP4 through TMA): w_scale_ptr is the TMA descriptor of the scale records
    (kernels/mxfp4_records.py, viewed [E·NB, KB, 256]) and stride_wsn the row of this tile's first gate block; the
    up rows' blocks are N/64 after the gate's (N a multiple of 64).
    W_SWIZZLED (swapped MXFP4: `reads_prepared`): prepared weights (kernels/mxfp4_swizzle.py), the bytes re-encoded
    and tile-major; with USE_TMA `w_desc` is their `tile_view`, block `tile_box`.
    """
    if (QUANT == 3 or QUANT == 4) and SWAP_AB:
        a_t = tl.trans(a)
        acc_g = _mxfp4_swap_dot(a_t, w_base, w_scale_ptr, offs_n, k, stride_wn, stride_wsn, K, acc_g, w_desc, tma_row,
                                USE_TMA, BLOCK_SIZE_N, BLOCK_SIZE_K, SCALE_TMA, W_SWIZZLED)
        if GATED:
            up_scales = stride_wsn  # pointer rows: the row stride; records: the up rows' first record
            if SCALE_TMA:
                up_scales = stride_wsn + N // 64
            acc_u = _mxfp4_swap_dot(a_t, w_base, w_scale_ptr, offs_n + N, k, stride_wn, up_scales, K, acc_u, w_desc,
                                    tma_row + N, USE_TMA, BLOCK_SIZE_N, BLOCK_SIZE_K, SCALE_TMA, W_SWIZZLED)
    elif QUANT == 4 or QUANT == 5:
        acc_g = mxfp4_dot_scaled(a, w_base, w_scale_ptr, offs_n, k, stride_wn, stride_wsn, K, acc_g, BLOCK_SIZE_K)
        if GATED:
            acc_u = mxfp4_dot_scaled(a, w_base, w_scale_ptr, offs_n + N, k, stride_wn, stride_wsn, K, acc_u,
                                     BLOCK_SIZE_K)
    elif QUANT == 3:
        acc_g = _mxfp4_tile_dot(a, w_base, w_scale_ptr, offs_n, k, stride_wn, stride_wsn, K, acc_g, BLOCK_SIZE_N,
                                BLOCK_SIZE_K)
        if GATED:
            acc_u = _mxfp4_tile_dot(a, w_base, w_scale_ptr, offs_n + N, k, stride_wn, stride_wsn, K, acc_u,
                                    BLOCK_SIZE_N, BLOCK_SIZE_K)
    else:
        acc_g, acc_u = _gated_dot_8_16(a, a_rows, w_base, offs_n, offs_k, k, K, N, stride_wn, a_scale_ptr, stride_asm,
                                       w_scale_ptr, stride_wsn, GATED, QUANT, EVEN_K, acc_g, acc_u, w_desc, tma_row,
                                       USE_TMA, A_QUANT_ON_LOAD, SWAP_AB)
    return acc_g, acc_u


@triton.jit
def _fma_w_tile(w_base, rows, offs_k, k, K, stride_wn, EVEN_K: tl.constexpr):
    """The 16-bit weight tile of rows `rows`, K indices k + offs_k, as fp32 [BLOCK_N, BLOCK_K] (the weight's own
    orientation). Zero past K."""
    ptrs = w_base + rows[:, None] * stride_wn + (k + offs_k)[None, :]
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
    return w.to(tl.float32)


@triton.jit
def _fma_mxfp4(x_even, x_odd, w_base, ws_base, rows, k, K, stride_wn, stride_wsn, BLOCK_SIZE_N: tl.constexpr,
               BLOCK_SIZE_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] sum over K indices [k, k + BLOCK_K) of x · w for MXFP4 rows `rows`, by multiply-adds: each
    byte's low nibble (element 2j) meets x_even[:, j] and its high nibble x_odd[:, j], so the decoded weights are
    never interleaved back into K order (the activations are split instead: a tile of a few rows)."""
    packed, sc = mxfp4_codes(w_base, ws_base, rows, k, stride_wn, stride_wsn, K, BLOCK_SIZE_K)
    sc = sc[:, :, None]  # [BLOCK_N, BLOCK_K // 32, 1]: one scale per 16 bytes
    low = tl.reshape(tl.reshape(decode_e2m1(packed & 0xF), (BLOCK_SIZE_N, BLOCK_SIZE_K // 32, 16)) * sc,
                     (BLOCK_SIZE_N, BLOCK_SIZE_K // 2))
    high = tl.reshape(tl.reshape(decode_e2m1(packed >> 4), (BLOCK_SIZE_N, BLOCK_SIZE_K // 32, 16)) * sc,
                      (BLOCK_SIZE_N, BLOCK_SIZE_K // 2))
    return tl.sum(x_even[:, None, :] * low[None, :, :] + x_odd[:, None, :] * high[None, :, :], axis=2)


@triton.jit
def _gated_fma(a, w_base, ws_base, offs_n, offs_k, k, K, N, stride_wn, stride_wsn, GATED: tl.constexpr,
               QUANT: tl.constexpr, EVEN_K: tl.constexpr, acc_g, acc_u, BLOCK_SIZE_N: tl.constexpr,
               BLOCK_SIZE_K: tl.constexpr):
    """One K step of the (gate, up) accumulators [BLOCK_M, BLOCK_N] by fp32 multiply-adds, for blocks of fewer than
    16 pairs (tl.dot needs 16 rows): a [BLOCK_M, BLOCK_K] 16-bit, w rows `offs_n` (gate) and `offs_n + N` (up)."""
    if QUANT == 3 or QUANT == 4:  # MXFP4: A split into even and odd K indices, the weights' nibbles left apart
        x_even, x_odd = tl.split(tl.reshape(a.to(tl.float32), (a.shape[0], BLOCK_SIZE_K // 2, 2)))
        acc_g += _fma_mxfp4(x_even, x_odd, w_base, ws_base, offs_n, k, K, stride_wn, stride_wsn, BLOCK_SIZE_N,
                            BLOCK_SIZE_K)
        if GATED:
            acc_u += _fma_mxfp4(x_even, x_odd, w_base, ws_base, offs_n + N, k, K, stride_wn, stride_wsn,
                                BLOCK_SIZE_N, BLOCK_SIZE_K)
        return acc_g, acc_u
    x = a.to(tl.float32)[:, None, :]
    acc_g += tl.sum(x * _fma_w_tile(w_base, offs_n, offs_k, k, K, stride_wn, EVEN_K)[None, :, :], axis=2)
    if GATED:
        acc_u += tl.sum(x * _fma_w_tile(w_base, offs_n + N, offs_k, k, K, stride_wn, EVEN_K)[None, :, :], axis=2)
    return acc_g, acc_u


@triton.jit
def _mxfp4_tile_dot(a, w_base, w_scale_ptr, rows, k, stride_wn, stride_wsn, K, acc, BLOCK_SIZE_N: tl.constexpr,
                    BLOCK_SIZE_K: tl.constexpr):
    """acc plus this K step's a · w for MXFP4 rows `rows`, the tile decoded into a's dtype first."""
    w = mxfp4_tile(w_base, w_scale_ptr, rows, k, stride_wn, stride_wsn, K, BLOCK_SIZE_N, BLOCK_SIZE_K,
                   tl.float32).to(a.dtype)
    return tl.dot(a, w.T, acc)


@triton.jit
def _mxfp4_swap_dot(a_t, w_base, w_scale_ptr, rows, k, stride_wn, stride_wsn, K, acc, w_desc, tma_row,
                    USE_TMA: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                    SCALE_TMA: tl.constexpr = False, SWIZZLED: tl.constexpr = False):
    """acc [BLOCK_N, BLOCK_M] plus this K step's w · a_t (a_t = aᵀ, [BLOCK_K, BLOCK_M]) for MXFP4 rows `rows`: the
    tile decoded by packed PTX in the K32 order (`mxfp4_tile_k32`; A's columns must be in that order too) and fed
    as the dot's left operand.

    Why this orientation: Hopper's wgmma reads its left operand from registers, so the decoded weights go from the
    decode straight into the MMA, and its 64 rows come from N rather than a block of a few pairs. On the H100
    (probe_mxfp4_gemv.py, gpt-oss-120b's GEMMs) it ran 21-22% faster than tl.dot_scaled at 64 tokens, 8-9% at 1.
    """
    if USE_TMA:
        if SWIZZLED:  # prepared weights, tile-major (mxfp4_swizzle.tile_view): this K step's chunk rows, one box
            packed = tl.reshape(w_desc.load([tma_row // 64, (k // 128) * 64 + tma_row % 64, (k % 128) // 2]),
                                (BLOCK_SIZE_N, BLOCK_SIZE_K // 2))
        else:  # the packed bytes through `w_desc` ([E·N_W, K/2] uint8, TMA zero-fills past K)
            packed = w_desc.load([tma_row, k // 2])
        if SCALE_TMA:  # the codes too: this K step's records of the tile's BLOCK_N / 64 blocks (stride_wsn: the first)
            codes = tl.reshape(w_scale_ptr.load([stride_wsn, k // BLOCK_SIZE_K, 0]), (BLOCK_SIZE_N, BLOCK_SIZE_K // 32))
        else:  # by pointers
            codes = mxfp4_scale_codes(w_scale_ptr, rows, k, stride_wsn, K, BLOCK_SIZE_K)
        w = mxfp4_decode_k32(packed, codes, BLOCK_SIZE_N, BLOCK_SIZE_K, a_t.dtype, SWIZZLED, SCALE_TMA)
    elif SWIZZLED:  # prepared weights by pointers (no TMA: the interpreter, GPUs before Hopper)
        packed = tile_major_bytes(w_base, rows, k, K, BLOCK_SIZE_K)
        codes = mxfp4_scale_codes(w_scale_ptr, rows, k, stride_wsn, K, BLOCK_SIZE_K)
        w = mxfp4_decode_k32(packed, codes, BLOCK_SIZE_N, BLOCK_SIZE_K, a_t.dtype, SWIZZLED)
    else:
        w = mxfp4_tile_k32(w_base, w_scale_ptr, rows, k, stride_wn, stride_wsn, K, BLOCK_SIZE_N, BLOCK_SIZE_K,
                           a_t.dtype)
    return tl.dot(w, a_t, acc)


@triton.jit
def _gated_dot_8_16(a, a_rows, w_base, offs_n, offs_k, k, K, N, stride_wn,
                    a_scale_ptr, stride_asm, w_scale_ptr, stride_wsn, GATED: tl.constexpr, QUANT: tl.constexpr,
                    EVEN_K: tl.constexpr, acc_g, acc_u, w_desc, tma_row, USE_TMA: tl.constexpr,
                    A_QUANT_ON_LOAD: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """`_gated_dot` for 16-bit and fp8 weights (QUANT 0-2); SWAP_AB: see `_gated_dot`."""
    a_s = a_rows  # per_1x128 only: this K step's activation scales
    if QUANT == 2:
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm + k // 128)
        if A_QUANT_ON_LOAD:
            a_s = tl.maximum(a_s, 1e-10) / 448.0
            a = _round_to_e4m3(tl.clamp(a.to(tl.float32) / a_s[:, None], -448.0, 448.0)).to(FP8_TL)
    acc_g = _scaled_dot(a, a_s, _w_tile(w_base, offs_n, offs_k, k, K, stride_wn, w_desc,
                        tma_row, EVEN_K, USE_TMA, SWAP_AB), w_scale_ptr, offs_n, k, stride_wsn, acc_g, QUANT, SWAP_AB)
    if GATED:
        acc_u = _scaled_dot(a, a_s,
                            _w_tile(w_base, offs_n + N, offs_k, k, K, stride_wn, w_desc, tma_row + N, EVEN_K, USE_TMA,
                                    SWAP_AB), w_scale_ptr, offs_n + N, k, stride_wsn, acc_u, QUANT, SWAP_AB)
    return acc_g, acc_u


@triton.jit
def _w_tile(w_base, rows, offs_k, k, K, stride_wn, w_desc, tma_row, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
            SWAP_AB: tl.constexpr):
    """The weight tile of rows `rows`, K indices k + offs_k: [BLOCK_K, BLOCK_N] for a · w, or [BLOCK_N, BLOCK_K]
    (the weight's own row-major orientation) for SWAP_AB's w · aᵀ. Zero past K."""
    if USE_TMA:
        w = w_desc.load([tma_row, k])
        if not SWAP_AB:
            w = w.T
    elif SWAP_AB:
        ptrs = w_base + rows[:, None] * stride_wn + (k + offs_k)[None, :]
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
    else:
        ptrs = w_base + rows[None, :] * stride_wn + (k + offs_k)[:, None]
        if EVEN_K:
            w = tl.load(ptrs)
        else:
            w = tl.load(ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)
    return w


@triton.jit
def _scaled_dot(a, a_s, w, w_scale_ptr, rows, k, stride_wsn, acc, QUANT: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc plus this K step's product a · w ([BLOCK_M, BLOCK_N]; SWAP_AB: w · aᵀ, [BLOCK_N, BLOCK_M]), per_1x128
    (QUANT 2) scaled by a_s (this step's 1×128 scale per row of a) times the 128×128 block scale of each w row."""
    if SWAP_AB:
        prod_in = tl.trans(a)
    if QUANT == 2:
        w_s = tl.load(w_scale_ptr + (rows // 128) * stride_wsn + k // 128)
        if SWAP_AB:
            acc += tl.dot(w, prod_in) * (w_s[:, None] * a_s[None, :])
        else:
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
    elif SWAP_AB:
        acc = tl.dot(w, prod_in, acc)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _block_pairs(sorted_ids_ptr, expert_ids_ptr, pid_m, numel, ROW_DIV: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                 A_SORTED: tl.constexpr = False):
    """The sorted pairs of block `pid_m`: (pairs, real-pair mask, rows of A they read, expert as int64).

    Padding pairs read row 0 (in bounds, no mask) and are never stored. With A_SORTED, A is in the sort's order
    (a sorted intermediate): the block reads its own BLOCK_SIZE_M rows, padding rows included (stage 1 wrote zeros).
    """
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M))
    row_ok = pairs < numel
    if A_SORTED:
        a_rows = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    else:
        a_rows = tl.where(row_ok, pairs // ROW_DIV, 0).to(tl.int64)
    return pairs, row_ok, a_rows, tl.load(expert_ids_ptr + pid_m).to(tl.int64)


@triton.jit
def _gated_tile(a_ptr, a_rows, stride_am, k_start, k_end, K, N, w_base, offs_n, stride_wn, a_scale_ptr, stride_asm,
                ws_base, stride_wsn, w_desc, tma_row, a_desc, a_row0, GATED: tl.constexpr, QUANT: tl.constexpr,
                EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                A_QUANT_ON_LOAD: tl.constexpr = False, A_TMA: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
                WARP_SPEC: tl.constexpr = False, SCALE_TMA: tl.constexpr = False, W_SWIZZLED: tl.constexpr = False):
    """The (gate, up) accumulators of rows `a_rows` over K in [k_start, k_end), per-token scales applied.

    A_QUANT_ON_LOAD: A is unquantized and `a_scale_ptr` holds its amax per row (per_token) or per 1×128 group
    (per_1x128); each tile is quantized to fp8 as it is loaded, as `quant_tile` would have done it.
    A_TMA: the rows are a_row0.. (a_rows = a_row0 + arange, a sorted intermediate) and each A tile comes through
    `a_desc` (TMA zero-fills past K).
    SWAP_AB: the K loop accumulates w · aᵀ ([BLOCK_N, BLOCK_M]) and the result is transposed once at the end.
    WARP_SPEC: the K loop goes to Triton's warp specialisation (load warps feeding MMA warps; every load a TMA load).
    """
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    if QUANT == 1 and A_QUANT_ON_LOAD:
        row_scale = tl.maximum(tl.load(a_scale_ptr + a_rows), 1e-10) / 448.0
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_start + offs_k)[None, :]
    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_SIZE_K, warp_specialize=WARP_SPEC):
        if A_TMA:
            a = a_desc.load([a_row0, k])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)
        if QUANT == 1 and A_QUANT_ON_LOAD:
            a = _round_to_e4m3(tl.clamp(a.to(tl.float32) / row_scale[:, None], -448.0, 448.0)).to(FP8_TL)
        if BLOCK_SIZE_M < 16:  # a few pairs: fp32 multiply-adds in registers (fused_moe_config.is_fma)
            acc_g, acc_u = _gated_fma(a, w_base, ws_base, offs_n, offs_k, k, K, N, stride_wn, stride_wsn, GATED,
                                      QUANT, EVEN_K, acc_g, acc_u, BLOCK_SIZE_N, BLOCK_SIZE_K)
        else:
            acc_g, acc_u = _gated_dot(a, a_rows, w_base, offs_n, offs_k, k, K, N, stride_wn,
                                      a_scale_ptr, stride_asm, ws_base, stride_wsn, GATED, QUANT, EVEN_K, acc_g,
                                      acc_u, w_desc, tma_row, USE_TMA, A_QUANT_ON_LOAD, BLOCK_SIZE_N, BLOCK_SIZE_K,
                                      SWAP_AB, SCALE_TMA, W_SWIZZLED)
        a_ptrs += BLOCK_SIZE_K
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
        if QUANT == 3 or QUANT == 4:  # the swapped MXFP4 decode's tiles hold the weights scaled down (K32_FOLD)
            unscale = k32_unscale(a_ptr.dtype.element_ty)
            acc_g = acc_g * unscale
            acc_u = acc_u * unscale
    if QUANT == 1:
        if A_QUANT_ON_LOAD:
            a_s = row_scale[:, None]
        else:
            a_s = tl.load(a_scale_ptr + a_rows)[:, None]
        acc_g = acc_g * a_s * tl.load(ws_base + offs_n)[None, :]
        if GATED:
            acc_u = acc_u * a_s * tl.load(ws_base + offs_n + N)[None, :]
    elif QUANT == 5:  # MXFP4 weights carry their own scales (in the dot): only A's per-token scale is left
        a_s = tl.load(a_scale_ptr + a_rows)[:, None]
        acc_g = acc_g * a_s
        if GATED:
            acc_u = acc_u * a_s
    return acc_g, acc_u


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # stage 1: hidden [T, K]; stage 2: intermediate [numel, K], or [rows, K] sorted (A_SORTED); dtype or fp8
    a_desc,  # A_SORTED 2: TMA descriptor of the sorted intermediate [rows, K], block [BLOCK_M, BLOCK_K]; else unused
    a_scale_ptr,  # fp32: per_token [rows]; per_1x128 [rows, ⌈K/128⌉]
    w_ptr,  # [E, N·(2 if GATED else 1), K]
    w_desc,  # USE_TMA: TMA descriptor of w viewed [E·N_W, K], block [BLOCK_N, BLOCK_K]; else unused
    w_scale_ptr,  # fp32: per_token [E, N_W]; per_1x128 [E, ⌈N_W/128⌉, ⌈K/128⌉]
    out_ptr,  # KSPLIT 1: [numel, N] ([rows, N] with OUT_SORTED); fp32 partials [KSPLIT, numel or rows, N_W] (gate and
    # up kept apart); ATOMIC_TOPK: fp32 [T, N] zeroed, every split and slot adds into it
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,  # int32, from moe_align_block_size
    weights_ptr,  # fp32 [numel] routing weights in pair order
    amax_ptr,  # AMAX_OUT: fp32 [numel or rows, amax groups] zeroed, stage 1 max-reduces |output| into it; else unused
    numel, N, K, k_per_split, num_pid_m,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_ok,
    stride_amax,  # AMAX_OUT: row stride of amax_ptr
    A_ROW_DIV: tl.constexpr,  # topk for stage 1 (rows of hidden), 1 for stage 2 (rows of the intermediate)
    GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, KSPLIT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    AMAX_OUT: tl.constexpr = 0,  # stage 1, KSPLIT 1: 1 = amax per output row, 2 = per 1×128 group; 0 = none
    A_QUANT_ON_LOAD: tl.constexpr = False,  # stage 2: A unquantized, a_scale_ptr its amax (AMAX_OUT of stage 1)
    OUT_SORTED: tl.constexpr = False,  # stage 1: output rows (and amax, partials) in the sort's order, not by pair
    A_SORTED: tl.constexpr = 0,  # stage 2: A rows in the sort's order; 1 pointer loads, 2 through a_desc (TMA)
    ATOMIC_TOPK: tl.constexpr = 0,  # stage 2: topk > 0 adds weight·row into fp32 out row pair // topk; 0 stores
    SWAP_AB: tl.constexpr = False,  # accumulate w · aᵀ (a wgmma's 64 rows from N), transposed at the end; not QUANT 5
    WARP_SPEC: tl.constexpr = False,  # stage 2, A and w through TMA: a warp-specialised K loop
    OUT_K32: tl.constexpr = False,  # stage 1: output columns in the K32 order (stage 2's swapped MXFP4 reads them so)
    SCALE_TMA: tl.constexpr = False,  # swapped MXFP4: w_scale_ptr is the scale records' TMA descriptor, stride_wse
    # the records an expert, stride_wsn unused (kernels/mxfp4_records.py)
    W_SWIZZLED: tl.constexpr = False,  # prepared MXFP4 weights: re-encoded, tile-major (kernels/mxfp4_swizzle.py)
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (kernels/pdl.py): wait before any access
):
    """One BLOCK_M×BLOCK_N tile of one expert's block of sorted pairs, for one K split.

    The fp8 paths may skip the intermediate's own quantization launch: stage 1 records the amax of what it
    stores (AMAX_OUT, atomic max: exact in any order) and stage 2 quantizes A tile by tile (A_QUANT_ON_LOAD),
    giving the same fp8 values and scales as the quantization kernel.
    A sorted intermediate (OUT_SORTED in stage 1, A_SORTED in stage 2): block b's rows are b·BLOCK_M.. in both
    stages, so stage 2 reads A contiguously (no gather) and maps each row back to its pair only in the epilogue;
    stage 1 writes its padding rows as zeros, which stage 2 reads but never stores.

    Grid: (num_pid_m·⌈N/BLOCK_N⌉, KSPLIT), num_pid_m = moe_align.gemm_blocks (every block that can hold pairs);
    blocks past the padded count exit.
    """
    pdl_start(PDL)
    pid_m, pid_n = _pid_mn(num_pid_m, tl.cdiv(N, BLOCK_SIZE_N), GROUP_SIZE_M)
    pid_k = tl.program_id(1)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_post_ptr):
        return
    pairs, row_ok, a_rows, expert = _block_pairs(sorted_ids_ptr, expert_ids_ptr, pid_m, numel, A_ROW_DIV,
                                                 BLOCK_SIZE_M, A_SORTED != 0)
    offs_n_out = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_n = offs_n_out % N
    w_base = w_ptr + expert * stride_we
    if SCALE_TMA:  # the descriptor itself, and this tile's gate record at K step 0 where the row stride goes
        ws_base = w_scale_ptr
        stride_wsn = (expert * stride_wse + pid_n * (BLOCK_SIZE_N // 64)).to(tl.int32)
    else:
        ws_base = w_scale_ptr + expert * stride_wse
    expert_rows = 2 * N if GATED else N
    if W_SWIZZLED:  # prepared weights keep whole 64-row chunks: an expert's rows padded to a multiple of 64
        expert_rows = tl.cdiv(expert_rows, 64) * 64
    tma_row = (expert * expert_rows + pid_n * BLOCK_SIZE_N).to(tl.int32)
    k_start = pid_k * k_per_split
    acc_g, acc_u = _gated_tile(a_ptr, a_rows, stride_am, k_start, tl.minimum(k_start + k_per_split, K), K, N,
                               w_base, offs_n, stride_wn, a_scale_ptr, stride_asm, ws_base, stride_wsn, w_desc,
                               tma_row, a_desc, (pid_m * BLOCK_SIZE_M).to(tl.int32), GATED, QUANT, EVEN_K, USE_TMA,
                               BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, A_QUANT_ON_LOAD, A_SORTED == 2, SWAP_AB,
                               WARP_SPEC, SCALE_TMA, W_SWIZZLED)
    n_ok = (offs_n_out < N)[None, :]
    mask = row_ok[:, None] & n_ok
    if OUT_K32:  # stage 2 reads the intermediate in the K32 order (N a multiple of 32: the order stays within N)
        if BLOCK_SIZE_N >= 32:  # reorder the tile in registers and store it contiguously
            acc_g = _k32_columns(acc_g, BLOCK_SIZE_M, BLOCK_SIZE_N)
            if GATED:
                acc_u = _k32_columns(acc_u, BLOCK_SIZE_M, BLOCK_SIZE_N)
        else:  # a 16-wide tile holds half a chunk: store each column where it goes
            offs_n_out = k32_position(offs_n_out)
    if OUT_SORTED:
        rows = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)[:, None]
    else:
        rows = pairs.to(tl.int64)[:, None]
    if ATOMIC_TOPK != 0:
        # Stage 2 sums the top-k slots (and K splits) itself: fp32 adds in whatever order the programs run.
        if MUL_WEIGHT:
            acc_g = acc_g * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        tokens = (pairs // ATOMIC_TOPK).to(tl.int64)[:, None]
        tl.atomic_add(out_ptr + tokens * stride_om + offs_n_out[None, :], acc_g, mask=mask, sem="relaxed")
    elif KSPLIT == 1:
        if ACT == 2:
            res = acc_g
        elif GATED:
            res = _activation(acc_g, ACT) * acc_u
        else:
            res = _activation(acc_g, ACT)
        if MUL_WEIGHT:
            res = res * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        if OUT_SORTED:  # every row of the block: padding rows as zeros, so stage 2 reads defined values
            stored = tl.where(row_ok[:, None], res, 0.0).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows * stride_om + offs_n_out[None, :], stored, mask=(rows >= 0) & n_ok)
        else:
            stored = res.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows * stride_om + offs_n_out[None, :], stored, mask=mask)
        if AMAX_OUT != 0:
            _amax_out(tl.where(mask, tl.abs(stored.to(tl.float32)), 0.0), amax_ptr + rows * stride_amax, row_ok,
                      pid_n, N, AMAX_OUT, BLOCK_SIZE_M, BLOCK_SIZE_N)
    else:
        base = out_ptr + pid_k * stride_ok + rows * stride_om + offs_n_out[None, :]
        if ACT == 2 and MUL_WEIGHT:
            # Stage 2 is linear after the GEMM, so the routing weight can go on each split's partial.
            acc_g = acc_g * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
        tl.store(base, acc_g, mask=mask)
        if GATED:
            tl.store(base + N, acc_u, mask=mask)


@triton.jit
def _k32_columns(x, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """x [BLOCK_M, BLOCK_N] (columns in K order, BLOCK_N a multiple of 32) with its columns in the K32 order: column
    8t + 4g + 2i + h of each 32 moves to 16g + 8h + 2t + i, as `k32_permute` does on the host."""
    x = tl.reshape(x, (BLOCK_SIZE_M, BLOCK_SIZE_N // 32, 4, 2, 2, 2))
    return tl.reshape(tl.permute(x, (0, 1, 3, 5, 2, 4)), (BLOCK_SIZE_M, BLOCK_SIZE_N))


def gated_of(w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """True when w1 holds gate and up rows ([E, 2I, D]), False for a plain [E, I, D] first GEMM."""
    inter = w2.shape[2]
    if w1.shape[1] == 2 * inter:
        return True
    if w1.shape[1] == inter:
        return False
    raise ValueError(f"w1 has {w1.shape[1]} rows per expert; expected 2·inter_dim = {2 * inter} (gate and up) "
                     f"or inter_dim = {inter}, with inter_dim taken from w2 {tuple(w2.shape)}")


def quantize_weights(w: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [E, N, K] float -> fp8 (MXFP4 for per_1x32) and the scales the kernels read.

    Scales: per_token [E, N]; per_1x128 [E, ⌈N/128⌉, ⌈K/128⌉]; per_1x32 e8m0 [E, N, K/32] (values packed [E, N, K/2]).
    """
    experts, n, k = w.shape
    if quant == "per_token":
        q, s = quantize_rows(w.reshape(experts * n, k))
        return q.view(experts, n, k), s.view(experts, n)
    if quant == "per_1x128":
        parts = [quantize_blocks(w[e], SCALE_BLOCK, SCALE_BLOCK) for e in range(experts)]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    if quant in MXFP4_QUANTS:  # packed e2m1 [E, N, K/2] and e8m0 scales [E, N, K/32], both uint8
        return quantize_mxfp4(w)
    raise ValueError(f"quantize_weights: quant {quant!r} is not a quantized type; expected per_token, per_1x128 "
                     f"or {MXFP4}")


def quantize_activations(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Activations [R, C] as the kernels read them (one Triton launch for fp8; unchanged for "none")."""
    if quant not in FP8_QUANTS:  # MXFP4 quantizes the weights only: A stays 16-bit
        return x, None
    return quantize_fp8(x, act_group(quant))


def _dummy(device: torch.device) -> torch.Tensor:
    return torch.empty(1, device=device, dtype=torch.float32)


def _act_scale(a_scale: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """(tensor, row stride) of an activation scale; per-token scales are 1-D and have row stride 0 (unused)."""
    if a_scale is None:
        return _dummy(device), 0
    return a_scale, a_scale.stride(0) if a_scale.dim() == 2 else 0


def _scale_strides(scale: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """(tensor, expert stride, row stride) of a weight scale; 2-D per-channel scales have row stride 0 (unused)."""
    if scale is None:
        return _dummy(device), 0, 0
    return scale, scale.stride(0), scale.stride(1) if scale.dim() == 3 else 0


def _launch_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                 out: torch.Tensor, sorting: MoeSorting, weights: torch.Tensor, *, n: int, k: int, a_row_div: int,
                 gated: bool, act: int, mul_weight: bool, quant: str, config: MoeConfig) -> torch.Tensor:
    """Run _moe_gemm_kernel (and the stage-1 finish when split): returns `out`, or the fp32 partials of stage 2."""
    cfg = config
    if any(getattr(cfg, name) for name in PLAN_FIELDS):
        raise ValueError(f"{', '.join(PLAN_FIELDS)} shape the whole 2-stage call (one stage's output is the other's "
                         "input): run them through fused_moe_2stage or tritune.ops.fused_moe, not a stage alone")
    w_scale, records = split_scales(w_scale)
    w, swizzled = split_weights(w)
    if swizzled:
        check_swizzled(cfg, quant, "stage1" if gated or act != _ACT_ID["none"] else "stage2", n, gated)
        check_prepared_device(w)
    if quant in MXFP4_QUANTS:
        _check_mxfp4(w, w_scale, k, cfg)
    numel = sorting.numel
    num_pid_m = min(sorting.expert_ids.numel(), gemm_blocks(numel, w.shape[0], cfg.BLOCK_SIZE_M))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.KSPLIT), cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K
    n_w = n * (2 if gated else 1)
    target = out if cfg.KSPLIT == 1 else torch.empty((cfg.KSPLIT, numel, n_w), device=a.device, dtype=torch.float32)
    a_s, stride_asm = _act_scale(a_scale, a.device)
    w_s, stride_wse, stride_wsn = _scale_strides(w_scale, a.device)
    if cfg.SCALE_TMA:  # the codes through TMA, from their records (re-laid here when the caller has none)
        check_scale_records(cfg, n, gated)
        records = scale_records(w_scale) if records is None else records
        w_s = TensorDescriptor.from_tensor(records_view(records), records_box(cfg.BLOCK_SIZE_N))
        stride_wse, stride_wsn = records.shape[1], 0
    grid = (num_pid_m * triton.cdiv(n, cfg.BLOCK_SIZE_N), cfg.KSPLIT)
    w_desc = w
    if swizzled and cfg.USE_TMA:  # prepared weights: tile-major, one box a K step
        w_desc = TensorDescriptor.from_tensor(tile_view(w), tile_box(cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K))
    elif cfg.USE_TMA:
        row, box = weight_tma_view(quant, k, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K)
        if (row * w.element_size()) % 16:
            raise ValueError(f"USE_TMA needs weight rows of 16-byte multiples; K={k} of {w.dtype} "
                             f"({row * w.element_size()} bytes) is not")
        w_desc = TensorDescriptor.from_tensor(w.view(-1, row), box)
    _moe_gemm_kernel[grid](
        a, a, a_s, w, w_desc, w_s, target, sorting.sorted_token_ids, sorting.expert_ids, sorting.num_tokens_post_padded,
        weights, weights, numel, n, k, k_per_split, num_pid_m,
        a.stride(0), stride_asm, w.stride(0), w.stride(1), stride_wse, stride_wsn, target.stride(-2),
        target.stride(0) if cfg.KSPLIT > 1 else 0, 0,
        A_ROW_DIV=a_row_div, GATED=gated, ACT=act, MUL_WEIGHT=mul_weight, QUANT=quant_id(quant),
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, BLOCK_SIZE_N=cfg.BLOCK_SIZE_N, BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M, KSPLIT=cfg.KSPLIT, EVEN_K=k % cfg.BLOCK_SIZE_K == 0, USE_TMA=bool(cfg.USE_TMA),
        SWAP_AB=bool(cfg.SWAP_AB), SCALE_TMA=bool(cfg.SCALE_TMA), W_SWIZZLED=swizzled, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if cfg.KSPLIT == 1 or act == _ACT_ID["none"]:
        return target
    block = min(triton.next_power_of_2(n), 1024)
    _stage1_finish_kernel[(numel, triton.cdiv(n, block))](
        target, out, weights, sorting.sorted_token_ids, n, numel, target.stride(0), target.stride(1),
        KSPLIT=cfg.KSPLIT, GATED=gated, ACT=act, MUL_WEIGHT=mul_weight, BLOCK=block, SORTED=False, num_warps=4)
    return out


def reads_prepared(cfg: MoeConfig, quant: str, n: int = 0, gated: bool = False) -> bool:
    """Whether a stage GEMM with `cfg` reads prepared MXFP4 weights (re-encoded, tile-major: kernels/mxfp4_swizzle.py):
    the swapped GEMM on tiles of at least 64 rows (the re-encoding follows the Hopper wgmma's register order, which
    smaller tiles do not use: a 32-row tile decoded garbage on the H100), by pointers or through TMA with a K step
    inside one tile-major chunk (BLOCK_K at most 128); a gated stage 1 only where its up rows start a chunk
    (inter_dim `n` a multiple of 64)."""
    return (k32_input(cfg, quant) and cfg.BLOCK_SIZE_N >= TILE_ROWS
            and (not cfg.USE_TMA or cfg.BLOCK_SIZE_K <= TILE_BLOCK_K) and not (gated and n % TILE_ROWS))


def check_swizzled(cfg: MoeConfig, quant: str, kernel: str, n: int = 0, gated: bool = False) -> None:
    """What prepared MXFP4 weights (kernels/mxfp4_swizzle.py) need: the one GEMM that reads them (`reads_prepared`),
    and for a gated stage 1 up rows that start on a 64-row chunk (inter_dim `n` a multiple of 64)."""
    if not reads_prepared(cfg, quant):  # the config's rules first (their message), then the shape's
        raise ValueError(f"{cfg.name(kernel, quant)}: prepared MXFP4 weights (prepare_mxfp4_weights) are read only by "
                         f"the swapped GEMM ({MXFP4} with SWAP_AB) with BLOCK_SIZE_N >= {TILE_ROWS}, through TMA "
                         f"with BLOCK_SIZE_K <= {TILE_BLOCK_K}; "
                         "pass the standard packed bytes for this config")
    if not reads_prepared(cfg, quant, n, gated):
        raise ValueError(f"prepared MXFP4 weights: the gated stage 1 needs inter_dim a multiple of {TILE_ROWS} (its up "
                         f"rows start a tile-major chunk), got {n}; pass the standard packed bytes")


def check_scale_records(cfg: MoeConfig, n: int, gated: bool) -> None:
    """SCALE_TMA's one shape rule past check_config: a gated stage's up rows start on a record (N a multiple of
    64), so the gate's and the up tile's records line up."""
    if gated and n % RECORD_ROWS:
        raise ValueError(f"SCALE_TMA: the gated stage 1 needs inter_dim a multiple of {RECORD_ROWS} (its up rows' "
                         f"scale records start at row inter_dim), got {n}")


def _check_mxfp4(w: torch.Tensor, w_scale: torch.Tensor | None, k: int, cfg: MoeConfig) -> None:
    """One line for what the MXFP4 GEMM cannot run: packed uint8 [E, N, K/2] with uint8 scales [E, N, K/32], K a
    multiple of 32, BLOCK_SIZE_K >= 32 (whole scale blocks per K step), TMA only in the swapped GEMM."""
    if w.dtype != torch.uint8 or w.shape[2] * 2 != k or k % 32:
        raise ValueError(f"{MXFP4}: weights must be packed uint8 [E, N, K/2] with K a multiple of 32; got {w.dtype} "
                         f"{tuple(w.shape)} for K={k}")
    want = (w.shape[0], w.shape[1], k // 32)
    if w_scale is None or w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != want:
        got = "None" if w_scale is None else f"{w_scale.dtype} {tuple(w_scale.shape)}"
        raise ValueError(f"{MXFP4}: scales must be uint8 e8m0 {want}; got {got}")
    if w_scale.device != w.device:
        raise ValueError(f"{MXFP4}: scales are on {w_scale.device}, the weights on {w.device}")
    if cfg.BLOCK_SIZE_K < 32 or (cfg.USE_TMA and not cfg.SWAP_AB):
        raise ValueError(f"{MXFP4}: needs BLOCK_SIZE_K >= 32, and SWAP_AB with USE_TMA; got BLOCK_SIZE_K="
                         f"{cfg.BLOCK_SIZE_K}, USE_TMA={cfg.USE_TMA}, SWAP_AB={cfg.SWAP_AB}")


def _check_sorting(sorting: MoeSorting, config: MoeConfig, numel: int) -> None:
    if sorting.block_size != config.BLOCK_SIZE_M:
        raise ValueError(f"the sort was made for BLOCK_SIZE_M {sorting.block_size}, "
                         f"the config has {config.BLOCK_SIZE_M}")
    if sorting.numel != numel:
        raise ValueError(f"the sort covers {sorting.numel} pairs, the routing has {numel}")


def moe_stage1(hidden: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, topk_weights: torch.Tensor, sorting: MoeSorting,
               config: MoeConfig, *, inter_dim: int, activation: str = "silu", quant: str = "none",
               w1_scale: torch.Tensor | None = None, doweight_stage1: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """act(hidden·w1_gateᵀ) ⊙ (hidden·w1_upᵀ) per routed pair, quantizing hidden first for fp8.

    hidden [T, D] bf16/fp16; w1 [E, 2I or I, D] (MXFP4: packed, or `prepare_mxfp4_weights`' re-encoding for a
    swapped config); topk_weights fp32 [T, topk] -> intermediate [T·topk, I] in hidden's dtype.
    """
    _check_sorting(sorting, config, topk_weights.numel())
    tokens, model_dim = hidden.shape
    a, a_scale = quantize_activations(hidden, quant)
    if k32_input(config, quant, isinstance(w1, Mxfp4Weights)):  # the swapped MXFP4 GEMM on standard bytes reads A
        a = k32_permute_triton(a)  # in the K32 order (the output stays in K order)
    if out is None:
        out = torch.empty((sorting.numel, inter_dim), device=hidden.device, dtype=hidden.dtype)
    return _launch_gemm(a, a_scale, w1, w1_scale, out, sorting, topk_weights.reshape(-1), n=inter_dim, k=model_dim,
                        a_row_div=sorting.numel // tokens, gated=w1.shape[1] == 2 * inter_dim,
                        act=_ACT_ID[activation], mul_weight=doweight_stage1, quant=quant, config=config)


def moe_stage2(inter: torch.Tensor, w2: torch.Tensor | Mxfp4Weights, topk_weights: torch.Tensor, sorting: MoeSorting,
               config: MoeConfig, *, quant: str = "none", w2_scale: torch.Tensor | None = None,
               doweight_stage1: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_slot weight · (inter·w2ᵀ) per token, quantizing the intermediate first for fp8.

    inter [T·topk, I] bf16/fp16; w2 [E, D, I]; topk_weights fp32 [T, topk] -> out [T, D], inter's dtype.
    """
    _check_sorting(sorting, config, topk_weights.numel())
    tokens, topk = topk_weights.shape
    model_dim = w2.shape[1]
    a, a_scale = quantize_activations(inter, quant)
    if k32_input(config, quant, isinstance(w2, Mxfp4Weights)):  # into the K32 order (the 2-stage call has stage 1
        a = k32_permute_triton(a)  # write it so)
    if out is None:
        out = torch.empty((tokens, model_dim), device=inter.device, dtype=inter.dtype)
    direct = topk == 1 and config.KSPLIT == 1
    # With split-K the partials are fp32 [KSPLIT, numel, D], allocated by the launcher.
    part = out if direct or config.KSPLIT > 1 else torch.empty((sorting.numel, model_dim), device=inter.device,
                                                               dtype=inter.dtype)
    part = _launch_gemm(a, a_scale, w2, w2_scale, part, sorting, topk_weights.reshape(-1), n=model_dim,
                        k=inter.shape[1], a_row_div=1, gated=False, act=_ACT_ID["none"],
                        mul_weight=not doweight_stage1, quant=quant, config=config)
    if direct:
        return out
    block = min(triton.next_power_of_2(model_dim), 1024)
    _topk_sum_kernel[(tokens, triton.cdiv(model_dim, block))](
        part, out, model_dim, part.stride(0) if config.KSPLIT > 1 else 0,
        TOPK=topk, KSPLIT=config.KSPLIT, BLOCK=block, num_warps=4)
    return out


def _validate(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str, quant: str,
              w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
              prepared: tuple[bool, bool] = (False, False)) -> tuple[int, int, int]:
    """Shapes, dtypes and layouts, host-only; returns (experts, inter_dim, model_dim). `prepared`: w1, w2 are
    `Mxfp4Weights.view`s (their tiles contiguous by construction; the view's strides are not the layout)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; expected one of {ACTIVATIONS}")
    if quant not in ALL_QUANTS:
        raise ValueError(f"quant {quant!r}; expected one of {ALL_QUANTS}")
    if hidden.dim() != 2 or hidden.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"hidden_states must be 2-D bf16/fp16, got {tuple(hidden.shape)} {hidden.dtype}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 and w2 must be 3-D [E, N, K], got {tuple(w1.shape)} and {tuple(w2.shape)}")
    experts, model_dim, inter_dim = w2.shape
    packed = quant in MXFP4_QUANTS  # two e2m1 values per byte along K
    if packed:
        inter_dim *= 2
        if w1.shape[1] not in (inter_dim, 2 * inter_dim):
            raise ValueError(f"w1 has {w1.shape[1]} rows per expert; expected 2·inter_dim = {2 * inter_dim} (gate and "
                             f"up) or inter_dim = {inter_dim}, with inter_dim = 2 × w2's packed {w2.shape[2]}")
    else:
        gated_of(w1, w2)
    if w1.shape[0] != experts or w1.shape[2] * (2 if packed else 1) != model_dim or hidden.shape[1] != model_dim:
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                         f"[tokens={hidden.shape[0]}, topk]")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")
    for name, t, laid_out in (("hidden_states", hidden, False), ("w1", w1, prepared[0]), ("w2", w2, prepared[1]),
                              ("topk_weights", topk_weights, False)):
        if not laid_out and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    want_w = hidden.dtype if quant == "none" else torch.uint8 if packed else FP8
    if w1.dtype != want_w or w2.dtype != want_w:
        raise ValueError(f"quant {quant!r} wants w1/w2 of {want_w}, got {w1.dtype}/{w2.dtype}")
    if quant != "none":
        wanted = {"per_token": ((experts, w1.shape[1]), (experts, model_dim)),
                  "per_1x128": ((experts, triton.cdiv(w1.shape[1], 128), triton.cdiv(model_dim, 128)),
                                (experts, triton.cdiv(model_dim, 128), triton.cdiv(inter_dim, 128))),
                  MXFP4: ((experts, w1.shape[1], model_dim // 32), (experts, model_dim, inter_dim // 32))}[
            MXFP4 if packed else quant]
        scale_dtype = torch.uint8 if packed else torch.float32
        for name, s, shape in (("w1_scale", w1_scale, wanted[0]), ("w2_scale", w2_scale, wanted[1])):
            if packed and s is not None and s.dim() == 4:  # the scale records of a SCALE_TMA stage (mxfp4_records)
                shape = records_shape(shape[0], shape[1], shape[2] * 32)
            if s is None or tuple(s.shape) != shape or s.dtype != scale_dtype or not s.is_contiguous():
                got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
                raise ValueError(f"{quant} wants {name} {'uint8' if packed else 'fp32'} contiguous {shape}, got {got}")
    if packed and (model_dim % 32 or inter_dim % 32):
        raise ValueError(f"{quant}: model_dim {model_dim} and inter_dim {inter_dim} must be multiples of 32")
    return experts, inter_dim, model_dim


def stage_scales(scale: torch.Tensor | Mxfp4Scales | None, scale_tma: int) -> torch.Tensor | None:
    """The scale tensor a stage's kernel reads: the records with SCALE_TMA (re-laid here when `scale` is only the
    codes: a copy per call, so hand `prepare_mxfp4_scales` results to repeated calls), else the codes."""
    codes, records = split_scales(scale)
    if not scale_tma:
        return codes
    return scale_records(codes) if records is None else records


def fused_moe_2stage(hidden: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, w2: torch.Tensor | Mxfp4Weights,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, stage1: MoeConfig, stage2: MoeConfig, *,
                     activation: str = "silu", quant: str = "none", w1_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, doweight_stage1: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE as sort → (quantize) → stage 1 → (quantize) → stage 2 → top-k sum; no host sync.

    hidden [T, D] bf16/fp16, w1 [E, 2I or I, D], w2 [E, D, I], topk_weights fp32 [T, topk], topk_ids int [T, topk]
    -> [T, D] in hidden's dtype. Both stages share BLOCK_SIZE_M (one sort serves both). Binds its launches afresh
    on every call (`tritune.ops.fused_moe` keeps a `MoeLaunch` per call signature instead).
    """
    from tritune.kernels.fused_moe_launch import MoeLaunch

    w1_scale = stage_scales(w1_scale, stage1.SCALE_TMA)
    w2_scale = stage_scales(w2_scale, stage2.SCALE_TMA)
    launch = MoeLaunch(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, stage1=stage1, stage2=stage2,
                       activation=activation, quant=quant, doweight_stage1=doweight_stage1)
    if out is None:
        out = torch.empty((hidden.shape[0], w2.shape[1]), device=hidden.device, dtype=hidden.dtype)
    return launch(hidden, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, out)
