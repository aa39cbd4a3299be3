"""benchmarks/profile_mxfp4_host.py without a GPU: it refuses in one line (host cost with the GPU parked needs one);
on a GPU it is a device job (RESULTS.md)."""

from __future__ import annotations

import pytest
import torch
from benchmark_module import load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="profile_mxfp4_host: needs a GPU"):
        load_benchmark("profile_mxfp4_host").main([])


def test_shapes_name_the_small_case_and_gpt_oss():
    shapes = load_benchmark("profile_mxfp4_host").SHAPES
    assert shapes["gpt-oss-120b"] == (2880, 2880, 128, 4) and len(shapes) == 2
