"""Test helpers: random MoE problems and an independent float64 oracle (per token, per expert)."""

from __future__ import annotations

import math

import torch


def require_sm90() -> None:
    """Skip the calling test unless an SM90 GPU is present; fp32 matmuls in full precision (no TF32)."""
    import pytest

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False


def sm90_drop_module(name: str):
    """``sm90_megamoe.<name>`` (skipping the test without CuTeDSL), after the shim put the drop on the
    path and checked its mirrored constants."""
    import importlib

    import pytest

    pytest.importorskip("cutlass")
    from moe_ep.shim import SM90_MEGAMOE_CONSTANTS

    SM90_MEGAMOE_CONSTANTS.check()
    return importlib.import_module(f"sm90_megamoe.{name}")


def record_outputs(modules) -> list:
    """Forward hooks on ``modules`` that append each call's output (a float32 copy) to the returned list,
    in call order (the transformers tests compare each experts module's output, not only the logits)."""
    seen = []
    for m in modules:
        m.register_forward_hook(lambda mod, args, out: seen.append(out.detach().float().clone()))
    return seen


def no_ptxas_result() -> None:
    """A drop's ``ptxas_info`` gave None: skip the calling test when no ptxas is installed; fail when one
    is (it then rejected the PTX at every ISA version the drop's helper tries, which a skip would hide)."""
    import pytest

    assert sm90_drop_module("layout_compile_check")._ptxas() is None, "ptxas is installed but rejected the PTX"
    pytest.skip("no ptxas installed: spill check skipped")


def activation_problem(E, H, I, K, T, seed, device, x_scale, fp8=False) -> tuple:
    """One layer's inputs for an activation test: x [T, H] bf16 times ``x_scale`` (FC1's outputs are
    ~N(0, x_scale^2), so a clamp or cap at a few units bites), ids [T, K] int32, w [T, K] f32 softmax,
    w13 [E, 2I, H] and w2 [E, H, I] bf16 (``fp8``: as ``quantize_fp8_block128`` gives them)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * x_scale).to(torch.bfloat16).to(device)
    ids = torch.randn(T, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(device)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).to(device)
    if fp8:
        from moe_ep.api.quant import quantize_fp8_block128

        w13, w2 = quantize_fp8_block128(w13.float()), quantize_fp8_block128(w2.float())
    return x, ids, w, w13, w2


def gelu_erf_f64(g: torch.Tensor) -> torch.Tensor:
    """GELU from its definition, 0.5 g (1 + erf(g / sqrt(2))), in float64."""
    g = g.double()
    return 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))


def gelu_tanh_f64(g: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation from its formula, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), in
    float64 (not torch's gelu, so the check does not trust the function it checks against)."""
    g = g.double()
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def gated_f64(activation: str, g: torch.Tensor, u: torch.Tensor, c: dict) -> torch.Tensor:
    """A gated activation of float64 gate / up values from its definition (``c``: clamped_swiglu's
    ``swiglu_alpha`` / ``swiglu_limit`` / ``swiglu_beta`` / ``swiglu_limit_after_act``, softcapped_swiglu's
    ``gate_softcap`` / ``up_softcap``; the Blackwell drops' tests)."""
    g, u = g.double(), u.double()
    if activation == "swiglu":
        return g / (1 + torch.exp(-g)) * u
    if activation == "gelu_glu":
        return gelu_erf_f64(g) * u
    if activation == "gelu_tanh_glu":
        return gelu_tanh_f64(g) * u
    if activation == "clamped_swiglu":
        lim = torch.tensor(c["swiglu_limit"], dtype=torch.float64)
        u = torch.minimum(torch.maximum(u, -lim), lim) + c["swiglu_beta"]
        if c["swiglu_limit_after_act"]:
            return u * torch.minimum(g / (1 + torch.exp(-c["swiglu_alpha"] * g)), lim)
        g = torch.minimum(g, lim)
        return u * g / (1 + torch.exp(-c["swiglu_alpha"] * g))
    if activation == "softcapped_swiglu":  # the sigmoid sees the raw gate
        cg, cu = c["gate_softcap"], c["up_softcap"]
        return cg * torch.tanh(g / cg) / (1 + torch.exp(-g)) * cu * torch.tanh(u / cu)
    raise ValueError(activation)


def gated_moe_f64(x, ids, w, w13, w2, act, fp8=False):
    """The layer in float64 with a gated activation ``act(h [M, 2I] float64) -> [M, I]``, one expert at
    a time, router weights in k order. ``fp8``: the quantised model (block-128 e4m3 weights as
    ``quantize_fp8_block128`` gives them, dequantised; x and the activation, rounded to bf16 first as
    the kernels write it, quantised per 128 values of a row)."""
    if fp8:
        from moe_ep.api.quant import dequantize_fp8_block128, dequantize_fp8_rows128, quantize_fp8_rows128

        def rows(t):
            return dequantize_fp8_rows128(*quantize_fp8_rows128(t.float())).double()

        w13, w2, x = dequantize_fp8_block128(w13).double(), dequantize_fp8_block128(w2).double(), rows(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        a = act(x[t].double() @ w13[e].double().t())
        if fp8:
            a = rows(a.to(torch.bfloat16))
        out.index_add_(0, t, (a @ w2[e].double().t()) * w[t, k].double()[:, None])
    return out


def fast_layer_forward(cfg, backend, x, ids, w, w13, w2) -> tuple:
    """One forward of a warmed-up ``backend`` layer (one rank) into a NaN-poisoned output, its GPU
    error flags checked: ``(out [T, H] bf16, whether the decode kernels ran or None)``."""
    from moe_ep.api import EPGroup, MoELayer

    with MoELayer(cfg, EPGroup.single(), backend=backend) as layer:
        layer.warmup(progress=False)
        out = torch.full(tuple(x.shape), float("nan"), dtype=torch.bfloat16, device=x.device)
        layer.forward(x, ids, w, w13, w2, out=out)
        layer.check_errors()
        return out, getattr(layer._impl, "_decode", None)


def make_problem(E, H, I, K, T, *, gated=True, skew=False, seed=0, dtype=torch.bfloat16):
    """Global problem: x [T,H], ids [T,K] int64 (distinct per row), w [T,K] f32, w13 [E,rows,H], w2 [E,H,I].

    skew: expert 0 takes (about) half of all (token, k) slots; experts E//2.. get none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, E // 2:] = -1e9 if E // 2 >= K else logits[:, E // 2:]
        logits[: (T * K) // 2 if K == 1 else T, 0] += 1e4 if K > 1 else 0.0
        if K == 1:
            logits[: T // 2, 0] += 1e4
    vals, ids = logits.topk(K, dim=-1)
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1).float()
    rows = 2 * I if gated else I
    w13 = (torch.randn(E, rows, H, generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(dtype)
    return x, ids, w, w13, w2


def oracle_f64(x, ids, w, w13, w2, activation, intermediate, *, b13=None, b2=None, alpha=1.702, limit=7.0,
               beta=1.0, gate_softcap=4.0, up_softcap=25.0):
    """out[t] = sum_k w[t,k] * (W2_e · act(W13_e · x[t] + b13_e) + b2_e) in float64, one
    token-expert pair at a time (b13 [E, rows], b2 [E, H] optional; alpha/limit/beta: clamped_swiglu;
    gate_softcap/up_softcap: softcapped_swiglu)."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    b13d = None if b13 is None else b13.double()
    b2d = None if b2 is None else b2.double()
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13d[e] @ xd[t]
            if b13d is not None:
                h = h + b13d[e]
            if activation == "swiglu":
                g, u = h[:intermediate], h[intermediate:]
                a = g / (1 + torch.exp(-g)) * u
            elif activation == "gelu_glu":
                g, u = h[:intermediate], h[intermediate:]
                a = gelu_erf_f64(g) * u
            elif activation == "gelu_tanh_glu":  # Gemma 4's "gelu_pytorch_tanh", from its formula
                g, u = h[:intermediate], h[intermediate:]
                a = gelu_tanh_f64(g) * u
            elif activation == "clamped_swiglu":
                g = torch.where(h[:intermediate] > limit, torch.full_like(h[:intermediate], limit), h[:intermediate])
                u = torch.maximum(torch.minimum(h[intermediate:], torch.tensor(limit, dtype=torch.float64)),
                                  torch.tensor(-limit, dtype=torch.float64))
                a = g / (1 + torch.exp(-alpha * g)) * (u + beta)
            elif activation == "softcapped_swiglu":  # Inkling2's: the sigmoid sees the raw gate
                g, u = h[:intermediate], h[intermediate:]
                a = (gate_softcap * torch.tanh(g / gate_softcap) / (1 + torch.exp(-g))
                     * up_softcap * torch.tanh(u / up_softcap))
            elif activation == "squared_relu":
                a = torch.clamp(h, min=0) ** 2
            else:
                raise ValueError(activation)
            y = w2d[e] @ a
            if b2d is not None:
                y = y + b2d[e]
            out[t] += float(w[t, k]) * y
    return out


def swiglu_moe_f64(x, ids, w, w13, w2, I):
    """float64 SwiGLU MoE on x's device, grouped by expert: out[t] = sum_k w[t,k] * W2_e · (silu(G) * U),
    [G; U] = W13_e · x[t] (G the first I rows)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        h = x[t].double() @ w13[e].double().T
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        out.index_add_(0, t, (a @ w2[e].double().T) * w[t, k].double()[:, None])
    return out


def fc1_f64(x, ids, w13, b13=None):
    """Every pair's FC1 output (bias included) in float64: ``[T*K, rows]`` (to see what an
    activation's input looks like, e.g. that a clamp triggers)."""
    hs = []
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            hs.append(h if b13 is None else h + b13[e].double())
    return torch.stack(hs) if hs else torch.zeros(0, w13.shape[1], dtype=torch.float64)


def gpu_bytes_held() -> int:
    """Bytes torch's allocator holds for live tensors, after a GC pass and a device sync (memory tests)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def worst_row_err(a, b) -> float:
    """The largest per-token relative error of ``a`` [T, H] against ``b`` [T, H]: ``|a_t - b_t| /
    |b_t|``, a row far below the median norm measured against a tenth of the median instead. Why:
    :func:`rel_err` of thousands of rows hides a few wrong ones (one token missing one of its 8
    experts moves it by ~0.005 at T = 4096), this does not."""
    assert a.shape == b.shape and a.dim() == 2, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    norms = b.norm(dim=1)
    floor = 0.1 * float(norms.median())
    return float(((a - b).norm(dim=1) / norms.clamp_min(max(floor, 1e-30))).max())


def capture_graph(fn, warmup: bool = False) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph (``warmup``: run it once on a side stream first, as torch
    recommends before a capture)."""
    if warmup:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_poisoned(graph, *outs, layer=None) -> None:
    """NaN-fill ``outs`` (so a row the replay does not write shows) and, given the ``MoELayer`` or
    the ``VirtualEP`` (every rank) the graph runs, its workspace's activation buffers
    (:func:`poison_workspace`: so a row the replay does not write there shows too, instead of the
    last run's value); replay ``graph``, wait for it."""
    for o in outs:
        o.fill_(float("nan"))
    if layer is not None:
        poison_layer(layer)
    graph.replay()
    torch.cuda.synchronize()


#: the workspace's activation buffers (float regions a forward rewrites before it reads them): the
#: received tokens, the grouped rows, FC1's output, their quantised copies and scales, the combine's
#: rows. Not the protocol state, the index buffers or the routing weights (garbage there is a
#: different failure, or would be flagged as bad input).
POISONED_BUFFERS = ("recv_x", "comb", "xs", "h", "xq", "xq_scale", "hq", "hq_scale", "xq_tok", "sx_tok",
                    "xq_send", "sx_send")


def poison_workspace(impl) -> list:
    """NaN-fill ``impl``'s activation buffers in its workspace (:data:`POISONED_BUFFERS`; e4m3 as
    its NaN byte 0x7f), so a forward that reads a row it did not write in this call shows NaN in its
    output instead of the last call's value. Returns the names filled."""
    views = impl.ws.views(impl.dims)
    filled = []
    for name in POISONED_BUFFERS:
        t = views.get(name)
        if t is None:
            continue
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            raise AssertionError(f"poison_workspace: {name} is {t.dtype}, not a float buffer")
        filled.append(name)
    assert {"xs", "h"} <= set(filled), filled
    return filled


def poison_layer(layer) -> None:
    """:func:`poison_workspace` of a ``MoELayer``'s backend, or of every rank of a ``VirtualEP``."""
    for impl in getattr(layer, "ranks", None) or [layer._impl]:
        poison_workspace(impl)


def layer_outputs_with_switch(monkeypatch, switch, cfg, backend, inputs, check_impl, values=("0", "1")) -> list:
    """One-rank layer outputs with environment ``switch`` = ``values[0]`` ("0"), then ``values[1]``
    ("1"): for each, a fresh layer
    (warmed up; ``check_impl(impl, on)`` asserts the switch took), an eager forward into a
    NaN-poisoned ``out``, then (with at least one token) the same forward captured in a CUDA graph
    and replayed into a poisoned ``out`` -- asserted equal to the eager result. Before each run the
    workspace's activation buffers are NaN-poisoned too (:func:`poison_workspace`): otherwise the
    replay would find the eager run's values there, and a row it failed to write would still pass.
    ``inputs``: (x, ids, w, w13, w2)."""
    from moe_ep.api import EPGroup, MoELayer

    x, ids, w, w13, w2 = inputs
    outs = []
    for flag in values:
        monkeypatch.setenv(switch, flag)
        layer = MoELayer(cfg, EPGroup.single(), backend=backend)
        layer.warmup(progress=False)
        check_impl(layer._impl, flag != values[0])
        out = torch.full((x.shape[0], cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        poison_layer(layer)
        outs.append(layer.forward(x, ids, w, w13, w2, out=out).clone())
        # the swap-AB decode GEMMs (few tokens) take none of the 128-row kernels' switches: both runs
        # would be the same kernels and the comparison could not fail
        assert not (x.shape[0] and getattr(layer._impl, "_decode", False)), \
            f"{x.shape[0]} tokens run the decode GEMMs, which {switch} does not reach: test with more tokens"
        if x.shape[0]:
            graph = capture_graph(lambda: layer.forward(x, ids, w, w13, w2, out=out))
            replay_poisoned(graph, out, layer=layer)
            assert torch.equal(out, outs[-1])
        layer.check_errors()
        layer.destroy()
    return outs


def qwen3_gather_layer(T: int, seed: int) -> tuple:
    """``(cfg, (x, ids, w, w13, w2))`` of the gathering-FC1 layer tests: Qwen3's shapes (E 128, H 2048,
    I 768, top-8; capacity 4096 tokens), ``T`` tokens with uniform random ids and weights, BF16
    weights, all drawn on the GPU from ``seed``."""
    from moe_ep.api import MoEConfig

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=4096)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, E, (T, K), device="cuda", generator=g, dtype=torch.int32)
    w = torch.rand(T, K, device="cuda", generator=g)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    return cfg, (x, ids, w, w13, w2)


def fp8_layer_inputs(E, H, I, K, T, seed) -> tuple:
    """Tokens, routing (top-k of random logits) and FP8 block-128 weights of one layer, on the GPU:
    (x [T, H] bf16, ids [T, K] int32, w [T, K] f32 softmax, w13, w2 as ``quantize_fp8_block128`` gives them)."""
    from moe_ep.api.quant import quantize_fp8_block128

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randn(T, E, generator=g).topk(K, -1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    w13 = quantize_fp8_block128((torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).cuda())
    w2 = quantize_fp8_block128((torch.randn(E, H, I, generator=g) * I ** -0.5).cuda())
    return x, ids, w, w13, w2


def fp8_gemm_problem(m_total, n, k, E, routing, seed, scale_rows) -> tuple:
    """Random CPU inputs of one FP8 block-scaled grouped GEMM, quantised by the drop's reference
    (the calling test module has registered the sm90 drop): (a [m_total, k] e4m3, a_s [m_total,
    k/128] f32, b [E, n, k] e4m3, b_s [E, n/128, k/128] f32, offs [E + 1] int32 of ``routing``
    ("uniform" / "skewed"), row scales [m_total] f32 or None)."""
    from sm90_megamoe import fp8_reference as ref

    offs = ref.make_offsets(m_total, E, routing, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    a, a_s = ref.quantize_rows128(torch.randn(m_total, k, generator=g) * 0.5)
    b, b_s = ref.quantize_weight_block128(torch.randn(E, n, k, generator=g) / k ** 0.5)
    rs = torch.rand(m_total, generator=g) if scale_rows else None
    return a, a_s, b, b_s, offs, rs


def bf16_gemm_problem(m_total, n, k, E, routing, seed, scale_rows, bias_dtype=None) -> tuple:
    """Random GPU inputs of one BF16 grouped GEMM (the calling test module has registered the sm90
    drop): (a [m_total, k] bf16, b [E, n, k] bf16, offs [E + 1] int32 of ``routing`` ("uniform" /
    "skewed"), row scales [m_total] f32 or None, bias [E, n] of ``bias_dtype`` or None)."""
    from sm90_megamoe.grouped_gemm_runner import make_offsets

    offs = make_offsets(m_total, E, routing, torch.Generator().manual_seed(seed)).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    a = (torch.randn(m_total, k, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    b = (torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    rs = torch.rand(m_total, device="cuda", generator=g) if scale_rows else None
    bias = None if bias_dtype is None else (torch.randn(E, n, device="cuda", generator=g) * 0.5).to(bias_dtype)
    return a, b, offs, rs, bias


def variants_same_bits(fns, a, b, offs, n_out, row_scale=None, bias=None) -> torch.Tensor:
    """Run each grouped GEMM of ``fns`` (the first the baseline) into a NaN-poisoned output with a
    guard band behind it; assert that no variant stores past its output, leaves an element
    unwritten, or differs from the baseline by one bit. Returns the last variant's output."""
    m_total = a.shape[0]
    size = m_total * n_out
    outs = []
    for fn in fns:
        # stores past n_out land in the next row (the comparison catches them) or, on the last row,
        # in the guard band
        buf = torch.full((size + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs, out=buf[:size].view(m_total, n_out), row_scale=row_scale, bias=bias)
        outs.append(buf)
    torch.cuda.synchronize()
    for buf in outs[1:]:
        assert torch.isnan(buf[size:]).all(), "a store past the output"
        assert not bool(torch.isnan(buf[:size]).any()), "elements left unwritten (NaN poison survived)"
        assert torch.equal(outs[0][:size], buf[:size])
    return outs[-1][:size].view(m_total, n_out)


def pingpong_option_bits(act, n, k, tile_n, scale_rows, routing, m_total, seed, option: dict):
    """A BF16 pingpong GEMM with ``option`` (e.g. ``{"jump_stages": True}``) against the same GEMM
    without it, 16 experts, on :func:`bf16_gemm_problem`'s inputs: the same
    bits (:func:`variants_same_bits`: NaN poison, guard band), then the variant against float64."""
    from sm90_megamoe.launch import get_grouped_gemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E = 16
    a, b, offs, rs, _ = bf16_gemm_problem(m_total, n, k, E, routing, seed, scale_rows)
    fns = [get_grouped_gemm(act, n, k, E, scale_rows=scale_rows, tile_n=tile_n, schedule="pingpong", raster_m=16,
                            **opt) for opt in ({}, option)]
    got = variants_same_bits(fns, a, b, offs, n // 2 if act in ("swiglu", "gelu_glu", "clamped_swiglu") else n,
                             row_scale=rs)
    want = grouped_gemm_reference(a.double(), b.double(), offs, act, None if rs is None else rs.double()).double()
    assert float((got.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


def qwen3_pingpong_switch_outputs(monkeypatch, switch: str, attr: str, T: int, seed: int) -> list:
    """Qwen3's BF16 layer (:func:`qwen3_gather_layer`) with environment ``switch`` off, then on
    (:func:`layer_outputs_with_switch`: eager and CUDA graph), asserting that its pingpong FC2 takes
    the kernel option ``attr`` exactly when on and its cooperative FC1 never; returns both outputs."""
    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    cfg, inputs = qwen3_gather_layer(T, seed=seed)

    def check(impl, on):
        assert impl.fc2.compiled.schedule == "pingpong" and getattr(impl.fc2.compiled, attr) == on
        assert not getattr(impl.fc1.compiled, attr)

    return layer_outputs_with_switch(monkeypatch, switch, cfg, "sm90_bf16_cutedsl", inputs, check)


_KERNELS: dict = {}


def kernel_once(cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` -- a drop's launcher (``CompiledFp8Gemm``, ``Fp8GroupedGemm``,
    ``CompiledGroupedGemm``) -- built once per test process for the same arguments. A launcher keeps
    no state between launches, so tests that differ only in routing or M share one compile (each FP8
    compile takes seconds on the GPU host; group 9 of the suite compiled ~130 kernels, 420 s)."""
    key = (cls.__module__, cls.__qualname__, args, tuple(sorted(kwargs.items())))
    if key not in _KERNELS:
        _KERNELS[key] = cls(*args, **kwargs)
    return _KERNELS[key]


def fp8_variants_same_bits(fns, problem, act=None) -> None:
    """Run FP8 grouped GEMM launchers (``CompiledFp8Gemm``, the first the baseline) on ``problem`` (the
    CPU tuple :func:`fp8_gemm_problem` gives, moved to the GPU), each into its own NaN-poisoned bf16
    output, every variant twice in a row (barrier phases carry over between launches); assert the
    baseline's output finite and every variant's run equal to it bit for bit. ``act`` (the launchers'
    activation): the baseline also within 1e-2 of the drop's dequantised math in float64 (on the GPU),
    so the common bits are right, not only equal."""
    a, a_s, b, b_s, offs, row_scale = (t.cuda() if t is not None else None for t in problem)
    rs = torch.ones(1, device="cuda") if row_scale is None else row_scale  # the launcher always takes one
    m = a.shape[0]
    outs = []
    for g in [fns[0]] + [f for f in fns[1:] for _ in range(2)]:
        out = torch.full((m, g.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        g(a, a_s, b, b_s, offs, out=out, row_scale=rs)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    if act is not None and m:
        from sm90_megamoe import fp8_reference as ref

        want = ref.fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, act, row_scale, dtype=torch.float64)
        err = float((outs[0].double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < 1e-2, err


def gathered_bf16_problem(m_total: int, routing: str, b_seed: int, src_seed: int, idx_seed: int) -> tuple:
    """GPU inputs of the gathering BF16 FC1 tests (Qwen3's FC1 shape, 16 experts; the calling module
    has registered the sm90 drop): (src [700, 2048] bf16 tokens, idx [m_total] int32 rows of src,
    a = src[idx] [m_total, 2048] bf16, b [16, 1536, 2048] bf16, offs [17] int32 of ``routing``)."""
    from sm90_megamoe.grouped_gemm_runner import make_inputs

    E, t_src, n, k = 16, 700, 1536, 2048
    _, b, offs, _, _ = make_inputs(m_total, n, k, E, "swiglu", routing, False, seed=b_seed)
    g = torch.Generator(device="cuda").manual_seed(src_seed)
    src = (torch.randn(t_src, k, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    idx = torch.randint(0, t_src, (m_total,), generator=torch.Generator().manual_seed(idx_seed),
                        dtype=torch.int32).cuda()
    return src, idx, src[idx.long()].contiguous(), b, offs
