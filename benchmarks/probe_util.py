"""What every kernel probe in benchmarks/ does with one variant: run it once, check it against the reference, time
it, or keep the error a compiler or the GPU raised as the variant's result (a probe sweeps configs that may not
build)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def checked_time(fn: Callable[[], torch.Tensor], ref: torch.Tensor, timer: Callable[[Callable], float]
                 ) -> tuple[float, float] | str:
    """(µs by `timer`, relative L2 error of fn()'s result against `ref`), or "ErrorType: message" when fn raises."""
    try:
        got = fn()
        if got.is_cuda:
            torch.cuda.synchronize()
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        return round(timer(fn), 1), round(err, 5)
    except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses is a result
        return f"{type(exc).__name__}: {str(exc)[:160]}"


# Seconds of one fixed load (`gpu_settle`: bf16 matmuls, the same for every contestant) right before each contestant is
# timed. An fp8 GEMM at the H200's power limit ran 2340 µs timed after an idle GPU, 2380 after vLLM's slower kernel,
# 2600-2680 after itself and 2780 after cuBLAS (24576x7168 M 8192, thirtieth session), and turning the order keeps
# each contestant's predecessor (a rotation keeps the cycle). Settling on the contestant itself was tried first and
# is not fair either: a contestant whose host cost leaves the GPU idle part of the time (Triton's launcher on a 40-85
# µs kernel) settles cooler and then ran 10-12% faster than the same binary launched by the op or from a CUDA graph.
SETTLE_S = 0.3


def set_settle(seconds: float) -> None:
    """The settle every later `timed_rounds` uses by default (a bench's `--settle`); 0 turns it off."""
    global SETTLE_S
    if not seconds >= 0:
        raise ValueError(f"settle must be >= 0 seconds, got {seconds}")
    SETTLE_S = float(seconds)


_HEATER: dict[int, tuple] = {}  # the settle's operands, made once per GPU


def gpu_settle(fn: Callable, seconds: float | None = None) -> None:
    """Hold the current GPU under one fixed load for `seconds` (SETTLE_S when None) of wall time: 4096x4096 bf16
    matmuls queued 8 at a time, whatever `fn` is, so every contestant starts from the same clock and temperature
    rather than from the state the previous one (or its own host cost) left. Nothing without CUDA."""
    import time

    del fn  # the load is the same for every contestant: that is the point
    seconds = SETTLE_S if seconds is None else seconds
    if seconds <= 0 or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    if device not in _HEATER:
        gen = torch.Generator(device="cuda").manual_seed(0)
        _HEATER[device] = tuple(torch.randn(4096, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
                                for _ in range(3))
    x, y, out = _HEATER[device]
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            torch.matmul(x, y, out=out)
        torch.cuda.synchronize()


def timed_rounds(fns: dict[str, Callable], timer: Callable[[Callable], float], rounds: int = 1,
                 on_error: Callable[[str, Exception], None] | None = None,
                 settle: Callable[[Callable], None] | None = None) -> dict[str, float]:
    """The median over `rounds` rounds of `timer` on each of `fns` (name -> callable), every one timed once a round,
    the order turned by one each round (twenty-ninth session: the same config 2-7% slower in a later column), each
    timing preceded by `settle(fn)` (default `gpu_settle`: one fixed load for SETTLE_S, so neither the kernel before
    it nor its own host cost sets its clock). A timing that raises propagates, or (`on_error`) is handed to it and
    that contestant is timed no more and left out."""
    import statistics

    settle = gpu_settle if settle is None else settle
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    failed: set[str] = set()
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name in failed:
                continue
            try:
                settle(fns[name])
                times[name].append(timer(fns[name]))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(name, exc)
                failed.add(name)
    return {name: statistics.median(ts) for name, ts in times.items() if ts and name not in failed}


def add_rounds_args(ap, what: str = "every contestant") -> None:
    """`--rounds` and `--settle` on a bench's parser; call `apply_rounds_args(args)` after parsing."""
    ap.add_argument("--rounds", type=int, default=1,
                    help=f"rounds of timing, {what} once a round in a turning order (median of rounds)")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds of one fixed GPU load right before each contestant is timed (0: none)")


def apply_rounds_args(args) -> None:
    set_settle(args.settle)


def checked_rounds(calls: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]],
                   timer: Callable[[Callable], float], rounds: int = 1,
                   settle: Callable[[Callable], None] | None = None) -> dict[str, tuple[float, float] | str]:
    """`checked_time` for several contestants (name -> (fn, ref)), each checked once, then timed in interleaved
    rounds (`timed_rounds`)."""
    out: dict[str, tuple[float, float] | str] = {}
    errs: dict[str, float] = {}
    for name, (fn, ref) in calls.items():
        try:
            got = fn()
            if got.is_cuda:
                torch.cuda.synchronize()
            errs[name] = float((got.float() - ref.float()).norm() / ref.float().norm())
        except Exception as exc:  # noqa: BLE001 - a config the compiler or the GPU refuses is a result
            out[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    us = timed_rounds({name: calls[name][0] for name in errs}, timer, rounds, settle=settle)
    out.update({name: (round(us[name], 1), round(errs[name], 5)) for name in errs})
    return {name: out[name] for name in calls}


def parse_ws_variant(v: str) -> dict | None:
    """`ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS[:SPLITS]]]`, a variant of the warp-specialised GEMM
    (`kernels/gluon_gemm_ws.py`; WARPS the consumer's, 8 unless given; SPLITS the block-scaled kernel's K split, 1
    unless given), as `ws_gemm`'s keyword arguments; None for a variant of another form. ValueError for a malformed
    one."""
    if not v.startswith("ws:"):
        return None
    parts = v[3:].split(":")
    if not 4 <= len(parts) <= 7 or not all(x.isdigit() for x in parts):
        raise ValueError(f"variant {v!r} is not ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS[:SPLITS]]]")
    x = [int(p) for p in parts] + [8, 40, 1][len(parts) - 4:]
    return {"block_m": x[0], "block_n": x[1], "stages": x[2], "group_m": x[3], "num_warps": x[4], "loader_regs": x[5],
            "splits": x[6]}
