"""The persistent stage 2 (MoeConfig.PERSISTENT, kernels/fused_moe_persistent.py): the same tiles as the
one-tile-a-program kernel in another schedule, so the same bits; more tiles than programs (4 under the interpreter);
the options it does not run refused in one line. fp16 under the interpreter (its bf16 tl.dot is wrong)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fused_moe import BASE, TMA_FP8, Dims, assert_close, make_moe

from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.moe_reference import fused_moe_reference

# Stage 2 through TMA on the sorted intermediate, one tile a program; PS1 is the same with persistent programs.
PLAIN = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
                  USE_TMA=1, SORTED_INTER=2)
PS = dataclasses.replace(PLAIN, PERSISTENT=1)
FIRST = dataclasses.replace(PLAIN, USE_TMA=0)  # stage 1 (writes the sorted intermediate)


@pytest.mark.parametrize(("dims", "quant", "doweight", "group"), [
    pytest.param(BASE, "none", False, 1, id="masked-n"),  # D 40: two N tiles, the second masked
    pytest.param(Dims(tokens=21, experts=2, model_dim=96), "none", True, 2, id="two-blocks-per-expert-grouped"),
    pytest.param(Dims(tokens=3, experts=16), "none", False, 1, id="experts-with-zero-tokens"),
    pytest.param(dataclasses.replace(BASE, topk=1), "none", False, 1, id="topk1-writes-out"),
    pytest.param(Dims(tokens=9, topk=8, experts=8, model_dim=48, inter_dim=32), "none", False, 1, id="top8"),
    pytest.param(TMA_FP8, "per_token", False, 1, id="per_token"),  # fp8 rows of 32 bytes; scales by sorted row
    pytest.param(Dims(tokens=17, experts=4, model_dim=48, inter_dim=32), "per_token", True, 4, id="per_token-many"),
    pytest.param(TMA_FP8, "per_1x128", False, 1, id="per_1x128"),
    # K 160 crosses a 128 scale group (K steps of 32 in groups 0 and 1); D 144 crosses a 128-row w2 scale block
    pytest.param(Dims(tokens=7, experts=4, model_dim=144, inter_dim=160), "per_1x128", True, 2,
                 id="per_1x128-crossing"),
])
def test_persistent_stage_2_equals_one_tile_a_program(dims: Dims, quant: str, doweight: bool, group: int) -> None:
    x = make_moe(dims, quant, seed=21)
    kw = x.kw("silu", doweight)
    plain, ps = (dataclasses.replace(c, GROUP_SIZE_M=group) for c in (PLAIN, PS))
    first = dataclasses.replace(FIRST, GROUP_SIZE_M=group)
    want = fm.fused_moe_2stage(*x.args, first, plain, **kw)
    got = fm.fused_moe_2stage(*x.args, first, ps, **kw)
    tiles = -(-dims.model_dim // PS.BLOCK_SIZE_N) * -(-dims.tokens * dims.topk // PS.BLOCK_SIZE_M)
    assert tiles > 4 or dims.tokens <= 5  # most cases give the interpreter's 4 programs several tiles each
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same tiles, each summed in the same K order
    assert_close(got, fused_moe_reference(*x.args, **kw), quant)


@pytest.mark.parametrize(("dims", "quant", "group"), [
    pytest.param(Dims(tokens=9, topk=8, experts=8, model_dim=48, inter_dim=32), "none", 1, id="top8"),
    pytest.param(Dims(tokens=21, experts=2, model_dim=96), "none", 4096, id="n-tile-major"),  # one group: N-major
    pytest.param(Dims(tokens=17, experts=4, model_dim=48, inter_dim=32), "per_token", 4096, id="per_token"),
])
def test_persistent_stage_2_sums_the_top_k_slots_with_atomics(dims: Dims, quant: str, group: int) -> None:
    """TOPK_ATOMIC: every slot's weighted row added into the fp32 [T, D] accumulator (the order varies: close, not
    bit-equal); GROUP_SIZE_M past the block count walks the tiles N tile by N tile."""
    x = make_moe(dims, quant, seed=23)
    kw = x.kw("silu", False)
    first = dataclasses.replace(FIRST, TOPK_ATOMIC=1, GROUP_SIZE_M=group)
    ps = dataclasses.replace(PS, TOPK_ATOMIC=1, GROUP_SIZE_M=group)
    assert ps.name("stage2").endswith("_SI2_TA1_PS1")
    got = fm.fused_moe_2stage(*x.args, first, ps, **kw)
    want = fm.fused_moe_2stage(*x.args, first, dataclasses.replace(ps, PERSISTENT=0), **kw)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    assert_close(got, fused_moe_reference(*x.args, **kw), quant)


def test_the_name_shows_ps1_and_parses_back() -> None:
    assert PS.name("stage2").endswith("_TMA1_SI2_PS1") and "PS" not in PLAIN.name("stage2")
    assert MoeConfig.parse_name(PS.name("stage2", "per_token")) == ("stage2", PS)


@pytest.mark.parametrize(("kernel", "cfg", "quant"), [
    ("stage1", PS, "none"),
    ("stage2", dataclasses.replace(PS, USE_TMA=0), "none"),
    ("stage2", dataclasses.replace(PS, SORTED_INTER=1), "none"),
    ("stage2", dataclasses.replace(PS, KSPLIT=2), "none"),
    ("stage2", dataclasses.replace(PS, SWAP_AB=1), "none"),
    ("stage2", dataclasses.replace(PS, PERSISTENT=2), "none"),
])
def test_what_it_does_not_run_is_refused_in_one_line(kernel: str, cfg: MoeConfig, quant: str) -> None:
    with pytest.raises(ValueError, match=r"PERSISTENT \(0 or 1\) is for stage 2 .* with every load through TMA") as e:
        fm.check_config(cfg, kernel, quant)
    assert "\n" not in str(e.value)


def test_mxfp4_weights_are_refused() -> None:
    """The persistent stage 2 is not built for MXFP4 weights (their TMA path is the swapped GEMM's alone)."""
    with pytest.raises(ValueError, match="MXFP4"):
        fm.check_config(dataclasses.replace(PS, num_stages=2), "stage2", fm.MXFP4)
    with pytest.raises(ValueError, match="PERSISTENT"):
        fm.check_config(dataclasses.replace(PS, USE_TMA=0), "stage2", fm.MXFP4)


def test_a_plan_with_it_is_refused_before_any_launch() -> None:
    x = make_moe(BASE, "none", seed=1)
    with pytest.raises(ValueError, match="PERSISTENT"):
        fm.fused_moe_2stage(*x.args, FIRST, dataclasses.replace(PS, KSPLIT=2), **x.kw("silu", False))
