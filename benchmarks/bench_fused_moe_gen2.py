r"""Fused MoE, generation 2 (issue 14): tritune's whole op against vLLM 0.33's two GEMM launches with vLLM's own config,
and against the roofline floor, on held-out shapes (models not in examples/), same inputs, one process, one timer.

Here, once (peers_vllm/ is git-ignored: third-party code is measured beside the project, never committed; vllm_moe.py
is copied in because ../shared does not travel to the device):

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm-wheel
    python ../shared/peers/extract_vllm.py /tmp/vllm-wheel/vllm-*.whl peers_vllm
    cp ../shared/peers/vllm_moe.py peers_vllm/

On the device (repository root; run with timeout_s 600 and carry ["peers_vllm"], about 2 MB):

    set -o pipefail; PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/bench_fused_moe_gen2.py \
        --vendor-dir peers_vllm --out $OUT/bench_fused_moe_gen2.json --tune-row qwen3-30b-a3b:1024 \
        --time-limit 420 [--variant SORTED_INTER=1,TOPK_ATOMIC=1] 2>&1 | tee $OUT/bench_fused_moe_gen2.log

Rows past --time-limit are listed as skipped in the JSON; rerun them with --shapes / --fp8-shapes / --tokens.

Contestants: ours = `tritune.ops.fused_moe` with its own choice (sort, quantization, GEMMs, activation, top-k sum);
each --variant = the op with its own choice's MoeConfig fields replaced (dataclasses.replace; a field MoeConfig lacks
is skipped with a note); vLLM = `VllmMoe.kernels()` (bf16) or `VllmBlockFp8.kernels()` (per_1x128): its two GEMM
launches alone on a ready sort and pre-quantized activations, a lower bound of vLLM's op; floor = max(FLOPs / peak,
(routed experts' weights + input and output activations) / bandwidth). GPU time: median of --iters calls, L2 flushed
(tritune.tuning.bench.time_kernel); ours also eager / CUDA-graph per call (bench_runtime.eager_and_graph). Each
contestant is first checked against the fp32 reference (relative L2 error in the JSON; above 5e-2 flagged WRONG).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {  # name -> (model_dim D, inter_dim I, experts E, topk); none is in examples/ or the shipped tuned CSV
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "gpt-oss-20b-like": (2880, 2880, 32, 4),
    "mixtral-8x22b": (6144, 16384, 8, 2),
    "qwen2-57b-a14b-tp2": (3584, 1280, 64, 8),  # vLLM ships E=64,N=1280 for the H100 (bf16)
}
HELD_OUT = tuple(SHAPES)  # the default --shapes: measured untuned, as a user first meets the op
# Issue 14's target table: each point tuned by `tritune moe` first (--write-untuned, then --tuned-csv).
TARGET_SHAPES = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "e128-top8-i384": (4096, 384, 128, 8),  # vLLM ships an H100 file for E=128,N=384
    "e64-top6-i1536": (2048, 1536, 64, 6),  # vLLM ships an H100 file for E=64,N=1536
}
TARGET_TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
SHAPES |= TARGET_SHAPES
FP8_SHAPES = ("qwen3-30b-a3b", "deepseek-v2-lite")  # per_1x128: vLLM's kernel has a 128x128 block-fp8 path
TOKENS = (1, 8, 64, 333, 1024, 2048, 6000)
PEAKS = {"bf16_flops": 730e12, "fp8_flops": 1250e12, "bytes_per_s": 3.0e12}  # H100 SXM: the floor
BLOCK = 128  # per_1x128: activation groups of 128, weight blocks of 128x128
WRONG = 5e-2  # relative L2 error above which a contestant is flagged WRONG


def floor_us(tokens: int, d: int, inter: int, topk: int, routed: int, quant: str, peaks: dict = PEAKS) -> float:
    """Roofline floor (µs) of one gated MoE call: its FLOPs at peak, or the routed experts' weights (w1 [2I, D] and
    w2 [D, I]; 1 byte in fp8, scales not counted, else 2) plus the bf16 input and output [T, D] at bandwidth."""
    flops = 2.0 * tokens * topk * 3 * d * inter
    nbytes = routed * 3 * d * inter * (1 if quant != "none" else 2) + 2 * tokens * d * 2
    peak = peaks["bf16_flops"] if quant == "none" else peaks["fp8_flops"]
    return 1e6 * max(flops / peak, nbytes / peaks["bytes_per_s"])


def routed_experts(topk_ids: torch.Tensor) -> int:
    """Experts that at least one token is routed to (the only weights a call must read)."""
    return int(torch.unique(topk_ids).numel())


def parse_variant(text: str, fields: set[str]) -> tuple[dict, dict, list[str]]:
    """'A=1,s2.B=0' -> (stage-1 fields, stage-2 fields, notes). A bare field applies to both stages (and the 1-stage
    kernel), s1./s2. to one; a field not in `fields` (MoeConfig's) is skipped with a note."""
    s1, s2, notes = {}, {}, []
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        stage, _, name = key.rpartition(".")
        if not sep or stage not in ("", "s1", "s2") or not value.lstrip("-").isdigit():
            raise ValueError(f"variant {text!r}: {item!r} is not [s1.|s2.]FIELD=INT")
        if name not in fields:
            notes.append(f"variant {text!r}: MoeConfig has no field {name!r} here; skipped")
            continue
        for target in ((s1, s2) if not stage else (s1,) if stage == "s1" else (s2,)):
            target[name] = int(value)
    return s1, s2, notes


def apply_variant(choice, s1: dict, s2: dict):
    """The MoeChoice `choice` with its stage configs' fields replaced (a 1-stage choice takes only s1's)."""
    stage2 = None if choice.stage2 is None else dataclasses.replace(choice.stage2, **s2)
    return dataclasses.replace(choice, stage1=dataclasses.replace(choice.stage1, **s1), stage2=stage2,
                               source=f"variant of {choice.source}")


def vllm_block_fp8_config(tokens: int, experts: int, inter: int, vendor_dir, device_file_name: str) -> tuple[dict, str]:
    """vLLM 0.33's block-fp8 choice: its shipped file for (E, N=inter, device, fp8_w8a8, [128,128]) at the nearest
    batch size, else its get_default_config on CUDA (read from the wheel's fused_moe.py)."""
    name = "NVIDIA_H200" if "H200" in device_file_name.split("_") else device_file_name
    path = pathlib.Path(vendor_dir, "configs",
                        f"E={experts},N={inter},device_name={name},dtype=fp8_w8a8,block_shape=[{BLOCK},{BLOCK}].json")
    if path.exists():
        table = {int(k): v for k, v in json.loads(path.read_text()).items() if k.isdigit()}
        return dict(table[min(table, key=lambda k: abs(k - tokens))]), path.name
    small = tokens <= 8
    return {"BLOCK_SIZE_M": 16 if tokens <= 64 else 64, "BLOCK_SIZE_N": 64 if small else BLOCK, "BLOCK_SIZE_K": BLOCK,
            "GROUP_SIZE_M": 1 if tokens <= 16 else 32, "num_warps": 4,
            "num_stages": (4 if tokens <= 4 else 3) if small else 3}, "vLLM default"


class VllmBlockFp8:
    """vLLM's fused_moe_kernel on its block-fp8 path (fp8 weights, 128x128 block scales, 1x128 activation groups),
    launched as vLLM 0.33's invoke_fused_moe_triton_kernel does: BLOCK_SIZE_K capped at 128, SWAP_AB when
    BLOCK_SIZE_M < 64 <= BLOCK_SIZE_N on Hopper. The sort comes from vllm_moe.VllmMoe."""

    def __init__(self, w1, w2, s1, s2, topk_weights, topk_ids, *, vendor_dir, device_file_name: str, hopper: bool):
        from vllm_moe import VllmMoe

        cfg, source = vllm_block_fp8_config(topk_ids.shape[0], w1.shape[0], w2.shape[2], vendor_dir, device_file_name)
        self.base = b = VllmMoe(w1, w2, topk_weights, topk_ids, vendor_dir=vendor_dir, config=cfg)
        self.config, self.config_source, self.s1, self.s2, self.hopper = b.config, source, s1, s2, hopper
        self._c1 = torch.empty(b.T, b.topk, 2 * b.I, device=w1.device, dtype=torch.bfloat16)
        self._c2 = torch.empty(b.T, b.topk, b.D, device=w1.device, dtype=torch.bfloat16)
        self.xq = self.hq = None  # (fp8 [rows, K], fp32 scales [rows, K/128]) of each GEMM's A

    def _launch(self, a, a_s, w, w_s, c, mul_w: bool, top_k: int) -> None:
        import triton
        import triton.language as tl

        cfg = {k: v for k, v in self.config.items() if k != "SPLIT_K"}
        cfg["BLOCK_SIZE_K"] = min(cfg["BLOCK_SIZE_K"], BLOCK)
        sorted_ids, expert_ids, post = self.base._sort
        em = sorted_ids.size(0) if a.size(0) >= cfg["BLOCK_SIZE_M"] else min(
            sorted_ids.size(0), a.size(0) * top_k * cfg["BLOCK_SIZE_M"])
        grid = (triton.cdiv(em, cfg["BLOCK_SIZE_M"]) * triton.cdiv(w.size(1), cfg["BLOCK_SIZE_N"]),)
        swap = self.hopper and cfg["BLOCK_SIZE_M"] < 64 <= cfg["BLOCK_SIZE_N"]
        self.base._kernel[grid](
            a, w, c, None, a_s, w_s, self.base.tw, sorted_ids, expert_ids, post, w.size(1), w.size(2), em,
            a.size(0) * top_k, a.stride(0), a.stride(1), w.stride(0), w.stride(2), w.stride(1), c.stride(1),
            c.stride(2), a_s.stride(0), a_s.stride(1), w_s.stride(0), w_s.stride(2), w_s.stride(1), 0, 0, BLOCK, BLOCK,
            naive_block_assignment=False, SPLIT_K=1, MUL_ROUTED_WEIGHT=mul_w, top_k=top_k, compute_type=tl.bfloat16,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, HAS_BIAS=False,
            SWAP_AB=swap, USE_TD=False, **cfg)

    def kernels(self) -> None:
        """The two GEMM launches on the ready sort and the activations the last __call__ quantized."""
        self._launch(*self.xq, self.base.w1, self.s1, self._c1, False, self.base.topk)
        self._launch(*self.hq, self.base.w2, self.s2, self._c2, True, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The whole MoE [T, D] bf16 (SiLU·up, 1x128 quantization and the top-k sum in torch)."""
        from tritune.kernels.fused_moe import quantize_activations

        inter = self.base.I
        self.xq = quantize_activations(x, "per_1x128")
        self._launch(*self.xq, self.base.w1, self.s1, self._c1, False, self.base.topk)
        h = torch.nn.functional.silu(self._c1[..., :inter].float()) * self._c1[..., inter:].float()
        self.hq = quantize_activations(h.to(torch.bfloat16).view(-1, inter), "per_1x128")
        self._launch(*self.hq, self.base.w2, self.s2, self._c2, True, 1)
        return self._c2.sum(1)


def make_weights(shape: str, quant: str, device: str = "cuda") -> dict:
    """Seeded w1 [E, 2I, D], w2 [E, D, I] (bf16, or fp8 with 128x128 block scales s1, s2) on `device`."""
    from tritune.kernels.fused_moe import quantize_weights

    d, inter, e, _ = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)
    w1 = torch.randn(e, 2 * inter, d, device=device, generator=gen) / d**0.5
    w2 = torch.randn(e, d, inter, device=device, generator=gen) / inter**0.5
    if quant == "none":
        return {"w1": w1.bfloat16(), "w2": w2.bfloat16(), "s1": None, "s2": None}
    (q1, s1), (q2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    return {"w1": q1, "w2": q2, "s1": s1, "s2": s2}


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:400]


def run_point(shape: str, quant: str, tokens: int, w: dict, args, tuned_csv: str | None = None) -> dict:
    """One row: every contestant on the same inputs (seeded by the token count), checked, then timed (on the weights'
    device: the GPU; on the CPU, through the interpreter, only to exercise this code)."""
    from bench_runtime import eager_and_graph
    from probe_util import timed_rounds

    from tritune import knobs
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops import fused_moe, reload_moe_configs
    from tritune.ops.fused_moe import fused_moe_choice
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import time_kernel

    d, inter, e, topk = SHAPES[shape]
    dev = w["w1"].device
    h = torch.randn(tokens, d, device=dev, generator=torch.Generator(device=dev).manual_seed(tokens)).bfloat16()
    tw, ti = sample_routing(tokens, e, topk, seed=tokens, device=dev)
    kw = {"quant": quant, "w1_scale": w["s1"], "w2_scale": w["s2"]}
    ref = fused_moe_reference(h, w["w1"], w["w2"], tw, ti, **kw)

    def rel_err(out: torch.Tensor) -> float:
        return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))

    def timed(fn) -> float:
        return time_kernel(fn, iters=args.iters, warmup=min(3, args.iters), l2_bytes=args.l2_bytes).median_us

    routed = routed_experts(ti)
    own = fused_moe_choice(h, w["w1"], w["w2"], ti, quant=quant)
    row = {"shape": shape, "dims": [d, inter, e, topk], "quant": quant, "tokens": tokens, "routed_experts": routed,
           "floor_us": floor_us(tokens, d, inter, topk, routed, quant, args.peaks), "ours_source": own.source,
           "ours_configs": [c.name("1stage" if own.run_1stage else k, quant)
                            for c, k in ((own.stage1, "stage1"), (own.stage2, "stage2")) if c is not None]}
    calls = {"ours": None} | {f"variant {label}": apply_variant(own, s1, s2) for label, s1, s2 in args.variants}
    for flags in args.rule_flags:  # the rule table's choice with some of its switches set otherwise
        calls[flags_label(flags)] = rule_choice_with(flags, tokens, d, inter, e, topk, quant)
    if tuned_csv is not None:  # the tuned row's choice, read from its CSV alone, then forgotten
        os.environ[knobs.CONFIG_FMOE] = tuned_csv
        try:
            reload_moe_configs()
            calls["tuned"] = fused_moe_choice(h, w["w1"], w["w2"], ti, quant=quant)
            row["tuned_source"] = calls["tuned"].source
        except Exception as err:  # noqa: BLE001
            row["tuned_error"] = _error(err)
        finally:
            del os.environ[knobs.CONFIG_FMOE]
            reload_moe_configs()
    runnable = {}
    for name, choice in calls.items():
        fn = (lambda c=choice: fused_moe(h, w["w1"], w["w2"], tw, ti, choice=c, **kw))
        try:
            row[f"{name}_rel_err"] = rel_err(fn())
            runnable[name] = fn
        except Exception as err:  # noqa: BLE001 - a variant the kernels reject is a result, not a crash
            row[f"{name}_error"] = _error(err)
    try:  # the peer: vLLM's two GEMM launches on a ready sort, timed in the same rounds
        if quant == "per_token":
            raise ValueError("no per_token peer in this benchmark (issue 14 compares per_token with our bf16)")
        if quant == "none":
            from vllm_moe import VllmMoe

            peer = VllmMoe(w["w1"], w["w2"], tw, ti, vendor_dir=args.vendor_dir)
        else:
            cuda = dev.type == "cuda"
            peer = VllmBlockFp8(w["w1"], w["w2"], w["s1"], w["s2"], tw, ti, vendor_dir=args.vendor_dir,
                                device_file_name=torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu",
                                hopper=cuda and torch.cuda.get_device_capability() == (9, 0))
        row["vllm_config"], row["vllm_config_source"] = peer.config, peer.config_source
        row["vllm_rel_err"] = rel_err(peer(h))
        runnable["vllm"] = peer.kernels
    except Exception as err:  # noqa: BLE001
        row["vllm_error"] = _error(err)
    # Timed in interleaved rounds (probe_util.timed_rounds); until the twenty-ninth session vLLM's column was timed
    # after all of ours. A contestant whose timing raises keeps its error as its result.
    us = timed_rounds(runnable, timed, args.rounds,
                      on_error=lambda name, err: row.update({f"{name}_error": _error(err)}))
    row.update({f"{name}_us": t for name, t in us.items()})
    if "ours_us" in row and dev.type == "cuda":  # eager back-to-back and CUDA-graph replay, ~20 ms a round
        try:
            reps = max(2, min(20, int(2e4 / row["ours_us"])))
            row.update({f"ours_{k}": v for k, v in eager_and_graph([runnable["ours"]], reps=reps).items()})
        except Exception as err:  # noqa: BLE001
            row["ours_error"] = _error(err)
    if args.grouped and quant == "none":
        _time_grouped(row, h, w, tw, ti, rel_err, timed)
    if args.library and quant in ("none", "per_token") and dev.type == "cuda":
        _time_library(row, h, w, ti, quant, timed)
    return row


def _time_grouped(row: dict, h, w: dict, tw, ti, rel_err, timed) -> None:
    """--grouped: the same MoE through the training MLP's kernels (`ops.moe_mlp` under inference_mode: the routing
    sort, the grouped gate_up GEMM, SwiGLU, the grouped down GEMM, the top-k sum), whose GEMMs take every routed row
    of an expert as one group instead of the fused op's padded blocks: is that a faster inference path?"""
    from tritune.ops.moe_mlp import moe_mlp

    def fn():
        with torch.inference_mode():
            return moe_mlp(h, w["w1"], w["w2"], tw.to(h.dtype), ti)

    try:
        row["grouped_rel_err"] = rel_err(fn())
        row["grouped_us"] = timed(fn)
    except Exception as err:  # noqa: BLE001
        row["grouped_error"] = _error(err)


def _time_library(row: dict, h, w: dict, ti, quant: str, timed) -> None:
    """--library: the vendor library's grouped GEMMs on the same routed rows, gathered in expert order outside the
    timing: `torch._grouped_mm` (bf16) or `torch._scaled_grouped_mm` (per_token: fp8 rows with row-wise scales), the
    two GEMMs alone (no sort, activation or top-k sum), and cuBLAS on one dense GEMM pair of the same total size (one
    expert's weights for every row). What the hardware's own libraries take for the GEMMs this op must run: a measured
    ceiling for its large-token floor target, which counts the GEMMs at the peak of a dense matmul."""
    from tritune.kernels.fused_moe import quantize_activations

    experts, topk = w["w1"].shape[0], ti.shape[1]
    flat = ti.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = h[order // topk].contiguous()
    inter = w["w2"].shape[2]
    gen = torch.Generator(h.device).manual_seed(1)
    zs = torch.randn(xs.shape[0], inter, device=h.device, generator=gen).to(h.dtype)
    first = int(torch.nonzero(counts)[0])
    lo, hi = int(offs[first]) - int(counts[first]), int(offs[first])
    w1t, w2t = w["w1"].transpose(1, 2), w["w2"].transpose(1, 2)
    if quant == "none":
        ref = xs[lo:hi].float() @ w["w1"][first].float().T
        gemm1 = lambda: torch._grouped_mm(xs, w1t, offs=offs)  # noqa: E731
        gemm2 = lambda: torch._grouped_mm(zs, w2t, offs=offs)  # noqa: E731
        dense = lambda: (xs @ w["w1"][0].T, zs @ w["w2"][0].T)  # noqa: E731
    else:
        (xq, xsc), (zq, zsc) = quantize_activations(xs, quant), quantize_activations(zs, quant)
        xsc, zsc = xsc.reshape(-1).float().contiguous(), zsc.reshape(-1).float().contiguous()
        s1, s2 = w["s1"].float().reshape(experts, -1), w["s2"].float().reshape(experts, -1)
        ref = (xq[lo:hi].float() * xsc[lo:hi, None]) @ (w["w1"][first].float() * s1[first, :, None]).T
        kw = {"offs": offs, "out_dtype": torch.bfloat16}
        gemm1 = lambda: torch._scaled_grouped_mm(xq, w1t, xsc, s1, **kw)  # noqa: E731
        gemm2 = lambda: torch._scaled_grouped_mm(zq, w2t, zsc, s2, **kw)  # noqa: E731
        dense = lambda: (torch._scaled_mm(xq, w["w1"][0].T, xsc[:, None], s1[0][None, :], out_dtype=torch.bfloat16),  # noqa: E731
                         torch._scaled_mm(zq, w["w2"][0].T, zsc[:, None], s2[0][None, :], out_dtype=torch.bfloat16))
    try:
        got = gemm1()[lo:hi].float()
        row["library_rel_err"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        row["library_us"] = timed(lambda: (gemm1(), gemm2()))
        row["library_gemm1_us"], row["library_gemm2_us"] = timed(gemm1), timed(gemm2)
        row["dense_us"] = timed(dense)
    except Exception as err:  # noqa: BLE001 - a library that lacks this case is a result
        row["library_error"] = _error(err)


def tune_spec(text: str) -> tuple[str, str, int]:
    """'SHAPE:TOKENS[:QUANT]' -> (shape, quant, tokens), as `points` lists them; ValueError when malformed."""
    shape, tokens, quant = (text.split(":") + ["none"])[:3] if text.count(":") in (1, 2) else (text, "", "")
    if shape not in SHAPES or not tokens.isdigit() or int(tokens) < 1 or quant not in ("none", "per_1x128"):
        raise ValueError(f"--tune-row {text!r}: expected SHAPE:TOKENS[:none|per_1x128], SHAPE one of {list(SHAPES)}")
    return shape, quant, int(tokens)


def tune_shape(spec: str):
    """The untuned-CSV row (FmoeShape) of --tune-row `spec`: gated SiLU, bf16 activations."""
    from tritune.store.fmoe_rows import FmoeShape

    shape, quant, tokens = tune_spec(spec)
    q = "fp8" if quant != "none" else "bf16"
    return FmoeShape(tokens, *SHAPES[shape], "silu", "bf16", q, q, quant, True, False)


def tune_row(spec: str, out_csv: pathlib.Path) -> dict:
    """`tritune moe` on one row in a subprocess from a fresh folder (no journal to resume), as a user runs it: wall
    seconds, exit status, the tuned row (its CSV copied to `out_csv`)."""
    from tritune.store.fmoe_csv import read_tuned, write_untuned

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        untuned, tuned = pathlib.Path(tmp, "untuned_fmoe.csv"), pathlib.Path(tmp, "tuned_fmoe.csv")
        write_untuned(untuned, [tune_shape(spec)])
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "tritune.cli", "moe", "-i", str(untuned), "-o", str(tuned),
                              "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
        rec = {"row": spec, "wall_s": time.perf_counter() - t0, "returncode": run.returncode,
               "stdout_tail": run.stdout[-3000:], "stderr_tail": run.stderr[-2000:]}
        if run.returncode == 0 and tuned.exists():
            out_csv.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tuned, out_csv)
            rec["tuned_csv"], rec["tuned"] = str(out_csv), [dataclasses.asdict(r) for r in read_tuned(out_csv)]
    return rec


def points(args) -> list[tuple[str, str, int]]:
    """(shape, quant, tokens) in run order: bf16 rows shape by shape, then the fp8 rows (--fp8-quants) of
    --fp8-shapes."""
    return ([(s, "none", t) for s in args.shapes for t in args.tokens]
            + [(s, q, t) for q in args.fp8_quants for s in args.fp8_shapes for t in args.tokens])


def fp8_speedups(rows: list[dict]) -> list[str]:
    """Issue 14's fp8 targets: at each (shape, tokens) measured in bf16 and in an fp8 quantization, our bf16 op's
    time over our fp8 op's (the op's own choice, or the tuned row's where timed)."""
    def best(r: dict) -> float | None:
        times = [r[k] for k in ("ours_us", "tuned_us") if r.get(k) and r.get(k.replace("_us", "_rel_err"), 0) <= WRONG]
        return min(times) if times else None

    bf16 = {(r["shape"], r["tokens"]): best(r) for r in rows if r["quant"] == "none"}
    lines = []
    for r in rows:
        base, mine = bf16.get((r["shape"], r["tokens"])), best(r)
        if r["quant"] != "none" and base and mine:
            lines.append(f"{r['shape']} {r['tokens']} tokens: {r['quant']} {base / mine:.2f}x faster than bf16 "
                         f"({mine:.1f} vs {base:.1f} us)")
    return lines


def parse_rule_flags(text: str) -> tuple[tuple[str, int], ...]:
    """`NAME=INT[,NAME=INT...]`, each NAME an integer or boolean switch of tritune.ops.heuristics; ValueError else."""
    from tritune.ops import heuristics

    flags = []
    for item in text.split(","):
        name, _, value = item.strip().partition("=")
        if not (name.isupper() and isinstance(getattr(heuristics, name, None), (bool, int))) or not value.isdigit():
            raise ValueError(f"--rule-flag {text!r}: {item!r} is not NAME=INT with NAME an integer or boolean switch "
                             "of tritune.ops.heuristics")
        flags.append((name, int(value)))
    return tuple(flags)


def rule_choice_with(flags: tuple, tokens: int, d: int, inter: int, experts: int, topk: int, quant: str):
    """The rule table's choice (`heuristic_moe_choice`) for the point with each `tritune.ops.heuristics.<flag>` set to
    its value (put back afterwards)."""
    from tritune.ops import heuristics
    from tritune.ops.fused_moe import heuristic_moe_choice

    old = {flag: getattr(heuristics, flag) for flag, _ in flags}
    try:
        for flag, value in flags:
            setattr(heuristics, flag, type(old[flag])(value))
        return heuristic_moe_choice(tokens, d, inter, experts, topk, quant)
    finally:
        for flag, value in old.items():
            setattr(heuristics, flag, value)


def flags_label(flags: tuple) -> str:
    return "rule " + ",".join(f"{f}={v}" for f, v in flags)


def table(rows: list[dict], labels: list[str], tuned: bool = False, rule_flags: tuple = ()) -> list[str]:
    """The markdown table of `rows`: one column per --variant label and --rule-flag (and the tuned row's choice when
    `tuned`)."""
    extra = [f"variant {v}" for v in labels] + [flags_label(f) for f in rule_flags]
    extra += (["tuned"] if tuned else []) + [k for k in ("grouped", "library", "dense")
                                             if any(f"{k}_us" in r or f"{k}_error" in r for r in rows)]
    head = ["shape", "quant", "tokens", "ours µs", "vLLM µs", "ours/vLLM", "floor µs", "ours/floor",
            "ours eager / graph µs", "vLLM config"] + [f"{k} µs (/ours)" for k in extra]

    def us(r, k):
        if f"{k}_us" not in r:
            return "error" if f"{k}_error" in r else "-"
        return f"{r[f'{k}_us']:.1f}" + (" WRONG" if r.get(f"{k}_rel_err", 0) > WRONG else "")

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours, peer = r.get("ours_us"), r.get("vllm_us")
        cells = [r["shape"], r["quant"], str(r["tokens"]), us(r, "ours"), us(r, "vllm"),
                 f"{ours / peer:.2f}" if ours and peer else "-", f"{r['floor_us']:.1f}",
                 f"{ours / r['floor_us']:.2f}" if ours else "-",
                 f"{r['ours_eager_us']:.1f} / {r['ours_graph_us']:.1f}" if "ours_graph_us" in r else "-",
                 "file" if r.get("vllm_config_source", "").endswith(".json") else "default"]
        cells += [us(r, k) + (f" ({r[f'{k}_us'] / ours:.2f})" if f"{k}_us" in r and ours else "") for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; shape names, --tune-row and --variant fields (against this tritune's MoeConfig) checked."""
    from tritune.kernels.fused_moe import MoeConfig

    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    names = lambda text: tuple(n for n in text.split(",") if n)  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vendor-dir", default="peers_vllm", help="extract_vllm.py's folder, with vllm_moe.py copied in")
    ap.add_argument("--out", type=pathlib.Path, help="JSON, rewritten after every row")
    ap.add_argument("--shapes", type=names, default=HELD_OUT, help=f"bf16 shapes, of {', '.join(SHAPES)}")
    ap.add_argument("--fp8-shapes", type=names, default=FP8_SHAPES, help="fp8 shapes ('' for none)")
    ap.add_argument("--fp8-quants", type=names, default=("per_1x128",),
                    help="quantizations of the fp8 shapes: per_1x128 (vLLM's block-fp8 kernel beside it) and/or "
                         "per_token (no vLLM column: issue 14 compares it with our own bf16)")
    ap.add_argument("--tokens", type=ints, default=TOKENS, help="comma list")
    ap.add_argument("--variant", action="append", default=[], metavar="[s1.|s2.]FIELD=INT,...",
                    help="the op's own choice with these MoeConfig fields replaced (repeatable)")
    ap.add_argument("--rule-flag", action="append", default=[], metavar="NAME=INT[,NAME=INT...]",
                    help="also the rule table's choice with these switches of tritune.ops.heuristics set (repeatable; "
                         "each a column), e.g. FP8_PAIR_AT_DECODE=0 or GLUON_MOE_MIN_K=256,GLUON_MOE_PERSISTENT=1")
    ap.add_argument("--tune-row", metavar="SHAPE:TOKENS[:QUANT]", help="first time `tritune moe` on this one row")
    ap.add_argument("--tuned-csv", type=pathlib.Path,
                    help="a tuned fused-MoE CSV: every row also times the op's choice read from it alone")
    ap.add_argument("--write-untuned", type=pathlib.Path, metavar="CSV",
                    help="write the untuned rows of these points (for `tritune moe -i`) and exit; no GPU needed")
    ap.add_argument("--grouped", action="store_true",
                    help="bf16 rows also time the training MLP's grouped kernels (ops.moe_mlp, inference mode)")
    ap.add_argument("--library", action="store_true",
                    help="bf16 and per_token rows also time the vendor library's two grouped GEMMs (torch._grouped_mm"
                         " / _scaled_grouped_mm) on pre-gathered rows, and cuBLAS on a dense pair of the same size")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per contestant and round (median)")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # probe_util, a sibling
    from probe_util import add_rounds_args, apply_rounds_args

    add_rounds_args(ap)
    ap.add_argument("--time-limit", type=float, default=420.0, help="start no row after this many seconds")
    args = ap.parse_args(argv)
    apply_rounds_args(args)
    for name in (*args.shapes, *args.fp8_shapes):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    for quant in args.fp8_quants:
        if quant not in ("per_1x128", "per_token"):
            ap.error(f"--fp8-quants: {quant!r} is not per_1x128 or per_token")
    try:
        args.tune_point = tune_spec(args.tune_row) if args.tune_row else None
        fields = {f.name for f in dataclasses.fields(MoeConfig)}
        parsed = [(text, *parse_variant(text, fields)) for text in args.variant]
    except ValueError as err:
        ap.error(str(err))
    args.notes = [note for *_, notes in parsed for note in notes]
    args.notes += [f"variant {text!r}: no field MoeConfig has; not run" for text, s1, s2, _ in parsed if not s1 | s2]
    args.variants = [(text, s1, s2) for text, s1, s2, _ in parsed if s1 | s2]
    try:
        args.rule_flags = [parse_rule_flags(text) for text in args.rule_flag]
    except ValueError as err:
        ap.error(str(err))
    args.peaks = dict(PEAKS)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.write_untuned:
        from tritune.store.fmoe_csv import write_untuned
        from tritune.store.fmoe_rows import FmoeShape

        rows = []
        for shape, quant, tokens in points(args):
            q = "fp8" if quant != "none" else "bf16"
            rows.append(FmoeShape(tokens, *SHAPES[shape], "silu", "bf16", q, q, quant, True, False))
        write_untuned(args.write_untuned, rows)
        print(f"wrote {len(rows)} untuned row(s) to {args.write_untuned}")
        return
    for note in args.notes:
        print("note:", note, flush=True)
    sys.path[:0] = [str(ROOT / "benchmarks"), str(pathlib.Path(args.vendor_dir).resolve()),
                    str(ROOT.parent / "shared" / "peers")]  # vllm_moe.py: the vendor dir's copy, else ../shared's
    from tritune.device import current_device

    start, dev = time.perf_counter(), current_device()
    args.l2_bytes = dev.l2_bytes
    version = pathlib.Path(args.vendor_dir, "VERSION")
    doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": dev.provenance(),
           "vllm": version.read_text().strip().splitlines()[-1] if version.exists() else None, "peaks": args.peaks,
           "command": " ".join(sys.argv), "notes": args.notes, "tune": None, "rows": [], "skipped": []}
    print(f"{dev.name}  triton {dev.triton_version}  torch {dev.torch_version}  {doc['vllm']}", flush=True)

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".tmp").write_text(json.dumps(doc, indent=1, default=str))
            args.out.with_suffix(".tmp").replace(args.out)

    if args.tune_row:
        doc["tune"] = tune_row(args.tune_row, (args.out.parent if args.out else ROOT / "tritune-out")
                               / "gen2_tuned_fmoe.csv")
        print(f"tune {args.tune_row}: {doc['tune']['wall_s']:.1f} s wall, rc {doc['tune']['returncode']}", flush=True)
        save()
    tuned_csv, weights = (doc["tune"] or {}).get("tuned_csv"), (None, None)
    for shape, quant, tokens in points(args):
        if time.perf_counter() - start > args.time_limit:
            doc["skipped"].append([shape, quant, tokens])
            continue
        t0 = time.perf_counter()
        try:
            if weights[0] != (shape, quant):
                weights = (None, None)  # free the last shape's weights before making the next
                torch.cuda.empty_cache()
                weights = ((shape, quant), make_weights(shape, quant, "cuda" if torch.cuda.is_available() else "cpu"))
            csv_of_row = str(args.tuned_csv) if args.tuned_csv else (
                tuned_csv if args.tune_point == (shape, quant, tokens) else None)
            row = run_point(shape, quant, tokens, weights[1], args, csv_of_row)
        except Exception as err:  # noqa: BLE001 - the other rows still run (an out-of-memory reference, say)
            row = {"shape": shape, "quant": quant, "tokens": tokens, "floor_us": float("nan"),
                   "ours_error": _error(err)}
        row["wall_s"] = time.perf_counter() - t0
        doc["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        save()
    print("\n" + "\n".join(table(doc["rows"], [v[0] for v in args.variants], tuned=bool(tuned_csv or args.tuned_csv),
                                  rule_flags=args.rule_flags)))
    if speedups := fp8_speedups(doc["rows"]):
        print("\nfp8 against our bf16:\n" + "\n".join(speedups))
    if doc["tune"]:
        print(f"\ntune time of {args.tune_row}: {doc['tune']['wall_s']:.1f} s wall (`tritune moe`, one row)")
    if doc["skipped"]:
        print(f"\nskipped past --time-limit (run them with --shapes/--fp8-shapes/--tokens): {doc['skipped']}")
    save()


if __name__ == "__main__":
    main()
