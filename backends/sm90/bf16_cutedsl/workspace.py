"""One workspace per (EP group, rank, device), shared by every SM90 layer on it (DeepEP-style).

An engine builds one ``MoELayer`` per transformer layer and runs them one after another, so the
layers can share every buffer: each forward rewrites what it reads. A workspace holds two pools,
sized for the largest layer attached to it, and every layer carves its own typed views from them:

* symmetric pool (NVSHMEM for W > 1 on real GPUs; plain device memory otherwise) -- peers write
  it: ``flags [2W] i64, recv_count [W] i32`` (protocol state, at fixed offsets), then
  ``recv_ids [S,K] i32, recv_w [S,K] f32, recv_x [S,H] bf16, comb [S,H] bf16``;
* local pool -- ``ctrl [4] i64, err [4] i32`` (fixed), ``dmask [T_max] i32``, then the expert
  buffers ``xs [P,H] bf16`` (FC1 input; FC2 writes its output ``y`` over it: xs is dead by then),
  ``h [P,I] bf16``, ``idx [P] i32, ws [P] f32, pos [S,K] i32, offsets [E_l+1] i32`` and the
  layout scratch ``counts [1024·E_l] i32``; for a block-scaled backend (``Dims.quant``) also the
  quantised copies of FC1's and FC2's inputs, ``xq [P,H], hq [P,I]`` e4m3 with one scale per block
  of values, ``xq_scale [P,H/block], hq_scale [P,I/block]``, and what the FP8 backend's opt-in
  switches add: the received tokens quantised in token order ``xq_tok [S,H], sx_tok [S,H/block]``
  (``Dims.token_rows``, ``MOE_EP_FP8_PLACE_FC1=copy``) and the sender's quantised tokens
  ``xq_send [T_max,H], sx_send [T_max,H/block]`` (``Dims.send_rows``, ``MOE_EP_FP8_WIRE=1``);

with S = W·T_max receive slots, P = S·K grouped rows, each region rounded up to 256 bytes
(:func:`workspace_bytes` gives the total). Why sharing is correct: the EP protocol state (epoch,
flags) is one sequence per workspace, and all ranks call their layers' forwards in the same
order (a requirement of any collective), so interleaving layers is just a longer sequence of
forwards. What must stay per layer does: each layer has its own record of bad inputs (``verr``);
a fatal error (a stalled peer) is shared, as it stops every layer's kernels until
``reset_error_state()``.

Lifetime: the pools are allocated at the first ``warmup()`` (collective), sized for every layer
constructed so far; a larger layer warmed up later grows them (collective; every attached layer
is re-bound to the new pools -- CUDA graphs captured before that are invalid). The last layer's
``destroy()`` frees them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.shim import (SM90_LAYOUT_MAX_CHUNKS, nvshmem_acquire, sm90_ep_buffer_specs,
                         sm90_layout_counts_len)

ALIGN = 256  # bytes; every region starts 256-byte aligned (TMA and 16-byte vectors need 16)


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Dims:
    """What one layer needs from the workspace."""

    hidden: int
    intermediate: int
    topk: int
    world: int
    max_tokens: int
    local_experts: int
    #: block-scaled backends: ``(values per scale, scale dtype)`` of the grouped rows' quantised
    #: copies (``xq``, ``hq``); None: a BF16 layer, which needs none
    quant: tuple | None = None
    #: with ``quant``: the received tokens quantised once each, in token order (``xq_tok``, ``sx_tok``)
    token_rows: bool = False
    #: with ``quant``: this rank's tokens quantised before they are sent (``xq_send``, ``sx_send``)
    send_rows: bool = False

    @staticmethod
    def of(config: Any, world: int, quant: tuple | None = None, *, token_rows: bool = False,
           send_rows: bool = False) -> "Dims":
        if (token_rows or send_rows) and quant is None:
            raise ValueError("Dims: token_rows / send_rows are quantised rows: they need quant=(block, scale dtype)")
        return Dims(config.hidden, config.intermediate, config.top_k, world, config.max_tokens_per_rank,
                    config.local_experts(world), quant, token_rows, send_rows)


def _plan(d: Dims) -> tuple[list, list, int, int]:
    """(symmetric regions, local regions, symmetric bytes, local bytes); a region is
    (name, shape, dtype, byte offset). Fixed regions come first, so they sit at the same offsets
    for every layer of a workspace."""
    S, P = d.world * d.max_tokens, d.world * d.max_tokens * d.topk
    ep = sm90_ep_buffer_specs(d.hidden, d.topk, d.world, d.max_tokens)
    sym = [(b.name, b.shape, b.dtype) for b in ep if b.symmetric]
    loc = [(b.name, b.shape, b.dtype) for b in ep if not b.symmetric]
    loc += [("xs", (P, d.hidden), torch.bfloat16), ("h", (P, d.intermediate), torch.bfloat16),
            ("idx", (P,), torch.int32), ("ws", (P,), torch.float32), ("pos", (S, d.topk), torch.int32),
            ("offsets", (d.local_experts + 1,), torch.int32),
            ("counts", (sm90_layout_counts_len(SM90_LAYOUT_MAX_CHUNKS, d.local_experts),), torch.int32)]
    if d.quant is not None:  # rewritten by every forward like xs and h, so shared like them
        block, scale_dtype = d.quant
        loc += [("xq", (P, d.hidden), torch.float8_e4m3fn), ("xq_scale", (P, d.hidden // block), scale_dtype),
                ("hq", (P, d.intermediate), torch.float8_e4m3fn),
                ("hq_scale", (P, d.intermediate // block), scale_dtype)]
        for on, rows, q, sc in ((d.token_rows, S, "xq_tok", "sx_tok"), (d.send_rows, d.max_tokens, "xq_send", "sx_send")):
            if on:
                loc += [(q, (rows, d.hidden), torch.float8_e4m3fn), (sc, (rows, d.hidden // block), scale_dtype)]
    out = []
    for regions in (sym, loc):
        off, placed = 0, []
        for name, shape, dtype in regions:
            n = 1
            for s in shape:
                n *= s
            placed.append((name, shape, dtype, off))
            off += _round(n * torch.empty((), dtype=dtype).element_size())
        out.append((placed, off))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def workspace_bytes(config: Any, world_size: int, quant: tuple | None = None, **rows: bool) -> int:
    """Device bytes of the workspace one layer of ``config`` needs on each rank:

    symmetric = 2W·8 + W·4 + 2·S·K·4 + 2·S·H·2, local = 4·8 + 4·4 + T_max·4 + P·H·2 + P·I·2
    + 3·P·4 + (E_l+1)·4 + 1024·E_l·4 (each term rounded up to 256 bytes), S = W·T_max, P = S·K;
    ``quant`` ``(block, scale dtype)``: + P·(H + I) + P·(H + I)/block·scale bytes; ``rows``
    (``token_rows`` / ``send_rows``, see :class:`Dims`): + S or T_max rows of H + H/block·scale bytes.
    Layers sharing a workspace need the maximum over them, not the sum."""
    return dims_bytes(Dims.of(config, world_size, quant, **rows))


def dims_bytes(d: Dims) -> int:
    """:func:`workspace_bytes` of a layer's :class:`Dims`."""
    _, _, s, loc = _plan(d)
    return s + loc


class Workspace:
    """The shared pools of one (group, rank, device). Use :func:`get_workspace`."""

    def __init__(self, key: tuple, device: torch.device, rank: int, world: int, group: Any,
                 nvshmem: bool) -> None:
        self.key, self.device, self.rank, self.world, self.group = key, device, rank, world, group
        self.nvshmem = nvshmem
        self.runtime = None
        self.sym_pool: torch.Tensor | None = None
        self.local_pool: torch.Tensor | None = None
        self.sym_bytes = self.local_bytes = 0
        self.generation = 0
        #: host-side sequence number of dispatches on this workspace (handles compare it)
        self.seq = 0
        self._needs: "weakref.WeakKeyDictionary[Any, Dims]" = weakref.WeakKeyDictionary()
        self._bound: "weakref.WeakSet[Any]" = weakref.WeakSet()

    # -- sizing ---------------------------------------------------------------------------------
    def register(self, client: Any, dims: Dims) -> None:
        """A layer was constructed: size the pools for it too (at the next reserve)."""
        self._needs[client] = dims

    def _required(self) -> tuple[int, int]:
        sym = loc = 0
        for d in list(self._needs.values()):
            _, _, s, lb = _plan(d)
            sym, loc = max(sym, s), max(loc, lb)
        return sym, loc

    def reserve(self) -> bool:
        """Collective (W > 1): make the pools large enough for every registered layer. Returns
        True when they were (re)allocated; the caller then re-binds the other bound layers."""
        sym, loc = self._required()
        if sym <= self.sym_bytes and loc <= self.local_bytes:
            return False
        sym, loc = max(sym, self.sym_bytes), max(loc, self.local_bytes)
        self._free_pools()
        if self.nvshmem:
            if self.runtime is None:
                self.runtime = nvshmem_acquire(self.group.pg, device_index=self.device.index, heap_bytes=sym)
            self.sym_pool = self.runtime.tensor((sym,), torch.uint8)
        else:
            self.sym_pool = torch.empty(sym, dtype=torch.uint8, device=self.device)
        self.local_pool = torch.empty(loc, dtype=torch.uint8, device=self.device)
        # protocol state starts at zero (flags, recv_count, ctrl, err sit at the pools' heads)
        self.sym_pool.zero_()
        self.local_pool[:ALIGN * 4].zero_()
        self.sym_bytes, self.local_bytes = sym, loc
        self.generation += 1
        if self.runtime is not None:  # peers' flags are zero before anyone writes them
            self.runtime.barrier(torch.cuda.current_stream(self.device))
        return True

    def rebind_others(self, me: Any) -> None:
        """After a growth: every other bound layer builds its views and sessions again."""
        for client in list(self._bound):
            if client is not me:
                client._rebind()

    # -- views ----------------------------------------------------------------------------------
    @staticmethod
    def _carve(pool: torch.Tensor, regions: list) -> dict:
        out = {}
        for name, shape, dtype, off in regions:
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            out[name] = pool[off:off + nbytes].view(dtype).view(shape)
        return out

    def views(self, dims: Dims) -> dict:
        """This rank's typed buffers for a layer of ``dims`` (symmetric and local)."""
        sym, loc, s, lb = _plan(dims)
        if self.sym_pool is None or s > self.sym_bytes or lb > self.local_bytes:
            raise RuntimeError("workspace too small for this layer: call reserve() first")
        return {**self._carve(self.sym_pool, sym), **self._carve(self.local_pool, loc)}

    def peer_views(self, dims: Dims) -> list:
        """W > 1 on real GPUs: per rank r, its symmetric buffers as addressable from here."""
        sym, _, _, _ = _plan(dims)
        return [self._carve(pool, sym) for pool in self.runtime.peers(self.sym_pool)]

    def bind(self, client: Any) -> None:
        self._bound.add(client)

    def detach(self, client: Any) -> None:
        """A layer is destroyed; the last one frees the pools (collective for NVSHMEM)."""
        self._bound.discard(client)
        self._needs.pop(client, None)
        if len(self._needs) == 0:
            self._free_pools()
            if self.runtime is not None:
                self.runtime.release()
                self.runtime = None
            with _LOCK:
                if _WORKSPACES.get(self.key) is self:
                    del _WORKSPACES[self.key]

    def _free_pools(self) -> None:
        if self.sym_pool is None:
            return
        if self.device.type == "cuda":  # no kernel may still use the pools
            torch.cuda.synchronize(self.device)
        if self.runtime is not None:
            self.runtime.barrier(torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
            if self.runtime.alive:
                self.runtime.free(self.sym_pool)
        self.sym_pool = self.local_pool = None
        self.sym_bytes = self.local_bytes = 0


_LOCK = threading.Lock()
_WORKSPACES: dict[tuple, Workspace] = {}


def group_key(group: Any) -> tuple:
    """Identity of an EP group: its global ranks (real), or ('virtual', W) / ('single',)."""
    if group.world_size == 1:
        return ("single",)
    if group.dist_backend == "virtual":
        return ("virtual", group.world_size)
    import torch.distributed as dist

    return ("ranks",) + tuple(dist.get_process_group_ranks(group.pg))


def get_workspace(group: Any, device: torch.device) -> Workspace:
    """The process-level workspace of (group, this rank, device), created on first use."""
    key = (group_key(group), group.rank, device.type, device.index)
    with _LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None:
            nvshmem = group.world_size > 1 and group.dist_backend != "virtual"
            ws = _WORKSPACES[key] = Workspace(key, device, group.rank, group.world_size, group, nvshmem)
        return ws


def live_workspaces() -> list[Workspace]:
    """For tests and diagnostics."""
    with _LOCK:
        return list(_WORKSPACES.values())
