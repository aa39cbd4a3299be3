"""The engine's view of a `UserKernel`: `UserProblem` (a problem dict with its key, made in the parent) and
`UserTunable` (the Tunable protocol), plus the gate's default thresholds and what a journal already holds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tritune.device import DeviceInfo
from tritune.knobs import interpreting
from tritune.tuning.journal import Journal
from tritune.tuning.space import SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.tuner import journal_key
from tritune.tuning.types import Config
from tritune.user.keys import scalars

if TYPE_CHECKING:
    from tritune.user.api import UserKernel


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
class UserProblem:
    """One problem: the `inputs` problem dict as sorted items, plus its key text (made once, in the parent)."""

    kernel: str
    items: tuple[tuple[str, Any], ...]
    key_text: str
    key_items: tuple[tuple[str, Any], ...] = ()
    run_tag: str = ""  # set by tune(force=True): a fresh journal key, so nothing earlier is reused

    def key(self) -> str:
        return f"{self.kernel}:{self.key_text}" + (f"|{self.run_tag}" if self.run_tag else "")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)


@dataclass(frozen=True)
class UserTunable:
    """The engine's view of a UserKernel (the Tunable protocol); pickles the kernel by reference."""

    kernel: UserKernel
    space_overrides: tuple[tuple[str, tuple], ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.name

    def _meta(self, problem: UserProblem) -> dict[str, Any]:
        return {**scalars(problem.as_dict()), **scalars(self.kernel._shadow_args(problem.as_dict()))}

    def space(self, problem: UserProblem, device: DeviceInfo) -> SearchSpace:
        space = self.kernel.search_space(self._meta(problem))
        return space.with_params(dict(self.space_overrides)) if self.space_overrides else space

    def make_inputs(self, problem: UserProblem, device: torch.device, seed: int) -> dict[str, Any]:
        return self.kernel.make_args(problem.as_dict(), device, seed)

    def reference(self, problem: UserProblem, inputs: dict[str, Any]) -> torch.Tensor:
        return self.kernel.reference_fn(dict(inputs)).float()

    def alloc_output(self, problem: UserProblem, inputs: dict[str, Any]) -> torch.Tensor:
        return torch.empty_like(inputs[self.kernel.output])

    def launcher(self, problem: UserProblem, inputs: dict[str, Any], config: Config,
                 out: torch.Tensor) -> Callable[[], None]:
        args = {**inputs, self.kernel.output: out}
        launch = self.kernel.kernel[self.kernel.grid_for(args, config)]
        kwargs = {**args, **config.as_dict()}
        return lambda: launch(**kwargs)

    def compile(self, problem: UserProblem, config: Config) -> None:
        """Build the binary from dtypes alone (mock tensors); nothing under the interpreter or without meta inputs."""
        if interpreting():
            return
        args = self.kernel._meta_args(problem.as_dict())
        if args is None:
            return  # inputs() cannot run on the meta device: the first launch compiles
        from triton.runtime.jit import MockTensor

        mock = {k: MockTensor(v.dtype, list(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        self.kernel.kernel.warmup(**mock, **config.as_dict(), grid=self.kernel.grid_for(args, config))

    def flops(self, problem: UserProblem) -> float:
        return float(self.kernel.flops_fn(self._meta(problem))) if self.kernel.flops_fn else math.nan

    def bytes_moved(self, problem: UserProblem) -> float:
        """`bytes_moved(meta)` if given, else every tensor argument's bytes, each tensor once."""
        if self.kernel.bytes_fn:
            return float(self.kernel.bytes_fn(self._meta(problem)))
        args = self.kernel._shadow_args(problem.as_dict())
        tensors = {id(v): v for v in args.values() if isinstance(v, torch.Tensor)}
        return float(sum(t.numel() * t.element_size() for t in tensors.values()))

    def tolerance(self, problem: UserProblem) -> Tolerance:
        return self.kernel.tolerance_for(self.kernel._shadow_args(problem.as_dict()))


def journaled(path: Path, device: DeviceInfo, tunable: UserTunable, problems: list[UserProblem]) -> dict[str, set]:
    """problem key -> configs the journal holds before this run (to count what the run measures itself)."""
    if not Path(path).exists():
        return {p.key(): set() for p in problems}
    with Journal(path) as journal:
        return {p.key(): set(journal.measurements(journal_key(device, p, tunable))) for p in problems}
