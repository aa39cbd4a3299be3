"""The routing sort's Triton launches (kernels/expert_grouping.py) against torch's stable argsort, exactly, with and
without the scan launch: uneven and empty experts, one expert taking every pair, a partial last chunk, several chunks,
256 experts, int32 and int64 ids. In the interpreter without a GPU (slow there: few, small cases), on the GPU where
there is one."""

from __future__ import annotations

import pytest
import torch

from tritune.kernels.expert_grouping import CHUNK, SCAN_FROM_COUNTS, group_by_expert_triton, scans
from tritune.kernels.grouped_gemm import group_by_expert, group_by_expert_reference
from tritune.knobs import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1 (the test command sets it)")


def routed(tokens: int, topk: int, experts: int, used: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """topk distinct experts per token among the first `used` (the rest get no pairs)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(used, generator=g)[:topk] for _ in range(tokens)]).to(dtype).to(DEV)


@pytest.mark.parametrize(("tokens", "topk", "experts", "used", "dtype", "scan_from"), [
    (1, 1, 2, 2, torch.int64, None),  # one pair
    (7, 2, 5, 4, torch.int32, None),  # expert 4 empty, int32 ids
    (7, 2, 5, 4, torch.int32, 1),  # the same through the scan launch (one chunk)
    (CHUNK // 2 + 3, 2, 16, 16, torch.int64, None),  # a full chunk and a partial one
    (CHUNK // 2 + 3, 2, 16, 16, torch.int64, 2),  # ... scanned
    (150, 4, 256, 200, torch.int64, None),  # 256 experts (a power of two), 56 empty; three chunks
    (150, 4, 256, 200, torch.int64, 1),  # ... scanned
])
def test_the_triton_sort_equals_the_stable_argsort(tokens, topk, experts, used, dtype, scan_from):
    ids = routed(tokens, topk, experts, used, seed=tokens + experts, dtype=dtype)
    m_sizes, gather = group_by_expert_triton(ids, experts, scan_from_chunks=scan_from)
    m_ref, g_ref = group_by_expert_reference(ids, experts)
    assert m_sizes.dtype == gather.dtype == torch.int32
    assert torch.equal(m_sizes, m_ref) and torch.equal(gather, g_ref)


def test_the_scan_starts_where_the_count_table_reaches_the_measured_crossing():
    assert not scans(1023, 8) and scans(1024, 16) and not scans(127, 128) and scans(128, 128)
    assert scans(1, SCAN_FROM_COUNTS) and not scans(1, SCAN_FROM_COUNTS - 1)


def test_one_expert_taking_every_pair_keeps_token_order():
    ids = torch.zeros(CHUNK + 5, 1, dtype=torch.int64, device=DEV)
    ids[::3] = 2
    m_sizes, gather = group_by_expert_triton(ids, 3)
    assert m_sizes.tolist() == [(CHUNK + 5) - len(range(0, CHUNK + 5, 3)), 0, len(range(0, CHUNK + 5, 3))]
    assert torch.equal(gather, group_by_expert_reference(ids, 3)[1])


def test_the_op_gives_the_reference_on_either_path():
    ids = routed(5, 2, 4, 4, seed=3)
    got = group_by_expert(ids, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, group_by_expert_reference(ids, 4), strict=True))


def test_an_empty_batch_sorts_to_nothing():
    m_sizes, gather = group_by_expert_triton(torch.zeros(0, 2, dtype=torch.int64, device=DEV), 5)
    assert m_sizes.tolist() == [0] * 5 and gather.numel() == 0 and gather.dtype == torch.int32
