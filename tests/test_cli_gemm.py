"""`tritune gemm` and `tritune device`: bad input is one stderr line and leaves -o alone; a tiny run writes files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from cli_asserts import one_error_line

from tritune.cli import main
from tritune.device import current_device
from tritune.tuners.gemm import INTERPRETER_SPACE

SRC = Path(__file__).resolve().parent.parent / "src"
SLUG = current_device().slug  # "cpu_interpreter" without a GPU
SHAPE_FILE = f"{SLUG}-GEMM-BF16-N=40-K=48.json"
DEFAULT_FILE = f"{SLUG}-GEMM-BF16.json"
SENTINEL = b'{"sentinel": "results of an earlier run", "bytes": [1, 2, 3]}\n'
GOOD = ["--n", "40", "--k", "48", "--m", "1,17"]  # N, K not multiples of the 32-wide blocks: masked edges


@pytest.fixture(autouse=True)
def _src_importable(monkeypatch):
    # The subprocess runs `python -m tritune.cli` from this checkout, whatever the pytest import mode.
    paths = [str(SRC), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


@pytest.fixture
def small_space(tmp_path) -> Path:
    """INTERPRETER_SPACE as a --search-space file: BLOCK_SIZE_M in (16, 32) x NUM_KSPLIT in (1, 2)."""
    path = tmp_path / "space.json"
    path.write_text(json.dumps({k: list(v) for k, v in INTERPRETER_SPACE.items()}))
    return path


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """An -o folder already holding a results file from an earlier run."""
    out = tmp_path / "out"
    out.mkdir()
    (out / SHAPE_FILE).write_bytes(SENTINEL)
    return out


def run_cli(argv: list[str]) -> int:
    """main() returns its code; argparse-level errors raise SystemExit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def assert_untouched(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == [SHAPE_FILE]  # no journal, no lock, no default file
    assert (out / SHAPE_FILE).read_bytes() == SENTINEL


@pytest.mark.parametrize(("flags", "expected"), [
    (["--kernel", "fp4", *GOOD], ["unknown kernel 'fp4'", "bf16"]),  # names the bad value and the choices
    (["--kernel", "bf16", "--n", "40", "--k", "48", "--m", "16,,32"], ["malformed M list", "'16,,32'"]),  # empty
    (["--kernel", "bf16", "--n", "40", "--k", "48", "--m", "16,x"], ["'x'", "'16,x'"]),  # non-numeric item
    (["--kernel", "bf16", "--n", "40", "--k", "48", "--m", "0"], ["'0'", "positive"]),  # M below 1
    (["--kernel", "bf16", "--k", "48", "--m", "1,17"], ["--n"]),  # missing --n
    (["--kernel", "bf16", "--n", "forty", "--k", "48", "--m", "1"], ["--n", "'forty'"]),  # argparse type error
    (["--kernel", "bf16", *GOOD, "--objective", "gpu"], ["--objective", "invalid choice: 'gpu'", "eager"]),
    (["--kernel", "bf16", *GOOD, "--finalists", "two"], ["--finalists", "'two'"]),
    (["--kernel", "bf16", *GOOD, "--out-dtype", "fp32"], ["--out-dtype", "invalid choice: 'fp32'", "fp16"]),
])
def test_bad_flags_fail_on_one_line(flags, expected, out_dir, capsys):
    assert run_cli(["gemm", *flags, "-o", str(out_dir), "--no-progress"]) == 2
    line = one_error_line(capsys)
    for text in expected:
        assert text in line
    assert_untouched(out_dir)


@pytest.mark.parametrize(("content", "expected"), [
    (None, ["cannot read search-space file"]),  # no such file
    ('{"BLOCK_SIZE_M": [16, 32],,}', ["not valid JSON", "line 1, column 27"]),  # the second comma, located
    ('{"BLOCK_SIZE_Q": [16]}', ["unknown search-space parameter", "'BLOCK_SIZE_Q'"]),  # typo in a name
    ('{"BLOCK_SIZE_M": []}', ["'BLOCK_SIZE_M'", "non-empty list"]),  # no values
])
def test_bad_search_space_file_fails_on_one_line(content, expected, tmp_path, out_dir, capsys):
    space = tmp_path / "space.json"
    if content is not None:
        space.write_text(content)
    code = run_cli(["gemm", "--kernel", "bf16", *GOOD, "-o", str(out_dir), "--search-space", str(space),
                    "--no-progress"])
    assert code == 2
    line = one_error_line(capsys)
    for text in expected:
        assert text in line
    if content is None or "not valid" in expected[0]:
        assert str(space) in line
    assert_untouched(out_dir)


def test_unknown_search_space_parameter_names_the_file(tmp_path, out_dir, capsys):
    space = tmp_path / "space.json"
    space.write_text('{"BLOCK_SIZE_Q": [16]}')
    run_cli(["gemm", "--kernel", "bf16", *GOOD, "-o", str(out_dir), "--search-space", str(space), "--no-progress"])
    assert str(space) in one_error_line(capsys)


@pytest.mark.parametrize(("rows", "expected"), [
    (['"1,17",40,48', '"16",forty,48'], ["row 3, column N", "'forty'"]),  # bad N on the last row
    (['"1,17",40,48', '"16,x",40,48'], ["row 3, column M", "'x'"]),  # bad item inside the quoted M list
    (['"1,17",40,0'], ["row 2, column K", "'0'"]),  # K below 1
    (['"1,17",40'], ["row 2", "expected 3 columns"]),  # a column short
    (None, ["cannot read shapes file"]),  # no such file
])
def test_bad_shapes_file_row_fails_on_one_line(rows, expected, tmp_path, out_dir, capsys):
    shapes = tmp_path / "shapes.csv"
    if rows is not None:
        shapes.write_text("\n".join(["M,N,K", *rows]) + "\n")
    assert run_cli(["gemm", "--kernel", "bf16", "--shapes", str(shapes), "-o", str(out_dir), "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert str(shapes) in line
    for text in expected:
        assert text in line
    assert_untouched(out_dir)


def test_shapes_file_row_number_is_the_line_number(tmp_path, out_dir, capsys):
    shapes = tmp_path / "shapes.csv"
    shapes.write_text('# tuned for model X\nM,N,K\n\n"1,17",40,forty\n')  # the bad value is on line 4
    assert run_cli(["gemm", "--kernel", "bf16", "--shapes", str(shapes), "-o", str(out_dir), "--no-progress"]) == 2
    assert "row 4, column K" in one_error_line(capsys)


@pytest.mark.parametrize("how", ["--m", "--shapes"])
def test_superscript_digit_is_named_like_any_bad_value(how, tmp_path, out_dir, capsys):
    shapes = tmp_path / "shapes.csv"
    shapes.write_text('M,N,K\n"1",40,4\u00b2\n')
    flags = ["--n", "40", "--k", "48", "--m", "1,\u00b2"] if how == "--m" else ["--shapes", str(shapes)]
    assert run_cli(["gemm", "--kernel", "bf16", *flags, "-o", str(out_dir), "--no-progress"]) == 2
    assert ("--m" if how == "--m" else "row 2, column K") in one_error_line(capsys)


def test_malformed_results_file_in_output_folder_is_one_error_line(out_dir, small_space, capsys):
    code = run_cli(["gemm", "--kernel", "bf16", "--dtype", "fp16", *GOOD, "-o", str(out_dir), "--search-space",
                    str(small_space), "--iters", "2", "--warmup", "1", "--no-progress"])
    assert code == 2
    assert str(out_dir / SHAPE_FILE) in one_error_line(capsys)
    assert (out_dir / SHAPE_FILE).read_bytes() == SENTINEL


def test_subprocess_exit_code_and_single_stderr_line(tmp_path, out_dir):
    # Goes as far as building the tunable (imports torch, triton, the kernels): nothing else may reach stderr.
    space = tmp_path / "space.json"
    space.write_text('{"BLOCK_SIZE_Q": [16]}')
    proc = subprocess.run(
        [sys.executable, "-m", "tritune.cli", "gemm", "--kernel", "bf16", *GOOD, "-o", str(out_dir),
         "--search-space", str(space), "--no-progress"],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("tritune: error: ") and "'BLOCK_SIZE_Q'" in proc.stderr
    assert_untouched(out_dir)


def test_tiny_run_writes_shape_and_default_files(tmp_path, small_space, capsys):
    out = tmp_path / "out"
    code = main(["gemm", "--kernel", "bf16", "--dtype", "fp16", *GOOD, "-o", str(out), "--search-space",
                 str(small_space), "--iters", "2", "--warmup", "1", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"wrote {out / SHAPE_FILE}" in captured.out and f"wrote {out / DEFAULT_FILE}" in captured.out
    shape = json.loads((out / SHAPE_FILE).read_text())
    default = json.loads((out / DEFAULT_FILE).read_text())
    for doc in (shape, default):
        assert set(doc) == {"small", "any", "tritune"}  # M=1 and M=17 are both "small"
        assert (doc["tritune"]["kernel"], doc["tritune"]["out_dtype"]) == ("BF16", "bf16")
        assert doc["tritune"]["provenance"]["triton_version"] == triton.__version__
    shape, default = shape["tritune"], default["tritune"]
    assert (shape["N"], shape["K"], sorted(shape["by_M"])) == (40, 48, ["1", "17"])
    assert shape["by_M"]["1"]["config"]["BLOCK_SIZE_M"] == 16  # 32 is pruned for M=1
    assert default["from_shapes"] == [{"N": 40, "K": 48}]
    for entry in shape["by_M"].values():  # each winner also timed as the op runs: eager and (on the CPU) eager again
        assert entry["time_us"] > 0 and entry["eager_us"] > 0 and entry["graph_us"] > 0
    assert "eager us" in captured.out and "graph us" in captured.out


def test_out_dtype_fp16_run_writes_its_own_files(tmp_path, small_space, capsys):
    out = tmp_path / "out"
    code = main(["gemm", "--kernel", "bf16", "--dtype", "fp16", "--out-dtype", "fp16", "--n", "40", "--k", "48",
                 "--m", "17", "-o", str(out), "--search-space", str(small_space), "--iters", "2", "--warmup", "1",
                 "--finalists", "0", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    shape_file, default_file = f"{SLUG}-GEMM-BF16-OUT_FP16-N=40-K=48.json", f"{SLUG}-GEMM-BF16-OUT_FP16.json"
    assert {p.name for p in out.glob("*.json")} == {shape_file, default_file}  # the bf16-output names untouched
    for name in (shape_file, default_file):
        meta = json.loads((out / name).read_text())["tritune"]
        assert (meta["kernel"], meta["out_dtype"]) == ("BF16", "fp16")
    assert "gemm:bf16:fp16:out=fp16:M=17:N=40:K=48" in captured.out  # the problem key carries it too


@pytest.mark.parametrize(("flags", "objective", "finalists"), [
    ([], "auto", 5),  # the defaults
    (["--objective", "graph", "--finalists", "2"], "graph", 2),
    (["--finalists", "0"], "auto", 0),  # GPU time alone picks
])
def test_objective_and_finalists_reach_the_settings(flags, objective, finalists, tmp_path, monkeypatch):
    import tritune.tuners.gemm as gemm_tuner

    seen = {}

    def fake_tune_gemm(req, device, settings, tunable=None):
        seen["settings"] = settings
        raise KeyboardInterrupt  # stop before any work: main() turns this into exit 2

    monkeypatch.setattr(gemm_tuner, "tune_gemm", fake_tune_gemm)
    # fp16 operands: without a GPU, bf16 ones are refused before tune_gemm (the interpreter's bf16 tl.dot is wrong)
    argv = ["gemm", "--kernel", "bf16", "--dtype", "fp16", *GOOD, "-o", str(tmp_path / "out"), "--no-progress"]
    assert main([*argv, *flags]) == 2
    assert seen["settings"].objective == objective and seen["settings"].finalists == finalists


def test_device_prints_name_and_triton_version(capsys):
    assert main(["device"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"name: {current_device().name}" in lines
    assert f"triton_version: {triton.__version__}" in lines
