"""Runs candidates on a Ray cluster behind the local executor's seam (submit / poll / cancel / pending / close): one
benchmark actor per GPU of every node, each candidate compiled on the node whose GPU runs it, faults re-queued once.

Ray is imported on first use only (`pip install tritune[ray]`): the engine loads without it. The driver holds all
state; nodes hold only their actors and their own Triton cache (binaries never travel). Every measurement comes back
to the driver, which journals it (tuner.py) the moment poll() returns it, so a rerun after a driver crash resumes.
Faults: an actor that dies, hangs past the timeout or loses its node has its candidate in flight re-queued once; a
candidate that takes down a second actor is recorded (CRASHED, or TIMEOUT after two hangs) with both reasons. Actors
whose GPU model or Triton version differs from the run's device are not used: one journal row never mixes devices.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from tritune.device import DeviceInfo
from tritune.tuning.affinity import next_problem
from tritune.tuning.compile import CompileOutcome, compile_target_of
from tritune.tuning.errors import is_sticky
from tritune.tuning.ray_cluster import (
    STARTUP_TIMEOUT_S,
    RaySettings,
    connect,
    gpu_nodes,
    import_ray,
    on_node,
    remote,
    slot_options,
)
from tritune.tuning.ray_state import (
    _MAX_STRIKES,
    _SETUP_TIMEOUT_FACTOR,
    _Actor,
    _Item,
    _Node,
    cluster_summary_lines,
    node_rates_text,
)
from tritune.tuning.types import BenchSettings, Measurement, Status, Task

_MAX_START_FAILURES = 3  # per GPU slot, in a row: then the slot is given up (the run goes on without it)
_PROGRESS_EVERY_S = 0.5


class DeferredCompiles:
    """The tuner's compile pool when the executor compiles on the nodes: every candidate 'compiles' at once here
    and is compiled for real on the node that runs it (a failure there comes back as the candidate's result)."""

    def submit(self, problem: Any, config: Any) -> Future[CompileOutcome]:
        done: Future[CompileOutcome] = Future()
        done.set_result(CompileOutcome(Status.OK, "compiled on the node that runs it", 0.0))
        return done

    def prestart(self) -> None:
        pass

    def shutdown(self, cancel: bool = False) -> None:
        pass


class RayExecutor:
    """Benchmarks candidates of `tunable` on the GPUs of a Ray cluster that are a `device.name` (same Triton version).

    Same seam as `LocalExecutor`. Nothing starts until the first poll (a rerun with nothing left measures nothing
    and starts nothing). The tuner hands candidates over uncompiled (`DeferredCompiles`): they compile on the nodes.
    """

    def __init__(self, tunable: Any, settings: BenchSettings, ray_settings: RaySettings, device: DeviceInfo,
                 progress: bool = False) -> None:
        self._tunable, self._settings, self._ray_settings, self._device = tunable, settings, ray_settings, device
        self._compile_target = compile_target_of(device)  # compile tasks answer Triton from it, opening no GPU
        self._cutoffs: dict[str, float] = {}  # problem key -> early-stop cutoff (set_cutoff), applied at hand-out
        self._progress_on = progress
        self._queues: dict[str, deque[_Item]] = {}  # problem key -> queued items, in submission order
        self._queued = 0
        self._nodes: dict[str, _Node] = {}
        self._actors: list[_Actor] = []
        self._started = False
        self._closed = False
        self._began = 0.0
        self.requeued: list[tuple[int, str]] = []  # (task id, why): candidates re-queued after losing their actor
        self.given_up: list[tuple[int, str]] = []  # (task id, why): recorded after taking down _MAX_STRIKES actors
        self._bar: Any = None
        self._bar_at = 0.0

    # ---- the seam ----------------------------------------------------------------------------------------------

    def submit(self, task: Task) -> None:
        """Queue one candidate; never blocks (the cluster is joined on the first poll)."""
        if self._closed:
            raise RuntimeError("RayExecutor is closed")
        key = task.problem.key()
        self._queues.setdefault(key, deque()).append(_Item(task, key))
        self._queued += 1

    def set_cutoff(self, problem_key: str, cutoff_us: float) -> None:
        """First-pass candidates of this problem handed out from now on stop timing early above `cutoff_us`."""
        self._cutoffs[problem_key] = cutoff_us

    def cancel(self) -> list[Task]:
        """Withdraw every candidate not yet handed to an actor (queued or compiling ahead) and return them."""
        dropped = [item.task for queue in self._queues.values() for item in queue]
        for actor in self._actors:
            dropped += [item.task for item, _ in actor.ahead]
            actor.ahead.clear()
        self._queues.clear()
        self._queued = 0
        return dropped

    @property
    def slots(self) -> int:
        """Benchmark actors (one per GPU; the cluster is joined to count them): how many problems the tuner
        interleaves in its compile order."""
        self._start()
        return max(1, len(self._actors))

    def capacity(self) -> int:
        """Candidates worth having queued, compiling ahead or in flight: every actor's compile-ahead list full and
        one more each (0 before the cluster is joined)."""
        return sum(a.node.lookahead + 1 for a in self._actors)

    def pending(self) -> int:
        """Candidates queued, compiling ahead or in flight."""
        return self._queued + sum(len(a.ahead) + (a.item is not None) for a in self._actors)

    def poll(self, timeout: float = 0.05) -> list[Measurement]:
        """Feed idle actors, wait up to `timeout` s for anything to finish, enforce timeouts; return measurements.

        Raises RuntimeError when candidates are waiting and no actor is left to run them.
        """
        results: list[Measurement] = []
        if not self.pending():  # as LocalExecutor: nothing to wait for still waits
            time.sleep(timeout)
            return results
        ray = self._start()
        self._feed(results)
        watched = self._watched()
        now = time.monotonic()
        nearest = min((a.deadline(self._settings.timeout_s) for a in self._actors), default=now)
        wait_s = 0.0 if results else max(0.0, min(timeout, nearest - now))  # compile failures: no waiting
        if watched:
            ready, _ = ray.wait(list(watched), num_returns=1, timeout=wait_s)
            if ready:
                ready, _ = ray.wait(list(watched), num_returns=len(watched), timeout=0)
            for ref in ready:
                self._on_ready(ref, *watched[ref], results)
        elif wait_s:
            time.sleep(wait_s)
        self._enforce_deadlines(results)
        self._feed(results)
        if self.pending() and not self._actors:
            raise RuntimeError("no benchmark actor is left on the Ray cluster: " + self._why_none())
        self._show_progress()
        return results

    def close(self) -> None:
        """Stop every actor (candidates in flight are dropped); idempotent. The Ray connection stays open."""
        if self._closed:
            return
        self._closed = True
        for actor in list(self._actors):  # a candidate still in flight counts as busy time, not idle
            self._retire(actor, kill=True)
        if self._bar is not None:
            self._bar.close()
        self._queues.clear()
        self._queued = 0

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def summary_lines(self, now: float | None = None) -> list[str]:
        """Nodes, GPUs, candidates and idle seconds per GPU, compiles per node, and what faults cost, as of `now`
        (time.monotonic(); default: now); [] if nothing was started."""
        if not self._started:
            return []
        now = time.monotonic() if now is None else now
        return cluster_summary_lines(self._nodes.values(), self._actors, self._device.name, self._began,
                                     len(self.requeued), len(self.given_up), now)

    # ---- start-up ----------------------------------------------------------------------------------------------

    def _start(self) -> Any:
        ray = import_ray()
        if self._started:
            return ray
        ray = connect(self._ray_settings)
        self._started, self._began = True, time.monotonic()
        nodes = gpu_nodes(ray, self._ray_settings.resource)
        if not nodes:
            raise RuntimeError(f"no alive node of the Ray cluster offers the resource {self._ray_settings.resource!r}")
        blob = ray.cloudpickle.dumps((self._tunable, self._settings))
        self._actor_blob = ray.put(blob)
        self._tunable_blob = ray.put(ray.cloudpickle.dumps(self._tunable))
        for n in nodes:
            res = n["Resources"]
            node = _Node(n["NodeID"], f"{n.get('NodeManagerAddress', '?')}/{n['NodeID'][:8]}", float(res.get("CPU", 1)),
                         int(res[self._ray_settings.resource]))
            self._nodes[node.node_id] = node
            for _ in range(node.gpus):
                self._actors.append(self._spawn(len(self._actors), node))
        if self._progress_on:
            from tqdm import tqdm

            self._bar = tqdm(desc="ray", unit="cfg", leave=True, dynamic_ncols=True)
        return ray

    def _spawn(self, slot: int, node: _Node, start_failures: int = 0) -> _Actor:
        actor_cls, _, _ = remote()
        handle = actor_cls.options(**slot_options(self._ray_settings.resource), num_cpus=0, max_restarts=0,
                                   max_task_retries=0, scheduling_strategy=on_node(node.node_id)
                                   ).remote(self._actor_blob)
        return _Actor(slot, node, handle, handle.hello.remote(), time.monotonic(), start_failures)

    # ---- scheduling --------------------------------------------------------------------------------------------

    def _pop(self, actor: _Actor) -> _Item:
        """The next candidate for `actor`'s compile-ahead list: of the problem it is on (its last candidate ahead, or
        the one it ran), else of one no other actor is on (tuning/affinity.py)."""
        prefer = actor.ahead[-1][0].key if actor.ahead else actor.problem_key
        others = (a.ahead[-1][0].key if a.ahead else a.problem_key for a in self._actors if a is not actor)
        key = next_problem(self._queues, prefer, others)
        queue = self._queues[key]
        item = queue.popleft()
        if not queue:
            del self._queues[key]
        self._queued -= 1
        return item

    def _requeue(self, item: _Item) -> None:
        """Back to the front of its problem's queue: a candidate that lost its actor goes next."""
        self._queues.setdefault(item.key, deque()).appendleft(item)
        self._queued += 1

    def _compile(self, node: _Node, task: Task) -> Any:
        """The ObjectRef of `task`'s compile on `node`: started now unless that binary is already compiling there."""
        key_fn = getattr(self._tunable, "compile_key", None)
        ckey = key_fn(task.problem, task.config) if key_fn else f"{task.problem.key()}|{task.config.key()}"
        ref = node.compiles.get(ckey)
        if ref is None:
            _, compile_task, _ = remote()
            there = compile_task.options(num_cpus=1, max_retries=1, scheduling_strategy=on_node(node.node_id))
            ref = there.remote(self._tunable_blob, import_ray().cloudpickle.dumps((task.problem, task.config)),
                               self._compile_target)
            node.compiles[ckey] = ref
            node.compiled += 1
        return ref

    def _feed(self, results: list[Measurement]) -> None:
        """Top up every ready actor's compile-ahead list, then hand each idle actor its next compiled candidate."""
        ray = import_ray()
        for actor in list(self._actors):
            if actor.ready_at is None or actor not in self._actors:  # not started, or retired with its node meanwhile
                continue
            while len(actor.ahead) < actor.node.lookahead and self._queued:
                item = self._pop(actor)
                actor.ahead.append((item, self._compile(actor.node, item.task)))
            if not actor.ahead and actor.item is None:
                self._steal_for(actor)
            while actor.item is None and actor.ahead:
                item, ref = actor.ahead[0]
                done, _ = ray.wait([ref], timeout=0)
                if not done:
                    break
                actor.ahead.popleft()
                outcome = self._outcome(ref, actor.node)
                if outcome is None:  # the node went away under the compile: retire it, the candidate goes back
                    self._requeue(item)
                    self._node_lost(actor.node, results)
                    break
                if outcome.status is Status.OK:
                    self._hand(actor, item)
                else:
                    results.append(Measurement(item.key, item.task.config, outcome.status, message=outcome.message,
                                               extra={**self._provenance(actor, item), "stage": "compile"}))

    def _steal_for(self, actor: _Actor) -> None:
        """Nothing queued and `actor` idle: take the last not-yet-handed candidate of the longest other compile-ahead
        list (its compile is redone here unless both actors share a node), so the run's tail is spread too."""
        donors = [a for a in self._actors if a is not actor and len(a.ahead) > (1 if a.item is None else 0)]
        if donors:
            donor = max(donors, key=lambda a: len(a.ahead))
            item, ref = donor.ahead.pop()
            actor.ahead.append((item, ref if donor.node is actor.node else self._compile(actor.node, item.task)))

    def _outcome(self, ref: Any, node: _Node) -> CompileOutcome | None:
        """What a finished compile on `node` gave; None when it failed because the node is gone."""
        try:
            outcome: CompileOutcome = import_ray().get(ref)
        except Exception as exc:  # the compile process died twice (max_retries=1), or its node did
            if not self._node_alive(node):
                return None
            return CompileOutcome(Status.CRASHED, f"compile task failed twice: {_first_line(exc)}", 0.0)
        if ref not in node.counted:
            node.counted.add(ref)
            node.compile_s += outcome.seconds
        return outcome

    def _hand(self, actor: _Actor, item: _Item) -> None:
        fresh = actor.fresh and actor.problem_key == item.key
        actor.prep = None if fresh else actor.handle.prepare.remote(item.task.problem)
        actor.run = actor.handle.run.remote(item.task.tightened(self._cutoffs))
        actor.item, actor.problem_key = item, item.key
        actor.handed_at = time.monotonic()
        actor.started_at = actor.handed_at if fresh else None

    def _watched(self) -> dict[Any, tuple[str, _Actor]]:
        watched: dict[Any, tuple[str, _Actor]] = {}
        for actor in self._actors:
            if actor.ready_at is None:
                watched[actor.hello] = ("hello", actor)
                continue
            if actor.item is not None:
                if actor.prep is not None and actor.started_at is None:
                    watched[actor.prep] = ("prep", actor)
                watched[actor.run] = ("run", actor)
            elif actor.ahead:
                watched[actor.ahead[0][1]] = ("compile", actor)
        return watched

    def _on_ready(self, ref: Any, kind: str, actor: _Actor, results: list[Measurement]) -> None:
        if actor not in self._actors or kind == "compile":
            return  # retired meanwhile / picked up by the next _feed
        ray = import_ray()
        try:
            value = ray.get(ref)
        except Exception as exc:  # RayActorError and kin: the actor (or its node) is gone
            self._lost(actor, "crash", _first_line(exc), results)
            return
        now = time.monotonic()
        if kind == "hello":
            self._on_hello(actor, value, now)
        elif kind == "prep":
            actor.started_at = now
        else:
            item = actor.item
            assert item is not None
            if actor.started_at is None:
                actor.started_at = now
            actor.busy_s += now - actor.handed_at
            actor.done += 1
            actor.item, actor.prep, actor.run = None, None, None
            actor.fresh = value.ok
            value = dataclasses.replace(value, extra={**value.extra, **self._provenance(actor, item)})
            results.append(value)
            if self._bar is not None:
                self._bar.update(1)
            if is_sticky(value.status):  # its CUDA context is dead: a fresh actor takes the slot
                self._retire(actor, kill=True)
                self._actors.append(self._spawn(actor.slot, actor.node))

    def _on_hello(self, actor: _Actor, info: dict[str, Any], now: float) -> None:
        device: DeviceInfo = info["device"]
        actor.device = device
        if (device.name, device.triton_version) != (self._device.name, self._device.triton_version):
            actor.node.note = (f"{device.name} (Triton {device.triton_version}) not used: this run tunes "
                               f"{self._device.name} (Triton {self._device.triton_version})")
            self._retire(actor, kill=True)
            return
        actor.ready_at = now
        actor.start_failures = 0

    def _provenance(self, actor: _Actor, item: _Item) -> dict[str, Any]:
        return {"task_id": item.task.task_id, "worker": actor.slot, "node": actor.node.label,
                "device": (actor.device or self._device).name}

    # ---- faults --------------------------------------------------------------------------------------------------

    def _enforce_deadlines(self, results: list[Measurement]) -> None:
        now = time.monotonic()
        timeout_s = self._settings.timeout_s
        for actor in list(self._actors):
            if now <= actor.deadline(timeout_s):
                continue
            if actor.item is None:
                self._lost(actor, "start", f"not ready after {STARTUP_TIMEOUT_S:.0f}s", results)
            elif actor.started_at is None:
                limit = _SETUP_TIMEOUT_FACTOR * timeout_s
                self._lost(actor, "hang", f"inputs not ready after {limit:.3g}s; actor killed", results)
            else:
                self._lost(actor, "hang", f"no result after {timeout_s:.3g}s; actor killed", results)

    def _lost(self, actor: _Actor, why: str, detail: str, results: list[Measurement]) -> None:
        """`actor` crashed, hung or never started: its candidates go back (a second strike records one); the slot is
        refilled on the same node, or the whole node retired if the node is gone."""
        if why != "hang" and not self._node_alive(actor.node):
            self._node_lost(actor.node, results)
            return
        was_ready = actor.ready_at is not None
        self._strike(actor, f"{'actor hung' if why == 'hang' else 'actor died'} on {actor.node.label}: {detail}",
                     why == "hang", results)
        self._retire(actor, kill=True)
        failures = 0 if was_ready else actor.start_failures + 1
        if failures >= _MAX_START_FAILURES:
            actor.node.note = f"a GPU slot given up after {failures} failed starts ({detail})"
            return
        self._actors.append(self._spawn(actor.slot, actor.node, failures))

    def _strike(self, actor: _Actor, reason: str, hung: bool, results: list[Measurement]) -> None:
        for item, _ in actor.ahead:
            self._requeue(item)
        actor.ahead.clear()
        item = actor.item
        if item is None:
            return
        actor.node.struck += 1
        item.strikes.append(reason)
        if len(item.strikes) < _MAX_STRIKES:
            self._requeue(item)
            self.requeued.append((item.task.task_id, reason))
            return
        status = Status.TIMEOUT if hung else Status.CRASHED
        message = f"took down {_MAX_STRIKES} benchmark actors: " + "; ".join(item.strikes)
        self.given_up.append((item.task.task_id, message))
        results.append(Measurement(item.key, item.task.config, status, message=message,
                                   extra=self._provenance(actor, item)))

    def _retire(self, actor: _Actor, kill: bool) -> None:
        actor.ended_at = time.monotonic()
        if actor.item is not None:
            actor.busy_s += actor.ended_at - actor.handed_at
        actor.item = None
        if actor in self._actors:
            self._actors.remove(actor)
        actor.node.retired.append(actor)
        if kill:
            try:
                import_ray().kill(actor.handle, no_restart=True)
            except Exception:
                pass

    def _node_lost(self, node: _Node, results: list[Measurement]) -> None:
        """Every actor of `node` is gone with it: in-flight candidates struck once, compile-ahead ones re-queued."""
        if not node.alive:
            return
        node.alive, node.lost_at = False, time.monotonic()
        for actor in [a for a in self._actors if a.node is node]:
            self._strike(actor, f"node {node.label} lost", False, results)
            self._retire(actor, kill=False)
        node.compiles.clear()

    def _node_alive(self, node: _Node) -> bool:
        if not node.alive:
            return False
        try:
            return any(n["NodeID"] == node.node_id and n.get("Alive") for n in import_ray().nodes())
        except Exception:
            return True

    def _why_none(self) -> str:
        return "; ".join(f"{n.label}: {n.note or ('lost' if not n.alive else 'no slot left')}"
                         for n in self._nodes.values()) or "no node"

    def _show_progress(self) -> None:
        if self._bar is None or time.monotonic() - self._bar_at < _PROGRESS_EVERY_S:
            return
        self._bar_at = time.monotonic()
        self._bar.set_postfix_str(self.node_rates(self._bar_at), refresh=True)

    def node_rates(self, now: float | None = None) -> str:
        """The progress bar's text: each node's candidates per second since its first actor was ready (until it was
        lost), "a1b2c3d4 2.0/s, e5f6a7b8 1.0/s lost"; nodes with no ready actor yet are left out."""
        now = time.monotonic() if now is None else now
        return node_rates_text(self._nodes.values(), self._actors, now)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
