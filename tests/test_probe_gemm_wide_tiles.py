"""benchmarks/probe_gemm_wide_tiles.py without a GPU: the BN + BT wide tiles through the interpreter (fp16), so the
experiment the next GPU session runs is known to compute the right product, edges included."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_gemm_wide_tiles",
                                              ROOT / "benchmarks" / "probe_gemm_wide_tiles.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the probe itself")


@pytest.mark.parametrize(("m", "n", "k", "bm", "bn", "bt", "sms", "tiles"), [
    (70, 104, 200, 32, 32, 16, 4, 9),  # 3 x 3 tiles of 32 x 48; the last column's tail part past N (clipped)
    (33, 48, 64, 16, 32, 16, 3, 3),  # N exactly one wide tile; M one row past two tiles
    (64, 200, 96, 32, 64, 32, 5, 6),  # tail wider than the rest of N in the last tile
])
def test_wide_tiles_match_torch(m, n, k, bm, bn, bt, sms, tiles):
    gen = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, k, generator=gen).half()
    out = torch.zeros(m, n, dtype=torch.float16)
    f = probe.WideTile(a, b, out, bm, bn, bt, 32, 4, 2, group=2, sms=sms)
    f()
    want = a.float() @ b.float().T
    assert f.tiles == tiles
    assert float((out.float() - want).norm() / want.norm()) < 1e-3
