"""The packed PTX decode's integer part (kernels/mxfp4.py), emulated on the CPU from the PTX text itself: the GPU is
the only place the PTX runs, so this pins the arithmetic that builds each e2m1 code's bf16 (or fp16) sign and
magnitude fields, for every pair of bytes a register half-pair can hold. The float multiplies after it (by the bias
2**126 or 2**14, then the scale) are exact and checked bit for bit on the GPU (test_mxfp4_kernels.py's K32 tile
test)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tritune.kernels.mxfp4 import _pairs_ptx, bf16_field_factor

U32 = np.uint64(0xFFFFFFFF)


def _constant(ptx: str, pattern: str) -> int:
    match = re.search(pattern, ptx)
    assert match, f"{pattern!r} not in the PTX"
    text = match.group(1)
    return int(text, 16) if text.startswith("0x") else int(text)


def _prmt_halves(word: np.ndarray, first_byte: int) -> np.ndarray:
    """prmt.b32 d, word, 0, 0x4140 (first_byte 0) or 0x4342 (2): bytes first_byte, first_byte + 1 of word into the
    low bytes of d's two halves, zeros above them."""
    b0 = (word >> np.uint64(8 * first_byte)) & np.uint64(0xFF)
    b1 = (word >> np.uint64(8 * first_byte + 8)) & np.uint64(0xFF)
    return b0 | (b1 << np.uint64(16))


def _bf16_fields(ptx: str, word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two output registers before the float multiplies, by the bf16 PTX's mask, prmt, multiply and mask."""
    nibbles = _constant(ptx, r"and\.b32 m, \$2, (0x[0-9A-Fa-f]+);")
    factor = _constant(ptx, r"mul\.lo\.u32 x, x, (0x[0-9A-Fa-f]+);")
    keep = _constant(ptx, r"and\.b32 \$0, x, (0x[0-9A-Fa-f]+);")
    assert _constant(ptx, r"mul\.lo\.u32 y, y, (0x[0-9A-Fa-f]+);") == factor
    assert _constant(ptx, r"and\.b32 \$1, y, (0x[0-9A-Fa-f]+);") == keep
    m = word & np.uint64(nibbles)
    return tuple((_prmt_halves(m, first) * np.uint64(factor)) & U32 & np.uint64(keep) for first in (0, 2))


def _shift_fields(ptx: str, word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same for the shift form's prmt, two shifts, two masks and an or (fp16's PTX)."""
    shift_mag = _constant(ptx, r"shl\.b32 t, x, (\d+);")
    shift_sign = _constant(ptx, r"shl\.b32 u, x, (\d+);")
    mag_mask = _constant(ptx, r"and\.b32 t, t, (0x[0-9A-Fa-f]+);")
    out = []
    for first in (0, 2):
        x = _prmt_halves(word, first)
        t = ((x << np.uint64(shift_mag)) & U32) & np.uint64(mag_mask)
        u = ((x << np.uint64(shift_sign)) & U32) & np.uint64(0x80008000)
        out.append(t | u)
    return tuple(out)


def _spec_fields(word: np.ndarray, high: bool, mag_bit: int) -> tuple[np.ndarray, np.ndarray]:
    """Each byte's chosen nibble: sign (bit 3) to bit 15 of its half, magnitude (bits 0-2) to bits mag_bit.. of it;
    bytes 0, 1 to the first register's halves, bytes 2, 3 to the second's."""
    halves = []
    for byte in range(4):
        v = (word >> np.uint64(8 * byte + (4 if high else 0))) & np.uint64(0xF)
        halves.append(((v & np.uint64(7)) << np.uint64(mag_bit)) | ((v >> np.uint64(3)) << np.uint64(15)))
    return halves[0] | (halves[1] << np.uint64(16)), halves[2] | (halves[3] << np.uint64(16))


def _every_byte_pair() -> np.ndarray:
    """Words covering every value of bytes (0, 1) and, shifted, of bytes (2, 3), with the other pair random."""
    pairs = np.arange(1 << 16, dtype=np.uint64)
    other = np.random.default_rng(7).integers(0, 1 << 16, size=pairs.size, dtype=np.uint64)
    return np.concatenate([pairs | (other << np.uint64(16)), other | (pairs << np.uint64(16))])


@pytest.mark.parametrize("high", [False, True], ids=["low-nibbles", "high-nibbles"])
@pytest.mark.parametrize(("fp16", "emulate", "mag_bit"), [(False, _bf16_fields, 6), (True, _shift_fields, 9)],
                         ids=["bf16-one-multiply", "fp16-shifts"])
def test_ptx_fields_match_the_spec(fp16, emulate, mag_bit, high):
    words = _every_byte_pair()
    got = emulate(_pairs_ptx(fp16, high), words)
    for g, w in zip(got, _spec_fields(words, high, mag_bit=mag_bit), strict=True):
        bad = g != w
        assert not bad.any(), f"{int(bad.sum())} words differ, first {hex(int(words[bad][0]))}"


@pytest.mark.parametrize("high", [False, True])
def test_bf16_factor_keeps_each_half_apart(high):
    """The largest masked half times the factor stays under 2**16 (nothing carries into the other half), and its two
    copies of the nibble do not overlap (bits 6-9 and 12-15)."""
    factor = bf16_field_factor(high)
    top = 0xF << (4 if high else 0)
    assert top * factor < 1 << 16
    assert factor == (1 << (6 - (4 if high else 0))) + (1 << (12 - (4 if high else 0)))
    for v in range(16):
        product = (v << (4 if high else 0)) * factor
        assert product == (v << 6) | (v << 12)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    """A 16-bit bf16 pattern as its float32 value (bf16 is float32's top half)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.mark.parametrize("high", [False, True], ids=["low-nibbles", "high-nibbles"])
def test_folded_bf16_ptx_is_the_value_times_2_to_the_minus_64(high):
    """The swapped GEMM's folded bf16 PTX (K32_FOLD): the fields, then one multiply by the scale 2**(code - 65) that
    `e8m0_to_bf16_folded` gives, make value · 2**(code - 127) · 2**-64 for every nibble and scale code 66-192 (the
    normal range; 59-65 go subnormal and are checked on the GPU), exactly: no bias multiply is left."""
    from tritune.kernels.mxfp4 import K32_FOLD, K32_UNSCALE
    from tritune.kernels.mxfp4_format import e2m1_values

    ptx = _pairs_ptx(False, high, folded=True)
    assert "bias" not in ptx and ptx.count("fma.rn.bf16x2") == 2
    assert K32_UNSCALE.value == 2.0 ** (126 - K32_FOLD.value)
    words = np.arange(1 << 16, dtype=np.uint64)  # bytes 0 and 1: every pair
    first, _ = _bf16_fields(ptx, words)
    values = e2m1_values().numpy()
    for code in (66, 100, 127, 150, 192):
        scale = np.float32(2.0 ** (code - 127 + K32_FOLD.value))
        for half in (0, 1):
            got = _bf16_value((first >> np.uint64(16 * half)) & np.uint64(0xFFFF)) * scale
            nibble = (words >> np.uint64(8 * half + (4 if high else 0))) & np.uint64(0xF)
            want = values[nibble.astype(np.int64)] * np.float32(2.0 ** (code - 127)) / np.float32(K32_UNSCALE.value)
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), (code, half)
            assert not (got.view(np.uint32) & np.uint32(0xFFFF)).any()  # a bf16 holds it: the fma rounds nothing
