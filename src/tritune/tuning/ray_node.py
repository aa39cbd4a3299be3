"""What runs on each node of a Ray cluster for `RayExecutor`: the benchmark actor (one per GPU), the compile task
(on the node whose GPU will run the candidate, so the binary lands in that node's own Triton cache) and the device
probe. Imports no Ray: the driver wraps these with `ray.remote`, so this module loads on any machine.

The tunable arrives as pickled bytes and is unpickled only after `TRITON_INTERPRET` is settled for this process
(no CUDA here: Triton's interpreter, as the CLI does on a machine without a GPU), because unpickling it imports the
kernel modules and Triton reads the variable when a kernel is decorated.
"""

from __future__ import annotations

import os
import pickle
import platform
import socket
from typing import Any

from tritune.tuning.types import Config, Measurement, Task


def _settle_interpreter() -> None:
    """No CUDA in this process: run kernels through Triton's interpreter (before any kernel module is imported)."""
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit use): the host stands for the node
        return platform.node()


class BenchActor:
    """One GPU of one node: the local executor's benchmark worker (`worker._Runner`) behind actor methods.

    `prepare(problem)` builds the problem's inputs and reference (the driver times it against the setup limit), then
    `run(task)` measures one candidate against the per-candidate timeout; calls run in submission order.
    """

    def __init__(self, blob: bytes) -> None:
        _settle_interpreter()
        import torch

        from tritune.tuning.worker import _Runner

        tunable, settings = pickle.loads(blob)
        # Ray sets CUDA_VISIBLE_DEVICES to the GPU it granted, so that GPU is device 0 here.
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._runner = _Runner(tunable, device, settings)
        self._failed: tuple[str, BaseException] | None = None  # (problem key, what making its inputs raised)

    def hello(self) -> dict[str, Any]:
        """Who this actor is: node id, host, pid and the `DeviceInfo` of its GPU (or the interpreter stand-in)."""
        from tritune.device import current_device

        return {"node_id": _node_id(), "host": socket.gethostname(), "pid": os.getpid(), "device": current_device()}

    def prepare(self, problem: Any) -> bool:
        """Make `problem`'s inputs now, so that `run` is timed from here; False when that failed (`run` reports it)."""
        self._failed = None
        try:
            self._runner.prepare(problem)
        except Exception as exc:
            self._runner.forget()
            self._failed = (problem.key(), exc)
            return False
        return True

    def run(self, task: Task) -> Measurement:
        """Measure one candidate (first pass or finalist); never raises but for a dead process."""
        if self._failed is not None and self._failed[0] == task.problem.key():
            from tritune.tuning.errors import classify_exception, short_message

            exc = self._failed[1]
            self._failed = None
            return Measurement(task.problem.key(), task.config, classify_exception(exc),
                               message="making inputs: " + short_message(exc))
        return self._runner.run(task, lambda: None)


_TUNABLES: dict[bytes, Any] = {}  # per compile process: the tunables it has unpickled, by their pickled form


def compile_on_node(tunable_blob: bytes, candidate: bytes, target: Any = None):
    """Compile one pickled (problem, config) with the pickled tunable here; a `compile.CompileOutcome`, never raises.

    The binary stays in this node's Triton cache, where the benchmark actor of this node finds it. With `target`
    (a `CompileTarget`, the GPU model tuned) Triton is answered from it: the task opens no CUDA context.
    """
    _settle_interpreter()
    from tritune.tuning.compile import compile_one, lower_compile_priority

    tunable = _TUNABLES.get(tunable_blob)
    if tunable is None:
        if not _TUNABLES:  # this process's first compile: below the benchmark actors, as the local pool is
            lower_compile_priority()
        tunable = _TUNABLES.setdefault(tunable_blob, pickle.loads(tunable_blob))
    problem, config = pickle.loads(candidate)
    assert isinstance(config, Config)
    if target is None:
        return compile_one(tunable, problem, config)
    from tritune.compile_target import compiling_for

    with compiling_for(target):  # not compile_without_gpu: Ray may reuse this process for a task that needs the GPU
        return compile_one(tunable, problem, config)


def probe_device() -> dict[str, Any]:
    """The node id and `DeviceInfo` of the GPU this task was given (what the driver tunes for)."""
    _settle_interpreter()
    from tritune.device import current_device

    return {"node_id": _node_id(), "host": socket.gethostname(), "device": current_device()}
