"""Atomic file writes: a reader sees the old file or the new one, never half of one; a crash keeps the old.

Writers of the same path serialise on `<path>.lock` (a filelock), shared between processes and threads.
"""

from __future__ import annotations

import json
import math
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from filelock import FileLock

_LOCKS: dict[str, FileLock] = {}
_LOCKS_GUARD = threading.Lock()


def path_lock(path: Path) -> FileLock:
    """The lock guarding writes to `path` (file `<path>.lock`, left in place on release).

    One FileLock object per path per process, so it is re-entrant: a read-modify-write may hold it around
    `atomic_write_text`, which takes it again, without deadlocking on itself.
    """
    key = str(Path(path).absolute())
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = FileLock(key + ".lock")
        return lock


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
