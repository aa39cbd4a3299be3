"""Which problem a GPU worker takes its next candidate from, and the order candidates are compiled in.

A worker that changes problem rebuilds that problem's inputs and reference (for a large MoE row, weights of a few GB
and a reference pass), so with several GPUs the candidates of a run are spread problem by problem, not candidate by
candidate: each worker keeps to its problem, moves to one no other worker holds, and only when every queued problem
is held joins the one with the most candidates waiting. The compile order feeds that: candidates of as many problems
as there are workers are interleaved, so each worker finds a problem of its own in the queue.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence, Sized
from typing import TypeVar

T = TypeVar("T")


def next_problem(queues: Mapping[str, Sized], current: str | None, held_by_others: Iterable[str | None]) -> str:
    """The problem key (of the non-empty `queues`, in submission order) a worker holding `current` serves next."""
    if current in queues:
        return current
    held = set(held_by_others)
    for key in queues:
        if key not in held:
            return key
    return max(queues, key=lambda k: len(queues[k]))  # first of the longest on a tie


def interleave(items: Sequence[T], key_of, group: int) -> list[T]:
    """`items` (grouped by problem, `key_of(item)` its problem) reordered so that the problems are taken `group` at a
    time and their items alternate within a group; group 1 (one worker) keeps the order."""
    if group <= 1:
        return list(items)
    by_problem: dict[Hashable, list[T]] = {}
    for item in items:
        by_problem.setdefault(key_of(item), []).append(item)
    problems = list(by_problem.values())
    out: list[T] = []
    for start in range(0, len(problems), group):
        lists = problems[start:start + group]
        for i in range(max(map(len, lists))):
            out.extend(lst[i] for lst in lists if i < len(lst))
    return out
