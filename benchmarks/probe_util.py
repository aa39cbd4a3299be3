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
