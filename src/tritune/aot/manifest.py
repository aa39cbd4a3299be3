"""A bundle's `manifest.json`: what was built (kernels, one artifact per config), read and checked field by
field so a bad file fails with the file and the field path, written atomically. Format: docs/AOT.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tritune.store.atomic import atomic_write_text

FORMAT = "tritune-aot-bundle"
VERSION = 1
MANIFEST_NAME = "manifest.json"
# Every status but "ok" means no executable to run; the compiler tells out-of-resources apart from other errors.
STATUSES = ("ok", "compile_error", "out_of_resources", "crashed")

ParamValue = int | str | float

# Ids and kernel names become file names (bin/<id>, logs/<id>.log, specs/<kernel>.spec): no separators, no
# leading dot or dash (hidden files, options), nothing a shell or Make would mangle.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


class ManifestError(ValueError):
    """A manifest that cannot be used: one line naming the file, the field path and what is wrong."""


@dataclass
class ArtifactEntry:
    """One compiled config. `files` maps roles ("c", "h", "glue", "binary") to paths relative to the bundle."""

    id: str
    kernel: str
    params: dict[str, ParamValue]
    status: str = "ok"
    error: str = ""
    symbol: str = ""
    signature: str = ""
    shared_bytes: int = 0
    files: dict[str, str] = field(default_factory=dict)
    target: str = ""
    triton: str = ""
    compile_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kernel": self.kernel, "params": dict(self.params), "status": self.status,
                "error": self.error, "symbol": self.symbol, "signature": self.signature,
                "shared_bytes": self.shared_bytes, "files": dict(self.files), "target": self.target,
                "triton": self.triton, "compile_s": self.compile_s}

    @classmethod
    def from_json(cls, obj: Any, source: str, where: str = "artifact") -> ArtifactEntry:
        """Check and convert one artifact object; `where` is its field path for errors (e.g. `artifacts[3]`)."""
        f = _Fields(obj, source, where)
        return cls(id=f.take("id", _name), kernel=f.take("kernel", _name), params=f.take("params", _params),
                   status=f.take("status", _status), error=f.take("error", _str), symbol=f.take("symbol", _str),
                   signature=f.take("signature", _str), shared_bytes=f.take("shared_bytes", _count),
                   files=f.take("files", _files), target=f.take("target", _str), triton=f.take("triton", _str),
                   compile_s=f.take("compile_s", _seconds))


@dataclass
class KernelEntry:
    """One kernel of the bundle: its run spec (relative path), Triton source, grid expressions, problem, store."""

    name: str
    spec: str
    source: str = ""
    grid: list[str] = field(default_factory=lambda: ["1", "1", "1"])
    problem: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        # The name is the key in "kernels", not repeated inside.
        return {"spec": self.spec, "source": self.source, "grid": list(self.grid), "problem": dict(self.problem),
                "store": dict(self.store)}

    @classmethod
    def from_json(cls, name: str, obj: Any, source: str, where: str) -> KernelEntry:
        f = _Fields(obj, source, where)
        return cls(name=name, spec=f.take("spec", _rel_path), source=f.take("source", _str),
                   grid=f.take("grid", _grid), problem=f.take("problem", _object), store=f.take("store", _object))


@dataclass
class Manifest:
    """The whole manifest. Artifacts keep their build order, which is the order the runner runs them in."""

    format: str = FORMAT
    version: int = VERSION
    created: str = ""
    target: str = ""
    triton: str = ""
    torch: str = ""
    tritune: str = ""
    build_host: str = ""
    kernels: dict[str, KernelEntry] = field(default_factory=dict)
    artifacts: list[ArtifactEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version, "created": self.created, "target": self.target,
                "triton": self.triton, "torch": self.torch, "tritune": self.tritune, "build_host": self.build_host,
                "kernels": {name: kernel.to_json() for name, kernel in self.kernels.items()},
                "artifacts": [artifact.to_json() for artifact in self.artifacts]}

    @classmethod
    def from_json(cls, obj: Any, source: str) -> Manifest:
        """Check every field of a parsed manifest; ManifestError names `source` and the field path.

        Keys this version does not know are ignored, so a newer builder's extra fields do not stop a run.
        """
        f = _Fields(obj, source, "")
        fmt = f.take("format", _str)
        if fmt != FORMAT:
            raise f.error("format", f"expected {FORMAT!r}, got {fmt!r}")
        version = f.take("version", _int)
        if version != VERSION:
            raise f.error("version", f"unsupported version {version} (this tritune reads version {VERSION})")
        kernels_obj = f.take("kernels", _object)
        kernels: dict[str, KernelEntry] = {}
        for name, kernel_obj in kernels_obj.items():
            where = f"kernels.{name}"
            if not _NAME_RE.fullmatch(name):
                raise ManifestError(f"{source}: {where}: kernel name {name!r} is not file-name safe "
                                    f"(letters, digits, _ . + = -, not starting with . or -)")
            kernels[name] = KernelEntry.from_json(name, kernel_obj, source, where)
        artifacts_obj = f.take("artifacts", _list)
        artifacts: list[ArtifactEntry] = []
        seen: dict[str, int] = {}
        for i, artifact_obj in enumerate(artifacts_obj):
            where = f"artifacts[{i}]"
            artifact = ArtifactEntry.from_json(artifact_obj, source, where)
            if artifact.id in seen:
                raise ManifestError(f"{source}: {where}.id: duplicate id {artifact.id!r} "
                                    f"(also artifacts[{seen[artifact.id]}])")
            if artifact.kernel not in kernels:
                known = ", ".join(kernels) or "none"
                raise ManifestError(f"{source}: {where}.kernel: unknown kernel {artifact.kernel!r} (kernels: {known})")
            seen[artifact.id] = i
            artifacts.append(artifact)
        return cls(format=fmt, version=version, created=f.take("created", _str), target=f.take("target", _str),
                   triton=f.take("triton", _str), torch=f.take("torch", _str), tritune=f.take("tritune", _str),
                   build_host=f.take("build_host", _str), kernels=kernels, artifacts=artifacts)

    def artifact(self, artifact_id: str) -> ArtifactEntry:
        """The artifact of that id; KeyError when there is none."""
        for artifact in self.artifacts:
            if artifact.id == artifact_id:
                return artifact
        raise KeyError(artifact_id)


def load_manifest(bundle_dir: Path) -> Manifest:
    """Read and check `<bundle_dir>/manifest.json`; every problem is a ManifestError naming the file."""
    path = Path(bundle_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file (is {bundle_dir} a bundle made by `tritune aot build`?)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: cannot read: {err}".replace("\n", " ")) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path}: not JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    return Manifest.from_json(obj, str(path))


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Path:
    """Check `manifest` as a reader would, then replace `<bundle_dir>/manifest.json` atomically; returns the path.

    Checking first means a manifest that load_manifest would refuse is never written over a good one.
    """
    path = Path(bundle_dir) / MANIFEST_NAME
    obj = manifest.to_json()
    Manifest.from_json(obj, str(path))
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")
    return path


class _Fields:
    """Takes the fields of one JSON object, turning a bad one into ManifestError with its path."""

    def __init__(self, obj: Any, source: str, where: str) -> None:
        if not isinstance(obj, dict):
            raise ManifestError(f"{source}: {where or '(top level)'}: expected an object, got {_kind(obj)}")
        self.obj, self.source, self.where = obj, source, where

    def error(self, key: str, why: str) -> ManifestError:
        path = f"{self.where}.{key}" if self.where else key
        return ManifestError(f"{self.source}: {path}: {why}")

    def take(self, key: str, check: Callable[[Any], Any]) -> Any:
        if key not in self.obj:
            raise self.error(key, "missing")
        try:
            return check(self.obj[key])
        except _FieldError as err:
            raise self.error(key + err.sub, err.why) from None


class _FieldError(Exception):
    """A bad value; `sub` extends the field path (e.g. `.BLOCK_SIZE_M`, `[1]`)."""

    def __init__(self, why: str, sub: str = "") -> None:
        super().__init__(why)
        self.why, self.sub = why, sub


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"expected a string, got {_kind(value)}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(f"expected an integer, got {_kind(value)}")
    return value


def _count(value: Any) -> int:
    if _int(value) < 0:
        raise _FieldError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _FieldError(f"expected a finite number >= 0, got {value!r}")
    return float(value)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _FieldError(f"expected an object, got {_kind(value)}")
    return dict(value)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _FieldError(f"expected an array, got {_kind(value)}")
    return value


def _name(value: Any) -> str:
    if not _NAME_RE.fullmatch(_str(value)):
        raise _FieldError(f"{value!r} is not file-name safe (1-200 of letters, digits, _ . + = -, "
                          f"not starting with . or -)")
    return value


def _status(value: Any) -> str:
    if _str(value) not in STATUSES:
        raise _FieldError(f"expected one of {', '.join(STATUSES)}, got {value!r}")
    return value


def _params(value: Any) -> dict[str, ParamValue]:
    params = _object(value)
    for key, item in params.items():
        ok = isinstance(item, (int, str)) or (isinstance(item, float) and math.isfinite(item))
        if isinstance(item, bool) or not ok:
            raise _FieldError(f"expected an integer, a string or a finite number, got {_kind(item)}", f".{key}")
        if not key:
            raise _FieldError("empty parameter name")
    return params


def _rel_path(value: Any) -> str:
    # The runner executes bundle/<files["binary"]>: a path must stay inside the bundle.
    path = PurePosixPath(_str(value))
    if not value or path.is_absolute() or ".." in path.parts or "\\" in value:
        raise _FieldError(f"expected a relative path inside the bundle, got {value!r}")
    return value


def _files(value: Any) -> dict[str, str]:
    files = _object(value)
    for role, path in files.items():
        try:
            _rel_path(path)
        except _FieldError as err:
            raise _FieldError(err.why, f".{role}") from None
    return files


def _grid(value: Any) -> list[str]:
    grid = _list(value)
    if len(grid) != 3:
        raise _FieldError(f"expected 3 expressions (x, y, z), got {len(grid)}")
    for i, item in enumerate(grid):
        if not isinstance(item, str) or not item.strip():
            raise _FieldError(f"expected a non-empty expression string, got {_kind(item)}", f"[{i}]")
    return list(grid)
