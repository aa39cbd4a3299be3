"""`perf_stats.csv`: one row per artifact run, accumulated across runs (new rows are appended, old rows are
never dropped), read back with errors naming the file, row and column. Columns: docs/AOT.md.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tritune.store.atomic import atomic_write_text, path_lock
from tritune.store.csv_records import csv_records

HEAD_COLUMNS = ("timestamp", "artifact", "kernel")
TAIL_COLUMNS = ("valid", "reason", "median_us", "min_us", "max_us", "reps", "total_s")
FIXED_COLUMNS = HEAD_COLUMNS + TAIL_COLUMNS

ParamValue = int | str | float

_INT_RE = re.compile(r"[+-]?[0-9]+")
_VALID = {"True": True, "False": False}


class PerfStatsError(ValueError):
    """A perf_stats.csv that cannot be read or extended: one line naming the file, row and column."""


@dataclass(frozen=True)
class StatRow:
    """One run of one artifact. Times in microseconds (nan when not measured); total_s is the process wall time."""

    timestamp: str  # ISO-8601 UTC, e.g. 2026-11-21T10:00:00.123456Z
    artifact: str
    kernel: str
    params: dict[str, ParamValue] = field(default_factory=dict)
    valid: bool = False
    reason: str = ""
    median_us: float = math.nan
    min_us: float = math.nan
    max_us: float = math.nan
    reps: int = 0
    total_s: float = 0.0


def utc_now() -> str:
    """Now as an ISO-8601 UTC timestamp with microseconds, so two runs in one second still order."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def param_columns(names: Iterable[str]) -> list[str]:
    """Parameter column order: BLOCK_* first, then the rest, each group sorted."""
    unique = set(names)
    return sorted(n for n in unique if n.startswith("BLOCK_")) + sorted(n for n in unique if not n.startswith("BLOCK_"))


def columns_for(param_names: Iterable[str]) -> list[str]:
    return [*HEAD_COLUMNS, *param_columns(param_names), *TAIL_COLUMNS]


def write_perf_stats(path: Path, rows: Sequence[StatRow]) -> Path:
    """Add `rows` to the CSV at `path`, atomically; returns the path.

    A new file gets a header of exactly the columns `rows` need. An existing file with the same parameter
    columns (or more) gets the rows appended, its old bytes untouched; one lacking some of the new parameter
    columns is rewritten with the union of columns, every old row and cell kept (new cells left empty).
    """
    path = Path(path)
    names = [name for row in rows for name in row.params]
    clash = sorted(set(names) & set(FIXED_COLUMNS))
    if clash:
        raise PerfStatsError(f"{path}: parameter name(s) {', '.join(clash)} clash with fixed columns")
    with path_lock(path):  # read-modify-write: hold the lock so concurrent runners do not drop each other's rows
        old_text = _read_text(path) if path.exists() else ""
        old_header, old_rows = _raw_rows(path, old_text) if old_text.strip() else (None, [])
        if old_header is None:
            header = columns_for(names)
            atomic_write_text(path, _csv_text(header, [], rows, with_header=True))
            return path
        old_params = [name for name in old_header if name not in FIXED_COLUMNS]
        header = columns_for([*old_params, *names])
        if set(header) == set(old_header):
            sep = "" if old_text.endswith("\n") else "\n"
            atomic_write_text(path, old_text + sep + _csv_text(old_header, [], rows, with_header=False))
        else:
            atomic_write_text(path, _csv_text(header, old_rows, rows, with_header=True))
    return path


def check_extendable(path: Path) -> None:
    """Raise PerfStatsError now if write_perf_stats could not add rows to `path`, so a long run does not end
    with results it cannot save (a missing file is fine: it will be created)."""
    path = Path(path)
    if path.exists():
        text = _read_text(path)
        if text.strip():
            _raw_rows(path, text)


def read_perf_stats(path: Path) -> list[StatRow]:
    """Every row of a perf_stats.csv in file order; PerfStatsError names the file, row, line and column."""
    path = Path(path)
    if not path.exists():
        raise PerfStatsError(f"{path}: no such file")
    text = _read_text(path)
    if not text.strip():
        raise PerfStatsError(f"{path}: empty file (no header)")
    header, raw = _raw_rows(path, text)
    params = [name for name in header if name not in FIXED_COLUMNS]
    return [_parse_row(path, number, line, cells, params) for number, line, cells in raw]


def latest_rows(rows: Sequence[StatRow]) -> list[StatRow]:
    """Per artifact, the row with the latest timestamp (a tie goes to the later row), in first-seen order."""
    best: dict[str, tuple[datetime, StatRow]] = {}
    for row in rows:
        when = _parse_time(row.timestamp)
        if row.artifact not in best or when >= best[row.artifact][0]:
            best[row.artifact] = (when, row)
    return [row for _, row in best.values()]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PerfStatsError(f"{path}: cannot read: {err}".replace("\n", " ")) from None


def _raw_rows(path: Path, text: str) -> tuple[list[str], list[tuple[int, int, dict[str, str]]]]:
    """The header and (row number, line, cells as written) of every non-blank data row."""

    def check_header(header: list[str]) -> None:
        missing = [name for name in FIXED_COLUMNS if name not in header]
        if missing:
            raise PerfStatsError(f"{path}: not a perf_stats file: the header lacks column(s) {', '.join(missing)}")
        if "" in header:
            raise PerfStatsError(f"{path}: column {header.index('') + 1} of the header has no name")

    header, records = csv_records(path, text, PerfStatsError, check_header)
    assert header is not None  # callers pass non-blank text
    return header, [(number, line, dict(zip(header, record, strict=True))) for number, line, record in records]


def _csv_text(header: Sequence[str], old: Sequence[tuple[int, int, dict[str, str]]], rows: Sequence[StatRow],
              *, with_header: bool) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if with_header:
        writer.writerow(header)
    for _, _, cells in old:
        writer.writerow([cells.get(name, "") for name in header])
    for row in rows:
        cells = _cells(row)
        writer.writerow([cells.get(name, "") for name in header])
    return out.getvalue()


def _cells(row: StatRow) -> dict[str, str]:
    cells = {"timestamp": row.timestamp, "artifact": row.artifact, "kernel": row.kernel,
             "valid": "True" if row.valid else "False", "reason": row.reason, "median_us": _num(row.median_us, 4),
             "min_us": _num(row.min_us, 4), "max_us": _num(row.max_us, 4), "reps": str(row.reps),
             "total_s": _num(row.total_s, 3)}
    cells.update({name: repr(value) if isinstance(value, float) else str(value) for name, value in row.params.items()})
    return cells


def _num(value: float, digits: int) -> str:
    # Not measured is an empty cell, which pandas and read_perf_stats both read as nan.
    return repr(round(value, digits)) if math.isfinite(value) else ""


def _parse_row(path: Path, number: int, line: int, cells: dict[str, str], params: Sequence[str]) -> StatRow:
    def error(column: str, expected: str) -> PerfStatsError:
        return PerfStatsError(f"{path}, row {number} (line {line}), column '{column}': value {cells[column]!r}: "
                              f"expected {expected}")

    def number_of(column: str, empty_ok: bool) -> float:
        text = cells[column].strip()
        if not text and empty_ok:
            return math.nan
        try:
            return float(text)
        except ValueError:
            raise error(column, "a number" + (" or an empty cell" if empty_ok else "")) from None

    timestamp = cells["timestamp"].strip()
    try:
        _parse_time(timestamp)
    except ValueError:
        raise error("timestamp", "an ISO-8601 time such as 2026-11-21T10:00:00Z") from None
    if not cells["artifact"].strip():
        raise error("artifact", "an artifact id")
    if cells["valid"].strip() not in _VALID:
        raise error("valid", "True or False")
    reps_text = cells["reps"].strip()
    if not _INT_RE.fullmatch(reps_text or "0") or int(reps_text or "0") < 0:
        raise error("reps", "an integer >= 0")
    return StatRow(timestamp=timestamp, artifact=cells["artifact"].strip(), kernel=cells["kernel"].strip(),
                   params={name: _param(cells[name].strip()) for name in params if cells[name].strip()},
                   valid=_VALID[cells["valid"].strip()], reason=cells["reason"],
                   median_us=number_of("median_us", True), min_us=number_of("min_us", True),
                   max_us=number_of("max_us", True), reps=int(reps_text or "0"),
                   total_s=number_of("total_s", False))


def _param(text: str) -> ParamValue:
    """A parameter cell back to its type: integer, else number, else the text."""
    if _INT_RE.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _parse_time(text: str) -> datetime:
    when = datetime.fromisoformat(text)
    # A naive time in this file is UTC; comparing naive with aware times would raise.
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
