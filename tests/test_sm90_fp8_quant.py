"""SM90 BF16 -> FP8 per-row 128-group quantiser (sm90_megamoe.fp8_quant): compiles for sm_90a on
CPU with the e4m3 conversion, 16-byte vectors, IEEE-exact division, no spills; the ``gpu`` tests check it
bit for bit against ``fp8_reference.quantize_rows128`` on an SM90 GPU."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

# the drop tree the installed moe_ep uses (an installed copy, not this checkout, on the GPU host),
# registered through the shim so later shim imports in this process find the same modules
from moe_ep.shim import drop_src, register_drop  # noqa: E402

SRC = drop_src("sm90", "megamoe")
register_drop(SRC)

from sm90_megamoe import fp8_reference as ref  # noqa: E402
from sm90_megamoe.fp8_quant import (  # noqa: E402
    CompiledFp8QuantizeRows,
    Fp8QuantizeRows128,
    can_implement,
    compile_fp8_quantize_rows,
)


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("k", [2048, 768, 128, 14336])
@pytest.mark.parametrize("counted,gather", [(False, False), (True, False), (True, True)])
def test_compiles_with_e4m3_cvt_no_spills(k, counted, gather):
    from sm90_megamoe.layout_compile_check import ptxas_info

    ptx = compile_fp8_quantize_rows(k, counted=counted, gather=gather, keep_ptx=True).__ptx__
    assert ".target sm_90a" in ptx
    cvt = set(re.findall(r"cvt[\w.:]*e4m3[\w.:]*", ptx))
    assert cvt == {"cvt.rn.satfinite.e4m3x2.f32"}, cvt
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 8          # 16 values per lane
    assert ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 1
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and "div.full" not in ptx
    # drop v24: one correctly rounded reciprocal per group and lane, then Markstein's correction
    # (tests/test_fp8_quant_div.py); no approximate reciprocal
    assert ptx.count("rcp.rn.f32") == 1 and "rcp.approx" not in ptx
    assert ".ftz" not in ptx                                        # denormals kept, as torch
    assert "shfl.sync.bfly.b32" in ptx and "max.NaN.f32" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx  # PDL (drop v16)
    info = ptxas_info(ptx, "sm_90a")
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0, info


def test_tvm_ffi_compiles():
    pytest.importorskip("tvm_ffi")
    c = compile_fp8_quantize_rows(2048, tvm_ffi=True, keep_ptx=True)
    assert "cvt.rn.satfinite.e4m3x2.f32" in c.__ptx__


@pytest.mark.parametrize("counted,gather", [(False, False), (True, False), (True, True)])
def test_fake_signature_matches_real_tensors(counted, gather):
    """The fake-tensor ABI equals the one the classic launcher builds from torch tensors."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from sm90_megamoe.ep_compile_check import same_signature
    from sm90_megamoe.fp8_quant import Fp8GatherQuantizeRows128, Fp8QuantizeRows128Counted

    k, m, src = 768, 37, 11
    fake = compile_fp8_quantize_rows(k, counted=counted, gather=gather, keep_ptx=True)
    count = torch.zeros(1, dtype=torch.int32) if counted else None
    idx = torch.zeros(m, dtype=torch.int32) if gather else None
    args = CompiledFp8QuantizeRows.cute_args(
        torch.zeros(src if gather else m, k, dtype=torch.bfloat16), torch.zeros(m, k, dtype=torch.float8_e4m3fn),
        torch.zeros(m, k // 128, dtype=torch.float32), count, idx)
    kern = (Fp8GatherQuantizeRows128 if gather else Fp8QuantizeRows128Counted if counted else Fp8QuantizeRows128)(k)
    real = cute.compile(kern, *args, cutlass.Int32(m), make_fake_stream(),
                        options="--gpu-arch sm_90a --keep-ptx")
    assert same_signature(fake, real)


def test_can_implement():
    assert can_implement(2048) is None and can_implement(128) is None
    assert can_implement(100) is not None and can_implement(0) is not None
    with pytest.raises(ValueError):
        Fp8QuantizeRows128(2000)


# ---------------------------------------------------------------------------- GPU (SM90)
def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _rows(m, k, gen):
    """Random bf16 rows with an all-zero group, huge and tiny magnitudes, bf16 subnormals,
    a group whose amax is negative, exact +-448-ratio values and mixed-scale groups."""
    x = torch.randn(m, k, generator=gen, dtype=torch.float32)
    if m:
        g = k // 128
        x[0, :128] = 0.0                                            # all-zero group
        x[0, :5] = torch.tensor([0.0, -0.0, 0.0, 0.0, 0.0])
        x[min(1, m - 1), 128 * (g - 1):] *= 1e30                     # huge
        x[min(2, m - 1), :128] *= 1e-30                              # tiny (normal f32 scale)
        x[min(3, m - 1), :128] = torch.randn(128, generator=gen) * 1e-39   # bf16 subnormals
        x[min(4, m - 1), :128] = torch.rand(128, generator=gen)
        x[min(4, m - 1), 7] = -3.0                                   # amax from a negative value
        x[min(5, m - 1), :128] = torch.randn(128, generator=gen) * torch.logspace(
            -20, 20, 128)                                            # mixed magnitudes
        for r in range(6, min(m, 64)):                               # per-row spread of scales
            x[r] *= 10.0 ** float(torch.randint(-12, 13, (1,), generator=gen))
        if g > 1 and m > 6:
            x[6, 128:256] = 0.0                                      # zero group mid-row
    return x.to(torch.bfloat16)


def _expect(x, rows):
    q, s = ref.quantize_rows128(x[:rows].float())
    return q.view(torch.uint8), s


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2048, 768])
@pytest.mark.parametrize("tvm_ffi", [False, True])
def test_bit_identical_to_reference(k, tvm_ffi):
    _sm90()
    if tvm_ffi:
        pytest.importorskip("tvm_ffi")
    gen = torch.Generator().manual_seed(k)
    dev = "cuda"
    kern = CompiledFp8QuantizeRows(k, tvm_ffi=tvm_ffi)
    for m, m_rows in [(0, 0), (1, 1), (1000, 1000), (1000, 613), (1000, 0), (7, 100)]:
        x = _rows(m, k, gen).to(dev)
        q = torch.full((m, k), 0x5A, dtype=torch.uint8, device=dev)          # poison
        s = torch.full((m, k // 128), float("nan"), dtype=torch.float32, device=dev)
        kern(x, q.view(torch.float8_e4m3fn), s, m_rows=m_rows)
        torch.cuda.synchronize()
        rows = min(m, m_rows)
        eq, es = _expect(x.cpu(), rows)
        assert torch.equal(q[:rows].cpu(), eq), (k, m, m_rows)
        assert torch.equal(s[:rows].cpu().view(torch.int32), es.view(torch.int32)), (k, m, m_rows)
        assert bool((q[rows:] == 0x5A).all()) and bool(s[rows:].isnan().all())
        # the GPU torch quantiser agrees too (same rule, on-device)
        gq, gs = ref.quantize_rows128(x[:rows].float())
        assert torch.equal(gq.view(torch.uint8).cpu(), eq) and torch.equal(gs.cpu(), es)


@pytest.mark.gpu
def test_counted_variant_skips_rows_beyond_device_count():
    _sm90()
    k, m = 768, 1000
    gen = torch.Generator().manual_seed(5)
    x = _rows(m, k, gen).cuda()
    kern = CompiledFp8QuantizeRows(k, counted=True)
    for cnt, m_rows in [(0, m), (517, m), (m, m), (900, 300), (5000, m)]:
        q = torch.full((m, k), 0x5A, dtype=torch.uint8, device="cuda")
        s = torch.full((m, k // 128), float("nan"), dtype=torch.float32, device="cuda")
        count = torch.tensor([cnt], dtype=torch.int32, device="cuda")
        kern(x, q, s, m_rows=m_rows, count=count)
        torch.cuda.synchronize()
        rows = min(cnt, m_rows, m)
        eq, es = _expect(x.cpu(), rows)
        assert torch.equal(q[:rows].cpu(), eq) and torch.equal(s[:rows].cpu(), es)
        assert bool((q[rows:] == 0x5A).all()) and bool(s[rows:].isnan().all())


@pytest.mark.gpu
def test_gather_variant_quantises_indexed_source_rows():
    """q[r] = quantize(x[idx[r]]) bit for bit for r < min(count, m_rows, M) (repeated and
    out-of-order indices; a bad index is clamped into the source, never read out of bounds);
    rows past the count stay poisoned."""
    _sm90()
    k, S, M = 2048, 300, 1000
    gen = torch.Generator().manual_seed(13)
    x = _rows(S, k, gen).cuda()
    idx = torch.randint(0, S, (M + 7,), generator=gen, dtype=torch.int32)
    idx[5], idx[6] = -3, S + 40  # clamped to rows 0 and S-1
    kern = CompiledFp8QuantizeRows(k, gather=True)
    for cnt, m_rows in [(0, M), (613, M), (M, M), (900, 250)]:
        q = torch.full((M, k), 0x5A, dtype=torch.uint8, device="cuda")
        s = torch.full((M, k // 128), float("nan"), dtype=torch.float32, device="cuda")
        kern(x, q, s, m_rows=m_rows, count=torch.tensor([cnt], dtype=torch.int32, device="cuda"), idx=idx.cuda())
        torch.cuda.synchronize()
        rows = min(cnt, m_rows, M)
        eq, es = _expect(x.cpu()[idx[:rows].clamp(0, S - 1).long()], rows)
        assert torch.equal(q[:rows].cpu(), eq) and torch.equal(s[:rows].cpu(), es), (cnt, m_rows)
        assert bool((q[rows:] == 0x5A).all()) and bool(s[rows:].isnan().all())


@pytest.mark.gpu
def test_grid_stride_covers_large_m():
    """More groups than the grid cap (grid-stride loop), small cap to force many iterations."""
    _sm90()
    k, m = 2048, 3000
    gen = torch.Generator().manual_seed(9)
    x = _rows(m, k, gen).cuda()
    kern = CompiledFp8QuantizeRows(k, compiled=compile_fp8_quantize_rows(k, max_ctas=3))
    q = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    s = torch.empty(m, k // 128, dtype=torch.float32, device="cuda")
    kern(x, q, s)
    torch.cuda.synchronize()
    eq, es = _expect(x.cpu(), m)
    assert torch.equal(q.cpu(), eq) and torch.equal(s.cpu(), es)
