"""`tritune configs [--check] [DIR]`: every tuned file listed with its kind, provenance and whether this machine
would use it; exit 0 (all used as is), 1 (stale, skipped or malformed, with --check), 2 (bad usage)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_asserts import one_error_line

from tritune import knobs
from tritune.cli import main
from tritune.device import current_device
from tritune.kernels.grouped_gemm_config import KernelConfigForward
from tritune.store import gemm_json as gj
from tritune.store import grouped_gemm_json as ggj
from tritune.store.fmoe_csv import write_tuned
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.provenance import triton_minor
from tritune.store.user_json import UserEntry, UserKernelStore
from tritune.tuning.types import Config

SRC = Path(__file__).resolve().parent.parent / "src"
DEV = current_device()  # "cpu-interpreter" without a GPU
PROV = DEV.provenance()
SMS = "no GPU" if DEV.interpreter else f"{DEV.sm_count} SMs"  # how the listing names what the files record
OTHER = "NVIDIA H200 (test)"
OLD_TRITON = "2.0.0"  # never the running Triton
SHAPE = FmoeShape(token=16, model_dim=256, inter_dim=128, expert=8, topk=2, act_type="silu", dtype="bf16",
                  q_dtype_a="bf16", q_dtype_w="bf16", q_type="none", use_g1u1=True, doweight_stage1=False)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def gemm_file(folder: Path, prov: dict, N: int = 40, K: int = 48) -> Path:
    config = Config.of(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    entry = gj.GemmEntry(M=16, config=config, time_us=1.0, tflops=1.0, gbps=1.0, error=0.0)
    return gj.write_shape_file(folder, prov, "BF16", N, K, {16: entry}, device_slug=DEV.slug)


def fmoe_row(device: str, token: int = 16) -> FmoeTuned:
    return FmoeTuned(cu_num=DEV.cu_num, shape=SHAPE.with_token(token), block_m=16, ksplit=0, us1=1.0,
                     kernelName1="k1", err1=0.0, us2=0.0, kernelName2="", err2=0.0, us=1.0, run_1stage=True,
                     tflops=1.0, bw=1.0, extra=(("device", device), ("triton", DEV.triton_version),
                                                ("torch", DEV.torch_version)))


@pytest.fixture
def good_dir(tmp_path) -> Path:
    """One file of every kind, each written with this machine's provenance, and two files that are not tuned."""
    folder = tmp_path / "configs"
    folder.mkdir()
    gemm_file(folder, PROV)
    gj.write_default_file(folder, PROV, "BF16", device_slug=DEV.slug)
    write_tuned(folder / "tuned_fmoe.csv", [fmoe_row(DEV.name, 16), fmoe_row(DEV.name, 64)])
    fwd = KernelConfigForward(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, num_warps=4, num_stages=2)
    ggj.write_entries(ggj.store_path(folder, DEV.name), [ggj.GroupedGemmEntry(
        triton=DEV.triton_version, num_experts=8, n=256, k=128, topk=2, dtype="bf16", gemm="gate_up",
        kernel="forward", tokens=64, config=fwd.to_dict(), us=1.0, torch_us=2.0, baseline="torch", provenance=PROV)])
    UserKernelStore(folder / "user_kernels" / "axpy.json", "axpy").put([UserEntry(
        DEV.name, DEV.triton_version, {"n": 8}, "n=8", {"BLOCK": 64}, 1.0, "2025-01-01T00:00:00+00:00",
        provenance=PROV)])
    (folder / "untuned_fmoe.csv").write_text("token,model_dim\n1,2\n")  # an input, not a tuned file
    (folder / "notes.json").write_text('{"hello": 1}')
    return folder


def test_every_kind_with_this_machines_provenance_is_used(good_dir, capsys):
    assert run_cli(["configs", "--check", str(good_dir)]) == 0
    out = capsys.readouterr().out
    triton = triton_minor(DEV.triton_version)
    assert out.splitlines()[0] == f"this machine: {DEV.name} ({SMS}, Triton {triton})"
    tuned_on = f"tuned on {DEV.name}, {SMS}, Triton {DEV.triton_version}, torch {DEV.torch_version}"
    kinds = ("gemm shape", "gemm default", "fused-moe csv, 2 rows", "grouped-gemm, 1 entry", "user kernel, 1 entry")
    for kind in kinds:
        assert f"    {kind}: {tuned_on} -> used\n" in out
    assert str(good_dir / "user_kernels" / "axpy.json") in out
    assert "untuned_fmoe.csv" not in out and "notes.json" not in out
    assert out.splitlines()[-1] == "5 file(s), 5 item(s): 5 used as is, 0 used with a warning, 0 skipped, 0 malformed"


def test_stale_triton_is_used_but_fails_the_check(good_dir, capsys):
    path = gemm_file(good_dir, {**PROV, "triton_version": OLD_TRITON}, N=64)
    assert run_cli(["configs", str(good_dir)]) == 0  # without --check: a listing, exit 0
    assert run_cli(["configs", "--check", str(good_dir)]) == 1
    out = capsys.readouterr().out
    status = f"used (Triton 2.0 != {triton_minor(DEV.triton_version)})"
    assert f"{path}\n    gemm shape: tuned on {DEV.name}, {SMS}, Triton 2.0.0" in out
    assert out.count(f"-> {status}\n") == 2  # once per run
    assert out.splitlines()[-1].endswith("5 used as is, 1 used with a warning, 0 skipped, 0 malformed")


def test_files_of_another_device_are_skipped(good_dir, capsys):
    path = gemm_file(good_dir, {**PROV, "name": OTHER}, N=64)
    write_tuned(good_dir / "tuned_fmoe.csv", [fmoe_row(DEV.name, 16), fmoe_row(OTHER, 32), fmoe_row(DEV.name, 64)])
    assert run_cli(["configs", "--check", str(good_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{path}\n    gemm shape: tuned on {OTHER}, " in out
    assert f"-> skipped: tuned on {OTHER}, this is {DEV.name}\n" in out
    # The CSV: one item per (device, SMs, Triton, torch) group of rows, with its count.
    assert f"    fused-moe csv, 2 rows: tuned on {DEV.name}, {SMS}" in out
    assert f"    fused-moe csv, 1 row: tuned on {OTHER}, {SMS}" in out
    assert out.count(f"skipped: tuned on {OTHER}, this is {DEV.name}") == 2


def test_malformed_files_are_listed_as_malformed(good_dir, capsys):
    (good_dir / f"{DEV.slug}-GEMM-BF16-N=8-K=8.json").write_text("{broken")
    (good_dir / "more_tuned_fmoe.csv").write_text("cu_num,token\n132,16\n")
    assert run_cli(["configs", "--check", str(good_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    bad_json = lines.index(str(good_dir / f"{DEV.slug}-GEMM-BF16-N=8-K=8.json"))
    assert lines[bad_json + 1].startswith("    gemm shape -> malformed: not valid JSON")
    bad_csv = lines.index(str(good_dir / "more_tuned_fmoe.csv"))
    assert lines[bad_csv + 1].startswith("    fused-moe csv -> malformed: missing required column(s): model_dim")
    assert lines[-1].endswith("0 skipped, 2 malformed")


def test_empty_folder_exits_0(tmp_path, capsys):
    assert run_cli(["configs", "--check", str(tmp_path)]) == 0
    assert "no tuned config files found" in capsys.readouterr().out


@pytest.mark.parametrize("make, why", [
    (lambda p: None, "does not exist"),  # a typo
    (lambda p: p.write_text("x"), "is not a folder"),  # a file
])
def test_bad_dir_is_one_error_line(tmp_path, capsys, make, why):
    target = tmp_path / "configs"
    make(target)
    assert run_cli(["configs", "--check", str(target)]) == 2
    assert one_error_line(capsys) == f"tritune: error: {target} {why}"


def test_defaults_list_the_shipped_files_honestly(monkeypatch, capsys):
    monkeypatch.delenv(knobs.CONFIG_DIR, raising=False)
    monkeypatch.delenv(knobs.CONFIG_FMOE, raising=False)
    code = run_cli(["configs", "--check"])
    out = capsys.readouterr().out
    shipped = sorted(gj.PACKAGE_DIR.glob("*.json"))
    assert shipped and all(f"{path}\n    gemm " in out for path in shipped)
    assert str(ggj.PACKAGE_DIR) in out and "tuned_fmoe.csv" in out
    if DEV.interpreter:  # the shipped files are H100's: skipped here, and the report says why
        assert code == 1
        assert "no GPU: Triton's interpreter stands in" in out.splitlines()[1]
        assert out.count("-> skipped: tuned on NVIDIA H100 80GB HBM3, this is cpu-interpreter\n") == len(shipped) + 2


def test_defaults_read_the_knobs(good_dir, monkeypatch, capsys):
    monkeypatch.setenv(knobs.CONFIG_DIR, str(good_dir))
    monkeypatch.setenv(knobs.CONFIG_FMOE, str(good_dir / "tuned_fmoe.csv"))
    run_cli(["configs"])
    out = capsys.readouterr().out
    assert f"searched: {knobs.CONFIG_DIR}={good_dir}" in out
    assert out.splitlines().count(str(good_dir / "tuned_fmoe.csv")) == 1  # read through TRITUNE_CONFIG_FMOE, once
    assert f"{good_dir / 'user_kernels' / 'axpy.json'}\n    user kernel, 1 entry" in out
    monkeypatch.setenv(knobs.CONFIG_FMOE, str(good_dir / "missing.csv"))
    assert run_cli(["configs", "--check"]) == 2
    assert "missing.csv" in one_error_line(capsys)


def test_subprocess_exit_codes(good_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "tritune.cli", "configs", "--check"]
    assert subprocess.run([*cmd, str(good_dir)], capture_output=True, text=True).returncode == 0
    gemm_file(good_dir, {**PROV, "name": OTHER}, N=64)
    assert subprocess.run([*cmd, str(good_dir)], capture_output=True, text=True).returncode == 1
    missing = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr == f"tritune: error: {tmp_path / 'nope'} does not exist\n"
