"""RayExecutor on a real Ray cluster on this machine: a head and two worker nodes started here with `ray start`, a
custom resource `fake_gpu` standing in for GPUs, kernels scripted (ray_tunables) or through Triton's interpreter.

Same answer as the local executor on the same seeded problems; a rerun of a finished run measures (and starts)
nothing; a candidate that kills or hangs two actors is recorded, not retried forever; the CLI's `--executor ray`
tunes a real GEMM through the interpreter on the nodes; killing a worker node mid-run loses nothing and re-measures
only what was in flight there; a driver killed mid-run leaves no actor behind and its rerun measures only what the
journal lacks. The progress and summary text per node are checked on synthetic numbers. The module's cluster is
shared by its tests and always stopped by the fixture.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray_tunables import CountProblem, ScriptedCounts, eager_time, gpu_time, graph_time

from tritune.device import current_device
from tritune.tuning import ray_executor
from tritune.tuning.bench import Timers
from tritune.tuning.journal import Journal
from tritune.tuning.ray_cluster import RaySettings
from tritune.tuning.ray_executor import RayExecutor
from tritune.tuning.ray_state import _Actor, _Item, _Node
from tritune.tuning.tuner import TuneSettings, journal_key, tune
from tritune.tuning.types import BenchSettings, Config, Status

try:
    import ray
except ImportError:  # the cluster tests skip, saying why; the test that the rest works without Ray still runs
    ray = None

pytestmark = pytest.mark.timeout(180)

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
DEVICE = current_device()
RESOURCE = "fake_gpu"
GPUS_PER_NODE = 2
BENCH = BenchSettings(iters=2, warmup=0, timeout_s=2.0, seed=0, flush_l2=False,
                     timers=Timers(gpu=gpu_time, eager=eager_time, graph=graph_time))
# Detect a dead node in about 1.5 s rather than Ray's default 15 s (the health check fails at once on a dead raylet).
HEAD_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3,
               "health_check_timeout_ms": 5000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (Ray's workers start their own sessions, so a process group misses them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _adopt_orphans(on: bool) -> None:
    """Make this process the reaper of its orphaned descendants (Linux PR_SET_CHILD_SUBREAPER), so that the node
    processes killed here are reaped here rather than left as zombies where init does not reap."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap(pids: list[int], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    left = set(pids)
    while left and time.monotonic() < end:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours (reaped by its own parent) or gone
                done = pid
            if done:
                left.discard(pid)
        time.sleep(0.05)


class LoopbackCluster:
    """A head (no resources: the driver's side) and worker nodes "a" and "b", each `ray start --block` in a process
    of its own, so that one node can be killed with everything it started."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # Ray's sessions (logs, sockets) here, not in /tmp/ray; a short path, as unix socket paths are limited to 107.
        self.temp_dir = tempfile.mkdtemp(prefix="tt-ray-")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), str(TESTS), os.environ.get("PYTHONPATH")) if p)}

    def _start(self, name: str, *args: str) -> None:
        log = self.folder / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            ["ray", "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
             f"--temp-dir={self.temp_dir}", *args],
            env=self.env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + 60
        while "block forever" not in log.read_text():  # up and registered with the head
            if self.procs[name].poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"ray node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

    def start(self) -> None:
        self._start("head", "--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
                    f"--system-config={json.dumps(HEAD_CONFIG)}")
        for name in ("a", "b"):  # one at a time: two raylets starting together on 2 cores can miss the head's timeout
            self._start(name, f"--address={self.address}", "--num-cpus=1",
                        f"--resources={json.dumps({RESOURCE: GPUS_PER_NODE})}")

    def pids(self, name: str) -> list[int]:
        return _descendants(self.procs[name].pid)

    def kill(self, name: str) -> list[int]:
        """SIGKILL node `name` and every process it started (its raylet, agents and workers): a machine lost."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[name].wait(timeout=30)
        _reap(pids[1:])
        return pids

    def stop(self) -> None:
        for name in self.procs:
            if self.procs[name].poll() is None:
                self.kill(name)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if ray is None:
        pytest.skip("Ray is not installed: pip install 'tritune[ray]' (scripts/setup.sh installs it for the tests)")
    c = LoopbackCluster(tmp_path_factory.mktemp("ray"))
    _adopt_orphans(True)
    try:
        c.start()
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.stop()
        _adopt_orphans(False)


def test_everything_else_works_without_ray():
    """Ray blocked from import: the engine, tuners and CLI load, and --executor ray is one line and exit 2."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import tritune.tuning.tuner, tritune.tuners.gemm\n"
            "from tritune.tuning.ray_cluster import ray_available\n"
            "assert not ray_available()\n"
            "from tritune.cli import main\n"
            "sys.exit(main(['gemm', '--kernel', 'bf16', '--n', '40', '--k', '48', '--m', '1', '--executor', 'ray']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "tritune: error: --executor ray needs Ray: pip install 'tritune[ray]'\n"


class _Postfix:
    def __init__(self) -> None:
        self.text: list[str] = []

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.text.append(text)

    def close(self) -> None:
        pass


def test_progress_shows_each_nodes_rate_and_the_summary_each_gpu(monkeypatch):
    """Synthetic executor state, no Ray: node a (2 GPUs, one actor replaced after a crash), node b lost at 5 s, node c
    with no usable GPU; the bar's text and the summary as of 10 s after the start, and idle time after close()."""
    t0 = time.monotonic() - 10.0
    ex = RayExecutor(ScriptedCounts(), BENCH, RaySettings(None, RESOURCE), DEVICE)
    a = _Node("a" * 32, "127.0.0.1/aaaaaaaa", cpus=4, gpus=2, compiled=20, compile_s=12.34)
    b = _Node("b" * 32, "127.0.0.1/bbbbbbbb", cpus=4, gpus=2, compiled=6, compile_s=3.0, alive=False, lost_at=t0 + 5,
              struck=1)
    c = _Node("c" * 32, "127.0.0.1/cccccccc", cpus=1, gpus=1, note="NVIDIA H200 (Triton 3.3.0) not used")

    def actor(slot: int, node: _Node, ready: float, done: int, busy: float, ended: float | None = None) -> _Actor:
        return _Actor(slot, node, None, None, t0, ready_at=t0 + ready, done=done, busy_s=busy,
                      ended_at=None if ended is None else t0 + ended)

    a.retired = [actor(1, a, ready=1.0, done=1, busy=1.5, ended=3.0)]  # crashed; its successor holds slot 1
    b.retired = [actor(2, b, ready=1.0, done=3, busy=3.0, ended=5.0),
                 actor(3, b, ready=2.0, done=1, busy=1.0, ended=5.0)]
    ex._actors = [actor(0, a, ready=1.0, done=12, busy=7.0), actor(1, a, ready=4.0, done=5, busy=4.0)]
    ex._nodes = {n.node_id: n for n in (a, b, c)}
    ex._started, ex._began, ex.requeued = True, t0, [(7, "actor died")]

    ex._bar = _Postfix()
    ex._show_progress()
    assert ex._bar.text == ["aaaaaaaa 2.0/s, bbbbbbbb 1.0/s lost"]  # 18 in 9 s since ready; 4 in the 4 s b lived
    assert ex.summary_lines(now=t0 + 10.0) == [
        f"ray: 3 node(s), 4 GPU(s) of {DEVICE.name}; 22 measurement(s) in 10.0s; 1 re-queued after losing their "
        "actor, 0 recorded after taking down 2 actors",
        "  node 127.0.0.1/aaaaaaaa: 2 GPU(s); candidates per GPU 12, 6; idle s per GPU 2.0, 2.5; "
        "20 compile(s), 12.3 CPU-s",
        "  node 127.0.0.1/bbbbbbbb: 2 GPU(s); candidates per GPU 3, 1; idle s per GPU 1.0, 2.0; 6 compile(s), "
        "3.0 CPU-s; LOST after 5.0s; 1 candidate(s) in flight on lost actors",
        "  node 127.0.0.1/cccccccc: 0 GPU(s); candidates per GPU -; idle s per GPU -; 0 compile(s), 0.0 CPU-s; "
        "NVIDIA H200 (Triton 3.3.0) not used"]
    # Closed with a candidate in flight (a time limit passed): its 0.5 s on the GPU so far count as busy, not idle.
    running = ex._actors[0]
    running.item, running.handed_at = _Item(None, "k"), t0 + 9.5
    killed: list[int] = []  # no Ray here: ray.kill would start a local Ray instance
    fake_ray = SimpleNamespace(kill=lambda handle, no_restart: killed.append(handle))
    monkeypatch.setattr(ray_executor, "import_ray", lambda: fake_ray)
    for i, live in enumerate(ex._actors):
        live.handle = i
    ex.close()
    assert not ex._actors and killed == [0, 1]
    assert running.idle_s(time.monotonic()) == pytest.approx(10.0 - 1.0 - 7.0 - 0.5)


def settings(journal: Path, cluster: LoopbackCluster | None, finalists: int = 2) -> TuneSettings:
    where = RaySettings(cluster.address, RESOURCE) if cluster is not None else None
    return TuneSettings(journal_path=journal, bench=BENCH, num_gpus=2, compile_workers=1, progress=False,
                        finalists=finalists, ray=where)


def rows(journal: Path, tunable, problems) -> dict[tuple[str, str], tuple]:
    """Every journaled (problem, config) with what must not depend on where it ran."""
    with Journal(journal) as j:
        out = {}
        for p in problems:
            for config, m in j.measurements(journal_key(DEVICE, p, tunable)).items():
                out[(p.key(), config.key())] = (m.status, m.time_us, m.error, m.rel_l2_err, m.eager_us, m.graph_us)
        return out


def test_same_answer_as_the_local_executor_and_a_rerun_measures_nothing(cluster, tmp_path):
    problems = [CountProblem("a", 9),  # wrong answer, compile error, a crash and a hang among them
                CountProblem("b", 5)]  # a second problem: inputs made per problem on each actor
    tunable = ScriptedCounts(wrong=(3,), no_compile=(5,), crash=(7,), hang=(8,))
    local, _ = tune(tunable, problems, DEVICE, settings(tmp_path / "local.sqlite", None))
    start = time.monotonic()
    remote, summary = tune(tunable, problems, DEVICE, settings(tmp_path / "ray.sqlite", cluster))
    took = time.monotonic() - start

    assert rows(tmp_path / "ray.sqlite", tunable, problems) == rows(tmp_path / "local.sqlite", tunable, problems)
    assert [r.best.config for r in remote] == [r.best.config for r in local]
    assert [r.gpu_best.config for r in remote] == [r.gpu_best.config for r in local]
    by_i = {int(m.config["i"]): m for m in remote[0].measurements}
    assert by_i[7].status is Status.CRASHED and "took down 2 benchmark actors" in by_i[7].message
    assert by_i[8].status is Status.TIMEOUT and by_i[8].message.count("actor hung") == 2
    assert by_i[5].status is Status.COMPILE_ERROR and summary.compile_failed == Counter(compile_error=1)
    # Provenance per measurement: the device and node that ran it (compile errors: the node that compiled).
    nodes = {m.extra["node"] for r in remote for m in r.measurements}
    assert len(nodes) == 2 and {m.extra["device"] for r in remote for m in r.measurements} == {DEVICE.name}
    text = "\n".join(summary.lines())
    assert re.search(r"ray: 2 node\(s\), \d GPU\(s\) of cpu-interpreter", text), text
    assert "2 recorded after taking down 2 actors" in text and text.count("candidates per GPU") == 2
    print(f"ray run: {took:.1f}s\n{text}")

    rerun, again = tune(tunable, problems, DEVICE, settings(tmp_path / "ray.sqlite", cluster))
    assert (again.measured, again.retimed, again.executor_lines) == (0, 0, [])  # nothing measured, nothing started
    assert [r.best.config for r in rerun] == [r.best.config for r in remote]


def test_cli_tunes_a_gemm_through_the_interpreter_on_the_nodes(cluster, tmp_path, capsys):
    from tritune.cli import main
    from tritune.tuners.gemm import INTERPRETER_SPACE

    space = tmp_path / "space.json"
    space.write_text(json.dumps({k: list(v) for k, v in INTERPRETER_SPACE.items()}))
    out = tmp_path / "out"
    code = main(["gemm", "--kernel", "bf16", "--dtype", "fp16", "--n", "40", "--k", "48", "--m", "1,17", "-o",
                 str(out), "--search-space", str(space), "--iters", "1", "--warmup", "0", "--finalists", "1",
                 "--no-progress", "--executor", "ray", "--ray-address", cluster.address, "--ray-resource", RESOURCE])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"== {DEVICE.name}: {2 * GPUS_PER_NODE} GPU(s) of the Ray cluster" in captured.out
    assert "ray: 2 node(s)" in captured.out and (out / f"journal-{DEVICE.slug}.sqlite").exists()
    shape = json.loads((out / f"{DEVICE.slug}-GEMM-BF16-N=40-K=48.json").read_text())["tritune"]
    assert sorted(shape["by_M"]) == ["1", "17"] and shape["provenance"]["name"] == DEVICE.name
    with Journal(out / f"journal-{DEVICE.slug}.sqlite") as j:
        ms = [m for key in j.problem_keys() for m in j.measurements(key).values()]
    assert ms and all(m.ok and m.error == 0.0 and m.extra["device"] == DEVICE.name for m in ms)  # real kernels, right


def test_cli_refuses_an_unknown_device_model(cluster, capsys):
    from tritune.cli import main

    code = main(["gemm", "--kernel", "bf16", "--n", "40", "--k", "48", "--m", "1", "--executor", "ray",
                 "--ray-address", cluster.address, "--ray-resource", RESOURCE, "--ray-device", "NVIDIA H200"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert f"no GPU of the Ray cluster is a 'NVIDIA H200'; it has {2 * GPUS_PER_NODE} x {DEVICE.name}" in err


# The driver of test_a_rerun_after_the_driver_is_killed_resumes: tune() on a pickled (tunable, problems, settings).
DRIVER = ("import pickle, sys\n"
          "from tritune.device import current_device\n"
          "from tritune.tuning.tuner import tune\n"
          "with open(sys.argv[1], 'rb') as f:\n"
          "    tunable, problems, settings = pickle.load(f)\n"
          "tune(tunable, problems, current_device(), settings)\n")


def _journaled(journal: Path) -> int:
    """Rows in the journal, read without writing to it (0 until the driver has made it)."""
    try:
        with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])
    except sqlite3.OperationalError:
        return 0


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _node_processes(cluster: LoopbackCluster) -> set[int]:
    """Every running process of the cluster's nodes: raylets, agents, workers, actors."""
    return {pid for name in cluster.procs for pid in cluster.pids(name) if _running(pid)}


def test_a_rerun_after_the_driver_is_killed_resumes(cluster, tmp_path):
    """The driver, a process of its own, SIGKILLed mid-run: its actors die with it, and the same run again measures
    only what the journal lacks; the journal and the winners equal an uninterrupted run's."""
    problems = [CountProblem("driver", 18)]
    journal, killed_log, rerun_log = tmp_path / "driver.sqlite", tmp_path / "killed.log", tmp_path / "rerun.log"
    run = tmp_path / "run.pickle"
    run.write_bytes(pickle.dumps((ScriptedCounts(run_s=0.3, log=str(killed_log)), problems,
                                  settings(journal, cluster))))
    out = tmp_path / "driver.out"
    before = _node_processes(cluster)
    with out.open("w") as sink:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(run)], env=cluster.env, stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # The uninterrupted run (the local executor) while the driver starts: it takes seconds to journal anything.
        whole, _ = tune(ScriptedCounts(), problems, DEVICE, settings(tmp_path / "whole.sqlite", None))
        end = time.monotonic() + 60
        while _journaled(journal) < 5:  # a few of the 18 measured: kill it mid-run
            assert driver.poll() is None and time.monotonic() < end, out.read_text()[-3000:]
            time.sleep(0.02)
        driver_pids = _descendants(driver.pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
    assert driver.returncode == -signal.SIGKILL
    # Ray ends a dead driver's job: its actors and workers go, the nodes are back to what they ran before it started.
    killed_actors = {int(line.split()[0]) for line in killed_log.read_text().splitlines()}
    assert killed_actors and killed_actors.isdisjoint(before)
    end = time.monotonic() + 30
    while left := {p for p in driver_pids if _running(p)} | (_node_processes(cluster) - before):
        assert time.monotonic() < end, f"processes of the killed driver still run: {sorted(left)}"
        time.sleep(0.1)
    committed = {int(Config.from_key(c)["i"]) for _, c in rows(journal, ScriptedCounts(), problems)}
    assert 5 <= len(committed) < 18  # nothing more is journaled once the driver is gone

    rerun, summary = tune(ScriptedCounts(log=str(rerun_log)), problems, DEVICE, settings(journal, cluster))

    assert (summary.reused, summary.measured) == (len(committed), 18 - len(committed))
    retimed = [int(m.config["i"]) for m in rerun[0].measurements if m.retimed]
    assert len(retimed) == 2
    attempts = Counter(int(line.split()[2]) for line in rerun_log.read_text().splitlines())
    assert attempts == Counter(set(range(18)) - committed) + Counter(retimed)  # the missing, then the 2 finalists
    assert rows(journal, ScriptedCounts(), problems) == rows(tmp_path / "whole.sqlite", ScriptedCounts(), problems)
    assert (rerun[0].best.config, rerun[0].gpu_best.config) == (whole[0].best.config, whole[0].gpu_best.config)
    print(f"journaled before the kill: {len(committed)}; driver {driver.pid} and actors {sorted(killed_actors)} gone")


def test_losing_a_node_mid_run_loses_nothing(cluster, tmp_path):
    """Runs last: node "b" stays dead. A candidate in flight on b is measured again elsewhere, nothing else is."""
    log = tmp_path / "attempts.log"
    log.touch()
    problems = [CountProblem("kill", 16)]
    tunable = ScriptedCounts(run_s=0.4, log=str(log))
    b_pids = set(cluster.pids("b"))
    killed: list[int] = []

    def kill_when_b_is_busy() -> None:
        while not killed:
            for line in log.read_text().splitlines():  # b started a candidate: it sleeps run_s now
                if int(line.split()[0]) in set(cluster.pids("b")) - b_pids:
                    killed.extend(cluster.kill("b"))
                    return
            time.sleep(0.02)

    import threading

    killer = threading.Thread(target=kill_when_b_is_busy, daemon=True)
    killer.start()
    results, summary = tune(tunable, problems, DEVICE, settings(tmp_path / "kill.sqlite", cluster, finalists=0))
    killer.join(timeout=5)
    assert killed, "node b never started a candidate"

    assert all(m.ok for m in results[0].measurements) and len(results[0].measurements) == 16
    assert len(rows(tmp_path / "kill.sqlite", tunable, problems)) == 16  # each journaled once, nothing lost
    attempts = [(int(pid), int(i)) for pid, _, i in (line.split() for line in log.read_text().splitlines())]
    per_candidate = Counter(i for _, i in attempts)
    again = {i for i, n in per_candidate.items() if n > 1}
    in_flight_on_b = {i for pid, i in attempts if pid in killed}
    assert again and again <= in_flight_on_b and max(per_candidate.values()) == 2
    assert len(again) <= GPUS_PER_NODE  # at most one candidate per actor of b was in flight
    assert {m.extra["node"] for m in results[0].measurements if int(m.config["i"]) in again} != set()
    text = "\n".join(summary.lines())
    requeued = re.search(r"(\d+) re-queued after losing their actor", text)
    assert requeued, text
    # A candidate sent to b and lost before it logged its start is re-queued too, but measured only once in the log.
    assert len(again) <= int(requeued.group(1)) <= GPUS_PER_NODE, text
    assert re.search(rf"LOST after [\d.]+s; {requeued.group(1)} candidate\(s\) in flight on lost actors", text), text
    print(f"re-measured {sorted(again)}; attempts {len(attempts)}\n{text}")
