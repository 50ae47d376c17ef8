"""Torch reference of the receiver-side expert layout (layout_kernels), CPU or GPU.

``ref_layout`` is the contract: valid (slot, k) pairs grouped by local expert, in (expert, slot,
k) row order (a stable sort). The kernels must match it exactly.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def valid_pairs(recv_ids: torch.Tensor, recv_count: torch.Tensor, T_max: int,
                local_experts: int) -> torch.Tensor:
    """[S, K] bool: slot valid (t < recv_count[src]) and 0 <= id < E_l."""
    S, K = recv_ids.shape
    W = S // T_max
    dev = recv_ids.device
    t = torch.arange(T_max, device=dev).repeat(W)
    q = torch.arange(W, device=dev).repeat_interleave(T_max)
    slot_ok = t < recv_count.long()[q]
    return slot_ok.unsqueeze(1) & (recv_ids >= 0) & (recv_ids < local_experts)


def ref_layout(recv_ids: torch.Tensor, recv_w: torch.Tensor, recv_count: torch.Tensor,
               T_max: int, local_experts: int,
               recv_x: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Canonical layout: rows in (expert, slot, k) order.

    Returns offsets [E_l+1] int32, n (int), idx [n] int32, ws [n] f32, pos [S, K] int32 (-1 for
    invalid pairs), and xs [n, H] = recv_x[idx] if recv_x is given."""
    S, K = recv_ids.shape
    E_l = local_experts
    ok = valid_pairs(recv_ids, recv_count, T_max, E_l)
    key = torch.where(ok, recv_ids.long(), torch.full_like(recv_ids, E_l, dtype=torch.long))
    flat = key.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E_l + 1)[:E_l]
    offsets = torch.zeros(E_l + 1, dtype=torch.int32, device=recv_ids.device)
    offsets[1:] = torch.cumsum(counts, 0).int()
    n = int(ok.sum())
    order = order[:n]
    inv = torch.full((S * K,), -1, dtype=torch.long, device=recv_ids.device)
    inv[order] = torch.arange(n, device=recv_ids.device)
    out = dict(offsets=offsets, n=n, idx=torch.div(order, K, rounding_mode="floor").int(),
               ws=recv_w.flatten()[order], pos=inv.view(S, K).int())
    if recv_x is not None:
        out["xs"] = recv_x[out["idx"].long()]
    return out
