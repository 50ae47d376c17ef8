"""Torch references of the receiver-side expert layout (layout_kernels), CPU or GPU.

* ``ref_layout``: the contract, in canonical (expert, slot, k) row order.
* ``canonicalize``: reorder kernel outputs (any row order inside an expert) into that canonical
  order, after checking that pos is a bijection between valid pairs and rows [0, n).
* ``TorchLayoutBuffers`` / ``torch_expert_layout``: a copy of the moe_ep SM90 backend's torch
  path (backends/sm90/bf16_cutedsl/layout.py; the drop never imports moe_ep), for timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

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


def canonicalize(offsets: torch.Tensor, idx: torch.Tensor, ws: torch.Tensor, pos: torch.Tensor,
                 local_experts: int, xs: Optional[torch.Tensor] = None):
    """Reorder a layout whose rows inside an expert are in any order into the canonical
    (expert, slot, k) order. Returns (dict like ref_layout, list of structural errors)."""
    errs: List[str] = []
    S, K = pos.shape
    E_l = local_experts
    dev = pos.device
    n = int(offsets[E_l])
    flat = pos.flatten().long()
    valid = flat >= 0
    if int(valid.sum()) != n:
        errs.append(f"pos has {int(valid.sum())} rows >= 0, offsets[E_l] = {n}")
        return None, errs
    rows = flat[valid]
    if n and (int(rows.min()) < 0 or int(rows.max()) >= n):
        errs.append("pos row out of [0, n)")
        return None, errs
    if n and not torch.equal(torch.sort(rows).values, torch.arange(n, device=dev)):
        errs.append("pos is not a bijection onto [0, n)")
        return None, errs
    pair_of_row = torch.empty(n, dtype=torch.long, device=dev)
    pair_of_row[rows] = torch.nonzero(valid).flatten()
    expert_of_row = torch.searchsorted(offsets[1:].long().contiguous(),
                                       torch.arange(n, device=dev), right=True)
    perm = torch.argsort(expert_of_row * (S * K) + pair_of_row)
    new_of_old = torch.empty(n, dtype=torch.long, device=dev)
    new_of_old[perm] = torch.arange(n, device=dev)
    cpos = torch.full((S * K,), -1, dtype=torch.long, device=dev)
    cpos[valid] = new_of_old[rows]
    out = dict(offsets=offsets.clone(), n=n, idx=idx[:n][perm], ws=ws[:n][perm],
               pos=cpos.view(S, K).int())
    if xs is not None:
        out["xs"] = xs[:n][perm]
    return out, errs


# =============================================================================================
# The moe_ep backend's torch path (copy, for timing comparisons)
# =============================================================================================


@dataclass
class TorchLayoutBuffers:
    slot_t: torch.Tensor
    slot_src: torch.Tensor
    arange_p: torch.Tensor
    ones_p: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    idx: torch.Tensor
    ws: torch.Tensor
    pos: torch.Tensor
    inv: torch.Tensor

    @staticmethod
    def allocate(world: int, max_tokens: int, topk: int, e_local: int,
                 device) -> "TorchLayoutBuffers":
        S = world * max_tokens
        P = S * topk
        ar = torch.arange(S, device=device)
        return TorchLayoutBuffers(
            slot_t=(ar % max_tokens).to(torch.int32), slot_src=ar // max_tokens,
            arange_p=torch.arange(P, device=device),
            ones_p=torch.ones(P, dtype=torch.int32, device=device),
            counts=torch.zeros(e_local + 1, dtype=torch.int32, device=device),
            offsets=torch.zeros(e_local + 1, dtype=torch.int32, device=device),
            idx=torch.zeros(P, dtype=torch.int32, device=device),
            ws=torch.zeros(P, dtype=torch.float32, device=device),
            pos=torch.full((S, topk), -1, dtype=torch.int32, device=device),
            inv=torch.zeros(P, dtype=torch.int64, device=device))


def torch_expert_layout(lb: TorchLayoutBuffers, recv_ids: torch.Tensor, recv_w: torch.Tensor,
                        recv_count: torch.Tensor, e_local: int) -> None:
    """Verbatim logic of moe_ep.backends.sm90.bf16_cutedsl.layout.expert_layout."""
    S, K = recv_ids.shape
    valid = lb.slot_t < recv_count[lb.slot_src]
    keys = torch.where(valid.unsqueeze(1) & (recv_ids >= 0), recv_ids, e_local).view(-1)
    perm = torch.sort(keys, stable=True).indices
    lb.counts.zero_().scatter_add_(0, keys.long(), lb.ones_p)
    torch.cumsum(lb.counts[:e_local], 0, dtype=torch.int32, out=lb.offsets[1:])
    lb.idx.copy_(perm // K)
    torch.index_select(recv_w.view(-1), 0, perm, out=lb.ws)
    lb.inv.scatter_(0, perm, lb.arange_p)
    lb.pos.view(-1).copy_(torch.where(keys < e_local, lb.inv, -1))
