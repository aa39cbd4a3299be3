"""Manual tuning helpers for the grouped-GEMM kernels (forward, dX, dW), under the names users know from Unsloth:
the config search space and its pruning rules, device limits, result tables, and a context that lets a tuning
loop survive a config that fails to compile or launch."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import product
from pathlib import Path

import pandas as pd
from triton.runtime.errors import OutOfResources

from tritune.device import DeviceInfo, current_device
from tritune.kernels.grouped_gemm_config import (
    KernelConfig,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    smem_bytes,
)
from tritune.store.atomic import atomic_write_text

__all__ = [
    "BACKWARD_DW_RULES", "BACKWARD_DX_RULES", "DeviceProperties", "FORWARD_RULES", "KernelConfig",
    "KernelConfigBackward_dW", "KernelConfigBackward_dX", "KernelConfigForward", "KernelResult",
    "TritonTuningContext", "check_resources", "exceeds_smem", "get_device_properties", "get_kernel_configs",
    "permute_x_with_permute_y", "prune_kernel_configs_backward_dW", "prune_kernel_configs_backward_dX",
    "prune_kernel_configs_fwd", "scheduled_with_fused_permute_or_flatten", "scheduled_without_tma",
    "tma_load_dy_with_permute_y", "tma_load_x_with_permute_x", "tma_store_with_permute_x", "tma_store_with_permute_y",
    "uses_tma",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceProperties:
    """Unsloth's name for a device's limits: a view of the engine's `DeviceInfo` (`of`), never read separately."""

    NUM_SM: int
    NUM_REGS: int
    SIZE_SMEM: int  # bytes of shared memory one block may use
    WARP_SIZE: int

    @classmethod
    def of(cls, device: DeviceInfo) -> DeviceProperties:
        return cls(NUM_SM=device.sm_count, NUM_REGS=device.regs_per_block, SIZE_SMEM=device.max_shared_mem,
                   WARP_SIZE=device.warp_size)


@functools.cache
def get_device_properties() -> DeviceProperties:
    """Limits of the current device (an H100 stand-in when there is no GPU), read once per process."""
    return DeviceProperties.of(current_device())


def _supports_tma(supports_tma: bool | None) -> bool:
    return current_device().supports_tma if supports_tma is None else bool(supports_tma)


# --- Pruning: each predicate returns True when the config must be DROPPED. -----------------------------------


def tma_load_x_with_permute_x(config: KernelConfig) -> bool:
    """A TMA load of X reads a contiguous block; a fused permute_x gathers scattered rows (forward, dW)."""
    return bool(getattr(config, "use_tma_load_x", False) and config.permute_x)


def tma_load_dy_with_permute_y(config: KernelConfig) -> bool:
    """A TMA load of dY reads a contiguous block; a fused permute_y gathers scattered rows (dX, dW)."""
    return bool(getattr(config, "use_tma_load_dy", False) and config.permute_y)


def permute_x_with_permute_y(config: KernelConfig) -> bool:
    """The kernels fuse at most one of the two permutes (all three kernels)."""
    return config.permute_x and config.permute_y


def tma_store_with_permute_y(config: KernelConfig) -> bool:
    """A TMA store writes a contiguous block; the forward's permute_y scatters output rows."""
    return config.use_tma_store and config.permute_y


def tma_store_with_permute_x(config: KernelConfig) -> bool:
    """A TMA store writes a contiguous block; dX's permute_x scatters output rows."""
    return config.use_tma_store and config.permute_x


def scheduled_without_tma(config: KernelConfig) -> bool:
    """dW's scheduled loop reads both operands and stores through TMA descriptors (grouped_dw_scheduled)."""
    return bool(getattr(config, "scheduled", False)) and not (
        config.use_tma_load_dy and config.use_tma_load_x and config.use_tma_store)


def scheduled_with_fused_permute_or_flatten(config: KernelConfig) -> bool:
    """dW's scheduled loop gets its rows from its own padding copy, which does the permutes, and has no tile loop to
    flatten: the fused-permute and flatten flags would only repeat a candidate."""
    return bool(getattr(config, "scheduled", False)) and (config.permute_x or config.permute_y or config.flatten)


def uses_tma(config: KernelConfig) -> bool:
    """Any TMA flag is on (dropped on devices below capability 9.0)."""
    return any(getattr(config, f.name) for f in fields(config) if f.name.startswith("use_tma_"))


def exceeds_smem(config: KernelConfig, device_properties: DeviceProperties | None = None,
                 element_size: int = 2) -> bool:
    """The config needs more shared memory than one block may use."""
    props = device_properties or get_device_properties()
    return smem_bytes(config, element_size) > props.SIZE_SMEM


Rule = Callable[[KernelConfig], bool]
FORWARD_RULES: tuple[Rule, ...] = (tma_load_x_with_permute_x, permute_x_with_permute_y, tma_store_with_permute_y)
BACKWARD_DX_RULES: tuple[Rule, ...] = (tma_load_dy_with_permute_y, permute_x_with_permute_y, tma_store_with_permute_x)
BACKWARD_DW_RULES: tuple[Rule, ...] = (tma_load_dy_with_permute_y, tma_load_x_with_permute_x, permute_x_with_permute_y,
                                       scheduled_without_tma, scheduled_with_fused_permute_or_flatten)


def _prune(configs: Iterable[KernelConfig], cls: type[KernelConfig], rules: tuple[Rule, ...],
           device_properties: DeviceProperties | None, supports_tma: bool | None, element_size: int) -> list:
    props = device_properties or get_device_properties()
    tma_ok = _supports_tma(supports_tma)
    kept = []
    for config in configs:
        if not isinstance(config, cls):
            raise TypeError(f"expected {cls.__name__}, got {type(config).__name__}")
        if any(rule(config) for rule in rules) or exceeds_smem(config, props, element_size):
            continue
        if not tma_ok and uses_tma(config):
            continue
        kept.append(config)
    return kept


def prune_kernel_configs_fwd(configs: Iterable[KernelConfigForward], device_properties: DeviceProperties | None = None,
                             *, supports_tma: bool | None = None, element_size: int = 2) -> list[KernelConfigForward]:
    """The forward configs no rule of FORWARD_RULES, shared memory or TMA support drops, in input order."""
    return _prune(configs, KernelConfigForward, FORWARD_RULES, device_properties, supports_tma, element_size)


def prune_kernel_configs_backward_dX(  # noqa: N802 (the name users know)
        configs: Iterable[KernelConfigBackward_dX], device_properties: DeviceProperties | None = None,
        *, supports_tma: bool | None = None, element_size: int = 2) -> list[KernelConfigBackward_dX]:
    """The dX configs no rule of BACKWARD_DX_RULES, shared memory or TMA support drops, in input order."""
    return _prune(configs, KernelConfigBackward_dX, BACKWARD_DX_RULES, device_properties, supports_tma, element_size)


def prune_kernel_configs_backward_dW(  # noqa: N802 (the name users know)
        configs: Iterable[KernelConfigBackward_dW], device_properties: DeviceProperties | None = None,
        *, supports_tma: bool | None = None, element_size: int = 2) -> list[KernelConfigBackward_dW]:
    """The dW configs no rule of BACKWARD_DW_RULES, shared memory or TMA support drops, in input order."""
    return _prune(configs, KernelConfigBackward_dW, BACKWARD_DW_RULES, device_properties, supports_tma, element_size)


# --- Search space. -------------------------------------------------------------------------------------------

_TMA_LOAD_FIELDS: dict[type[KernelConfig], tuple[str, str]] = {
    KernelConfigForward: ("use_tma_load_x", "use_tma_load_w"),
    KernelConfigBackward_dW: ("use_tma_load_dy", "use_tma_load_x"),
    KernelConfigBackward_dX: ("use_tma_load_dy", "use_tma_load_w"),
}


def _expand(cls: type[KernelConfig], tiles: list[tuple], tma_values: tuple[bool, ...],
            permute_values: tuple[bool, ...]) -> list:
    names = (*_TMA_LOAD_FIELDS[cls], "use_tma_store")
    configs: dict[KernelConfig, None] = {}  # an ordered set: dedupes, keeps first-seen order
    for (m, n, k, warps, stages), tma, (px, py) in product(tiles, product(tma_values, repeat=3),
                                                            product(permute_values, repeat=2)):
        flags = dict(zip(names, tma, strict=True))
        configs[cls(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, num_warps=warps, num_stages=stages,
                    flatten=True, permute_x=px, permute_y=py, fuse_mul_post=False, **flags)] = None
    return list(configs)


def get_kernel_configs(
    BLOCK_M: Sequence[int] = (64, 128),  # noqa: N803 (the names users know)
    BLOCK_N: Sequence[int] = (64, 128, 256),  # noqa: N803
    BLOCK_K: Sequence[int] = (64, 128, 256),  # noqa: N803
    num_warps: Sequence[int] = (4, 8),
    num_stages: Sequence[int] = (3, 4, 5),
    use_tma_loads: Sequence[bool] = (True, False),
    fuse_permute: Sequence[bool] = (True, False),
    *,
    device_properties: DeviceProperties | None = None,
    supports_tma: bool | None = None,
    element_size: int = 2,
) -> tuple[list[KernelConfigForward], list[KernelConfigBackward_dW], list[KernelConfigBackward_dX]]:
    """Every combination of the given values, pruned, as (forward, dW, dX) lists.

    Each TMA flag (both loads and use_tma_store) takes every value of `use_tma_loads`; permute_x and permute_y
    each take False and every value of `fuse_permute`. supports_tma=None reads the current device
    (capability >= 9.0); False drops every config with a TMA flag on.
    """
    named = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages,
                 use_tma_loads=use_tma_loads)
    empty = [name for name, values in named.items() if len(values) == 0]
    if empty:
        raise ValueError(f"empty value list(s) for {empty}")
    tiles = list(product(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages))
    tma_values = tuple(dict.fromkeys(bool(v) for v in use_tma_loads))
    permute_values = tuple(dict.fromkeys([False, *(bool(v) for v in fuse_permute)]))
    kwargs = dict(device_properties=device_properties or get_device_properties(),
                  supports_tma=_supports_tma(supports_tma), element_size=element_size)
    forward = prune_kernel_configs_fwd(_expand(KernelConfigForward, tiles, tma_values, permute_values), **kwargs)
    dW = prune_kernel_configs_backward_dW(_expand(KernelConfigBackward_dW, tiles, tma_values, permute_values),
                                          **kwargs)
    dX = prune_kernel_configs_backward_dX(_expand(KernelConfigBackward_dX, tiles, tma_values, permute_values),
                                          **kwargs)
    return forward, dW, dX


# --- Results. ------------------------------------------------------------------------------------------------

_RESULT_COLUMNS = ("torch_time", "triton_time", "speedup")


@dataclass
class KernelResult:
    torch_time: float
    triton_time: float
    kernel_config: KernelConfig
    speedup: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.triton_time > 0:  # also catches nan
            raise ValueError(f"triton_time must be > 0, got {self.triton_time!r}")
        self.speedup = self.torch_time / self.triton_time

    def to_dict(self) -> dict:
        """Flat row: `kernel` (the config class name), every config field, then the times and the speedup."""
        return {"kernel": type(self.kernel_config).__name__, **asdict(self.kernel_config),
                "torch_time": self.torch_time, "triton_time": self.triton_time, "speedup": self.speedup}

    @staticmethod
    def _sorted_frame(results: Sequence[KernelResult], sort_by: str, ascending: bool) -> pd.DataFrame:
        # Index = position in `results`, so print_table can find each row's config.
        rows = [result.to_dict() for result in results]
        columns = None if rows else ["kernel", *(f.name for f in fields(KernelConfig)), *_RESULT_COLUMNS]
        frame = pd.DataFrame(rows, columns=columns)
        if sort_by not in frame.columns:
            raise ValueError(f"sort_by={sort_by!r} is not a column; columns are {list(frame.columns)}")
        return frame.sort_values(sort_by, ascending=ascending, kind="stable")

    @staticmethod
    def to_dataframe(results: Iterable[KernelResult], sort_by: str = "speedup",
                     ascending: bool = False) -> pd.DataFrame:
        return KernelResult._sorted_frame(list(results), sort_by, ascending).reset_index(drop=True)

    @staticmethod
    def to_csv(results: Iterable[KernelResult], sort_by: str = "speedup", ascending: bool = False,
               filename: str | Path = "results.csv") -> Path:
        """Write the sorted table as CSV (atomically) and return its path."""
        path = Path(filename)
        atomic_write_text(path, KernelResult.to_dataframe(results, sort_by, ascending).to_csv(index=False))
        return path

    @staticmethod
    def print_table(results: Iterable[KernelResult], sort_by: str = "speedup", ascending: bool = False,
                    num_results: int = 10) -> str:
        """Print and return the top `num_results` rows: config label, both times and the speedup."""
        if num_results < 0:
            raise ValueError(f"num_results must be >= 0, got {num_results}")
        results = list(results)
        frame = KernelResult._sorted_frame(results, sort_by, ascending).head(num_results)
        rows = [("kernel_config", *_RESULT_COLUMNS)]
        for index in frame.index:
            result = results[index]
            rows.append((result.kernel_config.to_string(include_tuning_params=True, include_tma=True),
                         f"{result.torch_time:.4f}", f"{result.triton_time:.4f}", f"{result.speedup:.3f}"))
        widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
        text = "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                          for row in rows)
        print(text)
        return text


# --- Failures during a manual tuning loop. -------------------------------------------------------------------


def _label(config: KernelConfig) -> str:
    return f"{type(config).__name__}({config.to_string(include_tuning_params=True, include_tma=True)})"


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_resources(config: KernelConfig, device_properties: DeviceProperties | None = None,
                    element_size: int = 2) -> None:
    """Raise OutOfResources(required, limit, "shared memory") when the config cannot fit; call it before a launch
    (Triton's interpreter never runs out of resources by itself)."""
    props = device_properties or get_device_properties()
    if exceeds_smem(config, props, element_size):
        raise OutOfResources(smem_bytes(config, element_size), props.SIZE_SMEM, "shared memory")


class TritonTuningContext:
    """`with TritonTuningContext(config) as ctx:` runs one trial; an Exception inside is logged as a one-line
    warning, stored in `ctx.error`, and suppressed (`ctx.success` becomes False). KeyboardInterrupt and
    SystemExit propagate."""

    def __init__(self, kernel_config: KernelConfig):
        self.kernel_config = kernel_config
        self.success = True
        self.error: str | None = None

    def __enter__(self) -> TritonTuningContext:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        label = _label(self.kernel_config)
        if isinstance(exc, OutOfResources):
            message = f"{label}: out of resources: {exc.name} required {exc.required}, limit {exc.limit}"
        else:
            message = f"{label}: {exc_type.__name__}: {_one_line(str(exc))}"
        self.success = False
        self.error = message
        logger.warning("%s", message)
        return True
