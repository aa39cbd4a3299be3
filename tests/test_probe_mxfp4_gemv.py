"""benchmarks/probe_mxfp4_gemv.py without a GPU: every non-MMA variant of the probe's matrix-vector kernel (load
checksum, bf16, fp32 multiply-add with per-weight and per-block scales, the in-thread block sums of `gemv`) through
the interpreter, split-K and a K not
a multiple of BLOCK_K included, so the GPU session's figures come from kernels known to compute the product."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("probe_mxfp4_gemv", ROOT / "benchmarks" / "probe_mxfp4_gemv.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the probe itself")


def test_every_variant_matches_the_reference(tmp_path):
    out = tmp_path / "probe.json"
    assert probe.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    modes = {r["mode"] for r in rows}
    # the dot modes need the GPU (bf16 dot), gemv_asm runs PTX
    assert modes == {"load", "bf16", "fma", "fma_blockscale", "gemv"}
    # three points (1, 2, 3 rows an expert); gemv keeps at most 2 rows, so it skips the third
    assert len(rows) == (len(modes) * 3 - 1) * len(probe.TINY_TILES)
    assert all("error" not in r and r["rel_l2"] < 1e-5 for r in rows), [r for r in rows if "error" in r][:2]


def test_an_unknown_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(["--modes", "fma,nope", "--out", "x"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def _run_ptx(ptx: str, reg: int) -> list[float]:
    """Execute the decode's PTX (shl, shr, and, or on b32, mul.rn.f32 by an immediate) on one input register."""
    import re
    import struct

    regs: dict[str, int | float] = {"$4": reg}
    out = {}
    for line in ptx.splitlines():
        m = re.match(r"(shl|shr|and|or|mul)\.\S+ (\S+), (\S+), (\S+);", line.strip())
        if not m:
            continue
        op, dst, a, b = m.groups()

        def val(x: str) -> int | float:
            if x.startswith("0f"):
                return struct.unpack(">f", bytes.fromhex(x[2:]))[0]
            return regs[x] if x in regs else int(x, 0)
        lhs, rhs = val(a), val(b)
        if op == "mul":
            res = struct.unpack("<f", struct.pack("<I", lhs))[0] * rhs
        elif op == "shl":
            res = (lhs << rhs) & 0xFFFFFFFF
        elif op == "shr":
            res = lhs >> rhs
        else:
            res = lhs & rhs if op == "and" else lhs | rhs
        regs[dst] = res
        if dst.startswith("$"):
            out[int(dst[1:])] = res
    return [out[i] for i in range(4)]


def test_the_ptx_decode_gives_every_code_its_value():
    import math

    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    low, high = probe._e2m1_f32_ptx(False), probe._e2m1_f32_ptx(True)
    for byte in range(256):
        reg = byte | ((255 - byte) << 8) | (byte << 16) | ((byte ^ 0x5A) << 24)
        got_low, got_high = _run_ptx(low, reg), _run_ptx(high, reg)
        for i in range(4):
            b = (reg >> (8 * i)) & 0xFF
            for got, code in ((got_low[i], b & 0xF), (got_high[i], b >> 4)):
                want = -values[code & 7] if code & 8 else values[code & 7]
                assert got == want and math.copysign(1, got) == math.copysign(1, want), (b, code, got)
