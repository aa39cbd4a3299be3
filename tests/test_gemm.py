"""GEMM kernels against gemm_reference: odd shapes, split-K, persistent TMA, the scale pipeline, validation errors.

Without a GPU these run in Triton's interpreter (tests/conftest.py), so blocks stay small (16/32) to keep it fast.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tritune.kernels import gemm as gk
from tritune.kernels.quant import quantize_blocks, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn

# (kernel, operand dtype of the bf16 kernel): fp16 and fp32 only, since tl.dot on bf16 operands is wrong in the
# interpreter; fp8 is the operand type of the other two kernels.
FLAVOURS = [("bf16", torch.float16), ("bf16", torch.float32), ("a8w8", FP8), ("a8w8_blockscale", FP8)]
FLAVOUR_IDS = ["fp16", "fp32", "a8w8", "a8w8_blockscale"]
ONE_PER_KERNEL = [("bf16", torch.float16), ("a8w8", FP8), ("a8w8_blockscale", FP8)]
ONE_PER_KERNEL_IDS = ["fp16", "a8w8", "a8w8_blockscale"]


def _operands(kernel: str, M: int, N: int, K: int, dtype: torch.dtype = torch.float16, seed: int = 0) -> dict:
    """Seeded A [M, K], B [N, K] (and fp32 scales) for `kernel`, as gemm's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen)
    b = torch.randn(N, K, generator=gen) / math.sqrt(K)
    # Magnitudes that change from row to row and from one 128-block to the next make every scale distinct, so a
    # kernel reading the wrong row's, the wrong N block's or the wrong K block's scale is off by a factor, not
    # by rounding.
    a = a * (1 + torch.arange(M) % 3)[:, None] * (1 + torch.arange(K) // gk.SCALE_BLOCK % 3)[None, :]
    b = b * (1 + torch.arange(N) % 2)[:, None] * (1 + torch.arange(N) // gk.SCALE_BLOCK % 3)[:, None]
    if kernel == "bf16":
        ops = {"a": a.to(dtype), "b": b.to(dtype), "a_scale": None, "b_scale": None}
    elif kernel == "a8w8":
        (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
        ops = {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}
    else:
        (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, gk.SCALE_BLOCK)
        ops = {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}
    return {k: v.to(DEVICE) if v is not None else None for k, v in ops.items()}


def _reference(kernel: str, ops: dict) -> torch.Tensor:
    return gk.gemm_reference(kernel, ops["a"], ops["b"], ops["a_scale"], ops["b_scale"])


def _run_fp32(kernel: str, ops: dict, cfg: gk.GemmConfig, **kwargs) -> torch.Tensor:
    """gemm into an fp32 `out` pre-filled with NaN; asserts every element was written and `out` is returned."""
    M, N = ops["a"].shape[0], ops["b"].shape[0]
    out = torch.full((M, N), math.nan, device=DEVICE, dtype=torch.float32)
    result = gk.gemm(kernel, ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"], out=out,
                     **kwargs)
    assert result is out
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} elements never written"
    return out


def _assert_close_fp32(out: torch.Tensor, ref: torch.Tensor, operand_dtype: torch.dtype) -> None:
    # fp16 and fp8 products are exact in fp32, so in the interpreter only the summation order differs from the
    # reference. On a GPU, fp32 operands go through tf32 (10-bit mantissa) and Hopper's fp8 MMA keeps fewer
    # accumulator bits than fp32.
    loose = DEVICE == "cuda" and operand_dtype in (torch.float32, FP8)
    rtol = 5e-3 if loose else 1e-4
    scale = ref.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=10 * rtol * scale)


def _assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 keeps 8 mantissa bits: a relative rounding error up to 2^-9 per element.
    assert out.dtype == torch.bfloat16
    scale = ref.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)


SMALL = gk.GemmConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=2)


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (37, 53, 131),  # no dimension a multiple of any block size: edge tiles in M, N and K
        (1, 53, 131),  # M=1 (one decode token): the single row tile is 15/16 padding
        (37, 53, 9),  # K=9 under BLOCK_SIZE_K: one masked K step and nothing else
        (19, 129, 259),  # N=129 crosses a 128-wide scale block by one column; K=259 ends in a 3-column scale block
        (145, 17, 64),  # 10 row tiles with GROUP_SIZE_M 8 (last group partial); K a multiple of BLOCK_SIZE_K (EVEN_K)
    ],
)
@pytest.mark.parametrize(("kernel", "dtype"), FLAVOURS, ids=FLAVOUR_IDS)
def test_matches_reference_odd_shapes(kernel: str, dtype: torch.dtype, M: int, N: int, K: int) -> None:
    ops = _operands(kernel, M, N, K, dtype)
    _assert_close_fp32(_run_fp32(kernel, ops, SMALL), _reference(kernel, ops), dtype)


@pytest.mark.parametrize(("kernel", "dtype"), FLAVOURS, ids=FLAVOUR_IDS)
def test_default_output_is_bf16(kernel: str, dtype: torch.dtype) -> None:
    ops = _operands(kernel, 37, 53, 131, dtype)
    out = gk.gemm(kernel, ops["a"], ops["b"], SMALL, a_scale=ops["a_scale"], b_scale=ops["b_scale"])
    assert out.shape == (37, 53)
    _assert_close_bf16(out, _reference(kernel, ops))


@pytest.mark.parametrize(
    ("K", "NUM_KSPLIT"),
    [
        (131, 2),  # K odd: splits of 96 and 35, the last K step of the second masked
        (131, 3),  # 131/3 rounds up to 64 per split: two full splits and one of 3 elements
        (96, 2),  # K a multiple of BLOCK_SIZE_K (EVEN_K) but not of 2*BLOCK_SIZE_K: splits of 64 and 32
        (40, 3),  # splits of 32: the third starts past K and must contribute zeros, not stale memory
        (300, 3),  # splits of 128 line up with the scale blocks; the last holds a partial scale block
    ],
)
@pytest.mark.parametrize(("kernel", "dtype"), ONE_PER_KERNEL, ids=ONE_PER_KERNEL_IDS)
def test_split_k(kernel: str, dtype: torch.dtype, K: int, NUM_KSPLIT: int) -> None:
    ops = _operands(kernel, 37, 53, K, dtype)
    cfg = gk.GemmConfig(16, 32, 32, 8, 4, 2, NUM_KSPLIT=NUM_KSPLIT)
    _assert_close_fp32(_run_fp32(kernel, ops, cfg), _reference(kernel, ops), dtype)


@pytest.mark.parametrize(
    ("M", "N"),
    [
        (70, 90),  # 5 x 3 tiles of 16x32 on the interpreter's 4 "SMs": 3 full waves (12 tiles) whole, 3 split
        (37, 53),  # 3 x 2 tiles: one wave whole, 2 split
        (20, 40),  # 2 x 2 tiles: exactly one wave, nothing split
        (10, 20),  # 1 tile: under one wave, every tile split (plain split-K)
    ],
)
@pytest.mark.parametrize(("kernel", "dtype"), ONE_PER_KERNEL, ids=ONE_PER_KERNEL_IDS)
def test_tail_split_splits_only_the_last_wave(kernel: str, dtype: torch.dtype, M: int, N: int,
                                              monkeypatch) -> None:
    """TAIL_SPLIT: the full waves' tiles whole, the rest split along K and fixed up in the same launch; the same
    answer as the reference, twice (the locks are back at zero), odd K with a short last split."""
    cfg = gk.GemmConfig(16, 32, 32, 8, 4, 2, NUM_KSPLIT=3, TAIL_SPLIT=True)
    tiles = -(-M // 16) * -(-N // 32)
    sms = gk.programs_per_wave(torch.device(DEVICE))  # the interpreter's 4; a GPU's SMs (these grids: under one wave)
    whole = gk.tail_split_whole_tiles(tiles, sms)
    assert whole == tiles // sms * sms
    grids = []
    real = gk.BoundKernel
    monkeypatch.setattr(gk, "BoundKernel", lambda fn, grid, *a, **kw: grids.append(tuple(grid)) or real(fn, grid, *a,
                                                                                                         **kw))
    ops = _operands(kernel, M, N, 131, dtype)
    first = _run_fp32(kernel, ops, cfg)
    assert grids == [(whole + (tiles - whole) * 3, 1)]  # one launch: the whole tiles, then 3 pieces of each other
    _assert_close_fp32(first, _reference(kernel, ops), dtype)
    torch.testing.assert_close(_run_fp32(kernel, ops, cfg), first, rtol=0, atol=0)


def test_tail_split_needs_the_split_pointer_kernel() -> None:
    ops = _operands("bf16", 37, 53, 131, torch.float16)
    for cfg in (gk.GemmConfig(16, 32, 32, TAIL_SPLIT=True), gk.GemmConfig(64, 32, 32, NUM_KSPLIT=2, TAIL_SPLIT=True,
                                                                          PERSISTENT_TMA=True)):
        with pytest.raises(ValueError, match="TAIL_SPLIT splits the last wave's tiles of the pointer kernel"):
            gk.validate("bf16", ops["a"], ops["b"], None, None, cfg)


@pytest.mark.parametrize(("kernel", "dtype"), ONE_PER_KERNEL, ids=ONE_PER_KERNEL_IDS)
def test_split_k_reuses_a_poisoned_workspace(kernel: str, dtype: torch.dtype) -> None:
    # A workspace larger than needed and full of NaN: every partial the reduction reads must have been written,
    # including those of the split that starts past K (K=40, 3 splits of 32).
    cfg = gk.GemmConfig(16, 32, 32, 8, 4, 2, NUM_KSPLIT=3)
    workspace = torch.full((3 * 37 * 53 + 100,), math.nan, device=DEVICE, dtype=torch.float32)
    for K in (40, 131):
        ops = _operands(kernel, 37, 53, K, dtype, seed=K)
        out = _run_fp32(kernel, ops, cfg, workspace=workspace)
        _assert_close_fp32(out, _reference(kernel, ops), dtype)


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (37, 56, 144),  # M odd (TMA zero-fills A rows, clips C rows); N, K 16-byte rows but not block multiples
        (1, 136, 48),  # M=1; N=136 crosses a 128-wide scale block
        (145, 40, 32),  # 10 row tiles, GROUP_SIZE_M 8, 20 tiles over 4 interpreter "SMs": the persistent loop
    ],
)
@pytest.mark.parametrize("BLOCK_SIZE_N", [32, 256])  # 256: per-column B scales in the block-scaled kernel
@pytest.mark.parametrize(("kernel", "dtype"), FLAVOURS, ids=FLAVOUR_IDS)
def test_persistent_tma(kernel: str, dtype: torch.dtype, BLOCK_SIZE_N: int, M: int, N: int, K: int) -> None:
    ops = _operands(kernel, M, N, K, dtype)
    cfg = gk.GemmConfig(16, BLOCK_SIZE_N, 32, 8, 4, 2, PERSISTENT_TMA=True)
    _assert_close_fp32(_run_fp32(kernel, ops, cfg), _reference(kernel, ops), dtype)


@pytest.mark.parametrize(("warp_specialize", "subtile"), [(True, False), (False, True), (True, True)],
                         ids=["ws", "subtile", "ws-subtile"])
@pytest.mark.parametrize(("kernel", "dtype"), FLAVOURS, ids=FLAVOUR_IDS)
def test_persistent_tma_options(kernel: str, dtype: torch.dtype, warp_specialize: bool, subtile: bool) -> None:
    """M, N past the tiles (the right half of the last column tile is all clipped: N 72 = 64 + 8), 20 tiles over the
    interpreter's 4 "SMs"."""
    ops = _operands(kernel, 145, 72, 144, dtype)
    cfg = gk.GemmConfig(16, 64, 32, 8, 4, 2, PERSISTENT_TMA=True, WARP_SPECIALIZE=warp_specialize,
                        EPILOGUE_SUBTILE=subtile)
    _assert_close_fp32(_run_fp32(kernel, ops, cfg), _reference(kernel, ops), dtype)


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (37, 136, 272),  # K not a multiple of 128: the last step is a TMA zero-filled partial scale block
        (37, 136, 256),  # K a multiple of 128: the drain after the loop rescales the last full block
        (1, 40, 16),  # K under BLOCK_SIZE_K: the loop runs once, everything is in the drain
    ],
)
@pytest.mark.parametrize("BLOCK_SIZE_N", [32, 128])  # 128: the widest tile inside one scale block
def test_scale_pipeline(BLOCK_SIZE_N: int, M: int, N: int, K: int) -> None:
    ops = _operands("a8w8_blockscale", M, N, K)
    cfg = gk.GemmConfig(16, BLOCK_SIZE_N, 128, 8, 4, 2, PERSISTENT_TMA=True, SCALE_PIPELINE=True)
    _assert_close_fp32(_run_fp32("a8w8_blockscale", ops, cfg), _reference("a8w8_blockscale", ops), FP8)


@pytest.mark.parametrize(
    "BLOCK_SIZE_N",
    [
        16,  # scalar B scale; eight tiles per scale block
        64,  # scalar B scale; the last tile is 44 columns of one scale block past N
        128,  # scalar B scale; a tile is exactly one scale block
        256,  # per-column B scales: one tile spans two scale blocks, the second tile wraps past N=300
    ],
)
def test_blockscale_b_scale_paths(BLOCK_SIZE_N: int) -> None:
    ops = _operands("a8w8_blockscale", 19, 300, 259)
    cfg = gk.GemmConfig(16, BLOCK_SIZE_N, 32, 8, 4, 2)
    _assert_close_fp32(_run_fp32("a8w8_blockscale", ops, cfg), _reference("a8w8_blockscale", ops), FP8)


@pytest.mark.parametrize("BLOCK_SIZE_K", [32, 64, 128])  # each divisor of 128 steps inside one scale block
def test_blockscale_block_k_dividing_128(BLOCK_SIZE_K: int) -> None:
    ops = _operands("a8w8_blockscale", 19, 53, 259)
    cfg = gk.GemmConfig(16, 32, BLOCK_SIZE_K, 8, 4, 2)
    _assert_close_fp32(_run_fp32("a8w8_blockscale", ops, cfg), _reference("a8w8_blockscale", ops), FP8)


@pytest.mark.parametrize("persistent_tma", [False, True], ids=["grid", "tma"])
@pytest.mark.parametrize(("kernel", "dtype"), ONE_PER_KERNEL, ids=ONE_PER_KERNEL_IDS)
def test_out_is_a_window_of_a_larger_buffer(kernel: str, dtype: torch.dtype, persistent_tma: bool) -> None:
    # `out` is rows 2..38 of a 48-row buffer: the masked (or TMA-clipped) edge stores must not touch the
    # neighbouring rows, and a bf16 `out` is written in place.
    M, N, K = 37, 56, 144
    ops = _operands(kernel, M, N, K, dtype)
    buf = torch.full((48, N), 7.0, device=DEVICE, dtype=torch.bfloat16)
    out = buf[2 : 2 + M]
    cfg = gk.GemmConfig(16, 32, 32, 8, 4, 2, PERSISTENT_TMA=persistent_tma)
    result = gk.gemm(kernel, ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"], out=out)
    assert result.data_ptr() == out.data_ptr()
    _assert_close_bf16(out, _reference(kernel, ops))
    assert (buf[:2] == 7.0).all() and (buf[2 + M :] == 7.0).all()


def test_out_in_fp16() -> None:
    ops = _operands("a8w8", 37, 53, 131)
    out = torch.full((37, 53), math.nan, device=DEVICE, dtype=torch.float16)
    gk.gemm("a8w8", ops["a"], ops["b"], SMALL, a_scale=ops["a_scale"], b_scale=ops["b_scale"], out=out)
    assert not out.isnan().any()
    ref = _reference("a8w8", ops)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.parametrize(
    ("cfg"),
    [
        SMALL,  # one launch stores C from the fp32 accumulator
        gk.GemmConfig(16, 32, 32, 8, 4, 2, NUM_KSPLIT=3),  # the split-K reduce kernel stores C
        gk.GemmConfig(16, 32, 32, 8, 4, 2, PERSISTENT_TMA=True),  # a TMA descriptor of an fp16 C stores it
    ],
    ids=["grid", "split-k", "tma"],
)
@pytest.mark.parametrize(("kernel", "dtype"), ONE_PER_KERNEL, ids=ONE_PER_KERNEL_IDS)
def test_out_dtype_fp16(kernel: str, dtype: torch.dtype, cfg: gk.GemmConfig) -> None:
    ops = _operands(kernel, 37, 56, 144, dtype)  # 16-byte rows in fp16 for TMA; M and N edge tiles
    out = gk.gemm(kernel, ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"],
                  out_dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == (37, 56)
    ref = _reference(kernel, ops)
    # fp16 keeps 11 mantissa bits: one rounding of the fp32 result, 2^-11 relative. bf16's 2^-9 fails this, so a C
    # rounded through bf16 on the way would too.
    atol = 1e-3 * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=atol)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ref.bfloat16().float(), ref, rtol=1e-3, atol=atol)


def test_out_dtype_must_be_bf16_or_fp16() -> None:
    ops = _operands("bf16", 8, 16, 32)
    with pytest.raises(ValueError, match="output dtype torch.float32 is not one of"):
        gk.gemm("bf16", ops["a"], ops["b"], SMALL, out_dtype=torch.float32)
    assert gk.out_dtype_name(torch.float16) == "fp16" and gk.OUT_DTYPES["bf16"] == torch.bfloat16


GLUON_64 = gk.GemmConfig(64, 128, 128, num_warps=4, num_stages=5, GLUON=True)


def _bad(kernel: str = "a8w8", M: int = 8, N: int = 16, K: int = 32, **changes) -> tuple[str, dict, gk.GemmConfig]:
    """Valid small operands for `kernel`, with `changes` replacing operands or (key "cfg") the config."""
    cfg = changes.pop("cfg", SMALL)
    ops = _operands(kernel, M, N, K) if kernel in gk.KERNELS else _operands("bf16", M, N, K)
    ops.update(changes)
    return kernel, ops, cfg


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (_bad("bf16", b=torch.zeros(16, 31, dtype=torch.float16)), "K mismatch"),
        (_bad("a8w8", a=torch.zeros(8, 32, dtype=FP8), b=torch.zeros(16, 16, dtype=FP8)), "K mismatch"),
        (_bad("bf16", a=torch.zeros(0, 32, dtype=torch.float16)), "empty GEMM: M=0"),
        (_bad("a8w8", a=torch.zeros(0, 32, dtype=FP8), a_scale=torch.ones(0)), "empty GEMM: M=0"),
        (_bad("a8w8", a=torch.zeros(8, 32, dtype=torch.float16)), "takes float8_e4m3fn"),
        (_bad("a8w8", b=torch.zeros(16, 32, dtype=torch.bfloat16)), "takes float8_e4m3fn"),
        (_bad("bf16", b=torch.zeros(16, 32, dtype=torch.float32)), "bf16/fp16/fp32 A and B of one dtype"),
        (_bad("bf16", a=torch.zeros(8, 32, dtype=FP8), b=torch.zeros(16, 32, dtype=FP8)), "bf16/fp16/fp32"),
        (_bad("a8w8", a_scale=torch.ones(9)), "scales must be A(8,) and B(16,)"),
        (_bad("a8w8", b_scale=torch.ones(8)), "scales must be"),
        (_bad("a8w8_blockscale", N=136, K=200, b_scale=torch.ones(136, 2)), "scales must be A(8, 2) and B(2, 2)"),
        (_bad("a8w8_blockscale", K=200, a_scale=torch.ones(8, 1)), "scales must be"),
        (_bad("a8w8", a_scale=None), "needs a_scale and b_scale"),
        (_bad("a8w8", a_scale=torch.ones(8, dtype=torch.float16)), "scales must be float32"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(16, 32, 256)), "BLOCK_SIZE_K dividing 128, got 256"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(16, 32, 48)), "BLOCK_SIZE_K dividing 128, got 48"),
        (_bad("fp4"), "unknown GEMM kernel 'fp4'"),
        (_bad("bf16", a=torch.zeros(32, 8, dtype=torch.float16).t()), "contiguous along K"),  # column-major A
        (_bad("bf16", cfg=gk.GemmConfig(16, 32, 32, NUM_KSPLIT=2, PERSISTENT_TMA=True)), "does not split K"),
        (_bad("bf16", cfg=gk.GemmConfig(16, 32, 32, PERSISTENT_TMA=True, SCALE_PIPELINE=True)), "SCALE_PIPELINE"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(16, 256, 128, PERSISTENT_TMA=True, SCALE_PIPELINE=True)),
         "BLOCK_SIZE_N <= 128"),
        (_bad("bf16", K=36, cfg=gk.GemmConfig(16, 32, 32, PERSISTENT_TMA=True)), "16-byte aligned"),  # 72-byte rows
        (_bad("bf16", cfg=gk.GemmConfig(16, 32, 32, WARP_SPECIALIZE=True)), "options of the persistent TMA kernel"),
        (_bad("bf16", cfg=gk.GemmConfig(16, 32, 32, EPILOGUE_SUBTILE=True)), "options of the persistent TMA kernel"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(16, 32, 128, PERSISTENT_TMA=True, SCALE_PIPELINE=True,
                                                    WARP_SPECIALIZE=True)), "two schedules of one loop"),
        (_bad("a8w8", cfg=gk.GemmConfig(64, 224, 128, num_warps=4, GLUON=True)),
         "not a power of two or the sum of two"),  # 224 = 128 + 96
        (_bad("bf16", cfg=gk.GemmConfig(128, 192, 128, num_warps=8, GLUON=True)), "GLUON bf16 takes BLOCK_SIZE_K 64"),
        (_bad("a8w8", cfg=gk.GemmConfig(64, 384, 128, num_warps=4, GLUON=True)), "(at most 256)"),
        (_bad("a8w8", cfg=gk.GemmConfig(64, 128, 128, num_warps=8, GLUON=True)), "16 rows a warp or more"),
        (_bad("bf16", a=torch.zeros(8, 32), b=torch.zeros(16, 32), cfg=gk.GemmConfig(64, 128, 64, num_warps=4,
                                                                                    GLUON=True)),
         "GLUON takes bf16, fp16 or fp8 operands, not float32"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(64, 256, 128, num_warps=4, GLUON=True)), "BLOCK_SIZE_N 64 or 128"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(128, 128, 128, num_warps=4, GLUON=True)),
         "BLOCK_SIZE_M 16 x num_warps"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(64, 128, 64, num_warps=4, GLUON=True)), "BLOCK_SIZE_K 128"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(64, 128, 128, num_warps=4, NUM_KSPLIT=2, GLUON=True)),
         "GLUON is its own kernel"),
        (_bad("a8w8_blockscale", cfg=gk.GemmConfig(64, 128, 128, num_warps=4, SCALE_PIPELINE=True, GLUON=True)),
         "GLUON is its own kernel"),
        (_bad("a8w8", cfg=gk.GemmConfig(128, 192, 128, num_warps=8, PERSISTENT_TMA=True, WARP_SPECIALIZE=True,
                                        GLUON=True)), "one MMA a K step (BLOCK_SIZE_N a power of two)"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_validation_errors(case: tuple[str, dict, gk.GemmConfig], message: str) -> None:
    kernel, ops, cfg = case
    ops = {k: v.to(DEVICE) if v is not None else None for k, v in ops.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        gk.gemm(kernel, ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"])


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(8, 15),  # wrong shape
        torch.empty(16, 8).t(),  # right shape, not contiguous
    ],
)
def test_out_must_be_contiguous_m_by_n(out: torch.Tensor) -> None:
    ops = _operands("bf16", 8, 16, 32)
    with pytest.raises(ValueError, match="out must be a contiguous 8x16 tensor"):
        gk.gemm("bf16", ops["a"], ops["b"], SMALL, out=out.to(DEVICE))


def test_config_from_params_rejects_unknown_names() -> None:
    assert gk.GemmConfig.from_params({"BLOCK_SIZE_M": 32}) == gk.GemmConfig(BLOCK_SIZE_M=32)
    with pytest.raises(ValueError, match="BLOCK_M"):
        gk.GemmConfig.from_params({"BLOCK_M": 32})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's own refusal: off Hopper the op says so; a Hopper GPU "
                    "runs the kernel (tests/test_gluon_blockscale_gpu.py)")
def test_gluon_refused_off_the_gpu() -> None:
    ops = _operands("a8w8_blockscale", 256, 256, 512)
    with pytest.raises(ValueError, match="GLUON (runs on a Hopper GPU|needs Triton's Gluon)"):
        gk.gemm("a8w8_blockscale", ops["a"], ops["b"], GLUON_64, a_scale=ops["a_scale"], b_scale=ops["b_scale"])
    assert gk.gluon_problem(GLUON_64) is None and gk.gluon_problem(gk.GemmConfig(128, 128, 128, num_warps=8)) is None
    ws = gk.GemmConfig(128, 128, 128, num_warps=8, num_stages=5, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)
    assert gk.gluon_problem(ws) is None  # the warp-specialised block-scaled kernel
    dense = gk.GemmConfig(128, 256, 64, num_warps=8, num_stages=3, PERSISTENT_TMA=True, WARP_SPECIALIZE=True,
                          GLUON=True)
    assert gk.gluon_problem(dense, "bf16", 2) is None  # and the dense ones
    with pytest.raises(ValueError, match="GLUON (runs on a Hopper GPU|needs Triton's Gluon)"):
        gk.gemm("a8w8_blockscale", ops["a"], ops["b"], ws, a_scale=ops["a_scale"], b_scale=ops["b_scale"])


def test_a_gluon_k_split_is_the_warp_specialised_kernels_and_each_split_holds_a_k_block() -> None:
    """NUM_KSPLIT 2-4 with GLUON runs the warp-specialised kernel's split-K form (kernels/gluon_gemm_ws.
    ws_splitk_kernel), every kernel; not the one-kernel Gluon GEMMs. A split of K blocks that leaves one empty is
    refused before any launch (`split_k_fits`: the blocks are 128 bytes of a row, 64 bf16 or 128 fp8)."""
    from tritune.kernels.gluon_gemm_ws import split_k_fits, split_k_workspace

    for kernel, bk, elt in (("a8w8_blockscale", 128, 1), ("a8w8", 128, 1), ("bf16", 64, 2)):
        ws = gk.GemmConfig(128, 128, bk, 8, 8, 4, NUM_KSPLIT=4, PERSISTENT_TMA=True, WARP_SPECIALIZE=True,
                           GLUON=True)
        assert gk.gluon_problem(ws, kernel, elt) is None
        one_kernel = gk.GemmConfig(128, 128, bk, 8, 8, 4, NUM_KSPLIT=2, PERSISTENT_TMA=True, GLUON=True)
        assert "NUM_KSPLIT 1 (2-4 on the warp-specialised one)" in gk.gluon_problem(one_kernel, kernel, elt)
    five = gk.GemmConfig(128, 128, 128, 8, 8, 4, NUM_KSPLIT=5, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)
    assert "NUM_KSPLIT 1" in gk.gluon_problem(five)
    assert split_k_fits(7168, 4) and split_k_fits(384, 2) and split_k_fits(256, 4, 64)
    assert not split_k_fits(384, 4) and not split_k_fits(1536, 5, 128) and not split_k_fits(128, 2)
    assert split_k_workspace(1000, 1536, 128, 128, 4) == (8 * 12 * 4 * 128 * 128, 96)
    with pytest.raises(ValueError, match="32-bit offsets"):
        split_k_workspace(65536, 65536, 128, 128, 4)
