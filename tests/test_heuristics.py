"""ops.heuristics: each row of the documented rule tables, and every config valid for the kernels and the tuner."""

import dataclasses
import itertools

import pytest

from tritune.device import current_device
from tritune.kernels import gemm as gk
from tritune.kernels.fused_moe import MoeConfig, check_config, check_plan
from tritune.kernels.gluon_gemm import smem_bytes as gluon_gemm_smem_bytes
from tritune.ops import heuristics
from tritune.ops.heuristics import gemm_heuristic, moe_heuristic
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe_tunable import MoeProblem, one_stage_constraints, stage_constraints
from tritune.tuners.gemm_tunable import GemmProblem, gemm_constraints
from tritune.tuning.types import Config

H100 = current_device()  # no GPU here: the interpreter stand-in with H100 limits (132 SMs, 232448 B)


def device(sm_count=132, max_shared=232448):
    return dataclasses.replace(H100, sm_count=sm_count, max_shared_mem=max_shared, capability=(9, 0))


def tile(c):
    return c.BLOCK_SIZE_M, c.BLOCK_SIZE_N, c.BLOCK_SIZE_K


@pytest.mark.parametrize("kernel, M, N, K, want", [
    # (BM, BN, BK, split, stages, TMA)
    ("bf16", 1, 4096, 14336, (16, 64, 256, 4, 4, False)),  # 64 tiles < 66 and each streams 1.8 MiB: split 4
    ("bf16", 1, 4096, 4096, (16, 64, 256, 1, 4, False)),  # same grid, 512 KiB per tile: K not long, no split
    ("a8w8", 16, 14336, 4096, (16, 128, 256, 1, 4, False)),  # 112 tiles cover 3/4 of the SMs: the wider tile
    ("a8w8_blockscale", 1, 2112, 7168, (16, 32, 128, 1, 5, False)),  # 33 tiles < 44: narrow fallback, 5 stages
    ("a8w8_blockscale", 1, 4096, 14336, (16, 64, 128, 4, 4, False)),  # as tuned: 16x64, split 4
    ("bf16", 32, 4096, 4096, (32, 64, 256, 1, 4, False)),  # M <= 32 row; 64 tiles, no fallback past a third
    ("a8w8", 64, 4096, 4096, (32, 64, 256, 1, 4, False)),  # 64x64 = 64 tiles; 32x64 fills (as tuned)
    ("a8w8_blockscale", 64, 4096, 4096, (64, 64, 128, 1, 4, False)),  # no 32-row main tile when block-scaled
    ("a8w8_blockscale", 64, 2112, 7168, (16, 64, 128, 1, 4, False)),  # under a third: 16-row fallback (vLLM)
    ("bf16", 256, 14336, 4096, (128, 256, 64, 1, 4, False)),  # 128x256 still gives 112 tiles (as tuned)
    ("a8w8_blockscale", 256, 14336, 4096, (64, 128, 128, 1, 4, False)),  # no 128-row tile to M=256 (tuned)
    ("a8w8_blockscale", 512, 2112, 7168, (64, 64, 128, 1, 4, False)),  # 64x128: 136 tiles = a half-empty wave
    ("bf16", 1024, 4096, 4096, (128, 256, 64, 1, 3, True)),  # bf16 TMA from 1024: 3 stages leave the epilogue room
    ("a8w8", 1024, 4096, 4096, (128, 256, 128, 1, 4, False)),  # a8w8: TMA only from 2048
    ("bf16", 256, 6144, 4096, (128, 128, 64, 1, 7, False)),  # past 64 rows as many stages as fit, up to 7
    # bf16 past 64 rows: the tile whose waves cost least. 72 tiles of 128x128 in one wave beat 288 of 64x64 in three
    # (29.4 against 38.6 us tuned); 384 of 128x128 (2.9 waves) beat 192 of 128x256 (1.45) at M 1024 (74.9 / 93.2 us)
    ("bf16", 256, 4608, 3584, (128, 128, 64, 1, 7, False)),
    ("bf16", 1024, 6144, 4096, (128, 128, 64, 1, 6, True)),
    ("bf16", 1024, 37888, 3584, (128, 256, 64, 1, 3, True)),  # 1184 tiles of 128x256: 8.97 waves, nearly full
    ("bf16", 128, 128, 4096, (64, 32, 128, 1, 7, False)),  # one tile of 128x128 against 8 programs of 64x32
    ("bf16", 64, 4096, 4096, (32, 64, 256, 1, 4, False)),  # up to 64 rows: 4 stages, as before
    ("a8w8", 256, 6144, 4096, (128, 128, 128, 1, 4, False)),  # fp8: 4 stages, as before (deep ones not measured)
    ("bf16", 4096, 4096, 4096, (128, 256, 64, 1, 3, True)),  # TMA: 3 stages leave room for the epilogue tile
    ("a8w8_blockscale", 1024, 4096, 4096, (128, 128, 128, 1, 4, True)),  # block-scaled TMA from 1024
    ("bf16", 1, 512, 16384, (16, 32, 256, 8, 4, False)),  # 16 tiles, 1 MiB each: split 8 (grid 128 <= 264)
])
def test_gemm_rule_table_rows(kernel, M, N, K, want):
    c = gemm_heuristic(kernel, M, N, K, gluon=False)  # the Triton kernels' rows (the Gluon rule: below)
    assert (*tile(c), c.NUM_KSPLIT, c.num_stages, c.PERSISTENT_TMA) == want


@pytest.mark.parametrize("M, N, group", [
    (1, 4096, 1),  # one row of tiles: grouping pruned by the tuner
    (256, 4096, 8),  # several rows
])
def test_gemm_group_size(M, N, group):
    assert gemm_heuristic("bf16", M, N, 4096).GROUP_SIZE_M == group


def test_gemm_cache_modifier_and_warps():
    assert gemm_heuristic("a8w8", 8, 4096, 4096).cache_modifier == ".cg"  # weight streaming at M <= 16
    assert gemm_heuristic("a8w8", 64, 4096, 4096).cache_modifier == ""
    assert gemm_heuristic("bf16", 8192, 8192, 8192).num_warps == 8  # 128x256
    assert gemm_heuristic("bf16", 64, 4096, 4096).num_warps == 4


def test_split_k_leaves_at_least_four_k_steps_per_split():
    for kernel, M, N, K in itertools.product(gk.KERNELS, (1, 8, 32), (256, 512, 1024, 4096), (2048, 8192, 32768)):
        c = gemm_heuristic(kernel, M, N, K)
        tiles = -(-M // c.BLOCK_SIZE_M) * -(-N // c.BLOCK_SIZE_N)
        if c.NUM_KSPLIT > 1:
            assert K >= 4 * c.NUM_KSPLIT * c.BLOCK_SIZE_K and 2 * tiles < 132, c
            assert tiles * c.NUM_KSPLIT <= 2 * 132


SHAPES = [(N, K) for N in (16, 100, 512, 1536, 2112, 4096, 7168, 14336, 24576)
          for K in (16, 96, 512, 4096, 7168, 18432)]
MS = (1, 3, 16, 17, 32, 48, 64, 100, 256, 300, 512, 1000, 2048, 8192)


@pytest.mark.parametrize("kernel", gk.KERNELS)
@pytest.mark.parametrize("sm_count, max_shared", [
    (132, 232448),  # H100 / H200
    (114, 232448),  # H100 PCIe
    (108, 166912),  # A100: less shared memory, no TMA rows (capability checked separately)
])
def test_every_gemm_config_passes_the_tuners_rules(kernel, sm_count, max_shared):
    dev = device(sm_count, max_shared)
    for (N, K), M in itertools.product(SHAPES, MS):
        c = gemm_heuristic(kernel, M, N, K, sm_count, max_shared)
        rules = gemm_constraints(GemmProblem(kernel, M, N, K), dev)
        broken = [r.name for r in rules if not r.ok(Config.from_dict(dataclasses.asdict(c)))]
        assert not broken, (M, N, K, c, broken)
        if kernel == "a8w8_blockscale":
            assert gk.SCALE_BLOCK % c.BLOCK_SIZE_K == 0


def test_fp8_per_token_takes_the_gluon_tile_whose_waves_cost_least():
    """a8w8 on Hopper from M 256 (N >= 128, K >= 512, 16-byte rows): the Gluon tile whose waves cost least, or the
    Triton rule where Triton's 128x256 costs least (twenty-sixth session, six held-out (N, K) on an H100)."""
    def rule(M, N, K, **kw):
        return gemm_heuristic("a8w8", M, N, K, gluon=True, **kw)

    q_a = rule(1024, 1536, 7168)  # 128 tiles of 64x192: one full wave; 128x256 would fill 48 SMs
    assert q_a.GLUON and (q_a.BLOCK_SIZE_M, q_a.BLOCK_SIZE_N, q_a.num_warps, q_a.num_stages) == (64, 192, 4, 5)
    assert q_a.PERSISTENT_TMA and q_a.BLOCK_SIZE_K == 128 and gk.gluon_problem(q_a, "a8w8", 1) is None
    down = rule(256, 3584, 18944)  # 112 tiles of 64x128 in one wave
    assert down.GLUON and (down.BLOCK_SIZE_M, down.BLOCK_SIZE_N, down.num_stages) == (64, 128, 6)
    assert rule(4096, 1536, 7168).BLOCK_SIZE_N == 128  # 384 tiles of 128x128: 2.9 waves, 128x256 two half-full
    for M, N, K in ((8192, 4608, 3584), (4096, 6144, 4096), (1024, 14336, 8192), (256, 14336, 8192)):
        c = rule(M, N, K)  # many waves of 128x256 (or 112 tiles in one): Triton's tile and rule
        assert not c.GLUON and (c.BLOCK_SIZE_M, c.BLOCK_SIZE_N) == (128, 256), (M, N, K, c)
    for M, N, K, kw in ((255, 1536, 7168, {}), (1024, 120, 7168, {}), (1024, 1536, 384, {}),
                        (1024, 1540, 7168, {}), (1024, 1536, 7176, {}), (1024, 1536, 7168, {"capability": (8, 0)})):
        assert not rule(M, N, K, **kw).GLUON, (M, N, K, kw)
    assert not gemm_heuristic("a8w8", 1024, 1536, 7168, gluon=False).GLUON
    assert not gemm_heuristic("bf16", 1024, 1536, 7168, gluon=True).GLUON  # bf16: the tuner's to pick
    small = rule(1024, 1536, 7168, max_shared=166912)  # 64x192 at 5 stages needs 188 KB: 4 fit
    assert small.num_stages == 4 and gluon_gemm_smem_bytes(64, 192, 4) <= 166912


def test_block_scaled_takes_the_gluon_kernel_on_hopper_from_m_256():
    """H100: 128x128 on 8 warps fed by a loader warp group through 5 stages where that grid makes a wave
    (twenty-eighth session), else 64x128 on 4 warps and 5 stages, loads and MMAs in one kernel (twenty-fifth), and
    where even that grid fills under half the SMs 64x64 warp-specialised, 8 stages (H200, thirtieth); only on
    Hopper with Gluon, from M 256, N 128, K 512, with 16-byte rows."""
    def rule(M, N, K, **kw):
        return gemm_heuristic("a8w8_blockscale", M, N, K, gluon=True, **kw)

    big = rule(4096, 24576, 7168)
    assert big.GLUON and (tile(big), big.num_warps, big.num_stages, big.GROUP_SIZE_M) == ((128, 128, 128), 8, 5, 8)
    assert gk.gluon_problem(big) is None and big.PERSISTENT_TMA and big.WARP_SPECIALIZE and big.NUM_KSPLIT == 1
    small = rule(512, 1536, 7168)  # 4 x 12 = 48 tiles of 128x128: under a wave; 96 of 64x128 over half
    assert small.GLUON and (tile(small), small.num_warps, small.num_stages) == ((64, 128, 128), 4, 5)
    assert not small.WARP_SPECIALIZE and gk.gluon_problem(small) is None
    narrow = rule(256, 1536, 7168)  # 48 tiles of 64x128 fill under half the SMs: 96 of 64x64, warp-specialised
    assert (tile(narrow), narrow.num_warps, narrow.num_stages, narrow.GROUP_SIZE_M) == ((64, 64, 128), 4, 8, 8)
    assert narrow.WARP_SPECIALIZE and narrow.PERSISTENT_TMA and gk.gluon_problem(narrow) is None
    assert rule(256, 1536, 512).num_stages == 6  # 4 K blocks: no more stages than 2 + K blocks
    assert rule(256, 1536, 7168, max_shared=120 * 1024).num_stages == 7  # 16 KB a stage + the C tile
    assert not rule(256, 4096, 7168).WARP_SPECIALIZE  # 128 tiles of 64x128: the 64x128 rule
    assert rule(1024, 1536, 7168).BLOCK_SIZE_M == 64 and rule(2048, 1536, 7168).BLOCK_SIZE_M == 128  # 96 / 192 tiles
    assert rule(1024, 1536, 7168).num_stages == 4  # 192 tiles of 64x128: two programs a SM need 4 stages or fewer
    assert rule(512, 1536, 512).num_stages == 5 and rule(4096, 1536, 512).num_stages == 5  # 4 K blocks + 2 >= 5
    for M, N, K, kw in ((255, 4096, 4096, {}), (4096, 120, 4096, {}), (4096, 4096, 384, {}), (4096, 4100, 4096, {}),
                        (4096, 4096, 4104, {}), (4096, 4096, 4096, {"capability": (8, 0)})):
        assert not rule(M, N, K, **kw).GLUON, (M, N, K, kw)
    assert not gemm_heuristic("a8w8_blockscale", 4096, 4096, 4096, gluon=False).GLUON
    assert not gemm_heuristic("a8w8", 4096, 4096, 4096, gluon=True).GLUON  # 128x256's waves cost least


def test_block_scaled_warp_specialises_at_long_k_where_triton_can():
    """Measured on the H100 (Triton 3.6): 0.88-0.97x the time from K 7168 at M >= 1024, nothing at K <= 4096 or in
    bf16. Only on the persistent TMA kernel, only where Triton has warp_specialize (3.5+); the Gluon kernel off."""
    def rule(*shape, **kw):
        return gemm_heuristic(*shape, gluon=False, **kw)

    assert rule("a8w8_blockscale", 4096, 1536, 7168, warp_specialize=True).WARP_SPECIALIZE
    assert rule("a8w8_blockscale", 1024, 3584, 18944, warp_specialize=True).WARP_SPECIALIZE
    assert not rule("a8w8_blockscale", 4096, 6144, 4096, warp_specialize=True).WARP_SPECIALIZE  # K short
    assert not rule("a8w8_blockscale", 512, 1536, 7168, warp_specialize=True).WARP_SPECIALIZE  # no TMA
    assert not rule("a8w8_blockscale", 4096, 1536, 7168, warp_specialize=False).WARP_SPECIALIZE
    assert not rule("bf16", 8192, 1536, 7168, warp_specialize=True).WARP_SPECIALIZE
    assert not rule("a8w8_blockscale", 4096, 1536, 7168, capability=(8, 0), warp_specialize=True).WARP_SPECIALIZE
    ws = rule("a8w8_blockscale", 4096, 1536, 7168, warp_specialize=True)
    assert ws.PERSISTENT_TMA and not ws.SCALE_PIPELINE  # the kernel's own pairing rules


def test_no_tma_before_hopper():
    assert not gemm_heuristic("bf16", 8192, 8192, 8192, capability=(8, 0)).PERSISTENT_TMA
    assert not moe_heuristic(4096, 4096, 14336, 8, 2, "none", capability=(8, 0))[1].USE_TMA


def test_gemm_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown GEMM kernel"):
        gemm_heuristic("int8", 1, 1, 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        gemm_heuristic("bf16", 0, 4096, 4096)


# ---------------------------------------------------------------------------------------------------- fused MoE


def short(c):
    return c.BLOCK_SIZE_M, c.BLOCK_SIZE_N, c.BLOCK_SIZE_K, c.num_warps, c.GROUP_SIZE_M, c.USE_TMA


@pytest.mark.parametrize("tokens, dims, quant, want", [
    # (run_1stage, stage 1 or 1-stage (BM, BN, BK, warps, GM, TMA), stage 2 or None)
    (1, (4096, 14336, 8, 2), "none", (True, (16, 128, 128, 4, 1, 0), None)),  # 2 pairs: 1-stage (tuned)
    # 1-stage slices of I narrowed until (expert blocks) x (slices) fills the 132 SMs, as tuned at 1 token:
    (1, (4096, 384, 128, 8), "none", (True, (16, 32, 128, 4, 1, 0), None)),  # 8 x 12 programs (128 wide: 8 x 3)
    (1, (2048, 1536, 64, 6), "none", (True, (16, 64, 128, 4, 1, 0), None)),  # 6 x 24
    (5, (4096, 14336, 8, 2), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 256, 4, 1, 0))),  # 10 pairs: 2-stage
    (8, (4096, 14336, 8, 2), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 256, 4, 1, 0))),  # m = 2, as tuned
    # fp8 on 16-row blocks: tiles twice as wide as bf16's, BK 128 for per_1x128 (its scale block)
    (32, (4096, 14336, 8, 2), "per_1x128", (False, (16, 64, 128, 4, 1, 0), (16, 128, 128, 4, 1, 0))),
    # fp8 at a handful of pairs: the stage pair, not the 1-stage kernel (tuned at E 128 and Qwen3-30B-A3B, 1 token)
    (1, (4096, 384, 128, 8), "per_1x128", (False, (16, 64, 128, 4, 1, 0), (16, 128, 128, 4, 1, 0))),
    (1, (2048, 768, 128, 8), "per_token", (False, (16, 64, 256, 4, 1, 0), (16, 128, 128, 4, 1, 0))),
    (128, (4096, 14336, 8, 2), "none", (False, (64, 64, 128, 4, 1, 0), (64, 128, 128, 4, 1, 0))),  # m=32, tuned
    (512, (4096, 14336, 8, 2), "none", (False, (64, 128, 64, 4, 8, 1), (64, 256, 64, 4, 8, 1))),  # m=128: GM 8
    (1024, (4096, 14336, 8, 2), "none", (False, (128, 128, 64, 8, 8, 1), (128, 256, 64, 8, 8, 1))),  # as tuned
    (1024, (4096, 14336, 8, 2), "per_token", (False, (128, 128, 128, 8, 8, 1), (128, 256, 128, 8, 8, 1))),
    (1024, (4096, 14336, 8, 2), "per_1x128", (False, (64, 256, 128, 8, 8, 1), (64, 256, 128, 8, 8, 1))),
    # per_1x128 at m = 384 (DeepSeek-V2-Lite, 4096 tokens): 64-row tiles as tuned (128 rows ran 2.2x behind)
    (4096, (2048, 1408, 64, 6), "per_1x128", (False, (64, 256, 128, 8, 8, 1), (64, 256, 128, 8, 8, 1))),
    # per_1x128 at m = 1024: still 64-row tiles (the tuned Mixtral row at 4096 tokens: 64x256 on both stages)
    (4096, (4096, 14336, 8, 2), "per_1x128", (False, (64, 256, 128, 8, 8, 1), (64, 256, 128, 8, 8, 1))),
    # ... and at m = 562 (DeepSeek-V2-Lite, 6000 tokens: the 128-row rule ran 4x behind vLLM there)
    (6000, (2048, 1408, 64, 6), "per_1x128", (False, (64, 256, 128, 8, 8, 1), (64, 256, 128, 8, 8, 1))),
    (256, (2048, 768, 128, 8), "none", (False, (32, 64, 128, 4, 1, 0), (32, 64, 128, 4, 1, 0))),  # m=16: BM 32
    # stage 2's K is I: 256-wide steps only where I holds at least 4 of them (I 384: 128, 0.82x at 16 tokens)
    (16, (4096, 384, 128, 8), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 128, 4, 1, 0))),
    (16, (2048, 768, 128, 8), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 128, 4, 1, 0))),  # 3 steps
    (16, (2048, 1408, 64, 6), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 256, 4, 1, 0))),  # 5.5 steps
    (64, (2048, 1536, 64, 6), "none", (False, (16, 32, 256, 4, 1, 0), (16, 64, 256, 4, 1, 0))),  # 6 steps
])
def test_moe_rule_table_rows(tokens, dims, quant, want):
    run_1stage, s1, s2 = moe_heuristic(tokens, *dims, quant, gluon=False)  # the Triton kernels' rows (Gluon: below)
    assert (run_1stage, short(s1), short(s2) if s2 else None) == want


def test_per_1x128_takes_the_gluon_stages_on_hopper_from_128_pairs_an_expert():
    """per_1x128 on Hopper with Gluon, gated, D and I multiples of 128, from m = 128 and I 256: both stages in Gluon
    on 128-row blocks, stage 1 on gathered rows, both fed by loader warp groups; below m 128 and I 1024, stage 1
    alone, gathering its own rows."""
    from tritune.kernels.fused_moe import check_plan
    from tritune.kernels.fused_moe_config import gluon_problem

    _, s1, s2 = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True)  # DeepSeek-V2-Lite, m = 384
    assert s1.GLUON and s2.GLUON and (s1.BLOCK_SIZE_M, s1.BLOCK_SIZE_N, s2.BLOCK_SIZE_N) == (128, 64, 128)
    assert s1.GATHER_A and s1.SORTED_INTER == 2 and gluon_problem(s1, "stage1", "per_1x128") is None
    assert (s1.PERSISTENT, s1.WARP_SPEC, s1.num_stages) == (1, 1, 6)  # both fed by a loader warp group
    assert (s2.PERSISTENT, s2.WARP_SPEC, s2.num_stages) == (1, 1, 6)
    assert gluon_problem(s2, "stage2", "per_1x128") is None
    check_plan(s1, s2, "per_1x128")
    # From I 256 at m >= 128: E 128 I 384 at 4096 tokens (m = 256) takes the pair too
    _, p1, p2 = moe_heuristic(4096, 4096, 384, 128, 8, "per_1x128", gluon=True)
    assert p1.GLUON and p2.GLUON and p2.WARP_SPEC and p1.BLOCK_SIZE_M == 128
    assert not moe_heuristic(4096, 4096, 128, 128, 8, "per_1x128", gluon=True)[2].GLUON  # I 128: not the pair
    # below I 1024 the pair from m = 256: at 2048 tokens (m = 128) stage 1 alone on Gluon, as below
    _, q1, q2 = moe_heuristic(2048, 4096, 384, 128, 8, "per_1x128", gluon=True)
    assert q1.GLUON and not q2.GLUON and not q1.GATHER_A
    assert moe_heuristic(2048, 4096, 1024, 128, 8, "per_1x128", gluon=True)[2].GLUON  # I 1024: from m = 128
    # Below m 128 and I 1024 (E 128 I 384 at 1024 tokens, m = 64): stage 1 alone on Gluon, gathering its own rows, on
    # the Triton plan's 64-row blocks before its persistent Triton stage 2
    _, s1, s2 = moe_heuristic(1024, 4096, 384, 128, 8, "per_1x128", gluon=True)
    assert s1.GLUON == 1 and not s1.GATHER_A and (s1.BLOCK_SIZE_M, s1.BLOCK_SIZE_N, s1.num_warps) == (64, 64, 4)
    assert not s2.GLUON and s2.PERSISTENT and s2.SORTED_INTER == 2 and s2.BLOCK_SIZE_M == 64
    assert gluon_problem(s1, "stage1", "per_1x128") is None
    check_plan(s1, s2, "per_1x128")
    assert not moe_heuristic(512, 4096, 384, 128, 8, "per_1x128", gluon=True)[1].GLUON  # from m = 64
    assert not s1.QUANT_OUT  # stage 1 quantizing its own output: 0.96-1.05x the op's time (twenty-eighth session)
    old = heuristics.GLUON_MOE_QUANT_OUT
    heuristics.GLUON_MOE_QUANT_OUT = True
    try:
        for tokens, dims, want in ((1024, (4096, 384, 128, 8), 1), (4096, (2048, 1408, 64, 6), 0)):
            _, q1, q2 = moe_heuristic(tokens, *dims, "per_1x128", gluon=True)
            # one tile a program only: not on the pair's persistent, warp-specialised stage 1
            assert q1.QUANT_OUT == want and not q2.QUANT_OUT, dims
            check_plan(q1, q2, "per_1x128")
    finally:
        heuristics.GLUON_MOE_QUANT_OUT = old
    assert not moe_heuristic(1024, 4096, 384, 128, 8, "per_1x128", gluon=True)[1].WARP_SPEC  # measured slower
    old = heuristics.GLUON_MOE_STAGE1_WS
    heuristics.GLUON_MOE_STAGE1_WS = True  # below I 1024: the own gather in a loader warp group
    try:
        _, g1, g2 = moe_heuristic(1024, 4096, 384, 128, 8, "per_1x128", gluon=True)
        assert (g1.GATHER_A, g1.PERSISTENT, g1.WARP_SPEC, g1.num_stages) == (0, 1, 1, 6) and not g2.GLUON
        check_plan(g1, g2, "per_1x128")
        old_copy = heuristics.GLUON_MOE_COPY_ROWS
        heuristics.GLUON_MOE_COPY_ROWS = False  # the pair's stage 1 gathering its own rows, in its loader
        try:
            _, g1, g2 = moe_heuristic(4096, 4096, 384, 128, 8, "per_1x128", gluon=True)
            assert (g1.BLOCK_SIZE_M, g1.GATHER_A, g1.WARP_SPEC, g2.WARP_SPEC) == (128, 0, 1, 1)
            check_plan(g1, g2, "per_1x128")
        finally:
            heuristics.GLUON_MOE_COPY_ROWS = old_copy
    finally:
        heuristics.GLUON_MOE_STAGE1_WS = old
    # as many stages as fit: stage 2's beside its rows' 16-byte rearrangement (32 KB)
    small = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True, max_shared=190000)
    assert (small[1].num_stages, small[2].num_stages) == (5, 4)
    assert not s1.TOPK_ATOMIC and not s2.TOPK_ATOMIC  # stage 2 adding into the tokens' rows: not yet measured
    old = heuristics.GLUON_MOE_TOPK_ATOMIC
    try:
        for mode, stages_190k in ((1, 5), (2, 4)):  # fp32: no 32 KB row buffer beside the ring; 16-bit: the buffer
            heuristics.GLUON_MOE_TOPK_ATOMIC = mode
            _, a1, a2 = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True)
            assert a1.TOPK_ATOMIC == a2.TOPK_ATOMIC == mode and (a2.WARP_SPEC, a2.num_stages) == (1, 6)
            check_plan(a1, a2, "per_1x128")
            small = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True, max_shared=190000)
            assert small[2].num_stages == stages_190k
            _, d1, d2 = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True, atomics=False)
            assert not d1.TOPK_ATOMIC and not d2.TOPK_ATOMIC  # TRITUNE_DETERMINISTIC
    finally:
        heuristics.GLUON_MOE_TOPK_ATOMIC = old
    old = heuristics.GLUON_MOE_WS2
    heuristics.GLUON_MOE_WS2 = False  # stage 2 persistent, its loads its own
    try:
        _, w1, w2 = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True)
        assert (w2.PERSISTENT, w2.WARP_SPEC, w2.num_stages) == (1, 0, 4) and w1.WARP_SPEC
        check_plan(w1, w2, "per_1x128")
    finally:
        heuristics.GLUON_MOE_WS2 = old
    old = heuristics.GLUON_MOE_WS
    heuristics.GLUON_MOE_WS = False  # the pair's stage 1 as before: one tile a program, its loads its own
    try:
        _, w1, w2 = moe_heuristic(4096, 2048, 1408, 64, 6, "per_1x128", gluon=True)
        assert (w1.PERSISTENT, w1.WARP_SPEC, w1.num_stages) == (0, 0, 4)
        check_plan(w1, w2, "per_1x128")
    finally:
        heuristics.GLUON_MOE_WS = old
    for tokens, dims, kw in ((1024, (2048, 1408, 64, 6), {}),  # m = 96
                             (512, (4096, 384, 128, 8), {}),  # m = 32
                             (4096, (4096, 384, 128, 8), {"capability": (8, 0)}),
                             (4096, (2048, 1408, 64, 6), {"capability": (8, 0)}),
                             (4096, (2048, 1408, 64, 6), {"gluon": False}),
                             (4096, (2048, 1408, 64, 6), {"gated": False}),
                             (4096, (2000, 1408, 64, 6), {}),  # D not a multiple of 128
                             (4096, (2048, 1400, 64, 6), {})):
        _, s1, s2 = moe_heuristic(tokens, *dims, "per_1x128", **{"gluon": True, **kw})
        assert not s1.GLUON and not s2.GLUON, (tokens, dims, kw)
    assert not moe_heuristic(4096, 2048, 1408, 64, 6, "per_token", gluon=True)[1].GLUON


def test_moe_one_stage_only_for_a_handful_of_pairs():
    assert moe_heuristic(4, 2048, 768, 128, 2, "none")[0]  # 8 pairs
    assert not moe_heuristic(5, 2048, 768, 128, 2, "none")[0]  # 10 pairs


def _moe_shape(tokens, dims, quant, dtype="bf16"):
    d, i, e, k = dims
    q = "fp8" if quant != "none" else dtype
    qa, qw = (dtype, "fp4x2") if quant == "per_1x32" else (q, q)  # MXFP4: 16-bit activations, packed fp4 weights
    return FmoeShape(token=tokens, model_dim=d, inter_dim=i, expert=e, topk=k, act_type="silu", dtype=dtype,
                     q_dtype_a=qa, q_dtype_w=qw, q_type=quant, use_g1u1=True, doweight_stage1=False)


MOE_DIMS = [(64, 32, 4, 2),  # test-sized: tiles clipped to the dimensions
            (1024, 512, 8, 2), (4096, 14336, 8, 2),  # Mixtral-like
            (2048, 768, 128, 8), (7168, 2048, 256, 8),  # Qwen3 / DeepSeek-like: many experts, topk 8
            (4096, 96, 60, 4)]  # inter_dim not a power of two, experts not a power of two
TOKENS = (1, 2, 3, 4, 7, 16, 33, 100, 256, 1000, 4096, 16384)


@pytest.mark.parametrize("quant", ["none", "per_token", "per_1x128", "per_1x32"])
@pytest.mark.parametrize("max_shared", [232448, 166912])  # H100; A100-sized shared memory
def test_every_moe_config_passes_check_config_and_the_tuners_rules(quant, max_shared):
    dev = device(max_shared=max_shared)
    for dims, tokens in itertools.product(MOE_DIMS, TOKENS):
        run_1stage, s1, s2 = moe_heuristic(tokens, *dims, quant, max_shared=max_shared)
        shape = _moe_shape(tokens, dims, quant)
        kinds = [("1stage", s1)] if run_1stage else [("stage1", s1), ("stage2", s2)]
        for kind, config in kinds:
            check_config(config, kind, quant)
            params = dataclasses.asdict(config)
            if kind == "1stage":  # every field of a 1-stage config is in its space
                rules = one_stage_constraints(MoeProblem(shape, kind), dev)
            else:
                params.pop("BLOCK_SIZE_D")
                rules = stage_constraints(MoeProblem(shape, kind), dev)
            broken = [r.name for r in rules if not r.ok(Config.from_dict(params))]
            assert not broken, (tokens, dims, quant, kind, config, broken)
        if not run_1stage:
            assert s1.BLOCK_SIZE_M == s2.BLOCK_SIZE_M  # one sort serves both stages


def test_moe_stage_2_runs_persistent_with_the_sorted_intermediate_up_to_its_k_limit():
    """Stage 2 (K = the intermediate size) persistent, its weights through TMA, where the rule table reads the sorted
    intermediate through TMA and K <= 512 (bf16), 1536 (per_token), 768 (per_1x128); never for MXFP4 (no TMA
    there)."""
    def stage2(tokens, inter, quant="none"):
        _, s1, s2 = moe_heuristic(tokens, 4096, inter, 128, 8, quant, gluon=False)  # the Triton rule
        check_plan(s1, s2, quant)
        return s2

    for tokens in (1024, 4096, 8192):  # m = 64, 256, 512 pairs per expert
        s2 = stage2(tokens, 384)
        assert (s2.PERSISTENT, s2.USE_TMA, s2.SORTED_INTER, s2.KSPLIT) == (1, 1, 2, 1)
    assert stage2(4096, 512).PERSISTENT == 1 and stage2(4096, 768).PERSISTENT == 0  # K 768: measured even, not set
    assert stage2(512, 384).PERSISTENT == 0  # m = 32: no sorted intermediate
    for quant in ("per_token", "per_1x128"):
        for tokens in (1024, 8192):
            s2 = stage2(tokens, 384, quant)
            assert (s2.PERSISTENT, s2.USE_TMA, s2.SORTED_INTER, s2.KSPLIT) == (1, 1, 2, 1), (quant, tokens)
        assert stage2(512, 384, quant).PERSISTENT == 0
    # fp8 further than bf16: per_token to K 1536, per_1x128 to 768 (the longest K each was measured to gain at)
    assert [stage2(4096, k, "per_token").PERSISTENT for k in (768, 1536, 1537, 14336)] == [1, 1, 0, 0]
    assert [stage2(4096, k, "per_1x128").PERSISTENT for k in (768, 769, 1408)] == [1, 0, 0]
    assert stage2(4096, 1536, "per_token").SORTED_INTER == 2 and stage2(4096, 1408, "per_1x128").SORTED_INTER == 0
    assert stage2(4096, 384, "per_1x32").PERSISTENT == 0


def test_moe_rejects_bad_input():
    with pytest.raises(ValueError, match="quant"):
        moe_heuristic(16, 4096, 14336, 8, 2, "int8")
    with pytest.raises(ValueError, match="bad fused-MoE shape"):
        moe_heuristic(16, 4096, 14336, 8, 9, "none")


def test_moe_sorted_intermediate_through_tma_from_64_pairs_per_expert_in_16_bit_on_hopper():
    def levers(tokens, inter=14336, quant="none", capability=(9, 0)):
        _, s1, s2 = moe_heuristic(tokens, 4096, inter, 8, 2, quant, capability=capability, gluon=False)
        check_plan(s1, s2, quant)
        return s1.SORTED_INTER, s2.SORTED_INTER

    assert levers(256) == (2, 2)  # m = 64
    assert levers(252) == (0, 0)  # m = 63
    # fp8: only together with the persistent stage 2 (K <= 512), never alone
    assert levers(1024, quant="per_1x128") == (0, 0) and levers(1024, quant="per_token") == (0, 0)
    assert levers(1024, inter=512, quant="per_token") == (2, 2) and levers(1024, inter=512, quant="per_1x128") == (2, 2)
    assert levers(1024, capability=(8, 0)) == (0, 0)  # no TMA
    assert levers(1024, inter=14340) == (0, 0)  # rows of 28680 bytes: not a 16-byte multiple, no descriptor


def test_mxfp4_takes_the_swapped_1_stage_kernel_up_to_8_pairs_an_expert_split_under_1_25_waves():
    """The swapped 1-stage kernel (both GEMMs of a 128-wide slice of the intermediate in one program) beat the stage
    pair on the H100 at 1-64 tokens on four shapes (twenty-first session), its stage 1 split along K (the splits then
    sharing w2's rows) while the programs stay within three an SM (twenty-second session). Only on Hopper with the
    codes' records, and a gated w1's up rows on a record."""
    def one(tokens, dims=(2880, 2880, 128, 4), **kw):
        run_1stage, first, second = moe_heuristic(tokens, *dims, "per_1x32", **kw)
        assert (second is None) == run_1stage
        return first if run_1stage else None

    want = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=3,
                     BLOCK_SIZE_D=128, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)
    split = {k: dataclasses.replace(want, KSPLIT=k) for k in (2, 4, 8)}
    assert one(1) == split[4]  # 4 blocks x 23 slices = 92 programs: 368 split 4, within 3 an SM of 132
    assert one(2) == split[2]  # 184: 368 split 2
    for tokens in (3, 4, 16, 64, 256):  # 276 programs .. 8 pairs an expert
        assert one(tokens) == want, tokens
    for config in (want, *split.values()):
        check_config(config, "1stage", "per_1x32")
    assert one(257) is None  # 9 pairs an expert
    assert one(1, (2048, 1408, 64, 6)) == split[4] and one(2, (2048, 1408, 64, 6)) == split[2]  # 66, 132 programs
    # Qwen3-like: 48, 96, 192 programs; split 8 would leave 2 K steps a split
    assert [one(t, (2048, 768, 128, 8)) for t in (1, 2, 4)] == [split[4], split[4], split[2]]
    assert one(1, (512, 256, 8, 2)) is None  # 2 blocks x 2 slices: 8 splits would not make a wave
    assert one(1, (1024, 1024, 8, 2), sm_count=64) == split[2]  # K 1024: each split 4 steps at least
    assert one(1, (512, 1024, 8, 2), sm_count=64) == want
    assert one(16, capability=(8, 0)) is None  # no TMA
    assert one(16, scale_records=False) is None  # codes only: the stage pair's codes-by-pointer tiles
    assert one(16, one_stage=False) is None
    assert one(16, (2880, 2880 + 32, 128, 4)) is None  # up rows at 2912: not on a record
    assert one(16, (2880, 2880 + 32, 128, 4), gated=False) == want
    assert moe_heuristic(16, 2880, 2880, 128, 4, "per_1x32_a8")[0] is False  # fp8 activations: not swapped


def test_mxfp4_takes_the_swapped_gemm_with_block_m_from_the_pairs_per_expert():
    """MXFP4 with 16-bit activations: SWAP_AB on both stages (H100, gpt-oss-120b: 1.6-1.8x faster than tl.dot_scaled
    at 16-256 tokens); on Hopper the weights and the codes through TMA (SCALE_TMA at BLOCK_K 128), 16-row blocks up
    to 16 pairs an expert on 4 stages, else 64-row blocks with 128 x 128 x 128 tiles on 8 warps (tuned so); split 2
    where the routed experts' tiles would not give 2 programs an SM (4 where each split keeps 4 K steps); 16-row
    blocks take 128-row tiles on 8 warps where that grid fills two waves unsplit (stage 2 since the nineteenth
    session; stage 1, on 3 stages, up to 2 pairs an expert, since the twentieth)."""
    def plan(tokens, dims=(2880, 2880, 128, 4)):  # the stage pair (the 1-stage kernel takes 9-8E pairs: below)
        run_1stage, s1, s2 = moe_heuristic(tokens, *dims, "per_1x32", one_stage=False)
        assert not run_1stage
        check_plan(s1, s2, "per_1x32")
        return [(*tile(c), c.KSPLIT, c.SWAP_AB) for c in (s1, s2)]

    assert plan(1) == [(16, 64, 128, 4, 1)] * 2  # 4 experts x 45 tiles of 64 = 180 programs; K 2880 >= 16 x 128
    assert plan(1, (512, 512, 128, 4)) == [(16, 64, 128, 2, 1)] * 2  # K 512: 4 steps a split at 2 splits, not 4
    for tokens in (16, 64):  # 64+ experts routed x 23 tiles of 128 >= 2 x 132 SMs, up to 2 pairs an expert
        assert plan(tokens) == [(16, 128, 128, 1, 1)] * 2, tokens
        _, s1, s2 = moe_heuristic(tokens, 2880, 2880, 128, 4, "per_1x32", one_stage=False)
        assert s1.num_warps == s2.num_warps == 8, tokens
    assert plan(256) == [(16, 64, 128, 1, 1), (16, 128, 128, 1, 1)]  # 8 pairs an expert: stage 1 on 64 rows
    assert plan(2) == [(16, 64, 128, 1, 1)] * 2  # 8 experts x 23 tiles of 128 = 184 < 264: 64 wide (360 programs)
    assert plan(4) == [(16, 128, 128, 1, 1)] * 2  # 16 x 23 = 368
    assert plan(1024) == plan(4096) == plan(16384) == [(64, 128, 128, 1, 1)] * 2  # past 16 pairs an expert
    for tokens, stages in ((1, (3, 3)), (2, (4, 4)), (64, (3, 4)), (256, (4, 4)), (4096, (3, 4))):
        _, s1, s2 = moe_heuristic(tokens, 2880, 2880, 128, 4, "per_1x32", one_stage=False)
        assert (s1.num_stages, s2.num_stages) == stages and s1.SCALE_TMA == s2.SCALE_TMA == 1, tokens
    _, s1, s2 = moe_heuristic(64, 2880, 2880, 128, 4, "per_1x32", capability=(8, 0))  # no TMA before Hopper
    assert s1.USE_TMA == s1.SCALE_TMA == 0 and tile(s1) == (16, 64, 128)
    _, s1, _ = moe_heuristic(64, 2880, 2880 + 32, 128, 4, "per_1x32")  # up rows at 2912: not on a record
    assert s1.SCALE_TMA == 0 and s1.USE_TMA == 1
    _, _, s2 = moe_heuristic(4096, 2880, 2880, 128, 4, "per_1x32")
    assert s2.num_warps == 8 and s2.USE_TMA == 1  # 128 wide: 16 x num_warps (check_config's race rule)
    assert plan(16, (48, 40, 4, 2)) == [(16, 64, 64, 1, 1)] * 2  # BK clipped to K (48, 40); BN 64 past N
    _, a8, _ = moe_heuristic(16, 2880, 2880, 128, 4, "per_1x32_a8")  # fp8 activations: not measured, bf16 tiles
    assert tile(a8) == (16, 32, 256) and not a8.SWAP_AB


def test_the_block_scaled_k_split_takes_the_split_whose_waves_cost_least(monkeypatch):
    """Off until measured (`GLUON_BLOCKSCALE_SPLIT_K`). On: 1536 x 7168 has 96 tiles of 128x128 at M 1024 (split 4:
    384 units in 3 waves of 14 K blocks), 192 at M 2048 (split 2: 3 waves of 28); at M 4096 the 384 tiles already
    fill 2.9 waves; K 1536 leaves no split 8 K blocks; a grid of 1536 tiles needs none."""
    from tritune.ops import heuristics as h

    def rule(M, N, K):
        return gemm_heuristic("a8w8_blockscale", M, N, K, gluon=True)

    assert rule(1024, 1536, 7168).NUM_KSPLIT == 1 and not h.GLUON_BLOCKSCALE_SPLIT_K
    monkeypatch.setattr(h, "GLUON_BLOCKSCALE_SPLIT_K", True)
    assert [h._blockscale_splits(M, 1536, 7168, 132) for M in (1024, 2048, 4096, 8192)] == [4, 2, 1, 1]
    assert h._blockscale_splits(1024, 1536, 1536, 132) == 1 and h._blockscale_splits(1024, 24576, 7168, 132) == 1
    split = rule(1024, 1536, 7168)
    assert (tile(split), split.num_warps, split.NUM_KSPLIT) == ((128, 128, 128), 8, 4)
    assert split.WARP_SPECIALIZE and split.PERSISTENT_TMA and gk.gluon_problem(split) is None
    assert rule(2048, 1536, 7168).NUM_KSPLIT == 2 and rule(4096, 1536, 7168).NUM_KSPLIT == 1
    narrow = rule(256, 1536, 7168)  # 48 tiles of 64x128: the narrow tile (measured) before any split
    assert narrow.NUM_KSPLIT == 1 and tile(narrow) == (64, 64, 128)
