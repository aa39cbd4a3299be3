"""A run without a GPU records what it was (Triton's interpreter: 0 SMs, no capability), never the H100 limits it
prunes with, so an interpreted result can never be served to a GPU: not by cu_num, not by provenance."""

from __future__ import annotations

import dataclasses

import triton

from tritune.device import DeviceInfo, versions
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.fmoe_table import FmoeConfigTable
from tritune.store.provenance import INTERPRETER_NAME, Machine, Recorded, compare, machine_of

# The interpreter stand-in as current_device() makes it without a GPU (built here, so the test runs on a GPU too).
INTERP = DeviceInfo(name=INTERPRETER_NAME, sm_count=132, capability=(9, 0), max_shared_mem=232448,
                    regs_per_block=65536, l2_bytes=50 * 1024 * 1024, warp_size=32, interpreter=True, **versions())
H100 = dataclasses.replace(INTERP, name="NVIDIA H100 80GB HBM3", interpreter=False)
GPU = machine_of(H100)
SHAPE = FmoeShape(16, 256, 128, 8, 2, "silu", "bf16", "bf16", "bf16", "none", True, False)


def row(cu_num: int, extra: tuple = ()) -> FmoeTuned:
    return FmoeTuned(cu_num=cu_num, shape=SHAPE, block_m=16, ksplit=0, us1=1.0, kernelName1="k1", err1=0.0, us2=0.0,
                     kernelName2="", err2=0.0, us=1.0, run_1stage=True, tflops=1.0, bw=1.0, extra=extra)


def test_the_interpreter_records_no_gpu():
    prov = INTERP.provenance()
    assert (prov["sm_count"], prov["capability"], prov["interpreter"]) == (0, "none", True)
    assert (prov["max_shared_mem"], prov["regs_per_block"], prov["l2_bytes"]) == (0, 0, 0)  # no H100 limit recorded
    assert INTERP.cu_num == 0 and INTERP.sm_count == 132  # the stand-in's limits still prune as an H100 would
    assert machine_of(INTERP) == Machine(INTERPRETER_NAME, 0, triton.__version__, True)
    assert machine_of(INTERP).describe().startswith(f"{INTERPRETER_NAME} (no GPU, Triton ")
    # A GPU records itself.
    assert (H100.cu_num, H100.provenance()["sm_count"], H100.provenance()["capability"]) == (132, 132, "9.0")


def test_interpreted_provenance_never_fits_a_gpu():
    recorded = Recorded.from_provenance(INTERP.provenance())
    assert compare(recorded, GPU).skip  # the GEMM, grouped-GEMM and user-kernel stores skip on this verdict
    assert compare(recorded, machine_of(INTERP)).ok
    # Even under the GPU's own name, 0 SMs reads as interpreted: skipped.
    renamed = Recorded(name=GPU.name, sm_count=0, triton_version=triton.__version__)
    assert renamed.by_interpreter and "tuned by the interpreter" in compare(renamed, GPU).skip


def test_interpreted_fused_moe_row_is_never_looked_up_on_a_gpu():
    tuned = row(INTERP.cu_num, (("device", INTERPRETER_NAME), ("triton", triton.__version__)))
    bare = row(INTERP.cu_num)  # the same row with its provenance columns stripped, as another tool may copy it
    for r in (tuned, bare):
        table = FmoeConfigTable([r])
        assert table.lookup(GPU.sm_count, SHAPE, 16, machine=GPU) is None
        assert table.lookup(GPU.sm_count, SHAPE, 16) is None  # not even without the provenance check
        assert table.rows_of(GPU.sm_count, SHAPE) == []
        # The interpreter itself (the CPU ops' lookups) still finds its own row.
        assert table.lookup(machine_of(INTERP).sm_count, SHAPE, 16, machine=machine_of(INTERP)) == r
    assert bare.recorded().by_interpreter


def test_a_gpu_row_is_not_served_to_the_interpreter():
    table = FmoeConfigTable([row(132, (("device", GPU.name),))])
    assert table.lookup(machine_of(INTERP).sm_count, SHAPE, 16, machine=machine_of(INTERP)) is None
