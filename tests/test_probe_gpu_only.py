"""The GPU-only probes added for issue 16 (benchmarks/probe_wgmma_small_n.py, probe_moe_graph_gap.py) refuse to run
without CUDA in one line and a non-zero exit rather than printing numbers about nothing; their table rows hold what
their docstrings promise."""

from __future__ import annotations

import pytest
import torch
from benchmark_module import load_benchmark


@pytest.mark.parametrize("name", ["probe_wgmma_small_n", "probe_moe_graph_gap"])
def test_refuses_without_a_gpu(name, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"{name}: needs a GPU"):
        load_benchmark(name).main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_wgmma_probe_tiles_cover_narrow_and_full_n():
    probe = load_benchmark("probe_wgmma_small_n")
    assert {bm for _, bm, _ in probe.TILES} == {16, 32, 64, 128}
    assert all(bn % 64 == 0 and bk % 16 == 0 for bn, _, bk in probe.TILES)  # whole m64 wgmmas, whole k16 steps
    assert probe.PEAK_MAC_PER_SM_CYCLE == round(989.4e12 / 2 / 132 / 1.83e9)


@pytest.mark.parametrize("name", ["probe_gluon_moe_stage1", "probe_gluon_moe_stage2"])
def test_gluon_moe_probes_refuse_without_a_hopper_gpu(name, monkeypatch):
    """The Gluon stage prototypes (issue 14) run only on Hopper with Gluon: elsewhere one line and a non-zero exit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"{name}: needs a Hopper GPU"):
        load_benchmark(name).main(["--tokens", "16"])


def test_gluon_moe_stage1_refuses_an_intermediate_size_off_the_scale_blocks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    probe = load_benchmark("probe_gluon_moe_stage1")
    if not probe.HAS_GLUON_HOPPER:
        pytest.skip("this Triton has no Gluon Hopper API (Triton >= 3.5): the probe refuses earlier")
    with pytest.raises(SystemExit, match="I 100 is not a multiple of 128"):
        probe.main(["--dims", "2048,100,8,2"])
