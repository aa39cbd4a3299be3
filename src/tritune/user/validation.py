"""A user kernel's declaration checked against its `@triton.jit` signature, once, when it is declared: `KernelSpec`
(what every other part reads), and the checks of what `inputs()` returns and of a problem's values.

Every error is a one-line ValueError (TypeError for a wrong kind of object) naming the kernel and the culprit.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tritune.expr import ExprError, args_used, variables_used
from tritune.tuning.types import Config, Scalar
from tritune.user.keys import PLAIN, GridFn

# Keyword arguments of a Triton launch that are not kernel parameters: allowed in a space without a constexpr.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

Constraint = Callable[[dict[str, Any]], bool]  # meta (scalar arguments ∪ config) -> keep this config?


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """What a declaration says, checked: names, the space, key, output and grid in the kernel's own terms."""

    name: str  # names the results file and the journal's problems
    arg_names: tuple[str, ...]  # every parameter, in declaration order
    required: tuple[str, ...]  # parameters without a default
    constexpr_names: frozenset[str]
    space: dict[str, tuple[Scalar, ...]]  # config parameter -> values, in the order given
    output: str  # the argument the kernel writes
    key_names: tuple[str, ...]  # arguments whose values form the key (tensor dtypes are added)
    grid: tuple[str, ...] | GridFn  # 1-3 expressions, or grid(meta) -> tuple
    grid_names: tuple[str, ...]  # integer names the expressions read
    grid_reads_tensors: bool  # numel()/first() in an expression (or a callable grid): not cached per call
    constraints: dict[str, Constraint]
    default: Config | None  # the config for untuned keys; None: the first of the pruned space


def _is_constexpr(annotation: Any) -> bool:
    """`tl.constexpr` written as the class or as text ("tl.constexpr" under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        return annotation.strip().rsplit(".", 1)[-1] == "constexpr"
    return getattr(annotation, "__name__", None) == "constexpr"


def kernel_params(kernel: Any) -> list[inspect.Parameter]:
    """The parameters of a `@triton.jit` function (compiled or interpreted), in declaration order."""
    from triton.runtime.jit import KernelInterface

    fn = getattr(kernel, "fn", None)
    if not isinstance(kernel, KernelInterface) or not inspect.isfunction(fn):
        raise TypeError(f"expected a @triton.jit function (not autotuned or wrapped), got {type(kernel).__name__}")
    return list(inspect.signature(fn).parameters.values())


def declare(kernel: Any, *, space: Mapping[str, Sequence[Scalar]], key: str | Sequence[str], output: str,
            grid: str | Sequence[str | int] | GridFn, constraints: Mapping[str, Constraint] | None = None,
            name: str | None = None, default: Mapping[str, Scalar] | None = None) -> KernelSpec:
    """Check a declaration against the kernel's signature; the arguments are `tunable_kernel`'s."""
    params = kernel_params(kernel)
    name = name or kernel.fn.__name__
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(f"kernel name {name!r} must be letters, digits, '_', '.' or '-' (it names files)")
    arg_names = tuple(p.name for p in params)
    constexpr_names = frozenset(p.name for p in params if _is_constexpr(p.annotation))
    where = f"kernel {name}"

    if not space:
        raise ValueError(f"{where}: the search space is empty")
    space_params: dict[str, tuple[Scalar, ...]] = {}
    for param, values in space.items():
        values = tuple(values)
        if not values or not all(isinstance(v, PLAIN) for v in values):
            raise ValueError(f"{where}: space parameter {param!r} needs a non-empty list of scalars, not {values}")
        if param not in LAUNCH_OPTIONS:
            if param not in arg_names:
                raise ValueError(f"{where}: space parameter {param!r} is not a parameter of the kernel "
                                 f"(parameters: {', '.join(arg_names)})")
            if param not in constexpr_names:
                raise ValueError(f"{where}: space parameter {param!r} is not a tl.constexpr parameter of the "
                                 f"kernel; annotate it `{param}: tl.constexpr`")
        space_params[param] = values
    if output not in arg_names or output in space_params:
        raise ValueError(f"{where}: output {output!r} is not a (non-config) argument of the kernel")
    key_names = (key,) if isinstance(key, str) else tuple(key)
    for key_name in key_names:
        if key_name not in arg_names or key_name in space_params:
            raise ValueError(f"{where}: key name {key_name!r} is not a (non-config) argument of the kernel")
    if isinstance(grid, str):
        grid = (grid,)
    grid = grid if callable(grid) else tuple(map(str, grid))
    grid_names, grid_reads_tensors = _check_grid(where, grid, arg_names, space_params)
    constraints = dict(constraints or {})
    for rule, pred in constraints.items():
        if not callable(pred):
            raise TypeError(f"{where}: constraint {rule!r} is not callable")
    default_config = None if default is None else Config.from_dict(dict(default))
    if default_config is not None and set(default_config.as_dict()) != set(space_params):
        raise ValueError(f"{where}: default config sets {sorted(default_config.as_dict())}, the space has "
                         f"{sorted(space_params)}")
    return KernelSpec(name, arg_names, tuple(p.name for p in params if p.default is inspect.Parameter.empty),
                      constexpr_names, space_params, output, key_names, grid, grid_names, grid_reads_tensors,
                      constraints, default_config)


def _check_grid(where: str, grid: tuple[str, ...] | GridFn, arg_names: tuple[str, ...],
                space: Mapping[str, Any]) -> tuple[tuple[str, ...], bool]:
    """(integer names the grid reads, whether it reads tensors through numel/first); errors name the text."""
    if callable(grid):
        return (), True
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"{where}: grid needs 1 to 3 expressions, got {len(grid)}")
    names: set[str] = set()
    reads_tensors = False
    for text in grid:
        try:
            used, tensors = variables_used(text), args_used(text)
        except ExprError as exc:
            raise ValueError(f"{where}: grid: {exc}") from None
        unknown = sorted((used - set(arg_names) - set(space)) | (tensors - set(arg_names)))
        if unknown:
            raise ValueError(f"{where}: grid expression {text!r} reads {', '.join(map(repr, unknown))}, neither "
                             f"a kernel argument nor a space parameter")
        names |= used
        reads_tensors |= bool(tensors)
    return tuple(sorted(names)), reads_tensors


def check_inputs(spec: KernelSpec, args: Any) -> dict[str, Any]:
    """`inputs()`'s result validated and put in the kernel's parameter order."""
    where = f"kernel {spec.name}: inputs()"
    if not isinstance(args, Mapping):
        raise ValueError(f"{where} must return a dict of kernel arguments, got {type(args).__name__}")
    unknown = [k for k in args if k not in spec.arg_names]
    if unknown:
        raise ValueError(f"{where} returned {', '.join(map(repr, unknown))}, not argument(s) of the kernel")
    config_set = [k for k in args if k in spec.space]
    if config_set:
        raise ValueError(f"{where} returned space parameter(s) {', '.join(map(repr, config_set))}; "
                         f"the config sets them")
    missing = [k for k in spec.required if k not in args and k not in spec.space]
    if missing:
        raise ValueError(f"{where} did not return kernel argument(s) {', '.join(map(repr, missing))}")
    if not isinstance(args[spec.output], torch.Tensor):
        raise ValueError(f"{where}: output {spec.output!r} is not a tensor")
    return {k: args[k] for k in spec.arg_names if k in args}


def check_problem(spec: KernelSpec, problem: Mapping[str, Any]) -> None:
    """A problem dict's values must be plain (int, float, bool, str, torch.dtype): they cross into workers."""
    for name, value in problem.items():
        if not isinstance(value, (*PLAIN, torch.dtype, type(None))):
            raise ValueError(f"kernel {spec.name}: problem value {name}={value!r} must be a plain value "
                             f"(int, float, bool, str, torch.dtype) so it can cross into worker processes")
