"""Where the host time of one op call goes (GPU box): each piece of the bound GEMM call timed alone.

    PYTHONPATH=src python3 benchmarks/profile_host.py
"""

from __future__ import annotations

import statistics
import time

import torch


def per_call(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def _tiny_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tiny(x_ptr):
        tl.store(x_ptr, 1.0)

    @triton.jit
    def wide(x_ptr, y_ptr, z_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
             C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr):
        tl.store(x_ptr, 1.0)

    return tiny, wide


def main() -> None:
    import triton

    from tritune import ops
    from tritune.kernels import gemm as gk
    from tritune.kernels.launch import _direct_launch

    print("Triton", triton.__version__)
    a = torch.randn(16, 256, device="cuda").bfloat16()
    b = torch.randn(256, 256, device="cuda").bfloat16()
    out = torch.empty(16, 256, device="cuda", dtype=torch.bfloat16)
    cfg = gk.GemmConfig(16, 64, 128, 1, 4, 3)
    plan = gk.GemmLaunch("bf16", a, b, None, None, out, cfg)
    run_closure = plan.main.launch
    print("direct C launch:", _direct_launch(gk._gemm_kernel.warmup(a, b, out, a, a, a, a, *plan._tail, grid=(1,),
                                                                    num_warps=4, num_stages=3).run) is not None)
    pa, pb, po = a.data_ptr(), b.data_ptr(), out.data_ptr()
    from tritune.kernels.launch import BoundKernel

    tiny, wide = _tiny_kernels()
    x = torch.zeros(16, device="cuda")
    bt = BoundKernel(tiny, (1,), (x,), varying=1, num_warps=1, num_stages=1)
    bw = BoundKernel(wide, (1,), (x, x, x, *range(3, 19), 1, 2, 3, 4, 5), varying=3, num_warps=1, num_stages=1)
    px = x.data_ptr()
    rows = {
        "x.add_(1) (a torch launch)": lambda: x.add_(1),
        "bound tiny kernel (1 ptr)": lambda: bt(px),
        "bound wide kernel (3 ptr + 16 int + 5 constexpr)": lambda: bw(px, px, px),
        "torch.matmul": lambda: a @ b.T,
        "torch.empty(16x256)": lambda: torch.empty(16, 256, device=a.device, dtype=torch.bfloat16),
        "key-like tuple": lambda: ("bf16", None, a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(),
                                   b.dtype, b.device, a.data_ptr() & 15, b.data_ptr() & 15, out.data_ptr() & 15),
        "a.device": lambda: a.device,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "bound launch (tensors)": lambda: plan(a, b, None, None, out),
        "bound launch (ints)": lambda: run_closure(pa, pb, po, pa, pa, pa, pa),
        "ops.gemm(out=)": lambda: ops.gemm(a, b, out=out, config=cfg),
        "ops.gemm()": lambda: ops.gemm(a, b, config=cfg),
        "ops.gemm() selected": lambda: ops.gemm(a, b),
        "torch.matmul again": lambda: a @ b.T,
        "triton JIT launch": lambda: gk._gemm_kernel[(4, 1)](a, b, out, a, a, a, a, *plan._tail, num_warps=4,
                                                              num_stages=3),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {per_call(fn):7.2f} us")


if __name__ == "__main__":
    main()
