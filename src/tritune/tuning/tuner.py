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
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tritune.device import DeviceInfo
from tritune.tuning.affinity import interleave
from tritune.tuning.compile import CompileOutcome, CompilePool, compile_target_of
from tritune.tuning.executor import LocalExecutor
from tritune.tuning.journal import Journal
from tritune.tuning.ray_cluster import RaySettings
from tritune.tuning.ray_executor import DeferredCompiles, RayExecutor
from tritune.tuning.report import ProblemResult, TuneSummary, progress_label
from tritune.tuning.strategy import STRATEGIES, best, best_for, finalists
from tritune.tuning.tunable import Tunable
from tritune.tuning.types import BenchSettings, Config, Measurement, Objective, Status, Task


@dataclass(frozen=True)
class TuneSettings:
    journal_path: Path
    bench: BenchSettings = BenchSettings()
    num_gpus: int = 1
    compile_workers: int | None = None  # None: every CPU core
    # Compiled candidates waiting for or on a GPU, per GPU worker, at which the compile pool is down to one compile at
    # a time; below it the pool runs that fraction of its processes less (_Pipeline._govern_compiles). 0: off, every
    # process compiles whenever there is work.
    compile_lead: int = 0
    strategy: str = "exhaustive"
    budget: int | None = None  # candidates per problem; None: all that survive pruning
    progress: bool = True
    finalists: int = 5  # per problem, the fastest by GPU time re-timed as the op runs; 0: GPU time picks alone
    objective: Objective = Objective.AUTO  # which op-time figure picks the winner among the finalists
    devices: tuple[int, ...] | None = None  # GPU indices the workers run on; None: 0 .. num_gpus-1
    # Wall-clock seconds one tune() call may spend measuring, counted from its first candidate's result (the start-up
    # of workers and compile pool and the first compile are not); past it nothing more is measured
    # (see _Pipeline.evaluate). None: no limit.
    time_limit_s: float | None = None
    # Benchmark on the GPUs of a Ray cluster (tuning/ray_executor.py; num_gpus and devices then unused); None: the
    # GPUs of this machine.
    ray: RaySettings | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))  # "eager" / "graph" accepted too
        if isinstance(self.finalists, bool) or not isinstance(self.finalists, int) or self.finalists < 0:
            raise ValueError(f"finalists must be an integer >= 0, got {self.finalists!r}")
        if self.time_limit_s is not None and not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0):
            raise ValueError(f"time_limit_s must be a finite number > 0, got {self.time_limit_s!r}")
        if isinstance(self.compile_lead, bool) or not isinstance(self.compile_lead, int) or self.compile_lead < 0:
            raise ValueError(f"compile_lead must be an integer >= 0, got {self.compile_lead!r}")


_LOOK_ELSEWHERE_S = 0.25  # how often a run waiting on another's claims reads the journal for their results
# Pairs a run claims ahead of what it has finished: enough to keep a compile pool of every core and the GPU workers
# busy, few enough that a second run sharing the journal finds work to take.
CLAIM_WINDOW = 64


def journal_key(device: DeviceInfo, problem: Any, tunable: Tunable) -> str:
    """Everything that changes the answer: device, compiler, problem (shape, dtypes), correctness thresholds."""
    tol = tunable.tolerance(problem)
    return (f"{device.slug}|triton={device.triton_version}|{problem.key()}"
            f"|tol={tol.atol:g},{tol.rtol:g},{tol.max_mismatch_ratio:g}")


class _Pipeline:
    """Evaluates (problem, config) pairs: journal first, then compile pool, then GPU executor."""

    def __init__(self, tunable: Tunable, device: DeviceInfo, settings: TuneSettings, journal: Journal,
                 summary: TuneSummary, executor: LocalExecutor | RayExecutor | None,
                 pool: CompilePool | DeferredCompiles, owns_pool: bool, started: float):
        self.tunable, self.device, self.settings = tunable, device, settings
        self.journal, self.summary = journal, summary
        self.started = started  # tune()'s start: what first_task_s counts from
        # A pool lent by tune()'s caller serves its next pass, processes already started; tune() shuts its own.
        self.pool, self.owns_pool = pool, owns_pool
        self.owns_executor = executor is None  # one lent by the caller outlives this pipeline
        self.executor = executor if executor is not None else make_executor(tunable, device, settings)
        self.compiled: dict[str, Future[CompileOutcome]] = {}
        self.bars: dict[str, tqdm] = {}
        self.next_id = 0  # task ids are unique over the pipeline's life, so a late result is never mistaken
        # With a time limit: when the run ends and when the current share of it ends (time.monotonic(); None until
        # the first result starts the clock), and how many problems share what is left.
        self.end: float | None = None
        self.deadline: float | None = None
        self.sharing = 1
        # task id -> (config, journal key, finalist, first-pass measurement) of candidates still in flight when
        # a share ended: their results, if they come while the run goes on, are journaled for later runs.
        self.late: dict[int, tuple[Config, str, bool, Measurement | None]] = {}
        self.best_us: dict[str, float] = {}  # journal key -> fastest first-pass median so far (early stop)

    def _note_best(self, problem_key: str, jkey: str, m: Measurement) -> None:
        """Keep first-pass `m` as its problem's fastest median if it is, and tell the executor the problem's new
        early-stop cutoff (early_stop_factor x it), which it gives every candidate of the problem it hands out."""
        if not (m.ok and math.isfinite(m.time_us) and m.time_us < self.best_us.get(jkey, math.inf)):
            return
        self.best_us[jkey] = m.time_us
        if (factor := self.settings.bench.early_stop_factor) > 0:
            self.executor.set_cutoff(problem_key, factor * m.time_us)

    def _govern_compiles(self, queued: int) -> None:
        """With `compile_lead`, run as many compiles at once as the GPUs need: the pool's size while nothing compiled
        waits for a GPU, falling in proportion to what waits, one compile at `compile_lead` a GPU worker. The same
        compile work then spreads out instead of bursting on every core (4 GPUs, 64-core host: a 24-process pool cut
        the GPU workers' summed time 341 -> 313 s but starved the GPUs; issue 17)."""
        lead = self.settings.compile_lead
        set_limit = getattr(self.pool, "set_limit", None)
        if not lead or set_limit is None:
            return
        want = lead * max(1, getattr(self.executor, "slots", 1))
        set_limit(math.ceil(self.pool.slots * (1 - queued / want)) if queued < want else 1)

    def share_time(self, problems_left: int) -> None:
        """With a time limit, give the next problem an even share of the time left (a share unused passes on)."""
        self.sharing = problems_left
        if self.end is not None:
            now = time.monotonic()
            self.deadline = now + max(0.0, self.end - now) / problems_left

    def _start_clock(self) -> None:
        """At the first result: the time limit (if any) starts now, the current problem getting its share."""
        if self.end is None and self.settings.time_limit_s is not None:
            now = time.monotonic()
            self.end = now + self.settings.time_limit_s
            self.deadline = now + self.settings.time_limit_s / self.sharing

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _unmeasured(self, jkey: str, config: Config, first: Measurement | None, finalist: bool) -> Measurement:
        """What a pair left out by the time limit gets, never journaled (a later run measures it): a finalist its
        first-pass measurement (not re-timed, so it ranks after the re-timed ones), a candidate a TIMEOUT."""
        self.summary.unmeasured += 1
        if finalist and first is not None:
            return first
        return Measurement(jkey, config, Status.TIMEOUT,
                           message=f"not measured: the run's time limit ({self.settings.time_limit_s:g}s) passed")

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        if self.owns_executor:
            self.executor.close()
            self.summary.executor_lines += getattr(self.executor, "summary_lines", list)()
        else:  # a lent executor serves the next pass: what this one left in flight is finished (and journaled) first
            while self.executor.pending():
                for m in self.executor.poll(0.05):
                    self._take_late(m)
        if self.owns_pool:
            self.pool.shutdown(cancel=True)
        else:  # a lent pool serves the next pass: only what this one queued and no longer needs is dropped
            for future in self.compiled.values():
                future.cancel()

    def _claim_window(self) -> int:
        """Pairs this run holds open at most (compiling, queued or on a GPU): twice what keeps every compile process
        and the executor busy, as a window refills only once half of it is done; CLAIM_WINDOW at least (what another
        tuner sharing the journal cannot take meanwhile). At 64 it starved 4 GPUs: a Ray run's actors idled 22% of the
        time, each wanting 18 candidates compiling ahead (issue 17)."""
        return max(CLAIM_WINDOW, 2 * (getattr(self.pool, "slots", 0) + self.executor.capacity()))

    def _compile_key(self, problem: Any, config: Config) -> str:
        key_fn = getattr(self.tunable, "compile_key", None)
        return key_fn(problem, config) if key_fn else f"{problem.key()}|{config.key()}"

    def _bar(self, problem: Any, total: int) -> tqdm | None:
        if not self.settings.progress:
            return None
        key = problem.key()
        if key not in self.bars:
            self.bars[key] = tqdm(total=total, desc=progress_label(problem), unit="cfg", leave=True,
                                  dynamic_ncols=True)
        return self.bars[key]

    def _record(self, jkey: str, m: Measurement, phase: str) -> Measurement:
        """Journal `m` under `jkey` and drop this run's claim on it (for `phase`): it is done for every tuner."""
        self._start_clock()
        m = dataclasses.replace(m, problem_key=jkey)
        self.journal.record(m)
        self.journal.release([(jkey, m.config.key())], phase)
        return m

    def _compile(self, problem: Any, config: Config, jkey: str,
                 waiting: dict[str, list[tuple[Any, Config, str]]]) -> None:
        """Queue a pair behind its binary's compile (started now unless this pipeline already has it)."""
        ckey = self._compile_key(problem, config)
        if ckey not in self.compiled:
            self.compiled[ckey] = self.pool.submit(problem, config)
            self.summary.compiled += 1
        waiting[ckey].append((problem, config, jkey))

    def _claim(self, batch: list[tuple[Any, Config, str]], results: dict[tuple[str, str], Measurement],
               per_problem: Counter, finalist: bool,
               phase: str) -> tuple[list[tuple[Any, Config, str]], dict[tuple[str, str], tuple[Any, Config, str]]]:
        """Claim `batch` in the journal: (the pairs this run measures, the pairs another run holds, by key). Pairs
        another run finished since the journal was first read go straight into `results`."""
        claims = self.journal.claim([(jkey, config.key()) for _, config, jkey in batch], phase)
        pending = {(jkey, config.key()): (problem, config, jkey) for problem, config, jkey in batch}
        self._take_shared({key: pending[key] for key in claims.done}, results, per_problem, finalist)
        mine = [pair for key, pair in pending.items() if key in claims.mine]
        return mine, {key: pair for key, pair in pending.items() if key in claims.others}

    def _collect_elsewhere(self, elsewhere: dict[tuple[str, str], tuple[Any, Config, str]],
                           results: dict[tuple[str, str], Measurement], per_problem: Counter, finalist: bool,
                           phase: str, waiting: dict[str, list[tuple[Any, Config, str]]]) -> tuple[int, int]:
        """Take what other runs have journaled since the last look; claim (and queue for compiling) what they gave
        up or left behind by dying. Returns (pairs taken from the journal, pairs claimed)."""
        claims = self.journal.claim(list(elsewhere), phase)
        self._take_shared({key: elsewhere.pop(key) for key in claims.done}, results, per_problem, finalist)
        for key in claims.mine:
            self._compile(*elsewhere.pop(key), waiting)
        return len(claims.done), len(claims.mine)

    def _take_shared(self, done: dict[tuple[str, str], tuple[Any, Config, str]],
                     results: dict[tuple[str, str], Measurement], per_problem: Counter, finalist: bool) -> None:
        """Pairs another tuner sharing the journal measured: their journaled results (one read per problem), not
        measured again here."""
        journaled = {jkey: self.journal.measurements(jkey) for jkey, _ in done}
        for key, (problem, config, jkey) in done.items():
            results[key] = journaled[jkey][config]
            if finalist:  # counted apart: the candidates line counts candidates, not candidates + finalists
                self.summary.retimed_shared += 1
            else:
                self.summary.shared += 1
            if not finalist and (bar := self._bar(problem, per_problem[problem.key()])) is not None:
                bar.update(1)

    def _take_late(self, m: Measurement) -> bool:
        """Journal `m` if it is the result of a candidate left in flight when an earlier share ended; True if so."""
        entry = self.late.pop(m.extra.get("task_id"), None)
        if entry is None:
            return False
        config, jkey, finalist, first = entry
        m = dataclasses.replace(m, config=config)
        self._record(jkey, _with_op_times(first, m) if finalist else m, "retime" if finalist else "measure")
        if finalist:
            self.summary.retimed += 1
        else:
            self.summary.measured += 1
        return True

    def evaluate(self, pairs: Sequence[tuple[Any, Config]], finalist: bool = False) -> list[Measurement]:
        """Measure every pair not already journaled; return measurements in the order of `pairs`.

        With `finalist`, a pair is re-timed as the op runs (eager and CUDA graph) unless its journal row already
        holds those times; the result is the journaled first-pass measurement with them added, or the failure.
        Once the time limit (or the current problem's share of it) has passed, nothing more is waited for: queued
        candidates are withdrawn, those in flight are left to finish (their results are journaled if they come
        while the run goes on), and every pair without a result is `_unmeasured`.
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
                self._note_best(pkey, jkey, done)
                self.summary.reused += 1
                if (bar := self._bar(problem, per_problem[pkey])) is not None:
                    bar.update(1)
            else:
                todo.append((problem, config, jkey))
        if not todo or self._out_of_time():
            for _, config, jkey in todo:
                results[(jkey, config.key())] = self._unmeasured(jkey, config, journaled[jkey].get(config), finalist)
            return [results[(jkeys[p.key()], c.key())] for p, c in pairs]

        # As many problems as there are GPU workers at a time, their candidates alternating: each worker keeps to
        # a problem of its own (tuning/affinity.py), not rebuilding inputs for every problem.
        todo = interleave(todo, lambda pair: pair[2], getattr(self.executor, "slots", 1))
        start = time.perf_counter()
        phase = "retime" if finalist else "measure"
        # Pairs are claimed in the journal a window at a time (_claim_window), so another tuner sharing it takes the
        # rest; pairs another run holds are waited for and taken from the journal, and a dead run's claims are taken
        # over.
        unclaimed: list[tuple[Any, Config, str]] = list(todo)
        elsewhere: dict[tuple[str, str], tuple[Any, Config, str]] = {}
        waiting: dict[str, list[tuple[Any, Config, str]]] = defaultdict(list)
        tasks: dict[int, tuple[Any, Config, str]] = {}
        first_task_at = last_compile_at = None
        remaining, open_mine, next_look = len(todo), 0, time.monotonic()
        while remaining and not self._out_of_time():
            self.journal.heartbeat()
            window = self._claim_window()
            if unclaimed and open_mine <= window // 2:
                batch, unclaimed = unclaimed[:window - open_mine], unclaimed[window - open_mine:]
                mine, others = self._claim(batch, results, per_problem, finalist, phase)
                remaining -= len(batch) - len(mine) - len(others)
                open_mine += len(mine)
                elsewhere.update(others)
                for pair in mine:
                    self._compile(*pair, waiting)
            if elsewhere and time.monotonic() >= next_look:
                next_look = time.monotonic() + _LOOK_ELSEWHERE_S
                taken, reclaimed = self._collect_elsewhere(elsewhere, results, per_problem, finalist, phase, waiting)
                remaining -= taken
                open_mine += reclaimed
            for ckey in [k for k in waiting if self.compiled[k].done()]:
                outcome = self.compiled[ckey].result()
                last_compile_at = time.perf_counter()
                self.summary.compile_cpu_s += outcome.seconds
                for problem, config, jkey in waiting.pop(ckey):
                    if outcome.status is Status.OK:
                        tasks[self.next_id] = (problem, config, jkey)
                        self.executor.submit(Task(self.next_id, problem, config, finalist))
                        first_task_at = first_task_at or time.perf_counter()
                        if not self.summary.first_task_s:
                            self.summary.first_task_s = first_task_at - self.started
                        self.next_id += 1
                        continue
                    m = self._record(jkey, Measurement(jkey, config, outcome.status, message=outcome.message), phase)
                    self.summary.compile_failed[outcome.status.value] += 1
                    results[(jkey, config.key())] = m
                    remaining -= 1
                    open_mine -= 1
                    if not finalist and (bar := self._bar(problem, per_problem[problem.key()])) is not None:
                        bar.update(1)
            self._govern_compiles(len(tasks))
            for m in self.executor.poll(0.02 if waiting else 0.2):
                if self._take_late(m):
                    continue
                problem, config, jkey = tasks.pop(_task_id(m, tasks))
                m = dataclasses.replace(m, config=config)
                if finalist:
                    m = _with_op_times(journaled[jkey].get(config), m)
                m = self._record(jkey, m, phase)
                results[(jkey, config.key())] = m
                if not finalist:
                    self._note_best(problem.key(), jkey, m)
                    self.summary.early_stopped += "early_stop" in m.extra
                remaining -= 1
                open_mine -= 1
                if not m.ok:  # a Ray node's compile failure arrives here too, marked stage=compile
                    compiling = m.extra.get("stage") == "compile"
                    (self.summary.compile_failed if compiling else self.summary.failed)[m.status.value] += 1
                if finalist:
                    self.summary.retimed += 1
                    continue
                self.summary.measured += 1
                if (bar := self._bar(problem, per_problem[problem.key()])) is not None:
                    bar.update(1)
                    if m.ok:
                        bar.set_postfix_str(f"{m.time_us:.1f}us", refresh=False)
        if remaining:  # the time limit passed first: what this run claimed and will not measure is given back
            for task in self.executor.cancel():
                tasks.pop(task.task_id)
            self.late.update({i: (c, j, finalist, journaled[j].get(c)) for i, (_, c, j) in tasks.items()})
            self.journal.release([(j, c.key()) for _, c, j in todo if (j, c.key()) not in results], phase)
            for _, config, jkey in todo:
                if (jkey, config.key()) not in results:
                    results[(jkey, config.key())] = self._unmeasured(jkey, config, journaled[jkey].get(config),
                                                                     finalist)
        if self.settings.compile_lead and hasattr(self.pool, "set_limit"):
            self.pool.set_limit(None)  # a lent pool serves its next pass at full size
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


def _retime_finalists(pipeline: _Pipeline, tunable: Tunable, problems: Sequence[Any], per: list[list[Measurement]],
                      n: int) -> tuple[list[list[Measurement]], list[set[Config]]]:
    """Re-time each problem's finalists (`strategy.finalists`: the top `n` by GPU time and the fastest of each
    launch class the tunable names, if it names any) as the op runs; (measurements with them replaced, the
    finalists' configs per problem)."""
    classify = getattr(tunable, "launch_class", None)
    picked = [finalists(ms, n, (lambda c, p=p: classify(p, c)) if classify else None)
              for p, ms in zip(problems, per, strict=True)]
    chosen = [{m.config for m in ms} for ms in picked]
    pairs = [(p, m.config) for p, ms in zip(problems, picked, strict=True) for m in ms]
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


def make_executor(tunable: Tunable, device: DeviceInfo, settings: TuneSettings) -> LocalExecutor | RayExecutor:
    """The executor `settings` asks for: the Ray cluster's GPUs, or one worker per local GPU."""
    if settings.ray is not None:
        return RayExecutor(tunable, settings.bench, settings.ray, device, settings.progress)
    devices = list(settings.devices) if settings.devices else None
    return LocalExecutor(tunable, max(1, settings.num_gpus), settings.bench, devices)


def make_compile_pool(tunable: Tunable, settings: TuneSettings,
                      device: DeviceInfo | None = None) -> CompilePool | DeferredCompiles:
    """The compile pool `settings` asks for: every core here, compiling for `device` without opening it, or none
    with Ray (each candidate compiles on the node whose GPU runs it)."""
    if settings.ray is not None:
        return DeferredCompiles()
    return CompilePool(tunable, settings.compile_workers, compile_target_of(device))


def tune(tunable: Tunable, problems: Sequence[Any], device: DeviceInfo, settings: TuneSettings,
         executor: LocalExecutor | RayExecutor | None = None,
         pool: CompilePool | DeferredCompiles | None = None) -> tuple[list[ProblemResult], TuneSummary]:
    """Tune every problem; returns per-problem results and the run summary.

    `executor` (from `make_executor`, same tunable and bench settings): one the caller keeps across several passes,
    so the GPU workers start once; the caller closes it and reports its `summary_lines()`. Default: one of this run.
    `pool` (from `make_compile_pool`) likewise keeps the compile processes across passes (spawning a pool of every
    core, each importing torch and Triton, held up a later pass's first compile by seconds); the caller shuts it down.

    The first pass measures GPU time (every candidate, or what the strategy and budget pick); then the
    `settings.finalists` fastest per problem are re-timed as the op runs and `settings.objective` picks the
    winner among them (least eager_us, or least graph_us; one whose graph could not be captured ranks last). When
    every finalist failed its re-time, the fastest remaining candidate by GPU time wins, not re-timed.
    With `settings.time_limit_s`, the clock starts at the first candidate's result; problems searched one after
    another (any strategy but an unbudgeted exhaustive run, which is one batch) each get an even share of the time
    left; what is not measured when it runs out ranks as a TIMEOUT (a finalist not re-timed by then keeps its GPU
    time) and is not journaled.
    """
    t0 = time.perf_counter()
    summary = TuneSummary(problems=len(problems))
    if settings.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {settings.strategy!r}; expected one of {sorted(STRATEGIES)}")
    owns_pool = pool is None
    pool = make_compile_pool(tunable, settings, device) if owns_pool else pool
    pool.prestart()  # its processes start while the spaces are built
    results: list[ProblemResult] = []
    with ExitStack() as cleanup:
        if owns_pool:  # also when building the spaces or opening the journal fails (shutting down twice is harmless)
            cleanup.callback(pool.shutdown, cancel=True)
        spaces = []
        for problem in problems:
            space = tunable.space(problem, device)
            pruned = space.prune()
            summary.space_size += space.size
            summary.pruned.update(pruned.pruned)
            summary.candidates += len(pruned.kept)
            spaces.append((problem, space.size, pruned))
        journal = cleanup.enter_context(Journal(settings.journal_path))
        pipeline = _Pipeline(tunable, device, settings, journal, summary, executor, pool, owns_pool, started=t0)
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
                for i, (problem, _, pr) in enumerate(spaces):
                    def evaluate(batch, problem=problem):
                        return pipeline.evaluate([(problem, c) for c in batch])

                    pipeline.share_time(len(spaces) - i)  # one problem after another: each an even share of the time
                    per.append(strategy(pr.kept, evaluate, budget=settings.budget, seed=settings.bench.seed))
                pipeline.share_time(1)
            gpu_bests = [best(ms) for ms in per]
            finalists_of: list[set[Config]] = [set() for _ in per]
            if settings.finalists > 0:
                per, finalists_of = _retime_finalists(pipeline, tunable, [p for p, _, _ in spaces], per,
                                                      settings.finalists)
        finally:
            pipeline.close()
    for (problem, size, pruned), ms, gpu_best, configs in zip(spaces, per, gpu_bests, finalists_of, strict=True):
        winner = best_for(settings.objective, [m for m in ms if m.config in configs]) or best(ms)
        results.append(ProblemResult(problem, winner, ms, size, pruned.pruned, gpu_best))
    summary.wall_s = time.perf_counter() - t0
    return results, summary
