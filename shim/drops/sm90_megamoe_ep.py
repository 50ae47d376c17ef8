"""Shim for the SM90 drop's EP dispatch / combine kernels (``sm90_megamoe.ep_launch``): shape
checks, the buffer list, the compile-cache key, :func:`prebuild_ep` and the per-layer
:class:`EpSession`. Same drop, contract and mirrored constants as :mod:`.sm90_megamoe` (which
re-exports these names); kept apart only to keep files short."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE, ensure_not_capturing
from ..errors import CapacityError, DeviceStallError
from ..launch_mode import use_tvm_ffi
from .sm90_megamoe import CONSTANTS, PKG, _E, _L, _check_ep_arch, _cutlass_version, _load, cache_namespace

#: CTAs per SM of ``combine_local`` at large token counts (EpSession.local_combine_ctas)
LOCAL_COMBINE_CTAS_PER_SM = 4
_WHERE = {1: "dispatch", 2: "dispatch wait", 3: "combine send", 4: "combine reduce"}


@dataclass(frozen=True)
class EpKey:
    """Every value the compiled EP kernels depend on."""

    drop_version: int
    ep_abi_version: int
    cutlass_version: str
    arch: str
    hidden: int
    topk: int
    world: int
    max_tokens: int
    num_experts: int
    tvm_ffi: bool
    local_combine: bool = False


def check_ep_shapes(hidden: int, topk: int, world: int, num_experts: int) -> None:
    if hidden % _E["EP_ALIGN_H_ELEMS"]:
        raise ValueError(f"sm90 EP: hidden={hidden} must be a multiple of {_E['EP_ALIGN_H_ELEMS']}")
    if not 1 <= topk <= _E["EP_MAX_TOPK"]:
        raise ValueError(f"sm90 EP: top_k={topk} must be in [1, {_E['EP_MAX_TOPK']}]")
    if not 1 <= world <= _E["EP_MAX_WORLD"]:
        raise ValueError(f"sm90 EP: world size {world} must be in [1, {_E['EP_MAX_WORLD']}]")
    if num_experts % world:
        raise ValueError(f"sm90 EP: num_experts={num_experts} must be a multiple of the world size {world}")
    if num_experts // world > _L["LAYOUT_MAX_LOCAL_EXPERTS"]:
        raise ValueError(f"sm90 EP: {num_experts // world} local experts, at most {_L['LAYOUT_MAX_LOCAL_EXPERTS']}")


@dataclass(frozen=True)
class BufferSpec:
    """One buffer the EP kernels use: ``shape``/``dtype``; ``symmetric`` = peers write it;
    ``fixed`` = its place must be the same for every layer sharing a workspace (protocol state);
    ``init``: ``"zero"`` or ``"verr"`` (ep_constants.VERR_RESET) at allocation, ``None``: any."""

    name: str
    shape: tuple
    dtype: Any
    symmetric: bool
    fixed: bool
    init: str | None


def ep_buffer_specs(hidden: int, topk: int, world: int, max_tokens: int) -> list[BufferSpec]:
    """The drop's EP buffers (``ep_launch.EpBuffers``) for one configuration, fixed ones first.
    ``verr`` (a layer's record of bad inputs) is per layer and not listed."""
    import torch

    S, H, K, W = world * max_tokens, hidden, topk, world
    return [
        BufferSpec("flags", (2 * W,), torch.int64, True, True, "zero"),
        BufferSpec("recv_count", (W,), torch.int32, True, True, "zero"),
        BufferSpec("recv_ids", (S, K), torch.int32, True, False, None),
        BufferSpec("recv_w", (S, K), torch.float32, True, False, None),
        BufferSpec("recv_x", (S, H), torch.bfloat16, True, False, None),
        BufferSpec("comb", (S, H), torch.bfloat16, True, False, None),
        BufferSpec("ctrl", (_E["EP_CTRL_LEN"],), torch.int64, False, True, "zero"),
        BufferSpec("err", (_E["EP_ERR_LEN"],), torch.int32, False, True, "zero"),
        BufferSpec("dmask", (max_tokens,), torch.int32, False, False, None),
    ]


SYMMETRIC = ("recv_x", "recv_ids", "recv_w", "recv_count", "flags", "comb")


def new_verr(device: Any):
    """A fresh per-layer record of bad inputs (int64 [8] = VERR_RESET)."""
    import torch

    return torch.tensor(_E["VERR_RESET"], dtype=torch.int64, device=device)


def prebuild_ep(hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                arch: str = "sm_90a", local_combine: bool = False) -> None:
    """Compile (or load from the disk cache) every EP kernel for these static values and ``arch``
    (:data:`EP_ARCHS`); no GPU needed. Sessions call it; so does ``python -m moe_ep.aot``."""
    check_ep_shapes(hidden, topk, world, num_experts)
    _check_ep_arch(arch)
    el = _load("sm90_megamoe.ep_launch")
    cfg = el.EpConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens, num_experts=num_experts)
    ffi = use_tvm_ffi()
    local_combine = bool(local_combine) and world == 1  # the one-launch combine exists for W = 1 only
    key = EpKey(CONSTANTS.value(PKG, "DROP_VERSION"), _E["EP_ABI_VERSION"], _cutlass_version(), arch,
                hidden, topk, world, max_tokens, num_experts, ffi, local_combine)

    COMPILE_CACHE.get_or_compile(key, lambda: {k: build_ep_kernel(key, k) for k in el.kinds_for(cfg, local_combine)})


def build_ep_kernel(key: EpKey, kind: str) -> Any:
    """EP kernel ``kind`` of ``key`` from the disk cache, else compiled and stored; either way put
    where the drop's launches find it. The compile step of :func:`prebuild_ep` and of a cache rebuilt
    from a manifest (``kernel_replay``)."""
    el = _load("sm90_megamoe.ep_launch")
    cfg = el.EpConfig(hidden=key.hidden, topk=key.topk, world=key.world, max_tokens=key.max_tokens,
                      num_experts=key.num_experts)
    compiled = disk_cache.get_or_build(
        cache_namespace(key.arch), f"ep_{kind}", (key, kind),
        lambda: el.compile_kernel(kind=kind, cfg=cfg, tvm_ffi=key.tvm_ffi, arch=key.arch), tvm_ffi=key.tvm_ffi)
    el.put_kernel(kind=kind, cfg=cfg, compiled=compiled, tvm_ffi=key.tvm_ffi, arch=key.arch)
    return compiled


class EpSession:
    """One layer's EP kernels on one rank, on buffers the caller owns.

    ``buffers``: every :func:`ep_buffer_specs` name plus ``verr`` -> tensor of that shape/dtype
    (views into a workspace). ``peers`` (W > 1 on real GPUs): ``peers[r]`` maps each symmetric
    buffer name to rank r's buffer as addressable from this rank (``peers[rank]`` = own). Virtual
    ranks pass ``peers=None`` and call :meth:`connect`. W == 1 needs neither.
    Launch methods never synchronise the host; :meth:`check` and :meth:`read_input_errors` do.
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                 rank: int, device: Any, buffers: dict, peers: list | None = None,
                 global_ranks: tuple = (), num_ctas: int | None = None, timeout_ns: int | None = None,
                 arch: str = "sm_90a", local_combine: bool = False) -> None:
        check_ep_shapes(hidden, topk, world, num_experts)
        ensure_not_capturing("EP session set-up")
        el = self._el = _load("sm90_megamoe.ep_launch")
        self.cfg = el.EpConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                                     num_experts=num_experts)
        self.local_combine = bool(local_combine) and world == 1
        prebuild_ep(hidden, topk, world, max_tokens, num_experts, arch, self.local_combine)
        self.arch = arch
        self.world, self.rank, self.device = world, rank, device
        self.global_ranks = tuple(global_ranks) or tuple(range(world))
        self._num_ctas, self._timeout_ns = num_ctas, timeout_ns
        self.bufs = el.EpBuffers(**{n: buffers[n] for n in (*SYMMETRIC, "ctrl", "err", "verr", "dmask")})
        self.ep = None
        if peers is not None:
            self._connect(peers)
        elif world == 1:
            self._connect([self.bufs])

    def connect(self, sessions: list) -> None:
        """Virtual ranks: build the peer table from every virtual rank's buffers (index = rank)."""
        if len(sessions) != self.world:
            raise ValueError(f"connect() needs {self.world} sessions, got {len(sessions)}")
        self._connect([s.bufs for s in sessions])

    def _connect(self, views: list) -> None:
        el = self._el
        self.peer_table = el.build_peer_table(peer_buffers=views, device=self.device)
        kw = {} if self._timeout_ns is None else {"timeout_ns": int(self._timeout_ns)}
        self.ep = el.EpRank(cfg=self.cfg, rank=self.rank, bufs=self.bufs, peer_table=self.peer_table,
                            num_ctas=self._num_ctas, tvm_ffi=use_tvm_ffi(), arch=self.arch,
                            local_combine=self.local_combine, **kw)
        self.dispatch = self.ep.dispatch
        self.wait = self.ep.wait
        self.gather = self.ep.gather  # out[i] = src[idx[i]] for i < count[0] (rows of this width)
        self.combine_send = self.ep.combine_send
        self.combine_reduce = self.ep.combine_reduce
        # W = 1: combine_send + combine_reduce in one launch (drop v14), bit for bit; drop v58:
        # prepare_combine_local(y, pos) -> run(out, num_ctas=None), the same launch with y and pos
        # checked and packed once (a layer's own buffers)
        self.combine_local = self.ep.combine_local if self.local_combine else None
        self.prepare_combine_local = self.ep.prepare_combine_local if self.local_combine else None

    def token_ctas(self, tokens: int) -> int:
        """Grid for the kernels that take one token per warp (dispatch, combine_local,
        combine_reduce) in a call of ``tokens`` tokens: enough CTAs for one warp per token, at
        most the session's grid, at least 1 (a call without tokens still publishes its flag). The
        results do not depend on the grid (each token is one warp's work; the first-bad-value
        record is an atomic minimum); what shrinks is the per-CTA completion protocol (dispatch:
        one system-scope fence and arrival atomic per CTA), which dominates a decode step's dispatch."""
        warps = self.cfg.threads // 32
        return max(1, min(self.ep.num_ctas, -(-int(tokens) // warps)))

    def local_combine_ctas(self, tokens: int) -> int:
        """Grid of ``combine_local`` (one rank) for ``tokens`` tokens: one warp per token, up to
        LOCAL_COMBINE_CTAS_PER_SM CTAs per SM of the session's grid. Nothing waits on another rank
        there, and one CTA of 8 warps per SM kept too few loads in flight: at 8192 tokens the
        kernel read Qwen3's 268 MB of expert rows at ~2.7 TB/s on the H200. Same bits at any grid
        (each token is one warp's work, in k order)."""
        warps = self.cfg.threads // 32
        return max(1, min(LOCAL_COMBINE_CTAS_PER_SM * self.ep.num_ctas, -(-int(tokens) // warps)))

    def release(self) -> None:
        """Classic launch path: drop the converted arguments that keep the last call's tensors alive
        (drop v113's ``EpRank.release``; a warm-up's throw-away tokens). TVM-FFI keeps none."""
        if self.ep is not None:
            self.ep.release()

    def check(self) -> None:
        """Raise :class:`DeviceStallError` (timeout) or :class:`CapacityError` if a kernel of this
        rank set its error word. Synchronises the host."""
        code, peer, where, aux = self.ep.read_err()
        if code == _E["ERR_TIMEOUT"]:
            g = self.global_ranks[peer] if 0 <= peer < len(self.global_ranks) else peer
            raise DeviceStallError(
                f"EP rank {self.rank}: timed out in {_WHERE.get(where, where)} waiting for rank {peer} "
                f"(global rank {g}) at forward {aux}; that rank stalled or did not call forward. "
                "Every rank must call reset_error_state() (collective) before the next forward",
                rank=peer, global_rank=g, where=_WHERE.get(where, str(where)))
        if code == _E["ERR_CAPACITY"]:
            raise CapacityError(f"EP rank {self.rank}: {aux} tokens exceed the receive capacity "
                                f"(max_tokens_per_rank); nothing was written")
        if code:
            raise RuntimeError(f"EP rank {self.rank}: device error word {(code, peer, where, aux)}")

    def read_input_errors(self) -> dict:
        """``{"topk_ids": (forward, token, k, id) | None, "topk_weights": (forward, token, k,
        value) | None}``: the first dropped choice of each kind since the last reset (host sync)."""
        return self.ep.read_verr()

    def reset_input_errors(self) -> None:
        self.ep.reset_verr()

    def reset(self) -> None:
        """Zero this rank's flags, counters and error word (collective: barrier before and after)."""
        self.ep.reset_state()


def compile_ep_ptx(kind: str, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                   arch: str = "sm_90a") -> str:
    """Compile one EP kernel (``dispatch``, ``dispatch_i64``, ``wait``, ``gather``,
    ``combine_send``, ``combine_send_weighted``, ``combine_reduce``) or layout kernel
    (``layout_count``, ``layout_place``) without a GPU and return its PTX (artifacts go to a
    temporary folder)."""
    check_ep_shapes(hidden, topk, world, num_experts)
    with tempfile.TemporaryDirectory(prefix="moe_ep_ptx_") as d:
        opts = f"--gpu-arch {arch} --keep-ptx --dump-dir={d}"
        if kind.startswith("layout_"):
            ll = _load("sm90_megamoe.layout_launch")
            cfg = ll.LayoutConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                                  local_experts=num_experts // world)
            return ll.compile_kernel(kind[len("layout_"):], cfg, options=opts).__ptx__
        el = _load("sm90_megamoe.ep_launch")
        cfg = el.EpConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens, num_experts=num_experts)
        return el.compile_kernel(kind=kind, cfg=cfg, options=opts).__ptx__
