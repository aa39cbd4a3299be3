"""`tritune grouped-gemm`: a tiny fp16 run through Triton's interpreter writes the CSV and the store file that
GroupedGemmStore then serves; bad input is one stderr line, exit 2, and no file written.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import triton
from cli_asserts import one_error_line

from tritune.cli import main
from tritune.device import current_device
from tritune.store.grouped_gemm_json import GroupedGemmStore, read_entries, store_path
from tritune.tuners.grouped_gemm import CSV_COLUMNS, MODEL_PRESETS, preset_shape

DEV = current_device()
# 5 experts (prime), 7 tokens top-2 (14 pairs); H=40, I=24 do not divide the 32-wide blocks (masked edges).
SHAPE = ["--num-experts", "5", "--hidden-size", "40", "--intermediate-size", "24", "--topk", "2", "--seqlen", "7",
         "--dtype", "fp16"]
ENGINE = ["--iters", "1", "--warmup", "0", "--no-progress", "--compile-workers", "1"]
DIMS = {("gate_up", k): (48, 40) for k in ("forward", "dX", "dW")} | {("down", k): (40, 24)
                                                                      for k in ("forward", "dX", "dW")}


def run_cli(argv: list[str]) -> int:
    """main() returns its code; argparse-level errors raise SystemExit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def lookup(s: GroupedGemmStore, gemm: str, kernel: str, tokens: int = 7, num_experts: int = 5):
    n, k = DIMS[(gemm, kernel)]
    return s.lookup(DEV.name, triton.__version__, num_experts, n, k, 2, "fp16", gemm, kernel, tokens)


@pytest.fixture
def space(tmp_path) -> Path:
    """One tile: each kernel's candidates are fuse_permute True and False."""
    path = tmp_path / "space.json"
    path.write_text(json.dumps({"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32], "BLOCK_SIZE_K": [32]}))
    return path


def test_tiny_run_writes_csv_and_store_that_lookup_serves(tmp_path, space, capsys):
    out, configs = tmp_path / "out" / "results.csv", tmp_path / "configs"
    code = main(["grouped-gemm", *SHAPE, "-o", str(out), "--config-dir", str(configs), "--search-space", str(space),
                 "--top-n", "1", *ENGINE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "correctness only" in captured.out and f"wrote {out}" in captured.out
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 12 and {(r["gemm"], r["kernel"]) for r in rows} == set(DIMS)  # 6 kernels x fuse T/F
    entries = read_entries(store_path(configs, DEV.name))
    assert len(entries) == 6 and {e.tokens for e in entries} == {7}
    s = GroupedGemmStore([configs])
    for e in entries:
        times = [float(r["triton_time"]) for r in rows if (r["gemm"], r["kernel"]) == (e.gemm, e.kernel)]
        # The objective (auto by default: eager without a GPU) picks among the finalists, both candidates here; the
        # store keeps the winner's GPU time, as the CSV does.
        assert any(e.us == pytest.approx(t) for t in times) and e.provenance["name"] == DEV.name
        assert e.baseline == "torch loop over experts + torch permute" and e.torch_us > 0
        config, where = lookup(s, e.gemm, e.kernel)
        assert config == e.config and "tokens=7" in where
    assert lookup(s, "down", "dW", num_experts=6) is None  # another shape
    near = lookup(s, "gate_up", "dX", tokens=28)  # 4x the tuned 7 tokens
    assert near[0] == lookup(s, "gate_up", "dX")[0] and "nearest tuned to 28" in near[1]
    assert lookup(s, "gate_up", "dX", tokens=2) is not None  # 3.5x below
    assert lookup(s, "gate_up", "dX", tokens=29) is None and lookup(s, "gate_up", "dX", tokens=1) is None


def test_presets_and_overrides():
    shape = preset_shape("mixtral-8x7b", num_experts=None, hidden_size=None, intermediate_size=1024, topk=None,
                         seqlen=64, dtype="bf16", skew=0.0)
    assert (shape.num_experts, shape.topk, shape.hidden_size, shape.intermediate_size) == (8, 2, 4096, 1024)
    assert MODEL_PRESETS["qwen3-30b-a3b"] == (128, 8, 2048, 768)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--model", "llama-moe"], ["--model", "'llama-moe'"]),  # unknown preset
    (["--num-experts", "5", "--intermediate-size", "24", "--topk", "2"], ["--hidden-size"]),  # missing dimension
    (["--model", "qwen3-30b-a3b", "--topk", "200"], ["--topk 200", "--num-experts 128"]),  # override beyond preset
    ([*SHAPE, "--gemms", "gate_up,up"], ["--gemms", "'up'"]),
    ([*SHAPE, "--kernels", "forward,dY"], ["--kernels", "'dY'"]),
    ([*SHAPE, "--dtype", "fp8"], ["--dtype", "'fp8'"]),
    ([*SHAPE, "--seqlen", "0"], ["--seqlen", "'0'"]),
    ([*SHAPE, "--skew", "-1"], ["--skew", "-1"]),
    ([*SHAPE, "--routing", "uniform", "--skew", "1.5"], ["--skew 1.5", "--routing zipf"]),
    ([*SHAPE, "--routing", "pareto"], ["--routing", "'pareto'"]),
    ([*SHAPE, "--top-n", "x"], ["--top-n", "'x'"]),
])
def test_bad_flags_fail_on_one_line_and_write_nothing(flags, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the defaults (results.csv, tritune-out/configs) land here if anything is written
    assert run_cli(["grouped-gemm", *flags, *ENGINE]) == 2
    line = one_error_line(capsys)
    for text in expected:
        assert text in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("content", "expected"), [
    ('{"BLOCK_SIZE_Q": [16]}', "'BLOCK_SIZE_Q'"),  # typo in a name
    ('{"BLOCK_SIZE_M": [16],,}', "not valid JSON"),
    (None, "cannot read search-space file"),
])
def test_bad_search_space_names_the_file(content, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "space.json"
    if content is not None:
        path.write_text(content)
    assert run_cli(["grouped-gemm", *SHAPE, "--search-space", str(path), *ENGINE]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and expected in line
    assert [p.name for p in tmp_path.iterdir()] == (["space.json"] if content is not None else [])


def test_malformed_store_file_is_one_line_and_left_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    configs = tmp_path / "configs"
    configs.mkdir()
    path = store_path(configs, DEV.name)
    path.write_text('{"device": "x", "entries": [{}]}')
    assert run_cli(["grouped-gemm", *SHAPE, "--config-dir", str(configs), *ENGINE]) == 2
    assert str(path) in one_error_line(capsys)
    assert path.read_text() == '{"device": "x", "entries": [{}]}' and sorted(tmp_path.iterdir()) == [configs]


def test_output_folder_and_missing_config_dir_env_are_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert run_cli(["grouped-gemm", *SHAPE, "-o", "out", *ENGINE]) == 2
    assert "cannot write the output file out: it is a folder" in one_error_line(capsys)
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "nowhere"))
    assert run_cli(["grouped-gemm", *SHAPE, *ENGINE]) == 2
    assert "TRITUNE_CONFIG_DIR" in one_error_line(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())
