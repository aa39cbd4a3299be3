"""Run-time GEMM ops that pick their own config: the tuned shape file of (N, K) (its exact M, else a cost estimate
over the configs tuned at the neighbouring M), else the documented rule table of `tritune.ops.heuristics`.

Lookups go through `tritune.store.gemm_json.default_store()` (cached per process; `reload_configs()` re-reads
the files and TRITUNE_CONFIG_DIR). A shape file tuned on another GPU is skipped with one warning (another Triton
version: used, with one warning). The per-device default file the tuner writes (the most common winner) is not
used at run time: the rule table, calibrated on the tuned files, serves shapes nobody tuned.

Off the tuned grid (`ops.offgrid.choose_gemm_offgrid`): every config tuned at the nearest M below and above is
scaled by `ops.cost_model` (tiles, waves, bytes) from the M it was measured at to the asked M, its launches' host
cost added, and the rule-table config competes on its model estimate; the least estimated time wins.

C is bf16 unless `out_dtype=torch.float16` (or an fp16 `out`): an fp16 C is served by the fp16-output tunes
(`...-GEMM-<TAG>-OUT_FP16-N=..-K=...json`), never by the bf16 ones; an `out` of any other dtype by the bf16 ones.
Only bf16-output misses are tuned online (TRITUNE_ONLINE_TUNE).
"""

from __future__ import annotations

import functools

import torch

from tritune.kernels import gemm as gk
from tritune.ops.heuristics import gemm_heuristic
from tritune.ops.offgrid import choose_gemm_offgrid, gemm_entries
from tritune.ops.online import GemmRequest, maybe_tune
from tritune.store.gemm_json import default_store
from tritune.store.gemm_json import reload_configs as _reload_store
from tritune.store.provenance import Machine, running_machine

__all__ = ["gemm", "gemm_a8w8", "gemm_a8w8_blockscale", "select_config", "heuristic_config", "reload_configs"]


def heuristic_config(kernel: str, M: int, N: int, K: int, sm_count: int = 132) -> gk.GemmConfig:
    """The rule-table config for a shape nobody tuned (`tritune.ops.heuristics.gemm_heuristic`, H100 limits)."""
    return gemm_heuristic(kernel, M, N, K, sm_count)


@functools.cache
def _device_facts(index: int) -> tuple[str, int, int, tuple[int, int], Machine]:
    """(slug, SMs, shared memory per block, capability, Machine) of GPU `index`, or of the interpreter (-1)."""
    from tritune.device import current_device

    info = current_device(index) if index >= 0 else current_device()
    return info.slug, info.sm_count, info.max_shared_mem, info.capability, running_machine(
        index if index >= 0 else None)


# (kernel, M, N, K, device, output dtype name) -> (config, source): the hot path of an op is one dict lookup.
_SELECTED: dict[tuple, tuple[gk.GemmConfig, str]] = {}


def reload_configs() -> None:
    """Forget every cached choice and bound launch, and re-read the config files (and TRITUNE_CONFIG_DIR)."""
    _SELECTED.clear()
    _PLANS.clear()
    _reload_store()


def _out_name(dtype: torch.dtype) -> str:
    """The output dtype whose tunes serve a C of `dtype`: fp16's for fp16, bf16's for any other."""
    return "fp16" if dtype == torch.float16 else "bf16"


def select_config(kernel: str, M: int, N: int, K: int, device: torch.device,
                  out_dtype: torch.dtype = torch.bfloat16) -> tuple[gk.GemmConfig, str]:
    """The config an op writing C in `out_dtype` will use and where it came from (a file and bucket, or
    'heuristic'). `device` may be a torch.device or its name ("cuda:0", "cpu"); `out_dtype` is one the ops write
    (torch.bfloat16 or torch.float16), as `gemm(..., out_dtype=)` checks it: "fp16" would answer for bf16's files."""
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    device = torch.device(device)
    out = _out_name(out_dtype)
    key = (kernel, M, N, K, device, out)
    found = _SELECTED.get(key)
    if found is None:
        found = _SELECTED[key] = _select(kernel, M, N, K, device, out)
    return found


def _select(kernel: str, M: int, N: int, K: int, device: torch.device, out: str = "bf16",
            online: bool = True) -> tuple[gk.GemmConfig, str]:
    index = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" \
        else -1
    slug, sms, max_shared, capability, machine = _device_facts(index)
    rule = gemm_heuristic(kernel, M, N, K, sms, max_shared, capability=capability)
    found = default_store().shape_entries(slug, gk.TAGS[kernel], N, K, machine=machine, out_dtype=out)
    if found is not None:
        path, by_M = found
        entries = gemm_entries(by_M)
        if entries:
            config, why = choose_gemm_offgrid(kernel, M, N, K, entries, sms, heuristic=rule)
            return config, f"shape file {path}: {why}"
    # TRITUNE_ONLINE_TUNE=1 tunes a miss; its requests (and files) are bf16-output only.
    if online and out == "bf16" and maybe_tune("gemm", GemmRequest(kernel, M, N, K, index)):
        reload_configs()
        return _select(kernel, M, N, K, device, out, online=False)
    return rule, "heuristic"


# Bound launches per call signature: everything a launch was specialized on (shapes, strides, dtypes, devices,
# 16-byte alignment) plus the explicit config, if any. A hit costs building this key and the launches themselves.
_PLANS: dict[tuple, gk.GemmLaunch] = {}
_PLANS_MAX = 4096  # distinct call signatures kept; past that the cache starts afresh (serving sees a few hundred)


def _plan(kernel: str, a: torch.Tensor, b: torch.Tensor, a_scale, b_scale, out: torch.Tensor,
          config: gk.GemmConfig | None) -> gk.GemmLaunch:
    for name, t in (("B", b), ("a_scale", a_scale), ("b_scale", b_scale), ("out", out)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, A on {a.device}: every tensor must be on one device")
    M, K = a.shape
    N = b.shape[0]
    if config is None:
        config, _ = select_config(kernel, M, N, K, a.device, out.dtype)
    if config.GLUON and not gk.gluon_available(a.device):  # a file tuned on Hopper, read where Gluon cannot run
        config = _off_gluon(config, {"WARP_SPECIALIZE": False})  # Triton's own may be absent where Gluon is
    if (config.PERSISTENT_TMA or config.GLUON) and not gk.tma_compatible(a, b, out):
        config = _off_gluon(config, {"PERSISTENT_TMA": False, "WARP_SPECIALIZE": False, "EPILOGUE_SUBTILE": False})
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    if a.is_cuda:
        with torch.cuda.device(a.device):
            return gk.GemmLaunch(kernel, a, b, a_scale, b_scale, out, config)
    return gk.GemmLaunch(kernel, a, b, a_scale, b_scale, out, config)


def _off_gluon(config: gk.GemmConfig, more: dict) -> gk.GemmConfig:
    """`config` on the Triton kernels: GLUON off (and `more`), a tile two powers of two wide (192, 96: Gluon's
    only) cut to the larger one, and no K split (the warp-specialised block-scaled Gluon kernel's)."""
    bn = config.BLOCK_SIZE_N
    return gk.GemmConfig(**{**config.__dict__, **more, "GLUON": False, "NUM_KSPLIT": 1,
                            "BLOCK_SIZE_N": 1 << (bn.bit_length() - 1)})


_OUT_DTYPES = frozenset(gk.OUT_DTYPES.values())


def _run(kernel: str, a: torch.Tensor, b: torch.Tensor, a_scale, b_scale, out, config,
         out_dtype: torch.dtype | None) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"A and B must be 2-D, got A{tuple(a.shape)} B{tuple(b.shape)}")
    device = a.device
    if out is None:
        out_key = torch.bfloat16 if out_dtype is None else out_dtype
        if out_key not in _OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
        out = torch.empty(a.shape[0], b.shape[0], device=device, dtype=out_key)
    else:
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out is {out.dtype} but out_dtype is {out_dtype}")
        out_key = (out.shape, out.stride(), out.dtype, out.device)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if a_scale is None:
        scale_key, psa, psb = None, pa, pa  # never read by the unquantized kernel
    else:
        psa, psb = a_scale.data_ptr(), b_scale.data_ptr()
        scale_key = (a_scale.shape, a_scale.stride(), a_scale.dtype, a_scale.device, psa & 15,
                     b_scale.shape, b_scale.stride(), b_scale.dtype, b_scale.device, psb & 15)
    key = (kernel, config, a.shape, a.stride(), a.dtype, device, b.shape, b.stride(), b.dtype, b.device,
           pa & 15, pb & 15, pc & 15, scale_key, out_key)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(kernel, a, b, a_scale, b_scale, out, config)
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        with torch.cuda.device(device):
            _launch(plan, a, b, a_scale, b_scale, out, pa, pb, psa, psb, pc)
    else:
        _launch(plan, a, b, a_scale, b_scale, out, pa, pb, psa, psb, pc)
    return out


def _launch(plan: gk.GemmLaunch, a, b, a_scale, b_scale, out, pa: int, pb: int, psa: int, psb: int, pc: int) -> None:
    if plan.takes_addresses:
        plan(pa, pb, psa, psb, pc)
    else:
        plan(a, b, a_scale, b_scale, out)


def gemm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, config: gk.GemmConfig | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A [M, K] · B [N, K]ᵀ for bf16/fp16/fp32 operands -> [M, N] in `out_dtype` (torch.bfloat16 when None, or
    torch.float16), or into `out` (`out_dtype`, if given, must be its dtype)."""
    return _run("bf16", a, b, None, None, out, config, out_dtype)


def gemm_a8w8(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
              out: torch.Tensor | None = None, config: gk.GemmConfig | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp8 e4m3 A [M, K] (per-token scales [M]) · B [N, K]ᵀ (per-channel scales [N]) -> [M, N] in `out_dtype`
    (bf16 default, or fp16), or into `out`."""
    return _run("a8w8", a, b, a_scale, b_scale, out, config, out_dtype)


def gemm_a8w8_blockscale(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
                         out: torch.Tensor | None = None, config: gk.GemmConfig | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp8 A [M, K] with scales [M, ⌈K/128⌉] · B [N, K]ᵀ with scales [⌈N/128⌉, ⌈K/128⌉] -> [M, N] in `out_dtype`
    (bf16 default, or fp16), or into `out`."""
    return _run("a8w8_blockscale", a, b, a_scale, b_scale, out, config, out_dtype)
