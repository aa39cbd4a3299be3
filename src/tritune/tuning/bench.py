"""Timing one prepared launch: CUDA events around each call with an L2 flush in between, or perf_counter on CPU.

The method string travels with every timing so a result file says how it was measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CPU_METHOD = "cpu-perf-counter (interpreter: timings meaningless)"

_SLEEP_CYCLES_PER_S = 2.0e9  # torch.cuda._sleep counts SM clock cycles; ~2 GHz on H100/H200 boost clocks
# (device index, bytes) -> flush buffer; kept for the life of the process so timing never allocates.
_FLUSH_BUFFERS: dict[tuple[int, int], torch.Tensor] = {}


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    max_us: float
    iters: int
    method: str


def _flush_buffer(l2_bytes: int) -> torch.Tensor:
    """An int8 buffer of 4x the L2 size on the current device, so zeroing it evicts the kernel's data."""
    key = (torch.cuda.current_device(), 4 * l2_bytes)
    buffer = _FLUSH_BUFFERS.get(key)
    if buffer is None:
        buffer = _FLUSH_BUFFERS[key] = torch.empty(key[1], dtype=torch.int8, device="cuda")
    return buffer


def time_kernel(
    fn: Callable[[], None],
    *,
    iters: int = 50,
    warmup: int = 5,
    flush_l2: bool = True,
    l2_bytes: int = 50 * 2**20,
) -> Timing:
    """Call `fn` `warmup` times untimed, then `iters` times timed; times are per call, in microseconds.

    On CUDA each timed call sits between a start and an end event on the current stream, preceded (when
    `flush_l2`) by zeroing a 4x-L2 buffer outside the events, so every call starts with a cold L2 as it
    would inside a model; the host synchronizes once at the end, so launches queue back to back. Pass the
    device's L2 size (DeviceInfo.l2_bytes) as `l2_bytes`. Without CUDA (Triton interpreter) each call is
    timed with perf_counter; those numbers say nothing about GPU speed.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    if not torch.cuda.is_available():
        return _time_cpu(fn, iters, warmup)

    flush = _flush_buffer(l2_bytes) if flush_l2 else None
    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    # Host cost of one call (Python, argument binding, launch) once warm.
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # Park the GPU while the host queues every timed call, so a kernel shorter than its own launch overhead is
    # timed back to back (GPU time, as under CUDA graphs) rather than with the host's gaps inside the events.
    torch.cuda._sleep(int(min(2.0, 1.5 * iters * (host_s + 30e-6)) * _SLEEP_CYCLES_PER_S))
    for start, end in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times_us = [1000.0 * start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    method = "cuda-events+l2-flush" if flush_l2 else "cuda-events"
    return Timing(statistics.median(times_us), min(times_us), max(times_us), iters, method)


def _time_cpu(fn: Callable[[], None], iters: int, warmup: int) -> Timing:
    for _ in range(warmup):
        fn()
    times_us = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times_us.append(1e6 * (time.perf_counter() - start))
    return Timing(statistics.median(times_us), min(times_us), max(times_us), iters, CPU_METHOD)
