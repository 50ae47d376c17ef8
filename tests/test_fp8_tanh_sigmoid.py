"""Drop v50: the swiglu FP8 GEMM (FC1) takes its sigmoid from one ``tanh.approx``
(``tanh_sigmoid=True``: sigmoid(g) = 0.5 + 0.5 tanh(g / 2), one MUFU op per output instead of
``ex2`` + ``rcp``; the SwiGLU epilogue is MUFU-bound); drop v51: every FC1 variant takes it. CPU: the
PTX (tanh.approx, no ex2 / rcp; the gathering variant too), no
spills, the kernel without the flag unchanged, the refusals, the shim's switch and key. GPU: the
kernel against float64 with the exact SiLU and against the ``ex2`` + ``rcp`` kernel, every row
written; the FP8 layer with the opt-out (``MOE_EP_FP8_TANH_SIGMOID=0``; the tanh is the default since the
twenty-first session) against the reference backend and float64, and its FC1 variants bit-identical
to one another with the opt-out."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import fp8_gemm_problem, kernel_once  # noqa: E402
from sm90_megamoe import fp8_reference as ref  # noqa: E402

# the layer's FC1 schedules (as the shim picks them): Qwen3 (short-K: staged scales) and Mixtral
FC1 = [
    (1536, 2048, 128, dict(wide_gated=True, cluster_n=2, smem_scales=True, overlap_promotion=True)),
    (28672, 4096, 8, dict(wide_gated=True, cluster_n=2, overlap_promotion=True)),
]


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("n,k,experts,kw", FC1)
def test_tanh_sigmoid_ptx(n, k, experts, kw):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant("swiglu", n, k, experts, False, raster_m=16, tanh_sigmoid=True, **kw)
    _, base = compile_variant("swiglu", n, k, experts, False, raster_m=16, **kw)
    ptx, base_ptx = compiled.__ptx__, base.__ptx__
    # one tanh per output of the thread's 32 (wide gated m64n128: 64 accumulators, half gate)
    assert ptx.count("tanh.approx.f32") == 32 and "ex2.approx" not in ptx and "rcp.approx" not in ptx
    assert "tanh.approx" not in base_ptx and base_ptx.count("ex2.approx") == 32
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"], r
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


def _variant_ptx(variant: str, tanh: bool) -> str:
    """PTX of an FC1 variant at Qwen3's shape (wide gated, overlapped promotion)."""
    from sm90_megamoe.fp8_runner import compile_variant

    _, compiled = compile_variant("swiglu", 1536, 2048, 128, False, raster_m=16, overlap_promotion=True,
                                  wide_gated=True, tanh_sigmoid=tanh, **{variant: 2 if variant == "cluster_n" else True})
    return compiled.__ptx__


@pytest.mark.parametrize("variant", ["cluster_n", "smem_scales"])
def test_tanh_sigmoid_ptx_of_the_fc1_variants(variant):
    """Drop v51: every FC1 variant takes the switch (the layer's FC1 variants keep one another's bits
    with it on): in clusters of 2, with staged scales."""
    ptx, base = _variant_ptx(variant, True), _variant_ptx(variant, False)
    assert "tanh.approx.f32" in ptx and "ex2.approx" not in ptx
    assert "tanh.approx" not in base and "ex2.approx" in base


def test_tanh_sigmoid_refusals():
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    with pytest.raises(ValueError, match="needs activation 'swiglu'"):
        Fp8BlockScaledGroupedGemmSm90("identity", tanh_sigmoid=True)
    with pytest.raises(ValueError, match="needs activation 'swiglu'"):
        CompiledFp8Gemm("identity", 2048, 768, 8, tanh_sigmoid=True)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_TANH_SIGMOID", raising=False)
    key = s._key("gemm", "swiglu", 28672, 4096, 8, False)  # on by default (twenty-first session)
    assert key.tanh_sigmoid and s._gemm_options(key)["tanh_sigmoid"]
    assert not s._key("gemm", "identity", 4096, 14336, 8, True).tanh_sigmoid      # FC2 has no sigmoid
    # drop v51: every FC1 variant, so switching between them keeps the bits
    assert not s._key("quantize", "", 0, 2048, 0, False).tanh_sigmoid
    monkeypatch.setenv("MOE_EP_FP8_TANH_SIGMOID", "0")  # the opt-out: ex2 + rcp in every FC1 variant
    assert not s._key("gemm", "swiglu", 28672, 4096, 8, False).tanh_sigmoid
    monkeypatch.setenv("MOE_EP_FP8_TANH_SIGMOID", "1")
    assert s._key("gemm", "swiglu", 28672, 4096, 8, False).tanh_sigmoid


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("n,k,m_total,kw", [
    (1536, 2048, 5000, FC1[0][3]),  # Qwen3's FC1 schedule
    (2048, 4096, 3000, FC1[1][3]),  # Mixtral's (K 4096, global scales), narrower N
    (1536, 2048, 1, FC1[0][3]),     # one row
])
def test_gpu_tanh_sigmoid_against_float64(n, k, m_total, kw, routing):
    """Every row written (NaN-poisoned), the output within 1e-2 of a float64 computation with the
    exact SiLU, and within 2e-3 of the ex2 + rcp kernel (tanh.approx: ~2^-11 relative error)."""
    _sm90()
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E = 16
    a, a_s, b, b_s, offs, _ = (None if t is None else t.cuda()
                               for t in fp8_gemm_problem(m_total, n, k, E, routing, 70 + m_total, False))
    outs = []
    for tanh in (False, True):
        fn = kernel_once(Fp8GroupedGemm, "swiglu", n, k, E, False, raster_m=16, tanh_sigmoid=tanh, **kw)
        out = torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, None))
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[1]).any()), "rows left unwritten (NaN poison survived)"
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), offs.cpu(), "swiglu",
                                          dtype=torch.float64)

    def rel(x, y):
        return float((x.double().cpu() - y.double().cpu()).norm() / y.double().cpu().norm().clamp_min(1e-30))

    errs = dict(tanh_vs_float64=rel(outs[1], want), exact_vs_float64=rel(outs[0], want),
                tanh_vs_exact=rel(outs[1], outs[0]))
    print(f"tanh_sigmoid n={n} k={k} m={m_total} {routing}: " + ", ".join(f"{a} {v:.2e}" for a, v in errs.items()))
    assert errs["tanh_vs_float64"] < 1e-2 and errs["tanh_vs_exact"] < 2e-3, errs


@pytest.mark.gpu
def test_gpu_fp8_layer_with_exact_sigmoid(monkeypatch):
    """The FP8 layer with ``MOE_EP_FP8_TANH_SIGMOID=0`` (the opt-out: ex2 + rcp; the default takes the
    tanh since the twenty-first session, and test_fp8_backend checks it): the checks of the layer's
    float64 test (Qwen3 shapes, 1024 tokens) hold either way."""
    _sm90()
    from test_fp8_backend import QWEN, test_fp8_layer_against_reference_and_float64 as layer_test

    monkeypatch.setenv("MOE_EP_FP8_TANH_SIGMOID", "0")
    layer_test(1024, False, QWEN)


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["MOE_EP_FP8_WIDE_GATED", "MOE_EP_FP8_CLUSTER"])
def test_gpu_fc1_variants_keep_bits_with_exact_sigmoid(monkeypatch, switch):
    """Drop v51: with ``MOE_EP_FP8_TANH_SIGMOID=0`` (the opt-out) the FC1 variants (gathering,
    narrow gated) give that path's bits too, eager and under a poisoned CUDA graph -- as
    test_fp8_backend's variant test checks them at the default (tanh)."""
    _sm90()
    from test_fp8_backend import test_fp8_fc1_variants_are_bit_identical as variants_test

    monkeypatch.setenv("MOE_EP_FP8_TANH_SIGMOID", "0")
    variants_test(monkeypatch, 700, switch)
