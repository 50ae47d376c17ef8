"""gelu_tanh_glu (drop v109): ``gelu_tanh(g) * u``, ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g +
0.044715 g^3)))`` -- torch's ``gelu(approximate="tanh")``, transformers' ``gelu_pytorch_tanh``: Gemma 4's
experts (Gemma-4-26B-A4B: 128 experts, top-8, I 704).

The kernels compute it as the equal ``g * sigmoid(2 z)`` (``ex2`` + ``rcp``), which has no cancellation
where ``1 + tanh(z)`` is tiny. The two GELUs differ by ~10% at g = -3 (gelu_tanh(-3) = -0.00364, the erf
form -0.00405), far above bf16's rounding, so the GPU checks below tell the forms apart element by element.

CPU: every SM90 BF16 kernel that runs a gated activation (128-row cooperative, the gathering FC1, the
opt-in gated pingpong, swap-AB decode) compiles it for sm_90a with one ``ex2`` + ``rcp`` per output and
no spills; the drop's reference and the reference backend against float64 from the formula; which
backends take it (sm90_bf16_cutedsl) and which refuse it, naming it (FP8, Blackwell). GPU: the 128-row
and swap-AB GEMMs element by element against float64 (and not the erf form), and the layer (prefill and
decode kernels) against float64. (Gemma 4 through transformers: tests/test_transformers_layouts.py.)"""

import zlib

import pytest
import torch

from moe_ep.api import EPGroup, MoEConfig

from moe_oracle import (activation_problem, fast_layer_forward, gated_moe_f64, gelu_erf_f64, gelu_tanh_f64, rel_err,
                         require_sm90)
from moe_oracle import sm90_drop_module as _drop

GEMMA4_FC1 = (2 * 704, 2816, 128)  # n = 2 I, k = H, E


def _clean(ptx):
    return "wgmma.mma_async" in ptx and "ld.local" not in ptx and "st.local" not in ptx


# ---- CPU: compile ---------------------------------------------------------------------------


def test_128_row_gemm_compiles_it_with_one_ex2_per_output():
    """Gemma 4's FC1 (I 704: the last 128-wide n-tile half full): one ``ex2`` + one ``rcp`` per output,
    as many as the ex2 + rcp SwiGLU kernel at the same shape (so the same MUFU work), no tanh, no erf."""
    cc = _drop("compile_check")
    n, k, e = GEMMA4_FC1
    ptx = cc.compile_for_arch("gelu_tanh_glu", n, k, False, num_experts=e, raster_m=8).__ptx__
    base = cc.compile_for_arch("swiglu", n, k, False, num_experts=e, raster_m=8).__ptx__
    assert _clean(ptx) and "cp.async.bulk.tensor" in ptx
    assert "tanh.approx" not in ptx
    assert ptx.count("ex2.approx") == base.count("ex2.approx") > 0
    assert ptx.count("rcp.approx") == base.count("rcp.approx") > 0
    assert ptx != base


@pytest.mark.parametrize("schedule", ["gather", "pingpong", "swapab"])
def test_the_other_gated_schedules_compile_it(schedule):
    """The gathering FC1 (``MOE_EP_GATHER_FC1=1``), the gated pingpong (``MOE_EP_GATED_PINGPONG=1``,
    128 x 96) and the swap-AB decode kernel."""
    n, k, e = GEMMA4_FC1
    if schedule == "swapab":
        sr = _drop("swapab_runner")
        kern, compiled = sr.compile_swapab("gelu_tanh_glu", n, k, e, False, 16)
        assert kern.activation == "gelu_tanh_glu"
        ptx, base = compiled.__ptx__, sr.compile_swapab("swiglu", n, k, e, False, 16)[1].__ptx__
    else:
        cc = _drop("compile_check")
        kw = (dict(schedule="cooperative", gather_a=True) if schedule == "gather"
              else dict(schedule="pingpong", tile_n=96))
        ptx, base = (cc.compile_for_arch(act, n, k, False, num_experts=e, raster_m=8, **kw).__ptx__
                     for act in ("gelu_tanh_glu", "swiglu"))
    assert _clean(ptx) and "tanh.approx" not in ptx
    # one ex2 + one rcp per output like the SwiGLU kernel of the same schedule, which it is not
    assert ptx.count("ex2.approx") == base.count("ex2.approx") > 0
    assert ptx.count("rcp.approx") == base.count("rcp.approx") > 0
    assert ptx != base


# ---- CPU: references, backends ----------------------------------------------------------------


def test_drop_reference_and_the_reference_backend_are_the_formula():
    """The drop's torch reference (``grouped_gemm_reference``) and the reference backend's ``activate``
    against GELU's tanh formula in float64 (not torch's gelu); the erf form is 7-80% off at g in [-4, -2.8]."""
    from moe_ep.backends.reference.backend import activate

    g = torch.Generator().manual_seed(11)
    h = torch.randn(400, 64, generator=g, dtype=torch.float64) * 3
    want = gelu_tanh_f64(h[:, :32]) * h[:, 32:]
    got = activate(h.float(), "gelu_tanh_glu", 32)
    # torch's float32 0.5 g (1 + tanh(z)) cancels where 1 + tanh(z) is tiny: absolute error ~1e-7 there
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    ref = _drop("reference")
    a = torch.randn(50, 16, generator=g)
    b = torch.randn(3, 64, 16, generator=g)
    offs = torch.tensor([0, 20, 20, 50])
    got = ref.grouped_gemm_reference(a, b, offs, "gelu_tanh_glu")
    want = torch.cat([(lambda y: gelu_tanh_f64(y[:, :32]) * y[:, 32:])(a[lo:hi].double() @ b[e].double().T)
                      for e, (lo, hi) in enumerate([(0, 20), (20, 20), (20, 50)])])
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
    x = torch.linspace(-4, -2.8, 101, dtype=torch.float64)
    assert ((gelu_erf_f64(x) - gelu_tanh_f64(x)).abs() / gelu_tanh_f64(x).abs()).min() > 0.05


def test_reference_layer_against_float64():
    from moe_ep.api import MoELayer

    E, H, I, K, T = 8, 128, 96, 2, 40
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64,
                    activation="gelu_tanh_glu")
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, 9, "cpu", x_scale=3.0)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    assert rel_err(got, gated_moe_f64(x, ids, w, w13, w2, lambda h: gelu_tanh_f64(h[:, :I]) * h[:, I:])) < 1e-2


def test_which_backends_take_it():
    """sm90_bf16_cutedsl takes Gemma 4's shape (its FC1 key carries the activation), and so does the
    SM100 W4A16 backend (drop sm100/w4a16 v2) and the SM120 MXFP8 one (drop sm120/mxfp8 v2); the FP8
    backend refuses it, naming it, before anything is built."""
    from moe_ep.backends import UnsupportedBackendError
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.backends.sm90.fp8_cutedsl import check_config as fp8_check
    from moe_ep.bench.models import model_config
    from moe_ep.shim import sm90_check_gemm_shapes

    cfg = model_config("gemma4", 8192)
    assert (cfg.activation, cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k) == (
        "gelu_tanh_glu", 128, 2816, 704, 8)
    specs = _gemm_specs(cfg, 128)
    for spec in specs.values():  # the shapes the backend's check() asks the shim about
        sm90_check_gemm_shapes(spec["activation"], spec["n"], spec["k"], spec["num_experts"])
    assert specs["fc1"]["activation"] == specs["fc1_decode"]["activation"] == "gelu_tanh_glu"
    assert specs["fc2"]["activation"] == "identity"
    fp8 = MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=256,
                    quant="fp8_block128", activation="gelu_tanh_glu")
    with pytest.raises(UnsupportedBackendError, match="gelu_tanh_glu"):
        fp8_check(fp8, EPGroup.single())
    from moe_ep.backends.sm100.w4a16_cutedsl.backend import check_config as sm100_check
    from moe_ep.backends.sm120.mxfp8_cutedsl.backend import check_config as sm120_check

    def blackwell(quant):
        return MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=256,
                         quant=quant, activation="gelu_tanh_glu")

    sm100_check(blackwell("nvfp4_w4a16"), EPGroup.single())
    sm120_check(blackwell("mxfp8"), EPGroup.single())


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["cooperative", "swapab"])
def test_gemm_is_the_tanh_form_element_by_element(schedule):
    """The grouped GEMM on gates ~N(0, 3^2), 16 experts (skewed), NaN-poisoned output: every element
    within bf16's rounding of float64's ``gelu_tanh(g) * u``; on the gates in [-4, -2.8] the erf form is
    >= 7% away, and the kernel's output stays within 1% of the tanh form there."""
    require_sm90()
    make_offsets = _drop("grouped_gemm_runner").make_offsets
    CompiledGroupedGemm = _drop("launch").CompiledGroupedGemm

    n, k, E = 2 * 704, 2816, 16
    m_total = 3001 if schedule == "cooperative" else 200
    offs = make_offsets(m_total, E, "skewed", torch.Generator().manual_seed(3)).cuda()
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(schedule.encode()))
    a = torch.randn(m_total, k, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(E, n, k, device="cuda", generator=g) * 3 / k ** 0.5).to(torch.bfloat16)
    fn = CompiledGroupedGemm("gelu_tanh_glu", n, k, E, False, schedule=schedule,
                             tile_n=16 if schedule == "swapab" else None)
    out = torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(a, b, offs, out=out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(out).any()), "elements left unwritten (NaN poison survived)"
    o = offs.cpu().tolist()
    hs = torch.cat([a[o[e]:o[e + 1]].cpu().double() @ b[e].cpu().double().T for e in range(E)])
    gate, up = hs[:, :n // 2], hs[:, n // 2:]
    want, erf = gelu_tanh_f64(gate) * up, gelu_erf_f64(gate) * up
    got = out.cpu().double()
    scale = want.abs().max()
    # bf16's rounding (2^-9) twice over, plus float32 accumulation against float64 (~1e-5 of h)
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 2e-5 * scale).all(), (got - want).abs().max()
    band = (gate > -4) & (gate < -2.8) & (up.abs() > 1)
    assert int(band.sum()) > 500
    d_tanh = ((got - want).abs() / want.abs())[band]
    d_erf = ((got - erf).abs() / erf.abs())[band]
    assert d_tanh.max() < 1e-2 and d_erf.min() > 0.05, (d_tanh.max(), d_erf.min())


@pytest.mark.gpu
@pytest.mark.parametrize("T,decode", [(700, False), (6, True)])
def test_gelu_tanh_on_the_bf16_backend(T, decode):
    """A Gemma-4-like layer (E 32, H 1024, I 352: ragged against the 128 tile, K 4) on the 128-row
    kernels (700 tokens) and the swap-AB decode kernels (6 tokens), against float64."""
    require_sm90()
    E, H, I, K = 32, 1024, 352, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=2048,
                    activation="gelu_tanh_glu")
    seed = zlib.crc32(f"gelu_tanh/{T}".encode())
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, seed, "cuda", x_scale=3.0)
    out, ran_decode = fast_layer_forward(cfg, "sm90_bf16_cutedsl", x, ids, w, w13, w2)
    assert ran_decode == decode and torch.isfinite(out).all()
    want = gated_moe_f64(x, ids, w, w13, w2, lambda h: gelu_tanh_f64(h[:, :I]) * h[:, I:])
    assert rel_err(out, want) < 1e-2, rel_err(out, want)
