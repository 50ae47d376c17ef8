"""The FP8 GEMM's plain k-loop (no overlapped promotion: Qwen3's wide FC1, Mixtral's FC2, the
gathering FC1) at even and odd k-tile counts, 1 included (written with drop
v31, kept when v32 restored the earlier loop). CPU: each kernel compiles without spills. GPU: the
plain schedule gives the overlapped schedule's bits (same WGMMAs, same promotion order) and agrees
with float64."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe import fp8_reference as ref  # noqa: E402

# (activation, N, K, wide): K / 128 = 1, 2, 3, 9 (odd: the leftover k-tile), 16
SHAPES = [
    ("identity", 256, 128, False),
    ("identity", 512, 256, False),
    ("swiglu", 512, 384, True),
    ("identity", 1024, 1152, False),
    ("swiglu", 1536, 2048, True),
]


@pytest.mark.parametrize("act,n,k,wide", SHAPES)
def test_plain_schedule_compiles_without_spills(act, n, k, wide):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, 8, act == "identity", raster_m=16, wide_gated=wide)
    ptx = compiled.__ptx__
    assert "wgmma.mma_async" in ptx and "e4m3" in ptx
    r = ptx_report(kernel, compiled)
    if r.get("ptxas_spill_bytes") is not None:
        assert r["ptxas_spill_bytes"] == 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,wide", SHAPES)
def test_gpu_plain_schedule_matches_overlapped_and_float64(act, n, k, wide, routing):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    from moe_oracle import fp8_gemm_problem, kernel_once

    E, m_total, sr = 8, 1500, act == "identity"
    a, a_s, b, b_s, offs, rs = fp8_gemm_problem(m_total, n, k, E, routing, k + n, sr)
    dev = [None if t is None else t.cuda() for t in (a, a_s, b, b_s, offs, rs)]
    outs = []
    for overlap in (False, True):
        fn = kernel_once(Fp8GroupedGemm, act, n, k, E, sr, raster_m=16, overlap_promotion=overlap, wide_gated=wide)
        out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(*dev[:4], out, dev[4], dev[5]))
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[0]).any()), "rows left unwritten (NaN poison survived)"
    assert torch.equal(outs[0], outs[1]), "plain and overlapped schedules differ"
    want = ref.fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, act, rs, dtype=torch.float64)
    rel = float((outs[0].double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
    assert rel < 1e-2, rel
