"""The fused-MoE tunable: each pruning rule alone, problem keys, the e2e space, cost model, and the worker's path
(make_inputs → reference → alloc_output → launcher → gate) for every kind on a tiny fp16 problem."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.device import current_device
from tritune.kernels.fused_moe import MoeConfig
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe_tunable import (
    ONE_STAGE_MAX_PAIRS,
    ONE_STAGE_SPACE,
    ONE_STAGE_SWAP_MAX_MEAN,
    REL_L2_BOUND,
    STAGE_SPACE,
    FusedMoeTunable,
    MoeProblem,
    one_stage_constraints,
    plan_names,
    routed_experts,
    routing,
    stage_constraints,
)
from tritune.tuning.check import check_output, poison
from tritune.tuning.space import SearchSpace
from tritune.tuning.types import Config

DEV = current_device()  # no GPU: an interpreter stand-in with H100 limits (132 SMs, 227 KiB shared memory, sm_90)
AMPERE = dataclasses.replace(DEV, name="ampere-like", capability=(8, 0))
GPU = dataclasses.replace(DEV, interpreter=False)  # the same limits, read as a GPU's (its speed rules apply)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shape(quant: str = "none", **changes) -> FmoeShape:
    """A DeepSeek-ish row (512 tokens, top-2 of 8 experts: 128 pairs per expert) with `changes` applied."""
    q = "fp8" if quant != "none" else "bf16"
    fields = dict(token=512, model_dim=4096, inter_dim=1024, expert=8, topk=2, act_type="silu", dtype="bf16",
                  q_dtype_a=q, q_dtype_w=q, q_type=quant, use_g1u1=True, doweight_stage1=False)
    fields.update(changes)
    return FmoeShape(**fields)


def stage_config(**changes) -> Config:
    """A stage config passing every rule for BIG (below), with `changes`; every STAGE_SPACE parameter set."""
    params = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3,
                  KSPLIT=1, USE_TMA=0, SWAP_AB=0, SCALE_TMA=0)
    params.update(changes)
    assert set(params) == set(STAGE_SPACE)
    return Config.of(**params)


def one_config(**changes) -> Config:
    """A 1-stage config passing every rule for ONE (below), with `changes`; every ONE_STAGE_SPACE parameter set."""
    params = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, BLOCK_SIZE_D=64, GROUP_SIZE_M=1, num_warps=4,
                  num_stages=2, SWAP_AB=0, USE_TMA=0, SCALE_TMA=0, KSPLIT=1)
    params.update(changes)
    assert set(params) == set(ONE_STAGE_SPACE)
    return Config.of(**params)


def _failing(rules, config: Config) -> list[str]:
    return [c.name for c in rules if not c.ok(config)]


BIG = MoeProblem(shape(), "stage1")  # 1024 pairs, 128 per expert, N=1024 (gate+up), K=4096
FEW = MoeProblem(shape(token=16, model_dim=256, inter_dim=256), "stage1")  # 4 pairs per expert, K=256
ONE = MoeProblem(shape(token=16, model_dim=512, inter_dim=256), "1stage")  # 32 pairs, 4 per expert, D=512

P1X128_REGS = "per_1x128 accumulators + scaled product > 192 registers per thread (128 on 4 warps)"
# (rule, problem, device, config): the config breaks that rule and no other.
MX = MoeProblem(shape("per_1x32", q_dtype_a="bf16", q_dtype_w="fp4x2"), "stage1")  # MXFP4 weights, bf16 activations
MX8 = MoeProblem(shape("per_1x32", q_dtype_a="fp8", q_dtype_w="fp4x2"), "stage1")  # per_1x32_a8: fp8 activations
TMA_RULE = "MXFP4 weights through TMA exactly when the GEMM swaps (per_1x32 only)"
SWAP_RULE = ("SWAP_AB only with BLOCK_SIZE_M <= 32 < BLOCK_SIZE_N (MXFP4: 64 <= BLOCK_SIZE_N <= 16 x num_warps; "
             "not per_1x32_a8)")
SCALE_RULE = ("SCALE_TMA only where the scale records fit the tile (per_1x32 swapped through TMA, BLOCK_K 128, "
              "BLOCK_N a multiple of 64, stage 1's inter_dim a multiple of 64)")
MX_SWAP = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, SWAP_AB=1, USE_TMA=1)
STAGE_RULES = [
    (TMA_RULE, MX, DEV, stage_config(USE_TMA=1)),  # MXFP4 through TMA only in the swapped GEMM
    (TMA_RULE, MX, DEV, stage_config(SWAP_AB=1)),  # and always there
    (TMA_RULE, MX8, DEV, stage_config(USE_TMA=1)),  # fp8 activations: pointers
    (SCALE_RULE, BIG, DEV, stage_config(SCALE_TMA=1)),  # 16-bit weights have no codes
    (SCALE_RULE, MoeProblem(shape("per_1x32", q_dtype_a="bf16", q_dtype_w="fp4x2", token=16), "stage1"), DEV,
     stage_config(**(MX_SWAP | dict(SCALE_TMA=1, BLOCK_SIZE_K=256)))),  # a record covers 128 along K
    (SCALE_RULE, MoeProblem(shape("per_1x32", q_dtype_a="bf16", q_dtype_w="fp4x2", token=16, inter_dim=1056),
                            "stage1"), DEV, stage_config(**MX_SWAP, SCALE_TMA=1)),  # up rows at 1056: not on a record
    (SWAP_RULE, BIG, DEV, stage_config(SWAP_AB=1)),  # 64-row blocks fill a wgmma themselves
    (SWAP_RULE, MX8, DEV, stage_config(SWAP_AB=1, BLOCK_SIZE_M=32, BLOCK_SIZE_N=64)),  # no e4m3 decode for the swap
    ("shared memory > device limit", BIG, DEV,
     stage_config(BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, num_warps=8, num_stages=4)),  # 4*(64+2*128)*128*2 B = 320 KiB
    ("accumulator registers per thread > 128", BIG, DEV,
     stage_config(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, GROUP_SIZE_M=1)),  # 2 tiles of 128x128 over 128 threads
    (P1X128_REGS, MoeProblem(shape("per_1x128"), "stage2"),
     DEV, stage_config(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128)),  # (1 + 1) tiles of 64x256 over 128 threads: 256
    (P1X128_REGS, MoeProblem(shape("per_1x128"), "stage1"),
     DEV, stage_config(BLOCK_SIZE_N=128, BLOCK_SIZE_K=128)),  # (2 + 1) tiles of 64x128 over 128 threads: 192 > 128
    ("BLOCK_SIZE_M under 16 only for 16-bit or MXFP4 weights, without TMA or SWAP_AB",
     MoeProblem(shape("per_token", token=4, expert=8, topk=2), "stage1"), DEV,
     stage_config(BLOCK_SIZE_M=1, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)),  # fp8: no multiply-add path (BK 128: a GPU's
    # per_token speed rule would fail BK 64 too)
    ("BLOCK_SIZE_M under 16 only as the power of two holding the pairs per expert", FEW, DEV,
     stage_config(BLOCK_SIZE_M=2, GROUP_SIZE_M=1)),  # 4 pairs per expert: 4
    ("multiply-add product > 128 registers per thread", FEW, DEV,
     stage_config(BLOCK_SIZE_M=4, BLOCK_SIZE_N=128, GROUP_SIZE_M=1)),  # 4 x 128 x 64 over 128 threads: 256
    ("8 warps on a tile under 128x64 (not the swapped MXFP4 GEMM)", BIG, DEV,
     stage_config(BLOCK_SIZE_M=32, num_warps=8)),  # 2*32*64 < 128*64
    ("BLOCK_SIZE_M above 2x the pairs per expert", FEW, DEV,
     stage_config(BLOCK_SIZE_M=32, GROUP_SIZE_M=1)),  # 4 pairs per expert: BLOCK_SIZE_M up to 16
    ("BLOCK_SIZE_M under a quarter of the pairs per expert (cap 64)", BIG, DEV,
     stage_config(BLOCK_SIZE_M=16)),  # 128 pairs per expert: at least 32
    ("BLOCK_SIZE_N 32 only with BLOCK_SIZE_M <= 32", BIG, DEV, stage_config(BLOCK_SIZE_N=32)),
    ("per_1x128 needs BLOCK_SIZE_K dividing 128", MoeProblem(shape("per_1x128"), "stage1"), DEV,
     stage_config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=256)),  # fp8: the 256-deep tiles fit in shared memory
    ("fp8 per_token with BLOCK_SIZE_K 64", MoeProblem(shape("per_token"), "stage1"), GPU, stage_config()),
    ("BLOCK_SIZE_K 256 only with BLOCK_SIZE_M <= 32", BIG, DEV, stage_config(BLOCK_SIZE_K=256, num_stages=2)),
    ("BLOCK_SIZE_K x KSPLIT > K", FEW, DEV,
     stage_config(BLOCK_SIZE_M=16, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, KSPLIT=4)),  # 512 > K=256; grid of 32 blocks
    ("split-K on a grid that already fills the GPU (MXFP4: twice)", BIG, DEV,
     stage_config(KSPLIT=2)),  # 16 x 16 blocks >= 132 SMs
    ("num_stages beyond the K steps", FEW, DEV,
     stage_config(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_stages=4)),  # 1 K step
    ("GROUP_SIZE_M > 1 with one block per expert", FEW, DEV, stage_config(BLOCK_SIZE_M=16)),
    ("TMA: needs Hopper and 16-byte weight rows", BIG, AMPERE, stage_config(USE_TMA=1)),  # sm_80
    ("TMA: needs Hopper and 16-byte weight rows", MoeProblem(shape(model_dim=4100), "stage1"), DEV,
     stage_config(USE_TMA=1)),  # stage 1 K=4100 bf16: 8200-byte rows
    ("TMA: needs Hopper and 16-byte weight rows", MoeProblem(shape(inter_dim=1028), "stage2"), DEV,
     stage_config(USE_TMA=1)),  # stage 2 K is inter_dim: 1028 bf16 = 2056-byte rows
]

PAIRS_RULE = (f"1-stage only up to {ONE_STAGE_MAX_PAIRS} routed pairs (swapped MXFP4: {ONE_STAGE_SWAP_MAX_MEAN} "
              "pairs an expert)")
SWAP1_RULE = "SWAP_AB only for per_1x32, and always there on a GPU with TMA"
TILES1_RULE = ("the swapped 1-stage tiles: BLOCK_N 64 or 128, BLOCK_D a multiple of 64, both at most 16 x num_warps, "
               "BLOCK_K 128 through TMA, SCALE_TMA where the records fit (BLOCK_N 128); no TMA or SCALE_TMA unswapped")
SPLIT1_RULE = "1-stage split-K only swapped, on a grid under three waves, each split 2 K steps or more"
# gpt-oss-120b at 16 tokens: 64 pairs over 128 experts
MX1 = MoeProblem(shape("per_1x32", token=16, expert=128, topk=4, model_dim=2880, inter_dim=2880, q_dtype_a="bf16",
                       q_dtype_w="fp4x2"), "1stage")
SWAPPED1 = dict(BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=128, num_warps=8, num_stages=3, SWAP_AB=1,
                USE_TMA=1, SCALE_TMA=1)

ONE_STAGE_RULES = [
    (PAIRS_RULE, MoeProblem(ONE.shape.with_token(200), "1stage"), DEV, one_config()),  # 400 pairs
    (PAIRS_RULE, MoeProblem(MX1.shape.with_token(600), "1stage"), GPU, one_config(**SWAPPED1)),  # 19 pairs an expert
    (SWAP1_RULE, ONE, DEV, one_config(BLOCK_SIZE_K=128, USE_TMA=1, SWAP_AB=1)),  # bf16 never swaps
    (SWAP1_RULE, MX1, GPU, one_config()),  # MXFP4 on a GPU with TMA always swaps
    (TILES1_RULE, MX1, GPU, one_config(**(SWAPPED1 | {"BLOCK_SIZE_N": 64}))),  # records need w2's K step of 128
    (TILES1_RULE, MX1, GPU, one_config(**(SWAPPED1 | {"num_warps": 4}))),  # 128 rows on 4 warps raced
    (TILES1_RULE, MX1, GPU, one_config(**(SWAPPED1 | {"BLOCK_SIZE_K": 64}))),
    (TILES1_RULE, ONE, DEV, one_config(USE_TMA=1)),  # TMA unswapped
    (SPLIT1_RULE, ONE, DEV, one_config(KSPLIT=2)),  # unswapped
    (SPLIT1_RULE, MX1, GPU, one_config(**(SWAPPED1 | {"KSPLIT": 2}))),  # 64 blocks x 23 slices: 11 waves
    (SPLIT1_RULE, MoeProblem(dataclasses.replace(MX1.shape, token=1, model_dim=256), "1stage"), GPU,
     one_config(**(SWAPPED1 | {"KSPLIT": 2}))),  # K 256: one 128-deep step a split
    ("shared memory > device limit", ONE, DEV,
     one_config(BLOCK_SIZE_N=128, BLOCK_SIZE_K=256, num_stages=4)),  # 4*(16+2*128)*256*2 B = 544 KiB
    ("BLOCK_SIZE_M above 2x the pairs per expert", ONE, DEV, one_config(BLOCK_SIZE_M=32)),  # 4 pairs: up to 16
    ("per_1x128 needs BLOCK_SIZE_K and BLOCK_SIZE_N dividing 128", MoeProblem(
        shape("per_1x128", token=16, model_dim=512, inter_dim=256), "1stage"), DEV, one_config(BLOCK_SIZE_N=256)),
    ("per_1x128 needs BLOCK_SIZE_K and BLOCK_SIZE_N dividing 128", MoeProblem(
        shape("per_1x128", token=16, model_dim=512, inter_dim=256), "1stage"), DEV, one_config(BLOCK_SIZE_K=256)),
    ("8 warps on a tile under 32x128 (not the swapped MXFP4 kernel: its work is the decode)", ONE, DEV,
     one_config(num_warps=8)),  # 16x64 output tile
    ("num_stages beyond the K steps", ONE, DEV,
     one_config(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, num_stages=5)),  # D=512: 2 K steps, so at most 4 stages
]


@pytest.mark.parametrize(("rule", "problem", "dev", "config"), STAGE_RULES, ids=[r[0] for r in STAGE_RULES])
def test_each_stage_rule_prunes_on_its_own(rule: str, problem: MoeProblem, dev, config: Config) -> None:
    rules = stage_constraints(problem, dev)
    assert _failing(rules, config) == [rule]
    result = SearchSpace({k: (v,) for k, v in config.items}, rules).prune()
    assert result.kept == [] and result.pruned == {rule: 1}


@pytest.mark.parametrize(("rule", "problem", "dev", "config"), ONE_STAGE_RULES,
                         ids=[f"{i}-{r[0][:40]}" for i, r in enumerate(ONE_STAGE_RULES)])
def test_each_one_stage_rule_prunes_on_its_own(rule: str, problem: MoeProblem, dev, config: Config) -> None:
    rules = one_stage_constraints(problem, dev)
    assert _failing(rules, config) == [rule]
    result = SearchSpace({k: (v,) for k, v in config.items}, rules).prune()
    assert result.kept == [] and result.pruned == {rule: 1}


def test_the_interpreter_keeps_per_token_stages_with_its_small_block_k() -> None:
    """BLOCK_SIZE_K >= 128 for fp8 per_token is a GPU speed rule: without a GPU the tiny space (BLOCK_SIZE_K 32) would
    otherwise prune every stage candidate of a per_token row, leaving only the 1-stage kernel."""
    rules = stage_constraints(MoeProblem(shape("per_token"), "stage1"), dataclasses.replace(GPU, interpreter=True))
    assert "fp8 per_token with BLOCK_SIZE_K 64" not in _failing(rules, stage_config())


def test_mxfp4_with_16_bit_activations_may_swap_at_any_block_height() -> None:
    """The packed-PTX decode feeds the swapped dot (fused_moe._mxfp4_swap_dot) from registers: any BLOCK_SIZE_M, a
    64-row weight tile at least; fp8 activations are refused."""
    rules = stage_constraints(MX, DEV)
    for bm in (32, 64):  # 128 pairs per expert
        assert _failing(rules, stage_config(SWAP_AB=1, USE_TMA=1, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64)) == []
    assert _failing(rules, stage_config(SWAP_AB=1, USE_TMA=1, BLOCK_SIZE_M=32, BLOCK_SIZE_N=32)) == [SWAP_RULE]
    # two 64-row wgmmas a warp group raced on the H100: 128 wide on 8 warps only
    assert _failing(rules, stage_config(SWAP_AB=1, USE_TMA=1, BLOCK_SIZE_M=32, BLOCK_SIZE_N=128)) == [SWAP_RULE]
    assert _failing(rules, stage_config(SWAP_AB=1, USE_TMA=1, BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, num_warps=8)) == []


def test_the_swapped_mxfp4_gemm_may_take_8_warps_on_a_16_row_block() -> None:
    """Its work a K step is the BLOCK_N x BLOCK_K decode: stage 2's 16-row blocks on 128 x 128 tiles over 8 warps beat
    64 x 128 on 4 on the H100 (nineteenth session), which the 8-warp rule (BLOCK_M x BLOCK_N) pruned; the dot_scaled
    and 16-bit tiles keep the rule."""
    few = MoeProblem(shape("per_1x32", token=16, expert=128, topk=4, model_dim=2880, inter_dim=2880,
                           q_dtype_a="bf16", q_dtype_w="fp4x2"), "stage2")  # 64 pairs: 16-row blocks
    fields = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=4)
    rule = "8 warps on a tile under 128x64 (not the swapped MXFP4 GEMM)"
    assert _failing(stage_constraints(few, DEV), stage_config(SWAP_AB=1, USE_TMA=1, SCALE_TMA=1, **fields)) == []
    assert rule in _failing(stage_constraints(few, DEV), stage_config(**fields))  # dot_scaled: pruned as before


def test_mxfp4_splits_k_on_grids_under_two_waves() -> None:
    """MXFP4's decode loops split along K while the grid is under two programs an SM (other quants: one)."""
    one_token = MoeProblem(shape("per_1x32", token=1, expert=128, topk=4, model_dim=2880, inter_dim=2880,
                                 q_dtype_a="bf16", q_dtype_w="fp4x2"), "stage1")  # 4 experts x 45 tiles: 180
    fields = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, KSPLIT=2, GROUP_SIZE_M=1)
    rule = "split-K on a grid that already fills the GPU (MXFP4: twice)"
    assert rule not in _failing(stage_constraints(one_token, DEV), stage_config(SWAP_AB=1, USE_TMA=1, **fields))
    bf16 = MoeProblem(shape(token=1, expert=128, topk=4, model_dim=2880, inter_dim=2880), "stage1")
    assert rule in _failing(stage_constraints(bf16, DEV), stage_config(**fields))


def test_every_rule_has_a_case() -> None:
    assert {c.name for c in stage_constraints(BIG, DEV)} == {r[0] for r in STAGE_RULES}
    assert {c.name for c in one_stage_constraints(ONE, DEV)} == {r[0] for r in ONE_STAGE_RULES}


@pytest.mark.parametrize(("problem", "config"), [
    (BIG, stage_config()),
    (dataclasses.replace(BIG, kind="stage2"), stage_config(USE_TMA=1)),  # N=4096, K=1024: 16-byte rows on sm_90
    (FEW, stage_config(BLOCK_SIZE_M=16, GROUP_SIZE_M=1, KSPLIT=2)),  # 32 blocks: split-K allowed, 128*2 <= 256
    (FEW, stage_config(BLOCK_SIZE_M=16, GROUP_SIZE_M=1, SWAP_AB=1)),  # 16-pair blocks, 64-wide N tiles: swapped
])
def test_stage_config_passing_every_rule(problem: MoeProblem, config: Config) -> None:
    assert _failing(stage_constraints(problem, DEV), config) == []


def test_one_stage_config_passing_every_rule() -> None:
    assert _failing(one_stage_constraints(ONE, DEV), one_config()) == []
    # the swapped MXFP4 kernel on a GPU: 128-row tiles on 8 warps, the codes' records; under the interpreter either
    assert _failing(one_stage_constraints(MX1, GPU), one_config(**SWAPPED1)) == []
    interp = dataclasses.replace(GPU, interpreter=True)
    assert _failing(one_stage_constraints(MX1, interp), one_config(**SWAPPED1)) == []
    assert _failing(one_stage_constraints(MX1, interp), one_config()) == []
    unrecorded = dict(SWAPPED1, BLOCK_SIZE_N=64, BLOCK_SIZE_D=64, num_warps=4, SCALE_TMA=0)
    assert _failing(one_stage_constraints(MX1, GPU), one_config(**unrecorded)) == []
    two = MoeProblem(MX1.shape.with_token(2), "1stage")  # 8 blocks x 23 slices: split stage 1
    assert _failing(one_stage_constraints(two, GPU), one_config(**(SWAPPED1 | {"KSPLIT": 4}))) == []


def test_space_uses_the_rules_of_its_kind() -> None:
    t = FusedMoeTunable()
    assert [c.name for c in t.space(BIG, DEV).constraints] == [c.name for c in stage_constraints(BIG, DEV)]
    assert [c.name for c in t.space(ONE, DEV).constraints] == [c.name for c in one_stage_constraints(ONE, DEV)]
    assert dict(t.space(ONE, DEV).params) == ONE_STAGE_SPACE
    small = FusedMoeTunable(stage_space=(("KSPLIT", (1,)), ("BLOCK_SIZE_M", (16,))))
    params = small.space(BIG, DEV).params
    assert params["KSPLIT"] == (1,) and params["BLOCK_SIZE_M"] == (16,) and params["USE_TMA"] == (0, 1)


# --- problems -------------------------------------------------------------------------------------------------------

PAIR = (MoeConfig(16, 32, 32, 1, 4, 2), MoeConfig(16, 32, 32, 1, 4, 2))  # an e2e problem's plan: launch configs
NAMES = (PAIR[0].name("stage1"), PAIR[1].name("stage2"))  # what its key, space and the CSV call it


def test_problem_keys() -> None:
    s = shape()
    keys = {kind: MoeProblem(s, kind).key() for kind in ("stage1", "stage2", "1stage")}
    keys["e2e"] = MoeProblem(s, "e2e", plan=PAIR).key()
    assert len(set(keys.values())) == 4  # distinct for distinct kinds
    for kind, key in keys.items():
        assert key.startswith(f"fused_moe:{kind}:{s.key()}:skew=0")
    assert keys["e2e"].endswith(f":{NAMES[0]}+{NAMES[1]}")
    assert MoeProblem(s, "stage1", skew=1.2).key() != keys["stage1"] and "skew=1.2" in MoeProblem(
        s, "stage1", skew=1.2).key()
    assert MoeProblem(s, "e2e", plan=(PAIR[0], None)).key() != keys["e2e"]  # another plan, another key
    assert MoeProblem(s.with_token(7), "stage1").key() != keys["stage1"]
    assert MoeProblem(shape("per_token"), "stage1").key() != keys["stage1"]  # q_type (and fp8 dtypes) in the key
    assert hash(MoeProblem(s, "stage1")) == hash(MoeProblem(s, "stage1"))


def test_compile_pool_builds_an_e2e_problems_plan(monkeypatch) -> None:
    """The e2e re-time's kernels compile in the pool like the search's (its lever variants, e.g. SORTED_INTER 2, are
    new specializations): a stage pair compiles both GEMMs (as the plan launches them: programmatic dependents where
    the target has PDL), a 1-stage plan its one kernel, a stage problem its own."""
    from tritune.tuners import fused_moe_tunable as ft

    built, pdl = [], []
    monkeypatch.setattr(ft, "interpreting", lambda: False)
    monkeypatch.setattr(ft, "target_pdl", lambda: True)
    monkeypatch.setattr(ft, "compile_only", lambda kernel, dims, cfg, pdl_=False, **kw: (
        built.append((kernel, cfg, dims.tokens)), pdl.append(kw.get("pdl", pdl_))))
    s = shape()
    lever = (dataclasses.replace(PAIR[0], SORTED_INTER=2), dataclasses.replace(PAIR[1], SORTED_INTER=2))
    tunable = FusedMoeTunable()
    e2e = MoeProblem(s, "e2e", plan=lever)
    tunable.compile(e2e, tunable.space(e2e, DEV).prune().kept[0])
    assert built == [("stage1", lever[0], s.token), ("stage2", lever[1], s.token)] and pdl == [True, True]
    one = dataclasses.replace(PAIR[0], BLOCK_SIZE_D=32)
    built.clear()
    e2e = MoeProblem(s, "e2e", plan=(one, None))
    tunable.compile(e2e, tunable.space(e2e, DEV).prune().kept[0])
    assert built == [("1stage", one, s.token)]
    built.clear()
    tunable.compile(MoeProblem(s, "stage2"), stage_config())
    assert [k for k, _, _ in built] == ["stage2"]


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown fused-MoE problem kind 'stage3'"):
        MoeProblem(shape(), "stage3")


def test_e2e_problem_carries_launch_configs_and_names_them_once() -> None:
    # The re-time gets the configs themselves; the names (key, space label, CSV) are derived from them, never parsed.
    s = shape("per_token", act_type="gelu")
    pair = MoeProblem(s, "e2e", plan=PAIR)
    assert pair.plan == PAIR and pair.names == plan_names(PAIR, s) == (
        PAIR[0].name("stage1", "per_token", "gelu"), PAIR[1].name("stage2", "per_token", "gelu"))
    one = dataclasses.replace(PAIR[0], BLOCK_SIZE_D=32)
    assert MoeProblem(s, "e2e", plan=(one, None)).names == (one.name("1stage", "per_token", "gelu"), "")
    assert MoeProblem(s, "stage1").names == ("", "")
    with pytest.raises(ValueError, match="without a plan has nothing to re-time"):
        FusedMoeTunable().space(MoeProblem(s, "e2e"), DEV)
    with pytest.raises(ValueError, match="stage1 problem takes no plan"):
        MoeProblem(s, "stage1", plan=PAIR)


def test_e2e_space_is_exactly_one_config() -> None:
    space = FusedMoeTunable().space(MoeProblem(shape(), "e2e", plan=PAIR), DEV)
    assert space.size == 1
    assert list(space.configs()) == [Config.of(kernel1=NAMES[0], kernel2=NAMES[1])]
    assert space.prune().kept == [Config.of(kernel1=NAMES[0], kernel2=NAMES[1])]


# --- cost model -----------------------------------------------------------------------------------------------------

def test_flops() -> None:
    s = shape(token=3, model_dim=64, inter_dim=48, expert=4, topk=2)
    t = FusedMoeTunable()
    first, second = 2.0 * 6 * 96 * 64, 2.0 * 6 * 64 * 48
    assert t.flops(MoeProblem(s, "stage1")) == first
    assert t.flops(MoeProblem(s, "stage2")) == second
    assert t.flops(MoeProblem(s, "1stage")) == t.flops(MoeProblem(s, "e2e", plan=PAIR)) == first + second
    plain = dataclasses.replace(s, use_g1u1=False)
    assert t.flops(MoeProblem(plain, "stage1")) == first / 2


def test_bytes_count_only_routed_experts() -> None:
    t = FusedMoeTunable()
    few = shape(token=2, model_dim=64, inter_dim=32, expert=64, topk=2)  # 4 pairs over 64 experts
    many = few.with_token(64)  # 128 pairs: most of the 64 experts get a token
    r_few, r_many = routed_experts(few, 0.0), routed_experts(many, 0.0)
    assert 1 <= r_few <= 4 < r_many < few.expert
    assert r_few == torch.unique(routing(few, 0.0)[1]).numel()
    w1_expert, w2_expert = 2 * 32 * 64 * 2, 64 * 32 * 2  # bf16 gate+up and down weights of one expert

    def io(s: FmoeShape, kind: str) -> int:
        """Bytes of everything but the weights."""
        return int(t.bytes_moved(MoeProblem(s, kind))) - routed_experts(s, 0.0) * {
            "stage1": w1_expert, "stage2": w2_expert, "1stage": w1_expert + w2_expert}[kind]

    assert io(few, "stage1") == 2 * (2 * 64 + 4 * 32)  # hidden in, intermediate out
    assert io(few, "stage2") == 2 * (4 * 32 + 2 * 64)  # intermediate in, output out
    assert io(few, "1stage") == 2 * 2 * 2 * 64  # hidden in, output out
    for kind in ("stage1", "stage2", "1stage"):
        grew = t.bytes_moved(MoeProblem(many, kind)) - t.bytes_moved(MoeProblem(few, kind))
        per_expert = {"stage1": w1_expert, "stage2": w2_expert, "1stage": w1_expert + w2_expert}[kind]
        assert grew == (r_many - r_few) * per_expert + io(many, kind) - io(few, kind)
    fp8 = dataclasses.replace(few, q_type="per_token", q_dtype_a="fp8", q_dtype_w="fp8")
    assert t.bytes_moved(MoeProblem(fp8, "stage1")) == r_few * w1_expert // 2 + io(few, "stage1")  # 1-byte weights
    mx = dataclasses.replace(few, q_type="per_1x32", q_dtype_a="bf16", q_dtype_w="fp4x2")
    # half a byte per weight and one scale byte per 32; the activations and the intermediate stay 16-bit
    assert t.bytes_moved(MoeProblem(mx, "stage1")) == r_few * w1_expert // 2 * (0.5 + 1 / 32) + io(few, "stage1")


def test_skew_concentrates_routing() -> None:
    s = shape(token=64, model_dim=64, inter_dim=32, expert=64, topk=2)
    assert routed_experts(s, 3.0) < routed_experts(s, 0.0)
    w1, ids1 = routing(s, 0.0)
    w2, ids2 = routing(s, 0.0)
    assert torch.equal(ids1, ids2) and torch.equal(w1, w2)  # seeded: every kind of a row sees the same routing
    assert w1.dtype == torch.float32 and ids1.dtype == torch.int32 and ids1.shape == (64, 2)


def test_tolerance() -> None:
    for quant in ("none", "per_token", "per_1x128", "per_1x32"):
        fix = {"q_dtype_a": "bf16", "q_dtype_w": "fp4x2"} if quant == "per_1x32" else {}
        tol = FusedMoeTunable(err_ratio=0.25).tolerance(MoeProblem(shape(quant, **fix), "stage1"))
        assert tol.max_mismatch_ratio == 0.25
        assert tol.max_rel_l2 == REL_L2_BOUND[quant]
        assert (tol.atol, tol.rtol) == (FusedMoeTunable().atol, FusedMoeTunable().rtol)
    assert REL_L2_BOUND["none"] <= REL_L2_BOUND["per_token"] == REL_L2_BOUND["per_1x128"]
    assert REL_L2_BOUND["per_1x32"] == REL_L2_BOUND["none"]  # the reference runs on the dequantized weights


# --- what the GPU worker does, on the CPU ---------------------------------------------------------------------------

TINY = dict(token=3, model_dim=40, inter_dim=24, expert=5, topk=2, act_type="gelu", dtype="fp16",
            q_dtype_a="fp16", q_dtype_w="fp16", q_type="none", use_g1u1=True, doweight_stage1=False)
SMALL = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
STAGE = Config.of(**{k: v for k, v in dataclasses.asdict(SMALL).items() if k != "BLOCK_SIZE_D"})
ONE_STAGE = Config.of(**{k: v for k, v in dataclasses.asdict(SMALL).items() if k not in ("KSPLIT", "USE_TMA")}
                      | {"BLOCK_SIZE_D": 32})
FP8_TINY = TINY | dict(q_dtype_a="fp8", q_dtype_w="fp8", q_type="per_1x128", doweight_stage1=True)
LEVERS = dataclasses.replace(SMALL, SORTED_INTER=2, TOPK_ATOMIC=1)
MX_TINY = TINY | dict(model_dim=64, inter_dim=32, q_dtype_w="fp4x2", q_type="per_1x32")  # K multiples of 32
MX8_TINY = MX_TINY | dict(q_dtype_a="fp8")  # per_1x32_a8: fp8 per-token activations
# The swapped MXFP4 1-stage kernel: prepared weights and the codes' records (inter_dim 128: a 128-row slice, gate and
# up rows each on their own record)
MX1_TINY = MX_TINY | dict(inter_dim=128)
SWAPPED_ONE = dataclasses.replace(SMALL, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=64, num_warps=8,
                                  SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)


@pytest.mark.parametrize(("fields", "kind", "config", "plan"), [
    (TINY, "stage1", STAGE, None),
    (TINY, "stage1", STAGE.replace(KSPLIT=2), None),  # split-K: the finish kernel writes `out`
    (TINY, "stage2", STAGE, None),
    (TINY | dict(doweight_stage1=True), "stage2", STAGE.replace(KSPLIT=2), None),
    (TINY, "1stage", ONE_STAGE, None),
    (TINY, "e2e", None, (SMALL, SMALL)),
    (TINY, "e2e", None, (dataclasses.replace(SMALL, BLOCK_SIZE_D=32), None)),
    (FP8_TINY, "stage2", STAGE, None),  # fp8 1x128: the stage-2 input is the reference intermediate
    (FP8_TINY, "e2e", None, (dataclasses.replace(SMALL, BLOCK_SIZE_D=32), None)),
    (TINY, "e2e", None, (LEVERS, LEVERS)),  # the tuner's lever variant: sorted intermediate via TMA, atomic top-k
    (FP8_TINY, "e2e", None, (dataclasses.replace(LEVERS, SORTED_INTER=1),) * 2),
    (MX_TINY, "stage1", STAGE, None),  # MXFP4: packed weights, the dequantized reference
    (MX8_TINY, "stage2", STAGE, None),
    (MX8_TINY, "1stage", ONE_STAGE, None),
    (MX8_TINY, "e2e", None, (SMALL, SMALL)),
    (MX1_TINY, "1stage", Config.of(**{k: getattr(SWAPPED_ONE, k) for k in ONE_STAGE_SPACE}), None),
    (MX1_TINY, "e2e", None, (SWAPPED_ONE, None)),
], ids=["stage1", "stage1-ksplit2", "stage2", "stage2-ksplit2-doweight", "1stage", "e2e-2stage", "e2e-1stage",
        "stage2-per_1x128", "e2e-1stage-per_1x128", "e2e-levers", "e2e-levers-per_1x128", "stage1-mxfp4",
        "stage2-mxfp4-a8", "1stage-mxfp4-a8", "e2e-mxfp4-a8", "1stage-mxfp4-swapped", "e2e-1stage-mxfp4-swapped"])
def test_worker_path_matches_reference(fields: dict, kind: str, config: Config | None, plan) -> None:
    problem = MoeProblem(FmoeShape(**fields), kind, plan=plan)
    tunable = FusedMoeTunable()
    config = config or next(tunable.space(problem, DEV).configs())
    inputs = tunable.make_inputs(problem, DEVICE, seed=0)
    again = tunable.make_inputs(problem, DEVICE, seed=0)
    assert all(v is None or torch.equal(v.float(), again[k].float()) for k, v in inputs.items())  # seeded
    ref = tunable.reference(problem, inputs)
    out = tunable.alloc_output(problem, inputs)
    s = problem.shape
    assert out.shape == ref.shape == ((s.token * s.topk, s.inter_dim) if kind == "stage1" else (s.token, s.model_dim))
    assert out.dtype == torch.float16 and ref.dtype == torch.float32 and ref.abs().max() > 0
    fn = tunable.launcher(problem, inputs, config, out)
    for _ in range(2):  # the worker runs the launcher again after timing, on re-poisoned output
        poison(out)
        fn()
        check = check_output(out, ref, tunable.tolerance(problem))
        assert check.passed, check.reason
        assert check.rel_l2_err < 1e-2 and check.unwritten == 0


def test_make_inputs_shapes_and_dtypes() -> None:
    t = FusedMoeTunable()
    s = FmoeShape(**(FP8_TINY | dict(use_g1u1=False)))
    x = t.make_inputs(MoeProblem(s, "stage2"), DEVICE, seed=3)
    assert x["hidden"].shape == (3, 40) and x["hidden"].dtype == torch.float16
    assert x["w1"].shape == (5, 24, 40) and x["w1"].dtype == torch.float8_e4m3fn  # no gate-up: [E, I, D]
    assert x["w2"].shape == (5, 40, 24) and x["w1_scale"].shape == (5, 1, 1) and x["w2_scale"].shape == (5, 1, 1)
    assert x["inter"].shape == (6, 24) and x["inter"].dtype == torch.float16
    assert "inter" not in t.make_inputs(MoeProblem(s, "stage1"), DEVICE, seed=3)
    assert x["hidden"].float().std() > 0.5  # randn, never zeros


def test_mxfp4_inputs_carry_the_records_and_the_prepared_bytes_of_the_weights_the_kind_runs() -> None:
    """The swapped GEMM's prepared forms, made once per problem: both scales' records, and the prepared (re-encoded,
    tile-major) bytes of w1 for stage 1, of w2 for stage 2, of both for the whole op."""
    from tritune.kernels.mxfp4_swizzle import Mxfp4Weights

    t = FusedMoeTunable()
    s = shape("per_1x32", q_dtype_a="fp16", q_dtype_w="fp4x2", dtype="fp16", token=3, model_dim=64, inter_dim=32,
              expert=4, topk=2)
    for kind, names in (("stage1", {"w1"}), ("stage2", {"w2"}), ("e2e", {"w1", "w2"})):
        x = t.make_inputs(MoeProblem(s, kind), DEVICE, seed=3)
        assert {k.removesuffix("_tiles") for k in x if k.endswith("_tiles")} == names, kind
        assert "w1_scale_records" in x and "w2_scale_records" in x
        for name in names:
            prepared = Mxfp4Weights(x[f"{name}_tiles"], *x[name].shape[1:])
            assert torch.equal(prepared.standard().cpu(), x[name].cpu())


def test_launcher_rejects_config_the_kernel_cannot_run() -> None:
    problem = MoeProblem(FmoeShape(**TINY), "1stage")
    t = FusedMoeTunable()
    inputs = t.make_inputs(problem, DEVICE, seed=0)
    with pytest.raises(ValueError, match="BLOCK_SIZE_D"):
        t.launcher(problem, inputs, ONE_STAGE.replace(BLOCK_SIZE_D=0), t.alloc_output(problem, inputs))


def test_extra_points_are_measured_whatever_the_constraints_say() -> None:
    """SearchSpace.extra: after the product's points, each once; kept by prune even where a constraint fails (the
    op's own choice is always measured); a `with_params` copy keeps them."""
    from tritune.tuning.space import Constraint

    not_two = Constraint("a is not 2", lambda c: c["a"] != 2)
    inside, outside = Config.of(a=2, b=0), Config.of(a=3, b=0)
    space = SearchSpace({"a": (1, 2), "b": (0,)}, (not_two,), extra=(outside, inside, outside))
    assert space.size == 3 and list(space.configs()) == [Config.of(a=1, b=0), inside, outside]
    pruned = space.prune()
    assert pruned.kept == [Config.of(a=1, b=0), inside, outside] and pruned.pruned == {}
    plain = SearchSpace({"a": (1, 2), "b": (0,)}, (not_two,))
    assert plain.size == 2 and plain.prune().pruned == {"a is not 2": 1}
    wider = space.with_params({"a": (1, 2, 3)})
    assert wider.extra == space.extra and wider.size == 3  # 3 is in the product now: once


def test_the_rule_tables_kernels_join_the_stage_search_on_a_gpu() -> None:
    """Each stage space holds the rule table's kernel of its kind (its searched fields), outside the constraints;
    not under the interpreter, and not when the space is overridden (tests, --search-space)."""
    from tritune.tuners.fused_moe_tunable import rule_plan, rule_points

    big = MoeProblem(shape(token=4096, inter_dim=384, expert=128, topk=8), "stage2")
    first, second = rule_plan(big.shape, GPU)
    (point,) = FusedMoeTunable().space(big, GPU).extra
    assert point.as_dict() == {n: getattr(second, n) for n in STAGE_SPACE}
    assert FusedMoeTunable().space(dataclasses.replace(big, kind="stage1"), GPU).extra == (
        Config.from_dict({n: getattr(first, n) for n in STAGE_SPACE}),)
    assert FusedMoeTunable().space(dataclasses.replace(big, kind="1stage"), GPU).extra == ()  # a 2-stage plan
    assert FusedMoeTunable().space(big, dataclasses.replace(DEV, interpreter=True)).extra == ()  # interpreted
    assert FusedMoeTunable(stage_space=(("KSPLIT", (1,)),)).space(big, GPU).extra == ()
    assert rule_points(big, GPU, dict(STAGE_SPACE)) == (point,)


def test_the_multiply_add_rules_one_by_one(monkeypatch) -> None:
    """BLOCK_SIZE_M under 16 (the stage kernels' multiply-add path): only for 16-bit or MXFP4 weights without TMA or
    SWAP_AB, only as the power of two holding the pairs per expert, only with its product within 128 registers a
    thread; such values join the default space only with FMA_IN_SPACE."""
    from tritune.tuners import fused_moe_tunable as fmt

    decode = MoeProblem(shape(token=1, expert=128, topk=8), "stage1")  # 8 pairs over 128 experts: 1 per expert
    three = MoeProblem(shape(token=12, expert=8, topk=2), "stage2")  # 24 pairs over 8 experts: 3 per expert
    fp8 = MoeProblem(shape("per_token", token=1, expert=128, topk=8), "stage1")
    fma = stage_config(BLOCK_SIZE_M=1, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1)
    assert _failing(stage_constraints(decode, GPU), fma) == []
    assert _failing(stage_constraints(three, GPU), fma.replace(BLOCK_SIZE_M=4)) == []
    assert _failing(stage_constraints(three, GPU), fma.replace(BLOCK_SIZE_M=2)) == [
        "BLOCK_SIZE_M under 16 only as the power of two holding the pairs per expert"]
    assert "BLOCK_SIZE_M under 16 only for 16-bit or MXFP4 weights, without TMA or SWAP_AB" in _failing(
        stage_constraints(fp8, GPU), fma)
    assert "BLOCK_SIZE_M under 16 only for 16-bit or MXFP4 weights, without TMA or SWAP_AB" in _failing(
        stage_constraints(decode, GPU), fma.replace(USE_TMA=1))
    wide = fma.replace(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, num_stages=1)  # 1 x 256 x 128 fp32
    assert _failing(stage_constraints(decode, GPU), wide) == ["multiply-add product > 128 registers per thread"]
    assert _failing(stage_constraints(decode, GPU), wide.replace(num_warps=8)) == []  # 8 warps share it
    assert 1 not in FusedMoeTunable().space(decode, GPU).params["BLOCK_SIZE_M"]
    monkeypatch.setattr(fmt, "FMA_IN_SPACE", True)
    space = FusedMoeTunable().space(decode, GPU)
    assert space.params["BLOCK_SIZE_M"][:4] == fmt.FMA_BLOCK_M
    kept = {c["BLOCK_SIZE_M"] for c in space.prune().kept}
    assert 1 in kept and not kept & {2, 4, 8}


def test_deterministic_leaves_the_rule_plan_a_stage_pair(monkeypatch):
    """TRITUNE_DETERMINISTIC=1: the op passes over 1-stage plans (they sum with atomics), so the tuner neither tunes
    the 1-stage kind nor re-times the rule table's 1-stage plan."""
    from tritune import knobs
    from tritune.tuners.fused_moe_tunable import rule_plan

    gpu = dataclasses.replace(GPU, capability=(9, 0))
    first, second = rule_plan(MX1.shape, gpu)  # gpt-oss-120b at 16 tokens: the swapped 1-stage kernel
    assert second is None and first.SWAP_AB == 1
    monkeypatch.setenv(knobs.DETERMINISTIC, "1")
    first, second = rule_plan(MX1.shape, gpu)
    assert second is not None and first.SWAP_AB == second.SWAP_AB == 1
