"""Launch configs of the grouped-GEMM kernels (forward, dX, dW), with the field names and defaults users know from
Unsloth's manual tuning module, plus the shared-memory estimate the pruning rules use.

A config is a frozen, hashable value: `dataclasses.asdict` is its JSON form and `from_dict` rebuilds it, checking
every field; `launch_config(kernel, params)` is the one place a stored or searched config becomes a kernel's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from tritune.kernels.triton_release import triton_release

TUNING_FIELDS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages", "flatten")

C = TypeVar("C", bound="KernelConfig")


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and fusion flags shared by the three kernels.

    permute_x: the kernel gathers its X (forward, dW) or scatters its dX (dX) through `gather_indices`, so the
      token-order tensor is never copied into expert order. permute_y: the forward scatters Y rows back to
      token order; dX and dW gather dY from token order. fuse_mul_post: the forward multiplies each row by its
      routing weight (inference only: no gradient flows to the weights through it).
    """

    BLOCK_SIZE_M: int = 32
    BLOCK_SIZE_N: int = 32
    BLOCK_SIZE_K: int = 32
    num_warps: int = 4
    num_stages: int = 2
    flatten: bool = True
    permute_x: bool = False
    permute_y: bool = False
    fuse_mul_post: bool = False
    use_tma_store: bool = False

    def to_string(self, include_tuning_params: bool = False, include_tma: bool = False) -> str:
        """A short label: the fusion flags that are on, then (optionally) tile params and the TMA flags that are on,
        e.g. `permute_x,BLOCK_SIZE_M=64,...,flatten=True,use_tma_load_w`."""
        parts = [name for name in ("permute_x", "permute_y", "fuse_mul_post") if getattr(self, name)]
        if include_tuning_params:
            parts += [f"{name}={getattr(self, name)}" for name in TUNING_FIELDS]
            if getattr(self, "GROUP_SIZE_N", 1) != 1:  # dW's tile order, named only off its default
                parts.append(f"GROUP_SIZE_N={self.GROUP_SIZE_N}")
            if getattr(self, "scheduled", False):
                parts.append("scheduled")
        if include_tma:
            parts += [f.name for f in fields(self) if f.name.startswith("use_tma_") and getattr(self, f.name)]
        return ",".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[C], params: Mapping[str, Any]) -> C:
        """Rebuild from `to_dict()`; ValueError naming an unknown key, or a field whose value is not of its type
        (tile sizes, warps and stages: integers >= 1; flags: booleans)."""
        known = {f.name: type(f.default) for f in fields(cls)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}")
        for name, value in params.items():
            want = known[name]
            if type(value) is not want or (want is int and value < 1):
                what = "positive int" if want is int else "bool"
                raise ValueError(f"{cls.__name__}: {name}={value!r} is not a {what}")
        return cls(**params)

    @property
    def tma_loads(self) -> tuple[bool, bool]:
        """(first operand, second operand) TMA load flags, in the kernel's operand order."""
        raise NotImplementedError


@dataclass(frozen=True)
class KernelConfigForward(KernelConfig):
    """Y = X·W[e]ᵀ. Tiles: BLOCK_SIZE_M rows × BLOCK_SIZE_N output columns, reduction BLOCK_SIZE_K."""

    use_tma_load_w: bool = False
    use_tma_load_x: bool = False

    @property
    def tma_loads(self) -> tuple[bool, bool]:
        return self.use_tma_load_x, self.use_tma_load_w


@dataclass(frozen=True)
class KernelConfigBackward_dW(KernelConfig):  # noqa: N801 (the name users know)
    """dW[e] = dY[e]ᵀ·X[e]. Tiles: BLOCK_SIZE_N × BLOCK_SIZE_K of dW, reduction over the expert's rows in
    BLOCK_SIZE_M steps. GROUP_SIZE_N: N tiles walked together along K (`_dw_tile`; 1: K tiles fastest).
    scheduled: X and dY are copied into rows padded per expert and every program's row blocks of all its tiles run
    as one pipelined loop over a step table (kernels/grouped_dw_scheduled.py); it reads and stores through TMA, and
    the copy does the permutes, so it needs all three TMA flags and neither permute flag."""

    use_tma_load_dy: bool = False
    use_tma_load_x: bool = False
    GROUP_SIZE_N: int = 1
    scheduled: bool = False

    @property
    def tma_loads(self) -> tuple[bool, bool]:
        return self.use_tma_load_dy, self.use_tma_load_x


@dataclass(frozen=True)
class KernelConfigBackward_dX(KernelConfig):  # noqa: N801 (the name users know)
    """dX = dY·W[e]. Tiles: BLOCK_SIZE_M rows × BLOCK_SIZE_K output columns, reduction over N in BLOCK_SIZE_N."""

    use_tma_load_dy: bool = False
    use_tma_load_w: bool = False

    @property
    def tma_loads(self) -> tuple[bool, bool]:
        return self.use_tma_load_dy, self.use_tma_load_w


# The launch config of each kernel: what `launch_config` builds and what the grouped-GEMM store's entries name
# ("config_class").
CONFIG_CLASSES: dict[str, type[KernelConfig]] = {
    "forward": KernelConfigForward, "dX": KernelConfigBackward_dX, "dW": KernelConfigBackward_dW}


def launch_config(kernel: str, params: Mapping[str, Any]) -> KernelConfig:
    """The config of `kernel` ("forward", "dX", "dW") from its fields, as `to_dict()` gives them and the store holds
    them; ValueError naming an unknown kernel, an unknown field or a value of the wrong type."""
    if kernel not in CONFIG_CLASSES:
        raise ValueError(f"unknown grouped-GEMM kernel {kernel!r}; expected one of {', '.join(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[kernel].from_dict(params)


def smem_bytes(config: KernelConfig, element_size: int = 2) -> int:
    """Shared memory a config needs: num_stages buffers of both operand tiles, plus the output tile when it is
    staged for a TMA store. The operand tiles are (M×K, N×K) forward, (M×N, N×K) dX, (M×N, M×K) dW."""
    m, n, k = config.BLOCK_SIZE_M, config.BLOCK_SIZE_N, config.BLOCK_SIZE_K
    if isinstance(config, KernelConfigBackward_dX):
        operands, out_tile = m * n + n * k, m * k
    elif isinstance(config, KernelConfigBackward_dW):
        operands, out_tile = m * n + m * k, n * k
    else:
        operands, out_tile = m * k + n * k, m * n
    if getattr(config, "scheduled", False):
        # Triton 3.6 allocates num_stages - 1 buffers for the scheduled loop and lowers the count itself where they
        # would not fit (compiled for cuda:90: 64×128×256 takes 164 KB at 4 stages, 213 KB at 5 and at 6).
        return (config.num_stages - 1) * operands * element_size
    total = config.num_stages * operands * element_size
    if config.use_tma_store:
        total += out_tile * element_size
    return total


# The Triton releases whose compiler fails, for a GPU, on the forward and dX kernels' flattened tile loop
# (`flatten=True`) around a TMA store: Triton 3.6's TritonGPUFuseNestedLoops pass stops with "PassManager::run failed"
# at every tile size tried (16×16×16 to 64×128×64, compiled for cuda:90 without a GPU, 2026-11-27), where 3.9
# compiles them; dW compiles either way. Later releases are let through until measured.
FLATTEN_TMA_STORE_BROKEN_UP_TO = (3, 6)


def stores_through_tma(config: KernelConfig) -> bool:
    """Whether a launch with `config` stores its output through TMA: the forward's scattered Y (permute_y) and dX's
    scattered dX (permute_x) never do, whatever the flag; dW's output is never scattered."""
    if isinstance(config, KernelConfigForward):
        return config.use_tma_store and not config.permute_y
    if isinstance(config, KernelConfigBackward_dX):
        return config.use_tma_store and not config.permute_x
    return config.use_tma_store


def compiles_here(config: KernelConfig, triton_version: str, interpreter: bool) -> bool:
    """Whether this Triton builds `config` for a GPU (always in the interpreter, which compiles nothing). dW's
    flattened loop builds with the store on every release seen."""
    return interpreter or isinstance(config, KernelConfigBackward_dW) or not (
        config.flatten and stores_through_tma(config)
        and triton_release(triton_version) <= FLATTEN_TMA_STORE_BROKEN_UP_TO)


def check_compiles_here(config: KernelConfig, triton_version: str, interpreter: bool) -> None:
    """ValueError (one line) when `config` is valid but this Triton cannot compile it for a GPU. Called where a
    launch binds and where compile_only builds; a stored entry's validity does not depend on the machine reading
    it."""
    if not compiles_here(config, triton_version, interpreter):
        broken = ".".join(map(str, FLATTEN_TMA_STORE_BROKEN_UP_TO))
        raise ValueError(f"{type(config).__name__}({config.to_string(True, True)}): flatten=True with a TMA store "
                         f"needs a Triton newer than {broken} (its FuseNestedLoops pass fails on this loop); this is "
                         f"Triton {triton_version}: use flatten=False")
