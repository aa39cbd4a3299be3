"""MXFP4 scale records (kernels/mxfp4_records.py) and the swapped GEMM reading its codes through TMA (SCALE_TMA): the
layout, the one-line refusals, both stages and the whole call against the pointer path (bit-equal: the same codes
decoded the same way) and the dequantized reference, split-K, tiles past N and K, and the op taking prepared scales
(and turning SCALE_TMA off for plain codes). Without a GPU these run in Triton's interpreter, fp16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, fused_moe_2stage, moe_stage1, moe_stage2
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.kernels.mxfp4_records import Mxfp4Scales, prepare_mxfp4_scales, records_shape, scale_records

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
TOL = 1e-2 if DTYPE == torch.bfloat16 else 2e-3  # against the fp32 reference (as test_fused_moe_mxfp4.py)
TOKENS, D, INTER, E, TOPK = 9, 160, 64, 4, 2  # K 160: a 128 step and a partial one; N_W 128, D 160 past a tile
ST = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
               SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)


def operands(inter: int = INTER, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(TOKENS, D, generator=gen) / 2).to(DTYPE)
    w1 = torch.randn(E, 2 * inter, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, inter, generator=gen) / inter**0.5
    ids = torch.randint(0, E - 1, (TOKENS, TOPK), generator=gen, dtype=torch.int32)  # expert E-1 idle
    weights = torch.rand(TOKENS, TOPK, generator=gen)
    (q1, s1), (q2, s2) = fm.quantize_weights(w1, fm.MXFP4), fm.quantize_weights(w2, fm.MXFP4)
    return [t.to(DEVICE) for t in (hidden, q1, q2, weights, ids, s1, s2)]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def test_records_hold_each_step_and_block_row_by_row_with_scale_1_past_n_and_k():
    codes = (torch.arange(2 * 70 * 5, dtype=torch.int32) % 193).reshape(2, 70, 5).to(torch.uint8)  # up to 192
    rec = scale_records(codes)
    assert tuple(rec.shape) == records_shape(2, 70, 160) == (2, 2, 2, 256) and rec.is_contiguous()
    r = rec[1, 0, 1].reshape(64, 4)  # expert 1, rows 0-63, K step 1 (codes 4-7, only 4 exists)
    assert torch.equal(r[:, 0], codes[1, :64, 4]) and bool((r[:, 1:] == 127).all())
    r = rec[0, 1, 0].reshape(64, 4)  # expert 0, rows 64-127 (64-69 exist), K step 0
    assert torch.equal(r[:6], codes[0, 64:70, :4]) and bool((r[6:] == 127).all())


def test_records_store_codes_past_193_as_193_the_folded_decodes_inf():
    codes = torch.tensor([0, 127, 192, 193, 194, 254, 255, 7], dtype=torch.uint8).reshape(1, 2, 4)
    rec = scale_records(codes)[0, 0, 0].reshape(64, 4)
    assert rec[:2].tolist() == [[0, 127, 192, 193], [193, 193, 193, 7]]


def test_the_refusals_name_what_is_wrong():
    codes = torch.zeros(2, 64, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"records must be contiguous uint8 \(2, 1, 1, 256\)"):
        Mxfp4Scales(codes, torch.zeros(2, 1, 2, 256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="want uint8 e8m0 codes"):
        scale_records(codes.float())
    for bad in ({"BLOCK_SIZE_K": 64}, {"USE_TMA": 0}, {"BLOCK_SIZE_N": 32}, {"SCALE_TMA": 2}):
        with pytest.raises(ValueError, match="SCALE_TMA"):
            check_config(dataclasses.replace(ST, **bad), "stage1", fm.MXFP4)
    with pytest.raises(ValueError, match="SCALE_TMA"):
        check_config(ST, "1stage", fm.MXFP4)
    hidden, q1, _, weights, ids, s1, _ = operands(inter=96)  # the up rows start at 96: not on a record
    sorting = moe_align_block_size(ids, ST.BLOCK_SIZE_M, E)
    with pytest.raises(ValueError, match="inter_dim a multiple of 64"):
        moe_stage1(hidden, q1, weights, sorting, ST, inter_dim=96, quant=fm.MXFP4, w1_scale=s1)


@pytest.mark.parametrize("ksplit", [1, 2])
def test_both_stages_read_the_records_as_the_pointer_path_reads_the_codes(ksplit):
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    st = dataclasses.replace(ST, KSPLIT=ksplit)
    plain = dataclasses.replace(st, SCALE_TMA=0)
    sorting = moe_align_block_size(ids, st.BLOCK_SIZE_M, E)
    got = moe_stage1(hidden, q1, weights, sorting, st, inter_dim=INTER, quant=fm.MXFP4,
                     w1_scale=prepare_mxfp4_scales(s1))
    want = moe_stage1(hidden, q1, weights, sorting, plain, inter_dim=INTER, quant=fm.MXFP4, w1_scale=s1)
    assert torch.equal(got, want)
    assert torch.equal(moe_stage1(hidden, q1, weights, sorting, st, inter_dim=INTER, quant=fm.MXFP4, w1_scale=s1),
                       want)  # plain codes: re-laid on the fly
    inter = want.to(DTYPE)
    got2 = moe_stage2(inter, q2, weights, sorting, st, quant=fm.MXFP4, w2_scale=prepare_mxfp4_scales(s2))
    want2 = moe_stage2(inter, q2, weights, sorting, plain, quant=fm.MXFP4, w2_scale=s2)
    assert torch.equal(got2, want2)


def test_the_whole_call_with_records_matches_the_reference_and_the_pointer_path():
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    ref = fused_moe_reference(*(t.cpu() for t in (hidden, q1, q2, weights, ids)), quant=fm.MXFP4,
                              w1_scale=s1.cpu(), w2_scale=s2.cpu())
    p1, p2 = prepare_mxfp4_scales(s1), prepare_mxfp4_scales(s2)
    plain = dataclasses.replace(ST, SCALE_TMA=0)
    want = fused_moe_2stage(hidden, q1, q2, weights, ids, plain, plain, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
    for levers in ({}, {"SORTED_INTER": 1, "TOPK_ATOMIC": 1}):
        st = dataclasses.replace(ST, **levers)
        got = fused_moe_2stage(hidden, q1, q2, weights, ids, st, st, quant=fm.MXFP4, w1_scale=p1, w2_scale=p2)
        assert rel_l2(got, ref) < TOL, levers
        if not levers:
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="scale records need SCALE_TMA"):
        fm_launch = __import__("tritune.kernels.fused_moe_launch", fromlist=["MoeLaunch"])
        fm_launch.MoeLaunch(hidden, q1, q2, weights, ids, p1.records, s2, stage1=plain, stage2=plain, quant=fm.MXFP4)


def test_the_op_takes_prepared_scales_and_turns_scale_tma_off_for_plain_codes():
    from tritune import ops
    from tritune.ops.fused_moe import MoeChoice

    hidden, q1, q2, weights, ids, s1, s2 = operands()
    choice = MoeChoice(False, ST, ST, "test")
    prepared = ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, ops.prepare_mxfp4_scales(s1),
                                   ops.prepare_mxfp4_scales(s2))  # the rule table's own choice
    forced = ops.fused_moe(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=ops.prepare_mxfp4_scales(s1),
                           w2_scale=ops.prepare_mxfp4_scales(s2), choice=choice)
    with pytest.warns(UserWarning, match="SCALE_TMA"):  # a forced choice with records' tiles, given codes
        plain = ops.fused_moe(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2, choice=choice)
    ref = fused_moe_reference(*(t.cpu() for t in (hidden, q1, q2, weights, ids)), quant=fm.MXFP4,
                              w1_scale=s1.cpu(), w2_scale=s2.cpu())
    assert torch.equal(forced, plain) and rel_l2(forced, ref) < TOL and rel_l2(prepared, ref) < TOL
    heur = ops.fused_moe_choice(hidden, q1, q2, ids, quant=fm.MXFP4)
    # the rule table asks for it where BLOCK_K is 128 (stage 1; stage 2's K of 64 takes BLOCK_K 64)
    assert (heur.stage1.SCALE_TMA, heur.stage2.SCALE_TMA, heur.stage2.BLOCK_SIZE_K) == (1, 0, 64)
    # the swapped 1-stage kernel reads both records; given codes, a forced choice reads them by pointers
    one_cfg = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=128, GROUP_SIZE_M=1,
                        num_warps=8, num_stages=2, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
    records = ops.fused_moe(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=ops.prepare_mxfp4_scales(s1),
                            w2_scale=ops.prepare_mxfp4_scales(s2), choice=MoeChoice(True, one_cfg, None, "test"))
    with pytest.warns(UserWarning, match="SCALE_TMA"):
        codes = ops.fused_moe(hidden, q1, q2, weights, ids, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2,
                              choice=MoeChoice(True, one_cfg, None, "test"))
    assert rel_l2(records, ref) < TOL and rel_l2(codes, records.float().cpu()) < 1e-5


def test_plain_codes_get_the_codes_only_rule_or_the_tuned_tiles_without_scale_tma():
    import importlib

    from tritune.ops.fused_moe import MoeChoice

    op = importlib.import_module("tritune.ops.fused_moe")
    codes, records = torch.zeros(4, 128, 5, dtype=torch.uint8), torch.zeros(4, 2, 2, 256, dtype=torch.uint8)
    rule = MoeChoice(False, ST, ST, "heuristic")
    plain = dataclasses.replace(ST, SCALE_TMA=0)
    codes_rule = MoeChoice(False, dataclasses.replace(plain, num_stages=3), plain, "heuristic")
    assert op._scale_tma_as_given(rule, codes, codes, lambda: codes_rule) is codes_rule
    assert op._scale_tma_as_given(rule, records, records, lambda: codes_rule) is rule  # records: as chosen
    with pytest.warns(UserWarning, match=r"tuned: f.csv, row 1 reads the MXFP4 codes through TMA .* "
                                         r"tritune.ops.prepare_mxfp4_scales"):
        tuned = op._scale_tma_as_given(MoeChoice(False, ST, ST, "tuned: f.csv, row 1"), codes, records, None)
    assert (tuned.stage1.SCALE_TMA, tuned.stage2.SCALE_TMA) == (0, 1) and "SCALE_TMA off" in tuned.source
    assert dataclasses.replace(tuned.stage1, SCALE_TMA=1) == ST  # the tuned tile kept


def test_the_op_settles_each_stages_scale_form_once_per_scales_and_shape(monkeypatch):
    """Prepared scales: the choice and each stage's form are looked up once per (scales, call shape), not per call;
    another object (even with the same tensors) is a new entry; one prepared and one plain both run as codes."""
    import importlib

    from tritune import ops

    op = importlib.import_module("tritune.ops.fused_moe")
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    p1, p2 = ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2)
    calls = []
    real = op.fused_moe_choice
    monkeypatch.setattr(op, "fused_moe_choice", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, p1, p2)
    assert torch.equal(ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, p1, p2), first)
    assert len(calls) == 1
    ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, Mxfp4Scales(s1, p1.records), p2)
    assert len(calls) == 2
    s1_, s2_, choice = op._scale_forms(hidden, q1, q2, ids, p1, s2, "silu", fm.MXFP4, False, None)
    assert s1_ is s1 and s2_ is s2 and choice is None  # mixed: codes for both, the op's usual path
