"""Grouped-GEMM tuned configs: one JSON file per device, `<slug>-GROUPED_GEMM.json`, holding the best config per
(Triton version, MoE shape, gemm, kernel, token count); merged on write; looked up at run time, cached.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tritune.device import slug_of
from tritune.store.atomic import atomic_write_json, path_lock
from tritune.store.files import ConfigFiles
from tritune.store.process_wide import ProcessWide
from tritune.store.provenance import Machine, Recorded, check, compare

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "configs" / "grouped_gemm"
# The launch-config class each kernel's entries name in "config_class" (tritune.kernels.grouped_gemm_config's
# CONFIG_CLASSES, which builds a config from an entry's fields; a test keeps the two equal).
CONFIG_CLASS_NAMES = {"forward": "KernelConfigForward", "dX": "KernelConfigBackward_dX",
                      "dW": "KernelConfigBackward_dW"}
GEMMS = ("gate_up", "down")
DTYPES = ("bf16", "fp16", "fp32")
MAX_TOKEN_RATIO = 4  # a tuned token count serves a request at most two doublings away
_INT_FIELDS = ("num_experts", "n", "k", "topk", "tokens")


def file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3-GROUPED_GEMM.json'."""
    return f"{slug_of(device_name)}-GROUPED_GEMM.json"


def store_path(folder: str | Path, device_name: str) -> Path:
    return Path(folder) / file_name(device_name)


@dataclass(frozen=True)
class GroupedGemmEntry:
    """The winner of one grouped-GEMM kernel ("forward", "dX", "dW") of one MoE GEMM ("gate_up": N=2I, K=H;
    "down": N=H, K=I) at `tokens` tokens; `us`/`torch_us` are microseconds of the config and the baseline."""

    triton: str
    num_experts: int
    n: int
    k: int
    topk: int
    dtype: str
    gemm: str
    kernel: str
    tokens: int
    # The kernel's launch config as `KernelConfig.to_dict()` gives it (its field order kept in the file).
    config: dict[str, int | bool] = field(hash=False)
    us: float
    torch_us: float
    baseline: str  # how torch_us was measured, e.g. "torch._grouped_mm" or "torch loop over experts"
    provenance: dict = field(default_factory=dict, hash=False)  # DeviceInfo.provenance() of the tuning run

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "config", dict(self.config))

    def key(self) -> tuple:
        """What an entry is merged on: a new entry with the same key replaces the old one."""
        return (self.triton, self.num_experts, self.n, self.k, self.topk, self.dtype, self.gemm, self.kernel,
                self.tokens)

    def recorded(self, device: str) -> Recorded:
        """Its provenance in the file of `device`: that name, its Triton, SMs/torch/interpreter from `provenance`."""
        return replace(Recorded.from_provenance(self.provenance), name=device, triton_version=self.triton)

    def to_dict(self) -> dict:
        return {"triton": self.triton, "num_experts": self.num_experts, "n": self.n, "k": self.k, "topk": self.topk,
                "dtype": self.dtype, "gemm": self.gemm, "kernel": self.kernel, "tokens": self.tokens,
                "config": dict(self.config), "config_class": CONFIG_CLASS_NAMES[self.kernel], "us": self.us,
                "torch_us": self.torch_us, "baseline": self.baseline, "provenance": self.provenance}

    @staticmethod
    def from_dict(d: object) -> GroupedGemmEntry:
        """Inverse of to_dict; ValueError naming the missing or bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"entry {d!r} is not an object")
        names = [f.name for f in fields(GroupedGemmEntry)] + ["config_class"]
        missing = [name for name in names if name not in d]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        kernel = d["kernel"]
        if kernel not in CONFIG_CLASS_NAMES:
            raise ValueError(f"field 'kernel': {kernel!r} is not one of {', '.join(CONFIG_CLASS_NAMES)}")
        if d["config_class"] != CONFIG_CLASS_NAMES[kernel]:
            raise ValueError(f"field 'config_class': {d['config_class']!r} does not match kernel {kernel!r} "
                             f"(expected {CONFIG_CLASS_NAMES[kernel]!r})")
        values = {name: d[name] for name in names if name != "config_class"}
        for name in ("us", "torch_us"):
            if values[name] is None:  # JSON null stands for inf/nan (see atomic.json_safe)
                values[name] = math.nan
        return GroupedGemmEntry(**values)


def _validate(e: GroupedGemmEntry) -> None:
    for name in _INT_FIELDS:
        value = getattr(e, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"field {name!r}: {value!r} is not a positive integer")
    for name, allowed in (("gemm", GEMMS), ("dtype", DTYPES), ("kernel", tuple(CONFIG_CLASS_NAMES))):
        if getattr(e, name) not in allowed:
            raise ValueError(f"field {name!r}: {getattr(e, name)!r} is not one of {', '.join(allowed)}")
    for name in ("triton", "baseline"):
        if not isinstance(getattr(e, name), str) or not getattr(e, name):
            raise ValueError(f"field {name!r}: {getattr(e, name)!r} is not a non-empty string")
    for name in ("us", "torch_us"):
        value = getattr(e, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"field {name!r}: {value!r} is not a number")
    if not isinstance(e.provenance, dict):
        raise ValueError(f"field 'provenance': {e.provenance!r} is not an object")
    # The fields themselves are the kernel's to judge (`launch_config`, where the op builds the config); here only
    # what the file format says: an object of integers >= 1 and booleans.
    if not isinstance(e.config, dict) or not e.config:
        raise ValueError(f"field 'config': {e.config!r} is not a non-empty object")
    for name, value in e.config.items():
        if not isinstance(name, str) or not (isinstance(value, bool) or (isinstance(value, int) and value >= 1)):
            raise ValueError(f"field 'config': {name}={value!r} is not a positive int or a bool")


def _load(path: Path) -> tuple[str, list[GroupedGemmEntry]]:
    """(device name, entries) of a store file; ValueError naming the file and the fault."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level is not an object")
    if not isinstance(doc.get("device"), str) or not doc["device"]:
        raise ValueError(f"{path}: field 'device' is missing or not a non-empty string")
    if not isinstance(doc.get("entries"), list):
        raise ValueError(f"{path}: field 'entries' is missing or not a list")
    entries, seen = [], {}
    for i, rec in enumerate(doc["entries"]):
        try:
            entry = GroupedGemmEntry.from_dict(rec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: entries[{i}]: {err}") from None
        if entry.key() in seen:
            raise ValueError(f"{path}: entries[{i}] repeats the key of entries[{seen[entry.key()]}]")
        seen[entry.key()] = i
        try:
            entry.recorded(doc["device"])
        except ValueError as err:
            raise ValueError(f"{path}: entries[{i}]: {err}") from None
        entries.append(entry)
    return doc["device"], entries


def read_store_file(path: str | Path) -> tuple[str, list[GroupedGemmEntry]]:
    """(the file's device name, its entries), validated; ValueError naming the file and the bad field."""
    return _load(Path(path))


def read_entries(path: str | Path) -> list[GroupedGemmEntry]:
    """Every entry of a store file, validated; ValueError naming the file and the bad field."""
    return _load(Path(path))[1]


def write_entries(path: str | Path, entries: Sequence[GroupedGemmEntry], device: str | None = None) -> Path:
    """Merge `entries` into the store file at `path` (created if absent) atomically, under its file lock.

    An entry with the key of an existing one replaces it; the others are kept. `device` (the file's "device")
    defaults to the existing file's, else the first entry's provenance name. A malformed existing file, or one
    of another device, is a ValueError and is left as it was.
    """
    path = Path(path)
    with path_lock(path):  # held across read-merge-write so two tuners of one device lose no entries
        old_device, old = _load(path) if path.exists() else (None, [])
        name = device or old_device or next((e.provenance.get("name") for e in entries if e.provenance), None)
        if not name:
            raise ValueError(f"{path}: no device name (pass device= or entries with a provenance)")
        if old_device is not None and old_device != name:
            raise ValueError(f"{path}: holds configs of device {old_device!r}, not {name!r}")
        merged = {e.key(): e for e in old}
        merged.update({e.key(): e for e in entries})
        ordered = sorted(merged.values(), key=lambda e: (e.triton, e.gemm, e.kernel, e.dtype, e.num_experts, e.n,
                                                         e.k, e.topk, e.tokens))
        atomic_write_json(path, {"device": name, "entries": [e.to_dict() for e in ordered]})
    return path


class GroupedGemmStore(ConfigFiles[tuple[str, list[GroupedGemmEntry]]]):
    """Run-time lookup of tuned grouped-GEMM configs over files read once per process.

    Folders, in order: `folders` if given, else TRITUNE_CONFIG_DIR (when set) then the shipped
    `tritune/configs/grouped_gemm/`. An entry of an earlier folder shadows one with the same key in a later
    one. Matching is exact on everything but tokens: the exact token count wins, else the nearest tuned count
    at most MAX_TOKEN_RATIO times larger or smaller (ties: the earlier folder, then the larger count), else
    None. A malformed file warns once and is skipped, never raises (`store.files.ConfigFiles`, which also reads each
    file once until `reload()`).
    Given the running `machine`, entries it may not use (provenance.compare: the file's device, the entry's SM
    count, interpreter vs GPU) are passed over, with one warning per file when that leaves nothing; entries of
    the running Triton version come first, else those of other versions serve, with one warning per file.
    """

    KIND = "grouped-GEMM"

    def package_dir(self) -> Path:
        return PACKAGE_DIR

    def read(self, path: Path) -> tuple[str, list[GroupedGemmEntry]]:
        return _load(path)

    def lookup(self, device_name: str, triton_version: str, num_experts: int, n: int, k: int, topk: int, dtype: str,
               gemm: str, kernel: str, tokens: int, *,
               machine: Machine | None = None) -> tuple[dict, str] | None:
        """(config fields, "<file> entry ...") for one kernel of one MoE GEMM at `tokens` tokens, or None
        (`kernels.grouped_gemm_config.launch_config(kernel, fields)` is the kernel's config).

        `machine` (provenance.running_machine()) turns on the provenance check; None: exact Triton version only.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
        want = (num_experts, n, k, topk, dtype, gemm, kernel)
        found: list[tuple[int, Path, GroupedGemmEntry, Recorded]] = []  # every Triton version
        for rank, folder in enumerate(self.folders()):
            path = store_path(folder, device_name)
            device, entries = self.parsed(path) or ("", [])
            found += [(rank, path, e, e.recorded(device)) for e in entries if e.key()[1:-1] == want]
        same = [f for f in found if f[2].triton == triton_version]
        if machine is None:
            picked = _nearest_tokens(same, tokens)
        else:
            fit = [f for f in found if not compare(f[3], machine).skip]
            # Entries of this Triton version first; else any other (another major.minor is served with a warning).
            picked = _nearest_tokens([f for f in fit if f[2].triton == triton_version], tokens) or _nearest_tokens(
                fit, tokens)
            shown = picked or _nearest_tokens(same, tokens) or _nearest_tokens(found, tokens)  # or what would be
            if shown is not None:
                check(str(shown[1]), shown[3], machine)
        if picked is None:
            return None
        _, path, e, recorded = picked
        note = "" if e.tokens == tokens else f" (nearest tuned to {tokens})"
        stale = compare(recorded, machine).stale if machine is not None else ""
        note += f" (stale: {stale})" if stale else ""
        return dict(e.config), f"{path} entry {gemm}/{kernel} tokens={e.tokens}{note}"


def _nearest_tokens(found: list[tuple], tokens: int) -> tuple | None:
    """The (rank, path, entry, recorded) whose entry is of exactly `tokens` (the earliest), else of the nearest
    count at most MAX_TOKEN_RATIO away (ties: the earlier folder, then the larger count), else None."""
    exact = [f for f in found if f[2].tokens == tokens]
    if exact:
        return exact[0]
    near = [(abs(math.log2(f[2].tokens / tokens)), f[0], -f[2].tokens, i) for i, f in enumerate(found)
            if max(f[2].tokens, tokens) <= MAX_TOKEN_RATIO * min(f[2].tokens, tokens)]
    return found[min(near)[3]] if near else None


_DEFAULT = ProcessWide(GroupedGemmStore)


def default_store() -> GroupedGemmStore:
    """The process-wide store the ops use."""
    return _DEFAULT.get()


def reload_grouped_gemm_configs() -> None:
    """Make lookups see store files written or changed since they were read (and a new TRITUNE_CONFIG_DIR)."""
    built = _DEFAULT.built()
    if built is not None:
        built.reload()
