"""The benchmark process: one per GPU, long-lived; runs candidates one at a time on poisoned output, checks, times
(GPU time in the first pass; eager and CUDA-graph time for a finalist).

Pipe protocol. Parent -> worker: a Task, or None to stop. Worker -> parent: ("ready",) once started,
("started", task_id) once the problem's inputs are ready, ("result", task_id, Measurement) per task.
After a sticky failure (dead CUDA context) the worker sends the result and exits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from tritune.tuning.bench import PARK_TOTALS, Timing, merged, while_gpu_busy
from tritune.tuning.errors import classify_exception, is_sticky, short_message
from tritune.tuning.processes import adopt_env
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import BenchSettings, CheckResult, Config, Measurement, Status, Task

if TYPE_CHECKING:
    from tritune.tuning.check import PreparedReference

_DEFAULT_L2_BYTES = 50 * 2**20
_STICKY_EXIT_CODE = 3
# Problems whose inputs a worker keeps besides the current one, while the GPU has room (KEPT_MEMORY_SHARE of it in
# use at most, counting a state as large as the largest built so far). On 4 GPUs the compile pool runs barely ahead, so
# a worker's problem often has nothing queued for a moment and the worker serves another, then comes back: with 2
# kept it still built inputs 2.6x as often as on 1 GPU (8.5 s against 3.3 s summed, issue 17).
KEPT_PROBLEMS = 4
KEPT_MEMORY_SHARE = 0.5


@dataclass
class _ProblemState:
    """What is made once per problem and reused by every candidate of it."""

    key: str
    inputs: Any
    ref: PreparedReference  # the reference with what depends on it alone computed once
    out: torch.Tensor


class _Runner:
    """Per-process state: the device, the current problem's buffers, and the gate and timer functions."""

    def __init__(self, tunable: Any, device: torch.device, settings: BenchSettings) -> None:
        # Imported in the worker only, so importing the executor in the parent does not pull them in.
        from tritune.tuning.check import check_output, poison, prepare_reference

        self.tunable = tunable
        self.device = device
        self.settings = settings
        self.l2_bytes = _l2_bytes(device)
        self.state: _ProblemState | None = None
        self._kept: dict[str, _ProblemState] = {}  # recent problems' states, least recently used first
        self._largest_state = 0  # bytes of the largest problem state built so far (what a new one may need)
        self.phases: dict[str, float] = {}  # the current candidate's milliseconds per phase (see `run`)
        self._mark = time.perf_counter()
        self._check_output = check_output
        self._prepare_reference = prepare_reference
        self._poison = poison

    def prepare(self, problem: Any) -> _ProblemState:
        """Inputs, reference and output buffer of `problem`, built only when the problem changes and was not among
        the last KEPT_PROBLEMS served (then kept while the GPU has room)."""
        key = problem.key()
        if self.state is not None and self.state.key == key:
            return self.state
        if self.state is not None:
            self._kept[self.state.key] = self.state
        self.state = self._kept.pop(key, None)
        while len(self._kept) > KEPT_PROBLEMS:
            self._kept.pop(next(iter(self._kept)))
        if self.state is None:
            self.state = self._build(problem, key)
        return self.state

    def _build(self, problem: Any, key: str) -> _ProblemState:
        """A new problem's state; the kept ones give way when the GPU is short of room (before, or when it runs out).
        The retry comes after the handler: inside it, the traceback would keep the failed attempt's tensors alive
        and the retry ran out of memory too (gpt-oss's MXFP4 rows on an H100: every problem switch failed)."""
        self._make_room()
        try:
            return self._build_now(problem, key)
        except torch.cuda.OutOfMemoryError:
            if not self._kept:
                raise
        self._kept.clear()
        torch.cuda.empty_cache()
        return self._build_now(problem, key)

    def _build_now(self, problem: Any, key: str) -> _ProblemState:
        before = self._allocated()
        inputs = self.tunable.make_inputs(problem, self.device, self.settings.seed)
        ref = self.tunable.reference(problem, inputs)
        out = self.tunable.alloc_output(problem, inputs)
        ref = self._prepare_reference(ref, out.dtype, self.tunable.tolerance(problem))  # once, not per check
        self._sync()
        self._largest_state = max(self._largest_state, self._allocated() - before)
        return _ProblemState(key, inputs, ref, out)

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _make_room(self) -> None:
        """Drop kept states, least recently used first, while the GPU in use plus a state as large as the largest
        built so far would be over KEPT_MEMORY_SHARE of it."""
        if self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        while self._kept and self._allocated() + self._largest_state > KEPT_MEMORY_SHARE * total:
            self._kept.pop(next(iter(self._kept)))

    def forget(self) -> None:
        """Drop the current problem's state (a failing candidate may have written into its inputs or reference), so
        the next candidate of it rebuilds them."""
        self.state = None

    def run(self, task: Task, started: Callable[[], None]) -> Measurement:
        """Measure one candidate; never raises (but Ctrl-C). Calls `started()` once inputs are ready.

        A passing measurement's extra["phase_ms"] says where the worker's time went (inputs: building the problem's
        inputs and reference, 0 when kept from the last candidate; bind: the launcher; run: the first checked run up to
        its sync, which loads the binary; rerun: the checked run after timing; check: comparing their outputs with
        the reference; time: the timer): what sets a tuning run's pace besides the GPU time itself. On 4 H200s the
        checked runs took 26-42% more seconds than on 1 GPU while the comparisons took the same (issue 17). Three
        figures inside "time" come with them: timer_parked (the sleeps the GPU timers asked for) and timer_queued
        (the host's time queueing the timed calls behind them), and preload (loading `task.likely_next`'s binary
        while the GPU ran the timed calls); extra["short_park_retimed"] counts the short parks the GPU caught up
        with (the calls left were queued again behind a longer park)."""
        problem, config = task.problem, task.config
        key = _safe_key(problem)
        self.phases = {}
        parked0, queued0, retimed0 = PARK_TOTALS["parked"], PARK_TOTALS["queued"], PARK_TOTALS["retimed"]
        self._mark = time.perf_counter()
        try:
            state = self.prepare(problem)
        except Exception as exc:
            self.forget()
            return Measurement(key, config, classify_exception(exc), message="making inputs: " + short_message(exc))
        self._phase("inputs")
        started()
        while_gpu_busy(functools.partial(self._preload, *task.likely_next) if task.likely_next else None)
        try:
            if task.finalist:
                measurement = self._measure_as_op(problem, config, state)
            else:
                measurement = self._measure(problem, config, state, task.cutoff_us)
        except Exception as exc:
            measurement = Measurement(key, config, classify_exception(exc), message=short_message(exc))
        while_gpu_busy(None)  # a preload no timing reached (a failed check, a finalist's timers) is dropped
        if not measurement.ok:
            # A failing candidate may have written out of bounds into the inputs or the reference: rebuild.
            self.forget()
            return measurement
        phases = {name: round(ms, 3) for name, ms in self.phases.items()}
        extra = {**measurement.extra, "phase_ms": phases}
        if PARK_TOTALS["parked"] > parked0:
            phases["timer_parked"] = round(1e3 * (PARK_TOTALS["parked"] - parked0), 3)
            phases["timer_queued"] = round(1e3 * (PARK_TOTALS["queued"] - queued0), 3)
        if PARK_TOTALS["retimed"] > retimed0:  # timings whose short park the GPU caught up with
            extra["short_park_retimed"] = PARK_TOTALS["retimed"] - retimed0
        return dataclasses.replace(measurement, extra=extra)

    def _preload(self, problem: Any, config: Config) -> None:
        """Load the binary of the candidate this worker will likely measure next into Triton's in-memory cache (the
        pool compiled it already, so this reads Triton's disk cache) while the GPU runs the current candidate's timed
        calls, so that candidate's first checked run launches sooner: on 1 H200 the first checked runs fell from 25.1
        to 18.8 s summed, on 4 from 41.4-45.9 to 35.8 s (issue 17). A failure is left to the candidate's own run.
        Loading the CUDA module here too (the binary's `_init_handles`) was measured on 4 H100s and left out: the
        preload grew from 7 to 26 s summed on 1 GPU, and the first checked runs did not shrink (18.2-19.2 s)."""
        t0 = time.perf_counter()
        try:
            self.tunable.compile(problem, config)
        except Exception:
            pass
        finally:  # a figure inside "time", where the timer ran it
            self.phases["preload"] = self.phases.get("preload", 0.0) + (time.perf_counter() - t0) * 1e3

    def _phase(self, name: str) -> None:
        """Add the time since the last phase ended (since `run` began, for the first) to phase `name`."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + (now - self._mark) * 1e3
        self._mark = now

    def _launch_checked(self, problem: Any, config: Config,
                        state: _ProblemState) -> tuple[Tolerance, Callable[[], None], CheckResult]:
        """(tolerance, the candidate's launcher, its first checked run): every measurement starts with these."""
        tol = self.tunable.tolerance(problem)
        fn = self.tunable.launcher(problem, state.inputs, config, state.out)
        self._phase("bind")
        first = self._checked_run(fn, state, tol)
        self._phase("check")
        return tol, fn, first

    def _measure(self, problem: Any, config: Config, state: _ProblemState,
                 cutoff_us: float = math.inf) -> Measurement:
        tol, fn, first = self._launch_checked(problem, config, state)
        if not first.passed:
            return _wrong_answer(state.key, config, first, "")
        timing, stopped = self._time_first_pass(fn, cutoff_us)
        self._phase("time")
        # Checked again after timing: a kernel that races or corrupts state only under repetition fails too.
        second = self._checked_run(fn, state, tol, "rerun")
        self._phase("check")
        if not second.passed:
            return _wrong_answer(state.key, config, second, "after timing: ")
        return Measurement(
            state.key,
            config,
            Status.OK,
            time_us=timing.median_us,
            error=max(first.mismatch_ratio, second.mismatch_ratio),
            rel_l2_err=max(first.rel_l2_err, second.rel_l2_err),
            extra={"min_us": timing.min_us, "max_us": timing.max_us, "method": timing.method,
                   **({"early_stop": timing.iters} if stopped else {})},
        )

    def _time_first_pass(self, fn: Callable[[], None], cutoff_us: float) -> tuple[Timing, bool]:
        """(GPU timing, stopped early): `early_stop_iters` calls first where the task has a cutoff, and no more when
        even the fastest of them is over it; else `iters` in all (the probe's and the rest's samples, ranked together;
        a timer that keeps no samples is ranked on the rest alone)."""
        s = self.settings
        kw = dict(flush_l2=s.flush_l2, l2_bytes=self.l2_bytes)
        probe_iters = s.early_stop_iters
        if not (math.isfinite(cutoff_us) and s.early_stop_factor > 0 and 0 < probe_iters < s.iters):
            return s.timers.gpu(fn, iters=s.iters, warmup=s.warmup, **kw), False
        probe = s.timers.gpu(fn, iters=probe_iters, warmup=s.warmup, **kw)
        if probe.min_us > cutoff_us:
            return probe, True
        return merged(probe, s.timers.gpu(fn, iters=s.iters - probe_iters, warmup=0, **kw)), False

    def _measure_as_op(self, problem: Any, config: Config, state: _ProblemState) -> Measurement:
        """A finalist: checked, timed as eager calls and as a CUDA-graph replay, checked again. time_us stays NaN
        (the parent keeps the first pass's); a graph that cannot be captured leaves graph_us NaN, with the reason
        in extra["graph_error"], and does not fail the candidate."""
        tol, fn, first = self._launch_checked(problem, config, state)
        if not first.passed:
            return _wrong_answer(state.key, config, first, "")
        s = self.settings
        eager = s.timers.eager(fn, iters=s.iters, warmup=s.warmup, flush_l2=s.flush_l2, l2_bytes=self.l2_bytes)
        graph = s.timers.graph(fn, iters=s.iters, warmup=s.warmup, flush_l2=s.flush_l2, l2_bytes=self.l2_bytes)
        self._phase("time")
        second = self._checked_run(fn, state, tol, "rerun")  # a graph replay writes `out` too: check eager again
        self._phase("check")
        if not second.passed:
            return _wrong_answer(state.key, config, second, "after timing as the op runs: ")
        extra = {"eager_method": eager.method, "graph_method": graph.method}
        if math.isfinite(getattr(eager, "host_us", math.nan)):
            extra["host_us"] = eager.host_us
        if graph.failed:
            extra["graph_error"] = graph.error
        return Measurement(state.key, config, Status.OK, time_us=math.nan,
                           error=max(first.mismatch_ratio, second.mismatch_ratio),
                           rel_l2_err=max(first.rel_l2_err, second.rel_l2_err), extra=extra,
                           eager_us=eager.median_us, graph_us=graph.median_us)

    def _checked_run(self, fn: Callable[[], None], state: _ProblemState, tol: Tolerance,
                     phase: str = "run") -> CheckResult:
        self._poison(state.out)
        fn()
        self._sync()  # so an asynchronous CUDA error is raised here and blamed on this candidate
        self._phase(phase)  # the caller's next phase, "check", is then the comparison alone
        return self._check_output(state.out, state.ref, tol)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def worker_main(env: dict[str, str], tunable_pickle: bytes, device_index: int | None, settings: BenchSettings,
                conn: Connection) -> None:
    """Process entry point: serve Tasks from `conn` on GPU `device_index`, or on the CPU when None. The parent's
    environment is adopted before the tunable is unpickled (which imports kernel modules, and Triton reads
    TRITON_INTERPRET when they load): a process forked from the fork server has the server's."""
    adopt_env(env)
    tunable = pickle.loads(tunable_pickle)
    # Ctrl-C reaches the whole process group; the parent stops the workers, they must not die mid-task.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if device_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
    else:
        device = torch.device("cpu")
    runner = _Runner(tunable, device, settings)
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if task is None:
            return
        measurement = runner.run(task, functools.partial(conn.send, ("started", task.task_id)))
        conn.send(("result", task.task_id, measurement))
        if is_sticky(measurement.status):
            # The CUDA context is dead; normal interpreter shutdown could hang in its destructors.
            conn.close()
            os._exit(_STICKY_EXIT_CODE)


def _l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return _DEFAULT_L2_BYTES


def _safe_key(problem: Any) -> str:
    try:
        return problem.key()
    except Exception:
        return repr(problem)


def _wrong_answer(key: str, config: Config, check: CheckResult, when: str) -> Measurement:
    return Measurement(key, config, Status.WRONG_ANSWER, error=check.mismatch_ratio, rel_l2_err=check.rel_l2_err,
                       message=when + check.reason)
