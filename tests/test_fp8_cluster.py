"""Drop v28: the plain FP8 grouped GEMM in clusters of 2 CTAs (``cluster_n=2``): the two CTAs of a
cluster compute one m-tile's two adjacent n-tiles and multicast A's halves to each other (drop v49's
clusters of 4 were removed in v84). CPU: the PTX (multicast TMA for A only, the remote stage
release, the cluster barrier), no spills, the refusals, the shim's switch (on from K = 4096). GPU:
the same bits as single CTAs, and float64 agreement."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import fp8_gemm_problem, kernel_once  # noqa: E402
from sm90_megamoe import fp8_reference as ref  # noqa: E402
from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90  # noqa: E402


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,overlap,wide,cluster_n", [
    ("swiglu", 1536, 2048, 128, False, True, 2),    # Qwen3 FC1 (the backend's wide schedule)
    ("identity", 2048, 768, 128, True, False, 2),   # Qwen3 FC2, overlapped promotion
    ("identity", 4096, 14336, 8, False, False, 2),  # Mixtral FC2 (112 k-tiles)
    ("swiglu", 28672, 4096, 8, True, True, 2),      # Mixtral FC1's layer schedule
])
def test_cluster_ptx_multicasts_a_only(act, n, k, experts, overlap, wide, cluster_n):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, experts, act == "identity", raster_m=16,
                                       overlap_promotion=overlap, wide_gated=wide, cluster_n=cluster_n)
    ptx = compiled.__ptx__
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[^;]*;", ptx)
    a_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.2d")]  # A [M, K]; B is 3d [E, N, K]
    b_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.3d")]
    assert a_loads and all("multicast::cluster" in x for x in a_loads), a_loads
    assert b_loads and not any("multicast" in x for x in b_loads), b_loads
    # a stage is released in every CTA of the cluster (remote mbarrier arrive), barriers initialised cluster-wide
    assert re.search(r"mapa\.shared::cluster", ptx) and "mbarrier.arrive.shared::cluster" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "mbarrier_init.release.cluster" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["pdl"] and r["smem_bytes"] <= 227 * 1024
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r
    # the kernel's own copy of the unit count: one unit is the cluster's n-tiles
    n_out = n // 2 if act == "swiglu" else n
    assert kernel.cluster_n == cluster_n and kernel.n_tiles == n_out // kernel.tile_n // cluster_n


def test_single_cta_kernel_has_no_cluster_code():
    from sm90_megamoe.fp8_runner import compile_variant

    _, compiled = compile_variant("identity", 2048, 768, 128, True, raster_m=16)
    ptx = compiled.__ptx__
    assert "multicast" not in ptx and "barrier.cluster" not in ptx and "mapa" not in ptx


def test_cluster_refusals():
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm
    from sm90_megamoe.fp8_runner import compile_variant

    for bad in (4, 8):  # drop v84 removed clusters of 4
        with pytest.raises(ValueError, match="cluster_n must be 1 or 2"):
            Fp8BlockScaledGroupedGemmSm90("identity", cluster_n=bad)
    with pytest.raises(ValueError, match="multiple of 2 n-tiles"):  # N 384: 3 n-tiles of 128
        compile_variant("identity", 384, 256, 4, False, cluster_n=2)
    with pytest.raises(ValueError, match="cluster_n must be 1 or 2"):
        CompiledFp8Gemm("identity", 2048, 768, 8, cluster_n=4)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    # default: clusters from K = 4096 (Mixtral's FC1 and FC2) and where the scales are staged in
    # smem (K <= 2048: Qwen3; the non-gated FC2 at every K since the fifty-first session), single
    # CTAs in between for the gated FC1
    monkeypatch.delenv("MOE_EP_FP8_CLUSTER", raising=False)
    monkeypatch.delenv("MOE_EP_FP8_SMEM_SCALES", raising=False)
    assert s.CLUSTER_MIN_K == 4096 and s.SMEM_SCALES_MAX_K == 2048
    assert s.use_fp8_cluster("swiglu", 28672, 4096) == s.use_fp8_cluster("identity", 4096, 14336) == 2
    assert s.use_fp8_cluster("swiglu", 1536, 2048) == s.use_fp8_cluster("identity", 2048, 768) == 2
    assert s.use_fp8_cluster("swiglu", 2048, 2560) == 1 and s.use_fp8_cluster("identity", 2048, 2560) == 2
    assert s._key("gemm", "swiglu", 1536, 2048, 128, False).cluster_n == 2
    assert s._key("gemm", "identity", 4096, 14336, 8, True).cluster_n == 2
    assert s.use_fp8_cluster("identity", 384, 8192) == 1    # 3 n-tiles: no pairs
    monkeypatch.setenv("MOE_EP_FP8_SMEM_SCALES", "0")      # global scales: single CTAs below 4096
    assert s.use_fp8_cluster("swiglu", 1536, 2048) == s.use_fp8_cluster("identity", 2048, 768) == 1
    assert s._key("gemm", "swiglu", 1536, 2048, 128, False).cluster_n == 1
    monkeypatch.setenv("MOE_EP_FP8_OVERLAP", "0")          # plain schedule: no staged scales, no clusters
    monkeypatch.delenv("MOE_EP_FP8_SMEM_SCALES")
    assert s.use_fp8_cluster("identity", 2048, 768) == 1
    monkeypatch.delenv("MOE_EP_FP8_OVERLAP")
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "1")          # forced on
    assert s.use_fp8_cluster("swiglu", 1536, 2048) == 2     # I 768: 12 n-tiles of 64
    assert s.use_fp8_cluster("identity", 2048, 768) == 2    # 16 n-tiles of 128
    assert s.use_fp8_cluster("identity", 384, 256) == 1
    assert s._key("gemm", "identity", 2048, 768, 128, True).cluster_n == 2
    # the gathering kernel and the quantisers stay single-CTA
    assert s._key("quantize", "", 0, 2048, 0, False).cluster_n == 1
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "0")          # forced off
    assert s.use_fp8_cluster("identity", 4096, 14336) == 1
    # drop v84 removed clusters of 4: the value raises, naming the variable and why
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "4")
    with pytest.raises(ValueError, match="MOE_EP_FP8_CLUSTER='4': drop v84 removed clusters of 4"):
        s.use_fp8_cluster("swiglu", 28672, 4096)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,overlap,wide,m_total", [
    ("swiglu", 1536, 2048, False, True, 5000),   # Qwen3 FC1, wide gate+up
    ("swiglu", 1536, 2048, True, False, 300),    # fewer units than clusters
    ("identity", 2048, 768, True, False, 5000),  # Qwen3 FC2 + router weights
    ("identity", 512, 8192, True, False, 2000),  # chunked overlapped schedule (64 k-tiles)
    ("identity", 1024, 1024, False, False, 1),   # one row
])
def test_gpu_cluster_is_bit_identical(act, n, k, overlap, wide, m_total, routing):
    """Clusters of 2 give the single-CTA kernel's bits (each tile's WGMMAs and promotions are the
    same; only where A's bytes come from differs), every row written (NaN-poisoned output), and
    agree with a float64 computation of the quantised problem."""
    _sm90()
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm, max_active_ctas

    E, sr = 16, act == "identity"
    a, a_s, b, b_s, offs, rs = (None if t is None else t.cuda()
                                for t in fp8_gemm_problem(m_total, n, k, E, routing, 40 + m_total, sr))
    outs = []
    sizes = (1, 2)
    for cluster_n in sizes:
        fn = kernel_once(Fp8GroupedGemm, act, n, k, E, sr, raster_m=16, overlap_promotion=overlap, wide_gated=wide,
                         cluster_n=cluster_n)
        out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, rs))
        outs.append(out)
    torch.cuda.synchronize()
    for cn in sizes[1:]:
        assert max_active_ctas(cn) % cn == 0 and 0 < max_active_ctas(cn) <= max_active_ctas(1)
    for cn, out in zip(sizes[1:], outs[1:]):
        assert not bool(torch.isnan(out).any()), f"cluster_n={cn}: rows left unwritten (NaN poison survived)"
        assert torch.equal(outs[0], out), f"cluster_n={cn}"
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), offs.cpu(), act,
                                          None if rs is None else rs.cpu(), dtype=torch.float64)
    got = outs[-1].double().cpu()
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_n", [2])
def test_gpu_cluster_launcher_clamps_the_grid(cluster_n):
    """The launcher never starts more CTAs than the clusters that fit (a grid of one per SM would
    leave its last clusters waiting for a whole pass): the same bits with any requested count."""
    _sm90()
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm, cluster_ctas

    E, n, k, m_total = 8, 2048, 768, 3000
    a, a_s, b, b_s, offs, rs = (t.cuda() for t in fp8_gemm_problem(m_total, n, k, E, "skewed", 5, True))
    fn = CompiledFp8Gemm("identity", n, k, E, scale_rows=True, raster_m=16, cluster_n=cluster_n)
    assert fn._max_ctas == cluster_ctas(cluster_n)
    outs = []
    for ctas in (None, 1000, 7, cluster_n, 1):  # 1: still one whole cluster
        out = torch.full((m_total, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a.view(torch.float8_e4m3fn), a_s, b.view(torch.float8_e4m3fn), b_s, offs, out, rs, max_active_ctas=ctas)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", ["0", "1"])
def test_gpu_backend_launcher_matches_float64(monkeypatch, cluster):
    """``moe_ep.backends.sm90.fp8_cutedsl.grouped_gemm_fp8`` (the launcher the benchmarks and
    ``bench.ncu_gemm`` use) on the backend's schedule, single CTAs and clusters: against a float64
    computation of the quantised problem, every row written."""
    _sm90()
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", cluster)
    from moe_ep.backends.quant import quantize_fp8_block128, quantize_fp8_rows128
    from moe_ep.backends.sm90.fp8_cutedsl import grouped_gemm_fp8

    E, n, k, m_total = 8, 1024, 512, 1500
    g = torch.Generator(device="cuda").manual_seed(17)
    a, a_s = quantize_fp8_rows128(torch.randn(m_total, k, device="cuda", generator=g))
    w = quantize_fp8_block128(torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5)
    offs = ref.make_offsets(m_total, E, "skewed", torch.Generator().manual_seed(3)).cuda()
    fn = grouped_gemm_fp8("swiglu", n, k, E)
    assert fn.cluster_n == {"0": 1, "1": 2}[cluster]
    out = torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(a, a_s, w.values, w.scale, offs, out=out, row_scale=torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), w.values.cpu(), w.scale.cpu(), offs.cpu(), "swiglu",
                                          dtype=torch.float64)
    got = out.double().cpu()
    assert not bool(torch.isnan(got).any())
    assert float((got - want).norm() / want.norm()) < 1e-2
