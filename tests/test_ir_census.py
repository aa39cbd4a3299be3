"""benchmarks/ir_census.py without a GPU: it compiles for sm_90 as the compile pool does and reads the MMA waits the
RESULTS.md K-step analysis rests on (a rescaled dot retires at once; only the chained accumulator stays in flight)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ir_census", ROOT / "benchmarks" / "ir_census.py")


def test_census_counts_and_waits_from_canned_asm():
    interpret = os.environ.get("TRITON_INTERPRET")
    ir_census = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ir_census)  # pops TRITON_INTERPRET at import: put it back for the tests after this one
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = interpret
    asm = {"ttgir": "ttg.convert_layout x\nttg.local_alloc y\nttg.convert_layout z",
           "ptx": "wgmma.mma_async a\nwgmma.wait_group.sync.aligned 2;\nwgmma.mma_async b\n"
                  "wgmma.wait_group.sync.aligned 0;\ncvt.rn.bf16.f32 c\nst.shared.b32 d"}
    row = ir_census.census(asm)
    assert row["wgmma"] == 2 and row["wgmma waits"] == [2, 0]
    assert (row["convert_layout"], row["local_alloc"], row["cvt"], row["st.shared"], row["mma.sync"]) == (2, 1, 1, 1, 0)
    assert (row["regs"], row["spill bytes"]) == (None, None)  # no cubin, no resource usage


def test_compiles_for_sm90_without_a_gpu_and_reads_the_k_step_forms(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ir_census.py"), "--scaled-dots",
                           "--point", "e128-top8-i384:per_token:4096", "--stage", "stage1", "--out", str(tmp_path),
                           "--cache", str(tmp_path / "cache")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    waits = {label: line.rsplit(" | ", 1)[1].rstrip(" |") for label, line in rows.items()}
    assert waits["toy: rescale after each dot"] == "[0, 0]"  # each rescaled MMA retires before the next
    assert waits["toy: chained accumulator"].startswith("[") and waits["toy: chained accumulator"] != "[0, 0]"
    (stage1,) = [label for label in rows if label.startswith("e128-top8-i384:per_token:4096 stage1 ")]
    cells = rows[stage1].split(" | ")
    assert "moe_stage1_per_token" in stage1 and 0 < int(cells[1]) <= 255 and int(cells[2]) >= 0  # regs, spills
    assert int(cells[3]) > 0  # wgmma
    assert (tmp_path / "e128-top8-i384_per_token_4096_stage1.ptx").read_text().count("wgmma.mma_async") > 0
