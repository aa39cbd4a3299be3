"""One lazily built object per process (the config stores the ops read): built on first use, once, even when
several threads ask at the same moment, so every caller shares one cache that `reload` refreshes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ProcessWide(Generic[T]):
    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._obj: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        """The object, built now if this is the first call."""
        obj = self._obj
        if obj is not None:
            return obj
        with self._lock:
            if self._obj is None:
                self._obj = self._make()
            return self._obj

    def built(self) -> T | None:
        """The object if some caller has built it, else None (nothing is built)."""
        return self._obj
