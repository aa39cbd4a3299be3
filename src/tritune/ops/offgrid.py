"""Choices between tuned sizes: for an M (GEMM) or token count (fused MoE) with no tuned entry, every config
measured at the neighbouring tuned sizes is scaled by the cost model to the asked size, and the least estimated
time wins (plus the host cost of its launches). Exact hits return the tuned entry unchanged. Pure Python.

Rules, shared by both choosers:

- neighbours: the largest tuned size below the asked one and the smallest above; past either end of the tuned
  range, the two nearest tuned sizes on the side that exists (`scope="all"`: every tuned size);
- a candidate is a distinct config (GEMM) or plan (MoE: 1-stage config, or stage-1 + stage-2 configs) of those
  sizes; one measured at several tuned sizes is scaled from the size nearest the asked one (in log2 distance);
- its cost = measured µs × model(asked) / model(measured at) + the host cost of its launches at the asked size
  (`cost_model.Estimate.host_us`: 5 µs per launch, 6 µs more for TMA descriptors), so split-K's second launch
  must buy more than it costs; ties go to fewer launches, then to the candidate from the nearer size;
- optionally (`heuristic=`), an unmeasured config — the rule table's — competes too: its model estimate at the
  asked size × the geometric mean of the measured/model ratios of the candidates × HEURISTIC_MARGIN (1.10: tuned
  winners sit on the fast side of the model, so an unmeasured config must look clearly better to be trusted);
  it lets a far-away tuned size lose to the rule table instead of serving a size it suits badly;
- fused MoE: a 1-stage plan is a candidate only up to ONE_STAGE_MAX_PAIRS routed pairs (tokens · topk), the
  tuner's own limit;
- fused MoE: where every tuned token count is more than MOE_FAR_TOKENS times the asked one, or less than 1 /
  MOE_FAR_TOKENS of it, the rule table's plan (`heuristic=`) is taken without a comparison: a plan tuned for
  another regime of pairs per expert is scaled by a model that misses what its tiles cost there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tritune.ops import cost_model as cm

__all__ = ["HEURISTIC_MARGIN", "MOE_FAR_TOKENS", "MoeRow", "choose_gemm_offgrid", "choose_moe_offgrid", "gemm_entries",
           "moe_row_of", "neighbours"]

HEURISTIC_MARGIN = 1.10  # an unmeasured config's scaled estimate is inflated by this before it competes
# Mixtral-8x7B's shipped fp8 rows are tuned at 1024 tokens only. At 2 / 4 / 8 tokens the chooser scaled them to
# 320-342 / 428 / 669 µs (per_token; BM 128 tiles for 4-16 pairs) and took them over the rule table's plan, which
# ran 225 / 282 / 511 µs (per_1x128: 262 / 306 / 550 against 230 / 283 / 519). The model missed about 27% of what
# 128-row tiles cost at one pair an expert, and the calibration on the 1024-token row (x 1.15) and the margin inflated
# the rule's estimate (H100, RESULTS.md twenty-fourth session). Within 16x it measured mixed (0.94-1.07 at 64-128
# tokens; the tuned plan 1.28-1.33x faster at 256).
MOE_FAR_TOKENS = 16


def neighbours(sizes: Sequence[int], asked: int, scope: str = "neighbours") -> list[int]:
    """The tuned sizes whose candidates are scaled to `asked` (see the module docstring), nearest first."""
    if scope not in ("neighbours", "all"):
        raise ValueError(f"scope {scope!r}; expected 'neighbours' or 'all'")
    ordered = sorted(set(sizes))
    if not ordered:
        raise ValueError("no tuned sizes to choose from")
    if scope == "all":
        chosen = ordered
    else:
        below = [s for s in ordered if s < asked]
        above = [s for s in ordered if s > asked]
        chosen = below[-1:] + above[:1] if below and above else (below[-2:] if below else above[:2])
    return sorted(chosen, key=lambda s: (_log_distance(s, asked), -s))


def _log_distance(a: int, b: int) -> float:
    return abs(math.log2(a) - math.log2(b))


def _describe(lo_hi: list[int], asked: int, what: str) -> str:
    below = [s for s in lo_hi if s < asked]
    above = [s for s in lo_hi if s > asked]
    if below and above:
        return f"{what}={asked} between tuned {max(below)} and {min(above)}"
    if below:
        return f"{what}={asked} above tuned {', '.join(map(str, sorted(below)))}"
    return f"{what}={asked} below tuned {', '.join(map(str, sorted(above)))}"


@dataclass(frozen=True)
class _Candidate:
    key: Any  # hashable identity of the config or plan
    value: Any  # what the chooser returns
    measured_at: int
    measured_us: float
    scaled_us: float
    host_us: float
    launches: int
    heuristic: bool = False  # not measured: model estimate × the measured candidates' measured/model ratio

    @property
    def cost(self) -> float:
        return self.scaled_us + self.host_us


def _pick(cands: list[_Candidate], asked: int) -> tuple[_Candidate, list[_Candidate]]:
    ranked = sorted(cands, key=lambda c: (c.cost, c.launches, _log_distance(c.measured_at, asked)))
    return ranked[0], ranked


def _explain(head: str, what: str, best: _Candidate, ranked: list[_Candidate]) -> str:
    def one(c: _Candidate) -> str:
        extra = f" + {c.host_us:.0f} µs host ({c.launches} launch{'es' if c.launches > 1 else ''})"
        if c.heuristic:
            return (f"heuristic config modelled {c.scaled_us:.1f} µs (calibrated on the tuned candidates, "
                    f"+{100 * (HEURISTIC_MARGIN - 1):.0f}% margin){extra}")
        return f"config of {what}={c.measured_at} scaled {c.measured_us:.1f} → {c.scaled_us:.1f} µs{extra}"

    rest = "; vs " + "; ".join(one(c) for c in ranked[1:4]) if len(ranked) > 1 else ""
    return f"off-grid: {head}; chose {one(best)}{rest}"


def _heuristic_candidate(value: Any, key: Any, asked_est: cm.Estimate, measured: list[_Candidate],
                         own_est: Mapping[Any, float]) -> _Candidate:
    """An unmeasured candidate, scored by the model calibrated on the measured ones (module docstring)."""
    bias = math.exp(sum(math.log(c.measured_us / own_est[c.key]) for c in measured) / len(measured))
    return _Candidate(key, value, measured[0].measured_at, math.nan, asked_est.gpu_us * bias * HEURISTIC_MARGIN,
                      asked_est.host_us, asked_est.launches, heuristic=True)


# ---------------------------------------------------------------------------------------------------------- GEMM


def gemm_entries(by_M: Mapping[int, Any]) -> dict[int, tuple[Any, float]]:
    """A shape file's per-M entries (store.gemm_json.GemmEntry: stored Config, time_us) as the chooser's input
    {M: (GemmConfig, time_us)}; entries without a finite time are left out."""
    from tritune.kernels.gemm import GemmConfig  # torch; only when converting stored entries

    out = {}
    for M, entry in by_M.items():
        if math.isfinite(entry.time_us) and entry.time_us > 0:
            out[int(M)] = (GemmConfig.from_params(entry.config.as_dict()), float(entry.time_us))
    return out


def _gemm_key(config: Any) -> Any:
    if hasattr(config, "as_dict"):
        return tuple(sorted(config.as_dict().items()))
    if isinstance(config, Mapping):
        return tuple(sorted(config.items()))
    return config


def choose_gemm_offgrid(kernel: str, M: int, N: int, K: int, entries: Mapping[int, tuple[Any, float]],
                        sm_count: int = 132, *, scope: str = "neighbours", heuristic: Any = None,
                        hw: cm.Hardware | None = None) -> tuple[Any, str]:
    """The config for C[M, N] = A[M, K]·B[N, K]ᵀ of `kernel` ("bf16", "a8w8", "a8w8_blockscale") and why.

    `entries`: the shape file's tuned winners {M: (config, time_us)} (GemmConfig, or anything with the same
    fields by attribute or key; see `gemm_entries`). `heuristic`: an unmeasured config that may compete (e.g.
    `heuristics.gemm_heuristic(...)`). Returns the winning config object unchanged, and a source string: "tuned
    M=64" for an exact hit, else "off-grid: M=48 between tuned 32 and 64; chose config of M=64 scaled 22.1 →
    21.3 µs + 5 µs host (1 launch); vs config of M=32 ...". ValueError when `entries` is empty or M < 1.
    """
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    if not entries:
        raise ValueError("no tuned entries to choose from")
    if M in entries:
        return entries[M][0], f"tuned M={M}"
    hw = hw or cm.hardware(sm_count)
    sizes = neighbours(list(entries), M, scope)
    to_shape = cm.GemmShape(kernel, M, N, K)
    by_config: dict[Any, tuple[Any, int, float]] = {}
    for size in sizes:  # nearest first: a config seen at several sizes is scaled from the nearest
        config, us = entries[size]
        by_config.setdefault(_gemm_key(config), (config, size, us))
    cands, own = [], {}
    for key, (config, size, us) in by_config.items():
        at = cm.estimate_gemm(config, to_shape, hw)
        own[key] = cm.estimate_gemm(config, to_shape.with_M(size), hw).gpu_us
        cands.append(_Candidate(key, config, size, us, us * at.gpu_us / own[key], at.host_us, at.launches))
    if heuristic is not None and _gemm_key(heuristic) not in by_config:
        cands.append(_heuristic_candidate(heuristic, _gemm_key(heuristic), cm.estimate_gemm(heuristic, to_shape, hw),
                                          list(cands), own))
    best, ranked = _pick(cands, M)
    return best.value, _explain(_describe(sizes, M, "M"), "M", best, ranked)


# ---------------------------------------------------------------------------------------------------- fused MoE


@dataclass(frozen=True)
class MoeRow:
    """A tuned fused-MoE row of one shape at one token count: its plan and measured op time (`us`)."""

    tokens: int
    run_1stage: bool
    stage1: Any  # MoeConfig (the 1-stage kernel's when run_1stage)
    stage2: Any  # MoeConfig, None when run_1stage
    us: float


def moe_row_of(tuned: Any) -> MoeRow:
    """The MoeRow of a store.fmoe_csv.FmoeTuned (kernel names parsed); ValueError when a name does not parse."""
    from tritune.kernels.fused_moe import MoeConfig  # torch; only when converting stored rows

    _, stage1 = MoeConfig.parse_name(tuned.kernelName1)
    stage2 = None if tuned.run_1stage else MoeConfig.parse_name(tuned.kernelName2)[1]
    return MoeRow(tuned.shape.token, bool(tuned.run_1stage), stage1, stage2, float(tuned.us))


def _as_row(row: MoeRow | Sequence) -> MoeRow:
    return row if isinstance(row, MoeRow) else MoeRow(*row)


def choose_moe_offgrid(tokens: int, model_dim: int, inter_dim: int, experts: int, topk: int, quant: str,
                       rows: Sequence[MoeRow | tuple], sm_count: int = 132, *, gated: bool = True,
                       act_elt: int = 2, scope: str = "neighbours", heuristic: tuple | None = None,
                       hw: cm.Hardware | None = None) -> tuple[bool, Any, Any, str]:
    """(run_1stage, stage1-or-1stage config, stage2 config or None, source) for `tokens` tokens of a fused MoE.

    `rows`: the tuned rows of this shape (any token counts), as MoeRow or (tokens, run_1stage, stage1, stage2, us)
    tuples (see `moe_row_of`). An exact token hit returns that row's plan with source "tuned tokens=N"; otherwise
    the candidates of the neighbouring rows are scaled (module docstring). `heuristic`: an unmeasured
    (run_1stage, stage1, stage2) that may compete (e.g. `heuristics.moe_heuristic(...)`). `gated`: w1 holds gate
    and up rows; `act_elt`: bytes of the activations (2 for bf16/fp16). ValueError when no row is usable.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    by_tokens: dict[int, MoeRow] = {}
    for row in map(_as_row, rows):
        if math.isfinite(row.us) and row.us > 0 and row.tokens not in by_tokens:
            by_tokens[row.tokens] = row
    if not by_tokens:
        raise ValueError("no tuned rows to choose from")
    if tokens in by_tokens:
        r = by_tokens[tokens]
        return r.run_1stage, r.stage1, r.stage2, f"tuned tokens={tokens}"
    if heuristic is not None and all(max(t / tokens, tokens / t) > MOE_FAR_TOKENS for t in by_tokens):
        return (*tuple(heuristic), f"off-grid: {_describe(sorted(by_tokens), tokens, 'tokens')}, all more than "
                f"{MOE_FAR_TOKENS}x away; chose the heuristic config")
    hw = hw or cm.hardware(sm_count)
    one_stage_ok = tokens * topk <= cm.ONE_STAGE_MAX_PAIRS
    usable = {t: r for t, r in by_tokens.items() if one_stage_ok or not r.run_1stage}
    if not usable:
        raise ValueError(f"every tuned row runs the 1-stage kernel, which stops at {cm.ONE_STAGE_MAX_PAIRS} routed "
                         f"pairs ({tokens} tokens x topk {topk})")
    sizes = neighbours(list(usable), tokens, scope)
    shape = cm.MoeShape(tokens, model_dim, inter_dim, experts, topk, quant, gated, act_elt)
    plans: dict[Any, tuple[cm.MoePlan, int, float]] = {}
    for size in sizes:  # nearest first, as for the GEMM
        r = usable[size]
        plans.setdefault((r.run_1stage, r.stage1, r.stage2), (cm.MoePlan(r.run_1stage, r.stage1, r.stage2), size, r.us))
    cands, own = [], {}
    for key, (plan, size, us) in plans.items():
        at = cm.estimate_moe(plan, shape, hw)
        own[key] = cm.estimate_moe(plan, shape.with_tokens(size), hw).gpu_us
        cands.append(_Candidate(key, plan, size, us, us * at.gpu_us / own[key], at.host_us, at.launches))
    if heuristic is not None and tuple(heuristic) not in plans and (one_stage_ok or not heuristic[0]):
        plan = cm.MoePlan(*heuristic)
        cands.append(_heuristic_candidate(plan, tuple(heuristic), cm.estimate_moe(plan, shape, hw), list(cands),
                                          own))
    best, ranked = _pick(cands, tokens)
    plan = best.value
    return plan.run_1stage, plan.stage1, plan.stage2, _explain(_describe(sizes, tokens, "tokens"), "tokens", best,
                                                                ranked)
