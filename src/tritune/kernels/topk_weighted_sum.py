"""The MoE MLP's last step for training, out[t] = Σ_slots w[t, s]·y[t·topk + s], forward and backward, one launch
each. Torch's eager form (a broadcast multiply, a sum, and their gradients) took 0.9 ms of Mixtral's and 1.4 ms of
Qwen3-30B-A3B's training step at 8192 tokens on the H100 (profile_moe_mlp_step.py), about four times what reading
and writing its tensors once costs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_launch import launch

BLOCK = 1024
LAUNCH = {"num_warps": 4, "num_stages": 3}  # Triton's defaults, as a bound launch (kernels/grouped_launch.py)


@triton.jit
def _topk_weighted_sum_fwd_kernel(y_ptr, w_ptr, out_ptr, D, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                                  WEIGHTED: tl.constexpr = True):
    """y [T·TOPK, D], w [T, TOPK] -> out [T, D], fp32 sums (not WEIGHTED: plain sums, w never read).
    Grid: (T, cdiv(D, BLOCK))."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(TOPK):
        y = tl.load(y_ptr + (t * TOPK + s) * D + cols, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            y = y * tl.load(w_ptr + t * TOPK + s).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _topk_weighted_sum_bwd_kernel(dout_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, D, TOPK: tl.constexpr,
                                  TOPK_POW2: tl.constexpr, BLOCK: tl.constexpr, STORE_DY: tl.constexpr = True):
    """dout [T, D], y [T·TOPK, D], w [T, TOPK] -> dy [T·TOPK, D] = w·dout (unless not STORE_DY: the MoE MLP then
    writes it padded per expert itself) and dw [T, TOPK] = <dout[t], y[t, s]>.
    Grid: (T,); each program walks its token's D columns, so dw needs no atomics."""
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, TOPK_POW2)
    slot_ok = slots < TOPK
    w = tl.load(w_ptr + t * TOPK + slots, mask=slot_ok, other=0.0).to(tl.float32)
    rows = t * TOPK + slots
    dot = tl.zeros((TOPK_POW2, BLOCK), dtype=tl.float32)
    for c0 in range(0, D, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < D
        dout = tl.load(dout_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
        both = slot_ok[:, None] & ok[None, :]
        y = tl.load(y_ptr + rows[:, None] * D + cols[None, :], mask=both, other=0.0).to(tl.float32)
        dot += y * dout[None, :]
        if STORE_DY:
            tl.store(dy_ptr + rows[:, None] * D + cols[None, :], (w[:, None] * dout[None, :]).to(
                dy_ptr.dtype.element_ty), mask=both)
    tl.store(dw_ptr + t * TOPK + slots, tl.sum(dot, axis=1).to(dw_ptr.dtype.element_ty), mask=slot_ok)


def _check(y: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    if w.dim() != 2 or y.dim() != 2 or y.shape[0] != w.numel():
        raise ValueError(f"topk_weighted_sum needs y [T·topk, D] and w [T, topk], got {tuple(y.shape)} and "
                         f"{tuple(w.shape)}")
    return w.shape[0], w.shape[1], y.shape[1]


def topk_weighted_sum_forward(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [T·topk, D] (pair order), w [T, topk] -> [T, D] in y's dtype."""
    tokens, topk, d = _check(y, w)
    out = torch.empty((tokens, d), device=y.device, dtype=y.dtype)
    if tokens and d:
        launch(_topk_weighted_sum_fwd_kernel, (tokens, triton.cdiv(d, BLOCK)),
               dict(y_ptr=y.contiguous(), w_ptr=w.contiguous(), out_ptr=out, D=d, TOPK=topk, BLOCK=BLOCK,
                    WEIGHTED=True), **LAUNCH)
    return out


def topk_sum(y: torch.Tensor, topk: int) -> torch.Tensor:
    """y [T·topk, D] (pair order) -> [T, D] in y's dtype: each token's topk rows summed in fp32, rounded once (the
    MoE MLP's input gradient: each token fed topk pairs). One launch, where torch's sum in fp32 and cast are two and
    write an fp32 [T, D] between them."""
    if y.dim() != 2 or topk < 1 or y.shape[0] % topk:
        raise ValueError(f"topk_sum needs y [T·topk, D] with topk >= 1, got {tuple(y.shape)} and topk {topk}")
    tokens, d = y.shape[0] // topk, y.shape[1]
    out = torch.empty((tokens, d), device=y.device, dtype=y.dtype)
    if tokens and d:
        y = y.contiguous()
        launch(_topk_weighted_sum_fwd_kernel, (tokens, triton.cdiv(d, BLOCK)),
               dict(y_ptr=y, w_ptr=y, out_ptr=out, D=d, TOPK=topk, BLOCK=BLOCK, WEIGHTED=False), **LAUNCH)
    return out


def topk_weighted_sum_backward(dout: torch.Tensor, y: torch.Tensor, w: torch.Tensor, *, with_dy: bool = True
                               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(dy [T·topk, D] in y's dtype, dw [T, topk] in w's dtype) for dout [T, D]; dy None when not with_dy."""
    tokens, topk, d = _check(y, w)
    dy = torch.empty_like(y) if with_dy else None
    dw = torch.empty_like(w)
    if tokens:
        launch(_topk_weighted_sum_bwd_kernel, (tokens,), dict(
            dout_ptr=dout.contiguous(), y_ptr=y.contiguous(), w_ptr=w.contiguous(), dy_ptr=dy if with_dy else dw,
            dw_ptr=dw, D=d, TOPK=topk, TOPK_POW2=triton.next_power_of_2(topk),
            BLOCK=max(16, BLOCK // triton.next_power_of_2(topk)), STORE_DY=with_dy), **LAUNCH)
    return dy, dw
