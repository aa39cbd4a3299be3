"""Where a user kernel's tuned configs live and how a call finds one: the results file's path, a lookup that warns
(never raises) on a bad file or a stale entry (the stores' one policy, `tritune.store.files`), the per-process cache
of each key's config, and the entry a tune persists.

The file format itself is `tritune.store.user_json`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tritune import knobs
from tritune.device import DeviceInfo
from tritune.store.provenance import running_machine
from tritune.store.user_json import UserEntry, UserKernelFiles, now_iso, pick
from tritune.tuning.types import Config, Measurement


def default_path(name: str) -> Path:
    """$TRITUNE_CONFIG_DIR/user_kernels/<name>.json, else ./tritune_tuned/<name>.json."""
    folder = knobs.config_dir()
    return (folder / "user_kernels" if folder is not None else Path("tritune_tuned")) / f"{name}.json"


class StoredConfigs:
    """A kernel's tuned configs as a call sees them: (device name, key text) -> Config, cached per process."""

    def __init__(self, name: str, space_names: frozenset[str], path: str | Path | None = None) -> None:
        self.name, self.space_names = name, space_names
        self._path = None if path is None else Path(path)
        self._cache: dict[tuple[str, str], Config] = {}  # the one cache of what a call chose
        self._files = UserKernelFiles()  # the results file, parsed once until reload

    @property
    def path(self) -> Path:
        """The results file: as given, else `default_path(name)` (read when asked, so the knob may change)."""
        return self._path if self._path is not None else default_path(self.name)

    @path.setter
    def path(self, path: str | Path | None) -> None:
        self._path = None if path is None else Path(path)
        self.reload()

    def reload(self) -> None:
        """Forget the cached configs and the file read; the next call per key reads the file again."""
        self._cache.clear()
        self._files.reload()

    def config_for(self, device: str, key_text: str, fallback: Callable[[], Config]) -> Config:
        """The stored config for (device, key), else `fallback()`; either is cached for the process."""
        slot = (device, key_text)
        config = self._cache.get(slot)
        if config is None:
            config = self._lookup(device, key_text) or fallback()
            self._cache[slot] = config
        return config

    def _lookup(self, device: str, key_text: str) -> Config | None:
        # stacklevel 5: the warning points at the caller of UserKernel.run (run -> best_config -> here).
        try:
            path = self.path
        except ValueError as exc:  # a bad TRITUNE_CONFIG_DIR, where the default path lives
            warnings.warn(f"{exc}; kernel {self.name} uses its default config", stacklevel=5)
            return None
        entries = self._files.parsed(path)  # None: no file, or a malformed one (skipped with one warning)
        entry = pick(path, entries or [], device, key_text, machine=running_machine())
        if entry is None:
            return None
        if set(entry.config) != set(self.space_names):
            warnings.warn(f"{self.path}: the config stored for {key_text} sets {sorted(entry.config)}, the "
                          f"space has {sorted(self.space_names)}; using the default config", stacklevel=5)
            return None
        return Config.from_dict(entry.config)


def tuned_entry(device: DeviceInfo, key: Mapping[str, Any], key_text: str, best: Measurement, *, candidates: int,
                failed: int, space_size: int, source_hash: str) -> UserEntry:
    """The store entry of one tuned problem's winner, with its provenance (device, search, kernel source)."""
    provenance = {**device.provenance(), "candidates": candidates, "failed": failed, "space_size": space_size,
                  "kernel_source_sha256": source_hash, "timing": best.extra.get("method", "")}
    return UserEntry(device.name, device.triton_version, dict(key), key_text, best.config.as_dict(), best.time_us,
                     now_iso(), "jit", provenance)
