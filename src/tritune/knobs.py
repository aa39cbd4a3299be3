"""Every TRITUNE_* environment variable: its type, default and meaning, read here and nowhere else.

Each knob is a function read at call time (never an import-time constant), so tests can monkeypatch
the environment and a long-lived process sees the value current when it asks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = "TRITUNE_CONFIG_DIR"
CONFIG_FMOE = "TRITUNE_CONFIG_FMOE"
CACHE_DIR = "TRITUNE_CACHE_DIR"
LOG_LEVEL = "TRITUNE_LOG_LEVEL"


def _raw(name: str) -> str | None:
    """The variable's text, or None when unset or blank (an empty value means "use the default")."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def config_dir() -> Path | None:
    """TRITUNE_CONFIG_DIR: an extra folder of tuned GEMM JSON files, searched before the shipped ones.

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


@dataclass(frozen=True)
class Knob:
    name: str
    read: Callable[[], object]
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob(CONFIG_DIR, config_dir, "Extra folder of tuned GEMM JSON files, searched before the shipped ones."),
    Knob(CONFIG_FMOE, fmoe_config_files, "Colon-separated tuned fused-MoE CSV files (read by the MoE tuner/op)."),
    Knob(CACHE_DIR, cache_dir, "Folder for tritune's caches. Default ~/.cache/tritune."),
    Knob(LOG_LEVEL, log_level, "Level of the 'tritune' logger (DEBUG, INFO, WARNING, ...). Default WARNING."),
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
