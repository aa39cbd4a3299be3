"""MXFP4 scales re-laid for TMA: what lets the swapped MXFP4 GEMM prefetch its e8m0 codes with its packed weights.

Why: the swapped GEMM (fused_moe._mxfp4_swap_dot) reads a [64, 4]-byte tile of codes every 128-wide K step. As byte
loads Triton 3.6 leaves them outside its software pipeline, so every K step waits on them; TMA could prefetch them,
but it needs 16-byte rows, and the codes' rows ([E, N, K/32]) give 4 bytes a row a step. Re-laid once, as a weight is
at load time, each (expert, 64-row block, K step) becomes one 256-byte record, so a BLOCK_N = 64·j tile's codes of
one K step are j records: one TMA box [j, 1, 256] over the view [E·NB, KB, 256], reshaped to [64·j, 4] in registers.
Compiled for sm90 the record's shared-memory load lands straight in the decode's layout (no layout conversion); on
the H100 a toy of the K loop ran 4-9% faster on gpt-oss-120b's GEMMs at 1-64 tokens, matching a decode with no scale
loads at all (benchmarks/probe_mxfp4_scale_tma.py, 2026-11-27). The records are block-major, a block's K steps
adjacent, so a program's records are one contiguous run, as the prepared weights' chunks are
(kernels/mxfp4_swizzle.py; until the twentieth session they were K-step major, a program's records 256 bytes out of
every ⌈N/64⌉·256).

The layout: records[e, nb, kb, r·4 + j] = min(codes[e, nb·64 + r, kb·4 + j], 193), 127 (scale 1) past N or K.
Codes past 193 are stored as 193: the bf16 decode reads 193 as inf (past the folded decode's exact range, as
before), and with no clamp left in the kernel its K step is 12 instructions shorter (`mxfp4.e8m0_to_bf16_folded`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECORD_ROWS = 64  # weight rows a record covers (a wgmma's M)
RECORD_K = 128  # K a record covers: 4 codes a row; the GEMM's BLOCK_SIZE_K must be this
CODES_PER_ROW = RECORD_K // 32
RECORD_BYTES = RECORD_ROWS * CODES_PER_ROW  # 256: a TMA box's inner dimension
PAD_CODE = 127  # scale 1: past K the packed codes are 0, so the products stay 0
MAX_CODE = 193  # codes past this are stored as this: the folded bf16 decode's inf (kernels/mxfp4.py)


def scale_records(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 codes uint8 [E, N, K/32] -> records uint8 [E, ⌈N/64⌉, ⌈K/128⌉, 256] (module docstring), contiguous."""
    if codes.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"scale_records: want uint8 e8m0 codes [E, N, K/32], got {codes.dtype} {tuple(codes.shape)}")
    e, n, kc = codes.shape
    nb, kb = -(-n // RECORD_ROWS), -(-kc // CODES_PER_ROW)
    full = torch.full((e, nb * RECORD_ROWS, kb * CODES_PER_ROW), PAD_CODE, dtype=torch.uint8, device=codes.device)
    full[:, :n, :kc] = codes.clamp(max=MAX_CODE)
    full = full.reshape(e, nb, RECORD_ROWS, kb, CODES_PER_ROW).permute(0, 1, 3, 2, 4)
    return full.reshape(e, nb, kb, RECORD_BYTES).contiguous()


def records_shape(experts: int, rows: int, k: int) -> tuple[int, int, int, int]:
    """The records' shape for a weight of `experts` x [rows, K] (K in elements)."""
    return experts, -(-rows // RECORD_ROWS), -(-k // RECORD_K), RECORD_BYTES


def records_box(tile_rows: int) -> list[int]:
    """One K step's records of a tile of `tile_rows` rows (a multiple of 64) in `records_view`: one TMA box."""
    return [tile_rows // RECORD_ROWS, 1, RECORD_BYTES]


def records_view(records: torch.Tensor) -> torch.Tensor:
    """The records [E, NB, KB, 256] as the TMA view [E·NB, KB, 256]."""
    e, nb, kb, width = records.shape
    return records.view(e * nb, kb, width)


@dataclass(frozen=True, eq=False)  # identity: the op keys its per-call caches on the object
class Mxfp4Scales:
    """One MXFP4 weight's scales in both layouts: `codes` [E, N, K/32] (every MXFP4 kernel reads these) and
    `records` (scale_records: the swapped GEMM's TMA path, config SCALE_TMA). Made once per weight, at load time, by
    `prepare_mxfp4_scales`; the fused-MoE op and stage functions take it wherever they take the codes."""

    codes: torch.Tensor
    records: torch.Tensor

    def __post_init__(self) -> None:
        want = records_shape(self.codes.shape[0], self.codes.shape[1], self.codes.shape[2] * 32)
        if tuple(self.records.shape) != want or self.records.dtype != torch.uint8 or not self.records.is_contiguous():
            raise ValueError(f"Mxfp4Scales: records must be contiguous uint8 {want} for codes "
                             f"{tuple(self.codes.shape)}, got {self.records.dtype} {tuple(self.records.shape)}")
        if self.records.device != self.codes.device:
            raise ValueError(f"Mxfp4Scales: codes on {self.codes.device}, records on {self.records.device}")


def prepare_mxfp4_scales(codes: torch.Tensor) -> Mxfp4Scales:
    """The codes and their records, for a weight's lifetime: pass the result as w1_scale / w2_scale. If the codes
    change in place afterwards, prepare again (the records are a copy)."""
    return Mxfp4Scales(codes, scale_records(codes))


def split_scales(scale: torch.Tensor | Mxfp4Scales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(codes, records or None) of a scale argument that may be either form."""
    if isinstance(scale, Mxfp4Scales):
        return scale.codes, scale.records
    return scale, None
