"""The multiprocessing context the tuner's compile pool and GPU workers start from (TRITUNE_START_METHOD).

"forkserver" (the default) forks them from one server process that imported torch and Triton once, so each starts in
milliseconds; the CLI starts that server (`start_server_early`) before it imports torch where the CUDA driver
reports a GPU (asked through libcuda), else once it has decided on the interpreter, before its device query and file
reading, so the server's imports overlap them. "spawn" starts a fresh interpreter per process that imports torch and
Triton itself, 2-4 s each and all at once at the start of a tune: on 4 H200s the first candidate reached a GPU 9.7 s
after the tune began with spawn and 3.5 s with the server (which took 3.8 s to start before it), and the 4-GPU MoE
tune took 106.2 s against 109.2 s (issue 17). The server never initialises CUDA (it imports torch, not a CUDA
tensor), so a forked GPU worker makes its own context as a spawned one does. Fork itself is never used: the driver
holds a CUDA context.

A forked child inherits the server's environment, fixed when the server started, not the parent's now: every child
entry point adopts the parent's environment (`parent_env` / `adopt_env`), so a knob set after the server started
reaches the children as it does with spawn. One thing adoption cannot change: Triton's own library functions were
decorated in the server, in the TRITON_INTERPRET mode it had then, so that variable must be settled before the server
starts (the CLI decides it first; a process that flips it between tunes should use spawn).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext

from tritune.knobs import START_METHOD, start_method

# What the fork server imports before it forks anything: what every compile process and worker imports first (torch
# and Triton), and tritune's worker and tunables, whose kernel modules every child would otherwise import itself
# (about 0.65 s a process on a 2-core CPU machine, with 60 compile processes starting at once on 4 H200s). None of
# them touches CUDA at import (a forked child could then not initialise it): a GPU test forks workers that use it.
FORKSERVER_PRELOAD = ["torch", "triton", "triton.language", "tritune.tuning.worker", "tritune.tuners.fused_moe_tunable",
                      "tritune.tuners.gemm_tunable", "tritune.tuners.grouped_gemm_tunable"]


def process_context() -> BaseContext:
    """The context to start tuner processes from, as TRITUNE_START_METHOD says (read at each call)."""
    method = start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when this process first starts its server
    return ctx


def start_server_early() -> None:
    """Start the fork server now (where TRITUNE_START_METHOD is forkserver) so its imports run while this process
    does other work; it returns once the server process is started, not once it has imported. Call it after
    TRITON_INTERPRET is decided: the server's environment is fixed here (children adopt the parent's anyway)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    process_context()  # the preload list, before the server starts
    forkserver.ensure_running()


def start_server_before_torch() -> bool:
    """Start the fork server now, before this process imports torch (1-3 s), where that can be decided without
    torch: the start method is forkserver and the CUDA driver reports a GPU, so this process will not turn on
    Triton's interpreter either, unless its torch cannot use the GPU (`spawn_if_server_is_stale`). True if started."""
    if start_method() != "forkserver" or not driver_reports_a_gpu():
        return False
    start_server_early()
    return True


def spawn_if_server_is_stale(server_started: bool, interpreting: bool) -> None:
    """A server started before torch for a GPU that this torch then cannot use (a CPU build, so the interpreter is
    on): its Triton was set up without the interpreter, so children are spawned instead, deciding as this process
    did."""
    if server_started and interpreting:
        os.environ[START_METHOD] = "spawn"


def driver_reports_a_gpu() -> bool:
    """Whether the CUDA driver reports a device, asked of libcuda without torch: False without a driver or device."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def parent_env() -> dict[str, str]:
    """The environment a child started now should run with (passed to it, adopted by `adopt_env`)."""
    return dict(os.environ)


def adopt_env(env: dict[str, str] | None) -> None:
    """Make this process's environment `env` (the parent's when it started this child); None leaves it as is."""
    if env is None or env == os.environ:
        return
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
