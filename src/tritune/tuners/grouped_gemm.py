"""The grouped-GEMM tuner: an MoE MLP shape in; every passing candidate of its gate_up/down forward, dX and dW
kernels against the torch baseline as one CSV; the best config per kernel merged into the device's store file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from tritune import knobs
from tritune.device import DeviceInfo, interpreter_cost_fault
from tritune.kernels.grouped_gemm_config import KernelConfig
from tritune.store.atomic import atomic_write_text, check_writable
from tritune.store.grouped_gemm_json import GroupedGemmEntry, read_entries, store_path, write_entries
from tritune.tuners.grouped_gemm_tunable import (
    DEFAULT_SPACE,
    DTYPES,
    GEMMS,
    INTERPRETER_SPACE,
    KERNELS,
    SPACE_RULES,
    GroupedGemmProblem,
    GroupedGemmShape,
    GroupedGemmTunable,
    kernel_config,
    torch_baseline,
)
from tritune.tuners.grouped_gemm_tuning import KernelResult
from tritune.tuning.bench import time_kernel
from tritune.tuning.space import load_space_file
from tritune.tuning.tuner import TuneSettings, tune
from tritune.tuning.types import Measurement

# (num_experts, topk, hidden_size, intermediate_size) of each model's MoE MLP.
MODEL_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
ZIPF_DEFAULT_SKEW = 1.2
# The CSV: which problem, the config class, every KernelConfig field (TMA fields of all three kernels and dW's
# GROUP_SIZE_N and scheduled; blank where a kernel has none), then the KernelResult times (microseconds) and
# speedup = torch_time / triton_time.
CSV_COLUMNS = ("gemm", "kernel", "config_class", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps",
               "num_stages", "flatten", "permute_x", "permute_y", "fuse_mul_post", "use_tma_store", "use_tma_load_x",
               "use_tma_load_w", "use_tma_load_dy", "GROUP_SIZE_N", "scheduled", "torch_time", "triton_time",
               "speedup")


@dataclass(frozen=True)
class GroupedGemmRequest:
    """What to tune and where the results go. `space` replaces lists of the default (or interpreter) space."""

    shape: GroupedGemmShape
    gemms: tuple[str, ...] = GEMMS
    kernels: tuple[str, ...] = KERNELS
    top_n: int = 10
    output: Path = Path("results.csv")
    store_dir: Path = Path("tritune-out/configs")
    space: tuple[tuple[str, tuple], ...] | None = None
    interpreter: bool = False
    allow_slow_interpreter: bool = False  # without a GPU, tune shapes beyond what the interpreter finishes quickly

    def __post_init__(self) -> None:
        for name, values, allowed in (("gemms", self.gemms, GEMMS), ("kernels", self.kernels, KERNELS)):
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise ValueError(f"{name} must be a non-empty subset of {', '.join(allowed)}, got {values!r}")
        if isinstance(self.top_n, bool) or not isinstance(self.top_n, int) or self.top_n < 0:
            raise ValueError(f"top_n must be an integer >= 0, got {self.top_n!r}")

    def problems(self) -> list[GroupedGemmProblem]:
        return [GroupedGemmProblem(self.shape, g, k) for g in GEMMS if g in self.gemms
                for k in KERNELS if k in self.kernels]


@dataclass
class GroupedGemmOutcome:
    """One kernel's results: every passing candidate as a KernelResult, the winner, the baseline."""

    problem: GroupedGemmProblem
    results: list[KernelResult] = field(default_factory=list)
    best: KernelResult | None = None
    torch_us: float = math.nan
    baseline: str = ""
    failed: int = 0  # candidates measured or compiled that did not pass (not KernelResults)
    pruned: int = 0
    why_failed: str = ""  # no winner: the one cause (ProblemResult.why_failed)


def preset_shape(model: str | None, *, num_experts: int | None, hidden_size: int | None,
                 intermediate_size: int | None, topk: int | None, seqlen: int, dtype: str,
                 skew: float) -> GroupedGemmShape:
    """A preset's dimensions with the explicit ones overriding them; ValueError naming the flag at fault."""
    dims = {"num_experts": num_experts, "topk": topk, "hidden_size": hidden_size,
            "intermediate_size": intermediate_size}
    if model is not None:
        if model not in MODEL_PRESETS:
            raise ValueError(f"--model {model!r} is not a preset; known: {', '.join(MODEL_PRESETS)}")
        for name, value in zip(dims, MODEL_PRESETS[model], strict=True):
            dims[name] = value if dims[name] is None else dims[name]
    missing = [f"--{name.replace('_', '-')}" for name, value in dims.items() if value is None]
    if missing:
        raise ValueError(f"give --model or all of --num-experts, --hidden-size, --intermediate-size, --topk "
                         f"(missing {', '.join(missing)})")
    if dims["topk"] > dims["num_experts"]:
        raise ValueError(f"--topk {dims['topk']} exceeds --num-experts {dims['num_experts']}")
    return GroupedGemmShape(seqlen=seqlen, dtype=dtype, skew=skew, **dims)


def routing_skew(routing: str | None, skew: float | None) -> float:
    """The Zipf exponent: uniform is 0; zipf defaults to ZIPF_DEFAULT_SKEW; --skew alone implies zipf."""
    if skew is not None and not (math.isfinite(skew) and skew >= 0):
        raise ValueError(f"--skew {skew!r} must be a finite number >= 0")
    if routing == "uniform":
        if skew:
            raise ValueError(f"--skew {skew:g} needs --routing zipf (uniform routing has no skew)")
        return 0.0
    if routing not in (None, "zipf"):
        raise ValueError(f"--routing {routing!r} must be uniform or zipf")
    if routing == "zipf" and skew is None:
        return ZIPF_DEFAULT_SKEW
    return skew or 0.0


def parse_names(text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    """'gate_up,down' -> ('gate_up', 'down'); case-insensitive; ValueError naming the flag and the bad item."""
    by_lower = {name.lower(): name for name in allowed}
    items = [t.strip() for t in text.split(",")]
    out = []
    for item in items:
        if item.lower() not in by_lower:
            raise ValueError(f"{flag}: {item!r} in {text!r} is not one of {', '.join(allowed)}")
        out.append(by_lower[item.lower()])
    return tuple(dict.fromkeys(out))


def default_store_dir() -> Path:
    """TRITUNE_CONFIG_DIR when set (it must exist), else ./tritune-out/configs."""
    return knobs.config_dir() or Path("tritune-out/configs")


def space_from_file(path: str | Path) -> tuple[tuple[str, tuple], ...]:
    """A --search-space JSON file as space overrides; ValueError naming the file and the bad entry (every name and
    value checked against SPACE_RULES)."""
    return tuple(sorted(load_space_file(path, SPACE_RULES).items()))


def build_tunable(req: GroupedGemmRequest) -> GroupedGemmTunable:
    """The tunable with the request's space: its overrides replace lists of the default space, or of the
    interpreter space under the interpreter (so a partial --search-space file never brings back the full lists)."""
    overrides: dict[str, tuple] = dict(INTERPRETER_SPACE) if req.interpreter else {}
    overrides.update(dict(req.space or ()))
    unknown = sorted(set(overrides) - set(DEFAULT_SPACE))
    if unknown:
        raise ValueError(f"unknown search-space parameter(s) {unknown}; known: {sorted(DEFAULT_SPACE)}")
    return GroupedGemmTunable(space_params=tuple(sorted(overrides.items())) if overrides else None)


def check_interpreter_cost(req: GroupedGemmRequest, device: DeviceInfo) -> None:
    """Without a GPU, refuse (ValueError naming the kernel and what to run instead) a kernel far beyond what the
    interpreter finishes (`device.interpreter_cost_fault`), unless `req.allow_slow_interpreter`; then operands the
    interpreter's tl.dot gets wrong (bf16 on Triton 3.9: `interpreter_dot_fault`), which would fail every candidate
    whatever the flag."""
    if not device.interpreter:
        return
    tunable = GroupedGemmTunable()
    for p in req.problems() if not req.allow_slow_interpreter else ():
        elements = tunable.bytes_moved(p) / DTYPES[p.shape.dtype].itemsize
        fault = interpreter_cost_fault(tunable.flops(p), elements)
        if fault is not None:
            raise ValueError(f"grouped GEMM {p.gemm} {p.kernel} (N={p.n}, K={p.k}, {p.shape.pairs} pairs) without a "
                             f"GPU: {fault}; pass a smaller --seqlen and explicit sizes, tune on a GPU, or pass "
                             "--allow-slow-interpreter")
    if req.shape.dtype == "bf16":
        from tritune.kernels.interpreter_probe import interpreter_dot_fault

        fault = interpreter_dot_fault(torch.bfloat16, "bf16")
        if fault is not None:
            raise ValueError(f"--dtype bf16 without a GPU: {fault}; pass --dtype fp16 or tune on a GPU")


def check_existing_outputs(req: GroupedGemmRequest, device: DeviceInfo) -> None:
    """Refuse to start when an output cannot be written (the CSV, the store folder) or the store file we would
    merge into is unreadable."""
    check_writable(req.output)
    check_writable(req.store_dir, folder=True)
    path = store_path(req.store_dir, device.name)
    if path.exists():
        read_entries(path)  # raises ValueError naming the file and the field


def _baseline(problem: GroupedGemmProblem, device: DeviceInfo, settings: TuneSettings) -> tuple[float, str]:
    """Median microseconds of the torch baseline on this process's device, explicit permutes included."""
    where = torch.device("cpu") if device.interpreter or not torch.cuda.is_available() else torch.device("cuda")
    tunable = GroupedGemmTunable()
    inputs = tunable.make_inputs(problem, where, settings.bench.seed)
    bench = settings.bench
    grouped_mm = (where.type == "cuda" and device.capability >= (9, 0) and hasattr(torch, "_grouped_mm"))
    if grouped_mm:
        fn = torch_baseline(problem, inputs, use_grouped_mm=True)
        try:
            fn()
        except (RuntimeError, TypeError, ValueError):  # dtype or layout torch._grouped_mm does not take
            grouped_mm = False
    if not grouped_mm:
        fn = torch_baseline(problem, inputs, use_grouped_mm=False)
    timing = time_kernel(fn, iters=bench.iters, warmup=bench.warmup, flush_l2=bench.flush_l2,
                         l2_bytes=device.l2_bytes)
    name = "torch._grouped_mm" if grouped_mm else "torch loop over experts"
    return timing.median_us, f"{name} + torch permute"


def _csv_frame(outcomes: Sequence[GroupedGemmOutcome]) -> pd.DataFrame:
    frames = []
    for o in outcomes:
        frame = KernelResult.to_dataframe(o.results).rename(columns={"kernel": "config_class"})
        frame.insert(0, "kernel", o.problem.kernel)
        frame.insert(0, "gemm", o.problem.gemm)
        frames.append(frame.reindex(columns=list(CSV_COLUMNS)))
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=list(CSV_COLUMNS))
    return pd.concat(frames, ignore_index=True)


def _entry(o: GroupedGemmOutcome, m: Measurement, device: DeviceInfo) -> GroupedGemmEntry:
    p, s = o.problem, o.problem.shape
    return GroupedGemmEntry(triton=device.triton_version, num_experts=s.num_experts, n=p.n, k=p.k, topk=s.topk,
                            dtype=s.dtype, gemm=p.gemm, kernel=p.kernel, tokens=s.seqlen,
                            config=kernel_config(p, m.config).to_dict(), us=m.time_us, torch_us=o.torch_us,
                            baseline=o.baseline, provenance=device.provenance())


def _heading(o: GroupedGemmOutcome) -> str:
    p = o.problem
    return (f"== {p.gemm} {p.kernel} (N={p.n}, K={p.k}, {p.shape.dtype}): torch {o.torch_us:.2f} us "
            f"({o.baseline}); {len(o.results)} passed, {o.failed} failed, {o.pruned} pruned")


def tune_grouped_gemm(request: GroupedGemmRequest, device: DeviceInfo, settings: TuneSettings,
                      tunable: GroupedGemmTunable | None = None) -> list[GroupedGemmOutcome]:
    """Tune the requested kernels; print each kernel's top `top_n` and the run summary; write every passing
    candidate to `request.output` (one CSV, atomically) and each kernel's winner into the device's store file
    in `request.store_dir` (merged, tokens = seqlen). Times are microseconds; a candidate with fuse_permute
    False is timed with its torch permute. Returns one outcome per kernel, in gate_up, down x forward, dX, dW
    order.
    """
    tunable = tunable or build_tunable(request)
    check_interpreter_cost(request, device)
    check_existing_outputs(request, device)
    problems = request.problems()
    results, summary = tune(tunable, problems, device, settings)
    outcomes = []
    winners: list[tuple[GroupedGemmOutcome, Measurement]] = []
    for r in results:
        o = GroupedGemmOutcome(r.problem, pruned=sum(r.pruned.values()), why_failed=r.why_failed())
        o.torch_us, o.baseline = _baseline(r.problem, device, settings)
        for m in r.measurements:
            if not m.ok:
                o.failed += 1
                continue
            result = KernelResult(o.torch_us, m.time_us, kernel_config(r.problem, m.config))
            o.results.append(result)
            if m is r.best:
                o.best = result
        if r.best is not None and r.best.ok:
            winners.append((o, r.best))
        outcomes.append(o)
        print(_heading(o))
        KernelResult.print_table(o.results, num_results=request.top_n)
    print("\n".join(summary.lines()))
    atomic_write_text(request.output, _csv_frame(outcomes).to_csv(index=False))
    if winners:
        write_entries(store_path(request.store_dir, device.name), [_entry(o, m, device) for o, m in winners],
                      device=device.name)
    return outcomes


def result_lines(outcomes: Sequence[GroupedGemmOutcome]) -> list[str]:
    """One line per kernel: the winner's time, speedup over torch and config, or why there is none."""
    lines = []
    for o in outcomes:
        name = f"{o.problem.gemm} {o.problem.kernel}"
        if o.best is None:
            lines.append(f"{name:<16} FAILED: {o.why_failed}")
            continue
        lines.append(f"{name:<16} {o.best.triton_time:10.2f} us  x{o.best.speedup:.2f} vs torch  "
                     f"{_label(o.best.kernel_config)}")
    return lines


def failure(outcomes: Sequence[GroupedGemmOutcome]) -> str:
    """'' when every kernel has a winner, else one line naming each failed kernel and its one cause (the result
    lines' words)."""
    failed = [o for o in outcomes if o.best is None]
    if not failed:
        return ""
    return f"no config for {len(failed)} kernel(s): " + "; ".join(
        f"{o.problem.gemm} {o.problem.kernel} ({o.why_failed})" for o in failed)


def _label(config: KernelConfig) -> str:
    return config.to_string(include_tuning_params=True, include_tma=True)
