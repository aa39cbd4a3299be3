"""`tritune example`, the main job: what it tunes and how long it times. On a GPU: every GEMM kernel over the shapes
file and the untuned fused-MoE rows of the example files. Without one: tiny odd shapes the interpreter finishes in
seconds, with a few timed runs only (interpreted timings mean nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tritune.kernels.gemm import KERNELS
from tritune.store.atomic import check_writable
from tritune.store.fmoe_csv import write_untuned
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe import MoeTuneRequest
from tritune.tuners.gemm import GemmShape, GemmTuneRequest, read_shapes_file
from tritune.tuning.tuner import TuneSettings

# Without a GPU: odd sizes (masked edges), fp16 operands (the interpreter's tl.dot is wrong on bf16 ones).
TINY_GEMM = GemmShape((1, 17), 96, 80)
TINY_FMOE = FmoeShape(token=5, model_dim=96, inter_dim=80, expert=5, topk=2, act_type="silu", dtype="fp16",
                      q_dtype_a="fp16", q_dtype_w="fp16", q_type="none", use_g1u1=True, doweight_stage1=False)
TINY_FMOE_FILE = "untuned_fmoe_tiny.csv"  # written into the output folder: the fused-MoE input without a GPU
INTERPRETER_ITERS, INTERPRETER_WARMUP = 3, 1  # at most, per candidate, without a GPU


@dataclass(frozen=True)
class ExamplePlan:
    """The runs of `tritune example`, in order: the GEMM requests, then the fused-MoE one."""

    gemm: tuple[GemmTuneRequest, ...]
    moe: MoeTuneRequest


def plan_example(output: Path, *, interpreted: bool, shapes: Path, moe_shapes: Path) -> ExamplePlan:
    """The example's runs into `output` (GEMM files in <output>/gemm, <output>/tuned_fmoe.csv). ValueError (one line)
    when `output` cannot be a folder, or (on a GPU) when a shapes file is bad. Without a GPU (`interpreted`) the
    files are not read: the tiny rows are tuned, their untuned CSV written to <output>/untuned_fmoe_tiny.csv."""
    output = Path(output)
    check_writable(output, folder=True)  # before the tiny input is written into it
    if interpreted:
        tiny = output / TINY_FMOE_FILE
        write_untuned(tiny, [TINY_FMOE])
        return ExamplePlan((GemmTuneRequest("bf16", (TINY_GEMM,), output / "gemm", dtype="fp16"),),
                           MoeTuneRequest(tiny, output / "tuned_fmoe.csv", retune_all=True))
    shape_list = tuple(read_shapes_file(shapes))
    return ExamplePlan(tuple(GemmTuneRequest(kernel, shape_list, output / "gemm") for kernel in KERNELS),
                       MoeTuneRequest(moe_shapes, output / "tuned_fmoe.csv",
                                      profile_file=output / "tuned_fmoe_profile.csv"))


def example_settings(settings: TuneSettings, interpreted: bool) -> TuneSettings:
    """The settings the example runs with: as given on a GPU; without one at most INTERPRETER_ITERS timed runs and
    INTERPRETER_WARMUP warm-ups per candidate (a new value: `settings` is not changed)."""
    if not interpreted:
        return settings
    bench = dataclasses.replace(settings.bench, iters=min(settings.bench.iters, INTERPRETER_ITERS),
                                warmup=min(settings.bench.warmup, INTERPRETER_WARMUP))
    return dataclasses.replace(settings, bench=bench)
