"""aot.manifest: a manifest survives a write/load round trip, and each kind of bad field fails with the file
and the field path."""

import copy
import json

import pytest

from tritune.aot.manifest import (
    ArtifactEntry,
    KernelEntry,
    Manifest,
    ManifestError,
    load_manifest,
    write_manifest,
)


def sample() -> Manifest:
    kernel = KernelEntry(name="moe_stage1", spec="specs/moe_stage1.spec",
                         source="tritune.kernels.fused_moe:_moe_gemm_kernel",
                         grid=["cdiv(EM, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N)", "1", "1"],
                         problem={"T": 1024, "E": 8, "topk": 2}, store={"kind": "fmoe", "cu_num": 132})
    ok = ArtifactEntry(id="moe_stage1_BM64_W4", kernel="moe_stage1",
                       params={"BLOCK_SIZE_M": 64, "num_warps": 4, "act": "silu", "scale": 0.5}, status="ok",
                       error="", symbol="moe_stage1_BM64_W4", signature="*bf16:16, i32", shared_bytes=98304,
                       files={"c": "artifacts/moe_stage1_BM64_W4/k.c", "binary": "bin/moe_stage1_BM64_W4"},
                       target="cuda:90", triton="3.6.0", compile_s=1.25)
    failed = ArtifactEntry(id="moe_stage1_BM256_W8", kernel="moe_stage1", params={"BLOCK_SIZE_M": 256},
                           status="compile_error", error="out of resources: shared memory", target="cuda:90",
                           triton="3.6.0", compile_s=0.5)
    return Manifest(created="2026-11-21T10:00:00Z", target="cuda:90", triton="3.6.0", torch="2.11.0",
                    tritune="0.1.0", build_host="builder", kernels={"moe_stage1": kernel}, artifacts=[ok, failed])


def test_round_trip(tmp_path):
    manifest = sample()
    path = write_manifest(tmp_path, manifest)
    assert path == tmp_path / "manifest.json"
    loaded = load_manifest(tmp_path)
    assert loaded == manifest
    assert json.loads(path.read_text())["format"] == "tritune-aot-bundle"
    assert loaded.artifact("moe_stage1_BM256_W8").status == "compile_error"
    assert Manifest.from_json(manifest.to_json(), "x") == manifest


def test_unknown_keys_are_ignored():
    obj = sample().to_json()
    obj["new_field"] = 1
    obj["artifacts"][0]["extra"] = "x"
    assert Manifest.from_json(obj, "m.json") == sample()


def mutate(fn):
    obj = copy.deepcopy(sample().to_json())
    fn(obj)
    return obj


def art(key, value):
    return lambda o: o["artifacts"][1].__setitem__(key, value)


def drop(key):
    return lambda o: o["artifacts"][1].pop(key)


@pytest.mark.parametrize("change, message", [
    (lambda o: o.update(format="other"), "format: expected 'tritune-aot-bundle', got 'other'"),
    (lambda o: o.update(version=2), "version: unsupported version 2"),
    (lambda o: o.update(version="1"), "version: expected an integer, got a string"),
    (lambda o: o.update(version=True), "version: expected an integer, got a boolean"),
    (lambda o: o.pop("created"), "created: missing"),
    (lambda o: o.update(target=90), "target: expected a string, got an integer"),
    (lambda o: o.update(kernels=[]), "kernels: expected an object, got an array"),
    (lambda o: o.update(artifacts={}), "artifacts: expected an array, got an object"),
    (lambda o: o["kernels"].update({"../evil": o["kernels"]["moe_stage1"]}), "kernels.../evil: kernel name"),
    (lambda o: o["kernels"]["moe_stage1"].update(spec="/etc/passwd"), "kernels.moe_stage1.spec: expected a relative"),
    (lambda o: o["kernels"]["moe_stage1"].update(grid=["1", "1"]), "kernels.moe_stage1.grid: expected 3"),
    (lambda o: o["kernels"]["moe_stage1"].update(grid=["1", 2, "1"]), "kernels.moe_stage1.grid[1]: expected a non"),
    (lambda o: o["kernels"]["moe_stage1"].update(problem=None), "kernels.moe_stage1.problem: expected an object"),
    (lambda o: o["kernels"]["moe_stage1"].pop("store"), "kernels.moe_stage1.store: missing"),
    (lambda o: o["artifacts"].__setitem__(1, "x"), "artifacts[1]: expected an object, got a string"),
    (art("params", [64]), "artifacts[1].params: expected an object, got an array"),
    (art("params", {"BLOCK_SIZE_M": True}), "artifacts[1].params.BLOCK_SIZE_M: expected an integer, a string"),
    (art("params", {"BLOCK_SIZE_M": None}), "artifacts[1].params.BLOCK_SIZE_M: expected an integer, a string"),
    (art("params", {"x": float("nan")}), "artifacts[1].params.x: expected"),
    (art("id", "a/b"), "artifacts[1].id: 'a/b' is not file-name safe"),
    (art("id", ".hidden"), "artifacts[1].id: '.hidden' is not file-name safe"),
    (art("id", "-rf"), "artifacts[1].id: '-rf' is not file-name safe"),
    (art("id", ""), "artifacts[1].id: '' is not file-name safe"),
    (art("id", "moe_stage1_BM64_W4"), "artifacts[1].id: duplicate id 'moe_stage1_BM64_W4' (also artifacts[0])"),
    (art("kernel", "moe_stage2"), "artifacts[1].kernel: unknown kernel 'moe_stage2' (kernels: moe_stage1)"),
    (art("status", "done"),
     "artifacts[1].status: expected one of ok, compile_error, out_of_resources, crashed, got 'done'"),
    (art("shared_bytes", -1), "artifacts[1].shared_bytes: expected an integer >= 0"),
    (art("compile_s", "1s"), "artifacts[1].compile_s: expected a finite number >= 0"),
    (art("files", {"binary": "../../bin/sh"}), "artifacts[1].files.binary: expected a relative path inside"),
    (art("files", {"binary": 3}), "artifacts[1].files.binary: expected a string, got an integer"),
    (drop("symbol"), "artifacts[1].symbol: missing"),
    (drop("error"), "artifacts[1].error: missing"),
])
def test_validation_errors_name_file_and_field(change, message):
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(mutate(change), "b/manifest.json")
    assert str(err.value).startswith("b/manifest.json: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_top_level_not_an_object():
    with pytest.raises(ManifestError, match=r"^m\.json: \(top level\): expected an object, got an array$"):
        Manifest.from_json([], "m.json")


def test_load_errors(tmp_path):
    with pytest.raises(ManifestError, match="manifest.json: no such file"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": ')
    with pytest.raises(ManifestError, match=r"manifest.json: not JSON: .* line 1, column 12"):
        load_manifest(tmp_path)


def test_write_refuses_a_bad_manifest_and_keeps_the_old_file(tmp_path):
    write_manifest(tmp_path, sample())
    before = (tmp_path / "manifest.json").read_text()
    bad = sample()
    bad.artifacts.append(copy.deepcopy(bad.artifacts[0]))
    with pytest.raises(ManifestError, match=r"artifacts\[2\]\.id: duplicate id"):
        write_manifest(tmp_path, bad)
    assert (tmp_path / "manifest.json").read_text() == before
