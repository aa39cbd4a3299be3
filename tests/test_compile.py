"""CompilePool and failure classification: errors become outcomes, a crashing compile is pinned and survived."""

from __future__ import annotations

import os
import time
from concurrent.futures import wait
from pathlib import Path

import fake_tunables
import pytest
from fake_tunables import AddProblem, ScriptedAdd
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from tritune.tuning.compile import CompilePool
from tritune.tuning.errors import classify_exception, is_sticky, short_message
from tritune.tuning.types import Config, Status

P = AddProblem(64)


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    # Spawned compile workers unpickle fake_tunables: make it importable whatever the pytest import mode.
    here = Path(__file__).resolve().parent
    paths = [str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # Spawned, not forked from the fork server: a server started here would keep TRITON_INTERPRET unset for every
    # later test of this process (tuning/processes.py), which then compiles for a GPU that is not there.
    monkeypatch.setenv("TRITUNE_START_METHOD", "spawn")


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (OutOfResources(300000, 232448, "shared memory"), Status.OUT_OF_RESOURCES),
        (RuntimeError("PTXAS error: Internal Triton PTX codegen error"), Status.PTXAS_ERROR),
        (RuntimeError("ptxas fatal: Unresolved extern function"), Status.PTXAS_ERROR),
        (CompilationError("x = tl.load(p)", None, "unsupported"), Status.COMPILE_ERROR),
        (RuntimeError("PassManager::run failed"), Status.COMPILE_ERROR),  # MLIR pipeline failure
        (RuntimeError("CUDA error: an illegal memory access was encountered"), Status.CRASHED),
        (RuntimeError("Triton Error [CUDA]: unspecified launch failure"), Status.CRASHED),
        (RuntimeError("CUDA error: misaligned address"), Status.CRASHED),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), Status.RUNTIME_ERROR),  # not sticky
        (ValueError("CUDA error: but not a RuntimeError"), Status.RUNTIME_ERROR),
        (KeyError("x"), Status.RUNTIME_ERROR),
    ],
)
def test_classify_exception(exc, status):
    assert classify_exception(exc) is status
    assert is_sticky(status) == (status is Status.CRASHED)


def test_short_message():
    assert short_message(CompilationError("x = tl.load(p)\ny = 2", None, "\nbad index\nmore")) == (
        "CompilationError: bad index"
    )  # the error, not the kernel source
    assert short_message(RuntimeError("\n  CUDA error: boom  \nCUDA kernel errors might be...")) == (
        "RuntimeError: CUDA error: boom"
    )
    assert len(short_message(RuntimeError("x" * 1000))) == 300
    assert short_message(RuntimeError()) == "RuntimeError"


def test_pool_classifies_failures():
    fake_tunables.COMPILE_PIDS.clear()
    modes = ["ok", "oor", "ptxas", "compile_error", "value_error"]
    with CompilePool(ScriptedAdd(), max_workers=2) as pool:
        assert not pool.inline
        futures = [pool.submit(P, Config.of(mode=mode)) for mode in modes]
        outcomes = [f.result(timeout=60) for f in futures]
    assert [o.status for o in outcomes] == [
        Status.OK,
        Status.OUT_OF_RESOURCES,
        Status.PTXAS_ERROR,
        Status.COMPILE_ERROR,
        Status.RUNTIME_ERROR,
    ]
    assert outcomes[0].message == "" and outcomes[0].seconds >= 0
    assert "shared memory" in outcomes[1].message and outcomes[4].message == "ValueError: bad launch grid"
    assert os.getpid() not in fake_tunables.COMPILE_PIDS  # ran in the pool's processes


@pytest.mark.parametrize("interpret", [True, False])
def test_inline_when_interpreting_or_single_worker(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    fake_tunables.COMPILE_PIDS.clear()
    pool = CompilePool(ScriptedAdd(), max_workers=8 if interpret else 1)
    assert pool.inline
    future = pool.submit(P, Config.of(mode="oor"))
    assert future.done() and future.result().status is Status.OUT_OF_RESOURCES  # completed before submit returned
    assert fake_tunables.COMPILE_PIDS == [os.getpid()]
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(P, Config.of(mode="ok"))


def test_crashing_compile_is_pinned_and_pool_recovers():
    modes = ["ok", "ok", "compile_exit", "ok", "oor", "ok"]
    with CompilePool(ScriptedAdd(), max_workers=2) as pool:
        futures = [pool.submit(P, Config.of(mode=mode, i=i)) for i, mode in enumerate(modes)]
        outcomes = [f.result(timeout=120) for f in futures]
        later = pool.submit(P, Config.of(mode="ok", i=99)).result(timeout=60)
    expected = {"ok": Status.OK, "oor": Status.OUT_OF_RESOURCES, "compile_exit": Status.CRASHED}
    # Jobs that shared the broken pool with the crasher are re-run, not blamed.
    assert [o.status for o in outcomes] == [expected[m] for m in modes]
    assert "died" in outcomes[2].message
    assert later.status is Status.OK


def test_shutdown_cancel_cancels_queued_jobs():
    pool = CompilePool(ScriptedAdd(), max_workers=2)
    futures = [pool.submit(P, Config.of(mode="ok", sleep=0.5, i=i)) for i in range(8)]
    assert futures[0].result(timeout=60).status is Status.OK  # the pool is up and busy
    pool.shutdown(cancel=True)
    done, not_done = wait(futures, timeout=30)  # cancelled futures must wake waiters too
    assert not not_done
    assert sum(f.cancelled() for f in futures) >= 5
    assert all(f.result().status is Status.OK for f in futures if not f.cancelled())


def test_prestart_spawns_every_process_before_the_first_compile():
    pool = CompilePool(ScriptedAdd(), max_workers=2)
    pool.prestart()
    for _ in range(600):  # the dispatcher creates the process pool and hands each process a warm-up
        processes = getattr(pool._pool, "_processes", None) or {}
        if len(processes) == 2:
            break
        time.sleep(0.05)
    assert len(processes) == 2
    assert pool.submit(P, Config.of(mode="ok")).result(timeout=60).status is Status.OK  # compiles as before
    pool.shutdown()
    pool.prestart()  # after shutdown: nothing, no error


def test_prestart_is_nothing_inline():
    pool = CompilePool(ScriptedAdd(), max_workers=1)
    pool.prestart()
    assert pool._thread is None and pool._pool is None


def test_compile_processes_run_at_the_lowest_priority():
    """A compile never takes a core from a GPU worker's host side (issue 17): the pool's processes drop to nice 19."""
    import subprocess
    import sys

    from tritune.tuning.compile import COMPILE_NICENESS

    code = "import os; from tritune.tuning.compile import lower_compile_priority as low; low(); print(os.nice(0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert COMPILE_NICENESS == 19 and int(out) == 19


def _until(condition, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_set_limit_caps_the_compiles_running_at_once_and_a_raise_takes_effect_at_once():
    pool = CompilePool(ScriptedAdd(), max_workers=3)
    pool.set_limit(0)  # clamped to 1
    serial = [pool.submit(P, Config.of(mode="ok", sleep=0.1, i=i)) for i in range(4)]
    assert all(f.result(timeout=60).status is Status.OK for f in serial)
    assert pool.peak_in_flight == 1
    # Raised while one long compile runs and two wait: the two start now, not when the first ends.
    slow = [pool.submit(P, Config.of(mode="ok", sleep=3.0, i=10 + i)) for i in range(3)]
    assert _until(lambda: pool.peak_in_flight == 1 and pool._events.empty())
    time.sleep(0.2)  # the dispatcher is now waiting for an event with two jobs held back
    pool.set_limit(99)  # clamped to the pool's 3
    assert _until(lambda: pool.peak_in_flight == 3, seconds=2.5)  # before the first 3-second compile can end
    assert all(f.result(timeout=60).status is Status.OK for f in slow)
    pool.shutdown()


def test_set_limit_is_nothing_inline():
    pool = CompilePool(ScriptedAdd(), max_workers=1)
    pool.set_limit(1)
    assert pool._thread is None and pool.submit(P, Config.of(mode="ok")).result().status is Status.OK
