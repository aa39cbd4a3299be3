"""The scheduled grouped-GEMM dW (kernels/grouped_dw_scheduled.py): its padding plan, its step table (every row block
of every tile exactly once, the store on each tile's last block) and the kernel against the torch reference on odd
shapes: through the interpreter (fp16) without a GPU, on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.grouped_dw_scheduled import dw_schedule, operands_to_pad, pad, rows_upper_bound, scheduled_dw
from tritune.kernels.grouped_gemm import grouped_gemm_dw, grouped_gemm_dx, grouped_gemm_forward, scheduled_dw_launch
from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW, KernelConfigBackward_dX, KernelConfigForward
from tritune.kernels.grouped_gemm_reference import grouped_gemm_dw_reference, grouped_gemm_reference
from tritune.ops.grouped_gemm import GroupedGemmConfigs, grouped_gemm, heuristic_configs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCHEDULED = KernelConfigBackward_dW(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                                    flatten=False, use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True,
                                    scheduled=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _padded_reference(src: torch.Tensor, m_sizes: list[int], rows: list[int], bm: int) -> torch.Tensor:
    """src's rows `rows` (one per grouped row) placed expert by expert on whole bm-row blocks, zeros between."""
    parts, g = [], 0
    for m in m_sizes:
        blocks = max(1, -(-m // bm))
        block = torch.zeros(blocks * bm, src.shape[1], dtype=src.dtype, device=src.device)
        block[:m] = src[rows[g:g + m]]
        parts.append(block)
        g += m
    return torch.cat(parts)


@pytest.mark.parametrize(("gathered", "topk"), [(False, 1), (True, 2), (True, 1)])
def test_pad_puts_each_expert_on_whole_blocks(gathered, topk):
    m_sizes = [5, 0, 17, 16]  # an empty expert keeps one block of zeros: it stores its zero dW
    pairs, bm = sum(m_sizes), 16
    gen = torch.Generator().manual_seed(topk)
    gather = torch.randperm(pairs, generator=gen).int()
    src = torch.randn(pairs // topk if gathered else pairs, 24, generator=gen).half()
    rows = (gather.long() // topk).tolist() if gathered else list(range(pairs))
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    got = pad(src.to(DEV), ms, gather.to(DEV) if gathered else None, topk, pairs, bm)
    assert got.shape[0] == rows_upper_bound(pairs, 4, bm) == (3 + 4) * bm
    want = _padded_reference(src, m_sizes, rows, bm)
    assert torch.equal(got[:want.shape[0]].cpu(), want)  # rows past the padded total are never read


def test_operands_to_pad():
    assert operands_to_pad(64, 32, False, False) == (True, False)  # X narrower: copy X, read dY in place
    assert operands_to_pad(32, 64, False, False) == (False, True)
    assert operands_to_pad(32, 64, True, False) == (True, False)  # the permuted one, whatever the widths
    assert operands_to_pad(64, 32, False, True) == (False, True)


@pytest.mark.parametrize(("m_sizes", "n", "k", "bn", "bk", "programs", "pad_x"), [
    ([5, 0, 37, 16], 32, 48, 16, 32, 3, True),
    ([1, 40], 64, 16, 32, 16, 7, False),  # more programs than some experts have tiles; X read in place
])
def test_schedule_visits_every_block_of_every_tile_once(m_sizes, n, k, bn, bk, programs, pad_x):
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    bm = 16
    sched = dw_schedule(ms, sum(m_sizes), n, k, bm, bn, bk, programs, 2, pad_x=pad_x, pad_dy=not pad_x)
    n_tiles, k_tiles = n // bn, -(-k // bk)
    blocks = [max(1, -(-m // bm)) for m in m_sizes]
    pad_row = [sum(blocks[:e]) * bm for e in range(len(m_sizes))]
    start = [sum(m_sizes[:e]) for e in range(len(m_sizes))]
    tiles_of = [[t for t in range(len(m_sizes) * n_tiles * k_tiles) if t % programs == p] for p in range(programs)]
    seen, stores = [], []
    table = sched.table.cpu()
    for p in range(programs):
        steps = sum(blocks[t // (n_tiles * k_tiles)] for t in tiles_of[p])
        assert steps <= sched.max_steps
        for i, (x_row, dy_row, nk, out_row) in enumerate(table[p, :steps].tolist()):
            pid_n, pid_k = nk >> 16, nk & 0xFFFF
            padded = x_row if pad_x else dy_row
            e = max(i for i in range(len(m_sizes)) if pad_row[i] <= padded)  # every expert has a block
            b = (padded - pad_row[e]) // bm
            assert (dy_row if pad_x else x_row) == start[e] + b * bm  # the operand read in place: grouped rows
            seen.append((e, pid_n, pid_k, b))
            if out_row >= 0:
                assert out_row == e * n + pid_n * bn and b == blocks[e] - 1
                stores.append((e, pid_n, pid_k))
            if i == steps - 1:
                assert out_row >= 0  # a program's steps end on a store
    want = sorted((e, pid_n, pid_k, b) for e in range(len(m_sizes)) for pid_n in range(n_tiles)
                  for pid_k in range(k_tiles) for b in range(blocks[e]))
    assert sorted(seen) == want  # every block of every tile once
    assert sorted(stores) == sorted((e, pid_n, pid_k) for e in range(len(m_sizes)) for pid_n in range(n_tiles)
                                    for pid_k in range(k_tiles))  # one store a tile


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


def test_pad_with_a_scale_writes_the_top_k_sums_dy_padded():
    """dout [T, D] in token order times the routing weight of each pair: the MoE MLP's dY, padded, in one pass
    (fp32 product rounded once, as the top-k sum's own backward rounds it)."""
    m_sizes, topk, bm = [3, 0, 6, 5], 2, 16
    pairs = sum(m_sizes)
    gen = torch.Generator().manual_seed(7)
    gather = torch.randperm(pairs, generator=gen).int()
    dout = torch.randn(pairs // topk, 40, generator=gen).half()
    w = torch.rand(pairs // topk, topk, generator=gen)
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    got = pad(dout.to(DEV), ms, gather.to(DEV), topk, pairs, bm, scale=w.to(DEV))
    dy = (w.reshape(-1, 1) * dout.float().repeat_interleave(topk, 0)).half()  # pair order
    want = _padded_reference(dy, m_sizes, gather.long().tolist(), bm)
    assert torch.equal(got[:want.shape[0]].cpu(), want)
    with pytest.raises(ValueError, match="a scale needs gather indices and 14 elements"):
        pad(dout.to(DEV), ms, None, topk, pairs, bm, scale=w.to(DEV))


FWD = KernelConfigForward(BLOCK_SIZE_M=32, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                          flatten=False, use_tma_load_x=True)
DX = KernelConfigBackward_dX(BLOCK_SIZE_M=32, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, num_warps=4, num_stages=2,
                             flatten=False, use_tma_load_dy=True)


@pytest.mark.parametrize("tma", [True, False])
def test_forward_and_dx_read_rows_padded_per_expert(tma):
    """A padded input (16-row blocks) under 32-row tiles: a tile's rows past its expert read the next expert's rows
    and are never stored; the output is grouped and unpadded."""
    m_sizes, n, k, bm = [5, 0, 37, 16], 24, 32, 16
    pairs = sum(m_sizes)
    gen = torch.Generator().manual_seed(11)
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    x = torch.randn(pairs, k, generator=gen).half().to(DEV)
    w = (torch.randn(4, n, k, generator=gen) / 4).half().to(DEV)
    x_pad = pad(x, ms, None, 1, pairs, bm)
    fwd = KernelConfigForward(**{**FWD.to_dict(), "use_tma_load_x": tma})
    got = grouped_gemm_forward(x_pad, w, ms, fwd, x_padded_to=bm, pairs=pairs)
    assert got.shape == (pairs, n) and rel(got, grouped_gemm_reference(x, w, ms)) < 2e-3
    dy = torch.randn(pairs, n, generator=gen).half().to(DEV)
    dx_cfg = KernelConfigBackward_dX(**{**DX.to_dict(), "use_tma_load_dy": tma})
    got_dx = grouped_gemm_dx(pad(dy, ms, None, 1, pairs, bm), w, ms, dx_cfg, dy_padded_to=bm, pairs=pairs)
    want_dx = torch.cat([dy[s:s + m].float() @ w[e].float() for e, (s, m) in
                         enumerate(zip([0, 5, 5, 42], m_sizes, strict=True))])
    assert got_dx.shape == (pairs, k) and rel(got_dx, want_dx) < 2e-3
    with pytest.raises(ValueError, match="needs pairs"):
        grouped_gemm_forward(x_pad, w, ms, fwd, x_padded_to=bm)
    with pytest.raises(ValueError, match="padded to 24 rows"):
        grouped_gemm_forward(x_pad, w, ms, fwd, x_padded_to=24, pairs=pairs)
    with pytest.raises(ValueError, match=r"x padded per expert to 16 rows has 96 rows; 58 pairs over 4 experts need "
                                         r"128"):  # a short buffer: TMA would read zeros past it, silently
        grouped_gemm_forward(x_pad[:96], w, ms, fwd, x_padded_to=bm, pairs=pairs)


@pytest.mark.parametrize("padded", ["x", "dy"])
def test_scheduled_dw_reads_an_operand_already_padded_without_copying_it(padded):
    m_sizes, n, k = [7, 0, 20, 9], 32, 48
    pairs = sum(m_sizes)
    gen = torch.Generator().manual_seed(13)
    ms = torch.tensor(m_sizes, dtype=torch.int32, device=DEV)
    x = torch.randn(pairs, k, generator=gen).half().to(DEV)
    dy = torch.randn(pairs, n, generator=gen).half().to(DEV)
    x_in = pad(x, ms, None, 1, pairs, 16) if padded == "x" else x
    dy_in = pad(dy, ms, None, 1, pairs, 16) if padded == "dy" else dy
    got = scheduled_dw_launch(x_in, dy_in, ms, SCHEDULED, topk=1, gather=None, permute_x=False, permute_y=False,
                              padded=padded, pairs=pairs)
    assert rel(got, grouped_gemm_dw_reference(x, dy, ms)) < 2e-3 and (got[1] == 0).all()
    with pytest.raises(ValueError, match="read in place has 36 rows, not 35"):
        scheduled_dw_launch(x_in, dy_in, ms, SCHEDULED, topk=1, gather=None, permute_x=False, permute_y=False,
                            padded=padded, pairs=pairs - 1)
    short = {"x": (x_in[:64], dy_in), "dy": (x_in, dy_in[:64])}[padded]
    with pytest.raises(ValueError, match=f"scheduled dW: {padded} padded per expert to 16 rows has 64 rows; 36 pairs "
                                         "over 4 experts need 112"):
        scheduled_dw_launch(*short, ms, SCHEDULED, topk=1, gather=None, permute_x=False, permute_y=False,
                            padded=padded, pairs=pairs)
