"""Timing: the CPU path's statistics and call counts (the CUDA path runs only where a GPU exists)."""

from __future__ import annotations

import time

import pytest
import torch

from tritune.tuning.bench import CPU_METHOD, time_kernel


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
    assert fn.calls == iters + warmup and timing.iters == iters


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
