"""The SM120 MXFP8 kernel drop ``kernel_src/sm120/mxfp8/src/sm120_mxfp8`` (CPU only).

(a) every kernel compiles for sm_120a from fake tensors; the GEMM's PTX has the block-scaled warp
    MMA (``mma.sync...kind::mxf8f6f4.block_scale``), TMA, ldmatrix and the cp.async -> mbarrier
    arrival; ``ptxas -arch=sm_120a`` assembles with no spills and <= 99 KB of shared memory
    (skipped without a ptxas); fake and real-tensor signatures agree;
(b) the torch reference agrees with an independent float64 computation (fp8 bits decoded by
    hand, per-token expert lookup) on ragged routing with an empty and a 1-token expert;
(c) the quantiser's reference rule is bit-identical to moe_ep's ``quantize_mxfp8`` (random rows,
    edge blocks, and every finite bf16 value as a block's amax);
(d) ``can_implement`` refuses bad shapes with a reason;
(e) the CPU emulation of the GEMM (the kernel's own per-lane index maps run against a model of
    TMA swizzle / ldmatrix / mma fragments / scale lanes) reproduces the reference, and catches a
    deliberately broken index map.
The drop is imported by its top-level name from its ``src`` folder (the shim integration comes
later); the drop itself never imports moe_ep.
"""

import re

import pytest
import torch

pytest.importorskip("cutlass")

# the drop tree the installed moe_ep uses (an installed copy, not this checkout, on the GPU host),
# registered through the shim so later shim imports in this process find the same modules
from moe_ep.shim import drop_src, register_drop  # noqa: E402
from moe_oracle import gated_f64  # noqa: E402

_DROP_SRC = drop_src("sm120", "mxfp8")
register_drop(_DROP_SRC)

from sm120_mxfp8 import (  # noqa: E402
    ACTIVATION_CONSTANT_DEFAULTS,
    EPILOGUES,
    GATED_EPILOGUES,
    SMEM_LIMIT,
    Mxfp8GroupedGemmSm120,
    can_implement,
    quantize_can_implement,
)
from sm120_mxfp8.compile_check import check_gemm, check_quantize  # noqa: E402
from sm120_mxfp8.emulate import emulate_grouped_gemm  # noqa: E402
from sm120_mxfp8.launch import compile_mxfp8_gemm, pick_tile_tokens  # noqa: E402
from sm120_mxfp8.reference import grouped_gemm_reference, quantize_rows_reference  # noqa: E402


def _offsets(counts):
    offs = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offs[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return offs


def _inputs(n, k, counts, seed=0):
    """MXFP8 inputs quantised with the reference rule, for explicit per-expert counts."""
    g = torch.Generator().manual_seed(seed)
    e, m = len(counts), sum(counts)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g))
         ).to(torch.bfloat16)
    w = (torch.randn(e * n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    xv, xs = quantize_rows_reference(x)
    wv, ws = quantize_rows_reference(w)
    rs = torch.rand(m, generator=g)
    return xv, xs, wv.reshape(e, n, k), ws.reshape(e, n, k // 32), _offsets(counts), rs


# ------------------------------------------------------------------------------ (a) compile
@pytest.mark.parametrize("epilogue,n,k,e,tile_tokens,signature", [
    ("swiglu", 1536, 2048, 128, 16, True),    # Qwen3-30B-A3B FC1, decode tile
    ("row_scale", 2048, 768, 128, 128, False),  # Qwen3 FC2, prefill tile (8 MMA warps)
    ("identity", 136, 256, 5, 8, False),       # ragged N, smallest token tile
    ("gelu_glu", 1536, 2048, 128, 16, False),  # drop v2's gated epilogues
    ("gelu_tanh_glu", 1536, 2048, 128, 16, False),
    ("clamped_swiglu", 4096, 4096, 32, 64, False),     # DeepSeek-V4 shard FC1
    ("softcapped_swiglu", 4608, 4608, 48, 32, False),  # Inkling2 shard FC1
])
def test_gemm_compiles_for_sm120(epilogue, n, k, e, tile_tokens, signature):
    info = check_gemm(epilogue, n, k, e, tile_tokens, signature=signature)  # raises on PTX issues
    ptx = info["ptx"]
    if epilogue == "gelu_tanh_glu":  # g * sigmoid(2 z): ex2 + rcp, no tanh
        assert "ex2.approx" in ptx and "rcp.approx" in ptx and "tanh.approx" not in ptx
    if epilogue == "clamped_swiglu":
        assert "min.f32" in ptx and "max.f32" in ptx and "ex2.approx" in ptx
    if epilogue == "softcapped_swiglu":  # three tanh per output, no ex2
        assert ptx.count("tanh.approx.f32") >= 3 and "ex2.approx" not in ptx
    assert "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e4m3.e4m3.f32.ue8m0" in ptx
    assert "cp.async.bulk.tensor" in ptx and "ldmatrix.sync.aligned.m8n8.x4" in ptx
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert info["dyn_smem"] <= SMEM_LIMIT and info["stages"] >= 2
    if signature:
        assert info["signature_ok"]
    if "registers" not in info:
        pytest.skip("no ptxas installed: PTX checks only")
    assert info["spill"] == 0, info
    assert info["dyn_smem"] + info["static_smem"] <= 99 * 1024
    assert info["registers"] * info["threads"] <= 65536


def test_quantize_compiles_for_sm120():
    info = check_quantize(768, signature=True)
    ptx = info["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "shfl.sync.bfly" in ptx
    assert ".ftz" not in ptx, "subnormal bf16 inputs must not be flushed"
    assert info["signature_ok"]
    if "registers" not in info:
        pytest.skip("no ptxas installed: PTX checks only")
    assert info["spill"] == 0 and info["static_smem"] <= 99 * 1024


def test_tvm_ffi_variants_compile():
    pytest.importorskip("tvm_ffi")
    from sm120_mxfp8.launch import compile_quantize_rows

    for compiled in (compile_mxfp8_gemm("swiglu", 256, 256, 4, 16, tvm_ffi=True),
                     compile_quantize_rows(256, tvm_ffi=True)):
        assert callable(getattr(compiled, "__tvm_ffi_object__", None))


# ------------------------------------------------------------------------------ (b) reference
def _e4m3_f64(u8: torch.Tensor) -> torch.Tensor:
    """e4m3 bits -> float64 by hand: s eeee mmm, bias 7, subnormals, 0x7f / 0xff NaN."""
    b = u8.view(torch.uint8).to(torch.int64)
    s = torch.where(b >> 7 == 1, -1.0, 1.0).double()
    ex = (b >> 3) & 0xF
    man = (b & 7).double()
    val = torch.where(ex == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.exp2((ex - 7).double()))
    val = torch.where((b & 0x7F) == 0x7F, float("nan"), val)
    return s * val


def _scale_f64(codes: torch.Tensor) -> torch.Tensor:
    c = codes.view(torch.uint8).to(torch.int64)
    return torch.tensor([2.0 ** (int(v) - 127) for v in c.reshape(-1)], dtype=torch.float64).reshape(c.shape)


def _float64_grouped(x, xs, w, ws, offs, epilogue, rs, consts=None):
    """Independent route: hand-decoded fp8, scales applied per 32-column block, per-token
    expert lookup by searchsorted, one einsum."""
    m, k = x.shape
    xd = (_e4m3_f64(x).reshape(m, k // 32, 32) * _scale_f64(xs)[..., None]).reshape(m, k)
    e, n, _ = w.shape
    wd = (_e4m3_f64(w).reshape(e, n, k // 32, 32) * _scale_f64(ws)[..., None]).reshape(e, n, k)
    expert = torch.searchsorted(offs[1:].to(torch.int64), torch.arange(m), right=True)
    h = torch.einsum("mk,mnk->mn", xd, wd[expert])
    if epilogue in GATED_EPILOGUES:
        return gated_f64(epilogue, h[:, : n // 2], h[:, n // 2:], dict(ACTIVATION_CONSTANT_DEFAULTS, **(consts or {})))
    if epilogue == "row_scale":
        return h * rs.double()[:, None]
    return h


_SMALL_CLAMP = {"swiglu_alpha": 1.0, "swiglu_limit": 0.5, "swiglu_beta": 0.0, "swiglu_limit_after_act": True}


@pytest.mark.parametrize("epilogue,consts", [(e, None) for e in EPILOGUES]
                         + [("clamped_swiglu", _SMALL_CLAMP), ("clamped_swiglu", {"swiglu_limit": 0.5}),
                            ("softcapped_swiglu", {"gate_softcap": 0.5, "up_softcap": 0.25})])
def test_reference_matches_float64(epilogue, consts):
    counts = [6, 0, 1, 17, 9, 3]  # an empty expert and a 1-token expert
    x, xs, w, ws, offs, rs = _inputs(96, 256, counts, seed=1)
    ref = grouped_gemm_reference(x, xs, w, ws, offs, epilogue, rs if epilogue == "row_scale" else None,
                                 **(consts or {}))
    want = _float64_grouped(x, xs, w, ws, offs, epilogue, rs, consts)
    assert ref.shape == want.shape == (sum(counts), 48 if epilogue in GATED_EPILOGUES else 96)
    assert torch.isfinite(want).all()
    err = (ref.double() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-5, err


# ------------------------------------------------------------------------------ (c) quantiser
def _assert_same_quant(x):
    from moe_ep.backends.quant import quantize_mxfp8  # the test may import moe_ep; the drop may not

    v, s = quantize_rows_reference(x)
    q = quantize_mxfp8(x)
    assert v.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(v.view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8), q.scale.view(torch.uint8))


def test_quantize_reference_bit_identical_random():
    g = torch.Generator().manual_seed(2)
    for m, k, spread in ((64, 1024, 30), (7, 4096, 4), (33, 768, 60)):
        x = torch.randn(m, k, generator=g) * torch.exp2(
            torch.randint(-spread, spread + 1, (m, k // 32, 1), generator=g).float()
        ).repeat_interleave(32, dim=1).reshape(m, k)
        _assert_same_quant(x.to(torch.bfloat16))


def test_quantize_reference_bit_identical_edge_blocks():
    x = torch.zeros(8, 256, dtype=torch.float32)
    x[0, 32:64] = 1.75 * 2.0 ** 3            # amax / 448 is exactly a power of two
    x[0, 64:96] = 1.7578125 * 2.0 ** 3       # the next bf16 up
    x[1, :32] = 2.0 ** -130                  # bf16 subnormals (amax < 2^-120: exponent -127)
    x[1, 32:64] = torch.linspace(-1, 1, 32) * 2.0 ** -121
    x[2, :32] = 3.0e38                       # near the bf16 maximum
    x[2, 32:64] = -448.0
    x[3, :32] = -0.0
    x[4, :] = torch.linspace(-5, 5, 256)
    _assert_same_quant(x.to(torch.bfloat16))  # row 0 also starts with a block of zeros


def test_quantize_reference_bit_identical_every_bf16_amax():
    """Every finite positive bf16 value once as the amax of a block (with smaller, signed
    neighbours): the bit-level exponent rule equals torch's ceil(log2(amax / 448))."""
    codes = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = codes.view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(3)
    frac = torch.rand(amax.shape[0], 31, generator=g) * 2 - 1
    blocks = torch.cat([amax[:, None], amax[:, None] * frac], dim=1)
    _assert_same_quant(blocks.to(torch.bfloat16))


# ------------------------------------------------------------------------------ (d) can_implement
@pytest.mark.parametrize("args,needle", [
    (("gelu", 256, 256, 8), "epilogue"),
    (("swiglu", 256, 200, 8), "K=200"),
    (("swiglu", 256, 2880, 8), "K=2880"),             # % 32 but not % 128
    (("row_scale", 260, 256, 8), "N_out=260"),
    (("swiglu", 257, 256, 8), "even N"),
    (("swiglu", 2 * 100, 256, 8), "N_out=100"),
    (("row_scale", 256, 256, 0), "num_experts"),
    (("row_scale", 256, 256, 5000), "num_experts"),
    (("row_scale", 256, 256, 8, 24), "tile_tokens"),
    (("row_scale", 256, 256, 8, 16, 1), "num_stages"),
])
def test_can_implement_refuses(args, needle):
    reason = can_implement(*args)
    assert isinstance(reason, str) and needle in reason, reason
    with pytest.raises(ValueError, match=re.escape(needle)):  # the compile refuses for the same reason
        compile_mxfp8_gemm(*args)


def test_can_implement_accepts_and_helpers():
    assert can_implement("swiglu", 1536, 2048, 128, 16) is None
    assert can_implement("row_scale", 2880, 2816, 32, 128) is None   # N not a tile multiple
    assert quantize_can_implement(2880) is None
    assert "K=40" in quantize_can_implement(40)
    assert pick_tile_tokens(1, 128) == 8 and pick_tile_tokens(128 * 8, 128) == 8
    assert pick_tile_tokens(16 * 128, 128) == 16 and pick_tile_tokens(10 ** 6, 8) == 64
    kern = Mxfp8GroupedGemmSm120("swiglu", 16)
    assert kern.static_shapes(1536, 2048) == (768, 12, 16)


# ------------------------------------------------------------------------------ (e) emulation
@pytest.mark.parametrize("epilogue,n,tile_tokens,counts", [
    ("swiglu", 144, 8, [5, 0, 1, 13, 20]),       # I = 72: the second tile is ragged
    ("row_scale", 136, 16, [5, 0, 1, 13, 20]),
    ("identity", 136, 128, [0, 1, 130, 7]),      # 8 MMA warps, 2 token tiles for one expert
    ("swiglu", 128, 32, [40, 3]),
    ("clamped_swiglu", 144, 16, [5, 0, 1, 13, 20]),  # drop v2: the gated mapping carries every gate
    ("softcapped_swiglu", 144, 8, [5, 0, 1, 13, 20]),
])
def test_emulated_kernel_matches_reference(epilogue, n, tile_tokens, counts):
    x, xs, w, ws, offs, rs = _inputs(n, 256, counts, seed=4)
    consts = {"swiglu_limit": 0.5} if epilogue == "clamped_swiglu" else {}
    kern = Mxfp8GroupedGemmSm120(epilogue, tile_tokens, **consts)
    row_scale = rs if epilogue == "row_scale" else None
    em = emulate_grouped_gemm(kern, x, xs, w, ws, offs, row_scale)
    ref = grouped_gemm_reference(x, xs, w, ws, offs, epilogue, row_scale, **consts)
    assert torch.isfinite(em).all()
    err = (em - ref.double()).abs().max().item() / ref.abs().max().item()
    assert err < 1e-6, err


class _NoSwizzleXor(Mxfp8GroupedGemmSm120):
    def w_ldsm_chunk(self, kk, lane):  # forgets the 128-byte swizzle
        return 2 * kk + lane // 16


class _SwappedScaleLanes(Mxfp8GroupedGemmSm120):
    def w_sf_row(self, wm, a, lane):  # rows g and g + 8 swapped
        return self._srow(2 * wm + a, 8 * (1 - lane % 2) + lane // 4)


@pytest.mark.parametrize("cls", [_NoSwizzleXor, _SwappedScaleLanes])
def test_emulation_catches_broken_index_maps(cls):
    x, xs, w, ws, offs, rs = _inputs(136, 256, [9, 0, 4], seed=5)
    # the swapped scale lanes only show when the two rows' scales differ: vary them per row
    ws = (ws.view(torch.uint8).to(torch.int32)
          + torch.arange(136, dtype=torch.int32)[None, :, None] % 3).to(torch.uint8).view(ws.dtype)
    ref = grouped_gemm_reference(x, xs, w, ws, offs, "identity")
    em = emulate_grouped_gemm(cls("identity", 16), x, xs, w, ws, offs)
    err = (em - ref.double()).abs().max().item() / ref.abs().max().item()
    assert err > 1e-2, err


# ------------------------------------------------------------------------------ (f) drop v2: gates
def test_v2_gates_are_compiled_in_and_checked():
    """Each activation constant is compile-time (a different one, different PTX); the epilogues
    without constants ignore them; unusable ones are refused by name; the limit binds on these inputs."""
    from sm120_mxfp8 import check_activation_constants
    from sm120_mxfp8.launch import activation_constants

    def ptx(epi, **c):
        return compile_mxfp8_gemm(epi, 256, 256, 4, 16, extra_options="--keep-ptx", **c).__ptx__

    base = ptx("clamped_swiglu")
    for change in ({"swiglu_alpha": 1.0}, {"swiglu_limit": 10.0}, {"swiglu_beta": 0.0},
                   {"swiglu_limit_after_act": True}):
        assert ptx("clamped_swiglu", **change) != base, change
    assert ptx("softcapped_swiglu", up_softcap=5.0) != ptx("softcapped_swiglu")
    assert ptx("swiglu", swiglu_limit=3.0) == ptx("swiglu")
    assert activation_constants("gelu_glu", gate_softcap=1.0) == {}
    with pytest.raises(ValueError, match="swiglu_limit > 0"):
        Mxfp8GroupedGemmSm120("clamped_swiglu", 16, swiglu_limit=float("inf"))
    with pytest.raises(ValueError, match="gate_softcap"):
        Mxfp8GroupedGemmSm120("softcapped_swiglu", 16, gate_softcap=0.0)
    assert check_activation_constants("clamped_swiglu", 1.702, 7.0, float("nan"), 4.0, 25.0) is not None
    assert can_implement("gelu_tanh_glu", 257, 256, 8) is not None  # odd N
    x, xs, w, ws, offs, rs = _inputs(96, 256, [6, 0, 1, 17, 9, 3], seed=1)
    h = grouped_gemm_reference(x, xs, w, ws, offs, "identity")
    assert float((h[:, :48].abs() > 0.5).float().mean()) > 0.2 and float((h[:, 48:].abs() > 0.5).float().mean()) > 0.2
