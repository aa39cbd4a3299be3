"""Programmatic dependent launch (Hopper): a fused-MoE plan's kernels start while the previous one drains.

Why: at decode sizes the op is a chain of short kernels (sort, stage 1, its finish, stage 2, top-k sum), and each
one pays a launch gap, a pipeline fill and a drain (stage 1 alone about 27 µs past its bytes on the H100 at
gpt-oss-120b's shape, nineteenth session). Launched with the PDL attribute (`BoundKernel(launch_pdl=True)`), a
kernel's CTAs may be scheduled once every CTA of the previous grid has signalled (`gdc_launch_dependents`), and they
wait (`gdc_wait`) for that grid's completion and memory flush before touching memory: correct whatever the
previous kernel was, since every kernel here waits before its first global access.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Launch a fused-MoE plan's chain as programmatic dependents on Hopper and later; False launches each kernel plainly.
MOE_PDL = True
PDL_MIN_MAJOR = 9  # griddepcontrol: sm90+


def plan_pdl(capability_major: int) -> bool:
    """Whether a fused-MoE plan (`MoeLaunch`) on a GPU of this compute-capability major launches with PDL."""
    return MOE_PDL and capability_major >= PDL_MIN_MAJOR


def target_pdl() -> bool:
    """`plan_pdl` for the GPU Triton compiles for now (a compile process's target included): what `compile_only`
    builds for the plan's kernels."""
    arch = triton.runtime.driver.active.get_current_target().arch
    return plan_pdl(int(arch) // 10 if isinstance(arch, int) else 0)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the previous grid, then let the next one be scheduled (its CTAs fill
    the SMs this grid's last wave leaves idle, and wait in turn). Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
