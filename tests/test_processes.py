"""TRITUNE_START_METHOD: the compile pool and the GPU workers start from the context it names, and both still work
when forked from the fork server (which imported torch and Triton once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fake_tunables import AddProblem, ScriptedAdd

from tritune import knobs
from tritune.tuning.compile import CompilePool
from tritune.tuning.executor import LocalExecutor, run_all
from tritune.tuning.processes import FORKSERVER_PRELOAD, adopt_env, parent_env, process_context, start_server_early
from tritune.tuning.types import BenchSettings, Config, Status, Task

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    paths = [str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.delenv(knobs.START_METHOD, raising=False)


def test_the_context_follows_the_knob(monkeypatch):
    assert process_context().get_start_method() == "forkserver"  # the default on Linux
    monkeypatch.setenv(knobs.START_METHOD, "spawn")
    assert process_context().get_start_method() == "spawn"
    monkeypatch.setenv(knobs.START_METHOD, "forkserver")
    assert process_context().get_start_method() == "forkserver"
    assert FORKSERVER_PRELOAD[:2] == ["torch", "triton"]


def test_a_child_adopts_the_parents_environment_of_now():
    """A process forked from the fork server has the server's environment: it takes the parent's at its start."""
    saved = dict(os.environ)
    try:
        env = {**saved, "TRITUNE_TEST_ONLY": "new"}
        env.pop("HOME", None)
        adopt_env(env)
        assert os.environ.get("TRITUNE_TEST_ONLY") == "new" and "HOME" not in os.environ
        assert parent_env() == env
        adopt_env(None)  # nothing given: unchanged
        assert parent_env() == env
    finally:
        adopt_env(saved)
    assert dict(os.environ) == saved


def test_forked_children_see_a_knob_set_after_the_server_started(monkeypatch, tmp_path):
    """The server starts first (as the CLI starts it); a variable set afterwards still reaches the compile processes
    and the GPU workers, as it does with spawn."""
    monkeypatch.setenv(knobs.START_METHOD, "forkserver")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    start_server_early()
    log = tmp_path / "make_inputs.log"
    monkeypatch.setenv("TRITUNE_TEST_MARK", "set-after-the-server")
    with CompilePool(ScriptedAdd(), max_workers=1) as pool:
        outcome = pool.submit(AddProblem(8), Config.of(mode="env")).result(timeout=120)
    assert "TRITUNE_TEST_MARK=set-after-the-server" in outcome.message
    settings = BenchSettings(iters=2, warmup=0, timeout_s=5.0, seed=0, flush_l2=False)
    devices = [0] if torch.cuda.is_available() else None
    with LocalExecutor(ScriptedAdd(str(log)), num_workers=1, settings=settings, devices=devices) as ex:
        ex.wait_ready(120)
        (result,) = run_all(ex, [Task(0, AddProblem(100), Config.of(mode="good"))])
    assert result.ok and "set-after-the-server" in log.read_text()


def test_compile_pool_and_workers_run_forked_from_the_server(monkeypatch):
    monkeypatch.setenv(knobs.START_METHOD, "forkserver")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a pool of processes even without a GPU
    with CompilePool(ScriptedAdd(), max_workers=2) as pool:
        assert not pool.inline
        outcomes = [pool.submit(AddProblem(8), Config.of(mode=m)).result(timeout=120) for m in ("ok", "oor")]
    assert [o.status for o in outcomes] == [Status.OK, Status.OUT_OF_RESOURCES]
    settings = BenchSettings(iters=3, warmup=1, timeout_s=5.0, seed=0, flush_l2=False)
    devices = [0] if torch.cuda.is_available() else None
    with LocalExecutor(ScriptedAdd(), num_workers=1, settings=settings, devices=devices) as ex:
        ex.wait_ready(120)
        results = run_all(ex, [Task(0, AddProblem(100), Config.of(mode="good")),
                               Task(1, AddProblem(100), Config.of(mode="wrong"))])
    assert results[0].ok and results[1].status is Status.WRONG_ANSWER


def test_the_fork_servers_preload_imports_and_leaves_cuda_alone():
    """Every module the server preloads imports (a failing one is skipped silently by multiprocessing, so it is
    checked here), and importing them initialises no CUDA (a child forked after that could not)."""
    import subprocess
    import sys

    code = ("import importlib, sys, torch\n"
            f"for name in {FORKSERVER_PRELOAD!r}: importlib.import_module(name)\n"
            "sys.exit(3 if torch.cuda.is_initialized() else 0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
