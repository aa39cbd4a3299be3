"""Timing: the CPU path's statistics and call counts for GPU time, eager and graph timing (the CUDA paths run only
where a GPU exists)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tritune.tuning.bench import (
    CPU_EAGER_METHOD,
    CPU_GRAPH_METHOD,
    CPU_METHOD,
    Timing,
    merged,
    time_eager,
    time_graph,
    time_kernel,
)


class Counter:
    def __init__(self, sleep_s: float = 0.0) -> None:
        self.calls = 0
        self.sleep_s = sleep_s

    def __call__(self) -> None:
        self.calls += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the perf_counter path used under the interpreter")
def test_cpu_sleep_stats() -> None:
    timing = time_kernel(Counter(sleep_s=0.002), iters=7, warmup=1)
    assert timing.method == CPU_METHOD and timing.iters == 7
    assert 0 < timing.min_us <= timing.median_us <= timing.max_us
    assert timing.min_us >= 2000.0  # sleep never returns early
    assert timing.median_us < 200_000.0


@pytest.mark.parametrize("iters,warmup", [(1, 0), (5, 3), (50, 5)])
def test_call_counts(iters: int, warmup: int) -> None:
    fn = Counter()
    timing = time_kernel(fn, iters=iters, warmup=warmup, flush_l2=False)
    # On a GPU the timer warms up at least once and makes one more call to size the sleep that parks the GPU.
    want = iters + warmup if not torch.cuda.is_available() else iters + max(warmup, 1) + 1
    assert fn.calls == want and timing.iters == iters


def test_bad_counts() -> None:
    with pytest.raises(ValueError):
        time_kernel(Counter(), iters=0)
    with pytest.raises(ValueError):
        time_kernel(Counter(), warmup=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the CUDA-event timer")
def test_cuda_events() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    timing = time_kernel(lambda: torch.mm(x, x), iters=10, warmup=2)
    assert timing.method == "cuda-events+l2-flush"
    assert 0 < timing.min_us <= timing.median_us <= timing.max_us
    assert time_kernel(lambda: torch.mm(x, x), iters=3, flush_l2=False).method == "cuda-events"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the perf_counter path used under the interpreter")
def test_cpu_eager_is_per_call_over_back_to_back_batches() -> None:
    fn = Counter(sleep_s=0.001)
    timing = time_eager(fn, iters=4, warmup=2, batches=3)
    assert fn.calls == 2 + 3 * 4 and timing.iters == 12 and timing.method == CPU_EAGER_METHOD
    assert 1000.0 <= timing.min_us <= timing.median_us <= timing.max_us < 200_000.0  # per call, not per batch
    assert not timing.failed and timing.error == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: without CUDA there is no graph to replay")
def test_cpu_graph_is_eager_calls_and_says_so() -> None:
    fn = Counter(sleep_s=0.001)
    timing = time_graph(fn, iters=5, warmup=1)
    assert fn.calls == 1 + 5 and timing.iters == 5 and timing.method == CPU_GRAPH_METHOD
    assert 1000.0 <= timing.median_us < 200_000.0 and math.isfinite(timing.median_us)
    assert not timing.failed


def test_eager_and_graph_times_are_finite_and_positive() -> None:
    x = torch.randn(64, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    for timing in (time_eager(lambda: torch.mm(x, x), iters=3, warmup=1),
                   time_graph(lambda: torch.mm(x, x), iters=3, warmup=1)):
        assert 0 < timing.min_us <= timing.median_us <= timing.max_us < math.inf


def test_eager_and_graph_bad_counts() -> None:
    for bad in ({"iters": 0}, {"warmup": -1}):
        with pytest.raises(ValueError):
            time_eager(Counter(), **bad)
        with pytest.raises(ValueError):
            time_graph(Counter(), **bad)
    with pytest.raises(ValueError):
        time_eager(Counter(), batches=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: CUDA-graph capture")
def test_graph_capture_failure_is_a_failed_timing_not_a_crash() -> None:
    x = torch.randn(1024, device="cuda")
    timing = time_graph(lambda: x.sum().item(), iters=3, warmup=1)  # a host sync cannot be captured
    assert timing.failed and timing.error.startswith("capture failed") and math.isnan(timing.median_us)
    stream = torch.cuda.current_stream()
    ok = time_graph(lambda: torch.mm(x[:32, None], x[None, :32]), iters=3, warmup=1)  # the process still works
    assert not ok.failed and ok.median_us > 0 and torch.cuda.current_stream() == stream


def test_first_pass_timings_keep_their_samples_and_merge() -> None:
    a = time_kernel(lambda: None, iters=3, warmup=0)
    b = time_kernel(lambda: time.sleep(0.002), iters=4, warmup=0)
    assert len(a.samples) == 3 and len(b.samples) == 4 and a.median_us == sorted(a.samples)[1]
    both = merged(a, b)
    assert both.iters == 7 and both.samples == a.samples + b.samples
    assert both.min_us == min(a.samples) and both.max_us == max(b.samples)
    scripted = Timing(5.0, 5.0, 5.0, 4, a.method)  # a timer that keeps no samples: the second run alone
    assert merged(a, scripted) is scripted and merged(scripted, b) is b
