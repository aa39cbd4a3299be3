"""A fused-MoE tunable whose kernels run for real (the interpreter checks every candidate) but whose GPU, eager and
graph times are scripted per plan, for the tuner's end-to-end choice: the CPU has no GPU to time.

Top-level module so spawned worker processes can unpickle it; the timers are fake_tunables' scripted ones (they call
the candidate once and report its `gpu_us`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tritune.tuners.fused_moe_tunable import FusedMoeTunable, MoeProblem
from tritune.tuning.types import Config


class TimedCall:
    """A candidate's launch and the time the scripted timers report for it."""

    def __init__(self, fn: Callable[[], None], gpu_us: float) -> None:
        self.fn, self.gpu_us = fn, gpu_us

    def __call__(self) -> None:
        self.fn()


@dataclass(frozen=True)
class ScriptedMoeTunable(FusedMoeTunable):
    """End to end, a stage pair with the plan-level levers on (SORTED_INTER) takes `lever_us` (or its row's entry in
    `lever_us_by_token`), one without `pair_us`; everything else (stage candidates, the 1-stage) `other_us`."""

    lever_us: float = 50.0
    pair_us: float = 100.0
    other_us: float = 1000.0
    lever_us_by_token: tuple[tuple[int, float], ...] = ()  # rows (by token count) whose lever time differs

    def launcher(self, problem: MoeProblem, inputs: dict, config: Config, out) -> TimedCall:
        fn = super().launcher(problem, inputs, config, out)
        us = self.other_us
        if problem.kind == "e2e" and problem.plan[1] is not None:
            lever = dict(self.lever_us_by_token).get(problem.shape.token, self.lever_us)
            us = lever if problem.plan[0].SORTED_INTER else self.pair_us
        return TimedCall(fn, us)
