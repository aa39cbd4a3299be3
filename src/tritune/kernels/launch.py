"""Bound launches: a Triton kernel compiled once for one specialization and then launched through its C launcher,
so a call pays neither Triton's per-call JIT dispatch (argument binding, specialization, cache key, option
parsing) nor a pointer lookup per tensor. Also the one-allocation scratch layout the multi-launch ops share.

Whoever keeps a `BoundKernel` owns the promise that later calls match the specialization it was bound with:
the same dtypes, the same integer arguments (or ones of the same class: equal to 1, divisible by 16, other) and
pointers of the same 16-byte alignment. The ops keep that promise by keying their plans on every one of those.
Under Triton's interpreter (no GPU) a bound kernel simply launches through Triton each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from triton.runtime.jit import JITFunction

__all__ = ["BoundKernel", "Workspace", "align_bits", "launch_counts", "reset_launch_counts"]

# Per kernel name, how many launches went through bound kernels (CPU tests pin launches per op call).
_COUNTS: dict[str, int] = {}
_COUNTING = [False]


def launch_counts() -> dict[str, int]:
    """Launches per kernel name since reset_launch_counts(counting=True); empty while counting is off."""
    return dict(_COUNTS)


def reset_launch_counts(counting: bool = True) -> None:
    """Zero the launch counters and switch counting on or off (off by default: it costs a dict update)."""
    _COUNTS.clear()
    _COUNTING[0] = counting


def _hooks_installed() -> bool:
    """True when a profiler (e.g. proton) asked Triton to call hooks around launches: then we launch through the JIT,
    which calls them, rather than hide our launches from it."""
    try:
        from triton import knobs

        return knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None
    except (ImportError, AttributeError):  # Triton < 3.4 keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel

        return getattr(CompiledKernel, "launch_enter_hook", None) is not None


def align_bits(*tensors: torch.Tensor | None) -> int:
    """One bit per tensor: set when its address is not 16-byte aligned (Triton specializes pointers on that)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is not None and t.data_ptr() & 15:
            bits |= 1 << i
    return bits


class BoundKernel:
    """A kernel bound to one grid and one specialization: `bound(*args)` launches it on the current stream.

    `args` at binding are every parameter of the kernel in order (constexprs included, tensors for pointers); a
    call passes the same list with, for each pointer, a tensor or its address as an int.
    """

    __slots__ = ("launch", "name")

    def __init__(self, fn, grid: Sequence[int], args: Sequence, *, num_warps: int, num_stages: int) -> None:
        grid3 = (tuple(int(g) for g in grid) + (1, 1))[:3]
        self.name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")
        if not isinstance(fn, JITFunction) or _hooks_installed():
            self.launch = _through_triton(fn, grid3, num_warps, num_stages, self.name)
            return
        compiled = fn.warmup(*args, grid=grid3, num_warps=num_warps, num_stages=num_stages)
        run = compiled.run  # loads the binary on the current device (and checks its resources) once
        function, metadata = compiled.function, compiled.packed_metadata
        gx, gy, gz = grid3
        device = torch.cuda.current_device()
        stream_of = torch._C._cuda_getCurrentRawStream
        name = self.name

        def launch(*call_args) -> None:
            if _COUNTING[0]:
                _COUNTS[name] = _COUNTS.get(name, 0) + 1
            run(gx, gy, gz, stream_of(device), function, metadata, None, None, None, *call_args)

        self.launch = launch

    def __call__(self, *args) -> None:
        self.launch(*args)


def _through_triton(fn, grid3: tuple[int, int, int], num_warps: int, num_stages: int, name: str):
    launcher = fn[grid3]

    def launch(*call_args) -> None:
        if _COUNTING[0]:
            _COUNTS[name] = _COUNTS.get(name, 0) + 1
        launcher(*call_args, num_warps=num_warps, num_stages=num_stages)

    return launch


_ALIGN = 256  # bytes: every piece starts on a 256-byte boundary (TMA wants 16, vector loads 16)


@dataclass(frozen=True)
class Workspace:
    """The scratch buffers of one op call laid out in one allocation: `allocate` returns the pieces.

    Each piece is (dtype, numel). On a GPU the pieces come back as addresses (ints, which Triton's launcher takes
    for pointers); under the interpreter as flat tensors, which it needs. Either way a call costs one allocation,
    taken from torch's caching allocator on the current stream, so it is safe across streams and inside CUDA
    graph capture (the graph's private pool then owns it).
    """

    pieces: tuple[tuple[torch.dtype, int], ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        offs, at = [], 0
        for dtype, numel in self.pieces:
            offs.append(at)
            at += -(-max(numel, 1) * dtype.itemsize // _ALIGN) * _ALIGN
        return (*offs, at)

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, list]:
        """(the buffer, which the caller keeps alive until its launches are queued; the pieces in order)."""
        offsets = self.offsets
        buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
        if device.type == "cuda":
            base = buffer.data_ptr()
            return buffer, [base + off for off in offsets[:-1]]
        return buffer, [buffer[off:off + max(numel, 1) * dtype.itemsize].view(dtype)
                        for (dtype, numel), off in zip(self.pieces, offsets, strict=False)]
