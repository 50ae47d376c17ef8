"""SM90 (H100/H200) BF16 backend on the CuTeDSL drop ``sm90/megamoe`` — any EP size on one host.

Forward of one rank (W ranks, S = W·T_max receive slots, P = S·K pair capacity), all on the
device, no host sync, no allocation (buffers come from ``warmup``), CUDA-graph capturable:

1. ``dispatch`` kernel: each token row goes once to every rank that owns one of its experts
   (peer stores into that rank's symmetric ``recv_x`` at slot ``my_rank·T_max + t``), with its
   local expert ids and router weights; an epoch flag publishes it (W == 1: the same kernels on
   local memory, no NVSHMEM);
2. ``wait`` kernel: until every source's flag carries this forward's epoch (bounded by
   ``%globaltimer``; a stall sets an error word that :meth:`check` turns into an exception);
3. expert layout: valid (slot, k) pairs stably sorted by local expert (torch ops on the device) ->
   ``expert_offsets``, row -> slot, row weights, (slot, k) -> row; then the ``gather`` kernel
   copies ``xs[r] = recv_x[slot of r]``. With ``deterministic=False`` two drop kernels do all of
   it (count + scan, place + gather) with atomic row placement: fewer launches, not bit-stable;
4. FC1 + activation, FC2 with the router weight per row in the epilogue (varlen-M grouped GEMMs);
5. ``combine_send`` kernel: per received token, its ≤K weighted expert rows summed in float32 in
   k order -> one bf16 row back to the source rank (peer store), then an epoch flag;
6. ``combine_reduce`` kernel: the ≤W partial rows of each token summed in float32 in rank order.

Capacity (no per-expert capacity, nothing dropped): a source sends each token at most once to each
destination, into its own slot range, so a rank receives at most ``S = W·T_max`` token rows
(``recv_x``/``comb``: S × H bf16 each, symmetric) and at most ``P = S·K`` (token, local expert)
rows for the grouped GEMMs (``xs``/``y``: P × H, ``h``: P × I, local). ``T > T_max`` is refused by
the API before launch; the dispatch kernel also sets a capacity error instead of writing out of
bounds.

No floating-point atomics: with ``deterministic=True`` (the default) outputs are bit-deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.shim import (Sm90EpSession, Sm90LayoutSession, nvshmem_acquire, sm90_check_gemm_shapes,
                         sm90_grouped_gemm)

from ...registry import BackendImpl, UnsupportedBackendError
from .layout import LayoutBuffers, expert_layout

ACTIVATION_MAP = {"swiglu": "swiglu", "squared_relu": "squared_relu"}
#: bytes kept free on top of the symmetric buffers when sizing NVSHMEM's heap
_HEAP_SLACK = 256 << 20


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl needs a CUDA device (got {device})")
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl needs an SM90 GPU (H100/H200); this GPU is "
                                      f"sm_{cc[0]}{cc[1]} ({torch.cuda.get_device_name(device)})")
    if config.dtype != torch.bfloat16:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl runs bf16 only, not {config.dtype}")
    if config.activation not in ACTIVATION_MAP:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl: activation {config.activation!r} is not "
                                      f"supported (supported: {sorted(ACTIVATION_MAP)})")
    if group.world_size > 1 and group.dist_backend != "nccl":
        raise UnsupportedBackendError("sm90_bf16_cutedsl over several ranks bootstraps NVSHMEM over an "
                                      f"NCCL process group (got {group.dist_backend!r})")
    try:
        import cutlass  # noqa: F401
    except ImportError as e:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl needs nvidia-cutlass-dsl: {e}") from e
    e_local = config.local_experts(group.world_size)
    try:
        sm90_check_gemm_shapes(ACTIVATION_MAP[config.activation], config.w13_rows, config.hidden, e_local)
        sm90_check_gemm_shapes("identity", config.hidden, config.intermediate, e_local)
    except ValueError as e:
        raise UnsupportedBackendError(str(e)) from e


@dataclass
class Sm90HandleState:
    num_tokens: int
    topk_ids: torch.Tensor  # [T, K] int32 (the layer's persistent copy)


class Sm90CuteDSLBackend(BackendImpl):
    name = "sm90_bf16_cutedsl"

    def __init__(self, config: Any, group: Any, device: torch.device, *, timeout_s: float = 10.0,
                 num_ctas: int | None = None, virtual: bool = False, deterministic: bool = True) -> None:
        """``num_ctas``: grid of every kernel (default: all SMs). ``virtual``: one of W virtual
        ranks in this process (see :mod:`.virtual`), for testing EP on one GPU.
        ``deterministic=False`` builds the expert layout with the drop's two layout kernels
        (atomic row placement: ~0.35 ms less host time per eager forward on the Qwen3 shape) instead
        of ~16 torch ops around a stable sort. Experimental: outputs are then not bit-stable
        (seen on the H200; they passed the bf16-tolerance oracles, cause under investigation —
        docs/PERFORMANCE.md)."""
        self.layout_kernel = not deterministic
        self.num_ctas = num_ctas
        self.virtual = virtual
        self.cfg = config
        self.group = group
        self.device = device
        self.W = group.world_size
        self.E = config.local_experts(self.W)
        self.timeout_ns = int(timeout_s * 1e9)
        self.ep = None
        self.runtime = None

    # ---- set-up ------------------------------------------------------------------------------
    def _ensure(self) -> None:
        if self.ep is not None:
            return
        cfg, W, E, dev = self.cfg, self.W, self.E, self.device
        self._fc1 = sm90_grouped_gemm(ACTIVATION_MAP[cfg.activation], cfg.w13_rows, cfg.hidden, E)
        self._fc2 = sm90_grouped_gemm("identity", cfg.hidden, cfg.intermediate, E, scale_rows=True)
        Tm, K, H = cfg.max_tokens_per_rank, cfg.top_k, cfg.hidden
        S = W * Tm
        P = S * K
        global_ranks = (0,)
        if W > 1 and not self.virtual:
            import os

            import torch.distributed as dist

            # symmetric heap: recv_x + comb + ids/weights + flags, with slack (set before init)
            need = 2 * S * H * 2 + S * K * 8 + 64 * W + _HEAP_SLACK
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(need))
            self.runtime = nvshmem_acquire(self.group.pg, device_index=dev.index)
            global_ranks = tuple(dist.get_process_group_ranks(self.group.pg))
        self.ep = Sm90EpSession(H, K, W, Tm, cfg.num_experts, self.group.rank, dev, runtime=self.runtime,
                                global_ranks=global_ranks, timeout_ns=self.timeout_ns, num_ctas=self.num_ctas,
                                virtual=self.virtual)
        if self.runtime is not None:
            self.runtime.barrier(torch.cuda.current_stream(dev))  # peers' flags are zero before use
        bf = torch.bfloat16
        self._xs = torch.empty(P, H, dtype=bf, device=dev)
        self._h = torch.empty(P, cfg.intermediate, dtype=bf, device=dev)
        self._y = torch.empty(P, H, dtype=bf, device=dev)
        self._ids = torch.empty(Tm, K, dtype=torch.int32, device=dev)
        self._lb = LayoutBuffers.allocate(W, Tm, K, E, dev)
        self._layout = (Sm90LayoutSession(H, K, W, Tm, E, dev, num_ctas=self.num_ctas)
                        if self.layout_kernel else None)

    def warmup(self, progress):
        progress(f"compiling FC1 ({self.cfg.activation}), FC2 and EP kernels for sm_90a"
                 + (f"; NVSHMEM over {self.W} ranks" if self.W > 1 else ""))
        self._ensure()
        progress("running once")
        cfg = self.cfg
        T = min(cfg.max_tokens_per_rank, 64)
        g = torch.Generator(device=self.device).manual_seed(1234 + self.group.rank)
        x = torch.randn(T, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, cfg.num_experts, (T, cfg.top_k), device=self.device, generator=g, dtype=torch.int32)
        w = torch.rand(T, cfg.top_k, device=self.device, generator=g)
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g).to(torch.bfloat16)
        self.forward(x, ids, w, w13, w2)
        torch.cuda.synchronize(self.device)
        self.check()

    # ---- forward -----------------------------------------------------------------------------
    # The forward in four steps, so that virtual ranks in one process can interleave them by
    # phase (every rank's dispatch is enqueued before any rank's wait, and so on).
    def _step_dispatch(self, x, topk_ids, topk_weights):
        ids = self._ids[:x.shape[0]]
        ids.copy_(topk_ids)  # int64 -> int32 as needed, into a persistent buffer
        self.ep.dispatch(x, ids, topk_weights)
        return ids

    def _step_layout(self):
        b, lb = self.ep.bufs, self._lb
        self.ep.wait()
        if self._layout is not None:  # two launches: count + scan, place + row gather
            self._layout(b.recv_ids, b.recv_w, b.recv_count, b.recv_x, lb.offsets, lb.idx, lb.ws, lb.pos, self._xs)
        else:  # stable sort: (expert, slot, k) row order, bit-deterministic
            expert_layout(lb, b.recv_ids, b.recv_w, b.recv_count, self.E)
            self.ep.gather(b.recv_x, lb.idx, lb.offsets[self.E:], self._xs)

    def _step_experts(self, w13, w2):
        lb = self._lb
        self._fc1(self._xs, w13, lb.offsets, out=self._h, max_active_ctas=self.num_ctas)
        self._fc2(self._h, w2, lb.offsets, out=self._y, row_scale=lb.ws, max_active_ctas=self.num_ctas)

    def forward(self, x, topk_ids, topk_weights, w13, w2, out=None):
        self._ensure()
        if out is None:
            out = torch.empty(x.shape[0], self.cfg.hidden, dtype=x.dtype, device=x.device)
        ids = self._step_dispatch(x, topk_ids, topk_weights)
        self._step_layout()
        self._step_experts(w13, w2)
        self.ep.combine_send(self._y, self._lb.pos)
        self.ep.combine_reduce(ids, out)
        return out

    # ---- the split pair ------------------------------------------------------------------------
    def dispatch(self, x, topk_ids, topk_weights):
        """Returns exactly R rows: reading R is this path's one host sync."""
        self._ensure()
        ids = self._step_dispatch(x, topk_ids, topk_weights)
        self._step_layout()
        R = int(self._lb.offsets[self.E])
        return self._xs[:R], self._lb.offsets.clone(), Sm90HandleState(x.shape[0], ids)

    def combine(self, expert_out, state: Sm90HandleState, out=None):
        T = state.num_tokens
        if out is None:
            out = torch.empty(T, self.cfg.hidden, dtype=expert_out.dtype, device=expert_out.device)
        R = expert_out.shape[0]
        y = self._y[:max(R, 1)]
        if R:
            torch.mul(expert_out, self._lb.ws[:R].unsqueeze(1), out=y)  # router weights, as FC2 would
        self.ep.combine_send(y, self._lb.pos)
        self.ep.combine_reduce(state.topk_ids, out)
        return out

    # ---- benchmark hooks -------------------------------------------------------------------------
    def comm_ops(self, x, topk_ids, topk_weights):
        """For benchmarks: ``(dispatch, combine)`` callables that run only the communication
        kernels of a forward on these inputs (dispatch + wait; combine send + reduce). Run one
        full forward first so the expert layout is valid for ``combine``."""
        self._ensure()
        T = x.shape[0]
        ids = self._ids[:T]
        ids.copy_(topk_ids)
        out = torch.empty(T, self.cfg.hidden, dtype=torch.bfloat16, device=self.device)

        def dispatch():
            self.ep.dispatch(x, ids, topk_weights)
            self.ep.wait()

        def combine():
            self.ep.combine_send(self._y, self._lb.pos)
            self.ep.combine_reduce(ids, out)

        return dispatch, combine

    # ---- errors and teardown ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a device-side wait timed out or capacity overflowed (host sync)."""
        if self.ep is not None:
            self.ep.check()

    def reset_error_state(self) -> None:
        """Collective: clear every rank's EP flags/counters after an error."""
        if self.ep is None:
            return
        torch.cuda.synchronize(self.device)
        if self.W > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group.pg)
        self.ep.reset()
        torch.cuda.synchronize(self.device)
        if self.W > 1:
            dist.barrier(group=self.group.pg)

    def destroy(self):
        if self.ep is not None:
            torch.cuda.synchronize(self.device)
            if self.runtime is not None:
                self.runtime.barrier(torch.cuda.current_stream(self.device))
                torch.cuda.synchronize(self.device)
            self.ep.free()
            self.ep = None
        if self.runtime is not None:
            self.runtime.release()
            self.runtime = None


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False):
    """The compiled SM90 varlen-M grouped GEMM (for benchmarks and engines with their own MoE
    plumbing): ``fn(a [M,k] bf16, b [E,n,k] bf16, offsets [E+1] int32 (device), out=[M,n_out]
    bf16, row_scale=[M] f32)``; ``n_out`` = n/2 for swiglu."""
    return sm90_grouped_gemm(activation, n, k, num_experts, scale_rows=scale_rows)
