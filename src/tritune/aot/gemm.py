"""The dense GEMM (bf16/fp16, pointer kernel, no split-K) as a bundle plan: A, B and the expected C written
once, the run spec, and the configs (the tuner's default space with split-K and TMA fixed off, pruned by the
tuner's own rules for the target).

Split-K needs a second reduction launch and the persistent TMA kernel host-built descriptors, neither of
which one generic main launch can express; those configs stay JIT-only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from tritune.aot.plan import KernelPlan, aot_space, data_name, param_names_of
from tritune.aot.spec import RunSpec, SpecArg, SpecTolerance
from tritune.aot.tdat import write_tensor
from tritune.device import DeviceInfo
from tritune.tuners.gemm_tunable import DEFAULT_SPACE, GemmProblem, GemmTunable

_ENTRY = "from tritune.aot.entries import gemm_entry  # noqa: F401\n"
_FIXED = {"NUM_KSPLIT": (1,), "PERSISTENT_TMA": (False,), "SCALE_PIPELINE": (False,), "TAIL_SPLIT": (False,),
          "GLUON": (False,), "WARP_SPECIALIZE": (False,)}
_SHORT = {"BLOCK_SIZE_M": "BM", "BLOCK_SIZE_N": "BN", "BLOCK_SIZE_K": "BK", "GROUP_SIZE_M": "GM",
          "num_warps": "W", "num_stages": "S", "CACHE_CG": "CG"}


def shape_tag(p: GemmProblem) -> str:
    return f"M={p.M}-N={p.N}-K={p.K}-{p.dtype}"


def gemm_configs(problem: GemmProblem, device: DeviceInfo, space: Mapping[str, tuple] | None = None) -> list[dict]:
    """Pruned configs of the tuner's default space (or `space`), as AOT parameters (cache_modifier -> CACHE_CG)."""
    params = aot_space(DEFAULT_SPACE, space, _FIXED)
    kept = GemmTunable(space_params=tuple(params.items())).space(problem, device).prune().kept
    return [aot_params(c.as_dict()) for c in kept]


def aot_params(config: Mapping) -> dict[str, int]:
    bad = {k: config[k] for k in ("NUM_KSPLIT", "PERSISTENT_TMA", "SCALE_PIPELINE", "TAIL_SPLIT", "GLUON")
           if k in config and config[k] not in (1, False, 0)}
    if bad or config.get("NUM_KSPLIT", 1) != 1:
        raise ValueError(f"aot: GEMM config {dict(config)}: split-K, TMA and Gluon configs are not supported ahead "
                         "of time")
    return {"BLOCK_SIZE_M": int(config["BLOCK_SIZE_M"]), "BLOCK_SIZE_N": int(config["BLOCK_SIZE_N"]),
            "BLOCK_SIZE_K": int(config["BLOCK_SIZE_K"]), "GROUP_SIZE_M": int(config.get("GROUP_SIZE_M", 8)),
            "num_warps": int(config["num_warps"]), "num_stages": int(config["num_stages"]),
            "CACHE_CG": int(config.get("cache_modifier", "") == ".cg" or config.get("CACHE_CG", 0) == 1)}


def gemm_config_of(params: Mapping[str, int]) -> dict:
    """Inverse of aot_params: the GemmConfig fields the tuned JSON files hold."""
    return {"BLOCK_SIZE_M": params["BLOCK_SIZE_M"], "BLOCK_SIZE_N": params["BLOCK_SIZE_N"],
            "BLOCK_SIZE_K": params["BLOCK_SIZE_K"], "GROUP_SIZE_M": params["GROUP_SIZE_M"],
            "num_warps": params["num_warps"], "num_stages": params["num_stages"], "NUM_KSPLIT": 1,
            "cache_modifier": ".cg" if params["CACHE_CG"] else "", "PERSISTENT_TMA": False, "SCALE_PIPELINE": False}


def artifact_id(params: Mapping[str, int]) -> str:
    return "gemm_bf16_" + "_".join(f"{short}{params[long]}" for long, short in _SHORT.items())


def gemm_plans(bundle: Path, problem: GemmProblem, device: DeviceInfo, *, space: Mapping[str, tuple] | None = None,
               configs: list[dict] | None = None, seed: int = 0) -> list[KernelPlan]:
    if problem.kernel != "bf16":
        raise ValueError(f"aot: GEMM kernel {problem.kernel!r} is not supported ahead of time (bf16/fp16 only)")
    if problem.out_dtype != "bf16":  # the bundle's expected C and the imported files are bf16-output
        raise ValueError(f"aot: GEMM output dtype {problem.out_dtype!r} is not supported ahead of time (bf16 only)")
    chosen = [aot_params(c) for c in configs] if configs else gemm_configs(problem, device, space)
    if not chosen:
        raise ValueError(f"aot: no GEMM config survives pruning for {shape_tag(problem)}")
    tunable = GemmTunable()
    x = tunable.make_inputs(problem, torch.device("cpu"), seed)
    tag = shape_tag(problem)
    meta = {"shape_tag": tag, "seed": seed}
    (bundle / "data").mkdir(parents=True, exist_ok=True)
    write_tensor(bundle / data_name("a", tag), "a", x["a"], meta)
    write_tensor(bundle / data_name("b", tag), "b", x["b"], meta)
    expected = tunable.reference(problem, x).to(torch.bfloat16)  # the kernel writes bf16 (as the JIT op does)
    write_tensor(bundle / data_name("expected", tag), "expected", expected, meta)
    tol = tunable.tolerance(problem)
    spec = RunSpec(kernel="gemm_bf16", values=(), args=(
        SpecArg("a_ptr", "in", data_name("a", tag)),
        SpecArg("b_ptr", "in", data_name("b", tag)),
        SpecArg("c_ptr", "out", data_name("expected", tag)),
        SpecArg("a_scale_ptr", "scratch", "16"),
        SpecArg("b_scale_ptr", "scratch", "16"),
        SpecArg("M", "i32", str(problem.M)),
        SpecArg("N", "i32", str(problem.N)),
        SpecArg("K", "i32", str(problem.K)),
        SpecArg("k_per_split", "i32", "cdiv(K, BLOCK_SIZE_K) * BLOCK_SIZE_K"),
        SpecArg("stride_am", "i32", "K"),
        SpecArg("stride_bn", "i32", "K"),
        SpecArg("stride_cm", "i32", "N"),
        SpecArg("stride_ck", "i32", "0"),
        SpecArg("stride_asm", "i32", "0"),
        SpecArg("stride_bsn", "i32", "0"),
    ), grid=("cdiv(M, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N)", "1", "1"),
        tolerance=SpecTolerance(tol.atol, tol.rtol, tol.max_mismatch_ratio, tol.max_rel_l2))
    k = problem.K

    def constexprs(p: Mapping[str, int]) -> dict[str, int]:
        return {"QUANT": 0, "BLOCK_SIZE_M": p["BLOCK_SIZE_M"], "BLOCK_SIZE_N": p["BLOCK_SIZE_N"],
                "BLOCK_SIZE_K": p["BLOCK_SIZE_K"], "GROUP_SIZE_M": p["GROUP_SIZE_M"], "NUM_KSPLIT": 1,
                "EVEN_K": int(k % p["BLOCK_SIZE_K"] == 0), "CACHE_CG": p["CACHE_CG"]}

    from tritune.aot import entries

    return [KernelPlan(
        name="gemm_bf16", entry_source=_ENTRY, function="gemm_entry", param_names=param_names_of(entries.gemm_entry),
        spec=spec, configs=chosen, constexprs=constexprs, artifact_id=artifact_id,
        source="tritune.kernels.gemm:_gemm_kernel (via tritune.aot.entries:gemm_entry)",
        pointer_dtypes={"a_scale_ptr": "fp32", "b_scale_ptr": "fp32"}, do_not_specialize=("M", "stride_ck"),
        problem={"kernel": problem.kernel, "M": problem.M, "N": problem.N, "K": problem.K, "dtype": problem.dtype,
                 "seed": seed},
        store={"kind": "gemm", "tag": problem.tag, "M": problem.M, "N": problem.N, "K": problem.K,
               "flops": tunable.flops(problem), "bytes": tunable.bytes_moved(problem)})]
