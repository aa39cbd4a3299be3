"""The fused-MoE tuner: untuned CSV rows in, tuned CSV rows out (best stage pair sharing BLOCK_SIZE_M, or 1-stage).

Per row: every stage-1, stage-2 and 1-stage candidate is measured by GPU time (one engine run, so compiles and GPU
work overlap across rows); the stage pair minimising us1 + us2 per BLOCK_SIZE_M, the fastest pair's variant with the
sorted intermediate read through TMA (E2E_LEVER_VARIANT; also with stage 2 persistent, E2E_PERSISTENT_VARIANT) and
the best 1-stage are then re-timed end to end as the op the user calls (GPU time, eager calls and a CUDA-graph
replay), and the one the objective prefers among those that pass the gate is written.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tritune import knobs
from tritune.device import DeviceInfo, interpreter_cost_fault
from tritune.kernels.fused_moe_config import FP8_QUANTS, MXFP4_QUANTS, MoeConfig, check_config, is_fma
from tritune.store.atomic import atomic_write_text, check_writable, path_lock
from tritune.store.fmoe_csv import merge_tuned, read_tuned, read_untuned, write_tuned
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.tuners import fused_moe_tunable
from tritune.tuners.fused_moe_tunable import (
    ONE_STAGE_RULES,
    STAGE_RULES,
    FusedMoeTunable,
    MoeProblem,
    Plan,
    config_of,
    plan_names,
    rule_plan,
)
from tritune.tuning.report import ProblemResult, TuneSummary
from tritune.tuning.space import load_space_file
from tritune.tuning.strategy import resolve_objective
from tritune.tuning.tuner import TuneSettings, make_compile_pool, make_executor, tune
from tritune.tuning.types import Measurement, Objective

# Tiny blocks for Triton's interpreter (no GPU): a correctness run, not a performance one.
INTERPRETER_STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16,), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "GROUP_SIZE_M": (1,), "num_warps": (4,),
    "num_stages": (2,), "KSPLIT": (1, 2), "USE_TMA": (0,), "SWAP_AB": (0,), "SCALE_TMA": (0,),
}
INTERPRETER_ONE_STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16,), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "BLOCK_SIZE_D": (32,),
    "GROUP_SIZE_M": (1,), "num_warps": (4,), "num_stages": (2,), "SWAP_AB": (0,), "USE_TMA": (0,), "SCALE_TMA": (0,),
    "KSPLIT": (1,),
}
PROFILE_COLUMNS = ("token", "model_dim", "inter_dim", "expert", "topk", "act_type", "dtype", "q_type", "use_g1u1",
                   "doweight_stage1", "kind", "kernelName", "status", "us", "err", "rel_l2", "message", "us_eager",
                   "us_graph")


@dataclass(frozen=True)
class MoeTuneRequest:
    input: Path
    output: Path
    last: bool = False  # only the last input row
    retune_all: bool = False  # also rows already in the output for this device
    profile_file: Path | None = None
    err_ratio: float = 0.5
    skew: float = 0.0  # Zipf exponent of the synthetic routing; 0 is uniform
    space_file: Path | None = None  # JSON {param: [values]}: each list replaces that parameter's in every space with it
    allow_slow_interpreter: bool = False  # without a GPU, tune rows beyond what the interpreter finishes quickly

    def __post_init__(self) -> None:
        if not 0.0 <= self.err_ratio <= 1.0:
            raise ValueError(f"--errRatio {self.err_ratio} must lie in [0, 1]")
        if not (self.skew >= 0.0 and math.isfinite(self.skew)):
            raise ValueError(f"--skew {self.skew} must be a finite number >= 0")


@dataclass
class Choice:
    """The winner of one row before the end-to-end re-time: its launch configs and what the stages measured."""

    plan: Plan  # (stage 1, stage 2), or (1-stage, None)
    us1: float
    err1: float
    us2: float = 0.0
    err2: float = 0.0

    @property
    def one_stage(self) -> bool:
        return self.plan[1] is None


@dataclass
class MoeTuneReport:
    written: list[FmoeTuned] = field(default_factory=list)
    skipped: list[FmoeShape] = field(default_factory=list)
    failed: list[tuple[FmoeShape, str]] = field(default_factory=list)
    summaries: list[TuneSummary] = field(default_factory=list)
    results: list[ProblemResult] = field(default_factory=list)
    rule_plans: set[str] = field(default_factory=set)  # keys of the e2e problems that re-time the rule table's plan
    # Seconds outside the engine's passes (issue 17: the fixed cost that a multi-GPU run does not divide):
    # "start" making the GPU workers and the compile pool, "close" shutting them down, "write" the output files.
    outside_s: dict[str, float] = field(default_factory=dict)

    def failure(self) -> str:
        """'' when every row was tuned, else one line naming each failed row and its one cause (the table's words)."""
        if not self.failed:
            return ""
        return f"{len(self.failed)} row(s) could not be tuned: " + "; ".join(
            f"{row_name(s)}: {why}" for s, why in self.failed)


def build_tunable(req: MoeTuneRequest, device: DeviceInfo) -> FusedMoeTunable:
    """The tunable with the request's spaces: under the interpreter its tiny spaces; a --search-space file's lists
    replace those of every space that has the name (checked against STAGE_RULES/ONE_STAGE_RULES here, before any
    work; a name in neither is an error)."""
    stage = dict(INTERPRETER_STAGE_SPACE) if device.interpreter else {}
    one_stage = dict(INTERPRETER_ONE_STAGE_SPACE) if device.interpreter else {}
    if req.space_file is not None:
        overrides = load_space_file(req.space_file, STAGE_RULES | ONE_STAGE_RULES)
        stage.update({name: values for name, values in overrides.items() if name in STAGE_RULES})
        one_stage.update({name: values for name, values in overrides.items() if name in ONE_STAGE_RULES})
    return FusedMoeTunable(err_ratio=req.err_ratio, stage_space=tuple(stage.items()) or None,
                           one_stage_space=tuple(one_stage.items()) or None)


def row_name(shape: FmoeShape) -> str:
    """'token=5 model_dim=96 inter_dim=80 expert=5 topk=2': how messages and summaries name a row."""
    s = shape
    return f"token={s.token} model_dim={s.model_dim} inter_dim={s.inter_dim} expert={s.expert} topk={s.topk}"


def _interpreter_fault(shape: FmoeShape) -> str | None:
    """`device.interpreter_cost_fault` of one row: the whole op's FLOPs, every expert's weights and the activations."""
    s = shape
    weights = s.expert * s.model_dim * s.inter_dim * (3 if s.use_g1u1 else 2)
    return interpreter_cost_fault(FusedMoeTunable().flops(MoeProblem(s, "1stage")), weights + s.token * s.model_dim)


def plan_rows(req: MoeTuneRequest, device: DeviceInfo) -> tuple[list[FmoeShape], list[FmoeShape]]:
    """(rows to tune, rows skipped as already tuned): reads and validates input and output (FmoeCsvError), and
    refuses (ValueError, one line) an input without rows, an output or profile path that cannot be written, and,
    without a GPU, a row far beyond what the interpreter finishes unless `req.allow_slow_interpreter`, then a row of
    dtype bf16 where the interpreter's tl.dot gets bf16 wrong (`interpreter_dot_fault`: every candidate would fail)."""
    if req.input.is_file() and not req.input.read_text(encoding="utf-8-sig", errors="replace").strip():
        raise ValueError(f"no rows to tune in {req.input} (the file is empty)")
    shapes = read_untuned(req.input)
    if not shapes:
        raise ValueError(f"no rows to tune in {req.input} (only a header)")
    for path in (req.output, req.profile_file):  # the journal goes beside the output
        if path is not None:
            check_writable(path)
    existing = read_tuned(req.output) if req.output.exists() else []
    numbered = list(enumerate(shapes, start=1))
    if req.last:
        numbered = numbered[-1:]
    done = {t.shape for t in existing if t.cu_num == device.cu_num}
    first: dict[FmoeShape, int] = {}  # identical input rows are tuned once, named by their first row
    for number, shape in numbered:
        first.setdefault(shape, number)
    todo, skipped = [], []
    for shape, number in first.items():
        if shape in done and not req.retune_all:
            skipped.append(shape)
            continue
        fault = _interpreter_fault(shape) if device.interpreter and not req.allow_slow_interpreter else None
        if fault is not None:
            raise ValueError(f"{req.input}: row {number} ({row_name(shape)}) without a GPU: {fault}; run `tritune "
                             "example` (a tiny interpreted row), tune on a GPU, or pass --allow-slow-interpreter")
        if device.interpreter and shape.dtype == "bf16":  # per_Token / per_1x128 rows of dtype bf16 fail it too
            from tritune.kernels.interpreter_probe import interpreter_dot_fault

            fault = interpreter_dot_fault(torch.bfloat16, "bf16")
            if fault is not None:
                raise ValueError(f"{req.input}: row {number} ({row_name(shape)}) of dtype bf16 without a GPU: "
                                 f"{fault}; use fp16 rows (as `tritune example` does) or tune on a GPU")
        todo.append(shape)
    return todo, skipped


def _name(p: MoeProblem, m: Measurement) -> str:
    """A stage or 1-stage candidate's kernel name (the profile file's kernelName)."""
    return config_of(m.config).name(p.kind, p.shape.quant, p.shape.act_type)


# Stage pairs re-timed end to end per row: the best pair of each of this many BLOCK_SIZE_M values (by the sum of their
# stage times). The stages are timed alone, and the whole op (sort, quantization, the two GEMMs on a shared sort,
# top-k sum, host cost) can rank pairs otherwise: on the H100, rows tuned at 4096 tokens ran 29-52% above their stage
# sums end to end while a 128-row pair the stage sums ranked lower ran faster. Only pairs within E2E_PAIR_SPREAD of
# the fastest stage sum are re-timed (a pair far behind on its stages does not win back that much end to end), and one
# pair under the interpreter, where times mean nothing and each re-time costs minutes.
E2E_PAIRS = 3
E2E_PAIR_SPREAD = 1.5


def choose(stage1: ProblemResult, stage2: ProblemResult, one: ProblemResult | None,
           pairs_max: int = E2E_PAIRS) -> list[Choice]:
    """The best stage pair of each BLOCK_SIZE_M both stages passed at (the `pairs_max` fastest by stage sum, within
    E2E_PAIR_SPREAD of the fastest) and the best 1-stage, fastest first (empty when nothing passed)."""
    def best_by_bm(r: ProblemResult) -> dict[int, Measurement]:
        out: dict[int, Measurement] = {}
        for m in r.measurements:
            bm = m.config["BLOCK_SIZE_M"]
            if m.ok and (bm not in out or m.time_us < out[bm].time_us):
                out[bm] = m
        return out

    b1, b2 = best_by_bm(stage1), best_by_bm(stage2)
    choices = []
    pairs = sorted(((b1[bm], b2[bm]) for bm in b1 if bm in b2), key=lambda p: p[0].time_us + p[1].time_us)
    for m1, m2 in pairs[:pairs_max]:
        if m1.time_us + m2.time_us > E2E_PAIR_SPREAD * (pairs[0][0].time_us + pairs[0][1].time_us):
            break
        choices.append(Choice((config_of(m1.config), config_of(m2.config)), m1.time_us, m1.error, m2.time_us,
                              m2.error))
    if one is not None and one.best is not None:
        choices.append(Choice((config_of(one.best.config), None), one.best.time_us, one.best.error))
    return sorted(choices, key=lambda c: c.us1 + c.us2)


# The end-to-end re-time also runs, for the fastest stage pair (by stage sum), its variant with the sorted
# intermediate read through TMA (MoeConfig.SORTED_INTER 2: stage 1 writes the intermediate in the sort's order, stage 2
# loads A contiguously through a descriptor). The stages are timed alone and cannot see the lever, so only the whole op
# decides: the variant is written only when it is faster end to end (a tie keeps the plain pair). Measured on the H100
# against the plain plan (benchmarks/RESULTS.md, 2026-11-26): 0.94-0.97x from 1024 tokens in bf16, 0.75-0.84x per_1x128
# at 1024 tokens, even at <= 64 tokens. Not varied: SORTED_INTER 1 (pointer loads; not measured alone) and TOPK_ATOMIC
# (1.04-1.12x slower from 2048 tokens: fp32 atomics into [T, D] cost more than the sum they replace).
E2E_LEVER_VARIANT = True
E2E_LEVER_UNDER_INTERPRETER = False  # a speed lever: not worth an interpreted re-time (tests switch it on)
# With it, the same variant with stage 2 persistent (MoeConfig.PERSISTENT, weights through TMA too), where stage 2
# can run so (16-bit or fp8 weights, one K split, no SWAP_AB). Measured on the H100 (RESULTS.md, 2026-11-26, the
# rule table's tiles, warm L2): stage 2 0.80-0.91x the time at E 128 top-8 I 384 (1024-8192 tokens), 0.99-1.02x at
# I 768 and 1536; a re-time per row, and only the whole op decides.
E2E_PERSISTENT_VARIANT = True


def lever_variant(plan: Plan, shape: FmoeShape, device: DeviceInfo) -> Plan | None:
    """The stage pair with SORTED_INTER 2 in both stages, or None where A cannot go through TMA (no TMA on the
    device, or intermediate rows that are not 16-byte multiples) or the device is Triton's interpreter."""
    a_bytes = 1 if shape.quant in FP8_QUANTS else 2
    if device.interpreter and not E2E_LEVER_UNDER_INTERPRETER:
        return None
    if shape.quant in MXFP4_QUANTS:  # the sorted intermediate has not run with MXFP4 weights on a GPU yet
        return None
    if is_fma(plan[0]):  # the multiply-add path takes no plan levers
        return None
    if not device.supports_tma or (shape.inter_dim * a_bytes) % 16:
        return None
    first, second = plan
    return dataclasses.replace(first, SORTED_INTER=2), dataclasses.replace(second, SORTED_INTER=2)


def persistent_variant(lever: Plan, shape: FmoeShape) -> Plan | None:
    """The lever variant `lever` (SORTED_INTER 2) with stage 2 persistent (PERSISTENT 1, its weights through TMA),
    or None where stage 2 cannot run so (fused_moe_config.check_config's conditions)."""
    first, second = lever
    persistent = dataclasses.replace(second, PERSISTENT=1, USE_TMA=1)
    try:
        check_config(persistent, "stage2", shape.quant)
    except ValueError:
        return None
    return first, persistent


def with_lever_variant(choices: list[Choice], shape: FmoeShape, device: DeviceInfo) -> list[Choice]:
    """`choices` and, last (so that a tie keeps the plain pair), the lever variants of the fastest stage pair (the
    sorted intermediate; with E2E_PERSISTENT_VARIANT also that with stage 2 persistent), which carry that pair's
    stage times (the stages were measured without the levers); unchanged when E2E_LEVER_VARIANT is off, no stage
    pair passed or the lever does not apply."""
    pair = next((c for c in choices if not c.one_stage), None)
    variant = lever_variant(pair.plan, shape, device) if E2E_LEVER_VARIANT and pair is not None else None
    if variant is None:
        return choices
    variants = [variant]
    persistent = persistent_variant(variant, shape) if E2E_PERSISTENT_VARIANT else None
    if persistent is not None:
        variants.append(persistent)
    return [*choices, *(Choice(v, pair.us1, pair.err1, pair.us2, pair.err2) for v in variants)]


# The end-to-end re-time also runs, on per_1x128 rows on Hopper with Gluon, the stage pair on the Gluon kernels
# (MoeConfig.GLUON, kernels/gluon_moe.py) on 128-row blocks (the rule table's) and on 64-row blocks: they need the
# plan levers (rows gathered, the sorted intermediate), so the stages alone cannot time them. H100 (RESULTS.md,
# twenty-sixth session): the 128-row pair 0.81-0.93x the Triton plan's time at 4096-8192 tokens where I >= 1024;
# alone, the 64-row stage kernels 0.85-0.96x the op's at E 64 I 1536 and 1024-8192 tokens.
E2E_GLUON_VARIANTS = True
# The persistent Gluon stage 2 (GLUON 1 with PERSISTENT 1; the rule's since the twenty-seventh session: 0.97-1.00x
# the whole op's time) joins them, alone and with the persistent stage 1 (0.98-1.04x: a row may still gain).
E2E_GLUON_PERSISTENT = True
# The rule's 128-row pair with stage 1 quantizing its own output (QUANT_OUT): 0.96-1.05x the op's time (H100,
# twenty-eighth session), so off.
E2E_GLUON_QUANT_OUT = False
# The 128-row pair with stage 1 fed by a loader warp group (WARP_SPEC, persistent, 6 stages; the rule's since the
# twenty-eighth session: 0.91-0.98x the whole op's time at E 64 and DeepSeek-V2-Lite, 4096-8192 tokens).
E2E_GLUON_WS = True
# Both stages fed by a loader warp group (stage 2 too: moe_stage2_ws_kernel; the rule's since the twenty-ninth session:
# 0.95-0.99x the whole op's time at E 64 and DeepSeek-V2-Lite, H200).
E2E_GLUON_WS2 = True
# That pair with stage 2 adding its rows into the tokens' rows (TOPK_ATOMIC; heuristics.GLUON_MOE_TOPK_ATOMIC):
# compiled for sm_90, not yet run on a GPU, so off; never under TRITUNE_DETERMINISTIC.
E2E_GLUON_TOPK_ATOMIC = False
_GLUON_PLAN = dict(BLOCK_SIZE_K=128, GROUP_SIZE_M=8, USE_TMA=1, SORTED_INTER=2, GATHER_A=1, GLUON=1)
GLUON_PAIRS = (  # (stage 1, stage 2): BLOCK_M 16 rows a warp; stage 1's BLOCK_N is its gate's (and up's) width
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, **_GLUON_PLAN)),
    # stage 2 persistent: only with E2E_GLUON_PERSISTENT
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1, **_GLUON_PLAN)),
    # both persistent (the rule's stage 1 is not: 0.98-1.04x the whole op's time where I >= 1024)
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, PERSISTENT=1, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1, **_GLUON_PLAN)),
    (MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=4, num_stages=4, **_GLUON_PLAN)),
    # stage 1 quantizing its own output: only with E2E_GLUON_QUANT_OUT
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, QUANT_OUT=1, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1, **_GLUON_PLAN)),
    # stage 1 fed by a loader warp group: only with E2E_GLUON_WS
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=6, PERSISTENT=1, WARP_SPEC=1,
               **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1, **_GLUON_PLAN)),
    # both: only with E2E_GLUON_WS2
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=6, PERSISTENT=1, WARP_SPEC=1,
               **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=6, PERSISTENT=1, WARP_SPEC=1,
               **_GLUON_PLAN)),
    # and stage 2 adding into the tokens' rows: only with E2E_GLUON_TOPK_ATOMIC
    (MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=6, PERSISTENT=1, WARP_SPEC=1,
               TOPK_ATOMIC=1, **_GLUON_PLAN),
     MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=6, PERSISTENT=1, WARP_SPEC=1,
               TOPK_ATOMIC=1, **_GLUON_PLAN)),
)


def gluon_variants(shape: FmoeShape, device: DeviceInfo) -> list[Plan]:
    """The Gluon stage pairs (`GLUON_PAIRS`) a row can run: per_1x128, gated SiLU with the routing weights in stage
    2, D and I multiples of 128, on a Hopper GPU with Triton's Gluon API; none elsewhere (or with the switch off)."""
    from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

    if not (E2E_GLUON_VARIANTS and HAS_GLUON_HOPPER and not device.interpreter and device.capability[0] == 9
            and shape.quant == "per_1x128" and shape.use_g1u1 and shape.act_type == "silu"
            and not shape.doweight_stage1 and shape.model_dim % 128 == 0 and shape.inter_dim % 128 == 0):
        return []
    return [pair for pair in GLUON_PAIRS if shape.inter_dim % pair[0].BLOCK_SIZE_N == 0
            and (E2E_GLUON_PERSISTENT or not pair[1].PERSISTENT) and (E2E_GLUON_QUANT_OUT or not pair[0].QUANT_OUT)
            and (E2E_GLUON_WS or not pair[0].WARP_SPEC) and (E2E_GLUON_WS2 or not pair[1].WARP_SPEC)
            and (not pair[1].TOPK_ATOMIC or (E2E_GLUON_TOPK_ATOMIC and not knobs.deterministic()))]


def with_gluon_variants(choices: list[Choice], shape: FmoeShape, device: DeviceInfo) -> list[Choice]:
    """`choices` and, last (a tie keeps what came first), the row's Gluon stage pairs (`gluon_variants`) not already
    among them, carrying the fastest stage pair's stage times (the stages alone cannot run them)."""
    pair = next((c for c in choices if not c.one_stage), None)
    if pair is None:
        return choices
    new = [v for v in gluon_variants(shape, device) if all(c.plan != v for c in choices)]
    return [*choices, *(Choice(v, pair.us1, pair.err1, pair.us2, pair.err2) for v in new)]


def rule_plan_applies(device: DeviceInfo) -> bool:
    """Whether the rule table's plan is re-timed: on a GPU (under the interpreter only where tests switch it on)."""
    return not device.interpreter or fused_moe_tunable.RULE_PLAN_UNDER_INTERPRETER


def with_rule_plan(choices: list[Choice], stage1: ProblemResult, stage2: ProblemResult, one: ProblemResult | None,
                   plan: Plan | None) -> list[Choice]:
    """`choices` and, last (so that a tie keeps the tuner's pick), the rule table's plan for the row (`rule_plan`;
    None where it does not apply) with its stages' measured times (the stage search always measures them), unless
    a choice already runs that plan or its stages did not pass."""
    if plan is None or any(c.plan == plan for c in choices):
        return choices

    def measured(result: ProblemResult | None, kernel: MoeConfig) -> Measurement | None:
        """The passing measurement of `kernel` (its searched fields) among `result`'s."""
        for m in result.measurements if result is not None else ():
            if m.ok and m.config.as_dict() == {name: getattr(kernel, name) for name in m.config.as_dict()}:
                return m
        return None

    first, second = plan
    if second is None:
        m1 = measured(one, first)
        return choices if m1 is None else [*choices, Choice(plan, m1.time_us, m1.error)]
    m1, m2 = measured(stage1, first), measured(stage2, second)
    if m1 is None or m2 is None:
        return choices
    return [*choices, Choice(plan, m1.time_us, m1.error, m2.time_us, m2.error)]


def why_nothing_chosen(stage1: ProblemResult, stage2: ProblemResult, one: ProblemResult | None) -> str:
    """Why `choose` found nothing, in each kind's own words (`ProblemResult.why_failed`): 'no stage pair and no
    1-stage winner (stage1: every candidate was pruned; ...)'."""
    causes = [f"{r.problem.kind}: {r.why_failed()}" for r in (stage1, stage2, one) if r is not None and r.best is None]
    if stage1.best is not None and stage2.best is not None:
        causes.insert(0, "stage 1 and stage 2 passed at no common BLOCK_SIZE_M")
    return f"no stage pair and no 1-stage winner ({'; '.join(causes)})"


def _tuned_row(shape: FmoeShape, choice: Choice, e2e: Measurement, tunable: FusedMoeTunable, problem: MoeProblem,
               device: DeviceInfo, objective: Objective) -> FmoeTuned:
    """The CSV row: `us` is the GPU time of the chosen kernels end to end; after the provenance columns come
    us_eager and us_graph (the op's per-call time as eager calls and as a CUDA-graph replay; empty when not
    measured) and `objective`, what chose between the stage pair and the 1-stage ("gpu" when neither had the
    objective's figure, so GPU time chose)."""
    cfg1, cfg2 = choice.plan
    ksplit = cfg1.KSPLIT if cfg2 is None else max(cfg1.KSPLIT, cfg2.KSPLIT)
    name1, name2 = plan_names(choice.plan, shape)
    seconds = e2e.time_us * 1e-6
    extra = (("device", device.name), ("triton", device.triton_version), ("torch", device.torch_version),
             ("routing", "uniform" if problem.skew == 0 else f"zipf{problem.skew:g}"),
             ("us_stages", f"{choice.us1 + choice.us2:.2f}"), ("rel_l2", f"{e2e.rel_l2_err:.3g}"),
             ("us_eager", _us(e2e.eager_us)), ("us_graph", _us(e2e.graph_us)),
             ("objective", objective.value if math.isfinite(e2e.objective_time(objective)) else "gpu"))
    return FmoeTuned(
        cu_num=device.cu_num, shape=shape, block_m=cfg1.BLOCK_SIZE_M, ksplit=ksplit,
        us1=choice.us1, kernelName1=name1, err1=_finite(choice.err1),
        us2=choice.us2, kernelName2=name2, err2=_finite(choice.err2),
        us=e2e.time_us, run_1stage=choice.one_stage,
        tflops=tunable.flops(problem) / seconds / 1e12, bw=tunable.bytes_moved(problem) / seconds / 1e9,
        extra=extra)


def _finite(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def _us(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else ""


def tune_fmoe(req: MoeTuneRequest, device: DeviceInfo, settings: TuneSettings,
              tunable: FusedMoeTunable | None = None,
              plan: tuple[list[FmoeShape], list[FmoeShape]] | None = None) -> MoeTuneReport:
    """Tune the request's rows and merge them into the output CSV (atomically; other rows kept).

    `plan` is `plan_rows(req, device)` when the caller already read and validated the files.
    """
    tunable = tunable or build_tunable(req, device)
    todo, skipped = plan or plan_rows(req, device)
    report = MoeTuneReport(skipped=skipped)
    if not todo:
        return report
    # TRITUNE_DETERMINISTIC: the op would pass over a 1-stage row (it sums with atomics), so none is tuned.
    kinds = ("stage1", "stage2") if knobs.deterministic() else ("stage1", "stage2", "1stage")
    problems = [MoeProblem(shape, kind, req.skew) for shape in todo for kind in kinds]
    # A stage alone is not what the user calls: only the end-to-end step below is timed as the op runs.
    first, e2e_settings = dataclasses.replace(settings, finalists=0), settings
    if settings.time_limit_s is not None:  # the stage search gets three quarters of the limit, the re-time the rest
        first = dataclasses.replace(first, time_limit_s=0.75 * settings.time_limit_s)
        e2e_settings = dataclasses.replace(settings, time_limit_s=0.25 * settings.time_limit_s)
    # One set of GPU workers and one compile pool for both passes (the re-time would otherwise start them again).
    clock = time.perf_counter()
    executor, pool = make_executor(tunable, device, settings), make_compile_pool(tunable, settings, device)
    pool.prestart()
    report.outside_s["start"] = time.perf_counter() - clock
    try:
        _search_and_retime(req, device, settings, first, e2e_settings, tunable, todo, problems, executor, pool,
                           report)
    finally:
        clock = time.perf_counter()
        pool.shutdown(cancel=True)
        executor.close()
        report.outside_s["close"] = time.perf_counter() - clock
        if report.summaries:  # the executor's lines once, under the last pass's summary
            report.summaries[-1].executor_lines += getattr(executor, "summary_lines", list)()
    clock = time.perf_counter()
    if report.written:
        with path_lock(req.output):
            existing = read_tuned(req.output) if req.output.exists() else []
            write_tuned(req.output, merge_tuned(existing, report.written))
    if req.profile_file is not None:
        write_profile(req.profile_file, report.results)
    report.outside_s["write"] = time.perf_counter() - clock
    return report


def _search_and_retime(req: MoeTuneRequest, device: DeviceInfo, settings: TuneSettings, first: TuneSettings,
                       e2e_settings: TuneSettings, tunable: FusedMoeTunable, todo: list[FmoeShape],
                       problems: list[MoeProblem], executor, pool, report: MoeTuneReport) -> None:
    """The stage search over every row, then each row's end-to-end re-time; results and rows into `report`."""
    results, summary = tune(tunable, problems, device, first, executor, pool)
    report.summaries.append(summary)
    report.results.extend(results)
    by = {(r.problem.shape, r.problem.kind): r for r in results}

    e2e_problems, choices = [], {}
    for shape in todo:
        kind_results = (by[(shape, "stage1")], by[(shape, "stage2")], by.get((shape, "1stage")))
        cs = choose(*kind_results, pairs_max=1 if device.interpreter else E2E_PAIRS)
        if not cs:
            report.failed.append((shape, why_nothing_chosen(*kind_results)))
            continue
        rule = rule_plan(shape, device) if rule_plan_applies(device) else None
        cs = with_gluon_variants(with_lever_variant(cs, shape, device), shape, device)
        cs = with_rule_plan(cs, *kind_results, rule)
        for c in cs:
            p = MoeProblem(shape, "e2e", req.skew, c.plan)
            choices[p.key()] = c
            e2e_problems.append(p)
            if c.plan == rule:
                report.rule_plans.add(p.key())
    if e2e_problems:
        e2e_results, e2e_summary = tune(tunable, e2e_problems, device, e2e_settings, executor, pool)
        report.summaries.append(e2e_summary)
        report.results.extend(e2e_results)
        for shape in todo:
            timed = [(r.best, choices[r.problem.key()], r.problem) for r in e2e_results
                     if r.problem.shape == shape and r.best is not None]
            if not timed:
                if not any(s == shape for s, _ in report.failed):
                    whys = "; ".join(r.why_failed() for r in e2e_results if r.problem.shape == shape)
                    report.failed.append((shape, f"the chosen kernels failed when re-timed end to end ({whys})"))
                continue
            objective = resolve_objective(settings.objective, [t[0] for t in timed])
            e2e, choice, problem = min(timed, key=lambda t: (t[0].objective_time(objective), t[0].time_us))
            report.written.append(_tuned_row(shape, choice, e2e, tunable, problem, device, objective))


def write_profile(path: Path, results: Sequence[ProblemResult]) -> None:
    """Every measured candidate of every kind (failures with their status and message), atomically."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(PROFILE_COLUMNS)
    for r in results:
        p: MoeProblem = r.problem
        s = p.shape
        for m in r.measurements:
            name = "+".join(n for n in p.names if n) if p.kind == "e2e" else _name(p, m)
            us = f"{m.time_us:.2f}" if m.ok else ""
            err = "" if math.isnan(m.error) else f"{100 * m.error:.4g}%"
            rel = "" if math.isnan(m.rel_l2_err) else f"{m.rel_l2_err:.3g}"
            writer.writerow([s.token, s.model_dim, s.inter_dim, s.expert, s.topk, s.act_type, s.dtype, s.q_type,
                             s.use_g1u1, s.doweight_stage1, p.kind, name, m.status.value, us, err, rel,
                             m.message.replace("\n", " ")[:300], _us(m.eager_us), _us(m.graph_us)])
    atomic_write_text(path, buf.getvalue())


def summary_lines(report: MoeTuneReport) -> list[str]:
    """One labelled block per row tuned (its candidates per kernel kind, then the end-to-end re-time of its stage
    pair and 1-stage winners), then the run's totals once, both engine passes together."""
    lines = []
    shapes = list(dict.fromkeys(r.problem.shape for r in report.results))
    for shape in shapes:
        lines.append(f"== row {row_name(shape)} ({shape.act_type}, {shape.dtype}, quant {shape.quant})")
        lines += ["  " + _kind_line(r, r.problem.key() in report.rule_plans) for r in report.results
                  if r.problem.shape == shape]
    if report.summaries:
        lines.append(f"== run: {len(shapes)} row(s), stage search and end-to-end re-time together")
        lines += ["  " + line for line in TuneSummary.total(report.summaries).lines()]
        if len(report.summaries) == 2:  # where a multi-GPU run's time goes: the re-time waits for the whole search
            search, retime = report.summaries
            lines.append(f"  passes: stage search {search.wall_s:.1f}s, end-to-end re-time {retime.wall_s:.1f}s; "
                         f"first candidate to a worker after {search.first_task_s:.1f}s and {retime.first_task_s:.1f}s")
    if report.outside_s:
        o = report.outside_s
        lines.append(f"  outside the passes: starting workers and pool {o.get('start', 0):.1f}s, closing them "
                     f"{o.get('close', 0):.1f}s, writing {o.get('write', 0):.1f}s")
    return lines


def _kind_line(r: ProblemResult, rule_plan: bool = False) -> str:
    """'stage1: 2 in the space, 0 pruned, 2 measured; best 12.3 us', 'e2e (stage pair): 1 measured; best ...'
    ('e2e (stage pair BM128, rule table)' for the rule table's plan)."""
    p: MoeProblem = r.problem
    failed = Counter(m.status.value for m in r.measurements if not m.ok)
    failures = (" (" + ", ".join(f"{n} {kind}" for kind, n in sorted(failed.items())) + ")") if failed else ""
    outcome = f"best {r.best.time_us:.1f} us" if r.best is not None else r.why_failed()
    if p.kind == "e2e":
        which = "1-stage" if not p.names[1] else f"stage pair BM{p.plan[0].BLOCK_SIZE_M}{p.lever_tag}"
        which += ", rule table" if rule_plan else ""
        return f"e2e ({which}): {len(r.measurements)} measured{failures}; {outcome}"
    return (f"{p.kind}: {r.space_size} in the space, {sum(r.pruned.values())} pruned, {len(r.measurements)} "
            f"measured{failures}; {outcome}")


def result_table(report: MoeTuneReport) -> list[str]:
    lines = [f"{'token':>6} {'D':>6} {'I':>6} {'E':>4} {'k':>2} {'quant':<10} {'GPU us':>9} {'eager us':>9} "
             f"{'graph us':>9} {'TFLOP/s':>8} {'GB/s':>7}  winner"]
    for t in report.written:
        s = t.shape
        win = t.kernelName1 if t.run_1stage else f"{t.kernelName1} + {t.kernelName2}"
        extra = dict(t.extra)
        lines.append(f"{s.token:>6} {s.model_dim:>6} {s.inter_dim:>6} {s.expert:>4} {s.topk:>2} {s.q_type:<10} "
                     f"{t.us:9.1f} {extra.get('us_eager', '-'):>9} {extra.get('us_graph', '-'):>9} {t.tflops:8.1f} "
                     f"{t.bw:7.0f}  {win}")
    for s, why in report.failed:
        lines.append(f"{s.token:>6} {s.model_dim:>6} {s.inter_dim:>6} {s.expert:>4} {s.topk:>2} {s.q_type:<10} "
                     f"{'FAILED':>9}  {why}")
    if report.skipped:
        lines.append(f"skipped {len(report.skipped)} row(s) already tuned for this device (--all to retune)")
    return lines
