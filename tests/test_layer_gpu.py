"""GPU (H200): the default MoELayer on sm90_bf16_cutedsl -- results against the reference backend,
and the hot-path properties: no host sync, no allocation, bit-determinism, CUDA graphs, bad
values dropped and reported, stale handles refused, memory freed, one workspace for many layers.

Run on the GPU machine: ``pytest -m gpu tests/test_layer_gpu.py``.
"""

import zlib

import pytest
import torch
from moe_oracle import (capture_graph, gpu_bytes_held, layer_outputs_with_switch, replay_poisoned, swiglu_moe_f64,
                        worst_row_err)

pytestmark = pytest.mark.gpu

QWEN = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def problem(T, seed, E=128, H=2048, I=768, K=8, skew=False, ids_dtype=torch.int32, weights=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, :4] += 3.0
    ids = logits.topk(K, dim=-1).indices.to(ids_dtype).cuda()
    w = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    if not weights:
        return x, ids, w
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).cuda()
    return x, ids, w, w13, w2


def layers(cfg, *names):
    from moe_ep.api import EPGroup, MoELayer

    return [MoELayer(cfg, EPGroup.single(), backend=n) for n in names]


@pytest.mark.parametrize("routing,T,ids_dtype", [
    ("uniform", 1, torch.int32), ("skewed", 1, torch.int64), ("uniform", 333, torch.int64),
    ("skewed", 333, torch.int32), ("uniform", 4096, torch.int32), ("skewed", 4096, torch.int64),
])
def test_layer_matches_reference(routing, T, ids_dtype):
    _sm90()
    from moe_ep.api import MoEConfig
    from moe_ep.backends.reference import expert_mlp

    cfg = MoEConfig(max_tokens_per_rank=4096, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of(routing, T), skew=routing == "skewed", ids_dtype=ids_dtype)
    fast, ref = layers(cfg, "auto", "reference")
    assert fast.backend_name == "sm90_bf16_cutedsl"
    fast.warmup(progress=False)
    out = torch.full((T, cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fast.forward(x, ids, w, w13, w2, out=out)
    want = ref.forward(x, ids, w, w13, w2)
    fast.check_errors()
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert rel(got, want) < 1e-2 and worst_row_err(got, want) < 3e-2  # every token, not only the mean
    # the split pair: fixed-capacity recv_x, valid rows below offsets[-1]
    recv, offs, h = fast.dispatch(x, ids, w)
    assert recv.shape[0] == cfg.max_tokens_per_rank * cfg.top_k == h.num_recv_rows
    R = int(offs[-1])
    assert R == T * cfg.top_k
    y = torch.full_like(recv, float("nan"))  # padding rows must never be read
    y[:R] = expert_mlp(recv[:R], offs, w13, w2, "swiglu", cfg.intermediate)
    combined = fast.combine(y, h)
    assert rel(combined, want) < 1e-2 and worst_row_err(combined, want) < 3e-2
    fast.destroy(), ref.destroy()


def test_bad_values_dropped_and_reported():
    """Out-of-range ids (int32 and int64, incl. values that would wrap) and NaN/inf weights are
    dropped, never computed by another expert; check_errors names the first one, once."""
    _sm90()
    from moe_ep.api import MoEConfig, RoutingValueError

    cfg = MoEConfig(max_tokens_per_rank=512, **QWEN)
    fast, ref = layers(cfg, "sm90_bf16_cutedsl", "reference")
    fast.warmup(progress=False)
    x, ids, w, w13, w2 = problem(300, 7)
    for dtype, bad_vals in ((torch.int32, (128, 1000, -3, 2**31 - 1)), (torch.int64, (128, 2**40 + 5, -1, 2**32 + 3))):
        bad = ids.to(dtype).clone()
        for j, v in enumerate(bad_vals):
            bad[10 + 37 * j, j % 8] = v
        got = fast.forward(x, bad, w, w13, w2)
        want = ref.forward(x, bad, w, w13, w2)
        assert torch.isfinite(got).all()
        assert rel(got, want) < 1e-2
        # the dropped choices really contribute nothing: same as weight 0 on a valid expert
        clean, w0 = ids.to(dtype).clone(), w.clone()
        for j in range(len(bad_vals)):
            w0[10 + 37 * j, j % 8] = 0.0
        assert rel(got, ref.forward(x, clean, w0, w13, w2)) < 1e-2
        with pytest.raises(RoutingValueError, match=r"topk_ids\[10, 0\] = 128 is outside \[0, 128\)") as ei:
            fast.check_errors()
        assert (ei.value.argument, ei.value.token, ei.value.k, ei.value.value) == ("topk_ids", 10, 0, 128)
        assert isinstance(ei.value, ValueError)
        fast.check_errors()  # reported once
    for v in (float("nan"), float("inf")):
        bw = w.clone()
        bw[5, 3] = v
        bw[200, 1] = -v
        got = fast.forward(x, ids, bw, w13, w2)
        assert torch.isfinite(got).all()
        w0 = w.clone()
        w0[5, 3] = w0[200, 1] = 0.0
        assert rel(got, ref.forward(x, ids, w0, w13, w2)) < 1e-2
        with pytest.raises(RoutingValueError, match=r"topk_weights\[5, 3\] = (nan|inf) is not finite"):
            fast.check_errors()
    fast.destroy(), ref.destroy()


def test_forward_no_host_sync_no_allocation():
    """Ten default forwards (and dispatch/combine pairs) under torch's sync debug mode "error",
    and the caching allocator's allocation count does not move."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=2048, **QWEN)
    (layer,) = layers(cfg, "sm90_bf16_cutedsl")
    layer.warmup(progress=False)
    x, ids, w, w13, w2 = problem(2048, 3)
    out = torch.empty_like(x)
    out2 = torch.empty_like(x)
    layer.forward(x, ids, w, w13, w2, out=out)
    recv, offs, h = layer.dispatch(x, ids, w)
    layer.combine(recv, h, out=out2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            layer.forward(x, ids, w, w13, w2, out=out)
        for _ in range(3):
            recv, offs, h = layer.dispatch(x, ids, w)
            layer.combine(recv, h, out=out2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    layer.check_errors()
    layer.destroy()


def test_bit_identical_repeats_and_cuda_graph():
    """30 repeats are bit-identical; warmup -> capture -> replay equals eager bit for bit; new
    inputs copied into the captured buffers give the new result."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=1024, **QWEN)
    (layer,) = layers(cfg, "sm90_bf16_cutedsl")
    layer.warmup(progress=False)
    x, ids, w, w13, w2 = problem(1024, 1, skew=True)
    eager = layer.forward(x, ids, w, w13, w2).clone()
    repeat = torch.empty_like(x)
    for _ in range(30):
        repeat.fill_(float("nan"))  # each repeat writes every element again
        assert torch.equal(layer.forward(x, ids, w, w13, w2, out=repeat), eager)
    out = torch.empty_like(x)
    g = capture_graph(lambda: layer.forward(x, ids, w, w13, w2, out=out), warmup=True)
    for _ in range(3):
        replay_poisoned(g, out, layer=layer)
        assert torch.equal(out, eager)
    x2, ids2, w_2 = problem(1024, 2, weights=False)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w_2)
    g.replay()
    want = layer.forward(x2, ids2, w_2, w13, w2)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and not torch.equal(want, eager)
    del g
    layer.destroy()


def test_stale_handles_raise():
    _sm90()
    from moe_ep.api import MoEConfig, StaleHandleError

    cfg = MoEConfig(max_tokens_per_rank=256, **QWEN)
    a, b = layers(cfg, "sm90_bf16_cutedsl", "sm90_bf16_cutedsl")
    a.warmup(progress=False), b.warmup(progress=False)
    x, ids, w, w13, w2 = problem(200, 4)
    recv1, _, h1 = a.dispatch(x, ids, w)
    recv2, _, h2 = a.dispatch(x, ids, w)
    with pytest.raises(StaleHandleError, match="stale"):
        a.combine(recv1, h1)
    a.combine(recv2, h2)
    _, _, h3 = a.dispatch(x, ids, w)
    b.forward(x, ids, w, w13, w2)  # another layer on the same workspace overwrites a's buffers
    with pytest.raises(StaleHandleError, match="workspace"):
        a.combine(recv2, h3)
    a.destroy(), b.destroy()


def test_destroy_frees_memory():
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=8192, **QWEN)
    x, ids, w, w13, w2 = problem(4096, 5)
    (warm,) = layers(cfg, "sm90_bf16_cutedsl")  # compile caches filled once
    warm.warmup(progress=False)
    warm.forward(x, ids, w, w13, w2)
    warm.destroy()
    del warm
    base = gpu_bytes_held()
    (layer,) = layers(cfg, "sm90_bf16_cutedsl")
    layer.warmup(progress=False)
    layer.forward(x, ids, w, w13, w2)
    held = gpu_bytes_held() - base
    assert held >= layer.workspace_bytes(cfg, 1)
    layer.destroy()
    del layer
    assert gpu_bytes_held() == base


def test_one_workspace_for_48_layers():
    """48 Qwen3 layers (8192 tokens) take about one layer's memory; interleaved forwards of
    different layers (different weights, one with a smaller shape, one that grows the
    workspace after the others were warmed up) match the reference."""
    _sm90()
    from moe_ep.api import EPGroup, MoEConfig, MoELayer

    cfg = MoEConfig(max_tokens_per_rank=8192, **QWEN)
    small = MoEConfig(max_tokens_per_rank=512, **QWEN)
    (ref,) = layers(cfg, "reference")
    ref.forward(*problem(64, seed_of("ws", 9)))  # cuBLAS's workspaces come with the first matmul: before base
    base = gpu_bytes_held()
    first = [MoELayer(small, EPGroup.single(), backend="sm90_bf16_cutedsl")]
    first[0].warmup(progress=False)
    one_small = gpu_bytes_held() - base
    ls = first + [MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl") for _ in range(48)]
    for layer in ls[1:]:
        layer.warmup(progress=False)  # the first of them grows the workspace: ls[0] is re-bound
    held = gpu_bytes_held() - base
    need = MoELayer.workspace_bytes(cfg, 1)
    assert one_small < need
    assert held <= need + 49 * (1 << 20), f"49 layers hold {held / 2**30:.2f} GiB; one needs {need / 2**30:.2f}"
    problems = [problem(T, seed_of("ws", i)) for i, T in enumerate((4096, 300, 8192, 512))]
    order = [(1, 0), (17, 1), (0, 3), (48, 2), (1, 1), (0, 3), (30, 0)]
    for li, pi in order:
        x, ids, w, w13, w2 = problems[pi]
        got = ls[li].forward(x, ids, w, w13, w2, out=torch.full_like(x, float("nan")))
        assert rel(got, ref.forward(x, ids, w, w13, w2)) < 1e-2, f"layer {li} problem {pi}"
    for layer in ls:
        layer.check_errors()
        layer.destroy()
    ref.destroy()
    del problems, x, ids, w, w13, w2, got, ls, first, layer
    assert gpu_bytes_held() - base < (1 << 20)


def _oracle_f64_gpu(x, ids, w, w13, w2, cfg, b13=None, b2=None):
    """float64 on the GPU, one expert at a time over its (token, k) pairs, summed per token."""
    T, H = x.shape
    I, lim, alpha, beta = cfg.intermediate, cfg.swiglu_limit, cfg.swiglu_alpha, cfg.swiglu_beta
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in torch.unique(ids).tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        h = xd[t] @ w13[e].double().t()
        if b13 is not None:
            h = h + b13[e].double()
        if cfg.activation == "squared_relu":
            a = h.clamp(min=0) ** 2
        else:
            g, u = h[:, :I], h[:, I:]
            if cfg.activation == "swiglu":
                a = g * torch.sigmoid(g) * u
            elif cfg.activation == "gelu_glu":
                a = 0.5 * g * (1 + torch.erf(g * 2 ** -0.5)) * u
            else:
                g = g.clamp(max=lim)
                a = (u.clamp(-lim, lim) + beta) * g * torch.sigmoid(alpha * g)
        y = a @ w2[e].double().t()
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, t, y * w[t, k].double()[:, None])
    return out


@pytest.mark.parametrize("shape,activation,bias_dtype", [
    ("gpt_oss", "clamped_swiglu", torch.bfloat16), ("gpt_oss", "clamped_swiglu", None),
    ("gpt_oss", "gelu_glu", torch.float32), ("qwen3", "swiglu", torch.float32),
    ("qwen3", "squared_relu", torch.bfloat16),
])
def test_activations_biases_on_the_fast_backend(shape, activation, bias_dtype):
    """gpt-oss widths (H = I = 2880, ragged against the 128 tile) and Qwen3 widths: every
    activation, with and without per-expert biases, on sm90_bf16_cutedsl (chosen by "auto")
    against float64; skewed routing."""
    _sm90()
    from moe_ep.api import EPGroup, MoEConfig, MoELayer

    E, H, I, K = (16, 2880, 2880, 4) if shape == "gpt_oss" else (128, 2048, 768, 8)
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=512,
                    activation=activation, bias_dtype=bias_dtype)
    T = 300
    g = torch.Generator().manual_seed(seed_of(shape, activation, bias_dtype))
    amp = 4.0 if activation == "clamped_swiglu" else 1.0
    x = (torch.randn(T, H, generator=g) * amp).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=g)
    logits[:, :2] += 2.0
    ids = logits.topk(K, dim=-1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    w13 = (torch.randn(E, cfg.w13_rows, H, generator=g) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).cuda()
    b13 = b2 = None
    if bias_dtype is not None:
        b13 = (torch.randn(E, cfg.w13_rows, generator=g) * amp).to(bias_dtype).cuda()
        b2 = torch.randn(E, H, generator=g).to(bias_dtype).cuda()
    with MoELayer(cfg, EPGroup.single(), backend="auto") as layer:
        assert layer.backend_name == "sm90_bf16_cutedsl"
        layer.warmup(progress=False)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.forward(x, ids, w, w13, w2, out=out, b13=b13, b2=b2)
        layer.check_errors()
    want = _oracle_f64_gpu(x, ids, w, w13, w2, cfg, b13, b2)
    assert torch.isfinite(out).all()
    assert rel(out, want) < 1e-2, rel(out, want)
    if bias_dtype is not None:  # the biases matter at this size: leaving them out is far off
        assert rel(_oracle_f64_gpu(x, ids, w, w13, w2, cfg), want) > 0.05


def test_odd_hidden_refused_up_front_and_reference_computes_it():
    """hidden 511 (vLLM's MoE tests): the fast backend refuses it by name before any launch, and
    "auto" runs it on the reference backend, which computes it (no _grouped_mm stride error)."""
    _sm90()
    from moe_ep.api import EPGroup, MoEConfig, MoELayer, UnsupportedBackendError

    cfg = MoEConfig(num_experts=8, hidden=511, intermediate=256, top_k=2, max_tokens_per_rank=64)
    with pytest.raises(UnsupportedBackendError, match="511"):
        MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl")
    g = torch.Generator().manual_seed(511)
    x = torch.randn(64, 511, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randn(64, 8, generator=g).topk(2, -1).indices.to(torch.int32).cuda()
    w = torch.rand(64, 2, generator=g).cuda()
    w13 = (torch.randn(8, 512, 511, generator=g) * 511 ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(8, 511, 256, generator=g) * 256 ** -0.5).to(torch.bfloat16).cuda()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = MoELayer(cfg, EPGroup.single(), backend="auto")
    assert layer.backend_name == "reference"
    got = layer.forward(x, ids, w, w13, w2)
    assert rel(got, _oracle_f64_gpu(x, ids, w, w13, w2, cfg)) < 1e-2
    layer.destroy()


@pytest.mark.parametrize("quant", ["fp8_block128", "mxfp8", "nvfp4_w4a16"])
def test_quantised_configs_refused_by_the_bf16_backend(quant):
    """The SM90 BF16 backend refuses block-scaled weights by name; "auto" runs them on the backend
    of their format that runs here (FP8 block-128: sm90_fp8_cutedsl; the Blackwell formats: the
    reference backend) and matches a float32 computation of the dequantised model."""
    _sm90()
    import warnings

    from moe_ep.api import EPGroup, MoEConfig, MoELayer, UnsupportedBackendError
    from moe_ep.api.quant import (dequantize_fp8_block128, dequantize_mxfp8, dequantize_nvfp4,
                                  quantize_fp8_block128, quantize_mxfp8, quantize_nvfp4)

    cfg = MoEConfig(num_experts=8, hidden=256, intermediate=128, top_k=2, max_tokens_per_rank=64, quant=quant)
    with pytest.raises(UnsupportedBackendError, match=quant):
        MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = MoELayer(cfg, EPGroup.single(), backend="auto")
    assert layer.backend_name == ("sm90_fp8_cutedsl" if quant == "fp8_block128" else "reference")
    q, dq = {"fp8_block128": (quantize_fp8_block128, dequantize_fp8_block128),
             "mxfp8": (quantize_mxfp8, dequantize_mxfp8), "nvfp4_w4a16": (quantize_nvfp4, dequantize_nvfp4)}[quant]
    x, ids, w, w13, w2 = problem(64, seed_of("quant", quant), E=8, H=256, I=128, K=2)
    out = layer.forward(x, ids, w, q(w13), q(w2))
    plain = MoELayer(MoEConfig(num_experts=8, hidden=256, intermediate=128, top_k=2, max_tokens_per_rank=64),
                     EPGroup.single(), backend="reference")
    want = plain.forward(x, ids, w, dq(q(w13)).to(torch.bfloat16), dq(q(w2)).to(torch.bfloat16))
    assert torch.isfinite(out).all() and rel(out, want) < 0.05  # activation quantisation on top
    layer.destroy(), plain.destroy()


@pytest.mark.parametrize("model", ["qwen3", "mixtral"])
def test_decode_layer_against_float64(model):
    """Decode-sized layers (max_tokens_per_rank 256) run the swap-AB GEMMs (Mixtral's 256-token
    calls the 128-row ones); T = 0 ... 256 tokens, uniform and all-to-one-expert routing, against
    float64, outputs poisoned with NaN first."""
    _sm90()
    from moe_ep.api import MoEConfig

    dims = QWEN if model == "qwen3" else dict(num_experts=8, hidden=4096, intermediate=14336, top_k=2)
    E, H, I, K = dims["num_experts"], dims["hidden"], dims["intermediate"], dims["top_k"]
    cfg = MoEConfig(max_tokens_per_rank=256, **dims)
    (fast,) = layers(cfg, "auto")
    fast.warmup(progress=False)
    impl = fast._impl  # Qwen3 at 256 tokens: decode kernels only; Mixtral: both paths (T <= 128 decode)
    decode = (impl.fc1_decode or impl.fc1, impl.fc2_decode or impl.fc2)
    assert [g.compiled.schedule for g in decode] == ["swapab", "swapab"]
    assert (impl.fc1_decode is None) == (model == "qwen3")
    g = torch.Generator().manual_seed(seed_of("decode", model))
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).cuda()
    for T in (0, 1, 7, 64, 256):
        for one_expert in (False, True):
            x, ids, w = problem(T, seed_of(model, T, one_expert), E=E, H=H, I=I, K=K, weights=False)
            if one_expert and T:
                hot = int(ids[0, 0])  # every token picks expert `hot` first (others keep their choices)
                ids = torch.where(ids == hot, ids[:, :1], ids)
                ids[:, 0] = hot
            out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            got = fast.forward(x, ids, w, w13, w2, out=out)
            fast.check_errors()
            assert got.shape == (T, H)
            if T == 0:
                continue
            assert torch.isfinite(got).all(), (model, T, one_expert)
            assert rel(got, swiglu_moe_f64(x, ids, w, w13, w2, I)) < 1e-2, (model, T, one_expert)
    fast.destroy()


@pytest.mark.parametrize("T", [0, 1, 700])
def test_local_combine_is_bit_identical(monkeypatch, T):
    """The one-launch combine (one rank, the default; drop v14's CombineLocal) gives the
    bits of combine_send + combine_reduce, eager and under a CUDA graph; rows of tokens whose
    every choice is dropped (bad expert ids) are zero in both."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=1024, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("local_combine", T))
    if T > 1:
        ids[3] = 10_000  # every choice of token 3 invalid: a zero row
    monkeypatch.setenv("MOE_EP_LOCAL_COMBINE", "0")
    (plain,) = layers(cfg, "sm90_bf16_cutedsl")
    want = plain.forward(x, ids, w, w13, w2).clone()
    try:
        plain.check_errors()
    except Exception:  # noqa: BLE001 - the bad ids above are reported, as they should be
        pass
    plain.destroy()
    monkeypatch.setenv("MOE_EP_LOCAL_COMBINE", "1")
    (local,) = layers(cfg, "sm90_bf16_cutedsl")
    local.warmup(progress=False)
    assert local._impl.local_combine
    out = torch.full((T, QWEN["hidden"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(local.forward(x, ids, w, w13, w2, out=out), want)
    if T > 1:
        assert bool((want[3] == 0).all())
        graph = capture_graph(lambda: local.forward(x, ids, w, w13, w2, out=out))
        replay_poisoned(graph, out, layer=local)
        assert torch.equal(out, want)
    local.destroy()


@pytest.mark.parametrize("T", [1, 40, 300])
def test_layout_chunks_do_not_change_the_bits(monkeypatch, T):
    """The token-adaptive layout grid (default: 4 chunks at 1 token, 16 at 40, one per SM at 300)
    gives the bits of a fixed grid of 3 chunks and of the fixed full grid (MOE_EP_LAYOUT_CHUNKS)."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=512, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("layout_chunks", T))
    outs = []
    for chunks in ("", "3", "4096"):
        monkeypatch.setenv("MOE_EP_LAYOUT_CHUNKS", chunks)
        (layer,) = layers(cfg, "sm90_bf16_cutedsl")
        out = torch.full((T, QWEN["hidden"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs.append(layer.forward(x, ids, w, w13, w2, out=out).clone())
        layer.check_errors()
        layer.destroy()
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("T", [0, 1, 37, 700])
def test_token_grid_gives_the_full_grid_bits(T, monkeypatch):
    """Dispatch and the combine on a grid sized from the call's tokens (MOE_EP_TOKEN_GRID=1) give
    the bits of the full grid, with bad choices recorded the same way. One rank's defaults (LocalRoute,
    the one-launch combine) have neither kernel, so the test turns them off."""
    _sm90()
    from moe_ep.api import MoEConfig

    monkeypatch.setenv("MOE_EP_LOCAL_ROUTE", "0")
    monkeypatch.setenv("MOE_EP_LOCAL_COMBINE", "0")
    cfg = MoEConfig(max_tokens_per_rank=1024, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("token_grid", T))
    if T > 2:
        ids[2, 1] = -5  # one dropped choice: the first-bad-value record must not depend on the grid
    (layer,) = layers(cfg, "sm90_bf16_cutedsl")
    outs, errs = [], []
    for token_grid in (False, True):
        layer._impl.token_grid = token_grid
        out = torch.full((T, QWEN["hidden"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs.append(layer.forward(x, ids, w, w13, w2, out=out).clone())
        try:
            layer.check_errors()
            errs.append(None)
        except Exception as e:  # noqa: BLE001 - the bad id above is reported, as it should be
            errs.append(str(e).split(" at forward")[0])
    assert torch.equal(outs[0], outs[1]) and errs[0] == errs[1], errs
    assert (errs[1] is not None) == (T > 2)
    assert not layer._impl.local_route and not layer._impl.local_combine  # (bound now) the grid was read
    layer.destroy()


def _forward_and_errors(layer, x, ids, w, w13, w2, T):
    """One forward into a NaN-poisoned ``out``; returns (out, the check_errors message or None)."""
    out = torch.full((T, QWEN["hidden"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = layer.forward(x, ids, w, w13, w2, out=out).clone()
    try:
        layer.check_errors()
        return out, None
    except Exception as e:  # noqa: BLE001 - bad values planted on purpose are reported
        return out, f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("T,ids_dtype,bad", [(0, torch.int32, False), (1, torch.int64, False),
                                             (37, torch.int32, True), (700, torch.int64, True)])
def test_local_route_is_bit_identical(monkeypatch, T, ids_dtype, bad):
    """One rank without a dispatch (MOE_EP_LOCAL_ROUTE=1, drop v19's LocalRoute): the bits of
    dispatch + layout, eager, repeated and under a CUDA graph; out-of-range ids and a NaN weight
    are dropped and reported with the same message; the split dispatch/combine pair agrees too."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=1024, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("local_route", T), ids_dtype=ids_dtype)
    if bad:
        ids[2, 1], ids[5, 0], ids[T - 1, 7] = 128, -1, 10_000
        w[4, 3] = float("nan")
    results = {}
    for route in ("0", "1"):
        monkeypatch.setenv("MOE_EP_LOCAL_ROUTE", route)
        (layer,) = layers(cfg, "sm90_bf16_cutedsl")
        layer.warmup(progress=False)
        assert layer._impl.local_route == (route == "1")
        first = _forward_and_errors(layer, x, ids, w, w13, w2, T)
        again = _forward_and_errors(layer, x, ids, w, w13, w2, T)
        assert torch.equal(first[0], again[0]) and again[1] == first[1]  # read-and-reset: recorded anew
        if T:
            out = torch.empty_like(first[0])
            graph = capture_graph(lambda: layer.forward(x, ids, w, w13, w2, out=out))
            replay_poisoned(graph, out, layer=layer)
            assert torch.equal(out, first[0])
            xs, offsets, handle = layer.dispatch(x, ids, w)  # the split pair, router weights in combine
            y = torch.zeros(xs.shape[0], QWEN["hidden"], dtype=torch.bfloat16, device="cuda")
            y[: int(offsets[-1])] = xs[: int(offsets[-1])]  # identity experts: combine sums the x rows
            split = layer.combine(y, handle).clone()
        else:
            split = None
        layer.destroy()
        results[route] = (first, split)
    (out0, msg0), split0 = results["0"]
    (out1, msg1), split1 = results["1"]
    assert torch.equal(out0, out1) and torch.isfinite(out1).all()
    assert msg0 == msg1 and (msg1 is not None) == bad
    if T:
        assert torch.equal(split0, split1)


@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_wide_gated_fc1_is_bit_identical(monkeypatch, T):
    """Drop v22's ``wide`` FC1 (MOE_EP_WIDE_GATED=1: one m64n256 WGMMA over the gate and up tiles)
    gives the bits of the two-WGMMA ``cooperative`` FC1 (the default), eager and under a CUDA
    graph (passed on the H200 at e82f1e5)."""
    _sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=4096, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("wide_gated", T))

    def check(impl, on):
        assert impl.fc1.compiled.schedule == ("wide" if on else "cooperative")

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_WIDE_GATED", cfg, "sm90_bf16_cutedsl",
                                     (x, ids, w, w13, w2), check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
