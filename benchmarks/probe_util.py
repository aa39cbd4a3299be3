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


def checked_rounds(calls: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]],
                   timer: Callable[[Callable], float], rounds: int = 1) -> dict[str, tuple[float, float] | str]:
    """`checked_time` for several contestants (name -> (fn, ref)), timed in `rounds` rounds with the order turned
    each round, the median over rounds: a kernel timed right after another's milliseconds of MMAs runs on a hotter,
    slower-clocked GPU (twenty-ninth session: the same config 2-7% slower in a later column)."""
    import statistics

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
    names = list(errs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timer(calls[name][0]))
    out.update({name: (round(statistics.median(times[name]), 1), round(errs[name], 5)) for name in names})
    return {name: out[name] for name in calls}


def parse_ws_variant(v: str) -> dict | None:
    """`ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS]]`, a variant of the warp-specialised GEMM
    (`kernels/gluon_gemm_ws.py`; WARPS the consumer's, 8 unless given), as `ws_gemm`'s keyword arguments; None for a
    variant of another form. ValueError for a malformed one."""
    if not v.startswith("ws:"):
        return None
    parts = v[3:].split(":")
    if not 4 <= len(parts) <= 6 or not all(x.isdigit() for x in parts):
        raise ValueError(f"variant {v!r} is not ws:BM:BN:STAGES:GROUP_M[:WARPS[:LOADER_REGS]]")
    x = [int(p) for p in parts] + [8, 40][len(parts) - 4:]
    return {"block_m": x[0], "block_n": x[1], "stages": x[2], "group_m": x[3], "num_warps": x[4], "loader_regs": x[5]}
