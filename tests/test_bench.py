"""Timing: the CPU path's statistics and call counts for GPU time, eager and graph timing (the CUDA paths run only
where a GPU exists)."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

from tritune.tuning.bench import (
    CPU_EAGER_METHOD,
    CPU_GRAPH_METHOD,
    CPU_METHOD,
    Timing,
    host_cost_us,
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


def test_host_cost_is_the_least_batch_median() -> None:
    """Interference from other processes only adds host time, a batch at a time: the least batch is the call's."""
    assert host_cost_us([66.4, 33.0, 60.1, 34.7, 65.5]) == 33.0
    assert host_cost_us([41.0]) == 41.0
    with pytest.raises(ValueError, match="no batches"):
        host_cost_us([])


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
    # the union's extremes (on a GPU both calls time empty event pairs, so which run holds them is chance)
    assert both.min_us == min(a.samples + b.samples) and both.max_us == max(a.samples + b.samples)
    scripted = Timing(5.0, 5.0, 5.0, 4, a.method)  # a timer that keeps no samples: the second run alone
    assert merged(a, scripted) is scripted and merged(scripted, b) is b


class _ScriptedEvent:
    """A CUDA event stand-in: `query()` says whether the GPU has run it (scripted), elapsed_time 2 ms to any end."""

    def __init__(self, log: list, reached: bool) -> None:
        self.log, self.reached = log, reached

    def record(self) -> None:
        self.log.append("record")

    def query(self) -> bool:
        return self.reached

    def elapsed_time(self, end: _ScriptedEvent) -> float:
        return 2.0


def _scripted(reached_at: int | None):
    """(event factory, log): start events from number `reached_at` on have been reached by the GPU when queried."""
    log: list = []
    made = [0]

    def event():
        made[0] += 1
        index = made[0] - 1  # starts are made first, then ends
        return _ScriptedEvent(log, reached_at is not None and index >= reached_at)

    return event, log


def test_short_park_times_every_call_while_the_host_stays_ahead() -> None:
    """bench._queued_event_times with scripted events: with the check on and no start event run by the time its call
    is queued, every call is timed; the park and queueing seconds land in PARK_TOTALS."""
    from tritune.tuning import bench

    event, log = _scripted(None)
    fn, slept, synced = Counter(), [], []
    parked0 = bench.PARK_TOTALS["parked"]
    times = bench._queued_event_times(fn, 4, None, 0.001, checked=True, event=event, sleep=slept.append,
                                      synchronize=lambda: synced.append(1))
    assert times == [2000.0] * 4 and fn.calls == 4 and slept == [0.001] and synced == [1]
    assert bench.PARK_TOTALS["parked"] == pytest.approx(parked0 + 0.001) and log.count("record") == 8


def test_short_park_stops_at_the_first_call_the_gpu_caught_up_with() -> None:
    """A start event already run when its call is queued whole: that call may hold host gaps, so the queue stops there
    and nothing is returned (the caller times again with the full park); unchecked, the same is timed as it is."""
    from tritune.tuning import bench

    event, _ = _scripted(2)  # the third call's start has run
    fn = Counter()
    assert bench._queued_event_times(fn, 5, None, 0.001, checked=True, event=event, sleep=lambda s: None,
                                     synchronize=lambda: None) == [2000.0] * 2  # the two queued whole before it
    assert fn.calls == 3  # stopped there
    event, _ = _scripted(2)
    assert bench._queued_event_times(Counter(), 5, None, 0.001, checked=False, event=event, sleep=lambda s: None,
                                     synchronize=lambda: None) == [2000.0] * 5


def test_a_caught_up_short_park_keeps_what_was_queued_whole_and_parks_longer(monkeypatch) -> None:
    """_parked_event_times: the short park first (with a flush). Where the GPU caught up, the calls queued whole before
    that are kept and the rest queued again behind a park twice as long, up to SHORT_PARK_TRIES parks, then behind
    the full park; each catch-up counts in PARK_TOTALS["retimed"]. Without a flush, or with TRITUNE_TIMER_PARK=full,
    the full park only."""
    from tritune.tuning import bench

    calls = []
    whole_per_short_park = [10]  # calls each checked queue gets through before the GPU catches up

    def queued(fn, iters, flush, park_s, *, checked):
        calls.append((round(park_s, 6), iters, checked))
        return [float(len(calls))] * (min(iters, whole_per_short_park[0]) if checked else iters)

    monkeypatch.setattr(bench, "_queued_event_times", queued)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(time, "perf_counter", itertools.cycle([0.0, 1e-5]).__next__)  # one call's host cost: 10 us
    short = 2 * 40e-6 + 50e-6
    retimed0 = bench.PARK_TOTALS["retimed"]
    assert bench.SHORT_PARK_TRIES == 3
    times = bench._parked_event_times(Counter(), 50, torch.empty(1))
    assert times == [1.0] * 10 + [2.0] * 10 + [3.0] * 10 + [4.0] * 20  # every sample kept, in order
    assert calls == [(round(short, 6), 50, True), (round(2 * short, 6), 40, True), (round(4 * short, 6), 30, True),
                     (round(1.5 * 20 * 40e-6, 6), 20, False)]
    assert bench.PARK_TOTALS["retimed"] == retimed0 + 3
    calls.clear()
    whole_per_short_park[0] = 30  # the second park gets through the 20 left
    assert len(bench._parked_event_times(Counter(), 50, torch.empty(1))) == 50
    assert [(iters, checked) for _, iters, checked in calls] == [(50, True), (20, True)]
    assert bench.PARK_TOTALS["retimed"] == retimed0 + 4
    calls.clear()
    bench._parked_event_times(Counter(), 50, None)  # no flush: no margin for the short park
    assert [checked for _, _, checked in calls] == [False]
    calls.clear()
    monkeypatch.setenv("TRITUNE_TIMER_PARK", "full")
    bench._parked_event_times(Counter(), 50, torch.empty(1))
    assert [checked for _, _, checked in calls] == [False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the short park's event checks")
def test_short_and_full_parks_agree_and_a_host_bound_call_takes_the_full_one(monkeypatch) -> None:
    """On a GPU: a GPU-bound call times the same under the short park as under the full one; a call whose host cost
    dwarfs its GPU time (a host sleep) fails the short park's check and is timed with the full park."""
    from tritune.tuning import bench

    x = torch.randn(2048, 2048, device="cuda")
    short = time_kernel(lambda: torch.mm(x, x), iters=30)
    monkeypatch.setenv("TRITUNE_TIMER_PARK", "full")
    full = time_kernel(lambda: torch.mm(x, x), iters=30)
    assert abs(short.median_us / full.median_us - 1) < 0.1
    monkeypatch.delenv("TRITUNE_TIMER_PARK")
    y = torch.zeros(1, device="cuda")

    def host_bound() -> None:
        time.sleep(0.002)  # 2 ms of host per call, far over the flush's GPU time
        y.add_(1)

    retimed0 = bench.PARK_TOTALS["retimed"]
    timing = time_kernel(host_bound, iters=10, warmup=1)
    assert bench.PARK_TOTALS["retimed"] >= retimed0 + 1  # each short park the GPU caught up with
    assert timing.iters == 10 and timing.median_us < 1000.0  # the add's GPU time, not the host's 2 ms


def test_a_host_job_runs_once_while_the_timed_calls_are_queued() -> None:
    """bench.while_gpu_busy: the job runs after the last timed call is queued and before the host synchronizes, once;
    None drops a job not yet run."""
    from tritune.tuning import bench

    order: list[str] = []
    event, _ = _scripted(None)
    fn = Counter()
    bench.while_gpu_busy(lambda: order.append(f"job after {fn.calls} calls"))
    bench._queued_event_times(fn, 3, None, 0.001, checked=True, event=event, sleep=lambda s: None,
                              synchronize=lambda: order.append("sync"))
    event, _ = _scripted(None)
    bench._queued_event_times(fn, 3, None, 0.001, checked=True, event=event, sleep=lambda s: None,
                              synchronize=lambda: order.append("sync"))
    assert order == ["job after 3 calls", "sync", "sync"]
    bench.while_gpu_busy(lambda: order.append("dropped"))
    bench.while_gpu_busy(None)
    event, _ = _scripted(None)
    bench._queued_event_times(fn, 1, None, 0.001, checked=True, event=event, sleep=lambda s: None,
                              synchronize=lambda: None)
    assert "dropped" not in order
