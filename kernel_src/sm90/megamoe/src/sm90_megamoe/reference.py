"""float32 torch reference of exactly what GroupedGemmSm90 computes (loop over experts)."""

from __future__ import annotations

from typing import Optional

import torch


def clamped_swiglu_reference(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float, beta: float,
                             after_act: bool = False) -> torch.Tensor:
    """clamped_swiglu in torch (the kernels' form): ``(clamp(u, -limit, limit) + beta) * g' *
    sigmoid(alpha * g')`` with ``g' = min(g, limit)``; ``after_act`` (drop v102): the gate clamped after
    the activation, ``(clamp(u, -limit, limit) + beta) * min(g * sigmoid(alpha * g), limit)``."""
    u = u.clamp(-limit, limit) + beta
    if after_act:
        return u * (g * torch.sigmoid(alpha * g)).clamp(max=limit)
    g = g.clamp(max=limit)
    return u * g * torch.sigmoid(alpha * g)


def softcapped_swiglu_reference(g: torch.Tensor, u: torch.Tensor, gate_softcap: float,
                                up_softcap: float) -> torch.Tensor:
    """softcapped_swiglu in torch (drop v103): ``gate_softcap * tanh(g / gate_softcap) * sigmoid(g) *
    up_softcap * tanh(u / up_softcap)``."""
    return (gate_softcap * torch.tanh(g / gate_softcap) * torch.sigmoid(g)
            * (up_softcap * torch.tanh(u / up_softcap)))


def grouped_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    row_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    swiglu_beta: float = 1.0,
    swiglu_limit_after_act: bool = False,
    gate_softcap: float = 4.0,
    up_softcap: float = 25.0,
) -> torch.Tensor:
    """
    a:         [M_total, K]      bf16 (any float dtype)
    b:         [E, N, K]         bf16; gated: N = 2*I, gate rows [0, I), up rows [I, 2I)
    offsets:   [E + 1]           int (any device), offsets[0] = 0, offsets[E] = M_total
    row_scale: [M_total]         fp32 or None
    bias:      [E, N]            fp32/bf16 or None, added before the activation
    returns:   [M_total, N_out]  float32, N_out = I for the gated activations else N
    """
    offs = [int(x) for x in offsets.tolist()]
    num_experts, n, _ = b.shape
    gated = activation in ("swiglu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu", "gelu_tanh_glu")
    n_out = n // 2 if gated else n
    out = torch.zeros(a.shape[0], n_out, dtype=torch.float32, device=a.device)
    for e in range(num_experts):
        lo, hi = offs[e], offs[e + 1]
        if hi <= lo:
            continue
        y = a[lo:hi].float() @ b[e].float().t()
        if bias is not None:
            y = y + bias[e].float()
        if gated:
            g, u = y[:, : n // 2], y[:, n // 2 :]
        if activation == "swiglu":
            y = torch.nn.functional.silu(g) * u
        elif activation == "gelu_glu":
            y = torch.nn.functional.gelu(g) * u
        elif activation == "gelu_tanh_glu":  # drop v109 (Gemma 4)
            y = torch.nn.functional.gelu(g, approximate="tanh") * u
        elif activation == "clamped_swiglu":
            y = clamped_swiglu_reference(g, u, swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act)
        elif activation == "softcapped_swiglu":
            y = softcapped_swiglu_reference(g, u, gate_softcap, up_softcap)
        elif activation == "squared_relu":
            y = torch.relu(y).square()
        elif activation != "identity":
            raise ValueError(activation)
        out[lo:hi] = y
    if row_scale is not None:
        out = out * row_scale.float()[:, None]
    return out
