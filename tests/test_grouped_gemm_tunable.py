"""The grouped-GEMM tunable: problem keys and validation, each pruning rule by name, fuse_permute False giving the
fused kernel's output for all six problems, and the kernels passing the engine's gate against the reference.

Kernels run through Triton's interpreter on tiny fp16 shapes (its tl.dot is wrong on bf16 operands).
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tritune.device import DeviceInfo
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW, KernelConfigBackward_dX, KernelConfigForward
from tritune.ops import moe_mlp as mlp
from tritune.tuners.grouped_gemm_tunable import (
    DEFAULT_SPACE,
    GEMMS,
    INTERPRETER_SPACE,
    KERNELS,
    TOLERANCES,
    GroupedGemmProblem,
    GroupedGemmShape,
    GroupedGemmTunable,
    dw_order_matters,
    kernel_config,
    torch_baseline,
)
from tritune.tuning.check import check_output, poison
from tritune.tuning.space import SearchSpace
from tritune.tuning.types import Config

H100 = DeviceInfo(name="test-H100", sm_count=132, capability=(9, 0), max_shared_mem=232448, regs_per_block=65536,
                  l2_bytes=50 * 2**20, warp_size=32, triton_version="3.9.0", torch_version="2", cuda_version="12")
QWEN3_8K = GroupedGemmShape(num_experts=128, hidden_size=2048, intermediate_size=768, topk=8, seqlen=8192, dtype="bf16")
MIXTRAL_8K = GroupedGemmShape(num_experts=8, hidden_size=4096, intermediate_size=14336, topk=2, seqlen=8192,
                              dtype="bf16")
TRITON_36 = dataclasses.replace(H100, triton_version="3.6.0")  # a release whose flattened loop fails with a TMA store
# 5 experts (prime), 7 tokens top-2: 14 pairs, under one 16-row tile; H=40, I=24 keep every fp16 row a 16-byte
# multiple (TMA) while not dividing the 32-wide blocks (masked edges).
TINY = GroupedGemmShape(num_experts=5, hidden_size=40, intermediate_size=24, topk=2, seqlen=7, dtype="fp16")
# Zipf routing over 6 experts: some expert gets no rows (its dW must be zero) and one holds most pairs.
SKEWED = GroupedGemmShape(num_experts=6, hidden_size=40, intermediate_size=24, topk=2, seqlen=9, dtype="fp16",
                          skew=2.0)
PROBLEMS = [GroupedGemmProblem(TINY, g, k) for g in GEMMS for k in KERNELS]
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # kernels run on the GPU where there is one
BASE = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, num_warps=4, num_stages=2, flatten=True,
            use_tma_load_a=False, use_tma_load_b=False, use_tma_store=False, fuse_permute=True, GROUP_SIZE_N=1,
            scheduled=False)
TUNABLE = GroupedGemmTunable()


def point(**overrides) -> Config:
    return Config.from_dict({**BASE, **overrides})


def run(problem: GroupedGemmProblem, inputs: dict, config: Config) -> torch.Tensor:
    out = TUNABLE.alloc_output(problem, inputs)
    poison(out)
    TUNABLE.launcher(problem, inputs, config, out)()
    return out


# --- Problems. ------------------------------------------------------------------------------------------------


def test_key_changes_with_every_field():
    variants = [dataclasses.replace(TINY, **{f.name: v}) for f, v in zip(
        dataclasses.fields(TINY), (6, 48, 32, 3, 8, "bf16", 1.5), strict=True)]
    problems = [GroupedGemmProblem(TINY, "gate_up", "forward"), GroupedGemmProblem(TINY, "down", "forward"),
                GroupedGemmProblem(TINY, "gate_up", "dX"), *(GroupedGemmProblem(s, "gate_up", "forward")
                                                             for s in variants)]
    keys = [p.key() for p in problems]
    assert len(set(keys)) == len(keys)
    assert GroupedGemmProblem(TINY, "down", "dW").key() == GroupedGemmProblem(TINY, "down", "dW").key()


def test_dims_and_permute_roles():
    up, down = GroupedGemmProblem(TINY, "gate_up", "dX"), GroupedGemmProblem(TINY, "down", "dX")
    assert (up.n, up.k, up.permute_x, up.permute_y) == (48, 40, True, False)  # W1 [E, 2I, H]
    assert (down.n, down.k, down.permute_x, down.permute_y) == (40, 24, False, True)  # W2 [E, H, I]


@pytest.mark.parametrize(("field", "value"), [
    ("num_experts", 0), ("hidden_size", -8), ("intermediate_size", 2.0), ("topk", True), ("seqlen", "7"),
    ("dtype", "fp8"), ("skew", -0.5), ("skew", float("nan")),
])
def test_shape_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        dataclasses.replace(TINY, **{field: value})
    assert repr(value) in str(info.value)


def test_topk_above_experts_and_unknown_gemm_or_kernel_are_errors():
    with pytest.raises(ValueError, match="topk"):
        dataclasses.replace(TINY, topk=6)
    with pytest.raises(ValueError, match="'up'"):
        GroupedGemmProblem(TINY, "up", "forward")
    with pytest.raises(ValueError, match="'dx'"):
        GroupedGemmProblem(TINY, "down", "dx")


def test_tunable_and_problem_pickle():
    tunable = GroupedGemmTunable(space_params=tuple(INTERPRETER_SPACE.items()))
    assert pickle.loads(pickle.dumps((tunable, PROBLEMS[0]))) == (tunable, PROBLEMS[0])


# --- Configs and the space. -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("gemm", "kernel", "cls", "permute", "a", "b"), [
    ("gate_up", "forward", KernelConfigForward, "permute_x", "use_tma_load_x", "use_tma_load_w"),
    ("gate_up", "dX", KernelConfigBackward_dX, "permute_x", "use_tma_load_dy", "use_tma_load_w"),
    ("gate_up", "dW", KernelConfigBackward_dW, "permute_x", "use_tma_load_dy", "use_tma_load_x"),
    ("down", "forward", KernelConfigForward, "permute_y", "use_tma_load_x", "use_tma_load_w"),
    ("down", "dX", KernelConfigBackward_dX, "permute_y", "use_tma_load_dy", "use_tma_load_w"),
    ("down", "dW", KernelConfigBackward_dW, "permute_y", "use_tma_load_dy", "use_tma_load_x"),
])
def test_kernel_config_maps_fuse_permute_and_operands(gemm, kernel, cls, permute, a, b):
    problem = GroupedGemmProblem(TINY, gemm, kernel)
    fused = kernel_config(problem, point(use_tma_load_a=True, flatten=False))
    assert type(fused) is cls and getattr(fused, permute) and getattr(fused, a) and not getattr(fused, b)
    assert not fused.flatten and not fused.fuse_mul_post and (fused.permute_x, fused.permute_y).count(True) == 1
    plain = kernel_config(problem, point(fuse_permute=False, use_tma_load_b=True, use_tma_store=True))
    assert not (plain.permute_x or plain.permute_y) and getattr(plain, b) and plain.use_tma_store


def test_default_space_lists():
    # BM (32, 64, 128), BN, BK (64, 128, 256), warps, stages, flatten, the three TMA flags, fuse_permute, dW's order
    # and dW's scheduled loop
    assert SearchSpace(DEFAULT_SPACE).size == 3 * 3 * 3 * 2 * 3 * 2 * 2 * 2 * 2 * 2 * 2 * 2
    assert DEFAULT_SPACE["fuse_permute"] == (True, False) and DEFAULT_SPACE["use_tma_store"] == (False, True)


def pruned_by(problem: GroupedGemmProblem, config: Config, device: DeviceInfo = H100) -> dict[str, int]:
    """{rule: 1} for the rule that drops `config`, {} when it is kept."""
    space = TUNABLE.space(problem, device).with_params({k: (v,) for k, v in config.items})
    return space.prune().pruned


# A dW point the scheduled loop takes: all three TMA flags, no fused permute, no flatten.
SCHEDULED_OK = dict(use_tma_load_a=True, use_tma_load_b=True, use_tma_store=True, fuse_permute=False, flatten=False)
ODD_H = dataclasses.replace(TINY, hidden_size=36)  # fp16 rows of 72 bytes: no TMA on a tensor with K or N = H


@pytest.mark.parametrize(("gemm", "kernel", "overrides", "device", "shape", "rule"), [
    ("gate_up", "forward", dict(use_tma_load_a=True), H100, TINY, "tma_load_x_with_permute_x"),  # gathered X
    ("gate_up", "dW", dict(use_tma_load_b=True), H100, TINY, "tma_load_x_with_permute_x"),  # dW's X is operand b
    ("down", "dX", dict(use_tma_load_a=True), H100, TINY, "tma_load_dy_with_permute_y"),  # gathered dY
    ("down", "dW", dict(use_tma_load_a=True), H100, TINY, "tma_load_dy_with_permute_y"),
    ("down", "forward", dict(use_tma_store=True), H100, TINY, "tma_store_with_permute_y"),  # scattered Y
    ("gate_up", "dX", dict(use_tma_store=True), H100, TINY, "tma_store_with_permute_x"),  # scattered dX
    ("down", "forward", dict(BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, num_stages=4), H100, TINY, "exceeds_smem"),
    ("down", "dW", {}, dataclasses.replace(H100, max_shared_mem=4095), TINY, "exceeds_smem"),  # needs 4096
    ("down", "dW", dict(fuse_permute=False, use_tma_load_a=True), dataclasses.replace(H100, capability=(8, 0)),
     TINY, "TMA needs capability >= 9.0"),
    ("gate_up", "forward", dict(use_tma_load_b=True), H100, ODD_H, "TMA rows not a multiple of 16 bytes"),
    ("down", "forward", dict(fuse_permute=False, use_tma_store=True), H100, ODD_H,
     "TMA rows not a multiple of 16 bytes"),  # Y rows of N = H
    ("gate_up", "forward", dict(GROUP_SIZE_N=8), H100, TINY, "GROUP_SIZE_N orders dW's tiles only"),
    ("down", "dX", dict(GROUP_SIZE_N=8), H100, TINY, "GROUP_SIZE_N orders dW's tiles only"),
    ("down", "dX", dict(fuse_permute=False, use_tma_store=True), TRITON_36, TINY,  # flatten=True in BASE
     "flatten with a TMA store does not compile on this Triton"),
    ("gate_up", "forward", dict(use_tma_store=True), TRITON_36, TINY,
     "flatten with a TMA store does not compile on this Triton"),
    ("down", "dW", dict(GROUP_SIZE_N=8), H100, TINY, "GROUP_SIZE_N cannot matter: the experts in flight fit the L2"),
    ("gate_up", "dW", dict(GROUP_SIZE_N=8), H100, QWEN3_8K,  # 512 rows an expert: 5 MB in flight
     "GROUP_SIZE_N cannot matter: the experts in flight fit the L2"),
    ("gate_up", "forward", dict(SCHEDULED_OK, scheduled=True), H100, TINY, "scheduled is dW's"),
    ("down", "dX", dict(SCHEDULED_OK, scheduled=True), H100, TINY, "scheduled is dW's"),
    ("down", "dW", dict(SCHEDULED_OK, scheduled=True, use_tma_store=False), H100, TINY, "scheduled_without_tma"),
    ("gate_up", "dW", dict(SCHEDULED_OK, scheduled=True, use_tma_load_a=False), H100, TINY, "scheduled_without_tma"),
    ("gate_up", "dW", dict(SCHEDULED_OK, scheduled=True, flatten=True), H100, TINY,
     "scheduled_with_fused_permute_or_flatten"),
    ("down", "dW", dict(SCHEDULED_OK, scheduled=True), H100, TINY,  # N = H = 40, BLOCK_SIZE_N 32
     "scheduled needs N a multiple of BLOCK_SIZE_N"),
])
def test_each_pruning_rule_by_name(gemm, kernel, overrides, device, shape, rule):
    problem = GroupedGemmProblem(shape, gemm, kernel)
    assert pruned_by(problem, point(**overrides), device) == {rule: 1}


@pytest.mark.parametrize(("gemm", "kernel", "overrides"), [
    ("gate_up", "forward", dict(fuse_permute=False, use_tma_load_a=True, use_tma_store=True)),  # X pre-gathered
    ("down", "forward", dict(fuse_permute=False, use_tma_store=True)),  # grouped Y, scattered by torch after
    ("down", "dX", dict(fuse_permute=False, use_tma_load_a=True, use_tma_load_b=True, use_tma_store=True)),
    ("gate_up", "dX", dict(use_tma_load_a=True, use_tma_load_b=True)),  # dY is grouped; only the store scatters
    ("gate_up", "forward", dict(use_tma_load_b=True, use_tma_store=True)),  # W and grouped Y are contiguous
])
def test_tma_kept_where_tensors_are_contiguous(gemm, kernel, overrides):
    assert pruned_by(GroupedGemmProblem(TINY, gemm, kernel), point(**overrides)) == {}


@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_dw_tile_order_searched_where_an_expert_outgrows_the_l2(gemm):
    # Mixtral at 8192 tokens: 2048 rows an expert, 75-134 MB of dY and X each
    problem = GroupedGemmProblem(MIXTRAL_8K, gemm, "dW")
    assert dw_order_matters(problem, H100)
    assert pruned_by(problem, point(GROUP_SIZE_N=8, fuse_permute=False, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128)) == {}


@pytest.mark.parametrize(("gemm", "kernel", "overrides", "device"), [
    ("gate_up", "forward", dict(use_tma_store=True, flatten=False), TRITON_36),  # not flattened
    ("down", "dW", dict(fuse_permute=False, use_tma_store=True), TRITON_36),  # dW builds either way
    ("gate_up", "forward", dict(use_tma_store=True), H100),  # Triton 3.9 builds it
])
def test_flatten_with_tma_store_kept_where_it_compiles(gemm, kernel, overrides, device):
    assert pruned_by(GroupedGemmProblem(TINY, gemm, kernel), point(**overrides), device) == {}


@pytest.mark.parametrize(("gemm", "layout"), [("gate_up", "padded"), ("down", "padded"), ("down", "plain")])
def test_a_scheduled_dw_point_is_kept_and_matches_the_reference(gemm, layout, monkeypatch):
    # N (2I gate_up, H down) a multiple of BLOCK_SIZE_N 32; skewed routing leaves an expert empty (its dW: zeros).
    # The down dW is timed as the MoE MLP runs it: on dY already padded (the top-k sum's backward writes it so),
    # unless TRITUNE_MOE_MLP_LAYOUT=plain; gate_up keeps its copy (the MLP pays it in the forward).
    monkeypatch.setenv("TRITUNE_MOE_MLP_LAYOUT", layout)
    calls = []
    real = mlp.scheduled_dw_launch  # the MLP's padded dW (dw_on_padded) launches through it
    monkeypatch.setattr(mlp, "scheduled_dw_launch", lambda *a, **kw: calls.append(kw.get("padded")) or real(*a, **kw))
    shape = dataclasses.replace(SKEWED, hidden_size=64, intermediate_size=16)
    problem = GroupedGemmProblem(shape, gemm, "dW")
    config = point(**SCHEDULED_OK, scheduled=True)
    assert pruned_by(problem, config) == {}
    assert kernel_config(problem, config).scheduled
    inputs = TUNABLE.make_inputs(problem, DEV, 1)
    assert (inputs["m_sizes"] == 0).any()
    result = check_output(run(problem, inputs, config), TUNABLE.reference(problem, inputs), TUNABLE.tolerance(problem))
    assert result.passed, result
    assert calls == (["dy"] if (gemm, layout) == ("down", "padded") else [])  # else run_dw's copying launch


def test_rule_names_in_order_and_permute_pair_never_fires():
    names = [c.name for c in TUNABLE.space(PROBLEMS[0], H100).constraints]
    assert names == ["tma_load_x_with_permute_x", "permute_x_with_permute_y", "tma_store_with_permute_y",
                     "GROUP_SIZE_N orders dW's tiles only",
                     "GROUP_SIZE_N cannot matter: the experts in flight fit the L2", "scheduled is dW's",
                     "scheduled needs N a multiple of BLOCK_SIZE_N", "exceeds_smem",
                     "TMA needs capability >= 9.0", "TMA rows not a multiple of 16 bytes",
                     "flatten with a TMA store does not compile on this Triton"]
    for problem in PROBLEMS:  # fuse_permute sets one role flag only, so this rule only guards the mapping
        assert "permute_x_with_permute_y" not in TUNABLE.space(problem, H100).prune().pruned


def test_space_overrides_replace_lists_and_reject_unknown_names():
    tunable = GroupedGemmTunable(space_params=tuple(INTERPRETER_SPACE.items()))
    assert tunable.space(PROBLEMS[0], H100).size == 4
    with pytest.raises(ValueError, match="BLOCK_M"):
        GroupedGemmTunable(space_params=(("BLOCK_M", (16,)),)).space(PROBLEMS[0], H100)


# --- Inputs, numbers. -----------------------------------------------------------------------------------------


def test_inputs_are_seeded_nonzero_and_in_role_layout():
    up_fwd, down_dw = GroupedGemmProblem(TINY, "gate_up", "forward"), GroupedGemmProblem(TINY, "down", "dW")
    a, b = TUNABLE.make_inputs(up_fwd, "cpu", 3), TUNABLE.make_inputs(up_fwd, "cpu", 3)
    assert all(torch.equal(x, y) for x, y in zip(a["args"], b["args"], strict=True))
    assert not torch.equal(a["args"][0], TUNABLE.make_inputs(up_fwd, "cpu", 4)["args"][0])
    x, w = a["args"]
    assert x.shape == (7, 40) and w.shape == (5, 48, 40) and x.dtype == torch.float16  # X in token order
    assert (x != 0).all() and (w != 0).all() and w.abs().max() < 1.0  # weights ~N(0, 0.05²)
    assert int(a["m_sizes"].sum()) == 14 and sorted(a["gather"].tolist()) == list(range(14))
    assert torch.equal(a["src_rows"], a["gather"].long() // 2)
    act, dy = TUNABLE.make_inputs(down_dw, "cpu", 3)["args"]
    assert act.shape == (14, 24) and dy.shape == (14, 40)  # grouped A, pair-order dY


def test_flops_bytes_and_tolerances():
    up_fwd, down_dx = GroupedGemmProblem(TINY, "gate_up", "forward"), GroupedGemmProblem(TINY, "down", "dX")
    assert TUNABLE.flops(up_fwd) == 2.0 * 14 * 48 * 40
    assert TUNABLE.bytes_moved(up_fwd) == 2.0 * (7 * 40 + 5 * 48 * 40 + 14 * 48)  # X read once in token order
    assert TUNABLE.bytes_moved(down_dx) == 2.0 * (14 * 40 + 5 * 40 * 24 + 14 * 24)
    assert TUNABLE.tolerance(up_fwd) == TOLERANCES["fp16"]
    bf16 = TOLERANCES["bf16"]
    assert (bf16.atol, bf16.rtol, bf16.max_rel_l2) == (2e-2, 2e-2, 1e-2)
    assert TOLERANCES["fp16"].atol < bf16.atol and TOLERANCES["fp32"].atol == 1e-4


def test_compile_is_a_no_op():
    assert TUNABLE.compile(PROBLEMS[0], point()) is None


# --- Kernels against each other and the reference (interpreter without a GPU, else the GPU). -----------------


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.gemm}-{p.kernel}")
def test_unfused_permute_gives_the_fused_output(problem):
    inputs = TUNABLE.make_inputs(problem, DEV, 0)
    fused = run(problem, inputs, point())
    # Unfused, every TMA flag the layout allows on: the pre-gathered operand and the grouped output are plain.
    # Not flattened: Triton 3.6 does not build a flattened forward or dX loop around a TMA store (on the GPU).
    plain = point(fuse_permute=False, use_tma_load_a=True, use_tma_load_b=True, use_tma_store=True, flatten=False)
    assert pruned_by(problem, plain) == {}
    torch.testing.assert_close(run(problem, inputs, plain), fused, rtol=1e-3, atol=1e-3)
    assert torch.equal(run(problem, inputs, point(fuse_permute=False)), fused)  # same tiles, same sums


@pytest.mark.parametrize(("shape", "gemm", "kernel", "overrides"), [
    (TINY, "gate_up", "forward", dict(BLOCK_SIZE_M=32, flatten=False)),  # one tile holds two experts' rows
    (TINY, "down", "forward", dict(use_tma_load_b=True)),
    (SKEWED, "gate_up", "dW", dict(fuse_permute=False, use_tma_load_b=True, use_tma_store=True)),  # empty expert
    (SKEWED, "down", "dX", dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)),  # several N steps and K tiles
    (SKEWED, "down", "dW", {}),
])
def test_kernel_passes_the_engine_gate(shape, gemm, kernel, overrides):
    problem = GroupedGemmProblem(shape, gemm, kernel)
    config = point(**overrides)
    assert pruned_by(problem, config) == {}
    inputs = TUNABLE.make_inputs(problem, DEV, 1)
    if shape is SKEWED:
        assert (inputs["m_sizes"] == 0).any()
    result = check_output(run(problem, inputs, config), TUNABLE.reference(problem, inputs), TUNABLE.tolerance(problem))
    assert result.passed, result.reason


def test_gate_fails_a_wrong_layout():
    # A dX of gate_up left in grouped order (no scatter) must not pass against the pair-order reference.
    problem = GroupedGemmProblem(TINY, "gate_up", "dX")
    inputs = TUNABLE.make_inputs(problem, DEV, 0)
    out = run(problem, inputs, point())
    shuffled = out[inputs["pairs"]]  # pair order -> grouped order
    assert not check_output(shuffled, TUNABLE.reference(problem, inputs), TUNABLE.tolerance(problem)).passed


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.gemm}-{p.kernel}")
def test_torch_loop_baseline_matches_the_reference(problem):
    inputs = TUNABLE.make_inputs(problem, "cpu", 2)
    out = torch_baseline(problem, inputs, use_grouped_mm=False)()
    result = check_output(out, TUNABLE.reference(problem, inputs), TUNABLE.tolerance(problem))
    assert result.passed, result.reason


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_ops_untuned_choice_is_always_measured_on_a_gpu(gemm, kernel, monkeypatch):
    """On a GPU (scripted here: CUDA available, capability 9.0) the space holds the op's untuned choice as a point
    that `kernel_config` maps back to exactly it; none under the interpreter or with an override."""
    from tritune.ops.grouped_gemm import heuristic_configs
    from tritune.tuners.grouped_gemm_tunable import rule_points

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    shape = GroupedGemmShape(num_experts=64, hidden_size=2048, intermediate_size=1408, topk=6, seqlen=4096,
                             dtype="bf16")
    problem = GroupedGemmProblem(shape, gemm, kernel)
    (p,) = TUNABLE.space(problem, H100).extra
    rule = getattr(heuristic_configs(problem.n, problem.k, 4096 * 6 / 64, problem.permute_x, problem.permute_y,
                                     torch.device("cuda")), kernel)
    assert kernel_config(problem, p) == rule and p in TUNABLE.space(problem, H100).prune().kept
    assert rule_points(problem, dataclasses.replace(H100, interpreter=True)) == ()
    assert GroupedGemmTunable(space_params=tuple(INTERPRETER_SPACE.items())).space(problem, H100).extra == ()
