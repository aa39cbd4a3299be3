"""A whole fused-MoE call bound once per call signature: sort, activation quantization, both GEMMs (or the 1-stage
kernel) and the top-k sum as bound launches, every scratch buffer carved from one allocation per call.

2-stage: sort (1-3 launches; the first also quantizes the activations for fp8 and zeroes what the GEMMs accumulate
into) → stage 1 [→ split-K finish] → [quantize intermediate] → stage 2 [→ top-k sum, or with TOPK_ATOMIC the cast of
its fp32 accumulator into `out`]. 1-stage: sort (its first launch also quantizes and zeroes the fp32 accumulator) →
the 1-stage kernel → cast into `out`. With SORTED_INTER the intermediate (its amax, split-K partials and fp8 copy
too) has the sort's padded row order. Nothing is read back to the host, so a call is graph-safe.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune.compile_target import sm_count_for
from tritune.kernels import fused_moe_1stage
from tritune.kernels.fused_moe import (
    _ACT_ID,
    FP8_QUANTS,
    SCALE_BLOCK,
    MoeConfig,
    _moe_gemm_kernel,
    _stage1_finish_kernel,
    _topk_sum_kernel,
    _validate,
    act_group,
    check_config,
    check_plan,
    check_scale_records,
    check_swizzled,
    k32_input,
    quant_id,
)
from tritune.kernels.fused_moe_1stage import (
    _acc_to_out_kernel,
    _moe_1stage_kernel,
    _moe_1stage_swap_kernel,
    coop_split,
    register_cap,
)
from tritune.kernels.fused_moe_config import check_compiles_here, weight_tma_view
from tritune.kernels.fused_moe_gather import ROWS as GATHER_ROWS
from tritune.kernels.fused_moe_gather import _gather_rows_kernel, gather_grid
from tritune.kernels.fused_moe_persistent import _moe_gemm_persistent_kernel
from tritune.kernels.gemm import programs_per_wave
from tritune.kernels.launch import BoundKernel, DescriptorCache, Workspace, row_major_strides
from tritune.kernels.moe_align import AlignLaunch, RideAlong, gemm_blocks, sorted_rows
from tritune.kernels.mxfp4_records import records_box
from tritune.kernels.mxfp4_swizzle import check_prepared_device, split_weights, tile_box, tile_view, tile_view_shape
from tritune.kernels.pdl import plan_pdl
from tritune.kernels.quant import FP8 as _FP8
from tritune.kernels.quant import QuantLaunch
from tritune.knobs import interpreting

__all__ = ["FUSE_INTERMEDIATE_QUANT", "FUSE_QUANT_L2_SHARE", "MoeLaunch", "fuses_intermediate_quant"]

# An fp8 2-stage call can quantize its intermediate inside the GEMMs (stage 1 records the amax of what it stores,
# stage 2 quantizes A as it loads it) instead of in a launch between them: one launch fewer per call, the same bits.
# It is off: on the H100 (benchmarks/profile_moe_kernels.py, 2026-11-26, rule-table configs) stage 2 quantizing A on
# load took 1.2-3.0x the time of stage 2 on ready fp8 A (per_1x128: 246 against 110 µs on DeepSeek-V2-Lite at 1024
# tokens; per_token: 229 against 77 µs on DeepSeek-V2-Lite at 256 tokens, 177 against 149 µs on Qwen3-30B-A3B at
# 1024), far more than the separate quantization launch costs (2.5-10 µs there, since quant_tile). Stage 2 then
# reads A in 16 bits and re-quantizes it for every N tile, and the tuner times stage 2 on fp8 A. The paths stay (and
# tested, bit-equal to the separate launch) behind FUSE_INTERMEDIATE_QUANT for a kernel that makes them pay; when on,
# they are kept to intermediates of at most FUSE_QUANT_L2_SHARE of L2 and stage-2 configs whose 16-bit A tiles fit
# shared memory.
FUSE_INTERMEDIATE_QUANT = False
FUSE_QUANT_L2_SHARE = 1 / 3


def fuses_intermediate_quant(quant: str, stage1: MoeConfig, stage2: MoeConfig, intermediate_bytes: int,
                             a_bytes: int, l2_bytes: int | None, max_shared: int | None) -> bool:
    """Whether a 2-stage fp8 call skips the intermediate's quantization launch: only with FUSE_INTERMEDIATE_QUANT on
    (off by default: measured slower), not behind a split-K stage 1 (no epilogue sees whole outputs), only while the
    16-bit intermediate takes at most FUSE_QUANT_L2_SHARE of `l2_bytes`, and only when stage 2's pipeline of
    `a_bytes`-wide A tiles and fp8 weight tiles fits `max_shared` (None: no such limit, the interpreter)."""
    if not FUSE_INTERMEDIATE_QUANT or quant not in ("per_token", "per_1x128") or stage1.KSPLIT != 1 \
            or stage1.GLUON or stage2.GLUON:  # the Gluon stages read and write a ready fp8 / 16-bit intermediate
        return False
    if l2_bytes is not None and intermediate_bytes > FUSE_QUANT_L2_SHARE * l2_bytes:
        return False
    tiles = stage2.num_stages * (stage2.BLOCK_SIZE_M * a_bytes + stage2.BLOCK_SIZE_N) * stage2.BLOCK_SIZE_K
    return max_shared is None or tiles <= max_shared


_F32 = torch.float32
# A call's tensors, in order (topk_ids flattened): the head of the flat list every launch takes its pointers from.
_TENSORS = ("hidden", "w1", "w2", "topk_weights", "w1_scale", "w2_scale", "out", "topk_ids")
_SOURCE = {"t": 0, "p": 1, "d": 2}  # where a pointer argument comes from per call: tensors, pieces, descriptors


class _Pieces:
    """The workspace layout being built: (dtype, numel) per piece, addressed by index."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.dtype, int]] = []

    def add(self, dtype: torch.dtype, numel: int) -> int:
        self.items.append((dtype, numel))
        return len(self.items) - 1

    def extend(self, pieces) -> int:
        first = len(self.items)
        self.items.extend(pieces)
        return first


@dataclass
class _Tma:
    """One TMA operand of the plan: where its base comes from per call (("t", call tensor) or ("p", workspace
    piece)), its view (row-major) and block, the descriptor the binding compiled with, and (GPU) its argument cache.

    `example` is dropped (None) once the plan is bound: over a call tensor it holds that tensor, a weight, and the op
    keeps its plans. The tuner builds fresh weights for each end-to-end candidate, and each one's plan kept them:
    2.7 GB a Mixtral candidate, until one H100 ran out of memory re-timing the MoE file's rows (issue 17)."""

    source: tuple[str, object]
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: list[int]
    example: TensorDescriptor | None
    cache: DescriptorCache | None = None
    width: int = 1  # launch arguments one descriptor takes
    view: Callable[[torch.Tensor], torch.Tensor] | None = None  # the view when a reshape cannot make it


def _weight_scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(expert stride, row stride) of a weight scale; per-channel [E, N] scales have no row stride (unused)."""
    if scale is None:
        return 0, 0
    return scale.stride(0), scale.stride(1) if scale.dim() == 3 else 0


class MoeLaunch:
    """The launches of one fused-MoE call signature with one choice of kernels, bound once.

    Built from example tensors (validated here); a call must pass tensors of the same shapes, dtypes, strides and
    16-byte alignment (the op keys its cache on them). `stage2` None means the 1-stage kernel with `stage1`'s config.
    """

    def __init__(self, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, *,
                 stage1: MoeConfig, stage2: MoeConfig | None, activation: str = "silu", quant: str = "none",
                 doweight_stage1: bool = False) -> None:
        (w1, swizzled1), (w2, swizzled2) = split_weights(w1), split_weights(w2)
        self.swizzled = (swizzled1, swizzled2)  # prepared MXFP4 bytes (kernels/mxfp4_swizzle.py), per stage
        for w, prepared in ((w1, swizzled1), (w2, swizzled2)):
            if prepared:
                check_prepared_device(w)
        experts, inter_dim, model_dim = _validate(hidden, w1, w2, topk_weights, topk_ids, activation, quant,
                                                  w1_scale, w2_scale, self.swizzled)
        self.one_stage = stage2 is None
        if self.one_stage:
            check_config(stage1, "1stage", quant)
            if not stage1.SWAP_AB and any(s is not None and s.dim() == 4 for s in (w1_scale, w2_scale)):
                raise ValueError("the 1-stage kernel reads the MXFP4 scales as codes [E, N, K/32], not as records "
                                 "(only its swapped variant, SWAP_AB 1, reads records)")
            if not stage1.SWAP_AB and (swizzled1 or swizzled2):
                raise ValueError("the 1-stage kernel reads the standard packed MXFP4 bytes, not prepared ones "
                                 "(prepare_mxfp4_weights): only the swapped GEMMs (SWAP_AB 1) decode those")
        else:
            check_plan(stage1, stage2, quant)
        tokens, topk = topk_ids.shape
        self.tokens, self.model_dim, self.dtype = tokens, model_dim, hidden.dtype
        numel = tokens * topk
        self.ids_contiguous = topk_ids.is_contiguous()
        ids = topk_ids if self.ids_contiguous else topk_ids.contiguous()
        pieces = _Pieces()
        group = act_group(quant)
        # Rows of the intermediate: one per pair, or with SORTED_INTER the sort's order (block b's rows are
        # b·BLOCK_SIZE_M.. in both stages) over the blocks the GEMMs cover (moe_align.sorted_rows).
        self.sorted_inter = 0 if self.one_stage else stage1.SORTED_INTER
        self.inter_rows = sorted_rows(numel, experts, stage1.BLOCK_SIZE_M) if self.sorted_inter else numel
        # Stage 2 sums the top-k slots with atomics into an fp32 [T, D] accumulator (not when it writes `out` itself).
        self.topk_atomic = not self.one_stage and bool(stage2.TOPK_ATOMIC) and not (topk == 1 and stage2.KSPLIT == 1)
        # TOPK_ATOMIC 2 (the Gluon stage 2): that accumulator in the activations' 16-bit type
        acc_dtype = hidden.dtype if self.topk_atomic and stage2.TOPK_ATOMIC == 2 else torch.float32
        # The swapped 1-stage kernel split along K counts each slice's finished splits (one fp32 counter a slice).
        self.split_counts = 0
        if self.one_stage and stage1.SWAP_AB and stage1.KSPLIT > 1:  # and, cooperative, one ticket counter
            self.split_counts = (gemm_blocks(numel, experts, stage1.BLOCK_SIZE_M)
                                 * triton.cdiv(inter_dim, stage1.BLOCK_SIZE_N) + coop_split(stage1))
        # The sort's first launch also quantizes the activations (fp8) and zeroes the accumulators.
        zero, zero2 = self._zeroed(quant, stage1, stage2, tokens, model_dim, inter_dim, hidden)
        act_quant = quant in FP8_QUANTS  # MXFP4 (per_1x32) quantizes the weights only
        # The swapped MXFP4 stage 1 on standard packed bytes reads hidden in the K32 order: the sort's first launch
        # copies it so (prepared weights read it in K order: kernels/mxfp4_swizzle.py).
        self.k32_ride = k32_input(stage1, quant, self.swizzled[0])
        carried = act_quant or self.k32_ride
        ride = RideAlong(x=hidden if carried else None, rows=tokens if carried else 0, cols=model_dim,
                         stride=hidden.stride(0), group=group, zero=zero, zero2=zero2, k32=self.k32_ride,
                         zero2_dtype=acc_dtype)
        # Hopper: the plan's sort, GEMMs and their finish kernels launch as programmatic dependents (kernels/pdl.py).
        self.pdl = hidden.is_cuda and plan_pdl(torch.cuda.get_device_capability(hidden.device)[0])
        self.align = AlignLaunch(ids.reshape(-1), stage1.BLOCK_SIZE_M, experts, ride, pdl=self.pdl)
        pieces.extend(self.align.pieces)  # first, so the sort's own piece indices hold in the workspace
        self.calls: list[tuple] = []  # (bound kernel, where each of its pointers comes from per call), in launch order
        for bound, uses in self.align.steps():
            self.calls.append((bound, tuple((_SOURCE["t"], _TENSORS.index("hidden" if kind == "x" else "topk_ids"))
                                            if kind in ("x", "ids") else (_SOURCE["p"], i) for kind, i in uses)))
        self.q1 = self.align.q_piece
        self.dummy = pieces.add(_F32, 1)  # the scale pointer of an unquantized operand (never read)
        self.gated = w1.shape[1] == 2 * inter_dim
        self.tma: list[_Tma] = []  # TMA operands (weights; a sorted intermediate), in launch order
        self.trace_piece: int | None = None  # the swapped 1-stage kernel's phase stamps (fused_moe_1stage.TRACE)
        self.quant2 = None
        self._w_strides = (_weight_scale_strides(w1_scale), _weight_scale_strides(w2_scale))
        if self.one_stage:
            self._bind_1stage(hidden, w1, w2, topk_weights, w1_scale, w2_scale, pieces, stage1, numel, topk,
                              inter_dim, model_dim, activation, quant)
        else:
            self._bind_2stage(hidden, w1, w2, topk_weights, w1_scale, w2_scale, pieces, stage1, stage2, numel,
                              tokens, topk, inter_dim, model_dim, activation, quant, doweight_stage1, group)
        self.workspace = Workspace(tuple(pieces.items))
        self._finish_binding(pieces)

    def _zeroed(self, quant: str, stage1: MoeConfig, stage2: MoeConfig | None, tokens: int, model_dim: int,
                inter_dim: int, hidden: torch.Tensor) -> tuple[int, int]:
        """fp32 elements the sort's first launch zeroes in its two buffers: (the 1-stage accumulator, 0), or for 2
        stages (the intermediate's amax when its quantization is fused into the GEMMs: one per row, or per row and
        1×128 group; the top-k accumulator [T, D] with TOPK_ATOMIC)."""
        props = torch.cuda.get_device_properties(hidden.device) if hidden.is_cuda else None
        self.fused_quant = not self.one_stage and fuses_intermediate_quant(
            quant, stage1, stage2, self.inter_rows * inter_dim * hidden.element_size(), hidden.element_size(),
            props.L2_cache_size if props else None, props.shared_memory_per_block_optin if props else None)
        self.final_cast = self.one_stage and fused_moe_1stage.FINAL_CAST_IN_KERNEL
        if self.one_stage:  # zero2: the per-token counts of the cast in the kernel, or the split counters
            return tokens * model_dim, tokens if self.final_cast else self.split_counts
        self.amax_groups = triton.cdiv(inter_dim, SCALE_BLOCK) if quant == "per_1x128" else 1
        return (self.inter_rows * self.amax_groups if self.fused_quant else 0,
                tokens * model_dim if self.topk_atomic else 0)

    # Argument recipes: each entry is ("t", name) a call tensor, ("p", i) workspace piece i, ("d", j) the TMA
    # descriptor self.tma[j], or ("v", value) a value fixed at binding. Pointers come first in every kernel, so a
    # launch keeps its fixed tail apart and resolves only its head per call.
    def _bind(self, fn, grid, recipe: list[tuple], example: dict, pieces: _Pieces, num_warps: int,
              num_stages: int, pdl: bool = False, maxnreg: int | None = None) -> None:
        args = []
        for kind, what in recipe:
            if kind == "t":
                args.append(example[what])
            elif kind == "p":
                args.append(pieces.items[what][0])
            elif kind == "d":
                args.append(self.tma[what].example)
            else:
                args.append(what)
        cut = next((i for i, (kind, _) in enumerate(recipe) if kind == "v"), len(recipe))
        if any(kind != "v" for kind, _ in recipe[cut:]):
            raise AssertionError(f"{fn}: every pointer must precede the fixed arguments")
        head = tuple((_SOURCE[kind], _TENSORS.index(what) if kind == "t" else what) for kind, what in recipe[:cut])
        self.calls.append((BoundKernel(fn, grid, args, varying=cut, num_warps=num_warps, num_stages=num_stages,
                                       launch_pdl=pdl, maxnreg=maxnreg), head))

    def _finish_binding(self, pieces: _Pieces) -> None:
        """Per launch, its C launch and one C-level getter of its pointers out of the call's flat list: the call's
        tensors (or addresses), then the workspace pieces, then the launch arguments of the TMA descriptors in
        self.tma's order."""
        for tma in self.tma:
            tma.example = None  # bound: keep no call tensor alive (see _Tma)
        n_t, n_p = len(_TENSORS), len(pieces.items)
        offset = {0: 0, 1: n_t}
        desc_at, at = {}, n_t + n_p
        for j, tma in enumerate(self.tma):
            desc_at[j] = range(at, at + tma.width)
            at += tma.width
        self.getters = []
        for bound, head in self.calls:
            flat = [j for src, key in head for j in (desc_at[key] if src == 2 else (offset[src] + key,))]
            getter = operator.itemgetter(*flat) if len(flat) > 1 else (lambda xs, i=flat[0]: (xs[i],))
            self.getters.append((bound, getter))
        self.steps = tuple((bound.launch, getter) for bound, getter in self.getters)

    def _descriptor(self, source: tuple, shape: tuple[int, ...], dtype: torch.dtype, block: list[int],
                    example: dict, what: str, view=None, gluon: bool = False) -> tuple[str, int]:
        """A TMA operand over `source` viewed `shape` (row-major; `view(tensor)` makes that view when a reshape
        cannot), recorded in self.tma; its recipe entry. `gluon`: the binding compiles a Gluon kernel, whose
        descriptors carry their shared-memory layout (the per-call cache still encodes plain ones: the launcher takes
        the layout recorded at compile time)."""
        if (shape[-1] * dtype.itemsize) % 16:
            raise ValueError(f"{what} needs rows of 16-byte multiples; K={shape[-1]} of {dtype} is not")
        if gluon:
            from triton.runtime.jit import MockTensor

            from tritune.kernels.gluon_blockscale import descriptor

            desc = descriptor(MockTensor(dtype, list(shape)), block)  # only its dtype and shape matter to the binding
        elif source[0] == "t":
            t = example[source[1]]
            desc = TensorDescriptor.from_tensor(view(t) if view else t.view(*shape), block)
        else:  # a workspace piece: its dtype is all the binding needs (Triton's mock tensor, as compile_only does)
            from triton.runtime.jit import MockTensor

            desc = TensorDescriptor(MockTensor(dtype), list(shape), row_major_strides(shape), block)
        self.tma.append(_Tma(source, shape, dtype, block, desc, view=view))
        return ("d", len(self.tma) - 1)

    def _weight_operand(self, w: str, quant: str, k: int, tile_rows: int, k_step: int, prepared: bool,
                        example: dict) -> tuple[str, int]:
        """The TMA operand of call tensor `w` read by tiles of `tile_rows` rows and `k_step` K: prepared MXFP4
        weights tile-major (one box a K step, `tile_view`), others as rows of their K (`weight_tma_view`)."""
        w_t = example[w]
        if prepared:
            return self._descriptor(("t", w), tile_view_shape(*w_t.shape), w_t.dtype, tile_box(tile_rows, k_step),
                                    example, "prepared weights", view=tile_view)
        row, box = weight_tma_view(quant, k, tile_rows, k_step)
        return self._descriptor(("t", w), (w_t.numel() // row, row), w_t.dtype, box, example, "USE_TMA")

    def _scale_operand(self, w_scale: tuple, cfg: MoeConfig, kernel: str, quant: str, tile_rows: int,
                       strides: tuple[int, int], example: dict) -> tuple[tuple, tuple[int, int]]:
        """A GEMM's weight-scale argument and its (expert, row) strides: with SCALE_TMA the records' TMA operand (one
        K step's records of a `tile_rows`-row tile) and (records an expert, 0), else as given. ValueError when the
        scales came in the other form."""
        scale_t = example[w_scale[1]] if w_scale[0] == "t" else None
        if bool(cfg.SCALE_TMA) != (scale_t is not None and scale_t.dim() == 4):
            wants = "SCALE_TMA reads the scales as records" if cfg.SCALE_TMA else "scale records need SCALE_TMA"
            raise ValueError(f"{cfg.name(kernel, quant)}: {wants} (kernels/mxfp4_records.py prepare_mxfp4_scales); "
                             f"got {w_scale[1]} {None if scale_t is None else tuple(scale_t.shape)}")
        if not cfg.SCALE_TMA:
            return w_scale, strides
        e, nb, kb, width = scale_t.shape
        return (self._descriptor(w_scale, (e * nb, kb, width), torch.uint8, records_box(tile_rows), example,
                                 "SCALE_TMA"), (nb, 0))

    def _gemm(self, *, kernel: str, a: tuple, a_scale: tuple, w: str, w_scale: tuple, target: tuple, stride_asm: int,
              amax: tuple, stride_amax: int, amax_out: int, quant_on_load: bool, n: int, k: int, numel: int,
              cfg: MoeConfig, stride_om: int, stride_ok: int, a_row_div: int, gated: bool, act: int,
              mul_weight: bool, quant: str, example: dict, pieces: _Pieces, scale_strides: tuple,
              out_sorted: bool = False, a_sorted: int = 0, atomic_topk: int = 0, a_rows: int | None = None,
              out_k32: bool = False, swizzled: bool = False, quant_out: tuple | None = None) -> None:
        check_compiles_here(cfg, kernel, quant, triton.__version__, interpreting())
        if cfg.GLUON:
            self._gemm_gluon(kernel=kernel, a=a, a_scale=a_scale, w=w, w_scale=w_scale, target=target,
                             stride_asm=stride_asm, n=n, k=k, numel=numel, cfg=cfg, example=example, pieces=pieces,
                             a_rows=a_rows, gated=gated, act=act, mul_weight=mul_weight, atomic_topk=atomic_topk,
                             quant_on_load=quant_on_load, stride_om=stride_om, topk=a_row_div, quant_out=quant_out)
            return
        if swizzled:
            check_swizzled(cfg, quant, kernel, n, gated)
        num_pid_m = self.align.gemm_blocks
        k_per_split = triton.cdiv(triton.cdiv(k, cfg.KSPLIT), cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K
        w_t = example[w]
        first = len(self.tma)
        a_desc = a
        if a_sorted == 2:  # A in the sort's order through TMA: block b's tile is rows b·BLOCK_M.. of [rows, K]
            what = "GATHER_A (A through TMA)" if a_rows is not None else "SORTED_INTER 2 (A through TMA)"
            a_desc = self._descriptor(a, (a_rows or self.inter_rows, k), pieces.items[a[1]][0],
                                      [cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_K], example, what)
        w_desc = ("t", w)
        if cfg.USE_TMA:
            w_desc = self._weight_operand(w, quant, k, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, swizzled, example)
        w_scale, scale_strides = self._scale_operand(w_scale, cfg, kernel, quant, cfg.BLOCK_SIZE_N, scale_strides,
                                                     example)
        if cfg.SCALE_TMA:
            check_scale_records(cfg, n, gated)
        recipe = [a, a_desc, a_scale, ("t", w), w_desc, w_scale, target, ("p", 0), ("p", 1), ("p", 2),
                  ("t", "topk_weights"), amax]
        recipe += [("v", v) for v in (
            numel, n, k, k_per_split, num_pid_m, k, stride_asm, w_t.stride(0), w_t.stride(1), *scale_strides,
            stride_om, stride_ok, stride_amax, a_row_div, gated, act, mul_weight, quant_id(quant), cfg.BLOCK_SIZE_M,
            cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, cfg.GROUP_SIZE_M, cfg.KSPLIT, k % cfg.BLOCK_SIZE_K == 0,
            bool(cfg.USE_TMA), amax_out, quant_on_load, out_sorted, a_sorted, atomic_topk, bool(cfg.SWAP_AB),
            bool(cfg.WARP_SPEC), out_k32, bool(cfg.SCALE_TMA), swizzled, self.pdl)]
        tiles = num_pid_m * triton.cdiv(n, cfg.BLOCK_SIZE_N)
        if cfg.PERSISTENT:  # same arguments; one program a SM walks the tiles (fused_moe_persistent)
            if quant_on_load:
                raise ValueError(f"{cfg.name(kernel, quant)}: PERSISTENT reads a ready fp8 intermediate, not one "
                                 "quantized on load (FUSE_INTERMEDIATE_QUANT)")
            fn, grid = _moe_gemm_persistent_kernel, (min(programs_per_wave(w_t.device), tiles), 1)
        else:
            fn, grid = _moe_gemm_kernel, (tiles, cfg.KSPLIT)
        self._bind(fn, grid, recipe, example, pieces, cfg.num_warps, cfg.num_stages, self.pdl)
        self._cache_descriptors(first, w_t)

    def _gemm_gluon(self, *, kernel: str, a: tuple, a_scale: tuple, w: str, w_scale: tuple, target: tuple,
                    stride_asm: int, n: int, k: int, numel: int, cfg: MoeConfig, example: dict, pieces: _Pieces,
                    a_rows: int | None, gated: bool, act: int, mul_weight: bool, atomic_topk: int,
                    quant_on_load: bool, stride_om: int, topk: int, quant_out: tuple | None = None) -> None:
        """A per_1x128 stage on the Gluon kernels (kernels/gluon_moe.py; `check_config` holds the config to them):
        w and (stage 1) the intermediate through TMA, A too (stage 2; stage 1 with GATHER_A) or stage 1 copying each
        pair's token row itself (cp.async; `a_rows` None); stage 1 with QUANT_OUT writes `target` in fp8 and the
        scales `quant_out` = (their piece, groups a row). ValueError where they cannot run this call."""
        from tritune.kernels import gluon_moe
        from tritune.kernels.gluon_gemm_ws import WS_LOADER_REGS, ws_maxnreg

        name = cfg.name(kernel, "per_1x128")
        w_t, ws_t = example[w], example[w_scale[1]]
        if not (gluon_moe.HAS_GLUON_HOPPER and w_t.is_cuda and torch.cuda.get_device_capability(w_t.device)[0] == 9):
            raise ValueError(f"{name}: GLUON runs on a Hopper GPU with Triton's Gluon API (Triton >= 3.5), not "
                             f"{w_t.device} with Triton {triton.__version__}")
        if kernel == "stage1" and (not gated or act != _ACT_ID["silu"] or mul_weight or n % cfg.BLOCK_SIZE_N):
            raise ValueError(f"{name}: GLUON's stage 1 is gated SiLU with the routing weights in stage 2 and an "
                             f"intermediate size (here {n}) a multiple of BLOCK_SIZE_N")
        if kernel == "stage2" and (not mul_weight or quant_on_load):
            raise ValueError(f"{name}: GLUON's stage 2 applies the routing weights itself and reads the quantized "
                             "intermediate (not quantized on load)")
        if ws_t.dim() != 3 or ws_t.stride(2) != 1:
            raise ValueError(f"{name}: GLUON takes per_1x128 weight scales [E, N/128, K/128], contiguous along K")
        bm, bn = cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N
        first = len(self.tma)
        maxnreg = None  # ptxas' own, but for the warp-specialised stage 1
        gather = kernel == "stage1" and a_rows is None  # the rows in token order, [tokens, K]
        tokens = numel // topk
        if gather and tokens * k >= 2**31:
            raise ValueError(f"{name}: the in-kernel gather addresses A with 32-bit offsets; {tokens} tokens x {k} "
                             "exceed them (use GATHER_A 1)")
        a_desc = self._descriptor(a, (tokens if gather else a_rows or self.inter_rows, k), pieces.items[a[1]][0],
                                  [bm, SCALE_BLOCK], example, "GLUON (A through TMA)", gluon=True)
        row, _ = weight_tma_view("per_1x128", k, bn, SCALE_BLOCK)
        w_desc = self._descriptor(("t", w), (w_t.numel() // row, row), w_t.dtype, [bn, SCALE_BLOCK], example,
                                  "GLUON (weights through TMA)", gluon=True)
        strides = (ws_t.stride(0), ws_t.stride(1), 1)
        blocks = self.align.gemm_blocks
        grid = (blocks * triton.cdiv(n, bn),)
        tail = [("v", v) for v in (cfg.GROUP_SIZE_M, cfg.num_stages, cfg.num_warps)]
        if kernel == "stage1":
            out_desc = self._descriptor(target, (self.inter_rows, n), pieces.items[target[1]][0], [bm, bn], example,
                                        "GLUON (the intermediate through TMA)", gluon=True)
            # A's rows by pointer too (read only with GATHER), the sorted pairs, their count, A's row stride
            counts = [("v", numel), ("v", k)]
            pointers = [a_desc, w_desc, out_desc, a_scale, w_scale, ("p", 1), ("p", 2), a, ("p", 0)]
            fn = gluon_moe.moe_stage1_kernel
            if cfg.PERSISTENT:  # a program a SM walks the filled blocks' tiles
                grid = (min(programs_per_wave(w_t.device), grid[0]),)
                counts.append(("v", grid[0]))
                fn = gluon_moe.moe_stage1_persistent_kernel
                if cfg.WARP_SPEC:  # its loads from a loader warp group, whose registers the MMA warps take
                    fn, maxnreg = gluon_moe.moe_stage1_ws_kernel, ws_maxnreg(cfg.num_warps)
            if cfg.QUANT_OUT:  # a program a 128-column scale group, its scales beside the fp8 rows
                if quant_out is None or n % (2 * bn):
                    raise ValueError(f"{name}: QUANT_OUT needs the plan's fp8 intermediate and I (here {n}) a "
                                     f"multiple of {2 * bn}")
                grid = (blocks * (n // (2 * bn)),)
                pointers.append(quant_out[0])
                counts.append(("v", quant_out[1]))
                fn = gluon_moe.moe_stage1_q_kernel
            recipe = pointers + [("v", v) for v in (n, k, blocks, stride_asm, 1, *strides)] + counts + tail + [
                ("v", gather), ("v", topk)]
            if cfg.QUANT_OUT:  # the 16-bit type the intermediate would have had, for its rounding
                recipe.append(("v", example["hidden"].dtype == torch.float16))
        else:
            values = (numel, n, k, blocks, stride_asm, 1, *strides, stride_om)
            fn = gluon_moe.moe_stage2_kernel
            if cfg.PERSISTENT:  # a program a SM walks the filled blocks' tiles
                grid = (min(programs_per_wave(w_t.device), grid[0]),)
                values += (grid[0],)
                fn = gluon_moe.moe_stage2_persistent_kernel
                if cfg.WARP_SPEC:  # its loads from a loader warp group, whose registers the MMA warps take
                    fn, maxnreg = gluon_moe.moe_stage2_ws_kernel, ws_maxnreg(cfg.num_warps)
            # atomic_topk: each row added into its token's row of the [T, D] accumulator (`target`; its dtype says
            # fp32 or 16-bit)
            recipe = [a_desc, w_desc, target, a_scale, w_scale, ("p", 0), ("p", 1), ("t", "topk_weights"),
                      ("p", 2)] + [("v", v) for v in values] + tail + [("v", atomic_topk)]
        if maxnreg is not None:  # warp-specialised: the launcher takes every parameter, the loader's registers too
            recipe.append(("v", WS_LOADER_REGS))
        # Not a programmatic dependent: the Gluon kernels do not wait on the previous launch's grid themselves.
        self._bind(fn, grid, recipe, example, pieces, cfg.num_warps, cfg.num_stages, False, maxnreg)
        self._cache_descriptors(first, w_t)

    def _cache_descriptors(self, first: int, w_t: torch.Tensor) -> None:
        """The last bound kernel's TMA operands (self.tma[first:], in signature order): each one's descriptor cache
        (GPU) and its launch-argument width."""
        bound = self.calls[-1][0]
        for nth, tma in enumerate(self.tma[first:]):
            encode = partial(bound.encode, nth=nth)
            if w_t.is_cuda:
                tma.cache = DescriptorCache(tma.shape, row_major_strides(tma.shape), tma.dtype, tma.block,
                                            encode=encode)
                # How many launch arguments one descriptor takes, from a real (small) tensor: encoding the binding's
                # mock tensor of a workspace piece would hand the driver a null address.
                sample = torch.empty((*tma.block[:-1], tma.shape[-1]), dtype=tma.dtype, device=w_t.device)
                tma.width = len(encode(TensorDescriptor.from_tensor(sample, tma.block)))
            else:
                tma.width = len(encode(tma.example))

    def _bind_2stage(self, hidden, w1, w2, topk_weights, w1_scale, w2_scale, pieces: _Pieces, cfg1: MoeConfig,
                     cfg2: MoeConfig, numel: int, tokens: int, topk: int, inter_dim: int, model_dim: int,
                     activation: str, quant: str, doweight_stage1: bool, group: int) -> None:
        example = {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": topk_weights, "w1_scale": w1_scale,
                   "w2_scale": w2_scale, "out": torch.empty((tokens, model_dim), device=hidden.device,
                                                            dtype=hidden.dtype)}
        dummy = ("p", self.dummy)
        quantized = quant in FP8_QUANTS  # the activations and the intermediate; MXFP4 keeps them 16-bit
        a1, s1 = (("p", self.q1), ("p", self.q1 + 1)) if quantized else (("t", "hidden"), dummy)
        stride_asm1 = self.align.groups if quant == "per_1x128" else 0
        if self.k32_ride:  # the swapped MXFP4 stage 1 reads hidden in the K32 order, copied by the sort's launch
            a1 = ("p", self.q1)
        gathered_rows = None
        if cfg1.GATHER_A:  # stage 1's A (and its scales) copied into the sort's order, then read through TMA
            gathered_rows = self.align.sorted_rows
            groups = self.align.groups if quantized else 1
            a_dt = pieces.items[a1[1]][0] if a1[0] == "p" else hidden.dtype
            ga = pieces.add(a_dt, gathered_rows * model_dim)
            gs = pieces.add(_F32, gathered_rows * groups) if quantized else self.dummy
            grid, block_c = gather_grid(gathered_rows, model_dim)
            self._bind(_gather_rows_kernel, grid, [a1, s1, ("p", ga), ("p", gs), ("p", 0), ("p", 2)] + [
                ("v", v) for v in (numel, gathered_rows, model_dim, groups, topk, quantized,
                                   triton.next_power_of_2(groups), GATHER_ROWS, block_c)], example, pieces, 4, 1)
            a1, s1 = ("p", ga), ("p", gs) if quantized else dummy
        rows = self.inter_rows  # numel, or the sort's padded length with SORTED_INTER
        quant_out = None
        if cfg1.QUANT_OUT:  # stage 1 writes the fp8 intermediate and its 1x128 scales: no quantization launch
            groups2 = triton.cdiv(inter_dim, SCALE_BLOCK)
            inter = self.inter_piece = pieces.add(_FP8, rows * inter_dim)
            quant_out = (("p", pieces.add(_F32, rows * groups2)), groups2)
        else:
            inter = self.inter_piece = pieces.add(hidden.dtype, rows * inter_dim)
        n_w1 = inter_dim * (2 if self.gated else 1)
        split1 = cfg1.KSPLIT > 1
        target1 = pieces.add(_F32, cfg1.KSPLIT * rows * n_w1) if split1 else inter
        ws1 = ("t", "w1_scale") if quant != "none" else dummy
        # stage 1 records the intermediate's amax, stage 2 quantizes as it loads (not where stage 1 quantizes itself)
        fused = self.fused_quant and quant_out is None
        amax = ("p", self.align.zero_piece) if fused else dummy
        amax_out = (2 if quant == "per_1x128" else 1) if fused else 0
        self._gemm(kernel="stage1", a=a1, a_scale=s1, w="w1", w_scale=ws1, target=("p", target1),
                   stride_asm=stride_asm1,
                   amax=amax, stride_amax=self.amax_groups if fused else 0, amax_out=amax_out, quant_on_load=False,
                   n=inter_dim, k=model_dim, numel=numel, cfg=cfg1, stride_om=n_w1 if split1 else inter_dim,
                   stride_ok=rows * n_w1 if split1 else 0, a_row_div=topk, gated=self.gated,
                   act=_ACT_ID[activation], mul_weight=doweight_stage1, quant=quant, example=example, pieces=pieces,
                   scale_strides=self._w_strides[0], out_sorted=bool(self.sorted_inter),
                   a_sorted=2 if cfg1.GATHER_A else 0, a_rows=gathered_rows,
                   out_k32=k32_input(cfg2, quant, self.swizzled[1]), swizzled=self.swizzled[0], quant_out=quant_out)
        if split1:
            block = min(triton.next_power_of_2(inter_dim), 1024)
            self._bind(_stage1_finish_kernel, (rows, triton.cdiv(inter_dim, block)),
                       [("p", target1), ("p", inter), ("t", "topk_weights"), ("p", 0)] + [("v", v) for v in (
                           inter_dim, numel, rows * n_w1, n_w1, cfg1.KSPLIT, self.gated, _ACT_ID[activation],
                           doweight_stage1, block, bool(self.sorted_inter), self.pdl)], example, pieces, 4, 1,
                       self.pdl)
        a2, s2, stride_asm2 = ("p", inter), dummy, 0
        if quant_out is not None:
            s2, stride_asm2 = quant_out
        elif fused:
            s2, stride_asm2 = amax, self.amax_groups if quant == "per_1x128" else 0
        elif quantized:  # sorted: every row of the padded length, those past the padded count unwritten and unread
            self.quant2 = QuantLaunch(hidden.dtype, rows, inter_dim, inter_dim, group)
            q2 = pieces.extend(self.quant2.pieces)
            a2, s2 = ("p", q2), ("p", q2 + 1)
            stride_asm2 = self.quant2.groups if quant == "per_1x128" else 0
            self.calls.append((self.quant2.bound, ((_SOURCE["p"], inter), (_SOURCE["p"], q2), (_SOURCE["p"], q2 + 1))))
        direct = topk == 1 and cfg2.KSPLIT == 1
        split2 = cfg2.KSPLIT > 1 and not self.topk_atomic
        if direct:
            target2 = ("t", "out")
        elif self.topk_atomic:  # every split and slot adds into the [T, D] accumulator (fp32, or 16-bit with
            # TOPK_ATOMIC 2) the sort zeroed
            target2 = ("p", self.align.zero2_piece)
        else:
            target2 = ("p", pieces.add(_F32 if split2 else hidden.dtype, cfg2.KSPLIT * numel * model_dim))
        ws2 = ("t", "w2_scale") if quant != "none" else dummy
        self._gemm(kernel="stage2", a=a2, a_scale=s2, w="w2", w_scale=ws2, target=target2, stride_asm=stride_asm2,
                   amax=dummy, stride_amax=0, amax_out=0, quant_on_load=fused, n=model_dim, k=inter_dim,
                   numel=numel, cfg=cfg2, stride_om=model_dim, stride_ok=numel * model_dim if split2 else 0,
                   a_row_div=1, gated=False, act=_ACT_ID["none"], mul_weight=not doweight_stage1, quant=quant,
                   example=example, pieces=pieces, scale_strides=self._w_strides[1], a_sorted=self.sorted_inter,
                   atomic_topk=topk if self.topk_atomic else 0, swizzled=self.swizzled[1])
        if self.topk_atomic:
            n = tokens * model_dim
            self._bind(_acc_to_out_kernel, (triton.cdiv(n, 1024),),
                       [target2, ("t", "out"), ("v", n), ("v", 1024), ("v", False)], example, pieces, 4, 1)
        elif not direct:
            block = min(triton.next_power_of_2(model_dim), 1024)
            self._bind(_topk_sum_kernel, (tokens, triton.cdiv(model_dim, block)),
                       [target2, ("t", "out")] + [("v", v) for v in (
                           model_dim, numel * model_dim if split2 else 0, topk, cfg2.KSPLIT, block, self.pdl)],
                       example, pieces, 4, 1, self.pdl)

    def _bind_1stage(self, hidden, w1, w2, topk_weights, w1_scale, w2_scale, pieces: _Pieces, cfg: MoeConfig,
                     numel: int, topk: int, inter_dim: int, model_dim: int, activation: str, quant: str) -> None:
        example = {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": topk_weights, "w1_scale": w1_scale,
                   "w2_scale": w2_scale, "out": torch.empty((self.tokens, model_dim), device=hidden.device,
                                                            dtype=hidden.dtype)}
        acc = ("p", self.align.zero_piece)  # zeroed by the sort's first launch
        if cfg.SWAP_AB:
            self._bind_1stage_swap(example, pieces, cfg, numel, topk, inter_dim, model_dim, activation, quant)
            n = self.tokens * model_dim
            self._bind(_acc_to_out_kernel, (triton.cdiv(n, 1024),),
                       [acc, ("t", "out"), ("v", n), ("v", 1024), ("v", self.pdl)], example, pieces, 4, 1, self.pdl)
            return
        dummy = ("p", self.dummy)
        fp8_a = quant in FP8_QUANTS  # activations quantized by the sort's first launch
        a, s = (("p", self.q1), ("p", self.q1 + 1)) if fp8_a else (("t", "hidden"), dummy)
        ws1, ws2 = (("t", "w1_scale"), ("t", "w2_scale")) if quant != "none" else (dummy, dummy)
        num_pid_m = self.align.gemm_blocks
        final, count = (("t", "out"), ("p", self.align.zero2_piece)) if self.final_cast else (dummy, dummy)
        recipe = [a, s, ("t", "w1"), ws1, ("t", "w2"), ws2, acc, ("p", 0), ("p", 1), ("p", 2),
                  ("t", "topk_weights"), final, count]
        recipe += [("v", v) for v in (
            numel, inter_dim, model_dim, num_pid_m, model_dim,
            self.align.groups if quant == "per_1x128" else 0,
            w1.stride(0), w1.stride(1), *self._w_strides[0], w2.stride(0), w2.stride(1), *self._w_strides[1],
            topk, self.gated, _ACT_ID[activation], quant_id(quant), cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N,
            cfg.BLOCK_SIZE_K, cfg.BLOCK_SIZE_D, cfg.GROUP_SIZE_M, model_dim % cfg.BLOCK_SIZE_K == 0,
            hidden.dtype == torch.float16, self.final_cast)]
        grid = (num_pid_m * triton.cdiv(inter_dim, cfg.BLOCK_SIZE_N),)
        self._bind(_moe_1stage_kernel, grid, recipe, example, pieces, cfg.num_warps, cfg.num_stages)
        if self.final_cast:
            return
        n = self.tokens * model_dim
        self._bind(_acc_to_out_kernel, (triton.cdiv(n, 1024),), [acc, ("t", "out"), ("v", n), ("v", 1024),
                                                                  ("v", False)], example, pieces, 4, 1)

    def _bind_1stage_swap(self, example: dict, pieces: _Pieces, cfg: MoeConfig, numel: int, topk: int,
                          inter_dim: int, model_dim: int, activation: str, quant: str) -> None:
        """The swapped MXFP4 1-stage kernel (`_moe_1stage_swap_kernel`): hidden in the K32 order (copied by the sort's
        first launch) for standard packed bytes, as it is for prepared weights; each weight and its scales through TMA
        or by pointers as `cfg` says."""
        check_compiles_here(cfg, "1stage", quant, triton.__version__, interpreting())
        if self.swizzled[0]:  # a gated w1's up rows on a tile-major chunk, as the stage GEMMs need
            check_swizzled(cfg, quant, "1stage", inter_dim, self.gated)
        if cfg.SCALE_TMA:  # and on a record
            check_scale_records(cfg, inter_dim, self.gated)
        if self.swizzled[0] != self.swizzled[1]:
            raise ValueError("the swapped 1-stage kernel needs w1 and w2 both prepared (prepare_mxfp4_weights) or "
                             "both standard packed bytes")
        first = len(self.tma)
        operands = []
        # (weight, its scales, its K, the tile's rows, its K step, the scales' strides when read by pointers)
        for w, ws, k, rows, k_step, strides in (
                ("w1", "w1_scale", model_dim, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K, self._w_strides[0]),
                ("w2", "w2_scale", inter_dim, cfg.BLOCK_SIZE_D, cfg.BLOCK_SIZE_N, self._w_strides[1])):
            w_t = example[w]
            desc = ("t", w)
            if cfg.USE_TMA:
                desc = self._weight_operand(w, quant, k, rows, k_step, self.swizzled[0], example)
            scale, strides = self._scale_operand(("t", ws), cfg, "1stage", quant, rows, strides, example)
            operands.append((("t", w), desc, scale, (w_t.stride(0), w_t.stride(1), *strides)))
        (w1, d1, s1, st1), (w2, d2, s2, st2) = operands
        num_pid_m = self.align.gemm_blocks
        split = cfg.KSPLIT > 1  # stage 1's partial sums by pair, and the counters the sort zeroes
        part = ("p", pieces.add(_F32, cfg.KSPLIT * numel * inter_dim * (2 if self.gated else 1))) if split else \
            ("p", self.dummy)
        count = ("p", self.align.zero2_piece) if split else ("p", self.dummy)
        k_per_split = triton.cdiv(triton.cdiv(model_dim, cfg.KSPLIT), cfg.BLOCK_SIZE_K) * cfg.BLOCK_SIZE_K
        hidden = ("p", self.q1) if self.k32_ride else ("t", "hidden")  # prepared weights read hidden in K order
        recipe = [hidden, w1, d1, s1, w2, d2, s2, ("p", self.align.zero_piece), ("p", 0), ("p", 1),
                  ("p", 2), ("t", "topk_weights"), part, count]
        tiles = num_pid_m * triton.cdiv(inter_dim, cfg.BLOCK_SIZE_N)
        trace = fused_moe_1stage.TRACE and not interpreting()
        self.trace_piece = pieces.add(_F32, 2 * fused_moe_1stage.TRACE_SLOTS * tiles * cfg.KSPLIT) if trace else None
        recipe.append(("p", self.trace_piece if trace else self.dummy))
        recipe += [("v", v) for v in (
            numel, inter_dim, model_dim, num_pid_m, k_per_split, model_dim, *st1, *st2, topk, self.gated,
            _ACT_ID[activation], quant_id(quant), cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K,
            cfg.BLOCK_SIZE_D, cfg.GROUP_SIZE_M, model_dim % cfg.BLOCK_SIZE_K == 0, bool(cfg.USE_TMA),
            bool(cfg.SCALE_TMA), self.swizzled[0], cfg.KSPLIT, self.pdl, coop_split(cfg),
            fused_moe_1stage.COOP_TICKET, trace, fused_moe_1stage.prefetch_w2(cfg))]
        grid = (tiles * cfg.KSPLIT,) if coop_split(cfg) else (tiles, cfg.KSPLIT)
        cap = register_cap(cfg, numel, example["w1"].shape[0], inter_dim, sm_count_for(example["hidden"].device))
        self._bind(_moe_1stage_swap_kernel, grid, recipe, example, pieces, cfg.num_warps, cfg.num_stages, self.pdl,
                   cap)
        self._cache_descriptors(first, example["w1"])

    def trace_stamps(self) -> torch.Tensor:
        """The last call's phase stamps of the swapped 1-stage kernel, int64 [programs, TRACE_SLOTS] (a view into the
        kept scratch: read it before the next call). ValueError when the plan was bound without TRACE."""
        piece = None if self.trace_piece is None else self.workspace.last_piece(self.trace_piece)
        if piece is None:
            raise ValueError("no phase stamps: bind the plan with fused_moe_1stage.TRACE on a GPU and call it first")
        return piece.view(torch.int64).view(-1, fused_moe_1stage.TRACE_SLOTS)

    def __call__(self, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, w1_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                 out: torch.Tensor, addresses: tuple[int, ...] | None = None) -> torch.Tensor:
        """Run the bound launches into `out` [T, D] (hidden's dtype) and return it.

        `addresses` (GPU only): the data pointers of (hidden, w1, w2, topk_weights, w1_scale or 0, w2_scale or 0,
        out, topk_ids), which the op has already read; the launches then take them instead of the tensors.
        """
        keep, p = self.workspace.allocate(hidden.device)  # noqa: F841 (alive until every launch is queued)
        if addresses is not None and self.ids_contiguous:
            head = addresses
        else:
            ids = topk_ids if self.ids_contiguous else topk_ids.contiguous()
            head = (hidden, split_weights(w1)[0], split_weights(w2)[0], topk_weights, w1_scale, w2_scale, out, ids)
        flat = self.flat_arguments(head, p)
        for launch, getter in self.steps:
            launch(*getter(flat))
        return out

    def flat_arguments(self, head: tuple, pieces: tuple) -> tuple:
        """What every step's getter picks its launch arguments from: the call's tensors (or their addresses), the
        workspace pieces, then each TMA operand's descriptor (cached for the few bases that repeat)."""
        descs = ()
        for tma in self.tma:
            kind, key = tma.source
            base = head[_TENSORS.index(key)] if kind == "t" else pieces[key]
            if tma.cache is not None:  # weights and the kept workspace: the same few addresses call after call
                descs += tma.cache.get(base if isinstance(base, int) else base.data_ptr())
            else:
                view = tma.view(base) if tma.view else base.view(tma.shape)
                descs += (TensorDescriptor.from_tensor(view, tma.block),)
        return (*head, *pieces, *descs)
