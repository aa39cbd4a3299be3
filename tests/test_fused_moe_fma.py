"""The stage kernels' multiply-add path (BLOCK_SIZE_M 1-8: fp32 FMAs in registers instead of tl.dot, for decode-size
blocks), 16-bit and MXFP4 weights, against the torch references; and what check_config lets it take. Without a GPU
these run in Triton's interpreter on tiny odd shapes (K not a multiple of BLOCK_K, N under a tile, an idle expert,
split-K, experts with more pairs than a block)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

# The MXFP4 stage tests' operands: 7 tokens, top-2 of 4 experts (the last idle), stage 1 K 96 (not a multiple of 64),
# N 40 under a 64 tile.
from test_fused_moe_mxfp4 import DEVICE, INTER, TOKENS, TOPK, D, E, operands, rel_l2

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, check_plan, moe_stage1, moe_stage2, quantize_weights
from tritune.kernels.fused_moe_config import is_fma
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.moe_reference import fused_moe_reference, stage1_reference, stage2_reference


def fma_config(bm: int, **changes) -> MoeConfig:
    return dataclasses.replace(MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1,
                                         num_warps=4, num_stages=2), **changes)


@pytest.mark.parametrize("quant", ["none", fm.MXFP4])
@pytest.mark.parametrize(("bm", "ksplit"), [(1, 1), (2, 2), (4, 1)])
def test_stage1_multiply_add_matches_the_reference(quant, bm, ksplit):
    hidden, w1, _, ids, weights = operands()
    w, scale = (w1.half(), None) if quant == "none" else quantize_weights(w1, quant)
    cfg = fma_config(bm, KSPLIT=ksplit)
    assert is_fma(cfg)
    sorting = moe_align_block_size(ids.to(DEVICE), bm, E)
    out = moe_stage1(hidden.to(DEVICE), w.to(DEVICE), weights.to(DEVICE), sorting, cfg, inter_dim=INTER, quant=quant,
                     w1_scale=None if scale is None else scale.to(DEVICE))
    ref = stage1_reference(hidden, w, weights, ids, inter_dim=INTER, quant=quant, w1_scale=scale)
    assert out.shape == (TOKENS * TOPK, INTER) and rel_l2(out.cpu(), ref) < 2e-3


@pytest.mark.parametrize("quant", ["none", fm.MXFP4])
@pytest.mark.parametrize("bm", [1, 8])
def test_stage2_multiply_add_matches_the_reference(quant, bm):
    _, _, w2, ids, weights = operands(inter=64)  # MXFP4: K (the intermediate) a multiple of 32
    inter = (torch.randn(TOKENS * TOPK, 64, generator=torch.Generator().manual_seed(3)) / 2).half()
    w, scale = (w2.half(), None) if quant == "none" else quantize_weights(w2, quant)
    cfg = fma_config(bm, BLOCK_SIZE_K=32)
    sorting = moe_align_block_size(ids.to(DEVICE), bm, E)
    out = moe_stage2(inter.to(DEVICE), w.to(DEVICE), weights.to(DEVICE), sorting, cfg, quant=quant,
                     w2_scale=None if scale is None else scale.to(DEVICE))
    ref = stage2_reference(inter, w, weights, ids, quant=quant, w2_scale=scale)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 2e-3


@pytest.mark.parametrize("quant", ["none", fm.MXFP4])
def test_whole_two_stage_call_with_multiply_add_stages(quant):
    """Both stages on the multiply-add path in one call, through the bound launch (sort, stages, top-k sum)."""
    hidden, w1, w2, ids, weights = operands(seed=5, inter=64)
    (q1, s1), (q2, s2) = ((w1.half(), None), (w2.half(), None)) if quant == "none" else (
        quantize_weights(w1, quant), quantize_weights(w2, quant))
    cfg = fma_config(2, BLOCK_SIZE_K=32)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = fm.fused_moe_2stage(dev(hidden), dev(q1), dev(q2), dev(weights), dev(ids), stage1=cfg, stage2=cfg,
                              quant=quant, w1_scale=dev(s1), w2_scale=dev(s2))
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 3e-3


@pytest.mark.parametrize(("changes", "kernel", "quant", "why"), [
    ({}, "stage1", "per_token", "quant none or per_1x32"),
    ({}, "stage2", "per_1x128", "quant none or per_1x32"),
    ({}, "stage1", "per_1x32_a8", "quant none or per_1x32"),
    ({"BLOCK_SIZE_D": 32}, "1stage", "none", "for stage kernels"),
    ({"USE_TMA": 1}, "stage1", "none", "without TMA"),
    ({"SWAP_AB": 1}, "stage2", "none", "SWAP_AB"),
    ({"SORTED_INTER": 2}, "stage1", "none", "SORTED_INTER"),
    ({"BLOCK_SIZE_M": 3}, "stage1", "none", "power of two"),
    ({"BLOCK_SIZE_N": 8}, "stage1", "none", "BLOCK_SIZE_N=8 must be a power of two >= 16"),
])
def test_what_the_multiply_add_path_refuses(changes, kernel, quant, why):
    with pytest.raises(ValueError, match=why):
        check_config(fma_config(4, **changes), kernel, quant)


def test_the_multiply_add_path_accepts_its_stage_kernels():
    for bm in (1, 2, 4, 8):
        for quant in ("none", fm.MXFP4):
            check_config(fma_config(bm), "stage1", quant)
            check_config(fma_config(bm, KSPLIT=4), "stage2", quant)
    check_plan(fma_config(2), fma_config(2, BLOCK_SIZE_N=128), "none")
    assert not is_fma(fma_config(16))
