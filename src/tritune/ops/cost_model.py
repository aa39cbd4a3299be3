"""Analytic time model of tritune's GEMM and fused-MoE kernels on Hopper: it ranks configs and scales a time
measured at one problem size to another (`scale_time`: measured × model(to) / model(from), so the model's bias
cancels). Pure Python, no torch; configs are read by attribute or by key (GemmConfig, MoeConfig or a stored Config).

The model, per kernel launch (all times in µs):

- work: programs = tiles × splits (persistent TMA: tiles, one SM each in turn); an SM runs ⌈programs / SMs⌉ of
  them, so wave quantization is explicit;
- compute = max(per SM: programs per SM × flops per program / (SM peak × tile efficiency), chip: all flops / the
  chip's sustained rate) — one SM reaches the dense peak (990 / 1979 TFLOP/s bf16 / fp8 over 132 SMs) but the chip
  sustains ~800 / 1550 (tuned 128×256 tiles: 780-790 / 1520; the 730 / 1250 often quoted are below what the tuned
  kernels reached), so a half-empty grid runs each SM faster. Tile efficiency = (BN/256)^¼ (narrower wgmma) ·
  (BM·N/(BM+N) / 85.3)^½ (loads per MAC, N = the columns sharing one A tile), ×½ under 64 rows (no wgmma);
  fused-MoE GEMMs ×0.75 (A rows gathered by pointer). Block-scaled fp8 pays the per-K-block rescale on the FMA
  units (+60% per 128 of K, ×1.5 when every column has its own scale; ×0.6 of it with SCALE_PIPELINE);
- loads = programs per SM × bytes each loads / min(an SM's L2 rate, bytes in flight / latency); in flight =
  (num_stages - 1) stages of A and B tiles × CTAs resident per SM (shared memory, registers);
- HBM = weight bytes / min(HBM, streams × stream rate) + other bytes / HBM. A stream is a distinct weight tile
  being read (column tiles × splits; programs sharing a tile add no new addresses), its rate = its pipeline's
  weight bytes in flight / latency (Little's law, ≤ 100 GB/s); weights are re-read once per group of row tiles
  (GROUP_SIZE_M, or the rows one wave spans) unless they fit in L2;
- time = fixed cost + (compute⁴ + loads⁴ + HBM⁴)^¼ (a soft max: balanced kernels overlap imperfectly) + a slot
  per launched program; split-K adds its fp32 partials written and read back (in the same launch).

Fused MoE follows the kernels: pairs per expert c ~ Binomial(tokens, topk/experts) (uniform routing), so touched
experts are E·(1 - (1 - topk/E)^T), blocks E·𝔼⌈c/BM⌉ (padding waste included); only touched experts' weights are
read, once per group of an expert's blocks; the sort buffer's worst-case blocks are all launched. Each op counts
its launches as kernels/fused_moe_launch.py makes them (sort, 1-3, quantizing fp8 activations in its first; the
GEMMs; split-K finish; intermediate quantization; top-k sum; 1-stage: sort, kernel, cast), each with its GPU cost,
and `Estimate.host_us` = launches × the host cost the run-time op pays (+ TMA descriptors).

Calibration (configs/gemm, configs/tuned_fmoe.csv, benchmarks/results): the 63 shipped GEMM winners are estimated
at 0.83-1.18× their measured times (geomean 0.99) and a config tuned at two M scales between them within ±8%;
M=1 GEMMs and 1-8-token MoE rows stream weights at 2.6-2.8 TB/s after ~8-10 µs of fixed cost; in the 1024-token
MoE profile the lowest-estimated stage-1 / stage-2 configs measure 1.00× / 1.09× the best (Spearman 0.91 / 0.82);
num_stages 3 → 4 is worth 15% on 128×128×64 at M=512 (AOT GEMM bundle).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

H100_SMS = 132
FP8_KERNELS = ("a8w8", "a8w8_blockscale")
ONE_STAGE_MAX_PAIRS = 256  # = tuners.fused_moe_tunable.ONE_STAGE_MAX_PAIRS (the tuner never tries 1-stage above)
OVERLAP_P = 4  # compute, loads and HBM combine as a p-norm: balanced kernels overlap imperfectly
TILE_N_EXP, TILE_I_EXP = 0.25, 0.5  # fitted on the MoE profiles and the AOT GEMM bundle (benchmarks/results)
MOE_EFFICIENCY = 0.75  # the fused-MoE GEMMs gather A rows by pointer (no TMA), tuned ones run ~25% under GEMM rates
# The sort (kernels.moe_align): one launch up to SORT_SMALL_MAX pairs, two while ⌈pairs/128⌉·experts counts stay
# within SORT_SELF_SCAN_COUNTS, else three; its first launch also quantizes fp8 activations and zeroes the 1-stage sum.
SORT_SMALL_MAX, SORT_CHUNK, SORT_SELF_SCAN_COUNTS = 64, 128, 65536


@dataclass(frozen=True)
class Hardware:
    """One GPU as the model sees it. Per-SM rates are the H100's (totals / 132 SMs): another SM count scales the
    compute and the streaming it can do, not HBM. Units: bytes, µs, flops."""

    sm_count: int = H100_SMS
    sm_peak_bf16: float = 990e6 / H100_SMS  # flop/µs one SM reaches with wgmma (dense bf16 peak / SMs)
    sm_peak_fp8: float = 1979e6 / H100_SMS
    chip_bf16: float = 800e6  # flop/µs the whole H100 sustains (tuned 128x256 tiles: 780-790 TFLOP/s)
    chip_fp8: float = 1550e6  # (tuned a8w8: 1520 TFLOP/s)
    hbm: float = 3.0e6 * 0.9  # B/µs sustained by streaming kernels (3.0 TB/s peak)
    sm_stream: float = 100e3  # B/µs one weight stream can pull from HBM however deep its pipeline
    sm_l2: float = 110e3  # B/µs one SM loads from L2
    latency: float = 1.0  # µs from load issue to use (sets what the pipeline's bytes in flight can sustain)
    l2_bytes: float = 50 * 2**20 * 0.6  # L2 that holds re-used operands (60% of 50 MiB)
    atomic: float = 2.0e6  # B/µs of fp32 atomic adds into L2 (1-stage MoE output)
    max_shared: int = 232448
    fixed_us: float = 8.0  # GPU cost of a main kernel launch (ramp-up, first loads after a flush, tail)
    aux_us: float = 2.5  # GPU cost of a helper launch (split-K reduce, sort, quantize, top-k sum, zero, cast)
    host_launch_us: float = 5.0  # host cost per launch the run-time op pays; added, never scaled
    host_tma_us: float = 1.0  # host cost of one launch's TMA descriptors (encoded once per address, then looked up)

    def sm_peak(self, elt: int) -> float:
        return self.sm_peak_fp8 if elt == 1 else self.sm_peak_bf16

    def chip_peak(self, elt: int) -> float:
        return (self.chip_fp8 if elt == 1 else self.chip_bf16) * self.sm_count / H100_SMS


H100 = Hardware()


def hardware(sm_count: int = H100_SMS, max_shared: int = 232448) -> Hardware:
    """The H100 model with another SM count or shared-memory limit (H200: 132 SMs, same per-SM rates)."""
    if sm_count == H100.sm_count and max_shared == H100.max_shared:
        return H100
    return replace(H100, sm_count=sm_count, max_shared=max_shared)


@dataclass(frozen=True)
class Estimate:
    """A modelled op: GPU time (what the tuner measures), launches, and the host cost the run-time op adds."""

    gpu_us: float
    launches: int
    host_us: float
    bound: str  # what dominates the main kernel: "compute", "loads" (L2/latency), "hbm"

    @property
    def total_us(self) -> float:
        return self.gpu_us + self.host_us


@dataclass(frozen=True)
class GemmShape:
    """C[M, N] = A[M, K] · B[N, K]ᵀ for one kernel ("bf16", "a8w8", "a8w8_blockscale"); elt = operand bytes (0:
    1 for the fp8 kernels, else 2)."""

    kernel: str
    M: int
    N: int
    K: int
    elt: int = 0

    @property
    def width(self) -> int:
        return self.elt or (1 if self.kernel in FP8_KERNELS else 2)

    def with_M(self, M: int) -> GemmShape:
        return replace(self, M=M)


@dataclass(frozen=True)
class MoeShape:
    """A fused-MoE problem: hidden [tokens, model_dim], w1 [experts, (2 if gated) · inter_dim, model_dim],
    w2 [experts, model_dim, inter_dim]; quant "none" | "per_token" | "per_1x128"; act_elt = bytes of hidden."""

    tokens: int
    model_dim: int
    inter_dim: int
    experts: int
    topk: int
    quant: str = "none"
    gated: bool = True
    act_elt: int = 2

    @property
    def width(self) -> int:
        return 1 if self.quant != "none" else self.act_elt

    @property
    def pairs(self) -> int:
        return self.tokens * self.topk

    def with_tokens(self, tokens: int) -> MoeShape:
        return replace(self, tokens=tokens)


class MoePlan(NamedTuple):
    """The kernels of one fused-MoE call: the 1-stage config, or the stage-1 and stage-2 configs."""

    run_1stage: bool
    stage1: Any  # MoeConfig (the 1-stage kernel's when run_1stage)
    stage2: Any  # MoeConfig, None when run_1stage


def _param(cfg: Any, name: str, default: Any = None) -> Any:
    """A config parameter by attribute (dataclass configs) or by key (tuning.types.Config, dicts)."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    value = getattr(cfg, name, None)
    if value is None and hasattr(cfg, "get"):
        value = cfg.get(name, default)
    return default if value is None else value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ceil(x: float) -> int:
    """⌈x⌉ of an expected count, at least 1 (monotone in x, so estimates grow with the token count)."""
    return max(1, math.ceil(x - 1e-9))


def _soft_max(*terms: float) -> float:
    return sum(t**OVERLAP_P for t in terms) ** (1 / OVERLAP_P)


def tile_efficiency(block_m: int, block_n: int, total_n: int = 0) -> float:
    """Fraction of one SM's MMA peak one tl.dot of BLOCK_M×BLOCK_N reaches. Under 64 rows there is no wgmma
    (Ampere-style mma.sync at about half the rate); a narrower wgmma issues more, smaller instructions; and a tile
    that loads more per MAC (BM·N/(BM+N), N = `total_n`, the columns sharing one A tile) starves the MMA."""
    total_n = total_n or block_n
    mma = 1.0 if block_m >= 64 else 0.5
    intensity = block_m * total_n / (block_m + total_n)  # 85.3 for 128x256
    return mma * min(1.0, block_n / 256) ** TILE_N_EXP * min(1.0, intensity / 85.3) ** TILE_I_EXP


def rescale_overhead(block_k: int, per_column_scale: bool, pipelined: bool = False, off_mma_path: bool = False
                     ) -> float:
    """Compute multiplier of block-scaled fp8: the FMA rescale of every 128-deep K block (BLOCK_SIZE_K ≤ 128).
    `off_mma_path`: the Gluon kernel, which rescales block k-1 while block k's MMA runs (H100: 0.72-0.83x the Triton
    kernel's time from M 1024, so a third of the extra)."""
    extra = 0.6 * (128 / max(block_k, 1)) * (1.5 if per_column_scale else 1.0)
    if off_mma_path:
        return 1.0 + extra / 3
    return 1.0 + (0.6 * extra if pipelined else extra)


def occupancy(smem: int, warps: int, acc_per_thread: float, hw: Hardware = H100) -> int:
    """CTAs resident per SM: shared memory, 64 warps, 64K registers (accumulator + ~64 per thread)."""
    regs = min(255.0, acc_per_thread + 64.0)
    by_regs = int(65536 // (warps * 32 * regs))
    by_smem = hw.max_shared // max(smem, 1)
    return max(1, min(by_smem, 64 // warps, by_regs, 8))


@dataclass(frozen=True)
class _Launch:
    """What one kernel launch does, in the terms of the model."""

    programs: int  # programs with work (persistent TMA: tiles)
    flops_prog: float  # MMA flops of one program, padding and rescale included
    bytes_prog: float  # bytes one program loads (through L2)
    inflight: float  # bytes one program keeps in flight
    occ: int  # CTAs resident per SM
    total_flops: float  # flops of the whole launch (chip-rate bound)
    stream_bytes: float  # weight bytes from HBM (re-reads included), limited by how many streams pull them
    streams: float  # distinct weight tiles streamed at once (programs sharing a tile add no new addresses)
    stream_inflight: float  # weight bytes one stream keeps in flight (its pipeline's stages of weight tiles)
    other_bytes: float  # other HBM traffic: activations, outputs, partials
    elt: int
    eff: float  # tile efficiency
    boost: float = 1.0  # TMA's better-overlapped pipeline: a few % on both the SM's and the chip's rate
    launched: int = 0  # programs the grid launches (fused MoE: the sort's worst case, most exit at once)


def _launch_us(x: _Launch, hw: Hardware) -> tuple[float, str]:
    """GPU µs of one main launch and what bounds it."""
    sms = hw.sm_count
    per_sm = _cdiv(max(x.programs, 1), sms)
    resident = max(1, min(x.occ, per_sm))
    compute = max(per_sm * x.flops_prog / (hw.sm_peak(x.elt) * x.eff), x.total_flops / hw.chip_peak(x.elt)) / x.boost
    load_rate = min(hw.sm_l2, resident * x.inflight / hw.latency)
    loads = per_sm * x.bytes_prog / load_rate
    stream_rate = min(hw.sm_stream, x.stream_inflight / hw.latency)  # Little's law per stream
    concurrent = min(max(x.programs, 1), sms * x.occ)
    streams = max(1, min(x.streams, concurrent))
    hbm = x.stream_bytes / min(hw.hbm, streams * stream_rate) + x.other_bytes / hw.hbm
    terms = {"compute": compute, "loads": loads, "hbm": hbm}
    slots = 0.25 * _cdiv(x.launched, sms * x.occ)  # each launched program costs a slot and one load, if no more
    return hw.fixed_us + _soft_max(*terms.values()) + slots, max(terms, key=terms.get)


def _aux_us(hw: Hardware, nbytes: float) -> float:
    """GPU µs of a helper launch moving `nbytes` through HBM."""
    return hw.aux_us + nbytes / hw.hbm


def _reads(total: float, sharers: int, groups: int, hw: Hardware) -> float:
    """Times an operand of `total` bytes comes from HBM: once if it fits in L2, else once per group of sharers."""
    return 1.0 if total <= hw.l2_bytes else float(_cdiv(groups, max(sharers, 1)))


# ---------------------------------------------------------------------------------------------------------- GEMM


def gemm_smem(config: Any, elt: int) -> int:
    """Shared memory of a GEMM config as the tuner counts it (stages of A and B tiles, TMA epilogue tile)."""
    bm, bn, bk = (int(_param(config, f"BLOCK_SIZE_{x}")) for x in "MNK")
    tiles = (bm + bn) * bk * elt * int(_param(config, "num_stages", 3))
    epilogue = _param(config, "PERSISTENT_TMA", False) or _param(config, "GLUON", False)
    return tiles + (bm * bn * 2 if epilogue else 0)


def estimate_gemm(config: Any, shape: GemmShape, hw: Hardware = H100) -> Estimate:
    """Modelled time of `tritune.kernels.gemm.gemm(shape.kernel, ...)` with `config` (pointer kernel + split-K
    reduce, or the persistent TMA kernel)."""
    bm, bn, bk = (int(_param(config, f"BLOCK_SIZE_{x}")) for x in "MNK")
    group, warps = int(_param(config, "GROUP_SIZE_M", 1)), int(_param(config, "num_warps", 4))
    stages = int(_param(config, "num_stages", 3))
    tma = bool(_param(config, "PERSISTENT_TMA", False))
    split = 1 if tma else max(1, int(_param(config, "NUM_KSPLIT", 1)))
    M, N, K, elt = shape.M, shape.N, shape.K, shape.width
    pm, pn = _cdiv(M, bm), _cdiv(N, bn)
    tiles = pm * pn
    kspan = _cdiv(_cdiv(K, split), bk) * bk  # each split covers a whole number of K steps
    programs = tiles * split
    overhead = 1.0
    if shape.kernel == "a8w8_blockscale":
        overhead = rescale_overhead(bk, bn > 128, bool(_param(config, "SCALE_PIPELINE", False)),
                                    bool(_param(config, "GLUON", False)))
    smem = gemm_smem(config, elt)
    occ = 1 if tma else occupancy(smem, warps, bm * bn / (warps * 32), hw)
    concurrent = min(programs, hw.sm_count * occ)
    # Rows of tiles that read one B column tile while it is hot: the group, or the rows one wave spans.
    rows_sharing = group if group > 1 else max(1, concurrent // pn)
    a_bytes, b_bytes = M * K * elt, N * K * elt
    b_reads = _reads(b_bytes, rows_sharing, pm, hw)
    a_group = min(rows_sharing, pm) * bm * K * elt
    a_reads = 1.0 if a_group <= hw.l2_bytes else float(_cdiv(pn, max(1, concurrent // max(rows_sharing, 1))))
    out_bytes = M * N * (4 * split if split > 1 else 2)
    launch = _Launch(
        programs=programs, flops_prog=2.0 * bm * bn * kspan * overhead, bytes_prog=(bm + bn) * kspan * elt,
        inflight=max(1, stages - 1) * (bm + bn) * bk * elt, occ=occ,
        total_flops=2.0 * pm * bm * pn * bn * split * kspan * overhead, stream_bytes=b_bytes * b_reads,
        streams=pn * split, stream_inflight=max(1, stages - 1) * bn * bk * elt,
        other_bytes=a_bytes * a_reads + out_bytes, elt=elt,
        eff=tile_efficiency(bm, bn), boost=1.05 if tma else 1.0)
    gpu, bound = _launch_us(launch, hw)
    launches = 1
    if split > 1:  # one launch: the last split of each tile reads the fp32 partials back and writes C
        gpu += M * N * (4 * split + 2) / hw.hbm
    host = launches * hw.host_launch_us + (hw.host_tma_us if tma else 0.0)
    return Estimate(gpu, launches, host, bound)


# ---------------------------------------------------------------------------------------------------- fused MoE


@functools.lru_cache(maxsize=4096)
def routing_stats(tokens: int, experts: int, topk: int, block_m: int, group: int = 1) -> tuple[float, float, float]:
    """Uniform routing, pairs per expert c ~ Binomial(tokens, topk/experts): (touched experts E·(1 - (1-p)^T),
    sorted blocks E·𝔼⌈c/BM⌉, weight sweeps E·𝔼⌈⌈c/BM⌉/group⌉ — how often the experts' weights are streamed).

    𝔼⌈c/b⌉ = Σ_j P(c > j·b); P is the exact binomial while its spread is small, else the normal approximation
    with continuity correction (within 1% of exact), so a call costs at most a few hundred terms.
    """
    p = min(1.0, topk / experts)
    if p >= 1.0:
        blocks = _cdiv(tokens, block_m)
        return float(experts), float(experts * blocks), float(experts * _cdiv(blocks, group))
    mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
    if sd < 8:
        log_p, log_q, base = math.log(p), math.log1p(-p), math.lgamma(tokens + 1)
        top = min(tokens, int(mean + 12 * sd) + 8)
        pmf = [math.exp(base - math.lgamma(c + 1) - math.lgamma(tokens - c + 1) + c * log_p + (tokens - c) * log_q)
               for c in range(top + 1)]
        tail = [0.0] * (top + 2)  # tail[x] = P(c >= x)
        for c in range(top, -1, -1):
            tail[c] = tail[c + 1] + pmf[c]

        def above(x: int) -> float:  # P(c > x)
            return tail[x + 1] if x + 1 <= top else 0.0
    else:
        def above(x: int) -> float:
            return 0.5 * math.erfc((x + 0.5 - mean) / (sd * math.sqrt(2.0)))
    hi = min(tokens, mean + 12 * sd + 1)

    def expected_ceil(width: int) -> float:  # 𝔼⌈c/width⌉
        return sum(above(j * width) for j in range(int(hi // width) + 1))

    touched = 1.0 - (1.0 - p) ** tokens
    return experts * touched, experts * expected_ceil(block_m), experts * expected_ceil(block_m * group)


def moe_smem(config: Any, kernel: str, shape: MoeShape) -> int:
    """Shared memory of a fused-MoE config as the tuner counts it (stages of A and gate/up tiles; 1-stage also
    the second GEMM's double buffer)."""
    bm, bn, bk = (int(_param(config, f"BLOCK_SIZE_{x}")) for x in "MNK")
    stages, elt = int(_param(config, "num_stages", 3)), shape.width
    halves = 2 if shape.gated and kernel in ("stage1", "1stage") else 1
    first = stages * (bm + halves * bn) * bk * elt
    if kernel != "1stage":
        return first
    return max(first, 2 * (bm + int(_param(config, "BLOCK_SIZE_D", 64))) * bn * 2)


def _moe_gemm_launch(config: Any, kernel: str, s: MoeShape, hw: Hardware) -> tuple[float, str, int, float]:
    """(GPU µs of the stage GEMM, bound, helper launches after it, their GPU µs) for kernel "stage1"/"stage2"."""
    bm, bn, bk = (int(_param(config, f"BLOCK_SIZE_{x}")) for x in "MNK")
    group, warps = int(_param(config, "GROUP_SIZE_M", 1)), int(_param(config, "num_warps", 4))
    stages, ksplit = int(_param(config, "num_stages", 3)), max(1, int(_param(config, "KSPLIT", 1)))
    elt, pairs = s.width, s.pairs
    stage1 = kernel == "stage1"
    n, k = (s.inter_dim, s.model_dim) if stage1 else (s.model_dim, s.inter_dim)
    halves = 2 if stage1 and s.gated else 1
    pn = _cdiv(n, bn)
    alloc_blocks = _cdiv(pairs + s.experts * (bm - 1), bm)
    occ = occupancy(moe_smem(config, kernel, s), warps, halves * bm * bn / (warps * 32), hw)
    touched, blocks, _ = routing_stats(s.tokens, s.experts, s.topk, bm)
    programs = _ceil(blocks) * pn * ksplit
    concurrent = min(programs, hw.sm_count * occ)
    rows_sharing = group if group > 1 else max(1, concurrent // (pn * ksplit))
    _, _, sweeps = routing_stats(s.tokens, s.experts, s.topk, bm, rows_sharing)
    expert_w = halves * n * k * elt
    w_reads = sweeps / max(touched, 1e-9) if expert_w > hw.l2_bytes else 1.0
    kspan = _cdiv(_cdiv(k, ksplit), bk) * bk
    # A Gluon stage (GLUON, per_1x128 on Hopper) rescales off the MMA's path; its stage 1 on the gathered copy
    # (GATHER_A) reads A through TMA, without the pointer-gather discount. H100, twenty-seventh session, 4096 tokens:
    # stage 1 modelled 413 / 383 / 304 µs against 437 / 400 / 321 measured at E 64 I 1536 / DeepSeek-V2-Lite / E 128
    # I 384; gathering its own rows (cp.async) it keeps the discount (E 128, 64-row blocks: 405 against 346); stage 2
    # keeps it too (E 64 265 against 255; E 128's 3 K blocks a tile 290 against 427).
    gluon = bool(_param(config, "GLUON", 0))
    overhead = rescale_overhead(bk, True, off_mma_path=gluon) if s.quant == "per_1x128" else 1.0
    use_tma = bool(_param(config, "USE_TMA", 0))
    a_bytes = (s.tokens * k if stage1 else pairs * k) * elt
    out_bytes = pairs * (halves * n * 4 * ksplit if ksplit > 1 else n * s.act_elt)
    launch = _Launch(
        programs=programs, flops_prog=2.0 * bm * halves * bn * kspan * overhead,
        bytes_prog=(bm + halves * bn) * kspan * elt, inflight=max(1, stages - 1) * (bm + halves * bn) * bk * elt,
        occ=occ, total_flops=2.0 * blocks * bm * halves * pn * bn * ksplit * kspan * overhead,
        stream_bytes=touched * expert_w * w_reads, streams=max(1.0, touched) * pn * ksplit,
        stream_inflight=max(1, stages - 1) * halves * bn * bk * elt, other_bytes=a_bytes + out_bytes, elt=elt,
        eff=(1.0 if gluon and stage1 and _param(config, "GATHER_A", 0) else MOE_EFFICIENCY)
        * tile_efficiency(bm, bn, halves * bn),
        boost=1.03 if use_tma else 1.0, launched=alloc_blocks * pn * ksplit)
    gpu, bound = _launch_us(launch, hw)
    aux_n, aux = 0, 0.0
    if stage1 and _param(config, "GATHER_A", 0):  # the rows copied into the sort's order first
        aux_n, aux = 1, _aux_us(hw, 2 * pairs * k * elt)
    if stage1 and ksplit > 1:  # finish: sum the partials, activation
        aux_n, aux = 1, _aux_us(hw, out_bytes + pairs * n * s.act_elt)
    if not stage1 and (s.topk > 1 or ksplit > 1):  # top-k sum over slots (and splits)
        aux_n, aux = 1, _aux_us(hw, out_bytes + s.tokens * n * s.act_elt)
    return gpu, bound, aux_n, aux


def _one_stage_us(config: Any, s: MoeShape, hw: Hardware) -> tuple[float, str]:
    """GPU µs of `_moe_1stage_kernel` and its bound."""
    bm, bn, bk = (int(_param(config, f"BLOCK_SIZE_{x}")) for x in "MNK")
    bd = int(_param(config, "BLOCK_SIZE_D", 64))
    warps, stages = int(_param(config, "num_warps", 4)), int(_param(config, "num_stages", 3))
    elt, pairs, d, inter = s.width, s.pairs, s.model_dim, s.inter_dim
    halves = 2 if s.gated else 1
    pn = _cdiv(inter, bn)
    touched, blocks, sweeps = routing_stats(s.tokens, s.experts, s.topk, bm)
    programs = _ceil(blocks) * pn
    alloc_blocks = _cdiv(pairs + s.experts * (bm - 1), bm)
    occ = occupancy(moe_smem(config, "1stage", s), warps, (halves * bm * bn + bm * bd) / (warps * 32), hw)
    overhead = rescale_overhead(bk, True) if s.quant == "per_1x128" else 1.0
    d_pad = _cdiv(d, bd) * bd
    flops_prog = 2.0 * bm * halves * bn * _cdiv(d, bk) * bk * overhead + 2.0 * bm * bn * d_pad
    expert_w = (halves + 1) * inter * d * elt
    w_reads = sweeps / max(touched, 1e-9) if expert_w > hw.l2_bytes else 1.0
    launch = _Launch(
        programs=programs, flops_prog=flops_prog, bytes_prog=(bm * d + (halves + 1) * bn * d) * elt,
        inflight=max(1, stages - 1) * (bm + halves * bn) * bk * elt, occ=occ, total_flops=programs * flops_prog,
        stream_bytes=touched * expert_w * w_reads, streams=max(1.0, touched) * pn,
        stream_inflight=max(1, stages - 1) * halves * bn * bk * elt, other_bytes=s.tokens * d * elt, elt=elt,
        eff=MOE_EFFICIENCY * tile_efficiency(bm, bn, halves * bn), launched=alloc_blocks * pn)
    gpu, bound = _launch_us(launch, hw)
    return gpu + pairs * d * 4 * pn / hw.atomic, bound  # every intermediate slice adds into each output row


def _front_us(s: MoeShape, hw: Hardware, one_stage: bool) -> tuple[int, float]:
    """Launches and GPU µs of the sort that opens every fused-MoE call, with what rides along in its first launch
    (fp8 activation quantization; the 1-stage fp32 accumulator's zeroing)."""
    if s.pairs <= SORT_SMALL_MAX:
        launches = 1
    else:
        launches = 2 if _cdiv(s.pairs, SORT_CHUNK) * s.experts <= SORT_SELF_SCAN_COUNTS else 3
    rides = s.tokens * s.model_dim * ((s.act_elt + 1 if s.quant != "none" else 0) + (4 if one_stage else 0))
    return launches, launches * _aux_us(hw, s.pairs * 8) + rides / hw.hbm


def estimate_moe(plan: MoePlan, shape: MoeShape, hw: Hardware = H100) -> Estimate:
    """Modelled time of the whole fused-MoE op (as `tritune.ops.fused_moe` runs it) for one plan."""
    launches, gpu = _front_us(shape, hw, plan.run_1stage)
    if plan.run_1stage:
        kernel, bound = _one_stage_us(plan.stage1, shape, hw)
        gpu += kernel + _aux_us(hw, shape.tokens * shape.model_dim * (4 + shape.act_elt))  # cast the fp32 sum
        launches += 2
    else:
        g1, bound, n1, a1 = _moe_gemm_launch(plan.stage1, "stage1", shape, hw)
        g2, _, n2, a2 = _moe_gemm_launch(plan.stage2, "stage2", shape, hw)
        gpu += g1 + a1 + g2 + a2
        launches += 2 + n1 + n2
        if shape.quant != "none" and not _param(plan.stage1, "QUANT_OUT", 0):
            # the intermediate is quantized before stage 2 (QUANT_OUT: by stage 1 itself, no launch)
            gpu += _aux_us(hw, shape.pairs * shape.inter_dim * (shape.act_elt + 1))
            launches += 1
    return Estimate(gpu, launches, launches * hw.host_launch_us, bound)


# ------------------------------------------------------------------------------------------------------- common


def estimate(config: Any, shape: GemmShape | MoeShape, hw: Hardware = H100) -> Estimate:
    """The modelled op: a GEMM config at a GemmShape, or a MoePlan at a MoeShape."""
    if isinstance(shape, GemmShape):
        return estimate_gemm(config, shape, hw)
    if isinstance(shape, MoeShape):
        return estimate_moe(config, shape, hw)
    raise TypeError(f"unknown problem shape {shape!r}")


def scale_time(measured_us: float, config: Any, from_shape: GemmShape | MoeShape, to_shape: GemmShape | MoeShape,
               hw: Hardware = H100) -> float:
    """GPU µs of `config` at `to_shape`, from its measured GPU µs at `from_shape`: measured × model(to)/model(from).

    Both shapes must be of one kind (GEMM or MoE); the host launch cost is not in it (see Estimate.host_us).
    """
    if type(from_shape) is not type(to_shape):
        raise TypeError(f"cannot scale between {type(from_shape).__name__} and {type(to_shape).__name__}")
    if from_shape == to_shape:
        return float(measured_us)
    return measured_us * estimate(config, to_shape, hw).gpu_us / estimate(config, from_shape, hw).gpu_us
