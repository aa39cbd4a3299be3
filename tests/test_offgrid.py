"""ops.offgrid: choices between tuned sizes by scaled measured times, and the store accessors that feed them."""

import math

import pytest

from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.gemm import GemmConfig
from tritune.ops import cost_model as cm
from tritune.ops.offgrid import (
    HEURISTIC_MARGIN,
    MOE_FAR_TOKENS,
    MoeRow,
    choose_gemm_offgrid,
    choose_moe_offgrid,
    gemm_entries,
    moe_row_of,
    neighbours,
)
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.fmoe_table import FmoeConfigTable
from tritune.store.gemm_json import GemmConfigStore, GemmEntry, write_shape_file
from tritune.tuning.types import Config

MIXTRAL = dict(model_dim=4096, inter_dim=14336, experts=8, topk=2)
SMALL = GemmConfig(16, 64, 256, 1, 4, 4)
MID = GemmConfig(64, 128, 128, 8, 4, 4)
BIG = GemmConfig(128, 256, 64, 8, 8, 4)


def modelled(config, kernel, M, N, K, bias=1.0):
    """A 'measured' time that is the model's own estimate times `bias` (so scaling reproduces the model)."""
    return bias * cm.estimate_gemm(config, cm.GemmShape(kernel, M, N, K)).gpu_us


@pytest.mark.parametrize("sizes, asked, scope, want", [
    ([1, 16, 64, 256], 48, "neighbours", [64, 16]),  # between: the two around it, nearest (log2) first
    ([1, 16, 64, 256], 32, "neighbours", [64, 16]),  # log2 tie: the larger first
    ([16, 64, 256], 4, "neighbours", [16, 64]),  # below the range: the two smallest
    ([16, 64, 256], 4096, "neighbours", [256, 64]),  # above the range: the two largest
    ([64], 8, "neighbours", [64]),  # a single tuned size
    ([1, 16, 64, 256], 48, "all", [64, 16, 256, 1]),  # every size, nearest first
])
def test_neighbours(sizes, asked, scope, want):
    assert neighbours(sizes, asked, scope) == want


def test_neighbours_rejects_bad_scope_and_no_sizes():
    with pytest.raises(ValueError, match="scope"):
        neighbours([1], 2, "nearby")
    with pytest.raises(ValueError, match="no tuned sizes"):
        neighbours([], 2)


def test_gemm_exact_hit_returns_the_tuned_entry_unchanged():
    entries = {16: (SMALL, 20.0), 64: (MID, 22.0)}
    config, source = choose_gemm_offgrid("bf16", 64, 4096, 4096, entries)
    assert config is MID and source == "tuned M=64"


@pytest.mark.parametrize("bias_small, bias_mid, winner", [
    (1.0, 1.0, SMALL),  # equal model bias: the model's choice at M=48 (16-row tiles: 3 rows of 64 streams)
    (1.0, 0.6, MID),  # the 64-row config measured 40% under the model at M=64: its scaled time wins
])
def test_gemm_between_two_sizes_picks_the_least_scaled_time(bias_small, bias_mid, winner):
    kernel, N, K = "a8w8", 4096, 4096
    entries = {16: (SMALL, modelled(SMALL, kernel, 16, N, K, bias_small)),
               64: (MID, modelled(MID, kernel, 64, N, K, bias_mid))}
    config, source = choose_gemm_offgrid(kernel, 48, N, K, entries)
    scaled = {c: t * cm.estimate_gemm(c, cm.GemmShape(kernel, 48, N, K)).gpu_us
              / cm.estimate_gemm(c, cm.GemmShape(kernel, m, N, K)).gpu_us for m, (c, t) in entries.items()}
    assert config is winner and winner == min(scaled, key=scaled.get)
    assert source.startswith("off-grid: M=48 between tuned 16 and 64; chose config of M=")
    assert "vs config of M=" in source


def test_gemm_config_that_wins_only_by_waves_at_the_asked_size():
    # N=1408: a 128x128 tile makes 11 column tiles. At M=1536 (12 rows, 132 tiles: one full wave) it is the
    # better config; at M=1544 it needs 143 tiles, a second wave, and the 64-row tile (275 tiles, 3 waves of
    # half the work) wins although it lost at its own tuned size.
    kernel, N, K = "bf16", 1408, 8192
    a, b = GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(64, 128, 128, 8, 4, 4)
    assert modelled(a, kernel, 1536, N, K) < modelled(b, kernel, 1536, N, K)
    entries = {1536: (a, modelled(a, kernel, 1536, N, K)), 2048: (b, modelled(b, kernel, 2048, N, K))}
    config, _ = choose_gemm_offgrid(kernel, 1544, N, K, entries)
    assert config is b


def test_gemm_split_k_candidate_penalized_when_the_grid_fills_the_sms():
    # N=14336 in 64-wide tiles is 224 programs: split-K only adds its partials' traffic and a second wave for
    # nothing, so its 1 µs lower measured time does not win (both are one launch).
    split, plain = GemmConfig(16, 64, 256, 1, 4, 4, 4), GemmConfig(16, 64, 256, 1, 4, 4, 1)
    config, source = choose_gemm_offgrid("a8w8", 24, 14336, 4096, {16: (split, 31.0), 32: (plain, 32.0)})
    assert config is plain
    chosen, beaten = source.split("; vs ")[:2]
    assert "M=32" in chosen and "M=16" in beaten and "(1 launch)" in chosen and "(1 launch)" in beaten


def test_gemm_a_config_tuned_at_several_sizes_is_scaled_from_the_nearest():
    kernel, N, K = "bf16", 4096, 4096
    entries = {256: (MID, 30.0), 1024: (BIG, 50.0), 4096: (BIG, 183.0)}
    _, source = choose_gemm_offgrid(kernel, 1536, N, K, entries, scope="all")
    assert "config of M=1024 scaled 50.0" in source and "M=4096 scaled" not in source


def test_gemm_below_and_above_the_tuned_range():
    entries = {64: (MID, 22.0), 256: (MID, 27.0), 1024: (BIG, 49.0)}
    _, low = choose_gemm_offgrid("bf16", 8, 4096, 4096, entries)
    _, high = choose_gemm_offgrid("bf16", 8192, 4096, 4096, entries)
    assert low.startswith("off-grid: M=8 below tuned 64, 256")
    assert high.startswith("off-grid: M=8192 above tuned 256, 1024")


def test_gemm_rejects_empty_entries_and_bad_m():
    with pytest.raises(ValueError, match="no tuned entries"):
        choose_gemm_offgrid("bf16", 8, 4096, 4096, {})
    with pytest.raises(ValueError, match="M must be >= 1"):
        choose_gemm_offgrid("bf16", 0, 4096, 4096, {1: (SMALL, 1.0)})


def test_gemm_entries_converts_stored_entries_and_drops_unmeasured():
    stored = {M: GemmEntry(M=M, config=Config.from_dict(MID.__dict__), time_us=t, tflops=1.0, gbps=1.0, error=0.0)
              for M, t in ((64, 22.0), (128, math.nan))}
    assert gemm_entries(stored) == {64: (MID, 22.0)}


def test_gemm_heuristic_candidate_beats_a_far_away_tuned_size():
    # Only M=4096 is tuned (a 128x256 TMA tile): at M=8 the rule-table config wins, and says so.
    big_tma = GemmConfig(128, 256, 64, 8, 8, 3, PERSISTENT_TMA=True)
    entries = {4096: (big_tma, modelled(big_tma, "bf16", 4096, 4096, 4096))}
    heuristic = GemmConfig(16, 64, 256, 1, 4, 4, cache_modifier=".cg")
    config, source = choose_gemm_offgrid("bf16", 8, 4096, 4096, entries, heuristic=heuristic)
    assert config is heuristic and "chose heuristic config modelled" in source


def test_gemm_heuristic_candidate_needs_a_clear_margin():
    # The model rates the unmeasured 5-stage config 2% better than the measured one at M=24: not enough.
    kernel, N, K = "a8w8", 4096, 4096
    heuristic = GemmConfig(16, 64, 256, 1, 4, 5)
    measured = cm.estimate_gemm(SMALL, cm.GemmShape(kernel, 24, N, K)).total_us
    unmeasured = cm.estimate_gemm(heuristic, cm.GemmShape(kernel, 24, N, K)).total_us
    assert unmeasured < measured < unmeasured * HEURISTIC_MARGIN
    entries = {16: (SMALL, modelled(SMALL, kernel, 16, N, K))}
    config, source = choose_gemm_offgrid(kernel, 24, N, K, entries, heuristic=heuristic)
    assert config is SMALL and "vs heuristic config" in source
    # The heuristic equal to a tuned config is that measured candidate, not a second one.
    assert "heuristic" not in choose_gemm_offgrid(kernel, 24, N, K, entries, heuristic=SMALL)[1]


# ---------------------------------------------------------------------------------------------------- fused MoE

ONE = MoeConfig(16, 128, 128, 1, 4, 3, 1, 256)
S1_16, S2_16 = MoeConfig(16, 32, 256, 1, 4, 4), MoeConfig(16, 64, 256, 1, 4, 4)
S1_128, S2_128 = MoeConfig(128, 128, 64, 8, 8, 4, 1, 0, 1), MoeConfig(128, 256, 64, 8, 8, 4, 1, 0, 1)
S1_64, S2_64 = MoeConfig(64, 128, 64, 8, 4, 4), MoeConfig(64, 256, 64, 8, 4, 4, 1, 0, 1)


def moe_modelled(tokens, run_1stage, s1, s2, bias=1.0):
    shape = cm.MoeShape(tokens, *MIXTRAL.values())
    return bias * cm.estimate_moe(cm.MoePlan(run_1stage, s1, s2), shape).gpu_us


def test_moe_exact_hit_returns_the_tuned_row():
    rows = [(1, True, ONE, None, 257.3), (8, False, S1_16, S2_16, 935.3)]
    assert choose_moe_offgrid(8, **MIXTRAL, quant="none", rows=rows) == (False, S1_16, S2_16, "tuned tokens=8")


def test_moe_between_rows_picks_the_least_scaled_plan():
    # 1024 tokens between the 512 and 2048 rows (the case: today the 2048-token bucket row serves it).
    rows = [MoeRow(512, False, S1_64, S2_64, moe_modelled(512, False, S1_64, S2_64)),
            MoeRow(2048, False, S1_128, S2_128, moe_modelled(2048, False, S1_128, S2_128))]
    run_1stage, s1, s2, source = choose_moe_offgrid(1024, **MIXTRAL, quant="none", rows=rows)
    costs = {(r.stage1, r.stage2): moe_modelled(1024, False, r.stage1, r.stage2) for r in rows}
    assert not run_1stage and (s1, s2) == min(costs, key=costs.get)
    assert source.startswith("off-grid: tokens=1024 between tuned 512 and 2048; chose config of tokens=")


def test_moe_one_stage_never_above_its_pair_limit():
    # A 1-stage row measured absurdly fast must not serve 200 tokens x topk 2 = 400 routed pairs (> 256).
    rows = [MoeRow(1, True, ONE, None, 1.0), MoeRow(512, False, S1_64, S2_64, 1300.0)]
    run_1stage, s1, s2, _ = choose_moe_offgrid(200, **MIXTRAL, quant="none", rows=rows)
    assert (run_1stage, s1, s2) == (False, S1_64, S2_64)
    # 64 tokens = 128 pairs is within the limit: the same row may now serve.
    assert choose_moe_offgrid(64, **MIXTRAL, quant="none", rows=rows)[0] is True


def test_moe_only_one_stage_rows_above_the_limit_is_an_error():
    with pytest.raises(ValueError, match="1-stage kernel"):
        choose_moe_offgrid(1000, **MIXTRAL, quant="none", rows=[MoeRow(1, True, ONE, None, 250.0)])


def test_moe_heuristic_candidate_respects_the_pair_limit():
    rows = [MoeRow(512, False, S1_64, S2_64, moe_modelled(512, False, S1_64, S2_64))]
    one_stage = (True, ONE, None)
    assert choose_moe_offgrid(400, **MIXTRAL, quant="none", rows=rows, heuristic=one_stage)[:3] == (False, S1_64, S2_64)
    # Only a 16-token row (BLOCK_M 16) is tuned: at 200 tokens (12.5x away) its tiny tiles lose to the rule table's
    # on the model.
    rows = [MoeRow(16, False, S1_16, S2_16, moe_modelled(16, False, S1_16, S2_16))]
    got = choose_moe_offgrid(200, **MIXTRAL, quant="none", rows=rows, heuristic=(False, S1_128, S2_128))
    assert got[:3] == (False, S1_128, S2_128) and "chose heuristic" in got[3]


@pytest.mark.parametrize("asked, far", [(2, True), (63, True), (64, False), (256, False), (16384, False),
                                        (16385, True)])
def test_moe_rule_table_serves_token_counts_far_from_every_tuned_one(asked, far):
    """Past MOE_FAR_TOKENS times from every tuned count the rule table's plan is taken as it is (Mixtral's fp8 rows
    tuned at 1024 tokens, scaled to 2-8 tokens, ran 1.3-1.5x the rule's plan on the H100); nearer, it competes."""
    assert MOE_FAR_TOKENS == 16
    # the tuned row measured far faster than anything: it wins wherever it competes
    rows = [MoeRow(1024, False, S1_128, S2_128, 1.0)]
    got = choose_moe_offgrid(asked, **MIXTRAL, quant="per_token", rows=rows, heuristic=(False, S1_16, S2_16))
    if far:
        assert got[:3] == (False, S1_16, S2_16) and "more than 16x away; chose the heuristic config" in got[3]
    else:
        assert got[:3] == (False, S1_128, S2_128)
    assert choose_moe_offgrid(asked, **MIXTRAL, quant="per_token", rows=rows)[:3] == (False, S1_128, S2_128)


def test_moe_rejects_no_rows():
    with pytest.raises(ValueError, match="no tuned rows"):
        choose_moe_offgrid(16, **MIXTRAL, quant="none", rows=[])


# ------------------------------------------------------------------------------------------------ store accessors

PROV = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "triton_version": "3.9", "torch_version": "2.13"}
SLUG = "NVIDIA_H100_80GB_HBM3"


def test_gemm_store_shape_entries(tmp_path):
    entries = {M: GemmEntry(M=M, config=Config.from_dict(MID.__dict__), time_us=t, tflops=1.0, gbps=1.0, error=0.0)
               for M, t in ((16, 20.0), (64, 22.0))}
    path = write_shape_file(tmp_path, PROV, "BF16", 4096, 4096, entries)
    store = GemmConfigStore([tmp_path])
    found = store.shape_entries(SLUG, "BF16", 4096, 4096)
    assert found is not None and found[0] == path and found[1] == entries
    assert store.shape_entries(SLUG, "BF16", 4096, 8192) is None  # no file for that shape
    config, source = choose_gemm_offgrid("bf16", 32, 4096, 4096, gemm_entries(found[1]))
    assert config == MID and source.startswith("off-grid: M=32 between tuned 16 and 64")


def _shape(token=16, q_type="none", dtype="bf16"):
    q = "fp8" if q_type != "none" else dtype
    return FmoeShape(token=token, model_dim=4096, inter_dim=14336, expert=8, topk=2, act_type="silu", dtype=dtype,
                     q_dtype_a=q, q_dtype_w=q, q_type=q_type, use_g1u1=True, doweight_stage1=False)


def _tuned(shape, us, cu_num=132, stage1=S1_64, stage2=S2_64):
    return FmoeTuned(cu_num=cu_num, shape=shape, block_m=stage1.BLOCK_SIZE_M, ksplit=1, us1=us / 2,
                     kernelName1=stage1.name("stage1"), err1=0.0, us2=us / 2, kernelName2=stage2.name("stage2"),
                     err2=0.0, us=us, run_1stage=False, tflops=1.0, bw=1.0)


def test_fmoe_table_rows_of_one_shape_sorted_by_token():
    rows = [_tuned(_shape(2048), 2500.0), _tuned(_shape(512), 1300.0), _tuned(_shape(600, "per_token"), 700.0),
            _tuned(_shape(512), 1200.0, cu_num=114)]
    table = FmoeConfigTable(rows)
    got = table.rows_of(132, _shape(1))
    assert [r.shape.token for r in got] == [512, 2048]  # other quant and other SM count left out
    assert table.rows_of(132, _shape(1, dtype="fp16")) == []
    parsed = [moe_row_of(r) for r in got]
    assert parsed[0] == MoeRow(512, False, S1_64, S2_64, 1300.0)
    assert choose_moe_offgrid(1024, **MIXTRAL, quant="none", rows=parsed)[3].startswith(
        "off-grid: tokens=1024 between tuned 512 and 2048")


def test_a_gluon_rule_plan_beats_a_triton_row_scaled_far_up():
    """Mixtral-8x7B per_1x128 tuned at 1024 tokens only (the shipped row, Triton kernels): at 4096 and 8192 tokens
    the rule's Gluon plan wins the comparison (H100: 3396 / 6705 µs against the scaled row's 4278 / 8605)."""
    from tritune.ops.fused_moe import _parse_stage, heuristic_moe_choice

    s1 = _parse_stage("moe_stage1_per_1x128_silu_BM64_BN256_BK128_GM8_W8_S3_KS1_TMA1", "stage1", "per_1x128", "silu")
    s2 = _parse_stage("moe_stage2_per_1x128_silu_BM64_BN256_BK128_GM8_W8_S4_KS1_TMA1", "stage2", "per_1x128", "silu")
    rows = [MoeRow(1024, False, s1, s2, 1450.46)]
    for tokens in (4096, 8192):
        rule = heuristic_moe_choice(tokens, 4096, 14336, 8, 2, "per_1x128")
        assert rule.stage1.GLUON
        got = choose_moe_offgrid(tokens, 4096, 14336, 8, 2, "per_1x128", rows, 132,
                                 heuristic=(False, rule.stage1, rule.stage2))
        assert got[1:3] == (rule.stage1, rule.stage2) and "chose heuristic" in got[3], got[3]
