"""Whether a tuned file fits the machine it is read on: what the machine is (`Machine`), what a file recorded
(`Recorded`), the one policy comparing them (`compare`), and the once-per-process warning a lookup gives.

Policy: another device name, another SM count, or interpreter-tuned vs GPU (either way) -> skipped; another
Triton major.minor -> used, with a warning. Whatever the file did not record is not compared. An interpreted run
records 0 SMs (no GPU ran), and 0 SMs is read as interpreted, so such a file never fits a GPU.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from tritune.device import INTERPRETER_NAME, current_device


def triton_minor(version: str) -> str:
    """'3.6.0' -> '3.6', '3.9.0+git1234' -> '3.9'; text without a major.minor is returned stripped."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return f"{match[1]}.{match[2]}" if match else version.strip()


@dataclass(frozen=True)
class Machine:
    """The machine a lookup serves: what `compare` holds a file's provenance against."""

    name: str  # DeviceInfo.name, e.g. "NVIDIA H100 80GB HBM3", or "cpu-interpreter"
    sm_count: int  # DeviceInfo.cu_num: 0 for the interpreter
    triton_version: str
    interpreter: bool = False

    def describe(self) -> str:
        """'NVIDIA H100 80GB HBM3 (132 SMs, Triton 3.9)', 'cpu-interpreter (no GPU, Triton 3.9)'."""
        sms = "no GPU" if self.interpreter else f"{self.sm_count} SMs"
        return f"{self.name} ({sms}, Triton {triton_minor(self.triton_version)})"


def machine_of(info) -> Machine:
    """The Machine of a `tritune.device.DeviceInfo` (or anything with its attribute names): the interpreter's
    has 0 SMs, as its outputs record."""
    interpreter = bool(info.interpreter)
    return Machine(info.name, 0 if interpreter else info.sm_count, info.triton_version, interpreter)


def running_machine(device_index: int | None = None) -> Machine:
    """The Machine of GPU `device_index` (None: the current one), or of the interpreter stand-in without a GPU.

    Built from `tritune.device.current_device`, which is cached, so calling this per lookup miss is cheap.
    """
    import torch

    return machine_of(current_device(device_index) if torch.cuda.is_available() else current_device())


def _text(prov: Mapping, key: str) -> str | None:
    value = prov.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"provenance {key}={value!r} is not a string")
    return value


@dataclass(frozen=True)
class Recorded:
    """What a file (or a group of its rows) says it was tuned on; None where it does not say."""

    name: str | None = None
    sm_count: int | None = None
    triton_version: str | None = None
    interpreter: bool | None = None
    torch_version: str | None = None

    @staticmethod
    def from_provenance(prov: Mapping) -> Recorded:
        """From a `DeviceInfo.provenance()` dict (name, sm_count, triton_version, torch_version, interpreter).

        Missing keys stay None; a present key of the wrong type is a ValueError naming it.
        """
        sm_count, interpreter = prov.get("sm_count"), prov.get("interpreter")
        if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 0):
            raise ValueError(f"provenance sm_count={sm_count!r} is not an integer >= 0 (0: no GPU)")
        if interpreter is not None and not isinstance(interpreter, bool):
            raise ValueError(f"provenance interpreter={interpreter!r} is not true/false")
        return Recorded(_text(prov, "name"), sm_count, _text(prov, "triton_version"), interpreter,
                        _text(prov, "torch_version"))

    @property
    def by_interpreter(self) -> bool | None:
        """Tuned through Triton's interpreter: the flag if recorded, else read from 0 SMs or the device name."""
        if self.interpreter is not None:
            return self.interpreter
        if self.sm_count == 0:
            return True
        return None if self.name is None else self.name == INTERPRETER_NAME

    def _sms(self) -> str:
        if self.sm_count is None:
            return ""
        return "no GPU" if self.sm_count == 0 else f"{self.sm_count} SMs"

    def describe(self) -> str:
        """'NVIDIA H200, 132 SMs, Triton 3.6.0, torch 2.11.0' (what is known), or 'no provenance recorded'."""
        parts = [self.name or "", self._sms(),
                 f"Triton {self.triton_version}" if self.triton_version else "",
                 f"torch {self.torch_version}" if self.torch_version else ""]
        return ", ".join(p for p in parts if p) or "no provenance recorded"

    def short(self) -> str:
        """'NVIDIA H200 (132 SMs, Triton 3.6)': the form a warning sets beside Machine.describe()."""
        inside = [self._sms(),
                  f"Triton {triton_minor(self.triton_version)}" if self.triton_version else ""]
        inside_text = ", ".join(p for p in inside if p)
        return (self.name or "an unnamed device") + (f" ({inside_text})" if inside_text else "")


@dataclass(frozen=True)
class Verdict:
    """What `compare` decided: `skip` says why the machine must not use the file, `stale` why it is used with a
    warning; both empty: used as is."""

    skip: str = ""
    stale: str = ""

    @property
    def ok(self) -> bool:
        return not self.skip and not self.stale

    def status(self) -> str:
        """'used', 'used (Triton 3.6 != 3.9)' or 'skipped: tuned on NVIDIA H200, this is cpu-interpreter'."""
        if self.skip:
            return f"skipped: {self.skip}"
        return f"used ({self.stale})" if self.stale else "used"


@functools.cache
def compare(recorded: Recorded, machine: Machine) -> Verdict:
    """The policy (cached: one decision per distinct provenance and machine)."""
    interp = recorded.by_interpreter
    skip = ""
    if recorded.name is not None and recorded.name != machine.name:
        skip = f"tuned on {recorded.name}, this is {machine.name}"
    elif interp is not None and interp != machine.interpreter:
        skip = (f"tuned {'by the interpreter' if interp else 'on a GPU'}, this is "
                f"{machine.name}{' (no GPU)' if machine.interpreter else ''}")
    elif recorded.sm_count is not None and recorded.sm_count != machine.sm_count:
        skip = f"tuned with {recorded.sm_count} SMs, this {machine.name} has {machine.sm_count}"
    stale = ""
    if recorded.triton_version is not None:
        tuned, running = triton_minor(recorded.triton_version), triton_minor(machine.triton_version)
        if tuned != running:
            stale = f"Triton {tuned} != {running}"
    return Verdict(skip, stale)


def mismatch_message(where: str, recorded: Recorded, machine: Machine, verdict: Verdict) -> str:
    """'tritune: <where> was tuned on NVIDIA H200 (132 SMs, Triton 3.6); this is NVIDIA H100 80GB HBM3
    (132 SMs, Triton 3.9): not using it (tuned on NVIDIA H200, this is ...)' or '...: using it anyway (Triton
    3.6 != 3.9)'."""
    action = f"not using it ({verdict.skip})" if verdict.skip else f"using it anyway ({verdict.stale})"
    return f"tritune: {where} was tuned on {recorded.short()}; this is {machine.describe()}: {action}"


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn_once(message: str) -> None:
    """warnings.warn(message) the first time this process sees `message` (it names the file and the mismatch, so
    this is one warning per file and mismatch); later calls are silent whatever the warning filters say."""
    with _WARNED_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    warnings.warn(message, stacklevel=3)


def check(where: str, recorded: Recorded, machine: Machine) -> Verdict:
    """compare(), warning once when the verdict is not 'used as is'. What a lookup calls for a file it would serve."""
    verdict = compare(recorded, machine)
    if not verdict.ok:
        warn_once(mismatch_message(where, recorded, machine, verdict))
    return verdict
