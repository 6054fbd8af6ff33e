"""Router: each backend against the tests' own fp32 router (helpers.topk_softmax_fp32).

Ids compare exactly; weights to rtol 1e-5, atol 1e-6 (fp32 softmax, different op order).
"""

import pytest
import torch

from helpers import topk_softmax_fp32
from moekit import route, topk_softmax

NAN, INF = float("nan"), float("inf")


def _check_pair(logits, top_k, renormalize=True):
    """Both backends against the reference; returns the triton backend's (weights, ids)."""
    w_ref, i_ref = topk_softmax_fp32(logits, top_k, renormalize)
    for backend in ("torch", "triton"):
        w, ids = topk_softmax(logits, top_k, renormalize=renormalize, backend=backend)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        assert torch.equal(ids, i_ref), backend
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
        # ids unique and in range within each row
        num_experts = logits.shape[1]
        assert ((ids >= 0) & (ids < num_experts)).all()
        assert all(len(set(r.tolist())) == top_k for r in ids)
    return w, ids


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k",
    [(1, 8, 2), (13, 60, 7), (5, 257, 257), (3, 1, 1), (17, 128, 8), (2, 5, 5), (9, 7, 1)],
    ids=lambda v: str(v),
)
def test_random_logits_match(num_tokens, num_experts, top_k):
    logits = torch.randn(num_tokens, num_experts)
    for renormalize in (True, False):
        w, ids = _check_pair(logits, top_k, renormalize)
        if renormalize:
            torch.testing.assert_close(w.sum(-1), torch.ones(num_tokens))


def test_ties_go_to_the_lower_id():
    logits = torch.zeros(4, 16)
    logits[1, 3::4] = 2.0
    logits[2, :] = -0.0
    logits[2, 5] = 0.0
    _, ids = _check_pair(logits, 4)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [3, 7, 11, 15]
    assert ids[2].tolist() == [0, 1, 2, 3]          # -0.0 and +0.0 tie


def test_nan_and_inf_logits():
    logits = torch.randn(5, 12)
    logits[0, 0] = NAN                               # NaN ranks lowest
    logits[1, :] = NAN                               # all NaN: ids still in range, unique
    logits[2, 4] = INF
    logits[2, 9] = INF
    logits[3, 2] = -INF
    logits[4, :6] = NAN
    w, ids = _check_pair(logits, 6)
    assert 0 not in ids[0].tolist()
    assert ids[2, :2].tolist() == [4, 9]
    assert sorted(ids[4].tolist()) == list(range(6, 12))
    assert torch.isfinite(w).all()


def test_matches_fp32_reference_and_route_linear():
    x = torch.randn(11, 40, dtype=torch.float16)
    wr = torch.randn(9, 40, dtype=torch.float16)
    w_ref, ids_ref = topk_softmax_fp32(torch.nn.functional.linear(x, wr), 3)
    for backend in ("torch", "triton"):
        w, ids = route(x, wr, 3, backend=backend)
        assert torch.equal(ids, ids_ref), backend
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,num_experts", [("triton", 8), ("torch", 8), ("auto", 5000)])
def test_num_valid_tokens_masks_padding_rows(backend, num_experts, device):
    """Rows at or past n get id -1 and weight 0 on both backends; "auto" with more experts than the
    kernel takes (5,000 > 4,096) routes through the torch backend instead of raising."""
    logits = torch.randn(6, num_experts)
    logits[5] = NAN                                       # garbage in a padding row changes nothing
    n = torch.tensor(4, dtype=torch.int32, device=device)
    w, ids = topk_softmax(logits.to(device), 2, backend=backend, num_valid_tokens=n)
    w, ids = w.cpu(), ids.cpu()
    w_ref, ids_ref = topk_softmax_fp32(logits[:4], 2)
    assert torch.equal(ids[:4], ids_ref) and (ids[4:] == -1).all()
    assert torch.equal(w[4:], torch.zeros(2, 2))
    torch.testing.assert_close(w[:4], w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_num_valid_tokens_of_another_shape_raises(backend):
    """num_valid_tokens is one count, a 0-d tensor: any other shape raises before a launch, naming
    it (the kernel would read its first element where torch broadcasts it over the K slots)."""
    logits = torch.randn(4, 6)
    x, wr = torch.randn(4, 8), torch.randn(6, 8)
    for bad in ([1, 3], [3], [[3]]):
        nv = torch.tensor(bad, dtype=torch.int32)
        for top_k in (2, 3):
            with pytest.raises(ValueError, match=r"num_valid_tokens must be a 0-d int32 tensor.*got shape"):
                topk_softmax(logits, top_k, backend=backend, num_valid_tokens=nv)
        with pytest.raises(ValueError, match=r"num_valid_tokens must be a 0-d int32 tensor.*got shape"):
            route(x, wr, 2, backend=backend, num_valid_tokens=nv)
    w, ids = topk_softmax(logits, 3, backend=backend, num_valid_tokens=torch.tensor(3, dtype=torch.int32))
    w_ref, ids_ref = topk_softmax_fp32(logits[:3], 3)
    assert torch.equal(ids[:3], ids_ref) and (ids[3:] == -1).all()
    assert torch.equal(w[3:], torch.zeros(1, 3))
    torch.testing.assert_close(w[:3], w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_tokens(backend):
    w, ids = topk_softmax(torch.empty(0, 8), 2, backend=backend)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


def test_bad_inputs_raise_before_launch():
    x, wr = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k"):
        route(x, wr, 0)
    with pytest.raises(ValueError, match="top_k"):
        route(x, wr, 5)
    with pytest.raises(TypeError, match="top_k"):
        route(x, wr, 2.0)
    with pytest.raises(ValueError, match="router_weight"):
        route(x, torch.randn(4, 7), 2)
    with pytest.raises(TypeError, match="router_weight"):
        route(x, wr.double(), 2)
    with pytest.raises(ValueError, match="hidden_states"):
        route(x[None], wr, 2)
    with pytest.raises(ValueError, match="backend"):
        route(x, wr, 2, backend="cuda")
    with pytest.raises(TypeError, match="logits"):
        topk_softmax(torch.zeros(3, 4, dtype=torch.int32), 2)
    with pytest.raises(TypeError, match="renormalize must be a bool, got 'no'"):
        route(x, wr, 2, renormalize="no")
    with pytest.raises(TypeError, match="renormalize must be a bool, got 0"):
        topk_softmax(torch.randn(3, 4), 2, renormalize=0)
