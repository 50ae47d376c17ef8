"""Bad input raises a clear TypeError/ValueError naming the argument, before any launch.

Bad values (expert ids outside [0, E), non-finite router weights) are checked on the host only
with ``check_values=True``; without it the backend drops them and ``check_errors()`` reports them
(tests/test_reference.py)."""

import pytest
import torch
from moe_oracle import make_problem, oracle_f64, rel_err

from moe_ep.api import EPGroup, MoEConfig, MoELayer
from moe_ep.backends import CapacityError, MoEError, RoutingValueError, UnsupportedBackendError

E, H, I, K, T = 8, 32, 16, 2, 10


def _setup(check_values):
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=16)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu", check_values=check_values)
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=5)
    return layer, [x, ids.to(torch.int32), w, w13, w2]


@pytest.fixture
def setup():
    return _setup(check_values=False)


@pytest.fixture
def checked():
    """A layer with the host-side value checks (the debugging opt-in)."""
    return _setup(check_values=True)


BAD = [  # (argument index, mutate, exception, message fragment)
    (0, lambda t: t.float(), TypeError, "x must have dtype"),
    (0, lambda t: t[:, :-1].contiguous(), ValueError, "x must have shape"),
    (0, lambda t: t.t().contiguous().t(), ValueError, "x must be contiguous"),
    (0, lambda t: t.unsqueeze(0), ValueError, "x must be 2-D"),
    (0, lambda t: t.tolist(), TypeError, "x must be a torch.Tensor"),
    (1, lambda t: t.float(), TypeError, "topk_ids must have one of dtypes"),
    (1, lambda t: t[:, :1].contiguous(), ValueError, "topk_ids has 1 columns but the layer's top_k is 2"),
    (1, lambda t: t[:-1].contiguous(), ValueError, "topk_ids must have shape"),
    (2, lambda t: t.double(), TypeError, "topk_weights must have dtype"),
    (2, lambda t: torch.cat([t, t], 1), ValueError, "topk_weights has 4 columns"),
    (3, lambda t: t[:4].contiguous(), ValueError, "w13 holds 4 experts"),
    (3, lambda t: t[:, :I].contiguous(), ValueError, "w13 must have shape"),
    (3, lambda t: t.float(), TypeError, "w13 must have dtype"),
    (4, lambda t: t.transpose(1, 2).contiguous(), ValueError, "w2 must have shape"),
    (3, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w13 must be contiguous"),
    (4, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w2 must be contiguous"),
]


BAD_VALUES = [  # check_values=True: (argument index, mutate, message fragment)
    (1, lambda t: torch.where(t == t[0, 0], torch.full_like(t, E), t), "outside [0, 8)"),
    (1, lambda t: torch.where(t == t[0, 0], torch.full_like(t, -1), t), "expert id -1"),
    (2, lambda t: torch.where(t == t[0, 0], torch.full_like(t, float("nan")), t), "non-finite"),
    (2, lambda t: torch.where(t == t[0, 0], torch.full_like(t, float("-inf")), t), "non-finite"),
]


@pytest.mark.parametrize("idx,mutate,exc,frag", BAD)
@pytest.mark.parametrize("check_values", [False, True])
def test_bad_forward_inputs(idx, mutate, exc, frag, check_values):
    layer, args = _setup(check_values)
    args = list(args)
    args[idx] = mutate(args[idx])
    with pytest.raises(exc) as ei:
        layer.forward(*args)
    assert frag in str(ei.value)
    assert not isinstance(ei.value, MoEError)  # plain TypeError/ValueError


@pytest.mark.parametrize("idx,mutate,frag", BAD_VALUES)
def test_bad_values_checked_on_host_when_asked(checked, idx, mutate, frag):
    layer, args = checked
    args = list(args)
    args[idx] = mutate(args[idx])
    arg = ("topk_ids", "topk_weights")[idx - 1]
    for call in (lambda: layer.forward(*args), lambda: layer.dispatch(*args[:3])):
        with pytest.raises(ValueError) as ei:
            call()
        assert type(ei.value) is ValueError  # raised before launch, not a backend's RoutingValueError
        assert frag in str(ei.value) and arg in str(ei.value)
    layer.check_errors()  # nothing reached the backend


@pytest.mark.parametrize("idx,mutate,frag", BAD_VALUES)
def test_bad_values_without_host_check_reach_the_backend(setup, idx, mutate, frag):
    layer, args = setup
    args = list(args)
    args[idx] = mutate(args[idx])
    layer.forward(*args)  # no host sync, no raise: the backend drops the choice
    with pytest.raises(RoutingValueError) as ei:
        layer.check_errors()
    assert ei.value.argument == ("topk_ids", "topk_weights")[idx - 1]


@pytest.mark.parametrize("check_values", [False, True])
def test_too_many_tokens(check_values):
    layer, (x, ids, w, w13, w2) = _setup(check_values)
    x2, ids2, w_2, _, _ = make_problem(E, H, I, K, 17, seed=1)
    for call in (lambda: layer.forward(x2, ids2, w_2, w13, w2), lambda: layer.dispatch(x2, ids2, w_2)):
        with pytest.raises(CapacityError, match="max_tokens_per_rank=16") as ei:
            call()
        assert isinstance(ei.value, ValueError)
        assert "x has 17 tokens" in str(ei.value)


def test_out_checked_and_untouched_on_error(checked):
    layer, (x, ids, w, w13, w2) = checked
    out = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must have shape"):
        layer.forward(x, ids, w, w13, w2, out=torch.empty(T + 1, H, dtype=torch.bfloat16))
    bad_ids = ids.clone()
    bad_ids[3, 1] = 99
    with pytest.raises(ValueError, match="expert id 99"):
        layer.forward(x, bad_ids, w, w13, w2, out=out)
    assert (out == 7.0).all()  # nothing written
    # and the layer still works afterwards
    got = layer.forward(x, ids, w, w13, w2, out=out)
    assert rel_err(got, oracle_f64(x, ids, w, w13, w2, "swiglu", I)) < 1e-2


def test_device_mismatch_named():
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=16)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="meta")
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=5)
    with pytest.raises(ValueError, match="x is on cpu"):
        layer.forward(x, ids, w, w13, w2)


def test_combine_validation(setup):
    layer, (x, ids, w, w13, w2) = setup
    recv, offs, h = layer.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="expert_out must have shape"):
        layer.combine(recv[:-1].contiguous(), h)
    with pytest.raises(TypeError, match="expert_out must have dtype"):
        layer.combine(recv.float(), h)
    with pytest.raises(TypeError, match="handle must be a DispatchHandle"):
        layer.combine(recv, object())
    other = MoELayer(layer.config, EPGroup.single(), backend="reference", device="cpu")
    with pytest.raises(ValueError, match="another MoELayer"):
        other.combine(recv, h)


def test_backend_errors():
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=16)
    with pytest.raises(ValueError, match=r"unknown moe_ep backend 'nope'; available: \[.*'reference'"):
        MoELayer(cfg, EPGroup.single(), backend="nope", device="cpu")
    with pytest.raises(TypeError, match="backend must be"):
        MoELayer(cfg, EPGroup.single(), backend=3, device="cpu")
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        MoELayer({"num_experts": 8}, EPGroup.single())


def test_destroyed_layer_refuses(setup):
    layer, args = setup
    layer.destroy()
    layer.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="destroyed"):
        layer.forward(*args)


@pytest.mark.parametrize("kw,exc,frag", [
    (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
    (dict(top_k=9), ValueError, "top_k (9) must be <= num_experts"),
    (dict(hidden=2.0), TypeError, "hidden must be an int"),
    (dict(dtype=torch.float16), ValueError, "dtype torch.float16 is not supported"),
    (dict(dtype="bf16"), TypeError, "dtype must be a torch.dtype"),
    (dict(activation="relu"), ValueError, "activation 'relu'"),
    (dict(max_tokens_per_rank=True), TypeError, "max_tokens_per_rank must be an int"),
])
def test_config_validation(kw, exc, frag):
    base = dict(num_experts=8, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=4)
    base.update(kw)
    with pytest.raises(exc) as ei:
        MoEConfig(**base)
    assert frag in str(ei.value)


def test_experts_not_divisible_by_world():
    cfg = MoEConfig(num_experts=6, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=4)
    with pytest.raises(ValueError, match="multiple of the EP world size"):
        cfg.local_experts(4)
    assert isinstance(UnsupportedBackendError("x"), ValueError)


def test_autograd_refused_and_parameters_accepted_under_no_grad(setup):
    """Weights held as nn.Parameter (requires_grad) are what engines and transformers pass: under
    no_grad they are used as plain tensors (the kernel backends hand them to DLPack, which refuses
    tensors that require grad); with grad enabled there is no backward, so forward refuses."""
    layer, (x, ids, w, w13, w2) = setup
    p13, p2 = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())
    with pytest.raises(RuntimeError, match="w13 requires grad"):
        layer.forward(x, ids, w, p13, p2)
    with torch.no_grad():
        y = layer.forward(x, ids, w, p13, p2)
    assert not y.requires_grad
    ref = oracle_f64(x, ids, w, w13, w2, "swiglu", I)
    assert rel_err(y, ref) < 1e-2


def test_check_tensor_device_and_shape_fast_paths_keep_the_rules():
    """The per-call checks compare a CUDA layer's device by index and a fully known shape in one
    comparison; what they accept and refuse is unchanged (CPU: a CPU tensor against a CUDA layer)."""
    from moe_ep.api import validation as V

    t = torch.zeros(4, 8)
    assert not V._on(t, torch.device("cuda", 0)) and not V._on(t, torch.device("cuda"))
    assert V._on(t, torch.device("cpu")) and not V._on(t, torch.device("meta"))
    with pytest.raises(ValueError, match="x is on cpu, but the layer runs on cuda:0"):
        V.check_tensor("x", t, device=torch.device("cuda", 0))
    assert V.check_tensor("x", t, shape=(4, 8)) is t and V.check_tensor("x", t, shape=(None, 8)) is t
    for bad, msg in (((4, 9), "must have shape \\[4, 9\\]"), ((4,), "must be 1-D"), ((None, 9), "\\[\\*, 9\\]")):
        with pytest.raises(ValueError, match=msg):
            V.check_tensor("x", t, shape=bad)


def test_fp8_parameters_reach_the_backend_detached():
    """transformers' FP8 experts hold the e4m3 weights AND their float32 block scales as
    nn.Parameter (requires_grad): under no_grad every one of them -- the scale arguments and a
    container's fields too -- reaches the backend detached (the kernel backends hand them to DLPack,
    which refuses tensors that require grad: the 61st session's H100 run of the transformers FP8
    test failed so); with grad enabled forward refuses, naming the argument. The output matches the
    same layer on plain tensors."""
    from moe_ep.api.quant import FP8Block128Weight, quantize_fp8_block128

    E_, H_, I_ = 4, 256, 128
    cfg = MoEConfig(num_experts=E_, hidden=H_, intermediate=I_, top_k=2, max_tokens_per_rank=16,
                    quant="fp8_block128")
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
    x, ids, w, w13, w2 = make_problem(E_, H_, I_, 2, 12, seed=8)
    q13, q2 = quantize_fp8_block128(w13), quantize_fp8_block128(w2)
    seen = []
    run = layer._impl.forward

    def spy(*args, **kw):
        for a in (*args, *kw.values()):
            parts = (a.values, a.scale) if isinstance(a, FP8Block128Weight) else (a,)
            seen.extend(bool(p.requires_grad) for p in parts if isinstance(p, torch.Tensor))
        return run(*args, **kw)

    layer._impl.forward = spy
    with torch.no_grad():
        want = layer.forward(x, ids, w, q13.values, q2.values, w13_scale=q13.scale, w2_scale=q2.scale)
    assert seen and not any(seen)
    param = lambda t: torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point())
    s13, s2 = param(q13.scale), param(q2.scale)
    assert s13.requires_grad
    seen.clear()
    with torch.no_grad():
        got = layer.forward(x, ids, w, param(q13.values), param(q2.values), w13_scale=s13, w2_scale=s2)
    assert seen and not any(seen), seen
    assert torch.equal(got, want)
    seen.clear()
    with torch.no_grad():  # the containers' fields
        got = layer.forward(x, ids, w, FP8Block128Weight(param(q13.values), s13), FP8Block128Weight(q2.values, s2))
    assert seen and not any(seen), seen
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="w13_scale requires grad"):
        layer.forward(x, ids, w, q13.values, q2.values, w13_scale=s13, w2_scale=q2.scale)
    with pytest.raises(RuntimeError, match=r"w2\.scale requires grad"):
        layer.forward(x, ids, w, q13, FP8Block128Weight(q2.values, s2))


def test_dispatch_and_combine_take_parameters_under_no_grad(setup):
    """dispatch's x / topk_weights and combine's expert_out that require grad are used detached under
    no_grad, refused by name with grad enabled."""
    layer, (x, ids, w, w13, w2) = setup
    px = torch.nn.Parameter(x.clone())
    with pytest.raises(RuntimeError, match="x requires grad"):
        layer.dispatch(px, ids, w)
    with torch.no_grad():
        recv, offsets, handle = layer.dispatch(px, ids, w)
        y = layer.combine(torch.nn.Parameter(recv.clone()), handle)
    assert not y.requires_grad
    recv2, _, handle2 = layer.dispatch(x, ids, w)
    assert torch.equal(y, layer.combine(recv2, handle2))
