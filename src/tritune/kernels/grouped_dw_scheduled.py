"""Grouped-GEMM dW (dW[e] = dY[e]ᵀ·X[e]) as ONE pipelined loop per program over a step table built on the GPU.

Why. `_grouped_dw_kernel` loops over an expert's row blocks inside a loop over its output tiles. Triton 3.6 does not
flatten that nest when the inner trip count depends on the expert, so every tile starts a fresh pipeline: with
Qwen3-30B-A3B's 512-row experts a tile is 8-16 steps, and the refills kept dW at 0.88-0.94× `torch._grouped_mm`.
Here the rows are copied into blocks padded per expert (zeros between experts), and each program's row blocks of all
its tiles run as one loop whose step s reads its coordinates from a table by s alone. No load address depends on the
epilogue's `if`, so the pipeliner keeps loads in flight across tile ends (Triton 3.6, cuda:90: num_stages - 1 steps
ahead, against 1 when the next tile's coordinates were computed inside the `if`). Measured on the H100 at 8192
tokens, 64-row steps of 128×256 tiles, 5 stages: 1.04× `_grouped_mm` on both Qwen3 GEMMs, 1.05-1.23× on Mixtral's
(RESULTS.md, thirteenth session).

What it costs: the padded copies of X and dY (the op's dW pays a gather of one of them anyway when it does not fuse
the permute) and 8 bytes of table per step. Nothing here waits on the GPU: every size the host allocates is an upper
bound from the shapes alone, so a training step stays capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.grouped_gemm import _dw_tile

PAD_ROWS = 32  # rows a program of the padding copy moves
PAD_COLS = 256


@triton.jit(do_not_specialize=["rows_ub"])
def _pad_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, total_ptr, rows_ub, C,
                     ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst[r] = src[src_rows[r]] for r below the padded row count (*total_ptr), zeros where src_rows[r] < 0 (the
    padding); rows from there to rows_ub are never read, so they are left alone. Grid (⌈rows_ub/ROWS⌉, ⌈C/BLOCK_C⌉)."""
    r0 = tl.program_id(0) * ROWS
    if r0 < tl.load(total_ptr):
        r = r0 + tl.arange(0, ROWS)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        src_rows = tl.load(src_rows_ptr + r, mask=r < rows_ub, other=-1)
        ok_c = c[None, :] < C
        vals = tl.load(src_ptr + tl.maximum(src_rows, 0).to(tl.int64)[:, None] * C + c[None, :],
                       mask=(src_rows[:, None] >= 0) & ok_c, other=0.0)
        tl.store(dst_ptr + r.to(tl.int64)[:, None] * C + c[None, :], vals, mask=(r[:, None] < rows_ub) & ok_c)


@triton.jit
def _dw_schedule_kernel(table_ptr, offsets_ptr, blocks_ptr, pad_row_ptr, start_ptr, N, n_tiles, k_tiles,
                        num_programs, max_steps, PAD_X: tl.constexpr, PAD_DY: tl.constexpr,
                        BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, GROUP_SIZE_N: tl.constexpr):
    """Writes tile t's steps into its program's table: program t % P, from step offsets[t // P, t % P], one entry
    per row block of its expert: (X row, dY row, N tile << 16 | K tile, dW row to store at on the tile's last block
    else -1). A padded operand's rows start at the expert's padded row, an unpadded one's at its first grouped row
    (the block then runs into the next expert's rows, where the padded operand holds zeros). Grid: (tiles,)."""
    t = tl.program_id(0)
    p = t % num_programs
    per_expert = n_tiles * k_tiles
    e = t // per_expert
    pid_n, pid_k = _dw_tile(t % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
    first = tl.load(offsets_ptr + t)  # offsets is [J, P] row-major: index (t // P) * P + t % P == t
    blocks = tl.load(blocks_ptr + e)
    padded0 = tl.load(pad_row_ptr + e)
    grouped0 = tl.load(start_ptr + e)
    x0 = padded0 if PAD_X else grouped0
    dy0 = padded0 if PAD_DY else grouped0
    base = table_ptr + (p.to(tl.int64) * max_steps + first) * 4
    for b in range(0, blocks):
        tl.store(base + 4 * b, x0 + b * BLOCK_SIZE_M)
        tl.store(base + 4 * b + 1, dy0 + b * BLOCK_SIZE_M)
        tl.store(base + 4 * b + 2, (pid_n << 16) | pid_k)
        tl.store(base + 4 * b + 3, tl.where(b == blocks - 1, e * N + pid_n * BLOCK_SIZE_N, -1))


@triton.jit
def _dw_scheduled_kernel(x_desc, dy_desc, dw_desc, table_ptr, steps_ptr, max_steps,
                         BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr):
    """This program's steps of the table: accumulate dY[rows]ᵀ·X[rows] of the step's tile, store it (through the
    [E·N, K] output descriptor) and start over where the step names a dW row. Nothing but shifts and masks between
    a table entry and its loads: an integer division a step (the tile from its index) cost a third of the loop."""
    pid = tl.program_id(0)
    base = table_ptr + pid.to(tl.int64) * max_steps * 4
    acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)
    for s in range(0, tl.load(steps_ptr + pid)):
        step = base + 4 * s
        nk = tl.load(step + 2)
        off_k = (nk & 0xFFFF) * BLOCK_SIZE_K
        acc = tl.dot(dy_desc.load([tl.load(step + 1), (nk >> 16) * BLOCK_SIZE_N]).T,
                     x_desc.load([tl.load(step), off_k]), acc)
        out_row = tl.load(step + 3)
        if out_row >= 0:
            dw_desc.store([out_row, off_k], acc.to(dw_desc.dtype))
            acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)


@dataclass(frozen=True)
class PaddedRows:
    """Rows padded per expert to whole blocks. `x_src` / `dy_src` [rows_ub] name the source row of each padded row
    of an operand that is copied (-1: padding, zeros; None: the operand is read in place, grouped); `pad_row`,
    `start`, `blocks` [E]: each expert's first padded row, first grouped row and block count (at least 1, so an
    empty expert still stores its zero dW); `total` [1] the padded row count. All on the GPU; rows_ub, the host's
    bound on `total`, needs no sync."""

    x_src: torch.Tensor | None
    dy_src: torch.Tensor | None
    pad_row: torch.Tensor
    start: torch.Tensor
    blocks: torch.Tensor
    total: torch.Tensor
    rows_ub: int


def padded_rows(m_sizes: torch.Tensor, gather: torch.Tensor | None, pairs: int, topk: int, permute_x: bool,
                permute_y: bool, block_m: int, pad_x: bool = True, pad_dy: bool = True) -> PaddedRows:
    """The padding plan for `pairs` grouped rows (m_sizes [E] int32). With permute_x X is [T, K] in token order (row
    of grouped row g: gather[g] // topk), else grouped; with permute_y dY is [P, N] in pair order (row gather[g]),
    else grouped. An operand in a permuted order must be padded (copied): it cannot be read in place."""
    if (permute_x and not pad_x) or (permute_y and not pad_dy):
        raise ValueError("an operand in token or pair order must be padded: it has no grouped rows to read in place")
    device = m_sizes.device
    counts = m_sizes.long()
    blocks = torch.clamp((counts + block_m - 1) // block_m, min=1)
    ends = torch.cumsum(blocks * block_m, 0)
    pad_row = ends - blocks * block_m
    start = torch.cumsum(counts, 0) - counts
    rows_ub = (triton.cdiv(pairs, block_m) + len(counts)) * block_m  # Σ max(1, ⌈m/BM⌉) ≤ ⌈P/BM⌉ + E
    g = torch.arange(pairs, device=device)
    expert = torch.searchsorted(torch.cumsum(counts, 0), g, right=True)
    dst = pad_row[expert] + g - start[expert]
    pair = gather.long() if gather is not None else g

    def sources(rows: torch.Tensor) -> torch.Tensor:
        src = torch.full((rows_ub,), -1, device=device, dtype=torch.int32)
        src[dst] = rows.to(torch.int32)
        return src

    return PaddedRows(sources(pair // topk if permute_x else g) if pad_x else None,
                      sources(pair if permute_y else g) if pad_dy else None,
                      pad_row.to(torch.int32), start.to(torch.int32), blocks.to(torch.int32),
                      ends[-1:].to(torch.int32), rows_ub)


def pad(src: torch.Tensor, src_rows: torch.Tensor, plan: PaddedRows) -> torch.Tensor:
    """[rows_ub, C] copy of src's rows in padded order (rows past plan.total left unwritten)."""
    out = torch.empty((plan.rows_ub, src.shape[1]), device=src.device, dtype=src.dtype)
    grid = (triton.cdiv(plan.rows_ub, PAD_ROWS), triton.cdiv(src.shape[1], PAD_COLS))
    _pad_rows_kernel[grid](src, out, src_rows, plan.total, plan.rows_ub, src.shape[1], ROWS=PAD_ROWS,
                           BLOCK_C=PAD_COLS)
    return out


@dataclass(frozen=True)
class Schedule:
    """int32 table [programs, max_steps, 4] of (X row, dY row, N tile << 16 | K tile, dW row or -1) per step, and
    each program's step count."""

    table: torch.Tensor
    steps: torch.Tensor
    max_steps: int


def dw_schedule(plan: PaddedRows, pairs: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                programs: int, group_size_n: int = 1) -> Schedule:
    """Tiles t = 0.. (expert t // per_expert, then `_dw_tile`'s order) go round-robin to `programs` programs, each
    tile one step per row block of its expert, in tile order within a program."""
    experts = plan.blocks.shape[0]
    n_tiles, k_tiles = n // block_n, triton.cdiv(k, block_k)
    if max(n_tiles, k_tiles) >= 1 << 15:  # (N tile << 16) stays positive
        raise ValueError(f"scheduled dW: {n_tiles} N tiles or {k_tiles} K tiles do not fit the table's 15 bits")
    per_expert = n_tiles * k_tiles
    tiles = experts * per_expert
    rounds = triton.cdiv(tiles, programs)
    tile_blocks = torch.zeros(rounds * programs, device=plan.blocks.device, dtype=torch.int32)
    tile_blocks[:tiles] = plan.blocks.repeat_interleave(per_expert)
    by_round = tile_blocks.view(rounds, programs)
    offsets = (torch.cumsum(by_round, 0, dtype=torch.int32) - by_round).contiguous()
    steps = by_round.sum(0, dtype=torch.int32)
    # A program holds at most ⌈per_expert / P⌉ tiles of each expert, each of that expert's blocks.
    max_steps = triton.cdiv(per_expert, programs) * (triton.cdiv(pairs, block_m) + experts)
    table = torch.empty((programs, max_steps, 4), device=plan.blocks.device, dtype=torch.int32)
    _dw_schedule_kernel[(tiles,)](table, offsets, plan.blocks, plan.pad_row, plan.start, n, n_tiles, k_tiles,
                                  programs, max_steps, PAD_X=plan.x_src is not None, PAD_DY=plan.dy_src is not None,
                                  BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, GROUP_SIZE_N=group_size_n)
    return Schedule(table, steps, max_steps)


def operands_to_pad(n: int, k: int, permute_x: bool, permute_y: bool) -> tuple[bool, bool]:
    """(pad X, pad dY): an operand in token or pair order is gathered anyway, so it is the one copied; with neither
    permuted, the narrower one (less to copy). The other is read in place: its rows past an expert's end belong to
    the next expert and meet the padded operand's zeros."""
    if permute_x or permute_y:
        return permute_x, permute_y
    return k <= n, k > n


def scheduled_dw(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int,
                 permute_x: bool, permute_y: bool, *, block_m: int, block_n: int, block_k: int, group_size_n: int,
                 num_warps: int, num_stages: int, programs: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """dW [E, N, K] (into `out` when given) from X and dY in the layouts the forward saw (see `padded_rows`): pad
    one operand (or both), build the table, run `_dw_scheduled_kernel`. N must be a multiple of block_n (the output
    descriptor spans every expert's rows); rows must be 16-byte multiples (TMA)."""
    n, k, experts = dy.shape[1], x.shape[1], m_sizes.shape[0]
    pairs = dy.shape[0]
    if n % block_n:
        raise ValueError(f"scheduled dW: N={n} is not a multiple of BLOCK_SIZE_N={block_n}")
    if out is None:
        out = torch.empty((experts, n, k), device=x.device, dtype=x.dtype)
    pad_x, pad_dy = operands_to_pad(n, k, permute_x, permute_y)
    plan = padded_rows(m_sizes, gather, pairs, topk, permute_x, permute_y, block_m, pad_x, pad_dy)
    x_rows = pad(x, plan.x_src, plan) if pad_x else x
    dy_rows = pad(dy, plan.dy_src, plan) if pad_dy else dy
    programs = max(1, min(programs, experts * (n // block_n) * triton.cdiv(k, block_k)))
    sched = dw_schedule(plan, pairs, n, k, block_m, block_n, block_k, programs, group_size_n)
    _dw_scheduled_kernel[(programs,)](
        TensorDescriptor.from_tensor(x_rows, [block_m, block_k]),
        TensorDescriptor.from_tensor(dy_rows, [block_m, block_n]),
        TensorDescriptor.from_tensor(out.view(experts * n, k), [block_n, block_k]),
        sched.table, sched.steps, sched.max_steps,
        BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=block_k, num_warps=num_warps,
        num_stages=num_stages)
    return out
