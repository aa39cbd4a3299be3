"""The scheduled grouped-GEMM dW (kernels/grouped_dw_scheduled.py): its padding plan, its step table (every row block
of every tile exactly once, the store on each tile's last block) and the kernel against the torch reference on odd
shapes: through the interpreter (fp16) without a GPU, on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.grouped_dw_scheduled import dw_schedule, operands_to_pad, padded_rows, scheduled_dw
from tritune.kernels.grouped_gemm import grouped_gemm_dw
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW
from tritune.kernels.grouped_gemm_reference import grouped_gemm_dw_reference
from tritune.ops.grouped_gemm import GroupedGemmConfigs, grouped_gemm, heuristic_configs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCHEDULED = KernelConfigBackward_dW(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                                    flatten=False, use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True,
                                    scheduled=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_padded_rows_put_each_expert_on_whole_blocks():
    m_sizes = torch.tensor([5, 0, 17, 16], dtype=torch.int32, device=DEV)
    plan = padded_rows(m_sizes, None, 38, 1, False, False, 16)
    assert plan.blocks.tolist() == [1, 1, 2, 1]  # the empty expert keeps one block: it stores its zero dW
    assert plan.pad_row.tolist() == [0, 16, 32, 64]
    assert plan.start.tolist() == [0, 5, 5, 22]
    assert plan.total.tolist() == [80]
    assert plan.rows_ub == (3 + 4) * 16 >= 80
    src = plan.x_src.tolist()
    assert src[:5] == [0, 1, 2, 3, 4] and set(src[5:32]) == {-1}  # expert 0's rows, then padding
    assert src[32:49] == list(range(5, 22)) and set(src[49:64]) == {-1}
    assert src[64:80] == list(range(22, 38))


def test_only_what_is_asked_is_padded_and_a_permuted_operand_must_be():
    m_sizes = torch.tensor([3, 3], dtype=torch.int32, device=DEV)
    plan = padded_rows(m_sizes, None, 6, 1, False, False, 16, pad_x=False, pad_dy=True)
    assert plan.x_src is None and plan.dy_src is not None
    with pytest.raises(ValueError, match="must be padded"):
        padded_rows(m_sizes, torch.arange(6, dtype=torch.int32, device=DEV), 6, 2, True, False, 16, pad_x=False)
    assert operands_to_pad(64, 32, False, False) == (True, False)  # X narrower: copy X, read dY in place
    assert operands_to_pad(32, 64, False, False) == (False, True)
    assert operands_to_pad(32, 64, True, False) == (True, False)  # the permuted one, whatever the widths
    assert operands_to_pad(64, 32, False, True) == (False, True)


def test_padded_rows_follow_the_permutes():
    m_sizes = torch.tensor([3, 3], dtype=torch.int32, device=DEV)
    gather = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int32, device=DEV)  # pair ids, topk 2: tokens 2 0 1 | 0 2 1
    plan = padded_rows(m_sizes, gather, 6, 2, True, True, 16)
    assert plan.x_src[:3].tolist() == [2, 0, 1] and plan.x_src[16:19].tolist() == [0, 2, 1]  # token rows
    assert plan.dy_src[:3].tolist() == [5, 0, 3] and plan.dy_src[16:19].tolist() == [1, 4, 2]  # pair rows


@pytest.mark.parametrize(("m_sizes", "n", "k", "bn", "bk", "programs"), [
    ([5, 0, 37, 16], 32, 48, 16, 32, 3),
    ([1, 40], 64, 16, 32, 16, 7),  # more programs than some experts have tiles
])
def test_schedule_visits_every_block_of_every_tile_once(m_sizes, n, k, bn, bk, programs):
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    bm = 16
    plan = padded_rows(ms, None, sum(m_sizes), 1, False, False, bm)
    sched = dw_schedule(plan, sum(m_sizes), n, k, bm, bn, bk, programs, group_size_n=2)
    n_tiles, k_tiles = n // bn, -(-k // bk)
    seen, stores = [], []
    for p in range(programs):
        steps = int(sched.steps[p])
        assert steps <= sched.max_steps
        last = None
        for x_row, dy_row, nk, out_row in sched.table[p, :steps].tolist():
            pid_n, pid_k = nk >> 16, nk & 0xFFFF
            assert x_row == dy_row  # both padded here
            seen.append((pid_n, pid_k, x_row))
            if out_row >= 0:
                stores.append((out_row, pid_k))
            last = out_row
        assert last is None or last >= 0  # a program's steps end on a store
    want = sorted((pid_n, pid_k, int(plan.pad_row[e]) + b * bm) for e in range(len(m_sizes))
                  for pid_n in range(n_tiles) for pid_k in range(k_tiles) for b in range(int(plan.blocks[e])))
    assert sorted(seen) == want  # every block of every tile once
    assert sorted(stores) == sorted((e * n + pid_n * bn, pid_k) for e in range(len(m_sizes))
                                    for pid_n in range(n_tiles) for pid_k in range(k_tiles))  # one store a tile


@pytest.mark.parametrize(("m_sizes", "n", "k", "topk", "permute_x", "permute_y", "group"), [
    ([5, 0, 37, 16], 32, 48, 1, False, False, 1),  # an empty expert, rows short of a block, K past a tile
    ([33, 1, 0], 64, 40, 1, False, False, 2),  # K not a multiple of BLOCK_SIZE_K, an empty last expert
    ([7, 9, 0, 4], 32, 24, 2, True, False, 1),  # X in token order
    ([7, 9, 0, 4], 48, 24, 2, False, True, 3),  # dY in pair order, N tiles in groups of 3
])
def test_scheduled_dw_matches_torch(m_sizes, n, k, topk, permute_x, permute_y, group):
    gen = torch.Generator().manual_seed(sum(m_sizes) + n + k)
    pairs = sum(m_sizes)
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    gather = torch.randperm(pairs, generator=gen).int().to(DEV)
    x = torch.randn(pairs // topk if permute_x else pairs, k, generator=gen).half().to(DEV)
    dy = torch.randn(pairs, n, generator=gen).half().to(DEV)
    got = scheduled_dw(x, dy, ms, gather, topk, permute_x, permute_y, block_m=16, block_n=16, block_k=16,
                       group_size_n=group, num_warps=4, num_stages=2, programs=5)
    want = grouped_gemm_dw_reference(x, dy, ms, topk=topk, gather_indices=gather, permute_x=permute_x,
                                     permute_y=permute_y)
    assert rel(got, want) < 2e-3
    for e, m in enumerate(m_sizes):
        if m == 0:
            assert (got[e] == 0).all()


def test_the_kernel_api_runs_a_scheduled_config_and_refuses_a_bad_one():
    ms = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    x, dy = torch.randn(8, 32).half().to(DEV), torch.randn(8, 16).half().to(DEV)
    got = grouped_gemm_dw(x, dy, ms, SCHEDULED)
    assert rel(got, grouped_gemm_dw_reference(x, dy, ms)) < 2e-3
    no_store = KernelConfigBackward_dW(**{**SCHEDULED.to_dict(), "use_tma_store": False})
    with pytest.raises(ValueError, match="use_tma_store"):
        grouped_gemm_dw(x, dy, ms, no_store)
    wide = KernelConfigBackward_dW(**{**SCHEDULED.to_dict(), "BLOCK_SIZE_N": 32})
    with pytest.raises(ValueError, match="N=16 is not a multiple of BLOCK_SIZE_N=32"):
        grouped_gemm_dw(x, dy, ms, wide)


def test_autograd_through_the_op_with_a_scheduled_dw():
    gen = torch.Generator().manual_seed(0)
    tokens, experts, topk, k, n = 9, 4, 2, 32, 48
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int().to(DEV)
    from tritune.kernels.grouped_gemm import group_by_expert

    ms, gather = group_by_expert(ids, experts)
    base = heuristic_configs(n, k, tokens * topk / experts, True, False, torch.device(DEV))
    configs = GroupedGemmConfigs(base.forward, base.dX, SCHEDULED)
    x = torch.randn(tokens, k, generator=gen).half().to(DEV).requires_grad_()
    w = (torch.randn(experts, n, k, generator=gen) / 4).half().to(DEV).requires_grad_()
    dy = torch.randn(tokens * topk, n, generator=gen).half().to(DEV)
    grouped_gemm(x, w, ms, gather, topk=topk, permute_x=True, configs=configs).backward(dy)
    want = grouped_gemm_dw_reference(x.detach(), dy, ms, topk=topk, gather_indices=gather, permute_x=True)
    assert rel(w.grad, want) < 2e-3
