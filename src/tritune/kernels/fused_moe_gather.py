"""Stage 1's activations gathered into the sort's order (the GATHER_A plan option): one copy launch after the sort,
so stage 1 reads each block's rows contiguously through a TMA descriptor instead of gathering them by pointers.
Hopper's TMA cannot gather rows (Blackwell's can), hence the copy; whether it pays is the GPU's to say.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROWS = 16  # sorted rows per program


@triton.jit(do_not_specialize=["numel", "rows"])
def _gather_rows_kernel(
    src_ptr, src_scale_ptr,  # activations [T, C] (16-bit or fp8, contiguous) and their fp32 scales [T, groups]
    dst_ptr, dst_scale_ptr,  # [rows, C] and [rows, groups] in the sort's order
    sorted_ids_ptr, num_post_ptr,  # int32, from the sort
    numel, rows, C, groups,
    TOPK: tl.constexpr, SCALES: tl.constexpr, G_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Row p of dst = src row sorted_ids[p] // TOPK for a real pair below the padded count, zeros otherwise (padding
    rows are read by stage 1 and never stored; zero scales keep them finite). Grid: (⌈rows/ROWS⌉, ⌈C/BLOCK_C⌉)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = r < rows
    pairs = tl.load(sorted_ids_ptr + r, mask=in_rows, other=numel)
    ok = (pairs < numel) & (r < tl.load(num_post_ptr))
    src_rows = tl.where(ok, pairs // TOPK, 0).to(tl.int64)
    dst_rows = r.to(tl.int64)
    x = tl.load(src_ptr + src_rows[:, None] * C + c[None, :], mask=ok[:, None] & (c < C)[None, :], other=0.0)
    tl.store(dst_ptr + dst_rows[:, None] * C + c[None, :], x, mask=in_rows[:, None] & (c < C)[None, :])
    if SCALES and tl.program_id(1) == 0:
        g = tl.arange(0, G_P2)
        s = tl.load(src_scale_ptr + src_rows[:, None] * groups + g[None, :], mask=ok[:, None] & (g < groups)[None, :],
                    other=0.0)
        tl.store(dst_scale_ptr + dst_rows[:, None] * groups + g[None, :], s,
                 mask=in_rows[:, None] & (g < groups)[None, :])


def gather_grid(rows: int, cols: int) -> tuple[tuple[int, int], int]:
    """(grid, BLOCK_C) of `_gather_rows_kernel` over `rows` sorted rows of `cols` columns."""
    block_c = min(triton.next_power_of_2(max(cols, 1)), 256)
    return (triton.cdiv(rows, ROWS), triton.cdiv(cols, block_c)), block_c
