"""Rule-table configs for shapes with no tuned file: GEMM (bf16/fp16, a8w8, a8w8_blockscale) and fused MoE
(2-stage or 1-stage; quant none, per_token, per_1x128). Calibrated on the shipped H100 files (configs/gemm,
configs/tuned_fmoe.csv, the tuning profiles in benchmarks/results) and on vLLM's shipped H100 Triton configs
(block-fp8 GEMM: BLOCK_N 32-64 for N ~ 2k at M <= 64, BLOCK_K 128, 4 warps; fused MoE: BLOCK_M grows with the
pairs per expert). Every config passes the kernels' own checks and breaks none of the tuner's pruning rules.

GEMM, `gemm_heuristic(kernel, M, N, K)`; fallback tiles in parentheses:

| M     | tiles BM×BN, largest first       | block-scaled tiles         | BLOCK_K (block-scaled: always 128)  |
|-------|----------------------------------|----------------------------|-------------------------------------|
| ≤ 16  | 16×128, 16×64, (16×32)           | same                       | 256; `.cg` loads                    |
| ≤ 32  | 32×128, 32×64, (32×32)           | same                       | 256                                 |
| ≤ 64  | 64×128, 64×64, 32×64, (16×64)    | 64×128, 64×64, (16×64)     | 256 on 32-row tiles, else 128       |
| ≤ 256 | 128×256, 128×128, 64×128, 64×64, (64×32) | 64×128, 64×64, (64×32) | 64 on ≥ 128×128 bf16, else 128 |
| ≤ 512 | 128×128, 64×128, 64×64           | same                       | 64 on 128×128 bf16, else 128        |
| > 512 | 128×256, 128×128, 128×64         | 128×128, 128×64            | 64 on ≥ 128×128 bf16, else 128      |

- bf16/fp16 past M = 64: the tile (main or fallback) whose grid costs least: waves × tile area / the tile's speed
  (`TILE_SPEED`, as tuned on the H100);
- otherwise, waves: the first tile whose grid ⌈M/BM⌉·⌈N/BN⌉ covers ≥ 0.7 of the SMs with its waves ≥ 0.7 full (136 tiles
  on 132 SMs is two waves, one nearly empty: the next tile is taken); past the main tiles, a fallback only while
  the grid is under a third of the SMs (N=2112 at M=1: 16×32, 66 programs, as vLLM ships; N=4096: 16×64 and
  split-K, as tuned); else the last tile. Block-scaled tiles keep BLOCK_N ≤ 128 (one B scale per tile), skip
  128-row tiles up to M=256 and 32-row main tiles (tuned: 64×128 won there);
- 8 warps on tiles of at least 128×128 (bf16/fp16: larger than 128×128), else 4; GROUP_SIZE_M 8 when there is more
  than one row of tiles;
- split-K only when the grid is under half the SMs AND K is long: each tile streams ≥ 640 KiB of B (below that
  the second launch, ~3 µs on the GPU and ~5 µs on the host, costs more than the idle SMs give back); then the
  largest of 2, 4, 8 keeping the grid within 2× the SMs and ≥ 4 K steps per split (tuned at N=4096: split 4 at
  K=14336 for M ≤ 64; at K=4096 split-K won by less than a launch);
- persistent TMA from M ≥ 1024 (block-scaled, bf16/fp16) / 2048 (a8w8) on Hopper with 16-byte rows; no split-K with it;
  block-scaled with K ≥ `WS_MIN_K` (7168) warp-specialised on Triton ≥ 3.5;
- block-scaled from M ≥ `GLUON_MIN_M` (256), N ≥ 128 and K ≥ 512 on Hopper with Gluon (Triton ≥ 3.5) and 16-byte
  rows: the Gluon kernel (`GLUON`, kernels/gluon_blockscale.py: the rescale of K block k-1 while block k's MMA
  runs), persistent, 128×128 on 8 warps fed by a loader warp group (`WARP_SPECIALIZE`, kernels/gluon_gemm_ws.py, 5
  stages) where that grid makes a wave, else 64×128 on 4 (H100: 1.23× faster than the Triton kernels in geomean at
  M 256-8192, up to 1.39×; the loader warp group another 0.833 → 0.91× `_scaled_mm` from M 1024); where even 64×128
  fills under half the SMs, 64×64 warp-specialised with up to `NARROW_STAGES` (8) stages (H200, 1536 × 7168 M 256:
  18.0 against 22.2 µs);
- a8w8 from M ≥ `GLUON_MIN_M`, N ≥ 128 and K ≥ 512 on Hopper with Gluon and 16-byte rows: the tile whose waves cost
  least (`FP8_TILE_SPEED`) among Triton's 128×256 and the Gluon kernel's (kernels/gluon_gemm.py, persistent) 128×128,
  64×192 (two MMAs, 128 + 64 columns), 128×192 and 64×128; the Triton rule where 128×256 costs least (H100: 1.03-1.20×
  faster than the Triton rule at the 9 of 24 held-out points it takes Gluon, the op 1.047 → 1.089× `_scaled_mm`);
- bf16/fp16 past M = 64: up to 7 stages (`DEEP_STAGES`; 128×128×64 at M 256-1024 ran 1.10-1.41× faster with 6-7
  than with 4); otherwise 4 stages (5 when one stage holds ≤ 8 KiB, as vLLM's small block-fp8 tiles); fewer when the
  A and B stages (plus
  the TMA epilogue tile) exceed `max_shared` — BLOCK_K halves first if fewer than 3 would fit — and never more
  than 2 + the K steps; BLOCK_K ≤ next_pow2(K), but not under 128 on tiles under 128×128 (the tuner's rule) unless
  block-scaled.

Fused MoE, `moe_heuristic(tokens, model_dim, inter_dim, experts, topk, quant)`; m = tokens·topk/experts (mean
routed pairs per expert), BK = BLOCK_K bf16 / fp8:

| case                          | BLOCK_M | stage 1 or 1-stage: BN, BK, warps        | stage 2: BN, BK, warps  |
|-------------------------------|---------|------------------------------------------|-------------------------|
| tokens·topk ≤ 8, 16-bit ²: 1-stage | 16 | BN 128, BK 128, BLOCK_D 256, 4 warps, 3 stages | —                  |
| m ≤ 12                        | 16      | 32 (fp8 64), 256 (per_1x128: 128), 4     | 64 (fp8 128), 256 (128), 4 ¹ |
| m ≤ 24                        | 32      | 64, 128, 4                               | 64, 128, 4              |
| m ≤ 64                        | 64      | 64, 128, 4                               | 128, 128, 4             |
| m ≤ 128 (per_1x128: any m)    | 64      | 128, 64 / 128, 4 (per_1x128: 256, 8)     | 256, 64 / 128, 4 (8)    |
| larger                        | 128     | 128, 64 / 128, 8                         | 256, 64 / 128, 8        |

- ¹ BLOCK_K 256 only where K holds at least MIN_WIDE_K_STEPS = 4 such steps, else 128: stage 2's K is the
  intermediate size (I 384: 0.82x / 0.89x the stage pair's time at 16 / 64 tokens with 128);
- ² fp8 takes the stage pair there too, on the m ≤ 12 row's tiles (`FP8_PAIR_AT_DECODE`; 0.66-0.95x the 1-stage's
  time at 1 token on four shapes);
- GROUP_SIZE_M 8 when an expert holds more than one block (its weights then stream once per group, not once per
  block: GROUP_SIZE_M 1 doubled stage 1 at 1024 tokens in the tuning profile), else 1; 4 stages (fewer to fit);
- weight tiles through TMA (USE_TMA) when m > 64 on Hopper with 16-byte weight rows (tuned: from m = 128);
- bf16/fp16 from m = 64 on Hopper (intermediate rows 16-byte multiples): `SORTED_INTER` 2 on both stages (stage 1
  writes the intermediate in the sort's order, stage 2 reads it through TMA);
- with it, stage 2 persistent (`PERSISTENT`, its weights through TMA too) when its K, the intermediate size, is at most
  PERSISTENT_MAX_K = 512 (H100, E 128 top-8 I 384, whole op with warm L2: 0.92 / 0.97 / 0.96x at 1024 / 4096 / 8192
  tokens; at I 768 and 1536 stage 2 is 0.99-1.02x, left to the tuner);
- fp8 per_token and per_1x128 take both together, never the sorted intermediate alone (H100, E 128 top-8 I 384,
  whole op with the L2 flushed: 0.94x at 1024-8192 tokens, per_1x128 1.01x at 1024), up to a longer K:
  `PERSISTENT_MAX_K_PER_TOKEN` 1536 (0.91-1.00x at I 768-1536) and `PERSISTENT_MAX_K_PER_1X128` 768;
- per_1x128 on Hopper with Gluon from m = `GLUON_MOE_MIN_M` (128), gated, D and I multiples of 128, I ≥
  `GLUON_MOE_MIN_K` (256; 1024 until the twenty-ninth session; below I 1024 from m = `GLUON_MOE_SHORT_K_MIN_M`,
  256): both stages on the Gluon kernels (`GLUON`, kernels/gluon_moe.py) on 128-row blocks, stage 1 on rows
  gathered for TMA (GATHER_A) with 64-wide gate and up tiles, stage 2 128 wide, both persistent and fed by a loader
  warp group (`GLUON_MOE_WS`, `GLUON_MOE_WS2`), 8 warps
  (H100, whole op: 0.81-0.97x the Triton plan's time at 2048-8192 tokens; Mixtral-8x7B 0.79x its scaled tuned row);
  where the pair is not taken, below I 1024, stage 1 alone on the Gluon kernel gathering its own rows (GATHER_A 0)
  before the plan's Triton stage 2 (`GLUON_MOE_STAGE1`; E 128 I 384 and Qwen3-30B-A3B 0.84-0.97x);
- MXFP4 (per_1x32) with 16-bit activations: the swapped GEMM on both stages (SWAP_AB: the weight tile decoded by
  packed PTX and fed to the wgmma from registers, one decode serving the whole block), tiles by `_mxfp4_swapped`.
  H100, gpt-oss-120b, stage pair on a ready sort (2026-11-27, sixteenth session): 527 / 1094 / 1205 µs at 16 / 64 /
  256 tokens on the 64 × 128 tiles against 940 / 1997 / 1477 for the same tiles through tl.dot_scaled (504.8 / 994.6
  / 1010.0 once the decode read the K32 order), and taller blocks from 1024 tokens (BM 32: 1918 against the bf16
  rule's 64-row swapped tiles' 2245; BM 64 at 4096: 4089 against 5723); its packed weights through TMA on Hopper
  (417 / 830 / 891 / 1463 / 3580 µs at 16 / 64 / 256 / 1024 / 4096 tokens against 492 / 967 / 1030 / 1597 / 3878 by
  pointers, seventeenth session); with fp8 activations (per_1x32_a8) the
  bf16/fp16 choice as a 2-stage plan without TMA or the sorted intermediate, BLOCK_K ≥ 32 (not measured apart);
- MXFP4 with 16-bit activations on Hopper, its codes' records at hand, up to MXFP4_ONE_STAGE_MAX_MEAN pairs an
  expert: the swapped 1-stage kernel (both GEMMs of a 128-wide slice of the intermediate in one program: BM 16, BN
  128, BK 128, BLOCK_D 128, 8 warps, 3 stages, weights and codes through TMA), stage 1 split along K under 1.25 waves
  of programs, the splits of a slice then sharing w2's rows (`_mxfp4_one_stage`). H100 (twenty-first session),
  against the rule table's stage pair: one token 0.88x (gpt-oss-120b), 0.79x (Qwen3-30B-A3B-like), 0.76x
  (DeepSeek-V2-Lite-like); gpt-oss-120b 0.79 / 0.78 / 0.92 / 0.95 / 0.98 / 0.96x at 2 / 4 / 8 / 16 / 32 / 64 tokens,
  gpt-oss-20b 0.77 / 0.79 / 0.93 / 1.01x at 2 / 4 / 16 / 64, Qwen3-like 0.80 / 0.88 / 0.89 / 0.95x at 2 / 4 / 16 /
  64, DeepSeek-like 0.70 / 0.79 / 0.88 / 1.00x;
- 1-stage only up to 8 routed pairs (tuned: 2 pairs 1-stage, 16 pairs 2-stage; the tuner's own limit is 256);
- split-K as for the GEMM, on the tuner's grid count (experts with pairs × blocks each × N tiles) and the weight
  bytes each program streams;
- BLOCK_N and BLOCK_K never exceed the next power of two (≥ 16) of what they tile, except where the tuner's rules
  need more (BLOCK_N ≥ 64 from BLOCK_M 64, BLOCK_K ≥ 128 for fp8 per_token); both stages share BLOCK_M.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_1stage import CAPPED_PROGRAMS_PER_SM, one_stage_programs
from tritune.kernels.fused_moe_config import PERSISTENT_QUANTS
from tritune.kernels.gemm import KERNELS as GEMM_KERNELS
from tritune.kernels.gemm import SCALE_BLOCK, GemmConfig, triton_ws_builds
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.gluon_blockscale import smem_bytes as gluon_smem_bytes
from tritune.kernels.gluon_gemm import smem_bytes as gluon_gemm_smem_bytes
from tritune.kernels.triton_release import HAS_WARP_SPECIALIZE
from tritune.ops import cost_model as cm

__all__ = ["MXFP4_ONE_STAGE_MAX_MEAN", "ONE_STAGE_PAIRS", "SPLIT_MIN_TILE_BYTES", "gemm_heuristic", "moe_heuristic"]

SPLIT_MIN_TILE_BYTES = 640 * 1024  # B bytes one program must stream before split-K's second launch pays
WS_MIN_K = 7168  # block-scaled persistent GEMMs warp-specialise from this K
# Block-scaled GEMMs run the Gluon kernel on Hopper from this M, with N >= 128 and K at least four 128-deep blocks
# (H100, twenty-fifth session: 1.23x faster than the Triton kernels in geomean, up to 1.39x, at M 256-8192 on
# (N, K) = (1536, 7168), (24576, 7168), (1536, 1536); smaller M, N and K not measured).
GLUON_MIN_M = 256
ONE_STAGE_PAIRS = 8  # routed pairs up to which the 1-stage kernel is the heuristic's choice
MXFP4_ONE_STAGE_MAX_MEAN = 8  # pairs an expert up to which MXFP4 takes the swapped 1-stage kernel (past 8 pairs)
# Programs an SM the swapped 1-stage kernel's K splits may fill: what fits under its register cap (register_cap).
ONE_STAGE_PROGRAMS_PER_SM = CAPPED_PROGRAMS_PER_SM
PERSISTENT_MAX_K = 512  # stage 2 (K = the intermediate size) runs persistent up to this K with the sorted intermediate
# fp8 runs it (and so the sorted intermediate) further: its K steps take half bf16's time, so the fill and epilogue a
# persistent program overlaps weigh twice as much. H100, whole op, L2 flushed, four shapes at 1024 / 4096 / 8192 tokens
# (RESULTS.md, twenty-fifth session): per_token at I 768 / 1408 / 1536 0.91-1.00x the time, at I 14336 1.00-1.06x;
# per_1x128 at I 768 0.93 / 0.99 / 1.00x, at I 1408 / 1536 0.99-1.04x.
# per_1x128 on Hopper from GLUON_MOE_MIN_M routed pairs an expert, gated, D and I multiples of 128 and I (stage 2's
# K) at least GLUON_MOE_MIN_K: both stages on the Gluon kernels, 128-row blocks (`_gluon_moe`; kernels/gluon_moe.py).
# H100, the whole op, L2 flushed (twenty-sixth session): E 64 top-6 I 1536 at 4096 / 8192 tokens 0.93 / 0.87x the
# Triton plan's time, DeepSeek-V2-Lite (I 1408) 0.86 / 0.81x; from m 128 (twenty-seventh session, 2048 tokens, m
# 192): 0.97 / 0.95x. From I 256 since the twenty-ninth session: with both stages fed by loader warp groups
# (GLUON_MOE_WS, GLUON_MOE_WS2) and stage 2's rows leaving by 16-byte stores, H200, whole op, L2 flushed, interleaved
# rounds: Qwen3-30B-A3B (I 768) 0.89 / 0.86x the time of the plan below (Triton stage 2) at 4096 / 8192 tokens, E 128
# top-8 I 384 0.99 / 0.95x. (Before those, at I 384 the one-tile Gluon stage 2 ran 1.22x the persistent Triton one's
# time and the pair made the op 1.28-1.37x slower: H100, twenty-sixth session.)
GLUON_MOE = True
GLUON_MOE_MIN_M = 128
GLUON_MOE_MIN_K = 256
# Below I 1024 the pair needs this many pairs an expert: at m 128 (2048 tokens) it ran 1.11x the time of the plan
# below at E 128 top-8 I 384 and 1.02x at Qwen3-30B-A3B (H200, twenty-ninth session).
GLUON_MOE_SHORT_K_MIN_M = 256
# Where the pair is not taken (fewer than GLUON_MOE_MIN_M pairs an expert), below this I: stage 1 alone on the Gluon
# kernel (GLUON_MOE_STAGE1, below); from it, the Triton plan.
GLUON_MOE_STAGE1_MAX_K = 1024
# Stage 2 of that pair persistent (a program an SM walking its (block, column) tiles): H100, whole op, L2 flushed
# (twenty-seventh session): 0.97-0.98x the one-tile-a-program Gluon stage 2's time at 4096 tokens (E 64 I 1536,
# DeepSeek-V2-Lite, Mixtral-8x7B), 1.00 at 8192; alone, 246 against 260 µs at E 64 4096 tokens.
GLUON_MOE_PERSISTENT = True
# Stage 1's rows copied into the sort's order by a launch before it (GATHER_A 1), or (False) by the stage-1 kernel
# itself with cp.async. H100, whole op (twenty-seventh session): copied, the pair above runs 0.83-0.95x the own-gather
# pair's time at E 64 I 1536, DeepSeek-V2-Lite and Mixtral-8x7B, 4096-8192 tokens (each of I/64 column tiles
# gathers its rows again, by cp.async, where the copied rows come through TMA).
GLUON_MOE_COPY_ROWS = True
# Below GLUON_MOE_STAGE1_MAX_K where the pair is not taken (from GLUON_MOE_STAGE1_MIN_M pairs an expert, the same
# shapes otherwise): stage 1 alone on the Gluon kernel, gathering its own rows (GATHER_A 0: the intermediate is
# short, few column tiles gather), on the Triton plan's 64- or 128-row blocks, before the plan's Triton stage 2
# (`_gluon_stage1`). H100, whole op, L2 flushed: E 128 top-8 I 384 0.84-0.89x the Triton plan's time at 4096 / 8192
# tokens, Qwen3-30B-A3B (I 768) 0.92-0.97x; at 2048 tokens (m 128) 0.89 / 0.92x. (Those counts now take the pair.)
GLUON_MOE_STAGE1 = True
GLUON_MOE_STAGE1_MIN_M = 64  # at 1024 tokens (m 64): E 128 I 384 0.92x, Qwen3-30B-A3B 0.87x
# The Gluon stage 1 persistent (a program an SM, the next tile's loads under this one's epilogue) in both rules. H100,
# whole op (twenty-seventh session): 0.98-1.04x with the copied rows (E 64, DeepSeek-V2-Lite, Mixtral-8x7B at 4096 /
# 8192 tokens), 1.06-1.13x with its own gather (E 128, Qwen3-30B-A3B): off; the tuner re-times the 128-row pair with
# both stages persistent.
GLUON_MOE_STAGE1_PERSISTENT = False
# The Gluon stage 1 writing the intermediate in fp8 itself (QUANT_OUT; a program two 64-wide tiles of one scale
# group), no quantization launch, in both rules. H100, twenty-eighth session, whole op: 0.96-1.05x at 4096 / 8192
# tokens on five shapes (E 64 8192: the kernel 817 µs against 764 + the launch's 89), so off; the pair's stage 1 is
# persistent now (GLUON_MOE_WS), which it is not.
GLUON_MOE_QUANT_OUT = False
# The Gluon stage 1 of the pair (copied rows) persistent with its loads from a loader warp group (WARP_SPEC;
# kernels/gluon_moe.moe_stage1_ws_kernel, the scheme of gluon_gemm_ws) and `GLUON_MOE_WS_STAGES` stages. H100,
# twenty-eighth session: stage 1 alone 376 / 708 µs against the one-tile kernel's 434 / 778 at E 64 top-6 I 1536
# 4096 / 8192 tokens (4 stages: 393 / 721), Mixtral-8x7B 8192 tokens 4311 against 4449; the whole op, L2 flushed,
# 0.91-0.93 / 0.96-0.98x at E 64 4096 / 8192 tokens, DeepSeek-V2-Lite 0.95 / 0.97x.
GLUON_MOE_WS = True
GLUON_MOE_WS_STAGES = 6
# Stage 2 of the pair the same way (kernels/gluon_moe.moe_stage2_ws_kernel, as many of GLUON_MOE_WS_STAGES as fit).
# H200, twenty-ninth session, whole op, L2 flushed, interleaved rounds: E 64 top-6 I 1536 0.96 / 0.99x at 4096 / 8192
# tokens, DeepSeek-V2-Lite 0.95 / 0.98x; alone 204-206 against 220 µs (E 64, 4096 tokens, warm L2). Its first form
# (twenty-eighth session) ran 1.33x slower: D and out's row stride unspecialized, so rows left 2 bytes at a time.
GLUON_MOE_WS2 = True
# The pair's stage 2 adding each row into its token's row of a [T, D] accumulator (TOPK_ATOMIC) instead of writing
# [pairs, D] rows for a top-k sum launch: at E 128 top-8 that sum and its rows are about a quarter of the op. 1: an fp32
# accumulator (two columns an atomic, from the MMA's layout; 67 MB at 4096 tokens and D 4096, more than the L2); 2: one
# in the activations' 16-bit type (eight columns an atomic; half the bytes, each add rounded). Written in the
# twenty-ninth session (compiled for sm_90), not yet run on a GPU: 0 (off). The seventh session's Triton stage 2 with
# fp32 atomics ran 1.04-1.12x slower from 2048 tokens. Never under TRITUNE_DETERMINISTIC (the adds' order is the GPU's).
GLUON_MOE_TOPK_ATOMIC = 0
# Below GLUON_MOE_STAGE1_MAX_K, the Gluon stage 1 that gathers its own rows persistent with the gather and the weights'
# loads in a loader warp group (WARP_SPEC with GATHER_A 0; its cp.async copies arrive on the stage's barrier). H200,
# twenty-ninth session, E 128 top-8 I 384, stage 1 alone (warm L2), 64x64 tiles: 321.9 / 594.1 µs at 4096 / 8192
# tokens against the one-tile kernel's 314.0 / 567.5; the whole op 1.01-1.05x. Off.
GLUON_MOE_STAGE1_WS = False
PERSISTENT_MAX_K_PER_TOKEN = 1536
PERSISTENT_MAX_K_PER_1X128 = 768
FILL = 0.7  # a tile is large enough when its grid covers this fraction of the SMs
# bf16 past 64 rows: a tile's speed per output element against 128x256's, roughly as tuned on the H100 (six held-out
# (N, K), M 256-8192, 2026-11-27: 128x128 at 6 stages ran about 0.93 of 128x256, 64-row and 64-column tiles 0.65-0.85).
# The tile taken is the one whose waves cost least (`_wave_cost`): at M 1024, N 6144, 384 tiles of 128x128 (2.9
# waves) beat 192 of 128x256 (1.45 waves, the second half empty): 74.9 against 93.2 us.
TILE_SPEED = {(128, 256): 1.0, (256, 128): 1.0, (128, 128): 0.93, (64, 256): 0.85, (128, 64): 0.7, (64, 128): 0.7,
              (64, 64): 0.65}

# fp8 per-token (a8w8) on Hopper from GLUON_MIN_M: the tile whose waves cost least (`_wave_cost`) among the Triton
# kernel's 128x256 and the Gluon kernel's tiles (kernels/gluon_gemm; (BM, BN, warps, stages)), each at its speed per
# output element against Triton's 128x256 at 8192 rows (H100, six held-out (N, K), twenty-sixth session: Gluon
# 128x128 0.75-0.97, 64x192 0.82-0.88, 128x192 0.77-0.87, 64x128 0.72-0.74). Where Triton's tile wins, the rule
# below picks its config as before. Measured in one run with the Triton-only rule: the Gluon tiles ran 0.83-0.97x
# its time at the 9 of 24 points (M 256-4096) where the costs pick them; the op 1.047 -> 1.089x `_scaled_mm` in
# geomean. Where Triton's 128x256 is picked it ran 1.0-1.1x faster than any Gluon tile.
FP8_TILE_SPEED = {(128, 256): 1.0, (128, 128): 0.86, (64, 192): 0.85, (128, 192): 0.82, (64, 128): 0.72}
_GLUON_FP8_TILES = ((128, 128, 8, 4), (64, 192, 4, 5), (128, 192, 8, 4), (64, 128, 4, 6))

# (M upper bound or None, main tiles largest first, fallback tiles). Block-scaled: BLOCK_N capped at 128, no
# 128-row tile up to M=256 (tuned: 64x128 beat 128x128 there) and no 32-row main tile past M=32 (its BLOCK_K 128
# keeps too little in flight; tuned: 64-row tiles). Fallbacks only for grids under a third of the SMs.
_GEMM_TILES = (
    (16, ((16, 128), (16, 64)), ((16, 32),)),
    (32, ((32, 128), (32, 64)), ((32, 32),)),
    (64, ((64, 128), (64, 64), (32, 64)), ((16, 64),)),
    (256, ((128, 256), (128, 128), (64, 128), (64, 64)), ((64, 32),)),
    (512, ((128, 128), (64, 128), (64, 64)), ()),
    (None, ((128, 256), (128, 128), (128, 64)), ()),
)
SMALL_STAGE_BYTES = 8 * 1024  # a pipeline stage this small gets a fifth stage (vLLM's small-M block-fp8 configs)
# bf16/fp16 GEMM past LARGE_M rows: the wave-cost tile (`TILE_SPEED`), 4 warps on 128x128, and as many stages as fit,
# up to DEEP_STAGES (H100, six held-out (N, K) at M 256 and 1024: 128x128x64 ran 1.10-1.41x faster with 6-7 stages
# than with 4, e.g. 33.9 against 41.9 us at M 256, N 6144, K 4096)
DEEP_STAGES, LARGE_M = 7, 64


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(grid: int, tile_bytes: int, K: int, block_k: int, sm_count: int) -> int:
    """Split-K factor: 1 unless the grid is under half the SMs and each program streams a long K."""
    if grid * 2 >= sm_count or tile_bytes < SPLIT_MIN_TILE_BYTES:
        return 1
    best = 1
    for s in (2, 4, 8):
        if grid * s <= 2 * sm_count and K >= 4 * s * block_k:
            best = s
    return best


def _fills(grid: int, sm_count: int) -> bool:
    """A grid that covers FILL of the SMs and whose last wave is not mostly empty (≥ FILL of the waves' slots).

    0.7 rather than 3/4: Llama-3-8B's qkv (N=6144) at M=200 gives 96 tiles of 128×128 (0.73 of 132 SMs), which
    measured 1.33× faster as an op than the 384 tiles of 64×64 the 3/4 rule picked (H100, 2026-11-23)."""
    waves = _cdiv(grid, sm_count)
    return grid >= FILL * sm_count and grid >= FILL * waves * sm_count


def _wave_cost(tile: tuple[int, int], M: int, N: int, sm_count: int, speeds: dict = TILE_SPEED) -> float:
    """The time of a grid of `tile`, in units of one 128×256 tile at full speed: waves × tile area / the tile's
    measured speed (`speeds`: bf16's `TILE_SPEED` unless given)."""
    bm, bn = tile
    return _cdiv(_cdiv(M, bm) * _cdiv(N, bn), sm_count) * bm * bn / speeds.get(tile, 0.5) / (128 * 256)


def _gluon_fp8(M: int, N: int, sm_count: int, max_shared: int) -> GemmConfig | None:
    """The Gluon a8w8 config whose waves cost least (`FP8_TILE_SPEED`), None where Triton's 128x256 costs least."""
    best = min(((128, 256, 0, 0),) + _GLUON_FP8_TILES,
               key=lambda t: _wave_cost(t[:2], M, N, sm_count, FP8_TILE_SPEED))  # first of equals: Triton's
    bm, bn, warps, stages = best
    if not warps:
        return None
    while stages > 2 and gluon_gemm_smem_bytes(bm, bn, stages) > max_shared:
        stages -= 1
    return GemmConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=warps,
                      num_stages=stages, PERSISTENT_TMA=True, GLUON=True)


def _gemm_tile(kernel: str, M: int, N: int, sm_count: int, by_wave_cost: bool) -> tuple[int, int]:
    """`by_wave_cost` (bf16/fp16 past LARGE_M rows): the tile of M's row (main or fallback) whose waves cost least
    (`_wave_cost`). Otherwise the first main tile whose grid fills the SMs (`_fills`); past the last main tile,
    fallbacks only while the grid is under a third of the SMs; else the last tile tried."""
    _, main, fallback = next(row for row in _GEMM_TILES if row[0] is None or M <= row[0])
    tiles = [(t, i >= len(main)) for i, t in enumerate(main + fallback)]
    if kernel == "a8w8_blockscale":  # BLOCK_N <= 128 keeps one B scale per tile (a scalar in the K loop)
        tiles = [((bm, min(bn, 128)), fb) for (bm, bn), fb in tiles
                 if (M > 256 or bm < 128) and (M <= 32 or fb or bm > 32)]
    n_cap = max(16, _p2(N))
    tiles = list({(bm, min(bn, n_cap)): fb for (bm, bn), fb in tiles}.items())
    if by_wave_cost:
        return min((t for t, _ in tiles), key=lambda t: _wave_cost(t, M, N, sm_count))  # first of equals
    for i, ((bm, bn), _) in enumerate(tiles):
        grid = _cdiv(M, bm) * _cdiv(N, bn)
        if i + 1 == len(tiles) or _fills(grid, sm_count) or (tiles[i + 1][1] and grid * 3 >= sm_count):
            return bm, bn
    raise AssertionError("unreachable")


def _fit_stages(stages: int, smem_of, max_shared: int, k_steps: int) -> int:
    """The most stages (≤ `stages`, ≤ 2 + K steps, ≥ 1) whose shared memory fits (1 when none does)."""
    stages = min(stages, 2 + k_steps)
    while stages > 1 and smem_of(stages) > max_shared:
        stages -= 1
    return stages


def _fit(bk: int, min_bk: int, stages_of) -> tuple[int, int]:
    """(BLOCK_K, stages): halve BLOCK_K (not under `min_bk`) while fewer than 3 stages would fit."""
    stages = stages_of(bk)
    while stages < 3 and bk // 2 >= min_bk:
        bk //= 2
        stages = stages_of(bk)
    return bk, stages


# Block-scaled where even 64x128 tiles fill under half the SMs: 64x64 tiles (twice the grid), warp-specialised, as many
# stages as fit up to NARROW_STAGES. H200, thirtieth session, tuned op (these tiles were the tuner's winners) against
# the 64x128 rule: 1536 x 7168 at M 256 (48 tiles of 64x128) 18.0 against 22.2 us, 1536 x 1536 8.5 against 9.4.
NARROW_STAGES = 8


def _gluon_blockscale_narrow(M: int, N: int, K: int, max_shared: int) -> GemmConfig:
    stages = _fit_stages(NARROW_STAGES, lambda s: gluon_smem_bytes(64, 64, s), max_shared, _cdiv(K, SCALE_BLOCK))
    return GemmConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=SCALE_BLOCK,
                      GROUP_SIZE_M=8 if _cdiv(M, 64) > 1 else 1, num_warps=4, num_stages=stages,
                      PERSISTENT_TMA=True, GLUON=True, WARP_SPECIALIZE=True)


# The warp-specialised 128x128 tile with K split 2-4 ways (kernels/gluon_gemm_ws.ws_splitk_kernel, MODE 2) where
# the split's waves cost less (`_blockscale_splits`): 1536 x 7168 has 96 tiles at M 1024 (0.73 of a wave; split 4:
# 384 units, 2.9 waves of quarter tiles) and 192 at M 2048 (1.45 waves; split 2: 2.9 waves of half tiles). Written
# in the thirtieth session after the device time ran out: compiled for sm_90, GPU tests written, not yet measured,
# so off; the tuner's TMA rule keeps split-K out of its space too.
GLUON_BLOCKSCALE_SPLIT_K = False
SPLIT_OVERHEAD_BLOCKS = 2  # a unit's fixed cost in K blocks: its pipeline's fill and its share of the fix-up
MIN_SPLIT_K_BLOCKS = 8  # K blocks a split keeps at least


def _blockscale_splits(M: int, N: int, K: int, sm_count: int) -> int:
    """The K split (1-4) of 128x128 tiles whose waves cost least: waves x (K blocks a unit + SPLIT_OVERHEAD_BLOCKS),
    each split keeping MIN_SPLIT_K_BLOCKS; ties to the smaller split."""
    from tritune.kernels.gluon_gemm_ws import split_k_fits

    tiles, k_blocks = _cdiv(M, 128) * _cdiv(N, 128), _cdiv(K, SCALE_BLOCK)
    best, best_cost = 1, _cdiv(tiles, sm_count) * (k_blocks + SPLIT_OVERHEAD_BLOCKS)
    for splits in (2, 3, 4):
        per = _cdiv(k_blocks, splits)
        if per < MIN_SPLIT_K_BLOCKS or not split_k_fits(K, splits):
            continue
        cost = _cdiv(tiles * splits, sm_count) * (per + SPLIT_OVERHEAD_BLOCKS)
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def _gluon_blockscale(M: int, N: int, K: int, sm_count: int, max_shared: int) -> GemmConfig:
    """The Gluon block-scaled kernel's tile: 128x128 on 8 warps where those tiles make at least a wave, fed by a
    loader warp group (WARP_SPECIALIZE, kernels/gluon_gemm_ws) through 5 stages; else 64x128 on 4 warps, one kernel
    for loads and MMAs (H100, the three (N, K) of issue 15 at M 256-8192: the 64-row and the one-kernel 128-row
    tiles each the best of six Gluon variants or within 6% of it, twenty-fifth session; the warp-specialised
    128-row tile 0.833 → 0.908-0.916x `_scaled_mm`'s time in geomean from M 1024, twenty-eighth session)."""
    if 2 * _cdiv(M, 64) * _cdiv(N, 128) <= sm_count and _cdiv(M, 128) * _cdiv(N, 128) < sm_count:
        return _gluon_blockscale_narrow(M, N, K, max_shared)  # measured; the K split (unmeasured) not preferred
    splits = _blockscale_splits(M, N, K, sm_count) if GLUON_BLOCKSCALE_SPLIT_K else 1
    bm = 128 if splits > 1 or _cdiv(M, 128) * _cdiv(N, 128) >= sm_count else 64
    # 64-row tiles: 5 stages while the grid is under a wave (one program a SM anyway), else 4, which lets two
    # programs share a SM (5 stages: 1536 x 7168 at M 1024 40.3 us against 31.4; at M 256 22.0 against 24.9)
    most = 5 if bm == 128 or _cdiv(M, 64) * _cdiv(N, 128) <= sm_count else 4
    stages = min(most, 2 + _cdiv(K, SCALE_BLOCK))
    while stages > 2 and gluon_smem_bytes(bm, 128, stages) > max_shared:
        stages -= 1
    # Persistent (as many programs as fit at once, each walking tiles; the same as one tile a program where the grid
    # fits at once): the next tile's loads under this one's epilogue. H100: 0.85-0.95x the time at K 1536 from M
    # 2048 and at 1536 x 7168 from M 4096, about even elsewhere; 24576 x 7168 at M 8192 1.05-1.11x (within the
    # ±10% that multi-millisecond kernels move between runs here).
    return GemmConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=SCALE_BLOCK,
                      GROUP_SIZE_M=8 if _cdiv(M, bm) > 1 else 1, num_warps=bm // 16, num_stages=stages,
                      NUM_KSPLIT=splits, PERSISTENT_TMA=True, GLUON=True, WARP_SPECIALIZE=bm == 128)


def gemm_heuristic(kernel: str, M: int, N: int, K: int, sm_count: int = 132, max_shared: int = 232448, *,
                   capability: tuple[int, int] = (9, 0), warp_specialize: bool = HAS_WARP_SPECIALIZE,
                   gluon: bool = HAS_GLUON_HOPPER) -> GemmConfig:
    """The rule-table config (module docstring) for C[M, N] = A[M, K]·B[N, K]ᵀ with `kernel` ("bf16" for
    bf16/fp16 operands, "a8w8", "a8w8_blockscale"). `warp_specialize`: whether this Triton has `tl.range(...,
    warp_specialize=...)`; `gluon`: whether it has Gluon's Hopper API (defaults: the installed Triton's). ValueError
    for an unknown kernel or a size < 1."""
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"unknown GEMM kernel {kernel!r}; expected one of {GEMM_KERNELS}")
    if min(M, N, K) < 1:
        raise ValueError(f"M, N, K must be >= 1, got M={M} N={N} K={K}")
    block_scaled = kernel == "a8w8_blockscale"
    if block_scaled and gluon and capability[0] == 9 and M >= GLUON_MIN_M and N >= 128 and K >= 4 * SCALE_BLOCK \
            and N % 8 == 0 and K % 16 == 0:
        return _gluon_blockscale(M, N, K, sm_count, max_shared)
    if kernel == "a8w8" and gluon and capability[0] == 9 and M >= GLUON_MIN_M and N >= 128 and K >= 4 * 128 \
            and N % 8 == 0 and K % 16 == 0:
        config = _gluon_fp8(M, N, sm_count, max_shared)
        if config is not None:
            return config
    elt = 1 if kernel in cm.FP8_KERNELS else 2
    large_bf16 = elt == 2 and M > LARGE_M  # the held-out tune's rules: wave-cost tile, deep stages, 4 warps on 128x128
    bm, bn = _gemm_tile(kernel, M, N, sm_count, large_bf16)
    big = bm >= 128 and bn >= 128
    if block_scaled:
        bk = SCALE_BLOCK
    elif bm <= 32:
        bk = 256
    else:
        bk = 64 if elt == 2 and big else 128
    # BLOCK_K 64 and under only on block-scaled or >= 128x128 tiles (the tuner's rule); past K it only masks.
    min_bk = 16 if block_scaled or big else 128
    bk = max(min(bk, max(16, _p2(K))), min_bk)
    pm, pn = _cdiv(M, bm), _cdiv(N, bn)
    aligned = (K * elt) % 16 == 0 and (N * 2) % 16 == 0
    # Persistent TMA from M 1024 for block-scaled and for bf16/fp16 (tuned, H100: 128x128 through TMA on 4 warps ran
    # 0.80-0.91x the pointer kernel's time at M 1024 on 4 of 6 held-out (N, K), 128x256 the same either way), else 2048.
    tma_from = 1024 if block_scaled or elt == 2 else 2048
    tma = capability[0] >= 9 and aligned and bm >= 64 and M >= tma_from
    split = 1 if tma else _split(pm * pn, bn * K * elt, K, bk, sm_count)
    epilogue = bm * bn * 2 if tma else 0

    def stages_of(block_k: int) -> int:
        if large_bf16:
            most = DEEP_STAGES
        else:
            most = 5 if (bm + bn) * block_k * elt <= SMALL_STAGE_BYTES else 4
        return _fit_stages(most, lambda s: (bm + bn) * block_k * elt * s + epilogue, max_shared,
                           _cdiv(K, block_k * split))

    bk, stages = _fit(bk, min(bk, min_bk), stages_of)
    # Block-scaled, persistent, long K: load warps feeding the MMA warps hide the per-K-block rescale (H100, Triton
    # 3.6: 0.88-0.97x the time from K 7168 at M >= 1024; about 1.0x at K 3584-4096; bf16 gained nothing).
    # Only where Triton can build it (`triton_ws_builds`: at N 16-32 the 128-row tile on 4 warps could not).
    warps = 8 if big and not (large_bf16 and bm * bn <= 128 * 128) else 4
    ws = block_scaled and tma and K >= WS_MIN_K and warp_specialize and triton_ws_builds(bm, bn, warps)
    return GemmConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8 if pm > 1 else 1,
                      num_warps=warps,
                      num_stages=stages, NUM_KSPLIT=split,
                      cache_modifier=".cg" if M <= 16 else "", PERSISTENT_TMA=tma, WARP_SPECIALIZE=ws)


# ---------------------------------------------------------------------------------------------------- fused MoE


def _mxfp4_swapped(pairs: int, experts: int, model_dim: int, inter_dim: int,
                   sm_count: int, tma: bool, records: bool = True) -> tuple[MoeConfig, MoeConfig]:
    """Both stage configs for MXFP4 weights with 16-bit activations: the swapped GEMM (SWAP_AB, module docstring).

    On Hopper (`tma`) the packed weights come through TMA (their swizzled shared tile reads without the pointer
    path's bank conflicts: 7.7-15% off the stage pair, seventeenth session) and so do the e8m0 codes, from their
    records (SCALE_TMA at BLOCK_K 128; the op turns it off for plain codes). With the codes prefetched the tuner's own
    measurements (H100, gpt-oss-120b, eighteenth session, each stage alone) ranked: 16-row blocks up to 16 pairs an
    expert, 64 x 128-deep tiles on 4 warps, 4 pipeline stages (stage 1 at 64 tokens 438 us, 3 stages 450, the codes
    by pointers 547); past 16 pairs 64-row blocks with 128 x 128 tiles on 8 warps, BLOCK_K 128, stage 2 on 4 stages
    (1024 tokens, 32 pairs an expert: stage 1 718 us against 745 on the 32-row block; 4096: 1670 against 1822 on
    64-wide tiles). Stage 2, which reads one weight tile a K step where stage 1 reads two, takes the 128-row tile on
    8 warps at 16-row blocks too (nineteenth session, the stage pair with re-encoded weights: 308.0 against 329.9 us
    at 16 tokens, 620.8 against 684.2 at 64), unless that grid would need splitting; so does stage 1, on 3 stages,
    up to 2 pairs an expert, since the prepared weights are tile-major (twentieth session, the stage pair on four
    shapes: -1.6 to -3.5% at 0.5-1.5 pairs an expert, -3% and +1.3% at 2, +1.1 to +6.8% at 4-8).
    Without TMA: BLOCK_M the power of two holding the mean pairs per expert, 16 to 64 (128 spilled: 255 registers on
    the gated stage 1, 1.3-2.4x behind 64); BLOCK_N 64 (a wgmma's rows, even past a smaller N; wider on 4 warps
    raced, check_config); BLOCK_K 128 on blocks of up to 32 rows, 64 on 64-row ones, where stage 2 takes 128 x 128
    tiles on 8 warps. Split along K when the routed experts' N tiles give under 2 programs an SM, in 4 where each
    split keeps 4 K steps, else 2 (H100, gpt-oss-120b at one token, 4 experts x 45 tiles: 74 us the stage pair split
    2, 105 unsplit; at 16 tokens, 2880 programs, splitting lost; through TMA at one token: 4 splits 48.5 and 28.5
    us, 2 splits 50.8 and 31.6). `records` False (the caller has the codes only, no records): the TMA rule of before
    the records, the weights through TMA and the codes by pointers (seventeenth session: past 32 pairs an expert
    stage 1 kept BLOCK_K 64; with the codes by pointers the 128-wide tiles ran 1780 against 1337 us at 1024 tokens)."""
    mean = _cdiv(pairs, experts)
    tma_codes = tma and records
    bm = (16 if _p2(mean) <= 16 else 64) if tma_codes else min(64, max(16, _p2(mean)))
    blocks = min(pairs, experts) * _cdiv(mean, bm)
    configs = []
    for stage2, (n, k) in enumerate(((inter_dim, model_dim), (model_dim, inter_dim))):  # stage 1's N: gate and up
        wide = bm == 64 and (tma_codes or bool(stage2))
        # 16-row blocks take 128-row tiles on 8 warps too where that grid still fills two waves unsplit: stage 2's
        # always, a gated stage 1's up to 2 pairs an expert.
        wide = wide or (tma_codes and (bool(stage2) or mean <= 2) and blocks * _cdiv(n, 128) >= 2 * sm_count)
        bn, warps = (128, 8) if wide else (64, 4)
        bk = max(32, min(128 if bm <= 32 or wide else 64, _p2(k)))
        split = 1
        if blocks * _cdiv(n, bn) < 2 * sm_count:  # under two waves: split 4 while each split keeps 4 K steps
            split = 4 if k >= 16 * bk else 2 if k >= 4 * bk else 1
        # The codes through TMA where their records fit the tile (BLOCK_K 128; stage 1's up rows on a record).
        scale_tma = int(tma_codes and bk == 128 and (stage2 or n % 64 == 0))
        deep = (scale_tma and split == 1 and (bm == 16 or stage2) and not (wide and not stage2)
                and _cdiv(k, bk) >= 2)  # the tuner's cap: steps + 2
        stages = 4 if deep else 3
        configs.append(MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, num_warps=warps,
                                 num_stages=stages, KSPLIT=split, SWAP_AB=1, USE_TMA=int(tma), SCALE_TMA=scale_tma))
    return configs[0], configs[1]


def _mxfp4_one_stage(pairs: int, experts: int, model_dim: int, inter_dim: int, gated: bool, tma_codes: bool,
                     sm_count: int) -> MoeConfig | None:
    """The swapped MXFP4 1-stage config (module docstring), or None where the stage pair is the rule: programs (16-row
    blocks × 128-wide slices of the intermediate) that 8 splits would not make a wave of, past
    MXFP4_ONE_STAGE_MAX_MEAN pairs an expert, without TMA or the codes' records, or a gated w1's up rows do not
    start a record (inter_dim not a multiple of 64). Stage 1 splits along K (2, 4 or 8, each split 4 K steps at
    least) while the programs stay within ONE_STAGE_PROGRAMS_PER_SM an SM, the splits of a slice sharing w2's rows
    (fused_moe_1stage COOP_SPLIT; past two an SM the kernel's registers are capped so three fit, register_cap).
    H100 (twenty-second session, µs, best split first): gpt-oss-120b 1 token (92 slices) split 4 44.3 / split 2
    47.9, 2 tokens split 2 68.9 / unsplit 77.5; Qwen3-30B-A3B-like (48 slices) split 4 27.0 / split 8 30.9, 2 tokens
    split 4 35.7 / 2 36.7, 4 tokens split 2 52.1 / unsplit 57.0; DeepSeek-V2-Lite-like 1 token split 4 28.5, 2 tokens
    split 2 41.5, 4 tokens (264) unsplit 60.1. One miss: gpt-oss-120b at 4 tokens (368 slices) ran split 2 in 116.2
    against 132.6 unsplit."""
    mean = _cdiv(pairs, experts)
    if not tma_codes or mean > MXFP4_ONE_STAGE_MAX_MEAN or (gated and inter_dim % 64):
        return None
    programs = one_stage_programs(pairs, experts, inter_dim, 128)
    if programs * 8 < sm_count:
        return None
    split = 1
    while split < 8 and programs * 2 * split <= ONE_STAGE_PROGRAMS_PER_SM * sm_count \
            and model_dim >= 2 * split * 4 * 128:
        split *= 2
    return MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=8, num_stages=3,
                     KSPLIT=split, BLOCK_SIZE_D=128, SWAP_AB=1, USE_TMA=1, SCALE_TMA=1)


# fp8 (per_token, per_1x128) at decode sizes: the stage pair even at a handful of pairs (the 1-stage kernel widens its
# fp8 w2 to 16 bits in registers), stage 1 64 and stage 2 128 wide on 16-row blocks. Tuned on the H100, E 128 top-8
# I 384 and Qwen3-30B-A3B (I 768), both quantizations at 1 / 16 / 64 tokens: every 1-token winner was the pair, 0.66-
# 0.85x the rule's 1-stage; every winner's stage 1 was 64 wide (the rule's 32), stage 2 128 (per_token) or 256
# (per_1x128, one 64); the tuned ops ran 0.88-0.99x the rule's at 16-64 tokens (RESULTS.md, twenty-fourth session).
FP8_PAIR_AT_DECODE = True

# A stage's 256-wide K step only where K holds at least this many of them: stage 2 of E 128 top-8 I 384 at 16 and 64
# tokens ran 0.82x and 0.89x the time with 128-wide steps (1.5 steps of 256, the second half empty), Qwen3-30B-A3B's
# I 768 (3 steps) 0.98x; from I 1408 (5.5 steps) 128 was even or 1% slower (H100, bf16, RESULTS.md twenty-fourth
# session).
MIN_WIDE_K_STEPS = 4


def _moe_block_m(m: float, quant: str) -> int:
    if m <= 12:
        return 16
    if m <= 24:
        return 32
    # per_1x128 rescales every column per K step: 64-row tiles at every m (tuned on the H100: 64x256 won at m = 256,
    # 384 and 1024 (Mixtral, 4096 tokens; tuned_fp8_large.csv), the 128-row tiles 2.2x behind at m = 384; on an
    # H200 at m = 256 the best 128-row stage-1 tile ran 1.4x behind; the old 128-row rule from m = 512 ran DeepSeek-V2-
    # Lite at 6000 tokens (m = 562) in 4478 us where vLLM's 64-row default took 1104)
    return 64 if m <= 128 or quant == "per_1x128" else 128


def _moe_stage(bm: int, bn: int, bk: int, warps: int, n: int, k: int, quant: str, mean: int, active: int,
               halves: int, elt: int, tma: bool, sm_count: int, max_shared: int) -> MoeConfig:
    """One stage's config with the dimension caps, warps, GROUP_SIZE_M, split-K and stages applied."""
    bn = max(min(bn, max(16, _p2(n))), 64 if bm > 32 else 16)  # the tuner keeps BLOCK_N 32 to BLOCK_M <= 32
    bk = min(bk, max(16, _p2(k)))
    while bk > 128 and _cdiv(k, bk) < MIN_WIDE_K_STEPS:  # a short K loop cannot fill the pipeline
        bk //= 2
    if quant == "per_token":
        bk = max(bk, 128)  # the tuner prunes fp8 per_token with BLOCK_K 64
    acc = halves * bm * bn
    warps = 8 if acc >= 128 * 64 and (warps == 8 or acc // 128 > 128) else 4
    blocks_per_expert = _cdiv(mean, bm)
    grid = active * max(1, blocks_per_expert) * _cdiv(n, bn)  # the tuner's count
    split = _split(grid, halves * bn * k * elt, k, bk, sm_count)

    def stages_of(block_k: int) -> int:
        return _fit_stages(4, lambda s: s * (bm + halves * bn) * block_k * elt, max_shared,
                           _cdiv(k, block_k * split))

    bk, stages = _fit(bk, 128 if quant == "per_token" else min(bk, 64), stages_of)
    return MoeConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8 if blocks_per_expert > 1 else 1,
                     num_warps=warps, num_stages=stages, KSPLIT=split, USE_TMA=int(tma and (k * elt) % 16 == 0))


def moe_heuristic(tokens: int, model_dim: int, inter_dim: int, experts: int, topk: int, quant: str,
                  sm_count: int = 132, max_shared: int = 232448, *,
                  gated: bool = True, capability: tuple[int, int] = (9, 0),
                  one_stage: bool = True, scale_records: bool = True,
                  gluon: bool = HAS_GLUON_HOPPER, atomics: bool = True) -> tuple[bool, MoeConfig, MoeConfig | None]:
    """(run_1stage, stage-1 or 1-stage config, stage-2 config or None) for `tokens` tokens of a fused MoE with
    hidden [tokens, model_dim], w1 [experts, 2·inter_dim (inter_dim if not gated), model_dim], w2 [experts,
    model_dim, inter_dim]; quant "none" | "per_token" | "per_1x128" | "per_1x32" (MXFP4 weights) | "per_1x32_a8" (and
    fp8 activations). `one_stage` False:
    never the 1-stage kernel. `scale_records` False: MXFP4 scales given as codes only (no SCALE_TMA tiles).
    `atomics` False: no plan whose stage 2 sums the top-k slots with atomics (TRITUNE_DETERMINISTIC). Rules:
    module docstring."""
    if quant not in fm.ALL_QUANTS:
        raise ValueError(f"quant {quant!r}; expected one of {fm.ALL_QUANTS}")
    if min(tokens, model_dim, inter_dim, experts, topk) < 1 or topk > experts:
        raise ValueError(f"bad fused-MoE shape: tokens={tokens} model_dim={model_dim} inter_dim={inter_dim} "
                         f"experts={experts} topk={topk}")
    if quant == fm.MXFP4:
        one = _mxfp4_one_stage(tokens * topk, experts, model_dim, inter_dim, gated,
                               capability[0] >= 9 and scale_records, sm_count)
        if one is not None and one_stage:
            return True, one, None
        return False, *_mxfp4_swapped(tokens * topk, experts, model_dim, inter_dim, sm_count, capability[0] >= 9,
                                      scale_records)
    if quant in fm.MXFP4_QUANTS:
        # fp8 activations, weights upcast in the kernel: the bf16 tiles (not measured apart yet), 2-stage (the
        # unswapped MXFP4 1-stage kernel is the tuner's to pick: not measured), without TMA (the weights load by
        # pointers) or the sorted intermediate (not measured with MXFP4), BLOCK_K >= 32.
        _, s1, s2 = moe_heuristic(tokens, model_dim, inter_dim, experts, topk, "none", sm_count, max_shared,
                                  gated=gated, capability=capability, one_stage=False)
        s1, s2 = (replace(c, USE_TMA=0, SORTED_INTER=0, PERSISTENT=0, BLOCK_SIZE_K=max(32, c.BLOCK_SIZE_K))
                  for c in (s1, s2))
        return False, s1, s2
    elt = 1 if quant != "none" else 2
    pairs = tokens * topk
    halves = 2 if gated else 1
    if pairs <= ONE_STAGE_PAIRS and one_stage and (quant == "none" or not FP8_PAIR_AT_DECODE):
        return True, _one_stage(model_dim, inter_dim, quant, halves, elt, max_shared,
                                blocks=min(pairs, experts), sm_count=sm_count), None
    m = pairs / experts
    mean = max(1, math.ceil(m))
    active = min(pairs, experts)
    gluon_ok = quant == "per_1x128" and GLUON_MOE and gluon and capability[0] == 9 and gated \
        and model_dim % SCALE_BLOCK == 0 and inter_dim % SCALE_BLOCK == 0
    pair_min_m = GLUON_MOE_MIN_M if inter_dim >= GLUON_MOE_STAGE1_MAX_K else GLUON_MOE_SHORT_K_MIN_M
    if gluon_ok and m >= pair_min_m and inter_dim >= GLUON_MOE_MIN_K:
        return (False, *_gluon_moe(mean, max_shared, atomics))
    bm = _moe_block_m(m, quant)
    fp8 = quant != "none"
    if bm == 16:
        bk = 128 if quant == "per_1x128" else 256
        # fp8 tiles twice as wide: as many bytes a tile (see FP8_PAIR_AT_DECODE)
        s1 = (64 if fp8 else 32, bk, 4)
        s2 = (128 if fp8 else 64, bk, 4)
    elif bm == 32:
        s1 = s2 = (64, 128, 4)
    elif bm == 64 and m <= 64:
        s1, s2 = (64, 128, 4), (128, 128, 4)
    elif bm == 64:
        bk = 128 if fp8 else 64
        # per_1x128 rescales every column per K step: wider tiles on 8 warps (tuned at m = 256)
        s1 = (256, 128, 8) if quant == "per_1x128" else (128, bk, 4)
        s2 = (256, bk, 8 if quant == "per_1x128" else 4)
    else:
        bk = 128 if fp8 else 64
        s1, s2 = (128, bk, 8), (256, bk, 8)
    tma = capability[0] >= 9 and m > 64  # weight tiles through TMA once blocks are full (tuned: from m = 128)
    common = dict(quant=quant, mean=mean, active=active, elt=elt, sm_count=sm_count, max_shared=max_shared)
    stage1 = _moe_stage(bm, *s1, n=inter_dim, k=model_dim, halves=halves, tma=tma, **common)
    stage2 = _moe_stage(bm, *s2, n=model_dim, k=inter_dim, halves=1, tma=tma, **common)
    sorted_ok = m >= 64 and capability[0] >= 9 and (inter_dim * elt) % 16 == 0
    max_k = {"per_token": PERSISTENT_MAX_K_PER_TOKEN, "per_1x128": PERSISTENT_MAX_K_PER_1X128}.get(quant,
                                                                                                  PERSISTENT_MAX_K)
    persistent_ok = inter_dim <= max_k and stage2.KSPLIT == 1 and not stage2.SWAP_AB
    if sorted_ok and (quant == "none" or (quant in PERSISTENT_QUANTS and persistent_ok)):
        # The intermediate in the sort's order, read by stage 2 through TMA (measured on the H100: 0.94-0.99x the
        # plain plan at 13 of 15 bf16 points from m = 64, up to 1.04x at 2). fp8 takes it only with the persistent
        # stage 2: alone it measured mixed, with it 0.94x the plain plan at E 128 top-8 I 384 (per_token 1024-8192
        # tokens; per_1x128 4096 and 8192, 1.01x at 1024).
        stage1, stage2 = replace(stage1, SORTED_INTER=2), replace(stage2, SORTED_INTER=2)
        if persistent_ok:
            stage2 = replace(stage2, PERSISTENT=1, USE_TMA=1)
    if gluon_ok and GLUON_MOE_STAGE1 and m >= GLUON_MOE_STAGE1_MIN_M and inter_dim < GLUON_MOE_STAGE1_MAX_K \
            and stage2.SORTED_INTER == 2 and stage1.KSPLIT == 1 and bm in (64, 128):
        stage1 = _gluon_stage1(stage1, max_shared)
    return False, stage1, stage2


def _gluon_moe(mean: int, max_shared: int, atomics: bool = True) -> tuple[MoeConfig, MoeConfig]:
    """The per_1x128 stage pair on the Gluon kernels, 128-row blocks on 8 warps: stage 1 on rows gathered for TMA
    with 64-wide gate and up tiles (`GLUON_MOE_WS`: fed by a loader warp group through as many of
    `GLUON_MOE_WS_STAGES` stages as fit `max_shared`), stage 2 with 128-wide tiles; grouped when an expert's `mean`
    pairs fill more than one block; `GLUON_MOE_TOPK_ATOMIC` (where `atomics`): stage 2 adds its rows into the
    tokens' rows (TOPK_ATOMIC 1 or 2, a plan option both stages carry)."""
    common = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_K=SCALE_BLOCK, GROUP_SIZE_M=8 if _cdiv(mean, 128) > 1 else 1,
                  num_warps=8, num_stages=4, USE_TMA=1,
                  SORTED_INTER=2, GATHER_A=int(GLUON_MOE_COPY_ROWS), GLUON=1,
                  TOPK_ATOMIC=int(GLUON_MOE_TOPK_ATOMIC) if atomics else 0)
    stage1 = MoeConfig(BLOCK_SIZE_N=64, PERSISTENT=int(GLUON_MOE_STAGE1_PERSISTENT), **common)
    # a loader warp group feeds the MMA warps, through a deeper ring (gathering the rows itself without the copy)
    if GLUON_MOE_WS if GLUON_MOE_COPY_ROWS else GLUON_MOE_STAGE1_WS:
        # A's, the gate's and the up's 128-deep blocks a stage; C's tile beside
        stage1 = replace(stage1, PERSISTENT=1, WARP_SPEC=1,
                         num_stages=_ws_stages((128 + 2 * 64) * SCALE_BLOCK, 128 * 64 * 2, max_shared))
    stage2 = MoeConfig(BLOCK_SIZE_N=128, PERSISTENT=int(GLUON_MOE_PERSISTENT), **common)
    if GLUON_MOE_WS2 and GLUON_MOE_PERSISTENT:  # A's and w2's blocks a stage; the rows' 16-byte rearrangement beside
        stage2 = replace(stage2, WARP_SPEC=1, num_stages=_ws_stages(  # no rearrangement for fp32 atomics
            (128 + 128) * SCALE_BLOCK, 0 if stage2.TOPK_ATOMIC == 1 else 128 * 128 * 2, max_shared))
    return _quant_out(stage1), stage2


def _ws_stages(per_stage: int, fixed: int, max_shared: int) -> int:
    """A warp-specialised Gluon stage's ring: `GLUON_MOE_WS_STAGES` stages of `per_stage` bytes beside `fixed` ones,
    fewer (not under 4) where they would not fit `max_shared` (barriers: 1 KB)."""
    stages = GLUON_MOE_WS_STAGES
    while stages > 4 and stages * per_stage + fixed + 1024 > max_shared:
        stages -= 1
    return stages


def _quant_out(stage1: MoeConfig) -> MoeConfig:
    """The Gluon stage 1 quantizing its own output where `GLUON_MOE_QUANT_OUT` says so (one tile a program only)."""
    return replace(stage1, QUANT_OUT=int(GLUON_MOE_QUANT_OUT and not stage1.PERSISTENT))


def _gluon_stage1(stage1: MoeConfig, max_shared: int) -> MoeConfig:
    """A Triton plan's stage 1 on the Gluon kernel on the same blocks, gathering its own rows: 64-wide gate and up
    tiles, 16 rows a warp, 4 stages (`GLUON_MOE_STAGE1_WS`: persistent, the gather in a loader warp group, as many of
    `GLUON_MOE_WS_STAGES` as fit)."""
    bm = stage1.BLOCK_SIZE_M
    gluon = replace(stage1, BLOCK_SIZE_N=64, BLOCK_SIZE_K=SCALE_BLOCK, num_warps=bm // 16, num_stages=4, USE_TMA=1,
                    GATHER_A=0, GLUON=1, PERSISTENT=int(GLUON_MOE_STAGE1_PERSISTENT))
    if GLUON_MOE_STAGE1_WS:
        gluon = replace(gluon, PERSISTENT=1, WARP_SPEC=1,
                        num_stages=_ws_stages((bm + 2 * 64) * SCALE_BLOCK, bm * 64 * 2, max_shared))
    return _quant_out(gluon)


def _one_stage(model_dim: int, inter_dim: int, quant: str, halves: int, elt: int, max_shared: int, blocks: int,
               sm_count: int) -> MoeConfig:
    # Its grid is (expert blocks) x (BLOCK_SIZE_N slices of I): at a handful of pairs, narrower slices until the grid
    # fills the SMs (decode reads weights; an idle SM is bandwidth lost). Tuned on the H100 at 1 token: E 128 top-8
    # I 384 won with 32 (8 x 12 programs; 128 gave 24 and ran 1.44x slower), E 64 top-6 I 1536 with 64 (6 x 24).
    bn = min(128, max(16, _p2(inter_dim)))
    while bn > 32 and blocks * _cdiv(inter_dim, bn) < sm_count:
        bn //= 2
    bk = min(128, max(16, _p2(model_dim)))
    bd = min(256, max(16, _p2(model_dim)))
    config = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, num_warps=4, num_stages=3,
                       KSPLIT=1, BLOCK_SIZE_D=bd, USE_TMA=0)

    def smem(stages: int) -> int:
        return max(stages * (16 + halves * bn) * bk * elt, 2 * (16 + bd) * bn * 2)

    stages = _fit_stages(3, smem, max_shared, _cdiv(model_dim, bk))
    while smem(stages) > max_shared and bd > 16:  # the second GEMM's double buffer alone is too big
        bd //= 2
    return replace(config, num_stages=stages, BLOCK_SIZE_D=bd)
