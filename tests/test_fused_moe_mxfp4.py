"""MXFP4 (per_1x32) weights in the fused-MoE stage kernels (issue 16): 16-bit activations, packed e2m1 weights and
e8m0 scales decoded in registers, against the torch reference on the dequantized weights. Without a GPU these run in
Triton's interpreter: fp16 activations, tiny odd shapes (K a multiple of 32 but not of BLOCK_SIZE_K, N under a tile,
idle experts, split-K)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, moe_stage1, moe_stage2, quantize_weights
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.moe_reference import stage1_reference, stage2_reference
from tritune.kernels.mxfp4_format import dequantize_mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
TOKENS, D, INTER, E, TOPK = 7, 96, 40, 4, 2  # K 96 and 40 -> 64: stage 1 K not a multiple of BLOCK_K; N under tiles


def operands(dtype=torch.float16, topk: int = TOPK, inter: int = INTER, gated: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(TOKENS, D, generator=gen) / 2).to(dtype)
    w1 = torch.randn(E, (2 if gated else 1) * inter, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, inter, generator=gen) / inter**0.5
    ids = torch.randint(0, E - 1, (TOKENS, topk), generator=gen, dtype=torch.int32)  # expert E-1 idle
    weights = torch.rand(TOKENS, topk, generator=gen)
    return hidden, w1, w2, ids, weights


def op_module():
    return importlib.import_module("tritune.ops.fused_moe")


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(params=[False, True], ids=["decode", "dot_scaled"])
def mxfp4_gemm(request, monkeypatch):
    """Both MXFP4 GEMM paths: the weight tile decoded in registers (QUANT 3) and tl.dot_scaled (QUANT 4)."""
    monkeypatch.setattr(fm, "MXFP4_DOT_SCALED", request.param)
    return request.param


@pytest.mark.parametrize("ksplit", [1, 2], ids=["ksplit1", "ksplit2"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_stage1_with_mxfp4_weights_matches_the_dequantized_reference(ksplit, gated, mxfp4_gemm):
    inter = 64 if not gated else INTER  # stage 2 below needs K (= inter) a multiple of 32
    hidden, w1, _, ids, weights = operands(gated=gated, inter=inter)
    q1, s1 = quantize_weights(w1, fm.MXFP4)
    assert q1.dtype == s1.dtype == torch.uint8 and q1.shape == (E, w1.shape[1], D // 2)
    cfg = dataclasses.replace(CFG, KSPLIT=ksplit)
    sorting = moe_align_block_size(ids.to(DEVICE), cfg.BLOCK_SIZE_M, E)
    out = moe_stage1(hidden.to(DEVICE), q1.to(DEVICE), weights.to(DEVICE), sorting, cfg, inter_dim=inter,
                     quant=fm.MXFP4, w1_scale=s1.to(DEVICE))
    ref = stage1_reference(hidden, q1, weights, ids, inter_dim=inter, quant=fm.MXFP4, w1_scale=s1)
    assert out.shape == (TOKENS * TOPK, inter) and out.dtype == hidden.dtype
    assert rel_l2(out.cpu(), ref) < 2e-3


@pytest.mark.parametrize("ksplit", [1, 2], ids=["ksplit1", "ksplit2"])
def test_stage2_with_mxfp4_weights_matches_the_dequantized_reference(ksplit, mxfp4_gemm):
    _, _, w2, ids, weights = operands(inter=64)
    inter = (torch.randn(TOKENS * TOPK, 64, generator=torch.Generator().manual_seed(3)) / 2).half()
    q2, s2 = quantize_weights(w2, fm.MXFP4)
    cfg = dataclasses.replace(CFG, KSPLIT=ksplit, BLOCK_SIZE_K=32)
    sorting = moe_align_block_size(ids.to(DEVICE), cfg.BLOCK_SIZE_M, E)
    out = moe_stage2(inter.to(DEVICE), q2.to(DEVICE), weights.to(DEVICE), sorting, cfg, quant=fm.MXFP4,
                     w2_scale=s2.to(DEVICE))
    ref = stage2_reference(inter, q2, weights, ids, quant=fm.MXFP4, w2_scale=s2)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 2e-3


DTYPES = [pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
              DEVICE == "cpu", reason="bf16 (the packed PTX decode) needs a GPU: the interpreter runs no PTX and its "
              "bf16 tl.dot is wrong"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("gated", "ksplit"), [(True, 1), (True, 2), (False, 1)], ids=["gated", "gated-ks2", "plain"])
def test_swap_ab_stage1_with_mxfp4_weights(gated, ksplit, dtype, mxfp4_gemm):
    """SWAP_AB: the decoded weight tile as the dot's left operand (w · aᵀ, transposed once at the end), whichever
    path MXFP4_DOT_SCALED names for the unswapped case; K 96 is not a multiple of BLOCK_K 64, N 40 under a tile."""
    inter = 64 if not gated else INTER
    hidden, w1, _, ids, weights = operands(dtype=dtype, gated=gated, inter=inter)
    q1, s1 = quantize_weights(w1, fm.MXFP4)
    cfg = dataclasses.replace(CFG, SWAP_AB=1, KSPLIT=ksplit)
    check_config(cfg, "stage1", fm.MXFP4)
    sorting = moe_align_block_size(ids.to(DEVICE), cfg.BLOCK_SIZE_M, E)
    out = moe_stage1(hidden.to(DEVICE), q1.to(DEVICE), weights.to(DEVICE), sorting, cfg, inter_dim=inter,
                     quant=fm.MXFP4, w1_scale=s1.to(DEVICE))
    ref = stage1_reference(hidden, q1, weights, ids, inter_dim=inter, quant=fm.MXFP4, w1_scale=s1)
    assert out.shape == (TOKENS * TOPK, inter) and out.dtype == dtype
    assert rel_l2(out.cpu(), ref) < (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_ab_whole_call_with_mxfp4_weights(dtype):
    """Both stages swapped as the bound 2-stage call, with the sorted intermediate and the top-k atomics, and with the
    packed weights through TMA (rows of 48 and 32 bytes; K 96 is not a multiple of BLOCK_K 64, so TMA zero-fills),
    also with stage 2 reading the sorted K32 intermediate through TMA (SORTED_INTER 2)."""
    from tritune.kernels.fused_moe import fused_moe_2stage
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(dtype=dtype, inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    for levers in ({}, {"SORTED_INTER": 1, "TOPK_ATOMIC": 1}, {"USE_TMA": 1}, {"USE_TMA": 1, "KSPLIT": 2},
                   {"USE_TMA": 1, "SORTED_INTER": 2}):
        cfg1 = dataclasses.replace(CFG, SWAP_AB=1, **levers)
        cfg2 = dataclasses.replace(cfg1, BLOCK_SIZE_K=32)
        out = fused_moe_2stage(*on[:5], cfg1, cfg2, quant=fm.MXFP4, w1_scale=on[5], w2_scale=on[6])
        assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < (2e-3 if dtype == torch.float16 else 1e-2), levers


def test_swapped_tma_tiles_past_n_and_k():
    """The packed weights through TMA where a tile passes N (stage 1's gate tile reads the up half's first rows,
    stage 2's last tile the next expert's or nothing; decoded, never stored) and K (zero-filled): N 96 and K 96 on
    64-wide tiles, both stages, fp16 in the interpreter."""
    from tritune.kernels.fused_moe import fused_moe_2stage
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=96)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    cfg = dataclasses.replace(CFG, BLOCK_SIZE_N=64, SWAP_AB=1, USE_TMA=1)
    out = fused_moe_2stage(*on[:5], cfg, cfg, quant=fm.MXFP4, w1_scale=on[5], w2_scale=on[6])
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 2e-3


@pytest.mark.parametrize(("swap1", "swap2", "ksplit1", "bn1"), [(1, 0, 1, 32), (0, 1, 1, 32), (1, 1, 2, 32),
                                                               (0, 1, 2, 32), (0, 1, 1, 16), (0, 1, 2, 16)],
                         ids=["stage1-only", "stage2-only", "both-ks2", "stage2-only-ks2", "bn16", "bn16-ks2"])
def test_swapped_stages_mixed_with_plain_ones(swap1, swap2, ksplit1, bn1):
    """The swapped stages read A in the K32 order: hidden is copied so when stage 1 swaps (by the sort's first launch,
    riding along: no launch of its own), and stage 1 writes the intermediate so when stage 2 swaps (its tile
    reordered in registers, or from a 16-wide tile column by column; through split-K's partials and finish too);
    every mix gives the reference."""
    from tritune.kernels.fused_moe import fused_moe_2stage
    from tritune.kernels.fused_moe_launch import MoeLaunch
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    cfg1 = dataclasses.replace(CFG, SWAP_AB=swap1, KSPLIT=ksplit1, BLOCK_SIZE_N=bn1)
    cfg2 = dataclasses.replace(CFG, SWAP_AB=swap2, BLOCK_SIZE_K=32)
    out = fused_moe_2stage(*on[:5], cfg1, cfg2, quant=fm.MXFP4, w1_scale=on[5], w2_scale=on[6])
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 2e-3
    launch = MoeLaunch(*on[:5], on[5], on[6], stage1=cfg1, stage2=cfg2, quant=fm.MXFP4)
    names = [bound.name for bound, _ in launch.calls]
    assert "_k32_permute_kernel" not in names and launch.k32_ride == bool(swap1), names
    assert launch.calls[0][0].name == "_moe_align_first_kernel"


@pytest.mark.parametrize("kernel", ["stage1", "stage2"])
def test_swap_ab_is_refused_for_mxfp4_with_fp8_activations(kernel):
    """The swapped tile would have to decode to e4m3: not built."""
    with pytest.raises(ValueError, match=r"SWAP_AB is not for MXFP4 weights with fp8 activations \(per_1x32_a8\)$"):
        check_config(dataclasses.replace(CFG, SWAP_AB=1), kernel, fm.MXFP4_A8)
    check_config(dataclasses.replace(CFG, SWAP_AB=1), kernel, fm.MXFP4)


def test_the_reference_is_the_plain_moe_on_the_dequantized_weights():
    hidden, w1, _, ids, weights = operands()
    q1, s1 = quantize_weights(w1, fm.MXFP4)
    plain = stage1_reference(hidden, dequantize_mxfp4(q1, s1), weights, ids, inter_dim=INTER)
    assert torch.equal(stage1_reference(hidden, q1, weights, ids, inter_dim=INTER, quant=fm.MXFP4, w1_scale=s1),
                       plain)


def test_what_the_mxfp4_gemm_refuses():
    hidden, w1, _, ids, weights = operands()
    q1, s1 = quantize_weights(w1, fm.MXFP4)
    sorting = moe_align_block_size(ids.to(DEVICE), CFG.BLOCK_SIZE_M, E)
    args = (hidden.to(DEVICE), q1.to(DEVICE), weights.to(DEVICE), sorting)
    s1 = s1.to(DEVICE)

    def run(cfg=CFG, scale=s1):
        return moe_stage1(*args, cfg, inter_dim=INTER, quant=fm.MXFP4, w1_scale=scale)

    with pytest.raises(ValueError, match="needs BLOCK_SIZE_K >= 32, and SWAP_AB with USE_TMA; got BLOCK_SIZE_K=16"):
        run(dataclasses.replace(CFG, BLOCK_SIZE_K=16))
    with pytest.raises(ValueError, match="and SWAP_AB with USE_TMA; got BLOCK_SIZE_K=64, USE_TMA=1, SWAP_AB=0"):
        run(dataclasses.replace(CFG, USE_TMA=1))
    with pytest.raises(ValueError, match=r"MXFP4 weights come through TMA only in the swapped GEMM \(SWAP_AB 1"):
        check_config(dataclasses.replace(CFG, USE_TMA=1), "stage1", fm.MXFP4)
    with pytest.raises(ValueError, match="MXFP4 weights come through TMA only in the swapped GEMM"):
        check_config(dataclasses.replace(CFG, USE_TMA=1, SWAP_AB=1), "stage2", fm.MXFP4_A8)
    check_config(dataclasses.replace(CFG, USE_TMA=1, SWAP_AB=1), "stage2", fm.MXFP4)
    with pytest.raises(ValueError, match=r"scales must be uint8 e8m0 \(4, 80, 3\); got None"):
        run(scale=None)
    with pytest.raises(ValueError, match="scales must be uint8"):
        run(scale=s1.float())
    with pytest.raises(ValueError, match="scales are on meta"):
        run(scale=s1.to("meta"))
    with pytest.raises(ValueError, match=r"packed uint8 \[E, N, K/2\]"):
        moe_stage1(hidden.to(DEVICE), w1.half().to(DEVICE), weights.to(DEVICE), sorting, CFG, inter_dim=INTER,
                   quant=fm.MXFP4, w1_scale=s1)
    with pytest.raises(ValueError, match="the 1-stage kernel's BLOCK_SIZE_N too"):
        check_config(dataclasses.replace(CFG, BLOCK_SIZE_N=16, BLOCK_SIZE_D=32), "1stage", fm.MXFP4)
    check_config(dataclasses.replace(CFG, BLOCK_SIZE_D=32), "1stage", fm.MXFP4)
    check_config(CFG, "stage1", fm.MXFP4)  # what the tests above run passes
    assert fm.MXFP4 not in fm.QUANT_TYPES and fm.MXFP4 in fm.ALL_QUANTS


def test_whole_reference_reads_the_intermediate_size_through_the_packing():
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    got = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    plain = fused_moe_reference(hidden, dequantize_mxfp4(q1, s1), dequantize_mxfp4(q2, s2), weights, ids)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("levers", [{}, {"SORTED_INTER": 1}, {"SORTED_INTER": 1, "TOPK_ATOMIC": 1}, {"KSPLIT": 2}],
                         ids=["plain", "sorted", "sorted-atomic", "ksplit2"])
def test_whole_two_stage_call_with_mxfp4_weights(levers):
    """The bound 2-stage call (sort, both GEMMs, the top-k sum): activations stay 16-bit, no quantization launch,
    the same answer as the reference on the dequantized weights, with the plan levers and split-K too."""
    from tritune.kernels.fused_moe import fused_moe_2stage
    from tritune.kernels.fused_moe_launch import MoeLaunch
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    cfg1 = dataclasses.replace(CFG, **levers)
    cfg2 = dataclasses.replace(CFG, BLOCK_SIZE_K=32, **levers)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    out = fused_moe_2stage(*on[:5], cfg1, cfg2, quant=fm.MXFP4, w1_scale=on[5], w2_scale=on[6])
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 2e-3
    launch = MoeLaunch(*on[:5], on[5], on[6], stage1=cfg1, stage2=cfg2, quant=fm.MXFP4)
    assert launch.quant2 is None and not launch.fused_quant  # nothing quantizes the activations or the intermediate


@pytest.mark.parametrize("levers", [{}, {"SORTED_INTER": 1, "TOPK_ATOMIC": 1}, {"KSPLIT": 2}],
                         ids=["plain", "sorted-atomic", "ksplit2"])
def test_fp8_activations_with_mxfp4_weights(levers):
    """per_1x32_a8: the activations and the intermediate quantized to fp8 per token (as per_token does), the MXFP4
    weights through tl.dot_scaled (e4m3 x e2m1), the per-token scale in the epilogue; against the reference on the
    same fp8 activations and the dequantized weights, stage by stage and as the bound 2-stage call."""
    from tritune.kernels.fused_moe import fused_moe_2stage
    from tritune.kernels.fused_moe_launch import MoeLaunch
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4_A8), quantize_weights(w2, fm.MXFP4_A8)
    cfg1 = dataclasses.replace(CFG, **levers)
    cfg2 = dataclasses.replace(CFG, BLOCK_SIZE_K=32, **levers)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    if not levers:
        sorting = moe_align_block_size(on[4], CFG.BLOCK_SIZE_M, E)
        inter = moe_stage1(on[0], on[1], on[3], sorting, cfg1, inter_dim=64, quant=fm.MXFP4_A8, w1_scale=on[5])
        ref1 = stage1_reference(hidden, q1, weights, ids, inter_dim=64, quant=fm.MXFP4_A8, w1_scale=s1)
        assert rel_l2(inter.cpu(), ref1) < 2e-3
    out = fused_moe_2stage(*on[:5], cfg1, cfg2, quant=fm.MXFP4_A8, w1_scale=on[5], w2_scale=on[6])
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4_A8, w1_scale=s1, w2_scale=s2)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 1e-2
    # fp8 activations: far from the 16-bit path's answer only by the activations' quantization
    mx16 = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    assert 1e-3 < rel_l2(out.cpu(), mx16) < 0.1
    launch = MoeLaunch(*on[:5], on[5], on[6], stage1=cfg1, stage2=cfg2, quant=fm.MXFP4_A8)
    assert launch.quant2 is not None  # the intermediate's per-token quantization launch


@pytest.mark.parametrize("quant", [fm.MXFP4, fm.MXFP4_A8])
def test_one_stage_kernel_with_mxfp4_weights(quant, mxfp4_gemm):
    """Both GEMMs in one launch: gate-up through the MXFP4 GEMM path (decode, dot_scaled, or fp8 A), w2's slice of
    each row decoded for the second; against the reference that keeps the intermediate 16-bit, as the kernel does.
    BLOCK_SIZE_N 32 over I = 64: two slices, each one scale block of w2's rows; D = 96 over BLOCK_SIZE_D 64: one
    masked output block."""
    from tritune.kernels.fused_moe_1stage import fused_moe_1stage
    from tritune.kernels.moe_reference import fused_moe_reference

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    cfg = dataclasses.replace(CFG, BLOCK_SIZE_D=64)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    out = fused_moe_1stage(*on[:5], cfg, quant=quant, w1_scale=on[5], w2_scale=on[6])
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2,
                              requantize_intermediate=False)
    assert out.shape == (TOKENS, D) and rel_l2(out.cpu(), ref) < 1e-2


def test_the_whole_call_refuses_bad_mxfp4_operands():
    from tritune.kernels.fused_moe import fused_moe_2stage

    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    cfg2 = dataclasses.replace(CFG, BLOCK_SIZE_K=32)
    with pytest.raises(ValueError, match=r"per_1x32 wants w2_scale uint8 contiguous \(4, 96, 2\), got None"):
        fused_moe_2stage(hidden, q1, q2, weights, ids, CFG, cfg2, quant=fm.MXFP4, w1_scale=s1)
    with pytest.raises(ValueError, match="shapes disagree"):  # unpacked weights: K twice what MXFP4 stores
        fused_moe_2stage(hidden, w1.half(), q2, weights, ids, CFG, cfg2, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="wants w1/w2 of torch.uint8, got torch.int8"):
        fused_moe_2stage(hidden, q1.view(torch.int8), q2, weights, ids, CFG, cfg2, quant=fm.MXFP4, w1_scale=s1,
                         w2_scale=s2)
    with pytest.raises(ValueError, match="expected 2·inter_dim = 128"):
        fused_moe_2stage(hidden, q1[:, :100], q2, weights, ids, CFG, cfg2, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)


@pytest.fixture
def four_sms(monkeypatch):
    """The op's rule table on a 4-SM device, where this file's tiny MoE fills the waves the swapped 1-stage kernel
    wants (a full-size GPU sends it to the stage pair)."""
    op = importlib.import_module("tritune.ops.fused_moe")
    real = op._device_facts
    monkeypatch.setattr(op, "_device_facts", lambda index: (4, *real(index)[1:]))
    op.reload_moe_configs()
    yield
    op.reload_moe_configs()


@pytest.mark.parametrize("sms", [132, 4], ids=["stage pair", "1-stage"])
def test_the_op_serves_mxfp4_with_the_rule_tables_kernels(sms, request):
    from tritune import ops
    from tritune.kernels.moe_reference import fused_moe_reference

    if sms == 4:
        request.getfixturevalue("four_sms")
    hidden, w1, w2, ids, weights = operands(inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    on = [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]
    choice = ops.fused_moe_choice(on[0], on[1], on[2], on[4], quant=fm.MXFP4)
    codes_rule = op_module()._rule_choice(on[0], on[1], on[2], on[4], "silu", fm.MXFP4, False, scale_records=False)
    # the scales as codes: the stage pair, the swapped GEMM with its packed weights through TMA (the heuristic's Hopper
    # rule; the interpreter runs it too)
    assert not codes_rule.run_1stage and choice.source == "heuristic"
    assert all(c.SWAP_AB == 1 and c.USE_TMA == 1 and c.SORTED_INTER == 0 and c.BLOCK_SIZE_K >= 32
               for c in (codes_rule.stage1, codes_rule.stage2))
    # with the codes' records (the choice): on 132 SMs the stage pair (4 blocks x 1 slice, 8 splits would not make a
    # wave); on 4 SMs the swapped 1-stage kernel, unsplit (K 96: not 2 steps a split)
    assert choice.run_1stage == (sms == 4)
    if sms == 4:
        assert choice.stage1.KSPLIT == 1 and choice.stage1.SWAP_AB == choice.stage1.SCALE_TMA == 1
        p1, p2 = ops.prepare_mxfp4_scales(on[5]), ops.prepare_mxfp4_scales(on[6])
        one = ops.fused_moe(on[0], on[1], on[2], on[3], on[4], quant=fm.MXFP4, w1_scale=p1, w2_scale=p2)
        ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
        assert rel_l2(one.cpu(), ref) < 2e-3
    ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    first = ops.fused_moe_mxfp4(*on)
    assert first.shape == (TOKENS, D) and rel_l2(first.cpu(), ref) < 2e-3
    assert torch.equal(ops.fused_moe_mxfp4(*on), first)  # the bound plan, again
    # fp8 per-token activations: act_dtype picks per_1x32_a8 on the same MXFP4 weights
    ref8 = fused_moe_reference(hidden, q1, q2, weights, ids, quant=fm.MXFP4_A8, w1_scale=s1, w2_scale=s2)
    a8 = ops.fused_moe_mxfp4(*on, act_dtype=torch.float8_e4m3fn)
    assert rel_l2(a8.cpu(), ref8) < 1e-2 and not torch.equal(a8, first)
    assert ops.fused_moe_choice(on[0], on[1], on[2], on[4], quant=fm.MXFP4_A8).source == "heuristic"
    with pytest.raises(ValueError, match="act_dtype torch.float32: expected None, torch.float16 or "
                                         "torch.float8_e4m3fn"):
        ops.fused_moe_mxfp4(*on, act_dtype=torch.float32)


def test_the_rule_table_gives_mxfp4_only_the_swapped_1_stage_kernel():
    from tritune.ops.heuristics import moe_heuristic

    for tokens in (1, 3, 64):  # 4 to 256 pairs: the swapped 1-stage kernel (test_heuristics.py has its bounds)
        run_1stage, one, none = moe_heuristic(tokens, 2880, 2880, 128, 4, fm.MXFP4)
        assert run_1stage and none is None and one.SWAP_AB == one.USE_TMA == 1
        check_config(one, "1stage", fm.MXFP4)
    for tokens in (4096,):
        run_1stage, s1, s2 = moe_heuristic(tokens, 2880, 2880, 128, 4, fm.MXFP4)
        assert not run_1stage and s2 is not None
        for cfg, kernel in ((s1, "stage1"), (s2, "stage2")):
            check_config(cfg, kernel, fm.MXFP4)
            assert cfg.USE_TMA == 1 and cfg.SWAP_AB == 1 and cfg.SORTED_INTER == 0
    # before Hopper, no TMA
    _, s1, s2 = moe_heuristic(64, 2880, 2880, 128, 4, fm.MXFP4, capability=(8, 0))
    assert s1.USE_TMA == 0 and s2.USE_TMA == 0


def test_the_op_refuses_scales_past_the_bf16_decodes_range_once_per_buffer(monkeypatch):
    """The bf16 decode folds 2**126 into the scale (kernels/mxfp4.py K32_FOLD): codes past 192 would decode to inf or
    NaN, so the op refuses them with the tensor, the code and where it sits, and checks each scale buffer only once."""
    import importlib

    from tritune import ops

    op = importlib.import_module("tritune.ops.fused_moe")  # the module (tritune.ops.fused_moe is also the function)
    hidden, w1, w2, ids, weights = operands(dtype=torch.bfloat16, inter=64)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    bad = s2.clone()
    bad[2, 5, 1] = 200
    with pytest.raises(ValueError, match=r"w2_scale: e8m0 code 200 at \[2, 5, 1\] exceeds 192"):
        ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, s1, bad)
    edge = s1.clone()
    edge[0, 0, 0] = 192
    op._check_mxfp4_scale_range(edge, s2)  # 192 is the last code in range
    maxes = []
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a: maxes.append(1) or torch.amax(self))
    op._check_mxfp4_scale_range(edge, s2)
    assert maxes == []  # both buffers were checked above: no second sync
    op._check_mxfp4_scale_range(edge, s2.clone())
    assert maxes == [1]
