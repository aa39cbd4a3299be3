"""Search spaces: named parameter lists plus named constraints, pruned before anything is compiled.

Each constraint has a name so the summary can say how many candidates each rule removed.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritune.tuning.types import Config, Scalar


@dataclass(frozen=True)
class Constraint:
    """A rule a config must satisfy; `ok` returns False to prune."""

    name: str
    ok: Callable[[Config], bool]


@dataclass(frozen=True)
class PruneResult:
    kept: list[Config]
    pruned: dict[str, int]  # constraint name -> configs it removed (first failing rule counts)

    @property
    def pruned_total(self) -> int:
        return sum(self.pruned.values())


@dataclass(frozen=True)
class SearchSpace:
    params: Mapping[str, Sequence[Scalar]]
    constraints: tuple[Constraint, ...] = field(default=())

    @property
    def size(self) -> int:
        total = 1
        for values in self.params.values():
            total *= len(values)
        return total

    def configs(self) -> Iterator[Config]:
        names = sorted(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield Config(tuple(zip(names, values, strict=True)))

    def prune(self) -> PruneResult:
        kept: list[Config] = []
        pruned: dict[str, int] = {c.name: 0 for c in self.constraints}
        for config in self.configs():
            failing = next((c for c in self.constraints if not c.ok(config)), None)
            if failing is None:
                kept.append(config)
            else:
                pruned[failing.name] += 1
        return PruneResult(kept, {k: v for k, v in pruned.items() if v})

    def with_params(self, overrides: Mapping[str, Sequence[Scalar]]) -> SearchSpace:
        """Replace parameter lists (e.g. from --search-space); unknown names are an error."""
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise ValueError(f"unknown search-space parameter(s) {unknown}; known: {sorted(self.params)}")
        merged = dict(self.params)
        merged.update({k: tuple(v) for k, v in overrides.items()})
        return SearchSpace(merged, self.constraints)


def load_space_file(path: str | Path) -> dict[str, tuple[Scalar, ...]]:
    """Read a JSON object {param: [values...]}; raise ValueError naming the file and the bad entry."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read search-space file ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a JSON object of parameter name -> list of values")
    out: dict[str, tuple[Scalar, ...]] = {}
    for name, values in data.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}: parameter {name!r} must be a non-empty list, got {values!r}")
        for value in values:
            if not isinstance(value, (int, float, str, bool)):
                raise ValueError(f"{path}: parameter {name!r} has a non-scalar value {value!r}")
        out[name] = tuple(values)
    return out
