"""Gluon kernels compiled for sm_90 with no GPU, in a child process (compile_without_gpu retargets a process's
Triton driver for good), and what ptxas says of their PTX: the CPU suite's check that the wgmmas stay asynchronous
(tests/test_gluon_blockscale.py, test_gluon_gemm.py, test_gluon_moe.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The child's first lines: the sm_90 target, `report` for the body to fill and `ptxas_report` to fill it with.
_PRELUDE = r'''
import json, pathlib, re, subprocess, tempfile
from tritune.compile_target import CompileTarget, compile_without_gpu
compile_without_gpu(CompileTarget("cuda", 90, 32, 132))
from triton.backends.nvidia.compiler import get_ptxas
_PTXAS = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90 (its PTX version needs it)
report = {}


def ptxas_report(ptx, **extra):
    """The wgmma wait counts of `ptx` and ptxas' verdict on it (exit status, verbose output), with `extra`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp, "k.ptx")
        src.write_text(ptx)
        run = subprocess.run([_PTXAS, "-arch=sm_90a", "-v", str(src), "-o", str(pathlib.Path(tmp, "k.cubin"))],
                             capture_output=True, text=True)
    return {"waits": re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx), "ptxas_rc": run.returncode,
            "ptxas": run.stdout + run.stderr, **extra}
'''


def compile_report(body: str) -> dict:
    """Run `body` after the prelude in a child (src on its path) and return the `report` it filled: name -> the
    `ptxas_report` of one compiled kernel."""
    code = _PRELUDE + body + '\nprint("REPORT " + json.dumps(report))\n'
    # Not under the interpreter the suite sets: there Triton's jit-defined helpers (gl.max's reduction) become
    # interpreted functions the compiler refuses, and only a warm kernel cache would hide it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**env, "PYTHONPATH": str(ROOT / "src")})
    line = next((x for x in run.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line is not None, run.stderr[-3000:]
    return json.loads(line[len("REPORT "):])


def assert_asynchronous(name: str, r: dict) -> None:
    """ptxas built it, kept every wgmma asynchronous (no C7514 / C7512 serialization, which a register copy of an
    in-flight accumulator or a spill brings back) and spilled nothing."""
    assert r["ptxas_rc"] == 0, (name, r["ptxas"])
    assert "C7514" not in r["ptxas"] and "C7512" not in r["ptxas"], (name, r["ptxas"])
    assert "0 bytes spill stores" in r["ptxas"], (name, r["ptxas"])
