import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = ["benchmarks", "src"]
from ir_census import start_compiling_for
start_compiling_for(90, 132, None)
import torch, dataclasses
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_compile import MoeDims, compile_only
from tritune.ops.heuristics import moe_heuristic
dims = MoeDims(16, 4, 128, 2880, 2880, True, torch.bfloat16, "per_1x32", "silu", False, swizzled=True)
_, s1, s2 = moe_heuristic(16, 2880, 2880, 128, 4, "per_1x32", one_stage=False)
for kind, cfg in (("stage1", s1), ("stage2", s2), ("stage1", dataclasses.replace(s1, SCALE_TMA=0))):
    k = compile_only(kind, dims, cfg, pdl=True); print(kind, cfg.name(kind, "per_1x32"), "ok")
one = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=128, GROUP_SIZE_M=1, num_warps=8, num_stages=3, KSPLIT=2, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
for cfg in (one, dataclasses.replace(one, SCALE_TMA=0), dataclasses.replace(one, KSPLIT=1)):
    k = compile_only("1stage", dims, cfg, pdl=True); print(cfg.name("1stage", "per_1x32"), "ok")
