"""Correctness gate: each failure kind, passing cases in low precision, and the poison surviving dtype trips."""

from __future__ import annotations

import math

import pytest
import torch

from tritune.tuning.check import check_output, poison, poison_value
from tritune.tuning.tunable import Tolerance

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64]
TIGHT = Tolerance(atol=1e-5, rtol=1e-5, max_mismatch_ratio=0.0, max_rel_l2=1e-3)


def _ref(shape: tuple[int, ...] = (64, 96), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", FLOATS + [torch.int8, torch.int32])
def test_poison_is_finite_and_survives_round_trip(dtype: torch.dtype) -> None:
    value = poison_value(dtype)
    assert math.isfinite(value) and value < 0
    out = torch.empty(5, 7, dtype=dtype)
    poison(out)
    assert (out.to(torch.float64) == value).all()
    # Through fp32 and back (what a kernel storing a loaded value would do) the bits are unchanged.
    assert torch.equal(out.to(torch.float32).to(dtype).view(torch.uint8), out.view(torch.uint8))
    assert torch.tensor(value, dtype=torch.float64).to(dtype).to(torch.float64).item() == value


def test_poison_values() -> None:
    assert poison_value(torch.float16) == -65504.0  # clipped to finfo.min
    assert poison_value(torch.float8_e4m3fn) == -448.0
    assert poison_value(torch.float32) == pytest.approx(-3.0e38, rel=1e-6)
    assert poison_value(torch.int32) == -(2**31)


def test_poison_non_contiguous() -> None:
    base = torch.zeros(8, 8, dtype=torch.bfloat16)
    poison(base.t()[:, ::2])  # strided view
    assert (base[::2, :] == poison_value(torch.bfloat16)).all() and (base[1::2, :] == 0).all()


def test_pass_fp32() -> None:
    ref = _ref()
    result = check_output(ref.clone(), ref, TIGHT)
    assert result.passed and result.reason == ""
    assert result.mismatch_ratio == 0.0 and result.max_abs_err == 0.0 and result.rel_l2_err == 0.0
    assert result.unwritten == 0 and result.nonfinite == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pass_low_precision(dtype: torch.dtype) -> None:
    ref = _ref()
    tol = Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_ratio=0.0, max_rel_l2=1e-2)
    result = check_output(ref.to(dtype), ref, tol)
    assert result.passed, result.reason
    assert 0 < result.max_abs_err < 1e-1 and 0 < result.rel_l2_err < 1e-2
    # The same rounding fails a tolerance tighter than the dtype can meet.
    assert not check_output(ref.to(dtype), ref, TIGHT).passed


def test_unwritten() -> None:
    ref = _ref()
    out = ref.to(torch.bfloat16)
    poison(out[3, :3])  # 3 elements the "kernel" never stored
    tol = Tolerance(atol=1.0, rtol=1.0, max_mismatch_ratio=0.5, max_rel_l2=1e9)  # loose tolerances do not help
    result = check_output(out, ref, tol)
    assert not result.passed
    assert result.unwritten == 3 and result.nonfinite == 0
    assert result.reason.startswith("3 unwritten elements")
    assert result.rel_l2_err == math.inf
    assert result.max_abs_err < 1.0  # the poison does not pollute the error of written elements


def test_reference_equal_to_poison_is_not_unwritten() -> None:
    # An fp8 output saturating at -448 where the reference is below it was written, not left poisoned.
    out = torch.tensor([-448.0, 1.0, 2.0]).to(torch.float8_e4m3fn)
    for below in (-450.0, -500.0):  # rounds to -448; beyond the range (torch's cast may give NaN there)
        ref = torch.tensor([below, 1.0, 2.0])
        result = check_output(out, ref, Tolerance(atol=0.0, rtol=0.2, max_rel_l2=1.0))
        assert result.unwritten == 0 and result.passed, result.reason
    # A poisoned element whose reference is elsewhere still counts.
    result = check_output(out, torch.tensor([-300.0, 1.0, 2.0]), Tolerance(atol=0.0, rtol=1.0, max_rel_l2=1.0))
    assert result.unwritten == 1 and not result.passed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite(bad: float) -> None:
    ref = _ref()
    out = ref.clone()
    out[0, 0] = bad
    out[5, 7] = bad
    result = check_output(out, ref, Tolerance(atol=1.0, rtol=1.0, max_mismatch_ratio=0.5, max_rel_l2=1e9))
    assert not result.passed and result.nonfinite == 2 and result.unwritten == 0
    assert result.reason.startswith("2 non-finite elements")
    assert result.rel_l2_err == math.inf and math.isfinite(result.max_abs_err)


def test_nonfinite_reference_matches_same_value() -> None:
    ref = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    assert check_output(ref.clone(), ref, TIGHT).passed
    result = check_output(torch.tensor([math.inf, math.inf, math.nan, 1.0]), ref, TIGHT)
    assert not result.passed and result.nonfinite == 0 and result.mismatch_ratio == 0.25


def test_mismatch_ratio() -> None:
    ref = torch.ones(8, 100)
    out = ref.clone()
    out[0, :] += 1e-2  # 100 of 800 elements = 12.5%, small in L2
    tol = Tolerance(atol=1e-3, rtol=0.0, max_mismatch_ratio=0.005, max_rel_l2=1.0)
    result = check_output(out, ref, tol)
    assert not result.passed
    assert result.mismatch_ratio == 0.125 and result.reason == "mismatch 12.5% > 0.5%"
    assert result.max_abs_err == pytest.approx(1e-2, rel=1e-3)
    # The same output passes once the allowed ratio covers it.
    loose = Tolerance(atol=1e-3, rtol=0.0, max_mismatch_ratio=0.2, max_rel_l2=1.0)
    assert check_output(out, ref, loose).passed


def test_rel_l2() -> None:
    ref = torch.ones(10, 10)
    out = ref * 1.2  # every element within atol, but 20% off in L2
    result = check_output(out, ref, Tolerance(atol=0.5, rtol=0.0, max_mismatch_ratio=0.0, max_rel_l2=0.01))
    assert not result.passed and result.mismatch_ratio == 0.0
    assert result.rel_l2_err == pytest.approx(0.2, rel=1e-5) and result.reason == "rel L2 0.2 > 0.01"


def test_zero_reference() -> None:
    ref = torch.zeros(4, 4)
    assert check_output(ref.clone(), ref, TIGHT).rel_l2_err == 0.0
    result = check_output(ref + 1.0, ref, Tolerance(atol=2.0, rtol=0.0))
    assert not result.passed and result.rel_l2_err == math.inf


def test_empty_passes() -> None:
    result = check_output(torch.empty(0, 16, dtype=torch.float16), torch.empty(0, 16), TIGHT)
    assert result.passed and result.mismatch_ratio == 0.0


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shape"):
        check_output(torch.zeros(4, 4), torch.zeros(4, 5), TIGHT)
    with pytest.raises(ValueError, match="shape"):
        check_output(torch.zeros(16), torch.zeros(4, 4), TIGHT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_a_prepared_reference_gives_the_same_verdict_and_figures(dtype):
    """The worker prepares each problem's reference once; its short path must judge exactly as the general one, on
    clean, unwritten, non-finite and mismatching outputs, and on references it cannot take the short path for."""
    from tritune.tuning.check import prepare_reference

    gen = torch.Generator().manual_seed(7)
    tol = Tolerance(atol=1e-2, rtol=1e-2, max_mismatch_ratio=0.05)
    ref = torch.randn(37, 29, generator=gen)
    ref_inf = ref.clone()
    ref_inf[3, 4] = float("inf")
    ref_poison = ref.clone()
    ref_poison[0, 0] = poison_value(dtype)  # rounds to the poison: unwritten there is not counted
    for reference, plain in ((ref, True), (ref_inf, False), (ref_poison, False)):
        prepared = prepare_reference(reference, dtype, tol)
        assert prepared.plain is plain
        good = reference.clamp(-400, 400).to(dtype)
        noisy = (reference + 0.05 * torch.randn(reference.shape, generator=gen)).clamp(-400, 400).to(dtype)
        partial = good.clone()
        poison(partial[5:9])
        nan = good.clone()
        if dtype.itemsize > 1:
            nan[2, :3] = float("nan")
        for out in (good, noisy, partial, nan):
            assert check_output(out, prepared, tol) == check_output(out, reference, tol)
    other = Tolerance(atol=0.0, rtol=0.0)  # a prepared reference judged under another tolerance: general path
    assert check_output(good, prepare_reference(ref, dtype, tol), other) == check_output(good, ref, other)
