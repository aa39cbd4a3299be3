"""The C toolchain for bundle executables: which compiler, where cuda.h is, and one compile-and-link command.

No CUDA toolkit is needed: Triton's wheel ships cuda.h, and `csrc/cuda_shim.c` opens libcuda at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CSRC_DIR = Path(__file__).parent / "csrc"
MAIN_SOURCES = ("main.c", "expr.c", "tdat.c", "cuda_shim.c")  # the generic main, linked into every executable
CFLAGS = ("-O2", "-std=gnu11", "-Wall", "-Wextra")
LIBS = ("-ldl", "-lm")
COMPILE_TIMEOUT_S = 600  # a launcher embeds its cubin as a C array literal, which compilers take a while over
_TAIL_LINES = 20


class ToolchainError(RuntimeError):
    """No C compiler, no cuda.h, or a compile that failed (the message ends with the compiler's last lines)."""


def find_cc() -> str | None:
    """The C compiler: $CC (the build convention, not a tritune knob) or `cc`, resolved on PATH; None if absent."""
    return shutil.which(os.environ.get("CC") or "cc")


def cuda_include_dir() -> Path:
    """The folder holding the cuda.h that Triton's wheel ships (backends/nvidia/include)."""
    import triton

    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if not (folder / "cuda.h").is_file():
        raise ToolchainError(f"no cuda.h in {folder}: this triton has no NVIDIA backend headers")
    return folder


def compile_object(source: Path, output: Path, include_dirs: list[Path], force_include: Path | None = None) -> str:
    """`cc -c` one source: the generic main's files are compiled once per bundle, then linked into each executable."""
    return compile_executable([source], output, include_dirs, force_include, link=False)


def compile_executable(
    sources: list[Path], output: Path, include_dirs: list[Path], force_include: Path | None = None, link: bool = True
) -> str:
    """Compile and link `sources` into `output` with `cc -O2 -std=gnu11 -Wall -Wextra ... -ldl -lm`.

    `force_include` is passed as `-include` (for tritune_artifact.h in Triton's launcher sources). Returns the
    compiler's diagnostics (warnings; "" when clean). Raises ToolchainError when there is no compiler or it fails.
    """
    cc = find_cc()
    if cc is None:
        raise ToolchainError(f"no C compiler: {os.environ.get('CC') or 'cc'} is not on PATH (set CC)")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [cc, *CFLAGS]
    command += [f"-I{folder}" for folder in include_dirs]
    if force_include is not None:
        command += ["-include", str(force_include)]
    command += ["-o", str(output), *map(str, sources), *LIBS] if link else ["-c", "-o", str(output), *map(str, sources)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"{cc} took over {COMPILE_TIMEOUT_S}s building {output.name}") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-_TAIL_LINES:])
        raise ToolchainError(f"{cc} failed (exit {done.returncode}) building {output.name}:\n{tail}")
    return done.stderr
