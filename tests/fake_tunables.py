"""Tiny CPU tunables whose behaviour per config is scripted, for the compile pool and executor tests.

Top-level module so spawned worker processes can unpickle them. The config's "mode" says what happens:
good | wrong | partial | flaky | slow | hang | exit | sticky | raise, and for compile():
ok | oor | ptxas | compile_error | value_error | compile_exit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config

# pids of processes compile() ran in; only meaningful for inline (same-process) compiles.
COMPILE_PIDS: list[int] = []


@dataclass(frozen=True)
class AddProblem:
    n: int

    def key(self) -> str:
        return f"add:n={self.n}:float32"


class ScriptedAdd:
    """out = x + y on the CPU, misbehaving as config["mode"] says."""

    name = "scripted_add"

    def __init__(self, log_path: str | None = None) -> None:
        self.log_path = log_path  # make_inputs appends one line per call here (it runs in another process)

    def make_inputs(self, problem: AddProblem, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(f"{os.getpid()} {problem.key()}\n")
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(problem.n, generator=gen) + 0.5  # never zero
        y = torch.rand(problem.n, generator=gen) + 0.5
        return x.to(device), y.to(device)

    def reference(self, problem: AddProblem, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return inputs[0].float() + inputs[1].float()

    def alloc_output(self, problem: AddProblem, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.empty_like(inputs[0])

    def launcher(self, problem: AddProblem, inputs, config: Config, out: torch.Tensor):
        x, y = inputs
        mode = config.get("mode", "good")
        calls = [0]

        def fn() -> None:
            calls[0] += 1
            if mode == "hang":
                time.sleep(1000)
            elif mode == "exit":
                os._exit(1)
            elif mode == "sticky":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            elif mode == "raise":
                raise ValueError("launcher bug")
            elif mode == "slow":
                time.sleep(0.02)
            if mode == "partial":  # the second half keeps whatever the engine left there (its poison)
                half = problem.n // 2
                torch.add(x[:half], y[:half], out=out[:half])
                return
            torch.add(x, y, out=out)
            if mode == "wrong":
                out.mul_(1.5)
            elif mode == "flaky" and calls[0] > 1:  # right the first time, wrong under repetition
                out[0] = 0.0

        return fn

    def compile(self, problem: AddProblem, config: Config) -> None:
        COMPILE_PIDS.append(os.getpid())
        mode = config.get("mode", "ok")
        if mode == "oor":
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(300000, 232448, "shared memory")
        if mode == "ptxas":
            raise RuntimeError("ptxas fatal: Unresolved extern function")
        if mode == "compile_error":
            from triton.compiler.errors import CompilationError

            raise CompilationError("x = tl.load(p)", None, "unsupported tensor index")
        if mode == "value_error":
            raise ValueError("bad launch grid")
        if mode == "compile_exit":
            os._exit(1)
        time.sleep(float(config.get("sleep", 0.0)))

    def flops(self, problem: AddProblem) -> float:
        return float(problem.n)

    def bytes_moved(self, problem: AddProblem) -> float:
        return 12.0 * problem.n

    def tolerance(self, problem: AddProblem) -> Tolerance:
        return Tolerance(atol=1e-6, rtol=1e-6)
