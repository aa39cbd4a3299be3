"""benchmarks/bench_fused_moe_gen2.py without a GPU: the floor arithmetic, argument and --variant parsing, vLLM's
block-fp8 config choice, the table, and (where peers_vllm/ was extracted) the block-fp8 peer through the interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest
import torch

from tritune.kernels.fused_moe import MoeConfig
from tritune.ops.fused_moe import MoeChoice

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_fused_moe_gen2", ROOT / "benchmarks" / "bench_fused_moe_gen2.py")
gen2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen2)
FIELDS = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "num_warps"}


@pytest.mark.parametrize("tokens, d, inter, topk, routed, quant, want_us", [
    # Mixtral-8x7B, 1 token (bandwidth): weights 2·3·4096·14336·2 B + in/out 2·4096·2 B = 704659456 B at 3 TB/s
    (1, 4096, 14336, 2, 2, "none", 704659456 / 3e12 * 1e6),
    # Mixtral-8x7B, 8192 tokens (compute): 2·8192·2·3·4096·14336 = 5772436045824 FLOP at 730 TFLOP/s
    (8192, 4096, 14336, 2, 8, "none", 5772436045824 / 730e12 * 1e6),
    # Qwen3-30B-A3B per_1x128, 6000 tokens: 452984832000 FLOP at the fp8 peak 1250 TFLOP/s = 362.39 µs beats the
    # 1-byte weights 128·3·2048·768 + in/out 2·6000·2048·2 = 653131776 B (217.7 µs)
    (6000, 2048, 768, 8, 128, "per_1x128", 452984832000 / 1250e12 * 1e6),
    # the same in bf16: 620.5 µs of FLOPs at 730 TFLOP/s beats 1257111552 B (419.0 µs)
    (6000, 2048, 768, 8, 128, "none", 452984832000 / 730e12 * 1e6),
    # fp8 at 1 token (bandwidth, 1-byte weights): 8·3·2048·768 + 2·2048·2 = 37756928 B
    (1, 2048, 768, 8, 8, "per_1x128", 37756928 / 3e12 * 1e6),
])
def test_floor_by_hand(tokens, d, inter, topk, routed, quant, want_us):
    assert gen2.floor_us(tokens, d, inter, topk, routed, quant) == pytest.approx(want_us, rel=1e-12)


def test_floor_counts_only_routed_experts():
    ids = torch.tensor([[0, 3], [3, 5], [5, 0]])  # 3 of 8 experts routed to
    assert gen2.routed_experts(ids) == 3
    full, part = (gen2.floor_us(3, 4096, 14336, 2, r, "none") for r in (8, 3))
    assert part == pytest.approx(full * (3 * 3 * 4096 * 14336 * 2 + 3 * 4096 * 4) / (8 * 3 * 4096 * 14336 * 2
                                                                                   + 3 * 4096 * 4))


def test_parse_variant_fields_stages_and_unknown():
    s1, s2, notes = gen2.parse_variant("BLOCK_SIZE_N=128, s2.num_warps=8,NOT_A_FIELD_XYZ=1,s1.BLOCK_SIZE_M=32", FIELDS)
    assert s1 == {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_M": 32}
    assert s2 == {"BLOCK_SIZE_N": 128, "num_warps": 8}
    assert len(notes) == 1 and "NOT_A_FIELD_XYZ" in notes[0]
    for bad in ("BLOCK_SIZE_N", "s3.BLOCK_SIZE_N=1", "BLOCK_SIZE_N=x"):
        with pytest.raises(ValueError):
            gen2.parse_variant(bad, FIELDS)


def test_apply_variant_two_stage_and_one_stage():
    two = MoeChoice(False, MoeConfig(BLOCK_SIZE_M=64), MoeConfig(BLOCK_SIZE_M=64, num_warps=4), "heuristic")
    got = gen2.apply_variant(two, {"BLOCK_SIZE_N": 128}, {"num_warps": 8})
    assert got.stage1 == MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128) and got.stage2.num_warps == 8
    assert not got.run_1stage and got.source == "variant of heuristic" and two.stage1.BLOCK_SIZE_N == 64
    one = MoeChoice(True, MoeConfig(BLOCK_SIZE_D=256), None, "heuristic")
    got = gen2.apply_variant(one, {"num_warps": 8}, {"num_warps": 2})
    assert got.run_1stage and got.stage2 is None and got.stage1 == MoeConfig(BLOCK_SIZE_D=256, num_warps=8)


def test_parse_args_points_variants_and_tune_row(capsys):
    args = gen2.parse_args(["--shapes", "mixtral-8x22b", "--fp8-shapes", "deepseek-v2-lite", "--tokens", "1,333",
                            "--variant", "BLOCK_SIZE_M=32,NOT_A_FIELD_XYZ=1", "--variant", "NOPE_XYZ=1",
                            "--tune-row", "deepseek-v2-lite:333:per_1x128"])
    assert gen2.points(args) == [("mixtral-8x22b", "none", 1), ("mixtral-8x22b", "none", 333),
                                 ("deepseek-v2-lite", "per_1x128", 1), ("deepseek-v2-lite", "per_1x128", 333)]
    assert args.variants == [("BLOCK_SIZE_M=32,NOT_A_FIELD_XYZ=1", {"BLOCK_SIZE_M": 32}, {"BLOCK_SIZE_M": 32})]
    assert any("NOT_A_FIELD_XYZ" in n for n in args.notes) and any("NOPE_XYZ" in n and "not run" in n
                                                                   for n in args.notes)
    assert args.tune_point == ("deepseek-v2-lite", "per_1x128", 333)
    defaults = gen2.parse_args([])
    assert len(gen2.points(defaults)) == 7 * (5 + 2) and defaults.variants == [] and defaults.tune_point is None
    assert gen2.parse_args(["--fp8-shapes", ""]).fp8_shapes == ()
    assert gen2.parse_args(["--rule-flag", "FP8_PAIR_AT_DECODE=0"]).rule_flags == [(("FP8_PAIR_AT_DECODE", 0),)]
    both = gen2.parse_args(["--rule-flag", "GLUON_MOE_MIN_K=256,GLUON_MOE_PERSISTENT=1"]).rule_flags
    assert both == [(("GLUON_MOE_MIN_K", 256), ("GLUON_MOE_PERSISTENT", 1))]
    assert gen2.flags_label(both[0]) == "rule GLUON_MOE_MIN_K=256,GLUON_MOE_PERSISTENT=1"
    for bad in (["--shapes", "llama"], ["--tune-row", "mixtral-8x22b"], ["--tune-row", "mixtral-8x22b:0"],
                ["--variant", "BLOCK_SIZE_M"], ["--rule-flag", "NO_SUCH_SWITCH=1"], ["--rule-flag", "moe_heuristic=1"],
                ["--rule-flag", "FP8_PAIR_AT_DECODE=yes"],
                ["--rule-flag", "FP8_PAIR_AT_DECODE=0,NO_SUCH_SWITCH=1"]):
        with pytest.raises(SystemExit) as exc:
            gen2.parse_args(bad)
        assert exc.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        gen2.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "PYTHONPATH=src python benchmarks/bench_fused_moe_gen2.py \\\n" in text and "peers_vllm" in text


def test_tune_shape_is_a_valid_untuned_row(tmp_path):
    from tritune.store.fmoe_csv import read_untuned, write_untuned

    shapes = [gen2.tune_shape(f"{name}:1024") for name in gen2.SHAPES] + [gen2.tune_shape("qwen3-30b-a3b:8:per_1x128")]
    write_untuned(tmp_path / "rows.csv", shapes)
    assert read_untuned(tmp_path / "rows.csv") == shapes
    assert (shapes[0].model_dim, shapes[0].inter_dim, shapes[0].expert, shapes[0].topk) == (2048, 768, 128, 8)
    assert shapes[-1].q_type == "per_1x128" and shapes[-1].q_dtype_w == "fp8" and shapes[-1].token == 8


@pytest.mark.parametrize("tokens, want", [  # vLLM 0.33's get_default_config, block-fp8 on CUDA
    (1, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "GROUP_SIZE_M": 1, "num_stages": 4}),  # M <= 4: deeper pipeline
    (8, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "GROUP_SIZE_M": 1, "num_stages": 3}),  # M <= 8: 64-wide N tiles
    (16, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 1, "num_stages": 3}),
    (64, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 32, "num_stages": 3}),
    (333, {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 32, "num_stages": 3}),
])
def test_vllm_block_fp8_default(tmp_path, tokens, want):
    cfg, source = gen2.vllm_block_fp8_config(tokens, 128, 768, tmp_path, "NVIDIA_H100_80GB_HBM3")
    assert source == "vLLM default" and cfg == {**want, "BLOCK_SIZE_K": 128, "num_warps": 4}


def test_vllm_block_fp8_file_nearest_batch_and_h200_name(tmp_path):
    (tmp_path / "configs").mkdir()
    name = "E=64,N=1408,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    (tmp_path / "configs" / name).write_text(json.dumps({"1": {"BLOCK_SIZE_M": 16}, "64": {"BLOCK_SIZE_M": 32},
                                                         "triton_version": "3.6.0"}))
    assert gen2.vllm_block_fp8_config(40, 64, 1408, tmp_path, "NVIDIA_H200_141GB_HBM3e") == ({"BLOCK_SIZE_M": 32}, name)
    assert gen2.vllm_block_fp8_config(20, 64, 1408, tmp_path, "NVIDIA_H200") == ({"BLOCK_SIZE_M": 16}, name)
    assert gen2.vllm_block_fp8_config(20, 64, 1408, tmp_path, "NVIDIA_H100_80GB_HBM3")[1] == "vLLM default"


def test_table_ratios_flags_and_errors():
    rows = [{"shape": "s", "quant": "none", "tokens": 8, "floor_us": 100.0, "ours_us": 150.0, "ours_rel_err": 3e-3,
             "vllm_us": 200.0, "vllm_rel_err": 3e-3, "vllm_config_source": "E=8,N=1.json", "ours_eager_us": 170.0,
             "ours_graph_us": 151.0, "variant A=1_us": 120.0, "variant A=1_rel_err": 0.5},
            {"shape": "s", "quant": "none", "tokens": 9, "floor_us": 100.0, "ours_error": "ValueError: x",
             "vllm_error": "RuntimeError: y", "variant A=1_error": "no"}]
    head, rule, ok, bad = gen2.table(rows, ["A=1"])
    assert head.count("|") == rule.count("|") == ok.count("|") == bad.count("|") == 12
    assert ok == ("| s | none | 8 | 150.0 | 200.0 | 0.75 | 100.0 | 1.50 | 170.0 / 151.0 | file | 120.0 WRONG (0.80) |")
    assert bad == "| s | none | 9 | error | error | - | 100.0 | - | - | default | error |"


def test_table_library_columns_only_where_measured():
    row = {"shape": "s", "quant": "none", "tokens": 8, "floor_us": 100.0, "ours_us": 200.0, "library_us": 150.0,
           "dense_us": 100.0}
    head, _, line = gen2.table([row], [])
    assert head.endswith("| library µs (/ours) | dense µs (/ours) |")
    assert line.endswith("| 150.0 (0.75) | 100.0 (0.50) |")
    assert "library" not in gen2.table([{k: v for k, v in row.items() if k not in ("library_us", "dense_us")}], [])[0]
    assert gen2.parse_args(["--library"]).library and not gen2.parse_args([]).library


def _peer_dirs() -> tuple[pathlib.Path, pathlib.Path]:
    vendor = ROOT / "peers_vllm"
    shared = next((p for p in (vendor, ROOT.parent / "shared" / "peers") if (p / "vllm_moe.py").exists()), None)
    if not (vendor / "vllm_fused_moe_kernel.py").exists() or shared is None:
        pytest.skip("vLLM's kernel is not extracted here (peers_vllm/ is git-ignored; see ../shared/peers/README.md)")
    return vendor, shared


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check; the GPU runs the benchmark itself")
@pytest.mark.parametrize("hopper", [False, True])  # SWAP_AB off / on (BLOCK_SIZE_M 16 < 64 <= BLOCK_SIZE_N 64)
def test_block_fp8_peer_matches_reference(monkeypatch, hopper):
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops.routing import sample_routing

    vendor, shared = _peer_dirs()
    monkeypatch.syspath_prepend(str(shared))
    monkeypatch.syspath_prepend(str(vendor))
    g = torch.Generator().manual_seed(0)
    E, D, inter, T, topk = 4, 256, 384, 5, 2  # T below BLOCK_SIZE_M: the short grid; 3 weight blocks on N of w2
    w1, w2 = torch.randn(E, 2 * inter, D, generator=g) / D**0.5, torch.randn(E, D, inter, generator=g) / inter**0.5
    (q1, s1), (q2, s2) = quantize_weights(w1, "per_1x128"), quantize_weights(w2, "per_1x128")
    h = torch.randn(T, D, generator=g).bfloat16()
    tw, ti = sample_routing(T, E, topk, seed=1)
    ref = fused_moe_reference(h, q1, q2, tw, ti, quant="per_1x128", w1_scale=s1, w2_scale=s2)
    peer = gen2.VllmBlockFp8(q1, q2, s1, s2, tw, ti, vendor_dir=vendor, device_file_name="NVIDIA_H100_80GB_HBM3",
                             hopper=hopper)
    out = peer(h)
    assert peer.config_source == "vLLM default" and out.shape == (T, D)
    # each GEMM against torch on the same fp8 operands (bf16 output rounding only): checks every launch argument
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    wide = lambda s, rows, cols: s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]  # noqa: E731
    w1d, w2d = q1.float() * wide(s1, 2 * inter, D), q2.float() * wide(s2, D, inter)
    (xq, xs), (hq, hs) = peer.xq, peer.hq
    x = xq.float() * xs.repeat_interleave(128, 1)[:, :D]
    hd = (hq.float() * hs.repeat_interleave(128, 1)[:, :inter]).view(T, topk, inter)
    c1 = torch.einsum("td,tknd->tkn", x, w1d[ti.long()])
    c2 = torch.einsum("tki,tkdi->tkd", hd, w2d[ti.long()]) * tw[..., None]
    assert rel(peer._c1, c1) < 1e-2 and rel(peer._c2, c2) < 1e-2
    # end to end: the fp8 rounding of the intermediate flips a few values against the reference's own rounding
    assert rel(out, ref) < 5e-2
    first = peer._c2.clone()
    peer.kernels()
    assert torch.equal(peer._c2, first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check; the GPU runs the benchmark itself")
def test_main_runs_a_row_end_to_end_on_the_interpreter(monkeypatch, tmp_path, capsys):
    """Every line of main and run_point once (a tiny per_1x128 row: ours, a --variant, the tuned row's choice, the
    vLLM peer), the JSON and the table; the tuning subprocess is replaced by a tuned CSV written here."""
    from tritune.store.fmoe_csv import write_tuned
    from tritune.store.fmoe_rows import FmoeTuned

    vendor, shared = _peer_dirs()
    monkeypatch.setattr(sys, "path", [str(shared), *sys.path])  # main prepends its folders; undone after the test
    monkeypatch.setitem(gen2.SHAPES, "tiny", (128, 128, 4, 2))
    monkeypatch.delenv("TRITUNE_CONFIG_FMOE", raising=False)
    tuned_name = "moe_1stage_per_1x128_silu_BM16_BN64_BK128_GM1_W4_S3_KS1_BD128"
    row = FmoeTuned(0, gen2.tune_shape("tiny:3:per_1x128"), 16, 1, 1.0, tuned_name, 0.0, 0.0, "", 0.0, 1.0, True,
                    0.0, 0.0, (("device", "cpu-interpreter"),))
    write_tuned(tmp_path / "tuned.csv", [row])
    monkeypatch.setattr(gen2, "tune_row", lambda spec, out: {"row": spec, "wall_s": 1.5, "returncode": 0,
                                                               "tuned_csv": str(tmp_path / "tuned.csv")})
    gen2.main(["--vendor-dir", str(vendor), "--out", str(tmp_path / "gen2.json"), "--shapes", "", "--fp8-shapes",
               "tiny", "--tokens", "3", "--iters", "1", "--variant", "BLOCK_SIZE_N=64,NOT_A_FIELD_XYZ=1",
               "--tune-row", "tiny:3:per_1x128", "--rule-flag", "FP8_PAIR_AT_DECODE=0"])
    doc = json.loads((tmp_path / "gen2.json").read_text())
    (r,) = doc["rows"]
    assert doc["notes"] and doc["skipped"] == [] and doc["tune"]["wall_s"] == 1.5
    assert "TRITUNE_CONFIG_FMOE" not in os.environ  # the tuned row's CSV was read for its row alone
    assert (r["shape"], r["quant"], r["tokens"]) == ("tiny", "per_1x128", 3) and r["ours_source"] == "heuristic"
    assert r["tuned_source"].startswith("tuned") and r["vllm_config_source"] == "vLLM default"
    assert r["floor_us"] == gen2.floor_us(3, 128, 128, 2, r["routed_experts"], "per_1x128")
    for name in ("ours", "variant BLOCK_SIZE_N=64,NOT_A_FIELD_XYZ=1", "tuned", "vllm", "rule FP8_PAIR_AT_DECODE=0"):
        assert r[f"{name}_us"] > 0, r.get(f"{name}_error")
    assert r["ours_configs"][0].startswith("moe_stage1")  # 6 pairs of fp8: the stage pair; the flag off: 1-stage
    from tritune.ops import heuristics

    assert heuristics.FP8_PAIR_AT_DECODE is True  # the flag was put back
    assert r["vllm_rel_err"] < 5e-2  # the peer's fp8 path is right on the CPU too (ours reads bf16: see the GPU)
    out = capsys.readouterr().out
    assert "| tiny | per_1x128 | 3 |" in out and "tune time of tiny:3:per_1x128: 1.5 s" in out


def test_target_rows_written_for_tritune_moe_and_held_out_shapes_stay_the_default(tmp_path, capsys):
    from tritune.store.fmoe_csv import read_untuned

    assert gen2.parse_args([]).shapes == gen2.HELD_OUT and not set(gen2.HELD_OUT) & set(gen2.TARGET_SHAPES)
    out = tmp_path / "targets.csv"
    gen2.main(["--shapes", ",".join(gen2.TARGET_SHAPES), "--fp8-shapes", "", "--tokens",
               ",".join(map(str, gen2.TARGET_TOKENS)), "--write-untuned", str(out)])
    rows = read_untuned(out)
    assert len(rows) == 21 and f"wrote 21 untuned row(s) to {out}" in capsys.readouterr().out
    assert {(r.model_dim, r.inter_dim, r.expert, r.topk) for r in rows} == set(gen2.TARGET_SHAPES.values())
    assert {r.token for r in rows} == set(gen2.TARGET_TOKENS) and {r.q_type for r in rows} == {"none"}


def test_per_token_points_rows_and_their_speedup_over_bf16(tmp_path, capsys):
    """Issue 14's fp8 targets: per_token rows (no vLLM column) beside the bf16 rows, and our bf16 time over our fp8
    time at each point measured both ways (the tuned row's time where it is faster and right)."""
    from tritune.store.fmoe_csv import read_untuned

    args = gen2.parse_args(["--shapes", "mixtral-8x7b", "--fp8-shapes", "mixtral-8x7b", "--tokens", "1024",
                            "--fp8-quants", "per_token,per_1x128"])
    assert gen2.points(args) == [("mixtral-8x7b", "none", 1024), ("mixtral-8x7b", "per_token", 1024),
                                 ("mixtral-8x7b", "per_1x128", 1024)]
    with pytest.raises(SystemExit):
        gen2.parse_args(["--fp8-quants", "per_1x32"])
    assert "per_1x32" in capsys.readouterr().err
    rows = [{"shape": "s", "tokens": 1024, "quant": "none", "ours_us": 300.0},
            {"shape": "s", "tokens": 1024, "quant": "per_token", "ours_us": 200.0, "tuned_us": 150.0},
            {"shape": "s", "tokens": 1024, "quant": "per_1x128", "ours_us": 100.0, "ours_rel_err": 0.5},  # WRONG
            {"shape": "s", "tokens": 64, "quant": "per_token", "ours_us": 90.0}]  # no bf16 row there
    assert gen2.fp8_speedups(rows) == ["s 1024 tokens: per_token 2.00x faster than bf16 (150.0 vs 300.0 us)"]
    out = tmp_path / "rows.csv"
    gen2.main(["--shapes", "", "--fp8-shapes", "mixtral-8x7b", "--fp8-quants", "per_token", "--tokens", "1024",
               "--write-untuned", str(out)])
    (row,) = read_untuned(out)
    assert row.q_type == "per_token" and row.q_dtype_a == "fp8"


def test_a_per_token_row_runs_without_a_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(gen2.SHAPES, "tiny", (128, 128, 4, 2))
    monkeypatch.delenv("TRITUNE_CONFIG_FMOE", raising=False)
    gen2.main(["--out", str(tmp_path / "gen2.json"), "--shapes", "", "--fp8-shapes", "tiny", "--fp8-quants",
               "per_token", "--tokens", "3", "--iters", "1"])
    (r,) = json.loads((tmp_path / "gen2.json").read_text())["rows"]
    # (its error is not checked here: the benchmark's activations are bf16, whose tl.dot the interpreter gets wrong)
    assert (r["quant"], r["tokens"]) == ("per_token", 3) and r["ours_us"] > 0 and "ours_rel_err" in r
    assert r["vllm_error"].startswith("ValueError: no per_token peer")
    assert "| tiny | per_token | 3 |" in capsys.readouterr().out
