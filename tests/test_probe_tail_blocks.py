"""benchmarks/probe_tail_blocks.py without a GPU: its split of the routing into whole blocks and per-expert tails
covers every pair once, and the two-launch stage pair equals the torch reference through the interpreter."""

from __future__ import annotations

import json

import torch
from benchmark_module import load_benchmark


def _probe():
    return load_benchmark("probe_tail_blocks")


def test_split_covers_every_pair_once_with_whole_main_blocks():
    probe = _probe()
    gen = torch.Generator().manual_seed(3)
    experts, topk = 6, 2
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(50)]).int()
    ids[:, 0] = torch.where(torch.arange(50) < 40, 0, ids[:, 0])  # expert 0 gets most tokens
    ids[:, 1] = torch.where(ids[:, 1] == 0, 5, ids[:, 1])
    split = probe.split_by_tail(ids, experts, block_main=16, block_tail=4)
    numel = ids.numel()
    seen = []
    for sorting, block in ((split.main, 16), (split.tail, 4)):
        assert sorting.block_size == block and sorting.numel == numel
        sids = sorting.sorted_token_ids.view(-1, block)
        assert sids.shape[0] == sorting.expert_ids.numel() == int(sorting.num_tokens_post_padded) // block
        for row, expert in zip(sids, sorting.expert_ids.tolist(), strict=True):
            real = row[row < numel]
            assert bool((ids.reshape(-1)[real.long()] == expert).all())
            if block == 16:
                assert real.numel() == 16  # main blocks are whole
            seen += real.tolist()
    assert sorted(seen) == list(range(numel))
    counts = torch.bincount(ids.reshape(-1).long(), minlength=experts)
    assert split.single_rows == int(((counts + 15) // 16 * 16).sum())
    assert split.computed_rows == int((counts // 16 * 16 + (counts % 16 + 3) // 4 * 4).sum()) < split.single_rows


def test_two_launch_stage_pair_matches_the_reference(tmp_path):
    out = tmp_path / "tail.json"
    assert _probe().main(["--tiny", "--tokens", "120", "--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["variant"] == "single launch a stage" and rows[0]["block_m"] > 16
    tails = [r for r in rows if r["variant"].startswith("tail blocks of")]
    assert tails and all(r["rel_l2"] < 1e-2 and r["computed_rows"] <= r["single_rows"] for r in rows[1:])
