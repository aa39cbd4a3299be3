"""Device identity and limits: what pruning reads and what every output file records as provenance."""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import asdict, dataclass

import torch
import triton

# Used when there is no GPU (interpreter runs): H100 SXM limits, so pruning behaves as it would there.
_H100_LIMITS = dict(sm_count=132, capability=(9, 0), max_shared_mem=232448, regs_per_block=65536,
                    l2_bytes=50 * 1024 * 1024, warp_size=32)


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
        return re.sub(r"[^A-Za-z0-9.]+", "_", self.name).strip("_")

    @property
    def target(self) -> str:
        return f"cuda:{self.capability[0]}{self.capability[1]}"

    def provenance(self) -> dict:
        """The dict written into every result file."""
        info = asdict(self)
        info["capability"] = f"{self.capability[0]}.{self.capability[1]}"
        info["python_version"] = platform.python_version()
        return info


def versions() -> dict[str, str]:
    return {
        "triton_version": triton.__version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "none",
    }


@functools.cache
def current_device(index: int | None = None) -> DeviceInfo:
    """The GPU this process runs on, or an interpreter stand-in with H100 limits when there is none."""
    if not torch.cuda.is_available():
        return DeviceInfo(name="cpu-interpreter", interpreter=True, **_H100_LIMITS, **versions())
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
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
