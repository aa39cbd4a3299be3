"""The fused-MoE launch config: `MoeConfig` (one kernel's tiles and options, its CSV kernel name and back),
`check_config` (can this config run this kernel) and `check_plan` (can these two stage configs run together).

Host-only and hashable; `tritune.kernels.fused_moe` re-exports every name here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from tritune.kernels.mxfp4_records import RECORD_K, RECORD_ROWS
from tritune.kernels.triton_release import triton_release

ACTIVATIONS = ("silu", "gelu")
QUANT_TYPES = ("none", "per_token", "per_1x128")  # every kernel has these, the 1-stage one included
MXFP4 = "per_1x32"  # MXFP4 weights decoded in registers, 16-bit activations
MXFP4_A8 = "per_1x32_a8"  # MXFP4 weights, fp8 per-token activations (tl.dot_scaled)
MXFP4_QUANTS = (MXFP4, MXFP4_A8)  # the quantizations with MXFP4 weights
# Quantizations with fp8 activations (and a quantized intermediate); MXFP4_A8's are per token, like per_token's.
FP8_QUANTS = ("per_token", "per_1x128", MXFP4_A8)
ALL_QUANTS = (*QUANT_TYPES, *MXFP4_QUANTS)  # what the op, the tuner and the CSV take

KERNELS = ("stage1", "stage2", "1stage")
SCALE_BLOCK = 128
# Plan-level options (both stages carry the same value; MoeLaunch refuses a pair that disagrees). Off by default; a
# kernel name carries them only when on, so every name written before they existed reads back unchanged.
PLAN_FIELDS = ("SORTED_INTER", "TOPK_ATOMIC", "GATHER_A")
# Fields a kernel name shows only when on (so every name written before they existed reads back unchanged).
OPTIONAL_FIELDS = (*PLAN_FIELDS, "SWAP_AB", "WARP_SPEC", "PERSISTENT", "SCALE_TMA", "GLUON", "QUANT_OUT")


def act_group(quant: str) -> int:
    """Columns per activation scale for a quantization with fp8 activations: 0 (one per row) or 128 (1×128)."""
    return SCALE_BLOCK if quant == "per_1x128" else 0


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of one fused-MoE kernel candidate (stage 1, stage 2 or 1-stage).

    For 1-stage, BLOCK_SIZE_N tiles the intermediate dimension and BLOCK_SIZE_D the output columns.
    SORTED_INTER (2-stage plans): stage 1 writes the intermediate in the sort's padded, expert-grouped row order, so
    stage 2 reads each block's A rows contiguously (1: pointer loads; 2: through a TMA descriptor, Hopper, rows of
    16-byte multiples) and maps rows back to pairs in its epilogue. TOPK_ATOMIC (2-stage plans): stage 2 adds
    weight x row into an fp32 [T, D] accumulator with atomics instead of writing [T·topk, D] for the top-k sum kernel
    (not bit-deterministic: the order of the adds varies from run to run); 2 (the Gluon stage 2 only) into a [T, D]
    accumulator of the activations' 16-bit type, half the bytes, each add rounded. SWAP_AB (either stage kernel):
    the tile is computed transposed, w · aᵀ, so the wgmma's 64-row operand is the weight tile rather than a block of
    16 or 32 pairs (what vLLM does on Hopper when BLOCK_SIZE_M < 64 <= BLOCK_SIZE_N).
    """

    BLOCK_SIZE_M: int = 64
    BLOCK_SIZE_N: int = 64
    BLOCK_SIZE_K: int = 64
    GROUP_SIZE_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    KSPLIT: int = 1
    BLOCK_SIZE_D: int = 0  # 1-stage only
    USE_TMA: int = 0  # 2-stage only: weight tiles through a TMA descriptor (Hopper; K·itemsize a multiple of 16 bytes)
    SORTED_INTER: int = 0  # 2-stage plans: 0 pair order; 1 sorted rows; 2 sorted rows, stage 2 loads A through TMA
    TOPK_ATOMIC: int = 0  # 2-stage plans: stage 2 sums the top-k slots with atomics, 1 in fp32, 2 (Gluon) in 16 bits
    SWAP_AB: int = 0  # stage kernels: 1 = accumulate w · aᵀ, a wgmma's 64 rows from N (small blocks)
    WARP_SPEC: int = 0  # stage 2 with every load through TMA (USE_TMA, SORTED_INTER 2): a warp-specialised K loop;
    # a Gluon stage (GLUON, PERSISTENT): a loader warp group feeding the MMA warps
    GATHER_A: int = 0  # 2-stage plans: 1 = a launch copies stage 1's A rows into the sort's order, read through TMA
    PERSISTENT: int = 0  # stage 2 (Gluon: stage 1 too), loads through TMA: 1 = a persistent program walks tiles
    SCALE_TMA: int = 0  # swapped MXFP4 through TMA, BLOCK_K 128: 1 = the e8m0 codes through TMA too (mxfp4_records)
    # per_1x128 stage kernels on Hopper: 1 = the Gluon kernel (kernels/gluon_moe.py)
    GLUON: int = 0
    # the Gluon stage 1: 1 = it writes the intermediate quantized (fp8, a scale per 128 columns), no quantization launch
    QUANT_OUT: int = 0

    _SHORT = {"BLOCK_SIZE_M": "BM", "BLOCK_SIZE_N": "BN", "BLOCK_SIZE_K": "BK", "GROUP_SIZE_M": "GM",
              "num_warps": "W", "num_stages": "S", "KSPLIT": "KS", "BLOCK_SIZE_D": "BD", "USE_TMA": "TMA",
              "SORTED_INTER": "SI", "TOPK_ATOMIC": "TA", "SWAP_AB": "SW", "WARP_SPEC": "WS", "GATHER_A": "GA",
              "PERSISTENT": "PS", "SCALE_TMA": "ST", "GLUON": "GL", "QUANT_OUT": "QO"}

    @staticmethod
    def from_params(params: dict) -> MoeConfig:
        known = {f.name for f in fields(MoeConfig)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown fused-MoE config parameter(s) {unknown}")
        return MoeConfig(**params)

    def name(self, kernel: str, quant: str = "none", activation: str = "silu") -> str:
        """The kernel and its whole config, e.g. `moe_stage1_per_token_silu_BM64_BN128_BK128_GM8_W8_S3_KS1_TMA0`
        (`..._SI2_TA1` appended only when the plan-level options are on)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown fused-MoE kernel {kernel!r}; expected one of {KERNELS}")

        def shown(long: str) -> bool:
            if long == "BLOCK_SIZE_D":
                return kernel == "1stage"
            if long == "USE_TMA":  # the 1-stage kernel's names written before its TMA variant have no TMA field
                return kernel != "1stage" or self.USE_TMA != 0
            return long not in OPTIONAL_FIELDS or getattr(self, long) != 0

        parts = [f"{short}{getattr(self, long)}" for long, short in self._SHORT.items() if shown(long)]
        return f"moe_{kernel}_{quant}_{activation}_" + "_".join(parts)

    @staticmethod
    def parse_name(name: str) -> tuple[str, MoeConfig]:
        """Inverse of `name`: (kernel, config). ValueError naming the text when it is not one of ours."""
        fields_re = r"[A-Z]+\d+(?:_[A-Z]+\d+)*"  # one or more FIELD<int>, joined by single underscores
        quants = "|".join(ALL_QUANTS)
        m = re.fullmatch(rf"moe_(stage1|stage2|1stage)_({quants})_(silu|gelu)_({fields_re})", name)
        if not m:
            raise ValueError(f"not a tritune fused-MoE kernel name: {name!r}")
        by_short = {short: long for long, short in MoeConfig._SHORT.items()}
        params = {}
        for part in m.group(4).split("_"):
            short, value = re.fullmatch(r"([A-Z]+)(\d+)", part).groups()
            if short not in by_short:
                raise ValueError(f"kernel name {name!r}: unknown field {short!r}")
            params[by_short[short]] = int(value)
        return m.group(1), MoeConfig(**params)


# Stage kernels with BLOCK_SIZE_M under 16 (1, 2, 4 or 8 pairs a block) multiply-add in fp32 registers instead of
# tl.dot (which needs 16 rows): for decode, where an expert gets one or two pairs, the weight tile goes from memory
# (and, for MXFP4, its decode) straight into FMAs, with no round trip through shared memory into an MMA layout and
# no 16-row tile of which one row is real. 16-bit activations with 16-bit or MXFP4 weights; no TMA, SWAP_AB or plan
# levers (not built for it).
FMA_QUANTS = ("none", "per_1x32")
PERSISTENT_QUANTS = ("none", "per_token", "per_1x128")  # what the persistent stage 2 (fused_moe_persistent) runs
FMA_MAX_BLOCK_M = 8


def is_fma(config: MoeConfig) -> bool:
    """Whether a stage config takes the register multiply-add path (BLOCK_SIZE_M under 16)."""
    return config.BLOCK_SIZE_M <= FMA_MAX_BLOCK_M


def weight_tma_view(quant: str, k: int, tile_rows: int, k_step: int) -> tuple[int, list[int]]:
    """USE_TMA's view of a weight read by tiles of `tile_rows` rows and `k_step` K (a stage kernel's BLOCK_N and
    BLOCK_K): its row length in its own elements and one tile's box (MXFP4 rows hold K/2 packed bytes)."""
    if quant in MXFP4_QUANTS:
        return k // 2, [tile_rows, k_step // 2]
    return k, [tile_rows, k_step]


def scale_records_fit(quant: str, swap_ab: int, use_tma: int, block_k: int, block_n: int) -> bool:
    """Whether a stage tile can read its MXFP4 codes from their records (SCALE_TMA): the swapped GEMM through TMA,
    one record's K step (BLOCK_K 128) and whole 64-row records (check_config and the tuner's SCALE_RULE share it)."""
    return (quant == MXFP4 and bool(swap_ab) and bool(use_tma) and block_k == RECORD_K
            and block_n % RECORD_ROWS == 0)


def check_config(config: MoeConfig, kernel: str, quant: str) -> None:
    """ValueError (one line) when `config` cannot run `kernel` for `quant`; cheap, host-only."""
    for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        v = getattr(config, name)
        if v < 1 or v & (v - 1) or (v < 16 and name != "BLOCK_SIZE_M"):
            raise ValueError(f"{config.name(kernel, quant)}: {name}={v} must be a power of two >= 16"
                             + (" (or 1-8 pairs for a stage kernel's multiply-add path)" if name == "BLOCK_SIZE_M"
                                else ""))
    if is_fma(config) and (kernel == "1stage" or quant not in FMA_QUANTS or config.USE_TMA or config.SWAP_AB
                           or any(getattr(config, f) for f in PLAN_FIELDS)):
        raise ValueError(f"{config.name(kernel, quant)}: BLOCK_SIZE_M under 16 (the multiply-add path) is for stage "
                         f"kernels with quant {' or '.join(FMA_QUANTS)}, without TMA, SWAP_AB or "
                         f"{', '.join(PLAN_FIELDS)}")
    if config.KSPLIT < 1 or config.num_warps < 1 or config.num_stages < 1 or config.GROUP_SIZE_M < 1:
        raise ValueError(f"{config.name(kernel, quant)}: KSPLIT, num_warps, num_stages, GROUP_SIZE_M must be >= 1")
    if quant == "per_1x128" and SCALE_BLOCK % config.BLOCK_SIZE_K:
        raise ValueError(f"{config.name(kernel, quant)}: per_1x128 needs BLOCK_SIZE_K dividing 128")
    if quant in MXFP4_QUANTS and (config.BLOCK_SIZE_K < 32 or (kernel == "1stage" and config.BLOCK_SIZE_N < 32)):
        raise ValueError(f"{config.name(kernel, quant)}: MXFP4 (per_1x32) needs BLOCK_SIZE_K >= 32 (whole scale "
                         "blocks; the 1-stage kernel's BLOCK_SIZE_N too: it slices w2 along K by it)")
    if quant in MXFP4_QUANTS and config.USE_TMA and not (quant == MXFP4 and config.SWAP_AB):
        raise ValueError(f"{config.name(kernel, quant)}: MXFP4 weights come through TMA only in the swapped GEMM "
                         "(SWAP_AB 1, 16-bit activations)")
    if config.SORTED_INTER not in (0, 1, 2) or config.TOPK_ATOMIC not in (0, 1, 2) or any(
            getattr(config, f) not in (0, 1) for f in ("SWAP_AB", "GATHER_A")):
        raise ValueError(f"{config.name(kernel, quant)}: SORTED_INTER and TOPK_ATOMIC must be 0, 1 or 2, SWAP_AB and "
                         "GATHER_A 0 or 1")
    if config.TOPK_ATOMIC == 2 and not config.GLUON:
        raise ValueError(f"{config.name(kernel, quant)}: TOPK_ATOMIC 2 (adds into a 16-bit accumulator) is the Gluon "
                         "stage 2's (GLUON 1); the Triton kernels add in fp32 (TOPK_ATOMIC 1)")
    gluon_ws = config.GLUON and config.WARP_SPEC  # a Gluon stage kernel's loader partition (gluon_problem checks it)
    if config.WARP_SPEC not in (0, 1) or (config.WARP_SPEC and not gluon_ws and (
            kernel != "stage2" or not config.USE_TMA or config.SORTED_INTER != 2)):
        raise ValueError(f"{config.name(kernel, quant)}: WARP_SPEC (0 or 1) is for stage 2 with every load through "
                         "TMA (USE_TMA 1 and SORTED_INTER 2), or a Gluon stage kernel's (GLUON 1)")
    if config.PERSISTENT not in (0, 1) or (config.PERSISTENT and (
            (kernel != "stage2" and not (kernel == "stage1" and config.GLUON)) or not config.USE_TMA
            or config.SORTED_INTER != 2 or config.KSPLIT != 1 or config.SWAP_AB
            or (config.WARP_SPEC and not gluon_ws) or quant not in PERSISTENT_QUANTS)):
        raise ValueError(f"{config.name(kernel, quant)}: PERSISTENT (0 or 1) is for stage 2 (stage 1 too on the "
                         f"Gluon kernel, GLUON 1) with every load through TMA (USE_TMA 1, SORTED_INTER 2), KSPLIT 1, "
                         f"no SWAP_AB or WARP_SPEC, quant {' or '.join(PERSISTENT_QUANTS)}")
    if config.SCALE_TMA not in (0, 1) or (config.SCALE_TMA and not (
            scale_records_fit(quant, config.SWAP_AB, config.USE_TMA, config.BLOCK_SIZE_K, config.BLOCK_SIZE_N)
            and not config.PERSISTENT)):
        raise ValueError(f"{config.name(kernel, quant)}: SCALE_TMA (0 or 1) is for the swapped {MXFP4} GEMM with its "
                         f"weights through TMA (SWAP_AB 1, USE_TMA 1), BLOCK_SIZE_K {RECORD_K} and BLOCK_SIZE_N a "
                         f"multiple of {RECORD_ROWS} (the scale records' tile, kernels/mxfp4_records.py)")
    if config.QUANT_OUT not in (0, 1) or (config.QUANT_OUT and (
            kernel != "stage1" or not config.GLUON or config.BLOCK_SIZE_N != 64 or config.PERSISTENT)):
        raise ValueError(f"{config.name(kernel, quant)}: QUANT_OUT (0 or 1) is the Gluon stage 1's (GLUON 1, "
                         "BLOCK_SIZE_N 64, one tile a program): it quantizes the intermediate in its epilogue")
    if config.GLUON not in (0, 1) or (config.GLUON and gluon_problem(config, kernel, quant)):
        raise ValueError(f"{config.name(kernel, quant)}: " + (gluon_problem(config, kernel, quant)
                                                               or "GLUON must be 0 or 1"))
    if config.SWAP_AB and kernel == "1stage":
        _check_1stage_swap(config, quant)
    if config.SWAP_AB and quant == MXFP4 and config.BLOCK_SIZE_N > 16 * config.num_warps:
        # H100, Triton 3.6: BM 64 BN 128 BK 64 on 4 warps (two 64-row wgmmas a warp group, the A operand from
        # registers) gave a different stage-2 output on 7 of 30 identical runs, with non-finite values; 8 warps and
        # 64-wide tiles were bit-identical on all 30 (benchmarks/RESULTS.md, sixteenth session).
        raise ValueError(f"{config.name(kernel, quant)}: SWAP_AB with MXFP4 needs BLOCK_SIZE_N <= 16 x num_warps "
                         "(one 64-row wgmma a warp group: wider tiles raced on the H100)")
    if config.SWAP_AB and quant == MXFP4_A8:
        # MXFP4 with 16-bit activations swaps through the packed PTX decode (fused_moe._mxfp4_swap_dot); with fp8
        # activations the tile would have to decode to e4m3, which nothing here does.
        raise ValueError(f"{config.name(kernel, quant)}: SWAP_AB is not for MXFP4 weights with fp8 activations "
                         f"({MXFP4_A8})")
    if kernel == "1stage":
        d = config.BLOCK_SIZE_D
        if d < 16 or d & (d - 1) or (config.KSPLIT != 1 and not config.SWAP_AB):
            raise ValueError(f"{config.name(kernel, quant)}: 1-stage needs BLOCK_SIZE_D a power of two >= 16, KSPLIT 1 "
                             "(split-K only in its swapped MXFP4 variant)")
        if config.USE_TMA and not config.SWAP_AB:
            raise ValueError(f"{config.name(kernel, quant)}: 1-stage reads through TMA only in its swapped MXFP4 "
                             "variant (SWAP_AB 1)")
        if config.SORTED_INTER or config.TOPK_ATOMIC or config.GATHER_A:
            raise ValueError(f"{config.name(kernel, quant)}: 1-stage has no sorted-intermediate, top-k-atomic or "
                             "gathered-A variant (SORTED_INTER, TOPK_ATOMIC, GATHER_A are 2-stage plan options)")
        if quant == "per_1x128" and SCALE_BLOCK % config.BLOCK_SIZE_N:
            raise ValueError(f"{config.name(kernel, quant)}: 1-stage per_1x128 needs BLOCK_SIZE_N dividing 128")


def gluon_problem(config: MoeConfig, kernel: str, quant: str) -> str | None:
    """Why `config` cannot run on the Gluon stage kernels (kernels/gluon_moe.py), None when it can: a stage kernel of
    per_1x128 with the weights and the intermediate through TMA (USE_TMA 1, SORTED_INTER 2; stage 1's rows through
    TMA from the GATHER_A copy, or copied by the kernel itself without it), BLOCK_SIZE_K 128, BLOCK_SIZE_N 64 or 128
    (one weight scale a tile), BLOCK_SIZE_M 16 rows a warp (64 on 4, 128 on 8), and none of the Triton kernels' other
    options (KSPLIT 1; no SWAP_AB, SCALE_TMA). TOPK_ATOMIC (a plan option): stage 2 adds each row into its token's
    row of the accumulator, fp32 (1) or the activations' 16-bit type (2) (`gluon_moe._stage2_store`). PERSISTENT is
    either stage's persistent Gluon kernel;
    WARP_SPEC (persistent) its warp-specialised form (a loader warp group feeding the MMA warps; stage 1's own
    gather done by that warp group)."""
    if kernel == "1stage" or quant != "per_1x128":
        return f"GLUON is for the per_1x128 stage kernels, not {kernel} with {quant}"
    if config.BLOCK_SIZE_K != SCALE_BLOCK or config.BLOCK_SIZE_N not in (64, 128) or config.num_warps not in (4, 8) \
            or config.BLOCK_SIZE_M != 16 * config.num_warps:
        return ("GLUON takes BLOCK_SIZE_K 128, BLOCK_SIZE_N 64 or 128 and BLOCK_SIZE_M 16 x num_warps (64 on 4, 128 "
                "on 8)")
    if not config.USE_TMA or config.SORTED_INTER != 2:
        return "GLUON reads the weights and the intermediate through TMA (USE_TMA 1, SORTED_INTER 2)"
    if config.KSPLIT != 1 or config.SWAP_AB or config.SCALE_TMA:
        return "GLUON is its own kernel: KSPLIT 1, no SWAP_AB or SCALE_TMA"
    if config.WARP_SPEC and (not config.PERSISTENT or config.QUANT_OUT):
        return ("GLUON with WARP_SPEC (a loader warp group feeding the MMA warps, moe_stage1_ws_kernel / "
                "moe_stage2_ws_kernel) is persistent (PERSISTENT 1), without QUANT_OUT")
    return None


def _check_1stage_swap(config: MoeConfig, quant: str) -> None:
    """The swapped 1-stage kernel (fused_moe_1stage._moe_1stage_swap_kernel): MXFP4 with 16-bit activations; w1's
    tile BLOCK_N rows (64 or 128: the K step of w2's tile, within one tile-major chunk and one scale record) and
    w2's BLOCK_D rows (a multiple of 64), both one 64-row wgmma a warp group at most (the race check_config cites)."""
    name = config.name("1stage", quant)
    if quant != MXFP4:
        raise ValueError(f"{name}: the swapped 1-stage kernel (SWAP_AB 1) is for {MXFP4} with 16-bit activations")
    rows_cap = 16 * config.num_warps
    if config.BLOCK_SIZE_N not in (64, 128) or config.BLOCK_SIZE_N > rows_cap:
        raise ValueError(f"{name}: the swapped 1-stage kernel needs BLOCK_SIZE_N 64 or 128 and at most 16 x "
                         f"num_warps = {rows_cap}")
    if config.BLOCK_SIZE_D % 64 or config.BLOCK_SIZE_D > rows_cap:
        raise ValueError(f"{name}: the swapped 1-stage kernel needs BLOCK_SIZE_D a multiple of 64 and at most 16 x "
                         f"num_warps = {rows_cap}")
    if config.BLOCK_SIZE_M < 16 or (config.USE_TMA and config.BLOCK_SIZE_K > 128):
        raise ValueError(f"{name}: the swapped 1-stage kernel needs BLOCK_SIZE_M >= 16 and, through TMA, "
                         "BLOCK_SIZE_K <= 128")
    if config.SCALE_TMA and config.BLOCK_SIZE_N != RECORD_K:
        # w2's K step is BLOCK_N: a record's 128. Half a record (BLOCK_N 64, the codes picked apart in registers)
        # was correct in the interpreter and wrong on the H100 (Triton 3.6; RESULTS.md, twenty-first session).
        raise ValueError(f"{name}: the swapped 1-stage kernel reads scale records (SCALE_TMA) only with BLOCK_SIZE_N "
                         f"{RECORD_K} (w2's K step is BLOCK_N, a record's)")


def check_plan(stage1: MoeConfig, stage2: MoeConfig, quant: str) -> None:
    """ValueError (one line) unless the two stage configs can run as one 2-stage call: each valid for its stage,
    and equal in what the plan shares (BLOCK_SIZE_M: one sort serves both; SORTED_INTER, TOPK_ATOMIC)."""
    if stage1.BLOCK_SIZE_M != stage2.BLOCK_SIZE_M:
        raise ValueError(f"stage 1 and stage 2 must share BLOCK_SIZE_M, got {stage1.BLOCK_SIZE_M} and "
                         f"{stage2.BLOCK_SIZE_M}")
    for name in PLAN_FIELDS:
        if getattr(stage1, name) != getattr(stage2, name):
            raise ValueError(f"stage 1 and stage 2 must share {name} (a plan-level option), got "
                             f"{getattr(stage1, name)} and {getattr(stage2, name)}")
    check_config(stage1, "stage1", quant)
    check_config(stage2, "stage2", quant)


# The Triton releases whose compiler fails on stage 2's warp-specialised K loop for a GPU (the interpreter runs it as
# a plain loop): on the H100 Triton 3.6's NVGPUWarpSpecialization pass stops with "PassManager::run failed"
# (2026-11-26, every quant). Later releases are let through until measured.
WARP_SPEC_BROKEN_UP_TO = (3, 6)


def check_compiles_here(config: MoeConfig, kernel: str, quant: str, triton_version: str, interpreter: bool) -> None:
    """ValueError (one line) when `config` is valid but this Triton cannot compile it for a GPU; nothing in the
    interpreter. Called where a launch binds and where compile_only builds, not by check_config (a tuned row's
    validity does not depend on the machine reading it)."""
    if config.WARP_SPEC and not config.GLUON and not warp_spec_compiles(triton_version, interpreter):
        raise ValueError(f"{config.name(kernel, quant)}: WARP_SPEC needs a Triton newer than "
                         f"{'.'.join(map(str, WARP_SPEC_BROKEN_UP_TO))} (its Hopper warp-specialisation pass fails on "
                         f"this loop); this is Triton {triton_version}: use WARP_SPEC 0")


def warp_spec_compiles(triton_version: str, interpreter: bool) -> bool:
    """Whether this Triton builds WARP_SPEC 1 (always in the interpreter, which runs a plain loop)."""
    return interpreter or triton_release(triton_version) > WARP_SPEC_BROKEN_UP_TO
