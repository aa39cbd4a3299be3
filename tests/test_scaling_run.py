"""benchmarks/scaling_run.py without a GPU: the executor lines it reads, winners from real output files, and the
efficiency / winner-agreement table."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("scaling_run", ROOT / "benchmarks" / "scaling_run.py")
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)


def test_executor_lines_summed_over_passes_local_and_ray():
    local = ("local: 2 worker(s) on device(s) 0, 1; 30 measurement(s) in 9.0s; candidates per GPU 16, 14; "
             "idle s per GPU 1.5, 2.0 (19% of the time since ready)\n"
             "noise candidates per GPU 9; idle s per GPU 9\n"
             "  local: 2 worker(s) on device(s) 0, 1; 4 measurement(s) in 2.0s; candidates per GPU 2, 2; "
             "idle s per GPU 0.5, 0.0 (12% of the time since ready)\n")
    assert "  local: 2" in local  # the MoE tuner indents its summary lines
    assert scaling.executor_figures(local) == {"candidates_per_gpu": [18, 16], "idle_s_per_gpu": [2.0, 2.0]}
    ray = ("ray: 1 node(s), 2 GPU(s) of NVIDIA H200; 10 measurement(s) in 5.0s; 0 re-queued\n"
           "  node host/ab12cd34: 2 GPU(s); candidates per GPU 6, 4; idle s per GPU 0.3, 1.2; 3 compile(s)\n")
    assert scaling.executor_figures(ray) == {"candidates_per_gpu": [6, 4], "idle_s_per_gpu": [0.3, 1.2]}


def _run(name, gpus, wall, winners, executor="local", rc=0):
    return {"name": name, "kind": "gemm", "executor": executor, "gpus": gpus, "rc": rc, "wall_s": wall,
            "candidates_per_gpu": [1] * gpus, "idle_s_per_gpu": [1.0] * gpus, "winners": winners}


def test_pass_walls_read_from_the_moe_summary():
    text = "== run: 2 row(s), stage search and end-to-end re-time together\n  passes: stage search 102.9s, " \
           "end-to-end re-time 4.0s\n"
    assert scaling.pass_walls(text) == {"search_s": 102.9, "retime_s": 4.0}
    text = text.replace("4.0s\n", "4.0s; first candidate to a worker after 6.2s and 0.8s\n")
    assert scaling.pass_walls(text) == {"search_s": 102.9, "retime_s": 4.0, "search_first_task_s": 6.2,
                                        "retime_first_task_s": 0.8}
    text += ("  outside the passes: starting workers and pool 0.4s, closing them 2.1s, writing 0.3s\n"
             "  before the tune: 3.5s (imports, device, reading and checking the rows)\n")
    assert scaling.pass_walls(text) == {"search_s": 102.9, "retime_s": 4.0, "search_first_task_s": 6.2,
                                        "retime_first_task_s": 0.8, "start_s": 0.4, "close_s": 2.1, "write_s": 0.3,
                                        "before_tune_s": 3.5}
    assert scaling.pass_walls("wrote 3 shape file(s)") == {}  # the GEMM tuner has one pass
    split = text.replace("(imports, device, reading and checking the rows)",
                         "(driver query and fork server, torch, tritune's imports, device, reading and checking the "
                         "rows: 0.9 / 1.6 / 0.7 / 0.1 / 0.2s)")
    assert {k: v for k, v in scaling.pass_walls(split).items() if k.startswith("before_")} == {
        "before_tune_s": 3.5, "before_driver_s": 0.9, "before_torch_s": 1.6, "before_imports_s": 0.7,
        "before_device_s": 0.1, "before_rows_s": 0.2}
    done = scaling.pass_walls(split + "  done 113.1s after the command started (the interpreter's exit follows)\n")
    assert done["done_s"] == 113.1 and scaling.with_residual(done, 115.0)["exit_s"] == 1.9
    walls = scaling.pass_walls(text)
    assert scaling.with_residual(walls, 115.0)["residual_s"] == round(115.0 - (3.5 + 0.4 + 102.9 + 4.0 + 2.1 + 0.3), 2)
    assert scaling.with_residual({"search_s": 1.0}, 5.0) == {"search_s": 1.0}  # not every part printed: none


def test_compare_efficiency_and_winners():
    a = {"config": "A", "us": 10.0}
    runs = [_run("g1", 1, 100.0, {"p": a, "q": {"config": "B", "us": 20.0}}),
            _run("g2", 2, 55.0, {"p": a, "q": {"config": "C", "us": 20.6}}),
            _run("g4", 4, 40.0, {"p": {"config": "D", "us": 12.0}}, executor="ray")]
    rows = {r["name"]: r for r in scaling.compare(runs, spread=0.05)}
    assert rows["g1"]["efficiency"] == 1.0 and rows["g1"]["winners_same"] == 2
    assert rows["g2"]["efficiency"] == round(100 / 110, 3)
    assert rows["g2"]["winners_differ"] == 1 and rows["g2"]["within_spread"]  # 3% apart
    assert rows["g4"]["efficiency"] == 0.625 and rows["g4"]["missing"] == 1
    assert not rows["g4"]["within_spread"] and rows["g4"]["worst_time_ratio_where_differ"] == 1.2
    assert rows["g2"]["idle_fraction_of_wall"] == round(2.0 / 110.0, 3)


def test_gemm_winners_read_from_the_written_json(tmp_path):
    (tmp_path / "gemm").mkdir()
    doc = {"small": {}, "tritune": {"N": 64, "K": 32, "by_M": {
        "16": {"M": 16, "config": {"BLOCK_SIZE_M": 16}, "time_us": 3.0, "eager_us": None}}}}
    (tmp_path / "gemm" / "dev-GEMM-BF16-N=64-K=32.json").write_text(json.dumps(doc))
    (tmp_path / "gemm" / "dev-GEMM-BF16.json").write_text(json.dumps({"tritune": {}}))  # the default: not a shape
    (w,) = scaling.gemm_winners(tmp_path).items()
    assert w[0] == "M=16,N=64,K=32" and w[1]["us"] == 3.0 and w[1]["config"] == '{"BLOCK_SIZE_M": 16}'


def test_worker_phases_summed_from_the_journal(tmp_path):
    from tritune.tuning.journal import Journal
    from tritune.tuning.types import Config, Measurement, Status

    with Journal(tmp_path / "gemm" / "journal-dev.sqlite") as journal:
        for i, phases in enumerate([{"inputs": 1000.0, "bind": 5.0, "check": 20.0, "time": 3.0},
                                    {"inputs": 0.0, "bind": 5.0, "check": 20.0, "time": 3.0}, None]):
            extra = {"phase_ms": phases, "short_park_retimed": i} if phases else {}
            journal.record(Measurement("p", Config.of(i=i), Status.OK, time_us=1.0, extra=extra))
    assert scaling.phase_seconds(tmp_path) == {"bind": 0.0, "check": 0.0, "inputs": 1.0, "time": 0.0,
                                               "measurements": 2, "short_park_retimed": 1}


def test_a_run_past_its_timeout_is_recorded_not_raised(tmp_path):
    run = scaling.run_one("gemm", "local", 1, tmp_path, timeout_s=0.01)  # killed long before the CLI starts tuning
    assert run["rc"] == "timeout after 0 s" and run["wall_s"] < 30
    assert (tmp_path / "gemm-local-1gpu" / "stdout.log").exists()
    rows = {r["name"]: r for r in scaling.compare([_run("gemm-local-1gpu1", 1, 100.0, {}), {**run, "wall_s": 80.0}],
                                                  spread=0.05)}
    late = rows["gemm-local-1gpu"]
    assert late["efficiency_at_most"] == 1.25 and "efficiency" not in late  # unfinished: only a bound


def test_runs_compare_with_the_1_gpu_run_of_their_compile_workers(tmp_path):
    run = scaling.run_one("gemm", "local", 1, tmp_path, timeout_s=0.01, compile_workers=7)
    assert run["name"] == "gemm-local-1gpu-cw7" and run["compile_workers"] == 7
    assert run["start_method"] == "forkserver"  # the product's default, unnamed
    spawned = scaling.run_one("gemm", "local", 1, tmp_path, timeout_s=0.01, start_method="spawn")
    assert spawned["name"] == "gemm-local-1gpu-spawn"
    assert "--compile-workers 7" in run["command"]
    runs = [_run("all-1", 1, 100.0, {}), {**_run("cw-1", 1, 90.0, {}), "compile_workers": 7},
            {**_run("cw-4", 4, 25.0, {}), "compile_workers": 7}, _run("all-4", 4, 30.0, {})]
    rows = {r["name"]: r for r in scaling.compare(runs, spread=0.05)}
    assert rows["cw-4"]["efficiency"] == 0.9 and rows["all-4"]["efficiency"] == round(100 / 120, 3)


def test_cpu_sampler_counts_busy_cpus_and_their_clock():
    import time

    with scaling.CpuSampler(period_s=0.05) as cpu:
        end = time.perf_counter() + 0.4
        while time.perf_counter() < end:  # one CPU busy here
            pass
    fig = cpu.figures()
    assert fig["samples"] >= 3 and fig["busy_cpus"]["mean"] > 0.3
    assert fig["busy_cpus"]["p10"] <= fig["busy_cpus"]["mean"] <= fig["busy_cpus"]["p90"] + 1e-9
    assert fig["cpu_mhz"] is None or fig["cpu_mhz"]["mean"] > 0  # some VMs do not report a clock
    assert scaling.CpuSampler().figures() == {"busy_cpus": None, "cpu_mhz": None, "samples": 0}


def test_gpu_figures_average_each_gpu_and_skip_unreadable_lines():
    text = ("0, 1980, 650.5, 100, 60\n1, 1700, 700.0, 90, 70\n0, 1800, 600.5, 80, 64\n"
            "1, [N/A], 690.0, 95, 71\n2, 1000, 100, 0, 30\ngarbage\n")
    fig = scaling.gpu_figures(text, 2)
    assert fig["sm_mhz"] == [1890.0, 1700.0] and fig["power_w"] == [625.5, 700.0]
    assert fig["util_pct"] == [90.0, 90.0] and fig["temp_c_max"] == [64.0, 70.0]
    assert fig["samples"] == 1  # GPU 1 has one readable sample; GPU 2 is not one of the run's
    assert scaling.gpu_figures("", 1) == {"sm_mhz": [None], "power_w": [None], "util_pct": [None],
                                          "temp_c_max": [None], "samples": 0}


def test_a_setting_compares_with_its_own_1gpu_run_else_the_default_one():
    a = {"config": "A", "us": 10.0}
    runs = [_run("g1", 1, 100.0, {"p": a}), _run("g4", 4, 30.0, {"p": a}),
            {**_run("g4-cw24", 4, 25.0, {"p": a}), "compile_workers": 24},
            {**_run("g1-fs", 1, 90.0, {"p": a}), "start_method": "forkserver"},
            {**_run("g4-fs", 4, 25.0, {"p": a}), "start_method": "forkserver"}]
    rows = {r["name"]: r for r in scaling.compare(runs, spread=0.05)}
    assert rows["g4"]["baseline"] == "g1" and rows["g4"]["efficiency"] == round(100 / 120, 3)
    assert rows["g4-cw24"]["baseline"] == "g1" and rows["g4-cw24"]["efficiency"] == 1.0  # no 1-GPU cw24 run
    assert rows["g4-fs"]["baseline"] == "g1-fs" and rows["g4-fs"]["efficiency"] == 0.9


def test_tagged_repeats_pair_with_their_own_1_gpu_run_and_report_the_spread(tmp_path, capsys):
    run = scaling.run_one("gemm", "local", 1, tmp_path, timeout_s=0.01, tag="b")
    assert run["name"] == "gemm-local-1gpu-b" and run["tag"] == "b"
    runs = [{**_run("g-1gpu", 1, 300.0, {}), "tag": ""}, {**_run("g-4gpu", 4, 100.0, {}), "tag": ""},
            {**_run("g-1gpu-b", 1, 320.0, {}), "tag": "b"}, {**_run("g-4gpu-b", 4, 94.0, {}), "tag": "b"},
            {**_run("g-2gpu-c", 2, 160.0, {}), "tag": "c"}]  # no 1-GPU run tagged c: the untagged one
    rows = scaling.compare(runs, spread=0.05)
    by = {r["name"]: r for r in rows}
    assert by["g-4gpu"]["efficiency"] == 0.75 and by["g-4gpu"]["baseline"] == "g-1gpu"
    assert by["g-4gpu-b"]["efficiency"] == round(320 / 376, 3) and by["g-4gpu-b"]["baseline"] == "g-1gpu-b"
    assert by["g-2gpu-c"]["baseline"] == "g-1gpu"
    spread = scaling.efficiency_spread(runs, rows)
    assert set(spread) == {"g-4gpu"}  # the 2-GPU setting ran once: no spread
    assert spread["g-4gpu"]["efficiencies"] == [0.75, round(320 / 376, 3)] and spread["g-4gpu"]["min"] == 0.75
    with pytest.raises(SystemExit) as exit_:
        scaling.main(["--out", str(tmp_path / "x"), "--tag", "a b"])
    assert exit_.value.code == 2 and "--tag 'a b': use letters, digits and - only" in capsys.readouterr().err
