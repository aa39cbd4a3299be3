"""What users call at run time; each op picks its tuned config by itself."""

from tritune.kernels.mxfp4_records import Mxfp4Scales, prepare_mxfp4_scales
from tritune.kernels.mxfp4_swizzle import Mxfp4Weights, prepare_mxfp4_weights
from tritune.ops.fused_moe import (
    MoeChoice,
    fused_moe,
    fused_moe_a8w8,
    fused_moe_a8w8_blockscale,
    fused_moe_choice,
    fused_moe_mxfp4,
    heuristic_moe_choice,
    reload_moe_configs,
)
from tritune.ops.gemm import gemm, gemm_a8w8, gemm_a8w8_blockscale, reload_configs, select_config
from tritune.ops.routing import sample_routing, topk_softmax

__all__ = ["MoeChoice", "Mxfp4Scales", "Mxfp4Weights", "fused_moe", "fused_moe_a8w8", "fused_moe_a8w8_blockscale",
           "fused_moe_choice", "fused_moe_mxfp4", "gemm", "gemm_a8w8", "gemm_a8w8_blockscale", "heuristic_moe_choice",
           "prepare_mxfp4_scales", "prepare_mxfp4_weights", "reload_configs", "reload_moe_configs", "sample_routing",
           "select_config", "topk_softmax"]
