"""Host side of the expert-layout kernels (layout_kernels): config, compile cache, launcher.

    cfg = LayoutConfig(hidden=2048, topk=8, world=W, max_tokens=T_max, local_experts=E // W)
    lay = Layout(cfg, device)                      # owns its zeroed int32 scratch
    lay(b.recv_ids, b.recv_w, b.recv_count, b.recv_x, offsets, idx, ws, pos, xs)   # 2 launches
    lay(b.recv_ids, b.recv_w, b.recv_count, None, offsets, idx, ws, pos, None)      # no gather

Nothing here synchronizes the host. Kernels are compiled once per static configuration from
FAKE tensors (no GPU needed) and cached; tensor conversions are cached per argument role (a call
with the same tensors as the previous call converts nothing). All shapes are static except the
row count of recv_x, idx, ws and xs; the number of valid rows is device-side (offsets[E_l]).
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
from .ep_constants import EP_ALIGN_H_ELEMS
from .ep_launch import ARCH, _fake, _real, _stream, default_num_ctas
from .layout_kernels import (
    LAYOUT_ABI_VERSION,
    LAYOUT_MAX_LOCAL_EXPERTS,
    LAYOUT_MAX_TOPK,
    LAYOUT_THREADS,
    LayoutCount,
    LayoutPlace,
    scr_arrive,
    scr_counts,
    scr_cursor,
    scratch_len,
)

KINDS = ("count", "place", "place_nogather")
LAYOUT_PLACE_CTAS_PER_SM = 4


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """Static configuration (compile key = (H, K, W, T_max, E_l, threads) + kernel kind)."""

    hidden: int         # H, multiple of 8
    topk: int           # K <= 32
    world: int          # W (source ranks)
    max_tokens: int     # T_max per source rank
    local_experts: int  # E_l
    threads: int = LAYOUT_THREADS

    def __post_init__(self):
        if self.hidden % EP_ALIGN_H_ELEMS:
            raise ValueError(f"hidden={self.hidden} must be a multiple of {EP_ALIGN_H_ELEMS}")
        if not 1 <= self.topk <= LAYOUT_MAX_TOPK:
            raise ValueError(f"topk={self.topk} must be in [1, {LAYOUT_MAX_TOPK}]")
        if not 1 <= self.local_experts <= LAYOUT_MAX_LOCAL_EXPERTS:
            raise ValueError(f"local_experts={self.local_experts} out of range")
        if self.world < 1 or self.max_tokens < 1 or self.pairs >= 2**31:
            raise ValueError("world / max_tokens out of range")
        if self.threads % 32 or self.threads < 32:
            raise ValueError("threads must be a multiple of 32")

    @property
    def slots(self) -> int:
        return self.world * self.max_tokens

    @property
    def pairs(self) -> int:
        return self.world * self.max_tokens * self.topk


def fake_args(kind: str, cfg: LayoutConfig):
    """Fake ``__call__`` arguments with the static/dynamic structure ``Layout`` passes."""
    H, K, W, S, E_l = cfg.hidden, cfg.topk, cfg.world, cfg.slots, cfg.local_experts
    bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
    stream = make_fake_stream()
    n = cutlass.Int32(1)
    ids = _fake(i32, (S, K), 4)
    cnt = _fake(i32, (W,), 4)
    scr = _fake(i32, (scratch_len(E_l),), 4)
    if kind == "count":
        return (ids, cnt, scr, _fake(i32, (E_l + 1,), 4), n, stream)
    if kind in ("place", "place_nogather"):
        return (ids, _fake(f32, (S, K), 4), cnt, scr, _fake(bf16, (None, H), 16),
                _fake(i32, (None,), 4), _fake(f32, (None,), 4), _fake(i32, (S, K), 4),
                _fake(bf16, (None, H), 16), n, stream)
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
    raise ValueError(kind)


def cache_key(kind: str, cfg: LayoutConfig) -> tuple:
    static = dataclasses.astuple(cfg)
    if kind == "count":  # H does not matter
        static = (cfg.topk, cfg.world, cfg.max_tokens, cfg.local_experts, cfg.threads)
    return (LAYOUT_ABI_VERSION, DROP_VERSION, getattr(cutlass, "__version__", ""), ARCH, kind,
            static)


class _Compiled:
    """A compiled kernel; recompiles from the first real arguments if the fake-compiled
    signature is rejected (safety net, logged once)."""

    def __init__(self, kind: str, cfg: LayoutConfig, options: str = f"--gpu-arch {ARCH}"):
        self.kind = kind
        self.kernel = make_kernel(kind, cfg)
        self.options = options
        self.fn = cute.compile(self.kernel, *fake_args(kind, cfg), options=options)
        self._verified = False

    def __call__(self, *args):
        if self._verified:
            self.fn(*args)
            return
        try:
            self.fn(*args)
        except Exception as exc:  # noqa: BLE001
            print(f"[sm90_megamoe.layout] fake-compiled {self.kind} rejected real args "
                  f"({exc!r}); recompiling from real arguments")
            self.fn = cute.compile(self.kernel, *args, options=self.options)
            self.fn(*args)
        self._verified = True


_CACHE: Dict[tuple, _Compiled] = {}


def get_kernel(kind: str, cfg: LayoutConfig) -> _Compiled:
    key = cache_key(kind, cfg)
    k = _CACHE.get(key)
    if k is None:
        k = _CACHE[key] = _Compiled(kind, cfg)
    return k


class Layout:
    """Receiver-side expert layout in 2 launches (LayoutCount, LayoutPlace with fused gather).

    Owns ``scratch`` (int32 [2*E_l + 4], zeroed here once; the kernels keep it tail-clean, see
    layout_kernels). Calls sharing one ``Layout`` must be stream-ordered (one object per stream).

    num_ctas:   grid cap of LayoutPlace (default LAYOUT_PLACE_CTAS_PER_SM * #SMs: 54 registers
                x 256 threads fit 4 CTAs per SM, one slot per warp in flight)
    count_ctas: grid cap of LayoutCount (default #SMs: every CTA flushes up to E_l global
                atomics, so fewer, fuller CTAs are cheaper)
    Each grid is also capped at the work (LayoutCount: ceil(S*K / threads), LayoutPlace:
    ceil(S / warps per CTA)).
    """

    def __init__(self, cfg: LayoutConfig, device, num_ctas: Optional[int] = None,
                 count_ctas: Optional[int] = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.scratch = torch.zeros(scratch_len(cfg.local_experts), dtype=torch.int32,
                                   device=self.device)
        sms = default_num_ctas()
        n_place = num_ctas or LAYOUT_PLACE_CTAS_PER_SM * sms
        n_count = count_ctas or sms
        th = cfg.threads
        self.count_ctas = max(1, min(n_count, (cfg.pairs + th - 1) // th))
        self.place_ctas = max(1, min(n_place, (cfg.slots + th // 32 - 1) // (th // 32)))
        self.k_count = get_kernel("count", cfg)
        self._k_place: Dict[bool, _Compiled] = {}
        self._scr = _real(self.scratch, 4, False)
        self._n_count = cutlass.Int32(self.count_ctas)
        self._n_place = cutlass.Int32(self.place_ctas)
        self._conv: Dict[str, tuple] = {}
        self._dummy = torch.zeros(1, cfg.hidden, dtype=torch.bfloat16, device=self.device)
        self._dummy_x = _real(self._dummy, 16, True)

    def _place(self, gather: bool) -> _Compiled:
        k = self._k_place.get(gather)
        if k is None:
            k = self._k_place[gather] = get_kernel("place" if gather else "place_nogather",
                                                    self.cfg)
        return k

    def _cv(self, role: str, t: torch.Tensor, align: int, dynamic_rows: bool):
        """One-entry conversion cache per argument role (keeps the last tensor alive, so a
        cached address cannot be recycled)."""
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        hit = self._conv.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        if not t.is_contiguous():
            raise ValueError(f"{role} must be contiguous")
        if t.data_ptr() % align:
            raise ValueError(f"{role} must be {align}-byte aligned")
        ct = _real(t, align, dynamic_rows)
        self._conv[role] = (key, ct)
        return ct

    def _check(self, recv_ids, recv_w, recv_count, recv_x, offsets, idx, ws, pos, xs):
        c = self.cfg
        S, K, P = c.slots, c.topk, c.pairs
        assert recv_ids.dtype == torch.int32 and tuple(recv_ids.shape) == (S, K)
        assert recv_w.dtype == torch.float32 and tuple(recv_w.shape) == (S, K)
        assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (c.world,)
        assert offsets.dtype == torch.int32 and tuple(offsets.shape) == (c.local_experts + 1,)
        assert idx.dtype == torch.int32 and idx.dim() == 1 and idx.shape[0] >= P
        assert ws.dtype == torch.float32 and ws.dim() == 1 and ws.shape[0] >= P
        assert pos.dtype == torch.int32 and tuple(pos.shape) == (S, K)
        if recv_x is not None:
            assert xs is not None
            assert recv_x.dtype == torch.bfloat16 and tuple(recv_x.shape) == (S, c.hidden)
            assert xs.dtype == torch.bfloat16 and xs.dim() == 2 and xs.shape[1] == c.hidden
            assert xs.shape[0] >= P

    def __call__(self, recv_ids: torch.Tensor, recv_w: torch.Tensor, recv_count: torch.Tensor,
                 recv_x: Optional[torch.Tensor], offsets: torch.Tensor, idx: torch.Tensor,
                 ws: torch.Tensor, pos: torch.Tensor, xs: Optional[torch.Tensor],
                 stream=None, check: bool = True) -> None:
        """Fill offsets [E_l+1], idx [>=S*K], ws [>=S*K], pos [S, K] (all entries) and, if
        ``recv_x``/``xs`` are given, xs[r] = recv_x[idx[r]] for r < offsets[E_l].
        recv_ids/recv_w [S, K], recv_count [W], recv_x [S, H]; xs [>=S*K, H]. No host sync."""
        if check:
            self._check(recv_ids, recv_w, recv_count, recv_x, offsets, idx, ws, pos, xs)
        st = _stream(stream)
        mIds = self._cv("recv_ids", recv_ids, 4, False)
        mCnt = self._cv("recv_count", recv_count, 4, False)
        self.k_count(mIds, mCnt, self._scr, self._cv("offsets", offsets, 4, False),
                     self._n_count, st)
        gather = recv_x is not None
        if gather:
            mX, mXs = self._cv("recv_x", recv_x, 16, True), self._cv("xs", xs, 16, True)
        else:
            mX = mXs = self._dummy_x
        self._place(gather)(mIds, self._cv("recv_w", recv_w, 4, False), mCnt, self._scr, mX,
                            self._cv("idx", idx, 4, True), self._cv("ws", ws, 4, True),
                            self._cv("pos", pos, 4, False), mXs, self._n_place, st)

    # -- test helpers (host-synchronizing) ------------------------------------------------------

    def scratch_state(self):
        """(counts, cursor, arrive) as CPU tensors -- synchronizes the host."""
        E_l = self.cfg.local_experts
        s = self.scratch.cpu()
        return (s[scr_counts(E_l):scr_counts(E_l) + E_l], s[scr_cursor(E_l):scr_cursor(E_l) + E_l],
                int(s[scr_arrive(E_l)]))
