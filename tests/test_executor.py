"""LocalExecutor on CPU workers: one result per task, failures isolated, hung and dead workers replaced."""

from __future__ import annotations

import math
import os
import time
import weakref
from pathlib import Path

import pytest
import torch
from fake_tunables import AddProblem, ScriptedAdd

from tritune.tuning.executor import LocalExecutor, run_all
from tritune.tuning.types import BenchSettings, Config, Status, Task

FAST = BenchSettings(iters=3, warmup=1, timeout_s=2.0, seed=0, flush_l2=False)
DEVICES = [0] if torch.cuda.is_available() else None  # on a GPU machine every worker shares GPU 0
P1 = AddProblem(1000)
P2 = AddProblem(777)  # odd length: "partial" leaves an uneven tail


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    # Spawned workers unpickle tritune and fake_tunables: make both importable whatever the pytest import mode.
    here = Path(__file__).resolve().parent
    paths = [str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def tasks_for(modes: list[str], problem: AddProblem = P1, first_id: int = 0) -> list[Task]:
    return [Task(first_id + i, problem, Config.of(mode=mode, i=first_id + i)) for i, mode in enumerate(modes)]


def test_every_task_gets_one_result_and_failures_are_isolated():
    modes = ["good", "wrong", "partial", "flaky", "raise", "hang", "good", "exit", "good", "sticky", "good", "good"]
    tasks = tasks_for(modes) + tasks_for(["good", "partial", "good"], P2, first_id=100)
    expected = {
        "good": Status.OK,
        "wrong": Status.WRONG_ANSWER,
        "partial": Status.WRONG_ANSWER,
        "flaky": Status.WRONG_ANSWER,
        "raise": Status.RUNTIME_ERROR,
        "hang": Status.TIMEOUT,
        "exit": Status.CRASHED,
        "sticky": Status.CRASHED,
    }
    with LocalExecutor(ScriptedAdd(), num_workers=2, settings=FAST, devices=DEVICES) as ex:
        results = run_all(ex, tasks)
        assert ex.pending() == 0
    (line,) = ex.summary_lines()
    counts = line.split("candidates per GPU ")[1].split(";")[0].split(", ")
    assert sum(map(int, counts)) == len(tasks)  # failures and replaced workers counted on their slot
    assert [m.extra["task_id"] for m in results] == [t.task_id for t in tasks]
    for task, m in zip(tasks, results, strict=True):
        assert m.status is expected[task.config["mode"]], (task, m)
        assert m.config == task.config and m.problem_key == task.problem.key()
    by_mode = {t.config["mode"]: m for t, m in zip(tasks, results, strict=True)}
    assert "unwritten" in by_mode["partial"].message
    assert by_mode["flaky"].message.startswith("after timing")  # passes once, fails under repetition
    assert by_mode["wrong"].error == 1.0 and by_mode["wrong"].time_us == float("inf")
    assert "illegal memory access" in by_mode["sticky"].message
    good = [m for m in results if m.ok]
    assert len(good) == 7  # including those queued behind the hang, the exit and the sticky error
    assert all(0 < m.time_us < 1e5 and m.error == 0.0 and set(m.extra) >= {"min_us", "max_us", "method"} for m in good)


def test_timeout_is_honoured_and_worker_replaced():
    with LocalExecutor(ScriptedAdd(), num_workers=1, settings=FAST, devices=DEVICES) as ex:
        ex.wait_ready(60)
        for task in tasks_for(["good", "hang", "good"]):
            ex.submit(task)
        times: dict[int, float] = {}
        results = {}
        start = time.monotonic()
        while ex.pending():
            for m in ex.poll(0.05):
                results[m.extra["task_id"]] = m
                times[m.extra["task_id"]] = time.monotonic() - start
    assert [results[i].status for i in range(3)] == [Status.OK, Status.TIMEOUT, Status.OK]
    hang_s = times[1] - times[0]
    assert FAST.timeout_s <= hang_s < FAST.timeout_s + 1.5, hang_s  # killed on time, not at the setup limit
    assert "worker killed" in results[1].message


def test_two_workers_share_one_problem_per_candidate(tmp_path):
    log = tmp_path / "make_inputs.log"
    with LocalExecutor(ScriptedAdd(str(log)), num_workers=2, settings=FAST, devices=DEVICES) as ex:
        ex.wait_ready(60)
        results = run_all(ex, tasks_for(["slow"] * 10))
    assert all(m.ok for m in results)
    (line,) = ex.summary_lines()
    assert line.startswith("local: 2 worker(s)") and "10 measurement(s)" in line
    counts = [int(c) for c in line.split("candidates per GPU ")[1].split(";")[0].split(", ")]
    assert len(counts) == 2 and sum(counts) == 10 and min(counts) >= 1
    idle = [float(x) for x in line.split("idle s per GPU ")[1].split(" (")[0].split(", ")]
    assert len(idle) == 2 and all(x >= 0 for x in idle)
    first, last = (float(x) for x in line.split("; ready ")[1].removesuffix("s after the start").split("-"))
    assert 0 <= first <= last < 60  # when the workers became ready (wait_ready allowed 60 s)
    started = [float(x) for x in line.split("; started ")[1].split("s;")[0].split("-")]
    assert 0 <= started[0] <= started[1] <= first  # each process started (the fork server ready) before it was ready
    assert ex.summary_lines() == [line]  # frozen at close
    assert {m.extra["worker"] for m in results} == {0, 1}  # balanced per candidate, not per problem
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and len({line.split()[0] for line in lines}) == 2  # inputs once per worker


def test_inputs_rebuilt_only_after_a_failure(tmp_path):
    log = tmp_path / "make_inputs.log"
    with LocalExecutor(ScriptedAdd(str(log)), num_workers=1, settings=FAST, devices=DEVICES) as ex:
        results = run_all(ex, tasks_for(["good", "good", "wrong", "good", "good"]))
    assert [m.status for m in results] == [Status.OK] * 2 + [Status.WRONG_ANSWER] + [Status.OK] * 2
    assert len(log.read_text().splitlines()) == 2  # first task, then after the wrong answer


def test_submit_and_poll_do_not_block():
    with LocalExecutor(ScriptedAdd(), num_workers=1, settings=FAST, devices=DEVICES) as ex:
        start = time.monotonic()
        for task in tasks_for(["good"] * 50):
            ex.submit(task)
        ex.poll(0.0)  # workers are still importing torch: nothing to hand out, nothing to wait for
        assert time.monotonic() - start < 0.5
        assert ex.pending() == 50
    with pytest.raises(RuntimeError):
        ex.submit(tasks_for(["good"])[0])


def test_a_passing_measurement_says_where_the_worker_spent_its_time():
    with LocalExecutor(ScriptedAdd(), num_workers=1, settings=FAST, devices=DEVICES) as ex:
        results = run_all(ex, tasks_for(["slow", "slow", "wrong"]))
    first, second, wrong = results
    # where the GPU timer parks the GPU (on a GPU), "time" comes with its park and queue seconds, and with the load of
    # the successor the task named (TRITUNE_WORKER_PRELOAD, on by default), run while the GPU ran the timed calls
    timer_keys = {"timer_parked", "timer_queued", "preload"} if torch.cuda.is_available() else set()
    assert set(first.extra["phase_ms"]) == {"inputs", "bind", "run", "rerun", "check", "time"} | timer_keys
    # "slow" sleeps 20 ms a call: two checked runs, then the timer's warm-up and timed calls
    assert first.extra["phase_ms"]["run"] >= 20 and first.extra["phase_ms"]["rerun"] >= 20  # one checked run each
    assert first.extra["phase_ms"]["time"] >= 20 * (FAST.iters + 1)
    # the comparison alone (the second candidate's: on a GPU the first comparison also loads torch's kernels)
    assert second.extra["phase_ms"]["check"] < second.extra["phase_ms"]["run"]
    assert second.extra["phase_ms"]["inputs"] < first.extra["phase_ms"]["inputs"] + 1.0  # inputs kept: ~0
    assert "phase_ms" not in wrong.extra  # only passing measurements carry it


def test_a_worker_keeps_recent_problems_inputs_and_rebuilds_after_a_failure(tmp_path, monkeypatch):
    """Back and forth between problems (what a GPU does when the compile pool runs barely ahead): each problem's
    inputs are built once while it is among the last KEPT_PROBLEMS + 1 served; a failure rebuilds them."""
    from tritune.tuning import worker

    monkeypatch.setattr(worker, "KEPT_PROBLEMS", 2)  # the sequence below is written for 2
    log = tmp_path / "make_inputs.log"
    runner = worker._Runner(ScriptedAdd(str(log)), torch.device("cpu"), FAST)
    p3, p4 = AddProblem(55), AddProblem(66)
    built = lambda: [line.split()[1] for line in log.read_text().splitlines()]  # noqa: E731
    for problem in (P1, P2, P1, P2, P1):
        state = runner.prepare(problem)
        assert state.key == problem.key() and state.inputs[0].numel() == problem.n
    assert built() == [P1.key(), P2.key()]
    for problem in (p3, p4, P1, P2):  # at p4 the least recently served, P2, was dropped; P1 was kept
        runner.prepare(problem)
    assert built()[2:] == [p3.key(), p4.key(), P2.key()]
    results = [runner.run(task, lambda: None) for task in tasks_for(["good", "wrong", "good"], P2, first_id=7)]
    assert [m.status for m in results] == [Status.OK, Status.WRONG_ANSWER, Status.OK]
    assert built()[5:] == [P2.key()]  # after the wrong answer, P2's inputs were made afresh
    runner.prepare(P1)  # still kept
    assert len(built()) == 6


def test_kept_inputs_give_way_when_the_gpu_is_short_of_room(monkeypatch):
    """Before a build the least recently served states go while the GPU in use plus the largest state built so far is
    over KEPT_MEMORY_SHARE of it; a build that runs out of memory drops every kept state and tries once more, after
    the failed attempt's allocations are released."""
    from types import SimpleNamespace

    from tritune.tuning import worker

    runner = worker._Runner(ScriptedAdd(), torch.device("cpu"), FAST)
    for problem in (P1, P2, AddProblem(55)):
        runner.prepare(problem)
    assert list(runner._kept) == [P1.key(), P2.key()]
    runner.device = torch.device("cuda")  # as a GPU worker: its memory figures scripted below
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=100))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 40 + 10 * len(runner._kept))  # 60 with 2
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner._make_room()
    assert list(runner._kept) == [P2.key()]  # 60 > 50, then 50 is not over half
    runner._largest_state = 5  # room for a state as large as the largest built so far: 50 + 5 > 50
    runner._make_room()
    assert not runner._kept
    runner._largest_state, runner._kept = 0, {P2.key(): None}
    attempts, first_attempt = [], []

    class Buffer:  # what an attempt allocated before it ran out
        pass

    def build_now(problem, key):
        attempts.append(len(runner._kept))
        buffer = Buffer()
        if len(attempts) == 1:
            first_attempt.append(weakref.ref(buffer))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        # the failed attempt's frame, and what it held, is gone before the retry (inside the except block the
        # traceback kept it, and on a GPU the retry ran out of memory too)
        assert first_attempt[0]() is None
        return worker._ProblemState(key, None, None, None)

    monkeypatch.setattr(runner, "_build_now", build_now)
    state = runner._build(AddProblem(66), "add:n=66")
    assert state.key == "add:n=66" and attempts == [1, 0] and not runner._kept
    with pytest.raises(torch.cuda.OutOfMemoryError):  # with nothing kept, running out of memory is the problem's
        attempts.clear()
        runner._build(AddProblem(77), "add:n=77")


def test_a_candidate_over_its_cutoff_stops_after_the_probe():
    """Early stop: `early_stop_iters` calls, and no more when even the fastest is over the task's cutoff; under it,
    `iters` calls in all; a finalist or no cutoff: `iters` calls, no probe."""
    import dataclasses

    settings = dataclasses.replace(FAST, iters=4, early_stop_iters=2)
    slow = Config.of(mode="slow", i=0)  # 20 ms a call
    # a cutoff under any time (on a GPU the timer sees the add kernel's microseconds, not the host's 20 ms)
    tasks = [Task(0, P1, slow, cutoff_us=1e-3), Task(1, P1, slow, cutoff_us=1e9), Task(2, P1, slow)]
    with LocalExecutor(ScriptedAdd(), num_workers=1, settings=settings, devices=DEVICES) as ex:
        stopped, kept, plain = run_all(ex, tasks)
    assert all(m.ok for m in (stopped, kept, plain))
    assert stopped.extra["early_stop"] == 2 and (torch.cuda.is_available() or stopped.time_us >= 20000.0)
    assert "early_stop" not in kept.extra and "early_stop" not in plain.extra
    # the probe alone against the probe and the rest of `iters`
    assert stopped.extra["phase_ms"]["time"] < kept.extra["phase_ms"]["time"]


def test_a_queued_task_takes_its_problems_cutoff_when_handed_out():
    task = Task(0, P1, Config.of(mode="good"))
    assert task.tightened({P1.key(): 50.0}).cutoff_us == 50.0
    assert task.tightened({P2.key(): 50.0}) is task  # another problem's
    assert Task(0, P1, task.config, cutoff_us=10.0).tightened({P1.key(): 50.0}).cutoff_us == 10.0  # already lower
    assert Task(0, P1, task.config, finalist=True).tightened({P1.key(): 50.0}).cutoff_us == math.inf


def test_a_measurement_reports_the_timers_park_and_queue_seconds(monkeypatch):
    """Inside "time", where a GPU timer parked the GPU: the sleep it asked for and the host's queueing behind it,
    the candidate's share of bench.PARK_TOTALS (absent where no timer parked, as on the CPU)."""
    import dataclasses

    from tritune.tuning import bench, worker

    def parking_timer(fn, *, iters, warmup, **kw):
        bench.PARK_TOTALS["parked"] += 0.003
        bench.PARK_TOTALS["queued"] += 0.001
        return bench.Timing(5.0, 4.0, 6.0, iters, "scripted")

    timers = dataclasses.replace(FAST.timers, gpu=parking_timer)
    runner = worker._Runner(ScriptedAdd(), torch.device("cpu"), dataclasses.replace(FAST, timers=timers))
    parked = runner.run(Task(0, P1, Config.of(mode="good")), lambda: None)
    still = dataclasses.replace(FAST.timers, gpu=lambda fn, *, iters, warmup, **kw: bench.Timing(5.0, 4.0, 6.0, iters,
                                                                                                "scripted"))
    plain = worker._Runner(ScriptedAdd(), torch.device("cpu"), dataclasses.replace(FAST, timers=still)).run(
        Task(1, P1, Config.of(mode="good")), lambda: None)
    assert parked.ok and parked.extra["phase_ms"]["timer_parked"] == pytest.approx(3.0)
    assert parked.extra["phase_ms"]["timer_queued"] == pytest.approx(1.0)
    assert plain.ok and "timer_parked" not in plain.extra["phase_ms"]


def test_a_worker_loads_its_likely_next_candidate_while_the_gpu_times(monkeypatch):
    """The task's likely successor is compiled (Triton's cache read) once, at the timer's wait on the GPU, its seconds
    reported as "preload"; a failing load does not fail the candidate; a job no timer reached is dropped."""
    import dataclasses

    import fake_tunables

    from tritune.tuning import worker

    timers = dataclasses.replace(FAST.timers, gpu=fake_tunables.host_job_gpu_time)
    runner = worker._Runner(ScriptedAdd(), torch.device("cpu"), dataclasses.replace(FAST, timers=timers))
    fake_tunables.COMPILE_PIDS.clear()
    m = runner.run(Task(0, P1, Config.of(mode="good"), likely_next=(P1, Config.of(mode="good", i=1))), lambda: None)
    assert m.ok and fake_tunables.COMPILE_PIDS == [os.getpid()] and m.extra["phase_ms"]["preload"] >= 0
    broken = runner.run(Task(1, P1, Config.of(mode="good"), likely_next=(P1, Config.of(mode="value_error"))),
                        lambda: None)
    assert broken.ok and len(fake_tunables.COMPILE_PIDS) == 2  # the load raised; the candidate still passed
    wrong = runner.run(Task(2, P1, Config.of(mode="wrong"), likely_next=(P1, Config.of(mode="good"))), lambda: None)
    plain = runner.run(Task(3, P1, Config.of(mode="good")), lambda: None)
    assert wrong.status is Status.WRONG_ANSWER and plain.ok and "preload" not in plain.extra["phase_ms"]
    assert len(fake_tunables.COMPILE_PIDS) == 2  # the wrong answer's job was dropped, not run by the next timing


@pytest.mark.parametrize("preload", ["1", "0"])
def test_each_task_names_the_candidate_its_worker_gets_next(tmp_path, monkeypatch, preload):
    """One worker, four queued candidates of a problem: each but the last names its successor, which the worker
    loads while timing (TRITUNE_WORKER_PRELOAD=0: none named, none loaded)."""
    import dataclasses

    import fake_tunables

    monkeypatch.setenv("TRITUNE_WORKER_PRELOAD", preload)
    log = tmp_path / "compile.log"
    settings = dataclasses.replace(FAST, timers=dataclasses.replace(FAST.timers, gpu=fake_tunables.host_job_gpu_time))
    with LocalExecutor(ScriptedAdd(compile_log=str(log)), num_workers=1, settings=settings, devices=DEVICES) as ex:
        ex.wait_ready(60)
        results = run_all(ex, tasks_for(["good"] * 4))
    assert all(m.ok for m in results)
    loaded = log.read_text().split() if log.exists() else []
    assert loaded == (["1", "2", "3"] if preload == "1" else [])


def test_the_likely_next_task_skips_those_other_busy_workers_on_the_problem_take_first():
    from collections import deque
    from types import SimpleNamespace

    ex = LocalExecutor.__new__(LocalExecutor)
    me = SimpleNamespace(task=None, problem_key=None)
    busy = [SimpleNamespace(task=object(), problem_key=P1.key()) for _ in range(2)]
    idle_elsewhere = SimpleNamespace(task=None, problem_key=P1.key())
    ex._workers = [me, *busy, idle_elsewhere, SimpleNamespace(task=object(), problem_key=P2.key())]
    queue = deque(tasks_for(["good"] * 4))
    assert ex._likely_next(queue, P1.key(), me) == (P1, queue[2].config)  # two busy workers take 0 and 1 first
    assert ex._likely_next(deque(list(queue)[:2]), P1.key(), me) is None  # too short: they take both
    ex._workers = [me]
    assert ex._likely_next(queue, P1.key(), me) == (P1, queue[0].config)
