"""TRITUNE_MXFP4_DECODE=asm (kernels/mxfp4.py: two e2m1 codes a register through PTX) against the spec's dequantizer,
bit for bit, and a whole MXFP4 fused MoE through it. GPU only: the interpreter cannot run PTX, and the knob is read
when the kernels are imported, so each check runs in a fresh Python with the variable set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tritune import knobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="PTX decode: needs a GPU (Triton's interpreter runs no inline assembly)")

# Every byte value (both nibbles, every code) under scale codes from tiny to large; N not a multiple of BLOCK_N and K
# with a half-masked tile.
DEQUANT = """
import torch
from tritune.kernels import mxfp4
from tritune.kernels.mxfp4_format import dequantize_mxfp4
assert mxfp4.ASM_DECODE, "the knob did not reach the kernels"
packed = torch.arange(256, dtype=torch.uint8).repeat(6, 1)[:, :240].contiguous().cuda()  # [6, 240]: K = 480
codes = torch.tensor([2, 100, 119, 127, 140, 200], dtype=torch.uint8)
scales = codes[:, None].repeat(1, 480 // 32).contiguous().cuda()
want = dequantize_mxfp4(packed, scales, torch.float32).to(torch.bfloat16)
for block_n, block_k in ((4, 64), (8, 256), (2, 32)):
    got = mxfp4.dequantize_mxfp4_triton(packed, scales, torch.bfloat16, block_n=block_n, block_k=block_k)
    bits_equal = torch.equal(got.view(torch.int16), want.view(torch.int16))  # -0.0 and +0.0 apart
    assert bits_equal, (block_n, block_k, int((got.float() != want.float()).sum()))
print("DEQUANT OK")
"""

MOE = """
import torch
from tritune.kernels import fused_moe as fm, mxfp4
from tritune.kernels.fused_moe import quantize_weights
from tritune.kernels.moe_reference import fused_moe_reference
from tritune.ops import fused_moe
from tritune.ops.routing import sample_routing
assert mxfp4.ASM_DECODE
fm.MXFP4_DOT_SCALED = False  # the stage kernels decode each tile (QUANT 3) instead of handing it to tl.dot_scaled
g = torch.Generator().manual_seed(0)
t, d, i, e, k = 33, 256, 128, 8, 2
hidden = torch.randn(t, d, generator=g).bfloat16().cuda()
(q1, s1), (q2, s2) = (quantize_weights(torch.randn(e, n, kk, generator=g) / kk ** 0.5, "per_1x32")
                      for n, kk in ((2 * i, d), (d, i)))
q1, s1, q2, s2 = (x.cuda() for x in (q1, s1, q2, s2))
w, ids = (x.cuda() for x in sample_routing(t, e, k, seed=0))
ref = fused_moe_reference(hidden, q1, q2, w, ids, quant="per_1x32", w1_scale=s1, w2_scale=s2)
got = fused_moe(hidden, q1, q2, w, ids, quant="per_1x32", w1_scale=s1, w2_scale=s2)
rel = float((got.float() - ref.float()).norm() / ref.float().norm())
assert rel < 2e-2, rel
print("MOE OK", rel)
"""


@pytest.mark.parametrize(("script", "done"), [(DEQUANT, "DEQUANT OK"), (MOE, "MOE OK")], ids=["dequant", "fused-moe"])
def test_ptx_decode(script: str, done: str) -> None:
    env = {**os.environ, knobs.MXFP4_DECODE: "asm"}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and done in run.stdout, run.stderr[-3000:]
