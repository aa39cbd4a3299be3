"""The run spec of docs/AOT.md (`specs/<kernel>.spec`): its dataclass, text form, and resolution.

`resolve` computes exactly what `csrc/main.c` computes before it touches CUDA (files, values, integer and
float arguments, grid), so a bundle is checked at build time; `check_specialization` is the main's exit-5
check. Lines are evaluated in file order: a name must be defined before it is used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritune import expr
from tritune.aot.tdat import TensorHeader, first_element, read_header

HEADER = "tritune-spec 1"
ROLES = ("in", "out", "scratch", "i32", "i64", "f32")
FILE_ROLES = ("in", "out")  # numel() and first() take these
POINTER_ROLES = ("in", "out", "scratch")
INT_ROLES = ("i32", "i64")  # visible to later expressions by name
EXPR_ROLES = ("scratch", "i32", "i64")
ARG_TYPES = {"p": POINTER_ROLES, "i": ("i32",), "l": ("i64",), "f": ("f32",)}  # tritune_argdesc.type -> roles
HINTS = (0, 1, 16)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Same grammar as main.c's number check; no inf/nan, no underscores, no hex, so strtod and float() agree.
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
FLOAT32_MAX = 3.4028234663852886e38
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
GRID_MAX = ((1 << 31) - 1, 65535, 65535)  # CUDA's launch limits per dimension


class SpecError(ValueError):
    """A run spec that does not parse, cannot be evaluated, or does not fit an artifact."""


@dataclass(frozen=True)
class SpecArg:
    """One kernel argument: `text` is a FILE (in/out), an EXPR (scratch bytes, i32, i64) or a NUMBER (f32)."""

    name: str
    role: str
    text: str


@dataclass(frozen=True)
class SpecTolerance:
    """The accuracy check: an element mismatches when NaN/Inf or |out-ref| > atol + rtol*|ref|."""

    atol: float
    rtol: float
    max_mismatch_ratio: float
    max_rel_l2: float

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "max_mismatch_ratio", "max_rel_l2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SpecError(f"tolerance {name}={value!r} must be a finite number >= 0")
            object.__setattr__(self, name, float(value))


@dataclass(frozen=True)
class SpecItem:
    """A value or an arg, as one line of the spec (what `evaluation_order` lists)."""

    kind: str  # value | arg
    name: str
    text: str
    role: str = ""  # args only

    @property
    def is_expr(self) -> bool:
        return self.kind == "value" or self.role in EXPR_ROLES


@dataclass(frozen=True)
class RunSpec:
    """A kernel's run spec, shared by all its configs. `values` are (name, expr) pairs; `grid` three exprs.

    Values may use args and args may use values; `to_text` writes them interleaved so each name is defined
    before it is used, keeping the order within `values` and within `args`.
    """

    kernel: str
    values: tuple[tuple[str, str], ...]
    args: tuple[SpecArg, ...]
    grid: tuple[str, str, str]
    tolerance: SpecTolerance

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple((str(n), str(e)) for n, e in self.values))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "grid", tuple(str(g) for g in self.grid))
        _validate(self)

    def to_text(self) -> str:
        """The spec file's text (TAB-separated, ends with a newline); `RunSpec.parse` reads it back equal."""
        lines = [HEADER, f"kernel\t{self.kernel}"]
        for item in evaluation_order(self):
            if item.kind == "value":
                lines.append(f"value\t{item.name}\t{item.text}")
            else:
                lines.append(f"arg\t{item.name}\t{item.role}\t{item.text}")
        lines.append("grid\t" + "\t".join(self.grid))
        tol = self.tolerance
        lines.append(f"tolerance\t{tol.atol!r}\t{tol.rtol!r}\t{tol.max_mismatch_ratio!r}\t{tol.max_rel_l2!r}")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, source: str = "<spec>") -> RunSpec:
        """Read a spec file's text; errors are SpecError("<source>:<line>: what")."""
        return _parse(text, source)


def _items(spec: RunSpec) -> list[SpecItem]:
    return [SpecItem("value", n, e) for n, e in spec.values] + [
        SpecItem("arg", a.name, a.text, a.role) for a in spec.args
    ]


def _check_field(what: str, text: str) -> None:
    if not isinstance(text, str) or not text or "\t" in text or "\n" in text or "\r" in text:
        raise SpecError(f"{what} {text!r} must be non-empty text without tabs or newlines")


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SpecError(f"{what} name {name!r} is not an identifier")


def _check_float(what: str, text: str) -> float:
    if not _NUMBER.fullmatch(text):
        raise SpecError(f"{what} {text!r} is not a decimal number")
    value = float(text)
    if abs(value) > FLOAT32_MAX:
        raise SpecError(f"{what} {text!r} does not fit in a float32")
    return value


def _check_expr(what: str, text: str) -> None:
    _check_field(what, text)
    try:
        expr.check(text)
    except expr.ExprError as e:
        raise SpecError(f"{what}: {e}") from None


def _references(text: str, by_name: Mapping[str, SpecItem]) -> set[str]:
    """The spec names expression `text` needs defined before it; SpecError when it misuses one."""
    needed = set()
    for name in expr.variables_used(text):
        item = by_name.get(name)
        if item is None:
            continue  # an artifact parameter, checked at resolve
        if item.kind == "arg" and item.role not in INT_ROLES:
            raise SpecError(f"'{name}' is a {item.role} argument, not an integer (use numel() or first())")
        needed.add(name)
    for name in expr.args_used(text):
        item = by_name.get(name)
        if item is None or item.kind != "arg":
            raise SpecError(f"numel()/first() of '{name}', which is not an argument")
        if item.role not in FILE_ROLES:
            raise SpecError(f"numel()/first() of '{name}', a {item.role} argument (want in or out)")
        needed.add(name)
    return needed


def _validate(spec: RunSpec) -> None:
    _check_name("kernel", spec.kernel)
    seen: set[str] = set()
    for item in _items(spec):
        _check_name(item.kind, item.name)
        if item.name in seen:
            raise SpecError(f"name '{item.name}' is defined twice")
        seen.add(item.name)
        what = f"{item.kind} '{item.name}'"
        if item.kind == "arg" and item.role not in ROLES:
            raise SpecError(f"{what}: unknown role {item.role!r} (want one of {' '.join(ROLES)})")
        if item.is_expr:
            _check_expr(what, item.text)
        elif item.role == "f32":
            _check_float(what, item.text)
        else:
            _check_field(f"{what} file", item.text)
    if len(spec.grid) != 3:
        raise SpecError(f"grid has {len(spec.grid)} expressions, want 3")
    for i, text in enumerate(spec.grid):
        _check_expr(f"grid[{i}]", text)
    if not isinstance(spec.tolerance, SpecTolerance):
        raise SpecError(f"tolerance must be a SpecTolerance, got {type(spec.tolerance).__name__}")
    evaluation_order(spec)  # raises on a cycle or a misused name
    by_name = {item.name: item for item in _items(spec)}
    for i, text in enumerate(spec.grid):
        try:
            _references(text, by_name)
        except SpecError as e:
            raise SpecError(f"grid[{i}]: {e}") from None


def evaluation_order(spec: RunSpec) -> list[SpecItem]:
    """Values and args in an order that defines each name before its use, each kind keeping its own order.

    Greedy merge of the two sequences: taking any head whose needs are met never blocks the other, so this
    finds an order whenever one exists.
    """
    by_name = {item.name: item for item in _items(spec)}
    queues = [
        [SpecItem("value", n, e) for n, e in spec.values],
        [SpecItem("arg", a.name, a.text, a.role) for a in spec.args],
    ]
    needs = {}
    for item in by_name.values():
        try:
            needs[item.name] = _references(item.text, by_name) if item.is_expr else set()
        except SpecError as e:
            raise SpecError(f"{item.kind} '{item.name}': {e}") from None
    done: set[str] = set()
    order: list[SpecItem] = []
    while queues[0] or queues[1]:
        for queue in queues:
            if queue and needs[queue[0].name] <= done:
                item = queue.pop(0)
                order.append(item)
                done.add(item.name)
                break
        else:
            stuck = ", ".join(f"{q[0].kind} '{q[0].name}' needs {sorted(needs[q[0].name] - done)}" for q in queues if q)
            raise SpecError(f"no order defines every name before its use (a cycle, or values out of order): {stuck}")
    return order


def _parse(text: str, source: str) -> RunSpec:
    lines = text.split("\n")
    if lines[0].rstrip("\r") != HEADER:
        raise SpecError(f"{source}:1: first line must be '{HEADER}', got {lines[0][:40]!r}")
    kernel = grid = tolerance = None
    items: list[tuple[int, SpecItem]] = []
    defined: dict[str, int] = {}
    refs: list[tuple[int, str]] = []  # (line, expression) to check against definitions once all are read
    wanted = {"kernel": 2, "value": 3, "arg": 4, "grid": 4, "tolerance": 5}
    for lineno, line in enumerate(lines[1:], start=2):
        line = line.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        keyword = fields[0]
        try:
            if keyword not in wanted:
                raise SpecError(f"unknown line kind {keyword!r} (want {', '.join(wanted)})")
            if len(fields) != wanted[keyword]:
                raise SpecError(f"'{keyword}' takes {wanted[keyword] - 1} TAB-separated fields, got {len(fields) - 1}")
            if any(not f for f in fields):
                raise SpecError("empty field (two TABs in a row, or a trailing TAB)")
            if keyword in ("kernel", "grid", "tolerance"):
                if {"kernel": kernel, "grid": grid, "tolerance": tolerance}[keyword] is not None:
                    raise SpecError(f"second '{keyword}' line")
            if keyword == "kernel":
                _check_name("kernel", fields[1])
                kernel = fields[1]
            elif keyword == "tolerance":
                numbers = [_check_float(f"tolerance field {i + 1}", f) for i, f in enumerate(fields[1:])]
                tolerance = SpecTolerance(*numbers)
            elif keyword == "grid":
                for i, f in enumerate(fields[1:]):
                    _check_expr(f"grid[{i}]", f)
                    refs.append((lineno, f))
                grid = tuple(fields[1:])
            else:
                item = SpecItem(keyword, fields[1], fields[-1], fields[2] if keyword == "arg" else "")
                _check_name(keyword, item.name)
                if item.name in defined:
                    raise SpecError(f"'{item.name}' already defined on line {defined[item.name]}")
                if keyword == "arg" and item.role not in ROLES:
                    raise SpecError(f"unknown role {item.role!r} (want one of {' '.join(ROLES)})")
                if item.is_expr:
                    _check_expr(f"{keyword} '{item.name}'", item.text)
                    refs.append((lineno, item.text))
                elif item.role == "f32":
                    _check_float(f"arg '{item.name}'", item.text)
                defined[item.name] = lineno
                items.append((lineno, item))
        except SpecError as e:
            raise SpecError(f"{source}:{lineno}: {e}") from None
    by_name = {item.name: item for _, item in items}
    for lineno, text in refs:
        try:
            for name in _references(text, by_name):
                if defined[name] >= lineno:
                    raise SpecError(f"'{name}' is used before its definition on line {defined[name]}")
        except SpecError as e:
            raise SpecError(f"{source}:{lineno}: {e}") from None
    for keyword, got in (("kernel", kernel), ("grid", grid), ("tolerance", tolerance)):
        if got is None:
            raise SpecError(f"{source}: no '{keyword}' line")
    values = tuple((item.name, item.text) for _, item in items if item.kind == "value")
    args = tuple(SpecArg(item.name, item.role, item.text) for _, item in items if item.kind == "arg")
    try:
        return RunSpec(kernel, values, args, grid, tolerance)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def substitute(template: str, params: Mapping[str, int]) -> str:
    """`template` with every `{NAME}` replaced by the artifact parameter NAME (SpecError if there is none)."""
    out = []
    i = 0
    while i < len(template):
        ch = template[i]
        if ch == "{":
            end = template.find("}", i)
            if end < 0:
                raise SpecError(f'"{template}": unclosed {{ at column {i + 1}')
            name = template[i + 1 : end]
            if not _NAME.fullmatch(name):
                raise SpecError(f'"{template}": placeholder {{{name}}} is not a name')
            if name not in params:
                raise SpecError(f'"{template}": no artifact parameter {name} for {{{name}}}')
            out.append(str(int(params[name])))
            i = end + 1
        elif ch == "}":
            raise SpecError(f'"{template}": stray }} at column {i + 1}')
        else:
            out.append(ch)
            i += 1
    return "".join(out)


@dataclass
class Resolved:
    """What the main computes from a spec for one artifact before it touches CUDA.

    `files`: in/out arg -> data file; `int_args`: i32/i64 values; `scratch`: scratch arg -> bytes;
    `roles`: every arg -> its role, in spec order.
    """

    files: dict[str, Path]
    values: dict[str, int]
    int_args: dict[str, int]
    float_args: dict[str, float]
    grid: tuple[int, int, int]
    scratch: dict[str, int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)


def resolve(spec: RunSpec, params: Mapping[str, int], bundle_dir: Path) -> Resolved:
    """Evaluate `spec` for an artifact with `params`, reading only headers (and first elements) of data files.

    Raises TdatError for a missing or malformed data file (the main exits 3), SpecError when the spec cannot be
    evaluated with these params (exit 2) or names a value or arg like a parameter (exit 5). The grid's range is
    `check_specialization`'s business.
    """
    bundle_dir = Path(bundle_dir)
    for item in _items(spec):
        if item.name in params:
            raise SpecError(f"{spec.kernel}: spec name '{item.name}' is also an artifact parameter")
    files: dict[str, Path] = {}
    headers: dict[str, TensorHeader] = {}
    for arg in spec.args:
        if arg.role in FILE_ROLES:
            try:
                files[arg.name] = bundle_dir / substitute(arg.text, params)
            except SpecError as e:
                raise SpecError(f"{spec.kernel}: arg '{arg.name}': {e}") from None
            headers[arg.name] = read_header(files[arg.name])

    names: dict[str, int] = {name: int(value) for name, value in params.items()}
    numel = lambda name: headers[name].numel  # KeyError: not an in/out arg
    first = lambda name: first_element(files[name])

    def run(what: str, text: str) -> int:
        try:
            return expr.evaluate(text, names, numel=numel, first=first)
        except expr.ExprError as e:
            raise SpecError(f"{spec.kernel}: {what}: {e}") from None

    out = Resolved(files, {}, {}, {}, (0, 0, 0), {}, {a.name: a.role for a in spec.args})
    for item in evaluation_order(spec):
        what = f"{item.kind} '{item.name}'"
        if item.kind == "value":
            out.values[item.name] = names[item.name] = run(what, item.text)
        elif item.role in INT_ROLES:
            value = run(what, item.text)
            if item.role == "i32" and not INT32_MIN <= value <= INT32_MAX:
                raise SpecError(f"{spec.kernel}: {what}: {value} does not fit in an i32")
            out.int_args[item.name] = names[item.name] = value
        elif item.role == "scratch":
            out.scratch[item.name] = run(what, item.text)
            if out.scratch[item.name] < 0:
                raise SpecError(f"{spec.kernel}: {what}: {out.scratch[item.name]} bytes")
        elif item.role == "f32":
            out.float_args[item.name] = float(item.text)
    out.grid = tuple(run(f"grid[{i}]", text) for i, text in enumerate(spec.grid))
    return out


def check_specialization(resolved: Resolved, argdescs: Sequence[tuple[str, str, int]]) -> None:
    """Raise SpecError when `resolved` does not fit an artifact's arguments (main.c exits 5 on the same).

    `argdescs`: the artifact's (name, type, hint) in kernel order; type 'p' pointer, 'i' int32, 'l' int64,
    'f' float; hint 16 = divisible by 16, 1 = compiled in as the constant 1, 0 = none. Also checks the grid
    against CUDA's launch limits.
    """
    described = set()
    for name, type_char, hint in argdescs:
        described.add(name)
        role = resolved.roles.get(name)
        if role is None:
            raise SpecError(f"artifact argument '{name}' has no spec arg")
        if type_char not in ARG_TYPES:
            raise SpecError(f"artifact argument '{name}' has unknown type {type_char!r}")
        if role not in ARG_TYPES[type_char]:
            raise SpecError(f"artifact argument '{name}' (type {type_char!r}) is given a spec arg of role {role}")
        if hint not in HINTS:
            raise SpecError(f"artifact argument '{name}' has unknown hint {hint}")
        if role in INT_ROLES:
            value = resolved.int_args[name]
            if hint == 16 and value % 16:
                raise SpecError(f"arg '{name}' = {value} breaks the artifact's specialization (divisible by 16)")
            if hint == 1 and value != 1:
                raise SpecError(f"arg '{name}' = {value} breaks the artifact's specialization (equal to 1)")
        elif hint == 1 or (hint == 16 and type_char == "f"):
            raise SpecError(f"artifact argument '{name}' (type {type_char!r}) cannot have hint {hint}")
    for name in resolved.roles:
        if name not in described:
            raise SpecError(f"spec arg '{name}' is not an argument of the artifact")
    for axis, (dim, limit) in enumerate(zip(resolved.grid, GRID_MAX, strict=True)):
        if not 1 <= dim <= limit:
            raise SpecError(f"grid[{axis}] = {dim} is outside 1..{limit}")
    x, y, z = resolved.grid
    if (x * y * z) % (1 << 32) == 0:
        raise SpecError(f"grid {x}x{y}x{z} has 2**32 * k blocks, which Triton's launcher reads as empty")
