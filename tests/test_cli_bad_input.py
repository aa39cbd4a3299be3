"""Bad input to every tuner is one stderr line and exit 2 before any work: search-space values, output paths that
cannot be written, inputs without rows, shapes far beyond what the interpreter finishes; and a problem with no
winner is reported with one cause, the same on stdout and stderr (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_asserts import one_error_line

from tritune.cli import main
from tritune.device import DeviceInfo, versions
from tritune.store.fmoe_rows import UNTUNED_COLUMNS, FmoeShape
from tritune.tuners import fused_moe as fmoe_tuner
from tritune.tuners import gemm as gemm_tuner
from tritune.tuners import grouped_gemm as gg_tuner

ENGINE = ["--iters", "1", "--warmup", "0", "--no-progress", "--compile-workers", "1"]
GEMM = ["gemm", "--kernel", "bf16", "--dtype", "fp16", "--n", "40", "--k", "48", "--m", "1,17"]
# token 3 top-2 of 3 experts: 6 pairs (the tiny row of test_cli_moe).
ROW = "3,64,48,3,2,ActivationType.Silu,torch.float16,torch.float16,torch.float16,QuantType.No,True,False"
GROUPED = ["grouped-gemm", "--num-experts", "5", "--hidden-size", "40", "--intermediate-size", "24", "--topk", "2",
           "--seqlen", "7", "--dtype", "fp16", "--gemms", "gate_up", "--kernels", "forward"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
# The stand-in current_device() makes without a GPU, built here so the cost checks are tested on a GPU too.
INTERP = DeviceInfo(name="cpu-interpreter", sm_count=132, capability=(9, 0), max_shared_mem=232448,
                    regs_per_block=65536, l2_bytes=50 * 2**20, warp_size=32, interpreter=True, **versions())


def run_cli(argv: list[str]) -> int:
    """main() returns its code; argparse-level errors raise SystemExit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def moe_input(folder: Path, *rows: str) -> Path:
    path = folder / "untuned.csv"
    path.write_text("\n".join([",".join(UNTUNED_COLUMNS), *rows]) + "\n")
    return path


def space(folder: Path, content: dict | str) -> Path:
    path = folder / "space.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---- 1. search-space files --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "content", "expected"), [
    ("gemm", {"BLOCK_SIZE_M": [0]}, "BLOCK_SIZE_M value 0 must be a power of two >= 16"),  # was a ZeroDivisionError
    ("gemm", {"BLOCK_SIZE_N": [16, 40]},  # neither a power of two nor the sum of two >= 16 (48 = 32 + 16 is)
     "BLOCK_SIZE_N value 40 must be a power of two >= 16 or the sum of two (192 = 128 + 64)"),
    ("gemm", {"BLOCK_SIZE_N": [224]}, "BLOCK_SIZE_N value 224 must be a power of two >= 16 or the sum of two"),
    ("gemm", {"num_warps": [6]}, "num_warps value 6 must be a power of two >= 1"),
    ("gemm", {"NUM_KSPLIT": [-2]}, "NUM_KSPLIT value -2 must be an integer >= 1"),  # any integer >= 1, 3 is fine
    ("gemm", {"num_stages": [2.5]}, "num_stages value 2.5 must be an integer >= 1"),
    ("gemm", {"GROUP_SIZE_M": [True]}, "GROUP_SIZE_M value true must be an integer >= 1"),  # a bool is no count
    ("gemm", {"cache_modifier": [".cs"]}, 'cache_modifier value ".cs" must be one of "", ".cg"'),  # enum
    ("gemm", {"PERSISTENT_TMA": [1]}, "PERSISTENT_TMA value 1 must be one of false, true"),
    ("gemm", {"BLOCK_SIZE_D": [32]}, "unknown search-space parameter(s) ['BLOCK_SIZE_D']"),  # another kernel's
    ("moe", {"BLOCK_SIZE_M": [0]}, "BLOCK_SIZE_M value 0 must be a power of two >= 16"),
    ("moe", {"BLOCK_SIZE_D": [24]}, "BLOCK_SIZE_D value 24 must be a power of two >= 16"),  # 1-stage only
    ("moe", {"USE_TMA": [True]}, "USE_TMA value true must be one of 0, 1"),  # stage spaces only
    ("moe", {"NUM_KSPLIT": [1]}, "unknown search-space parameter(s) ['NUM_KSPLIT']"),  # the GEMM's name
    ("grouped", {"BLOCK_SIZE_K": [0]}, "BLOCK_SIZE_K value 0 must be a power of two >= 16"),
    ("grouped", {"fuse_permute": ["yes"]}, 'fuse_permute value "yes" must be one of false, true'),
])
def test_search_space_values_are_checked_before_any_work(command, content, expected, tmp_path, capsys):
    path = space(tmp_path, content)
    out = tmp_path / "out"
    argv = {"gemm": [*GEMM, "-o", str(out)],
            "moe": ["moe", "-i", str(moe_input(tmp_path, ROW)), "-o", str(out / "tuned.csv")],
            "grouped": [*GROUPED, "-o", str(out / "r.csv"), "--config-dir", str(out)]}[command]
    assert run_cli([*argv, "--search-space", str(path), *ENGINE]) == 2
    line = one_error_line(capsys)
    assert line == f"tritune: error: {path}: {expected}" or (expected in line and str(path) in line)
    assert not out.exists()  # nothing written, no journal


def test_a_valid_space_keeps_each_value_once():
    from tritune.tuners.gemm_tunable import SPACE_RULES
    from tritune.tuning.space import load_space_file

    path = Path(__file__).resolve().parent.parent / "examples" / "grouped_gemm_space.json"
    assert load_space_file(path, gg_tuner.SPACE_RULES)  # the shipped example passes its own rules
    assert SPACE_RULES["NUM_KSPLIT"].fault(3) is None and SPACE_RULES["GROUP_SIZE_M"].fault(5) is None
    assert all(SPACE_RULES["BLOCK_SIZE_N"].fault(n) is None for n in (16, 48, 96, 192, 256))  # Gluon's two MMAs
    assert SPACE_RULES["BLOCK_SIZE_M"].fault(192) is not None  # rows stay powers of two


# ---- 2. output paths --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "output", "expected"), [
    ("gemm", "x/out", "cannot write the output folder {x}/out: {x} is a file, not a folder"),
    ("gemm", "x", "cannot write the output folder {x}: it is a file"),
    ("moe", "x/out.csv", "cannot write the output file {x}/out.csv: {x} is a file, not a folder"),  # was a traceback
    ("moe", "d", "cannot write the output file {d}: it is a folder"),
    ("moe-profile", "x/p.csv", "cannot write the output file {x}/p.csv: {x} is a file, not a folder"),
    ("grouped", "x/r.csv", "cannot write the output file {x}/r.csv: {x} is a file, not a folder"),
    ("grouped-store", "x/configs", "cannot write the output folder {x}/configs: {x} is a file, not a folder"),
    ("example", "x/out", "cannot write the output folder {x}/out: {x} is a file, not a folder"),
    ("aot-build", "x/bundle", "cannot write the output folder {x}/bundle: {x} is a file, not a folder"),
    ("aot-run", "x/stats.csv", "cannot write the output file {x}/stats.csv: {x} is a file, not a folder"),
    ("aot-import", "x", "cannot write the output folder {x}: it is a file"),
])
def test_unwritable_output_is_one_line_before_any_work(command, output, expected, tmp_path, capsys):
    (tmp_path / "x").write_text("a regular file\n")
    (tmp_path / "d").mkdir()
    target = str(tmp_path / output)
    inp = str(moe_input(tmp_path, ROW))
    before = listing(tmp_path)
    argv = {"gemm": [*GEMM, "-o", target, *ENGINE],
            "moe": ["moe", "-i", inp, "-o", target, *ENGINE],
            "moe-profile": ["moe", "-i", inp, "-o", str(tmp_path / "d" / "t.csv"), "--profile_file", target, *ENGINE],
            "grouped": [*GROUPED, "-o", target, "--config-dir", str(tmp_path / "d"), *ENGINE],
            "grouped-store": [*GROUPED, "-o", str(tmp_path / "d" / "r.csv"), "--config-dir", target, *ENGINE],
            "example": ["example", "-o", target, *ENGINE],
            "aot-build": ["aot", "build", "--kernel", "gemm", "-o", target],
            "aot-run": ["aot", "run", str(tmp_path / "d"), "--output", target],
            "aot-import": ["aot", "import", str(tmp_path / "d"), "-o", target]}[command]
    assert run_cli(argv) == 2
    line = one_error_line(capsys)
    assert line == "tritune: error: " + expected.format(x=tmp_path / "x", d=tmp_path / "d")
    assert listing(tmp_path) == before  # nothing half-written, no journal, no lock


@pytest.mark.parametrize("command", ["gemm", "moe", "example"])
def test_a_cache_folder_that_is_a_file_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    # The write locks live in TRITUNE_CACHE_DIR/locks: a file there was a traceback after the whole tune.
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("TRITUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = {"gemm": [*GEMM, "-o", str(out)], "example": ["example", "-o", str(out)],
            "moe": ["moe", "-i", str(moe_input(tmp_path, ROW)), "-o", str(out / "t.csv")]}[command]
    assert run_cli([*argv, *ENGINE]) == 2
    assert one_error_line(capsys) == (f"tritune: error: TRITUNE_CACHE_DIR='{tmp_path / 'cache'}': "
                                      f"{tmp_path / 'cache'} exists and is not a folder")
    assert not out.exists()


@pytest.mark.parametrize(("variable", "value", "choices"), [
    ("TRITUNE_START_METHOD", "fork", "spawn, forkserver"),  # the driver holds a CUDA context: never plain fork
    ("TRITUNE_TIMER_PARK", "long", "short, full"),
    ("TRITUNE_MXFP4_DECODE", "ptx", "ops, asm"),
])
@pytest.mark.parametrize("command", ["gemm", "moe"])
def test_a_bad_start_method_is_one_line_before_any_work(command, variable, value, choices, tmp_path, monkeypatch,
                                                        capsys):
    monkeypatch.setenv(variable, value)
    out = tmp_path / "out"
    argv = {"gemm": [*GEMM, "-o", str(out)],
            "moe": ["moe", "-i", str(moe_input(tmp_path, ROW)), "-o", str(out / "t.csv")]}[command]
    assert run_cli([*argv, *ENGINE]) == 2
    assert one_error_line(capsys) == f"tritune: error: {variable}={value!r}: use one of {choices}"
    assert not out.exists()


@pytest.mark.parametrize("command", ["gemm", "moe"])
def test_a_bad_worker_preload_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITUNE_WORKER_PRELOAD", "sometimes")
    out = tmp_path / "out"
    argv = {"gemm": [*GEMM, "-o", str(out)],
            "moe": ["moe", "-i", str(moe_input(tmp_path, ROW)), "-o", str(out / "t.csv")]}[command]
    assert run_cli([*argv, *ENGINE]) == 2
    assert one_error_line(capsys) == ("tritune: error: TRITUNE_WORKER_PRELOAD='sometimes' is not a boolean; use 1 or 0 "
                                      "(true/false, yes/no, on/off)")
    assert not out.exists()


def test_a_tuning_command_starts_the_fork_server_first_and_a_query_does_not(tmp_path, monkeypatch):
    """The fork server's imports overlap the CLI's own work: a tuning verb starts it before anything else (here the
    run then stops at a bad input); `configs` starts nothing."""
    from tritune.tuning import processes

    started = []
    monkeypatch.setattr(processes, "start_server_early", lambda: started.append(True))
    missing = tmp_path / "missing.csv"
    assert run_cli(["moe", "-i", str(missing), "-o", str(tmp_path / "t.csv"), *ENGINE]) == 2
    assert started == [True]
    run_cli(["configs"])
    assert started == [True]


@pytest.mark.parametrize("torch_has_cuda", [True, False])
def test_where_the_driver_reports_a_gpu_the_fork_server_starts_before_torch_is_imported(tmp_path, monkeypatch,
                                                                                         torch_has_cuda):
    """The driver's answer (libcuda, no torch) lets the server start before the CLI's own torch import; a torch
    that then finds no GPU (a CPU build) leaves the early server unused: children are spawned."""
    from tritune import cli, knobs
    from tritune.tuning import processes

    order = []
    monkeypatch.setenv(knobs.START_METHOD, "forkserver")  # restored after: main sets it to spawn in one case
    monkeypatch.setattr(processes, "start_server_early", lambda: order.append("server"))
    monkeypatch.setattr(processes, "driver_reports_a_gpu", lambda: True)
    monkeypatch.setattr(cli, "_use_interpreter_without_gpu", lambda: order.append("torch") or not torch_has_cuda)
    missing = tmp_path / "missing.csv"
    assert run_cli(["moe", "-i", str(missing), "-o", str(tmp_path / "t.csv"), *ENGINE]) == 2
    assert order == ["server", "torch"]
    assert knobs.start_method() == ("forkserver" if torch_has_cuda else "spawn")


def test_without_a_driver_gpu_the_fork_server_starts_after_the_interpreter_is_decided(tmp_path, monkeypatch):
    from tritune import cli
    from tritune.tuning import processes

    order = []
    monkeypatch.setattr(processes, "start_server_early", lambda: order.append("server"))
    monkeypatch.setattr(processes, "driver_reports_a_gpu", lambda: False)
    monkeypatch.setattr(cli, "_use_interpreter_without_gpu", lambda: order.append("torch") or True)
    assert run_cli(["moe", "-i", str(tmp_path / "missing.csv"), "-o", str(tmp_path / "t.csv"), *ENGINE]) == 2
    assert order == ["torch", "server"]


# ---- 3. inputs without rows -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "content", "why"), [
    ("gemm", "M,N,K\n", "only a header"),
    ("gemm", "# a comment only\n\n", "the file is empty"),
    ("gemm", "", "the file is empty"),
    ("moe", ",".join(UNTUNED_COLUMNS) + "\n", "only a header"),
    ("moe", "", "the file is empty"),
    ("moe", "\n\n", "the file is empty"),
])
def test_an_input_without_rows_is_an_error(command, content, why, tmp_path, capsys):
    path = tmp_path / "in.csv"
    path.write_text(content)
    out = tmp_path / "out"
    argv = ([*GEMM[:5], "--shapes", str(path), "-o", str(out)] if command == "gemm"
            else ["moe", "-i", str(path), "-o", str(out / "t.csv")])
    assert run_cli([*argv, *ENGINE]) == 2
    assert one_error_line(capsys) == f"tritune: error: no rows to tune in {path} ({why})"
    assert not out.exists()


# ---- 4. shapes far beyond what the interpreter finishes ---------------------------------------------------------

@NO_GPU
def test_full_size_moe_rows_are_refused_without_a_gpu(tmp_path, capsys):
    example = Path(__file__).resolve().parent.parent / "examples" / "untuned_fmoe.csv"
    out = tmp_path / "tuned.csv"
    assert run_cli(["moe", "-i", str(example), "-o", str(out), *ENGINE]) == 2
    line = one_error_line(capsys)
    for text in (f"{example}: row 1 (token=", "without a GPU: about", "per interpreted call", "tritune example",
                 "--allow-slow-interpreter"):
        assert text in line
    assert list(tmp_path.iterdir()) == []


@NO_GPU
@pytest.mark.parametrize("command", ["gemm", "grouped"])
def test_large_gemm_shapes_are_refused_without_a_gpu(command, tmp_path, capsys):
    argv = (["gemm", "--kernel", "bf16", "--m", "16,4096", "--n", "4096", "--k", "4096", "-o", str(tmp_path / "o")]
            if command == "gemm" else
            ["grouped-gemm", "--model", "mixtral-8x7b", "-o", str(tmp_path / "r.csv"), "--config-dir", str(tmp_path)])
    assert run_cli([*argv, *ENGINE]) == 2
    line = one_error_line(capsys)
    assert "without a GPU: about" in line and "--allow-slow-interpreter" in line
    assert ("GEMM M=4096 N=4096 K=4096" if command == "gemm" else "grouped GEMM gate_up forward") in line
    assert list(tmp_path.iterdir()) == []


def test_the_cost_check_passes_tiny_shapes_and_is_lifted_by_the_flag(tmp_path):
    big = gemm_tuner.GemmTuneRequest("bf16", (gemm_tuner.GemmShape((4096,), 4096, 4096),), tmp_path)
    with pytest.raises(ValueError, match="without a GPU"):
        gemm_tuner.check_interpreter_cost(big, INTERP)
    gemm_tuner.check_interpreter_cost(gemm_tuner.GemmTuneRequest(
        "bf16", big.shapes, tmp_path, dtype="fp16", allow_slow_interpreter=True), INTERP)
    # `tritune example`'s interpreted shapes are far inside the limits.
    gemm_tuner.check_interpreter_cost(gemm_tuner.GemmTuneRequest(
        "bf16", (gemm_tuner.GemmShape((1, 17), 96, 80),), tmp_path, dtype="fp16"), INTERP)
    tiny = FmoeShape(5, 96, 80, 5, 2, "silu", "fp16", "fp16", "fp16", "none", True, False)
    assert fmoe_tuner._interpreter_fault(tiny) is None
    mixtral = FmoeShape(1024, 4096, 14336, 8, 2, "silu", "bf16", "bf16", "bf16", "none", True, False)
    assert "per interpreted call" in fmoe_tuner._interpreter_fault(mixtral)


@NO_GPU
@pytest.mark.parametrize("command", ["gemm", "grouped", "moe"])
def test_bf16_operands_the_interpreter_multiplies_wrongly_are_refused(command, tmp_path, capsys):
    # Triton 3.9's interpreter multiplies bf16 bit patterns in tl.dot: every candidate failed "wrong_answer" after the
    # whole run (`tritune gemm --kernel bf16 --n 32 --k 64 --m 4`, bf16 being --dtype's default).
    from tritune.kernels.interpreter_probe import interpreter_dot_is_exact

    if interpreter_dot_is_exact(torch.bfloat16):
        pytest.skip("this Triton's interpreter multiplies bf16 right: nothing to refuse")
    # The fp8 row's dtype (activations, output) is bf16 too: its 1-stage candidate failed the same way.
    rows = (ROW.replace("torch.float16", "dtypes.bf16"),
            ROW.replace("torch.float16,torch.float16,torch.float16,QuantType.No",
                        "dtypes.bf16,dtypes.fp8,dtypes.fp8,QuantType.per_Token"))
    argv = {"gemm": [*GEMM[:3], "--n", "40", "--k", "48", "--m", "1,17", "-o", str(tmp_path / "o")],
            "grouped": [*GROUPED[:-6], "--gemms", "gate_up", "--kernels", "forward", "-o", str(tmp_path / "r.csv"),
                        "--config-dir", str(tmp_path / "c")],
            "moe": ["moe", "-i", str(tmp_path / "untuned.csv"), "-o", str(tmp_path / "t.csv")]}[command]
    for row in rows if command == "moe" else rows[:1]:
        if command == "moe":
            moe_input(tmp_path, ROW, row)  # row 2 is refused, naming it
        before = listing(tmp_path)
        for extra in ([], ["--allow-slow-interpreter"]):  # not a matter of time: the flag does not lift it
            assert run_cli([*argv, *extra, *ENGINE]) == 2
            line = one_error_line(capsys)
            assert "tl.dot on bf16 operands wrongly (triton-lang/triton#11584)" in line
            assert line.startswith("tritune: error: " + (f"{tmp_path / 'untuned.csv'}: row 2 (token=3 " if command ==
                                                         "moe" else "--dtype bf16 without a GPU: Triton "))
            assert ("use fp16 rows" if command == "moe" else "pass --dtype fp16") in line
        assert listing(tmp_path) == before  # nothing written, no journal
    # The fp8 kernels (fp8 operands) and fp16 operands are not refused.
    for kernel, dtype in (("a8w8", "bf16"), ("a8w8_blockscale", "bf16"), ("bf16", "fp16"), ("bf16", "fp32")):
        gemm_tuner.check_interpreter_cost(gemm_tuner.GemmTuneRequest(
            kernel, (gemm_tuner.GemmShape((1,), 40, 48),), tmp_path, dtype=dtype), INTERP)


# ---- 7. one cause, one message ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("command", "content", "cause"), [
    ("gemm", {"BLOCK_SIZE_M": [64]}, "every candidate was pruned"),  # M=1 keeps no BLOCK_SIZE_M of 64
    ("moe", {"BLOCK_SIZE_M": [128]},  # 6 pairs: every kind's BLOCK_SIZE_M rule prunes 128
     "no stage pair and no 1-stage winner (stage1: every candidate was pruned; stage2: every candidate was pruned; "
     "1stage: every candidate was pruned)"),
    ("grouped", {"BLOCK_SIZE_M": [256], "BLOCK_SIZE_N": [256], "BLOCK_SIZE_K": [256], "num_stages": [5]},
     "every candidate was pruned"),  # tiles beyond the shared memory
])
def test_every_candidate_pruned_is_one_message_on_stdout_and_stderr(command, content, cause, tmp_path, capsys):
    path = space(tmp_path, content)
    argv = {"gemm": [*GEMM[:7], "--k", "48", "--m", "1", "-o", str(tmp_path / "o")],
            "moe": ["moe", "-i", str(moe_input(tmp_path, ROW)), "-o", str(tmp_path / "t.csv")],
            "grouped": [*GROUPED, "-o", str(tmp_path / "r.csv"), "--config-dir", str(tmp_path / "c")]}[command]
    assert run_cli([*argv, "--search-space", str(path), *ENGINE]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("tritune: error: ") and cause in err
    assert cause in captured.out  # the result table gives the same cause
    assert "correctness gate" not in captured.out + captured.err
