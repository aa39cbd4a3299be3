"""Compiles candidates in a process pool across the CPU cores, ahead of the GPU; failures become outcomes.

A compile that kills its worker process (BrokenProcessPool) is pinned on the right candidate by re-running
the candidates it took down one at a time; only one that breaks the pool on its own is marked CRASHED.
"""

from __future__ import annotations

import multiprocessing
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

from tritune.tuning.errors import classify_exception, short_message
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


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET, Triton's own variable)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; the parent decides what stops, workers must not die mid-task.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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

    def __init__(self, tunable: Any, max_workers: int | None = None) -> None:
        self._tunable = tunable
        self._max_workers = (os.cpu_count() or 1) if max_workers is None else max_workers
        self.inline = self._max_workers <= 1 or interpreting()
        self._events: queue.Queue[tuple] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, problem: Any, config: Config) -> Future[CompileOutcome]:
        """Queue one compile; the future always completes with a CompileOutcome (or is cancelled)."""
        if self._closed:
            raise RuntimeError("CompilePool is shut down")
        outer: Future[CompileOutcome] = Future()
        if self.inline:
            outer.set_result(compile_one(self._tunable, problem, config))
            return outer
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name="tritune-compile", daemon=True)
                self._thread.start()
        self._events.put(("job", _Job(problem, config, outer)))
        return outer

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
        pool: ProcessPoolExecutor | None = None
        stopping = False
        while True:
            # In flight is capped so a broken pool only takes down what it was running; while blame is being
            # assigned (retry non-empty or a struck job running) jobs run one at a time.
            isolating = bool(retry) or any(job.strikes for job, _ in in_flight.values())
            cap = 1 if isolating else self._max_workers
            while (retry or backlog) and len(in_flight) < cap:
                job = retry.popleft() if retry else backlog.popleft()
                if job.outer.cancelled():
                    _cancel(job.outer)  # notify waiters: wait()/as_completed() ignore a merely CANCELLED future
                    continue
                if pool is None:
                    pool = ProcessPoolExecutor(
                        self._max_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint
                    )
                try:
                    inner = pool.submit(compile_one, self._tunable, job.problem, job.config)
                except BrokenProcessPool:  # broke before we saw its futures fail: retry on a fresh pool
                    pool.shutdown(wait=False)
                    pool = None
                    (retry if job.strikes else backlog).appendleft(job)
                    continue
                job.handed_at = time.perf_counter()
                in_flight[inner] = (job, pool)
                inner.add_done_callback(lambda f: self._events.put(("done", f)))
                isolating = isolating or bool(job.strikes)
                cap = 1 if isolating else self._max_workers

            if stopping and not (backlog or retry or in_flight):
                break
            event = self._events.get()
            if event[0] == "job":
                backlog.append(event[1])
            elif event[0] == "stop":
                stopping = True
                if event[1]:  # cancel
                    for job in [*backlog, *retry, *(j for j, _ in in_flight.values())]:
                        _cancel(job.outer)
                    backlog.clear()
                    retry.clear()
                    if pool is not None:
                        pool.shutdown(wait=False, cancel_futures=True)
                        pool = None
                    in_flight.clear()
            elif event[1] in in_flight:
                inner = event[1]
                job, owner = in_flight.pop(inner)
                if _broken(inner):
                    if owner is pool:
                        pool.shutdown(wait=False)
                        pool = None
                    if job.strikes:
                        _finish(
                            job,
                            CompileOutcome(
                                Status.CRASHED,
                                "compile worker process died (pool broken)",
                                time.perf_counter() - job.handed_at,
                            ),
                        )
                    else:
                        job.strikes += 1
                        retry.append(job)
                else:
                    _finish(job, _outcome(inner, job))
        if pool is not None:
            pool.shutdown(wait=True)


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
