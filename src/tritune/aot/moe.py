"""Fused-MoE GEMM kernels (stage 1: gate-up + activation; stage 2: down, routing weight per pair) as bundle
plans: the data set (inputs once; per BLOCK_SIZE_M the sort with moe_align_block_size's padding and the
expected output), the run spec, and the configs; plus `MoeGemmTunable`, the same launch timed by the engine
through Triton's JIT, so AOT and JIT numbers compare like for like.

An artifact runs exactly one `_moe_gemm_kernel` launch on a ready sort, without split-K (its reduction is a
second kernel), TMA descriptors (the generic main passes plain pointers) or the op-level SORTED_INTER / TOPK_ATOMIC
(the default, pair-order variant only). The grid is computed from the
padded token count of the data set for the artifact's BLOCK_SIZE_M.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tritune.aot.plan import TRITON_DTYPE, KernelPlan, aot_space, data_name, param_names_of
from tritune.aot.spec import RunSpec, SpecArg, SpecTolerance
from tritune.aot.tdat import write_tensor
from tritune.device import DeviceInfo
from tritune.kernels import fused_moe as fm
from tritune.kernels.moe_align import moe_align_block_size_reference
from tritune.store.fmoe_rows import FmoeShape
from tritune.tuners.fused_moe_tunable import DTYPES, FusedMoeTunable, MoeProblem, config_of
from tritune.tuning.types import Config

MOE_KERNELS = ("stage1", "stage2")
# The default AOT space: 4 x 2 x 2 x 2 = 32 configs per stage before pruning.
AOT_MOE_SPACE: dict[str, tuple] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (64, 128),
    "BLOCK_SIZE_K": (64, 128),
    "GROUP_SIZE_M": (8,),
    "num_warps": (4, 8),
    "num_stages": (3,),
}
_FIXED = {"KSPLIT": (1,), "USE_TMA": (0,)}
_ENTRY = "from tritune.kernels.fused_moe import _moe_gemm_kernel  # noqa: F401\n"


def shape_tag(shape: FmoeShape) -> str:
    return (f"T={shape.token}-D={shape.model_dim}-I={shape.inter_dim}-E={shape.expert}-topk={shape.topk}"
            f"-{shape.dtype}")


def check_shape(shape: FmoeShape) -> None:
    """The fused-MoE problems an artifact can run; one-line ValueError otherwise."""
    if shape.q_type != "none":
        raise ValueError(f"aot: fused-MoE q_type {shape.q_type!r} is not supported ahead of time (bf16/fp16 only)")
    if not shape.use_g1u1:
        raise ValueError("aot: fused-MoE artifacts need gate and up fused (use_g1u1)")


def moe_configs(problem: MoeProblem, device: DeviceInfo, space: Mapping[str, tuple] | None = None) -> list[dict]:
    """The pruned configs of `space` (default AOT_MOE_SPACE) for one stage, split-K and TMA fixed off."""
    tunable = FusedMoeTunable(stage_space=tuple(aot_space(AOT_MOE_SPACE, space, _FIXED).items()))
    kept = tunable.space(problem, device).prune().kept
    return [c.as_dict() for c in kept]


def artifact_id(kind: str, params: Mapping[str, int]) -> str:
    """The kernel name the tuned CSV uses, e.g. moe_stage1_none_silu_BM64_BN128_BK64_GM8_W4_S3_KS1_TMA0."""
    return fm.MoeConfig.from_params(dict(params)).name(kind)


def stage2_pair_reference(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """What the stage-2 GEMM writes before the top-k sum: fp32 [T·topk, D], each pair times its weight."""
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros((ids.numel(), w2.shape[1]), dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        pairs = (ids == e).nonzero().squeeze(1)
        out[pairs] = (inter[pairs].float() @ w2[e].float().T) * weights[pairs, None]
    return out


def write_moe_data(bundle: Path, shape: FmoeShape, kinds: tuple[str, ...], block_sizes: list[int],
                   seed: int = 0, skew: float = 0.0) -> None:
    """Inputs once; per BLOCK_SIZE_M the sort and each stage's expected output (named by BLOCK_SIZE_M and shape).

    Inputs are the engine's own (`FusedMoeTunable.make_inputs`, same seed and routing), made on the CPU.
    """
    tag = shape_tag(shape)
    dt = DTYPES[shape.dtype]
    tunable = FusedMoeTunable()
    problem = MoeProblem(shape, "stage1", skew)
    x = tunable.make_inputs(problem, torch.device("cpu"), seed)
    meta = {"shape_tag": tag, "seed": seed, "skew": repr(skew)}
    (bundle / "data").mkdir(parents=True, exist_ok=True)

    def put(what: str, tensor: torch.Tensor, bm: int | None = None, **extra) -> None:
        write_tensor(bundle / data_name(what, tag, bm), what, tensor, meta | extra)

    put("hidden", x["hidden"])
    put("topk_weights", x["topk_weights"].float())
    put("topk_ids", x["topk_ids"].to(torch.int32))
    inter_ref = tunable.reference(problem, x)
    if "stage1" in kinds:
        put("w1", x["w1"])
    if "stage2" in kinds:
        put("w2", x["w2"])
        inter = inter_ref.to(dt)
        put("inter", inter)
        out2 = stage2_pair_reference(inter, x["w2"], x["topk_weights"], x["topk_ids"]).to(dt)
    out1 = inter_ref.to(dt)
    for bm in block_sizes:
        sorting = moe_align_block_size_reference(x["topk_ids"], bm, shape.expert)
        put("sorted_token_ids", sorting.sorted_token_ids, bm, block_size_m=bm)
        put("expert_ids", sorting.expert_ids, bm, block_size_m=bm)
        put("num_tokens_post_padded", sorting.num_tokens_post_padded, bm, block_size_m=bm)
        if "stage1" in kinds:
            put("stage1_expected", out1, bm, block_size_m=bm)
        if "stage2" in kinds:
            put("stage2_expected", out2, bm, block_size_m=bm)


def moe_spec(kind: str, shape: FmoeShape, tolerance: SpecTolerance) -> RunSpec:
    """Arguments of `_moe_gemm_kernel` in declaration order; the grid covers the padded count of this sort."""
    tag = shape_tag(shape)
    bm = "{BLOCK_SIZE_M}"
    stage1 = kind == "stage1"
    n, k = (shape.inter_dim, shape.model_dim) if stage1 else (shape.model_dim, shape.inter_dim)
    n_w = 2 * n if stage1 else n
    args = [
        SpecArg("a_ptr", "in", data_name("hidden" if stage1 else "inter", tag)),
        SpecArg("a_desc", "scratch", "16"),
        SpecArg("a_scale_ptr", "scratch", "16"),
        SpecArg("w_ptr", "in", data_name("w1" if stage1 else "w2", tag)),
        SpecArg("w_desc", "scratch", "16"),
        SpecArg("w_scale_ptr", "scratch", "16"),
        SpecArg("out_ptr", "out", data_name(f"{kind}_expected", tag, bm)),
        SpecArg("sorted_ids_ptr", "in", data_name("sorted_token_ids", tag, bm)),
        SpecArg("expert_ids_ptr", "in", data_name("expert_ids", tag, bm)),
        SpecArg("num_post_ptr", "in", data_name("num_tokens_post_padded", tag, bm)),
        SpecArg("weights_ptr", "in", data_name("topk_weights", tag)),
        SpecArg("amax_ptr", "scratch", "16"),
        SpecArg("numel", "i32", "numel(weights_ptr)"),
        SpecArg("N", "i32", str(n)),
        SpecArg("K", "i32", str(k)),
        SpecArg("k_per_split", "i32", "cdiv(K, BLOCK_SIZE_K) * BLOCK_SIZE_K"),
        SpecArg("num_pid_m", "i32", "cdiv(first(num_post_ptr), BLOCK_SIZE_M)"),
        SpecArg("stride_am", "i32", "K"),
        SpecArg("stride_asm", "i32", "0"),
        SpecArg("stride_we", "i32", f"{n_w} * K"),
        SpecArg("stride_wn", "i32", "K"),
        SpecArg("stride_wse", "i32", "0"),
        SpecArg("stride_wsn", "i32", "0"),
        SpecArg("stride_om", "i32", "N"),
        SpecArg("stride_ok", "i32", "0"),
        SpecArg("stride_amax", "i32", "0"),
    ]
    return RunSpec(kernel=f"moe_{kind}", values=(), args=tuple(args),
                   grid=("num_pid_m * cdiv(N, BLOCK_SIZE_N)", "1", "1"), tolerance=tolerance)


def _constexprs(kind: str, shape: FmoeShape) -> Callable[[Mapping[str, int]], dict[str, int]]:
    stage1 = kind == "stage1"
    k = shape.model_dim if stage1 else shape.inter_dim

    def constexprs(p: Mapping[str, int]) -> dict[str, int]:
        return {
            "A_ROW_DIV": shape.topk if stage1 else 1, "GATED": int(stage1), "ACT": fm._ACT_ID[shape.act_type]
            if stage1 else fm._ACT_ID["none"], "MUL_WEIGHT": int(shape.doweight_stage1 if stage1
                                                                 else not shape.doweight_stage1),
            "QUANT": 0, "BLOCK_SIZE_M": p["BLOCK_SIZE_M"], "BLOCK_SIZE_N": p["BLOCK_SIZE_N"],
            "BLOCK_SIZE_K": p["BLOCK_SIZE_K"], "GROUP_SIZE_M": p["GROUP_SIZE_M"], "KSPLIT": 1,
            "EVEN_K": int(k % p["BLOCK_SIZE_K"] == 0), "USE_TMA": 0, "AMAX_OUT": 0, "A_QUANT_ON_LOAD": 0,
            "OUT_SORTED": 0, "A_SORTED": 0, "ATOMIC_TOPK": 0, "SWAP_AB": 0, "WARP_SPEC": 0,
            "OUT_K32": 0, "SCALE_TMA": 0, "W_SWIZZLED": 0, "PDL": 0,
        }
    return constexprs


def spec_tolerance(shape: FmoeShape, kind: str) -> SpecTolerance:
    """The engine's own gate for this problem, so an artifact passes exactly when its JIT twin would."""
    tol = FusedMoeTunable().tolerance(MoeProblem(shape, kind))
    return SpecTolerance(tol.atol, tol.rtol, tol.max_mismatch_ratio, tol.max_rel_l2)


def moe_plans(bundle: Path, shape: FmoeShape, device: DeviceInfo, *, kinds: tuple[str, ...] = MOE_KERNELS,
              space: Mapping[str, tuple] | None = None, configs: Mapping[str, list[dict]] | None = None,
              seed: int = 0, skew: float = 0.0) -> list[KernelPlan]:
    """One plan per stage in `kinds`, its data written into `bundle`. `configs[kind]` overrides the space."""
    check_shape(shape)
    bad = [k for k in kinds if k not in MOE_KERNELS]
    if bad or not kinds:
        raise ValueError(f"aot: fused-MoE kernels {bad or '(none)'}: expected some of {', '.join(MOE_KERNELS)}")
    chosen = {}
    for kind in kinds:
        given = (configs or {}).get(kind)
        chosen[kind] = [_full_config(c) for c in given] if given else \
            moe_configs(MoeProblem(shape, kind, skew), device, space)
        if not chosen[kind]:
            raise ValueError(f"aot: no {kind} config survives pruning for {shape_tag(shape)}")
    block_sizes = sorted({c["BLOCK_SIZE_M"] for cs in chosen.values() for c in cs})
    write_moe_data(bundle, shape, kinds, block_sizes, seed, skew)
    plans = []
    for kind in kinds:
        plans.append(KernelPlan(
            name=f"moe_{kind}", entry_source=_ENTRY, function="_moe_gemm_kernel",
            param_names=param_names_of(fm._moe_gemm_kernel), spec=moe_spec(kind, shape, spec_tolerance(shape, kind)),
            configs=chosen[kind], constexprs=_constexprs(kind, shape),
            artifact_id=lambda p, kind=kind: artifact_id(kind, p),
            source="tritune.kernels.fused_moe:_moe_gemm_kernel",
            pointer_dtypes={"a_desc": TRITON_DTYPE[shape.dtype], "a_scale_ptr": "fp32",
                            "w_desc": TRITON_DTYPE[shape.dtype], "w_scale_ptr": "fp32", "amax_ptr": "fp32"},
            problem={"kind": kind, "shape": shape.key(), "skew": skew, "seed": seed},
            store={"kind": "fmoe", "stage": kind, "shape": asdict(shape)}))
    return plans


def _full_config(params: Mapping[str, int]) -> dict:
    """A config as given by the user (kernel name fields) with every MoeConfig field present."""
    cfg = fm.MoeConfig.from_params(dict(params))
    if cfg.KSPLIT != 1 or cfg.USE_TMA or cfg.SWAP_AB:
        raise ValueError(f"aot: {cfg.name('stage1')}: split-K, TMA and SWAP_AB configs are not supported ahead of "
                         "time")
    if any(getattr(cfg, name) for name in fm.PLAN_FIELDS):
        raise ValueError(f"aot: {cfg.name('stage1')}: {', '.join(fm.PLAN_FIELDS)} are options of the whole op, "
                         "not of one stage's artifact")
    return {k: getattr(cfg, k) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                         "num_warps", "num_stages", "KSPLIT", "USE_TMA")}


@dataclass(frozen=True)
class MoeGemmTunable(FusedMoeTunable):
    """The artifacts' work through Triton's JIT: one `_moe_gemm_kernel` launch on a sort made outside the timed
    call, stage 2 writing per-pair outputs (no top-k sum), so AOT and JIT times measure the same kernel."""

    name: str = "fused_moe_gemm"

    def reference(self, problem: MoeProblem, inputs: dict) -> torch.Tensor:
        if problem.kind == "stage1":
            return super().reference(problem, inputs)
        x = inputs
        return stage2_pair_reference(x["inter"].cpu(), x["w2"].cpu(), x["topk_weights"].cpu(),
                                     x["topk_ids"].cpu()).to(x["inter"].device)

    def alloc_output(self, problem: MoeProblem, inputs: dict) -> torch.Tensor:
        s = problem.shape
        cols = s.inter_dim if problem.kind == "stage1" else s.model_dim
        return torch.empty((s.token * s.topk, cols), device=inputs["hidden"].device, dtype=DTYPES[s.dtype])

    def launcher(self, problem: MoeProblem, inputs: dict, config: Config, out: torch.Tensor) -> Callable[[], None]:
        s, x = problem.shape, inputs
        cfg = config_of(config)
        fm.check_config(cfg, problem.kind, s.q_type)
        sorting = moe_align_block_size_reference(x["topk_ids"], cfg.BLOCK_SIZE_M, s.expert)
        weights = x["topk_weights"].reshape(-1)
        if problem.kind == "stage1":
            kw = dict(n=s.inter_dim, k=s.model_dim, a_row_div=s.topk, gated=True, act=fm._ACT_ID[s.act_type],
                      mul_weight=s.doweight_stage1)
            a, w = x["hidden"], x["w1"]
        else:
            kw = dict(n=s.model_dim, k=s.inter_dim, a_row_div=1, gated=False, act=fm._ACT_ID["none"],
                      mul_weight=not s.doweight_stage1)
            a, w = x["inter"], x["w2"]
        return lambda: fm._launch_gemm(a, None, w, None, out, sorting, weights, quant="none", config=cfg, **kw)
