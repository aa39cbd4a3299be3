"""The user-kernel API: `tunable_kernel(...)` declares a `UserKernel` over any `@triton.jit` function (api.py).

Layer: below the CLI and aot/ (which builds bundles from a UserKernel), above the engine, the stores and knobs.
Parts: validation.py (the declaration checked), keys.py (keys and grids), store.py (the results file at run time),
tunable.py (the engine's view), api.py (UserKernel and tunable_kernel).
"""

from tritune.user.api import UserKernel, UserTuneResult, tunable_kernel
from tritune.user.tunable import UserProblem, UserTunable, default_tolerance
from tritune.user.validation import LAUNCH_OPTIONS

__all__ = ["LAUNCH_OPTIONS", "UserKernel", "UserProblem", "UserTunable", "UserTuneResult", "default_tolerance",
           "tunable_kernel"]
