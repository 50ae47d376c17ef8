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
4. expert MLP: FC1 (``w13``) plus the bias ``b13`` in float32, activation in float32, rounded to
   the layer dtype, FC2 (``w2``) plus the bias ``b2`` in float32, rounded to the layer dtype —
   ``torch._grouped_mm`` on CUDA when it can take the shapes (16-byte aligned strides: H, I and
   w13_rows multiples of 8 in bf16), else (CPU, or any other shape) a per-expert matmul loop;
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


SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_BETA = 1.702, 7.0, 1.0  # gpt-oss; MoEConfig's defaults


def activate(h: torch.Tensor, activation: str, intermediate: int, *, swiglu_alpha: float = SWIGLU_ALPHA,
             swiglu_limit: float = SWIGLU_LIMIT, swiglu_beta: float = SWIGLU_BETA,
             swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
             up_softcap: float = 25.0) -> torch.Tensor:
    """FC1 output ``[M, w13_rows]`` (float32, bias included) -> activation ``[M, I]`` (float32).

    Gated activations read the gate from columns ``[0, I)`` and the up projection from ``[I, 2I)``;
    ``swiglu_alpha``/``swiglu_limit``/``swiglu_beta``/``swiglu_limit_after_act`` are used by
    ``"clamped_swiglu"`` only, ``gate_softcap``/``up_softcap`` by ``"softcapped_swiglu"`` (pass the
    config's)."""
    if activation == "swiglu":
        return F.silu(h[:, :intermediate]) * h[:, intermediate:]
    if activation == "gelu_glu":
        return F.gelu(h[:, :intermediate]) * h[:, intermediate:]
    if activation == "gelu_tanh_glu":  # Gemma 4: torch's tanh approximation
        return F.gelu(h[:, :intermediate], approximate="tanh") * h[:, intermediate:]
    if activation == "clamped_swiglu":
        g, u = h[:, :intermediate], h[:, intermediate:].clamp(min=-swiglu_limit, max=swiglu_limit)
        if swiglu_limit_after_act:  # Step-3.7 / Bailing: min(act(g), limit)
            return (u + swiglu_beta) * (g * torch.sigmoid(swiglu_alpha * g)).clamp(max=swiglu_limit)
        g = g.clamp(max=swiglu_limit)
        return (u + swiglu_beta) * g * torch.sigmoid(swiglu_alpha * g)
    if activation == "softcapped_swiglu":  # Inkling2: the sigmoid sees the raw gate
        g, u = h[:, :intermediate], h[:, intermediate:]
        return (gate_softcap * torch.tanh(g / gate_softcap) * torch.sigmoid(g)
                * (up_softcap * torch.tanh(u / up_softcap)))
    if activation == "squared_relu":
        return torch.relu(h).square()
    raise ValueError(f"unknown activation {activation!r}")


def grouped_mm_fits(recv_x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes the expert MLP's operands (``recv_x [R, H]``, ``w13ᵀ``,
    ``w2ᵀ``) and products (``[R, w13_rows]``, ``[R, I]``, ``[R, H]``, row-major): it needs every
    non-unit stride a multiple of 16 bytes and 16-byte aligned data (for bf16: H, I and w13_rows
    multiples of 8) and fails with "strides should be multiple of 16 bytes" otherwise."""
    es = recv_x.element_size()
    if any((n * es) % 16 for n in (recv_x.shape[1], w13.shape[1], w2.shape[2])):
        return False
    for t in (recv_x, w13.transpose(1, 2), w2.transpose(1, 2)):
        if t.data_ptr() % 16 or any(st != 1 and (st * t.element_size()) % 16 for st in t.stride()):
            return False
    return True


def expert_mlp(recv_x: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               activation: str, intermediate: int, *, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, swiglu_alpha: float = SWIGLU_ALPHA,
               swiglu_limit: float = SWIGLU_LIMIT, grouped: bool | None = None,
               act_quant: Any = None, swiglu_beta: float = SWIGLU_BETA,
               swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
               up_softcap: float = 25.0) -> torch.Tensor:
    """Grouped expert MLP.

    Args:
        recv_x: ``[R, H]`` rows grouped by local expert (dtype = layer dtype).
        offsets: ``[E_local + 1]`` int32, expert e owns rows ``[offsets[e], offsets[e+1])``.
        w13: ``[E_local, w13_rows, H]``; w2: ``[E_local, H, I]``.
        b13: optional ``[E_local, w13_rows]`` (float32 or the layer dtype), added to FC1's float32
            result before the activation; b2: optional ``[E_local, H]``, added to FC2's float32
            result before it is rounded to the layer dtype.
        swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act: the ``"clamped_swiglu"``
            parameters; gate_softcap, up_softcap: ``"softcapped_swiglu"``'s (the config's).
        grouped: ``None`` (default): ``torch._grouped_mm`` on CUDA when it can take the shapes
            (:func:`grouped_mm_fits`), else a per-expert matmul loop in float32; ``True``:
            ``torch._grouped_mm`` wherever it can take the shapes (CPU too); ``False``: the loop.
        act_quant: optional ``f(t [M, K] float) -> [M, K]`` applied to FC1's input rows and to the
            activation (rounded to the layer dtype first, as the kernels write it) before FC2: the
            quantise-dequantise of an activation format such as MXFP8 or FP8 per 128 values; its
            results must be exact in the layer dtype.
    Returns:
        ``[R, H]`` in recv_x's dtype; the activation is rounded to that dtype before FC2, as the
        kernels do. ``torch._grouped_mm`` returns its products in the input dtype (it has no
        float32 output), so on that path FC1's and FC2's products are rounded to the layer dtype
        before the biases are added in float32.
    """
    R, H = recv_x.shape
    out = torch.empty(R, H, dtype=recv_x.dtype, device=recv_x.device)
    if R == 0:
        return out

    def act(h: torch.Tensor) -> torch.Tensor:
        a = activate(h, activation, intermediate, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                     swiglu_beta=swiglu_beta, swiglu_limit_after_act=swiglu_limit_after_act,
                     gate_softcap=gate_softcap, up_softcap=up_softcap)
        a = a.to(out.dtype)  # the kernels write the activation in the layer dtype, then quantise it
        return a if act_quant is None else act_quant(a.float())

    if act_quant is not None:  # quantised activations: float32 values of the format, per-expert loop
        recv_x = act_quant(recv_x)
        grouped = False

    if grouped is None:
        grouped = recv_x.is_cuda
    grouped = grouped and hasattr(torch, "_grouped_mm") and grouped_mm_fits(recv_x, w13, w2)
    if grouped:
        ends = offsets[1:].to(torch.int32)
        row_expert = None
        if b13 is not None or b2 is not None:  # local expert of each row (rows past the end: the last)
            rows = torch.arange(R, dtype=offsets.dtype, device=offsets.device)
            row_expert = torch.searchsorted(offsets[1:].contiguous(), rows, right=True)
            row_expert.clamp_(max=w13.shape[0] - 1)
        h = torch._grouped_mm(recv_x, w13.transpose(1, 2), offs=ends).float()
        if b13 is not None:
            h += b13.float()[row_expert]
        a = act(h)
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=ends)
        if b2 is not None:
            y = y.float() + b2.float()[row_expert]
        return y.to(recv_x.dtype)
    offs = offsets.tolist()
    for e in range(w13.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        h = recv_x[lo:hi].float() @ w13[e].float().t()
        if b13 is not None:
            h += b13[e].float()
        y = act(h).float() @ w2[e].float().t()
        if b2 is not None:
            y += b2[e].float()
        out[lo:hi] = y.to(out.dtype)
    return out


def dequantized_weights(cfg: Any, w13: Any, w2: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Semantics of the block-scaled formats (``cfg.quant``): ``(w13, w2, act_quant)`` in the layer
    dtype for :func:`expert_mlp`. ``nvfp4_w4a16``: ``dtype(dequant(w))``, BF16 activations;
    ``mxfp8``: ``dequant(w)`` (exact in bf16) and MXFP8 quantise-dequantise of both GEMM inputs;
    ``fp8_block128``: float32 ``dequant(w)`` and per-row 128-group FP8 quantise-dequantise of both
    GEMM inputs (the products accumulate in float32, as block-scaled FP8 GEMMs do)."""
    from ..quant import (dequantize_fp8_block128, dequantize_fp8_rows128, dequantize_mxfp8, dequantize_nvfp4,
                         quantize_fp8_rows128, quantize_mxfp8)

    if cfg.quant == "fp8_block128":
        def act_quant_fp8(t: torch.Tensor) -> torch.Tensor:
            return dequantize_fp8_rows128(*quantize_fp8_rows128(t))

        return dequantize_fp8_block128(w13), dequantize_fp8_block128(w2), act_quant_fp8
    if cfg.quant == "nvfp4_w4a16":
        return dequantize_nvfp4(w13).to(cfg.dtype), dequantize_nvfp4(w2).to(cfg.dtype), None
    if cfg.quant == "mxfp8":
        def act_quant(t: torch.Tensor) -> torch.Tensor:
            return dequantize_mxfp8(quantize_mxfp8(t))

        return dequantize_mxfp8(w13).to(cfg.dtype), dequantize_mxfp8(w2).to(cfg.dtype), act_quant
    raise ValueError(f"unknown quant format {cfg.quant!r}")


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

    def forward(self, x, topk_ids, topk_weights, w13, w2, out=None, b13=None, b2=None):
        recv_x, offsets, state = self.dispatch(x, topk_ids, topk_weights)
        cfg = self.cfg
        act_quant = None
        if getattr(cfg, "quant", None) is not None:
            w13, w2, act_quant = dequantized_weights(cfg, w13, w2)
        y = expert_mlp(recv_x, offsets, w13, w2, cfg.activation, cfg.intermediate, b13=b13, b2=b2,
                       swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, act_quant=act_quant,
                       swiglu_beta=cfg.swiglu_beta, swiglu_limit_after_act=cfg.swiglu_limit_after_act,
                       gate_softcap=cfg.gate_softcap, up_softcap=cfg.up_softcap)
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
