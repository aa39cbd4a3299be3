"""Tuners sharing one journal share the work: a candidate claimed by one is not measured by the other, which waits
for its result; claims of a dead or silent owner are taken over; both runs end with the same complete answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tritune.tuning import journal as journal_module
from tritune.tuning.bench import Timers, Timing
from tritune.tuning.journal import Journal
from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import Config, Measurement, Status

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
K1, K2, K3 = (("p", Config.of(a=i).key()) for i in (1, 2, 3))  # (journal key, Config.key())


def measured(key: tuple[str, str], eager_us: float = float("nan")) -> Measurement:
    return Measurement(key[0], Config.from_key(key[1]), Status.OK, time_us=1.0, eager_us=eager_us)


def foreign_claim(path: Path, key: tuple[str, str], *, host: str, pid: int, seen: float, phase: str = "measure"):
    """A claim row as another process (or host) would have left it."""
    with Journal(path) as j:
        j._conn.execute("INSERT INTO claims VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (*key, phase, f"{host}:{pid}:x", host, pid, "", seen))


# ---- the claims themselves --------------------------------------------------------------------------------------

def test_a_claimed_candidate_goes_to_one_journal_until_it_is_done(tmp_path):
    path = tmp_path / "journal.sqlite"
    with Journal(path) as a, Journal(path) as b:  # two runs on one folder (one process: both owners alive)
        assert a.claim([K1, K2], "measure").mine == {K1, K2}
        got = b.claim([K1, K2, K3], "measure")
        assert (got.mine, got.others, got.done) == ({K3}, {K1, K2}, set())
        assert a.claim([K1], "measure").mine == {K1}  # an owner may claim its own claim again
        a.record(measured(K1))
        a.release([K1], "measure")
        got = b.claim([K1, K2], "measure")
        assert (got.done, got.others) == ({K1}, {K2})  # done: read from the journal, not measured again
        # A finalist's re-time is its own phase: measured is not re-timed.
        assert b.claim([K1], "retime").mine == {K1} and not b.is_done(K1, "retime")
        b.record(measured(K1, eager_us=2.0))
        assert b.is_done(K1, "retime") and a.claim([K1], "retime").done == {K1}
    with Journal(path) as c:  # closing released every claim a and b held
        assert c.claim([K2, K3], "measure").mine == {K2, K3}


def test_claims_of_a_dead_process_are_taken_over(tmp_path):
    path = tmp_path / "journal.sqlite"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    with Journal(path) as j:
        host = j._host
    foreign_claim(path, K1, host=host, pid=gone.pid, seen=time.time())
    foreign_claim(path, K2, host=host, pid=os.getppid(), seen=time.time())  # alive: our parent
    with Journal(path) as j:
        got = j.claim([K1, K2], "measure")
        assert (got.mine, got.others) == ({K1}, {K2})


def test_silent_claims_of_another_host_go_stale(tmp_path):
    path = tmp_path / "journal.sqlite"
    now = time.time()
    foreign_claim(path, K1, host="elsewhere", pid=1, seen=now - journal_module.STALE_AFTER_S - 1)
    foreign_claim(path, K2, host="elsewhere", pid=1, seen=now)  # its pid cannot be checked from here: it is alive
    with Journal(path) as j:
        got = j.claim([K1, K2], "measure")
        assert (got.mine, got.others) == ({K1}, {K2})


def test_a_zombie_does_not_hold_claims(tmp_path):
    path = tmp_path / "journal.sqlite"
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to tell a zombie")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):  # exited but not waited for: a zombie
        if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    with Journal(path) as j:
        foreign_claim(path, K1, host=j._host, pid=child.pid, seen=time.time())
        assert j.claim([K1], "measure").mine == {K1}
    child.wait()


# ---- two tuner processes on one journal -------------------------------------------------------------------------

class LoggedCall:
    """One candidate's call; the scripted timers log which tuner (the worker's parent) timed which candidate."""

    def __init__(self, out: torch.Tensor, x: torch.Tensor, name: str, gpu_us: float, log: str) -> None:
        self.out, self.x, self.name, self.gpu_us, self.log = out, x, name, gpu_us, log

    def __call__(self) -> None:
        self.out.copy_(self.x)


def _logged(kind: str, fn: LoggedCall) -> Timing:
    fn()
    time.sleep(0.1)  # a measurement takes time, so the two runs overlap
    with open(fn.log, "a") as log:
        log.write(f"{kind} {os.getppid()} {fn.name}\n")
    return Timing(fn.gpu_us, fn.gpu_us, fn.gpu_us, 1, f"scripted {kind}")


def logged_gpu(fn: LoggedCall, **_: object) -> Timing:
    return _logged("gpu", fn)


def logged_eager(fn: LoggedCall, **_: object) -> Timing:
    return _logged("eager", fn)


def logged_graph(fn: LoggedCall, **_: object) -> Timing:
    return _logged("graph", fn)


NAMES = tuple("abcdefgh")


class LoggedOp:
    """Eight candidates; candidate i has GPU time 10 + i us."""

    name = "logged_op"

    def __init__(self, log: str) -> None:
        self.log = log

    def space(self, problem, device):
        from tritune.tuning.space import SearchSpace

        return SearchSpace({"name": NAMES})

    def make_inputs(self, problem, device, seed):
        return torch.arange(8, dtype=torch.float32, device=device)

    def reference(self, problem, inputs):
        return inputs.clone()

    def alloc_output(self, problem, inputs):
        return torch.empty_like(inputs)

    def launcher(self, problem, inputs, config, out):
        return LoggedCall(out, inputs, config["name"], 10.0 + NAMES.index(config["name"]), self.log)

    def compile(self, problem, config):
        pass

    def flops(self, problem):
        return 8.0

    def bytes_moved(self, problem):
        return 64.0

    def tolerance(self, problem):
        return Tolerance(atol=0.0, rtol=0.0)


def run_tuner(journal: str, log: str, out: str) -> None:
    """One tuner process: the whole run over LoggedOp, its answer written to `out` as JSON."""
    from fake_tunables import OpProblem

    from tritune.device import current_device
    from tritune.tuning import tuner
    from tritune.tuning.types import BenchSettings

    tuner._Pipeline._claim_window = lambda self: 2  # two at a time, so both runs find work while the other measures
    bench = BenchSettings(iters=1, warmup=0, timers=Timers(gpu=logged_gpu, eager=logged_eager, graph=logged_graph))
    settings = tuner.TuneSettings(journal_path=Path(journal), bench=bench, progress=False, finalists=2,
                                  compile_workers=1)
    (result,), summary = tuner.tune(LoggedOp(log), [OpProblem()], current_device(), settings)
    Path(out).write_text(json.dumps({
        "best": result.best.config["name"], "pid": os.getpid(),
        "times": {m.config["name"]: [m.time_us, m.eager_us] for m in result.measurements},
        "measured": summary.measured, "shared": summary.shared, "reused": summary.reused,
        "retimed": summary.retimed, "retimed_shared": summary.retimed_shared, "lines": summary.lines()}))


def test_two_tuners_on_one_journal_measure_each_candidate_once(tmp_path):
    journal, log = tmp_path / "journal.sqlite", tmp_path / "timed.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from test_shared_journal import run_tuner; run_tuner(*sys.argv[1:])"
    runs = [subprocess.Popen([sys.executable, "-c", code, str(journal), str(log), str(tmp_path / f"out{i}.json")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for run in runs:
        output, _ = run.communicate(timeout=240)
        assert run.returncode == 0, output
    a, b = (json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2))
    timed = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    # Every candidate timed once, by one of the two runs; every finalist re-timed once (eager and graph).
    gpu = Counter(name for (kind, _, name) in timed if kind == "gpu")
    assert gpu == Counter(NAMES) and all(n == 1 for n in timed.values())
    assert Counter(name for (kind, _, name) in timed if kind == "eager") == Counter("ab")
    # Each run measured its part and took the rest from the journal (measured there by the other run).
    for run in (a, b):
        assert run["measured"] + run["shared"] + run["reused"] >= len(NAMES)
    assert a["measured"] + b["measured"] == len(NAMES) and a["retimed"] + b["retimed"] == 2
    # The summary counts candidates and finalists the other run did apart (it once said "24 measured by another
    # tuner" on a line of 12 candidates): each run's candidates add up, and so do its finalists.
    for run in (a, b):
        assert run["measured"] + run["shared"] + run["reused"] == len(NAMES)
        assert run["retimed"] + run["retimed_shared"] <= 2
        if run["retimed_shared"]:
            assert f"{run['retimed_shared']} re-timed by another tuner sharing it)" in "\n".join(run["lines"])
    # The same complete answer in both.
    assert a["best"] == b["best"] == "a" and a["times"] == b["times"] and len(a["times"]) == len(NAMES)
    with Journal(journal) as j:
        assert j._conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0  # no claim left behind
        assert j.count() == len(NAMES)
