r"""Where a fused-MoE call's GPU time goes, kernel by kernel, for tritune's op and vLLM's two GEMM launches side by
side, with each compiled GEMM's registers and spills (issue 14: a whole-op gap in bench_fused_moe_gen2 says how much
slower, this says which launch and why).

On the device (repository root; carry ["peers_vllm"], see bench_fused_moe_gen2.py for how to make it):

    PYTHONPATH=src python benchmarks/profile_moe_kernels.py --vendor-dir peers_vllm --out $OUT/profile.json \
        --points deepseek-v2-lite:per_1x128:1024,qwen3-30b-a3b:none:1024 [--variant s1.BLOCK_SIZE_N=128 ...] \
        [--rule-flag GLUON_MOE_MIN_K=256 ...]

Each contestant runs --iters calls back to back under torch.profiler (CUDA activity only; L2 not flushed between
calls, so these are warm-cache times: the breakdown, not the headline). Kernels are listed in launch order with
their mean µs per call. Registers and spills come from the compiled kernels in Triton's JIT caches after the runs
(every specialization that ran, ours and vLLM's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def device_events(fn, iters: int, warmup: int = 3) -> list:
    """The profiler's GPU kernel events (no memory events) of `iters` calls of fn after `warmup` calls, by start."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name != "[memory]"),
                  key=lambda e: e.time_range.start)


def kernel_times(fn, iters: int) -> list[tuple[str, float]]:
    """(kernel name, mean µs per call) in launch order over `iters` calls of fn (after 3 warm-up calls)."""
    events = device_events(fn, iters)
    per_call = len(events) // iters
    if per_call == 0 or per_call * iters != len(events):
        return [(f"{len(events)} kernels over {iters} calls: not a whole number per call", float("nan"))]
    out = []
    for i in range(per_call):
        times = [events[c * per_call + i].time_range.elapsed_us() for c in range(iters)]
        out.append((events[i].name[:90], sum(times) / iters))
    return out


def compiled_resources(jit_fns: dict) -> list[dict]:
    """name, warps, stages, registers, spills, shared bytes of every compiled specialization of each JIT function."""
    rows = []
    for label, fn in jit_fns.items():
        for caches in getattr(fn, "device_caches", {}).values():
            for key, kernel in caches[0].items():
                try:
                    kernel._init_handles()
                except Exception:  # noqa: BLE001 - a kernel that cannot load still has its metadata
                    pass
                md = kernel.metadata
                try:  # the constexprs by name (Triton 3.6: ASTSource.constants keyed by argument path)
                    names = kernel.src.fn.arg_names
                    consts = {names[k[0]]: v for k, v in kernel.src.constants.items() if len(k) == 1
                              and names[k[0]].isupper()}
                except Exception:  # noqa: BLE001
                    consts = {}
                rows.append({"kernel": label, "warps": md.num_warps, "stages": md.num_stages,
                             "regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                             "shared": md.shared, "constexprs": consts, "key": str(key)[-400:]})
    return rows


def profile_point(spec: str, variants: list, args, rule_flags: tuple = ()) -> dict:
    """One SHAPE:QUANT:TOKENS point: each contestant checked against the fp32 reference, then its kernels timed."""
    import bench_fused_moe_gen2 as gen2

    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops import fused_moe
    from tritune.ops.fused_moe import fused_moe_choice
    from tritune.ops.routing import sample_routing

    shape, quant, tokens = spec.split(":")
    tokens = int(tokens)
    d, inter, e, topk = gen2.SHAPES[shape]
    w = gen2.make_weights(shape, quant)
    h = torch.randn(tokens, d, device="cuda", generator=torch.Generator("cuda").manual_seed(tokens)).bfloat16()
    tw, ti = sample_routing(tokens, e, topk, seed=tokens, device="cuda")
    kw = {"quant": quant, "w1_scale": w["s1"], "w2_scale": w["s2"]}
    ref = fused_moe_reference(h, w["w1"], w["w2"], tw, ti, **kw)
    own = fused_moe_choice(h, w["w1"], w["w2"], ti, quant=quant)
    calls = {"ours": own} | {f"variant {t}": gen2.apply_variant(own, s1, s2) for t, s1, s2 in variants}
    calls |= {gen2.flags_label(f): gen2.rule_choice_with(f, tokens, d, inter, e, topk, quant) for f in rule_flags}
    point = {"point": spec, "floor_us": gen2.floor_us(tokens, d, inter, topk, gen2.routed_experts(ti), quant),
             "contestants": {}}
    for label, choice in calls.items():
        def fn(c=choice):
            return fused_moe(h, w["w1"], w["w2"], tw, ti, choice=c, **kw)

        names = [c.name("1stage" if choice.run_1stage else k, quant)
                 for c, k in ((choice.stage1, "stage1"), (choice.stage2, "stage2")) if c is not None]
        try:
            err = float((fn().float() - ref).norm() / ref.norm())
            point["contestants"][label] = {"configs": names, "rel_err": err,
                                           "kernels": kernel_times(fn, args.iters)}
        except Exception as exc:  # noqa: BLE001 - a variant the kernels refuse is a result
            point["contestants"][label] = {"configs": names, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if quant not in ("none", "per_1x128"):  # vLLM's per-token fp8 MoE is not among the extracted peers
        point["contestants"]["vllm"] = {"error": f"no {quant} peer: vllm_moe runs bf16 and 128x128 block fp8"}
        return point
    try:
        if quant == "none":
            from vllm_moe import VllmMoe

            peer = VllmMoe(w["w1"], w["w2"], tw, ti, vendor_dir=args.vendor_dir)
        else:
            peer = gen2.VllmBlockFp8(w["w1"], w["w2"], w["s1"], w["s2"], tw, ti, vendor_dir=args.vendor_dir,
                                     device_file_name=torch.cuda.get_device_name().replace(" ", "_"),
                                     hopper=torch.cuda.get_device_capability() == (9, 0))
        err = float((peer(h).float() - ref).norm() / ref.norm())
        point["contestants"]["vllm"] = {"configs": [json.dumps(peer.config)], "rel_err": err,
                                        "kernels": kernel_times(peer.kernels, args.iters)}
    except Exception as exc:  # noqa: BLE001
        point["contestants"]["vllm"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return point


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vendor-dir", default="peers_vllm")
    ap.add_argument("--points", required=True, help="comma list of SHAPE:QUANT:TOKENS (QUANT none, per_token or "
                    "per_1x128; vLLM beside none and per_1x128 only)")
    ap.add_argument("--variant", action="append", default=[], help="as bench_fused_moe_gen2 --variant (repeatable)")
    ap.add_argument("--rule-flag", action="append", default=[],
                    help="as bench_fused_moe_gen2 --rule-flag: the rule's choice with these switches (repeatable)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--fused-quant", action="store_true",
                    help="fp8: quantize the intermediate inside the GEMMs (FUSE_INTERMEDIATE_QUANT on; off by default)")
    args = ap.parse_args(argv)
    if args.fused_quant:
        from tritune.kernels import fused_moe_launch

        fused_moe_launch.FUSE_INTERMEDIATE_QUANT = True
    sys.path[:0] = [str(ROOT / "benchmarks"), str(pathlib.Path(args.vendor_dir).resolve())]
    import bench_fused_moe_gen2 as gen2

    from tritune.kernels import fused_moe as fm

    fields = {f.name for f in dataclasses.fields(fm.MoeConfig)}
    variants = [(text, *gen2.parse_variant(text, fields)[:2]) for text in args.variant]
    try:
        rule_flags = [gen2.parse_rule_flags(text) for text in args.rule_flag]
    except ValueError as err:
        ap.error(str(err))
    doc = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "points": []}
    for spec in args.points.split(","):
        point = profile_point(spec, variants, args, rule_flags)
        torch.cuda.empty_cache()
        doc["points"].append(point)
        print(f"\n## {spec}  floor {point['floor_us']:.1f} µs")
        for label, c in point["contestants"].items():
            if "error" in c:
                print(f"  {label}: {c['error']}")
                continue
            total = sum(t for _, t in c["kernels"])
            print(f"  {label}: {total:.1f} µs  rel_err {c['rel_err']:.2e}  {' '.join(c['configs'])}")
            for name, t in c["kernels"]:
                print(f"      {t:8.1f}  {name}")
    import vllm_fused_moe_kernel as peer_kernels  # noqa: F401 - loaded by vllm_moe; its JIT cache holds vLLM's GEMM

    jits = {"ours _moe_gemm_kernel": fm._moe_gemm_kernel}
    jits |= {f"vllm {n}": getattr(peer_kernels, n) for n in dir(peer_kernels)
             if type(getattr(peer_kernels, n)).__name__ == "JITFunction"}
    doc["resources"] = compiled_resources(jits)
    print("\n| kernel | warps | stages | regs | spills | shared | constexprs |\n|---|---|---|---|---|---|---|")
    for r in doc["resources"]:
        short = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        print(f"| {r['kernel']} | {r['warps']} | {r['stages']} | {r['regs']} | {r['spills']} | {r['shared']} "
              f"| {short} |")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
