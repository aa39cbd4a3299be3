"""Stream-K for the warp-specialised block-scaled fp8 GEMM (Gluon, Hopper): every program takes an equal share of all
(tile, K block) steps, so a grid of a few tiles still keeps every SM busy to the end.

Why. A persistent GEMM hands out whole tiles. When the tile count is just under or just over a multiple of the SM
count, the last wave runs part-empty: 1536x7168 at M 1024 has 96 tiles of 128x128 for 132 SMs, 73% of the GPU, and
at M 2048 192 tiles take two waves, the second 45% full. There the rule's kernels ran 0.80-0.82x `_scaled_mm`'s
speed (H100, twenty-eighth session), while the same tile reaches 0.91x where the waves fill. Smaller tiles do not
help: each one streams its operands at a lower MMA rate. Stream-K keeps the 128x128 tile and splits the work itself:
the tiles' K blocks, laid end to end in the grouped tile order, are cut into `programs` equal ranges.

A program's range holds at most one tile's tail (its first segment, when the range starts inside a tile), whole
tiles, and one tile's head (its last segment). The program that holds a tile's first K block owns the tile: it
computes its part, then adds the others' partial sums and stores C. Every other segment's partial sum goes to the
program's own fp32 slot of a workspace, announced by a flag. A tail is the first thing its program computes, and the
owner reaches its head last, so the owner seldom waits. The owner clears the flag it consumed, so the workspace's
flags are zero again when the launch ends (it must start zeroed; `streamk_workspace`).

Deadlock freedom needs every program resident at once: one program an SM, at most the SM count, nothing else
holding the SMs. The loader and the MMA warps are those of `kernels/gluon_gemm_ws.py`; the K loop is
`gluon_blockscale._blockscale_tile`, each segment's activation and weight scales offset to its first block.
"""

from __future__ import annotations

import torch
import triton

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.gluon_gemm_ws import WS_LOADER_REGS, ws_descriptors, ws_maxnreg

if HAS_GLUON_HOPPER:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from tritune.kernels.gluon_blockscale import _blockscale_tile, _tile_coords, _tma_load
    from tritune.kernels.gluon_gemm import _epilogue

    @gluon.jit
    def _sk_range(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, programs):
        """(tiles down M, tiles across N, K blocks a tile, all steps, this program's first and past-last step)."""
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        k_tiles = gl.cdiv(K, BK)
        total = num_pid_m * num_pid_n * k_tiles
        pid = gl.program_id(0)
        return num_pid_m, num_pid_n, k_tiles, total, pid * total // programs, (pid + 1) * total // programs

    @gluon.jit
    def _sk_loader(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, GROUP_M: gl.constexpr):
        """This program's steps, in order, into the ring (step g into stage g % STAGES once freed)."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        num_pid_m, num_pid_n, k_tiles, total, first, last = _sk_range(M, N, K, BM, BN, BK, programs)
        for it in range(first, last):
            g = it - first
            s = g % STAGES
            pid_m, pid_n = _tile_coords(it // k_tiles, num_pid_m, num_pid_n, GROUP_M)
            mbarrier.wait(empty.index(s), phase=((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * BM, (it % k_tiles) * BK], ready.index(s), a_smem.index(s))
            _tma_load(b_desc, [pid_n * BN, (it % k_tiles) * BK], ready.index(s), b_smem.index(s))

    @gluon.jit
    def _sk_consumer(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, part_ptr,
                     flag_ptr, M, N, K, programs, stride_asm, stride_ask, stride_bsn, stride_bsk,
                     GROUP_M: gl.constexpr):
        """Each segment's K loop from the ring; a whole tile stored, a head completed with the later programs'
        partial sums, a tail's partial sum left in this program's workspace slot."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_smem.type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 32])
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        num_pid_m, num_pid_n, k_tiles, total, first, last = _sk_range(M, N, K, BM, BN, BK, programs)
        pid = gl.program_id(0)
        # a slot's element (r, c) at r * BN + c, each thread touching the same elements on both sides
        slot = gl.arange(0, BM, layout=rows)[:, None] * BN + gl.arange(0, BN, layout=cols)[None, :]
        it = first
        while it < last:
            tile = it // k_tiles
            kb = it % k_tiles
            steps = gl.minimum(k_tiles - kb, last - it)
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BM
            off_n = pid_n * BN
            offs_m = off_m + gl.arange(0, BM, layout=rows)
            acc = _blockscale_tile(a_desc, b_desc, a_smem, b_smem, ready, it - first, steps, off_m, off_n,
                                   as_ptr + offs_m * stride_asm + kb * stride_ask, offs_m < M,
                                   bs_ptr + (off_n // BK) * stride_bsn + kb * stride_bsk, stride_ask, stride_bsk,
                                   gl.zeros([BM, BN], gl.float32, layout), STAGES, empty, True)
            if kb == 0:  # this program owns the tile: the later programs' shares of it, then C
                end_prog = ((tile + 1) * k_tiles * programs - 1) // total  # the program of its last K block
                for q in range(pid + 1, end_prog + 1):
                    while gl.atomic_add(flag_ptr + q, 0, sem="acquire", scope="gpu") == 0:
                        pass
                    gl.thread_barrier()
                    acc = acc + gl.load(part_ptr + q * (BM * BN) + slot, cache_modifier=".cg")  # not L1
                    gl.thread_barrier()
                    gl.atomic_xchg(flag_ptr + q, 0, sem="relaxed", scope="gpu")
                tma.store_wait(pendings=0)  # the previous tile's C has left c_smem
                _epilogue(acc, c_desc, c_smem, off_m, off_n, as_ptr, bs_ptr, M, N, False)
            else:  # a tail: its partial sum for the owner
                gl.store(part_ptr + pid * (BM * BN) + slot, acc)
                gl.thread_barrier()
                gl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")
            it += steps
        tma.store_wait(pendings=0)

    # No integer argument specialized: a constant 1 would reach the partitions as a Python int, which they refuse.
    @gluon.jit(do_not_specialize=["M", "N", "K", "stride_asm", "stride_ask", "stride_bsn", "stride_bsk", "programs"])
    def streamk_blockscale_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, part_ptr, flag_ptr, M, N, K, stride_asm,
                                  stride_ask, stride_bsn, stride_bsk, programs, GROUP_M: gl.constexpr,
                                  STAGES: gl.constexpr, LOADER_REGS: gl.constexpr):
        """C [M, N] = Σ_k (A_k · B_kᵀ) · as[:, k] · bs[n // 128, k] (`ws_gemm_kernel` MODE 2's result) with the
        (tile, K block) steps shared out evenly over `programs` programs (at most one an SM, all resident).
        part_ptr: fp32 [programs, BM, BN]; flag_ptr: int32 [programs], zero at launch and left zero. Launch with
        maxnreg `ws_maxnreg(num_warps)`. Grid: (programs,)."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(BK == 128)
        gl.static_assert(BN <= 128)  # one weight scale a tile and K block
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_sk_consumer, (a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, ready, empty, as_ptr, bs_ptr, part_ptr,
                            flag_ptr, M, N, K, programs, stride_asm, stride_ask, stride_bsn, stride_bsk, GROUP_M)),
            (_sk_loader, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, programs, GROUP_M)),
        ], [4], [LOADER_REGS])  # a whole warp group: setmaxnreg acts on warp groups


def streamk_workspace(programs: int, block_m: int, block_n: int, device: torch.device) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """The kernel's partial sums (fp32 [programs, BM, BN], written before read) and flags (int32, zeroed once: each
    launch leaves them zero)."""
    return (torch.empty(programs, block_m, block_n, device=device, dtype=torch.float32),
            torch.zeros(programs, device=device, dtype=torch.int32))


def streamk_blockscale_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                            block_m: int = 128, block_n: int = 128, stages: int = 5, group_m: int = 8,
                            num_warps: int = 8, programs: int | None = None, workspace: tuple | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [M, N] = A [M, K] fp8 · B [N, K]ᵀ fp8, a_scale [M, ⌈K/128⌉], b_scale [⌈N/128⌉, ⌈K/128⌉] (fp32), by
    stream-K over `programs` programs (default: one an SM). Launched through Triton's own launcher (probes, tests)."""
    if not HAS_GLUON_HOPPER:
        raise RuntimeError(f"streamk_blockscale_gemm needs Triton's Gluon Hopper API (Triton >= 3.5); this is "
                           f"Triton {triton.__version__}")
    M, K = a.shape
    N = b.shape[0]
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    programs = max(1, min(programs, triton.cdiv(M, block_m) * triton.cdiv(N, block_n) * triton.cdiv(K, 128)))
    part, flags = workspace if workspace is not None else streamk_workspace(programs, block_m, block_n, a.device)
    streamk_blockscale_kernel[(programs,)](*ws_descriptors(a, b, out, block_m, block_n), a_scale, b_scale, part,
                                           flags, M, N, K, a_scale.stride(0), a_scale.stride(1), b_scale.stride(0),
                                           b_scale.stride(1), programs, GROUP_M=group_m, STAGES=stages,
                                           LOADER_REGS=WS_LOADER_REGS, num_warps=num_warps,
                                           maxnreg=ws_maxnreg(num_warps))
    return out
