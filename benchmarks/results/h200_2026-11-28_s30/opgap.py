"""Why the block-scaled op is slower than ws_gemm with the same config at large M."""
import hashlib, json, sys, torch, triton
sys.path.insert(0, "benchmarks")
from bench_gemm_gen2 import bf16_operands, fp8_operands
from probe_util import checked_rounds
from tritune.ops import gemm_a8w8_blockscale
import importlib; opg = importlib.import_module("tritune.ops.gemm")
from tritune.kernels import gluon_gemm_ws as ws
from tritune.tuning.bench import time_kernel

for m in (4096, 8192):
    n, k = 24576, 7168
    f8 = fp8_operands(*bf16_operands(m, n, k))
    a8, sa8, b8, sb8 = f8.a8, f8.sa8, f8.b8, f8.sb8
    out = gemm_a8w8_blockscale(a8, b8, sa8, sb8)
    plan = next(iter(opg._PLANS.values()))
    c_op = plan.main.compiled
    print("config", opg.select_config("a8w8_blockscale", m, n, k, a8.device))
    print("op launch grid", plan.main.grid, "meta", {kk: getattr(c_op.metadata, kk, None) for kk in ("num_warps", "num_stages", "maxnreg", "shared")}, "regs", c_op.n_regs, "spills", c_op.n_spills)
    ws_out = ws.ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, stages=5, group_m=8)
    dev_cache = ws.ws_gemm_kernel.device_caches[0][0]
    for key, ck in dev_cache.items():
        print("ws cache entry", hashlib.md5(ck.asm["ptx"].encode()).hexdigest()[:10], {kk: getattr(ck.metadata, kk, None) for kk in ("num_warps", "num_stages", "maxnreg", "shared")}, "regs", ck.n_regs, str(key)[:300])
    print("op ptx", hashlib.md5(c_op.asm["ptx"].encode()).hexdigest()[:10], "same result", torch.equal(out, ws_out))
    pre = torch.empty_like(out)
    timer = lambda fn: time_kernel(fn, iters=10, warmup=3).median_us
    calls = {
        "op": (lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8), f8.ref_blocks),
        "op_out": (lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8, out=pre), f8.ref_blocks),
        "ws": (lambda: ws.ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, stages=5, group_m=8), f8.ref_blocks),
        "ws_out": (lambda: ws.ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, stages=5, group_m=8, out=pre), f8.ref_blocks),
    }
    row = checked_rounds(calls, timer, 5)
    print(m, json.dumps(row))
    # the op's bound kernel launched with descriptors made by Triton's launcher path? time plan directly
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    for name, fn in (("op", lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8, out=pre)), ("ws", lambda: ws.ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, stages=5, group_m=8, out=pre))) * 2:
        fn(); torch.cuda.synchronize()
        st.record()
        for _ in range(20):
            fn()
        en.record(); torch.cuda.synchronize()
        print(m, "back-to-back", name, st.elapsed_time(en) / 20 * 1000, "us")
    opg._PLANS.clear()
