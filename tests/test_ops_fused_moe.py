"""ops.fused_moe: tuned-row lookup (exact token count, off-grid choice, SM count, bad rows), the per-process cache, the
heuristic, and the op's result against the torch reference (fp16 only: bf16 tl.dot is broken in the interpreter)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time

import pytest
import torch

from tritune import knobs
from tritune.device import current_device
from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, quantize_weights
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.ops.fused_moe import (
    fused_moe,
    fused_moe_a8w8,
    fused_moe_a8w8_blockscale,
    fused_moe_choice,
    heuristic_moe_choice,
    reload_moe_configs,
)
from tritune.ops.routing import sample_routing
from tritune.store.fmoe_csv import write_tuned
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned

# tritune.ops.fused_moe is the op function (the package re-exports it); the module is this.
op = importlib.import_module("tritune.ops.fused_moe")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CU = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else current_device().cu_num
# Odd sizes: D=40 is not a multiple of BLOCK_SIZE_K=32 (masked K), INTER=24 < BLOCK_SIZE_N=32 (masked N), 7 tokens.
T, D, INTER, E, TOPK = 7, 40, 24, 5, 2
# Small blocks, so the interpreter is quick; GROUP_SIZE_M 1 and 2 stages to be told apart from the heuristic.
SMALL = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
SMALL_N16 = dataclasses.replace(SMALL, BLOCK_SIZE_N=16)
ONE = dataclasses.replace(SMALL, BLOCK_SIZE_D=32)  # 1-stage: D=40 spans a full and a masked 32-column block


def shape(quant: str = "none", token: int = T, model_dim: int = D) -> FmoeShape:
    q = "fp8" if quant != "none" else "fp16"
    return FmoeShape(token=token, model_dim=model_dim, inter_dim=INTER, expert=E, topk=TOPK, act_type="silu",
                     dtype="fp16", q_dtype_a=q, q_dtype_w=q, q_type=quant, use_g1u1=True, doweight_stage1=False)


def row(s: FmoeShape, name1: str, name2: str = "", *, run_1stage: bool = False, cu_num: int = CU) -> FmoeTuned:
    return FmoeTuned(cu_num=cu_num, shape=s, block_m=16, ksplit=0, us1=3.0, kernelName1=name1, err1=0.001,
                     us2=0.0 if run_1stage else 2.0, kernelName2=name2, err2=0.0, us=5.0, run_1stage=run_1stage,
                     tflops=1.0, bw=1.0)


def two_stage(s: FmoeShape, c1: MoeConfig = SMALL, c2: MoeConfig = SMALL, **kw) -> FmoeTuned:
    return row(s, c1.name("stage1", s.q_type, s.act_type), c2.name("stage2", s.q_type, s.act_type), **kw)


@pytest.fixture
def use_rows(tmp_path, monkeypatch):
    """use_rows(rows) -> path: TRITUNE_CONFIG_FMOE names a file holding exactly `rows`; caches dropped."""
    def use(rows: list[FmoeTuned]):
        path = tmp_path / "tuned_fmoe.csv"
        write_tuned(path, rows)
        monkeypatch.setenv(knobs.CONFIG_FMOE, str(path))
        reload_moe_configs()
        return path
    yield use
    reload_moe_configs()  # later tests must not see this file's choices


def problem(quant: str = "none", tokens: int = T, model_dim: int = D, seed: int = 0):
    """fp16 hidden, gate-up weights (fp8 + scales for quant types) and sampled routing, seeded."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, model_dim, generator=g).half()
    w1 = torch.randn(E, 2 * INTER, model_dim, generator=g) / model_dim ** 0.5
    w2 = torch.randn(E, model_dim, INTER, generator=g) / INTER ** 0.5
    if quant == "none":
        w1, w2, s1, s2 = w1.half(), w2.half(), None, None
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    weights, ids = sample_routing(tokens, E, TOPK, seed=seed)
    to = (lambda t: None if t is None else t.to(DEV))
    return to(hidden), to(w1), to(w2), to(weights), to(ids), to(s1), to(s2)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_tuned_2stage_matches_reference(use_rows, monkeypatch):
    path = use_rows([two_stage(shape())])
    hidden, w1, w2, weights, ids, _, _ = problem()
    choice = fused_moe_choice(hidden, w1, w2, ids)
    assert (choice.run_1stage, choice.stage1, choice.stage2) == (False, SMALL, SMALL)
    assert choice.source == f"tuned: {path}, row 1 (line 2)"
    out = fused_moe(hidden, w1, w2, weights, ids)
    assert out.shape == (T, D) and out.dtype == torch.float16
    assert rel_l2(out, fused_moe_reference(hidden, w1, w2, weights, ids)) < 1e-2


@pytest.mark.parametrize(("quant", "sorted_inter"), [("none", 2), ("per_token", 1), ("per_1x128", 1)])
def test_tuned_row_with_the_plan_levers_runs_them(use_rows, monkeypatch, quant, sorted_inter):
    """A row whose kernel names carry SORTED_INTER / TOPK_ATOMIC (what the tuner writes when that variant is faster
    end to end) binds them, and the op still matches the reference. (fp8 quantizes the intermediate before stage 2,
    whose TMA would need rows of 16-byte multiples: INTER 24 is not, so those rows take pointer loads.)"""
    levers = dataclasses.replace(SMALL, SORTED_INTER=sorted_inter, TOPK_ATOMIC=1)
    use_rows([two_stage(shape(quant), levers, levers)])
    ran = []
    real = op.MoeLaunch
    monkeypatch.setattr(op, "MoeLaunch", lambda *a, **kw: ran.append((kw["stage1"], kw["stage2"])) or real(*a, **kw))
    hidden, w1, w2, weights, ids, s1, s2 = problem(quant, seed=4)
    out = fused_moe(hidden, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
    assert ran == [(levers, levers)]
    ref = fused_moe_reference(hidden, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
    assert rel_l2(out, ref) < (1e-2 if quant == "none" else 2e-2)


def test_tuned_1stage_matches_reference(use_rows, monkeypatch):
    use_rows([row(shape(), ONE.name("1stage", "none", "silu"), run_1stage=True)])
    ran = []
    ops_fused_moe = sys.modules["tritune.ops.fused_moe"]  # the module (tritune.ops.fused_moe is the op)
    real = ops_fused_moe.MoeLaunch
    monkeypatch.setattr(ops_fused_moe, "MoeLaunch", lambda *a, **kw: ran.append((kw["stage1"], kw["stage2"]))
                        or real(*a, **kw))
    hidden, w1, w2, weights, ids, _, _ = problem(seed=1)
    out = fused_moe(hidden, w1, w2, weights, ids)
    assert ran == [(ONE, None)]  # the 1-stage launch was bound with the tuned config
    ref = fused_moe_reference(hidden, w1, w2, weights, ids, requantize_intermediate=False)
    assert rel_l2(out, ref) < 1e-2


@pytest.mark.parametrize(("quant", "run"), [
    ("per_token", fused_moe_a8w8),  # per-channel fp8 weights
    ("per_1x128", fused_moe_a8w8_blockscale),  # 128×128-block fp8 weights; D, INTER < 128: one partial block each
])
def test_fp8_ops_match_reference(quant, run, use_rows):
    use_rows([two_stage(shape(quant))])
    hidden, w1, w2, weights, ids, s1, s2 = problem(quant, seed=2)
    assert fused_moe_choice(hidden, w1, w2, ids, quant=quant).source.startswith("tuned: ")
    out = run(hidden, w1, w2, weights, ids, s1, s2)
    ref = fused_moe_reference(hidden, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
    assert rel_l2(out, ref) < 1e-2


def _choice_for(tokens: int, model_dim: int = D, quant: str = "none"):
    """A choice needs only shapes: empty tensors of the call's shapes and dtypes."""
    wdtype = torch.float8_e4m3fn if quant != "none" else torch.float16
    hidden = torch.empty(tokens, model_dim, dtype=torch.float16, device=DEV)
    w1 = torch.empty(E, 2 * INTER, model_dim, dtype=wdtype, device=DEV)
    w2 = torch.empty(E, model_dim, INTER, dtype=wdtype, device=DEV)
    ids = torch.zeros(tokens, TOPK, dtype=torch.int32, device=DEV)
    return fused_moe_choice(hidden, w1, w2, ids, quant=quant)


@pytest.mark.parametrize("tokens", [
    8,  # tuned exactly
    64,  # tuned exactly (the other row)
    5,  # between nothing and 8: the two nearest tuned rows compete, scaled down
    20,  # between 8 and 64
    3000,  # far past 64: still a cost estimate (the rule table competes)
])
def test_choice_exact_and_off_grid(tokens, use_rows):
    path = use_rows([two_stage(shape(token=8)), two_stage(shape(token=64), SMALL_N16, SMALL_N16)])
    choice = _choice_for(tokens)
    if tokens in (8, 64):
        want = SMALL if tokens == 8 else SMALL_N16
        row = 1 if tokens == 8 else 2
        assert (choice.stage1, choice.stage2) == (want, want)
        assert choice.source == f"tuned: {path}, row {row} (line {row + 1})"
        return
    assert choice.source.startswith(f"off-grid: tokens={tokens}") and choice.source.endswith(f"from {path}")
    heuristic = heuristic_moe_choice(tokens, D, INTER, E, TOPK, "none")
    assert (choice.run_1stage, choice.stage1, choice.stage2) in (
        (False, SMALL, SMALL), (False, SMALL_N16, SMALL_N16),
        (heuristic.run_1stage, heuristic.stage1, heuristic.stage2))


def test_unknown_shape_and_other_sm_count_use_heuristic(use_rows):
    use_rows([two_stage(shape(model_dim=48)), two_stage(shape(), cu_num=CU + 1)])
    choice = _choice_for(T)  # D=40 is tuned only for another SM count; D=48 only here but not called
    assert choice == heuristic_moe_choice(T, D, INTER, E, TOPK, "none")
    assert choice.source == "heuristic"
    assert _choice_for(T, model_dim=48).source.startswith("tuned: ")


def test_choice_is_cached_until_reload(use_rows, monkeypatch):
    use_rows([two_stage(shape())])
    calls = []
    real = op.default_table
    monkeypatch.setattr(op, "default_table", lambda: calls.append(1) or real())
    first = _choice_for(T)
    assert _choice_for(T) is first  # same token count: no table or file access
    assert len(calls) == 1
    _choice_for(5)  # another token count is chosen afresh (off the tuned grid: a cost estimate)
    assert len(calls) == 2
    reload_moe_configs()
    assert _choice_for(T) == first and len(calls) == 3


@pytest.mark.parametrize("bad", [
    row(shape(), "moe_stage1_none_silu_BM16_garbled!", SMALL.name("stage2")),  # does not parse
    row(shape(), SMALL.name("stage2"), SMALL.name("stage2")),  # a stage-2 kernel where stage 1 belongs
    row(shape(), SMALL.name("stage1", "per_token"), SMALL.name("stage2")),  # kernel of another quant type
    two_stage(shape(), SMALL, dataclasses.replace(SMALL, BLOCK_SIZE_M=32)),  # stages disagree on BLOCK_SIZE_M
    two_stage(shape(), SMALL, dataclasses.replace(SMALL, SORTED_INTER=1)),  # ... on a plan-level option
    row(shape(), "moe_stage1_none_silu_BM16_BN24_BK32", SMALL.name("stage2")),  # BLOCK_SIZE_N not a power of 2
    row(shape(), SMALL.name("1stage"), run_1stage=True),  # 1-stage config without BLOCK_SIZE_D
])
def test_bad_tuned_row_warns_and_falls_back(bad, use_rows):
    path = use_rows([bad])
    with pytest.warns(UserWarning, match=f"{path}, row 1"):
        choice = _choice_for(T)
    assert choice == heuristic_moe_choice(T, D, INTER, E, TOPK, "none")


@pytest.mark.parametrize("quant", fm.QUANT_TYPES)
def test_heuristic_configs_always_valid(quant):
    # The rule table itself is pinned in tests/test_heuristics.py; here: what the op gets is always runnable.
    dims = [(24, 40), (64, 32), (4096, 14336), (7168, 2048), (5120, 1536)]
    for tokens in (1, 3, 16, 100, 512, 4096, 32768):
        for experts, topk in ((8, 2), (64, 8), (256, 8)):
            for model_dim, inter_dim in dims:
                choice = heuristic_moe_choice(tokens, model_dim, inter_dim, experts, topk, quant)
                assert choice.source == "heuristic"
                if choice.run_1stage:
                    assert tokens * topk <= 256 and choice.stage2 is None
                    check_config(choice.stage1, "1stage", quant)
                    continue
                check_config(choice.stage1, "stage1", quant)
                check_config(choice.stage2, "stage2", quant)
                assert choice.stage1.BLOCK_SIZE_M == choice.stage2.BLOCK_SIZE_M


def test_heuristic_runs_end_to_end(use_rows):
    use_rows([])  # a header-only file: no tuned row, whatever the package ships
    tokens, model_dim, inter_dim, experts = 3, 64, 32, 3
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, model_dim, generator=g).half().to(DEV)
    w1 = (torch.randn(experts, 2 * inter_dim, model_dim, generator=g) / 8).half().to(DEV)
    w2 = (torch.randn(experts, model_dim, inter_dim, generator=g) / 6).half().to(DEV)
    weights, ids = sample_routing(tokens, experts, 2, seed=3, device=DEV)
    choice = fused_moe_choice(hidden, w1, w2, ids)
    assert choice == heuristic_moe_choice(tokens, model_dim, inter_dim, experts, 2, "none")
    assert choice.stage1.BLOCK_SIZE_M == 16
    start = time.perf_counter()
    out = fused_moe(hidden, w1, w2, weights, ids)
    assert time.perf_counter() - start < 20
    assert rel_l2(out, fused_moe_reference(hidden, w1, w2, weights, ids)) < 1e-2


def test_empty_batch(use_rows):
    use_rows([])
    hidden, w1, w2, weights, ids, _, _ = problem()
    out = fused_moe(hidden[:0], w1, w2, weights[:0], ids[:0])
    assert out.shape == (0, D) and out.dtype == torch.float16


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"activation": "relu"}, "activation 'relu'"),
    ({"quant": "int8"}, "quant 'int8'"),
])
def test_bad_strings_raise(kwargs, match, monkeypatch):
    monkeypatch.setattr(op, "default_table", lambda: pytest.fail("looked up before checking the arguments"))
    hidden, w1, w2, weights, ids, _, _ = problem()
    with pytest.raises(ValueError, match=match):
        fused_moe(hidden, w1, w2, weights, ids, **kwargs)
    with pytest.raises(ValueError, match="quant 'int8'"):
        heuristic_moe_choice(T, D, INTER, E, TOPK, "int8")


def test_a_cached_plan_keeps_no_call_tensor_alive(use_rows):
    """The op caches its bound plans; they must not hold the call's tensors. A TMA plan kept its weights through the
    descriptor it was bound with, and the tuner, which builds fresh weights for each end-to-end candidate, ran one
    H100 out of memory re-timing Mixtral rows (2.7 GB a candidate, issue 17)."""
    import gc
    import weakref

    use_rows([])
    tma = dataclasses.replace(SMALL, USE_TMA=1)
    model_dim = 48  # fp16 rows of 96 / 48 bytes: TMA-able

    def call() -> list[weakref.ref]:
        g = torch.Generator().manual_seed(5)
        hidden = torch.randn(T, model_dim, generator=g).half().to(DEV)
        w1 = (torch.randn(E, 2 * INTER, model_dim, generator=g) / 8).half().to(DEV)
        w2 = (torch.randn(E, model_dim, INTER, generator=g) / 6).half().to(DEV)
        weights, ids = sample_routing(T, E, TOPK, seed=5, device=DEV)
        out = fused_moe(hidden, w1, w2, weights, ids, choice=op.MoeChoice(False, tma, tma, "test"))
        assert rel_l2(out, fused_moe_reference(hidden, w1, w2, weights, ids)) < 1e-2
        return [weakref.ref(t) for t in (hidden, w1, w2, weights, ids)]

    plans = len(op._PLANS)
    refs = call()
    gc.collect()
    assert len(op._PLANS) == plans + 1  # the plan is cached...
    assert [r() is None for r in refs] == [True] * 5  # ...and every tensor of the call is gone


def test_deterministic_passes_over_plans_that_sum_with_atomics(use_rows, monkeypatch):
    """TRITUNE_DETERMINISTIC=1: a tuned 1-stage or TOPK_ATOMIC row gives way to the neighbouring rows or the rule
    table's stage pair, and the rule table never takes the 1-stage kernel (here at 2 tokens, 4 pairs), so every
    run adds in the same order: two calls, the same bits."""
    levers = dataclasses.replace(SMALL, TOPK_ATOMIC=1)
    use_rows([row(shape(), ONE.name("1stage", "none", "silu"), run_1stage=True),
              two_stage(shape(token=2), levers, levers)])
    hidden, w1, w2, weights, ids, _, _ = problem()
    assert fused_moe_choice(hidden, w1, w2, ids).run_1stage  # the tuned 1-stage row
    monkeypatch.setenv(knobs.DETERMINISTIC, "1")
    reload_moe_configs()
    for tokens in (T, 2):
        hidden, w1, w2, weights, ids, _, _ = problem(tokens=tokens)
        choice = fused_moe_choice(hidden, w1, w2, ids)
        assert not op.sums_with_atomics(choice) and choice.source.startswith("heuristic"), (tokens, choice)
        first = fused_moe(hidden, w1, w2, weights, ids)
        assert torch.equal(fused_moe(hidden, w1, w2, weights, ids), first)
        assert rel_l2(first, fused_moe_reference(hidden, w1, w2, weights, ids)) < 1e-2
    assert op.heuristic_moe_choice(2, D, INTER, E, TOPK, "none").run_1stage  # the rule table's own at 4 pairs
