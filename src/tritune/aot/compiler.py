"""One config of one kernel -> one artifact: Triton's AOT compiler (cubin embedded in a generated C launcher)
for a named target, plus the glue that gives every artifact the same C interface (docs/AOT.md).

Compiling needs no GPU: while a job runs, Triton's active driver is a stand-in that names the target and maps
argument types, so `triton.tools.compile` never asks a device what it is. This module imports no kernel
module at the top, so a spawned worker can switch Triton's interpreter off before any kernel is decorated.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Shared memory one block may opt in to, per compute capability (CUDA programming guide, table of limits).
MAX_SHARED_BYTES = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
                    100: 232448, 120: 101376}
GRID_ARG = "tritune_grid[0],tritune_grid[1],tritune_grid[2]"
_INT32 = (-(2**31), 2**31 - 1)
_TYPE_CHAR = {"ptr": "p", "i32": "i", "i64": "l", "fp32": "f"}


class AotError(ValueError):
    """A build request that cannot work (bad target, a kernel argument with no value); one line."""


@dataclass(frozen=True)
class AotTarget:
    """What to compile for: `cuda:90` (H100/H200), `cuda:80` (A100), ...; warp size 32."""

    backend: str
    arch: int
    warp_size: int = 32

    @staticmethod
    def parse(text: str) -> AotTarget:
        m = re.fullmatch(r"\s*cuda:(\d{2,3})(?::(\d+))?\s*", text or "")
        if not m:
            raise AotError(f"target {text!r}: expected cuda:<compute capability>, e.g. cuda:90 (H100/H200) "
                           "or cuda:80 (A100)")
        arch = int(m[1])
        if arch < 70:
            raise AotError(f"target {text!r}: Triton compiles for compute capability 7.0 and newer")
        return AotTarget("cuda", arch, int(m[2] or 32))

    @property
    def text(self) -> str:
        return f"{self.backend}:{self.arch}"

    @property
    def max_shared_bytes(self) -> int:
        return MAX_SHARED_BYTES.get(self.arch, 101376)


@contextlib.contextmanager
def target_driver(target: AotTarget) -> Iterator[None]:
    """Make Triton compile for `target` whether or not this machine has a GPU; restores the driver after."""
    from tritune.compile_target import CompileTarget, compiling_for

    with compiling_for(CompileTarget(target.backend, target.arch, target.warp_size)):
        yield


@dataclass(frozen=True)
class KernelArg:
    """One parameter of the kernel in declaration order, with the value this artifact is specialized on.

    kind: "ptr" (dtype is Triton's element type: bf16, fp16, fp32, i32, i64, u8), "i32"/"i64"/"fp32" (a runtime
    scalar; `value` is what the data set passes) or "constexpr" (`value` compiled in).
    """

    name: str
    kind: str
    value: int | float | None = None
    dtype: str = ""
    specialize: bool = True  # False for the kernel's do_not_specialize arguments


def specialization(arg: KernelArg) -> int:
    """The hint Triton's JIT would give this argument: 16 (aligned / divisible by 16), 1 (the integer 1,
    compiled in), 0 (none). Pointers are from cuMemAlloc, so always 16-byte aligned."""
    if arg.kind == "ptr":
        return 16
    if arg.kind in ("i32", "i64") and arg.specialize:
        if arg.value == 1:
            return 1
        if arg.value % 16 == 0:
            return 16
    return 0


def int_kind(value: int) -> str:
    """i32 when the value fits, else i64: the type Triton's JIT picks for a Python int."""
    return "i32" if _INT32[0] <= value <= _INT32[1] else "i64"


def signature_text(args: Sequence[KernelArg]) -> str:
    """The `--signature` of triton.tools.compile: `*bf16:16, i32, i32:16, 64, ...` in declaration order."""
    parts = []
    for a in args:
        if a.kind == "constexpr":
            parts.append(str(int(a.value)))
            continue
        ty = f"*{a.dtype}" if a.kind == "ptr" else a.kind
        hint = specialization(a)
        parts.append(f"{ty}:{hint}" if hint else ty)
    return ", ".join(parts)


@dataclass(frozen=True)
class CompileJob:
    """Everything a worker needs to build one artifact; plain data, so it pickles to a spawned process."""

    artifact_id: str
    kernel: str  # the spec's kernel name (e.g. moe_stage1)
    entry_path: str  # a Python file defining `function` at module level
    function: str  # the @triton.jit function's own name (the cubin's entry symbol)
    args: tuple[KernelArg, ...]
    params: tuple[tuple[str, int], ...]  # config parameters, num_warps and num_stages included
    target: AotTarget
    out_dir: str  # artifacts/<id>/ inside the bundle


@dataclass
class CompiledArtifact:
    artifact_id: str
    status: str  # ok | compile_error | out_of_resources
    error: str = ""
    symbol: str = ""
    signature: str = ""
    shared_bytes: int = 0
    files: dict[str, str] = field(default_factory=dict)  # c, h, glue: paths relative to out_dir's bundle
    compile_s: float = 0.0


def _short(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:400]


def compile_artifact(job: CompileJob) -> CompiledArtifact:
    """Compile `job` with triton.tools.compile and write its glue; never raises, failures come back as status."""
    from triton.tools.compile import CompileArgs, compile_kernel

    start = time.perf_counter()
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = dict(job.params)
    signature = signature_text(job.args)
    try:
        with target_driver(job.target):
            symbol, files = compile_kernel(CompileArgs(
                path=job.entry_path, kernel_name=job.function, signature=signature, grid=GRID_ARG,
                target=None,  # the stand-in driver answers with a proper GPUTarget (Triton 3.6 keeps strings)
                num_warps=int(params["num_warps"]), num_stages=int(params["num_stages"]),
                out_name="tt_" + job.kernel, out_path=out_dir / ("tt_" + job.kernel)))
    except Exception as exc:  # a config that cannot compile is a result, not a build failure
        return CompiledArtifact(job.artifact_id, "compile_error", _short(exc), signature=signature,
                                compile_s=time.perf_counter() - start)
    c_file = next(Path(f) for f in files if str(f).endswith(".c"))
    h_file = next(Path(f) for f in files if str(f).endswith(".h"))
    shared = _shared_bytes(c_file)
    glue = out_dir / "glue.c"
    glue.write_text(glue_source(job, symbol, h_file.name))
    result = CompiledArtifact(job.artifact_id, "ok", symbol=symbol, signature=signature, shared_bytes=shared,
                              files={"c": str(c_file), "h": str(h_file), "glue": str(glue)},
                              compile_s=time.perf_counter() - start)
    if shared > job.target.max_shared_bytes:
        result.status = "out_of_resources"
        result.error = f"needs {shared} bytes of shared memory; {job.target.text} allows {job.target.max_shared_bytes}"
    return result


def _shared_bytes(c_file: Path) -> int:
    m = re.search(r"int shared = (\d+);", c_file.read_text())
    return int(m[1]) if m else 0


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_C_VALUE = {"ptr": "*(const CUdeviceptr *)", "i32": "*(const int32_t *)", "i64": "*(const int64_t *)",
            "fp32": "*(const float *)"}


def glue_source(job: CompileJob, symbol: str, header_name: str) -> str:
    """The artifact's half of the interface in src/tritune_artifact.h: what it was built with, and one launch
    function taking every runtime argument by pointer (those compiled in as the constant 1 are skipped)."""
    runtime = [a for a in job.args if a.kind != "constexpr"]
    params = ",\n    ".join(f"{{{_c_string(k)}, {int(v)}LL}}" for k, v in job.params)
    argdescs = ",\n    ".join(f"{{{_c_string(a.name)}, '{_TYPE_CHAR[a.kind]}', {specialization(a)}}}"
                               for a in runtime)
    passed = [f"{_C_VALUE[a.kind]}values[{i}]" for i, a in enumerate(runtime) if specialization(a) != 1]
    call = ", ".join(["stream"] + passed)
    return f"""/* Generated by tritune aot build: artifact {job.artifact_id} ({job.kernel}, {job.target.text}). */
#include "tritune_artifact.h"
#include "{header_name}"

const char *const tritune_artifact_id = {_c_string(job.artifact_id)};
const char *const tritune_kernel_name = {_c_string(job.kernel)};
const char *const tritune_target = {_c_string(job.target.text)};
const tritune_param tritune_params[] = {{
    {params}
}};
const int tritune_num_params = {len(job.params)};
const tritune_argdesc tritune_args[] = {{
    {argdescs}
}};
const int tritune_num_args = {len(runtime)};

CUresult tritune_launch(CUstream stream, void *const *values) {{
    (void)values;
    return {symbol}({call});
}}
"""


def kernel_args(param_names: Sequence[str], constexprs: Mapping[str, int | bool],
                runtime: Mapping[str, KernelArg]) -> tuple[KernelArg, ...]:
    """The kernel's parameters in declaration order: each a constexpr of this config or a runtime argument."""
    out = []
    for name in param_names:
        if name in constexprs:
            out.append(KernelArg(name, "constexpr", int(constexprs[name])))
        elif name in runtime:
            out.append(runtime[name])
        else:
            raise AotError(f"kernel parameter {name!r} has neither a constexpr value nor a run-spec argument")
    extra = sorted(set(constexprs) - set(param_names)) + sorted(set(runtime) - set(param_names))
    if extra:
        raise AotError(f"{extra} are not parameters of the kernel (it takes {list(param_names)})")
    return tuple(out)


def init_worker() -> None:
    """Spawned compile workers compile for real even when the parent runs under Triton's interpreter."""
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default; set so 3.9 does not warn
