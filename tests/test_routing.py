"""MoE routing: topk_softmax against a direct torch computation; sample_routing's guarantees."""

import pytest
import torch

from tritune.ops.routing import sample_routing, topk_softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_matches_torch(dtype, renormalize):
    logits = torch.randn(33, 60, generator=torch.Generator().manual_seed(0)).to(dtype)  # E=60: not a power of two
    weights, ids = topk_softmax(logits, 6, renormalize=renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = torch.topk(probs, 6, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (33, 6)
    assert torch.equal(ids, want_ids.int())
    torch.testing.assert_close(weights, want_w)
    picked = probs.gather(1, ids.long())  # the weights are the softmax probabilities of the chosen experts
    if renormalize:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, picked)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33))
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())  # largest first


@pytest.mark.parametrize("logits,topk", [
    (torch.randn(8), 2),  # 1-D
    (torch.zeros(4, 8, dtype=torch.int32), 2),  # integer logits
    (torch.randn(4, 8), 0),
    (torch.randn(4, 8), 9),  # more than E
])
def test_topk_softmax_bad_arguments(logits, topk):
    with pytest.raises(ValueError):
        topk_softmax(logits, topk)


@pytest.mark.parametrize("skew", [0.0, 1.2])
def test_sample_routing_shape_range_distinct(skew):
    weights, ids = sample_routing(500, 16, 8, skew=skew, seed=3)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (500, 8)
    assert int(ids.min()) >= 0 and int(ids.max()) < 16
    assert bool((ids.sort(dim=-1).values.diff(dim=-1) > 0).all())  # distinct within each row
    assert bool((weights > 0).all())
    torch.testing.assert_close(weights.sum(-1), torch.ones(500))


def test_sample_routing_topk_equals_experts():
    _, ids = sample_routing(10, 4, 4, skew=2.0, seed=0)
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(4, dtype=torch.int32).expand(10, 4))


def test_sample_routing_deterministic_per_seed():
    a = sample_routing(64, 32, 4, skew=0.8, seed=7)
    b = sample_routing(64, 32, 4, skew=0.8, seed=7)
    c = sample_routing(64, 32, 4, skew=0.8, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    assert not torch.equal(a[0], c[0])


def test_sample_routing_skew_concentrates_traffic():
    def top_share(skew: float) -> float:
        _, ids = sample_routing(4096, 64, 8, skew=skew, seed=1)
        return float(torch.bincount(ids.reshape(-1).long(), minlength=64).max()) / ids.numel()

    uniform, skewed = top_share(0.0), top_share(1.2)
    assert uniform < 1.5 / 64  # close to the fair share 1/64
    assert skewed > 4 * uniform


def test_sample_routing_device_argument():
    weights, ids = sample_routing(4, 8, 2, device=torch.device("cpu"))
    assert weights.device.type == ids.device.type == "cpu"


@pytest.mark.parametrize("kwargs", [
    dict(tokens=0, experts=8, topk=2),
    dict(tokens=4, experts=0, topk=1),
    dict(tokens=4, experts=8, topk=0),
    dict(tokens=4, experts=8, topk=9),  # topk > experts
    dict(tokens=4, experts=8, topk=2, skew=-0.5),
    dict(tokens=4, experts=8, topk=2, skew=float("nan")),
])
def test_sample_routing_bad_arguments(kwargs):
    tokens, experts, topk = kwargs.pop("tokens"), kwargs.pop("experts"), kwargs.pop("topk")
    with pytest.raises(ValueError):
        sample_routing(tokens, experts, topk, **kwargs)
