"""Does the kernel timed just before change a power-bound fp8 GEMM's time? (predecessor bias in timed_rounds)"""
import json, sys, time, torch, triton
sys.path.insert(0, "benchmarks")
from bench_gemm_gen2 import bf16_operands, fp8_operands
from bench_blockfp8_vllm import nearest_config, vendor_file
from probe_gluon_blockfp8 import vllm_kernel as load_peer
from tritune.ops import gemm_a8w8_blockscale
from tritune.kernels import gluon_gemm_ws as ws
from tritune.tuning.bench import time_kernel
import pathlib
m, n, k = 8192, 24576, 7168
f8 = fp8_operands(*bf16_operands(m, n, k))
a8, sa8, b8, sb8 = f8.a8, f8.sa8, f8.b8, f8.sb8
peer = load_peer(pathlib.Path("peers_vllm"))
cfg = nearest_config(json.loads(vendor_file(pathlib.Path("peers_vllm"), n, k).read_text()), m)
c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
def vllm():
    peer[grid](a8, b8, c, sa8, sb8, m, n, k, 128, 128, a8.stride(0), a8.stride(1), b8.stride(1), b8.stride(0), c.stride(0), c.stride(1), sa8.stride(0), sa8.stride(1), sb8.stride(1), sb8.stride(0), **cfg)
fns = {"scaled_mm": f8.scaled_mm, "vllm": vllm, "op": lambda: gemm_a8w8_blockscale(a8, b8, sa8, sb8),
       "ws": lambda: ws.ws_gemm(a8, b8, a_scale=sa8, b_scale=sb8, block_scaled=True, stages=5, group_m=8),
       "idle": lambda: time.sleep(0.3)}
t = lambda name: time_kernel(fns[name], iters=10, warmup=3).median_us if name != "idle" else fns[name]()
for name in fns:
    if name != "idle":
        fns[name](); torch.cuda.synchronize()

def settle(name, secs):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while time.perf_counter() - t0 < secs:
        for _ in range(4):
            fns[name]()
        torch.cuda.synchronize()
res = {}
for rep in range(2):
    for s in (0.0, 0.1, 0.3, 1.0):
        for pred in ("idle", "scaled_mm"):
            for who in ("ws", "scaled_mm", "vllm"):
                t(pred)
                settle(who, s)
                res.setdefault(f"{who:9s} settle {s} after {pred}", []).append(round(t(who), 1))
for kk, v in sorted(res.items()):
    print(f"{kk:36s} {v}")
