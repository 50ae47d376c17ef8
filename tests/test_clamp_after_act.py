"""clamped_swiglu with the gate clamped after the activation (drop v102; ``swiglu_limit_after_act``):
``(clamp(u, -limit, limit) + beta) * min(g * sigmoid(alpha * g), limit)``. Step-3.7 and Bailing
(transformers' ``limit_after_act``) run it with alpha 1 and beta 0; the clamp-before form
(gpt-oss, DeepSeek-V4) is the default.

CPU: every SM90 kernel that runs clamped_swiglu (the BF16 128-row GEMM, the swap-AB decode GEMM, the
FP8 FC1 plain and overlapped-wide) compiles for sm_90a with the flag, without spills, and the flag
changes its PTX; MoEConfig validates it; the layer's specs and both shims' keys carry it; the
reference backend (BF16 and FP8) against float64 written from Step-3.7's definition.
GPU: ``sm90_bf16_cutedsl`` (prefill and decode kernels) and ``sm90_fp8_cutedsl`` against float64; the
clamp-before form would be off. (The transformers models: tests/test_transformers_layouts.py.)"""

import zlib

import pytest
import torch

from moe_ep.api import MoEConfig

from moe_oracle import activation_problem, fast_layer_forward, gated_moe_f64, rel_err, require_sm90
from moe_oracle import sm90_drop_module as _drop

STEP = dict(swiglu_alpha=1.0, swiglu_limit=7.0, swiglu_beta=0.0, swiglu_limit_after_act=True)  # Step-3.7's


def _no_spills(ptx):
    return "ld.local" not in ptx and "st.local" not in ptx


def _step_f64(h, I, limit, beta=0.0, after_act=True):
    """Step-3.7's ``Step3p7Experts._apply_gate`` in float64 (``act_fn(gate).clamp(max=limit) *
    up.clamp(-limit, limit)``), plus ``beta`` on the clamped up; ``after_act=False``: the clamp before
    the SiLU (DeepSeek-V4's), to show the two differ."""
    g, u = h[:, :I].double(), h[:, I:].double().clamp(-limit, limit) + beta
    if after_act:
        return torch.nn.functional.silu(g).clamp(max=limit) * u
    return torch.nn.functional.silu(g.clamp(max=limit)) * u


# ---- CPU: compile, validation, keys ---------------------------------------------------------


def test_128_row_gemm_compiles_with_the_clamp_after(tmp_path):
    cc = _drop("compile_check")
    ptx = {}
    for after in (False, True):
        compiled = cc.compile_for_arch("clamped_swiglu", 5760, 2880, False, bias_dtype="float32", raster_m=8,
                                       swiglu_alpha=1.0, swiglu_limit=7.0, swiglu_beta=0.0,
                                       swiglu_limit_after_act=after, extra_options=f"--dump-dir={tmp_path}")
        ptx[after] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[after] and "min.f32" in ptx[after] and _no_spills(ptx[after])
    assert ptx[False] != ptx[True]  # the clamp order is compiled in


def test_swapab_gemm_compiles_with_the_clamp_after():
    sr = _drop("swapab_runner")
    ptx = {}
    for after in (False, True):
        kern, compiled = sr.compile_swapab("clamped_swiglu", 2 * 2048, 4096, 32, False, 16,
                                           **STEP | {"swiglu_limit_after_act": after})
        assert kern.swiglu_limit_after_act == after
        ptx[after] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[after] and "min.f32" in ptx[after] and _no_spills(ptx[after])
    assert ptx[False] != ptx[True]


@pytest.mark.parametrize("kw", [{}, dict(overlap_promotion=True, wide_gated=True)], ids=["plain", "overlap_wide"])
def test_fp8_fc1_compiles_with_the_clamp_after(kw):
    fr = _drop("fp8_runner")
    ptx = {}
    for after in (False, True):
        kern, compiled = fr.compile_variant("clamped_swiglu", 1536, 2048, 128, False,
                                            swiglu=(1.0, 7.0, 0.0, after), **kw)
        assert kern.swiglu_limit_after_act == after
        ptx[after] = compiled.__ptx__
        assert "wgmma.mma_async" in ptx[after] and "e4m3" in ptx[after] and _no_spills(ptx[after])
    assert ptx[False] != ptx[True]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_config_refuses_a_non_bool(value):
    with pytest.raises(TypeError, match="MoEConfig.swiglu_limit_after_act must be a bool"):
        MoEConfig(num_experts=8, hidden=256, intermediate=256, top_k=2, max_tokens_per_rank=64,
                  activation="clamped_swiglu", swiglu_limit_after_act=value)


def test_the_layer_and_both_shims_key_the_clamp_order():
    """Every FC1 spec of such a layer (the decode FC1 too) carries the flag, and the BF16 and FP8
    compile keys differ by it; for other activations it is not passed / zeroed."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.shim.drops.sm90_megamoe import GemmKey
    from moe_ep.shim.drops.sm90_megamoe_fp8 import _gemm_key

    cfg = MoEConfig(num_experts=32, hidden=1024, intermediate=512, top_k=4, max_tokens_per_rank=4096,
                    activation="clamped_swiglu", **STEP)
    specs = _gemm_specs(cfg, 32)
    for name in ("fc1", "fc1_decode"):
        assert specs[name]["swiglu_limit_after_act"] is True
    assert "swiglu_limit_after_act" not in specs["fc2"]
    assert GemmKey.__dataclass_fields__["swiglu_limit_after_act"].default is False
    after = _gemm_key("clamped_swiglu", 1024, 1024, 32, False, swiglu=(1.0, 7.0, 0.0, True))
    before = _gemm_key("clamped_swiglu", 1024, 1024, 32, False, swiglu=(1.0, 7.0, 0.0))
    assert after.swiglu_limit_after_act and not before.swiglu_limit_after_act and after != before
    plain = _gemm_key("swiglu", 1024, 1024, 32, False, swiglu=(1.0, 7.0, 0.0, True))
    assert not plain.swiglu_limit_after_act


def test_drop_reference_is_the_definition():
    """The drop's torch reference (its runners check the kernels against it) against Step-3.7's
    definition in float64."""
    ref = _drop("reference")
    g = torch.Generator().manual_seed(5)
    h = torch.randn(300, 64, generator=g) * 6
    got = ref.clamped_swiglu_reference(h[:, :32], h[:, 32:], 1.0, 7.0, 0.0, after_act=True)
    assert torch.allclose(got.double(), _step_f64(h, 32, 7.0), rtol=1e-5, atol=1e-5)
    before = ref.clamped_swiglu_reference(h[:, :32], h[:, 32:], 1.0, 7.0, 0.0)
    assert torch.allclose(before.double(), _step_f64(h, 32, 7.0, after_act=False), rtol=1e-5, atol=1e-5)


def _oracle_f64(x, ids, w, w13, w2, I, limit, after_act=True, fp8=False):
    """Step-3.7's experts in float64 (``fp8``: the quantised model)."""
    return gated_moe_f64(x, ids, w, w13, w2, lambda h: _step_f64(h, I, limit, after_act=after_act), fp8=fp8)


def _gates_past(x, w13, I, limit):
    """How many of the gates of the first 64 tokens through the first four experts pass ``limit``
    after the SiLU (where the two clamp orders differ)."""
    h = torch.cat([x[:64].double() @ w13[e].double().t() for e in range(4)])
    return int((torch.nn.functional.silu(h[:, :I]) > limit).sum())


def test_reference_backend_against_float64():
    """The reference backend's BF16 layer, on the CPU, against Step-3.7's experts in float64; the
    clamp-before form is off."""
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K, T = 8, 128, 96, 2, 40
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64,
                    activation="clamped_swiglu", **STEP | {"swiglu_limit": 2.0})
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, 7, "cpu", x_scale=3.0)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    assert _gates_past(x, w13, I, 2.0) > 0.05 * min(T, 64) * 4 * I
    want = _oracle_f64(x, ids, w, w13, w2, I, 2.0)
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I, 2.0, after_act=False)) > 0.05


def test_fp8_reference_backend_against_float64():
    from moe_ep.api import EPGroup, MoELayer

    E, H, I, K, T = 8, 256, 256, 2, 48
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64, quant="fp8_block128",
                    activation="clamped_swiglu", **STEP | {"swiglu_limit": 2.0})
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, 3, "cpu", x_scale=3.0, fp8=True)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2)
    want = _oracle_f64(x, ids, w, w13, w2, I, 2.0, fp8=True)
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    assert rel_err(got, _oracle_f64(x, ids, w, w13, w2, I, 2.0, after_act=False, fp8=True)) > 0.05


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T,decode", [(700, False), (6, True)])
def test_clamp_after_on_the_bf16_backend(T, decode):
    """A Step-3.7-style layer (E 32, H 1024, I 352: ragged against the 128 tile, K 4; limit 2, below
    Step-3.7's 7, where the clamp-before form would be as good as identical: ``7 * sigmoid(7)`` is
    within 0.1% of 7) on the 128-row kernels (700 tokens) and the swap-AB decode kernels (6 tokens),
    against float64; the clamp-before form is off."""
    require_sm90()
    E, H, I, K = 32, 1024, 352, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=2048,
                    activation="clamped_swiglu", **STEP | {"swiglu_limit": 2.0})
    seed = zlib.crc32(f"after/{T}".encode())
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, seed, "cuda", x_scale=3.0)
    out, ran_decode = fast_layer_forward(cfg, "sm90_bf16_cutedsl", x, ids, w, w13, w2)
    assert ran_decode == decode and torch.isfinite(out).all() and _gates_past(x, w13, I, 2.0) > 0
    want = _oracle_f64(x, ids, w, w13, w2, I, 2.0)
    assert rel_err(out, want) < 1e-2, rel_err(out, want)
    assert rel_err(out, _oracle_f64(x, ids, w, w13, w2, I, 2.0, after_act=False)) > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 6])
def test_clamp_after_on_the_fp8_backend(T):
    """The same (limit 2) on sm90_fp8_cutedsl (I 512), against the quantised model in float64."""
    require_sm90()
    E, H, I, K = 32, 1024, 512, 4
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=1024, quant="fp8_block128",
                    activation="clamped_swiglu", **STEP | {"swiglu_limit": 2.0})
    seed = zlib.crc32(f"fp8after/{T}".encode())
    x, ids, w, w13, w2 = activation_problem(E, H, I, K, T, seed, "cuda", x_scale=3.0, fp8=True)
    out, _ = fast_layer_forward(cfg, "sm90_fp8_cutedsl", x, ids, w, w13, w2)
    assert torch.isfinite(out).all()
    want = _oracle_f64(x, ids, w, w13, w2, I, 2.0, fp8=True)
    # FC2's input is re-quantised to e4m3: one token's rows average little (see test_fp8_backend)
    assert rel_err(out, want) < (1e-2 if T >= 64 else 3e-2), rel_err(out, want)
    assert rel_err(out, _oracle_f64(x, ids, w, w13, w2, I, 2.0, after_act=False, fp8=True)) > 0.05
