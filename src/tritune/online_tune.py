"""Online tuning's tuners (TRITUNE_ONLINE_TUNE=1): a short budgeted tune of one GEMM or fused-MoE shape on the caller's
GPU, persisted to TRITUNE_CONFIG_DIR by the tuners' own journal and locked, atomic writers. This module sits above
tuners, engine and store; the ops reach `TUNERS` by name through `tritune.ops.online` on their first miss.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tritune.device import DeviceInfo, current_device
from tritune.kernels.gemm import TAGS
from tritune.ops.online import GemmRequest, MoeRequest, Tuner
from tritune.store.atomic import path_lock
from tritune.store.fmoe_csv import USER_FILE_NAME, read_tuned
from tritune.store.gemm_json import read_gemm_file, shape_file_name
from tritune.tuners.fused_moe import MoeTuneRequest, tune_fmoe
from tritune.tuners.gemm import GemmShape, GemmTuneRequest, tune_gemm
from tritune.tuning.report import ProblemResult
from tritune.tuning.tuner import TuneSettings
from tritune.tuning.types import BenchSettings

__all__ = ["TUNERS", "online_settings", "tune_fmoe_online", "tune_gemm_online"]

# Candidates per second of budget the search may pick (per problem): a rough rate for a GPU, where the compile pool
# (every core) stays ahead of one benchmark worker; the wall-clock limit stops the search whichever comes first.
CANDIDATES_PER_S = 4
MIN_CANDIDATES = 8
FINALISTS = 3  # re-timed as the op runs (eager, CUDA graph); fewer than the CLI's 5, to keep within the budget
# Another process tuning the same shape holds its lock: wait for its budget plus this, then give up (heuristic).
LOCK_WAIT_EXTRA_S = 60.0


def online_settings(folder: Path, device: DeviceInfo, index: int, budget_s: float) -> TuneSettings:
    """The engine settings of an online tune on GPU `index` (-1: the interpreter): a neighbourhood search over about
    CANDIDATES_PER_S x `budget_s` candidates per problem, stopped `budget_s` seconds after the first result; the journal
    beside the outputs (`journal-<device>.sqlite`, as the CLI names it), so another process reuses what was measured.
    """
    bench = BenchSettings(iters=2, warmup=1, timeout_s=max(budget_s, 1.0)) if device.interpreter else \
        BenchSettings(iters=20, warmup=3, timeout_s=max(budget_s, 1.0))
    return TuneSettings(journal_path=folder / f"journal-{device.slug}.sqlite", bench=bench, num_gpus=1,
                        devices=(index,) if index >= 0 else None, strategy="neighbourhood",
                        budget=max(MIN_CANDIDATES, round(CANDIDATES_PER_S * budget_s)), progress=False,
                        finalists=FINALISTS, time_limit_s=budget_s)


def _device(index: int) -> DeviceInfo:
    return current_device(index) if index >= 0 else current_device()


def _lock_wait(budget_s: float) -> float:
    return budget_s + LOCK_WAIT_EXTRA_S


def _statuses(results: list[ProblemResult]) -> str:
    counts = Counter(m.status.value for r in results for m in r.measurements)
    return ", ".join(f"{status}={n}" for status, n in sorted(counts.items())) or "no candidate"


def tune_gemm_online(request: GemmRequest, folder: Path, budget_s: float) -> None:
    """Tune `request.M` of the (N, K) shape file the op missed and write it into `folder`; RuntimeError when no
    candidate passed in time. The shape file's lock is held throughout: a second process missing the same shape
    waits, then finds the file and tunes nothing."""
    device = _device(request.device)
    path = folder / shape_file_name(device.slug, TAGS[request.kernel], request.N, request.K)
    with path_lock(path).acquire(timeout=_lock_wait(budget_s)):
        if path.is_file():  # written while this process waited for the lock
            read_gemm_file(path)  # a malformed file is a ValueError here, not a silent heuristic
            return
        # The shape file serves every operand type of the kernel: bf16 operands on a GPU; fp16 in the interpreter,
        # whose tl.dot is wrong on bf16.
        dtype = "fp16" if device.interpreter else "bf16"
        req = GemmTuneRequest(request.kernel, (GemmShape((request.M,), request.N, request.K),), folder, dtype=dtype)
        report = tune_gemm(req, device, online_settings(folder, device, request.device, budget_s))
    if report.failed_problems:
        raise RuntimeError(f"no candidate passed within {budget_s:g}s ({_statuses(report.results)})")


def tune_fmoe_online(request: MoeRequest, folder: Path, budget_s: float) -> None:
    """Tune the fused-MoE row the op missed (its shape at the asked token count) and merge it into
    `folder/tuned_fmoe.csv`, the file the ops read from TRITUNE_CONFIG_DIR; RuntimeError when nothing passed in
    time. That file's lock is held throughout, so online MoE tunes of one folder run one at a time; a process that
    waited finds the shape's rows and tunes nothing."""
    device = _device(request.device)
    output = folder / USER_FILE_NAME
    shape = request.shape
    with path_lock(output).acquire(timeout=_lock_wait(budget_s)):
        if output.is_file() and any(row.cu_num == device.cu_num and row.shape.shape_key() == shape.shape_key()
                                    and dict(row.extra).get("device") == device.name for row in read_tuned(output)):
            return  # tuned while this process waited for the lock
        req = MoeTuneRequest(input=output, output=output)  # `input` is not read: the plan names the one row
        report = tune_fmoe(req, device, online_settings(folder, device, request.device, budget_s),
                           plan=([shape], []))
    if not report.written:
        why = "; ".join(reason for _, reason in report.failed) or "nothing written"
        raise RuntimeError(f"{why} within {budget_s:g}s ({_statuses(report.results)})")


TUNERS: dict[str, Tuner] = {"gemm": tune_gemm_online, "fused_moe": tune_fmoe_online}
