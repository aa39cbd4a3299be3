"""store.provenance: the stale-file policy, and each store's lookup under it (skipped or served, warned once)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import triton

from tritune.kernels.grouped_gemm_config import KernelConfigForward
from tritune.store import gemm_json as gj
from tritune.store import grouped_gemm_json as ggj
from tritune.store.fmoe_csv import write_tuned
from tritune.store.fmoe_rows import FmoeShape, FmoeTuned
from tritune.store.fmoe_table import FmoeConfigTable
from tritune.store.provenance import Machine, Recorded, Verdict, compare, running_machine, triton_minor
from tritune.store.user_json import UserEntry, UserKernelStore
from tritune.tuning.types import Config

H100 = "NVIDIA H100 80GB HBM3"
MACHINE = Machine(H100, 132, "3.9.0")
SLUG = gj.slug_of(H100)
PROV = {"name": H100, "sm_count": 132, "triton_version": "3.9.0", "torch_version": "2.13.0", "interpreter": False}


@contextmanager
def caught():
    """Every tritune warning raised inside, whatever the filters (the store's own once-only rule is under test)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got: list[str] = []
        yield got
    got.extend(str(w.message) for w in seen if str(w.message).startswith("tritune:"))


@pytest.mark.parametrize("recorded, verdict", [
    (Recorded(H100, 132, "3.9.0", False), Verdict()),  # same machine
    (Recorded(H100, 132, "3.9.1"), Verdict()),  # patch versions do not count
    (Recorded(), Verdict()),  # nothing recorded: nothing to compare
    (Recorded(H100, 132, "3.6.0"), Verdict(stale="Triton 3.6 != 3.9")),  # used, with a warning
    (Recorded("NVIDIA H200", 132, "3.9.0"), Verdict(skip=f"tuned on NVIDIA H200, this is {H100}")),  # same SMs
    (Recorded(H100, 114, "3.9.0"), Verdict(skip=f"tuned with 114 SMs, this {H100} has 132")),
    (Recorded(None, None, None, True), Verdict(skip=f"tuned by the interpreter, this is {H100}")),  # no name given
    (Recorded("NVIDIA H200", 132, "3.6.0"),  # both: skipped, and the Triton note kept
     Verdict(skip=f"tuned on NVIDIA H200, this is {H100}", stale="Triton 3.6 != 3.9")),
])
def test_policy(recorded, verdict):
    assert compare(recorded, MACHINE) == verdict


def test_policy_interpreter_both_ways():
    cpu = Machine("cpu-interpreter", 132, "3.9.0", interpreter=True)
    gpu_file = compare(Recorded(H100, 132, "3.9.0", False), cpu)
    assert gpu_file.status() == f"skipped: tuned on {H100}, this is cpu-interpreter"
    # An interpreter-tuned file named only by its device name is still known as one, and never serves a GPU.
    assert compare(Recorded("cpu-interpreter", 132, "3.9.0"), MACHINE).skip
    assert compare(Recorded("cpu-interpreter", 132, "3.9.0"), cpu).ok


def test_statuses_and_versions():
    assert Verdict().status() == "used"
    assert Verdict(stale="Triton 3.6 != 3.9").status() == "used (Triton 3.6 != 3.9)"
    assert triton_minor("3.6.0") == "3.6" and triton_minor("3.10.0+git12ab") == "3.10" and triton_minor(" x ") == "x"
    assert Recorded.from_provenance(PROV) == Recorded(H100, 132, "3.9.0", False, "2.13.0")
    assert Recorded.from_provenance({}).describe() == "no provenance recorded"
    for bad in ({"sm_count": "132"}, {"sm_count": True}, {"name": 5}, {"interpreter": "no"}):
        with pytest.raises(ValueError, match="provenance"):
            Recorded.from_provenance(bad)


def test_running_machine_is_current_device():
    from tritune.device import current_device

    info = current_device()
    m = running_machine()
    assert (m.name, m.sm_count, m.triton_version, m.interpreter) == (info.name, info.cu_num, triton.__version__,
                                                                     info.interpreter)


# ---- GEMM store ------------------------------------------------------------------------------------------------

def gemm_entry(M: int) -> gj.GemmEntry:
    config = Config.of(BLOCK_M=M, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return gj.GemmEntry(M=M, config=config, time_us=1.0, tflops=1.0, gbps=1.0, error=0.0)


def test_gemm_shape_file_of_another_device_is_skipped_with_one_warning(tmp_path):
    # Named for this machine (so the lookup reads it) but tuned on an H200 with the same SM count.
    path = gj.write_shape_file(tmp_path, {**PROV, "name": "NVIDIA H200"}, "BF16", 64, 32, {16: gemm_entry(16)},
                               device_slug=SLUG)
    store = gj.GemmConfigStore([tmp_path])
    with caught() as got:
        assert store.lookup(SLUG, "BF16", 16, 64, 32, machine=MACHINE) is None
        assert store.lookup(SLUG, "BF16", 300, 64, 32, machine=MACHINE) is None  # another M: same file, no 2nd warning
    assert got == [f"tritune: {path} was tuned on NVIDIA H200 (132 SMs, Triton 3.9); this is {H100} (132 SMs, "
                   f"Triton 3.9): not using it (tuned on NVIDIA H200, this is {H100})"]
    with caught() as got:  # without a machine nothing is checked, as before
        assert store.lookup(SLUG, "BF16", 16, 64, 32)[0] == gemm_entry(16).config
    assert got == []


def test_gemm_skipped_shape_file_falls_back_to_the_device_default(tmp_path):
    shape = gj.write_shape_file(tmp_path, {**PROV, "sm_count": 114}, "BF16", 64, 32, {16: gemm_entry(16)},
                                device_slug=SLUG)
    default = gj.write_default_file(tmp_path, {**PROV}, "BF16")  # voted from the 114-SM file, recorded as 132
    with caught() as got:
        config, source = gj.GemmConfigStore([tmp_path]).lookup(SLUG, "BF16", 16, 64, 32, machine=MACHINE)
    assert source == f"device default {default} bucket small" and config == gemm_entry(16).config
    assert len(got) == 1 and str(shape) in got[0] and "tuned with 114 SMs" in got[0]


def test_gemm_triton_mismatch_is_used_with_one_warning(tmp_path):
    path = gj.write_shape_file(tmp_path, {**PROV, "triton_version": "3.6.0"}, "BF16", 64, 32, {16: gemm_entry(16)})
    store = gj.GemmConfigStore([tmp_path])
    with caught() as got:
        config, source = store.lookup(SLUG, "BF16", 16, 64, 32, machine=MACHINE)
        store.lookup(SLUG, "BF16", 17, 64, 32, machine=MACHINE)
        gj.GemmConfigStore([tmp_path]).lookup(SLUG, "BF16", 16, 64, 32, machine=MACHINE)  # a fresh store: still once
    assert config == gemm_entry(16).config and source == f"shape file {path} M=16 (stale: Triton 3.6 != 3.9)"
    assert got == [f"tritune: {path} was tuned on {H100} (132 SMs, Triton 3.6); this is {H100} (132 SMs, Triton "
                   "3.9): using it anyway (Triton 3.6 != 3.9)"]


def test_gemm_file_with_bad_provenance_is_malformed(tmp_path):
    gj.write_shape_file(tmp_path, {**PROV, "sm_count": "many"}, "BF16", 64, 32, {16: gemm_entry(16)})
    with caught() as got:
        assert gj.GemmConfigStore([tmp_path]).lookup(SLUG, "BF16", 16, 64, 32, machine=MACHINE) is None
    assert len(got) == 1 and "malformed" in got[0] and "sm_count='many'" in got[0]


# ---- fused-MoE table -------------------------------------------------------------------------------------------

SHAPE = FmoeShape(token=16, model_dim=256, inter_dim=128, expert=8, topk=2, act_type="silu", dtype="bf16",
                  q_dtype_a="bf16", q_dtype_w="bf16", q_type="none", use_g1u1=True, doweight_stage1=False)


def fmoe_row(device: str | None, triton_version: str = "3.9.0", us: float = 10.0, cu_num: int = 132,
             token: int = 16) -> FmoeTuned:
    extra = (("device", device), ("triton", triton_version)) if device else ()
    return FmoeTuned(cu_num=cu_num, shape=SHAPE.with_token(token), block_m=16, ksplit=0, us1=us, kernelName1="k1",
                     err1=0.0, us2=0.0, kernelName2="", err2=0.0, us=us, run_1stage=True, tflops=1.0, bw=1.0,
                     extra=extra)


def test_fmoe_rows_of_another_device_are_not_served(tmp_path):
    path = tmp_path / "tuned_fmoe.csv"
    # The interpreter stand-in reports 132 SMs too: without the check its row would serve an H100.
    write_tuned(path, [fmoe_row("cpu-interpreter", token=16), fmoe_row("NVIDIA H200", token=32)])
    table = FmoeConfigTable.from_files([path])
    with caught() as got:
        assert table.lookup(132, SHAPE, 16, machine=MACHINE) is None
        assert table.lookup(132, SHAPE, 32, machine=MACHINE) is None
        assert table.lookup(132, SHAPE, 12, machine=MACHINE) is None  # same file and mismatch as the first: silent
    assert len(got) == 2 and all(g.startswith(f"tritune: {path} was tuned on ") for g in got)
    assert "cpu-interpreter (132 SMs, Triton 3.9)" in got[0] and "not using it (tuned on cpu-interpreter" in got[0]
    assert "NVIDIA H200 (132 SMs, Triton 3.9)" in got[1]
    assert table.lookup(132, SHAPE, 16) is not None  # no machine: served as before
    assert table.lookup(114, SHAPE, 16, machine=MACHINE) is None  # another cu_num: never matched


def test_fmoe_rows_of_two_devices_with_one_cu_num_both_kept(tmp_path):
    path = tmp_path / "tuned_fmoe.csv"
    ours, theirs = fmoe_row(H100, us=20.0), fmoe_row("NVIDIA H200", us=10.0)
    write_tuned(path, [ours, theirs])
    with caught() as got:
        table = FmoeConfigTable.from_files([path])  # not duplicates: no warning
        assert table.lookup(132, SHAPE, 16, machine=MACHINE) == ours  # served silently: this machine's row
    assert got == []
    assert table.lookup(132, SHAPE, 16) == theirs  # no machine: the lower us, as duplicates resolved before
    assert len(table.rows) == 2


def test_fmoe_triton_mismatch_served_with_one_warning(tmp_path):
    path = tmp_path / "tuned_fmoe.csv"
    old = fmoe_row(H100, triton_version="3.6.0")
    write_tuned(path, [old, fmoe_row(H100, triton_version="3.6.0", token=64)])
    table = FmoeConfigTable.from_files([path])
    with caught() as got:
        assert table.lookup(132, SHAPE, 16, machine=MACHINE) == old
        assert table.lookup(132, SHAPE, 64, machine=MACHINE).shape.token == 64
    assert got == [f"tritune: {path} was tuned on {H100} (132 SMs, Triton 3.6); this is {H100} (132 SMs, Triton "
                   "3.9): using it anyway (Triton 3.6 != 3.9)"]


def test_fmoe_rows_without_provenance_are_served_silently():
    table = FmoeConfigTable([fmoe_row(None)])  # aiter's files record only cu_num, which the lookup matches
    with caught() as got:
        assert table.lookup(132, SHAPE, 16, machine=MACHINE) is not None
    assert got == []


# ---- grouped GEMM and user kernels -----------------------------------------------------------------------------

FWD = KernelConfigForward(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, num_warps=8, num_stages=3)


def grouped_entry(triton_version: str, tokens: int = 1024, **prov) -> ggj.GroupedGemmEntry:
    return ggj.GroupedGemmEntry(triton=triton_version, num_experts=8, n=256, k=128, topk=2, dtype="bf16",
                                gemm="gate_up", kernel="forward", tokens=tokens, config=FWD.to_dict(), us=1.0,
                                torch_us=2.0, baseline="torch",
                                provenance={**PROV, "triton_version": triton_version, **prov})


def grouped_lookup(store: ggj.GroupedGemmStore, machine: Machine | None, tokens: int = 1024):
    return store.lookup(H100, "3.9.0", 8, 256, 128, 2, "bf16", "gate_up", "forward", tokens, machine=machine)


def test_grouped_other_triton_served_with_a_warning_only_when_checked(tmp_path):
    path = ggj.write_entries(ggj.store_path(tmp_path, H100), [grouped_entry("3.6.0")])
    store = ggj.GroupedGemmStore([tmp_path])
    assert grouped_lookup(store, None) is None  # unchecked: exact Triton version only, as before
    with caught() as got:
        config, source = grouped_lookup(store, MACHINE)
        grouped_lookup(store, MACHINE, tokens=512)
    assert config == FWD.to_dict() and source.endswith("tokens=1024 (stale: Triton 3.6 != 3.9)")
    assert len(got) == 1 and got[0].startswith(f"tritune: {path} was tuned on {H100} (132 SMs, Triton 3.6)")
    # An entry of the running version wins over the stale one, silently.
    ggj.write_entries(path, [grouped_entry("3.9.0", tokens=1024)])
    with caught() as got:
        assert "stale" not in ggj.GroupedGemmStore([tmp_path]).lookup(
            H100, "3.9.0", 8, 256, 128, 2, "bf16", "gate_up", "forward", 1024, machine=MACHINE)[1]
    assert got == []


def test_grouped_file_of_another_device_is_skipped(tmp_path):
    path = ggj.store_path(tmp_path, H100)
    ggj.write_entries(path, [grouped_entry("3.9.0", name="NVIDIA H200")], device="NVIDIA H200")  # renamed in place
    with caught() as got:
        assert grouped_lookup(ggj.GroupedGemmStore([tmp_path]), MACHINE) is None
    assert len(got) == 1 and str(path) in got[0] and "not using it (tuned on NVIDIA H200" in got[0]


def test_user_store_checks_sms_and_triton(tmp_path):
    def put(path, triton_version, sm_count):
        store = UserKernelStore(path, kernel="k")
        store.put([UserEntry(H100, triton_version, {"n": 1}, "n=1", {"BLOCK": 64}, 1.0, "2025-01-01T00:00:00+00:00",
                             provenance={"sm_count": sm_count})])
        return store

    stale = put(tmp_path / "stale.json", "3.6.0", 132)
    with caught() as got:
        assert stale.lookup(H100, "n=1", machine=MACHINE).config == {"BLOCK": 64}
        assert stale.lookup(H100, "n=1", machine=MACHINE) is not None
    assert len(got) == 1 and "stale.json was tuned" in got[0] and "using it anyway (Triton 3.6 != 3.9)" in got[0]
    other = put(tmp_path / "other.json", "3.9.0", 114)
    with caught() as got:
        assert other.lookup(H100, "n=1", machine=MACHINE) is None
        assert other.lookup(H100, "n=1") is not None  # unchecked
    assert len(got) == 1 and "not using it (tuned with 114 SMs" in got[0]
