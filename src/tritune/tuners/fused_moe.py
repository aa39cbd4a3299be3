"""The fused-MoE tuner: untuned CSV rows in, tuned CSV rows out (best stage pair sharing BLOCK_SIZE_M, or 1-stage).

Per row: every stage-1, stage-2 and 1-stage candidate is measured by GPU time (one engine run, so compiles and GPU
work overlap across rows); the stage pair minimising us1 + us2 per BLOCK_SIZE_M and the best 1-stage are then
re-timed end to end as the op the user calls (GPU time, eager calls and a CUDA-graph replay), and the one the
objective prefers among those that pass the gate is written.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritune.kernels.fused_moe import MoeConfig
from tritune.store.atomic import atomic_write_text, path_lock
from tritune.store.fmoe_csv import FmoeShape, FmoeTuned, merge_tuned, read_tuned, read_untuned, write_tuned
from tritune.tuners.fused_moe_tunable import FusedMoeTunable, MoeProblem, config_of
from tritune.tuning.device import DeviceInfo
from tritune.tuning.tuner import ProblemResult, TuneSettings, TuneSummary, tune
from tritune.tuning.types import Measurement, Objective

# Tiny blocks for Triton's interpreter (no GPU): a correctness run, not a performance one.
INTERPRETER_STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16,), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "GROUP_SIZE_M": (1,), "num_warps": (4,),
    "num_stages": (2,), "KSPLIT": (1, 2), "USE_TMA": (0,),
}
INTERPRETER_ONE_STAGE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16,), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "BLOCK_SIZE_D": (32,),
    "GROUP_SIZE_M": (1,), "num_warps": (4,), "num_stages": (2,),
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.err_ratio <= 1.0:
            raise ValueError(f"--errRatio {self.err_ratio} must lie in [0, 1]")
        if not (self.skew >= 0.0 and math.isfinite(self.skew)):
            raise ValueError(f"--skew {self.skew} must be a finite number >= 0")


@dataclass
class Choice:
    """The winner of one row before the end-to-end re-time."""

    names: tuple[str, str]
    us1: float
    err1: float
    us2: float = 0.0
    err2: float = 0.0

    @property
    def one_stage(self) -> bool:
        return not self.names[1]


@dataclass
class MoeTuneReport:
    written: list[FmoeTuned] = field(default_factory=list)
    skipped: list[FmoeShape] = field(default_factory=list)
    failed: list[tuple[FmoeShape, str]] = field(default_factory=list)
    summaries: list[TuneSummary] = field(default_factory=list)
    results: list[ProblemResult] = field(default_factory=list)


def build_tunable(req: MoeTuneRequest, device: DeviceInfo) -> FusedMoeTunable:
    if device.interpreter:
        return FusedMoeTunable(err_ratio=req.err_ratio, stage_space=tuple(INTERPRETER_STAGE_SPACE.items()),
                               one_stage_space=tuple(INTERPRETER_ONE_STAGE_SPACE.items()))
    return FusedMoeTunable(err_ratio=req.err_ratio)


def plan_rows(req: MoeTuneRequest, device: DeviceInfo) -> tuple[list[FmoeShape], list[FmoeShape]]:
    """(rows to tune, rows skipped as already tuned); reads and validates input and output, raising FmoeCsvError."""
    shapes = read_untuned(req.input)
    existing = read_tuned(req.output) if req.output.exists() else []
    if req.last:
        shapes = shapes[-1:]
    done = {t.shape for t in existing if t.cu_num == device.cu_num}
    todo, skipped = [], []
    for shape in dict.fromkeys(shapes):  # identical input rows are tuned once
        (skipped if shape in done and not req.retune_all else todo).append(shape)
    return todo, skipped


def _name(p: MoeProblem, m: Measurement) -> str:
    return config_of(m.config).name(p.kind, p.shape.q_type, p.shape.act_type)


def choose(stage1: ProblemResult, stage2: ProblemResult, one: ProblemResult | None) -> list[Choice]:
    """The best stage pair sharing BLOCK_SIZE_M and the best 1-stage, fastest first (empty when nothing passed)."""
    def best_by_bm(r: ProblemResult) -> dict[int, Measurement]:
        out: dict[int, Measurement] = {}
        for m in r.measurements:
            bm = m.config["BLOCK_SIZE_M"]
            if m.ok and (bm not in out or m.time_us < out[bm].time_us):
                out[bm] = m
        return out

    b1, b2 = best_by_bm(stage1), best_by_bm(stage2)
    choices = []
    pairs = [(b1[bm], b2[bm]) for bm in b1 if bm in b2]
    if pairs:
        m1, m2 = min(pairs, key=lambda p: p[0].time_us + p[1].time_us)
        choices.append(Choice((_name(stage1.problem, m1), _name(stage2.problem, m2)), m1.time_us, m1.error,
                              m2.time_us, m2.error))
    if one is not None and one.best is not None:
        choices.append(Choice((_name(one.problem, one.best), ""), one.best.time_us, one.best.error))
    return sorted(choices, key=lambda c: c.us1 + c.us2)


def _tuned_row(shape: FmoeShape, choice: Choice, e2e: Measurement, tunable: FusedMoeTunable, problem: MoeProblem,
               device: DeviceInfo, objective: Objective) -> FmoeTuned:
    """The CSV row: `us` is the GPU time of the chosen kernels end to end; after the provenance columns come
    us_eager and us_graph (the op's per-call time as eager calls and as a CUDA-graph replay; empty when not
    measured) and `objective`, what chose between the stage pair and the 1-stage ("gpu" when neither had the
    objective's figure, so GPU time chose)."""
    _, cfg1 = MoeConfig.parse_name(choice.names[0])
    ksplit = cfg1.KSPLIT
    if not choice.one_stage:
        ksplit = max(ksplit, MoeConfig.parse_name(choice.names[1])[1].KSPLIT)
    seconds = e2e.time_us * 1e-6
    extra = (("device", device.name), ("triton", device.triton_version), ("torch", device.torch_version),
             ("routing", "uniform" if problem.skew == 0 else f"zipf{problem.skew:g}"),
             ("us_stages", f"{choice.us1 + choice.us2:.2f}"), ("rel_l2", f"{e2e.rel_l2_err:.3g}"),
             ("us_eager", _us(e2e.eager_us)), ("us_graph", _us(e2e.graph_us)),
             ("objective", objective.value if math.isfinite(e2e.objective_time(objective)) else "gpu"))
    return FmoeTuned(
        cu_num=device.cu_num, shape=shape, block_m=cfg1.BLOCK_SIZE_M, ksplit=ksplit,
        us1=choice.us1, kernelName1=choice.names[0], err1=_finite(choice.err1),
        us2=choice.us2, kernelName2=choice.names[1], err2=_finite(choice.err2),
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
    kinds = ("stage1", "stage2", "1stage")
    problems = [MoeProblem(shape, kind, req.skew) for shape in todo for kind in kinds]
    # A stage alone is not what the user calls: only the end-to-end step below is timed as the op runs.
    first, e2e_settings = dataclasses.replace(settings, finalists=0), settings
    if settings.time_limit_s is not None:  # the stage search gets three quarters of the limit, the re-time the rest
        first = dataclasses.replace(first, time_limit_s=0.75 * settings.time_limit_s)
        e2e_settings = dataclasses.replace(settings, time_limit_s=0.25 * settings.time_limit_s)
    results, summary = tune(tunable, problems, device, first)
    report.summaries.append(summary)
    report.results.extend(results)
    by = {(r.problem.shape, r.problem.kind): r for r in results}

    e2e_problems, choices = [], {}
    for shape in todo:
        cs = choose(by[(shape, "stage1")], by[(shape, "stage2")], by.get((shape, "1stage")))
        if not cs:
            report.failed.append((shape, "no stage pair and no 1-stage candidate passed the correctness gate"))
            continue
        for c in cs:
            p = MoeProblem(shape, "e2e", req.skew, c.names)
            choices[p.key()] = c
            e2e_problems.append(p)
    if e2e_problems:
        e2e_results, e2e_summary = tune(tunable, e2e_problems, device, e2e_settings)
        report.summaries.append(e2e_summary)
        report.results.extend(e2e_results)
        for shape in todo:
            timed = [(r.best, choices[r.problem.key()], r.problem) for r in e2e_results
                     if r.problem.shape == shape and r.best is not None]
            if not timed:
                if not any(s == shape for s, _ in report.failed):
                    report.failed.append((shape, "the chosen kernels failed when re-timed end to end"))
                continue
            objective = settings.objective
            e2e, choice, problem = min(timed, key=lambda t: (t[0].objective_time(objective), t[0].time_us))
            report.written.append(_tuned_row(shape, choice, e2e, tunable, problem, device, objective))
    if report.written:
        with path_lock(req.output):
            existing = read_tuned(req.output) if req.output.exists() else []
            write_tuned(req.output, merge_tuned(existing, report.written))
    if req.profile_file is not None:
        write_profile(req.profile_file, report.results)
    return report


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
