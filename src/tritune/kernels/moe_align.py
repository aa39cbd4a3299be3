"""The MoE token sort ("moe_align_block_size"): group (token, slot) pairs by expert, pad each group to BLOCK_SIZE_M.

Owns the Triton kernels (one-launch path for small inputs, count/scatter or count/scan/scatter for larger ones),
their bound launcher (`AlignLaunch`), and the plain-torch reference they must match exactly. Nothing reads device
values on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune.compile_target import compile_only_process
from tritune.kernels.launch import BoundKernel
from tritune.kernels.mxfp4 import K32_BLOCK, k32_copy_block
from tritune.kernels.pdl import pdl_start
from tritune.kernels.quant import FP8, QuantLayout, quant_layout, quant_tile
from tritune.knobs import interpreting

SMALL_MAX = 64  # numel up to this takes the one-launch path (its pair-by-pair compare costs 225 µs at 256 on H100)
CHUNK = 128  # pairs per program in the multi-launch path; the rank step compares a CHUNK×CHUNK tile
_TILE_ELEMS = 4096  # elements per 2-D compare tile in the block fill and the chunk scan


@dataclass(frozen=True)
class MoeSorting:
    """The sort of the flat pairs p = t·topk + s by expert, in the layout the fused-MoE GEMM reads."""

    sorted_token_ids: torch.Tensor  # int32 [max_padded]: pair indices by expert, padding = numel
    expert_ids: torch.Tensor  # int32 [cdiv(max_padded, block_size)]: expert of each block, -1 past the end
    num_tokens_post_padded: torch.Tensor  # int32 [1]: sum over experts of the padded group lengths
    block_size: int
    numel: int


def max_padded_size(numel: int, num_experts: int, block_size: int) -> int:
    """Length of sorted_token_ids: room for every pair plus block_size-1 padding per expert."""
    return numel + num_experts * (block_size - 1)


def sorted_rows(numel: int, num_experts: int, block_size: int) -> int:
    """Rows of a buffer in the sort's order (a sorted intermediate, stage 1's gathered A): the row blocks the GEMM
    grids cover (gemm_blocks), never past the padded sort. Every block that holds pairs lies inside; the rest of
    the padded sort is never written or read, so at 1 token, top-8 of 128 experts and 16-row blocks the buffer (and
    the launches that run over it: the split-K finish, the intermediate's fp8 quantization) has 144 rows, not 1928."""
    blocks = gemm_blocks(numel, num_experts, block_size)
    return min(max_padded_size(numel, num_experts, block_size), blocks * block_size)


# False: the GEMM grids cover every block of the padded sort, as before gemm_blocks (the A/B of its measurement).
GEMM_GRID_TIGHT = True


def gemm_blocks(numel: int, num_experts: int, block_size: int) -> int:
    """How many row blocks a GEMM over the sort must cover: at most ⌈numel/block_size⌉ + min(experts, numel) - 1
    blocks hold pairs (each expert with pairs adds at most one partial block; blocks are laid out from 0), never
    more than the padded sort has. The GEMM grids are sized by this, not by the padded length: with few pairs and
    many experts (decode: 1 token, top-8 of 128 experts, 16-row blocks) the padded sort has 121 blocks and 8 hold
    pairs, so 15 of every 16 programs would start only to find their block past the end and exit."""
    padded = triton.cdiv(max_padded_size(numel, num_experts, block_size), block_size)
    if not GEMM_GRID_TIGHT:
        return padded
    if numel <= 0:
        return 1
    return min(padded, triton.cdiv(numel, block_size) + min(num_experts, numel))


@triton.jit
def _fill_blocks(
    sorted_ptr, expert_ids_ptr,  # int32 [max_padded], int32 [num_blocks]
    blk_begin, blk_end,  # this program's block range [blk_begin, blk_end)
    seg_lo, seg_nblk, seg_cnt, seg_eid,  # int32 [V] each: first block, blocks, real pairs and expert of a segment
    numel, max_padded,
    BS: tl.constexpr, BS_P2: tl.constexpr, BT: tl.constexpr,
):
    """Write expert_ids for blocks [blk_begin, blk_end) and `numel` into their positions that hold no pair.

    Segments are experts (multi-launch path) or first pairs of experts (one-launch path); empty ones never match.
    Padding and real positions are disjoint, so these stores never race with the scatter of the pairs.

    Grid: none of its own; inlined into the one-launch and scatter kernels.
    """
    seg_hi = seg_lo + seg_nblk
    j = tl.arange(0, BS_P2)
    for b0 in range(blk_begin, blk_end, BT):
        b = b0 + tl.arange(0, BT)
        b_ok = b < blk_end
        hit = (seg_lo[None, :] <= b[:, None]) & (b[:, None] < seg_hi[None, :])  # [BT, V], at most one per row
        found = tl.sum(hit.to(tl.int32), axis=1) > 0
        eid = tl.sum(tl.where(hit, seg_eid[None, :], 0), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(found, eid, -1), mask=b_ok)
        # Real pairs of the segment fill [lo·BS, lo·BS + cnt); blocks of no segment get lo = cnt = 0: all padding.
        real_end = tl.sum(tl.where(hit, seg_lo[None, :] * BS + seg_cnt[None, :], 0), axis=1)
        q = b[:, None] * BS + j[None, :]  # [BT, BS_P2] positions
        pad = b_ok[:, None] & (j[None, :] < BS) & (q < max_padded) & (q >= real_end[:, None])
        tl.store(sorted_ptr + q, tl.zeros_like(q) + numel, mask=pad)


@triton.jit
def _align_small(
    ids_ptr,  # int32/int64 [numel] flat topk_ids
    sorted_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [num_blocks]
    ntpp_ptr,  # int32 [1] num_tokens_post_padded
    numel, num_experts, max_padded, num_blocks,
    BS: tl.constexpr, BS_P2: tl.constexpr, N_P2: tl.constexpr, BT: tl.constexpr,
):
    """All three steps in one program for numel <= N_P2, with pair×pair compares only (no per-expert vectors)."""
    i = tl.arange(0, N_P2)
    ids = tl.load(ids_ptr + i, mask=i < numel, other=-1).to(tl.int32)
    valid = (i < numel) & (ids >= 0) & (ids < num_experts)
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]  # [N_P2, N_P2]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # earlier pairs of the same expert
    cnt = tl.sum(same.to(tl.int32), axis=1)
    # The first pair of each expert stands for the expert: its block count, zero for every other pair.
    nblk = tl.where(valid & (rank == 0), (cnt + BS - 1) // BS, 0)
    lo = tl.sum(tl.where(ids[None, :] < ids[:, None], nblk[None, :], 0), axis=1)  # blocks of smaller experts
    tl.store(sorted_ptr + lo * BS + rank, i, mask=valid)
    tl.store(ntpp_ptr, tl.sum(nblk, axis=0) * BS)
    _fill_blocks(sorted_ptr, expert_ids_ptr, 0, num_blocks, lo, nblk, cnt, ids, numel, max_padded, BS, BS_P2, BT)


@triton.jit
def _count_chunk(
    pid,  # the chunk
    ids_ptr,  # int32/int64 [numel] flat topk_ids
    counts_ptr,  # int32 [num_chunks, num_experts] out: pairs of each expert in each chunk
    numel, num_experts,
    CHUNK: tl.constexpr, NB: tl.constexpr,  # NB: power of two > num_experts (bin num_experts takes bad ids)
):
    """Per-expert counts of one chunk of pairs."""
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (ids >= 0) & (ids < num_experts)
    hist = tl.histogram(tl.where(valid, ids, num_experts), NB)
    e = tl.arange(0, NB)
    tl.store(counts_ptr + pid * num_experts + e, hist, mask=e < num_experts)


@triton.jit(do_not_specialize=["numel", "max_padded", "num_blocks", "sort_programs", "quant_programs", "n_zero",
                               "n_zero2", "R"])
def _moe_align_first_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr,  # as in _align_small
    counts_ptr,  # int32 [num_chunks, num_experts] (multi-launch path; unused when SMALL)
    x_ptr, q_ptr, s_ptr,  # riding along: x [rows, C] quantized to fp8 q [rows, C] and fp32 s [rows, groups] (K32:
    # copied into q [rows, C] of x's dtype in the K32 order; s unused)
    zero_ptr, zero2_ptr,  # riding along: fp32 [n_zero] and fp32 [n_zero2] set to zero
    numel, num_experts, max_padded, num_blocks, sort_programs, quant_programs, n_zero, n_zero2, R, C, stride_x, groups,
    SMALL: tl.constexpr, BS: tl.constexpr, BS_P2: tl.constexpr, N_P2: tl.constexpr, BT: tl.constexpr,
    CHUNK: tl.constexpr, NB: tl.constexpr, GROUP: tl.constexpr, QBLOCK: tl.constexpr, QROWS: tl.constexpr,
    ZBLOCK: tl.constexpr, K32: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent (kernels/pdl.py)
):
    """The sort's first launch (all of it for few pairs, else the chunk counts), with independent work the fused
    MoE needs before its GEMMs riding along in the same launch: the fp8 quantization of the activations (one
    program per QROWS rows and scale group; with K32 instead their copy in the K32 order the swapped MXFP4 stage 1
    reads, one program per row and QBLOCK columns) and the zeroing of up to two fp32 buffers (the 1-stage or top-k
    accumulator, the fused fp8 quantization's amax). One launch instead of three or four.

    Grid: (sort_programs + quant_programs + ⌈n_zero/ZBLOCK⌉ + ⌈n_zero2/ZBLOCK⌉,).
    """
    pdl_start(PDL)
    pid = tl.program_id(0)
    if pid < sort_programs:
        if SMALL:
            _align_small(ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, numel, num_experts, max_padded, num_blocks,
                         BS, BS_P2, N_P2, BT)
        else:
            _count_chunk(pid, ids_ptr, counts_ptr, numel, num_experts, CHUNK, NB)
    elif pid < sort_programs + quant_programs:
        q = pid - sort_programs
        if K32:
            k32_copy_block(x_ptr, q_ptr, q // groups, q % groups, C, stride_x, QBLOCK)
        else:
            quant_tile(x_ptr, q_ptr, s_ptr, (q // groups) * QROWS, q % groups, R, C, stride_x, C, groups, GROUP,
                       QBLOCK, QROWS)
    else:
        z = pid - sort_programs - quant_programs
        first = tl.cdiv(n_zero, ZBLOCK)
        if z < first:
            offs = z * ZBLOCK + tl.arange(0, ZBLOCK)
            tl.store(zero_ptr + offs, tl.zeros((ZBLOCK,), dtype=tl.float32), mask=offs < n_zero)
        else:
            offs = (z - first) * ZBLOCK + tl.arange(0, ZBLOCK)
            tl.store(zero2_ptr + offs, tl.zeros((ZBLOCK,), dtype=tl.float32), mask=offs < n_zero2)


@triton.jit(do_not_specialize=["num_chunks"])
def _moe_scan_kernel(
    counts_ptr,  # int32 [num_chunks, num_experts] in: counts; out: exclusive prefix over chunks (in place)
    expert_info_ptr,  # int32 [2, num_experts] out: row 0 first block of each expert, row 1 its pair count
    ntpp_ptr,  # int32 [1] num_tokens_post_padded
    num_chunks, num_experts,
    BS: tl.constexpr, E_P2: tl.constexpr, CT: tl.constexpr,
):
    """Chunk offsets per expert, expert totals, block starts and the padded total, CT chunks per step.

    Grid: (1,).
    """
    e = tl.arange(0, E_P2)
    e_ok = e < num_experts
    carry = tl.zeros((E_P2,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CT):
        rows = c0 + tl.arange(0, CT)
        m = (rows < num_chunks)[:, None] & e_ok[None, :]
        ptrs = counts_ptr + rows[:, None] * num_experts + e[None, :]
        x = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(x, axis=0) - x + carry[None, :], mask=m)
        carry += tl.sum(x, axis=0)
    nblk = (carry + BS - 1) // BS
    lo = tl.cumsum(nblk, axis=0) - nblk
    tl.store(expert_info_ptr + e, lo, mask=e_ok)
    tl.store(expert_info_ptr + num_experts + e, carry, mask=e_ok)
    tl.store(ntpp_ptr, tl.sum(nblk, axis=0) * BS)


@triton.jit(do_not_specialize=["numel", "max_padded", "num_blocks", "blocks_per_program", "num_chunks"])
def _moe_scatter_kernel(
    ids_ptr,  # int32/int64 [numel] flat topk_ids
    offsets_ptr,  # int32 [num_chunks, num_experts]: SELF_SCAN: per-chunk counts; else exclusive prefix over chunks
    expert_info_ptr,  # int32: SELF_SCAN: scratch rows [num_chunks, E]; else [2, E] first block and count
    sorted_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [num_blocks]
    ntpp_ptr,  # int32 [1] num_tokens_post_padded (written here only with SELF_SCAN)
    numel, num_experts, max_padded, num_blocks, blocks_per_program, num_chunks,
    CHUNK: tl.constexpr, BS: tl.constexpr, BS_P2: tl.constexpr, E_P2: tl.constexpr, BT: tl.constexpr,
    SELF_SCAN: tl.constexpr, CT: tl.constexpr,
):
    """Place one chunk's pairs (stable within each expert), then fill this program's share of blocks.

    SELF_SCAN (few chunks): each program sums the chunk counts itself (all of them for the expert totals, the
    earlier ones for its own offsets), so the sort needs no separate scan launch; the per-pair gather of its
    offsets goes through its own scratch row. Grid: (⌈numel/CHUNK⌉,).
    """
    pid = tl.program_id(0)
    ev = tl.arange(0, E_P2)
    e_ok = ev < num_experts
    if SELF_SCAN:
        cnt = tl.zeros((E_P2,), dtype=tl.int32)
        before = tl.zeros((E_P2,), dtype=tl.int32)
        for c0 in range(0, num_chunks, CT):
            rows = c0 + tl.arange(0, CT)
            x = tl.load(offsets_ptr + rows[:, None] * num_experts + ev[None, :],
                        mask=(rows < num_chunks)[:, None] & e_ok[None, :], other=0)
            cnt += tl.sum(x, axis=0)
            before += tl.sum(tl.where((rows < pid)[:, None], x, 0), axis=0)
        nblk = (cnt + BS - 1) // BS
        lo = tl.cumsum(nblk, axis=0) - nblk
        if pid == 0:
            tl.store(ntpp_ptr, tl.sum(nblk, axis=0) * BS)
        row = expert_info_ptr + pid * num_experts
        tl.store(row + ev, lo * BS + before, mask=e_ok)
        tl.debug_barrier()  # the row is gathered below by other threads of this program
    else:
        lo = tl.load(expert_info_ptr + ev, mask=e_ok, other=0)
        cnt = tl.load(expert_info_ptr + num_experts + ev, mask=e_ok, other=0)
        nblk = (cnt + BS - 1) // BS
    k = tl.arange(0, CHUNK)
    offs = pid * CHUNK + k
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    valid = (offs < numel) & (ids >= 0) & (ids < num_experts)
    # Rank among the chunk's earlier pairs of the same expert; an invalid i never stores, a valid i only
    # matches valid j, so the -1 fill of the tail cannot leak into a rank.
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (k[None, :] < k[:, None])).to(tl.int32), axis=1)
    e = tl.where(valid, ids, 0)
    if SELF_SCAN:
        base = tl.load(expert_info_ptr + pid * num_experts + e)
    else:
        base = tl.load(expert_info_ptr + e) * BS + tl.load(offsets_ptr + pid * num_experts + e)
    tl.store(sorted_ptr + base + rank, offs, mask=valid)

    blk_begin = pid * blocks_per_program
    blk_end = tl.minimum(blk_begin + blocks_per_program, num_blocks)
    _fill_blocks(sorted_ptr, expert_ids_ptr, blk_begin, blk_end, lo, nblk, cnt, ev,
                 numel, max_padded, BS, BS_P2, BT)


def _validate(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [tokens, topk], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    numel = topk_ids.numel()
    if max(max_padded_size(numel, num_experts, block_size), triton.cdiv(numel, CHUNK) * num_experts) >= 2**31:
        raise ValueError(f"{numel} pairs, {num_experts} experts, block {block_size} overflow int32 offsets")


def moe_align_block_size_reference(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> MoeSorting:
    """Plain-torch sort, any device: the definition the Triton path must equal exactly.

    topk_ids int32/int64 [T, topk] with values in [0, num_experts); pairs with other values are left out.
    """
    _validate(topk_ids, block_size, num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_padded = max_padded_size(numel, num_experts, block_size)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # bad ids sort last, into bin E
    counts = torch.bincount(key, minlength=num_experts + 1)
    nblk = (counts[:num_experts] + block_size - 1) // block_size
    blk_lo = torch.cumsum(nblk, 0) - nblk
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first_of_key = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel, device=dev) - first_of_key[sorted_key]
    ok = sorted_key < num_experts
    pos = torch.where(ok, blk_lo[sorted_key.clamp(max=num_experts - 1)] * block_size + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), numel, dtype=torch.int32, device=dev)  # last slot takes bad ids
    sorted_ids[pos] = order.to(torch.int32)
    num_blocks = triton.cdiv(max_padded, block_size)
    expert = torch.searchsorted(torch.cumsum(nblk, 0), torch.arange(num_blocks, device=dev), right=True)
    expert_ids = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    ntpp = (nblk.sum() * block_size).reshape(1).to(torch.int32)
    return MoeSorting(sorted_ids[:max_padded], expert_ids, ntpp, block_size, numel)


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _block_tile(v_p2: int, bs_p2: int) -> int:
    """Blocks per fill step, so the [BT, V] and [BT, BS_P2] tiles stay near _TILE_ELEMS elements."""
    return max(1, min(64, _TILE_ELEMS // max(v_p2, bs_p2)))


@dataclass(frozen=True)
class RideAlong:
    """Work the fused MoE hands the sort's first launch: quantize `rows` rows of `cols` columns of an activation
    (row stride `stride`, `group` columns per scale, 0 for per row; `x` a tensor or a dtype at binding) and zero
    `zero` fp32 elements and, in a second buffer, `zero2` more (of `zero2_dtype`: a 16-bit accumulator too). All land
    in pieces of the sort's workspace. With `k32`
    the rows are copied in the K32 order instead (x's dtype, no scales: the swapped MXFP4 stage 1's input,
    kernels/mxfp4.py), which saves that GEMM's own copy launch."""

    x: torch.Tensor | torch.dtype | None = None
    rows: int = 0
    cols: int = 0
    stride: int = 0
    group: int = 0
    zero: int = 0
    zero2: int = 0
    k32: bool = False
    zero2_dtype: torch.dtype = torch.float32


_ZBLOCK = 4096


class AlignLaunch:
    """`moe_align_block_size` for one (pairs, experts, block size, ids dtype and alignment), bound once. `pdl`: the
    first launch is a programmatic dependent of whatever ran before (kernels/pdl.py; the fused-MoE plan's choice).

    Its buffers are `pieces` (dtype, numel) in the caller's workspace, in the order `__call__` takes them:
    sorted_token_ids, expert_ids, num_tokens_post_padded, the scratch of the multi-launch paths (3, 4), then the
    ride-along outputs: fp8 activations and their scales (`q_piece`, `q_piece + 1`) and the zeroed buffers
    (`zero_piece`, `zero2_piece`). Launches: one for numel <= SMALL_MAX; two (count, scatter that scans for itself)
    up to SELF_SCAN_COUNTS counts; three (count, scan, scatter) beyond, where one scan beats every program re-reading
    all the counts. The ride-along work runs in the first launch.
    """

    def __init__(self, flat_ids: torch.Tensor, block_size: int, num_experts: int,
                 ride: RideAlong = RideAlong(), pdl: bool = False) -> None:
        numel = flat_ids.numel()
        self.numel, self.block_size = numel, block_size
        self.max_padded = max_padded_size(numel, num_experts, block_size)
        self.num_blocks = num_blocks = triton.cdiv(self.max_padded, block_size)
        self.gemm_blocks = gemm_blocks(numel, num_experts, block_size)  # the GEMM grids' row blocks
        self.sorted_rows = sorted_rows(numel, num_experts, block_size)  # rows of buffers in the sort's order
        i32, f32 = torch.int32, torch.float32
        small = numel <= SMALL_MAX
        num_chunks = triton.cdiv(numel, CHUNK)
        self_scan = num_chunks * num_experts <= SELF_SCAN_COUNTS
        pieces = [(i32, self.max_padded), (i32, num_blocks), (i32, 1),
                  (i32, 1 if small else num_chunks * num_experts),  # 3: per-chunk counts (or their prefix)
                  (i32, 1 if small else (num_chunks if self_scan else 2) * num_experts)]  # 4: scratch / expert info
        if ride.k32:  # one program per row and K32_BLOCK columns; a one-element stand-in for the scales' piece
            x_dtype = ride.x if isinstance(ride.x, torch.dtype) else ride.x.dtype
            qlay = QuantLayout(triton.cdiv(ride.cols, K32_BLOCK), K32_BLOCK, 1, 4)
            quant_pieces = [(x_dtype, ride.rows * ride.cols), (f32, 1)]
        else:
            qlay = quant_layout(ride.cols, ride.group) if ride.rows else None
            quant_pieces = [(FP8, ride.rows * ride.cols), (f32, ride.rows * (qlay.groups if qlay else 1))]
        groups = qlay.groups if qlay else 1
        self.q_piece = self.zero_piece = self.zero2_piece = None
        if ride.rows:
            self.q_piece = len(pieces)
            pieces += quant_pieces
            self.groups = groups
        if ride.zero:
            self.zero_piece = len(pieces)
            pieces.append((f32, ride.zero))
        if ride.zero2:
            self.zero2_piece = len(pieces)
            pieces.append((ride.zero2_dtype, ride.zero2))
        self.pieces = tuple(pieces)
        bs_p2 = _p2(block_size)
        n_p2 = _p2(numel)
        e_p2 = _p2(num_experts)
        sort_programs = 1 if small else num_chunks
        quant_programs = qlay.programs(ride.rows) if qlay else 0
        self.launches: list[tuple[BoundKernel, tuple[int, ...], bool]] = []  # kernel, its pieces, takes ids?
        uses = (0, 1, 2, 3, self.q_piece or 0, (self.q_piece or 0) + bool(ride.rows), self.zero_piece or 0,
                self.zero2_piece or 0)
        self.takes_x = ride.rows > 0
        first = (flat_ids, *(pieces[i][0] for i in uses[:4]), ride.x if ride.rows else flat_ids,
                 *(pieces[i][0] for i in uses[4:]),
                 numel, num_experts, self.max_padded, num_blocks, sort_programs, quant_programs, ride.zero, ride.zero2,
                 ride.rows, ride.cols, ride.stride, groups, small, block_size, bs_p2, n_p2,
                 _block_tile(n_p2 if small else e_p2, bs_p2), CHUNK, _p2(num_experts + 1), ride.group,
                 qlay.block if qlay else 16, qlay.rows if qlay else 1, _ZBLOCK, ride.k32, pdl)
        warps = max(8 if small and n_p2 > 64 else 4, qlay.warps if qlay else 1)
        zero_programs = triton.cdiv(ride.zero, _ZBLOCK) + triton.cdiv(ride.zero2, _ZBLOCK)
        self._first = BoundKernel(_moe_align_first_kernel, (sort_programs + quant_programs + zero_programs,),
                                  first, varying=10, num_warps=warps, num_stages=1, launch_pdl=pdl)
        self._first_uses = uses
        if small:
            return
        ct = max(1, _TILE_ELEMS // e_p2)
        if not self_scan:
            self._add(_moe_scan_kernel, (1,), None, (3, 4, 2), pieces,
                      (num_chunks, num_experts, block_size, e_p2, ct), 8)
        self._add(_moe_scatter_kernel, (num_chunks,), flat_ids, (3, 4, 0, 1, 2), pieces,
                  (numel, num_experts, self.max_padded, num_blocks, triton.cdiv(num_blocks, num_chunks), num_chunks,
                   CHUNK, block_size, bs_p2, e_p2, _block_tile(e_p2, bs_p2), self_scan, min(ct, _p2(num_chunks))), 4)

    def _add(self, fn, grid: tuple[int, ...], ids: torch.Tensor | None, uses: tuple[int, ...], pieces: list,
             tail: tuple, num_warps: int) -> None:
        head = ((ids,) if ids is not None else ()) + tuple(pieces[i][0] for i in uses)
        bound = BoundKernel(fn, grid, (*head, *tail), varying=len(head), num_warps=num_warps, num_stages=1)
        self.launches.append((bound, uses, ids is not None))

    def steps(self) -> list[tuple[BoundKernel, tuple[tuple[str, int], ...]]]:
        """The launches in order, each with where its pointers come from: ("ids", 0) the flat ids, ("x", 0) the
        activation to quantize, ("p", i) piece i. A caller that runs several launches per call (the fused-MoE op)
        resolves them all from one flat list instead of calling this object."""
        u = self._first_uses
        first = (("ids", 0), *(("p", i) for i in u[:4]), ("x", 0) if self.takes_x else ("ids", 0),
                 *(("p", i) for i in u[4:]))
        rest = [(bound, ((("ids", 0),) if takes_ids else ()) + tuple(("p", i) for i in uses))
                for bound, uses, takes_ids in self.launches]
        return [(self._first, first), *rest]

    def __call__(self, flat_ids, pieces: Sequence, x=None) -> None:
        """Sort `flat_ids` (a tensor or its address) into `pieces` (addresses or tensors, in the order of
        `self.pieces`); `x` is the activation to quantize (tensor or address) when this sort carries that work."""
        u = self._first_uses
        self._first.launch(flat_ids, pieces[u[0]], pieces[u[1]], pieces[u[2]], pieces[u[3]],
                           x if self.takes_x else flat_ids, pieces[u[4]], pieces[u[5]], pieces[u[6]], pieces[u[7]])
        for bound, uses, takes_ids in self.launches:
            if takes_ids:
                bound.launch(flat_ids, *(pieces[i] for i in uses))
            else:
                bound.launch(*(pieces[i] for i in uses))


# Up to this many chunk counts (chunks × experts; 256 KB) every scatter program re-reads all of them (~1 µs from L2)
# rather than pay a scan launch: 65536 pairs at 128 experts, 8192 at 1024.
SELF_SCAN_COUNTS = 65536


def compile_sort_only(numel: int, block_size: int, num_experts: int, ids_dtype: torch.dtype = torch.int32) -> None:
    """In a compile process (`compile_target.compile_without_gpu`): build the sort's kernels for `numel` contiguous
    ids, as the `AlignLaunch` a GPU worker's `moe_align_block_size` binds (the same code, so the same keys; its
    bound kernels only compile here). Without it each GPU worker compiled them on its first candidate of a size, at
    the same moment as the others (issue 17). Nothing in a process with a GPU."""
    if compile_only_process():
        AlignLaunch(torch.empty(numel, dtype=ids_dtype), block_size, num_experts)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> MoeSorting:
    """Triton sort, same result as `moe_align_block_size_reference`, without a host synchronisation.

    topk_ids int32/int64 [T, topk], values in [0, num_experts). One to three launches (see `AlignLaunch`); every
    size is host-known, so the call can be captured in a CUDA graph. Binds afresh per call: the fused-MoE op keeps
    an `AlignLaunch` in its plan instead.
    """
    _validate(topk_ids, block_size, num_experts)
    if topk_ids.device.type != "cuda" and not interpreting():
        raise ValueError(f"moe_align_block_size: topk_ids is on {topk_ids.device}; the sort's kernels run on a CUDA "
                         "device (or on the CPU under TRITON_INTERPRET=1)")
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type == "cuda":
        with torch.cuda.device(flat.device):
            launch = AlignLaunch(flat, block_size, num_experts)
    else:
        launch = AlignLaunch(flat, block_size, num_experts)
    tensors = [torch.empty(max(numel, 1), dtype=dtype, device=flat.device) for dtype, numel in launch.pieces]
    launch(flat, tensors)
    return MoeSorting(tensors[0], tensors[1], tensors[2], block_size, flat.numel())
