import os, sys, time
os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = ["benchmarks", "src"]
from ir_census import start_compiling_for
start_compiling_for(90, 132, None)
import torch
from tritune.kernels import fused_moe_1stage
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_compile import MoeDims, compile_only
dims = MoeDims(1, 4, 128, 2880, 2880, True, torch.bfloat16, "per_1x32", "silu", False, swizzled=True)
for w2s in (None, 6):
    fused_moe_1stage.W2_STAGES = w2s
    cfg = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, BLOCK_SIZE_D=128, GROUP_SIZE_M=1, num_warps=8, num_stages=3, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
    k = compile_only("1stage", dims, cfg, pdl=True)
    print(w2s, "smem", k.metadata.shared)
