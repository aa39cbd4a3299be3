"""The MoE MLP for training: route, gate_up grouped GEMM (gathering tokens itself), SwiGLU, down grouped GEMM
(scattering rows back to token order itself), weighted top-k sum; as a function and as an nn.Module."""

from __future__ import annotations

import torch
from torch import nn

from tritune.kernels.grouped_gemm import group_by_expert
from tritune.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_reference
from tritune.kernels.topk_weighted_sum import topk_weighted_sum_backward, topk_weighted_sum_forward
from tritune.ops.grouped_gemm import GroupedGemmConfigs, grouped_gemm


class SwiGLU(torch.autograd.Function):
    """silu(gate)·up over h [R, 2I] (gate columns first), one Triton launch each way."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        ctx.save_for_backward(h)
        return swiglu_forward(h)

    @staticmethod
    def backward(ctx, da: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_backward(h, da)


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


def moe_mlp(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, gate_up_configs: GroupedGemmConfigs | None = None,
            down_configs: GroupedGemmConfigs | None = None) -> torch.Tensor:
    """Differentiable MoE MLP.

    hidden [T, H]; gate_up_proj [E, 2I, H] (gate rows then up rows); down_proj [E, H, I]; topk_weights [T, topk]
    (gradients flow to them); topk_ids [T, topk] int -> [T, H] in hidden's dtype.
    """
    topk = topk_ids.shape[1]
    m_sizes, gather = group_by_expert(topk_ids, gate_up_proj.shape[0])
    h = grouped_gemm(hidden, gate_up_proj, m_sizes, gather, topk=topk, permute_x=True, configs=gate_up_configs)
    a = SwiGLU.apply(h)
    y = grouped_gemm(a, down_proj, m_sizes, gather, topk=topk, permute_y=True, configs=down_configs)
    return TopkWeightedSum.apply(y, topk_weights)


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
