"""benchmarks/probe_mxfp4_scale_tma.py without a GPU: the re-laid scale records hold each (K step, 64-row block)'s
codes row by row with 127 past N and K, and the toy's TMA-scale mode gives exactly the byte-load mode's result in the
interpreter, on a K that ends inside a step."""

from __future__ import annotations

import json

import torch
from benchmark_module import load_benchmark


def test_tile_scales_lays_each_step_and_block_out_row_by_row():
    probe = load_benchmark("probe_mxfp4_scale_tma")
    s = (torch.arange(70 * 5, dtype=torch.int32) % 193).reshape(70, 5).to(torch.uint8)  # N 70, K/32 5: past a tile
    t = probe.tile_scales(s)
    assert t.shape == (2 * 2, 256)  # 2 row blocks x 2 K steps
    rec = t[0 * 2 + 1].reshape(64, 4)  # rows 0-63, K step 1: codes 4..7, of which only 4 exists
    assert torch.equal(rec[:, 0], s[:64, 4]) and bool((rec[:, 1:] == 127).all())
    rec = t[1 * 2 + 0].reshape(64, 4)  # rows 64-127, K step 0: rows 64-69 real, the rest 127
    assert torch.equal(rec[:6], s[64:70, :4]) and bool((rec[6:] == 127).all())


def test_tma_scales_match_the_byte_loads(tmp_path):  # the interpreter in CI, the GPU where there is one
    out = tmp_path / "scale_tma.json"
    assert load_benchmark("probe_mxfp4_scale_tma").main(["--tiny", "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    # fp16 output in the interpreter; on a GPU bf16, whose rounding alone is ~1.6e-3 of relative L2 (measured, H100)
    bound = 4e-3 if torch.cuda.is_available() else 1e-3
    assert rows["tma"]["equal_to_bytes"] and rows["bytes"]["rel_l2"] < bound
    assert rows["none"]["rel_l2"] > 1  # every scale 1 is a bound, not an answer
