"""The grouped-GEMM store file: round trip, merge-replace under one key, malformed files named with the field at
fault, and the lookup rules (exact match but for tokens; nearest tuned token count within 4x; folder order)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from tritune.kernels.grouped_gemm_config import (
    CONFIG_CLASSES,
    KernelConfigBackward_dW,
    KernelConfigBackward_dX,
    KernelConfigForward,
    launch_config,
)
from tritune.store import grouped_gemm_json as store
from tritune.store.grouped_gemm_json import (
    GroupedGemmEntry,
    GroupedGemmStore,
    read_entries,
    reload_grouped_gemm_configs,
    store_path,
    write_entries,
)

DEVICE = "NVIDIA H100 80GB HBM3"
PROV = {"name": DEVICE, "capability": "9.0", "triton_version": "3.6.0"}
FWD = KernelConfigForward(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, num_warps=8, num_stages=3,
                          permute_x=True, use_tma_load_w=True)
DX = KernelConfigBackward_dX(BLOCK_SIZE_M=128, permute_y=True, use_tma_load_w=True, use_tma_store=True)


def entry(**overrides) -> GroupedGemmEntry:
    # The store holds a kernel's config as its fields (KernelConfig.to_dict()); the op builds it with launch_config.
    fields = dict(triton="3.6.0", num_experts=128, n=1536, k=2048, topk=8, dtype="bf16", gemm="gate_up",
                  kernel="forward", tokens=1024, config=FWD, us=100.0, torch_us=150.0,
                  baseline="torch._grouped_mm + torch permute", provenance=PROV)
    fields.update(overrides)
    return GroupedGemmEntry(**{**fields, "config": fields["config"].to_dict()})


def lookup(s: GroupedGemmStore, tokens: int, **overrides):
    """The store's answer with the config built as the op builds it: (KernelConfig, where), or None."""
    args = dict(device_name=DEVICE, triton_version="3.6.0", num_experts=128, n=1536, k=2048, topk=8, dtype="bf16",
                gemm="gate_up", kernel="forward", tokens=tokens)
    args.update(overrides)
    found = s.lookup(**args)
    return None if found is None else (launch_config(args["kernel"], found[0]), found[1])


def test_file_name_and_round_trip(tmp_path):
    path = store_path(tmp_path, DEVICE)
    assert path.name == "NVIDIA_H100_80GB_HBM3-GROUPED_GEMM.json"
    entries = [entry(), entry(gemm="down", kernel="dX", n=2048, k=768, config=DX, us=float("inf"))]
    assert write_entries(path, entries) == path
    doc = json.loads(path.read_text())
    assert doc["device"] == DEVICE and len(doc["entries"]) == 2
    first = doc["entries"][1]  # sorted: down before gate_up
    assert first["config_class"] == "KernelConfigForward" and first["config"]["use_tma_load_w"] is True
    assert first["provenance"] == PROV and first["triton"] == "3.6.0" and first["tokens"] == 1024
    assert doc["entries"][0]["us"] is None  # inf written as null
    back = read_entries(path)
    assert back[1] == entries[0] and launch_config("dX", back[0].config) == DX and back[0].us != back[0].us  # nan


def test_merge_replaces_the_same_key_and_keeps_the_rest(tmp_path):
    path = store_path(tmp_path, DEVICE)
    write_entries(path, [entry(), entry(tokens=4096, us=300.0), entry(dtype="fp16")])
    faster = entry(us=80.0, config=replace(FWD, num_stages=4))
    write_entries(path, [faster, entry(triton="3.7.0")])
    by_key = {e.key(): e for e in read_entries(path)}
    assert len(by_key) == 4  # tokens 1024 replaced; 4096, fp16 kept; a new Triton version added
    assert by_key[entry().key()] == faster
    assert by_key[entry(tokens=4096).key()].us == 300.0


def test_write_refuses_another_devices_file_and_leaves_it(tmp_path):
    path = store_path(tmp_path, DEVICE)
    write_entries(path, [entry()])
    before = path.read_bytes()
    with pytest.raises(ValueError, match="'NVIDIA H200'"):
        write_entries(path, [entry(tokens=8)], device="NVIDIA H200")
    assert path.read_bytes() == before


def _doc(**entry_overrides) -> dict:
    rec = entry().to_dict()
    rec.update(entry_overrides)
    return {"device": DEVICE, "entries": [rec]}


@pytest.mark.parametrize(("content", "expected"), [
    ("{not json", "not valid JSON"),
    ('["a list"]', "top level is not an object"),
    (json.dumps({"entries": []}), "field 'device'"),
    (json.dumps({"device": DEVICE, "entries": {}}), "field 'entries'"),
    (json.dumps({"device": DEVICE, "entries": [{"triton": "3.6.0"}]}), "entries[0]: missing field(s) num_experts"),
    (json.dumps(_doc(n=0)), "entries[0]: field 'n': 0"),
    (json.dumps(_doc(dtype="fp8")), "field 'dtype': 'fp8'"),
    (json.dumps(_doc(gemm="up")), "field 'gemm': 'up'"),
    (json.dumps(_doc(kernel="dx")), "field 'kernel': 'dx'"),
    (json.dumps(_doc(config_class="KernelConfigBackward_dW")), "field 'config_class'"),
    (json.dumps(_doc(config={})), "field 'config'"),
    (json.dumps(_doc(config={"BLOCK_SIZE_M": "64"})), "BLOCK_SIZE_M='64'"),
    (json.dumps(_doc(config={"BLOCK_SIZE_M": 0})), "BLOCK_SIZE_M=0"),
    (json.dumps(_doc(us="fast")), "field 'us'"),
    (json.dumps({"device": DEVICE, "entries": [entry().to_dict(), entry().to_dict()]}), "entries[1] repeats"),
])
def test_malformed_file_names_the_file_and_the_field(tmp_path, content, expected):
    path = store_path(tmp_path, DEVICE)
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        read_entries(path)
    assert str(path) in str(info.value) and expected in str(info.value)
    with pytest.raises(ValueError) as info:  # a merge never overwrites what it cannot read
        write_entries(path, [entry()])
    assert str(path) in str(info.value)
    assert path.read_text() == content


def test_entry_names_its_kernels_config_class_and_the_kernel_checks_the_fields():
    # The file names each kernel's config class as the kernels define it; the fields are the kernel's to judge, where
    # the op builds the config (an unknown field or a value of the wrong type is a ValueError naming it).
    assert store.CONFIG_CLASS_NAMES == {kernel: cls.__name__ for kernel, cls in CONFIG_CLASSES.items()}
    assert entry(kernel="dW", config=KernelConfigBackward_dW()).to_dict()["config_class"] == "KernelConfigBackward_dW"
    with pytest.raises(ValueError, match=r"unknown KernelConfigBackward_dW field\(s\) \['use_tma_load_w'\]"):
        launch_config("dW", entry(kernel="dW").config)  # a forward config's fields
    with pytest.raises(ValueError, match=r"unknown KernelConfigForward field\(s\) \['BLOCK_M'\]"):
        launch_config("forward", {"BLOCK_M": 64})
    with pytest.raises(ValueError, match="KernelConfigForward: flatten=1 is not a bool"):
        launch_config("forward", {"flatten": 1})


def test_lookup_exact_match_on_everything_but_tokens(tmp_path):
    write_entries(store_path(tmp_path, DEVICE), [entry(), entry(tokens=16, config=replace(FWD, num_warps=4))])
    s = GroupedGemmStore([tmp_path])
    config, where = lookup(s, 1024)
    assert config == FWD and str(store_path(tmp_path, DEVICE)) in where and "tokens=1024" in where
    assert "nearest" not in where
    for other in (dict(triton_version="3.7.0"), dict(num_experts=64), dict(n=1024), dict(k=4096), dict(topk=4),
                  dict(dtype="fp16"), dict(gemm="down"), dict(kernel="dX"), dict(device_name="NVIDIA H200")):
        assert lookup(s, 1024, **other) is None, other


def test_lookup_nearest_token_count_within_four_times(tmp_path):
    write_entries(store_path(tmp_path, DEVICE), [entry(), entry(tokens=16, config=replace(FWD, num_warps=4))])
    s = GroupedGemmStore([tmp_path])
    assert lookup(s, 4096)[0] == FWD and "nearest tuned to 4096" in lookup(s, 4096)[1]  # exactly 4x
    assert lookup(s, 256)[0] == FWD  # 4x below 1024, 16x above 16
    assert lookup(s, 4097) is None  # beyond 4x
    assert lookup(s, 4)[0].num_warps == 4 and lookup(s, 3) is None  # 16 serves 4..64
    assert lookup(s, 128) is None  # 8x from both tuned counts
    with pytest.raises(ValueError, match="tokens"):
        lookup(s, 0)


def test_lookup_ties_go_to_the_first_folder_then_the_larger_count(tmp_path):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    low = replace(FWD, num_warps=4)
    write_entries(store_path(user, DEVICE), [entry(tokens=512, config=low)])
    other_512 = entry(tokens=512, config=replace(low, flatten=False))
    write_entries(store_path(shipped, DEVICE), [entry(tokens=2048), other_512])
    assert lookup(GroupedGemmStore([shipped]), 1024)[0] == FWD  # 512 and 2048 both 2x away: the larger count
    s = GroupedGemmStore([user, shipped])
    assert lookup(s, 512)[0] == low and str(user) in lookup(s, 512)[1]  # the user's file shadows the shipped one
    assert lookup(s, 1024)[0] == low  # a tie across folders: the earlier folder
    assert lookup(s, 2048)[0] == FWD  # an exact match in a later folder beats a near one in an earlier


def test_malformed_file_warns_and_is_skipped_at_lookup(tmp_path):
    bad, good = tmp_path / "bad", tmp_path / "good"
    bad.mkdir()
    store_path(bad, DEVICE).write_text('{"device": 1}')
    write_entries(store_path(good, DEVICE), [entry()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lookup(GroupedGemmStore([bad, good]), 1024)[0] == FWD
    assert any(str(store_path(bad, DEVICE)) in str(w.message) for w in caught)


def test_default_store_reads_config_dir_and_reload(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "_DEFAULT", store.ProcessWide(store.GroupedGemmStore))
    s = store.default_store()
    assert s is store.default_store() and s.folders() == [tmp_path, store.PACKAGE_DIR]
    assert lookup(s, 1024) is None
    write_entries(store_path(tmp_path, DEVICE), [entry()])
    assert lookup(s, 1024) is None  # cached until reloaded
    reload_grouped_gemm_configs()
    assert lookup(s, 1024)[0] == FWD


def test_package_folder_exists():
    assert store.PACKAGE_DIR == Path(store.__file__).parent.parent / "configs" / "grouped_gemm"
    assert store.PACKAGE_DIR.is_dir()
