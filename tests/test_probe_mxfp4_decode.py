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
