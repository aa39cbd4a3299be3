"""aot.compiler: target parsing, the JIT-equivalent specialization, and real AOT compiles for cuda:90 on a machine
with no GPU (a scale kernel that builds, a tl.dot tile that needs too much shared memory, a kernel Triton rejects).

The compiles go through `builder.compile_all`, whose spawned workers switch Triton's interpreter off (conftest.py
switches it on in this process when there is no GPU). A C compiler is required (CI has gcc): the generated glue
is compiled against Triton's header, so these tests fail rather than skip without one.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.runtime.driver import driver

from tritune.aot.builder import compile_all
from tritune.aot.compiler import (
    AotError,
    AotTarget,
    CompileJob,
    KernelArg,
    int_kind,
    kernel_args,
    signature_text,
    specialization,
    target_driver,
)
from tritune.aot.toolchain import CSRC_DIR, compile_object, cuda_include_dir

CUDA90 = AotTarget("cuda", 90, 32)

KERNELS = textwrap.dedent('''
    import triton
    import triton.language as tl


    @triton.jit
    def scale(x_ptr, out_ptr, alpha, n, one, BLOCK: tl.constexpr):
        # out = x * alpha; `one` is the integer 1, so it is compiled in and not passed to the launcher.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n * one
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha, mask=mask)


    @triton.jit
    def tile_dot(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


    @triton.jit
    def broken(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, 3), 1.0)  # arange needs a power-of-two length
''')

SCALE_ARGS = (KernelArg("x_ptr", "ptr", dtype="fp32"), KernelArg("out_ptr", "ptr", dtype="fp32"),
              KernelArg("alpha", "fp32", 0.125, specialize=False), KernelArg("n", "i32", 1024),
              KernelArg("one", "i32", 1), KernelArg("BLOCK", "constexpr", 128))
# fp16 128x128 A and B tiles of 64 deep, 8 stages: 7 x 32 KiB = 256 KiB > the 227 KiB cuda:90 allows.
DOT_PARAMS = (("BM", 128), ("BN", 128), ("BK", 64), ("num_warps", 4), ("num_stages", 8))
DOT_ARGS = (KernelArg("a_ptr", "ptr", dtype="fp16"), KernelArg("b_ptr", "ptr", dtype="fp16"),
            KernelArg("c_ptr", "ptr", dtype="fp32"), KernelArg("K", "i32", 4096),
            *(KernelArg(name, "constexpr", value) for name, value in DOT_PARAMS[:3]))


# ---------------------------------------------------------------------------------------------- AotTarget.parse

@pytest.mark.parametrize(("text", "expected"), [
    ("cuda:90", AotTarget("cuda", 90, 32)),  # H100/H200
    ("cuda:80", AotTarget("cuda", 80, 32)),  # A100
    ("cuda:90:32", AotTarget("cuda", 90, 32)),  # explicit warp size
])
def test_parse_accepts_cuda_targets(text, expected):
    target = AotTarget.parse(text)
    assert target == expected
    assert target.text == text[:7]
    assert target.max_shared_bytes == {90: 232448, 80: 166912}[target.arch]


@pytest.mark.parametrize("text", [
    "sm_90",  # nvcc spelling
    "cuda",  # no compute capability
    "cuda:6",  # one digit
    "hip:gfx942",  # another backend
    "",  # nothing
    "cuda:60",  # older than Triton supports
])
def test_parse_rejects_with_one_line_naming_the_text(text):
    with pytest.raises(AotError) as info:
        AotTarget.parse(text)
    message = str(info.value)
    assert f"target {text!r}" in message
    assert "\n" not in message


# ------------------------------------------------------------------------------------------- specialization

# Triton's JIT key of an int: ('constexpr', 1) for 1, (type, 'D') when divisible by 16, (type, '') otherwise.
_HINT_OF_KEY = {"D": 16, "": 0, None: 0}


@pytest.mark.parametrize("value", [0, 1, 7, 16, 48, 2**31 - 1, 2**33])
def test_int_specialization_matches_triton_jit(value):
    kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
    arg = KernelArg("v", int_kind(value), value)
    if kind == "constexpr":
        assert (key, specialization(arg)) == (1, 1)
        assert signature_text([arg]) == "i32:1"
        return
    assert arg.kind == kind  # i32, or i64 past 2**31 - 1
    assert specialization(arg) == _HINT_OF_KEY[key]
    assert signature_text([arg]) == (f"{kind}:16" if key == "D" else kind)


@pytest.mark.parametrize("value", [0, 1, 7, 16, 48, 2**31 - 1, 2**33])
def test_do_not_specialize_drops_hints_like_triton(value):
    kind, key = native_specialize_impl(BaseBackend, value, False, False, True)
    arg = KernelArg("v", int_kind(value), value, specialize=False)
    assert (kind, key) == (arg.kind, None)
    assert specialization(arg) == 0
    assert signature_text([arg]) == kind


def test_signature_text_in_declaration_order():
    # Pointers are 16-byte aligned; fp32 scalars get no hint; constexprs are their value.
    assert signature_text(SCALE_ARGS) == "*fp32:16, *fp32:16, fp32, i32:16, i32:1, 128"


# ---------------------------------------------------------------------------------------------- kernel_args

def test_kernel_args_in_declaration_order():
    n = KernelArg("n", "i32", 7)
    out = kernel_args(["x_ptr", "n", "BLOCK"], {"BLOCK": 64}, {"n": n, "x_ptr": SCALE_ARGS[0]})
    assert out == (SCALE_ARGS[0], n, KernelArg("BLOCK", "constexpr", 64))


def test_kernel_args_parameter_without_value():
    with pytest.raises(AotError, match=r"kernel parameter 'n' has neither a constexpr value nor a run-spec argument"):
        kernel_args(["x_ptr", "n", "BLOCK"], {"BLOCK": 64}, {"x_ptr": SCALE_ARGS[0]})


def test_kernel_args_extra_name():
    with pytest.raises(AotError, match=r"\['GROUP', 'm'\] are not parameters of the kernel"):
        kernel_args(["x_ptr", "BLOCK"], {"BLOCK": 64, "GROUP": 8}, {"x_ptr": SCALE_ARGS[0],
                                                                  "m": KernelArg("m", "i32", 3)})


# -------------------------------------------------------------------------------------------- target_driver

def test_target_driver_restores_previous_driver_even_on_error(monkeypatch):
    previous = object()
    monkeypatch.setattr(driver, "_active", previous)
    with pytest.raises(RuntimeError, match="boom"), target_driver(AotTarget.parse("cuda:80")):
        assert driver.active.get_current_target() == GPUTarget("cuda", 80, 32)
        assert driver.active.map_python_to_cpp_type("fp32") == "float"  # not Triton's `double`
        assert driver.active.map_python_to_cpp_type("i64") == "int64_t"
        raise RuntimeError("boom")
    assert driver._active is previous
    with target_driver(CUDA90):
        assert driver.active.get_current_target() == GPUTarget("cuda", 90, 32)
    assert driver._active is previous


# ------------------------------------------------------------------------------------------ compile_artifact

@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The three jobs compiled by two spawned workers, with a private Triton cache (nothing reused)."""
    root = tmp_path_factory.mktemp("aot_compile")
    source = root / "kernels.py"
    source.write_text(KERNELS)

    def job(ident: str, function: str, args, params) -> CompileJob:
        return CompileJob(ident, function, str(source), function, tuple(args), tuple(params), CUDA90,
                          str(root / "artifacts" / ident))

    jobs = [job("scale_B128", "scale", SCALE_ARGS, (("BLOCK", 128), ("num_warps", 4), ("num_stages", 3))),
            job("tile_dot_S8", "tile_dot", DOT_ARGS, DOT_PARAMS),
            job("broken_B4", "broken", (KernelArg("x_ptr", "ptr", dtype="fp32"), KernelArg("BLOCK", "constexpr", 4)),
                (("BLOCK", 4), ("num_warps", 4), ("num_stages", 3)))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root / "triton_cache"))
        seen = []
        results = compile_all(jobs, workers=2, progress=seen.append)
    assert sorted(r.artifact_id for r in seen) == sorted(j.artifact_id for j in jobs)
    return results


def _cubin(launcher: Path) -> bytes:
    """The cubin Triton's launcher embeds as `unsigned char CUBIN_NAME[n] = { 0x7f, ... };`."""
    m = re.search(r"unsigned char CUBIN_NAME\[(\d+)\] = \{([^}]*)\}", launcher.read_text())
    blob = bytes(int(x, 16) for x in m[2].split(","))
    assert len(blob) == int(m[1])
    return blob


def test_compile_scale_for_cuda90_without_gpu(compiled):
    res = compiled["scale_B128"]
    assert (res.status, res.error) == ("ok", "")
    assert res.signature == "*fp32:16, *fp32:16, fp32, i32:16, i32:1, 128"
    assert res.shared_bytes == 0
    assert re.fullmatch(r"tt_scale_[0-9a-f]{8}_0d1d3d4c", res.symbol)  # x, out, n divisible by 16; one constant
    cubin = _cubin(Path(res.files["c"]))
    assert cubin.startswith(b"\x7fELF") and b".target sm_90" in cubin  # compiled for the target, not this host
    header = Path(res.files["h"]).read_text()
    # fp32 scalars are `float`: Triton >= 3.4's template says `double`, but the cubin reads 4 bytes.
    assert (f"CUresult {res.symbol}(CUstream stream, CUdeviceptr x_ptr, CUdeviceptr out_ptr, float alpha, "
            "int32_t n);") in header
    assert "double" not in header


def test_glue_lists_params_argdescs_and_skips_the_constant_one(compiled):
    res = compiled["scale_B128"]
    glue = Path(res.files["glue"]).read_text()
    assert f'#include "{Path(res.files["h"]).name}"' in glue
    assert 'tritune_artifact_id = "scale_B128";' in glue
    assert 'tritune_kernel_name = "scale";' in glue
    assert 'tritune_target = "cuda:90";' in glue
    for line in ('{"BLOCK", 128LL}', '{"num_warps", 4LL}', '{"num_stages", 3LL}', "tritune_num_params = 3;",
                 "{\"x_ptr\", 'p', 16}", "{\"out_ptr\", 'p', 16}", "{\"alpha\", 'f', 0}", "{\"n\", 'i', 16}",
                 "{\"one\", 'i', 1}", "tritune_num_args = 5;"):
        assert line in glue
    assert (f"return {res.symbol}(stream, *(const CUdeviceptr *)values[0], *(const CUdeviceptr *)values[1], "
            "*(const float *)values[2], *(const int32_t *)values[3]);") in glue
    assert "values[4]" not in glue  # `one` is compiled in


def test_glue_compiles_against_tritons_header(compiled, tmp_path):
    res = compiled["scale_B128"]
    warnings = compile_object(Path(res.files["glue"]), tmp_path / "glue.o",
                              [CSRC_DIR, Path(res.files["h"]).parent, cuda_include_dir()])
    assert warnings == ""
    assert (tmp_path / "glue.o").stat().st_size > 0


def test_too_much_shared_memory_is_out_of_resources(compiled):
    res = compiled["tile_dot_S8"]
    assert res.status == "out_of_resources"
    assert res.shared_bytes > CUDA90.max_shared_bytes
    assert res.error == f"needs {res.shared_bytes} bytes of shared memory; cuda:90 allows 232448"


def test_kernel_that_fails_to_compile_is_a_compile_error(compiled):
    res = compiled["broken_B4"]
    assert res.status == "compile_error"
    assert res.error.startswith("CompilationError: ")
    assert "power of 2" in res.error
    assert "\n" not in res.error
    assert res.files == {} and res.symbol == ""
