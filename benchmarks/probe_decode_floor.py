r"""How close can a decode-sized MoE call get to its byte floor on this GPU, and where does the tuned MXFP4 op's time
go at 1 and 16 tokens (issue 16: 1 token runs 3.1x its floor; 16 tokens 1.45x)?

Three measurements, each timed with three L2 states before every call, because a decode step's L2 is not what the
usual flush leaves:
- `zero`: a 200 MB buffer zeroed (the engine's `time_kernel` and `triton.testing.do_bench` both do this): L2 ends
  full of dirty lines, so the timed call's first ~50 MB of reads each evict a line that must be written back;
- `read`: the same buffer zeroed and then summed: L2 ends full of clean lines (what a model's previous layer, which
  mostly reads weights and KV cache, leaves);
- `warm`: nothing between calls (the call's own bytes may still be in L2: an upper bound, not a claim).

1. `stream`: the routed experts' bytes (gpt-oss-120b, MXFP4: stage 1's w1 and its scales, stage 2's w2 and its
   scales) read once by a plain streaming kernel (each program XORs contiguous 16-byte words), over a grid of
   programs and words per load: what any kernel that reads those bytes cannot beat, launch and ramp included.
2. `stream2`: stage 1's bytes then stage 2's, two launches back to back: the floor of a 2-GEMM decode.
3. `op`: the tuned op (`fused_moe_mxfp4`, prepared weights and scales), timed whole and under torch.profiler,
   kernel by kernel (each kernel's µs and the gap before it).

    PYTHONPATH=src python benchmarks/probe_decode_floor.py --mxfp4-csv M.csv [--tokens 1,16] --json F     # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

COPY_BYTES_PER_S = 3.0e12
FLUSH_BYTES = 200 * 2**20
FLUSHES = ("zero", "read", "warm")


_L2_PREFETCH = tl.constexpr("{ .reg .pred p; .reg .b32 t; mov.u32 $0, 0; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                             "@p cp.async.bulk.prefetch.L2.global [$1], $2; }")


@triton.jit
def _stream_kernel(w_ptr, ids_ptr, out_ptr, expert_words, chunks_per_expert, total_chunks, pf_ptr, pf_expert_bytes,
                   slots, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr):
    """XOR of every int32 word of the routed experts' slices: chunk c of slot s is words c·BLOCK.. of expert ids[s].
    PREFETCH: first each program asks L2 (one bulk prefetch an expert, thread 0) for its share of the routed experts'
    slices of a second weight at pf_ptr (pf_expert_bytes an expert): what a stage 1 could do for stage 2."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    if PREFETCH:
        piece = tl.cdiv(pf_expert_bytes, tl.num_programs(0) * 16) * 16
        start = tl.program_id(0) * piece
        if start < pf_expert_bytes:
            n = tl.minimum(piece, pf_expert_bytes - start)
            for slot in range(slots):
                e = tl.load(ids_ptr + slot).to(tl.int64)
                addr = pf_ptr + e * pf_expert_bytes + start + tl.zeros([1], tl.int64)
                tl.inline_asm_elementwise(_L2_PREFETCH, "=r,l,r", [addr, tl.full([1], n, tl.int32)], dtype=tl.int32,
                                          is_pure=False, pack=1)
    if PERSISTENT:
        step = tl.num_programs(0)
    else:
        step = total_chunks
    for item in range(tl.program_id(0), total_chunks, step):
        slot = item // chunks_per_expert
        chunk = item % chunks_per_expert
        e = tl.load(ids_ptr + slot).to(tl.int64)
        word = chunk * BLOCK + offs
        acc ^= tl.load(w_ptr + e * expert_words + word, mask=word < expert_words, other=0)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + offs, acc)


@triton.jit
def _tile_stream_kernel(w_ptr, ids_ptr, out_ptr, expert_words, row_words, rows, blocks_per_expert, total_items,
                        ROWS: tl.constexpr, STEP: tl.constexpr, ATOM: tl.constexpr):
    """XOR of the routed experts' first rows·row_words words by items of ROWS rows, each walked in steps of STEP
    words a row: a [ROWS, STEP] tile a step, as a GEMM's weight tile. The item's words are laid out in atoms of ATOM
    rows: atom a, step s, row r of the atom at a·ATOM·row_words + s·ATOM·STEP + r·STEP. ATOM 1 is the plain
    row-major weight (rows row_words apart); ATOM ROWS makes each step's tile one contiguous chunk. row_words a
    multiple of STEP."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, STEP)[None, :]
    within = (r // ATOM) * (ATOM * row_words) + (r % ATOM) * STEP + c
    acc = tl.zeros([ROWS, STEP], tl.int32)
    for item in range(tl.program_id(0), total_items, tl.num_programs(0)):
        slot = item // blocks_per_expert
        blk = item % blocks_per_expert
        e = tl.load(ids_ptr + slot).to(tl.int64)
        base = w_ptr + e * expert_words + blk * ROWS * row_words
        ok = blk * ROWS + r < rows
        for k in range(0, row_words, STEP):
            acc ^= tl.load(base + within + k * ATOM, mask=ok, other=0)
    tl.store(out_ptr + tl.program_id(0) * ROWS * STEP + r * STEP + c, acc)


class TileStream:
    """The routed experts' stage codes as [rows, row_words] int32 (row_words cut to a multiple of `step`), read by
    `_tile_stream_kernel`; checked by the XOR of every word read (XOR ignores order)."""

    def __init__(self, buf: torch.Tensor, ids: torch.Tensor, rows: int, row_words: int, rows_per_item: int,
                 step: int, programs: int, atom: int, warps: int = 4):
        self.buf, self.ids, self.rows, self.r, self.step, self.atom = buf, ids, rows, rows_per_item, step, atom
        self.row_words = row_words // step * step
        self.blocks = triton.cdiv(rows, rows_per_item)
        self.total = self.blocks * ids.numel()
        self.grid, self.warps = min(programs, self.total), warps
        self.out = torch.empty(self.grid * rows_per_item * step, dtype=torch.int32, device=buf.device)

    def __call__(self) -> None:
        _tile_stream_kernel[(self.grid,)](self.buf, self.ids, self.out, self.buf.stride(0), self.row_words, self.rows,
                                          self.blocks, self.total, ROWS=self.r, STEP=self.step, ATOM=self.atom,
                                          num_warps=self.warps)

    def check(self) -> bool:
        self()
        used = self.rows * self.row_words
        want = xor_rows(torch.cat([self.buf[e, :used] for e in self.ids.tolist()]).view(-1, 1))
        return bool(torch.equal(want, xor_rows(self.out.view(-1, 1))))


class Stream:
    """One streaming read over `slots` experts' int32 slices of `words` words each, in chunks of BLOCK words."""

    def __init__(self, buf: torch.Tensor, ids: torch.Tensor, block: int, programs: int | None, warps: int,
                 prefetch: torch.Tensor | None = None):
        self.buf, self.ids, self.block, self.warps, self.prefetch = buf, ids, block, warps, prefetch
        self.words = buf.shape[1]
        self.chunks = triton.cdiv(self.words, block)
        self.total = self.chunks * ids.numel()
        self.grid = programs or self.total
        self.out = torch.empty(self.grid * block, dtype=torch.int32, device=buf.device)

    def __call__(self) -> None:
        pf = self.buf if self.prefetch is None else self.prefetch
        _stream_kernel[(self.grid,)](self.buf, self.ids, self.out, self.words, self.chunks, self.total, pf,
                                     pf.stride(0) * pf.element_size(), self.ids.numel(), BLOCK=self.block,
                                     PERSISTENT=self.grid < self.total, PREFETCH=self.prefetch is not None,
                                     num_warps=self.warps)

    def check(self) -> bool:
        self()
        want = xor_rows(torch.cat([torch.nn.functional.pad(self.buf[e], (0, self.chunks * self.block - self.words))
                                   .view(-1, self.block) for e in self.ids.tolist()]))
        return bool(torch.equal(want, xor_rows(self.out.view(self.grid, self.block))))


def xor_rows(rows: torch.Tensor) -> torch.Tensor:
    """The XOR of a [R, B] int32 tensor's rows, by halving."""
    while rows.shape[0] > 1:
        if rows.shape[0] % 2:
            rows = torch.cat([rows, torch.zeros_like(rows[:1])])
        rows = rows[0::2] ^ rows[1::2]
    return rows[0]


def timed(fn, flush: str, iters: int = 40) -> float:
    """Median µs per call between CUDA events, the GPU parked while the calls queue, L2 in state `flush` first."""
    buf = _flush_buffer()
    fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(int(0.05 * 1.4e9))
    for s, e in zip(starts, ends, strict=True):
        _flush(buf, flush)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(1000.0 * s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


_BUF: list[torch.Tensor] = []


def _flush_buffer() -> torch.Tensor:
    if not _BUF:
        _BUF.append(torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda"))
    return _BUF[0]


def _flush(buf: torch.Tensor, flush: str) -> None:
    if flush == "zero":
        buf.zero_()
    elif flush == "read":
        buf.zero_()
        buf.sum()


def kernel_profile(fn, flush: str, iters: int = 20, park: bool = False) -> list[dict]:
    """Per kernel of one call, in launch order: mean µs and mean gap from the previous kernel's end (the first
    kernel's gap is from the flush's end); plus the span from the first start to the last end. `park`: the calls
    queue behind a sleep kernel, so the gaps are the GPU's own and not the host's launch time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    buf = _flush_buffer()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if park:
            torch.cuda._sleep(int(iters * 300e-6 * 2.0e9))  # ~300 µs a call of ~2 GHz cycles: the host stays ahead
        for _ in range(iters):
            _flush(buf, flush)
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name != "[memory]"),
                    key=lambda e: e.time_range.start)
    with profile(activities=[ProfilerActivity.CUDA]) as alone:
        _flush(buf, flush)
        torch.cuda.synchronize()
    flush_kernels = sum(1 for e in alone.events() if e.device_type == DeviceType.CUDA and e.name != "[memory]")
    if park:
        events = events[1:]  # the sleep
    per_call = len(events) // iters
    calls = [events[c * per_call:(c + 1) * per_call] for c in range(iters)]
    rows = []
    for i in range(flush_kernels, per_call):
        dur = [c[i].time_range.elapsed_us() for c in calls]
        gap = [c[i].time_range.start - c[i - 1].time_range.end for c in calls] if i else [0.0]
        rows.append({"kernel": calls[0][i].name[:70], "us": round(statistics.mean(dur), 2),
                     "gap_us": round(statistics.mean(gap), 2)})
    span = [c[-1].time_range.end - c[flush_kernels].time_range.start for c in calls]
    rows.append({"kernel": "span (first start to last end)", "us": round(statistics.median(span), 2), "gap_us": 0})
    return rows


def stream_rows(d: int, inter: int, experts: int, topk: int, tokens: int) -> list[dict]:
    from tritune import ops

    _, ids = ops.sample_routing(tokens, experts, topk, seed=1234, device=torch.device("cuda"))
    routed = torch.unique(ids).to(torch.int32)
    # int32 words of one expert's stage-1 (w1 codes + scales) and stage-2 bytes
    w1_words = (2 * inter * d // 2 + 2 * inter * d // 32) // 4
    w2_words = (d * inter // 2 + d * inter // 32) // 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    b1 = torch.randint(-2**31, 2**31 - 1, (experts, w1_words), generator=gen, device="cuda", dtype=torch.int32)
    b2 = torch.randint(-2**31, 2**31 - 1, (experts, w2_words), generator=gen, device="cuda", dtype=torch.int32)
    floor1 = routed.numel() * w1_words * 4 / COPY_BYTES_PER_S * 1e6
    floor2 = routed.numel() * w2_words * 4 / COPY_BYTES_PER_S * 1e6
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(block, progs, warps) for block in (1024, 2048, 4096) for progs in (None, sms * 2, sms * 4, sms * 8)
              for warps in (4, 8) if not (block == 1024 and warps == 8)]
    best = {}
    for block, progs, warps in shapes:
        s1 = Stream(b1, routed, block, progs, warps)
        s2 = Stream(b2, routed, block, progs, warps)
        if not (s1.check() and s2.check()):
            rows.append({"what": "stream", "block": block, "programs": progs, "warps": warps, "error": "checksum"})
            continue
        for flush in FLUSHES:
            t1, t2 = timed(s1, flush), timed(s2, flush)
            t12 = timed(lambda a=s1, b=s2: (a(), b()), flush)
            row = {"what": "stream", "tokens": tokens, "experts": routed.numel(), "block": block,
                   "programs": progs or s1.total, "warps": warps, "flush": flush, "stage1_us": round(t1, 2),
                   "stage2_us": round(t2, 2), "both_us": round(t12, 2), "floor1_us": round(floor1, 2),
                   "floor2_us": round(floor2, 2)}
            rows.append(row)
            key = flush
            if key not in best or t12 < best[key]["both_us"]:
                best[key] = row
    # the same bytes by GEMM-like items (64 rows of one expert, 352 of a row's 360 codes words, 16 words = 128
    # weights a step), laid out in atoms of 1 (the plain weight), 16 or 64 rows (codes only, no scales)
    for atom in (1, 16, 64):
        for progs in (sms * 4, sms * 8):
            ts = TileStream(b1, routed, 2 * inter, d // 8, 64, 16, progs, atom)
            ts2 = TileStream(b2, routed, d, inter // 8, 64, 16, progs, atom)
            if not (ts.check() and ts2.check()):
                rows.append({"what": "tiles", "atom": atom, "programs": progs, "error": "checksum"})
                continue
            for flush in FLUSHES[:2]:
                t1, t2 = timed(ts, flush), timed(ts2, flush)
                row = {"what": "tiles", "tokens": tokens, "atom": atom, "programs": ts.grid, "flush": flush,
                       "stage1_codes_us": round(t1, 2), "stage2_codes_us": round(t2, 2)}
                rows.append(row)
                print(f"| tiles atom {atom} {flush} | {tokens} tok | progs {ts.grid} | s1 codes {t1:.2f} | "
                      f"s2 codes {t2:.2f} |", flush=True)
    # stage 1's bytes read while each program prefetches its share of stage 2's into L2, then stage 2 read
    for flush in FLUSHES[:2]:
        row = best[flush]
        s1 = Stream(b1, routed, row["block"], row["programs"], row["warps"], prefetch=b2)
        s2 = Stream(b2, routed, row["block"], row["programs"], row["warps"])
        if not s1.check():
            rows.append({"what": "prefetch", "error": "checksum"})
            continue
        t1, t12 = timed(s1, flush), timed(lambda a=s1, b=s2: (a(), b()), flush)
        rows.append({"what": "prefetch", "tokens": tokens, "flush": flush, "stage1_us": round(t1, 2),
                     "both_us": round(t12, 2), "both_plain_us": row["both_us"]})
        print(f"| prefetch {flush} | {tokens} tok | s1 with the prefetch {t1:.2f} | both {t12:.2f} (plain "
              f"{row['both_us']}) |", flush=True)
    for flush, row in best.items():
        print(f"| stream best {flush} | {tokens} tok | s1 {row['stage1_us']} (floor {row['floor1_us']}) | "
              f"s2 {row['stage2_us']} (floor {row['floor2_us']}) | both {row['both_us']} | block {row['block']} "
              f"progs {row['programs']} w{row['warps']} |", flush=True)
    return rows


def bf16_tile_rows(d: int, inter: int, experts: int, topk: int, tokens: int) -> list[dict]:
    """The routed experts' bf16 weights (w1 [2I, D], w2 [D, I]) read as a bf16 GEMM's tiles: 64 rows, a 64-wide K
    step (128 bytes a row, 32 words), the rows as stored (atom 1) or laid out tile by tile (atom 64); both flushes.
    Whether the bf16 op's decode would gain from a tile-major layout too (issue 14)."""
    from tritune import ops

    _, ids = ops.sample_routing(tokens, experts, topk, seed=1234, device=torch.device("cuda"))
    routed = torch.unique(ids).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1_row, w2_row = d // 2, inter // 2  # int32 words of a bf16 row
    b1 = torch.randint(-2**31, 2**31 - 1, (experts, 2 * inter * w1_row), generator=gen, device="cuda",
                       dtype=torch.int32)
    b2 = torch.randint(-2**31, 2**31 - 1, (experts, d * w2_row), generator=gen, device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    floor = routed.numel() * (b1.shape[1] + b2.shape[1]) * 4 / COPY_BYTES_PER_S * 1e6
    rows = []
    for atom in (1, 64):
        ts = TileStream(b1, routed, 2 * inter, w1_row, 64, 32, sms * 8, atom)
        ts2 = TileStream(b2, routed, d, w2_row, 64, 32, sms * 8, atom)
        if not (ts.check() and ts2.check()):
            rows.append({"what": "bf16 tiles", "atom": atom, "error": "checksum"})
            continue
        for flush in FLUSHES[:2]:
            t1, t2 = timed(ts, flush), timed(ts2, flush)
            rows.append({"what": "bf16 tiles", "tokens": tokens, "atom": atom, "flush": flush,
                         "stage1_us": round(t1, 2), "stage2_us": round(t2, 2), "floor_us": round(floor, 2)})
            print(f"| bf16 tiles atom {atom} {flush} | {tokens} tok | s1 {t1:.2f} | s2 {t2:.2f} | both floor "
                  f"{floor:.1f} |", flush=True)
    return rows


def op_rows(csv: pathlib.Path, d: int, inter: int, experts: int, topk: int, tokens_list: list[int]) -> list[dict]:
    os.environ["TRITUNE_CONFIG_FMOE"] = str(csv)
    from bench_mxfp4_tuned_ab import mxfp4_moe

    from tritune import ops

    g = torch.Generator(device="cuda").manual_seed(0)
    moe = mxfp4_moe(d, inter, experts, g)
    pw1, pw2, ps1, ps2 = moe.w1, moe.w2, moe.s1, moe.s2
    rows = []
    for tokens in tokens_list:
        hidden = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
        weights, ids = ops.sample_routing(tokens, experts, topk, seed=1234, device=torch.device("cuda"))

        def call(h=hidden, w=weights, i=ids):
            return ops.fused_moe_mxfp4(h, pw1, pw2, w, i, ps1, ps2)

        for flush in FLUSHES:
            us = timed(call, flush)
            prof = kernel_profile(call, flush)
            rows.append({"what": "op", "tokens": tokens, "flush": flush, "us": round(us, 2), "kernels": prof})
            kern = " + ".join(f"{k['us']:.1f}" for k in prof[:-1])
            print(f"| op {flush} | {tokens} tok | {us:.1f} µs | span {prof[-1]['us']} | kernels {kern} |", flush=True)
            for k in prof:
                print(f"    {k['kernel']:<72} {k['us']:8.2f} gap {k['gap_us']:6.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mxfp4-csv", type=pathlib.Path, default=None, help="tuned rows for the op (else no op rows)")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--dims", default="2880,2880,128,4", help="D,I,E,TOPK")
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--bf16-tiles", action="store_true", help="also the bf16 weights read as tiles, by layout")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_decode_floor: needs a GPU (it times streaming reads and the op)")
    d, inter, experts, topk = (int(x) for x in args.dims.split(","))
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    if args.bf16_tiles:
        for t in tokens:
            rows += bf16_tile_rows(d, inter, experts, topk, t)
    if not args.skip_stream:
        for t in tokens:
            rows += stream_rows(d, inter, experts, topk, t)
    if args.mxfp4_csv:
        rows += op_rows(args.mxfp4_csv, d, inter, experts, topk, tokens)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
