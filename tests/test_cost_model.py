"""ops.cost_model: routing statistics, monotonic estimates, waves, split-K and host cost, scaling, calibration."""

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest

from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.gemm import GemmConfig
from tritune.ops import cost_model as cm
from tritune.ops.heuristics import gemm_heuristic, moe_heuristic
from tritune.tuning.types import Config

ROOT = Path(__file__).resolve().parent.parent
GEMM_FILES = sorted((ROOT / "src" / "tritune" / "configs" / "gemm").glob("*-N=*-K=*.json"))
TAGS = {"BF16": "bf16", "A8W8": "a8w8", "A8W8_BLOCKSCALE": "a8w8_blockscale"}
MIXTRAL = (4096, 14336, 8, 2)  # model_dim, inter_dim, experts, topk of the shipped tuned rows


def gemm(config, kernel, M, N, K):
    return cm.estimate_gemm(config, cm.GemmShape(kernel, M, N, K))


def exact_stats(tokens, experts, topk, block_m, group):
    """The same expectations summed over the whole binomial with exact integer coefficients."""
    p = topk / experts
    if p == 1:
        pmf = [0.0] * tokens + [1.0]
    else:  # in logs: the coefficients of a 4096-token binomial overflow a float
        pmf = [math.exp(math.lgamma(tokens + 1) - math.lgamma(c + 1) - math.lgamma(tokens - c + 1)
                        + c * math.log(p) + (tokens - c) * math.log1p(-p)) for c in range(tokens + 1)]
    touched = experts * (1 - pmf[0])
    blocks = experts * sum(q * math.ceil(c / block_m) for c, q in enumerate(pmf))
    sweeps = experts * sum(q * math.ceil(math.ceil(c / block_m) / group) for c, q in enumerate(pmf))
    return touched, blocks, sweeps


@pytest.mark.parametrize("tokens, experts, topk, block_m, group, rel", [
    (1, 8, 2, 16, 1, 1e-9),  # one token: exactly topk experts, one block each
    (37, 8, 2, 16, 1, 1e-9),  # a few blocks per expert
    (300, 8, 2, 64, 8, 1e-9),  # grouped sweeps over several blocks (last exact-sum size: spread 7.5)
    (64, 256, 8, 16, 1, 1e-9),  # many experts, most untouched
    (5, 8, 8, 16, 1, 1e-9),  # topk == experts: every expert gets every token
    (4096, 8, 2, 128, 8, 1e-2),  # wide spread: the normal approximation
    (1000, 64, 6, 16, 1, 1e-2),  # normal approximation with a block much narrower than the spread
])
def test_routing_stats_match_the_exact_binomial(tokens, experts, topk, block_m, group, rel):
    got = cm.routing_stats(tokens, experts, topk, block_m, group)
    assert got == pytest.approx(exact_stats(tokens, experts, topk, block_m, group), rel=rel)


def test_one_token_touches_exactly_topk_experts():
    touched, blocks, _ = cm.routing_stats(1, 8, 2, 16)
    assert touched == pytest.approx(2.0) and blocks == pytest.approx(2.0)


@pytest.mark.parametrize("kernel, N, K", [
    ("bf16", 4096, 4096),  # square
    ("a8w8", 4096, 14336),  # long K: split-K configs at small M
    ("a8w8_blockscale", 2112, 7168),  # small N: narrow tiles
    ("bf16", 512, 16384),  # tiny grid, long K
])
def test_gemm_estimate_is_non_decreasing_in_M(kernel, N, K):
    configs = {gemm_heuristic(kernel, M, N, K) for M in (1, 16, 64, 256, 1024, 4096)}
    for config in configs:
        times = [gemm(config, kernel, M, N, K).gpu_us for M in [*range(1, 300), *range(300, 8200, 13)]]
        assert all(b >= a - 1e-9 for a, b in zip(times, times[1:], strict=False)), config


@pytest.mark.parametrize("quant, dims", [
    ("none", MIXTRAL),  # the shipped rows' shape
    ("per_1x128", (7168, 2048, 256, 8)),  # DeepSeek-like: many experts, topk 8
    ("per_token", (1024, 512, 8, 2)),  # small shape: weights fit in L2
])
def test_moe_estimate_is_non_decreasing_in_tokens(quant, dims):
    plans = {cm.MoePlan(*moe_heuristic(t, *dims, quant)) for t in (1, 16, 128, 1024)}
    for plan in plans:
        top = cm.ONE_STAGE_MAX_PAIRS // dims[3] if plan.run_1stage else 6000
        times = [cm.estimate_moe(plan, cm.MoeShape(t, *dims, quant)).gpu_us for t in range(1, top + 1, 7)]
        assert all(b >= a - 1e-9 for a, b in zip(times, times[1:], strict=False)), plan


def test_one_more_row_of_tiles_costs_a_wave():
    # 12 x 11 = 132 tiles fill the H100 once; one more row of M makes 143 tiles, a second wave.
    config = GemmConfig(128, 128, 64, 8, 8, 4)
    full = gemm(config, "bf16", 1536, 1408, 8192)
    over = gemm(config, "bf16", 1537, 1408, 8192)
    assert over.gpu_us > 1.4 * full.gpu_us


def test_split_k_is_penalized_when_the_grid_fills_the_sms():
    one, two = (gemm(GemmConfig(128, 128, 64, 8, 8, 4, split), "bf16", 4096, 4096, 4096) for split in (1, 2))
    assert two.launches == 1 and one.launches == 1  # split-K sums its partials in the same launch
    assert two.gpu_us > one.gpu_us and two.total_us > one.total_us


def test_split_k_pays_on_a_tiny_grid_with_long_k():
    # N=512 in 32-wide tiles is 16 programs: each streams 1 MiB of B alone unless K is split.
    one, eight = (gemm(GemmConfig(16, 32, 256, 1, 4, 4, split), "bf16", 1, 512, 16384) for split in (1, 8))
    assert eight.total_us < one.total_us - 10


def test_split_k_pays_no_second_launch_on_the_host():
    # Block-scaled N=K=4096 at M=1: split 4 is faster on the GPU (as the tuner measured), and with the partials summed
    # by the last split of each tile it costs the host one launch, as the unsplit kernel does.
    one, four = (gemm(GemmConfig(16, 64, 128, 1, 4, 4, split), "a8w8_blockscale", 1, 4096, 4096) for split in (1, 4))
    assert four.gpu_us < one.gpu_us
    assert four.host_us == pytest.approx(one.host_us)
    assert four.total_us < one.total_us


def test_tma_pays_its_descriptors_on_the_host():
    plain = gemm(GemmConfig(128, 256, 64, 8, 8, 3), "bf16", 4096, 4096, 4096)
    tma = gemm(GemmConfig(128, 256, 64, 8, 8, 3, PERSISTENT_TMA=True), "bf16", 4096, 4096, 4096)
    assert tma.host_us == pytest.approx(plain.host_us + cm.H100.host_tma_us)
    assert tma.gpu_us < plain.gpu_us


def test_scale_time_is_the_model_ratio_and_identity_on_equal_shapes():
    config = GemmConfig(64, 128, 128, 8, 4, 4)
    small, large = cm.GemmShape("a8w8", 64, 4096, 4096), cm.GemmShape("a8w8", 512, 4096, 4096)
    assert cm.scale_time(12.5, config, small, small) == 12.5
    ratio = cm.estimate(config, large).gpu_us / cm.estimate(config, small).gpu_us
    assert cm.scale_time(10.0, config, small, large) == pytest.approx(10.0 * ratio)
    assert cm.scale_time(cm.scale_time(10.0, config, small, large), config, large, small) == pytest.approx(10.0)
    with pytest.raises(TypeError, match="cannot scale"):
        cm.scale_time(1.0, config, small, cm.MoeShape(64, 4096, 4096, 8, 2))


def test_configs_are_read_by_attribute_or_key():
    fields = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
    shape = cm.GemmShape("bf16", 256, 4096, 4096)
    want = gemm(GemmConfig(**fields), "bf16", 256, 4096, 4096)
    assert cm.estimate(Config.from_dict(fields), shape) == want
    assert cm.estimate(dict(fields), shape) == want


def test_fewer_sms_are_slower_when_compute_bound():
    config, shape = GemmConfig(128, 256, 64, 8, 8, 4), cm.GemmShape("bf16", 8192, 8192, 8192)
    assert cm.estimate(config, shape, cm.hardware(sm_count=114)).gpu_us > cm.estimate(config, shape).gpu_us


def test_group_size_m_one_resweeps_expert_weights():
    # Tuning profile (1024 tokens, Mixtral): GROUP_SIZE_M 1 ran stage 1 in 2990 µs, GROUP_SIZE_M 8 in 1340 µs.
    shape = cm.MoeShape(1024, *MIXTRAL)
    gm1, gm8 = (cm.estimate_moe(cm.MoePlan(False, MoeConfig(64, 128, 64, g, 4, 4), MoeConfig(64, 256, 64, 8, 4, 4)),
                                shape).gpu_us for g in (1, 8))
    assert gm1 > 1.4 * gm8


@pytest.mark.parametrize("tokens, one_stage_cheaper", [
    (1, True),  # two routed pairs: the weights dominate and 1-stage saves launches (tuned: 1-stage won)
    (128, False),  # 256 pairs: 1-stage re-reads each expert's weights per block and adds atomics
])
def test_one_stage_against_two_stage(tokens, one_stage_cheaper):
    shape = cm.MoeShape(tokens, *MIXTRAL)
    one = cm.MoePlan(True, MoeConfig(16, 128, 128, 1, 4, 3, 1, 256), None)
    two = cm.MoePlan(*moe_heuristic(max(tokens, 64), *MIXTRAL, "none"))
    assert (cm.estimate_moe(one, shape).total_us < cm.estimate_moe(two, shape).total_us) == one_stage_cheaper


def test_estimates_track_the_shipped_gemm_files():
    """Calibration guard: every shipped tuned winner is estimated within 0.75-1.3x of its measured time."""
    ratios = []
    for path in GEMM_FILES:
        doc = json.loads(path.read_text())["tritune"]  # per-M winners sit beside the aiter-layout buckets
        for M, entry in doc["by_M"].items():
            est = gemm(entry["config"], TAGS[doc["kernel"]], int(M), doc["N"], doc["K"]).gpu_us
            ratios.append(est / entry["time_us"])
    assert len(ratios) == 63
    assert 0.75 < min(ratios) and max(ratios) < 1.3
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) == pytest.approx(1.0, abs=0.1)


def test_model_ranks_the_tuning_profile():
    """The lowest-estimated stage-1 and stage-2 candidates of the 1024-token profile measured within 10% of the
    best (benchmarks/results/tune_fmoe_row1_profile_h100_2026-11-21.csv: 144 + 208 candidates)."""
    rows = list(csv.DictReader(open(ROOT / "benchmarks" / "results" / "tune_fmoe_row1_profile_h100_2026-11-21.csv")))
    shape = cm.MoeShape(1024, *MIXTRAL)
    for kind in ("stage1", "stage2"):
        measured = {MoeConfig.parse_name(r["kernelName"])[1]: float(r["us"])
                    for r in rows if r["kind"] == kind and r["status"] == "ok"}
        modelled = {c: cm._moe_gemm_launch(c, kind, shape, cm.H100)[0] for c in measured}
        assert measured[min(modelled, key=modelled.get)] <= 1.10 * min(measured.values()), kind


def test_gluon_moe_stages_model_faster_and_pay_their_gather():
    """The Gluon per_1x128 pair (rescale off the MMA's path, stage 1 from TMA) models under the Triton pair at
    Mixtral-8x7B 4096 tokens (measured 0.79x on the H100), and its stage 1 pays the gathered copy as a helper
    launch (GATHER_A)."""
    from tritune.ops import heuristics
    from tritune.ops.fused_moe import heuristic_moe_choice

    shape = cm.MoeShape(4096, 4096, 14336, 8, 2, "per_1x128", True, 2)
    gluon = heuristic_moe_choice(4096, 4096, 14336, 8, 2, "per_1x128")
    assert gluon.stage1.GLUON and gluon.stage1.GATHER_A
    old = heuristics.GLUON_MOE
    heuristics.GLUON_MOE = False
    try:
        triton = heuristic_moe_choice(4096, 4096, 14336, 8, 2, "per_1x128")
    finally:
        heuristics.GLUON_MOE = old
    assert not triton.stage1.GLUON
    est = {k: cm.estimate_moe(cm.MoePlan(False, c.stage1, c.stage2), shape).gpu_us
           for k, c in (("gluon", gluon), ("triton", triton))}
    assert 0.6 < est["gluon"] / est["triton"] < 0.9, est
    _, _, helpers, copy_us = cm._moe_gemm_launch(gluon.stage1, "stage1", shape, cm.H100)
    assert helpers == 1 and copy_us > 2 * shape.pairs * 4096 / cm.H100.hbm
    quantizing = cm.estimate_moe(cm.MoePlan(False, dataclasses.replace(gluon.stage1, QUANT_OUT=1), gluon.stage2),
                                 shape)
    assert quantizing.launches == cm.estimate_moe(cm.MoePlan(False, gluon.stage1, gluon.stage2), shape).launches - 1
    assert quantizing.gpu_us < est["gluon"]  # no quantization launch
    own_gather = dataclasses.replace(gluon.stage1, GATHER_A=0)  # cp.async by pointer: no copy, the gather discount
    own_us, _, own_helpers, _ = cm._moe_gemm_launch(own_gather, "stage1", shape, cm.H100)
    assert own_helpers == 0 and own_us > cm._moe_gemm_launch(gluon.stage1, "stage1", shape, cm.H100)[0]
