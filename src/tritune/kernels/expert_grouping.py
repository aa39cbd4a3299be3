"""The training MLP's routing sort in two or three Triton launches: per-expert row counts (m_sizes) and the pairs
grouped by expert in token order within each expert (gather_indices), from topk_ids.

Why: torch's stable argsort, zeros, scatter_add and casts were about 125 µs of host time a call on the H100 and
seven-odd launches (a cub radix sort among them), the largest single host cost of a small training step after the
GEMMs (profile_moe_mlp_host.py, fourteenth session). Here each chunk of CHUNK pairs is counted (tl.histogram), then
each chunk places its pairs: the expert's first grouped row, plus the same expert's pairs in earlier chunks, plus
its rank among the chunk's pairs of that expert (a sort of (expert, position) keys keeps token order). While the
count table is small, each chunk reads every chunk's counts itself (two launches; the reads grow with the square of
the chunk count). From SCAN_FROM_COUNTS counts (chunks times experts), one program per expert scans its column of
counts first (three launches, linear: a step of 64K tokens at top-8 has 2048 chunks). No host sync; the result
equals the stable argsort's exactly. Expert ids must lie in [0, num_experts), as a router gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritune.kernels.grouped_launch import launch

CHUNK = 256  # pairs a program counts and places
# From this many counts (chunks × experts rounded up to a power of two), a scan launch replaces every chunk reading
# all the counts. Measured on the H100 (probe_expert_grouping.py, fifteenth session), the two paths cross there for
# 8, 64 and 128 experts alike: at 8192 counts the two launches win by 0.3-1.6 µs (E 8 at 1024 chunks ties: 14.5
# against 14.1), at 16384 the scan wins (E 128, 128 chunks: 11.2 against 11.8 µs), and by 2048 chunks of E 128 the
# two launches take 727 µs against the scan's 25.5.
SCAN_FROM_COUNTS = 16384
SCAN_BLOCK = 1024  # chunks an expert's scan program sums at once
HELPER_LAUNCH = {"num_warps": 4, "num_stages": 1}


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, P, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to expert e. Grid: (⌈P/CHUNK⌉,)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < P
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    hist = tl.histogram(ids, E_POW2)
    bins = tl.arange(0, E_POW2)
    hist -= tl.where(bins == 0, CHUNK - tl.sum(ok.to(tl.int32), axis=0), 0)  # the last chunk's padding, counted in 0
    tl.store(counts_ptr + c * E_POW2 + bins, hist)


@triton.jit
def _expert_scan_kernel(counts_ptr, bases_ptr, m_sizes_ptr, num_chunks, E_POW2: tl.constexpr,
                        SCAN_BLOCK: tl.constexpr):
    """bases[c, e] = expert e's pairs in chunks before c; m_sizes[e] = all of them. Grid: (num_experts,)."""
    e = tl.program_id(0)
    carry = 0
    for c0 in range(0, num_chunks, SCAN_BLOCK):
        rows = c0 + tl.arange(0, SCAN_BLOCK)
        ok = rows < num_chunks
        vals = tl.load(counts_ptr + rows * E_POW2 + e, mask=ok, other=0)
        tl.store(bases_ptr + rows * E_POW2 + e, carry + tl.cumsum(vals, axis=0) - vals, mask=ok)
        carry += tl.sum(vals, axis=0)
    tl.store(m_sizes_ptr + e, carry)


@triton.jit
def _place_pairs_kernel(ids_ptr, counts_ptr, bases_ptr, m_sizes_ptr, gather_ptr, P, num_chunks,
                        NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                        SCANNED: tl.constexpr):
    """gather[first row of e + e's pairs in chunks before c + rank in c] = p for each pair p of chunk c routed to e.
    SCANNED: `_expert_scan_kernel` wrote m_sizes and each chunk's pairs before it into bases; else every program
    sums all chunks' counts, and program 0 writes m_sizes. Grid: (⌈P/CHUNK⌉,)."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    if SCANNED:
        totals = tl.load(m_sizes_ptr + experts, mask=experts < NUM_EXPERTS, other=0)
        before = tl.load(bases_ptr + c * E_POW2 + experts, mask=experts < NUM_EXPERTS, other=0)
        tl.debug_barrier()  # every thread has read this chunk's row of bases before it is overwritten below
    else:
        totals = tl.zeros((E_POW2,), dtype=tl.int32)
        before = tl.zeros((E_POW2,), dtype=tl.int32)
        for c0 in range(0, num_chunks, ROWS):  # every chunk's counts, ROWS chunks at a time
            rows = c0 + tl.arange(0, ROWS)
            table = tl.load(counts_ptr + rows[:, None] * E_POW2 + experts[None, :],
                            mask=(rows < num_chunks)[:, None], other=0)
            totals += tl.sum(table, axis=0)
            before += tl.sum(tl.where((rows < c)[:, None], table, 0), axis=0)
        if c == 0:
            tl.store(m_sizes_ptr + experts, totals, mask=experts < NUM_EXPERTS)
    mine = tl.load(counts_ptr + c * E_POW2 + experts)
    # where this chunk's first pair of each expert goes, less its first position in the chunk's sorted order
    tl.store(bases_ptr + c * E_POW2 + experts, (tl.cumsum(totals, axis=0) - totals) + before
             - (tl.cumsum(mine, axis=0) - mine))
    tl.debug_barrier()  # the bases are read back below by other threads of this program
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=E_POW2).to(tl.int32)  # padding sorts last
    keys = tl.sort(ids * CHUNK + tl.arange(0, CHUNK))  # by expert, then position: token order within an expert
    e = keys // CHUNK
    real = e < E_POW2
    base = tl.load(bases_ptr + c * E_POW2 + e, mask=real, other=0)
    tl.store(gather_ptr + base + tl.arange(0, CHUNK), (c * CHUNK + keys % CHUNK).to(tl.int32), mask=real)


def scans(chunks: int, e_pow2: int) -> bool:
    """Whether the sort runs its scan launch for this many chunks and (power-of-two) experts."""
    return chunks * e_pow2 >= SCAN_FROM_COUNTS


def group_by_expert_triton(topk_ids: torch.Tensor, num_experts: int,
                           scan_from_chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_sizes int32 [E], gather_indices int32 [T·topk]) for topk_ids [T, topk]: `grouped_gemm.group_by_expert`'s
    result, in two launches, or three (the scan) where `scans` says, or from `scan_from_chunks` chunks of CHUNK
    pairs when given (the probe and the tests force either path so)."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pairs = flat.numel()
    if pairs == 0:  # an empty batch: nothing to launch
        return (torch.zeros(num_experts, device=flat.device, dtype=torch.int32),
                torch.empty(0, device=flat.device, dtype=torch.int32))
    e_pow2 = triton.next_power_of_2(max(num_experts, 2))
    chunks = max(1, triton.cdiv(pairs, CHUNK))
    counts = torch.empty((chunks, e_pow2), device=flat.device, dtype=torch.int32)
    bases = torch.empty_like(counts)
    m_sizes = torch.empty(num_experts, device=flat.device, dtype=torch.int32)
    gather = torch.empty(pairs, device=flat.device, dtype=torch.int32)
    launch(_chunk_counts_kernel, (chunks,), dict(ids_ptr=flat, counts_ptr=counts, P=pairs, E_POW2=e_pow2,
                                                 CHUNK=CHUNK), **HELPER_LAUNCH)
    scanned = scans(chunks, e_pow2) if scan_from_chunks is None else chunks >= scan_from_chunks
    if scanned:
        launch(_expert_scan_kernel, (num_experts,), dict(counts_ptr=counts, bases_ptr=bases, m_sizes_ptr=m_sizes,
                                                         num_chunks=chunks, E_POW2=e_pow2, SCAN_BLOCK=SCAN_BLOCK),
               **HELPER_LAUNCH)
    launch(_place_pairs_kernel, (chunks,), dict(
        ids_ptr=flat, counts_ptr=counts, bases_ptr=bases, m_sizes_ptr=m_sizes, gather_ptr=gather, P=pairs,
        num_chunks=chunks, NUM_EXPERTS=num_experts, E_POW2=e_pow2, CHUNK=CHUNK, ROWS=max(1, 4096 // e_pow2),
        SCANNED=scanned), **HELPER_LAUNCH)
    return m_sizes, gather
