"""The Gluon bf16 / fp16 / a8w8 GEMM on a Hopper GPU: against the fp32 reference on shapes no tile divides (a partial
last K step, M and N edges, a 192-wide tile's second MMA past N), through the op as a user calls it (its own
rule-table choice included), bit-equal as a CUDA-graph replay. Gluon has no interpreter: on anything but a Hopper GPU
with Triton's Gluon API these skip with that reason (the CPU suite compiles the kernel: tests/test_gluon_gemm.py)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from tritune.kernels import gemm as gk
from tritune.kernels.gluon_gemm import HAS_GLUON_HOPPER, gluon_gemm
from tritune.kernels.gluon_gemm_ws import ws_gemm
from tritune.kernels.quant import quantize_rows
from tritune.tuning.bench import capture_graph

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (HOPPER and HAS_GLUON_HOPPER),
                                reason="the Gluon kernel runs only on a Hopper GPU with Triton's Gluon API")


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> gk.GemmConfig:
    return gk.GemmConfig(bm, bn, bk, group, warps, stages, PERSISTENT_TMA=True, GLUON=True)


CASES = [  # (kernel, operand dtype, config)
    ("bf16", torch.bfloat16, _cfg(128, 128, 64, 4, 5)),
    ("bf16", torch.bfloat16, _cfg(128, 192, 64, 8, 4)),  # two MMAs a K step: 128 + 64 columns
    ("bf16", torch.float16, _cfg(64, 192, 64, 4, 5, group=1)),
    ("bf16", torch.bfloat16, _cfg(256, 128, 64, 8, 3)),
    ("a8w8", torch.float8_e4m3fn, _cfg(64, 192, 128, 4, 5)),
    ("a8w8", torch.float8_e4m3fn, _cfg(128, 256, 128, 8, 3)),
    ("a8w8", torch.float8_e4m3fn, _cfg(64, 96, 128, 4, 6)),  # 64 + 32
    ("a8w8", torch.float8_e4m3fn, _cfg(128, 128, 128, 8, 4)),
    # fed by a loader warp group (kernels/gluon_gemm_ws), through the op
    ("bf16", torch.bfloat16, dataclasses.replace(_cfg(128, 256, 64, 8, 3), WARP_SPECIALIZE=True)),
    ("a8w8", torch.float8_e4m3fn, dataclasses.replace(_cfg(128, 128, 128, 4, 5), WARP_SPECIALIZE=True)),
    # and with K split two ways (kernels/gluon_gemm_ws.ws_splitk_kernel): the tiles' halves added by the last one
    ("bf16", torch.bfloat16, dataclasses.replace(_cfg(128, 128, 64, 8, 4), WARP_SPECIALIZE=True, NUM_KSPLIT=2)),
    ("a8w8", torch.float8_e4m3fn, dataclasses.replace(_cfg(128, 256, 128, 8, 3), WARP_SPECIALIZE=True,
                                                      NUM_KSPLIT=2)),
]


def _operands(kernel: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen)
    b = torch.randn(N, K, generator=gen) / math.sqrt(K)
    if kernel == "bf16":
        return {"a": a.to(dtype).cuda(), "b": b.to(dtype).cuda(), "a_scale": None, "b_scale": None}
    a = a * (1 + torch.arange(M) % 5)[:, None]  # a distinct scale per row and column
    b = b * (1 + torch.arange(N) % 3)[:, None]
    (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
    return {"a": qa.cuda(), "b": qb.cuda(), "a_scale": sa.cuda(), "b_scale": sb.cuda()}


def _check(kernel: str, out: torch.Tensor, ops: dict) -> None:
    ref = gk.gemm_reference(kernel, ops["a"], ops["b"], ops["a_scale"], ops["b_scale"])
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < 5e-3, rel  # bf16 / fp16 output rounding (2^-9) and Hopper's accumulation order
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("kernel", "dtype", "cfg"), CASES, ids=[
    f"{k}-{str(d)[6:]}-{c.BLOCK_SIZE_M}x{c.BLOCK_SIZE_N}s{c.num_stages}{'ws' if c.WARP_SPECIALIZE else ''}"
    f"{f'k{c.NUM_KSPLIT}' if c.NUM_KSPLIT > 1 else ''}" for k, d, c in CASES])
@pytest.mark.parametrize(("M", "N", "K"), [
    (300, 520, 1040),  # M, N not multiples of a tile (520 = 2 x 192 + 136); K ends in a partial step
    (1, 200, 256),  # one row; K of 4 bf16 / 2 fp8 steps: fewer than the stages, which are capped to them
    (257, 4096, 384),
    (1024, 4608, 3584),  # Qwen2.5-7B's qkv: 24 x 16 tiles of 64 x 192
    (4096, 1536, 1536),  # persistent programs take several tiles each
])
def test_matches_the_reference(kernel: str, dtype: torch.dtype, cfg: gk.GemmConfig, M: int, N: int, K: int) -> None:
    ops = _operands(kernel, dtype, M, N, K)
    out = gk.gemm(kernel, ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"])
    _check(kernel, out, ops)
    launch = functools.partial(ws_gemm, splits=cfg.NUM_KSPLIT) if cfg.WARP_SPECIALIZE else gluon_gemm
    again = launch(ops["a"], ops["b"], a_scale=ops["a_scale"], b_scale=ops["b_scale"], block_m=cfg.BLOCK_SIZE_M,
                   block_n=cfg.BLOCK_SIZE_N, stages=cfg.num_stages, num_warps=cfg.num_warps, group_m=cfg.GROUP_SIZE_M,
                   out=torch.empty_like(out))
    assert torch.equal(out, again)  # the bound launch and Triton's own launcher run the same binary


@pytest.mark.parametrize(("kernel", "dtype", "block_m", "block_n", "warps"), [
    ("bf16", torch.bfloat16, 128, 128, 4), ("bf16", torch.float16, 128, 256, 8),
    ("a8w8", torch.float8_e4m3fn, 128, 256, 8), ("a8w8", torch.float8_e4m3fn, 64, 128, 4)])
@pytest.mark.parametrize(("M", "N", "K"), [(300, 520, 1040), (1, 200, 256), (4096, 1536, 1536)])
def test_the_warp_specialised_form_matches_the_reference(kernel: str, dtype: torch.dtype, block_m: int, block_n: int,
                                                          warps: int, M: int, N: int, K: int) -> None:
    """kernels/gluon_gemm_ws.py's dense forms (the probe's; the op runs its block-scaled one): a loader warp group
    feeding the MMA warps through the ring, the stage freed after each wgmma retires."""
    from tritune.kernels.gluon_gemm_ws import ws_gemm

    ops = _operands(kernel, dtype, M, N, K)
    out = ws_gemm(ops["a"], ops["b"], a_scale=ops["a_scale"], b_scale=ops["b_scale"], block_m=block_m,
                  block_n=block_n, stages=3, num_warps=warps)
    _check(kernel, out, ops)


def test_the_op_picks_it_for_fp8_and_a_graph_replays_it_bit_equal() -> None:
    from tritune.ops import gemm_a8w8
    from tritune.ops.gemm import select_config

    M, N, K = 1024, 1536, 7168  # DeepSeek-V3's q_a: 64 x 192 tiles make one wave
    ops = _operands("a8w8", torch.float8_e4m3fn, M, N, K, seed=1)
    cfg, source = select_config("a8w8", M, N, K, ops["a"].device)
    if source == "heuristic":
        assert cfg.GLUON and cfg.BLOCK_SIZE_N == 192, cfg
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    gemm_a8w8(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], out=out)
    _check("a8w8", out, ops)
    eager = out.clone()
    graph, _ = capture_graph(lambda: gemm_a8w8(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], out=out))
    out.zero_()  # the capture's warm-up wrote it: only the replay may write it again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_misaligned_rows_fall_back_to_the_triton_kernel() -> None:
    """K 7176 fp8 (not a multiple of 16): no TMA, so the op takes a Triton tile rather than refusing the call."""
    from tritune.ops import gemm_a8w8

    ops = _operands("a8w8", torch.float8_e4m3fn, 1024, 1536, 7176, seed=2)
    _check("a8w8", gemm_a8w8(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"]), ops)
    _check("a8w8", gemm_a8w8(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], config=CASES[4][2]), ops)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gk.gemm("a8w8", ops["a"], ops["b"], CASES[4][2], a_scale=ops["a_scale"], b_scale=ops["b_scale"])
