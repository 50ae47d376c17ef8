"""Every activation (clamped_swiglu included) with and without per-expert biases (float32, bf16)
on the reference backend against the independent float64 oracle; any shape (hidden 511, the
gpt-oss 2880, intermediate 100); b13/b2 and swiglu_alpha/limit/bias_dtype validation."""

import math
import warnings

import pytest
import torch
from moe_oracle import fc1_f64, gated_f64, gelu_tanh_f64, make_problem, oracle_f64, rel_err

from moe_ep.api import ACTIVATIONS, EPGroup, MoEConfig, MoELayer
from moe_ep.backends import BackendSpec, BackendWarning, UnsupportedBackendError, explain, register, registry, select
from moe_ep.backends.reference import expert_mlp, grouped_mm_fits

BIAS_DTYPES = [None, torch.float32, torch.bfloat16]
TOL = 6e-3  # vs the float64 oracle: bf16 activation before FC2 and bf16 output give ~3e-3
GROUPED_TOL = 8e-3  # torch._grouped_mm also rounds FC1's and FC2's products to bf16 (~4e-3)
CLAMP_W13_SCALE = 5.0  # FC1 outputs ~ N(0, 5²) (plus bias): |h| > limit=7 for ~15% of them


def problem(cfg, T, seed, *, w13_scale=None, skew=False):
    """Global problem for ``cfg`` (E_local = E) plus biases of ``cfg.bias_dtype`` (or None) with
    magnitudes comparable to what they are added to: b13 ~ FC1's outputs, b2 ~ the layer's output."""
    E, H, I, K = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, gated=cfg.gated, skew=skew, seed=seed)
    if w13_scale is None:
        # FC1 outputs large enough that a clamp at gpt-oss's 7 / a gate softcap of 4 bites
        w13_scale = CLAMP_W13_SCALE if cfg.activation in ("clamped_swiglu", "softcapped_swiglu") else 1.0
    if w13_scale != 1.0:
        w13 = (w13.float() * w13_scale).to(cfg.dtype)
    b13 = b2 = None
    if cfg.bias_dtype is not None:
        g = torch.Generator().manual_seed(seed + 1)
        h_rms = float(fc1_f64(x, ids, w13).pow(2).mean().sqrt())
        y_rms = float(oracle(cfg, x, ids, w, w13, w2).pow(2).mean().sqrt())
        b13 = (torch.randn(E, cfg.w13_rows, generator=g) * h_rms).to(cfg.bias_dtype)
        b2 = (torch.randn(E, H, generator=g) * y_rms).to(cfg.bias_dtype)
    return x, ids, w, w13, w2, b13, b2


def oracle(cfg, x, ids, w, w13, w2, b13=None, b2=None, **kw):
    kw = {"alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit, "beta": cfg.swiglu_beta,
          "gate_softcap": cfg.gate_softcap, "up_softcap": cfg.up_softcap, **kw}
    return oracle_f64(x, ids, w, w13, w2, cfg.activation, cfg.intermediate, b13=b13, b2=b2, **kw)


def clamp_counts(cfg, x, ids, w13, b13):
    """(gate entries above limit, up entries outside [-limit, limit]) over all pairs' FC1 outputs."""
    h = fc1_f64(x, ids, w13, b13)
    lim = cfg.swiglu_limit
    return int((h[:, :cfg.intermediate] > lim).sum()), int((h[:, cfg.intermediate:].abs() > lim).sum())


def _cfg(E=8, H=64, I=32, K=3, T=64, act="swiglu", bias_dtype=None, **kw):
    return MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, activation=act,
                     bias_dtype=bias_dtype, **kw)


@pytest.mark.parametrize("bias_dtype", BIAS_DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activation_and_bias_match_f64(act, bias_dtype):
    cfg = _cfg(act=act, bias_dtype=bias_dtype)
    T = 41
    seed = 100 * ACTIVATIONS.index(act) + BIAS_DTYPES.index(bias_dtype)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, T, seed)
    ref = oracle(cfg, x, ids, w, w13, w2, b13, b2)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        out = torch.full((T, cfg.hidden), float("nan"), dtype=torch.bfloat16)  # poisoned
        got = layer.forward(x, ids.to(torch.int32), w, w13, w2, out=out, b13=b13, b2=b2)
        assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
        # bf16 rounding points: the activation before FC2 and the output (measured ~3e-3)
        assert rel_err(got, ref) < TOL
        assert torch.equal(layer.forward(x, ids, w, w13, w2, b13=b13, b2=b2), got)  # int64 ids, no out
    if bias_dtype is not None:
        assert b13.dtype == b2.dtype == bias_dtype and b13.abs().min() > 0 and b2.abs().min() > 0
        # the biases matter: the output without them is far off (so the check above sees them)
        assert rel_err(oracle(cfg, x, ids, w, w13, w2), ref) > 0.5
        assert rel_err(oracle(cfg, x, ids, w, w13, w2, b13=None, b2=b2), ref) > 0.5
        assert rel_err(oracle(cfg, x, ids, w, w13, w2, b13=b13, b2=None), ref) > 0.2
    if act == "clamped_swiglu":
        n_gate, n_up = clamp_counts(cfg, x, ids, w13, b13)
        assert n_gate > 0 and n_up > 0, (n_gate, n_up)  # the clamp at limit really triggers
        assert rel_err(oracle(cfg, x, ids, w, w13, w2, b13, b2, limit=math.inf), ref) > 0.5


def test_clamped_swiglu_uses_the_configs_alpha_and_limit():
    cfg = _cfg(act="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=1.5, bias_dtype=torch.float32)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, 37, seed=7, w13_scale=1.0)
    n_gate, n_up = clamp_counts(cfg, x, ids, w13, b13)
    assert n_gate > 0 and n_up > 0
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2, b13=b13, b2=b2)
    assert rel_err(got, oracle(cfg, x, ids, w, w13, w2, b13, b2)) < TOL
    # the defaults (1.702, 7.0) would give something else
    assert rel_err(got, oracle(cfg, x, ids, w, w13, w2, b13, b2, alpha=1.702)) > 0.1
    assert rel_err(got, oracle(cfg, x, ids, w, w13, w2, b13, b2, limit=7.0)) > 0.5


@pytest.mark.parametrize("bias_dtype", [None, torch.float32], ids=str)
def test_clamped_swiglu_without_the_plus_one(bias_dtype):
    """DeepSeek-V4 / GLM-5 / Hunyuan-V4's clamped SwiGLU: ``swiglu_alpha=1, swiglu_beta=0`` --
    ``silu(min(g, limit)) * clamp(u, -limit, limit)``, against float64 written from that
    definition (not from the shared oracle's formula)."""
    cfg = _cfg(act="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=3.0, swiglu_beta=0.0, bias_dtype=bias_dtype)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, 53, seed=11, w13_scale=3.0)
    n_gate, n_up = clamp_counts(cfg, x, ids, w13, b13)
    assert n_gate > 0 and n_up > 0  # the clamp really triggers
    I = cfg.intermediate
    want = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double() + (0 if b13 is None else b13[e].double())
            a = torch.nn.functional.silu(h[:I].clamp(max=3.0)) * h[I:].clamp(-3.0, 3.0)
            want[t] += float(w[t, k]) * (w2[e].double() @ a + (0 if b2 is None else b2[e].double()))
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        out = torch.full((x.shape[0], cfg.hidden), float("nan"), dtype=torch.bfloat16)
        got = layer.forward(x, ids, w, w13, w2, out=out, b13=b13, b2=b2)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL
    # gpt-oss's +1 (the default beta) would give something else
    assert rel_err(got, oracle(cfg, x, ids, w, w13, w2, b13, b2, beta=1.0)) > 0.1


def test_activate_clamped_swiglu_elementwise():
    """The formula itself, on hand-picked values (gate rows first, then up rows)."""
    from moe_ep.backends.reference import activate

    g = torch.tensor([[-9.0, -1.0, 0.0, 0.5, 7.0, 8.0, 100.0]])
    u = torch.tensor([[-9.0, -7.5, 0.0, 3.0, 6.9, 7.5, -100.0]])
    got = activate(torch.cat([g, u], 1), "clamped_swiglu", 7, swiglu_alpha=1.702, swiglu_limit=7.0)
    gc, uc = g.double().clamp(max=7.0), u.double().clamp(-7.0, 7.0)
    want = (uc + 1) * gc / (1 + torch.exp(-1.702 * gc))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert got[0, 6] == pytest.approx((-7.0 + 1) * 7.0 / (1 + math.exp(-1.702 * 7.0)), rel=1e-6)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activate_is_each_formula_element_by_element(act):
    """``activate`` against each activation's float64 formula (``gated_f64``, not torch's functions),
    gates over [-8, 8] with the interval [-4, -2.8] sampled densely: there GELU's erf and tanh forms
    differ by 5-80%, which the layer tests' norm-wise tolerance cannot see."""
    from moe_ep.backends.reference import activate

    gen = torch.Generator().manual_seed(7 + ACTIVATIONS.index(act))
    g = torch.cat([torch.rand(300, generator=gen) * 16 - 8, torch.linspace(-4, -2.8, 100)]).double()
    u = torch.randn(400, generator=gen, dtype=torch.float64) * 9  # past the clamp at 7 for some
    cfg = _cfg(act=act)
    c = {"swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit, "swiglu_beta": cfg.swiglu_beta,
         "swiglu_limit_after_act": cfg.swiglu_limit_after_act, "gate_softcap": cfg.gate_softcap,
         "up_softcap": cfg.up_softcap}
    if act == "squared_relu":
        got, want = activate(g[None].float(), act, 400), torch.relu(g[None]) ** 2
    else:
        got = activate(torch.cat([g, u])[None].float(), act, 400, **c)
        want = gated_f64(act, g[None], u[None], c)
    # float32 math on float32-rounded inputs: a few ulp of the larger of the two factors
    scale = (g.abs().clamp(min=1) * u.abs().clamp(min=1))[None]
    assert ((got.double() - want).abs() <= 1e-5 * scale).all(), act
    assert (want != 0).float().mean() > 0.3  # not a test on zeros (squared_relu: 36% nonzero)
    if act == "gelu_glu":  # the check above tells the erf form from the tanh one
        tanh_form = gelu_tanh_f64(g[None]) * u[None]
        assert ((tanh_form - want).abs() > 1e-5 * scale).any()


# ---- any shape: torch._grouped_mm only where it can take the strides, else the loop ----------

ODD = [  # E, H, I, K, T, activation, bias dtype
    (4, 511, 64, 2, 13, "swiglu", torch.float32),           # hidden 511: no 16-byte strides
    (4, 511, 64, 2, 13, "clamped_swiglu", torch.bfloat16),
    (4, 96, 100, 2, 11, "gelu_glu", None),                    # intermediate 100
    (4, 96, 100, 3, 11, "squared_relu", torch.float32),       # w13_rows 100 too
    (4, 96, 100, 2, 11, "clamped_swiglu", torch.float32),
    (2, 2880, 2880, 2, 6, "clamped_swiglu", torch.bfloat16),  # gpt-oss expert shape
]


@pytest.mark.parametrize("E,H,I,K,T,act,bias_dtype", ODD)
def test_odd_shapes(E, H, I, K, T, act, bias_dtype):
    cfg = _cfg(E=E, H=H, I=I, K=K, T=T, act=act, bias_dtype=bias_dtype)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, T, seed=H + I)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2, b13=b13, b2=b2)
        assert rel_err(got, oracle(cfg, x, ids, w, w13, w2, b13, b2)) < TOL
        if act == "clamped_swiglu":
            assert min(clamp_counts(cfg, x, ids, w13, b13)) > 0
        # the expert MLP on its own: _grouped_mm where the strides allow it (CPU torch has it too)
        recv, offs, _ = layer.dispatch(x, ids, w)
    fits = grouped_mm_fits(recv, w13, w2)
    assert fits == all(n % 8 == 0 for n in (H, I, cfg.w13_rows))
    kw = dict(b13=b13, b2=b2, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    loop = expert_mlp(recv, offs, w13, w2, act, I, grouped=False, **kw)
    auto = expert_mlp(recv, offs, w13, w2, act, I, **kw)  # CPU: the loop
    assert torch.equal(auto, loop)
    grouped = expert_mlp(recv, offs, w13, w2, act, I, grouped=True, **kw)
    if fits:
        assert rel_err(grouped, loop) < GROUPED_TOL
    else:
        assert torch.equal(grouped, loop)  # fell back to the loop instead of failing


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("H", [511, 100, 36])
def test_grouped_mm_really_refuses_those_strides(H):
    """The condition grouped_mm_fits guards against is real: torch fails on these shapes."""
    x = torch.randn(10, H).bfloat16()
    w = torch.randn(2, 24, H).bfloat16()
    assert not grouped_mm_fits(x, w, torch.randn(2, H, 24).bfloat16())
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([4, 10], dtype=torch.int32))


@pytest.mark.parametrize("act", ["swiglu", "clamped_swiglu", "squared_relu"])
def test_grouped_path_with_biases_and_padding_rows(act):
    """The _grouped_mm path (CUDA's) with biases, run on CPU: equal to the loop within bf16
    rounding; rows past offsets[-1] (a kernel backend's padding) do not disturb the valid ones."""
    cfg = _cfg(act=act, bias_dtype=torch.float32, K=2)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, 30, seed=31, skew=True)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
    recv, offs, h = layer.dispatch(x, ids, w)
    R = recv.shape[0]
    padded = torch.cat([recv, torch.randn(17, cfg.hidden).bfloat16()])
    kw = dict(b13=b13, b2=b2, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    loop = expert_mlp(recv, offs, w13, w2, act, cfg.intermediate, grouped=False, **kw)
    for rows in (recv, padded):
        grouped = expert_mlp(rows, offs, w13, w2, act, cfg.intermediate, grouped=True, **kw)
        assert grouped.shape == rows.shape
        assert rel_err(grouped[:R], loop) < GROUPED_TOL
    ref = oracle(cfg, x, ids, w, w13, w2, b13, b2)
    assert rel_err(layer.combine(loop, h), ref) < TOL
    assert rel_err(layer.combine(grouped[:R].contiguous(), h), ref) < GROUPED_TOL
    # the old positional call still works (no biases, default clamped_swiglu parameters)
    y = expert_mlp(recv, offs, w13, w2, act, cfg.intermediate)
    assert rel_err(layer.combine(y, h), oracle(cfg, x, ids, w, w13, w2)) < TOL


# ---- validation --------------------------------------------------------------------------------

VE, VH, VI, VK, VT = 8, 32, 16, 2, 10


def _bias_setup(bias_dtype=torch.float32, act="swiglu", device="cpu"):
    cfg = _cfg(E=VE, H=VH, I=VI, K=VK, T=16, act=act, bias_dtype=bias_dtype)
    x, ids, w, w13, w2 = make_problem(VE, VH, VI, VK, VT, gated=cfg.gated, seed=5)
    b13 = torch.randn(VE, cfg.w13_rows).to(bias_dtype or torch.float32)
    b2 = torch.randn(VE, VH).to(bias_dtype or torch.float32)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device=device)
    return layer, [x, ids, w, w13, w2], b13, b2


BAD_BIAS = [  # (argument, mutate, exception, message fragments)
    ("b13", lambda t: None, ValueError, ["b13 is required", "config.bias_dtype is set"]),
    ("b2", lambda t: None, ValueError, ["b2 is required", "config.bias_dtype is set"]),
    ("b13", lambda t: t.bfloat16(), TypeError, ["b13 must have dtype torch.float32, got torch.bfloat16"]),
    ("b2", lambda t: t.double(), TypeError, ["b2 must have dtype torch.float32"]),
    ("b13", lambda t: t.tolist(), TypeError, ["b13 must be a torch.Tensor"]),
    ("b2", lambda t: t.numpy(), TypeError, ["b2 must be a torch.Tensor"]),
    ("b13", lambda t: t[:, :VI].contiguous(), ValueError, ["b13 must have shape [8, 32]"]),
    ("b13", lambda t: t[:4].contiguous(), ValueError, ["b13 holds 4 experts", "8 local experts"]),
    ("b13", lambda t: t.unsqueeze(-1), ValueError, ["b13 must be 2-D"]),
    ("b2", lambda t: t.reshape(-1), ValueError, ["b2 must be 2-D"]),
    ("b2", lambda t: torch.cat([t, t], 1), ValueError, ["b2 must have shape [8, 32]"]),
    ("b2", lambda t: t.t().contiguous().t(), ValueError, ["b2 must be contiguous"]),
]


@pytest.mark.parametrize("name,mutate,exc,frags", BAD_BIAS)
def test_bad_biases(name, mutate, exc, frags):
    layer, args, b13, b2 = _bias_setup()
    biases = {"b13": b13, "b2": b2}
    biases[name] = mutate(biases[name])
    out = torch.full((VT, VH), 7.0, dtype=torch.bfloat16)
    with pytest.raises(exc) as ei:
        layer.forward(*args, out=out, **biases)
    for frag in frags:
        assert frag in str(ei.value)
    assert type(ei.value) is exc  # a plain TypeError/ValueError, raised before any launch
    assert (out == 7.0).all()
    layer.forward(*args, out=out, b13=b13, b2=b2)  # the layer still works


@pytest.mark.parametrize("name", ["b13", "b2"])
def test_biases_refused_without_bias_dtype(name):
    layer, args, b13, b2 = _bias_setup(bias_dtype=None)
    with pytest.raises(ValueError) as ei:
        layer.forward(*args, **{name: {"b13": b13, "b2": b2}[name]})
    msg = str(ei.value)
    assert msg.startswith(f"{name} was given") and "set MoEConfig.bias_dtype" in msg
    with pytest.raises(TypeError):  # keyword-only: a sixth positional argument is out, not a bias
        layer.forward(*args, None, b13)
    layer.forward(*args)


def test_bf16_bias_dtype_wants_bf16():
    layer, args, b13, b2 = _bias_setup(bias_dtype=torch.bfloat16)
    assert b13.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="b2 must have dtype torch.bfloat16, got torch.float32"):
        layer.forward(*args, b13=b13, b2=b2.float())
    layer.forward(*args, b13=b13, b2=b2)


def test_bias_device_named():
    layer, args, b13, b2 = _bias_setup(device="meta")
    args = [a.to("meta") for a in args]
    with pytest.raises(ValueError, match="b13 is on cpu, but the layer runs on meta"):
        layer.forward(*args, b13=b13, b2=b2.to("meta"))
    with pytest.raises(ValueError, match="b2 is on cpu, but the layer runs on meta"):
        layer.forward(*args, b13=b13.to("meta"), b2=b2)


@pytest.mark.parametrize("kw,exc,frag", [
    (dict(swiglu_alpha=float("nan")), ValueError, "swiglu_alpha must be finite"),
    (dict(swiglu_alpha=float("-inf")), ValueError, "swiglu_alpha must be finite"),
    (dict(swiglu_alpha="1.702"), TypeError, "swiglu_alpha must be a float"),
    (dict(swiglu_alpha=None), TypeError, "swiglu_alpha must be a float"),
    (dict(swiglu_limit=0.0), ValueError, "swiglu_limit must be > 0"),
    (dict(swiglu_limit=-7), ValueError, "swiglu_limit must be > 0"),
    (dict(swiglu_limit=float("inf")), ValueError, "swiglu_limit must be finite"),
    (dict(swiglu_limit=float("nan")), ValueError, "swiglu_limit must be finite"),
    (dict(swiglu_limit=True), TypeError, "swiglu_limit must be a float"),
    (dict(swiglu_beta=float("nan")), ValueError, "swiglu_beta must be finite"),
    (dict(swiglu_beta=float("inf")), ValueError, "swiglu_beta must be finite"),
    (dict(swiglu_beta="0"), TypeError, "swiglu_beta must be a float"),
    (dict(swiglu_beta=False), TypeError, "swiglu_beta must be a float"),
    (dict(bias_dtype=torch.float16), ValueError, "bias_dtype torch.float16 is not supported"),
    (dict(bias_dtype=torch.float64), ValueError, "bias_dtype torch.float64 is not supported"),
    (dict(bias_dtype=torch.int32), ValueError, "bias_dtype"),
    (dict(bias_dtype="float32"), TypeError, "bias_dtype must be None or a torch.dtype"),
])
@pytest.mark.parametrize("act", ["swiglu", "clamped_swiglu"])
def test_config_validation(kw, exc, frag, act):
    base = dict(num_experts=8, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=4, activation=act)
    with pytest.raises(exc) as ei:
        MoEConfig(**base, **kw)
    assert frag in str(ei.value) and "MoEConfig." in str(ei.value)


def test_config_accepts_and_normalises():
    cfg = MoEConfig(num_experts=8, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=4,
                    activation="clamped_swiglu", swiglu_alpha=2, swiglu_limit=10, bias_dtype=torch.bfloat16)
    assert cfg.gated and cfg.w13_rows == 32 and cfg.has_bias
    assert type(cfg.swiglu_alpha) is float and cfg.swiglu_alpha == 2.0 and cfg.swiglu_limit == 10.0
    d = MoEConfig(num_experts=8, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=4)
    assert (d.swiglu_alpha, d.swiglu_limit, d.swiglu_beta, d.bias_dtype, d.has_bias) == (1.702, 7.0, 1.0, None,
                                                                                           False)
    z = MoEConfig(**{**d.__dict__, "swiglu_beta": 0})
    assert type(z.swiglu_beta) is float and z.swiglu_beta == 0.0 and z != d
    # beta is the last field: positional construction of the earlier fields is unchanged
    p = MoEConfig(8, 32, 16, 2, 4, torch.bfloat16, "clamped_swiglu", 1.0, 3.0, torch.float32, None, 0.0)
    assert (p.swiglu_limit, p.bias_dtype, p.quant, p.swiglu_beta) == (3.0, torch.float32, None, 0.0)
    assert MoEConfig(**{**d.__dict__, "swiglu_alpha": -0.5}).swiglu_alpha == -0.5  # any finite alpha
    assert MoEConfig(**{**d.__dict__, "bias_dtype": torch.float32}) != d


# ---- backends refuse what they cannot run -------------------------------------------------------

def test_reference_accepts_every_activation_and_bias():
    for act in ACTIVATIONS:
        for bd in BIAS_DTYPES:
            cfg = _cfg(act=act, bias_dtype=bd)
            (ref,) = [v for v in explain(cfg, EPGroup.single(), torch.device("cpu")) if v.name == "reference"]
            assert ref.ok, ref.reason


def test_backend_without_biases_is_passed_over(monkeypatch):
    """A backend refuses a config (e.g. bias_dtype set) through its check; "auto" passes it over
    with the reason and naming it raises UnsupportedBackendError."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.reset_warnings()

    def check(config, group, device):
        if config.bias_dtype is not None:
            raise UnsupportedBackendError("nobias: no per-expert biases")

    register(BackendSpec(name="nobias", description="fake", priority=1000, check=check,
                         factory=lambda *a, **k: None))
    cpu, g = torch.device("cpu"), EPGroup.single()
    assert select("auto", _cfg(), g, cpu).name == "nobias"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select("auto", _cfg(bias_dtype=torch.float32), g, cpu).name == "reference"
    said = [str(w.message) for w in caught if issubclass(w.category, BackendWarning)]
    assert any("'nobias': nobias: no per-expert biases" in m for m in said), said
    with pytest.raises(UnsupportedBackendError, match="no per-expert biases"):
        select("nobias", _cfg(bias_dtype=torch.bfloat16), g, cpu)
    registry.reset_warnings()


# ---- the reference backend on CUDA: _grouped_mm where it fits, the loop elsewhere --------------

@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,K,T,act,bias_dtype", [
    (8, 128, 64, 4, 50, "clamped_swiglu", torch.float32),    # fits _grouped_mm
    (8, 128, 64, 4, 50, "squared_relu", torch.bfloat16),
    *ODD,
])
def test_reference_on_cuda(E, H, I, K, T, act, bias_dtype, monkeypatch):
    cfg = _cfg(E=E, H=H, I=I, K=K, T=T, act=act, bias_dtype=bias_dtype)
    x, ids, w, w13, w2, b13, b2 = problem(cfg, T, seed=H + I + 1)
    ref = oracle(cfg, x, ids, w, w13, w2, b13, b2)
    calls = []
    real = torch._grouped_mm

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    dev = torch.device("cuda")
    cu = [t if t is None else t.to(dev) for t in (x, ids, w, w13, w2, b13, b2)]
    with MoELayer(cfg, EPGroup.single(), backend="reference", device=dev) as layer:
        got = layer.forward(*cu[:5], b13=cu[5], b2=cu[6])
    fits = all(n % 8 == 0 for n in (H, I, cfg.w13_rows))
    assert len(calls) == (2 if fits else 0)
    assert rel_err(got.cpu(), ref) < (GROUPED_TOL if fits else TOL)
