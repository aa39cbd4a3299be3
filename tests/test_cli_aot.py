"""`tritune aot build | run | import` in-process: every bad request is exit 2 and one stderr line, caught before
anything is compiled, and an existing bundle folder is left byte-for-byte as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_asserts import one_error_line
from test_aot_import import DEVICE, moe_bundle, moe_id

from tritune.cli import main
from tritune.store.fmoe_csv import read_tuned

USER_KERNEL = str(Path(__file__).resolve().parent / "user_kernels_for_tests.py") + ":axpy"
GEMM = ["--kernel", "gemm", "--m", "64", "--n", "64", "--k", "64"]


def run_cli(argv: list[str]) -> int:
    """main() returns its code; argparse-level errors raise SystemExit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes), hidden ones included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -------------------------------------------------------------------------------------------------- aot build

@pytest.mark.parametrize(("flags", "expected"), [
    ([*GEMM, "--target", "sm_90"], ["target 'sm_90'", "cuda:90"]),  # nvcc's spelling, not ours
    ([*GEMM, "--target", "hip:gfx942"], ["target 'hip:gfx942'"]),  # another backend
    (["--kernel", "nonsense"], ["--kernel 'nonsense'", "fused_moe", "module:attribute"]),  # no such kernel
    (["--kernel", USER_KERNEL], ["a user kernel needs --problem"]),  # user kernel, no problem dict
    (["--kernel", USER_KERNEL, "--problem", "{n: 1}"], ["--problem is not JSON", "column 2"]),
    (["--kernel", USER_KERNEL, "--problem", "[1, 2]"], ["--problem must be a JSON object"]),
    (["--kernel", "fused_moe", "--moe-kernels", "stage1,stage3"], ["--moe-kernels 'stage1,stage3'"]),
])
def test_build_bad_request_is_one_line(flags, expected, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert run_cli(["aot", "build", *flags, "-o", str(out)]) == 2
    line = one_error_line(capsys)
    for text in expected:
        assert text in line
    assert list(tmp_path.iterdir()) == []  # no bundle, no staging folder


def test_build_configs_not_json_names_file_line_and_column(tmp_path, capsys):
    configs = tmp_path / "configs.json"
    configs.write_text('[\n  {"BLOCK_SIZE_M": 64,}\n]\n')  # trailing comma on line 2
    assert run_cli(["aot", "build", *GEMM, "--configs", str(configs), "-o", str(tmp_path / "bundle")]) == 2
    line = one_error_line(capsys)
    assert f"--configs {configs}: not JSON (" in line
    assert "at line 2 column 23)" in line
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize(("content", "expected"), [
    (None, "no such file"),  # the file is not there
    ("folder", "cannot read (Is a directory)"),  # a folder: one line, not a traceback
    (b"\xff\xfe[]", "not UTF-8 text (invalid start byte at byte 0)"),  # UTF-16 BOM
    ("[]", "expected a non-empty JSON list of {param: value} objects"),  # empty list
    ('{"BLOCK_SIZE_M": 64}', "expected a non-empty JSON list"),  # one object, not a list (gemm takes a list)
])
def test_build_configs_bad_content(tmp_path, capsys, content, expected):
    configs = tmp_path / "configs.json"
    if content == "folder":
        configs.mkdir()
    elif isinstance(content, bytes):
        configs.write_bytes(content)
    elif content is not None:
        configs.write_text(content)
    assert run_cli(["aot", "build", *GEMM, "--configs", str(configs), "-o", str(tmp_path / "bundle")]) == 2
    line = one_error_line(capsys)
    assert f"--configs {configs}" in line and expected in line


def test_build_refuses_existing_folder_without_force(tmp_path, capsys):
    out = tmp_path / "bundle"
    (out / "bin").mkdir(parents=True)
    (out / "manifest.json").write_bytes(b'{"an earlier": "bundle"}\n')
    (out / "bin" / "k_BM64").write_bytes(b"\x7fELF\x00\x01 not really")
    (out / ".hidden").write_bytes(b"")
    before = snapshot(out)
    assert run_cli(["aot", "build", *GEMM, "-o", str(out)]) == 2
    line = one_error_line(capsys)
    assert f"{out} exists and is not empty; choose a new folder or pass --force" in line
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no staging folder left behind


def test_build_refuses_a_file_as_output(tmp_path, capsys):
    out = tmp_path / "bundle"
    out.write_bytes(b"not a folder")
    assert run_cli(["aot", "build", *GEMM, "-o", str(out)]) == 2
    assert f"cannot write the output folder {out}: it is a file" in one_error_line(capsys)
    assert out.read_bytes() == b"not a folder"


# ---------------------------------------------------------------------------------------------------- aot run

def test_run_without_manifest(tmp_path, capsys):
    (tmp_path / "perf_stats.csv").write_text("")
    assert run_cli(["aot", "run", str(tmp_path), "--no-progress"]) == 2
    assert one_error_line(capsys) == f"tritune: error: {tmp_path} is not a bundle (no manifest.json)"
    assert (tmp_path / "perf_stats.csv").read_text() == ""


# ------------------------------------------------------------------------------------------------- aot import

def test_import_without_perf_stats_names_the_file(tmp_path, capsys):
    bundle = moe_bundle(tmp_path / "bundle")
    (bundle / "perf_stats.csv").unlink()
    out = tmp_path / "tuned"
    assert run_cli(["aot", "import", str(bundle), "-o", str(out)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"tritune: error: {bundle / 'perf_stats.csv'} is missing")
    assert not out.exists()


def test_import_without_manifest(tmp_path, capsys):
    assert run_cli(["aot", "import", str(tmp_path), "-o", str(tmp_path / "tuned")]) == 2
    assert f"{tmp_path / 'manifest.json'}: no such file" in one_error_line(capsys)


def test_import_without_device_needs_both_flags(tmp_path, capsys):
    bundle = moe_bundle(tmp_path / "bundle", device=None)
    out = tmp_path / "tuned"
    assert run_cli(["aot", "import", str(bundle), "-o", str(out), "--device-name", "NVIDIA H100"]) == 2
    assert "pass --device-name and --cu-num" in one_error_line(capsys)
    assert run_cli(["aot", "import", str(bundle), "-o", str(out), "--device-name", "NVIDIA H100",
                    "--cu-num", "132"]) == 0
    assert read_tuned(out / "tuned_fmoe.csv")[0].cu_num == 132


def test_import_prints_what_went_where(tmp_path, capsys):
    bundle = moe_bundle(tmp_path / "bundle")
    out = tmp_path / "tuned"
    assert run_cli(["aot", "import", str(bundle), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    [line] = captured.out.splitlines()
    assert line.startswith("fused MoE token=1024,") and line.endswith(f"-> {out / 'tuned_fmoe.csv'}")
    [tuned] = read_tuned(out / "tuned_fmoe.csv")
    assert (tuned.kernelName1, tuned.cu_num) == (moe_id("stage1", 32), DEVICE["sm_count"])
