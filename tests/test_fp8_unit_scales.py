"""Drop v69: the FP8 grouped GEMM's scales loaded by TMA, 8 k-tiles per copy, into double-buffered
shared memory (``unit_scales``). CPU: the layer schedules compile with the scale copies and no
per-k-tile global scale loads, no pipeline stage lost, no spills; the refusals; the shim's switch
and keys. GPU: the same bits as the schedule the layer runs without it (uniform / skewed routing,
edge row counts, NaN-poisoned outputs, two launches in a row), and the FP8 layer with it on."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import (fp8_gemm_problem, fp8_layer_inputs, fp8_variants_same_bits,  # noqa: E402
                         kernel_once, layer_outputs_with_switch)

# (activation, N, K, E, the layer's schedule without unit_scales): Qwen3's FC1 (16 k-tiles, unrolled),
# Mixtral's FC1 (32, unrolled), an FC2 on the chunked schedule (48 k-tiles: chunks of 16), a
# DeepSeek-V3-shaped FC1 (K 7168, 56 k-tiles: chunks of 14 without unit_scales, of 8 with them; drop v105)
# and an Inkling2-shaped FC1 (K 4608, 36 k-tiles in chunks of 12: scales 4 k-tiles per copy; drop v106)
SHAPES = [
    ("swiglu", 1536, 2048, 128, dict(wide_gated=True, cluster_n=2, smem_scales=True, tanh_sigmoid=True)),
    ("swiglu", 28672, 4096, 8, dict(wide_gated=True, cluster_n=2, tanh_sigmoid=True)),
    ("identity", 1024, 6144, 8, dict(cluster_n=2, smem_scales=True, scale_warp=True)),
    ("swiglu", 1024, 7168, 8, dict(wide_gated=True, cluster_n=2, tanh_sigmoid=True)),
    ("swiglu", 1024, 4608, 8, dict(wide_gated=True, cluster_n=2, tanh_sigmoid=True)),
]
#: per SHAPES row (by K): the chunk it runs with unit_scales (0: the whole k-loop unrolled), without
#: them, and the k-tiles whose scales one copy loads
CHUNKS = {2048: (0, 0, 8), 4096: (0, 0, 8), 6144: (16, 16, 8), 7168: (8, 14, 8), 4608: (12, 12, 4)}


def _kernel(act, n, k, experts, kw, unit_scales):
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90

    if unit_scales:
        kw = {key: v for key, v in kw.items() if key not in ("smem_scales", "scale_warp")}
    return Fp8BlockScaledGroupedGemmSm90(act, scale_rows=act == "identity", raster_m=16, overlap_promotion=True,
                                         unit_scales=unit_scales, **kw)


def _compile(act, n, k, experts, kw, unit_scales):
    import cutlass.cute as cute
    from sm90_megamoe.fp8_runner import fake_args

    kernel = _kernel(act, n, k, experts, kw, unit_scales)
    return kernel, cute.compile(kernel, *fake_args(experts, n, k, act), options="--gpu-arch sm_90a --keep-ptx")


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
def test_unit_scales_ptx(act, n, k, experts, kw):
    from sm90_megamoe.fp8_runner import ptx_report

    kernel, compiled = _compile(act, n, k, experts, kw, True)
    base_kernel, _ = _compile(act, n, k, experts, kw, False)
    ptx = compiled.__ptx__
    k_tiles = k // 128
    # per chunk of 8 k-tiles: one 2-D copy of the A scales (to this CTA only) and a 3-D one per
    # weight block; the operands' copies are unchanged (A multicast in the cluster, B 3-D)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", ptx)) > 0
    # the consumers read 4 scales per k-tile from shared memory (the unrolled or chunked k-loop's
    # traced k-tiles), and load none from global memory (a handful of scheduler / row-scale loads remain)
    assert (kernel.overlap_chunk, base_kernel.overlap_chunk, kernel.unit_kc) == CHUNKS[k]
    traced = kernel.overlap_chunk or k_tiles
    assert len(re.findall(r"ld\.shared\.b32", ptx)) >= (4 if act == "swiglu" else 3) * traced
    assert len(re.findall(r"ld\.global", ptx)) < traced
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"], r
    assert kernel.num_stages == base_kernel.num_stages  # the chunk buffers fit beside the stages
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


def test_unit_scales_refusals():
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm
    from sm90_megamoe.unit_scales import unit_scales_reason

    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90

    with pytest.raises(ValueError, match="needs overlap_promotion"):  # not with the staged scales
        Fp8BlockScaledGroupedGemmSm90("identity", overlap_promotion=True, smem_scales=True, unit_scales=True)
    with pytest.raises(ValueError, match="needs overlap_promotion"):
        CompiledFp8Gemm("identity", 1024, 6144, 8, unit_scales=True)  # the plain schedule
    with pytest.raises(ValueError, match="unit_scales needs overlap_promotion and refuses smem_scales"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, overlap_promotion=True, smem_scales=True, unit_scales=True)
    assert "K/128 = 6 must be a multiple of 4" in unit_scales_reason(6, 0)  # Qwen3's FC2 (K 768)
    assert "chunk (10 k-tiles)" in unit_scales_reason(40, 10)
    assert unit_scales_reason(112, 16) is None and unit_scales_reason(16, 0) is None
    assert unit_scales_reason(36, 12) is None and "multiple of 4" in unit_scales_reason(36, 18)  # drop v106
    with pytest.raises(Exception, match="multiple of 4"):  # raised while tracing, before any launch
        _compile("identity", 2048, 768, 128, dict(cluster_n=2), True)
    # Inkling2's FC2 (K 2304: 18 k-tiles; its scale rows' 72-byte stride is no TMA stride)
    with pytest.raises(Exception, match="K/128 = 18 must be a multiple of 4"):
        _compile("identity", 1024, 2304, 8, dict(cluster_n=2), True)


def test_shim_switch_and_keys(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    for var in ("MOE_EP_FP8_UNIT_SCALES", "MOE_EP_FP8_DEFERRED_EPILOGUE") + s._STAGED_SCALE_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    mixtral_fc1 = lambda: s._key("gemm", "swiglu", 28672, 4096, 8, False, overlap_promotion=True)  # noqa: E731
    mixtral_fc2 = lambda: s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=True)  # noqa: E731
    qwen_fc1 = lambda: s._key("gemm", "swiglu", 1536, 2048, 128, False, overlap_promotion=True)  # noqa: E731
    qwen_fc2 = lambda: s._key("gemm", "identity", 2048, 768, 128, True, overlap_promotion=True)  # noqa: E731
    # default ("auto"): from K 4096, in place of the staged / global scales; clusters unchanged
    for key in (mixtral_fc1(), mixtral_fc2()):
        assert key.unit_scales and not key.smem_scales and not key.scale_warp and key.cluster_n == 2
        assert s._gemm_options(key)["unit_scales"] is True
    assert not qwen_fc1().unit_scales and qwen_fc1().smem_scales and qwen_fc1().cluster_n == 2
    assert not qwen_fc2().unit_scales and qwen_fc2().smem_scales
    # never on the plain schedule, the gathering FC1 or a quantiser
    assert not s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=False).unit_scales
    assert not s._key("quantize", "", 0, 4096, 0, False).unit_scales
    # "auto" (fifty-first session): from K 4096 wherever the kernel can -- DeepSeek-V3's FC1 (K 7168,
    # chunks of 8 k-tiles, 14 without), K 5120 (8, 10 without) and Inkling2's FC1 (K 4608: 4 k-tiles'
    # scales per copy); below K 4096 never, and K/128 not a multiple of 4 cannot take them
    assert s.use_fp8_unit_scales(7168) and s.use_fp8_unit_scales(5120) and s.use_fp8_unit_scales(4608)
    assert not s.use_fp8_unit_scales(768) and not s.use_fp8_unit_scales(2048)
    assert not s.use_fp8_unit_scales(4096 + 2 * 128)  # 34 k-tiles
    dsv3_fc1 = s._key("gemm", "swiglu", 4096, 7168, 32, False, overlap_promotion=True)
    assert dsv3_fc1.unit_scales and not dsv3_fc1.smem_scales and dsv3_fc1.cluster_n == 2
    # Inkling2's FC2 (K 2304, 18 k-tiles) cannot: it stages its scales (non-gated: at every K)
    ink_fc2 = s._key("gemm", "identity", 4608, 2304, 48, True, overlap_promotion=True)
    assert not ink_fc2.unit_scales and ink_fc2.smem_scales and not ink_fc2.scale_warp and ink_fc2.cluster_n == 2
    assert (s.fp8_overlap_chunk(7168), s.fp8_overlap_chunk(7168, unit_scales=True)) == (14, 8)
    assert [s.fp8_unit_scale_kc(k) for k in (4096, 7168, 4608, 2304, 768)] == [8, 8, 4, 0, 0]
    assert s.fp8_overlap_chunk(4608, unit_scales=True) == 12
    # "1": wherever the kernel can (Qwen3's FC1 too, not its FC2; DeepSeek-V3's FC1 in chunks of 8,
    # drop v105; Inkling2's FC1, v106, not its FC2); "0": never
    monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", "1")
    assert qwen_fc1().unit_scales and not qwen_fc1().smem_scales and not qwen_fc2().unit_scales
    assert s.use_fp8_unit_scales(7168) and s.use_fp8_unit_scales(5120) and s.use_fp8_unit_scales(4608)
    assert not s.use_fp8_unit_scales(2304)
    dsv3_fc1 = s._key("gemm", "swiglu", 4096, 7168, 32, False, overlap_promotion=True)
    assert dsv3_fc1.unit_scales and dsv3_fc1.overlap_promotion and dsv3_fc1.cluster_n == 2
    monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", "0")
    assert not mixtral_fc2().unit_scales and mixtral_fc2().smem_scales and mixtral_fc2().scale_warp
    assert not mixtral_fc1().unit_scales and not mixtral_fc1().smem_scales
    # not with the deferred epilogue (K <= 1024 by default; forced on, Mixtral's FC1 keeps global scales)
    monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", "1")
    assert not s._key("gemm", "identity", 2048, 1024, 128, True, overlap_promotion=True).unit_scales
    monkeypatch.setenv("MOE_EP_FP8_DEFERRED_EPILOGUE", "1")
    assert mixtral_fc1().deferred_epilogue and not mixtral_fc1().unit_scales
    monkeypatch.delenv("MOE_EP_FP8_DEFERRED_EPILOGUE")
    # "auto" leaves the scales to an explicitly set staged-scale switch
    monkeypatch.delenv("MOE_EP_FP8_UNIT_SCALES")
    assert mixtral_fc1().unit_scales
    monkeypatch.setenv("MOE_EP_FP8_SCALE_WARP", "1")
    assert not mixtral_fc2().unit_scales and mixtral_fc2().scale_warp
    monkeypatch.delenv("MOE_EP_FP8_SCALE_WARP")
    for bad in ("yes", "2", "on"):
        monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", bad)
        with pytest.raises(ValueError, match="MOE_EP_FP8_UNIT_SCALES"):
            mixtral_fc1()


# ---------------------------------------------------------------------------- GPU
def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
@pytest.mark.parametrize("m,routing", [(1, "uniform"), (37, "skewed"), (700, "uniform"), (3000, "skewed")])
def test_unit_scales_bit_identical(act, n, k, experts, kw, m, routing):
    """The same bits as the layer's schedule without it; every row written (NaN-poisoned); twice in a
    row (the chunk barriers' phases carry over between launches)."""
    _needs_sm90()
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    sr = act == "identity"
    base = kernel_once(CompiledFp8Gemm, act, n, k, experts, sr, raster_m=16, overlap_promotion=True, **kw)
    unit_kw = {key: v for key, v in kw.items() if key not in ("smem_scales", "scale_warp")}
    unit = kernel_once(CompiledFp8Gemm, act, n, k, experts, sr, raster_m=16, overlap_promotion=True,
                       unit_scales=True, **unit_kw)
    fp8_variants_same_bits([base, unit], fp8_gemm_problem(m, n, k, experts, routing, 300 + m, sr), act)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 700])
@pytest.mark.parametrize("shape,values,fc1_on,fc2_on", [
    # a Mixtral-like layer whose FC2 (K 6144, chunked) takes it by default; "0" turns it off
    (dict(num_experts=8, hidden=1024, intermediate=6144, top_k=2), ("0", "auto"), False, True),
    # Qwen3's: only FC1 can (K 2048), and only when forced
    (dict(num_experts=128, hidden=2048, intermediate=768, top_k=8), ("0", "1"), True, False),
    # an Inkling2-like layer (fifty-first session): FC1 (K 4608, 4 k-tiles' scales per copy) takes it
    # by default, its FC2 (K 2304) cannot
    (dict(num_experts=8, hidden=4608, intermediate=2304, top_k=2), ("0", "auto"), True, False),
])
def test_layer_with_unit_scales_is_bit_identical(monkeypatch, T, shape, values, fc1_on, fc2_on):
    """The FP8 layer with and without unit_scales: the same bits, eager and under a CUDA graph."""
    _needs_sm90()
    from moe_ep.api import MoEConfig

    for var in ("MOE_EP_FP8_SMEM_SCALES", "MOE_EP_FP8_SCALE_WARP"):
        monkeypatch.delenv(var, raising=False)
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **shape)

    def check(impl, on):
        assert impl.fc1.unit_scales == (on and fc1_on) and impl.fc2.unit_scales == (on and fc2_on)

    inputs = fp8_layer_inputs(shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"], T, 41 + T)
    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FP8_UNIT_SCALES", cfg, "sm90_fp8_cutedsl", inputs, check,
                                     values=values)
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1]).all()
