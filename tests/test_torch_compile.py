"""MoELayer under torch.compile: forward is one opaque operator (``torch.ops.moe_ep.forward`` /
``forward_out``, moe_ep/api/compiled.py) whose implementation is the eager forward, so a model
that calls a layer compiles with ``fullgraph=True`` and gets the eager bits. CPU tests run the
reference backend (whose host syncs Dynamo could not trace either); the GPU tests run the SM90
kernel backends, also under ``mode="reduce-overhead"`` (CUDA graphs)."""

import gc

import pytest
import torch
from moe_oracle import gated_moe_f64, make_problem, oracle_f64, rel_err

from moe_ep.api import EPGroup, MoEConfig, MoELayer
from moe_ep.api.quant import quantize_fp8_block128

E, H, I, K = 8, 256, 128, 2


def _inputs(T, seed, device="cpu"):
    """``[x, ids (int32), w, w13, w2]``: fresh random tokens, routing and BF16 weights."""
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=seed)
    return [t.to(device) for t in (x, ids.to(torch.int32), w, w13, w2)]


def _setup(T=24, seed=0, quant=None, backend="reference", device="cpu"):
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64, quant=quant)
    return MoELayer(cfg, EPGroup.single(), backend=backend, device=device), _inputs(T, seed, device)


def _graph_ops(fn, *args):
    """(result, the call targets of the one FX graph Dynamo hands its backend) with fullgraph=True."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return out, [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def test_forward_is_one_operator_with_the_eager_bits():
    layer, (x, ids, w, w13, w2) = _setup(seed=1)
    eager = layer.forward(x, ids, w, w13, w2).clone()
    assert rel_err(eager, oracle_f64(x, ids, w, w13, w2, "swiglu", I)) < 1e-2

    def model(x):
        return layer.forward(x, ids, w, w13, w2) * 2

    got, ops = _graph_ops(model, x)
    assert ops.count("moe_ep.forward") == 1 and torch.equal(got, eager * 2)
    torch._dynamo.reset()
    for backend in ("aot_eager", "inductor"):
        assert torch.equal(torch.compile(model, backend=backend, fullgraph=True)(x), eager * 2), backend
    layer.destroy()


def test_forward_into_out_and_fresh_token_counts():
    """``out=``: the mutating operator writes the caller's buffer (poisoned first) and forward
    returns it; with ``dynamic=True`` other token counts (0 included) reuse the graph, each equal
    to the eager result."""
    layer, (x, ids, w, w13, w2) = _setup(T=40, seed=2)

    def model(x, ids, w, out):
        y = layer.forward(x, ids, w, w13, w2, out=out)
        return y, out + 1

    got, ops = _graph_ops(model, x, ids, w, torch.full_like(x, float("nan")))
    assert ops.count("moe_ep.forward_out") == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for T in (40, 7, 0, 33):
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        y, plus = compiled(x[:T], ids[:T], w[:T], out)
        want = layer.forward(x[:T], ids[:T], w[:T], w13, w2)
        assert y.data_ptr() == out.data_ptr() and torch.equal(out, want) and torch.equal(plus, want + 1), T
    layer.destroy()


def test_block_scaled_weights_as_container_or_with_scales():
    """FP8 block-128 weights, as a container or as e4m3 tensors with their scales: the operator
    carries the container's fields and rebuilds it; both give the eager bits."""
    layer, (x, ids, w, w13, w2) = _setup(seed=3, quant="fp8_block128")
    q13, q2 = quantize_fp8_block128(w13), quantize_fp8_block128(w2)
    eager = layer.forward(x, ids, w, q13, q2).clone()
    got, ops = _graph_ops(lambda x: layer.forward(x, ids, w, q13, q2), x)
    assert ops.count("moe_ep.forward") == 1 and torch.equal(got, eager)
    got, _ = _graph_ops(lambda x: layer.forward(x, ids, w, q13.values, q2.values, w13_scale=q13.scale,
                                                w2_scale=q2.scale), x)
    assert torch.equal(got, eager)
    layer.destroy()


def test_bad_input_raises_the_eager_errors():
    """What the eager forward refuses, the compiled one refuses with the same error, naming the
    argument: a wrong dtype (inside the operator), a weight of no known type (the eager forward
    behind a graph break), autograd, a destroyed layer."""
    layer, (x, ids, w, w13, w2) = _setup(seed=4)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match=r"^x must have dtype torch\.bfloat16, got torch\.float32"):
        torch.compile(lambda x: layer.forward(x, ids, w, w13, w2), fullgraph=True)(x.float())
    with pytest.raises(TypeError, match=r"^w13 must be a torch\.Tensor, got list"):
        torch.compile(lambda x: layer.forward(x, ids, w, w13.tolist()[:1], w2))(x)
    p13 = torch.nn.Parameter(w13)
    with pytest.raises(RuntimeError, match="no backward"):
        torch.compile(lambda x: layer.forward(x, ids, w, p13, w2))(x)
    with torch.no_grad():  # parameters under no_grad: fine, the eager bits
        got = torch.compile(lambda x: layer.forward(x, ids, w, p13, w2), fullgraph=True)(x)
    assert torch.equal(got, layer.forward(x, ids, w, w13, w2))
    compiled = torch.compile(lambda x: layer.forward(x, ids, w, w13, w2), fullgraph=True)
    compiled(x)
    layer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        compiled(x)
    layer = compiled = None  # the last references: the layer is collected
    gc.collect()
    from moe_ep.api import compiled as C

    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.moe_ep.forward(10 ** 9, x, ids, w, [w13, w2], "tensor,tensor", None, None, None, None)
    assert all(ref() is not None for ref in C._LAYERS.values())  # a dead layer's key is dropped


def test_split_pair_runs_eagerly_behind_graph_breaks():
    """dispatch / combine return host objects (the handle): under torch.compile they run eagerly
    behind graph breaks, with the eager results."""
    layer, (x, ids, w, w13, w2) = _setup(seed=5)

    def engine(x):
        recv, offs, handle = layer.dispatch(x, ids, w)
        return layer.combine(recv * 0.5, handle)

    torch._dynamo.reset()
    got = torch.compile(engine)(x)
    assert torch.equal(got, engine(x))
    # each token's rows come back weighted: sum_k w[t,k] * 0.5 * x[t]
    want = 0.5 * x.double() * w.double().sum(1, keepdim=True)
    assert rel_err(got, want) < 1e-2
    layer.destroy()


def test_eager_forward_never_touches_the_operator(monkeypatch):
    """Outside torch.compile forward is the plain call: the operator's layer lookup is never reached."""
    from moe_ep.api import compiled as C

    layer, (x, ids, w, w13, w2) = _setup(seed=6)
    monkeypatch.setattr(C, "_layer", lambda key: pytest.fail("eager forward went through the operator"))
    assert torch.isfinite(layer.forward(x, ids, w, w13, w2)).all()
    layer.destroy()


def test_importing_moe_ep_does_not_import_dynamo():
    """The compile support costs nothing at import: torch._dynamo (~0.9 s) loads only when torch.compile
    is used."""
    import subprocess
    import sys

    code = ("import sys, moe_ep.api, moe_ep.backends, moe_ep.integrations.transformers; "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_host_bench_runs_the_operator():
    """`python -m moe_ep.bench.compile_host`: its operator path really goes through the operator
    (eager forward + dispatch, so never cheaper than the eager forward it wraps)."""
    from moe_ep.bench import compile_host

    us = compile_host.measure(iters=3000)
    assert set(us) == {"eager", "operator", "compiled"} and all(0 < v < 1e4 for v in us.values())
    assert us["operator"] > us["eager"]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8_block128"])
def test_sm90_layer_compiles_fullgraph_and_under_cuda_graphs(quant):
    """The SM90 kernel backends (BF16, FP8) under torch.compile: fullgraph with inductor, and
    mode="reduce-overhead" (CUDA graphs replayed by torch), each call with fresh inputs equal to
    the eager forward's bits, which match float64."""
    from moe_oracle import require_sm90

    require_sm90()
    backend = "sm90_fp8_cutedsl" if quant else "sm90_bf16_cutedsl"
    layer, (x, ids, w, w13, w2) = _setup(T=48, seed=7, quant=quant, backend=backend, device="cuda")
    layer.warmup(progress=False)
    wq13, wq2 = (quantize_fp8_block128(w13), quantize_fp8_block128(w2)) if quant else (w13, w2)

    def model(x, ids, w):
        return layer.forward(x, ids, w, wq13, wq2) + x

    torch._dynamo.reset()
    for mode in (None, "reduce-overhead"):
        compiled = torch.compile(model, fullgraph=True, mode=mode)
        for seed in (8, 9, 10, 11):  # reduce-overhead records on its second call, replays after
            x, ids, w, _, _ = _inputs(48, seed, "cuda")
            y = layer.forward(x, ids, w, wq13, wq2).clone()
            got = compiled(x, ids, w).clone()
            assert torch.equal(got, y + x), (mode, seed)
        if not quant:  # (the oracle on the host)
            assert rel_err(y.cpu(), oracle_f64(*(t.cpu() for t in (x, ids, w, w13, w2)), "swiglu", I)) < 1e-2
        else:  # the quantised model (dequantised weights, rows quantised per 128 values) in float64
            want = gated_moe_f64(x, ids, w, wq13, wq2, lambda h: h[:, :I] * torch.sigmoid(h[:, :I]) * h[:, I:],
                                 fp8=True)
            assert rel_err(y, want) < 1e-2
    layer.check_errors()
    layer.destroy()
