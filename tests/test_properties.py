"""Property tests (hypothesis): config validation and the reference math."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_f64, rel_err

from moe_ep.api import ACTIVATIONS, EPGroup, MoEConfig, MoELayer

ints = st.integers(min_value=-3, max_value=300)


@given(E=ints, H=ints, I=ints, K=ints, T=ints, act=st.sampled_from(ACTIVATIONS + ("relu", "")))
def test_config_accepts_exactly_the_valid(E, H, I, K, T, act):
    bad = {name for name, v in (("num_experts", E), ("hidden", H), ("intermediate", I), ("top_k", K),
                                ("max_tokens_per_rank", T)) if v < 1}
    bad |= {"top_k"} if K > E else set()
    bad |= {"activation"} if act not in ACTIVATIONS else set()
    valid = not bad
    try:
        cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, activation=act)
    except (ValueError, TypeError) as e:
        assert not valid
        assert any(f"MoEConfig.{name}" in str(e) for name in bad), (bad, str(e))  # names a bad argument
        return
    assert valid
    assert cfg.w13_rows == (2 * I if act != "squared_relu" else I)
    assert cfg.flops(T) == 2 * T * K * H * (cfg.w13_rows + I)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), E=st.integers(1, 6), K=st.integers(1, 3), T=st.integers(0, 12),
       act=st.sampled_from(ACTIVATIONS), seed=st.integers(0, 2**31 - 1))
def test_reference_equals_oracle_on_any_routing(data, E, K, T, act, seed):
    K = min(K, E)
    H, I = 16, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=16, activation=act)
    g = torch.Generator().manual_seed(seed)
    # arbitrary routing, duplicates across tokens allowed, any histogram (hypothesis picks the ids)
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, E - 1), min_size=K, max_size=K,
                                                   unique=True), min_size=T, max_size=T)),
                       dtype=torch.int64).reshape(T, K)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = torch.rand(T, K, generator=g)
    w13 = (torch.randn(E, cfg.w13_rows, H, generator=g) * 0.25).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.35).bfloat16()
    got = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu").forward(x, ids, w, w13, w2)
    assert got.shape == (T, H) and torch.isfinite(got).all()
    if T:
        ref = oracle_f64(x, ids, w, w13, w2, act, I)
        if float(ref.norm()) > 1e-3:
            assert rel_err(got, ref) < 2e-2
