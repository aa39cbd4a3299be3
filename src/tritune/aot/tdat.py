"""The `.tdat` tensor file of docs/AOT.md: a `key: value` text header, then the raw little-endian C-order bytes.

The same format is read by `csrc/tdat.c` in the bundle's executables, so this module is strict: anything the C
reader would refuse is refused here too, with a one-line message naming the file.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

MAGIC = b"TRITUNE-TENSOR 1\n"
MAX_HEADER_BYTES = 1 << 20  # a header this long means a wrong file, not a tensor; both readers stop here
REQUIRED_KEYS = ("name", "dtype", "shape")

TDAT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_FORMAT_NAMES = {dtype: name for name, dtype in TDAT_DTYPES.items()}
_KEY = re.compile(r"[a-z0-9_]+")
_DIM = re.compile(r"[0-9]+")
_INT64_MAX = (1 << 63) - 1


class TdatError(ValueError):
    """A `.tdat` file that is missing, malformed, or does not match what its header says."""


@dataclass(frozen=True)
class TensorHeader:
    """What a `.tdat` header says; `data_offset` is where the payload starts in the file."""

    name: str
    dtype: str  # format name: bf16 fp16 fp32 int32 int64 uint8
    shape: tuple[int, ...]
    meta: dict[str, str] = field(default_factory=dict)  # every other key, values as text
    data_offset: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return TDAT_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def itemsize(self) -> int:
        return TDAT_DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _check_little_endian() -> None:
    # The payload is little-endian and is copied as-is; a big-endian host would silently swap every element.
    if sys.byteorder != "little":
        raise TdatError("tdat files are little-endian; this host is big-endian")


def _header_text(name: str, dtype: str, shape: tuple[int, ...], meta: dict[str, str]) -> bytes:
    lines = [MAGIC.decode()[:-1]]
    for key, value in (("name", name), ("dtype", dtype), ("shape", " ".join(map(str, shape))), *meta.items()):
        # An empty value is written without the space so no line carries trailing whitespace.
        lines.append(f"{key}: {value}" if value else f"{key}:")
    lines.append("end")
    return ("\n".join(lines) + "\n").encode()


def _check_meta(path: Path, name: str, meta: dict[str, str | int] | None) -> dict[str, str]:
    if not name or "\n" in name or "\r" in name:
        raise TdatError(f"{path}: tensor name {name!r} must be non-empty text without newlines")
    out: dict[str, str] = {}
    for key, value in (meta or {}).items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise TdatError(f"{path}: metadata key {key!r} must match [a-z0-9_]+")
        if key in REQUIRED_KEYS:
            raise TdatError(f"{path}: metadata key {key!r} is reserved")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TdatError(f"{path}: metadata {key}={value!r} must be a str or an int")
        text = str(value)
        if "\n" in text or "\r" in text:
            raise TdatError(f"{path}: metadata {key}={value!r} holds a newline")
        out[key] = text
    return out


def write_tensor(path: Path | str, name: str, tensor: torch.Tensor, meta: dict[str, str | int] | None = None) -> None:
    """Write `tensor` (any device, any layout; dtype one of TDAT_DTYPES) to `path` as a `.tdat` file.

    Atomic: the bytes go to a temp file in the same folder, which then replaces `path`, so a reader never
    sees half a file. `meta` keys (`[a-z0-9_]+`, not name/dtype/shape) are written after the required keys
    and come back from `read_header` as text.
    """
    path = Path(path)
    _check_little_endian()
    dtype = _FORMAT_NAMES.get(tensor.dtype)
    if dtype is None:
        raise TdatError(f"{path}: cannot store dtype {tensor.dtype} (tdat holds {' '.join(TDAT_DTYPES)})")
    meta_text = _check_meta(path, name, meta)
    cpu = tensor.detach().to("cpu").contiguous()
    header = _header_text(name, dtype, tuple(cpu.shape), meta_text)
    # bf16 has no numpy dtype: view the elements as bytes (works for every dtype) and hand numpy only uint8.
    payload = cpu.reshape(-1).view(torch.uint8).numpy() if cpu.numel() else None

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(header)
            if payload is not None:
                f.write(memoryview(payload))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _parse_shape(path: Path, lineno: int, text: str) -> tuple[int, ...]:
    dims = []
    for token in text.split():
        if not _DIM.fullmatch(token):
            raise TdatError(f"{path}: line {lineno}: bad shape {text!r} (want space-separated non-negative integers)")
        dims.append(int(token))
    return tuple(dims)


def _read_header(f: BinaryIO, path: Path) -> TensorHeader:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        if magic.startswith(b"TRITUNE-TENSOR "):
            raise TdatError(f"{path}: unsupported version line {magic.splitlines()[0]!r} (want 'TRITUNE-TENSOR 1')")
        raise TdatError(f"{path}: bad magic {magic[:16]!r} (not a tdat file; want 'TRITUNE-TENSOR 1')")
    fields: dict[str, tuple[int, str]] = {}
    offset = len(MAGIC)
    lineno = 1
    while True:
        lineno += 1
        raw = f.readline(MAX_HEADER_BYTES - offset + 1)
        offset += len(raw)
        if offset > MAX_HEADER_BYTES:
            raise TdatError(f"{path}: header longer than {MAX_HEADER_BYTES} bytes (no 'end' line?)")
        if not raw.endswith(b"\n"):
            raise TdatError(f"{path}: line {lineno}: header ends before its 'end' line")
        try:
            line = raw[:-1].decode()
        except UnicodeDecodeError:
            raise TdatError(f"{path}: line {lineno}: header line is not UTF-8") from None
        if line == "end":
            break
        key, colon, value = line.partition(":")
        if not colon or not _KEY.fullmatch(key):
            raise TdatError(f"{path}: line {lineno}: want 'key: value' with key [a-z0-9_]+, got {line[:60]!r}")
        if key in fields:
            raise TdatError(f"{path}: line {lineno}: key {key!r} repeated (first on line {fields[key][0]})")
        fields[key] = (lineno, value[1:] if value.startswith(" ") else value)
    missing = [key for key in REQUIRED_KEYS if key not in fields]
    if missing:
        raise TdatError(f"{path}: header lacks required key(s) {', '.join(missing)}")
    dtype_line, dtype = fields["dtype"]
    if dtype not in TDAT_DTYPES:
        raise TdatError(f"{path}: line {dtype_line}: unknown dtype {dtype!r} (want one of {' '.join(TDAT_DTYPES)})")
    shape = _parse_shape(path, *fields["shape"])
    meta = {key: value for key, (_, value) in fields.items() if key not in REQUIRED_KEYS}
    header = TensorHeader(fields["name"][1], dtype, shape, meta, offset)
    if header.nbytes > _INT64_MAX:
        raise TdatError(f"{path}: shape {' '.join(map(str, shape))} is too large")
    return header


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise TdatError(f"{path}: no such file") from None
    except OSError as e:
        raise TdatError(f"{path}: cannot open: {e.strerror}") from None


def _check_payload(path: Path, header: TensorHeader, size: int) -> None:
    payload = size - header.data_offset
    if payload != header.nbytes:
        what = "short" if payload < header.nbytes else "long"
        raise TdatError(
            f"{path}: payload too {what}: {payload} bytes, expected {header.nbytes} "
            f"(shape [{' '.join(map(str, header.shape))}] x {header.dtype} {header.itemsize} bytes)"
        )


def read_header(path: Path | str) -> TensorHeader:
    """The header of the `.tdat` file at `path`; checks the payload length from the file size, reads no payload."""
    path = Path(path)
    with _open(path) as f:
        header = _read_header(f, path)
        _check_payload(path, header, os.fstat(f.fileno()).st_size)
    return header


def read_tensor(path: Path | str) -> tuple[TensorHeader, torch.Tensor]:
    """The header and the tensor (CPU, the header's dtype and shape) of the `.tdat` file at `path`."""
    path = Path(path)
    _check_little_endian()
    with _open(path) as f:
        header = _read_header(f, path)
        _check_payload(path, header, os.fstat(f.fileno()).st_size)
        tensor = torch.empty(header.shape, dtype=header.torch_dtype)
        if header.nbytes:
            # Read straight into the tensor's bytes: no intermediate copy, and bf16 needs no numpy support.
            view = tensor.reshape(-1).view(torch.uint8).numpy()
            got = f.readinto(memoryview(view))
            if got != header.nbytes:
                raise TdatError(f"{path}: payload too short: {got} bytes, expected {header.nbytes}")
    return header, tensor


def first_element(path: Path | str) -> int:
    """Element 0 of an int32/int64 `.tdat` file (what `first(ARG)` means in a run spec)."""
    path = Path(path)
    with _open(path) as f:
        header = _read_header(f, path)
        _check_payload(path, header, os.fstat(f.fileno()).st_size)
        if header.dtype not in ("int32", "int64"):
            raise TdatError(f"{path}: first element wanted from a {header.dtype} tensor (want int32 or int64)")
        if header.numel == 0:
            raise TdatError(f"{path}: first element wanted from an empty tensor")
        f.seek(header.data_offset)
        raw = f.read(header.itemsize)
    return int.from_bytes(raw, "little", signed=True)
