"""What the fused-MoE GEMMs do after their K loop, in jit helpers and the small kernels behind them: the activation,
the max-reduction of stage 1's output for the fused fp8 quantization, the split-K finish of stage 1 (pair order or the
sort's order) and the top-k sum of stage 2.

Stage 2's atomic top-k sum (TOPK_ATOMIC) needs no kernel here: it adds into an fp32 [T, D] accumulator zeroed by the
sort's first launch, cast into `out` by the 1-stage path's `_acc_to_out_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritune.kernels.pdl import pdl_start


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    else:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _amax_out(x, amax_rows, row_ok, pid_n, N, AMAX_OUT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
              BLOCK_SIZE_N: tl.constexpr):
    """Max-reduce |tile| `x` [BM, BN] (masked entries 0) into the amax of its rows (AMAX_OUT 1) or of their 1×128
    groups (2); `amax_rows` [BM, 1] points at each row's first amax."""
    if AMAX_OUT == 1 or BLOCK_SIZE_N <= 128:
        group = 0 if AMAX_OUT == 1 else (pid_n * BLOCK_SIZE_N) // 128
        tl.atomic_max(amax_rows + group, tl.max(x, axis=1)[:, None], mask=row_ok[:, None])
    else:
        per_group = tl.max(tl.reshape(x, (BLOCK_SIZE_M, BLOCK_SIZE_N // 128, 128)), axis=2)
        groups = pid_n * (BLOCK_SIZE_N // 128) + tl.arange(0, BLOCK_SIZE_N // 128)
        tl.atomic_max(amax_rows + groups[None, :], per_group, mask=row_ok[:, None] & (groups * 128 < N)[None, :])


@triton.jit
def _stage1_finish_kernel(
    part_ptr,  # fp32 [KSPLIT, rows, N_W]
    out_ptr,  # [rows, N] intermediate dtype
    weights_ptr,  # fp32 [numel]
    sorted_ids_ptr,  # SORTED: int32 [rows] the pair of each row (numel for padding); else unused
    N, numel, stride_pk, stride_pm,
    KSPLIT: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    SORTED: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (kernels/pdl.py)
):
    """Sum the split-K partials of stage 1, then activation and routing weight. Rows are pairs (rows = numel), or with
    SORTED the sort's positions (rows = its padded length): a padding row is written as zeros, unread partials and all.

    Grid: (rows, ⌈N/BLOCK⌉).
    """
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    load_mask = mask
    pair = row
    if SORTED:
        pair = tl.load(sorted_ids_ptr + row)
        load_mask = mask & (tl.zeros((BLOCK,), dtype=tl.int32) + pair < numel)  # padding: no partial is read
        pair = tl.minimum(pair, numel - 1)
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for ks in range(KSPLIT):
        base = part_ptr + ks * stride_pk + row * stride_pm + offs
        g += tl.load(base, mask=load_mask, other=0.0)
        if GATED:
            u += tl.load(base + N, mask=load_mask, other=0.0)
    res = _activation(g, ACT) * u if GATED else _activation(g, ACT)  # 0 on padding rows: act(0)·0 = act(0) = 0
    if MUL_WEIGHT:
        res = res * tl.load(weights_ptr + pair)
    tl.store(out_ptr + row * N + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _topk_sum_kernel(
    part_ptr,  # [KSPLIT, T·TOPK, D], out dtype (KSPLIT 1) or fp32
    out_ptr,  # [T, D]
    D, stride_pk,
    TOPK: tl.constexpr, KSPLIT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (kernels/pdl.py)
):
    """out[t] = Σ_slots Σ_splits part[split, t·TOPK + slot] (routing weights were applied by stage 2).

    Grid: (T, ⌈D/BLOCK⌉).
    """
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(TOPK):
        for ks in range(KSPLIT):
            acc += tl.load(part_ptr + ks * stride_pk + (t * TOPK + s) * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
