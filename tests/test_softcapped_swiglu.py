"""softcapped_swiglu (drop v103): ``gate_softcap * tanh(g / gate_softcap) * sigmoid(g) * up_softcap *
tanh(u / up_softcap)``, Inkling2's experts (caps 4 and 25; the sigmoid sees the raw gate).

CPU: every SM90 kernel that runs a gated activation (the BF16 128-row GEMM, the swap-AB decode GEMM,
the FP8 FC1 plain and overlapped-wide) compiles it for sm_90a with three ``tanh.approx`` per output
and no spills, and the caps change its PTX; MoEConfig validates the caps; the layer's specs and both
shims' keys carry them; the reference backend (BF16 and FP8) against float64 written from Inkling2's
definition. GPU: ``sm90_bf16_cutedsl`` (prefill and decode kernels) and ``sm90_fp8_cutedsl`` against
float64; plain SwiGLU would be off. (The transformers models: tests/test_transformers_layouts.py.)"""

import zlib

import pytest
import torch

from moe_ep.api import MoEConfig

from moe_oracle import activation_problem, fast_layer_forward, gated_moe_f64, rel_err, require_sm90
from moe_oracle import sm90_drop_module as _drop

CAPS = dict(gate_softcap=1.0, up_softcap=1.5)  # small, so that both caps bind on the tests' FC1 outputs


def _clean(ptx, swiglu_ptx):
    """WGMMA, no local memory, and three tanh per output (the two caps and the sigmoid), counted against
    the SwiGLU kernel of the same schedule and shape, whose sigmoid takes one ex2 per output."""
    per_output = swiglu_ptx.count("ex2.approx")
    return ("wgmma.mma_async" in ptx and per_output > 0 and ptx.count("tanh.approx.f32") == 3 * per_output
            and "ex2.approx" not in ptx and "ld.local" not in ptx and "st.local" not in ptx)


def _inkling2_f64(h, I, gate_softcap, up_softcap):
    """Inkling2's ``Inkling2SoftcappedSwiGLU`` in float64: ``Softcap(gate) * sigmoid(gate) * Softcap(up)``,
    ``Softcap(x) = tanh(x / c) * c``."""
    g, u = h[:, :I].double(), h[:, I:].double()
    return torch.tanh(g / gate_softcap) * gate_softcap * torch.sigmoid(g) * (torch.tanh(u / up_softcap) * up_softcap)


# ---- CPU: compile, validation, keys ---------------------------------------------------------


def test_128_row_gemm_compiles_it(tmp_path):
    cc = _drop("compile_check")
    ptx = {}
    base = cc.compile_for_arch("swiglu", 2 * 1536, 2048, False, raster_m=8,
                               extra_options=f"--dump-dir={tmp_path}").__ptx__
    for caps in ((4.0, 25.0), (1.0, 1.5)):
        compiled = cc.compile_for_arch("softcapped_swiglu", 2 * 1536, 2048, False, raster_m=8,
                                       gate_softcap=caps[0], up_softcap=caps[1], extra_options=f"--dump-dir={tmp_path}")
        ptx[caps] = compiled.__ptx__
        assert _clean(ptx[caps], base)
    assert ptx[(4.0, 25.0)] != ptx[(1.0, 1.5)]  # the caps are compiled in


def test_swapab_gemm_compiles_it():
    sr = _drop("swapab_runner")
    kern, compiled = sr.compile_swapab("softcapped_swiglu", 2 * 2048, 4096, 32, False, 16, **CAPS)
    assert (kern.gate_softcap, kern.up_softcap) == (1.0, 1.5)
    assert _clean(compiled.__ptx__, sr.compile_swapab("swiglu", 2 * 2048, 4096, 32, False, 16)[1].__ptx__)


@pytest.mark.parametrize("kw", [{}, dict(overlap_promotion=True, wide_gated=True)], ids=["plain", "overlap_wide"])
def test_fp8_fc1_compiles_it(kw):
    fr = _drop("fp8_runner")
    kern, compiled = fr.compile_variant("softcapped_swiglu", 1536, 2048, 128, False, swiglu=(1.0, 1.5), **kw)
    assert (kern.gate_softcap, kern.up_softcap) == (1.0, 1.5)
    base = fr.compile_variant("swiglu", 1536, 2048, 128, False, **kw)[1].__ptx__
    assert _clean(compiled.__ptx__, base) and "e4m3" in compiled.__ptx__


@pytest.mark.parametrize("kw,exc,match", [
    (dict(gate_softcap=0.0), ValueError, "MoEConfig.gate_softcap must be > 0"),
    (dict(up_softcap=-1.0), ValueError, "MoEConfig.up_softcap must be > 0"),
    (dict(up_softcap=float("inf")), ValueError, "MoEConfig.up_softcap must be finite"),
    (dict(gate_softcap="4"), TypeError, "MoEConfig.gate_softcap must be a float"),
])
def test_config_validates_the_caps(kw, exc, match):
    with pytest.raises(exc, match=match):
        MoEConfig(num_experts=8, hidden=256, intermediate=256, top_k=2, max_tokens_per_rank=64,
                  activation="softcapped_swiglu", **kw)


def test_drop_refuses_bad_caps():
    gg = _drop("grouped_gemm")
    with pytest.raises(ValueError, match="softcapped_swiglu needs finite gate_softcap and up_softcap > 0"):
        gg.GroupedGemmSm90("softcapped_swiglu", gate_softcap=0.0)


def test_the_layer_and_both_shims_key_the_caps():
    """Every FC1 spec of such a layer (the decode FC1 too) carries the caps; both compile keys hold
    them (and zero them for other activations); the FP8 backend accepts the activation."""
    from moe_ep.api import EPGroup
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.backends.sm90.fp8_cutedsl import check_config
    from moe_ep.shim.drops.sm90_megamoe import GemmKey
    from moe_ep.shim.drops.sm90_megamoe_fp8 import _gemm_key

    cfg = MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=4096,
                    activation="softcapped_swiglu", **CAPS)
    specs = _gemm_specs(cfg, 32)
    for name in ("fc1", "fc1_decode"):
        assert (specs[name]["activation"], specs[name]["gate_softcap"], specs[name]["up_softcap"]) == (
            "softcapped_swiglu", 1.0, 1.5)
    assert "gate_softcap" not in specs["fc2"]
    assert GemmKey.__dataclass_fields__["gate_softcap"].default == 0.0
    k1 = _gemm_key("softcapped_swiglu", 1024, 1024, 32, False, swiglu=(1.0, 1.5))
    k4 = _gemm_key("softcapped_swiglu", 1024, 1024, 32, False, swiglu=(4.0, 25.0))
    assert (k1.gate_softcap, k1.up_softcap) == (1.0, 1.5) and k1 != k4 and k1.wide_gated and not k1.tanh_sigmoid
    assert (k1.swiglu_alpha, k1.swiglu_limit) == (0.0, 0.0)
    plain = _gemm_key("swiglu", 1024, 1024, 32, False, swiglu=(1.0, 1.5))
    assert (plain.gate_softcap, plain.up_softcap) == (0.0, 0.0)
    check_config(MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=256,
                           quant="fp8_block128", activation="softcapped_swiglu"), EPGroup.single())


def test_bench_model_carries_the_caps():
    """``python -m moe_ep.bench --model inkling2_shard`` (and ``bench gemm``, ``aot build``) runs Inkling2's
    activation with its caps."""
    from moe_ep.bench.models import model_config

    cfg = model_config("inkling2_shard", 8192)
    assert (cfg.activation, cfg.gate_softcap, cfg.up_softcap) == ("softcapped_swiglu", 4.0, 25.0)
    assert (cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k) == (48, 4608, 2304, 8)


def test_drop_reference_is_the_definition():
    ref = _drop("reference")
    h = torch.randn(300, 64, generator=torch.Generator().manual_seed(5)) * 6
    got = ref.softcapped_swiglu_reference(h[:, :32], h[:, 32:], 4.0, 25.0)
    assert torch.allclose(got.double(), _inkling2_f64(h, 32, 4.0, 25.0), rtol=1e-5, atol=1e-5)


def _act(h, I, softcapped=True):
    if softcapped:
        return _inkling2_f64(h, I, CAPS["gate_softcap"], CAPS["up_softcap"])
    return torch.nn.functional.silu(h[:, :I].double()) * h[:, I:].double()  # plain SwiGLU, to show the difference


def _oracle_f64(x, ids, w, w13, w2, I, softcapped=True, fp8=False):
    """Inkling2's experts in float64 (``fp8``: the quantised model)."""
    return gated_moe_f64(x, ids, w, w13, w2, lambda h: _act(h, I, softcapped), fp8=fp8)


def test_reference_backend_against_float64():
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K, T = 8, 128, 96, 2, 40
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64,
                    activation="softcapped_swiglu", **CAPS)
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, 7, "cpu", x_scale=3.0)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I)) < 1e-2
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I, softcapped=False)) > 0.1


def test_fp8_reference_backend_against_float64():
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K, T = 8, 256, 256, 2, 48
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64, quant="fp8_block128",
                    activation="softcapped_swiglu", **CAPS)
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, 3, "cpu", x_scale=3.0, fp8=True)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I, fp8=True)) < 1e-2
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I, softcapped=False, fp8=True)) > 0.1


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T,decode", [(700, False), (6, True)])
def test_softcapped_on_the_bf16_backend(T, decode):
    """An Inkling2-style layer (E 32, H 1024, I 352: ragged against the 128 tile, K 4; caps 1 and 1.5,
    which FC1's outputs pass often) on the 128-row kernels (700 tokens) and the swap-AB decode
    kernels (6 tokens), against float64; plain SwiGLU is off."""
    require_sm90()
    E, H, I, K = 32, 1024, 352, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=2048,
                    activation="softcapped_swiglu", **CAPS)
    seed = zlib.crc32(f"softcap/{T}".encode())
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, seed, "cuda", x_scale=3.0)
    out, ran_decode = fast_layer_forward(cfg, "sm90_bf16_cutedsl", x, ids, w, w13, w2)
    assert ran_decode == decode and torch.isfinite(out).all()
    want = _oracle_f64(x, ids, w, w13, w2, I)
    assert rel_err(out, want) < 1e-2, rel_err(out, want)
    assert rel_err(out, _oracle_f64(x, ids, w, w13, w2, I, softcapped=False)) > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 6])
def test_softcapped_on_the_fp8_backend(T):
    """The same on sm90_fp8_cutedsl (I 512), against the quantised model in float64."""
    require_sm90()
    E, H, I, K = 32, 1024, 512, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=1024, quant="fp8_block128",
                    activation="softcapped_swiglu", **CAPS)
    seed = zlib.crc32(f"fp8softcap/{T}".encode())
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, seed, "cuda", x_scale=3.0, fp8=True)
    out, _ = fast_layer_forward(cfg, "sm90_fp8_cutedsl", x, ids, w, w13, w2)
    assert torch.isfinite(out).all()
    want = _oracle_f64(x, ids, w, w13, w2, I, fp8=True)
    # FC2's input is re-quantised to e4m3: one token's rows average little (see test_fp8_backend)
    assert rel_err(out, want) < (1e-2 if T >= 64 else 3e-2), rel_err(out, want)
    assert rel_err(out, _oracle_f64(x, ids, w, w13, w2, I, softcapped=False, fp8=True)) > 0.1
