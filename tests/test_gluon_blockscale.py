"""The Gluon block-scaled fp8 kernel compiled for sm_90 with no GPU, as the tuner's compile pool builds it: the MMAs
of two consecutive K blocks stay in flight together (`wgmma.wait_group 1`), ptxas keeps them asynchronous (no C7514 /
C7512 serialization, which a register copy of an in-flight partial or a spill brings back), and nothing spills.

The kernel itself runs only on a Hopper GPU (Gluon has no interpreter): tests/test_gluon_blockscale_gpu.py."""

from __future__ import annotations

import pytest
from sm90_ptx import assert_asynchronous, compile_report

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

_CHILD = r"""
import re
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
cfg = gk.GemmConfig(128, 128, 128, 8, 8, 5, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)
gk.compile_only("a8w8_blockscale", M, N, K, cfg)  # the warp-specialised kernel, as the compile pool builds it
from tritune.kernels import gluon_gemm_ws as ws
kernel = ws.ws_gemm_kernel.warmup(*ws.ws_descriptors(a, b, c, 128, 128), torch.float32, torch.float32, M, N, K,
                                  K // 128, 1, K // 128, 1, 132, *ws.constexprs("a8w8_blockscale", cfg), num_warps=8,
                                  num_stages=5, maxnreg=ws.ws_maxnreg(8), grid=(1,))
ptx = kernel.asm["ptx"]
report["ws 128x128 w8 s5"] = ptxas_report(ptx, maxnreg=re.findall(r"\.maxnreg\s+(\d+)", ptx),
                                          setmaxnreg=re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx),
                                          warps=kernel.metadata.num_warps)
split = gk.GemmConfig(128, 128, 128, 8, 8, 5, NUM_KSPLIT=4, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True)
gk.compile_only("a8w8_blockscale", 1024, N, K, split)  # K split 4 ways: the compile pool's call
kernel = ws.ws_splitk_kernel.warmup(*ws.ws_descriptors(a, b, c, 128, 128), torch.float32, torch.float32,
                                    torch.float32, torch.int32, M, N, K, K // 128, 1, K // 128, 1, 132,
                                    *ws.splitk_constexprs("a8w8_blockscale", split), num_warps=8, num_stages=5,
                                    maxnreg=ws.ws_maxnreg(8), grid=(1,))
ptx = kernel.asm["ptx"]
report["ws split-K 4"] = ptxas_report(ptx, atomics=re.findall(r"atom\.global\.gpu\.(\w+)\.(\w+)", ptx))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    if not HAS_GLUON_HOPPER:
        pytest.skip("this Triton has no Gluon Hopper API (Triton >= 3.5)")
    return compile_report(_CHILD)  # one child compiles every kernel of this module


def test_two_k_blocks_in_flight_and_not_serialized(report: dict) -> None:
    assert set(report) == {"128x128 w8 s4", "64x128 w4 s5", "ws 128x128 w8 s5", "ws split-K 4"}
    for name, r in report.items():
        assert "1" in r["waits"] and r["waits"][-1] == "0", (name, r["waits"])  # k-1 retired while k runs; then all
        assert_asynchronous(name, r)


def test_the_loader_warp_group_hands_its_registers_to_the_mma_warps(report: dict) -> None:
    """The warp-specialised kernel: 8 MMA warps and a loader warp group, 12 warps launched at 168 registers a thread
    (all of the SM's 65536); the loader drops to 40 so the MMA warps can rise to 232 (setmaxnreg, a warp group at a
    time)."""
    r = report["ws 128x128 w8 s5"]
    assert r["warps"] == 12 and r["maxnreg"] == ["168"]
    counts = {int(n) for _, n in r["setmaxnreg"]}
    assert {40, 232} <= counts and max(counts) <= 248, r["setmaxnreg"]
    assert 232 * 8 * 32 + 40 * 4 * 32 <= 65536


def test_a_split_k_tile_counts_its_splits_with_one_acquire_release_add_and_zeroes_the_count(report: dict) -> None:
    """The K-split kernel: a tile's count raised once a unit (acq_rel at GPU scope: the partial sum stored before,
    the other slots read after), and set back to zero by the unit that finished the tile."""
    r = report["ws split-K 4"]
    assert ["acq_rel", "add"] in r["atomics"] and ["relaxed", "exch"] in r["atomics"], r["atomics"]
