"""The MoE MLP for training: route, gate_up grouped GEMM (gathering tokens itself), SwiGLU, down grouped GEMM
(scattering rows back to token order itself), weighted top-k sum; as a function and as an nn.Module.

One autograd Function holds the whole block, so it decides the layouts between its kernels. Where a GEMM's dW runs
the scheduled loop (kernels/grouped_dw_scheduled.py), the operand that loop would copy into rows padded per expert
is produced padded in the first place: the forward gathers the tokens into padded rows once (the gate_up GEMM
reads them through TMA, and its dW reads them again in place), and the backward writes the top-k sum's dY straight
into padded rows from dout and the routing weights (the down GEMM's dX reads it through TMA, its dW in place).
Each saves a copy as large as the operand (Qwen3-30B-A3B at 8192 tokens: 268 MB each way), at the price of keeping
the padded tokens for the backward instead of the hidden states (topk times their size).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from tritune.kernels.grouped_dw_scheduled import pad
from tritune.kernels.grouped_gemm import (
    group_by_expert,
    grouped_gemm_dx,
    grouped_gemm_forward,
    scheduled_dw_launch,
)
from tritune.kernels.grouped_gemm_config import KernelConfig, KernelConfigBackward_dW
from tritune.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_reference
from tritune.kernels.topk_weighted_sum import topk_sum, topk_weighted_sum_backward, topk_weighted_sum_forward
from tritune.knobs import moe_mlp_layout
from tritune.ops.grouped_gemm import (
    GroupedGemmConfigs,
    bind_cuda_context,
    run_dw,
    run_dx,
    run_forward,
    select_configs,
)


class TopkWeightedSum(torch.autograd.Function):
    """out[t] = Σ_s w[t, s]·y[t·topk + s] over y [T·topk, D] in pair order, one Triton launch each way; gradients
    flow to y and to the routing weights w [T, topk]."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, w = y.contiguous(), w.contiguous()
        ctx.save_for_backward(y, w)
        return topk_weighted_sum_forward(y, w)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, w = ctx.saved_tensors
        return topk_weighted_sum_backward(dout, y, w)


def padded_rows(dw: KernelConfigBackward_dW) -> int:
    """Rows per block of the padded layout the GEMM's dW reads in place (its BLOCK_SIZE_M), or 0: plain layouts
    (a plain dW, or TRITUNE_MOE_MLP_LAYOUT=plain)."""
    return dw.BLOCK_SIZE_M if dw.scheduled and moe_mlp_layout() == "padded" else 0


@functools.lru_cache(maxsize=256)
def config_reading_padded(config: KernelConfig, operand: str) -> KernelConfig:
    """The forward (operand "x") or dX ("dy") config reading its input from padded rows: contiguous per expert, so
    through TMA and with no gather (the permute the config fused is already done). Cached: configs are frozen, and
    a dataclass replace each call was a visible part of a small step's host time."""
    return dataclasses.replace(config, permute_x=False, permute_y=False, **{f"use_tma_load_{operand}": True})


def forward_on_padded(x_rows: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor, topk: int,
                      config: KernelConfig, padded_to: int) -> torch.Tensor:
    """Y [P, N] grouped from X in rows padded per expert to `padded_to` (`pad`'s layout), as the MLP's gate_up
    forward runs it: the config reading padded rows through TMA."""
    return grouped_gemm_forward(x_rows, w, m_sizes, config_reading_padded(config, "x"), topk=topk,
                                gather_indices=gather, x_padded_to=padded_to, pairs=gather.shape[0])


def dx_on_padded(dy_rows: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor, topk: int,
                 config: KernelConfig, padded_to: int) -> torch.Tensor:
    """dX [P, K] grouped from dY in rows padded per expert, as the MLP's down dX runs it."""
    return grouped_gemm_dx(dy_rows, w, m_sizes, config_reading_padded(config, "dy"), topk=topk,
                           gather_indices=gather, dy_padded_to=padded_to, pairs=gather.shape[0])


def dw_on_padded(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor, topk: int,
                 config: KernelConfigBackward_dW, padded: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """dW [E, N, K] (into `out` when given) through the scheduled loop with operand `padded` ("x" or "dy") already
    in rows padded per expert and the other grouped, as the MLP's backward runs it: nothing copied."""
    return scheduled_dw_launch(x, dy, m_sizes, config, topk=topk, gather=gather, permute_x=False, permute_y=False,
                               out=out, padded=padded, pairs=gather.shape[0])


class _MoeMlp(torch.autograd.Function):
    """The MoE MLP from routed tokens to their weighted top-k sum; gradients for hidden, both weights and the
    routing weights (see the module docstring for the layouts)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                m_sizes: torch.Tensor, gather: torch.Tensor, topk: int, up: GroupedGemmConfigs,
                down: GroupedGemmConfigs, pad_up: int) -> torch.Tensor:
        hidden, w1, w2, topk_weights = (t.contiguous() for t in (hidden, w1, w2, topk_weights))
        pairs = gather.shape[0]
        if pad_up:
            x_rows = pad(hidden, m_sizes, gather, topk, pairs, pad_up)
            h = forward_on_padded(x_rows, w1, m_sizes, gather, topk, up.forward, pad_up)
        else:
            x_rows = hidden
            h = run_forward(hidden, w1, m_sizes, gather, topk, True, False, up.forward)
        a = swiglu_forward(h)
        y = run_forward(a, w2, m_sizes, gather, topk, False, True, down.forward)
        ctx.save_for_backward(x_rows, w1, w2, topk_weights, m_sizes, gather, h, a, y)
        ctx.topk, ctx.up, ctx.down, ctx.pad_up, ctx.tokens = topk, up, down, pad_up, hidden.shape[0]
        return topk_weighted_sum_forward(y, topk_weights)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x_rows, w1, w2, topk_weights, m_sizes, gather, h, a, y = ctx.saved_tensors
        bind_cuda_context(dout.device)
        dout = dout.contiguous()
        topk, up, down, pairs = ctx.topk, ctx.up, ctx.down, gather.shape[0]
        need_x, need_w1, need_w2, need_tw = ctx.needs_input_grad[:4]
        dw1 = dw2 = d_tw = dx = None
        pad_down = padded_rows(down.dW) if need_w2 else 0
        if pad_down:  # dY = w·dout written into padded rows: down's dX reads it by TMA, its dW in place
            dy_rows = pad(dout, m_sizes, gather, topk, pairs, pad_down, scale=topk_weights)
            if need_tw:
                d_tw = topk_weighted_sum_backward(dout, y, topk_weights, with_dy=False)[1]
            da = dx_on_padded(dy_rows, w2, m_sizes, gather, topk, down.dX, pad_down)
            dw2 = dw_on_padded(a, dy_rows, m_sizes, gather, topk, down.dW, "dy")
        else:
            dy, d_tw = topk_weighted_sum_backward(dout, y, topk_weights)
            da = run_dx(dy, w2, m_sizes, gather, topk, False, True, down.dX)
            if need_w2:
                dw2 = run_dw(a, dy, m_sizes, gather, topk, False, True, down.dW)
        dh = swiglu_backward(h, da)
        if need_x:  # each token fed topk pairs: their gradients add up
            dx = topk_sum(run_dx(dh, w1, m_sizes, gather, topk, True, False, up.dX), topk)
        if need_w1 and ctx.pad_up:
            dw1 = dw_on_padded(x_rows, dh, m_sizes, gather, topk, up.dW, "x")
        elif need_w1:
            dw1 = run_dw(x_rows, dh, m_sizes, gather, topk, True, False, up.dW)
        return dx, dw1, dw2, d_tw if need_tw else None, None, None, None, None, None, None


def moe_mlp(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, gate_up_configs: GroupedGemmConfigs | None = None,
            down_configs: GroupedGemmConfigs | None = None) -> torch.Tensor:
    """Differentiable MoE MLP.

    hidden [T, H]; gate_up_proj [E, 2I, H] (gate rows then up rows); down_proj [E, H, I]; topk_weights [T, topk]
    (gradients flow to them); topk_ids [T, topk] int -> [T, H] in hidden's dtype. Configs None: the tuned ones for
    this device and shape, else the heuristic's.
    """
    topk = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} differ")
    m_sizes, gather = group_by_expert(topk_ids, gate_up_proj.shape[0])
    up = gate_up_configs or select_configs(hidden.shape[0], gate_up_proj, topk, True, False)
    down = down_configs or select_configs(hidden.shape[0] * topk, down_proj, topk, False, True)
    # The padded tokens only serve gate_up's dW: not made where no backward will run (no_grad, inference_mode, a
    # frozen weight). Decided here: inside the Function's forward, grad mode is always off and needs_input_grad
    # ignores it.
    pad_up = padded_rows(up.dW) if torch.is_grad_enabled() and gate_up_proj.requires_grad else 0
    return _MoeMlp.apply(hidden, gate_up_proj, down_proj, topk_weights, m_sizes, gather, topk, up, down, pad_up)


def moe_mlp_reference(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fp32 torch loop over experts, differentiable: the reference the op's values and gradients must match."""
    out = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
    for e in range(gate_up_proj.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a = swiglu_reference(hidden[tok].float() @ gate_up_proj[e].float().T)
        y = a @ down_proj[e].float().T
        out = out.index_add(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
    return out


class MoeMLP(nn.Module):
    """A sparse MoE block (Qwen3-MoE / Mixtral style): a router, top-k softmax routing (renormalized when
    `norm_topk_prob`), SwiGLU experts on tritune's grouped GEMMs with tuned configs looked up per shape."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, topk: int, *,
                 norm_topk_prob: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        factory = {"device": device, "dtype": dtype}
        self.num_experts, self.topk, self.norm_topk_prob = num_experts, topk, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, topk] differentiable through the router, topk_ids int64 [T, topk])."""
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        ids = torch.topk(probs.detach(), self.topk, dim=-1).indices
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., H]."""
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        return moe_mlp(flat, self.gate_up_proj, self.down_proj, weights, ids).view(shape)
