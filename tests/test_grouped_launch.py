"""Bound launches of the grouped-GEMM kernels (kernels/grouped_launch.py): a repeated call binds nothing new and
launches once a kernel; a call that differs in anything the binary or the launch depends on (rows, a TMA operand,
a pointer's alignment, a config) binds afresh and is still right. Interpreter without a GPU (fp16), else the GPU."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tritune.kernels import grouped_launch
from tritune.kernels.grouped_gemm import grouped_gemm_dw, grouped_gemm_forward
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW, KernelConfigForward
from tritune.kernels.grouped_gemm_reference import grouped_gemm_dw_reference, grouped_gemm_reference
from tritune.kernels.launch import launch_counts, reset_launch_counts

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FWD = KernelConfigForward(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                          flatten=False)
SCHEDULED = KernelConfigBackward_dW(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                                    flatten=False, use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True,
                                    scheduled=True)


@pytest.fixture
def fresh():
    grouped_launch._PLANS.clear()
    reset_launch_counts(counting=True)
    yield
    reset_launch_counts(counting=False)
    grouped_launch._PLANS.clear()


def operands(rows: int, k: int, n: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base, extra = divmod(rows, experts)
    m_sizes = torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.int32)
    x = torch.randn(rows, k, generator=g).half()
    w = (torch.randn(experts, n, k, generator=g) / k**0.5).half()
    return x.to(DEV), w.to(DEV), m_sizes.to(DEV)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_repeated_call_binds_once_and_a_changed_one_binds_afresh(fresh):
    x, w, m = operands(40, 32, 48, 3)
    fwd = partial(grouped_gemm_forward, num_programs=2)  # one grid for every row count (else min(SMs, tiles))
    for _ in range(3):
        out = fwd(x, w, m, FWD)
    assert grouped_launch.plans_kept() == 1
    assert launch_counts() == {"_grouped_fwd_kernel": 3}
    assert rel(out, grouped_gemm_reference(x, w, m)) < 2e-3
    x2, w2, m2 = operands(56, 32, 48, 3, seed=1)  # more rows: pointer loads do not specialize on the row count
    assert rel(fwd(x2, w2, m2, FWD), grouped_gemm_reference(x2, w2, m2)) < 2e-3
    assert grouped_launch.plans_kept() == 1
    tma = KernelConfigForward(**{**FWD.to_dict(), "use_tma_load_w": True, "use_tma_load_x": True})
    assert rel(fwd(x, w, m, tma), grouped_gemm_reference(x, w, m)) < 2e-3
    assert grouped_launch.plans_kept() == 2
    # a TMA operand's view shape is in its descriptor: more rows, another plan
    assert rel(fwd(x2, w2, m2, tma), grouped_gemm_reference(x2, w2, m2)) < 2e-3
    assert grouped_launch.plans_kept() == 3


def test_a_misaligned_pointer_is_a_new_specialization(fresh):
    x, w, m = operands(40, 32, 48, 3)
    grouped_gemm_forward(x, w, m, FWD, num_programs=2)
    shifted = torch.empty(40 * 32 + 1, dtype=x.dtype, device=DEV)[1:].view(40, 32)  # 2 bytes off 16
    shifted.copy_(x)
    assert rel(grouped_gemm_forward(shifted, w, m, FWD, num_programs=2), grouped_gemm_reference(x, w, m)) < 2e-3
    assert grouped_launch.plans_kept() == 2


def test_the_scheduled_dw_binds_its_launches_once(fresh):
    x, _, m = operands(40, 32, 48, 3)
    dy = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)).half().to(DEV)
    for _ in range(2):
        got = grouped_gemm_dw(x, dy, m, SCHEDULED)
    assert rel(got, grouped_gemm_dw_reference(x, dy, m)) < 2e-3
    # the padding copy of one operand, the table kernel and the loop
    assert launch_counts() == {"_pad_rows_kernel": 2, "_dw_schedule_kernel": 2, "_dw_scheduled_kernel": 2}
    assert grouped_launch.plans_kept() == 3
