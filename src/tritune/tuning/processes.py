"""The multiprocessing context the tuner's compile pool and GPU workers start from (TRITUNE_START_METHOD).

Both are started with "spawn" by default: a fresh interpreter that imports torch and Triton, 2-4 s each and all at
once at the start of a tune (64 compile processes and 4 workers on 4 H200s, where the first candidate reached a GPU
10 s after the start). "forkserver" forks them from one server process that imported torch and Triton once, so each
starts in milliseconds. The server never initialises CUDA (it imports torch, not a CUDA tensor), so a forked GPU
worker makes its own context as a spawned one does. Fork itself is never used: the driver holds a CUDA context.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

from tritune.knobs import start_method

# What the fork server imports before it forks anything: what every compile process and worker imports first.
FORKSERVER_PRELOAD = ["torch", "triton", "triton.language"]


def process_context() -> BaseContext:
    """The context to start tuner processes from, as TRITUNE_START_METHOD says (read at each call)."""
    method = start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when this process first starts its server
    return ctx
