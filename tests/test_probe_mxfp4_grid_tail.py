"""benchmarks/probe_mxfp4_grid_tail.py without a GPU: its routing covers exactly the chosen experts with distinct
experts per token, its floor, and its one-line refusals (timing the stage is a device job, RESULTS.md)."""

from __future__ import annotations

import pytest
import torch
from benchmark_module import load_benchmark


@pytest.mark.parametrize("count", [4, 15, 47, 64])
def test_round_robin_routing_covers_the_pool_with_distinct_experts_per_token(count):
    probe = load_benchmark("probe_mxfp4_grid_tail")
    pool = torch.randperm(128, generator=torch.Generator().manual_seed(count))[:count]
    ids = probe.round_robin_ids(pool, 16, 4)
    assert ids.shape == (16, 4) and ids.dtype == torch.int32
    assert set(ids.flatten().tolist()) == set(pool.tolist())
    assert all(len(set(row)) == 4 for row in ids.tolist())
    per_expert = torch.bincount(ids.flatten().long(), minlength=128)[pool]
    assert int(per_expert.max() - per_expert.min()) <= 1


def test_the_floor_is_the_routed_gate_and_up_bytes():
    probe = load_benchmark("probe_mxfp4_grid_tail")
    assert probe.floor_us(1) == pytest.approx(2 * 2880 * 2880 * 4.25 / 8 / 3.0e12 * 1e6)


def test_refusals_are_one_line():
    probe = load_benchmark("probe_mxfp4_grid_tail")
    with pytest.raises(SystemExit, match=r"--experts each in \[4, 64\]"):
        probe.main(["--experts", "3,14"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="probe_mxfp4_grid_tail: needs a GPU"):
            probe.main(["--experts", "14"])
