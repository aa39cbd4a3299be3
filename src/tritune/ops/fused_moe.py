"""Run-time fused-MoE ops that pick their own kernels: the tuned CSV row for (SM count, shape, token bucket), else
a documented heuristic; the choice is cached per process until `reload_moe_configs()`.

Lookups go through `tritune.store.fmoe_csv.default_table()` (TRITUNE_CONFIG_FMOE, else the shipped files). A tuned
row whose kernel names do not parse, name the wrong kernel, quant or activation, fail `check_config`, or whose two
stages disagree on BLOCK_SIZE_M is skipped with a one-line warning, and the heuristic is used instead.

The heuristic (always 2-stage; from first H100 measurements), with m = tokens·topk/experts (mean pairs per expert):

- BLOCK_SIZE_M: 16 if m <= 16, 32 if m <= 32, 64 if m <= 128, else 128 (one sort serves both stages);
- stage 1: BLOCK_SIZE_N 64 if BLOCK_SIZE_M <= 32 else 128; BLOCK_SIZE_K 128 for fp8, 64 for bf16/fp16;
  GROUP_SIZE_M 8; 4 warps and 4 stages if BLOCK_SIZE_M <= 32, else 8 warps and 3 stages; no split-K;
- stage 2: as stage 1, but 4 stages whenever BLOCK_SIZE_M <= 64;
- BLOCK_SIZE_N and BLOCK_SIZE_K never exceed the next power of two (at least 16) of the dimension they tile, so
  tiny test shapes do not waste whole tiles; every heuristic config passes `check_config` for every quant type.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
import triton

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_launch import MoeLaunch
from tritune.store.fmoe_csv import (
    FmoeShape,
    FmoeTuned,
    default_table,
    reload_fmoe_configs,
    token_bucket,
)

__all__ = ["MoeChoice", "fused_moe", "fused_moe_a8w8", "fused_moe_a8w8_blockscale", "fused_moe_choice",
           "heuristic_moe_choice", "reload_moe_configs"]

_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class MoeChoice:
    """The kernels one fused-MoE call runs, and where they came from."""

    run_1stage: bool
    stage1: MoeConfig  # the 1-stage kernel's config when run_1stage
    stage2: MoeConfig | None  # None when run_1stage
    source: str  # "tuned: <file>, row N (line L)" or "heuristic"


def heuristic_moe_choice(tokens: int, model_dim: int, inter_dim: int, experts: int, topk: int,
                         quant: str) -> MoeChoice:
    """The documented fallback (see the module docstring): a 2-stage choice for `tokens` tokens of the shape."""
    if quant not in fm.QUANT_TYPES:
        raise ValueError(f"quant {quant!r}; expected one of {fm.QUANT_TYPES}")
    m = tokens * topk / experts
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 128 else 128
    small = bm <= 32
    bk = 128 if quant != "none" else 64

    def fit(block: int, dim: int) -> int:
        return min(block, max(16, triton.next_power_of_2(dim)))

    stage1 = MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=fit(64 if small else 128, inter_dim),
                       BLOCK_SIZE_K=fit(bk, model_dim), GROUP_SIZE_M=8, num_warps=4 if small else 8,
                       num_stages=4 if small else 3, KSPLIT=1)
    stage2 = MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=fit(64 if small else 128, model_dim),
                       BLOCK_SIZE_K=fit(bk, inter_dim), GROUP_SIZE_M=8, num_warps=4 if small else 8,
                       num_stages=4 if bm <= 64 else 3, KSPLIT=1)
    return MoeChoice(run_1stage=False, stage1=stage1, stage2=stage2, source="heuristic")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """SMs of `device`; without a GPU, the interpreter stand-in's (H100 limits)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    from tritune.tuning.device import current_device

    return current_device().sm_count


# (cu_num, shape_key, token bucket) -> choice: after the first call of a bucket, an op does one dict lookup.
_CHOSEN: dict[tuple[int, tuple, int], MoeChoice] = {}


def reload_moe_configs() -> None:
    """Forget every cached choice and bound launch; re-read TRITUNE_CONFIG_FMOE and the tuned files on the next call."""
    _CHOSEN.clear()
    _PLANS.clear()
    reload_fmoe_configs()


def _call_shape(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                activation: str, quant: str, doweight_stage1: bool) -> FmoeShape:
    """The FmoeShape of a call; ValueError (one line) for an unknown activation, quant or dtype, or wrong ranks."""
    if activation not in fm.ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; expected one of {fm.ACTIVATIONS}")
    if quant not in fm.QUANT_TYPES:
        raise ValueError(f"quant {quant!r}; expected one of {fm.QUANT_TYPES}")
    if hidden_states.dim() != 2 or hidden_states.dtype not in _DTYPE_NAME:
        raise ValueError(f"hidden_states must be 2-D bf16/fp16, got {tuple(hidden_states.shape)} "
                         f"{hidden_states.dtype}")
    if w1.dim() != 3 or w2.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(f"w1, w2 must be 3-D and topk_ids 2-D, got {tuple(w1.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    dtype = _DTYPE_NAME[hidden_states.dtype]
    q_dtype = "fp8" if quant != "none" else dtype
    experts, model_dim, inter_dim = w2.shape
    return FmoeShape(token=max(hidden_states.shape[0], 1), model_dim=model_dim, inter_dim=inter_dim,
                     expert=experts, topk=topk_ids.shape[1], act_type=activation, dtype=dtype, q_dtype_a=q_dtype,
                     q_dtype_w=q_dtype, q_type=quant, use_g1u1=fm.gated_of(w1, w2),
                     doweight_stage1=bool(doweight_stage1))


def _parse_stage(name: str, kernel: str, quant: str, activation: str) -> MoeConfig:
    """The config of a tuned kernel name; ValueError when it is not `kernel` for this quant and activation."""
    kind, config = MoeConfig.parse_name(name)
    prefix = f"moe_{kernel}_{quant}_{activation}_"
    if kind != kernel or not name.startswith(prefix):
        raise ValueError(f"kernel name {name!r} is not a {prefix}* kernel")
    fm.check_config(config, kernel, quant)
    return config


def _tuned_choice(row: FmoeTuned, origin: str) -> MoeChoice:
    """The choice a tuned row names; ValueError (one line) when the row cannot be run."""
    quant, activation = row.shape.q_type, row.shape.act_type
    if row.run_1stage:
        return MoeChoice(True, _parse_stage(row.kernelName1, "1stage", quant, activation), None, f"tuned: {origin}")
    stage1 = _parse_stage(row.kernelName1, "stage1", quant, activation)
    stage2 = _parse_stage(row.kernelName2, "stage2", quant, activation)
    if stage1.BLOCK_SIZE_M != stage2.BLOCK_SIZE_M:
        raise ValueError(f"stages disagree on BLOCK_SIZE_M ({stage1.BLOCK_SIZE_M} vs {stage2.BLOCK_SIZE_M})")
    return MoeChoice(False, stage1, stage2, f"tuned: {origin}")


def _choose(cu_num: int, shape: FmoeShape, tokens: int) -> MoeChoice:
    table = default_table()
    row = table.lookup(cu_num, shape, tokens)
    if row is not None:
        origin = table.origin(row)
        try:
            return _tuned_choice(row, origin)
        except ValueError as err:
            warnings.warn(f"tritune: skipping tuned fused-MoE row {origin}: {err}; using the heuristic",
                          stacklevel=4)
    return heuristic_moe_choice(tokens, shape.model_dim, shape.inter_dim, shape.expert, shape.topk, shape.q_type)


def fused_moe_choice(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, *,
                     activation: str = "silu", quant: str = "none", doweight_stage1: bool = False) -> MoeChoice:
    """The kernels `fused_moe` runs for these arguments (see `fused_moe` for shapes); cached per process."""
    shape = _call_shape(hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1)
    cu_num = _sm_count(hidden_states.device)
    key = (cu_num, shape.shape_key(), token_bucket(shape.token))
    found = _CHOSEN.get(key)
    if found is None:
        found = _CHOSEN[key] = _choose(cu_num, shape, shape.token)
    return found


# Bound launches per call signature: what the kernels were specialized on (shapes, strides, dtypes, 16-byte
# alignment, device), the call's options and the explicit choice, if any. A hit costs this key and the launches.
_PLANS: dict[tuple, MoeLaunch] = {}
_PLANS_MAX = 4096  # distinct call signatures kept; past that the cache starts afresh


def _signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _plan(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
          topk_ids: torch.Tensor, w1_scale, w2_scale, activation: str, quant: str, doweight_stage1: bool,
          choice: MoeChoice | None) -> MoeLaunch:
    for name, t in (("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if t is not None and t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}: every tensor must be "
                             f"on one device")
    if choice is None:
        choice = fused_moe_choice(hidden_states, w1, w2, topk_ids, activation=activation, quant=quant,
                                  doweight_stage1=doweight_stage1)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    stage2 = None if choice.run_1stage else choice.stage2
    with torch.cuda.device(hidden_states.device) if hidden_states.is_cuda else contextlib.nullcontext():
        return MoeLaunch(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, stage1=choice.stage1,
                         stage2=stage2, activation=activation, quant=quant, doweight_stage1=doweight_stage1)


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", quant: str = "none",
              w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              doweight_stage1: bool = False, out: torch.Tensor | None = None,
              choice: MoeChoice | None = None) -> torch.Tensor:
    """The MoE layer with tuned (or heuristic) kernels.

    hidden_states [T, D] bf16/fp16; w1 [E, 2I, D] (gate rows, then up rows) or [E, I, D] (no gate); w2 [E, D, I];
    topk_weights fp32 [T, topk]; topk_ids int [T, topk] -> [T, D] in hidden's dtype (into `out` when given, a
    contiguous [T, D] tensor of that dtype). For quant "per_token" / "per_1x128" the weights are fp8 e4m3 with the
    scales of `kernels.fused_moe.quantize_weights`; the activations are quantized inside. `choice` forces the
    kernels (the tuner times candidates through it). Shape and dtype errors are one-line ValueErrors.

    The first call of a call signature picks the kernels and binds their launches; later calls only launch
    (4-6 launches and 2 allocations for bf16; no host synchronisation, so the call can be captured in a CUDA graph).
    """
    tokens = hidden_states.shape[0]
    if out is None:
        out = torch.empty(tokens, w2.shape[1], device=hidden_states.device, dtype=hidden_states.dtype)
        out_key = None
    else:
        if tuple(out.shape) != (tokens, w2.shape[1]) or out.dtype != hidden_states.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{tokens}, {w2.shape[1]}] {hidden_states.dtype} tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        out_key = out.device
    if tokens == 0:  # an empty batch: nothing to route (the launchers divide by the token count)
        _call_shape(hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1)
        return out
    device = hidden_states.device
    addresses = (hidden_states.data_ptr(), w1.data_ptr(), w2.data_ptr(), topk_weights.data_ptr(),
                 0 if w1_scale is None else w1_scale.data_ptr(), 0 if w2_scale is None else w2_scale.data_ptr(),
                 out.data_ptr(), topk_ids.data_ptr())
    key = (device, hidden_states.shape, hidden_states.stride(), hidden_states.dtype, w1.shape, w1.stride(), w1.dtype,
           w1.device, w2.shape, w2.stride(), w2.dtype, w2.device, topk_weights.shape, topk_weights.stride(),
           topk_weights.dtype, topk_weights.device, topk_ids.shape, topk_ids.stride(), topk_ids.dtype,
           topk_ids.device, _signature(w1_scale), _signature(w2_scale), activation, quant, doweight_stage1,
           tuple(a & 15 for a in addresses), out_key, choice)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, activation,
                                   quant, doweight_stage1, choice)
    args = (hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, out,
            addresses if device.type == "cuda" else None)
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        with torch.cuda.device(device):
            return plan(*args)
    return plan(*args)


def fused_moe_a8w8(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w1_scale: torch.Tensor, w2_scale: torch.Tensor, *,
                   activation: str = "silu", doweight_stage1: bool = False) -> torch.Tensor:
    """`fused_moe` with fp8 per-token activations and per-channel fp8 weights (w1_scale fp32 [E, 2I or I],
    w2_scale fp32 [E, D])."""
    return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation, quant="per_token",
                     w1_scale=w1_scale, w2_scale=w2_scale, doweight_stage1=doweight_stage1)


def fused_moe_a8w8_blockscale(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1_scale: torch.Tensor,
                              w2_scale: torch.Tensor, *, activation: str = "silu",
                              doweight_stage1: bool = False) -> torch.Tensor:
    """`fused_moe` with fp8 per 1×128 activations and 128×128-block fp8 weights (w1_scale fp32 [E, ⌈2I/128⌉,
    ⌈D/128⌉], w2_scale fp32 [E, ⌈D/128⌉, ⌈I/128⌉])."""
    return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation, quant="per_1x128",
                     w1_scale=w1_scale, w2_scale=w2_scale, doweight_stage1=doweight_stage1)
