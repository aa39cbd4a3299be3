"""Which Triton release this is, as the kernels' options need it: some exist only from a release on
(`tl.range(..., warp_specialize=...)` from 3.5), and some fail to compile up to one (kernels/fused_moe_config.py)."""

from __future__ import annotations

import re

import triton


def triton_release(version: str = triton.__version__) -> tuple[int, int]:
    """(major, minor): '3.6.0' -> (3, 6), '3.10.0+git1234' -> (3, 10)."""
    major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    return major, minor


# `tl.range(..., warp_specialize=...)`: Triton 3.5 on.
HAS_WARP_SPECIALIZE = triton_release() >= (3, 5)
