"""The one interface every tunable kernel implements, so the engine never names GEMM or MoE.

A tunable is a small picklable object (it crosses into compile and GPU worker processes). Problems are
frozen dataclasses with a `key()` that includes every dtype and shape that changes the answer, and optionally a
`label()`, a short name the progress lines show instead of a long key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from tritune.device import DeviceInfo
from tritune.tuning.space import SearchSpace
from tritune.tuning.types import Config


@runtime_checkable
class Problem(Protocol):
    def key(self) -> str:
        """Stable text naming the problem: kernel, shape, dtypes."""
        ...


@dataclass(frozen=True)
class Tolerance:
    """Correctness gate thresholds: an element mismatches when |out-ref| > atol + rtol*|ref|."""

    atol: float
    rtol: float
    max_mismatch_ratio: float = 0.0  # fraction of mismatching elements allowed
    max_rel_l2: float = 1e-2  # bound on ||out-ref||/||ref|| always enforced


class Tunable(Protocol):
    """What a kernel family provides to the engine."""

    name: str

    def space(self, problem: Any, device: DeviceInfo) -> SearchSpace:
        """The search space for this problem on this device (constraints included)."""
        ...

    def make_inputs(self, problem: Any, device: torch.device, seed: int) -> Any:
        """Seeded random inputs (never zeros), made once per problem."""
        ...

    def reference(self, problem: Any, inputs: Any) -> torch.Tensor:
        """The expected output, computed in fp32 by torch."""
        ...

    def alloc_output(self, problem: Any, inputs: Any) -> torch.Tensor:
        """An output buffer the engine poisons before each checked run."""
        ...

    def launcher(self, problem: Any, inputs: Any, config: Config, out: torch.Tensor) -> Callable[[], None]:
        """Everything per-config prepared (workspaces, grid); the callable only launches into `out`."""
        ...

    def compile(self, problem: Any, config: Config) -> None:
        """Compile without launching (warms Triton's on-disk cache); raises on compile failure."""
        ...

    def flops(self, problem: Any) -> float: ...

    def bytes_moved(self, problem: Any) -> float:
        """Fewest bytes the op must move: each input read once, each output written once."""
        ...

    def tolerance(self, problem: Any) -> Tolerance: ...
