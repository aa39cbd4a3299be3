r"""Grouped-GEMM dW with per-expert TMA bounds, as an experiment outside the op (issue 15): does a dW kernel whose
every row block, the expert's last one included, loads through TMA beat `torch._grouped_mm` on pre-gathered rows?

Why: dW[e] = dY[e]ᵀ·X[e] reduces over the expert's rows, so its reduction is short (Qwen3-30B-A3B at 8192 tokens:
512 rows an expert on average, 8 steps of 64) and each output tile pays its pipeline fill again. The op's kernel
loads full row blocks through host TMA descriptors and the expert's last, partial block through masked pointer loads
outside the pipelined loop: one unpipelined global-memory round trip per output tile. Here each tile builds device
descriptors whose row bound is the expert's end, so TMA zero-fills the rows past it and the whole reduction is one
pipelined loop; the persistent tile loop may be flattened so the next tile's loads start under this tile's MMAs.

    PYTHONPATH=src python benchmarks/probe_grouped_dw.py --out $OUT/dw.json

Prints a JSON row per (model, GEMM): `torch._grouped_mm` (bare, rows pre-gathered), the op's dW kernel with its
shipped config on the same pre-gathered rows, then each variant of the op's kernel and of this file's two as
[µs, rel L2 against `_grouped_mm`]; a table of the best of each last.

A second experiment, `_dw_padded_kernel`: rows padded per expert to whole row blocks (done outside the timing), so
every program's row blocks of all its tiles form one loop Triton pipelines, the epilogue under an `if`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from itertools import product

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.grouped_gemm import _dw_tile

MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}  # E, topk, hidden, inter
# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages): the reduction step BM and the output tile
# BN x BK, each within the H100's 227 KiB with its epilogue tile
VARIANTS = ((64, 128, 256, 8, 3), (32, 128, 256, 8, 5), (32, 128, 256, 8, 6), (16, 128, 256, 8, 8),
            (64, 256, 128, 8, 3), (32, 256, 128, 8, 5))
GROUPS = (1, 4, 8, 16)  # GROUP_SIZE_N: N tiles walked together along K
KERNELS = ("op", "bounded", "padded", "scheduled")  # the op's dW kernel, and the experiments of this file


@triton.jit
def _dw_bounded_kernel(x_ptr, dy_ptr, dw_desc, m_sizes_ptr, N, K,
                       NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FLATTEN: tl.constexpr,
                       GROUP_SIZE_N: tl.constexpr):
    """dW [E·N, K] tiles BN x BK, persistent over (expert, N tile, K tile) in the op's dW tile order; x [P, K] and
    dy [P, N] in grouped order."""
    offs_e = tl.arange(0, E_POW2)
    counts = tl.load(m_sizes_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    n_tiles = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_expert = n_tiles * k_tiles
    for t in tl.range(tl.program_id(0), NUM_EXPERTS * per_expert, NUM_PROGRAMS, flatten=FLATTEN):
        e = t // per_expert
        row0 = tl.sum(tl.where(offs_e < e, counts, 0), axis=0)
        end = row0 + tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
        pid_n, pid_k = _dw_tile(t % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
        off_n = pid_n * BN
        off_k = pid_k * BK
        # rows past `end` belong to the next expert: TMA reads them as zeros
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[end, K], strides=[K, 1], block_shape=[BM, BK])
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[end, N], strides=[N, 1], block_shape=[BM, BN])
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for m0 in range(row0, end, BM):
            acc = tl.dot(dy_desc.load([m0, off_n]).T, x_desc.load([m0, off_k]), acc)
        dw_desc.store([e * N + off_n, off_k], acc.to(dw_desc.dtype))


@triton.jit
def _dw_padded_kernel(x_desc, dy_desc, dw_desc, pad_row_ptr, pad_blocks_ptr, steps_ptr, N, K,
                      NUM_EXPERTS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GROUP_SIZE_N: tl.constexpr):
    """dW tiles as `_dw_bounded_kernel`, over rows padded per expert to whole BM blocks of zeros (x_desc, dy_desc over
    [P_pad, K], [P_pad, N]), in ONE loop over this program's row blocks of all its tiles (`steps_ptr[pid]` of them):
    a tile's epilogue runs under an `if` when its last block is in, so the software pipeline carries the next tile's
    loads across it instead of refilling per tile."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_expert = n_tiles * k_tiles
    last = NUM_EXPERTS * per_expert - 1
    tile = pid
    e = tile // per_expert
    pid_n, pid_k = _dw_tile(tile % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
    row = tl.load(pad_row_ptr + e)
    blocks = tl.load(pad_blocks_ptr + e)
    blk = 0
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for _ in range(0, tl.load(steps_ptr + pid)):
        r = row + blk * BM
        acc = tl.dot(dy_desc.load([r, pid_n * BN]).T, x_desc.load([r, pid_k * BK]), acc)
        blk += 1
        if blk == blocks:
            dw_desc.store([e * N + pid_n * BN, pid_k * BK], acc.to(dw_desc.dtype))
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            tile += NUM_PROGRAMS
            e = tl.minimum(tile, last) // per_expert
            pid_n, pid_k = _dw_tile(tl.minimum(tile, last) % per_expert, n_tiles, k_tiles, GROUP_SIZE_N)
            row = tl.load(pad_row_ptr + e)
            blocks = tl.load(pad_blocks_ptr + e)
            blk = 0


@triton.jit
def _dw_scheduled_kernel(x_desc, dy_desc, dw_desc, schedule_ptr, steps_ptr, MAX_STEPS, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    """`_dw_padded_kernel`'s single loop with every step's coordinates read from a table by the loop index (padded
    row, N offset, K offset, and the dW row to store at when the step ends its tile, else -1): no load address
    depends on the epilogue's `if`, so the pipeliner may run num_stages - 1 steps ahead across tile ends."""
    pid = tl.program_id(0)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for s in range(0, tl.load(steps_ptr + pid)):
        step = schedule_ptr + (pid * MAX_STEPS + s) * 4
        off_k = tl.load(step + 2)
        acc = tl.dot(dy_desc.load([tl.load(step), tl.load(step + 1)]).T, x_desc.load([tl.load(step), off_k]), acc)
        out_row = tl.load(step + 3)
        if out_row >= 0:
            dw_desc.store([out_row, off_k], acc.to(dw_desc.dtype))
            acc = tl.zeros((BN, BK), dtype=tl.float32)


def pad_rows(t: torch.Tensor, m_sizes: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t's grouped rows copied into whole bm-row blocks per expert, zeros between; each expert's first padded row;
    its block count, at least 1 so an empty expert still writes its zero dW)."""
    counts = m_sizes.long()
    blocks = torch.clamp((counts + bm - 1) // bm, min=1)
    pad_row = torch.cumsum(blocks * bm, 0) - blocks * bm
    start = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(len(counts), device=t.device), counts)
    dst = pad_row[expert] + torch.arange(t.shape[0], device=t.device) - start[expert]
    out = torch.zeros(int((blocks * bm).sum()), t.shape[1], device=t.device, dtype=t.dtype)
    out[dst] = t
    return out, pad_row.to(torch.int32), blocks.to(torch.int32)


class PaddedDw:
    """One bound launch of `_dw_padded_kernel`: dW [E, N, K] from grouped x [P, K], dy [P, N] (padded here, outside
    any timing). N must be a multiple of BN."""

    def __init__(self, x, dy, m_sizes, out, bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 1,
                 sms: int | None = None) -> None:
        e, n, k = out.shape
        if n % bn:
            raise ValueError(f"N {n} is not a multiple of BLOCK_SIZE_N {bn}")
        sms = sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        x_pad, pad_row, blocks = pad_rows(x, m_sizes, bm)
        dy_pad, _, _ = pad_rows(dy, m_sizes, bm)
        per_expert = (n // bn) * triton.cdiv(k, bk)
        programs = min(sms, e * per_expert)
        tile_blocks = blocks.long().repeat_interleave(per_expert)
        owner = torch.arange(tile_blocks.numel(), device=x.device) % programs
        steps = torch.zeros(programs, dtype=torch.long, device=x.device).index_add_(0, owner, tile_blocks)
        self.args = (TensorDescriptor.from_tensor(x_pad, [bm, bk]), TensorDescriptor.from_tensor(dy_pad, [bm, bn]),
                     TensorDescriptor.from_tensor(out.view(e * n, k), [bn, bk]), pad_row, blocks,
                     steps.to(torch.int32), n, k)
        self.kw = dict(NUM_EXPERTS=e, NUM_PROGRAMS=programs, BM=bm, BN=bn, BK=bk, GROUP_SIZE_N=group,
                       num_warps=warps, num_stages=stages)
        self.grid = (programs,)
        self.out = out
        self.padded = (x_pad, dy_pad)  # kept alive for the descriptors

    def __call__(self) -> torch.Tensor:
        _dw_padded_kernel[self.grid](*self.args, **self.kw)
        return self.out


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


class BoundedDw:
    """One bound launch of the kernel above: dW [E, N, K] from grouped x [P, K], dy [P, N] and m_sizes [E].
    N must be a multiple of BN (the output descriptor spans all experts' rows)."""

    def __init__(self, x, dy, m_sizes, out, bm: int, bn: int, bk: int, warps: int, stages: int, flatten: bool,
                 sms: int | None = None, group: int = 1) -> None:
        e, n, k = out.shape
        if n % bn:
            raise ValueError(f"N {n} is not a multiple of BLOCK_SIZE_N {bn}")
        triton.set_allocator(_scratch)
        sms = sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = min(sms, e * (n // bn) * triton.cdiv(k, bk))
        self.args = (x, dy, TensorDescriptor.from_tensor(out.view(e * n, k), [bn, bk]), m_sizes, n, k)
        self.kw = dict(NUM_EXPERTS=e, E_POW2=triton.next_power_of_2(e), NUM_PROGRAMS=programs, BM=bm, BN=bn, BK=bk,
                       FLATTEN=flatten, GROUP_SIZE_N=group, num_warps=warps, num_stages=stages)
        self.grid = (programs,)
        self.out = out

    def __call__(self) -> torch.Tensor:
        _dw_bounded_kernel[self.grid](*self.args, **self.kw)
        return self.out


def dw_schedule(blocks: torch.Tensor, pad_row: torch.Tensor, n: int, k: int, bm: int, bn: int, bk: int,
                programs: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [programs, max steps, 4] table of (padded row, N offset, K offset, dW row to store at or -1), int32
    [programs] step counts) for `_dw_scheduled_kernel`: program p takes tiles p, p + programs, ... in the op's dW
    tile order (`_dw_tile`, GROUP_SIZE_N `group`), each tile one step per row block of its expert."""
    n_tiles, k_tiles = n // bn, -(-k // bk)
    per_expert = n_tiles * k_tiles
    rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(programs)]
    for t in range(len(blocks) * per_expert):
        e, local = divmod(t, per_expert)
        in_group = group * k_tiles
        first_n = (local // in_group) * group
        size = min(n_tiles - first_n, group)
        pid_n, pid_k = first_n + (local % in_group) % size, (local % in_group) // size
        count = int(blocks[e])
        for b in range(count):
            end = e * n + pid_n * bn if b == count - 1 else -1
            rows[t % programs].append((int(pad_row[e]) + b * bm, pid_n * bn, pid_k * bk, end))
    longest = max(len(r) for r in rows)
    table = torch.full((programs, longest, 4), -1, dtype=torch.int32)
    for p, r in enumerate(rows):
        table[p, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return table, torch.tensor([len(r) for r in rows], dtype=torch.int32)


class ScheduledDw(PaddedDw):
    """`_dw_scheduled_kernel` over the same padded rows as PaddedDw, its step table built on the host."""

    def __init__(self, x, dy, m_sizes, out, bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 1,
                 sms: int | None = None) -> None:
        super().__init__(x, dy, m_sizes, out, bm, bn, bk, warps, stages, group, sms)
        x_desc, dy_desc, dw_desc, pad_row, blocks = self.args[:5]
        table, steps = dw_schedule(blocks.cpu(), pad_row.cpu(), out.shape[1], out.shape[2], bm, bn, bk,
                                   self.grid[0], group)
        self.schedule = table.to(x.device)
        self.args = (x_desc, dy_desc, dw_desc, self.schedule, steps.to(x.device), table.shape[1])
        self.kw = dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)

    def __call__(self) -> torch.Tensor:
        _dw_scheduled_kernel[self.grid](*self.args, **self.kw)
        return self.out


def main() -> None:
    from probe_util import checked_time

    from tritune.kernels.grouped_gemm import group_by_expert, grouped_gemm_dw
    from tritune.kernels.grouped_gemm_config import KernelConfigBackward_dW
    from tritune.ops.grouped_gemm import select_configs
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import time_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {', '.join(KERNELS)}")
    ap.add_argument("--variants", help="BM:BN:BK:warps:stages:group,... instead of VARIANTS x GROUPS")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if args.variants:
        points = [tuple(int(v) for v in item.split(":")) for item in args.variants.split(",")]
        points = [(p[:5], p[5]) for p in points]
    else:
        points = list(product(VARIANTS, GROUPS))
    timed = lambda f: time_kernel(f, iters=20, warmup=3, l2_bytes=64 * 2**20).median_us  # noqa: E731
    rows = []
    for model, (experts, topk, hidden, inter) in MODELS.items():
        pairs = args.seqlen * topk
        _, ids = sample_routing(args.seqlen, experts, topk, seed=0, device="cuda")
        m_sizes, _ = group_by_expert(ids, experts)
        offs = torch.cumsum(m_sizes, 0).to(torch.int32)
        w1 = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
        # gate_up: dW1 = dH^T X, N 2I, K H; down: dW2 = dY^T A, N H, K I (rows grouped, as `_grouped_mm` takes them)
        for gemm, n, k, w, px, py in (("gate_up", 2 * inter, hidden, w1, True, False),
                                      ("down", hidden, inter, w2, False, True)):
            g = torch.Generator(device="cuda").manual_seed(n + k)
            x = torch.randn(pairs, k, device="cuda", dtype=torch.bfloat16, generator=g)
            dy = torch.randn(pairs, n, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = torch._grouped_mm(dy.t(), x, offs=offs)
            row = {"model": model, "gemm": gemm, "E": experts, "N": n, "K": k, "rows": pairs,
                   "flops": 2 * pairs * n * k,
                   "grouped_mm": timed(functools.partial(torch._grouped_mm, dy.t(), x, offs=offs))}
            op = functools.partial(grouped_gemm_dw, x, dy, m_sizes, topk=topk)
            shipped = select_configs(args.seqlen if px else pairs, w, topk, px, py).dW
            shipped = KernelConfigBackward_dW(**{**shipped.to_dict(), "permute_x": False, "permute_y": False})
            variants = {f"op shipped {shipped.to_string(True, True)}":
                        functools.partial(op, shipped)}
            out = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)  # one buffer: checked as written
            for (bm, bn, bk, warps, stages), group in points:
                cfg = KernelConfigBackward_dW(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=warps,
                                              num_stages=stages, flatten=False, use_tma_load_dy=True,
                                              use_tma_load_x=True, use_tma_store=True, GROUP_SIZE_N=group)
                name = f"{bm}x{bn}x{bk} w{warps} s{stages} g{group}"
                if "op" in kernels:
                    variants[f"op {name}"] = functools.partial(op, cfg, out=out)
                if "bounded" in kernels:
                    variants[f"bounded {name}"] = BoundedDw(x, dy, m_sizes, out, bm, bn, bk, warps, stages, False,
                                                            group=group)
                if "padded" in kernels:
                    variants[f"padded {name}"] = PaddedDw(x, dy, m_sizes, out, bm, bn, bk, warps, stages, group=group)
                if "scheduled" in kernels:
                    variants[f"scheduled {name}"] = ScheduledDw(x, dy, m_sizes, out, bm, bn, bk, warps, stages,
                                                                group=group)
            for key, fn in variants.items():
                result = checked_time(fn, ref, timed)
                row[key] = list(result) if isinstance(result, tuple) else result
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    print("| model | GEMM | _grouped_mm µs | op shipped µs | best of each kernel: µs, config, gmm / it |\n"
          "|---|---|---|---|---|")
    for r in rows:
        ok = {k: v[0] for k, v in r.items() if isinstance(v, list) and v[1] < 1e-2}
        shipped = next((v for k, v in ok.items() if k.startswith("op shipped")), math.nan)
        bests = []
        for kernel in kernels:
            mine = {k: v for k, v in ok.items() if k.startswith(f"{kernel} ") and not k.startswith("op shipped")}
            if mine:
                best = min(mine, key=mine.get)
                bests.append(f"{mine[best]:.1f} {best} {r['grouped_mm'] / mine[best]:.2f}")
        print(f"| {r['model']} | {r['gemm']} | {r['grouped_mm']:.1f} | {shipped:.1f} | {'; '.join(bests)} |")


if __name__ == "__main__":
    main()
