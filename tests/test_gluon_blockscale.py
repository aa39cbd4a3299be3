"""The Gluon block-scaled fp8 kernel compiled for sm_90 with no GPU, as the tuner's compile pool builds it: the MMAs
of two consecutive K blocks stay in flight together (`wgmma.wait_group 1`), ptxas keeps them asynchronous (no C7514 /
C7512 serialization, which a register copy of an in-flight partial or a spill brings back), and nothing spills.

The kernel itself runs only on a Hopper GPU (Gluon has no interpreter): tests/test_gluon_blockscale_gpu.py."""

from __future__ import annotations

import pytest
from sm90_ptx import assert_asynchronous, compile_report

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

_CHILD = r"""
import torch
from triton.runtime.jit import MockTensor
from tritune.kernels import gemm as gk, gluon_blockscale as gb

M, N, K = 4096, 1536, 7168
for bm, warps, stages in ((128, 8, 4), (64, 4, 5)):
    cfg = gk.GemmConfig(bm, 128, 128, 8, warps, stages, PERSISTENT_TMA=bm == 128, GLUON=True)
    gk.compile_only("a8w8_blockscale", M, N, K, cfg)  # the compile pool's call
    a, b = MockTensor(torch.float8_e4m3fn, [M, K]), MockTensor(torch.float8_e4m3fn, [N, K])
    c = MockTensor(torch.bfloat16, [M, N])
    kernel = gb.blockscale_kernel.warmup(*gb.descriptors(a, b, c, bm, 128), torch.float32, torch.float32, M, N, K,
                                         K // 128, 1, K // 128, 1, 132, 8, stages, warps, num_warps=warps,
                                         num_stages=stages, grid=(1,))
    report[f"{bm}x128 w{warps} s{stages}"] = ptxas_report(kernel.asm["ptx"])
"""


@pytest.mark.skipif(not HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API (Triton >= 3.5)")
def test_two_k_blocks_in_flight_and_not_serialized() -> None:
    report = compile_report(_CHILD)
    assert set(report) == {"128x128 w8 s4", "64x128 w4 s5"}
    for name, r in report.items():
        assert "1" in r["waits"] and r["waits"][-1] == "0", (name, r["waits"])  # k-1 retired while k runs; then all
        assert_asynchronous(name, r)
