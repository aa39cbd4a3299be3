"""benchmarks/bench_gemm_gen2.py without a GPU: its variants are configs the kernels accept, the shapes are the
issue's kind (not in examples/, some N not a power of two), the table's ratios, and a clear exit without a GPU."""

from __future__ import annotations

import csv
import importlib.util
import pathlib

import pytest
import torch

from tritune.kernels import gemm as gk

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_gemm_gen2", ROOT / "benchmarks" / "bench_gemm_gen2.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_shapes_are_new_and_some_n_are_not_powers_of_two():
    with (ROOT / "examples" / "gemm_shapes.csv").open(newline="") as f:
        shipped = {(int(r["N"]), int(r["K"])) for r in csv.DictReader(line for line in f if not line.startswith("#"))}
    assert shipped
    assert len(bench.SHAPES) == 6 and not shipped & set(bench.SHAPES.values())
    assert sum(n & (n - 1) != 0 for n, _ in bench.SHAPES.values()) >= 2


@pytest.mark.parametrize("kernel", ["bf16", "a8w8_blockscale"])
def test_every_variant_is_a_config_the_kernels_accept(kernel):
    a = torch.zeros(256, 512, dtype=torch.float8_e4m3fn if kernel != "bf16" else torch.bfloat16)
    b = torch.zeros(384, 512, dtype=a.dtype)
    scales = (torch.ones(256, 4), torch.ones(3, 4)) if kernel != "bf16" else (None, None)
    found = bench.variants(kernel)
    # warp specialisation only for block-scaled (bf16 measured no gain); sub-tiling and split-K where they apply
    assert any(c.WARP_SPECIALIZE for c in found.values()) == (kernel != "bf16")
    assert any(c.EPILOGUE_SUBTILE for c in found.values())
    assert any(c.NUM_KSPLIT > 1 for c in found.values()) == (kernel == "bf16")
    for name, cfg in found.items():
        gk.validate(kernel, a, b, *scales, cfg)  # raises on a config the kernels refuse
        assert cfg.PERSISTENT_TMA == name.startswith("tma")
        assert ("ws" in name.split()) == cfg.WARP_SPECIALIZE and ("sub" in name.split()) == cfg.EPILOGUE_SUBTILE


def test_table_ratios_and_geomean():
    rows = [{"kernel": "bf16", "shape": "s", "M": 256, "flops": 2e12, "cublas_us": 100.0, "op_us": 125.0,
             "best": "v", "best_us": 80.0},
            {"kernel": "bf16", "shape": "s", "M": 1024, "flops": 2e12, "cublas_us": 100.0, "op_us": 80.0,
             "best": "v", "best_us": 125.0}]
    lines = bench.table(rows)
    assert "| bf16 | s | 256 | 100.0 | 125.0 (0.80) | 80.0 (1.25) | v | 25000 |" in lines
    assert lines[-1].strip() == "bf16: cuBLAS / best variant geomean 1.000, cuBLAS / op geomean 1.000"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit; on a GPU the benchmark runs")
def test_exits_with_a_reason_without_a_gpu(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a GPU" in capsys.readouterr().err
