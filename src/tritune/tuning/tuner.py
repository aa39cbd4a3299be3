"""The tuning run: problems → prune → compile ahead (CPU pool) → benchmark behind (GPU workers) → journal →
finalists re-timed as the op runs → best.

Compilation and benchmarking overlap: a candidate goes to a GPU worker the moment its binary is ready, so the GPU
never waits on a compile it does not need. The first pass ranks every candidate by GPU time; the top few per
problem are then timed as the user's op runs (eager calls, host included, and a CUDA-graph replay) and the
objective picks among them. Everything measured is in the journal before it is used, so a rerun of the same
command resumes where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritune.tuning.compile import CompileOutcome, CompilePool
from tritune.tuning.device import DeviceInfo
from tritune.tuning.executor import BenchSettings, LocalExecutor, Task
from tritune.tuning.journal import Journal
from tritune.tuning.strategy import STRATEGIES, best, best_for, top
from tritune.tuning.tunable import Tunable
from tritune.tuning.types import Config, Measurement, Objective, Status


@dataclass(frozen=True)
class TuneSettings:
    journal_path: Path
    bench: BenchSettings = BenchSettings()
    num_gpus: int = 1
    compile_workers: int | None = None  # None: every CPU core
    strategy: str = "exhaustive"
    budget: int | None = None  # candidates per problem; None: all that survive pruning
    progress: bool = True
    finalists: int = 5  # per problem, the fastest by GPU time re-timed as the op runs; 0: GPU time picks alone
    objective: Objective = Objective.EAGER  # which op-time figure picks the winner among the finalists

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))  # "eager" / "graph" accepted too
        if isinstance(self.finalists, bool) or not isinstance(self.finalists, int) or self.finalists < 0:
            raise ValueError(f"finalists must be an integer >= 0, got {self.finalists!r}")


@dataclass
class ProblemResult:
    problem: Any
    best: Measurement | None  # the objective's pick among the finalists (GPU time's pick without finalists)
    measurements: list[Measurement]  # finalists carry eager_us and graph_us
    space_size: int
    pruned: dict[str, int]
    gpu_best: Measurement | None = None  # the first pass's winner: least GPU time


@dataclass
class TuneSummary:
    problems: int = 0
    space_size: int = 0
    pruned: Counter = field(default_factory=Counter)  # rule -> configs removed
    candidates: int = 0
    reused: int = 0  # found in the journal, not measured again
    compiled: int = 0  # distinct binaries built in this run
    compile_failed: Counter = field(default_factory=Counter)  # status -> count
    measured: int = 0
    failed: Counter = field(default_factory=Counter)  # status -> count (benchmark side, finalists included)
    retimed: int = 0  # finalists timed as the op runs in this run
    retimed_reused: int = 0  # finalists whose op times the journal already held
    compile_wall_s: float = 0.0
    compile_cpu_s: float = 0.0  # summed per-binary compile times: what one process would have spent
    bench_wall_s: float = 0.0
    wall_s: float = 0.0

    @property
    def compile_speedup(self) -> float:
        """How much faster the pool compiled than one process would have."""
        return self.compile_cpu_s / self.compile_wall_s if self.compile_wall_s > 0 else float("nan")

    def lines(self) -> list[str]:
        def kinds(c: Counter) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "none"

        return [
            f"problems: {self.problems}",
            f"candidates: {self.space_size} in the spaces, {sum(self.pruned.values())} pruned, "
            f"{self.candidates} kept, {self.reused} reused from the journal",
            f"pruned by rule: {kinds(self.pruned)}",
            f"compiled: {self.compiled} binaries ({self.compile_cpu_s:.1f} CPU-s, pool speed-up "
            f"{f'{self.compile_speedup:.1f}x' if self.compile_cpu_s >= 1.0 else 'n/a'}); "
            f"compile failures: {kinds(self.compile_failed)}",
            f"measured: {self.measured}; failed on the GPU: {kinds(self.failed)}",
            f"finalists timed as the op runs: {self.retimed} ({self.retimed_reused} reused from the journal)",
            f"wall: {self.wall_s:.1f}s (compiling {self.compile_wall_s:.1f}s, benchmarking {self.bench_wall_s:.1f}s, "
            f"overlapped)",
        ]


def journal_key(device: DeviceInfo, problem: Any, tunable: Tunable) -> str:
    """Everything that changes the answer: device, compiler, problem (shape, dtypes), correctness thresholds."""
    tol = tunable.tolerance(problem)
    return (f"{device.slug}|triton={device.triton_version}|{problem.key()}"
            f"|tol={tol.atol:g},{tol.rtol:g},{tol.max_mismatch_ratio:g}")


class _Pipeline:
    """Evaluates (problem, config) pairs: journal first, then compile pool, then GPU executor."""

    def __init__(self, tunable: Tunable, device: DeviceInfo, settings: TuneSettings, journal: Journal,
                 summary: TuneSummary):
        self.tunable, self.device, self.settings = tunable, device, settings
        self.journal, self.summary = journal, summary
        self.pool = CompilePool(tunable, settings.compile_workers)
        self.executor = LocalExecutor(tunable, max(1, settings.num_gpus), settings.bench)
        self.compiled: dict[str, Future[CompileOutcome]] = {}
        self.bars: dict[str, tqdm] = {}

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.executor.close()
        self.pool.shutdown(cancel=True)

    def _compile_key(self, problem: Any, config: Config) -> str:
        key_fn = getattr(self.tunable, "compile_key", None)
        return key_fn(problem, config) if key_fn else f"{problem.key()}|{config.key()}"

    def _bar(self, problem: Any, total: int) -> tqdm | None:
        if not self.settings.progress:
            return None
        key = problem.key()
        if key not in self.bars:
            self.bars[key] = tqdm(total=total, desc=key, unit="cfg", leave=True, dynamic_ncols=True)
        return self.bars[key]

    def _record(self, jkey: str, m: Measurement) -> Measurement:
        m = dataclasses.replace(m, problem_key=jkey)
        self.journal.record(m)
        return m

    def evaluate(self, pairs: Sequence[tuple[Any, Config]], finalist: bool = False) -> list[Measurement]:
        """Measure every pair not already journaled; return measurements in the order of `pairs`.

        With `finalist`, a pair is re-timed as the op runs (eager and CUDA graph) unless its journal row already
        holds those times; the result is the journaled first-pass measurement with them added, or the failure.
        """
        results: dict[tuple[str, str], Measurement] = {}
        todo: list[tuple[Any, Config, str]] = []
        per_problem: Counter = Counter(p.key() for p, _ in pairs)
        jkeys: dict[str, str] = {}  # problem key -> journal key
        journaled: dict[str, dict[Config, Measurement]] = {}  # journal key -> what the journal holds (one query)
        for problem, config in pairs:
            pkey = problem.key()
            if pkey not in jkeys:
                jkeys[pkey] = journal_key(self.device, problem, self.tunable)
                journaled[jkeys[pkey]] = self.journal.measurements(jkeys[pkey])
            jkey = jkeys[pkey]
            done = journaled[jkey].get(config)
            if done is not None and finalist and (done.retimed or not done.ok):
                results[(jkey, config.key())] = done
                self.summary.retimed_reused += 1
            elif done is not None and not finalist:
                results[(jkey, config.key())] = done
                self.summary.reused += 1
                if (bar := self._bar(problem, per_problem[pkey])) is not None:
                    bar.update(1)
            else:
                todo.append((problem, config, jkey))
        if not todo:
            return [results[(jkeys[p.key()], c.key())] for p, c in pairs]

        start = time.perf_counter()
        waiting: dict[str, list[tuple[Any, Config, str]]] = defaultdict(list)
        for problem, config, jkey in todo:
            ckey = self._compile_key(problem, config)
            if ckey not in self.compiled:
                self.compiled[ckey] = self.pool.submit(problem, config)
                self.summary.compiled += 1
            waiting[ckey].append((problem, config, jkey))
        tasks: dict[int, tuple[Any, Config, str]] = {}
        next_id = 0
        first_task_at = last_compile_at = None
        remaining = len(todo)
        while remaining:
            for ckey in [k for k in waiting if self.compiled[k].done()]:
                outcome = self.compiled[ckey].result()
                last_compile_at = time.perf_counter()
                self.summary.compile_cpu_s += outcome.seconds
                for problem, config, jkey in waiting.pop(ckey):
                    if outcome.status is Status.OK:
                        tasks[next_id] = (problem, config, jkey)
                        self.executor.submit(Task(next_id, problem, config, finalist))
                        first_task_at = first_task_at or time.perf_counter()
                        next_id += 1
                        continue
                    m = self._record(jkey, Measurement(jkey, config, outcome.status, message=outcome.message))
                    self.summary.compile_failed[outcome.status.value] += 1
                    results[(jkey, config.key())] = m
                    remaining -= 1
                    if not finalist and (bar := self._bar(problem, per_problem[problem.key()])) is not None:
                        bar.update(1)
            for m in self.executor.poll(0.02 if waiting else 0.2):
                problem, config, jkey = tasks.pop(_task_id(m, tasks))
                m = dataclasses.replace(m, config=config)
                if finalist:
                    m = _with_op_times(journaled[jkey].get(config), m)
                m = self._record(jkey, m)
                results[(jkey, config.key())] = m
                remaining -= 1
                if not m.ok:
                    self.summary.failed[m.status.value] += 1
                if finalist:
                    self.summary.retimed += 1
                    continue
                self.summary.measured += 1
                if (bar := self._bar(problem, per_problem[problem.key()])) is not None:
                    bar.update(1)
                    if m.ok:
                        bar.set_postfix_str(f"{m.time_us:.1f}us", refresh=False)
        end = time.perf_counter()
        self.summary.compile_wall_s += ((last_compile_at or start) - start)
        self.summary.bench_wall_s += (end - (first_task_at or end))
        return [results[(jkeys[p.key()], c.key())] for p, c in pairs]


def _with_op_times(first: Measurement | None, m: Measurement) -> Measurement:
    """A finalist's first-pass measurement with the op times the re-time found; the re-time's failure instead when
    it failed (a candidate that breaks on its second visit is not trusted to win)."""
    if first is None:
        return m
    if not m.ok:
        return dataclasses.replace(m, message="timed as the op runs: " + m.message)
    return dataclasses.replace(first, eager_us=m.eager_us, graph_us=m.graph_us, extra={**first.extra, **m.extra})


def _retime_finalists(pipeline: _Pipeline, problems: Sequence[Any], per: list[list[Measurement]],
                      n: int) -> tuple[list[list[Measurement]], list[set[Config]]]:
    """Re-time the top `n` by GPU time of each problem as the op runs; (measurements with them replaced, the
    finalists' configs per problem)."""
    chosen = [{m.config for m in top(ms, n)} for ms in per]
    pairs = [(p, m.config) for p, ms in zip(problems, per, strict=True) for m in top(ms, n)]
    if not pairs:
        return per, chosen
    retimed = {(p.key(), c): m for (p, c), m in zip(pairs, pipeline.evaluate(pairs, finalist=True), strict=True)}
    per = [[retimed.get((p.key(), m.config), m) for m in ms] for p, ms in zip(problems, per, strict=True)]
    return per, chosen


def _task_id(m: Measurement, tasks: dict[int, tuple[Any, Config, str]]) -> int:
    task_id = m.extra.get("task_id")
    if task_id is None or task_id not in tasks:
        raise RuntimeError(f"executor returned a measurement with unknown task id {task_id!r}")
    return task_id


def tune(tunable: Tunable, problems: Sequence[Any], device: DeviceInfo,
         settings: TuneSettings) -> tuple[list[ProblemResult], TuneSummary]:
    """Tune every problem; returns per-problem results and the run summary.

    The first pass measures GPU time (every candidate, or what the strategy and budget pick); then the
    `settings.finalists` fastest per problem are re-timed as the op runs and `settings.objective` picks the
    winner among them (least eager_us, or least graph_us; one whose graph could not be captured ranks last). When
    every finalist failed its re-time, the fastest remaining candidate by GPU time wins, not re-timed.
    """
    t0 = time.perf_counter()
    summary = TuneSummary(problems=len(problems))
    if settings.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {settings.strategy!r}; expected one of {sorted(STRATEGIES)}")
    spaces = []
    for problem in problems:
        space = tunable.space(problem, device)
        pruned = space.prune()
        summary.space_size += space.size
        summary.pruned.update(pruned.pruned)
        summary.candidates += len(pruned.kept)
        spaces.append((problem, space.size, pruned))
    results: list[ProblemResult] = []
    with Journal(settings.journal_path) as journal:
        pipeline = _Pipeline(tunable, device, settings, journal, summary)
        try:
            if settings.strategy == "exhaustive" and settings.budget is None:
                # One batch across all problems: compiles are shared and GPU workers never idle between problems.
                pairs = [(p, c) for p, _, pr in spaces for c in pr.kept]
                all_ms = pipeline.evaluate(pairs)
                by_problem: dict[str, list[Measurement]] = defaultdict(list)
                for (p, _), m in zip(pairs, all_ms, strict=True):
                    by_problem[p.key()].append(m)
                per = [by_problem[p.key()] for p, _, _ in spaces]
            else:
                strategy = STRATEGIES[settings.strategy]
                per = []
                for problem, _, pr in spaces:
                    def evaluate(batch, problem=problem):
                        return pipeline.evaluate([(problem, c) for c in batch])

                    per.append(strategy(pr.kept, evaluate, budget=settings.budget, seed=settings.bench.seed))
            gpu_bests = [best(ms) for ms in per]
            finalists: list[set[Config]] = [set() for _ in per]
            if settings.finalists > 0:
                per, finalists = _retime_finalists(pipeline, [p for p, _, _ in spaces], per, settings.finalists)
        finally:
            pipeline.close()
    for (problem, size, pruned), ms, gpu_best, configs in zip(spaces, per, gpu_bests, finalists, strict=True):
        winner = best_for(settings.objective, [m for m in ms if m.config in configs]) or best(ms)
        results.append(ProblemResult(problem, winner, ms, size, pruned.pruned, gpu_best))
    summary.wall_s = time.perf_counter() - t0
    return results, summary
