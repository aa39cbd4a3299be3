"""The two K32-order probes (benchmarks/probe_mxfp4_byte_order.py, probe_mxfp4_swap_race.py) without a GPU: the host
byte re-order the first times against is the one it documents, and the second runs its interpreter shapes and finds
the swapped stage 2 deterministic there."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_module import load_benchmark

from tritune.kernels.mxfp4_format import pack_e2m1


def test_host_reorder_puts_each_k_pair_where_the_probe_says():
    probe = load_benchmark("probe_mxfp4_byte_order")
    codes = torch.randint(0, 16, (3, 2, 64), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    moved = probe.host_reorder(pack_e2m1(codes))
    assert moved.shape == (3, 2, 32) and moved.dtype == torch.uint8
    for q in range(2):
        for t in range(4):
            for g in range(2):
                for i in range(2):
                    byte = moved[..., 16 * q + 4 * t + 2 * g + i]
                    assert torch.equal(byte & 15, codes[..., 32 * q + 16 * g + 2 * t + i])
                    assert torch.equal(byte >> 4, codes[..., 32 * q + 16 * g + 8 + 2 * t + i])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the probe itself")
def test_swap_race_probe_runs_its_tiny_shapes(tmp_path):
    out = tmp_path / "race.json"
    assert load_benchmark("probe_mxfp4_swap_race").main(["--tiny", "--runs", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    assert all(r["differing_runs"] == 0 and r["nonfinite_elements"] == 0 and r["runs"] == 2 for r in rows)


def test_byte_order_probe_says_it_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the probe runs for real")
    assert load_benchmark("probe_mxfp4_byte_order").main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a GPU" in capsys.readouterr().err
