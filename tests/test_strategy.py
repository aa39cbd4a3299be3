"""Strategies replayed against a recorded journal: budgets, no repeats, best(), the optimum, determinism."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tritune.tuning.journal import Journal
from tritune.tuning.space import SearchSpace
from tritune.tuning.strategy import (
    HOST_BOUND_SHARE,
    STRATEGIES,
    Evaluate,
    best,
    best_for,
    exhaustive,
    finalists,
    host_bound,
    neighbourhood,
    random_sample,
    replay_evaluator,
    resolve_objective,
)
from tritune.tuning.types import Config, Measurement, Objective, Status

PROBLEM = "gemm:m=4096,n=4096,k=4096,bf16"
SPACE = SearchSpace(
    {
        "BLOCK_M": (16, 32, 64, 128, 256),
        "BLOCK_N": (16, 32, 64, 128, 256),
        "num_warps": (1, 2, 4, 8),
        "num_stages": (1, 2, 3, 4),
    }
)
CANDIDATES = list(SPACE.configs())  # 400 configs
OPTIMUM = Config.of(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)


def _landscape(c: Config) -> Measurement:
    """Separable bowl around OPTIMUM in log2 space; big tiles run out of resources, one tile shape is wrong."""
    if c["BLOCK_M"] * c["BLOCK_N"] >= 256 * 128:
        return Measurement(PROBLEM, c, Status.OUT_OF_RESOURCES, message="shared memory")
    if c["BLOCK_M"] == 16 and c["BLOCK_N"] == 16:
        return Measurement(PROBLEM, c, Status.WRONG_ANSWER, time_us=1.0, error=0.5, message="mismatch 50% > 0%")
    cost = sum((math.log2(c[k]) - math.log2(OPTIMUM[k])) ** 2 for k in ("BLOCK_M", "BLOCK_N", "num_warps"))
    cost += 0.5 * (c["num_stages"] - OPTIMUM["num_stages"]) ** 2
    return Measurement(PROBLEM, c, Status.OK, time_us=100.0 + 10.0 * cost, error=0.0, rel_l2_err=1e-4)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal(tmp_path / "journal.sqlite") as j:
        for c in CANDIDATES:
            j.record(_landscape(c))
        yield j


class Recorder:
    """Wraps an Evaluate and remembers every batch it was asked for."""

    def __init__(self, evaluate: Evaluate) -> None:
        self.evaluate = evaluate
        self.batches: list[list[Config]] = []

    def __call__(self, batch: Sequence[Config]) -> list[Measurement]:
        self.batches.append(list(batch))
        return self.evaluate(batch)

    @property
    def evaluated(self) -> list[Config]:
        return [c for b in self.batches for c in b]


def test_best() -> None:
    a, b, c = Config.of(x=1), Config.of(x=2), Config.of(x=3)
    assert best([]) is None
    assert best([Measurement("p", a, Status.TIMEOUT), Measurement("p", b, Status.WRONG_ANSWER, time_us=1.0)]) is None
    ms = [
        Measurement("p", c, Status.OK, time_us=5.0),
        Measurement("p", b, Status.WRONG_ANSWER, time_us=1.0),  # fast but wrong never wins
        Measurement("p", a, Status.OK, time_us=7.0),
    ]
    assert best(ms).config == c
    tie = [Measurement("p", c, Status.OK, time_us=5.0), Measurement("p", a, Status.OK, time_us=5.0)]
    assert best(tie).config == a and best(reversed(tie)).config == a  # ties go to the smaller config


def test_replay_evaluator(journal: Journal) -> None:
    evaluate = replay_evaluator(journal, PROBLEM)
    missing = Config.of(BLOCK_M=512, BLOCK_N=16, num_warps=1, num_stages=1)
    got = evaluate([OPTIMUM, missing])
    assert got[0].ok and got[0].time_us == 100.0
    assert got[1].status is Status.CRASHED and got[1].message == "not in journal" and got[1].config == missing
    assert all(m.status is Status.CRASHED for m in replay_evaluator(journal, "other")([OPTIMUM]))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("budget", [0, 1, 40, 1000])  # nothing, one, part of the space, more than the space
def test_budget_and_no_repeats(journal: Journal, name: str, budget: int) -> None:
    recorder = Recorder(replay_evaluator(journal, PROBLEM))
    results = STRATEGIES[name](CANDIDATES, recorder, budget=budget, seed=3)
    evaluated = recorder.evaluated
    assert len(evaluated) <= budget
    assert len(set(evaluated)) == len(evaluated)
    assert [m.config for m in results] == evaluated
    assert set(evaluated) <= set(CANDIDATES)
    if budget == 0:
        assert results == [] and recorder.batches == []


def test_exhaustive(journal: Journal) -> None:
    recorder = Recorder(replay_evaluator(journal, PROBLEM))
    results = exhaustive(CANDIDATES + CANDIDATES[:5], recorder)  # duplicates are evaluated once
    assert len(recorder.batches) == 1 and recorder.evaluated == CANDIDATES
    assert best(results).config == OPTIMUM
    assert [m.config for m in exhaustive(CANDIDATES, recorder, budget=7)] == CANDIDATES[:7]


def test_random_sample(journal: Journal) -> None:
    evaluate = replay_evaluator(journal, PROBLEM)
    first = [m.config for m in random_sample(CANDIDATES, evaluate, budget=50, seed=1)]
    again = [m.config for m in random_sample(CANDIDATES, evaluate, budget=50, seed=1)]
    other = [m.config for m in random_sample(CANDIDATES, evaluate, budget=50, seed=2)]
    assert first == again and first != other and len(set(first)) == 50
    assert set(m.config for m in random_sample(CANDIDATES, evaluate, seed=0)) == set(CANDIDATES)


@pytest.mark.parametrize("seed", range(5))
def test_neighbourhood_finds_optimum(journal: Journal, seed: int) -> None:
    recorder = Recorder(replay_evaluator(journal, PROBLEM))
    results = neighbourhood(CANDIDATES, recorder, budget=120, seed=seed, first=16)
    assert best(results).config == OPTIMUM
    assert len(recorder.evaluated) <= 120
    assert len(recorder.batches[0]) == 16
    # Every later batch is made of one-parameter moves, so it is far cheaper than the whole space.
    assert len(recorder.evaluated) < len(CANDIDATES) / 2


def test_neighbourhood_deterministic(journal: Journal) -> None:
    evaluate = replay_evaluator(journal, PROBLEM)
    runs = [[m.config for m in neighbourhood(CANDIDATES, evaluate, budget=60, seed=7)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != [m.config for m in neighbourhood(CANDIDATES, evaluate, budget=60, seed=8)]


def test_neighbourhood_keeps_sampling_until_something_is_ok(journal: Journal) -> None:
    # Every candidate but one fails: random batches continue until the one OK config turns up.
    failing = [c for c in CANDIDATES if not _landscape(c).ok]
    candidates = failing + [OPTIMUM]
    recorder = Recorder(replay_evaluator(journal, PROBLEM))
    results = neighbourhood(candidates, recorder, budget=None, seed=0, first=4)
    assert best(results).config == OPTIMUM
    assert all(len(b) <= 4 for b in recorder.batches)
    assert len(set(recorder.evaluated)) == len(recorder.evaluated)


def test_neighbourhood_stops_at_local_optimum() -> None:
    # A 1-D space: after the first batch holds the best, its neighbours are everything else.
    candidates = [Config.of(x=i) for i in range(10)]
    recorder = Recorder(lambda batch: [Measurement("p", c, Status.OK, time_us=float(c["x"])) for c in batch])
    results = neighbourhood(candidates, recorder, budget=100, seed=0, first=3)
    assert len(recorder.batches) == 2 and len(results) == 10 and best(results).config == Config.of(x=0)


def test_finalists_add_the_fastest_of_each_launch_class() -> None:
    ms = [_landscape(c) for c in CANDIDATES]
    cls = lambda c: "one warp" if c["num_warps"] == 1 else "several warps"  # noqa: E731 (stands for launch count)
    plain = finalists(ms, 3)
    assert plain == sorted((m for m in ms if m.ok), key=lambda m: (m.time_us, m.config))[:3]
    assert all(m.config["num_warps"] != 1 for m in plain)  # the bowl's minimum needs 4 warps
    picked = finalists(ms, 3, cls)
    assert picked[:3] == plain and len(picked) == 4  # the top 3, then the fastest one-warp candidate
    fastest_one_warp = min((m for m in ms if m.ok and m.config["num_warps"] == 1), key=lambda m: m.time_us)
    assert picked[3] is fastest_one_warp
    assert finalists(ms, 0, cls) == []  # no finalists asked: none, whatever the classes


def _retimed(name: str, gpu_us: float, eager_us: float, graph_us: float, host_us: float | None) -> Measurement:
    extra = {} if host_us is None else {"host_us": host_us}
    return Measurement("p", Config.of(name=name), Status.OK, time_us=gpu_us, extra=extra, eager_us=eager_us,
                       graph_us=graph_us)


def test_auto_objective_ranks_host_bound_finalists_by_graph_time() -> None:
    """The twenty-third session's 1-token MXFP4 row: the 1-stage kernel's eager batches all landed high (host noise),
    so eager picked the stage pair, 5 µs slower on the GPU. Host costs of 33-40 µs against 43-49 µs of GPU time:
    host-bound, so AUTO ranks by graph time."""
    one_stage = _retimed("1stage", 43.5, 57.4, 44.0, 40.0)
    pair = _retimed("pair", 49.2, 49.2, 50.4, 33.0)
    ms = [one_stage, pair]
    assert host_bound(ms) and 33.0 >= HOST_BOUND_SHARE * 44.0
    assert resolve_objective(Objective.AUTO, ms) is Objective.GRAPH
    assert best_for(Objective.AUTO, ms) is one_stage
    assert best_for(Objective.EAGER, ms) is pair  # what the eager objective picked
    assert resolve_objective(Objective.EAGER, ms) is Objective.EAGER  # explicit objectives are kept


def test_auto_objective_keeps_eager_where_a_finalist_is_cheap_on_the_host() -> None:
    """A config with a costly host path (5 ms a call) and the least GPU time against one with almost no host cost:
    the least host cost is far under the GPU time, so the eager time decides and the costly path loses."""
    costly = _retimed("A", 10.0, 5010.0, 10.0, 5000.0)
    cheap = _retimed("B", 20.0, 21.0, 20.0, 0.5)
    assert not host_bound([costly, cheap])
    assert best_for(Objective.AUTO, [costly, cheap]) is cheap
    assert best_for(Objective.GRAPH, [costly, cheap]) is costly


def test_auto_objective_is_eager_for_gpu_bound_rows_and_unknown_host_costs() -> None:
    big = [_retimed("a", 500.0, 505.0, 498.0, 40.0), _retimed("b", 510.0, 503.0, 512.0, 42.0)]
    assert not host_bound(big) and best_for(Objective.AUTO, big) is big[1]  # eager decides: b
    old = [_retimed("a", 43.5, 57.4, 44.0, None), _retimed("b", 49.2, 49.2, 50.4, None)]  # journalled before host_us
    assert not host_bound(old) and resolve_objective(Objective.AUTO, old) is Objective.EAGER
    assert not host_bound([]) and not host_bound([Measurement("p", Config.of(name="x"), Status.OK, time_us=1.0)])
    with pytest.raises(ValueError, match="resolve AUTO"):
        big[0].objective_time(Objective.AUTO)
