"""clamped_swiglu's ``swiglu_beta`` (drop v99): ``(clamp(u, -limit, limit) + beta) * g' *
sigmoid(alpha * g')``, ``g' = min(g, limit)``. gpt-oss adds 1 (beta 1, the default); DeepSeek-V4,
GLM-5 and Hunyuan-V4 add nothing (``swiglu_alpha=1, swiglu_beta=0``).

CPU: both SM90 kernels that run it (the 128-row GEMM and the swap-AB decode GEMM) compile for
sm_90a with beta 0, without spills, and beta changes their PTX; the layer asks the shim for the
config's beta. GPU: a layer with beta 0 on ``sm90_bf16_cutedsl`` against float64 written from
DeepSeek-V4's definition, on the prefill and the decode kernels.
FP8 (drop v100): the FP8 FC1 runs clamped_swiglu too -- compile tests, the shim's key, the reference
backend's FP8 layer against the quantised model in float64 (CPU), and ``sm90_fp8_cutedsl`` against
it (GPU). (The BF16 reference backend's beta: tests/test_activations_bias.py.)"""

import importlib
import zlib

import pytest
import torch

from moe_ep.api import MoEConfig

V4 = dict(swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0)  # DeepSeek-V4's clamped SwiGLU


def _drop(name):
    pytest.importorskip("cutlass")
    from moe_ep.shim import SM90_MEGAMOE_CONSTANTS

    SM90_MEGAMOE_CONSTANTS.check()  # puts the drop on the path (and checks the mirror)
    return importlib.import_module(f"sm90_megamoe.{name}")


def _no_spills(ptx):
    return "ld.local" not in ptx and "st.local" not in ptx


def test_128_row_gemm_compiles_with_beta_0(tmp_path):
    cc = _drop("compile_check")
    ptx = {}
    for beta in (0.0, 1.0):
        compiled = cc.compile_for_arch("clamped_swiglu", 5760, 2880, False, bias_dtype="float32", raster_m=8,
                                       swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=beta,
                                       extra_options=f"--dump-dir={tmp_path}")
        ptx[beta] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[beta] and "min.f32" in ptx[beta] and _no_spills(ptx[beta])
    assert ptx[0.0] != ptx[1.0]  # beta is compiled in


def test_swapab_gemm_compiles_with_beta_0():
    sr = _drop("swapab_runner")
    ptx = {}
    for beta in (0.0, 1.0):
        kern, compiled = sr.compile_swapab("clamped_swiglu", 2 * 2048, 4096, 32, False, 16, **V4 | {"swiglu_beta": beta})
        assert kern.swiglu_beta == beta
        ptx[beta] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[beta] and "min.f32" in ptx[beta] and _no_spills(ptx[beta])
    assert ptx[0.0] != ptx[1.0]


@pytest.mark.parametrize("kw", [dict(swiglu_beta=float("nan")), dict(swiglu_beta=float("inf"))])
def test_drop_refuses_a_non_finite_beta(kw):
    gg = _drop("grouped_gemm")
    sw = _drop("swapab_gemm")
    with pytest.raises(ValueError, match="swiglu_beta"):
        gg.GroupedGemmSm90("clamped_swiglu", **kw)
    with pytest.raises(ValueError, match="swiglu_beta"):
        sw.SwapABGroupedGemmSm90("clamped_swiglu", **kw)


def test_layer_asks_the_shim_for_the_configs_beta():
    """Every GEMM spec of a clamped_swiglu layer carries its beta (the compile cache key holds it),
    the decode FC1 too; other activations pass none."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.shim.drops.sm90_megamoe import GemmKey

    cfg = MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=4096,
                    activation="clamped_swiglu", **V4)
    specs = _gemm_specs(cfg, 32)
    assert {"fc1", "fc1_decode"} <= set(specs)
    for name in ("fc1", "fc1_decode"):
        assert (specs[name]["swiglu_alpha"], specs[name]["swiglu_limit"], specs[name]["swiglu_beta"]) == (1.0, 10.0, 0.0)
    assert "swiglu_beta" not in specs["fc2"]
    plain = _gemm_specs(MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=4096), 32)
    assert "swiglu_beta" not in plain["fc1"]
    assert "swiglu_beta" in GemmKey.__dataclass_fields__


def test_bench_model_carries_the_activation_constants():
    """``python -m moe_ep.bench --model dsv4_shard`` (and ``bench gemm``, ``aot build``) runs DeepSeek-V4's
    activation, not gpt-oss's: the model entry's constants reach its MoEConfig."""
    from moe_ep.bench.models import model_config

    cfg = model_config("dsv4_shard", 8192)
    assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta) == ("clamped_swiglu", 1.0, 10.0, 0.0)
    assert (cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k) == (32, 4096, 2048, 6)
    gpt = model_config("gpt_oss", 64)
    assert (gpt.swiglu_alpha, gpt.swiglu_limit, gpt.swiglu_beta) == (1.702, 7.0, 1.0)


# ---- GPU ------------------------------------------------------------------------------------


def _oracle_f64(x, ids, w, w13, w2, I, limit, beta):
    """DeepSeek-V4's experts in float64 at beta 0 (transformers' ``DeepseekV4Experts._apply_gate``:
    ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``), one expert at a time; ``beta`` is
    added to the clamped up projection."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        h = x[t].double() @ w13[e].double().t()
        a = torch.nn.functional.silu(h[:, :I].clamp(max=limit)) * (h[:, I:].clamp(-limit, limit) + beta)
        out.index_add_(0, t, (a @ w2[e].double().t()) * w[t, k].double()[:, None])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("T,decode", [(700, False), (6, True)])
def test_beta_0_on_the_fast_backend(T, decode):
    """A DeepSeek-V4-style layer (E 32, H 1024, I 352: ragged against the 128 tile, K 4) with
    FC1 outputs large enough that the clamp at 10 triggers, on the 128-row kernels (700 tokens)
    and the swap-AB decode kernels (6 tokens), against float64; gpt-oss's +1 would be far off."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K = 32, 1024, 352, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=2048,
                    activation="clamped_swiglu", **V4)
    g = torch.Generator().manual_seed(zlib.crc32(f"beta0/{T}".encode()))
    x = (torch.randn(T, H, generator=g) * 6.0).to(torch.bfloat16).cuda()
    ids = torch.randn(T, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16).cuda()
    with MoELayer(cfg, EPGroup.single(), backend="sm90_bf16_cutedsl") as layer:
        layer.warmup(progress=False)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.forward(x, ids, w, w13, w2, out=out)
        assert layer._impl._decode == decode
        layer.check_errors()
    want = _oracle_f64(x, ids, w, w13, w2, I, 10.0, beta=0.0)
    assert torch.isfinite(out).all()
    err = float((out.double() - want).norm() / want.norm())
    assert err < 1e-2, err
    h = torch.cat([x[:64].double() @ w13[e].double().t() for e in range(4)])
    assert (h[:, :I] > 10.0).any() and (h[:, I:].abs() > 10.0).any(), "the clamp should trigger"
    plus_one = _oracle_f64(x, ids, w, w13, w2, I, 10.0, beta=1.0)  # gpt-oss's +1
    assert float((out.double() - plus_one).norm() / plus_one.norm()) > 0.1


# ---- FP8 (drop v100): clamped_swiglu in the FP8 block-scaled FC1 ------------------------------


def _clamped_f64(h, I, limit, beta, alpha=1.0):
    g, u = h[:, :I].clamp(max=limit), h[:, I:].clamp(-limit, limit)
    return (u + beta) * g * torch.sigmoid(alpha * g)


def _fp8_problem(E, H, I, K, T, seed, device, x_scale):
    from moe_ep.api.quant import quantize_fp8_block128

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * x_scale).to(torch.bfloat16).to(device)
    ids = torch.randn(T, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(device)
    w13 = quantize_fp8_block128((torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(device))
    w2 = quantize_fp8_block128((torch.randn(E, H, I, generator=g) * I ** -0.5).to(device))
    return x, ids, w, w13, w2


def _fp8_oracle_f64(x, ids, w, w13, w2, I, limit, beta):
    """The quantised model in float64 by its definition: x quantised per 128 values of a row, the
    dequantised weights, the clamped activation written in bf16 and quantised the same way, router
    weights in k order."""
    from moe_ep.api.quant import dequantize_fp8_block128, dequantize_fp8_rows128, quantize_fp8_rows128

    d13, d2 = dequantize_fp8_block128(w13).double(), dequantize_fp8_block128(w2).double()
    xq = dequantize_fp8_rows128(*quantize_fp8_rows128(x.float())).double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    clamped = 0
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        h = xq[t] @ d13[e].T
        clamped += int((h[:, :I] > limit).sum())
        a = _clamped_f64(h, I, limit, beta).to(torch.bfloat16).float()
        aq = dequantize_fp8_rows128(*quantize_fp8_rows128(a)).double()
        out.index_add_(0, t, (aq @ d2[e].T) * w[t, k].double()[:, None])
    return out, clamped


def test_fp8_backend_takes_clamped_swiglu_and_keys_its_constants():
    """The FP8 backend accepts clamped_swiglu (still refuses squared_relu); FC1's compile key holds
    alpha / limit / beta and the gated schedule (wide gate+up WGMMA), not swiglu's tanh sigmoid."""
    from moe_ep.api import EPGroup
    from moe_ep.backends import UnsupportedBackendError
    from moe_ep.backends.sm90.fp8_cutedsl import check_config
    from moe_ep.shim.drops.sm90_megamoe_fp8 import _gemm_key

    dims = dict(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=256, quant="fp8_block128")
    check_config(MoEConfig(activation="clamped_swiglu", **V4, **dims), EPGroup.single())
    with pytest.raises(UnsupportedBackendError, match="squared_relu"):
        check_config(MoEConfig(activation="squared_relu", **dims), EPGroup.single())
    k0 = _gemm_key("clamped_swiglu", 1024, 1024, 32, False, swiglu=(1.0, 10.0, 0.0))
    k1 = _gemm_key("clamped_swiglu", 1024, 1024, 32, False, swiglu=(1.0, 10.0, 1.0))
    assert (k0.swiglu_alpha, k0.swiglu_limit, k0.swiglu_beta) == (1.0, 10.0, 0.0) and k0 != k1
    assert k0.wide_gated and not k0.tanh_sigmoid
    plain = _gemm_key("swiglu", 1024, 1024, 32, False, swiglu=(1.0, 10.0, 0.0))  # ignored for swiglu
    assert (plain.swiglu_alpha, plain.swiglu_limit, plain.swiglu_beta) == (0.0, 0.0, 0.0) and plain.tanh_sigmoid


@pytest.mark.parametrize("kw", [{}, dict(overlap_promotion=True, wide_gated=True)], ids=["plain", "overlap_wide"])
def test_fp8_fc1_compiles_with_beta_0(kw):
    fr = _drop("fp8_runner")
    ptx = {}
    for beta in (0.0, 1.0):
        kern, compiled = fr.compile_variant("clamped_swiglu", 1536, 2048, 128, False, swiglu=(1.0, 10.0, beta), **kw)
        assert (kern.swiglu_alpha, kern.swiglu_limit, kern.swiglu_beta) == (1.0, 10.0, beta)
        ptx[beta] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[beta] and "e4m3" in ptx[beta] and "min.f32" in ptx[beta]
        assert _no_spills(ptx[beta])
    assert ptx[0.0] != ptx[1.0]


def test_fp8_reference_backend_clamped_beta_0_against_float64():
    """The reference backend's FP8 layer with DeepSeek-V4's activation, on the CPU, against the
    quantised model in float64; gpt-oss's +1 would be far off."""
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K, T = 8, 256, 256, 2, 48
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64, quant="fp8_block128",
                    activation="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=2.0, swiglu_beta=0.0)
    x, ids, w, w13, w2 = _fp8_problem(E, H, I, K, T, seed=3, device="cpu", x_scale=2.0)
    want, clamped = _fp8_oracle_f64(x, ids, w, w13, w2, I, 2.0, 0.0)
    assert clamped > 0
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-2, err
    other, _ = _fp8_oracle_f64(x, ids, w, w13, w2, I, 2.0, 1.0)
    assert float((got.double() - other).norm() / other.norm()) > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("T,beta", [(700, 0.0), (700, 1.0), (6, 0.0)])
def test_fp8_clamped_on_the_fast_backend(T, beta):
    """A DeepSeek-V4-style FP8 layer (E 32, H 1024, I 512, K 4; limit 10 with FC1 outputs large
    enough that it triggers) on sm90_fp8_cutedsl against the quantised model in float64; beta 1
    (gpt-oss's form) too."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K = 32, 1024, 512, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=1024, quant="fp8_block128",
                    activation="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=beta)
    x, ids, w, w13, w2 = _fp8_problem(E, H, I, K, T, seed=zlib.crc32(f"fp8/{T}/{beta}".encode()), device="cuda",
                                      x_scale=6.0)
    with MoELayer(cfg, EPGroup.single(), backend="sm90_fp8_cutedsl") as layer:
        layer.warmup(progress=False)
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.forward(x, ids, w, w13, w2, out=out)
        layer.check_errors()
    want, clamped = _fp8_oracle_f64(x, ids, w, w13, w2, I, 10.0, beta)
    assert clamped > 0 and torch.isfinite(out).all()
    err = float((out.double() - want).norm() / want.norm())
    # FC2's input is re-quantised to e4m3: one token's rows average little (see test_fp8_backend)
    assert err < (1e-2 if T >= 64 else 3e-2), err
    other, _ = _fp8_oracle_f64(x, ids, w, w13, w2, I, 10.0, 1.0 - beta)
    assert float((out.double() - other).norm() / other.norm()) > 0.05
