"""The generic main (aot/csrc/main.c) built with a stub glue, on a machine with no GPU: it compiles warning-free,
its --dry-run agrees with tritune.aot.spec.resolve, and every failure exits with the code docs/AOT.md gives.

A C compiler is required (CI has gcc): without one these tests fail rather than skip.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_aot_spec import MOE_ARGDESCS, MOE_PARAMS, MOE_SPEC, expected_resolution, make_moe_bundle

from tritune.aot.spec import RunSpec, SpecError, check_specialization, resolve
from tritune.aot.tdat import TDAT_DTYPES, TdatError, write_tensor
from tritune.aot.toolchain import CSRC_DIR, MAIN_SOURCES, ToolchainError, compile_executable, cuda_include_dir
from tritune.expr import ExprError, evaluate

ARTIFACT_ID = "moe_stage1_BM64_BN128_BK64_GM8_W4_S3"
RESULT_KEYS = [
    "artifact",
    "valid",
    "max_abs_err",
    "mismatch_ratio",
    "rel_l2",
    "median_us",
    "min_us",
    "max_us",
    "reps",
    "grid",
    "error",
]

# Stands in for Triton's generated launcher: calls exit() without including <stdlib.h>, as its template does.
FAKE_LAUNCHER = """
#include <stdio.h>
#include <cuda.h>
CUresult fake_kernel(CUstream stream) {
    if (stream == (CUstream)1) exit(209); /* never taken; links to the main's exit hook */
    return CUDA_SUCCESS;
}
"""


def _glue(argdescs) -> str:
    params = ", ".join(f'{{"{k}", {v}}}' for k, v in MOE_PARAMS.items())
    args = ", ".join(f"{{\"{name}\", '{kind}', {hint}}}" for name, kind, hint in argdescs)
    return f"""#include "tritune_artifact.h"
CUresult fake_kernel(CUstream stream);
const char *const tritune_artifact_id = "{ARTIFACT_ID}";
const char *const tritune_kernel_name = "moe_stage1";
const char *const tritune_target = "cuda:90";
const tritune_param tritune_params[] = {{{params}}};
const int tritune_num_params = {len(MOE_PARAMS)};
const tritune_argdesc tritune_args[] = {{{args}}};
const int tritune_num_args = {len(argdescs)};
CUresult tritune_launch(CUstream stream, void *const *values) {{
    (void)values;
    return fake_kernel(stream);
}}
"""


def _require_cc() -> str:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.fail(f"no C compiler ({os.environ.get('CC', 'cc')} not on PATH): the AOT main cannot be tested")
    return cc


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> Path:
    """The main linked with the MoE stub glue, built as a bundle's Makefile would (header force-included)."""
    _require_cc()
    work = tmp_path_factory.mktemp("build")
    (work / "glue.c").write_text(_glue(MOE_ARGDESCS))
    (work / "launcher.c").write_text(FAKE_LAUNCHER)
    sources = [CSRC_DIR / name for name in MAIN_SOURCES] + [work / "glue.c", work / "launcher.c"]
    output = work / "bin" / ARTIFACT_ID
    diagnostics = compile_executable(sources, output, [CSRC_DIR, cuda_include_dir()], CSRC_DIR / "tritune_artifact.h")
    assert diagnostics == "", f"the main compiled with warnings:\n{diagnostics}"
    return output


@pytest.fixture
def bundle(tmp_path) -> tuple[Path, dict[str, int]]:
    return tmp_path, make_moe_bundle(tmp_path)


def _run(exe: Path, bundle: Path, *extra: str, spec: str = "specs/moe_stage1.spec", cwd: Path | None = None):
    command = [str(exe), "--bundle", str(bundle), "--spec", spec, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd)


def _last_json(stdout: str, prefix: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines and lines[-1].startswith(prefix + " "), f"last stdout line is not {prefix}: {stdout!r}"
    return json.loads(lines[-1][len(prefix) + 1 :])


def test_the_main_compiles_without_warnings_under_strict_flags(tmp_path):
    # Each source on its own (the fixture links them together), pedantic enough to catch sloppy C.
    _require_cc()
    for name in MAIN_SOURCES:
        command = [
            shutil.which(os.environ.get("CC", "cc")),
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Wshadow",
            "-Wformat=2",
            f"-I{cuda_include_dir()}",
            f"-I{CSRC_DIR}",
            "-c",
            str(CSRC_DIR / name),
            "-o",
            str(tmp_path / (name + ".o")),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0 and done.stderr == "", f"{name}:\n{done.stderr}"


def test_the_header_makes_a_launcher_calling_exit_compile(tmp_path):
    _require_cc()
    (tmp_path / "launcher.c").write_text(FAKE_LAUNCHER)
    for defines in ([], ["-DTRITUNE_NO_EXIT_HOOK"]):
        command = [
            shutil.which(os.environ.get("CC", "cc")),
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            *defines,
            f"-I{cuda_include_dir()}",
            "-include",
            str(CSRC_DIR / "tritune_artifact.h"),
            "-c",
            str(tmp_path / "launcher.c"),
            "-o",
            str(tmp_path / "launcher.o"),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_the_headers_exit_hook_catches_the_launchers_exit(tmp_path):
    # Triton's launcher exits with a CUresult as the status; through the hook the main can answer exit 4.
    _require_cc()
    (tmp_path / "launcher.c").write_text(FAKE_LAUNCHER)
    (tmp_path / "hook_main.c").write_text(
        "#include <unistd.h>\n"
        "CUresult fake_kernel(CUstream stream);\n"
        'void tritune_launcher_exit(int status) { printf("hooked %d\\n", status); fflush(stdout); _exit(4); }\n'
        "int main(void) { fake_kernel((CUstream)1); return 0; }\n"
    )
    output = tmp_path / "hook"
    sources = [tmp_path / "launcher.c", tmp_path / "hook_main.c"]
    assert compile_executable(sources, output, [cuda_include_dir()], CSRC_DIR / "tritune_artifact.h") == ""
    done = subprocess.run([str(output)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (4, "hooked 209\n")


def test_compile_failure_raises_with_the_compiler_output(tmp_path):
    _require_cc()
    (tmp_path / "broken.c").write_text("int main(void) { return missing_symbol_xyz; }\n")
    with pytest.raises(ToolchainError, match="missing_symbol_xyz"):
        compile_executable([tmp_path / "broken.c"], tmp_path / "broken", [])


def test_dry_run_agrees_with_python_resolve(exe, bundle, tmp_path_factory):
    root, sizes = bundle
    # Run from elsewhere: the spec path is found relative to the bundle.
    done = _run(exe, root, "--dry-run", cwd=tmp_path_factory.mktemp("elsewhere"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    dry = _last_json(done.stdout, "TRITUNE_DRYRUN")
    resolved = resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root)
    check_specialization(resolved, MOE_ARGDESCS)
    assert dry["artifact"] == ARTIFACT_ID
    assert dry["kernel"] == "moe_stage1"
    assert dry["params"] == MOE_PARAMS
    assert dry["values"] == resolved.values
    assert dry["args"] == {**resolved.int_args, **resolved.float_args}
    assert tuple(dry["grid"]) == resolved.grid
    # ... and both agree with the sizes worked out by hand.
    expected = expected_resolution(sizes)
    assert dry["values"] == expected["values"]
    assert tuple(dry["grid"]) == expected["grid"]


def test_dry_run_of_a_python_written_spec(exe, bundle):
    # to_text reorders values after the args they read; the main must accept what Python writes.
    root, _ = bundle
    (root / "specs" / "rewritten.spec").write_text(RunSpec.parse(MOE_SPEC).to_text())
    done = _run(exe, root, "--dry-run", spec=str(root / "specs" / "rewritten.spec"))
    assert done.returncode == 0, done.stderr
    assert (
        tuple(_last_json(done.stdout, "TRITUNE_DRYRUN")["grid"])
        == resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root).grid
    )


def _write_spec(root: Path, text: str) -> str:
    (root / "specs" / "edited.spec").write_text(text)
    return "specs/edited.spec"


def test_missing_data_file_exits_3_naming_it(exe, bundle):
    root, _ = bundle
    (root / "data" / "expert_ids.BLOCK_SIZE_M=64.tdat").unlink()
    for extra in (["--dry-run"], ["--reps", "2"]):
        done = _run(exe, root, *extra)
        assert done.returncode == 3, done.stderr
        assert "expert_ids.BLOCK_SIZE_M=64.tdat: no such file" in done.stderr
    assert _last_json(done.stdout, "TRITUNE_RESULT")["valid"] is False
    with pytest.raises(TdatError, match="expert_ids"):
        resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root)


def test_malformed_data_file_exits_3(exe, bundle):
    root, _ = bundle
    path = root / "data" / "a.tdat"
    path.write_bytes(path.read_bytes()[:-3])
    done = _run(exe, root, "--dry-run")
    assert done.returncode == 3
    assert "a.tdat: payload too short" in done.stderr
    with pytest.raises(TdatError, match="payload too short"):
        resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root)


@pytest.mark.parametrize(
    "old, new, line, match",
    [
        ("value\tT\t32", "value\tT\tcdiv(32,", 4, "expected a number"),
        ("arg\tK\ti32\t64", "arg\tK\tint\t64", 17, "unknown role 'int'"),
        ("value\ttopk\t2", "value\ttopk\t2\textra", 5, "takes 2 TAB-separated fields"),
        ("value\tT\t32", "value\tT\ttopk * 16", 4, "'topk' is used before its definition on line 5"),
        ("tritune-spec 1", "tritune-spec 9", 1, "first line must be"),
    ],
)
def test_spec_errors_exit_2_naming_the_line(exe, bundle, old, new, line, match):
    root, _ = bundle
    text = MOE_SPEC.replace(old, new, 1)
    spec = _write_spec(root, text)
    done = _run(exe, root, "--dry-run", spec=spec)
    assert done.returncode == 2, done.stderr
    assert f"specs/edited.spec:{line}: " in done.stderr and match in done.stderr, done.stderr
    with pytest.raises(SpecError, match=f":{line}: .*{match}"):
        RunSpec.parse(text, "specs/edited.spec")


def test_evaluation_errors_exit_2(exe, bundle):
    root, _ = bundle
    text = MOE_SPEC.replace("value\tT\t32", "value\tT\t32 / (2 - 2)")
    done = _run(exe, root, "--dry-run", spec=_write_spec(root, text))
    assert done.returncode == 2
    assert "division by zero" in done.stderr
    with pytest.raises(SpecError, match="division by zero"):
        resolve(RunSpec.parse(text), MOE_PARAMS, root)


@pytest.mark.parametrize(
    "old, new, match",
    [
        ("arg\tN\ti32\t128", "arg\tN\ti32\t100", "'N' = 100 breaks the artifact's specialization (divisible by 16)"),
        ("arg\tstride_ak\ti32\t1", "arg\tstride_ak\ti32\t2", "(equal to 1)"),
        ("arg\tscale\tf32\t0.5", "arg\tscale\ti32\t1", "is given a spec arg of role i32"),
        ("arg\tscale\tf32\t0.5", "arg\tscale\tf32\t0.5\narg\textra\ti32\t1", "'extra' is not an argument"),
        ("arg\tscale\tf32\t0.5\n", "", "artifact argument 'scale' has no spec arg"),
        ("kernel\tmoe_stage1", "kernel\tmoe_stage2", "spec is for kernel 'moe_stage2'"),
        ("\t1\t1\n", "\t0\t1\n", "grid[1] = 0 is outside"),
    ],
)
def test_spec_that_does_not_fit_the_artifact_exits_5(exe, bundle, old, new, match):
    root, _ = bundle
    text = MOE_SPEC.replace(old, new, 1)
    done = _run(exe, root, "--dry-run", spec=_write_spec(root, text))
    assert done.returncode == 5, done.stderr
    assert match in done.stderr
    if "kernel" not in old:  # the kernel name is the builder's business, not check_specialization's
        with pytest.raises(SpecError):
            check_specialization(resolve(RunSpec.parse(text), MOE_PARAMS, root), MOE_ARGDESCS)


@pytest.mark.parametrize(
    "args",
    [
        ["--bogus"],
        ["--reps", "0"],
        ["--reps", "ten"],
        ["--warmup"],
    ],
)
def test_usage_errors_exit_2(exe, bundle, args):
    root, _ = bundle
    done = _run(exe, root, *args)
    assert done.returncode == 2
    assert done.stderr.startswith("tritune: ")
    done = subprocess.run([str(exe), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--bundle and --spec are required" in done.stderr


def test_a_real_run_without_a_gpu_exits_4_with_a_result_line(exe, bundle):
    root, _ = bundle
    done = _run(exe, root, "--reps", "3", "--warmup", "1", "--flush-bytes", "1024")
    result = _last_json(done.stdout, "TRITUNE_RESULT")
    assert list(result) == RESULT_KEYS
    assert result["artifact"] == ARTIFACT_ID and result["valid"] is False and result["error"]
    assert result["grid"] == list(resolve(RunSpec.parse(MOE_SPEC), MOE_PARAMS, root).grid)
    if torch.cuda.is_available():
        # The stub launches nothing, so the poisoned output is still there: wrong output.
        assert done.returncode == 1, done.stderr
        assert "wrong output 'c'" in result["error"] and result["mismatch_ratio"] == 1.0
    else:
        assert done.returncode == 4, done.stderr
        assert "cuInit failed: CUDA error" in done.stderr
        assert "cuInit" in result["error"]
        assert result["reps"] == 0 and result["median_us"] == 0.0


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    """A random expression over small literals, spec names and every operator and function."""
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(
            [str(rng.randint(-20, 20)), "T", "topk", "BLOCK_SIZE_M", "numel(c)", "first(num_tokens_post_padded)"]
        )
    kind = rng.random()
    a, b = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    if kind < 0.6:
        return f"{a} {rng.choice('+-*/%')} {b}"
    if kind < 0.7:
        return f"-({a})"
    return f"{rng.choice(['cdiv', 'min', 'max'])}({a}, {b})"


def _spec_with_values(expressions: list[str]) -> str:
    lines = "".join(f"value\tv{i}\t{text}\n" for i, text in enumerate(expressions))
    return MOE_SPEC.replace("grid\t", lines + "grid\t", 1)


def test_c_and_python_evaluate_expressions_alike(exe, bundle):
    root, _ = bundle
    rng = random.Random(0)
    fixed = [
        "-7 / 2",
        "-7 % 2",
        "7 % -2",
        "cdiv(-7, 2)",
        "cdiv(7, -2)",
        "cdiv(-7, -2)",
        "- - 5",
        "((((1))))",
        "9223372036854775807",
        "-9223372036854775807 - 1",
        "(-9223372036854775807 - 1) % -1",
        "(-9223372036854775807 - 1) / 2",
        "cdiv(-9223372036854775807 - 1, 2)",
        "2*3+4*5-6/4%3",
        "007",
        "BLOCK_SIZE_M * num_warps - num_stages",
        "numel(sorted_token_ids) / BLOCK_SIZE_M",
    ]
    expressions = list(fixed)
    while len(expressions) < 300:
        text = _random_expression(rng)
        try:
            evaluate(text, {"T": 32, "topk": 2, "BLOCK_SIZE_M": 64}, numel=lambda a: 8192, first=lambda a: 256)
        except ExprError:
            continue  # division by zero; errors are compared below
        expressions.append(text)
    text = _spec_with_values(expressions)
    done = _run(exe, root, "--dry-run", spec=_write_spec(root, text))
    assert done.returncode == 0, done.stderr
    python = resolve(RunSpec.parse(text), MOE_PARAMS, root).values
    assert _last_json(done.stdout, "TRITUNE_DRYRUN")["values"] == python


@pytest.mark.parametrize(
    "text",
    [
        "T / (topk - 2)",
        "T % 0",
        "cdiv(1, topk - topk)",
        "9223372036854775807 + 1",
        "4294967296 * 4294967296",
        "(-9223372036854775807 - 1) / -1",
        "-(-9223372036854775807 - 1)",
        "cdiv(-9223372036854775807 - 1, -1)",
        "M + 1",
        "1 +",
        "(1 + 2",
        "1 2",
        "1 ) $",
        "foo(1)",
        "min(1)",
        "max(1, 2, 3)",
        "numel(1)",
        "numel(c + 1)",
        "9223372036854775808",
        "2 ** 3",
        "(" * 65 + "1" + ")" * 65,
        "-" * 65 + "1",
    ],
)
def test_c_and_python_report_the_same_expression_errors(exe, bundle, text):
    root, _ = bundle
    spec = _spec_with_values([text])
    with pytest.raises((SpecError, ExprError)) as info:
        resolve(RunSpec.parse(spec), MOE_PARAMS, root)
    python = str(info.value)
    message = python[python.index('expression "') :]
    done = _run(exe, root, "--dry-run", spec=_write_spec(root, spec))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, f"python: {python}\nC: {done.stderr}"


# ---------------------------------------------------------------- the CUDA path, against a fake driver
#
# No GPU here, so the run path (allocations, copies, poison, launch, check, the held stream, events, cleanup) runs
# against a libcuda.so.1 written for the test: device memory is host memory, a CUfunction is a host function that
# cuLaunchKernel calls, events count launches. It exports cuEventElapsedTime only unversioned (as drivers before
# CUDA 12.8 did), so the shim's fallback from cuEventElapsedTime_v2 is exercised, and it refuses to synchronize a
# stream still held on its flag (a real GPU would hang there).

FAKE_LIBCUDA = r"""
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct CUevent_st { long long launches; };
struct CUstream_st { int unused; };
static long long live, launches, waits;
static uint32_t *wait_addr;
static uint32_t wait_value;
static unsigned grid[3];

static int env(const char *name) { const char *v = getenv(name); return v ? atoi(v) : 0; }
__attribute__((destructor)) static void report(void) {
    fprintf(stderr, "fake-cuda: live=%lld waits=%lld launches=%lld grid=%ux%ux%u\n", live, waits, launches,
            grid[0], grid[1], grid[2]);
}
CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int o) { *d = o; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)&live; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult cuStreamCreate(CUstream *s, unsigned int f) { (void)f; *s = calloc(1, sizeof **s); live++; return 0; }
CUresult cuStreamDestroy(CUstream s) { free(s); live--; return CUDA_SUCCESS; }
CUresult cuMemAlloc(CUdeviceptr *p, size_t n) { *p = (CUdeviceptr)(uintptr_t)malloc(n); live++; return 0; }
CUresult cuMemFree(CUdeviceptr p) { free((void *)(uintptr_t)p); live--; return CUDA_SUCCESS; }
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) { memcpy(d, (void *)(uintptr_t)s, n); return 0; }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    (void)s; memset((void *)(uintptr_t)d, v, n); return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int f) { (void)f; *p = malloc(n); live++; return 0; }
CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int f) {
    (void)f; *d = (CUdeviceptr)(uintptr_t)p; return CUDA_SUCCESS;
}
CUresult cuMemFreeHost(void *p) { free(p); live--; return CUDA_SUCCESS; }
CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) {
    (void)s;
    if (env("FAKE_CUDA_NO_MEMOPS") || f != CU_STREAM_WAIT_VALUE_GEQ) return CUDA_ERROR_NOT_SUPPORTED;
    wait_addr = (uint32_t *)(uintptr_t)a; wait_value = v; waits++; return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s) {
    (void)s;
    if (wait_addr && (int32_t)(*(volatile uint32_t *)wait_addr - wait_value) < 0) {
        fprintf(stderr, "fake-cuda: deadlock: synchronize while the stream waits on its flag\n");
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    wait_addr = NULL;
    return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent *e, unsigned int f) { (void)f; *e = calloc(1, sizeof **e); live++; return 0; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)s; e->launches = launches; return CUDA_SUCCESS; }
CUresult cuEventDestroy(CUevent e) { free(e); live--; return CUDA_SUCCESS; }
#undef cuEventElapsedTime
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    *ms = (float)(b->launches - a->launches) * 0.0078125f; return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake driver error"; return CUDA_SUCCESS; }
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream s, void **params, void **extra) {
    (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)extra;
    if (++launches == env("FAKE_CUDA_FAIL_LAUNCH")) return CUDA_ERROR_LAUNCH_FAILED;
    grid[0] = gx; grid[1] = gy; grid[2] = gz;
    void (*kernel)(void **);
    uintptr_t address = (uintptr_t)f;
    memcpy(&kernel, &address, sizeof kernel);
    kernel(params);
    return CUDA_SUCCESS;
}
"""

# A "kernel" that copies src to dst (flipping a bit of element 0 when bump is set) and checks that its scratch
# starts zeroed, then dirties it.
COPY_GLUE = r"""
#include "tritune_artifact.h"
const char *const tritune_artifact_id = "copy_B128";
const char *const tritune_kernel_name = "copy";
const char *const tritune_target = "cuda:90";
const tritune_param tritune_params[] = {{"BLOCK", 128}, {"num_warps", 4}};
const int tritune_num_params = 2;
const tritune_argdesc tritune_args[] = {{"src", 'p', 16}, {"dst", 'p', 16}, {"nbytes", 'l', 16}, {"bump", 'i', 0},
                                        {"work", 'p', 0}};
const int tritune_num_args = 5;

static void copy_kernel(void **params) {
    unsigned char *src = (unsigned char *)(uintptr_t)*(CUdeviceptr *)params[0];
    unsigned char *dst = (unsigned char *)(uintptr_t)*(CUdeviceptr *)params[1];
    int64_t nbytes = *(int64_t *)params[2];
    int32_t bump = *(int32_t *)params[3];
    unsigned char *work = (unsigned char *)(uintptr_t)*(CUdeviceptr *)params[4];
    int dirty = 0;
    for (int i = 0; i < 64; i++) dirty |= work[i];
    memcpy(dst, src, (size_t)nbytes);
    if ((bump || dirty) && nbytes) dst[0] ^= 0x40;
    memset(work, 0x5A, 64);
}

CUresult tritune_launch(CUstream stream, void *const *values) {
    if (*(int32_t *)values[3] == 2) { /* what Triton's launcher does when its module does not load */
        printf("Triton Error [CUDA]: no kernel image is available\\n");
        exit(209);
    }
    uintptr_t address;
    void (*kernel)(void **) = copy_kernel;
    memcpy(&address, &kernel, sizeof address);
    return cuLaunchKernel((CUfunction)address, tritune_grid[0], tritune_grid[1], tritune_grid[2], 128, 1, 1, 0,
                          stream, (void **)values, NULL);
}
"""


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> tuple[Path, Path]:
    """(the copy artifact's executable, a folder holding the fake libcuda.so.1)."""
    cc = _require_cc()
    work = tmp_path_factory.mktemp("fake_cuda")
    (work / "fake_libcuda.c").write_text(FAKE_LIBCUDA)
    lib = work / "lib"
    lib.mkdir()
    command = [cc, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-shared", "-fPIC", f"-I{cuda_include_dir()}", "-o",
               str(lib / "libcuda.so.1"), str(work / "fake_libcuda.c")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (work / "glue.c").write_text(COPY_GLUE)
    sources = [CSRC_DIR / name for name in MAIN_SOURCES] + [work / "glue.c"]
    output = work / "bin" / "copy_B128"
    assert compile_executable(sources, output, [CSRC_DIR, cuda_include_dir()], CSRC_DIR / "tritune_artifact.h") == ""
    return output, lib


def _copy_bundle(root: Path, src: torch.Tensor, expected: torch.Tensor, bump: int, tolerance: str) -> None:
    write_tensor(root / "data" / "src.tdat", "src", src)
    write_tensor(root / "data" / "expected.tdat", "dst", expected)
    (root / "specs").mkdir(parents=True, exist_ok=True)
    (root / "specs" / "copy.spec").write_text(
        "tritune-spec 1\nkernel\tcopy\n"
        "arg\tsrc\tin\tdata/src.tdat\narg\tdst\tout\tdata/expected.tdat\n"
        f"arg\tnbytes\ti64\tnumel(dst) * {expected.element_size()}\narg\tbump\ti32\t{bump}\n"
        "arg\twork\tscratch\t64\n"
        "grid\tcdiv(numel(dst), BLOCK)\t1\t1\n"
        f"tolerance\t{tolerance}\n"
    )


def _run_fake(fake_cuda, root: Path, *extra: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    exe, lib = fake_cuda
    environment = {**os.environ, "LD_LIBRARY_PATH": str(lib), **env}
    command = [str(exe), "--bundle", str(root), "--spec", "specs/copy.spec", "--flush-bytes", "4096", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)
    return done, _last_json(done.stdout, "TRITUNE_RESULT")


def _random_tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype_name", list(TDAT_DTYPES))
def test_a_correct_kernel_is_valid_and_timed(fake_cuda, tmp_path, dtype_name):
    dtype = TDAT_DTYPES[dtype_name]
    src = _random_tensor(dtype, 1008)  # not a multiple of BLOCK (the grid rounds up); bytes divisible by 16
    _copy_bundle(tmp_path, src, src.clone(), bump=0, tolerance="0.0\t0.0\t0.0\t0.0")
    done, result = _run_fake(fake_cuda, tmp_path, "--reps", "40", "--warmup", "3")
    assert done.returncode == 0, done.stderr
    assert result["valid"] is True and result["error"] == ""
    assert (result["max_abs_err"], result["mismatch_ratio"], result["rel_l2"]) == (0.0, 0.0, 0.0)
    # Each timed rep is exactly one launch between its events: 0.0078125 ms.
    assert result["median_us"] == result["min_us"] == result["max_us"] == 7.8125
    assert result["reps"] == 40 and result["grid"] == [8, 1, 1]
    # 40 reps = chunks of 32 and 8, each held on the flag; 1 + 3 + 40 + 1 launches; everything freed.
    assert "fake-cuda: live=0 waits=2 launches=45 grid=8x1x1" in done.stderr, done.stderr


def test_a_wrong_kernel_exits_1_with_its_errors(fake_cuda, tmp_path):
    src = _random_tensor(torch.float32, 1000)
    _copy_bundle(tmp_path, src, src.clone(), bump=1, tolerance="0.0\t0.0\t0.0\t1.0")
    done, result = _run_fake(fake_cuda, tmp_path)
    assert done.returncode == 1, done.stderr
    assert result["valid"] is False and "wrong output 'dst': 1 of 1000 elements mismatch" in result["error"]
    assert result["mismatch_ratio"] == pytest.approx(1e-3)
    assert result["max_abs_err"] > 0 and result["reps"] == 0
    assert "fake-cuda: live=0 waits=0 launches=1" in done.stderr


def test_tolerances_allow_float_mismatches_but_never_integer_ones(fake_cuda, tmp_path):
    # One element in 1000 flips a bit: within a 1% mismatch ratio for floats, never for integers.
    for dtype, code in ((torch.bfloat16, 0), (torch.int32, 1)):
        src = _random_tensor(dtype, 1000)
        _copy_bundle(tmp_path, src, src.clone(), bump=1, tolerance="0.0\t0.0\t0.01\t1.0")
        done, result = _run_fake(fake_cuda, tmp_path, "--reps", "3")
        assert done.returncode == code, (dtype, done.stderr)
        assert result["valid"] is (code == 0)


def test_unwritten_output_fails_whatever_the_tolerance(fake_cuda, tmp_path):
    # The kernel copies half the bytes: the other half keeps the 0xFF poison, NaN in fp16.
    src = _random_tensor(torch.float16, 64)
    _copy_bundle(tmp_path, src, src.clone(), bump=0, tolerance="1e3\t1e3\t0.5\t1e3")
    spec = tmp_path / "specs" / "copy.spec"
    spec.write_text(spec.read_text().replace("numel(dst) * 2", "numel(dst)"))
    done, result = _run_fake(fake_cuda, tmp_path)
    assert done.returncode == 1, done.stderr
    assert "32 of 64 elements mismatch (ratio 0.5, allowed 0.5), 32 NaN/Inf" in result["error"]
    assert result["mismatch_ratio"] == 0.5
    assert result["max_abs_err"] is None and result["rel_l2"] is None  # NaN/Inf are null in JSON


def test_without_stream_memory_operations_it_times_unheld(fake_cuda, tmp_path):
    src = _random_tensor(torch.float32, 256)
    _copy_bundle(tmp_path, src, src.clone(), bump=0, tolerance="0.0\t0.0\t0.0\t0.0")
    done, result = _run_fake(fake_cuda, tmp_path, "--reps", "70", FAKE_CUDA_NO_MEMOPS="1")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("stream memory operations are not supported") == 1
    assert result["valid"] is True and result["reps"] == 70


@pytest.mark.parametrize(
    "fail_at, what",
    [
        (1, "first launch"),  # the checked launch
        (2, "warmup"),
        (10, "a timed rep while the stream is held"),
    ],
)
def test_a_failing_launch_exits_4_and_frees_everything(fake_cuda, tmp_path, fail_at, what):
    src = _random_tensor(torch.float32, 256)
    _copy_bundle(tmp_path, src, src.clone(), bump=0, tolerance="0.0\t0.0\t0.0\t0.0")
    done, result = _run_fake(fake_cuda, tmp_path, "--warmup", "3", FAKE_CUDA_FAIL_LAUNCH=str(fail_at))
    assert done.returncode == 4, (what, done.stderr)
    assert result["valid"] is False and f"CUDA error {719}" in result["error"]
    assert "deadlock" not in done.stderr
    assert "fake-cuda: live=0" in done.stderr, done.stderr


def test_the_launchers_exit_becomes_a_result_line_and_exit_4(fake_cuda, tmp_path):
    src = _random_tensor(torch.float32, 256)
    _copy_bundle(tmp_path, src, src.clone(), bump=2, tolerance="0.0\t0.0\t0.0\t0.0")
    done, result = _run_fake(fake_cuda, tmp_path)
    assert done.returncode == 4, done.stderr
    assert result["valid"] is False and "Triton's launcher stopped on CUDA error 209" in result["error"]
