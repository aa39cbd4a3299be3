"""fp32 torch references of the grouped-GEMM kernels, with the same permute semantics (a loop over experts)."""

from __future__ import annotations

import torch


def _grouped_rows(t: torch.Tensor, gather_indices: torch.Tensor | None, divide: int) -> torch.Tensor:
    """t's rows in grouped order: row g is t[gather_indices[g] // divide] (t itself when not permuted)."""
    if gather_indices is None:
        return t.float()
    return t.float()[gather_indices.long() // divide]


def _to_pair_order(grouped: torch.Tensor, gather_indices: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(grouped)
    out[gather_indices.long()] = grouped
    return out


def _expert_slices(m_sizes: torch.Tensor):
    start = 0
    for e, count in enumerate(m_sizes.tolist()):
        yield e, slice(start, start + count)
        start += count


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *, topk: int = 1,
                           gather_indices: torch.Tensor | None = None, permute_x: bool = False,
                           permute_y: bool = False, topk_weights: torch.Tensor | None = None,
                           fuse_mul_post: bool = False) -> torch.Tensor:
    """Forward: x [P, K] grouped or [T, K] (permute_x); w [E, N, K] -> fp32 [P, N] grouped or pair order."""
    xg = _grouped_rows(x, gather_indices if permute_x else None, topk)
    y = torch.zeros((xg.shape[0], w.shape[1]), dtype=torch.float32, device=x.device)
    for e, rows in _expert_slices(m_sizes):
        y[rows] = xg[rows] @ w[e].float().T
    if fuse_mul_post:
        y *= topk_weights.reshape(-1).float()[gather_indices.long()][:, None]
    return _to_pair_order(y, gather_indices) if permute_y else y


def grouped_gemm_dx_reference(dy: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *, topk: int = 1,
                              gather_indices: torch.Tensor | None = None, permute_x: bool = False,
                              permute_y: bool = False) -> torch.Tensor:
    """dX: dy [P, N] grouped or pair order (permute_y); w [E, N, K] -> fp32 [P, K] grouped or pair order."""
    dyg = _grouped_rows(dy, gather_indices if permute_y else None, 1)
    dx = torch.zeros((dyg.shape[0], w.shape[2]), dtype=torch.float32, device=dy.device)
    for e, rows in _expert_slices(m_sizes):
        dx[rows] = dyg[rows] @ w[e].float()
    return _to_pair_order(dx, gather_indices) if permute_x else dx


def grouped_gemm_dw_reference(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, *, topk: int = 1,
                              gather_indices: torch.Tensor | None = None, permute_x: bool = False,
                              permute_y: bool = False) -> torch.Tensor:
    """dW: x as in the forward, dy as in dX -> fp32 [E, N, K]."""
    xg = _grouped_rows(x, gather_indices if permute_x else None, topk)
    dyg = _grouped_rows(dy, gather_indices if permute_y else None, 1)
    dw = torch.zeros((m_sizes.shape[0], dy.shape[1], x.shape[1]), dtype=torch.float32, device=x.device)
    for e, rows in _expert_slices(m_sizes):
        dw[e] = dyg[rows].T @ xg[rows]
    return dw
