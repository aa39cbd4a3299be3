"""What a tuning run reports: each problem's result (`ProblemResult`), the run's counts and times (`TuneSummary`)
and their summary lines, and the label a progress line gives a problem.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tritune.tuning.types import Measurement


@dataclass
class ProblemResult:
    problem: Any
    best: Measurement | None  # the objective's pick among the finalists (GPU time's pick without finalists)
    measurements: list[Measurement]  # finalists carry eager_us and graph_us
    space_size: int
    pruned: dict[str, int]
    gpu_best: Measurement | None = None  # the first pass's winner: least GPU time

    def why_failed(self) -> str:
        """Why there is no winner, the one message every report of it uses: 'every candidate was pruned' (nothing
        was measured) or 'no candidate passed (2 wrong_answer, 1 compile_error)'; '' when there is a winner."""
        if self.best is not None:
            return ""
        if not self.measurements:
            return "every candidate was pruned"
        kinds = Counter(m.status.value for m in self.measurements)
        return "no candidate passed (" + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) + ")"


@dataclass
class TuneSummary:
    problems: int = 0
    space_size: int = 0
    pruned: Counter = field(default_factory=Counter)  # rule -> configs removed
    candidates: int = 0
    reused: int = 0  # found in the journal, not measured again
    shared: int = 0  # candidates measured by another tuner sharing the journal while this one waited for them
    compiled: int = 0  # distinct binaries built in this run
    compile_failed: Counter = field(default_factory=Counter)  # status -> count
    measured: int = 0
    early_stopped: int = 0  # of the measured: timed only the early-stop probe, over the problem's cutoff
    failed: Counter = field(default_factory=Counter)  # status -> count (benchmark side, finalists included)
    unmeasured: int = 0  # candidates (and finalist re-times) left out because the time limit passed
    retimed: int = 0  # finalists timed as the op runs in this run
    retimed_reused: int = 0  # finalists whose op times the journal already held
    retimed_shared: int = 0  # finalists re-timed by another tuner sharing the journal while this one waited
    compile_wall_s: float = 0.0
    compile_cpu_s: float = 0.0  # summed per-binary compile times: what one process would have spent
    bench_wall_s: float = 0.0
    first_task_s: float = 0.0  # from the start of the pass to its first candidate handed to a GPU worker
    wall_s: float = 0.0
    executor_lines: list[str] = field(default_factory=list)  # what a Ray executor reports: nodes, GPUs, idle time

    @staticmethod
    def total(summaries: Sequence[TuneSummary]) -> TuneSummary:
        """Several runs' summaries as one: every count, counter and time added."""
        out = TuneSummary()
        for s in summaries:
            for f in dataclasses.fields(TuneSummary):
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
        return out

    @property
    def compile_speedup(self) -> float:
        """How much faster the pool compiled than one process would have."""
        return self.compile_cpu_s / self.compile_wall_s if self.compile_wall_s > 0 else float("nan")

    def lines(self) -> list[str]:
        def kinds(c: Counter) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "none"

        def rules(c: Counter) -> str:  # rule texts hold "=" and ">" themselves: the count goes in parentheses
            return ", ".join(f"{k} ({v})" for k, v in sorted(c.items())) or "none"

        return [
            f"problems: {self.problems}",
            f"candidates: {self.space_size} in the spaces, {sum(self.pruned.values())} pruned, "
            f"{self.candidates} kept, {self.reused} reused from the journal"
            + (f", {self.shared} measured by another tuner sharing it" if self.shared else ""),
            f"pruned by rule: {rules(self.pruned)}",
            f"compiled: {self.compiled} binaries ({self.compile_cpu_s:.1f} CPU-s, pool speed-up "
            f"{f'{self.compile_speedup:.1f}x' if self.compile_cpu_s >= 1.0 else 'n/a'}); "
            f"compile failures: {kinds(self.compile_failed)}",
            f"measured: {self.measured}"
            + (f" ({self.early_stopped} stopped after the early-stop probe)" if self.early_stopped else "")
            + f"; failed on the GPU: {kinds(self.failed)}"
            + (f"; {self.unmeasured} left unmeasured (time limit)" if self.unmeasured else ""),
            f"finalists timed as the op runs: {self.retimed} ({self.retimed_reused} reused from the journal"
            + (f", {self.retimed_shared} re-timed by another tuner sharing it" if self.retimed_shared else "") + ")",
            f"wall: {self.wall_s:.1f}s (compiling {self.compile_wall_s:.1f}s, benchmarking {self.bench_wall_s:.1f}s, "
            f"overlapped)",
            *self.executor_lines,
        ]


PROGRESS_LABEL_CHARS = 80


def progress_label(problem: Any) -> str:
    """What a progress line calls a problem: its `label()` if it has one, else its key; either cut to
    PROGRESS_LABEL_CHARS with a middle ellipsis (the full key stays in the journal)."""
    label = getattr(problem, "label", None)
    text = label() if callable(label) else problem.key()
    if len(text) <= PROGRESS_LABEL_CHARS:
        return text
    half = (PROGRESS_LABEL_CHARS - 1) // 2
    return text[:half] + "…" + text[len(text) - (PROGRESS_LABEL_CHARS - 1 - half):]
