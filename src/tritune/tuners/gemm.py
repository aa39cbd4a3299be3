"""The GEMM tuner: shapes in, per-device JSON files with M buckets out (shape files plus the device default), one
family of files per output dtype."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tritune.device import DeviceInfo, interpreter_cost_fault
from tritune.kernels.gemm import KERNELS, OUT_DTYPES
from tritune.store.atomic import check_writable
from tritune.store.gemm_json import (
    GemmEntry,
    default_file_name,
    read_gemm_file,
    shape_file_name,
    write_default_file,
    write_shape_file,
)
from tritune.tuners.gemm_tunable import SPACE_RULES, GemmProblem, GemmTunable
from tritune.tuning.report import ProblemResult, TuneSummary
from tritune.tuning.space import load_space_file
from tritune.tuning.tuner import TuneSettings, tune

# Tiny blocks for Triton's interpreter (no GPU): a correctness run, not a performance one.
INTERPRETER_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32), "BLOCK_SIZE_N": (32,), "BLOCK_SIZE_K": (32,), "GROUP_SIZE_M": (1,),
    "num_warps": (4,), "num_stages": (2,), "NUM_KSPLIT": (1, 2), "cache_modifier": ("",), "PERSISTENT_TMA": (False,),
    "SCALE_PIPELINE": (False,), "TAIL_SPLIT": (False,), "GLUON": (False,), "WARP_SPECIALIZE": (False,),
}


@dataclass(frozen=True)
class GemmShape:
    """One line of a shapes file: a list of M values tuned for one (N, K)."""

    Ms: tuple[int, ...]
    N: int
    K: int


def parse_m_list(text: str, where: str = "--m") -> tuple[int, ...]:
    """'16,32,64' -> (16, 32, 64); raises ValueError naming the bad item."""
    items = [t.strip() for t in text.replace(";", ",").split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"{where}: malformed M list {text!r} (expected comma-separated positive integers)")
    out = []
    for item in items:
        if not (item.isascii() and item.isdigit()) or int(item) < 1:
            raise ValueError(f"{where}: M value {item!r} in {text!r} is not a positive integer")
        out.append(int(item))
    return tuple(sorted(set(out)))


def _positive(text: str, where: str) -> int:
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{where}: {text!r} is not a positive integer")
    return int(text)


def read_shapes_file(path: str | Path) -> list[GemmShape]:
    """CSV with header `M,N,K`; M is a quoted list ("16,32,64"). Lines starting with # are comments."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read shapes file ({exc.strerror or exc})") from None
    rows = []  # (line number in the file, cells)
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#") or not line.strip():
            continue
        rows.append((lineno, next(csv.reader([line]))))
    if not rows:
        raise ValueError(f"no rows to tune in {path} (the file is empty)")
    if [c.strip() for c in rows[0][1]] != ["M", "N", "K"]:
        where = rows[0][0] if rows else 1
        raise ValueError(f"{path}: row {where}: expected the header M,N,K")
    shapes = []
    for i, row in rows[1:]:
        if len(row) != 3:
            raise ValueError(f"{path}: row {i}: expected 3 columns M,N,K, got {len(row)}: {row!r}")
        shapes.append(GemmShape(parse_m_list(row[0], f"{path}: row {i}, column M"),
                                _positive(row[1], f"{path}: row {i}, column N"),
                                _positive(row[2], f"{path}: row {i}, column K")))
    if not shapes:
        raise ValueError(f"no rows to tune in {path} (only a header)")
    return shapes


@dataclass(frozen=True)
class GemmTuneRequest:
    kernel: str
    shapes: tuple[GemmShape, ...]
    out_dir: Path
    dtype: str = "bf16"
    atol: float = 1e-2
    rtol: float = 1e-2
    max_mismatch_ratio: float = 1e-3
    space_file: Path | None = None
    allow_slow_interpreter: bool = False  # without a GPU, tune shapes beyond what the interpreter finishes quickly
    out_dtype: str = "bf16"  # C's dtype: "bf16" or "fp16"; it names the files ("-OUT_FP16") and the journal keys

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; expected one of {', '.join(KERNELS)}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"unknown out_dtype {self.out_dtype!r}; expected one of {', '.join(OUT_DTYPES)}")


@dataclass
class GemmTuneReport:
    results: list[ProblemResult]
    summary: TuneSummary
    files: list[Path]
    failed_problems: list[GemmProblem]

    def failure(self) -> str:
        """'' when every problem has a winner, else one line with each failed problem and its one cause (the result
        table's words): 'no config for 1 problem(s): gemm:bf16:...:K=48 (every candidate was pruned)'."""
        failed = [r for r in self.results if r.best is None]
        if not failed:
            return ""
        return (f"no config for {len(failed)} problem(s): "
                + "; ".join(f"{r.problem.key()} ({r.why_failed()})" for r in failed))


def build_tunable(req: GemmTuneRequest, device: DeviceInfo) -> GemmTunable:
    # Under the interpreter a --search-space file replaces lists of the interpreter's space (a partial file never brings
    # back the full default lists); its names and values are checked against SPACE_RULES here, before any work.
    overrides = dict(INTERPRETER_SPACE) if device.interpreter else {}
    if req.space_file:
        overrides.update(load_space_file(req.space_file, SPACE_RULES))
    space_params = tuple(sorted(overrides.items())) if overrides else None
    tunable = GemmTunable(space_params=space_params, atol=req.atol, rtol=req.rtol,
                          max_mismatch_ratio=req.max_mismatch_ratio)
    if overrides:  # validate names now, before any work starts
        try:
            tunable.space(GemmProblem(req.kernel, 1, 1, 1, req.dtype, req.out_dtype), device)
        except ValueError as exc:
            raise ValueError(f"{req.space_file or 'interpreter space'}: {exc}") from None
    return tunable


def check_interpreter_cost(req: GemmTuneRequest, device: DeviceInfo) -> None:
    """Without a GPU, refuse (ValueError naming the shape and what to run instead) a shape whose largest M is far
    beyond what the interpreter finishes (`device.interpreter_cost_fault`), unless `req.allow_slow_interpreter`; then
    operands the interpreter's tl.dot gets wrong (bf16 on Triton 3.9: `interpreter_dot_fault`), which would fail
    every candidate whatever the flag."""
    if not device.interpreter:
        return
    for s in req.shapes if not req.allow_slow_interpreter else ():
        M = max(s.Ms)
        fault = interpreter_cost_fault(2.0 * M * s.N * s.K, M * s.K + s.N * s.K + M * s.N)
        if fault is not None:
            raise ValueError(f"GEMM M={M} N={s.N} K={s.K} without a GPU: {fault}; run `tritune example` (tiny "
                             "interpreted shapes), tune on a GPU, or pass --allow-slow-interpreter")
    if req.kernel == "bf16" and req.dtype == "bf16":  # the fp8 kernels' operands are fp8: the interpreter's are right
        from tritune.kernels.interpreter_probe import interpreter_dot_fault

        fault = interpreter_dot_fault(torch.bfloat16, "bf16")
        if fault is not None:
            raise ValueError(f"--dtype bf16 without a GPU: {fault}; pass --dtype fp16 (the same kernel and files) or "
                             "tune on a GPU")


def check_existing_outputs(req: GemmTuneRequest, device: DeviceInfo) -> None:
    """Refuse to start when the output folder cannot be written or a results file we would merge into is unreadable
    (before any tuning work)."""
    check_writable(req.out_dir, folder=True)
    tag = GemmProblem(req.kernel, 1, 1, 1, req.dtype).tag
    names = [shape_file_name(device.slug, tag, s.N, s.K, req.out_dtype) for s in req.shapes]
    names.append(default_file_name(device.slug, tag, req.out_dtype))
    for name in names:
        path = req.out_dir / name
        if path.exists():
            read_gemm_file(path)  # raises ValueError naming the file and what is wrong


def tune_gemm(req: GemmTuneRequest, device: DeviceInfo, settings: TuneSettings,
              tunable: GemmTunable | None = None) -> GemmTuneReport:
    """Tune every (M, N, K), then write one JSON per (N, K) and the device default for the kernel's tag and the
    request's output dtype.

    `tunable` is `build_tunable(req, device)` when a caller already made (and validated) it.
    """
    tunable = tunable or build_tunable(req, device)
    check_interpreter_cost(req, device)
    check_existing_outputs(req, device)
    problems = [GemmProblem(req.kernel, M, s.N, s.K, req.dtype, req.out_dtype) for s in req.shapes for M in s.Ms]
    results, summary = tune(tunable, problems, device, settings)
    entries: dict[tuple[int, int], dict[int, GemmEntry]] = defaultdict(dict)
    failed = []
    for r in results:
        p: GemmProblem = r.problem
        if r.best is None:
            failed.append(p)
            continue
        seconds = r.best.time_us * 1e-6
        entries[(p.N, p.K)][p.M] = GemmEntry(
            M=p.M, config=r.best.config, time_us=r.best.time_us,
            tflops=tunable.flops(p) / seconds / 1e12, gbps=tunable.bytes_moved(p) / seconds / 1e9,
            error=r.best.error if not math.isnan(r.best.error) else 0.0,
            eager_us=r.best.eager_us, graph_us=r.best.graph_us)
    files = []
    tag = problems[0].tag
    provenance = device.provenance()
    for (N, K), by_m in sorted(entries.items()):
        files.append(write_shape_file(req.out_dir, provenance, tag, N, K, by_m, device_slug=device.slug,
                                      out_dtype=req.out_dtype))
    if entries:
        files.append(write_default_file(req.out_dir, provenance, tag, device_slug=device.slug, out_dtype=req.out_dtype))
    return GemmTuneReport(results, summary, files, failed)


def result_table(results: Sequence[ProblemResult], tunable_flops) -> list[str]:
    """One line per problem: the winner's GPU time (us), its eager and CUDA-graph per-call times (the op as the user
    calls it; '-' when not measured), TFLOP/s from the GPU time, and its config."""
    lines = [f"{'problem':<44} {'GPU us':>9} {'eager us':>9} {'graph us':>9} {'TFLOP/s':>8}  config"]
    for r in results:
        if r.best is None:
            lines.append(f"{r.problem.key():<44} {'FAILED':>9} {'-':>9} {'-':>9} {'-':>8}  {r.why_failed()}")
            continue
        tflops = tunable_flops(r.problem) / (r.best.time_us * 1e-6) / 1e12
        eager, graph = (f"{t:9.1f}" if math.isfinite(t) else f"{'-':>9}" for t in (r.best.eager_us, r.best.graph_us))
        lines.append(f"{r.problem.key():<44} {r.best.time_us:9.1f} {eager} {graph} {tflops:8.1f}  {r.best.config}")
    return lines
