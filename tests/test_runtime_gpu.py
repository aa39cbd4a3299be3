"""GPU only: every op path runs without a host synchronisation (torch.cuda.set_sync_debug_mode("error")) and,
captured in a CUDA graph, replays to the eager result. The same cases feed benchmarks/bench_runtime.py."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU only: sync-free launches and CUDA-graph replay need a CUDA device")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def gemm_inputs(kernel: str, M: int, N: int, K: int, seed: int = 0) -> dict:
    from tritune.kernels.quant import quantize_blocks, quantize_rows

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g) / math.sqrt(K)
    if kernel == "bf16":
        return {"a": a.bfloat16(), "b": b.bfloat16(), "a_scale": None, "b_scale": None}
    if kernel == "a8w8":
        (qa, sa), (qb, sb) = quantize_rows(a), quantize_rows(b)
    else:
        (qa, sa), (qb, sb) = quantize_blocks(a, 1), quantize_blocks(b, 128)
    return {"a": qa, "b": qb, "a_scale": sa, "b_scale": sb}


def gemm_call(kernel: str, x: dict, config=None) -> Callable[[], torch.Tensor]:
    from tritune import ops

    if kernel == "bf16":
        return lambda: ops.gemm(x["a"], x["b"], config=config)
    op = ops.gemm_a8w8 if kernel == "a8w8" else ops.gemm_a8w8_blockscale
    return lambda: op(x["a"], x["b"], x["a_scale"], x["b_scale"], config=config)


def moe_inputs(T: int, D: int, inter: int, E: int, topk: int, quant: str = "none", seed: int = 0) -> dict:
    from tritune.kernels.fused_moe import quantize_weights
    from tritune.ops.routing import sample_routing

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w1 = torch.randn(E, 2 * inter, D, device="cuda", generator=g) / math.sqrt(D)
    w2 = torch.randn(E, D, inter, device="cuda", generator=g) / math.sqrt(inter)
    if quant == "none":
        (w1, s1), (w2, s2) = (w1.bfloat16(), None), (w2.bfloat16(), None)
    else:
        (w1, s1), (w2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
    weights, ids = sample_routing(T, E, topk, skew=0.0, device=torch.device("cuda"), seed=seed)
    return {"hidden": hidden, "w1": w1, "w2": w2, "topk_weights": weights, "topk_ids": ids, "w1_scale": s1,
            "w2_scale": s2, "quant": quant}


def moe_call(x: dict, choice=None) -> Callable[[], torch.Tensor]:
    from tritune import ops

    return lambda: ops.fused_moe(x["hidden"], x["w1"], x["w2"], x["topk_weights"], x["topk_ids"], quant=x["quant"],
                                 w1_scale=x["w1_scale"], w2_scale=x["w2_scale"], choice=choice)


def safety_cases() -> list[tuple[str, Callable[[], Callable[[], torch.Tensor]], bool]]:
    """(name, factory of a call returning its output, exact replay expected)."""
    from tritune.kernels.fused_moe import MoeConfig
    from tritune.kernels.gemm import GemmConfig
    from tritune.ops.fused_moe import MoeChoice

    cases = []
    for kernel in ("bf16", "a8w8", "a8w8_blockscale"):
        bk = 128
        for name, cfg in (("pointer", GemmConfig(64, 128, bk, 8, 4, 3)),
                          ("split-K 4", GemmConfig(16, 64, bk, 1, 4, 3, NUM_KSPLIT=4)),
                          ("TMA", GemmConfig(128, 128, bk, 8, 8, 3, PERSISTENT_TMA=True))):
            M = 8 if "split" in name else 300

            def make(kernel=kernel, cfg=cfg, M=M):
                return gemm_call(kernel, gemm_inputs(kernel, M, 1024, 2048), cfg)
            cases.append((f"gemm {kernel} {name}", make, True))

        def make_op(kernel=kernel):
            return gemm_call(kernel, gemm_inputs(kernel, 33, 2048, 1024))
        cases.append((f"gemm {kernel} op (selected config)", make_op, True))

    s1 = MoeConfig(16, 64, 128, 1, 4, 3)
    s2 = MoeConfig(16, 64, 128, 1, 4, 3)
    s1_64 = MoeConfig(64, 128, 64, 8, 8, 3)
    s2_64 = MoeConfig(64, 128, 64, 8, 8, 3)
    moe = [
        ("2-stage bf16, 1-launch sort (7 tok E128 top8)", (7, 1024, 256, 128, 8, "none"), MoeChoice(False, s1, s2, "")),
        ("2-stage bf16, 2-launch sort (256 tok E64 top8)", (256, 1024, 512, 64, 8, "none"),
         MoeChoice(False, s1_64, s2_64, "")),
        ("2-stage bf16, 3-launch sort (1024 tok E64 top8)", (1024, 1024, 512, 64, 8, "none"),
         MoeChoice(False, s1_64, s2_64, "")),
        ("2-stage bf16 split-K both stages", (4, 2048, 1024, 8, 2, "none"),
         MoeChoice(False, MoeConfig(16, 64, 128, 1, 4, 3, KSPLIT=4), MoeConfig(16, 64, 128, 1, 4, 3, KSPLIT=2), "")),
        ("2-stage bf16 TMA weights", (64, 1024, 512, 8, 2, "none"),
         MoeChoice(False, MoeConfig(16, 64, 128, 1, 4, 3, USE_TMA=1), MoeConfig(16, 64, 128, 1, 4, 3, USE_TMA=1), "")),
        ("2-stage bf16 top-1 (direct store)", (64, 1024, 512, 8, 1, "none"), MoeChoice(False, s1, s2, "")),
        ("2-stage fp8 per_token", (64, 1024, 512, 8, 2, "per_token"), MoeChoice(False, s1, s2, "")),
        ("2-stage fp8 per_1x128", (64, 1024, 512, 8, 2, "per_1x128"), MoeChoice(False, s1, s2, "")),
        ("1-stage bf16", (8, 1024, 512, 8, 2, "none"),
         MoeChoice(True, MoeConfig(16, 64, 128, 1, 4, 3, BLOCK_SIZE_D=128), None, "")),
        ("1-stage fp8 per_1x128", (8, 1024, 512, 8, 2, "per_1x128"),
         MoeChoice(True, MoeConfig(16, 64, 128, 1, 4, 3, BLOCK_SIZE_D=128), None, "")),
        ("op (selected kernels) bf16 Mixtral-like 16 tok", (16, 4096, 1792, 8, 2, "none"), None),
        # the rule table's sorted intermediate with the persistent stage 2 (m >= 64, K <= 512), bf16 and both fp8s
        ("op (selected kernels) bf16 E128 top8 I384 1024 tok", (1024, 2048, 384, 128, 8, "none"), None),
        ("op (selected kernels) fp8 per_token E128 top8 I384 1024 tok", (1024, 2048, 384, 128, 8, "per_token"), None),
        ("op (selected kernels) fp8 per_1x128 E128 top8 I384 1024 tok", (1024, 2048, 384, 128, 8, "per_1x128"), None),
        # MXFP4: the swapped GEMM (stage 1 writing the K32 order), without split-K, and the rule table's choice
        ("2-stage MXFP4 swapped", (64, 1024, 512, 32, 4, "per_1x32"),
         MoeChoice(False, MoeConfig(16, 64, 128, 1, 4, 3, SWAP_AB=1), MoeConfig(16, 64, 128, 1, 4, 3, SWAP_AB=1), "")),
        ("op (selected kernels) MXFP4 E32 top4 16 tok", (16, 1024, 512, 32, 4, "per_1x32"), None),
    ]
    for name, dims, choice in moe:
        def make(dims=dims, choice=choice):
            return moe_call(moe_inputs(*dims), choice)
        cases.append((f"fused_moe {name}", make, choice is None or not choice.run_1stage))

    def prepared(tokens: int):  # MXFP4 with prepared scales: the codes through TMA too (SCALE_TMA), the op's choice
        from tritune.ops import prepare_mxfp4_scales

        x = moe_inputs(tokens, 1024, 512, 32, 4, "per_1x32")
        x["w1_scale"], x["w2_scale"] = prepare_mxfp4_scales(x["w1_scale"]), prepare_mxfp4_scales(x["w2_scale"])
        return moe_call(x)
    for tokens in (16, 1024):
        cases.append((f"fused_moe op (selected kernels) MXFP4 prepared scales E32 top4 {tokens} tok",
                      lambda tokens=tokens: prepared(tokens), tokens != 16))  # 16: the 1-stage kernel's atomics

    def prepared_weights(tokens: int):  # and the weights re-encoded (prepare_mxfp4_weights): the swapped decode's PTX
        from tritune.ops import prepare_mxfp4_scales, prepare_mxfp4_weights

        x = moe_inputs(tokens, 1024, 512, 32, 4, "per_1x32")
        x["w1_scale"], x["w2_scale"] = prepare_mxfp4_scales(x["w1_scale"]), prepare_mxfp4_scales(x["w2_scale"])
        x["w1"], x["w2"] = prepare_mxfp4_weights(x["w1"]), prepare_mxfp4_weights(x["w2"])
        return moe_call(x)
    for tokens in (16, 1024):
        cases.append((f"fused_moe op (selected kernels) MXFP4 prepared weights E32 top4 {tokens} tok",
                      lambda tokens=tokens: prepared_weights(tokens), tokens != 16))  # 16: as above

    def one_stage_rule():  # 64 pairs over 32 experts x 12 slices of I 1536: the rule's swapped 1-stage kernel
        from tritune.ops import prepare_mxfp4_scales, prepare_mxfp4_weights

        x = moe_inputs(16, 1024, 1536, 32, 4, "per_1x32")
        x["w1_scale"], x["w2_scale"] = prepare_mxfp4_scales(x["w1_scale"]), prepare_mxfp4_scales(x["w2_scale"])
        x["w1"], x["w2"] = prepare_mxfp4_weights(x["w1"]), prepare_mxfp4_weights(x["w2"])
        return moe_call(x)
    # its fp32 atomics add in any order: graph replay within 1e-2 relative L2 of eager, not bit for bit
    cases.append(("fused_moe op (selected kernels) MXFP4 swapped 1-stage E32 top4 16 tok", one_stage_rule, False))

    def grouped(kind: str):
        from tritune.kernels.grouped_gemm import group_by_expert
        from tritune.ops.grouped_gemm import grouped_gemm, run_dw, run_dx, run_forward, select_configs

        T, E, topk, D, N = 512, 16, 4, 1024, 768
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:topk] for _ in range(T)]).int()
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(E, N, D, device="cuda", generator=g) / 32).bfloat16()
        m_sizes, gather = group_by_expert(ids, E)
        cfg = select_configs(T, w, topk, True, False)
        dy = torch.randn(T * topk, N, device="cuda", generator=g).bfloat16()
        if kind == "forward":
            return lambda: run_forward(x, w, m_sizes, gather, topk, True, False, cfg.forward)
        if kind == "dX":
            return lambda: run_dx(dy, w, m_sizes, gather, topk, True, False, cfg.dX)
        if kind == "dW":
            return lambda: run_dw(x, dy, m_sizes, gather, topk, True, False, cfg.dW)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            xg.grad, wg.grad = None, None
            m, gi = group_by_expert(ids, E)
            y = grouped_gemm(xg, wg, m, gi, topk=topk, permute_x=True)
            y.backward(dy)
            return torch.cat([y.detach().reshape(-1), xg.grad.reshape(-1), wg.grad.reshape(-1)])
        return step

    for kind in ("forward", "dX", "dW", "autograd step"):
        cases.append((f"grouped_gemm {kind}", lambda kind=kind: grouped(kind), True))
    return cases


def check_safety(name: str, factory, exact: bool) -> dict:
    rec = {"case": name}
    try:
        fn = factory()
        fn()  # binds (compiles on first sight)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        eager = eager.clone()
        torch.cuda.synchronize()
        rec["sync_free"] = True
    except Exception as err:  # noqa: BLE001 (a benchmark reports every failure and goes on)
        rec.update(sync_free=False, error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        return rec
    try:
        from tritune.tuning.bench import capture_graph

        graph, captured = capture_graph(fn)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(captured, eager)
        err = rel_l2(captured, eager)
        rec.update(graph_replay_equal=bool(same if exact else err < 1e-2), graph_rel_l2=err, exact=exact)
    except Exception as err:  # noqa: BLE001
        rec.update(graph_replay_equal=False, error=f"graph: {type(err).__name__}: {err}".splitlines()[0][:300])
    return rec



@pytest.mark.parametrize("case", safety_cases() if torch.cuda.is_available() else [], ids=lambda c: c[0])
def test_op_path_is_sync_free_and_graph_safe(case):
    name, factory, exact = case
    rec = check_safety(name, factory, exact)
    assert rec.get("sync_free"), rec
    assert rec.get("graph_replay_equal"), rec


def test_split_k_plan_on_two_streams_at_once():
    """One split-K plan used from two streams concurrently: each stream has its own tile locks, so the last-split
    reductions never mix (both results equal the single-stream one, call after call)."""
    from tritune import ops
    from tritune.kernels.gemm import GemmConfig

    x = gemm_inputs("a8w8_blockscale", 16, 4096, 7168)
    cfg = GemmConfig(16, 64, 128, 1, 4, 3, NUM_KSPLIT=8)
    want = ops.gemm_a8w8_blockscale(x["a"], x["b"], x["a_scale"], x["b_scale"], config=cfg)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(50):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(ops.gemm_a8w8_blockscale(x["a"], x["b"], x["a_scale"], x["b_scale"], config=cfg))
    torch.cuda.synchronize()
    for out in outs[0] + outs[1]:
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("quant", ["none", "per_token"])
def test_plans_bound_on_fresh_weights_leave_no_memory_behind(quant):
    """The op caches a plan per call signature and choice; a plan must not keep the call's tensors. The tuner binds a
    plan per end-to-end candidate, each on fresh weights, and TMA plans kept theirs: 2.7 GB a Mixtral candidate,
    until an H100 ran out of memory (issue 17). Three more plans bound on fresh weights here must leave the
    allocation where the first left it."""
    import dataclasses
    import gc

    from tritune.kernels.fused_moe import MoeConfig, quantize_weights
    from tritune.ops.fused_moe import MoeChoice, fused_moe
    from tritune.ops.routing import sample_routing

    tokens, model_dim, inter_dim, experts, topk = 256, 1024, 2048, 8, 2
    # BLOCK_SIZE_K 64: stage 1's gate and up tiles at 128 need 240 KB of shared memory over 3 stages (227 KB on H100)
    cfg = MoeConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3,
                    USE_TMA=1)

    def call(group: int) -> None:  # each GROUP_SIZE_M is a choice of its own, so a plan of its own
        c = dataclasses.replace(cfg, GROUP_SIZE_M=group)
        g = torch.Generator(device="cuda").manual_seed(group)
        hidden = torch.randn(tokens, model_dim, device="cuda", generator=g).bfloat16()
        w1 = torch.randn(experts, 2 * inter_dim, model_dim, device="cuda", generator=g) / 32
        w2 = torch.randn(experts, model_dim, inter_dim, device="cuda", generator=g) / 45
        if quant == "none":
            (w1, s1), (w2, s2) = (w1.bfloat16(), None), (w2.bfloat16(), None)
        else:
            (w1, s1), (w2, s2) = quantize_weights(w1, quant), quantize_weights(w2, quant)
        weights, ids = sample_routing(tokens, experts, topk, seed=group, device="cuda")
        fused_moe(hidden, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2,
                  choice=MoeChoice(False, c, c, "test"))
        torch.cuda.synchronize()

    call(1)  # the first plan also leaves the op's kept scratch
    gc.collect()
    base = torch.cuda.memory_allocated()
    for group in (2, 4, 8):
        call(group)
    gc.collect()
    weight_bytes = 3 * experts * inter_dim * model_dim * (2 if quant == "none" else 1)  # a set: 100 / 50 MB
    assert torch.cuda.memory_allocated() - base < weight_bytes // 4
