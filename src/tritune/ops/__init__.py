"""What users call at run time; each op picks its tuned config by itself."""

from tritune.ops.gemm import gemm, gemm_a8w8, gemm_a8w8_blockscale, reload_configs, select_config

__all__ = ["gemm", "gemm_a8w8", "gemm_a8w8_blockscale", "reload_configs", "select_config"]
