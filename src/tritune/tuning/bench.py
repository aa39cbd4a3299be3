"""Timing one prepared launch three ways: GPU time (time_kernel), as the user's eager call (time_eager, host
included) and as a CUDA-graph replay (time_graph); perf_counter on CPU.

The method string travels with every timing so a result file says how it was measured.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tritune.knobs import timer_park

CPU_METHOD = "cpu-perf-counter (interpreter: timings meaningless)"
CPU_EAGER_METHOD = "cpu-perf-counter, back-to-back calls (interpreter: timings meaningless)"
CPU_GRAPH_METHOD = "cpu-perf-counter, no CUDA graph: back-to-back calls (interpreter: timings meaningless)"

_SLEEP_CYCLES_PER_S = 2.0e9  # torch.cuda._sleep counts SM clock cycles; ~2 GHz on H100/H200 boost clocks
# (device index, bytes) -> flush buffer; kept for the life of the process so timing never allocates.
_FLUSH_BUFFERS: dict[tuple[int, int], torch.Tensor] = {}
# Seconds this process's GPU timers parked the GPU (the sleep asked for) and spent queueing the timed calls behind
# it, summed: a worker reports each candidate's share, so a tuning run shows whether a busier host lengthens the
# timing loops (the sleep is sized from one call's host cost) or the GPU does (issue 17).
PARK_TOTALS = {"parked": 0.0, "queued": 0.0, "retimed": 0}  # retimed: short parks the GPU caught up with
# Host work to do once while the GPU runs a timing's queued calls, where the host would otherwise wait on the GPU
# (a worker's preload of its likely next candidate: while_gpu_busy).
_WHILE_GPU_BUSY: list[Callable[[], None]] = []


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    max_us: float
    iters: int
    method: str
    error: str = ""  # why it could not be measured (times are then NaN); "" when it was
    samples: tuple[float, ...] = ()  # every timed call's µs, where the timer keeps them (first-pass timers do)
    host_us: float = math.nan  # time_eager: the host cost per call (its figure is max(this, GPU time))

    @property
    def failed(self) -> bool:
        return bool(self.error)


def _of_samples(times_us: Sequence[float], method: str) -> Timing:
    """The Timing of these per-call times, which it keeps."""
    return Timing(statistics.median(times_us), min(times_us), max(times_us), len(times_us), method,
                  samples=tuple(times_us))


def merged(first: Timing, second: Timing) -> Timing:
    """One Timing over both runs' calls (a probe and the rest of a candidate's timing); `second` alone where either
    kept no samples (scripted timers)."""
    if not first.samples or not second.samples or first.method != second.method:
        return second
    return _of_samples(first.samples + second.samples, second.method)


def while_gpu_busy(job: Callable[[], None] | None) -> None:
    """Run `job` once, at the next point where a GPU timing has its calls queued and the host would wait for them;
    None drops a job not yet run. The timings are events on the GPU, so host work there does not change them."""
    _WHILE_GPU_BUSY[:] = [job] if job is not None else []


def _run_host_job() -> None:
    if _WHILE_GPU_BUSY:
        _WHILE_GPU_BUSY.pop()()


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

    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    times_us = _parked_event_times(fn, iters, _flush_buffer(l2_bytes) if flush_l2 else None)
    method = "cuda-events+l2-flush" if flush_l2 else "cuda-events"
    return _of_samples(times_us, method)


# The GPU is parked on a sleep while the host queues the timed calls. A sleep sized to cover the whole queue (1.5 x
# calls x (one call's host cost + 30 us)) asked for 51 s behind 27 s of queueing in a 1-GPU MoE tune (4x H200,
# 2026-11-26): time the GPU spent idle. With the L2 flush before each call the GPU's time per call (the flush alone
# is tens of us) is mostly longer than the host's, so after a short head start the host stays ahead of the GPU.
# The short park (TRITUNE_TIMER_PARK, default "short") tries that first and checks every call: once a call is
# queued whole, the GPU must not have reached its start event yet (a CUDA event query), else something in it may
# have waited on the host. The calls before the first that fails were each queued whole ahead of the GPU, so their
# times are kept; the rest are queued again behind a park twice as long, up to SHORT_PARK_TRIES parks, then behind
# the full park. (Until 2026-11-26's ninth session the first failure re-timed every call behind the full park: on 4
# H200s 755-1288 timings of a MoE tune went back so, against 368 on 1 GPU, issue 17.) Without a flush there is no
# such margin, and the full park is used.
SHORT_PARK_TRIES = 3


def _parked_event_times(fn: Callable[[], None], iters: int, flush: torch.Tensor | None) -> list[float]:
    """µs of each of `iters` calls of `fn` (warm already), each between CUDA events and preceded by zeroing `flush`
    when given; the GPU is parked on a sleep while the host queues the timed calls, so a kernel shorter than its
    own launch overhead is timed back to back (GPU time, as under CUDA graphs) rather than with the host's gaps."""
    t0 = time.perf_counter()
    fn()  # host cost of one call (Python, argument binding, launch), to size the sleep
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    times: list[float] = []
    if flush is not None and timer_park() == "short":
        for attempt in range(SHORT_PARK_TRIES):
            park_s = min(2.0, 2 ** attempt * (2.0 * (host_s + 30e-6) + 50e-6))
            times += _queued_event_times(fn, iters - len(times), flush, park_s, checked=True)
            if len(times) == iters:
                return times
            PARK_TOTALS["retimed"] += 1
    left = iters - len(times)
    return times + _queued_event_times(fn, left, flush, min(2.0, 1.5 * left * (host_s + 30e-6)), checked=False)


def _queued_event_times(fn: Callable[[], None], iters: int, flush: torch.Tensor | None, park_s: float, *,
                        checked: bool, event: Callable[[], Any] | None = None,
                        sleep: Callable[[float], None] | None = None,
                        synchronize: Callable[[], None] | None = None) -> list[float]:
    """Park the GPU `park_s` seconds, queue the timed calls, then µs per call. `checked`: the queue stops at the first
    call whose start event has run by the time the call is queued whole (the GPU caught up with the host, so that call
    may include host gaps), and only the calls before it are returned. `event`, `sleep`, `synchronize`: CUDA's by
    default (tests script them)."""
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    sleep = sleep or (lambda s: torch.cuda._sleep(int(s * _SLEEP_CYCLES_PER_S)))
    synchronize = synchronize or torch.cuda.synchronize
    starts = [event() for _ in range(iters)]
    ends = [event() for _ in range(iters)]
    sleep(park_s)
    t0 = time.perf_counter()
    whole = iters  # calls queued whole ahead of the GPU
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
        if checked and start.query():
            whole = i
            break
    PARK_TOTALS["queued"] += time.perf_counter() - t0
    PARK_TOTALS["parked"] += park_s
    _run_host_job()
    synchronize()
    return [1000.0 * start.elapsed_time(end) for start, end in zip(starts[:whole], ends[:whole], strict=True)]


def _time_cpu(fn: Callable[[], None], iters: int, warmup: int) -> Timing:
    for _ in range(warmup):
        fn()
    times_us = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times_us.append(1e6 * (time.perf_counter() - start))
    return _of_samples(times_us, CPU_METHOD)


def host_cost_us(batch_medians: list[float]) -> float:
    """A call's host cost from the median per-call time of each of several batches: the least of them. Another
    process on the machine only adds time, and it does so a batch at a time: the same MXFP4 decode call measured 33 µs
    in some batches and 60-66 µs in others of one process (H100 host, RESULTS.md twenty-third session), which made
    the tuner's eager objective pick between two kernels on that noise."""
    if not batch_medians:
        raise ValueError("host_cost_us: no batches")
    return min(batch_medians)


def time_eager(fn: Callable[[], None], *, iters: int = 50, warmup: int = 5, batches: int = 5,
               flush_l2: bool = True, l2_bytes: int = 50 * 2**20) -> Timing:
    """Per-call time of `fn` as a user's eager loop sees it, in microseconds: back-to-back calls run at the pace of
    the slower of the host (Python, argument checks, every launch) and the GPU, so the figure is
    max(host cost per call, GPU time per call).

    Both are measured. Host cost: `iters` calls timed one by one with perf_counter while the GPU is parked on a
    sleep, so no launch waits on a full queue; the least of `batches` such batches' medians (`host_cost_us`). GPU
    time: `time_kernel` (each call on a cold L2 when `flush_l2`, as inside a model, where other layers' data evicts
    this one's). Timing back-to-back calls directly would let data that fits in L2 stay warm from call to call,
    which no model sees; flushing between them would add a launch of its own to the host cost being measured.
    Without CUDA (Triton interpreter) the batches are timed with perf_counter; those numbers say nothing about a GPU.
    """
    if iters < 1 or warmup < 0 or batches < 1:
        raise ValueError(f"need iters >= 1, warmup >= 0, batches >= 1, got iters={iters} warmup={warmup} "
                         f"batches={batches}")
    if not torch.cuda.is_available():
        return _time_batches_cpu(fn, iters, warmup, batches, CPU_EAGER_METHOD)
    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    host_samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        torch.cuda.synchronize()
        torch.cuda._sleep(int(min(2.0, 2.0 * iters * (one + 30e-6)) * _SLEEP_CYCLES_PER_S))
        per_call = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            per_call.append(1e6 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        host_samples.append(statistics.median(per_call))
    host = host_cost_us(host_samples)
    gpu = time_kernel(fn, iters=iters, warmup=0, flush_l2=flush_l2, l2_bytes=l2_bytes)
    method = f"max(host cost per call {host:.1f} us, GPU time {gpu.median_us:.1f} us [{gpu.method}])"
    return Timing(max(host, gpu.median_us), max(min(host_samples), gpu.min_us), max(max(host_samples), gpu.max_us),
                  iters * batches, method, host_us=host)


def time_graph(
    fn: Callable[[], None],
    *,
    iters: int = 50,
    warmup: int = 5,
    flush_l2: bool = True,
    l2_bytes: int = 50 * 2**20,
) -> Timing:
    """GPU time of one call of `fn` replayed from a CUDA graph (its kernels back to back, no host launch gaps
    between them), in microseconds; median, min and max over `iters` replays.

    The warm-up calls run on a side stream before capture, as torch requires; one call is then captured with
    torch.cuda.graph and replayed. Each timed replay sits between CUDA events, preceded (when `flush_l2`) by
    zeroing a 4x-L2 buffer, with the GPU parked while the host queues them, as in time_kernel. A call that
    cannot be captured (a host sync, a CPU tensor, an allocation the graph pool refuses...) gives a Timing with
    NaN times and `error` set; it never raises. Without CUDA (Triton interpreter) there is no graph: the calls
    are timed back to back as time_eager does (one batch), so the figure is host wall clock, nothing about a GPU.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    if not torch.cuda.is_available():
        return _time_batches_cpu(fn, iters, warmup, 1, CPU_GRAPH_METHOD)
    method = "cuda-graph replay, cuda-events" + ("+l2-flush" if flush_l2 else "")
    stream = torch.cuda.current_stream()
    graph = None
    try:
        graph, _ = capture_graph(fn, warmup)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # capture is best effort: the candidate itself is judged by its eager runs
        graph = None
        torch.cuda.set_stream(stream)  # torch.cuda.graph leaves its capture stream current when capture_end raises
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky error surfaces again at the worker's next checked run, blamed there
            pass
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return Timing(math.nan, math.nan, math.nan, 0, method,
                      error=f"capture failed: {type(exc).__name__}: {first_line}"[:300])
    try:
        times_us = _parked_event_times(graph.replay, iters, _flush_buffer(l2_bytes) if flush_l2 else None)
    finally:
        graph.reset()  # its memory pool goes back before the next candidate
    return _of_samples(times_us, method)


def capture_graph(fn: Callable[[], object], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a CUDA graph of one call of fn, what the captured call returned), not yet replayed. fn first runs
    max(warmup, 1) times on a side stream, as torch requires before a capture. Raises what the capture raises
    (time_graph, the runtime benchmarks and the GPU tests share this one sequence)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _time_batches_cpu(fn: Callable[[], None], iters: int, warmup: int, batches: int, method: str) -> Timing:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append(1e6 * (time.perf_counter() - start) / iters)
    return Timing(statistics.median(samples), min(samples), max(samples), iters * batches, method)


@dataclass(frozen=True)
class Timers:
    """The three timers a benchmark worker uses. Module-level functions, so the value pickles into workers;
    tests swap in scripted ones to stand for a GPU the CPU does not have."""

    gpu: Callable[..., Timing] = time_kernel  # first pass: ranks every candidate
    eager: Callable[..., Timing] = time_eager  # finalists, objective "eager"
    graph: Callable[..., Timing] = time_graph  # finalists, objective "graph"
