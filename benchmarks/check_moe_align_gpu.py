"""GPU check (not a CI test): moe_align_block_size on the GPU equals the torch reference exactly, and its time.

    PYTHONPATH=src python benchmarks/check_moe_align_gpu.py
"""

from __future__ import annotations

import torch

from tritune.kernels.moe_align import moe_align_block_size, moe_align_block_size_reference
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

CASES = [  # (tokens, experts, topk, skew): decode, prefill, many experts, skewed routing (zero-token experts)
    (1, 8, 2, 0.0), (7, 8, 2, 0.0), (128, 8, 2, 0.0), (1000, 8, 2, 0.0), (8192, 8, 2, 0.0),
    (3, 128, 8, 0.0), (333, 128, 8, 1.5), (4096, 128, 8, 0.0), (4096, 256, 8, 1.2), (16384, 64, 6, 0.0),
]


def main() -> None:
    bad = 0
    print(f"{'tokens':>7} {'E':>4} {'k':>2} {'skew':>4} {'BM':>4}  exact   us")
    for tokens, experts, topk, skew in CASES:
        _, ids = sample_routing(tokens, experts, topk, skew=skew, seed=tokens, device="cuda")
        for bm in (16, 64, 128):
            got = moe_align_block_size(ids, bm, experts)
            ref = moe_align_block_size_reference(ids, bm, experts)
            same = all(torch.equal(getattr(got, f), getattr(ref, f))
                       for f in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"))
            bad += not same
            us = time_kernel(lambda i=ids, b=bm, e=experts: moe_align_block_size(i, b, e), iters=50, warmup=5).median_us
            print(f"{tokens:>7} {experts:>4} {topk:>2} {skew:>4} {bm:>4}  {str(same):<6} {us:5.1f}")
    print("ALL EXACT" if bad == 0 else f"{bad} MISMATCHES")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
