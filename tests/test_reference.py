"""Reference backend (EP=1) against the independent float64 per-pair loop; bad routing values
(expert id outside [0, E), non-finite weight) drop that choice and are reported once."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_oracle import make_problem, oracle_f64, rel_err

from moe_ep.api import EPGroup, MoEConfig, MoELayer, RoutingValueError

CASES = [  # E, H, I, K, T, activation, skew
    (8, 64, 32, 1, 37, "swiglu", False),
    (8, 64, 32, 2, 50, "swiglu", True),
    (16, 128, 64, 8, 40, "swiglu", False),
    (16, 128, 64, 8, 40, "swiglu", True),
    (4, 32, 48, 2, 19, "squared_relu", False),
    (6, 48, 16, 3, 25, "gelu_glu", True),
    (8, 64, 32, 2, 30, "clamped_swiglu", False),  # with biases and a triggered clamp: test_activations_bias.py
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


# ---- bad routing values: the choice is dropped and reported once (as the kernels do) ----------

BE, BH, BI, BK, BT = 8, 64, 32, 3, 12


def _bad_problem(seed=21):
    cfg = MoEConfig(num_experts=BE, hidden=BH, intermediate=BI, top_k=BK, max_tokens_per_rank=16)
    x, ids, w, w13, w2 = make_problem(BE, BH, BI, BK, BT, seed=seed)
    return cfg, x, ids, w, w13, w2


def _masked(ids, w, dropped):
    """The same routing with the dropped choices removed: weight 0 and a valid id (expert 0)."""
    return torch.where(dropped, torch.zeros_like(ids), ids), torch.where(dropped, torch.zeros_like(w), w)


def _layer(cfg):
    return MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu", check_values=False)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_bad_choices_are_dropped_not_wrapped(id_dtype):
    cfg, x, ids, w, w13, w2 = _bad_problem()
    bad_ids, bad_w = ids.clone(), w.clone()
    # ids 8, 10, 13, 1000 used to compute experts 0, 2, 5, 0 (modulo E_local); -1 crashed bincount
    for (t, k), v in {(3, 1): 1000, (5, 0): -1, (7, 2): BE, (9, 1): 10, (10, 0): 13, (11, 2): -(2 ** 31)}.items():
        bad_ids[t, k] = v
    for (t, k), v in {(2, 0): float("nan"), (4, 2): float("inf"), (6, 1): float("-inf")}.items():
        bad_w[t, k] = v
    dropped = (bad_ids < 0) | (bad_ids >= BE) | ~torch.isfinite(bad_w)
    assert int(dropped.sum()) == 9
    ok_ids, ok_w = _masked(bad_ids, bad_w, dropped)
    with _layer(cfg) as layer:
        got = layer.forward(x, bad_ids.to(id_dtype), bad_w, w13, w2)
        assert torch.isfinite(got).all()
        want = layer.forward(x, ok_ids.to(id_dtype), ok_w, w13, w2)
        assert torch.equal(got, want)  # exactly the routing without those choices
        assert rel_err(got, oracle_f64(x, ok_ids, ok_w, w13, w2, "swiglu", BI)) < 1e-2
        with pytest.raises(RoutingValueError) as ei:
            layer.check_errors()
        e = ei.value
        assert isinstance(e, ValueError)
        assert (e.argument, e.token, e.k, e.value) == ("topk_ids", 3, 1, 1000)  # smallest token, then k
        msg = str(e)
        assert "topk_ids[3, 1] = 1000 is outside [0, 8)" in msg and "that choice was dropped" in msg
        assert "topk_weights[2, 0] = nan is not finite" in msg  # the other kind, in the same message
        layer.check_errors()  # reported once
        # the layer keeps working
        got = layer.forward(x, ids, w, w13, w2)
        assert rel_err(got, oracle_f64(x, ids, w, w13, w2, "swiglu", BI)) < 1e-2
        layer.check_errors()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_reported(value):
    cfg, x, ids, w, w13, w2 = _bad_problem(seed=22)
    bad_w = w.clone()
    bad_w[8, 2] = value
    bad_w[5, 1] = value
    dropped = ~torch.isfinite(bad_w)
    ok_ids, ok_w = _masked(ids, bad_w, dropped)
    with _layer(cfg) as layer:
        got = layer.forward(x, ids, bad_w, w13, w2)
        assert torch.equal(got, layer.forward(x, ok_ids, ok_w, w13, w2))
        with pytest.raises(RoutingValueError, match=r"topk_weights\[5, 1\] = .* is not finite") as ei:
            layer.check_errors()
        e = ei.value
        assert (e.argument, e.token, e.k) == ("topk_weights", 5, 1)
        assert str(e.value) == str(value) and "topk_ids" not in str(e)
        layer.check_errors()


def test_negative_id_alone():
    cfg, x, ids, w, w13, w2 = _bad_problem(seed=23)
    bad = ids.clone()
    bad[0, 0] = -5
    with _layer(cfg) as layer:
        got = layer.forward(x, bad.to(torch.int32), w, w13, w2)
        ok_ids, ok_w = _masked(bad, w, bad < 0)
        assert torch.equal(got, layer.forward(x, ok_ids, ok_w, w13, w2))
        with pytest.raises(RoutingValueError, match=r"topk_ids\[0, 0\] = -5 is outside \[0, 8\)") as ei:
            layer.check_errors()
        assert (ei.value.argument, ei.value.token, ei.value.k, ei.value.value) == ("topk_ids", 0, 0, -5)


def test_bad_id_with_bad_weight_is_one_id_error():
    """A choice with an invalid id is a topk_ids error whatever its weight (as in the kernels)."""
    cfg, x, ids, w, w13, w2 = _bad_problem(seed=24)
    bad_ids, bad_w = ids.clone(), w.clone()
    bad_ids[4, 1], bad_w[4, 1] = 99, float("nan")
    with _layer(cfg) as layer:
        layer.forward(x, bad_ids, bad_w, w13, w2)
        with pytest.raises(RoutingValueError) as ei:
            layer.check_errors()
        assert (ei.value.argument, ei.value.token, ei.value.k, ei.value.value) == ("topk_ids", 4, 1, 99)
        assert "topk_weights" not in str(ei.value)


def test_first_offender_is_from_the_earliest_call_since_the_report():
    cfg, x, ids, w, w13, w2 = _bad_problem(seed=25)
    first, second = ids.clone(), ids.clone()
    first[6, 2] = 50
    second[0, 0] = 60
    w_bad = w.clone()
    w_bad[1, 1] = float("nan")
    with _layer(cfg) as layer:
        layer.forward(x, first, w, w13, w2)
        layer.forward(x, second, w_bad, w13, w2)  # later, smaller token: not the first offender
        with pytest.raises(RoutingValueError) as ei:
            layer.check_errors()
        assert (ei.value.token, ei.value.k, ei.value.value) == (6, 2, 50)
        assert "topk_weights[1, 1] = nan" in str(ei.value)  # first of its kind
        layer.forward(x, second, w, w13, w2)
        with pytest.raises(RoutingValueError) as ei:
            layer.check_errors()
        assert (ei.value.token, ei.value.k, ei.value.value) == (0, 0, 60)
        layer.check_errors()


def test_dispatch_sends_only_valid_pairs():
    cfg, x, ids, w, w13, w2 = _bad_problem(seed=26)
    bad_ids, bad_w = ids.clone(), w.clone()
    bad_ids[2, 0], bad_ids[7, 1], bad_w[9, 2] = -1, 1000, float("inf")
    dropped = (bad_ids < 0) | (bad_ids >= BE) | ~torch.isfinite(bad_w)
    ok_ids, ok_w = _masked(bad_ids, bad_w, dropped)
    with _layer(cfg) as layer:
        recv_x, offs, handle = layer.dispatch(x, bad_ids, bad_w)
        n_valid = BT * BK - 3
        assert recv_x.shape == (n_valid, BH) and handle.num_recv_rows == n_valid and int(offs[-1]) == n_valid
        for e in range(BE):
            assert int(offs[e + 1] - offs[e]) == int(((bad_ids == e) & ~dropped).sum())
        y = layer.combine(recv_x, handle)  # identity experts: sum of the valid weights times x
        ref = x.double() * ok_w.double().sum(1, keepdim=True)
        assert torch.isfinite(y).all() and rel_err(y, ref) < 5e-3
        with pytest.raises(RoutingValueError, match=r"topk_ids\[2, 0\] = -1 .*topk_weights\[9, 2\] = inf"):
            layer.check_errors()
        layer.check_errors()
        # every choice dropped: nothing sent, zero output
        recv_x, offs, handle = layer.dispatch(x, torch.full_like(ids, -1), w)
        assert recv_x.shape == (0, BH) and int(offs[-1]) == 0
        poisoned = torch.full((BT, BH), float("nan"), dtype=x.dtype)
        assert layer.combine(recv_x, handle, out=poisoned) is poisoned and (poisoned == 0).all()
        with pytest.raises(RoutingValueError):
            layer.check_errors()
        poisoned.fill_(float("nan"))  # the forward too writes every element when nothing is routed
        assert layer.forward(x, torch.full_like(ids, -1), w, w13, w2, out=poisoned) is poisoned
        assert (poisoned == 0).all()
        with pytest.raises(RoutingValueError):
            layer.check_errors()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), T=st.integers(1, 10), K=st.integers(1, 3), seed=st.integers(0, 2 ** 31 - 1))
def test_any_bad_values_equal_the_masked_oracle(data, T, K, seed):
    E, H, I = 6, 16, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=16)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(data.draw(st.lists(st.integers(-3, E + 3), min_size=T * K, max_size=T * K))).reshape(T, K)
    specials = st.sampled_from([float("nan"), float("inf"), float("-inf")])
    w = torch.tensor(data.draw(st.lists(st.one_of(st.floats(0, 1), specials), min_size=T * K, max_size=T * K)),
                     dtype=torch.float32).reshape(T, K)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, cfg.w13_rows, H, generator=g) * 0.25).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.35).bfloat16()
    id_bad, w_bad = (ids < 0) | (ids >= E), ~torch.isfinite(w)
    ok_ids, ok_w = _masked(ids, w, id_bad | w_bad)
    with _layer(cfg) as layer:
        got = layer.forward(x, ids, w, w13, w2)
        assert torch.isfinite(got).all()
        # A dropped choice leaves its expert's batch one row shorter than the masked routing's (weight 0,
        # still computed), and the CPU float32 matmul may round a row differently with another M (the
        # 53rd session's CI drew seed 72: one element one bf16 ulp apart). So: equal up to one ulp of
        # the output's scale, which a choice computed or dropped wrongly (a whole expert's term) is not.
        masked = layer.forward(x, ok_ids, ok_w, w13, w2).float()
        assert float((got.float() - masked).abs().max()) <= 2 ** -8 * float(masked.abs().max()) + 1e-30
        ref = oracle_f64(x, ok_ids, ok_w, w13, w2, "swiglu", I)
        if float(ref.norm()) > 1e-3:
            assert rel_err(got, ref) < 2e-2
        want = None
        flat_id, flat_w = id_bad.flatten(), (w_bad & ~id_bad).flatten()
        if flat_id.any():
            i = int(torch.nonzero(flat_id)[0, 0])
            want = ("topk_ids", i // K, i % K, int(ids.flatten()[i]))
        elif flat_w.any():
            i = int(torch.nonzero(flat_w)[0, 0])
            want = ("topk_weights", i // K, i % K, float(w.flatten()[i]))
        if want is None:
            layer.check_errors()
        else:
            with pytest.raises(RoutingValueError) as ei:
                layer.check_errors()
            e = ei.value
            got_err = (e.argument, e.token, e.k, e.value)
            assert got_err[:3] == want[:3]
            assert got_err[3] == want[3] or (math.isnan(got_err[3]) and math.isnan(want[3]))
        layer.check_errors()


@pytest.mark.multirank
@pytest.mark.parametrize("n", [2, 4])
def test_drops_over_ranks(n):
    """EP over n CPU ranks with bad values equals EP=1 without those choices; each rank reports its own."""
    from test_multirank import HERE, torchrun

    p = torchrun(n, HERE / "mr_drop_worker.py")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for r in range(n):
        assert f"rank {r}/{n}: OK" in p.stdout
