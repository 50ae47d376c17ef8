"""Drop v48: the FP8 grouped GEMM stores each tile while the next tile's first k-tile runs
(``deferred_epilogue=True``, the unrolled overlapped schedule). CPU: the layer schedules compile
with no spills and asynchronous WGMMAs (no ptxas C7514), the tile's global stores sit between a
WGMMA commit and its wait, the kernel without the flag is unchanged, the refusals and the shim's
switch. GPU: the same bits as the kernel without it on every schedule it applies to (edge row
counts, empty experts, one k-tile), every row written, float64 agreement."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import fp8_gemm_problem, kernel_once  # noqa: E402
from sm90_megamoe import fp8_reference as ref  # noqa: E402

# the layer's schedules (as the shim picks them) of Qwen3's FC1 / FC2 and Mixtral's FC1
LAYER = [
    ("swiglu", 1536, 2048, 128, dict(wide_gated=True, cluster_n=2, smem_scales=True)),
    ("identity", 2048, 768, 128, dict(cluster_n=2, smem_scales=True)),
    ("swiglu", 28672, 4096, 8, dict(wide_gated=True, cluster_n=2)),
]


def _stores_under_wgmma(ptx: str) -> int:
    """Global stores issued between a ``wgmma.commit_group`` and the next ``wgmma.wait_group``."""
    spans = re.findall(r"wgmma\.commit_group[^\n]*\n(.*?)wgmma\.wait_group", ptx, flags=re.S)
    return sum(len(re.findall(r"st\.global", body)) for body in spans)


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,kw", LAYER)
def test_deferred_epilogue_ptx(act, n, k, experts, kw):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    sr = act == "identity"
    kernel, compiled = compile_variant(act, n, k, experts, sr, raster_m=16, overlap_promotion=True,
                                       deferred_epilogue=True, **kw)
    _, base = compile_variant(act, n, k, experts, sr, raster_m=16, overlap_promotion=True, **kw)
    ptx = compiled.__ptx__
    # the previous tile's stores run while the first k-tile's WGMMAs are in flight; without the
    # flag no store is issued under a WGMMA group
    assert _stores_under_wgmma(ptx) > 0 and _stores_under_wgmma(base.__ptx__) == 0
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"], r
    if r["ptxas_spill_bytes"] is None:
        pytest.skip("no ptxas installed: spill and C7514 checks skipped")
    assert r["ptxas_spill_bytes"] == 0, r
    from test_sm90_fp8_compile import _ptxas_stderr

    assert "C7514" not in _ptxas_stderr(ptx)  # the WGMMAs stay asynchronous


def test_deferred_epilogue_refusals():
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm
    from sm90_megamoe.fp8_runner import compile_variant

    with pytest.raises(ValueError, match="deferred_epilogue needs overlap_promotion"):
        Fp8BlockScaledGroupedGemmSm90("identity", deferred_epilogue=True)
    with pytest.raises(ValueError, match="deferred_epilogue needs overlap_promotion"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, deferred_epilogue=True)
    with pytest.raises(ValueError, match="not the chunked one"):  # K 14336: 112 k-tiles, chunked
        compile_variant("identity", 1024, 14336, 8, True, overlap_promotion=True, deferred_epilogue=True)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_DEFERRED_EPILOGUE", raising=False)
    # default: short K only (nineteenth session, at the 700 W cap: Qwen3 FC2, K 768, 1.058x; K 2048
    # and 4096 slower)
    assert s._gemm_key("identity", 2048, 768, 128, True).deferred_epilogue
    assert s._gemm_key("identity", 2048, 1024, 128, True).deferred_epilogue
    assert not s._gemm_key("swiglu", 1536, 2048, 128, False).deferred_epilogue
    assert not s._gemm_key("swiglu", 28672, 4096, 8, False).deferred_epilogue
    monkeypatch.setenv("MOE_EP_FP8_DEFERRED_EPILOGUE", "0")
    assert not s._gemm_key("identity", 2048, 768, 128, True).deferred_epilogue
    monkeypatch.setenv("MOE_EP_FP8_DEFERRED_EPILOGUE", "1")
    assert s._gemm_key("swiglu", 1536, 2048, 128, False).deferred_epilogue
    assert s._gemm_key("identity", 2048, 768, 128, True).deferred_epilogue
    assert s._gemm_key("swiglu", 28672, 4096, 8, False).deferred_epilogue
    # never where the kernel cannot: the chunked schedule, the plain schedule, the quantisers
    assert not s._gemm_key("identity", 4096, 14336, 8, True).deferred_epilogue
    assert not s._key("gemm", "identity", 2048, 768, 128, True, 16, False).deferred_epilogue
    assert not s._key("quantize", "", 0, 2048, 0, False).deferred_epilogue
    assert s._gemm_options(s._gemm_key("identity", 2048, 768, 128, True))["deferred_epilogue"]


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,kw,m_total", [
    ("swiglu", 1536, 2048, LAYER[0][4], 5000),                               # Qwen3 FC1's schedule
    ("identity", 2048, 768, LAYER[1][4], 5000),                              # Qwen3 FC2 + router weights
    ("swiglu", 1024, 4096, LAYER[2][4], 3000),                               # Mixtral FC1's schedule
    ("identity", 1024, 768, dict(), 1),                                      # one row, single CTAs
    ("identity", 512, 128, dict(cluster_n=2), 700),                          # one k-tile
    ("swiglu", 512, 256, dict(wide_gated=True), 129),                        # two k-tiles, two m-tiles
    ("swiglu", 512, 384, dict(), 333),                                       # two B tiles per stage
])
def test_gpu_deferred_epilogue_is_bit_identical(act, n, k, kw, m_total, routing):
    """The deferred epilogue gives the kernel's bits without it (same sums in the same order, only
    the stores move), writes every row (NaN-poisoned output), and agrees with float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E, sr = 16, act == "identity"
    a, a_s, b, b_s, offs, rs = (None if t is None else t.cuda()
                                for t in fp8_gemm_problem(m_total, n, k, E, routing, 40 + m_total, sr))
    outs = []
    for defer in (False, True):
        fn = kernel_once(Fp8GroupedGemm, act, n, k, E, sr, raster_m=16, overlap_promotion=True,
                         deferred_epilogue=defer, **kw)
        out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, rs))
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[1]).any()), "rows left unwritten (NaN poison survived)"
    assert torch.equal(outs[0], outs[1])
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), offs.cpu(), act,
                                          None if rs is None else rs.cpu(), dtype=torch.float64)
    rel = float((outs[1].double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
    assert rel < 1e-2, rel
