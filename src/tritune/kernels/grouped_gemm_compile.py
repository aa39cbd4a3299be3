"""Compile a grouped-GEMM kernel without a GPU or a launch: the compile pool's half of tuning.

Pointers are Triton's warm-up mock tensors and the integers are the values the real launch passes (the program
count is never specialized), so each binary lands in Triton's cache under the key the real launch computes.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.kernels.grouped_gemm import _grouped_dw_kernel, _grouped_dx_kernel, _grouped_fwd_kernel
from tritune.kernels.grouped_gemm_config import (
    KernelConfig,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    check_compiles_here,
    stores_through_tma,
)
from tritune.knobs import interpreting

_PROGRAMS = 132  # not 1 (the kernels do not specialize on it); the SM count of an H100 or H200, whose launches size the
# scheduled dW's table from it


def _operand(dtype: torch.dtype, tma: bool, rows: int, cols: int, block: list[int]):
    from triton.runtime.jit import MockTensor

    if tma:
        return TensorDescriptor(MockTensor(dtype), [rows, cols], [cols, 1], block)
    return MockTensor(dtype)


def compile_only(config: KernelConfig, *, num_experts: int, n: int, k: int, pairs: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the kernel a launch with `config` would run (forward, dX or dW by the config's class) for weights
    [num_experts, n, k] over `pairs` grouped rows; raises what Triton raises for a config that cannot compile."""
    from triton.runtime.jit import MockTensor

    check_compiles_here(config, triton.__version__, interpreting())
    cfg, i32, f32 = config, torch.int32, torch.float32
    bm, bn, bk = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K
    common = dict(NUM_EXPERTS=num_experts, E_POW2=triton.next_power_of_2(num_experts), NUM_PROGRAMS=_PROGRAMS,
                  PERMUTE_X=cfg.permute_x, PERMUTE_Y=cfg.permute_y, FLATTEN=cfg.flatten,
                  BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,))
    if isinstance(cfg, KernelConfigForward):
        _grouped_fwd_kernel.warmup(
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_x, pairs, k, [bm, bk]),
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_w, num_experts * n, k, [bn, bk]),
            MockTensor(dtype), _operand(dtype, stores_through_tma(cfg), pairs, n, [bm, bn]),
            MockTensor(i32), MockTensor(i32), MockTensor(f32 if cfg.fuse_mul_post else i32), n, k,
            TOPK=topk, FUSE_MUL_POST=cfg.fuse_mul_post, USE_TMA_LOAD_X=cfg.use_tma_load_x,
            USE_TMA_LOAD_W=cfg.use_tma_load_w, USE_TMA_STORE=stores_through_tma(cfg),
            EVEN_K=k % bk == 0, **common)
    elif isinstance(cfg, KernelConfigBackward_dX):
        _grouped_dx_kernel.warmup(
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_dy, pairs, n, [bm, bn]),
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_w, num_experts * n, k, [bn, bk]),
            MockTensor(dtype), _operand(dtype, stores_through_tma(cfg), pairs, k, [bm, bk]),
            MockTensor(i32), MockTensor(i32), n, k,
            USE_TMA_LOAD_DY=cfg.use_tma_load_dy, USE_TMA_LOAD_W=cfg.use_tma_load_w,
            USE_TMA_STORE=stores_through_tma(cfg), EVEN_N=n % bn == 0, **common)
    elif isinstance(cfg, KernelConfigBackward_dW) and cfg.scheduled:
        from tritune.kernels.grouped_dw_scheduled import (
            HELPER_LAUNCH,
            PAD_COLS,
            PAD_ROWS,
            _dw_schedule_kernel,
            _dw_scheduled_kernel,
            _pad_rows_kernel,
            max_table_steps,
            rows_upper_bound,
        )

        # The padded rows and the step table are sized at the launch; the kernels specialize on neither. The copy
        # and the table kernel are built for every role (which operand is copied, and from which order, is the
        # launch's to decide).
        rows = rows_upper_bound(pairs, num_experts, bm)
        e_pow2 = triton.next_power_of_2(num_experts)
        per_expert = (n // bn) * triton.cdiv(k, bk)
        # the table's row length as dw_schedule sizes it (an int argument: its divisibility is in the cache key)
        max_steps = max_table_steps(per_expert, _PROGRAMS, pairs, num_experts, bm)
        # (gathered, by, scaled): grouped; X in token order; dY in pair order; the MoE MLP's dY from dout and the
        # routing weights (moe_mlp's padded backward)
        for gathered, by, scaled in ((False, 1, False), (True, topk, False), (True, 1, False), (True, topk, True)):
            _pad_rows_kernel.warmup(MockTensor(dtype), MockTensor(dtype), MockTensor(i32), MockTensor(i32),
                                    MockTensor(torch.float32), rows, k, NUM_EXPERTS=num_experts, E_POW2=e_pow2,
                                    BLOCK_SIZE_M=bm, GATHERED=gathered, TOPK=by, SCALED=scaled, ROWS=PAD_ROWS,
                                    BLOCK_C=PAD_COLS, grid=(1,), **HELPER_LAUNCH)
        for pad_x in (True, False):
            _dw_schedule_kernel.warmup(MockTensor(i32), MockTensor(i32), n, n // bn, triton.cdiv(k, bk), _PROGRAMS,
                                       max_steps, NUM_EXPERTS=num_experts, E_POW2=e_pow2, PAD_X=pad_x, PAD_DY=not pad_x,
                                       BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, GROUP_SIZE_N=cfg.GROUP_SIZE_N, grid=(1,),
                                       **HELPER_LAUNCH)
        _dw_scheduled_kernel.warmup(
            _operand(dtype, True, rows, k, [bm, bk]), _operand(dtype, True, rows, n, [bm, bn]),
            _operand(dtype, True, num_experts * n, k, [bn, bk]), MockTensor(i32), MockTensor(i32), max_steps,
            num_experts * per_expert, per_expert,
            BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            grid=(1,))
    elif isinstance(cfg, KernelConfigBackward_dW):
        _grouped_dw_kernel.warmup(
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_x, pairs, k, [bm, bk]),
            MockTensor(dtype), _operand(dtype, cfg.use_tma_load_dy, pairs, n, [bm, bn]),
            MockTensor(dtype), _operand(dtype, stores_through_tma(cfg), num_experts * n, k, [bn, bk]),
            MockTensor(i32), MockTensor(i32), n, k,
            TOPK=topk, USE_TMA_LOAD_DY=cfg.use_tma_load_dy, USE_TMA_LOAD_X=cfg.use_tma_load_x,
            USE_TMA_STORE=stores_through_tma(cfg), GROUP_SIZE_N=cfg.GROUP_SIZE_N, **common)
    else:
        raise TypeError(f"not a grouped-GEMM kernel config: {type(cfg).__name__}")
