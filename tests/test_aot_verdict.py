"""aot.verdict.judge: only a clean exit with a matching, sane result line is valid; every other outcome is a
failure with a one-line reason."""

import json
import math

import pytest

from tritune.aot.verdict import Verdict, judge, not_built

ID = "moe_stage1_BM64_BN128_BK64_GM8_W4_S3"


def result_line(**over):
    obj = {"artifact": ID, "valid": True, "max_abs_err": 0.0, "mismatch_ratio": 0.0, "rel_l2": 0.0,
           "median_us": 10.5, "min_us": 9.75, "max_us": 12.0, "reps": 100, "grid": [4, 1, 1], "error": ""}
    obj.update(over)
    return "TRITUNE_RESULT " + json.dumps(obj)


def test_good_run_is_valid_with_times():
    v = judge(ID, 0, "loading\n" + result_line() + "\n", "", False)
    assert v == Verdict(True, "", 10.5, 9.75, 12.0, 100, 0, None)


def test_result_line_followed_by_other_output_still_counts():
    v = judge(ID, 0, result_line() + "\nbye\nstats done\n", "", False)
    assert v.valid and v.median_us == 10.5


def test_last_result_line_wins():
    # An earlier line says valid; the last one (the final check) says not valid.
    stdout = result_line() + "\n" + result_line(valid=False, mismatch_ratio=0.5) + "\n"
    v = judge(ID, 0, stdout, "", False)
    assert not v.valid and "not valid" in v.reason and "mismatch_ratio=0.5" in v.reason


def test_wrong_output_exit_1():
    v = judge(ID, 1, result_line(valid=False, mismatch_ratio=0.25, rel_l2=0.5) + "\n",
              "mismatch in out: 25% of elements\n", False)
    assert not v.valid
    assert v.reason == "wrong output: mismatch_ratio=0.25, rel_l2=0.5"
    assert v.exit_code == 1 and math.isnan(v.median_us) and v.reps == 0


def test_exit_1_without_result_names_stderr():
    v = judge(ID, 1, "", "something odd\n", False)
    assert v.reason == "exit 1: something odd"


def test_missing_data_exit_3_uses_last_stderr_line():
    v = judge(ID, 3, "", "reading spec\ncannot open data/x.tdat: No such file or directory\n\n", False)
    assert not v.valid
    assert v.reason == "exit 3: cannot open data/x.tdat: No such file or directory"
    assert v.exit_code == 3 and v.signal is None


@pytest.mark.parametrize("code, message", [(4, "CUDA error: an illegal memory access was encountered (launch)"),
                                           (5, "arg K=100 breaks specialization 16 of the artifact")])
def test_cuda_and_spec_errors(code, message):
    v = judge(ID, code, "", message + "\n", False)
    assert not v.valid and v.reason == f"exit {code}: {message}" and v.exit_code == code


def test_nonzero_exit_with_silent_stderr_says_what_the_code_means():
    v = judge(ID, 4, "", "", False)
    assert v.reason == "exit 4: CUDA error (nothing on stderr)"


def test_nonzero_exit_is_never_valid_even_with_a_valid_result_line():
    v = judge(ID, 4, result_line() + "\n", "CUDA error: unspecified launch failure\n", False)
    assert not v.valid and v.reason == "exit 4: CUDA error: unspecified launch failure"


def test_crash_by_signal():
    v = judge(ID, -11, result_line() + "\n", "", False)
    assert not v.valid and v.reason == "crashed: signal SIGSEGV" and v.signal == 11 and v.exit_code is None


def test_timeout_wins_over_everything():
    v = judge(ID, -9, result_line() + "\n", "", True, timeout_s=2.5)
    assert not v.valid and v.reason == "timeout after 2.5s"


def test_exit_0_without_result_line():
    v = judge(ID, 0, "all good, trust me\n", "", False)
    assert not v.valid and v.reason == "exit 0 but no result line" and v.exit_code == 0


def test_exit_0_with_result_for_another_artifact():
    v = judge(ID, 0, result_line(artifact="other_BM16") + "\n", "", False)
    assert not v.valid and v.reason.startswith("result is for artifact 'other_BM16'")


def test_exit_0_with_garbage_json():
    v = judge(ID, 0, 'TRITUNE_RESULT {"artifact": "x", "median_us": nan}\n', "", False)
    assert not v.valid and v.reason.startswith("result line is not JSON")


def test_exit_0_with_json_that_is_not_an_object():
    v = judge(ID, 0, "TRITUNE_RESULT [1, 2]\n", "", False)
    assert not v.valid and v.reason == "result line is not a JSON object"


@pytest.mark.parametrize("over, reason", [
    ({"median_us": float("nan")}, "result says valid but times are not finite"),
    ({"max_us": float("inf")}, "result says valid but times are not finite"),
    ({"median_us": 0.0, "min_us": 0.0}, "result says valid but times are not positive"),
    ({"median_us": None}, "result says valid but times are missing or not numbers"),
    ({"min_us": 11.0}, "result says valid but times are out of order"),
    ({"reps": 0}, "result says valid but reps is 0"),
    ({"valid": "true"}, "exit 0 but result says not valid"),
])
def test_exit_0_with_valid_true_but_bad_numbers(over, reason):
    v = judge(ID, 0, result_line(**over) + "\n", "", False)
    assert not v.valid and v.reason.startswith(reason)
    assert math.isnan(v.median_us)


def test_reason_is_one_bounded_line():
    v = judge(ID, 3, "", "bad\x00 file\tname " + "x" * 1000 + "\n", False)
    assert "\n" not in v.reason and "\x00" not in v.reason and len(v.reason) <= 300


def test_not_built():
    v = not_built("triton.CompilationError: out of resources: shared memory\nmore")
    assert not v.valid and v.reason == "not built: triton.CompilationError: out of resources: shared memory more"
    assert not_built("").reason == "not built: compile error (no message)"
    oor = not_built("shared memory 262144 > 232448", "out_of_resources")
    assert not oor.valid and oor.reason == "not built: out_of_resources: shared memory 262144 > 232448"
