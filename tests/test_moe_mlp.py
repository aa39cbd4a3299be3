"""The grouped-GEMM autograd Function, SwiGLU and the MoE MLP (function and module) against torch autograd of the
fp32 references, under the interpreter (fp32/fp16 only: bf16 tl.dot is wrong there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tritune.kernels.grouped_gemm import group_by_expert
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW
from tritune.kernels.grouped_gemm_reference import grouped_gemm_reference
from tritune.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_reference
from tritune.knobs import interpreting
from tritune.ops.grouped_gemm import (
    GroupedGemmConfigs,
    gemm_role,
    grouped_gemm,
    heuristic_configs,
    reload_grouped_gemm_configs,
    select_configs,
)
from tritune.ops.moe_mlp import MoeMLP, moe_mlp, moe_mlp_reference

# CPU tensors through Triton need its interpreter: on a GPU machine (where conftest leaves TRITON_INTERPRET unset)
# these run only with TRITON_INTERPRET=1 (grouped GEMM forward/dX/dW and its autograd step on the GPU:
# tests/test_grouped_gemm_gpu.py, tests/test_runtime_gpu.py).
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and not interpreting(),
                                reason="CPU tensors through Triton: run with TRITON_INTERPRET=1 on a GPU machine")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routing(tokens: int, used_experts: int, topk: int, seed: int) -> torch.Tensor:
    """topk distinct experts per token drawn from the first `used_experts` (the rest get zero tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(used_experts, generator=g)[:topk] for _ in range(tokens)])


CASES = [
    (9, 5, 2, torch.float32),  # expert 4 gets no tokens, topk 2
    (11, 7, 1, torch.float32),  # top-1, prime E, experts 5 and 6 empty
    (13, 5, 3, torch.float16),  # fp16, topk 3
]


@pytest.mark.parametrize("tokens,experts,topk,dtype", CASES)
@pytest.mark.parametrize("role", ["gate_up", "down", "plain"])
def test_autograd_function_matches_reference(tokens, experts, topk, dtype, role):
    torch.manual_seed(1)
    k, n = 24, 40
    ids = routing(tokens, experts - 1 if experts > 5 else 4, topk, seed=tokens)
    m_sizes, gather = group_by_expert(ids, experts)
    permute_x, permute_y = role == "gate_up", role == "down"
    rows = tokens if permute_x else tokens * topk
    x = torch.randn(rows, k, dtype=dtype).requires_grad_()
    w = (torch.randn(experts, n, k, dtype=dtype) * 0.3).requires_grad_()
    y = grouped_gemm(x, w, m_sizes, gather, topk=topk, permute_x=permute_x, permute_y=permute_y)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref = grouped_gemm_reference(x, w, m_sizes, topk=topk, gather_indices=gather, permute_x=permute_x,
                                   permute_y=permute_y)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy.float())
    bound = 1e-5 if dtype == torch.float32 else 3e-3
    assert y.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    assert rel(y, y_ref) < bound and rel(dx, dx_ref) < bound and rel(dw, dw_ref) < bound
    assert dw[experts - 1].abs().max().item() == 0.0  # the last expert got no rows: its gradient is exactly zero


@pytest.mark.parametrize("role", ["gate_up", "down"])
def test_unfused_permute_configs_give_the_same_values_and_gradients(role):
    """A tuned config may leave its permute to torch (fuse_permute False): the op must honour it exactly."""
    torch.manual_seed(2)
    ids = routing(10, 5, 2, seed=3)
    m_sizes, gather = group_by_expert(ids, 6)
    permute_x, permute_y = role == "gate_up", role == "down"
    x = torch.randn(10 if permute_x else 20, 24).requires_grad_()
    w = torch.randn(6, 16, 24).requires_grad_()
    fused = heuristic_configs(16, 24, 3.0, permute_x, permute_y, torch.device("cpu"))
    unfused = GroupedGemmConfigs(*(dataclasses.replace(c, permute_x=False, permute_y=False)
                                   for c in (fused.forward, fused.dX, fused.dW)))
    outs = []
    for configs in (fused, unfused):
        y = grouped_gemm(x, w, m_sizes, gather, topk=2, permute_x=permute_x, permute_y=permute_y, configs=configs)
        outs.append((y, *torch.autograd.grad(y, (x, w), torch.ones_like(y))))
    for a, b in zip(*outs, strict=True):
        assert rel(a, b) < 1e-6


def test_swiglu_forward_and_backward_match_torch_autograd():
    torch.manual_seed(3)
    h = torch.randn(7, 2 * 37, requires_grad=True)  # I = 37: not a multiple of the block
    a = swiglu_forward(h.detach())
    da = torch.randn_like(a)
    ref = swiglu_reference(h)
    (dh_ref,) = torch.autograd.grad(ref, h, da)
    assert rel(a, ref) < 1e-6
    assert rel(swiglu_backward(h.detach(), da), dh_ref) < 1e-6
    with pytest.raises(ValueError, match="contiguous \\[R, 2I\\]"):
        swiglu_forward(torch.randn(3, 5))


@pytest.mark.parametrize("tokens,experts,topk,dtype", CASES)
def test_moe_mlp_values_and_gradients_match_the_reference(tokens, experts, topk, dtype):
    torch.manual_seed(4)
    hidden, inter = 24, 16
    ids = routing(tokens, experts - 1, topk, seed=5)  # the last expert gets no tokens
    x = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.3).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, dtype=dtype) * 0.3).requires_grad_()
    tw = torch.rand(tokens, topk).requires_grad_()
    y = moe_mlp(x, w1, w2, tw, ids)
    g = torch.randn(y.shape, dtype=dtype)
    grads = torch.autograd.grad(y, (x, w1, w2, tw), g)
    y_ref = moe_mlp_reference(x, w1, w2, tw, ids)
    grads_ref = torch.autograd.grad(y_ref, (x, w1, w2, tw), g.float())
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    assert rel(y, y_ref) < bound
    for name, got, want in zip(("x", "w1", "w2", "topk_weights"), grads, grads_ref, strict=True):
        assert rel(got, want) < bound, name


def test_moe_mlp_module_routes_and_trains_the_router():
    torch.manual_seed(6)
    block = MoeMLP(num_experts=6, hidden_size=24, intermediate_size=16, topk=2)
    x = torch.randn(2, 5, 24)
    y = block(x)
    weights, ids = block.route(x.reshape(-1, 24))
    assert y.shape == x.shape
    assert torch.allclose(weights.sum(-1), torch.ones(10))  # norm_topk_prob renormalizes
    ref = moe_mlp_reference(x.reshape(-1, 24), block.gate_up_proj, block.down_proj, weights, ids).view(x.shape)
    assert rel(y, ref) < 1e-5
    y.square().sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0  # the router learns through the top-k weights
    assert block.gate_up_proj.grad.shape == block.gate_up_proj.shape
    with pytest.raises(ValueError, match="topk must be in"):
        MoeMLP(num_experts=4, hidden_size=8, intermediate_size=8, topk=5)


def test_config_selection_without_a_gpu_is_the_documented_heuristic():
    reload_grouped_gemm_configs()
    w = torch.empty(4, 16, 24)
    configs = select_configs(10, w, 2, True, False)
    assert configs.origins == ("heuristic",) * 3
    assert configs.forward.permute_x and not configs.forward.use_tma_load_w  # no TMA in the interpreter
    assert select_configs(10, w, 2, True, False) is configs  # cached per process
    # An empty batch looks up the 1-token configs (the tuned store refuses a token count of 0)
    assert select_configs(0, w, 2, True, False) is select_configs(1, w, 2, True, False)
    assert select_configs(0, w, 2, False, True) is select_configs(2, w, 2, False, True)
    assert gemm_role(True, False) == "gate_up" and gemm_role(False, True) == "down"
    with pytest.raises(ValueError, match="never both"):
        gemm_role(True, True)


SCHEDULED_DW = KernelConfigBackward_dW(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                                       flatten=False, use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True,
                                       scheduled=True)


@pytest.mark.parametrize(("dtype", "frozen", "layout", "topk"), [
    (torch.float32, None, "padded", 2), (torch.float16, None, "padded", 2), (torch.float16, "gate_up", "padded", 2),
    (torch.float32, "down", "padded", 2), (torch.float16, None, "plain", 2), (torch.float32, None, "padded", 1),
    (torch.float32, None, "padded", 3)])
def test_moe_mlp_with_scheduled_dw_keeps_padded_rows_and_matches_the_reference(dtype, frozen, layout, topk,
                                                                                monkeypatch):
    """Both dW scheduled: the forward gathers the tokens into padded rows (gate_up reads them through TMA) and the
    backward writes dY padded from dout; values and every gradient as the reference, the same as the plain layouts
    give, whichever weight is frozen (a frozen GEMM keeps the plain layout), and with TRITUNE_MOE_MLP_LAYOUT=plain
    (the dW loop copies its operand)."""
    monkeypatch.setenv("TRITUNE_MOE_MLP_LAYOUT", layout)
    torch.manual_seed(8)
    tokens, experts, hidden, inter = 13, 5, 32, 16
    ids = routing(tokens, experts - 1, topk, seed=9)  # the last expert gets no tokens
    x = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.3).requires_grad_(frozen != "gate_up")
    w2 = (torch.randn(experts, hidden, inter, dtype=dtype) * 0.3).requires_grad_(frozen != "down")
    tw = torch.rand(tokens, topk).requires_grad_()
    plain_up = heuristic_configs(2 * inter, hidden, tokens * topk / experts, True, False, torch.device("cpu"))
    plain_down = heuristic_configs(hidden, inter, tokens * topk / experts, False, True, torch.device("cpu"))
    sched_up = GroupedGemmConfigs(plain_up.forward, plain_up.dX, SCHEDULED_DW)
    sched_down = GroupedGemmConfigs(plain_down.forward, plain_down.dX, SCHEDULED_DW)
    inputs = [t for t in (x, w1, w2, tw) if t.requires_grad]
    g = torch.randn(tokens, hidden, dtype=dtype)
    results = []
    for up, down in ((sched_up, sched_down), (plain_up, plain_down)):
        y = moe_mlp(x, w1, w2, tw, ids, gate_up_configs=up, down_configs=down)
        results.append((y, *torch.autograd.grad(y, inputs, g)))
    y_ref = moe_mlp_reference(x, w1, w2, tw, ids)
    refs = (y_ref, *torch.autograd.grad(y_ref, inputs, g.float()))
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    for got, plain, want in zip(*results, refs, strict=True):
        assert got.dtype == plain.dtype and rel(got, want) < bound and rel(got, plain) < bound
    if frozen != "gate_up":
        assert results[0][2][experts - 1].abs().max().item() == 0.0  # dW1 of the expert with no tokens


def test_no_padded_tokens_are_made_where_no_backward_runs(monkeypatch):
    """Under no_grad (a model in eval) the forward takes the plain layout: the padded copy of the tokens would only
    serve gate_up's dW. With grad enabled it makes it once."""
    import tritune.ops.moe_mlp as mlp

    made = []
    real = mlp.pad
    monkeypatch.setattr(mlp, "pad", lambda *a, **kw: made.append(kw.get("scale") is None) or real(*a, **kw))
    tokens, experts, topk, hidden, inter = 9, 4, 2, 32, 16
    ids = routing(tokens, experts, topk, seed=11)
    x = torch.randn(tokens, hidden)
    w1 = (torch.randn(experts, 2 * inter, hidden) * 0.3).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter) * 0.3).requires_grad_()
    tw = torch.rand(tokens, topk)
    base = heuristic_configs(2 * inter, hidden, tokens * topk / experts, True, False, torch.device("cpu"))
    up = GroupedGemmConfigs(base.forward, base.dX, SCHEDULED_DW)
    with torch.no_grad():
        y_eval = moe_mlp(x, w1, w2, tw, ids, gate_up_configs=up)
    assert made == []
    y = moe_mlp(x, w1, w2, tw, ids, gate_up_configs=up)
    assert made == [True] and rel(y, y_eval) < 1e-6


@pytest.mark.parametrize("scheduled", [False, True])
def test_an_empty_batch_gives_empty_outputs_and_zero_weight_gradients(scheduled):
    """No tokens at all (an expert-parallel rank can receive none): outputs with no rows, zero dW, no TMA descriptor
    over an empty tensor, in both layouts."""
    experts, hidden, inter, topk = 4, 32, 16, 2
    x = torch.randn(0, hidden).requires_grad_()
    w1 = torch.randn(experts, 2 * inter, hidden).requires_grad_()
    w2 = torch.randn(experts, hidden, inter).requires_grad_()
    tw = torch.rand(0, topk).requires_grad_()
    up = heuristic_configs(2 * inter, hidden, 1.0, True, False, torch.device("cpu"))
    down = heuristic_configs(hidden, inter, 1.0, False, True, torch.device("cpu"))
    if scheduled:
        up, down = (GroupedGemmConfigs(c.forward, c.dX, SCHEDULED_DW) for c in (up, down))
    y = moe_mlp(x, w1, w2, tw, torch.zeros(0, topk, dtype=torch.int64), gate_up_configs=up, down_configs=down)
    y.sum().backward()
    assert y.shape == (0, hidden) and x.grad.shape == (0, hidden) and tw.grad.shape == (0, topk)
    assert w1.grad.abs().max().item() == 0.0 and w2.grad.abs().max().item() == 0.0
