"""SM90 FP8 block-scaled grouped GEMM (sm90_megamoe.fp8_gemm): compiles for sm_90a on CPU with an
FP8 WGMMA and TMA and no spills; the torch reference agrees with an independent float64
computation; can_implement refuses bad shapes. The ``gpu`` test runs the kernel on an H200."""

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
from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90, can_implement  # noqa: E402

from moe_oracle import kernel_once, no_ptxas_result  # noqa: E402


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,scale_rows,wgmma_n", [
    ("swiglu", 1536, 2048, 128, False, 64),     # Qwen3-30B-A3B FC1: w13 [E, 2*768, 2048]
    ("identity", 2048, 768, 128, True, 128),    # Qwen3 FC2 with router weights
    ("identity", 4096, 14336, 8, False, 128),   # Mixtral FC2 (long K)
])
def test_compiles_with_fp8_wgmma_tma_no_spills(act, n, k, experts, scale_rows, wgmma_n):
    from sm90_megamoe.fp8_runner import compile_variant, ptx_report

    kernel, compiled = compile_variant(act, n, k, experts, scale_rows)
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    wgmma = set(re.findall(r"wgmma\.mma_async[\w.]*", ptx))
    assert wgmma == {f"wgmma.mma_async.sync.aligned.m64n{wgmma_n}k32.f32.e4m3.e4m3"}, wgmma
    assert "cp.async.bulk.tensor" in ptx
    assert "wgmma.wait_group.sync.aligned 0" in ptx.replace("\t", " ").replace("  ", " ")
    assert "ld.local" not in ptx and "st.local" not in ptx
    if act == "swiglu":
        assert "ex2.approx" in ptx
    r = ptx_report(kernel, compiled)
    assert r["pdl"], "PDL: griddepcontrol.wait / launch_dependents missing (drop v16)"
    assert r["smem_bytes"] <= 227 * 1024 and r["stages"] >= 4
    if r["ptxas_spill_bytes"] is None:
        no_ptxas_result()
    assert r["ptxas_spill_bytes"] == 0, r
    err = _ptxas_stderr(ptx)
    assert "C7514" not in err, err[-2000:]  # WGMMAs not serialised by ptxas


def _ptxas_stderr(ptx: str) -> str:
    """``ptxas -v`` diagnostics of ``ptx`` for sm_90a (skips the test without a ptxas)."""
    import os
    import subprocess
    import tempfile

    from sm90_megamoe.layout_compile_check import _ptxas

    exe = _ptxas()
    if exe is None:
        pytest.skip("no ptxas installed")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        for ver in (None, "9.0", "8.8", "8.7", "8.5"):  # lower the ISA version to what this ptxas takes
            with open(src, "w") as fh:
                fh.write(ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}", ptx, flags=re.M))
            r = subprocess.run([exe, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                return r.stderr
    raise AssertionError(r.stderr[-2000:])


def test_compiles_with_native_fp8_tensors():
    """The kernel also takes Float8E4M3FN tensors (not only their uint8 views)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    e, n, k = 4, 256, 256
    m = cute.sym_int()
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    args = (
        make_fake_compact_tensor(f8, (m, k), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(f32, (m, k // 128), stride_order=(1, 0), assumed_align=4),
        make_fake_compact_tensor(f8, (e, n, k), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(f32, (e, n // 128, k // 128), stride_order=(2, 1, 0), assumed_align=4),
        make_fake_compact_tensor(cutlass.BFloat16, (m, n), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(cutlass.Int32, (e + 1,), assumed_align=4),
        make_fake_compact_tensor(f32, (cute.sym_int(),), assumed_align=4),
        cutlass.Int32(132), make_fake_stream(),
    )
    compiled = cute.compile(Fp8BlockScaledGroupedGemmSm90("identity"), *args,
                            options="--gpu-arch sm_90a --keep-ptx")
    assert "e4m3.e4m3" in compiled.__ptx__


# ---------------------------------------------------------------------------- can_implement
@pytest.mark.parametrize("args,needle", [
    (("identity", 256, 192, 8), "K=192"),
    (("identity", 256, 100, 8), "K=100"),
    (("identity", 200, 256, 8), "N=200"),
    (("swiglu", 384, 256, 8), "I = N/2 = 192"),
    (("gelu_glu", 256, 256, 8), "activation"),
    (("identity", 256, 256, 0), "num_experts"),
    (("identity", 256, 256, 8, 256), "tile_n"),
    (("swiglu", 512, 256, 8, 128), "swiglu needs tile_n"),
])
def test_can_implement_refuses(args, needle):
    reason = can_implement(*args)
    assert reason is not None and needle in reason


def test_can_implement_accepts_model_shapes():
    for args in (("swiglu", 1536, 2048, 128), ("identity", 2048, 768, 128),
                 ("swiglu", 28672, 4096, 8), ("identity", 4096, 14336, 8),
                 ("identity", 256, 256, 8, 64)):
        assert can_implement(*args) is None, args
    with pytest.raises(ValueError, match="swiglu needs tile_n == 64"):
        Fp8BlockScaledGroupedGemmSm90("swiglu", tile_n=128)


# ---------------------------------------------------------------------------- reference (CPU)
def _float64_blockwise(a, a_s, b, b_s, offs, act, rs):
    """Independent float64 computation in the kernel's own order: per k-block partial products
    of the raw e4m3 values, promoted with a_scale[m, kb] * b_scale[e, n // 128, kb]."""
    M, K = a.shape
    E, N, _ = b.shape
    kb_n = K // 128
    o = offs.tolist()
    n_out = N // 2 if act == "swiglu" else N
    out = torch.zeros(M, n_out, dtype=torch.float64)
    for e in range(E):
        lo, hi = o[e], o[e + 1]
        acc = torch.zeros(hi - lo, N, dtype=torch.float64)
        for kb in range(kb_n):
            ks = slice(kb * 128, (kb + 1) * 128)
            part = a[lo:hi, ks].double() @ b[e, :, ks].double().t()
            sb = b_s[e, :, kb].double().repeat_interleave(128)[:N]
            acc += part * a_s[lo:hi, kb].double()[:, None] * sb[None, :]
        if act == "swiglu":
            g, u = acc[:, :n_out], acc[:, n_out:]
            acc = g / (1 + torch.exp(-g)) * u
        out[lo:hi] = acc
    if rs is not None:
        out *= rs.double()[:, None]
    return out


def _quantised_problem(m_offsets, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(m_offsets) - 1
    x = torch.randn(m_offsets[-1], k, generator=g)
    x[:3, 128:256] *= 40.0  # per-block scales differ along K and across rows
    w = torch.randn(e, n, k, generator=g) / k ** 0.5
    w[:, :128, :128] *= 10.0
    a, a_s = ref.quantize_rows128(x)
    b, b_s = ref.quantize_weight_block128(w)
    return x, w, a, a_s, b, b_s, torch.tensor(m_offsets, dtype=torch.int32)


@pytest.mark.parametrize("act", ["identity", "swiglu"])
def test_reference_matches_float64_ragged_with_empty_expert(act):
    offsets = [0, 37, 37, 200, 331]  # expert 1 empty, ragged sizes
    x, w, a, a_s, b, b_s, offs = _quantised_problem(offsets, 512, 384)
    rs = torch.rand(offsets[-1], generator=torch.Generator().manual_seed(1))
    got = ref.fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, act, rs)
    want = _float64_blockwise(a, a_s, b, b_s, offs, act, rs)
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 1e-6, rel
    # the float64 path through the reference's own dequantisation agrees too
    got64 = ref.fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, act, rs, dtype=torch.float64)
    assert float((got64 - want).norm() / want.norm()) < 1e-12
    # and the quantised model is close to the unquantised one (the format works)
    exact = _float64_blockwise(x, torch.ones(x.shape[0], 3), w, torch.ones(w.shape[0], 4, 3),
                               offs, act, rs)
    assert float((want - exact).norm() / exact.norm()) < 0.1


def test_quantisers_follow_the_format():
    x = torch.randn(5, 256)
    x[2, :128] = 0.0
    v, s = ref.quantize_rows128(x)
    assert v.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    assert s[2, 0] == 1.0
    torch.testing.assert_close(s[0, 1], x[0, 128:].abs().max() / 448.0)
    assert float(v.float().abs().max()) <= 448.0
    back = ref.dequantize_rows128(v, s)
    assert bool(((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, 1) / 1024 + 1e-12).all())
    w = torch.randn(2, 256, 384)
    vb, sb = ref.quantize_weight_block128(w)
    assert sb.shape == (2, 2, 3)
    torch.testing.assert_close(sb[1, 1, 2], w[1, 128:, 256:].abs().max() / 448.0)


# ---------------------------------------------------------------------------- GPU (H200)
@pytest.mark.parametrize("act,n,k,experts,scale_rows", [
    ("swiglu", 1536, 2048, 128, False),    # Qwen3 FC1: 16 k-tiles
    ("identity", 2048, 768, 128, True),    # Qwen3 FC2: 6 k-tiles (even: the drain branch)
    ("identity", 2048, 640, 16, False),    # 5 k-tiles (odd)
    ("swiglu", 28672, 4096, 8, False),     # Mixtral FC1: 32 k-tiles, the limit of the full unroll
    ("identity", 4096, 14336, 8, True),    # Mixtral FC2: 112 k-tiles, chunks of 16 (drop v25)
    ("swiglu", 4096, 7168, 32, False),     # 56 k-tiles: chunks of 14
])
def test_overlapped_promotion_stays_asynchronous(act, n, k, experts, scale_rows):
    """The overlapped-promotion schedule: ptxas keeps its WGMMAs asynchronous (no C7514
    "wgmma.mma_async instructions are serialized" warning), no spills, two partial sets of
    WGMMAs in flight (``wait_group 1``). Beyond 32 k-tiles it runs in chunks (drop v25): one
    chunk's WGMMAs in the code (4 per k-tile), not the whole K's."""
    from sm90_megamoe.fp8_gemm import overlap_chunk
    from sm90_megamoe.fp8_runner import compile_variant

    kernel, compiled = compile_variant(act, n, k, experts, scale_rows, overlap_promotion=True)
    ptx = compiled.__ptx__
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    chunk = {14336: 16, 7168: 14}.get(k, 0)
    assert kernel.overlap_chunk == chunk == overlap_chunk(k // 128)
    if chunk:  # one chunk in the code: its WGMMAs, C - 1 waits with one group left, one drain
        assert len(re.findall(r"wgmma\.mma_async\.sync", ptx)) == 4 * kernel.n_mma * chunk
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == chunk - 1
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)) == 1
    err = _ptxas_stderr(ptx)
    assert "C7514" not in err and "serialized" not in err, err[-2000:]
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", err), err[-2000:]


def test_overlapped_promotion_chunks_and_refusal():
    """overlap_chunk: 0 while the whole loop unrolls, then the largest even divisor of K/128 up to
    16 (with unit_scales, drop v105: the largest multiple of 8 dividing it, up to 16); an odd K/128
    beyond 32 k-tiles is refused by name."""
    from sm90_megamoe.fp8_gemm import overlap_chunk
    from sm90_megamoe.fp8_runner import compile_variant

    assert [overlap_chunk(t) for t in (1, 6, 32, 34, 56, 112, 1000, 33, 35)] == [0, 0, 0, 2, 14, 16, 10, 0, 0]
    # unit_scales' chunks: DeepSeek-V3's FC1 (56 k-tiles) 8 instead of 14, K 5120 (40) 8 instead of 10;
    # where the even divisor already is a multiple of 8 (Mixtral's FC2, 112: 16; 48: 16) it is unchanged
    assert [overlap_chunk(t, 8) for t in (32, 56, 40, 112, 48, 36, 1000)] == [0, 8, 8, 16, 16, 0, 8]
    assert all(overlap_chunk(t, 8) == overlap_chunk(t) for t in range(1, 400) if overlap_chunk(t) % 8 == 0)
    assert overlap_chunk(36, 4) == 12  # Inkling2's FC1 with scales 4 k-tiles per copy (drop v106)
    with pytest.raises(ValueError, match="K/128 = 35 is odd"):
        compile_variant("identity", 4096, 35 * 128, 8, True, overlap_promotion=True)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,scale_rows", [
    ("swiglu", 1536, 2048, False),   # Qwen3 FC1
    ("identity", 2048, 768, True),   # Qwen3 FC2 + router weights
    ("identity", 2048, 640, False),  # odd number of k-tiles
    ("identity", 1024, 4352, True),  # 34 k-tiles: overlapped in chunks of 2 (drop v25)
    ("identity", 512, 8192, False),  # 64 k-tiles: chunks of 16
])
def test_gpu_against_float64(act, n, k, scale_rows, routing, overlap):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E, m_total = 16, 5000
    gen = torch.Generator().manual_seed(7)
    offs = ref.make_offsets(m_total, E, routing, gen)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m_total, k, generator=g) * 0.5
    w = torch.randn(E, n, k, generator=g) / k ** 0.5
    a, a_s = ref.quantize_rows128(x)
    b, b_s = ref.quantize_weight_block128(w)
    rs = torch.rand(m_total, generator=g) if scale_rows else None
    want = _float64_blockwise(a, a_s, b, b_s, offs, act, rs)

    fn = kernel_once(Fp8GroupedGemm, act, n, k, E, scale_rows, overlap_promotion=overlap)
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn.launch(fn.prepare(dev(a), dev(a_s), dev(b), dev(b_s), out, dev(offs), dev(rs)))
    torch.cuda.synchronize()
    if overlap:  # the same promotion order as the default schedule: the same bits
        base = kernel_once(Fp8GroupedGemm, act, n, k, E, scale_rows)
        out0 = torch.full_like(out, float("nan"))
        base.launch(base.prepare(dev(a), dev(a_s), dev(b), dev(b_s), out0, dev(offs), dev(rs)))
        torch.cuda.synchronize()
        assert torch.equal(out, out0)
    got = out.double().cpu()
    assert not bool(torch.isnan(got).any()), "rows left unwritten (NaN poison survived)"
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-2, rel
    # per expert too (an error confined to one small expert would hide in the global norm)
    o = offs.tolist()
    for e in range(E):
        if o[e + 1] > o[e]:
            d = want[o[e]:o[e + 1]]
            assert float((got[o[e]:o[e + 1]] - d).norm() / d.norm().clamp_min(1e-30)) < 1e-2, e


# ---------------------------------------------------------------------------- asynchronous WGMMAs, no spills
def _assert_fits_async_no_spills(kernel, compiled, ptxas_words):
    """No local memory, PDL and TMA present, shared memory within 227 KB, 0 spill bytes and none
    of ``ptxas_words`` (WGMMA serialisation warnings) in ``ptxas -v``'s output."""
    from sm90_megamoe.fp8_runner import ptx_report

    ptx = compiled.__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    r = ptx_report(kernel, compiled)
    assert r["pdl"] and r["tma"] and r["smem_bytes"] <= 227 * 1024
    if r["ptxas_spill_bytes"] is None:
        no_ptxas_result()
    assert r["ptxas_spill_bytes"] == 0, r
    err = _ptxas_stderr(ptx)
    assert not any(w in err for w in ptxas_words), err[-2000:]


# ---------------------------------------------------------------------------- FC1 wide gate+up WGMMA (drop v21)
@pytest.mark.parametrize("n,k,experts,overlap", [
    (1536, 2048, 128, False),   # Qwen3 FC1
    (1536, 2048, 128, True),    # ... overlapped promotion
    (28672, 4096, 8, True),     # Mixtral FC1, 32 k-tiles unrolled
])
def test_wide_gated_compiles(n, k, experts, overlap):
    """``wide_gated``: FC1's gate and up tiles (adjacent smem slots) feed one m64n128 WGMMA per
    k-block (4 per k-tile instead of 8); asynchronous (no C7514), no spills, no local memory."""
    from sm90_megamoe.fp8_runner import compile_variant

    kernel, compiled = compile_variant("swiglu", n, k, experts, False, overlap_promotion=overlap, wide_gated=True)
    ptx = compiled.__ptx__
    assert set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)) == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
    from sm90_megamoe.fp8_gemm import overlap_chunk

    # with overlap: the whole k-loop unrolled, or one chunk of it; without: one loop body
    traced = (overlap_chunk(k // 128) or k // 128) if overlap else 1
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 4 * traced
    _assert_fits_async_no_spills(kernel, compiled, ("C7514", "serialized"))


def test_wide_gated_refuses_identity():
    with pytest.raises(ValueError, match="wide_gated needs a gated activation"):
        Fp8BlockScaledGroupedGemmSm90("identity", wide_gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_gpu_wide_gated_is_bit_identical(routing, overlap):
    """The wide gate+up WGMMA gives the default FC1's bits (each output's K sum is the same four
    k32 WGMMA steps per k-tile, promoted in the same order)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.fp8_runner import Fp8GroupedGemm

    E, m_total, n, k = 16, 5000, 1536, 2048
    offs = ref.make_offsets(m_total, E, routing, torch.Generator().manual_seed(21)).cuda()
    g = torch.Generator().manual_seed(8)
    a, a_s = (t.cuda() for t in ref.quantize_rows128(torch.randn(m_total, k, generator=g)))
    b, b_s = (t.cuda() for t in ref.quantize_weight_block128(torch.randn(E, n, k, generator=g) / k ** 0.5))
    outs = []
    for wide in (False, True):
        fn = kernel_once(Fp8GroupedGemm, "swiglu", n, k, E, False, overlap_promotion=overlap, wide_gated=wide)
        out = torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, None))
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])


def test_accumulator_coordinates_the_fc1_variants_rely_on(tmp_path):
    """What drop v21's FC1 variants assume about the WGMMA accumulator (CuTe's own partition of
    an identity tile, every thread of the two consumer warpgroups): elements (2p, 2p+1) are
    adjacent columns of one row; element i sits in row r or r + 8 by (i // 2) % 2; the 4 lanes of
    a quad share their rows; and in the 128-wide
    (gate | up) accumulator element i < 32 is the 64-wide tile's element i and element i + 32 is
    the same place 64 columns on (the up value of that gate value)."""
    import json
    import os
    import subprocess
    import sys

    code = f"""
import sys, json
sys.path.insert(0, {str(SRC)!r})
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from sm90_megamoe.grouped_gemm import LayoutEnum
out = {{}}
@cute.jit
def run():
    for n in (64, 128):
        k = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        tm = sm90_utils.make_trivial_tiled_mma(cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, k, k,
                                               cutlass.Float32, (2, 1, 1), tiler_mn=(64, n))
        for t in list(range(256)):  # a Python list: iterated at trace time, not staged
            c = tm.get_slice(t).partition_C(cute.make_identity_tensor((128, n)))
            out[f"{{n}},{{t}}"] = [[int(c[i][0]), int(c[i][1])] for i in list(range(cute.size(c)))]
run()
print(json.dumps(out))
"""
    script = tmp_path / "coords.py"  # a file: CuTeDSL compiles a function from its source
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"))
    assert p.returncode == 0, p.stderr[-2000:]
    coords = json.loads(p.stdout.strip().splitlines()[-1])
    for t in range(256):
        c64, c128 = coords[f"64,{t}"], coords[f"128,{t}"]
        assert len(c64) == 32 and len(c128) == 64
        r = c64[0][0]
        for i, (row, col) in enumerate(c64):
            assert row == r + 8 * ((i // 2) % 2)
            if i % 2:
                assert [row, col] == [c64[i - 1][0], c64[i - 1][1] + 1]
        quad = [coords[f"64,{(t & ~3) + j}"][0][0] for j in range(4)]
        assert quad == [r] * 4
        assert c128[:32] == c64 and all(c128[i + 32] == [c64[i][0], c64[i][1] + 64] for i in range(32))
