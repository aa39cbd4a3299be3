"""Values the engine passes around: a config, the closed set of outcomes, the ranking objective, one measured
candidate.

Configs are hashable values so a winner is `min(times, key=times.get)` and a journal row can be found
again by key; failures are data (a kind plus a message) and rank as infinitely slow. `Config` itself is defined in
the leaf `tritune.params` (the stores hold configs too and sit below the engine) and named here for the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tritune.params import Config, Scalar

if TYPE_CHECKING:
    from tritune.tuning.bench import Timers

__all__ = ["BenchSettings", "CheckResult", "Config", "Measurement", "Objective", "Scalar", "Status", "Task"]


class Status(enum.StrEnum):
    """Closed set of outcomes for one candidate. Everything but OK ranks as infinitely slow."""

    OK = "ok"
    PRUNED = "pruned"
    COMPILE_ERROR = "compile_error"
    OUT_OF_RESOURCES = "out_of_resources"
    PTXAS_ERROR = "ptxas_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    RUNTIME_ERROR = "runtime_error"
    WRONG_ANSWER = "wrong_answer"

    @property
    def failed(self) -> bool:
        return self is not Status.OK


class Objective(enum.StrEnum):
    """What ranks the finalists (the first pass always ranks by GPU time): the per-call time of back-to-back eager
    calls, host cost included (what a user's eager loop sees), the GPU time of a CUDA-graph replay, or AUTO: per
    problem, the graph time where the problem is host-bound, else the eager time (`strategy.resolve_objective`)."""

    EAGER = "eager"
    GRAPH = "graph"
    AUTO = "auto"


@dataclass(frozen=True)
class CheckResult:
    """What the correctness gate found: the verdict and the numbers behind it."""

    passed: bool
    mismatch_ratio: float  # fraction of elements outside atol/rtol
    max_abs_err: float
    rel_l2_err: float  # ||out - ref|| / ||ref||
    unwritten: int  # elements still holding the poison value
    nonfinite: int  # NaN/Inf elements not present in the reference
    reason: str = ""


@dataclass(frozen=True)
class Measurement:
    """One candidate of one problem, as the journal stores it."""

    problem_key: str
    config: Config
    status: Status
    time_us: float = math.inf
    error: float = math.nan  # mismatch ratio from the gate, NaN when not checked
    rel_l2_err: float = math.nan
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # Finalists only (NaN until re-timed as the op runs): eager calls back to back, and a CUDA-graph replay.
    eager_us: float = math.nan
    graph_us: float = math.nan

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def rank_time(self) -> float:
        return self.time_us if self.ok else math.inf

    @property
    def retimed(self) -> bool:
        """Whether the finalist pass has timed this candidate as the op runs (eager is always measured there)."""
        return not math.isnan(self.eager_us)

    @property
    def host_us(self) -> float:
        """The host cost per call the eager re-time measured (NaN when not re-timed, or journalled before it was
        kept)."""
        return float(self.extra.get("host_us", math.nan))

    def objective_time(self, objective: Objective) -> float:
        """eager_us or graph_us; inf when failed or not measured that way (a graph that could not be captured).
        AUTO is decided per problem (`strategy.resolve_objective`), not per measurement."""
        if objective is Objective.AUTO:
            raise ValueError("objective_time: resolve AUTO for the problem first (strategy.resolve_objective)")
        t = self.eager_us if objective is Objective.EAGER else self.graph_us
        return t if self.ok and math.isfinite(t) else math.inf


def _default_timers() -> Timers:
    # Imported on first use: bench imports torch, and this module stays light (the stores import Config).
    from tritune.tuning.bench import Timers

    return Timers()


@dataclass(frozen=True)
class BenchSettings:
    """How a benchmark worker measures: iterations, warm-up, per-candidate timeout, input seed, L2 flush, timers."""

    iters: int = 50
    warmup: int = 5
    timeout_s: float = 60.0  # per candidate, counted from the moment the worker has the problem's inputs
    seed: int = 0  # for make_inputs
    flush_l2: bool = True
    # Early stop of the first pass: a candidate is timed `early_stop_iters` calls first, and stops there when even
    # its fastest call is over `early_stop_factor` x the fastest median of its problem so far (Task.cutoff_us); the
    # others are timed `iters` calls in all, ranked on all of them. 0 turns it off. Two thirds of a MoE row's stage
    # candidates are over 1.5x its best, so their timing shrinks to a third (tuning/worker.py, tuning/tuner.py).
    early_stop_factor: float = 1.5
    early_stop_iters: int = 10
    # GPU time (first pass), eager and CUDA-graph time (finalists); tests swap in scripted ones.
    timers: Timers = field(default_factory=_default_timers)


@dataclass(frozen=True)
class Task:
    """One candidate handed to a benchmark worker (executor -> worker)."""

    task_id: int  # unique per executor; comes back as Measurement.extra["task_id"]
    problem: Any
    config: Config
    finalist: bool = False  # re-time as the op runs (eager and graph) instead of the first pass's GPU time
    cutoff_us: float = math.inf  # first pass: stop timing early above this (BenchSettings.early_stop_factor)
    # (problem, config) the executor expects to hand the same worker next: its binary is loaded while the GPU times
    # this one (TRITUNE_WORKER_PRELOAD). A hint only: another worker may take it, and nothing is measured from it.
    likely_next: tuple[Any, Config] | None = None

    def tightened(self, cutoffs: dict[str, float]) -> Task:
        """This task with its problem's current cutoff where that is lower (executors apply it when they hand the
        task to a worker, so it is the cutoff of the problem's best at that moment); finalists never stop."""
        cutoff = cutoffs.get(self.problem.key(), math.inf)
        if self.finalist or not cutoff < self.cutoff_us:
            return self
        return dataclasses.replace(self, cutoff_us=cutoff)
