"""GPU check (not a CI test): moe_align_block_size on the GPU equals the torch reference exactly, and its time.

    PYTHONPATH=src python benchmarks/check_moe_align_gpu.py
    PYTHONPATH=src python benchmarks/check_moe_align_gpu.py --self-scan-ab

--self-scan-ab times the sort's kernels (torch.profiler, GPU time only, so the per-call binding is not counted) with
the scatter programs re-reading every chunk's counts (`SELF_SCAN_COUNTS` as shipped, where it applies) against one
scan launch (`SELF_SCAN_COUNTS` 0), at the sizes where the self-scan grows with the square of the chunk count.
"""

from __future__ import annotations

import sys

import torch

from tritune.kernels import moe_align
from tritune.kernels.moe_align import moe_align_block_size, moe_align_block_size_reference
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

CASES = [  # (tokens, experts, topk, skew): decode, prefill, many experts, skewed routing (zero-token experts)
    (1, 8, 2, 0.0), (7, 8, 2, 0.0), (128, 8, 2, 0.0), (1000, 8, 2, 0.0), (8192, 8, 2, 0.0),
    (3, 128, 8, 0.0), (333, 128, 8, 1.5), (4096, 128, 8, 0.0), (4096, 256, 8, 1.2), (16384, 64, 6, 0.0),
]


SCAN_CASES = [(tokens, 128, 8) for tokens in (1024, 2048, 4096, 8192)] + [(4096, 64, 6), (16384, 8, 2)]


def sort_kernel_us(ids: torch.Tensor, bm: int, experts: int, iters: int = 20) -> float:
    """GPU µs per sort call: the sum of its kernels' times under torch.profiler (after 3 warm-up calls)."""
    from profile_moe_kernels import device_events  # benchmarks/, beside this script

    events = device_events(lambda: moe_align_block_size(ids, bm, experts), iters)
    return sum(e.time_range.elapsed_us() for e in events) / iters


def self_scan_ab() -> int:
    """Both multi-launch paths of the sort, each checked against the reference, timed by their kernels."""
    bad = 0
    shipped = moe_align.SELF_SCAN_COUNTS
    print(f"{'tokens':>7} {'E':>4} {'k':>2} {'BM':>4} {'chunks x E':>10}  self-scan us  scan launch us")
    for tokens, experts, topk in SCAN_CASES:
        _, ids = sample_routing(tokens, experts, topk, seed=tokens, device="cuda")
        for bm in (64, 128):
            ref = moe_align_block_size_reference(ids, bm, experts)
            times = []
            for limit in (shipped, 0):
                moe_align.SELF_SCAN_COUNTS = limit
                got = moe_align_block_size(ids, bm, experts)
                bad += not all(torch.equal(getattr(got, f), getattr(ref, f))
                               for f in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"))
                times.append(sort_kernel_us(ids, bm, experts))
            moe_align.SELF_SCAN_COUNTS = shipped
            counts = -(-tokens * topk // moe_align.CHUNK) * experts
            print(f"{tokens:>7} {experts:>4} {topk:>2} {bm:>4} {counts:>10}  {times[0]:12.1f}  {times[1]:14.1f}")
    print("ALL EXACT" if bad == 0 else f"{bad} MISMATCHES")
    return 1 if bad else 0


def main() -> None:
    if "--self-scan-ab" in sys.argv[1:]:
        raise SystemExit(self_scan_ab())
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
