"""The Gluon bf16 / a8w8 GEMM without a GPU: tile widths split into two power-of-two MMAs, the stages capped at the K
steps, and the kernel compiled for sm_90 as the tuner's compile pool builds it, with its wgmmas kept asynchronous
(`wgmma.wait_group` 1 for one MMA a K step, 2 for two; no C7514 / C7512 serialization) and nothing spilled.

The kernel itself runs only on a Hopper GPU (Gluon has no interpreter): tests/test_gluon_gemm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from sm90_ptx import assert_asynchronous, compile_report

from tritune.kernels import gemm as gk
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.gluon_gemm import block_k, constexprs, programs_for, smem_bytes, split_width


@pytest.mark.parametrize(("width", "parts"), [(192, (128, 64)), (96, (64, 32)), (128, (128, 0)), (48, (32, 16)),
                                              (160, (128, 32)), (16, (16, 0))])
def test_a_width_splits_into_two_powers_of_two(width: int, parts: tuple[int, int]) -> None:
    assert split_width(width) == parts


@pytest.mark.parametrize("width", [224, 40, 8, 200])
def test_a_width_with_no_such_split_is_refused(width: int) -> None:
    with pytest.raises(ValueError, match=f"BLOCK_N {width}"):
        split_width(width)


def test_the_stages_never_outnumber_the_k_steps() -> None:
    """The next tile's first blocks load inside this tile's K loop, so a tile needs as many K steps as stages."""
    cfg = gk.GemmConfig(128, 192, 64, 8, 8, 5, PERSISTENT_TMA=True, GLUON=True)
    assert constexprs("bf16", 4096, torch.bfloat16, cfg) == (64, False, 8, 5, 8, True)
    assert constexprs("bf16", 200, torch.bfloat16, cfg)[3] == 4  # 200 / 64: 4 K steps
    assert constexprs("a8w8", 200, torch.float8_e4m3fn, cfg)[:4] == (64, True, 8, 2)  # fp8: 128-wide steps
    assert block_k(torch.float16) == 64 and block_k(torch.float8_e4m3fn) == 128
    assert smem_bytes(128, 192, 4) == 4 * 320 * 128 + 128 * 192 * 2
    assert programs_for(100, 132) == 100 and programs_for(1000, 132) == 132


_CHILD = r"""
import torch
from triton.runtime.jit import MockTensor
from tritune.kernels import gemm as gk, gluon_gemm as gg

M, N, K = 4096, 4608, 3584
for kernel, dtype, cfg in (
        ("bf16", torch.bfloat16, gk.GemmConfig(128, 128, 64, 8, 4, 5, PERSISTENT_TMA=True, GLUON=True)),
        ("bf16", torch.float16, gk.GemmConfig(128, 192, 64, 8, 8, 4, PERSISTENT_TMA=True, GLUON=True)),
        ("a8w8", torch.float8_e4m3fn, gk.GemmConfig(64, 192, 128, 8, 4, 5, PERSISTENT_TMA=True, GLUON=True)),
        ("a8w8", torch.float8_e4m3fn, gk.GemmConfig(128, 256, 128, 8, 8, 3, PERSISTENT_TMA=True, GLUON=True))):
    gk.compile_only(kernel, M, N, K, cfg, dtype if kernel == "bf16" else torch.bfloat16)  # the compile pool's call
    a, b = MockTensor(dtype, [M, K]), MockTensor(dtype, [N, K])
    c = MockTensor(torch.bfloat16, [M, N])
    s = torch.float32 if kernel == "a8w8" else dtype
    compiled = gg.gemm_kernel.warmup(*gg.descriptors(a, b, c, cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N), s, s, M, N, K, 1,
                                     *gg.constexprs(kernel, K, dtype, cfg), num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, grid=(1,))
    report[f"{kernel} {cfg.BLOCK_SIZE_M}x{cfg.BLOCK_SIZE_N}"] = ptxas_report(
        compiled.asm["ptx"], two_mmas=cfg.BLOCK_SIZE_N & (cfg.BLOCK_SIZE_N - 1) != 0)
from tritune.kernels import gluon_gemm_ws as ws
for kernel, dtype, cfg in (  # the warp-specialised forms, as the compile pool builds them
        ("bf16", torch.bfloat16, gk.GemmConfig(128, 256, 64, 8, 8, 3, PERSISTENT_TMA=True, WARP_SPECIALIZE=True,
                                               GLUON=True)),
        ("a8w8", torch.float8_e4m3fn, gk.GemmConfig(128, 128, 128, 8, 4, 5, PERSISTENT_TMA=True,
                                                    WARP_SPECIALIZE=True, GLUON=True))):
    gk.compile_only(kernel, M, N, K, cfg, dtype if kernel == "bf16" else torch.bfloat16)
    a, b = MockTensor(dtype, [M, K]), MockTensor(dtype, [N, K])
    c = MockTensor(torch.bfloat16, [M, N])
    s = torch.float32 if kernel == "a8w8" else dtype
    compiled = ws.ws_gemm_kernel.warmup(*ws.ws_descriptors(a, b, c, cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N), s, s, M, N,
                                        K, 0, 0, 0, 0, 1, *ws.constexprs(kernel, cfg), num_warps=cfg.num_warps,
                                        num_stages=cfg.num_stages, maxnreg=ws.ws_maxnreg(cfg.num_warps), grid=(1,))
    report[f"ws {kernel} {cfg.BLOCK_SIZE_M}x{cfg.BLOCK_SIZE_N}"] = ptxas_report(compiled.asm["ptx"], two_mmas=False)
"""


@pytest.mark.skipif(not HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API (Triton >= 3.5)")
def test_compiled_for_sm90_with_the_mmas_in_flight_and_nothing_spilled() -> None:
    report = compile_report(_CHILD)
    assert set(report) == {"bf16 128x128", "bf16 128x192", "a8w8 64x192", "a8w8 128x256", "ws bf16 128x256",
                           "ws a8w8 128x128"}
    for name, r in report.items():
        in_flight = "2" if r["two_mmas"] else "1"  # this K step's MMAs run while the loop refills the last one's stage
        assert set(r["waits"]) == {in_flight, "0"}, (name, r["waits"])  # and all retired after the loop
        assert_asynchronous(name, r)
