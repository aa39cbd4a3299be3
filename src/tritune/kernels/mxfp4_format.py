"""MXFP4 weights (OCP Microscaling Formats v1.0): e2m1 elements, one e8m0 scale per 32 along K; pure torch.

MXFP4 is how gpt-oss ships its MoE experts: 4 bits a value plus 8 bits per 32 values, 4.25 bits per weight. Hopper
has no fp4 MMA, so the fused-MoE kernels will load the packed codes and scales and upcast to bf16/fp8 before the dot.
This module is the spec-exact reference those kernels, and the tuner's correctness gate, are checked against.

Error bound (the gate's reasoning). Within a block of scale s = 2**X, quantize_mxfp4 rounds w / s to the nearest
e2m1 value, and dequantize is exact, so per element

    |dequantize(quantize(w)) - w| <= max(|w|, s) / 4,

i.e. at most 25% of |w| where |w| >= s (e2m1's normal range: one mantissa bit, so half a step is a quarter of the
binade; the saturated values w / s in (6, 8) lose less than (w / s) / 4 too), and at most s / 4 below it (half of
the subnormal step 0.5·s; values under s / 4 flush to zero). Since the block's amax >= 4·s, no error passes amax / 4.
The gate will compare a kernel against the torch MoE run on the DEQUANTIZED weights, so its tolerance covers
accumulation order only; this quantization error never enters it.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements along K that share one scale
BITS_PER_WEIGHT = 4.25  # 4-bit code + 8-bit scale / 32

# e2m1: code bit 3 = sign, bits 2-1 = exponent (bias 1), bit 0 = mantissa; exponent 0 is subnormal (0, 0.5).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; codes 8..15 are their negatives (8 is -0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of e2m1's largest power of two: 6 = 1.5 * 2**2
E2M1_SIGN = 0x8

# e8m0: a uint8 biased exponent, value 2**(code - 127); 255 is NaN (the quantizer never writes it), no zero, no sign.
E8M0_BIAS = 127
E8M0_MAX_CODE = 254
E8M0_NAN = 255
# The spec leaves an all-zero block's scale free. Its own rule, X = floor(log2(amax)) - emax, gives -inf there and the
# clamp to the e8m0 range lands on the smallest valid code, so that is what zero blocks get: code 0, scale 2**-127.
# That scale is an fp32 subnormal; a kernel that flushes it to zero still gets the right answer, all codes being 0.
ZERO_BLOCK_SCALE_CODE = 0

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_values() -> torch.Tensor:
    """The 16-entry lookup table: fp32 [16], entry c is the value of e2m1 code c (entry 8 is -0.0)."""
    return torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2**exponent for integer exponent in [-127, 127], built from the bits so it is exact (2**-127 is the one
    subnormal; exp2 and pow are only promised to be close)."""
    biased = exponent.to(torch.int32) + E8M0_BIAS
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))
    return bits.view(torch.float32)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (values 0..15, K even) -> packed uint8 [..., K/2].

    Byte j holds element 2j in its LOW nibble and element 2j+1 in its HIGH nibble: the layout the kernels read.
    """
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2 or bool((codes > 15).any()):
        raise ValueError(f"pack_e2m1 needs uint8 codes 0..15 with an even last dimension, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] (low nibble first, as pack_e2m1 writes) -> codes uint8 [..., K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"K (last dimension) = {k} is not a multiple of the MXFP4 block {BLOCK}")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] (fp32, bf16 or fp16; K a multiple of 32; finite) -> (packed uint8 [..., K/2], scales uint8
    [..., K/32]) with w ≈ dequantize_mxfp4(packed, scales).

    Per block of 32 along K, as the spec converts: X = floor(log2(amax)) - 2, biased and clamped to e8m0 [0, 254]
    (all-zero blocks: code 0); each w / 2**X rounds to the nearest e2m1 value, ties to the even mantissa bit,
    saturating at ±6. The sign is kept, so a negative value that rounds to zero is code 8 (-0).
    """
    if w.dtype not in _FLOATS:
        raise TypeError(f"quantize_mxfp4 takes fp32, bf16 or fp16, got {w.dtype}")
    if w.ndim == 0:
        raise ValueError("quantize_mxfp4 needs a tensor [..., K], got a scalar")
    _check_k(w.shape[-1])
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"MXFP4 cannot encode NaN or Inf: the input has {int(bad.sum())} (first at index {first})")

    blocks = w.float().unflatten(-1, (-1, BLOCK))  # exact upcast; [..., K/32, 32]
    amax = blocks.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1, exact for subnormals
    biased = torch.where(amax > 0, exp - 1 - E2M1_EMAX + E8M0_BIAS, ZERO_BLOCK_SCALE_CODE).clamp(0, E8M0_MAX_CODE)
    # Multiplying by 2**-X is exact (|result| < 8; results small enough to lose bits are far below the 0.25 that
    # rounds to zero). -X lies in [-127, 127] (fp32's largest amax gives code 252), so _pow2 covers it.
    scaled = blocks * _pow2(E8M0_BIAS - biased)[..., None]
    mag = scaled.abs()
    # e2m1's step is 0.5 below 2, 1 in [2, 4), 2 from 4: torch.round on mag / step is ties-to-even, and on this grid the
    # even multiple of the step is always the code with mantissa bit 0 (a tie rounding up across 2 or 4 lands on it).
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    rounded = (torch.round(mag / step) * step).clamp_max(E2M1_MAX)
    codes = torch.searchsorted(e2m1_values()[:8].to(rounded.device), rounded).to(torch.uint8)
    codes |= torch.signbit(scaled).to(torch.uint8) << 3
    return pack_e2m1(codes.flatten(-2)), biased.to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2], scales uint8 [..., K/32] -> w dtype [..., K], value(code) * 2**(scale - 127).

    Exact in fp32 and in bf16 (same exponent range; e2m1 values need 2 significant bits) for every scale code up to
    252, which covers everything quantize_mxfp4 writes; at 253 and 254 the larger values overflow to inf. fp16 is exact
    only for codes 104..140. Scale code 255 (NaN) makes its whole block NaN, as the spec says.
    """
    k = packed.shape[-1] * 2
    _check_k(k)
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or scales.shape != (*packed.shape[:-1], k // BLOCK):
        raise ValueError(f"dequantize_mxfp4 needs uint8 packed [..., K/2] and scales [..., K/32], got {packed.dtype} "
                         f"{tuple(packed.shape)} and {scales.dtype} {tuple(scales.shape)}")
    values = e2m1_values().to(packed.device)[unpack_e2m1(packed).long()].unflatten(-1, (-1, BLOCK))
    scale = _pow2(scales.to(torch.int32).clamp_max(E8M0_MAX_CODE) - E8M0_BIAS)
    scale = torch.where(scales == E8M0_NAN, float("nan"), scale)
    return (values * scale[..., None]).flatten(-2).to(dtype)


def mxfp4_bytes(rows: int, k: int) -> int:
    """Bytes of an MXFP4 [rows, K] weight: rows·K/2 of packed codes plus rows·K/32 of scales."""
    _check_k(k)
    return rows * k // 2 + rows * k // BLOCK
