"""The fused-MoE kernels as an engine tunable: one problem per (CSV row, kernel kind), its space and pruning rules.

Kinds: "stage1" (sort + activation quantization + gate-up GEMM, timed together), "stage2" (quantization of the
intermediate + down GEMM + top-k sum; the sort is made outside the timed call since stage 1 paid for it),
"1stage" (the whole op in one GEMM launch) and "e2e" (a chosen pair re-timed as the op the user calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from tritune import knobs
from tritune.device import DeviceInfo
from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe_compile import MoeDims, compile_only
from tritune.kernels.fused_moe_config import FMA_QUANTS, scale_records_fit
from tritune.kernels.moe_align import compile_sort_only, moe_align_block_size
from tritune.kernels.moe_reference import fused_moe_reference, stage1_reference, stage2_reference
from tritune.kernels.mxfp4_format import BITS_PER_WEIGHT
from tritune.kernels.mxfp4_records import RECORD_BYTES, RECORD_ROWS, Mxfp4Scales, scale_records
from tritune.kernels.mxfp4_swizzle import Mxfp4Weights, prepare_mxfp4_weights
from tritune.kernels.pdl import target_pdl
from tritune.knobs import interpreting
from tritune.ops.fused_moe import MoeChoice, fused_moe
from tritune.ops.heuristics import moe_heuristic
from tritune.ops.routing import sample_routing
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuning.space import Constraint, Param, SearchSpace
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config

KINDS = ("stage1", "stage2", "1stage", "e2e")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Relative L2 error bound per data path, always enforced whatever --errRatio allows.
# MXFP4 takes the 16-bit bound: its reference is the torch MoE on the dequantized weights, which bf16 and fp16 hold
# exactly (e2m1 values times a power of two, within the scale codes quantize_mxfp4 writes for these N(0, 1/K) weights:
# kernels/mxfp4_format.py), so the kernel and the reference differ only in accumulation order and the rounding of
# the 16-bit intermediate, as on the bf16 path; the quantization error itself never enters the gate.
REL_L2_BOUND = {"none": 2e-2, "per_token": 3e-2, "per_1x128": 3e-2, fm.MXFP4: 2e-2, fm.MXFP4_A8: 3e-2}
TMA_RULE = f"MXFP4 weights through TMA exactly when the GEMM swaps ({fm.MXFP4} only)"
SCALE_RULE = (f"SCALE_TMA only where the scale records fit the tile ({fm.MXFP4} swapped through TMA, BLOCK_K 128, "
              "BLOCK_N a multiple of 64, stage 1's inter_dim a multiple of 64)")
SWAP_RULE = ("SWAP_AB only with BLOCK_SIZE_M <= 32 < BLOCK_SIZE_N (MXFP4: 64 <= BLOCK_SIZE_N <= 16 x num_warps; "
             f"not {fm.MXFP4_A8})")
ONE_STAGE_MAX_PAIRS = 256  # the 1-stage kernel's atomics only pay while the weights dominate

# BLOCK_SIZE_M values of the stage kernels' multiply-add path (fused_moe_config.is_fma), in the space only with
# FMA_IN_SPACE: not yet measured on a GPU against the tl.dot tiles (benchmarks/bench_mxfp4_stages.py --fma times it).
FMA_BLOCK_M = (1, 2, 4, 8)
FMA_IN_SPACE = False

STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 8),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "KSPLIT": (1, 2, 4),
    "USE_TMA": (0, 1),
    "SWAP_AB": (0, 1),
    "SCALE_TMA": (0, 1),
}
ONE_STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32),
    "BLOCK_SIZE_N": (32, 64, 128),
    "BLOCK_SIZE_K": (64, 128, 256),
    "BLOCK_SIZE_D": (64, 128, 256),
    "GROUP_SIZE_M": (1,),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "SWAP_AB": (0, 1),  # the swapped MXFP4 1-stage kernel (fused_moe_1stage._moe_1stage_swap_kernel)
    "USE_TMA": (0, 1),
    "SCALE_TMA": (0, 1),
    "KSPLIT": (1, 2, 4),  # the swapped one's stage 1 split along K
}
# The swapped MXFP4 1-stage kernel is searched up to this many pairs an expert (the other 1-stage kernels up to
# ONE_STAGE_MAX_PAIRS pairs in all): on the H100 it beat the stage pair at 2-8 pairs an expert on four shapes
# (benchmarks/RESULTS.md, twenty-first session).
ONE_STAGE_SWAP_MAX_MEAN = 16
# The values each parameter may take at all (`--search-space` is checked against them before any work; a name goes
# to every space that has it): tiles are powers of two >= 16 (fm.check_config), num_warps a power of two.
_TILE, _COUNT = Param(16, pow2=True), Param(1)
STAGE_RULES: dict[str, Param] = {
    "BLOCK_SIZE_M": _TILE, "BLOCK_SIZE_N": _TILE, "BLOCK_SIZE_K": _TILE, "GROUP_SIZE_M": _COUNT,
    "num_warps": Param(1, pow2=True), "num_stages": _COUNT, "KSPLIT": _COUNT, "USE_TMA": Param(choices=(0, 1)),
    "SWAP_AB": Param(choices=(0, 1)), "SCALE_TMA": Param(choices=(0, 1)),
}
ONE_STAGE_RULES: dict[str, Param] = {
    "BLOCK_SIZE_M": _TILE, "BLOCK_SIZE_N": _TILE, "BLOCK_SIZE_K": _TILE, "BLOCK_SIZE_D": _TILE,
    "GROUP_SIZE_M": _COUNT, "num_warps": Param(1, pow2=True), "num_stages": _COUNT,
    "SWAP_AB": Param(choices=(0, 1)), "USE_TMA": Param(choices=(0, 1)), "SCALE_TMA": Param(choices=(0, 1)),
    "KSPLIT": _COUNT,
}


# What the e2e kind re-times: (stage-1 config, stage-2 config), or (1-stage config, None).
Plan = tuple[fm.MoeConfig, fm.MoeConfig | None]


@dataclass(frozen=True)
class MoeProblem:
    """One kernel kind of one CSV row; `skew` is the Zipf exponent of the synthetic routing (0: uniform); `plan` the
    launch configs an e2e problem re-times as the op (None for the other kinds; an e2e problem without one only
    sizes the whole op: FLOPs and bytes)."""

    shape: FmoeShape
    kind: str
    skew: float = 0.0
    plan: Plan | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fused-MoE problem kind {self.kind!r}; expected one of {KINDS}")
        if self.plan is not None and self.kind != "e2e":
            raise ValueError(f"a fused-MoE {self.kind} problem takes no plan (only e2e re-times one)")

    @property
    def names(self) -> tuple[str, str]:
        """The kernel names of an e2e problem's plan, as the CSV's kernelName1 and kernelName2 write them ("" for a
        1-stage plan's second); ("", "") for the other kinds."""
        return plan_names(self.plan, self.shape) if self.plan is not None else ("", "")

    def key(self) -> str:
        names = f":{self.names[0]}+{self.names[1]}" if self.kind == "e2e" else ""
        return f"fused_moe:{self.kind}:{self.shape.key()}:skew={self.skew:g}{names}"

    def label(self) -> str:
        """A short name for progress lines ('moe stage1 T5 D96 I80 E5 k2 silu fp16 none'); `key()` stays the
        journal's."""
        s = self.shape
        which = {"e2e": " 1-stage" if not self.names[1] else f" BM{self.plan[0].BLOCK_SIZE_M}{self.lever_tag}"
                 }.get(self.kind, "")
        skew = f" zipf{self.skew:g}" if self.skew else ""
        return (f"moe {self.kind}{which} T{s.token} D{s.model_dim} I{s.inter_dim} E{s.expert} k{s.topk} {s.act_type} "
                f"{s.dtype} {s.quant}{skew}")

    @property
    def lever_tag(self) -> str:
        """' SI2 TA1' (' SI2 PS1' with stage 2 persistent, ' SI2 GA1 GL1' on the Gluon kernels) when an end-to-end
        plan has issue 14's levers on, else ''."""
        first, second = self.plan if self.plan else (None, None)
        levers = [f"{short}{getattr(first, name, 0)}" for name, short in (
            ("SORTED_INTER", "SI"), ("TOPK_ATOMIC", "TA"), ("GATHER_A", "GA"), ("GLUON", "GL"))
                  if first is not None and getattr(first, name, 0)]
        levers += ["PS1"] if getattr(second, "PERSISTENT", 0) else []
        return (" " + " ".join(levers)) if levers else ""

    @property
    def dims(self) -> MoeDims:
        s = self.shape
        return MoeDims(s.token, s.topk, s.expert, s.model_dim, s.inter_dim, s.use_g1u1, DTYPES[s.dtype],
                          s.quant, s.act_type, s.doweight_stage1, swizzled=s.quant == fm.MXFP4)


def routing(shape: FmoeShape, skew: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded synthetic routing every kind of one row shares: (weights fp32 [T, topk], ids int32 [T, topk])."""
    return sample_routing(shape.token, shape.expert, shape.topk, skew=skew, seed=1234, device=device)


def routed_experts(shape: FmoeShape, skew: float) -> int:
    """Experts that receive at least one token under `routing` (the only weights the op must read)."""
    return int(torch.unique(routing(shape, skew)[1]).numel())


def _elt(p: MoeProblem) -> int:
    """Bytes per activation element of a GEMM's A (fp8 for the fp8 quantizations, else 16-bit)."""
    return 1 if p.shape.quant in fm.FP8_QUANTS else 2


def _w_elt(p: MoeProblem) -> float:
    """Bytes per weight element: fp8 1, 16-bit 2, MXFP4 half a byte of code plus 1/32 of a byte of scale."""
    return BITS_PER_WEIGHT / 8 if p.shape.quant in fm.MXFP4_QUANTS else 2 if p.shape.quant == "none" else 1


def stage_constraints(p: MoeProblem, dev: DeviceInfo) -> tuple[Constraint, ...]:
    """Static pruning rules of the stage-1/stage-2 space, in order; the first failing rule is the one counted."""
    s = p.shape
    stage1 = p.kind == "stage1"
    numel = s.token * s.topk
    mean = max(1, math.ceil(numel / s.expert))  # pairs per expert under uniform routing
    b_tiles = 2 if stage1 and s.use_g1u1 else 1  # gate and up tiles per K step
    n, k = (s.inter_dim, s.model_dim) if stage1 else (s.model_dim, s.inter_dim)
    elt, w_elt = _elt(p), _w_elt(p)
    w_row = k // 2 if s.quant in fm.MXFP4_QUANTS else k * elt  # bytes of a weight row (TMA wants 16-byte multiples)
    active = min(numel, s.expert)

    def blocks(c: Config) -> int:
        return active * max(1, triton.cdiv(mean, c["BLOCK_SIZE_M"]))

    def smem(c: Config) -> int:
        return int(c["num_stages"] * (c["BLOCK_SIZE_M"] * elt + b_tiles * c["BLOCK_SIZE_N"] * w_elt)
                   * c["BLOCK_SIZE_K"])

    quant = s.quant
    return (
        # The swapped MXFP4 GEMM reads its packed tile from a swizzled TMA tile without bank conflicts: 7.7-15% faster
        # than by pointers at 16-4096 tokens (H100, gpt-oss-120b, seventeenth session), so only that is searched.
        Constraint(TMA_RULE,
                   lambda c: quant not in fm.MXFP4_QUANTS or bool(c["USE_TMA"]) == (quant == fm.MXFP4
                                                                                 and bool(c["SWAP_AB"]))),
        # The codes through TMA (kernels/mxfp4_records.py) are searched beside the pointer loads wherever they fit.
        Constraint(SCALE_RULE,
                   lambda c: not c.get("SCALE_TMA", 0) or (
                       scale_records_fit(quant, c["SWAP_AB"], c["USE_TMA"], c["BLOCK_SIZE_K"], c["BLOCK_SIZE_N"])
                       and (not stage1 or n % RECORD_ROWS == 0))),
        # vLLM's rule on Hopper: the weight tile becomes the wgmma's 64-row operand when a block has fewer pairs.
        # MXFP4 swaps for another reason, at any block height: the decoded tile goes to the wgmma from registers
        # (fused_moe._mxfp4_swap_dot), and one decode serves all BLOCK_SIZE_M rows; one 64-row wgmma a warp group
        # (wider raced: check_config). Not with fp8 activations (check_config says why).
        Constraint(SWAP_RULE,
                   lambda c: not c["SWAP_AB"] or (quant != fm.MXFP4_A8 and (
                       64 <= c["BLOCK_SIZE_N"] <= 16 * c["num_warps"] if quant == fm.MXFP4
                       else c["BLOCK_SIZE_M"] <= 32 < c["BLOCK_SIZE_N"]))),
        Constraint("shared memory > device limit", lambda c: smem(c) <= dev.max_shared_mem),
        Constraint("accumulator registers per thread > 128",
                   lambda c: b_tiles * c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] // (c["num_warps"] * 32) <= 128),
        # per_1x128 scales each K step's product before adding it: one more tile of fp32 registers live. On an H200
        # every stage-2 tile past 192 of them ran 1.6-1.8x behind the best (Mixtral, 1024 tokens). On 4 warps even 192
        # spill: the gated 64x128 stage 1 compiled to 255 registers and 62-64 spills and ran 2.1x behind the same tile
        # on 8 warps (H100, DeepSeek-V2-Lite and Qwen3-30B-A3B at 1024 tokens), which spilled 0.
        Constraint("per_1x128 accumulators + scaled product > 192 registers per thread (128 on 4 warps)",
                   lambda c: quant != "per_1x128"
                   or (b_tiles + 1) * c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] // (c["num_warps"] * 32)
                   <= (128 if c["num_warps"] == 4 else 192)),
        # The multiply-add path (BLOCK_SIZE_M under 16, fused_moe_config.is_fma): what it runs, one block height per
        # row (the power of two holding the pairs an expert gets, so an expert's weights are read by one block), and
        # its [BLOCK_M, BLOCK_N, BLOCK_K] product within 128 fp32 registers a thread.
        Constraint("BLOCK_SIZE_M under 16 only for 16-bit or MXFP4 weights, without TMA or SWAP_AB",
                   lambda c: c["BLOCK_SIZE_M"] >= 16 or (quant in FMA_QUANTS and not c["USE_TMA"]
                                                         and not c["SWAP_AB"])),
        Constraint("BLOCK_SIZE_M under 16 only as the power of two holding the pairs per expert",
                   lambda c: c["BLOCK_SIZE_M"] >= 16 or c["BLOCK_SIZE_M"] == triton.next_power_of_2(mean)),
        Constraint("multiply-add product > 128 registers per thread",
                   lambda c: c["BLOCK_SIZE_M"] >= 16
                   or c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] * c["BLOCK_SIZE_K"] <= 128 * 32 * c["num_warps"]),
        # The swapped MXFP4 GEMM's work a K step is its decode, BLOCK_N x BLOCK_K weights whatever the block height:
        # 128-row tiles on 8 warps beat 64 on 4 in stage 2 at 16-row blocks (nineteenth session), so it is exempt.
        Constraint("8 warps on a tile under 128x64 (not the swapped MXFP4 GEMM)",
                   lambda c: c["num_warps"] == 4 or c["BLOCK_SIZE_M"] < 16
                   or b_tiles * c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] >= 128 * 64
                   or (quant == fm.MXFP4 and bool(c["SWAP_AB"]))),
        Constraint("BLOCK_SIZE_M above 2x the pairs per expert",
                   lambda c: c["BLOCK_SIZE_M"] <= max(16, triton.next_power_of_2(2 * mean))),
        Constraint("BLOCK_SIZE_M under a quarter of the pairs per expert (cap 64)",
                   lambda c: c["BLOCK_SIZE_M"] >= min(64, triton.next_power_of_2(mean) // 4)),
        Constraint("BLOCK_SIZE_N 32 only with BLOCK_SIZE_M <= 32",
                   lambda c: c["BLOCK_SIZE_N"] > 32 or c["BLOCK_SIZE_M"] <= 32),
        Constraint("per_1x128 needs BLOCK_SIZE_K dividing 128",
                   lambda c: quant != "per_1x128" or fm.SCALE_BLOCK % c["BLOCK_SIZE_K"] == 0),
        Constraint("fp8 per_token with BLOCK_SIZE_K 64",  # a GPU speed rule: the interpreter's tiny space keeps 32
                   lambda c: quant != "per_token" or c["BLOCK_SIZE_K"] >= 128 or dev.interpreter),
        Constraint("BLOCK_SIZE_K 256 only with BLOCK_SIZE_M <= 32",
                   lambda c: c["BLOCK_SIZE_K"] < 256 or c["BLOCK_SIZE_M"] <= 32),
        Constraint("BLOCK_SIZE_K x KSPLIT > K", lambda c: c["BLOCK_SIZE_K"] * c["KSPLIT"] <= max(k, c["BLOCK_SIZE_K"])),
        # MXFP4's programs are long decode loops: splitting a grid of under two waves still pays (H100, gpt-oss-120b
        # at one token, 180 programs of 64 columns: 74 us the stage pair split 2 against 105 unsplit).
        Constraint("split-K on a grid that already fills the GPU (MXFP4: twice)",
                   lambda c: c["KSPLIT"] == 1 or blocks(c) * triton.cdiv(n, c["BLOCK_SIZE_N"])
                   < dev.sm_count * (2 if quant in fm.MXFP4_QUANTS else 1)),
        Constraint("num_stages beyond the K steps",
                   lambda c: c["num_stages"] <= 2 + triton.cdiv(k, c["BLOCK_SIZE_K"] * c["KSPLIT"])),
        Constraint("GROUP_SIZE_M > 1 with one block per expert",
                   lambda c: c["GROUP_SIZE_M"] == 1 or triton.cdiv(mean, c["BLOCK_SIZE_M"]) > 1),
        Constraint("TMA: needs Hopper and 16-byte weight rows",
                   lambda c: not c["USE_TMA"] or (dev.capability[0] >= 9 and w_row % 16 == 0)),
    )


def one_stage_constraints(p: MoeProblem, dev: DeviceInfo) -> tuple[Constraint, ...]:
    """Pruning rules of the 1-stage space."""
    s = p.shape
    numel = s.token * s.topk
    mean = max(1, math.ceil(numel / s.expert))
    b_tiles = 2 if s.use_g1u1 else 1
    elt = _elt(p)
    # On a GPU with TMA the MXFP4 1-stage kernel is the swapped one: the unswapped one never beat the stage pair
    # there (the op never took it); the interpreter runs either (its space keeps the unswapped one's small tiles).
    swap_only = s.quant == fm.MXFP4 and dev.supports_tma and not dev.interpreter

    def smem(c: Config) -> int:
        if c["SWAP_AB"]:  # packed weight tiles of both loops (half a byte a weight) and the activations' tiles
            return c["num_stages"] * ((b_tiles * c["BLOCK_SIZE_N"] + c["BLOCK_SIZE_D"]) * c["BLOCK_SIZE_K"] // 2
                                      + c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_K"] * 2 + 4 * RECORD_BYTES)
        first = c["num_stages"] * (c["BLOCK_SIZE_M"] + b_tiles * c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * elt
        return max(first, 2 * (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_D"]) * c["BLOCK_SIZE_N"] * 2)

    def swapped_fits(c: Config) -> bool:
        """The swapped 1-stage kernel's tiles (fused_moe_config._check_1stage_swap), BLOCK_K 128 through TMA, and
        the codes' records exactly where they fit (BLOCK_N 128; a gated w1's up rows on a record)."""
        if not c["SWAP_AB"]:
            return not c["USE_TMA"] and not c["SCALE_TMA"]
        records = c["BLOCK_SIZE_N"] == 128 and (not s.use_g1u1 or s.inter_dim % RECORD_ROWS == 0)
        cap = 16 * c["num_warps"]
        return (c["USE_TMA"] == 1 and c["BLOCK_SIZE_K"] == 128 and bool(c["SCALE_TMA"]) == records
                and c["BLOCK_SIZE_N"] in (64, 128) and c["BLOCK_SIZE_N"] <= cap
                and c["BLOCK_SIZE_D"] % 64 == 0 and c["BLOCK_SIZE_D"] <= cap)

    return (
        Constraint(f"1-stage only up to {ONE_STAGE_MAX_PAIRS} routed pairs (swapped MXFP4: "
                   f"{ONE_STAGE_SWAP_MAX_MEAN} pairs an expert)",
                   lambda c: (mean <= ONE_STAGE_SWAP_MAX_MEAN) if c["SWAP_AB"] else numel <= ONE_STAGE_MAX_PAIRS),
        Constraint(f"SWAP_AB only for {fm.MXFP4}, and always there on a GPU with TMA",
                   lambda c: (c["SWAP_AB"] == 1) == swap_only or (c["SWAP_AB"] == 1 and s.quant == fm.MXFP4
                                                                  and dev.interpreter)),
        Constraint("the swapped 1-stage tiles: BLOCK_N 64 or 128, BLOCK_D a multiple of 64, both at most 16 x "
                   "num_warps, BLOCK_K 128 through TMA, SCALE_TMA where the records fit (BLOCK_N 128); "
                   "no TMA or SCALE_TMA unswapped", swapped_fits),
        Constraint("shared memory > device limit", lambda c: smem(c) <= dev.max_shared_mem),
        Constraint("1-stage split-K only swapped, on a grid under three waves, each split 2 K steps or more",
                   lambda c: c["KSPLIT"] == 1 or (bool(c["SWAP_AB"]) and min(numel, s.expert) * triton.cdiv(
                       s.inter_dim, c["BLOCK_SIZE_N"]) < 3 * dev.sm_count
                       and s.model_dim >= 2 * c["KSPLIT"] * c["BLOCK_SIZE_K"])),
        Constraint("BLOCK_SIZE_M above 2x the pairs per expert",
                   lambda c: c["BLOCK_SIZE_M"] <= max(16, triton.next_power_of_2(2 * mean))),
        Constraint("per_1x128 needs BLOCK_SIZE_K and BLOCK_SIZE_N dividing 128",
                   lambda c: s.quant != "per_1x128" or (fm.SCALE_BLOCK % c["BLOCK_SIZE_K"] == 0
                                                         and fm.SCALE_BLOCK % c["BLOCK_SIZE_N"] == 0)),
        Constraint("8 warps on a tile under 32x128 (not the swapped MXFP4 kernel: its work is the decode)",
                   lambda c: c["num_warps"] == 4 or c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_D"] >= 32 * 128
                   or bool(c["SWAP_AB"])),
        Constraint("num_stages beyond the K steps",
                   lambda c: c["num_stages"] <= 2 + triton.cdiv(s.model_dim, c["BLOCK_SIZE_K"])),
    )


# The rule table's plan joins the stage search (its stages always measured) and the end-to-end re-time, so a tuned
# row is never one the op beats untuned: on the H100, E 128 top-8 I 384 rows tuned at 4096 and 8192 tokens ran
# 979.8 / 1646.8 us where the rule table's own plan ran 949.8 / 1559.1 us (benchmarks/RESULTS.md, 2026-11-26).
# Off under the interpreter (its times mean nothing; tests switch it on).
RULE_PLAN_UNDER_INTERPRETER = False


def rule_plan(shape: FmoeShape, device: DeviceInfo) -> Plan:
    """What the op runs for a row of `shape` with no tuned file on `device` (the rule table)."""
    run_1stage, first, second = moe_heuristic(
        shape.token, shape.model_dim, shape.inter_dim, shape.expert, shape.topk, shape.quant, device.sm_count,
        device.max_shared_mem, gated=shape.use_g1u1, capability=device.capability,
        one_stage=not knobs.deterministic(), atomics=not knobs.deterministic())
    return (first, None) if run_1stage else (first, second)


def rule_point(problem: MoeProblem, device: DeviceInfo, params: dict) -> Config | None:
    """The rule plan's kernel for `problem`'s kind as a point of a space with `params` (the plan-level fields the
    stages are not searched over left out: the stage alone runs without them), or None where the plan has no kernel
    of that kind."""
    first, second = rule_plan(problem.shape, device)
    kernel = {"stage1": first if second is not None else None, "stage2": second,
              "1stage": first if second is None else None}[problem.kind]
    if kernel is None:
        return None
    return Config.from_dict({name: getattr(kernel, name) for name in params})


def rule_points(problem: MoeProblem, device: DeviceInfo, params: dict) -> tuple[Config, ...]:
    """`SearchSpace.extra` for `problem`: the rule plan's kernel of its kind, where it has one."""
    if device.interpreter and not RULE_PLAN_UNDER_INTERPRETER:
        return ()
    point = rule_point(problem, device, params)
    return () if point is None else (point,)


def config_of(config: Config) -> fm.MoeConfig:
    """The launch config of a stage or 1-stage search-space point: the one place an engine Config becomes one."""
    return fm.MoeConfig.from_params(config.as_dict())


def plan_names(plan: Plan, shape: FmoeShape) -> tuple[str, str]:
    """(kernelName1, kernelName2) of a plan for a row of `shape`: its quant and activation in the names; a 1-stage
    plan's second name is ""."""
    first, second = plan
    kind1 = "1stage" if second is None else "stage1"
    return (first.name(kind1, shape.quant, shape.act_type),
            "" if second is None else second.name("stage2", shape.quant, shape.act_type))


@dataclass(frozen=True)
class FusedMoeTunable:
    """Engine binding for `tritune.kernels.fused_moe`; picklable (it crosses into compile and GPU workers)."""

    name: str = "fused_moe"
    err_ratio: float = 0.5
    atol: float = 1e-2
    rtol: float = 2e-2
    stage_space: tuple[tuple[str, tuple], ...] | None = None  # overrides (tests, --search-space)
    one_stage_space: tuple[tuple[str, tuple], ...] | None = None

    def space(self, problem: MoeProblem, device: DeviceInfo) -> SearchSpace:
        if problem.kind == "e2e":  # one point: the plan, labelled by its kernel names (the journal's config key)
            if problem.plan is None:
                raise ValueError("an e2e fused-MoE problem without a plan has nothing to re-time")
            return SearchSpace({"kernel1": (problem.names[0],), "kernel2": (problem.names[1],)})
        if problem.kind == "1stage":
            params = dict(ONE_STAGE_SPACE) | dict(self.one_stage_space or ())
            extra = () if self.one_stage_space else rule_points(problem, device, params)
            return SearchSpace(params, one_stage_constraints(problem, device), extra=extra)
        params = dict(STAGE_SPACE) | dict(self.stage_space or ())
        if FMA_IN_SPACE and not self.stage_space:
            params["BLOCK_SIZE_M"] = (*FMA_BLOCK_M, *params["BLOCK_SIZE_M"])
        extra = () if self.stage_space else rule_points(problem, device, params)
        return SearchSpace(params, stage_constraints(problem, device), extra=extra)

    def make_inputs(self, problem: MoeProblem, device: torch.device, seed: int) -> dict:
        s = problem.shape
        dt = DTYPES[s.dtype]
        gen = torch.Generator(device=device).manual_seed(seed)
        n_w1 = s.inter_dim * (2 if s.use_g1u1 else 1)
        # Weights scaled by 1/sqrt(K) keep every GEMM's output ~N(0, 1), so tolerances mean the same at any shape.
        hidden = torch.randn(s.token, s.model_dim, device=device, generator=gen).to(dt)
        w1 = torch.randn(s.expert, n_w1, s.model_dim, device=device, generator=gen) / math.sqrt(s.model_dim)
        w2 = torch.randn(s.expert, s.model_dim, s.inter_dim, device=device, generator=gen) / math.sqrt(s.inter_dim)
        if s.quant == "none":
            (w1, w1_s), (w2, w2_s) = (w1.to(dt), None), (w2.to(dt), None)
        else:
            (w1, w1_s), (w2, w2_s) = fm.quantize_weights(w1, s.quant), fm.quantize_weights(w2, s.quant)
        weights, ids = routing(s, problem.skew, device)
        inputs = {"hidden": hidden, "w1": w1, "w2": w2, "w1_scale": w1_s, "w2_scale": w2_s,
                  "topk_weights": weights, "topk_ids": ids}
        if s.quant == fm.MXFP4:  # the codes' TMA records and the prepared weights too, made once as a user's load
            # would (SCALE_TMA; the swapped GEMM reads prepared weights: `launcher`), those of the weights it runs
            inputs["w1_scale_records"], inputs["w2_scale_records"] = scale_records(w1_s), scale_records(w2_s)
            for name in {"stage1": ("w1",), "stage2": ("w2",)}.get(problem.kind, ("w1", "w2")):
                inputs[f"{name}_tiles"] = prepare_mxfp4_weights(inputs[name]).tiles
        if problem.kind == "stage2":
            inputs["inter"] = self._stage1_ref(problem, inputs).to(dt)
        return inputs

    def _stage1_ref(self, p: MoeProblem, x: dict) -> torch.Tensor:
        s = p.shape
        return stage1_reference(x["hidden"], x["w1"], x["topk_weights"], x["topk_ids"], inter_dim=s.inter_dim,
                                activation=s.act_type, quant=s.quant, w1_scale=x["w1_scale"],
                                doweight_stage1=s.doweight_stage1)

    def reference(self, problem: MoeProblem, inputs: dict) -> torch.Tensor:
        s, x = problem.shape, inputs
        if problem.kind == "stage1":
            return self._stage1_ref(problem, x)
        if problem.kind == "stage2":
            return stage2_reference(x["inter"], x["w2"], x["topk_weights"], x["topk_ids"], quant=s.quant,
                                    w2_scale=x["w2_scale"], doweight_stage1=s.doweight_stage1)
        one_stage = problem.kind == "1stage" or (problem.kind == "e2e" and problem.plan[1] is None)
        return fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"],
                                   activation=s.act_type, quant=s.quant, w1_scale=x["w1_scale"],
                                   w2_scale=x["w2_scale"], doweight_stage1=s.doweight_stage1,
                                   requantize_intermediate=not one_stage)

    def alloc_output(self, problem: MoeProblem, inputs: dict) -> torch.Tensor:
        s = problem.shape
        rows, cols = (s.token * s.topk, s.inter_dim) if problem.kind == "stage1" else (s.token, s.model_dim)
        return torch.empty((rows, cols), device=inputs["hidden"].device, dtype=DTYPES[s.dtype])

    def launcher(self, problem: MoeProblem, inputs: dict, config: Config, out: torch.Tensor) -> Callable[[], None]:
        s, x = problem.shape, inputs
        w1_s, w2_s = x["w1_scale"], x["w2_scale"]
        if "w1_scale_records" in x:  # MXFP4: both layouts, so SCALE_TMA points read their records
            w1_s, w2_s = Mxfp4Scales(w1_s, x["w1_scale_records"]), Mxfp4Scales(w2_s, x["w2_scale_records"])
        kw = {"activation": s.act_type, "quant": s.quant, "w1_scale": w1_s, "w2_scale": w2_s,
              "doweight_stage1": s.doweight_stage1}

        def weight(name: str, cfg: fm.MoeConfig | None) -> torch.Tensor | Mxfp4Weights:
            """The GEMM that reads prepared MXFP4 weights gets them (as the op does when users prepare them)."""
            gated = name == "w1" and s.use_g1u1
            if cfg is not None and f"{name}_tiles" in x and fm.reads_prepared(cfg, s.quant, s.inter_dim, gated):
                return Mxfp4Weights(x[f"{name}_tiles"], *x[name].shape[1:])
            return x[name]

        if problem.kind in ("e2e", "1stage"):
            # The whole op, exactly as users call it (its bound launches, host cost included).
            if problem.kind == "e2e":
                cfg1, cfg2 = problem.plan
            else:
                cfg1, cfg2 = config_of(config), None
                fm.check_config(cfg1, "1stage", s.quant)
            choice = MoeChoice(cfg2 is None, cfg1, cfg2, "tuner")
            # The unswapped 1-stage kernel reads the standard bytes; the swapped one reads both weights prepared.
            reads1 = cfg1 if cfg2 is not None or cfg1.SWAP_AB else None
            if cfg2 is None and not fm.reads_prepared(cfg1, s.quant, s.inter_dim, s.use_g1u1):
                reads1 = None  # both weights as they are (MoeLaunch takes both prepared or neither)
            reads2 = cfg2 if cfg2 is not None else reads1
            args = (x["hidden"], weight("w1", reads1), weight("w2", reads2), x["topk_weights"], x["topk_ids"])
            return lambda: fused_moe(*args, out=out, choice=choice, **kw)
        cfg = config_of(config)
        fm.check_config(cfg, problem.kind, s.quant)
        if problem.kind == "stage1":
            w1 = weight("w1", cfg)

            def stage1() -> None:
                sorting = moe_align_block_size(x["topk_ids"], cfg.BLOCK_SIZE_M, s.expert)
                fm.moe_stage1(x["hidden"], w1, x["topk_weights"], sorting, cfg, inter_dim=s.inter_dim,
                              activation=s.act_type, quant=s.quant, w1_scale=w1_s,
                              doweight_stage1=s.doweight_stage1, out=out)
            return stage1
        sorting = moe_align_block_size(x["topk_ids"], cfg.BLOCK_SIZE_M, s.expert)
        w2 = weight("w2", cfg)
        return lambda: fm.moe_stage2(x["inter"], w2, x["topk_weights"], sorting, cfg, quant=s.quant,
                                     w2_scale=w2_s, doweight_stage1=s.doweight_stage1, out=out)

    def compile(self, problem: MoeProblem, config: Config) -> None:
        """Into Triton's cache, in the compile pool: the candidate's GEMM kernel, or for an e2e problem its plan's
        GEMM kernels (the lever variants among them, e.g. SORTED_INTER 2, were never compiled by the stage search;
        left to the GPU worker, they compiled there one after another while every GPU waited: issue 17)."""
        if interpreting():
            return
        if problem.kind != "e2e":
            cfg = config_of(config)
            # The swapped 1-stage kernel is timed inside the op, whose plan launches it as a programmatic dependent.
            compile_only(problem.kind, problem.dims, cfg, pdl=problem.kind == "1stage" and target_pdl())
            if problem.kind != "1stage":  # the stage launcher sorts for its BLOCK_SIZE_M (int32 ids, as make_inputs)
                compile_sort_only(problem.dims.numel, cfg.BLOCK_SIZE_M, problem.dims.experts)
            return
        cfg1, cfg2 = problem.plan
        if cfg2 is None:
            compile_only("1stage", problem.dims, cfg1, pdl=target_pdl())
        else:  # the op's plan launches its GEMMs as programmatic dependents on Hopper (kernels/pdl.py)
            compile_only("stage1", problem.dims, cfg1, pdl=target_pdl())
            compile_only("stage2", problem.dims, cfg2, pdl=target_pdl())

    def compile_key(self, problem: MoeProblem, config: Config) -> str:
        return f"{problem.key()}:{config.key()}"

    def flops(self, problem: MoeProblem) -> float:
        s = problem.shape
        numel = s.token * s.topk
        first = 2.0 * numel * s.inter_dim * (2 if s.use_g1u1 else 1) * s.model_dim
        second = 2.0 * numel * s.model_dim * s.inter_dim
        return {"stage1": first, "stage2": second}.get(problem.kind, first + second)

    def bytes_moved(self, problem: MoeProblem) -> float:
        """Weights of the routed experts only (MXFP4's scales counted; fp8 scales ignored: under 1%), activations in
        and out once."""
        s = problem.shape
        elt, act = _w_elt(problem), 2
        routed = routed_experts(s, problem.skew)
        w1 = routed * s.inter_dim * (2 if s.use_g1u1 else 1) * s.model_dim * elt
        w2 = routed * s.model_dim * s.inter_dim * elt
        io1 = act * (s.token * s.model_dim + s.token * s.topk * s.inter_dim)
        io2 = act * (s.token * s.topk * s.inter_dim + s.token * s.model_dim)
        whole = w1 + w2 + act * 2 * s.token * s.model_dim
        return float({"stage1": w1 + io1, "stage2": w2 + io2}.get(problem.kind, whole))

    def tolerance(self, problem: MoeProblem) -> Tolerance:
        return Tolerance(self.atol, self.rtol, self.err_ratio, max_rel_l2=REL_L2_BOUND[problem.shape.quant])
