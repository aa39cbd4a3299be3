"""Grouped GEMM at run time: the autograd Function over the forward, dX and dW kernels. Each kernel's config comes
from the tuned store (device, Triton version, shape, token count), else from the documented heuristic below.

A config that does not fuse its GEMM's permute (a tuned `fuse_permute=False`) is honoured: the op then gathers or
scatters with torch around the kernel, which is what was timed when that config won.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch

from tritune.kernels.grouped_gemm import grouped_gemm_dw, grouped_gemm_dx, grouped_gemm_forward, scheduled_dw_launch
from tritune.kernels.grouped_gemm_config import (
    KernelConfig,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    launch_config,
)

KERNELS = ("forward", "dX", "dW")


@dataclass(frozen=True)
class GroupedGemmConfigs:
    """The three kernels' configs for one GEMM, and where each came from (a store entry or "heuristic")."""

    forward: KernelConfigForward
    dX: KernelConfigBackward_dX  # noqa: N815 (the kernel's name)
    dW: KernelConfigBackward_dW  # noqa: N815
    origins: tuple[str, str, str] = ("heuristic", "heuristic", "heuristic")


def gemm_role(permute_x: bool, permute_y: bool) -> str:
    """The MoE GEMM a permute pattern belongs to: gate_up gathers X, down scatters Y."""
    if permute_x and permute_y:
        raise ValueError("a grouped GEMM permutes X or Y, never both")
    return "gate_up" if permute_x else "down" if permute_y else "plain"


def _tma_ok(device: torch.device, *row_elements: int) -> bool:
    """TMA needs Hopper or newer and rows of 16-byte multiples (2-byte elements: multiples of 8)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return all(n % 8 == 0 for n in row_elements)


def heuristic_configs(n: int, k: int, rows_per_expert: float, permute_x: bool, permute_y: bool,
                      device: torch.device) -> GroupedGemmConfigs:
    """The configs used for a shape never tuned (measured best or near-best on the H100 at 8192 tokens for
    Qwen3-30B-A3B and Mixtral in benchmarks/RESULTS.md):

    - forward: 128×256×64 tiles (BLOCK_SIZE_M 64 below 64 rows per expert; BLOCK_SIZE_N 128 when N < 256),
      8 warps, 3 stages; TMA for W, for X unless it is gathered, and for the store unless it is scattered;
    - dX: 128 rows × 256 output columns, reduction 64; TMA likewise;
    - dW where TMA serves every operand and N is a multiple of 128: the scheduled loop (`grouped_dw_scheduled`),
      128×256 of dW per tile, 64-row steps in 5 stages, N tiles in groups of 16 along K. In the op (gathers
      included), on the H100 at 1024-8192 tokens, it beat the plain kernel below on all twelve Qwen3-30B-A3B and
      DeepSeek-V2-Lite dW GEMMs (by 4-26%); on Mixtral at 4096 tokens it won gate_up and lost down by 5%, and the
      tuner picked it at 1024 and 8192 (RESULTS.md, thirteenth session);
    - other dW: 128×256 of dW per tile, 32 rows per reduction step in 5 stages, N tiles in groups of 8 along K,
      every load and the store through TMA where rows allow, the permute left to torch (index_select before the
      kernel). Measured on pre-gathered rows (`probe_grouped_dw.py`, H100, 8192 tokens): 32-row steps beat 64 by
      3-8% on both models, and the grouped order takes Mixtral's down dW from 3.27 to 2.86 ms (its X per expert
      outgrows the L2 when K tiles run fastest).
    Without a GPU (the interpreter) every tile is 32 and no TMA is used.
    """
    if device.type != "cuda":
        small = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, num_warps=4, num_stages=2, flatten=False)
        return GroupedGemmConfigs(
            KernelConfigForward(**small, permute_x=permute_x, permute_y=permute_y),
            KernelConfigBackward_dX(**small, permute_x=permute_x, permute_y=permute_y),
            KernelConfigBackward_dW(**small, permute_x=permute_x, permute_y=permute_y))
    tma_n, tma_k = _tma_ok(device, n), _tma_ok(device, k)
    tma = tma_n and tma_k
    bm = 64 if rows_per_expert < 64 else 128
    common = dict(num_warps=8, num_stages=3, flatten=False, permute_x=permute_x, permute_y=permute_y)
    fwd = KernelConfigForward(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=256 if n >= 256 else 128, BLOCK_SIZE_K=64, **common,
                              use_tma_load_w=tma, use_tma_load_x=tma_k and not permute_x,
                              use_tma_store=tma_n and not permute_y)
    dx = KernelConfigBackward_dX(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=256 if k >= 256 else 128, **common,
                                 use_tma_load_w=tma, use_tma_load_dy=tma_n and not permute_y,
                                 use_tma_store=tma_k and not permute_x)
    # dW leaves its permute to torch: a gathered operand read through pointers halves the kernel's speed (measured:
    # Mixtral gate_up dW 11.5 ms fused vs 5.7 ms on TMA-loaded, pre-gathered rows), far more than the gather costs.
    scheduled = tma and n % 128 == 0
    dw = KernelConfigBackward_dW(BLOCK_SIZE_M=64 if scheduled else 32, BLOCK_SIZE_N=128,
                                 BLOCK_SIZE_K=256 if k >= 256 else 128, num_warps=8, num_stages=5, flatten=False,
                                 permute_x=False, permute_y=False, use_tma_load_dy=tma_n, use_tma_load_x=tma_k,
                                 use_tma_store=tma, GROUP_SIZE_N=16 if scheduled else 8, scheduled=scheduled)
    return GroupedGemmConfigs(fwd, dx, dw)


@functools.lru_cache(maxsize=4096)
def _select(device: torch.device, num_experts: int, n: int, k: int, topk: int, tokens: int, dtype: torch.dtype,
            permute_x: bool, permute_y: bool) -> GroupedGemmConfigs:
    heuristic = heuristic_configs(n, k, tokens * topk / num_experts, permute_x, permute_y, device)
    role = gemm_role(permute_x, permute_y)
    if device.type != "cuda" or role == "plain":
        return heuristic
    from tritune.device import current_device
    from tritune.store.grouped_gemm_json import default_store
    from tritune.store.provenance import running_machine, warn_once

    info = current_device(device.index)
    machine = running_machine(device.index)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    chosen, origins = [], []
    for kernel, fallback in zip(KERNELS, (heuristic.forward, heuristic.dX, heuristic.dW), strict=True):
        found = default_store().lookup(info.name, info.triton_version, num_experts, n, k, topk, dtype_name, role,
                                       kernel, tokens, machine=machine)
        config, origin = fallback, "heuristic"
        if found is not None:
            try:
                config, origin = launch_config(kernel, found[0]), found[1]
            except ValueError as err:  # the file's format was fine, the kernel cannot take these fields
                warn_once(f"tritune: skipping tuned grouped-GEMM {found[1]}: {err}; using the heuristic")
        chosen.append(config)
        origins.append(origin)
    return GroupedGemmConfigs(*chosen, origins=tuple(origins))


def select_configs(x_rows: int, w: torch.Tensor, topk: int, permute_x: bool, permute_y: bool) -> GroupedGemmConfigs:
    """Configs for a grouped GEMM with weights w [E, N, K] over `x_rows` rows of X as given (tokens when permute_x,
    else grouped rows); cached per process (`reload_grouped_gemm_configs` clears it). An empty batch (an expert-parallel
    rank can get none) takes the 1-token configs: nothing launches, but the lookup wants a token count >= 1."""
    num_experts, n, k = w.shape
    tokens = max(1, x_rows if permute_x else x_rows // topk)
    return _select(w.device, num_experts, n, k, topk, tokens, w.dtype, permute_x, permute_y)


def reload_grouped_gemm_configs() -> None:
    """Forget cached choices (after tuning wrote new entries)."""
    _select.cache_clear()
    try:
        from tritune.store.grouped_gemm_json import reload_grouped_gemm_configs as reload_store
    except ImportError:
        return
    reload_store()


def _fit(config: KernelConfig, permute_x: bool, permute_y: bool) -> KernelConfig:
    """The config's fusion flags limited to the permutes this GEMM has (a config never permutes what is not)."""
    return dataclasses.replace(config, permute_x=config.permute_x and permute_x,
                               permute_y=config.permute_y and permute_y)


def _to_pair_order(grouped: torch.Tensor, gather: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Rows of a grouped-order result scattered to pair order (row g goes to gather[g])."""
    target = torch.empty_like(grouped) if out is None else out
    return target.index_copy_(0, gather.long(), grouped)


def run_forward(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int,
                permute_x: bool, permute_y: bool, config: KernelConfigForward,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Y [P, N] (into `out` when given): grouped, or pair order with permute_y; permutes the config does not fuse
    are done in torch."""
    cfg = _fit(config, permute_x, permute_y)
    if permute_x and not cfg.permute_x:
        x = x.index_select(0, gather.long() // topk)
    if permute_y and not cfg.permute_y:
        y = grouped_gemm_forward(x, w, m_sizes, cfg, topk=topk, gather_indices=gather)
        return _to_pair_order(y, gather, out)
    return grouped_gemm_forward(x, w, m_sizes, cfg, topk=topk, gather_indices=gather, out=out)


def run_dx(dy: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int,
           permute_x: bool, permute_y: bool, config: KernelConfigBackward_dX,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """dX [P, K] (into `out` when given): grouped, or pair order when the forward gathered X (sum over topk for
    token order)."""
    cfg = _fit(config, permute_x, permute_y)
    if permute_y and not cfg.permute_y:
        dy = dy.index_select(0, gather.long())
    if permute_x and not cfg.permute_x:
        dx = grouped_gemm_dx(dy, w, m_sizes, cfg, topk=topk, gather_indices=gather)
        return _to_pair_order(dx, gather, out)
    return grouped_gemm_dx(dy, w, m_sizes, cfg, topk=topk, gather_indices=gather, out=out)


def run_dw(x: torch.Tensor, dy: torch.Tensor, m_sizes: torch.Tensor, gather: torch.Tensor | None, topk: int,
           permute_x: bool, permute_y: bool, config: KernelConfigBackward_dW,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """dW [E, N, K] (into `out` when given) from X and dY in the layouts the forward saw and produced."""
    cfg = _fit(config, permute_x, permute_y)
    if cfg.scheduled:  # its padding copy gathers both operands from the layouts they are in
        return scheduled_dw_launch(x, dy, m_sizes, cfg, topk=topk, gather=gather, permute_x=permute_x,
                                   permute_y=permute_y, out=out)
    if permute_x and not cfg.permute_x:
        x = x.index_select(0, gather.long() // topk)
    if permute_y and not cfg.permute_y:
        dy = dy.index_select(0, gather.long())
    return grouped_gemm_dw(x, dy, m_sizes, cfg, topk=topk, gather_indices=gather, out=out)


class GroupedGemm(torch.autograd.Function):
    """Y = X·W[e]ᵀ per expert with gradients for X and W (m_sizes and gather_indices get none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather_indices: torch.Tensor | None,
                topk: int, permute_x: bool, permute_y: bool, configs: GroupedGemmConfigs | None) -> torch.Tensor:
        if configs is None:
            configs = select_configs(x.shape[0], w, topk, permute_x, permute_y)
        x, w = x.contiguous(), w.contiguous()
        ctx.save_for_backward(x, w, m_sizes, gather_indices)
        ctx.topk, ctx.permute_x, ctx.permute_y, ctx.configs = topk, permute_x, permute_y, configs
        return run_forward(x, w, m_sizes, gather_indices, topk, permute_x, permute_y, configs.forward)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, m_sizes, gather = ctx.saved_tensors
        bind_cuda_context(dy.device)
        dy = dy.contiguous()
        args = (m_sizes, gather, ctx.topk, ctx.permute_x, ctx.permute_y)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = run_dx(dy, w, *args, ctx.configs.dX)
            if ctx.permute_x:  # each token's row fed topk pairs: their gradients add up
                dx = dx.view(x.shape[0], ctx.topk, -1).sum(1, dtype=torch.float32).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = run_dw(x, dy, *args, ctx.configs.dW)
        return dx, dw, None, None, None, None, None, None


_CONTEXT_BOUND = threading.local()


def bind_cuda_context(device: torch.device) -> None:
    """Make the device's CUDA context current on this thread (autograd runs backward on its own threads).

    Triton builds TMA descriptors through the driver API, which needs a current context; a thread whose first CUDA
    work is that call has none yet ("invalid device context"). Recording an event goes through the runtime API,
    which binds the primary context; done once per thread and device.
    """
    if device.type != "cuda":
        return
    bound = getattr(_CONTEXT_BOUND, "devices", None)
    if bound is None:
        bound = _CONTEXT_BOUND.devices = set()
    if device.index not in bound:
        with torch.cuda.device(device):
            torch.cuda.Event().record()
        bound.add(device.index)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, gather_indices: torch.Tensor | None = None,
                 *, topk: int = 1, permute_x: bool = False, permute_y: bool = False,
                 configs: GroupedGemmConfigs | None = None) -> torch.Tensor:
    """Differentiable grouped GEMM.

    x [P, K] grouped (or [T, K] token order with permute_x); w [E, N, K]; m_sizes int32 [E]; gather_indices int32
    [P] (pair position of each grouped row; needed with a permute) -> Y [P, N] grouped (pair order with permute_y).
    configs=None picks the tuned configs for this device and shape, else the heuristic.
    """
    return GroupedGemm.apply(x, w, m_sizes, gather_indices, topk, permute_x, permute_y, configs)
