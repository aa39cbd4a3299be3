"""Compiling for a GPU without touching it: what a compile process answers Triton with instead of a CUDA context.

A JIT warm-up asks Triton's driver for the current device, stream and target, and Triton's CUDA driver answers
through torch.cuda: every compile process of the pool then initialised CUDA and made a context on the first
visible GPU. On 4 H200s with 64 compile processes the first candidate reached a GPU worker 30 s after the tune
started (15 s with 2 GPUs visible), and 64 contexts sat on GPU 0 (issue 17); hiding the GPUs took it to 10.5 s.
A process that calls `compile_without_gpu(target)` first hides the GPUs from CUDA and answers Triton from `target`;
the binaries land in Triton's cache under the key the real launch computes on that GPU (the key holds the target,
which is the same `GPUTarget`).

Imports neither torch nor a kernel module at the top: the AOT compiler's spawned workers load this before they
decide on Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CompileTarget:
    """The GPU binaries are for: Triton's backend and arch (90 for H100/H200), its warp size, and the SM count that
    persistent kernels compile in (their NUM_SMS constexpr)."""

    backend: str
    arch: int
    warp_size: int = 32
    sm_count: int | None = None  # None: a kernel needing it asks the GPU (the AOT compiler never does)


class TargetDriver:
    """The part of Triton's driver a compile consults, answering for a target instead of a device."""

    def __init__(self, target: CompileTarget) -> None:
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget(target.backend, target.arch, target.warp_size)

    def get_current_target(self):
        return self._target

    def map_python_to_cpp_type(self, ty: str) -> str:
        """Triton's mapping, except fp32 scalars: since Triton 3.4 its AOT launcher declares them `double` and
        hands cuLaunchKernel the 8-byte value while the cubin reads 4 bytes, so the kernel sees garbage (a
        softmax scale of 0.125 arrives as 0). Declared `float`, launcher and cubin agree."""
        from triton.backends.nvidia.driver import ty_to_cpp

        return "float" if ty in ("fp32", "f32") else ty_to_cpp(ty)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0  # a warm-up compiles and never launches


_PROCESS_TARGET: CompileTarget | None = None  # what `compiling_for` / `compile_without_gpu` set in this process


@contextlib.contextmanager
def compiling_for(target: CompileTarget) -> Iterator[None]:
    """Make Triton compile for `target` whether or not this machine has a GPU (and persistent kernels take its SM
    count); restores Triton's driver after."""
    global _PROCESS_TARGET
    from triton.runtime.driver import driver

    saved = driver._active, _PROCESS_TARGET
    driver._active, _PROCESS_TARGET = TargetDriver(target), target
    try:
        yield
    finally:
        driver._active, _PROCESS_TARGET = saved


def compile_without_gpu(target: CompileTarget) -> None:
    """For the rest of this (compile) process: no GPU visible to CUDA (set before anything initialises it) and
    Triton compiling for `target`. A compile that still needs the GPU fails as a compile error instead of making a
    context."""
    global _PROCESS_TARGET
    from triton.runtime.driver import driver

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    driver._active, _PROCESS_TARGET = TargetDriver(target), target


def process_sm_count() -> int | None:
    """The SM count this process compiles for (`compiling_for`), None where it has its GPU to ask."""
    return _PROCESS_TARGET.sm_count if _PROCESS_TARGET is not None else None


def sm_count_for(device) -> int | None:
    """The SM count kernels for `device` (a torch.device) are built for: this process's compile target's, else the
    GPU's; None where there is neither (a CPU device, no GPU and no target)."""
    count = process_sm_count()
    if count is None and device.type == "cuda":
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def compile_only_process() -> bool:
    """True where this process compiles for a target instead of running on a GPU (`compiling_for`,
    `compile_without_gpu`): a kernel bound here is compiled, never loaded or launched."""
    return _PROCESS_TARGET is not None
