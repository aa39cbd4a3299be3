"""benchmarks/bench_mxfp4_stages.py without a GPU: the floor by hand and one tiny point through the interpreter."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_mxfp4_stages", ROOT / "benchmarks" / "bench_mxfp4_stages.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_floor_counts_mxfp4_values_and_scales():
    # gpt-oss-120b, 1 token, 4 routed experts: 4 * 3 * 2880 * 2880 weights at 17/32 byte + 2 * 2880 * 2 B at 3 TB/s
    want = (4 * 3 * 2880 * 2880 * (0.5 + 1 / 32) + 2 * 2880 * 2) / 3.0e12 * 1e6
    assert abs(bench.floor_us(1, 2880, 2880, 4, 4, 0.5 + 1 / 32) - want) < 1e-9
    assert bench.floor_us(1, 2880, 2880, 4, 4, 2.0) / want > 3.7  # the point of MXFP4: 3.76x fewer bytes


def test_tiny_point_runs_and_checks_both_contestants(tmp_path):
    out = tmp_path / "mx.json"
    assert bench.main(["--tiny", "--tokens", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bf16_rel_l2"] < 1e-2 and row["mxfp4_rel_l2"] < 1e-2
    assert row["mxfp4_configs"][0].startswith("moe_stage1_per_1x32_") and row["mxfp4_us"] > 0
    for name in ("mxfp4 dot_scaled", "mxfp4 rule", "mxfp4 a8"):  # the other MXFP4 contestants: checked too
        assert row[f"{name}_rel_l2"] < 1e-2 and row[f"{name}_us"] > 0


def test_tiny_point_with_the_multiply_add_path(tmp_path):
    out = tmp_path / "mx.json"
    assert bench.main(["--tiny", "--tokens", "3", "--fma", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    fma = [k[:-7] for k in row if k.endswith("_rel_l2") and " fma " in k]
    assert len(fma) == 2 * len(bench.FMA_TILES)  # bf16 and MXFP4, each tile
    assert all(row[f"{name}_rel_l2"] < 1e-2 and row[f"{name}_us"] > 0 for name in fma)
    assert row["mxfp4 fma 0_configs"][0].startswith("moe_stage1_per_1x32_silu_BM2_")  # 6 pairs over 4 experts
    assert row["bf16_fma_best_us"] > 0


def test_sweep_warps_takes_a_comma_list_of_warp_counts(capsys):
    assert bench._warp_counts("4,8") == (4, 8)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--tiny", "--out", "unused.json", "--sweep-warps", "8,3"])
    assert exit_.value.code == 2
    assert "--sweep-warps: '8,3': a comma list of warp counts, each 4, 8 or 16" in capsys.readouterr().err
