"""Grouped GEMM for MoE training: Y = X·W[e]ᵀ (forward), dX = dY·W[e] and dW[e] = dY[e]ᵀ·X[e], rows grouped by
expert through per-expert counts, with the MoE permutes fused into the loads and stores.

Layout: W [E, N, K]; m_sizes int32 [E] (rows per expert, summing to P); "grouped order" is the rows of all
experts one after another (expert 0's m_sizes[0] rows first). gather_indices int32 [P]: for grouped row g, the
position in "pair order" (p = token·topk + slot) of the pair it holds; X in token order has T = P / topk rows.
Each kernel is persistent (one program per SM walks the tiles), finds a tile's expert from a prefix sum of the
counts held in registers, and needs no host sync. Kernels take a config and launch; they never tune.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_gemm_config import (
    KernelConfig,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    check_compiles_here,
    stores_through_tma,
)
from tritune.kernels.grouped_launch import Desc, launch
from tritune.knobs import interpreting


@triton.jit
def _expert_tiles(m_sizes_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                  col_tiles):
    """(expert ids, row counts, tiles per expert, their running end, total tiles) for BLOCK_SIZE_M row blocks
    times `col_tiles` output-column tiles, the counts loaded once into registers."""
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(m_sizes_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    tiles = tl.cdiv(counts, BLOCK_SIZE_M) * col_tiles
    return offs_e, counts, tiles, tl.cumsum(tiles, axis=0), tl.sum(tiles, axis=0)


@triton.jit
def _tile_expert(t, offs_e, counts, tiles, tiles_end, BLOCK_SIZE_M: tl.constexpr):
    """(expert, its first grouped row, its row count, row block, column tile) of tile t; row blocks run fastest
    within an expert."""
    e = tl.sum((tiles_end <= t).to(tl.int32), axis=0)
    before = offs_e < e
    tile0 = tl.sum(tl.where(before, tiles, 0), axis=0)
    row0 = tl.sum(tl.where(before, counts, 0), axis=0)
    m_e = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    m_tiles = tl.cdiv(m_e, BLOCK_SIZE_M)
    return e, row0, m_e, (t - tile0) % m_tiles, (t - tile0) // m_tiles


@triton.jit
def _padded_row0(e, offs_e, counts, NUM_EXPERTS: tl.constexpr, PAD_TO: tl.constexpr):
    """Expert e's first row in a layout padded per expert to whole PAD_TO-row blocks, an empty expert keeping one
    block (the scheduled dW's layout: `grouped_dw_scheduled.pad`)."""
    blocks = tl.where(offs_e < NUM_EXPERTS, tl.maximum(tl.cdiv(counts, PAD_TO), 1), 0)
    return tl.sum(tl.where(offs_e < e, blocks, 0), axis=0) * PAD_TO


@triton.jit
def _dw_tile(local, n_tiles, k_tiles, GROUP_SIZE_N: tl.constexpr):
    """(N tile, K tile) of an expert's local dW tile index: K tiles run fastest across groups of GROUP_SIZE_N N
    tiles, N tiles fastest within a group, so the tiles in flight at once read a few dY column stripes and a few X
    column stripes instead of one dY stripe and all of X (which outgrows the L2 when K is long, e.g. Mixtral's down
    dW reads 56 MB of X per expert). GROUP_SIZE_N 1: one N tile at a time, K tiles fastest."""
    in_group = GROUP_SIZE_N * k_tiles
    first_n = (local // in_group) * GROUP_SIZE_N
    size = tl.minimum(n_tiles - first_n, GROUP_SIZE_N)
    return first_n + (local % in_group) % size, (local % in_group) // size


@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _grouped_fwd_kernel(
    x_ptr, x_desc,  # permute_x: [T, K] token order, else [P, K] grouped (padded per expert with PAD_X_TO)
    w_ptr, w_desc,  # [E, N, K]; desc over [E·N, K] block [BN, BK]
    y_ptr, y_desc,  # [P, N]: pair order with permute_y, else grouped; desc [P, N] block [BM, BN]
    m_sizes_ptr, gather_ptr, topk_w_ptr,  # int32 [E]; int32 [P]; [P] in pair order (fuse_mul_post)
    N, K,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, NUM_PROGRAMS,
    PERMUTE_X: tl.constexpr, PERMUTE_Y: tl.constexpr, FUSE_MUL_POST: tl.constexpr,
    USE_TMA_LOAD_X: tl.constexpr, USE_TMA_LOAD_W: tl.constexpr, USE_TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr,
    PAD_X_TO: tl.constexpr = 0,
):
    """Grid: (NUM_PROGRAMS,), persistent over the Σ_e cdiv(m_e, BM)·cdiv(N, BN) tiles (M fastest in an expert).
    PAD_X_TO > 0: X (not permuted) has each expert's rows from `_padded_row0`; its rows past the expert only feed
    output rows that are never stored."""
    pid = tl.program_id(0)
    offs_e, counts, tiles, tiles_end, total = _expert_tiles(m_sizes_ptr, NUM_EXPERTS, E_POW2, BLOCK_SIZE_M,
                                                            tl.cdiv(N, BLOCK_SIZE_N))
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    for t in tl.range(pid, total, NUM_PROGRAMS, flatten=FLATTEN):
        e, row0, m_e, pid_m, pid_n = _tile_expert(t, offs_e, counts, tiles, tiles_end, BLOCK_SIZE_M)
        rows = pid_m * BLOCK_SIZE_M + offs_m
        row_ok = rows < m_e
        grouped = row0 + tl.where(row_ok, rows, 0)  # rows past the expert re-read its first row; never stored
        if PAD_X_TO > 0:
            x_row0 = _padded_row0(e, offs_e, counts, NUM_EXPERTS, PAD_X_TO)
        else:
            x_row0 = row0
        if PERMUTE_X or PERMUTE_Y or FUSE_MUL_POST:
            pair = tl.load(gather_ptr + grouped)
        if PERMUTE_X:
            x_rows = pair // TOPK
        else:
            x_rows = x_row0 + tl.where(row_ok, rows, 0)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        w_rows = e * N + offs_n % N
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_SIZE_K):
            k_ok = k0 + offs_k < K
            if USE_TMA_LOAD_X:
                a = x_desc.load([x_row0 + pid_m * BLOCK_SIZE_M, k0])
            elif EVEN_K:
                a = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :])
            else:
                a = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                            mask=k_ok[None, :], other=0.0)
            if USE_TMA_LOAD_W:
                b = w_desc.load([e * N + pid_n * BLOCK_SIZE_N, k0])
            elif EVEN_K:
                b = tl.load(w_ptr + w_rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :])
            else:
                b = tl.load(w_ptr + w_rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :],
                            mask=k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        if FUSE_MUL_POST:
            acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)[:, None]
        out = acc.to(y_ptr.dtype.element_ty)
        n_ok = offs_n < N
        if PERMUTE_Y:
            tl.store(y_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :], out,
                     mask=row_ok[:, None] & n_ok[None, :])
        elif USE_TMA_STORE and (pid_m + 1) * BLOCK_SIZE_M <= m_e:  # a full tile: the descriptor clips N only
            y_desc.store([row0 + pid_m * BLOCK_SIZE_M, pid_n * BLOCK_SIZE_N], out)
        else:
            tl.store(y_ptr + (row0 + rows)[:, None].to(tl.int64) * N + offs_n[None, :], out,
                     mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _grouped_dx_kernel(
    dy_ptr, dy_desc,  # permute_y: [P, N] pair order, else grouped; desc [P, N] block [BM, BN]
    w_ptr, w_desc,  # [E, N, K]; desc over [E·N, K] block [BN, BK]
    dx_ptr, dx_desc,  # [P, K]: pair order with permute_x, else grouped; desc [P, K] block [BM, BK]
    m_sizes_ptr, gather_ptr,
    N, K,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, NUM_PROGRAMS,
    PERMUTE_X: tl.constexpr, PERMUTE_Y: tl.constexpr,
    USE_TMA_LOAD_DY: tl.constexpr, USE_TMA_LOAD_W: tl.constexpr, USE_TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_N: tl.constexpr,
    PAD_DY_TO: tl.constexpr = 0,
):
    """Grid: (NUM_PROGRAMS,), persistent over Σ_e cdiv(m_e, BM)·cdiv(K, BK) tiles; reduction over N.
    PAD_DY_TO > 0: dY (not permuted) has each expert's rows from `_padded_row0`."""
    pid = tl.program_id(0)
    offs_e, counts, tiles, tiles_end, total = _expert_tiles(m_sizes_ptr, NUM_EXPERTS, E_POW2, BLOCK_SIZE_M,
                                                            tl.cdiv(K, BLOCK_SIZE_K))
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    offs_n = tl.arange(0, BLOCK_SIZE_N)
    for t in tl.range(pid, total, NUM_PROGRAMS, flatten=FLATTEN):
        e, row0, m_e, pid_m, pid_k = _tile_expert(t, offs_e, counts, tiles, tiles_end, BLOCK_SIZE_M)
        rows = pid_m * BLOCK_SIZE_M + offs_m
        row_ok = rows < m_e
        grouped = row0 + tl.where(row_ok, rows, 0)
        if PAD_DY_TO > 0:
            dy_row0 = _padded_row0(e, offs_e, counts, NUM_EXPERTS, PAD_DY_TO)
        else:
            dy_row0 = row0
        if PERMUTE_X or PERMUTE_Y:
            pair = tl.load(gather_ptr + grouped)
        if PERMUTE_Y:
            dy_rows = pair
        else:
            dy_rows = dy_row0 + tl.where(row_ok, rows, 0)
        offs_k = pid_k * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
        k_cols = offs_k % K
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_SIZE_N):
            n_ok = n0 + offs_n < N
            # dY columns past N are zero (mask or TMA zero-fill), so W rows read past N (the next expert's,
            # through TMA) add nothing.
            if USE_TMA_LOAD_DY:
                a = dy_desc.load([dy_row0 + pid_m * BLOCK_SIZE_M, n0])
            elif EVEN_N:
                a = tl.load(dy_ptr + dy_rows[:, None].to(tl.int64) * N + (n0 + offs_n)[None, :])
            else:
                a = tl.load(dy_ptr + dy_rows[:, None].to(tl.int64) * N + (n0 + offs_n)[None, :],
                            mask=n_ok[None, :], other=0.0)
            if USE_TMA_LOAD_W:
                b = w_desc.load([e * N + n0, pid_k * BLOCK_SIZE_K])
            elif EVEN_N:
                b = tl.load(w_ptr + (e * N + n0 + offs_n)[:, None].to(tl.int64) * K + k_cols[None, :])
            else:
                b = tl.load(w_ptr + (e * N + n0 + offs_n)[:, None].to(tl.int64) * K + k_cols[None, :],
                            mask=n_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
        out = acc.to(dx_ptr.dtype.element_ty)
        k_ok = offs_k < K
        if PERMUTE_X:
            tl.store(dx_ptr + pair[:, None].to(tl.int64) * K + offs_k[None, :], out,
                     mask=row_ok[:, None] & k_ok[None, :])
        elif USE_TMA_STORE and (pid_m + 1) * BLOCK_SIZE_M <= m_e:
            dx_desc.store([row0 + pid_m * BLOCK_SIZE_M, pid_k * BLOCK_SIZE_K], out)
        else:
            tl.store(dx_ptr + (row0 + rows)[:, None].to(tl.int64) * K + offs_k[None, :], out,
                     mask=row_ok[:, None] & k_ok[None, :])


@triton.jit(do_not_specialize=["NUM_PROGRAMS"])
def _grouped_dw_kernel(
    x_ptr, x_desc,  # permute_x: [T, K] token order, else [P, K] grouped; desc [P, K] block [BM, BK]
    dy_ptr, dy_desc,  # permute_y: [P, N] pair order, else grouped; desc [P, N] block [BM, BN]
    dw_ptr, dw_desc,  # [E, N, K]; desc over [E·N, K] block [BN, BK]
    m_sizes_ptr, gather_ptr,
    N, K,
    NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, NUM_PROGRAMS,
    PERMUTE_X: tl.constexpr, PERMUTE_Y: tl.constexpr,
    USE_TMA_LOAD_DY: tl.constexpr, USE_TMA_LOAD_X: tl.constexpr, USE_TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_N: tl.constexpr = 1,
):
    """Grid: (NUM_PROGRAMS,), persistent over E·cdiv(N, BN)·cdiv(K, BK) tiles in `_dw_tile`'s order; reduction over
    the expert's rows. An expert with no rows gets a zero dW."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(m_sizes_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    n_tiles = tl.cdiv(N, BLOCK_SIZE_N)
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    per_expert = n_tiles * k_tiles
    total = NUM_EXPERTS * per_expert
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    for t in tl.range(pid, total, NUM_PROGRAMS, flatten=FLATTEN):
        e = t // per_expert
        row0 = tl.sum(tl.where(offs_e < e, counts, 0), axis=0)
        m_e = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
        pid_n, pid_k = _dw_tile(t % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        offs_k = pid_k * BLOCK_SIZE_K + tl.arange(0, BLOCK_SIZE_K)
        n_cols = offs_n % N
        k_cols = offs_k % K
        # A gathered X tile read through pointers makes a slow MN-major B operand, so with PERMUTE_X the
        # kernel accumulates dWᵀ = Xᵀ·dY (X becomes the A operand) and transposes once at the end.
        if PERMUTE_X:
            acc = tl.zeros((BLOCK_SIZE_K, BLOCK_SIZE_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)
        # Full row blocks need no mask (a register-side mask would keep dY out of the pipelined shared-memory
        # path); the expert's last partial block is read with masked loads after the loop.
        m_full = (m_e // BLOCK_SIZE_M) * BLOCK_SIZE_M
        for m0 in range(0, m_full, BLOCK_SIZE_M):
            grouped = row0 + m0 + offs_m
            if PERMUTE_X or PERMUTE_Y:
                pair = tl.load(gather_ptr + grouped)
            if USE_TMA_LOAD_X:
                x = x_desc.load([row0 + m0, pid_k * BLOCK_SIZE_K])
            else:
                x_rows = pair // TOPK if PERMUTE_X else grouped
                x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * K + k_cols[None, :])
            if USE_TMA_LOAD_DY:
                dy = dy_desc.load([row0 + m0, pid_n * BLOCK_SIZE_N])
            else:
                dy_rows = pair if PERMUTE_Y else grouped
                dy = tl.load(dy_ptr + dy_rows[:, None].to(tl.int64) * N + n_cols[None, :])
            if PERMUTE_X:
                acc = tl.dot(tl.trans(x), dy, acc)
            else:
                acc = tl.dot(tl.trans(dy), x, acc)
        if m_full < m_e:
            row_ok = m_full + offs_m < m_e
            grouped = row0 + m_full + tl.where(row_ok, offs_m, 0)
            if PERMUTE_X or PERMUTE_Y:
                pair = tl.load(gather_ptr + grouped)
            x_rows = pair // TOPK if PERMUTE_X else grouped
            dy_rows = pair if PERMUTE_Y else grouped
            x = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * K + k_cols[None, :], mask=row_ok[:, None], other=0.0)
            dy = tl.load(dy_ptr + dy_rows[:, None].to(tl.int64) * N + n_cols[None, :], mask=row_ok[:, None],
                         other=0.0)
            if PERMUTE_X:
                acc = tl.dot(tl.trans(x), dy, acc)
            else:
                acc = tl.dot(tl.trans(dy), x, acc)
        if PERMUTE_X:
            out = tl.trans(acc).to(dw_ptr.dtype.element_ty)
        else:
            out = acc.to(dw_ptr.dtype.element_ty)
        if USE_TMA_STORE and (pid_n + 1) * BLOCK_SIZE_N <= N:  # a full tile inside this expert's N rows
            dw_desc.store([e * N + pid_n * BLOCK_SIZE_N, pid_k * BLOCK_SIZE_K], out)
        else:
            tl.store(dw_ptr + (e * N + offs_n)[:, None].to(tl.int64) * K + offs_k[None, :], out,
                     mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


@functools.lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(device: torch.device, tiles_upper_bound: int, num_programs: int | None) -> int:
    if num_programs is None:
        num_programs = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 4
    return max(1, min(num_programs, tiles_upper_bound))


def _descriptor(t: torch.Tensor, rows: int, cols: int, block: list[int], what: str) -> Desc:
    """A TMA operand over t viewed [rows, cols]; rows must be 16-byte multiples (Hopper's rule)."""
    if (cols * t.element_size()) % 16:
        raise ValueError(f"TMA on {what} needs rows of 16-byte multiples; {cols} elements of {t.dtype} are not")
    return Desc(t, (rows, cols), tuple(block))


def rows_upper_bound(pairs: int, experts: int, block_m: int) -> int:
    """The host's bound on the rows of a layout padded per expert to whole block_m blocks: Σ max(1, ⌈m/BM⌉) blocks
    ≤ ⌈P/BM⌉ + E (no sync). `grouped_dw_scheduled.pad` allocates exactly this many."""
    return (triton.cdiv(pairs, block_m) + experts) * block_m


def check_padded_rows(t: torch.Tensor, pairs: int, experts: int, padded_to: int, name: str) -> None:
    """ValueError (one line) where `t`, in rows padded per expert to `padded_to`, is shorter than that layout can
    need: TMA would read zeros past its end without a word."""
    need = rows_upper_bound(pairs, experts, padded_to)
    if t.shape[0] < need:
        raise ValueError(f"{name} padded per expert to {padded_to} rows has {t.shape[0]} rows; {pairs} pairs over "
                         f"{experts} experts need {need}")


def _rows(t: torch.Tensor, pairs: int | None, padded_to: int, permuted: bool, topk: int, experts: int,
          name: str) -> int:
    """P, the grouped rows of a launch whose input `t` is in token order (permuted: T·topk rows), grouped, or padded
    per expert to whole blocks of `padded_to` rows (then the caller names P, which t's padded rows cannot tell)."""
    if not padded_to:
        return t.shape[0] * (topk if permuted else 1)
    if permuted:
        raise ValueError(f"{name} padded per expert cannot also be gathered by a permute")
    if pairs is None or pairs < 0:
        raise ValueError(f"{name} padded per expert needs pairs, its grouped row count")
    if padded_to not in (16, 32, 64, 128, 256):
        raise ValueError(f"{name} padded to {padded_to} rows: expected 16, 32, 64, 128 or 256")
    check_padded_rows(t, pairs, experts, padded_to, name)
    return pairs


def _check(config: KernelConfig, expected: type, m_sizes: torch.Tensor, gather_indices: torch.Tensor | None,
           p: int, topk: int, tensors: dict[str, torch.Tensor]) -> None:
    if not isinstance(config, expected):
        raise TypeError(f"expected a {expected.__name__}, got {type(config).__name__}")
    if config.permute_x and config.permute_y:
        raise ValueError("permute_x and permute_y cannot both be set in one kernel")
    check_compiles_here(config, triton.__version__, interpreting())
    _check_routing(m_sizes, gather_indices, p, config.permute_x or config.permute_y or config.fuse_mul_post,
                   config.to_string())
    if p % topk:
        raise ValueError(f"{p} grouped rows are not a multiple of topk {topk}")
    gathered = {"x": config.permute_x and not isinstance(config, KernelConfigBackward_dX),
                "dy": config.permute_y and not isinstance(config, KernelConfigForward)}
    for operand, is_gathered in gathered.items():
        if is_gathered and getattr(config, f"use_tma_load_{operand}", False):
            raise ValueError(f"use_tma_load_{operand} cannot load rows gathered by a permute")
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _check_routing(m_sizes: torch.Tensor, gather_indices: torch.Tensor | None, p: int, needs_gather: bool,
                   who: str) -> None:
    """m_sizes int32 [E]; gather_indices int32 [p] where `who` (the launch, in the message) reads through it."""
    if m_sizes.dtype != torch.int32 or m_sizes.dim() != 1:
        raise ValueError(f"m_sizes must be a 1-D int32 tensor, got {m_sizes.dtype} of shape {tuple(m_sizes.shape)}")
    if needs_gather and (gather_indices is None or gather_indices.shape != (p,)
                         or gather_indices.dtype != torch.int32):
        raise ValueError(f"{who} needs gather_indices: int32 of shape ({p},)")


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_sizes int32 [E], gather_indices int32 [T·topk]) for topk_ids [T, topk] (ids in [0, E)): the pairs sorted by
    expert (stable, so pairs of one expert stay in token order). No host sync. On a GPU, two Triton launches
    (kernels/expert_grouping.py); elsewhere torch's stable argsort (`group_by_expert_reference`)."""
    if topk_ids.is_cuda:
        from tritune.kernels.expert_grouping import group_by_expert_triton

        return group_by_expert_triton(topk_ids, num_experts)
    return group_by_expert_reference(topk_ids, num_experts)


def group_by_expert_reference(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_by_expert` in torch: a stable argsort and a scatter-add (the Triton launches must match it exactly)."""
    flat = topk_ids.reshape(-1)
    gather_indices = torch.argsort(flat, stable=True).to(torch.int32)
    m_sizes = torch.zeros(num_experts, device=flat.device, dtype=torch.int32)
    m_sizes.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    return m_sizes, gather_indices


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """An int32 pointer for a parameter the launch never reads (one per device, kept)."""
    dummy = _DUMMIES.get(device)
    if dummy is None:
        dummy = _DUMMIES[device] = torch.zeros(16, device=device, dtype=torch.int32)
    return dummy


def grouped_gemm_forward(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, config: KernelConfigForward, *,
                         topk: int = 1, gather_indices: torch.Tensor | None = None,
                         topk_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         num_programs: int | None = None, x_padded_to: int = 0,
                         pairs: int | None = None) -> torch.Tensor:
    """Y[g] = X[row of g]·W[e(g)]ᵀ for every grouped row g.

    x [P, K] grouped, or [T, K] token order with permute_x (row of g = gather_indices[g] // topk), or, with
    x_padded_to, grouped rows padded per expert to whole blocks of that many rows (`grouped_dw_scheduled.pad`; then
    `pairs` = P); w [E, N, K] bf16/fp16/fp32; m_sizes int32 [E]; topk_weights [T, topk] or [P] (fuse_mul_post);
    -> Y [P, N] in x's dtype: grouped, or pair order with permute_y.
    """
    cfg = config
    n_exp, n, k = w.shape
    p = _rows(x, pairs, x_padded_to, cfg.permute_x, topk, m_sizes.shape[0], "x")
    _check(cfg, KernelConfigForward, m_sizes, gather_indices, p, topk, {"x": x, "w": w})
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]}, w has K={k}")
    if cfg.fuse_mul_post and (topk_weights is None or topk_weights.numel() != p):
        raise ValueError(f"fuse_mul_post needs topk_weights with {p} elements")
    if out is None:
        out = torch.empty((p, n), device=x.device, dtype=x.dtype)
    if p == 0:  # an empty batch (an expert-parallel rank may get no tokens): TMA takes no empty operand
        return out
    bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
    x_desc = _descriptor(x, x.shape[0], k, [bm, bk], "x") if cfg.use_tma_load_x else x
    w_desc = _descriptor(w, n_exp * n, k, [bn, bk], "w") if cfg.use_tma_load_w else w
    y_desc = _descriptor(out, p, n, [bm, bn], "y") if stores_through_tma(cfg) else out
    dummy = _dummy(x.device)
    programs = _num_programs(x.device, (triton.cdiv(p, bm) + n_exp) * triton.cdiv(n, bn), num_programs)
    launch(_grouped_fwd_kernel, (programs,), dict(
        x_ptr=x, x_desc=x_desc, w_ptr=w, w_desc=w_desc, y_ptr=out, y_desc=y_desc, m_sizes_ptr=m_sizes,
        gather_ptr=gather_indices if gather_indices is not None else dummy,
        topk_w_ptr=topk_weights.reshape(-1) if cfg.fuse_mul_post else dummy, N=n, K=k,
        NUM_EXPERTS=n_exp, E_POW2=triton.next_power_of_2(n_exp), TOPK=topk, NUM_PROGRAMS=programs,
        PERMUTE_X=cfg.permute_x, PERMUTE_Y=cfg.permute_y, FUSE_MUL_POST=cfg.fuse_mul_post,
        USE_TMA_LOAD_X=cfg.use_tma_load_x, USE_TMA_LOAD_W=cfg.use_tma_load_w,
        USE_TMA_STORE=stores_through_tma(cfg), FLATTEN=cfg.flatten,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, EVEN_K=k % bk == 0, PAD_X_TO=x_padded_to),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_dx(dy: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, config: KernelConfigBackward_dX, *,
                    topk: int = 1, gather_indices: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    num_programs: int | None = None, dy_padded_to: int = 0,
                    pairs: int | None = None) -> torch.Tensor:
    """dX[g] = dY[row of g]·W[e(g)] for every grouped row g.

    dy [P, N]: grouped, or pair order with permute_y (row of g = gather_indices[g]), or, with dy_padded_to, grouped
    rows padded per expert to whole blocks of that many rows (then `pairs` = P); w [E, N, K]
    -> dX [P, K] in dy's dtype: grouped, or pair order with permute_x (sum it over topk for token order).
    """
    cfg = config
    n_exp, n, k = w.shape
    p = _rows(dy, pairs, dy_padded_to, cfg.permute_y, 1, m_sizes.shape[0], "dy")
    _check(cfg, KernelConfigBackward_dX, m_sizes, gather_indices, p, topk, {"dy": dy, "w": w})
    if dy.shape[1] != n:
        raise ValueError(f"dy has N={dy.shape[1]}, w has N={n}")
    if out is None:
        out = torch.empty((p, k), device=dy.device, dtype=dy.dtype)
    if p == 0:
        return out
    bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
    dy_desc = _descriptor(dy, dy.shape[0], n, [bm, bn], "dy") if cfg.use_tma_load_dy else dy
    w_desc = _descriptor(w, n_exp * n, k, [bn, bk], "w") if cfg.use_tma_load_w else w
    dx_desc = _descriptor(out, p, k, [bm, bk], "dx") if stores_through_tma(cfg) else out
    programs = _num_programs(dy.device, (triton.cdiv(p, bm) + n_exp) * triton.cdiv(k, bk), num_programs)
    launch(_grouped_dx_kernel, (programs,), dict(
        dy_ptr=dy, dy_desc=dy_desc, w_ptr=w, w_desc=w_desc, dx_ptr=out, dx_desc=dx_desc, m_sizes_ptr=m_sizes,
        gather_ptr=gather_indices if gather_indices is not None else _dummy(dy.device), N=n, K=k,
        NUM_EXPERTS=n_exp, E_POW2=triton.next_power_of_2(n_exp), NUM_PROGRAMS=programs,
        PERMUTE_X=cfg.permute_x, PERMUTE_Y=cfg.permute_y,
        USE_TMA_LOAD_DY=cfg.use_tma_load_dy, USE_TMA_LOAD_W=cfg.use_tma_load_w,
        USE_TMA_STORE=stores_through_tma(cfg), FLATTEN=cfg.flatten,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, EVEN_N=n % bn == 0, PAD_DY_TO=dy_padded_to),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_dw(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, config: KernelConfigBackward_dW, *,
                    topk: int = 1, gather_indices: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    num_programs: int | None = None) -> torch.Tensor:
    """dW[e] = Σ_{g in e} dY[row of g]ᵀ·X[row of g].

    x as in the forward ([P, K] grouped or [T, K] token order with permute_x); dy as in dX ([P, N] grouped or
    pair order with permute_y) -> dW [E, N, K] in x's dtype (zero for an expert with no rows).
    """
    cfg = config
    p, n = dy.shape
    k = x.shape[1]
    n_exp = m_sizes.shape[0]
    _check(cfg, KernelConfigBackward_dW, m_sizes, gather_indices, p, topk, {"x": x, "dy": dy})
    if x.shape[0] * (topk if cfg.permute_x else 1) != p:
        raise ValueError(f"x has {x.shape[0]} rows, dy has {p} (topk {topk}, permute_x {cfg.permute_x})")
    if cfg.scheduled:
        return scheduled_dw_launch(x, dy, m_sizes, cfg, topk=topk, gather=gather_indices, permute_x=cfg.permute_x,
                                   permute_y=cfg.permute_y, out=out, num_programs=num_programs)
    if out is None:
        out = torch.empty((n_exp, n, k), device=x.device, dtype=x.dtype)
    if p == 0:  # no rows: every expert's dW is zero
        return out.zero_()
    bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
    x_desc = _descriptor(x, p, k, [bm, bk], "x") if cfg.use_tma_load_x else x
    dy_desc = _descriptor(dy, p, n, [bm, bn], "dy") if cfg.use_tma_load_dy else dy
    dw_desc = _descriptor(out, n_exp * n, k, [bn, bk], "dw") if stores_through_tma(cfg) else out
    programs = _num_programs(x.device, n_exp * triton.cdiv(n, bn) * triton.cdiv(k, bk), num_programs)
    launch(_grouped_dw_kernel, (programs,), dict(
        x_ptr=x, x_desc=x_desc, dy_ptr=dy, dy_desc=dy_desc, dw_ptr=out, dw_desc=dw_desc, m_sizes_ptr=m_sizes,
        gather_ptr=gather_indices if gather_indices is not None else _dummy(x.device), N=n, K=k,
        NUM_EXPERTS=n_exp, E_POW2=triton.next_power_of_2(n_exp), TOPK=topk, NUM_PROGRAMS=programs,
        PERMUTE_X=cfg.permute_x, PERMUTE_Y=cfg.permute_y,
        USE_TMA_LOAD_DY=cfg.use_tma_load_dy, USE_TMA_LOAD_X=cfg.use_tma_load_x,
        USE_TMA_STORE=stores_through_tma(cfg), FLATTEN=cfg.flatten,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_N=cfg.GROUP_SIZE_N),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def scheduled_dw_launch(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, config: KernelConfigBackward_dW, *,
                        topk: int, gather: torch.Tensor | None, permute_x: bool, permute_y: bool,
                        out: torch.Tensor | None = None, num_programs: int | None = None,
                        padded: str | None = None, pairs: int | None = None) -> torch.Tensor:
    """dW through the scheduled loop (kernels/grouped_dw_scheduled.py) for a config with `scheduled`: X and dY in the
    layouts the forward saw (permute_x: X in token order; permute_y: dY in pair order), which its padding copy
    gathers from, or with `padded` ("x" or "dy") that operand already padded per expert to BLOCK_SIZE_M rows and
    `pairs` = P; ValueError (one line) for a scheduled config without its three TMA flags or with N not a multiple
    of BLOCK_SIZE_N."""
    from tritune.kernels.grouped_dw_scheduled import scheduled_dw

    cfg = config
    p = dy.shape[0] if padded is None else pairs
    _check_routing(m_sizes, gather, p, permute_x or permute_y,
                   f"scheduled dW with permute_x={permute_x} permute_y={permute_y}")
    if padded is None and (p % topk or x.shape[0] * (topk if permute_x else 1) != p):
        raise ValueError(f"x has {x.shape[0]} rows, dy has {p} (topk {topk}, permute_x {permute_x})")
    for name, t in (("x", x), ("dy", dy)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not (cfg.use_tma_load_dy and cfg.use_tma_load_x and cfg.use_tma_store):
        raise ValueError(f"{type(cfg).__name__}({cfg.to_string(True, True)}): scheduled dW reads and stores "
                         f"through TMA: set use_tma_load_dy, use_tma_load_x and use_tma_store")
    n, k = dy.shape[1], x.shape[1]
    for name, t, row in (("x", x, k), ("dy", dy, n)):
        if (row * t.element_size()) % 16:
            raise ValueError(f"scheduled dW: {name} rows of {row} elements are not a multiple of 16 bytes (TMA)")
    programs = _num_programs(x.device, m_sizes.shape[0] * triton.cdiv(n, cfg.BLOCK_SIZE_N)
                             * triton.cdiv(k, cfg.BLOCK_SIZE_K), num_programs)
    return scheduled_dw(x, dy, m_sizes, gather, topk, permute_x, permute_y, block_m=cfg.BLOCK_SIZE_M,
                        block_n=cfg.BLOCK_SIZE_N, block_k=cfg.BLOCK_SIZE_K, group_size_n=cfg.GROUP_SIZE_N,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, programs=programs, out=out,
                        padded=padded, pairs=pairs)
