"""Fused-MoE CSV rows: the records `FmoeShape` and `FmoeTuned`, the cell parsing by lookup table (never eval)
with one-line errors, and the canonical written form of each cell.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tritune.store.provenance import Recorded

T = TypeVar("T")

UNTUNED_COLUMNS = ("token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_dtype_a",
                   "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1")
TUNED_COLUMNS = ("cu_num", *UNTUNED_COLUMNS, "block_m", "ksplit", "us1", "kernelName1", "err1", "us2",
                 "kernelName2", "err2", "us", "run_1stage", "tflops", "bw")

# Written form -> canonical value. The first spelling of each canonical value is the one written.
_ACT = {"ActivationType.Silu": "silu", "ActivationType.Gelu": "gelu",
        "Silu": "silu", "Gelu": "gelu", "silu": "silu", "gelu": "gelu"}
_QTYPE = {"QuantType.No": "none", "QuantType.per_Token": "per_token", "QuantType.per_1x128": "per_1x128",
          "QuantType.per_1x32": "per_1x32",
          "No": "none", "per_Token": "per_token", "per_1x128": "per_1x128", "per_1x32": "per_1x32"}
# Both fp8 spellings of aiter's (AMD) files mean fp8 e4m3 here: NVIDIA has only the "fn" variant.
_QDTYPE = {"dtypes.bf16": "bf16", "dtypes.fp16": "fp16", "dtypes.fp8": "fp8",
           "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float8_e4m3fn": "fp8",
           "torch.float8_e4m3fnuz": "fp8", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8",
           "dtypes.fp4x2": "fp4x2", "fp4x2": "fp4x2"}  # aiter's name for MXFP4's packed e2m1 pairs (weights only)
_DTYPE = {text: value for text, value in _QDTYPE.items() if value not in ("fp8", "fp4x2")}
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
_OUR_KERNEL_NAME = re.compile(rf"moe_(?:stage1|stage2|1stage)_(?:{'|'.join([*_QTYPE_OUT, 'per_1x32_a8'])})_"
                              rf"(?:{'|'.join(_ACT_OUT)})_BM([0-9]+)(?:_[A-Z]+[0-9]+)*")


def name_block_m(name: str) -> int | None:
    """The BLOCK_SIZE_M of a kernel name tritune wrote; None for any other name (not checked against block_m)."""
    match = _OUR_KERNEL_NAME.fullmatch(name)
    return int(match[1]) if match else None


class FmoeCsvError(ValueError):
    """A fused-MoE CSV file that cannot be read: one line naming the file, row, line, column and value."""


def _quant_fault(dtype: str, q_type: str, q_dtype_a: str, q_dtype_w: str) -> tuple[str, str] | None:
    """(column, why) when the quantised dtypes do not fit q_type, else None.

    q_type none: activations and weights stay in `dtype`; per_token / per_1x128: both are fp8; per_1x32 (MXFP4):
    weights fp4x2, activations in `dtype` or fp8 (per token).
    """
    want_a, want_w = {"none": (dtype, dtype), "per_1x32": (dtype, "fp4x2")}.get(q_type, ("fp8", "fp8"))
    if q_type == "per_1x32" and q_dtype_a == "fp8":
        want_a = "fp8"
    for column, value, want in (("q_dtype_a", q_dtype_a, want_a), ("q_dtype_w", q_dtype_w, want_w)):
        if value != want:
            also = f" or {_QDTYPE_OUT['fp8']}" if q_type == "per_1x32" and column == "q_dtype_a" else ""
            return column, (f"value {_QDTYPE_OUT.get(value, value)!r} does not fit q_type "
                            f"{_QTYPE_OUT.get(q_type, q_type)}; expected {_QDTYPE_OUT.get(want, want)}{also}")
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
    q_dtype_a/q_dtype_w "bf16"|"fp16"|"fp8" (q_dtype_w also "fp4x2"); q_type "none"|"per_token"|"per_1x128"|
    "per_1x32" (MXFP4: weights fp4x2, activations in dtype or fp8). `quant` is the kernels' name for it."""

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

    @property
    def quant(self) -> str:
        """The kernels' quantization: q_type, except MXFP4 weights with fp8 activations, "per_1x32_a8"."""
        return "per_1x32_a8" if self.q_type == "per_1x32" and self.q_dtype_a == "fp8" else self.q_type

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
    if _QDTYPE.get(text) in ("fp8", "fp4x2"):
        raise ValueError(f"value {text!r} is not allowed as dtype (only q_dtype_a/q_dtype_w may be fp8 or fp4x2); "
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


def _tuned(row: _Row, extras: Sequence[str]) -> FmoeTuned:
    """The FmoeTuned of a tuned file's row; `extras` names its provenance columns, in header order."""
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
    return tuned


def _shape_cells(s: FmoeShape) -> list[str]:
    """UNTUNED_COLUMNS of a shape, in their written forms."""
    return [str(s.token), str(s.model_dim), str(s.inter_dim), str(s.expert), str(s.topk), _ACT_OUT[s.act_type],
            _QDTYPE_OUT[s.dtype], _QDTYPE_OUT[s.q_dtype_a], _QDTYPE_OUT[s.q_dtype_w], _QTYPE_OUT[s.q_type],
            _BOOL_OUT[s.use_g1u1], _BOOL_OUT[s.doweight_stage1]]


def _cells(row: FmoeTuned) -> list[str]:
    return [str(row.cu_num), *_shape_cells(row.shape), str(row.block_m), str(row.ksplit), f"{row.us1:.2f}",
            row.kernelName1, format_err(row.err1), f"{row.us2:.2f}", row.kernelName2, format_err(row.err2),
            f"{row.us:.2f}", _BOOL_OUT[row.run_1stage], f"{row.tflops:.2f}", f"{row.bw:.2f}"]


def format_err(err: float) -> str:
    """An error fraction as the file writes it: 0.005 -> "0.5%"."""
    return f"{100 * err:.4g}%"
