"""Each WS variant in its own process (a fault kills the CUDA context): ok / error, rel err, µs."""
import json, subprocess, sys, os
CHILD = r'''
import sys, json, torch, triton
from tritune.kernels.gluon_gemm_ws import ws_gemm
kw = json.loads(sys.argv[1]); mode = kw.pop("mode")
M, N, K = 2048, 6144, 4096
torch.manual_seed(0)
if mode == "bf16":
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float().T; fn = lambda: ws_gemm(a, b, **kw)
else:
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn); b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // 128, device="cuda") + 0.5; sb = torch.rand(N // 128, K // 128, device="cuda") + 0.5
    ref = torch.einsum("mkq,nkq->mn", (a.float().view(M, K // 128, 128) * sa[:, :, None]), b.float().view(N, K // 128, 128) * sb.repeat_interleave(128, 0)[:, :, None])
    fn = lambda: ws_gemm(a, b, a_scale=sa, b_scale=sb, block_scaled=True, **kw)
out = fn(); torch.cuda.synchronize()
err = float((out.float() - ref).norm() / ref.norm())
ms = triton.testing.do_bench(fn, warmup=5, rep=30)
cub = triton.testing.do_bench(lambda: a @ b.T, warmup=5, rep=30) if mode == "bf16" else float("nan")
print("RESULT", json.dumps({"err": err, "us": ms * 1e3, "cublas_us": cub * 1e3, "tflops": 2 * M * N * K / ms / 1e9}))
'''
variants = json.loads(sys.argv[1])
for v in variants:
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(v)], capture_output=True, text=True, timeout=40,
                           env={**os.environ})
        line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT")), None)
        print(json.dumps(v), line or ("FAIL rc %d %s" % (r.returncode, r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else "")), flush=True)
    except subprocess.TimeoutExpired:
        print(json.dumps(v), "HANG (40 s)", flush=True)
