"""The grouped-GEMM kernels of an MoE MLP (gate_up and down; forward, dX, dW) as an engine tunable: problem key,
search space and its pruning rules, inputs in each role's layout, the fp32 reference and the torch baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritune.device import DeviceInfo
from tritune.kernels import grouped_gemm as gg
from tritune.kernels.grouped_dw_scheduled import pad
from tritune.kernels.grouped_gemm_compile import compile_only
from tritune.kernels.grouped_gemm_config import CONFIG_CLASSES, KernelConfig, compiles_here
from tritune.kernels.grouped_gemm_reference import (
    grouped_gemm_dw_reference,
    grouped_gemm_dx_reference,
    grouped_gemm_reference,
)
from tritune.knobs import interpreting
from tritune.ops.grouped_gemm import heuristic_configs, run_dw, run_dx, run_forward
from tritune.ops.moe_mlp import dw_on_padded, padded_rows
from tritune.ops.routing import sample_routing
from tritune.tuners.grouped_gemm_tuning import (
    BACKWARD_DW_RULES,
    BACKWARD_DX_RULES,
    FORWARD_RULES,
    DeviceProperties,
    exceeds_smem,
    uses_tma,
)
from tritune.tuning.space import BOOL, Constraint, Param, SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config

GEMMS = ("gate_up", "down")
KERNELS = ("forward", "dX", "dW")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_RULES = {"forward": FORWARD_RULES, "dX": BACKWARD_DX_RULES, "dW": BACKWARD_DW_RULES}
# Config fields of the first and second operand's TMA load: x·w forward, dy·w dX, dy·x dW.
_TMA_FIELDS = {"forward": ("use_tma_load_x", "use_tma_load_w"), "dX": ("use_tma_load_dy", "use_tma_load_w"),
               "dW": ("use_tma_load_dy", "use_tma_load_x")}
_RUN = {"forward": run_forward, "dX": run_dx, "dW": run_dw}
_REFERENCE = {"forward": grouped_gemm_reference, "dX": grouped_gemm_dx_reference, "dW": grouped_gemm_dw_reference}
# Which kernel argument the role's permute gathers (gate_up: X from token order; down: dY from pair order);
# absent: the permute scatters the output into pair order instead (gate_up dX, down forward).
_GATHERED_ARG = {("gate_up", "forward"): 0, ("gate_up", "dW"): 0, ("down", "dX"): 0, ("down", "dW"): 1}

DEFAULT_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (32, 64, 128),
    "BLOCK_SIZE_N": (64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "num_warps": (4, 8),
    "num_stages": (3, 4, 5),
    "flatten": (True, False),
    "use_tma_load_a": (False, True),  # first operand: x forward, dy dX, dy dW
    "use_tma_load_b": (False, True),  # second operand: w forward, w dX, x dW
    "use_tma_store": (False, True),
    "fuse_permute": (True, False),  # True: the kernel permutes; False: torch permutes around it (timed with it)
    "GROUP_SIZE_N": (1, 8),  # dW's tile order (`_dw_tile`); 1 only for forward and dX
    "scheduled": (False, True),  # dW's one-loop kernel over padded rows (grouped_dw_scheduled); False elsewhere
}
# Tiny blocks for Triton's interpreter (no GPU): a correctness run, not a performance one.
INTERPRETER_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "num_warps": (4,), "num_stages": (2,),
    "flatten": (True,), "use_tma_load_a": (False,), "use_tma_load_b": (False,), "use_tma_store": (False,),
    "fuse_permute": (True, False), "GROUP_SIZE_N": (1,), "scheduled": (False,),
}
# The values each parameter may take at all (a --search-space file is checked against them before any work): tiles
# are powers of two >= 16 (tl.arange, tl.dot), num_warps a power of two, the flags true or false.
SPACE_RULES: dict[str, Param] = {
    "BLOCK_SIZE_M": Param(16, pow2=True), "BLOCK_SIZE_N": Param(16, pow2=True), "BLOCK_SIZE_K": Param(16, pow2=True),
    "num_warps": Param(1, pow2=True), "num_stages": Param(1), "flatten": BOOL, "use_tma_load_a": BOOL,
    "use_tma_load_b": BOOL, "use_tma_store": BOOL, "fuse_permute": BOOL, "GROUP_SIZE_N": Param(1), "scheduled": BOOL,
}


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class GroupedGemmShape:
    """An MoE MLP: E experts, hidden H, intermediate I, topk experts per token, seqlen tokens; skew is the Zipf
    exponent of the synthetic routing (0: uniform)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    topk: int
    seqlen: int
    dtype: str
    skew: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "topk", "seqlen"):
            _positive_int(name, getattr(self, name))
        if self.topk > self.num_experts:
            raise ValueError(f"topk must be <= num_experts ({self.num_experts}), got {self.topk}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.skew, bool) or not isinstance(self.skew, (int, float)) or not (
                math.isfinite(self.skew) and self.skew >= 0):
            raise ValueError(f"skew must be a finite number >= 0, got {self.skew!r}")

    @property
    def pairs(self) -> int:
        """P = seqlen·topk: rows of every grouped-order tensor."""
        return self.seqlen * self.topk


@dataclass(frozen=True)
class GroupedGemmProblem:
    """One kernel ("forward", "dX", "dW") of one GEMM ("gate_up": W1 [E, 2I, H]; "down": W2 [E, H, I])."""

    shape: GroupedGemmShape
    gemm: str
    kernel: str

    def __post_init__(self) -> None:
        if self.gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    def key(self) -> str:
        s = self.shape
        return (f"grouped_gemm:{self.gemm}:{self.kernel}:{s.dtype}:E={s.num_experts}:H={s.hidden_size}"
                f":I={s.intermediate_size}:topk={s.topk}:seqlen={s.seqlen}:skew={s.skew:g}")

    def label(self) -> str:
        """A short name for progress lines ('gate_up forward T1024 E128 k8'); `key()` stays the journal's."""
        s = self.shape
        return f"{self.gemm} {self.kernel} T{s.seqlen} E{s.num_experts} k{s.topk}"

    @property
    def n(self) -> int:
        return 2 * self.shape.intermediate_size if self.gemm == "gate_up" else self.shape.hidden_size

    @property
    def k(self) -> int:
        return self.shape.hidden_size if self.gemm == "gate_up" else self.shape.intermediate_size

    @property
    def permute_x(self) -> bool:
        """gate_up's role: its forward and dW gather X from token order, its dX scatters into pair order."""
        return self.gemm == "gate_up"

    @property
    def permute_y(self) -> bool:
        """down's role: its forward scatters Y into pair order, its dX and dW gather dY from pair order."""
        return self.gemm == "down"


def rule_points(problem: GroupedGemmProblem, device: DeviceInfo) -> tuple[Config, ...]:
    """The op's untuned choice for `problem` (`ops.grouped_gemm.heuristic_configs`, the kernel's config of the
    three) as a search-space point, where one gives back exactly that config through `kernel_config`; none under
    the interpreter or without CUDA."""
    if device.interpreter or not torch.cuda.is_available():
        return ()
    s = problem.shape
    configs = heuristic_configs(problem.n, problem.k, s.seqlen * s.topk / s.num_experts, problem.permute_x,
                                problem.permute_y, torch.device("cuda"))
    rule = getattr(configs, problem.kernel)
    first, second = _TMA_FIELDS[problem.kernel]
    point = Config.of(BLOCK_SIZE_M=rule.BLOCK_SIZE_M, BLOCK_SIZE_N=rule.BLOCK_SIZE_N, BLOCK_SIZE_K=rule.BLOCK_SIZE_K,
                      num_warps=rule.num_warps, num_stages=rule.num_stages, flatten=bool(rule.flatten),
                      use_tma_load_a=bool(getattr(rule, first)), use_tma_load_b=bool(getattr(rule, second)),
                      use_tma_store=bool(rule.use_tma_store), fuse_permute=bool(rule.permute_x or rule.permute_y),
                      GROUP_SIZE_N=getattr(rule, "GROUP_SIZE_N", 1), scheduled=getattr(rule, "scheduled", False))
    return (point,) if kernel_config(problem, point) == rule else ()


def kernel_config(problem: GroupedGemmProblem, config: Config) -> KernelConfig:
    """The kernel's config for a search-space point: fuse_permute becomes the role's permute flag and
    use_tma_load_a/b the kernel's own TMA field names."""
    first, second = _TMA_FIELDS[problem.kernel]
    fuse = bool(config["fuse_permute"])
    # GROUP_SIZE_N and scheduled came with dW's tile order and its one-loop kernel: a point from before them (a
    # journal, a search-space file) has 1 and False
    order = {"GROUP_SIZE_N": int(config.get("GROUP_SIZE_N", 1)),
             "scheduled": bool(config.get("scheduled", False))} if problem.kernel == "dW" else {}
    return CONFIG_CLASSES[problem.kernel](**order,
        BLOCK_SIZE_M=int(config["BLOCK_SIZE_M"]), BLOCK_SIZE_N=int(config["BLOCK_SIZE_N"]),
        BLOCK_SIZE_K=int(config["BLOCK_SIZE_K"]), num_warps=int(config["num_warps"]),
        num_stages=int(config["num_stages"]), flatten=bool(config["flatten"]),
        permute_x=fuse and problem.permute_x, permute_y=fuse and problem.permute_y, fuse_mul_post=False,
        use_tma_store=bool(config["use_tma_store"]),
        **{first: bool(config["use_tma_load_a"]), second: bool(config["use_tma_load_b"])})


def _element_size(problem: GroupedGemmProblem) -> int:
    return torch.empty((), dtype=DTYPES[problem.shape.dtype]).element_size()


def tma_row_elements(problem: GroupedGemmProblem) -> dict[str, int]:
    """Row length (elements) of each tensor a TMA flag reads or writes: operand a, operand b, the output."""
    n, k = problem.n, problem.k
    return {"forward": {"a": k, "b": k, "store": n}, "dX": {"a": n, "b": k, "store": k},
            "dW": {"a": n, "b": k, "store": k}}[problem.kernel]


# dW's tile order (GROUP_SIZE_N) decides which stripes of dY and X stay in the L2. Where the experts whose tiles are
# in flight at once (one wave of 128×256 tiles) hold their dY and X in half the L2, at twice the average rows per
# expert for routing skew, no order can matter: Qwen3-30B-A3B's dW ran within ±3% across orders 1-16 on the H100,
# Mixtral's down dW (75 MB per expert) 3.27 ms at 1 and 2.86 at 16 (RESULTS.md, 2026-11-27 twelfth session).
DW_ORDER_L2_SHARE = 0.5
DW_ORDER_ROWS_MARGIN = 2.0


def dw_order_matters(problem: GroupedGemmProblem, device: DeviceInfo) -> bool:
    """Whether dW's operands in flight outgrow DW_ORDER_L2_SHARE of the L2, so GROUP_SIZE_N is worth searching."""
    s = problem.shape
    rows = DW_ORDER_ROWS_MARGIN * s.pairs / s.num_experts
    tiles_per_expert = max(1, -(-problem.n // 128) * -(-problem.k // 256))
    experts_in_flight = max(1.0, device.sm_count / tiles_per_expert)
    return rows * (problem.n + problem.k) * _element_size(problem) * experts_in_flight > (
        DW_ORDER_L2_SHARE * device.l2_bytes)


def grouped_gemm_constraints(problem: GroupedGemmProblem, device: DeviceInfo) -> tuple[Constraint, ...]:
    """The pruning rules of grouped_gemm_tuning (each named after its predicate), shared memory against the
    device, then TMA support; the first failing rule is the one counted."""
    props = DeviceProperties.of(device)
    elt = _element_size(problem)
    rows = tma_row_elements(problem)
    order_matters = problem.kernel == "dW" and dw_order_matters(problem, device)

    def keeps(rule: Callable[[KernelConfig], bool]) -> Callable[[Config], bool]:
        return lambda c: not rule(kernel_config(problem, c))

    def tma_aligned(c: Config) -> bool:
        flags = {"a": c["use_tma_load_a"], "b": c["use_tma_load_b"], "store": c["use_tma_store"]}
        return all((rows[what] * elt) % 16 == 0 for what, on in flags.items() if on)

    rules = [Constraint(rule.__name__, keeps(rule)) for rule in _RULES[problem.kernel]]
    return (
        *rules,
        Constraint("GROUP_SIZE_N orders dW's tiles only",
                   lambda c: problem.kernel == "dW" or c.get("GROUP_SIZE_N", 1) == 1),
        Constraint("GROUP_SIZE_N cannot matter: the experts in flight fit the L2",
                   lambda c: c.get("GROUP_SIZE_N", 1) == 1 or order_matters),
        Constraint("scheduled is dW's", lambda c: problem.kernel == "dW" or not c.get("scheduled", False)),
        Constraint("scheduled needs N a multiple of BLOCK_SIZE_N",
                   lambda c: not c.get("scheduled", False) or problem.n % int(c["BLOCK_SIZE_N"]) == 0),
        Constraint("exceeds_smem", lambda c: not exceeds_smem(kernel_config(problem, c), props, elt)),
        Constraint("TMA needs capability >= 9.0",
                   lambda c: device.supports_tma or not uses_tma(kernel_config(problem, c))),
        Constraint("TMA rows not a multiple of 16 bytes", tma_aligned),
        Constraint("flatten with a TMA store does not compile on this Triton",
                   lambda c: compiles_here(kernel_config(problem, c), device.triton_version, device.interpreter)),
    )


def _rows_of_x(problem: GroupedGemmProblem) -> int:
    """Rows of the kernel's X: token order [T, K] for gate_up (permute_x role), grouped [P, K] for down."""
    return problem.shape.seqlen if problem.gemm == "gate_up" else problem.shape.pairs


def make_grouped_inputs(problem: GroupedGemmProblem, device: torch.device | str, seed: int) -> dict:
    """Seeded routing and operands in the layout the problem's kernel reads with its permute fused.

    Returns {"args": the two kernel operands (x, w forward; dy, w dX; x, dy dW), "m_sizes" int32 [E],
    "gather" int32 [P], "src_rows" int64 [P] (row of the gathered operand for each grouped row), "pairs" int64
    [P] (pair-order position of each grouped row)}. Activations ~N(0, 1), weights ~N(0, 0.05²).
    """
    s, dt = problem.shape, DTYPES[problem.shape.dtype]
    device = torch.device(device)
    _, ids = sample_routing(s.seqlen, s.num_experts, s.topk, skew=s.skew, seed=seed, device=device)
    m_sizes, gather = gg.group_by_expert(ids, s.num_experts)
    gen = torch.Generator(device=device).manual_seed(seed)
    n, k, p = problem.n, problem.k, s.pairs

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device).mul_(scale).to(dt)

    if problem.kernel == "forward":
        args = (randn(_rows_of_x(problem), k), randn(s.num_experts, n, k, scale=0.05))
    elif problem.kernel == "dX":
        args = (randn(p, n), randn(s.num_experts, n, k, scale=0.05))
    else:
        args = (randn(_rows_of_x(problem), k), randn(p, n))
    pairs = gather.long()
    src_rows = pairs // s.topk if problem.gemm == "gate_up" else pairs
    return {"args": args, "m_sizes": m_sizes, "gather": gather, "src_rows": src_rows, "pairs": pairs}


def output_shape(problem: GroupedGemmProblem) -> tuple[int, ...]:
    p = problem.shape.pairs
    return {"forward": (p, problem.n), "dX": (p, problem.k),
            "dW": (problem.shape.num_experts, problem.n, problem.k)}[problem.kernel]


def torch_baseline(problem: GroupedGemmProblem, inputs: dict,
                   use_grouped_mm: bool) -> Callable[[], torch.Tensor]:
    """The op in torch, explicit permutes included: torch._grouped_mm (use_grouped_mm; bf16 on sm90+), else a
    loop over experts (m_sizes read to the host here, outside the returned call). Output as the reference's."""
    a, b = inputs["args"]
    src, pairs, m_sizes = inputs["src_rows"], inputs["pairs"], inputs["m_sizes"]
    kernel, gathered = problem.kernel, _GATHERED_ARG.get((problem.gemm, problem.kernel))
    offs = torch.cumsum(m_sizes, 0, dtype=torch.int32)
    slices = []
    start = 0
    for count in m_sizes.tolist():
        slices.append(slice(start, start + count))
        start += count

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if use_grouped_mm:
            if kernel == "forward":
                return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
            if kernel == "dX":
                return torch._grouped_mm(a, b, offs=offs)
            return torch._grouped_mm(b.t(), a, offs=offs)
        if kernel == "dW":
            out = torch.zeros(output_shape(problem), dtype=a.dtype, device=a.device)
            for e, rows in enumerate(slices):
                out[e] = b[rows].T @ a[rows]
            return out
        out = torch.empty((a.shape[0], b.shape[1] if kernel == "forward" else b.shape[2]), dtype=a.dtype,
                          device=a.device)
        for e, rows in enumerate(slices):
            out[rows] = a[rows] @ (b[e].T if kernel == "forward" else b[e])
        return out

    if gathered == 0:
        return lambda: product(a.index_select(0, src), b)
    if gathered == 1:
        return lambda: product(a, b.index_select(0, src))
    return lambda: torch.empty(output_shape(problem), dtype=a.dtype, device=a.device).index_copy_(
        0, pairs, product(a, b))


# Per output dtype. fp32 assumes tl.dot in full precision (as the interpreter computes it).
TOLERANCES = {
    "bf16": Tolerance(atol=2e-2, rtol=2e-2, max_mismatch_ratio=1e-3, max_rel_l2=1e-2),
    "fp16": Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_ratio=1e-3, max_rel_l2=5e-3),
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, max_mismatch_ratio=0.0, max_rel_l2=1e-4),
}


@dataclass(frozen=True)
class GroupedGemmTunable:
    """Engine binding for `tritune.kernels.grouped_gemm`; picklable (it crosses into compile and GPU workers)."""

    name: str = "grouped_gemm"
    space_params: tuple[tuple[str, tuple], ...] | None = None  # overrides (interpreter space, --search-space)

    def space(self, problem: GroupedGemmProblem, device: DeviceInfo) -> SearchSpace:
        """The default space and its rules, with the op's untuned choice on a GPU always measured
        (`SearchSpace.extra`); an override (interpreter space, --search-space) measures only what it lists."""
        extra = () if self.space_params else rule_points(problem, device)
        space = SearchSpace(dict(DEFAULT_SPACE), grouped_gemm_constraints(problem, device), SPACE_RULES, extra)
        return space.with_params(dict(self.space_params)) if self.space_params else space

    def make_inputs(self, problem: GroupedGemmProblem, device: torch.device, seed: int) -> dict:
        return make_grouped_inputs(problem, device, seed)

    def reference(self, problem: GroupedGemmProblem, inputs: dict) -> torch.Tensor:
        """fp32, in the layout of the fused kernel: gate_up forward/dW read X in token order and its dX is
        written in pair order; down forward is written in pair order and its dX/dW read dY in pair order."""
        return _REFERENCE[problem.kernel](*inputs["args"], inputs["m_sizes"], topk=problem.shape.topk,
                                          gather_indices=inputs["gather"], permute_x=problem.permute_x,
                                          permute_y=problem.permute_y)

    def alloc_output(self, problem: GroupedGemmProblem, inputs: dict) -> torch.Tensor:
        a = inputs["args"][0]
        return torch.empty(output_shape(problem), device=a.device, dtype=DTYPES[problem.shape.dtype])

    def launcher(self, problem: GroupedGemmProblem, inputs: dict, config: Config,
                 out: torch.Tensor) -> Callable[[], None]:
        """What the op runs (ops.grouped_gemm.run_*): fuse_permute=True is one kernel launch; False is the kernel
        without permutes plus the permute in torch (index_select before, or index_copy_ into pair order after).

        A scheduled down dW runs as the MoE MLP runs it (ops/moe_mlp.py): on dY the top-k sum's backward already
        wrote padded per expert, a write the plain layout pays too, so the padding copy is made here, outside the
        timed call. A scheduled gate_up dW keeps its copy in the timing: the MLP pays it, in the forward."""
        run = _RUN[problem.kernel]
        a, b = inputs["args"]
        m_sizes, gather, kc = inputs["m_sizes"], inputs["gather"], kernel_config(problem, config)
        topk, pairs = problem.shape.topk, problem.shape.pairs
        padded_to = padded_rows(kc) if problem.kernel == "dW" and problem.permute_y else 0
        if padded_to:
            dy_rows = pad(b, m_sizes, gather, 1, pairs, padded_to)
            return lambda: dw_on_padded(a, dy_rows, m_sizes, gather, topk, kc, "dy", out=out)
        return lambda: run(a, b, m_sizes, gather, topk, problem.permute_x, problem.permute_y, kc, out=out)

    def compile(self, problem: GroupedGemmProblem, config: Config) -> None:
        """Build the candidate's binary in the CPU pool (nothing to build under the interpreter)."""
        if interpreting():
            return
        s = problem.shape
        compile_only(kernel_config(problem, config), num_experts=s.num_experts, n=problem.n, k=problem.k,
                     pairs=s.pairs, topk=s.topk, dtype=DTYPES[s.dtype])

    def flops(self, problem: GroupedGemmProblem) -> float:
        return 2.0 * problem.shape.pairs * problem.n * problem.k

    def bytes_moved(self, problem: GroupedGemmProblem) -> float:
        """Each operand read once (X [T, K] in token order for gate_up), the output written once; all E weights."""
        s, n, k = problem.shape, problem.n, problem.k
        x, w, dy = _rows_of_x(problem) * k, s.num_experts * n * k, s.pairs * n
        total = {"forward": x + w + s.pairs * n, "dX": dy + w + s.pairs * k, "dW": x + dy + w}[problem.kernel]
        return float(total * _element_size(problem))

    def tolerance(self, problem: GroupedGemmProblem) -> Tolerance:
        return TOLERANCES[problem.shape.dtype]

