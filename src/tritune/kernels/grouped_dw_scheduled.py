"""Grouped-GEMM dW (dW[e] = dY[e]ᵀ·X[e]) as ONE pipelined loop per program over a step table built on the GPU.

Why. `_grouped_dw_kernel` loops over an expert's row blocks inside a loop over its output tiles. Triton 3.6 does not
flatten that nest when the inner trip count depends on the expert, so every tile starts a fresh pipeline: with
Qwen3-30B-A3B's 512-row experts a tile is 8-16 steps, and the refills kept dW at 0.88-0.94× `torch._grouped_mm`.
Here one operand is copied into blocks padded per expert (zeros between experts), and each program's row blocks of
all its tiles run as one loop whose step s reads its coordinates from a table by s alone. No load address depends on
the epilogue's `if`, so the pipeliner keeps loads in flight across tile ends (Triton 3.6, cuda:90: num_stages - 1
steps ahead, against 1 when the next tile's coordinates were computed inside the `if`). On the H100 (RESULTS.md,
thirteenth session): 1.04× `_grouped_mm` on both Qwen3 GEMMs and 1.05-1.23× on Mixtral's on rows padded beforehand;
in the op, gathers included, faster than the plain kernel on every Qwen3 and DeepSeek-V2-Lite dW measured.

What it costs: the copy of one operand (the one in token or pair order, which the op gathers anyway, or else the
narrower) and 16 bytes of table per step. Nothing here waits on the GPU: every size the host allocates is an upper
bound from the shapes alone, so a training step stays capturable in a CUDA graph, and the plan is computed inside
the kernels from `m_sizes` (about twenty small torch launches of planning cost more than the loop saved on Qwen3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_gemm import _dw_tile, check_padded_rows, rows_upper_bound
from tritune.kernels.grouped_launch import Desc, launch

PAD_ROWS = 16  # rows a program of the padding copy moves (all their columns, PAD_COLS at a time)
PAD_COLS = 256
HELPER_LAUNCH = {"num_warps": 4, "num_stages": 1}  # the padding copy's and the table kernel's (compile_only too)
ROUNDS_CHUNK = tl.constexpr(256)  # rounds of a program's tiles summed at once when counting its steps


@triton.jit
def _layout(m_sizes_ptr, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_SIZE_M: tl.constexpr):
    """Per expert, in registers: (ids, row counts, blocks = max(1, ⌈rows/BM⌉), first padded row, first grouped row).
    An empty expert keeps one block, so its zero dW is still stored."""
    offs_e = tl.arange(0, E_POW2)
    real = offs_e < NUM_EXPERTS
    counts = tl.load(m_sizes_ptr + offs_e, mask=real, other=0)
    blocks = tl.where(real, tl.maximum(tl.cdiv(counts, BLOCK_SIZE_M), 1), 0)
    pad_row = tl.cumsum(blocks, axis=0) * BLOCK_SIZE_M - blocks * BLOCK_SIZE_M
    start = tl.cumsum(counts, axis=0) - counts
    return offs_e, counts, blocks, pad_row, start


@triton.jit
def _expert_blocks(m_sizes_ptr, e, BLOCK_SIZE_M: tl.constexpr):
    """Row blocks of expert(s) e (any shape), at least 1."""
    return tl.maximum(tl.cdiv(tl.load(m_sizes_ptr + e), BLOCK_SIZE_M), 1)


@triton.jit
def _program_steps_before(m_sizes_ptr, p, rounds, tiles, per_expert, num_programs, BLOCK_SIZE_M: tl.constexpr):
    """Steps of program p's tiles in rounds [0, rounds): tiles j·P + p below `tiles`, one step per row block."""
    total = 0
    for j0 in range(0, rounds, ROUNDS_CHUNK):
        j = j0 + tl.arange(0, ROUNDS_CHUNK)
        t = j * num_programs + p
        ok = (j < rounds) & (t < tiles)
        total += tl.sum(tl.where(ok, _expert_blocks(m_sizes_ptr, tl.where(ok, t, 0) // per_expert, BLOCK_SIZE_M), 0),
                        axis=0)
    return total


@triton.jit(do_not_specialize=["rows_ub"])
def _pad_rows_kernel(src_ptr, dst_ptr, m_sizes_ptr, gather_ptr, scale_ptr, rows_ub, C,
                     NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                     GATHERED: tl.constexpr, TOPK: tl.constexpr, SCALED: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """dst's padded row r = src's row for the grouped row it holds (zeros for padding): grouped row g itself, or, when
    GATHERED, the row gather[g] // TOPK (X in token order: TOPK = topk; dY in pair order: TOPK = 1). SCALED (with
    GATHERED): times scale[gather[g]] in fp32, so dout [T, D] with the routing weights in pair order becomes the
    top-k sum's dY already padded. Rows past the padded total are never read and are left alone.
    Grid (⌈rows_ub/ROWS⌉,); a program walks its rows' columns BLOCK_C at a time."""
    offs_e, counts, blocks, pad_row, start = _layout(m_sizes_ptr, NUM_EXPERTS, E_POW2, BLOCK_SIZE_M)
    r0 = tl.program_id(0) * ROWS
    if r0 < tl.sum(blocks, axis=0) * BLOCK_SIZE_M:
        r = r0 + tl.arange(0, ROWS)
        mine = (pad_row[None, :] <= r[:, None]) & (offs_e[None, :] < NUM_EXPERTS)  # [ROWS, E]: experts at or before
        e = tl.sum(mine.to(tl.int32), axis=1) - 1
        hit = offs_e[None, :] == e[:, None]
        local = r - tl.sum(tl.where(hit, pad_row[None, :], 0), axis=1)
        real = local < tl.sum(tl.where(hit, counts[None, :], 0), axis=1)
        g = tl.sum(tl.where(hit, start[None, :], 0), axis=1) + local
        if GATHERED:
            pair = tl.load(gather_ptr + g, mask=real, other=0)
            src_rows = pair // TOPK
        else:
            src_rows = g
        if SCALED:
            scale = tl.load(scale_ptr + pair, mask=real, other=0.0).to(tl.float32)
        src_row = src_ptr + tl.where(real, src_rows, 0).to(tl.int64)[:, None] * C
        dst_row = dst_ptr + r.to(tl.int64)[:, None] * C
        for c0 in range(0, C, BLOCK_C):  # the rows' experts found once, for every column
            c = c0 + tl.arange(0, BLOCK_C)
            ok_c = c[None, :] < C
            vals = tl.load(src_row + c[None, :], mask=real[:, None] & ok_c, other=0.0)
            if SCALED:
                vals = (vals.to(tl.float32) * scale[:, None]).to(dst_ptr.dtype.element_ty)
            tl.store(dst_row + c[None, :], vals, mask=(r[:, None] < rows_ub) & ok_c)


@triton.jit
def _dw_schedule_kernel(table_ptr, m_sizes_ptr, N, n_tiles, k_tiles, num_programs, max_steps,
                        NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, PAD_X: tl.constexpr, PAD_DY: tl.constexpr,
                        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, GROUP_SIZE_N: tl.constexpr):
    """Writes tile t's steps into its program's table: program t % P, after the steps of that program's earlier
    tiles, one entry per row block of its expert: (X row, dY row, N tile << 16 | K tile, dW row to store at on the
    tile's last block else -1). A padded operand's rows start at the expert's padded row, an unpadded one's at its
    first grouped row (the block then runs into the next expert's rows, where the padded operand holds zeros).
    Grid: (tiles,)."""
    t = tl.program_id(0)
    p = t % num_programs
    per_expert = n_tiles * k_tiles
    e = t // per_expert
    pid_n, pid_k = _dw_tile(t % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
    first = _program_steps_before(m_sizes_ptr, p, t // num_programs, NUM_EXPERTS * per_expert, per_expert,
                                  num_programs, BLOCK_SIZE_M)
    offs_e, counts, blocks_e, pad_row, start = _layout(m_sizes_ptr, NUM_EXPERTS, E_POW2, BLOCK_SIZE_M)
    hit = offs_e == e
    blocks = tl.sum(tl.where(hit, blocks_e, 0), axis=0)
    padded0 = tl.sum(tl.where(hit, pad_row, 0), axis=0)
    grouped0 = tl.sum(tl.where(hit, start, 0), axis=0)
    x0 = padded0 if PAD_X else grouped0
    dy0 = padded0 if PAD_DY else grouped0
    base = table_ptr + (p.to(tl.int64) * max_steps + first) * 4
    for b in range(0, blocks):
        tl.store(base + 4 * b, x0 + b * BLOCK_SIZE_M)
        tl.store(base + 4 * b + 1, dy0 + b * BLOCK_SIZE_M)
        tl.store(base + 4 * b + 2, (pid_n << 16) | pid_k)
        tl.store(base + 4 * b + 3, tl.where(b == blocks - 1, e * N + pid_n * BLOCK_SIZE_N, -1))


@triton.jit
def _dw_scheduled_kernel(x_desc, dy_desc, dw_desc, table_ptr, m_sizes_ptr, max_steps, tiles, per_expert,
                         BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """This program's steps of the table: accumulate dY[rows]ᵀ·X[rows] of the step's tile, store it (through the
    [E·N, K] output descriptor) and start over where the step names a dW row. Nothing but shifts and masks between
    a table entry and its loads: an integer division a step (the tile from its index) cost a third of the loop."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    steps = _program_steps_before(m_sizes_ptr, pid, tl.cdiv(tiles, num_programs), tiles, per_expert, num_programs,
                                  BLOCK_SIZE_M)
    base = table_ptr + pid.to(tl.int64) * max_steps * 4
    acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)
    for s in range(0, steps):
        step = base + 4 * s
        nk = tl.load(step + 2)
        off_k = (nk & 0xFFFF) * BLOCK_SIZE_K
        acc = tl.dot(dy_desc.load([tl.load(step + 1), (nk >> 16) * BLOCK_SIZE_N]).T,
                     x_desc.load([tl.load(step), off_k]), acc)
        out_row = tl.load(step + 3)
        if out_row >= 0:
            dw_desc.store([out_row, off_k], acc.to(dw_desc.dtype))
            acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)


def max_table_steps(per_expert: int, programs: int, pairs: int, experts: int, block_m: int) -> int:
    """The host's bound on one program's steps: it holds at most ⌈per_expert / P⌉ tiles of each expert, each of that
    expert's blocks (no sync)."""
    return triton.cdiv(per_expert, programs) * (triton.cdiv(pairs, block_m) + experts)


def pad(src: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int, pairs: int,
        block_m: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[rows_upper_bound, C] copy of src's rows padded per expert to whole block_m blocks (zeros between; rows past
    the padded total left unwritten). src is grouped when gather is None, else read through gather // topk (X in
    token order: topk; dY in pair order: 1). scale [P] in pair order (needs gather): each row times scale[pair]."""
    experts = m_sizes.shape[0]
    if scale is not None and (gather is None or scale.numel() != pairs):
        raise ValueError(f"pad: a scale needs gather indices and {pairs} elements, one per pair")
    rows_ub = rows_upper_bound(pairs, experts, block_m)
    out = torch.empty((rows_ub, src.shape[1]), device=src.device, dtype=src.dtype)
    grid = (triton.cdiv(rows_ub, PAD_ROWS),)
    launch(_pad_rows_kernel, grid, dict(
        src_ptr=src, dst_ptr=out, m_sizes_ptr=m_sizes, gather_ptr=gather if gather is not None else m_sizes,
        scale_ptr=scale.reshape(-1) if scale is not None else m_sizes, rows_ub=rows_ub, C=src.shape[1],
        NUM_EXPERTS=experts, E_POW2=triton.next_power_of_2(experts), BLOCK_SIZE_M=block_m,
        GATHERED=gather is not None, TOPK=topk, SCALED=scale is not None, ROWS=PAD_ROWS, BLOCK_C=PAD_COLS),
        **HELPER_LAUNCH)
    return out


@dataclass(frozen=True)
class Schedule:
    """int32 table [programs, max_steps, 4] of (X row, dY row, N tile << 16 | K tile, dW row or -1) per step; a
    program's step count is recomputed by whoever reads it (`_program_steps_before` over all rounds)."""

    table: torch.Tensor
    max_steps: int
    tiles: int
    per_expert: int


def dw_schedule(m_sizes: torch.Tensor, pairs: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                programs: int, group_size_n: int = 1, pad_x: bool = True, pad_dy: bool = True) -> Schedule:
    """Tiles t = 0.. (expert t // per_expert, then `_dw_tile`'s order) go round-robin to `programs` programs, each
    tile one step per row block of its expert, in tile order within a program. One launch."""
    experts = m_sizes.shape[0]
    n_tiles, k_tiles = n // block_n, triton.cdiv(k, block_k)
    if max(n_tiles, k_tiles) >= 1 << 15:  # (N tile << 16) stays positive
        raise ValueError(f"scheduled dW: {n_tiles} N tiles or {k_tiles} K tiles do not fit the table's 15 bits")
    per_expert = n_tiles * k_tiles
    tiles = experts * per_expert
    max_steps = max_table_steps(per_expert, programs, pairs, experts, block_m)
    table = torch.empty((programs, max_steps, 4), device=m_sizes.device, dtype=torch.int32)
    launch(_dw_schedule_kernel, (tiles,), dict(
        table_ptr=table, m_sizes_ptr=m_sizes, N=n, n_tiles=n_tiles, k_tiles=k_tiles, num_programs=programs,
        max_steps=max_steps, NUM_EXPERTS=experts, E_POW2=triton.next_power_of_2(experts), PAD_X=pad_x,
        PAD_DY=pad_dy, BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, GROUP_SIZE_N=group_size_n),
        **HELPER_LAUNCH)
    return Schedule(table, max_steps, tiles, per_expert)


def operands_to_pad(n: int, k: int, permute_x: bool, permute_y: bool) -> tuple[bool, bool]:
    """(pad X, pad dY): an operand in token or pair order is gathered anyway, so it is the one copied; with neither
    permuted, the narrower one (less to copy). The other is read in place: its rows past an expert's end belong to
    the next expert and meet the padded operand's zeros."""
    if permute_x or permute_y:
        return permute_x, permute_y
    return k <= n, k > n


def scheduled_dw(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int,
                 permute_x: bool, permute_y: bool, *, block_m: int, block_n: int, block_k: int, group_size_n: int,
                 num_warps: int, num_stages: int, programs: int, out: torch.Tensor | None = None,
                 padded: str | None = None, pairs: int | None = None) -> torch.Tensor:
    """dW [E, N, K] (into `out` when given) from X and dY in the layouts the forward saw (permute_x: X [T, K] in token
    order, row gather[g] // topk; permute_y: dY [P, N] in pair order, row gather[g]; else grouped): pad one operand
    (or both), write the table, run `_dw_scheduled_kernel`; four launches at most, none waiting on the GPU. N must be
    a multiple of block_n (the output descriptor spans every expert's rows); rows must be 16-byte multiples (TMA).

    padded "x" or "dy": that operand is already padded per expert to block_m (`pad`'s layout, as the MoE MLP keeps
    it), so nothing is copied, the other operand is read in place (grouped), and `pairs` names P."""
    n, k, experts = dy.shape[1], x.shape[1], m_sizes.shape[0]
    if n % block_n:
        raise ValueError(f"scheduled dW: N={n} is not a multiple of BLOCK_SIZE_N={block_n}")
    if padded is None:
        pairs = dy.shape[0]
        pad_x, pad_dy = operands_to_pad(n, k, permute_x, permute_y)
    elif padded in ("x", "dy") and not (permute_x or permute_y) and pairs is not None:
        pad_x, pad_dy = padded == "x", padded == "dy"
        in_place, laid = (dy, x) if pad_x else (x, dy)
        if in_place.shape[0] != pairs:
            raise ValueError(f"scheduled dW: the operand read in place has {in_place.shape[0]} rows, not {pairs}")
        check_padded_rows(laid, pairs, experts, block_m, f"scheduled dW: {padded}")
    else:
        raise ValueError(f"scheduled dW: padded={padded!r} needs 'x' or 'dy', pairs, and no permute")
    if out is None:
        out = torch.empty((experts, n, k), device=x.device, dtype=x.dtype)
    if pairs == 0:  # no rows at all (an empty batch): every dW is zero, and TMA takes no empty operand
        return out.zero_()
    if padded is not None:
        x_rows, dy_rows = x, dy
    else:
        x_rows = pad(x, m_sizes, gather if permute_x else None, topk, pairs, block_m) if pad_x else x
        dy_rows = pad(dy, m_sizes, gather if permute_y else None, 1, pairs, block_m) if pad_dy else dy
    programs = max(1, min(programs, experts * (n // block_n) * triton.cdiv(k, block_k)))
    sched = dw_schedule(m_sizes, pairs, n, k, block_m, block_n, block_k, programs, group_size_n, pad_x, pad_dy)
    launch(_dw_scheduled_kernel, (programs,), dict(
        x_desc=Desc(x_rows, tuple(x_rows.shape), (block_m, block_k)),
        dy_desc=Desc(dy_rows, tuple(dy_rows.shape), (block_m, block_n)),
        dw_desc=Desc(out, (experts * n, k), (block_n, block_k)),
        table_ptr=sched.table, m_sizes_ptr=m_sizes, max_steps=sched.max_steps, tiles=sched.tiles,
        per_expert=sched.per_expert, BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k),
        num_warps=num_warps, num_stages=num_stages)
    return out
