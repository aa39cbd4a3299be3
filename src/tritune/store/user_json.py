"""Tuned configs of user kernels (`tritune.tunable_kernel`): one JSON file per kernel, one entry per (device, key).

Entries come from `UserKernel.tune()` (source "jit") or from `tritune aot import` (source "aot"). Writes merge by
(device, key_text) under the file's lock and replace the file atomically; a malformed file is never overwritten.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from tritune.store.atomic import atomic_write_json, path_lock
from tritune.store.files import ConfigFiles
from tritune.store.provenance import Machine, Recorded, check

FORMAT = "tritune-user-kernel"
VERSION = 1
SOURCES = ("jit", "aot")


class UserStoreError(ValueError):
    """A store file that cannot be read or merged into; the message is one line naming the file."""


@dataclass(frozen=True)
class UserEntry:
    """The winner of one key on one device. `key` maps key argument names (and tensor names -> dtype) to values."""

    device: str  # DeviceInfo.name, e.g. "NVIDIA H100 80GB HBM3"
    triton: str  # Triton version it was tuned with
    key: dict[str, Any]
    key_text: str  # UserKernel.key_text(): the lookup key
    config: dict[str, Any]  # space parameter -> value (launch options included)
    time_us: float  # nan when unknown
    tuned_at: str  # ISO 8601
    source: str = "jit"  # "jit" (UserKernel.tune) or "aot" (tritune aot import)
    provenance: dict[str, Any] = field(default_factory=dict)

    def recorded(self) -> Recorded:
        """Its provenance: `device` and `triton`, with SMs/torch/interpreter from `provenance` when recorded."""
        return replace(Recorded.from_provenance(self.provenance), name=self.device, triton_version=self.triton)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "triton": self.triton, "key": dict(self.key), "key_text": self.key_text,
                "config": dict(self.config), "time_us": self.time_us, "tuned_at": self.tuned_at,
                "source": self.source, "provenance": dict(self.provenance)}


def now_iso() -> str:
    """The current time as an ISO 8601 string with the local UTC offset (what `tuned_at` holds)."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _tuned_order(entry: UserEntry) -> tuple[int, float, str]:
    """Sort key for "latest wins": parsed time when the text parses, else the text itself."""
    try:
        moment = datetime.fromisoformat(entry.tuned_at)
        if moment.tzinfo is None:
            moment = moment.astimezone()
        return (1, moment.timestamp(), entry.tuned_at)
    except ValueError:
        return (0, 0.0, entry.tuned_at)


_FIELDS: dict[str, tuple[type, ...]] = {
    "device": (str,), "triton": (str,), "key": (dict,), "key_text": (str,), "config": (dict,),
    "time_us": (int, float, type(None)), "tuned_at": (str,), "source": (str,), "provenance": (dict,),
}


def _entry(path: Path, index: int, raw: Any) -> UserEntry:
    where = f"{path}: entry {index}"
    if not isinstance(raw, dict):
        raise UserStoreError(f"{where} is not a JSON object")
    missing = [name for name in _FIELDS if name not in raw and name != "provenance"]
    if missing:
        raise UserStoreError(f"{where} lacks {', '.join(repr(m) for m in missing)}")
    for name, types in _FIELDS.items():
        value = raw.get(name, {}) if name == "provenance" else raw[name]
        if not isinstance(value, types) or (isinstance(value, bool) and name == "time_us"):
            raise UserStoreError(f"{where}: {name!r} has the wrong type ({type(value).__name__})")
    if raw["source"] not in SOURCES:
        raise UserStoreError(f"{where}: source {raw['source']!r} is not one of {', '.join(SOURCES)}")
    for name, value in raw["config"].items():
        if not isinstance(value, (int, float, str, bool)):
            raise UserStoreError(f"{where}: config parameter {name!r} is not a scalar ({value!r})")
    time_us = math.nan if raw["time_us"] is None else float(raw["time_us"])
    entry = UserEntry(raw["device"], raw["triton"], raw["key"], raw["key_text"], raw["config"], time_us,
                      raw["tuned_at"], raw["source"], raw.get("provenance", {}))
    try:
        entry.recorded()
    except ValueError as exc:
        raise UserStoreError(f"{where}: {exc}") from None
    return entry


def pick(path: Path, entries: Sequence[UserEntry], device: str, key_text: str,
         machine: Machine | None = None) -> UserEntry | None:
    """The entry of `path` (its `entries`) for exactly this device name and key text (the latest `tuned_at` if
    several), else None. With `machine`, one it may not use is None (see `UserKernelStore.lookup`)."""
    found = [e for e in entries if e.device == device and e.key_text == key_text]
    entry = max(found, key=_tuned_order) if found else None
    if entry is None or machine is None:
        return entry
    return None if check(str(path), entry.recorded(), machine).skip else entry


class UserKernelFiles(ConfigFiles[list[UserEntry]]):
    """Results files as a kernel's calls read them (`tritune.user.store.StoredConfigs`): each file's entries parsed
    once until `reload()`; a malformed file skipped with one warning naming it and the problem."""

    KIND = "user-kernel"

    def read(self, path: Path) -> list[UserEntry]:
        return UserKernelStore(path).entries()


class UserKernelStore:
    """One kernel's results file. Reads are fresh each call (callers cache); `put` merges under a file lock."""

    def __init__(self, path: str | Path, kernel: str | None = None) -> None:
        self.path = Path(path)
        self.kernel = kernel  # written into a new file; None: the file name's stem

    def _read(self) -> tuple[str | None, list[UserEntry]]:
        """(kernel name in the file, entries); (None, []) when the file does not exist."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None, []
        except OSError as exc:
            raise UserStoreError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserStoreError(f"{self.path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                                 ) from None
        if not isinstance(doc, dict):
            raise UserStoreError(f"{self.path}: expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT:
            raise UserStoreError(f"{self.path}: 'format' is {doc.get('format')!r}, expected {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise UserStoreError(f"{self.path}: unsupported version {doc.get('version')!r} (this tritune reads "
                                 f"{VERSION})")
        kernel = doc.get("kernel")
        if not isinstance(kernel, str):
            raise UserStoreError(f"{self.path}: 'kernel' must be a string, got {kernel!r}")
        entries = doc.get("entries")
        if not isinstance(entries, list):
            raise UserStoreError(f"{self.path}: 'entries' must be a list")
        return kernel, [_entry(self.path, i, raw) for i, raw in enumerate(entries)]

    def entries(self) -> list[UserEntry]:
        """Every entry in file order; [] when the file does not exist; UserStoreError when it is malformed."""
        return self._read()[1]

    def lookup(self, device: str, key_text: str, *, machine: Machine | None = None) -> UserEntry | None:
        """The entry for exactly this device name and key text (the latest `tuned_at` if several), else None.

        With `machine` (provenance.running_machine()), an entry it may not use (another SM count, interpreter vs
        GPU) is None and one of another Triton major.minor is served; either warns once per file and mismatch.
        """
        return pick(self.path, self.entries(), device, key_text, machine)

    def put(self, entries: Sequence[UserEntry]) -> None:
        """Merge `entries` into the file: one entry per (device, key_text), the latest `tuned_at` kept.

        Read, merge and write happen under the file's lock; the write is atomic. A malformed existing file raises
        UserStoreError and is left as it was; so does a file written for another kernel.
        """
        for entry in entries:
            if entry.source not in SOURCES:
                raise ValueError(f"entry source {entry.source!r} is not one of {', '.join(SOURCES)}")
        with path_lock(self.path):
            kernel, existing = self._read()
            if kernel is not None and self.kernel is not None and kernel != self.kernel:
                raise UserStoreError(f"{self.path}: holds kernel {kernel!r}, not {self.kernel!r}")
            merged: dict[tuple[str, str], UserEntry] = {}
            for entry in [*existing, *entries]:
                slot = (entry.device, entry.key_text)
                if slot not in merged or _tuned_order(entry) >= _tuned_order(merged[slot]):
                    merged[slot] = entry
            doc = {
                "format": FORMAT,
                "version": VERSION,
                "kernel": kernel or self.kernel or self.path.stem,
                "entries": [merged[slot].to_json() for slot in sorted(merged)],
            }
            atomic_write_json(self.path, doc)
