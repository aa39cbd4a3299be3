"""Search strategies: plain functions over `evaluate(batch)` and a budget, plus a journal replay evaluator.

A strategy never measures anything itself, so every strategy is tested by replaying a recorded journal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from tritune.tuning.journal import Journal
from tritune.tuning.types import Config, Measurement, Objective, Status

Evaluate = Callable[[Sequence[Config]], list[Measurement]]


class Strategy(Protocol):
    """The calling convention every entry of STRATEGIES accepts."""

    def __call__(
        self, candidates: Sequence[Config], evaluate: Evaluate, budget: int | None = None, seed: int = 0
    ) -> list[Measurement]: ...


def best(measurements: Iterable[Measurement]) -> Measurement | None:
    """The OK measurement with the lowest finite time; ties go to the smaller Config; None if none is OK."""
    ok = [m for m in measurements if m.ok and math.isfinite(m.time_us)]
    return min(ok, key=lambda m: (m.time_us, m.config)) if ok else None


def top(measurements: Iterable[Measurement], n: int) -> list[Measurement]:
    """The `n` OK measurements with the lowest finite time, fastest first (ties: smaller Config); best() is top[0]."""
    ok = [m for m in measurements if m.ok and math.isfinite(m.time_us)]
    return sorted(ok, key=lambda m: (m.time_us, m.config))[:max(n, 0)]


def finalists(measurements: Iterable[Measurement], n: int,
              launch_class: Callable[[Config], str] | None = None) -> list[Measurement]:
    """The candidates re-timed as the op runs: the `n` fastest by GPU time, plus the fastest of every launch class
    (`launch_class(config)`: candidates of one class pay the same host cost, e.g. one launch vs split-K's two), so
    a config whose lower host cost wins as the user calls it is never ranked out by GPU time alone."""
    ms = list(measurements)
    chosen = top(ms, n)
    if launch_class is None or n < 1:
        return chosen
    seen = {launch_class(m.config) for m in chosen}
    for m in top(ms, len(ms)):
        cls = launch_class(m.config)
        if cls not in seen:
            seen.add(cls)
            chosen.append(m)
    return chosen


# AUTO ranks a problem's finalists by graph time when the least host cost among them is at least this share of the
# least GPU time: there the eager figure, max(host cost, GPU time), moves with the host more than with the kernels.
# One process's host cost per call moved between 33-48 µs and 60-66 µs batch to batch whatever the kernels (H100
# host, MXFP4 decode at 1 token, GPU time 43-49 µs), and the eager objective picked a kernel 5 µs slower on GPU time
# on that noise (RESULTS.md, twenty-third session). Serving stacks replay decode-size steps as CUDA graphs, where only
# GPU time counts. Where one finalist is cheap on the host and another is not, the least host cost is small and the
# eager time still decides, so a config with a costly host path (more launches) is not picked by GPU time alone.
HOST_BOUND_SHARE = 0.5


def host_bound(measurements: Iterable[Measurement]) -> bool:
    """Whether the re-timed finalists among `measurements` are host-bound: the least host cost among them is at least
    HOST_BOUND_SHARE of the least GPU time (graph time where captured, else the first pass's). False when any host
    cost or time is unknown (journal rows from before host costs were kept): the eager objective then decides."""
    timed = [m for m in measurements if m.ok and m.retimed]
    if not timed or any(not math.isfinite(m.host_us) for m in timed):
        return False
    gpu = [m.graph_us if math.isfinite(m.graph_us) else m.time_us for m in timed]
    gpu = [t for t in gpu if math.isfinite(t)]
    return bool(gpu) and min(m.host_us for m in timed) >= HOST_BOUND_SHARE * min(gpu)


def resolve_objective(objective: Objective, measurements: Iterable[Measurement]) -> Objective:
    """`objective` itself, or for AUTO: GRAPH where the problem's finalists are `host_bound`, else EAGER."""
    if objective is not Objective.AUTO:
        return objective
    return Objective.GRAPH if host_bound(measurements) else Objective.EAGER


def best_for(objective: Objective, measurements: Iterable[Measurement]) -> Measurement | None:
    """The OK measurement with the least time as `objective` measures it (Measurement.objective_time; AUTO resolved
    over these measurements first); those not measured that way (not re-timed, or a graph that could not be captured)
    come after every measured one, by GPU time; ties go to the lower GPU time, then the smaller Config. None if none
    is OK."""
    ok = [m for m in measurements if m.ok and math.isfinite(m.time_us)]
    objective = resolve_objective(objective, ok)
    return min(ok, key=lambda m: (m.objective_time(objective), m.time_us, m.config)) if ok else None


def _unique(candidates: Sequence[Config]) -> list[Config]:
    return list(dict.fromkeys(candidates))


def _limit(budget: int | None, available: int) -> int:
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return available if budget is None else min(budget, available)


def exhaustive(
    candidates: Sequence[Config], evaluate: Evaluate, budget: int | None = None, seed: int = 0
) -> list[Measurement]:
    """Evaluate every candidate (or the first `budget`) in one batch, in candidate order.

    `seed` is unused; it is accepted so all strategies share one calling convention.
    """
    batch = _unique(candidates)
    batch = batch[: _limit(budget, len(batch))]
    return evaluate(batch) if batch else []


def random_sample(
    candidates: Sequence[Config], evaluate: Evaluate, budget: int | None = None, seed: int = 0
) -> list[Measurement]:
    """Evaluate a seeded random subset of `budget` candidates (all of them, shuffled, if None) in one batch."""
    pool = _unique(candidates)
    batch = random.Random(seed).sample(pool, _limit(budget, len(pool)))
    return evaluate(batch) if batch else []


def _neighbours(a: Config, b: Config) -> bool:
    """True when a and b name the same parameters and differ in exactly one value."""
    da, db = a.as_dict(), b.as_dict()
    return da.keys() == db.keys() and sum(da[k] != db[k] for k in da) == 1


def neighbourhood(
    candidates: Sequence[Config], evaluate: Evaluate, budget: int | None = None, seed: int = 0, first: int = 32
) -> list[Measurement]:
    """Seeded random batch of `first`, then greedy one-parameter moves from the best OK config so far.

    Each round evaluates, as one batch in candidate order, every untried candidate differing from the
    current best in exactly one parameter (any value of it, not only adjacent ones), cut to the budget
    left. While no candidate is OK yet, the round is another random batch of `first` instead. Stops when
    the budget is spent or the best has no untried neighbour (a local optimum), so it may use less than
    the budget. Returns every measurement in evaluation order.
    """
    if first < 1:
        raise ValueError(f"first must be >= 1, got {first}")
    pool = _unique(candidates)
    limit = _limit(budget, len(pool))
    rng = random.Random(seed)
    tried: set[Config] = set()
    results: list[Measurement] = []

    def run(batch: list[Config]) -> None:
        tried.update(batch)
        results.extend(evaluate(batch))

    while len(tried) < limit:
        left = limit - len(tried)
        current = best(results)
        if current is None:
            untried = [c for c in pool if c not in tried]
            run(rng.sample(untried, min(first, left)))
            continue
        batch = [c for c in pool if c not in tried and _neighbours(c, current.config)]
        if not batch:
            break
        run(batch[:left])
    return results


def replay_evaluator(journal: Journal, problem_key: str) -> Evaluate:
    """An Evaluate answering from the measurements `journal` holds for `problem_key` (read once, now).

    Needs no GPU: this is how strategies are tested and compared. A config the journal does not hold comes
    back as Measurement(problem_key, config, Status.CRASHED, message="not in journal"), so it ranks as
    infinitely slow instead of stopping the search.
    """
    recorded = journal.measurements(problem_key)

    def evaluate(batch: Sequence[Config]) -> list[Measurement]:
        return [recorded.get(c) or Measurement(problem_key, c, Status.CRASHED, message="not in journal") for c in batch]

    return evaluate


STRATEGIES: dict[str, Strategy] = {
    "exhaustive": exhaustive,
    "random": random_sample,
    "neighbourhood": neighbourhood,
}
