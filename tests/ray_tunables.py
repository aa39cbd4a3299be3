"""A scripted tunable for the Ray executor tests: GPU, eager and graph times come from the config (so two executors
give bit-equal results), each measurement attempt is logged with the pid that made it, and chosen candidates answer
wrong, fail to compile, crash their process or hang. Top-level module, so Ray's node processes can unpickle it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from tritune.tuning.bench import Timing
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config


@dataclass(frozen=True)
class CountProblem:
    """`size` candidates i = 0 .. size-1 of one problem named `tag`."""

    tag: str
    size: int
    n: int = 32  # output elements

    def key(self) -> str:
        return f"count:{self.tag}:size={self.size}:n={self.n}:float32"


@dataclass
class ScriptedCall:
    x: torch.Tensor
    out: torch.Tensor
    gpu_us: float
    eager_us: float
    wrong: bool

    def __call__(self) -> None:
        self.out.copy_(self.x)
        if self.wrong:
            self.out.mul_(2.0)


@dataclass(frozen=True)
class ScriptedCounts:
    """Candidate i: GPU time 10 + (7 i mod 13) us, eager time GPU + (i mod 3), graph time GPU - 1. `wrong`,
    `no_compile`, `crash` and `hang` name the i that misbehave; each attempt sleeps `run_s` and, with `log`, appends
    'pid problem-tag i' to that file first."""

    wrong: tuple[int, ...] = ()
    no_compile: tuple[int, ...] = ()
    crash: tuple[int, ...] = ()
    hang: tuple[int, ...] = ()
    run_s: float = 0.0
    log: str | None = None
    name: str = field(default="scripted_counts", compare=False)

    def space(self, problem: CountProblem, device):
        from tritune.tuning.space import SearchSpace

        return SearchSpace({"i": tuple(range(problem.size))})

    def make_inputs(self, problem: CountProblem, device: torch.device, seed: int) -> torch.Tensor:
        return (torch.rand(problem.n, generator=torch.Generator().manual_seed(seed)) + 0.5).to(device)

    def reference(self, problem: CountProblem, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.float()

    def alloc_output(self, problem: CountProblem, inputs: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(inputs)

    def launcher(self, problem: CountProblem, inputs: torch.Tensor, config: Config, out: torch.Tensor) -> ScriptedCall:
        i = int(config["i"])
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {problem.tag} {i}\n")
        if i in self.crash:
            os._exit(7)
        if i in self.hang:
            time.sleep(1000)
        time.sleep(self.run_s)
        gpu_us = 10.0 + (7 * i) % 13
        return ScriptedCall(inputs, out, gpu_us, gpu_us + i % 3, i in self.wrong)

    def compile(self, problem: CountProblem, config: Config) -> None:
        if int(config["i"]) in self.no_compile:
            from triton.compiler.errors import CompilationError

            raise CompilationError("x = tl.load(p)", None, "scripted compile error")

    def flops(self, problem: CountProblem) -> float:
        return float(problem.n)

    def bytes_moved(self, problem: CountProblem) -> float:
        return 8.0 * problem.n

    def tolerance(self, problem: CountProblem) -> Tolerance:
        return Tolerance(atol=0.0, rtol=0.0)


def gpu_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True, l2_bytes: int = 0) -> Timing:
    fn()
    return Timing(fn.gpu_us, fn.gpu_us, fn.gpu_us, iters, "scripted gpu time")


def eager_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True, l2_bytes: int = 0) -> Timing:
    fn()
    return Timing(fn.eager_us, fn.eager_us, fn.eager_us, iters, "scripted eager time")


def graph_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True, l2_bytes: int = 0) -> Timing:
    fn()
    return Timing(fn.gpu_us - 1.0, fn.gpu_us - 1.0, fn.gpu_us - 1.0, iters, "scripted graph replay")
