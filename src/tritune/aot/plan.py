"""What a kernel family hands the bundle builder: the kernel, its run spec, the configs to compile and how
each config's constexprs follow from its parameters, with the data already written into the bundle.

One plan per kernel (fused-MoE stage 1, stage 2, GEMM, a user kernel); the builder never names a family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritune.aot.spec import RunSpec

# .tdat dtype -> Triton's pointer element type
TRITON_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "int32": "i32", "int64": "i64", "uint8": "u8"}
_SAFE_ID = re.compile(r"[A-Za-z0-9_]+")


@dataclass
class KernelPlan:
    """One kernel of a bundle.

    `constexprs(params)` gives the compiled-in values of one config (block sizes and the problem's flags);
    `configs` are the config parameter dicts (num_warps and num_stages included, ints only); `artifact_id`
    names a config uniquely and file-name safely. `store` says where `tritune aot import` writes the winner.
    """

    name: str
    entry_source: str  # Python source of a module that defines `function` (the @triton.jit kernel) at top level
    function: str
    param_names: tuple[str, ...]  # the kernel's parameters in declaration order
    spec: RunSpec
    configs: list[dict[str, int]]
    constexprs: Callable[[Mapping[str, int]], dict[str, int | bool]]
    artifact_id: Callable[[Mapping[str, int]], str]
    source: str  # "module:function" for the manifest
    pointer_dtypes: Mapping[str, str] = field(default_factory=dict)  # Triton element type of each scratch pointer
    do_not_specialize: Sequence[str] = ()
    problem: dict = field(default_factory=dict)
    store: dict = field(default_factory=dict)

    def check_ids(self) -> None:
        ids = [self.artifact_id(c) for c in self.configs]
        bad = [i for i in ids if not _SAFE_ID.fullmatch(i)]
        if bad:
            raise ValueError(f"{self.name}: artifact ids {bad[:3]} are not file-name safe ([A-Za-z0-9_])")
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"{self.name}: configs {dup[:3]} appear more than once")


def aot_space(defaults: Mapping[str, Sequence], space: Mapping[str, Sequence] | None,
              fixed: Mapping[str, tuple]) -> dict[str, tuple]:
    """`defaults` overridden by the user's `space`, with the parameters an artifact cannot vary pinned to `fixed`
    (one launch per artifact: no split-K reduction, no host-built TMA descriptors). ValueError when `space`
    asks for another value of a pinned parameter."""
    space = dict(space or {})
    for name, value in fixed.items():
        if name in space and tuple(space[name]) != value:
            raise ValueError(f"aot: {name} must be {value[0]} ahead of time (got {list(space[name])})")
    return {k: tuple(v) for k, v in (dict(defaults) | space | dict(fixed)).items()}


def spec_path(bundle: Path, kernel: str) -> Path:
    return bundle / "specs" / f"{kernel}.spec"


def data_name(what: str, shape_tag: str, block_size_m: int | str | None = None) -> str:
    """`data/<what>[.BLOCK_SIZE_M=<bm>].<shape>.tdat`; pass "{BLOCK_SIZE_M}" to get the spec's template."""
    bm = f".BLOCK_SIZE_M={block_size_m}" if block_size_m is not None else ""
    return f"data/{what}{bm}.{shape_tag}.tdat"


def param_names_of(kernel: object) -> tuple[str, ...]:
    """Parameter names of a @triton.jit function (JIT or interpreter object alike)."""
    import inspect

    fn = getattr(kernel, "fn", kernel)
    return tuple(inspect.signature(fn).parameters)
