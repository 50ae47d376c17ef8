"""GPU (H200): the SM90 grouped GEMMs and the EP=1 layer against float32 references.

Run on the GPU machine: ``pytest -m gpu tests/test_sm90_gpu.py``.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = {  # H, I, E
    "qwen3": (2048, 768, 128),
    "mixtral": (4096, 14336, 8),
    "dsv3_shard": (7168, 2048, 32),
}


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def histogram(M, E, routing, gen):
    """Expert offsets [E+1] int32 for M rows: uniform (multinomial over all experts) or skewed
    (expert 0 takes half of the rows; every third expert gets none; the rest multinomial)."""
    p = torch.ones(E)
    fixed = torch.zeros(E, dtype=torch.long)
    if routing == "skewed":
        p[0::3] = 0.0
        fixed[0] = M // 2
    rest = M - int(fixed.sum())
    draws = torch.multinomial(p, rest, replacement=True, generator=gen) if rest else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(draws, minlength=E) + fixed
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(counts, 0)
    return offs


def ref_gemm(a, b, offs, activation, row_scale=None):
    """float32 per-expert reference: act(A_e · B_eᵀ) (· row_scale)."""
    out = []
    o = offs.tolist()
    for e in range(b.shape[0]):
        h = a[o[e]:o[e + 1]].float() @ b[e].float().t()
        if activation == "swiglu":
            i = h.shape[1] // 2
            h = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        elif activation == "squared_relu":
            h = torch.relu(h).square()
        out.append(h)
    r = torch.cat(out) if out else torch.zeros(0, 1)
    if row_scale is not None:
        r = r * row_scale[:, None]
    return r


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_case(act, n, k, E, M, routing, gen, scale=False):
    from moe_ep.shim import sm90_grouped_gemm

    fn = sm90_grouped_gemm(act, n, k, E, scale_rows=scale)
    dev = "cuda"
    a = (torch.randn(M, k, generator=gen) ).to(torch.bfloat16).to(dev)
    b = (torch.randn(E, n, k, generator=gen) * k ** -0.5).to(torch.bfloat16).to(dev)
    offs = histogram(M, E, routing, gen)
    rs = torch.rand(M, generator=gen).to(dev) if scale else None
    n_out = n // 2 if act == "swiglu" else n
    out = torch.full((M, n_out), float("nan"), dtype=torch.bfloat16, device=dev)  # poison
    fn(a, b, offs.to(dev), out=out, row_scale=rs)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output rows"
    ref = ref_gemm(a, b, offs, act, rs)
    e = rel(out, ref)
    assert e < 1e-2, f"{act} n={n} k={k} E={E} M={M} {routing}: rel err {e:.3e}"
    return e


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_fc1_fc2_models(model, routing):
    _sm90()
    H, I, E = SHAPES[model]
    gen = torch.Generator().manual_seed(hash((model, routing)) % 2**31)
    M = 16384 if model == "qwen3" else 4096
    run_case("swiglu", 2 * I, H, E, M, routing, gen)
    run_case("identity", H, I, E, M, routing, gen, scale=True)
    if model == "qwen3":
        run_case("squared_relu", I, H, E, M, routing, gen)
        run_case("identity", H, I, E, M, routing, gen, scale=False)


def test_m_total_sweep_one_kernel():
    """1 row to 2·65536 rows, three different histograms, one compiled kernel per GEMM."""
    _sm90()
    from moe_ep.shim import COMPILE_CACHE

    H, I, E = SHAPES["qwen3"]
    gen = torch.Generator().manual_seed(7)
    run_case("swiglu", 2 * I, H, E, 64, "uniform", gen)
    run_case("identity", H, I, E, 64, "uniform", gen, scale=True)
    misses = COMPILE_CACHE.misses
    for M in (1, 7, 129, 1000, 65536, 131072):
        for routing in ("uniform", "skewed"):
            run_case("swiglu", 2 * I, H, E, M, routing, gen)
            run_case("identity", H, I, E, M, routing, gen, scale=True)
    assert COMPILE_CACHE.misses == misses, "a routing/M_total change recompiled"


def test_back_to_back_histograms():
    """Three histograms through one compiled kernel, back to back, no sync in between."""
    _sm90()
    from moe_ep.shim import sm90_grouped_gemm

    H, I, E = SHAPES["qwen3"]
    gen = torch.Generator().manual_seed(9)
    fn = sm90_grouped_gemm("swiglu", 2 * I, H, E)
    M = 8192
    a = torch.randn(M, H, generator=gen).to(torch.bfloat16).cuda()
    b = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    hists = [histogram(M, E, r, gen) for r in ("uniform", "skewed", "uniform")]
    hists[2] = torch.tensor([0] * 64 + [M] * (E + 1 - 64), dtype=torch.int32)  # all rows to expert 63
    outs = [torch.full((M, I), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in hists]
    for h, o in zip(hists, outs):
        fn(a, b, h.cuda(), out=o)
    torch.cuda.synchronize()
    for h, o in zip(hists, outs):
        assert rel(o, ref_gemm(a, b, h, "swiglu")) < 1e-2


@pytest.mark.parametrize("routing,T,deterministic", [
    ("uniform", 1, True), ("skewed", 1, True), ("uniform", 333, True), ("skewed", 333, True),
    ("uniform", 4096, True), ("skewed", 4096, True), ("skewed", 4096, False), ("uniform", 333, False),
])
def test_layer_ep1_matches_reference(routing, T, deterministic):
    _sm90()
    from moe_ep.api import EPGroup, MoEConfig, MoELayer

    H, I, E = SHAPES["qwen3"]
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=8, max_tokens_per_rank=4096)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=gen)
    if routing == "skewed":
        logits[:, :4] += 3.0
    ids = logits.topk(8, dim=-1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(T, 8, generator=gen), -1).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16).cuda()
    g = EPGroup.single()
    with MoELayer(cfg, g, backend="auto", deterministic=deterministic) as fast, \
            MoELayer(cfg, g, backend="reference") as ref:
        assert fast.backend_name == "sm90_bf16_cutedsl"
        fast.warmup(progress=False)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = fast.forward(x, ids, w, w13, w2, out=out)
        want = ref.forward(x, ids, w, w13, w2)
        assert torch.isfinite(got).all()
        assert rel(got, want) < 1e-2
        # split pair: dispatch -> reference expert MLP -> combine == forward
        recv, offs, h = fast.dispatch(x, ids, w)
        from moe_ep.backends.reference import expert_mlp

        y = expert_mlp(recv, offs, w13, w2, "swiglu", I)
        assert rel(fast.combine(y, h), want) < 1e-2


def test_layer_ep1_cuda_graph_bit_identical():
    """warmup -> capture -> replay equals eager bit for bit; new inputs copied into the captured
    buffers give the new (correct) result."""
    _sm90()
    from moe_ep.api import EPGroup, MoEConfig, MoELayer

    H, I, E, K, T = 2048, 768, 128, 8, 1024
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T)
    gen = torch.Generator().manual_seed(1)

    def inputs():
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        ids = torch.randn(T, E, generator=gen).topk(K, -1).indices.to(torch.int32).cuda()
        w = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda()
        return x, ids, w

    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16).cuda()
    layer = MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl")
    layer.warmup(progress=False)
    x, ids, w = inputs()
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    eager = layer.forward(x, ids, w, w13, w2).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer.forward(x, ids, w, w13, w2, out=out)  # side-stream warm-up, as torch recommends
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(x, ids, w, w13, w2, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x2, ids2, w2_ = inputs()
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
    g.replay()
    want = layer.forward(x2, ids2, w2_, w13, w2)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert not torch.equal(want, eager)
    layer.destroy()
