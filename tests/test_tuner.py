"""tune() on the GEMM tunable: journal resume (also after kill -9), summary counts, M buckets and the default file;
the finalists re-timed as the op runs and ranked by the objective, on a fake op with scripted GPU times."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_tunables import (
    OpProblem,
    ScriptedOp,
    failing_graph_time,
    scripted_eager_time,
    scripted_gpu_time,
    scripted_graph_time,
)
from test_journal import OLD_SCHEMA

from tritune.device import current_device
from tritune.tuners.gemm import INTERPRETER_SPACE, GemmShape, GemmTuneRequest, tune_gemm
from tritune.tuners.gemm_tunable import GemmProblem, GemmTunable
from tritune.tuning.bench import Timers
from tritune.tuning.compile import CompilePool
from tritune.tuning.journal import Journal
from tritune.tuning.tuner import TuneSettings, journal_key, tune
from tritune.tuning.types import BenchSettings, Objective

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
DEVICE = current_device()
FAST = BenchSettings(iters=2, warmup=1, timeout_s=60.0, seed=0)
# BLOCK_SIZE_M in (16, 32) x NUM_KSPLIT in (1, 2); with K < 64 split-K is pruned, and M=1 prunes BLOCK_SIZE_M=32.
TUNABLE = GemmTunable(space_params=tuple(sorted(INTERPRETER_SPACE.items())))
SHAPES = (GemmShape((1, 17), 40, 48),  # N, K not multiples of the 32-wide blocks: masked edges
          GemmShape((1, 17), 24, 40))  # a second (N, K) for the default file's vote


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    # Spawned benchmark workers and the CLI subprocess import tritune (and fake_tunables) from this checkout.
    monkeypatch.setenv("PYTHONPATH", _pythonpath())


def settings(journal: Path) -> TuneSettings:
    return TuneSettings(journal_path=journal, bench=FAST, progress=False)


def space_file(folder: Path, space: dict) -> Path:
    path = folder / "space.json"
    path.write_text(json.dumps({k: list(v) for k, v in space.items()}))
    return path


def journal_rows(path: Path) -> int:
    if not path.exists():
        return 0
    try:
        conn = sqlite3.connect(path, timeout=5.0)
        try:
            return int(conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.OperationalError:  # created but the schema not written yet
        return 0


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory):
    """One tune_gemm run over M in (1, 17) for two (N, K): 4 problems, 16 configs, 6 kept."""
    out = tmp_path_factory.mktemp("two_shapes")
    req = GemmTuneRequest("bf16", SHAPES, out, dtype="fp16", space_file=space_file(out, INTERPRETER_SPACE))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", _pythonpath())  # module scope: set up before the autouse fixture
        report = tune_gemm(req, DEVICE, settings(out / "journal.sqlite"))
    return out, report


def test_rerun_with_the_same_journal_measures_nothing(tmp_path):
    problems = [GemmProblem("bf16", M, 40, 48, "fp16") for M in (1, 17)]
    first, s1 = tune(TUNABLE, problems, DEVICE, settings(tmp_path / "journal.sqlite"))
    assert (s1.measured, s1.reused, s1.candidates) == (3, 0, 3)
    again, s2 = tune(TUNABLE, problems, DEVICE, settings(tmp_path / "journal.sqlite"))
    assert (s2.measured, s2.reused, s2.compiled) == (0, s2.candidates, 0)
    assert s2.candidates == s1.candidates
    for r1, r2 in zip(first, again, strict=True):
        assert r1.problem == r2.problem
        assert r1.best is not None and r1.best.ok
        assert (r2.best.config, r2.best.time_us) == (r1.best.config, r1.best.time_us)
        assert [(m.config, m.status, m.time_us) for m in r2.measurements] == \
               [(m.config, m.status, m.time_us) for m in r1.measurements]


def test_run_killed_mid_way_resumes_without_remeasuring(tmp_path):
    out = tmp_path / "out"
    journal = out / f"journal-{DEVICE.slug}.sqlite"
    Ms = (1, 2, 3, 17, 18, 19, 20, 31)  # 1 + 1 + 1 + 5 x 2 = 13 candidates: seconds of interpreted work
    space = space_file(tmp_path, INTERPRETER_SPACE)
    cmd = [sys.executable, "-m", "tritune.cli", "gemm", "--kernel", "bf16", "--dtype", "fp16", "--n", "40",
           "--k", "48", "--m", ",".join(map(str, Ms)), "-o", str(out), "--search-space", str(space),
           "--iters", "2", "--warmup", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while journal_rows(journal) == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its benchmark workers: no clean-up runs
        except ProcessLookupError:  # the whole group already exited; the returncode check below says so
            pass
        _, err = proc.communicate(timeout=30)
    before = journal_rows(journal)
    assert before >= 1, err.decode()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed: give it more work"

    req = GemmTuneRequest("bf16", (GemmShape(Ms, 40, 48),), out, dtype="fp16", space_file=space)
    report = tune_gemm(req, DEVICE, settings(journal))
    summary = report.summary
    assert before < summary.candidates == 13
    assert summary.reused == before
    assert summary.measured == summary.candidates - summary.reused
    assert journal_rows(journal) == summary.candidates
    assert not report.failed_problems
    assert (out / f"{DEVICE.slug}-GEMM-BF16-N=40-K=48.json").is_file()
    assert (out / f"{DEVICE.slug}-GEMM-BF16.json").is_file()


def test_summary_counts_add_up(two_shapes):
    _, report = two_shapes
    s = report.summary
    assert s.problems == 4 and s.space_size == 4 * 4
    assert sum(s.pruned.values()) + s.candidates == s.space_size
    # First failing rule counts: M=1 loses BLOCK_SIZE_M=32 twice, K < 64 loses the other split-K configs.
    assert dict(s.pruned) == {"BLOCK_SIZE_M above next_pow2(M)": 4, "BLOCK_SIZE_K x NUM_KSPLIT > K": 6}
    assert (s.candidates, s.measured, s.reused) == (6, 6, 0)
    assert s.compiled == 4  # one binary per (N, K, config): M is not specialized
    assert not s.failed and not s.compile_failed
    assert s.wall_s >= s.bench_wall_s > 0
    text = "\n".join(s.lines())
    assert "16 in the spaces, 10 pruned, 6 kept, 0 reused" in text
    # Each rule's count stands apart from the rule's own text (not "next_pow2(M)=4", read as a value of M's).
    assert "pruned by rule: BLOCK_SIZE_K x NUM_KSPLIT > K (6), BLOCK_SIZE_M above next_pow2(M) (4)" in text
    wall = next(line for line in s.lines() if line.startswith("wall:"))
    assert "compiling" in wall and "benchmarking" in wall


def test_shape_files_bucket_by_m_and_default_file_votes(two_shapes):
    out, report = two_shapes
    slug = DEVICE.slug
    names = [f"{slug}-GEMM-BF16-N=24-K=40.json", f"{slug}-GEMM-BF16-N=40-K=48.json", f"{slug}-GEMM-BF16.json"]
    assert sorted(p.name for p in report.files) == names
    docs = {name: json.loads((out / name).read_text()) for name in names}
    for name in names[:2]:
        doc = docs[name]
        by_M = doc["tritune"]["by_M"]
        assert sorted(by_M, key=int) == ["1", "17"]
        assert set(doc) == {"small", "any", "tritune"}  # 1 and 17 are both under 32
        assert doc["small"] == doc["any"] == by_M["17"]["config"]  # the largest M of each
        assert by_M["1"]["config"]["BLOCK_SIZE_M"] == 16  # the only config kept for M=1
    default = docs[names[2]]
    assert default["tritune"]["from_shapes"] == [{"N": 24, "K": 40}, {"N": 40, "K": 48}]
    assert set(default) == {"small", "any", "tritune"}
    for bucket, votes in default["tritune"]["votes"].items():
        ballots = [docs[name][bucket] for name in names[:2]]
        assert votes["shapes"] == 2
        assert default[bucket] in ballots and votes["votes"] == ballots.count(default[bucket])


# ---- finalists: re-timed as the op runs, ranked by the objective ------------------------------------------------

# A has the least GPU time but 5 ms of host cost per call (say four launches through a slow launcher); B and C pay
# almost none. The first pass (GPU time) ranks A, B, C; the top 2 are finalists.
OP = ScriptedOp((("A", 10.0, 5.0), ("B", 20.0, 0.0), ("C", 30.0, 0.0)))
SCRIPTED = Timers(gpu=scripted_gpu_time, graph=scripted_graph_time)  # eager: the real time_eager, host cost and all


def op_settings(journal: Path, objective: Objective, finalists: int = 2, timers: Timers = SCRIPTED) -> TuneSettings:
    bench = BenchSettings(iters=2, warmup=0, timeout_s=60.0, seed=0, flush_l2=False, timers=timers)
    return TuneSettings(journal_path=journal, bench=bench, progress=False, finalists=finalists, objective=objective)


def by_name(result) -> dict:
    return {m.config["name"]: m for m in result.measurements}


def test_eager_objective_picks_low_host_cost_and_graph_picks_low_gpu_time(tmp_path):
    journal = tmp_path / "journal.sqlite"
    (eager,), s1 = tune(OP, [OpProblem()], DEVICE, op_settings(journal, Objective.EAGER))
    ms = by_name(eager)
    assert eager.gpu_best.config["name"] == "A"  # the first pass ranks by GPU time
    assert eager.best.config["name"] == "B"  # ... but A's host cost makes it the slower op to call
    assert ms["A"].eager_us >= 5000.0 > 1000.0 > ms["B"].eager_us  # the sleep is real; B's copy takes microseconds
    assert (ms["A"].graph_us, ms["B"].graph_us) == (10.0, 20.0)  # a graph replay hides the host cost
    assert (ms["A"].time_us, ms["B"].time_us, ms["C"].time_us) == (10.0, 20.0, 30.0)  # GPU time kept as measured
    assert not ms["C"].retimed and math.isnan(ms["C"].graph_us)  # third by GPU time: not a finalist
    assert eager.best is ms["B"]  # the winner is one of the measurements (callers compare by identity)
    assert (s1.measured, s1.retimed, s1.retimed_reused) == (3, 2, 0)
    assert "finalists timed as the op runs: 2 (0 reused from the journal)" in s1.lines()

    # The op times are in the journal: the graph objective on the same journal measures nothing and picks A.
    (graph,), s2 = tune(OP, [OpProblem()], DEVICE, op_settings(journal, Objective.GRAPH))
    assert graph.best.config["name"] == "A"
    assert (s2.measured, s2.reused, s2.retimed, s2.retimed_reused) == (0, 3, 0, 2)
    assert by_name(graph)["A"].eager_us == ms["A"].eager_us
    with Journal(journal) as j:
        stored = {m.config["name"]: m for m in j.measurements(journal_key(DEVICE, OpProblem(), OP)).values()}
    assert stored["B"].eager_us == ms["B"].eager_us and stored["B"].graph_us == 20.0
    assert stored["B"].extra["graph_method"] == "scripted graph replay"


def test_a_lent_compile_pool_serves_several_passes_and_is_left_open(tmp_path):
    """The fused-MoE tuner lends one pool to its stage search and its re-time (a pool of every core takes seconds to
    start): tune() submits to it and leaves it open; the caller shuts it down."""
    submitted = []

    class CountingPool(CompilePool):
        def submit(self, problem, config):
            submitted.append(config["name"])
            return super().submit(problem, config)

    pool = CountingPool(OP, max_workers=1)
    for objective in (Objective.EAGER, Objective.GRAPH):  # two passes, two journals: each compiles all three
        (r,), _ = tune(OP, [OpProblem()], DEVICE, op_settings(tmp_path / f"{objective.value}.sqlite", objective),
                       pool=pool)
        assert r.best is not None
    assert sorted(submitted) == ["A", "A", "B", "B", "C", "C"]
    assert pool.submit(OpProblem(), by_name(r)["A"].config).result().status.value == "ok"  # still open
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(OpProblem(), by_name(r)["A"].config)


def test_no_finalists_leaves_gpu_time_to_pick(tmp_path):
    (r,), summary = tune(OP, [OpProblem()], DEVICE, op_settings(tmp_path / "j.sqlite", Objective.EAGER, finalists=0))
    assert r.best is r.gpu_best and r.best.config["name"] == "A"
    assert summary.retimed == 0 and not any(m.retimed for m in r.measurements)


def test_graph_objective_without_a_captured_graph_falls_back_to_gpu_time(tmp_path):
    timers = Timers(gpu=scripted_gpu_time, graph=failing_graph_time)
    (r,), _ = tune(OP, [OpProblem()], DEVICE, op_settings(tmp_path / "j.sqlite", Objective.GRAPH, timers=timers))
    ms = by_name(r)
    assert r.best.config["name"] == "A"  # no finalist has a graph time: the least GPU time among them wins
    assert ms["A"].retimed and math.isnan(ms["A"].graph_us) and ms["A"].ok  # a failed capture fails nothing
    assert ms["A"].extra["graph_error"] == "capture failed: scripted"


def test_auto_objective_ranks_host_bound_finalists_by_graph_time(tmp_path):
    """AUTO (the default): graph time where the finalists' least host cost is at least half their least GPU time,
    eager time elsewhere; the host cost each eager re-time measured is journalled (extra["host_us"])."""
    timers = Timers(gpu=scripted_gpu_time, graph=scripted_graph_time, eager=scripted_eager_time)
    bound = ScriptedOp((("fast", 40.0, 0.045), ("slow", 48.0, 0.035)))  # host 45 / 35 µs against GPU 40 / 48
    (r,), _ = tune(bound, [OpProblem()], DEVICE, op_settings(tmp_path / "a.sqlite", Objective.AUTO, timers=timers))
    ms = by_name(r)
    assert ms["fast"].eager_us == pytest.approx(45.0) and ms["slow"].eager_us == 48.0
    assert ms["fast"].host_us == pytest.approx(45.0)
    assert r.best.config["name"] == "fast"  # graph time 40 against 48 (eager agrees here)
    noisy = ScriptedOp((("fast", 40.0, 0.060), ("slow", 48.0, 0.035)))  # fast's host batches landed high
    (r,), _ = tune(noisy, [OpProblem()], DEVICE, op_settings(tmp_path / "b.sqlite", Objective.AUTO, timers=timers))
    assert r.best.config["name"] == "fast"
    (r,), _ = tune(noisy, [OpProblem()], DEVICE, op_settings(tmp_path / "b.sqlite", Objective.EAGER, timers=timers))
    assert r.best.config["name"] == "slow"  # eager picks on the host noise
    (r,), _ = tune(OP, [OpProblem()], DEVICE, op_settings(tmp_path / "c.sqlite", Objective.AUTO, timers=timers))
    assert r.best.config["name"] == "B"  # A's 5 ms of host cost is no noise: B is cheap on the host, eager decides
    assert TuneSettings(tmp_path / "j").objective is Objective.AUTO


def test_settings_check_objective_and_finalists(tmp_path):
    assert TuneSettings(tmp_path / "j", objective="graph").objective is Objective.GRAPH
    with pytest.raises(ValueError, match="'wall' is not a valid Objective"):
        TuneSettings(tmp_path / "j", objective="wall")
    with pytest.raises(ValueError, match="finalists must be an integer >= 0"):
        TuneSettings(tmp_path / "j", finalists=-1)


def test_journal_from_before_op_times_resumes_and_retimes_only_the_finalists(tmp_path):
    path = tmp_path / "old.sqlite"
    jkey = journal_key(DEVICE, OpProblem(), OP)
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    for name, us in (("A", 10.0), ("B", 20.0), ("C", 30.0)):  # the first pass, done by an older tritune
        conn.execute("INSERT INTO measurements VALUES (?, ?, 'ok', ?, 0.0, 0.0, '', '{}', 0.0)",
                     (jkey, f'{{"name":"{name}"}}', us))
    conn.commit()
    conn.close()
    (r,), summary = tune(OP, [OpProblem()], DEVICE, op_settings(path, Objective.EAGER))
    assert (summary.measured, summary.reused, summary.retimed) == (0, 3, 2)
    assert r.best.config["name"] == "B" and not by_name(r)["C"].retimed


def test_early_stop_cuts_slow_candidates_short_and_keeps_the_winner(tmp_path):
    """A first: its 10 µs sets the cutoff at 15 µs, so C (40) and D (100) stop after the probe; B (12) is timed in
    full; A still wins, and the summary counts the stopped."""
    op = ScriptedOp((("A", 10.0, 0.0), ("B", 12.0, 0.0), ("C", 40.0, 0.0), ("D", 100.0, 0.0)))
    bench = BenchSettings(iters=4, warmup=0, timeout_s=60.0, seed=0, flush_l2=False, timers=SCRIPTED,
                          early_stop_iters=2)
    settings = TuneSettings(journal_path=tmp_path / "j.sqlite", bench=bench, progress=False, finalists=0)
    (r,), summary = tune(op, [OpProblem()], DEVICE, settings)
    ms = by_name(r)
    assert r.best.config["name"] == "A"
    assert ms["C"].extra["early_stop"] == 2 and ms["D"].extra["early_stop"] == 2
    assert "early_stop" not in ms["A"].extra and "early_stop" not in ms["B"].extra
    assert summary.early_stopped == 2 and "(2 stopped after the early-stop probe)" in " ".join(summary.lines())
    off = dataclasses.replace(settings, journal_path=tmp_path / "k.sqlite",
                              bench=dataclasses.replace(bench, early_stop_factor=0))
    (r2,), summary2 = tune(op, [OpProblem()], DEVICE, off)
    assert summary2.early_stopped == 0 and r2.best.config["name"] == "A"


def test_compile_lead_runs_the_pool_as_fast_as_the_gpus_consume(tmp_path):
    """compile_lead N: nothing compiled waiting -> the whole pool; waiting in proportion -> fewer processes; N a GPU
    worker or more -> one; off (0) -> the pool is never touched."""
    from types import SimpleNamespace

    from tritune.tuning.tuner import _Pipeline

    limits = []
    pool = SimpleNamespace(slots=64, set_limit=limits.append)
    pipe = SimpleNamespace(settings=TuneSettings(tmp_path / "j", compile_lead=8), pool=pool,
                           executor=SimpleNamespace(slots=4))
    for queued in (0, 8, 16, 31, 32, 100):
        _Pipeline._govern_compiles(pipe, queued)
    assert limits == [64, 48, 32, 2, 1, 1]
    pipe.settings = TuneSettings(tmp_path / "j")
    _Pipeline._govern_compiles(pipe, 0)
    assert limits == [64, 48, 32, 2, 1, 1]  # off: no call
    with pytest.raises(ValueError, match="compile_lead must be an integer >= 0"):
        TuneSettings(tmp_path / "j", compile_lead=-1)


def test_a_governed_lent_pool_is_back_at_full_size_after_the_pass(tmp_path):
    limits = []

    class RecordingPool(CompilePool):
        def set_limit(self, limit):
            limits.append(limit)
            super().set_limit(limit)

    pool = RecordingPool(OP, max_workers=1)
    settings_ = dataclasses.replace(op_settings(tmp_path / "j.sqlite", Objective.EAGER), compile_lead=2)
    (r,), _ = tune(OP, [OpProblem()], DEVICE, settings_, pool=pool)
    assert r.best is not None and limits and limits[-1] is None
    pool.shutdown()
