"""MXFP4 Triton decoding (kernels/mxfp4.py) against the torch reference (kernels/mxfp4_format.py), bit for bit.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1). That interpreter's
fp32 -> bf16 cast gets results below bf16's normal range wrong (it clamps the exponent without shifting the
mantissa), so the random-code bf16 comparison leaves out scale codes 0 and 1, the only ones whose products go there;
fp32 and fp16 outputs are compared over their whole exact ranges.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tritune.kernels.mxfp4 import (
    K32_UNSCALE,
    decode_e2m1,
    dequantize_mxfp4_triton,
    e8m0_to_bf16,
    e8m0_to_bf16_folded,
    e8m0_to_fp32,
    k32_permute,
    k32_permute_triton,
    k32_unpermute,
    mxfp4_tile,
    mxfp4_tile_k32,
)
from tritune.kernels.mxfp4_format import dequantize_mxfp4, e2m1_values, pack_e2m1, quantize_mxfp4, unpack_e2m1

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run where the data is; compared on the CPU
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bit pattern (so -0.0 differs from 0.0); NaN where the other is NaN, whatever its sign and
    payload (torch writes bf16 NaN as 0xFFFF, the kernel 0x7FC0: neither is specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got.view(_BITS[got.dtype]) != want.view(_BITS[want.dtype])) & ~nan
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} differ; got {got[bad][:4]} want {want[bad][:4]}"


@triton.jit
def _map_probe(codes_ptr, out_ptr, N: tl.constexpr, FN: tl.constexpr):
    """out[i] = FN(codes[i]): one launch for each element-wise decode helper under test."""
    i = tl.arange(0, N)
    tl.store(out_ptr + i, FN(tl.load(codes_ptr + i)))


@triton.jit
def _tile_t_probe(w_ptr, s_ptr, out_ptr, k0, K, stride_wn, stride_sn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One mxfp4_tile at k0, stored transposed as the fused-MoE kernel feeds it to tl.dot: out [BLOCK_K, BLOCK_N]."""
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = mxfp4_tile(w_ptr, s_ptr, n, k0, stride_wn, stride_sn, K, BLOCK_N, BLOCK_K, tl.float32)
    tl.store(out_ptr + k[:, None] * BLOCK_N + n[None, :], w.T)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_decode_e2m1_all_codes(dtype):
    out = torch.full((16,), float("nan"), device=DEVICE)
    _map_probe[(1,)](torch.arange(16).to(dtype).to(DEVICE), out, N=16, FN=decode_e2m1)
    _assert_bits_equal(out.cpu(), e2m1_values())  # entry 8 is -0.0: the bit compare checks the sign


def test_e8m0_to_fp32_every_code():
    codes = torch.arange(256).to(torch.uint8).to(DEVICE)
    out = torch.zeros(256, device=DEVICE)
    _map_probe[(1,)](codes, out, N=256, FN=e8m0_to_fp32)
    out = out.cpu()
    want = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float32)  # 2**-127 is fp32's subnormal
    _assert_bits_equal(out[:255], want)
    for c in (0, 1, 100, 127, 128, 200, 254):
        assert out[c].item() == 2.0 ** (c - 127)
    assert out[0].view(torch.int32).item() == 0x00400000
    assert torch.isnan(out[255]) and out[255].view(torch.int32).item() == 0x7FC00000


def test_e8m0_to_bf16_every_code():
    """The integer-only conversion the swapped GEMM's bf16 decode uses: 2**(code - 127) for every code (0 is bf16's
    subnormal 2**-127), NaN for 255."""
    codes = torch.arange(256).to(torch.uint8).to(DEVICE)
    out = torch.zeros(256, dtype=torch.bfloat16, device=DEVICE)
    _map_probe[(1,)](codes, out, N=256, FN=e8m0_to_bf16)
    out = out.cpu()
    want = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float32).to(torch.bfloat16)
    _assert_bits_equal(out[:255], want)
    assert out[0].view(torch.int16).item() == 0x0040 and out[254].item() == 2.0 ** 127
    assert torch.isnan(out[255]) and out[255].view(torch.int16).item() == 0x7FC0


def test_folded_e8m0_to_bf16_every_code():
    """The folded decode's scale (K32_FOLD): 2**(code - 65) for codes 0-192, inf at 193, NaN above."""
    codes = torch.arange(256).to(torch.uint8).to(DEVICE)
    out = torch.zeros(256, dtype=torch.bfloat16, device=DEVICE)
    _map_probe[(1,)](codes, out, N=256, FN=e8m0_to_bf16_folded)
    out = out.cpu()
    want = torch.tensor([2.0 ** (c - 65) for c in range(193)], dtype=torch.float32).to(torch.bfloat16)
    _assert_bits_equal(out[:193], want)
    assert out[0].item() == 2.0 ** -65 and out[192].item() == 2.0 ** 127
    assert torch.isposinf(out[193]) and bool(torch.isnan(out[194:]).all())


SHAPES = [pytest.param((33, 96), id="N33-K96"), pytest.param((5, 32), id="N5-K32"),
          pytest.param((3, 17, 160), id="E3-N17-K160")]


def _quantized(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded N(0, 1) data with one all-zero block and one block of tiny negatives (codes -0), quantized."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    w.view(-1, shape[-1])[0, :32] = 0.0
    w.view(-1, shape[-1])[-1, -32:] = -1e-3 * torch.rand(32, generator=gen)
    w.view(-1, shape[-1])[-1, -1] = -1.0  # amax 1: scale 2**-2, so the -1e-3s round to -0 (code 8)
    return quantize_mxfp4(w)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_dequant_matches_reference_on_quantized_data(shape, dtype):
    packed, scales = _quantized(shape, seed=len(shape) * 100 + shape[-1])
    assert bool((unpack_e2m1(packed) == 8).any())  # some -0 codes
    nonzero = scales[scales != 0]
    assert int(nonzero.min()) >= 104 and int(nonzero.max()) <= 140  # fp16's exact range (mxfp4_format)
    got = dequantize_mxfp4_triton(packed.to(DEVICE), scales.to(DEVICE), dtype).cpu()
    assert got.shape == (*shape[:-1], shape[-1])
    _assert_bits_equal(got, dequantize_mxfp4(packed, scales, dtype))


@pytest.mark.parametrize("dtype,lo", [(torch.float32, 0), (torch.bfloat16, 2)])
def test_dequant_random_codes_whole_scale_range(dtype, lo):
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 224
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(lo, 253, (n, k // 32), dtype=torch.uint8, generator=gen)  # 253, 254 overflow to inf
    scales[0, 0], scales[1, 6] = lo, 252
    scales[2, 3] = 255  # NaN: the whole block is NaN
    got = dequantize_mxfp4_triton(packed.to(DEVICE), scales.to(DEVICE), dtype, block_n=16, block_k=64).cpu()
    want = dequantize_mxfp4(packed, scales, dtype)
    assert bool(torch.isnan(got[2, 96:128]).all()) and int(torch.isnan(got).sum()) == 32
    _assert_bits_equal(got, want)


@pytest.mark.parametrize("n,k,block_n,block_k", [(33, 96, 32, 64), (9, 160, 8, 128), (6, 32, 4, 256)])
def test_k_tail_masked_and_rows_wrapped(n, k, block_n, block_k):
    """K not a multiple of BLOCK_K, N not a multiple of BLOCK_N (the last tiles are partial), and the rows are views
    into wider rows (stride > K/2) whose tails hold 0xFF bytes and NaN scale codes."""
    gen = torch.Generator().manual_seed(n * k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    wide_w = torch.full((n, k // 2 + 64), 0xFF, dtype=torch.uint8)
    wide_s = torch.full((n, k // 32 + 8), 255, dtype=torch.uint8)
    wide_w[:, :k // 2] = pack_e2m1(codes)
    wide_s[:, :k // 32] = torch.randint(120, 135, (n, k // 32), dtype=torch.uint8, generator=gen)
    packed, scales = wide_w[:, :k // 2], wide_s[:, :k // 32]
    assert packed.stride(0) > k // 2
    got = dequantize_mxfp4_triton(packed.to(DEVICE), scales.to(DEVICE), torch.float16, block_n=block_n,
                                  block_k=block_k).cpu()
    _assert_bits_equal(got, dequantize_mxfp4(packed, scales, torch.float16))


def test_tile_transposed_for_dot_and_zero_past_k():
    """The tile helper on its own: stored .T, and 0 past K even though the bytes and scales there are 0xFF / NaN."""
    gen = torch.Generator().manual_seed(3)
    n, k, k0, block_k = 8, 64, 32, 64  # the tile covers [32, 96): its second half lies past K
    wide_w = torch.full((n, k // 2 + 32), 0xFF, dtype=torch.uint8)
    wide_s = torch.full((n, k // 32 + 2), 255, dtype=torch.uint8)
    wide_w[:, :k // 2] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    wide_s[:, :k // 32] = torch.randint(110, 140, (n, k // 32), dtype=torch.uint8, generator=gen)
    out = torch.full((block_k, n), float("nan"), device=DEVICE)
    _tile_t_probe[(1,)](wide_w.to(DEVICE), wide_s.to(DEVICE), out, k0, k, wide_w.stride(0), wide_s.stride(0),
                        BLOCK_N=n, BLOCK_K=block_k)
    out = out.cpu()
    ref = dequantize_mxfp4(wide_w[:, :k // 2], wide_s[:, :k // 32])
    _assert_bits_equal(out[:32], ref[:, k0:].T.contiguous())
    _assert_bits_equal(out[32:], torch.zeros(32, n))


def test_empty_rows():
    out = dequantize_mxfp4_triton(torch.zeros((0, 16), dtype=torch.uint8), torch.zeros((0, 1), dtype=torch.uint8))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("packed,scales,kwargs,match", [
    (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), {},
     r"packed must be uint8.*\(4, 16\)"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float32), {},
     r"scales must be uint8.*\(4, 1\)"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), {},
     r"scales \(4, 2\) does not match packed \(4, 16\) \(want \(4, 1\)\)"),
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, 1, dtype=torch.uint8), {},
     r"scales \(2, 3, 1\) does not match packed \(2, 4, 16\)"),
    (torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), {},
     r"packed \(4, 24\) gives K = 48, not a multiple of 32"),
    (torch.zeros(16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), {}, r"packed must be \[N, K/2\]"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), {"dtype": torch.int32},
     r"dtype must be"),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), {"block_k": 48},
     r"block_k must be a power of two >= 32"),
])
def test_bad_inputs(packed, scales, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4_triton(packed, scales, **kwargs)


def test_k32_order_in_torch_and_triton_agree():
    """k32_permute (torch) puts K index 8t + 4g + 2i + h of each 32-chunk at position 16g + 8h + 2t + i; the Triton
    copy (which stores by k32_position, the inverse map) gives the same tensor; K not a multiple of 32 is refused."""
    x = torch.arange(3 * 96, dtype=torch.float32).reshape(3, 96)
    y = k32_permute(x)
    for c in range(96):
        q, r = divmod(c, 32)
        g, h, t, i = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
        assert torch.equal(y[:, c], x[:, 32 * q + 8 * t + 4 * g + 2 * i + h]), c
    assert sorted(y[0].tolist()) == x[0].tolist()  # a permutation
    h16 = torch.randn(5, 160, generator=torch.Generator().manual_seed(2)).half()
    assert torch.equal(k32_permute_triton(h16.to(DEVICE)).cpu(), k32_permute(h16))
    with pytest.raises(ValueError, match="the last dimension 40 is not a multiple of 32"):
        k32_permute(torch.zeros(2, 40))
    # k32_unpermute (the order prepared weights are stored in) undoes it, both ways round
    assert torch.equal(k32_unpermute(y), x) and torch.equal(k32_permute(k32_unpermute(x)), x)
    with pytest.raises(ValueError, match="k32_unpermute: the last dimension 40 is not a multiple of 32"):
        k32_unpermute(torch.zeros(2, 40))
    with pytest.raises(ValueError, match=r"K must be a multiple of 32 with unit stride"):
        k32_permute_triton(torch.zeros(2, 48, device=DEVICE))


@triton.jit
def _tile_k32_probe(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    OUT_DTYPE: tl.constexpr):
    """The whole [N, K] weight through mxfp4_tile_k32, stored as the tiles come (columns in the K32 order)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = mxfp4_tile_k32(w_ptr, s_ptr, n % N, k0, K // 2, K // 32, K, BLOCK_N, BLOCK_K, OUT_DTYPE)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n[:, None] * K + k[None, :], w, mask=(n[:, None] < N) & (k[None, :] < K))


# Scale codes each type holds exactly (module docstring of kernels/mxfp4.py): fp16 104-140; bf16 through the folded
# PTX (K32_FOLD) 59-192.
K32_DTYPES = [pytest.param(torch.float16, tl.float16, (104, 141), id="fp16"),
              pytest.param(torch.bfloat16, tl.bfloat16, (59, 193), id="bf16", marks=pytest.mark.skipif(
                  DEVICE == "cpu", reason="bf16 (the packed PTX decode) on a GPU only: the interpreter's fp32 -> bf16 "
                  "cast is wrong for tiny results (module docstring)"))]


@pytest.mark.parametrize(("dtype", "out_tl", "codes"), K32_DTYPES)
def test_tile_decode_in_the_k32_order_is_the_permuted_dequantized_weight(dtype, out_tl, codes):
    """mxfp4_tile_k32, as the swapped stage GEMM decodes (packed PTX on a GPU, the integer decode in the
    interpreter), equals the spec's dequantizer put in the K32 order, bit for bit; K 160 leaves the second tile of
    128 half past K."""
    gen = torch.Generator().manual_seed(7)
    n, k = 37, 160
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(codes[0], codes[1], (n, k // 32), generator=gen, dtype=torch.uint8)
    out = torch.full((n, k), float("nan"), dtype=dtype, device=DEVICE)
    _tile_k32_probe[(triton.cdiv(n, 16), triton.cdiv(k, 128))](packed.to(DEVICE), scales.to(DEVICE), out, n, k,
                                                               BLOCK_N=16, BLOCK_K=128, OUT_DTYPE=out_tl)
    # the folded bf16 tile holds the weights times 2**-64 (exactly: powers of two), fp16 and the interpreter's as is
    unscale = K32_UNSCALE.value if dtype == torch.bfloat16 and DEVICE == "cuda" else 1.0
    _assert_bits_equal((out.cpu().float() * unscale).to(dtype), k32_permute(dequantize_mxfp4(packed, scales, dtype)))
