"""Triton GEMM kernels: C = A · Bᵀ (A is M×K, B is N×K, C bf16 or fp16) in three flavours, with split-K.

- bf16/fp16 operands;
- a8w8: fp8 e4m3 operands, per-token scales for A (M) and per-channel scales for B (N);
- a8w8_blockscale: fp8 operands, A scales per 1×128 (M × ⌈K/128⌉), B scales per 128×128 (⌈N/128⌉ × ⌈K/128⌉).

Kernels take a config and launch; they never tune themselves. Edge tiles are masked, so any M, N, K works.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl

from tritune.compile_target import sm_count_for
from tritune.kernels.launch import BoundKernel, DescriptorCache, Workspace

QUANT_NONE, QUANT_PER_TOKEN, QUANT_BLOCK = 0, 1, 2
SCALE_BLOCK = 128  # block size of the block-scaled format, along K for A and along N and K for B

KERNELS = ("bf16", "a8w8", "a8w8_blockscale")
TAGS = {"bf16": "BF16", "a8w8": "A8W8", "a8w8_blockscale": "A8W8_BLOCKSCALE"}  # in tuned file names
OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # C's dtypes the tuners and ops choose between
_QUANT_OF = {"bf16": QUANT_NONE, "a8w8": QUANT_PER_TOKEN, "a8w8_blockscale": QUANT_BLOCK}


def out_dtype_name(dtype: torch.dtype) -> str:
    """'bf16' or 'fp16' for C's dtype; ValueError for any other."""
    for name, dt in OUT_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"output dtype {dtype} is not one of {', '.join(map(str, OUT_DTYPES.values()))}")


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one GEMM candidate."""

    BLOCK_SIZE_M: int = 64
    BLOCK_SIZE_N: int = 64
    BLOCK_SIZE_K: int = 64
    GROUP_SIZE_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    NUM_KSPLIT: int = 1
    cache_modifier: str = ""  # "" or ".cg" (skip L1 for the streamed operands)
    PERSISTENT_TMA: bool = False  # persistent grid of one program per SM, TMA descriptor loads/stores (Hopper)
    SCALE_PIPELINE: bool = False  # block-scaled TMA only: rescale block k-1 while the MMA of block k runs
    WARP_SPECIALIZE: bool = False  # persistent TMA only: the tile loop split into load and MMA warps (Triton >= 3.5)
    EPILOGUE_SUBTILE: bool = False  # persistent TMA only: C converted and stored as two [BM, BN/2] halves
    TAIL_SPLIT: bool = False  # pointer kernel, NUM_KSPLIT > 1: split only the tiles past the full waves
    # Hopper: the Gluon kernel of the family. Block-scaled: rescale off the MMA path (kernels/gluon_blockscale); bf16
    # and a8w8: persistent, BLOCK_SIZE_N may be the sum of two powers of two (kernels/gluon_gemm). With
    # WARP_SPECIALIZE and PERSISTENT_TMA, any of them fed by a loader warp group (kernels/gluon_gemm_ws).
    GLUON: bool = False

    @staticmethod
    def from_params(params: dict) -> GemmConfig:
        known = GemmConfig.__dataclass_fields__
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"unknown GEMM config parameter(s) {unknown}")
        return GemmConfig(**params)


@triton.jit(do_not_specialize=["M", "stride_ck", "dp_tiles"])
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr,  # A [M, K], B [N, K], C [M, N] (or fp32 partials [KSPLIT, M, N] when split)
    a_scale_ptr, b_scale_ptr,  # fp32; shapes depend on QUANT (unused when QUANT_NONE)
    out_ptr,  # SPLIT_FIXUP: C [M, N] (row stride stride_cm); else unused
    lock_ptr,  # SPLIT_FIXUP: int32 [tiles], zero between calls: splits of each tile that are done
    M, N, K,
    k_per_split,  # K elements each split covers, a multiple of BLOCK_SIZE_K
    stride_am, stride_bn, stride_cm, stride_ck,
    stride_asm, stride_bsn,  # row strides of the scale tensors
    dp_tiles,  # TAIL_SPLIT: the tiles computed whole (the full waves); 0 otherwise
    QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_KSPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    CACHE_MODIFIER: tl.constexpr, SPLIT_FIXUP: tl.constexpr = False, TAIL_SPLIT: tl.constexpr = False,
):
    """One BLOCK_M×BLOCK_N tile of one K split.

    SPLIT_FIXUP (split-K in one launch): each split stores its fp32 partial and counts itself done on the tile's
    lock; the last one sums the partials in split order (the reduce kernel's order, so the same bits), writes C and
    sets the lock back to zero for the next call.

    TAIL_SPLIT (with SPLIT_FIXUP): only the tiles past the full waves are split. Tiles [0, dp_tiles) run whole and
    store C directly; each later tile runs as NUM_KSPLIT pieces that fill the last wave (a 128x128 grid of 288 tiles on
    132 SMs otherwise leaves its third wave 18% full).

    Grid: (⌈M/BLOCK_M⌉·⌈N/BLOCK_N⌉, NUM_KSPLIT); TAIL_SPLIT: (dp_tiles + (tiles - dp_tiles)·NUM_KSPLIT, 1).
    """
    whole = False  # TAIL_SPLIT: this program computes its tile over all of K
    if TAIL_SPLIT:
        q = tl.program_id(0)
        whole = q < dp_tiles
        tail = tl.maximum(q - dp_tiles, 0)
        pid = tl.where(whole, q, dp_tiles + tail // NUM_KSPLIT)
        pid_k = tl.where(whole, 0, tail % NUM_KSPLIT)
    else:
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    # Grouped ordering: GROUP_SIZE_M row-tiles share the same B columns while they are hot in L2.
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    # Wrap out-of-range rows/cols onto valid ones: loads stay in bounds without masks; stores are masked.
    offs_am = offs_m % M
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    k_start = pid_k * k_per_split
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + (k_start + offs_k)[None, :]
    b_ptrs = b_ptr + offs_bn[None, :] * stride_bn + (k_start + offs_k)[:, None]
    if QUANT == 1:
        a_s = tl.load(a_scale_ptr + offs_am)
        b_s = tl.load(b_scale_ptr + offs_bn)
    if QUANT == 2:
        a_s_ptrs = a_scale_ptr + offs_am * stride_asm
        b_s_ptrs = b_scale_ptr + (offs_bn // 128) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if TAIL_SPLIT:
        k_end = tl.where(whole, K, tl.minimum(k_start + k_per_split, K))
    else:
        k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, cache_modifier=CACHE_MODIFIER)
            b = tl.load(b_ptrs, cache_modifier=CACHE_MODIFIER)
        else:
            a = tl.load(a_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0, cache_modifier=CACHE_MODIFIER)
            b = tl.load(b_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0, cache_modifier=CACHE_MODIFIER)
        if QUANT == 2:
            # BLOCK_SIZE_K divides 128, so one scale column covers this whole K step.
            ks = k // 128
            a_sk = tl.load(a_s_ptrs + ks)
            if BLOCK_SIZE_N <= 128:
                # The tile lies inside one 128-wide scale block: one scalar B scale, one FMA per element.
                b_sk = tl.load(b_scale_ptr + (pid_n * BLOCK_SIZE_N // 128) * stride_bsn + ks)
                acc += tl.dot(a, b) * (a_sk * b_sk)[:, None]
            else:
                b_sk = tl.load(b_s_ptrs + ks)
                acc += tl.dot(a, b) * (a_sk[:, None] * b_sk[None, :])
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K

    if QUANT == 1:
        acc = acc * (a_s[:, None] * b_s[None, :])
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if whole:  # TAIL_SPLIT's full-wave tiles: C directly (C and the partials share the row stride N)
        tl.store(out_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=c_mask)
    else:
        _store_split(acc, c_ptr, out_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, c_mask, stride_cm, stride_ck,
                     NUM_KSPLIT, BLOCK_SIZE_M, BLOCK_SIZE_N, SPLIT_FIXUP)


@triton.jit
def _store_split(acc, c_ptr, out_ptr, lock_ptr, pid, pid_k, offs_m, offs_n, c_mask, stride_cm, stride_ck,
                 NUM_KSPLIT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                 SPLIT_FIXUP: tl.constexpr):
    """Store this split's tile (C itself when unsplit); SPLIT_FIXUP: the last split of the tile sums them into C."""
    c_ptrs = c_ptr + pid_k * stride_ck + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    if SPLIT_FIXUP:
        tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
        done = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == NUM_KSPLIT - 1:
            total = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
            part_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
            for s in tl.static_range(NUM_KSPLIT):  # L2 loads (.cg): other SMs wrote them
                total += tl.load(part_ptrs + s * stride_ck, mask=c_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=c_mask)
            tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_persistent_kernel(
    a_desc, b_desc, c_desc,  # TMA descriptors: A [M, K] block [BM, BK], B [N, K] block [BN, BK], C [M, N] [BM, BN]
    a_scale_ptr, b_scale_ptr,  # fp32 scales as in _gemm_kernel
    M, N, K,
    stride_asm, stride_bsn,
    QUANT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, NUM_SMS: tl.constexpr, SCALE_PIPELINE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False, FLATTEN: tl.constexpr = True, EPILOGUE_SUBTILE: tl.constexpr = False,
):
    """Each program walks tiles start, start+NUM_SMS, ...; TMA zero-fills edge loads and clips edge stores.

    WARP_SPECIALIZE hands the tile loop to Triton's warp specialisation (TMA-load warps feeding MMA warps; FLATTEN
    off with it, as Triton's persistent tutorial runs it on Hopper). EPILOGUE_SUBTILE stores C as two [BM, BN/2]
    halves (c_desc's block), so the conversion and store of the first overlap the second and fewer registers hold C.

    Grid: (min(NUM_SMS, tiles),).
    """
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + (tile_id % group_size_m)
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        off_m = pid_m * BLOCK_SIZE_M
        off_n = pid_n * BLOCK_SIZE_N
        offs_m = off_m + tl.arange(0, BLOCK_SIZE_M)
        offs_n = off_n + tl.arange(0, BLOCK_SIZE_N)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        if SCALE_PIPELINE:
            # Block-scaled, BLOCK_SIZE_N <= 128, BLOCK_SIZE_K == 128: the FMA rescale of step k-1 is issued after
            # the MMA of step k, so the tensor cores and the FMA units can overlap.
            prev = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
            prev_s = tl.zeros((BLOCK_SIZE_M,), dtype=tl.float32)
            for ki in range(k_tiles):
                off_k = ki * BLOCK_SIZE_K
                a = a_desc.load([off_m, off_k])
                b = b_desc.load([off_n, off_k])
                a_sk = tl.load(a_scale_ptr + offs_m * stride_asm + ki, mask=offs_m < M, other=0.0)
                b_sk = tl.load(b_scale_ptr + (off_n // 128) * stride_bsn + ki)
                d = tl.dot(a, b.T)
                acc += prev * prev_s[:, None]
                prev = d
                prev_s = a_sk * b_sk
            acc += prev * prev_s[:, None]
            k_tiles_left = 0
        else:
            k_tiles_left = k_tiles
        for ki in range(k_tiles_left):
            off_k = ki * BLOCK_SIZE_K
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k])
            if QUANT == 2:
                ks = off_k // 128
                a_sk = tl.load(a_scale_ptr + offs_m * stride_asm + ks, mask=offs_m < M, other=0.0)
                if BLOCK_SIZE_N <= 128:
                    b_sk = tl.load(b_scale_ptr + (off_n // 128) * stride_bsn + ks)
                    acc += tl.dot(a, b.T) * (a_sk * b_sk)[:, None]
                else:
                    b_sk = tl.load(b_scale_ptr + (offs_n // 128) * stride_bsn + ks, mask=offs_n < N, other=0.0)
                    acc += tl.dot(a, b.T) * (a_sk[:, None] * b_sk[None, :])
            else:
                acc = tl.dot(a, b.T, acc)
        if QUANT == 1:
            a_s = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
            b_s = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc * (a_s[:, None] * b_s[None, :])
        if EPILOGUE_SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_SIZE_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def tma_options(cfg: GemmConfig) -> dict:
    """The persistent TMA kernel's option constexprs of `cfg` (shared by the launch and compile_only)."""
    return {"WARP_SPECIALIZE": cfg.WARP_SPECIALIZE, "FLATTEN": not cfg.WARP_SPECIALIZE,
            "EPILOGUE_SUBTILE": cfg.EPILOGUE_SUBTILE}


def c_block(cfg: GemmConfig) -> list[int]:
    """The TMA block of C: the whole tile, or half its columns with EPILOGUE_SUBTILE."""
    return [cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N // 2 if cfg.EPILOGUE_SUBTILE else cfg.BLOCK_SIZE_N]


def triton_ws_builds(block_m: int, block_n: int, num_warps: int) -> bool:
    """Whether Triton's warp-specialised persistent block-scaled kernel (WARP_SPECIALIZE without GLUON, the rule's and
    the tuner's only Triton WS) builds for sm_90 with this tile: on 8 warps, or on 4 a 64-row tile up to 128 wide.
    The other 4-warp tiles tried (64-256 rows, 16-256 columns) fail in Triton's pass pipeline on 3.6 and 3.9 (a
    descriptor store whose layout no longer matches its block; thirtieth session). The interpreter runs them all."""
    return num_warps != 4 or (block_m == 64 and block_n <= 128)


def tma_compatible(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b, out))


def programs_per_wave(device: torch.device) -> int:
    """How many programs a persistent kernel launches at most: one per SM (a compile process: the SMs it compiles
    for), 4 in the interpreter."""
    if device.type != "cuda":
        return 4  # interpreter: a few programs exercise the persistent loop
    count = sm_count_for(device)  # a compile process has no GPU to ask: its target's
    return count if count is not None else torch.cuda.get_device_properties(device).multi_processor_count


def tail_split_whole_tiles(tiles: int, num_sms: int) -> int:
    """TAIL_SPLIT's tiles computed whole: every full wave (none when the grid is under one wave: all split)."""
    return tiles // num_sms * num_sms


def k_per_split(K: int, cfg: GemmConfig) -> int:
    """K elements per split, rounded up to BLOCK_SIZE_K so split boundaries align with K steps."""
    per = triton.cdiv(K, cfg.NUM_KSPLIT)
    return triton.cdiv(per, cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K


def offsets_fit(*element_counts: int) -> bool:
    """Whether tensors of these element counts fit the kernels' 32-bit offsets (A, B, C or the split-K partials)."""
    return max(element_counts) < 2**31


def gluon_problem(cfg: GemmConfig, kernel: str = "a8w8_blockscale", elt: int = 1) -> str | None:
    """Why `cfg` cannot be a GLUON config of `kernel` (operands of `elt` bytes; None when it can). The block-scaled
    kernel takes BLOCK_SIZE_K 128, BLOCK_SIZE_N 64 or 128 (one weight scale a tile), BLOCK_SIZE_M 16 rows a warp (64
    on 4 warps, 128 on 8); the bf16 / a8w8 kernel takes BLOCK_SIZE_K of 128 bytes (64 for 16-bit operands, 128 for
    fp8), BLOCK_SIZE_N a power of two or the sum of two (16-256), BLOCK_SIZE_M 64-256 with at least 16 rows a warp.
    Both take none of the Triton kernels' options but PERSISTENT_TMA (the block-scaled kernel then runs persistent:
    as many programs as fit at once; the other always does) and, persistent with a power-of-two BLOCK_SIZE_N,
    WARP_SPECIALIZE (the warp-specialised kernel of each: a loader warp group feeding the num_warps MMA warps)."""
    if kernel == "a8w8_blockscale":
        if cfg.BLOCK_SIZE_K != SCALE_BLOCK or cfg.BLOCK_SIZE_N not in (64, 128) or cfg.num_warps not in (4, 8) \
                or cfg.BLOCK_SIZE_M != 16 * cfg.num_warps:
            return (f"GLUON takes BLOCK_SIZE_K 128, BLOCK_SIZE_N 64 or 128 and BLOCK_SIZE_M 16 x num_warps (64 on 4, "
                    f"128 on 8), got {cfg.BLOCK_SIZE_M}x{cfg.BLOCK_SIZE_N}x{cfg.BLOCK_SIZE_K} on {cfg.num_warps} "
                    f"warps")
    else:
        from tritune.kernels.gluon_gemm import split_width

        try:
            split_width(cfg.BLOCK_SIZE_N)
            width = None if cfg.BLOCK_SIZE_N <= 256 else "at most 256"
        except ValueError as err:
            width = str(err)
        if width or cfg.BLOCK_SIZE_K != 128 // elt or cfg.num_warps not in (4, 8) \
                or cfg.BLOCK_SIZE_M not in (64, 128, 256) or cfg.BLOCK_SIZE_M < 16 * cfg.num_warps:
            return (f"GLUON {kernel} takes BLOCK_SIZE_K {128 // elt} (128 bytes), BLOCK_SIZE_N a power of two or the "
                    f"sum of two up to 256, BLOCK_SIZE_M 64-256 with 16 rows a warp or more, got "
                    f"{cfg.BLOCK_SIZE_M}x{cfg.BLOCK_SIZE_N}x{cfg.BLOCK_SIZE_K} on {cfg.num_warps} warps"
                    + (f" ({width})" if width else ""))
    if cfg.WARP_SPECIALIZE and (not cfg.PERSISTENT_TMA or cfg.BLOCK_SIZE_N & (cfg.BLOCK_SIZE_N - 1)):
        return ("GLUON with WARP_SPECIALIZE (a loader warp group feeding the MMA warps, kernels/gluon_gemm_ws) is "
                "persistent (PERSISTENT_TMA on), one MMA a K step (BLOCK_SIZE_N a power of two)")
    # K split 2-4 ways: the warp-specialised kernel's only (ws_splitk_kernel)
    split_ok = cfg.NUM_KSPLIT == 1 or (cfg.WARP_SPECIALIZE and 2 <= cfg.NUM_KSPLIT <= MAX_GLUON_SPLITS)
    if not split_ok or cfg.SCALE_PIPELINE or cfg.EPILOGUE_SUBTILE or cfg.TAIL_SPLIT or cfg.cache_modifier:
        return (f"GLUON is its own kernel: NUM_KSPLIT 1 (2-{MAX_GLUON_SPLITS} on the warp-specialised one), no "
                "SCALE_PIPELINE, EPILOGUE_SUBTILE, TAIL_SPLIT or cache_modifier (PERSISTENT_TMA makes it "
                "persistent)")
    return None


MAX_GLUON_SPLITS = 4  # K splits of the warp-specialised Gluon kernel


def gluon_available(device: torch.device) -> bool:
    """Whether the Gluon block-scaled kernel can run on `device`: a Hopper GPU and a Triton with Gluon's Hopper API."""
    from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

    return HAS_GLUON_HOPPER and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _check_gluon(kernel: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: GemmConfig) -> None:
    from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

    if a.dtype == torch.float32:
        raise ValueError("GLUON takes bf16, fp16 or fp8 operands, not float32")
    why = gluon_problem(cfg, kernel, a.element_size())
    if why:
        raise ValueError(why)
    if not HAS_GLUON_HOPPER:
        raise ValueError(f"GLUON needs Triton's Gluon Hopper API (Triton >= 3.5), this is Triton {triton.__version__}")
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] != 9:
        raise ValueError(f"GLUON runs on a Hopper GPU (wgmma, TMA), not {a.device}")
    if not tma_compatible(a, b, out):
        raise ValueError("GLUON needs 16-byte aligned A, B, C rows (K a multiple of 16, N of 8)")


def validate(kernel: str, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None,
             b_scale: torch.Tensor | None, cfg: GemmConfig) -> None:
    """Reject shapes, dtypes and configs the kernels cannot take, with a message naming the problem."""
    if kernel not in _QUANT_OF:
        raise ValueError(f"unknown GEMM kernel {kernel!r}; expected one of {KERNELS}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"A and B must be 2-D, got A{tuple(a.shape)} B{tuple(b.shape)}")
    (M, K), (N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"K mismatch: A is {M}x{K} but B is {N}x{Kb} (B must be N x K)")
    if M == 0 or N == 0 or K == 0:
        raise ValueError(f"empty GEMM: M={M} N={N} K={K}")
    if (cfg.WARP_SPECIALIZE or cfg.EPILOGUE_SUBTILE) and not cfg.PERSISTENT_TMA:
        raise ValueError("WARP_SPECIALIZE and EPILOGUE_SUBTILE are options of the persistent TMA kernel "
                         "(PERSISTENT_TMA=True)")
    if cfg.TAIL_SPLIT and (cfg.PERSISTENT_TMA or cfg.NUM_KSPLIT < 2):
        raise ValueError(f"TAIL_SPLIT splits the last wave's tiles of the pointer kernel: it needs NUM_KSPLIT >= 2 "
                         f"and PERSISTENT_TMA off, got NUM_KSPLIT={cfg.NUM_KSPLIT} "
                         f"PERSISTENT_TMA={cfg.PERSISTENT_TMA}")
    if not offsets_fit(M * K, N * K, M * N * cfg.NUM_KSPLIT):
        raise ValueError(f"M={M} N={N} K={K} (split {cfg.NUM_KSPLIT}) is too large for the kernels' 32-bit offsets")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("A and B must be contiguous along K (stride 1 in the last dimension)")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    quant = _QUANT_OF[kernel]
    if quant == QUANT_NONE:
        if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or b.dtype != a.dtype:
            raise ValueError(f"bf16 GEMM takes bf16/fp16/fp32 A and B of one dtype, got {a.dtype} and {b.dtype}")
        return
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{kernel} takes float8_e4m3fn A and B, got {a.dtype} and {b.dtype}")
    if a_scale is None or b_scale is None:
        raise ValueError(f"{kernel} needs a_scale and b_scale")
    if quant == QUANT_PER_TOKEN:
        want_a, want_b = (M,), (N,)
        a_shape, b_shape = tuple(a_scale.reshape(-1).shape), tuple(b_scale.reshape(-1).shape)
    else:
        want_a = (M, triton.cdiv(K, SCALE_BLOCK))
        want_b = (triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK))
        a_shape, b_shape = tuple(a_scale.shape), tuple(b_scale.shape)
        if SCALE_BLOCK % cfg.BLOCK_SIZE_K:
            raise ValueError(f"{kernel} needs BLOCK_SIZE_K dividing {SCALE_BLOCK}, got {cfg.BLOCK_SIZE_K}")
    if a_shape != want_a or b_shape != want_b:
        raise ValueError(f"{kernel} scales must be A{want_a} and B{want_b}, got A{a_shape} and B{b_shape}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError(f"{kernel} scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")


class GemmLaunch:
    """The launches of one GEMM problem with one config, bound once: calling it only launches.

    Built from example tensors (validated here); a call must pass tensors of the same shapes, dtypes, strides and
    16-byte alignment (the caller keys its cache on them). Pointer kernel: one launch, split-K included (fp32
    partials in the kept scratch or `workspace`, the last split of each tile sums them; its per-tile locks are kept
    per stream, zero between calls, and made afresh in each CUDA graph). TMA kernel: one launch; on a GPU the encoded
    descriptors of A, B and C are kept by address (a plan fixes everything else they hold).
    """

    def __init__(self, kernel: str, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None,
                 b_scale: torch.Tensor | None, out: torch.Tensor, cfg: GemmConfig) -> None:
        validate(kernel, a, b, a_scale, b_scale, cfg)
        M, K = a.shape
        N = b.shape[0]
        if tuple(out.shape) != (M, N) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {M}x{N} tensor, got {tuple(out.shape)}")
        self.M, self.N, self.K, self.cfg = M, N, K, cfg
        self.device = a.device
        # On a GPU a call may pass addresses instead of tensors: the op computes them anyway.
        self.takes_addresses = a.is_cuda
        quant = _QUANT_OF[kernel]
        a_s = a_scale if a_scale is not None else a  # scale pointers are never read when QUANT_NONE
        b_s = b_scale if b_scale is not None else a
        scale_strides = (a_s.stride(0) if quant == QUANT_BLOCK else 0, b_s.stride(0) if quant == QUANT_BLOCK else 0)
        bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
        self.split = cfg.NUM_KSPLIT
        self.workspace_numel = cfg.NUM_KSPLIT * M * N  # fp32 partial sums a split-K call needs
        self._desc_of = (0, 1, 2)  # which of (A, B, C) each TMA descriptor describes
        if cfg.GLUON:
            self._bind_gluon(kernel, a, b, a_s, b_s, out, cfg)
            return
        if cfg.PERSISTENT_TMA:
            _check_tma(a, b, out, quant, cfg)
            from triton.tools.tensor_descriptor import TensorDescriptor

            self._blocks = ([bm, bk], [bn, bk], c_block(cfg))
            num_sms = programs_per_wave(a.device)
            self._tail = (M, N, K, *scale_strides, quant, bm, bn, bk, cfg.GROUP_SIZE_M, num_sms, cfg.SCALE_PIPELINE,
                          *tma_options(cfg).values())
            self.main = BoundKernel(
                _gemm_tma_persistent_kernel, (min(num_sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),),
                (*(TensorDescriptor.from_tensor(t, blk) for t, blk in zip((a, b, out), self._blocks, strict=True)),
                 a_s, b_s, *self._tail), varying=5, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            self._desc_caches = None  # off the GPU: descriptors built per call (`_descs`)
            if a.is_cuda:
                self._cache_descriptors((a, b, out))
            return
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        grid = (tiles, cfg.NUM_KSPLIT)
        dp = 0
        if cfg.TAIL_SPLIT:  # the full waves whole, the rest split: one dimension of programs
            dp = tail_split_whole_tiles(tiles, programs_per_wave(a.device))
            grid = (dp + (tiles - dp) * cfg.NUM_KSPLIT, 1)
        self.scratch = Workspace(((torch.float32, cfg.NUM_KSPLIT * M * N),)) if self.split > 1 else None
        stride_c, stride_ck = (N, M * N) if self.split > 1 else (out.stride(0), 0)
        self._tail = (M, N, K, k_per_split(K, cfg), a.stride(0), b.stride(0), stride_c, stride_ck, *scale_strides,
                      dp, quant, bm, bn, bk, cfg.GROUP_SIZE_M, cfg.NUM_KSPLIT, K % bk == 0, cfg.cache_modifier)
        self._tail += (self.split > 1, cfg.TAIL_SPLIT)  # SPLIT_FIXUP, TAIL_SPLIT
        target = torch.empty((cfg.NUM_KSPLIT, M, N), device=a.device, dtype=torch.float32) if self.split > 1 else out
        self.tiles = tiles
        self._locks: dict[int, torch.Tensor] = {}  # per stream (key: raw stream handle; 0 off the GPU)
        # Unsplit launches pass A for the two pointers they never read (out, lock), as compile_only does.
        fixup = (out, torch.zeros(self.tiles, device=a.device, dtype=torch.int32)) if self.split > 1 else (a, a)
        self.main = BoundKernel(_gemm_kernel, grid, (a, b, target, a_s, b_s, *fixup, *self._tail), varying=7,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def _bind_gluon(self, kernel: str, a, b, a_s, b_s, out, cfg: GemmConfig) -> None:
        """A Gluon kernel, bound once: the warp-specialised one (WARP_SPECIALIZE, any kernel) or the block-scaled
        one, their three descriptors encoded and cached by address as the persistent TMA kernel's are (Triton's
        launcher encodes a Gluon descriptor from the layout recorded at compile time, so the plain descriptor the
        cache builds serves); the one-kernel bf16 / a8w8 GEMM in `_bind_gluon_gemm`."""
        from tritune.kernels import gluon_blockscale as gb

        _check_gluon(kernel, a, b, out, cfg)
        bm, bn = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N
        if cfg.WARP_SPECIALIZE:  # a loader warp group feeding the MMA warps (kernels/gluon_gemm_ws), every kernel
            from tritune.kernels import gluon_gemm_ws as ws

            bk = 128 // a.element_size()
            self._blocks = ([bm, bk], [bn, bk], [bm, bn])
            block_scaled = kernel == "a8w8_blockscale"
            strides = (a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1)) if block_scaled else (0, 0, 0, 0)
            programs = min(triton.cdiv(self.M, bm) * triton.cdiv(self.N, bn), programs_per_wave(a.device))
            if cfg.NUM_KSPLIT > 1:  # K split: the tiles' slots and counts ride each launch
                self._bind_ws_split_k(kernel, a, b, a_s, b_s, out, cfg, strides)
            else:
                self.main = BoundKernel(
                    ws.ws_gemm_kernel, (programs,),
                    (*ws.ws_descriptors(a, b, out, bm, bn), a_s, b_s, self.M, self.N, self.K, *strides, programs,
                     *ws.constexprs(kernel, cfg)),
                    varying=5, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    maxnreg=ws.ws_maxnreg(cfg.num_warps))
        elif kernel != "a8w8_blockscale":
            self._bind_gluon_gemm(kernel, a, b, a_s, b_s, out, cfg)
            return
        else:
            self._blocks = ([bm, SCALE_BLOCK], [bn, SCALE_BLOCK], [bm, bn])
            programs = gb.programs_for(triton.cdiv(self.M, bm) * triton.cdiv(self.N, bn), programs_per_wave(a.device),
                                       bm, bn, cfg.num_stages, cfg.PERSISTENT_TMA)
            self.main = BoundKernel(
                gb.blockscale_kernel, (programs,),
                (*gb.descriptors(a, b, out, bm, bn), a_s, b_s, self.M, self.N, self.K, a_s.stride(0), a_s.stride(1),
                 b_s.stride(0), b_s.stride(1), programs, cfg.GROUP_SIZE_M, cfg.num_stages, cfg.num_warps),
                varying=5, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self._cache_descriptors((a, b, out))

    def _bind_ws_split_k(self, kernel: str, a, b, a_s, b_s, out, cfg: GemmConfig, strides: tuple) -> None:
        """`self.main`: the warp-specialised kernel with K split NUM_KSPLIT ways (its descriptors as the unsplit
        one's, `_bind_gluon`): the fp32 slots of the tiles' partial sums come from `self.scratch` per call, the
        per-tile counts from `_lock` (per stream, zeroed once, left zero by every launch; a CUDA graph gets its
        own)."""
        from tritune.kernels import gluon_gemm_ws as ws

        bm, bn = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N
        bk = 128 // a.element_size()
        if not ws.split_k_fits(self.K, cfg.NUM_KSPLIT, bk):
            raise ValueError(f"NUM_KSPLIT={cfg.NUM_KSPLIT} leaves a split without a {bk}-wide K block at K={self.K}")
        part_n, self.tiles = ws.split_k_workspace(self.M, self.N, bm, bn, cfg.NUM_KSPLIT)
        self.scratch = Workspace(((torch.float32, part_n),))
        self.workspace_numel = part_n
        self._locks = {}
        programs = min(self.tiles * cfg.NUM_KSPLIT, programs_per_wave(a.device))
        part = torch.empty(part_n, device=a.device, dtype=torch.float32)
        counts = torch.zeros(self.tiles, device=a.device, dtype=torch.int32)
        self.main = BoundKernel(
            ws.ws_splitk_kernel, (programs,),
            (*ws.ws_descriptors(a, b, out, bm, bn), a_s, b_s, part, counts, self.M, self.N, self.K, *strides,
             programs, *ws.splitk_constexprs(kernel, cfg)),
            varying=7, num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=ws.ws_maxnreg(cfg.num_warps))

    def _bind_gluon_gemm(self, kernel: str, a, b, a_s, b_s, out, cfg: GemmConfig) -> None:
        """The Gluon bf16 / a8w8 kernel (persistent, a program a SM), bound once: five descriptors (A; B's rows and
        C's columns in the tile's two power-of-two parts, the second pair repeating the first where the tile is one
        power of two wide), each cached by address."""
        from tritune.kernels import gluon_gemm as gg

        bm, bn = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N
        bn0, bn1 = gg.split_width(bn)
        bk = gg.block_k(a.dtype)
        self._blocks = ([bm, bk], [bn0, bk], [bn1 or bn0, bk], [bm, bn0], [bm, bn1 or bn0])
        self._desc_of = (0, 1, 1, 2, 2)  # which of (A, B, C) each descriptor describes
        programs = gg.programs_for(triton.cdiv(self.M, bm) * triton.cdiv(self.N, bn), programs_per_wave(a.device))
        self.main = BoundKernel(
            gg.gemm_kernel, (programs,),
            (*gg.descriptors(a, b, out, bm, bn), a_s, b_s, self.M, self.N, self.K, programs,
             *gg.constexprs(kernel, self.K, a.dtype, cfg)),
            varying=7, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self._cache_descriptors((a, b, b, out, out))

    def _cache_descriptors(self, tensors: tuple) -> None:
        """`self._desc_caches`: the bound kernel's TMA descriptors of `tensors` (in `self._blocks`' order), each
        encoded once per address (weights repeat every call, activations and outputs mostly do: torch's caching
        allocator hands the same blocks back; a plan fixes every other field of a descriptor)."""
        self._desc_caches = tuple(
            DescriptorCache(t.shape, t.stride(), t.dtype, blk, encode=partial(self.main.encode, nth=i))
            for i, (t, blk) in enumerate(zip(tensors, self._blocks, strict=True)))

    def _lock(self):
        """The per-tile locks of this call's stream (zero between calls: the last split of a tile resets its own)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu and torch.cuda.is_current_stream_capturing():  # a graph gets its own, zeroed when it is replayed
            return torch.zeros(self.tiles, device=self.device, dtype=torch.int32)
        stream = torch._C._cuda_getCurrentRawStream(self.device.index) if on_gpu else 0
        locks = self._locks.get(stream)
        if locks is None:
            locks = self._locks[stream] = torch.zeros(self.tiles, device=self.device, dtype=torch.int32)
        return locks.data_ptr() if on_gpu else locks

    def _descs(self, a, b, out) -> tuple:
        """The launch arguments of the three descriptors (addresses or tensors on a GPU; tensors otherwise)."""
        if self._desc_caches is None:
            from triton.tools.tensor_descriptor import TensorDescriptor

            return tuple(TensorDescriptor.from_tensor(t, blk) for t, blk in zip((a, b, out), self._blocks, strict=True))
        ptrs = (a if isinstance(a, int) else a.data_ptr(), b if isinstance(b, int) else b.data_ptr(),
                out if isinstance(out, int) else out.data_ptr())
        if len(self._desc_caches) == 3:
            ca, cb, cc = self._desc_caches
            return (*ca.get(ptrs[0]), *cb.get(ptrs[1]), *cc.get(ptrs[2]))
        return tuple(x for cache, i in zip(self._desc_caches, self._desc_of, strict=True) for x in cache.get(ptrs[i]))

    def __call__(self, a, b, a_scale, b_scale, out, workspace: torch.Tensor | None = None) -> None:
        """Launch on A, B, the scales (None when unquantized) and C: tensors, or their addresses when
        `takes_addresses`."""
        a_s = a_scale if a_scale is not None else a
        b_s = b_scale if b_scale is not None else a
        if self.cfg.GLUON and self.split > 1:  # the warp-specialised block-scaled kernel, K split
            if workspace is not None:
                part = workspace
            else:
                keep, (part,) = self.scratch.allocate(self.device)  # noqa: F841 (alive until the launch is queued)
            self.main.launch(*self._descs(a, b, out), a_s, b_s, part, self._lock())
            return
        if self.cfg.PERSISTENT_TMA or self.cfg.GLUON:
            self.main.launch(*self._descs(a, b, out), a_s, b_s)
            return
        if self.split == 1:
            self.main.launch(a, b, out, a_s, b_s, a, a)
            return
        if workspace is not None:
            part = workspace
        else:
            keep, (part,) = self.scratch.allocate(self.device)  # noqa: F841 (alive until the launch is queued)
        self.main.launch(a, b, part, a_s, b_s, out, self._lock())


def _check_tma(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, quant: int, cfg: GemmConfig) -> None:
    if cfg.NUM_KSPLIT != 1:
        raise ValueError("PERSISTENT_TMA does not split K; use NUM_KSPLIT=1")
    if cfg.SCALE_PIPELINE and (quant != QUANT_BLOCK or cfg.BLOCK_SIZE_K != 128 or cfg.BLOCK_SIZE_N > 128):
        raise ValueError("SCALE_PIPELINE needs the block-scaled kernel, BLOCK_SIZE_K 128 and BLOCK_SIZE_N <= 128")
    if cfg.WARP_SPECIALIZE and cfg.SCALE_PIPELINE:
        raise ValueError("WARP_SPECIALIZE and SCALE_PIPELINE are two schedules of one loop: choose one")
    if not tma_compatible(a, b, out):
        raise ValueError("PERSISTENT_TMA needs 16-byte aligned A, B, C rows (K and N multiples of 16 bytes)")


def gemm(kernel: str, a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig, *, a_scale: torch.Tensor | None = None,
         b_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
         workspace: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C[M, N] = A[M, K] · B[N, K]ᵀ (scaled for the fp8 kernels), written in `out`'s dtype, else as `out_dtype`
    (bf16 or fp16; the fp32 accumulator is rounded once, at the store).

    Binds the launch afresh on every call (the ops cache a `GemmLaunch` per call signature instead).
    `workspace` (fp32, ≥ NUM_KSPLIT·M·N elements) may be passed to avoid an allocation per split-K call.
    """
    validate(kernel, a, b, a_scale, b_scale, cfg)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[0]), device=a.device, dtype=OUT_DTYPES[out_dtype_name(out_dtype)])
    launch = GemmLaunch(kernel, a, b, a_scale, b_scale, out, cfg)
    if workspace is not None and cfg.NUM_KSPLIT > 1:
        need = launch.workspace_numel
        if workspace.dtype != torch.float32:
            raise ValueError(f"split-K workspace must be float32, got {workspace.dtype}")
        if workspace.numel() < need:
            workspace = None
    launch(a, b, a_scale, b_scale, out, workspace if cfg.NUM_KSPLIT > 1 else None)
    return out


def gemm_reference(kernel: str, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None = None,
                   b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 torch result the kernels must match: dequantize, then A·Bᵀ in fp32. Shape [M, N]."""
    quant = _QUANT_OF[kernel]
    af, bf = a.float(), b.float()
    if quant == QUANT_PER_TOKEN:
        af = af * a_scale.reshape(-1, 1)
        bf = bf * b_scale.reshape(-1, 1)
    elif quant == QUANT_BLOCK:
        af = af * a_scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, : a.shape[1]]
        bs = b_scale.repeat_interleave(SCALE_BLOCK, dim=0).repeat_interleave(SCALE_BLOCK, dim=1)
        bf = bf * bs[: b.shape[0], : b.shape[1]]
    return af @ bf.T


def compile_only(kernel: str, M: int, N: int, K: int, cfg: GemmConfig, dtype: torch.dtype = torch.bfloat16,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the kernel(s) this launch would use, without a GPU tensor or a launch. `dtype`: the bf16 kernel's
    operands; `out_dtype`: C's.

    Pointers are passed as dtypes (Triton's warm-up mock tensors, 16-byte aligned like real allocations) and the
    integer arguments take the real values, so the binary lands in Triton's cache under the key the real launch
    computes. M is never specialized, so one binary serves every M.
    """
    from triton.runtime.jit import MockTensor

    quant = _QUANT_OF[kernel]
    in_dtype = dtype if quant == QUANT_NONE else torch.float8_e4m3fn
    f32 = torch.float32
    bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
    ks = triton.cdiv(K, SCALE_BLOCK)
    s_a, s_b = (ks, ks) if quant == QUANT_BLOCK else (0, 0)
    scale_dtype = f32 if quant != QUANT_NONE else in_dtype
    if cfg.GLUON:
        from tritune.kernels import gluon_blockscale as gb

        why = ("GLUON takes bf16, fp16 or fp8 operands, not float32" if in_dtype == torch.float32
               else gluon_problem(cfg, kernel, in_dtype.itemsize))
        if why:
            raise ValueError(why)
        a, b, c = (MockTensor(dt, shape) for dt, shape in ((in_dtype, [M, K]), (in_dtype, [N, K]),
                                                           (out_dtype, [M, N])))
        if cfg.WARP_SPECIALIZE:  # no integer argument of it is specialized: any values serve
            from tritune.kernels import gluon_gemm_ws as ws

            if cfg.NUM_KSPLIT > 1:  # K split
                ws.ws_splitk_kernel.warmup(
                    *ws.ws_descriptors(a, b, c, bm, bn), scale_dtype, scale_dtype, f32, torch.int32, M, N, K, s_a, 1,
                    s_b, 1, 1, *ws.splitk_constexprs(kernel, cfg), num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, maxnreg=ws.ws_maxnreg(cfg.num_warps), grid=(1,))
                return
            ws.ws_gemm_kernel.warmup(*ws.ws_descriptors(a, b, c, bm, bn), scale_dtype, scale_dtype, M, N, K, s_a, 1,
                                     s_b, 1, 1, *ws.constexprs(kernel, cfg), num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages, maxnreg=ws.ws_maxnreg(cfg.num_warps), grid=(1,))
            return
        if kernel != "a8w8_blockscale":
            from tritune.kernels import gluon_gemm as gg

            gg.gemm_kernel.warmup(*gg.descriptors(a, b, c, bm, bn), scale_dtype, scale_dtype, M, N, K, 1,  # programs
                                  *gg.constexprs(kernel, K, in_dtype, cfg), num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages, grid=(1,))
            return
        gb.blockscale_kernel.warmup(
            *gb.descriptors(a, b, c, bm, bn), scale_dtype, scale_dtype, M, N, K, s_a, 1, s_b, 1, 1,  # programs: any
            cfg.GROUP_SIZE_M, cfg.num_stages, cfg.num_warps, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            grid=(1,))
        return
    if cfg.PERSISTENT_TMA:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(dt, rows, cols, block):
            return TensorDescriptor(MockTensor(dt), [rows, cols], [cols, 1], block)

        _gemm_tma_persistent_kernel.warmup(
            desc(in_dtype, M, K, [bm, bk]), desc(in_dtype, N, K, [bn, bk]), desc(out_dtype, M, N, c_block(cfg)),
            scale_dtype, scale_dtype, M, N, K, s_a, s_b,
            QUANT=quant, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=cfg.GROUP_SIZE_M,
            NUM_SMS=programs_per_wave(torch.device("cuda")), SCALE_PIPELINE=cfg.SCALE_PIPELINE, **tma_options(cfg),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,),
        )
        return
    split = cfg.NUM_KSPLIT > 1
    # Unsplit calls pass A for the two unused pointers (out, lock): its dtype is part of the binary's key.
    _gemm_kernel.warmup(
        in_dtype, in_dtype, f32 if split else out_dtype, scale_dtype, scale_dtype,
        out_dtype if split else in_dtype, torch.int32 if split else in_dtype,
        M, N, K, k_per_split(K, cfg), K, K, N, M * N if split else 0, s_a, s_b, 0,
        QUANT=quant, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M, NUM_KSPLIT=cfg.NUM_KSPLIT, EVEN_K=K % bk == 0,
        CACHE_MODIFIER=cfg.cache_modifier, SPLIT_FIXUP=split, TAIL_SPLIT=cfg.TAIL_SPLIT, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        grid=(1,),
    )
