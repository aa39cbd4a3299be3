"""Tuning your own Triton kernel with tritune: a flash-attention forward pass made tunable in one decoration.

`attention` is the tuned kernel (tritune.tunable_kernel over `_attn_fwd`), `flash_attention(q, k, v, causal)` the
function a model calls. Run `python examples/flash_attention.py [--store PATH]`: on a GPU it tunes 24 shapes and
compares with torch SDPA, then runs again to show the stored winners being reused; without a GPU it tunes one tiny
shape through Triton's interpreter (correctness only).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any @triton.jit: Triton reads this when a kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tritune  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the fast hardware path


@triton.jit
def _attn_fwd(
    Q, K, V, Out,  # [Z, H, N_CTX, HEAD_DIM] each, fp16/bf16/fp32 (Out the dtype of Q)
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    sm_scale,  # float: softmax scale, usually HEAD_DIM ** -0.5
    Z, H, N_CTX,
    HEAD_DIM: tl.constexpr,  # a power of two >= 16
    CAUSAL: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,  # query rows per program
    BLOCK_SIZE_N: tl.constexpr,  # keys per step of the inner loop
):
    """Out = softmax(Q Kᵀ · sm_scale [+ causal mask]) V for one BLOCK_SIZE_M tile of queries of one (z, h).

    Grid: (cdiv(N_CTX, BLOCK_SIZE_M), Z * H, 1). Keys stream through in BLOCK_SIZE_N steps with the running max and
    sum of the softmax kept in fp32 (online softmax), so the N_CTX x N_CTX scores never exist in memory. Rows and
    keys past N_CTX are masked, so N_CTX need not be a multiple of either block.
    """
    tile_m = tl.program_id(0)
    zh = tl.program_id(1)
    z = zh // H
    h = zh % H
    rows = tile_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    cols = tl.arange(0, BLOCK_SIZE_N)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < N_CTX
    # fp32 inputs keep fp32 products (no TF32), so the fp32 result matches an fp32 reference closely.
    precision: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"

    q_tile = Q + z * stride_qz + h * stride_qh + rows[:, None] * stride_qm + dims[None, :] * stride_qd
    q = tl.load(q_tile, mask=row_ok[:, None], other=0.0)
    k_head = K + z * stride_kz + h * stride_kh
    v_head = V + z * stride_vz + h * stride_vh

    row_max = tl.full([BLOCK_SIZE_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_SIZE_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_SIZE_M, HEAD_DIM], dtype=tl.float32)
    scale = sm_scale * 1.4426950408889634  # log2(e): scores in base 2
    # Causal: keys after this tile's last row are masked for every row of it, so the loop stops there.
    end = tl.minimum((tile_m + 1) * BLOCK_SIZE_M, N_CTX) if CAUSAL else N_CTX
    for start in range(0, end, BLOCK_SIZE_N):
        keys = start + cols
        key_ok = keys < N_CTX
        k = tl.load(k_head + keys[None, :] * stride_kn + dims[:, None] * stride_kd, mask=key_ok[None, :], other=0.0)
        scores = tl.dot(q, k, input_precision=precision) * scale  # [BLOCK_SIZE_M, BLOCK_SIZE_N], fp32
        keep = key_ok[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        # Every row sees key 0 in the first step, so new_max is finite from then on and no exp2 sees inf - inf.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_head + keys[:, None] * stride_vn + dims[None, :] * stride_vd, mask=key_ok[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
        row_max = new_max
    acc = acc / row_sum[:, None]
    o_tile = Out + z * stride_oz + h * stride_oh + rows[:, None] * stride_om + dims[None, :] * stride_od
    tl.store(o_tile, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


def attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool,
                   sm_scale: float | None = None) -> dict:
    """Every non-config argument of `_attn_fwd` for q, k, v, out of shape [Z, H, N_CTX, HEAD_DIM]."""
    Z, H, N_CTX, HEAD_DIM = q.shape
    if k.shape != q.shape or v.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"q, k, v, out must share one shape, got {[tuple(t.shape) for t in (q, k, v, out)]}")
    if HEAD_DIM < 16 or HEAD_DIM & (HEAD_DIM - 1):
        raise ValueError(f"HEAD_DIM must be a power of two >= 16, got {HEAD_DIM}")
    args = {"Q": q, "K": k, "V": v, "Out": out}
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        args.update(zip([f"stride_{prefix}{s}" for s in ("z", "h", "m" if prefix in "qo" else "n", "d")],
                        t.stride(), strict=True))
    args.update(sm_scale=HEAD_DIM ** -0.5 if sm_scale is None else float(sm_scale), Z=Z, H=H, N_CTX=N_CTX,
                HEAD_DIM=HEAD_DIM, CAUSAL=bool(causal))
    return args


def make_inputs(problem: dict, device: torch.device) -> dict:
    """problem = {"Z", "H", "N_CTX", "HEAD_DIM", "CAUSAL", "dtype": "fp16" | "bf16" | "fp32"}; the caller seeds."""
    shape = (problem["Z"], problem["H"], problem["N_CTX"], problem["HEAD_DIM"])
    dtype = DTYPES[problem["dtype"]]
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    return attention_args(q, k, v, torch.empty_like(q), problem["CAUSAL"])


def attention_reference(args: dict) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale, causal mask) V in fp32, [Z, H, N_CTX, HEAD_DIM]."""
    q, k, v = (args[name].float() for name in ("Q", "K", "V"))
    scores = q @ k.transpose(-1, -2) * args["sm_scale"]
    if args["CAUSAL"]:
        n = q.shape[-2]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_flops(meta: dict) -> float:
    """QKᵀ and PV: 2 · 2 · Z · H · N_CTX² · HEAD_DIM, halved when causal."""
    flops = 4.0 * meta["Z"] * meta["H"] * meta["N_CTX"] ** 2 * meta["HEAD_DIM"]
    return flops / 2 if meta["CAUSAL"] else flops


SPACE = {"BLOCK_SIZE_M": (64, 128), "BLOCK_SIZE_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
INTERPRETER_SPACE = {"BLOCK_SIZE_M": (16, 32), "BLOCK_SIZE_N": (16, 32), "num_warps": (4,), "num_stages": (2,)}

attention = tritune.tunable_kernel(
    space=SPACE,
    key=("Z", "H", "N_CTX", "HEAD_DIM", "CAUSAL"),
    inputs=make_inputs,
    reference=attention_reference,
    output="Out",
    grid=("cdiv(N_CTX, BLOCK_SIZE_M)", "Z * H", "1"),
    constraints={
        "BLOCK_SIZE_N > BLOCK_SIZE_M": lambda m: m["BLOCK_SIZE_N"] <= m["BLOCK_SIZE_M"],
        "128x128 score tile on 4 warps": lambda m: m["BLOCK_SIZE_M"] * m["BLOCK_SIZE_N"] < 128 * 128
        or m["num_warps"] == 8,  # 128 fp32 scores per thread on top of the accumulator: spills
    },
    flops=attention_flops,
    name="flash_attention",
)(_attn_fwd)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale) v for q, k, v of shape [Z, H, N_CTX, HEAD_DIM], with the tuned config."""
    out = torch.empty_like(q)
    attention(**attention_args(q, k, v, out, causal, sm_scale))
    return out


# ---- the demo -----------------------------------------------------------------------------------------------

def _gpu_problems() -> list[dict]:
    return [dict(Z=4, H=16, N_CTX=n, HEAD_DIM=d, CAUSAL=c, dtype=dt)
            for dt in ("fp16", "bf16") for c in (False, True) for d in (64, 128) for n in (1024, 2048, 4096)]


def _sdpa_us(problem: dict) -> float:
    from tritune.tuning.bench import time_kernel

    torch.manual_seed(0)
    shape = (problem["Z"], problem["H"], problem["N_CTX"], problem["HEAD_DIM"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[problem["dtype"]]) for _ in range(3))
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=problem["CAUSAL"])  # noqa: E731
    return time_kernel(fn, iters=20, warmup=3).median_us


def _table(problems: list[dict], results: list, sdpa: list[float]) -> list[str]:
    lines = [f"{'Z':>2} {'H':>3} {'N_CTX':>5} {'D':>4} {'causal':>6} {'dtype':>5}  {'config':<58} "
             f"{'us':>9} {'TFLOP/s':>8} {'SDPA us':>9} {'vs SDPA':>7}  source"]
    for p, r, base in zip(problems, results, sdpa, strict=True):
        config = ", ".join(f"{k}={v}" for k, v in sorted((r.config or {}).items())) or "(every candidate failed)"
        tflops = attention_flops(p) / (r.time_us * 1e-6) / 1e12 if math.isfinite(r.time_us) else math.nan
        source = "store (reused)" if r.reused else f"tuned: {r.measured} measured, {r.failed} failed"
        lines.append(f"{p['Z']:>2} {p['H']:>3} {p['N_CTX']:>5} {p['HEAD_DIM']:>4} {str(p['CAUSAL']):>6} "
                     f"{p['dtype']:>5}  {config:<58} {r.time_us:>9.1f} {tflops:>8.1f} {base:>9.1f} "
                     f"{base / r.time_us:>6.2f}x  {source}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=None, help="results file (default: see tunable_kernel)")
    args = parser.parse_args(argv)
    from tritune.tuning.tuner import TuneSettings
    from tritune.tuning.types import BenchSettings

    if args.store is not None:
        attention.store_path = args.store
    store = attention.store_path
    journal = store.parent / f"{attention.name}.journal.sqlite"
    gpu = torch.cuda.is_available()
    if gpu:
        problems, space, label = _gpu_problems(), None, ""
        settings = TuneSettings(journal_path=journal)
    else:
        print("no GPU: tuning one tiny problem through Triton's interpreter "
              "(interpreter: correctness only, timings meaningless)")
        problems = [dict(Z=1, H=2, N_CTX=50, HEAD_DIM=16, CAUSAL=True, dtype="fp16")]
        space, label = INTERPRETER_SPACE, " (interpreter: correctness only, timings meaningless)"
        settings = TuneSettings(journal_path=journal, bench=BenchSettings(iters=2, warmup=1), progress=False)
    print(f"store: {store}")
    sdpa = [_sdpa_us(p) for p in problems]
    for run in ("first run", "second run"):
        results = attention.tune(problems, settings=settings, space=space)
        print(f"\n{run}{label}:")
        print("\n".join(_table(problems, results, sdpa)))
    # The function a model calls picks the stored config for its shape; check it against the reference.
    p = problems[0]
    torch.manual_seed(1)
    args_ = make_inputs(p, torch.device("cuda" if gpu else "cpu"))
    out = flash_attention(args_["Q"], args_["K"], args_["V"], p["CAUSAL"])
    err = (out.float() - attention_reference(args_)).abs().max().item()
    print(f"\nflash_attention with config {attention.best_config(args_)}: max |out - reference| = {err:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
