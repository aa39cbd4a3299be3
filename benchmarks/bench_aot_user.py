"""AOT vs JIT for a user kernel (the flash-attention example): build a bundle with no GPU visible, run it, then
time every config through Triton's JIT on the bundle's own data (same tensors, same L2 flush, CUDA events),
and through the engine (`attention.tune`).

    PYTHONPATH=src:examples python benchmarks/bench_aot_user.py --work /tmp/aot-user --out $OUT/aot_user.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

PROBLEM = {"Z": 4, "H": 16, "N_CTX": 2048, "HEAD_DIM": 64, "CAUSAL": True, "dtype": "fp16"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/tritune-aot-user"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    bundle = args.work / "bundle"
    cli = [sys.executable, "-m", "tritune.cli", "aot"]
    subprocess.run(cli + ["build", "--kernel", "examples/flash_attention.py:attention", "--problem",
                          json.dumps(PROBLEM), "-o", str(bundle)], check=True,
                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    subprocess.run(cli + ["run", str(bundle), "--reps", str(args.reps), "--no-progress"], check=True)

    import flash_attention  # examples/ on PYTHONPATH, so the engine's spawned workers import it by name

    from tritune.aot.manifest import load_manifest
    from tritune.aot.spec import RunSpec, resolve
    from tritune.aot.stats import read_perf_stats
    from tritune.aot.tdat import read_tensor
    from tritune.tuning.bench import time_kernel
    from tritune.tuning.tuner import TuneSettings
    from tritune.tuning.types import BenchSettings, Config

    uk = flash_attention.attention
    manifest = load_manifest(bundle)
    spec = RunSpec.parse((bundle / "specs" / f"{uk.name}.spec").read_text())
    aot = {r.artifact: r.median_us for r in read_perf_stats(bundle / "perf_stats.csv") if r.valid}
    rows = []
    for art in manifest.artifacts:
        params = {k: int(v) for k, v in art.params.items()}
        res = resolve(spec, params, bundle)
        kargs = {a.name: read_tensor(res.files[a.name])[1].cuda() for a in spec.args if a.role in ("in", "out")}
        kargs |= res.int_args | res.float_args | {"HEAD_DIM": PROBLEM["HEAD_DIM"], "CAUSAL": PROBLEM["CAUSAL"]}
        config = Config.from_dict(params)
        grid = uk.grid_for(kargs, config)
        launch = uk.kernel[grid]
        jit = time_kernel(lambda launch=launch, kargs=kargs, params=params: launch(**kargs, **params),
                          iters=args.reps, warmup=10).median_us
        rows.append({"artifact": art.id, "aot_us": aot.get(art.id), "jit_us": jit,
                     "ratio": aot[art.id] / jit if art.id in aot else None})
    for r in rows:
        print(f"{r['artifact']:<72} aot {r['aot_us'] or float('nan'):8.1f} jit {r['jit_us']:8.1f} "
              f"ratio {r['ratio'] or float('nan'):.3f}", flush=True)
    uk.store_path = args.work / "store.json"
    settings = TuneSettings(journal_path=args.work / "journal.sqlite",
                            bench=BenchSettings(iters=args.reps, warmup=10), progress=False)
    tuned = uk.tune([PROBLEM], settings=settings)[0]
    engine_winner = "_".join([uk.name] + [f"{k}{tuned.config[k]}" for k in sorted(tuned.config)])
    best_aot = min((r for r in rows if r["aot_us"]), key=lambda r: r["aot_us"])
    best_jit = min(rows, key=lambda r: r["jit_us"])
    report = {"device": torch.cuda.get_device_name(0), "problem": PROBLEM, "rows": rows,
              "aot_winner": best_aot, "jit_winner": best_jit,
              "engine_winner": {"artifact": engine_winner, "time_us": tuned.time_us}}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"AOT winner {best_aot['artifact']} {best_aot['aot_us']:.1f} us; JIT (same data) winner "
          f"{best_jit['artifact']} {best_jit['jit_us']:.1f} us; engine winner {engine_winner} {tuned.time_us:.1f} us")


if __name__ == "__main__":
    main()
