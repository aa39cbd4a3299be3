"""benchmarks/bench_mxfp4_tuned_ab.py without a GPU: its floor, its --dims parsing and its one-line refusal (timing
the tuned ops is a device job, RESULTS.md)."""

from __future__ import annotations

import argparse

import pytest
import torch
from benchmark_module import load_benchmark


def test_the_floor_counts_the_routed_experts_mxfp4_bytes_at_the_copy_bandwidth():
    bench = load_benchmark("bench_mxfp4_tuned_ab")
    # gpt-oss-120b at one token: 4 experts x 3 x 2880 x 2880 weights at 4.25 bits, plus 2 x 2880 bf16 activations
    want = (4 * 3 * 2880 * 2880 * 4.25 / 8 + 2 * 2880 * 2) / 3.0e12 * 1e6
    assert bench.floor_us(4, 1, 2880, 2880) == pytest.approx(want) and 17.5 < want < 17.7


def test_dims_want_four_positive_integers():
    bench = load_benchmark("bench_mxfp4_tuned_ab")
    assert bench.parse_dims("2880,2880,32,4") == (2880, 2880, 32, 4)
    for bad in ("2880,2880,32", "2880,0,32,4", "a,b,c,d"):
        with pytest.raises(argparse.ArgumentTypeError, match="want D,I,E,TOPK"):
            bench.parse_dims(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("")
    with pytest.raises(SystemExit, match="bench_mxfp4_tuned_ab: needs a GPU"):
        load_benchmark("bench_mxfp4_tuned_ab").main(["--mxfp4-csv", str(csv), "--bf16-csv", str(csv)])
