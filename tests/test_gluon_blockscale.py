"""The Gluon block-scaled fp8 kernel compiled for sm_90 with no GPU, as the tuner's compile pool builds it: the MMAs
of two consecutive K blocks stay in flight together (`wgmma.wait_group 1`), ptxas keeps them asynchronous (no C7514 /
C7512 serialization, which a register copy of an in-flight partial or a spill brings back), and nothing spills.

The kernel itself runs only on a Hopper GPU (Gluon has no interpreter): tests/test_gluon_blockscale_gpu.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tritune.kernels.gluon_blockscale import HAS_GLUON_HOPPER

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Run in a child: compile_without_gpu retargets this process's Triton driver for good.
_CHILD = r"""
import json, pathlib, re, subprocess, sys, tempfile
from tritune.compile_target import CompileTarget, compile_without_gpu
compile_without_gpu(CompileTarget("cuda", 90, 32, 132))
import torch, triton
from triton.runtime.jit import MockTensor
from tritune.kernels import gemm as gk, gluon_blockscale as gb

M, N, K = 4096, 1536, 7168
from triton.backends.nvidia.compiler import get_ptxas
ptxas = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90 (its PTX version needs it)
report = {}
for bm, warps, stages in ((128, 8, 4), (64, 4, 5)):
    cfg = gk.GemmConfig(bm, 128, 128, 8, warps, stages, PERSISTENT_TMA=bm == 128, GLUON=True)
    gk.compile_only("a8w8_blockscale", M, N, K, cfg)  # the compile pool's call
    a, b = MockTensor(torch.float8_e4m3fn, [M, K]), MockTensor(torch.float8_e4m3fn, [N, K])
    c = MockTensor(torch.bfloat16, [M, N])
    kernel = gb.blockscale_kernel.warmup(*gb.descriptors(a, b, c, bm, 128), torch.float32, torch.float32, M, N, K,
                                         K // 128, 1, K // 128, 1, 132, 8, stages, warps, num_warps=warps,
                                         num_stages=stages, grid=(1,))
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp, "k.ptx")
        src.write_text(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(pathlib.Path(tmp, "k.cubin"))],
                             capture_output=True, text=True)
    report[f"{bm}x128 w{warps} s{stages}"] = {
        "waits": re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx), "ptxas_rc": run.returncode,
        "ptxas": run.stdout + run.stderr}
print("REPORT " + json.dumps(report))
"""


@pytest.mark.skipif(not HAS_GLUON_HOPPER, reason="this Triton has no Gluon Hopper API (Triton >= 3.5)")
def test_two_k_blocks_in_flight_and_not_serialized() -> None:
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    line = next((x for x in run.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line is not None, run.stderr[-3000:]
    report = json.loads(line[len("REPORT "):])
    assert set(report) == {"128x128 w8 s4", "64x128 w4 s5"}
    for name, r in report.items():
        assert r["ptxas_rc"] == 0, (name, r["ptxas"])
        assert "1" in r["waits"] and r["waits"][-1] == "0", (name, r["waits"])  # k-1 retired while k runs; then all
        assert "C7514" not in r["ptxas"] and "C7512" not in r["ptxas"], (name, r["ptxas"])  # not serialized
        assert "0 bytes spill stores" in r["ptxas"], (name, r["ptxas"])
