"""The FP8 quantiser's division (drop v24): ``x / scale`` as one reciprocal and Markstein's
correction per value (``q0 = x * r``, ``e = x - q0 * scale`` in one FMA, ``q = q0 + e * r``;
``q0`` when ``e == 0``) instead of an IEEE division per value, for 2^-60 <= scale <= 2^100.

The claim: every e4m3 byte equals the one from IEEE division (torch's ``x / scale``), for every
bf16 value of every group. A group's scale is ``amax / 448`` with ``amax`` itself a bf16 value,
so "every bf16 amax whose scale is in range x every bf16 value with |x| <= amax" is the whole
input space: 20481 amax values, 816.7 million pairs, all equal (``MOE_EP_EXHAUSTIVE=1`` runs
them, ~2 min; the default CPU run takes every 41st amax). The CPU check emulates the float32
operations exactly in float64 (products of two float32 are exact; the FMA residual is exact;
a float64 sum that lands on a float32 midpoint is settled with fractions) -- an independent
algorithm, not the kernel. The ``gpu`` test then runs the kernel on the same kind of groups and
compares with ``fp8_reference.quantize_rows128`` bit for bit."""

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

LO, HI = 2.0 ** -60, 2.0 ** 100  # sm90_megamoe.fp8_quant.FAST_DIV_MIN_SCALE / _MAX_SCALE


def _bf16_values() -> np.ndarray:
    """Every finite bf16 value, as float32."""
    x = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    return x[np.isfinite(x)]


def _amaxes(step: int):
    """(amax, scale) for every ``step``-th positive finite bf16 amax whose scale is in range."""
    out = []
    for bits in range(1, 0x7F80, step):
        amax = np.array([bits << 16], dtype=np.uint32).view(np.float32)[0]
        scale = np.float32(amax) / np.float32(448.0)
        if LO <= scale <= HI:
            out.append((amax, scale))
    return out


def _rn32(fr: Fraction) -> np.float32:
    """Round a rational to the nearest float32, ties to even."""
    c = np.float32(float(fr))
    cands = (c, np.nextafter(c, np.float32(-np.inf)), np.nextafter(c, np.float32(np.inf)))
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - fr), int(np.array(v).view(np.uint32)) & 1))


def _to_f32(v64: np.ndarray, exact) -> np.ndarray:
    """float64 -> float32, rounding exactly where the float64 value sits on a float32 midpoint."""
    r = v64.astype(np.float32)
    lo = np.nextafter(r, np.float32(-np.inf)).astype(np.float64)
    hi = np.nextafter(r, np.float32(np.inf)).astype(np.float64)
    r64 = r.astype(np.float64)
    for i in np.nonzero((v64 == (r64 + lo) / 2) | (v64 == (r64 + hi) / 2))[0]:
        r[i] = exact(i)
    return r


def _e4m3(v: np.ndarray) -> np.ndarray:
    return torch.from_numpy(v).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _mismatches(step: int) -> tuple:
    xs = _bf16_values()
    pairs = bad = 0
    for amax, s in _amaxes(step):
        x = xs[np.abs(xs) <= amax]
        x64 = x.astype(np.float64)
        r = _rn32(1 / Fraction(float(s)))                                   # rcp.rn.f32
        q0 = (x64 * float(r)).astype(np.float32)                            # mul.rn (exact product)
        e = (x64 - q0.astype(np.float64) * float(s)).astype(np.float32)     # fma.rn (exact residual)
        q = _to_f32(q0.astype(np.float64) + e.astype(np.float64) * float(r),  # fma.rn
                    lambda i: _rn32(Fraction(float(q0[i])) + Fraction(float(e[i])) * Fraction(float(r))))
        q = np.where(e == 0, q0, q)                                         # selp
        t = _to_f32(x64 / float(s), lambda i: _rn32(Fraction(float(x[i])) / Fraction(float(s))))  # div.rn
        pairs += x.size
        bad += int((_e4m3(q) != _e4m3(t)).sum())
    return pairs, bad


def test_markstein_division_gives_the_ieee_e4m3_bytes():
    full = os.environ.get("MOE_EP_EXHAUSTIVE") == "1"
    pairs, bad = _mismatches(1 if full else 41)
    assert pairs > (800_000_000 if full else 19_000_000)
    assert bad == 0, f"{bad} of {pairs} (amax, x) pairs give another e4m3 byte than IEEE division"


def test_quantiser_ptx_takes_the_reciprocal_path():
    """The compiled quantiser: one rcp.rn per group and lane, three .rn operations per value on
    the fast path, IEEE division (div.rn) kept for the other scales, no approximate forms."""
    pytest.importorskip("cutlass")
    from moe_ep.shim import drop_src, register_drop

    register_drop(drop_src("sm90", "megamoe"))
    from sm90_megamoe import fp8_quant

    assert (fp8_quant.FAST_DIV_MIN_SCALE, fp8_quant.FAST_DIV_MAX_SCALE) == (LO, HI)
    ptx = fp8_quant.compile_fp8_quantize_rows(2048, counted=True, gather=True, keep_ptx=True).__ptx__
    assert ptx.count("rcp.rn.f32") == 1 and "rcp.approx" not in ptx and "div.approx" not in ptx
    assert ptx.count("mul.rn.f32") == 16 and ptx.count("fma.rn.f32") == 32
    assert ptx.count("div.rn.f32") == 1 + 16          # amax / 448, and the slow path's 16
    assert ".ftz" not in ptx


@pytest.mark.gpu
def test_gpu_quantiser_matches_reference_on_every_bf16_value():
    """The kernel on groups whose first value is the amax and whose other 127 values run through
    every bf16 value with |x| <= amax (a sample of amax values across the fast range, its edges
    and beyond it), bit for bit against the torch quantiser."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an SM90 GPU")
    from moe_ep.shim import drop_src, register_drop

    register_drop(drop_src("sm90", "megamoe"))
    from sm90_megamoe import fp8_reference as ref
    from sm90_megamoe.fp8_quant import CompiledFp8QuantizeRows

    xs = torch.from_numpy(_bf16_values())
    gen = torch.Generator().manual_seed(24)
    amaxes = [a for a, _ in _amaxes(97)] + [LO * 448, HI * 448, LO * 100, HI * 1000, 1e-38, 3e38]
    groups = []
    for a in amaxes:
        a = torch.tensor(float(a)).to(torch.bfloat16).float()
        v = xs[xs.abs() <= a]
        v = v[torch.randperm(v.numel(), generator=gen)]
        n = -(-v.numel() // 127) * 127
        v = v.repeat(-(-n // v.numel()))[:n]
        g = v.view(-1, 127)
        groups.append(torch.cat([torch.full((g.shape[0], 1), float(a)), g], dim=1))
    x = torch.cat(groups).to(torch.bfloat16)
    x = x[: x.shape[0] // 16 * 16].reshape(-1, 2048)  # rows of 16 groups
    kern = CompiledFp8QuantizeRows(2048)
    xd = x.cuda()
    q = torch.full(x.shape, 0x5A, dtype=torch.uint8, device="cuda")
    s = torch.full((x.shape[0], 16), float("nan"), device="cuda")
    kern(xd, q, s)
    torch.cuda.synchronize()
    eq, es = ref.quantize_rows128(x.float())
    assert torch.equal(s.cpu().view(torch.int32), es.view(torch.int32))
    diff = (q.cpu() != eq.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} of {q.numel()} bytes differ from IEEE division"
