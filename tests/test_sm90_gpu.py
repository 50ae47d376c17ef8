"""GPU (H200): the SM90 grouped GEMMs against float32 references (the layer: test_layer_gpu.py).

Run on the GPU machine: ``pytest -m gpu tests/test_sm90_gpu.py``.
"""

import zlib

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


GATED = ("swiglu", "gelu_glu", "clamped_swiglu")


def ref_gemm(a, b, offs, activation, row_scale=None, bias=None, alpha=1.702, limit=7.0, dtype=torch.float32):
    """Per-expert reference in ``dtype``: act(A_e · B_eᵀ + bias_e) (· row_scale)."""
    out = []
    o = offs.tolist()
    for e in range(b.shape[0]):
        h = a[o[e]:o[e + 1]].to(dtype) @ b[e].to(dtype).t()
        if bias is not None:
            h = h + bias[e].to(dtype)
        if activation in GATED:
            i = h.shape[1] // 2
            g, u = h[:, :i], h[:, i:]
        if activation == "swiglu":
            h = torch.nn.functional.silu(g) * u
        elif activation == "gelu_glu":
            h = 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u
        elif activation == "clamped_swiglu":
            g = g.clamp(max=limit)
            h = (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
        elif activation == "squared_relu":
            h = torch.relu(h).square()
        out.append(h)
    r = torch.cat(out) if out else torch.zeros(0, 1)
    if row_scale is not None:
        r = r * row_scale[:, None].to(r.dtype)
    return r


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_case(act, n, k, E, M, routing, gen, scale=False, **gemm_kw):
    from moe_ep.shim import sm90_grouped_gemm

    fn = sm90_grouped_gemm(act, n, k, E, scale_rows=scale, device="cuda", **gemm_kw)
    dev = "cuda"
    a = (torch.randn(M, k, generator=gen) ).to(torch.bfloat16).to(dev)
    b = (torch.randn(E, n, k, generator=gen) * k ** -0.5).to(torch.bfloat16).to(dev)
    offs = histogram(M, E, routing, gen)
    rs = torch.rand(M, generator=gen).to(dev) if scale else None
    n_out = n // 2 if act in GATED else n
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
    gen = torch.Generator().manual_seed(zlib.crc32(f"{model}/{routing}".encode()))
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
    fn = sm90_grouped_gemm("swiglu", 2 * I, H, E, device="cuda")
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


@pytest.mark.parametrize("act,bias", [("clamped_swiglu", torch.float32), ("gelu_glu", torch.bfloat16),
                                      ("swiglu", torch.float32), ("swiglu", None),
                                      ("squared_relu", torch.bfloat16), ("identity", torch.float32)])
def test_activations_bias_ragged_intermediate(act, bias):
    """gpt-oss-120b widths (H = I = 2880: 22.5 output tiles of 128), every epilogue activation with
    and without per-expert biases, skewed routing, against float64; the clamp of clamped_swiglu
    must actually bite on these inputs."""
    _sm90()
    from moe_ep.shim import sm90_grouped_gemm

    H = I = 2880
    E, M = 16, 5003
    gen = torch.Generator().manual_seed(zlib.crc32(f"{act}/{bias}".encode()))
    n = 2 * I if act in GATED else I
    n_out = I
    amp = 4.0 if act == "clamped_swiglu" else 1.0
    fn = sm90_grouped_gemm(act, n, H, E, device="cuda", bias_dtype=bias)
    a = (torch.randn(M, H, generator=gen) * amp).to(torch.bfloat16).cuda()
    b = (torch.randn(E, n, H, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    bb = None if bias is None else (torch.randn(E, n, generator=gen) * amp).to(bias).cuda()
    offs = histogram(M, E, "skewed", gen)
    out = torch.full((M, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(a, b, offs.cuda(), out=out, bias=bb)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output rows"
    ref = ref_gemm(a, b, offs, act, bias=bb, dtype=torch.float64)
    e = rel(out, ref)
    assert e < 1e-2, f"{act} bias={bias}: rel err {e:.3e}"
    if act == "clamped_swiglu":
        h = ref_gemm(a, b, offs, "identity", bias=bb, dtype=torch.float64)
        assert (h[:, :I] > 7.0).float().mean() > 0.05 and (h[:, I:].abs() > 7.0).float().mean() > 0.05
    if act == "gelu_glu":  # the norm above cannot tell GELU's erf form from its tanh form; these elements can
        from moe_oracle import gelu_erf_f64, gelu_tanh_f64

        h = ref_gemm(a, b, offs, "identity", bias=bb, dtype=torch.float64)
        g, u = h[:, :I], h[:, I:]
        erf_form, tanh_form = gelu_erf_f64(g) * u, gelu_tanh_f64(g) * u
        band = (g > -4) & (g < -2.8) & (u.abs() > 0.1)  # gates where the two forms differ by 5-80%
        assert int(band.sum()) > 1000
        assert float(((tanh_form - erf_form).abs() / erf_form.abs())[band].min()) > 0.05
        d = ((out.double() - erf_form).abs() / erf_form.abs())[band]
        assert float(d.max()) < 2e-2, f"gelu_glu is not the erf form on {int((d >= 2e-2).sum())} elements"


@pytest.mark.parametrize("raster", [1, 3, 16])
def test_raster_orders_agree(raster):
    """The tile raster only reorders work: raster groups that do not divide an expert's m-tiles,
    empty experts, one huge expert -- same values as the float32 reference for every order."""
    _sm90()
    from moe_ep.shim import sm90_grouped_gemm

    H, I, E = 1024, 1408, 8
    gen = torch.Generator().manual_seed(100 + raster)
    fn = sm90_grouped_gemm("swiglu", 2 * I, H, E, device="cuda", raster_m=raster)
    M = 9000
    a = torch.randn(M, H, generator=gen).to(torch.bfloat16).cuda()
    b = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    for offs in (histogram(M, E, "skewed", gen),
                 torch.tensor([0, 0, 0, M, M, M, M, M, M], dtype=torch.int32)):
        out = torch.full((M, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs.cuda(), out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert rel(out, ref_gemm(a, b, offs, "swiglu")) < 1e-2


def test_bias_argument_contract():
    """A bias kernel needs its bias; a no-bias kernel refuses one (before any launch)."""
    _sm90()
    from moe_ep.shim import sm90_grouped_gemm

    fb = sm90_grouped_gemm("identity", 256, 128, 2, device="cuda", bias_dtype=torch.float32)
    fn = sm90_grouped_gemm("identity", 256, 128, 2, device="cuda")
    a = torch.randn(10, 128, device="cuda").to(torch.bfloat16)
    b = torch.randn(2, 256, 128, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    out = torch.empty(10, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bias"):
        fb(a, b, offs, out=out)
    with pytest.raises(ValueError, match="bias"):
        fn(a, b, offs, out=out, bias=torch.zeros(2, 256, device="cuda"))


@pytest.mark.parametrize("schedule,tile_n", [("pingpong", 128), ("pingpong", 192), ("cooperative", 128),
                                             ("cooperative", 256)])
def test_schedules_agree(schedule, tile_n):
    """Both schedules and tile widths on FC2 (identity + row scale) of Qwen3 and the DeepSeek-V3
    shard, and pingpong on a gated FC1 with 64-wide tiles: 1 row, skewed, odd counts (a CTA whose
    second warpgroup gets no tile, experts with one m-tile)."""
    _sm90()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{schedule}/{tile_n}".encode()))
    for model in ("qwen3", "dsv3_shard"):
        H, I, E = SHAPES[model]
        for M, routing in ((1, "uniform"), (777, "skewed"), (20000, "uniform")):
            run_case("identity", H, I, E, M, routing, gen, scale=True, schedule=schedule, tile_n=tile_n)
    if schedule == "pingpong":
        H, I, E = SHAPES["qwen3"]
        run_case("swiglu", 2 * I, H, E, 4133, "skewed", gen, schedule="pingpong", tile_n=64)


@pytest.mark.parametrize("model,T", [("qwen3", 777), ("qwen3", 4096), ("gpt_oss_like", 2000)])  # Qwen3 > 512: no decode GEMMs
def test_layer_fc2_pingpong_matches_cooperative(monkeypatch, model, T):
    """The shim's default FC2 for K <= 2880 on the H200 (on an H100 K <= 1920 where the cooperative kernel would cluster; the test sets 2880) --
    pingpong with 128 x 192 tiles (drop v71) -- gives
    the same layer bits as cooperative 128 x 256 (MOE_EP_PINGPONG_MAX_K=0), eager and replayed from
    a poisoned CUDA graph, and match the float64 oracle on a sample of rows (Qwen3: K 768; a gpt-oss-like
    layer: I 2880, the bound, with a ragged last tile of N = 2880 = 15 x 192)."""
    _sm90()
    from moe_oracle import layer_outputs_with_switch, make_problem, oracle_f64, rel_err, worst_row_err

    from moe_ep.api import MoEConfig

    E, H, I, K = (128, 2048, 768, 8) if model == "qwen3" else (32, 2880, 2880, 4)
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=4096)
    problem = make_problem(E, H, I, K, T, seed=zlib.crc32(f"pp/{model}/{T}".encode()))
    x, ids, w, w13, w2 = (t.cuda() for t in problem)

    def check(impl, on):
        assert (impl.fc2.compiled.schedule, impl.fc2.compiled.kernel.tile_n) == (
            ("pingpong", 192) if on else ("cooperative", 256))

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_PINGPONG_MAX_K", cfg, "sm90_bf16_cutedsl",
                                     (x, ids, w, w13, w2), check, values=("0", "2880"))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
    n = 48  # the float64 oracle walks token-expert pairs one by one: a sample of the rows
    want = oracle_f64(*(t[:n] for t in problem[:3]), problem[3], problem[4], "swiglu", I)
    assert rel_err(outs[1][:n].cpu(), want) < 1e-2 and worst_row_err(outs[1][:n].cpu(), want) < 3e-2
