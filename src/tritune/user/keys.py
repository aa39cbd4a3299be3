"""Keys and grids of a user kernel: the plain values a key is made of, its canonical text, and the launch grid from
`tritune.expr` expressions (or a callable) over the call's integer arguments and the config."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tritune.expr import ExprError, evaluate
from tritune.tuning.types import Config, Scalar

if TYPE_CHECKING:
    from tritune.user.validation import KernelSpec

PLAIN = (bool, int, float, str)  # what a key value, a problem value or a space value may be
GridFn = Callable[[dict[str, Any]], Sequence[int]]  # meta (scalar arguments ∪ config) -> grid


def scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    """The plain scalar entries of an argument or problem dict (what constraints, grids and cost models see)."""
    return {k: v for k, v in values.items() if isinstance(v, PLAIN)}


def plain_value(name: str, value: Any) -> Scalar:
    """A key value as a plain Python scalar (numpy and torch integers included)."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"key argument {name!r} must be an int, float, bool or str, got {type(value).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> "float16" (how tensor dtypes appear in keys)."""
    return str(dtype).removeprefix("torch.")


def key_of(spec: KernelSpec, args: Mapping[str, Any]) -> dict[str, Any]:
    """Key arguments' values (in `key` order), then every tensor argument's dtype name (parameter order)."""
    key: dict[str, Any] = {}
    for name in spec.key_names:
        if name not in args:
            raise ValueError(f"kernel {spec.name}: key argument {name!r} is missing")
        if isinstance(args[name], torch.Tensor):
            raise ValueError(f"kernel {spec.name}: key argument {name!r} is a tensor; key its size arguments")
        key[name] = plain_value(name, args[name])
    for name in spec.arg_names:
        value = args.get(name)
        if isinstance(value, torch.Tensor):
            key[name] = dtype_name(value.dtype)
    return key


def key_text(key: Mapping[str, Any]) -> str:
    """Canonical text of a key, e.g. "Z=1,H=2,N_CTX=128,CAUSAL=True,Q=float16,Out=float16"."""
    return ",".join(f"{k}={v}" for k, v in key.items())


def grid_for(spec: KernelSpec, args: Mapping[str, Any], config: Config | Mapping[str, Scalar]) -> tuple[int, ...]:
    """Launch grid: expressions over int/bool args (bools as 0/1) ∪ config, or grid(meta) when callable."""
    params = config.as_dict() if isinstance(config, Config) else dict(config)
    if callable(spec.grid):
        return tuple(int(g) for g in spec.grid({**scalars(args), **params}))
    merged = {**args, **params}
    names = tuple((n, int(merged[n])) for n in spec.grid_names if isinstance(merged.get(n), (bool, int)))
    try:
        if not spec.grid_reads_tensors:  # the common case, on every launch: cached
            return _cached_grid(spec.grid, names)
        return _tensor_grid(spec.grid, names, args)
    except ExprError as exc:
        raise ValueError(f"kernel {spec.name}: grid {spec.grid}: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _cached_grid(exprs: tuple[str, ...], names: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    return tuple(int(evaluate(text, dict(names))) for text in exprs)


def _tensor_grid(exprs: tuple[str, ...], names: tuple[tuple[str, int], ...], tensors: Mapping) -> tuple[int, ...]:
    """Grid expressions where numel(ARG) and first(ARG) read the call's tensors (not cached)."""

    def tensor(name: str) -> torch.Tensor:
        if not isinstance(tensors[name], torch.Tensor):
            raise ValueError(f"{name!r} is not a tensor argument")
        return tensors[name]

    def first(name: str) -> int:
        return int(tensor(name).reshape(-1)[0].item())  # reads the device: a sync on a GPU

    return tuple(int(evaluate(t, dict(names), numel=lambda n: tensor(n).numel(), first=first)) for t in exprs)
