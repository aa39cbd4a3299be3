"""AOT vs JIT on the GPU for the fused-MoE GEMM kernels: build a bundle with no GPU visible, run it, import it,
and compare with the engine tuning the very same configs through Triton's JIT (MoeGemmTunable: one
`_moe_gemm_kernel` launch on a ready sort, as the artifact runs it).

    PYTHONPATH=src python benchmarks/bench_aot_moe.py --work /tmp/aot --out $OUT/aot_moe.json

Checks: the AOT stage-1 winner equals the JIT winner or is within the JIT's run-to-run spread of it (two JIT
runs); every artifact's median within 5% of its JIT median; the imported CSV row names the AOT winners.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

SPACE = {"BLOCK_SIZE_M": [32, 64, 128], "BLOCK_SIZE_N": [64, 128], "BLOCK_SIZE_K": [64, 128],
         "GROUP_SIZE_M": [8], "num_warps": [4, 8], "num_stages": [3, 4]}


def sh(cmd: list[str], env: dict | None = None, log: Path | None = None) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if log:
        log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    print(done.stdout[-3000:], flush=True)
    if done.returncode:
        print(done.stderr[-3000:], flush=True)
        raise SystemExit(f"{' '.join(cmd[:6])}... failed with {done.returncode}")
    return time.perf_counter() - t0


def jit_times(shape, kind: str, repeat: int, iters: int, journal_dir: Path) -> list[dict[str, float]]:
    """Per run: artifact id -> JIT median (us), from the engine over the same space."""
    from tritune.aot.moe import MoeGemmTunable, artifact_id
    from tritune.device import current_device
    from tritune.tuners.fused_moe_tunable import MoeProblem
    from tritune.tuning.tuner import TuneSettings, tune
    from tritune.tuning.types import BenchSettings

    space = dict(SPACE) | {"KSPLIT": [1], "USE_TMA": [0]}
    tunable = MoeGemmTunable(stage_space=tuple((k, tuple(v)) for k, v in space.items()))
    runs = []
    for i in range(repeat):
        settings = TuneSettings(journal_path=journal_dir / f"jit_{kind}_{i}.sqlite",
                                bench=BenchSettings(iters=iters, warmup=10), progress=False)
        results, summary = tune(tunable, [MoeProblem(shape, kind)], current_device(), settings)
        print("\n".join(summary.lines()), flush=True)
        runs.append({artifact_id(kind, m.config.as_dict()): m.time_us for m in results[0].measurements if m.ok})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/tritune-aot"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    logs = args.out.parent
    logs.mkdir(parents=True, exist_ok=True)
    space_file = args.work / "space.json"
    space_file.write_text(json.dumps(SPACE))
    bundle = args.work / "bundle"
    cli = [sys.executable, "-m", "tritune.cli"]
    shape_flags = ["--tokens", str(args.tokens), "--model-dim", "4096", "--inter-dim", "1792", "--experts", "8",
                   "--topk", "2", "--dtype", "bf16"]
    no_gpu = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    build_s = sh(cli + ["aot", "build", "--kernel", "fused_moe", "--target", "cuda:90", "-o", str(bundle),
                        "--search-space", str(space_file)] + shape_flags, env=no_gpu, log=logs / "aot_build.log")
    run_s = []
    for i in range(2):
        run_s.append(sh(cli + ["aot", "run", str(bundle), "--reps", str(args.reps), "--no-progress"],
                        log=logs / f"aot_run_{i}.log"))
    sh(cli + ["aot", "import", str(bundle), "-o", str(args.work / "tuned")], log=logs / "aot_import.log")
    for name in ("perf_stats.csv", "perf_stats.svg", "manifest.json", "device.json"):
        shutil.copy(bundle / name, logs / f"aot_{name}")
    shutil.copy(args.work / "tuned" / "tuned_fmoe.csv", logs / "aot_tuned_fmoe.csv")

    from tritune.aot.stats import read_perf_stats
    from tritune.store.fmoe_csv import read_tuned
    from tritune.store.fmoe_rows import FmoeShape

    rows = read_perf_stats(bundle / "perf_stats.csv")
    aot_runs: list[dict[str, float]] = [{}, {}]
    seen: dict[str, int] = {}
    for r in rows:  # rows in run order: first run, then second
        k = seen.get(r.artifact, 0)
        seen[r.artifact] = k + 1
        if r.valid and k < 2:
            aot_runs[k][r.artifact] = r.median_us
    invalid = [(r.artifact, r.reason) for r in rows if not r.valid]
    shape = FmoeShape(token=args.tokens, model_dim=4096, inter_dim=1792, expert=8, topk=2, act_type="silu",
                      dtype="bf16", q_dtype_a="bf16", q_dtype_w="bf16", q_type="none", use_g1u1=True,
                      doweight_stage1=False)
    report = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
              "triton": triton.__version__, "torch": torch.__version__, "shape": shape.key(),
              "build_s": build_s, "run_s": run_s, "invalid": invalid, "kernels": {}}
    tuned = read_tuned(args.work / "tuned" / "tuned_fmoe.csv")[0]
    for kind in ("stage1", "stage2"):
        jit = jit_times(shape, kind, 2, args.reps, args.work)
        ids = sorted(i for i in aot_runs[0] if i.startswith(f"moe_{kind}_"))
        per = []
        for aid in ids:
            j = [run[aid] for run in jit if aid in run]
            a = [run[aid] for run in aot_runs if aid in run]
            if len(j) < 2 or not a:
                continue
            per.append({"artifact": aid, "aot_us": statistics.median(a), "aot_runs": a, "jit_us": statistics.median(j),
                        "jit_runs": j, "aot_over_jit": statistics.median(a) / statistics.median(j),
                        "jit_spread": abs(j[0] - j[1]) / min(j)})
        aot_best = min(per, key=lambda p: p["aot_us"])
        jit_best = min(per, key=lambda p: p["jit_us"])
        spread = max(p["jit_spread"] for p in per)
        same_or_close = aot_best["artifact"] == jit_best["artifact"] or \
            (aot_best["jit_us"] - jit_best["jit_us"]) / jit_best["jit_us"] <= max(spread, 0.0)
        within5 = sum(abs(p["aot_over_jit"] - 1) <= 0.05 for p in per)
        report["kernels"][kind] = {
            "configs": len(per), "aot_winner": aot_best, "jit_winner": jit_best, "max_jit_spread": spread,
            "median_jit_spread": statistics.median(p["jit_spread"] for p in per),
            "winner_equal_or_within_spread": same_or_close, "within_5pct": within5,
            "max_abs_dev": max(abs(p["aot_over_jit"] - 1) for p in per),
            "median_abs_dev": statistics.median(abs(p["aot_over_jit"] - 1) for p in per), "per_config": per}
    report["imported"] = {"kernelName1": tuned.kernelName1, "kernelName2": tuned.kernelName2, "block_m": tuned.block_m}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nbuild (no GPU visible) {build_s:.1f} s; runs {run_s[0]:.1f} s, {run_s[1]:.1f} s; invalid {invalid}")
    for kind, k in report["kernels"].items():
        print(f"{kind}: {k['configs']} configs; AOT winner {k['aot_winner']['artifact']} "
              f"{k['aot_winner']['aot_us']:.1f} us"
              f" (JIT {k['aot_winner']['jit_us']:.1f}); JIT winner {k['jit_winner']['artifact']} "
              f"{k['jit_winner']['jit_us']:.1f} us; equal-or-within-spread {k['winner_equal_or_within_spread']} "
              f"(max JIT spread {100 * k['max_jit_spread']:.1f}%); within 5%: {k['within_5pct']}/{k['configs']}, "
              f"max |AOT/JIT-1| {100 * k['max_abs_dev']:.1f}%, median {100 * k['median_abs_dev']:.1f}%")
        for p in k["per_config"]:
            print(f"   {p['artifact']:<60} aot {p['aot_us']:8.1f}  jit {p['jit_us']:8.1f}  "
                  f"ratio {p['aot_over_jit']:.3f}  jit spread {100 * p['jit_spread']:.1f}%")
    print(f"imported row: {report['imported']}")


if __name__ == "__main__":
    main()
