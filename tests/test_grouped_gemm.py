"""Grouped-GEMM kernels (forward, dX, dW) against an independent per-pair float64 truth: permutes, fused routing
weights, TMA loads/stores, persistent-grid edges, `out=`, group_by_expert and the launchers' validation errors.

Without a GPU these run in Triton's interpreter (tests/conftest.py), so shapes are small and odd and blocks are
16/32. Operands are fp16 or fp32 only: tl.dot on bf16 operands is wrong in the interpreter.

Routing used by every kernel test (see _routing): 7 experts, of which 0, 2 and 6 get no token (a zero-row expert
first, inside and last in the prefix sums), and expert 3 is chosen by all tokens but every eighth one, so it has
more rows than BLOCK_SIZE_M (several M tiles, the last one partial).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_gemm import (
    _dw_tile,
    group_by_expert,
    grouped_gemm_dw,
    grouped_gemm_dx,
    grouped_gemm_forward,
)
from tritune.kernels.grouped_gemm_config import (
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    check_compiles_here,
    compiles_here,
)
from tritune.kernels.grouped_gemm_reference import (
    grouped_gemm_dw_reference,
    grouped_gemm_dx_reference,
    grouped_gemm_reference,
)
from tritune.knobs import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS = 7
USED = (1, 3, 4, 5)  # experts 0, 2 and 6 never get a token
HEAVY = 3  # routed from every token t with t % 8 != 7
TOKENS = 19  # HEAVY gets 17 rows > BLOCK_SIZE_M = 16: two M tiles, the second with one row
SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)

# (relative L2 error bound, assert_close atol, rtol) per operand dtype, against the float64 truth
TOL = {torch.float16: (2e-3, 2e-2, 2e-2), torch.float32: (1e-4, 1e-4, 1e-4)}
if DEVICE == "cuda":  # on the GPU tl.dot multiplies fp32 operands as TF32 (10-bit mantissa), as torch allows
    TOL[torch.float32] = (2e-3, 2e-2, 2e-2)


def _routing(tokens: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [tokens, topk] int64: distinct experts per token, drawn from USED, HEAVY in a random slot of every
    token but each eighth one."""
    others = [e for e in USED if e != HEAVY]
    ids = torch.empty(tokens, topk, dtype=torch.int64)
    for t in range(tokens):
        chosen = [HEAVY] if t % 8 != 7 else []
        chosen += [others[i] for i in torch.randperm(len(others), generator=gen).tolist()][: topk - len(chosen)]
        ids[t] = torch.tensor(chosen)[torch.randperm(topk, generator=gen)]
    return ids


@dataclass
class Problem:
    topk: int
    ids: torch.Tensor  # [T, topk] int64
    m_sizes: torch.Tensor  # int32 [E]
    gather: torch.Tensor  # int32 [P]: grouped row -> pair position
    x_tok: torch.Tensor  # [T, K] token order
    x_grouped: torch.Tensor  # [P, K] grouped order
    w: torch.Tensor  # [E, N, K]
    dy_pair: torch.Tensor  # [P, N] pair order
    dy_grouped: torch.Tensor  # [P, N] grouped order
    weights: torch.Tensor  # [T, topk] fp32 routing weights

    @property
    def flat_ids(self) -> torch.Tensor:
        return self.ids.reshape(-1)

    @property
    def pair_token(self) -> torch.Tensor:
        return torch.arange(self.flat_ids.numel()) // self.topk


def _problem(*, tokens: int = TOKENS, topk: int = 2, k: int = 40, n: int = 24, dtype: torch.dtype = torch.float16,
             seed: int = 0) -> Problem:
    """A seeded routing and operands; m_sizes and gather_indices are built here with torch only (not through
    group_by_expert, which has its own test)."""
    gen = torch.Generator().manual_seed(seed)
    ids = _routing(tokens, topk, gen)
    flat = ids.reshape(-1)
    m_sizes = torch.bincount(flat, minlength=NUM_EXPERTS).to(torch.int32)
    gather = torch.argsort(flat, stable=True).to(torch.int32)
    x_tok = torch.randn(tokens, k, generator=gen).to(dtype)
    w = (torch.randn(NUM_EXPERTS, n, k, generator=gen) / math.sqrt(k)).to(dtype)
    dy_pair = torch.randn(tokens * topk, n, generator=gen).to(dtype)
    weights = torch.rand(tokens, topk, generator=gen) + 0.5
    assert (m_sizes[[0, 2, 6]] == 0).all() and m_sizes[HEAVY] >= SMALL["BLOCK_SIZE_M"]
    x_grouped = x_tok[gather.long() // topk].contiguous()
    dy_grouped = dy_pair[gather.long()].contiguous()
    return Problem(topk=topk, ids=ids, m_sizes=m_sizes.to(DEVICE), gather=gather.to(DEVICE),
                   x_tok=x_tok.to(DEVICE), x_grouped=x_grouped.to(DEVICE), w=w.to(DEVICE),
                   dy_pair=dy_pair.to(DEVICE), dy_grouped=dy_grouped.to(DEVICE), weights=weights.to(DEVICE))


# ---- independent float64 truth, pair by pair (p = token * topk + slot) ----

def _truth_forward(pb: Problem, *, permute_y: bool = False, fuse_mul_post: bool = False) -> torch.Tensor:
    x = pb.x_tok.cpu().double()[pb.pair_token]  # [P, K]
    y = torch.einsum("pk,pnk->pn", x, pb.w.cpu().double()[pb.flat_ids])
    if fuse_mul_post:
        y = y * pb.weights.cpu().double().reshape(-1)[:, None]
    return y if permute_y else y[pb.gather.cpu().long()]


def _truth_dx(pb: Problem, *, permute_x: bool = False) -> torch.Tensor:
    dx = torch.einsum("pn,pnk->pk", pb.dy_pair.cpu().double(), pb.w.cpu().double()[pb.flat_ids])
    return dx if permute_x else dx[pb.gather.cpu().long()]


def _truth_dw(pb: Problem) -> torch.Tensor:
    x = pb.x_tok.cpu().double()[pb.pair_token]
    outer = pb.dy_pair.cpu().double()[:, :, None] * x[:, None, :]
    dw = torch.zeros((NUM_EXPERTS, *outer.shape[1:]), dtype=torch.float64)
    return dw.index_add_(0, pb.flat_ids, outer)


def _buildable(cfg, launch):
    """cfg where this Triton builds it for the GPU; else (flatten with a TMA store on Triton 3.6, GPU runs only) the
    launch must refuse it in one line, and the case goes on with flatten=False."""
    if compiles_here(cfg, triton.__version__, interpreting()):
        return cfg
    with pytest.raises(ValueError, match="use flatten=False"):
        launch(cfg)
    return dataclasses.replace(cfg, flatten=False)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite elements"
    got = got.cpu().double()
    rel_bound, atol, rtol = TOL[dtype]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < rel_bound, f"relative L2 error {rel:.2e} >= {rel_bound:.0e}"
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# ---- forward ----

def _forward(pb: Problem, cfg: KernelConfigForward, **kwargs) -> torch.Tensor:
    return grouped_gemm_forward(pb.x_tok if cfg.permute_x else pb.x_grouped, pb.w, pb.m_sizes, cfg, topk=pb.topk,
                                gather_indices=pb.gather, topk_weights=pb.weights, **kwargs)


FORWARD_CASES = [
    # plain grouped X -> grouped Y; K=40, N=24 are not multiples of the 16/32 blocks
    pytest.param({}, {}, None, id="plain"),
    # odd K and N: masked K tail, rows that are not 16-byte multiples (fine without TMA)
    pytest.param({}, dict(k=37, n=21), None, id="plain-odd-k37-n21"),
    # K a multiple of BLOCK_SIZE_K: the unmasked EVEN_K loads
    pytest.param({}, dict(k=64, n=24), None, id="plain-even-k"),
    # BLOCK_SIZE_M=N=K=32 with 41 tokens (heavy expert 36 rows: two M tiles, K tail 8, one partial N tile)
    pytest.param(dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32), dict(tokens=41), None, id="blocks-32"),
    # 18 tokens: the heavy expert has exactly BLOCK_SIZE_M=16 rows (one full M tile, no partial one)
    pytest.param({}, dict(tokens=18), None, id="heavy-exactly-one-m-tile"),
    # permute_x, topk 1: token row = pair position
    pytest.param(dict(permute_x=True), dict(topk=1), None, id="permute_x-topk1"),
    # permute_x, topk 2: token row = pair // 2
    pytest.param(dict(permute_x=True), dict(topk=2), None, id="permute_x-topk2"),
    # permute_x, topk 3: token row = pair // 3
    pytest.param(dict(permute_x=True), dict(topk=3), None, id="permute_x-topk3"),
    # permute_y: Y scattered to pair order
    pytest.param(dict(permute_y=True), dict(topk=3), None, id="permute_y-topk3"),
    # fuse_mul_post alone: rows scaled by topk_weights[gather[g]] in grouped order
    pytest.param(dict(fuse_mul_post=True), {}, None, id="fuse_mul_post"),
    # fuse_mul_post with the gathered X
    pytest.param(dict(fuse_mul_post=True, permute_x=True), dict(topk=3), None, id="fuse_mul_post-permute_x"),
    # fuse_mul_post with the scattered Y
    pytest.param(dict(fuse_mul_post=True, permute_y=True), {}, None, id="fuse_mul_post-permute_y"),
    # TMA load of X alone (rows past an expert come from the next expert and must never be stored)
    pytest.param(dict(use_tma_load_x=True), {}, None, id="tma-load_x"),
    # TMA load of W alone (rows past N come from the next expert's W; K tail zero-filled)
    pytest.param(dict(use_tma_load_w=True), {}, None, id="tma-load_w"),
    # TMA store alone (full M tiles through the descriptor, the partial one through masked stores)
    pytest.param(dict(use_tma_store=True), {}, None, id="tma-store"),
    # all three TMA flags, uneven K=72 / N=56 against 32-blocks
    pytest.param(dict(use_tma_load_x=True, use_tma_load_w=True, use_tma_store=True, BLOCK_SIZE_N=32,
                      BLOCK_SIZE_K=32), dict(k=72, n=56), None, id="tma-all"),
    # permute_x with the TMA flags it allows (load_w, store)
    pytest.param(dict(permute_x=True, use_tma_load_w=True, use_tma_store=True), dict(topk=3), None,
                 id="tma-load_w-store-permute_x"),
    # permute_y with all TMA flags (the store flag must give way to the scatter)
    pytest.param(dict(permute_y=True, use_tma_load_x=True, use_tma_load_w=True, use_tma_store=True), {}, None,
                 id="tma-all-permute_y"),
    # one persistent program walks every tile
    pytest.param({}, {}, 1, id="num_programs-1"),
    # more programs requested than there are tiles
    pytest.param(dict(permute_x=True), {}, 1000, id="num_programs-1000"),
    # flatten=False loop
    pytest.param(dict(flatten=False), {}, 3, id="flatten-false"),
    # fp32 operands, plain
    pytest.param({}, dict(dtype=torch.float32), None, id="fp32-plain"),
    # fp32 operands with permute_x, fuse_mul_post and TMA load_w/store
    pytest.param(dict(permute_x=True, fuse_mul_post=True, use_tma_load_w=True, use_tma_store=True),
                 dict(dtype=torch.float32, topk=3), None, id="fp32-permute_x-fuse-tma"),
]


@pytest.mark.parametrize(("cfg_kwargs", "pb_kwargs", "num_programs"), FORWARD_CASES)
def test_forward(cfg_kwargs, pb_kwargs, num_programs):
    pb = _problem(**pb_kwargs)
    cfg = _buildable(KernelConfigForward(**{**SMALL, **cfg_kwargs}), lambda c: _forward(pb, c))
    y = _forward(pb, cfg, num_programs=num_programs)
    want = _truth_forward(pb, permute_y=cfg.permute_y, fuse_mul_post=cfg.fuse_mul_post)
    _assert_matches(y, want, pb.x_tok.dtype)


# ---- dX ----

def _dx(pb: Problem, cfg: KernelConfigBackward_dX, **kwargs) -> torch.Tensor:
    return grouped_gemm_dx(pb.dy_pair if cfg.permute_y else pb.dy_grouped, pb.w, pb.m_sizes, cfg, topk=pb.topk,
                           gather_indices=pb.gather, **kwargs)


DX_CASES = [
    # plain grouped dY -> grouped dX
    pytest.param({}, {}, None, id="plain"),
    # permute_x: dX scattered to pair order
    pytest.param(dict(permute_x=True), dict(topk=3), None, id="permute_x"),
    # permute_y: dY gathered from pair order
    pytest.param(dict(permute_y=True), dict(topk=3), None, id="permute_y"),
    # TMA load of dY alone
    pytest.param(dict(use_tma_load_dy=True), {}, None, id="tma-load_dy"),
    # TMA load of W alone (rows past N are the next expert's: dY must be zero there)
    pytest.param(dict(use_tma_load_w=True), {}, None, id="tma-load_w"),
    # TMA store alone
    pytest.param(dict(use_tma_store=True), {}, None, id="tma-store"),
    # all TMA flags
    pytest.param(dict(use_tma_load_dy=True, use_tma_load_w=True, use_tma_store=True), {}, None, id="tma-all"),
    # permute_x with all TMA flags (the store flag must give way to the scatter)
    pytest.param(dict(permute_x=True, use_tma_load_dy=True, use_tma_load_w=True, use_tma_store=True), {}, None,
                 id="tma-all-permute_x"),
    # permute_y with the TMA flags it allows (load_w, store)
    pytest.param(dict(permute_y=True, use_tma_load_w=True, use_tma_store=True), {}, None,
                 id="tma-load_w-store-permute_y"),
    # reduction dim N=21 not a multiple of BLOCK_SIZE_N=16, odd K=37 (no TMA)
    pytest.param({}, dict(k=37, n=21), None, id="uneven-n21-k37"),
    # uneven N=40 against BLOCK_SIZE_N=32 with every TMA flag (W rows 40..63 belong to the next expert)
    pytest.param(dict(use_tma_load_dy=True, use_tma_load_w=True, use_tma_store=True, BLOCK_SIZE_N=32,
                      BLOCK_SIZE_K=32), dict(k=72, n=40), None, id="uneven-n40-tma-all"),
    # 36 tokens, TMA store: the heavy expert has 32 rows = two full M tiles through the descriptor, no partial one
    pytest.param(dict(use_tma_store=True, permute_y=True), dict(tokens=36), None, id="heavy-two-full-m-tiles"),
    # N a multiple of BLOCK_SIZE_N: the unmasked EVEN_N loads
    pytest.param({}, dict(n=32), None, id="even-n"),
    # one program, flatten=False
    pytest.param(dict(flatten=False), {}, 1, id="num_programs-1-flatten-false"),
    # more programs than tiles
    pytest.param(dict(permute_y=True), {}, 1000, id="num_programs-1000"),
    # fp32 operands, plain
    pytest.param({}, dict(dtype=torch.float32), None, id="fp32-plain"),
    # fp32 operands, permute_x with TMA loads
    pytest.param(dict(permute_x=True, use_tma_load_dy=True, use_tma_load_w=True), dict(dtype=torch.float32), None,
                 id="fp32-permute_x-tma"),
]


@pytest.mark.parametrize(("cfg_kwargs", "pb_kwargs", "num_programs"), DX_CASES)
def test_dx(cfg_kwargs, pb_kwargs, num_programs):
    pb = _problem(**pb_kwargs)
    cfg = _buildable(KernelConfigBackward_dX(**{**SMALL, **cfg_kwargs}), lambda c: _dx(pb, c))
    dx = _dx(pb, cfg, num_programs=num_programs)
    _assert_matches(dx, _truth_dx(pb, permute_x=cfg.permute_x), pb.dy_pair.dtype)


# ---- dW ----

def _dw(pb: Problem, cfg: KernelConfigBackward_dW, **kwargs) -> torch.Tensor:
    return grouped_gemm_dw(pb.x_tok if cfg.permute_x else pb.x_grouped, pb.dy_pair if cfg.permute_y else pb.dy_grouped,
                           pb.m_sizes, cfg, topk=pb.topk, gather_indices=pb.gather, **kwargs)


DW_CASES = [
    # plain grouped X and dY
    pytest.param({}, {}, None, id="plain"),
    # permute_x: X gathered from token order, topk 3
    pytest.param(dict(permute_x=True), dict(topk=3), None, id="permute_x"),
    # permute_y: dY gathered from pair order
    pytest.param(dict(permute_y=True), dict(topk=3), None, id="permute_y"),
    # TMA load of dY alone
    pytest.param(dict(use_tma_load_dy=True), {}, None, id="tma-load_dy"),
    # TMA load of X alone (rows past an expert are the next expert's: dY must be zeroed there)
    pytest.param(dict(use_tma_load_x=True), {}, None, id="tma-load_x"),
    # TMA store alone (N=24: one full N tile through the descriptor, the partial one masked)
    pytest.param(dict(use_tma_store=True), {}, None, id="tma-store"),
    # all TMA flags
    pytest.param(dict(use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True), {}, None, id="tma-all"),
    # permute_x with the TMA flags it allows (load_dy, store)
    pytest.param(dict(permute_x=True, use_tma_load_dy=True, use_tma_store=True), dict(topk=2), None,
                 id="tma-load_dy-store-permute_x"),
    # permute_y with the TMA flags it allows (load_x, store)
    pytest.param(dict(permute_y=True, use_tma_load_x=True, use_tma_store=True), dict(topk=2), None,
                 id="tma-load_x-store-permute_y"),
    # uneven N=21 and K=37 (wrapped column loads, masked tails; no TMA)
    pytest.param({}, dict(k=37, n=21), None, id="uneven-n21-k37"),
    # uneven N=40, K=56 against 32-blocks with every TMA flag
    pytest.param(dict(use_tma_load_dy=True, use_tma_load_x=True, use_tma_store=True, BLOCK_SIZE_N=32,
                      BLOCK_SIZE_K=32), dict(k=56, n=40), None, id="uneven-n40-k56-tma-all"),
    # 18 tokens: the heavy expert has exactly BLOCK_SIZE_M=16 rows (a full row block and no tail block)
    pytest.param({}, dict(tokens=18, topk=1), None, id="heavy-exactly-one-m-block"),
    # 36 tokens with TMA loads: heavy expert 32 rows = two full row blocks, others a tail block only
    pytest.param(dict(use_tma_load_dy=True, use_tma_load_x=True), dict(tokens=36, topk=3), None,
                 id="heavy-two-full-m-blocks-tma"),
    # BLOCK_SIZE_M=32 with 41 tokens: heavy expert reduced over two M steps of 32
    pytest.param(dict(BLOCK_SIZE_M=32), dict(tokens=41, topk=1), None, id="blocks-m32-topk1"),
    # one program, flatten=False
    pytest.param(dict(flatten=False), {}, 1, id="num_programs-1-flatten-false"),
    # more programs than tiles
    pytest.param(dict(permute_x=True), {}, 1000, id="num_programs-1000"),
    # N tiles in groups of 2 along K: N=40 is 3 tiles (the last group one tile wide), K=56 is 4 tiles
    pytest.param(dict(GROUP_SIZE_N=2, use_tma_load_dy=True, use_tma_load_x=True), dict(k=56, n=40), 3,
                 id="group-n2-uneven"),
    # fp32 operands, plain
    pytest.param({}, dict(dtype=torch.float32), None, id="fp32-plain"),
    # fp32 operands, permute_y with TMA load_x and store
    pytest.param(dict(permute_y=True, use_tma_load_x=True, use_tma_store=True), dict(dtype=torch.float32), None,
                 id="fp32-permute_y-tma"),
]


@pytest.mark.parametrize(("cfg_kwargs", "pb_kwargs", "num_programs"), DW_CASES)
def test_dw(cfg_kwargs, pb_kwargs, num_programs):
    pb = _problem(**pb_kwargs)
    cfg = KernelConfigBackward_dW(**{**SMALL, **cfg_kwargs})
    dw = _dw(pb, cfg, num_programs=num_programs)
    _assert_matches(dw, _truth_dw(pb), pb.x_tok.dtype)


@pytest.mark.parametrize("cfg_kwargs", [
    # masked stores write the zero slices
    pytest.param({}, id="masked-store"),
    # TMA store writes the zero slices (N=24: one descriptor tile and one masked tile per expert)
    pytest.param(dict(use_tma_store=True, use_tma_load_x=True), id="tma-store"),
])
def test_dw_zero_token_expert_overwrites_nan(cfg_kwargs):
    pb = _problem()
    cfg = KernelConfigBackward_dW(**{**SMALL, **cfg_kwargs})
    out = torch.full(pb.w.shape, math.nan, dtype=pb.w.dtype, device=DEVICE)
    dw = _dw(pb, cfg, out=out)
    assert dw is out
    empty = (pb.m_sizes == 0).nonzero().flatten().tolist()
    assert empty == [0, 2, 6]
    assert (dw[empty] == 0).all(), "an expert with no tokens must get an all-zero dW, not the buffer's old values"
    _assert_matches(dw, _truth_dw(pb), pb.x_tok.dtype)


# ---- out= ----

@pytest.mark.parametrize("kernel", [
    # forward, Y scattered to pair order: every pair row must be written
    pytest.param("forward", id="forward-permute_y"),
    # dX scattered to pair order: every pair row must be written
    pytest.param("dx", id="dx-permute_x"),
    # dW with TMA store
    pytest.param("dw", id="dw-tma-store"),
])
def test_out_is_written_in_place_and_returned(kernel):
    pb = _problem(topk=3)
    if kernel == "forward":
        cfg = KernelConfigForward(**SMALL, permute_y=True)
        out = torch.full((pb.gather.numel(), pb.w.shape[1]), math.nan, dtype=torch.float16, device=DEVICE)
        got, want = _forward(pb, cfg, out=out), _truth_forward(pb, permute_y=True)
    elif kernel == "dx":
        cfg = KernelConfigBackward_dX(**SMALL, permute_x=True)
        out = torch.full((pb.gather.numel(), pb.w.shape[2]), math.nan, dtype=torch.float16, device=DEVICE)
        got, want = _dx(pb, cfg, out=out), _truth_dx(pb, permute_x=True)
    else:
        cfg = KernelConfigBackward_dW(**SMALL, use_tma_store=True)
        out = torch.full(pb.w.shape, math.nan, dtype=torch.float16, device=DEVICE)
        got, want = _dw(pb, cfg, out=out), _truth_dw(pb)
    ptr = out.data_ptr()
    assert got is out and out.data_ptr() == ptr
    _assert_matches(out, want, torch.float16)


# ---- the package's fp32 references agree with the per-pair truth ----

@pytest.mark.parametrize("mode", [
    # no permute
    pytest.param("plain"),
    # gathered X / scattered dX
    pytest.param("permute_x"),
    # scattered Y / gathered dY, with the routing weights
    pytest.param("permute_y"),
])
def test_references_match_truth(mode):
    pb = _problem(topk=3, dtype=torch.float32)
    px, py = mode == "permute_x", mode == "permute_y"
    kw = dict(topk=3, gather_indices=pb.gather, permute_x=px, permute_y=py)
    x = pb.x_tok if px else pb.x_grouped
    dy = pb.dy_pair if py else pb.dy_grouped
    y = grouped_gemm_reference(x, pb.w, pb.m_sizes, topk_weights=pb.weights, fuse_mul_post=py, **kw)
    _assert_matches(y, _truth_forward(pb, permute_y=py, fuse_mul_post=py), torch.float32)
    _assert_matches(grouped_gemm_dx_reference(dy, pb.w, pb.m_sizes, **kw), _truth_dx(pb, permute_x=px), torch.float32)
    _assert_matches(grouped_gemm_dw_reference(x, dy, pb.m_sizes, **kw), _truth_dw(pb), torch.float32)


# ---- group_by_expert ----

@pytest.mark.parametrize(("tokens", "topk", "num_experts"), [
    # topk 1, more experts than tokens use (some empty)
    pytest.param(11, 1, 7, id="topk1"),
    # topk 2 over a prime number of experts, many ties
    pytest.param(13, 2, 5, id="topk2"),
    # topk 3, experts drawn from a subset so the first and last are empty
    pytest.param(9, 3, 7, id="topk3-subset"),
])
def test_group_by_expert(tokens, topk, num_experts):
    gen = torch.Generator().manual_seed(tokens * 10 + topk)
    if topk == 3:
        ids = torch.randint(1, num_experts - 1, (tokens, topk), generator=gen)
    else:
        ids = torch.randint(0, num_experts, (tokens, topk), generator=gen)
    m_sizes, gather = group_by_expert(ids.to(DEVICE), num_experts)
    m_sizes, gather = m_sizes.cpu(), gather.cpu()
    flat = ids.reshape(-1)
    assert m_sizes.dtype == torch.int32 and gather.dtype == torch.int32
    assert m_sizes.shape == (num_experts,) and gather.shape == (tokens * topk,)
    assert int(m_sizes.sum()) == tokens * topk
    assert torch.equal(m_sizes, torch.bincount(flat, minlength=num_experts).to(torch.int32))
    if topk == 3:
        assert m_sizes[0] == 0 and m_sizes[-1] == 0
    g = gather.long()
    assert torch.equal(torch.sort(g).values, torch.arange(tokens * topk)), "not a permutation"
    assert torch.equal(flat[g], torch.sort(flat, stable=True).values), "does not sort the ids"
    same_expert = flat[g][1:] == flat[g][:-1]
    assert (g[1:][same_expert] > g[:-1][same_expert]).all(), "not stable: one expert's pairs out of pair order"
    assert torch.equal(g, torch.argsort(flat, stable=True))


# ---- validation errors ----

def _error_case(kernel: str, cfg_kwargs: dict, *, k: int = 40, m_sizes_dtype=torch.int32, gather=True,
                weights=True, config_cls=None):
    pb = _problem(k=k)
    m_sizes = pb.m_sizes.to(m_sizes_dtype)
    gather_indices = pb.gather if gather else None
    if kernel == "forward":
        cfg = (config_cls or KernelConfigForward)(**{**SMALL, **cfg_kwargs})
        x = pb.x_tok if cfg_kwargs.get("permute_x") else pb.x_grouped
        return lambda: grouped_gemm_forward(x, pb.w, m_sizes, cfg, topk=pb.topk, gather_indices=gather_indices,
                                            topk_weights=pb.weights if weights else None)
    if kernel == "dx":
        cfg = (config_cls or KernelConfigBackward_dX)(**{**SMALL, **cfg_kwargs})
        dy = pb.dy_pair if cfg_kwargs.get("permute_y") else pb.dy_grouped
        return lambda: grouped_gemm_dx(dy, pb.w, m_sizes, cfg, topk=pb.topk, gather_indices=gather_indices)
    cfg = (config_cls or KernelConfigBackward_dW)(**{**SMALL, **cfg_kwargs})
    x = pb.x_tok if cfg_kwargs.get("permute_x") else pb.x_grouped
    dy = pb.dy_pair if cfg_kwargs.get("permute_y") else pb.dy_grouped
    return lambda: grouped_gemm_dw(x, dy, m_sizes, cfg, topk=pb.topk, gather_indices=gather_indices)


ERROR_CASES = [
    # both permutes in one forward
    pytest.param("forward", dict(permute_x=True, permute_y=True), {}, ValueError, "cannot both be set", id="fwd-both"),
    # both permutes in one dX
    pytest.param("dx", dict(permute_x=True, permute_y=True), {}, ValueError, "cannot both be set", id="dx-both"),
    # both permutes in one dW
    pytest.param("dw", dict(permute_x=True, permute_y=True), {}, ValueError, "cannot both be set", id="dw-both"),
    # forward permute_x without gather_indices
    pytest.param("forward", dict(permute_x=True), dict(gather=False), ValueError, "needs gather_indices",
                 id="fwd-permute_x-no-gather"),
    # forward fuse_mul_post without gather_indices
    pytest.param("forward", dict(fuse_mul_post=True), dict(gather=False), ValueError, "needs gather_indices",
                 id="fwd-fuse-no-gather"),
    # dX permute_y without gather_indices
    pytest.param("dx", dict(permute_y=True), dict(gather=False), ValueError, "needs gather_indices",
                 id="dx-permute_y-no-gather"),
    # dW permute_x without gather_indices
    pytest.param("dw", dict(permute_x=True), dict(gather=False), ValueError, "needs gather_indices",
                 id="dw-permute_x-no-gather"),
    # int64 m_sizes on each launcher
    pytest.param("forward", {}, dict(m_sizes_dtype=torch.int64), ValueError, "m_sizes must be a 1-D int32",
                 id="fwd-m_sizes-int64"),
    # int64 m_sizes, dX
    pytest.param("dx", {}, dict(m_sizes_dtype=torch.int64), ValueError, "m_sizes must be a 1-D int32",
                 id="dx-m_sizes-int64"),
    # int64 m_sizes, dW
    pytest.param("dw", {}, dict(m_sizes_dtype=torch.int64), ValueError, "m_sizes must be a 1-D int32",
                 id="dw-m_sizes-int64"),
    # a dX config given to the forward
    pytest.param("forward", {}, dict(config_cls=KernelConfigBackward_dX), TypeError,
                 "expected a KernelConfigForward", id="fwd-wrong-config"),
    # a forward config given to dX
    pytest.param("dx", {}, dict(config_cls=KernelConfigForward), TypeError, "expected a KernelConfigBackward_dX",
                 id="dx-wrong-config"),
    # a dX config given to dW
    pytest.param("dw", {}, dict(config_cls=KernelConfigBackward_dX), TypeError, "expected a KernelConfigBackward_dW",
                 id="dw-wrong-config"),
    # K=36 fp16 = 72-byte rows: no TMA on W
    pytest.param("forward", dict(use_tma_load_w=True), dict(k=36), ValueError, "TMA on w needs rows of 16-byte",
                 id="fwd-tma-w-k36"),
    # K=36 fp16: no TMA store of dX (flatten off: Triton 3.6 refuses a flattened loop around a TMA store first)
    pytest.param("dx", dict(use_tma_store=True, flatten=False), dict(k=36), ValueError,
                 "TMA on dx needs rows of 16-byte",
                 id="dx-tma-store-k36"),
    # K=36 fp16: no TMA load of X in dW
    pytest.param("dw", dict(use_tma_load_x=True), dict(k=36), ValueError, "TMA on x needs rows of 16-byte",
                 id="dw-tma-x-k36"),
    # forward: TMA cannot load gathered X rows
    pytest.param("forward", dict(permute_x=True, use_tma_load_x=True), {}, ValueError,
                 "use_tma_load_x cannot load rows gathered", id="fwd-tma-x-permute_x"),
    # dW: TMA cannot load gathered X rows
    pytest.param("dw", dict(permute_x=True, use_tma_load_x=True), {}, ValueError,
                 "use_tma_load_x cannot load rows gathered", id="dw-tma-x-permute_x"),
    # dX: TMA cannot load gathered dY rows
    pytest.param("dx", dict(permute_y=True, use_tma_load_dy=True), {}, ValueError,
                 "use_tma_load_dy cannot load rows gathered", id="dx-tma-dy-permute_y"),
    # dW: TMA cannot load gathered dY rows
    pytest.param("dw", dict(permute_y=True, use_tma_load_dy=True), {}, ValueError,
                 "use_tma_load_dy cannot load rows gathered", id="dw-tma-dy-permute_y"),
    # fuse_mul_post with gather_indices but no topk_weights
    pytest.param("forward", dict(fuse_mul_post=True), dict(weights=False), ValueError,
                 "fuse_mul_post needs topk_weights", id="fwd-fuse-no-weights"),
]


@pytest.mark.parametrize(("kernel", "cfg_kwargs", "case_kwargs", "exc", "match"), ERROR_CASES)
def test_errors(kernel, cfg_kwargs, case_kwargs, exc, match):
    call = _error_case(kernel, cfg_kwargs, **case_kwargs)
    with pytest.raises(exc, match=match):
        call()


@triton.jit
def _dw_tiles_of(out_ptr, n_tiles, k_tiles, TILES: tl.constexpr, GROUP_SIZE_N: tl.constexpr):
    local = tl.arange(0, TILES)
    keep = local < n_tiles * k_tiles
    pid_n, pid_k = _dw_tile(tl.where(keep, local, 0), n_tiles, k_tiles, GROUP_SIZE_N)  # the kernel's are in range
    tl.store(out_ptr + 2 * local, pid_n, mask=keep)
    tl.store(out_ptr + 2 * local + 1, pid_k, mask=keep)


@pytest.mark.parametrize(("n_tiles", "k_tiles", "group"), [(1, 5, 8), (7, 3, 2), (12, 1, 4), (5, 4, 1), (9, 6, 8)])
def test_dw_tile_order_visits_every_tile_once(n_tiles, k_tiles, group):
    out = torch.full((2 * 64,), -1, dtype=torch.int32, device=DEVICE)
    _dw_tiles_of[(1,)](out, n_tiles, k_tiles, TILES=64, GROUP_SIZE_N=group)
    order = [tuple(p) for p in out.view(-1, 2)[: n_tiles * k_tiles].tolist()]
    assert sorted(order) == [(n, k) for n in range(n_tiles) for k in range(k_tiles)]
    # within a group, N tiles run fastest, then K: the first min(group, n_tiles) tiles share K tile 0
    width = min(group, n_tiles)
    assert order[:width] == [(n, 0) for n in range(width)]


@pytest.mark.parametrize(("config", "version", "interpreter", "builds"), [
    (KernelConfigForward(use_tma_store=True), "3.6.0", False, False),  # flatten=True is the default
    (KernelConfigBackward_dX(use_tma_store=True), "3.6.0", False, False),
    (KernelConfigForward(use_tma_store=True), "3.9.0", False, True),
    (KernelConfigForward(use_tma_store=True), "3.6.0", True, True),  # the interpreter compiles nothing
    (KernelConfigForward(use_tma_store=True, flatten=False), "3.6.0", False, True),
    (KernelConfigForward(use_tma_store=True, permute_y=True), "3.6.0", False, True),  # Y scattered: no TMA store
    (KernelConfigBackward_dX(use_tma_store=True, permute_x=True), "3.6.0", False, True),  # dX scattered likewise
    (KernelConfigBackward_dW(use_tma_store=True), "3.6.0", False, True),  # dW builds either way
])
def test_flatten_with_a_tma_store_is_refused_where_triton_cannot_build_it(config, version, interpreter, builds):
    assert compiles_here(config, version, interpreter) is builds
    if builds:
        check_compiles_here(config, version, interpreter)
    else:
        with pytest.raises(ValueError, match=r"flatten=True with a TMA store needs a Triton newer than 3\.6 .*"
                                             r"this is Triton 3\.6\.0: use flatten=False"):
            check_compiles_here(config, version, interpreter)
