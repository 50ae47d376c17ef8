"""Host side of the EP communication kernels: buffers, peer tables, compile cache, launch.

Nothing on the launch path synchronizes the host with the device. Every kernel is compiled once
per static configuration from FAKE tensors (no GPU needed to compile) and cached; the
per-forward tensors (x, topk ids/weights, outputs) are converted with ``from_dlpack`` +
``mark_compact_shape_dynamic`` on the token mode only, persistent buffers are converted once.

Typical use for one rank (real GPUs: ``symmetric_alloc=nvshmem.core.tensor`` and the peer table
from ``nvshmem.core.get_peer_tensor``; virtual ranks: plain torch buffers of one GPU):

    cfg   = EpConfig(hidden=2048, topk=8, world=W, max_tokens=4096, num_experts=128)
    bufs  = EpBuffers.allocate(cfg, device)                       # zero-initialised
    table = build_peer_table([peer_view_of_rank_r for r in range(W)], device)
    ep    = EpRank(cfg, my_rank, bufs, table)
    ep.dispatch(x, topk_ids, topk_w); ep.wait()
    ...   ep.gather(bufs.recv_x, idx, count, xg)  -> grouped GEMMs -> y (weighted)
    ep.combine_send(y, pos); ep.combine_reduce(topk_ids, out)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream

from . import DROP_VERSION
from .ep_constants import (
    DEFAULT_TIMEOUT_NS,
    EP_ABI_VERSION,
    EP_ALIGN_H_ELEMS,
    EP_CTRL_LEN,
    EP_ERR_LEN,
    EP_MAX_TOPK,
    EP_MAX_WORLD,
    EP_NUM_PEER_BUFS,
    EP_THREADS,
    PEER_COMB,
    PEER_FLAGS,
    PEER_RECV_COUNT,
    PEER_RECV_IDS,
    PEER_RECV_W,
    PEER_RECV_X,
)
from .ep_kernels import CombineReduce, CombineSend, EpDispatch, EpWait, GatherRows

ARCH = "sm_90a"
H200_NUM_SMS = 132

# Symmetric buffer names in peer-table row order.
SYMMETRIC_BUFFERS = {
    PEER_RECV_X: "recv_x",
    PEER_RECV_IDS: "recv_ids",
    PEER_RECV_W: "recv_w",
    PEER_RECV_COUNT: "recv_count",
    PEER_FLAGS: "flags",
    PEER_COMB: "comb",
}


# =============================================================================================
# Configuration and buffers
# =============================================================================================


@dataclasses.dataclass(frozen=True)
class EpConfig:
    """Static configuration (everything that is compiled in)."""

    hidden: int        # H, multiple of 8
    topk: int          # K <= 32
    world: int         # W <= 32
    max_tokens: int    # T_max per rank
    num_experts: int   # E, multiple of W
    threads: int = EP_THREADS

    def __post_init__(self):
        if self.hidden % EP_ALIGN_H_ELEMS:
            raise ValueError(f"hidden={self.hidden} must be a multiple of {EP_ALIGN_H_ELEMS}")
        if not 1 <= self.topk <= EP_MAX_TOPK:
            raise ValueError(f"topk={self.topk} must be in [1, {EP_MAX_TOPK}]")
        if not 1 <= self.world <= EP_MAX_WORLD:
            raise ValueError(f"world={self.world} must be in [1, {EP_MAX_WORLD}]")
        if self.num_experts % self.world:
            raise ValueError("num_experts must be divisible by world")
        if self.max_tokens < 1 or self.world * self.max_tokens * self.topk >= 2**31:
            raise ValueError("max_tokens out of range")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def slots(self) -> int:
        return self.world * self.max_tokens


@dataclasses.dataclass
class EpBuffers:
    """One rank's EP buffers.

    Symmetric (same shapes on every rank; peers write them):
        recv_x     [W*T_max, H] bf16
        recv_ids   [W*T_max, K] int32
        recv_w     [W*T_max, K] float32
        recv_count [W]          int32
        flags      [2*W]        int64   MUST be zero before the first forward on any rank
        comb       [W*T_max, H] bf16
    Local:
        ctrl       [4]          int64   zero at allocation (ctrl[0] = epoch)
        err        [4]          int32   zero at allocation
    """

    recv_x: torch.Tensor
    recv_ids: torch.Tensor
    recv_w: torch.Tensor
    recv_count: torch.Tensor
    flags: torch.Tensor
    comb: torch.Tensor
    ctrl: torch.Tensor
    err: torch.Tensor

    @classmethod
    def allocate(cls, cfg: EpConfig, device,
                 symmetric_alloc: Optional[Callable[..., torch.Tensor]] = None) -> "EpBuffers":
        """``symmetric_alloc(shape, dtype)`` allocates a symmetric tensor (e.g.
        ``nvshmem.core.tensor``); default: ``torch.empty`` on ``device`` (virtual ranks).
        flags / recv_count / ctrl / err are zeroed here (with NVSHMEM: barrier before use)."""
        S, H, K, W = cfg.slots, cfg.hidden, cfg.topk, cfg.world
        if symmetric_alloc is None:
            def symmetric_alloc(shape, dtype):
                return torch.empty(shape, dtype=dtype, device=device)
        b = cls(
            recv_x=symmetric_alloc((S, H), torch.bfloat16),
            recv_ids=symmetric_alloc((S, K), torch.int32),
            recv_w=symmetric_alloc((S, K), torch.float32),
            recv_count=symmetric_alloc((W,), torch.int32),
            flags=symmetric_alloc((2 * W,), torch.int64),
            comb=symmetric_alloc((S, H), torch.bfloat16),
            ctrl=torch.zeros(EP_CTRL_LEN, dtype=torch.int64, device=device),
            err=torch.zeros(EP_ERR_LEN, dtype=torch.int32, device=device),
        )
        b.flags.zero_()
        b.recv_count.zero_()
        return b

    def symmetric(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in SYMMETRIC_BUFFERS.values()}


def build_peer_table(peer_buffers: Sequence, device) -> torch.Tensor:
    """int64 [EP_NUM_PEER_BUFS, W] table of peer base addresses.

    ``peer_buffers[r]`` is rank r's symmetric buffers AS ADDRESSABLE FROM THIS RANK: an
    ``EpBuffers`` or a mapping name -> tensor (e.g. ``nvshmem.core.get_peer_tensor(buf, r)``
    for every name in ``SYMMETRIC_BUFFERS``). Index r == my_rank is this rank's own buffers.
    Built once at setup (it is a host -> device copy)."""
    W = len(peer_buffers)
    table = torch.zeros(EP_NUM_PEER_BUFS, W, dtype=torch.int64)
    for r, pb in enumerate(peer_buffers):
        get = pb.__getitem__ if isinstance(pb, Mapping) else (lambda n, pb=pb: getattr(pb, n))
        for row, name in SYMMETRIC_BUFFERS.items():
            t = get(name)
            addr = t.data_ptr()
            if addr % 16:
                raise ValueError(f"rank {r} {name} is not 16-byte aligned")
            table[row, r] = addr
    return table.to(device)


# =============================================================================================
# Fake arguments (compile without a GPU) and real-argument conversion
# =============================================================================================


def _fake(dtype, shape, align):
    """Row-major compact fake tensor; ``None`` entries of ``shape`` become dynamic."""
    shape = tuple(cute.sym_int() if s is None else s for s in shape)
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape)))[::-1],
                                    assumed_align=align)


def _real(t: torch.Tensor, align: int, dynamic_rows: bool):
    """CuTe view of a contiguous torch tensor; mode 0 dynamic if ``dynamic_rows``.
    (Row-major stride order is passed explicitly: ``torch.Tensor.dim_order()`` costs ~0.4 ms.)"""
    ct = from_dlpack(t, assumed_align=align)
    if dynamic_rows:
        ct = ct.mark_compact_shape_dynamic(mode=0, stride_order=tuple(range(t.dim())))
    return ct


def fake_args(kind: str, cfg: EpConfig, use_tvm_ffi: bool = False):
    """Fake ``__call__`` arguments of kernel ``kind`` whose static/dynamic structure matches
    what ``EpRank`` passes (token / row modes dynamic, everything else static)."""
    H, K, W, S = cfg.hidden, cfg.topk, cfg.world, cfg.slots
    bf16, i32, i64, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64, cutlass.Float32
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    peers = _fake(i64, (EP_NUM_PEER_BUFS, W), 8)
    ctrl = _fake(i64, (EP_CTRL_LEN,), 8)
    err = _fake(i32, (EP_ERR_LEN,), 4)
    flags = _fake(i64, (2 * W,), 8)
    n = cutlass.Int32(1)
    if kind == "dispatch":
        return (_fake(bf16, (None, H), 16), _fake(i32, (None, K), 4), _fake(f32, (None, K), 4),
                peers, ctrl, err, cutlass.Int32(0), n, n, stream)
    if kind == "wait":
        return (flags, ctrl, err, cutlass.Int64(1), stream)
    if kind == "gather":
        return (_fake(bf16, (None, H), 16), _fake(i32, (None,), 4), _fake(i32, (1,), 4),
                _fake(bf16, (None, H), 16), n, stream)
    if kind == "combine_send":
        return (_fake(bf16, (None, H), 16), _fake(i32, (S, K), 4), _fake(i32, (W,), 4), peers,
                ctrl, err, cutlass.Int32(0), n, stream)
    if kind == "combine_reduce":
        return (_fake(i32, (None, K), 4), _fake(bf16, (S, H), 16), flags, ctrl, err,
                _fake(bf16, (None, H), 16), n, cutlass.Int64(1), n, stream)
    raise ValueError(kind)


def make_kernel(kind: str, cfg: EpConfig):
    H, K, W, T, E, th = (cfg.hidden, cfg.topk, cfg.world, cfg.max_tokens, cfg.num_experts,
                         cfg.threads)
    if kind == "dispatch":
        return EpDispatch(H, K, W, T, E, th)
    if kind == "wait":
        return EpWait(W)
    if kind == "gather":
        return GatherRows(H, th)
    if kind == "combine_send":
        return CombineSend(H, K, W, T, th)
    if kind == "combine_reduce":
        return CombineReduce(H, K, W, T, E, th)
    raise ValueError(kind)


KINDS = ("dispatch", "wait", "gather", "combine_send", "combine_reduce")


def cache_key(kind: str, cfg: EpConfig) -> tuple:
    static = dataclasses.astuple(cfg)
    if kind == "wait":
        static = (cfg.world,)
    elif kind == "gather":
        static = (cfg.hidden, cfg.threads)
    return (EP_ABI_VERSION, DROP_VERSION, getattr(cutlass, "__version__", ""), ARCH, kind, static)


class _Compiled:
    """A compiled kernel; recompiles from the first real arguments if the fake-compiled
    signature is rejected (safety net, logged once)."""

    def __init__(self, kind: str, cfg: EpConfig, options: str = f"--gpu-arch {ARCH}"):
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
            print(f"[sm90_megamoe.ep] fake-compiled {self.kind} rejected real args ({exc!r}); "
                  "recompiling from real arguments")
            self.fn = cute.compile(self.kernel, *args, options=self.options)
            self.fn(*args)
        self._verified = True


_CACHE: Dict[tuple, _Compiled] = {}


def get_kernel(kind: str, cfg: EpConfig) -> _Compiled:
    key = cache_key(kind, cfg)
    k = _CACHE.get(key)
    if k is None:
        k = _Compiled(kind, cfg)
        _CACHE[key] = k
    return k


_STREAMS: Dict[int, cuda.CUstream] = {}


def _stream(stream) -> cuda.CUstream:
    """torch stream (default: current) -> cached CUstream handle."""
    if isinstance(stream, cuda.CUstream):
        return stream
    if stream is None:
        stream = torch.cuda.current_stream()
    h = stream.cuda_stream
    s = _STREAMS.get(h)
    if s is None:
        if len(_STREAMS) > 256:
            _STREAMS.clear()
        s = _STREAMS[h] = cuda.CUstream(h)
    return s


def default_num_ctas() -> int:
    try:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # noqa: BLE001
        return H200_NUM_SMS


# =============================================================================================
# Per-rank launcher
# =============================================================================================


class EpRank:
    """Launches the EP kernels of one rank. No method syncs the host (except ``read_err`` and
    ``reset_state``, which are for tests / error recovery).

    num_ctas: grid of the row kernels (default: #SMs). With virtual ranks on one GPU it must be
    small enough that the CTAs of all W ranks' kernels co-reside (e.g. <= #SMs / W / 2), because
    CombineReduce / EpWait spin on flags written by the other ranks' kernels.
    """

    def __init__(self, cfg: EpConfig, rank: int, bufs: EpBuffers, peer_table: torch.Tensor,
                 num_ctas: Optional[int] = None, timeout_ns: int = DEFAULT_TIMEOUT_NS):
        assert 0 <= rank < cfg.world
        assert peer_table.shape == (EP_NUM_PEER_BUFS, cfg.world)
        assert peer_table.dtype == torch.int64 and peer_table.is_cuda
        self.cfg, self.rank, self.bufs, self.peer_table = cfg, rank, bufs, peer_table
        self.num_ctas = num_ctas or default_num_ctas()
        self.timeout_ns = int(timeout_ns)
        self._timeout_key, self._timeout = None, None
        self.k = {kind: get_kernel(kind, cfg) for kind in KINDS}
        dev = bufs.recv_x.device
        # Persistent conversions (static layouts).
        self._peers = _real(peer_table, 8, False)
        self._ctrl = _real(bufs.ctrl, 8, False)
        self._err = _real(bufs.err, 4, False)
        self._flags = _real(bufs.flags, 8, False)
        self._recv_count = _real(bufs.recv_count, 4, False)
        self._comb = _real(bufs.comb, 16, False)
        self._rank = cutlass.Int32(rank)
        # 1-row dummies used when a rank has T == 0 tokens (no 0-row tensors are converted).
        H, K = cfg.hidden, cfg.topk
        self._conv: Dict[str, tuple] = {}
        self._i32: Dict[int, object] = {}
        self._keep = [torch.zeros(1, H, dtype=torch.bfloat16, device=dev),
                      torch.full((1, K), -1, dtype=torch.int32, device=dev),
                      torch.zeros(1, K, dtype=torch.float32, device=dev),
                      torch.zeros(1, H, dtype=torch.bfloat16, device=dev)]
        self._dummy_x = _real(self._keep[0], 16, True)
        self._dummy_ids = _real(self._keep[1], 4, True)
        self._dummy_w = _real(self._keep[2], 4, True)
        self._dummy_out = _real(self._keep[3], 16, True)

    # -- argument conversion (host overhead) ----------------------------------------------------

    def _cv(self, role: str, t: torch.Tensor, align: int, dynamic_rows: bool):
        """Convert with a one-entry cache per argument role: a call with the same tensor
        (pointer, shape, dtype) as the previous call of that role reuses the converted object
        (~20 us saved per tensor). The cache keeps the LAST tensor of each role alive (the
        DLPack capsule holds a reference), so a cached address can never be recycled."""
        if not t.is_contiguous():
            raise ValueError(f"{role} must be contiguous")
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        hit = self._conv.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        ct = _real(t, align, dynamic_rows)
        self._conv[role] = (key, ct)
        return ct

    def _int32(self, v: int):
        c = self._i32.get(v)
        if c is None:
            if len(self._i32) > 4096:
                self._i32.clear()
            c = self._i32[v] = cutlass.Int32(v)
        return c

    # -- forward ------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                 stream=None, num_ctas: Optional[int] = None):
        """x [T, H] bf16, topk_ids [T, K] int32 (global ids, <0 = dropped), topk_w [T, K] f32."""
        cfg = self.cfg
        T = x.shape[0]
        if T > cfg.max_tokens:
            raise ValueError(f"T={T} > T_max={cfg.max_tokens}")
        assert x.dtype == torch.bfloat16 and x.shape[1] == cfg.hidden and x.is_contiguous()
        assert topk_ids.dtype == torch.int32 and topk_ids.shape == (T, cfg.topk)
        assert topk_w.dtype == torch.float32 and topk_w.shape == (T, cfg.topk)
        if T == 0:
            mX, mI, mW = self._dummy_x, self._dummy_ids, self._dummy_w
        else:
            mX = self._cv("x", x, 16, True)
            mI = self._cv("topk_ids", topk_ids, 4, True)
            mW = self._cv("topk_w", topk_w, 4, True)
        self.k["dispatch"](mX, mI, mW, self._peers, self._ctrl, self._err, self._rank,
                           self._int32(T), self._int32(num_ctas or self.num_ctas),
                           _stream(stream))

    def wait(self, stream=None, timeout_ns: Optional[int] = None):
        """Block the stream (not the host) until all W dispatches of this epoch arrived."""
        if timeout_ns is None:
            timeout_ns = self.timeout_ns
        if self._timeout_key != timeout_ns:
            self._timeout_key, self._timeout = timeout_ns, cutlass.Int64(timeout_ns)
        self.k["wait"](self._flags, self._ctrl, self._err, self._timeout, _stream(stream))

    def gather(self, src: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
               out: torch.Tensor, stream=None, num_ctas: Optional[int] = None):
        """out[i] = src[idx[i]] for i < min(count[0], len(idx)); count: int32 device tensor with
        one element (a view is fine). src [R, H], out [cap, H] bf16; idx [cap] int32."""
        assert idx.dtype == torch.int32 and count.dtype == torch.int32 and count.numel() == 1
        assert out.shape[0] >= idx.shape[0] and src.shape[1] == out.shape[1] == self.cfg.hidden
        if idx.shape[0] == 0 or src.shape[0] == 0:
            return
        self.k["gather"](self._cv("g_src", src, 16, True), self._cv("g_idx", idx, 4, True),
                         self._cv("g_count", count.view(1), 4, False),
                         self._cv("g_out", out, 16, True),
                         self._int32(num_ctas or self.num_ctas), _stream(stream))

    def combine_send(self, y: torch.Tensor, pos: torch.Tensor, stream=None,
                     num_ctas: Optional[int] = None):
        """y [R, H] bf16 (weighted expert outputs, grouped), pos [W*T_max, K] int32 (-1 = none)."""
        cfg = self.cfg
        assert pos.dtype == torch.int32 and pos.shape == (cfg.slots, cfg.topk)
        assert y.dtype == torch.bfloat16 and y.shape[1] == cfg.hidden and y.shape[0] >= 1
        self.k["combine_send"](self._cv("y", y, 16, True), self._cv("pos", pos, 4, False),
                               self._recv_count, self._peers, self._ctrl, self._err, self._rank,
                               self._int32(num_ctas or self.num_ctas), _stream(stream))

    def combine_reduce(self, topk_ids: torch.Tensor, out: torch.Tensor, stream=None,
                       num_ctas: Optional[int] = None, timeout_ns: Optional[int] = None):
        """out [T, H] bf16 = sum over destinations of the returned partial rows."""
        T = topk_ids.shape[0]
        assert out.shape == (T, self.cfg.hidden) and out.dtype == torch.bfloat16
        if T == 0:
            mI, mO = self._dummy_ids, self._dummy_out
        else:
            mI, mO = self._cv("c_topk_ids", topk_ids, 4, True), self._cv("c_out", out, 16, True)
        if timeout_ns is None:
            timeout_ns = self.timeout_ns
        if self._timeout_key != timeout_ns:
            self._timeout_key, self._timeout = timeout_ns, cutlass.Int64(timeout_ns)
        self.k["combine_reduce"](mI, self._comb, self._flags, self._ctrl, self._err, mO,
                                 self._int32(T), self._timeout,
                                 self._int32(num_ctas or self.num_ctas), _stream(stream))

    # -- diagnostics / recovery (host-synchronizing) --------------------------------------------

    def read_err(self):
        """(code, peer, where, aux) — synchronizes the host."""
        return tuple(int(v) for v in self.bufs.err.cpu())

    def epoch(self) -> int:
        return int(self.bufs.ctrl[0].item())

    def reset_state(self):
        """Zero flags, recv_count, ctrl and err of THIS rank. After an error, every rank must
        reset, with a global barrier before and after (no kernel of any rank in flight)."""
        self.bufs.flags.zero_()
        self.bufs.recv_count.zero_()
        self.bufs.ctrl.zero_()
        self.bufs.err.zero_()
