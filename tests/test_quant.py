"""Block-scaled weight formats (NVFP4, MXFP8): round-trip error bounds against float64, exact
codes on hand-picked values, and the reference backend running both formats against a float64
oracle of the quantised model (CPU)."""

import math

import pytest
import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer
from moe_ep.api.quant import (MXFP8Tensor, NVFP4Weight, dequantize_fp8_block128,
                              dequantize_fp8_rows128, dequantize_mxfp8, dequantize_nvfp4, quantize_fp8_block128,
                              quantize_fp8_rows128, quantize_mxfp8, quantize_nvfp4)

from moe_oracle import rel_err


def weights(shape, seed, spread=True):
    """Random weights whose blocks span several orders of magnitude (and one all-zero block)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    if spread:
        w = w * torch.exp2(torch.randint(-12, 4, (*shape[:-1], shape[-1] // 16), generator=g).float()
                           ).repeat_interleave(16, -1)
        w[0, 0, :32] = 0.0
    return w.to(torch.bfloat16)


def test_nvfp4_round_trip_bound():
    w = weights((6, 40, 256), 1)
    q = quantize_nvfp4(w)
    assert q.values.dtype == torch.uint8 and q.values.shape == (6, 40, 128)
    assert q.block_scale.dtype == torch.float8_e4m3fn and q.block_scale.shape == (6, 40, 16)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (6,) and q.shape == w.shape
    wd = w.double()
    err = (dequantize_nvfp4(q).double() - wd).abs()
    amax_b = wd.abs().reshape(6, 40, 16, 16).amax(-1).repeat_interleave(16, -1)
    amax_e = wd.abs().amax(dim=(1, 2))[:, None, None]
    bound = amax_b * (1 / 6 + 1 / 16) + amax_e * 6 * 2.0 ** -10 / 2688
    assert (err <= bound).all(), float((err / bound).max())
    assert err[0, 0, :32].max() == 0  # a zero block stays zero
    assert 0.03 < rel_err(dequantize_nvfp4(q), w) < 0.15  # FP4: about 10 % in norm


def test_nvfp4_exact_codes():
    """Values on the E2M1 grid times a power-of-two block scale come back exactly; nibble order."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6])
    w = (grid * 0.25).reshape(1, 1, 16).repeat(1, 2, 1)
    q = quantize_nvfp4(w)
    assert torch.equal(dequantize_nvfp4(q), w)
    # element 0 (0.0) in the low nibble, element 1 (0.5 -> code 1) in the high nibble of byte 0
    assert int(q.values[0, 0, 0]) == (0 | (1 << 4))
    assert int(q.values[0, 0, 4]) == (9 | (10 << 4))  # -0.5 -> 8+1, -1 -> 8+2


def test_mxfp8_round_trip_bound_and_exact_in_bf16():
    w = weights((3, 20, 128), 2)
    q = quantize_mxfp8(w)
    assert q.values.dtype == torch.float8_e4m3fn and q.values.shape == w.shape
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (3, 20, 4)
    d = dequantize_mxfp8(q)
    scale = q.scale.double().repeat_interleave(32, -1)
    err = (d.double() - w.double()).abs()
    assert (err <= w.double().abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()
    assert torch.equal(d.to(torch.bfloat16).float(), d)  # dequantised values are bf16 numbers
    assert (q.values.float().abs().amax(-1) <= 448).all()  # the rounded-up scale never saturates
    assert rel_err(d, w) < 0.04


@pytest.mark.parametrize("fn,bad,exc,frag", [
    (quantize_nvfp4, torch.zeros(2, 3, 24), ValueError, r"w: the last dimension \(24\) must be a multiple of 16"),
    (quantize_nvfp4, torch.zeros(3, 32), ValueError, "w must have at least 3 dimensions"),
    (quantize_mxfp8, torch.zeros(3, 48), ValueError, r"w: the last dimension \(48\) must be a multiple of 32"),
    (quantize_mxfp8, torch.zeros(3, 32, dtype=torch.int32), TypeError, "w must be a bf16/fp16/fp32 tensor"),
    (quantize_mxfp8, torch.full((1, 32), float("nan")), ValueError, "w holds non-finite values"),
])
def test_bad_inputs(fn, bad, exc, frag):
    with pytest.raises(exc, match=frag):
        fn(bad)


def _fake_mxfp8(t):
    return dequantize_mxfp8(quantize_mxfp8(t.float())).double()


def _fake_fp8_rows(t):
    return dequantize_fp8_rows128(*quantize_fp8_rows128(t.float())).double()


def oracle_quantized(cfg, x, ids, w, w13, w2):
    """float64, one (token, k) pair at a time, on the quantised model: weights dequantised (NVFP4:
    rounded to bf16, as the W4A16 kernels use them); the activation is rounded to bf16, and MXFP8 /
    FP8 block-128 then quantise it and FC1's input row in their format."""
    deq = {"nvfp4_w4a16": dequantize_nvfp4, "mxfp8": dequantize_mxfp8, "fp8_block128": dequantize_fp8_block128}
    fake = {"mxfp8": _fake_mxfp8, "fp8_block128": _fake_fp8_rows}.get(cfg.quant)
    W13, W2 = deq[cfg.quant](w13), deq[cfg.quant](w2)
    if cfg.quant == "nvfp4_w4a16":
        W13, W2 = W13.to(torch.bfloat16), W2.to(torch.bfloat16)
    W13, W2 = W13.double(), W2.double()
    I = cfg.intermediate
    out = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = fake(x[t:t + 1])[0] if fake else x[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = W13[e] @ xt
            a = h[:I] * torch.sigmoid(h[:I]) * h[I:]
            a = a.to(torch.bfloat16).double()  # the kernels write the activation in bf16 ...
            a = fake(a[None])[0] if fake else a  # ... and quantise that
            out[t] += float(w[t, k]) * (W2[e] @ a)
    return out


@pytest.mark.parametrize("quant", ["nvfp4_w4a16", "mxfp8", "fp8_block128"])
def test_reference_backend_runs_the_formats(quant):
    E, H, I, K, T = 8, 128, 64, 2, 37
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, quant=quant)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randn(T, E, generator=g).topk(K, -1).indices
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w13_bf = weights((E, 2 * I, H), 3, spread=False) * H ** -0.5
    w2_bf = weights((E, H, I), 4, spread=False) * I ** -0.5
    qf = {"nvfp4_w4a16": quantize_nvfp4, "mxfp8": quantize_mxfp8, "fp8_block128": quantize_fp8_block128}[quant]
    want = oracle_quantized(cfg, x, ids, w, qf(w13_bf), qf(w2_bf))
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, qf(w13_bf), qf(w2_bf))
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2, rel_err(got, want)
    # the format matters: the same layer on the unquantised weights is measurably different
    bf = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T)
    with MoELayer(bf, EPGroup.single(), backend="reference", device="cpu") as layer:
        plain = layer.forward(x, ids, w, w13_bf, w2_bf)
    assert rel_err(plain, want) > (0.03 if quant == "nvfp4_w4a16" else 0.005)
    if quant == "fp8_block128":  # raw float8_e4m3fn weights + scales, as a checkpoint stores them
        q13, q2 = qf(w13_bf), qf(w2_bf)
        with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
            raw = layer.forward(x, ids, w, q13.values, q2.values, w13_scale=q13.scale, w2_scale=q2.scale)
        assert torch.equal(raw, got)


def test_quant_validation():
    with pytest.raises(ValueError, match="MoEConfig.quant 'int4'"):
        MoEConfig(num_experts=8, hidden=128, intermediate=64, top_k=2, max_tokens_per_rank=8, quant="int4")
    with pytest.raises(ValueError, match=r"MoEConfig.intermediate \(48\) must be a multiple of 32"):
        MoEConfig(num_experts=8, hidden=128, intermediate=48, top_k=2, max_tokens_per_rank=8, quant="mxfp8")
    cfg = MoEConfig(num_experts=4, hidden=64, intermediate=32, top_k=2, max_tokens_per_rank=8, quant="nvfp4_w4a16")
    x = torch.randn(8, 64).to(torch.bfloat16)
    ids = torch.randint(0, 4, (8, 2))
    w = torch.rand(8, 2)
    w13 = weights((4, 64, 64), 5, spread=False)
    w2 = weights((4, 64, 32), 6, spread=False)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        with pytest.raises(TypeError, match="w13 must be a moe_ep.api.quant.NVFP4Weight.*quantize_nvfp4"):
            layer.forward(x, ids, w, w13, quantize_nvfp4(w2))
        with pytest.raises(TypeError, match="w2 must be a moe_ep.api.quant.NVFP4Weight"):
            layer.forward(x, ids, w, quantize_nvfp4(w13), quantize_mxfp8(w2))
        with pytest.raises(ValueError, match=r"w13 has logical shape \[4, 64, 32\], expected \[4, 64, 64\]"):
            layer.forward(x, ids, w, quantize_nvfp4(w13[:, :, :32].contiguous()), quantize_nvfp4(w2))
        q = quantize_nvfp4(w13)
        bad = NVFP4Weight(q.values, q.block_scale.float(), q.global_scale)
        with pytest.raises(TypeError, match="block_scale"):
            layer.forward(x, ids, w, bad, quantize_nvfp4(w2))
        out = layer.forward(x, ids, w, q, quantize_nvfp4(w2))
        want = oracle_quantized(cfg, x, ids, w, q, quantize_nvfp4(w2))
        assert torch.isfinite(out).all() and rel_err(out, want) < 1e-2
    assert math.isclose(MXFP8Tensor(torch.zeros(2, 32, dtype=torch.float8_e4m3fn),
                                    torch.zeros(2, 1, dtype=torch.float8_e8m0fnu)).shape[-1], 32)


def test_fp8_block128_round_trip_ragged_blocks():
    """Weights with N, K not multiples of 128 (partial blocks) and activation rows."""
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(3, 200, 300, generator=g) * torch.exp2(torch.randint(-6, 6, (3, 200, 1), generator=g).float())
         ).to(torch.bfloat16)
    q = quantize_fp8_block128(w)
    assert q.values.dtype == torch.float8_e4m3fn and q.values.shape == (3, 200, 300)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3, 2, 3)
    d = dequantize_fp8_block128(q).double()
    scale = q.scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :300]
    err = (d - w.double()).abs()
    assert (err <= w.double().abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()
    assert (q.values.float().abs() <= 448).all()
    x = torch.randn(7, 300, generator=g) * 5
    v, s = quantize_fp8_rows128(x)
    assert v.shape == (7, 300) and s.shape == (7, 3)
    dx = dequantize_fp8_rows128(v, s).double()
    sx = s.double().repeat_interleave(128, 1)[:, :300]
    assert ((dx - x.double()).abs() <= x.double().abs() * 2.0 ** -4 + sx * 2.0 ** -10).all()


def test_fp8_block128_forward_validation():
    cfg = MoEConfig(num_experts=4, hidden=200, intermediate=72, top_k=2, max_tokens_per_rank=8, quant="fp8_block128")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (8, 2), generator=g)
    w = torch.rand(8, 2, generator=g)
    q13 = quantize_fp8_block128(torch.randn(4, 144, 200, generator=g))
    q2 = quantize_fp8_block128(torch.randn(4, 200, 72, generator=g))
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        with pytest.raises(ValueError, match="w13_scale is required"):
            layer.forward(x, ids, w, q13.values, q2.values, w2_scale=q2.scale)
        with pytest.raises(ValueError, match=r"w2_scale has shape \[4, 1, 1\], expected \[4, 2, 1\]"):
            layer.forward(x, ids, w, q13.values, q2.values, w13_scale=q13.scale, w2_scale=q2.scale[:, :1])
        with pytest.raises(ValueError, match="carries its scale"):
            layer.forward(x, ids, w, q13, q2, w13_scale=q13.scale)
        with pytest.raises(TypeError, match="w13 must be torch.float8_e4m3fn"):
            layer.forward(x, ids, w, q13.values.float(), q2.values, w13_scale=q13.scale, w2_scale=q2.scale)
        with pytest.raises(TypeError, match="w13_scale must be float32"):
            layer.forward(x, ids, w, q13.values, q2.values, w13_scale=q13.scale.double(), w2_scale=q2.scale)
        out = layer.forward(x, ids, w, q13, q2)  # partial 128-blocks in both weights and the rows
        assert torch.isfinite(out).all() and rel_err(out, oracle_quantized(cfg, x, ids, w, q13, q2)) < 1e-2
    plain = MoEConfig(num_experts=4, hidden=200, intermediate=72, top_k=2, max_tokens_per_rank=8)
    with MoELayer(plain, EPGroup.single(), backend="reference", device="cpu") as layer:
        with pytest.raises(ValueError, match="w13_scale was given, but MoEConfig.quant is None"):
            layer.forward(x, ids, w, torch.randn(4, 144, 200).to(torch.bfloat16),
                          torch.randn(4, 200, 72).to(torch.bfloat16), w13_scale=q13.scale)


# ---- MXFP4 (gpt-oss's checkpoints) -> NVFP4 ---------------------------------------------------------------
def _mxfp4_f64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 decoded from its definition in float64: E2M1 bit fields (sign, 2-bit exponent bias 1, 1-bit
    mantissa), element 2j in the low nibble, times 2 ** (E8M0 code - 127) per 32 values."""
    E, N, nb = scales.shape
    b = blocks.reshape(E, N, nb * 16).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(E, N, nb, 32)
    e, m = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).double()) * (1 + 0.5 * m))
    val = torch.where(codes >= 8, -mag, mag)
    return (val * torch.exp2((scales.view(torch.uint8).to(torch.int64) - 127).double())[..., None]).reshape(E, N, -1)


def _random_mxfp4(E, N, K, spread, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = (120 + torch.randint(0, spread + 1, (E, N, K // 32), generator=g)).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("spread", [0, 9, 17])
def test_nvfp4_from_mxfp4_is_exact_within_17_octaves(spread):
    from moe_ep.api.quant import nvfp4_from_mxfp4

    blocks, scales = _random_mxfp4(3, 10, 256, spread, spread)
    q = nvfp4_from_mxfp4(blocks, scales.view(torch.float8_e8m0fnu) if spread == 9 else scales)
    assert q.values.shape == (3, 10, 128) and q.block_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_nvfp4(q).double(), _mxfp4_f64(blocks, scales))
    assert torch.equal(q.values, blocks.reshape(3, 10, 128))  # the codes are kept


def test_nvfp4_from_mxfp4_gate_up_interleaved():
    from moe_ep.api.quant import nvfp4_from_mxfp4

    blocks, scales = _random_mxfp4(2, 8, 64, 5, 1)
    q = nvfp4_from_mxfp4(blocks, scales, gate_up_interleaved=True)
    dense = _mxfp4_f64(blocks, scales)
    assert torch.equal(dequantize_nvfp4(q).double(), torch.cat((dense[:, 0::2], dense[:, 1::2]), dim=1))


def test_nvfp4_from_mxfp4_beyond_17_octaves():
    from moe_ep.api.quant import nvfp4_from_mxfp4

    blocks, scales = _random_mxfp4(2, 6, 128, 4, 2)
    scales[1, 0, 0] = 100  # 2 ** -27 next to blocks of 2 ** -7 .. 2 ** -3: 24 octaves in expert 1
    blocks[1, 0, 0] = 0x77  # a non-zero block (both nibbles 6.0)
    with pytest.raises(ValueError, match="expert 1.*2\\*\\*24.*exact=False"):
        nvfp4_from_mxfp4(blocks, scales)
    q = nvfp4_from_mxfp4(blocks, scales, exact=False)
    want, got = _mxfp4_f64(blocks, scales), dequantize_nvfp4(q).double()
    assert torch.equal(got[0], want[0])  # the other expert stays exact
    err = (got - want).abs()
    assert float(err[1, 0, :32].max()) > 0 and float(err[1, 0, :32].max()) <= 6 * 2.0 ** -27  # re-rounded block
    err[1, 0, :32] = 0
    assert float(err.max()) == 0.0  # every other block exact
    blocks[1, 0, 0] = 0x88  # the same block of -0: its scale does not count, so the weight is exact again
    assert torch.equal(dequantize_nvfp4(nvfp4_from_mxfp4(blocks, scales)).double(), _mxfp4_f64(blocks, scales))


@pytest.mark.parametrize("blocks,scales,exc,frag", [
    (torch.zeros(2, 4, 2, 16, dtype=torch.int8), torch.zeros(2, 4, 2, dtype=torch.uint8), TypeError, "blocks"),
    (torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 4, 2), TypeError, "scales"),
    (torch.zeros(2, 4, 2, 8, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8), ValueError, "blocks must be"),
    (torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.full((2, 4, 2), 255, dtype=torch.uint8), ValueError, "scales hold the E8M0 NaN code"),
    (torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8), ValueError, "E, N, K/32"),
])
def test_nvfp4_from_mxfp4_refuses(blocks, scales, exc, frag):
    from moe_ep.api.quant import nvfp4_from_mxfp4

    with pytest.raises(exc, match=frag):
        nvfp4_from_mxfp4(blocks, scales)
    with pytest.raises(ValueError, match="even number of rows"):
        nvfp4_from_mxfp4(torch.zeros(1, 3, 1, 16, dtype=torch.uint8), torch.zeros(1, 3, 1, dtype=torch.uint8),
                         gate_up_interleaved=True)


def test_nvfp4_from_mxfp4_matches_transformers_gpt_oss_decode():
    """The layout assumptions (nibble order, E8M0 bias, [E, N, K/32, 16]) against transformers' own
    gpt-oss MXFP4 decode (``convert_moe_packed_tensors``: [E, K, N] float32 after its transpose)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from moe_ep.api.quant import nvfp4_from_mxfp4

    blocks, scales = _random_mxfp4(2, 12, 96, 11, 4)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize_nvfp4(nvfp4_from_mxfp4(blocks, scales))
    assert theirs.shape == (2, 96, 12) and torch.equal(ours, theirs.transpose(1, 2))
