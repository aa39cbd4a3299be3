"""Bound launches: a Triton kernel compiled once for one specialization and then launched through its C launcher,
so a call pays neither Triton's per-call JIT dispatch (argument binding, specialization, cache key, option
parsing) nor a pointer lookup per tensor. Also the one-allocation scratch layout the multi-launch ops share.

Whoever keeps a `BoundKernel` owns the promise that later calls match the specialization it was bound with:
the same dtypes, the same integer arguments (or ones of the same class: equal to 1, divisible by 16, other) and
pointers of the same 16-byte alignment. The ops keep that promise by keying their plans on every one of those.
Under Triton's interpreter (no GPU) a bound kernel simply launches through Triton each time.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from triton.runtime.jit import JITFunction

from tritune.compile_target import compile_only_process

__all__ = ["BoundKernel", "DescriptorCache", "Workspace", "launch_counts", "release_scratch", "reset_launch_counts"]

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


def _launch_hooks() -> tuple[object, object] | None:
    """Triton's launch hooks when a profiler (e.g. proton) installed some, else None: with hooks, a bound launch
    passes them and their launch metadata, as Triton's own launch does, rather than hide from the profiler."""
    try:
        from triton import knobs

        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except (ImportError, AttributeError):  # Triton < 3.4 keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel

        enter, leave = (getattr(CompiledKernel, "launch_enter_hook", None),
                        getattr(CompiledKernel, "launch_exit_hook", None))

    def empty(hook) -> bool:  # Triton >= 3.5 always holds a HookChain, empty unless a profiler added calls
        return hook is None or (hasattr(hook, "calls") and not hook.calls)

    return None if empty(enter) and empty(leave) else (enter, leave)


# The one launcher protocol we call past its Python wrapper (Triton 3.5-3.6's CudaLauncher): the wrapper only
# allocates scratch (none for kernels that need none) and forwards. Matched on its source text, so another Triton
# whose wrapper does anything else keeps the wrapper.
_KNOWN_WRAPPER = ("def __call__(self, gridX, gridY, gridZ, stream, function, *args):",
                  "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
                  "global_scratch, profile_scratch, *args)")
_WRAPPER_KNOWN: dict[type, bool] = {}


def _direct_launch(run):
    """The C launch function behind a Triton launcher when calling it directly is exactly what the launcher's
    `__call__` would do (known protocol, no scratch to allocate); else None."""
    cls = type(run)
    if cls not in _WRAPPER_KNOWN:
        try:
            import inspect

            text = " ".join(inspect.getsource(cls.__call__).split())
            _WRAPPER_KNOWN[cls] = all(part in text for part in _KNOWN_WRAPPER)
        except (OSError, TypeError):
            _WRAPPER_KNOWN[cls] = False
    if not _WRAPPER_KNOWN[cls]:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return getattr(run, "launch", None)


def _no_gpu_here(name: str) -> Callable[..., None]:
    def launch(*_head) -> None:
        raise RuntimeError(f"{name}: bound in a compile-only process (compile_target): compiled, not launchable")
    return launch


class BoundKernel:
    """A kernel bound to one grid and one specialization: `bound.launch(*pointers)` launches it on the current stream
    (`bound(*pointers)` too, one Python call more: hot paths call `launch`).

    `args` at binding are every parameter of the kernel in order (constexprs included; tensors, or dtypes for
    buffers of a workspace, for pointers). The first `varying` of them change per call (the pointers, which every
    kernel here takes first); the rest are fixed at binding. A call passes the varying ones: tensors, or addresses.
    `launch_pdl`: launched as a programmatic dependent of the previous kernel (kernels/pdl.py; the kernel must wait
    first). `maxnreg`: the registers a thread may hold (ptxas' cap; None leaves it to ptxas), what decides how many
    programs share an SM.
    """

    __slots__ = ("compiled", "encode", "grid", "launch", "name")

    def __init__(self, fn, grid: Sequence[int], args: Sequence, *, varying: int, num_warps: int,
                 num_stages: int, launch_pdl: bool = False, maxnreg: int | None = None) -> None:
        grid3 = (tuple(int(g) for g in grid) + (1, 1))[:3]
        self.grid = grid3  # what every launch covers (tests read it)
        self.name = name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")
        tail = tuple(args[varying:])
        self.encode = _as_is
        if not isinstance(fn, JITFunction):  # Triton's interpreter
            self.launch = _through_triton(fn, grid3, tail, num_warps, num_stages, name)
            return
        options = {"launch_pdl": True} if launch_pdl else {}  # the PDL launch attribute (kernels/pdl.py)
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        compiled = fn.warmup(*args, grid=grid3, num_warps=num_warps, num_stages=num_stages, **options)
        if compile_only_process():  # the compile pool binding what a GPU worker will bind: the binary is cached now
            self.launch = _no_gpu_here(name)
            return
        self.compiled = compiled  # probes read its registers and spills (n_regs, n_spills)
        run = compiled.run  # loads the binary on the current device (and checks its resources) once
        function, metadata = compiled.function, compiled.packed_metadata
        gx, gy, gz = grid3
        device = torch.cuda.current_device()
        stream_of = torch._C._cuda_getCurrentRawStream
        hooks = _launch_hooks()
        direct = _direct_launch(run) if hooks is None else None

        if direct is not None:
            coop, pdl = run.launch_cooperative_grid, run.launch_pdl
            raw = _unwrap_descriptors(direct)
            if raw is not None:
                direct, self.encode = raw

            def launch(*head) -> None:
                if _COUNTING[0]:
                    _COUNTS[name] = _COUNTS.get(name, 0) + 1
                direct(gx, gy, gz, stream_of(device), function, coop, pdl, None, None, metadata, None, None, None,
                       *head, *tail)
        elif hooks is None:
            def launch(*head) -> None:
                if _COUNTING[0]:
                    _COUNTS[name] = _COUNTS.get(name, 0) + 1
                run(gx, gy, gz, stream_of(device), function, metadata, None, None, None, *head, *tail)
        else:
            enter, leave = hooks

            def launch(*head) -> None:
                if _COUNTING[0]:
                    _COUNTS[name] = _COUNTS.get(name, 0) + 1
                stream = stream_of(device)
                call_args = (*head, *tail)
                run(gx, gy, gz, stream, function, metadata, compiled.launch_metadata(grid3, stream, *call_args),
                    enter, leave, *call_args)

        self.launch = launch

    def __call__(self, *head) -> None:
        self.launch(*head)


def _as_is(desc, nth: int = 0) -> tuple:
    return (desc,)


# Triton 3.5-3.6 wrap the C launch of a kernel with descriptor parameters in `inner`, which loops over every argument
# in Python and encodes each descriptor's tensor map (cuTensorMapEncodeTiled) on every launch. Matched on its source
# text like the launcher's `__call__`.
_KNOWN_DESC_WRAPPER = ("final_args = list(args[:_BASE_ARGS_FORMAT_LEN])",
                       "final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))",
                       "return launcher(*final_args)")


def _unwrap_descriptors(run_launch):
    """(the C launch function under Triton's descriptor wrapper, an `encode(desc, nth)` giving the arguments that
    wrapper would pass for the kernel's nth descriptor), when the wrapper is the known one; else None."""
    code = getattr(run_launch, "__code__", None)
    if code is None or run_launch.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in run_launch.__closure__), strict=True))
    if not {"launcher", "tensordesc_meta"} <= cells.keys():
        return None
    try:
        import inspect

        text = " ".join(inspect.getsource(run_launch).split())
    except (OSError, TypeError):
        return None
    module = inspect.getmodule(run_launch)
    make = getattr(module, "make_tensordesc_arg", None)
    if (not all(part in text for part in _KNOWN_DESC_WRAPPER) or make is None
            or getattr(module, "_BASE_ARGS_FORMAT_LEN", None) != 13):
        return None
    meta = cells["tensordesc_meta"]

    def encode(desc, nth: int = 0) -> tuple:
        return tuple(make(desc, meta[nth] if meta else None))

    return cells["launcher"], encode


def _through_triton(fn, grid3: tuple[int, int, int], tail: tuple, num_warps: int, num_stages: int, name: str):
    launcher = fn[grid3]

    def launch(*head) -> None:
        if _COUNTING[0]:
            _COUNTS[name] = _COUNTS.get(name, 0) + 1
        launcher(*head, *tail, num_warps=num_warps, num_stages=num_stages)

    return launch


_ALIGN = 256  # bytes: every piece starts on a 256-byte boundary (TMA wants 16, vector loads 16)


class _Address:
    """What a TMA descriptor needs of its base on the host: the address and the element type (no reference to the
    tensor, so a cached descriptor never keeps memory alive)."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """The element strides of a contiguous tensor of `shape` (a TMA view's, whatever its rank)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


class DescriptorCache:
    """Launch arguments of one plan's TMA operand, by address: `get(ptr)` is `encode(descriptor)` (a
    `BoundKernel.encode`: the encoded tensor map with its shape and strides on Triton 3.5-3.6, else the descriptor).
    Both are pure functions of (address, shape, strides, dtype, block), and a plan fixes all but the address, so a
    cached entry is right whatever tensor now lives at that address; weights (the same few addresses every call),
    and activations from torch's caching allocator, then cost a dict lookup instead of a descriptor's construction,
    checks and encoding. At most `size` addresses are kept."""

    __slots__ = ("shape", "strides", "dtype", "block", "size", "encode", "_by_ptr")

    def __init__(self, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, block: Sequence[int],
                 size: int = 512, encode=_as_is) -> None:
        self.shape, self.strides, self.dtype, self.block = list(shape), list(strides), dtype, list(block)
        self.size, self.encode = size, encode
        self._by_ptr: dict[int, tuple] = {}

    def get(self, ptr: int) -> tuple:
        args = self._by_ptr.get(ptr)
        if args is None:
            from triton.tools.tensor_descriptor import TensorDescriptor

            if len(self._by_ptr) >= self.size:
                self._by_ptr.clear()
            args = self._by_ptr[ptr] = self.encode(TensorDescriptor(_Address(ptr, self.dtype), self.shape,
                                                                    self.strides, self.block))
        return args


_SCRATCH_CACHE_MAX = 64 * 2**20  # bytes: smaller scratch is kept per (device, stream, thread) and reused
_SCRATCH: dict[tuple[int, int, int], torch.Tensor] = {}


class Workspace:
    """The scratch buffers of one op call laid out in one buffer: `allocate` returns the pieces.

    Each piece is (dtype, numel). On a GPU the pieces come back as addresses (ints, which Triton's launcher takes
    for pointers); under the interpreter as flat tensors, which it needs.

    On a GPU a buffer of at most 64 MB is kept per (device, stream, thread) and reused by the next call there: work
    on one stream runs in order, so a call's scratch is never overwritten while an earlier call of that stream still
    reads it, and two threads or streams never share one. While a CUDA graph is being captured every call takes a
    fresh buffer from the graph's pool instead, so a graph never shares scratch with eager calls. Larger scratch
    (large batches, where the GPU time dwarfs an allocation) is allocated per call.
    """

    __slots__ = ("pieces", "offsets", "nbytes", "_last")

    def __init__(self, pieces: tuple[tuple[torch.dtype, int], ...]) -> None:
        self.pieces = tuple(pieces)
        # (a weak reference to the kept buffer last used, its pieces): weak, so a plan never keeps scratch alive
        self._last: tuple[weakref.ref, list[int]] | None = None
        offs, at = [], 0
        for dtype, numel in self.pieces:
            offs.append(at)
            at += -(-max(numel, 1) * dtype.itemsize // _ALIGN) * _ALIGN
        self.offsets, self.nbytes = tuple(offs), at

    def last_piece(self, index: int) -> torch.Tensor | None:
        """Piece `index` of the kept buffer the last call used (a flat view, valid until the next call of its stream
        and thread reuses the buffer); None when no call kept one (the interpreter, scratch past the kept size)."""
        last = self._last[0]() if self._last is not None else None
        return None if last is None else self._piece(last, index)

    def _piece(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        dtype, numel = self.pieces[index]
        at = self.offsets[index]
        return buffer[at:at + max(numel, 1) * dtype.itemsize].view(dtype)

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, list]:
        """(the buffer, which the caller keeps alive until its launches are queued; the pieces in order)."""
        if device.type != "cuda":
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            return buffer, [self._piece(buffer, i) for i in range(len(self.pieces))]
        buffer = None
        if self.nbytes <= _SCRATCH_CACHE_MAX and not torch.cuda.is_current_stream_capturing():
            index = device.index if device.index is not None else torch.cuda.current_device()
            key = (index, torch._C._cuda_getCurrentRawStream(index), threading.get_ident())
            buffer = _SCRATCH.get(key)
            last = self._last
            if last is not None and buffer is not None and last[0]() is buffer:  # the pieces of last call
                return buffer, last[1]
            if buffer is None or buffer.numel() < self.nbytes:
                buffer = _SCRATCH[key] = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            base = buffer.data_ptr()
            self._last = (weakref.ref(buffer), [base + off for off in self.offsets])
            return buffer, self._last[1]
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        base = buffer.data_ptr()
        return buffer, [base + off for off in self.offsets]


def release_scratch() -> None:
    """Drop the kept scratch buffers (they return to torch's caching allocator)."""
    _SCRATCH.clear()
