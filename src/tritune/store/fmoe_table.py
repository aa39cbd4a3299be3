"""The run-time lookup of tuned fused-MoE rows: `FmoeConfigTable` by (cu_num, shape, token bucket), and the
process-wide table of the default files, read once until `reload_fmoe_configs()`.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from pathlib import Path

from tritune.store.files import ConfigFiles
from tritune.store.fmoe_csv import _read_tuned_rows, default_config_files
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.process_wide import ProcessWide
from tritune.store.provenance import Machine, compare, mismatch_message, warn_once


def token_bucket(tokens: int) -> int:
    """The next power of two >= tokens: 1 -> 1, 3 -> 4, 1024 -> 1024, 1025 -> 2048. tokens < 1: ValueError."""
    tokens = operator.index(tokens)
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    return 1 << (tokens - 1).bit_length()


class FmoeConfigTable:
    """Tuned fused-MoE rows indexed by (cu_num, shape_key()) then by token bucket.

    Rows whose (cu_num, device column, shape_key(), token_bucket(token)) coincide are duplicates: the lower `us`
    is kept (on a tie the one added first) and a one-line warning names both. Rows of different devices that
    share a cu_num (H100 and H200 both have 132 SMs) are all kept; a lookup without a machine serves the lower
    `us`, one with a machine only rows that provenance.compare lets it use. Files are never modified.
    """

    def __init__(self, rows: Sequence[FmoeTuned] = (), origins: Sequence[str] | None = None,
                 files: Sequence[str] | None = None) -> None:
        """`origins[i]` names where rows[i] came from, for duplicate warnings (default "row <i+1>"); `files[i]`
        the file it was read from, for provenance warnings (one per file; default the origin)."""
        origins = origins if origins is not None else [f"row {i + 1}" for i in range(len(rows))]
        files = files if files is not None else origins
        kept: dict[tuple[int, str, tuple, int], tuple[FmoeTuned, str]] = {}
        self._files: dict[FmoeTuned, str] = {}
        for row, origin, file in zip(rows, origins, files, strict=True):
            key = (row.cu_num, dict(row.extra).get("device", ""), row.shape.shape_key(), token_bucket(row.shape.token))
            if key in kept:
                row, origin = self._keep(kept[key], (row, origin), key[3])
            kept[key] = row, origin
            self._files.setdefault(row, file)
        self._rows = [row for row, _ in kept.values()]
        self._origins = {row: origin for row, origin in kept.values()}
        # (cu_num, shape_key) -> bucket -> the rows of that bucket (one per device), lowest us first (stable sort)
        self._index: dict[tuple[int, tuple], dict[int, list[FmoeTuned]]] = {}
        for (cu_num, _, shape_key, bucket), (row, _) in sorted(kept.items(), key=lambda item: item[1][0].us):
            self._index.setdefault((cu_num, shape_key), {}).setdefault(bucket, []).append(row)

    @staticmethod
    def _keep(old: tuple[FmoeTuned, str], new: tuple[FmoeTuned, str], bucket: int) -> tuple[FmoeTuned, str]:
        winner, loser = (new, old) if new[0].us < old[0].us else (old, new)
        warnings.warn(
            f"tritune: duplicate fused-MoE config for cu_num={old[0].cu_num}, token bucket {bucket}, "
            f"{old[0].shape.with_token(bucket).key()}: {old[1]} (us={old[0].us:g}) and {new[1]} "
            f"(us={new[0].us:g}); keeping {winner[1]} (us={winner[0].us:g}) over {loser[1]}", stacklevel=4)
        return winner

    @classmethod
    def from_files(cls, paths: Sequence[Path]) -> FmoeConfigTable:
        """The table of every row of every tuned CSV in `paths` (earlier files win ties). A file that cannot be
        read or parsed raises FmoeCsvError naming it."""
        rows, origins, files = [], [], []
        for path in paths:
            for tuned, row in _read_tuned_rows(Path(path)):
                rows.append(tuned)
                origins.append(row.where())
                files.append(str(path))
        return cls(rows, origins, files)

    @property
    def rows(self) -> list[FmoeTuned]:
        """Every kept row, in the order first seen."""
        return list(self._rows)

    def origin(self, row: FmoeTuned) -> str:
        """Where a kept row came from ("<file>, row N (line L)" for rows read by from_files)."""
        return self._origins[row]

    def lookup(self, cu_num: int, shape: FmoeShape, tokens: int, *, machine: Machine | None = None) -> FmoeTuned | None:
        """The row for `tokens` tokens of `shape` (its own token is ignored) on a GPU with `cu_num` SMs.

        Same cu_num and shape_key(): the row of bucket token_bucket(tokens) if tuned, else the bucket nearest in
        log2 distance (a tie goes to the larger bucket) when it is at most NEAREST_BUCKET_SPAN doublings away.
        None otherwise: a config tuned for 1024 tokens is worse at 8 than the heuristic (measured on H100).
        With `machine` (provenance.running_machine()), rows it may not use are passed over (one warning per file
        when that leaves nothing); a row of another Triton major.minor serves, with one warning per file.
        """
        by_bucket = self._index.get((cu_num, shape.shape_key()))
        if by_bucket is None:
            return None
        want = token_bucket(tokens)
        unchecked = _nearest({b: rows[0] for b, rows in by_bucket.items()}, want)
        if machine is None or unchecked is None:
            return unchecked
        row = _nearest({b: fit for b, rows in by_bucket.items()
                        if (fit := next((r for r in rows if not compare(r.recorded(), machine).skip), None))}, want)
        shown = row if row is not None else unchecked  # the row served, or the skipped one that would have been
        verdict = compare(shown.recorded(), machine)
        if not verdict.ok:
            warn_once(mismatch_message(self._files[shown], shown.recorded(), machine, verdict))
        return row

    def rows_of(self, cu_num: int, shape: FmoeShape, *, machine: Machine | None = None) -> list[FmoeTuned]:
        """The tuned rows of `shape` (its token ignored) on a GPU with `cu_num` SMs, one per token bucket (the row
        `lookup` serves for it; with `machine`, the first it may use), sorted by token: what an op chooses
        between when the asked token count has no row of its own."""
        by_bucket = self._index.get((cu_num, shape.shape_key()), {})
        picked = (next((r for r in rows if machine is None or not compare(r.recorded(), machine).skip), None)
                  for rows in by_bucket.values())
        return sorted((r for r in picked if r is not None), key=lambda r: r.shape.token)


def _nearest(by_bucket: dict[int, FmoeTuned], want: int) -> FmoeTuned | None:
    """The row of bucket `want`, else of the nearest bucket (see lookup); powers of two, so the log2 distance is
    the difference of bit lengths."""
    if want in by_bucket:
        return by_bucket[want]
    if not by_bucket:
        return None
    best = min(by_bucket, key=lambda b: (abs(b.bit_length() - want.bit_length()), -b))
    return by_bucket[best] if abs(best.bit_length() - want.bit_length()) <= NEAREST_BUCKET_SPAN else None


NEAREST_BUCKET_SPAN = 2  # doublings a tuned token bucket may be from the asked one and still serve it


class FmoeFiles(ConfigFiles[list[tuple[FmoeTuned, str]]]):
    """The fused-MoE CSVs the ops read (`default_config_files()`), each parsed once, and the one table of all their
    rows, built on first use; both kept until `reload()`. A malformed file is skipped with one warning naming it and
    the row, column and value at fault; a bad TRITUNE_CONFIG_FMOE raises (nothing is cached: the next call tries
    again)."""

    KIND = "fused-MoE"

    def read(self, path: Path) -> list[tuple[FmoeTuned, str]]:
        return [(tuned, row.where()) for tuned, row in _read_tuned_rows(path)]

    def reload(self) -> None:
        with self._lock:
            super().reload()
            self._table: FmoeConfigTable | None = None

    def table(self) -> FmoeConfigTable:
        with self._lock:
            if self._table is None:
                rows, origins, files = [], [], []
                for path in default_config_files():
                    for tuned, where in self.parsed(path) or ():
                        rows.append(tuned)
                        origins.append(where)
                        files.append(str(path))
                self._table = FmoeConfigTable(rows, origins, files)
            return self._table


_DEFAULT = ProcessWide(FmoeFiles)


def default_table() -> FmoeConfigTable:
    """The process-wide table of default_config_files(), read once until reload_fmoe_configs()."""
    return _DEFAULT.get().table()


def reload_fmoe_configs() -> None:
    """Drop the cached table and files: the next default_table() re-reads TRITUNE_CONFIG_FMOE and the files."""
    _DEFAULT.get().reload()
