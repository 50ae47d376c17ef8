"""Drop v108's ``stage_guard``: one pipeline stage fewer where the stage count divides the FP8 GEMM's
unrolled k-loop, the only place ptxas spills on the global- and staged-scale paths (51st session).
CPU: the rule, the spills it removes, the shim's switch and key. GPU (queued): the same bits as
without it, kernel and layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import (fp8_gemm_problem, fp8_layer_inputs, fp8_variants_same_bits,  # noqa: E402
                        kernel_once, layer_outputs_with_switch, require_sm90)

# (activation, N, K, E, kernel options): Inkling2's FC2 (K 2304 = 18 k-tiles, staged scales, 6 stages)
# and a gated FC1 on global scales at K 4608 (chunks of 12 k-tiles)
SHAPES = [
    ("identity", 1024, 2304, 8, dict(cluster_n=2, smem_scales=True)),
    ("swiglu", 1024, 4608, 8, dict(wide_gated=True, cluster_n=2, tanh_sigmoid=True)),
]


def test_guarded_stages_rule():
    from sm90_megamoe.fp8_gemm import guarded_stages

    assert [guarded_stages(6, t) for t in (12, 18, 24, 16, 20, 22, 6, 0)] == [5, 5, 5, 6, 6, 6, 6, 6]
    assert guarded_stages(6, 30) == 4  # 5 divides 30 too
    assert guarded_stages(4, 24) == 4 and guarded_stages(4, 20) == 3  # never below 3
    assert guarded_stages(6, 18, unit_scales=True) == 6  # scales by TMA never spilled


def _spills(act, n, k, experts, kw, stage_guard):
    """(pipeline stages, bytes spilled per thread by ptxas) of the kernel compiled for sm_90a."""
    import cutlass.cute as cute
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_runner import fake_args, ptx_report

    kernel = Fp8BlockScaledGroupedGemmSm90(act, scale_rows=act == "identity", raster_m=16, overlap_promotion=True,
                                           stage_guard=stage_guard, **kw)
    compiled = cute.compile(kernel, *fake_args(experts, n, k, act), options="--gpu-arch sm_90a --keep-ptx")
    r = ptx_report(kernel, compiled)
    if r["ptxas_spill_bytes"] is None:
        pytest.skip("no ptxas installed")
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"], r
    return r["stages"], r["ptxas_spill_bytes"]


@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
def test_stage_guard_removes_the_spills(act, n, k, experts, kw):
    stages, spilled = _spills(act, n, k, experts, kw, False)
    assert stages == 6 and spilled > 0  # what the guard is for (if this changes, re-measure it)
    assert _spills(act, n, k, experts, kw, True) == (5, 0)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_STAGE_GUARD", raising=False)
    fc2 = lambda: s._gemm_key("identity", 4608, 2304, 48, True)  # noqa: E731
    assert not fc2().stage_guard and "stage_guard" not in s._gemm_options(fc2())
    monkeypatch.setenv("MOE_EP_FP8_STAGE_GUARD", "1")
    assert fc2().stage_guard and s._gemm_options(fc2())["stage_guard"] is True
    monkeypatch.setattr(s.disk_cache, "get_or_build", lambda ns, name, key, build, **kw: name)
    assert s.compiled_gemm_of_key(fc2()) == "fp8_gemm_identity_cluster2_sg"  # its own cache entry
    assert not s._key("quantize", "", 0, 4608, 0, False).stage_guard
    monkeypatch.setenv("MOE_EP_FP8_STAGE_GUARD", "yes")
    with pytest.raises(ValueError, match="MOE_EP_FP8_STAGE_GUARD"):
        fc2()


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
@pytest.mark.parametrize("m,routing", [(37, "skewed"), (3000, "skewed"), (2000, "uniform")])
def test_stage_guard_is_bit_identical(act, n, k, experts, kw, m, routing):
    """Pipeline depth changes no sum: the same bits, every row written (NaN-poisoned), twice in a row."""
    require_sm90()
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    sr = act == "identity"
    fns = [kernel_once(CompiledFp8Gemm, act, n, k, experts, sr, raster_m=16, overlap_promotion=True,
                       stage_guard=guard, **kw) for guard in (False, True)]
    fp8_variants_same_bits(fns, fp8_gemm_problem(m, n, k, experts, routing, 500 + m, sr), act)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 700])
def test_layer_with_stage_guard_is_bit_identical(monkeypatch, T):
    """An Inkling2-like FP8 layer (FC2 K 2304 loses a stage, FC1 takes scales by TMA and keeps its own):
    the same bits with the switch off and on, eager and under a CUDA graph."""
    require_sm90()
    from moe_ep.api import MoEConfig

    shape = dict(num_experts=8, hidden=4608, intermediate=2304, top_k=2)
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **shape)

    def check(impl, on):
        assert impl.fc2.stage_guard == on

    inputs = fp8_layer_inputs(8, 4608, 2304, 2, T, 61 + T)
    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FP8_STAGE_GUARD", cfg, "sm90_fp8_cutedsl", inputs, check)
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1]).all()
