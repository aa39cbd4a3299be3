"""aot.runner: a fake bundle whose bin/ holds shell scripts playing every kind of executable (good, wrong,
missing data, crash, hang, lying about its id), plus a compile error and a missing binary. Only the good ones
may come out valid; stats accumulate; the SVG and the logs are written."""

import csv
import math
import stat
import time
import xml.etree.ElementTree as ET

import pytest

from tritune.aot import runner
from tritune.aot.manifest import ArtifactEntry, KernelEntry, Manifest, write_manifest
from tritune.aot.runner import run_bundle, summary_lines
from tritune.aot.stats import latest_rows, read_perf_stats

# The good scripts echo the --reps they were given, so the test sees the arguments arrive.
GOOD = r"""#!/bin/sh
reps=0
while [ $# -gt 0 ]; do case "$1" in --reps) reps=$2; shift;; esac; shift; done
echo "args ok"
echo 'TRITUNE_RESULT {"artifact": "@ID@", "valid": true, "max_abs_err": 0.0, "mismatch_ratio": 0.0, '\
'"rel_l2": 0.0, "median_us": @MED@, "min_us": @MIN@, "max_us": @MAX@, "reps": '$reps', "grid": [4, 1, 1], '\
'"error": ""}'
echo "done"
"""
ROLES = {
    "k_BM64_fast": GOOD.replace("@MED@", "10.5").replace("@MIN@", "9.5").replace("@MAX@", "12.0"),
    "k_BM128_slow": GOOD.replace("@MED@", "20.25").replace("@MIN@", "19.0").replace("@MAX@", "25.0"),
    "k_BM32_wrong": """#!/bin/sh
echo 'TRITUNE_RESULT {"artifact": "@ID@", "valid": false, "mismatch_ratio": 0.125, "rel_l2": 0.75, '\
'"median_us": 5.0, "min_us": 5.0, "max_us": 5.0, "reps": 3, "error": ""}'
echo "out: 12.5% mismatched" >&2
exit 1
""",
    "k_BM16_nodata": """#!/bin/sh
echo "cannot open data/x.tdat" >&2
exit 3
""",
    "k_BM8_crash": """#!/bin/sh
echo "about to fault"
kill -SEGV $$
""",
    "k_BM4_hang": """#!/bin/sh
echo "spinning"
sleep 30
""",
    "k_BM2_liar": """#!/bin/sh
echo 'TRITUNE_RESULT {"artifact": "k_BM64_fast", "valid": true, "median_us": 1.0, "min_us": 1.0, '\
'"max_us": 1.0, "reps": 3, "error": ""}'
""",
}
BLOCK = {"k_BM64_fast": 64, "k_BM128_slow": 128, "k_BM32_wrong": 32, "k_BM16_nodata": 16, "k_BM8_crash": 8,
         "k_BM4_hang": 4, "k_BM2_liar": 2, "k_BM256_cerr": 256, "k_BM512_nobin": 512}
IDS = list(BLOCK)


@pytest.fixture
def bundle(tmp_path):
    root = tmp_path / "bundle"
    (root / "specs").mkdir(parents=True)
    (root / "specs" / "k.spec").write_text("tritune-spec 1\nkernel\tk\n")
    (root / "bin").mkdir()
    for ident, script in ROLES.items():
        path = root / "bin" / ident
        path.write_text(script.replace("@ID@", ident))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    artifacts = []
    for ident, bm in BLOCK.items():
        status, error = ("compile_error", "out of resources: shared memory 262144 > 232448") \
            if ident == "k_BM256_cerr" else ("ok", "")
        artifacts.append(ArtifactEntry(id=ident, kernel="k", params={"num_warps": 4, "BLOCK_SIZE_N": 64,
                                                                     "BLOCK_SIZE_M": bm, "GROUP_SIZE_M": 8},
                                       status=status, error=error, files={"binary": f"bin/{ident}"},
                                       target="cuda:90", triton="3.6.0"))
    manifest = Manifest(created="2026-11-21T10:00:00Z", target="cuda:90", triton="3.6.0", torch="2.11.0",
                        tritune="0.1.0", build_host="test",
                        kernels={"k": KernelEntry(name="k", spec="specs/k.spec", grid=["4", "1", "1"])},
                        artifacts=artifacts)
    write_manifest(root, manifest)
    return root


def run(root, **kw):
    return run_bundle(root, reps=7, warmup=2, timeout_s=1.0, progress=False, **kw)


def test_every_role_gets_the_right_verdict(bundle):
    start = time.monotonic()
    rows = run(bundle)
    assert time.monotonic() - start < 20  # the hang is killed at the timeout, not waited for
    assert [r.artifact for r in rows] == IDS
    by = {r.artifact: r for r in rows}
    assert [r.artifact for r in rows if r.valid] == ["k_BM64_fast", "k_BM128_slow"]
    fast = by["k_BM64_fast"]
    assert (fast.median_us, fast.min_us, fast.max_us, fast.reps, fast.reason) == (10.5, 9.5, 12.0, 7, "")
    assert fast.params == {"num_warps": 4, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_M": 64, "GROUP_SIZE_M": 8}
    assert by["k_BM32_wrong"].reason == "wrong output: mismatch_ratio=0.125, rel_l2=0.75"
    assert by["k_BM16_nodata"].reason == "exit 3: cannot open data/x.tdat"
    assert by["k_BM8_crash"].reason == "crashed: signal SIGSEGV"
    assert by["k_BM4_hang"].reason == "timeout after 1s"
    # Well under the 5 s drain: the whole process group (the shell and its `sleep`) was killed.
    assert 0.9 < by["k_BM4_hang"].total_s < 4
    assert by["k_BM2_liar"].reason.startswith("result is for artifact 'k_BM64_fast'")
    assert by["k_BM256_cerr"].reason == "not built: out of resources: shared memory 262144 > 232448"
    assert by["k_BM512_nobin"].reason == f"missing binary bin/k_BM512_nobin (build with `make -C {bundle}`)"
    for r in rows:
        if not r.valid:
            assert math.isnan(r.median_us) and r.reps == 0
    assert by["k_BM256_cerr"].total_s == 0.0 and by["k_BM512_nobin"].total_s == 0.0


def test_perf_stats_csv_columns_and_values(bundle):
    run(bundle)
    with open(bundle / "perf_stats.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["timestamp", "artifact", "kernel", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "GROUP_SIZE_M",
                        "num_warps", "valid", "reason", "median_us", "min_us", "max_us", "reps", "total_s"]
    assert [line[1] for line in table[1:]] == IDS
    fast = dict(zip(table[0], table[1], strict=True))
    assert fast["timestamp"].endswith("Z") and fast["kernel"] == "k"
    assert (fast["BLOCK_SIZE_M"], fast["num_warps"], fast["valid"]) == ("64", "4", "True")
    assert (fast["median_us"], fast["min_us"], fast["max_us"], fast["reps"]) == ("10.5", "9.5", "12.0", "7")
    crash = dict(zip(table[0], table[5], strict=True))
    assert (crash["valid"], crash["reason"], crash["median_us"]) == ("False", "crashed: signal SIGSEGV", "")


def test_second_run_appends_and_latest_rows_picks_it(bundle):
    first = run(bundle)
    second = run(bundle, only=["k_BM128_slow", "k_BM64_fast"])
    assert [r.artifact for r in second] == ["k_BM64_fast", "k_BM128_slow"]  # manifest order, not `only` order
    rows = read_perf_stats(bundle / "perf_stats.csv")
    assert len(rows) == len(IDS) + 2
    assert [r.timestamp for r in rows[: len(IDS)]] == [r.timestamp for r in first]  # the old rows stay
    # Read back equal to what was returned, up to the rounding of total_s to ms.
    assert [(r.timestamp, r.artifact, r.median_us, r.valid) for r in rows[len(IDS):]] == \
        [(r.timestamp, r.artifact, r.median_us, r.valid) for r in second]
    assert [round(r.total_s, 3) for r in second] == [r.total_s for r in rows[len(IDS):]]
    latest = {r.artifact: r for r in latest_rows(rows)}
    assert len(latest) == len(IDS)
    assert latest["k_BM64_fast"].timestamp == second[0].timestamp != first[0].timestamp
    assert latest["k_BM4_hang"].timestamp == first[5].timestamp


def test_svg_is_xml_with_valid_bars_and_invalid_list(bundle):
    run(bundle)
    root = ET.parse(bundle / "perf_stats.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    labels = [t for t in texts if t in ("k_BM64_fast", "k_BM128_slow")]
    assert labels == ["k_BM64_fast", "k_BM128_slow"]  # fastest first
    assert any("10.50 us fastest" in t for t in texts)
    assert "not valid (7):" in texts
    assert "k_BM8_crash: crashed: signal SIGSEGV" in texts
    assert any(t.startswith("k_BM512_nobin: missing binary") for t in texts)


def test_logs_hold_full_output(bundle):
    run(bundle)
    logs = bundle / "logs"
    assert sorted(p.name for p in logs.iterdir()) == sorted(f"{i}.log" for i in IDS)
    good = (logs / "k_BM64_fast.log").read_text()
    assert "args ok" in good and "done" in good and "--reps 7 --warmup 2" in good
    assert f"--spec {bundle}/specs/k.spec" in good and f"--bundle {bundle}" in good
    assert "cannot open data/x.tdat" in (logs / "k_BM16_nodata.log").read_text()
    assert "spinning" in (logs / "k_BM4_hang.log").read_text()
    assert "out of resources" in (logs / "k_BM256_cerr.log").read_text()


def test_flush_bytes_and_custom_outputs(bundle, tmp_path):
    out, svg = tmp_path / "o" / "stats.csv", tmp_path / "o" / "plot.svg"
    rows = run(bundle, only=["k_BM64_fast"], flush_bytes=1 << 20, output=out, plot=svg)
    assert len(rows) == 1 and rows[0].valid
    assert out.exists() and svg.exists() and not (bundle / "perf_stats.csv").exists()
    assert "--flush-bytes 1048576" in (bundle / "logs" / "k_BM64_fast.log").read_text()


def test_not_executable_binary_is_reported(bundle):
    (bundle / "bin" / "k_BM64_fast").chmod(0o644)
    [row] = run(bundle, only=["k_BM64_fast"])
    assert not row.valid and row.reason.startswith("binary bin/k_BM64_fast is not executable")


def test_unknown_id_is_an_error(bundle):
    with pytest.raises(ValueError, match=r"manifest.json: unknown artifact id\(s\): nope, k_x"):
        run(bundle, only=["k_BM64_fast", "nope", "k_x"])
    assert not (bundle / "perf_stats.csv").exists()


def test_unusable_stats_file_fails_before_running(bundle):
    (bundle / "perf_stats.csv").write_text("mine,not,yours\n")
    with pytest.raises(ValueError, match="not a perf_stats file"):
        run(bundle, only=["k_BM64_fast"])
    assert not (bundle / "logs").exists()
    assert (bundle / "perf_stats.csv").read_text() == "mine,not,yours\n"


def test_ctrl_c_keeps_finished_rows(bundle, monkeypatch):
    real = runner.run_artifact
    calls = []

    def interrupt_second(*args):
        calls.append(args[2].id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(runner, "run_artifact", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        run(bundle)
    assert [r.artifact for r in read_perf_stats(bundle / "perf_stats.csv")] == ["k_BM64_fast"]
    assert "(interrupted)" in (bundle / "perf_stats.svg").read_text()


def test_bad_settings_are_errors(bundle):
    with pytest.raises(ValueError, match="reps=0"):
        run_bundle(bundle, reps=0, progress=False)
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_bundle(bundle, timeout_s=0, progress=False)


def test_summary_lines(bundle):
    rows = run(bundle, only=["k_BM64_fast", "k_BM128_slow", "k_BM8_crash"])
    assert summary_lines(rows) == ["2/3 configs valid", "fastest k: k_BM64_fast 10.50 us (min 9.50, max 12.00)",
                                   "not valid (1):", "  k_BM8_crash: crashed: signal SIGSEGV"]


def test_progress_bar_does_not_break_the_run(bundle, capsys):
    rows = run_bundle(bundle, only=["k_BM64_fast"], progress=True, timeout_s=5)
    assert rows[0].valid
    assert "1/1 valid" in capsys.readouterr().err
