"""`tritune aot build | run | import`: flags in, library calls out (docs/AOT.md has the formats)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

KERNEL_HELP = ("fused_moe (stage-1 and stage-2 GEMMs), gemm (bf16/fp16 pointer kernel), or a user kernel as "
               "module:attribute or path/to/file.py:attribute naming a tritune.tunable_kernel")


def add_parsers(sub: Any, positive_int, non_negative_int, positive_float) -> None:
    aot = sub.add_parser("aot", help="ahead of time: build a bundle per config for a target, run it there, "
                                     "import the statistics")
    verbs = aot.add_subparsers(dest="aot_command", required=True, parser_class=type(aot))

    b = verbs.add_parser("build", help="compile every config for --target (no GPU needed) into a bundle folder")
    b.add_argument("--kernel", required=True, help=KERNEL_HELP)
    b.add_argument("--target", default="cuda:90", help="cuda:<compute capability>: cuda:90 H100/H200, cuda:80 A100")
    b.add_argument("-o", "--output", type=Path, required=True, help="bundle folder (must be new or empty)")
    b.add_argument("--force", action="store_true", help="replace an existing bundle folder once the build succeeds")
    b.add_argument("--configs", type=Path, help="JSON list of configs ({param: value}); for fused_moe a list or "
                                                "{\"stage1\": [...], \"stage2\": [...]}")
    b.add_argument("--search-space", type=Path, help="JSON {param: [values]} replacing lists of the default space")
    b.add_argument("--tokens", type=positive_int, default=1024, help="fused_moe: tokens")
    b.add_argument("--model-dim", type=positive_int, default=4096, help="fused_moe: hidden size")
    b.add_argument("--inter-dim", type=positive_int, default=1792, help="fused_moe: intermediate size per expert")
    b.add_argument("--experts", type=positive_int, default=8, help="fused_moe: experts")
    b.add_argument("--topk", type=positive_int, default=2, help="fused_moe: experts per token")
    b.add_argument("--moe-kernels", default="stage1,stage2", help="fused_moe: comma-separated stage1,stage2")
    b.add_argument("--skew", type=float, default=0.0, help="fused_moe: Zipf routing exponent (0 uniform)")
    b.add_argument("--m", type=positive_int, default=4096, help="gemm: M")
    b.add_argument("--n", type=positive_int, default=4096, help="gemm: N")
    b.add_argument("--k", type=positive_int, default=4096, help="gemm: K")
    b.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    b.add_argument("--problem", help="user kernel: JSON object passed to its inputs() (e.g. '{\"Z\": 2, ...}')")
    b.add_argument("--seed", type=int, default=0, help="seed of the data set")
    b.add_argument("--compile-workers", type=positive_int, default=None, help="compile processes (default: all)")
    b.add_argument("--no-link", action="store_true", help="do not link executables here (make -C BUNDLE later)")

    r = verbs.add_parser("run", help="run every artifact of a bundle on this machine's GPU; writes perf_stats.csv")
    r.add_argument("bundle", type=Path)
    r.add_argument("--reps", type=positive_int, default=100, help="timed repetitions per artifact")
    r.add_argument("--warmup", type=non_negative_int, default=10)
    r.add_argument("--timeout", type=positive_float, default=120.0, help="seconds per artifact before it is killed")
    r.add_argument("--flush-bytes", type=positive_int, default=None, help="L2 flush buffer (default: 200 MiB)")
    r.add_argument("--only", help="comma-separated artifact ids")
    r.add_argument("--output", type=Path, help="statistics CSV (default BUNDLE/perf_stats.csv, appended to)")
    r.add_argument("--plot", type=Path, help="SVG of time per config (default BUNDLE/perf_stats.svg)")
    r.add_argument("--make", action="store_true", help="build missing executables with `make` first")
    r.add_argument("--no-progress", action="store_true")

    i = verbs.add_parser("import", help="turn a bundle's statistics into tuned-config files the runtime reads")
    i.add_argument("bundle", type=Path)
    i.add_argument("-o", "--output", type=Path, help="folder for tuned_fmoe.csv / GEMM JSON (default ./tritune_tuned;"
                                                    " user kernels go to their own store unless this is given)")
    i.add_argument("--stats", type=Path, help="statistics CSV (default BUNDLE/perf_stats.csv)")
    i.add_argument("--device-name", help="the target GPU's name (default: BUNDLE/device.json)")
    i.add_argument("--cu-num", type=positive_int, help="the target GPU's SM count (default: BUNDLE/device.json)")


def _fail(message: str) -> int:
    sys.stderr.write(f"tritune: error: {message}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        if args.aot_command == "build":
            return _build(args)
        if args.aot_command == "run":
            return _run(args)
        return _import(args)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        return _fail(str(err))


def target_device(target):
    """The limits pruning reads, for a target rather than a present GPU (the data-centre part of each arch)."""
    from tritune.device import DeviceInfo, versions

    sms = {90: 132, 80: 108, 89: 142, 86: 84, 100: 148}.get(target.arch, 108)
    return DeviceInfo(name=f"target {target.text}", sm_count=sms, capability=divmod(target.arch, 10),
                      max_shared_mem=target.max_shared_bytes, regs_per_block=65536, l2_bytes=50 * 2**20,
                      warp_size=target.warp_size, **versions())


def _json_file(path: Path | None, what: str) -> Any:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except OSError as err:  # a folder, no permission: one line, not a traceback
        raise ValueError(f"{what} {path}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path}: not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None


def _space(path: Path | None) -> dict | None:
    if path is None:
        return None
    from tritune.tuning.space import load_space_file

    return load_space_file(path)


def _config_list(doc: Any, where: str) -> list[dict]:
    if not isinstance(doc, list) or not all(isinstance(c, dict) for c in doc) or not doc:
        raise ValueError(f"{where}: expected a non-empty JSON list of {{param: value}} objects")
    return doc


def _plans_factory(args: argparse.Namespace, target):
    device = target_device(target)
    configs = _json_file(args.configs, "--configs")
    space = _space(args.search_space)
    kernel = args.kernel
    if kernel == "fused_moe":
        from tritune.aot.moe import MOE_KERNELS, moe_plans
        from tritune.store.fmoe_rows import FmoeShape

        kinds = tuple(k.strip() for k in args.moe_kernels.split(",") if k.strip())
        bad = [k for k in kinds if k not in MOE_KERNELS]
        if bad or not kinds:
            raise ValueError(f"--moe-kernels {args.moe_kernels!r}: expected some of {', '.join(MOE_KERNELS)}")
        shape = FmoeShape(token=args.tokens, model_dim=args.model_dim, inter_dim=args.inter_dim, expert=args.experts,
                          topk=args.topk, act_type="silu", dtype=args.dtype, q_dtype_a=args.dtype,
                          q_dtype_w=args.dtype, q_type="none", use_g1u1=True, doweight_stage1=False)
        by_kind = None
        if configs is not None:
            by_kind = ({k: _config_list(v, f"--configs {args.configs} [{k}]") for k, v in configs.items()}
                       if isinstance(configs, dict) else {k: _config_list(configs, f"--configs {args.configs}")
                                                          for k in kinds})
        return lambda staging: moe_plans(staging, shape, device, kinds=kinds, space=space, configs=by_kind,
                                         seed=args.seed, skew=args.skew)
    if kernel == "gemm":
        from tritune.aot.gemm import gemm_plans
        from tritune.tuners.gemm_tunable import GemmProblem

        problem = GemmProblem("bf16", args.m, args.n, args.k, args.dtype)
        listed = _config_list(configs, f"--configs {args.configs}") if configs is not None else None
        return lambda staging: gemm_plans(staging, problem, device, space=space, configs=listed, seed=args.seed)
    if ":" not in kernel:
        raise ValueError(f"--kernel {kernel!r}: expected {KERNEL_HELP}")
    from tritune.aot.user import user_plans

    if args.problem is None:
        raise ValueError("a user kernel needs --problem '{...}' (the dict its inputs() takes)")
    try:
        problem = json.loads(args.problem)
    except json.JSONDecodeError as err:
        raise ValueError(f"--problem is not JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(problem, dict):
        raise ValueError("--problem must be a JSON object")
    listed = _config_list(configs, f"--configs {args.configs}") if configs is not None else None
    return lambda staging: user_plans(staging, kernel, problem, configs=listed, seed=args.seed)


def _build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tritune.aot.builder import build_bundle
    from tritune.aot.compiler import AotTarget

    target = AotTarget.parse(args.target)
    make_plans = _plans_factory(args, target)
    bar = tqdm(desc="compile", unit="artifact", disable=not sys.stderr.isatty())
    report = build_bundle(args.output, target, make_plans, workers=args.compile_workers, force=args.force,
                          link=not args.no_link, progress=lambda _: bar.update())
    bar.close()
    print("\n".join(report.lines()))
    return 0 if report.compiled else _fail("no artifact compiled")


def write_device_file(bundle: Path) -> Path | None:
    """Record which GPU the statistics come from (import needs its name and SM count); None without a GPU."""
    from tritune.aot.importer import DEVICE_FILE
    from tritune.device import current_device
    from tritune.store.atomic import atomic_write_json

    device = current_device()
    if device.interpreter:
        return None
    path = Path(bundle) / DEVICE_FILE
    atomic_write_json(path, {"name": device.name, "sm_count": device.sm_count,
                             "capability": f"{device.capability[0]}.{device.capability[1]}",
                             "torch": device.torch_version})
    return path


def _run(args: argparse.Namespace) -> int:
    import subprocess

    from tritune.aot.runner import run_bundle, summary_lines

    if not (args.bundle / "manifest.json").is_file():
        raise ValueError(f"{args.bundle} is not a bundle (no manifest.json)")
    if args.make:
        done = subprocess.run(["make", "-C", str(args.bundle), "-j"], capture_output=True, text=True)
        if done.returncode:
            return _fail(f"make -C {args.bundle} failed: {done.stderr.strip().splitlines()[-1:]}")
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    rows = run_bundle(args.bundle, reps=args.reps, warmup=args.warmup, timeout_s=args.timeout,
                      flush_bytes=args.flush_bytes, output=args.output, plot=args.plot, only=only,
                      progress=not args.no_progress)
    write_device_file(args.bundle)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {args.output or args.bundle / 'perf_stats.csv'} and {args.plot or args.bundle / 'perf_stats.svg'}")
    return 0 if any(r.valid for r in rows) else 1


def _import(args: argparse.Namespace) -> int:
    from tritune.aot.importer import import_bundle

    for line in import_bundle(args.bundle, args.output, stats=args.stats, device_name=args.device_name,
                              cu_num=args.cu_num):
        print(line)
    return 0
