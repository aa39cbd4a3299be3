"""Atomic file writes: a reader sees the old file or the new one, never half of one; a crash keeps the old.

Writers of the same path serialise on a filelock shared between processes and threads, kept in one folder of the
user's cache (never beside the output); `check_writable` tells, before any work, whether an output can be written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from filelock import FileLock

from tritune import knobs

_LOCKS: dict[str, FileLock] = {}
_LOCKS_GUARD = threading.Lock()


def lock_folder() -> Path:
    """Where every path lock lives: `<TRITUNE_CACHE_DIR>/locks` (default ~/.cache/tritune/locks), created on use;
    `<tmp>/tritune-locks-<uid>` when that cannot be created (a read-only home)."""
    folder = knobs.cache_dir() / "locks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"tritune-locks-{os.getuid() if hasattr(os, 'getuid') else 0}"
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def lock_path(path: Path) -> Path:
    """The lock file of `path`: named by its file name and a hash of its resolved absolute path (symlinks and
    relative spellings of one file share a lock), in `lock_folder()`. The empty lock file stays there after release:
    deleting a lock file another process may be waiting on would let two writers in at once."""
    resolved = str(Path(path).resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:16]
    return lock_folder() / f"{Path(path).name[:80]}.{digest}.lock"


def path_lock(path: Path) -> FileLock:
    """The lock guarding writes to `path` (see `lock_path`; nothing is created beside `path`).

    One FileLock object per lock file per process, so it is re-entrant: a read-modify-write may hold it around
    `atomic_write_text`, which takes it again, without deadlocking on itself. Processes share it when they share a
    TRITUNE_CACHE_DIR (the default: every process of one user on one machine).
    """
    key = str(lock_path(path))
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = FileLock(key)
        return lock


def check_writable(path: Path, *, folder: bool = False) -> None:
    """ValueError (one line naming `path`) unless `path` can be written as a file (or, with `folder`, used as a
    folder to write in): not a folder where a file must be (or the reverse), no file where a parent folder must be,
    write permission where the file (or a missing folder) would be made; and a TRITUNE_CACHE_DIR that can hold the
    write locks (`lock_folder`; not a file). Creates nothing; what it cannot foresee (a full disk) still fails when
    written."""
    knobs.cache_dir()  # a bad TRITUNE_CACHE_DIR is its one-line ValueError now, not a traceback once the tune is done
    path = Path(path)
    what = "folder" if folder else "file"
    if path.exists():
        if folder != path.is_dir():
            raise ValueError(f"cannot write the output {what} {path}: it is {'a file' if folder else 'a folder'}")
        writable = os.access(path, os.W_OK | os.X_OK) if folder else os.access(path.parent, os.W_OK | os.X_OK)
        if not writable:
            raise ValueError(f"cannot write the output {what} {path}: no write permission in "
                             f"{path if folder else path.parent}")
        return
    parent = path.parent
    while not parent.exists():  # the first existing ancestor: the missing folders would be made in it
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write the output {what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write the output {what} {path}: no write permission in {parent}")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically, creating parent folders.

    Writes a temp file in the same folder, flushes and fsyncs it, then `os.replace`s it over `path`. On any
    error the temp file is removed and the previous `path` is untouched. A new file gets the usual
    0o666-minus-umask mode; an existing file keeps its mode.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path_lock(path):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o7777)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform/filesystem allows opening a folder.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (inf, -inf, nan) replaced by None, through dicts, lists and tuples.

    JSON has no inf/nan; Python's json would write the non-standard `Infinity`/`NaN`. Readers map None back
    to the float they expect (e.g. nan for "not measured").
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(value) for value in obj]
    return obj


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON (indent 2, keys in insertion order, trailing newline) atomically.

    inf/nan floats are written as null (see `json_safe`). The text is made before any file is touched, so
    an object json cannot encode raises TypeError/ValueError and leaves the previous file as it was.
    """
    text = json.dumps(json_safe(obj), indent=2, sort_keys=False, allow_nan=False) + "\n"
    atomic_write_text(path, text)
