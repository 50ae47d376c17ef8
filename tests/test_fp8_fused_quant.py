"""Drop v39: FC1 (wide gated swiglu, clusters of 2) whose output is FC2's e4m3 input -- each CTA
stages its 64-column half of a unit in its epilogue tile and sends the peer's 64 rows into the
peer's receive tile with one bulk copy; the producer warps of each CTA quantise their 64 rows over
the 128-column group from local shared memory while the consumers run the next unit. CPU: the PTX
(the bulk-copy hand-off, no cluster-scope fences, no bf16 global stores, the final cluster
barrier, no spills), the refusals, the shim's and
the backend's switches. GPU: ``q`` / ``q_scale`` bit-identical to the plain FC1 followed by the
standalone row quantiser (poisoned outputs: every row written) and to the reference quantiser,
on the two schedules the layer runs (Qwen3's short-K one, the long-K one), uniform and skewed
routing, down to one row.

Drop v66 (``pair_amax``, ``MOE_EP_FP8_FUSED_QUANT=epilogue``): no quantising warps; the consumers
quantise their 64 columns in the epilogue and the pair swaps each row's |max| with one 512-byte
bulk copy per unit. The same PTX checks (one bulk copy, no cluster-scope fences, only e4m3 rows
stored) and the same GPU test, against the same FC1 + quantiser."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import fp8_gemm_problem  # noqa: E402
from sm90_megamoe import fp8_reference as ref  # noqa: E402


def _compile(n, k, experts, smem_scales, pair_amax=False):
    import cutlass.cute as cute
    from sm90_megamoe.fp8_gemm import Fp8SwigluFusedQuantGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args

    kernel = Fp8SwigluFusedQuantGroupedGemmSm90(overlap_promotion=True, smem_scales=smem_scales,
                                                tanh_sigmoid=pair_amax, pair_amax=pair_amax)
    compiled = cute.compile(kernel, *fake_args(experts, n, k, "swiglu", fused_quant=True),
                            options="--gpu-arch sm_90a --keep-ptx")
    return kernel, compiled


def _plain_ptx(n, k, experts, smem_scales):
    """The PTX of the plain FC1 on the same schedule (clusters of 2, wide gated, overlapped)."""
    import cutlass.cute as cute
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args

    kernel = Fp8BlockScaledGroupedGemmSm90("swiglu", tile_n=64, overlap_promotion=True, wide_gated=True,
                                           cluster_n=2, smem_scales=smem_scales)
    return cute.compile(kernel, *fake_args(experts, n, k, "swiglu"), options="--gpu-arch sm_90a --keep-ptx").__ptx__


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("n,k,experts,smem", [(1536, 2048, 128, True),    # Qwen3 FC1: the short-K schedule
                                              (2048, 4096, 8, False)])    # long K: global scales
def test_fused_quant_ptx(n, k, experts, smem):
    from sm90_megamoe.fp8_runner import ptx_report

    kernel, compiled = _compile(n, k, experts, smem)
    ptx = compiled.__ptx__
    # the hand-off (v39): one bulk copy of 64 staged rows into the peer's receive tile, completing its
    # bytes on the peer's "full" barrier, which the local warpgroup arms with expect_tx
    bulk = re.findall(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes", ptx)
    assert len(bulk) == 1 and "cp.async.bulk.commit_group" in ptx and "cp.async.bulk.wait_group.read" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # the staged rows are visible to the copy
    assert len(re.findall(r"mbarrier\.arrive\.expect_tx\.shared", ptx)) > len(re.findall(
        r"mbarrier\.arrive\.expect_tx\.shared", _plain_ptx(n, k, experts, smem)))
    # no cluster-scope release / acquire (ptxas emits MEMBAR.ALL.GPU for them: v38), no remote loads
    # (v38), no gpu-scope fence or L2 round trip (v37)
    assert not re.search(r"mbarrier\.\S*\.(release|acquire)\.cluster", ptx)
    assert "ld.shared::cluster" not in ptx and "fence.acq_rel" not in ptx and "ld.relaxed.gpu" not in ptx
    assert "st.global.v4" not in ptx  # no bf16 rows: only e4m3 rows (8 bytes a lane) and scales
    assert "barrier.cluster.wait" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert len(re.findall(r"mbarrier\.init\.shared\.b64", ptx)) >= 2 * kernel.num_stages + 2
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"] and r["smem_bytes"] <= 227 * 1024
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


@pytest.mark.parametrize("n,k,experts,smem", [(1536, 2048, 128, True),    # Qwen3 FC1: the short-K schedule
                                              (2048, 4096, 8, False)])    # long K: global scales
def test_pair_amax_ptx(n, k, experts, smem):
    """v66: the row amaxes go to the peer by two ``st.async`` per quad (4 bytes each, completing on
    the peer's barrier, which its first consumer thread arms with expect_tx), no bulk copy; no
    quantising warps' e4m3 stores of 8 bytes, only the consumers' 16-byte e4m3 vectors (no bf16
    rows); the quantiser's exact division (two IEEE divisions per row on the fast path); no
    cluster-scope fences or remote loads; the final cluster barrier; as many pipeline stages as the
    plain FC1; no spills."""
    from sm90_megamoe.fp8_runner import ptx_report

    kernel, compiled = _compile(n, k, experts, smem, pair_amax=True)
    ptx = compiled.__ptx__
    assert len(re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32", ptx)) == 2
    assert "cp.async.bulk.shared::cluster" not in ptx and "mbarrier.arrive.expect_tx.shared" in ptx
    # Markstein's correction per value (fp8_quant._div_rn) on the fast path: one fma pair per element
    # (the second half of a unit's epilogue is traced twice: in the unit loop, and after it for the last)
    assert len(re.findall(r"fma\.rn\.f32 q1, e,", ptx)) == 2 * 32
    assert not re.search(r"mbarrier\.\S*\.(release|acquire)\.cluster", ptx)
    assert "ld.shared::cluster" not in ptx and "fence.acq_rel" not in ptx and "ld.relaxed.gpu" not in ptx
    # the e4m3 tile's 16-byte vectors (128 rows x 4 per unit over 256 threads: 2 each, traced twice),
    # nothing else
    assert len(re.findall(r"st\.global\.v4", ptx)) == 2 * 2 and "st.global.v2.b32" not in ptx
    assert "barrier.cluster.wait" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    plain_stages = _compile(n, k, experts, smem)[0].num_stages
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"] and r["smem_bytes"] <= 227 * 1024
    assert kernel.num_stages == plain_stages, (kernel.num_stages, plain_stages)
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


def test_pair_amax_switch(monkeypatch):
    """MOE_EP_FP8_FUSED_QUANT: "1" the warps (v39), "epilogue" the consumers (v66), a key of its own;
    any other value raises naming the variable; pair_amax without fused_quant is refused."""
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    with pytest.raises(ValueError, match="pair_amax is a way of fusing the quantiser"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, wide_gated=True, cluster_n=2, pair_amax=True)
    spec = ("swiglu", 28672, 4096, 8, False)
    monkeypatch.setenv("MOE_EP_FP8_FUSED_QUANT", "1")
    warps = s._checked_gemm_key(*spec, False, False, fused_quant=True)
    assert fb._fuses_quant(spec, 1) and warps.fused_quant and not warps.pair_amax
    monkeypatch.setenv("MOE_EP_FP8_FUSED_QUANT", "epilogue")
    pair = s._checked_gemm_key(*spec, False, False, fused_quant=True)
    assert fb._fuses_quant(spec, 1) and pair.fused_quant and pair.pair_amax and pair != warps
    assert not s._checked_gemm_key(*spec, False, False).pair_amax  # only a fused-quant FC1 has it
    # more k-tiles per unit than pipeline stages (the amax buffers alternate by unit): not K = 1024
    assert not s.fp8_fused_quant_available("swiglu", 2048, 1024, 8) and s.fp8_fused_quant_available(*spec)
    with pytest.raises(ValueError, match="fused_quant needs the wide gated swiglu FC1"):
        s._checked_gemm_key("swiglu", 2048, 1024, 8, False, False, False, fused_quant=True)
    assert s._gemm_options(pair)["pair_amax"] and not s._gemm_options(warps)["pair_amax"]
    monkeypatch.setenv("MOE_EP_FP8_FUSED_QUANT", "yes")
    with pytest.raises(ValueError, match="MOE_EP_FP8_FUSED_QUANT must be one of 0, 1, epilogue"):
        fb._fuses_quant(spec, 1)


def test_fused_quant_refusals(monkeypatch):
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90, Fp8SwigluFusedQuantGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    class Narrow(Fp8BlockScaledGroupedGemmSm90):
        fused_quant = True

    with pytest.raises(ValueError, match="fused_quant needs swiglu, wide_gated and cluster_n = 2"):
        Narrow("swiglu", wide_gated=True)  # single CTAs
    with pytest.raises(ValueError, match="fused_quant needs wide_gated and cluster_n = 2"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, wide_gated=True, fused_quant=True)
    with pytest.raises(ValueError, match="fused_quant needs wide_gated"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, wide_gated=False, cluster_n=2, fused_quant=True)
    assert Fp8SwigluFusedQuantGroupedGemmSm90().cluster_n == 2
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "0")
    assert not s.fp8_fused_quant_available("swiglu", 1536, 2048, 128)
    with pytest.raises(ValueError, match="fused_quant needs the wide gated swiglu FC1 in clusters of 2"):
        s._checked_gemm_key("swiglu", 1536, 2048, 128, False, False, False, fused_quant=True)
    monkeypatch.delenv("MOE_EP_FP8_CLUSTER")
    assert s.fp8_fused_quant_available("swiglu", 1536, 2048, 128)      # Qwen3: the short-K schedule
    assert s.fp8_fused_quant_available("swiglu", 28672, 4096, 8)       # Mixtral
    assert not s.fp8_fused_quant_available("identity", 2048, 768, 128)
    key = s._checked_gemm_key("swiglu", 28672, 4096, 8, False, False, False, fused_quant=True)
    assert key.fused_quant and key.cluster_n == 2 and key != s._gemm_key("swiglu", 28672, 4096, 8, False, False,
                                                                          False)


def test_backend_switch(monkeypatch):
    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb

    spec = ("swiglu", 1536, 2048, 128, False)
    monkeypatch.delenv("MOE_EP_FP8_FUSED_QUANT", raising=False)
    assert not fb._fuses_quant(spec, 1)  # opt-in
    monkeypatch.setenv("MOE_EP_FP8_FUSED_QUANT", "1")
    assert fb._fuses_quant(spec, 1) and fb._fuses_quant(spec, 2)
    monkeypatch.setenv("MOE_EP_FP8_FUSED_REQUANT", "1")  # the requantising FC1 writes hq itself
    assert not fb._fuses_quant(spec, 1)
    monkeypatch.delenv("MOE_EP_FP8_FUSED_REQUANT")
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "0")  # no clusters: no pair of CTAs per 128-column group
    assert not fb._fuses_quant(spec, 1)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["1", "epilogue"])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("n,k,experts,m_total", [
    (1536, 2048, 16, 5000),    # Qwen3's FC1 shape: staged scales, overlapped, clusters
    (1536, 2048, 16, 700),
    (1024, 4096, 8, 3000),     # long K: global scales
    (1024, 4096, 8, 1),        # one row
])
def test_gpu_fused_quant_is_bit_identical(monkeypatch, n, k, experts, m_total, routing, mode):
    """q / q_scale: the bits of the plain FC1 (clusters, same schedule) followed by the standalone
    quantiser, and of the reference quantiser on that FC1's rows; every row written (q
    0x7f-poisoned, scales NaN-poisoned); the plain FC1 agrees with float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_ep.shim import sm90_fp8_gemm, sm90_fp8_quantize_rows

    monkeypatch.setenv("MOE_EP_FP8_FUSED_QUANT", mode)  # "1": v39's warps; "epilogue": v66's pair_amax

    a, a_s, b, b_s, offs, _ = (None if t is None else t.cuda()
                               for t in fp8_gemm_problem(m_total, n, k, experts, routing, 300 + m_total, False))
    I = n // 2  # noqa: E741
    rs = torch.ones(1, device="cuda")
    plain = sm90_fp8_gemm("swiglu", n, k, experts, False)
    fused = sm90_fp8_gemm("swiglu", n, k, experts, False, fused_quant=True)
    assert fused.fused_quant and fused.cluster_n == 2 and plain.cluster_n == 2
    assert fused.pair_amax == (mode == "epilogue") and not plain.pair_amax
    quant = sm90_fp8_quantize_rows(I)
    h0 = torch.full((m_total, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    q0 = torch.full((m_total, I), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    q1 = q0.clone()
    s0 = torch.full((m_total, I // 128), float("nan"), device="cuda")
    s1 = s0.clone()
    plain(a, a_s, b, b_s, offs, out=h0, row_scale=rs)
    quant(h0, q0, s0, count=torch.full((1,), m_total, dtype=torch.int32, device="cuda"))
    fused(a, a_s, b, b_s, offs, out=q1, row_scale=rs, out_scale=s1)
    fused(a, a_s, b, b_s, offs, out=q1, row_scale=rs, out_scale=s1)  # twice: the barriers' phases restart
    torch.cuda.synchronize()
    assert not bool(torch.isnan(h0).any()) and not bool(torch.isnan(s1).any())
    assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0)
    rq, rsc = ref.quantize_rows128(h0.float().cpu())  # an independent implementation of the rule
    assert torch.equal(q1.view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(s1.cpu(), rsc)
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), offs.cpu(), "swiglu", None,
                                          dtype=torch.float64)
    rel = float((h0.double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
    assert rel < 1e-2, rel
