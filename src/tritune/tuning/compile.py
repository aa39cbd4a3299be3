"""Compiles candidates in a process pool across the CPU cores, ahead of the GPU; failures become outcomes.

A compile that kills its worker process (BrokenProcessPool) is pinned on the right candidate by re-running
the candidates it took down one at a time; only one that breaks the pool on its own is marked CRASHED.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tritune.compile_target import CompileTarget, compile_without_gpu
from tritune.knobs import interpreting
from tritune.tuning.errors import classify_exception, short_message
from tritune.tuning.processes import adopt_env, parent_env, process_context
from tritune.tuning.types import Config, Status


@dataclass(frozen=True)
class CompileOutcome:
    status: Status  # OK, COMPILE_ERROR, OUT_OF_RESOURCES, PTXAS_ERROR, CRASHED or RUNTIME_ERROR
    message: str
    seconds: float  # wall time of the compile (for CRASHED: from hand-over to the pool until the crash)


def compile_one(tunable: Any, problem: Any, config: Config) -> CompileOutcome:
    """Run `tunable.compile(problem, config)` here and classify what it raised; never raises (but Ctrl-C)."""
    start = time.perf_counter()
    try:
        tunable.compile(problem, config)
    except (Exception, SystemExit) as exc:
        return CompileOutcome(classify_exception(exc), short_message(exc), time.perf_counter() - start)
    return CompileOutcome(Status.OK, "", time.perf_counter() - start)


# Below the GPU workers and the driver: a compile waits, a timed candidate's host side does not. 19 (the lowest
# priority), not 5: at 5 a worker sharing a core with a compile still got only 3/4 of it (the kernel's weights 1024
# and 335), and on 4 GPUs beside 64 compile processes the same candidates took 12% longer (issue 17).
COMPILE_NICENESS = 19


def lower_compile_priority() -> None:
    """Run this (compile) process at COMPILE_NICENESS. With a pool as large as the machine, compiles would take CPU
    from the benchmark workers' host side (launch, check, timing loop); on 4 GPUs and 64 cores that slowed every
    candidate (issue 17). Where the OS refuses, compiles keep their priority."""
    try:
        os.nice(COMPILE_NICENESS)
    except OSError:
        pass


def _compile_process_init(target: CompileTarget | None, env: dict[str, str] | None = None) -> None:
    # The parent's environment first (a process forked from the fork server has the server's).
    adopt_env(env)
    # Ctrl-C reaches the whole process group; the parent decides what stops, workers must not die mid-task.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lower_compile_priority()
    if target is not None:
        compile_without_gpu(target)


def _on_rocm() -> bool:
    import torch

    return torch.version.hip is not None


def compile_target_of(device: Any) -> CompileTarget | None:
    """What the compile processes answer Triton with for `device` (a DeviceInfo): its arch and SM count, so they
    never open the GPU; None under the interpreter (nothing compiles)."""
    if device is None or getattr(device, "interpreter", True) or _on_rocm():
        return None  # ROCm: Triton's HIP target is not answered here; its processes ask the GPU, as before
    major, minor = device.capability
    return CompileTarget("cuda", 10 * major + minor, device.warp_size, device.sm_count)


@dataclass(eq=False)
class _Job:
    problem: Any
    config: Config
    outer: Future  # what the caller holds; stays PENDING until finished so the caller may cancel it
    strikes: int = 0  # pools this job was in flight in when they broke
    handed_at: float = field(default=0.0)


class CompilePool:
    """Compile candidates on `max_workers` spawned processes (default: every CPU core).

    Runs inline, in the calling process, when max_workers <= 1 or TRITON_INTERPRET=1 (nothing to compile).
    All pool interaction happens on one dispatcher thread; callers only enqueue and read futures.
    """

    def __init__(self, tunable: Any, max_workers: int | None = None, target: CompileTarget | None = None) -> None:
        self._tunable = tunable
        self._target = target  # None: each process compiles for the GPU it finds (and opens a context on it)
        self._max_workers = (os.cpu_count() or 1) if max_workers is None else max_workers
        self.inline = self._max_workers <= 1 or interpreting()
        self._events: queue.Queue[tuple] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pool: ProcessPoolExecutor | None = None  # touched only by the dispatcher thread
        self._closed = False
        self._lock = threading.Lock()
        self._limit = self._max_workers  # compiles allowed at once now (set_limit); the dispatcher's to read
        self.peak_in_flight = 0  # the most compiles that ran at once

    @property
    def slots(self) -> int:
        """Compiles that run at once (0 when compiling inline)."""
        return 0 if self.inline else self._max_workers

    def set_limit(self, limit: int | None) -> None:
        """Run at most `limit` compiles at once from now on (1 .. the pool's size; None: the pool's size). Compiles
        already running finish; queued ones wait. A caller that knows how far compiles are ahead of their consumers
        lowers it (every compile process at once slows the whole machine: the same binaries cost 1.7x the CPU-seconds
        with 64 processes as with 24 on a 64-core host, and the GPU workers' host work slowed with them)."""
        limit = self._max_workers if limit is None else max(1, min(int(limit), self._max_workers))
        if self.inline or limit == self._limit:
            return
        self._limit = limit
        if self._thread is not None:
            self._events.put(("limit",))  # wakes the dispatcher to start what a higher limit allows

    def submit(self, problem: Any, config: Config) -> Future[CompileOutcome]:
        """Queue one compile; the future always completes with a CompileOutcome (or is cancelled)."""
        if self._closed:
            raise RuntimeError("CompilePool is shut down")
        outer: Future[CompileOutcome] = Future()
        if self.inline:
            outer.set_result(compile_one(self._tunable, problem, config))
            return outer
        self._start_dispatcher()
        self._events.put(("job", _Job(problem, config, outer)))
        return outer

    def _start_dispatcher(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name="tritune-compile", daemon=True)
                self._thread.start()

    def prestart(self) -> None:
        """Start every compile process now (spawn, import torch and Triton: seconds on a large machine), while the
        caller builds its search spaces, instead of at the first compile. Nothing when compiling inline."""
        if self.inline or self._closed:
            return
        self._start_dispatcher()
        self._events.put(("prestart",))

    def shutdown(self, cancel: bool = False) -> None:
        """Stop accepting work. cancel=False: wait for every queued compile; True: cancel what has not finished."""
        self._closed = True
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._events.put(("stop", cancel))
            thread.join()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(cancel=exc_type is not None)

    # ---- dispatcher thread -------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        backlog: deque[_Job] = deque()
        retry: deque[_Job] = deque()  # jobs that were in flight when a pool broke, to re-run one at a time
        in_flight: dict[Future, tuple[_Job, ProcessPoolExecutor]] = {}
        try:
            self._serve(backlog, retry, in_flight)
        except BaseException as exc:  # a bug here must not leave callers waiting forever on their futures
            self._closed = True
            failed = CompileOutcome(Status.RUNTIME_ERROR, "compile dispatcher failed: " + short_message(exc), 0.0)
            jobs = [*backlog, *retry, *(job for job, _ in in_flight.values())]
            while not self._events.empty():
                event = self._events.get()
                jobs += [event[1]] if event[0] == "job" else []
            for job in jobs:
                _finish(job, failed)
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _serve(self, backlog: deque[_Job], retry: deque[_Job], in_flight: dict[Future, tuple[_Job, Any]]) -> None:
        stopping = False
        while True:
            # In flight is capped so a broken pool only takes down what it was running; while blame is being
            # assigned (retry non-empty or a struck job running) jobs run one at a time.
            isolating = bool(retry) or any(job.strikes for job, _ in in_flight.values())
            while (retry or backlog) and len(in_flight) < (1 if isolating else self._limit):
                job = retry.popleft() if retry else backlog.popleft()
                if job.outer.cancelled():
                    _cancel(job.outer)  # notify waiters: wait()/as_completed() ignore a merely CANCELLED future
                    continue
                self._ensure_pool()
                try:
                    inner = self._pool.submit(compile_one, self._tunable, job.problem, job.config)
                except BrokenProcessPool:  # broke before we saw its futures fail: retry on a fresh pool
                    self._drop_pool()
                    (retry if job.strikes else backlog).appendleft(job)
                    continue
                job.handed_at = time.perf_counter()
                in_flight[inner] = (job, self._pool)
                self.peak_in_flight = max(self.peak_in_flight, len(in_flight))
                inner.add_done_callback(lambda f: self._events.put(("done", f)))
                isolating = isolating or bool(job.strikes)

            if stopping and not (backlog or retry or in_flight):
                return
            event = self._events.get()
            if event[0] == "job":
                backlog.append(event[1])
            elif event[0] == "limit":
                continue  # the loop's head starts what the new limit allows
            elif event[0] == "prestart":
                self._ensure_pool()
                try:
                    for _ in range(self._max_workers):  # spawns every process now; untracked, a failure is harmless
                        self._pool.submit(_warm_up)
                except BrokenProcessPool:  # the next job rebuilds it
                    self._drop_pool()
            elif event[0] == "stop":
                stopping = True
                if event[1]:  # cancel
                    for job in [*backlog, *retry, *(j for j, _ in in_flight.values())]:
                        _cancel(job.outer)
                    backlog.clear()
                    retry.clear()
                    in_flight.clear()
                    self._drop_pool(cancel=True)
            elif event[1] in in_flight:
                job, owner = in_flight.pop(event[1])
                if not _broken(event[1]):
                    _finish(job, _outcome(event[1], job))
                    continue
                if owner is self._pool:
                    self._drop_pool()
                if job.strikes:  # broke the pool again while running alone: it is the culprit
                    elapsed = time.perf_counter() - job.handed_at
                    _finish(job, CompileOutcome(Status.CRASHED, "compile worker process died", elapsed))
                else:
                    job.strikes += 1
                    retry.append(job)

    def _ensure_pool(self) -> None:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self._max_workers, mp_context=process_context(),
                                             initializer=_compile_process_init,
                                             initargs=(self._target, parent_env()))

    def _drop_pool(self, cancel: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=cancel)
            self._pool = None


def _warm_up() -> None:
    """A compile process's first task: the imports every compile needs."""
    import torch  # noqa: F401
    import triton  # noqa: F401


def _broken(inner: Future) -> bool:
    return not inner.cancelled() and isinstance(inner.exception(), BrokenProcessPool)


def _outcome(inner: Future, job: _Job) -> CompileOutcome | None:
    """The outcome a finished pool future stands for; None when it was cancelled."""
    if inner.cancelled():
        return None
    exc = inner.exception()
    if exc is None:
        return inner.result()
    # compile_one never raises; this is the task failing to cross the process boundary (pickling).
    return CompileOutcome(classify_exception(exc), short_message(exc), time.perf_counter() - job.handed_at)


def _finish(job: _Job, outcome: CompileOutcome | None) -> None:
    if outcome is None:
        _cancel(job.outer)
        return
    try:
        job.outer.set_result(outcome)
    except InvalidStateError:  # the caller cancelled it meanwhile
        _cancel(job.outer)


def _cancel(outer: Future) -> None:
    """Cancel `outer` and notify its waiters (the step an executor normally does in set_running_or_notify_cancel)."""
    if outer.cancel():
        try:
            outer.set_running_or_notify_cancel()
        except RuntimeError:  # already notified
            pass
