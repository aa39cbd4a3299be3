"""The training-MLP runtime benchmark and its host profile without a GPU: both refuse in one line with exit 2
(they time CUDA launches, graphs and queues, which the interpreter has none of), and the benchmark's replay check
compares every output of a call."""

from __future__ import annotations

import pytest
import torch
from benchmark_module import load_benchmark

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal; the GPU runs them")


@pytest.mark.parametrize("name", ["bench_moe_mlp_runtime", "profile_moe_mlp_host"])
def test_refuses_without_a_gpu(name, tmp_path, capsys):
    assert load_benchmark(name).main(["--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_the_models_are_the_ones_the_grouped_bench_knows():
    bench = load_benchmark("bench_moe_mlp_runtime")
    grouped = load_benchmark("bench_grouped_gemm")
    for model, shape in bench.MODELS.items():
        assert grouped.MODELS[model] == shape
