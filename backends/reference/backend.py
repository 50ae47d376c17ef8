"""The torch reference EP MoE backend: obviously right rather than clever.

Per forward on each of W ranks (E_local = E/W experts per rank, local experts of rank r are
``[r·E_local, (r+1)·E_local)``):

1. every valid (token, k) pair is one row; pairs are stably sorted by global expert id, which
   groups them by destination rank and, inside a rank, by local expert. A choice whose expert id
   is outside ``[0, E)`` or whose router weight is not finite is dropped, as the kernels do: it
   is neither sent nor computed and contributes nothing; the first one of each kind is recorded
   and :meth:`ReferenceBackend.check` raises it as :class:`RoutingValueError` (once);
2. per-destination counts and the rows (bytes) are exchanged with ``all_to_all_single``;
3. received rows are stably grouped by local expert -> ``recv_x [R, H]``, ``expert_offsets``;
4. expert MLP: FC1 (``w13``), activation in float32, rounded to the layer dtype, FC2 (``w2``) —
   a per-expert matmul loop on CPU, ``torch._grouped_mm`` on CUDA;
5. rows go back with the reverse ``all_to_all_single``; each token's K rows are weighted by the
   router weights and summed in float32 in k order (deterministic), then cast to the layer dtype.

Host syncs (split sizes) are fine here: this is the oracle and the benchmark baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..registry import BackendImpl, UnsupportedBackendError, routing_value_error


def activate(h: torch.Tensor, activation: str, intermediate: int) -> torch.Tensor:
    """FC1 output ``[M, w13_rows]`` (float32) -> activation ``[M, I]`` (float32)."""
    if activation == "swiglu":
        return F.silu(h[:, :intermediate]) * h[:, intermediate:]
    if activation == "gelu_glu":
        return F.gelu(h[:, :intermediate]) * h[:, intermediate:]
    if activation == "squared_relu":
        return torch.relu(h).square()
    raise ValueError(f"unknown activation {activation!r}")


def expert_mlp(recv_x: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               activation: str, intermediate: int) -> torch.Tensor:
    """Grouped expert MLP.

    Args:
        recv_x: ``[R, H]`` rows grouped by local expert (dtype = layer dtype).
        offsets: ``[E_local + 1]`` int32, expert e owns rows ``[offsets[e], offsets[e+1])``.
        w13: ``[E_local, w13_rows, H]``; w2: ``[E_local, H, I]``.
    Returns:
        ``[R, H]`` in recv_x's dtype; the activation is rounded to that dtype before FC2, as the
        kernels do.
    """
    R, H = recv_x.shape
    out = torch.empty(R, H, dtype=recv_x.dtype, device=recv_x.device)
    if R == 0:
        return out
    if recv_x.is_cuda and hasattr(torch, "_grouped_mm"):
        ends = offsets[1:].to(torch.int32)
        h = torch._grouped_mm(recv_x, w13.transpose(1, 2), offs=ends)
        a = activate(h.float(), activation, intermediate).to(recv_x.dtype)
        return torch._grouped_mm(a, w2.transpose(1, 2), offs=ends).to(recv_x.dtype)
    offs = offsets.tolist()
    for e in range(w13.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        h = recv_x[lo:hi].float() @ w13[e].float().t()
        a = activate(h, activation, intermediate).to(recv_x.dtype)
        out[lo:hi] = (a.float() @ w2[e].float().t()).to(recv_x.dtype)
    return out


def _a2a_rows(group: Any, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """all_to_all_single of whole rows, moved as bytes (gloo lacks some dtypes)."""
    import torch.distributed as dist

    row_shape = send.shape[1:]
    row_bytes = send.element_size() * max(1, int(torch.Size(row_shape).numel()))
    dev = group.comm_device
    sb = send.contiguous().view(torch.uint8).reshape(send.shape[0], row_bytes).to(dev)
    rb = torch.empty(sum(recv_splits), sb.shape[1], dtype=torch.uint8, device=dev)
    dist.all_to_all_single(rb, sb, recv_splits, send_splits, group=group.pg)
    return rb.to(send.device).view(send.dtype).reshape(sum(recv_splits), *row_shape)


@dataclass
class ReferenceHandleState:
    """What combine() needs to undo dispatch(): see the module docstring."""

    num_tokens: int
    top_k: int
    pair_order: torch.Tensor  # [N] int64: send row i is pair pair_order[i] (N valid pairs)
    send_splits: list[int]
    recv_splits: list[int]
    group_perm: torch.Tensor  # [R] int64: grouped row j is received row group_perm[j]
    topk_weights: torch.Tensor  # [T, K] float32, 0 for dropped choices
    out_dtype: torch.dtype


class ReferenceBackend(BackendImpl):
    name = "reference"

    def __init__(self, config: Any, group: Any, device: torch.device) -> None:
        self.cfg = config
        self.group = group
        self.device = device
        self.e_local = config.local_experts(group.world_size)
        # first dropped choice of each kind since the last report: (token, k, value) or None
        self._bad_id: tuple[int, int, int] | None = None
        self._bad_weight: tuple[int, int, float] | None = None

    def _valid_pairs(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ``(ids [T*K] int64, valid [T*K] bool)``; records the first bad choice of each kind.

        Like the kernels: an id outside ``[0, E)`` is a ``topk_ids`` error; a non-finite weight of
        a choice with a valid id is a ``topk_weights`` error. The earliest call since the last
        report keeps the record; within a call the smallest (token, k) wins."""
        K = topk_ids.shape[1]
        ids = topk_ids.reshape(-1).to(torch.int64)
        id_ok = (ids >= 0) & (ids < self.cfg.num_experts)
        w_ok = torch.isfinite(topk_weights.reshape(-1))
        valid = id_ok & w_ok
        if ids.numel() and not bool(valid.all()):  # host sync: fine for the reference
            if self._bad_id is None and not bool(id_ok.all()):
                i = int(torch.nonzero(~id_ok)[0, 0])
                self._bad_id = (i // K, i % K, int(ids[i]))
            w_bad = id_ok & ~w_ok
            if self._bad_weight is None and bool(w_bad.any()):
                i = int(torch.nonzero(w_bad)[0, 0])
                self._bad_weight = (i // K, i % K, float(topk_weights.reshape(-1)[i]))
        return ids, valid

    def dispatch(self, x, topk_ids, topk_weights):
        W, El = self.group.world_size, self.e_local
        T, K = topk_ids.shape
        ids, valid = self._valid_pairs(topk_ids, topk_weights)
        pairs = torch.nonzero(valid).flatten()  # valid pairs in (token, k) order
        pair_order = pairs[torch.sort(ids[pairs], stable=True).indices]  # by (dest rank, local expert)
        send_x = x[pair_order // K]
        send_ids = ids[pair_order]
        send_le = (send_ids % El).to(torch.int32)
        if W == 1:
            send_splits = recv_splits = [int(pair_order.numel())]
            recv_x, recv_le = send_x, send_le
        else:
            import torch.distributed as dist

            send_counts = torch.bincount(send_ids // El, minlength=W).to(torch.int64)
            sc = send_counts.to(self.group.comm_device)
            rc = torch.empty_like(sc)
            dist.all_to_all_single(rc, sc, group=self.group.pg)
            send_splits, recv_splits = sc.tolist(), rc.tolist()
            recv_x = _a2a_rows(self.group, send_x, send_splits, recv_splits)
            recv_le = _a2a_rows(self.group, send_le.unsqueeze(1), send_splits, recv_splits).squeeze(1)
        group_perm = torch.sort(recv_le, stable=True).indices
        counts = torch.bincount(recv_le.to(torch.int64), minlength=El)
        offsets = torch.zeros(El + 1, dtype=torch.int32, device=x.device)
        offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
        weights = torch.where(valid.view(T, K), topk_weights, torch.zeros_like(topk_weights))
        state = ReferenceHandleState(T, K, pair_order, send_splits, recv_splits, group_perm,
                                     weights, x.dtype)
        return recv_x[group_perm].contiguous(), offsets, state

    def combine(self, expert_out, state: ReferenceHandleState, out=None):
        T, K = state.num_tokens, state.top_k
        back = torch.empty_like(expert_out)
        back[state.group_perm] = expert_out
        if self.group.world_size > 1:
            back = _a2a_rows(self.group, back, state.recv_splits, state.send_splits)
        # dropped pairs keep a zero row (and a zero weight)
        pair_rows = torch.zeros(T * K, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        pair_rows[state.pair_order] = back.float()
        weighted = pair_rows.view(T, K, expert_out.shape[1]) * state.topk_weights.unsqueeze(-1)
        acc = weighted[:, 0].clone()
        for k in range(1, K):  # fixed k order: bit-deterministic
            acc += weighted[:, k]
        res = acc.to(state.out_dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def forward(self, x, topk_ids, topk_weights, w13, w2, out=None):
        recv_x, offsets, state = self.dispatch(x, topk_ids, topk_weights)
        y = expert_mlp(recv_x, offsets, w13, w2, self.cfg.activation, self.cfg.intermediate)
        return self.combine(y, state, out)

    def check(self) -> None:
        """Raise :class:`RoutingValueError` for the first dropped choice recorded since the last
        report (``topk_ids`` before ``topk_weights``; both named when both occurred), then forget
        it: the error is reported once and the layer keeps working."""
        bad_id, bad_w = self._bad_id, self._bad_weight
        if bad_id is None and bad_w is None:
            return
        self._bad_id = self._bad_weight = None
        raise routing_value_error(self.cfg.num_experts, bad_id, bad_w)

    def reset_error_state(self) -> None:
        self._bad_id = self._bad_weight = None

    def warmup(self, progress):
        progress("reference backend: nothing to compile")
        if self.group.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group.pg)


def check(config: Any, group: Any, device: torch.device) -> None:
    if config.num_experts % group.world_size:
        raise UnsupportedBackendError(
            f"num_experts {config.num_experts} is not a multiple of the EP world size {group.world_size}")
    if group.world_size > 1 and group.dist_backend == "nccl" and device.type != "cuda":
        raise UnsupportedBackendError("an NCCL group needs CUDA tensors")
