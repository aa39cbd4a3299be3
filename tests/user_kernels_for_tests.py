"""A tiny user kernel for the tunable_kernel tests: out = alpha * x + y, with a BUG switch in its search space.

Top-level module so the engine's spawned worker processes can import `axpy` by name (UserKernel pickles by
reference). BUG=1 adds 1 to every element: a candidate the correctness gate must reject.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import tritune


@triton.jit
def _axpy_kernel(
    X, Y, Out,  # [n] each, fp16/fp32
    n,
    alpha,  # float
    BLOCK_SIZE: tl.constexpr,
    BUG: tl.constexpr,  # 1: a wrong answer on purpose
):
    """Out = alpha * X + Y. Grid: (cdiv(n, BLOCK_SIZE),)."""
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    y = tl.load(Y + offs, mask=mask).to(tl.float32)
    out = alpha * x + y
    if BUG:
        out = out + 1.0
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=mask)


def axpy_inputs(problem: dict, device: torch.device) -> dict:
    """problem = {"n": int, "dtype": "float16" | "float32"}; the caller seeds torch."""
    dtype = getattr(torch, problem["dtype"])
    x = torch.randn(problem["n"], device=device, dtype=dtype)
    y = torch.randn(problem["n"], device=device, dtype=dtype)
    return {"X": x, "Y": y, "Out": torch.empty_like(x), "n": problem["n"], "alpha": 1.5}


def axpy_reference(args: dict) -> torch.Tensor:
    return args["alpha"] * args["X"].float() + args["Y"].float()


SPACE = {"BLOCK_SIZE": (32, 64), "BUG": (0, 1), "num_warps": (4,)}

axpy = tritune.tunable_kernel(
    space=SPACE,
    key=("n",),
    inputs=axpy_inputs,
    reference=axpy_reference,
    output="Out",
    grid=("cdiv(n, BLOCK_SIZE)",),
    constraints={"BLOCK_SIZE > 2 * n": lambda m: m["BLOCK_SIZE"] <= 2 * m["n"]},
)(_axpy_kernel)
