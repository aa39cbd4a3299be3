"""Tune any user Triton kernel with tritune's engine: `tunable_kernel(...)` wraps a `@triton.jit` function.

The wrapped kernel (`UserKernel`) tunes through `tritune.tuning.tuner.tune` (parallel compile, isolated GPU workers,
the correctness gate, the journal), keeps winners in a JSON store (`tritune.store.user_json`), and at run time
launches with the stored config for the call's key (cached per process) or a default. Its parts: the checked
declaration (`validation`), keys and grids (`keys`), the results file (`store`) and the engine's view (`tunable`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import math
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tritune.device import DeviceInfo, current_device
from tritune.store.user_json import UserKernelStore
from tritune.tuning.space import Constraint, SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.tuner import TuneSettings, tune
from tritune.tuning.types import Config, Scalar
from tritune.user import keys
from tritune.user.keys import GridFn, scalars
from tritune.user.store import StoredConfigs, tuned_entry
from tritune.user.tunable import UserProblem, UserTunable, default_tolerance, journaled
from tritune.user.validation import KernelSpec, check_inputs, check_problem, declare

log = logging.getLogger("tritune")

Space = Mapping[str, Sequence[Scalar]]  # config parameter -> values (tl.constexpr parameters, launch options)
InputsFn = Callable[[dict[str, Any], torch.device], dict[str, Any]]  # (problem, device) -> non-config arguments
ReferenceFn = Callable[[dict[str, Any]], torch.Tensor]  # arguments -> expected output
MetaFn = Callable[[dict[str, Any]], float]  # meta (scalar arguments ∪ problem) -> FLOPs or bytes
Grid = str | Sequence[str | int] | GridFn


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

    Declared through `tunable_kernel` (its docstring says what each argument means); the declaration is checked
    against the kernel's signature here, once (`validation.declare`).
    """

    def __init__(self, kernel: Any, *, space: Space, key: str | Sequence[str], inputs: InputsFn,
                 reference: ReferenceFn, output: str, grid: Grid,
                 constraints: Mapping[str, Callable[[dict], bool]] | None = None, tolerance: Tolerance | None = None,
                 flops: MetaFn | None = None, bytes_moved: MetaFn | None = None, store: str | Path | None = None,
                 name: str | None = None, default: Mapping[str, Scalar] | None = None) -> None:
        self.spec: KernelSpec = declare(kernel, space=space, key=key, output=output, grid=grid,
                                        constraints=constraints, name=name, default=default)
        self.kernel = kernel
        self.inputs_fn, self.reference_fn = inputs, reference
        self.tolerance, self.flops_fn, self.bytes_fn = tolerance, flops, bytes_moved
        self.stored = StoredConfigs(self.spec.name, frozenset(self.spec.space), store)
        self._probes: dict[tuple, dict | None] = {}  # (kind, *problem items) -> arguments on the meta device

    # ---- the declaration (read-only views of `spec`) ----------------------------------------------------------

    name = property(lambda self: self.spec.name)
    arg_names = property(lambda self: self.spec.arg_names)
    constexpr_names = property(lambda self: self.spec.constexpr_names)
    space_params = property(lambda self: self.spec.space)
    output = property(lambda self: self.spec.output)
    key_names = property(lambda self: self.spec.key_names)
    grid = property(lambda self: self.spec.grid)
    constraints = property(lambda self: self.spec.constraints)
    default = property(lambda self: self.spec.default)

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
        return self.stored.path

    @store_path.setter
    def store_path(self, path: str | Path | None) -> None:
        self.stored.path = path

    def reload(self) -> None:
        """Forget the configs cached by run(); the next call per key reads the store again."""
        self.stored.reload()

    # ---- space, arguments, keys, grid ---------------------------------------------------------------------

    def search_space(self, problem_args: Mapping[str, Any] | None = None) -> SearchSpace:
        """The space with the constraints over meta = the args' scalars ∪ config (bools stay bools).

        Without args, a constraint reading a problem's name counts as satisfied (it cannot be decided).
        """
        meta = None if problem_args is None else scalars(problem_args)

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

    def make_args(self, problem: Mapping[str, Any], device: torch.device | str, seed: int = 0) -> dict[str, Any]:
        """Every non-config kernel argument for `problem`, made by `inputs` after `torch.manual_seed(seed)`."""
        torch.manual_seed(seed)
        return check_inputs(self.spec, self.inputs_fn(dict(problem), torch.device(device)))

    def _meta_args(self, problem: Mapping[str, Any]) -> dict | None:
        """`make_args(problem, "meta")`, or None when inputs() cannot run on the meta device; cached per process."""
        slot = ("meta", *sorted(problem.items()))
        if slot not in self._probes:
            try:
                # Not seeded (only shapes, dtypes and scalars are used): the caller's RNG state is left alone.
                self._probes[slot] = check_inputs(self.spec, self.inputs_fn(dict(problem), torch.device("meta")))
            except Exception:  # cannot run there (or is wrong: _shadow_args's CPU attempt says so)
                self._probes[slot] = None
        return self._probes[slot]

    def _shadow_args(self, problem: Mapping[str, Any]) -> dict:
        """The problem's arguments with every tensor on the meta device (made on the CPU if need be); cached."""
        slot = ("any", *sorted(problem.items()))
        if slot not in self._probes:
            args = self._meta_args(problem) or check_inputs(self.spec,
                                                            self.inputs_fn(dict(problem), torch.device("cpu")))
            self._probes[slot] = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        return self._probes[slot]

    def key_of(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Key arguments' values (in `key` order), then every tensor argument's dtype name (parameter order)."""
        return keys.key_of(self.spec, args)

    def key_text(self, args: Mapping[str, Any]) -> str:
        """Canonical text of `key_of(args)`, e.g. "Z=1,H=2,N_CTX=128,CAUSAL=True,Q=float16,Out=float16"."""
        return keys.key_text(self.key_of(args))

    def grid_for(self, args: Mapping[str, Any], config: Config | Mapping[str, Scalar]) -> tuple[int, ...]:
        """Launch grid: expressions over int/bool args (bools as 0/1) ∪ config, or grid(meta) when callable."""
        return keys.grid_for(self.spec, args, config)

    def tolerance_for(self, args: Mapping[str, Any]) -> Tolerance:
        """The gate's thresholds: `tolerance` if given, else `default_tolerance` of the output's dtype."""
        return self.tolerance if self.tolerance is not None else default_tolerance(args[self.output].dtype)

    def launch(self, args: Mapping[str, Any], config: Config) -> None:
        """kernel[grid](**args, **config): constexpr parameters and launch options (num_warps, ...) from config."""
        self.kernel[self.grid_for(args, config)](**args, **config.as_dict())

    # ---- run time ------------------------------------------------------------------------------------------

    def best_config(self, args: Mapping[str, Any]) -> Config:
        """The stored config for (the output's device, key), else `default_config(args)`; cached per process."""
        return self.stored.config_for(_device_name(args[self.output]), self.key_text(args),
                                      lambda: self.default_config(args))

    def run(self, **args: Any) -> None:
        """Launch with `best_config(args)`; `args` are every non-config kernel argument."""
        self.launch(args, self.best_config(args))

    def __call__(self, **args: Any) -> None:
        self.run(**args)

    # ---- tuning ----------------------------------------------------------------------------------------------

    def problem(self, problem: Mapping[str, Any], run_tag: str = "") -> UserProblem:
        """The engine's problem for one `inputs` problem dict (values: ints, floats, bools, str, torch.dtype)."""
        check_problem(self.spec, problem)
        key = self.key_of(self._shadow_args(problem))
        return UserProblem(self.name, tuple(sorted(problem.items())), keys.key_text(key), tuple(key.items()), run_tag)

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
            earlier = journaled(settings.journal_path, device, tunable, list(unique.values()))
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
                results[p.key_text] = UserTuneResult(p.key_text, dict(p.key_items), r.best.config.as_dict(),
                                                     r.best.time_us, False, measured, failed)
                entries.append(tuned_entry(device, dict(p.key_items), p.key_text, r.best,
                                           candidates=len(r.measurements), failed=failed, space_size=r.space_size,
                                           source_hash=self.source_hash()))
            if entries:
                store.put(entries)
                self.reload()
        return [results[p.key_text] for p in todo]

    def source_hash(self) -> str:
        """SHA-256 of the kernel's source text (recorded with each tuned entry)."""
        return hashlib.sha256(inspect.getsource(self.kernel.fn).encode()).hexdigest()


def _device_name(t: Any) -> str:
    if isinstance(t, torch.Tensor) and t.device.type == "cuda":
        return torch.cuda.get_device_name(t.device)
    return current_device().name


def tunable_kernel(*, space: Space, key: str | Sequence[str], inputs: InputsFn, reference: ReferenceFn, output: str,
                   grid: Grid, constraints: Mapping[str, Callable[[dict], bool]] | None = None,
                   tolerance: Tolerance | None = None, flops: MetaFn | None = None, bytes_moved: MetaFn | None = None,
                   store: str | Path | None = None, name: str | None = None,
                   default: Mapping[str, Scalar] | None = None) -> Callable[[Any], UserKernel]:
    """Decorator: `tunable_kernel(space=..., key=..., ...)(jit_fn)` is a `UserKernel` over the `@triton.jit` jit_fn.

    space: param -> values; params are tl.constexpr parameters or launch options (num_warps, num_stages, num_ctas,
      maxnreg). key: argument name(s) whose values form the key (every tensor argument's dtype is added).
    inputs(problem, device) -> every non-config argument (the caller seeds); reference(args) -> expected output.
    output: the argument the kernel writes. grid: 1-3 `tritune.expr` expressions over int/bool arguments and
      config params, or grid(meta) -> tuple. constraints: rule name -> predicate(meta = scalar args ∪ config).
    tolerance: gate thresholds (default by output dtype). flops / bytes_moved: meta (problem and argument
      scalars) -> float. store: results file (default $TRITUNE_CONFIG_DIR/user_kernels/<name>.json, else
      ./tritune_tuned/<name>.json). name: default the function's name. default: the config for untuned keys
      (default: the first config of the space pruned for the call's arguments).
    """
    def wrap(kernel: Any) -> UserKernel:
        return UserKernel(kernel, space=space, key=key, inputs=inputs, reference=reference, output=output, grid=grid,
                          constraints=constraints, tolerance=tolerance, flops=flops, bytes_moved=bytes_moved,
                          store=store, name=name, default=default)
    return wrap


def _import_user_kernel(module_name: str, attribute: str) -> UserKernel:
    """Unpickling: the UserKernel named `attribute` in `module_name` (imported if needed)."""
    obj = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(obj, UserKernel):
        raise pickle.UnpicklingError(f"{module_name}.{attribute} is a {type(obj).__name__}, not a tritune UserKernel")
    return obj
