"""compile_target (a leaf module): a compile process answers Triton from the tuned GPU's target and SM count and
never opens CUDA (issue 17: 64 compile processes each opening a context on GPU 0 held the first candidate back 30 s).

The real compile runs in a fresh interpreter with Triton's interpreter off (conftest switches it on here), compiling
for cuda:90 on this GPU-less machine as a compile process of the pool does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from tritune.compile_target import CompileTarget, compiling_for, process_sm_count
from tritune.device import DeviceInfo
from tritune.kernels import gemm as gk
from tritune.tuning.compile import compile_target_of

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", 132, (9, 0), 232448, 65536, 50 << 20, 32, "3.6.0", "2.11.0", "13.0")


def test_target_of_a_gpu_names_its_arch_warp_and_sms():
    assert compile_target_of(H100) == CompileTarget("cuda", 90, 32, 132)


def test_no_target_under_the_interpreter_without_a_device_or_on_rocm(monkeypatch):
    import dataclasses

    assert compile_target_of(dataclasses.replace(H100, interpreter=True)) is None
    assert compile_target_of(None) is None
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert compile_target_of(H100) is None  # a HIP build: its compile processes ask the GPU, as before


def test_compiling_for_answers_triton_and_the_sm_count_then_restores_both():
    before = driver._active
    assert process_sm_count() is None
    with compiling_for(CompileTarget("cuda", 90, 32, 77)):
        assert driver.active.get_current_target() == GPUTarget("cuda", 90, 32)
        assert (driver.active.get_current_device(), driver.active.get_current_stream(0)) == (0, 0)
        assert gk.programs_per_wave(torch.device("cuda")) == 77  # the persistent GEMM's NUM_SMS, not a GPU query
    assert driver._active is before and process_sm_count() is None


_CHILD = """
import json, os
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget("cuda", 90, 32, 77))
import pytest
import torch
from tritune.kernels import gemm as gk
gk.compile_only("bf16", 64, 256, 128, gk.GemmConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64,
                PERSISTENT_TMA=True), torch.float16, torch.float16)
gk.compile_only("bf16", 64, 256, 128, gk.GemmConfig(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32),
                torch.float16, torch.float16)
print(json.dumps({"cuda_initialized": torch.cuda.is_initialized(), "visible": os.environ["CUDA_VISIBLE_DEVICES"]}))
"""


def test_a_compile_process_builds_for_the_target_without_opening_cuda(tmp_path: Path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"cuda_initialized": False, "visible": ""}
    metas = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("*.json")
             if not p.name.startswith("__grp__")]
    kernels = {m["name"]: m for m in metas if "name" in m}
    assert {"_gemm_tma_persistent_kernel", "_gemm_kernel"} <= set(kernels)
    for meta in kernels.values():
        assert meta["target"]["arch"] == 90 and meta["target"]["backend"] == "cuda"
    assert list((tmp_path / "cache").rglob("*.cubin")), "no cubin written"


_GPU_CHILD = """
import json, sys
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget(*json.loads(sys.argv[1])))
import pytest
import torch
from tritune.kernels import gemm as gk
gk.compile_only("bf16", 96, 384, 160, gk.GemmConfig(**json.loads(sys.argv[2])), torch.bfloat16, torch.bfloat16)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the real launch must find the binary")
@pytest.mark.parametrize("params", [
    {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 3, "num_stages": 2},
    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 3, "num_stages": 2,
     "PERSISTENT_TMA": True},
])
def test_the_gpu_launch_finds_what_a_gpu_less_compile_process_built(tmp_path: Path, monkeypatch, params):
    """The binary a compile process built for this GPU's target is the one the launch here loads: it compiles
    nothing more (the cache key holds the target and NUM_SMS, which the process answered from the device)."""
    from tritune.device import current_device

    device = current_device()
    target = compile_target_of(device)
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, "-c", _GPU_CHILD, json.dumps([target.backend, target.arch,
                          target.warp_size, target.sm_count]), json.dumps(params)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    built = sorted(p.parent.name for p in cache.rglob("*.cubin"))
    assert len(built) == 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    import triton

    assert triton.knobs.cache.dir == str(cache)  # read at each compile: this process's launch looks there
    a = torch.randn(96, 160, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 160, device="cuda", dtype=torch.bfloat16)
    out = gk.gemm("bf16", a, b, gk.GemmConfig(**params))
    torch.testing.assert_close(out.float(), a.float() @ b.float().T, rtol=2e-2, atol=2e-1)
    assert sorted(p.parent.name for p in cache.rglob("*.cubin")) == built, "the launch compiled its own binary"


_SORT_CHILD = """
import json, sys
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget(*json.loads(sys.argv[1])))
from tritune.kernels.launch import BoundKernel
from tritune.kernels.moe_align import AlignLaunch, compile_sort_only
import torch
for numel, block, experts in json.loads(sys.argv[2]):
    compile_sort_only(numel, block, experts)
bound = AlignLaunch(torch.empty(40, dtype=torch.int32), 16, 8)._first
try:
    bound.launch(0)
except RuntimeError as exc:
    print(json.dumps({"refused": str(exc)}))
"""


def _run_sort_child(cache: Path, target: list, sizes: list) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", _SORT_CHILD, json.dumps(target), json.dumps(sizes)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_compile_process_builds_the_sort_a_worker_binds_and_cannot_launch_it(tmp_path: Path):
    """The stage candidates' sort (issue 17: four GPU workers compiled it at once): one, two and three launches."""
    run = _run_sort_child(tmp_path / "cache", ["cuda", 90, 32, 132], [[40, 16, 8], [1000, 32, 8], [70000, 64, 128]])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compile-only process" in json.loads(run.stdout.strip().splitlines()[-1])["refused"]
    names = {json.loads(p.read_text()).get("name") for p in (tmp_path / "cache").rglob("*.json")
             if not p.name.startswith("__grp__")}
    assert {"_moe_align_first_kernel", "_moe_scan_kernel", "_moe_scatter_kernel"} <= names


def test_the_sort_needs_no_compile_in_a_process_with_its_gpu():
    from tritune.kernels.moe_align import compile_sort_only

    compile_sort_only(40, 16, 8)  # not a compile-only process: nothing bound, nothing launched, nothing raised


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the real sort must find the binaries")
def test_the_gpu_sort_finds_what_a_gpu_less_compile_process_built(tmp_path: Path, monkeypatch):
    from tritune.device import current_device
    from tritune.kernels.moe_align import moe_align_block_size, moe_align_block_size_reference

    t = compile_target_of(current_device())
    cache = tmp_path / "cache"
    run = _run_sort_child(cache, [t.backend, t.arch, t.warp_size, t.sm_count], [[1000, 32, 8], [70000, 64, 128]])
    assert run.returncode == 0, run.stderr[-2000:]
    built = sorted(p.parent.name for p in cache.rglob("*.cubin"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    gen = torch.Generator().manual_seed(5)
    for (tokens, topk, experts, block) in ((125, 8, 8, 32), (8750, 8, 128, 64)):
        ids = torch.randint(0, experts, (tokens, topk), generator=gen, dtype=torch.int32).cuda()
        got = moe_align_block_size(ids, block, experts)
        want = moe_align_block_size_reference(ids, block, experts)
        assert torch.equal(got.expert_ids.cpu(), want.expert_ids.cpu())
        assert torch.equal(got.sorted_token_ids.cpu(), want.sorted_token_ids.cpu())
    assert sorted(p.parent.name for p in cache.rglob("*.cubin")) == built, "the sort compiled its own binaries"


_SCHEDULED_DW_CHILD = """
import json
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget("cuda", 90, 32, 132))
import torch
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW
from tritune.kernels.grouped_gemm_compile import compile_only
cfg = KernelConfigBackward_dW(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, num_warps=4, num_stages=3,
                              flatten=False, use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True,
                              GROUP_SIZE_N=2, scheduled=True)
compile_only(cfg, num_experts=6, n=128, k=96, pairs=200, topk=2, dtype=torch.float16)
print(json.dumps({"cuda_initialized": torch.cuda.is_initialized()}))
"""


def test_a_compile_process_builds_every_kernel_of_the_scheduled_dw(tmp_path: Path):
    """The padding copy (three ways: grouped, token order, pair order), the table kernel (either operand padded) and
    the loop itself: a GPU worker then launches all of them from the cache, compiling nothing."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _SCHEDULED_DW_CHILD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"cuda_initialized": False}
    metas = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("*.json")
             if not p.name.startswith("__grp__")]
    names = [m["name"] for m in metas if "name" in m]
    assert names.count("_pad_rows_kernel") == 4 and names.count("_dw_schedule_kernel") == 2
    assert names.count("_dw_scheduled_kernel") == 1


_BLOCKSCALE_RULE_CHILD = """
import json
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget("cuda", 90, 32, 132))
from tritune.kernels import gemm as gk
from tritune.ops.heuristics import gemm_heuristic
built = []
for M, N in ((2048, 16), (2048, 32), (1024, 1536)):
    cfg = gemm_heuristic("a8w8_blockscale", M, N, 7168, gluon=False, warp_specialize=True)
    gk.compile_only("a8w8_blockscale", M, N, 7168, cfg)
    built.append([cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.num_warps, cfg.WARP_SPECIALIZE])
print(json.dumps(built))
"""


def test_the_rule_tables_block_scaled_triton_configs_compile_for_hopper(tmp_path: Path):
    """The rule table's block-scaled configs on Triton's kernels at K 7168 (warp-specialised where Triton can) build
    for sm_90; at N 16 and 32 the 128-row tile stays on 4 warps, where Triton's warp specialisation fails to compile
    (thirtieth session), so it is not warp-specialised there."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _BLOCKSCALE_RULE_CHILD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert built[0][:3] == [128, 16, 4] and built[1][:3] == [128, 32, 4] and not built[0][3] and not built[1][3]
    assert built[2][3] and built[2][2] == 8  # 128x128 on 8 warps: warp-specialised


_RULE_SWEEP_CHILD = """
import itertools, json
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget("cuda", 90, 32, 132))
from tritune.kernels import gemm as gk
from tritune.ops.heuristics import gemm_heuristic
seen = set()
for kernel, M, N, K, gluon in itertools.product(("bf16", "a8w8", "a8w8_blockscale"), (64, 256, 2048),
                                                (16, 1536, 4096), (384, 7168), (False, True)):
    cfg = gemm_heuristic(kernel, M, N, K, gluon=gluon, warp_specialize=True)
    if (kernel, cfg) not in seen:
        seen.add((kernel, cfg))
        gk.compile_only(kernel, M, N, K, cfg)
print(json.dumps({"configs": len(seen), "gluon": sum(c.GLUON for _, c in seen)}))
"""


def test_every_rule_table_gemm_config_of_a_shape_sweep_compiles_for_hopper(tmp_path: Path):
    """Each distinct config the GEMM rule table gives over 108 shapes (three kernels, M 64-2048, N 16-4096, K 384
    and 7168, with and without Gluon, Triton's warp specialisation on) builds for sm_90 without a GPU: a config the
    op picks by itself must never fail to compile (thirtieth session: one at N 16-32 did). About 20 s."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _RULE_SWEEP_CHILD], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["configs"] >= 25 and got["gluon"] >= 4, got  # the sweep reaches both families of kernels


_MOE_RULE_SWEEP_CHILD = """
import itertools, json
from tritune.compile_target import CompileTarget
from tritune.tuning.compile import _compile_process_init
_compile_process_init(CompileTarget("cuda", 90, 32, 132))
from tritune.kernels.fused_moe_compile import MoeDims, compile_only
from tritune.ops.heuristics import moe_heuristic
seen = set()
for (d, i, e, k), quant, tokens in itertools.product(((4096, 384, 128, 8), (4096, 14336, 8, 2), (2880, 2880, 128, 4)),
                                                     ("none", "per_1x128", "per_1x32"), (1, 64, 4096)):
    one, c1, c2 = moe_heuristic(tokens, d, i, e, k, quant)
    dims = MoeDims(tokens, k, e, d, i, quant=quant, swizzled=quant == "per_1x32")
    for kernel, cfg in ((("1stage", c1),) if one else (("stage1", c1), ("stage2", c2))):
        if (kernel, cfg, quant) not in seen:
            seen.add((kernel, cfg, quant))
            compile_only(kernel, dims, cfg, pdl=True)
print(json.dumps({"binaries": len(seen), "gluon": sum(bool(c.GLUON) for _, c, _ in seen)}))
"""


def test_the_fused_moe_rule_tables_plans_of_a_sweep_compile_for_hopper(tmp_path: Path):
    """The fused-MoE rule table's stage and 1-stage configs for three shapes (E 128 top-8 I 384, Mixtral-8x7B,
    gpt-oss-120b), bf16 / per_1x128 / MXFP4, at 1, 64 and 4096 tokens build for sm_90 without a GPU (the Gluon pair
    among them). An offline sweep of 369 such binaries found none failing (thirtieth session); this keeps a sample.
    About 25 s."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", _MOE_RULE_SWEEP_CHILD], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["binaries"] >= 20 and got["gluon"] >= 2, got
