"""fp8 e4m3 quantization in the layouts the GEMM kernels read: per token, per channel, per 1×128, per 128×128."""

from __future__ import annotations

import torch
import triton

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
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_EPS)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gr * block_rows, gc * block_cols)
    return q[:rows, :cols].to(FP8).contiguous(), scale.contiguous()
