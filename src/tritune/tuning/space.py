"""Search spaces: named parameter lists plus named constraints, pruned before anything is compiled.

Each constraint has a name so the summary can say how many candidates each rule removed. A `Param` says which
values one parameter may take at all (checked when a user's list replaces a default one, before any work).
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
class Param:
    """The values one parameter may take: one of `choices` (compared with their type, so JSON `true` is not 1),
    else integers >= `least`, powers of two when `pow2` (tile sizes `tl.arange` and `tl.dot` take)."""

    least: int = 1
    pow2: bool = False
    choices: tuple[Scalar, ...] = ()
    pow2_pairs: bool = False  # with pow2: the sum of two powers of two (each >= least) too

    def fault(self, value: object) -> str | None:
        """Why `value` is not allowed ('must be a power of two >= 16'), None when it is."""
        if self.choices:
            if any(type(value) is type(c) and value == c for c in self.choices):
                return None
            return "must be one of " + ", ".join(json.dumps(c) for c in self.choices)
        whole = isinstance(value, int) and not isinstance(value, bool)
        if self.pow2 and not (whole and value >= self.least and (value & (value - 1) == 0
                                                                 or self.pow2_pairs and _pow2_pair(value, self.least))):
            return (f"must be a power of two >= {self.least}"
                    + (" or the sum of two (192 = 128 + 64)" if self.pow2_pairs else ""))
        if not (whole and value >= self.least):
            return f"must be an integer >= {self.least}"
        return None


def _pow2_pair(value: int, least: int) -> bool:
    """Whether `value` is the sum of two powers of two, each at least `least` (the larger taken first)."""
    high = 1 << (value.bit_length() - 1)
    low = value - high
    return low >= least and low & (low - 1) == 0


BOOL = Param(choices=(False, True))


def check_values(overrides: Mapping[str, Sequence[Scalar]], rules: Mapping[str, Param]) -> None:
    """ValueError on the first unknown name or value `rules` does not allow: one line naming the key and value."""
    unknown = sorted(set(overrides) - set(rules))
    if unknown:
        raise ValueError(f"unknown search-space parameter(s) {unknown}; known: {sorted(rules)}")
    for name, values in overrides.items():
        for value in values:
            if (why := rules[name].fault(value)) is not None:
                raise ValueError(f"{name} value {json.dumps(value)} {why}")


@dataclass(frozen=True)
class PruneResult:
    kept: list[Config]
    pruned: dict[str, int]  # constraint name -> configs it removed (first failing rule counts)

    @property
    def pruned_total(self) -> int:
        return sum(self.pruned.values())


@dataclass(frozen=True)
class SearchSpace:
    """The product of `params`' lists, pruned by `constraints`, plus `extra`: points measured whatever the
    constraints say (the op's own untuned choice, so a tuned result is never one the op would beat untuned), after
    the product's, each once."""

    params: Mapping[str, Sequence[Scalar]]
    constraints: tuple[Constraint, ...] = field(default=())
    rules: Mapping[str, Param] | None = None  # what `with_params` lets replace each list; None: names only
    extra: tuple[Config, ...] = ()

    @property
    def size(self) -> int:
        total = 1
        for values in self.params.values():
            total *= len(values)
        return total + len(self._extra_outside())

    def _in_product(self, config: Config) -> bool:
        values = config.as_dict()
        return values.keys() == self.params.keys() and all(values[k] in self.params[k] for k in values)

    def _extra_outside(self) -> list[Config]:
        """The extra points not in the product, each once, in order."""
        return [c for c in dict.fromkeys(self.extra) if not self._in_product(c)]

    def configs(self) -> Iterator[Config]:
        names = sorted(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield Config(tuple(zip(names, values, strict=True)))
        yield from self._extra_outside()

    def prune(self) -> PruneResult:
        kept: list[Config] = []
        pruned: dict[str, int] = {c.name: 0 for c in self.constraints}
        extra = set(self.extra)
        for config in self.configs():
            failing = None if config in extra else next((c for c in self.constraints if not c.ok(config)), None)
            if failing is None:
                kept.append(config)
            else:
                pruned[failing.name] += 1
        return PruneResult(kept, {k: v for k, v in pruned.items() if v})

    def with_params(self, overrides: Mapping[str, Sequence[Scalar]]) -> SearchSpace:
        """Replace parameter lists (e.g. from --search-space); an unknown name, or a value `rules` does not allow,
        is a ValueError."""
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise ValueError(f"unknown search-space parameter(s) {unknown}; known: {sorted(self.params)}")
        if self.rules is not None:
            check_values(overrides, self.rules)
        merged = dict(self.params)
        merged.update({k: tuple(v) for k, v in overrides.items()})
        return SearchSpace(merged, self.constraints, self.rules, self.extra)


def load_space_file(path: str | Path, rules: Mapping[str, Param] | None = None) -> dict[str, tuple[Scalar, ...]]:
    """Read a JSON object {param: [values...]} (a value listed twice is kept once); raise ValueError naming the
    file and the bad entry. With `rules`, every name and value is checked against them here, before any work."""
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
        # Keyed with the type, so `true` and 1 (equal in Python) are two values, and a repeated one is kept once.
        out[name] = tuple(v for _, v in dict.fromkeys((type(v), v) for v in values))
    if rules is not None:
        try:
            check_values(out, rules)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return out
