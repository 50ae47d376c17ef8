"""Drop v72: the BF16 grouped GEMM in clusters of 2 CTAs along N (``cluster_n=2``; non-gated, the
cooperative and pingpong schedules): the two CTAs of a cluster compute an n-tile pair of one m-tile
(the second past N when the n-tile count is odd: computed, never stored) and each loads half of the
A tile by a multicast TMA into both. CPU: the PTX (multicast on A's loads only, the cluster
barrier), no spills, the refusals, the shim's opt-in switch. GPU (not yet run): the same bits as
single CTAs, every element written, the float64 reference, and the layer with
``MOE_EP_BF16_CLUSTER_N=1`` against ``0`` (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe.grouped_gemm import GroupedGemmSm90  # noqa: E402
from moe_oracle import require_sm90  # noqa: E402


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("n,k,kw", [
    (2048, 768, dict(schedule="pingpong", tile_n=192, scale_rows=True)),   # Qwen3 FC2: 11 n-tiles (odd)
    (2048, 768, dict(schedule="cooperative", tile_n=256, scale_rows=True)),  # 8 n-tiles
    (2880, 2880, dict(schedule="pingpong", tile_n=192, scale_rows=True)),  # gpt-oss FC2 (15 n-tiles)
])
def test_cluster_n_ptx_multicasts_the_tokens_only(n, k, kw):
    """(With a bias, pingpong 128 x 192 spills 272-312 bytes with or without clusters: the bias
    values of a thread's 48 columns on top of its 192 accumulators.)"""
    import cutlass.cute as cute
    from sm90_megamoe.compile_check import fake_args
    from sm90_megamoe.layout_compile_check import ptxas_info

    kernel = GroupedGemmSm90("identity", cluster_n=2, raster_m=16, **kw)
    ptx = cute.compile(kernel, *fake_args(kernel, 128, n, k), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[^;]*;", ptx)
    a_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.2d")]  # A [M, K]
    b_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.3d")]  # B [E, N, K] as (N, K, E)
    assert a_loads and all("multicast::cluster" in x for x in a_loads), a_loads
    assert b_loads and not any("multicast" in x for x in b_loads), b_loads
    assert "mbarrier.arrive.shared::cluster" in ptx and "barrier.cluster.wait" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    info = ptxas_info(ptx, "sm_90a")
    if info is not None:
        assert info[1] == 0, info  # no spills


def test_cluster_n_refusals():
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="cluster_n must be 1 or 2"):
        GroupedGemmSm90("identity", cluster_n=4)
    for kw in (dict(activation="swiglu"), dict(activation="identity", cluster_m=2)):
        with pytest.raises(ValueError, match="cluster_n = 2 is for the non-gated"):
            GroupedGemmSm90(cluster_n=2, **kw)
    with pytest.raises(ValueError, match="cluster_n = 2 is for the non-gated"):
        GroupedGemmGatherSm90("identity", cluster_n=2)
    with pytest.raises(ValueError, match="cluster_n = 2 does not combine with gather_a"):
        CompiledGroupedGemm("identity", 2048, 768, 8, True, gather_a=True, cluster_n=2)
    with pytest.raises(ValueError, match="not schedule='swapab'"):
        CompiledGroupedGemm("identity", 2048, 768, 8, True, schedule="swapab", cluster_n=2)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_BF16_CLUSTER_N", raising=False)
    assert s.use_bf16_cluster_n("pingpong", gated=False) == 1  # opt-in
    monkeypatch.setenv("MOE_EP_BF16_CLUSTER_N", "1")
    assert s.use_bf16_cluster_n("pingpong", gated=False) == s.use_bf16_cluster_n("cooperative", gated=False) == 2
    assert s.use_bf16_cluster_n("cooperative", gated=True) == 1  # FC1 keeps single CTAs
    assert s.use_bf16_cluster_n("swapab", gated=False) == s.use_bf16_cluster_n("wide", gated=False) == 1
    assert s.use_bf16_cluster_n("cooperative", gated=False, gather_a=True) == 1
    assert s.GemmKey.__dataclass_fields__["cluster_n"].default == 1


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("n,k,kw,m_total", [
    (2048, 768, dict(schedule="pingpong", tile_n=192), 5000),     # Qwen3 FC2: odd n-tile count
    (2048, 768, dict(schedule="cooperative", tile_n=256), 5000),  # even n-tile count
    (2880, 2880, dict(schedule="pingpong", tile_n=192, bias=torch.float32), 2000),  # gpt-oss, a bias
    (1024, 1024, dict(schedule="pingpong", tile_n=192), 1),       # one row
])
def test_gpu_cluster_n_is_bit_identical(n, k, kw, m_total, routing):
    """Clusters along N give the single-CTA kernel's bits (the same WGMMAs per tile; only where A's
    bytes come from differs), every element written (NaN-poisoned output; the odd count's last
    pair writes nothing past N), and agree with a float64 computation."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem, kernel_once, variants_same_bits
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E = 16
    a, b, offs, rs, bias = bf16_gemm_problem(m_total, n, k, E, routing, 700 + m_total + n, True, kw.get("bias"))
    fns = [kernel_once(CompiledGroupedGemm, "identity", n, k, E, True, tile_n=kw["tile_n"], schedule=kw["schedule"],
                       raster_m=16, cluster_n=c, bias_dtype=None if bias is None else "float32")
           for c in (1, 2)]
    got = variants_same_bits(fns, a, b, offs, n, row_scale=rs, bias=bias)
    want = grouped_gemm_reference(a.double(), b.double(), offs, "identity", rs.double(),
                                  bias=None if bias is None else bias.double()).double()
    assert float((got.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_gpu_layer_with_cluster_n_is_bit_identical(monkeypatch, T):
    """MOE_EP_BF16_CLUSTER_N=1 (Qwen3's FC2 on pingpong 128 x 192 in clusters along N) gives the
    layer's default bits, eager and replayed from a poisoned CUDA graph; FC1 stays single-CTA."""
    require_sm90()
    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    from moe_oracle import layer_outputs_with_switch, make_problem

    from moe_ep.api import MoEConfig

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=4096)
    x, ids, w, w13, w2 = (t.cuda() for t in make_problem(E, H, I, K, T, seed=2300 + T))

    def check(impl, on):
        assert impl.fc2.compiled.cluster_n == (2 if on else 1) and impl.fc2.compiled.schedule == "pingpong"
        assert impl.fc1.compiled.cluster_n == 1

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_BF16_CLUSTER_N", cfg, "sm90_bf16_cutedsl",
                                     (x, ids, w, w13, w2), check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
