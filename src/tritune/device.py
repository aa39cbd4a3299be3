"""Device identity and limits: what pruning reads, what the ops key their choices on and what every output file records
as provenance; and what Triton's CPU interpreter (the stand-in without a GPU) can be expected to finish.

A leaf every layer may import (the engine too): it imports nothing of tritune's, and torch and Triton only when asked
about the running machine, so the stores stay light to import."""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import asdict, dataclass

# Used when there is no GPU (interpreter runs): H100 SXM limits, so pruning behaves as it would there. Outputs never
# record them as the machine's (`DeviceInfo.cu_num`, `provenance()`): no GPU ran.
_H100_LIMITS = dict(sm_count=132, capability=(9, 0), max_shared_mem=232448, regs_per_block=65536,
                    l2_bytes=50 * 1024 * 1024, warp_size=32)

# The interpreter runs a kernel's programs one after another in Python over numpy blocks: about 5 ns per FLOP on
# 32x32x32 tiles once a problem is past a few MFLOP (measured: 0.4 s for 2*128*512*512 FLOPs, 2.5 s for 2*256*1024**2;
# Triton 3.9, one core), and every candidate is run warm-up + iters + 2 times. The shipped tiny examples are under
# 0.5 MFLOP and 10^5 operand elements; the tuners refuse, without a GPU, problems beyond these limits unless the user
# allows them (one call then takes over half a second, and operands beyond 2^24 elements take seconds to make).
INTERPRETER_MAX_FLOPS = 2**27
INTERPRETER_MAX_ELEMENTS = 2**24
INTERPRETER_S_PER_FLOP = 5e-9
INTERPRETER_NAME = "cpu-interpreter"  # DeviceInfo.name without a GPU


def slug_of(device_name: str) -> str:
    """File-name-safe device name, as output file names carry it: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", device_name).strip("_")


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    sm_count: int
    capability: tuple[int, int]
    max_shared_mem: int  # bytes of shared memory one block may opt in to
    regs_per_block: int
    l2_bytes: int
    warp_size: int
    triton_version: str
    torch_version: str
    cuda_version: str
    interpreter: bool = False

    @property
    def slug(self) -> str:
        """File-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
        return slug_of(self.name)

    @property
    def target(self) -> str:
        return f"cuda:{self.capability[0]}{self.capability[1]}"

    @property
    def supports_tma(self) -> bool:
        """Hopper's tensor memory accelerator (host descriptors, TMA loads and stores): capability >= 9.0."""
        return self.capability >= (9, 0)

    @property
    def cu_num(self) -> int:
        """The SM count outputs record and lookups key on: 0 under the interpreter (no GPU ran; its `sm_count` is the
        stand-in's, for pruning only), so an interpreted result can never match a GPU."""
        return 0 if self.interpreter else self.sm_count

    def provenance(self) -> dict:
        """The dict written into every result file: the interpreter's says sm_count 0, capability "none" and 0 for
        the other GPU limits (shared memory, registers, L2: the H100 stand-in's prune, they are no machine's)."""
        info = asdict(self)
        info["capability"] = f"{self.capability[0]}.{self.capability[1]}"
        if self.interpreter:
            info.update(sm_count=self.cu_num, capability="none", max_shared_mem=0, regs_per_block=0, l2_bytes=0)
        info["python_version"] = platform.python_version()
        return info


def versions() -> dict[str, str]:
    import torch
    import triton

    return {
        "triton_version": triton.__version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
    }


@functools.cache
def current_device(index: int | None = None) -> DeviceInfo:
    """The GPU this process runs on, or an interpreter stand-in with H100 limits when there is none."""
    import torch

    if not torch.cuda.is_available():
        return DeviceInfo(name=INTERPRETER_NAME, interpreter=True, **_H100_LIMITS, **versions())
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or _H100_LIMITS["max_shared_mem"]
    return DeviceInfo(
        name=props.name,
        sm_count=props.multi_processor_count,
        capability=(props.major, props.minor),
        max_shared_mem=int(smem),
        regs_per_block=int(getattr(props, "regs_per_multiprocessor", 65536)),
        l2_bytes=int(props.L2_cache_size),
        warp_size=int(getattr(props, "warp_size", 32)),
        **versions(),
    )


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def interpreter_cost_fault(flops: float, elements: float) -> str | None:
    """Why a problem of `flops` per call and `elements` operand elements is beyond what the interpreter finishes in
    reasonable time, with an estimate of one call ('about 11 min per interpreted call (1.4e+11 FLOPs, ...)'); None
    when it is within INTERPRETER_MAX_FLOPS and INTERPRETER_MAX_ELEMENTS."""
    if flops <= INTERPRETER_MAX_FLOPS and elements <= INTERPRETER_MAX_ELEMENTS:
        return None
    seconds = flops * INTERPRETER_S_PER_FLOP
    took = (f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.0f} min" if seconds < 6000
            else f"{seconds / 3600:.0f} h")
    return (f"about {took} per interpreted call, each candidate run many times ({flops:.2g} FLOPs, {elements:.2g} "
            f"operand elements; the interpreter is kept to {INTERPRETER_MAX_FLOPS:.2g} and "
            f"{INTERPRETER_MAX_ELEMENTS:.2g})")
