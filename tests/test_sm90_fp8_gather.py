"""Drop v22's gathering FP8 grouped GEMM (sm90_megamoe.fp8_gather): FC1 reads grouped row r from
source row idx[r] (cp.async by the producer warpgroup, B still by TMA). CPU: it compiles with the
cp.async copies, their mbarrier arrivals and no spills; GPU: the same bits as the plain kernel on
the gathered rows, any schedule."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

SRC = drop_src("sm90", "megamoe")
register_drop(SRC)

from sm90_megamoe import fp8_reference as ref  # noqa: E402


@pytest.mark.parametrize("n,k,experts,overlap,wide", [
    (1536, 2048, 128, False, True),   # Qwen3 FC1, the default (wide, plain promotion)
    (1536, 2048, 128, True, False),   # overlapped promotion, two WGMMAs
    (28672, 4096, 8, True, True),     # Mixtral FC1, the default (wide, overlapped)
])
def test_gather_variant_compiles(n, k, experts, overlap, wide):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant("swiglu", n, k, experts, False, raster_m=16, overlap_promotion=overlap,
                                       wide_gated=wide, gather_a=True)
    ptx = compiled.__ptx__
    # one k-tile of A per thread: eight 16-byte cp.async, one per 16-row pass (drop v23: eight
    # consecutive lanes share a row, so a pass's destinations are 16 rows x 128 bytes = 2048 apart),
    # then the arrival; the compiler may unroll the k-loop (a multiple of 8 copies)
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[(%r\d+)(?:\+(\d+))?\], \[[^]]+\], 16, 16;", ptx)
    assert copies and len(copies) % 8 == 0, len(copies)
    first = copies[:8]
    assert len({r for r, _ in first}) == 1 and [int(o or 0) for _, o in first] == [2048 * i for i in range(8)], first
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx and "cp.async.bulk.tensor" in ptx  # B by TMA
    assert "ld.local" not in ptx and "st.local" not in ptx
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["pdl"] and r["smem_bytes"] <= 227 * 1024
    if r["ptxas_spill_bytes"] is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert r["ptxas_spill_bytes"] == 0, r


def test_gather_refuses_clusters_and_missing_idx():
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    with pytest.raises(ValueError, match="does not combine with gather_a"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 128, cluster_n=2, gather_a=True, compiled=object())
    fn = CompiledFp8Gemm("swiglu", 1536, 2048, 128, gather_a=True, compiled=object())
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="idx is required"):
        fn(z, z, z, z, z, out=z, row_scale=z)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,wide", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_gpu_gather_is_bit_identical(routing, overlap, wide):
    """FC1 on (tokens, idx) gives the bits of FC1 on the gathered rows (NaN-poisoned outputs);
    idx repeats tokens and skips some, as top-k routing does."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E, m_total, t_src, n, k = 16, 5000, 700, 1536, 2048
    offs = ref.make_offsets(m_total, E, routing, torch.Generator().manual_seed(31)).cuda()
    g = torch.Generator().manual_seed(9)
    src, src_s = (t.cuda() for t in ref.quantize_rows128(torch.randn(t_src, k, generator=g)))
    b, b_s = (t.cuda() for t in ref.quantize_weight_block128(torch.randn(E, n, k, generator=g) / k ** 0.5))
    idx = torch.randint(0, t_src, (m_total,), generator=g, dtype=torch.int32).cuda()
    a, a_s = src[idx.long()].contiguous(), src_s[idx.long()].contiguous()
    plain = Fp8GroupedGemm("swiglu", n, k, E, False, raster_m=16, overlap_promotion=overlap, wide_gated=wide)
    gath = Fp8GroupedGemm("swiglu", n, k, E, False, raster_m=16, overlap_promotion=overlap, wide_gated=wide,
                          gather_a=True)
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    plain.launch(plain.prepare(a, a_s, b, b_s, outs[0], offs, None))
    gath.launch(gath.prepare(src, src_s, b, b_s, outs[1], offs, None, idx=idx))
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])
    # and against the float64 model of the quantised math (not only against itself)
    want = ref.fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, "swiglu", None)
    assert float((outs[1].float() - want).norm() / want.norm()) < 1e-2
