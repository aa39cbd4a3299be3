"""Joining a Ray cluster: where to (`RaySettings`), the connection (Ray imported on first use only, so the engine
loads without it), the nodes that hold the GPU resource, the remote forms of `ray_node`'s actor and tasks, and the GPU
models a cluster holds (`cluster_devices`, what the CLI makes one tuning run per).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from tritune.device import DeviceInfo
from tritune.tuning.ray_node import BenchActor, compile_on_node, probe_device

STARTUP_TIMEOUT_S = 600.0  # actor placement + import torch + CUDA init


@dataclass(frozen=True)
class RaySettings:
    """Where a tuning run's candidates go when they go to Ray."""

    address: str | None = None  # ray.init(address=): "host:6379", "auto", "ray://..."; None: RAY_ADDRESS or a local Ray
    resource: str = "GPU"  # one benchmark actor per unit of it on each node; a custom resource stands in for GPUs


def ray_available() -> bool:
    """Whether Ray can be imported here (the `tritune[ray]` extra)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def import_ray() -> Any:
    """The `ray` module; a RuntimeError naming the extra to install when it is missing."""
    try:
        import ray
    except ImportError as exc:  # the CLI checks first; this is for library callers
        raise RuntimeError("the Ray executor needs Ray: pip install 'tritune[ray]'") from exc
    return ray


def connect(settings: RaySettings) -> Any:
    """The `ray` module, connected to `settings.address` (an existing connection is kept as it is)."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=settings.address, logging_level=logging.WARNING)
    return ray


@functools.cache
def remote() -> tuple[Any, Any, Any]:
    """`ray.remote` forms of (BenchActor, compile_on_node, probe_device), made once."""
    ray = import_ray()
    return ray.remote(BenchActor), ray.remote(compile_on_node), ray.remote(probe_device)


def on_node(node_id: str) -> Any:
    """Ray's scheduling strategy for 'on this node and nowhere else'."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def gpu_nodes(ray: Any, resource: str) -> list[dict]:
    """`ray.nodes()` entries of the alive nodes holding at least one unit of `resource`."""
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) >= 1]


def slot_options(resource: str) -> dict[str, Any]:
    """Ray options that hold one GPU (or one unit of the custom resource standing in for one)."""
    return {"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}}


def cluster_devices(settings: RaySettings, timeout_s: float = STARTUP_TIMEOUT_S) -> list[tuple[DeviceInfo, int]]:
    """The cluster's GPU models: (DeviceInfo of one GPU of that name, GPUs of that name), most GPUs first.

    One probe task per node (holding one of its GPUs). A cluster of one model gives one entry; a tuning run is made
    per entry (journal and results keyed by that device).
    """
    ray = connect(settings)
    nodes = gpu_nodes(ray, settings.resource)
    if not nodes:
        raise RuntimeError(f"no alive node of the Ray cluster offers the resource {settings.resource!r}")
    _, _, probe = remote()
    refs = {probe.options(**slot_options(settings.resource), scheduling_strategy=on_node(n["NodeID"])).remote():
            n for n in nodes}
    found: dict[str, tuple[DeviceInfo, int]] = {}
    for info, node in zip(ray.get(list(refs), timeout=timeout_s), refs.values(), strict=True):
        device: DeviceInfo = info["device"]
        seen, count = found.get(device.name, (device, 0))
        found[device.name] = (seen, count + int(node["Resources"][settings.resource]))
    return sorted(found.values(), key=lambda e: (-e[1], e[0].name))
