"""GEMM tuned-config files: one JSON per device, kernel tag, output dtype and (N, K) with M buckets; a per-device
default file voted from them; and the run-time lookup over the user's folder and the shipped one.

Files are in aiter's layout: each M bucket's config, a plain dict, at the top level, so a reader of aiter's GEMM
files serves them as they are; everything tritune adds (provenance, per-M winners with their times) sits under
the one other top-level key, "tritune", which no bucket can be named. The nested layout of earlier tritune
versions ("configs": {bucket: {"config": ...}} beside "provenance" and "by_M") is still read.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

from tritune.device import slug_of
from tritune.params import Config
from tritune.store.atomic import atomic_write_json, json_safe, path_lock
from tritune.store.files import ConfigFiles
from tritune.store.process_wide import ProcessWide
from tritune.store.provenance import Machine, Recorded, check

META = "tritune"  # the one top-level key that is not an M bucket
FORMAT = 2  # META["format"]; a file without META is in the nested layout (format 1)
OUT_DTYPE = "bf16"  # C's dtype in files whose names carry no "-OUT_<dtype>"
BUCKETS = ("small", "medium_M32", "medium_M64", "medium_M128", "large", "xlarge", "any")
_BUCKET_TOP = (("small", 31), ("medium_M32", 32), ("medium_M64", 64), ("medium_M128", 128), ("large", 256))
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "configs" / "gemm"
# slug has no '-', so the first "-GEMM-" ends it; the tag is everything up to "-N=" or ".json".
_NAME_RE = re.compile(r"(?P<slug>[A-Za-z0-9._]+)-GEMM-(?P<tag>.+?)(?:-N=(?P<N>\d+)-K=(?P<K>\d+))?\.json")


def m_bucket(M: int) -> str:
    """Bucket of a GEMM's M (rows of A): small <32, medium_M32 ==32, medium_M64 33-64, medium_M128 65-128,
    large 129-256, xlarge >256. M < 1 is a ValueError (an empty GEMM launches nothing)."""
    M = operator.index(M)
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    return next((name for name, top in _BUCKET_TOP if M <= top), "xlarge")


def name_parts(file_name: str) -> tuple[str, str, bool] | None:
    """(device slug, kernel tag, is a shape file) of a GEMM file name; None when it does not follow the scheme."""
    match = _NAME_RE.fullmatch(file_name)
    return (match["slug"], match["tag"], match["N"] is not None) if match else None


def file_tag(tag: str, out_dtype: str = OUT_DTYPE) -> str:
    """The tag part of a file name: the kernel's tag, with "-OUT_<DTYPE>" added when C is not bf16
    ("BF16", "fp16" -> "BF16-OUT_FP16"), so tunes of two output dtypes never share a file."""
    out_dtype = _check_out_dtype(out_dtype)
    return tag if out_dtype == OUT_DTYPE else f"{tag}-OUT_{out_dtype.upper()}"


def shape_file_name(device_slug: str, tag: str, N: int, K: int, out_dtype: str = OUT_DTYPE) -> str:
    return f"{device_slug}-GEMM-{file_tag(tag, out_dtype)}-N={N}-K={K}.json"


def default_file_name(device_slug: str, tag: str, out_dtype: str = OUT_DTYPE) -> str:
    return f"{device_slug}-GEMM-{file_tag(tag, out_dtype)}.json"


def _num(d: dict, name: str) -> float:
    value = d[name]
    if value is None:  # JSON null stands for inf/nan (see atomic.json_safe)
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} is not a number")
    return float(value)


def _pos_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}={value!r} is not a positive integer")
    return value


def _config(value: object) -> Config:
    if not isinstance(value, dict):
        raise ValueError(f"config {value!r} is not an object")
    try:
        return Config.from_dict(value)
    except TypeError as err:
        raise ValueError(str(err)) from None


@dataclass(frozen=True)
class GemmEntry:
    """The winner for one M of one (N, K): its config and what it measured."""

    M: int
    config: Config
    time_us: float
    tflops: float
    gbps: float
    error: float  # mismatch ratio from the correctness gate; nan when not checked (stored as null)
    # time_us is GPU time; these are the op's per-call time as eager calls (host included) and as a CUDA-graph
    # replay, nan when not measured (stored as null; absent in files written before they existed).
    eager_us: float = math.nan
    graph_us: float = math.nan

    def to_dict(self) -> dict:
        return {"M": self.M, "config": self.config.as_dict(), "time_us": self.time_us, "tflops": self.tflops,
                "gbps": self.gbps, "error": self.error, "eager_us": self.eager_us, "graph_us": self.graph_us}

    @staticmethod
    def from_dict(d: dict) -> GemmEntry:
        """Inverse of to_dict; ValueError saying what is missing or wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"entry {d!r} is not an object")
        missing = [k for k in ("M", "config", "time_us", "tflops", "gbps", "error") if k not in d]
        if missing:
            raise ValueError(f"entry lacks {', '.join(missing)}")
        return GemmEntry(M=_pos_int(d["M"], "M"), config=_config(d["config"]), time_us=_num(d, "time_us"),
                         tflops=_num(d, "tflops"), gbps=_num(d, "gbps"), error=_num(d, "error"),
                         eager_us=_num(d, "eager_us") if "eager_us" in d else math.nan,
                         graph_us=_num(d, "graph_us") if "graph_us" in d else math.nan)


@dataclass(frozen=True)
class GemmFile:
    """A validated shape or default file, in whichever layout it was written."""

    kernel: str  # the kernel's tag, e.g. "A8W8"
    out_dtype: str  # C's dtype, e.g. "bf16"
    shape: tuple[int, int] | None  # (N, K) of a shape file; None for a device default
    by_M: dict[int, GemmEntry]  # per-M winners; empty for a default file
    configs: dict[str, Config]  # bucket -> config, as an aiter reader sees it
    provenance: dict
    recorded: Recorded
    layout: str  # "aiter" (buckets at the top level) or "nested" (tritune's first layout, still read)


def _check_out_dtype(out_dtype: object) -> str:
    if not isinstance(out_dtype, str) or not re.fullmatch(r"[a-z0-9]+", out_dtype):
        raise ValueError(f"out_dtype={out_dtype!r} is not a dtype name such as 'bf16' or 'fp16'")
    return out_dtype


def _check(doc: object, file_name: str) -> GemmFile:
    """Validate a shape or default file of either layout (and its name, when it follows the naming scheme)."""
    if not isinstance(doc, dict):
        raise ValueError("top level is not an object")
    if META in doc:
        meta, layout = doc[META], "aiter"
        if not isinstance(meta, dict):
            raise ValueError(f"'{META}' is not an object")
        if meta.get("format") != FORMAT:
            raise ValueError(f"'{META}.format' is {meta.get('format')!r}; this tritune reads format {FORMAT}")
        raw = {b: rec for b, rec in doc.items() if b != META}
    elif isinstance(doc.get("configs"), dict):  # the nested layout: "configs": {bucket: {"config": ..., ...}}
        meta, layout = doc, "nested"
        raw = {b: rec.get("config") if isinstance(rec, dict) else rec for b, rec in doc["configs"].items()}
    else:
        raise ValueError(f"neither a '{META}' key (tritune's data beside the buckets) nor the older 'configs'")
    for key, kind in (("provenance", dict), ("kernel", str)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"'{key}' is missing or not a{'n object' if kind is dict else ' string'}")
    unknown = [b for b in raw if b not in BUCKETS]
    if unknown:
        raise ValueError(f"unknown bucket(s) {unknown}; known: {list(BUCKETS)}")
    kernel, out_dtype = meta["kernel"], _check_out_dtype(meta.get("out_dtype", OUT_DTYPE))  # nested: always bf16
    is_shape = "by_M" in meta
    name = _NAME_RE.fullmatch(file_name)
    if name and (name["tag"] != file_tag(kernel, out_dtype) or (name["N"] is not None) != is_shape):
        raise ValueError(f"content (kernel {kernel!r}, out_dtype {out_dtype!r}, {'shape' if is_shape else 'default'} "
                         "file) does not match the file name")
    recorded = Recorded.from_provenance(meta["provenance"])
    configs = {b: _config(raw[b]) for b in BUCKETS if b in raw}
    if not is_shape:
        if not configs:
            raise ValueError("no bucket configs")
        return GemmFile(kernel, out_dtype, None, {}, configs, meta["provenance"], recorded, layout)
    N, K = _pos_int(meta.get("N"), "N"), _pos_int(meta.get("K"), "K")
    if name and (int(name["N"]), int(name["K"])) != (N, K):
        raise ValueError(f"N={N}, K={K} do not match the file name")
    if not isinstance(meta["by_M"], dict) or not meta["by_M"]:
        raise ValueError("'by_M' is missing, empty or not an object")
    by_M = {}
    for key, rec in meta["by_M"].items():
        entry = GemmEntry.from_dict(rec)
        if key != str(entry.M):
            raise ValueError(f"by_M[{key!r}] holds M={entry.M}")
        by_M[entry.M] = entry
    if layout == "nested":  # its bucket records are whole entries: their M must sit in the bucket
        for bucket, rec in doc["configs"].items():
            entry = GemmEntry.from_dict(rec)
            if bucket != "any" and m_bucket(entry.M) != bucket:
                raise ValueError(f"configs[{bucket!r}] holds M={entry.M}, which is in bucket {m_bucket(entry.M)}")
    if "any" not in configs:
        raise ValueError("no 'any' bucket")
    return GemmFile(kernel, out_dtype, (N, K), by_M, configs, meta["provenance"], recorded, layout)


def _load(path: Path) -> tuple[dict, GemmFile]:
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    try:
        return doc, _check(doc, path.name)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None


def read_gemm_file(path: Path) -> dict:
    """The parsed JSON of a shape or default file (either layout), after validation; ValueError naming the file and
    the fault."""
    return _load(path)[0]


def load_gemm_file(path: Path) -> GemmFile:
    """A shape or default file of either layout as a `GemmFile`; ValueError naming the file and the fault."""
    return _load(path)[1]


def to_aiter_layout(doc: dict, file_name: str = "") -> dict:
    """The JSON of a nested-layout file (format 1) in the aiter layout, losing nothing: the bucket configs move to the
    top level and every other key under "tritune"; a default file's per-bucket votes go to "tritune.votes". A shape
    file's bucket records must be its by_M entries (as tritune wrote them: the bucket's largest M), since the new
    layout derives them from by_M again; ValueError otherwise, or when `doc` is not a valid nested file."""
    parsed = _check(doc, file_name)
    if parsed.layout != "nested":
        raise ValueError("not in the nested layout")
    out: dict = {b: parsed.configs[b].as_dict() for b in BUCKETS if b in parsed.configs}
    meta = {"format": FORMAT, "kernel": doc["kernel"], "out_dtype": OUT_DTYPE}
    meta.update((k, v) for k, v in doc.items() if k not in ("configs", "kernel"))
    if parsed.shape is None:
        meta["votes"] = {b: {k: v for k, v in rec.items() if k != "config"} for b, rec in doc["configs"].items()}
    else:
        derived = _by_bucket(parsed.by_M)
        if set(doc["configs"]) != set(derived):
            raise ValueError(f"buckets {sorted(doc['configs'])} are not those of by_M {sorted(derived)}")
        for bucket, entry in derived.items():
            if json_safe(GemmEntry.from_dict(doc["configs"][bucket]).to_dict()) != json_safe(entry.to_dict()):
                raise ValueError(f"configs[{bucket!r}] is not the by_M entry of M={entry.M}")
    out[META] = meta
    return out


def _by_bucket(by_M: dict[int, GemmEntry]) -> dict[str, GemmEntry]:
    """Per bucket, the entry of the largest tuned M in it; "any" is the largest M overall."""
    found = {m_bucket(M): by_M[M] for M in sorted(by_M)}  # ascending, so the largest M is written last
    out = {b: found[b] for b in BUCKETS if b in found}
    out["any"] = by_M[max(by_M)]
    return out


def write_shape_file(folder: Path, provenance: dict, tag: str, N: int, K: int, entries: dict[int, GemmEntry],
                     device_slug: str | None = None, *, out_dtype: str = OUT_DTYPE) -> Path:
    """Write (or merge into) `<slug>-GEMM-<file_tag(tag, out_dtype)>-N=<N>-K=<K>.json` in `folder`, atomically;
    return its path.

    Layout: each tuned bucket's config at the top level (the config of the largest tuned M in it; "any": of the
    largest M), then {"tritune": {"format", "kernel": tag, "out_dtype", "provenance", "N", "K", "by_M": {"<M>":
    entry}}}. An existing file (either layout) is merged: new M replace old entries of the same M, other old M are
    kept, and the buckets are derived again; the provenance becomes this write's. `device_slug` defaults to
    slug_of(provenance["name"]). A malformed existing file is a ValueError (it is not overwritten).
    """
    if not entries:
        raise ValueError("no entries to write")
    bad = [M for M, e in entries.items() if e.M != M]
    if bad:
        raise ValueError(f"entries keyed by M={bad} hold a different M")
    slug = device_slug or slug_of(provenance["name"])
    path = Path(folder) / shape_file_name(slug, tag, N, K, out_dtype)
    with path_lock(path):  # held across read-merge-write so two tuners of one shape don't lose entries
        merged = dict(_load(path)[1].by_M) if path.exists() else {}
        merged.update(entries)
        doc: dict = {b: e.config.as_dict() for b, e in _by_bucket(merged).items()}
        doc[META] = {"format": FORMAT, "kernel": tag, "out_dtype": out_dtype, "provenance": provenance, "N": N, "K": K,
                     "by_M": {str(M): merged[M].to_dict() for M in sorted(merged)}}
        atomic_write_json(path, doc)
    return path


def write_default_file(folder: Path, provenance: dict, tag: str, device_slug: str | None = None, *,
                       out_dtype: str = OUT_DTYPE) -> Path:
    """Vote the per-device default `<slug>-GEMM-<file_tag(tag, out_dtype)>.json` from every shape file of that device,
    tag and out_dtype in `folder`; return its path.

    Per bucket, each shape file's bucket winner is one vote; the config with most votes wins, ties going to the
    lowest summed time_us over its votes, then to the smallest Config.key(). Layout: the winning configs at the top
    level, then {"tritune": {"format", "kernel", "out_dtype", "provenance", "from_shapes": [{"N", "K"}], "votes":
    {bucket: {"votes": n, "shapes": shape files voting}}}}.
    """
    slug = device_slug or slug_of(provenance["name"])
    pattern = re.compile(rf"{re.escape(slug)}-GEMM-{re.escape(file_tag(tag, out_dtype))}-N=(\d+)-K=(\d+)\.json")
    shapes, ballots = [], {b: {} for b in BUCKETS}
    for path in sorted(Path(folder).iterdir()):
        match = pattern.fullmatch(path.name)
        if not match:
            continue
        shapes.append({"N": int(match[1]), "K": int(match[2])})
        for bucket, entry in _by_bucket(_load(path)[1].by_M).items():
            ballots[bucket].setdefault(entry.config, []).append(entry.time_us)
    if not shapes:
        raise ValueError(f"no {slug}-GEMM-{file_tag(tag, out_dtype)}-N=*-K=*.json shape files in {folder}")

    def rank(item: tuple[Config, list[float]]) -> tuple:
        config, times = item
        return -len(times), math.fsum(t if math.isfinite(t) else math.inf for t in times), config.key()

    doc: dict = {}
    votes = {}
    for bucket, ballot in ballots.items():
        if ballot:
            config, times = min(ballot.items(), key=rank)
            doc[bucket] = config.as_dict()
            votes[bucket] = {"votes": len(times), "shapes": sum(len(t) for t in ballot.values())}
    doc[META] = {"format": FORMAT, "kernel": tag, "out_dtype": out_dtype, "provenance": provenance,
                 "from_shapes": shapes, "votes": votes}
    path = Path(folder) / default_file_name(slug, tag, out_dtype)
    atomic_write_json(path, doc)
    return path


class GemmConfigStore(ConfigFiles[GemmFile]):
    """Run-time lookup of tuned GEMM configs over the files of `store.files.ConfigFiles` (each parsed once per
    process, until `reload()`, which also re-reads TRITUNE_CONFIG_DIR).

    Folders, searched in order (the first holding a readable file wins): `folders` if given, else
    TRITUNE_CONFIG_DIR (when set) then the shipped `tritune/configs/gemm/`. For (device, tag, out_dtype, M, N, K):
    1. the shape file of (N, K): the exact M in by_M, else M's bucket, else "any";
    2. the device default file: M's bucket, else "any";
    3. None: the caller uses its documented built-in heuristic.
    A malformed file (or a TRITUNE_CONFIG_DIR that is not a folder) warns once and is skipped, never raises.
    Given the running `machine`, a file whose provenance does not fit it (provenance.compare) warns once per
    process: another device, SM count or interpreter-vs-GPU skips it (the search goes on), another Triton
    major.minor serves it anyway.
    """

    KIND = "GEMM"

    def package_dir(self) -> Path:
        return PACKAGE_DIR

    def read(self, path: Path) -> GemmFile:
        return _load(path)[1]

    def lookup(self, device_slug: str, tag: str, M: int, N: int, K: int, *, machine: Machine | None = None,
               out_dtype: str = OUT_DTYPE) -> tuple[Config, str] | None:
        """(config, where it came from) for a GEMM C[M, N] = A[M, K] @ B[K, N], or None when nothing is tuned.

        `where` reads e.g. "shape file <path> M=64", "shape file <path> bucket large", "device default <path>
        bucket xlarge", with " (stale: Triton 3.6 != 3.9)" added when the file's Triton differs. `machine`
        (provenance.running_machine()) turns on the provenance check; None checks nothing. M < 1 is a ValueError.
        """
        buckets = (m_bucket(M), "any")
        found = self._first(shape_file_name(device_slug, tag, N, K, out_dtype), machine)
        if found:
            path, parsed, note = found
            if M in parsed.by_M:
                return parsed.by_M[M].config, f"shape file {path} M={M}{note}"
            bucket = next(b for b in buckets if b in parsed.configs)  # "any" is always there
            return parsed.configs[bucket], f"shape file {path} bucket {bucket}{note}"
        found = self._first(default_file_name(device_slug, tag, out_dtype), machine)
        if found:
            path, parsed, note = found
            for bucket in buckets:
                if bucket in parsed.configs:
                    return parsed.configs[bucket], f"device default {path} bucket {bucket}{note}"
        return None

    def shape_entries(self, device_slug: str, tag: str, N: int, K: int, *, machine: Machine | None = None,
                      out_dtype: str = OUT_DTYPE) -> tuple[Path, dict[int, GemmEntry]] | None:
        """The shape file of (N, K) that `lookup` reads (same folders, order and provenance check) and its tuned
        entries by M, for choosing between tuned M values; None when there is no such file."""
        found = self._first(shape_file_name(device_slug, tag, N, K, out_dtype), machine)
        return None if found is None else (found[0], dict(found[1].by_M))

    def _first(self, name: str, machine: Machine | None) -> tuple[Path, GemmFile, str] | None:
        """The first readable file `name` in folder order that `machine` may use, and a note when it is stale."""
        for folder in self.folders():
            path = folder / name
            parsed = self.parsed(path)
            if parsed is None:
                continue
            if machine is None:
                return path, parsed, ""
            verdict = check(str(path), parsed.recorded, machine)  # warns once per file and mismatch
            if not verdict.skip:
                return path, parsed, f" (stale: {verdict.stale})" if verdict.stale else ""
        return None


_DEFAULT = ProcessWide(GemmConfigStore)


def default_store() -> GemmConfigStore:
    """The process-wide store the ops use."""
    return _DEFAULT.get()


def reload_configs() -> None:
    """Make the ops see config files written or changed since they were first read (and a new TRITUNE_CONFIG_DIR)."""
    default_store().reload()
