"""Turns an exception raised while compiling or running a candidate into one of the closed set of statuses.

Sticky statuses mean the CUDA context that raised it is dead: the process must be replaced.
"""

from __future__ import annotations

import traceback

from tritune.tuning.types import Status


def _triton_error_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(out-of-resources, ptxas, compilation) exception classes of the installed Triton.

    Imported defensively: OutOfResources lived in triton.runtime.autotuner (2.0), triton.compiler.errors
    and triton.runtime.errors (2.1+); PTXASError only exists since 3.x.
    """
    oor: list[type] = []
    ptxas: list[type] = []
    comp: list[type] = []
    for module, name, bucket in (
        ("triton.runtime.errors", "OutOfResources", oor),
        ("triton.compiler.errors", "OutOfResources", oor),
        ("triton.runtime.autotuner", "OutOfResources", oor),
        ("triton.runtime.errors", "PTXASError", ptxas),
        ("triton.compiler.errors", "CompilationError", comp),
        ("triton.compiler.errors", "CompileTimeAssertionFailure", comp),
        ("triton.compiler.errors", "UnsupportedLanguageConstruct", comp),
    ):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and cls not in bucket:
            bucket.append(cls)
    return tuple(oor), tuple(ptxas), tuple(comp)


_TYPES: tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]] | None = None

# Errors after which the CUDA context refuses all further work (cudaErrorIllegalAddress, LaunchFailure, ...).
# Any "CUDA error" counts: a wrongly-sticky verdict costs a worker restart, a wrongly-benign one poisons
# every later measurement in that process.
_STICKY_MARKERS = (
    "illegal memory access",
    "illegal instruction",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "cuda error",
    "triton error [cuda]",
)
# Failures raised by the compiler pipeline that are not CompilationError (MLIR pass failures, LLVM, etc.).
_COMPILE_MARKERS = ("passmanager::run failed", "mlir", "llvm error", "failed to compile", "compilation failed")
_COMPILE_FRAMES = ("triton/compiler/", "triton/backends/", "triton/language/")


def classify_exception(exc: BaseException) -> Status:
    """The status of a candidate whose compile or run raised `exc` (never Status.OK)."""
    global _TYPES
    if _TYPES is None:
        _TYPES = _triton_error_types()
    oor_types, ptxas_types, compile_types = _TYPES
    text = str(exc).lower()

    if oor_types and isinstance(exc, oor_types):
        return Status.OUT_OF_RESOURCES
    if (ptxas_types and isinstance(exc, ptxas_types)) or "ptxas" in text:
        return Status.PTXAS_ERROR
    if "out of memory" in text:  # torch.OutOfMemoryError / cudaErrorMemoryAllocation: the context survives
        return Status.RUNTIME_ERROR
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _STICKY_MARKERS):
        return Status.CRASHED
    if compile_types and isinstance(exc, compile_types):
        return Status.COMPILE_ERROR
    if any(marker in text for marker in _COMPILE_MARKERS) or _raised_in_compiler(exc):
        return Status.COMPILE_ERROR
    return Status.RUNTIME_ERROR


def _raised_in_compiler(exc: BaseException) -> bool:
    """True when the innermost Python frame of the traceback belongs to Triton's compiler."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return bool(frames) and any(part in frames[-1].filename.replace("\\", "/") for part in _COMPILE_FRAMES)


def is_sticky(status: Status) -> bool:
    """Whether the process that produced `status` must be replaced before running anything else."""
    return status is Status.CRASHED


def short_message(exc: BaseException, limit: int = 300) -> str:
    """'TypeName: first non-blank line' of the exception, at most `limit` characters.

    Triton's CompilationError prints the kernel source first; its `error_message` attribute is used instead.
    """
    detail = getattr(exc, "error_message", None)
    text = detail if isinstance(detail, str) and detail.strip() else str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."
