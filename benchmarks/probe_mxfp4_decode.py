"""What each part of the swapped MXFP4 GEMM's weight decode costs (issue 16): the op's stage pair on the rule table's
tiles (gpt-oss-120b's MoE, a ready sort; stage 1's and stage 2's input copies into the K32 order included) with the
decode built several ways, each in its own process (a jitted function's globals are fixed once it has compiled):

    shift    the bf16 fields by prmt, two shifts, two masks and an or, then a multiply by 2**126 and one by the
             scale, the scales to bf16 through fp32 (the op of the sixteenth session)
    mul      the fields by one multiply (kernels/mxfp4.py), then the same two multiplies; the scales through fp32
    nofold   as mul, the scales to bf16 by integer ops (`e8m0_to_bf16`): the op of the seventeenth session
    op       the 2**126 folded into the scale (K32_FOLD: one multiply a pair, `e8m0_to_bf16_folded`, the
             accumulator scaled back once): what the op runs
    noscale  the op's decode with every scale 1, so the scale loads, their layout change and their conversion are
             gone. Not a contestant (its result is wrong): the bound on what any faster scale path could save.
    nodecode the packed PTX replaced by two byte moves (the scales still loaded and handed to it): the bound on
             what any faster decode could save. Not a contestant either.
    bytes    nodecode and noscale together: the loads, the MMA and the loop alone.
    words    the op's decode with each row's four scale codes of a 128-wide K step loaded as one 32-bit word from
             scale rows padded to 96 bytes (a view of a padded buffer; the op's byte loads are not pipelined by
             Triton 3.6, 32-bit ones are, TTGIR `async_copy_global_to_local`), split into codes in registers; the
             op's byte loads where BLOCK_K < 128. A contestant: exact, but it needs the padded rows.
    records  the op with prepared scales (`prepare_mxfp4_scales`): the rule table's tiles for them, the codes through
             TMA from their records where it asks for SCALE_TMA. Every other variant runs the rule table's tiles for
             plain codes (SCALE_TMA 0, the codes by pointers).
    swizzle  records, with the weights re-encoded too (`prepare_mxfp4_weights`, kernels/mxfp4_swizzle.py): the
             swapped GEMM's decode builds 8 weights from 12 instructions instead of 18.

    PYTHONPATH=src python benchmarks/probe_mxfp4_decode.py --out $OUT/decode.json             # GPU: every variant
    PYTHONPATH=src python benchmarks/probe_mxfp4_decode.py --tiny --variants op,shift --out F # interpreter
    ... --set USE_TMA=1,num_stages=4                  # config fields put on both stages' rule-table tiles
    ... --set 2:BLOCK_SIZE_N=128,2:num_warps=8        # on stage 2's alone (1: stage 1's)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritune.kernels.mxfp4 import mxfp4_scale_codes  # noqa: E402

VARIANTS = ("shift", "mul", "nofold", "op", "noscale", "nodecode", "bytes", "words", "records", "swizzle")
PREPARED = ("records", "swizzle")  # the variants that hand the op prepared scales
# nodecode's stand-in for the packed decode: each byte's bits copied into a 16-bit half, nothing else.
_BYTES_PTX = """
{
.reg .b32 z;
mov.b32 z, 0;
prmt.b32 $0, $2, z, 0x4140;
prmt.b32 $1, $2, z, 0x4342;
}
"""
SHAPE = (2880, 2880, 128, 4)  # gpt-oss-120b: model_dim, inter_dim, experts, topk
TINY = (64, 64, 4, 2)
TOKENS = (1, 16, 64, 256, 1024, 4096)
COPY_BYTES_PER_S = 3.0e12  # the H100's measured copy bandwidth, as the other benchmarks


def _shift_ptx(high: bool) -> str:
    """The bf16 PTX the op used before the one-multiply form: the fp16 text with bf16's field and bias."""
    from tritune.kernels.mxfp4 import _pairs_ptx

    return (_pairs_ptx(True, high).replace("0x0E000E00", "0x01C001C0").replace("0x74007400", "0x7E807E80")
            .replace("f16x2", "bf16x2").replace(f"shl.b32 t, x, {9 - 4 * high};", f"shl.b32 t, x, {6 - 4 * high};")
            .replace(f"shl.b32 t, y, {9 - 4 * high};", f"shl.b32 t, y, {6 - 4 * high};"))


@triton.jit
def scale_words(scale_ptr, offs_n, k0, stride_sn, K, BLOCK_K: tl.constexpr):
    """The words variant's `mxfp4_scale_codes`: rows' 4-byte-aligned codes as int32 loads (padded_scales)."""
    if BLOCK_K >= 128:  # k0 is a multiple of BLOCK_K: each row's 4 codes of a 128 step are one aligned word
        words = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_sn // 4)
                        + (k0 // 128 + tl.arange(0, BLOCK_K // 128))[None, :])
        codes = tl.reshape((words[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF,
                           (offs_n.shape[0], BLOCK_K // 32))
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        return tl.where(ks[None, :] < K // 32, codes, 127).to(tl.uint8)
    else:
        return mxfp4_scale_codes(scale_ptr, offs_n, k0, stride_sn, K, BLOCK_K)


def apply_variant(name: str) -> None:
    """Rebind the decode's pieces in kernels.mxfp4 before anything compiles."""
    import triton
    import triton.language as tl

    from tritune.kernels import mxfp4

    @triton.jit
    def via_fp32(codes):
        return mxfp4.e8m0_to_fp32(codes).to(tl.bfloat16)

    @triton.jit
    def ones(codes):
        return tl.full(codes.shape, 1.0, tl.bfloat16)

    if name not in VARIANTS:
        raise SystemExit(f"probe_mxfp4_decode: unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")
    if name in ("shift", "mul", "nofold"):  # two multiplies a pair, the tile at its true scale
        low, high = ((_shift_ptx(False), _shift_ptx(True)) if name == "shift"
                     else (mxfp4._LOW_NIBBLES_PTX.value, mxfp4._HIGH_NIBBLES_PTX.value))
        mxfp4._LOW_FOLDED_PTX, mxfp4._HIGH_FOLDED_PTX = tl.constexpr(low), tl.constexpr(high)
        mxfp4.e8m0_to_bf16_folded = mxfp4.e8m0_to_bf16 if name == "nofold" else via_fp32
        mxfp4.K32_UNSCALE = tl.constexpr(1.0)
    if name in ("noscale", "bytes"):
        mxfp4.e8m0_to_bf16_folded = ones
    if name in ("nodecode", "bytes"):
        mxfp4._LOW_FOLDED_PTX = tl.constexpr(_BYTES_PTX)
        mxfp4._HIGH_FOLDED_PTX = tl.constexpr(_BYTES_PTX)
    if name == "words":
        from tritune.kernels import fused_moe as fm

        fm.mxfp4_scale_codes = scale_words


def padded_scales(scales: torch.Tensor, row_bytes: int = 96) -> torch.Tensor:
    """`scales` [E, N, K/32] as a view of a buffer whose rows are `row_bytes` long (padding 127, scale 1)."""
    e, n, kb = scales.shape
    buf = torch.full((e, n, max(row_bytes, -(-kb // 16) * 16)), 127, dtype=torch.uint8, device=scales.device)
    buf[:, :, :kb] = scales
    return buf[:, :, :kb]


def _weights(experts: int, rows: int, cols: int, device: str, seed: int):
    """Seeded N(0, 1/cols) weights [experts, rows, cols], quantized to MXFP4 a few experts at a time."""
    from tritune.kernels import fused_moe as fm

    gen = torch.Generator(device=device).manual_seed(seed)
    packed, scales = [], []
    for lo in range(0, experts, 16):
        w = torch.randn(min(16, experts - lo), rows, cols, generator=gen, device=device) / cols**0.5
        q, s = fm.quantize_weights(w, fm.MXFP4)
        packed.append(q)
        scales.append(s)
    return torch.cat(packed), torch.cat(scales)


def parse_set(text: str) -> dict[str, int]:
    """--set [S:]FIELD=INT,...: MoeConfig fields put on both stages' rule-table configs, or with the prefix 1: or 2:
    on that stage's alone."""
    from tritune.kernels.fused_moe import MoeConfig

    known = {f.name for f in dataclasses.fields(MoeConfig)}
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        field = name[2:] if name[:2] in ("1:", "2:") else name
        if field not in known or not value.lstrip("-").isdigit():
            raise SystemExit(f"probe_mxfp4_decode: --set {part!r}: want [1:|2:]FIELD=INT with FIELD a MoeConfig "
                             "field")
        out[name] = int(value)
    return out


def parse_dims(text: str) -> tuple[int, int, int, int]:
    """--dims D,I,E,TOPK: model_dim, inter_dim (multiples of 32), experts, top-k."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % 32 or int(
            parts[1]) % 32:
        raise argparse.ArgumentTypeError(f"{text!r}: want D,I,E,TOPK, positive, D and I multiples of 32")
    d, i, e, k = map(int, parts)
    return d, i, e, k


def stage_fields(fields: dict[str, int], stage: int) -> dict[str, int]:
    """The --set fields for stage 1 or 2: the unprefixed ones, then that stage's own."""
    mine = {k[2:]: v for k, v in fields.items() if k.startswith(f"{stage}:")}
    return {k: v for k, v in fields.items() if ":" not in k} | mine


def run_variant(name: str, tokens: list[int], tiny: bool, iters: int, fields: dict[str, int],
                dims: tuple[int, int, int, int] = SHAPE) -> list[dict]:
    apply_variant(name)
    from tritune.kernels import fused_moe as fm
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops.heuristics import moe_heuristic
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import time_kernel

    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    d, inter, experts, topk = TINY if tiny else dims
    q1, s1 = _weights(experts, 2 * inter, d, device, 1)
    q2, s2 = _weights(experts, d, inter, device, 2)
    if name == "words":
        s1, s2 = padded_scales(s1), padded_scales(s2)
    w1_s, w2_s = s1, s2  # what the stages get: the codes, or (records) both layouts
    w1, w2 = q1, q2  # what the stages get: the packed bytes, or (swizzle) them re-encoded
    if name in PREPARED:
        from tritune.kernels.mxfp4_records import prepare_mxfp4_scales

        w1_s, w2_s = prepare_mxfp4_scales(s1), prepare_mxfp4_scales(s2)
    if name == "swizzle":
        from tritune.kernels.mxfp4_swizzle import prepare_mxfp4_weights

        w1, w2 = prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2)
    rows = []
    for t in tokens:
        gen = torch.Generator(device=device).manual_seed(t)
        hidden = (torch.randn(t, d, generator=gen, device=device) / 2).to(dtype)
        tw, ti = sample_routing(t, experts, topk, seed=t, device=device)
        _, c1, c2 = moe_heuristic(t, d, inter, experts, topk, fm.MXFP4, one_stage=False,
                                  capability=torch.cuda.get_device_capability() if device == "cuda" else (9, 0),
                                  scale_records=name in PREPARED)  # the rule for what the variant hands the op
        c1, c2 = (dataclasses.replace(c, **({} if name in PREPARED else {"SCALE_TMA": 0}) | stage_fields(fields, i))
                  for i, c in ((1, c1), (2, c2)))
        sorting = moe_align_block_size(ti, c1.BLOCK_SIZE_M, experts)

        def call(hidden=hidden, tw=tw, sorting=sorting, c1=c1, c2=c2):
            mid = fm.moe_stage1(hidden, w1, tw, sorting, c1, inter_dim=inter, w1_scale=w1_s, quant=fm.MXFP4)
            return fm.moe_stage2(mid, w2, tw, sorting, c2, w2_scale=w2_s, quant=fm.MXFP4)

        ref = fused_moe_reference(hidden, q1, q2, tw, ti, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
        rel = float((call().float() - ref).norm() / ref.norm().clamp_min(1e-30))
        routed = int(torch.unique(ti).numel())
        floor = routed * 3 * d * inter * (4.25 / 8) / COPY_BYTES_PER_S * 1e6
        us = time_kernel(call, iters=iters, warmup=min(3, iters)).median_us
        label = name + (f"[{','.join(f'{k}={v}' for k, v in fields.items())}]" if fields else "")
        rows.append({"variant": label, "tokens": t, "us": us, "floor_us": floor, "rel_l2": rel,
                     "configs": [c1.name("stage1", fm.MXFP4), c2.name("stage2", fm.MXFP4)]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--variant", default=None, help="run this one variant here (what the driver starts)")
    ap.add_argument("--tokens", default=None, help="comma list (default 1..4096, or 3,9 with --tiny)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape through the interpreter (fp16)")
    ap.add_argument("--set", default="", help="FIELD=INT,...: put on both stages' configs (e.g. USE_TMA=1)")
    ap.add_argument("--dims", type=parse_dims, default=SHAPE,
                    help="D,I,E,TOPK: another MoE shape (default gpt-oss-120b's 2880,2880,128,4)")
    args = ap.parse_args(argv)
    fields = parse_set(args.set)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([3, 9] if args.tiny else list(TOKENS))
    if args.variant:
        args.out.write_text(json.dumps(run_variant(args.variant, tokens, args.tiny, args.iters, fields, args.dims),
                                       indent=1))
        return 0
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            ap.error(f"--variants: unknown {name!r}; expected some of {', '.join(VARIANTS)}")
    rows = []
    for name in names:
        part = args.out.with_suffix(f".{name}.json")
        cmd = [sys.executable, __file__, "--variant", name, "--out", str(part), "--tokens", ",".join(map(str, tokens)),
               "--iters", str(args.iters), "--set", args.set, "--dims", ",".join(map(str, args.dims))] + (
                   ["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd, env=os.environ.copy())
        rows += json.loads(part.read_text()) if done.returncode == 0 else [{"variant": name, "error": done.returncode}]
    args.out.write_text(json.dumps({"shape": TINY if args.tiny else args.dims, "rows": rows}, indent=1))
    by = {(r["variant"].split("[")[0], r["tokens"]): r for r in rows if "us" in r}
    print("| tokens | floor µs | " + " | ".join(f"{n} µs" for n in names) + " | op / shift | rel_l2 (op) |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for t in tokens:
        cells = [f"{by[(n, t)]['us']:.1f}" if (n, t) in by else "—" for n in names]
        op, shift = by.get(("op", t)), by.get(("shift", t))
        ratio = f"{op['us'] / shift['us']:.3f}" if op and shift else "—"
        floor = next((r["floor_us"] for r in rows if r.get("tokens") == t and "floor_us" in r), math.nan)
        rel = f"{op['rel_l2']:.2e}" if op else "—"
        print(f"| {t} | {floor:.1f} | " + " | ".join(cells) + f" | {ratio} | {rel} |")
    return 0 if all("us" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
