"""The torch reference every fused-MoE kernel must match: fp32 arithmetic on the same quantized data path.

fp8 activations are quantized and dequantized exactly as the op does (per token or per 1×128), and the
intermediate is rounded to the activation dtype between the stages, so only accumulation order differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritune.kernels.fused_moe_config import FP8_QUANTS, MXFP4_QUANTS, act_group
from tritune.kernels.mxfp4_format import dequantize_mxfp4
from tritune.kernels.quant import quantize_blocks, quantize_rows

SCALE_BLOCK = 128


def _dequant_rows(x: torch.Tensor, quant: str) -> torch.Tensor:
    """Activations [R, C] through the op's quantizer and back, in fp32 (per_1x32 keeps them 16-bit)."""
    if quant not in FP8_QUANTS:
        return x.float()
    if act_group(quant) == 0:
        q, s = quantize_rows(x)
        return q.float() * s[:, None]
    q, s = quantize_blocks(x, 1, SCALE_BLOCK)
    return q.float() * s.repeat_interleave(SCALE_BLOCK, dim=1)[:, : x.shape[1]]


def _dequant_weight(w: torch.Tensor, scale: torch.Tensor | None, quant: str) -> torch.Tensor:
    """One expert's weight [N, K] in fp32 (scale: per_token [N]; per_1x128 [⌈N/128⌉, ⌈K/128⌉]; per_1x32: w packed
    MXFP4 [N, K/2], scale e8m0 [N, K/32])."""
    if quant == "none":
        return w.float()
    if quant in MXFP4_QUANTS:
        return dequantize_mxfp4(w, scale)
    if quant == "per_token":
        return w.float() * scale[:, None]
    n, k = w.shape
    full = scale.repeat_interleave(SCALE_BLOCK, dim=0).repeat_interleave(SCALE_BLOCK, dim=1)
    return w.float() * full[:n, :k]


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(x) if activation == "silu" else F.gelu(x)


def stage1_reference(hidden: torch.Tensor, w1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     inter_dim: int, activation: str = "silu", quant: str = "none",
                     w1_scale: torch.Tensor | None = None, doweight_stage1: bool = False) -> torch.Tensor:
    """The intermediate in pair order: fp32 [T·topk, I].

    hidden [T, D]; w1 [E, 2I (gate rows, then up rows) or I, D]; topk_weights fp32 [T, topk]; topk_ids [T, topk].
    """
    _, topk = topk_ids.shape
    return _stage1(_dequant_rows(hidden, quant), w1, w1_scale, topk_ids.reshape(-1).long(),
                   topk_weights.reshape(-1).float(), topk, activation, quant, doweight_stage1, inter_dim)


def _stage1(a: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor | None, ids: torch.Tensor,
            weights: torch.Tensor, topk: int, activation: str, quant: str, doweight: bool,
            inter_dim: int) -> torch.Tensor:
    gated = w1.shape[1] == 2 * inter_dim
    out = torch.zeros((ids.numel(), inter_dim), device=a.device, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        pairs = (ids == e).nonzero().squeeze(1)
        h = a[pairs // topk] @ _dequant_weight(w1[e], None if w1_scale is None else w1_scale[e], quant).T
        res = _act(h[:, :inter_dim], activation) * h[:, inter_dim:] if gated else _act(h, activation)
        if doweight:
            res = res * weights[pairs, None]
        out[pairs] = res
    return out


def stage2_reference(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     quant: str = "none", w2_scale: torch.Tensor | None = None,
                     doweight_stage1: bool = False) -> torch.Tensor:
    """Σ_slot weight · (inter·w2ᵀ): inter [T·topk, I] (the activation dtype), w2 [E, D, I] -> fp32 [T, D]."""
    tokens, topk = topk_ids.shape
    a = _dequant_rows(inter, quant)
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros((tokens, w2.shape[1]), device=inter.device, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        pairs = (ids == e).nonzero().squeeze(1)
        y = a[pairs] @ _dequant_weight(w2[e], None if w2_scale is None else w2_scale[e], quant).T
        if not doweight_stage1:
            y = y * weights[pairs, None]
        out.index_add_(0, pairs // topk, y)
    return out


def fused_moe_reference(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, activation: str = "silu", quant: str = "none",
                        w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                        doweight_stage1: bool = False, requantize_intermediate: bool = True) -> torch.Tensor:
    """The whole MoE in fp32 [T, D]; the intermediate is rounded to hidden's dtype between the stages, as in the op.

    requantize_intermediate=False follows the 1-stage kernel, which keeps the fp8 paths' intermediate in 16 bits.
    """
    inter_dim = w2.shape[2] * (2 if quant in MXFP4_QUANTS else 1)  # MXFP4 packs two values per byte along K
    inter = stage1_reference(hidden, w1, topk_weights, topk_ids, inter_dim=inter_dim, activation=activation,
                             quant=quant, w1_scale=w1_scale, doweight_stage1=doweight_stage1)
    if quant != "none" and not requantize_intermediate:
        # Dequantize the weights up front and run stage 2 unquantized: same as the 1-stage kernel's data path.
        w2 = torch.stack([_dequant_weight(w2[e], w2_scale[e], quant) for e in range(w2.shape[0])])
        quant, w2_scale = "none", None
    return stage2_reference(inter.to(hidden.dtype), w2, topk_weights, topk_ids, quant=quant, w2_scale=w2_scale,
                            doweight_stage1=doweight_stage1)
