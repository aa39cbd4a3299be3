"""tritune: autotune Triton kernels (GEMM, MoE, and any user kernel through `tritune.tunable_kernel`).

Importing `tritune` stays light: the user-kernel API (torch, triton) is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"tunable_kernel": "tritune.user", "UserKernel": "tritune.user", "UserTuneResult": "tritune.user"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tritune' has no attribute {name!r}")
