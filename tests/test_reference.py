"""Reference backend (EP=1) against the independent float64 per-pair loop."""

import pytest
import torch
from moe_oracle import make_problem, oracle_f64, rel_err

from moe_ep.api import EPGroup, MoEConfig, MoELayer

CASES = [  # E, H, I, K, T, activation, skew
    (8, 64, 32, 1, 37, "swiglu", False),
    (8, 64, 32, 2, 50, "swiglu", True),
    (16, 128, 64, 8, 40, "swiglu", False),
    (16, 128, 64, 8, 40, "swiglu", True),
    (4, 32, 48, 2, 19, "squared_relu", False),
    (6, 48, 16, 3, 25, "gelu_glu", True),
    (8, 64, 32, 2, 0, "swiglu", False),
]


@pytest.mark.parametrize("E,H,I,K,T,act,skew", CASES)
def test_reference_matches_f64_loop(E, H, I, K, T, act, skew):
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64, activation=act)
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, gated=cfg.gated, skew=skew, seed=E * 1000 + T)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)  # poisoned
        got = layer.forward(x, ids.to(torch.int32), w, w13, w2, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.isfinite(got).all()
        if T:
            ref = oracle_f64(x, ids, w, w13, w2, act, I)
            assert rel_err(got, ref) < 1e-2
            # int64 ids give the same result
            got64 = layer.forward(x, ids, w, w13, w2)
            assert torch.equal(got64, got)


def test_skewed_routing_really_is_skewed():
    _, ids, *_ = make_problem(16, 32, 16, 8, 64, skew=True, seed=3)
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts[0] == 64  # expert 0 in every token's top-8
    assert (counts[8:] == 0).all()  # half the experts get nothing


def test_dispatch_combine_roundtrip_identity_experts():
    """With expert_out = recv_x, combine(dispatch(x)) = sum_k w[t,k] x[t] exactly (f32 sum)."""
    E, H, K, T = 8, 64, 4, 33
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=16, top_k=K, max_tokens_per_rank=T)
    x, ids, w, *_ = make_problem(E, H, 16, K, T, seed=11)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
    recv_x, offs, handle = layer.dispatch(x, ids, w)
    assert recv_x.shape == (T * K, H) and offs.dtype == torch.int32 and int(offs[-1]) == T * K
    # grouped by expert: every row in expert e's range is a token routed to e
    for e in range(E):
        toks = set(torch.nonzero((ids == e).any(1)).flatten().tolist())
        seg = recv_x[offs[e]:offs[e + 1]]
        assert seg.shape[0] == int((ids == e).sum())
        for row in seg:
            assert any(torch.equal(row, x[t]) for t in toks)
    y = layer.combine(recv_x, handle)
    ref = (x.double() * w.double().sum(1, keepdim=True))
    assert rel_err(y, ref) < 5e-3
