"""The fused MoE's per_1x128 stages on the Gluon kernels (kernels/gluon_moe.py), through the op on a Hopper GPU:
against the fp32 reference on odd shapes (experts with no tokens, one expert taking every token, token counts no
block divides, D and I crossing 128-wide scale blocks), bit-equal as a CUDA-graph replay, the rule table's own
choice, the Triton plan where the Gluon one cannot run, and stage 1 quantizing its own output bit-equal to the
op's quantization launch. Gluon has no interpreter: on anything but a Hopper GPU with Triton's Gluon API these skip
with that reason (the CPU suite compiles the kernels: tests/test_gluon_moe.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fused_moe import Dims, make_moe

from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.ops.fused_moe import MoeChoice, fused_moe
from tritune.tuning.bench import capture_graph

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not (HOPPER and HAS_GLUON_HOPPER),
                                reason="the Gluon kernels run only on a Hopper GPU with Triton's Gluon API")

_PLAN = dict(BLOCK_SIZE_K=128, GROUP_SIZE_M=8, USE_TMA=1, SORTED_INTER=2, GATHER_A=1)
S1_128 = MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, GLUON=1, **_PLAN)
S2_128 = MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, GLUON=1, **_PLAN)
S1_64 = MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, GLUON=1, **_PLAN)
S2_64 = MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=5, GLUON=1, **_PLAN)
S2_PERSISTENT = dataclasses.replace(S2_128, GLUON=0, PERSISTENT=1)  # the rule's stage 2 where I < 1024


def _own_rows(*stages: MoeConfig) -> tuple[MoeConfig, ...]:
    """The stages with stage 1 copying its rows itself (cp.async; no GATHER_A copy)."""
    return tuple(dataclasses.replace(c, GATHER_A=0) for c in stages)


def _moe(tokens: int, d: int, inter: int, experts: int, topk: int, seed: int = 0, ids: torch.Tensor | None = None):
    """test_fused_moe's seeded per_1x128 operands (every scale distinct), hidden in bf16, `ids` routing if given."""
    x = make_moe(Dims(tokens=tokens, model_dim=d, inter_dim=inter, experts=experts, topk=topk), "per_1x128", seed)
    ops = {"hidden": x.hidden.bfloat16(), "w1": x.w1, "w2": x.w2, "w1_scale": x.w1_scale, "w2_scale": x.w2_scale,
           "weights": x.weights, "ids": x.ids.to(torch.int32)}
    if ids is not None:
        ops["ids"] = ids.to(device="cuda", dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed)
        ops["weights"] = torch.softmax(torch.randn(ids.shape, generator=gen), dim=1).cuda()
    return ops


def _run(x: dict, choice: MoeChoice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    return fused_moe(x["hidden"], x["w1"], x["w2"], x["weights"], x["ids"], quant="per_1x128",
                     w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice, out=out)


def _check(got: torch.Tensor, x: dict) -> None:
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["weights"], x["ids"], quant="per_1x128",
                              w1_scale=x["w1_scale"], w2_scale=x["w2_scale"])
    assert not got.isnan().any()
    rel = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 2e-2, rel  # the reference requantizes the intermediate as the op does; fp8 accumulation order


@pytest.mark.parametrize(("s1", "s2"), [(S1_128, S2_128), (S1_64, S2_64), (S1_128, S2_PERSISTENT),
                                        (S1_128, dataclasses.replace(S2_128, PERSISTENT=1)),
                                        _own_rows(S1_128, dataclasses.replace(S2_128, PERSISTENT=1)),
                                        _own_rows(S1_64, S2_64),
                                        (dataclasses.replace(S1_128, PERSISTENT=1),
                                         dataclasses.replace(S2_128, PERSISTENT=1)),
                                        _own_rows(dataclasses.replace(S1_64, PERSISTENT=1),
                                                  dataclasses.replace(S2_PERSISTENT, BLOCK_SIZE_M=64, num_warps=4)),
                                        (dataclasses.replace(S1_128, PERSISTENT=1, WARP_SPEC=1, num_stages=6),
                                         dataclasses.replace(S2_128, PERSISTENT=1)),
                                        (dataclasses.replace(S1_128, PERSISTENT=1, WARP_SPEC=1, num_stages=6),
                                         dataclasses.replace(S2_128, PERSISTENT=1, WARP_SPEC=1)),
                                        _own_rows(dataclasses.replace(S1_64, PERSISTENT=1, WARP_SPEC=1, num_stages=6),
                                                  dataclasses.replace(S2_PERSISTENT, BLOCK_SIZE_M=64, num_warps=4))],
                         ids=["128-rows", "64-rows", "triton-stage-2-persistent", "gluon-stage-2-persistent",
                              "128-rows-own-gather", "64-rows-own-gather", "both-persistent",
                              "64-rows-own-gather-persistent-then-triton", "stage-1-warp-specialised",
                              "both-warp-specialised", "64-rows-own-gather-warp-specialised-then-triton"])
@pytest.mark.parametrize(("tokens", "d", "inter", "experts", "topk"), [
    (300, 384, 256, 8, 2),  # every expert busy; 600 pairs: no block divides them
    (77, 640, 384, 16, 3),  # D and I cross 128-wide scale blocks 5 and 3 times; some experts get no tokens
    (1, 256, 128, 4, 1),  # one token, top-1: stage 2 writes the output itself
])
def test_matches_the_reference(s1, s2, tokens, d, inter, experts, topk) -> None:
    x = _moe(tokens, d, inter, experts, topk)
    _check(_run(x, MoeChoice(False, s1, s2, "test")), x)


def test_the_warp_specialised_kernels_give_the_persistent_ones_bits() -> None:
    """Each warp-specialised stage runs the persistent kernel's arithmetic in its order (the loads only move to a
    loader warp group): the op's output bit for bit, stage by stage, on an uneven routing (expert 2 takes every
    token's first slot, experts 0 and 1 none)."""
    second = torch.randint(3, 8, (700, 1), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([torch.full((700, 1), 2), second], dim=1)
    x = _moe(700, 384, 384, 8, 2, seed=4, ids=ids)
    s1, s2 = dataclasses.replace(S1_128, PERSISTENT=1), dataclasses.replace(S2_128, PERSISTENT=1)
    plain = _run(x, MoeChoice(False, s1, s2, "test"))
    _check(plain, x)
    for ws1, ws2 in ((1, 0), (1, 1)):
        pair = (dataclasses.replace(s1, WARP_SPEC=ws1, num_stages=6), dataclasses.replace(s2, WARP_SPEC=ws2))
        assert torch.equal(_run(x, MoeChoice(False, *pair, "test")), plain), (ws1, ws2)


@pytest.mark.parametrize("mode", [1, 2], ids=["fp32-accumulator", "bf16-accumulator"])
@pytest.mark.parametrize("warp_spec", [0, 1], ids=["persistent", "warp-specialised"])
@pytest.mark.parametrize(("tokens", "d", "inter", "experts", "topk"), [
    (300, 384, 256, 8, 2),  # 600 pairs over every expert
    (77, 640, 384, 16, 3),  # D and I crossing scale blocks; idle experts
    (33, 256, 128, 4, 1),  # top-1: stage 2 writes the output itself, no accumulator
])
def test_stage_2_adding_into_the_tokens_rows_matches_the_row_writing_pair(mode, warp_spec, tokens, d, inter,
                                                                          experts, topk) -> None:
    """TOPK_ATOMIC on the Gluon stage 2: each row added into its token's row of the accumulator (fp32, then cast; or
    bf16, each add rounded), in the GPU's order. Against the reference, and close to the pair that writes [pairs, D]
    rows for the top-k sum (that sum adds the bf16-rounded rows in slot order): within fp32 rounding for mode 1,
    within topk bf16 roundings for mode 2."""
    x = _moe(tokens, d, inter, experts, topk, seed=6)
    s1 = dataclasses.replace(S1_128, PERSISTENT=1, WARP_SPEC=1, num_stages=6)
    s2 = dataclasses.replace(S2_128, PERSISTENT=1, WARP_SPEC=warp_spec, num_stages=6 if warp_spec else 4)
    rows = _run(x, MoeChoice(False, s1, s2, "test"))
    atomic = _run(x, MoeChoice(False, dataclasses.replace(s1, TOPK_ATOMIC=mode),
                               dataclasses.replace(s2, TOPK_ATOMIC=mode), "test"))
    _check(atomic, x)
    assert float((atomic.float() - rows.float()).norm() / rows.float().norm()) < (4e-3 if mode == 1 else 1e-2)


@pytest.mark.parametrize("own_gather", [False, True], ids=["gather-copy", "own-gather"])
def test_one_expert_taking_every_token_and_empty_experts(own_gather: bool) -> None:
    ids = torch.full((513, 1), 3)  # 513 rows for expert 3: five 128-row blocks, the last one row; seven idle experts
    x = _moe(513, 256, 256, 8, 1, seed=1, ids=ids)
    pair = _own_rows(S1_128, S2_128) if own_gather else (S1_128, S2_128)
    if own_gather:  # and stage 1 persistent: one program walks the five blocks' tiles
        pair = (dataclasses.replace(pair[0], PERSISTENT=1), pair[1])
    _check(_run(x, MoeChoice(False, *pair, "test")), x)


@pytest.mark.parametrize("own_gather", [False, True], ids=["gluon-pair", "gluon-stage-1-then-triton"])
@pytest.mark.parametrize(("tokens", "d", "inter", "experts", "topk"), [
    (300, 384, 256, 8, 2),  # two scale groups a row
    (77, 640, 384, 16, 3),  # three; some experts get no tokens
])
def test_stage_1_quantizing_its_output_matches_the_quantization_launch(own_gather, tokens, d, inter, experts,
                                                                      topk) -> None:
    """QUANT_OUT: stage 1 writes the fp8 intermediate and its 1x128 scales itself (two 64-wide tiles a program, no
    quantization launch): the op's output bit-equal to the same plan with the launch, and the reference's."""
    x = _moe(tokens, d, inter, experts, topk, seed=7)
    if own_gather:  # the rule's plan below I 1024: stage 1 gathering its own rows, the persistent Triton stage 2
        s1, s2 = _own_rows(S1_64, dataclasses.replace(S2_PERSISTENT, BLOCK_SIZE_M=64, num_warps=4))
    else:
        s1, s2 = S1_128, dataclasses.replace(S2_128, PERSISTENT=1)
    plain = _run(x, MoeChoice(False, s1, s2, "test"))
    fused = _run(x, MoeChoice(False, dataclasses.replace(s1, QUANT_OUT=1), s2, "test"))
    assert torch.equal(fused, plain)
    _check(fused, x)


def test_the_rule_takes_it_and_a_graph_replays_it_bit_equal() -> None:
    from tritune.ops.fused_moe import heuristic_moe_choice

    x = _moe(2048, 512, 1024, 8, 2, seed=2)  # m = 512 pairs an expert
    choice = heuristic_moe_choice(2048, 512, 1024, 8, 2, "per_1x128")
    assert choice.stage1.GLUON and choice.stage2.GLUON
    assert choice.stage1.WARP_SPEC and choice.stage2.WARP_SPEC  # both fed by loader warp groups (the rule's pair)
    out = torch.empty(2048, 512, device="cuda", dtype=torch.bfloat16)
    _run(x, out=out)
    _check(out, x)
    eager = out.clone()
    graph, _ = capture_graph(lambda: _run(x, out=out))
    out.zero_()  # the capture's warm-up wrote it: only the replay may write it again
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_a_gluon_plan_falls_back_where_it_cannot_run() -> None:
    """GELU (the Gluon stage 1 is SiLU only): the op takes the rule table's Triton plan rather than refusing."""
    x = _moe(600, 256, 256, 4, 2, seed=3)
    got = fused_moe(x["hidden"], x["w1"], x["w2"], x["weights"], x["ids"], quant="per_1x128", activation="gelu",
                    w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=MoeChoice(False, S1_128, S2_128, "test"))
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], x["weights"], x["ids"], quant="per_1x128",
                              activation="gelu", w1_scale=x["w1_scale"], w2_scale=x["w2_scale"])
    assert float((got.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize(("bm", "warps"), [(128, 8), (64, 4)])
def test_the_stage_1_kernels_agree(bm: int, warps: int) -> None:
    """`moe_stage1_kernel` on the gathered copy through TMA and the same kernel copying each pair's token row itself
    (GATHER, cp.async), one tile a program and persistent, and the warp-specialised persistent kernel (its loads,
    the gather too, from a loader warp group): the same silu(gate) · up, bit for bit."""
    import triton

    from tritune.kernels.gluon_blockscale import descriptor
    from tritune.kernels.gluon_gemm_ws import ws_maxnreg
    from tritune.kernels.gluon_moe import moe_stage1_kernel, moe_stage1_persistent_kernel, moe_stage1_ws_kernel
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.kernels.quant import quantize_blocks

    x = _moe(700, 384, 320, 8, 2, seed=5)  # I 320: a 64-wide tile at 256, the up rows' scale block 2 then 4
    inter, d, experts, topk = 320, 384, 8, 2
    sort = moe_align_block_size(x["ids"], bm, experts)
    gen = torch.Generator(device="cuda").manual_seed(6)
    t8, t_s = quantize_blocks(torch.randn(700, d, device="cuda", generator=gen), 1)  # the tokens' rows
    sid = sort.sorted_token_ids.long()
    real = sid < 700 * topk
    tok = torch.where(real, sid // topk, 0)
    a8 = torch.where(real[:, None], t8[tok].view(torch.uint8), 0).view(t8.dtype)  # as the GATHER_A copy writes
    a_s = torch.where(real[:, None], t_s[tok], 0.0)
    rows, blocks = a8.shape[0], a8.shape[0] // bm
    outs = []
    for kernel, gather in ((moe_stage1_kernel, False), (moe_stage1_kernel, True),
                           (moe_stage1_persistent_kernel, False), (moe_stage1_persistent_kernel, True),
                           (moe_stage1_ws_kernel, False), (moe_stage1_ws_kernel, True)):
        out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
        a, s = (t8, t_s) if gather else (a8, a_s)
        head = [descriptor(a, [bm, 128]), descriptor(x["w1"].reshape(experts * 2 * inter, d), [64, 128]),
                descriptor(out, [bm, 64]), s, x["w1_scale"], sort.expert_ids, sort.num_tokens_post_padded]
        values = [inter, d, blocks, s.stride(0), s.stride(1), *x["w1_scale"].stride()]
        # A's token rows and the sorted pairs (read with GATHER), their count, A's row stride
        args = head + [t8, sort.sorted_token_ids] + values + [700 * topk, t8.stride(0)]
        grid = blocks * triton.cdiv(inter, 64)
        extra = {"maxnreg": ws_maxnreg(warps)} if kernel is moe_stage1_ws_kernel else {}
        if kernel is not moe_stage1_kernel:  # fewer programs than tiles: each walks several
            grid = min(grid, 7)
            args.append(grid)
        kernel[(grid,)](*args, GROUP_M=8, STAGES=3, WARPS=warps, num_warps=warps, GATHER=gather, TOPK=topk, **extra)
        outs.append(out)
    copied, *others = (o.float()[real] for o in outs)
    assert not copied.isnan().any()
    for other in others:
        assert torch.equal(other, copied)
