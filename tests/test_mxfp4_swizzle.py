"""Prepared MXFP4 weight bytes (kernels/mxfp4_swizzle.py): the encoding round trip through the decode's own
register formulas, the tile-major layout and its TMA view, the one-line refusals, the interpreter's per-tile undo,
both stages and the whole call against the standard bytes (bit-equal: the same weights decoded), and the op taking
prepared weights (with a looked-up choice that cannot read them giving way to the rule table). Without a GPU these
run in Triton's interpreter, fp16, which undoes the encoding per tile (`unswizzle_tile`); the bf16 PTX path is
test_runtime_gpu.py's."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import triton
import triton.language as tl
from test_mxfp4_records import DEVICE, DTYPE, INTER, E, operands  # the same small MoE (K 160: a step and a partial one)

from tritune import ops
from tritune.kernels import fused_moe as fm
from tritune.kernels.fused_moe import MoeConfig, fused_moe_2stage, moe_stage1, moe_stage2
from tritune.kernels.fused_moe_launch import MoeLaunch
from tritune.kernels.moe_align import moe_align_block_size
from tritune.kernels.mxfp4_swizzle import (
    SOURCE_BITS,
    Mxfp4Weights,
    k32_order_bytes,
    prepare_mxfp4_weights,
    swizzle_e2m1,
    tile_box,
    tile_major,
    tile_view,
    unswizzle_e2m1,
    unswizzle_tile,
    untile,
)
from tritune.ops.fused_moe import MoeChoice

ST = MoeConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2,
               SWAP_AB=1, USE_TMA=1, SCALE_TMA=0)


def test_each_bit_of_a_group_goes_once_and_the_decode_formulas_undo_it():
    assert sorted(SOURCE_BITS) == sorted(SOURCE_BITS.values()) == list(range(32))
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8, generator=gen)  # 3 experts, 3 row groups, K 80
    enc = swizzle_e2m1(raw)
    assert enc.shape == raw.shape and enc.dtype == torch.uint8 and enc.is_contiguous()
    assert torch.equal(unswizzle_e2m1(enc), raw) and not torch.equal(enc, raw)
    # A group is rows r and r + 8 of 16, one byte pair along K: nothing moves between groups.
    one = torch.zeros_like(raw)
    one[1, 16 + 8 + 5, 6] = 0x80  # row 29 (group 1, second half, r 5), byte 6 (pair 3, second byte)
    moved = swizzle_e2m1(one).nonzero().tolist()
    assert moved and all(e == 1 and r in (16 + 5, 16 + 8 + 5) and c in (6, 7) for e, r, c in moved)


def test_tile_major_puts_each_64_row_k_step_together_and_the_tma_view_finds_every_tile():
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (2, 160, 80), dtype=torch.uint8, generator=gen)  # N 160: a partial block; K/2 80
    tiles = tile_major(raw)
    assert tiles.shape == (2, 3, 2, 64, 64) and tiles.is_contiguous()
    assert torch.equal(tiles[1, 2, 0, :32], raw[1, 128:, :64]) and not tiles[1, 2, :, 32:].any()  # rows past N
    assert torch.equal(tiles[0, 1, 1, :, :16], raw[0, 64:128, 64:]) and not tiles[:, :, 1, :, 16:].any()  # past K
    assert torch.equal(untile(tiles, 160, 80), raw)
    w = prepare_mxfp4_weights(raw)
    assert w.shape == raw.shape and w.view.shape == raw.shape and w.view.data_ptr() == w.tiles.data_ptr()
    assert torch.equal(w.standard(), raw) and torch.equal(unswizzle_e2m1(w.packed()), k32_order_bytes(raw, True))
    view = tile_view(w.view)  # [E·NB, KS·64, 64]: the box of a BLOCK_N tile at K step s, rows n0.., as the kernel
    assert view.shape == (6, 128, 64)
    standard = tile_major(w.packed())[1].permute(0, 2, 1, 3).reshape(192, 128)  # expert 1, rows padded to 192
    for block_n, block_k, n0, k in ((64, 128, 64, 128), (128, 128, 0, 0), (16, 128, 144, 128), (32, 64, 32, 64)):
        rows, sub, width = tile_box(block_n, block_k)
        e_row = 1 * 192 + n0  # the kernel's coordinates: [row // 64, (k // 128)·64 + row % 64, (k % 128) / 2]
        r0, c0 = (k // 128) * 64 + e_row % 64, (k % 128) // 2
        box = view[e_row // 64:e_row // 64 + rows, r0:r0 + sub, c0:c0 + width]
        assert torch.equal(box.reshape(block_n, block_k // 2), standard[n0:n0 + block_n, k // 2:k // 2 + block_k // 2])


def test_the_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"N a multiple of 16 .* \(2, 24, 8\)"):
        swizzle_e2m1(torch.zeros(2, 24, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="want packed uint8"):
        swizzle_e2m1(torch.zeros(2, 16, 8))
    with pytest.raises(ValueError, match=r"want packed uint8 \[E, N, K/2\]"):
        prepare_mxfp4_weights(torch.zeros(16, 8, dtype=torch.uint8))
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    p1, p2 = prepare_mxfp4_weights(q1), prepare_mxfp4_weights(q2)
    sorting = moe_align_block_size(ids, ST.BLOCK_SIZE_M, E)
    for fields in ({"SWAP_AB": 0, "USE_TMA": 0}, {"BLOCK_SIZE_K": 256}, {"BLOCK_SIZE_N": 32}):
        with pytest.raises(ValueError, match=r"moe_stage1_per_1x32.*read only by the swapped GEMM.*N >= 64, through"):
            moe_stage1(hidden, p1, weights, sorting, dataclasses.replace(ST, **fields), inter_dim=INTER,
                       quant=fm.MXFP4, w1_scale=s1)
    one = dataclasses.replace(ST, SWAP_AB=0, USE_TMA=0, BLOCK_SIZE_D=64)
    with pytest.raises(ValueError, match="1-stage kernel reads the standard packed MXFP4 bytes"):
        MoeLaunch(hidden, p1, p2, weights, ids, s1, s2, stage1=one, stage2=None, quant=fm.MXFP4)
    h, r1, _, w, i, c1, _ = operands(inter=96)  # the up rows start at row 96, inside a 64-row chunk
    with pytest.raises(ValueError, match="inter_dim a multiple of 64 .* got 96"):
        moe_stage1(h, prepare_mxfp4_weights(r1), w, moe_align_block_size(i, ST.BLOCK_SIZE_M, E), ST, inter_dim=96,
                   quant=fm.MXFP4, w1_scale=c1)


@triton.jit
def _undo_kernel(x_ptr, y_ptr, BN: tl.constexpr, HK: tl.constexpr):
    r = tl.arange(0, BN)[:, None]
    c = tl.arange(0, HK)[None, :]
    tl.store(y_ptr + r * HK + c, unswizzle_tile(tl.load(x_ptr + r * HK + c), BN, HK))


def test_a_tile_is_undone_in_the_kernel_as_on_the_host():
    gen = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (32, 16), dtype=torch.uint8, generator=gen).to(DEVICE)
    out = torch.empty_like(raw)
    _undo_kernel[(1,)](swizzle_e2m1(raw), out, BN=32, HK=16)
    assert torch.equal(out, raw)


@pytest.mark.parametrize("fields", [{}, {"KSPLIT": 2}, {"USE_TMA": 0},
                                    {"BLOCK_SIZE_K": 64}, {"USE_TMA": 0, "BLOCK_SIZE_K": 64},
                                    {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "num_warps": 8}],
                         ids=["tma", "split-k", "pointer loads", "tma, 64-wide K", "pointers, 64-wide K",
                              "8 warps, 128 rows"])
def test_both_stages_read_re_encoded_bytes_as_the_standard_ones(fields):
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    st = dataclasses.replace(ST, **fields)
    sorting = moe_align_block_size(ids, st.BLOCK_SIZE_M, E)
    want = moe_stage1(hidden, q1, weights, sorting, st, inter_dim=INTER, quant=fm.MXFP4, w1_scale=s1)
    got = moe_stage1(hidden, prepare_mxfp4_weights(q1), weights, sorting, st, inter_dim=INTER, quant=fm.MXFP4,
                     w1_scale=s1)
    assert torch.equal(got, want)
    inter = want.to(DTYPE)
    want2 = moe_stage2(inter, q2, weights, sorting, st, quant=fm.MXFP4, w2_scale=s2)
    got2 = moe_stage2(inter, prepare_mxfp4_weights(q2), weights, sorting, st, quant=fm.MXFP4, w2_scale=s2)
    assert torch.equal(got2, want2)


def test_the_whole_call_with_re_encoded_weights_and_scale_records_matches_the_standard_bytes():
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    st = dataclasses.replace(ST, SCALE_TMA=1, SORTED_INTER=1, TOPK_ATOMIC=1)
    p1, p2 = ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2)
    want = fused_moe_2stage(hidden, q1, q2, weights, ids, st, st, quant=fm.MXFP4, w1_scale=p1, w2_scale=p2)
    got = fused_moe_2stage(hidden, prepare_mxfp4_weights(q1), q2, weights, ids, st, st, quant=fm.MXFP4,
                           w1_scale=p1, w2_scale=p2)  # one re-encoded, one standard
    assert torch.equal(got, want)


def test_the_op_takes_prepared_weights_and_a_choice_that_cannot_read_them_gives_way_to_the_rule():
    hidden, q1, q2, weights, ids, s1, s2 = operands()
    w1, w2 = ops.prepare_mxfp4_weights(q1), ops.prepare_mxfp4_weights(q2)
    assert isinstance(w1, ops.Mxfp4Weights) and w1.shape == q1.shape
    assert ops.fused_moe_choice(hidden, w1, w2, ids, quant=fm.MXFP4) == ops.fused_moe_choice(hidden, q1, q2, ids,
                                                                                             quant=fm.MXFP4)
    p1, p2 = ops.prepare_mxfp4_scales(s1), ops.prepare_mxfp4_scales(s2)
    want = ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, p1, p2)
    assert torch.equal(ops.fused_moe_mxfp4(hidden, w1, w2, weights, ids, p1, p2), want)
    assert torch.equal(ops.fused_moe_mxfp4(hidden, w1, w2, weights, ids, s1, s2),
                       ops.fused_moe_mxfp4(hidden, q1, q2, weights, ids, s1, s2))
    with pytest.raises(ValueError, match="read only by the swapped GEMM"):  # fp8 activations: dot_scaled
        ops.fused_moe_mxfp4(hidden, w1, w2, weights, ids, s1, s2, act_dtype=torch.float8_e4m3fn)
    op = importlib.import_module("tritune.ops.fused_moe")
    rule = MoeChoice(False, ST, ST, "heuristic")
    tuned = MoeChoice(False, dataclasses.replace(ST, SWAP_AB=0, USE_TMA=0), ST, "tuned: f.csv, row 2")
    assert op._swizzle_as_given(tuned, fm.MXFP4, (False, False), None) is tuned
    assert op._swizzle_as_given(tuned, fm.MXFP4, (False, True), None) is tuned  # stage 2 swapped: it reads them
    with pytest.warns(UserWarning, match=r"tuned: f.csv, row 2 does not run the swapped MXFP4 GEMM"):
        given = op._swizzle_as_given(tuned, fm.MXFP4, (True, True), lambda: rule)
    assert (given.stage1, given.stage2) == (ST, ST) and "row 2 not swapped" in given.source
    unswapped_one = dataclasses.replace(ST, SWAP_AB=0, USE_TMA=0, BLOCK_SIZE_D=64)
    with pytest.warns(UserWarning, match="does not run the swapped"):
        op._swizzle_as_given(MoeChoice(True, unswapped_one, None, "tuned: 1-stage"), fm.MXFP4, (True, False),
                             lambda: rule)
    swapped_one = MoeChoice(True, dataclasses.replace(ST, BLOCK_SIZE_D=64), None, "tuned: swapped 1-stage")
    assert op._swizzle_as_given(swapped_one, fm.MXFP4, (True, True), None) is swapped_one  # it reads them


def test_the_weights_wrapper_is_an_identity_keyed_holder():
    tiles = torch.zeros(1, 1, 1, 64, 64, dtype=torch.uint8)
    a, b = Mxfp4Weights(tiles, 48, 40), Mxfp4Weights(tiles, 48, 40)
    assert a != b and a.tiles is tiles and a.shape == (1, 48, 40)
