"""The MoE token sort: the Triton path equals the torch reference exactly; the reference has the defined layout."""

import pytest
import torch

from tritune.kernels.moe_align import (
    SMALL_MAX,
    MoeSorting,
    gemm_blocks,
    max_padded_size,
    moe_align_block_size,
    moe_align_block_size_reference,
    sorted_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sort(ids: torch.Tensor, block_size: int, experts: int) -> MoeSorting:
    """The Triton sort, run where the kernels run (the GPU when there is one; ids built on the CPU move there)."""
    return moe_align_block_size(ids.to(DEVICE), block_size, experts)


def _ids(tokens: int, topk: int, experts: int, seed: int, *, only: list[int] | None = None,
         dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Seeded random expert ids [tokens, topk], drawn from `only` when given (leaving the other experts empty)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(only if only is not None else list(range(experts)))
    return pool[torch.randint(0, len(pool), (tokens, topk), generator=gen)].to(dtype)


def _assert_same(got: MoeSorting, want: MoeSorting) -> None:
    assert got.sorted_token_ids.dtype == got.expert_ids.dtype == got.num_tokens_post_padded.dtype == torch.int32
    assert torch.equal(got.num_tokens_post_padded.cpu(), want.num_tokens_post_padded.cpu())
    assert torch.equal(got.expert_ids.cpu(), want.expert_ids.cpu())
    assert torch.equal(got.sorted_token_ids.cpu(), want.sorted_token_ids.cpu())
    assert (got.block_size, got.numel) == (want.block_size, want.numel)


def test_example_literal():
    # counts [7, 5, 2, 2], block 4: padded [8, 8, 4, 4]; pairs interleaved so stability is visible.
    flat = torch.tensor([3, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 1, 0, 1], dtype=torch.int32)
    pad = 16
    want_sorted = [1, 3, 5, 7, 9, 11, 14, pad, 2, 6, 10, 13, 15, pad, pad, pad, 4, 12, pad, pad, 0, 8, pad, pad]
    want_sorted += [pad] * (max_padded_size(16, 4, 4) - 24)
    for fn in (moe_align_block_size_reference, _sort):
        out = fn(flat.view(8, 2), 4, 4)
        assert out.num_tokens_post_padded.tolist() == [24]
        assert out.expert_ids.tolist() == [0, 0, 1, 1, 2, 3, -1]
        assert out.sorted_token_ids.tolist() == want_sorted


CASES = [
    # (tokens, topk, experts, block_size, only-these-experts)
    pytest.param(6, 2, 16, 4, [1, 5, 6], id="zero-token-experts-incl-first-and-last"),
    pytest.param(200, 2, 16, 16, [2, 3, 9], id="zero-token-experts-multi-chunk"),
    pytest.param(5, 3, 4, 4, None, id="numel-not-multiple-of-block"),
    pytest.param(1, 1, 8, 16, None, id="single-token-topk1"),
    pytest.param(20, 1, 1, 16, None, id="one-expert"),
    pytest.param(300, 1, 1, 64, None, id="one-expert-multi-chunk"),
    pytest.param(50, 2, 7, 16, None, id="prime-E-7"),
    pytest.param(300, 3, 13, 64, None, id="prime-E-13-multi-chunk"),
    pytest.param(3, 6, 160, 16, None, id="E-160-few-tokens"),
    pytest.param(64, 4, 160, 16, None, id="E-160-at-small-threshold"),
    pytest.param(257, 1, 8, 16, None, id="numel-just-above-small-threshold"),
    pytest.param(300, 3, 16, 16, None, id="multi-chunk-T300-topk3"),
    pytest.param(128, 8, 512, 16, None, id="E-512-multi-chunk"),
    pytest.param(37, 3, 8, 1, None, id="block-1-small"),
    pytest.param(100, 4, 8, 1, None, id="block-1-multi-chunk"),
    pytest.param(9, 8, 32, 64, None, id="block-64-decode"),
    pytest.param(150, 4, 24, 64, None, id="block-64-multi-chunk"),
    pytest.param(4, 8, 256, 256, None, id="block-256-wide-padding"),
    pytest.param(0, 8, 8, 16, None, id="no-tokens"),
    pytest.param(600, 8, 61, 32, None, id="38-chunks-prime-E"),
]


@pytest.mark.parametrize("limit", [
    pytest.param(0, id="three-launches-count-scan-scatter"),
    pytest.param(38 * 61, id="two-launches-at-the-self-scan-limit"),
])
def test_both_multi_launch_paths_equal_reference(limit, monkeypatch):
    import tritune.kernels.moe_align as moe_align

    monkeypatch.setattr(moe_align, "SELF_SCAN_COUNTS", limit)
    ids = _ids(600, 8, 61, seed=7)  # 4800 pairs: 38 chunks of 61 experts
    _assert_same(_sort(ids, 32, 61), moe_align_block_size_reference(ids, 32, 61))


@pytest.mark.parametrize("tokens,topk,experts,block_size,only", CASES)
def test_triton_equals_reference(tokens, topk, experts, block_size, only):
    ids = _ids(tokens, topk, experts, seed=tokens * 31 + experts, only=only)
    _assert_same(_sort(ids, block_size, experts),
                 moe_align_block_size_reference(ids, block_size, experts))


@pytest.mark.parametrize("tokens", [
    pytest.param(10, id="int64-small"),
    pytest.param(100, id="int64-multi-chunk"),
])
def test_int64_ids(tokens):
    ids = _ids(tokens, 4, 12, seed=5, dtype=torch.int64)
    got = _sort(ids, 16, 12)
    _assert_same(got, moe_align_block_size_reference(ids.int(), 16, 12))


def test_non_contiguous_ids():
    # Flat pair index follows the logical [T, topk] layout, not the storage of a strided view.
    ids = _ids(80, 8, 16, seed=9).to(DEVICE)[:, ::2]
    assert not ids.is_contiguous()
    _assert_same(_sort(ids, 16, 16), moe_align_block_size_reference(ids.contiguous(), 16, 16))


@pytest.mark.parametrize("tokens", [pytest.param(20, id="small"), pytest.param(200, id="multi-chunk")])
def test_out_of_range_ids_are_left_out(tokens):
    # Outside the contract, but both paths must agree and must not write out of bounds: such pairs are dropped.
    ids = _ids(tokens, 2, 8, seed=3)
    ids[::3, 0] = 8
    ids[1::5, 1] = -1
    _assert_same(_sort(ids, 16, 8), moe_align_block_size_reference(ids, 16, 8))


def test_sizes_come_from_the_host():
    ids = _ids(SMALL_MAX + 1, 1, 8, seed=1)
    out = _sort(ids, 32, 8)
    assert out.sorted_token_ids.shape == (max_padded_size(SMALL_MAX + 1, 8, 32),)
    assert out.expert_ids.shape == (-(-out.sorted_token_ids.numel() // 32),)
    assert out.num_tokens_post_padded.shape == (1,)


@pytest.mark.parametrize("fn", [moe_align_block_size, moe_align_block_size_reference])
@pytest.mark.parametrize("ids,block_size,experts,msg", [
    (torch.zeros(8, dtype=torch.int32), 16, 4, "2-D"),
    (torch.zeros(2, 4), 16, 4, "int32 or int64"),
    (torch.zeros(2, 4, dtype=torch.int32), 0, 4, "block_size"),
    (torch.zeros(2, 4, dtype=torch.int32), 16, 0, "num_experts"),
])
def test_bad_arguments(fn, ids, block_size, experts, msg):
    with pytest.raises(ValueError, match=msg):
        fn(ids, block_size, experts)


@pytest.mark.parametrize("seed", range(12))
def test_reference_layout(seed):
    gen = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 40, (1,), generator=gen))
    tokens = int(torch.randint(0, 60, (1,), generator=gen))
    topk = int(torch.randint(1, min(experts, 6) + 1, (1,), generator=gen))
    block_size = 2 ** int(torch.randint(0, 7, (1,), generator=gen))
    ids = _ids(tokens, topk, experts, seed=seed + 100)
    out = moe_align_block_size_reference(ids, block_size, experts)
    flat = ids.reshape(-1)
    numel = flat.numel()
    sorted_ids = out.sorted_token_ids.tolist()
    expert_ids = out.expert_ids.tolist()
    assert len(sorted_ids) == max_padded_size(numel, experts, block_size)
    assert len(expert_ids) == -(-len(sorted_ids) // block_size)
    pos = 0
    for e in range(experts):
        pairs = [p for p in range(numel) if int(flat[p]) == e]
        length = -(-len(pairs) // block_size) * block_size
        segment = sorted_ids[pos:pos + length]
        assert segment == pairs + [numel] * (length - len(pairs))  # stable order, then padding
        assert expert_ids[pos // block_size:(pos + length) // block_size] == [e] * (length // block_size)
        pos += length
    assert out.num_tokens_post_padded.tolist() == [pos]
    assert sorted_ids[pos:] == [numel] * (len(sorted_ids) - pos)
    assert expert_ids[pos // block_size:] == [-1] * (len(expert_ids) - pos // block_size)


def test_ids_off_the_gpu_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="topk_ids is on cpu; the sort's kernels run on a CUDA device"):
        moe_align_block_size(_ids(4, 2, 8, seed=0), 16, 8)


@pytest.mark.parametrize("seed", range(40))
def test_gemm_blocks_covers_every_block_that_holds_pairs(seed):
    """The GEMM grids cover gemm_blocks row blocks: never fewer than the sort fills, never more than it has."""
    gen = torch.Generator().manual_seed(seed)
    tokens, topk = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    experts = int(torch.randint(topk, 200, (1,), generator=gen))
    block = [16, 32, 64, 128][seed % 4]
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
    filled = moe_align_block_size_reference(ids, block, experts).num_tokens_post_padded.item() // block
    bound = gemm_blocks(ids.numel(), experts, block)
    assert filled <= bound <= -(-max_padded_size(ids.numel(), experts, block) // block)


def test_gemm_blocks_in_the_decode_regime():
    # 1 token, top-8 of 128 experts, 16-row blocks: 8 blocks hold pairs, the padded sort has 121
    assert gemm_blocks(8, 128, 16) == 9 and -(-max_padded_size(8, 128, 16) // 16) == 121
    assert gemm_blocks(2, 8, 16) == 3  # Mixtral, 1 token: 2 of 8 blocks
    assert gemm_blocks(8192, 8, 64) == 128 + 8  # many pairs: the padded sort's 136 blocks, every one may fill
    assert gemm_blocks(0, 8, 16) == 1


def test_gemm_blocks_padded_when_switched_off(monkeypatch):
    from tritune.kernels import moe_align

    monkeypatch.setattr(moe_align, "GEMM_GRID_TIGHT", False)
    assert gemm_blocks(8, 128, 16) == 121  # the A/B baseline: every block of the padded sort


def test_sorted_rows_cover_the_gemm_blocks_within_the_padded_sort():
    assert sorted_rows(8, 128, 16) == 9 * 16 == 144  # decode: not the padded 1928
    assert sorted_rows(8192, 8, 64) == max_padded_size(8192, 8, 64)  # many pairs: the whole padded sort
    for seed, (tokens, topk, experts, block) in enumerate(((1, 1, 1, 16), (5, 1, 3, 64), (50, 2, 7, 16),
                                                            (11, 3, 200, 128), (3, 8, 128, 16))):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
        filled = int(moe_align_block_size_reference(ids, block, experts).num_tokens_post_padded.item())
        assert filled <= sorted_rows(ids.numel(), experts, block) <= max_padded_size(ids.numel(), experts, block)


@pytest.mark.parametrize("tokens", [pytest.param(7, id="one-launch sort"), pytest.param(300, id="multi-launch sort")])
def test_the_first_launch_copies_the_activations_in_the_k32_order_riding_along(tokens):
    """RideAlong(k32=True): the sort's first launch also writes hidden's rows in the K32 order (the swapped MXFP4
    stage 1's input) into its piece, as `k32_permute` lays them out; a row stride past the width (a strided view),
    and a width past one K32_BLOCK (1056 = 1024 + 32), are covered; the sort itself is unchanged."""
    from tritune.kernels.moe_align import AlignLaunch, RideAlong
    from tritune.kernels.mxfp4 import k32_permute

    gen = torch.Generator().manual_seed(tokens)
    wide = torch.randn(tokens, 1100, generator=gen).half().to(DEVICE)
    x = wide[:, :1056]  # row stride 1100
    ids = _ids(tokens, 2, 8, seed=tokens).to(DEVICE)
    launch = AlignLaunch(ids.reshape(-1), 16, 8, RideAlong(x=x, rows=tokens, cols=1056, stride=x.stride(0), k32=True))
    pieces = [torch.zeros(n, dtype=dt, device=DEVICE) for dt, n in launch.pieces]
    launch(ids.reshape(-1), pieces, x)
    assert pieces[launch.q_piece].dtype == torch.float16
    assert torch.equal(pieces[launch.q_piece].reshape(tokens, 1056).cpu(), k32_permute(x.cpu()))
    want = moe_align_block_size_reference(ids.cpu(), 16, 8)
    assert torch.equal(pieces[2][:1].cpu(), want.num_tokens_post_padded.reshape(-1)[:1].cpu())
