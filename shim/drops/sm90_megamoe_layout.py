"""Shim for the SM90 drop's expert-layout kernels (``sm90_megamoe.layout_launch``): the
compile-cache key, :func:`prebuild_layout` and the per-layer :class:`LayoutSession`. Same drop,
contract and mirrored constants as :mod:`.sm90_megamoe` (which re-exports these names); kept
apart only to keep files short."""

from __future__ import annotations

from dataclasses import dataclass, replace as dc_replace
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE, ensure_not_capturing
from ..launch_mode import use_tvm_ffi
from .sm90_megamoe import (CONSTANTS, LAYOUT_MAX_CHUNKS, PKG, EpSession, _check_ep_arch, _cutlass_version, _L,
                           _load, _num_sms, cache_namespace)


@dataclass(frozen=True)
class LayoutKey:
    """Every value the compiled expert-layout kernels depend on."""

    drop_version: int
    layout_abi_version: int
    cutlass_version: str
    arch: str
    hidden: int
    topk: int
    world: int
    max_tokens: int
    local_experts: int
    tvm_ffi: bool
    route: bool = False  # also the one-rank LocalRoute kernels (drop v19)


def layout_counts_len(num_chunks: int, local_experts: int) -> int:
    """int32 elements of the layout scratch for ``num_chunks`` chunks."""
    return num_chunks * local_experts


def prebuild_layout(hidden: int, topk: int, world: int, max_tokens: int, local_experts: int,
                    arch: str = "sm_90a", route: bool = False) -> None:
    """Compile (or load from the disk cache) every expert-layout kernel for ``arch`` (``route``:
    also the one-rank LocalRoute kernels, world == 1 only); no GPU needed."""
    _check_ep_arch(arch)
    ll = _load("sm90_megamoe.layout_launch")
    cfg = ll.LayoutConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                          local_experts=local_experts)
    ffi = use_tvm_ffi()
    key = LayoutKey(CONSTANTS.value(PKG, "DROP_VERSION"), _L["LAYOUT_ABI_VERSION"], _cutlass_version(),
                    arch, hidden, topk, world, max_tokens, local_experts, ffi, bool(route))

    COMPILE_CACHE.get_or_compile(key, lambda: {k: build_layout_kernel(key, k)
                                               for k in ll.kinds_for(cfg=cfg, route=route)})


def build_layout_kernel(key: LayoutKey, kind: str) -> Any:
    """Layout kernel ``kind`` of ``key`` from the disk cache, else compiled and stored; either way
    put where the drop's launches find it. The compile step of :func:`prebuild_layout` and of a
    cache rebuilt from a manifest (``kernel_replay``)."""
    ll = _load("sm90_megamoe.layout_launch")
    cfg = ll.LayoutConfig(hidden=key.hidden, topk=key.topk, world=key.world, max_tokens=key.max_tokens,
                          local_experts=key.local_experts)
    compiled = disk_cache.get_or_build(  # the disk key leaves ``route`` out: a kind is a kind
        cache_namespace(key.arch), f"layout_{kind}", (dc_replace(key, route=False), kind),
        lambda: ll.compile_kernel(kind=kind, cfg=cfg, tvm_ffi=key.tvm_ffi, arch=key.arch), tvm_ffi=key.tvm_ffi)
    ll.put_kernel(kind=kind, cfg=cfg, compiled=compiled, tvm_ffi=key.tvm_ffi, arch=key.arch)
    return compiled


#: chunk counts a token-adaptive LayoutSession chooses from (and its full grid)
LAYOUT_CHUNK_TIERS = (4, 8, 16, 32, 64)
#: tokens per layout chunk the adaptive choice aims for (H200 decode sweep, 2026-12-01)
LAYOUT_TOKENS_PER_CHUNK = 4


def layout_chunks_for(tokens: int, max_chunks: int) -> int:
    """Layout chunks for a call whose rank receives about ``tokens`` tokens: the smallest tier of
    ``LAYOUT_CHUNK_TIERS`` with at most ``LAYOUT_TOKENS_PER_CHUNK`` tokens per chunk, else the full
    grid ``max_chunks``. Every layout CTA sums the per-expert counts of every chunk, so a decode
    step wants few chunks (1 token: 0.055 -> 0.048 ms per Qwen3 layer with 4 chunks instead of
    132) while a prefill wants them all (each chunk scans its slots)."""
    need = -(-max(1, int(tokens)) // LAYOUT_TOKENS_PER_CHUNK)
    for c in LAYOUT_CHUNK_TIERS:
        if c >= need and c < max_chunks:
            return c
    return max_chunks


class LayoutSession:
    """One layer's expert layout (wait + count, place + row gather: 2 launches, deterministic
    (expert, slot, k) row order) on a caller-owned ``counts`` scratch (int32, >= num_chunks · E_l).

    ``__call__(ep_session, offsets [E_l+1] i32, idx [S·K] i32, ws [S·K] f32, pos [S,K] i32,
    xs [S·K,H] bf16 or None, tokens=None)``. Calls sharing one scratch must be stream-ordered.

    ``route`` (world == 1): also :meth:`route`, the layout without a dispatch (drop v19's
    LocalRoute checks the caller's routing itself and LayoutPlace reads the caller's rows).

    ``adaptive``: the kernels' chunk count (their grid, a runtime argument of the same compiled
    kernels) follows each call's ``tokens`` hint (:func:`layout_chunks_for`, at most
    ``num_chunks``); all chunk counts give the same bits (chunks are contiguous slot ranges), so
    the hint only steers speed. The drop ``Layout`` objects of every tier are made here (no
    allocation per call).
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, local_experts: int, device: Any,
                 counts: Any, num_chunks: int | None = None, timeout_ns: int | None = None,
                 arch: str = "sm_90a", adaptive: bool = False, route: bool = False) -> None:
        ensure_not_capturing("layout set-up")
        ll = _load("sm90_megamoe.layout_launch")
        cfg = ll.LayoutConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                              local_experts=local_experts)
        if route and world != 1:
            raise ValueError(f"LayoutSession(route=True) is for one rank, not world={world}")
        prebuild_layout(hidden, topk, world, max_tokens, local_experts, arch, route=route)
        # one chunk per SM (or the caller's smaller grid), never more chunks than receive slots
        sms = _num_sms(device)
        C = max(1, min(num_chunks or sms, sms, LAYOUT_MAX_CHUNKS, world * max_tokens))
        self.num_chunks = C
        kw = {} if timeout_ns is None else {"timeout_ns": int(timeout_ns)}
        tiers = {C} | ({c for c in LAYOUT_CHUNK_TIERS if c < C} if adaptive else set())
        self._layouts = {c: ll.Layout(cfg=cfg, device=device, num_chunks=c, counts=counts,
                                      tvm_ffi=use_tvm_ffi(), arch=arch, route=route, **kw) for c in tiers}
        self.adaptive = bool(adaptive)
        self._checked = self._route_checked = False

    def release(self) -> None:
        """Classic launch path: drop the converted arguments that keep the last call's tensors alive
        (drop v113's ``Layout.release``; a warm-up's throw-away routing). TVM-FFI keeps none."""
        for layout in self._layouts.values():
            layout.release()

    def chunks(self, tokens: int | None) -> int:
        """Chunk count (grid) of a call with the ``tokens`` hint (None: the full grid)."""
        if not self.adaptive or tokens is None:
            return self.num_chunks
        return layout_chunks_for(tokens, self.num_chunks)

    def __call__(self, ep: EpSession, offsets, idx, ws, pos, xs, tokens: int | None = None) -> None:
        # argument checks on the first call only (they cost host time)
        layout = self._layouts[self.chunks(tokens)]
        layout(bufs=ep.bufs, offsets=offsets, idx=idx, ws=ws, pos=pos, xs=xs, stream=None,
               check=not self._checked)
        self._checked = True

    def route(self, ep: EpSession, x, topk_ids, topk_weights, offsets, idx, ws, pos, xs,
              tokens: int | None = None) -> None:
        """One rank, in place of ``ep.dispatch(x, topk_ids, topk_weights)`` + ``self(ep, ...)``:
        2 launches instead of 3, same outputs and error records bit for bit, rows gathered
        straight from ``x [T, H]`` (``ep.bufs.recv_x`` is not written). ``topk_ids [T, K]``
        int32/int64, ``topk_weights [T, K]`` float32."""
        layout = self._layouts[self.chunks(tokens)]
        layout.route(bufs=ep.bufs, x=x, topk_ids=topk_ids, topk_w=topk_weights, offsets=offsets, idx=idx,
                     ws=ws, pos=pos, xs=xs, stream=None, check=not self._route_checked)
        self._route_checked = True

    def prepare_route(self, ep: EpSession, offsets, idx, ws, pos, xs):
        """:meth:`route` with every argument but the routing fixed (drop v58's
        ``Layout.prepare_route``, one per chunk tier): ``run(x, topk_ids, topk_weights, tokens=None)``
        launches the same two kernels with the same arguments as ``route(ep, x, topk_ids,
        topk_weights, offsets, idx, ws, pos, xs, tokens=tokens)``, its buffers checked and packed
        here once. Made at bind from a layer's own buffers (it holds them)."""
        runs = {c: lay.prepare_route(bufs=ep.bufs, offsets=offsets, idx=idx, ws=ws, pos=pos, xs=xs)
                for c, lay in self._layouts.items()}
        chunks = self.chunks

        def run(x, topk_ids, topk_weights, tokens: int | None = None) -> None:
            runs[chunks(tokens)](x, topk_ids, topk_weights)
        return run
