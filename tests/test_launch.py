"""The ops' launch cache: a repeated call binds nothing new; a call differing in anything the kernels were
specialized on (shape class, stride, dtype, alignment) binds afresh and is still right; the launches and
allocations one call makes are pinned (plan-level levers included); no launch reads scratch nobody wrote; and
compile_only builds what the op binds. Runs under Triton's interpreter (fp16: bf16 tl.dot is wrong there)."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
import triton

from tritune.kernels import gemm as gk
from tritune.kernels.fused_moe import PLAN_FIELDS, MoeConfig
from tritune.kernels.fused_moe_config import warp_spec_compiles
from tritune.kernels.launch import Workspace, launch_counts, reset_launch_counts
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.knobs import interpreting
from tritune.ops.fused_moe import MoeChoice, fused_moe, reload_moe_configs
from tritune.ops.gemm import gemm, gemm_a8w8
from tritune.ops.routing import sample_routing

ops_gemm = importlib.import_module("tritune.ops.gemm")  # the module (tritune.ops.gemm is the op)
ops_moe = importlib.import_module("tritune.ops.fused_moe")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CFG = gk.GemmConfig(32, 32, 32, 1, 4, 2)
# Scratch allocations per call after the first: one under the interpreter; none on a GPU, where the buffer of the
# first call is kept per (device, stream, thread) and reused.
SCRATCH_ALLOC = [] if DEV.type == "cuda" else ["tritune.kernels.launch:empty"]


@pytest.fixture
def binds(monkeypatch):
    """Counts GemmLaunch / MoeLaunch constructions (each is one binding of an op's launches)."""
    made = {"gemm": 0, "moe": 0}
    real_gemm, real_moe = gk.GemmLaunch, ops_moe.MoeLaunch

    def gemm_launch(*a, **kw):
        made["gemm"] += 1
        return real_gemm(*a, **kw)

    def moe_launch(*a, **kw):
        made["moe"] += 1
        return real_moe(*a, **kw)

    monkeypatch.setattr(gk, "GemmLaunch", gemm_launch)
    monkeypatch.setattr(ops_moe, "MoeLaunch", moe_launch)
    ops_gemm._PLANS.clear()
    ops_moe._PLANS.clear()
    yield made
    ops_gemm._PLANS.clear()
    ops_moe._PLANS.clear()


def operands(M: int, N: int, K: int, dtype=torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(DEV, dtype)
    b = (torch.randn(N, K, generator=g) / K**0.5).to(DEV, dtype)
    return a, b


def check(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), gk.gemm_reference("bf16", a, b), atol=2e-2, rtol=2e-2)


def test_repeated_gemm_call_binds_once(binds):
    a, b = operands(17, 40, 48)
    for _ in range(3):
        check(gemm(a, b, config=CFG), a, b)
    assert binds["gemm"] == 1
    a2, b2 = operands(17, 40, 48, seed=1)  # new tensors, same signature: no new binding
    check(gemm(a2, b2, config=CFG), a2, b2)
    assert binds["gemm"] == 1


@pytest.mark.parametrize("change", [
    "shape",  # M changes the grid (and N, K the specialization)
    "dtype",  # fp32 operands compile another kernel
    "row stride",  # A as a slice of a wider tensor: another stride_am
    "alignment",  # A starting 2 bytes into its storage: Triton specialized on 16-byte alignment
    "out given",  # an out= tensor instead of a fresh one
    "config",  # an explicit other config
])
def test_changed_signature_binds_afresh_and_is_right(binds, change):
    a, b = operands(17, 40, 48)
    check(gemm(a, b, config=CFG), a, b)
    assert binds["gemm"] == 1
    out, cfg = None, CFG
    if change == "shape":
        a, b = operands(33, 24, 48)
    elif change == "dtype":
        a, b = operands(17, 40, 48, torch.float32)
    elif change == "row stride":
        a = torch.cat([a, a], dim=1)[:, :48]
        assert a.stride(0) == 96
    elif change == "alignment":
        a = torch.cat([torch.zeros(1, device=DEV, dtype=a.dtype), a.reshape(-1)])[1:].view(17, 48)
        assert a.data_ptr() % 16 != 0
    elif change == "out given":
        out = torch.empty(17, 40, device=DEV, dtype=torch.bfloat16)
    else:
        cfg = gk.GemmConfig(16, 32, 16, 1, 4, 2)
    result = gemm(a, b, config=cfg, out=out)
    assert binds["gemm"] == 2
    check(result, a, b)
    assert out is None or result is out
    gemm(a, b, config=cfg, out=out)
    assert binds["gemm"] == 2  # and the new signature is cached in turn


def test_fp8_scales_are_part_of_the_signature(binds):
    from tritune.kernels.quant import quantize_rows

    a, b = operands(9, 24, 64, torch.float32)
    (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
    out1 = gemm_a8w8(qa, qb, sa, sb, config=CFG)
    out2 = gemm_a8w8(qa, qb, sa.reshape(-1, 1), sb, config=CFG)  # [M, 1] scales: another shape, a new binding
    assert binds["gemm"] == 2
    torch.testing.assert_close(out1, out2)


def test_tensors_on_two_devices_are_refused():
    a, b = operands(4, 8, 16)
    with pytest.raises(ValueError, match="device"):
        ops_gemm._plan("bf16", a, b, None, None, torch.empty(4, 8, dtype=torch.bfloat16, device="meta"), CFG)


# ---------------------------------------------------------------------------------------------------- fused MoE
T, D, INTER, E, TOPK = 5, 40, 24, 4, 2
S = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
LEVERS = {"SORTED_INTER": 2, "TOPK_ATOMIC": 1}  # the sorted intermediate through TMA, the top-k sum in stage 2
SL = dataclasses.replace(S, **LEVERS)
SL_KS2 = dataclasses.replace(SL, KSPLIT=2, SORTED_INTER=1)  # split-K, pointer loads of the sorted rows
SL1 = dataclasses.replace(SL, SORTED_INTER=1)  # pointer loads of the sorted rows


def moe_problem(quant: str = "none", tokens: int = T, seed: int = 0, dims: tuple[int, int] = (D, INTER)) -> dict:
    from tritune.kernels.fused_moe import quantize_weights

    d, inter = dims
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, d, generator=g).to(DEV, torch.float16)
    w1 = torch.randn(E, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(E, d, inter, generator=g) / inter**0.5
    if quant == "none":
        (w1, s1), (w2, s2) = (w1.to(DEV, torch.float16), None), (w2.to(DEV, torch.float16), None)
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1.to(DEV), quant), quantize_weights(w2.to(DEV), quant)
    weights, ids = sample_routing(tokens, E, TOPK, seed=seed, device=DEV)
    return {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids, "w1_scale": s1,
            "w2_scale": s2}


def call(x: dict, choice: MoeChoice, quant: str = "none") -> torch.Tensor:
    return fused_moe(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=quant,
                     w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice)


@pytest.fixture
def counted(monkeypatch):
    """(launch counts, allocations made by tritune's own code) of the calls inside the `with` block."""
    allocs = []
    real = {name: getattr(torch, name) for name in ("empty", "zeros", "empty_like", "zeros_like")}

    def spy(name):
        def alloc(*a, **kw):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("tritune."):
                allocs.append(f"{caller}:{name}")
            return real[name](*a, **kw)
        return alloc

    for name in real:
        monkeypatch.setattr(torch, name, spy(name))

    class Counter:
        def __enter__(self):
            allocs.clear()
            reset_launch_counts(counting=True)
            return self

        def __exit__(self, *exc):
            self.launches = launch_counts()
            self.allocs = list(allocs)
            reset_launch_counts(counting=False)

    return Counter


@pytest.mark.parametrize(("quant", "choice", "tokens", "launches"), [
    # 2-stage, 10 pairs: one-launch sort, stage 1, stage 2, top-k sum
    ("none", MoeChoice(False, S, S, ""), T, {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2,
                                              "_topk_sum_kernel": 1}),
    # 2-stage, 200 pairs: count (first launch) + scatter that scans for itself
    ("none", MoeChoice(False, S, S, ""), 100, {"_moe_align_first_kernel": 1, "_moe_scatter_kernel": 1,
                                                "_moe_gemm_kernel": 2, "_topk_sum_kernel": 1}),
    # fp8: the activations are quantized in the sort's launch, the intermediate by its own launch (its fusion into
    # the GEMMs is off: FUSE_INTERMEDIATE_QUANT, measured slower)
    ("per_1x128", MoeChoice(False, S, S, ""), T, {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2,
                                                   "_quant_fp8_kernel": 1, "_topk_sum_kernel": 1}),
    ("per_token", MoeChoice(False, S, S, ""), T, {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2,
                                                   "_quant_fp8_kernel": 1, "_topk_sum_kernel": 1}),
    # fp8 with a split-K stage 1 (no epilogue to record the amax): the intermediate by its own launch
    ("per_1x128", MoeChoice(False, MoeConfig(16, 32, 32, 1, 4, 2, KSPLIT=2), S, ""), T,
     {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2, "_stage1_finish_kernel": 1, "_quant_fp8_kernel": 1,
      "_topk_sum_kernel": 1}),
    # 1-stage: the accumulator is zeroed in the sort's launch, then the kernel and the cast
    ("none", MoeChoice(True, MoeConfig(16, 32, 32, 1, 4, 2, BLOCK_SIZE_D=32), None, ""), T,
     {"_moe_align_first_kernel": 1, "_moe_1stage_kernel": 1, "_acc_to_out_kernel": 1}),
    # levers: stage 2 adds into an fp32 accumulator the sort's launch zeroes; its cast replaces the top-k sum
    ("none", MoeChoice(False, SL, SL, ""), T, {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2,
                                                "_acc_to_out_kernel": 1}),
    # (fp8 A rows of INTER = 24 bytes are no TMA rows: the sorted intermediate by pointer loads)
    ("per_1x128", MoeChoice(False, SL1, SL1, ""), 100, {"_moe_align_first_kernel": 1, "_moe_scatter_kernel": 1,
                                                         "_moe_gemm_kernel": 2, "_quant_fp8_kernel": 1,
                                                         "_acc_to_out_kernel": 1}),
    # levers behind a split stage 1: its finish and the intermediate's quantization run over the sorted rows
    ("per_token", MoeChoice(False, SL_KS2, SL_KS2, ""), T,
     {"_moe_align_first_kernel": 1, "_moe_gemm_kernel": 2, "_stage1_finish_kernel": 1, "_quant_fp8_kernel": 1,
      "_acc_to_out_kernel": 1}),
])
def test_fused_moe_launches_and_allocations_per_call(binds, counted, quant, choice, tokens, launches):
    x = moe_problem(quant, tokens)
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=quant,
                              w1_scale=x["w1_scale"], w2_scale=x["w2_scale"],
                              requantize_intermediate=not choice.run_1stage)
    first = call(x, choice, quant)  # binds
    with counted() as c:
        again = call(x, choice, quant)
    assert binds["moe"] == 1
    assert c.launches == launches
    # The output, and one scratch buffer under the interpreter (on a GPU it is kept per stream: no allocation).
    assert sorted(c.allocs) == sorted(["tritune.ops.fused_moe:empty", *SCRATCH_ALLOC])
    # Atomic sums (1-stage, TOPK_ATOMIC) repeat only up to their order of addition on a GPU.
    atomic = choice.run_1stage or choice.stage2.TOPK_ATOMIC
    torch.testing.assert_close(again, first, rtol=0, atol=2e-3 if atomic else 0)
    err = float((again.float() - ref).norm() / ref.norm())
    assert err < 2e-2


@pytest.mark.parametrize("kind", ["2-stage", "1-stage", "sorted"])
def test_few_pairs_among_many_experts_launch_only_the_blocks_that_can_fill(monkeypatch, kind):
    """1 token on 2 of 16 experts: the padded sort has 16 blocks of 16 rows, 2 hold pairs; the GEMM grids cover
    moe_align.gemm_blocks = 3 of them, a sorted intermediate has their 48 rows (not the padded 242), and the result
    is the reference's."""
    from tritune.kernels.moe_align import gemm_blocks, sorted_rows

    monkeypatch.setattr(sys.modules[__name__], "E", 16)
    x = moe_problem("none", tokens=1, seed=3)
    run_1stage = kind == "1-stage"
    cfg = SL if kind == "sorted" else S
    choice = MoeChoice(True, MoeConfig(16, 16, 32, 1, 4, 2, BLOCK_SIZE_D=32), None, "") if run_1stage else \
        MoeChoice(False, cfg, cfg, "")
    out = call(x, choice)
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"],
                              requantize_intermediate=False)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    plan = list(ops_moe._PLANS.values())[-1]
    assert plan.align.num_blocks == 16 and plan.align.gemm_blocks == gemm_blocks(2, 16, 16) == 3
    gemm_grids = [b.grid for b, _ in plan.getters if b.name in ("_moe_gemm_kernel", "_moe_1stage_kernel")]
    tiles = [-(-INTER // 16)] if run_1stage else [-(-INTER // cfg.BLOCK_SIZE_N), -(-D // cfg.BLOCK_SIZE_N)]
    assert [g[0] for g in gemm_grids] == [3 * n for n in tiles]
    if kind == "sorted":
        assert plan.inter_rows == sorted_rows(2, 16, 16) == 48


@pytest.mark.parametrize(("quant", "tokens", "cfg"), [
    ("none", T, MoeConfig(16, 32, 32, 1, 4, 2, BLOCK_SIZE_D=32)),  # INTER 24 in one slice: TOPK contributions
    ("none", 1, MoeConfig(16, 16, 32, 1, 4, 2, BLOCK_SIZE_D=16)),  # two slices of INTER, D 40 in three blocks
    ("per_token", 9, MoeConfig(32, 16, 32, 1, 4, 2, BLOCK_SIZE_D=64)),
    ("per_1x128", T, MoeConfig(16, 16, 32, 1, 4, 2, BLOCK_SIZE_D=32)),
])
def test_1stage_cast_in_the_kernel_drops_the_cast_launch(monkeypatch, request, binds, counted, quant, tokens, cfg):
    """FINAL_CAST_IN_KERNEL: the last program to add to a token writes its row in the output dtype; 2 launches, the
    same result as the cast launch (the same fp32 sums), and a second call right too (the sort zeroes the counts)."""
    request.addfinalizer(reload_moe_configs)  # no plan bound with the patched flag outlives the test
    from tritune.kernels import fused_moe_1stage

    x = moe_problem(quant, tokens)
    choice = MoeChoice(True, cfg, None, "")
    with_launch = call(x, choice, quant)
    reload_moe_configs()
    monkeypatch.setattr(fused_moe_1stage, "FINAL_CAST_IN_KERNEL", True)
    first = call(x, choice, quant)
    with counted() as c:
        again = call(x, choice, quant)
    assert c.launches == {"_moe_align_first_kernel": 1, "_moe_1stage_kernel": 1}
    torch.testing.assert_close(first, with_launch, rtol=0, atol=2e-3)  # atomics: equal up to the order of adds
    torch.testing.assert_close(again, first, rtol=0, atol=2e-3)
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=quant,
                              w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], requantize_intermediate=False)
    assert float((again.float() - ref).norm() / ref.norm()) < 3e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: programs racing on the counts across SMs")
def test_1stage_cast_in_the_kernel_under_load_on_the_gpu(monkeypatch, request):
    """Many programs on every SM adding to the same rows (200 tokens, 2 x 16 contributions each): 20 calls in a row,
    each equal to the cast launch's result up to the order of the fp32 adds."""
    request.addfinalizer(reload_moe_configs)
    from tritune.kernels import fused_moe_1stage

    x = moe_problem("none", 200, dims=(512, 256))
    choice = MoeChoice(True, MoeConfig(16, 16, 64, 1, 4, 2, BLOCK_SIZE_D=128), None, "")
    want = call(x, choice).float()
    reload_moe_configs()
    monkeypatch.setattr(fused_moe_1stage, "FINAL_CAST_IN_KERNEL", True)
    for _ in range(20):
        torch.testing.assert_close(call(x, choice).float(), want, rtol=0, atol=2e-2)


# The quantization launch of a sorted intermediate also covers its rows past the padded count, which nothing wrote
# (random in the interpreter's fresh scratch) and nothing reads: numpy may warn while dividing them.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("quant", "inter", "bn1", "levers"), [
    ("per_token", INTER, 32, {}),  # one amax per pair, several N tiles of stage 1 max-reduce into it
    ("per_1x128", INTER, 32, {}),  # one 1x128 group, masked past inter_dim
    ("per_1x128", 136, 32, {}),  # two groups, the second 8 columns wide; BLOCK_N 32 < 128: 4 tiles per group
    ("per_1x128", 136, 256, {}),  # BLOCK_N 256 > 128: each tile reduces two groups at once, the second masked
    ("per_token", 48, 32, LEVERS),  # amax per sorted row; the quantization launch over the sorted rows, TMA for both
    ("per_1x128", 136, 256, {"SORTED_INTER": 1}),  # fp8 rows of 136 bytes: pointer loads
])
def test_fp8_intermediate_quantized_inside_the_gemms_equals_its_own_launch(monkeypatch, request, quant, inter, bn1,
                                                                            levers):
    """Stage 1's amax and stage 2's quantize-on-load give the quantization launch's fp8 values and scales, so the
    result is the same bit for bit (the fusion is off by default: FUSE_INTERMEDIATE_QUANT)."""
    request.addfinalizer(reload_moe_configs)  # no plan bound with the patched threshold outlives the test
    from tritune.kernels import fused_moe_launch

    monkeypatch.setattr(fused_moe_launch, "FUSE_INTERMEDIATE_QUANT", True)
    from tritune.kernels.fused_moe import quantize_weights

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, D, generator=g).to(DEV, torch.float16)
    (w1, s1) = quantize_weights((torch.randn(E, 2 * inter, D, generator=g) / D**0.5).to(DEV), quant)
    (w2, s2) = quantize_weights((torch.randn(E, D, inter, generator=g) / inter**0.5).to(DEV), quant)
    weights, ids = sample_routing(T, E, TOPK, seed=3, device=DEV)
    x = {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids, "w1_scale": s1,
         "w2_scale": s2}
    choice = MoeChoice(False, dataclasses.replace(S, BLOCK_SIZE_N=bn1, **levers), dataclasses.replace(S, **levers), "")
    reset_launch_counts(counting=True)
    fused = call(x, choice, quant)
    assert "_quant_fp8_kernel" not in launch_counts()
    monkeypatch.setattr(fused_moe_launch, "FUSE_INTERMEDIATE_QUANT", False)
    reload_moe_configs()
    reset_launch_counts(counting=True)
    separate = call(x, choice, quant)
    assert launch_counts()["_quant_fp8_kernel"] == 1
    reset_launch_counts(counting=False)
    torch.testing.assert_close(fused, separate, rtol=0, atol=2e-3 if levers.get("TOPK_ATOMIC") else 0)
    ref = fused_moe_reference(hidden, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2)
    assert float((fused.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize(("quant", "cfg1", "cfg2"), [
    ("none", S, S),  # the plain plan reads nothing unwritten either
    ("none", SL, SL),  # a sorted intermediate: padding rows written as zeros, rows past the padded count never read
    ("per_token", SL, SL),  # the amax and the top-k accumulator: both zeroed by the sort's first launch
    ("per_token", SL_KS2, SL_KS2),  # the finish and the quantization launch over every sorted row
])
def test_scratch_poisoned_with_nan_is_never_read_unwritten(monkeypatch, quant, cfg1, cfg2):
    """Every scratch byte starts as 0xFF (NaN in fp32, fp16 and e4m3): the output is still right, and a sorted
    intermediate holds each pair's stage-1 row at its position in sorted_token_ids and zeros in padding rows. The
    intermediate's fp8 quantization fused into the GEMMs (off by default) is on: it has the most scratch."""
    from tritune.kernels import fused_moe_launch
    from tritune.kernels.fused_moe_launch import MoeLaunch

    monkeypatch.setattr(fused_moe_launch, "FUSE_INTERMEDIATE_QUANT", True)
    from tritune.kernels.moe_reference import stage1_reference

    real, seen = Workspace.allocate, {}

    def poisoned(self, device):
        buffer, pieces = real(self, device)
        buffer.fill_(255)
        seen["pieces"] = pieces
        return buffer, pieces

    monkeypatch.setattr(Workspace, "allocate", poisoned)
    tokens = 40  # 80 pairs over 4 experts: the sort's count and scatter launches, partial blocks per expert
    x = moe_problem(quant, tokens)
    args = (x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], x["w1_scale"], x["w2_scale"])
    launch = MoeLaunch(*args, stage1=cfg1, stage2=cfg2, quant=quant)
    out = launch(*args, torch.full((tokens, D), float("nan"), device=DEV, dtype=torch.float16))
    ref = fused_moe_reference(*args[:5], quant=quant, w1_scale=x["w1_scale"], w2_scale=x["w2_scale"])
    assert out.isfinite().all() and float((out.float() - ref).norm() / ref.norm()) < 2e-2
    pieces = seen["pieces"]
    if not cfg1.SORTED_INTER or not isinstance(pieces[0], torch.Tensor):
        return  # on a GPU the pieces are addresses
    numel, post = tokens * TOPK, int(pieces[2][0])
    assert launch.inter_rows == numel + E * (S.BLOCK_SIZE_M - 1)  # the sort's padded length
    pairs = pieces[0][:post].long()
    real_rows = pairs < numel
    inter = pieces[launch.inter_piece].view(launch.inter_rows, INTER)[:post].float()
    expected = stage1_reference(x["hidden"], x["w1"], x["topk_weights"], x["topk_ids"], inter_dim=INTER, quant=quant,
                                w1_scale=x["w1_scale"])
    torch.testing.assert_close(inter[real_rows], expected[pairs[real_rows]], rtol=2e-2, atol=2e-2)
    assert (~real_rows).any() and (inter[~real_rows] == 0).all()


def _bound_and_compiled(monkeypatch, kernel_fn, quant: str, dims: tuple[int, int], stage1: MoeConfig,
                        stage2: MoeConfig | None, kernel: str, cfg: MoeConfig) -> tuple[list[dict], list[dict]]:
    """The arguments `kernel_fn` gets (by name) from a MoeLaunch of (stage1, stage2) on a 40-token problem of `dims`
    (model_dim, inter_dim), and from compile_only(kernel, ..., cfg): what the op binds and what the pool compiles."""
    import inspect

    from tritune.kernels import fused_moe_launch
    from tritune.kernels.fused_moe_compile import MoeDims, compile_only
    from tritune.kernels.pdl import plan_pdl

    signature = inspect.signature(kernel_fn.fn)
    bound, compiled, real = [], [], fused_moe_launch.BoundKernel

    def record(fn, grid, args, **kw):
        if fn is kernel_fn:
            bound.append(signature.bind(*args).arguments)
        return real(fn, grid, args, **kw)

    def warmup(*args, grid, num_warps, num_stages, launch_pdl=False, **kw):  # launch options are not arguments
        compiled.append(signature.bind(*args, **kw).arguments)

    monkeypatch.setattr(fused_moe_launch, "BoundKernel", record)
    x = moe_problem(quant, tokens=40, dims=dims)
    fused_moe_launch.MoeLaunch(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], x["w1_scale"],
                               x["w2_scale"], stage1=stage1, stage2=stage2, quant=quant)
    # Only now: on a GPU, BoundKernel itself compiles through the real warmup.
    monkeypatch.setattr(kernel_fn, "warmup", warmup, raising=False)
    pdl = x["hidden"].is_cuda and plan_pdl(torch.cuda.get_device_capability(x["hidden"].device)[0])  # as the plan
    compile_only(kernel, MoeDims(40, TOPK, E, *dims, dtype=torch.float16, quant=quant), cfg, pdl=pdl)
    return bound, compiled


def _specialization(arguments: dict) -> dict:
    """Each argument as Triton specializes on it: descriptors by dtype, shape and block; pointers by dtype."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = {}
    for name, v in arguments.items():
        if isinstance(v, TensorDescriptor):
            out[name] = ("descriptor", v.base.dtype, list(v.shape), list(v.block_shape))
        else:
            out[name] = v if not name.endswith(("_ptr", "_desc")) or isinstance(v, torch.dtype) else v.dtype
    return out


def _refuses_warp_spec(quant: str, dims: tuple[int, int], stage1: MoeConfig, stage2: MoeConfig, kernel: str,
                       cfg: MoeConfig) -> None:
    """Where this Triton cannot build WARP_SPEC for the GPU, the op and compile_only both say so in one line."""
    from tritune.kernels import fused_moe_launch
    from tritune.kernels.fused_moe_compile import MoeDims, compile_only

    x = moe_problem(quant, tokens=40, dims=dims)
    with pytest.raises(ValueError, match="WARP_SPEC needs a Triton newer than 3.6"):
        fused_moe_launch.MoeLaunch(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], x["w1_scale"],
                                   x["w2_scale"], stage1=stage1, stage2=stage2, quant=quant)
    with pytest.raises(ValueError, match="WARP_SPEC needs a Triton newer than 3.6"):
        compile_only(kernel, MoeDims(40, TOPK, E, *dims, dtype=torch.float16, quant=quant), cfg)


@pytest.mark.parametrize(("kernel", "cfg", "quant"), [
    ("stage1", S, "none"),
    ("stage1", dataclasses.replace(S, SORTED_INTER=1), "none"),  # rows stored in the sort's order
    ("stage1", dataclasses.replace(SL, KSPLIT=2), "none"),  # partials of [KSPLIT, padded rows, 2I]
    ("stage2", S, "none"),
    ("stage2", SL, "none"),  # A descriptor over the sorted rows, fp32 accumulator target
    ("stage2", SL_KS2, "none"),  # split-K adding atomically
    ("stage2", dataclasses.replace(S, KSPLIT=2, SORTED_INTER=1), "none"),  # split-K partials by pair
    ("stage1", dataclasses.replace(S, GATHER_A=1), "none"),  # A gathered into the sort's order, through TMA
    ("stage1", dataclasses.replace(S, GATHER_A=1, SORTED_INTER=1), "per_1x128"),  # gathered fp8 A and its scales
    ("stage2", dataclasses.replace(S, SWAP_AB=1), "none"),  # the transposed product: a constexpr of its own
    ("stage2", dataclasses.replace(SL, USE_TMA=1, WARP_SPEC=1), "none"),  # warp-specialised, every load TMA
    ("stage1", S, "per_1x32"),  # MXFP4: packed uint8 weights (K/2 per row), uint8 scales [E, N, K/32]
    ("stage2", dataclasses.replace(S, KSPLIT=2), "per_1x32"),
    ("stage1", dataclasses.replace(S, SWAP_AB=1), "per_1x32"),  # swapped MXFP4: A copied in the K32 order first
])
def test_compile_only_builds_the_specialization_the_op_binds(monkeypatch, kernel, cfg, quant):
    """compile_only's pointer dtypes, descriptors, integers and constexprs are the ones MoeLaunch binds its GEMM
    launch with: the compile pool's binary is the one the op runs."""
    from tritune.kernels.fused_moe import _moe_gemm_kernel

    d, inter = (64, 32) if quant != "none" else (D, INTER)  # MXFP4: K multiples of 32; fp8 TMA rows of 16 bytes
    shared = {name: getattr(cfg, name) for name in PLAN_FIELDS}
    stage1, stage2 = (cfg, dataclasses.replace(S, **shared)) if kernel == "stage1" else \
        (dataclasses.replace(S, **shared), cfg)
    if cfg.WARP_SPEC and not warp_spec_compiles(triton.__version__, interpreting()):  # Triton 3.6 on a GPU
        _refuses_warp_spec(quant, (d, inter), stage1, stage2, kernel, cfg)
        return
    bound, compiled = _bound_and_compiled(monkeypatch, _moe_gemm_kernel, quant, (d, inter), stage1, stage2, kernel,
                                          cfg)
    built = _specialization(compiled[0])
    assert built == _specialization(bound[0 if kernel == "stage1" else 1])
    through_tma = cfg.SORTED_INTER == 2 if kernel == "stage2" else bool(cfg.GATHER_A)
    assert isinstance(built["a_desc"], tuple) == through_tma


@pytest.mark.parametrize(("quant", "topk_atomic"), [("none", 0), ("per_token", 0), ("per_1x128", 0), ("none", 1)])
def test_compile_only_builds_the_persistent_stage_2_the_op_binds(monkeypatch, quant, topk_atomic):
    """MoeConfig.PERSISTENT: the persistent kernel takes the same arguments, and compile_only builds it, not the
    one-tile-a-program kernel (with TOPK_ATOMIC: the fp32 accumulator and the top-k constexpr)."""
    from tritune.kernels.fused_moe_persistent import _moe_gemm_persistent_kernel

    cfg = dataclasses.replace(S, USE_TMA=1, SORTED_INTER=2, PERSISTENT=1, TOPK_ATOMIC=topk_atomic)
    stage1 = dataclasses.replace(S, SORTED_INTER=2, TOPK_ATOMIC=topk_atomic)
    bound, compiled = _bound_and_compiled(monkeypatch, _moe_gemm_persistent_kernel, quant, (64, 32), stage1, cfg,
                                          "stage2", cfg)
    assert len(bound) == len(compiled) == 1
    assert _specialization(compiled[0]) == _specialization(bound[0])
    assert isinstance(_specialization(bound[0])["w_desc"], tuple)


@pytest.mark.parametrize("quant", ["none", "per_1x128", "per_1x32"])
@pytest.mark.parametrize("final_cast", [False, True], ids=["cast-launch", "cast-in-kernel"])
def test_compile_only_builds_the_1_stage_specialization_the_op_binds(monkeypatch, quant, final_cast):
    """As above for the 1-stage kernel: MXFP4's packed uint8 weights and scales, fp8's scales, 16-bit's dummies;
    with the cast in the kernel, the output's dtype and the fp32 counts."""
    from tritune.kernels import fused_moe_1stage
    from tritune.kernels.fused_moe_1stage import _moe_1stage_kernel

    monkeypatch.setattr(fused_moe_1stage, "FINAL_CAST_IN_KERNEL", final_cast)
    dims = (64, 32) if quant == "per_1x32" else (D, INTER)
    cfg = dataclasses.replace(S, BLOCK_SIZE_D=32)
    bound, compiled = _bound_and_compiled(monkeypatch, _moe_1stage_kernel, quant, dims, cfg, None, "1stage", cfg)
    assert _specialization(compiled[0]) == _specialization(bound[0])


def test_fp8_intermediate_quantization_is_fused_only_where_it_is_safe(monkeypatch):
    from tritune.kernels import fused_moe_launch
    from tritune.kernels.fused_moe_launch import fuses_intermediate_quant

    l2, smem = 50 * 2**20, 232448  # the H100's
    big = MoeConfig(128, 256, 128, 8, 8, 4)  # stage 2 with 16-bit A: 4 x (128x128x2 + 256x128) = 256 KiB of tiles
    assert not fuses_intermediate_quant("per_token", S, S, 2**20, 2, l2, smem)  # off by default: measured slower
    monkeypatch.setattr(fused_moe_launch, "FUSE_INTERMEDIATE_QUANT", True)
    assert fuses_intermediate_quant("per_1x128", S, S, 2**20, 2, l2, smem)
    assert fuses_intermediate_quant("per_token", S, S, 2**20, 2, l2, smem)
    assert not fuses_intermediate_quant("none", S, S, 2**20, 2, l2, smem)  # nothing to quantize
    assert not fuses_intermediate_quant("per_token", MoeConfig(16, 32, 32, 1, 4, 2, KSPLIT=2), S, 2**20, 2, l2, smem)
    assert not fuses_intermediate_quant("per_token", S, S, l2 // 2, 2, l2, smem)  # the intermediate leaves L2
    assert not fuses_intermediate_quant("per_token", S, big, 2**20, 2, l2, smem)  # its A tiles would not fit
    assert fuses_intermediate_quant("per_token", S, big, l2, 2, None, None)  # the interpreter has no such limits


def test_gemm_launches_and_allocations_per_call(binds, counted):
    a, b = operands(1, 40, 200)
    split = gk.GemmConfig(16, 32, 32, 1, 4, 2, NUM_KSPLIT=4)
    gemm(a, b, config=split)
    gemm(a, b, config=CFG)
    with counted() as c:
        gemm(a, b, config=CFG)
    assert c.launches == {"_gemm_kernel": 1} and c.allocs == ["tritune.ops.gemm:empty"]
    with counted() as c:
        check(gemm(a, b, config=split), a, b)
    assert c.launches == {"_gemm_kernel": 1}  # split-K in one launch: the last split of a tile sums it
    assert sorted(c.allocs) == sorted(["tritune.ops.gemm:empty", *SCRATCH_ALLOC])


def test_split_k_in_one_launch_is_repeatable_and_leaves_its_locks_at_zero(binds):
    a, b = operands(5, 72, 200)  # 3 N tiles, 4 splits of K (the last one short)
    split = gk.GemmConfig(16, 32, 32, 1, 4, 2, NUM_KSPLIT=4)
    outs = [gemm(a, b, config=split) for _ in range(3)]
    check(outs[0], a, b)
    for again in outs[1:]:  # the locks were back at zero for each call: the same sums, in the same order
        torch.testing.assert_close(again, outs[0], rtol=0, atol=0)
    plan = next(p for p in ops_gemm._PLANS.values() if p.split == 4)
    assert plan._locks and all(int(locks.abs().sum()) == 0 for locks in plan._locks.values())


def test_moe_signature_change_rebinds(binds):
    x = moe_problem()
    choice = MoeChoice(False, S, S, "")
    call(x, choice)
    call(moe_problem(seed=1), choice)
    assert binds["moe"] == 1
    y = moe_problem(tokens=T + 1)  # another token count: another grid and sort
    out = call(y, choice)
    assert binds["moe"] == 2
    ref = fused_moe_reference(y["hidden"], y["w1"], y["w2"], y["topk_weights"], y["topk_ids"])
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    x["topk_ids"] = x["topk_ids"].long()  # int64 ids: another sort binary
    call(x, choice)
    assert binds["moe"] == 3


def test_workspace_layout_is_aligned_and_disjoint():
    ws = Workspace(((torch.int32, 5), (torch.float16, 3), (torch.float32, 1000)))
    assert ws.offsets == (0, 256, 512) and ws.nbytes == 512 + 4096
    buf, pieces = ws.allocate(torch.device("cpu"))
    assert [p.dtype for p in pieces] == [torch.int32, torch.float16, torch.float32]
    assert [p.numel() for p in pieces] == [5, 3, 1000]
    assert [p.data_ptr() - buf.data_ptr() for p in pieces] == [0, 256, 512]  # the GPU allocator aligns the base


def test_descriptor_cache_keeps_no_tensor_and_keys_on_the_address():
    from tritune.kernels.launch import DescriptorCache

    cache = DescriptorCache((64, 32), (32, 1), torch.float16, [16, 32], size=2)
    (first,) = cache.get(4096)  # without an encoder: the descriptor itself, as the one launch argument
    assert cache.get(4096)[0] is first  # the same address: the same descriptor, no construction
    assert first.base.data_ptr() == 4096 and not isinstance(first.base, torch.Tensor)
    assert (first.shape, first.strides, first.block_shape) == ([64, 32], [32, 1], [16, 32])
    cache.get(8192)
    cache.get(12288)  # past `size`: the cache starts afresh
    assert cache.get(4096)[0] is not first and cache.get(4096)[0].base.data_ptr() == 4096


def test_descriptor_cache_keeps_the_encoded_launch_arguments():
    from tritune.kernels.launch import DescriptorCache

    encoded = []

    def encode(desc, nth=0):  # stands for Triton's tensor-map encoding: called once per address
        encoded.append(desc.base.data_ptr())
        return ("map", *desc.shape, *desc.strides)

    cache = DescriptorCache((64, 32), (32, 1), torch.float16, [16, 32], encode=encode)
    assert cache.get(4096) == ("map", 64, 32, 32, 1)
    assert cache.get(4096) == ("map", 64, 32, 32, 1) and cache.get(8192)[0] == "map"
    assert encoded == [4096, 8192]
