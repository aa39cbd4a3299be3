"""`Config`: one point of a search space, named scalar parameters kept sorted, so equal configs hash equal and a winner
is `min(times, key=times.get)`. The value the engine measures, the tuners build launch configs from, and the stores
write and read back.

A leaf every layer may import (the engine names it as `tritune.tuning.types.Config`): it imports nothing of tritune's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

Scalar = int | float | str | bool


@dataclass(frozen=True, order=True)
class Config:
    """One point of a search space: named scalar parameters, kept sorted so equal configs hash equal."""

    items: tuple[tuple[str, Scalar], ...]

    @staticmethod
    def of(**params: Scalar) -> Config:
        return Config.from_dict(params)

    @staticmethod
    def from_dict(params: dict[str, Scalar]) -> Config:
        for name, value in params.items():
            if not isinstance(value, (int, float, str, bool)):
                raise TypeError(f"config parameter {name}={value!r} is not a scalar")
        return Config(tuple(sorted(params.items())))

    def as_dict(self) -> dict[str, Scalar]:
        return dict(self.items)

    def __getitem__(self, name: str) -> Scalar:
        for key, value in self.items:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str, default: Scalar | None = None) -> Scalar | None:
        for key, value in self.items:
            if key == name:
                return value
        return default

    def replace(self, **params: Scalar) -> Config:
        merged = self.as_dict()
        merged.update(params)
        return Config.from_dict(merged)

    def key(self) -> str:
        """Stable text form used as the journal key and in profile files."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_key(text: str) -> Config:
        return Config.from_dict(json.loads(text))

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items)
