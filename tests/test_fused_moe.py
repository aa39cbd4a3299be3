"""Fused-MoE kernels against moe_reference: stage 1, stage 2, the 2-stage and 1-stage ops over activation × quant ×
doweight_stage1, the edges (gate-up off, split-K, TMA, top-1, idle experts, masked M/N/K), the plan-level levers
(SORTED_INTER, TOPK_ATOMIC) on the same edges, names, config checks, argument validation, and the Triton fp8
quantizer against the torch one.

Without a GPU these run in Triton's interpreter (tests/conftest.py): fp16 activations only (tl.dot on bf16 is wrong
there), fp8 weights for the quant types, tiny odd shapes and 16/32 blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import triton

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, check_config, quantize_weights
from tritune.kernels.fused_moe_1stage import fused_moe_1stage
from tritune.kernels.fused_moe_config import check_compiles_here, warp_spec_compiles
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.moe_reference import fused_moe_reference, stage1_reference, stage2_reference
from tritune.kernels.quant import FP8, quantize_blocks, quantize_fp8, quantize_rows
from tritune.knobs import interpreting
from tritune.ops.routing import sample_routing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SMALL = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
ONE = dataclasses.replace(SMALL, BLOCK_SIZE_D=32)  # 1-stage
ACTS = fm.ACTIVATIONS
QUANTS = fm.QUANT_TYPES


@dataclass(frozen=True)
class Dims:
    tokens: int = 5
    model_dim: int = 40  # not a multiple of BLOCK_SIZE_K=32 (EVEN_K False) nor of BLOCK_SIZE_D=32
    inter_dim: int = 24  # under BLOCK_SIZE_N=32: the only N tile is masked
    experts: int = 4
    topk: int = 2  # 10 pairs: not a multiple of BLOCK_SIZE_M=16
    gated: bool = True


BASE = Dims()


@dataclass(frozen=True)
class Moe:
    """Seeded operands of one MoE call, with the keyword arguments every op and reference shares."""

    dims: Dims
    quant: str
    hidden: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    weights: torch.Tensor
    ids: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return self.hidden, self.w1, self.w2, self.weights, self.ids

    def kw(self, activation: str, doweight: bool) -> dict:
        return {"activation": activation, "quant": self.quant, "w1_scale": self.w1_scale, "w2_scale": self.w2_scale,
                "doweight_stage1": doweight}


def make_moe(d: Dims = BASE, quant: str = "none", seed: int = 0) -> Moe:
    gen = torch.Generator().manual_seed(seed)
    n_w1 = d.inter_dim * (2 if d.gated else 1)
    hidden = torch.randn(d.tokens, d.model_dim, generator=gen)
    w1 = torch.randn(d.experts, n_w1, d.model_dim, generator=gen) / math.sqrt(d.model_dim)
    w2 = torch.randn(d.experts, d.model_dim, d.inter_dim, generator=gen) / math.sqrt(d.inter_dim)
    # Magnitudes that differ per expert and per 128-block (of hidden's columns and of w1's rows) make every scale
    # distinct, so reading another expert's weights or the wrong block's scale is off by a factor, not by rounding.
    e_mag = (1 + torch.arange(d.experts) % 3)[:, None, None].float()
    hidden = hidden * (1 + torch.arange(d.model_dim) // 128 % 3)[None, :]
    w1 = w1 * e_mag * (1 + torch.arange(n_w1) // 128 % 2)[None, :, None] / 2
    w2 = w2 * e_mag / 2
    if quant == "none":
        (w1, s1), (w2, s2) = (w1.half(), None), (w2.half(), None)
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    weights, ids = sample_routing(d.tokens, d.experts, d.topk, seed=seed)
    to = (lambda t: None if t is None else t.to(DEVICE))
    return Moe(d, quant, to(hidden.half()), to(w1), to(w2), to(s1), to(s2), to(weights), to(ids))


def assert_close(out: torch.Tensor, ref: torch.Tensor, quant: str) -> None:
    assert out.shape == ref.shape
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} elements NaN (unwritten?)"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < (2e-2 if quant != "none" else 1e-2), rel


def nan_like(rows: int, cols: int) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel does not write stays NaN and fails assert_close."""
    return torch.full((rows, cols), math.nan, device=DEVICE, dtype=torch.float16)


def run_stage1(x: Moe, cfg: MoeConfig, activation: str, doweight: bool) -> None:
    d = x.dims
    sorting = moe_align_block_size(x.ids, cfg.BLOCK_SIZE_M, d.experts)
    out = nan_like(d.tokens * d.topk, d.inter_dim)
    res = fm.moe_stage1(x.hidden, x.w1, x.weights, sorting, cfg, inter_dim=d.inter_dim, activation=activation,
                        quant=x.quant, w1_scale=x.w1_scale, doweight_stage1=doweight, out=out)
    assert res is out and out.dtype == torch.float16
    ref = stage1_reference(x.hidden, x.w1, x.weights, x.ids, inter_dim=d.inter_dim, activation=activation,
                           quant=x.quant, w1_scale=x.w1_scale, doweight_stage1=doweight)
    assert_close(out, ref, x.quant)


def run_stage2(x: Moe, cfg: MoeConfig, activation: str, doweight: bool) -> None:
    d = x.dims
    inter = stage1_reference(x.hidden, x.w1, x.weights, x.ids, inter_dim=d.inter_dim, activation=activation,
                             quant=x.quant, w1_scale=x.w1_scale, doweight_stage1=doweight).half()
    sorting = moe_align_block_size(x.ids, cfg.BLOCK_SIZE_M, d.experts)
    out = nan_like(d.tokens, d.model_dim)
    res = fm.moe_stage2(inter, x.w2, x.weights, sorting, cfg, quant=x.quant, w2_scale=x.w2_scale,
                        doweight_stage1=doweight, out=out)
    assert res is out
    ref = stage2_reference(inter, x.w2, x.weights, x.ids, quant=x.quant, w2_scale=x.w2_scale,
                           doweight_stage1=doweight)
    assert_close(out, ref, x.quant)


def run_2stage(x: Moe, cfg1: MoeConfig, cfg2: MoeConfig, activation: str, doweight: bool) -> None:
    out = fm.fused_moe_2stage(*x.args, cfg1, cfg2, **x.kw(activation, doweight))
    assert out.dtype == torch.float16
    assert_close(out, fused_moe_reference(*x.args, **x.kw(activation, doweight)), x.quant)


def run_1stage(x: Moe, cfg: MoeConfig, activation: str, doweight: bool) -> None:
    out = nan_like(x.dims.tokens, x.dims.model_dim)
    assert fused_moe_1stage(*x.args, cfg, out=out, **x.kw(activation, doweight)) is out
    # The 1-stage kernel keeps the intermediate in 16 bits on the fp8 paths.
    ref = fused_moe_reference(*x.args, **x.kw(activation, doweight), requantize_intermediate=False)
    assert_close(out, ref, x.quant)


# --- every activation × quant × doweight_stage1, on BASE (masked M, N and K everywhere) ---------------------------

KINDS = ("stage1", "stage2", "2stage", "1stage")


@pytest.mark.parametrize("doweight", [False, True], ids=["weight-after", "weight-stage1"])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_activation_quant_doweight(kind: str, activation: str, quant: str, doweight: bool) -> None:
    x = make_moe(BASE, quant, seed=len(quant) + doweight)
    if kind == "stage1":
        run_stage1(x, SMALL, activation, doweight)
    elif kind == "stage2":
        run_stage2(x, SMALL, activation, doweight)
    elif kind == "2stage":
        run_2stage(x, SMALL, SMALL, activation, doweight)
    else:
        run_1stage(x, ONE, activation, doweight)


# --- edges of the stage kernels ---------------------------------------------------------------------------------

CROSSING = Dims(tokens=5, model_dim=136, inter_dim=72, experts=4, topk=2)  # D, 2I cross a 128 scale block; I odd
TMA_FP8 = Dims(tokens=5, model_dim=48, inter_dim=32, experts=4, topk=2)  # fp8 rows of 48 / 32 bytes: TMA-able
KS2, KS3 = dataclasses.replace(SMALL, KSPLIT=2), dataclasses.replace(SMALL, KSPLIT=3)
TMA = dataclasses.replace(SMALL, USE_TMA=1)
SWAP = dataclasses.replace(SMALL, SWAP_AB=1)

# (dims, config, quant, activation, doweight_stage1)
STAGE_EDGES = [
    pytest.param(BASE, KS2, "none", "silu", False, id="ksplit2"),  # K=40: splits of 32 and 8 (masked)
    pytest.param(BASE, KS3, "none", "gelu", True, id="ksplit3-doweight"),  # third split starts past K=40 (stage 1)
    pytest.param(BASE, KS2, "per_token", "silu", False, id="ksplit2-per_token"),  # per-token scales on each partial
    pytest.param(CROSSING, KS3, "per_1x128", "silu", True,
                 id="ksplit3-per_1x128-crossing"),  # splits of 64: the last one is scale block 1 of K=136
    pytest.param(BASE, TMA, "none", "silu", False, id="tma"),  # fp16 K=40 / 24: 80- and 48-byte rows
    pytest.param(TMA_FP8, TMA, "per_token", "gelu", True, id="tma-fp8"),  # fp8 weights through the descriptor
    pytest.param(BASE, dataclasses.replace(TMA, KSPLIT=2), "none", "silu", False, id="tma-ksplit2"),
    pytest.param(dataclasses.replace(BASE, topk=1), SMALL, "none", "silu", False,
                 id="topk1"),  # stage 2 writes out directly, no top-k sum
    pytest.param(dataclasses.replace(BASE, topk=1), KS2, "none", "gelu", False,
                 id="topk1-ksplit2"),  # top-1 but split: the sum over splits still runs
    pytest.param(Dims(tokens=3, experts=16), SMALL, "none", "silu", False,
                 id="experts-with-zero-tokens"),  # 6 pairs over 16 experts: most experts get nothing
    pytest.param(Dims(tokens=21, experts=2), dataclasses.replace(SMALL, GROUP_SIZE_M=2), "none", "silu", False,
                 id="two-blocks-per-expert"),  # 42 pairs over 2 experts: full and partial blocks, grouped order
    pytest.param(Dims(model_dim=64, inter_dim=32), SMALL, "none", "silu", False,
                 id="even-k"),  # K a multiple of BLOCK_SIZE_K on both stages (EVEN_K), N a multiple of BLOCK_SIZE_N
    pytest.param(Dims(inter_dim=40), dataclasses.replace(SMALL, BLOCK_SIZE_K=16), "none", "silu", False,
                 id="i-not-multiple-of-bn"),  # I=40: one full and one masked N tile; BLOCK_SIZE_K 16
    pytest.param(dataclasses.replace(BASE, gated=False), SMALL, "none", "gelu", False,
                 id="gate-up-off"),  # w1 [E, I, D]: act(x·w1ᵀ) with no up half
    pytest.param(dataclasses.replace(BASE, gated=False), KS2, "per_token", "silu", True,
                 id="gate-up-off-ksplit2-per_token"),
    pytest.param(CROSSING, SMALL, "per_1x128", "gelu", False,
                 id="per_1x128-crossing"),  # K steps in scale blocks 0 and 1; up rows 72..143 span w1 blocks 0, 1
    pytest.param(CROSSING, SMALL, "per_token", "silu", False, id="per_token-crossing"),
    # SWAP_AB: w · aᵀ accumulated [BLOCK_N, BLOCK_M], transposed once (each quantization, masked K, TMA, split-K)
    pytest.param(BASE, SWAP, "none", "silu", True, id="swap-ab"),
    pytest.param(BASE, dataclasses.replace(SWAP, KSPLIT=2), "per_token", "gelu", False, id="swap-ab-ksplit2-per_token"),
    pytest.param(CROSSING, SWAP, "per_1x128", "silu", False, id="swap-ab-per_1x128-crossing"),
    pytest.param(TMA_FP8, dataclasses.replace(TMA, SWAP_AB=1), "per_token", "silu", False, id="swap-ab-tma-fp8"),
    pytest.param(dataclasses.replace(BASE, gated=False), SWAP, "none", "gelu", False, id="swap-ab-gate-up-off"),
]


@pytest.mark.parametrize(("dims", "cfg", "quant", "activation", "doweight"), STAGE_EDGES)
def test_stage1_edges(dims: Dims, cfg: MoeConfig, quant: str, activation: str, doweight: bool) -> None:
    run_stage1(make_moe(dims, quant, seed=3), cfg, activation, doweight)


@pytest.mark.parametrize(("dims", "cfg", "quant", "activation", "doweight"), STAGE_EDGES)
def test_stage2_edges(dims: Dims, cfg: MoeConfig, quant: str, activation: str, doweight: bool) -> None:
    run_stage2(make_moe(dims, quant, seed=4), cfg, activation, doweight)


def test_tma_rejects_rows_not_16_byte_multiples() -> None:
    x = make_moe(BASE, "per_token")  # fp8 K=40: 40-byte rows
    with pytest.raises(ValueError, match="USE_TMA needs rows of 16-byte multiples; K=40"):
        fm.fused_moe_2stage(*x.args, TMA, SMALL, **x.kw("silu", False))


# --- edges of the whole ops -------------------------------------------------------------------------------------

# (dims, quant, activation, doweight_stage1)
OP_EDGES = [
    pytest.param(dataclasses.replace(BASE, gated=False), "none", "silu", False, id="gate-up-off"),
    pytest.param(dataclasses.replace(BASE, gated=False), "per_1x128", "gelu", True, id="gate-up-off-per_1x128"),
    pytest.param(dataclasses.replace(BASE, topk=1), "none", "silu", True, id="topk1"),
    pytest.param(Dims(tokens=3, experts=16), "per_token", "silu", False, id="experts-with-zero-tokens"),
    pytest.param(Dims(tokens=21, experts=2), "none", "gelu", False, id="two-blocks-per-expert"),
    pytest.param(CROSSING, "per_1x128", "silu", False, id="per_1x128-crossing"),  # w2 scale blocks 0, 1 along D
]


@pytest.mark.parametrize(("dims", "quant", "activation", "doweight"), OP_EDGES)
def test_2stage_edges(dims: Dims, quant: str, activation: str, doweight: bool) -> None:
    run_2stage(make_moe(dims, quant, seed=5), SMALL, KS2, activation, doweight)  # stage 2 split, stage 1 not


@pytest.mark.parametrize("quant", ["none", "per_1x128"])
def test_2stage_with_swap_ab_in_both_stages(quant: str) -> None:
    run_2stage(make_moe(CROSSING, quant, seed=5), SWAP, dataclasses.replace(SWAP, KSPLIT=2), "silu", False)


@pytest.mark.parametrize("quant", ["none", "per_token"])
def test_warp_specialised_stage_2_over_tma_loads(quant: str) -> None:
    """WARP_SPEC: stage 2's K loop handed to Triton's warp specialisation (the interpreter runs it as a plain loop);
    A (the sorted intermediate) and w2 through TMA. TMA_FP8's rows are 16-byte multiples in fp8 too."""
    dims = TMA_FP8 if quant != "none" else BASE
    ws = levers(TMA, 2, 0, WARP_SPEC=1)
    assert ws.name("stage2").endswith("_SI2_WS1")
    if warp_spec_compiles(triton.__version__, interpreting()):
        run_2stage(make_moe(dims, quant, seed=9), levers(SMALL, 2, 0), ws, "silu", False)
    else:  # Triton 3.6 on a GPU: its warp-specialisation pass fails on this loop; the op refuses in one line
        with pytest.raises(ValueError, match="WARP_SPEC needs a Triton newer than 3.6"):
            run_2stage(make_moe(dims, quant, seed=9), levers(SMALL, 2, 0), ws, "silu", False)
    with pytest.raises(ValueError, match="WARP_SPEC .* is for stage 2 with every load through TMA"):
        fm.check_config(levers(SMALL, 2, 0, WARP_SPEC=1), "stage2", quant)  # w2 by pointers
    with pytest.raises(ValueError, match="WARP_SPEC"):
        fm.check_config(ws, "stage1", quant)  # stage 1 gathers A by pointers


def test_warp_spec_is_refused_where_triton_cannot_build_it() -> None:
    """Triton 3.6's Hopper warp-specialisation pass fails on stage 2's loop (H100, 2026-11-26): a GPU build there is
    refused in one line naming the version; the interpreter and newer releases pass; WARP_SPEC 0 always passes."""
    ws = levers(TMA, 2, 0, WARP_SPEC=1)
    assert not warp_spec_compiles("3.6.0", interpreter=False)
    assert warp_spec_compiles("3.6.0", interpreter=True)
    assert warp_spec_compiles("3.9.0", interpreter=False) and warp_spec_compiles("3.10.1", interpreter=False)
    with pytest.raises(ValueError, match=r"_WS1: WARP_SPEC needs a Triton newer than 3\.6 .* this is Triton 3\.6\.0"):
        check_compiles_here(ws, "stage2", "none", "3.6.0", interpreter=False)
    check_compiles_here(ws, "stage2", "none", "3.7.0", interpreter=False)
    check_compiles_here(levers(TMA, 2, 0), "stage2", "none", "3.6.0", interpreter=False)


@pytest.mark.parametrize(("dims", "quant", "more"), [
    (BASE, "none", {}),  # fp16 rows of D=40: 80 bytes
    (TMA_FP8, "per_token", {"KSPLIT": 2}),  # fp8 rows of 48 bytes and their scales gathered; stage 1 split
    (TMA_FP8, "per_1x128", {"SORTED_INTER": 2}),  # with the sorted intermediate: both GEMMs read A through TMA
    (Dims(tokens=21, experts=2, model_dim=64), "none", {"TOPK_ATOMIC": 1}),  # several blocks per expert
])
def test_gathered_a_equals_the_pointer_gather(dims: Dims, quant: str, more: dict) -> None:
    """GATHER_A: a launch copies stage 1's rows (and fp8 scales) into the sort's order, stage 1 reads them through
    TMA: the same values in the same order as the pointer gather, so the same bits."""
    x = make_moe(dims, quant, seed=11)
    kw = x.kw("silu", False)
    cfg = dataclasses.replace(SMALL, GATHER_A=1, **more)
    assert cfg.name("stage1").endswith("_GA1")
    out = fm.fused_moe_2stage(*x.args, cfg, dataclasses.replace(cfg, KSPLIT=1), **kw)
    plain = fm.fused_moe_2stage(*x.args, dataclasses.replace(cfg, GATHER_A=0),
                                dataclasses.replace(cfg, GATHER_A=0, KSPLIT=1), **kw)
    atomic = more.get("TOPK_ATOMIC") and dims.topk > 1
    torch.testing.assert_close(out, plain, rtol=1e-2 if atomic else 0, atol=1e-2 if atomic else 0)
    assert_close(out, fused_moe_reference(*x.args, **kw), quant)
    with pytest.raises(ValueError, match="GATHER_A .A through TMA. needs rows of 16-byte multiples; K=136"):
        c = make_moe(CROSSING, "per_token")  # fp8 rows of 136 bytes
        fm.fused_moe_2stage(*c.args, cfg, dataclasses.replace(cfg, KSPLIT=1), **c.kw("silu", False))


def test_swap_ab_names_and_refusals() -> None:
    assert SWAP.name("stage1").endswith("_TMA0_SW1") and "SW" not in SMALL.name("stage1")  # shown only when on
    assert MoeConfig.parse_name(SWAP.name("stage2", "per_token")) == ("stage2", SWAP)
    with pytest.raises(ValueError, match=r"the swapped 1-stage kernel \(SWAP_AB 1\) is for per_1x32"):
        fm.check_config(dataclasses.replace(ONE, SWAP_AB=1), "1stage", "none")
    with pytest.raises(ValueError, match="SWAP_AB is not for MXFP4 weights with fp8 activations"):  # not built
        fm.check_config(dataclasses.replace(SWAP, BLOCK_SIZE_K=32), "stage1", fm.MXFP4_A8)
    fm.check_config(dataclasses.replace(SWAP, BLOCK_SIZE_K=32), "stage1", fm.MXFP4)  # the packed-PTX swap


@pytest.mark.parametrize(("dims", "quant", "activation", "doweight"), OP_EDGES)
def test_1stage_edges(dims: Dims, quant: str, activation: str, doweight: bool) -> None:
    run_1stage(make_moe(dims, quant, seed=6), ONE, activation, doweight)


def test_1stage_block_n_16_and_wide_block_d() -> None:
    # BLOCK_SIZE_N 16 under I=24 (one full, one masked slice); BLOCK_SIZE_D 64 over D=40 (one masked block).
    cfg = dataclasses.replace(ONE, BLOCK_SIZE_N=16, BLOCK_SIZE_D=64)
    run_1stage(make_moe(BASE, "per_1x128", seed=7), cfg, "silu", False)


def test_default_outputs_have_hidden_dtype_and_shape() -> None:
    x = make_moe()
    for out in (fm.fused_moe_2stage(*x.args, SMALL, SMALL), fused_moe_1stage(*x.args, ONE)):
        assert out.shape == (BASE.tokens, BASE.model_dim) and out.dtype == torch.float16


# --- plan-level levers: a sorted intermediate (SORTED_INTER) and the top-k sum in stage 2's epilogue (TOPK_ATOMIC) --

def levers(cfg: MoeConfig, sorted_inter: int, topk_atomic: int = 1, **more) -> MoeConfig:
    return dataclasses.replace(cfg, SORTED_INTER=sorted_inter, TOPK_ATOMIC=topk_atomic, **more)


FP8_ROWS = Dims(tokens=5, model_dim=136, inter_dim=80, experts=4, topk=2)  # D crosses a 128 block; fp8 rows of I: 80 B

# (dims, stage-1 config, stage-2 config, quant, activation, doweight_stage1); BASE: 10 pairs (not a multiple of
# BLOCK_SIZE_M), I=24 under BLOCK_SIZE_N, K=40 not a multiple of BLOCK_SIZE_K
LEVER_CASES = [
    pytest.param(BASE, levers(SMALL, 1), levers(SMALL, 1), "none", "silu", False, id="sorted-atomic"),
    pytest.param(BASE, levers(SMALL, 2, 0), levers(SMALL, 2, 0), "none", "gelu", True,
                 id="sorted-tma-doweight"),  # A through TMA: fp16 rows of 48 bytes; pairs summed by the top-k kernel
    pytest.param(Dims(tokens=3, experts=16), levers(SMALL, 2), levers(SMALL, 2), "none", "silu", False,
                 id="experts-with-zero-tokens"),  # 6 pairs over 16 experts
    pytest.param(dataclasses.replace(BASE, topk=1), levers(SMALL, 2), levers(SMALL, 2), "none", "silu", False,
                 id="topk1"),  # stage 2 writes `out` itself: TOPK_ATOMIC has nothing to sum
    pytest.param(dataclasses.replace(BASE, topk=1), levers(SMALL, 1), levers(KS2, 1), "none", "gelu", False,
                 id="topk1-ksplit2"),  # top-1, but two K splits add into each row
    pytest.param(Dims(tokens=7, topk=3), levers(SMALL, 2), levers(SMALL, 2), "none", "gelu", False,
                 id="topk3"),  # 21 pairs, three slots per token add into one row
    pytest.param(BASE, levers(TMA, 2), levers(TMA, 2), "none", "silu", False,
                 id="weights-and-a-through-tma"),  # stage 2 with two descriptors: their order in the launch
    pytest.param(Dims(inter_dim=40), levers(SMALL, 1, 0), levers(SMALL, 1, 0), "none", "silu", False,
                 id="i-not-multiple-of-bn"),  # a full and a masked N tile of stage 1, K=40 of stage 2
    pytest.param(Dims(tokens=21, experts=2), levers(SMALL, 2, GROUP_SIZE_M=2), levers(SMALL, 2, GROUP_SIZE_M=2),
                 "none", "silu", False, id="two-blocks-per-expert"),  # 42 pairs: full and partial blocks
    pytest.param(BASE, levers(KS2, 2), levers(KS3, 2), "none", "silu", True,
                 id="ksplit-both"),  # stage 1's finish in the sort's order; stage 2's splits add atomically
    pytest.param(BASE, levers(KS2, 1, 0), levers(KS2, 1, 0), "none", "gelu", False,
                 id="ksplit-both-sorted-only"),  # stage 2's partials by pair, summed by the top-k kernel
    pytest.param(dataclasses.replace(BASE, gated=False), levers(SMALL, 1), levers(SMALL, 1), "per_token", "gelu",
                 True, id="gate-up-off-per_token"),
    pytest.param(FP8_ROWS, levers(KS2, 2), levers(SMALL, 2), "per_1x128", "silu", False,
                 id="per_1x128-separate-quant-tma"),  # split stage 1: the quantization launch over the sorted rows
    pytest.param(CROSSING, levers(SMALL, 1), levers(KS2, 1), "per_1x128", "gelu", True,
                 id="per_1x128-crossing-ksplit2"),  # scale blocks 0 and 1 of D and of I=72
]


@pytest.mark.parametrize(("dims", "cfg1", "cfg2", "quant", "activation", "doweight"), LEVER_CASES)
def test_2stage_levers(dims: Dims, cfg1: MoeConfig, cfg2: MoeConfig, quant: str, activation: str,
                       doweight: bool) -> None:
    x = make_moe(dims, quant, seed=8)
    kw = x.kw(activation, doweight)
    out = fm.fused_moe_2stage(*x.args, cfg1, cfg2, **kw)
    assert_close(out, fused_moe_reference(*x.args, **kw), quant)
    plain = fm.fused_moe_2stage(*x.args, levers(cfg1, 0, 0), levers(cfg2, 0, 0), **kw)
    if cfg2.TOPK_ATOMIC and not (dims.topk == 1 and cfg2.KSPLIT == 1):
        # fp32 sums of unrounded rows, in any order, against 16-bit rows summed in order: close, not equal
        torch.testing.assert_close(out, plain, rtol=1e-2, atol=1e-2)
    else:  # the same arithmetic with the rows placed elsewhere: the same bits
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_2stage_levers_with_the_intermediate_quantized_in_the_gemms(monkeypatch) -> None:
    """The fusion is off by default (FUSE_INTERMEDIATE_QUANT: measured slower) and kept working: amax by sorted row,
    the 16-bit A through TMA, quantized on load."""
    from tritune.kernels import fused_moe_launch

    monkeypatch.setattr(fused_moe_launch, "FUSE_INTERMEDIATE_QUANT", True)
    test_2stage_levers(BASE, levers(SMALL, 2), levers(SMALL, 2), "per_token", "silu", False)


def test_levers_refused_where_they_cannot_run() -> None:
    x = make_moe(Dims(inter_dim=20))  # fp16 rows of 40 bytes: no TMA
    with pytest.raises(ValueError, match=r"SORTED_INTER 2 \(A through TMA\) needs rows of 16-byte multiples; K=20"):
        fm.fused_moe_2stage(*x.args, levers(SMALL, 2), levers(SMALL, 2))
    q = make_moe(BASE, "per_token")  # behind a split stage 1, stage 2 reads fp8 rows of I=24 bytes
    with pytest.raises(ValueError, match="K=24 of torch.float8_e4m3fn is not"):
        fm.fused_moe_2stage(*q.args, levers(KS2, 2), levers(SMALL, 2), **q.kw("silu", False))
    sorting = moe_align_block_size(x.ids, 16, x.dims.experts)
    with pytest.raises(ValueError, match="SORTED_INTER, TOPK_ATOMIC, GATHER_A shape the whole 2-stage call"):
        fm.moe_stage1(x.hidden, x.w1, x.weights, sorting, levers(SMALL, 1), inter_dim=20)


# --- names and config checks -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kernel", "cfg", "quant", "activation", "name"), [
    ("stage1", dataclasses.replace(SMALL, KSPLIT=2, USE_TMA=1), "per_token", "gelu",
     "moe_stage1_per_token_gelu_BM16_BN32_BK32_GM1_W4_S2_KS2_TMA1"),
    ("stage2", MoeConfig(), "none", "silu", "moe_stage2_none_silu_BM64_BN64_BK64_GM8_W4_S3_KS1_TMA0"),
    ("1stage", dataclasses.replace(ONE, BLOCK_SIZE_D=128), "per_1x128", "silu",
     "moe_1stage_per_1x128_silu_BM16_BN32_BK32_GM1_W4_S2_KS1_BD128"),  # BD, and no TMA field
    ("stage2", dataclasses.replace(SMALL, SORTED_INTER=2, TOPK_ATOMIC=1), "none", "silu",
     "moe_stage2_none_silu_BM16_BN32_BK32_GM1_W4_S2_KS1_TMA0_SI2_TA1"),  # plan-level options: named only when on
    ("stage1", dataclasses.replace(SMALL, SORTED_INTER=1), "per_token", "gelu",
     "moe_stage1_per_token_gelu_BM16_BN32_BK32_GM1_W4_S2_KS1_TMA0_SI1"),
])
def test_name_round_trip(kernel: str, cfg: MoeConfig, quant: str, activation: str, name: str) -> None:
    from tritune.store.fmoe_rows import name_block_m

    assert cfg.name(kernel, quant, activation) == name
    assert MoeConfig.parse_name(name) == (kernel, cfg)
    assert name_block_m(name) == cfg.BLOCK_SIZE_M  # the CSV reader's check of block_m reads it too


def test_shipped_names_parse_back_and_pass_the_checks() -> None:
    """Every shipped tuned row's kernel names read back to the same name, each config passes `check_config`, and a
    stage pair agrees on the plan-level options (`check_plan`); none adds with atomics (the op's default is
    deterministic where the tuner's rows are)."""
    from pathlib import Path

    from tritune.store.fmoe_csv import read_tuned

    rows = [row for path in sorted((Path(fm.__file__).parent.parent / "configs").rglob("*fmoe*.csv"))
            for row in read_tuned(path)]
    assert rows
    for row in rows:
        quant, act = row.shape.q_type, row.shape.act_type
        names = [name for name in (row.kernelName1, row.kernelName2) if name.startswith("moe_")]
        parsed = [MoeConfig.parse_name(name) for name in names]
        assert parsed, row
        for (kind, cfg), name in zip(parsed, names, strict=True):
            assert cfg.name(kind, quant, act) == name
            fm.check_config(cfg, kind, quant)
            assert not cfg.TOPK_ATOMIC, name
        if len(parsed) == 2:
            fm.check_plan(parsed[0][1], parsed[1][1], quant)


def test_name_rejects_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="unknown fused-MoE kernel 'stage3'"):
        SMALL.name("stage3")


@pytest.mark.parametrize("garbage", [
    "",
    "moe_stage3_none_silu_BM16",  # no such kernel
    "moe_stage1_fp4_silu_BM16",  # no such quant type
    "moe_stage1_none_relu_BM16",  # no such activation
    "moe_stage1_none_silu_",  # no fields
    "moe_stage1_none_silu_BM16_",  # trailing separator
    "moe_stage1_none_silu_BM16BN32",  # fields run together
    "moe_stage1_none_silu_bm16",  # lower case
    "moe_stage1_none_silu_BM-16",  # negative
    " moe_stage1_none_silu_BM16",  # leading space
    "gemm_bf16_BM16",  # another op's kernel
])
def test_parse_name_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError, match="not a tritune fused-MoE kernel name"):
        MoeConfig.parse_name(garbage)


def test_parse_name_rejects_unknown_field() -> None:
    with pytest.raises(ValueError, match="unknown field 'XX'"):
        MoeConfig.parse_name("moe_stage1_none_silu_BM16_XX3")


def test_from_params_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="BLOCK_SIZE_Q"):
        MoeConfig.from_params({"BLOCK_SIZE_Q": 16})


@pytest.mark.parametrize(("cfg", "kernel", "quant"), [
    (dataclasses.replace(SMALL, BLOCK_SIZE_K=64), "stage1", "per_1x128"),  # 64 divides 128
    (dataclasses.replace(SMALL, BLOCK_SIZE_K=256), "stage1", "per_token"),  # 256 is fine without 1×128 scales
    (dataclasses.replace(SMALL, KSPLIT=4, USE_TMA=1), "stage2", "none"),
    (dataclasses.replace(ONE, BLOCK_SIZE_N=128), "1stage", "per_1x128"),
    (dataclasses.replace(SMALL, KSPLIT=2, SORTED_INTER=2, TOPK_ATOMIC=1), "stage2", "per_1x128"),  # with split-K
])
def test_check_config_accepts(cfg: MoeConfig, kernel: str, quant: str) -> None:
    check_config(cfg, kernel, quant)


@pytest.mark.parametrize(("cfg", "kernel", "quant", "message"), [
    (dataclasses.replace(SMALL, BLOCK_SIZE_K=256), "stage1", "per_1x128", "per_1x128 needs BLOCK_SIZE_K dividing 128"),
    (dataclasses.replace(ONE, KSPLIT=2), "1stage", "none", "1-stage needs BLOCK_SIZE_D a power of two >= 16, KSPLIT 1"),
    (SMALL, "1stage", "none", "1-stage needs BLOCK_SIZE_D"),  # BLOCK_SIZE_D left at 0
    (dataclasses.replace(ONE, BLOCK_SIZE_D=48), "1stage", "none", "1-stage needs BLOCK_SIZE_D"),
    (dataclasses.replace(ONE, USE_TMA=1), "1stage", "none", "1-stage reads through TMA only in its swapped"),
    (dataclasses.replace(ONE, BLOCK_SIZE_N=256), "1stage", "per_1x128", "needs BLOCK_SIZE_N dividing 128"),
    (dataclasses.replace(SMALL, BLOCK_SIZE_N=24), "stage1", "none", "BLOCK_SIZE_N=24 must be a power of two"),
    (dataclasses.replace(SMALL, BLOCK_SIZE_M=12), "stage2", "none", "BLOCK_SIZE_M=12 must be a power of two >= 16"),
    (dataclasses.replace(SMALL, BLOCK_SIZE_M=8), "stage2", "per_token", "BLOCK_SIZE_M under 16"),
    (dataclasses.replace(SMALL, KSPLIT=0), "stage2", "none", "must be >= 1"),
    (dataclasses.replace(SMALL, SORTED_INTER=3), "stage2", "none", "SORTED_INTER and TOPK_ATOMIC must be 0, 1 or 2"),
    (dataclasses.replace(SMALL, TOPK_ATOMIC=3), "stage1", "none", "TOPK_ATOMIC must be 0, 1 or 2"),
    (dataclasses.replace(SMALL, TOPK_ATOMIC=2), "stage2", "none", "TOPK_ATOMIC 2 .* is the Gluon stage 2's"),
    (dataclasses.replace(SMALL, SWAP_AB=2), "stage1", "none", "SWAP_AB and GATHER_A 0 or 1"),
    (dataclasses.replace(ONE, SORTED_INTER=1), "1stage", "none", "1-stage has no sorted-intermediate, top-k-atomic"),
    (dataclasses.replace(ONE, TOPK_ATOMIC=1), "1stage", "none", "1-stage has no sorted-intermediate, top-k-atomic"),
    (dataclasses.replace(ONE, GATHER_A=1), "1stage", "none", "or gathered-A variant"),
])
def test_check_config_rejects(cfg: MoeConfig, kernel: str, quant: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        check_config(cfg, kernel, quant)
    assert "\n" not in str(err.value)


# --- argument validation (host-only: raised before any launch) ---------------------------------------------------

def _bad_call(x: Moe, **changes) -> dict:
    call = {"hidden": x.hidden, "w1": x.w1, "w2": x.w2, "topk_weights": x.weights, "topk_ids": x.ids,
            "stage1": SMALL, "stage2": SMALL, **x.kw("silu", False)}
    call.update(changes)
    return call


def _validation_cases() -> list:
    x, q = make_moe(), make_moe(quant="per_token")
    e, i, d = BASE.experts, BASE.inter_dim, BASE.model_dim
    return [
        pytest.param(_bad_call(x, w1=torch.zeros(e, 2 * i + 1, d, dtype=torch.float16)),
                     "w1 has 49 rows per expert", id="w1-rows"),
        pytest.param(_bad_call(x, topk_weights=x.weights.half()), "topk_weights must be fp32", id="weights-fp16"),
        pytest.param(_bad_call(q, w1_scale=None), r"per_token wants w1_scale fp32 contiguous \(4, 48\), got None",
                     id="missing-w1-scale"),
        pytest.param(_bad_call(q, w2_scale=q.w2_scale[:, :8].contiguous()), r"wants w2_scale .* got \(4, 8\)",
                     id="w2-scale-shape"),
        pytest.param(_bad_call(x, stage2=dataclasses.replace(SMALL, BLOCK_SIZE_M=32)),
                     "must share BLOCK_SIZE_M, got 16 and 32", id="block-m-mismatch"),
        pytest.param(_bad_call(x, stage2=dataclasses.replace(SMALL, SORTED_INTER=1)),
                     "must share SORTED_INTER .*, got 0 and 1", id="sorted-inter-mismatch"),
        pytest.param(_bad_call(x, stage1=dataclasses.replace(SMALL, TOPK_ATOMIC=1)),
                     "must share TOPK_ATOMIC .*, got 1 and 0", id="topk-atomic-mismatch"),
        pytest.param(_bad_call(x, activation="relu"), "activation 'relu'", id="activation"),
        pytest.param(_bad_call(x, quant="fp4"), "quant 'fp4'", id="quant"),
        pytest.param(_bad_call(x, hidden=x.hidden.float()), "hidden_states must be 2-D bf16/fp16", id="hidden-fp32"),
        pytest.param(_bad_call(x, quant="per_token"), "quant 'per_token' wants w1/w2 of torch.float8_e4m3fn",
                     id="fp16-weights-for-fp8"),
        pytest.param(_bad_call(x, hidden=torch.zeros(d, BASE.tokens, dtype=torch.float16).T),
                     "hidden_states must be contiguous", id="hidden-transposed"),
        pytest.param(_bad_call(x, topk_ids=x.ids[:, :1]), "topk_ids .* and topk_weights .* must both be",
                     id="ids-shape"),
        pytest.param(_bad_call(x, w2=x.w2[:, :, :-1].contiguous()), "w1 has 48 rows per expert; expected",
                     id="w2-inter-dim"),  # I taken from w2 (23): w1's 48 rows fit neither 23 nor 46
        pytest.param(_bad_call(x, stage1=dataclasses.replace(SMALL, BLOCK_SIZE_N=24)), "must be a power of two",
                     id="config"),
    ]


@pytest.mark.parametrize(("call", "message"), _validation_cases())
def test_2stage_validation_errors(call: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fm.fused_moe_2stage(**call)


def test_1stage_validates_like_2stage() -> None:
    q = make_moe(quant="per_1x128")
    with pytest.raises(ValueError, match="per_1x128 wants w2_scale"):
        fused_moe_1stage(*q.args, ONE, **(q.kw("silu", False) | {"w2_scale": None}))
    with pytest.raises(ValueError, match="1-stage reads through TMA only in its swapped MXFP4 variant"):
        fused_moe_1stage(*q.args, dataclasses.replace(ONE, USE_TMA=1), **q.kw("silu", False))


def test_quantize_weights_rejects_none() -> None:
    with pytest.raises(ValueError, match="not a quantized type; expected per_token, per_1x128 or per_1x32"):
        quantize_weights(torch.zeros(2, 4, 4), "none")


# --- the Triton fp8 quantizer against the torch one ----------------------------------------------------------------

def _fp8_input(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    # C=300: two full 128-groups and a partial one; rows of very different magnitudes.
    x = torch.randn(7, 300, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 5e3, 1.0])[:, None]
    x[3] = 0.0  # all-zero row: scale clamps, q all zero
    x[4, 128:256] = 0.0  # all-zero group inside a row
    x[6, 5] = 1e3  # one outlier: most of the row quantizes into fp8's subnormal range
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [0, 128], ids=["per-row", "1x128"])
def test_quantize_fp8_matches_torch(group: int, dtype: torch.dtype) -> None:
    x = _fp8_input(dtype)
    q, s = quantize_fp8(x, group)
    q_ref, s_ref = quantize_rows(x) if group == 0 else quantize_blocks(x, 1, group)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # The interpreter's own fp8 cast handles only normal numbers exactly (see quant._round_to_e4m3): elements that
    # land below 2**-6, fp8's subnormal range, may round differently; nothing else may differ.
    scaled = x.float() / (s_ref[:, None] if group == 0 else s_ref.repeat_interleave(group, dim=1)[:, : x.shape[1]])
    differ = q.float() != q_ref.float()
    assert (scaled[differ].abs() < 2**-6).all(), scaled[differ]
    assert (q.float() - q_ref.float()).abs().max() <= 2**-6
    assert (q[3].float() == 0).all()


def test_quantize_fp8_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="group 96 is not a power of two"):
        quantize_fp8(torch.zeros(2, 200), 96)
    with pytest.raises(ValueError, match="row-major 2-D"):
        quantize_fp8(torch.zeros(200, 2).T)
    q, s = quantize_fp8(torch.zeros(0, 200), 128)  # no rows: no launch, empty results
    assert q.shape == (0, 200) and s.shape == (0, 2)
