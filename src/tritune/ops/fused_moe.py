"""Run-time fused-MoE ops that pick their own kernels: the tuned CSV rows of (SM count, shape) — the row tuned at
this token count, else a cost estimate over the rows tuned at the neighbouring counts — else the documented rule
table of `tritune.ops.heuristics`; the choice is cached per (SM count, shape, token count) until
`reload_moe_configs()`.

Lookups go through `tritune.store.fmoe_table.default_table()` (TRITUNE_CONFIG_FMOE, else the shipped files). A tuned
row whose kernel names do not parse, name the wrong kernel, quant or activation, fail `check_config`, or whose two
stages disagree on BLOCK_SIZE_M or a plan-level option (`check_plan`) is skipped with a one-line warning; rows tuned
on another GPU are skipped with one warning (another Triton version: used, with one warning).

Off the tuned grid (`ops.offgrid.choose_moe_offgrid`): every plan (1-stage config, or stage-1 + stage-2 configs)
tuned at the nearest token counts below and above is scaled by `ops.cost_model` (experts touched, blocks per
expert, tiles, waves, weight bytes) from the count it was measured at to the asked one, its launches' host cost
added, and the rule table's plan competes on its model estimate; the least estimated time wins. Where every tuned
count is more than `offgrid.MOE_FAR_TOKENS` times away, the rule table's plan is taken without the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from tritune import knobs
from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_launch import MoeLaunch
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.mxfp4_records import Mxfp4Scales, split_scales
from tritune.kernels.mxfp4_swizzle import Mxfp4Weights, split_weights
from tritune.ops.heuristics import moe_heuristic
from tritune.ops.offgrid import MoeRow, choose_moe_offgrid
from tritune.ops.online import MoeRequest, maybe_tune
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.fmoe_table import default_table, reload_fmoe_configs
from tritune.store.provenance import Machine, running_machine

__all__ = ["MoeChoice", "fused_moe", "fused_moe_a8w8", "fused_moe_a8w8_blockscale", "fused_moe_choice",
           "heuristic_moe_choice", "reload_moe_configs"]

_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}
OP_QUANTS = fm.ALL_QUANTS  # what the op takes (the tuner too)


@dataclass(frozen=True)
class MoeChoice:
    """The kernels one fused-MoE call runs, and where they came from."""

    run_1stage: bool
    stage1: MoeConfig  # the 1-stage kernel's config when run_1stage
    stage2: MoeConfig | None  # None when run_1stage
    source: str  # "tuned: <file>, row N (line L)" or "heuristic"

    @property
    def w2_config(self) -> MoeConfig:
        """The config of the kernel that reads w2 (and its scales): stage 2's, or the 1-stage kernel's."""
        return self.stage1 if self.run_1stage else self.stage2


def heuristic_moe_choice(tokens: int, model_dim: int, inter_dim: int, experts: int, topk: int, quant: str, *,
                         sm_count: int = 132, max_shared: int = 232448, gated: bool = True,
                         scale_records: bool = True, deterministic: bool = False, gluon: bool = True) -> MoeChoice:
    """The rule table's choice (`tritune.ops.heuristics.moe_heuristic`) for `tokens` tokens of the shape
    (`scale_records` False: MXFP4 scales as codes only; `deterministic`: never a plan that sums with atomics;
    `gluon` False: never the Gluon stage kernels)."""
    if quant not in OP_QUANTS:
        raise ValueError(f"quant {quant!r}; expected one of {OP_QUANTS}")
    run_1stage, stage1, stage2 = moe_heuristic(tokens, model_dim, inter_dim, experts, topk, quant, sm_count,
                                               max_shared, gated=gated, scale_records=scale_records,
                                               one_stage=not deterministic, gluon=gluon and HAS_GLUON_HOPPER,
                                               atomics=not deterministic)
    return MoeChoice(run_1stage, stage1, stage2, "heuristic")


@functools.cache
def _device_facts(index: int) -> tuple[int, int, Machine]:
    """(SMs, shared memory per block, Machine) of GPU `index`, or of the interpreter stand-in (-1)."""
    from tritune.device import current_device

    info = current_device(index) if index >= 0 else current_device()
    return info.sm_count, info.max_shared_mem, running_machine(index if index >= 0 else None)


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


# (device, shape_key, tokens) -> choice: after the first call of a token count, an op does one dict lookup.
_CHOSEN: dict[tuple[int, tuple, int], MoeChoice] = {}


def reload_moe_configs() -> None:
    """Forget every cached choice and bound launch; re-read TRITUNE_CONFIG_FMOE and the tuned files on the next call."""
    _CHOSEN.clear()
    _PLANS.clear()
    _SCALES_IN_RANGE.clear()
    _SCALE_FORMS.clear()
    reload_fmoe_configs()


def _call_shape(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                activation: str, quant: str, doweight_stage1: bool) -> FmoeShape:
    """The FmoeShape of a call; ValueError (one line) for an unknown activation, quant or dtype, or wrong ranks."""
    if activation not in fm.ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; expected one of {fm.ACTIVATIONS}")
    if quant not in OP_QUANTS:
        raise ValueError(f"quant {quant!r}; expected one of {OP_QUANTS}")
    if hidden_states.dim() != 2 or hidden_states.dtype not in _DTYPE_NAME:
        raise ValueError(f"hidden_states must be 2-D bf16/fp16, got {tuple(hidden_states.shape)} "
                         f"{hidden_states.dtype}")
    if w1.dim() != 3 or w2.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(f"w1, w2 must be 3-D and topk_ids 2-D, got {tuple(w1.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    dtype = _DTYPE_NAME[hidden_states.dtype]
    experts, model_dim, inter_dim = w2.shape
    q_type = quant
    if quant in fm.MXFP4_QUANTS:  # two e2m1 values per byte along K; activations in dtype, or fp8 per token
        inter_dim *= 2
        q_type, q_dtype_w, gated = fm.MXFP4, "fp4x2", w1.shape[1] == 2 * inter_dim
        q_dtype_a = "fp8" if quant == fm.MXFP4_A8 else dtype
    else:
        q_dtype_a = q_dtype_w = "fp8" if quant != "none" else dtype
        gated = fm.gated_of(w1, w2)
    return FmoeShape(token=max(hidden_states.shape[0], 1), model_dim=model_dim, inter_dim=inter_dim,
                     expert=experts, topk=topk_ids.shape[1], act_type=activation, dtype=dtype, q_dtype_a=q_dtype_a,
                     q_dtype_w=q_dtype_w, q_type=q_type, use_g1u1=gated, doweight_stage1=bool(doweight_stage1))


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
    quant, activation = row.shape.quant, row.shape.act_type
    if row.run_1stage:
        return MoeChoice(True, _parse_stage(row.kernelName1, "1stage", quant, activation), None, f"tuned: {origin}")
    stage1 = _parse_stage(row.kernelName1, "stage1", quant, activation)
    stage2 = _parse_stage(row.kernelName2, "stage2", quant, activation)
    fm.check_plan(stage1, stage2, quant)  # what the stages share: BLOCK_SIZE_M (one sort), SORTED_INTER, TOPK_ATOMIC
    return MoeChoice(False, stage1, stage2, f"tuned: {origin}")


def sums_with_atomics(choice: MoeChoice) -> bool:
    """Whether a plan adds into its output in whatever order its programs run (the 1-stage kernels, TOPK_ATOMIC),
    so its bits may differ from run to run; TRITUNE_DETERMINISTIC keeps the op off such plans."""
    return choice.run_1stage or bool(choice.stage2.TOPK_ATOMIC)


def _choose(index: int, shape: FmoeShape, tokens: int, online: bool = True) -> MoeChoice:
    cu_num, max_shared, machine = _device_facts(index)
    fixed_order = knobs.deterministic()
    heuristic = heuristic_moe_choice(tokens, shape.model_dim, shape.inter_dim, shape.expert, shape.topk,
                                     shape.quant, sm_count=cu_num, max_shared=max_shared, gated=shape.use_g1u1,
                                     deterministic=fixed_order)
    table = default_table()
    rows, origins = [], {}
    for row in table.rows_of(machine.sm_count, shape, machine=machine):  # the cu_num rows record: 0 interpreted
        origin = table.origin(row)
        try:
            choice = _tuned_choice(row, origin)
        except ValueError as err:
            warnings.warn(f"tritune: skipping tuned fused-MoE row {origin}: {err}", stacklevel=4)
            continue
        if fixed_order and sums_with_atomics(choice):  # TRITUNE_DETERMINISTIC: not this row (no warning: asked for)
            continue
        if math.isfinite(row.us) and row.us > 0:
            rows.append(MoeRow(row.shape.token, choice.run_1stage, choice.stage1, choice.stage2, row.us))
            origins[row.shape.token] = origin
    if not rows:
        if online and maybe_tune("fused_moe", MoeRequest(shape.with_token(tokens), index)):
            reload_moe_configs()
            return _choose(index, shape, tokens, online=False)
        return heuristic
    run_1stage, stage1, stage2, why = choose_moe_offgrid(
        tokens, shape.model_dim, shape.inter_dim, shape.expert, shape.topk, shape.quant, rows, cu_num,
        gated=shape.use_g1u1, heuristic=(heuristic.run_1stage, heuristic.stage1, heuristic.stage2))
    if tokens in origins and why.startswith("tuned"):
        return MoeChoice(run_1stage, stage1, stage2, f"tuned: {origins[tokens]}")
    files = sorted({origin.split(",")[0] for origin in origins.values()})
    return MoeChoice(run_1stage, stage1, stage2, f"{why}; tuned rows from {', '.join(files)}")


def fused_moe_choice(hidden_states: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, w2: torch.Tensor | Mxfp4Weights,
                     topk_ids: torch.Tensor, *, activation: str = "silu", quant: str = "none",
                     doweight_stage1: bool = False) -> MoeChoice:
    """The kernels `fused_moe` runs for these arguments (see `fused_moe` for shapes); cached per process. With
    prepared MXFP4 weights, what the op runs with prepared scales (`_swizzle_as_given`)."""
    (w1, swizzled1), (w2, swizzled2) = split_weights(w1), split_weights(w2)
    shape = _call_shape(hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1)
    index = _index(hidden_states.device)
    key = (index, shape.shape_key(), shape.token)
    found = _CHOSEN.get(key)
    if found is None:
        found = _CHOSEN[key] = _choose(index, shape, shape.token)
    if swizzled1 or swizzled2:
        return _swizzle_as_given(found, quant, (swizzled1, swizzled2), lambda: _rule_choice(
            hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1, scale_records=True))
    return found


# Bound launches per call signature: what the kernels were specialized on (shapes, strides, dtypes, 16-byte
# alignment, device), the call's options and the explicit choice, if any. A hit costs this key and the launches.
_PLANS: dict[tuple, MoeLaunch] = {}
_PLANS_MAX = 4096  # distinct call signatures kept; past that the cache starts afresh
# MXFP4 scale buffers (device, address) whose codes were checked against the bf16 decode's range; the check costs a
# host sync, so it runs once per buffer, not per call.
_SCALES_IN_RANGE: set[tuple] = set()
MXFP4_BF16_MAX_CODE = 192  # kernels/mxfp4.py K32_FOLD: codes past it decode to inf or NaN on the bf16 path


def _check_mxfp4_scale_range(w1_scale: torch.Tensor, w2_scale: torch.Tensor, keys: tuple | None = None) -> None:
    """Refuse MXFP4 scales the folded bf16 decode cannot represent (e8m0 codes 193-255: weights of 2**66 and up, or
    the spec's NaN code 255), once per scale buffer; skipped while a CUDA graph is being captured (no sync there).
    `keys`: each buffer's (address, `_signature`), where the caller has them already (the op's call key does)."""
    if keys is None:
        keys = tuple((t.data_ptr(), _signature(t)) for t in (w1_scale, w2_scale))
    for name, scale, key in (("w1_scale", w1_scale, keys[0]), ("w2_scale", w2_scale, keys[1])):
        if key in _SCALES_IN_RANGE or scale.numel() == 0:
            continue
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            continue
        top = int(scale.max())
        if top > MXFP4_BF16_MAX_CODE:
            at = [int(i) for i in (scale == top).nonzero()[0]]
            raise ValueError(f"{name}: e8m0 code {top} at {at} exceeds {MXFP4_BF16_MAX_CODE}, the largest the bf16 "
                             f"MXFP4 decode represents (weights of 2**66 and up, or the NaN code 255)")
        if len(_SCALES_IN_RANGE) >= _PLANS_MAX:
            _SCALES_IN_RANGE.clear()
        _SCALES_IN_RANGE.add(key)


def _signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _rule_choice(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str, quant: str, doweight_stage1: bool, *, scale_records: bool,
                 gluon: bool = True) -> MoeChoice:
    """The rule table's choice for this call (`scale_records` False: its tiles for MXFP4 scales given as codes;
    `gluon` False: without the Gluon stage kernels)."""
    shape = _call_shape(hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1)
    cu_num, max_shared, _ = _device_facts(_index(hidden_states.device))
    return heuristic_moe_choice(shape.token, shape.model_dim, shape.inter_dim, shape.expert, shape.topk, quant,
                                sm_count=cu_num, max_shared=max_shared, gated=shape.use_g1u1,
                                scale_records=scale_records, deterministic=knobs.deterministic(), gluon=gluon)


def _gluon_runs(choice: MoeChoice, hidden_states: torch.Tensor, activation: str, doweight_stage1: bool) -> bool:
    """Whether a choice's Gluon stages (MoeConfig.GLUON) can run this call: a Hopper GPU with Triton's Gluon API,
    gated SiLU, the routing weights applied in stage 2. True for a choice with none."""
    stages = (choice.stage1,) if choice.run_1stage else (choice.stage1, choice.stage2)
    if not any(getattr(c, "GLUON", 0) for c in stages):
        return True
    return (HAS_GLUON_HOPPER and hidden_states.is_cuda and activation == "silu" and not doweight_stage1
            and torch.cuda.get_device_capability(hidden_states.device)[0] == 9)


def _plan(hidden_states: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, w2: torch.Tensor | Mxfp4Weights,
          topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1_scale, w2_scale, activation: str, quant: str,
          doweight_stage1: bool, choice: MoeChoice | None) -> MoeLaunch:
    launch_w1, launch_w2 = w1, w2  # MoeLaunch takes prepared weights as they came; the rest reads their bytes
    (w1, swizzled1), (w2, swizzled2) = split_weights(w1), split_weights(w2)
    for name, t in (("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if t is not None and t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}: every tensor must be "
                             f"on one device")
    # The rule table's tiles for scales given as codes (`_scale_forms` settled prepared ones before this).
    codes_rule = functools.partial(_rule_choice, hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1,
                                   scale_records=False)
    if choice is None:
        choice = fused_moe_choice(hidden_states, w1, w2, topk_ids, activation=activation, quant=quant,
                                  doweight_stage1=doweight_stage1)
        choice = _swizzle_as_given(choice, quant, (swizzled1, swizzled2), codes_rule)
    choice = _scale_tma_as_given(choice, w1_scale, w2_scale, codes_rule)
    if not _gluon_runs(choice, hidden_states, activation, doweight_stage1):
        # a Gluon plan (tuned on Hopper, or the rule's) where it cannot run: the rule table without it
        choice = _rule_choice(hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1,
                              scale_records=True, gluon=False)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    stage2 = None if choice.run_1stage else choice.stage2
    with torch.cuda.device(hidden_states.device) if hidden_states.is_cuda else contextlib.nullcontext():
        return MoeLaunch(hidden_states, launch_w1, launch_w2, topk_weights, topk_ids, w1_scale, w2_scale,
                         stage1=choice.stage1, stage2=stage2, activation=activation, quant=quant,
                         doweight_stage1=doweight_stage1)


# Prepared MXFP4 scales: per (scale objects, call shape, options, forced choice), which form each stage reads and the
# choice that says so. Keyed on the objects' ids, each checked against a weak reference, so no weight is kept alive.
_SCALE_FORMS: dict[tuple, tuple] = {}


def _scale_forms(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, w1_scale,
                 w2_scale, activation: str, quant: str, doweight_stage1: bool, choice: MoeChoice | None,
                 swizzled: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor, MoeChoice]:
    """(stage 1's scale tensor, stage 2's, the choice) for a call with `Mxfp4Scales`: the records where the choice's
    stage runs SCALE_TMA, else the codes. The choice is settled first; the answer is cached (no choice lookup or
    shape check per call: 20 µs a call on the H100 before the cache). Only when both are prepared: one prepared and
    one plain run as codes, both."""
    if not (isinstance(w1_scale, Mxfp4Scales) and isinstance(w2_scale, Mxfp4Scales)):
        return split_scales(w1_scale)[0], split_scales(w2_scale)[0], choice
    key = (id(w1_scale), id(w2_scale), hidden_states.shape, hidden_states.dtype, hidden_states.device, quant,
           activation, doweight_stage1, choice, swizzled)
    hit = _SCALE_FORMS.get(key)
    if hit is None or hit[0]() is not w1_scale or hit[1]() is not w2_scale:
        if choice is None:
            choice = fused_moe_choice(hidden_states, w1, w2, topk_ids, activation=activation, quant=quant,
                                      doweight_stage1=doweight_stage1)
            choice = _swizzle_as_given(choice, quant, swizzled, lambda: _rule_choice(
                hidden_states, w1, w2, topk_ids, activation, quant, doweight_stage1, scale_records=True))
        if len(_SCALE_FORMS) >= _PLANS_MAX:
            _SCALE_FORMS.clear()
        hit = _SCALE_FORMS[key] = (_weak(w1_scale), _weak(w2_scale), bool(choice.stage1.SCALE_TMA),
                                   bool(choice.w2_config.SCALE_TMA), choice)
    _, _, records1, records2, choice = hit
    return fm.stage_scales(w1_scale, records1), fm.stage_scales(w2_scale, records2), choice


def _weak(obj):
    return (lambda: None) if obj is None else weakref.ref(obj)


def _swizzle_as_given(choice: MoeChoice, quant: str, swizzled: tuple[bool, bool], swapped_rule) -> MoeChoice:
    """`choice` for a call with prepared MXFP4 weights (`prepare_mxfp4_weights`), which only the swapped stage
    GEMMs decode: a looked-up choice that runs anything else gives way to the rule table's (`swapped_rule()`, always
    swapped for bf16/fp16 activations), with one warning a plan. A forced choice is never rewritten (MoeLaunch
    refuses what it cannot run, as it does any prepared weights with fp8 activations)."""
    if not any(swizzled) or quant != fm.MXFP4:
        return choice
    stages = (choice.stage1, choice.w2_config)
    if all(fm.reads_prepared(c, quant) for c, on in zip(stages, swizzled, strict=True) if on):
        return choice
    fallback = swapped_rule()
    warnings.warn(f"tritune: {choice.source} does not run the swapped MXFP4 GEMM (64-row tiles or more) that prepared "
                  "weights need: running the rule table's tiles instead; pass the standard packed bytes to run it, or "
                  "tune with prepared weights", stacklevel=4)
    return MoeChoice(fallback.run_1stage, fallback.stage1, fallback.stage2,
                     f"heuristic (prepared weights; {choice.source} not swapped)")


def _scale_tma_as_given(choice: MoeChoice, w1_scale, w2_scale, codes_rule) -> MoeChoice:
    """`choice` for a call whose MXFP4 scales came as codes only: the records SCALE_TMA reads are made once per
    weight (`prepare_mxfp4_scales`), never per call. The rule table's choice becomes its codes-only one
    (`codes_rule()`: its tiles differ); a tuned choice keeps its tiles with SCALE_TMA off (the codes by pointers),
    with one warning a plan: those tiles were timed with the records (gpt-oss-120b's 128-wide ones ran 1.3x slower
    by pointers on the H100)."""
    second = choice.w2_config
    plain = [s is not None and s.dim() == 3 and c.SCALE_TMA for s, c in ((w1_scale, choice.stage1),
                                                                          (w2_scale, second))]
    if not any(plain):
        return choice
    if choice.source == "heuristic":
        return codes_rule()
    if choice.run_1stage:  # one config for both weights: records for both or for neither
        plain = [True, True]
    s1, s2 = (dataclasses.replace(c, SCALE_TMA=0) if off else c
              for off, c in zip(plain, (choice.stage1, second), strict=True))
    warnings.warn(f"tritune: {choice.source} reads the MXFP4 codes through TMA (SCALE_TMA) but the scales came as "
                  "codes: running its tiles with the codes by pointers; pass tritune.ops.prepare_mxfp4_scales(...) "
                  "results (made once per weight) for the tuned speed", stacklevel=4)
    return MoeChoice(choice.run_1stage, s1, None if choice.run_1stage else s2,
                     choice.source + " (SCALE_TMA off: the scales came as codes)")


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, w2: torch.Tensor | Mxfp4Weights,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "silu", quant: str = "none",
              w1_scale: torch.Tensor | Mxfp4Scales | None = None, w2_scale: torch.Tensor | Mxfp4Scales | None = None,
              doweight_stage1: bool = False, out: torch.Tensor | None = None,
              choice: MoeChoice | None = None) -> torch.Tensor:
    """The MoE layer with tuned (or heuristic) kernels.

    hidden_states [T, D] bf16/fp16; w1 [E, 2I, D] (gate rows, then up rows) or [E, I, D] (no gate); w2 [E, D, I];
    topk_weights fp32 [T, topk]; topk_ids int [T, topk] -> [T, D] in hidden's dtype (into `out` when given, a
    contiguous [T, D] tensor of that dtype). For quant "per_token" / "per_1x128" the weights are fp8 e4m3 with the
    scales of `kernels.fused_moe.quantize_weights`; the activations are quantized inside. `choice` forces the
    kernels (the tuner times candidates through it). Shape and dtype errors are one-line ValueErrors. MXFP4 scales
    may come as `prepare_mxfp4_scales` results (codes and their TMA records, made once per weight): the swapped
    stages then read the codes through TMA (SCALE_TMA); as plain codes they read them by pointers. MXFP4 weights
    may come prepared (`prepare_mxfp4_weights`, once per weight: re-encoded and tile-major): the swapped bf16 GEMM's
    decode is cheaper and its weight loads contiguous.

    The first call of a call signature picks the kernels and binds their launches; later calls only launch
    (4-6 launches and 2 allocations for bf16; no host synchronisation, so the call can be captured in a CUDA graph).
    """
    weights = w1, w2  # as given: MoeLaunch takes prepared ones (Mxfp4Weights) whole
    (w1, swizzled1), (w2, swizzled2) = split_weights(w1), split_weights(w2)
    if isinstance(w1_scale, Mxfp4Scales) or isinstance(w2_scale, Mxfp4Scales):
        w1_scale, w2_scale, choice = _scale_forms(hidden_states, w1, w2, topk_ids, w1_scale, w2_scale, activation,
                                                  quant, doweight_stage1, choice, (swizzled1, swizzled2))
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
    a0, a1, a2, a3, a4, a5, a6, a7 = addresses
    # Triton specializes each pointer on 16-byte alignment: one flag when all are aligned (the usual case), else each.
    aligned = (a0 | a1 | a2 | a3 | a4 | a5 | a6 | a7) & 15 == 0 or tuple(a & 15 for a in addresses)
    sig1, sig2 = _signature(w1_scale), _signature(w2_scale)
    key = (device, hidden_states.shape, hidden_states.stride(), hidden_states.dtype, w1.shape, w1.stride(), w1.dtype,
           w1.device, w2.shape, w2.stride(), w2.dtype, w2.device, topk_weights.shape, topk_weights.stride(),
           topk_weights.dtype, topk_weights.device, topk_ids.shape, topk_ids.stride(), topk_ids.dtype,
           topk_ids.device, sig1, sig2, activation, quant, doweight_stage1, aligned, out_key, choice, swizzled1,
           swizzled2)
    if quant == fm.MXFP4 and hidden_states.dtype == torch.bfloat16 and sig1 is not None and sig2 is not None:
        _check_mxfp4_scale_range(w1_scale, w2_scale, ((a4, sig1), (a5, sig2)))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(hidden_states, *weights, topk_weights, topk_ids, w1_scale, w2_scale, activation,
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


def fused_moe_mxfp4(hidden_states: torch.Tensor, w1: torch.Tensor | Mxfp4Weights, w2: torch.Tensor | Mxfp4Weights,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1_scale: torch.Tensor | Mxfp4Scales,
                    w2_scale: torch.Tensor | Mxfp4Scales, *, activation: str = "silu", doweight_stage1: bool = False,
                    act_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fused_moe` with MXFP4 weights (w1 uint8 [E, 2I or I, D/2] and w2 [E, D, I/2], two e2m1 values per byte,
    element 2j in the low nibble; w1_scale uint8 e8m0 [E, 2I or I, D/32], w2_scale [E, D, I/32];
    `kernels.fused_moe.quantize_weights(w, "per_1x32")` makes both). `act_dtype` None (or hidden's dtype): the
    activations stay bf16/fp16 and the weights are decoded to it (quant "per_1x32"); torch.float8_e4m3fn: the
    activations and the intermediate are quantized to fp8 per token and the MXFP4 weights multiply them through
    tl.dot_scaled (quant "per_1x32_a8"). Hopper has no fp4 MMA: the weights are upcast in the kernel either way.
    Scales prepared once per weight (`tritune.ops.prepare_mxfp4_scales(w1_scale)`) let the swapped bf16 GEMM
    prefetch its codes through TMA (SCALE_TMA; 4-9% off its GEMMs on an H100); plain codes work everywhere.
    Weights re-encoded once (`tritune.ops.prepare_mxfp4_weights(w1)`, kernels/mxfp4_swizzle.py) cut that GEMM's
    decode from 18 to 12 instructions per 8 weights (H100, gpt-oss-120b: 1-8% off the stage pair, most at 1024-4096
    tokens); only the swapped GEMM reads them, so bf16/fp16 activations only."""
    if act_dtype not in (None, hidden_states.dtype, torch.float8_e4m3fn):
        raise ValueError(f"act_dtype {act_dtype}: expected None, {hidden_states.dtype} or torch.float8_e4m3fn")
    quant = fm.MXFP4_A8 if act_dtype == torch.float8_e4m3fn else fm.MXFP4
    return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation, quant=quant,
                     w1_scale=w1_scale, w2_scale=w2_scale, doweight_stage1=doweight_stage1)


def fused_moe_a8w8_blockscale(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1_scale: torch.Tensor,
                              w2_scale: torch.Tensor, *, activation: str = "silu",
                              doweight_stage1: bool = False) -> torch.Tensor:
    """`fused_moe` with fp8 per 1×128 activations and 128×128-block fp8 weights (w1_scale fp32 [E, ⌈2I/128⌉,
    ⌈D/128⌉], w2_scale fp32 [E, ⌈D/128⌉, ⌈I/128⌉])."""
    return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation, quant="per_1x128",
                     w1_scale=w1_scale, w2_scale=w2_scale, doweight_stage1=doweight_stage1)
