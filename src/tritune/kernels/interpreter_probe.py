"""Whether Triton's CPU interpreter multiplies a dtype right in `tl.dot`: Triton 3.9's does not for bfloat16 (it keeps
bf16 as uint16 and multiplies the bit patterns: values around 1e10; triton-lang/triton#11584, "not supported yet"),
so without a GPU every bf16 candidate fails the correctness gate, whatever its config. The tuners ask this before any
work and refuse such problems in one line; a Triton whose interpreter gets it right passes the probe and runs them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_N = 16


@triton.jit
def _dot_probe_kernel(A, B, C, N: tl.constexpr):
    r = tl.arange(0, N)
    a = tl.load(A + r[:, None] * N + r[None, :])
    b = tl.load(B + r[:, None] * N + r[None, :])
    tl.store(C + r[:, None] * N + r[None, :], tl.dot(a, b))


@functools.cache
def interpreter_dot_is_exact(dtype: torch.dtype) -> bool:
    """Whether the interpreter's `tl.dot` of two 16x16 `dtype` matrices of small integers (exact in every float type,
    and their products in fp32) equals torch's product. Call it only where the interpreter runs kernels (no GPU,
    TRITON_INTERPRET=1 before this module was imported); a probe that cannot run at all says True (no refusal)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-2, 3, (_N, _N), generator=gen).to(dtype)
    b = torch.randint(-2, 3, (_N, _N), generator=gen).to(dtype)
    c = torch.zeros((_N, _N), dtype=torch.float32)
    try:
        _dot_probe_kernel[(1,)](a, b, c, N=_N)
    except Exception:  # noqa: BLE001 - no interpreter here (a GPU, or TRITON_INTERPRET unset): nothing to refuse
        return True
    return bool(torch.equal(c, a.float() @ b.float()))


def interpreter_dot_fault(dtype: torch.dtype, dtype_name: str) -> str | None:
    """Without a GPU: why `dtype` operands cannot be tuned through this Triton's interpreter, or None when they can."""
    if interpreter_dot_is_exact(dtype):
        return None
    return (f"Triton {triton.__version__}'s interpreter computes tl.dot on {dtype_name} operands wrongly "
            f"(triton-lang/triton#11584), so every candidate would fail the correctness gate")
