"""`tritune aot run`: run every artifact executable of a bundle on the target machine, judge each run, keep
its full output in `logs/<id>.log`, and add the results to `perf_stats.csv` and `perf_stats.svg`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tritune.aot.manifest import MANIFEST_NAME, ArtifactEntry, Manifest, load_manifest
from tritune.aot.plot import write_time_plot
from tritune.aot.stats import StatRow, check_extendable, utc_now, write_perf_stats
from tritune.aot.verdict import Verdict, judge, not_built, not_run

# After a timeout kill, how long to wait for the pipes to close (a stray grandchild may hold them open).
_DRAIN_S = 5.0


@dataclass(frozen=True)
class RunSettings:
    """How each executable is run: its --reps/--warmup/--flush-bytes and the wall-clock limit per run."""

    reps: int = 100
    warmup: int = 10
    timeout_s: float = 120.0
    flush_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError(f"reps={self.reps}: expected an integer >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: expected an integer >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: expected seconds > 0")
        if self.flush_bytes is not None and self.flush_bytes < 0:
            raise ValueError(f"flush_bytes={self.flush_bytes}: expected bytes >= 0")

    def arguments(self) -> list[str]:
        args = ["--reps", str(self.reps), "--warmup", str(self.warmup)]
        return args + (["--flush-bytes", str(self.flush_bytes)] if self.flush_bytes is not None else [])


@dataclass(frozen=True)
class _Outcome:
    """One artifact's verdict, the wall time of its process, and what goes into its log."""

    verdict: Verdict
    total_s: float
    log: str


def run_bundle(bundle_dir: Path, *, reps: int = 100, warmup: int = 10, timeout_s: float = 120.0,
               flush_bytes: int | None = None, output: Path | None = None, plot: Path | None = None,
               only: Sequence[str] | None = None, progress: bool = True) -> list[StatRow]:
    """Run the bundle's artifacts (manifest order; `only` restricts to those ids) and return one row each.

    The rows are appended to `output` (default `<bundle>/perf_stats.csv`) and plotted to `plot` (default
    `<bundle>/perf_stats.svg`). A failing artifact is a row with valid False and its reason, never an
    exception; ManifestError / ValueError are for a bad bundle or arguments. On Ctrl-C the rows finished so
    far are still written before the interrupt goes on.
    """
    bundle = Path(bundle_dir).absolute()
    settings = RunSettings(reps=reps, warmup=warmup, timeout_s=timeout_s, flush_bytes=flush_bytes)
    manifest = load_manifest(bundle)
    selected = _select(manifest, only, bundle / MANIFEST_NAME)
    output = Path(output) if output is not None else bundle / "perf_stats.csv"
    plot = Path(plot) if plot is not None else bundle / "perf_stats.svg"
    check_extendable(output)
    title = (f"{bundle.name}: {', '.join(dict.fromkeys(a.kernel for a in selected))} on {manifest.target or '?'}, "
             f"{reps} reps")
    rows: list[StatRow] = []
    bar = tqdm(selected, disable=not progress, unit="config", desc="aot run", dynamic_ncols=True)
    try:
        for artifact in bar:
            rows.append(run_artifact(bundle, manifest, artifact, settings))
            bar.set_postfix_str(f"{sum(r.valid for r in rows)}/{len(rows)} valid")
    except KeyboardInterrupt:
        if rows:
            _write_outputs(rows, output, plot, title + " (interrupted)")
        raise
    finally:
        bar.close()
    _write_outputs(rows, output, plot, title)
    return rows


def run_artifact(bundle: Path, manifest: Manifest, artifact: ArtifactEntry, settings: RunSettings) -> StatRow:
    """Run (or refuse to run) one artifact, write `<bundle>/logs/<id>.log`, and return its row."""
    timestamp = utc_now()
    outcome = _run(bundle, manifest, artifact, settings)
    v = outcome.verdict
    _write_log(bundle / "logs" / f"{artifact.id}.log",
               f"artifact: {artifact.id}\ntimestamp: {timestamp}\nvalid: {v.valid}\nreason: {v.reason}\n"
               f"total_s: {outcome.total_s:.3f}\n{outcome.log}")
    return StatRow(timestamp=timestamp, artifact=artifact.id, kernel=artifact.kernel, params=dict(artifact.params),
                   valid=v.valid, reason=v.reason, median_us=v.median_us, min_us=v.min_us, max_us=v.max_us,
                   reps=v.reps, total_s=outcome.total_s)


def summary_lines(rows: Sequence[StatRow]) -> list[str]:
    """A few lines for the terminal: how many are valid, the fastest per kernel, each failure and why."""
    valid = [r for r in rows if r.valid]
    lines = [f"{len(valid)}/{len(rows)} configs valid"]
    for kernel in dict.fromkeys(r.kernel for r in valid):
        best = min((r for r in valid if r.kernel == kernel), key=lambda r: r.median_us)
        lines.append(f"fastest {kernel}: {best.artifact} {best.median_us:.2f} us "
                     f"(min {best.min_us:.2f}, max {best.max_us:.2f})")
    failed = [r for r in rows if not r.valid]
    if failed:
        lines.append(f"not valid ({len(failed)}):")
        lines.extend(f"  {r.artifact}: {r.reason}" for r in failed)
    return lines


def _select(manifest: Manifest, only: Sequence[str] | None, source: Path) -> list[ArtifactEntry]:
    if only is None:
        return list(manifest.artifacts)
    wanted = set(only)
    unknown = [i for i in dict.fromkeys(only) if i not in {a.id for a in manifest.artifacts}]
    if unknown:
        raise ValueError(f"{source}: unknown artifact id(s): {', '.join(unknown)}")
    return [a for a in manifest.artifacts if a.id in wanted]


def _run(bundle: Path, manifest: Manifest, artifact: ArtifactEntry, settings: RunSettings) -> _Outcome:
    if artifact.status != "ok":
        return _Outcome(not_built(artifact.error, artifact.status), 0.0,
                        f"--- {artifact.status} ---\n{artifact.error}\n")
    rel = artifact.files.get("binary") or f"bin/{artifact.id}"
    binary = bundle / rel
    refusal = _refusal(binary, rel, bundle)
    if refusal:
        return _Outcome(not_run(refusal), 0.0, "")
    spec = bundle / manifest.kernels[artifact.kernel].spec
    command = [str(binary), "--bundle", str(bundle), "--spec", str(spec), *settings.arguments()]
    start = time.perf_counter()
    try:
        code, stdout, stderr, timed_out = _execute(command, bundle, settings.timeout_s)
    except OSError as err:  # e.g. exec format error: a binary built for another machine
        return _Outcome(not_run(f"cannot run {rel}: {err.strerror or err}"), time.perf_counter() - start, "")
    total_s = time.perf_counter() - start
    verdict = judge(artifact.id, code, stdout, stderr, timed_out, timeout_s=settings.timeout_s)
    log = (f"command: {' '.join(command)}\nexit: {code}\ntimed_out: {timed_out}\n"
           f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}\n")
    return _Outcome(verdict, total_s, log)


def _refusal(binary: Path, rel: str, bundle: Path) -> str:
    """Why `binary` cannot be run, or "" when it can."""
    if not binary.exists():
        return f"missing binary {rel} (build with `make -C {bundle}`)"
    if not binary.is_file():
        return f"binary {rel} is not a file"
    if not os.access(binary, os.X_OK):
        return f"binary {rel} is not executable (rebuild with `make -C {bundle}` or chmod +x it)"
    return ""


def _execute(command: list[str], cwd: Path, timeout_s: float) -> tuple[int | None, str, str, bool]:
    """(returncode, stdout, stderr, timed_out). The child leads its own process group, so a timeout or Ctrl-C
    kills it with everything it started (a forked helper would otherwise hold the pipes open)."""
    proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=_DRAIN_S)
        except subprocess.TimeoutExpired as exc:
            out, err = exc.output or b"", exc.stderr or b""
            proc.wait()
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return proc.returncode, _decode(out), _decode(err), timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _decode(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def _write_log(path: Path, text: str) -> None:
    """Replace the log whole (temp file + rename). No lock file: one runner owns a bundle's logs, and a lock
    per log would double the files in logs/."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_outputs(rows: Sequence[StatRow], output: Path, plot: Path, title: str) -> None:
    write_perf_stats(output, rows)
    write_time_plot(plot, rows, title)
