"""What a Ray run's driver knows of its cluster: the records of candidates, nodes and benchmark actors
(`_Item`, `_Node`, `_Actor`), and the summary lines and progress text made from them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tritune.device import DeviceInfo
from tritune.tuning.ray_cluster import STARTUP_TIMEOUT_S
from tritune.tuning.types import Task

_SETUP_TIMEOUT_FACTOR = 10  # as executor.py: making a problem's inputs may take this many candidate timeouts
_MAX_STRIKES = 2  # actors a candidate may take down: the first re-queues it, the second records it


@dataclass(eq=False)
class _Item:
    task: Task
    key: str  # problem key
    strikes: list[str] = field(default_factory=list)  # why each actor running it was lost


@dataclass(eq=False)
class _Node:
    node_id: str
    label: str  # "host/abcd1234"
    cpus: float
    gpus: int
    compiles: dict[str, Any] = field(default_factory=dict)  # compile key -> ObjectRef of its CompileOutcome here
    compiled: int = 0  # compile tasks started here
    compile_s: float = 0.0  # summed compile times of the outcomes read back
    counted: set = field(default_factory=set)  # compile ObjectRefs whose time is in compile_s
    alive: bool = True
    lost_at: float | None = None
    struck: int = 0  # candidates in flight on actors of this node when they were lost
    retired: list[_Actor] = field(default_factory=list)  # actors retired on this node (for the summary)
    note: str = ""

    @property
    def lookahead(self) -> int:
        """Candidates each of this node's actors holds compiling ahead: enough to keep every CPU busy."""
        return max(2, math.ceil(self.cpus / max(1, self.gpus)) + 1)


@dataclass(eq=False)
class _Actor:
    slot: int
    node: _Node
    handle: Any
    hello: Any  # ObjectRef until ready
    spawned_at: float
    start_failures: int = 0
    ready_at: float | None = None
    device: DeviceInfo | None = None
    ahead: deque[tuple[_Item, Any]] = field(default_factory=deque)  # (item, its compile ObjectRef on this node)
    item: _Item | None = None
    prep: Any = None
    run: Any = None
    handed_at: float = 0.0
    started_at: float | None = None
    problem_key: str | None = None
    fresh: bool = False  # the actor's inputs for problem_key are intact (last candidate passed)
    done: int = 0
    busy_s: float = 0.0
    ended_at: float | None = None

    def deadline(self, timeout_s: float) -> float:
        if self.item is not None:
            if self.started_at is None:
                return self.handed_at + _SETUP_TIMEOUT_FACTOR * timeout_s
            return self.started_at + timeout_s
        return math.inf if self.ready_at is not None else self.spawned_at + STARTUP_TIMEOUT_S

    def idle_s(self, now: float) -> float:
        if self.ready_at is None:
            return 0.0
        return max(0.0, (self.ended_at or now) - self.ready_at - self.busy_s)


def node_gpus(node: _Node, actors: Sequence[_Actor]) -> dict[int, list[_Actor]]:
    """GPU slot of `node` -> the actors that held it and became ready (a replaced actor leaves a successor);
    `actors` are the live ones of the run."""
    gpus: dict[int, list[_Actor]] = {}
    for actor in node.retired + [a for a in actors if a.node is node]:
        if actor.ready_at is not None:
            gpus.setdefault(actor.slot, []).append(actor)
    return dict(sorted(gpus.items()))


def cluster_summary_lines(nodes: Iterable[_Node], actors: Sequence[_Actor], device_name: str, began: float,
                          requeued: int, given_up: int, now: float) -> list[str]:
    """Nodes, GPUs, candidates and idle seconds per GPU, compiles per node, and what faults cost, as of `now`
    (time.monotonic()) for a run started at `began`; `requeued`/`given_up` count the candidates each fault cost."""
    per_node = {n: node_gpus(n, actors) for n in nodes}
    measured = sum(a.done for gpus in per_node.values() for lives in gpus.values() for a in lives)
    lines = [f"ray: {len(per_node)} node(s), {sum(map(len, per_node.values()))} GPU(s) of {device_name}; "
             f"{measured} measurement(s) in {now - began:.1f}s; {requeued} re-queued after losing "
             f"their actor, {given_up} recorded after taking down {_MAX_STRIKES} actors"]
    for node, gpus in per_node.items():
        done = ", ".join(str(sum(a.done for a in lives)) for lives in gpus.values()) or "-"
        idle = ", ".join(f"{sum(a.idle_s(now) for a in lives):.1f}" for lives in gpus.values()) or "-"
        lost = "" if node.alive else f"; LOST after {node.lost_at - began:.1f}s"
        lost += f"; {node.struck} candidate(s) in flight on lost actors" if node.struck else ""
        lines.append(f"  node {node.label}: {len(gpus)} GPU(s); candidates per GPU {done}; idle s per GPU {idle}; "
                     f"{node.compiled} compile(s), {node.compile_s:.1f} CPU-s{lost}"
                     + (f"; {node.note}" if node.note else ""))
    return lines


def node_rates_text(nodes: Iterable[_Node], actors: Sequence[_Actor], now: float) -> str:
    """Each node's candidates per second since its first actor was ready (until it was lost),
    "a1b2c3d4 2.0/s, e5f6a7b8 1.0/s lost"; nodes with no ready actor yet are left out."""
    parts = []
    for node in nodes:
        lives = [a for actors_of_slot in node_gpus(node, actors).values() for a in actors_of_slot]
        if not lives:
            continue
        since = min(a.ready_at or now for a in lives)
        rate = sum(a.done for a in lives) / max(1e-9, (node.lost_at or now) - since)
        parts.append(f"{node.label.split('/')[-1]} {rate:.1f}/s" + ("" if node.alive else " lost"))
    return ", ".join(parts)
