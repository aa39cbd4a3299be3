"""Which K order the swapped MXFP4 decode should read (issue 16): the same swapped GEMM with four byte orders.

The swapped stage GEMM decodes each weight tile by packed PTX and hands it to the wgmma as the register operand. In
the standard order (element 2j in byte j's low nibble) the wgmma fragment wants bytes t and t + 4 of every 8, so
Triton 3.6 reads shared memory a byte at a time and interleaves the decoded halves with byte permutes. The product
does not change if the weights' and the activations' K indices are permuted alike, so the decode may read the bytes
in whatever order the fragment likes. Modes (gpt-oss-120b's GEMMs, one grid (N / BLOCK_N, experts)):

- 0: standard order, decoded halves interleaved (the op before this probe);
- 2: bytes re-ordered on the host so that byte 4t + 2g + i of each 16-byte chunk holds K 16g + 2t + i (low nibble)
  and 16g + 8 + 2t + i (high); decoded as `kernels.mxfp4.mxfp4_tile_k32` does (the op now reads the standard bytes
  that way and permutes the activations instead: the same arithmetic);
- 3: standard bytes, the decoded tile's columns permuted in registers (a 4 × 4 byte transpose), activations loaded
  permuted in pairs;
- 4: standard bytes read as mode 2 reads them, activations loaded permuted element by element.

Each variant is checked against x · dequant(w)ᵀ in fp32 (rel. L2 under 1e-2) before it is timed. GPU only (PTX).

    PYTHONPATH=src python benchmarks/probe_mxfp4_byte_order.py --out $OUT/probe_mxfp4_byte_order.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from tritune.kernels.mxfp4 import _HIGH_NIBBLES_PTX, _LOW_NIBBLES_PTX, _e2m1_pairs, mxfp4_codes  # noqa: E402

MODES = (0, 2, 3, 4)
TILES = ((64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4))  # BLOCK_N, BLOCK_K, warps, stages
# (label, routed experts, rows each): gpt-oss-120b top-4 over 128 experts at 16, 64 and 256 tokens.
POINTS = (("16 tokens", 64, 1), ("64 tokens", 111, 2), ("256 tokens", 128, 8))
PROBLEMS = ((5760, 2880), (2880, 2880))  # stage 1 [2I, D], stage 2 [D, I]


@triton.jit
def _decode(packed, sc, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    sb = tl.reshape(tl.broadcast_to(sc.to(tl.bfloat16)[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
    lo = _e2m1_pairs(packed, sb, _LOW_NIBBLES_PTX)
    hi = _e2m1_pairs(packed, sb, _HIGH_NIBBLES_PTX)
    if MODE == 0:
        w = tl.interleave(lo, hi)
    elif MODE == 3:
        w = tl.interleave(lo, hi)
        w = tl.reshape(tl.permute(tl.reshape(w, (BN, BK // 32, 4, 4, 2)), (0, 1, 3, 2, 4)), (BN, BK))
    else:
        lo5 = tl.permute(tl.reshape(lo, (BN, BK // 32, 4, 2, 2)), (0, 1, 3, 2, 4))
        hi5 = tl.permute(tl.reshape(hi, (BN, BK // 32, 4, 2, 2)), (0, 1, 3, 2, 4))
        w = tl.join(tl.reshape(lo5, (BN, BK // 32, 2, 8)), tl.reshape(hi5, (BN, BK // 32, 2, 8)))
        w = tl.reshape(tl.permute(w, (0, 1, 2, 4, 3)), (BN, BK))
    return w


@triton.jit
def _swapped_gemv(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    """out[e, m, n] = sum_k x[e, m, k] w[e, n, k]: x bf16 [E, M, K] (M <= 16), w packed [E, N, K/2], s [E, N, K/32]."""
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows_out = pid * BN + tl.arange(0, BN)
    rows = (rows_out % N).to(tl.int64)
    acc = tl.zeros([BN, 16], tl.float32)
    jk = tl.arange(0, BK)
    m = tl.arange(0, 16)
    r = jk % 32
    if MODE == 3:  # column 32q + 8t + 2j + h is K 32q + 8j + 2t + h
        kk = (jk // 32) * 32 + ((r % 8) // 2) * 8 + (r // 8) * 2 + jk % 2
        kk = tl.max_contiguous(tl.multiple_of(kk, 2), 2)
    elif MODE == 4:  # column 32q + 16g + 8h + 2t + i is K 32q + 8t + 4g + 2i + h
        kk = (jk // 32) * 32 + ((r % 8) // 2) * 8 + (r // 16) * 4 + (r % 2) * 2 + (r % 16) // 8
    else:
        kk = jk
    x_base = x_ptr + e * M * K + m[None, :] * K
    for k in range(0, K, BK):
        xt = tl.load(x_base + (k + kk)[:, None], mask=m[None, :] < M, other=0.0)
        packed, sc = mxfp4_codes(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), rows, k, K // 2, K // 32, K, BK)
        acc = tl.dot(_decode(packed, sc, BN, BK, MODE), xt, acc)
    acc = tl.trans(acc)
    tl.store(out_ptr + e * M * N + m[:, None] * N + rows_out[None, :], acc,
             mask=(m[:, None] < M) & (rows_out[None, :] < N))


def _run(grid: tuple[int, int], x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor,
         meta: dict) -> torch.Tensor:
    _swapped_gemv[grid](x, w, s, out, x.shape[1], w.shape[1], x.shape[2], **meta)
    return out


def host_reorder(packed: torch.Tensor) -> torch.Tensor:
    """Standard packed bytes [..., K/2] -> mode 2's: byte 4t + 2g + i of each 16 holds K 16g + 2t + i (low nibble)
    and 16g + 8 + 2t + i (high)."""
    from tritune.kernels.mxfp4_format import unpack_e2m1

    codes = unpack_e2m1(packed)  # [..., K]
    lead, k = codes.shape[:-1], codes.shape[-1]
    d = len(lead) + 1
    c = codes.reshape(*lead, k // 32, 2, 2, 4, 2)  # K = 32q + 16g + 8h + 2t + i: (g, h, t, i)
    c = c.permute(*range(d), d + 2, d, d + 3, d + 1).reshape(*lead, k // 2, 2)  # (t, g, i) bytes, (h) nibbles
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8).contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_mxfp4_byte_order: needs a GPU (the decode is PTX)", file=sys.stderr)
        return 2
    from tritune.kernels.mxfp4_format import dequantize_mxfp4, quantize_mxfp4
    from tritune.tuning.bench import time_kernel

    rows = []
    for (label, experts, m), (n, k) in itertools.product(POINTS, PROBLEMS):
        gen = torch.Generator(device="cuda").manual_seed(n + experts)
        w, s = quantize_mxfp4(torch.randn(experts, n, k, generator=gen, device="cuda") / k**0.5)
        reordered = host_reorder(w)
        x = (torch.randn(experts, m, k, generator=gen, device="cuda") / 2).to(torch.bfloat16)
        ref = torch.einsum("emk,enk->emn", x.float(), dequantize_mxfp4(w, s, torch.float32))
        for mode, (bn, bk, warps, stages) in itertools.product(MODES, TILES):
            out = torch.empty(experts, m, n, device="cuda", dtype=torch.float32)
            run = functools.partial(_run, (triton.cdiv(n, bn), experts), x, reordered if mode == 2 else w, s, out,
                                    dict(BN=bn, BK=bk, MODE=mode, num_warps=warps, num_stages=stages))

            row = {"point": label, "problem": f"{n}x{k}", "mode": mode, "BLOCK_N": bn, "BLOCK_K": bk,
                   "num_warps": warps, "num_stages": stages}
            try:
                row["rel_l2"] = float((run() - ref).norm() / ref.norm())
                row["us"] = time_kernel(run, iters=args.iters, warmup=3).median_us
            except Exception as err:  # noqa: BLE001 - a variant the compiler refuses is a result
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    pathlib.Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                                  "torch": torch.__version__, "rows": rows}, indent=1))
    print("\npoint | problem | mode | best µs | tile (BLOCK_K, stages)")
    key = lambda r: (r["point"], r["problem"], r["mode"])  # noqa: E731
    wrong = 0
    for group_key, group in itertools.groupby(sorted(rows, key=key), key=key):
        group = list(group)
        wrong += sum(1 for r in group if r.get("rel_l2", 0.0) > 1e-2)
        ok = [r for r in group if "us" in r and r["rel_l2"] <= 1e-2]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        print(" | ".join(map(str, group_key)) + " | " +
              (f"{best['us']:.1f} | {best['BLOCK_K']}, {best['num_stages']}" if best else "all failed"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
