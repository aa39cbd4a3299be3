"""Scratch probe (not a benchmark of record): GPU correctness and timing of a few fused-MoE configs on Mixtral."""
import itertools, json, os, sys, time
import torch
from tritune.kernels import fused_moe as fm
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.moe_reference import fused_moe_reference, stage1_reference
from tritune.ops.routing import sample_routing
from tritune.tuning.bench import time_kernel

C = fm.MoeConfig
D, I, E, K = 4096, 14336, 8, 2
dev = "cuda"
torch.manual_seed(0)
w1 = (torch.randn(E, 2 * I, D, device=dev) / D**0.5).bfloat16()
w2 = (torch.randn(E, D, I, device=dev) / I**0.5).bfloat16()
rows = []
def t(fn):
    return time_kernel(fn, iters=20, warmup=5, flush_l2=True, l2_bytes=50 * 2**20).median_us

for T in [int(x) for x in sys.argv[1].split(",")]:
    h = torch.randn(T, D, device=dev).bfloat16()
    tw, ti = sample_routing(T, E, K, seed=1, device=dev)
    ref = fused_moe_reference(h, w1, w2, tw, ti)
    flops = 2 * T * K * 3 * D * I
    routed = torch.unique(ti).numel()
    floor = max(flops / 784e12, routed * 3 * D * I * 2 / 3.0e12) * 1e6
    # grouped_mm baseline: the two GEMMs on expert-sorted rows
    order = torch.argsort(ti.flatten(), stable=True)
    counts = torch.bincount(ti.flatten(), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = h[order // K]
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    def gmm():
        y = torch._grouped_mm(xs, w1t, offs=offs)
        z = torch.nn.functional.silu(y[:, :I]) * y[:, I:]
        return torch._grouped_mm(z, w2t, offs=offs)
    def gmm2():
        torch._grouped_mm(xs, w1t, offs=offs); torch._grouped_mm(xs[:, :I].repeat(1, 4)[:, :I].contiguous() if False else z_in, w2t, offs=offs)
    z_in = torch.randn(xs.shape[0], I, device=dev).bfloat16()
    t_gmm = t(gmm2)
    print(f"T={T} floor {floor:.0f}us grouped_mm(2 gemms) {t_gmm:.0f}us", flush=True)
    best = {}
    BMs = [16] if T <= 8 else [16, 32, 64] if T <= 128 else [64, 128]
    for BM in BMs:
        sorting = moe_align_block_size(ti, BM, E)
        inter = stage1_reference(h, w1, tw, ti, inter_dim=I).bfloat16()
        for kern in ("stage1", "stage2"):
            for BN, BK, W, S, KS, TMA in itertools.product([64, 128, 256] if T <= 128 else [128, 256], [64, 128] if T <= 128 else [64], [4, 8], [3, 4], [1, 2] if T <= 32 else [1], [0, 1]):
                if BM * BN > 128 * 256 or (BN == 256 and BK == 128 and S == 4): continue
                if kern == "stage1" and BM * BN * BK * S > 128 * 128 * 64 * 4: continue
                cfg = C(BM, BN, BK, 8, W, S, KS, 0, TMA)
                try:
                    if kern == "stage1":
                        fn = lambda: fm.moe_stage1(h, w1, tw, moe_align_block_size(ti, BM, E), cfg, inter_dim=I)
                    else:
                        fn = lambda: fm.moe_stage2(inter, w2, tw, sorting, cfg)
                    fn(); torch.cuda.synchronize()
                    us = t(fn)
                except Exception as e:
                    print("  fail", kern, cfg, str(e)[:80]); continue
                print(f"    {kern} {cfg} {us:.0f}", flush=True)
                key = (kern, BM)
                if key not in best or us < best[key][0]:
                    best[key] = (us, cfg)
        print(f"  BM{BM}: s1 {best[('stage1',BM)][0]:.0f} {best[('stage1',BM)][1]}  s2 {best[('stage2',BM)][0]:.0f} {best[('stage2',BM)][1]}", flush=True)
    bm = min(BMs, key=lambda b: best[("stage1", b)][0] + best[("stage2", b)][0])
    c1, c2 = best[("stage1", bm)][1], best[("stage2", bm)][1]
    op = lambda: fm.fused_moe_2stage(h, w1, w2, tw, ti, c1, c2)
    out = op(); err = ((out.float() - ref).norm() / ref.norm()).item()
    e2e = t(op)
    one = None
    if T <= 64:
        for BM, BN, BK, BD, W, S in itertools.product([16], [32, 64, 128], [64, 128], [64, 128], [4, 8], [3, 4]):
            cfg = C(BM, BN, BK, 8, W, S, 1, BD)
            fn = lambda: fm.fused_moe_1stage(h, w1, w2, tw, ti, cfg)
            try:
                o = fn(); torch.cuda.synchronize(); us = t(fn)
            except Exception as e:
                print("  fail 1stage", cfg, str(e)[:80]); continue
            e1 = ((o.float() - ref).norm() / ref.norm()).item()
            if one is None or us < one[0]: one = (us, cfg, e1)
    print(f"T={T} e2e {e2e:.0f}us ({e2e/floor:.2f}x floor, {t_gmm/e2e:.2f}x vs gmm) err {err:.1e} 1stage {one}", flush=True)
