"""MoE routing: top-k over the softmax of gating logits, and seeded synthetic routing for tuning and benchmarks."""

from __future__ import annotations

import math

import torch


def topk_softmax(gating_logits: torch.Tensor, topk: int,
                 renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, then the top-k experts of each token, largest weight first.

    gating_logits [T, E] any float dtype -> (topk_weights fp32 [T, topk], topk_ids int32 [T, topk]).
    With `renormalize` each row's weights are divided by their sum, so they sum to 1.
    """
    if gating_logits.dim() != 2:
        raise ValueError(f"gating_logits must be 2-D [tokens, experts], got shape {tuple(gating_logits.shape)}")
    if not gating_logits.is_floating_point():
        raise ValueError(f"gating_logits must be a float tensor, got {gating_logits.dtype}")
    experts = gating_logits.shape[1]
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"topk must be an int in [1, {experts}] (the number of experts), got {topk!r}")
    probs = torch.softmax(gating_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def sample_routing(tokens: int, experts: int, topk: int, *, skew: float = 0.0, seed: int = 0,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic routing: `topk` distinct experts per token, drawn without replacement.

    skew == 0 draws experts uniformly; skew > 0 draws from a Zipf law, P(rank r) ∝ 1/(r+1)**skew, over experts
    ranked by a seeded permutation (so the hot experts are not always the low ids). Returns (weights fp32
    [tokens, topk], positive, each row summing to 1, largest first; ids int32 [tokens, topk]). Generated on the
    CPU with one torch.Generator, so a seed gives the same routing on every device.
    """
    for name, value in (("tokens", tokens), ("experts", experts), ("topk", topk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if topk > experts:
        raise ValueError(f"topk ({topk}) cannot exceed experts ({experts}): the experts of a token are distinct")
    if not math.isfinite(skew) or skew < 0:
        raise ValueError(f"skew must be a finite number >= 0, got {skew!r}")
    gen = torch.Generator().manual_seed(seed)
    rank_of = torch.randperm(experts, generator=gen)  # expert rank_of[r] has popularity rank r
    probs = torch.empty(experts, dtype=torch.float64)
    probs[rank_of] = (torch.arange(experts, dtype=torch.float64) + 1) ** -skew
    ids = torch.multinomial(probs.expand(tokens, experts), topk, replacement=False, generator=gen)
    # Softmax of Gaussian logits: positive, rows sum to 1, spread like a real router's top-k.
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen, dtype=torch.float64), dim=-1)
    weights = weights.sort(dim=-1, descending=True).values.float()
    return weights.to(device), ids.to(device=device, dtype=torch.int32)
