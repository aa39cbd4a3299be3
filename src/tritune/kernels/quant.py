"""fp8 e4m3 quantization in the layouts the GEMM kernels read: per token, per channel, per 1×128, per 128×128."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune.kernels.launch import BoundKernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_EPS = 1e-10


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (per token for activations, per channel for N×K weights).

    x [R, C] float -> (fp8 [R, C], fp32 scales [R]) with x ≈ q * scale[:, None].
    """
    amax = x.float().abs().amax(dim=1).clamp_min(_EPS)
    scale = amax / FP8_MAX
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float().contiguous()


def quantize_blocks(x: torch.Tensor, block_rows: int, block_cols: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block_rows×block_cols tile (1×128 for activations, 128×128 for weights).

    x [R, C] float -> (fp8 [R, C], fp32 scales [⌈R/block_rows⌉, ⌈C/block_cols⌉]); edge tiles are partial.
    """
    rows, cols = x.shape
    gr, gc = triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols)
    padded = torch.zeros((gr * block_rows, gc * block_cols), device=x.device, dtype=torch.float32)
    padded[:rows, :cols] = x.float()
    tiles = padded.view(gr, block_rows, gc, block_cols)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(_EPS) / FP8_MAX  # clamp, then divide: as quantize_rows does
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gr * block_rows, gc * block_cols)
    return q[:rows, :cols].to(FP8).contiguous(), scale.contiguous()


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 to the nearest-even e4m3 value (normal range) before the cast, so the cast is exact.

    On the GPU the cast already rounds to nearest even and this changes nothing; Triton's interpreter (3.9) drops
    the carry when rounding crosses a power of two (127.5 becomes 64), which this sidesteps.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, ties to even
    return tl.where(tl.abs(x) >= 0.015625, rounded.to(tl.float32, bitcast=True), x)


@triton.jit
def quant_tile(x_ptr, q_ptr, s_ptr, row0, g, R, C, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
               BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Quantize columns [g·GROUP, (g+1)·GROUP) (the whole row when GROUP == 0) of rows row0..row0+ROWS-1 (those
    below R) and store their scales.

    A [ROWS, BLOCK] tile per step, so one program moves a few thousand elements in wide loads: one program per row
    and 128-column group left most of its threads idle and ran at a fifth of the copy bandwidth. A group that fits
    one tile is read once; wider groups (per-row scales) loop twice (amax, then quantize). Shared by
    `_quant_fp8_kernel` and the fused-MoE prologue, which quantizes the activations in the sort's launch.
    """
    rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < R
    if GROUP == 0:
        start = 0
        stop = C
    else:
        start = g * GROUP
        stop = tl.minimum(start + GROUP, C)
    x_rows = x_ptr + rows[:, None] * stride_x
    q_rows = q_ptr + rows[:, None] * stride_q
    if GROUP != 0 and GROUP <= BLOCK:
        offs = start + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (offs < stop)[None, :]
        x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
        q = _round_to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0))
        tl.store(q_rows + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for c in range(start, stop, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (offs < stop)[None, :]
            x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.maximum(amax, 1e-10) / 448.0
        for c in range(start, stop, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (offs < stop)[None, :]
            x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            q = _round_to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0))
            tl.store(q_rows + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_s + g, scale, mask=row_ok)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr,  # x [R, C] bf16/fp16/fp32, q fp8 [R, C], s fp32 [R, ⌈C/GROUP⌉]
    R, C, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr,  # columns per scale: a power of two (128 for 1×128), or 0 for one scale per row
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """One program per ROWS rows and scale group.

    Grid: (⌈R/ROWS⌉·groups,), groups = ⌈C/GROUP⌉ (1 when GROUP == 0) = stride_s.
    """
    pid = tl.program_id(0)
    quant_tile(x_ptr, q_ptr, s_ptr, (pid // stride_s) * ROWS, pid % stride_s, R, C, stride_x, stride_q, stride_s,
               GROUP, BLOCK, ROWS)


# Elements one quantization program takes per step: [32, 128] for 1×128 groups, [4, 1024] for per-row scales.
QUANT_TILE = 4096


@dataclass(frozen=True)
class QuantLayout:
    """How `quant_tile` covers rows of `cols` columns: scale groups per row, columns and rows per step, warps."""

    groups: int
    block: int
    rows: int
    warps: int

    def programs(self, rows: int) -> int:
        return triton.cdiv(rows, self.rows) * self.groups


def quant_layout(cols: int, group: int) -> QuantLayout:
    """The `QuantLayout` of a quantization of rows of `cols` columns with `group` columns per scale (0: per row)."""
    if group and group & (group - 1):
        raise ValueError(f"quantize_fp8: group {group} is not a power of two")
    groups = triton.cdiv(cols, group) if group else 1
    block = min(group, 1024) if group else min(triton.next_power_of_2(max(cols, 1)), 1024)
    return QuantLayout(groups, block, max(1, QUANT_TILE // block), 4)


class QuantLaunch:
    """`quantize_fp8` of one (rows, cols, row stride, group, input dtype and alignment), bound once.

    Writes into the caller's buffers `pieces` = (fp8 [rows·cols] row-major, fp32 scales [rows·groups]); `x` at
    binding may be a tensor or, for a buffer of the caller's workspace, its dtype.
    """

    def __init__(self, x: torch.Tensor | torch.dtype, rows: int, cols: int, stride_x: int, group: int) -> None:
        layout = quant_layout(cols, group)
        self.groups = groups = layout.groups
        self.pieces = ((FP8, rows * cols), (torch.float32, rows * groups))
        self._tail = (rows, cols, stride_x, cols, groups, group, layout.block, layout.rows)
        self._bound = BoundKernel(_quant_fp8_kernel, (layout.programs(rows),), (x, FP8, torch.float32, *self._tail),
                                  varying=3, num_warps=layout.warps, num_stages=1)

    @property
    def bound(self) -> BoundKernel:
        """The one launch, taking (x, q, scales)."""
        return self._bound

    def __call__(self, x, q, scales) -> None:
        self._bound.launch(x, q, scales)


def quantize_fp8(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton form of `quantize_rows` (group 0) and `quantize_blocks(x, 1, group)`: one launch, no host sync.

    x [R, C] contiguous float -> (fp8 [R, C], fp32 scales [R] for group 0, else [R, ⌈C/group⌉]).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8 wants a row-major 2-D tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    if group and group & (group - 1):
        raise ValueError(f"quantize_fp8: group {group} is not a power of two")
    rows, cols = x.shape
    q = torch.empty((rows, cols), device=x.device, dtype=FP8)
    groups = triton.cdiv(cols, group) if group else 1
    scales = torch.empty((rows, groups), device=x.device, dtype=torch.float32)
    if rows:
        QuantLaunch(x, rows, cols, x.stride(0), group)(x, q, scales)
    return q, (scales.view(rows) if not group else scales)
