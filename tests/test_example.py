"""`tritune example` (tuners/example.py): what it tunes on a GPU and without one, the tiny untuned CSV it writes, the
interpreter's few timed runs, and a CLI that only parses and calls these (it changes none of its arguments)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tritune import cli
from tritune.kernels.gemm import KERNELS
from tritune.store.fmoe_csv import read_untuned
from tritune.tuners import example
from tritune.tuners.gemm import read_shapes_file
from tritune.tuning.tuner import TuneSettings
from tritune.tuning.types import BenchSettings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# What the CLI wrote inline before the example moved into the library: the file must stay byte for byte the same.
TINY_CSV = ("token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,q_type,use_g1u1,doweight_stage1\n"
            "5,96,80,5,2,ActivationType.Silu,dtypes.fp16,dtypes.fp16,dtypes.fp16,QuantType.No,True,False\n")


def test_plan_without_a_gpu_is_the_tiny_rows(tmp_path):
    out = tmp_path / "out"  # not there yet: made for the tiny input
    plan = example.plan_example(out, interpreted=True, shapes=tmp_path / "unread.csv", moe_shapes=tmp_path / "no.csv")
    (gemm,) = plan.gemm
    assert (gemm.kernel, gemm.shapes, gemm.out_dir, gemm.dtype) == ("bf16", (example.TINY_GEMM,), out / "gemm", "fp16")
    tiny = out / example.TINY_FMOE_FILE
    assert tiny.read_text() == TINY_CSV and read_untuned(tiny) == [example.TINY_FMOE]
    assert (plan.moe.input, plan.moe.output, plan.moe.retune_all) == (tiny, out / "tuned_fmoe.csv", True)
    assert plan.moe.profile_file is None


def test_plan_on_a_gpu_is_every_gemm_kernel_then_the_moe_rows(tmp_path):
    shapes, moe = EXAMPLES / "gemm_shapes.csv", EXAMPLES / "untuned_fmoe.csv"
    plan = example.plan_example(tmp_path, interpreted=False, shapes=shapes, moe_shapes=moe)
    assert [r.kernel for r in plan.gemm] == list(KERNELS) == ["bf16", "a8w8", "a8w8_blockscale"]
    assert all(r.shapes == tuple(read_shapes_file(shapes)) and r.out_dir == tmp_path / "gemm" for r in plan.gemm)
    assert (plan.moe.input, plan.moe.output, plan.moe.profile_file) == (
        moe, tmp_path / "tuned_fmoe.csv", tmp_path / "tuned_fmoe_profile.csv")
    assert not plan.moe.retune_all and sorted(tmp_path.iterdir()) == []  # nothing written before tuning


def test_plan_refuses_an_output_that_cannot_be_a_folder(tmp_path):
    blocker = tmp_path / "x"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        example.plan_example(blocker / "out", interpreted=True, shapes=blocker, moe_shapes=blocker)
    with pytest.raises(ValueError, match="no-such.csv"):  # on a GPU the shapes file is read before any work
        example.plan_example(tmp_path / "out", interpreted=False, shapes=tmp_path / "no-such.csv", moe_shapes=blocker)


def test_interpreted_example_times_a_few_runs_only(tmp_path):
    given = TuneSettings(journal_path=tmp_path / "j", bench=BenchSettings(iters=30, warmup=5))
    capped = example.example_settings(given, interpreted=True)
    assert (capped.bench.iters, capped.bench.warmup) == (example.INTERPRETER_ITERS, example.INTERPRETER_WARMUP)
    assert (given.bench.iters, given.bench.warmup) == (30, 5)  # a new value; what was given is unchanged
    assert example.example_settings(given, interpreted=False) is given
    fewer = TuneSettings(journal_path=tmp_path / "j", bench=BenchSettings(iters=2, warmup=0))
    assert example.example_settings(fewer, interpreted=True).bench == fewer.bench  # never more than asked


def test_cli_example_passes_the_plan_and_changes_no_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CLI sets it without a GPU; restored after the test
    runs = []

    def fake_run(req, args, example=False):
        runs.append((req, vars(args).copy(), example))
        return 0

    monkeypatch.setattr(cli, "_run_gemm", fake_run)
    monkeypatch.setattr(cli, "_run_moe", fake_run)
    out = tmp_path / "out"
    argv = ["example", "-o", str(out), "--shapes", str(EXAMPLES / "gemm_shapes.csv"),
            "--moe-shapes", str(EXAMPLES / "untuned_fmoe.csv"), "--iters", "30", "--warmup", "5", "--no-progress"]
    parsed = vars(cli.build_parser().parse_args(argv))
    assert cli.main(argv) == 0
    interpreted = bool(runs) and runs[0][0].shapes == (example.TINY_GEMM,)
    want = example.plan_example(out, interpreted=interpreted, shapes=EXAMPLES / "gemm_shapes.csv",
                                moe_shapes=EXAMPLES / "untuned_fmoe.csv")
    assert [r[0] for r in runs] == [*want.gemm, want.moe] and all(r[2] for r in runs)
    assert all(args == parsed for _, args, _ in runs)  # iters and warmup as given: the library caps the timing


def test_example_without_a_gpu_says_the_shapes_files_it_does_not_use(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the shapes files: nothing to say")
    monkeypatch.setattr(cli, "_run_gemm", lambda req, args, example=False: 0)
    monkeypatch.setattr(cli, "_run_moe", lambda req, args, example=False: 0)
    shapes = tmp_path / "mine.csv"
    shapes.write_text("M,N,K\n\"1,2\",64,64\n")
    assert cli.main(["example", "-o", str(tmp_path / "out"), "--shapes", str(shapes), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "no GPU: --shapes not used" in err and "--moe-shapes" not in err
