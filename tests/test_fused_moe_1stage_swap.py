"""The swapped MXFP4 1-stage kernel (`fused_moe_1stage._moe_1stage_swap_kernel`: both GEMMs of a block's BLOCK_N slice
of the intermediate in one program, the decoded weights the wgmma's register operand): against the stage pair on
the same weights and the dequantized reference, on odd shapes (an idle expert, one expert taking every token, top-1,
inter_dim and model_dim not multiples of any tile, an ungated w1), every operand form (standard and prepared weights,
TMA and pointers, the codes and their records), and its one-line refusals. Without a GPU these run in Triton's
interpreter, fp16; the bf16 PTX decode is test_runtime_gpu.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, fused_moe_2stage, quantize_weights
from tritune.kernels.fused_moe_1stage import fused_moe_1stage
from tritune.kernels.fused_moe_launch import MoeLaunch
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.kernels.mxfp4_records import prepare_mxfp4_scales
from tritune.kernels.mxfp4_swizzle import prepare_mxfp4_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
TOL = 1e-2 if DTYPE == torch.bfloat16 else 2e-3
TOKENS, D, E = 9, 160, 4  # D 160: a 128-wide K step and a partial one; past a 128-row BLOCK_D
ONE = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=128, GROUP_SIZE_M=1, num_warps=8,
                num_stages=2, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
PAIR = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                 SWAP_AB=1, USE_TMA=1)


def operands(inter: int = 192, topk: int = 2, gated: bool = True, ids=None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(TOKENS, D, generator=gen) / 2).to(DTYPE)
    w1 = torch.randn(E, (2 if gated else 1) * inter, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, inter, generator=gen) / inter**0.5
    if ids is None:
        ids = torch.randint(0, E - 1, (TOKENS, topk), generator=gen, dtype=torch.int32)  # expert E-1 idle
    weights = torch.rand(TOKENS, topk, generator=gen)
    (q1, s1), (q2, s2) = quantize_weights(w1, fm.MXFP4), quantize_weights(w2, fm.MXFP4)
    return [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm().clamp_min(1e-30))


def reference(hidden, q1, q2, weights, ids, s1, s2) -> torch.Tensor:
    return fused_moe_reference(*(t.cpu() for t in (hidden, q1, q2, weights, ids)), quant=fm.MXFP4,
                               w1_scale=s1.cpu(), w2_scale=s2.cpu())


@pytest.mark.parametrize("fields", [
    {}, {"SCALE_TMA": 0}, {"USE_TMA": 0, "SCALE_TMA": 0}, {"BLOCK_SIZE_D": 64},
    {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_D": 64, "num_warps": 4, "SCALE_TMA": 0},
    {"BLOCK_SIZE_K": 64, "SCALE_TMA": 0}, {"BLOCK_SIZE_M": 32}, {"KSPLIT": 2},
    {"KSPLIT": 4, "USE_TMA": 0, "SCALE_TMA": 0},
], ids=["records", "codes", "pointers", "64-row w2 tiles", "64-wide slices", "64-deep w1 steps", "32-row blocks",
        "split 2", "split 4 (two empty), pointers"])
@pytest.mark.parametrize("prepared", [False, True], ids=["standard", "prepared"])
def test_the_whole_call_matches_the_stage_pair_and_the_reference(fields, prepared):
    """inter_dim 192: a 128-wide slice past it (the rest masked) or three 64-wide ones."""
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    cfg = dataclasses.replace(ONE, **fields)
    pair = fused_moe_2stage(hidden, q1, q2, weights, ids, PAIR, PAIR, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    w1, w2 = (prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2)) if prepared else (q1, q2)
    got = fused_moe_1stage(hidden, w1, w2, weights, ids, cfg, quant=fm.MXFP4, w1_scale=prepare_mxfp4_scales(s1),
                           w2_scale=prepare_mxfp4_scales(s2))
    assert got.shape == (TOKENS, D) and got.dtype == DTYPE
    assert rel_l2(got, pair) < TOL and rel_l2(got, reference(hidden, q1, q2, weights, ids, s1, s2)) < TOL
    if cfg.KSPLIT > 1:  # the counters start from zero every call (the sort's first launch zeroes them)
        again = fused_moe_1stage(hidden, w1, w2, weights, ids, cfg, quant=fm.MXFP4,
                                 w1_scale=prepare_mxfp4_scales(s1), w2_scale=prepare_mxfp4_scales(s2))
        assert rel_l2(again, got) < 1e-5


@pytest.mark.parametrize("case", ["top-1", "one expert takes every token", "ungated", "silu on 64-wide inter"])
def test_odd_routing_and_shapes(case):
    kw = {"top-1": {"topk": 1}, "ungated": {"gated": False, "inter": 96},
          "one expert takes every token": {"ids": torch.stack([torch.full((TOKENS,), 2), torch.arange(TOKENS) % 2],
                                                              1).to(torch.int32)},
          "silu on 64-wide inter": {"inter": 64}}[case]
    hidden, q1, q2, weights, ids, s1, s2 = operands(**kw)
    cfg = ONE if case != "ungated" else dataclasses.replace(ONE, SCALE_TMA=0)  # 96 rows: no whole records
    got = fused_moe_1stage(hidden, prepare_mxfp4_weights(q1) if case != "ungated" else q1,
                           prepare_mxfp4_weights(q2) if case != "ungated" else q2, weights, ids, cfg, quant=fm.MXFP4,
                           w1_scale=prepare_mxfp4_scales(s1), w2_scale=prepare_mxfp4_scales(s2))
    assert rel_l2(got, reference(hidden, q1, q2, weights, ids, s1, s2)) < TOL


@pytest.mark.parametrize(("fields", "match"), [
    ({"BLOCK_SIZE_N": 32, "SCALE_TMA": 0}, "BLOCK_SIZE_N 64 or 128"),
    ({"num_warps": 4}, r"at most 16 x num_warps = 64"),
    ({"BLOCK_SIZE_D": 96}, "BLOCK_SIZE_D a multiple of 64"),
    ({"BLOCK_SIZE_N": 64, "BLOCK_SIZE_D": 64, "num_warps": 4}, "records .* only with BLOCK_SIZE_N 128"),
    ({"BLOCK_SIZE_K": 256, "SCALE_TMA": 0}, "BLOCK_SIZE_K <= 128"),
])
def test_what_the_config_refuses(fields, match):
    with pytest.raises(ValueError, match=match):
        check_config(dataclasses.replace(ONE, **fields), "1stage", fm.MXFP4)


def test_what_the_call_refuses():
    with pytest.raises(ValueError, match="for per_1x32 with 16-bit activations"):
        check_config(dataclasses.replace(ONE, SCALE_TMA=0), "1stage", "none")
    with pytest.raises(ValueError, match=r"SCALE_TMA \(0 or 1\) is for the swapped"):  # unswapped: no records
        check_config(dataclasses.replace(ONE, SWAP_AB=0, USE_TMA=0, BLOCK_SIZE_D=64, num_warps=4), "1stage",
                     fm.MXFP4)
    hidden, q1, q2, weights, ids, s1, s2 = operands(inter=96)  # a gated w1's up rows at 96: on no record or chunk
    with pytest.raises(ValueError, match="inter_dim a multiple of 64"):  # the records
        fused_moe_1stage(hidden, q1, q2, weights, ids, ONE, quant=fm.MXFP4, w1_scale=prepare_mxfp4_scales(s1),
                         w2_scale=prepare_mxfp4_scales(s2))
    with pytest.raises(ValueError, match="inter_dim a multiple of 64"):  # the prepared weights
        fused_moe_1stage(hidden, prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2), weights, ids,
                         dataclasses.replace(ONE, SCALE_TMA=0), quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    codes = fused_moe_1stage(hidden, q1, q2, weights, ids, dataclasses.replace(ONE, SCALE_TMA=0), quant=fm.MXFP4,
                             w1_scale=s1, w2_scale=s2)  # codes and standard bytes: any inter_dim
    assert rel_l2(codes, reference(hidden, q1, q2, weights, ids, s1, s2)) < TOL
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    with pytest.raises(ValueError, match="both prepared .* or both standard"):
        fused_moe_1stage(hidden, prepare_mxfp4_weights(q1), q2, weights, ids, ONE, quant=fm.MXFP4,
                         w1_scale=prepare_mxfp4_scales(s1), w2_scale=prepare_mxfp4_scales(s2))
    with pytest.raises(ValueError, match="reads the standard packed MXFP4 bytes"):  # the unswapped kernel
        fused_moe_1stage(hidden, prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2), weights, ids,
                         dataclasses.replace(ONE, SWAP_AB=0, USE_TMA=0, SCALE_TMA=0, BLOCK_SIZE_D=64, num_warps=4),
                         quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)


def test_its_name_reads_back_and_older_1_stage_names_are_unchanged():
    name = ONE.name("1stage", fm.MXFP4)
    assert name == "moe_1stage_per_1x32_silu_BM16_BN128_BK128_GM1_W8_S2_KS1_BD128_TMA1_SW1_ST1"
    assert MoeConfig.parse_name(name) == ("1stage", ONE)
    old = dataclasses.replace(ONE, SWAP_AB=0, USE_TMA=0, SCALE_TMA=0)
    assert old.name("1stage", "none") == "moe_1stage_none_silu_BM16_BN128_BK128_GM1_W8_S2_KS1_BD128"


def test_registers_are_capped_only_past_two_split_programs_an_sm(monkeypatch):
    """register_cap: SPLIT_MAXNREG for split configs whose programs (a block an expert × 128-wide slices × splits) pass
    two an SM, where three then fit; none unsplit, in the interpreter, without an SM count; MAXNREG overrides."""
    from tritune.kernels import fused_moe_1stage as f1

    monkeypatch.setattr(f1, "interpreting", lambda: False)
    split = {k: dataclasses.replace(ONE, KSPLIT=k) for k in (1, 2, 4)}
    # gpt-oss-120b (E 128, I 2880: 23 slices) on 132 SMs: 1 token (4 pairs) split 4 = 368 programs, split 2 = 184
    assert f1.register_cap(split[4], 4, 128, 2880, 132) == f1.SPLIT_MAXNREG == 80
    assert f1.register_cap(split[2], 4, 128, 2880, 132) is None
    assert f1.register_cap(split[2], 8, 128, 2880, 132) == 80  # 2 tokens: 368
    assert f1.register_cap(split[1], 64, 128, 2880, 132) is None  # unsplit: about 60 registers already
    assert f1.register_cap(split[4], 6, 64, 1408, 132) is None  # 6 x 11 x 4 = 264: two an SM exactly
    assert f1.register_cap(split[4], 400, 4, 2880, 200) is None  # 4 experts: 4 blocks x 23 x 4 = 368 of 400 ...
    assert f1.register_cap(split[4], 400, 4, 2880, 132) == 80  # ... and past two an SM of 132
    assert f1.register_cap(split[4], 4, 128, 2880, None) is None
    monkeypatch.setattr(f1, "MAXNREG", 0)
    assert f1.register_cap(split[4], 4, 128, 2880, 132) is None
    monkeypatch.setattr(f1, "MAXNREG", 96)
    assert f1.register_cap(split[1], 4, 128, 2880, 132) == 96
    monkeypatch.setattr(f1, "MAXNREG", None)
    monkeypatch.setattr(f1, "interpreting", lambda: True)
    assert f1.register_cap(split[4], 4, 128, 2880, 132) is None


def prepared_split_call(ksplit: int):
    """(a call of the swapped 1-stage kernel split `ksplit` ways on prepared weights and scales, (hidden, prepared w1,
    w2, weights, ids, scale codes s1, s2), its config): the GPU cases that switch a kernel option and compare the
    result with the plain call's. Each call binds anew, so a module switch set between two calls takes effect."""
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    w1, w2 = prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2)
    cfg = dataclasses.replace(ONE, KSPLIT=ksplit)

    def call():
        return fused_moe_1stage(hidden, w1, w2, weights, ids, cfg, quant=fm.MXFP4, w1_scale=prepare_mxfp4_scales(s1),
                                w2_scale=prepare_mxfp4_scales(s2))

    return call, (hidden, w1, w2, weights, ids, s1, s2), cfg


def test_w2_is_prefetched_from_four_splits_and_the_probe_overrides_it(monkeypatch):
    """prefetch_w2: 1 (the slice's first split to arrive asks the L2 for its w2 chunks) from PREFETCH_W2_MIN_SPLIT
    splits, where it measured faster; 0 below, where it lost; PREFETCH_W2 overrides."""
    from tritune.kernels import fused_moe_1stage as f1

    split = {k: dataclasses.replace(ONE, KSPLIT=k) for k in (1, 2, 4, 8)}
    assert [f1.prefetch_w2(split[k]) for k in (1, 2, 4, 8)] == [0, 0, 1, 1] and f1.PREFETCH_W2_MIN_SPLIT == 4
    monkeypatch.setattr(f1, "PREFETCH_W2", 2)
    assert f1.prefetch_w2(split[1]) == f1.prefetch_w2(split[4]) == 2


@pytest.mark.skipif(DEVICE != "cuda", reason="the L2 prefetch is PTX (the interpreter runs the splits one at a time, "
                                              "none waiting, and never prefetches)")
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_w2_prefetch_leaves_the_result_unchanged(monkeypatch, mode):
    from tritune.kernels import fused_moe_1stage as f1

    call, _, _ = prepared_split_call(4)
    monkeypatch.setattr(f1, "PREFETCH_W2", 0)
    plain = call()
    monkeypatch.setattr(f1, "PREFETCH_W2", mode)
    assert rel_l2(call(), plain) < 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="ptxas' register cap and the phase stamps are GPU-only (the interpreter "
                                              "runs no PTX and ignores both)")
@pytest.mark.parametrize("cap", [80, 64])
def test_capped_registers_and_the_phase_stamps_leave_the_result_unchanged(monkeypatch, cap):
    from tritune.kernels import fused_moe_1stage as f1

    call, (hidden, w1, w2, weights, ids, s1, s2), cfg = prepared_split_call(2)
    plain = call()
    monkeypatch.setattr(f1, "MAXNREG", cap)
    monkeypatch.setattr(f1, "TRACE", True)
    assert rel_l2(call(), plain) < 1e-5
    # the stamps of one plan's call: every program that ran its slice stamps its phases in order, on a real SM
    ws1, ws2 = prepare_mxfp4_scales(s1).records, prepare_mxfp4_scales(s2).records
    launch = MoeLaunch(hidden, w1, w2, weights, ids, ws1, ws2, stage1=cfg, stage2=None, activation="silu",
                       quant=fm.MXFP4)
    out = torch.empty_like(plain)
    launch(hidden, w1, w2, weights, ids, ws1, ws2, out)
    launch.trace_stamps().zero_()  # programs past the sort's blocks return before stamping
    launch(hidden, w1, w2, weights, ids, ws1, ws2, out)
    stamps = launch.trace_stamps().cpu()
    ran = stamps[stamps[:, 4] > 0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert rel_l2(out, plain) < 1e-5 and len(ran) >= 2
    assert (ran[:, 1:5] >= ran[:, 0:4]).all() and ((ran[:, 5] >= 0) & (ran[:, 5] < sms)).all()
    assert sorted(ran[:, 6].tolist()) == sorted(set(ran[:, 6].tolist()))  # each work item once


def test_phase_stamps_are_refused_where_the_plan_has_none():
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    ws1, ws2 = prepare_mxfp4_scales(s1).records, prepare_mxfp4_scales(s2).records
    launch = MoeLaunch(hidden, q1, q2, weights, ids, ws1, ws2, stage1=ONE, stage2=None, activation="silu",
                       quant=fm.MXFP4)
    launch(hidden, q1, q2, weights, ids, ws1, ws2, torch.empty(TOKENS, D, dtype=DTYPE, device=DEVICE))
    with pytest.raises(ValueError, match="no phase stamps: bind the plan with fused_moe_1stage.TRACE on a GPU"):
        launch.trace_stamps()
