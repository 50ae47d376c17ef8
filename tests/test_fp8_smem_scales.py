"""Drops v34 / v35: the FP8 grouped GEMM's scales staged in shared memory (``smem_scales=True``;
v35's ``scale_warp=True``: by a second producer warp, the TMA warp's loop unchanged). The
producer warp loads each k-tile's 128 A-row scales and the weight block's scale(s) before it
waits for a free stage, stores them into the stage's slot and only then arms the stage's full
barrier, so the consumers read them from shared memory instead of waiting on global loads after
issuing the k-tile's WGMMAs. (Drop v65's look-ahead of the scale warp was removed in v84.) CPU:
the PTX (loads before the wait, a warp barrier between the
stores and the barrier's arrive), no spills, the refusals, the shim's switch. GPU: the same bits
as the global-memory kernel on every schedule the layer runs, every row written, and float64
agreement."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import fp8_gemm_problem, kernel_once  # noqa: E402
from sm90_megamoe import fp8_reference as ref  # noqa: E402


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _producer_blocks(ptx: str):
    """The PTX between each free-stage wait and the arrive that arms the stage's full barrier."""
    return re.findall(r"mbarrier\.try_wait[^\n]*\n((?:(?!mbarrier\.try_wait).)*?)mbarrier\.arrive\.expect_tx",
                      ptx, flags=re.S)


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,kw", [
    ("swiglu", 1536, 2048, 128, dict(wide_gated=True)),                            # Qwen3 FC1
    ("identity", 2048, 768, 128, dict(overlap_promotion=True)),                    # Qwen3 FC2
    ("identity", 4096, 14336, 8, dict(cluster_n=2)),                               # Mixtral FC2
    ("swiglu", 28672, 4096, 8, dict(wide_gated=True, overlap_promotion=True, cluster_n=2)),  # Mixtral FC1
])
def test_smem_scales_ptx(act, n, k, experts, kw):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, experts, act == "identity", raster_m=16, smem_scales=True, **kw)
    ptx = compiled.__ptx__
    blocks = _producer_blocks(ptx)
    assert blocks and ptx.count("mbarrier.arrive.expect_tx") == ptx.count("bar.warp.sync")
    for body in blocks:  # stores of the staged scales, then the warp barrier, then the arrive
        assert "st.shared.b32" in body and "bar.warp.sync" in body
        assert body.rfind("bar.warp.sync") > body.rfind("st.shared.b32")
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"]
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r
    # one slot of SCALE_SLOT float32 per stage, still inside the 227 KB of an SM90 CTA
    from sm90_megamoe.fp8_gemm import SCALE_SLOT

    assert SCALE_SLOT >= kernel.tile_m + kernel.num_b and SCALE_SLOT % 4 == 0
    assert r["smem_bytes"] <= 227 * 1024 and kernel.num_stages >= 4


@pytest.mark.parametrize("act,n,k,experts,kw", [
    ("identity", 4096, 14336, 8, dict(cluster_n=2)),                                # Mixtral FC2, plain
    ("identity", 4096, 14336, 8, dict(overlap_promotion=True, cluster_n=2)),       # Mixtral FC2, the default
    ("swiglu", 1536, 2048, 128, dict(wide_gated=True, overlap_promotion=True, cluster_n=2)),  # Qwen3 FC1
])
def test_scale_warp_ptx(act, n, k, experts, kw):
    """Drop v35: the scales staged by producer warp 1 -- full barriers initialised for two
    arrivals, the TMA warp's waits followed directly by its arrive (no stores between), the scale
    warp's stores, warp barrier and a plain (elected) arrive; no spills."""
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, experts, act == "identity", raster_m=16, smem_scales=True,
                                       scale_warp=True, **kw)
    ptx = compiled.__ptx__
    assert kernel.scale_warp and kernel.smem_scales
    inits = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s*\n\s*mbarrier\.init\.shared\.b64\s+\[%r\d+\], \1;", ptx)
    assert inits and inits[0][1] == "2", inits[:2]  # the first barriers initialised are the full ones
    for body in _producer_blocks(ptx):  # the TMA warp: nothing staged between its wait and its arrive
        assert "st.shared.b32" not in body
    assert ptx.count("bar.warp.sync") >= 1
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and not r["local"] and r["smem_bytes"] <= 227 * 1024
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


def _scale_windows(ptx: str):
    """Per stretch of PTX between two warp barriers that stores staged scales and loads some: (stored,
    loaded, stored registers loaded in the same stretch). v35's warp loads what it stores right
    before it (all of them)."""
    out = []
    for part in ptx.split("bar.warp.sync")[1:-1]:
        stored = re.findall(r"st\.shared\.b32\s+\[[^\]]+\],\s*(%r\d+);", part)
        loaded = re.findall(r"ld\.global\.b32\s+(%r\d+),", part)
        if stored and loaded:
            out.append((len(stored), len(loaded), len(set(stored) & set(loaded))))
    return out


@pytest.mark.parametrize("act,n,k,experts,kw", [
    ("identity", 4096, 14336, 8, dict(cluster_n=2)),                           # Mixtral FC2 (112 k-tiles)
    ("identity", 2048, 768, 128, dict(cluster_n=2)),                           # Qwen3 FC2 (6)
])
def test_scale_warp_stores_what_it_just_loaded_ptx(act, n, k, experts, kw):
    """Drop v35's scale warp stages one k-tile per round: every register it stores between two warp
    barriers was loaded in that same stretch (its loads are not issued ahead); no spills, no local
    memory."""
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, experts, act == "identity", raster_m=16,
                                       overlap_promotion=True, smem_scales=True, scale_warp=True, **kw)
    wins = _scale_windows(compiled.__ptx__)
    assert wins, "no staging stretch found"
    assert all(both == stored for stored, _, both in wins), wins
    r = ptx_report(kernel, compiled)
    assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"]
    if r["ptxas_spill_bytes"] is not None:
        assert r["ptxas_spill_bytes"] == 0, r


def test_global_scale_kernel_is_unchanged():
    """Without the switch the kernel has no staging code (v33's schedule: consumers load scales)."""
    from sm90_megamoe.fp8_runner import compile_variant

    _, compiled = compile_variant("identity", 2048, 768, 128, True, raster_m=16, overlap_promotion=True)
    assert "bar.warp.sync" not in compiled.__ptx__


def test_smem_scales_refusals():
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    with pytest.raises(ValueError, match="scale_warp needs smem_scales"):
        Fp8BlockScaledGroupedGemmSm90("identity", scale_warp=True)
    with pytest.raises(ValueError, match="scale_warp needs smem_scales"):
        CompiledFp8Gemm("identity", 2048, 768, 8, scale_warp=True)
    with pytest.raises(TypeError, match="scale_lookahead"):  # drop v84 removed it
        Fp8BlockScaledGroupedGemmSm90("identity", smem_scales=True, scale_warp=True, scale_lookahead=2)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_SMEM_SCALES", raising=False)
    monkeypatch.delenv("MOE_EP_FP8_OVERLAP", raising=False)
    monkeypatch.delenv("MOE_EP_FP8_SCALE_WARP", raising=False)
    # the rules of staged scales, with drop v69's unit_scales (which replaces them from K 4096) off
    monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", "0")
    # default: staged scales on the overlapped schedule up to K = 2048 (Qwen3's FC1 and FC2), and
    # for the non-gated GEMM (FC2) from K = 4096 (eighteenth session: Mixtral's FC2 1.036x)
    assert s.use_fp8_smem_scales(True, 768) and s.use_fp8_smem_scales(True, 2048)
    assert not s.use_fp8_smem_scales(True, 4096) and not s.use_fp8_smem_scales(False, 768)
    assert not s.use_fp8_smem_scales(True, 4096, "swiglu") and s.use_fp8_smem_scales(True, 14336, "identity")
    assert s._key("gemm", "swiglu", 1536, 2048, 128, False, overlap_promotion=True).smem_scales is True
    mixtral_fc1 = s._key("gemm", "swiglu", 28672, 4096, 8, False, overlap_promotion=True)
    mixtral_fc2 = s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=True)
    assert (mixtral_fc1.smem_scales, mixtral_fc1.scale_warp) == (False, False)
    assert (mixtral_fc2.smem_scales, mixtral_fc2.scale_warp, mixtral_fc2.cluster_n) == (True, True, 2)
    # what the backend compiles: Qwen3's two GEMMs on the short-K schedule (TMA warp staging)
    assert s.compiled_key_overlap("swiglu", 2048) and s.compiled_key_overlap("identity", 768)
    assert s._key("gemm", "identity", 2048, 768, 128, True, overlap_promotion=True).cluster_n == 2
    for v, on in (("1", True), ("0", False)):
        monkeypatch.setenv("MOE_EP_FP8_SMEM_SCALES", v)
        assert s.use_fp8_smem_scales(True, 14336) is on and s.use_fp8_smem_scales(True, 768) is on
        assert s.use_fp8_smem_scales(False, 768) is False  # never on the plain schedule
        assert s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=True).smem_scales is on
        assert s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=False).smem_scales is False
        # the quantisers have no scales to stage
        assert s._key("quantize", "", 0, 2048, 0, False).smem_scales is False
    # drop v35's scale warp: by default only for FC2 past K = 2048, forced by the switch, and only
    # where scales are staged
    monkeypatch.delenv("MOE_EP_FP8_SMEM_SCALES")
    assert s._key("gemm", "identity", 2048, 768, 128, True, overlap_promotion=True).scale_warp is False
    assert s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=True).scale_warp is True
    monkeypatch.setenv("MOE_EP_FP8_SCALE_WARP", "1")
    assert s._key("gemm", "identity", 2048, 768, 128, True, overlap_promotion=True).scale_warp is True
    assert s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=False).scale_warp is False
    monkeypatch.setenv("MOE_EP_FP8_SCALE_WARP", "0")
    assert s._key("gemm", "identity", 4096, 14336, 8, True, overlap_promotion=True).scale_warp is False


def test_shim_fp8_raster_switch(monkeypatch):
    """``MOE_EP_FP8_RASTER_M`` overrides the FP8 GEMMs' L2 raster (the key and the kernel options carry
    it); unset, K decides (Mixtral's FC2 13, its FC1 16); a bad value raises naming the variable."""
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_RASTER_M", raising=False)
    fc2 = lambda: s._gemm_key("identity", 4096, 14336, 8, True)  # noqa: E731
    assert fc2().raster_m == 13 == (24 << 20) // (128 * 14336)
    assert s._gemm_key("swiglu", 28672, 4096, 8, False).raster_m == 16
    monkeypatch.setenv("MOE_EP_FP8_RASTER_M", "16")
    assert fc2().raster_m == 16 and s._gemm_options(fc2())["raster_m"] == 16
    for bad in ("0", "65", "x"):
        monkeypatch.setenv("MOE_EP_FP8_RASTER_M", bad)
        with pytest.raises(ValueError, match="MOE_EP_FP8_RASTER_M"):
            fc2()


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,kw,m_total", [
    ("swiglu", 1536, 2048, dict(wide_gated=True), 5000),                           # Qwen3 FC1
    ("swiglu", 1536, 2048, dict(wide_gated=True, overlap_promotion=True), 700),
    ("swiglu", 1536, 2048, dict(), 300),                                           # two B tiles per stage
    ("identity", 2048, 768, dict(overlap_promotion=True), 5000),                   # Qwen3 FC2 + router weights
    ("identity", 2048, 768, dict(overlap_promotion=True, cluster_n=2), 2000),
    ("identity", 1024, 8192, dict(cluster_n=2), 3000),                             # long K, plain schedule
    ("identity", 512, 8192, dict(overlap_promotion=True), 1000),                   # chunked overlapped schedule
    ("identity", 1024, 14336, dict(overlap_promotion=True, cluster_n=2), 1500),    # Mixtral's FC2 schedule
    ("identity", 1024, 2304, dict(overlap_promotion=True, cluster_n=2), 3000),     # Inkling2's FC2 (51st)
    ("identity", 1024, 1024, dict(), 1),                                           # one row
])
def test_gpu_smem_scales_is_bit_identical(act, n, k, kw, m_total, routing):
    """Staged scales give the global-memory kernel's bits (the same products and sums: only where
    each scale is read from differs), every row written (NaN-poisoned output), and agree with a
    float64 computation of the quantised problem."""
    _sm90()
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E, sr = 16, act == "identity"
    a, a_s, b, b_s, offs, rs = (None if t is None else t.cuda()
                                for t in fp8_gemm_problem(m_total, n, k, E, routing, 70 + m_total, sr))
    outs = []
    # global, staged (v34), scale warp (v35)
    for smem, warp in ((False, False), (True, False), (True, True)):
        fn = kernel_once(Fp8GroupedGemm, act, n, k, E, sr, raster_m=16, smem_scales=smem, scale_warp=warp, **kw)
        out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, rs))
        outs.append(out)
    torch.cuda.synchronize()
    for o in outs[1:]:
        assert not bool(torch.isnan(o).any()), "rows left unwritten (NaN poison survived)"
        assert torch.equal(outs[0], o)
    want = ref.fp8_grouped_gemm_reference(a.cpu(), a_s.cpu(), b.cpu(), b_s.cpu(), offs.cpu(), act,
                                          None if rs is None else rs.cpu(), dtype=torch.float64)
    rel = float((outs[1].double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
    assert rel < 1e-2, rel
