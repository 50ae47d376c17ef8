"""Torch references of what the sm120_mxfp8 kernels compute (CPU or GPU, no CuTe needed).

* :func:`dequantize_mxfp8`       e4m3 values x 2^(E8M0 code - 127), float32
* :func:`grouped_gemm_reference` dequantised float32 GEMM per expert + the epilogue
* :func:`quantize_rows_reference` the row quantiser's exact rule (bit for bit)

fp8 tensors may be given as torch float8 dtypes or as their uint8 bit views.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .constants import ACTIVATION_CONSTANT_DEFAULTS as _ACT, E8M0_BIAS, GATED_EPILOGUES, MX_BLOCK

_FP8_VIEWS = (torch.uint8, torch.int8)


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    """e4m3 values (float8_e4m3fn or uint8 bits) -> float32."""
    if values.dtype in _FP8_VIEWS:
        values = values.view(torch.float8_e4m3fn)
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn (or its uint8 view), got {values.dtype}")
    return values.float()


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu or uint8 codes) -> float32 2^(code - 127) (code 255: NaN)."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype not in _FP8_VIEWS:
        raise TypeError(f"expected float8_e8m0fnu (or its uint8 view), got {scale.dtype}")
    code = scale.view(torch.uint8).to(torch.int32)
    s = torch.exp2((code - E8M0_BIAS).to(torch.float32))
    return torch.where(code == 255, torch.full_like(s, float("nan")), s)


def dequantize_mxfp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values ``[..., K]`` e4m3, scale ``[..., K/32]`` E8M0 -> float32 ``[..., K]``."""
    return _e4m3(values) * _e8m0(scale).repeat_interleave(MX_BLOCK, dim=-1)


def gated_activation_reference(epilogue: str, g: torch.Tensor, u: torch.Tensor,
                               swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                               swiglu_beta: float = _ACT["swiglu_beta"],
                               swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                               gate_softcap: float = _ACT["gate_softcap"],
                               up_softcap: float = _ACT["up_softcap"]) -> torch.Tensor:
    """act(g, u) of a gated epilogue in g's dtype (constants.py defines each one; the others drop v2)."""
    if epilogue == "swiglu":
        return torch.nn.functional.silu(g) * u
    if epilogue == "gelu_glu":
        return torch.nn.functional.gelu(g) * u
    if epilogue == "gelu_tanh_glu":
        return torch.nn.functional.gelu(g, approximate="tanh") * u
    if epilogue == "clamped_swiglu":
        u = u.clamp(-swiglu_limit, swiglu_limit) + swiglu_beta
        if swiglu_limit_after_act:
            return u * (g * torch.sigmoid(swiglu_alpha * g)).clamp(max=swiglu_limit)
        g = g.clamp(max=swiglu_limit)
        return u * g * torch.sigmoid(swiglu_alpha * g)
    if epilogue == "softcapped_swiglu":  # the sigmoid sees the raw gate
        return (gate_softcap * torch.tanh(g / gate_softcap) * torch.sigmoid(g)
                * (up_softcap * torch.tanh(u / up_softcap)))
    raise ValueError(f"{epilogue!r} is not a gated epilogue")


def grouped_gemm_reference(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    epilogue: str,
    row_scale: Optional[torch.Tensor] = None,
    swiglu_alpha: float = _ACT["swiglu_alpha"],
    swiglu_limit: float = _ACT["swiglu_limit"],
    swiglu_beta: float = _ACT["swiglu_beta"],
    swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
    gate_softcap: float = _ACT["gate_softcap"],
    up_softcap: float = _ACT["up_softcap"],
) -> torch.Tensor:
    """float32 reference of ``Mxfp8GroupedGemmSm120``.

    x:         [M_total, K]       e4m3 (or uint8 bits), rows grouped by expert
    x_scale:   [M_total, K/32]    E8M0 (or uint8 codes)
    w:         [E, N, K]          e4m3; gated: N = 2 I, gate rows [0, I), up rows [I, 2I)
    w_scale:   [E, N, K/32]       E8M0
    offsets:   [E + 1]            int, offsets[0] = 0, offsets[E] = M_total (any device)
    row_scale: [M_total]          float32, required by the row_scale epilogue
    swiglu_*:  clamped_swiglu's constants; *_softcap: softcapped_swiglu's (drop v2)
    returns:   [M_total, N_out]   float32, N_out = I (gated) or N
    """
    xd = dequantize_mxfp8(x, x_scale)
    wd = dequantize_mxfp8(w, w_scale)
    num_experts, n, _ = wd.shape
    n_out = n // 2 if epilogue in GATED_EPILOGUES else n
    offs = [int(v) for v in offsets.tolist()]
    out = torch.zeros(xd.shape[0], n_out, dtype=torch.float32, device=xd.device)
    for e in range(num_experts):
        lo, hi = offs[e], offs[e + 1]
        if hi <= lo:
            continue
        h = xd[lo:hi] @ wd[e].t()
        if epilogue in GATED_EPILOGUES:
            h = gated_activation_reference(epilogue, h[:, :n_out], h[:, n_out:], swiglu_alpha, swiglu_limit,
                                           swiglu_beta, swiglu_limit_after_act, gate_softcap, up_softcap)
        elif epilogue == "row_scale":
            if row_scale is None:
                raise ValueError("the row_scale epilogue needs row_scale")
            h = h * row_scale[lo:hi].float()[:, None]
        elif epilogue != "identity":
            raise ValueError(f"unknown epilogue {epilogue!r}")
        out[lo:hi] = h
    return out


def quantize_rows_reference(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The row quantiser's rule: ``x [M, K]`` (bf16; K % 32 == 0) -> (values ``[M, K]``
    float8_e4m3fn, scale ``[M, K/32]`` float8_e8m0fnu).

    e = ceil(log2(amax / 448)) from the bits of amax (amax = M 2^p: e = p - 8 + (M > 1.75)),
    at least -127; values = e4m3(x * 2^-e), round to nearest even. Equal to moe_ep's
    ``quantize_mxfp8`` for bf16 input (see quantize.py)."""
    if x.dim() != 2 or x.shape[1] % MX_BLOCK:
        raise ValueError(f"x must be [M, K] with K % {MX_BLOCK} == 0, got {tuple(x.shape)}")
    m, k = x.shape
    xf = x.float().reshape(m, k // MX_BLOCK, MX_BLOCK)
    amax = xf.abs().amax(dim=-1)
    bits = amax.view(torch.int32)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = e.clamp(min=-E8M0_BIAS)
    inv = ((E8M0_BIAS - e) << 23).view(torch.float32)  # 2^-e, a normal float32
    vals = (xf * inv[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    codes = (e + E8M0_BIAS).to(torch.uint8)
    return vals.reshape(m, k).contiguous(), codes.view(torch.float8_e8m0fnu).contiguous()
