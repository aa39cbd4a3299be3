"""Which problem a GPU worker serves next, and the compile order that gives each worker a problem of its own."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from fake_tunables import AddProblem, ScriptedAdd

from tritune.device import current_device
from tritune.tuning.affinity import interleave, next_problem
from tritune.tuning.executor import LocalExecutor, run_all
from tritune.tuning.tuner import TuneSettings, tune
from tritune.tuning.types import BenchSettings, Config, Task

FAST = BenchSettings(iters=2, warmup=0, timeout_s=5.0, seed=0, flush_l2=False)
DEVICES = [0] if torch.cuda.is_available() else None


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    here = Path(__file__).resolve().parent
    paths = [str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def test_next_problem_keeps_then_takes_an_unheld_one_then_the_longest():
    queues = {"a": [1, 2], "b": [1], "c": [1, 2, 3]}
    assert next_problem(queues, "b", ["a", "c"]) == "b"  # its own first, even if others hold it too
    assert next_problem(queues, "x", ["a"]) == "b"  # the oldest no one holds
    assert next_problem(queues, None, ["a", "b", None]) == "c"
    assert next_problem(queues, "x", ["a", "b", "c"]) == "c"  # all held: the longest queue
    assert next_problem({"a": [1], "b": [2]}, "x", ["a", "b"]) == "a"  # a tie: the oldest


def test_interleave_alternates_groups_of_problems_and_keeps_everything():
    items = [("p1", i) for i in range(3)] + [("p2", i) for i in range(1)] + [("p3", i) for i in range(2)] + \
        [("p4", 0)]
    assert interleave(items, lambda t: t[0], 1) == items
    out = interleave(items, lambda t: t[0], 2)
    assert out == [("p1", 0), ("p2", 0), ("p1", 1), ("p1", 2), ("p3", 0), ("p4", 0), ("p3", 1)]
    assert Counter(interleave(items, lambda t: t[0], 3)) == Counter(items)
    assert interleave(items, lambda t: t[0], 10)[:4] == [("p1", 0), ("p2", 0), ("p3", 0), ("p4", 0)]


def test_two_workers_on_interleaved_problems_build_each_problems_inputs_about_once(tmp_path):
    """Four problems, their candidates interleaved two problems at a time (as the tuner submits them): each worker
    keeps to a problem of its own. Before, both followed the oldest queued problem and built every problem's inputs
    twice (8 builds)."""
    log = tmp_path / "make_inputs.log"
    problems = [AddProblem(n) for n in (1000, 777, 555, 333)]
    tasks = [Task(10 * i + j, p, Config.of(mode="slow", i=j)) for i, p in enumerate(problems) for j in range(6)]
    ordered = interleave(tasks, lambda t: t.problem.key(), 2)
    with LocalExecutor(ScriptedAdd(str(log)), num_workers=2, settings=FAST, devices=DEVICES) as ex:
        ex.wait_ready(60)
        results = run_all(ex, ordered)
    assert all(m.ok for m in results)
    builds = log.read_text().splitlines()
    assert {line.split()[1] for line in builds} == {p.key() for p in problems}
    assert len(builds) <= len(problems) + 2, builds  # a tail may see a worker join another's problem


class SlowAdds(ScriptedAdd):
    """Four slow candidates per problem (module level: the spawned workers unpickle it)."""

    def space(self, problem, device):
        from tritune.tuning.space import SearchSpace

        return SearchSpace({"mode": ["slow"], "i": list(range(4))})


def test_tuner_on_two_workers_interleaves_problems_and_widens_its_claim_window(tmp_path):
    from tritune.tuning import tuner

    log = tmp_path / "make_inputs.log"
    problems = [AddProblem(n) for n in (1000, 777, 555, 333)]
    settings = TuneSettings(journal_path=tmp_path / "j.sqlite", bench=FAST, progress=False, num_gpus=2,
                            compile_workers=1, finalists=0, devices=(0, 0) if torch.cuda.is_available() else None)
    results, summary = tune(SlowAdds(str(log)), problems, current_device(), settings)
    assert all(r.best is not None and r.best.ok for r in results) and summary.measured == 16
    assert len(log.read_text().splitlines()) <= len(problems) + 2
    (line,) = summary.executor_lines
    assert line.startswith("local: 2 worker(s)") and "16 measurement(s)" in line

    class Pool:
        slots = 64

    class Executor:
        def capacity(self):
            return 12

    pipeline = tuner._Pipeline.__new__(tuner._Pipeline)
    pipeline.pool, pipeline.executor = Pool(), Executor()
    assert pipeline._claim_window() == 2 * (64 + 12)  # refilled at half: every compile process and GPU still fed
    Pool.slots = 0
    assert pipeline._claim_window() == tuner.CLAIM_WINDOW  # the floor


def test_an_executor_lent_to_two_passes_starts_its_workers_once(tmp_path):
    from tritune.tuning.tuner import make_executor

    log = tmp_path / "make_inputs.log"
    settings = TuneSettings(journal_path=tmp_path / "j.sqlite", bench=FAST, progress=False, compile_workers=1,
                            finalists=0)
    tunable = SlowAdds(str(log))
    executor = make_executor(tunable, current_device(), settings)
    try:
        first = tune(tunable, [AddProblem(100)], current_device(), settings, executor)[1]
        second = tune(tunable, [AddProblem(200)], current_device(), settings, executor)[1]
    finally:
        executor.close()
    assert first.measured == second.measured == 4
    assert first.executor_lines == second.executor_lines == []  # the lender reports the executor, once
    pids = {line.split()[0] for line in log.read_text().splitlines()}
    assert len(pids) == 1  # the same worker process served both passes
    (line,) = executor.summary_lines()
    assert "8 measurement(s)" in line
