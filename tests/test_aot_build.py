"""`tritune aot build` on this GPU-less machine: bundles for cuda:90 (fused MoE, GEMM, a user kernel) compiled by
Triton's AOT compiler and linked by the machine's C compiler; every executable's dry run agrees with the Python
resolver; the MoE data round-trips and its sort equals moe_align_block_size for every BLOCK_SIZE_M; run here
without a GPU, nothing is ever reported valid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import triton

from tritune.aot.builder import build_bundle
from tritune.aot.cli import target_device
from tritune.aot.compiler import AotTarget
from tritune.aot.gemm import gemm_plans
from tritune.aot.manifest import load_manifest
from tritune.aot.moe import moe_plans, shape_tag, write_moe_data
from tritune.aot.plan import data_name
from tritune.aot.runner import run_bundle
from tritune.aot.spec import RunSpec, resolve
from tritune.aot.tdat import read_header, read_tensor
from tritune.aot.user import user_plans
from tritune.kernels.moe_align import moe_align_block_size
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe_tunable import FusedMoeTunable, MoeProblem
from tritune.tuners.gemm_tunable import GemmProblem

TARGET = AotTarget.parse("cuda:90")
DEVICE = target_device(TARGET)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flash_attention.py"
SHAPE = FmoeShape(token=24, model_dim=64, inter_dim=32, expert=4, topk=2, act_type="silu", dtype="fp16",
                  q_dtype_a="fp16", q_dtype_w="fp16", q_type="none", use_g1u1=True, doweight_stage1=False)
MOE_CONFIGS = {
    "stage1": [dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
               dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=2)],
    "stage2": [dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)],
}
GEMM = GemmProblem("bf16", 40, 128, 96, "fp16")
GEMM_CONFIG = [dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=2,
                    cache_modifier=".cg")]
FA_PROBLEM = {"Z": 1, "H": 2, "N_CTX": 40, "HEAD_DIM": 16, "CAUSAL": True, "dtype": "fp16"}
FA_CONFIG = [dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=16, num_warps=4, num_stages=2)]


def _plans(staging: Path) -> list:
    return (moe_plans(staging, SHAPE, DEVICE, configs=MOE_CONFIGS)
            + gemm_plans(staging, GEMM, DEVICE, configs=GEMM_CONFIG)
            + user_plans(staging, f"{EXAMPLE}:attention", FA_PROBLEM, configs=FA_CONFIG))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("aot") / "bundle"
    report = build_bundle(path, TARGET, _plans, workers=2)
    assert report.failed == {}, report.lines()
    return path


def _dry_run(bundle: Path, artifact) -> dict:
    manifest = load_manifest(bundle)
    spec = manifest.kernels[artifact.kernel].spec
    done = subprocess.run([str(bundle / artifact.files["binary"]), "--bundle", str(bundle), "--spec",
                           str(bundle / spec), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("TRITUNE_DRYRUN ")
    return json.loads(line[len("TRITUNE_DRYRUN "):])


def test_bundle_has_every_artifact_built_for_the_target(bundle: Path):
    m = load_manifest(bundle)
    assert m.target == "cuda:90" and m.triton == triton.__version__
    assert set(m.kernels) == {"moe_stage1", "moe_stage2", "gemm_bf16", "flash_attention"}
    assert len(m.artifacts) == 5
    for a in m.artifacts:
        assert a.status == "ok" and a.target == "cuda:90" and a.symbol.startswith("tt_")
        for role in ("c", "h", "glue", "binary"):
            assert (bundle / a.files[role]).is_file(), (a.id, role)
        assert "unsigned char" in (bundle / a.files["c"]).read_text()[:4000]  # the cubin, embedded
    ids = [a.id for a in m.artifacts]
    assert "moe_stage1_none_silu_BM16_BN32_BK32_GM1_W4_S2_KS1_TMA0" in ids  # the tuned CSV's kernel names
    assert "gemm_bf16_BM32_BN64_BK32_GM8_W4_S2_CG1" in ids
    assert (bundle / "src" / "main.c").is_file() and (bundle / "src" / "cuda.h").is_file()
    assert (bundle / "Makefile").is_file()


def test_every_dry_run_equals_the_python_resolver(bundle: Path):
    m = load_manifest(bundle)
    for a in m.artifacts:
        spec = RunSpec.parse((bundle / m.kernels[a.kernel].spec).read_text())
        resolved = resolve(spec, {k: int(v) for k, v in a.params.items()}, bundle)
        got = _dry_run(bundle, a)
        assert got["artifact"] == a.id
        assert got["grid"] == list(resolved.grid)
        assert {k: v for k, v in got["args"].items() if k in resolved.int_args} == resolved.int_args
        for name, value in resolved.float_args.items():
            assert got["args"][name] == pytest.approx(value)


def test_moe_grid_covers_the_padded_count_of_its_block_size(bundle: Path):
    m = load_manifest(bundle)
    tag = shape_tag(SHAPE)
    for a in m.artifacts:
        if not a.kernel.startswith("moe_"):
            continue
        bm, bn = int(a.params["BLOCK_SIZE_M"]), int(a.params["BLOCK_SIZE_N"])
        padded = int(read_tensor(bundle / data_name("num_tokens_post_padded", tag, bm))[1][0])
        n = SHAPE.inter_dim if a.kernel == "moe_stage1" else SHAPE.model_dim
        assert _dry_run(bundle, a)["grid"] == [triton.cdiv(padded, bm) * triton.cdiv(n, bn), 1, 1]


def test_makefile_rebuilds_an_executable_with_the_machine_compiler(bundle: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    target = next(a for a in load_manifest(copy).artifacts if a.kernel == "gemm_bf16")
    (copy / target.files["binary"]).unlink()
    make = shutil.which("make")
    if make:
        command = [make, "-C", str(copy), target.files["binary"]]
    else:  # no make here: run the Makefile's own recipe for this target with the C compiler
        lines = (copy / "Makefile").read_text().splitlines()
        recipe = lines[lines.index(next(ln for ln in lines if ln.startswith(target.files["binary"] + ":"))) + 2]
        cc = os.environ.get("CC") or "cc"
        command = ["sh", "-c", recipe.strip().replace("$(CC)", cc).replace("$(CFLAGS)", "-O2 -std=gnu11")
                   .replace("$@", target.files["binary"])]
        (copy / "bin").mkdir(exist_ok=True)
    done = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _dry_run(copy, target)["artifact"] == target.id


def test_running_here_without_a_gpu_is_never_valid(bundle: Path, tmp_path: Path):
    rows = run_bundle(bundle, reps=2, warmup=0, timeout_s=60, output=tmp_path / "stats.csv",
                      plot=tmp_path / "plot.svg", progress=False)
    assert len(rows) == 5
    assert not any(r.valid for r in rows)
    assert all(r.reason.startswith("exit 4") for r in rows), [r.reason for r in rows]


def test_moe_inputs_round_trip_from_the_engines_own_inputs(bundle: Path):
    x = FusedMoeTunable().make_inputs(MoeProblem(SHAPE, "stage1"), torch.device("cpu"), 0)
    tag = shape_tag(SHAPE)
    for name in ("hidden", "w1", "w2", "topk_weights"):
        header, tensor = read_tensor(bundle / data_name(name, tag))
        assert header.name == name and header.meta["shape_tag"] == tag
        assert torch.equal(tensor, x[name].to(tensor.dtype))
    assert torch.equal(read_tensor(bundle / data_name("topk_ids", tag))[1], x["topk_ids"].to(torch.int32))
    header = read_header(bundle / data_name("stage1_expected", tag, 16))
    assert header.dtype == "fp16" and header.shape == (SHAPE.token * SHAPE.topk, SHAPE.inter_dim)


@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_moe_sort_files_equal_moe_align_block_size_for_every_block_size(tmp_path: Path, skew: float):
    block_sizes = [16, 32, 64, 128]
    write_moe_data(tmp_path, SHAPE, ("stage1",), block_sizes, seed=3, skew=skew)
    tag = shape_tag(SHAPE)
    ids = read_tensor(tmp_path / data_name("topk_ids", tag))[1]
    expected = None
    for bm in block_sizes:
        ref = moe_align_block_size(ids, bm, SHAPE.expert)
        for what, want in (("sorted_token_ids", ref.sorted_token_ids), ("expert_ids", ref.expert_ids),
                           ("num_tokens_post_padded", ref.num_tokens_post_padded)):
            header, got = read_tensor(tmp_path / data_name(what, tag, bm))
            assert header.meta["block_size_m"] == str(bm)
            assert torch.equal(got, want.cpu().to(torch.int32)), (what, bm)
        padded = int(ref.num_tokens_post_padded[0])
        assert padded % bm == 0 and padded >= SHAPE.token * SHAPE.topk
        out = read_tensor(tmp_path / data_name("stage1_expected", tag, bm))[1]
        expected = out if expected is None else expected
        assert torch.equal(out, expected)  # pair order: the expected output does not depend on BLOCK_SIZE_M


@pytest.mark.parametrize("kind", ["stage1", "stage2"])
def test_the_jit_twin_of_an_artifact_matches_its_reference(kind: str):
    # MoeGemmTunable times through the JIT exactly the one launch an artifact makes (the AOT-vs-JIT benchmark).
    from tritune.aot.moe import MoeGemmTunable
    from tritune.tuning.types import Config

    tunable, problem = MoeGemmTunable(), MoeProblem(SHAPE, kind)
    x = tunable.make_inputs(problem, torch.device("cpu"), 0)
    out = tunable.alloc_output(problem, x).fill_(float("nan"))
    config = Config.from_dict(dict(MOE_CONFIGS[kind][0], KSPLIT=1, USE_TMA=0))
    tunable.launcher(problem, x, config, out)()
    ref = tunable.reference(problem, x)
    cols = SHAPE.inter_dim if kind == "stage1" else SHAPE.model_dim
    assert out.shape == ref.shape == (SHAPE.token * SHAPE.topk, cols)
    assert torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref) < 1e-2
