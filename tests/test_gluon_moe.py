"""The fused MoE's Gluon per_1x128 stages without a GPU: what a GLUON config must hold (one-line refusals naming the
field), its kernel name (GL1 only when on, parsed back), the op's fallback to the Triton plan where Gluon cannot
run, the tuner's Gluon pairs, and the kernels compiled for sm_90 as the tuner's compile pool builds them
(`fused_moe_compile.compile_only`; stage 1 on the copied rows and gathering its own, one tile a program and
persistent), their MMAs kept in flight (`wgmma.wait_group` 2 for stage 1's gate and up pair, 1 for stage 2's one MMA
a K block), not serialized by ptxas (C7514 / C7512) and not spilling. The kernels run on a Hopper GPU in
tests/test_gluon_moe_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from sm90_ptx import assert_asynchronous, compile_report

from tritune.kernels.fused_moe import MoeConfig, check_config
from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

_PLAN = dict(BLOCK_SIZE_K=128, GROUP_SIZE_M=8, USE_TMA=1, SORTED_INTER=2, GATHER_A=1)
S1 = MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, GLUON=1, **_PLAN)
S2 = MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, GLUON=1, **_PLAN)


def test_a_gluon_pair_passes_the_checks_and_names_itself() -> None:
    check_config(S1, "stage1", "per_1x128")
    check_config(S2, "stage2", "per_1x128")
    check_config(dataclasses.replace(S2, PERSISTENT=1), "stage2", "per_1x128")  # the persistent Gluon stage 2
    check_config(dataclasses.replace(S1, PERSISTENT=1), "stage1", "per_1x128")  # and stage 1
    check_config(dataclasses.replace(S1, QUANT_OUT=1), "stage1", "per_1x128")  # stage 1 writing fp8 itself
    ws = dataclasses.replace(S1, PERSISTENT=1, WARP_SPEC=1, num_stages=6)  # and fed by a loader warp group
    check_config(ws, "stage1", "per_1x128")
    check_config(dataclasses.replace(S2, PERSISTENT=1, WARP_SPEC=1), "stage2", "per_1x128")  # stage 2 too
    check_config(dataclasses.replace(ws, GATHER_A=0), "stage1", "per_1x128")  # the loader gathering the rows
    # stage 2 adding each row into its token's row of the accumulator (a plan option: stage 1 carries it too)
    for mode in (1, 2):  # fp32 or 16-bit accumulator
        check_config(dataclasses.replace(S2, PERSISTENT=1, WARP_SPEC=1, TOPK_ATOMIC=mode), "stage2", "per_1x128")
        check_config(dataclasses.replace(ws, TOPK_ATOMIC=mode), "stage1", "per_1x128")
    name = ws.name("stage1", "per_1x128")
    assert name.endswith("_S6_KS1_TMA1_SI2_WS1_GA1_PS1_GL1") and MoeConfig.parse_name(name) == ("stage1", ws)
    name = dataclasses.replace(S1, QUANT_OUT=1).name("stage1", "per_1x128")
    assert name.endswith("_GL1_QO1") and MoeConfig.parse_name(name)[1].QUANT_OUT == 1
    name = S1.name("stage1", "per_1x128")
    assert name.endswith("_SI2_GA1_GL1") and MoeConfig.parse_name(name) == ("stage1", S1)
    assert "GL" not in dataclasses.replace(S1, GLUON=0).name("stage1", "per_1x128")  # old names read back unchanged


@pytest.mark.parametrize(("kernel", "quant", "changes", "message"), [
    ("stage1", "per_token", {}, "GLUON is for the per_1x128 stage kernels, not stage1 with per_token"),
    ("1stage", "per_1x128", {"BLOCK_SIZE_D": 128}, "GLUON is for the per_1x128 stage kernels"),
    ("stage1", "per_1x128", {"BLOCK_SIZE_K": 64}, "GLUON takes BLOCK_SIZE_K 128"),
    ("stage2", "per_1x128", {"BLOCK_SIZE_N": 256}, "BLOCK_SIZE_N 64 or 128"),
    ("stage2", "per_1x128", {"num_warps": 4}, "BLOCK_SIZE_M 16 x num_warps"),  # 128 rows on 4 warps
    ("stage2", "per_1x128", {"SORTED_INTER": 1}, "GLUON reads the weights and the intermediate through TMA"),
    ("stage2", "per_1x128", {"USE_TMA": 0}, "GLUON reads the weights and the intermediate through TMA"),
    ("stage2", "per_1x128", {"KSPLIT": 2}, "GLUON is its own kernel"),
    ("stage2", "per_1x128", {"GLUON": 2}, "GLUON must be 0 or 1"),  # 2 was a one-MMA stage 1, removed
    ("stage2", "per_1x128", {"GLUON": 0, "TOPK_ATOMIC": 2}, "TOPK_ATOMIC 2 .* is the Gluon stage 2's"),
    ("stage2", "per_1x128", {"TOPK_ATOMIC": 3}, "TOPK_ATOMIC must be 0, 1 or 2"),
    ("stage2", "per_1x128", {"QUANT_OUT": 1}, "QUANT_OUT .* is the Gluon stage 1's"),
    ("stage1", "per_1x128", {"QUANT_OUT": 1, "BLOCK_SIZE_N": 128}, "QUANT_OUT .* BLOCK_SIZE_N 64"),
    ("stage1", "per_1x128", {"QUANT_OUT": 1, "PERSISTENT": 1}, "QUANT_OUT .* one tile a program"),
    ("stage1", "per_1x128", {"QUANT_OUT": 1, "GLUON": 0}, r"QUANT_OUT .*\(GLUON 1"),
    ("stage1", "per_1x128", {"QUANT_OUT": 2}, "QUANT_OUT \\(0 or 1\\)"),
    ("stage1", "per_1x128", {"WARP_SPEC": 1}, "WARP_SPEC .* is persistent"),  # one tile a program
    ("stage2", "per_1x128", {"WARP_SPEC": 1}, "WARP_SPEC .* is persistent"),  # one tile a program
])
def test_what_a_gluon_config_must_hold(kernel: str, quant: str, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_config(dataclasses.replace(S2 if kernel == "stage2" else S1, **changes), kernel, quant)


@pytest.mark.parametrize("quant_out", [0, 1], ids=["bf16-intermediate", "stage-1-quantizes"])
def test_the_op_runs_the_triton_plan_where_gluon_cannot(monkeypatch, quant_out: int) -> None:
    """A choice naming GLUON (a file tuned on Hopper, or the rule's there) on the interpreter or another GPU: the op
    binds the rule table's plan without Gluon and gives the reference's result."""
    from tritune.kernels import fused_moe_launch
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops.fused_moe import MoeChoice, fused_moe

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and HAS_GLUON_HOPPER:
        pytest.skip("on a Hopper GPU with Gluon the Gluon plan itself runs (tests/test_gluon_moe_gpu.py)")
    bound = []
    real = fused_moe_launch.MoeLaunch
    op_module = importlib.import_module("tritune.ops.fused_moe")  # the package re-exports the function by that name
    monkeypatch.setattr(op_module, "MoeLaunch",
                        lambda *a, **kw: bound.append((kw["stage1"], kw["stage2"])) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden = torch.randn(9, 256, generator=gen).to(device, torch.float16)
    (q1, s1), (q2, s2) = (quantize_weights(torch.randn(4, 2 * 128, 256, generator=gen) / 16, "per_1x128"),
                          quantize_weights(torch.randn(4, 256, 128, generator=gen) / 11, "per_1x128"))
    ids = torch.tensor([[i % 4, (i + 1) % 4] for i in range(9)], dtype=torch.int32)
    weights = torch.softmax(torch.randn(9, 2, generator=gen), dim=1)
    ops = [t.to(device) for t in (q1, q2, weights, ids, s1, s2)]
    got = fused_moe(hidden, ops[0], ops[1], ops[2], ops[3], quant="per_1x128", w1_scale=ops[4], w2_scale=ops[5],
                    choice=MoeChoice(False, dataclasses.replace(S1, QUANT_OUT=quant_out), S2, "test"))
    assert len(bound) == 1 and not bound[0][0].GLUON and not bound[0][1].GLUON and not bound[0][0].QUANT_OUT
    ref = fused_moe_reference(hidden, ops[0], ops[1], ops[2], ops[3], quant="per_1x128", w1_scale=ops[4],
                              w2_scale=ops[5])
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


_CHILD = r"""
import dataclasses
import re

import torch

from tritune.kernels.fused_moe import MoeConfig
from tritune.kernels.fused_moe_compile import MoeDims, compile_only

plan = dict(BLOCK_SIZE_K=128, GROUP_SIZE_M=8, USE_TMA=1, SORTED_INTER=2, GATHER_A=1, GLUON=1)
dims = MoeDims(tokens=4096, topk=6, experts=64, model_dim=2048, inter_dim=1408, quant="per_1x128")
for kernel, cfg in (("stage1", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, **plan)),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, **plan)),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, **plan)),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1,
                                         **plan)),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4,
                                         **{**plan, "GATHER_A": 0})),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4,
                                         **{**plan, "GATHER_A": 0})),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, PERSISTENT=1,
                                         **plan)),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, PERSISTENT=1,
                                         **{**plan, "GATHER_A": 0})),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, QUANT_OUT=1,
                                         **plan)),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=4, QUANT_OUT=1,
                                         **{**plan, "GATHER_A": 0})),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=6, PERSISTENT=1,
                                         WARP_SPEC=1, **plan)),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, PERSISTENT=1,
                                         WARP_SPEC=1, **plan)),
                    ("stage1", MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, num_warps=4, num_stages=6, PERSISTENT=1,
                                         WARP_SPEC=1, **{**plan, "GATHER_A": 0})),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=4, TOPK_ATOMIC=1,
                                         **plan)),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=6, PERSISTENT=1,
                                         WARP_SPEC=1, TOPK_ATOMIC=1, **plan)),
                    ("stage2", MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, num_warps=8, num_stages=6, PERSISTENT=1,
                                         WARP_SPEC=1, TOPK_ATOMIC=2, **plan))):
    name = f"{kernel} {cfg.BLOCK_SIZE_M}x{cfg.BLOCK_SIZE_N} GL{cfg.GLUON}" + (" PS1" if cfg.PERSISTENT else "")
    name += " WS1" if cfg.WARP_SPEC else ""
    name += ("" if cfg.GATHER_A or kernel == "stage2" else " gather") + (" QO1" if cfg.QUANT_OUT else "")
    name += f" TA{cfg.TOPK_ATOMIC}" if cfg.TOPK_ATOMIC else ""
    ptx = compile_only(kernel, dims, cfg).asm["ptx"]
    report[name] = ptxas_report(ptx, atomics=re.findall(r"(?:atom|red)\.global\.[\w.]*add[\w.]*", ptx),
                                stores=re.findall(r"st\.global\.[\w.]+", ptx))
# fp16 activations: the quantizing stage 1 rounds to fp16 first, as the intermediate would hold it
report["stage1 128x64 GL1 QO1 fp16"] = ptxas_report(compile_only(
    "stage1", dataclasses.replace(dims, dtype=torch.float16),
    MoeConfig(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, num_warps=8, num_stages=4, QUANT_OUT=1, **plan)).asm["ptx"])
"""


@pytest.mark.skipif(not HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API (Triton >= 3.5)")
def test_both_stages_compile_for_sm90_with_their_mmas_in_flight() -> None:
    report = compile_report(_CHILD)
    assert set(report) == {"stage1 128x64 GL1", "stage1 64x64 GL1", "stage2 128x128 GL1", "stage2 128x128 GL1 PS1",
                           "stage1 128x64 GL1 gather", "stage1 64x64 GL1 gather", "stage1 128x64 GL1 PS1",
                           "stage1 64x64 GL1 PS1 gather", "stage1 128x64 GL1 QO1", "stage1 64x64 GL1 gather QO1",
                           "stage1 128x64 GL1 QO1 fp16", "stage1 128x64 GL1 PS1 WS1", "stage2 128x128 GL1 PS1 WS1",
                           "stage1 64x64 GL1 PS1 WS1 gather", "stage2 128x128 GL1 TA1",
                           "stage2 128x128 GL1 PS1 WS1 TA1", "stage2 128x128 GL1 PS1 WS1 TA2"}
    for name, r in report.items():
        # stage 2: rows out by 16-byte stores, or added into the accumulator: fp32 two at a time (TA1), bf16 eight
        # (TA2), as atom (Triton 3.6) or red (3.9, the result unused) .global.gpu.relaxed.add...
        if name.startswith("stage2"):
            if name.endswith(("TA1", "TA2")):
                want = ".add.v2.f32" if name.endswith("TA1") else ".add.noftz.v8.bf16"
                assert r["atomics"] and all(a.endswith(want) for a in r["atomics"]), (name, r)
                assert not r["stores"], (name, r)
            else:
                assert set(r["stores"]) == {"st.global.v4.b32"} and not r["atomics"], (name, r)
        two_groups = name.startswith("stage1")  # gate and up, one MMA each a K block
        assert sorted(set(r["waits"])) == (["0", "2"] if two_groups else ["0", "1"]), (name, r["waits"])
        assert_asynchronous(name, r)


def test_the_tuner_re_times_the_gluon_pairs_on_per_1x128_rows_on_hopper(monkeypatch) -> None:
    """The end-to-end candidates of a per_1x128 row on Hopper gain the Gluon stage pairs (128- and 64-row blocks),
    last, with the fastest pair's stage times; none for another quantization, GPU, activation, the interpreter or
    D / I off 128."""
    from tritune.device import DeviceInfo
    from tritune.kernels.fused_moe import check_plan
    from tritune.store.fmoe_rows import FmoeShape
    from tritune.tuners import fused_moe as fmoe_tuner

    hopper = DeviceInfo("H100", 132, (9, 0), 232448, 65536, 50 * 2**20, 32, "3.6.0", "2.11", "13.0")
    shape = FmoeShape(4096, 2048, 1408, 64, 6, "silu", "bf16", "fp8", "fp8", "per_1x128", True, False)
    pairs = fmoe_tuner.gluon_variants(shape, hopper)
    if not HAS_GLUON_HOPPER:
        assert pairs == []
        return
    assert fmoe_tuner.E2E_GLUON_PERSISTENT is True  # the rule's stage 2

    def kinds(plans):  # (block rows, stage 1's GLUON, stage 1 persistent, stage 2 persistent)
        return [(p[0].BLOCK_SIZE_M, p[0].GLUON, p[0].PERSISTENT, p[1].PERSISTENT) for p in plans]

    assert kinds(pairs) == [(128, 1, 0, 0), (128, 1, 0, 1), (128, 1, 1, 1), (64, 1, 0, 0), (128, 1, 1, 1),
                            (128, 1, 1, 1)]
    # the last two: stage 1 fed by a loader warp group, then both stages
    assert [(p[0].WARP_SPEC, p[1].WARP_SPEC) for p in pairs] == [(0, 0)] * 4 + [(1, 0), (1, 1)]
    for first, second in pairs:
        check_plan(first, second, "per_1x128")
    assert fmoe_tuner.E2E_GLUON_QUANT_OUT is False  # measured 0.96-1.05x
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_QUANT_OUT", True)
    with_quant = fmoe_tuner.gluon_variants(shape, hopper)
    assert with_quant[:-3] == pairs[:-2] and with_quant[-3][0].QUANT_OUT == 1
    check_plan(*with_quant[-3], "per_1x128")
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_QUANT_OUT", False)
    assert fmoe_tuner.E2E_GLUON_WS is True  # the rule's stage 1 since the twenty-eighth session
    assert fmoe_tuner.E2E_GLUON_WS2 is True  # and its stage 2 since the twenty-ninth
    assert fmoe_tuner.E2E_GLUON_TOPK_ATOMIC is False  # stage 2 adding into the tokens' rows: not yet run on a GPU
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_TOPK_ATOMIC", True)
    atomic = fmoe_tuner.gluon_variants(shape, hopper)
    assert atomic[:-1] == pairs and atomic[-1][0].TOPK_ATOMIC == atomic[-1][1].TOPK_ATOMIC == 1
    check_plan(*atomic[-1], "per_1x128")
    monkeypatch.setenv("TRITUNE_DETERMINISTIC", "1")  # the order of its adds is the GPU's: never then
    assert fmoe_tuner.gluon_variants(shape, hopper) == pairs
    monkeypatch.delenv("TRITUNE_DETERMINISTIC")
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_TOPK_ATOMIC", False)
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_WS2", False)
    assert fmoe_tuner.gluon_variants(shape, hopper) == pairs[:-1]
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_WS", False)
    assert fmoe_tuner.gluon_variants(shape, hopper) == pairs[:-2]
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_WS2", True)
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_WS", True)
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_PERSISTENT", False)
    assert [(p[0].BLOCK_SIZE_M, p[1].PERSISTENT) for p in fmoe_tuner.gluon_variants(shape, hopper)] == [
        (128, 0), (64, 0)]  # the warp-specialised pair's stage 2 is persistent too
    monkeypatch.setattr(fmoe_tuner, "E2E_GLUON_PERSISTENT", True)
    assert all(p[1].GLUON == 1 for p in pairs)
    fast = fmoe_tuner.Choice((dataclasses.replace(S1, GLUON=0, GATHER_A=0),
                              dataclasses.replace(S2, GLUON=0, GATHER_A=0)), 700.0, 0.0, 300.0, 0.0)
    chosen = fmoe_tuner.with_gluon_variants([fast], shape, hopper)
    assert chosen[0] == fast and [c.plan for c in chosen[1:]] == pairs
    assert all((c.us1, c.us2) == (700.0, 300.0) for c in chosen[1:])
    assert fmoe_tuner.with_gluon_variants(chosen, shape, hopper) == chosen  # each pair once
    for other in (dataclasses.replace(shape, q_type="per_token"), dataclasses.replace(shape, act_type="gelu"),
                  dataclasses.replace(shape, inter_dim=1400), dataclasses.replace(shape, doweight_stage1=True)):
        assert fmoe_tuner.gluon_variants(other, hopper) == [], other
    for dev in (dataclasses.replace(hopper, capability=(8, 0)), dataclasses.replace(hopper, interpreter=True)):
        assert fmoe_tuner.gluon_variants(shape, dev) == []
