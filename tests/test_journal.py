"""Journal: exact round trip of measurements (inf/NaN included), upsert, meta, and survival of SIGKILL."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

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
