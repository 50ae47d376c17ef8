"""Pure-torch references of the EP kernels and of the end-to-end dispatch -> experts -> combine.

Every function here reproduces the kernels' arithmetic exactly (same fp32 summation order,
one bf16 rounding per stage), so results can be compared bitwise (``torch.equal``).

Conventions (see ep_kernels): W ranks, T_max tokens per rank, E experts, E_l = E // W local
experts per rank, K choices; slot s = src_rank * T_max + t. An expert id outside [0, E) is a
dropped choice (routed nowhere), and so is a choice whose router weight is not finite.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch


# =============================================================================================
# Experts used by the tests (batch-invariant, element-wise: identical bits however rows are
# grouped, so the kernels' grouped path and this reference agree exactly)
# =============================================================================================


def expert_scaled(x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """y = bf16((x * scale[expert]) * weight): x [n, H] bf16, expert [n] global ids (valid),
    weight [n] f32, scale [E] f32. scale == 1 is the identity expert (times the router weight)."""
    return (x.float() * scale[expert].unsqueeze(-1) * weight.unsqueeze(-1)).to(torch.bfloat16)


def valid_choices(topk_ids: torch.Tensor, topk_w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, K] bool: the choices EpDispatch routes (0 <= id < E and a finite weight)."""
    g = topk_ids.long()
    return (g >= 0) & (g < num_experts) & torch.isfinite(topk_w)


def first_bad_values(topk_ids: torch.Tensor, topk_w: torch.Tensor, num_experts: int):
    """What EpDispatch records in verr for one forward: {"topk_ids": (t, k, id) or None,
    "topk_weights": (t, k, w) or None}, the smallest t*K + k of each kind (a weight counts only
    where the id is valid)."""
    g = topk_ids.long()
    bad_id = (g < 0) | (g >= num_experts)
    bad_w = ~bad_id & ~torch.isfinite(topk_w)
    out = {}
    for name, bad, vals in (("topk_ids", bad_id, g), ("topk_weights", bad_w, topk_w)):
        hit = torch.nonzero(bad.flatten()).flatten()
        if hit.numel() == 0:
            out[name] = None
        else:
            key = int(hit[0])
            t, k = divmod(key, topk_ids.shape[1])
            v = vals[t, k]
            out[name] = (t, k, int(v) if name == "topk_ids" else float(v))
    return out


# =============================================================================================
# Per-kernel references
# =============================================================================================


def ref_dispatch(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor],
                 ws: Sequence[torch.Tensor], T_max: int, num_experts: int) -> List[Dict]:
    """Expected symmetric buffers of every destination after EpDispatch of all W sources.

    Returns, per destination d, a dict with
        recv_x     [S, H] bf16  (only rows where row_mask is True are defined)
        row_mask   [S]    bool  slot valid and token has >= 1 choice on d
        recv_ids   [S, K] int32 (only rows where slot_valid is True are defined)
        recv_w     [S, K] f32   (same)
        slot_valid [S]    bool  t < T of the source
        recv_count [W]    int32
    """
    W = len(xs)
    E_l = num_experts // W
    H = xs[0].shape[1]
    K = ids[0].shape[1]
    S = W * T_max
    dev = xs[0].device
    out = []
    for d in range(W):
        rx = torch.zeros(S, H, dtype=torch.bfloat16, device=dev)
        rid = torch.full((S, K), -1, dtype=torch.int32, device=dev)
        rw = torch.zeros(S, K, dtype=torch.float32, device=dev)
        mask = torch.zeros(S, dtype=torch.bool, device=dev)
        valid = torch.zeros(S, dtype=torch.bool, device=dev)
        cnt = torch.tensor([x.shape[0] for x in xs], dtype=torch.int32, device=dev)
        for s in range(W):
            T = xs[s].shape[0]
            if T == 0:
                continue
            g = ids[s].long()
            ok = valid_choices(ids[s], ws[s], num_experts)
            on_d = ok & (torch.div(g.clamp(min=0), E_l, rounding_mode="floor") == d)
            lo = s * T_max
            rid[lo:lo + T] = torch.where(on_d, g - d * E_l, torch.full_like(g, -1)).int()
            rw[lo:lo + T] = ws[s]
            m = on_d.any(dim=1)
            mask[lo:lo + T] = m
            valid[lo:lo + T] = True
            rx[lo:lo + T] = xs[s]
        out.append(dict(recv_x=rx, row_mask=mask, recv_ids=rid, recv_w=rw, slot_valid=valid,
                        recv_count=cnt))
    return out


def ref_gather(src: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Rows [0, n) of GatherRows' output (idx outside [0, R) -> zero row)."""
    idx = idx[:n].long()
    ok = (idx >= 0) & (idx < src.shape[0])
    out = src[idx.clamp(0, src.shape[0] - 1)].clone()
    out[~ok] = 0
    return out


def ref_combine_send_partials(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[S, H] bf16: partial row of every slot (sum_k y[pos[s,k]] for pos >= 0, fp32, k order).
    Slots without any valid pos give 0 (the kernel sends nothing for them)."""
    S, K = pos.shape
    acc = torch.zeros(S, y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(K):
        p = pos[:, k].long()
        ok = (p >= 0) & (p < y.shape[0])
        acc = acc + torch.where(ok.unsqueeze(-1), y[p.clamp(0, y.shape[0] - 1)].float(),
                                torch.zeros((), device=y.device))
    return acc.to(torch.bfloat16)


def dest_mask(topk_ids: torch.Tensor, topk_w: torch.Tensor, W: int, num_experts: int) -> torch.Tensor:
    """[T] int32: what EpDispatch stores in dmask -- bit d set iff a valid choice lives on d."""
    E_l = num_experts // W
    ok = valid_choices(topk_ids, topk_w, num_experts)
    dest = torch.div(topk_ids.long().clamp(min=0), E_l, rounding_mode="floor")
    m = torch.zeros(topk_ids.shape[0], dtype=torch.int64, device=topk_ids.device)
    for d in range(W):
        m |= (ok & (dest == d)).any(dim=1).long() << d
    return m.int()


def ref_combine_reduce(dmask: torch.Tensor, comb: torch.Tensor, W: int, T_max: int) -> torch.Tensor:
    """out [T, H]: sum over the ranks d in dmask[t] (d order) of comb[d*T_max + t], fp32 -> bf16."""
    T = dmask.shape[0]
    acc = torch.zeros(T, comb.shape[1], dtype=torch.float32, device=comb.device)
    for d in range(W):
        routed = ((dmask.long() >> d) & 1).bool()
        rows = comb[d * T_max: d * T_max + T].float()
        acc = acc + torch.where(routed.unsqueeze(-1), rows, torch.zeros((), device=comb.device))
    return acc.to(torch.bfloat16)


# =============================================================================================
# Grouped-by-expert layout of a destination's received slots (torch, device-side, no sync)
# =============================================================================================


def expert_layout(recv_ids: torch.Tensor, recv_count: torch.Tensor, recv_w: torch.Tensor,
                  T_max: int, local_experts: int, rank: int):
    """Group every valid (slot, k) of a destination by local expert (stable: slot order within
    an expert). Everything stays on the device (no host sync).

    Returns dict:
        idx       [S*K] int32  slot of grouped row i (rows >= n: junk, never read)
        offsets   [E_l + 1] int32 expert row offsets; offsets[E_l] = n (valid rows)
        pos       [S, K] int32  grouped row of (slot, k) or -1
        expert    [S*K] int64  GLOBAL expert id of grouped row i (rows >= n: junk)
        weight    [S*K] f32    router weight of grouped row i
    """
    S, K = recv_ids.shape
    W = S // T_max
    dev = recv_ids.device
    t = torch.arange(T_max, device=dev).repeat(W)
    q = torch.arange(W, device=dev).repeat_interleave(T_max)
    slot_ok = t < recv_count.long()[q]
    key = torch.where(slot_ok.unsqueeze(-1) & (recv_ids >= 0) & (recv_ids < local_experts),
                      recv_ids.long(), torch.full_like(recv_ids, local_experts, dtype=torch.long))
    flat = key.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(local_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(local_experts + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(counts[:local_experts], 0).int()
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)
    pos = torch.where(flat < local_experts, inv, torch.full_like(inv, -1)).view(S, K).int()
    sorted_key = flat[order]
    return dict(
        idx=torch.div(order, K, rounding_mode="floor").int(),
        offsets=offsets,
        pos=pos,
        expert=sorted_key.clamp(max=local_experts - 1) + rank * local_experts,
        weight=recv_w.flatten()[order],
    )


# =============================================================================================
# End to end
# =============================================================================================


def ref_forward(xs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor],
                ws: Sequence[torch.Tensor], num_experts: int,
                scale: torch.Tensor) -> List[torch.Tensor]:
    """Output of dispatch -> expert_scaled -> CombineSend -> CombineReduce for every rank.

    For source rank s, token t: partial_d = bf16(sum_{k on d, k order} y_k) (fp32 sum),
    y_k = expert_scaled(x[t], ids[t,k], w[t,k]); out[t] = bf16(sum_{d routed, d order} partial_d).
    """
    W = len(xs)
    E_l = num_experts // W
    outs = []
    for s in range(W):
        x, g, w = xs[s], ids[s].long(), ws[s]
        T, K = g.shape
        H = x.shape[1]
        if T == 0:
            outs.append(torch.empty(0, H, dtype=torch.bfloat16, device=x.device))
            continue
        ok = valid_choices(ids[s], w, num_experts)
        dest = torch.div(g.clamp(min=0), E_l, rounding_mode="floor")
        zero = torch.zeros((), device=x.device)
        acc = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        for d in range(W):
            part = torch.zeros(T, H, dtype=torch.float32, device=x.device)
            for k in range(K):
                m = ok[:, k] & (dest[:, k] == d)
                y = expert_scaled(x, g[:, k].clamp(0, num_experts - 1), w[:, k].nan_to_num(0.0, 0.0, 0.0), scale)
                part = part + torch.where(m.unsqueeze(-1), y.float(), zero)
            routed = (ok & (dest == d)).any(dim=1)
            acc = acc + torch.where(routed.unsqueeze(-1), part.to(torch.bfloat16).float(), zero)
        outs.append(acc.to(torch.bfloat16))
    return outs
