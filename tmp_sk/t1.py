import dataclasses, sys, time, torch
sys.path.insert(0, "tests")
from test_mxfp4_records import operands, rel_l2, E, INTER, D
from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, fused_moe_2stage
from tritune.kernels.fused_moe_1stage import fused_moe_1stage
from tritune.kernels.mxfp4_records import prepare_mxfp4_scales
from tritune.kernels.mxfp4_swizzle import prepare_mxfp4_weights
hidden, q1, q2, weights, ids, s1, s2 = operands()
ST = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2, SWAP_AB=1, USE_TMA=1)
want = fused_moe_2stage(hidden, q1, q2, weights, ids, ST, ST, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
p1, p2 = prepare_mxfp4_scales(s1), prepare_mxfp4_scales(s2)
for fields, prep_w, rec in [({}, False, False), ({"USE_TMA": 0}, False, False), ({}, True, False),
                            ({"SCALE_TMA": 1}, True, True), ({"USE_TMA": 0}, True, False), ({"SCALE_TMA": 1, "BLOCK_SIZE_K": 128}, False, True)]:
    cfg = dataclasses.replace(MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, BLOCK_SIZE_D=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2, SWAP_AB=1, USE_TMA=1), **fields)
    w1 = prepare_mxfp4_weights(q1) if prep_w else q1
    w2 = prepare_mxfp4_weights(q2) if prep_w else q2
    t = time.time()
    got = fused_moe_1stage(hidden, w1, w2, weights, ids, cfg, quant=fm.MXFP4, w1_scale=p1 if rec else s1, w2_scale=p2 if rec else s2)
    print(fields, prep_w, rec, "rel", rel_l2(got, want.float().cpu()), f"{time.time()-t:.1f}s", cfg.name("1stage", fm.MXFP4))
# wider inter: the half-record select and several chunks; BN 128 / BD 128 on 8 warps
hidden, q1, q2, weights, ids, s1, s2 = operands(inter=192)
want = fused_moe_2stage(hidden, q1, q2, weights, ids, ST, ST, quant=fm.MXFP4, w1_scale=s1, w2_scale=s2)
p1, p2 = prepare_mxfp4_scales(s1), prepare_mxfp4_scales(s2)
for bn, bd, w in ((64, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 8)):
    for st in (0, 1):
        cfg = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, BLOCK_SIZE_D=bd, GROUP_SIZE_M=1, num_warps=w, num_stages=2, SWAP_AB=1, USE_TMA=1, SCALE_TMA=st)
        got = fused_moe_1stage(hidden, prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2), weights, ids, cfg, quant=fm.MXFP4, w1_scale=p1, w2_scale=p2)
        print("inter192", bn, bd, w, st, rel_l2(got, want.float().cpu()))
