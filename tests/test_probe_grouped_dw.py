"""benchmarks/probe_grouped_dw.py without a GPU: the dW kernel with per-expert TMA bounds through the interpreter
(fp16), so the experiment the next GPU session runs is known to compute the right gradient, an empty expert and
partial row blocks included."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_grouped_dw", ROOT / "benchmarks" / "probe_grouped_dw.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the probe itself")


@pytest.mark.parametrize(("m_sizes", "n", "k", "bm", "bn", "bk", "flatten", "group"), [
    ([5, 0, 37, 16], 32, 48, 16, 16, 32, False, 1),  # an empty expert (zeros), rows short of one block, K past a tile
    ([33, 1, 0], 64, 40, 16, 32, 16, True, 1),  # one row, an empty last expert, K not a multiple of BK
    ([20, 9], 80, 48, 16, 16, 16, False, 2),  # N tiles in groups of 2 along K, the last group one tile wide
])
def test_bounded_dw_matches_torch(m_sizes, n, k, bm, bn, bk, flatten, group):
    gen = torch.Generator().manual_seed(sum(m_sizes) * n + k)
    pairs = sum(m_sizes)
    x = torch.randn(pairs, k, generator=gen).half()
    dy = torch.randn(pairs, n, generator=gen).half()
    sizes = torch.tensor(m_sizes, dtype=torch.int32)
    out = torch.full((len(m_sizes), n, k), 7.0, dtype=torch.float16)  # every tile must be written, zeros included
    got = probe.BoundedDw(x, dy, sizes, out, bm, bn, bk, 4, 2, flatten, sms=3, group=group)()
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    want = torch.stack([dy[a:b].float().T @ x[a:b].float() for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert torch.equal(got[sizes == 0].float(), torch.zeros_like(want[sizes == 0]))
    assert float((got.float() - want).norm() / want.norm()) < 1e-3


def test_bounded_dw_refuses_n_off_the_tile():
    x, dy = torch.zeros(4, 16).half(), torch.zeros(4, 24).half()
    with pytest.raises(ValueError, match="N 24 is not a multiple of BLOCK_SIZE_N 16"):
        probe.BoundedDw(x, dy, torch.tensor([4], dtype=torch.int32), torch.empty(1, 24, 16).half(), 16, 16, 16, 4, 2,
                        False, sms=2)


@pytest.mark.parametrize(("m_sizes", "n", "k", "bm", "bn", "bk", "group", "sms"), [
    ([5, 0, 37, 16], 32, 48, 16, 16, 32, 1, 3),  # an empty expert (one zero block), partial blocks, K past a tile
    ([20, 9], 80, 48, 16, 16, 16, 2, 4),  # N tiles in groups of 2; more tiles than programs
    ([3], 16, 16, 16, 16, 16, 1, 8),  # one tile, fewer tiles than SMs
])
@pytest.mark.parametrize("kind", ["PaddedDw", "ScheduledDw"])
def test_padded_dw_matches_torch(m_sizes, n, k, bm, bn, bk, group, sms, kind):
    gen = torch.Generator().manual_seed(sum(m_sizes) * n + k + 1)
    pairs = sum(m_sizes)
    x = torch.randn(pairs, k, generator=gen).half()
    dy = torch.randn(pairs, n, generator=gen).half()
    sizes = torch.tensor(m_sizes, dtype=torch.int32)
    out = torch.full((len(m_sizes), n, k), 7.0, dtype=torch.float16)
    f = getattr(probe, kind)(x, dy, sizes, out, bm, bn, bk, 4, 2, group=group, sms=sms)
    got = f()
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    want = torch.stack([dy[a:b].float().T @ x[a:b].float() for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert torch.equal(got[sizes == 0].float(), torch.zeros_like(want[sizes == 0]))
    assert float((got.float() - want).norm() / want.norm()) < 1e-3
    # every row block of every tile is one step of some program
    tiles_per_expert = (n // bn) * -(-k // bk)
    blocks = [max(1, -(-m // bm)) for m in m_sizes]
    steps = f.args[5] if kind == "PaddedDw" else f.args[4]
    assert int(steps.sum()) == tiles_per_expert * sum(blocks)


def test_pad_rows_places_each_expert_on_a_block_boundary():
    t = torch.arange(6, dtype=torch.float32).view(6, 1) + 1
    padded, first, blocks = probe.pad_rows(t, torch.tensor([2, 0, 4], dtype=torch.int32), 4)
    assert first.tolist() == [0, 4, 8] and blocks.tolist() == [1, 1, 1]
    assert padded.view(-1).tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 3, 4, 5, 6]


def test_dw_schedule_lists_each_tiles_blocks_and_ends_it_with_its_store_row():
    # experts of 2 and 1 row blocks (padded rows 0 and 64), N 32 in two 16-wide tiles, one K tile: tiles t0 (e0, n0),
    # t1 (e0, n1), t2 (e1, n0), t3 (e1, n1); program 0 takes t0 and t2, program 1 t1 and t3
    table, steps = probe.dw_schedule(torch.tensor([2, 1]), torch.tensor([0, 64]), 32, 16, 32, 16, 16, 2, 1)
    assert steps.tolist() == [3, 3]
    assert table[0].tolist() == [[0, 0, 0, -1], [32, 0, 0, 0], [64, 0, 0, 32]]
    assert table[1].tolist() == [[0, 16, 0, -1], [32, 16, 0, 16], [64, 16, 0, 48]]
