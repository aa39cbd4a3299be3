"""Tiny CPU tunables whose behaviour per config is scripted, for the compile pool, executor and tuner tests.

Top-level module so spawned worker processes can unpickle them. ScriptedAdd: the config's "mode" says what happens:
good | wrong | partial | flaky | slow | hang | exit | sticky | raise, and for compile():
ok | oor | ptxas | compile_error | value_error | compile_exit. ScriptedOp with the scripted timers: candidates whose
GPU time is scripted and whose host cost is a real sleep, for the finalist re-ranking by objective.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from tritune.tuning.bench import Timing
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

    def __init__(self, log_path: str | None = None, compile_log: str | None = None) -> None:
        self.log_path = log_path  # make_inputs appends one line per call here (it runs in another process)
        self.compile_log = compile_log  # compile appends the config's "i" here (a worker's preload runs it)

    def make_inputs(self, problem: AddProblem, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.log_path is not None:
            mark = os.environ.get("TRITUNE_TEST_MARK")  # what the worker's environment says (test_processes.py)
            with open(self.log_path, "a") as log:
                log.write(f"{os.getpid()} {problem.key()}{' ' + mark if mark else ''}\n")
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
        if self.compile_log is not None:
            with open(self.compile_log, "a") as log:
                log.write(f"{config.get('i')}\n")
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
        if mode == "env":  # says what the compile process's environment holds (test_processes.py)
            raise ValueError(f"TRITUNE_TEST_MARK={os.environ.get('TRITUNE_TEST_MARK')}")
        if mode == "compile_exit":
            os._exit(1)
        time.sleep(float(config.get("sleep", 0.0)))

    def flops(self, problem: AddProblem) -> float:
        return float(problem.n)

    def bytes_moved(self, problem: AddProblem) -> float:
        return 12.0 * problem.n

    def tolerance(self, problem: AddProblem) -> Tolerance:
        return Tolerance(atol=1e-6, rtol=1e-6)


# ---- a fake op whose candidates trade GPU time against host cost, for the finalist re-ranking -------------------


@dataclass(frozen=True)
class OpProblem:
    n: int = 64

    def key(self) -> str:
        return f"op:n={self.n}:float32"


class ScriptedCall:
    """One candidate's launch: `out = x` plus `host_s` of real host cost per call; `gpu_us` is the GPU time a
    scripted timer reports for it (the CPU has no GPU to measure)."""

    def __init__(self, x: torch.Tensor, out: torch.Tensor, gpu_us: float, host_s: float) -> None:
        self.x, self.out, self.gpu_us, self.host_s = x, out, gpu_us, host_s

    def __call__(self) -> None:
        if self.host_s:
            time.sleep(self.host_s)
        self.out.copy_(self.x)


class ScriptedOp:
    """Candidates config["name"] with GPU time config["gpu_us"] and host cost config["host_ms"] per call."""

    name = "scripted_op"

    def __init__(self, candidates: tuple[tuple[str, float, float], ...]) -> None:
        self.candidates = candidates  # (name, gpu_us, host_ms)

    def space(self, problem: OpProblem, device):
        from tritune.tuning.space import SearchSpace

        return SearchSpace({"name": tuple(name for name, _, _ in self.candidates)})

    def make_inputs(self, problem: OpProblem, device: torch.device, seed: int) -> torch.Tensor:
        return (torch.rand(problem.n, generator=torch.Generator().manual_seed(seed)) + 0.5).to(device)

    def reference(self, problem: OpProblem, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.float()

    def alloc_output(self, problem: OpProblem, inputs: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(inputs)

    def launcher(self, problem: OpProblem, inputs: torch.Tensor, config: Config, out: torch.Tensor) -> ScriptedCall:
        gpu_us, host_ms = next((g, h) for name, g, h in self.candidates if name == config["name"])
        return ScriptedCall(inputs, out, gpu_us, host_ms / 1000.0)

    def compile(self, problem: OpProblem, config: Config) -> None:
        pass

    def flops(self, problem: OpProblem) -> float:
        return float(problem.n)

    def bytes_moved(self, problem: OpProblem) -> float:
        return 8.0 * problem.n

    def tolerance(self, problem: OpProblem) -> Tolerance:
        return Tolerance(atol=0.0, rtol=0.0)


def host_job_gpu_time(fn, *, iters: int, warmup: int, flush_l2: bool = True, l2_bytes: int = 0) -> Timing:
    """Stands for time_kernel where the GPU is busy with the timed calls: one call, then the host job a worker left
    for that moment (bench.while_gpu_busy), as the real timer runs it before it synchronizes."""
    from tritune.tuning import bench

    fn()
    bench._run_host_job()
    return Timing(5.0, 5.0, 5.0, iters, "scripted gpu time, host job run")


def scripted_gpu_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True,
                      l2_bytes: int = 0) -> Timing:
    """Stands for time_kernel on a GPU: the candidate's GPU time, host cost hidden (the GPU was parked)."""
    fn()
    return Timing(fn.gpu_us, fn.gpu_us, fn.gpu_us, iters, "scripted gpu time")


def scripted_graph_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True,
                        l2_bytes: int = 0) -> Timing:
    """Stands for time_graph on a GPU: a replay has no host cost, only the kernels' time."""
    fn()
    return Timing(fn.gpu_us, fn.gpu_us, fn.gpu_us, iters, "scripted graph replay")


def scripted_eager_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True,
                        l2_bytes: int = 0) -> Timing:
    """Stands for time_eager on a GPU: max(the scripted host cost, the GPU time), the host cost kept as host_us; no
    sleep (the host cost is scripted, not spent)."""
    fn.out.copy_(fn.x)
    host_us = fn.host_s * 1e6
    t = max(host_us, fn.gpu_us)
    return Timing(t, t, t, iters, "scripted eager", host_us=host_us)


def failing_graph_time(fn: ScriptedCall, *, iters: int, warmup: int, flush_l2: bool = True,
                       l2_bytes: int = 0) -> Timing:
    """A graph capture that fails for every candidate."""
    return Timing(math.nan, math.nan, math.nan, 0, "scripted graph replay", error="capture failed: scripted")
