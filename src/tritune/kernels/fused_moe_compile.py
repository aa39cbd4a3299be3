"""Compile a fused-MoE kernel without a GPU or a launch: the compile pool's half of tuning.

Pointers are Triton's warm-up mock tensors and the integers are the values the real launch passes, so each binary
lands in Triton's cache under the key the real launch computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.compile_target import sm_count_for
from tritune.kernels import fused_moe_1stage
from tritune.kernels.fused_moe import (
    _ACT_ID,
    FP8,
    FP8_QUANTS,
    MXFP4,
    MXFP4_QUANTS,
    SCALE_BLOCK,
    MoeConfig,
    _moe_gemm_kernel,
    check_config,
    check_scale_records,
    quant_id,
    reads_prepared,
)
from tritune.kernels.fused_moe_1stage import (
    _moe_1stage_kernel,
    _moe_1stage_swap_kernel,
    coop_split,
    register_cap,
)
from tritune.kernels.fused_moe_config import check_compiles_here, weight_tma_view
from tritune.kernels.fused_moe_persistent import _moe_gemm_persistent_kernel
from tritune.kernels.launch import row_major_strides
from tritune.kernels.moe_align import gemm_blocks, sorted_rows
from tritune.kernels.mxfp4_records import records_box, records_shape
from tritune.kernels.mxfp4_swizzle import tile_box, tile_view_shape
from tritune.knobs import interpreting


@dataclass(frozen=True)
class MoeDims:
    """The host-known sizes a fused-MoE launch specializes on (what `compile_only` needs instead of tensors)."""

    tokens: int
    topk: int
    experts: int
    model_dim: int
    inter_dim: int
    gated: bool = True
    dtype: torch.dtype = torch.bfloat16
    quant: str = "none"
    activation: str = "silu"
    doweight_stage1: bool = False
    swizzled: bool = False  # MXFP4 weights prepared (kernels/mxfp4_swizzle.py): the GEMMs that can read them do

    @property
    def numel(self) -> int:
        return self.tokens * self.topk


def compile_only(kernel: str, dims: MoeDims, config: MoeConfig, pdl: bool = False) -> Any:
    """Compile the GEMM kernel `kernel` ("stage1", "stage2", "1stage") would launch, with no GPU and no launch.

    Pointers are Triton's warm-up mock tensors and the integers are the values the real launch passes, so the
    binary lands in Triton's cache under the key of the real launch (the small sort, quantize and sum kernels are
    left to the first real launch: they are few and shared by every config). A config with the plan-level options
    (SORTED_INTER, TOPK_ATOMIC) compiles the variant `MoeLaunch` binds for it; the fp8 intermediate quantized inside
    the GEMMs (AMAX_OUT, A_QUANT_ON_LOAD) is not modelled here and compiles on its first launch, and so does a stage 1
    writing its output in the K32 order for a swapped MXFP4 stage 2 (OUT_K32: it depends on the other stage).
    Returns the binary (Triton's CompiledKernel: its `asm` is what benchmarks/ir_census.py counts). `pdl`: the
    variant a plan launches as a programmatic dependent (`MoeLaunch` on Hopper, kernels/pdl.py); the stage functions
    launch plainly.
    """
    from triton.runtime.jit import MockTensor

    check_config(config, kernel, dims.quant)
    check_compiles_here(config, kernel, dims.quant, triton.__version__, interpreting())
    cfg, q = config, dims.quant
    f32, i32 = torch.float32, torch.int32
    a_dt = FP8 if q in FP8_QUANTS else dims.dtype
    w_dt = torch.uint8 if q in MXFP4_QUANTS else a_dt  # MXFP4: two e2m1 codes per byte along K, uint8 e8m0 scales
    ws_dt = torch.uint8 if q in MXFP4_QUANTS else f32
    numel = dims.numel
    num_pid_m = gemm_blocks(numel, dims.experts, cfg.BLOCK_SIZE_M)  # as the launches pass it (its specialization)
    if kernel == "1stage" and cfg.SWAP_AB:
        return _compile_1stage_swap(dims, cfg, num_pid_m, pdl)
    if kernel == "1stage":
        d, inter = dims.model_dim, dims.inter_dim
        s1 = _mock_scale_strides(q, dims.experts, inter * (2 if dims.gated else 1), d)
        s2 = _mock_scale_strides(q, dims.experts, d, inter)
        d_row, i_row = (d // 2, inter // 2) if q in MXFP4_QUANTS else (d, inter)  # weight row lengths as stored
        final_cast = fused_moe_1stage.FINAL_CAST_IN_KERNEL  # the output and its counts, else two dummy pointers
        return _moe_1stage_kernel.warmup(
            a_dt, f32, w_dt, ws_dt, w_dt, ws_dt, f32, i32, i32, i32, f32, dims.dtype if final_cast else f32, f32,
            numel, inter, d, num_pid_m,
            d, triton.cdiv(d, SCALE_BLOCK) if q == "per_1x128" else 0,
            inter * (2 if dims.gated else 1) * d_row, d_row, *s1, d * i_row, i_row, *s2,
            TOPK=dims.topk, GATED=dims.gated, ACT=_ACT_ID[dims.activation], QUANT=quant_id(q),
            BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, BLOCK_SIZE_N=cfg.BLOCK_SIZE_N, BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
            BLOCK_SIZE_D=cfg.BLOCK_SIZE_D, GROUP_SIZE_M=cfg.GROUP_SIZE_M, EVEN_K=d % cfg.BLOCK_SIZE_K == 0,
            WIDE_FP16=dims.dtype == torch.float16, FINAL_CAST=final_cast, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, grid=(1,))
    # The plan-level options, as MoeLaunch passes them: a sorted intermediate has moe_align.sorted_rows rows; stage 2
    # adds into the fp32 [T, D] accumulator unless it writes `out` itself (top-1 without split-K).
    rows = sorted_rows(numel, dims.experts, cfg.BLOCK_SIZE_M) if cfg.SORTED_INTER else numel
    if cfg.GLUON:
        return _compile_gluon(kernel, dims, cfg, rows, num_pid_m)
    stage1 = kernel == "stage1"
    atomic = not stage1 and bool(cfg.TOPK_ATOMIC) and not (dims.topk == 1 and cfg.KSPLIT == 1)
    if stage1:
        n, k, gated = dims.inter_dim, dims.model_dim, dims.gated
        act, mul = _ACT_ID[dims.activation], dims.doweight_stage1
        a_row_div = dims.topk
    else:
        n, k, gated, act, mul = dims.model_dim, dims.inter_dim, False, _ACT_ID["none"], not dims.doweight_stage1
        a_row_div = 1
    n_w = n * (2 if gated else 1)
    split = cfg.KSPLIT > 1 and not atomic
    out_dt = f32 if split or atomic else dims.dtype
    w_desc = MockTensor(w_dt)
    prepared = dims.swizzled and reads_prepared(cfg, q, n, gated)
    if cfg.USE_TMA:  # as _launch_gemm and MoeLaunch pass it (prepared weights tile-major: mxfp4_swizzle.tile_view)
        w_desc = _mock_weight(q, w_dt, dims.experts, n_w, k, prepared, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K)
    a_sorted = (2 if cfg.GATHER_A else 0) if stage1 else cfg.SORTED_INTER
    a_desc = MockTensor(a_dt)
    if a_sorted == 2:  # stage 1's gathered A has the rows of a sorted intermediate (moe_align.sorted_rows)
        a_rows = sorted_rows(numel, dims.experts, cfg.BLOCK_SIZE_M) if stage1 else rows
        a_desc = TensorDescriptor(MockTensor(a_dt), [a_rows, k], [k, 1], [cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_K])
    part_rows = rows if stage1 else numel  # split-K partials: stage 1 in the intermediate's order, stage 2 by pair
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.KSPLIT), cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K
    w_row = k // 2 if q in MXFP4_QUANTS else k  # bytes (elements) of a weight row
    kernel_fn = _moe_gemm_persistent_kernel if cfg.PERSISTENT else _moe_gemm_kernel  # the same arguments
    ws, scale_strides = ws_dt, _mock_scale_strides(q, dims.experts, n_w, k)
    if cfg.SCALE_TMA:  # the codes' records through TMA (mxfp4_records), as _launch_gemm and MoeLaunch pass them
        ws, scale_strides = _mock_records(dims.experts, n_w, k, cfg.BLOCK_SIZE_N)
    return kernel_fn.warmup(
        a_dt, a_desc, f32, w_dt, w_desc, ws, out_dt, i32, i32, i32, f32, f32, numel, n, k, k_per_split, num_pid_m,
        k, triton.cdiv(k, SCALE_BLOCK) if q == "per_1x128" else 0, n_w * w_row, w_row,
        *scale_strides, n_w if split else n, part_rows * n_w if split else 0, 0,
        A_ROW_DIV=a_row_div, GATED=gated, ACT=act, MUL_WEIGHT=mul, QUANT=quant_id(q),
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, BLOCK_SIZE_N=cfg.BLOCK_SIZE_N, BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        GROUP_SIZE_M=cfg.GROUP_SIZE_M, KSPLIT=cfg.KSPLIT, EVEN_K=k % cfg.BLOCK_SIZE_K == 0, USE_TMA=bool(cfg.USE_TMA),
        AMAX_OUT=0, A_QUANT_ON_LOAD=False, OUT_SORTED=stage1 and bool(cfg.SORTED_INTER), A_SORTED=a_sorted,
        ATOMIC_TOPK=dims.topk if atomic else 0, SWAP_AB=bool(cfg.SWAP_AB), WARP_SPEC=bool(cfg.WARP_SPEC),
        OUT_K32=False, SCALE_TMA=bool(cfg.SCALE_TMA), W_SWIZZLED=prepared, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,), **({"launch_pdl": True} if pdl else {}))


def _compile_gluon(kernel: str, dims: MoeDims, cfg: MoeConfig, rows: int, num_pid_m: int) -> Any:
    """`compile_only` of a Gluon per_1x128 stage (kernels/gluon_moe.py), its operands as MoeLaunch._gemm_gluon passes
    them: A (stage 1: the gathered rows, or the tokens' rows it copies itself; stage 2: the quantized intermediate)
    and the weights as [E·N, K] through TMA, stage 1's intermediate through TMA too."""
    from triton.runtime.jit import MockTensor

    from tritune.kernels import gluon_moe
    from tritune.kernels.gluon_blockscale import descriptor

    f32, i32 = torch.float32, torch.int32
    stage1 = kernel == "stage1"
    n, k = (dims.inter_dim, dims.model_dim) if stage1 else (dims.model_dim, dims.inter_dim)
    n_w = n * (2 if stage1 and dims.gated else 1)
    bm, bn = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N
    a = descriptor(MockTensor(FP8, [rows, k]), [bm, SCALE_BLOCK])
    w = descriptor(MockTensor(FP8, [dims.experts * n_w, k]), [bn, SCALE_BLOCK])
    groups = triton.cdiv(k, SCALE_BLOCK)
    strides = (triton.cdiv(n_w, SCALE_BLOCK) * groups, groups, 1)  # quantize_weights' [E, N/128, K/128]
    meta = dict(GROUP_M=cfg.GROUP_SIZE_M, STAGES=cfg.num_stages, WARPS=cfg.num_warps, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, grid=(1,))
    if stage1:
        out = descriptor(MockTensor(dims.dtype, [rows, n]), [bm, bn])
        if not cfg.GATHER_A:  # the kernel copies each pair's token row: A's descriptor is over the tokens' rows
            a = descriptor(MockTensor(FP8, [dims.numel // dims.topk, k]), [bm, SCALE_BLOCK])
        args = (a, w, out, f32, f32, i32, i32, FP8, i32, n, k, num_pid_m, groups, 1, *strides, dims.numel, k)
        meta |= dict(GATHER=not cfg.GATHER_A, TOPK=dims.topk)
        if cfg.QUANT_OUT:  # the intermediate in fp8 and its scales, [rows, I/128]
            out = descriptor(MockTensor(FP8, [rows, n]), [bm, bn])
            return gluon_moe.moe_stage1_q_kernel.warmup(
                a, w, out, f32, f32, i32, i32, FP8, i32, f32, *args[9:], triton.cdiv(n, SCALE_BLOCK),
                FP16=dims.dtype == torch.float16, **meta)
        if cfg.PERSISTENT and cfg.WARP_SPEC:  # its loader warp group's registers go to the MMA warps
            from tritune.kernels.gluon_gemm_ws import WS_LOADER_REGS, ws_maxnreg

            return gluon_moe.moe_stage1_ws_kernel.warmup(
                *args, sm_count_for(torch.device("cuda")) or 132, LOADER_REGS=WS_LOADER_REGS,
                maxnreg=ws_maxnreg(cfg.num_warps), **meta)
        if cfg.PERSISTENT:  # the grid (a program a SM) is not specialized on
            return gluon_moe.moe_stage1_persistent_kernel.warmup(
                *args, sm_count_for(torch.device("cuda")) or 132, **meta)
        return gluon_moe.moe_stage1_kernel.warmup(*args, **meta)
    # TOPK_ATOMIC: each row added into its token's row of the [T, D] accumulator, fp32 (1) or 16-bit (2) (not at
    # top-1: out itself)
    atomic = dims.topk if cfg.TOPK_ATOMIC and dims.topk > 1 else 0
    out_dt = f32 if atomic and cfg.TOPK_ATOMIC == 1 else dims.dtype
    meta |= dict(ATOMIC_TOPK=atomic)
    if cfg.PERSISTENT:  # the grid (a program a SM) is not specialized on
        args = (a, w, out_dt, f32, f32, i32, i32, f32, i32, dims.numel, n, k, num_pid_m, groups, 1, *strides, n,
                sm_count_for(torch.device("cuda")) or 132)
        if cfg.WARP_SPEC:  # its loader warp group's registers go to the MMA warps
            from tritune.kernels.gluon_gemm_ws import WS_LOADER_REGS, ws_maxnreg

            return gluon_moe.moe_stage2_ws_kernel.warmup(*args, LOADER_REGS=WS_LOADER_REGS,
                                                         maxnreg=ws_maxnreg(cfg.num_warps), **meta)
        return gluon_moe.moe_stage2_persistent_kernel.warmup(*args, **meta)
    return gluon_moe.moe_stage2_kernel.warmup(a, w, out_dt, f32, f32, i32, i32, f32, i32, dims.numel, n, k,
                                              num_pid_m, groups, 1, *strides, n, **meta)


def _compile_1stage_swap(dims: MoeDims, cfg: MoeConfig, num_pid_m: int, pdl: bool) -> Any:
    """`compile_only` of the swapped MXFP4 1-stage kernel, its operands as MoeLaunch._bind_1stage_swap passes them."""
    from triton.runtime.jit import MockTensor

    d, inter, e = dims.model_dim, dims.inter_dim, dims.experts
    prepared = dims.swizzled and reads_prepared(cfg, MXFP4, inter, dims.gated)  # as the tuner's launcher passes them
    if cfg.SCALE_TMA:  # a gated w1's up rows on a record (prepared weights: `reads_prepared` asked the same)
        check_scale_records(cfg, inter, dims.gated)
    operands = []
    for rows, k, tile_rows, k_step in ((inter * (2 if dims.gated else 1), d, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K),
                                       (d, inter, cfg.BLOCK_SIZE_D, cfg.BLOCK_SIZE_N)):
        # Strides as the weight's view has them (prepared: Mxfp4Weights.view, (expert, 64, 1) over whole chunks).
        strides_w = ((-(-rows // 64) * 64 * (-(-k // 128) * 64), 64) if prepared else (rows * (k // 2), k // 2))
        w_desc = MockTensor(torch.uint8)
        if cfg.USE_TMA:
            w_desc = _mock_weight(MXFP4, torch.uint8, e, rows, k, prepared, tile_rows, k_step)
        ws, strides = MockTensor(torch.uint8), _mock_scale_strides(MXFP4, e, rows, k)
        if cfg.SCALE_TMA:
            ws, strides = _mock_records(e, rows, k, tile_rows)
        operands.append((w_desc, ws, (*strides_w, *strides)))
    (d1, s1, st1), (d2, s2, st2) = operands
    f32, i32, u8 = torch.float32, torch.int32, torch.uint8
    k_per_split = triton.cdiv(triton.cdiv(d, cfg.KSPLIT), cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K
    cap = register_cap(cfg, dims.numel, e, inter, sm_count_for(torch.device("cuda")))  # as the launch binds it
    return _moe_1stage_swap_kernel.warmup(
        dims.dtype, u8, d1, s1, u8, d2, s2, f32, i32, i32, i32, f32, f32, f32, f32, dims.numel, inter, d,
        num_pid_m, k_per_split, d, *st1, *st2,
        TOPK=dims.topk, GATED=dims.gated, ACT=_ACT_ID[dims.activation], QUANT=quant_id(MXFP4),
        BLOCK_SIZE_M=cfg.BLOCK_SIZE_M, BLOCK_SIZE_N=cfg.BLOCK_SIZE_N, BLOCK_SIZE_K=cfg.BLOCK_SIZE_K,
        BLOCK_SIZE_D=cfg.BLOCK_SIZE_D, GROUP_SIZE_M=cfg.GROUP_SIZE_M, EVEN_K=d % cfg.BLOCK_SIZE_K == 0,
        USE_TMA=bool(cfg.USE_TMA), SCALE_TMA=bool(cfg.SCALE_TMA), W_SWIZZLED=prepared, KSPLIT=cfg.KSPLIT, PDL=pdl,
        COOP=coop_split(cfg), TICKET=fused_moe_1stage.COOP_TICKET, TRACE=fused_moe_1stage.TRACE,
        PREFETCH_W2=fused_moe_1stage.prefetch_w2(cfg),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,), **({"launch_pdl": True} if pdl else {}),
        **({"maxnreg": cap} if cap else {}))


def _mock_weight(quant: str, dtype: torch.dtype, experts: int, rows: int, k: int, prepared: bool, tile_rows: int,
                 k_step: int) -> TensorDescriptor:
    """The TMA operand of a weight (experts × [rows, K] of `dtype`) read by tiles of `tile_rows` rows and `k_step` K,
    as MoeLaunch._weight_operand builds it: prepared MXFP4 weights tile-major (mxfp4_swizzle.tile_view), others as
    rows of their K (`weight_tma_view`)."""
    from triton.runtime.jit import MockTensor

    if prepared:
        shape, box = tile_view_shape(experts, rows, k // 2), tile_box(tile_rows, k_step)
    else:
        row, box = weight_tma_view(quant, k, tile_rows, k_step)
        shape = (experts * rows, row)
    return TensorDescriptor(MockTensor(dtype), list(shape), row_major_strides(shape), box)


def _mock_records(experts: int, rows: int, k: int, tile_rows: int) -> tuple[TensorDescriptor, tuple[int, int]]:
    """The TMA operand of an MXFP4 weight's scale records (mxfp4_records.records_view) read `tile_rows` rows a K
    step, and the (expert, row) strides the kernels take with it: (records an expert, 0)."""
    from triton.runtime.jit import MockTensor

    e, nb, kb, width = records_shape(experts, rows, k)
    shape = (e * nb, kb, width)
    desc = TensorDescriptor(MockTensor(torch.uint8), list(shape), row_major_strides(shape), records_box(tile_rows))
    return desc, (nb, 0)


def _mock_scale_strides(quant: str, experts: int, n: int, k: int) -> tuple[int, int]:
    """(expert stride, row stride) of a weight scale tensor, as `_scale_strides` reads them off a real one."""
    if quant == "per_token":
        return n, 0
    if quant == "per_1x128":
        return triton.cdiv(n, SCALE_BLOCK) * triton.cdiv(k, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)
    if quant in MXFP4_QUANTS:
        return n * (k // 32), k // 32
    return 0, 0
