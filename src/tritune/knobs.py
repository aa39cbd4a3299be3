"""Every TRITUNE_* environment variable: its type, default and meaning, read here and nowhere else (and the one
reader of Triton's TRITON_INTERPRET).

Each knob is a function read at call time (never an import-time constant), so tests can monkeypatch
the environment and a long-lived process sees the value current when it asks.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = "TRITUNE_CONFIG_DIR"
CONFIG_FMOE = "TRITUNE_CONFIG_FMOE"
CACHE_DIR = "TRITUNE_CACHE_DIR"
LOG_LEVEL = "TRITUNE_LOG_LEVEL"
ONLINE_TUNE = "TRITUNE_ONLINE_TUNE"
ONLINE_BUDGET = "TRITUNE_ONLINE_BUDGET"
START_METHOD = "TRITUNE_START_METHOD"
TIMER_PARK = "TRITUNE_TIMER_PARK"
MXFP4_DECODE = "TRITUNE_MXFP4_DECODE"
WORKER_PRELOAD = "TRITUNE_WORKER_PRELOAD"
MOE_MLP_LAYOUT = "TRITUNE_MOE_MLP_LAYOUT"
DETERMINISTIC = "TRITUNE_DETERMINISTIC"
INTERPRET = "TRITON_INTERPRET"  # Triton's own variable: read here (interpreting()), never in KNOBS' table

ONLINE_BUDGET_DEFAULT_S = 10.0
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _raw(name: str) -> str | None:
    """The variable's text, or None when unset or blank (an empty value means "use the default")."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def config_dir() -> Path | None:
    """TRITUNE_CONFIG_DIR: the user's folder of tuned files, searched before the shipped ones (GEMM and grouped-GEMM
    JSON, `user_kernels/`, and `tuned_fmoe.csv` before the fused-MoE CSVs); online tunes are written here.

    Unset: None. Set: the folder (with ~ expanded), which must exist, else ValueError naming it.
    """
    value = _raw(CONFIG_DIR)
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ValueError(f"{CONFIG_DIR}={value!r}: {path} {what}")
    return path


def fmoe_config_files() -> list[Path]:
    """TRITUNE_CONFIG_FMOE: colon-separated tuned fused-MoE CSV files, in the order given.

    Unset: []. Empty entries ("a.csv::b.csv") are skipped; every named file must exist, else a ValueError
    listing the missing ones.
    """
    value = _raw(CONFIG_FMOE)
    if value is None:
        return []
    paths = [Path(part.strip()).expanduser() for part in value.split(":") if part.strip()]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"{CONFIG_FMOE}={value!r}: no such file(s): {', '.join(missing)}")
    return paths


def cache_dir() -> Path:
    """TRITUNE_CACHE_DIR: where tritune keeps caches (journals, compiled artefacts). Default ~/.cache/tritune.

    The folder need not exist yet (callers create it); an existing path that is not a folder is a ValueError.
    """
    value = _raw(CACHE_DIR)
    path = Path(value if value is not None else "~/.cache/tritune").expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{CACHE_DIR}={value!r}: {path} exists and is not a folder")
    return path


def log_level() -> str:
    """TRITUNE_LOG_LEVEL: level of the `tritune` logger, a logging level name (any case). Default "WARNING".

    Returns the upper-case name, e.g. "DEBUG"; an unknown name is a ValueError listing the valid ones.
    """
    value = _raw(LOG_LEVEL)
    if value is None:
        return "WARNING"
    names = logging.getLevelNamesMapping()
    level = value.upper()
    if level not in names:
        raise ValueError(f"{LOG_LEVEL}={value!r} is not a logging level; use one of {', '.join(names)}")
    return level


def online_tune() -> bool:
    """TRITUNE_ONLINE_TUNE: "1" makes the first call of a GEMM or fused-MoE shape with no tuned entry run a short
    tune (see online_budget) on the caller's GPU and persist it to TRITUNE_CONFIG_DIR. Default off.

    Accepts 1/0, true/false, yes/no, on/off (any case); anything else is a ValueError naming the variable.
    """
    return _bool(ONLINE_TUNE, False)


def worker_preload() -> bool:
    """TRITUNE_WORKER_PRELOAD: whether a GPU worker loads the binary of the candidate it will likely measure next
    while the GPU runs the current one's timed calls (the executor names that candidate with each task), so its
    first checked run no longer waits on Triton's cache. Default on; "0" turns it off (the A/B of issue 17).

    Accepts 1/0, true/false, yes/no, on/off (any case); anything else is a ValueError naming the variable.
    """
    return _bool(WORKER_PRELOAD, True)


def deterministic() -> bool:
    """TRITUNE_DETERMINISTIC: "1" keeps the fused-MoE op to plans that add in a fixed order, so the same inputs give
    the same bits on every run: no 1-stage kernel and no TOPK_ATOMIC stage 2 (both sum with fp32 atomics, in whatever
    order the programs run); tuned rows that name one are passed over, the rule table's stage pair taking their
    place. Read when the op first binds a call signature (`tritune.ops.reload_moe_configs()` after changing it).
    Default off.

    Accepts 1/0, true/false, yes/no, on/off (any case); anything else is a ValueError naming the variable.
    """
    return _bool(DETERMINISTIC, False)


def _bool(name: str, default: bool) -> bool:
    """The boolean variable `name`, `default` when unset; a ValueError naming it when it is not a boolean."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in _BOOLS:
        raise ValueError(f"{name}={value!r} is not a boolean; use 1 or 0 (true/false, yes/no, on/off)")
    return _BOOLS[value.lower()]


def online_budget() -> float:
    """TRITUNE_ONLINE_BUDGET: seconds one online tune of a shape may spend measuring. Default 10.

    Counted from the first candidate's result: the start-up before it (benchmark worker, compile pool, first
    compile; seconds) comes on top, once per engine pass (GEMM one, fused MoE two: stages, then end to end, which
    share the budget 3:1). A finite number > 0, else a ValueError naming it.
    """
    value = _raw(ONLINE_BUDGET)
    if value is None:
        return ONLINE_BUDGET_DEFAULT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{ONLINE_BUDGET}={value!r} is not a number of seconds > 0")
    return seconds


START_METHODS = ("spawn", "forkserver")


def start_method() -> str:
    """TRITUNE_START_METHOD: how the tuner starts its compile processes and GPU workers. "forkserver" (default): they
    fork from a server that imported torch and Triton once, which never touches CUDA. "spawn": each starts a fresh
    Python and imports torch and Triton itself (seconds each; 64 at once on a large machine). Where the platform has
    no fork server, spawn. Anything else is a ValueError.
    """
    return _one_of(START_METHOD, START_METHODS,
                   "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")


TIMER_PARKS = ("short", "full")


def timer_park() -> str:
    """TRITUNE_TIMER_PARK: how long the GPU timers park the GPU while the host queues the timed calls. "short"
    (default): a head start of about two calls, every call then checked to have been queued whole before the GPU
    reached it; the calls from the first that was not are queued again behind a park twice as long (three parks at
    most, then the full park). "full": a sleep covering the whole queue, as before 2026-11-26. Anything else is a
    ValueError."""
    return _one_of(TIMER_PARK, TIMER_PARKS, "short")


MXFP4_DECODES = ("ops", "asm")


def mxfp4_decode() -> str:
    """TRITUNE_MXFP4_DECODE: how the GPU kernels turn MXFP4 weight bytes into bf16. "ops" (default): Triton integer
    and fp32 ops, about 13 a weight. "asm": packed PTX, two weights a 32-bit register, about 4 a weight
    (kernels/mxfp4.py); read once, when the kernels are imported. On the H100 both took the same time (within 0.7%
    at 1-64 tokens): the decode's arithmetic is not what bounds MXFP4. The interpreter always runs "ops". Anything
    else is a ValueError."""
    return _one_of(MXFP4_DECODE, MXFP4_DECODES, "ops")


MOE_MLP_LAYOUTS = ("padded", "plain")


def moe_mlp_layout() -> str:
    """TRITUNE_MOE_MLP_LAYOUT: the rows the training MoE MLP (ops/moe_mlp.py) hands a scheduled dW. "padded"
    (default): the operand that loop copies is produced padded per expert (the forward's gathered tokens, kept for
    the backward; the top-k sum's dY, written from dout). "plain": the loop copies it, as before 2026-11-27 (for A/B
    timing, or to keep the hidden states rather than topk times their size for the backward). Anything else is a
    ValueError."""
    return _one_of(MOE_MLP_LAYOUT, MOE_MLP_LAYOUTS, "padded")


def _one_of(name: str, choices: tuple[str, ...], default: str) -> str:
    """The variable's value, lower-cased, which must be one of `choices` (ValueError naming it otherwise); `default`
    when unset."""
    value = _raw(name)
    if value is None:
        return default
    if value.lower() not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)}")
    return value.lower()


# Triton's truthiness for its boolean variables (getenv_bool: lower-cased, not stripped), so tritune and Triton
# never disagree on whether kernels run in the interpreter.
_TRITON_TRUE = ("1", "true", "yes", "on", "y")


def interpreting() -> bool:
    """TRITON_INTERPRET (Triton's variable, not tritune's): whether Triton runs kernels in its CPU interpreter.

    True for what Triton itself takes as true: "1", "true", "yes", "on", "y" in any case, nothing else (" 1" and "2"
    are false to Triton, so they are here). Every tritune module asks this function; `tritune.cli` and the AOT
    compiler set the variable before Triton is imported. Kept out of KNOBS, the table of tritune's own variables.
    """
    return os.environ.get(INTERPRET, "").lower() in _TRITON_TRUE


@dataclass(frozen=True)
class Knob:
    name: str
    read: Callable[[], object]
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob(CONFIG_DIR, config_dir, "The user's folder of tuned files (GEMM, grouped GEMM, tuned_fmoe.csv), searched "
                                 "before the shipped ones; online tunes are written here."),
    Knob(CONFIG_FMOE, fmoe_config_files, "Colon-separated tuned fused-MoE CSV files (read by the MoE tuner/op)."),
    Knob(CACHE_DIR, cache_dir, "Folder for tritune's caches. Default ~/.cache/tritune."),
    Knob(LOG_LEVEL, log_level, "Level of the 'tritune' logger (DEBUG, INFO, WARNING, ...). Default WARNING."),
    Knob(ONLINE_TUNE, online_tune, "1: an untuned GEMM / fused-MoE shape is tuned on its first call (into "
                                   "TRITUNE_CONFIG_DIR). Default 0."),
    Knob(ONLINE_BUDGET, online_budget, "Seconds an online tune of one shape may measure (start-up on top). "
                                       "Default 10."),
    Knob(START_METHOD, start_method, "How the tuner starts compile processes and GPU workers: forkserver "
                                     "(default; forked from one process that imported torch and Triton) or spawn."),
    Knob(TIMER_PARK, timer_park, "How long the GPU timers park the GPU while the host queues: short (default; "
                                 "each call checked; from the first the GPU caught up with, queued again behind a "
                                 "longer park) or full (a sleep covering the whole queue)."),
    Knob(MXFP4_DECODE, mxfp4_decode, "How GPU kernels decode MXFP4 weights to bf16: ops (default; Triton ops) or "
                                     "asm (packed PTX, two weights a register; measured no faster)."),
    Knob(WORKER_PRELOAD, worker_preload, "1 (default): a GPU worker loads its likely next candidate's binary while "
                                         "the GPU times the current one. 0: each binary loads on its first run."),
    Knob(MOE_MLP_LAYOUT, moe_mlp_layout, "Rows the training MoE MLP gives a scheduled dW: padded (default; made "
                                         "padded where produced) or plain (the dW loop copies one operand)."),
    Knob(DETERMINISTIC, deterministic, "1: the fused-MoE op runs only plans that add in a fixed order (no 1-stage "
                                       "kernel, no TOPK_ATOMIC): the same bits every run. Default 0."),
)


def describe() -> list[tuple[str, str, str]]:
    """(name, current value as text, doc) for every knob; a bad value shows as "invalid: <reason>"."""
    rows = []
    for knob in KNOBS:
        try:
            value = knob.read()
            text = ":".join(map(str, value)) if isinstance(value, list) else str(value)
        except ValueError as err:
            text = f"invalid: {err}"
        rows.append((knob.name, text, knob.doc))
    return rows
