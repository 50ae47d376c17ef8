"""CPU tests of the sm100_w4a16 kernel drop (kernel_src/sm100/w4a16/src/sm100_w4a16).

(a) every epilogue compiles for sm_100a from fake tensors; the PTX holds tcgen05.mma and the
    dequant path; ptxas (if installed) assembles it with no spills, and the shared memory the
    launch asks for fits in 227 KB;
(b) the torch reference agrees with an independent float64 computation (arithmetic bit decode of
    E2M1 and E4M3, float64 matmul) on ragged routing with an empty expert;
(c) can_implement / the constructor refuse unsupported problems with a reason.

The drop is imported by its own top-level name with its ``src/`` folder on sys.path (the shim
integration comes later); nothing here imports moe_ep.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

# the drop tree the installed moe_ep uses (an installed copy, not this checkout, on the GPU host),
# registered through the shim so later shim imports in this process find the same modules
from moe_ep.shim import drop_src, register_drop  # noqa: E402

_SRC = drop_src("sm100", "w4a16")
register_drop(_SRC)

cute = pytest.importorskip("cutlass.cute")

import sm100_w4a16  # noqa: E402
from sm100_w4a16 import W4A16GroupedGemmSm100, can_implement  # noqa: E402
from sm100_w4a16.compile_check import check_ptx, find_ptxas, ptxas_info, same_signature_as_torch  # noqa: E402
from sm100_w4a16.constants import SMEM_CAPACITY_BYTES  # noqa: E402
from sm100_w4a16.grouped_gemm_runner import make_nvfp4_weights  # noqa: E402
from sm100_w4a16.launch import compile_w4a16_gemm  # noqa: E402
from sm100_w4a16.reference import dequant_nvfp4, w4a16_grouped_gemm_reference  # noqa: E402


# --------------------------------------------------------------------------- (a) compile
@pytest.mark.parametrize("epilogue,n,k", [
    ("squared_relu", 1856, 2688),   # Nemotron FC1
    ("row_scale", 2688, 1856),      # Nemotron FC2
    ("swiglu", 2 * 1856, 2688),
    ("identity", 200, 256),         # N not a multiple of the tile
    ("gelu_glu", 2 * 704, 2816),    # drop v2: Gemma 4's FC1 shape (I 704: 5.5 tiles)
    ("gelu_tanh_glu", 2 * 704, 2816),
    ("clamped_swiglu", 2 * 2880, 2880),     # drop v3: gpt-oss's FC1 shape
    ("softcapped_swiglu", 2 * 1536, 4608),  # drop v3: an Inkling2-size FC1
])
def test_compiles_for_sm100a(epilogue, n, k):
    compiled, kernel = compile_w4a16_gemm(epilogue, n, k, num_experts=128, return_kernel=True)
    ptx = compiled.__ptx__
    assert ".target sm_100a" in ptx
    assert "tcgen05.mma" in ptx
    assert "cvt.rn.f16x2.e2m1x2" in ptx and "mul.rn.f16x2" in ptx  # the dequant path
    assert check_ptx(ptx) == []
    if epilogue == "gelu_tanh_glu":  # g * sigmoid(2 z): one ex2 + one rcp per output, no tanh
        assert "ex2.approx" in ptx and "rcp.approx" in ptx and "tanh.approx" not in ptx
    if epilogue == "clamped_swiglu":  # two clamps of the gate / up values, the sigmoid by ex2 + rcp
        assert "min.f32" in ptx and "max.f32" in ptx and "ex2.approx" in ptx and "tanh.approx" not in ptx
    if epilogue == "softcapped_swiglu":  # three tanh per output, no ex2
        assert ptx.count("tanh.approx.f32") >= 3 and "ex2.approx" not in ptx
    assert kernel.smem_size <= SMEM_CAPACITY_BYTES
    if find_ptxas() is None:
        pytest.skip("ptxas not installed: PTX checks only")
    regs, spill, static_smem = ptxas_info(ptx, "sm_100a")
    assert 0 < regs <= 168  # 320 threads: 10 warps, 3 on one SM sub-partition
    assert spill == 0
    assert kernel.smem_size + static_smem <= 227 * 1024


def test_fake_signature_matches_torch_tensors():
    assert same_signature_as_torch("row_scale", 384, 512, 4)


# --------------------------------------------------------------------------- (b) reference
def _decode_e2m1_f64(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> float64 [..., K] by the E2M1 bit fields (s, e1e0, m), bias 1."""
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.int64)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    sign = np.where(codes & 8, -1.0, 1.0)
    e = (codes >> 1) & 3
    m = codes & 1
    mag = np.where(e == 0, 0.5 * m, np.ldexp(1.0 + 0.5 * m, e - 1))
    return sign * mag


def _decode_e4m3_f64(raw: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn bytes -> float64 by the bit fields (s, eeee, mmm), bias 7, no infinities."""
    raw = raw.astype(np.int64)
    sign = np.where(raw & 0x80, -1.0, 1.0)
    e = (raw >> 3) & 0xF
    m = raw & 7
    mag = np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return sign * mag


def _independent_f64(a, values, block_scale, global_scale, offsets, epilogue, row_scale, consts=None, bias=None):
    c = dict(sm100_w4a16.ACTIVATION_CONSTANT_DEFAULTS, **(consts or {}))
    w = _decode_e2m1_f64(values.numpy()) * np.repeat(
        _decode_e4m3_f64(block_scale.view(torch.uint8).numpy()), 16, axis=-1)
    a64 = a.double().numpy()
    e_count, n, _ = w.shape
    n_out = n // 2 if epilogue in sm100_w4a16.GATED_EPILOGUES else n
    out = np.zeros((a.shape[0], n_out))
    offs = offsets.tolist()
    for e in range(e_count):
        lo, hi = offs[e], offs[e + 1]
        y = a64[lo:hi] @ w[e].T * float(global_scale[e])
        if bias is not None:  # drop v4: before the epilogue
            y = y + bias[e].double().numpy()
        if epilogue == "squared_relu":
            y = np.maximum(y, 0.0) ** 2
        elif epilogue == "row_scale":
            y = y * row_scale.double().numpy()[lo:hi, None]
        elif epilogue == "swiglu":
            g, u = y[:, :n_out], y[:, n_out:]
            y = g / (1.0 + np.exp(-g)) * u
        elif epilogue == "gelu_glu":  # from the erf definition
            g, u = y[:, :n_out], y[:, n_out:]
            y = 0.5 * g * (1.0 + np.vectorize(math.erf, otypes=[float])(g / math.sqrt(2.0))) * u
        elif epilogue == "gelu_tanh_glu":  # from the tanh formula
            g, u = y[:, :n_out], y[:, n_out:]
            y = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
        elif epilogue == "clamped_swiglu":  # gpt-oss's definition, numpy clips
            g, u = y[:, :n_out], np.clip(y[:, n_out:], -c["swiglu_limit"], c["swiglu_limit"]) + c["swiglu_beta"]
            if c["swiglu_limit_after_act"]:
                y = u * np.minimum(g / (1.0 + np.exp(-c["swiglu_alpha"] * g)), c["swiglu_limit"])
            else:
                g = np.minimum(g, c["swiglu_limit"])
                y = u * g / (1.0 + np.exp(-c["swiglu_alpha"] * g))
        elif epilogue == "softcapped_swiglu":
            g, u = y[:, :n_out], y[:, n_out:]
            cg, cu = c["gate_softcap"], c["up_softcap"]
            y = cg * np.tanh(g / cg) / (1.0 + np.exp(-g)) * cu * np.tanh(u / cu)
        out[lo:hi] = y
    return out


_V3_CONSTS = {"swiglu_alpha": 1.0, "swiglu_limit": 3.0, "swiglu_beta": 0.0, "swiglu_limit_after_act": True}


def _reference_case():
    """The float64 check's problem: 5 experts, N 48, K 128, rows ``[37, 0, 129, 1, 64]`` (an empty
    expert, a partial tile, a single row): ``(a, values, block_scale, global_scale, offsets, row_scale)``."""
    gen = torch.Generator().manual_seed(7)
    e_count, n, k = 5, 48, 128
    counts = [37, 0, 129, 1, 64]
    offsets = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    m_total = int(offsets[-1])
    a = torch.randn(m_total, k, generator=gen).to(torch.bfloat16)
    values, block_scale, global_scale = make_nvfp4_weights(e_count, n, k, gen)
    row_scale = torch.rand(m_total, generator=gen)
    return a, values, block_scale, global_scale, offsets, row_scale


@pytest.mark.parametrize("epilogue,consts", [(e, None) for e in ("squared_relu", "row_scale", "swiglu", "identity",
                                                                  "gelu_glu", "gelu_tanh_glu", "clamped_swiglu",
                                                                  "softcapped_swiglu")]
                         + [("clamped_swiglu", _V3_CONSTS), ("softcapped_swiglu", {"gate_softcap": 2.0,
                                                                                    "up_softcap": 5.0})])
def test_reference_matches_float64(epilogue, consts):
    a, values, block_scale, global_scale, offsets, row_scale = _reference_case()
    got = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, epilogue,
                                       row_scale if epilogue == "row_scale" else None, **(consts or {}))
    want = _independent_f64(a, values, block_scale, global_scale, offsets, epilogue, row_scale, consts)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.isfinite(want).all()
    err = np.abs(got.double().numpy() - want).max()
    assert err <= 1e-5 * np.abs(want).max(), err
    # the expert with no rows is never read: NaN block scales there change nothing
    assert torch.isfinite(got).all()
    nan_scales = block_scale.clone()
    nan_scales[1] = float("nan")
    again = w4a16_grouped_gemm_reference(a, values, nan_scales, global_scale, offsets, epilogue,
                                         row_scale if epilogue == "row_scale" else None, **(consts or {}))
    assert torch.equal(again, got)


def test_dequant_covers_every_code():
    """All 16 E2M1 codes and both nibble positions decode as in moe_ep's NVFP4 table."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 16, 16)  # [E, N, K/2]
    scale = torch.ones(1, 16, 2, dtype=torch.float32).to(torch.float8_e4m3fn)
    w = dequant_nvfp4(codes, scale)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for byte in range(256):
        lo, hi = byte & 0xF, byte >> 4
        exp = [(-1.0 if c & 8 else 1.0) * table[c & 7] for c in (lo, hi)]
        got = w[0, byte // 16, 2 * (byte % 16): 2 * (byte % 16) + 2].tolist()
        assert got == exp, (byte, got, exp)


# --------------------------------------------------------------------------- (c) refusals
def test_can_implement_reasons():
    assert can_implement("squared_relu", 1856, 2688, 128) is None
    assert can_implement("row_scale", 2688, 1856, 128) is None
    assert can_implement("swiglu", 2 * 1856, 2688, 128) is None
    r = can_implement("squared_relu", 1856, 2688 + 32, 128)
    assert r is not None and "K=2720" in r and "64" in r
    r = can_implement("squared_relu", 1852, 2688, 128)
    assert r is not None and "N_out=1852" in r and "8" in r
    r = can_implement("swiglu", 2 * 1856 + 1, 2688, 128)
    assert r is not None and "even N" in r
    r = can_implement("swiglu", 2 * 1856, 2688, 128, tile_n=256)
    assert r is not None and "tile_n" in r
    assert "experts" in can_implement("row_scale", 2688, 1856, 0)
    assert "epilogue" in can_implement("gelu", 2688, 1856, 8)
    r = can_implement("gelu_tanh_glu", 2 * 704 + 1, 2816, 128)
    assert r is not None and "even N" in r


def test_constructor_refusals():
    with pytest.raises(NotImplementedError, match="gelu"):
        W4A16GroupedGemmSm100("gelu")
    with pytest.raises(ValueError, match="tile_n"):
        W4A16GroupedGemmSm100("squared_relu", tile_n=96)
    k = W4A16GroupedGemmSm100("squared_relu")
    with pytest.raises(ValueError, match="K=100"):
        k.static_shapes(1856, 100)
    with pytest.raises(ValueError, match="K=2700"):
        compile_w4a16_gemm("squared_relu", 1856, 2700, 8)
    assert k.static_shapes(1856, 2688) == (1856, 15)
    assert W4A16GroupedGemmSm100("swiglu").static_shapes(2 * 1856, 2688) == (1856, 15)


def test_drop_metadata():
    assert sm100_w4a16.DROP_VERSION == 4 and sm100_w4a16.BIAS_DTYPES == ("float32", "bfloat16")
    assert set(sm100_w4a16.EPILOGUES) >= {"squared_relu", "row_scale", "swiglu", "gelu_glu", "gelu_tanh_glu",
                                          "clamped_swiglu", "softcapped_swiglu"}
    assert sm100_w4a16.SF_BLOCK == 16 and sm100_w4a16.TILE_K == 64


def test_launcher_validates_without_launching():
    """The torch launcher checks shapes / dtypes on the host and returns at once for M_total = 0
    (no GPU needed for either; a real launch needs an SM100 GPU)."""
    from sm100_w4a16.launch import CompiledW4A16Gemm

    fn = CompiledW4A16Gemm("squared_relu", 256, 128, 3, compiled=object())  # no compile
    gen = torch.Generator().manual_seed(0)
    values, block_scale, global_scale = make_nvfp4_weights(3, 256, 128, gen)
    offsets = torch.zeros(4, dtype=torch.int32)
    out = fn(torch.zeros(0, 128, dtype=torch.bfloat16), values, block_scale, global_scale, offsets)
    assert tuple(out.shape) == (0, 256) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="values"):
        fn(torch.zeros(0, 128, dtype=torch.bfloat16), values[:, :128], block_scale, global_scale, offsets)
    with pytest.raises(ValueError, match="offsets"):
        fn(torch.zeros(0, 128, dtype=torch.bfloat16), values, block_scale, global_scale, offsets[:3])


# --------------------------------------------------------------------------- drop v3: activation constants
def test_clamps_bind_in_the_reference_case():
    """The float64 check above exercises the clamps and caps: with these inputs some gate and up
    values pass the limit (so a reference that ignored it would fail)."""
    a, values, block_scale, global_scale, offsets, _ = _reference_case()  # the very inputs of that check
    y = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, "identity")
    assert float(y.abs().max()) > 7.0 and float((y.abs() > 3.0).float().mean()) > 0.05
    base = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, "clamped_swiglu")
    other = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, "clamped_swiglu",
                                         **_V3_CONSTS)
    assert not torch.allclose(base, other)


def test_activation_constants_are_compiled_in():
    """Each constant is a compile-time value: a different one gives different PTX, and the kernel's
    other epilogues ignore them (the same PTX whatever is passed)."""
    from sm100_w4a16.launch import activation_constants

    def ptx(epi, **c):
        return compile_w4a16_gemm(epi, 2 * 256, 512, 4, **c).__ptx__

    base = ptx("clamped_swiglu")
    for change in ({"swiglu_alpha": 1.0}, {"swiglu_limit": 10.0}, {"swiglu_beta": 0.0},
                   {"swiglu_limit_after_act": True}):
        assert ptx("clamped_swiglu", **change) != base, change
    assert ptx("softcapped_swiglu", gate_softcap=3.0) != ptx("softcapped_swiglu")
    assert ptx("swiglu", swiglu_limit=3.0) == ptx("swiglu")
    assert activation_constants("swiglu", swiglu_limit=3.0) == {}
    assert activation_constants("softcapped_swiglu") == {"gate_softcap": 4.0, "up_softcap": 25.0}


def test_activation_constant_refusals():
    from sm100_w4a16 import check_activation_constants

    with pytest.raises(ValueError, match="swiglu_limit > 0"):
        W4A16GroupedGemmSm100("clamped_swiglu", swiglu_limit=0.0)
    with pytest.raises(ValueError, match="swiglu_alpha"):
        W4A16GroupedGemmSm100("clamped_swiglu", swiglu_alpha=float("nan"))
    with pytest.raises(ValueError, match="up_softcap > 0"):
        W4A16GroupedGemmSm100("softcapped_swiglu", up_softcap=-1.0)
    W4A16GroupedGemmSm100("swiglu", swiglu_limit=0.0)  # ignored by the other epilogues
    assert check_activation_constants("softcapped_swiglu", 1.702, 7.0, 1.0, 4.0, float("inf")) is not None
    assert check_activation_constants("clamped_swiglu", 1.702, 7.0, 0.0, 4.0, 25.0) is None


# --------------------------------------------------------------------------- drop v4: per-expert biases
@pytest.mark.parametrize("epilogue,bias_dtype", [("clamped_swiglu", torch.float32), ("row_scale", torch.bfloat16),
                                                 ("squared_relu", torch.float32), ("gelu_tanh_glu", torch.bfloat16)])
def test_reference_with_bias_matches_float64(epilogue, bias_dtype):
    gen = torch.Generator().manual_seed(9)
    e_count, n, k = 5, 48, 128
    offsets = torch.tensor([0, 37, 37, 166, 167, 231], dtype=torch.int32)
    a = torch.randn(231, k, generator=gen).to(torch.bfloat16)
    values, block_scale, global_scale = make_nvfp4_weights(e_count, n, k, gen)
    row_scale = torch.rand(231, generator=gen)
    bias = (3.0 * torch.randn(e_count, n, generator=gen)).to(bias_dtype)
    rs = row_scale if epilogue == "row_scale" else None
    got = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, epilogue, rs, bias)
    want = _independent_f64(a, values, block_scale, global_scale, offsets, epilogue, row_scale, bias=bias)
    err = np.abs(got.double().numpy() - want).max()
    assert err <= 1e-5 * np.abs(want).max(), err
    plain = w4a16_grouped_gemm_reference(a, values, block_scale, global_scale, offsets, epilogue, rs)
    assert float((got - plain).abs().max()) > 0.1  # the bias is applied


@pytest.mark.parametrize("epilogue,n,k,bias_dtype", [
    ("clamped_swiglu", 2 * 2880, 2880, torch.float32),  # gpt-oss FC1
    ("row_scale", 2880, 2880, torch.bfloat16),          # gpt-oss FC2
    ("swiglu", 2 * 1856, 2688, torch.bfloat16),
    ("squared_relu", 200, 256, torch.float32),           # N not a multiple of the tile: clamped bias index
])
def test_bias_variants_compile(epilogue, n, k, bias_dtype):
    """A bias is a trailing kernel argument ([E, N], its dtype loaded and widened in the epilogue); a
    gated epilogue with one loads 16 accumulator columns at a time so it stays in registers."""
    compiled, kernel = compile_w4a16_gemm(epilogue, n, k, 128, bias_dtype=bias_dtype, return_kernel=True)
    ptx = compiled.__ptx__
    assert check_ptx(ptx) == []
    gated = epilogue in sm100_w4a16.GATED_EPILOGUES
    assert ("tcgen05.ld.sync.aligned.32x32b.x16" in ptx) == gated
    plain = compile_w4a16_gemm(epilogue, n, k, 128).__ptx__
    assert ptx.count(".param") > plain.count(".param")  # the bias: a kernel argument
    assert ptx.count("ld.global") > plain.count("ld.global")  # and its loads in the epilogue
    if find_ptxas() is None:
        pytest.skip("ptxas not installed: PTX checks only")
    regs, spill, _ = ptxas_info(ptx, "sm_100a")
    assert spill == 0 and regs <= 168


def test_launcher_checks_the_bias():
    from sm100_w4a16.launch import CompiledW4A16Gemm

    gen = torch.Generator().manual_seed(0)
    values, block_scale, global_scale = make_nvfp4_weights(3, 256, 128, gen)
    offsets = torch.zeros(4, dtype=torch.int32)
    a = torch.zeros(0, 128, dtype=torch.bfloat16)
    with_bias = CompiledW4A16Gemm("squared_relu", 256, 128, 3, compiled=object(), bias_dtype=torch.float32)
    without = CompiledW4A16Gemm("squared_relu", 256, 128, 3, compiled=object())
    good = torch.zeros(3, 256)
    assert tuple(with_bias(a, values, block_scale, global_scale, offsets, bias=good).shape) == (0, 256)
    with pytest.raises(ValueError, match="compiled with a torch.float32 bias"):
        with_bias(a, values, block_scale, global_scale, offsets)
    with pytest.raises(ValueError, match="compiled without a bias"):
        without(a, values, block_scale, global_scale, offsets, bias=good)
    for bad in (good.to(torch.bfloat16), torch.zeros(3, 128), torch.zeros(256, 3).t()):
        with pytest.raises(ValueError, match="bias: expected"):
            with_bias(a, values, block_scale, global_scale, offsets, bias=bad)
    with pytest.raises(ValueError, match="bias_dtype"):
        CompiledW4A16Gemm("squared_relu", 256, 128, 3, compiled=object(), bias_dtype=torch.float16)
