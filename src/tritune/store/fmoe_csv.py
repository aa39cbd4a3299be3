"""Fused-MoE tuned-config CSV files in aiter's layout: reading untuned and tuned files, atomic writing, merging,
and where the files are (shipped, TRITUNE_CONFIG_DIR, TRITUNE_CONFIG_FMOE).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from tritune import knobs
from tritune.store.atomic import atomic_write_text
from tritune.store.csv_records import csv_records
from tritune.store.files import user_folder
from tritune.store.fmoe_rows import (
    TUNED_COLUMNS,
    UNTUNED_COLUMNS,
    FmoeCsvError,
    FmoeShape,
    FmoeTuned,
    _cells,
    _Row,
    _shape,
    _shape_cells,
    _tuned,
)

PACKAGE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

def _read_rows(path: Path, required: Sequence[str]) -> tuple[list[str], list[_Row]]:
    """The header (names stripped; unnamed columns dropped) and the non-blank data rows of a CSV file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FmoeCsvError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise FmoeCsvError(f"{path}: cannot read: {err}".replace("\n", " ")) from None

    def check_header(header: list[str]) -> None:
        missing = [name for name in required if name not in header]
        if missing:
            raise FmoeCsvError(f"{path}: missing required column(s): {', '.join(missing)}")

    header, records = csv_records(path, text, FmoeCsvError, check_header)
    if header is None:
        raise FmoeCsvError(f"{path}: empty file (no header)")
    rows = [_Row(path, number, line, {name: cell.strip() for name, cell in zip(header, record, strict=True) if name})
            for number, line, record in records]
    return [name for name in header if name], rows


def read_untuned(path: Path) -> list[FmoeShape]:
    """The problems of an untuned CSV (required columns UNTUNED_COLUMNS in any order; others ignored, so a tuned
    file is valid input). Header only: []. FmoeCsvError (one line: file, row, line, column, value) otherwise."""
    _, rows = _read_rows(path, UNTUNED_COLUMNS)
    return [_shape(row) for row in rows]


def _read_tuned_rows(path: Path) -> list[tuple[FmoeTuned, _Row]]:
    header, rows = _read_rows(path, TUNED_COLUMNS)
    extras = [name for name in header if name not in TUNED_COLUMNS]
    return [(_tuned(row, extras), row) for row in rows]


def read_tuned(path: Path) -> list[FmoeTuned]:
    """The rows of a tuned CSV (all TUNED_COLUMNS required, any order; any other named column is provenance,
    kept in `extra` in header order, empty cells left out). A missing file is an FmoeCsvError like any fault."""
    return [tuned for tuned, _ in _read_tuned_rows(path)]


def write_untuned(path: Path, shapes: Sequence[FmoeShape]) -> None:
    """Write an untuned CSV of `shapes` (UNTUNED_COLUMNS, the written forms `read_untuned` reads back) atomically."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(UNTUNED_COLUMNS)
    writer.writerows(_shape_cells(s) for s in shapes)
    atomic_write_text(Path(path), out.getvalue())


def tuned_csv_text(rows: Sequence[FmoeTuned]) -> str:
    """The file text of `rows`: TUNED_COLUMNS then the union of the rows' provenance names (first seen first;
    a row lacking one gets an empty cell), canonical written forms, '\\n' line ends."""
    extras: dict[str, None] = {}
    for row in rows:
        extras.update((name, None) for name, _ in row.extra)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*TUNED_COLUMNS, *extras])
    for row in rows:
        given = dict(row.extra)
        writer.writerow([*_cells(row), *(given.get(name, "") for name in extras)])
    return out.getvalue()


def write_tuned(path: Path, rows: Sequence[FmoeTuned]) -> None:
    """Replace `path` with `rows` atomically (the old file stays intact if anything fails).

    A read-merge-write must hold `atomic.path_lock(path)` around the read and this call (the lock is re-entrant).
    """
    atomic_write_text(Path(path), tuned_csv_text(rows))


def merge_tuned(existing: Sequence[FmoeTuned], new: Sequence[FmoeTuned]) -> list[FmoeTuned]:
    """`existing` with `new` merged in by key (cu_num, shape) — token included.

    A new row takes the place of the first existing row with its key (later existing rows with that key are
    dropped); new rows with unseen keys are appended in order; among new rows of one key the last wins.
    Existing duplicates of keys not in `new` are kept as they were.
    """
    latest = {row.key(): row for row in new}
    out: list[FmoeTuned] = []
    placed: set[tuple[int, FmoeShape]] = set()
    for row in [*existing, *new]:  # every new row's key is in `latest`: the first sighting places the winner
        key = row.key()
        if key not in latest:
            out.append(row)
        elif key not in placed:
            out.append(latest[key])
            placed.add(key)
    return out


def package_config_files() -> list[Path]:
    """The shipped files: configs/tuned_fmoe.csv (if present), then sorted configs/model_configs/*tuned_fmoe*.csv."""
    main = PACKAGE_CONFIGS / "tuned_fmoe.csv"
    models = sorted((PACKAGE_CONFIGS / "model_configs").glob("*tuned_fmoe*.csv"))
    return ([main] if main.is_file() else []) + [p for p in models if p.is_file()]


USER_FILE_NAME = "tuned_fmoe.csv"  # the one fused-MoE file read from TRITUNE_CONFIG_DIR (online tunes go there)


def user_config_file() -> Path | None:
    """<TRITUNE_CONFIG_DIR>/tuned_fmoe.csv when the variable is set (the file need not exist), else None; a bad
    TRITUNE_CONFIG_DIR is warned about and ignored, as every store does (`store.files.user_folder`)."""
    folder = user_folder()
    return None if folder is None else folder / USER_FILE_NAME


def default_config_files() -> list[Path]:
    """The fused-MoE CSVs the ops read: <TRITUNE_CONFIG_DIR>/tuned_fmoe.csv when it exists, then TRITUNE_CONFIG_FMOE's
    files when set (a missing one is a ValueError from knobs), else the shipped ones."""
    user = user_config_file()
    return ([user] if user is not None and user.is_file() else []) + (knobs.fmoe_config_files()
                                                                      or package_config_files())
