"""RayExecutor on a real Ray cluster on this machine: a head and two worker nodes started here with `ray start`, a
custom resource `fake_gpu` standing in for GPUs, kernels scripted (ray_tunables) or through Triton's interpreter.

Same answer as the local executor on the same seeded problems; a rerun of a finished run measures (and starts)
nothing; a candidate that kills or hangs two actors is recorded, not retried forever; the CLI's `--executor ray`
tunes a real GEMM through the interpreter on the nodes; killing a worker node mid-run loses nothing and re-measures
only what was in flight there. The module's cluster is shared by its tests and always stopped by the fixture.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from ray_tunables import CountProblem, ScriptedCounts, eager_time, gpu_time, graph_time

from tritune.device import current_device
from tritune.tuning.bench import Timers
from tritune.tuning.journal import Journal
from tritune.tuning.ray_cluster import RaySettings
from tritune.tuning.tuner import TuneSettings, journal_key, tune
from tritune.tuning.types import BenchSettings, Status

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
    assert f"{len(again)} re-queued after losing their actor" in text, text
    assert re.search(rf"LOST after [\d.]+s; {len(again)} candidate\(s\) in flight on lost actors", text), text
    print(f"re-measured {sorted(again)}; attempts {len(attempts)}\n{text}")
