"""Would a tail block per expert pay (issue 14)? The fused-MoE GEMMs pad each expert's rows up to a whole block: at
4096 tokens E 128 top-8 runs 128-row blocks over 256 +- 16 rows an expert, so the GEMMs compute about 1.25x the
routed rows (RESULTS.md, fifteenth session). Here each expert's rows are split: its whole blocks go to one launch
with the rule table's block height, the rest (fewer than a block) to a second launch of the same kernel with a
shorter block, padded only to that; both stages write their pairs' rows of one buffer, and one top-k sum follows.
Compared with the rule table's single launch per stage on the same inputs (bf16, uniform routing, one ready sort
each; the sorts are built in torch and not timed). Not in the op: a probe of the lever.

    PYTHONPATH=src python benchmarks/probe_tail_blocks.py --out $OUT/tail.json                     # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_tail_blocks.py --tiny --out F          # interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

SHAPES = {"e128-top8-i384": (4096, 384, 128, 8), "e64-top6-i1536": (2048, 1536, 64, 6)}  # D, I, E, topk (issue 14)
TOKENS = (1024, 4096, 8192)
TAIL_BLOCKS = (16, 32, 64)
TINY = {"tiny": (64, 64, 4, 2)}


@dataclasses.dataclass
class TailSplit:
    """One routing split into whole blocks (`main`, block_main rows) and each expert's remainder (`tail`)."""

    main: object  # MoeSorting or None when no expert fills a block
    tail: object  # MoeSorting or None when every expert's rows are whole blocks
    computed_rows: int  # rows the two launches compute, padding included
    single_rows: int  # rows one launch with block_main rows computes


def _sorting(groups: list[torch.Tensor], experts: list[int], block: int, numel: int, device):
    """A MoeSorting over `groups` (pair indices of expert experts[i]), each padded to a multiple of `block`."""
    from tritune.kernels.moe_align import MoeSorting

    ids, owners = [], []
    for pairs, e in zip(groups, experts, strict=True):
        blocks = -(-pairs.numel() // block)
        padded = torch.full((blocks * block,), numel, dtype=torch.int32)
        padded[:pairs.numel()] = pairs.to(torch.int32)
        ids.append(padded)
        owners += [e] * blocks
    if not owners:
        return None
    sorted_ids = torch.cat(ids).to(device)
    return MoeSorting(sorted_ids, torch.tensor(owners, dtype=torch.int32, device=device),
                      torch.tensor([sorted_ids.numel()], dtype=torch.int32, device=device), block, numel)


def split_by_tail(topk_ids: torch.Tensor, experts: int, block_main: int, block_tail: int) -> TailSplit:
    """Each expert's first ⌊rows / block_main⌋ · block_main pairs to `main`, the rest to `tail` (blocks of
    block_tail rows)."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    main_groups, main_owners, tail_groups, tail_owners = [], [], [], []
    start = single = 0
    for e, c in enumerate(counts):
        pairs = order[start:start + c]
        start += c
        whole = c // block_main * block_main
        single += -(-c // block_main) * block_main
        if whole:
            main_groups.append(pairs[:whole])
            main_owners.append(e)
        if c > whole:
            tail_groups.append(pairs[whole:])
            tail_owners.append(e)
    main = _sorting(main_groups, main_owners, block_main, numel, topk_ids.device)
    tail = _sorting(tail_groups, tail_owners, block_tail, numel, topk_ids.device)
    computed = sum(s.sorted_token_ids.numel() for s in (main, tail) if s is not None)
    return TailSplit(main, tail, computed, single)


def tail_call(x: dict, split: TailSplit, cfg1, cfg2, tail1, tail2):
    """The stage pair over `split`: stage 1 twice into one intermediate, stage 2 twice into one per-pair buffer,
    one top-k sum."""
    import triton

    from tritune.kernels import fused_moe as fm

    hidden, w1, w2, tw = x["hidden"], x["w1"], x["w2"], x["topk_weights"]
    tokens, topk = tw.shape
    inter_dim, model_dim = w2.shape[2], w2.shape[1]
    numel = tokens * topk
    inter = torch.empty((numel, inter_dim), device=hidden.device, dtype=hidden.dtype)
    for sorting, cfg in ((split.main, cfg1), (split.tail, tail1)):
        if sorting is not None:
            fm.moe_stage1(hidden, w1, tw, sorting, cfg, inter_dim=inter_dim, out=inter)
    part = torch.empty((numel, model_dim), device=hidden.device, dtype=hidden.dtype)
    for sorting, cfg in ((split.main, cfg2), (split.tail, tail2)):
        if sorting is not None:
            fm._launch_gemm(inter, None, w2, None, part, sorting, tw.reshape(-1), n=model_dim, k=inter_dim,
                            a_row_div=1, gated=False, act=fm._ACT_ID["none"], mul_weight=True, quant="none",
                            config=cfg)
    out = torch.empty((tokens, model_dim), device=hidden.device, dtype=hidden.dtype)
    block = min(triton.next_power_of_2(model_dim), 1024)
    fm._topk_sum_kernel[(tokens, triton.cdiv(model_dim, block))](part, out, model_dim, 0, TOPK=topk, KSPLIT=1,
                                                                 BLOCK=block, num_warps=4)
    return out


def _plain(cfg):
    """A rule-table config as one stage launch runs it: no plan levers, one K split."""
    return dataclasses.replace(cfg, SORTED_INTER=0, TOPK_ATOMIC=0, PERSISTENT=0, GATHER_A=0, WARP_SPEC=0, KSPLIT=1)


def point(name: str, dims: tuple[int, int, int, int], tokens: int, device: str, iters: int) -> list[dict]:
    from tritune.kernels import fused_moe as fm
    from tritune.kernels.moe_align import moe_align_block_size
    from tritune.kernels.moe_reference import fused_moe_reference
    from tritune.ops.heuristics import moe_heuristic
    from tritune.ops.routing import sample_routing
    from tritune.tuning.bench import time_kernel

    d, inter, experts, topk = dims
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = {"hidden": (torch.randn(tokens, d, generator=gen, device=device) / 2).to(dtype),
         "w1": (torch.randn(experts, 2 * inter, d, generator=gen, device=device) / d**0.5).to(dtype),
         "w2": (torch.randn(experts, d, inter, generator=gen, device=device) / inter**0.5).to(dtype)}
    tw, ti = sample_routing(tokens, experts, topk, seed=tokens, device=device)
    x["topk_weights"] = tw
    ref = fused_moe_reference(x["hidden"], x["w1"], x["w2"], tw, ti)
    _, c1, c2 = moe_heuristic(tokens, d, inter, experts, topk, "none", one_stage=False,
                              capability=torch.cuda.get_device_capability() if device == "cuda" else (9, 0))
    c1, c2 = _plain(c1), _plain(dataclasses.replace(c2, BLOCK_SIZE_M=c1.BLOCK_SIZE_M))
    sorting = moe_align_block_size(ti, c1.BLOCK_SIZE_M, experts)

    def single():
        mid = fm.moe_stage1(x["hidden"], x["w1"], tw, sorting, c1, inter_dim=inter)
        return fm.moe_stage2(mid, x["w2"], tw, sorting, c2)

    def rel(out):
        return float((out.float() - ref).norm() / ref.norm())

    timer = (lambda fn: time_kernel(fn, iters=iters, warmup=min(3, iters)).median_us)
    base = {"shape": name, "tokens": tokens, "block_m": c1.BLOCK_SIZE_M,
            "configs": [c1.name("stage1"), c2.name("stage2")]}
    rows = [{**base, "variant": "single launch a stage", "us": timer(single), "rel_l2": rel(single())}]
    for bt in (b for b in TAIL_BLOCKS if b < c1.BLOCK_SIZE_M):
        split = split_by_tail(ti, experts, c1.BLOCK_SIZE_M, bt)
        t1, t2 = (dataclasses.replace(c, BLOCK_SIZE_M=bt, GROUP_SIZE_M=1) for c in (c1, c2))
        for cfg, kernel in ((t1, "stage1"), (t2, "stage2")):
            fm.check_config(cfg, kernel, "none")

        def call(split=split, t1=t1, t2=t2):
            return tail_call(x, split, c1, c2, t1, t2)

        rows.append({**base, "variant": f"tail blocks of {bt}", "us": timer(call), "rel_l2": rel(call()),
                     "computed_rows": split.computed_rows, "single_rows": split.single_rows,
                     "routed_rows": tokens * topk})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--tokens", default=None, help="comma list (default 1024,4096,8192; 40 with --tiny)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape through the interpreter (fp16)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shapes = TINY if args.tiny else SHAPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([40] if args.tiny else list(TOKENS))
    rows = []
    for name, dims in shapes.items():
        for t in tokens:
            rows += point(name, dims, t, device, 1 if device == "cpu" else args.iters)
            args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print("| shape | tokens | variant | µs | computed / routed rows | rel_l2 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = f"{r['computed_rows'] / r['routed_rows']:.3f} (single {r['single_rows'] / r['routed_rows']:.3f})" \
            if "computed_rows" in r else "—"
        print(f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['us']:.1f} | {share} | {r['rel_l2']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
