"""benchmarks/probe_mxfp4_decode.py without a GPU: its "shift" baseline is the shift-form PTX the op used before the
one-multiply decode (checked against the spec's fields by the same emulation as test_mxfp4_ptx_fields.py), an
unknown variant is refused, and the driver runs one variant in a child process through the interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from benchmark_module import load_benchmark
from test_mxfp4_ptx_fields import _every_byte_pair, _shift_fields, _spec_fields


def _probe():
    return load_benchmark("probe_mxfp4_decode")



@pytest.mark.parametrize("high", [False, True])
def test_shift_baseline_builds_the_bf16_fields(high):
    ptx = _probe()._shift_ptx(high)
    assert "fma.rn.bf16x2" in ptx and "fma.rn.f16x2" not in ptx and "0x7E807E80" in ptx
    words = _every_byte_pair()
    for got, want in zip(_shift_fields(ptx, words), _spec_fields(words, high, mag_bit=6), strict=True):
        assert np.array_equal(got, want)


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        _probe().apply_variant("fast")
    with pytest.raises(SystemExit):
        _probe().main(["--variants", "op,fast", "--out", str(tmp_path / "x.json"), "--tiny"])


def test_driver_runs_a_variant_in_the_interpreter(tmp_path):
    out = tmp_path / "decode.json"
    assert _probe().main(["--tiny", "--variants", "op", "--tokens", "5", "--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["tokens"]) for r in rows] == [("op", 5)]
    assert rows[0]["rel_l2"] < 1e-2 and rows[0]["us"] > 0 and "SW1" in rows[0]["configs"][0]


def test_words_variant_reads_padded_scale_rows_exactly(tmp_path):
    """The 32-bit scale loads (BLOCK_K 128, forced here) give the op's result on rows padded to 96 bytes."""
    import torch

    probe = _probe()
    s = torch.randint(100, 140, (2, 3, 5), dtype=torch.uint8)
    p = probe.padded_scales(s)
    assert torch.equal(p, s) and p.stride() == (3 * 96, 96, 1)
    assert int(p.as_strided((2, 3, 96), p.stride())[0, 0, 5]) == 127  # the padding reads scale 1
    out = tmp_path / "words.json"
    assert probe.main(["--tiny", "--variants", "op,words", "--tokens", "5", "--iters", "1", "--set", "BLOCK_SIZE_K=128",
                       "--out", str(out)]) == 0
    rows = {r["variant"].split("[")[0]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["words"]["rel_l2"] == pytest.approx(rows["op"]["rel_l2"], rel=1e-6) and rows["words"]["rel_l2"] < 1e-2
    assert "BK128" in rows["words"]["configs"][0]


def _tiny_runs(tmp_path, **fields_by_variant: str) -> dict[str, dict]:
    """Each variant's row at 5 tokens of the tiny shape, run alone by the driver with its own --set fields."""
    rows = {}
    for variant, fields in fields_by_variant.items():
        out = tmp_path / f"{variant}.json"
        assert _probe().main(["--tiny", "--variants", variant, "--tokens", "5", "--iters", "1", "--set", fields,
                              "--out", str(out)]) == 0
        rows[variant] = json.loads(out.read_text())["rows"][0]
    return rows


def test_records_variant_reads_the_codes_through_tma_and_matches_the_op(tmp_path):
    """The tiny shape's rule tiles take BLOCK_K 64 (no records); forced to 128 with SCALE_TMA, the records variant
    reads the codes through TMA and gives the op's result."""
    rows = _tiny_runs(tmp_path, op="BLOCK_SIZE_K=128", records="BLOCK_SIZE_K=128,SCALE_TMA=1")
    assert "ST1" in rows["records"]["configs"][0] and "ST1" not in rows["op"]["configs"][0]
    assert rows["records"]["rel_l2"] == pytest.approx(rows["op"]["rel_l2"], rel=1e-6) and rows["op"]["rel_l2"] < 1e-2


def test_swizzle_variant_reads_re_encoded_weights_and_matches_the_op_and_set_takes_one_stage(tmp_path):
    """The swizzle variant hands the stages `prepare_mxfp4_weights` results (the interpreter undoes the encoding per
    tile) and gives the op's result; `--set 2:FIELD=V` reaches stage 2's config alone."""
    rows = _tiny_runs(tmp_path, op="BLOCK_SIZE_K=128", swizzle="BLOCK_SIZE_K=128,2:num_stages=3")
    assert rows["swizzle"]["rel_l2"] == pytest.approx(rows["op"]["rel_l2"], rel=1e-6) and rows["op"]["rel_l2"] < 1e-2
    assert "_S3_" in rows["swizzle"]["configs"][1]
    probe = _probe()
    assert probe.stage_fields(probe.parse_set("num_warps=4,1:KSPLIT=2"), 2) == {"num_warps": 4}
    with pytest.raises(SystemExit, match=r"want \[1:\|2:\]FIELD=INT"):
        probe.parse_set("3:KSPLIT=2")
    assert probe.parse_dims("2048,768,128,8") == (2048, 768, 128, 8)
