"""Runs candidates on one long-lived worker process per GPU, with a per-candidate timeout and fault isolation.

Single-threaded and non-blocking: submit() queues, poll() hands tasks to idle workers one candidate at a
time and collects results, so the caller can interleave compilation. A worker that hangs or dies is
killed and replaced; its candidate is recorded as TIMEOUT or CRASHED. Every task gets exactly one result.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from tritune.knobs import worker_preload
from tritune.tuning.affinity import next_problem
from tritune.tuning.errors import is_sticky
from tritune.tuning.processes import parent_env, process_context
from tritune.tuning.types import BenchSettings, Config, Measurement, Status, Task
from tritune.tuning.worker import worker_main

_SETUP_TIMEOUT_FACTOR = 10  # until "started": the first task of a problem also builds inputs and reference
_STARTUP_TIMEOUT_S = 600.0  # spawn + import torch + CUDA init: not counted against candidates, only a safety net
_MAX_START_FAILURES = 3  # a worker that cannot start 3 times in a row is a broken setup, not a bad candidate


@dataclass(eq=False)
class _Worker:
    slot: int
    device: int | None
    proc: BaseProcess
    conn: Connection
    spawned_at: float
    ready: bool = False
    task: Task | None = None
    task_key: str = ""
    handed_at: float = 0.0
    started_at: float | None = None
    problem_key: str | None = None  # the problem whose buffers the worker holds: preferred for its next task

    def deadline(self, timeout_s: float) -> float:
        if self.task is not None:
            if self.started_at is None:
                return self.handed_at + _SETUP_TIMEOUT_FACTOR * timeout_s
            return self.started_at + timeout_s
        return math.inf if self.ready else self.spawned_at + _STARTUP_TIMEOUT_S


@dataclass
class _SlotStats:
    """One GPU slot's record across worker replacements, for the run summary."""

    done: int = 0  # results recorded (failures included)
    busy_s: float = 0.0  # time a candidate was handed out and not yet answered
    started_at: float | None = None  # the slot's first worker process started (with the fork server, the first
    # waits for the server's own imports: issue 17's fixed cost, apart from the workers' CUDA start-up)
    ready_at: float | None = None  # the slot's first worker ready


class LocalExecutor:
    """One benchmark process per device on this machine (worker i runs on devices[i % len(devices)]).

    devices defaults to GPUs 0..num_workers-1 when CUDA is available, else num_workers CPU workers.
    """

    def __init__(self, tunable: Any, num_workers: int, settings: BenchSettings, devices: list[int] | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if devices is None:
            slots: list[int | None] = list(range(num_workers)) if torch.cuda.is_available() else [None] * num_workers
        else:
            slots = [devices[i % len(devices)] for i in range(num_workers)]
        self._tunable = tunable
        self._settings = settings
        self._ctx = process_context()
        self._queues: dict[str, deque[Task]] = {}  # problem key -> its queued tasks, in submission order
        self._queued = 0
        self._stash: list[Measurement] = []  # results collected by wait_ready, handed out by the next poll
        self._start_failures = [0] * num_workers
        self._stats = [_SlotStats() for _ in range(num_workers)]
        self._began = time.monotonic()
        self._ended: float | None = None
        self._cutoffs: dict[str, float] = {}  # problem key -> early-stop cutoff (set_cutoff), applied at hand-out
        self._closed = False
        self._preload = worker_preload()  # name each task's likely successor (TRITUNE_WORKER_PRELOAD)
        self._workers = [self._spawn(slot, device) for slot, device in enumerate(slots)]

    def submit(self, task: Task) -> None:
        """Queue one candidate; never blocks."""
        if self._closed:
            raise RuntimeError("LocalExecutor is closed")
        self._queues.setdefault(task.problem.key(), deque()).append(task)
        self._queued += 1

    def set_cutoff(self, problem_key: str, cutoff_us: float) -> None:
        """First-pass candidates of this problem handed out from now on stop timing early above `cutoff_us`."""
        self._cutoffs[problem_key] = cutoff_us

    def cancel(self) -> list[Task]:
        """Withdraw every task not yet handed to a worker and return them (tasks in flight still report)."""
        dropped = [task for queue in self._queues.values() for task in queue]
        self._queues.clear()
        self._queued = 0
        return dropped

    @property
    def slots(self) -> int:
        """GPU workers: how many problems the tuner interleaves in its compile order."""
        return len(self._workers)

    def capacity(self) -> int:
        """Tasks worth having queued or in flight to keep every worker busy (beyond what is compiling)."""
        return 4 * len(self._workers)

    def pending(self) -> int:
        """Tasks queued or in flight."""
        return self._queued + sum(w.task is not None for w in self._workers)

    def poll(self, timeout: float = 0.05) -> list[Measurement]:
        """Feed idle workers, wait up to `timeout` s for results, enforce timeouts; return finished measurements.

        Raises RuntimeError when a worker fails to start several times in a row (a broken setup).
        """
        results, self._stash = self._stash, []
        self._dispatch()
        now = time.monotonic()
        nearest = min(w.deadline(self._settings.timeout_s) for w in self._workers)
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), max(0.0, min(timeout, nearest - now))):
            self._drain(by_conn[conn], results)
        self._enforce_deadlines(results)
        self._dispatch()
        return results

    def wait_ready(self, timeout: float = _STARTUP_TIMEOUT_S) -> None:
        """Block until every worker has started (results meanwhile are kept for the next poll)."""
        end = time.monotonic() + timeout
        while not all(w.ready for w in self._workers):
            if time.monotonic() > end:
                raise TimeoutError(f"workers not ready after {timeout:.0f}s")
            self._stash.extend(self.poll(0.1))

    def close(self) -> None:
        """Stop every worker (tasks in flight are dropped); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ended = time.monotonic()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            _stop(w, grace_s=2.0 if w.ready else 0.0)  # one still importing torch holds nothing worth a wait
            w.task = None
        self._queues.clear()
        self._queued = 0

    def summary_lines(self, now: float | None = None) -> list[str]:
        """GPU workers, candidates and idle seconds per GPU since each was first ready (until close or `now`,
        time.monotonic()): what a scaling run reads to see whether the GPUs or the compile pool set the pace."""
        now = self._ended or (time.monotonic() if now is None else now)
        ready = [st for st in self._stats if st.ready_at is not None]
        idle = [max(0.0, now - st.ready_at - st.busy_s) for st in ready]
        span = sum(now - st.ready_at for st in ready)
        devices = ", ".join(str(w.device) for w in self._workers if w.device is not None) or "cpu"
        up = [st.ready_at - self._began for st in ready]  # worker start-up: part of a run's fixed cost (issue 17)
        started = [st.started_at - self._began for st in self._stats if st.started_at is not None]
        return [f"local: {len(self._workers)} worker(s) on device(s) {devices}; "
                f"{sum(st.done for st in self._stats)} measurement(s) in {now - self._began:.1f}s; "
                f"candidates per GPU {', '.join(str(st.done) for st in self._stats)}; "
                f"idle s per GPU {', '.join(f'{s:.1f}' for s in idle) or '-'} "
                f"({100 * sum(idle) / span if span > 0 else 0:.0f}% of the time since ready)"
                + (f"; started {min(started):.1f}-{max(started):.1f}s" if started else "")
                + (f"; ready {min(up):.1f}-{max(up):.1f}s after the start" if up else "")]

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------------

    def _spawn(self, slot: int, device: int | None) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main,
            args=(parent_env(), pickle.dumps(self._tunable), device, self._settings, child_conn),
            name=f"tritune-bench-{slot}",
            daemon=True,
        )
        proc.start()
        child_conn.close()  # so the parent sees EOF as soon as the worker dies
        spawned_at = time.monotonic()
        if self._stats[slot].started_at is None:
            self._stats[slot].started_at = spawned_at
        return _Worker(slot, device, proc, parent_conn, spawned_at=spawned_at)

    def _replace(self, w: _Worker, grace_s: float = 0.0) -> None:
        _stop(w, grace_s)
        self._workers[w.slot] = self._spawn(w.slot, w.device)

    def _dispatch(self) -> None:
        for w in self._workers:
            if not (self._queued and w.ready and w.task is None):
                continue
            # Its current problem first, then one no other worker holds: inputs are not rebuilt needlessly.
            key = next_problem(self._queues, w.problem_key, (o.problem_key for o in self._workers if o is not w))
            queue = self._queues[key]
            task = queue.popleft().tightened(self._cutoffs)
            if self._preload:
                task = dataclasses.replace(task, likely_next=self._likely_next(queue, key, w))
            try:
                w.conn.send(task)
            except OSError:  # died while idle: the task goes back, the worker is replaced
                queue.appendleft(task)
                self._replace(w)
                continue
            if not queue:
                del self._queues[key]
            self._queued -= 1
            w.task, w.task_key, w.problem_key = task, key, key
            w.handed_at, w.started_at = time.monotonic(), None

    def _likely_next(self, queue: deque[Task], key: str, w: _Worker) -> tuple[Any, Config] | None:
        """(problem, config) of the task `w` will likely get next: in its problem's queue, the one after those the
        other busy workers on that problem take first; None when the queue is that short."""
        ahead = sum(o is not w and o.task is not None and o.problem_key == key for o in self._workers)
        if len(queue) <= ahead:
            return None
        nxt = queue[ahead]
        return nxt.problem, nxt.config

    def _drain(self, w: _Worker, results: list[Measurement]) -> None:
        while True:
            try:
                if not w.conn.poll():
                    return
                message = w.conn.recv()
            except (EOFError, OSError):
                self._on_death(w, results)
                return
            kind = message[0]
            if kind == "ready":
                w.ready = True
                self._start_failures[w.slot] = 0
                if self._stats[w.slot].ready_at is None:
                    self._stats[w.slot].ready_at = time.monotonic()
            elif w.task is None or message[1] != w.task.task_id:
                continue  # nothing else is expected from an idle worker
            elif kind == "started":
                w.started_at = time.monotonic()
            elif kind == "result":
                measurement = dataclasses.replace(
                    message[2], extra={**message[2].extra, "task_id": w.task.task_id, "worker": w.slot}
                )
                results.append(measurement)
                self._count(w)
                w.task = None
                if is_sticky(measurement.status):  # the worker exits by itself: its CUDA context is dead
                    self._replace(w, grace_s=5.0)
                    return

    def _count(self, w: _Worker) -> None:
        stats = self._stats[w.slot]
        stats.done += 1
        stats.busy_s += time.monotonic() - w.handed_at

    def _on_death(self, w: _Worker, results: list[Measurement]) -> None:
        w.proc.join(timeout=1.0)
        how = _describe_exit(w.proc.exitcode)
        if w.task is not None:
            results.append(_failure(w, Status.CRASHED, f"worker process died ({how}) while running this candidate"))
            self._count(w)
        elif not w.ready:
            self._start_failed(w, how)
        self._replace(w)

    def _start_failed(self, w: _Worker, how: str) -> None:
        self._start_failures[w.slot] += 1
        if self._start_failures[w.slot] >= _MAX_START_FAILURES:
            _stop(w, grace_s=0.0)
            raise RuntimeError(
                f"benchmark worker {w.slot} (device {w.device}) failed to start "
                f"{_MAX_START_FAILURES} times in a row; last: {how} (see its stderr)"
            )

    def _enforce_deadlines(self, results: list[Measurement]) -> None:
        now = time.monotonic()
        timeout_s = self._settings.timeout_s
        for w in list(self._workers):
            if not w.proc.is_alive():  # normally seen as EOF on the pipe first; a safety net
                self._drain(w, results)
                if self._workers[w.slot] is w:
                    self._on_death(w, results)
            elif now > w.deadline(timeout_s):
                if w.task is None:  # never became ready
                    self._start_failed(w, f"not ready after {_STARTUP_TIMEOUT_S:.0f}s")
                elif w.started_at is None:
                    limit = _SETUP_TIMEOUT_FACTOR * timeout_s
                    results.append(_failure(w, Status.TIMEOUT, f"inputs not ready after {limit:.3g}s; worker killed"))
                else:
                    results.append(_failure(w, Status.TIMEOUT, f"no result after {timeout_s:.3g}s; worker killed"))
                if w.task is not None:
                    self._count(w)
                self._replace(w)


def run_all(executor: LocalExecutor, tasks: Iterable[Task], poll_s: float = 0.1) -> list[Measurement]:
    """Submit every task and poll until all are measured; results in the order of `tasks` (ids must be unique)."""
    tasks = list(tasks)
    for task in tasks:
        executor.submit(task)
    by_id: dict[int, Measurement] = {}
    while executor.pending():
        for measurement in executor.poll(poll_s):
            by_id[measurement.extra["task_id"]] = measurement
    return [by_id[task.task_id] for task in tasks]


def _failure(w: _Worker, status: Status, message: str) -> Measurement:
    assert w.task is not None
    return Measurement(
        w.task_key, w.task.config, status, message=message, extra={"task_id": w.task.task_id, "worker": w.slot}
    )


def _stop(w: _Worker, grace_s: float) -> None:
    """Wait up to grace_s for the worker to exit, then SIGKILL it (a hung kernel ignores anything softer)."""
    if grace_s > 0:
        w.proc.join(timeout=grace_s)
    if w.proc.is_alive():
        w.proc.kill()
        w.proc.join(timeout=10.0)
    w.conn.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
