"""Fused-MoE tuned-config CSV files in aiter's layout: untuned input rows, tuned output rows, their parsing
by lookup table (never eval), atomic writing, merging, and the run-time lookup by (cu_num, shape, token bucket).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
import operator
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tritune import knobs
from tritune.store.atomic import atomic_write_text
from tritune.store.csv_records import csv_records
from tritune.store.files import ConfigFiles, user_folder
from tritune.store.process_wide import ProcessWide
from tritune.store.provenance import Machine, Recorded, compare, mismatch_message, warn_once

T = TypeVar("T")

PACKAGE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"

UNTUNED_COLUMNS = ("token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
                   "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1")
TUNED_COLUMNS = ("cu_num", *UNTUNED_COLUMNS, "block_m", "ksplit", "us1", "kernelName1", "err1", "us2",
                 "kernelName2", "err2", "us", "run_1stage", "tflops", "bw")

# Written form -> canonical value. The first spelling of each canonical value is the one written.
_ACT = {"ActivationType.Silu": "silu", "ActivationType.Gelu": "gelu",
        "Silu": "silu", "Gelu": "gelu", "silu": "silu", "gelu": "gelu"}
_QTYPE = {"QuantType.No": "none", "QuantType.per_Token": "per_token", "QuantType.per_1x128": "per_1x128",
          "No": "none", "per_Token": "per_token", "per_1x128": "per_1x128"}
# Both fp8 spellings of aiter's (AMD) files mean fp8 e4m3 here: NVIDIA has only the "fn" variant.
_QDTYPE = {"dtypes.bf16": "bf16", "dtypes.fp16": "fp16", "dtypes.fp8": "fp8",
           "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float8_e4m3fn": "fp8",
           "torch.float8_e4m3fnuz": "fp8", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
_DTYPE = {text: value for text, value in _QDTYPE.items() if value != "fp8"}
_BOOL = {"True": True, "False": False, "true": True, "false": False, "1": True, "0": False}


def _written(table: dict[str, T]) -> dict[T, str]:
    """Canonical value -> its first spelling in `table` (the written one), in first-seen order."""
    return {value: next(t for t, v in table.items() if v == value) for value in dict.fromkeys(table.values())}


_ACT_OUT, _QTYPE_OUT, _QDTYPE_OUT, _BOOL_OUT = _written(_ACT), _written(_QTYPE), _written(_QDTYPE), _written(_BOOL)
_DTYPE_OUT = _written(_DTYPE)
_INT_RE = re.compile(r"[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


# tritune writes its fused-MoE kernel names with their launch fields, BLOCK_SIZE_M first, e.g.
# "moe_stage1_per_token_silu_BM64_BN128_BK128_GM8_W8_S3_KS1" (tritune.kernels.fused_moe.MoeConfig.name; a test keeps
# this reading of it in step). Another tool's names (aiter's) carry no BLOCK_SIZE_M tritune can read.
_OUR_KERNEL_NAME = re.compile(rf"moe_(?:stage1|stage2|1stage)_(?:{'|'.join(_QTYPE_OUT)})_"
                              rf"(?:{'|'.join(_ACT_OUT)})_BM([0-9]+)(?:_[A-Z]+[0-9]+)*")


def name_block_m(name: str) -> int | None:
    """The BLOCK_SIZE_M of a kernel name tritune wrote; None for any other name (not checked against block_m)."""
    match = _OUR_KERNEL_NAME.fullmatch(name)
    return int(match[1]) if match else None


class FmoeCsvError(ValueError):
    """A fused-MoE CSV file that cannot be read: one line naming the file, row, line, column and value."""


def _quant_fault(dtype: str, q_type: str, q_dtype_a: str, q_dtype_w: str) -> tuple[str, str] | None:
    """(column, why) when the quantised dtypes do not fit q_type, else None.

    q_type none: activations and weights stay in `dtype`; per_token / per_1x128: both are fp8.
    """
    want = dtype if q_type == "none" else "fp8"
    for column, value in (("q_dtype_a", q_dtype_a), ("q_dtype_w", q_dtype_w)):
        if value != want:
            return column, (f"value {_QDTYPE_OUT.get(value, value)!r} does not fit q_type "
                            f"{_QTYPE_OUT.get(q_type, q_type)}; expected {_QDTYPE_OUT.get(want, want)}")
    return None


def _check(obj: object, names: Sequence[str], ok: Callable[[object], bool], expected: str) -> None:
    for name in names:
        if not ok(value := getattr(obj, name)):
            raise ValueError(f"{type(obj).__name__}.{name}={value!r}: expected {expected}")


def _is_pos_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_time(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class FmoeShape:
    """One fused-MoE problem (one untuned row): hidden states [token, model_dim] routed to `topk` of `expert`
    experts with up/gate weights [(2 if use_g1u1 else 1) * inter_dim, model_dim] and down [model_dim, inter_dim].
    Canonical values, checked on construction (ValueError): act_type "silu"|"gelu"; dtype "bf16"|"fp16";
    q_dtype_a/q_dtype_w "bf16"|"fp16"|"fp8"; q_type "none"|"per_token"|"per_1x128"."""

    token: int
    model_dim: int
    inter_dim: int
    expert: int
    topk: int
    act_type: str
    dtype: str
    q_dtype_a: str
    q_dtype_w: str
    q_type: str
    use_g1u1: bool
    doweight_stage1: bool

    def __post_init__(self) -> None:
        _check(self, ("token", "model_dim", "inter_dim", "expert", "topk"), _is_pos_int, "an integer >= 1")
        if self.topk > self.expert:
            raise ValueError(f"FmoeShape.topk={self.topk} exceeds expert={self.expert}")
        for name, allowed in (("act_type", _ACT_OUT), ("dtype", _DTYPE_OUT), ("q_dtype_a", _QDTYPE_OUT),
                              ("q_dtype_w", _QDTYPE_OUT), ("q_type", _QTYPE_OUT)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"FmoeShape.{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        _check(self, ("use_g1u1", "doweight_stage1"), lambda v: isinstance(v, bool), "a bool")
        fault = _quant_fault(self.dtype, self.q_type, self.q_dtype_a, self.q_dtype_w)
        if fault:
            raise ValueError(f"FmoeShape.{fault[0]}: {fault[1]}")

    def shape_key(self) -> tuple:
        """Every field except token: what a run-time lookup matches exactly (token goes by bucket)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "token")

    def key(self) -> str:
        """Stable text of all fields, token included, e.g. "token=16,model_dim=7168,...,doweight_stage1=False"."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def with_token(self, token: int) -> FmoeShape:
        """This shape with another token count (e.g. the bucket a lookup resolved to)."""
        return dataclasses.replace(self, token=token)


_TUNED_FLOATS = ("us1", "err1", "us2", "err2", "us", "tflops", "bw")


@dataclass(frozen=True)
class FmoeTuned:
    """One tuned row: the winning kernels for `shape` on a GPU with `cu_num` SMs and what they measured.

    Times in microseconds, err1/err2 as fractions (0.005 is written "0.5%"), bw in GB/s. A 1-stage winner has
    us2=0, kernelName2="", err2=0. `extra` holds provenance columns (name, value) in order; values become
    stripped str and empty ones are dropped, so a row reads back equal to what was written.
    Construction checks every field (ValueError): block_m >= 1; cu_num >= 0 (0: tuned by Triton's interpreter, no
    GPU, so no GPU ever looks it up); ksplit >= 0 (aiter writes 0 for "no split"); floats finite and >= 0;
    kernelName1 non-empty.
    """

    cu_num: int
    shape: FmoeShape
    block_m: int
    ksplit: int
    us1: float
    kernelName1: str
    err1: float
    us2: float
    kernelName2: str
    err2: float
    us: float
    run_1stage: bool
    tflops: float
    bw: float
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _check(self, ("shape",), lambda v: isinstance(v, FmoeShape), "an FmoeShape")
        _check(self, ("block_m",), _is_pos_int, "an integer >= 1")
        _check(self, ("cu_num", "ksplit"), lambda v: v == 0 or _is_pos_int(v), "an integer >= 0")
        _check(self, _TUNED_FLOATS, _is_time, "a finite number >= 0")
        _check(self, ("kernelName1",), lambda v: isinstance(v, str) and v != "", "a kernel name")
        _check(self, ("kernelName2",), lambda v: isinstance(v, str), "a str ('' for a 1-stage winner)")
        _check(self, ("run_1stage",), lambda v: isinstance(v, bool), "a bool")
        for name in _TUNED_FLOATS:
            object.__setattr__(self, name, float(getattr(self, name)))
        # Stored as the file holds them: values stripped, empty ones left out (a missing cell reads as absent).
        extra = tuple((name, str(value).strip()) for name, value in self.extra if str(value).strip())
        names = [name for name, _ in self.extra]
        bad = [n for n in names if not isinstance(n, str) or not n or n != n.strip() or n in TUNED_COLUMNS]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"FmoeTuned.extra names {names}: expected distinct non-empty names that are not "
                             "fixed columns")
        object.__setattr__(self, "extra", extra)

    def key(self) -> tuple[int, FmoeShape]:
        """What merge_tuned replaces on: (cu_num, shape), token included."""
        return self.cu_num, self.shape

    def recorded(self) -> Recorded:
        """The row's provenance: its `device`, `triton` and `torch` columns (when present) and its cu_num (0 reads
        as interpreted)."""
        extra = dict(self.extra)
        return Recorded(name=extra.get("device"), sm_count=self.cu_num, triton_version=extra.get("triton"),
                        torch_version=extra.get("torch"))


@dataclass(frozen=True)
class _Row:
    """One data row of a file, with where it is, for error messages."""

    path: Path
    number: int  # 1-based among data rows (blank lines not counted)
    line: int  # 1-based line of the file where the row ends
    cells: dict[str, str]

    def where(self) -> str:
        return f"{self.path}, row {self.number} (line {self.line})"

    def error(self, column: str, why: str) -> FmoeCsvError:
        return FmoeCsvError(f"{self.where()}, column '{column}': {why}")

    def take(self, column: str, parse: Callable[[str], T]) -> T:
        try:
            return parse(self.cells[column])
        except ValueError as err:
            raise self.error(column, str(err)) from None


def _table(table: dict[str, T], expected: Sequence[str]) -> Callable[[str], T]:
    def parse(text: str) -> T:
        if text in table:
            return table[text]
        what = "empty value" if not text else f"unknown value {text!r}"
        raise ValueError(f"{what}; expected one of {', '.join(expected)}")
    return parse


def _dtype(text: str) -> str:
    if _QDTYPE.get(text) == "fp8":
        raise ValueError(f"value {text!r} is not allowed as dtype (only q_dtype_a/q_dtype_w may be fp8); "
                         f"expected one of {', '.join(_DTYPE_OUT.values())}")
    return _DTYPE_PARSE(text)


def _pos_int(text: str, least: int = 1) -> int:
    if not _INT_RE.fullmatch(text) or int(text) < least:
        raise ValueError(f"bad value {text!r}; expected a base-10 integer >= {least}")
    return int(text)


def _number(text: str) -> float:
    value = float(text) if _FLOAT_RE.fullmatch(text) else math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"bad value {text!r}; expected a finite number >= 0")
    return value


def _err(text: str) -> float:
    try:
        return _number(text[:-1].strip()) / 100 if text.endswith("%") else _number(text)
    except ValueError:
        raise ValueError(f"bad value {text!r}; expected a percentage like '0.5%' or a fraction >= 0") from None


def _kernel_name(text: str) -> str:
    if not text:
        raise ValueError("empty value; expected a kernel name")
    return text


_ACT_PARSE = _table(_ACT, list(_ACT_OUT.values()))
_DTYPE_PARSE = _table(_DTYPE, list(_DTYPE_OUT.values()))
_QDTYPE_PARSE = _table(_QDTYPE, list(_QDTYPE_OUT.values()))
_QTYPE_PARSE = _table(_QTYPE, list(_QTYPE_OUT.values()))
_BOOL_PARSE = _table(_BOOL, list(_BOOL))


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


def _shape(row: _Row) -> FmoeShape:
    ints = {name: row.take(name, _pos_int) for name in ("token", "model_dim", "inter_dim", "expert", "topk")}
    if ints["topk"] > ints["expert"]:
        raise row.error("topk", f"value {row.cells['topk']!r} exceeds expert={ints['expert']}; expected topk <= expert")
    dtype, q_type = row.take("dtype", _dtype), row.take("q_type", _QTYPE_PARSE)
    q_dtype_a, q_dtype_w = row.take("q_dtype_a", _QDTYPE_PARSE), row.take("q_dtype_w", _QDTYPE_PARSE)
    fault = _quant_fault(dtype, q_type, q_dtype_a, q_dtype_w)
    if fault:
        raise row.error(*fault)
    return FmoeShape(**ints, act_type=row.take("act_type", _ACT_PARSE), dtype=dtype, q_dtype_a=q_dtype_a,
                     q_dtype_w=q_dtype_w, q_type=q_type, use_g1u1=row.take("use_g1u1", _BOOL_PARSE),
                     doweight_stage1=row.take("doweight_stage1", _BOOL_PARSE))


def read_untuned(path: Path) -> list[FmoeShape]:
    """The problems of an untuned CSV (required columns UNTUNED_COLUMNS in any order; others ignored, so a tuned
    file is valid input). Header only: []. FmoeCsvError (one line: file, row, line, column, value) otherwise."""
    _, rows = _read_rows(path, UNTUNED_COLUMNS)
    return [_shape(row) for row in rows]


def _read_tuned_rows(path: Path) -> list[tuple[FmoeTuned, _Row]]:
    header, rows = _read_rows(path, TUNED_COLUMNS)
    extras = [name for name in header if name not in TUNED_COLUMNS]
    out = []
    for row in rows:
        take = row.take
        tuned = FmoeTuned(
            cu_num=take("cu_num", functools.partial(_pos_int, least=0)), shape=_shape(row),
            block_m=take("block_m", _pos_int),
            ksplit=take("ksplit", functools.partial(_pos_int, least=0)), us1=take("us1", _number),
            kernelName1=take("kernelName1", _kernel_name), err1=take("err1", _err), us2=take("us2", _number),
            kernelName2=row.cells["kernelName2"], err2=take("err2", _err), us=take("us", _number),
            run_1stage=take("run_1stage", _BOOL_PARSE), tflops=take("tflops", _number), bw=take("bw", _number),
            extra=tuple((name, row.cells[name]) for name in extras if row.cells[name]))
        for column in ("kernelName1", "kernelName2"):  # block_m must be the BLOCK_SIZE_M the kernels were built with
            name = row.cells[column]
            if (bm := name_block_m(name)) is not None and bm != tuned.block_m:
                raise row.error("block_m", f"value {row.cells['block_m']!r} is not the BLOCK_SIZE_M of {column} "
                                           f"{name!r} ({bm})")
        out.append((tuned, row))
    return out


def read_tuned(path: Path) -> list[FmoeTuned]:
    """The rows of a tuned CSV (all TUNED_COLUMNS required, any order; any other named column is provenance,
    kept in `extra` in header order, empty cells left out). A missing file is an FmoeCsvError like any fault."""
    return [tuned for tuned, _ in _read_tuned_rows(path)]


def _shape_cells(s: FmoeShape) -> list[str]:
    """UNTUNED_COLUMNS of a shape, in their written forms."""
    return [str(s.token), str(s.model_dim), str(s.inter_dim), str(s.expert), str(s.topk), _ACT_OUT[s.act_type],
            _QDTYPE_OUT[s.dtype], _QDTYPE_OUT[s.q_dtype_a], _QDTYPE_OUT[s.q_dtype_w], _QTYPE_OUT[s.q_type],
            _BOOL_OUT[s.use_g1u1], _BOOL_OUT[s.doweight_stage1]]


def _cells(row: FmoeTuned) -> list[str]:
    return [str(row.cu_num), *_shape_cells(row.shape), str(row.block_m), str(row.ksplit), f"{row.us1:.2f}",
            row.kernelName1, format_err(row.err1), f"{row.us2:.2f}", row.kernelName2, format_err(row.err2),
            f"{row.us:.2f}", _BOOL_OUT[row.run_1stage], f"{row.tflops:.2f}", f"{row.bw:.2f}"]


def write_untuned(path: Path, shapes: Sequence[FmoeShape]) -> None:
    """Write an untuned CSV of `shapes` (UNTUNED_COLUMNS, the written forms `read_untuned` reads back) atomically."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(UNTUNED_COLUMNS)
    writer.writerows(_shape_cells(s) for s in shapes)
    atomic_write_text(Path(path), out.getvalue())


def format_err(err: float) -> str:
    """An error fraction as the file writes it: 0.005 -> "0.5%"."""
    return f"{100 * err:.4g}%"


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
