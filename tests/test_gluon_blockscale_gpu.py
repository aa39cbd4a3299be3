"""The Gluon block-scaled fp8 GEMM on a Hopper GPU: against the fp32 reference on shapes no tile divides (a partial
last K block, M and N edges), through the op as a user calls it (its own rule-table choice included), bit-equal as
a CUDA-graph replay. Gluon has no interpreter: on anything but a Hopper GPU with Triton's Gluon API these skip with
that reason (the CPU suite checks the compiled kernel in tests/test_gluon_blockscale.py)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tritune.kernels import gemm as gk
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER, gluon_blockscale_gemm
from tritune.kernels.gluon_gemm_ws import ws_gemm
from tritune.kernels.quant import quantize_blocks
from tritune.tuning.bench import capture_graph

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (HOPPER and HAS_GLUON_HOPPER),
                                reason="the Gluon kernel runs only on a Hopper GPU with Triton's Gluon API")

CONFIGS = [gk.GemmConfig(128, 128, 128, 8, 8, 4, GLUON=True), gk.GemmConfig(64, 128, 128, 8, 4, 5, GLUON=True),
           gk.GemmConfig(128, 64, 128, 1, 8, 3, GLUON=True), gk.GemmConfig(64, 64, 128, 8, 4, 2, GLUON=True),
           # persistent: programs walk several tiles, the next tile's loads in flight during this one's epilogue
           gk.GemmConfig(128, 128, 128, 8, 8, 4, PERSISTENT_TMA=True, GLUON=True),
           gk.GemmConfig(64, 128, 128, 8, 4, 4, PERSISTENT_TMA=True, GLUON=True),
           # warp-specialised (kernels/gluon_gemm_ws): a loader warp group feeding the MMA warps
           gk.GemmConfig(128, 128, 128, 8, 8, 5, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True),
           gk.GemmConfig(64, 128, 128, 1, 4, 6, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True),
           # the rule's narrow tile where 64x128 fills under half the SMs (ops/heuristics._gluon_blockscale_narrow)
           gk.GemmConfig(64, 64, 128, 8, 4, 8, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True),
           # K split two ways: each tile's two partial sums added by the unit that finishes it
           gk.GemmConfig(128, 128, 128, 8, 8, 5, NUM_KSPLIT=2, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)]


def _operands(M: int, N: int, K: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen) * (1 + torch.arange(K) // 128 % 3)[None, :]  # distinct scale per K block
    b = torch.randn(N, K, generator=gen) / math.sqrt(K) * (1 + torch.arange(N) // 128 % 3)[:, None]
    (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, gk.SCALE_BLOCK)
    return {k: v.cuda() for k, v in {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}.items()}


def _check(out: torch.Tensor, ops: dict) -> None:
    ref = gk.gemm_reference("a8w8_blockscale", ops["a"], ops["b"], ops["a_scale"], ops["b_scale"])
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < 5e-3, rel  # bf16 output rounding (2^-9) and Hopper's fp8 accumulation within a 128-deep block
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.BLOCK_SIZE_M}x{c.BLOCK_SIZE_N}s{c.num_stages}"
                                               f"{'p' if c.PERSISTENT_TMA else ''}{'ws' if c.WARP_SPECIALIZE else ''}"
                                               f"{f'k{c.NUM_KSPLIT}' if c.NUM_KSPLIT > 1 else ''}")
@pytest.mark.parametrize(("M", "N", "K"), [
    (300, 520, 1040),  # M, N not multiples of a tile; K ends in a 16-wide block (TMA zero-fills the rest)
    (1, 136, 256),  # one row; N crosses a 128-wide weight-scale block by 8; two K blocks (even count)
    (257, 4096, 384),  # three K blocks (odd count: the loop's tail path)
    (1024, 1536, 7168),  # 56 K blocks, DeepSeek-V3's q_a projection
    (4096, 1536, 1536),  # 384 tiles of 128x128: persistent programs take three
])
def test_matches_the_reference(cfg: gk.GemmConfig, M: int, N: int, K: int) -> None:
    ops = _operands(M, N, K)
    out = gk.gemm("a8w8_blockscale", ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"])
    _check(out, ops)
    if cfg.WARP_SPECIALIZE:
        again = ws_gemm(ops["a"], ops["b"], a_scale=ops["a_scale"], b_scale=ops["b_scale"], block_scaled=True,
                        block_m=cfg.BLOCK_SIZE_M, block_n=cfg.BLOCK_SIZE_N, stages=cfg.num_stages,
                        group_m=cfg.GROUP_SIZE_M, num_warps=cfg.num_warps, splits=cfg.NUM_KSPLIT)
    else:
        again = gluon_blockscale_gemm(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], block_m=cfg.BLOCK_SIZE_M,
                                      block_n=cfg.BLOCK_SIZE_N, stages=cfg.num_stages, num_warps=cfg.num_warps,
                                      group_m=cfg.GROUP_SIZE_M, persistent=cfg.PERSISTENT_TMA)
    assert torch.equal(out, again)  # the bound launch and Triton's own launcher run the same binary


def test_the_op_picks_it_and_a_graph_replays_it_bit_equal() -> None:
    from tritune.ops import gemm_a8w8_blockscale
    from tritune.ops.gemm import select_config

    ops = _operands(512, 2048, 2048, seed=1)
    cfg, source = select_config("a8w8_blockscale", 512, 2048, 2048, ops["a"].device)
    if source == "heuristic":
        assert cfg.GLUON, cfg
    out = torch.empty(512, 2048, device="cuda", dtype=torch.bfloat16)
    gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], out=out)
    _check(out, ops)
    eager = out.clone()
    graph, _ = capture_graph(
        lambda: gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], out=out))
    out.zero_()  # the capture's warm-up wrote it: only the replay may write it again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_misaligned_rows_fall_back_to_the_triton_kernel() -> None:
    """K 1048 (not a multiple of 16): no TMA, so the op's rule drops GLUON rather than refusing the call."""
    from tritune.ops import gemm_a8w8_blockscale

    ops = _operands(512, 2048, 1048, seed=2)
    _check(gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"]), ops)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gk.gemm("a8w8_blockscale", ops["a"], ops["b"], CONFIGS[0], a_scale=ops["a_scale"], b_scale=ops["b_scale"])



@pytest.mark.parametrize("splits", [2, 3, 4])
def test_a_k_split_grid_matches_the_unsplit_kernel_repeats_bit_equal_and_leaves_its_counts_zero(splits: int) -> None:
    """K split 2-4 ways (96 tiles of 128x128 at M 1024, N 1536: 192-384 units on the SMs): the unsplit kernel's
    result up to fp32 summation order, bit-equal from launch to launch and as a CUDA-graph replay (the slots are
    added in split order whichever unit finishes a tile), and every tile's count back at zero (the op's per-stream
    counts serve the next launch)."""
    from tritune.ops import gemm_a8w8_blockscale

    ops = _operands(1000, 1536, 7168, seed=2)  # the last row of tiles partial
    cfg = gk.GemmConfig(128, 128, 128, 8, 8, 5, NUM_KSPLIT=splits, PERSISTENT_TMA=True, WARP_SPECIALIZE=True,
                        GLUON=True)
    whole = ws_gemm(ops["a"], ops["b"], a_scale=ops["a_scale"], b_scale=ops["b_scale"], block_scaled=True, stages=5)
    out = torch.empty_like(whole)
    gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], config=cfg, out=out)
    _check(out, ops)
    assert float((out.float() - whole.float()).abs().max()) <= 2 ** -6 * float(whole.float().abs().max())
    first = out.clone()
    for _ in range(3):
        gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], config=cfg, out=out)
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    graph, _ = capture_graph(
        lambda: gemm_a8w8_blockscale(ops["a"], ops["b"], ops["a_scale"], ops["b_scale"], config=cfg, out=out))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    op_gemm = importlib.import_module("tritune.ops.gemm")  # the module: `tritune.ops.gemm` the name is the function
    launch = next(p for p in op_gemm._PLANS.values() if p.cfg == cfg)
    for counts in launch._locks.values():
        assert int(counts.count_nonzero()) == 0


def test_a_k_split_that_leaves_a_split_empty_is_refused() -> None:
    ops = _operands(256, 256, 384)  # 3 K blocks: 4 splits would leave one without a block
    cfg = gk.GemmConfig(128, 128, 128, 1, 8, 3, NUM_KSPLIT=4, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)
    with pytest.raises(ValueError, match="without a 128-wide K block"):
        gk.gemm("a8w8_blockscale", ops["a"], ops["b"], cfg, a_scale=ops["a_scale"], b_scale=ops["b_scale"])
