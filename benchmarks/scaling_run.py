"""Multi-GPU scaling of the tuner (issue 17): the same tune on 1, 2 and 4 GPUs of one machine, local and Ray.

Each run is the CLI as a user types it, in a fresh output folder (so a fresh journal: nothing resumes) and a fresh
Triton cache (every candidate compiles, as on a new machine); the GPUs it may use are the first n
(CUDA_VISIBLE_DEVICES), which is also what a Ray started by the run sees. Per run: wall time, the executor's
candidates and idle seconds per GPU (its summary lines), the workers' seconds per phase (from the journal), and the
winners. Then per tune kind: scaling efficiency
T(1 GPU) / (n * T(n GPUs)) against the 1-GPU local run, and each run's winners against that run's (same config, or
the winner's time within --spread of the 1-GPU winner's).

    python benchmarks/scaling_run.py --out $OUT/scaling --kinds moe,gemm --executors local --gpus 1,2,4
    python benchmarks/scaling_run.py --out $OUT/scaling --kinds moe --executors ray --gpus 2,4 --merge earlier.json
    python benchmarks/scaling_run.py --out $OUT/b --kinds moe --gpus 4,1 --tag b --merge $OUT/a/scaling.json  # a repeat

Runs with a --tag compare with the 1-GPU run of the same tag (pairs run back to back on one machine), and the table
ends with each n-GPU setting's efficiencies over its tags: their spread is the run-to-run noise of the efficiency.

Writes {out}/scaling.json (every run) and {out}/{run}/stdout.log; prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "moe": lambda out: ["moe", "-i", str(ROOT / "examples/untuned_fmoe.csv"), "-o", str(out / "tuned_fmoe.csv")],
    "gemm": lambda out: ["gemm", "--kernel", "bf16", "--shapes", str(ROOT / "examples/gemm_shapes.csv"),
                         "-o", str(out / "gemm")],
}
_EXECUTOR_LINE = re.compile(r"candidates per GPU ([\d, ]+); idle s per GPU ([\d., ]+)")
_RAY_NODE_LINE = re.compile(r"^\s*node .*candidates per GPU ([\d, ]+); idle s per GPU ([\d., ]+)")


def executor_figures(stdout: str) -> dict:
    """Candidates and idle seconds per GPU summed over the run's tune passes (each pass prints its own line)."""
    done: list[int] = []
    idle: list[float] = []
    for line in stdout.splitlines():
        match = _EXECUTOR_LINE.search(line) if line.lstrip().startswith("local:") else _RAY_NODE_LINE.search(line)
        if not match:
            continue
        counts = [int(x) for x in match.group(1).split(",")]
        seconds = [float(x) for x in match.group(2).split(",")]
        done = [a + b for a, b in zip(done, counts, strict=True)] if done else counts
        idle = [a + b for a, b in zip(idle, seconds, strict=True)] if idle else seconds
    return {"candidates_per_gpu": done, "idle_s_per_gpu": idle}


_PASSES_LINE = re.compile(r"passes: stage search ([\d.]+)s, end-to-end re-time ([\d.]+)s"
                          r"(?:; first candidate to a worker after ([\d.]+)s and ([\d.]+)s)?")


_OUTSIDE_LINE = re.compile(r"outside the passes: starting workers and pool ([\d.]+)s, closing them ([\d.]+)s, "
                           r"writing ([\d.]+)s")
_BEFORE_LINE = re.compile(r"before the tune: ([\d.]+)s")
# Its split, where the CLI prints five parts (since 2026-11-26's ninth session).
_BEFORE_SPLIT = re.compile(r"before the tune: [\d.]+s \([^:]*: ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+)s\)")
_BEFORE_PARTS = ("before_driver_s", "before_torch_s", "before_imports_s", "before_device_s", "before_rows_s")
_DONE_LINE = re.compile(r"  done ([\d.]+)s after the command started")


_ACCOUNTED = ("before_tune_s", "start_s", "search_s", "retime_s", "close_s", "write_s")


def with_residual(walls: dict[str, float], wall_s: float) -> dict[str, float]:
    """`walls` plus residual_s: the run's wall time outside every part the tuner prints (the interpreter's start, the
    process's exit, the output), where it printed them all; 1.4-1.6 s on 4 H200s (issue 17's fixed cost). With the
    command's "done" line, exit_s too: the wall after it (the interpreter's exit, and its start before the CLI
    module)."""
    if "done_s" in walls:  # the interpreter's start and exit, around what the command timed itself
        walls = {**walls, "exit_s": round(wall_s - walls["done_s"], 2)}
    if not all(name in walls for name in _ACCOUNTED):
        return walls
    return {**walls, "residual_s": round(wall_s - sum(walls[name] for name in _ACCOUNTED), 2)}


def pass_walls(stdout: str) -> dict[str, float]:
    """The fused-MoE tuner's two passes (stage search, end-to-end re-time): their wall seconds, as it prints them;
    and, where it prints them, the seconds outside the passes (the fixed cost n GPUs do not divide)."""
    match = _PASSES_LINE.search(stdout)
    if not match:
        return {}
    names = ("search_s", "retime_s", "search_first_task_s", "retime_first_task_s")
    walls = {name: float(value) for name, value in zip(names, match.groups(), strict=True) if value is not None}
    if outside := _OUTSIDE_LINE.search(stdout):
        walls.update(zip(("start_s", "close_s", "write_s"), map(float, outside.groups()), strict=True))
    if before := _BEFORE_LINE.search(stdout):
        walls["before_tune_s"] = float(before.group(1))
    if split := _BEFORE_SPLIT.search(stdout):
        walls.update(zip(_BEFORE_PARTS, map(float, split.groups()), strict=True))
    if done := _DONE_LINE.search(stdout):
        walls["done_s"] = float(done.group(1))
    return walls


def phase_seconds(out: Path) -> dict[str, float]:
    """Seconds the GPU workers spent per phase (inputs, bind, run, rerun, check, time; worker.py's phase_ms) over every
    passing measurement journaled under `out`, how many measurements carried them, and how many timings went back
    from the short park to the full one (TRITUNE_TIMER_PARK short)."""
    totals: dict[str, float] = {}
    counted = retimed = 0
    for path in out.rglob("journal-*.sqlite"):
        with sqlite3.connect(path) as conn:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'measurements'").fetchone():
                continue  # a journal file opened but never written
            for (extra,) in conn.execute("SELECT extra FROM measurements"):
                fields = json.loads(extra)
                phases = fields.get("phase_ms")
                retimed += fields.get("short_park_retimed", 0)
                if phases:
                    counted += 1
                    for name, ms in phases.items():
                        totals[name] = totals.get(name, 0.0) + ms / 1e3
    return {**{k: round(v, 1) for k, v in sorted(totals.items())}, "measurements": counted,
            "short_park_retimed": retimed}


def moe_winners(out: Path) -> dict[str, dict]:
    """Row key -> the written winner (kernel names, GPU and eager time)."""
    path = out / "tuned_fmoe.csv"
    if not path.exists():
        return {}
    winners = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            key = ",".join(row[c] for c in ("token", "model_dim", "inter_dim", "expert", "topk", "q_type",
                                             "q_dtype_a"))
            winners[key] = {"config": f"{row['kernelName1']}|{row['kernelName2']}|{row['run_1stage']}",
                            "us": float(row["us"]), "us_eager": float(row.get("us_eager") or "nan")}
    return winners


def gemm_winners(out: Path) -> dict[str, dict]:
    winners = {}
    for path in sorted((out / "gemm").glob("*-N=*-K=*.json")):
        data = json.loads(path.read_text())["tritune"]
        for m, entry in data["by_M"].items():
            winners[f"M={m},N={data['N']},K={data['K']}"] = {
                "config": json.dumps(entry["config"], sort_keys=True), "us": entry["time_us"],
                "us_eager": entry.get("eager_us") if entry.get("eager_us") is not None else float("nan")}
    return winners


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where it cannot be read."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _cpu_mhz() -> float | None:
    """Mean clock of the CPUs now (/proc/cpuinfo "cpu MHz"); None where it is not reported."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        return None
    return sum(mhz) / len(mhz) if mhz else None


class CpuSampler:
    """Once a second during a run: how many CPUs were busy and their mean clock. On 4 GPUs every process of a run
    spent more CPU on the same work than on 1 (compiles +22%, the workers' checks +47%, issue 17); a lower all-core
    clock while the pool keeps more cores busy is one explanation, and these figures test it."""

    def __init__(self, period_s: float = 1.0) -> None:
        import threading

        self.period_s, self.busy_cpus, self.mhz = period_s, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        ncpu = os.cpu_count() or 1
        last = _cpu_times()
        while not self._stop.wait(self.period_s):
            now, mhz = _cpu_times(), _cpu_mhz()
            if now and last and now[1] > last[1]:
                self.busy_cpus.append(ncpu * (now[0] - last[0]) / (now[1] - last[1]))
            last = now
            if mhz is not None:
                self.mhz.append(mhz)

    def figures(self) -> dict:
        def stats(xs: list[float]) -> dict | None:
            if not xs:
                return None
            xs = sorted(xs)
            return {"mean": round(sum(xs) / len(xs), 1), "p10": round(xs[len(xs) // 10], 1),
                    "p90": round(xs[(9 * len(xs)) // 10], 1)}
        return {"busy_cpus": stats(self.busy_cpus), "cpu_mhz": stats(self.mhz), "samples": len(self.busy_cpus)}


class GpuSampler:
    """Once a second during a run, per GPU: SM clock (MHz), power (W), utilisation (%) and temperature, from
    `nvidia-smi` running beside the run. The same timing loops took 8% more seconds on 4 GPUs than on 1 (issue 17)
    while the winners' own times did not move; a lower clock when all four draw power at once would show here."""

    QUERY = "index,clocks.sm,power.draw,utilization.gpu,temperature.gpu"

    def __init__(self, gpus: int, period_ms: int = 1000) -> None:
        self.gpus, self.period_ms = gpus, period_ms
        self._file = tempfile.TemporaryFile(mode="w+")
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                stdout=self._file, stderr=subprocess.DEVNULL)
            # Its first sample before the run starts: nvidia-smi opening every GPU while the CLI initialises CUDA
            # is a likely cause of the 4-GPU runs' 5.5 s before the tune (3.4-3.8 s without the sampler, 2026-11-26).
            deadline = time.perf_counter() + 10.0
            written = lambda: os.fstat(self._file.fileno()).st_size > 0  # noqa: E731
            while time.perf_counter() < deadline and self._proc.poll() is None and not written():
                time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def figures(self) -> dict | None:
        """Per GPU used: the mean of each quantity over the run's samples (None without nvidia-smi)."""
        if self._proc is None:
            return None
        self._file.seek(0)
        return gpu_figures(self._file.read(), self.gpus)


def gpu_figures(text: str, gpus: int) -> dict:
    """nvidia-smi CSV lines (index, SM MHz, W, %, C) -> {"sm_mhz": [mean per GPU], "power_w": ..., "util_pct": ...,
    "temp_c_max": [...], "samples": n} over GPUs 0..gpus-1; unparsable lines ("[N/A]") are skipped."""
    cols: dict[int, list[tuple[float, ...]]] = {i: [] for i in range(gpus)}
    for line in text.splitlines():
        try:
            index, *values = (float(x) for x in line.split(","))
        except ValueError:
            continue
        if int(index) in cols and len(values) == 4:
            cols[int(index)].append(tuple(values))
    mean = lambda xs: round(sum(xs) / len(xs), 1) if xs else None  # noqa: E731
    return {"sm_mhz": [mean([v[0] for v in cols[i]]) for i in range(gpus)],
            "power_w": [mean([v[1] for v in cols[i]]) for i in range(gpus)],
            "util_pct": [mean([v[2] for v in cols[i]]) for i in range(gpus)],
            "temp_c_max": [max((v[3] for v in cols[i]), default=None) for i in range(gpus)],
            "samples": min((len(v) for v in cols.values()), default=0)}


def run_one(kind: str, executor: str, gpus: int, out_root: Path, timeout_s: float,
            compile_workers: int | None = None, start_method: str = "forkserver", compile_lead: int = 0,
            tag: str = "") -> dict:
    """One CLI run; `compile_workers` (the CLI's --compile-workers, default every core), `compile_lead` (its
    --compile-lead, default off), `start_method` (TRITUNE_START_METHOD) and `tag` (a repeat's label) name the run
    too."""
    name = (f"{kind}-{executor}-{gpus}gpu" + (f"-cw{compile_workers}" if compile_workers else "")
            + (f"-lead{compile_lead}" if compile_lead else "")
            + ("" if start_method == "forkserver" else f"-{start_method}") + (f"-{tag}" if tag else ""))
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cache = Path(tempfile.mkdtemp(prefix=f"triton-{name}-"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))),
           "PYTHONUNBUFFERED": "1", "TRITUNE_START_METHOD": start_method}
    cmd = [sys.executable, "-m", "tritune.cli", *COMMANDS[kind](out), "--no-progress", "--executor", executor]
    if compile_workers:
        cmd += ["--compile-workers", str(compile_workers)]
    if compile_lead:
        cmd += ["--compile-lead", str(compile_lead)]
    t0 = time.perf_counter()
    with CpuSampler() as cpu, GpuSampler(gpus) as gpu:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as err:  # a result too: how far it got (the journal) in how long
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            rc, stdout, stderr = f"timeout after {timeout_s:.0f} s", text(err.stdout), text(err.stderr)
    wall = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    (out / "stdout.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    winners = moe_winners(out) if kind == "moe" else gemm_winners(out)
    return {"name": name, "kind": kind, "executor": executor, "gpus": gpus, "compile_workers": compile_workers,
            "compile_lead": compile_lead, "start_method": start_method, "tag": tag,
            "rc": rc,
            "wall_s": round(wall, 2), "command": " ".join(cmd[1:]), **executor_figures(stdout),
            "worker_phase_s": phase_seconds(out), "pass_wall_s": with_residual(pass_walls(stdout), wall),
            "cpu": cpu.figures(),
            "gpu": gpu.figures(), "winners": winners}


def compare(runs: list[dict], spread: float) -> list[dict]:
    """Efficiency and winner agreement of each run against the 1-GPU local run of its kind and setting (compile
    workers, compile lead, start method, tag), or, where there is none, the same without the tag, or the default
    1-GPU run of its kind (named in `baseline`)."""
    def setting(r: dict) -> tuple:
        return (r["kind"], r.get("compile_workers"), r.get("compile_lead", 0), r.get("start_method", "spawn"),
                r.get("tag", ""))

    base = {setting(r): r for r in runs if r["executor"] == "local" and r["gpus"] == 1 and r["rc"] == 0}
    rows = []
    for r in runs:
        kind, method = r["kind"], r.get("start_method", "spawn")
        ref = (base.get(setting(r)) or base.get((*setting(r)[:4], "")) or base.get((kind, None, 0, method, ""))
               or base.get((kind, None, 0, "forkserver", "")) or base.get((kind, None, 0, "spawn", "")))
        row = {"name": r["name"], "rc": r["rc"], "wall_s": r["wall_s"], "gpus": r["gpus"],
               "baseline": ref["name"] if ref else None,
               "candidates_per_gpu": r["candidates_per_gpu"], "idle_s_per_gpu": r["idle_s_per_gpu"]}
        busy = sum(r["idle_s_per_gpu"])
        span = r["wall_s"] * max(1, len(r["idle_s_per_gpu"]))
        row["idle_fraction_of_wall"] = round(busy / span, 3) if span else None
        if ref and r["rc"] != 0:
            row["efficiency_at_most"] = round(ref["wall_s"] / (r["gpus"] * r["wall_s"]), 3)  # unfinished: a bound
        elif ref:
            row["efficiency"] = round(ref["wall_s"] / (r["gpus"] * r["wall_s"]), 3)
            same = differ = 0
            worst = 1.0
            for key, w in ref["winners"].items():
                other = r["winners"].get(key)
                if other is None:
                    continue
                if other["config"] == w["config"]:
                    same += 1
                else:
                    differ += 1
                    worst = max(worst, other["us"] / w["us"], w["us"] / other["us"])
            row.update(winners_same=same, winners_differ=differ, worst_time_ratio_where_differ=round(worst, 3),
                       within_spread=worst <= 1 + spread, missing=len(set(ref["winners"]) - set(r["winners"])))
        rows.append(row)
    return rows


def efficiency_spread(runs: list[dict], rows: list[dict]) -> dict[str, dict]:
    """Per n-GPU setting (the run's name without its tag), the efficiencies of its tagged and untagged repeats: each
    against its own 1-GPU run, with their range."""
    by_name = {r["name"]: r for r in runs}
    groups: dict[str, list[float]] = {}
    for row in rows:
        run = by_name[row["name"]]
        if run["gpus"] == 1 or "efficiency" not in row:
            continue
        tag = run.get("tag", "")
        groups.setdefault(row["name"].removesuffix(f"-{tag}") if tag else row["name"], []).append(row["efficiency"])
    return {name: {"efficiencies": effs, "min": min(effs), "max": max(effs), "mean": round(sum(effs) / len(effs), 3)}
            for name, effs in groups.items() if len(effs) > 1}


def warm_up() -> float:
    """Seconds of one untimed start of what every run starts (Python, torch, Triton, tritune's CLI, every GPU): the
    first run on a fresh machine otherwise reads them from a cold disk cache (6.7 s before the tune against 3.4 s
    warm, measured on 4 H200s) and the order of the runs would bias their comparison."""
    start = time.perf_counter()
    code = ("import torch, triton, tritune.cli; "
            "[torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]")
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=600)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default="moe,gemm")
    ap.add_argument("--executors", default="local")
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--merge", type=Path, action="append", default=[], help="earlier scaling.json to compare with")
    ap.add_argument("--spread", type=float, default=0.05, help="winner time difference taken as run-to-run noise")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds per run")
    ap.add_argument("--compile-workers", type=int, help="the CLI's --compile-workers for every run (default: every "
                    "core); runs compare with the 1-GPU run of the same setting")
    ap.add_argument("--compile-lead", type=int, default=0, help="the CLI's --compile-lead for every run (default 0: "
                    "off); runs compare with the 1-GPU run of the same setting")
    ap.add_argument("--tag", default="", help="a label for these runs (a repeat): they compare with the 1-GPU run "
                    "of the same tag; letters, digits and - only")
    ap.add_argument("--start-method", choices=("spawn", "forkserver"), default="forkserver",
                    help="TRITUNE_START_METHOD for every run (how compile processes and GPU workers start)")
    args = ap.parse_args(argv)
    if args.tag and not re.fullmatch(r"[A-Za-z0-9-]+", args.tag):
        ap.error(f"--tag {args.tag!r}: use letters, digits and - only (it becomes part of each run's folder name)")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [run for path in args.merge for run in json.loads(path.read_text())["runs"]]
    print(f"warm-up (imports and CUDA start-up, untimed): {warm_up():.1f}s", flush=True)
    for kind in args.kinds.split(","):
        for executor in args.executors.split(","):
            for gpus in map(int, args.gpus.split(",")):
                run = run_one(kind, executor, gpus, args.out, args.timeout, args.compile_workers, args.start_method,
                              args.compile_lead, args.tag)
                runs = [r for r in runs if r["name"] != run["name"]] + [run]
                print(f"{run['name']}: rc {run['rc']} wall {run['wall_s']:.1f}s per GPU {run['candidates_per_gpu']} "
                      f"idle {run['idle_s_per_gpu']} cpu {run['cpu']} gpu {run['gpu']}", flush=True)
                rows = compare(runs, args.spread)
                (args.out / "scaling.json").write_text(json.dumps(
                    {"runs": runs, "table": rows, "spread": efficiency_spread(runs, rows)}, indent=1))
    rows = compare(runs, args.spread)
    for row in rows:
        print(json.dumps(row))
    for name, spread in efficiency_spread(runs, rows).items():
        print(f"{name}: efficiency {spread['min']}-{spread['max']} over {len(spread['efficiencies'])} repeats "
              f"(mean {spread['mean']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
