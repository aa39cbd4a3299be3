"""The GEMM tunable: each pruning rule alone, prune counts, problem keys, inputs, reference, cost, heuristic."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tritune.device import current_device
from tritune.kernels import gemm as gk
from tritune.ops.gemm import heuristic_config
from tritune.tuners.gemm_tunable import DEFAULT_SPACE, GemmProblem, GemmTunable, gemm_constraints
from tritune.tuning.check import check_output, poison
from tritune.tuning.space import SearchSpace
from tritune.tuning.types import Config

DEV = current_device()  # no GPU: an interpreter stand-in with H100 limits (132 SMs, 227 KiB shared memory)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(**changes) -> Config:
    """A config that passes every rule for BIG (below), with `changes` applied; every DEFAULT_SPACE parameter set."""
    params = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3,
                  NUM_KSPLIT=1, cache_modifier="", PERSISTENT_TMA=False, SCALE_PIPELINE=False, TAIL_SPLIT=False,
                  GLUON=False, WARP_SPECIALIZE=False)
    params.update(changes)
    assert set(params) == set(DEFAULT_SPACE)
    return Config.of(**params)


def _failing(problem: GemmProblem, config: Config, dev=DEV) -> list[str]:
    return [c.name for c in gemm_constraints(problem, dev) if not c.ok(config)]


BIG = GemmProblem("bf16", 512, 8192, 4096)  # 4 x 64 tiles of 128x128: the grid already covers 132 SMs
SMALL_M = GemmProblem("bf16", 32, 4096, 4096)
SHORT_K = GemmProblem("bf16", 32, 256, 128)
BLOCKSCALE = GemmProblem("a8w8_blockscale", 512, 8192, 4096)
TAIL = GemmProblem("bf16", 2304, 2048, 4096)  # 18 x 16 = 288 tiles of 128x128: 2 full waves on 132 SMs + 24 tiles
A8W8 = GemmProblem("a8w8", 512, 8192, 4096)
TMA_RULE = "TMA: needs Hopper, 16-byte rows, no split-K"
GLUON_RULE = ("GLUON: Hopper (Gluon API), 16-bit or fp8 operands, 16-byte rows, its tiles, no Triton-kernel option "
              "(bf16 / a8w8: PERSISTENT_TMA on)")

# (rule, problem, config): the config breaks that rule and no other. Each problem and config is a valid point a
# step away, so the test also shows the rule is what separates it from a kept config.
ONE_RULE_EACH = [
    ("WARP_SPECIALIZE: Gluon's, or Triton's block-scaled persistent kernel's (Triton >= 3.5, K >= WS_MIN_K) "
     "without SCALE_PIPELINE", BLOCKSCALE,
     _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, WARP_SPECIALIZE=True)),  # Triton's, but K 4096 < 7168
    ("Triton's warp-specialised block-scaled kernel on 4 warps: only 64-row tiles up to 128 wide",
     GemmProblem("a8w8_blockscale", 1024, 1536, 7168),
     _config(BLOCK_SIZE_K=128, num_warps=4, PERSISTENT_TMA=True, WARP_SPECIALIZE=True)),  # fails to compile
    ("shared memory > device limit", BIG,
     _config(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, num_stages=4)),  # (128+256)*128*2 B*4 stages = 384 KiB
    ("accumulator registers per thread > 128", BIG,
     _config(BLOCK_SIZE_N=256, num_warps=4)),  # 128*256 accumulators / 128 threads = 256
    ("8 warps on a tile under 128x64", BIG, _config(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128)),
    ("BLOCK_SIZE_M above next_pow2(M)", GemmProblem("bf16", 20, 4096, 4096),
     _config(BLOCK_SIZE_M=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4)),  # next_pow2(20) = 32
    ("BLOCK_SIZE_M under 64 for M >= 256", BIG, _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, num_warps=4)),
    ("block-scale needs BLOCK_SIZE_K dividing 128", GemmProblem("a8w8_blockscale", 32, 4096, 4096),
     _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=4)),
    ("BLOCK_SIZE_K x NUM_KSPLIT > K", GemmProblem("bf16", 32, 256, 200),
     _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, NUM_KSPLIT=2)),  # 256 > 200
    ("split-K on a grid that already fills the GPU", BIG, _config(NUM_KSPLIT=2)),  # 256 tiles >= 132 SMs
    # 64 x 256 tiles, 16 in the last wave: TAIL_SPLIT by 8 is allowed, but 8 x 8192 x 32768 partials are not
    ("split-K partials past the kernels' 32-bit offsets", GemmProblem("bf16", 8192, 32768, 4096),
     _config(NUM_KSPLIT=8, TAIL_SPLIT=True)),
    ("TAIL_SPLIT needs split-K on the pointer kernel", TAIL, _config(TAIL_SPLIT=True)),
    ("TAIL_SPLIT only where the last wave is under half full and its splits fit in it", BIG,
     _config(NUM_KSPLIT=2, TAIL_SPLIT=True)),  # 256 tiles: 124 in the last wave of 132
    ("TAIL_SPLIT only where the last wave is under half full and its splits fit in it", TAIL,
     _config(NUM_KSPLIT=8, TAIL_SPLIT=True)),  # 24 tail tiles x 8 splits = 192 programs > 132 SMs
    ("num_stages beyond the K steps", SHORT_K,
     _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)),  # 1 K step + 2 < 4
    ("GROUP_SIZE_M > 1 with one row of tiles", SMALL_M, _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, num_warps=4)),
    (".cg loads only for M <= 32 (weight streaming)", BIG, _config(cache_modifier=".cg")),
    ("BLOCK_SIZE_K 256 only on tiles with BLOCK_SIZE_M <= 32", GemmProblem("a8w8", 64, 4096, 4096),
     _config(BLOCK_SIZE_M=64, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=4)),  # fp8, so the tiles fit
    ("BLOCK_SIZE_K 64 only on tiles of at least 64x128", BIG,
     _config(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4)),
    ("TMA: needs Hopper, 16-byte rows, no split-K", GemmProblem("bf16", 512, 8192, 4100),
     _config(PERSISTENT_TMA=True)),  # 4100 bf16 = 8200-byte rows
    ("TMA: needs Hopper, 16-byte rows, no split-K", GemmProblem("bf16", 512, 8196, 4096),
     _config(PERSISTENT_TMA=True)),  # C rows of 8196 bf16 = 16392 bytes
    ("TMA: needs Hopper, 16-byte rows, no split-K", GemmProblem("a8w8", 512, 8192, 4104),
     _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True)),  # fp8 K=4104: 8-byte but not 16-byte rows
    ("TMA: needs Hopper, 16-byte rows, no split-K", GemmProblem("bf16", 200, 256, 4096),
     _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, NUM_KSPLIT=2)),  # 4 tiles, split-K allowed but not with TMA
    ("TMA with BLOCK_SIZE_M < 64", GemmProblem("bf16", 200, 8192, 4096),
     _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, num_warps=4, PERSISTENT_TMA=True)),
    ("TMA persistent only for M >= 128", GemmProblem("bf16", 64, 8192, 4096),
     _config(BLOCK_SIZE_M=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, PERSISTENT_TMA=True)),
    ("SCALE_PIPELINE needs block-scale, TMA, BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128", BLOCKSCALE,
     _config(BLOCK_SIZE_K=128, SCALE_PIPELINE=True)),  # no TMA
    ("SCALE_PIPELINE needs block-scale, TMA, BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128", BLOCKSCALE,
     _config(BLOCK_SIZE_K=64, PERSISTENT_TMA=True, SCALE_PIPELINE=True)),
    ("SCALE_PIPELINE needs block-scale, TMA, BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128", BLOCKSCALE,
     _config(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, PERSISTENT_TMA=True, SCALE_PIPELINE=True)),
    ("SCALE_PIPELINE needs block-scale, TMA, BLOCK_SIZE_K 128, BLOCK_SIZE_N <= 128", BIG,
     _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, SCALE_PIPELINE=True)),  # bf16 kernel
    (GLUON_RULE, BIG, _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, GLUON=True)),  # bf16: BLOCK_SIZE_K 64
    (GLUON_RULE, BIG, _config(GLUON=True)),  # bf16, PERSISTENT_TMA off: the same persistent kernel again
    (GLUON_RULE, A8W8, _config(BLOCK_SIZE_N=224, BLOCK_SIZE_K=128, PERSISTENT_TMA=True,
                               GLUON=True)),  # 224 = 128 + 96: no two powers of two
    (GLUON_RULE, GemmProblem("bf16", 512, 8192, 4096, dtype="fp32"),
     _config(BLOCK_SIZE_K=32, PERSISTENT_TMA=True, GLUON=True)),  # fp32 operands: no Gluon kernel
    ("BLOCK_SIZE_N not a power of two: the Gluon kernel's only", BIG, _config(BLOCK_SIZE_N=192)),
    (GLUON_RULE, BLOCKSCALE, _config(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GLUON=True)),  # two weight scales a tile
    (GLUON_RULE, BLOCKSCALE, _config(BLOCK_SIZE_M=64, BLOCK_SIZE_K=128, GLUON=True)),  # 64 rows on 8 warps
    (GLUON_RULE, GemmProblem("a8w8_blockscale", 512, 8192, 4104),
     _config(BLOCK_SIZE_K=128, GLUON=True)),  # K 4104: 8-byte fp8 rows
]


@pytest.mark.parametrize(("rule", "problem", "config"), ONE_RULE_EACH, ids=[r[0] for r in ONE_RULE_EACH])
def test_each_rule_prunes_on_its_own(rule: str, problem: GemmProblem, config: Config) -> None:
    assert _failing(problem, config) == [rule]
    result = SearchSpace({k: (v,) for k, v in config.items}, gemm_constraints(problem, DEV)).prune()
    assert result.kept == [] and result.pruned == {rule: 1}


def test_gluon_configs_kept_on_hopper_with_gluon_only() -> None:
    """The Gluon block-scaled kernel's own tiles pass every rule on Hopper where this Triton has Gluon; not before
    Hopper."""
    from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

    for problem, config in (
            (BLOCKSCALE, _config(BLOCK_SIZE_K=128, GLUON=True)),
            (BLOCKSCALE, _config(BLOCK_SIZE_M=64, BLOCK_SIZE_K=128, num_warps=4, num_stages=5, GLUON=True)),
            # its warp-specialised form: a loader warp group feeding the MMA warps, persistent
            (BLOCKSCALE, _config(BLOCK_SIZE_K=128, num_stages=6, PERSISTENT_TMA=True, GLUON=True,
                                 WARP_SPECIALIZE=True)),
            (A8W8, _config(BLOCK_SIZE_K=128, num_stages=4, PERSISTENT_TMA=True, GLUON=True, WARP_SPECIALIZE=True)),
            # the bf16 / a8w8 kernel: 192 wide (two MMAs), and a power of two
            (A8W8, _config(BLOCK_SIZE_M=64, BLOCK_SIZE_N=192, BLOCK_SIZE_K=128, num_warps=4, num_stages=4,
                           PERSISTENT_TMA=True, GLUON=True)),
            (A8W8, _config(BLOCK_SIZE_K=128, num_stages=4, PERSISTENT_TMA=True, GLUON=True)),
            (BIG, _config(BLOCK_SIZE_N=192, PERSISTENT_TMA=True, GLUON=True)),
            (GemmProblem("bf16", 512, 8192, 4096, dtype="fp16"),
             _config(BLOCK_SIZE_M=64, BLOCK_SIZE_N=192, num_warps=4, num_stages=5, PERSISTENT_TMA=True, GLUON=True))):
        assert _failing(problem, config) == ([] if HAS_GLUON_HOPPER else [GLUON_RULE]), (problem, config)
        before_hopper = _failing(problem, config, dataclasses.replace(DEV, capability=(8, 0)))
        assert before_hopper[0] == GLUON_RULE and set(before_hopper[1:]) <= {TMA_RULE}


def test_every_rule_has_a_case() -> None:
    names = {c.name for c in gemm_constraints(BIG, DEV)}
    assert names == {rule for rule, _, _ in ONE_RULE_EACH}


@pytest.mark.parametrize(
    ("problem", "config"),
    [
        (BIG, _config()),
        (BLOCKSCALE, _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, SCALE_PIPELINE=True)),
        (SMALL_M, _config(BLOCK_SIZE_M=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, NUM_KSPLIT=4,
                          cache_modifier=".cg")),  # 32 tiles: split-K and .cg are both allowed
        (TAIL, _config(NUM_KSPLIT=4, TAIL_SPLIT=True)),  # 24 tail tiles x 4 splits = 96 programs in the last wave
    ],
)
def test_neighbours_of_the_cases_are_kept(problem: GemmProblem, config: Config) -> None:
    assert _failing(problem, config) == []


def test_tma_needs_hopper() -> None:
    ampere = dataclasses.replace(DEV, capability=(8, 0))
    config = _config(PERSISTENT_TMA=True)
    assert _failing(BIG, config) == []
    assert _failing(BIG, config, ampere) == ["TMA: needs Hopper, 16-byte rows, no split-K"]


def test_shared_memory_limit_follows_the_device() -> None:
    config = _config()  # (128+128)*64*2 B*3 stages = 96 KiB
    assert _failing(BIG, config, dataclasses.replace(DEV, max_shared_mem=96 * 1024)) == []
    assert _failing(BIG, config, dataclasses.replace(DEV, max_shared_mem=96 * 1024 - 1)) == [
        "shared memory > device limit"]


@pytest.mark.parametrize(
    "problem",
    [
        BIG,
        BLOCKSCALE,
        GemmProblem("a8w8", 1, 4096, 4096),  # decode: split-K and .cg territory
        GemmProblem("bf16", 37, 53, 131, "fp32"),  # odd and tiny
    ],
    ids=lambda p: p.key(),
)
def test_prune_counts_add_up(problem: GemmProblem) -> None:
    space = GemmTunable().space(problem, DEV)  # on a GPU machine DEV is the GPU: the rule table's point joins
    result = space.prune()
    constraints = gemm_constraints(problem, DEV)
    product = set(SearchSpace(space.params).configs())
    outside = [c for c in dict.fromkeys(space.extra) if c not in product]
    assert space.size == math.prod(len(v) for v in DEFAULT_SPACE.values()) + len(outside)
    assert sum(result.pruned.values()) == result.pruned_total == space.size - len(result.kept)
    assert result.kept, "the default space should keep something for every problem"
    assert set(result.pruned) <= {c.name for c in constraints} and all(n > 0 for n in result.pruned.values())
    assert all(c.ok(config) for config in result.kept if config not in space.extra for c in constraints)


def test_space_override() -> None:
    tunable = GemmTunable(space_params=(("NUM_KSPLIT", (1,)), ("PERSISTENT_TMA", (False,))))
    space = tunable.space(BIG, DEV)
    assert space.size == GemmTunable().space(BIG, DEV).size // 8
    assert all(c["NUM_KSPLIT"] == 1 and not c["PERSISTENT_TMA"] for c in space.prune().kept)
    with pytest.raises(ValueError, match=r"unknown search-space parameter\(s\) \['BLOCK_M'\]"):
        GemmTunable(space_params=(("BLOCK_M", (64,)),)).space(BIG, DEV)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kernel="fp4", M=1, N=1, K=1), "unknown GEMM kernel 'fp4'; expected one of bf16, a8w8, a8w8_blockscale"),
        (dict(kernel="bf16", M=0, N=64, K=64), "M, N, K must be >= 1, got M=0 N=64 K=64"),
        (dict(kernel="bf16", M=16, N=64, K=-1), "got M=16 N=64 K=-1"),
        (dict(kernel="bf16", M=16, N=64, K=64, dtype="fp8"), "unknown dtype 'fp8'"),
        (dict(kernel="bf16", M=16, N=64, K=64, out_dtype="fp32"), "unknown out_dtype 'fp32'"),
    ],
)
def test_problem_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        GemmProblem(**kwargs)
    assert message in str(info.value)


def test_problem_key() -> None:
    kernels = {GemmProblem(k, 16, 32, 64).key() for k in gk.KERNELS}
    dtypes = {GemmProblem("bf16", 16, 32, 64, d).key() for d in ("bf16", "fp16", "fp32")}
    assert len(kernels) == 3 and len(dtypes) == 3
    assert GemmProblem("a8w8", 16, 32, 64).key() == "gemm:a8w8:fp8e4m3:M=16:N=32:K=64"
    assert GemmProblem("bf16", 16, 32, 64, "fp16").key() == "gemm:bf16:fp16:M=16:N=32:K=64"
    assert GemmProblem("bf16", 16, 32, 64).key() != GemmProblem("bf16", 16, 64, 32).key()
    assert GemmProblem("a8w8_blockscale", 1, 2, 3).tag == "A8W8_BLOCKSCALE"
    # C's dtype: bf16 keys stay as they were (journals resume), fp16 ones differ; one tag, two file families.
    fp16_out = GemmProblem("a8w8", 16, 32, 64, out_dtype="fp16")
    assert fp16_out.key() == "gemm:a8w8:fp8e4m3:out=fp16:M=16:N=32:K=64" and fp16_out.tag == "A8W8"
    assert GemmProblem("a8w8", 16, 32, 64, out_dtype="bf16").key() == GemmProblem("a8w8", 16, 32, 64).key()
    config = Config.of(BLOCK_SIZE_M=16)
    assert GemmTunable().compile_key(fp16_out, config) != GemmTunable().compile_key(GemmProblem("a8w8", 1, 32, 64),
                                                                                    config)  # C's type is compiled in


PROBLEMS = [GemmProblem("bf16", 37, 53, 131, "fp16"), GemmProblem("bf16", 37, 53, 131, "fp32"),
            GemmProblem("a8w8", 37, 53, 131), GemmProblem("a8w8_blockscale", 37, 129, 259)]
PROBLEM_IDS = ["fp16", "fp32", "a8w8", "a8w8_blockscale"]


def _tensors(inputs: dict) -> list[torch.Tensor]:
    return [inputs[k].float() for k in ("a", "b", "a_scale", "b_scale") if inputs[k] is not None]


@pytest.mark.parametrize("problem", PROBLEMS, ids=PROBLEM_IDS)
def test_make_inputs_is_seeded(problem: GemmProblem) -> None:
    tunable = GemmTunable()
    first, again = tunable.make_inputs(problem, DEVICE, 0), tunable.make_inputs(problem, DEVICE, 0)
    other = tunable.make_inputs(problem, DEVICE, 1)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(first), _tensors(again), strict=True))
    assert not torch.equal(first["a"].float(), other["a"].float())
    assert not torch.equal(first["b"].float(), other["b"].float())
    for t in _tensors(first):
        assert t.abs().max() > 0 and t.isfinite().all()
    if problem.kernel == "bf16":
        assert first["a"].dtype == first["b"].dtype == {"fp16": torch.float16, "fp32": torch.float32}[problem.dtype]
        assert first["a_scale"] is None and first["b_scale"] is None
    else:
        assert first["a"].dtype == first["b"].dtype == torch.float8_e4m3fn
        assert (first["a_scale"] > 0).all() and (first["b_scale"] > 0).all()
    assert first["a"].shape == (problem.M, problem.K) and first["b"].shape == (problem.N, problem.K)
    # Inputs are valid operands of the kernel, scales included.
    gk.validate(problem.kernel, first["a"], first["b"], first["a_scale"], first["b_scale"], gk.GemmConfig())


@pytest.mark.parametrize("problem", PROBLEMS, ids=PROBLEM_IDS)
def test_reference_is_gemm_reference(problem: GemmProblem) -> None:
    tunable = GemmTunable()
    inputs = tunable.make_inputs(problem, DEVICE, 3)
    ref = tunable.reference(problem, inputs)
    assert ref.dtype == torch.float32 and ref.shape == (problem.M, problem.N)
    assert torch.equal(ref, gk.gemm_reference(problem.kernel, inputs["a"], inputs["b"], inputs["a_scale"],
                                              inputs["b_scale"]))
    # B is scaled by 1/sqrt(K): C is about N(0, 1) whatever K, so the tolerances mean the same at every shape.
    assert 0.5 < ref.std().item() < 2.0


def test_flops_and_bytes_moved() -> None:
    tunable = GemmTunable()
    M, N, K = 37, 300, 259
    assert tunable.flops(GemmProblem("bf16", M, N, K)) == 2 * 37 * 300 * 259 == 5_749_800
    # A and B once at the operand width, C once in bf16, scales in fp32.
    assert tunable.bytes_moved(GemmProblem("bf16", M, N, K)) == 2 * (37 * 259 + 300 * 259) + 2 * 37 * 300 == 196_766
    assert tunable.bytes_moved(GemmProblem("bf16", M, N, K, "fp32")) == 4 * 87_283 + 22_200 == 371_332
    assert tunable.bytes_moved(GemmProblem("a8w8", M, N, K)) == 87_283 + 22_200 + 4 * (37 + 300) == 110_831
    # Block scales: A 37 x ceil(259/128)=3, B ceil(300/128)=3 x 3.
    assert tunable.bytes_moved(GemmProblem("a8w8_blockscale", M, N, K)) == 87_283 + 22_200 + 4 * (111 + 9) == 109_963


@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_launcher_runs_kept_configs(out_dtype: str) -> None:
    # A few configs the default space keeps for an odd shape, through the tunable's own launcher and gate.
    problem = GemmProblem("bf16", 37, 53, 131, "fp16", out_dtype)
    tunable = GemmTunable()
    kept = tunable.space(problem, DEV).prune().kept
    picks = {(c["NUM_KSPLIT"], c["BLOCK_SIZE_K"]): c for c in kept}
    assert {1, 2} <= {split for split, _ in picks}
    inputs = tunable.make_inputs(problem, DEVICE, 0)
    ref = tunable.reference(problem, inputs)
    for config in picks.values():
        out = tunable.alloc_output(problem, inputs)
        assert out.dtype == gk.OUT_DTYPES[out_dtype]
        poison(out)
        tunable.launcher(problem, inputs, config, out)()
        result = check_output(out, ref, tunable.tolerance(problem))
        assert result.passed, f"{config}: {result.reason}"


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (1, 53, 131),  # M <= 16 tile; K under BLOCK_SIZE_K 256 (128 block-scaled)
        (1, 53, 1031),  # one tile, K >= 4 * BLOCK_SIZE_K: split-K with an odd K
        (37, 129, 259),  # M <= 64 tile; N crosses a scale block
        (100, 53, 131),  # M <= 256 tile, GROUP_SIZE_M 8 with two row tiles
        (300, 17, 131),  # the large tile, mostly padding
    ],
)
@pytest.mark.parametrize("kernel", gk.KERNELS)
def test_heuristic_config_validates_and_runs(kernel: str, M: int, N: int, K: int) -> None:
    cfg = heuristic_config(kernel, M, N, K, DEV.sm_count)
    problem = GemmProblem(kernel, M, N, K, "fp16")
    tunable = GemmTunable()
    inputs = tunable.make_inputs(problem, DEVICE, 0)
    gk.validate(kernel, inputs["a"], inputs["b"], inputs["a_scale"], inputs["b_scale"], cfg)
    out = torch.full((M, N), math.nan, device=DEVICE, dtype=torch.float32)
    gk.gemm(kernel, inputs["a"], inputs["b"], cfg, a_scale=inputs["a_scale"], b_scale=inputs["b_scale"], out=out)
    assert not out.isnan().any()
    # C is about N(0, 1). On a GPU, Hopper's fp8 MMA keeps fewer accumulator bits than fp32 (errors near 2e-3 seen
    # with BLOCK_SIZE_K 128); the interpreter accumulates in fp32.
    tol = 5e-3 if DEVICE == "cuda" else 1e-4
    torch.testing.assert_close(out, tunable.reference(problem, inputs), rtol=tol, atol=tol)


def test_heuristic_split_k() -> None:
    # The op's fallback is the rule table (pinned row by row in tests/test_heuristics.py): split-K only when the grid
    # cannot fill the SMs and K is long.
    assert heuristic_config("bf16", 1, 4096, 14336).NUM_KSPLIT == 4  # 64 tiles of 16x64, K 14336
    assert heuristic_config("bf16", 1, 4096, 4096).NUM_KSPLIT == 1  # K too short to pay a second launch
    assert heuristic_config("bf16", 1, 53, 1031).NUM_KSPLIT == 1  # one tile, but K 1031 is short
    assert heuristic_config("bf16", 4096, 4096, 4096).NUM_KSPLIT == 1  # the grid fills the SMs


@pytest.mark.parametrize(("kernel", "m", "n", "k"), [
    ("bf16", 1000, 6144, 4096),
    ("a8w8_blockscale", 4096, 24576, 7168),  # the rule's warp-specialised tile: no default-space value has it
    ("a8w8", 1, 2112, 7168),  # the rule's BLOCK_SIZE_N 32: not a default-space value
])
def test_the_rule_tables_config_is_always_measured(kernel, m, n, k) -> None:
    """On a GPU the space holds the op's untuned choice whatever the constraints say (`SearchSpace.extra`), so a
    tuned shape is never one the op beats untuned; not under the interpreter, and not with --search-space."""
    from tritune.tuners.gemm_tunable import config_of

    gpu = dataclasses.replace(DEV, interpreter=False)
    problem = GemmProblem(kernel, m, n, k)
    (point,) = GemmTunable().space(problem, gpu).extra
    assert config_of(point) == heuristic_config(kernel, m, n, k, gpu.sm_count)
    assert point in GemmTunable().space(problem, gpu).prune().kept
    assert GemmTunable().space(problem, DEV).extra == ()
    assert GemmTunable(space_params=(("num_stages", (3,)),)).space(problem, gpu).extra == ()


def test_the_gluon_k_split_joins_the_space_only_when_switched_on(monkeypatch):
    """The warp-specialised Gluon GEMM with K split (unmeasured, GLUON_SPLIT_IN_SPACE off) is kept out by the TMA rule;
    switched on it is kept where the grid is under a wave and every split holds a K block, and not otherwise."""
    from tritune.tuners import gemm_tunable

    problem = GemmProblem("a8w8_blockscale", 1024, 1536, 7168)  # 96 tiles of 128x128
    split = _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, WARP_SPECIALIZE=True, GLUON=True, NUM_KSPLIT=4,
                    num_stages=4)
    assert _failing(problem, split) == [TMA_RULE]
    monkeypatch.setattr(gemm_tunable, "GLUON_SPLIT_IN_SPACE", True)
    assert _failing(problem, split) == []
    assert TMA_RULE in _failing(GemmProblem("a8w8_blockscale", 1024, 1536, 384), split)  # 3 K blocks, 4 splits
    assert "split-K on a grid that already fills the GPU" in _failing(GemmProblem("a8w8_blockscale", 4096, 1536,
                                                                                  7168), split)
    assert _failing(problem, _config(BLOCK_SIZE_K=128, PERSISTENT_TMA=True, NUM_KSPLIT=4, num_stages=4)) == [TMA_RULE]
