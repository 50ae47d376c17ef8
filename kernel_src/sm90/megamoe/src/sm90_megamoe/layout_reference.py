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


def ref_route(topk_ids: torch.Tensor, topk_w: torch.Tensor, num_experts: int) -> Dict[str, torch.Tensor]:
    """What LocalRoute (one rank) must leave, by EpDispatch's rules: a choice is valid iff
    0 <= id < E and its weight is finite. Returns recv_ids [T, K] int32 (id or -1), dmask [T]
    int32 (1 if the token has a valid choice), and the first bad choice of each kind as
    (key t*K + k, value) or None: ``bad_id`` (any id outside [0, E)), ``bad_w`` (a valid id
    with a non-finite weight; value = the weight's float32 bits)."""
    ids = topk_ids.long()
    id_ok = (ids >= 0) & (ids < num_experts)
    w_ok = torch.isfinite(topk_w)
    valid = id_ok & w_ok
    out: Dict[str, object] = dict(recv_ids=torch.where(valid, ids, torch.full_like(ids, -1)).int(),
                                  dmask=valid.any(dim=1).int() if ids.shape[0] else valid.new_zeros(0).int())
    flat_ids, flat_w = ids.flatten(), topk_w.flatten()
    bad = torch.nonzero(~id_ok.flatten()).flatten()
    out["bad_id"] = (int(bad[0]), int(flat_ids[bad[0]])) if bad.numel() else None
    badw = torch.nonzero((id_ok & ~w_ok).flatten()).flatten()
    out["bad_w"] = (int(badw[0]), int(flat_w[badw[0]:badw[0] + 1].view(torch.int32)[0])) if badw.numel() else None
    return out
