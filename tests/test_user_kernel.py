"""tritune.tunable_kernel / UserKernel: construction errors, keys, grids, constraints, argument checks, pickling,
tune() through the engine on the CPU interpreter (store, reuse, force, the gate rejecting a wrong candidate),
run-time config choice, and the JSON store."""

from __future__ import annotations

import inspect
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from user_kernels_for_tests import _axpy_kernel, axpy, axpy_inputs, axpy_reference

import tritune
from tritune.device import current_device
from tritune.store.user_json import UserEntry, UserKernelStore, UserStoreError
from tritune.tuning.check import check_output
from tritune.tuning.journal import Journal
from tritune.tuning.tuner import journal_key
from tritune.tuning.types import Config, Status
from tritune.user import UserKernel, UserTunable, default_tolerance

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
DEVICE = current_device()
CPU = torch.device("cpu")
STORE_NAME = "_axpy_kernel.json"
P100 = {"n": 100, "dtype": "float16"}  # 4 candidates (BLOCK_SIZE 32/64 x BUG 0/1), 2 of them wrong
P20 = {"n": 20, "dtype": "float32"}  # BLOCK_SIZE 64 > 2n is pruned: 2 candidates, 1 wrong


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(autouse=True)
def _children_can_import(monkeypatch):
    # Spawned benchmark workers import tritune and user_kernels_for_tests (axpy is pickled by reference).
    monkeypatch.setenv("PYTHONPATH", _pythonpath())


def kernel(**changes) -> UserKernel:
    """An axpy UserKernel (not module level: fine for everything but tuning) with `changes` to its arguments."""
    kw = dict(space={"BLOCK_SIZE": (32, 64), "BUG": (0,), "num_warps": (4,)}, key=("n",), inputs=axpy_inputs,
              reference=axpy_reference, output="Out", grid=("cdiv(n, BLOCK_SIZE)",))
    kw.update(changes)
    return UserKernel(_axpy_kernel, **kw)


def journal_rows(path: Path) -> int:
    with Journal(path) as journal:
        return journal.count()


# ---- construction, keys, grids, constraints, arguments ------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(space={"n": (16, 32)}), "'n' is not a tl.constexpr parameter"),  # a runtime int argument
    (dict(space={"BLOCK": (16,)}), "'BLOCK' is not a parameter of the kernel"),
    (dict(space={"BLOCK_SIZE": ()}), "non-empty list"),
    (dict(output="Z"), "output 'Z'"),
    (dict(output="BLOCK_SIZE"), "output 'BLOCK_SIZE'"),  # a config parameter cannot be the output
    (dict(key=("n", "m")), "key name 'm'"),
    (dict(grid=("1", "1", "1", "1")), "1 to 3 expressions"),
    (dict(default={"BLOCK_SIZE": 32, "BUG": 0}), "default config sets"),  # num_warps missing
    (dict(name="my kernel"), "kernel name"),  # it names files
])
def test_construction_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        kernel(**changes)


def test_construction_needs_a_jit_function():
    with pytest.raises(TypeError, match="triton.jit"):
        UserKernel(axpy_reference, space={"BLOCK_SIZE": (32,)}, key=(), inputs=axpy_inputs,
                   reference=axpy_reference, output="Out", grid=("1",))


def test_tunable_kernel_takes_named_typed_parameters():
    params = inspect.signature(tritune.tunable_kernel).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())  # no **options bag
    assert [n for n, p in params.items() if p.default is inspect.Parameter.empty] == [
        "space", "key", "inputs", "reference", "output", "grid"]
    with pytest.raises(TypeError, match="spaces"):  # a misspelt option fails where it is written
        tritune.tunable_kernel(spaces={"BLOCK_SIZE": (32,)}, key="n", inputs=axpy_inputs, reference=axpy_reference,
                               output="Out", grid="cdiv(n, BLOCK_SIZE)")


def test_public_api_is_lazy_and_exported():
    assert tritune.UserKernel is UserKernel and isinstance(axpy, UserKernel)
    assert axpy.name == "_axpy_kernel" and axpy.kernel is _axpy_kernel
    assert axpy.key_names == ("n",) and axpy.output == "Out" and axpy.grid == ("cdiv(n, BLOCK_SIZE)",)
    code = "import sys, tritune; assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": _pythonpath()})


def test_key_text_is_stable_across_seeds_and_devices():
    cpu = axpy.make_args(P100, CPU, seed=0)
    assert axpy.key_text(cpu) == "n=100,X=float16,Y=float16,Out=float16"
    assert axpy.key_text(axpy.make_args(P100, CPU, seed=7)) == axpy.key_text(cpu)
    assert axpy.key_text(axpy.make_args(P100, "meta")) == axpy.key_text(cpu)
    assert axpy.key_of(cpu) == {"n": 100, "X": "float16", "Y": "float16", "Out": "float16"}
    problem = axpy.problem(P100)
    assert problem.key() == "_axpy_kernel:n=100,X=float16,Y=float16,Out=float16"
    assert pickle.loads(pickle.dumps(problem)) == problem
    with pytest.raises(ValueError, match="plain value"):
        axpy.problem({"n": 100, "dtype": "float16", "x": torch.ones(1)})


def test_grid_expressions_and_callables():
    args = axpy.make_args(P100, "meta")
    assert axpy.grid_for(args, Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4)) == (4,)  # cdiv(100, 32)
    assert axpy.grid_for(args, {"BLOCK_SIZE": 64, "BUG": 0, "num_warps": 4}) == (2,)
    numel = kernel(grid=("numel(X) / BLOCK_SIZE + max(1, BUG)",))
    assert numel.grid_for(args, Config.of(BLOCK_SIZE=32, BUG=0)) == (100 // 32 + 1,)
    as_callable = kernel(grid=lambda meta: (meta["n"] // meta["BLOCK_SIZE"] + 1,))
    assert as_callable.grid_for(args, Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4)) == (4,)
    with pytest.raises(ValueError, match="grid expression 'cdiv\\(n, BLOCKSIZE\\)' reads 'BLOCKSIZE'"):
        kernel(grid=("cdiv(n, BLOCKSIZE)",))  # a typo is caught when the kernel is declared
    with pytest.raises(ValueError, match="grid: expression \"cdiv\\(n,\""):
        kernel(grid=("cdiv(n,",))
    with pytest.raises(ValueError, match="division by zero"):
        kernel(grid=("n / (BLOCK_SIZE - 32)",)).grid_for(args, Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4))


def test_constraints_prune_per_problem():
    assert len(axpy.configs()) == 4  # without a problem a rule reading `n` cannot decide: nothing pruned
    assert len(axpy.configs(axpy.make_args(P100, "meta"))) == 4
    kept = axpy.configs(axpy.make_args(P20, "meta"))  # 64 > 2 * 20
    assert [c.as_dict() for c in kept] == [{"BLOCK_SIZE": 32, "BUG": b, "num_warps": 4} for b in (0, 1)]
    pruned = axpy.search_space(axpy.make_args(P20, "meta")).prune().pruned
    assert pruned == {"BLOCK_SIZE > 2 * n": 2}
    typo = kernel(constraints={"uses m": lambda m: m["m"] > 0})
    with pytest.raises(ValueError, match="constraint 'uses m' reads 'm'"):
        typo.configs(axpy.make_args(P100, "meta"))


def test_make_args_validates_and_seeds():
    a, b = axpy.make_args(P100, CPU, seed=3), axpy.make_args(P100, CPU, seed=3)
    assert torch.equal(a["X"], b["X"]) and not torch.equal(a["X"], axpy.make_args(P100, CPU, seed=4)["X"])
    assert list(a) == ["X", "Y", "Out", "n", "alpha"]  # the kernel's parameter order

    def without(name):
        return lambda p, d: {k: v for k, v in axpy_inputs(p, d).items() if k != name}

    with pytest.raises(ValueError, match="did not return kernel argument\\(s\\) 'alpha'"):
        kernel(inputs=without("alpha")).make_args(P100, CPU)
    with pytest.raises(ValueError, match="'Out'"):
        kernel(inputs=without("Out")).make_args(P100, CPU)
    with pytest.raises(ValueError, match="space parameter\\(s\\) 'BLOCK_SIZE'"):
        kernel(inputs=lambda p, d: {**axpy_inputs(p, d), "BLOCK_SIZE": 32}).make_args(P100, CPU)
    with pytest.raises(ValueError, match="'bogus', not argument"):
        kernel(inputs=lambda p, d: {**axpy_inputs(p, d), "bogus": 1}).make_args(P100, CPU)
    with pytest.raises(ValueError, match="output 'Out' is not a tensor"):
        kernel(inputs=lambda p, d: {**axpy_inputs(p, d), "Out": 0}).make_args(P100, CPU)


def test_pickled_by_reference():
    assert pickle.loads(pickle.dumps(axpy)) is axpy
    tunable = UserTunable(axpy)
    assert pickle.loads(pickle.dumps(tunable)).kernel is axpy
    with pytest.raises(pickle.PicklingError, match="define the tuned kernel at module level"):
        pickle.dumps(kernel())
    with pytest.raises(pickle.PicklingError, match="module level"):
        kernel().tune([P100])  # before any process is spawned


def test_tunable_protocol_pieces():
    tunable, problem = UserTunable(axpy), axpy.problem(P100)
    assert tunable.name == "_axpy_kernel"
    assert tunable.bytes_moved(problem) == 3 * 100 * 2  # X, Y, Out in fp16, each once
    assert math.isnan(tunable.flops(problem))
    assert tunable.tolerance(problem) == default_tolerance(torch.float16)
    assert (default_tolerance(torch.float16).atol, default_tolerance(torch.float32).atol) == (2e-2, 1e-4)
    tunable.compile(problem, Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4))  # interpreter: nothing to build
    inputs = tunable.make_inputs(problem, CPU, seed=0)
    ref = tunable.reference(problem, inputs)
    assert ref.dtype == torch.float32
    for bug, passed in ((0, True), (1, False)):
        out = tunable.alloc_output(problem, inputs)
        tunable.launcher(problem, inputs, Config.of(BLOCK_SIZE=64, BUG=bug, num_warps=4), out)()
        assert check_output(out, ref, tunable.tolerance(problem)).passed is passed


def test_inputs_that_cannot_run_on_meta_are_probed_on_the_cpu():
    def cpu_only(problem, device):
        if device.type == "meta":
            raise NotImplementedError("no generator on meta")
        return axpy_inputs(problem, device)

    k = kernel(inputs=cpu_only)
    assert k._meta_args(P100) is None
    assert k.problem(P100).key_text == "n=100,X=float16,Y=float16,Out=float16"
    assert UserTunable(k).bytes_moved(k.problem(P100)) == 600


def test_compile_warms_up_from_dtypes_on_a_gpu(monkeypatch):
    from triton.runtime.jit import MockTensor

    import tritune.user.tunable as uk

    calls = []
    monkeypatch.setattr(uk, "interpreting", lambda: False)  # as on a GPU machine
    monkeypatch.setattr(_axpy_kernel, "warmup", lambda **kw: calls.append(kw), raising=False)
    UserTunable(axpy).compile(axpy.problem(P100), Config.of(BLOCK_SIZE=64, BUG=0, num_warps=4))
    (kw,) = calls
    assert all(isinstance(kw[t], MockTensor) and kw[t].dtype == torch.float16 for t in ("X", "Y", "Out"))
    assert {k: kw[k] for k in ("n", "alpha", "BLOCK_SIZE", "BUG", "num_warps", "grid")} == dict(
        n=100, alpha=1.5, BLOCK_SIZE=64, BUG=0, num_warps=4, grid=(2,))


def test_tune_space_override_names_must_exist():
    with pytest.raises(ValueError, match="unknown search-space parameter"):
        axpy.tune([P100], space={"BLOCK_SIZE_Q": (16,)})


# ---- tune() through the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """axpy tuned twice with default settings into TRITUNE_CONFIG_DIR/user_kernels/ (P20 given twice)."""
    folder = tmp_path_factory.mktemp("tuned")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", _pythonpath())  # module scope: set up before the autouse fixture
        mp.setenv("TRITUNE_CONFIG_DIR", str(folder))
        axpy.reload()
        first = axpy.tune([P100, P20, dict(P20)])
        journal = folder / "user_kernels" / "_axpy_kernel.journal.sqlite"
        rows = journal_rows(journal)
        second = axpy.tune([P100, P20])
        rows_after = journal_rows(journal)
    return folder, first, second, rows, rows_after


def test_tune_persists_winners(tuned):
    folder, first, _, rows, _ = tuned
    store = folder / "user_kernels" / STORE_NAME
    assert [r.key_text for r in first] == ["n=100,X=float16,Y=float16,Out=float16",
                                           "n=20,X=float32,Y=float32,Out=float32"] + [first[1].key_text]
    assert first[2] == first[1]  # a repeated key is tuned once
    assert [(r.reused, r.measured, r.failed) for r in first[:2]] == [(False, 4, 2), (False, 2, 1)]
    assert rows == 6
    for r, p in zip(first, (P100, P20), strict=False):
        assert Config.from_dict(r.config) in axpy.configs(axpy.make_args(p, "meta"))
        assert r.config["BUG"] == 0 and 0 < r.time_us < math.inf  # the gate rejected every BUG=1 candidate
    doc = json.loads(store.read_text())
    assert (doc["format"], doc["version"], doc["kernel"]) == ("tritune-user-kernel", 1, "_axpy_kernel")
    assert len(doc["entries"]) == 2
    entry = next(e for e in doc["entries"] if e["key_text"] == first[0].key_text)
    assert set(entry) == {"device", "triton", "key", "key_text", "config", "time_us", "tuned_at", "source",
                          "provenance"}
    assert (entry["device"], entry["source"], entry["config"]) == (DEVICE.name, "jit", first[0].config)
    assert entry["key"] == {"n": 100, "X": "float16", "Y": "float16", "Out": "float16"}
    assert entry["provenance"]["triton_version"] == DEVICE.triton_version
    assert entry["provenance"]["kernel_source_sha256"] == axpy.source_hash()


def test_wrong_candidates_are_journaled_as_wrong_answers(tuned):
    folder = tuned[0]
    with Journal(folder / "user_kernels" / "_axpy_kernel.journal.sqlite") as journal:
        ms = journal.measurements(journal_key(DEVICE, axpy.problem(P100), UserTunable(axpy)))
    assert {c["BUG"]: m.status for c, m in ms.items() if c["BLOCK_SIZE"] == 32} == {0: Status.OK,
                                                                                    1: Status.WRONG_ANSWER}
    assert sorted(m.status.value for m in ms.values()) == ["ok", "ok", "wrong_answer", "wrong_answer"]


def test_second_tune_reuses_the_store(tuned):
    _, first, second, rows, rows_after = tuned
    assert [(r.reused, r.measured, r.failed) for r in second] == [(True, 0, 0), (True, 0, 0)]
    assert [(r.config, r.time_us) for r in second] == [(r.config, r.time_us) for r in first[:2]]
    assert rows_after == rows  # nothing measured, nothing journaled


def test_force_measures_again(tuned, tmp_path, monkeypatch):
    shutil.copytree(tuned[0] / "user_kernels", tmp_path / "user_kernels")
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path))
    journal = tmp_path / "user_kernels" / "_axpy_kernel.journal.sqlite"
    before = journal_rows(journal)
    (again,) = axpy.tune([P20], force=True)
    assert (again.reused, again.measured, again.failed, again.config["BUG"]) == (False, 2, 1, 0)
    assert journal_rows(journal) == before + 2
    entries = UserKernelStore(tmp_path / "user_kernels" / STORE_NAME).entries()
    assert len(entries) == 2  # replaced, not added


def test_run_uses_the_stored_config_and_falls_back_to_default(tuned, monkeypatch):
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tuned[0]))
    axpy.reload()
    launched = []
    monkeypatch.setattr(axpy, "launch", lambda args, config: (launched.append(config),
                                                              UserKernel.launch(axpy, args, config)))
    args = axpy.make_args(P100, CPU, seed=5)
    axpy(**args)
    assert launched == [Config.from_dict(tuned[1][0].config)]
    torch.testing.assert_close(args["Out"].float(), axpy_reference(args), atol=2e-2, rtol=2e-2)
    untuned = axpy.make_args({"n": 33, "dtype": "float16"}, CPU)
    axpy.run(**untuned)
    assert launched[-1] == Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4)  # first config of the pruned space
    torch.testing.assert_close(untuned["Out"].float(), axpy_reference(untuned), atol=2e-2, rtol=2e-2)
    axpy.reload()


def test_explicit_default_and_reload(tmp_path):
    k = kernel(default={"BLOCK_SIZE": 64, "BUG": 0, "num_warps": 4}, store=tmp_path / "k.json")
    args = k.make_args(P100, CPU)
    assert k.best_config(args) == Config.of(BLOCK_SIZE=64, BUG=0, num_warps=4)
    tuned = {"BLOCK_SIZE": 32, "BUG": 0, "num_warps": 4}
    UserKernelStore(k.store_path).put([UserEntry(DEVICE.name, "3.x", k.key_of(args), k.key_text(args), tuned, 1.0,
                                                 "2025-01-01T00:00:00+00:00", "aot")])
    assert k.best_config(args) == Config.of(BLOCK_SIZE=64, BUG=0, num_warps=4)  # cached per process
    k.reload()
    assert k.best_config(args) == Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4)


def test_default_store_path(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITUNE_CONFIG_DIR", raising=False)
    assert axpy.store_path == Path("tritune_tuned") / STORE_NAME
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path))
    assert axpy.store_path == tmp_path / "user_kernels" / STORE_NAME
    assert kernel(store=tmp_path / "x.json").store_path == tmp_path / "x.json"


# ---- the store -------------------------------------------------------------------------------------------------

def entry(key_text: str = "n=1", device: str = "dev", tuned_at: str = "2025-01-01T00:00:00+00:00",
          block: int = 32, source: str = "jit") -> UserEntry:
    return UserEntry(device, "3.9.0", {"n": 1}, key_text, {"BLOCK_SIZE": block}, 12.5, tuned_at, source,
                     {"note": "test"})


def test_store_merges_by_device_and_key(tmp_path):
    store = UserKernelStore(tmp_path / "sub" / "k.json", kernel="k")
    assert store.entries() == [] and store.lookup("dev", "n=1") is None
    store.put([entry(), entry("n=2"), entry(device="other")])
    store.put([entry(block=64, tuned_at="2025-06-01T00:00:00+00:00", source="aot"),
               entry("n=2", tuned_at="2024-01-01T00:00:00+00:00", block=128)])  # older: loses
    assert len(store.entries()) == 3
    assert store.lookup("dev", "n=1").config == {"BLOCK_SIZE": 64} and store.lookup("dev", "n=1").source == "aot"
    assert store.lookup("dev", "n=2").config == {"BLOCK_SIZE": 32}
    assert store.lookup("dev2", "n=1") is None
    assert json.loads(store.path.read_text())["kernel"] == "k"
    assert UserKernelStore(store.path).entries() == store.entries()


def test_store_lookup_takes_the_latest_of_duplicates(tmp_path):
    path = tmp_path / "k.json"
    doc = {"format": "tritune-user-kernel", "version": 1, "kernel": "k",
           "entries": [entry(block=b, tuned_at=t).to_json() for b, t in
                       ((16, "2025-03-01T00:00:00+00:00"), (64, "2025-05-01T00:00:00+00:00"),
                        (32, "2025-04-01T00:00:00+00:00"))]}
    path.write_text(json.dumps(doc))
    assert UserKernelStore(path).lookup("dev", "n=1").config == {"BLOCK_SIZE": 64}


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"format": "other", "version": 1, "kernel": "k", "entries": []}', "'format'"),
    ('{"format": "tritune-user-kernel", "version": 9, "kernel": "k", "entries": []}', "version 9"),
    ('{"format": "tritune-user-kernel", "version": 1, "kernel": "k", "entries": {}}', "'entries' must be a list"),
    ('{"format": "tritune-user-kernel", "version": 1, "kernel": "k", "entries": [{"device": "d"}]}',
     "entry 0 lacks 'triton'"),
])
def test_malformed_store_is_an_error_and_left_untouched(tmp_path, text, message):
    path = tmp_path / "k.json"
    path.write_text(text)
    with pytest.raises(UserStoreError, match=message) as err:
        UserKernelStore(path).put([entry()])
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_text() == text
    with pytest.raises(UserStoreError):
        UserKernelStore(path).lookup("dev", "n=1")


def test_store_of_another_kernel_is_not_merged_into(tmp_path):
    UserKernelStore(tmp_path / "k.json", kernel="k").put([entry()])
    with pytest.raises(UserStoreError, match="holds kernel 'k', not 'other'"):
        UserKernelStore(tmp_path / "k.json", kernel="other").put([entry()])


def test_run_with_a_malformed_store_warns_and_uses_the_default(tmp_path):
    (tmp_path / "k.json").write_text("[]")
    k = kernel(store=tmp_path / "k.json")
    args = k.make_args(P100, CPU)
    with pytest.warns(UserWarning, match="expected a JSON object"):
        assert k.best_config(args) == Config.of(BLOCK_SIZE=32, BUG=0, num_warps=4)
    assert (tmp_path / "k.json").read_text() == "[]"
