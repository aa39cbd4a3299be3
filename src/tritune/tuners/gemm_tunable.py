"""The GEMM kernels as an engine tunable: problem key, search space with its pruning rules, inputs, reference."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from tritune.device import DeviceInfo
from tritune.kernels import gemm as gk
from tritune.kernels.gemm import TAGS
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.gluon_gemm_ws import split_k_fits
from tritune.kernels.quant import quantize_blocks, quantize_rows
from tritune.kernels.triton_release import HAS_WARP_SPECIALIZE
from tritune.knobs import interpreting
from tritune.ops.gemm import gemm as op_gemm
from tritune.ops.gemm import gemm_a8w8, gemm_a8w8_blockscale, heuristic_config
from tritune.ops.heuristics import WS_MIN_K
from tritune.tuning.space import BOOL, Constraint, Param, SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The default space: wide enough to reach cuBLAS on H100 at every M, small enough to tune 8 M values of one
# (N, K) in minutes. `FULL_SPACE` is the exhaustive one (pass it with --search-space).
DEFAULT_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    # 192 (128 + 64 as two MMAs on one A tile): the Gluon bf16 / a8w8 kernel's only (a wave count Triton's powers of
    # two miss; H100: fp8 64x192 won 3 of 24 held-out points at M 256-4096)
    "BLOCK_SIZE_N": (64, 128, 192, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 8),
    "num_warps": (4, 8),
    # Deep pipelines win at M 256-1024 (H100, six held-out (N, K), 2026-11-27: stages 3-8 tuned 1.085x faster than
    # 3-4 in geomean, up to 1.19x; the best of 3, 4, 6, 8 within 0.4% of it for a third more candidates).
    "num_stages": (3, 4, 6, 8),
    "NUM_KSPLIT": (1, 2, 4, 8),
    "cache_modifier": ("", ".cg"),
    "PERSISTENT_TMA": (False, True),
    "SCALE_PIPELINE": (False, True),
    "TAIL_SPLIT": (False, True),
    # Hopper: the Gluon kernels. Block-scaled: rescale off the MMA path (H100 0.72-0.83x the Triton kernel's time);
    # bf16 / a8w8: persistent, 96- and 192-wide tiles (H100: fp8 0.83-0.97x the Triton op's time at M 256-4096 where
    # the rule picks it; bf16 0.91-0.96x at 4 of 24 held-out points, 1.01-1.05x at others).
    "GLUON": (False, True),
    # Gluon's loader warp group feeding the MMA warps (kernels/gluon_gemm_ws; H100, twenty-eighth session:
    # block-scaled 128x128 0.833 -> 0.908x `_scaled_mm` in geomean from M 1024; H200, untuned, fp8 per-token 128x128
    # 1.03-1.12x at M 1024 on four of six (N, K)), or Triton's own, block-scaled from K 7168 (the rule's: 0.88-0.97x
    # the time there)
    "WARP_SPECIALIZE": (False, True),
}
# The warp-specialised Gluon GEMM with K split (kernels/gluon_gemm_ws.ws_splitk_kernel, NUM_KSPLIT 2-4 with GLUON,
# WARP_SPECIALIZE and PERSISTENT_TMA) in the space: off until it has run on a GPU (thirtieth session: compiled for
# sm_90, GPU tests written); the TMA rule keeps split-K out while it is.
GLUON_SPLIT_IN_SPACE = False
FULL_SPACE: dict[str, tuple] = {
    **DEFAULT_SPACE,
    "BLOCK_SIZE_N": (32, 64, 96, 128, 192, 256),
    "num_stages": (2, 3, 4, 5, 6, 7, 8),
    "NUM_KSPLIT": (1, 2, 3, 4, 6, 8, 16),
}
# The values each parameter may take at all (a --search-space file is checked against them before any work): tiles
# are powers of two >= 16 (tl.arange, tl.dot), BLOCK_SIZE_N also the sum of two (Gluon's), num_warps a power of two;
# GROUP_SIZE_M, num_stages and NUM_KSPLIT any integer >= 1; cache_modifier "" or ".cg" (the pruning rules know no
# other).
SPACE_RULES: dict[str, Param] = {
    "BLOCK_SIZE_M": Param(16, pow2=True), "BLOCK_SIZE_N": Param(16, pow2=True, pow2_pairs=True),
    "BLOCK_SIZE_K": Param(16, pow2=True),
    "GROUP_SIZE_M": Param(1), "num_warps": Param(1, pow2=True), "num_stages": Param(1), "NUM_KSPLIT": Param(1),
    "cache_modifier": Param(choices=("", ".cg")), "PERSISTENT_TMA": BOOL, "SCALE_PIPELINE": BOOL, "TAIL_SPLIT": BOOL,
    "GLUON": BOOL, "WARP_SPECIALIZE": BOOL,
}


@dataclass(frozen=True)
class GemmProblem:
    """C[M, N] = A[M, K] · B[N, K]ᵀ for one kernel; `dtype` is the operand type of the bf16 kernel, `out_dtype`
    C's (bf16 or fp16)."""

    kernel: str
    M: int
    N: int
    K: int
    dtype: str = "bf16"
    out_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.kernel not in gk.KERNELS:
            raise ValueError(f"unknown GEMM kernel {self.kernel!r}; expected one of {', '.join(gk.KERNELS)}")
        if min(self.M, self.N, self.K) < 1:
            raise ValueError(f"M, N, K must be >= 1, got M={self.M} N={self.N} K={self.K}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {', '.join(_DTYPES)}")
        if self.out_dtype not in gk.OUT_DTYPES:
            raise ValueError(f"unknown out_dtype {self.out_dtype!r}; expected one of {', '.join(gk.OUT_DTYPES)}")

    def key(self) -> str:
        op_dtype = self.dtype if self.kernel == "bf16" else "fp8e4m3"
        out = "" if self.out_dtype == "bf16" else f":out={self.out_dtype}"  # bf16 keys as before: journals resume
        return f"gemm:{self.kernel}:{op_dtype}{out}:M={self.M}:N={self.N}:K={self.K}"

    @property
    def tag(self) -> str:
        return TAGS[self.kernel]


def _smem_bytes(c: Config, elt: int) -> int:
    stages = int(c["num_stages"])
    tiles = (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * elt * stages
    epilogue = c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] * 2 if c["PERSISTENT_TMA"] or c.get("GLUON") else 0
    return tiles + epilogue


def gemm_constraints(p: GemmProblem, dev: DeviceInfo) -> tuple[Constraint, ...]:
    """Static pruning rules, applied in order; the first failing rule is the one counted."""
    elt = 1 if p.kernel != "bf16" else torch.empty((), dtype=_DTYPES[p.dtype]).element_size()
    m_pow2 = triton.next_power_of_2(p.M)

    def tiles(c: Config) -> int:
        return triton.cdiv(p.M, c["BLOCK_SIZE_M"]) * triton.cdiv(p.N, c["BLOCK_SIZE_N"])

    def tma_ok(c: Config) -> bool:
        if not c["PERSISTENT_TMA"]:
            return True
        aligned = (p.K * elt) % 16 == 0 and (p.N * 2) % 16 == 0
        gluon_split = GLUON_SPLIT_IN_SPACE and bool(c.get("GLUON")) and bool(c.get("WARP_SPECIALIZE")) \
            and split_k_fits(p.K, c["NUM_KSPLIT"], 128 // elt)
        return dev.capability[0] >= 9 and aligned and (c["NUM_KSPLIT"] == 1 or gluon_split) \
            and c["cache_modifier"] == ""

    def gluon_ok(c: Config) -> bool:
        if not c.get("GLUON"):
            return True
        aligned = (p.K * elt) % 16 == 0 and p.N % 8 == 0
        if not (dev.capability[0] == 9 and HAS_GLUON_HOPPER and aligned and p.dtype != "fp32"):
            return False
        # bf16 / a8w8: always persistent, so PERSISTENT_TMA off would only repeat PERSISTENT_TMA on
        return (p.kernel == "a8w8_blockscale" or bool(c["PERSISTENT_TMA"])) and gk.gluon_problem(
            gk.GemmConfig.from_params(c.as_dict()), p.kernel, elt) is None

    def pow2(n: int) -> bool:
        return n & (n - 1) == 0

    return (
        Constraint("GLUON: Hopper (Gluon API), 16-bit or fp8 operands, 16-byte rows, its tiles, no Triton-kernel "
                   "option (bf16 / a8w8: PERSISTENT_TMA on)", gluon_ok),
        # Gluon's loader warp group (gluon_problem checks its tile), or Triton's own (3.5+) where the rule takes it
        Constraint("WARP_SPECIALIZE: Gluon's, or Triton's block-scaled persistent kernel's (Triton >= 3.5, "
                   "K >= WS_MIN_K) without SCALE_PIPELINE",
                   lambda c: not c.get("WARP_SPECIALIZE") or bool(c.get("GLUON")) or (
                       p.kernel == "a8w8_blockscale" and c["PERSISTENT_TMA"] and not c["SCALE_PIPELINE"]
                       and HAS_WARP_SPECIALIZE and p.K >= WS_MIN_K)),
        # `gk.triton_ws_builds`: the other 4-warp tiles fail to compile; a block-scaled tune on the H200 spent 636
        # compiles on them (thirtieth session).
        Constraint("Triton's warp-specialised block-scaled kernel on 4 warps: only 64-row tiles up to 128 wide",
                   lambda c: not c.get("WARP_SPECIALIZE") or bool(c.get("GLUON"))
                   or gk.triton_ws_builds(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["num_warps"])),
        Constraint("BLOCK_SIZE_N not a power of two: the Gluon kernel's only",
                   lambda c: pow2(c["BLOCK_SIZE_N"]) or bool(c.get("GLUON"))),
        Constraint("shared memory > device limit", lambda c: _smem_bytes(c, elt) <= dev.max_shared_mem),
        Constraint("accumulator registers per thread > 128",
                   lambda c: c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] // (c["num_warps"] * 32) <= 128),
        Constraint("8 warps on a tile under 128x64",
                   lambda c: c["num_warps"] == 4 or c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] >= 128 * 64),
        Constraint("BLOCK_SIZE_M above next_pow2(M)", lambda c: c["BLOCK_SIZE_M"] <= max(16, m_pow2)),
        Constraint("BLOCK_SIZE_M under 64 for M >= 256", lambda c: p.M < 256 or c["BLOCK_SIZE_M"] >= 64),
        Constraint("block-scale needs BLOCK_SIZE_K dividing 128",
                   lambda c: p.kernel != "a8w8_blockscale" or gk.SCALE_BLOCK % c["BLOCK_SIZE_K"] == 0),
        Constraint("BLOCK_SIZE_K x NUM_KSPLIT > K",
                   lambda c: c["BLOCK_SIZE_K"] * c["NUM_KSPLIT"] <= max(p.K, c["BLOCK_SIZE_K"])),
        Constraint("split-K on a grid that already fills the GPU",
                   lambda c: c["NUM_KSPLIT"] == 1 or tiles(c) < dev.sm_count or c["TAIL_SPLIT"]),
        Constraint("split-K partials past the kernels' 32-bit offsets",  # gemm.validate's limit, pruned ahead
                   lambda c: gk.offsets_fit(p.M * p.N * c["NUM_KSPLIT"])),
        Constraint("TAIL_SPLIT needs split-K on the pointer kernel",
                   lambda c: not c["TAIL_SPLIT"] or (c["NUM_KSPLIT"] >= 2 and not c["PERSISTENT_TMA"])),
        # Issue 15's wave-quantization lever: only a last wave under half full is worth splitting (a 128x128 grid of
        # 288 tiles on 132 SMs leaves its third wave 18% full), and its splits must fit in that wave.
        Constraint("TAIL_SPLIT only where the last wave is under half full and its splits fit in it",
                   lambda c: not c["TAIL_SPLIT"] or (tiles(c) >= dev.sm_count
                                                     and 0 < tiles(c) % dev.sm_count <= dev.sm_count // 2
                                                     and tiles(c) % dev.sm_count * c["NUM_KSPLIT"] <= dev.sm_count)),
        Constraint("num_stages beyond the K steps", lambda c: c["num_stages"] <= 2 + triton.cdiv(
            p.K, c["BLOCK_SIZE_K"] * c["NUM_KSPLIT"])),
        Constraint("GROUP_SIZE_M > 1 with one row of tiles",
                   lambda c: c["GROUP_SIZE_M"] == 1 or triton.cdiv(p.M, c["BLOCK_SIZE_M"]) > 1),
        Constraint(".cg loads only for M <= 32 (weight streaming)",
                   lambda c: c["cache_modifier"] == "" or p.M <= 32),
        Constraint("BLOCK_SIZE_K 256 only on tiles with BLOCK_SIZE_M <= 32",
                   lambda c: c["BLOCK_SIZE_K"] < 256 or c["BLOCK_SIZE_M"] <= 32),
        # 64x128x64 with 8 stages won one of 12 held-out points at M 256 (qwen2.5-7b down, K 18944) and came
        # within 2% on two more; smaller tiles at BLOCK_K 64 never came close.
        Constraint("BLOCK_SIZE_K 64 only on tiles of at least 64x128",
                   lambda c: c["BLOCK_SIZE_K"] != 64 or c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] >= 64 * 128
                   or p.kernel == "a8w8_blockscale"),
        Constraint("TMA: needs Hopper, 16-byte rows, no split-K", tma_ok),
        Constraint("TMA with BLOCK_SIZE_M < 64", lambda c: not c["PERSISTENT_TMA"] or c["BLOCK_SIZE_M"] >= 64),
        Constraint("TMA persistent only for M >= 128", lambda c: not c["PERSISTENT_TMA"] or p.M >= 128),
        Constraint("SCALE_PIPELINE needs block-scale, TMA, BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128",
                   lambda c: not c["SCALE_PIPELINE"] or (p.kernel == "a8w8_blockscale" and c["PERSISTENT_TMA"]
                                                          and c["BLOCK_SIZE_K"] == 128 and c["BLOCK_SIZE_N"] <= 128)),
    )


def rule_points(problem: GemmProblem, device: DeviceInfo) -> tuple[Config, ...]:
    """The rule table's config for `problem` on `device` as a search-space point: the space's parameters and any
    other field the rule sets (so `config_of` gives back exactly that config); none under the interpreter."""
    if device.interpreter:
        return ()
    rule = heuristic_config(problem.kernel, problem.M, problem.N, problem.K, device.sm_count)
    defaults = gk.GemmConfig()
    params = {f.name: getattr(rule, f.name) for f in dataclasses.fields(rule)
              if f.name in DEFAULT_SPACE or getattr(rule, f.name) != getattr(defaults, f.name)}
    return (Config.from_dict(params),)


def config_of(config: Config) -> gk.GemmConfig:
    """The launch config of a search-space point: the one place an engine Config becomes a GemmConfig (the ops read
    stored configs through `ops.offgrid.gemm_entries`, the same conversion of the same parameters)."""
    return gk.GemmConfig.from_params(config.as_dict())


@dataclass(frozen=True)
class GemmTunable:
    """Engine binding for `tritune.kernels.gemm`; picklable (it crosses into compile and GPU workers)."""

    name: str = "gemm"
    space_params: tuple[tuple[str, tuple], ...] | None = None  # overrides from --search-space
    atol: float = 1e-2
    rtol: float = 1e-2
    max_mismatch_ratio: float = 1e-3

    def space(self, problem: GemmProblem, device: DeviceInfo) -> SearchSpace:
        """The default space and its rules, with the op's own untuned choice (the rule table's config) always
        measured (`SearchSpace.extra`), so a tuned shape is never one the op beats untuned; a --search-space
        override replaces the lists and measures only what it lists."""
        extra = () if self.space_params else rule_points(problem, device)
        space = SearchSpace(dict(DEFAULT_SPACE), gemm_constraints(problem, device), SPACE_RULES, extra)
        return space.with_params(dict(self.space_params)) if self.space_params else space

    def make_inputs(self, problem: GemmProblem, device: torch.device, seed: int) -> dict:
        # Drawn where they are used: on the CPU an 8192 x 14336 operand took about a second, and a worker of a 4-GPU
        # run, serving many problems, spent 47.5 s summed building GEMM inputs against 21.5 s on 1 GPU (issue 17).
        gen = torch.Generator(device=device).manual_seed(seed)
        M, N, K = problem.M, problem.N, problem.K
        # B scaled by 1/sqrt(K) keeps C ~ N(0, 1) at any K, so atol/rtol mean the same thing for every shape.
        a = torch.randn(M, K, generator=gen, device=device)
        b = torch.randn(N, K, generator=gen, device=device) / math.sqrt(K)
        if problem.kernel == "bf16":
            dt = _DTYPES[problem.dtype]
            return {"a": a.to(dt), "b": b.to(dt), "a_scale": None, "b_scale": None}
        if problem.kernel == "a8w8":
            (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
        else:
            (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, gk.SCALE_BLOCK)
        return {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}

    def reference(self, problem: GemmProblem, inputs: dict) -> torch.Tensor:
        return gk.gemm_reference(problem.kernel, **inputs)

    def alloc_output(self, problem: GemmProblem, inputs: dict) -> torch.Tensor:
        return torch.empty((problem.M, problem.N), device=inputs["a"].device, dtype=gk.OUT_DTYPES[problem.out_dtype])

    def launcher(self, problem: GemmProblem, inputs: dict, config: Config, out: torch.Tensor) -> Callable[[], None]:
        """The op call itself (`tritune.ops.gemm*` with this config): its bound launches, host cost included; C's
        dtype comes with `out`."""
        cfg = config_of(config)
        a, b, a_scale, b_scale = inputs["a"], inputs["b"], inputs["a_scale"], inputs["b_scale"]
        if problem.kernel == "bf16":
            return lambda: op_gemm(a, b, out=out, config=cfg)
        op = gemm_a8w8 if problem.kernel == "a8w8" else gemm_a8w8_blockscale
        return lambda: op(a, b, a_scale, b_scale, out=out, config=cfg)

    def launch_class(self, problem: GemmProblem, config: Config) -> str:
        """Candidates of one class pay the same host cost per call: split-K takes a scratch buffer and its tile
        locks, TMA (the Gluon kernel too) looks up three descriptors. The tuner re-times the fastest of each class as
        the op runs."""
        tma = config.get("PERSISTENT_TMA") or config.get("GLUON")
        return f"{'tma' if tma else 'pointer'}, split {config.get('NUM_KSPLIT', 1) > 1}"

    def compile(self, problem: GemmProblem, config: Config) -> None:
        if interpreting():
            return
        cfg = config_of(config)
        gk.compile_only(problem.kernel, problem.M, problem.N, problem.K, cfg, _DTYPES[problem.dtype],
                        gk.OUT_DTYPES[problem.out_dtype])

    def compile_key(self, problem: GemmProblem, config: Config) -> str:
        """Configs with equal keys share one binary (M is never specialized), so compile them once."""
        return f"{problem.kernel}:{problem.dtype}:{problem.out_dtype}:N={problem.N}:K={problem.K}:{config.key()}"

    def flops(self, problem: GemmProblem) -> float:
        return 2.0 * problem.M * problem.N * problem.K

    def bytes_moved(self, problem: GemmProblem) -> float:
        elt = 1 if problem.kernel != "bf16" else torch.empty((), dtype=_DTYPES[problem.dtype]).element_size()
        M, N, K = problem.M, problem.N, problem.K
        scales = 0
        if problem.kernel == "a8w8":
            scales = 4 * (M + N)
        elif problem.kernel == "a8w8_blockscale":
            scales = 4 * (M * triton.cdiv(K, 128) + triton.cdiv(N, 128) * triton.cdiv(K, 128))
        return float(elt * (M * K + N * K) + 2 * M * N + scales)

    def tolerance(self, problem: GemmProblem) -> Tolerance:
        return Tolerance(self.atol, self.rtol, self.max_mismatch_ratio, max_rel_l2=2e-2)
