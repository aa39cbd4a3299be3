"""The training MLP's weighted top-k sum (kernels/topk_weighted_sum.py) against torch autograd, in Triton's
interpreter without a GPU: odd D (a partial column block, and D past one block), topk 1 to 8 (topk 3: slots padded to
a power of two), fp16 and fp32 outputs with fp32 routing weights."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.topk_weighted_sum import topk_sum, topk_weighted_sum_backward, topk_weighted_sum_forward
from tritune.ops.moe_mlp import TopkWeightedSum

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("tokens", "topk", "d", "dtype"), [
    (5, 1, 37, torch.float32),
    (3, 3, 1030, torch.float16),  # D past one block of 1024 in the forward; 4 padded slots in the backward
    (4, 8, 200, torch.float32),
    (1, 2, 16, torch.float16),
])
def test_forward_and_backward_match_torch(tokens, topk, d, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens * 100 + topk * 10 + d)
    y = torch.randn(tokens * topk, d, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    w = torch.rand(tokens, topk, device=DEVICE, generator=gen).requires_grad_()
    dout = torch.randn(tokens, d, device=DEVICE, generator=gen).to(dtype)
    want = (y.float().view(tokens, topk, d) * w.unsqueeze(-1)).sum(1)
    want.backward(dout.float())
    got = TopkWeightedSum.apply(y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert got.dtype == dtype and got.shape == (tokens, d)
    torch.testing.assert_close(got.float(), want.detach(), **tol)
    dy, dw = topk_weighted_sum_backward(dout, y.detach(), w.detach())
    assert dy.dtype == dtype and dw.dtype == torch.float32
    torch.testing.assert_close(dy.float(), y.grad.float(), **tol)
    torch.testing.assert_close(dw, w.grad, atol=1e-3 if dtype == torch.float32 else 5e-2, rtol=1e-3)
    no_dy, dw_only = topk_weighted_sum_backward(dout, y.detach(), w.detach(), with_dy=False)
    assert no_dy is None and torch.equal(dw_only, dw)  # the MoE MLP's padded backward writes dY itself


def test_gradients_flow_through_autograd():
    y = torch.randn(6, 24, device=DEVICE, requires_grad=True)
    w = torch.rand(3, 2, device=DEVICE, requires_grad=True)
    TopkWeightedSum.apply(y, w).sum().backward()
    torch.testing.assert_close(y.grad, w.detach().reshape(6, 1).expand(6, 24))
    torch.testing.assert_close(w.grad, y.detach().sum(1).view(3, 2))


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"y \[T·topk, D\] and w \[T, topk\], got \(5, 8\) and \(2, 2\)"):
        topk_weighted_sum_forward(torch.zeros(5, 8, device=DEVICE), torch.zeros(2, 2, device=DEVICE))


@pytest.mark.parametrize(("tokens", "topk", "d", "dtype"), [(5, 1, 37, torch.float32), (3, 3, 1030, torch.float16),
                                                           (4, 8, 200, torch.float16)])
def test_topk_sum_is_the_fp32_sum_rounded_once(tokens, topk, d, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + topk + d)
    y = torch.randn(tokens * topk, d, device=DEVICE, generator=gen).to(dtype)
    want = y.view(tokens, topk, d).sum(1, dtype=torch.float32).to(dtype)
    got = topk_sum(y, topk)
    assert got.dtype == dtype
    # the same fp32 sum up to its order (torch may reduce as a tree), one rounding: within one unit of the last place
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-3, atol=1e-6)
    with pytest.raises(ValueError, match=r"topk_sum needs y \[T·topk, D\] with topk >= 1, got \(7, 4\) and topk 2"):
        topk_sum(torch.zeros(7, 4, device=DEVICE), 2)
