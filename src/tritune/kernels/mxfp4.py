"""MXFP4 (per_1x32) decoding in Triton: the building blocks the Hopper fused-MoE stage kernels inline, and a standalone
dequantization kernel that exercises them against the torch reference (kernels/mxfp4_format.py).

Why decode in registers. Hopper has no fp4 MMA, so an MXFP4 GEMM there loads the packed e2m1 codes (two per byte)
and the e8m0 scales (one per 32 along K), turns them into a bf16/fp16 tile in registers and feeds that to tl.dot.
The weights cross HBM as 4.25 bits each instead of 16, which is the point for the memory-bound decode-size MoE; the
cost is a handful of integer ops per element in the inner loop. `decode_e2m1`, `e8m0_to_fp32` and `mxfp4_tile` are
those ops; a stage kernel calls `mxfp4_tile` where it would otherwise `tl.load` a [BLOCK_N, BLOCK_K] weight tile.

Layout (the same as mxfp4_format): packed uint8 [..., K/2], byte j holds element 2j in its LOW nibble and element
2j+1 in its HIGH nibble; scales uint8 [..., K/32], value 2**(code - 127), code 255 is NaN. e2m1 code: bit 3 sign,
bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (0, 0.5); magnitudes 0 0.5 1 1.5 2 3 4 6.

Exactness. Both decoders build fp32 bit patterns with integer ops and bitcast them, so they are exact by
construction (no exp2, no table in memory). An e2m1 value has at most 2 significant bits, so value * 2**e is exact in
fp32 for every scale code up to 252 (6 * 2**126 overflows at 253 and 254; values below fp32's normal range are
subnormals, still exact, though a GPU build that flushes denormals would zero them: only blocks with amax < 2**-123,
i.e. all-zero blocks in practice, have such scales). The cast to bf16 is exact over the same range (bf16 has fp32's
exponent range and 8 significant bits), which covers everything quantize_mxfp4 writes. fp16 is exact only for scale
codes 104..140: below, 0.5 * scale is under fp16's smallest subnormal 2**-24; above, 6 * scale passes 65504.

Portability (Triton 3.9's CPU interpreter and Triton 3.6 on the GPU machine): only long-standing primitives are used:
integer and/shift/compare, tl.where, `.to(..., bitcast=True)`, tl.interleave (join + reshape, in Triton since 3.0),
and tl.reshape (can_reorder=False, to broadcast each scale over its 32 elements). No tl.dot here, so the interpreter's
bf16 dot problem (interpreter_probe.py) does not touch these helpers. One interpreter fault does: its fp32 -> bf16
cast gets results below 2**-126 wrong (it clamps the exponent without shifting the mantissa), which only scale codes
0 and 1 produce; the GPU's cvt rounds them right, and a zero block (code 0, codes 0/8) still decodes to exact ±0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritune.kernels.mxfp4_swizzle import PAIR_MASK, ROTATIONS, SPREAD_BITS, SPREAD_FACTOR, unswizzle_tile
from tritune.knobs import interpreting, mxfp4_decode

BLOCK = 32  # elements along K per e8m0 scale (mxfp4_format.BLOCK)
DEFAULT_BLOCK_N = 32
DEFAULT_BLOCK_K = 64

_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# TRITUNE_MXFP4_DECODE=asm: bf16 tiles decode through packed PTX (`_e2m1_pairs`) instead of `decode_e2m1` and an
# fp32 multiply. Fixed when this module is imported: a jitted function's globals must not change once it compiled.
# Never in the interpreter, which cannot run PTX.
ASM_DECODE = tl.constexpr(mxfp4_decode() == "asm" and not interpreting())
# Whether PTX can run at all (a caller asking for the packed decode gets Triton's integer ops in the interpreter).
PTX_OK = tl.constexpr(not interpreting())

# Two e2m1 codes per 32-bit register, as bf16 (or fp16) bits: a code's sign (bit 3) goes to bit 15 of its half and
# its three magnitude bits (exponent, mantissa) to bits 6-8 (fp16: 9-11), the low bits of the 16-bit exponent and the
# top of its mantissa. The number so built is the code's value times 2**-126 (fp16: 2**-14) for every code, the
# subnormal 0.5 (exponent 0, mantissa 1) and zero included: exponent e >= 1 reads 2**(e - 127) (1 + m/2) =
# 2**-126 · 2**(e - 1) (1 + m/2), and exponent 0 with the mantissa's top bit reads 2**-127 = 2**-126 · 0.5 (fp16:
# bias 15, the same with 2**-14). One exact multiply by 2**126 (bf16 0x7E80; fp16 2**14, 0x7400) restores the value,
# one more applies the e8m0 scale (both fma with -0.0, so -0 stays -0). Bytes 0, 1 of the input register go to the
# halves of the first output register and bytes 2, 3 to the second (prmt).
#
# bf16 builds both fields with one multiply: with the other nibble masked off first, the nibble at bits b..b+3 of
# its half (b = 0 low, 4 high) times 2**(6 - b) + 2**(12 - b) lands at bits 6-9 and again at 12-15, apart (no
# carries, and under 2**16, so nothing crosses into the other half); one mask keeps bits 6-8 (the magnitude) and 15
# (the sign). That is mask, prmt, multiply, mask per register where the shift form below takes prmt, two shifts, two
# masks and an or: 684 instead of 751 instructions in the gated stage 1's K step (sm90, BM 16 BN 64 BK 128), 398
# instead of 430 in stage 2. fp16's fields (bits 9-11 and 15) would overlap at bit 12, so fp16 keeps the shifts.
_E2M1_PAIRS_BF16_PTX = """
{
.reg .b32 m, x, y, z, bias, negz;
mov.b32 z, 0;
mov.b32 bias, 0x7E807E80;
mov.b32 negz, 0x80008000;
and.b32 m, $2, NIBBLES;
prmt.b32 x, m, z, 0x4140;
prmt.b32 y, m, z, 0x4342;
mul.lo.u32 x, x, FACTOR;
mul.lo.u32 y, y, FACTOR;
and.b32 $0, x, 0x81C081C0;
and.b32 $1, y, 0x81C081C0;
fma.rn.bf16x2 $0, $0, bias, negz;
fma.rn.bf16x2 $1, $1, bias, negz;
fma.rn.bf16x2 $0, $0, $3, negz;
fma.rn.bf16x2 $1, $1, $4, negz;
}
"""
_E2M1_PAIRS_F16_PTX = """
{
.reg .b32 x, y, t, u, z, bias, negz;
mov.b32 z, 0;
mov.b32 bias, 0x74007400;
mov.b32 negz, 0x80008000;
prmt.b32 x, $2, z, 0x4140;
prmt.b32 y, $2, z, 0x4342;
shl.b32 t, x, SHIFT_MAG;
and.b32 t, t, 0x0E000E00;
shl.b32 u, x, SHIFT_SIGN;
and.b32 u, u, 0x80008000;
or.b32 $0, t, u;
shl.b32 t, y, SHIFT_MAG;
and.b32 t, t, 0x0E000E00;
shl.b32 u, y, SHIFT_SIGN;
and.b32 u, u, 0x80008000;
or.b32 $1, t, u;
fma.rn.f16x2 $0, $0, bias, negz;
fma.rn.f16x2 $1, $1, bias, negz;
fma.rn.f16x2 $0, $0, $3, negz;
fma.rn.f16x2 $1, $1, $4, negz;
}
"""


# The swapped GEMM's bf16 decode (`mxfp4_decode_k32`) folds the 2**126 into the scale rather than spending a multiply
# on it: each pair is one fma by a scale 2**(code - 127 + K32_FOLD), and the tile comes out as its values times
# 2**(K32_FOLD - 126) = 2**-64, which the K loop's accumulator takes back once (`k32_unscale`). Exact while the
# scaled values stay in bf16's range: scale codes 59-192, weights of magnitude 2**-68 to 2**65 (code 0, an all-zero
# block, decodes to exact zeros; codes 193-255 decode to inf or NaN, never to a wrong finite number). Two bf16
# multiplies a pair become one, and the scale one multiply-add and a min: 672 -> 586 instructions in the gated stage
# 1's K step, 392 -> 346 in stage 2 (sm90, BM 16 BN 64 BK 128, TMA).
K32_FOLD = tl.constexpr(62)
K32_UNSCALE = tl.constexpr(2.0 ** (126 - 62))
_E2M1_PAIRS_BF16_FOLDED_PTX = (_E2M1_PAIRS_BF16_PTX.replace("mov.b32 bias, 0x7E807E80;\n", "")
                               .replace(".reg .b32 m, x, y, z, bias, negz;", ".reg .b32 m, x, y, z, negz;")
                               .replace("fma.rn.bf16x2 $0, $0, bias, negz;\n", "")
                               .replace("fma.rn.bf16x2 $1, $1, bias, negz;\n", ""))

# The folded decode of re-encoded bytes (kernels/mxfp4_swizzle.py): each register is the group's word masked, after a
# rotate or the one spreading multiply, so 12 instructions build 8 weights instead of 18. Low: (L0, L1), (L2, L3);
# high: (H0, H1), (H2, H3).
_LOW_SWIZZLED_PTX = tl.constexpr(f"""
{{
.reg .b32 r, negz;
mov.b32 negz, 0x80008000;
and.b32 $0, $2, {PAIR_MASK:#x};
shf.r.wrap.b32 r, $2, $2, {ROTATIONS[1]};
and.b32 $1, r, {PAIR_MASK:#x};
fma.rn.bf16x2 $0, $0, $3, negz;
fma.rn.bf16x2 $1, $1, $4, negz;
}}
""")
_HIGH_SWIZZLED_PTX = tl.constexpr(f"""
{{
.reg .b32 r, negz;
mov.b32 negz, 0x80008000;
shf.r.wrap.b32 r, $2, $2, {ROTATIONS[2]};
and.b32 $0, r, {PAIR_MASK:#x};
and.b32 r, $2, {SPREAD_BITS:#x};
mul.lo.u32 r, r, {SPREAD_FACTOR:#x};
and.b32 $1, r, {PAIR_MASK:#x};
fma.rn.bf16x2 $0, $0, $3, negz;
fma.rn.bf16x2 $1, $1, $4, negz;
}}
""")

def bf16_field_factor(high: bool) -> int:
    """The multiplier that copies a masked nibble (low or `high`) of a half-word to bits 6-9 and 12-15."""
    low_bit = 4 if high else 0
    return (1 << (6 - low_bit)) + (1 << (12 - low_bit))


def _pairs_ptx(fp16: bool, high: bool, folded: bool = False) -> str:
    """The PTX for one nibble of each byte (`high`) into bf16 or fp16 pairs (`folded`: bf16 with the 2**126 in the
    scale, K32_FOLD)."""
    if fp16:
        return (_E2M1_PAIRS_F16_PTX.replace("SHIFT_MAG", str(9 - (4 if high else 0)))
                .replace("SHIFT_SIGN", str(12 - (4 if high else 0))))
    text = _E2M1_PAIRS_BF16_FOLDED_PTX if folded else _E2M1_PAIRS_BF16_PTX
    return (text.replace("NIBBLES", "0xF0F0F0F0" if high else "0x0F0F0F0F")
            .replace("FACTOR", hex(bf16_field_factor(high))))


_LOW_NIBBLES_PTX = tl.constexpr(_pairs_ptx(False, False))
_HIGH_NIBBLES_PTX = tl.constexpr(_pairs_ptx(False, True))
_LOW_FOLDED_PTX = tl.constexpr(_pairs_ptx(False, False, folded=True))
_HIGH_FOLDED_PTX = tl.constexpr(_pairs_ptx(False, True, folded=True))
_LOW_NIBBLES_F16_PTX = tl.constexpr(_pairs_ptx(True, False))
_HIGH_NIBBLES_F16_PTX = tl.constexpr(_pairs_ptx(True, True))


@triton.jit
def decode_e2m1(codes):
    """e2m1 codes (uint8 or int32, values 0..15; any shape) -> fp32 values, exact, by building the fp32 bits.

    With m = code & 7 = (exponent << 1) | mantissa: a normal code (exponent >= 1) is (1 + mantissa/2) * 2**(exp-1),
    whose fp32 bits are ((exp - 1 + 127) << 23) | (mantissa << 22) = (m + 252) << 22; the subnormal codes are
    m = 1 -> 0.5 (bits 126 << 23 = 252 << 22) and m = 0 -> 0. The sign, bit 3, moves to bit 31 (code 8 is -0.0).
    """
    c = codes.to(tl.uint32)
    m = c & 7
    mag = tl.where(m >= 2, (m + 252) << 22, tl.where(m == 1, 252 << 22, 0))
    bits = mag | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(scales):
    """e8m0 scale codes (uint8; any shape) -> fp32 2**(code - 127), exact: the code is the fp32 biased exponent, so
    the bits are code << 23; code 0 is the subnormal 2**-127 (bits 0x00400000), code 255 is NaN (0x7FC00000)."""
    s = scales.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_bf16(scales):
    """e8m0 scale codes (uint8; any shape) -> bf16 2**(code - 127), exact, by integer ops alone (no trip through
    fp32: 2.4-2.6% fewer instructions in the swapped stage kernels' K step, sm90): the code is bf16's biased
    exponent too, so the bits are code << 7; code 0 is the subnormal 2**-127 (0x0040: the max), code 255 NaN
    (0x7FC0: (code + 1) >> 2 reaches 0x40 only there)."""
    c = scales.to(tl.int32)
    bits = tl.maximum(c << 7, 0x40) | (((c + 1) >> 2) & 0x40)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_to_bf16_folded(scales, CLAMPED: tl.constexpr = False):
    """e8m0 scale codes (uint8) -> bf16 2**(code - 127 + K32_FOLD), the folded decode's scale: bits (code + 62) << 7,
    a normal number for codes 0-192 (one multiply-add); clamped to 0x7FC0, so 193 reads inf and 194-255 NaN (past
    the fold's exact range, never a wrong finite number). CLAMPED: the codes are at most 193 already (the scale
    records are, `mxfp4_records.scale_records`), so 193 reads inf with no clamp here: 12 fewer instructions in a
    K step of the swapped stage 2 (sm90, 128 x 128 tile on 8 warps)."""
    bits = scales.to(tl.int32) * 128 + K32_FOLD * 128
    if not CLAMPED:
        bits = tl.minimum(bits, 0x7FC0)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def k32_unscale(OUT_DTYPE: tl.constexpr):
    """What the swapped GEMM's accumulator is multiplied by once after its K loop: 2**64 where `mxfp4_decode_k32`
    runs the folded bf16 PTX (its tiles hold the values times 2**-64), else 1."""
    if PTX_OK and OUT_DTYPE == tl.bfloat16:
        return K32_UNSCALE
    return 1.0


@triton.jit
def mxfp4_tile(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Load and decode the MXFP4 weight tile rows offs_n, K indices [k0, k0 + BLOCK_K) -> [BLOCK_N, BLOCK_K] OUT_DTYPE.

    w_ptr: packed uint8, row n at w_ptr + n * stride_wn, K/2 contiguous bytes along K. scale_ptr: uint8, row n at
    scale_ptr + n * stride_sn, one code per 32 along K, contiguous. offs_n [BLOCK_N]: row indices, all of which must be
    loadable (no row mask: wrap them, e.g. `% N`, as the fused-MoE kernels do, and mask the rows at the store); their
    dtype sets the offset width, so pass int64 where n * stride passes 2**31. k0: a multiple of 32. BLOCK_K: a power
    of two >= 32; BLOCK_N: a power of two. K: the weight's K (a multiple of 32); elements at K and past it are 0.
    OUT_DTYPE: tl.bfloat16, tl.float16 or tl.float32 (the fp32 product is cast once; see the module's exactness note).

    The tile is [BLOCK_N, BLOCK_K], the weight's own row-major orientation: a kernel computing tl.dot(a, w) with
    a [BLOCK_M, BLOCK_K] wants w as [BLOCK_K, BLOCK_N], so it calls tl.dot(a, mxfp4_tile(...).T).
    """
    packed, sc = mxfp4_codes(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_K)
    if ASM_DECODE and OUT_DTYPE == tl.bfloat16:
        # Each byte's scale as bf16: exact, bf16 having fp32's exponent range.
        sb = _byte_scales(sc.to(tl.bfloat16), BLOCK_N, BLOCK_K)
        low = _e2m1_pairs(packed, sb, _LOW_NIBBLES_PTX)
        high = _e2m1_pairs(packed, sb, _HIGH_NIBBLES_PTX)
        return tl.interleave(low, high)
    low = decode_e2m1(packed & 0xF)  # elements k0 + 2j
    high = decode_e2m1(packed >> 4)  # elements k0 + 2j + 1
    w = tl.interleave(low, high)  # [BLOCK_N, BLOCK_K], element 2j before 2j + 1
    w = tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * sc[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(OUT_DTYPE)


# The K32 order (the swapped stage GEMM's, `mxfp4_tile_k32`). Within every 32 consecutive K indices (one scale
# block), position c = 16g + 8h + 2t + i holds K index 8t + 4g + 2i + h (t < 4; g, h, i < 2). Read in that order, the
# standard packed bytes decode straight into the wgmma's register fragment: a thread's four consecutive bytes are the
# K pairs its fragment wants, and each output register holds the low (or high) nibbles of two neighbouring bytes,
# which is what the packed PTX writes, so no byte-wise shared-memory reads and no interleaving permutes. The
# activations are put in the same order instead of the weights (`k32_permute`; stage 1 writes the intermediate so,
# `k32_position`), which leaves the product unchanged and the weight format standard. H100 (Triton 3.6, gpt-oss-120b's
# GEMMs at 16-256 tokens' rows per expert): 14-17% faster than the standard order's decode and interleave.
K32 = 32


def k32_permute(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> a contiguous copy in the K32 order: y[..., c] = x[..., K index of c]."""
    # x's chunk index 8t + 4g + 2i + h is (t, g, i, h) row-major; y's position 16g + 8h + 2t + i is (g, h, t, i).
    return _k32_blocks(x, "k32_permute", (4, 2, 2, 2), (1, 3, 0, 2))


def k32_unpermute(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `k32_permute`: y with k32_permute(y) == x, i.e. y[..., K index of c] = x[..., c] (K a multiple
    of 32; a contiguous copy). Prepared MXFP4 weights store each 32-wide K block so (`mxfp4_swizzle`): the decode,
    which hands the MMA the stored K index of c at position c, then hands it K index c."""
    # x's position 16g + 8h + 2t + i is (g, h, t, i) row-major; y's index 8t + 4g + 2i + h is (t, g, i, h).
    return _k32_blocks(x, "k32_unpermute", (2, 2, 4, 2), (2, 0, 3, 1))


def _k32_blocks(x: torch.Tensor, who: str, digits: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """Each 32-wide block of x's last dimension seen as the mixed-radix `digits` (row-major) and those digits put in
    `order`: a contiguous copy. K not a multiple of 32 is refused, naming `who`."""
    k = x.shape[-1]
    if k % K32:
        raise ValueError(f"{who}: the last dimension {k} is not a multiple of {K32}")
    lead = x.shape[:-1]
    d = len(lead) + 1  # the first of the block's digits
    y = x.reshape(*lead, k // K32, *digits).permute(*range(d), *(d + o for o in order))
    return y.reshape(*lead, k).contiguous()


@triton.jit
def k32_position(k):
    """Where K index k sits in the K32 order (the inverse of the order's map; any integer tensor)."""
    r = k % 32
    return k - r + ((r // 4) % 2) * 16 + (r % 2) * 8 + (r // 8) * 2 + (r // 2) % 2


@triton.jit
def k32_copy_block(x_ptr, y_ptr, row, block, K, stride_x, BLOCK: tl.constexpr):
    """Columns [block·BLOCK, (block+1)·BLOCK) of row `row` of x [rows, K] (row stride stride_x) into y [rows, K]
    contiguous, in the K32 order (BLOCK a multiple of 32): `_k32_permute_kernel`'s program, and what the sort's
    first launch runs riding along for the swapped MXFP4 stage 1 (moe_align.RideAlong.k32)."""
    row = row.to(tl.int64)
    k = block * BLOCK + tl.arange(0, BLOCK)
    ok = k < K
    v = tl.load(x_ptr + row * stride_x + k, mask=ok)
    tl.store(y_ptr + row * K + k32_position(k), v, mask=ok)


@triton.jit
def _k32_permute_kernel(x_ptr, y_ptr, K, stride_x, BLOCK: tl.constexpr):
    """Row program_id(0) of x [rows, K] (row stride stride_x) into y [rows, K] contiguous, in the K32 order.
    Grid: k32_grid(rows, K)."""
    k32_copy_block(x_ptr, y_ptr, tl.program_id(0), tl.program_id(1), K, stride_x, BLOCK)


K32_BLOCK = 1024


def k32_grid(rows: int, k: int) -> tuple[int, int]:
    return rows, triton.cdiv(k, K32_BLOCK)


def k32_permute_triton(x: torch.Tensor) -> torch.Tensor:
    """`k32_permute` of a 2-D x (unit stride along K) in one Triton launch."""
    rows, k = x.shape
    if k % K32 or x.stride(1) != 1:
        raise ValueError(f"k32_permute_triton: x {tuple(x.shape)} stride {x.stride()}: K must be a multiple of "
                         f"{K32} with unit stride")
    out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    if rows and k:
        _k32_permute_kernel[k32_grid(rows, k)](x, out, k, x.stride(0), BLOCK=K32_BLOCK, num_warps=4)
    return out


@triton.jit
def mxfp4_tile_k32(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """`mxfp4_tile` (bf16 or fp16) with its columns in the K32 order: column c of the tile is K index k0 + the K32
    order's index at c, from the standard packed bytes (`mxfp4_decode_k32`); operand conventions as `mxfp4_tile`."""
    packed, codes = mxfp4_raw(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_K)
    return mxfp4_decode_k32(packed, codes, BLOCK_N, BLOCK_K, OUT_DTYPE)


@triton.jit
def mxfp4_decode_k32(packed, codes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     SWIZZLED: tl.constexpr = False, CODES_CLAMPED: tl.constexpr = False):
    """The packed bytes [BLOCK_N, BLOCK_K // 2] and their scale codes [BLOCK_N, BLOCK_K // 32] (uint8) decoded into
    the K32 order's tile [BLOCK_N, BLOCK_K] of OUT_DTYPE (bf16 or fp16): by packed PTX on a GPU, by Triton's integer
    decode in the interpreter. The tile is the weights times 1 / k32_unscale(OUT_DTYPE) (2**-64 for bf16 on a GPU:
    K32_FOLD). SWIZZLED: `packed` holds re-encoded bytes (kernels/mxfp4_swizzle.py); the bf16 PTX reads them as they
    are, every other path restores the standard bytes first. CODES_CLAMPED: the codes come from scale records (at
    most 193: `e8m0_to_bf16_folded`)."""
    if SWIZZLED and not (PTX_OK and OUT_DTYPE == tl.bfloat16):
        packed = unswizzle_tile(packed, BLOCK_N, BLOCK_K // 2)
    if PTX_OK:
        if OUT_DTYPE == tl.bfloat16:  # folded: the tile is the values times 2**-64 (K32_FOLD, `k32_unscale`)
            s16 = _byte_scales(e8m0_to_bf16_folded(codes, CODES_CLAMPED), BLOCK_N, BLOCK_K)
            if SWIZZLED:
                lo = _e2m1_pairs(packed, s16, _LOW_SWIZZLED_PTX)
                hi = _e2m1_pairs(packed, s16, _HIGH_SWIZZLED_PTX)
            else:
                lo = _e2m1_pairs(packed, s16, _LOW_FOLDED_PTX)
                hi = _e2m1_pairs(packed, s16, _HIGH_FOLDED_PTX)
        else:
            s16 = _byte_scales(e8m0_to_fp32(codes).to(OUT_DTYPE), BLOCK_N, BLOCK_K)
            lo = _e2m1_pairs(packed, s16, _LOW_NIBBLES_F16_PTX)
            hi = _e2m1_pairs(packed, s16, _HIGH_NIBBLES_F16_PTX)
    else:
        s32 = _byte_scales(e8m0_to_fp32(codes), BLOCK_N, BLOCK_K)
        lo = (decode_e2m1(packed & 0xF) * s32).to(OUT_DTYPE)
        hi = (decode_e2m1(packed >> 4) * s32).to(OUT_DTYPE)
    w = tl.join(_k32_half(lo, BLOCK_N, BLOCK_K), _k32_half(hi, BLOCK_N, BLOCK_K))  # [BLOCK_N, chunk, g, 8, h]
    return tl.reshape(tl.permute(w, (0, 1, 2, 4, 3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _byte_scales(sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each packed byte's scale [BLOCK_N, BLOCK_K // 2] from the tile's [BLOCK_N, BLOCK_K // 32] (16 bytes a scale)."""
    return tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _k32_half(x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One nibble's decoded values [BLOCK_N, BLOCK_K // 2] (byte order) as [BLOCK_N, chunk, g, 8]: byte 4t + 2g + i
    of each 16-byte chunk goes to column 2t + i of half g, i.e. K32 position 16g + 2t + i (+ 8 for the high nibble)."""
    x = tl.permute(tl.reshape(x, (BLOCK_N, BLOCK_K // 32, 4, 2, 2)), (0, 1, 3, 2, 4))
    return tl.reshape(x, (BLOCK_N, BLOCK_K // 32, 2, 8))


@triton.jit
def _e2m1_pairs(packed, scales, PTX: tl.constexpr):
    """scale · value of one nibble of each byte of `packed` (uint8; `PTX` picks the low or high nibbles, and bf16 or
    fp16), `scales` of the same shape in `PTX`'s type, which the result takes; four bytes an instance of `PTX` (see
    _E2M1_PAIRS_BF16_PTX)."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,r,r,r", [packed, scales], dtype=scales.dtype, is_pure=True, pack=4)


@triton.jit
def mxfp4_codes(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_K: tl.constexpr):
    """The packed bytes [BLOCK_N, BLOCK_K // 2] (uint8, 0 past K) and the fp32 scales [BLOCK_N, BLOCK_K // 32] of
    rows offs_n, K indices [k0, k0 + BLOCK_K): what every register decode starts from (operands as `mxfp4_tile`)."""
    packed, codes = mxfp4_raw(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_K)
    return packed, e8m0_to_fp32(codes)


@triton.jit
def mxfp4_raw(w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, BLOCK_K: tl.constexpr):
    """`mxfp4_codes` with the scales left as their e8m0 codes (uint8)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index along the packed row
    packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + kb[None, :], mask=kb[None, :] < K // 2, other=0)
    return packed, mxfp4_scale_codes(scale_ptr, offs_n, k0, stride_sn, K, BLOCK_K)


@triton.jit
def mxfp4_scale_codes(scale_ptr, offs_n, k0, stride_sn, K, BLOCK_K: tl.constexpr):
    """The e8m0 codes [BLOCK_N, BLOCK_K // 32] (uint8) of rows offs_n, K indices [k0, k0 + BLOCK_K); past K they
    read 127 (scale 1): the codes there are 0 already, so the products are exactly 0."""
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # scale index along the row
    return tl.load(scale_ptr + offs_n[:, None] * stride_sn + ks[None, :], mask=ks[None, :] < K // 32, other=127)


@triton.jit
def mxfp4_dot_scaled(a, w_ptr, scale_ptr, offs_n, k0, stride_wn, stride_sn, K, acc, BLOCK_K: tl.constexpr):
    """acc + a · wᵀ over K indices [k0, k0 + BLOCK_K), w the MXFP4 rows offs_n, through `tl.dot_scaled`: the packed
    codes go in as [BLOCK_K/2, BLOCK_N] and the e8m0 scales as [BLOCK_N, BLOCK_K/32], and the compiler upcasts them
    in its own layout (on Hopper, which has no fp4 MMA) instead of `mxfp4_tile`'s decode, cast and transpose.

    a: [BLOCK_M, BLOCK_K] bf16, fp16 or fp8 e4m3 (its scale is the caller's to apply), zero past K. Same operand
    conventions as `mxfp4_tile` (rows loadable, k0 a multiple of 32); codes past K read as 0 and their scales as 127
    (1.0), so nothing past K adds to acc.
    """
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(scale_ptr + offs_n[:, None] * stride_sn + ks[None, :], mask=ks[None, :] < K // 32, other=127)
    codes = tl.load(w_ptr + offs_n[None, :] * stride_wn + kb[:, None], mask=kb[:, None] < K // 2, other=0)
    if a.dtype == tl.bfloat16:
        acc = tl.dot_scaled(a, None, "bf16", codes, scales, "e2m1", acc)
    elif a.dtype == tl.float8e4nv:
        acc = tl.dot_scaled(a, None, "e4m3", codes, scales, "e2m1", acc)
    else:
        acc = tl.dot_scaled(a, None, "fp16", codes, scales, "e2m1", acc)
    return acc


@triton.jit
def _dequant_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_wn, stride_sn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """out [N, K] (contiguous) = the decoded MXFP4 weight. Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = mxfp4_tile(w_ptr, scale_ptr, (rows % N).to(tl.int64), k0, stride_wn, stride_sn, K,
                   BLOCK_N, BLOCK_K, OUT_DTYPE)
    ks = k0 + tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < N) & (ks[None, :] < K)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], w, mask=ok)


def _pow2_at_most(x: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(x, 1)))


def dequantize_mxfp4_triton(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                            block_n: int = DEFAULT_BLOCK_N, block_k: int = DEFAULT_BLOCK_K) -> torch.Tensor:
    """packed uint8 [N, K/2] or [E, N, K/2], scales uint8 [N, K/32] or [E, N, K/32] -> [N, K] / [E, N, K] `dtype`
    (bf16, fp16 or fp32), equal to mxfp4_format.dequantize_mxfp4 (exactly, within the ranges the module docstring
    gives). block_n / block_k (powers of two, block_k >= 32) are capped to the problem: BLOCK_K 64 and K = 96 run one
    full and one half-masked K tile."""
    name = "dequantize_mxfp4_triton"
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed must be uint8, got {packed.dtype} {tuple(packed.shape)}")
    if scales.dtype != torch.uint8:
        raise ValueError(f"{name}: scales must be uint8 (e8m0 codes), got {scales.dtype} {tuple(scales.shape)}")
    if packed.ndim not in (2, 3):
        raise ValueError(f"{name}: packed must be [N, K/2] or [E, N, K/2], got {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    if k % BLOCK:
        raise ValueError(f"{name}: packed {tuple(packed.shape)} gives K = {k}, not a multiple of {BLOCK}")
    want = (*packed.shape[:-1], k // BLOCK)
    if tuple(scales.shape) != want:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} does not match packed {tuple(packed.shape)} "
                         f"(want {want})")
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {dtype}")
    if packed.device != scales.device:
        raise ValueError(f"{name}: packed is on {packed.device}, scales on {scales.device}")
    for what, b, least in (("block_n", block_n, 1), ("block_k", block_k, BLOCK)):
        if b < least or b & (b - 1):
            raise ValueError(f"{name}: {what} must be a power of two >= {least}, got {b}")

    out = torch.empty((*packed.shape[:-1], k), dtype=dtype, device=packed.device)
    w2 = packed.reshape(-1, packed.shape[-1])
    s2 = scales.reshape(-1, scales.shape[-1])
    if w2.shape[-1] and w2.stride(-1) != 1:
        w2 = w2.contiguous()
    if s2.shape[-1] and s2.stride(-1) != 1:
        s2 = s2.contiguous()
    n = w2.shape[0]
    if out.numel() == 0:
        return out
    bn = _pow2_at_most(n, block_n)
    bk = max(BLOCK, _pow2_at_most(k, block_k))
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](w2, s2, out, n, k, w2.stride(0), s2.stride(0),
                          BLOCK_N=bn, BLOCK_K=bk, OUT_DTYPE=_OUT_DTYPES[dtype], num_warps=4)
    return out
