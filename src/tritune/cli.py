"""`tritune` command line: parses flags and calls library functions; no tuning logic lives here."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_STARTED = time.perf_counter()  # about when the command started (this module is its first import)
# perf_counter() when main() had asked the driver for a GPU (and started the fork server) and when torch was imported:
# the split of "before the tune" (issue 17's fixed cost, all "imports" on 4 H200s: 3.8-5.8 s).
_MARKS: dict[str, float] = {}

INTERPRETER_LABEL = "interpreter: correctness only, timings meaningless"


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input on one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"tritune: error: {message}\n")
        raise SystemExit(2)


def _fail(message: str) -> int:
    sys.stderr.write(f"tritune: error: {message}\n")
    return 2


def _use_interpreter_without_gpu() -> bool:
    """Must run before any tritune kernel module is imported: Triton reads TRITON_INTERPRET at decoration."""
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _early_stop_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value == 0 or 1 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 0 (off) nor a factor above 1")
    return value


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iters", type=_positive_int, default=30, help="timed runs per candidate (median reported)")
    p.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed runs before timing")
    p.add_argument("--early-stop", type=_early_stop_factor, default=1.5, metavar="FACTOR",
                   help="time a candidate 10 runs first and stop there when even its fastest is over FACTOR x the "
                        "best median of its problem so far (default 1.5; 0: every candidate gets --iters runs)")
    p.add_argument("--timeout", type=_positive_float, default=60.0, help="seconds per candidate before it is killed")
    p.add_argument("--mp", type=_positive_int, default=None, help="GPU workers (default: every visible GPU)")
    p.add_argument("--compile-workers", type=_positive_int, default=None, help="compile processes (default: all)")
    p.add_argument("--compile-lead", type=_non_negative_int, default=0, metavar="N",
                   help="compile only as fast as the GPUs consume: with N compiled candidates waiting per GPU worker, "
                        "one compile at a time, fewer waiting, proportionally more (default 0: every compile process "
                        "whenever there is work)")
    p.add_argument("--strategy", default="exhaustive", choices=("exhaustive", "random", "neighbourhood"))
    p.add_argument("--budget", type=_positive_int, default=None, help="candidates per problem (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--allow-slow-interpreter", action="store_true",
                   help="without a GPU, tune shapes far beyond the tiny examples through Triton's interpreter anyway "
                        "(refused by default: minutes to hours per candidate)")
    p.add_argument("--objective", default="auto", choices=("auto", "eager", "graph"),
                   help="what picks the winner among the finalists: eager (per-call time of back-to-back eager calls, "
                        "host launch cost included), graph (GPU time of a CUDA-graph replay) or auto (default: graph "
                        "time where the finalists' host cost is at least half their GPU time, so the eager figure "
                        "would measure host noise; eager time elsewhere)")
    p.add_argument("--executor", default="local", choices=("local", "ray"),
                   help="where candidates are benchmarked: local (this machine's GPUs; default) or ray (every GPU of a "
                        "Ray cluster, one run per GPU model; pip install 'tritune[ray]')")
    p.add_argument("--ray-address", help="Ray cluster to join, e.g. head-node:6379 (default: RAY_ADDRESS, else a Ray "
                                         "started on this machine)")
    p.add_argument("--ray-device", help="with --executor ray on a cluster of several GPU models: tune only this one "
                                        "(default: each in turn)")
    p.add_argument("--ray-resource", default="GPU",
                   help="Ray resource each benchmark actor holds one unit of (default GPU; a custom resource stands in "
                        "for GPUs on a cluster without them)")
    p.add_argument("--finalists", type=_non_negative_int, default=5,
                   help="fastest candidates by GPU time per problem re-timed as the op runs (default 5; 0: GPU time "
                        "alone picks)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tritune", description="Autotune Triton GEMM, MoE and grouped-GEMM kernels.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("gemm", help="tune GEMM kernels; writes {device}-GEMM-{TAG}-N=..-K=...json")
    g.add_argument("--kernel", required=True, help="bf16, a8w8 or a8w8_blockscale")
    g.add_argument("--m", help="comma-separated M values, e.g. 16,32,64")
    g.add_argument("--n", type=_positive_int)
    g.add_argument("--k", type=_positive_int)
    g.add_argument("--shapes", type=Path, help="CSV file with header M,N,K (M a quoted list) instead of --m/--n/--k")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="operands of the bf16 kernel")
    g.add_argument("--out-dtype", default="bf16", choices=("bf16", "fp16"),
                   help="C's dtype; fp16 tunes go to their own files, {device}-GEMM-{TAG}-OUT_FP16-N=..-K=...json")
    g.add_argument("--atol", type=float, default=1e-2)
    g.add_argument("--rtol", type=float, default=1e-2)
    g.add_argument("--err-ratio", type=float, default=1e-3, help="fraction of elements allowed outside atol/rtol")
    g.add_argument("--search-space", type=Path, help="JSON {param: [values]} replacing the default lists")
    g.add_argument("-o", "--output", type=Path, default=Path("tritune-out/gemm"), help="output folder")
    _add_engine_flags(g)

    m = sub.add_parser("moe", help="tune fused-MoE kernels: untuned CSV rows in, tuned CSV rows out (aiter format)")
    m.add_argument("-i", "--input", type=Path, required=True, help="untuned CSV (token, model_dim, inter_dim, ...)")
    m.add_argument("-o", "--output", type=Path, default=Path("tuned_fmoe.csv"), help="tuned CSV, merged into")
    m.add_argument("--last", action="store_true", help="tune only the last input row")
    m.add_argument("--all", dest="retune_all", action="store_true",
                   help="retune rows already in the output for this device")
    m.add_argument("--profile_file", "--profile-file", dest="profile_file", type=Path,
                   help="CSV of every candidate measured (stage 1, stage 2, 1-stage, end to end), failures included")
    m.add_argument("--errRatio", "--err-ratio", dest="err_ratio", type=float, default=0.5,
                   help="fraction of output elements allowed outside atol/rtol (NaN/Inf, unwritten rows and the "
                        "relative L2 bound are always enforced)")
    m.add_argument("--skew", type=float, default=0.0,
                   help="routing while tuning: 0 uniform (default), > 0 Zipf over experts with this exponent")
    m.add_argument("--search-space", type=Path,
                   help="JSON {param: [values]}: each list replaces that parameter's in the stage and 1-stage spaces "
                        "that have it (without a GPU: the interpreter's)")
    _add_engine_flags(m)

    e = sub.add_parser("example", help="the main job: tune the shipped example shapes (tiny, interpreted, on CPU)")
    e.add_argument("-o", "--output", type=Path, default=Path("tritune-out"))
    e.add_argument("--shapes", type=Path, default=Path("examples/gemm_shapes.csv"),
                   help="GEMM shapes on a GPU (without one the tiny interpreted example runs instead)")
    e.add_argument("--moe-shapes", type=Path, default=Path("examples/untuned_fmoe.csv"),
                   help="untuned fused-MoE rows on a GPU (without one the tiny interpreted example runs instead)")
    _add_engine_flags(e)

    gg = sub.add_parser("grouped-gemm", help="tune the grouped-GEMM kernels of an MoE MLP (forward, dX, dW); "
                                             "writes a CSV of every passing config and {device}-GROUPED_GEMM.json")
    gg.add_argument("--model", help="preset: qwen3-30b-a3b, mixtral-8x7b or gpt-oss-20b "
                                    "(explicit --num-experts/--hidden-size/--intermediate-size/--topk override it)")
    gg.add_argument("--num-experts", type=_positive_int)
    gg.add_argument("--hidden-size", type=_positive_int)
    gg.add_argument("--intermediate-size", type=_positive_int)
    gg.add_argument("--topk", type=_positive_int)
    gg.add_argument("--seqlen", type=_positive_int, default=1024, help="tokens (pairs = seqlen x topk)")
    gg.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    gg.add_argument("--routing", choices=("uniform", "zipf"), help="synthetic routing (default uniform)")
    gg.add_argument("--skew", type=float, help="Zipf exponent (default 1.2 with --routing zipf)")
    gg.add_argument("--gemms", default="gate_up,down", help="comma-separated subset of gate_up,down")
    gg.add_argument("--kernels", default="forward,dX,dW", help="comma-separated subset of forward,dX,dW")
    gg.add_argument("--top-n", type=_non_negative_int, default=10, help="rows printed per kernel")
    gg.add_argument("-o", "--output", type=Path, default=Path("results.csv"), help="CSV of every passing config")
    gg.add_argument("--config-dir", type=Path,
                    help="folder of the store JSON (default: TRITUNE_CONFIG_DIR, else ./tritune-out/configs)")
    gg.add_argument("--search-space", type=Path,
                    help="JSON {param: [values]} replacing lists of the default space (without a GPU: the "
                         "interpreter's)")
    _add_engine_flags(gg)

    from tritune.aot.cli import add_parsers as add_aot_parsers

    add_aot_parsers(sub, _positive_int, _non_negative_int, _positive_float)
    sub.add_parser("device", help="print the device identity recorded in every output file")
    c = sub.add_parser(
        "configs", help="list tuned config files and whether this machine would use them",
        description="List every tuned config file (GEMM, fused-MoE CSV, grouped-GEMM, user kernel) with what it was "
                    "tuned on and whether this machine would use it: another device, SM count or interpreter-vs-GPU "
                    "is skipped, another Triton major.minor is used with a warning. Exit status with --check: 0 when "
                    "every file would be used as is, 1 when any is stale, skipped or malformed; 2 on bad usage "
                    "(without --check: 0 unless the usage is bad).")
    c.add_argument("--check", action="store_true", help="exit 1 unless every file would be used as is")
    c.add_argument("dir", nargs="?", type=Path, metavar="DIR",
                   help="folder to list, with its user_kernels/ (default: TRITUNE_CONFIG_DIR, the shipped configs "
                        "and the fused-MoE CSVs the ops read)")
    return parser


def _settings(args: argparse.Namespace, out_dir: Path, device):
    from tritune.device import gpu_count
    from tritune.tuning.ray_cluster import RaySettings
    from tritune.tuning.tuner import TuneSettings
    from tritune.tuning.types import BenchSettings, Objective

    bench = BenchSettings(iters=args.iters, warmup=args.warmup, timeout_s=args.timeout, seed=args.seed,
                          early_stop_factor=args.early_stop)
    return TuneSettings(
        ray=RaySettings(args.ray_address, args.ray_resource) if args.executor == "ray" else None,
        journal_path=out_dir / f"journal-{device.slug}.sqlite", bench=bench,
        num_gpus=args.mp or max(1, gpu_count()), compile_workers=args.compile_workers,
        compile_lead=args.compile_lead,
        strategy=args.strategy, budget=args.budget, progress=not args.no_progress,
        finalists=args.finalists, objective=Objective(args.objective),
    )


def _device(args: argparse.Namespace):
    """The device a tuning command tunes for: this machine's, or the cluster GPU model `_on_ray_cluster` is at."""
    from tritune.device import current_device

    return getattr(args, "ray_target", None) or current_device()


def _on_ray_cluster(args: argparse.Namespace) -> int:
    """`--executor ray`: the command once per GPU model of the cluster (or the one --ray-device names), each run
    with its own journal and results; the worst exit status."""
    from tritune.tuning.ray_cluster import RaySettings, cluster_devices, ray_available

    if not ray_available():
        return _fail("--executor ray needs Ray: pip install 'tritune[ray]'")
    try:
        found = cluster_devices(RaySettings(args.ray_address, args.ray_resource))
    except Exception as exc:  # no cluster at the address, no node with the resource, ...
        return _fail(f"Ray cluster {args.ray_address or '(default)'}: {exc}")
    models = [(d, n) for d, n in found if args.ray_device in (None, d.name)]
    if not models:
        have = ", ".join(f"{n} x {d.name}" for d, n in found)
        return _fail(f"no GPU of the Ray cluster is a {args.ray_device!r}; it has {have}")
    code = 0
    for device, count in models:  # each with its own copy of the arguments, naming the device it tunes for
        print(f"== {device.name}: {count} GPU(s) of the Ray cluster", flush=True)
        code = max(code, _tune(argparse.Namespace(**{**vars(args), "ray_target": device}), device.interpreter))
    return code


def _tune(args: argparse.Namespace, interpreted: bool) -> int:
    if args.command == "gemm":
        return _gemm(args)
    if args.command == "moe":
        return _moe(args)
    if args.command == "grouped-gemm":
        return _grouped_gemm(args)
    return _example(args, interpreted)


def _run_gemm(req, args: argparse.Namespace, example: bool = False) -> int:
    from tritune.tuners.example import example_settings
    from tritune.tuners.gemm import (
        build_tunable,
        check_existing_outputs,
        check_interpreter_cost,
        result_table,
        tune_gemm,
    )

    device = _device(args)
    if device.interpreter:
        print(f"No GPU found: running through Triton's interpreter ({INTERPRETER_LABEL}).", flush=True)
    try:
        tunable = build_tunable(req, device)
        check_interpreter_cost(req, device)
        check_existing_outputs(req, device)
    except ValueError as exc:
        return _fail(str(exc))
    settings = _settings(args, req.out_dir, device)
    report = tune_gemm(req, device, example_settings(settings, device.interpreter) if example else settings, tunable)
    print("\n".join(result_table(report.results, tunable.flops)))
    print("\n".join(report.summary.lines()))
    for path in report.files:
        print(f"wrote {path}")
    if device.interpreter:
        print(f"({INTERPRETER_LABEL})")
    if report.failed_problems:
        return _fail(report.failure())
    return 0


def _gemm(args: argparse.Namespace) -> int:
    from tritune.tuners.gemm import GemmShape, GemmTuneRequest, parse_m_list, read_shapes_file

    try:
        if args.shapes:
            if args.m or args.n or args.k:
                return _fail("give either --shapes or --m/--n/--k, not both")
            shapes = tuple(read_shapes_file(args.shapes))
        else:
            if not (args.m and args.n and args.k):
                return _fail("give --m, --n and --k (or --shapes FILE)")
            shapes = (GemmShape(parse_m_list(args.m), args.n, args.k),)
        req = GemmTuneRequest(args.kernel, shapes, args.output, args.dtype, args.atol, args.rtol, args.err_ratio,
                              args.search_space, out_dtype=args.out_dtype,
                              allow_slow_interpreter=args.allow_slow_interpreter)
    except ValueError as exc:
        return _fail(str(exc))
    return _run_gemm(req, args)


def _moe(args: argparse.Namespace) -> int:
    from tritune.tuners.fused_moe import MoeTuneRequest

    try:
        req = MoeTuneRequest(args.input, args.output, args.last, args.retune_all, args.profile_file, args.err_ratio,
                             args.skew, args.search_space, args.allow_slow_interpreter)
    except ValueError as exc:
        return _fail(str(exc))
    return _run_moe(req, args)


def _run_moe(req, args: argparse.Namespace, example: bool = False) -> int:
    from tritune.tuners.example import example_settings
    from tritune.tuners.fused_moe import build_tunable, plan_rows, result_table, summary_lines, tune_fmoe

    asked = time.perf_counter()  # the split of the time before the tune: imports, device query, rows
    device = _device(args)
    answered = time.perf_counter()
    if device.interpreter:
        print(f"No GPU found: running through Triton's interpreter ({INTERPRETER_LABEL}).", flush=True)
    try:
        tunable = build_tunable(req, device)
        plan = plan_rows(req, device)  # every input and output row is validated before any work starts
    except ValueError as exc:
        return _fail(str(exc))
    settings = _settings(args, req.output.parent, device)
    settings = example_settings(settings, device.interpreter) if example else settings
    before = time.perf_counter() - _STARTED
    driver, torch_at = _MARKS.get("driver", _STARTED), _MARKS.get("torch", _STARTED)
    split = (driver - _STARTED, torch_at - driver, asked - torch_at, answered - asked, before - (answered - _STARTED))
    report = tune_fmoe(req, device, settings, tunable, plan)
    print("\n".join(result_table(report)))
    print("\n".join(summary_lines(report)))
    if report.summaries and not example:  # the fixed cost a multi-GPU run does not divide (issue 17); the example
        # command ran its GEMM part first, which this would count
        print(f"  before the tune: {before:.1f}s (driver query and fork server, torch, tritune's imports, device, "
              f"reading and checking the rows: {' / '.join(f'{x:.1f}' for x in split)}s)")
        # Against the process's wall time, what the interpreter's start and exit take (4 H200s: 1.3-2.1 s unprinted).
        done = time.perf_counter() - _STARTED
        print(f"  done {done:.1f}s after the command started (the interpreter's exit follows)")
    if report.written:
        print(f"wrote {len(report.written)} row(s) to {req.output}")
    if req.profile_file is not None and report.results:
        print(f"wrote every candidate to {req.profile_file}")
    if device.interpreter:
        print(f"({INTERPRETER_LABEL})")
    if report.failed:
        return _fail(report.failure())
    return 0


def _example(args: argparse.Namespace, interpreted: bool) -> int:
    from tritune.tuners.example import plan_example

    try:
        plan = plan_example(args.output, interpreted=interpreted, shapes=args.shapes, moe_shapes=args.moe_shapes)
    except ValueError as exc:
        return _fail(str(exc))
    if interpreted:
        given = [flag for flag, value, default in (("--shapes", args.shapes, "examples/gemm_shapes.csv"),
                                                    ("--moe-shapes", args.moe_shapes, "examples/untuned_fmoe.csv"))
                 if value != Path(default)]
        if given:
            print(f"tritune: no GPU: {' and '.join(given)} not used; the tiny interpreted example runs instead "
                  "(tune those with `tritune gemm` / `tritune moe`, which refuse what the interpreter cannot finish)",
                  file=sys.stderr)
    code = 0
    for req in plan.gemm:
        if not interpreted:  # one kernel without a GPU, as before: no heading
            print(f"== {req.kernel}", flush=True)
        code = max(code, _run_gemm(req, args, example=True))
    print("== fused MoE", flush=True)
    return max(code, _run_moe(plan.moe, args, example=True))


def _grouped_gemm(args: argparse.Namespace) -> int:
    from tritune.tuners import grouped_gemm as ggt

    device = _device(args)
    try:
        shape = ggt.preset_shape(args.model, num_experts=args.num_experts, hidden_size=args.hidden_size,
                                 intermediate_size=args.intermediate_size, topk=args.topk, seqlen=args.seqlen,
                                 dtype=args.dtype, skew=ggt.routing_skew(args.routing, args.skew))
        req = ggt.GroupedGemmRequest(
            shape, ggt.parse_names(args.gemms, ggt.GEMMS, "--gemms"),
            ggt.parse_names(args.kernels, ggt.KERNELS, "--kernels"), args.top_n, args.output,
            args.config_dir or ggt.default_store_dir(),
            ggt.space_from_file(args.search_space) if args.search_space else None, device.interpreter,
            args.allow_slow_interpreter)
        tunable = ggt.build_tunable(req)
        ggt.check_interpreter_cost(req, device)
        ggt.check_existing_outputs(req, device)
    except ValueError as exc:
        return _fail(str(exc))
    if device.interpreter:
        print(f"No GPU found: running through Triton's interpreter ({INTERPRETER_LABEL}).", flush=True)
        if shape.dtype == "bf16":
            print("note: the interpreter's tl.dot is wrong on bf16 operands; use --dtype fp16 on the CPU", flush=True)
    outcomes = ggt.tune_grouped_gemm(req, device, _settings(args, req.output.parent, device), tunable)
    print("\n".join(ggt.result_lines(outcomes)))
    print(f"wrote {req.output}")
    if any(o.best is not None for o in outcomes):
        print(f"wrote {ggt.store_path(req.store_dir, device.name)}")
    if device.interpreter:
        print(f"({INTERPRETER_LABEL})")
    if any(o.best is None for o in outcomes):
        return _fail(ggt.failure(outcomes))
    return 0


def _configs(args: argparse.Namespace) -> int:
    from tritune.store import inventory
    from tritune.store.provenance import running_machine

    if args.dir is not None and not args.dir.is_dir():
        return _fail(f"{args.dir} {'is not a folder' if args.dir.exists() else 'does not exist'}")
    try:
        found = (inventory.check_folder(args.dir, running_machine()) if args.dir is not None
                 else inventory.check_defaults(running_machine()))
    except ValueError as exc:  # a bad TRITUNE_CONFIG_DIR or TRITUNE_CONFIG_FMOE
        return _fail(str(exc))
    print("\n".join(found.lines()))
    return 1 if args.check and not found.ok else 0


# The output flags of each `tritune aot` verb: (argument name, whether it names a folder).
_AOT_OUTPUTS = {"build": (("output", True),), "run": (("output", False), ("plot", False)),
                "import": (("output", True),)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "aot":  # compiles for a named target, never through the interpreter
        from tritune.aot.cli import run as run_aot
        from tritune.store.atomic import check_writable

        try:  # every output path the verb was given, before any work
            for name, folder in _AOT_OUTPUTS[args.aot_command]:
                if getattr(args, name) is not None:
                    check_writable(getattr(args, name), folder=folder)
        except ValueError as exc:
            return _fail(str(exc))
        return run_aot(args)
    # On a Ray cluster the nodes decide (no CUDA there: the interpreter); the driver's own GPU does not matter.
    on_ray = getattr(args, "executor", "local") == "ray"
    tuning = args.command not in ("device", "configs")
    from tritune.knobs import mxfp4_decode, start_method, timer_park, worker_preload
    from tritune.tuning import processes

    if tuning:
        try:  # how the tuner starts its processes and parks the GPU: a bad value is one line now, not mid-tune
            start_method()
            timer_park()
            mxfp4_decode()
            worker_preload()
        except ValueError as exc:
            return _fail(str(exc))
    # The fork server's imports overlap this process's own torch import where the driver reports a GPU (issue 17's
    # fixed cost), else the device query and reading the rows (below).
    early = tuning and not on_ray and processes.start_server_before_torch()
    _MARKS["driver"] = time.perf_counter()
    interpreted = False if on_ray else _use_interpreter_without_gpu()
    _MARKS["torch"] = time.perf_counter()
    processes.spawn_if_server_is_stale(early, interpreted)
    if args.command == "device":
        from tritune.device import current_device

        for key, value in current_device().provenance().items():
            print(f"{key}: {value}")
        return 0
    if args.command == "configs":
        return _configs(args)
    if not on_ray and not early:
        processes.start_server_early()
    try:
        return _on_ray_cluster(args) if on_ray else _tune(args, interpreted)
    except KeyboardInterrupt:
        return _fail("interrupted; everything measured so far is in the journal, rerun the command to resume")


if __name__ == "__main__":
    sys.exit(main())
