"""float32 torch reference of exactly what W4A16GroupedGemmSm100 computes (loop over experts),
plus the NVFP4 decode it relies on. Runs on any device (CPU included)."""

from __future__ import annotations

from typing import Optional

import torch

from .constants import ACTIVATION_CONSTANT_DEFAULTS as _ACT, GATED_EPILOGUES, SF_BLOCK

# E2M1 magnitudes by code 0..7 (bit 3 of the code is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_nvfp4(values: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """values [E, N, K/2] uint8 (element 2j = low nibble), block_scale [E, N, K/16]
    float8_e4m3fn (or its uint8 view) -> float32 [E, N, K] = e2m1 * block_scale (no global scale)."""
    if block_scale.dtype == torch.uint8:
        block_scale = block_scale.view(torch.float8_e4m3fn)
    e, n, k2 = values.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=values.device)
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(e, n, 2 * k2).long()
    mag = table[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * block_scale.float().repeat_interleave(SF_BLOCK, dim=-1)


def w4a16_grouped_gemm_reference(
    a: torch.Tensor,
    values: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    offsets: torch.Tensor,
    epilogue: str,
    row_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    swiglu_alpha: float = _ACT["swiglu_alpha"],
    swiglu_limit: float = _ACT["swiglu_limit"],
    swiglu_beta: float = _ACT["swiglu_beta"],
    swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
    gate_softcap: float = _ACT["gate_softcap"],
    up_softcap: float = _ACT["up_softcap"],
) -> torch.Tensor:
    """
    a:            [M_total, K]       bf16 (any float dtype)
    values:       [E, N, K/2]        uint8
    block_scale:  [E, N, K/16]       float8_e4m3fn or uint8 view
    global_scale: [E]                float32
    offsets:      [E + 1]            int (any device), offsets[0] = 0, offsets[E] = M_total
    row_scale:    [M_total]          float32, used by "row_scale" only
    bias:         [E, N]             float32 / bfloat16 or None, added to acc * gs before the epilogue (drop v4)
    swiglu_*:     clamped_swiglu's constants; *_softcap: softcapped_swiglu's (drop v3)
    returns:      [M_total, N_out]   float32, N_out = N (or N / 2 for the gated ones); rows of no
                                     expert stay 0
    """
    offs = [int(x) for x in offsets.tolist()]
    w = dequant_nvfp4(values, block_scale)  # [E, N, K] float32, exact
    e_count, n, _ = w.shape
    gated = epilogue in GATED_EPILOGUES
    n_out = n // 2 if gated else n
    out = torch.zeros(a.shape[0], n_out, dtype=torch.float32, device=a.device)
    for e in range(e_count):
        lo, hi = offs[e], offs[e + 1]
        if hi <= lo:
            continue
        y = (a[lo:hi].float() @ w[e].t()) * global_scale[e].float()
        if bias is not None:
            y = y + bias[e].float()
        if epilogue == "identity":
            pass
        elif epilogue == "squared_relu":
            y = torch.relu(y).square()
        elif epilogue == "row_scale":
            y = y * row_scale[lo:hi].float()[:, None]
        elif epilogue == "swiglu":
            y = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:]
        elif epilogue == "gelu_glu":  # drop v2
            y = torch.nn.functional.gelu(y[:, :n_out]) * y[:, n_out:]
        elif epilogue == "gelu_tanh_glu":  # drop v2 (Gemma 4)
            y = torch.nn.functional.gelu(y[:, :n_out], approximate="tanh") * y[:, n_out:]
        elif epilogue == "clamped_swiglu":  # drop v3 (gpt-oss, DeepSeek-V4, Step-3.7)
            g, u = y[:, :n_out], y[:, n_out:].clamp(-swiglu_limit, swiglu_limit) + swiglu_beta
            if swiglu_limit_after_act:
                y = u * (g * torch.sigmoid(swiglu_alpha * g)).clamp(max=swiglu_limit)
            else:
                g = g.clamp(max=swiglu_limit)
                y = u * g * torch.sigmoid(swiglu_alpha * g)
        elif epilogue == "softcapped_swiglu":  # drop v3 (Inkling2): the sigmoid sees the raw gate
            g, u = y[:, :n_out], y[:, n_out:]
            y = (gate_softcap * torch.tanh(g / gate_softcap) * torch.sigmoid(g)
                 * (up_softcap * torch.tanh(u / up_softcap)))
        else:
            raise ValueError(epilogue)
        out[lo:hi] = y
    return out
