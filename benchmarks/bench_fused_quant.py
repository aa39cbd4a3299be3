"""fp8 fused MoE: the intermediate quantized inside the GEMMs (stage 1 records its amax, stage 2 quantizes A as it
loads it) against its own quantization launch, on the GPU: the two results must be equal bit for bit; GPU time
(the tuner's timer) and host cost per call of both, per shape, quant and token count, with the op's own choice of
configs. Evidence for `kernels.fused_moe_launch.FUSE_INTERMEDIATE_QUANT` and `FUSE_QUANT_L2_SHARE`.

    PYTHONPATH=src python3 benchmarks/bench_fused_quant.py [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

# Models outside examples/: (name, model_dim, inter_dim, experts, topk)
SHAPES = (("Qwen3-30B-A3B", 2048, 768, 128, 8), ("DeepSeek-V2-Lite", 2048, 1408, 64, 6),
          ("Mixtral-8x7B", 4096, 14336, 8, 2))
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from tritune import ops
    from tritune.kernels import fused_moe_launch as fml
    from tritune.ops.fused_moe import fused_moe_choice, reload_moe_configs
    from tritune.tuning.bench import time_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    cases = _load("test_runtime_gpu", root / "tests" / "test_runtime_gpu.py")
    host = _load("profile_moe_host", root / "benchmarks" / "profile_moe_host.py").host_us
    rows = []
    print(f"{'shape':18s} {'quant':9s} {'T':>6s} {'pairs':>7s} {'BN1':>4s} {'gpu fused':>9s} {'gpu sep':>8s} "
          f"{'ratio':>6s} {'host fused':>10s} {'host sep':>8s} equal")
    for name, D, inter, E, topk in SHAPES:
        for quant in ("per_token", "per_1x128"):
            for T in TOKENS:
                x = cases.moe_inputs(T, D, inter, E, topk, quant)
                choice = fused_moe_choice(x["hidden"], x["w1"], x["w2"], x["topk_ids"], quant=quant)

                def call(x=x, choice=choice, quant=quant):
                    return ops.fused_moe(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=quant,
                                         w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice)
                rec = {"shape": name, "quant": quant, "tokens": T, "pairs": T * topk, "source": choice.source,
                       "run_1stage": choice.run_1stage, "bn1": choice.stage1.BLOCK_SIZE_N,
                       "ksplit1": choice.stage1.KSPLIT}
                outs = {}
                for mode, fuse in (("fused", True), ("separate", False)):
                    fml.FUSE_INTERMEDIATE_QUANT = fuse
                    fml.FUSE_QUANT_L2_SHARE = float("inf")  # compare at every size, past the op's own limit
                    reload_moe_configs()
                    outs[mode] = call().clone()
                    rec[f"gpu_{mode}_us"] = time_kernel(call, iters=30, warmup=3).median_us
                    rec[f"host_{mode}_us"] = host(call, n=100) if T <= 1024 else float("nan")
                rec["equal"] = bool(torch.equal(outs["fused"], outs["separate"]))
                rows.append(rec)
                print(f"{name:18s} {quant:9s} {T:6d} {T * topk:7d} {rec['bn1']:4d} {rec['gpu_fused_us']:9.1f} "
                      f"{rec['gpu_separate_us']:8.1f} {rec['gpu_fused_us'] / rec['gpu_separate_us']:6.3f} "
                      f"{rec['host_fused_us']:10.1f} {rec['host_separate_us']:8.1f} {rec['equal']}"
                      f"{'  (1-stage)' if choice.run_1stage else ''}", flush=True)
                del x, outs
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
