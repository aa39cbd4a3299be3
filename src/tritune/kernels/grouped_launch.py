"""Bound launches for the grouped-GEMM kernels (forward, dX, dW and the scheduled dW's four) and the training MLP's
other kernels (routing sort, SwiGLU, top-k sums): a call pays a plan lookup and a C launch instead of Triton's
per-call JIT dispatch and, for the GEMMs, three TMA descriptors built and encoded in Python.

Why: the training MLP is host-bound at small token counts. On the H100 each grouped GEMM cost about 120 µs of host
time a call, so a Qwen3-30B-A3B training step spent 2.2 ms in Python at 16 tokens, and eager ran 2× its CUDA graph
(RESULTS.md, thirteenth session). The inference ops got past the same cost with `kernels/launch.py`; this is the
grouped kernels' way onto it.

A plan binds one kernel for one grid and one specialization. Its key holds everything the binary and the launch
depend on: the grid, warps and stages, every argument after the pointers (integers and constexprs, by value), and
for each pointer its dtype, device and 16-byte alignment, or for each TMA operand its dtype, device, view shape and
block. Descriptors are kept by address in each plan (`DescriptorCache`), since a plan fixes all else they hold.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.launch import BoundKernel, DescriptorCache

_MAX_PLANS = 1024  # plans kept before the cache starts over (a training run has a few shapes; a sweep has many)


class Desc:
    """A TMA operand: `tensor` viewed as the contiguous `shape` [rows, cols], loaded or stored in `block` tiles."""

    __slots__ = ("tensor", "shape", "block")

    def __init__(self, tensor: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> None:
        self.tensor, self.shape, self.block = tensor, tuple(shape), tuple(block)

    def descriptor(self) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(self.tensor.view(self.shape), list(self.block))


def _kind(value: torch.Tensor | Desc) -> tuple:
    if isinstance(value, Desc):
        t = value.tensor
        return ("desc", t.dtype, t.device.index, value.shape, value.block)
    return ("ptr", value.dtype, value.device.index, value.data_ptr() % 16 == 0)


class _Plan:
    __slots__ = ("bound", "caches")

    def __init__(self, fn, grid: tuple[int, ...], head: list, tail: tuple, num_warps: int, num_stages: int) -> None:
        args = [h.descriptor() if isinstance(h, Desc) else h for h in head]
        self.bound = BoundKernel(fn, grid, (*args, *tail), varying=len(head), num_warps=num_warps,
                                 num_stages=num_stages)
        caches, nth = [], 0
        for h in head:
            if not isinstance(h, Desc):
                caches.append(None)
                continue
            if h.tensor.is_cuda:
                caches.append(DescriptorCache(h.shape, (h.shape[1], 1), h.tensor.dtype, h.block,
                                              encode=partial(self.bound.encode, nth=nth)))
            else:  # the interpreter takes descriptor objects
                caches.append(False)
            nth += 1
        self.caches = tuple(caches)

    def launch(self, head: list) -> None:
        args = []
        for h, cache in zip(head, self.caches, strict=True):
            if cache is None:
                args.append(h)
            elif cache is False:
                args.append(h.descriptor())
            else:
                args.extend(cache.get(h.tensor.data_ptr()))
        self.bound.launch(*args)


_PLANS: dict[tuple, _Plan] = {}
_PARAMETERS: dict[object, tuple[str, ...]] = {}


def _parameters(fn) -> tuple[str, ...]:
    names = _PARAMETERS.get(fn)
    if names is None:
        names = _PARAMETERS[fn] = tuple(inspect.signature(getattr(fn, "fn", fn)).parameters)
    return names


def launch(fn, grid: tuple[int, ...], params: dict, *, num_warps: int, num_stages: int) -> None:
    """Launch `fn` (a grouped kernel whose pointer and TMA parameters come first) over `grid` with every parameter
    by name: tensors for pointers, `Desc` for TMA operands, then integers and constexprs."""
    values = [params[name] for name in _parameters(fn)]
    varying = next(i for i, v in enumerate(values) if not isinstance(v, torch.Tensor | Desc))
    head, tail = values[:varying], tuple(values[varying:])
    key = (fn, grid, num_warps, num_stages, tail, tuple(_kind(h) for h in head))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(fn, grid, head, tail, num_warps, num_stages)
    plan.launch(head)


def plans_kept() -> int:
    """How many bound plans are kept (tests pin that a repeated call binds once)."""
    return len(_PLANS)
