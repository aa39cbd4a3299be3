"""aot.importer: hand-made bundles (manifest, perf_stats.csv, device.json; nothing compiled) imported into the
files the runtime reads: the fused-MoE CSV (one BLOCK_SIZE_M for both stages), the GEMM JSON, a user kernel store.
Only valid rows count, and per artifact only its latest run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tritune.aot import gemm as aot_gemm
from tritune.aot import moe as aot_moe
from tritune.aot.importer import import_bundle
from tritune.aot.manifest import ArtifactEntry, KernelEntry, Manifest, write_manifest
from tritune.aot.stats import StatRow, write_perf_stats
from tritune.store.fmoe_csv import read_tuned, write_tuned
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.fmoe_table import reload_fmoe_configs
from tritune.store.gemm_json import GemmConfigStore, default_file_name, shape_file_name, slug_of
from tritune.store.user_json import UserKernelStore
from tritune.tuners.fused_moe_tunable import FusedMoeTunable, MoeProblem
from tritune.tuning.types import Config

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": "9.0"}
SLUG = slug_of(DEVICE["name"])
TRITON = "3.9.0"
OLD, NEW = "2026-11-21T10:00:00.000000Z", "2026-11-21T11:00:00.000000Z"
SHAPE = FmoeShape(token=1024, model_dim=4096, inter_dim=1792, expert=8, topk=2, act_type="silu", dtype="bf16",
                  q_dtype_a="bf16", q_dtype_w="bf16", q_type="none", use_g1u1=True, doweight_stage1=False)


def make_bundle(root: Path, stores: dict[str, dict], artifacts: list[tuple[str, str, dict]],
                rows: list[list[StatRow]] | None = None, device: dict | None = DEVICE) -> Path:
    """A bundle folder with `stores` (kernel -> store), artifacts (id, kernel, params), perf_stats.csv written by
    one write_perf_stats call per list in `rows` (none when None), and device.json unless `device` is None."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(created="2026-11-21T09:00:00Z", target="cuda:90", triton=TRITON, torch="2.13.0",
                        tritune="0.1.0", build_host="test",
                        kernels={name: KernelEntry(name, f"specs/{name}.spec", store=store)
                                 for name, store in stores.items()},
                        artifacts=[ArtifactEntry(id=ident, kernel=kernel, params=params, target="cuda:90",
                                                 triton=TRITON) for ident, kernel, params in artifacts])
    write_manifest(root, manifest)
    for batch in rows or []:
        write_perf_stats(root / "perf_stats.csv", batch)
    if device is not None:
        (root / "device.json").write_text(json.dumps(device))
    return root


def row(artifact: str, kernel: str, params: dict, median_us: float, *, valid: bool = True, when: str = NEW) -> StatRow:
    return StatRow(timestamp=when, artifact=artifact, kernel=kernel, params=params, valid=valid,
                   reason="" if valid else "wrong output: 12.5% mismatched", median_us=median_us,
                   min_us=median_us * 0.9, max_us=median_us * 1.1, reps=100, total_s=0.5)


# ------------------------------------------------------------------------------------------------- fused MoE

def moe_params(bm: int, warps: int = 4) -> dict:
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8, "num_warps": warps,
            "num_stages": 3, "KSPLIT": 1, "USE_TMA": 0}


def moe_id(stage: str, bm: int, warps: int = 4) -> str:
    return aot_moe.artifact_id(stage, moe_params(bm, warps))


def moe_stores(stages=("stage1", "stage2")) -> dict[str, dict]:
    return {f"moe_{s}": {"kind": "fmoe", "stage": s, "shape": asdict(SHAPE)} for s in stages}


# (stage, BLOCK_SIZE_M, num_warps, median_us, valid, timestamp). Stage 1 alone is fastest at BM128 and stage 2
# alone at BM64, but BM128 has no valid stage 2 and BM64 sums 25 + 9 = 34: BM32 (14 + 15 = 29) must win.
MOE_RUNS = [
    ("stage1", 16, 4, 10.0, True, NEW),
    ("stage1", 32, 4, 14.0, True, NEW),
    ("stage1", 32, 8, 16.0, True, NEW),  # a slower config of the same BM: not the one paired
    ("stage1", 64, 4, 25.0, True, NEW),
    ("stage1", 64, 8, 0.2, False, NEW),  # fast but wrong: ignored
    ("stage1", 128, 4, 1.0, True, NEW),  # no valid stage-2 partner
    ("stage2", 16, 4, 30.0, True, NEW),
    ("stage2", 32, 4, 15.0, True, NEW),
    ("stage2", 64, 4, 9.0, True, NEW),
    ("stage2", 128, 4, 0.4, False, NEW),  # wrong in the latest run ...
]
MOE_OLD_RUNS = [
    ("stage2", 16, 4, 1.0, True, OLD),  # ... older runs, written after the new ones: superseded by timestamp
    ("stage2", 128, 4, 0.5, True, OLD),
]


def moe_rows(runs) -> list[StatRow]:
    return [row(moe_id(s, bm, w), f"moe_{s}", moe_params(bm, w), us, valid=ok, when=when)
            for s, bm, w, us, ok, when in runs]


def moe_bundle(root: Path, runs=MOE_RUNS, old_runs=MOE_OLD_RUNS, stages=("stage1", "stage2"), **kw) -> Path:
    arts = list({moe_id(s, bm, w): (moe_id(s, bm, w), f"moe_{s}", moe_params(bm, w))
                 for s, bm, w, *_ in [*runs, *old_runs] if s in stages}.values())
    batches = [moe_rows([r for r in runs if r[0] in stages]), moe_rows([r for r in old_runs if r[0] in stages])]
    return make_bundle(root, moe_stores(stages), arts, [b for b in batches if b], **kw)


@pytest.fixture
def fmoe_env(monkeypatch):
    """TRITUNE_CONFIG_FMOE for the test, and the process-wide table forgotten before and after."""
    reload_fmoe_configs()
    yield monkeypatch
    monkeypatch.undo()
    reload_fmoe_configs()


def test_fmoe_pairs_the_block_size_m_with_the_least_summed_time(tmp_path, fmoe_env):
    from tritune.store.fmoe_table import default_table

    bundle = moe_bundle(tmp_path / "bundle")
    out = tmp_path / "tuned"
    lines = import_bundle(bundle, out)
    csv_path = out / "tuned_fmoe.csv"
    assert lines == [f"fused MoE {SHAPE.key()}: block_m 32, {moe_id('stage1', 32)} (14.0 us) + "
                     f"{moe_id('stage2', 32)} (15.0 us) -> {csv_path}"]
    [tuned] = read_tuned(csv_path)
    assert (tuned.cu_num, tuned.shape, tuned.block_m, tuned.ksplit, tuned.run_1stage) == (132, SHAPE, 32, 0, False)
    assert (tuned.kernelName1, tuned.us1, tuned.err1) == (moe_id("stage1", 32), 14.0, 0.0)
    assert (tuned.kernelName2, tuned.us2, tuned.err2) == (moe_id("stage2", 32), 15.0, 0.0)
    assert tuned.us == 29.0
    whole = MoeProblem(SHAPE, "e2e")
    assert tuned.tflops == pytest.approx(FusedMoeTunable().flops(whole) / 29e-6 / 1e12, abs=0.006)
    assert tuned.bw == pytest.approx(FusedMoeTunable().bytes_moved(whole) / 29e-6 / 1e9, abs=0.006)
    assert dict(tuned.extra) == {"source": "aot", "device": DEVICE["name"], "triton": TRITON}

    fmoe_env.setenv("TRITUNE_CONFIG_FMOE", str(csv_path))
    reload_fmoe_configs()
    hit = default_table().lookup(132, SHAPE, 1000)  # 1000 tokens fall in the 1024 bucket
    assert (hit.kernelName1, hit.kernelName2, hit.block_m) == (moe_id("stage1", 32), moe_id("stage2", 32), 32)
    assert default_table().lookup(108, SHAPE, 1024) is None  # measured on a 132-SM part only


def test_fmoe_merge_keeps_other_rows_and_replaces_the_same_key(tmp_path):
    out = tmp_path / "tuned"
    out.mkdir()

    def tuned(cu_num: int, token: int, name: str) -> FmoeTuned:
        return FmoeTuned(cu_num=cu_num, shape=SHAPE.with_token(token), block_m=64, ksplit=0, us1=50.0,
                         kernelName1=f"{name}_1", err1=0.0, us2=40.0, kernelName2=f"{name}_2", err2=0.0, us=90.0,
                         run_1stage=False, tflops=1.0, bw=2.0, extra=(("source", "jit"),))

    other_token, same_key, other_gpu = tuned(132, 64, "small"), tuned(132, 1024, "stale"), tuned(108, 1024, "a100")
    write_tuned(out / "tuned_fmoe.csv", [other_token, same_key, other_gpu])
    import_bundle(moe_bundle(tmp_path / "bundle"), out)
    rows = read_tuned(out / "tuned_fmoe.csv")
    assert [r.kernelName1 for r in rows] == ["small_1", moe_id("stage1", 32), "a100_1"]  # replaced in place
    assert rows[0] == other_token and rows[2] == other_gpu


def test_fmoe_device_from_flags_when_device_json_is_missing(tmp_path):
    bundle = moe_bundle(tmp_path / "bundle", device=None)
    import_bundle(bundle, tmp_path / "tuned", device_name="NVIDIA A100-SXM4-80GB", cu_num=108)
    [tuned] = read_tuned(tmp_path / "tuned" / "tuned_fmoe.csv")
    assert tuned.cu_num == 108
    assert dict(tuned.extra)["device"] == "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize(("case", "message"), [
    ("only_stage1", r"fused-MoE import needs stage1 and stage2 results; the bundle has \['stage1'\]"),
    ("no_common_bm", "no BLOCK_SIZE_M has a valid stage-1 and a valid stage-2 artifact"),
    ("no_stats", r"perf_stats\.csv is missing: run `tritune aot run .*bundle` on the target first"),
    ("no_device", r"device\.json is missing \(`tritune aot run` writes it on the target\): pass --device-name and "
                  "--cu-num"),
])
def test_fmoe_import_errors(tmp_path, case, message):
    root = tmp_path / "bundle"
    if case == "only_stage1":
        bundle = moe_bundle(root, stages=("stage1",))
    elif case == "no_common_bm":  # stage 1 valid at BM16 only, stage 2 at BM64 only
        bundle = moe_bundle(root, runs=[("stage1", 16, 4, 10.0, True, NEW), ("stage1", 64, 4, 9.0, False, NEW),
                                        ("stage2", 64, 4, 9.0, True, NEW), ("stage2", 16, 4, 9.0, False, NEW)],
                            old_runs=[])
    elif case == "no_stats":
        bundle = moe_bundle(root)
        (bundle / "perf_stats.csv").unlink()
    else:
        bundle = moe_bundle(root, device=None)
    with pytest.raises(ValueError, match=message):
        import_bundle(bundle, tmp_path / "tuned", cu_num=132 if case == "no_device" else None)
    assert not (tmp_path / "tuned" / "tuned_fmoe.csv").exists()


# ------------------------------------------------------------------------------------------------------ GEMM

GEMM_STORE = {"kind": "gemm", "tag": "BF16", "M": 256, "N": 512, "K": 1024, "flops": 2.0 * 256 * 512 * 1024,
              "bytes": 2.0 * (256 * 1024 + 512 * 1024 + 256 * 512)}


def gemm_params(bm: int, cache_modifier: str) -> dict:
    return aot_gemm.aot_params({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                                "num_warps": 4, "num_stages": 3, "cache_modifier": cache_modifier})


def test_gemm_writes_shape_and_default_files_the_store_reads(tmp_path):
    winner, slower, wrong = gemm_params(64, ".cg"), gemm_params(128, ""), gemm_params(32, "")
    assert winner["CACHE_CG"] == 1 and slower["CACHE_CG"] == 0
    runs = [(winner, 20.0, True), (slower, 25.0, True), (wrong, 5.0, False)]
    bundle = make_bundle(tmp_path / "bundle", {"gemm_bf16": GEMM_STORE},
                         [(aot_gemm.artifact_id(p), "gemm_bf16", p) for p, _, _ in runs],
                         [[row(aot_gemm.artifact_id(p), "gemm_bf16", p, us, valid=ok) for p, us, ok in runs]])
    out = tmp_path / "tuned"
    shape_file, default_file = out / shape_file_name(SLUG, "BF16", 512, 1024), out / default_file_name(SLUG, "BF16")
    [line] = import_bundle(bundle, out)
    assert line == (f"gemm_bf16 M=256: {aot_gemm.artifact_id(winner)} (20.0 us) -> {shape_file} and {default_file}")

    expected = Config.from_dict(aot_gemm.gemm_config_of(winner))
    assert expected["cache_modifier"] == ".cg"
    store = GemmConfigStore([out])
    config, where = store.lookup(SLUG, "BF16", 256, 512, 1024)
    assert (config, where) == (expected, f"shape file {shape_file} M=256")
    config, where = store.lookup(SLUG, "BF16", 256, 4096, 4096)  # another shape: the voted device default
    assert config == expected and where.startswith(f"device default {default_file}")

    doc = json.loads(shape_file.read_text())["tritune"]
    assert doc["provenance"] == {"name": DEVICE["name"], "sm_count": 132, "triton_version": TRITON, "source": "aot",
                                 "target": "cuda:90"}
    entry = doc["by_M"]["256"]
    assert entry["time_us"] == 20.0
    assert entry["tflops"] == pytest.approx(GEMM_STORE["flops"] / 20e-6 / 1e12)
    assert entry["gbps"] == pytest.approx(GEMM_STORE["bytes"] / 20e-6 / 1e9)


# ----------------------------------------------------------------------------------------------- user kernel

USER_PARAMS = [{"BLOCK": 256, "num_warps": 4, "num_stages": 2}, {"BLOCK": 1024, "num_warps": 8, "num_stages": 2},
               {"BLOCK": 64, "num_warps": 2, "num_stages": 2}]


def user_bundle(root: Path, store_path: Path) -> Path:
    store = {"kind": "user", "path": str(store_path), "name": "axpy", "key_text": "N=4096,x=fp32",
             "key": {"N": 4096, "x": "fp32"}}
    ids = [f"axpy_B{p['BLOCK']}_W{p['num_warps']}" for p in USER_PARAMS]
    times = [(12.5, True), (8.5, True), (3.0, False)]  # BLOCK=1024 wins; BLOCK=64 is wrong
    return make_bundle(root, {"axpy": store}, [(i, "axpy", p) for i, p in zip(ids, USER_PARAMS, strict=True)],
                       [[row(i, "axpy", p, us, valid=ok) for i, p, (us, ok) in zip(ids, USER_PARAMS, times,
                                                                                  strict=True)]])


def check_user_entry(path: Path) -> None:
    entry = UserKernelStore(path).lookup(DEVICE["name"], "N=4096,x=fp32")
    assert entry is not None
    assert (entry.source, entry.config, entry.time_us, entry.triton) == ("aot", USER_PARAMS[1], 8.5, TRITON)
    assert entry.key == {"N": 4096, "x": "fp32"}
    assert entry.provenance == {"artifact": "axpy_B1024_W8", "target": "cuda:90", "sm_count": 132}
    assert UserKernelStore(path).lookup("NVIDIA A100-SXM4-80GB", "N=4096,x=fp32") is None


def test_user_kernel_goes_to_its_own_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working folder
    store_path = tmp_path / "home" / "axpy.json"
    [line] = import_bundle(user_bundle(tmp_path / "bundle", store_path))
    assert line == f"axpy [N=4096,x=fp32]: axpy_B1024_W8 (8.5 us) -> {store_path}"
    check_user_entry(store_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "home"]


def test_user_kernel_with_out_dir(tmp_path):
    store_path = tmp_path / "home" / "axpy.json"
    out = tmp_path / "out"
    import_bundle(user_bundle(tmp_path / "bundle", store_path), out)
    check_user_entry(out / "user_kernels" / "axpy.json")
    assert not store_path.exists()
