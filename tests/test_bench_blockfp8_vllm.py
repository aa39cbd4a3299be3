"""benchmarks/bench_blockfp8_vllm.py without a GPU: vLLM's config lookup and the refusals before any work."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_blockfp8_vllm", ROOT / "benchmarks" / "bench_blockfp8_vllm.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_nearest_config_is_vllms_lookup():
    configs = {"1": {"BLOCK_SIZE_M": 16}, "64": {"BLOCK_SIZE_M": 64}, "1024": {"BLOCK_SIZE_M": 128},
               "4096": {"BLOCK_SIZE_M": 256}}
    assert bench.nearest_config(configs, 1)["BLOCK_SIZE_M"] == 16
    assert bench.nearest_config(configs, 600)["BLOCK_SIZE_M"] == 128  # 424 from 1024, 536 from 64
    assert bench.nearest_config(configs, 2560)["BLOCK_SIZE_M"] == 128  # a tie goes to the smaller key
    assert bench.nearest_config(configs, 9000)["BLOCK_SIZE_M"] == 256


def test_vendor_file_names_the_h100_block_fp8_config(tmp_path):
    path = bench.vendor_file(tmp_path, 1536, 7168)
    assert path.name == "N=1536,K=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128,128].json"


def test_a_missing_vendor_config_stops_before_any_work(tmp_path, capsys):
    assert bench.main(["--vendor-dir", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "no vLLM H100 config" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
