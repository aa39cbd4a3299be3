"""Assemble a bundle (docs/AOT.md): specs, data (written by the plans), one artifact per config compiled on
every core for the target, the generic main's sources, one executable per artifact, a Makefile, the manifest.

The bundle is built in a sibling temporary folder and renamed into place at the end, so an interrupted or
failed build leaves nothing half-written, and an existing folder is only replaced when asked to.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import multiprocessing
import os
import platform
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritune.aot.compiler import (
    AotTarget,
    CompiledArtifact,
    CompileJob,
    KernelArg,
    compile_artifact,
    init_worker,
    int_kind,
    kernel_args,
)
from tritune.aot.manifest import ArtifactEntry, KernelEntry, Manifest, write_manifest
from tritune.aot.plan import TRITON_DTYPE, KernelPlan, spec_path
from tritune.aot.spec import resolve
from tritune.aot.tdat import read_header
from tritune.aot.toolchain import (
    MAIN_SOURCES,
    ToolchainError,
    compile_executable,
    compile_object,
    cuda_include_dir,
    find_cc,
)

CSRC = Path(__file__).parent / "csrc"


@dataclass
class BuildReport:
    bundle: Path
    manifest: Manifest
    compiled: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # artifact id -> why
    binaries: int = 0
    binary_note: str = ""  # why there are no executables, when there are none
    compile_wall_s: float = 0.0
    compile_cpu_s: float = 0.0
    link_wall_s: float = 0.0

    def lines(self) -> list[str]:
        total = len(self.manifest.artifacts)
        speed = self.compile_cpu_s / self.compile_wall_s if self.compile_wall_s else float("nan")
        out = [f"bundle {self.bundle}: {self.compiled}/{total} artifacts compiled for {self.manifest.target} "
               f"in {self.compile_wall_s:.1f} s ({speed:.1f}x over one process), {self.binaries} executables "
               f"linked in {self.link_wall_s:.1f} s"]
        out += [f"  not built: {aid}: {why}" for aid, why in self.failed.items()]
        if self.binary_note:
            out.append(f"  {self.binary_note}")
        return out


def _runtime_args(plan: KernelPlan, bundle: Path, params: dict[str, int]) -> dict[str, KernelArg]:
    """The spec's arguments as the artifact is specialized: element types from the data files, integers from the
    values this data set passes (resolved exactly as the main will)."""
    resolved = resolve(plan.spec, params, bundle)
    out = {}
    for a in plan.spec.args:
        keep = a.name not in plan.do_not_specialize
        if a.role in ("in", "out"):
            dtype = TRITON_DTYPE[read_header(resolved.files[a.name]).dtype]
            out[a.name] = KernelArg(a.name, "ptr", dtype=dtype)
        elif a.role == "scratch":
            if a.name not in plan.pointer_dtypes:
                raise ValueError(f"{plan.name}: scratch pointer {a.name!r} has no element type in the plan")
            out[a.name] = KernelArg(a.name, "ptr", dtype=plan.pointer_dtypes[a.name])
        elif a.role in ("i32", "i64"):
            value = resolved.int_args[a.name]
            kind = "i64" if a.role == "i64" else int_kind(value)
            if kind != a.role:
                raise ValueError(f"{plan.name}: argument {a.name}={value} does not fit {a.role}")
            out[a.name] = KernelArg(a.name, kind, value, specialize=keep)
        else:
            out[a.name] = KernelArg(a.name, "fp32", resolved.float_args[a.name], specialize=False)
    return out


def _jobs(plans: Sequence[KernelPlan], bundle: Path, target: AotTarget) -> list[CompileJob]:
    jobs = []
    entries = bundle / "artifacts" / "_entries"
    entries.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        plan.check_ids()
        entry = entries / f"{plan.name}.py"
        entry.write_text(plan.entry_source)
        for params in plan.configs:
            ids = plan.artifact_id(params)
            args = kernel_args(plan.param_names, plan.constexprs(params), _runtime_args(plan, bundle, params))
            jobs.append(CompileJob(ids, plan.name, str(entry), plan.function, args,
                                   tuple((k, int(v)) for k, v in params.items()), target,
                                   str(bundle / "artifacts" / ids)))
    return jobs


def compile_all(jobs: Sequence[CompileJob], workers: int | None = None,
                progress: Callable[[CompiledArtifact], None] | None = None) -> dict[str, CompiledArtifact]:
    """Compile every job in spawned worker processes (Triton's interpreter off there); a worker that dies takes
    only its job with it: the pool is rebuilt and the rest go on. Returns id -> result."""
    results: dict[str, CompiledArtifact] = {}
    pending = list(jobs)
    strikes: dict[str, int] = {}
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
    while pending:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker) as pool:
            futures = {pool.submit(compile_artifact, job): job for job in pending}
            pending = []
            for fut in cf.as_completed(futures):
                job = futures[fut]
                try:
                    result = fut.result()
                except Exception as exc:  # BrokenProcessPool: retry each once in a fresh pool, then give up
                    strikes[job.artifact_id] = strikes.get(job.artifact_id, 0) + 1
                    if strikes[job.artifact_id] < 2:
                        pending.append(job)
                        continue
                    result = CompiledArtifact(job.artifact_id, "crashed", f"compile worker died: {exc}")
                results[job.artifact_id] = result
                if progress:
                    progress(result)
    return results


def _copy_sources(bundle: Path) -> None:
    src = bundle / "src"
    src.mkdir(parents=True, exist_ok=True)
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            shutil.copy2(path, src / path.name)
    shutil.copy2(cuda_include_dir() / "cuda.h", src / "cuda.h")


def _binary_sources(bundle: Path, art: CompiledArtifact) -> list[Path]:
    return [bundle / "src" / s for s in MAIN_SOURCES] + [Path(art.files["c"]), Path(art.files["glue"])]


def _makefile(bundle: Path, arts: Sequence[CompiledArtifact]) -> str:
    """`make` rebuilds every executable from the bundle alone (cc and the bundled cuda.h; no CUDA toolkit)."""
    rel = [(a.artifact_id, [os.path.relpath(p, bundle) for p in _binary_sources(bundle, a)]) for a in arts]
    lines = ["# Generated by tritune aot build: one executable per artifact, no CUDA toolkit needed.",
             "CC ?= cc", "CFLAGS ?= -O2 -std=gnu11", "",
             "all: " + " ".join(f"bin/{aid}" for aid, _ in rel), ""]
    for aid, sources in rel:
        lines += [f"bin/{aid}: " + " ".join(sources),
                  "\t@mkdir -p bin",
                  f"\t$(CC) $(CFLAGS) -Isrc -Iartifacts/{aid} -include src/tritune_artifact.h -o $@ "
                  + " ".join(sources) + " -ldl -lm", ""]
    lines += [".PHONY: all", ""]
    return "\n".join(lines)


def _link(bundle: Path, arts: Sequence[CompiledArtifact], workers: int) -> tuple[dict[str, str], str]:
    """Link one executable per artifact with this machine's C compiler; returns (id -> binary or error, note)."""
    if find_cc() is None:
        return {}, "no C compiler here: executables not built (run `make -C BUNDLE` on a machine with cc)"
    (bundle / "bin").mkdir(exist_ok=True)
    objects = bundle / "bin" / ".obj"
    header = bundle / "src" / "tritune_artifact.h"
    with cf.ThreadPoolExecutor(max(1, workers)) as pool:  # the generic main: compiled once, linked into each
        done = list(pool.map(lambda s: compile_object(bundle / "src" / s, objects / f"{Path(s).stem}.o",
                                                      [bundle / "src"], header), MAIN_SOURCES))
    del done
    main_objects = [objects / f"{Path(s).stem}.o" for s in MAIN_SOURCES]

    def one(art: CompiledArtifact) -> tuple[str, str]:
        out = bundle / "bin" / art.artifact_id
        try:
            compile_executable(main_objects + [Path(art.files["c"]), Path(art.files["glue"])], out,
                               [bundle / "src", Path(art.files["c"]).parent], header)
        except ToolchainError as err:
            return art.artifact_id, f"error: {err}"
        return art.artifact_id, f"bin/{art.artifact_id}"

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        linked = dict(pool.map(one, arts))
    shutil.rmtree(objects, ignore_errors=True)
    return linked, ""


def _versions() -> dict[str, str]:
    import torch
    import triton

    try:
        from importlib.metadata import version

        tritune_version = version("tritune")
    except Exception:  # a source checkout on PYTHONPATH, not installed
        tritune_version = "source"
    return {"triton": triton.__version__, "torch": torch.__version__, "tritune": tritune_version}


def build_bundle(bundle: Path, target: AotTarget, make_plans: Callable[[Path], list[KernelPlan]], *,
                 workers: int | None = None, force: bool = False, link: bool = True,
                 progress: Callable[[CompiledArtifact], None] | None = None) -> BuildReport:
    """Build the bundle at `bundle`. `make_plans(staging_dir)` writes each kernel's data there and returns the
    plans. An existing non-empty `bundle` is an error unless `force`, and is replaced only after success."""
    bundle = Path(bundle)
    if bundle.exists() and (not bundle.is_dir() or any(bundle.iterdir())) and not force:
        raise FileExistsError(f"{bundle} exists and is not empty; choose a new folder or pass --force")
    staging = bundle.with_name(f".{bundle.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        report = _build_into(staging, target, make_plans, workers, link, progress)
        if bundle.exists():
            old = bundle.with_name(f".{bundle.name}.old-{os.getpid()}")
            bundle.rename(old)
            staging.rename(bundle)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(bundle)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.bundle = bundle
    return report


def _build_into(staging: Path, target: AotTarget, make_plans: Callable[[Path], list[KernelPlan]],
                workers: int | None, link: bool, progress) -> BuildReport:
    plans = make_plans(staging)
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise ValueError(f"kernels {names} are not distinct")
    (staging / "specs").mkdir(exist_ok=True)
    for plan in plans:
        spec_path(staging, plan.name).write_text(plan.spec.to_text())
    _copy_sources(staging)
    jobs = _jobs(plans, staging, target)
    t0 = time.perf_counter()
    results = compile_all(jobs, workers, progress)
    compile_wall = time.perf_counter() - t0
    ok = [results[j.artifact_id] for j in jobs if results[j.artifact_id].status == "ok"]
    t1 = time.perf_counter()
    binaries, note = _link(staging, ok, workers or os.cpu_count() or 1) if link else ({}, "executables not built")
    link_wall = time.perf_counter() - t1
    if ok:
        (staging / "Makefile").write_text(_makefile(staging, ok))
    versions = _versions()
    manifest = Manifest(
        created=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), target=target.text,
        build_host=f"{socket.gethostname()} ({platform.machine()}, {platform.system()})", **versions,
        kernels={p.name: KernelEntry(p.name, f"specs/{p.name}.spec", p.source, list(p.spec.grid), p.problem,
                                     p.store) for p in plans})
    report = BuildReport(staging, manifest, compile_wall_s=compile_wall, link_wall_s=link_wall,
                         binary_note=note)
    for job in jobs:
        res = results[job.artifact_id]
        files = {k: os.path.relpath(v, staging) for k, v in res.files.items()}
        status, error = res.status, res.error
        linked = binaries.get(job.artifact_id, "")
        if linked.startswith("bin/"):
            files["binary"] = linked
            report.binaries += 1
        elif linked:
            status, error = "compile_error", f"link {linked}"
        if status != "ok":
            report.failed[job.artifact_id] = f"{status}: {error}"
        else:
            report.compiled += 1
        report.compile_cpu_s += res.compile_s
        manifest.artifacts.append(ArtifactEntry(
            id=job.artifact_id, kernel=job.kernel, params=dict(job.params), status=status, error=error,
            symbol=res.symbol, signature=res.signature, shared_bytes=res.shared_bytes, files=files,
            target=target.text, triton=versions["triton"], compile_s=round(res.compile_s, 3)))
    write_manifest(staging, manifest)
    return report
