"""SwiGLU between the two MoE GEMMs, forward and backward, one elementwise launch each (torch's eager form is
several launches over a tensor as large as the gate-up output); with the torch reference beside it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_launch import launch

BLOCK = 1024
LAUNCH = {"num_warps": 4, "num_stages": 3}  # Triton's defaults, as a bound launch (kernels/grouped_launch.py)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, a_ptr, I, BLOCK: tl.constexpr):  # noqa: E741  # h [R, 2I] (gate | up) -> a [R, I]
    """Grid: (rows, cdiv(I, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(h_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + row * I + cols, a.to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, I, BLOCK: tl.constexpr):  # noqa: E741  # h [R, 2I]; da [R, I] -> dh [R, 2I]
    """Grid: (rows, cdiv(I, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(h_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + row * I + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = da * u * s * (1.0 + g * (1.0 - s))
    du = da * g * s
    tl.store(dh_ptr + row * 2 * I + cols, dg.to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dh_ptr + row * 2 * I + I + cols, du.to(dh_ptr.dtype.element_ty), mask=ok)


def swiglu_forward(h: torch.Tensor) -> torch.Tensor:
    """h [R, 2I] contiguous (gate columns then up columns) -> silu(gate)·up [R, I] in h's dtype."""
    rows, two_i = h.shape
    if two_i % 2 or not h.is_contiguous():
        raise ValueError(f"swiglu needs a contiguous [R, 2I] tensor, got {tuple(h.shape)}")
    a = torch.empty((rows, two_i // 2), device=h.device, dtype=h.dtype)
    if rows:
        launch(_swiglu_fwd_kernel, (rows, triton.cdiv(two_i // 2, BLOCK)),
               dict(h_ptr=h, a_ptr=a, I=two_i // 2, BLOCK=BLOCK), **LAUNCH)
    return a


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Gradient of swiglu_forward: h [R, 2I], da [R, I] -> dh [R, 2I]."""
    rows, two_i = h.shape
    dh = torch.empty_like(h)
    if rows:
        launch(_swiglu_bwd_kernel, (rows, triton.cdiv(two_i // 2, BLOCK)),
               dict(h_ptr=h, da_ptr=da.contiguous(), dh_ptr=dh, I=two_i // 2, BLOCK=BLOCK), **LAUNCH)
    return dh


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """fp32 torch form: silu(h[:, :I]) · h[:, I:]."""
    gate, up = h.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
