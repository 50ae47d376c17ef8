"""Host side of the expert-layout kernels (layout_kernels): config, compile cache, launcher.

    cfg = LayoutConfig(hidden=2048, topk=8, world=W, max_tokens=T_max, local_experts=E // W)
    lay = Layout(cfg, device)                 # C chunks (default: #SMs); owns or borrows scratch
    lay(bufs, offsets, idx, ws, pos, xs)      # 2 launches: wait + count, place + row gather
    lay(bufs, offsets, idx, ws, pos, None)    # no gather
    lay = Layout(cfg, device, route=True)     # W = 1 only: also the dispatch-free path
    lay.route(bufs, x, topk_ids, topk_w, offsets, idx, ws, pos, xs)   # 2 launches, no dispatch

``bufs`` is the rank's ``ep_launch.EpBuffers`` (recv_ids, recv_w, recv_count, recv_x, flags,
ctrl, err). Nothing here synchronizes the host. Kernels are compiled once per static
configuration from FAKE tensors (no GPU needed) and cached; tensor conversions are cached per
argument role (a call with the same tensors as the previous call converts nothing). All shapes
are static except the row count of recv_x, idx, ws, xs and the scratch length; the number of
valid rows is device-side (offsets[E_l]).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import make_fake_stream

from . import DROP_VERSION
from .ep_constants import DEFAULT_TIMEOUT_NS, EP_ALIGN_H_ELEMS
from .ep_launch import ARCH, _fake, _real, _stream, check_routing_inputs, device_num_sms
from .launch import call_on_stream, ffi_fixed, ffi_function
from .layout_kernels import (
    LAYOUT_ABI_VERSION,
    LAYOUT_MAX_LOCAL_EXPERTS,
    LAYOUT_MAX_TOPK,
    LAYOUT_MAX_WORLD,
    LayoutCount,
    LayoutPlace,
    LocalRoute,
    counts_len,
    layout_threads,
)

KINDS = ("count", "place", "place_nogather")
#: one rank only (world == 1): LocalRoute for int32 / int64 expert ids
ROUTE_KINDS = ("route", "route_i64")


def kinds_for(cfg: "LayoutConfig", route: bool = False) -> tuple:
    """The kernel kinds a ``Layout(cfg, route=route)`` launches."""
    if route and cfg.world != 1:
        raise ValueError(f"route kernels need world == 1, not {cfg.world}")
    return KINDS + (ROUTE_KINDS if route else ())


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """Static configuration (compile key = (H, K, W, T_max, E_l) + kernel kind)."""

    hidden: int         # H, multiple of 8
    topk: int           # K <= 32
    world: int          # W (source ranks) <= 32
    max_tokens: int     # T_max per source rank
    local_experts: int  # E_l <= 1024

    def __post_init__(self):
        if self.hidden % EP_ALIGN_H_ELEMS:
            raise ValueError(f"hidden={self.hidden} must be a multiple of {EP_ALIGN_H_ELEMS}")
        if not 1 <= self.topk <= LAYOUT_MAX_TOPK:
            raise ValueError(f"topk={self.topk} must be in [1, {LAYOUT_MAX_TOPK}]")
        if not 1 <= self.local_experts <= LAYOUT_MAX_LOCAL_EXPERTS:
            raise ValueError(f"local_experts={self.local_experts} must be in "
                             f"[1, {LAYOUT_MAX_LOCAL_EXPERTS}]")
        if not 1 <= self.world <= LAYOUT_MAX_WORLD:
            raise ValueError(f"world={self.world} must be in [1, {LAYOUT_MAX_WORLD}]")
        if self.max_tokens < 1 or self.pairs >= 2**31:
            raise ValueError("max_tokens out of range")

    @property
    def threads(self) -> int:
        return layout_threads(self.local_experts)

    @property
    def slots(self) -> int:
        return self.world * self.max_tokens

    @property
    def pairs(self) -> int:
        return self.world * self.max_tokens * self.topk


def fake_args(kind: str, cfg: LayoutConfig, use_tvm_ffi: bool = False):
    """Fake ``__call__`` arguments with the static/dynamic structure ``Layout`` passes."""
    H, K, W, S, E_l = cfg.hidden, cfg.topk, cfg.world, cfg.slots, cfg.local_experts
    bf16, i32, i64, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64, cutlass.Float32
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    n = cutlass.Int32(1)
    ids = _fake(i32, (S, K), 4)
    cnt = _fake(i32, (W,), 4)
    err = _fake(i32, (4,), 4)
    counts = _fake(i32, (None,), 4)
    if kind == "count":
        return (ids, cnt, _fake(i64, (2 * W,), 8), _fake(i64, (4,), 8), err, counts,
                cutlass.Int64(1), n, stream)
    if kind in ("place", "place_nogather"):
        return (ids, _fake(f32, (S, K), 4), cnt, err, counts, _fake(bf16, (None, H), 16),
                _fake(i32, (E_l + 1,), 4), _fake(i32, (None,), 4), _fake(f32, (None,), 4),
                _fake(i32, (S, K), 4), _fake(bf16, (None, H), 16), n, stream)
    if kind in ROUTE_KINDS:
        kinds_for(cfg, route=True)  # world == 1
        wide = kind == "route_i64"
        return (_fake(i64 if wide else i32, (None, K), 8 if wide else 4), _fake(f32, (None, K), 4),
                ids, _fake(f32, (S, K), 4), cnt, _fake(i64, (2 * W,), 8), _fake(i64, (4,), 8), err,
                _fake(i64, (8,), 8), _fake(i32, (cfg.max_tokens,), 4), counts, n, n, stream)
    raise ValueError(kind)


def make_kernel(kind: str, cfg: LayoutConfig):
    H, K, W, T, E_l, th = (cfg.hidden, cfg.topk, cfg.world, cfg.max_tokens, cfg.local_experts,
                           cfg.threads)
    if kind == "count":
        return LayoutCount(K, W, T, E_l, th)
    if kind == "place":
        return LayoutPlace(H, K, W, T, E_l, th, gather=True)
    if kind == "place_nogather":
        return LayoutPlace(H, K, W, T, E_l, th, gather=False)
    if kind in ROUTE_KINDS:
        kinds_for(cfg, route=True)
        return LocalRoute(K, T, E_l, th)
    raise ValueError(kind)


def cache_key(kind: str, cfg: LayoutConfig, tvm_ffi: bool = False, arch: str = ARCH) -> tuple:
    static = dataclasses.astuple(cfg)
    if kind == "count" or kind in ROUTE_KINDS:  # H does not matter
        static = (cfg.topk, cfg.world, cfg.max_tokens, cfg.local_experts)
    return (LAYOUT_ABI_VERSION, DROP_VERSION, getattr(cutlass, "__version__", ""), arch, kind,
            static, bool(tvm_ffi))


def compile_kernel(kind: str, cfg: LayoutConfig, options: Optional[str] = None,
                   tvm_ffi: bool = False, arch: str = ARCH):
    """Compile one layout kernel from fake tensors (no GPU needed); no caching. ``tvm_ffi``: for
    TVM-FFI launches (adds ``--enable-tvm-ffi``; the stream becomes torch's current one).
    ``arch``: the target (sm_90a, sm_100a or sm_120a: no arch-specific instruction);
    ``options`` None = ``--gpu-arch <arch>``."""
    if options is None:
        options = f"--gpu-arch {arch}"
    if tvm_ffi:
        options = f"{options} --enable-tvm-ffi"
    return cute.compile(make_kernel(kind, cfg), *fake_args(kind, cfg, use_tvm_ffi=tvm_ffi), options=options)


_CACHE: Dict[tuple, object] = {}


def get_kernel(kind: str, cfg: LayoutConfig, tvm_ffi: bool = False, arch: str = ARCH):
    """The compiled kernel (process-wide cache of compiled code only; no buffers)."""
    key = cache_key(kind, cfg, tvm_ffi, arch)
    k = _CACHE.get(key)
    if k is None:
        k = _CACHE[key] = compile_kernel(kind, cfg, tvm_ffi=tvm_ffi, arch=arch)
    return k


def put_kernel(kind: str, cfg: LayoutConfig, compiled, tvm_ffi: bool = False, arch: str = ARCH) -> None:
    """Seed the process-wide cache with ``kind``'s kernel for ``cfg`` compiled elsewhere (e.g.
    loaded from an exported object file); launches then use it instead of compiling."""
    if kind not in KINDS + ROUTE_KINDS:
        raise ValueError(f"unknown kernel kind {kind!r} (kinds: {KINDS + ROUTE_KINDS})")
    _CACHE[cache_key(kind, cfg, tvm_ffi, arch)] = compiled


def default_num_chunks(cfg: LayoutConfig, device) -> int:
    """One chunk per SM of ``device`` (never more chunks than slots)."""
    return max(1, min(device_num_sms(device), cfg.slots))


class Layout:
    """Receiver-side expert layout in 2 launches (LayoutCount with the dispatch wait,
    LayoutPlace with the fused row gather). Bit-deterministic; stateless between calls.

    num_chunks: C, grid of both kernels (default: #SMs of ``device``). Virtual ranks sharing a
                GPU pass a smaller C so that every rank's CTAs co-reside (LayoutCount spins).
    counts:     optional caller-owned int32 scratch of >= C * E_l elements (e.g. a view into a
                workspace); allocated here otherwise. Calls sharing one scratch must be
                stream-ordered.
    tvm_ffi:    launch kernels compiled for TVM-FFI with torch tensors (``stream``: a
                torch.cuda.Stream or None); else the classic path with converted CuTe tensors.
    arch:       the GPU's target (``sm_90a``, ``sm_100a``, ``sm_120a``): the kernels are arch-neutral.
    route:      world == 1 only: also load LocalRoute, for :meth:`route` (no dispatch needed).
    """

    def __init__(self, cfg: LayoutConfig, device, num_chunks: Optional[int] = None,
                 counts: Optional[torch.Tensor] = None, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 tvm_ffi: bool = False, arch: str = ARCH, route: bool = False):
        self.cfg = cfg
        self.device = torch.device(device)
        C = num_chunks or default_num_chunks(cfg, self.device)
        if not 1 <= C <= max(1, cfg.slots):
            raise ValueError(f"num_chunks={C} must be in [1, {max(1, cfg.slots)}]")
        self.num_chunks = C
        need = counts_len(C, cfg.local_experts)
        if counts is None:
            counts = torch.empty(need, dtype=torch.int32, device=self.device)
        if counts.dtype != torch.int32 or counts.dim() != 1 or counts.numel() < need \
                or not counts.is_contiguous():
            raise ValueError(f"counts must be a contiguous int32 vector of >= {need} elements")
        self.counts = counts[:need]
        self.timeout_ns = int(timeout_ns)
        self.ffi = bool(tvm_ffi)
        fast = ffi_function if self.ffi else (lambda k: k)
        self.k_count = fast(get_kernel("count", cfg, self.ffi, arch))
        self.k_place = {True: fast(get_kernel("place", cfg, self.ffi, arch)),
                        False: fast(get_kernel("place_nogather", cfg, self.ffi, arch))}
        self.k_route = None
        if route:
            kinds_for(cfg, route=True)
            self.k_route = {False: fast(get_kernel("route", cfg, self.ffi, arch)),
                            True: fast(get_kernel("route_i64", cfg, self.ffi, arch))}
            # a call with T = 0 still publishes T and the epoch: it needs some (unread) rows
            self._dummy_ids = torch.zeros(1, cfg.topk, dtype=torch.int32, device=self.device)
            self._dummy_w = torch.zeros(1, cfg.topk, dtype=torch.float32, device=self.device)
            if not self.ffi:  # converted once, like the other dummies
                self._dummy_ids, self._dummy_w = _real(self._dummy_ids, 4, True), _real(self._dummy_w, 4, True)
        self._conv: Dict[str, tuple] = {}
        self._dummy = torch.zeros(1, cfg.hidden, dtype=torch.bfloat16, device=self.device)
        if self.ffi:  # torch tensors and Python ints go straight into the call
            self._cnt, self._C, self._timeout, self._dummy_x = self.counts, C, self.timeout_ns, self._dummy
        else:
            self._cnt = _real(self.counts, 4, True)
            self._C = cutlass.Int32(C)
            self._timeout = cutlass.Int64(self.timeout_ns)
            self._dummy_x = _real(self._dummy, 16, True)

    def release(self) -> None:
        """Drop the conversion cache (classic path): it keeps each role's last tensor alive, e.g.
        a warm-up's throw-away routing, for as long as this launcher lives (drop v113)."""
        self._conv.clear()

    def _cv(self, role: str, t: torch.Tensor, align: int, dynamic_rows: bool):
        """One-entry conversion cache per argument role (keeps the last tensor alive, so a
        cached address cannot be recycled). TVM-FFI: the tensor itself."""
        if not self.ffi:
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            hit = self._conv.get(role)
            if hit is not None and hit[0] == key:
                return hit[1]
        if not t.is_contiguous():
            raise ValueError(f"{role} must be contiguous")
        if t.data_ptr() % align:
            raise ValueError(f"{role} must be {align}-byte aligned")
        if self.ffi:
            return t
        ct = _real(t, align, dynamic_rows)
        self._conv[role] = (key, ct)
        return ct

    def _check(self, bufs, offsets, idx, ws, pos, xs):
        c = self.cfg
        S, K, P, W = c.slots, c.topk, c.pairs, c.world

        def need(name, ok):
            if not ok:
                raise ValueError(f"Layout: {name} has the wrong dtype/shape for {c}")

        need("recv_ids", bufs.recv_ids.dtype == torch.int32 and tuple(bufs.recv_ids.shape) == (S, K))
        need("recv_w", bufs.recv_w.dtype == torch.float32 and tuple(bufs.recv_w.shape) == (S, K))
        need("recv_count", bufs.recv_count.dtype == torch.int32 and tuple(bufs.recv_count.shape) == (W,))
        need("flags", bufs.flags.dtype == torch.int64 and tuple(bufs.flags.shape) == (2 * W,))
        need("offsets", offsets.dtype == torch.int32 and tuple(offsets.shape) == (c.local_experts + 1,))
        need("idx", idx.dtype == torch.int32 and idx.dim() == 1 and idx.shape[0] >= P)
        need("ws", ws.dtype == torch.float32 and ws.dim() == 1 and ws.shape[0] >= P)
        need("pos", pos.dtype == torch.int32 and tuple(pos.shape) == (S, K))
        if xs is not None:
            need("recv_x", bufs.recv_x.dtype == torch.bfloat16 and tuple(bufs.recv_x.shape) == (S, c.hidden))
            need("xs", xs.dtype == torch.bfloat16 and xs.dim() == 2 and xs.shape[1] == c.hidden
                 and xs.shape[0] >= P)

    def _launcher(self, stream):
        if self.ffi:
            def launch(fn, *args):
                call_on_stream(fn, args, stream)
        else:
            st = _stream(stream)

            def launch(fn, *args):
                fn(*args, st)
        return launch

    def _place(self, launch, bufs, mX, offsets, idx, ws, pos, xs) -> None:
        """LayoutPlace over the counts in the scratch; rows gathered from ``mX`` if ``xs``."""
        gather = xs is not None
        mXs = self._cv("xs", xs, 16, True) if gather else self._dummy_x
        if not gather:
            mX = self._dummy_x
        launch(self.k_place[gather], self._cv("recv_ids", bufs.recv_ids, 4, False),
               self._cv("recv_w", bufs.recv_w, 4, False), self._cv("recv_count", bufs.recv_count, 4, False),
               self._cv("err", bufs.err, 4, False), self._cnt, mX, self._cv("offsets", offsets, 4, False),
               self._cv("idx", idx, 4, True), self._cv("ws", ws, 4, True),
               self._cv("pos", pos, 4, False), mXs, self._C)

    def __call__(self, bufs, offsets: torch.Tensor, idx: torch.Tensor, ws: torch.Tensor,
                 pos: torch.Tensor, xs: Optional[torch.Tensor], stream=None,
                 check: bool = True) -> None:
        """Wait for this epoch's dispatch, then fill offsets [E_l+1], idx [>=S*K], ws [>=S*K],
        pos [S, K] (valid slots) and, if ``xs`` is given, xs[r] = recv_x[idx[r]] for
        r < offsets[E_l]. No host sync."""
        if check:
            self._check(bufs, offsets, idx, ws, pos, xs)
        launch = self._launcher(stream)
        launch(self.k_count, self._cv("recv_ids", bufs.recv_ids, 4, False),
               self._cv("recv_count", bufs.recv_count, 4, False), self._cv("flags", bufs.flags, 8, False),
               self._cv("ctrl", bufs.ctrl, 8, False), self._cv("err", bufs.err, 4, False), self._cnt,
               self._timeout, self._C)
        mX = self._cv("recv_x", bufs.recv_x, 16, True) if xs is not None else None
        self._place(launch, bufs, mX, offsets, idx, ws, pos, xs)

    def route(self, bufs, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
              offsets: torch.Tensor, idx: torch.Tensor, ws: torch.Tensor, pos: torch.Tensor,
              xs: Optional[torch.Tensor], stream=None, check: bool = True) -> None:
        """One rank (world == 1), instead of ``EpRank.dispatch`` + ``__call__``: LocalRoute checks
        ``topk_ids [T, K]`` (int32/int64) and ``topk_w [T, K]`` (float32) as the dispatch does
        (same drops, verr, epoch, flag, recv_count and dmask words afterwards) and counts; then
        LayoutPlace fills offsets / idx / ws / pos and, if ``xs`` is given, xs[r] = x[idx[r]]
        straight from ``x [T, H]`` bf16 (recv_x is not written). Same outputs, bit for bit, as
        dispatch + layout. No host sync."""
        if self.k_route is None:
            raise RuntimeError("Layout.route needs Layout(..., route=True)")
        c = self.cfg
        # the per-call inputs are checked on every call, as EpRank.dispatch checks them
        T = check_routing_inputs(c.hidden, c.topk, c.max_tokens, x, topk_ids, topk_w)
        if check:
            self._check(bufs, offsets, idx, ws, pos, xs)
            if bufs.verr.dtype != torch.int64 or tuple(bufs.verr.shape) != (8,) \
                    or bufs.dmask.dtype != torch.int32 or tuple(bufs.dmask.shape) != (c.max_tokens,):
                raise ValueError("Layout.route: bufs.verr must be int64 [8], bufs.dmask int32 [T_max]")
        wide = topk_ids.dtype == torch.int64
        if T == 0:
            mI, mW, mX, wide = self._dummy_ids, self._dummy_w, self._dummy_x, False
        else:
            mI = self._cv("topk_ids", topk_ids, 8 if wide else 4, True)
            mW = self._cv("topk_w", topk_w, 4, True)
            mX = self._cv("x", x, 16, True)
        n = T if self.ffi else cutlass.Int32(T)
        launch = self._launcher(stream)
        launch(self.k_route[wide], mI, mW, self._cv("recv_ids", bufs.recv_ids, 4, False),
               self._cv("recv_w", bufs.recv_w, 4, False), self._cv("recv_count", bufs.recv_count, 4, False),
               self._cv("flags", bufs.flags, 8, False), self._cv("ctrl", bufs.ctrl, 8, False),
               self._cv("err", bufs.err, 4, False), self._cv("verr", bufs.verr, 8, False),
               self._cv("dmask", bufs.dmask, 4, False), self._cnt, n, self._C)
        self._place(launch, bufs, mX, offsets, idx, ws, pos, xs)

    def prepare_route(self, bufs, offsets: torch.Tensor, idx: torch.Tensor, ws: torch.Tensor,
                      pos: torch.Tensor, xs: Optional[torch.Tensor]):
        """:meth:`route` with every argument but the routing fixed (drop v58): ``run(x, topk_ids,
        topk_w)`` is ``self.route(bufs, x, topk_ids, topk_w, offsets, idx, ws, pos, xs)`` -- the same
        two kernels with the same arguments -- with the fixed buffers checked and packed once here,
        so a call checks only its routing inputs (as :meth:`route` does: dtypes, shapes, T <= T_max,
        contiguity, alignment). The fixed tensors are held and must keep their shapes while ``run``
        is used."""
        if self.k_route is None:
            raise RuntimeError("Layout.prepare_route needs Layout(..., route=True)")
        c = self.cfg
        self._check(bufs, offsets, idx, ws, pos, xs)
        if bufs.verr.dtype != torch.int64 or tuple(bufs.verr.shape) != (8,) \
                or bufs.dmask.dtype != torch.int32 or tuple(bufs.dmask.shape) != (c.max_tokens,):
            raise ValueError("Layout.prepare_route: bufs.verr must be int64 [8], bufs.dmask int32 [T_max]")
        if not self.ffi:
            def run_unpacked(x, topk_ids, topk_w):
                self.route(bufs, x, topk_ids, topk_w, offsets, idx, ws, pos, xs, check=False)
            return run_unpacked
        cv = self._cv
        recv_ids, recv_w = cv("recv_ids", bufs.recv_ids, 4, False), cv("recv_w", bufs.recv_w, 4, False)
        recv_count, err = cv("recv_count", bufs.recv_count, 4, False), cv("err", bufs.err, 4, False)
        # LocalRoute's arguments after the routing, and LayoutPlace's before and after its rows
        route_tail = (recv_ids, recv_w, recv_count, cv("flags", bufs.flags, 8, False), cv("ctrl", bufs.ctrl, 8, False),
                      err, cv("verr", bufs.verr, 8, False), cv("dmask", bufs.dmask, 4, False), self._cnt)
        gather = xs is not None
        place_head = (recv_ids, recv_w, recv_count, err, self._cnt)
        place_tail = (cv("offsets", offsets, 4, False), cv("idx", idx, 4, True), cv("ws", ws, 4, True),
                      cv("pos", pos, 4, False), cv("xs", xs, 16, True) if gather else self._dummy_x, self._C)
        # the fixed tensors as TVM-FFI objects once (drop v61). The routing (or, with no tokens,
        # the placeholders) stays torch tensors: TVM-FFI takes the stream from them
        route_tail, place_head, place_tail = ffi_fixed(*route_tail), ffi_fixed(*place_head), ffi_fixed(*place_tail)
        k_route, k_place, C = self.k_route, self.k_place[gather], self._C
        dummy_ids, dummy_w, dummy_x = self._dummy_ids, self._dummy_w, self._dummy_x

        def run(x, topk_ids, topk_w):
            T = check_routing_inputs(c.hidden, c.topk, c.max_tokens, x, topk_ids, topk_w)
            wide = topk_ids.dtype == torch.int64
            if T == 0:
                mI, mW, mX, wide = dummy_ids, dummy_w, dummy_x, False
            else:
                mI, mW, mX = cv("topk_ids", topk_ids, 8 if wide else 4, True), cv("topk_w", topk_w, 4, True), \
                    cv("x", x, 16, True)
            k_route[wide](mI, mW, *route_tail, T, C)
            k_place(*place_head, mX if gather else dummy_x, *place_tail)
        return run
