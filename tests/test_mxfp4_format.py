"""MXFP4 format (kernels/mxfp4_format.py) against an independent, per-element reading of the OCP MX v1.0 spec."""

from __future__ import annotations

import math

import pytest
import torch

from tritune.kernels.mxfp4_format import (
    E8M0_NAN,
    ZERO_BLOCK_SCALE_CODE,
    dequantize_mxfp4,
    e2m1_values,
    mxfp4_bytes,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the spec's e2m1 magnitudes, codes 0..7


def spec_reference(w: torch.Tensor) -> tuple[list[int], list[int]]:
    """Slow spec reading: per block, X from frexp of amax; per element, the nearest e2m1 magnitude by search (ties to
    the even code), saturated at 6, sign bit from the input's sign. Returns (codes, scale codes), flat."""
    flat = w.double().flatten().tolist()
    codes, scales = [], []
    for b in range(0, len(flat), 32):
        block = flat[b:b + 32]
        amax = max(abs(x) for x in block)
        biased = 0 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - 2 + 127, 0), 254)
        scales.append(biased)
        for x in block:
            v = min(abs(math.ldexp(x, -(biased - 127))), 6.0)
            best = min(range(8), key=lambda c: (abs(v - TABLE[c]), c % 2))
            codes.append(best | (8 if math.copysign(1.0, x) < 0 else 0))
    return codes, scales


def quantized_codes(w: torch.Tensor) -> tuple[list[int], list[int]]:
    packed, scales = quantize_mxfp4(w)
    return unpack_e2m1(packed).flatten().tolist(), scales.flatten().tolist()


def one_block(*head: float) -> torch.Tensor:
    """A [1, 32] fp32 block: the given values, then zeros."""
    return torch.tensor([list(head) + [0.0] * (32 - len(head))])


def test_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[None]  # [1, 32]: every code, at both nibble positions
    packed = pack_e2m1(codes)
    assert packed.shape == (1, 16) and packed[0, 0] == 0x10 and packed[0, 7] == 0xFE  # low nibble = element 2j
    assert torch.equal(unpack_e2m1(packed), codes)
    values = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))  # scale 2**0
    assert torch.equal(values, e2m1_values().repeat(2)[None])
    assert torch.equal(torch.signbit(values), (codes >= 8))  # code 8 is -0
    assert quantized_codes(values) == (codes.flatten().tolist(), [127])


@pytest.mark.parametrize("shape", [[3, 64], [2, 5, 96]])  # 2-D; 3-D with an odd number of rows and 3 blocks per row
@pytest.mark.parametrize("data", ["mixed", "grid"])
def test_matches_the_spec_reference(shape, data):
    g = torch.Generator().manual_seed(16)
    if data == "mixed":  # every block at its own magnitude 1e-3..1e3, its elements spread over two decades below it
        blocks = (*shape[:-1], shape[-1] // 32)
        mag = 10.0 ** torch.empty(*blocks, 1).uniform_(-3, 3, generator=g)
        spread = 10.0 ** torch.empty(*blocks, 32).uniform_(-2, 0, generator=g)
        w = (torch.randn(*blocks, 32, generator=g) * mag * spread).flatten(-2)
    else:  # multiples of 0.25 up to ±8 at a power-of-two scale: every tie, saturation and -0 happen
        w = torch.randint(-32, 33, shape, generator=g).float() / 4
        w = w * 2.0 ** torch.randint(-20, 21, (*shape[:-1], shape[-1] // 32), generator=g).repeat_interleave(32, -1)
    assert quantized_codes(w) == spec_reference(w)


def test_zero_block():
    packed, scales = quantize_mxfp4(torch.zeros(2, 64))
    assert scales.flatten().tolist() == [ZERO_BLOCK_SCALE_CODE] * 4 == [0] * 4
    assert not packed.any() and torch.equal(dequantize_mxfp4(packed, scales), torch.zeros(2, 64))
    packed, scales = quantize_mxfp4(-torch.zeros(1, 32))
    assert unpack_e2m1(packed).flatten().tolist() == [8] * 32 and not dequantize_mxfp4(packed, scales).any()


@pytest.mark.parametrize("x", [-10, 0, 5])
def test_largest_and_smallest_values_are_exact(x):
    w = one_block(6.0, -4.0, 0.5, -0.5, 1.5) * 2.0**x  # amax 6·2**X exactly: scale 2**X, every value on the grid
    packed, scales = quantize_mxfp4(w)
    assert scales.item() == 127 + x
    assert unpack_e2m1(packed)[0, :5].tolist() == [7, 14, 1, 9, 3]
    assert torch.equal(dequantize_mxfp4(packed, scales), w)


def test_saturation():
    w = one_block(7.5, -7.99, 6.5, 5.0, 5.01)  # amax in [4, 8): scale 1, and values past 6 clamp to ±6
    packed, scales = quantize_mxfp4(w)
    assert scales.item() == 127
    assert dequantize_mxfp4(packed, scales)[0, :5].tolist() == [6.0, -6.0, 6.0, 4.0, 6.0]


def test_ties_to_even():
    ties = [2.5, 3.5, 0.25, 0.75, 1.25, 1.75, 5.0, -2.5, -0.25]
    packed, scales = quantize_mxfp4(one_block(4.0, *ties))  # 4.0 fixes the scale at 1
    assert scales.item() == 127
    assert dequantize_mxfp4(packed, scales)[0, 1:10].tolist() == [2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -2.0, -0.0]
    assert unpack_e2m1(packed)[0, 9].item() == 8  # -0.25 rounds to -0, sign kept


@pytest.mark.parametrize("amax, code", [(4.0, 127), (8.0, 128), (2.0**-20, 105), (2.0**-125, 0), (2.0**126, 251)])
def test_power_of_two_amax(amax, code):
    packed, scales = quantize_mxfp4(one_block(amax, -amax / 8))
    assert scales.item() == code
    assert unpack_e2m1(packed)[0, :2].tolist() == [6, 9]  # 4 and -0.5 times the scale
    assert dequantize_mxfp4(packed, scales)[0, :2].tolist() == [amax, -amax / 8]


def test_e8m0_range_extremes():
    packed, scales = quantize_mxfp4(one_block(1e-40, -3e-41))  # fp32 subnormals: X clamps up to -127
    assert scales.item() == 0 and not dequantize_mxfp4(packed, scales).any()  # 1e-40 / 2**-127 ≈ 0.017 rounds to 0
    big = torch.finfo(torch.float32).max
    packed, scales = quantize_mxfp4(one_block(1e38, big, -big))
    assert scales.item() == 252  # floor(log2(fp32 max)) = 127: the largest code finite input gives, below the 254 cap
    w = dequantize_mxfp4(packed, scales)
    assert torch.isfinite(w).all() and w[0, :3].tolist() == [2.0**126, 1.5 * 2.0**127, -1.5 * 2.0**127]
    assert torch.isnan(dequantize_mxfp4(packed, torch.tensor([[E8M0_NAN]], dtype=torch.uint8))).all()


def test_rejects_nan_inf_and_bad_k():
    w = torch.ones(3, 64)
    w[1, 5], w[2, 0] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"NaN or Inf: the input has 2 \(first at index \(1, 5\)\)"):
        quantize_mxfp4(w)
    with pytest.raises(ValueError, match=r"K \(last dimension\) = 100 is not a multiple of the MXFP4 block 32"):
        quantize_mxfp4(torch.ones(4, 100))
    with pytest.raises(ValueError, match="K"):
        mxfp4_bytes(4, 100)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_their_fp32_upcast(dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(4, 128, generator=g) * 10.0 ** torch.randint(-4, 4, (4, 1), generator=g)).to(dtype)
    packed, scales = quantize_mxfp4(w)
    packed32, scales32 = quantize_mxfp4(w.float())
    assert torch.equal(packed, packed32) and torch.equal(scales, scales32)


def test_error_within_the_documented_bound():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 256, generator=g) * 10.0 ** torch.empty(8, 256).uniform_(-3, 3, generator=g)
    packed, scales = quantize_mxfp4(w)
    err = (dequantize_mxfp4(packed, scales) - w).abs()
    s = (2.0 ** (scales.double() - 127)).repeat_interleave(32, -1)
    assert (err <= torch.maximum(w.abs(), s) / 4).all()
    assert (err <= w.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1) / 4).all()
    # the bound is tight: 7.99 saturates to 6 (just under 25%) and 0.25·s flushes to zero (exactly s / 4)
    w = one_block(7.99, 0.25)
    err = (dequantize_mxfp4(*quantize_mxfp4(w)) - w).abs()
    assert 0.24 < err[0, 0] / 7.99 < 0.25 and err[0, 1] == 0.25


def test_bytes():
    assert mxfp4_bytes(2880, 5760) == 2880 * 5760 * 17 // 32  # 4.25 bits a weight
    assert mxfp4_bytes(1, 32) == 17
