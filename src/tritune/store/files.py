"""What every config store the ops read shares (GEMM, grouped GEMM, fused MoE, user kernels): where its files are,
each file parsed once until `reload`, and the one malformed-file policy: a file that cannot be read or parsed is
skipped, with one warning naming it and the problem. Lookups over the parsed files are the stores' own; the one
cache of what a lookup chose is the caller's (the op's, or a user kernel's per-key cache).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from tritune import knobs

P = TypeVar("P")


def user_folder() -> Path | None:
    """TRITUNE_CONFIG_DIR when set, else None; a bad value is warned about and ignored (lookups go on with the shipped
    files, as an unset one would)."""
    try:
        return knobs.config_dir()
    except ValueError as err:
        warnings.warn(f"tritune: ignoring {err}", stacklevel=3)
        return None


class ConfigFiles(Generic[P]):
    """A store's files as lookups read them. Subclasses name the kind (for warnings), the shipped folder, and `read`.

    Folders, in order: `folders` when given, else TRITUNE_CONFIG_DIR (when set) then `package_dir()` (when the store
    ships files). `parsed(path)` reads a file once; `reload()` forgets every file read and the folder list.
    """

    KIND: ClassVar[str] = "config"  # "GEMM", "grouped-GEMM", "fused-MoE", "user-kernel": names files in warnings

    def __init__(self, folders: Sequence[str | Path] | None = None) -> None:
        self._given = None if folders is None else [Path(f) for f in folders]
        self._lock = threading.RLock()
        self.reload()

    def package_dir(self) -> Path | None:
        """The shipped files' folder, searched after the user's; None when the store ships none."""
        return None

    def read(self, path: Path) -> P:
        """The parsed contents of the file at `path`; ValueError (or OSError) naming the file and the problem."""
        raise NotImplementedError

    def reload(self) -> None:
        """Forget the parsed files and the folder list; the next lookup reads the disk (and the knobs) again."""
        with self._lock:
            self._folders: list[Path] | None = None
            self._parsed: dict[Path, P | None] = {}

    def folders(self) -> list[Path]:
        with self._lock:
            if self._folders is None:
                if self._given is not None:
                    self._folders = list(self._given)
                else:
                    user, shipped = user_folder(), self.package_dir()
                    self._folders = [f for f in (user, shipped) if f is not None]
            return self._folders

    def parsed(self, path: Path) -> P | None:
        """The file at `path` as `read` gives it, read once until `reload`; None when there is no such file, or when
        it is malformed (then skipped with one warning naming it and the problem)."""
        path = Path(path)
        with self._lock:
            if path not in self._parsed:
                self._parsed[path] = self._read_or_warn(path)
            return self._parsed[path]

    def _read_or_warn(self, path: Path) -> P | None:
        if not path.is_file():
            return None
        try:
            return self.read(path)
        except (OSError, ValueError) as err:
            problem = str(err).replace("\n", " ")
            where = "" if str(path) in problem else f"{path}: "
            warnings.warn(f"tritune: skipping malformed {self.KIND} config file: {where}{problem}", stacklevel=5)
            return None
