"""The stores' one base (store/files.py): every store the ops read (GEMM, grouped GEMM, fused MoE, user kernels)
searches TRITUNE_CONFIG_DIR then its shipped folder, reads each file once until reload, and skips a malformed file
with one warning naming the file and the problem, serving what the other files hold."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tritune import knobs
from tritune.device import current_device
from tritune.kernels.grouped_gemm_config import KernelConfigForward
from tritune.store import fmoe_csv as fc
from tritune.store import fmoe_rows as fr
from tritune.store import fmoe_table as ft
from tritune.store import gemm_json as gj
from tritune.store import grouped_gemm_json as ggj
from tritune.store.files import ConfigFiles
from tritune.store.user_json import UserEntry, UserKernelStore
from tritune.tuning.types import Config
from tritune.user.store import StoredConfigs

DEVICE = "NVIDIA H100 80GB HBM3"
PROV = {"name": DEVICE, "sm_count": 132, "triton_version": "3.9", "torch_version": "2.13"}
BAD_JSON = "{not json"


def malformed_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "skipping malformed" in str(w.message)]


def check_one_warning(caught, kind: str, path: Path, problem: str) -> None:
    found = malformed_warnings(caught)
    assert len(found) == 1, found
    assert found[0].startswith(f"tritune: skipping malformed {kind} config file: {path}") and problem in found[0]
    assert "\n" not in found[0]


@pytest.fixture
def folders(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the user's TRITUNE_CONFIG_DIR, a second folder standing for the shipped one)."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(knobs.CONFIG_DIR, str(user))
    return user, shipped


def test_gemm_store_skips_a_malformed_file_with_one_warning(folders, monkeypatch):
    user, shipped = folders
    monkeypatch.setattr(gj, "PACKAGE_DIR", shipped)
    good = Config.of(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    gj.write_shape_file(shipped, PROV, "BF16", 64, 64, {16: gj.GemmEntry(16, good, 1.0, 1.0, 1.0, 0.0)})
    bad = user / gj.shape_file_name(gj.slug_of(DEVICE), "BF16", 64, 64)
    bad.write_text(BAD_JSON)
    store = gj.GemmConfigStore()
    assert store.folders() == [user, shipped]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.lookup(gj.slug_of(DEVICE), "BF16", 16, 64, 64)[0] == good  # the shipped file serves
        assert store.lookup(gj.slug_of(DEVICE), "BF16", 32, 64, 64)[0] == good  # the bad file is not read again
    check_one_warning(caught, "GEMM", bad, "not valid JSON")


def test_grouped_gemm_store_skips_a_malformed_file_with_one_warning(folders, monkeypatch):
    user, shipped = folders
    monkeypatch.setattr(ggj, "PACKAGE_DIR", shipped)
    fields = KernelConfigForward(BLOCK_SIZE_M=64).to_dict()
    ggj.write_entries(ggj.store_path(shipped, DEVICE), [ggj.GroupedGemmEntry(
        triton="3.9", num_experts=8, n=256, k=128, topk=2, dtype="bf16", gemm="gate_up", kernel="forward",
        tokens=64, config=fields, us=1.0, torch_us=2.0, baseline="torch", provenance=PROV)])
    bad = ggj.store_path(user, DEVICE)
    bad.write_text('{"device": "' + DEVICE + '", "entries": [{"triton": "3.9"}]}')
    store = ggj.GroupedGemmStore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in (64, 32):
            assert store.lookup(DEVICE, "3.9", 8, 256, 128, 2, "bf16", "gate_up", "forward", tokens)[0] == fields
    check_one_warning(caught, "grouped-GEMM", bad, "entries[0]: missing field(s)")


def test_fused_moe_table_skips_a_malformed_file_with_one_warning(folders, monkeypatch):
    # It used to raise from the op: a bad row in one file now costs that file only, as in every other store.
    user, shipped = folders
    shape = fr.FmoeShape(token=16, model_dim=64, inter_dim=32, expert=4, topk=2, act_type="silu", dtype="bf16",
                         q_dtype_a="bf16", q_dtype_w="bf16", q_type="none", use_g1u1=True, doweight_stage1=False)
    good = fr.FmoeTuned(cu_num=132, shape=shape, block_m=16, ksplit=1, us1=1.0, kernelName1="k1", err1=0.0,
                        us2=1.0, kernelName2="k2", err2=0.0, us=2.0, run_1stage=False, tflops=1.0, bw=1.0)
    fc.write_tuned(shipped / "tuned_fmoe.csv", [good])
    bad = user / fc.USER_FILE_NAME
    bad.write_text(fc.tuned_csv_text([good]).replace(",16,1,1.00,k1,", ",abc,1,1.00,k1,"))
    monkeypatch.setenv(knobs.CONFIG_FMOE, str(shipped / "tuned_fmoe.csv"))
    ft.reload_fmoe_configs()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ft.default_table().rows == [good]
            assert ft.default_table().lookup(132, shape, 16) == good
        check_one_warning(caught, "fused-MoE", bad, "row 1 (line 2), column 'block_m': bad value 'abc'")
    finally:
        ft.reload_fmoe_configs()


def test_user_kernel_store_skips_a_malformed_file_with_one_warning(tmp_path):
    here = current_device()
    bad = tmp_path / "k.json"
    bad.write_text(BAD_JSON)
    stored = StoredConfigs("k", frozenset({"BLOCK"}), bad)
    default = Config.of(BLOCK=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stored.config_for(here.name, "n=1", lambda: default) == default
        assert stored.config_for(here.name, "n=2", lambda: default) == default  # another key: not read again
    check_one_warning(caught, "user-kernel", bad, "not valid JSON")
    bad.unlink()
    UserKernelStore(bad, "k").put([UserEntry(here.name, here.triton_version, {"n": 3}, "n=3", {"BLOCK": 64}, 1.0,
                                             "2025-01-01T00:00:00+00:00", provenance=here.provenance())])
    assert stored.config_for(here.name, "n=3", lambda: default) == default  # the file is read once until reload
    stored.reload()
    assert stored.config_for(here.name, "n=3", lambda: default) == Config.of(BLOCK=64)


def test_a_bad_config_dir_is_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv(knobs.CONFIG_DIR, str(tmp_path / "missing"))
    monkeypatch.setattr(gj, "PACKAGE_DIR", tmp_path)
    with pytest.warns(UserWarning, match="tritune: ignoring"):
        assert gj.GemmConfigStore().folders() == [tmp_path]


def test_the_base_reads_each_file_once_until_reload(tmp_path):
    reads = []

    class Counting(ConfigFiles[str]):
        KIND = "test"

        def read(self, path: Path) -> str:
            reads.append(path)
            return path.read_text()

    path = tmp_path / "a.txt"
    path.write_text("one")
    files = Counting([tmp_path])
    assert files.folders() == [tmp_path] and files.parsed(path) == "one" and files.parsed(path) == "one"
    assert files.parsed(tmp_path / "absent.txt") is None and reads == [path]
    path.write_text("two")
    assert files.parsed(path) == "one"
    files.reload()
    assert files.parsed(path) == "two" and reads == [path, path]
