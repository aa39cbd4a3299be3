"""Online tuning (TRITUNE_ONLINE_TUNE=1) against the interpreter: off by default; the first call of an untuned GEMM or
fused-MoE shape tunes it into TRITUNE_CONFIG_DIR and later calls (and a second process) use the file; a failing tune
falls back to the heuristic with one warning; the engine's wall-clock limit; the seam keeps ops free of tuners."""

from __future__ import annotations

import ast
import json
import os
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from fake_tunables import OpProblem, ScriptedOp

from tritune import knobs, online_tune
from tritune.device import current_device
from tritune.kernels import gemm as gk
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.ops import online
from tritune.ops.fused_moe import fused_moe, fused_moe_choice, reload_moe_configs
from tritune.ops.gemm import gemm, heuristic_config, reload_configs, select_config
from tritune.store import fmoe_csv, gemm_json
from tritune.store.fmoe_csv import read_tuned
from tritune.tuners import fused_moe as fmoe_tuner
from tritune.tuners import gemm as gemm_tuner
from tritune.tuning.tuner import TuneSettings, tune
from tritune.tuning.types import BenchSettings

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
DEVICE = current_device()  # "cpu-interpreter" without a GPU
CPU = torch.device("cpu")
# M=5 under every 16-row block, N=40 and K=48 off the 32-wide blocks (masked edges); fp16 operands, as the
# interpreter's tl.dot is wrong on bf16 ones.
M, N, K = 5, 40, 48
SHAPE_FILE = f"{DEVICE.slug}-GEMM-BF16-N={N}-K={K}.json"
# D=40 masks a K block, I=24 < BLOCK_SIZE_N=32 masks N; 5 tokens top-2 of 4 experts.
T, D, INTER, E, TOPK = 5, 40, 24, 4, 2


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """TRITUNE_CONFIG_DIR = an empty folder, no shipped configs, a generous budget (the interpreter is slow), online
    tuning off, every cache and the seam's memory dropped before and after."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv(knobs.CONFIG_DIR, str(cfg))
    monkeypatch.setenv(knobs.ONLINE_BUDGET, "60")
    monkeypatch.delenv(knobs.ONLINE_TUNE, raising=False)
    monkeypatch.delenv(knobs.CONFIG_FMOE, raising=False)
    monkeypatch.setattr(gemm_json, "PACKAGE_DIR", tmp_path / "shipped")
    monkeypatch.setattr(fmoe_csv, "PACKAGE_CONFIGS", tmp_path / "shipped")
    # Spawned benchmark workers and the second process import tritune and fake_tunables from this checkout.
    paths = [str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    _forget()
    yield cfg
    _forget()
    for kind in ("gemm", "fused_moe"):
        online.set_tuner(kind, None)


def _forget() -> None:
    online.reset()
    reload_configs()
    reload_moe_configs()


def counting(kind: str, fn=None) -> list:
    """Register a tuner of `kind` that records its requests and then runs `fn` (None: does nothing)."""
    calls = []

    def tuner(request, folder, budget_s):
        calls.append((request, folder, budget_s))
        if fn is not None:
            fn(request, folder, budget_s)

    online.set_tuner(kind, tuner)
    return calls


def gemm_inputs(rows: int = M) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, K, generator=gen).half()
    b = (torch.randn(N, K, generator=gen) / K**0.5).half()  # keeps C ~ N(0, 1)
    return a, b


def check_gemm(rows: int = M) -> None:
    a, b = gemm_inputs(rows)
    torch.testing.assert_close(gemm(a, b).float(), gk.gemm_reference("bf16", a, b), atol=1e-2, rtol=1e-2)


def moe_inputs(tokens: int = T):
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, D, generator=g).half()
    w1 = (torch.randn(E, 2 * INTER, D, generator=g) / D**0.5).half()
    w2 = (torch.randn(E, D, INTER, generator=g) / INTER**0.5).half()
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, E, generator=g), dim=-1), TOPK)
    return hidden, w1, w2, weights, ids.to(torch.int32)


def check_moe(tokens: int = T):
    hidden, w1, w2, weights, ids = moe_inputs(tokens)
    out = fused_moe(hidden, w1, w2, weights, ids)
    choice = fused_moe_choice(hidden, w1, w2, ids)
    ref = fused_moe_reference(hidden, w1, w2, weights, ids, requantize_intermediate=not choice.run_1stage)
    assert (out.float() - ref).norm() / ref.norm() < 1e-2
    return choice


def journal_rows(path: Path) -> int:
    conn = sqlite3.connect(path, timeout=5.0)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])
    finally:
        conn.close()


def online_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "online tuning" in str(w.message) or "TRITUNE_ONLINE" in str(w.message)]


def second_process(kind: str) -> dict:
    """Run the op in a fresh process with this environment; it reports the choice's source, whether its (spy) tuner
    was called and whether the result matched the reference."""
    code = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
import test_online_tune as t
from tritune.ops import online
calls = []
online.set_tuner({kind!r}, lambda *args: calls.append(args))
if {kind!r} == "gemm":
    t.check_gemm()
    source = t.select_config("bf16", t.M, t.N, t.K, t.CPU)[1]
else:
    source = t.check_moe().source
print(json.dumps({{"source": source, "tuned": len(calls)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_off_by_default_a_miss_is_the_heuristic_and_writes_nothing(folder):
    calls = {kind: counting(kind) for kind in ("gemm", "fused_moe")}
    check_gemm()
    assert select_config("bf16", M, N, K, CPU) == (heuristic_config("bf16", M, N, K, DEVICE.sm_count), "heuristic")
    assert check_moe().source == "heuristic"
    assert calls == {"gemm": [], "fused_moe": []}
    assert list(folder.iterdir()) == []


def test_on_without_a_config_dir_warns_once_and_uses_the_heuristic(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")
    monkeypatch.delenv(knobs.CONFIG_DIR)
    _forget()
    calls = counting("gemm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (M, M + 2):  # two misses: one warning
            check_gemm(rows)
            assert select_config("bf16", rows, N, K, CPU)[1] == "heuristic"
    assert calls == []
    [message] = online_warnings(caught)
    assert "TRITUNE_ONLINE_TUNE=1 needs TRITUNE_CONFIG_DIR" in message


def test_gemm_first_call_tunes_persists_and_a_second_process_reuses_it(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")
    calls = counting("gemm", online_tune.tune_gemm_online)  # the real tuner, counted
    check_gemm()  # the first call tunes (the caller waits), then runs with the tuned config
    path = folder / SHAPE_FILE
    assert [c[0] for c in calls] == [online.GemmRequest("bf16", M, N, K, -1)] and calls[0][1:] == (folder, 60.0)
    doc = json.loads(path.read_text())["tritune"]
    assert sorted(doc["by_M"]) == [str(M)] and doc["provenance"]["name"] == DEVICE.name
    journal = folder / f"journal-{DEVICE.slug}.sqlite"
    rows = journal_rows(journal)
    assert rows >= 1  # beside the shape file, where the CLI keeps it
    config, source = select_config("bf16", M, N, K, CPU)
    assert source == f"shape file {path}: tuned M={M}"
    assert gk.GemmConfig.from_params(doc["by_M"][str(M)]["config"]) == config
    # Another M of the tuned shape is not a miss: the off-grid choice over the shape file serves it, no tune.
    check_gemm(9)
    assert select_config("bf16", 9, N, K, CPU)[1].startswith(f"shape file {path}: off-grid: M=9")
    assert len(calls) == 1
    # A second process with the same environment finds the file; its tuner is never called, nothing is measured.
    assert second_process("gemm") == {"source": f"shape file {path}: tuned M={M}", "tuned": 0}
    assert journal_rows(journal) == rows


def test_a_failing_tuner_falls_back_with_one_warning(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")

    def broken(request, folder, budget_s):
        raise RuntimeError("scripted failure")

    calls = counting("gemm", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (M, 9, M):  # three calls of one shape, two of them misses: one tune, one warning
            check_gemm(rows)
            assert select_config("bf16", rows, N, K, CPU) == (heuristic_config("bf16", rows, N, K, DEVICE.sm_count),
                                                               "heuristic")
    assert len(calls) == 1
    [message] = online_warnings(caught)
    assert message == (f"tritune: online tuning of GEMM bf16 N={N} K={K} (M={M}) failed (RuntimeError: scripted "
                       "failure); using the heuristic")
    assert list(folder.iterdir()) == []


def test_a_real_tune_with_no_candidate_falls_back_with_one_warning(folder, monkeypatch):
    # Every BLOCK_SIZE_M of this space is pruned for M=5: the engine runs and finds nothing to measure.
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")
    monkeypatch.setattr(gemm_tuner, "INTERPRETER_SPACE", {**gemm_tuner.INTERPRETER_SPACE, "BLOCK_SIZE_M": (64,)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_gemm()
    [message] = online_warnings(caught)
    assert "online tuning of GEMM bf16" in message and "no candidate passed within 60s" in message
    assert select_config("bf16", M, N, K, CPU)[1] == "heuristic"
    assert not (folder / SHAPE_FILE).exists()


def test_bad_knob_values_are_one_line_errors_naming_them(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "sometimes")
    with pytest.raises(ValueError, match="^TRITUNE_ONLINE_TUNE='sometimes' is not a boolean"):
        select_config("bf16", M, N, K, CPU)
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")
    monkeypatch.setenv(knobs.ONLINE_BUDGET, "-1")
    with pytest.raises(ValueError, match="^TRITUNE_ONLINE_BUDGET='-1' is not a number of seconds > 0"):
        select_config("bf16", M, N, K, CPU)


def test_a_shape_tuned_by_another_process_while_waiting_is_not_tuned_again(folder):
    # What a process finds once it holds the shape file's lock after another one wrote the file.
    entry = gemm_json.GemmEntry(M=17, config=gemm_json.Config.from_dict({"BLOCK_SIZE_M": 16}), time_us=1.0,
                                tflops=1.0, gbps=1.0, error=0.0)
    gemm_json.write_shape_file(folder, DEVICE.provenance(), "BF16", N, K, {17: entry}, device_slug=DEVICE.slug)
    online_tune.tune_gemm_online(online.GemmRequest("bf16", M, N, K, -1), folder, 60.0)
    assert sorted(p.name for p in folder.iterdir()) == [SHAPE_FILE]  # no journal, no lock beside it


def test_fused_moe_first_call_tunes_persists_and_a_second_process_reuses_it(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")
    # KSPLIT 1 only: one stage-1, one stage-2 and one 1-stage candidate, so the interpreted tune takes seconds.
    monkeypatch.setattr(fmoe_tuner, "INTERPRETER_STAGE_SPACE", {**fmoe_tuner.INTERPRETER_STAGE_SPACE, "KSPLIT": (1,)})
    calls = counting("fused_moe", online_tune.tune_fmoe_online)
    choice = check_moe()
    csv_path = folder / "tuned_fmoe.csv"
    assert len(calls) == 1 and calls[0][0].shape.token == T and calls[0][0].device == -1
    [row] = read_tuned(csv_path)
    assert (row.shape.token, row.shape.model_dim, row.shape.inter_dim, row.cu_num) == (T, D, INTER, DEVICE.cu_num)
    assert choice.source == f"tuned: {csv_path}, row 1 (line 2)"
    # The file is one of those the op reads when TRITUNE_CONFIG_DIR is set, before the shipped ones.
    assert fmoe_csv.default_config_files()[0] == csv_path
    # Another token count of the tuned shape is not a miss: the rows of the shape serve it (off-grid), no tune.
    assert f"tuned rows from {csv_path}" in check_moe(9).source
    assert len(calls) == 1
    assert second_process("fused_moe") == {"source": f"tuned: {csv_path}, row 1 (line 2)", "tuned": 0}


def test_a_failing_moe_tuner_falls_back_with_one_warning(folder, monkeypatch):
    monkeypatch.setenv(knobs.ONLINE_TUNE, "1")

    def broken(request, folder, budget_s):
        raise OSError("disk full")

    counting("fused_moe", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_moe().source == "heuristic"
        assert check_moe(9).source == "heuristic"  # same shape, another token count: no second try
    [message] = online_warnings(caught)
    assert message.startswith("tritune: online tuning of fused MoE token=5,model_dim=40") and "OSError: disk full" \
        in message


def test_time_limit_stops_measuring_and_a_rerun_resumes(tmp_path, monkeypatch):
    # Every candidate sleeps 100 ms per call (about half a second per candidate); two problems searched one after
    # the other share 3 s, so each gets some of its 6 candidates measured and not all.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    tunable = ScriptedOp(tuple((f"c{i}", 1.0, 100.0) for i in range(6)))
    problems = [OpProblem(64), OpProblem(65)]
    bench = BenchSettings(iters=2, warmup=1, timeout_s=60.0)
    journal = tmp_path / "journal.sqlite"
    limited = TuneSettings(journal_path=journal, bench=bench, progress=False, strategy="random", finalists=0,
                           time_limit_s=3.0)
    start = time.monotonic()
    results, summary = tune(tunable, problems, DEVICE, limited)
    assert time.monotonic() - start < 30  # start-up, 3 s, and stopping a worker mid-candidate
    for r in results:
        measured = [m for m in r.measurements if "time limit" not in m.message]
        assert 1 <= len(measured) < 6 and r.best is not None and r.best.ok
    assert summary.unmeasured > 0 and "left unmeasured (time limit)" in "\n".join(summary.lines())
    assert journal_rows(journal) == summary.measured  # what the limit left out is not journaled
    again, resumed = tune(tunable, problems, DEVICE, TuneSettings(journal_path=journal, bench=bench, progress=False,
                                                                 strategy="random", finalists=0))
    assert resumed.reused == summary.measured and resumed.measured == 12 - summary.measured
    assert resumed.unmeasured == 0 and all(len(r.measurements) == 6 for r in again)


def test_time_limit_must_be_positive(tmp_path):
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="time_limit_s must be a finite number > 0"):
            TuneSettings(journal_path=tmp_path / "j", time_limit_s=bad)


def test_ops_never_import_the_tuners():
    # The seam names its provider by a string; no module of ops/ imports tuners, the engine's tuner or the provider
    # (tests/test_import_layers.py checks every other import of the ops).
    assert online.PROVIDER == "tritune.online_tune"
    for path in (SRC / "tritune" / "ops").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("tritune.tuners", "tritune.online_tune", "tritune.tuning.tuner",
                                            "tritune.tuning.strategy")), f"{path.name} imports {name}"
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not any((getattr(n, "module", "") or "").startswith("tritune.tuning") for n in top), path.name
