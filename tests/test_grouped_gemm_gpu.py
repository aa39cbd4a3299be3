"""bf16 grouped GEMM and MoE MLP on the GPU (bf16 tl.dot is wrong in the interpreter, so bf16 is checked here),
with the heuristic's TMA configs; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.grouped_gemm import group_by_expert
from tritune.kernels.grouped_gemm_reference import (
    grouped_gemm_dw_reference,
    grouped_gemm_dx_reference,
    grouped_gemm_reference,
)
from tritune.ops.grouped_gemm import heuristic_configs, run_dw, run_dx, run_forward
from tritune.ops.moe_mlp import moe_mlp, moe_mlp_reference
from tritune.ops.routing import sample_routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checks bf16 and TMA paths")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("role", ["gate_up", "down", "plain"])
@pytest.mark.parametrize("tokens,experts,topk", [(300, 8, 2), (77, 16, 4)])  # 16 experts, 77 tokens: some empty
def test_bf16_kernels_match_the_reference(role, tokens, experts, topk):
    torch.manual_seed(0)
    k, n = 256, 384
    _, ids = sample_routing(tokens, experts, topk, seed=1, device="cuda")
    m_sizes, gather = group_by_expert(ids, experts)
    px, py = role == "gate_up", role == "down"
    pairs = tokens * topk
    x = torch.randn(tokens if px else pairs, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(pairs, n, device="cuda", dtype=torch.bfloat16)
    cfg = heuristic_configs(n, k, pairs / experts, px, py, torch.device("cuda"))
    kw = dict(topk=topk, gather_indices=gather, permute_x=px, permute_y=py)
    y = run_forward(x, w, m_sizes, gather, topk, px, py, cfg.forward)
    dx = run_dx(dy, w, m_sizes, gather, topk, px, py, cfg.dX)
    dw = run_dw(x, dy, m_sizes, gather, topk, px, py, cfg.dW)
    assert rel(y, grouped_gemm_reference(x, w, m_sizes, **kw)) < 1e-2
    assert rel(dx, grouped_gemm_dx_reference(dy, w, m_sizes, **kw)) < 1e-2
    assert rel(dw, grouped_gemm_dw_reference(x, dy, m_sizes, **kw)) < 1e-2


@pytest.mark.parametrize("layout", ["padded", "plain"])
@pytest.mark.parametrize("tokens,experts,topk", [(200, 8, 2), (77, 16, 4)])
def test_bf16_moe_mlp_gradients_match_the_reference(layout, tokens, experts, topk, monkeypatch):
    # N = 2I = 384 and H = 256 are multiples of 128: the heuristic's dW is the scheduled loop for both GEMMs, so
    # "padded" runs the padded layouts (tokens gathered into padded rows, dY written padded; 16 experts at 77
    # tokens leave some empty) and "plain" the loop with its copies.
    monkeypatch.setenv("TRITUNE_MOE_MLP_LAYOUT", layout)
    torch.manual_seed(1)
    hidden, inter = 256, 192
    tw, ids = sample_routing(tokens, experts, topk, seed=2, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.06).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.07).requires_grad_()
    tw = tw.clone().requires_grad_()
    y = moe_mlp(x, w1, w2, tw, ids)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w1, w2, tw), g)
    y_ref = moe_mlp_reference(x, w1, w2, tw, ids)
    want = torch.autograd.grad(y_ref, (x, w1, w2, tw), g.float())
    assert rel(y, y_ref) < 2e-2
    for name, a, b in zip(("x", "w1", "w2", "topk_weights"), got, want, strict=True):
        assert rel(a, b) < 3e-2, name


@pytest.mark.parametrize("layout", ["padded", "plain"])
def test_bf16_moe_mlp_takes_an_empty_batch(layout, monkeypatch):
    """No tokens (an expert-parallel rank can get none), with the heuristic's TMA configs and scheduled dW: empty
    outputs and zero weight gradients, no TMA descriptor over an empty tensor."""
    monkeypatch.setenv("TRITUNE_MOE_MLP_LAYOUT", layout)
    experts, topk, hidden, inter = 8, 2, 256, 192
    x = torch.randn(0, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.06).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.07).requires_grad_()
    tw = torch.rand(0, topk, device="cuda").requires_grad_()
    y = moe_mlp(x, w1, w2, tw, torch.zeros(0, topk, dtype=torch.int64, device="cuda"))
    y.sum().backward()
    assert y.shape == (0, hidden) and x.grad.shape == (0, hidden)
    assert w1.grad.abs().max().item() == 0.0 and w2.grad.abs().max().item() == 0.0
