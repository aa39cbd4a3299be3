"""scripts/device_batch.sh: several GPU jobs in one device call, each under its own limit, a table last."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_batch.sh"


def _run(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    (tmp_path / "steps.txt").write_text(steps)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "steps.txt")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}, timeout=60)


def test_each_step_runs_logs_and_is_tabled_even_after_a_failure_or_a_timeout(tmp_path):
    run = _run(tmp_path, "# comment\n\nfirst | 10 | echo one; echo two | tr o 0\nslow | 1 | sleep 5\n"
                         "fails | 10 | echo boom; exit 3\nlast | 10 | echo $PYTHONPATH\n")
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == ["first", "slow", "fails", "last"]
    assert rows[0].startswith("| first | 0 |") and rows[0].endswith("| tw0 |")  # the pipe stayed in the command
    assert "| slow | 124 (timed out) |" in rows[1]
    assert rows[2].startswith("| fails | 3 |") and rows[2].endswith("| boom |")
    assert rows[3].endswith("| src |")
    assert (tmp_path / "out" / "first.log").read_text() == "one\ntw0\n"


def test_a_bad_step_line_is_refused_naming_it_and_nothing_runs(tmp_path):
    run = _run(tmp_path, "ok | 10 | echo ran\nno-limit | x | true\n")
    assert run.returncode == 2 and run.stdout == ""
    assert "steps.txt line 2: want 'name | seconds | command'" in run.stderr and "no-limit | x | true" in run.stderr
    assert not (tmp_path / "out" / "ok.log").exists()
