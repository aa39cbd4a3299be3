import os, sys, subprocess, pathlib, time
os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = ["benchmarks", "src"]
from ir_census import start_compiling_for
start_compiling_for(90, 132, None)
import torch, triton
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels import fused_moe_1stage
fused_moe_1stage.COOP_SPLIT = True
from tritune.kernels.fused_moe_compile import MoeDims, compile_only
dims = MoeDims(1, 4, 128, 2880, 2880, True, torch.bfloat16, "per_1x32", "silu", False, swizzled=True)
for bn, bd, w, ks in ((128, 128, 8, 4), (128, 128, 8, 2)):
    cfg = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, BLOCK_SIZE_D=bd, GROUP_SIZE_M=1, num_warps=w, num_stages=3, KSPLIT=ks, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
    t = time.time()
    k = compile_only("1stage", dims, cfg, pdl=True)
    p = pathlib.Path("/tmp/k1.cubin"); p.write_bytes(k.asm["cubin"])
    tool = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True).stdout
    pathlib.Path(f"/tmp/k1_{bn}_{bd}.sass").write_text(sass)
    print(cfg.name("1stage", "per_1x32"), f"{time.time()-t:.1f}s", "smem", k.metadata.shared)
