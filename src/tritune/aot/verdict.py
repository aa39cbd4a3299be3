"""The pass/fail of one artifact run: what the executable's exit status, result line and stderr say, turned
into a Verdict with a one-line reason. Valid only when everything agrees; any doubt is a failure.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import dataclass
from typing import Any

RESULT_PREFIX = "TRITUNE_RESULT "
_NO_RESULT = "no result line"
_REASON_MAX = 300

# What the main's exit codes mean (docs/AOT.md), said when stderr is silent.
EXIT_MEANINGS = {1: "wrong output", 2: "usage or spec error", 3: "data file missing or malformed",
                 4: "CUDA error", 5: "the spec does not fit the artifact"}


@dataclass(frozen=True)
class Verdict:
    """One artifact's outcome. Times are microseconds, nan when not measured or not trusted."""

    valid: bool
    reason: str
    median_us: float = math.nan
    min_us: float = math.nan
    max_us: float = math.nan
    reps: int = 0
    exit_code: int | None = None
    signal: int | None = None


def not_run(reason: str) -> Verdict:
    """A failure found before running (not built, no binary): nothing ran, so no exit code."""
    return Verdict(valid=False, reason=_one_line(reason))


def not_built(error: str, status: str = "compile_error") -> Verdict:
    """The verdict of a manifest artifact whose status is not "ok" (compile_error, out_of_resources)."""
    kind = "" if status == "compile_error" else f"{status}: "
    if not error.strip():
        return not_run(f"not built: {kind or 'compile error '}(no message)")
    return not_run(f"not built: {kind}{error}")


def judge(artifact_id: str, returncode: int | None, stdout: str, stderr: str, timed_out: bool,
          *, timeout_s: float | None = None) -> Verdict:
    """Decide whether one run of `bin/<artifact_id>` is a valid measurement.

    Valid only when the run finished in time with exit 0 and the last `TRITUNE_RESULT ` line of `stdout` is a
    JSON object for this artifact saying valid, with finite times 0 < min <= median <= max and reps >= 1.
    `returncode` is subprocess's: negative for a signal. `timeout_s` only words the timeout reason.
    """
    if timed_out:
        after = f" after {timeout_s:g}s" if timeout_s is not None else ""
        return Verdict(False, f"timeout{after}")
    if returncode is None:
        return Verdict(False, "did not finish (no exit status)")
    if returncode < 0:
        return Verdict(False, f"crashed: signal {_signal_name(-returncode)}", signal=-returncode)
    result, problem = _result(stdout)
    if returncode == 0:
        return _judge_success(artifact_id, result, problem)
    fail = _failure(artifact_id, returncode, result, stderr)
    return Verdict(False, _one_line(fail), exit_code=returncode)


def _judge_success(artifact_id: str, result: dict[str, Any] | None, problem: str) -> Verdict:
    """Exit 0: trust nothing the result line does not back up."""
    def bad(reason: str) -> Verdict:
        return Verdict(False, _one_line(reason), exit_code=0)

    if result is None:
        return bad("exit 0 but no result line" if problem == _NO_RESULT else problem)
    if result.get("artifact") != artifact_id:
        return bad(f"result is for artifact {result.get('artifact')!r}, not {artifact_id!r}")
    if result.get("valid") is not True:
        return bad(f"exit 0 but result says not valid: {_check_numbers(result)}")
    times = [result.get(key) for key in ("median_us", "min_us", "max_us")]
    if not all(_is_number(t) for t in times):
        return bad("result says valid but times are missing or not numbers")
    median, low, high = (float(t) for t in times)
    if not all(math.isfinite(t) for t in (median, low, high)):
        return bad("result says valid but times are not finite")
    if min(median, low, high) <= 0:
        return bad(f"result says valid but times are not positive (median_us={median:g})")
    if not low <= median <= high:
        return bad(f"result says valid but times are out of order (min {low:g}, median {median:g}, max {high:g})")
    reps = result.get("reps")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        return bad(f"result says valid but reps is {reps!r}")
    return Verdict(True, "", median_us=median, min_us=low, max_us=high, reps=reps, exit_code=0)


def _failure(artifact_id: str, code: int, result: dict[str, Any] | None, stderr: str) -> str:
    """The reason for a non-zero exit: the wrong-output numbers for exit 1, else the last stderr line."""
    ours = result is not None and result.get("artifact") == artifact_id
    if code == 1 and ours and result.get("valid") is False:
        return f"wrong output: {_check_numbers(result)}"
    message = _last_line(stderr)
    if not message and ours and isinstance(result.get("error"), str) and result["error"].strip():
        message = result["error"]
    if not message:
        meaning = EXIT_MEANINGS.get(code, "unknown exit status")
        message = f"{meaning} (nothing on stderr)"
    return f"exit {code}: {message}"


def _check_numbers(result: dict[str, Any]) -> str:
    parts = [f"{key}={_fmt(result.get(key))}" for key in ("mismatch_ratio", "rel_l2") if key in result]
    error = result.get("error")
    if isinstance(error, str) and error.strip():
        parts.append(error.strip())
    return ", ".join(parts) or "no accuracy numbers"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if _is_number(value) else repr(value)


def _result(stdout: str) -> tuple[dict[str, Any] | None, str]:
    """The parsed last result line, or None and why not. Later output lines do not hide it."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        return None, _NO_RESULT
    try:
        result = json.loads(lines[-1][len(RESULT_PREFIX):])
    except json.JSONDecodeError as err:
        return None, f"result line is not JSON ({err.msg})"
    if not isinstance(result, dict):
        return None, "result line is not a JSON object"
    return result, ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _one_line(text: str) -> str:
    """Reasons go into CSV cells and SVG text: one line, bounded, no control characters."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 3] + "..."
