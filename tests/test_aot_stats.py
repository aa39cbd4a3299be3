"""aot.stats: perf_stats.csv accumulates (append, or rewrite with the union of columns, never dropping a
row), reads back typed, and a bad cell fails naming the file, row and column."""

import csv
import math
import xml.etree.ElementTree as ET

import pytest

from tritune.aot.plot import time_plot_svg
from tritune.aot.stats import PerfStatsError, StatRow, latest_rows, read_perf_stats, write_perf_stats


def row(artifact, ts="2026-11-21T10:00:00.000000Z", valid=True, median=10.0, **params):
    return StatRow(timestamp=ts, artifact=artifact, kernel="k", params=params or {"BLOCK_SIZE_M": 64},
                   valid=valid, reason="" if valid else "exit 3: cannot open data/x.tdat, twice \"quoted\"",
                   median_us=median if valid else math.nan, min_us=median - 1 if valid else math.nan,
                   max_us=median + 1 if valid else math.nan, reps=100 if valid else 0, total_s=1.23456)


def header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_new_file_column_order_and_round_trip(tmp_path):
    path = tmp_path / "perf_stats.csv"
    rows = [row("a", num_warps=4, BLOCK_SIZE_N=128, act="silu", BLOCK_SIZE_M=64, GROUP_SIZE_M=8, scale=0.5),
            row("b", valid=False, BLOCK_SIZE_M=32)]
    write_perf_stats(path, rows)
    assert header(path) == ["timestamp", "artifact", "kernel", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "GROUP_SIZE_M",
                            "act", "num_warps", "scale", "valid", "reason", "median_us", "min_us", "max_us",
                            "reps", "total_s"]
    back = read_perf_stats(path)
    assert back[0].params == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 8, "act": "silu",
                              "num_warps": 4, "scale": 0.5}
    assert back[1].params == {"BLOCK_SIZE_M": 32}  # empty cells are parameters the row does not have
    assert back[0].total_s == 1.235 and back[0].median_us == 10.0 and back[0].valid
    assert not back[1].valid and back[1].reason == rows[1].reason and math.isnan(back[1].median_us)


def test_same_columns_append_keeps_old_bytes(tmp_path):
    path = tmp_path / "perf_stats.csv"
    write_perf_stats(path, [row("a")])
    old = path.read_text()
    write_perf_stats(path, [row("a", ts="2026-11-21T11:00:00.000000Z", median=8.0)])
    assert path.read_text().startswith(old)
    rows = read_perf_stats(path)
    assert [r.median_us for r in rows] == [10.0, 8.0]
    assert [r.median_us for r in latest_rows(rows)] == [8.0]


def test_fewer_params_append_with_empty_cells(tmp_path):
    path = tmp_path / "perf_stats.csv"
    write_perf_stats(path, [row("a", BLOCK_SIZE_M=64, num_warps=4)])
    old = path.read_text()
    write_perf_stats(path, [row("b", BLOCK_SIZE_M=16)])
    assert path.read_text().startswith(old)
    assert read_perf_stats(path)[1].params == {"BLOCK_SIZE_M": 16}


def test_new_columns_rewrite_with_union_keeping_old_cells(tmp_path):
    path = tmp_path / "perf_stats.csv"
    write_perf_stats(path, [row("a", BLOCK_SIZE_M=64, num_warps=4)])
    # A hand-edited cell must survive the rewrite as written.
    path.write_text(path.read_text().replace(",10.0,", ",10.000,"))
    write_perf_stats(path, [row("b", BLOCK_SIZE_N=32, num_stages=3)])
    assert header(path)[3:7] == ["BLOCK_SIZE_M", "BLOCK_SIZE_N", "num_stages", "num_warps"]
    rows = read_perf_stats(path)
    assert [r.params for r in rows] == [{"BLOCK_SIZE_M": 64, "num_warps": 4}, {"BLOCK_SIZE_N": 32, "num_stages": 3}]
    assert ",10.000," in path.read_text()


def test_not_a_perf_stats_file_is_left_alone(tmp_path):
    path = tmp_path / "perf_stats.csv"
    path.write_text("name,value\nx,1\n")
    with pytest.raises(PerfStatsError, match="not a perf_stats file: the header lacks column"):
        write_perf_stats(path, [row("a")])
    assert path.read_text() == "name,value\nx,1\n"


def test_param_name_clashing_with_a_fixed_column(tmp_path):
    with pytest.raises(PerfStatsError, match="clash with fixed columns"):
        write_perf_stats(tmp_path / "p.csv", [StatRow("2026-11-21T10:00:00Z", "a", "k", params={"reps": 1})])
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize("column, value, expected", [
    ("timestamp", "yesterday", "an ISO-8601 time such as 2026-11-21T10:00:00Z"),
    ("artifact", "", "an artifact id"),
    ("valid", "yes", "True or False"),
    ("median_us", "fast", "a number or an empty cell"),
    ("reps", "1.5", "an integer >= 0"),
    ("total_s", "x", "a number"),
])
def test_read_errors_name_file_row_and_column(tmp_path, column, value, expected):
    path = tmp_path / "perf_stats.csv"
    write_perf_stats(path, [row("a"), row("b")])
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    table[2][table[0].index(column)] = value
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(table)
    with pytest.raises(PerfStatsError) as err:
        read_perf_stats(path)
    assert str(err.value) == f"{path}, row 2 (line 3), column '{column}': value {value!r}: expected {expected}"


def test_read_structural_errors(tmp_path):
    path = tmp_path / "perf_stats.csv"
    with pytest.raises(PerfStatsError, match="no such file"):
        read_perf_stats(path)
    path.write_text("")
    with pytest.raises(PerfStatsError, match="empty file"):
        read_perf_stats(path)
    write_perf_stats(path, [row("a")])
    path.write_text(path.read_text() + "x,y\n")
    with pytest.raises(PerfStatsError, match=r"row 2 \(line 3\): 2 fields, but the header has 11"):
        read_perf_stats(path)
    path.write_text("timestamp,artifact,artifact\n")
    with pytest.raises(PerfStatsError, match="artifact appear more than once"):
        read_perf_stats(path)


def test_latest_rows_per_artifact_in_first_seen_order():
    rows = [row("a", ts="2026-11-21T10:00:00Z", median=1.0), row("b", ts="2026-11-21T10:00:00Z"),
            row("a", ts="2026-11-21T09:00:00Z", median=2.0), row("a", ts="2026-11-21T10:00:00+00:00", median=3.0)]
    latest = latest_rows(rows)
    assert [r.artifact for r in latest] == ["a", "b"]
    assert latest[0].median_us == 3.0  # a tie goes to the later row; an older timestamp never wins


def test_plot_escapes_text_and_handles_no_valid_rows():
    svg = time_plot_svg([row("x<&>", valid=False)], 'title "q" <b> \x00')
    assert "no valid configuration" in svg and "x&lt;&amp;&gt;" in svg and "\x00" not in svg
    ET.fromstring(svg.split("\n", 1)[1])
