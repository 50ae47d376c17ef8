"""FP8 block-128 quantisers (DeepSeek-V3 / Qwen3-FP8 format) and the float32 torch reference of
what :class:`~.fp8_gemm.Fp8BlockScaledGroupedGemmSm90` computes. Standalone (no moe_ep import);
the rules are the host project's ``quantize_fp8_block128`` / ``quantize_fp8_rows128``::

    scale = amax(|block|) / 448        (1 for a block of zeros)
    value = e4m3(x / scale)            (round to nearest; never saturates)

weights: one scale per 128 x 128 block of ``w [E, N, K]`` -> ``scale [E, ceil(N/128), ceil(K/128)]``;
activations: one scale per 128 consecutive values of a row -> ``scale [M, ceil(K/128)]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import clamped_swiglu_reference, softcapped_swiglu_reference

FP8_BLOCK = 128
E4M3_MAX = 448.0


def _div_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded on every device: CUDA torch turns a division by a Python
    scalar into a multiplication by its rounded reciprocal (1 ulp off at times); the kernels divide."""
    return amax / torch.full_like(amax, E4M3_MAX)


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def quantize_weight_block128(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` float -> (values e4m3 [E, N, K], scale float32 [E, ceil(N/128), ceil(K/128)])."""
    E, N, K = w.shape
    nb, kb = _blocks(N), _blocks(K)
    wp = torch.zeros(E, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    wp[:, :N, :K] = w.float()
    blocks = wp.reshape(E, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, _div_e4m3_max(amax), torch.ones_like(amax))
    vals = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    vals = vals.reshape(E, nb * FP8_BLOCK, kb * FP8_BLOCK)[:, :N, :K].contiguous()
    return vals, scale.contiguous()


def quantize_rows128(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``t [M, K]`` float -> (values e4m3 [M, K], scale float32 [M, ceil(K/128)])."""
    M, K = t.shape
    kb = _blocks(K)
    tp = torch.zeros(M, kb * FP8_BLOCK, dtype=torch.float32, device=t.device)
    tp[:, :K] = t.float()
    g = tp.reshape(M, kb, FP8_BLOCK)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, _div_e4m3_max(amax), torch.ones_like(amax))
    vals = (g / scale[..., None]).to(torch.float8_e4m3fn).reshape(M, kb * FP8_BLOCK)[:, :K]
    return vals.contiguous(), scale.contiguous()


def dequantize_weight_block128(values: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    E, N, K = values.shape
    s = scale.to(dtype).repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)
    return values.to(dtype) * s[:, :N, :K]


def dequantize_rows128(values: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    K = values.shape[1]
    return values.to(dtype) * scale.to(dtype).repeat_interleave(FP8_BLOCK, dim=1)[:, :K]


def fp8_grouped_gemm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    row_scale: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    swiglu_beta: float = 1.0,
    swiglu_limit_after_act: bool = False,
    gate_softcap: float = 4.0,
    up_softcap: float = 25.0,
) -> torch.Tensor:
    """The dequantised math in ``dtype`` (float32 default), looping over experts.

    a [M, K] e4m3, a_scale [M, K/128] f32, b [E, N, K] e4m3, b_scale [E, N/128, K/128] f32,
    offsets [E+1] int, row_scale [M] f32 or None. Returns [M, N_out] in ``dtype``
    (identity: N_out = N; swiglu: N_out = N/2, silu(gate rows [0, I)) * up rows [I, 2I);
    clamped_swiglu / softcapped_swiglu: :func:`.reference.clamped_swiglu_reference` /
    :func:`.reference.softcapped_swiglu_reference` of gate and up)."""
    if activation not in ("identity", "swiglu", "clamped_swiglu", "softcapped_swiglu"):
        raise ValueError(activation)
    offs = [int(x) for x in offsets.tolist()]
    E, N, _ = b.shape
    n_out = N if activation == "identity" else N // 2
    ad = dequantize_rows128(a, a_scale, dtype)
    out = torch.zeros(a.shape[0], n_out, dtype=dtype, device=a.device)
    for e in range(E):
        lo, hi = offs[e], offs[e + 1]
        if hi <= lo:
            continue
        y = ad[lo:hi] @ dequantize_weight_block128(b[e:e + 1], b_scale[e:e + 1], dtype)[0].t()
        if activation == "swiglu":
            y = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:]
        elif activation == "clamped_swiglu":
            y = clamped_swiglu_reference(y[:, :n_out], y[:, n_out:], swiglu_alpha, swiglu_limit, swiglu_beta,
                                         swiglu_limit_after_act)
        elif activation == "softcapped_swiglu":
            y = softcapped_swiglu_reference(y[:, :n_out], y[:, n_out:], gate_softcap, up_softcap)
        out[lo:hi] = y
    if row_scale is not None:
        out = out * row_scale.to(dtype)[:, None]
    return out


def make_offsets(m_total: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """[E+1] int32 CPU offsets. uniform: near-equal counts; skewed: Zipf-like with empty experts
    (at least one expert is always empty when E >= 2)."""
    if routing == "uniform":
        counts = torch.full((experts,), m_total // experts, dtype=torch.int64)
        counts[: m_total - int(counts.sum())] += 1
    elif routing == "skewed":
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(experts, generator=gen)]
        w[torch.randperm(experts, generator=gen)[: max(1, experts // 8)]] = 0.0
        if float(w.sum()) == 0.0:
            w[0] = 1.0
        counts = (torch.multinomial(w / w.sum(), m_total, replacement=True, generator=gen)
                  .bincount(minlength=experts) if m_total > 0
                  else torch.zeros(experts, dtype=torch.int64))
    else:
        raise ValueError(routing)
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(counts, 0)
    return offs.to(torch.int32)
