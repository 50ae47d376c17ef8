"""forward's one-conjunction check (``validation.ForwardCheck``) accepts exactly what the full checks
accept: every argument mutated in every way the full checks look at, and whenever the fast check
passes an input, the full checks must pass it too (and return the same weights)."""

import itertools

import pytest
import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer
from moe_ep.api import validation as V
from moe_ep.api.quant import FP8Block128Weight, quantize_fp8_block128

E, H, I, K, CAP = 4, 256, 128, 2, 16
CPU = torch.device("cpu")


def _full(cfg, args, device=CPU):
    """The full checks in forward's order; returns the packed weights or raises."""
    x, ids, w, w13, w2, out, b13, b2, s13, s2 = args
    V.check_routing(cfg, x, ids, w, device, check_values=False)
    w13, w2 = V.pack_fp8_block128(cfg, w13, w2, s13, s2)
    V.check_weights(cfg, E, w13, w2, device)
    V.check_biases(cfg, E, b13, b2, device)
    V.check_out(cfg, out, x.shape[0], device)
    return w13, w2


def _valid(kind, T, g):
    quant = "fp8_block128" if kind.startswith("fp8") else None
    bias = torch.float32 if kind == "bias" else None
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=CAP, quant=quant,
                    bias_dtype=bias)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g).bfloat16()
    w2 = torch.randn(E, H, I, generator=g).bfloat16()
    s13 = s2 = b13 = b2 = None
    if quant:
        q13, q2 = quantize_fp8_block128(w13), quantize_fp8_block128(w2)
        if kind == "fp8_raw":
            w13, s13, w2, s2 = q13.values, q13.scale, q2.values, q2.scale
        else:
            w13, w2 = q13, q2
    if bias:
        b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    return cfg, [x, ids, w, w13, w2, out, b13, b2, s13, s2]


def _tensor_mutations(t):
    """What the full checks look at: type, dtype, shape (each dim, rank), contiguity, device."""
    yield None
    yield t.tolist() if t.numel() < 4096 else "not a tensor"
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.float8_e4m3fn):
        if dt != t.dtype:
            yield t.to(dt)
    yield t.unsqueeze(0)
    yield t.reshape(-1)
    for d in range(t.dim()):
        n = t.shape[d]
        yield t.narrow(d, 0, n - 1).contiguous() if n > 1 else torch.cat([t, t], d)
        grown = list(t.shape)
        grown[d] += 1
        yield torch.ones(grown).to(t.dtype)
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        yield t.transpose(-1, -2)  # non-contiguous, transposed shape
        yield t.transpose(-1, -2).contiguous().transpose(-1, -2)  # right shape, not contiguous
    yield t.to("meta")  # another device


def _mutations(args):
    """(argument index, replacement) for every argument: a tensor where None is expected, each
    mutation of a tensor, and of each part of an FP8 container."""
    for i, a in enumerate(args):
        if a is None:
            yield i, torch.ones(3)
            continue
        if isinstance(a, FP8Block128Weight):
            for m in _tensor_mutations(a.values):
                if isinstance(m, torch.Tensor):
                    yield i, FP8Block128Weight(m, a.scale)
            for m in _tensor_mutations(a.scale):
                if isinstance(m, torch.Tensor):
                    yield i, FP8Block128Weight(a.values, m)
            continue
        for m in _tensor_mutations(a):
            yield i, m


@pytest.mark.parametrize("kind", ["bf16", "bias", "fp8", "fp8_raw"])
@pytest.mark.parametrize("T", [0, 5, CAP])
def test_fast_check_accepts_exactly_what_full_checks_accept(kind, T):
    g = torch.Generator().manual_seed(100 * T + len(kind))
    cfg, args = _valid(kind, T, g)
    check = V.ForwardCheck(cfg, E, CPU)
    fast = check.args(*args)
    assert fast is not None, "the fast check refused a valid input"
    full = _full(cfg, args)
    for a, b in zip(fast, full):
        parts = (a.values, a.scale, b.values, b.scale) if isinstance(a, FP8Block128Weight) else (a, a, b, b)
        assert parts[0] is parts[2] and parts[1] is parts[3]
    cases = 0
    for i, m in itertools.chain(_mutations(args), [(8, torch.ones(1)), (9, torch.ones(1)),
                                                  (5, None), (0, args[0][:0]), (0, torch.cat([args[0]] * 4))]):
        bad = list(args)
        bad[i] = m
        if i == 0 and isinstance(m, torch.Tensor) and m.dim() == 2:  # keep ids/weights/out on x's rows
            T2 = m.shape[0]
            g2 = torch.Generator().manual_seed(T2)
            bad[1] = torch.randint(0, E, (T2, K), generator=g2, dtype=torch.int32)
            bad[2] = torch.rand(T2, K, generator=g2)
            bad[5] = torch.empty(T2, H, dtype=torch.bfloat16)
        fast = check.args(*bad)
        try:
            _full(cfg, bad)
            ok = True
        except (TypeError, ValueError):
            ok = False
        what = f"argument {i} = {type(m).__name__} {getattr(m, 'dtype', '')} {tuple(getattr(m, 'shape', ()))}"
        assert fast is None or ok, f"the fast check passed {what}, which the full checks refuse"
        assert fast is not None or not ok, f"the fast check refused {what}, which the full checks pass"
        cases += 1
    assert cases > 60


def test_fast_check_refuses_another_device():
    """A layer on cuda:0 (built here without a GPU) never fast-passes CPU tensors."""
    cfg, args = _valid("bf16", 4, torch.Generator().manual_seed(1))
    check = V.ForwardCheck(cfg, E, torch.device("cuda", 0))
    assert check.args(*args) is None
    assert not check.routing(*args[:3])
    with pytest.raises(ValueError, match="x is on cpu"):
        _full(cfg, args, torch.device("cuda", 0))


def test_forward_fast_path_output_matches_full_checks():
    """The reference layer gives the same output whether forward takes the fast path (the default)
    or the full checks (check_values=True), on fresh random inputs and a poisoned ``out``."""
    cfg, args = _valid("bf16", 7, torch.Generator().manual_seed(2))
    x, ids, w, w13, w2, out = args[:6]
    fast = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
    full = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu", check_values=True)
    a = fast.forward(x, ids, w, w13, w2, out=out)
    b = full.forward(x, ids, w, w13, w2)
    assert a is out and not torch.isnan(a.float()).any()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the fast path still refuses by name (through the full checks)
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        fast.forward(x, ids, w.double(), w13, w2)
    p13 = torch.nn.Parameter(w13.float(), requires_grad=True).bfloat16()  # a grad-tracking view
    with pytest.raises(RuntimeError, match="no backward"):
        fast.forward(x, ids, w, p13, w2)
    with torch.no_grad():
        c = fast.forward(x, ids, w, torch.nn.Parameter(w13), w2)
    torch.testing.assert_close(c, b, rtol=0, atol=0)
