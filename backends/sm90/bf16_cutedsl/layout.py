"""Receiver-side expert layout, on the device with torch ops (no host sync, graph-capturable).

After dispatch, slot ``s = src·T_max + t`` of this rank holds token t of rank src, valid while
``t < recv_count[src]``; ``recv_ids[s, k]`` is the local expert of choice k, or -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayoutBuffers:
    """Preallocated per layer (S = W·T_max slots, P = S·K pair capacity, E_l local experts)."""

    slot_t: torch.Tensor  # [S] int32: t of each slot
    slot_src: torch.Tensor  # [S] int64: source rank of each slot
    arange_p: torch.Tensor  # [P] int64
    ones_p: torch.Tensor  # [P] int32
    counts: torch.Tensor  # [E_l + 1] int32 (last bucket = invalid pairs)
    offsets: torch.Tensor  # [E_l + 1] int32, offsets[0] == 0 forever
    idx: torch.Tensor  # [P] int32: slot of grouped row r
    ws: torch.Tensor  # [P] float32: router weight of grouped row r
    pos: torch.Tensor  # [S, K] int32: grouped row of (slot, k), or -1
    inv: torch.Tensor  # [P] int64 scratch

    @staticmethod
    def allocate(world: int, max_tokens: int, topk: int, e_local: int, device) -> "LayoutBuffers":
        S = world * max_tokens
        P = S * topk
        ar = torch.arange(S, device=device)
        return LayoutBuffers(
            slot_t=(ar % max_tokens).to(torch.int32), slot_src=ar // max_tokens,
            arange_p=torch.arange(P, device=device), ones_p=torch.ones(P, dtype=torch.int32, device=device),
            counts=torch.zeros(e_local + 1, dtype=torch.int32, device=device),
            offsets=torch.zeros(e_local + 1, dtype=torch.int32, device=device),
            idx=torch.zeros(P, dtype=torch.int32, device=device),
            ws=torch.zeros(P, dtype=torch.float32, device=device),
            pos=torch.full((S, topk), -1, dtype=torch.int32, device=device),
            inv=torch.zeros(P, dtype=torch.int64, device=device))


def expert_layout(lb: LayoutBuffers, recv_ids: torch.Tensor, recv_w: torch.Tensor, recv_count: torch.Tensor,
                  e_local: int) -> None:
    """Fill ``lb.offsets/idx/ws/pos``: valid (slot, k) pairs grouped by local expert, in
    (expert, slot, k) order (a stable sort: deterministic).

    recv_ids ``[S, K]`` int32, recv_w ``[S, K]`` float32, recv_count ``[W]`` int32.
    """
    S, K = recv_ids.shape
    valid = lb.slot_t < recv_count[lb.slot_src]  # stale slots of shorter sources drop out
    keys = torch.where(valid.unsqueeze(1) & (recv_ids >= 0), recv_ids, e_local).view(-1)
    perm = torch.sort(keys, stable=True).indices
    lb.counts.zero_().scatter_add_(0, keys.long(), lb.ones_p)
    torch.cumsum(lb.counts[:e_local], 0, dtype=torch.int32, out=lb.offsets[1:])
    lb.idx.copy_(perm // K)
    torch.index_select(recv_w.view(-1), 0, perm, out=lb.ws)
    lb.inv.scatter_(0, perm, lb.arange_p)
    lb.pos.view(-1).copy_(torch.where(keys < e_local, lb.inv, -1))
