"""What Triton makes of a fused-MoE GEMM kernel, without a GPU: compile it for a target (default cuda:90, the H100 and
H200) the way the tuner's compile pool does, and count in its TTGIR and PTX what decides how its K loop runs.

Why: device time is short, and some questions are answered by the compiled code alone. Does the tensor-core MMA stay
in flight while the next K step loads (`wgmma.wait_group N`: N > 0), or is it retired at every step (0)? Does a tile
go through shared memory on its way to the MMA (`ttg.convert_layout`, `ttg.local_alloc`)? How much converting does a
register decode add (`cvt.`)? Triton is this machine's, which may not be the device's: say which in any record.

    PYTHONPATH=src python benchmarks/ir_census.py --point e128-top8-i384:per_1x128:4096 --point ...:per_token:4096
    PYTHONPATH=src python benchmarks/ir_census.py --point gpt-oss-120b:per_1x32:16 --stage stage1 --out /tmp/ir
    PYTHONPATH=src python benchmarks/ir_census.py --scaled-dots   # the K-step forms on one toy kernel

--point SHAPE:QUANT:TOKENS (shapes of bench_fused_moe_gen2.py, and gpt-oss-120b) takes the rule table's choice for
the H100 (`moe_heuristic`), --variant as bench_fused_moe_gen2's. --scaled-dots compiles one fp8 kernel with two
dots a K step in four forms: the rescale after each dot (as per_1x128 does), both dots then both rescales, the
rescale lagging one step (the GEMM's SCALE_PIPELINE), and the chained accumulator (per_token), and lists the waits.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before Triton decorates anything: this compiles, it never interprets

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

COUNTS = {  # name -> (IR, pattern)
    "wgmma": ("ptx", r"wgmma\.mma_async"),
    "mma.sync": ("ptx", r"\bmma\.sync"),
    "convert_layout": ("ttgir", r"ttg\.convert_layout"),
    "local_alloc": ("ttgir", r"ttg\.local_alloc"),
    "st.shared": ("ptx", r"\bst\.shared"),
    "ldmatrix": ("ptx", r"\bldmatrix"),
    "cvt": ("ptx", r"\bcvt\."),
}
SHAPES_EXTRA = {"gpt-oss-120b": (2880, 2880, 128, 4)}


def census(asm: dict) -> dict:
    """The counts of COUNTS in a compiled kernel's `asm` ({"ttgir": ..., "ptx": ..., "cubin": ...}), its wgmma wait
    depths in program order, and its registers a thread and spilled bytes (from the cubin, where there is one)."""
    row = {name: len(re.findall(pattern, asm[ir])) for name, (ir, pattern) in COUNTS.items()}
    row["wgmma waits"] = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", asm["ptx"])]
    row["regs"], row["spill bytes"] = resource_usage(asm.get("cubin"))
    return row


def resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers a thread, local-memory bytes) of a cubin, read by the cuobjdump Triton ships; (None, None) without
    one. A kernel at 255 registers runs at most two 128-thread programs an SM."""
    if not cubin:
        return None, None
    import subprocess

    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except OSError:
            return None, None
    regs, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def start_compiling_for(arch: int, sm_count: int, cache: str | None) -> None:
    """Compile for `arch` from now on in this process, with no GPU (the compile pool's way), into `cache`."""
    os.environ["TRITON_CACHE_DIR"] = cache or tempfile.mkdtemp(prefix="tritune-ir-")
    from tritune.compile_target import CompileTarget, compile_without_gpu

    compile_without_gpu(CompileTarget("cuda", arch, 32, sm_count))


def compile_point(spec: str, stage: str, variant: str, sm_count: int) -> tuple[str, dict]:
    """(the config's name, its compiled kernel's asm) for `stage` of point SHAPE:QUANT:TOKENS."""
    from bench_fused_moe_gen2 import SHAPES, parse_variant

    from tritune.kernels import fused_moe as fm
    from tritune.kernels.fused_moe_compile import MoeDims, compile_only
    from tritune.ops.heuristics import moe_heuristic

    shapes = SHAPES | SHAPES_EXTRA
    shape, quant, tokens = (spec.split(":") + ["", ""])[:3]
    if shape not in shapes or not tokens.isdigit() or int(tokens) < 1:
        raise ValueError(f"--point {spec!r}: expected SHAPE:QUANT:TOKENS, SHAPE one of {sorted(shapes)}")
    d, inter, experts, topk = shapes[shape]
    _, s1, s2 = moe_heuristic(int(tokens), d, inter, experts, topk, quant, sm_count, one_stage=False)
    f1, f2, notes = parse_variant(variant, {f.name for f in dataclasses.fields(fm.MoeConfig)})
    for note in notes:
        print(note, file=sys.stderr)
    config = dataclasses.replace(s1, **f1) if stage == "stage1" else dataclasses.replace(s2, **f2)
    compiled = compile_only(stage, MoeDims(int(tokens), topk, experts, d, inter, quant=quant), config)
    return config.name(stage, quant), compiled.asm


def scaled_dots() -> dict[str, dict]:
    """The toy kernel's four K-step forms, compiled: form -> census."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.jit import MockTensor

    @triton.jit
    def two_dots(a_ptr, b_ptr, c_ptr, s_ptr, K, FORM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
        offs_m, offs_n, offs_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc1 = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
        prev1 = tl.zeros((BM, BN), tl.float32)
        prev2 = tl.zeros((BM, BN), tl.float32)
        ps1 = tl.zeros((BM,), tl.float32)
        ps2 = tl.zeros((BM,), tl.float32)
        for k in range(0, K, BK):
            a = tl.load(a_ptr + offs_m[:, None] * K + (k + offs_k)[None, :])
            b1 = tl.load(b_ptr + offs_n[:, None] * K + (k + offs_k)[None, :]).T
            b2 = tl.load(b_ptr + BN * K + offs_n[:, None] * K + (k + offs_k)[None, :]).T
            s1 = tl.load(s_ptr + offs_m * K + k // BK)
            s2 = tl.load(s_ptr + BM * K + offs_m * K + k // BK)
            if FORM == 0:  # rescale after each dot
                acc1 += tl.dot(a, b1) * s1[:, None]
                acc2 += tl.dot(a, b2) * s2[:, None]
            elif FORM == 1:  # both dots, then both rescales
                d1 = tl.dot(a, b1)
                d2 = tl.dot(a, b2)
                acc1 += d1 * s1[:, None]
                acc2 += d2 * s2[:, None]
            elif FORM == 2:  # the rescale one step behind its dot
                d1 = tl.dot(a, b1)
                d2 = tl.dot(a, b2)
                acc1 += prev1 * ps1[:, None]
                acc2 += prev2 * ps2[:, None]
                prev1, prev2, ps1, ps2 = d1, d2, s1, s2
            else:  # the chained accumulator
                acc1 = tl.dot(a, b1, acc1)
                acc2 = tl.dot(a, b2, acc2)
        if FORM == 2:
            acc1 += prev1 * ps1[:, None]
            acc2 += prev2 * ps2[:, None]
        tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], acc1 + acc2)

    forms = ("rescale after each dot", "both dots, then rescales", "rescale one step behind", "chained accumulator")
    f8, f32 = torch.float8_e4m3fn, torch.float32
    out = {}
    for form, label in enumerate(forms):
        compiled = two_dots.warmup(MockTensor(f8), MockTensor(f8), MockTensor(f32), MockTensor(f32), 4096, FORM=form,
                                   BM=64, BN=128, BK=128, num_warps=8, num_stages=3, grid=(1,))
        out[label] = census(compiled.asm)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", default=[], help="SHAPE:QUANT:TOKENS (repeatable)")
    ap.add_argument("--stage", choices=("stage1", "stage2", "both"), default="both")
    ap.add_argument("--variant", default="", help="[s1.|s2.]FIELD=INT,... on the rule table's choice")
    ap.add_argument("--scaled-dots", action="store_true", help="the toy kernel's K-step forms")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sm-count", type=int, default=132)
    ap.add_argument("--out", type=pathlib.Path, help="folder for each kernel's TTGIR and PTX")
    ap.add_argument("--cache", help="Triton cache folder (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    if not args.point and not args.scaled_dots:
        ap.error("nothing to compile: give --point or --scaled-dots")
    start_compiling_for(args.arch, args.sm_count, args.cache)
    import triton

    print(f"Triton {triton.__version__}, target cuda:{args.arch}, no GPU")
    rows: list[tuple[str, dict]] = []
    for spec in args.point:
        for stage in ("stage1", "stage2") if args.stage == "both" else (args.stage,):
            try:
                name, asm = compile_point(spec, stage, args.variant, args.sm_count)
            except ValueError as exc:
                print(f"ir_census: {exc}", file=sys.stderr)
                return 2
            rows.append((f"{spec} {stage} {name}", census(asm)))
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{spec}_{stage}")
                for ir in ("ttgir", "ptx"):
                    (args.out / f"{stem}.{ir}").write_text(asm[ir])
    if args.scaled_dots:
        rows += [(f"toy: {label}", row) for label, row in scaled_dots().items()]
    keys = ["regs", "spill bytes", *COUNTS, "wgmma waits"]
    print("| kernel | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for label, row in rows:
        print(f"| {label} | " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
