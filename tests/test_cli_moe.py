"""`tritune moe`: a tiny fp16 run writes the tuned CSV and the profile; --last, skipping, --all, merging with rows of
another device; bad input is one stderr line, exit 2, and leaves the output file as it was.

Runs in-process through Triton's interpreter with one config per kernel kind, so each tuning run takes seconds.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from cli_asserts import one_error_line

from tritune.cli import main
from tritune.device import current_device
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.store.fmoe_csv import read_tuned, write_tuned
from tritune.store.fmoe_rows import TUNED_COLUMNS, UNTUNED_COLUMNS, FmoeShape, FmoeTuned
from tritune.tuners import fused_moe as fmoe_tuner

DEV = current_device()
HEADER = ",".join(UNTUNED_COLUMNS)
# token 3 top-2 of 3 experts: 6 pairs, under one BLOCK_SIZE_M; inter_dim 48 over 32-wide N tiles (one masked).
ROW_A = "3,64,48,3,2,ActivationType.Silu,torch.float16,torch.float16,torch.float16,QuantType.No,True,False"
ROW_B = "5,64,48,3,2,ActivationType.Gelu,torch.float16,torch.float16,torch.float16,QuantType.No,True,True"
SHAPE_A = FmoeShape(3, 64, 48, 3, 2, "silu", "fp16", "fp16", "fp16", "none", True, False)
SHAPE_B = FmoeShape(5, 64, 48, 3, 2, "gelu", "fp16", "fp16", "fp16", "none", True, True)
# The written header: the fixed aiter columns, then the provenance tritune adds, then the op's eager and CUDA-graph
# times and the objective that chose the row, in this order.
TUNED_HEADER = [*TUNED_COLUMNS, "device", "triton", "torch", "routing", "us_stages", "rel_l2", "us_eager", "us_graph",
                "objective"]
ENGINE = ["--iters", "1", "--warmup", "0", "--no-progress", "--compile-workers", "1"]
SMALL = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def _one_config_per_kind(monkeypatch):
    # build_tunable reads these when it runs; KSPLIT (1,) leaves one stage-1, one stage-2 and one 1-stage config.
    monkeypatch.setattr(fmoe_tuner, "INTERPRETER_STAGE_SPACE", {**fmoe_tuner.INTERPRETER_STAGE_SPACE, "KSPLIT": (1,)})


def run_cli(argv: list[str]) -> int:
    """main() returns its code; argparse-level errors raise SystemExit instead."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def write_input(path: Path, *rows: str) -> Path:
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def fake_row(shape: FmoeShape, cu_num: int) -> FmoeTuned:
    """A tuned row as an earlier run (on this or another GPU) would have left it."""
    return FmoeTuned(cu_num=cu_num, shape=shape, block_m=16, ksplit=0, us1=3.0, kernelName1=SMALL.name("stage1"),
                     err1=0.0, us2=2.0, kernelName2=SMALL.name("stage2"), err2=0.0, us=5.0, run_1stage=False,
                     tflops=1.0, bw=1.0)


def no_tuning_started(folder: Path) -> bool:
    return not any(p.name.startswith("journal-") for p in folder.iterdir())


def assert_consistent(row: FmoeTuned) -> None:
    """The kernel names parse, belong to this row's quant/activation, and agree with run_1stage and block_m."""
    s = row.shape
    kind1, cfg1 = MoeConfig.parse_name(row.kernelName1)
    assert row.kernelName1 == cfg1.name(kind1, s.quant, s.act_type)
    assert row.block_m == cfg1.BLOCK_SIZE_M
    if row.run_1stage:
        assert kind1 == "1stage" and row.kernelName2 == "" and row.us2 == 0
    else:
        kind2, cfg2 = MoeConfig.parse_name(row.kernelName2)
        assert (kind1, kind2) == ("stage1", "stage2") and cfg2.BLOCK_SIZE_M == cfg1.BLOCK_SIZE_M
        assert row.kernelName2 == cfg2.name(kind2, s.quant, s.act_type)
    assert row.us > 0 and row.cu_num == DEV.cu_num
    assert dict(row.extra)["device"] == DEV.name


def test_run_writes_tuned_row_and_profile_keeping_other_devices_rows(tmp_path, capsys, monkeypatch):
    pools = []
    real_pool = fmoe_tuner.make_compile_pool
    monkeypatch.setattr(fmoe_tuner, "make_compile_pool", lambda *a: pools.append(real_pool(*a)) or pools[-1])
    inp = write_input(tmp_path / "untuned.csv", ROW_A)
    out, profile = tmp_path / "tuned.csv", tmp_path / "profile.csv"
    other = fake_row(SHAPE_A, cu_num=DEV.cu_num + 1)  # same shape tuned on another GPU: kept, not a skip
    write_tuned(out, [other])
    code = run_cli(["moe", "-i", str(inp), "-o", str(out), "--profile_file", str(profile), *ENGINE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"wrote 1 row(s) to {out}" in captured.out and f"wrote every candidate to {profile}" in captured.out
    assert ("interpreter" in captured.out) == (not torch.cuda.is_available())  # the correctness-only label
    # One labelled summary for the row (each kind, then the end-to-end re-time of both winners) and the run's totals
    # once, not one unlabelled block per engine pass.
    summary = captured.out[captured.out.index("== row "):]
    # The interpreter's space is one candidate a kind; a GPU's is the full space, pruned.
    space = (r"1 in the space, 0 pruned, 1 measured" if DEV.interpreter
             else r"\d+ in the space, \d+ pruned, \d+ measured")
    assert summary.count("== row ") == 1 and re.match(
        r"== row token=3 model_dim=64 inter_dim=48 expert=3 topk=2 \(silu, fp16, quant none\)\n"
        rf"  stage1: {space}; best ", summary)
    for line in (rf"\n  stage2: {space}", rf"\n  1stage: {space}",
                 r"\n  e2e \(stage pair BM\d+\): 1 measured; best ", r"\n  e2e \(1-stage[^)]*\): 1 measured; best ",
                 r"\n== run: 1 row\(s\), stage search and end-to-end re-time"):
        assert re.search(line, summary), line
    # 3 kinds + 2 re-times; a GPU re-times the speed levers' and the rule table's plans too
    problems = re.findall(r"\n  problems: (\d+)\n", summary)
    assert captured.out.count("problems: ") == 1 and len(problems) == 1
    assert int(problems[0]) == 5 if not torch.cuda.is_available() else int(problems[0]) >= 5
    assert re.search(r"\n  passes: stage search \d+\.\ds, end-to-end re-time \d+\.\ds; first candidate to a worker "
                     r"after \d+\.\ds and \d+\.\ds\n", summary)
    assert re.search(r"\n  outside the passes: starting workers and pool \d+\.\ds, closing them \d+\.\ds, writing "
                     r"\d+\.\ds\n", summary)
    split = re.search(r"\n  before the tune: (\d+\.\d)s \(driver query and fork server, torch, tritune's imports, "
                      r"device, reading and checking the rows: (\d+\.\d) / (\d+\.\d) / (\d+\.\d) / (\d+\.\d) / "
                      r"(\d+\.\d)s\)\n", summary)
    assert split and abs(float(split[1]) - sum(float(split[i]) for i in range(2, 7))) <= 0.25  # the parts add up
    done = re.search(r"\n  done (\d+\.\d)s after the command started \(the interpreter's exit follows\)\n", summary)
    assert done and float(done[1]) >= float(split[1])
    # One set of workers for the stage search and the re-time: one executor line, counting both passes.
    assert summary.count("\n  local: 1 worker(s)") == 1
    assert len(pools) == 1  # ... and one compile pool
    assert not list(tmp_path.rglob("*.lock"))  # write locks live in the cache folder, never beside outputs

    with out.open() as f:
        header, *rows = list(csv.reader(f))
    assert header == TUNED_HEADER
    assert len(rows) == 2 and rows[0][len(TUNED_COLUMNS):] == [""] * 9  # the other GPU's row first, no provenance
    old, new = read_tuned(out)
    assert old == other
    assert new.shape == SHAPE_A
    assert_consistent(new)
    extra = dict(new.extra)
    assert extra["routing"] == "uniform"
    # Timed as the op runs (eager) and as a graph (on the CPU: eager calls again); the default objective chose.
    assert float(extra["us_eager"]) > 0 and float(extra["us_graph"]) > 0 and extra["objective"] == "eager"

    with profile.open() as f:
        prof = list(csv.DictReader(f))
    assert list(prof[0]) == list(fmoe_tuner.PROFILE_COLUMNS)
    assert {r["kind"] for r in prof} == {"stage1", "stage2", "1stage", "e2e"}
    # Only the end-to-end re-time is timed as the op runs: a stage alone is not what the user calls.
    assert all((r["us_eager"] != "") == (r["kind"] == "e2e") for r in prof)
    assert all(r["status"] == "ok" and float(r["us"]) > 0 for r in prof)
    by_kind = {kind: [r["kernelName"] for r in prof if r["kind"] == kind] for kind in ("stage1", "stage2", "1stage")}
    counts = {k: len(v) for k, v in by_kind.items()}
    # The interpreter's space: one candidate a kind; a GPU's: every candidate the pruned full space measured.
    assert counts == {"stage1": 1, "stage2": 1, "1stage": 1} if DEV.interpreter else min(counts.values()) >= 1
    for kind, names in by_kind.items():
        assert all(MoeConfig.parse_name(name)[0] == kind for name in names)
    e2e = sorted(r["kernelName"] for r in prof if r["kind"] == "e2e")
    if DEV.interpreter:  # the winners re-timed end to end: the stage pair (joined by "+") and the 1-stage kernel (no
        # lever variant: the interpreter has no TMA to read the sorted intermediate through)
        assert e2e == sorted([f"{by_kind['stage1'][0]}+{by_kind['stage2'][0]}", by_kind["1stage"][0]])
    assert (new.kernelName1 if new.run_1stage else f"{new.kernelName1}+{new.kernelName2}") in e2e


def test_last_tunes_only_the_last_row(tmp_path, capsys):
    inp = write_input(tmp_path / "untuned.csv", ROW_A, ROW_B)
    out = tmp_path / "tuned.csv"
    code = run_cli(["moe", "-i", str(inp), "-o", str(out), "--last", "--skew", "0.5", "--objective", "graph", *ENGINE])
    assert code == 0, capsys.readouterr().err
    (row,) = read_tuned(out)
    assert row.shape == SHAPE_B
    assert_consistent(row)
    assert dict(row.extra)["routing"] == "zipf0.5"
    assert dict(row.extra)["objective"] == "graph"


def test_rows_already_tuned_are_skipped_and_all_retunes_them(tmp_path, capsys):
    inp = write_input(tmp_path / "untuned.csv", ROW_A)
    out = tmp_path / "tuned.csv"
    write_tuned(out, [fake_row(SHAPE_A, cu_num=DEV.cu_num)])
    before = out.read_bytes()

    assert run_cli(["moe", "-i", str(inp), "-o", str(out), *ENGINE]) == 0
    assert "skipped 1 row(s) already tuned for this device (--all to retune)" in capsys.readouterr().out
    assert out.read_bytes() == before
    assert no_tuning_started(tmp_path)

    code = run_cli(["moe", "-i", str(inp), "-o", str(out), "--all", *ENGINE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "skipped" not in captured.out and f"wrote 1 row(s) to {out}" in captured.out
    (row,) = read_tuned(out)  # replaced in place, not appended
    assert row.shape == SHAPE_A and row != fake_row(SHAPE_A, cu_num=DEV.cu_num)
    assert_consistent(row)


def test_bad_value_in_input_names_file_row_and_column(tmp_path, capsys):
    inp = write_input(tmp_path / "untuned.csv", ROW_A, ROW_A.replace("ActivationType.Silu", "ActivationType.Relu"))
    out = tmp_path / "tuned.csv"
    write_tuned(out, [fake_row(SHAPE_B, cu_num=DEV.cu_num)])
    before = out.read_bytes()
    assert run_cli(["moe", "-i", str(inp), "-o", str(out), *ENGINE]) == 2
    line = one_error_line(capsys)
    for text in (str(inp), "row 2", "column 'act_type'", "'ActivationType.Relu'"):
        assert text in line
    assert out.read_bytes() == before
    assert no_tuning_started(tmp_path)


def test_missing_input_file(tmp_path, capsys):
    out = tmp_path / "tuned.csv"
    assert run_cli(["moe", "-i", str(tmp_path / "nope.csv"), "-o", str(out), *ENGINE]) == 2
    line = one_error_line(capsys)
    assert str(tmp_path / "nope.csv") in line and "no such file" in line
    assert not out.exists() and no_tuning_started(tmp_path)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--errRatio", "1.5"], "--errRatio 1.5 must lie in [0, 1]"),
    (["--err-ratio", "-0.1"], "--errRatio -0.1 must lie in [0, 1]"),
    (["--skew", "-1"], "--skew -1.0 must be a finite number >= 0"),
    (["--skew", "nan"], "--skew nan must be a finite number >= 0"),
    (["--iters", "0"], "'0' is not a positive integer"),  # argparse-level: SystemExit(2)
    (["--objective", "wall"], "argument --objective: invalid choice: 'wall'"),
    (["--finalists", "-1"], "'-1' is not a non-negative integer"),
])
def test_bad_flag_fails_on_one_line(flags, expected, tmp_path, capsys):
    inp = write_input(tmp_path / "untuned.csv", ROW_A)
    out = tmp_path / "tuned.csv"
    assert run_cli(["moe", "-i", str(inp), "-o", str(out), *ENGINE, *flags]) == 2
    assert expected in one_error_line(capsys)
    assert not out.exists() and no_tuning_started(tmp_path)


@pytest.mark.parametrize(("content", "expected"), [
    ("cu_num,token\n132,3\n", "missing required column(s)"),  # a foreign CSV
    (None, "column 'us'"),  # a tuned row whose us is not a number
    ("", "empty file"),
])
def test_corrupt_output_fails_before_tuning(content, expected, tmp_path, capsys):
    inp = write_input(tmp_path / "untuned.csv", ROW_A)
    out = tmp_path / "tuned.csv"
    if content is None:
        write_tuned(out, [fake_row(SHAPE_B, cu_num=DEV.cu_num)])
        content = out.read_text().replace(",5.00,False,", ",fast,False,")
        assert ",fast," in content
    out.write_text(content)
    before = out.read_bytes()
    assert run_cli(["moe", "-i", str(inp), "-o", str(out), *ENGINE]) == 2
    line = one_error_line(capsys)
    assert str(out) in line and expected in line
    assert out.read_bytes() == before
    assert no_tuning_started(tmp_path)


def test_e2e_retimes_the_best_stage_pair_of_each_block_m():
    """The stages are timed alone; the best pair of each BLOCK_SIZE_M (up to E2E_PAIRS, fastest stage sum first) is
    re-timed end to end, so a pair the stage sums rank second can still win as the whole op."""
    from tritune.params import Config
    from tritune.tuning.report import ProblemResult
    from tritune.tuning.types import Measurement, Status

    def result(kind: str, times: dict[tuple[int, int], float]) -> ProblemResult:
        ms = [Measurement(kind, Config.of(**{**MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn).__dict__}),
                          Status.OK, t, 0.0) for (bm, bn), t in times.items()]
        return ProblemResult(kind, min(ms, key=lambda m: m.time_us), ms, len(ms), {})

    stage1 = result("stage1", {(16, 64): 9.5, (32, 64): 7.0, (64, 64): 5.0, (64, 128): 4.0, (128, 64): 8.0})
    stage2 = result("stage2", {(16, 64): 1.0, (32, 64): 6.0, (64, 64): 5.0, (128, 128): 2.0})
    choices = fmoe_tuner.choose(stage1, stage2, None)
    # BM 64: 4 + 5 = 9; BM 128: 8 + 2 = 10; BM 16: 9.5 + 1 = 10.5; BM 32: 13 (the fourth: dropped)
    assert fmoe_tuner.E2E_PAIRS == 3
    assert [(c.plan[0].BLOCK_SIZE_M, c.us1 + c.us2) for c in choices] == [(64, 9.0), (128, 10.0), (16, 10.5)]
    assert choices[0].plan[0].BLOCK_SIZE_N == 128  # each BLOCK_SIZE_M's own fastest stage-1 config


def test_lever_variant_of_the_fastest_pair_only_and_only_where_tma_reads_a(monkeypatch):
    """The variant (SORTED_INTER 2 in both stages) joins the end-to-end candidates once, for the pair the stage sums
    rank first, after it (a tie keeps the plain pair); only where the device and the intermediate's rows allow TMA
    and not under the interpreter; E2E_LEVER_VARIANT False leaves the candidates as they were."""
    if DEV.interpreter:
        fast = fmoe_tuner.Choice((SMALL, SMALL), 2.0, 0.0, 3.0, 0.0)
        assert fmoe_tuner.with_lever_variant([fast], SHAPE_A, DEV) == [fast]  # interpreted: no speed lever
    monkeypatch.setattr(fmoe_tuner, "E2E_LEVER_UNDER_INTERPRETER", True)
    one = fmoe_tuner.Choice((dataclasses.replace(SMALL, BLOCK_SIZE_D=32), None), 1.0, 0.0)
    fast = fmoe_tuner.Choice((SMALL, SMALL), 2.0, 0.0, 3.0, 0.0)
    slow = fmoe_tuner.Choice((dataclasses.replace(SMALL, BLOCK_SIZE_M=32),) * 2, 4.0, 0.0, 4.0, 0.0)
    assert fmoe_tuner.E2E_LEVER_VARIANT is True  # on since measured on the H100 (RESULTS.md, 2026-11-26)
    chosen = fmoe_tuner.with_lever_variant([one, fast, slow], SHAPE_A, DEV)
    assert chosen[:3] == [one, fast, slow] and len(chosen) == 5
    variant, persistent = chosen[3:]
    assert variant.plan == tuple(dataclasses.replace(SMALL, SORTED_INTER=2) for _ in range(2))
    assert variant.plan[0].TOPK_ATOMIC == 0  # the atomics lost on the GPU: not varied
    assert persistent.plan == (variant.plan[0], dataclasses.replace(variant.plan[1], PERSISTENT=1, USE_TMA=1))
    for v in (variant, persistent):  # the stages were measured without the levers
        assert (v.us1, v.us2) == (fast.us1, fast.us2)
    assert fmoe_tuner.with_lever_variant([one], SHAPE_A, DEV) == [one]  # no stage pair: nothing to vary
    fp8 = dataclasses.replace(SHAPE_A, inter_dim=40, q_type="per_token", q_dtype_a="fp8", q_dtype_w="fp8")
    assert fmoe_tuner.lever_variant(fast.plan, fp8, DEV) is None  # fp8 rows of 40 bytes: no descriptor
    assert fmoe_tuner.with_lever_variant([one, fast], fp8, DEV) == [one, fast]
    no_tma = dataclasses.replace(DEV, capability=(8, 0))
    assert fmoe_tuner.lever_variant(fast.plan, SHAPE_A, no_tma) is None


def test_persistent_variant_only_where_stage_2_can_run_persistent(monkeypatch):
    """Stage 2 persistent joins only where check_config lets it (16-bit or fp8 weights, one K split, no SWAP_AB);
    E2E_PERSISTENT_VARIANT False leaves just the sorted-intermediate variant."""
    monkeypatch.setattr(fmoe_tuner, "E2E_LEVER_UNDER_INTERPRETER", True)
    lever = tuple(dataclasses.replace(SMALL, SORTED_INTER=2) for _ in range(2))
    assert fmoe_tuner.persistent_variant(lever, SHAPE_A)[1].name("stage2").endswith("_TMA1_SI2_PS1")
    block = dataclasses.replace(SHAPE_A, q_type="per_1x128", q_dtype_a="fp8", q_dtype_w="fp8")
    assert fmoe_tuner.persistent_variant(lever, block)[1].PERSISTENT == 1
    mxfp4 = dataclasses.replace(SHAPE_A, q_type="per_1x32", q_dtype_w="fp4x2")
    assert fmoe_tuner.persistent_variant(lever, mxfp4) is None
    for second in (dataclasses.replace(lever[1], KSPLIT=2), dataclasses.replace(lever[1], SWAP_AB=1)):
        assert fmoe_tuner.persistent_variant((lever[0], second), SHAPE_A) is None
    fast = fmoe_tuner.Choice((SMALL, SMALL), 2.0, 0.0, 3.0, 0.0)
    monkeypatch.setattr(fmoe_tuner, "E2E_PERSISTENT_VARIANT", False)
    assert [c.plan for c in fmoe_tuner.with_lever_variant([fast], SHAPE_A, DEV)] == [fast.plan, lever]


def test_lever_variant_switched_off_leaves_the_candidates(monkeypatch):
    fast = fmoe_tuner.Choice((SMALL, SMALL), 2.0, 0.0, 3.0, 0.0)
    monkeypatch.setattr(fmoe_tuner, "E2E_LEVER_VARIANT", False)
    assert fmoe_tuner.with_lever_variant([fast], SHAPE_A, DEV) == [fast]


def test_lever_variant_is_written_only_when_the_whole_op_is_faster(tmp_path, monkeypatch):
    """Through the engine with scripted timers, two rows in one run: every candidate runs through the interpreter (the
    variant passes the correctness gate on real kernels), and the end-to-end times, scripted per plan, decide: row A's
    variant is faster and written, row B's ties and loses (the plain pair is listed first; a slower one loses too)."""
    monkeypatch.setattr(fmoe_tuner, "E2E_LEVER_VARIANT", True)
    monkeypatch.setattr(fmoe_tuner, "E2E_LEVER_UNDER_INTERPRETER", True)
    from fake_tunables import scripted_gpu_time, scripted_graph_time
    from scripted_moe import ScriptedMoeTunable

    from tritune.tuning.bench import Timers
    from tritune.tuning.tuner import TuneSettings
    from tritune.tuning.types import BenchSettings

    timers = Timers(gpu=scripted_gpu_time, eager=scripted_graph_time, graph=scripted_graph_time)
    settings = TuneSettings(tmp_path / "journal.sqlite", compile_workers=1, progress=False,
                            bench=BenchSettings(iters=1, warmup=0, timeout_s=120.0, seed=0, flush_l2=False,
                                                timers=timers))
    tunable = ScriptedMoeTunable(
        stage_space=tuple({**fmoe_tuner.INTERPRETER_STAGE_SPACE, "KSPLIT": (1,)}.items()),
        one_stage_space=tuple(fmoe_tuner.INTERPRETER_ONE_STAGE_SPACE.items()),
        lever_us_by_token=((SHAPE_A.token, 50.0), (SHAPE_B.token, 100.0)))
    req = fmoe_tuner.MoeTuneRequest(write_input(tmp_path / "untuned.csv", ROW_A, ROW_B), tmp_path / "tuned.csv")
    report = fmoe_tuner.tune_fmoe(req, DEV, settings, tunable=tunable)
    e2e = [r for r in report.results if r.problem.kind == "e2e"]
    # per row: the pair, its two lever variants (the second with stage 2 persistent), the 1-stage
    assert len(e2e) == 8 and all(r.best is not None and r.best.ok for r in e2e)
    rows = {row.shape.token: row for row in report.written}
    assert rows[SHAPE_A.token].us == 50.0 and rows[SHAPE_B.token].us == 100.0
    for token, levers_written in ((SHAPE_A.token, True), (SHAPE_B.token, False)):
        for name in (rows[token].kernelName1, rows[token].kernelName2):
            assert name.endswith("_SI2") == levers_written
    assert sorted((t.kernelName1, t.kernelName2) for t in read_tuned(req.output)) == sorted(
        (r.kernelName1, r.kernelName2) for r in report.written)


def test_an_mxfp4_row_is_tuned_and_served_from_the_file(tmp_path, capsys, monkeypatch):
    """A QuantType.per_1x32 row (MXFP4 weights, fp16 activations; fp8 activations take the same path, tested at the
    worker in test_fused_moe_tunable): both stages and the 1-stage kernel, checked against the MoE on the dequantized
    weights; the written row reads back as the op's choice."""
    from tritune import knobs
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops import fused_moe, reload_moe_configs
    from tritune.ops.fused_moe import fused_moe_choice
    from tritune.ops.routing import sample_routing

    rows = ["3,64,64,3,2,ActivationType.Silu,dtypes.fp16,dtypes.fp16,dtypes.fp4x2,QuantType.per_1x32,True,False"]
    inp = write_input(tmp_path / "untuned.csv", *rows)
    out, profile = tmp_path / "tuned.csv", tmp_path / "profile.csv"
    code = run_cli(["moe", "-i", str(inp), "-o", str(out), "--profile_file", str(profile), *ENGINE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    tuned = {row.shape.quant: row for row in read_tuned(out)}
    assert set(tuned) == {"per_1x32"}
    for quant, row in tuned.items():
        assert row.shape.q_type == "per_1x32" and row.shape.q_dtype_w == "fp4x2"
        kind = "1stage" if row.run_1stage else "stage1"
        assert row.kernelName1.startswith(f"moe_{kind}_{quant}_silu_")
        assert_consistent(row)
    with profile.open() as f:
        prof = list(csv.DictReader(f))
    assert {r["kind"] for r in prof} == {"stage1", "stage2", "1stage", "e2e"}
    assert all(r["status"] == "ok" and float(r["rel_l2"]) < 3e-2 for r in prof if r["kind"] != "e2e")

    monkeypatch.setenv(knobs.CONFIG_FMOE, str(out))
    reload_moe_configs()
    try:
        g = torch.Generator().manual_seed(0)
        on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        hidden = torch.randn(3, 64, generator=g).half().to(on)
        (q1, s1), (q2, s2) = ((q.to(on), sc.to(on)) for q, sc in (
            quantize_weights(torch.randn(3, n, k, generator=g) / k**0.5, "per_1x32") for n, k in ((128, 64), (64, 64))))
        weights, ids = (t.to(on) for t in sample_routing(3, 3, 2, seed=0))
        for quant, row in tuned.items():
            choice = fused_moe_choice(hidden, q1, q2, ids, quant=quant)
            kind = "1stage" if row.run_1stage else "stage1"
            assert choice.source.startswith("tuned: ") and choice.stage1.name(kind, quant) == row.kernelName1
            ref = fused_moe_reference(hidden, q1, q2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
            got = fused_moe(hidden, q1, q2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
            assert float((got.float() - ref).norm() / ref.norm()) < 3e-2
    finally:
        monkeypatch.delenv(knobs.CONFIG_FMOE)
        reload_moe_configs()


def _stage_result(kind: str, kernels: list[tuple[MoeConfig, float]], failed: tuple[MoeConfig, ...] = ()):
    """A ProblemResult of stage measurements (the searched fields only, as the stage search records them)."""
    from tritune.params import Config
    from tritune.tuners.fused_moe_tunable import ONE_STAGE_SPACE, STAGE_SPACE
    from tritune.tuning.report import ProblemResult
    from tritune.tuning.types import Measurement, Status

    names = ONE_STAGE_SPACE if kind == "1stage" else STAGE_SPACE
    point = lambda cfg: Config.from_dict({n: getattr(cfg, n) for n in names})  # noqa: E731
    ms = [Measurement(kind, point(c), Status.OK, t, 0.01) for c, t in kernels]
    ms += [Measurement(kind, point(c), Status.WRONG_ANSWER, float("nan"), 1.0) for c in failed]
    ok = [m for m in ms if m.ok]
    return ProblemResult(kind, min(ok, key=lambda m: m.time_us) if ok else None, ms, len(ms), {})


def test_the_rule_tables_plan_joins_the_end_to_end_candidates(monkeypatch):
    """A tuned row is never one the op beats untuned: the rule table's plan (its plan-level fields included) is
    re-timed end to end, last (a tie keeps the tuner's pick), carrying its stages' measured times; not twice, not
    when a stage of it did not pass, and not under the interpreter unless switched on."""
    from tritune.tuners import fused_moe_tunable as fmt

    gpu = dataclasses.replace(DEV, interpreter=False)
    big = FmoeShape(4096, 4096, 384, 128, 8, "silu", "bf16", "bf16", "bf16", "none", True, False)
    rule1, rule2 = fmt.rule_plan(big, gpu)
    assert rule1.SORTED_INTER == 2  # a plan-level field the stages are not searched over
    other = dataclasses.replace(SMALL, BLOCK_SIZE_M=128)
    stage1 = _stage_result("stage1", [(rule1, 540.0), (other, 500.0)])
    stage2 = _stage_result("stage2", [(rule2, 520.0), (other, 480.0)])
    picked = fmoe_tuner.choose(stage1, stage2, None)
    assert [c.plan for c in picked] == [(other, other)]
    assert fmoe_tuner.rule_plan_applies(gpu)
    chosen = fmoe_tuner.with_rule_plan(picked, stage1, stage2, None, (rule1, rule2))
    assert chosen[0] == picked[0] and len(chosen) == 2
    assert chosen[1].plan == (rule1, rule2) and (chosen[1].us1, chosen[1].us2) == (540.0, 520.0)
    assert fmoe_tuner.with_rule_plan(chosen, stage1, stage2, None, (rule1, rule2)) == chosen  # already there
    unchecked = _stage_result("stage2", [(other, 480.0)], failed=(rule2,))
    assert fmoe_tuner.with_rule_plan(picked, stage1, unchecked, None, (rule1, rule2)) == picked  # stage 2 failed
    interpreted = dataclasses.replace(DEV, interpreter=True)
    assert not fmoe_tuner.rule_plan_applies(interpreted)  # off, so the caller passes no plan
    assert fmoe_tuner.with_rule_plan(picked, stage1, stage2, None, None) == picked
    monkeypatch.setattr(fmt, "RULE_PLAN_UNDER_INTERPRETER", True)
    one_rule, none = fmt.rule_plan(SHAPE_A, interpreted)
    assert none is None  # a 1-stage rule plan
    one = _stage_result("1stage", [(one_rule, 30.0)])
    fast = fmoe_tuner.Choice((SMALL, SMALL), 2.0, 0.0, 3.0, 0.0)
    assert fmoe_tuner.rule_plan_applies(interpreted)
    with_one = fmoe_tuner.with_rule_plan([fast], stage1, stage2, one, (one_rule, None))
    assert with_one == [fast, fmoe_tuner.Choice((one_rule, None), 30.0, 0.01)]
