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


def test_rotated_copies_hold_the_same_values_at_other_addresses():
    """--rotate: each copy's weights come from DRAM in turn (a model's layers), so every copy must be its own memory
    and the same numbers as the MoE's own weights (the first copy)."""
    from tritune import ops
    from tritune.kernels import fused_moe as fm

    bench = load_benchmark("bench_mxfp4_tuned_ab")
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(2, 128, 64, generator=gen), torch.randn(2, 64, 64, generator=gen)
    (q1, s1), (q2, s2) = fm.quantize_weights(w1, fm.MXFP4), fm.quantize_weights(w2, fm.MXFP4)
    moe = bench.Mxfp4Moe(q1, q2, ops.prepare_mxfp4_weights(q1), ops.prepare_mxfp4_weights(q2),
                         ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2), (w1.bfloat16(), w2.bfloat16()))
    assert bench.rotated_copies(moe, 0) == []
    copies = bench.rotated_copies(moe, 3)
    assert len(copies) == 3 and copies[0]["w1"] is moe.w1 and copies[0]["b2"] is moe.bf16[1]
    for c in copies[1:]:
        for key, own, got in (("w1", moe.w1.tiles, c["w1"].tiles), ("w2", moe.w2.tiles, c["w2"].tiles),
                              ("s1", moe.s1.records, c["s1"].records), ("s2", moe.s2.codes, c["s2"].codes),
                              ("b1", moe.bf16[0], c["b1"]), ("b2", moe.bf16[1], c["b2"])):
            assert torch.equal(got, own) and got.data_ptr() != own.data_ptr(), key
        assert (c["w1"].rows, c["w1"].half_k) == (moe.w1.rows, moe.w1.half_k)


def test_rotate_wants_two_copies_at_least():
    with pytest.raises(SystemExit, match="--rotate 1: want 0 .off. or at least 2 copies"):
        load_benchmark("bench_mxfp4_tuned_ab").main(["--mxfp4-csv", "x", "--bf16-csv", "y", "--rotate", "1"])
