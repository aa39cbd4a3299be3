"""benchmarks/probe_gemm_streamk.py without a GPU: the stream-K prototype's split and fix-up through the interpreter
(fp16: the interpreter's bf16 dot is wrong), so the measured experiment stays runnable."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_gemm_streamk", ROOT / "benchmarks" / "probe_gemm_streamk.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the probe itself")


@pytest.mark.parametrize(("tiles", "sms", "policy", "want"), [
    (9, 4, "one", (8, 1)),  # two full waves whole, the partial one split
    (9, 4, "two", (4, 5)),  # the last full wave split too
    (3, 4, "two", (0, 3)),  # under one wave: every tile split
    (8, 4, "two", (8, 0)),  # full waves only: nothing to split
])
def test_split_policy(tiles, sms, policy, want):
    assert probe.split_policy(tiles, sms, policy) == want


@pytest.mark.parametrize(("m", "n", "k", "sms", "policy"), [
    (70, 96, 200, 4, "two"),  # 3 x 3 tiles of 32 on 4 programs: 4 whole, 5 split over the 4
    (33, 40, 64, 7, "two"),  # more programs than tiles: each tile split between programs
    (64, 64, 320, 7, "one"),
])
def test_stream_k_matches_torch_and_leaves_its_locks_at_zero(m, n, k, sms, policy):
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, k, generator=gen).half()
    out = torch.zeros(m, n, dtype=torch.float16)
    f = probe.StreamK(a, b, out, 32, 32, 32, 4, 2, policy, group=2, sms=sms)
    f()
    want = a.float() @ b.float().T
    assert float((out.float() - want).norm() / want.norm()) < 1e-3
    assert f.sk > 0 and int(f.lock.abs().sum()) == 0  # every split tile summed once, its lock reset
