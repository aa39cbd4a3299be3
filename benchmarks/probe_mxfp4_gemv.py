"""What bounds MXFP4 at decode sizes (issue 16): the same weight stream timed with less and less work on it.

At 1-64 tokens gpt-oss-120b's MoE gives each routed expert 1-2 rows, so its stage GEMMs are matrix-vector products:
the time should be the MXFP4 bytes at the copy bandwidth. The op's stage pair runs 2.6-5.9× that floor, and neither
a cheaper register decode (PTX, ~4 integer ops a weight) nor 8 warps nor fp32 multiply-adds moved it. This probe
takes the stage-1 and stage-2 GEMMs of one expert set out of the op and times, on one grid
(N / BLOCK_N, experts, SPLIT_K), kernels that do progressively more with each tile:

- `load`:  load the packed codes and the scales, fold them into an integer checksum (the load bound of this tiling);
- `bf16`:  the same GEMV with bf16 weights (what 16-bit weights reach on the same tiling);
- `fma`:   decode in fp32, scale each weight, multiply-add with the rows (the op's multiply-add path);
- `fma_blockscale`: decode, multiply-add, and scale each 32-block's partial sum once (one multiply per 32 weights);
- `dot_scaled`: 16-row `tl.dot_scaled` (the op's MXFP4 path; rows past M are zero);
- `dot_bf16`: 16-row `tl.dot` on bf16 weights (the op's bf16 path).
- `gemv`: the tile as [BLOCK_N, BLOCK_K/32, 16] bytes, so a 32-weight block's 16 bytes sit in one thread: decode in
  fp32, multiply-add with the rows (at most 2), sum the block in the thread, scale the sum once, and reduce across
  threads only after the K loop (the `fma` modes reduce across threads every step);
- `gemv_asm`: `gemv` with the decode in PTX (`_E2M1_F32_PTX`: 5 integer ops and one multiply a weight).
- `swap_asm`: the weights as the MMA's left operand, Cᵀ = W·Xᵀ: the tile decoded to bf16 through packed PTX
  (`_e2m1_pairs`, as `kernels.mxfp4.mxfp4_tile` under TRITUNE_MXFP4_DECODE=asm), then `tl.dot(w, xᵀ)` with 16
  token columns. Hopper's wgmma takes its left operand from registers, so the decoded tile need not pass through
  shared memory (the right operand must): the orientation triton_kernels' Hopper MXFP4 matmul runs (its SWAP_XW).
- `swap_ops`: `swap_asm` with Triton's own integer decode (`mxfp4_tile`'s default).
- `swap_dot_scaled`, `swap_bf16`: the same orientation through `tl.dot_scaled` on the codes, and with bf16 weights.

Split-K programs add their partial sums with fp32 atomics into a zeroed output. Each variant is checked against
x · dequant(w)ᵀ in fp32 first (rel. L2 in the JSON); `load` is checked against its own checksum.

    PYTHONPATH=src python benchmarks/probe_mxfp4_gemv.py --out $OUT/probe_mxfp4_gemv.json          # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_mxfp4_gemv.py --tiny --out F          # interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from probe_util import checked_time  # noqa: E402

from tritune.kernels.mxfp4 import (  # noqa: E402
    _HIGH_NIBBLES_PTX,
    _LOW_NIBBLES_PTX,
    _e2m1_pairs,
    decode_e2m1,
    e8m0_to_fp32,
    mxfp4_codes,
    mxfp4_tile,
)

MODES = {"load": 0, "bf16": 1, "fma": 2, "fma_blockscale": 3, "dot_scaled": 4, "dot_bf16": 5, "gemv": 6,
         "gemv_asm": 7, "swap_asm": 8, "swap_dot_scaled": 9, "swap_bf16": 10, "swap_ops": 11}
MMA_MODES = ("dot_scaled", "dot_bf16", "swap_asm", "swap_dot_scaled", "swap_bf16", "swap_ops")
ASM_MODES = ("gemv_asm", "swap_asm")
GEMV_MODES = ("gemv", "gemv_asm")
BYTES_PER_S = 3.0e12  # measured H100 copy bandwidth, as the other benchmarks
# gpt-oss-120b (D = I = 2880): stage 1 is [2I, D] per expert, stage 2 [D, I].
PROBLEMS = {"stage1": (5760, 2880), "stage2": (2880, 2880)}
# (label, routed experts, rows per expert): 1 token top-4; 64 tokens top-4 over 128 experts (~111 routed, 2 rows).
POINTS = (("1 token", 4, 1), ("64 tokens", 111, 2))
TILES = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
         for bn, bk, sk, w, st in ((16, 256, 1, 4, 3), (32, 128, 1, 4, 3), (32, 256, 1, 4, 3), (64, 128, 1, 4, 3),
                                   (64, 256, 1, 8, 3), (128, 128, 1, 8, 3), (32, 256, 4, 4, 3), (64, 128, 4, 4, 3),
                                   (32, 128, 1, 4, 5), (64, 128, 1, 4, 5), (32, 512, 1, 4, 3), (16, 512, 2, 2, 4))]
GEMV_TILES = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=1)
              for bn, bk, sk, w in ((16, 256, 1, 4), (32, 128, 1, 4), (32, 256, 1, 4), (32, 512, 1, 4), (64, 128, 1, 4),
                                    (64, 256, 1, 4), (128, 128, 1, 4), (64, 256, 1, 8), (128, 256, 1, 8),
                                    (32, 256, 2, 4), (64, 128, 2, 4), (16, 512, 1, 2), (32, 256, 1, 2))]
TINY_TILES = [dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2),
              dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2),
              dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=3, num_warps=4, num_stages=2)]


# e2m1 nibbles of four bytes -> four fp32 values: the code's three magnitude bits go to bits 22-24 (the low bits of
# fp32's exponent and the top of its mantissa) and its sign to bit 31, which reads as value · 2**-126 for every code,
# the subnormal 0.5 included (kernels/mxfp4.py's bf16 pairs use the same trick); one multiply by 2**126 restores it.
# BYTE i's low nibble sits at bits 8i..8i+3, its high nibble at 8i+4..8i+7: (magnitude shift, sign shift) per byte.
def _e2m1_f32_ptx(high: bool) -> str:
    lines = ["{", ".reg .b32 t, u;"]
    for i in range(4):
        lo_bit = 8 * i + (4 if high else 0)
        mag, sign = 22 - lo_bit, 31 - (lo_bit + 3)
        lines.append(f"shl.b32 t, $4, {mag};" if mag >= 0 else f"shr.b32 t, $4, {-mag};")
        lines.append("and.b32 t, t, 0x01C00000;")
        lines.append(f"shl.b32 u, $4, {sign};")
        lines.append("and.b32 u, u, 0x80000000;")
        lines.append("or.b32 t, t, u;")
        lines.append(f"mul.rn.f32 ${i}, t, 0f7E800000;")
    return "\n".join(lines + ["}"])


_E2M1_F32_LOW = tl.constexpr(_e2m1_f32_ptx(False))
_E2M1_F32_HIGH = tl.constexpr(_e2m1_f32_ptx(True))


@triton.jit
def _e2m1_f32(packed, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(PTX, "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _gemv_step(w_rows3, s_rows, xs_rows, k, K, M: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
               acc0, acc1):
    """One K step of the `gemv` modes: acc_m [BLOCK_N, BLOCK_K/32] += (block sums of x_m · w) · scale; xs_rows:
    row m's even K indices at xs_rows + m·K, its odd ones K/2 further."""
    kb = tl.arange(0, BLOCK_K // 32)
    j = tl.arange(0, 16)
    byte = (k // 2 + kb[:, None] * 16 + j[None, :])  # [BLOCK_K/32, 16]
    ok = byte < K // 2
    packed = tl.load(w_rows3 + byte[None, :, :], mask=ok[None, :, :], other=0)  # [BLOCK_N, BLOCK_K/32, 16]
    sc = e8m0_to_fp32(tl.load(s_rows + (k // 32 + kb)[None, :], mask=(k // 32 + kb)[None, :] < K // 32, other=127))
    if ASM:
        low = _e2m1_f32(packed, _E2M1_F32_LOW)
        high = _e2m1_f32(packed, _E2M1_F32_HIGH)
    else:
        low = decode_e2m1(packed & 0xF)
        high = decode_e2m1(packed >> 4)
    x0e = tl.load(xs_rows + byte, mask=ok, other=0.0)  # x at K index 2·byte, the byte's low nibble
    x0o = tl.load(xs_rows + K // 2 + byte, mask=ok, other=0.0)
    acc0 += tl.sum(low * x0e[None, :, :] + high * x0o[None, :, :], axis=2) * sc
    if M == 2:
        x1e = tl.load(xs_rows + K + byte, mask=ok, other=0.0)
        x1o = tl.load(xs_rows + K + K // 2 + byte, mask=ok, other=0.0)
        acc1 += tl.sum(low * x1e[None, :, :] + high * x1o[None, :, :], axis=2) * sc
    return acc0, acc1


@triton.jit
def _gemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, wb_ptr, out_ptr, N, K,
                 M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, MODE: tl.constexpr):
    """out[e, m, n] (+)= sum_k x[e, m, k] · w[e, n, k] over this program's K range; rows n past N are wrapped on
    load and masked on store. x fp32 [E, M, K] (bf16 values), xs the same split into even and odd K [E, M, 2, K/2]
    (the `gemv` modes' activations: contiguous per nibble), w packed uint8 [E, N, K/2], s uint8 [E, N, K/32],
    wb bf16 [E, N, K] (the bf16 modes), out fp32 [E, M, N]. K a multiple of 32; steps past K are masked."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = (rows % N).to(tl.int64)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    jb = tl.arange(0, BLOCK_K // 2)
    jk = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_K // 32)
    ms = tl.arange(0, M_PAD)
    w_rows = w_ptr + e * N * (K // 2) + rows_c[:, None] * (K // 2)
    s_rows = s_ptr + e * N * (K // 32) + rows_c[:, None] * (K // 32)
    x_rows = x_ptr + e * M * K + ms[:, None] * K
    m_ok = ms[:, None] < M
    ms16 = tl.arange(0, 16)
    a_rows = x_ptr + e * M * K + ms16[:, None] * K
    if MODE == 4 or MODE == 5:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
    elif MODE >= 8:  # swapped: accumulates Cᵀ, transposed into acc after the loop
        acc_t = tl.zeros([BLOCK_N, 16], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    chk = tl.zeros([BLOCK_N], tl.int32)
    g0 = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    g1 = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    w_rows3 = w_rows[:, :, None]
    for k in range(k_lo, k_hi, BLOCK_K):
        kb_ok = (k // 2 + jb)[None, :] < K // 2
        ks_ok = (k // 32 + js)[None, :] < K // 32
        k_ok = (k + jk)[None, :] < K
        if MODE == 0:
            packed = tl.load(w_rows + (k // 2 + jb)[None, :], mask=kb_ok, other=0)
            sc = tl.load(s_rows + (k // 32 + js)[None, :], mask=ks_ok, other=0)
            chk += tl.sum(packed.to(tl.int32), axis=1) + tl.sum(sc.to(tl.int32), axis=1)
        elif MODE == 1:
            w = tl.load(wb_ptr + e * N * K + rows_c[:, None] * K + (k + jk)[None, :], mask=k_ok, other=0.0)
            x = tl.load(x_rows + (k + jk)[None, :], mask=m_ok & k_ok, other=0.0)
            w = w.to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        elif MODE == 2 or MODE == 3:
            packed = tl.load(w_rows + (k // 2 + jb)[None, :], mask=kb_ok, other=0)
            sc = e8m0_to_fp32(tl.load(s_rows + (k // 32 + js)[None, :], mask=ks_ok, other=127))
            x_even = tl.load(x_rows + (k + 2 * jb)[None, :], mask=m_ok & kb_ok, other=0.0)
            x_odd = tl.load(x_rows + (k + 2 * jb + 1)[None, :], mask=m_ok & kb_ok, other=0.0)
            low = decode_e2m1(packed & 0xF)
            high = decode_e2m1(packed >> 4)
            if MODE == 2:
                scb = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
                acc += tl.sum(x_even[:, None, :] * (low * scb)[None, :, :]
                              + x_odd[:, None, :] * (high * scb)[None, :, :], axis=2)
            else:
                part = x_even[:, None, :] * low[None, :, :] + x_odd[:, None, :] * high[None, :, :]
                part = tl.sum(tl.reshape(part, (M_PAD, BLOCK_N, BLOCK_K // 32, 16)), axis=3)
                acc += tl.sum(part * sc[None, :, :], axis=2)
        elif MODE == 4:
            a = tl.load(a_rows + (k + jk)[None, :], mask=(ms16[:, None] < M) & k_ok, other=0.0).to(tl.bfloat16)
            codes = tl.load(w_ptr + e * N * (K // 2) + rows_c[None, :] * (K // 2) + (k // 2 + jb)[:, None],
                            mask=(k // 2 + jb)[:, None] < K // 2, other=0)
            scales = tl.load(s_rows + (k // 32 + js)[None, :], mask=ks_ok, other=127)
            acc = tl.dot_scaled(a, None, "bf16", codes, scales, "e2m1", acc)
        elif MODE >= 8:
            xt = tl.trans(tl.load(a_rows + (k + jk)[None, :], mask=(ms16[:, None] < M) & k_ok, other=0.0)
                          .to(tl.bfloat16))  # [BLOCK_K, 16]
            if MODE == 8:
                packed, sc = mxfp4_codes(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), rows_c, k, K // 2,
                                         K // 32, K, BLOCK_K)
                sb = tl.reshape(tl.broadcast_to(sc.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                                (BLOCK_N, BLOCK_K // 2))
                w = tl.interleave(_e2m1_pairs(packed, sb, _LOW_NIBBLES_PTX), _e2m1_pairs(packed, sb, _HIGH_NIBBLES_PTX))
                acc_t = tl.dot(w, xt, acc_t)
            elif MODE == 11:
                w = mxfp4_tile(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // 32), rows_c, k, K // 2, K // 32, K,
                               BLOCK_N, BLOCK_K, tl.bfloat16)
                acc_t = tl.dot(w, xt, acc_t)
            elif MODE == 9:
                codes = tl.load(w_rows + (k // 2 + jb)[None, :], mask=kb_ok, other=0)  # [BLOCK_N, BLOCK_K/2]
                scales = tl.load(s_rows + (k // 32 + js)[None, :], mask=ks_ok, other=127)
                acc_t = tl.dot_scaled(codes, scales, "e2m1", xt, None, "bf16", acc_t)
            else:
                w = tl.load(wb_ptr + e * N * K + rows_c[:, None] * K + (k + jk)[None, :], mask=k_ok, other=0.0)
                acc_t = tl.dot(w, xt, acc_t)
        elif MODE == 6 or MODE == 7:
            g0, g1 = _gemv_step(w_rows3, s_rows, xs_ptr + e * M * K, k, K, M, BLOCK_K, MODE == 7, g0, g1)
        else:
            a = tl.load(a_rows + (k + jk)[None, :], mask=(ms16[:, None] < M) & k_ok, other=0.0).to(tl.bfloat16)
            wt = tl.load(wb_ptr + e * N * K + rows_c[None, :] * K + (k + jk)[:, None], mask=(k + jk)[:, None] < K,
                         other=0.0)
            acc = tl.dot(a, wt, acc)
    if MODE == 0:
        acc += chk.to(tl.float32)[None, :]
    if MODE == 6 or MODE == 7:
        acc += tl.where(ms[:, None] == 0, tl.sum(g0, axis=1)[None, :], tl.sum(g1, axis=1)[None, :])
    if MODE >= 8:
        acc = tl.trans(acc_t)
    if MODE == 4 or MODE == 5 or MODE >= 8:
        out_m = tl.arange(0, 16)
    else:
        out_m = ms
    ptrs = out_ptr + e * M * N + out_m[:, None] * N + rows[None, :]
    ok = (out_m[:, None] < M) & (rows[None, :] < N)
    if MODE == 0:
        acc = acc.to(tl.int32).to(tl.float32)  # the checksum, exact (each program writes its rows' own)
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=ok)
    else:
        tl.store(ptrs, acc, mask=ok)


def run_variant(mode: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, wb: torch.Tensor,
                tile: dict) -> torch.Tensor:
    e, m, k = x.shape
    n = w.shape[1]
    if mode in GEMV_MODES and m > 2:
        raise ValueError(f"{mode} takes at most 2 rows per expert, got {m}")
    out = torch.zeros(e, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, tile["BLOCK_N"]), e, tile["SPLIT_K"])
    xs = torch.stack((x[..., 0::2], x[..., 1::2]), dim=2).contiguous()  # [E, M, 2, K/2]
    _gemv_kernel[grid](x, xs, w, s, wb, out, n, k, M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=tile["BLOCK_N"],
                       BLOCK_K=tile["BLOCK_K"], SPLIT_K=tile["SPLIT_K"], MODE=MODES[mode],
                       num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return out


def load_checksum(w: torch.Tensor, s: torch.Tensor, m: int, tile: dict) -> torch.Tensor:
    """What `load` writes: per row, the sum of its bytes and scale codes in each program's K range (split-K
    programs add theirs), broadcast over the M rows."""
    total = w.to(torch.int64).sum(-1) + s.to(torch.int64).sum(-1)  # [E, N]
    return total.to(torch.float32)[:, None, :].expand(-1, m, -1)


def problem_rows(label: str, experts: int, m: int, n: int, k: int, tiles: list[dict], device: str,
                 modes: list[str], timer, gemv_tiles: list[dict] | None = None) -> list[dict]:
    from tritune.kernels.mxfp4_format import BITS_PER_WEIGHT, dequantize_mxfp4, quantize_mxfp4

    gen = torch.Generator(device=device).manual_seed(experts * 7 + n)
    w_f = torch.randn(experts, n, k, generator=gen, device=device) / k**0.5
    w, s = quantize_mxfp4(w_f)
    del w_f
    w_deq = dequantize_mxfp4(w, s, torch.float32)
    x = (torch.randn(experts, m, k, generator=gen, device=device) / 2).to(torch.bfloat16).float()
    ref = torch.einsum("emk,enk->emn", x, w_deq)
    wb = w_deq.to(torch.bfloat16)
    del w_deq
    ref_b = torch.einsum("emk,enk->emn", x, wb.float())
    x, w, s, wb = (t.contiguous() for t in (x, w, s, wb))
    mx_bytes = experts * n * k * BITS_PER_WEIGHT / 8
    bf_bytes = experts * n * k * 2
    rows = []
    gemv_tiles = gemv_tiles or tiles
    pairs = [(mode, tile) for mode in modes for tile in (gemv_tiles if mode in GEMV_MODES else tiles)]
    for mode, tile in pairs:
        if mode in GEMV_MODES and m > 2:
            continue  # they keep one accumulator per row, two at most
        want = load_checksum(w, s, m, tile).to(device) if mode == "load" else (
            ref_b if mode in ("bf16", "dot_bf16", "swap_bf16") else ref)
        res = checked_time(lambda mode=mode, tile=tile: run_variant(mode, x, w, s, wb, tile), want, timer)
        row = {"point": label, "problem": f"{n}x{k}", "mode": mode, **tile}
        if isinstance(res, str):
            row["error"] = res
        else:
            us, err = res
            floor = (bf_bytes if mode in ("bf16", "dot_bf16", "swap_bf16") else mx_bytes) / BYTES_PER_S * 1e6
            row |= {"us": us, "rel_l2": err, "floor_us": round(floor, 1), "x_floor": round(us / floor, 2),
                    "mxfp4_floor_us": round(mx_bytes / BYTES_PER_S * 1e6, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes for the interpreter (correctness only)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; known: {list(MODES)}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        from tritune.tuning.bench import time_kernel

        def timer(fn):
            return time_kernel(fn, iters=args.iters, warmup=3).median_us
    else:
        def timer(fn):
            return 0.0
    rows: list[dict] = []
    if args.tiny:
        if not cuda:  # the interpreter has no bf16 dot and runs no PTX
            modes = [m for m in modes if m not in MMA_MODES + ASM_MODES]
        for label, experts, m in (("tiny", 3, 1), ("tiny", 2, 2), ("tiny", 2, 3)):
            rows += problem_rows(label, experts, m, 40, 224, TINY_TILES, device, modes, timer)
    else:
        for (label, experts, m), (n, k) in itertools.product(POINTS, PROBLEMS.values()):
            rows += problem_rows(label, experts, m, n, k, TILES, device, modes, timer, GEMV_TILES)
    pathlib.Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "interpreter",
                                                  "triton": triton.__version__, "torch": torch.__version__,
                                                  "rows": rows}, indent=1))
    print("\npoint | problem | mode | best µs | × its floor | MXFP4 floor µs | tile")
    for key, group in itertools.groupby(sorted(rows, key=lambda r: (r["point"], r["problem"], r["mode"])),
                                        key=lambda r: (r["point"], r["problem"], r["mode"])):
        ok = [r for r in group if "us" in r]
        if not ok:
            print(" | ".join(key) + " | all failed")
            continue
        best = min(ok, key=lambda r: r["us"])
        tile = {t: best[t] for t in TILES[0]}
        print(f"{key[0]} | {key[1]} | {key[2]} | {best['us']} | {best['x_floor']} | {best['mxfp4_floor_us']} | {tile}")
    bad_err = [r for r in rows if "rel_l2" in r and not (math.isfinite(r["rel_l2"]) and r["rel_l2"] <= 1e-2)]
    if bad_err:
        print(f"WRONG: {len(bad_err)} variants off the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
