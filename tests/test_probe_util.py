"""benchmarks/probe_util.py: a probe's variant is timed and checked, or its error becomes its result."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_util", ROOT / "benchmarks" / "probe_util.py")
probe_util = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_util)


def test_a_variant_is_timed_and_checked_against_the_reference():
    ref = torch.tensor([3.0, 4.0])
    assert probe_util.checked_time(lambda: torch.tensor([3.0, 4.0]), ref, lambda fn: 12.34) == (12.3, 0.0)
    # one element off by 0.5 against a norm of 5: relative L2 error 0.1
    assert probe_util.checked_time(lambda: torch.tensor([3.0, 4.5]), ref, lambda fn: 1.0) == (1.0, 0.1)


def test_a_variant_that_raises_keeps_its_error_as_the_result():
    def refused() -> torch.Tensor:
        raise RuntimeError("out of resource: shared memory, Required: 262160")

    assert probe_util.checked_time(refused, torch.ones(1), lambda fn: 1.0) == (
        "RuntimeError: out of resource: shared memory, Required: 262160")


def test_rounds_turn_the_order_and_take_each_contestants_median():
    """Each round times every contestant once, starting one further along; the result is the median over rounds,
    with each one's error checked once; a contestant that raises keeps its error and is not timed."""
    order: list[str] = []
    clock = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def make(name: str):
        def fn() -> torch.Tensor:
            return torch.tensor([3.0, 4.0])
        fn.name = name
        return fn

    def refused() -> torch.Tensor:
        raise ValueError("no")

    def timer(fn) -> float:
        order.append(fn.name)
        return next(clock[fn.name])

    ref = torch.tensor([3.0, 4.0])
    got = probe_util.checked_rounds({"a": (make("a"), ref), "x": (refused, ref), "b": (make("b"), ref)}, timer, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert got == {"a": (3.0, 0.0), "x": "ValueError: no", "b": (4.0, 0.0)}
    assert list(got) == ["a", "x", "b"]


def test_a_timing_that_raises_is_reported_once_and_left_out_or_propagates():
    """`timed_rounds` with `on_error`: the failing contestant is handed over once, timed no more, and has no median;
    the others keep theirs. Without it the error propagates."""
    calls: list[str] = []

    def timer(fn) -> float:
        calls.append(fn.__name__)
        if fn.__name__ == "bad":
            raise RuntimeError("launch failed")
        return 2.0

    def good() -> None: ...

    def bad() -> None: ...

    errors: list[tuple[str, str]] = []
    got = probe_util.timed_rounds({"good": good, "bad": bad}, timer, 3,
                                  on_error=lambda name, exc: errors.append((name, str(exc))))
    assert got == {"good": 2.0} and errors == [("bad", "launch failed")]
    assert calls.count("bad") == 1 and calls.count("good") == 3
    with pytest.raises(RuntimeError, match="launch failed"):
        probe_util.timed_rounds({"bad": bad}, timer, 1)
    assert probe_util.timed_rounds({}, timer, 3) == {}  # every contestant refused before timing: nothing to time


def test_each_timing_follows_a_settle_of_the_same_contestant():
    """The settle runs the contestant about to be timed, right before its timing, every round (so the kernel
    before it no longer sets its clock); `checked_rounds` passes it on."""
    events: list[str] = []

    def timer(fn) -> float:
        events.append("time " + fn.__name__)
        return 1.0

    def a() -> None: ...

    def b() -> None: ...

    got = probe_util.timed_rounds({"a": a, "b": b}, timer, 2, settle=lambda fn: events.append("settle " + fn.__name__))
    assert got == {"a": 1.0, "b": 1.0}
    assert events == ["settle a", "time a", "settle b", "time b", "settle b", "time b", "settle a", "time a"]
    events.clear()
    ref = torch.ones(1)
    a_t = lambda: torch.ones(1)  # noqa: E731
    a_t.__name__ = "a"
    probe_util.checked_rounds({"a": (a_t, ref)}, timer, 1, settle=lambda fn: events.append("settle " + fn.__name__))
    assert events == ["settle a", "time a"]


def test_the_gpu_settle_runs_nothing_without_cuda_and_refuses_a_negative_time():
    calls: list[int] = []
    probe_util.gpu_settle(lambda: calls.append(1), 5.0)  # CI has no GPU: returns at once, calls nothing
    assert calls == [] or torch.cuda.is_available()
    before = probe_util.SETTLE_S
    try:
        probe_util.set_settle(0)
        assert probe_util.SETTLE_S == 0.0
        with pytest.raises(ValueError, match="settle must be >= 0"):
            probe_util.set_settle(-1)
        with pytest.raises(ValueError, match="settle must be >= 0"):
            probe_util.set_settle(float("nan"))
    finally:
        probe_util.set_settle(before)


def test_a_warp_specialised_variant_reads_its_optional_warps_loader_registers_and_k_split():
    assert probe_util.parse_ws_variant("128:128:5:8") is None  # another form's variant
    assert probe_util.parse_ws_variant("ws:128:128:5:8") == {"block_m": 128, "block_n": 128, "stages": 5,
                                                              "group_m": 8, "num_warps": 8, "loader_regs": 40,
                                                              "splits": 1}
    assert probe_util.parse_ws_variant("ws:64:128:8:8:4")["num_warps"] == 4
    got = probe_util.parse_ws_variant("ws:128:128:5:8:8:40:4")
    assert (got["loader_regs"], got["splits"]) == (40, 4)
    for bad in ("ws:128:128:5", "ws:128:128:5:8:8:40:4:1", "ws:128:x:5:8"):
        with pytest.raises(ValueError, match="is not ws:BM:BN:STAGES:GROUP_M"):
            probe_util.parse_ws_variant(bad)
