"""The CSV reading every tritune table shares (the tuned fused-MoE file, AOT perf statistics): blank lines
skipped, one header with no repeated names, every row as wide as the header, and each fault one line naming
the file, row and line; the table's own checks and cell parsing stay with the table."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path


def csv_records(path: Path, text: str, error: type[Exception],
                check_header: Callable[[list[str]], None]) -> tuple[list[str] | None, list[tuple[int, int, list[str]]]]:
    """(header with names stripped, [(row number, line, record as written)]) of the non-blank rows of `text`;
    header None when there is none. `check_header(header)` runs as soon as the header is read, so a wrong header
    is reported before any row. Faults raise `error` with one line naming `path`."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    rows: list[tuple[int, int, list[str]]] = []
    try:
        for record in reader:
            if not any(cell.strip() for cell in record):
                continue  # blank line
            if header is None:
                header = [cell.strip() for cell in record]
                dup = sorted({name for name in header if name and header.count(name) > 1})
                if dup:
                    raise error(f"{path}: column(s) {', '.join(dup)} appear more than once in the header")
                check_header(header)
                continue
            number = len(rows) + 1
            if len(record) != len(header):
                raise error(f"{path}, row {number} (line {reader.line_num}): {len(record)} fields, but the "
                            f"header has {len(header)}")
            rows.append((number, reader.line_num, record))
    except csv.Error as err:
        raise error(f"{path}, line {reader.line_num}: malformed CSV: {err}") from None
    return header, rows
