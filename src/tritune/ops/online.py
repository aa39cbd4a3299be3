"""Online tuning's seam (TRITUNE_ONLINE_TUNE=1): an op whose lookup found no tuned entry for a shape asks `maybe_tune`
for a short tune of it. The tuners sit above the ops, so they are never imported here: they are registered with
`set_tuner`, or taken from the module named by `PROVIDER` (by name: no import statement points up), imported on the
first miss with the knob on.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritune import knobs
from tritune.store.fmoe_rows import FmoeShape

__all__ = ["GemmRequest", "MoeRequest", "Tuner", "maybe_tune", "reset", "set_tuner"]

log = logging.getLogger("tritune")

# The module whose TUNERS serve a miss no `set_tuner` registration covers. It imports tuners, engine and store, which
# sit above the ops, so it is named, never imported by a statement: importlib loads it on the first miss with
# TRITUNE_ONLINE_TUNE=1.
PROVIDER = "tritune.online_tune"


@dataclass(frozen=True)
class GemmRequest:
    """Tune C[M, N] = A[M, K]·B[N, K]ᵀ of `kernel` at this M, on GPU `device` (-1: the interpreter)."""

    kernel: str
    M: int
    N: int
    K: int
    device: int

    def shape_key(self) -> tuple:
        return "gemm", self.kernel, self.N, self.K, self.device

    def describe(self) -> str:
        return f"GEMM {self.kernel} N={self.N} K={self.K} (M={self.M})"


@dataclass(frozen=True)
class MoeRequest:
    """Tune one fused-MoE row: `shape` at its own token count, on GPU `device` (-1: the interpreter)."""

    shape: FmoeShape
    device: int

    def shape_key(self) -> tuple:
        return "fused_moe", self.shape.shape_key(), self.device

    def describe(self) -> str:
        return f"fused MoE {self.shape.key()}"


# (request, folder to persist to, budget in seconds) -> None once the tune is persisted; raises when it failed.
Tuner = Callable[[Any, Path, float], None]

_TUNERS: dict[str, Tuner] = {}
_ATTEMPTS: dict[tuple, bool] = {}  # shape key -> whether its tune was persisted (this process tries a shape once)
_WARNED: set[str] = set()
_LOCK = threading.Lock()  # one online tune at a time in a process; other threads missing a shape wait for it
_LOCAL = threading.local()  # .busy while this thread tunes: a miss inside the tune itself is not tuned again


def set_tuner(kind: str, fn: Tuner | None) -> None:
    """Register the tuner of `kind` ("gemm" or "fused_moe"), ahead of the provider module's; None removes it."""
    if fn is None:
        _TUNERS.pop(kind, None)
    else:
        _TUNERS[kind] = fn


def reset() -> None:
    """Forget the shapes this process tried and the warnings given (tests; or to retry after fixing a cause)."""
    with _LOCK:
        _ATTEMPTS.clear()
        _WARNED.clear()


def maybe_tune(kind: str, request: GemmRequest | MoeRequest) -> bool:
    """Called by an op on a miss: no tuned entry for the request's shape. True when a tune of the shape was persisted
    (now, or earlier in this process): the op re-reads its files and looks again. False when online tuning is off,
    has no TRITUNE_CONFIG_DIR to write to (one warning per process), or the tune failed (one warning per shape and
    process); the op then keeps its heuristic. The caller waits while the tune runs (about the budget plus the
    engine's start-up, seconds). A bad TRITUNE_ONLINE_TUNE or TRITUNE_ONLINE_BUDGET is a ValueError.
    """
    if not knobs.online_tune() or getattr(_LOCAL, "busy", False) or _spawning():
        return False
    key = request.shape_key()
    done = _ATTEMPTS.get(key)
    if done is not None:
        return done
    budget = knobs.online_budget()
    with _LOCK:
        if key not in _ATTEMPTS:
            _ATTEMPTS[key] = _attempt(kind, request, budget)
        return _ATTEMPTS[key]


def _attempt(kind: str, request: GemmRequest | MoeRequest, budget: float) -> bool:
    try:
        folder = knobs.config_dir()
        if folder is None:
            raise ValueError(f"{knobs.CONFIG_DIR} is not set")
    except ValueError as err:
        _warn_once("folder", f"tritune: {knobs.ONLINE_TUNE}=1 needs {knobs.CONFIG_DIR}, the folder online tunes are "
                             f"written to ({err}); untuned shapes use the heuristic")
        return False
    _LOCAL.busy = True
    start = time.monotonic()
    try:
        log.info("tritune: online tuning %s for up to %gs into %s", request.describe(), budget, folder)
        _tuner(kind)(request, folder, budget)
    except Exception as err:  # noqa: BLE001 - whatever broke the tune, the op falls back to its heuristic
        warnings.warn(f"tritune: online tuning of {request.describe()} failed ({type(err).__name__}: {err}); using "
                      f"the heuristic", stacklevel=2)
        return False
    finally:
        _LOCAL.busy = False
    log.info("tritune: online tuning %s done in %.1fs", request.describe(), time.monotonic() - start)
    return True


def _tuner(kind: str) -> Tuner:
    """The registered tuner of `kind`, else the provider module's (`TUNERS` of `PROVIDER`)."""
    if kind not in _TUNERS:
        provided = importlib.import_module(PROVIDER).TUNERS
        for name, fn in provided.items():
            _TUNERS.setdefault(name, fn)
    if kind not in _TUNERS:
        raise LookupError(f"no online tuner for {kind!r}")
    return _TUNERS[kind]


def _spawning() -> bool:
    """True while this process is a spawned child re-running the parent's main module (a script without an
    `if __name__ == "__main__":` guard; the check is multiprocessing's own): the engine's workers start this way, and
    one tuning there would wait on the lock its parent holds."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _warn_once(what: str, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, stacklevel=3)
