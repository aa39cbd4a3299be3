"""perf_stats.csv -> the tuned-config files the runtime reads: the fused-MoE CSV (aiter columns), the GEMM JSON
with M buckets, a user kernel's results store. Only valid rows count, and per artifact only its latest run.

The target's identity (device name, SM count) comes from `device.json`, which `tritune aot run` writes beside
the statistics, or from the caller; nothing is guessed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tritune.aot.manifest import Manifest, load_manifest
from tritune.aot.stats import StatRow, latest_rows, read_perf_stats

DEVICE_FILE = "device.json"


@dataclass(frozen=True)
class TargetDevice:
    name: str
    sm_count: int

    @property
    def slug(self) -> str:
        from tritune.store.gemm_json import slug_of

        return slug_of(self.name)


def read_device(bundle: Path, name: str | None = None, sm_count: int | None = None) -> TargetDevice:
    """The device the statistics were measured on: `name`/`sm_count` when given, else BUNDLE/device.json."""
    path = Path(bundle) / DEVICE_FILE
    if name and sm_count:
        return TargetDevice(name, int(sm_count))
    if not path.is_file():
        raise ValueError(f"{path} is missing (`tritune aot run` writes it on the target): pass --device-name "
                         "and --cu-num")
    try:
        doc = json.loads(path.read_text())
        return TargetDevice(name or str(doc["name"]), int(sm_count or doc["sm_count"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: expected {{\"name\": ..., \"sm_count\": ...}} ({err})") from None


def winners(rows: Sequence[StatRow]) -> dict[str, list[StatRow]]:
    """Per kernel, its valid latest rows fastest first."""
    out: dict[str, list[StatRow]] = defaultdict(list)
    for row in latest_rows(rows):
        if row.valid and math.isfinite(row.median_us):
            out[row.kernel].append(row)
    return {k: sorted(v, key=lambda r: (r.median_us, r.artifact)) for k, v in out.items()}


DEFAULT_OUT = Path("tritune_tuned")


def import_bundle(bundle: Path, out_dir: Path | None = None, *, stats: Path | None = None,
                  device_name: str | None = None, cu_num: int | None = None) -> list[str]:
    """Write the winners of `bundle`'s statistics into `out_dir` (default ./tritune_tuned; fused MoE:
    tuned_fmoe.csv, GEMM: the JSON files), and user kernels into their own store (or `out_dir`/user_kernels when
    `out_dir` is given). Returns one line per kernel saying what went where."""
    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    stats = Path(stats) if stats else bundle / "perf_stats.csv"
    if not stats.is_file():
        raise ValueError(f"{stats} is missing: run `tritune aot run {bundle}` on the target first")
    best = winners(read_perf_stats(stats))
    device = read_device(bundle, device_name, cu_num)
    lines = []
    kinds = {k.store.get("kind", "") for k in manifest.kernels.values()}
    if "fmoe" in kinds:
        lines += _import_fmoe(manifest, best, device, Path(out_dir or DEFAULT_OUT))
    for name, kernel in manifest.kernels.items():
        if kernel.store.get("kind") == "gemm":
            lines += _import_gemm(manifest, name, best.get(name, []), device, Path(out_dir or DEFAULT_OUT))
        elif kernel.store.get("kind") == "user":
            lines += _import_user(manifest, name, best.get(name, []), device, out_dir)
    if not lines:
        raise ValueError(f"{bundle}: no kernel with a valid result to import")
    return lines


def _import_fmoe(manifest: Manifest, best: dict[str, list[StatRow]], device: TargetDevice,
                 out_dir: Path) -> list[str]:
    """Stage 1 and stage 2 share the sort, so their BLOCK_SIZE_M must agree: the pair with the least summed
    time over the BLOCK_SIZE_M both stages have wins."""
    from tritune.store.atomic import path_lock
    from tritune.store.fmoe_csv import merge_tuned, read_tuned, write_tuned
    from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
    from tritune.tuners.fused_moe_tunable import FusedMoeTunable, MoeProblem

    stages = {k.store.get("stage"): (name, k) for name, k in manifest.kernels.items() if k.store.get("kind") == "fmoe"}
    if set(stages) != {"stage1", "stage2"}:
        raise ValueError(f"fused-MoE import needs stage1 and stage2 results; the bundle has {sorted(stages)}")
    shape = FmoeShape(**stages["stage1"][1].store["shape"])
    per_bm: dict[str, dict[int, StatRow]] = {}
    for stage, (name, _) in stages.items():
        per_bm[stage] = {}
        for row in best.get(name, []):
            per_bm[stage].setdefault(int(row.params["BLOCK_SIZE_M"]), row)  # rows come fastest first
    common = sorted(set(per_bm["stage1"]) & set(per_bm["stage2"]))
    if not common:
        raise ValueError("fused-MoE import: no BLOCK_SIZE_M has a valid stage-1 and a valid stage-2 artifact")
    bm = min(common, key=lambda b: per_bm["stage1"][b].median_us + per_bm["stage2"][b].median_us)
    r1, r2 = per_bm["stage1"][bm], per_bm["stage2"][bm]
    tunable = FusedMoeTunable()
    whole = MoeProblem(shape, "e2e")
    us = r1.median_us + r2.median_us
    row = FmoeTuned(cu_num=device.sm_count, shape=shape, block_m=bm, ksplit=0, us1=r1.median_us,
                    kernelName1=r1.artifact, err1=0.0, us2=r2.median_us, kernelName2=r2.artifact, err2=0.0, us=us,
                    run_1stage=False, tflops=tunable.flops(whole) / (us * 1e-6) / 1e12,
                    bw=tunable.bytes_moved(whole) / (us * 1e-6) / 1e9,
                    extra=(("source", "aot"), ("device", device.name), ("triton", manifest.triton)))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tuned_fmoe.csv"
    with path_lock(path):
        existing = read_tuned(path) if path.exists() else []
        write_tuned(path, merge_tuned(existing, [row]))
    return [f"fused MoE {shape.key()}: block_m {bm}, {r1.artifact} ({r1.median_us:.1f} us) + {r2.artifact} "
            f"({r2.median_us:.1f} us) -> {path}"]


def _import_gemm(manifest: Manifest, name: str, rows: list[StatRow], device: TargetDevice,
                 out_dir: Path) -> list[str]:
    from tritune.aot.gemm import gemm_config_of
    from tritune.store.gemm_json import GemmEntry, write_default_file, write_shape_file
    from tritune.tuning.types import Config

    if not rows:
        return [f"{name}: no valid artifact, nothing imported"]
    store = manifest.kernels[name].store
    top = rows[0]
    seconds = top.median_us * 1e-6
    entry = GemmEntry(M=int(store["M"]), config=Config.from_dict(gemm_config_of(top.params)), time_us=top.median_us,
                      tflops=store["flops"] / seconds / 1e12, gbps=store["bytes"] / seconds / 1e9, error=0.0)
    provenance = {"name": device.name, "sm_count": device.sm_count, "triton_version": manifest.triton,
                  "source": "aot", "target": manifest.target}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_shape_file(out_dir, provenance, store["tag"], int(store["N"]), int(store["K"]),
                            {entry.M: entry}, device_slug=device.slug)
    default = write_default_file(out_dir, provenance, store["tag"], device_slug=device.slug)
    return [f"{name} M={entry.M}: {top.artifact} ({top.median_us:.1f} us) -> {path} and {default}"]


def _import_user(manifest: Manifest, name: str, rows: list[StatRow], device: TargetDevice,
                 out_dir: Path | None) -> list[str]:
    from tritune.store.user_json import UserEntry, UserKernelStore, now_iso

    if not rows:
        return [f"{name}: no valid artifact, nothing imported"]
    store = manifest.kernels[name].store
    top = rows[0]
    path = Path(store["path"]) if out_dir is None else Path(out_dir) / "user_kernels" / f"{store['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    UserKernelStore(path).put([UserEntry(
        device=device.name, triton=manifest.triton, key=dict(store.get("key", {})), key_text=store["key_text"],
        config=dict(top.params), time_us=top.median_us, tuned_at=now_iso(), source="aot",
        provenance={"artifact": top.artifact, "target": manifest.target, "sm_count": device.sm_count})])
    return [f"{name} [{store['key_text']}]: {top.artifact} ({top.median_us:.1f} us) -> {path}"]
