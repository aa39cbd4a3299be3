"""Tune any user Triton kernel with tritune's engine: `tritune.tunable_kernel(...)` wraps a `@triton.jit` function.

The wrapped kernel (`UserKernel`) tunes through `tritune.tuning.tuner.tune` (parallel compile, isolated GPU workers,
the correctness gate, the journal), keeps winners in a JSON store (`tritune.store.user_json`), and at run time
launches with the stored config for the call's key (cached per process) or a default.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import math
import numbers
import pickle
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tritune import knobs
from tritune.expr import ExprError, evaluate
from tritune.store.provenance import running_machine
from tritune.store.user_json import UserEntry, UserKernelStore, UserStoreError, now_iso
from tritune.tuning.device import DeviceInfo, current_device
from tritune.tuning.journal import Journal
from tritune.tuning.space import Constraint, SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.tuner import TuneSettings, journal_key, tune
from tritune.tuning.types import Config, Scalar
from tritune.user_tunable import _PLAIN, UserProblem, UserTunable
from tritune.user_tunable import scalars as _scalars

log = logging.getLogger("tritune")

# Keyword arguments of a Triton launch that are not kernel parameters: allowed in a space without a constexpr.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")



def _is_constexpr(annotation: Any) -> bool:
    """`tl.constexpr` written as the class or as text ("tl.constexpr" under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        return annotation.strip().rsplit(".", 1)[-1] == "constexpr"
    return getattr(annotation, "__name__", None) == "constexpr"


def _kernel_params(kernel: Any) -> list[inspect.Parameter]:
    """The parameters of a `@triton.jit` function (compiled or interpreted), in declaration order."""
    from triton.runtime.jit import KernelInterface

    fn = getattr(kernel, "fn", None)
    if not isinstance(kernel, KernelInterface) or not inspect.isfunction(fn):
        raise TypeError(f"expected a @triton.jit function (not autotuned or wrapped), got {type(kernel).__name__}")
    return list(inspect.signature(fn).parameters.values())


def _plain(name: str, value: Any) -> Scalar:
    """A key value as a plain Python scalar (numpy and torch integers included)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"key argument {name!r} must be an int, float, bool or str, got {type(value).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> "float16" (how tensor dtypes appear in keys)."""
    return str(dtype).removeprefix("torch.")


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """Gate thresholds by output dtype: fp32/fp64 1e-4, 16-bit floats 2e-2, 8-bit floats 0.125, integers exact."""
    if not dtype.is_floating_point:
        return Tolerance(atol=0.0, rtol=0.0)
    if dtype.itemsize >= 4:
        return Tolerance(atol=1e-4, rtol=1e-4)
    if dtype.itemsize == 2:
        return Tolerance(atol=2e-2, rtol=2e-2)
    return Tolerance(atol=0.125, rtol=0.125, max_rel_l2=5e-2)


@dataclass(frozen=True)
class UserTuneResult:
    """One problem of `UserKernel.tune`: the winner (None when every candidate failed) and what it cost."""

    key_text: str
    key: dict[str, Any]
    config: dict[str, Any] | None
    time_us: float  # inf when nothing passed
    reused: bool  # True: taken from the store, nothing measured
    measured: int  # candidates measured in this call (not reused from the journal)
    failed: int  # candidates of this problem that failed (compile error, wrong answer, ...)


class UserKernel:
    """A `@triton.jit` kernel plus what tuning it needs; define it at module level (workers import it by name).

    space: param -> values; params are tl.constexpr parameters or launch options (num_warps, num_stages, num_ctas,
      maxnreg). key: argument names whose values form the key (every tensor argument's dtype is added).
    inputs(problem, device) -> every non-config argument (the caller seeds); reference(args) -> expected output.
    output: the argument the kernel writes. grid: 1-3 `tritune.expr` expressions over int/bool arguments and
      config params, or grid(meta) -> tuple. constraints: rule name -> predicate(meta = scalar args ∪ config).
    tolerance: gate thresholds (default by output dtype). flops / bytes_moved: meta (problem and argument
      scalars) -> float. store: results file (default $TRITUNE_CONFIG_DIR/user_kernels/<name>.json, else
      ./tritune_tuned/<name>.json). name: default the function's name. default: the config for untuned keys
      (default: the first config of the space pruned for the call's arguments).
    """

    def __init__(self, kernel: Any, *, space: Mapping[str, Sequence[Scalar]], key: Sequence[str],
                 inputs: Callable[[dict, torch.device], dict], reference: Callable[[dict], torch.Tensor],
                 output: str, grid: Sequence[str | int] | Callable[[dict], Sequence[int]],
                 constraints: Mapping[str, Callable[[dict], bool]] | None = None, tolerance: Tolerance | None = None,
                 flops: Callable[[dict], float] | None = None, bytes_moved: Callable[[dict], float] | None = None,
                 store: str | Path | None = None, name: str | None = None,
                 default: Mapping[str, Scalar] | None = None) -> None:
        params = _kernel_params(kernel)
        self.kernel = kernel
        self.name = name or kernel.fn.__name__
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(f"kernel name {self.name!r} must be letters, digits, '_', '.' or '-' (it names files)")
        self.arg_names = tuple(p.name for p in params)
        self._required = tuple(p.name for p in params if p.default is inspect.Parameter.empty)
        self.constexpr_names = frozenset(p.name for p in params if _is_constexpr(p.annotation))
        where = f"kernel {self.name}"

        if not space:
            raise ValueError(f"{where}: the search space is empty")
        self.space_params: dict[str, tuple[Scalar, ...]] = {}
        for param, values in space.items():
            values = tuple(values)
            if not values or not all(isinstance(v, _PLAIN) for v in values):
                raise ValueError(f"{where}: space parameter {param!r} needs a non-empty list of scalars, not {values}")
            if param not in LAUNCH_OPTIONS:
                if param not in self.arg_names:
                    raise ValueError(f"{where}: space parameter {param!r} is not a parameter of the kernel "
                                     f"(parameters: {', '.join(self.arg_names)})")
                if param not in self.constexpr_names:
                    raise ValueError(f"{where}: space parameter {param!r} is not a tl.constexpr parameter of the "
                                     f"kernel; annotate it `{param}: tl.constexpr`")
            self.space_params[param] = values
        if output not in self.arg_names or output in self.space_params:
            raise ValueError(f"{where}: output {output!r} is not a (non-config) argument of the kernel")
        self.output = output
        self.key_names = (key,) if isinstance(key, str) else tuple(key)
        for name_ in self.key_names:
            if name_ not in self.arg_names or name_ in self.space_params:
                raise ValueError(f"{where}: key name {name_!r} is not a (non-config) argument of the kernel")
        if isinstance(grid, str):
            grid = (grid,)
        self.grid: tuple[str, ...] | Callable[[dict], Sequence[int]] = grid if callable(grid) else tuple(map(str, grid))
        self._grid_names, self._grid_reads_tensors = self._check_grid(where)
        self.constraints = dict(constraints or {})
        for rule, pred in self.constraints.items():
            if not callable(pred):
                raise TypeError(f"{where}: constraint {rule!r} is not callable")
        self.inputs_fn, self.reference_fn = inputs, reference
        self.tolerance, self.flops_fn, self.bytes_fn = tolerance, flops, bytes_moved
        self.default = None if default is None else Config.from_dict(dict(default))
        if self.default is not None and set(self.default.as_dict()) != set(self.space_params):
            raise ValueError(f"{where}: default config sets {sorted(self.default.as_dict())}, the space has "
                             f"{sorted(self.space_params)}")
        self._store = None if store is None else Path(store)
        self._cache: dict[tuple[str, str], Config] = {}  # (device name, key text) -> config, per process
        self._probes: dict[tuple, dict | None] = {}  # (kind, *problem items) -> arguments on the meta device

    def _check_grid(self, where: str) -> tuple[tuple[str, ...], bool]:
        """(integer names the grid reads, whether it reads tensors through numel/first); errors name the text."""
        if callable(self.grid):
            return (), True
        from tritune.expr import args_used, variables_used

        if not 1 <= len(self.grid) <= 3:
            raise ValueError(f"{where}: grid needs 1 to 3 expressions, got {len(self.grid)}")
        names: set[str] = set()
        reads_tensors = False
        for text in self.grid:
            try:
                used, tensors = variables_used(text), args_used(text)
            except ExprError as exc:
                raise ValueError(f"{where}: grid: {exc}") from None
            unknown = sorted((used - set(self.arg_names) - set(self.space_params)) | (tensors - set(self.arg_names)))
            if unknown:
                raise ValueError(f"{where}: grid expression {text!r} reads {', '.join(map(repr, unknown))}, neither "
                                 f"a kernel argument nor a space parameter")
            names |= used
            reads_tensors |= bool(tensors)
        return tuple(sorted(names)), reads_tensors

    def __repr__(self) -> str:
        return f"UserKernel({self.name!r}, space={self.space_params!r})"

    def __reduce__(self):
        # Pickled by reference: worker processes import the defining module and find the same object there.
        module_name = self.kernel.fn.__module__
        module = sys.modules.get(module_name)
        attr = next((k for k, v in vars(module).items() if v is self), None) if module is not None else None
        if attr is None:
            raise pickle.PicklingError(
                f"user kernel {self.name!r} has no module-level name in {module_name!r}: define the tuned kernel at "
                f"module level so worker processes can import it")
        return (_import_user_kernel, (module_name, attr))

    # ---- store -------------------------------------------------------------------------------------------

    @property
    def store_path(self) -> Path:
        """The results file: as given, else $TRITUNE_CONFIG_DIR/user_kernels/<name>.json, else ./tritune_tuned/."""
        if self._store is not None:
            return self._store
        folder = knobs.config_dir()
        return (folder / "user_kernels" if folder is not None else Path("tritune_tuned")) / f"{self.name}.json"

    @store_path.setter
    def store_path(self, path: str | Path | None) -> None:
        self._store = None if path is None else Path(path)
        self.reload()

    def reload(self) -> None:
        """Forget the configs cached by run(); the next call per key reads the store again."""
        self._cache.clear()

    # ---- space, arguments, keys, grid ---------------------------------------------------------------------

    def search_space(self, problem_args: Mapping[str, Any] | None = None) -> SearchSpace:
        """The space with the constraints over meta = the args' scalars ∪ config (bools stay bools).

        Without args, a constraint reading a problem's name counts as satisfied (it cannot be decided).
        """
        meta = None if problem_args is None else _scalars(problem_args)

        def rule(label: str, pred: Callable[[dict], bool]) -> Constraint:
            def ok(config: Config) -> bool:
                try:
                    return bool(pred({**(meta or {}), **config.as_dict()}))
                except KeyError as exc:
                    if meta is None:
                        return True
                    raise ValueError(f"kernel {self.name}: constraint {label!r} reads {exc}, neither an argument "
                                     f"nor a space parameter") from None
            return Constraint(label, ok)

        return SearchSpace(dict(self.space_params), tuple(rule(k, p) for k, p in self.constraints.items()))

    def configs(self, problem_args: Mapping[str, Any] | None = None) -> list[Config]:
        """The pruned space in SearchSpace.configs order (parameters sorted by name, then values as given)."""
        return self.search_space(problem_args).prune().kept

    def default_config(self, args: Mapping[str, Any] | None = None) -> Config:
        """`default` if given, else the first config of the space pruned for `args` (of the whole space if none)."""
        if self.default is not None:
            return self.default
        kept = self.configs(args)
        return kept[0] if kept else next(self.search_space().configs())

    def _checked(self, args: Any) -> dict[str, Any]:
        """`inputs()`'s result validated and put in the kernel's parameter order."""
        where = f"kernel {self.name}: inputs()"
        if not isinstance(args, Mapping):
            raise ValueError(f"{where} must return a dict of kernel arguments, got {type(args).__name__}")
        unknown = [k for k in args if k not in self.arg_names]
        if unknown:
            raise ValueError(f"{where} returned {', '.join(map(repr, unknown))}, not argument(s) of the kernel")
        config_set = [k for k in args if k in self.space_params]
        if config_set:
            raise ValueError(f"{where} returned space parameter(s) {', '.join(map(repr, config_set))}; "
                             f"the config sets them")
        missing = [k for k in self._required if k not in args and k not in self.space_params]
        if missing:
            raise ValueError(f"{where} did not return kernel argument(s) {', '.join(map(repr, missing))}")
        if not isinstance(args[self.output], torch.Tensor):
            raise ValueError(f"{where}: output {self.output!r} is not a tensor")
        return {k: args[k] for k in self.arg_names if k in args}

    def make_args(self, problem: Mapping[str, Any], device: torch.device | str, seed: int = 0) -> dict[str, Any]:
        """Every non-config kernel argument for `problem`, made by `inputs` after `torch.manual_seed(seed)`."""
        torch.manual_seed(seed)
        return self._checked(self.inputs_fn(dict(problem), torch.device(device)))

    def _meta_args(self, problem: Mapping[str, Any]) -> dict | None:
        """`make_args(problem, "meta")`, or None when inputs() cannot run on the meta device; cached per process."""
        slot = ("meta", *sorted(problem.items()))
        if slot not in self._probes:
            try:
                # Not seeded (only shapes, dtypes and scalars are used): the caller's RNG state is left alone.
                self._probes[slot] = self._checked(self.inputs_fn(dict(problem), torch.device("meta")))
            except Exception:  # cannot run there (or is wrong: _shadow_args's CPU attempt says so)
                self._probes[slot] = None
        return self._probes[slot]

    def _shadow_args(self, problem: Mapping[str, Any]) -> dict:
        """The problem's arguments with every tensor on the meta device (made on the CPU if need be); cached."""
        slot = ("any", *sorted(problem.items()))
        if slot not in self._probes:
            args = self._meta_args(problem) or self._checked(self.inputs_fn(dict(problem), torch.device("cpu")))
            self._probes[slot] = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        return self._probes[slot]

    def key_of(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Key arguments' values (in `key` order), then every tensor argument's dtype name (parameter order)."""
        key: dict[str, Any] = {}
        for name in self.key_names:
            if name not in args:
                raise ValueError(f"kernel {self.name}: key argument {name!r} is missing")
            if isinstance(args[name], torch.Tensor):
                raise ValueError(f"kernel {self.name}: key argument {name!r} is a tensor; key its size arguments")
            key[name] = _plain(name, args[name])
        for name in self.arg_names:
            value = args.get(name)
            if isinstance(value, torch.Tensor):
                key[name] = dtype_name(value.dtype)
        return key

    def key_text(self, args: Mapping[str, Any]) -> str:
        """Canonical text of `key_of(args)`, e.g. "Z=1,H=2,N_CTX=128,CAUSAL=True,Q=float16,Out=float16"."""
        return ",".join(f"{k}={v}" for k, v in self.key_of(args).items())

    def grid_for(self, args: Mapping[str, Any], config: Config | Mapping[str, Scalar]) -> tuple[int, ...]:
        """Launch grid: expressions over int/bool args (bools as 0/1) ∪ config, or grid(meta) when callable."""
        params = config.as_dict() if isinstance(config, Config) else dict(config)
        if callable(self.grid):
            return tuple(int(g) for g in self.grid({**_scalars(args), **params}))
        merged = {**args, **params}
        names = tuple((n, int(merged[n])) for n in self._grid_names if isinstance(merged.get(n), (bool, int)))
        try:
            if not self._grid_reads_tensors:  # the common case, on every launch: cached
                return _grid(self.grid, names)
            return _grid(self.grid, names, args)
        except ExprError as exc:
            raise ValueError(f"kernel {self.name}: grid {self.grid}: {exc}") from None

    def tolerance_for(self, args: Mapping[str, Any]) -> Tolerance:
        """The gate's thresholds: `tolerance` if given, else `default_tolerance` of the output's dtype."""
        return self.tolerance if self.tolerance is not None else default_tolerance(args[self.output].dtype)

    def launch(self, args: Mapping[str, Any], config: Config) -> None:
        """kernel[grid](**args, **config): constexpr parameters and launch options (num_warps, ...) from config."""
        self.kernel[self.grid_for(args, config)](**args, **config.as_dict())

    # ---- run time ------------------------------------------------------------------------------------------

    def best_config(self, args: Mapping[str, Any]) -> Config:
        """The stored config for (the output's device, key), else `default_config(args)`; cached per process."""
        slot = (_device_name(args[self.output]), self.key_text(args))
        config = self._cache.get(slot)
        if config is None:
            config = self._stored(*slot) or self.default_config(args)
            self._cache[slot] = config
        return config

    def _stored(self, device: str, key_text: str) -> Config | None:
        try:
            entry = UserKernelStore(self.store_path, self.name).lookup(device, key_text, machine=running_machine())
        except (UserStoreError, ValueError) as exc:
            warnings.warn(f"{exc}; kernel {self.name} uses its default config", stacklevel=4)
            return None
        if entry is None:
            return None
        if set(entry.config) != set(self.space_params):
            warnings.warn(f"{self.store_path}: the config stored for {key_text} sets {sorted(entry.config)}, the "
                          f"space has {sorted(self.space_params)}; using the default config", stacklevel=4)
            return None
        return Config.from_dict(entry.config)

    def run(self, **args: Any) -> None:
        """Launch with `best_config(args)`; `args` are every non-config kernel argument."""
        self.launch(args, self.best_config(args))

    def __call__(self, **args: Any) -> None:
        self.run(**args)

    # ---- tuning ----------------------------------------------------------------------------------------------

    def problem(self, problem: Mapping[str, Any], run_tag: str = "") -> UserProblem:
        """The engine's problem for one `inputs` problem dict (values: ints, floats, bools, str, torch.dtype)."""
        for name, value in problem.items():
            if not isinstance(value, (*_PLAIN, torch.dtype, type(None))):
                raise ValueError(f"kernel {self.name}: problem value {name}={value!r} must be a plain value "
                                 f"(int, float, bool, str, torch.dtype) so it can cross into worker processes")
        key = self.key_of(self._shadow_args(problem))
        text = ",".join(f"{k}={v}" for k, v in key.items())
        return UserProblem(self.name, tuple(sorted(problem.items())), text, tuple(key.items()), run_tag)

    def tune(self, problems: Sequence[Mapping[str, Any]], *, device: DeviceInfo | None = None,
             settings: TuneSettings | None = None, force: bool = False,
             space: Mapping[str, Sequence[Scalar]] | None = None) -> list[UserTuneResult]:
        """Tune every problem whose key the store lacks for this device (all with `force`), persist the winners.

        One result per problem, in order; problems sharing a key are tuned once. `space` replaces parameter lists
        for this run (names must exist). Default settings: the engine's, journal `<store dir>/<name>.journal.sqlite`.
        `force` measures again, ignoring the store and the journal's earlier measurements.
        """
        pickle.dumps(self)  # fails here, clearly, when worker processes could not import the kernel
        device = device or current_device()
        store_path = self.store_path
        settings = settings or TuneSettings(journal_path=store_path.parent / f"{self.name}.journal.sqlite")
        store = UserKernelStore(store_path, self.name)
        tunable = UserTunable(self, tuple((k, tuple(v)) for k, v in sorted((space or {}).items())))
        if space:
            self.search_space().with_params(space)  # unknown names fail before anything runs
        tag = f"force@{time.time_ns()}" if force else ""
        todo = [self.problem(p, tag) for p in problems]
        results: dict[str, UserTuneResult] = {}
        unique: dict[str, UserProblem] = {}
        for p in todo:
            entry = None if force or p.key_text in unique else store.lookup(device.name, p.key_text)
            if entry is not None:
                results[p.key_text] = UserTuneResult(p.key_text, dict(entry.key), dict(entry.config), entry.time_us,
                                                     True, 0, 0)
            elif p.key_text not in results:
                unique.setdefault(p.key_text, p)
        if unique:
            earlier = _journaled(settings.journal_path, device, tunable, list(unique.values()))
            ran, summary = tune(tunable, list(unique.values()), device, settings)
            for line in summary.lines():
                log.info("%s: %s", self.name, line)
            entries = []
            for r in ran:
                p: UserProblem = r.problem
                measured = sum(m.config not in earlier[p.key()] for m in r.measurements)
                failed = sum(not m.ok for m in r.measurements)
                if r.best is None:
                    results[p.key_text] = UserTuneResult(p.key_text, dict(p.key_items), None, math.inf, False,
                                                         measured, failed)
                    continue
                config = r.best.config.as_dict()
                results[p.key_text] = UserTuneResult(p.key_text, dict(p.key_items), config, r.best.time_us, False,
                                                     measured, failed)
                provenance = {**device.provenance(), "candidates": len(r.measurements), "failed": failed,
                              "space_size": r.space_size, "kernel_source_sha256": self.source_hash(),
                              "timing": r.best.extra.get("method", "")}
                entries.append(UserEntry(device.name, device.triton_version, dict(p.key_items), p.key_text, config,
                                         r.best.time_us, now_iso(), "jit", provenance))
            if entries:
                store.put(entries)
                self.reload()
        return [results[p.key_text] for p in todo]

    def source_hash(self) -> str:
        """SHA-256 of the kernel's source text (recorded with each tuned entry)."""
        return hashlib.sha256(inspect.getsource(self.kernel.fn).encode()).hexdigest()


@functools.lru_cache(maxsize=4096)
def _cached_grid(exprs: tuple[str, ...], names: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    return tuple(int(evaluate(text, dict(names))) for text in exprs)


def _grid(exprs: tuple[str, ...], names: tuple[tuple[str, int], ...], tensors: Mapping | None = None
          ) -> tuple[int, ...]:
    """Evaluate grid expressions; with `tensors`, numel(ARG) and first(ARG) read them (not cached)."""
    if tensors is None:
        return _cached_grid(exprs, names)

    def tensor(name: str) -> torch.Tensor:
        if not isinstance(tensors[name], torch.Tensor):
            raise ValueError(f"{name!r} is not a tensor argument")
        return tensors[name]

    def first(name: str) -> int:
        return int(tensor(name).reshape(-1)[0].item())  # reads the device: a sync on a GPU

    return tuple(int(evaluate(t, dict(names), numel=lambda n: tensor(n).numel(), first=first)) for t in exprs)


def _journaled(path: Path, device: DeviceInfo, tunable: UserTunable, problems: list[UserProblem]) -> dict[str, set]:
    """problem key -> configs the journal holds before this run (to count what the run measures itself)."""
    if not Path(path).exists():
        return {p.key(): set() for p in problems}
    with Journal(path) as journal:
        return {p.key(): set(journal.measurements(journal_key(device, p, tunable))) for p in problems}


def _device_name(t: Any) -> str:
    if isinstance(t, torch.Tensor) and t.device.type == "cuda":
        return torch.cuda.get_device_name(t.device)
    return current_device().name


def tunable_kernel(**options: Any) -> Callable[[Any], UserKernel]:
    """Decorator: `tunable_kernel(space=..., key=..., ...)(jit_fn)` is `UserKernel(jit_fn, space=..., ...)`."""
    return lambda kernel: UserKernel(kernel, **options)


def _import_user_kernel(module_name: str, attribute: str) -> UserKernel:
    """Unpickling: the UserKernel named `attribute` in `module_name` (imported if needed)."""
    obj = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(obj, UserKernel):
        raise pickle.UnpicklingError(f"{module_name}.{attribute} is a {type(obj).__name__}, not a tritune UserKernel")
    return obj
