"""The correctness gate: poison an output before a run, then judge it against the fp32 reference.

Unwritten (still poisoned) or spurious non-finite elements always fail, whatever the tolerances say.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritune.tuning.tunable import Tolerance
from tritune.tuning.types import CheckResult

# Large and negative so a poisoned element is far from any plausible output, yet finite so it cannot be
# confused with a NaN/Inf the kernel produced. Clipped to each dtype's range (fp16: -65504, e4m3fn: -448).
_POISON_TARGET = -3.0e38

# Same-width integer dtypes, so "unwritten" is a bit comparison and fp8 never needs arithmetic support.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def poison_value(dtype: torch.dtype) -> float:
    """The sentinel `poison` writes (floats: -3e38 clipped to the dtype's range; ints: the dtype's min).

    Exactly representable in `dtype` and in fp32, so it survives an fp32 round trip bit for bit.
    """
    if dtype.is_floating_point:
        value = max(_POISON_TARGET, torch.finfo(dtype).min)
        return float(torch.tensor(value, dtype=torch.float32).to(dtype).to(torch.float64).item())
    if dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"cannot poison a {dtype} tensor")
    return float(torch.iinfo(dtype).min)


def _poison_bits(dtype: torch.dtype) -> int:
    """The poison value's bit pattern as an integer of the same width as `dtype`."""
    if not dtype.is_floating_point:
        return int(poison_value(dtype))
    sentinel = torch.tensor([poison_value(dtype)], dtype=torch.float64).to(dtype)
    return int(sentinel.view(_BITS[dtype.itemsize]).item())


def _is_poison(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of elements bit-equal to the poison value of t's dtype."""
    bits = t.view(_BITS[t.dtype.itemsize]) if t.dtype.is_floating_point else t
    return bits == _poison_bits(t.dtype)


def _round_like(ref32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ref32 as a kernel storing it in `dtype` would: saturated first, since fp8 casts overflow to NaN."""
    if dtype == torch.float32 or not dtype.is_floating_point:
        return ref32.to(dtype)
    info = torch.finfo(dtype)
    return ref32.clamp(info.min, info.max).to(dtype)


def poison(out: torch.Tensor) -> None:
    """Fill `out` (any float/fp8/int dtype, any device, any strides) in place with `poison_value(out.dtype)`."""
    if out.dtype.is_floating_point:
        out.view(_BITS[out.dtype.itemsize]).fill_(_poison_bits(out.dtype))
    else:
        out.fill_(_poison_bits(out.dtype))


@dataclass(frozen=True)
class PreparedReference:
    """A reference every candidate of a problem is judged against, with what depends on it alone computed once (the
    worker checks each candidate twice: on a large MoE row the reference-only passes were half the gate's work).

    `plain`: every element finite and none rounding to the poison value in `dtype`, so `check_output` takes its short
    path (same verdict and figures as the general one, which handles the rest)."""

    ref32: torch.Tensor
    dtype: torch.dtype  # the output dtype it was prepared for
    tol: Tolerance
    plain: bool
    bound: torch.Tensor | None  # atol + rtol * |ref| (plain only)
    ref_norm: float


def prepare_reference(ref: torch.Tensor, out_dtype: torch.dtype, tol: Tolerance) -> PreparedReference:
    """`ref` (any float dtype, fp32 kept) prepared for judging outputs of `out_dtype` under `tol`."""
    ref32 = ref.to(torch.float32)
    finite = torch.isfinite(ref32)
    plain = bool(finite.all()) and not bool(_is_poison(_round_like(ref32, out_dtype)).any())
    bound = ref32.abs().mul_(tol.rtol).add_(tol.atol) if plain else None
    ref_norm = float(torch.linalg.vector_norm(torch.where(finite, ref32, 0.0), dtype=torch.float64))
    return PreparedReference(ref32, out_dtype, tol, plain, bound, ref_norm)


def check_output(out: torch.Tensor, ref: torch.Tensor | PreparedReference, tol: Tolerance) -> CheckResult:
    """Judge `out` (any float dtype; int works too) against `ref` (fp32, same shape) in fp32 on out's device.

    unwritten: elements still bit-equal to the poison value (unless the reference itself, saturated and
    rounded to out's dtype, equals it: an fp8 output at -448). nonfinite: NaN/Inf where the reference is finite.
    An element mismatches when |out-ref| > atol + rtol*|ref|; unwritten and nonfinite elements mismatch,
    and a non-finite reference element matches only the same Inf or a NaN. max_abs_err covers elements
    where both are finite and written; rel_l2_err = ||out-ref||/||ref|| is inf as soon as any element is
    unwritten, spuriously non-finite or differs from a non-finite reference.
    Fails on unwritten > 0, nonfinite > 0, mismatch_ratio > tol.max_mismatch_ratio or rel_l2 > tol.max_rel_l2.
    """
    prepared = ref if isinstance(ref, PreparedReference) else None
    if prepared is not None:
        ref = prepared.ref32
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    numel = out.numel()
    if numel == 0:
        return CheckResult(passed=True, mismatch_ratio=0.0, max_abs_err=0.0, rel_l2_err=0.0, unwritten=0, nonfinite=0)
    if (prepared is not None and prepared.plain and prepared.dtype == out.dtype and prepared.tol == tol
            and ref.device == out.device):
        return _check_plain(out, prepared, tol, numel)

    ref32 = ref.to(device=out.device, dtype=torch.float32)
    out32 = out.to(torch.float32)
    unwritten = _is_poison(out) & ~_is_poison(_round_like(ref32, out.dtype))
    ref_finite = torch.isfinite(ref32)
    out_finite = torch.isfinite(out32)
    nonfinite = ~out_finite & ref_finite
    both = out_finite & ref_finite & ~unwritten

    abs_diff = torch.where(both, out32 - ref32, 0.0).abs_()
    bound = ref32.abs().mul_(tol.rtol).add_(tol.atol)
    close = both & (abs_diff <= bound)
    del bound
    same_special = ~ref_finite & ((out32 == ref32) | (torch.isnan(out32) & torch.isnan(ref32)))
    close |= same_special
    special_bad = ~ref_finite & ~same_special

    # One device->host transfer for every number the verdict needs.
    stats = torch.stack(
        [
            unwritten.sum().double(),
            nonfinite.sum().double(),
            special_bad.sum().double(),
            close.sum().double(),
            abs_diff.max().double(),
            torch.linalg.vector_norm(abs_diff, dtype=torch.float64),
            torch.linalg.vector_norm(torch.where(ref_finite, ref32, 0.0), dtype=torch.float64),
        ]
    ).tolist()
    n_unwritten, n_nonfinite, n_special_bad, n_close = (int(x) for x in stats[:4])
    max_abs_err, diff_norm, ref_norm = stats[4:]

    return _verdict(numel, n_unwritten, n_nonfinite, n_special_bad, n_close, max_abs_err, diff_norm, ref_norm, tol)


def _check_plain(out: torch.Tensor, prepared: PreparedReference, tol: Tolerance, numel: int) -> CheckResult:
    """`check_output` against a plain prepared reference: no non-finite reference element and no poison collision,
    so nonfinite is ~isfinite(out), nothing is special, and the bound and the reference norm are already known."""
    out32 = out.to(torch.float32)
    unwritten = _is_poison(out)
    finite = torch.isfinite(out32)
    both = finite & ~unwritten
    abs_diff = torch.where(both, out32 - prepared.ref32, 0.0).abs_()
    close = both & (abs_diff <= prepared.bound)
    stats = torch.stack(
        [
            unwritten.sum().double(),
            (~finite).sum().double(),
            close.sum().double(),
            abs_diff.max().double(),
            torch.linalg.vector_norm(abs_diff, dtype=torch.float64),
        ]
    ).tolist()
    n_unwritten, n_nonfinite, n_close = (int(x) for x in stats[:3])
    return _verdict(numel, n_unwritten, n_nonfinite, 0, n_close, stats[3], stats[4], prepared.ref_norm, tol)


def _verdict(numel: int, n_unwritten: int, n_nonfinite: int, n_special_bad: int, n_close: int, max_abs_err: float,
             diff_norm: float, ref_norm: float, tol: Tolerance) -> CheckResult:
    mismatch_ratio = (numel - n_close) / numel
    if n_unwritten or n_nonfinite or n_special_bad:
        rel_l2 = float("inf")
    elif ref_norm == 0.0:
        rel_l2 = 0.0 if diff_norm == 0.0 else float("inf")
    else:
        rel_l2 = diff_norm / ref_norm

    reasons = []
    if n_unwritten:
        reasons.append(f"{n_unwritten} unwritten elements")
    if n_nonfinite:
        reasons.append(f"{n_nonfinite} non-finite elements")
    if mismatch_ratio > tol.max_mismatch_ratio:
        reasons.append(f"mismatch {100 * mismatch_ratio:.3g}% > {100 * tol.max_mismatch_ratio:.3g}%")
    if not rel_l2 <= tol.max_rel_l2:  # written so a NaN fails
        reasons.append(f"rel L2 {rel_l2:.3g} > {tol.max_rel_l2:.3g}")
    return CheckResult(
        passed=not reasons,
        mismatch_ratio=mismatch_ratio,
        max_abs_err=max_abs_err,
        rel_l2_err=rel_l2,
        unwritten=n_unwritten,
        nonfinite=n_nonfinite,
        reason="; ".join(reasons),
    )
