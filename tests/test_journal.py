"""Journal: exact round trip of measurements (inf/NaN included), upsert, meta, survival of SIGKILL, and a journal
written before the op-time columns existed opening and resuming."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tritune.tuning.journal import Journal
from tritune.tuning.types import Config, Measurement, Status

SRC = Path(__file__).resolve().parents[1] / "src"


def _same(a: Measurement, b: Measurement) -> bool:
    def eq(x: float, y: float) -> bool:
        return (math.isnan(x) and math.isnan(y)) or x == y

    return (
        a.problem_key == b.problem_key
        and a.config == b.config
        and a.status is b.status
        and eq(a.time_us, b.time_us)
        and eq(a.error, b.error)
        and eq(a.rel_l2_err, b.rel_l2_err)
        and a.message == b.message
        and a.extra == b.extra
        and eq(a.eager_us, b.eager_us)
        and eq(a.graph_us, b.graph_us)
    )


def test_round_trip_ok_and_failed(tmp_path: Path) -> None:
    ok = Measurement(
        "gemm-m128",
        Config.of(BLOCK_M=64, BLOCK_N=128, num_warps=4, split_k=False, scale=0.5, order="row"),
        Status.OK,
        time_us=12.345678901234567,
        error=0.0,
        rel_l2_err=1.25e-7,
        message="",
        extra={"tflops": 801.5, "regs": 128, "spills": 0},
    )
    # Failed candidates carry the defaults: inf time and NaN errors.
    oor = Measurement(
        "gemm-m128",
        Config.of(BLOCK_M=256, BLOCK_N=256, num_warps=8),
        Status.OUT_OF_RESOURCES,
        message="shared memory 262144 > 232448",
    )
    wrong = Measurement(
        "gemm-m256",
        Config.of(BLOCK_M=16, BLOCK_N=16, num_warps=1),
        Status.WRONG_ANSWER,
        time_us=3.0,
        error=0.125,
        rel_l2_err=math.inf,
        message="3 unwritten elements",
    )
    neg_inf = Measurement(
        "gemm-m256",
        Config.of(BLOCK_M=32, BLOCK_N=16, num_warps=1),
        Status.CRASHED,
        time_us=-math.inf,
        error=math.nan,
        rel_l2_err=math.nan,
        message="ünïcode ✓",
    )
    path = tmp_path / "deep" / "dir" / "journal.sqlite"
    with Journal(path) as j:
        for m in (ok, oor, wrong, neg_inf):
            j.record(m)
    with Journal(path) as j:
        assert j.count() == 4
        assert j.problem_keys() == ["gemm-m128", "gemm-m256"]
        first = j.measurements("gemm-m128")
        second = j.measurements("gemm-m256")
        assert j.measurements("missing") == {}
    assert list(first) == [ok.config, oor.config]  # first-recorded order
    assert _same(first[ok.config], ok)
    assert _same(first[oor.config], oor)
    assert first[oor.config].time_us == math.inf and math.isnan(first[oor.config].error)
    assert _same(second[wrong.config], wrong)
    assert _same(second[neg_inf.config], neg_inf)
    # Scalar types survive (bool stays bool, float stays float).
    assert first[ok.config].config["split_k"] is False and isinstance(first[ok.config].config["scale"], float)


def test_upsert_replaces(tmp_path: Path) -> None:
    config = Config.of(BLOCK_M=64, num_warps=4)
    with Journal(tmp_path / "j.sqlite") as j:
        j.record(Measurement("p", config, Status.TIMEOUT, message="timed out after 10s"))
        j.record(Measurement("p", config, Status.OK, time_us=7.5, error=0.0, rel_l2_err=0.0))
        j.record(Measurement("q", config, Status.OK, time_us=9.0))
        assert j.count() == 2
        got = j.measurements("p")[config]
    assert got.status is Status.OK and got.time_us == 7.5 and got.message == ""


def test_meta(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.sqlite") as j:
        assert j.get_meta("argv") is None
        j.set_meta("argv", "tritune tune gemm")
        j.set_meta("argv", "tritune tune moe")
    with Journal(tmp_path / "j.sqlite") as j:
        assert j.get_meta("argv") == "tritune tune moe"


_CHILD = """
import sys, time
from tritune.tuning.journal import Journal
from tritune.tuning.types import Config, Measurement, Status
j = Journal(sys.argv[1])
i = 0
while True:
    j.record(Measurement("p", Config.of(i=i), Status.OK, time_us=float(i)))
    print(i, flush=True)
    i += 1
    time.sleep(0.001)
"""


def test_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        returned = [int(child.stdout.readline()) for _ in range(25)]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    with Journal(path) as j:
        got = j.measurements("p")
    assert {Config.of(i=i) for i in returned} <= set(got)
    assert all(got[Config.of(i=i)].time_us == float(i) for i in returned)


def test_op_times_round_trip_and_upsert(tmp_path: Path) -> None:
    config = Config.of(BLOCK_M=64)
    first = Measurement("p", config, Status.OK, time_us=16.5, error=0.0, rel_l2_err=0.0)
    # A finalist: eager measured, graph not captured (NaN).
    retimed = Measurement("p", config, Status.OK, time_us=16.5, error=0.0, rel_l2_err=0.0, eager_us=101.25,
                          extra={"graph_error": "capture failed"})
    with Journal(tmp_path / "j.sqlite") as j:
        j.record(first)
        assert _same(j.measurements("p")[config], first) and not j.measurements("p")[config].retimed
        j.record(retimed)
        got = j.measurements("p")[config]
    assert _same(got, retimed) and got.retimed and math.isnan(got.graph_us)


# The schema of journals written before eager_us and graph_us existed.
OLD_SCHEMA = """
CREATE TABLE measurements (
    problem_key TEXT NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL, time_us REAL, error REAL,
    rel_l2_err REAL, message TEXT NOT NULL, extra TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (problem_key, config)
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def test_old_journal_gains_the_columns_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    conn.execute("INSERT INTO measurements VALUES ('p', ?, 'ok', 12.5, 0.0, 0.001, '', '{}', 0.0)",
                 (Config.of(BLOCK_M=16).key(),))
    conn.execute("INSERT INTO meta VALUES ('argv', 'tritune gemm')")
    conn.commit()
    conn.close()

    with Journal(path) as j:  # opens, adds the columns, reads the old row as not yet re-timed
        old = j.measurements("p")[Config.of(BLOCK_M=16)]
        assert old.ok and old.time_us == 12.5 and math.isnan(old.eager_us) and math.isnan(old.graph_us)
        assert j.get_meta("argv") == "tritune gemm"
        j.record(Measurement("p", Config.of(BLOCK_M=16), Status.OK, time_us=12.5, eager_us=30.0, graph_us=11.0))
        j.record(Measurement("p", Config.of(BLOCK_M=32), Status.OK, time_us=14.0))
    with Journal(path) as j:  # a second open finds the columns there and changes nothing
        got = j.measurements("p")
    assert (got[Config.of(BLOCK_M=16)].eager_us, got[Config.of(BLOCK_M=16)].graph_us) == (30.0, 11.0)
    assert got[Config.of(BLOCK_M=32)].time_us == 14.0 and not got[Config.of(BLOCK_M=32)].retimed
    conn = sqlite3.connect(path)
    columns = [row[1] for row in conn.execute("PRAGMA table_info(measurements)")]
    conn.close()
    assert columns[-2:] == ["eager_us", "graph_us"] and len(columns) == len(set(columns))


def test_opening_waits_out_a_locked_database_and_fails_on_anything_else():

    from tritune.tuning.journal import _until_unlocked

    calls = []

    def locked_twice():
        calls.append(1)
        if len(calls) < 3:
            raise sqlite3.OperationalError("database is locked")

    _until_unlocked(locked_twice, time.monotonic() + 5)
    assert len(calls) == 3
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        _until_unlocked(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("no such table: x")),
                        time.monotonic() + 5)
    with pytest.raises(sqlite3.OperationalError, match="locked"):  # past the deadline the error stands
        _until_unlocked(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")),
                        time.monotonic() - 1)


def test_many_connections_opening_one_new_journal_at_once(tmp_path):

    for attempt in range(3):
        path = tmp_path / f"j{attempt}.sqlite"
        errors, barrier = [], threading.Barrier(8)

        def open_it(path=path, errors=errors, barrier=barrier):
            barrier.wait()
            try:
                Journal(path).close()
            except Exception as exc:  # collected: an exception in a thread would not fail the test
                errors.append(exc)

        threads = [threading.Thread(target=open_it) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
