"""Host side of the EP communication kernels: buffers, peer tables, compile cache, launch.

Nothing on the launch path synchronizes the host with the device. Every kernel is compiled once
per static configuration from FAKE tensors (no GPU needed to compile) and cached; the
per-forward tensors (x, topk ids/weights, outputs) are converted with ``from_dlpack`` +
``mark_compact_shape_dynamic`` on the token mode only, persistent buffers are converted once.
With ``tvm_ffi=True`` (``--enable-tvm-ffi``, needs apache-tvm-ffi) nothing is converted: the
kernels are called with torch tensors and Python ints on torch's current stream.

Typical use for one rank (real GPUs: ``symmetric_alloc=nvshmem.core.tensor`` and the peer table
from ``nvshmem.core.get_peer_tensor``; virtual ranks: plain torch buffers of one GPU):

    cfg   = EpConfig(hidden=2048, topk=8, world=W, max_tokens=4096, num_experts=128)
    bufs  = EpBuffers.allocate(cfg, device)                       # zero-initialised
    table = build_peer_table([peer_view_of_rank_r for r in range(W)], device)
    ep    = EpRank(cfg, my_rank, bufs, table)
    ep.dispatch(x, topk_ids, topk_w)     # ids int32 or int64; bad ids / weights dropped + recorded
    ...   layout_launch.Layout (waits, groups rows)  -> grouped GEMMs -> y (weighted)
    ep.combine_send(y, pos); ep.combine_reduce(out)
    ep.read_verr()                       # host sync: the first bad input, if any
"""

from __future__ import annotations

import dataclasses
import struct
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
    EP_VERR_LEN,
    VERR_ID_EPOCH,
    VERR_ID_KEY,
    VERR_ID_VALUE,
    VERR_NO_KEY,
    VERR_RESET,
    VERR_W_EPOCH,
    VERR_W_KEY,
    VERR_W_VALUE,
    PEER_COMB,
    PEER_FLAGS,
    PEER_RECV_COUNT,
    PEER_RECV_IDS,
    PEER_RECV_W,
    PEER_RECV_X,
)
from .ep_kernels import CombineLocal, CombineReduce, CombineSend, EpDispatch, EpWait, GatherRows
from .launch import call_on_stream, ffi_fixed, ffi_function

ARCH = "sm_90a"

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
        verr       [8]          int64   VERR_RESET at allocation (first bad input value)
        dmask      [T_max]      int32   any content (written by dispatch before it is read)

    Callers with their own memory (a workspace) may build ``EpBuffers(...)`` from views
    directly; they must then zero flags / recv_count / ctrl / err and set verr = VERR_RESET.
    """

    recv_x: torch.Tensor
    recv_ids: torch.Tensor
    recv_w: torch.Tensor
    recv_count: torch.Tensor
    flags: torch.Tensor
    comb: torch.Tensor
    ctrl: torch.Tensor
    err: torch.Tensor
    verr: torch.Tensor
    dmask: torch.Tensor

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
            verr=torch.tensor(VERR_RESET, dtype=torch.int64, device=device),
            dmask=torch.zeros(cfg.max_tokens, dtype=torch.int32, device=device),
        )
        b.flags.zero_()
        b.recv_count.zero_()
        return b

    def symmetric(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in SYMMETRIC_BUFFERS.values()}


def check_routing_inputs(hidden: int, topk: int, max_tokens: int, x: torch.Tensor, topk_ids: torch.Tensor,
                         topk_w: torch.Tensor) -> int:
    """What a dispatch (or the one-rank LocalRoute) takes: x [T, H] bf16 with T <= T_max,
    topk_ids [T, K] int32/int64, topk_w [T, K] float32 (ValueError otherwise). Returns T."""
    T = x.shape[0]
    if T > max_tokens:
        raise ValueError(f"T={T} > T_max={max_tokens}")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be bf16 [T, {hidden}]")
    if topk_ids.dtype not in (torch.int32, torch.int64) or tuple(topk_ids.shape) != (T, topk):
        raise ValueError(f"topk_ids must be int32/int64 [{T}, {topk}]")
    if topk_w.dtype != torch.float32 or tuple(topk_w.shape) != (T, topk):
        raise ValueError(f"topk_w must be float32 [{T}, {topk}]")
    return T


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
    H, K, W, S, T = cfg.hidden, cfg.topk, cfg.world, cfg.slots, cfg.max_tokens
    bf16, i32, i64, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Int64, cutlass.Float32
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    peers = _fake(i64, (EP_NUM_PEER_BUFS, W), 8)
    ctrl = _fake(i64, (EP_CTRL_LEN,), 8)
    err = _fake(i32, (EP_ERR_LEN,), 4)
    verr = _fake(i64, (EP_VERR_LEN,), 8)
    dmask = _fake(i32, (T,), 4)
    flags = _fake(i64, (2 * W,), 8)
    n = cutlass.Int32(1)
    if kind in ("dispatch", "dispatch_i64"):
        ids = _fake(i64 if kind == "dispatch_i64" else i32, (None, K), 8 if kind == "dispatch_i64" else 4)
        return (_fake(bf16, (None, H), 16), ids, _fake(f32, (None, K), 4),
                peers, ctrl, err, verr, dmask, cutlass.Int32(0), n, n, stream)
    if kind == "wait":
        return (flags, ctrl, err, cutlass.Int64(1), stream)
    if kind == "gather":
        return (_fake(bf16, (None, H), 16), _fake(i32, (None,), 4), _fake(i32, (1,), 4),
                _fake(bf16, (None, H), 16), n, stream)
    if kind in ("combine_send", "combine_send_weighted"):
        return (_fake(bf16, (None, H), 16), _fake(i32, (S, K), 4), _fake(i32, (W,), 4),
                _fake(f32, (S, K), 4), peers, ctrl, err, cutlass.Int32(0), n, stream)
    if kind == "combine_reduce":
        return (dmask, _fake(bf16, (S, H), 16), flags, ctrl, err,
                _fake(bf16, (None, H), 16), n, cutlass.Int64(1), n, stream)
    if kind == "combine_local":
        return (_fake(bf16, (None, H), 16), _fake(i32, (S, K), 4), _fake(i32, (W,), 4), err,
                _fake(bf16, (None, H), 16), n, n, stream)
    raise ValueError(kind)


def make_kernel(kind: str, cfg: EpConfig):
    H, K, W, T, E, th = (cfg.hidden, cfg.topk, cfg.world, cfg.max_tokens, cfg.num_experts,
                         cfg.threads)
    if kind in ("dispatch", "dispatch_i64"):
        return EpDispatch(H, K, W, T, E, th)
    if kind == "wait":
        return EpWait(W)
    if kind == "gather":
        return GatherRows(H, th)
    if kind in ("combine_send", "combine_send_weighted"):
        return CombineSend(H, K, W, T, th, weighted=(kind == "combine_send_weighted"))
    if kind == "combine_reduce":
        return CombineReduce(H, K, W, T, E, th)
    if kind == "combine_local":
        if W != 1:
            raise ValueError(f"combine_local is the single-rank combine (W = 1), not W = {W}")
        return CombineLocal(H, K, T, th)
    raise ValueError(kind)


# dispatch_i64: the same kernel for int64 expert ids (read and range-checked in 64 bits);
# combine_send_weighted: the split dispatch/combine pair (router weights applied in combine).
KINDS = ("dispatch", "dispatch_i64", "wait", "gather", "combine_send", "combine_send_weighted",
         "combine_reduce")
# combine_local: combine in one launch when W = 1 (CombineLocal); built on request, W = 1 only
LOCAL_KINDS = ("combine_local",)


def kinds_for(cfg: "EpConfig", local_combine: bool = False) -> tuple:
    """The kernel kinds a rank of ``cfg`` uses: ``KINDS``, plus ``LOCAL_KINDS`` when asked for
    (``local_combine``) and W = 1."""
    return KINDS + (LOCAL_KINDS if local_combine and cfg.world == 1 else ())


def cache_key(kind: str, cfg: EpConfig, tvm_ffi: bool = False, arch: str = ARCH) -> tuple:
    static = dataclasses.astuple(cfg)
    if kind == "wait":
        static = (cfg.world,)
    elif kind == "gather":
        static = (cfg.hidden, cfg.threads)
    # dispatch vs dispatch_i64, combine_send vs combine_send_weighted: ``kind`` tells them apart
    return (EP_ABI_VERSION, DROP_VERSION, getattr(cutlass, "__version__", ""), arch, kind, static,
            bool(tvm_ffi))


def compile_kernel(kind: str, cfg: EpConfig, options: Optional[str] = None, tvm_ffi: bool = False,
                   arch: str = ARCH):
    """Compile one EP kernel from fake tensors (no GPU needed); no caching. ``tvm_ffi``: for
    TVM-FFI launches (adds ``--enable-tvm-ffi``; the stream argument becomes torch's current one).
    ``arch``: the target (the EP kernels use only loads, stores, atomics and fences, so they build
    for sm_90a, sm_100a and sm_120a alike); ``options`` None = ``--gpu-arch <arch>``."""
    if options is None:
        options = f"--gpu-arch {arch}"
    if tvm_ffi:
        options = f"{options} --enable-tvm-ffi"
    return cute.compile(make_kernel(kind, cfg), *fake_args(kind, cfg, use_tvm_ffi=tvm_ffi), options=options)


_CACHE: Dict[tuple, object] = {}


def get_kernel(kind: str, cfg: EpConfig, tvm_ffi: bool = False, arch: str = ARCH):
    """The compiled kernel (process-wide cache of compiled code only; no buffers). A real
    argument that does not match the fake-compiled signature raises at launch: the fake
    arguments ARE the ABI, nothing is silently recompiled."""
    key = cache_key(kind, cfg, tvm_ffi, arch)
    k = _CACHE.get(key)
    if k is None:
        k = _CACHE[key] = compile_kernel(kind, cfg, tvm_ffi=tvm_ffi, arch=arch)
    return k


def put_kernel(kind: str, cfg: EpConfig, compiled, tvm_ffi: bool = False, arch: str = ARCH) -> None:
    """Seed the process-wide cache with ``kind``'s kernel for ``cfg`` compiled elsewhere (e.g.
    loaded from an exported object file); launches then use it instead of compiling."""
    if kind not in KINDS + LOCAL_KINDS:
        raise ValueError(f"unknown kernel kind {kind!r} (kinds: {KINDS + LOCAL_KINDS})")
    _CACHE[cache_key(kind, cfg, tvm_ffi, arch)] = compiled


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


def device_num_sms(device=None) -> int:
    """SM count of ``device`` (default: the current CUDA device). Raises without CUDA: a grid
    size is never guessed."""
    if not torch.cuda.is_available():
        raise RuntimeError("sm90_megamoe: no CUDA device to size the grid for; pass num_ctas")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.cuda.get_device_properties(dev).multi_processor_count


# =============================================================================================
# Per-rank launcher
# =============================================================================================


class EpRank:
    """Launches the EP kernels of one rank. No method syncs the host (except ``read_err``,
    ``read_verr``, ``reset_state`` and ``reset_verr``, which are for error reporting / recovery).

    num_ctas: grid of the row kernels (default: #SMs of the buffers' device). With virtual ranks
    on one GPU it must be small enough that the CTAs of all W ranks' kernels co-reside (e.g.
    <= #SMs / W / 2), because CombineReduce / EpWait spin on flags written by other ranks.
    tvm_ffi: launch kernels compiled for TVM-FFI with torch tensors (``stream`` arguments are then
    ``torch.cuda.Stream`` or None); else the classic path with converted CuTe tensors.
    arch: the GPU's target (``sm_90a``, ``sm_100a``, ``sm_120a``): the kernels are arch-neutral.
    local_combine: also load ``combine_local`` (W = 1 only; see :meth:`combine_local`).
    """

    def __init__(self, cfg: EpConfig, rank: int, bufs: EpBuffers, peer_table: torch.Tensor,
                 num_ctas: Optional[int] = None, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 tvm_ffi: bool = False, arch: str = ARCH, local_combine: bool = False):
        if not 0 <= rank < cfg.world:
            raise ValueError(f"rank {rank} outside [0, {cfg.world})")
        if tuple(peer_table.shape) != (EP_NUM_PEER_BUFS, cfg.world) or \
                peer_table.dtype != torch.int64 or not peer_table.is_cuda:
            raise ValueError(f"peer_table must be int64 [{EP_NUM_PEER_BUFS}, {cfg.world}] on CUDA")
        self.cfg, self.rank, self.bufs, self.peer_table = cfg, rank, bufs, peer_table
        dev = bufs.recv_x.device
        self.num_ctas = num_ctas or device_num_sms(dev)
        self.timeout_ns = int(timeout_ns)
        self._timeout_key, self._timeout = None, None
        self.ffi = bool(tvm_ffi)
        self.k = {kind: get_kernel(kind, cfg, self.ffi, arch) for kind in kinds_for(cfg, local_combine)}
        if self.ffi:
            self.k = {kind: ffi_function(k) for kind, k in self.k.items()}
        # Persistent conversions (static layouts).
        cv = self._persistent
        self._peers = cv(peer_table, 8, False)
        self._ctrl = cv(bufs.ctrl, 8, False)
        self._err = cv(bufs.err, 4, False)
        self._verr = cv(bufs.verr, 8, False)
        self._dmask = cv(bufs.dmask, 4, False)
        self._flags = cv(bufs.flags, 8, False)
        self._recv_count = cv(bufs.recv_count, 4, False)
        self._recv_w = cv(bufs.recv_w, 4, False)
        self._comb = cv(bufs.comb, 16, False)
        self._rank = rank if self.ffi else cutlass.Int32(rank)
        # 1-row dummies used when a rank has T == 0 tokens (no 0-row tensors are converted).
        H, K = cfg.hidden, cfg.topk
        self._conv: Dict[str, tuple] = {}
        self._i32: Dict[int, object] = {}
        self._keep = [torch.zeros(1, H, dtype=torch.bfloat16, device=dev),
                      torch.full((1, K), -1, dtype=torch.int32, device=dev),
                      torch.zeros(1, K, dtype=torch.float32, device=dev),
                      torch.zeros(1, H, dtype=torch.bfloat16, device=dev)]
        self._dummy_x = cv(self._keep[0], 16, True)
        self._dummy_ids = cv(self._keep[1], 4, True)
        self._dummy_w = cv(self._keep[2], 4, True)
        self._dummy_out = cv(self._keep[3], 16, True)

    # -- argument conversion (host overhead) ----------------------------------------------------

    def _persistent(self, t: torch.Tensor, align: int, dynamic_rows: bool):
        """A buffer that lives as long as this launcher: converted once (TVM-FFI: as is)."""
        return t if self.ffi else _real(t, align, dynamic_rows)

    def _launch(self, kind: str, *args, stream=None):
        """Launch ``kind`` on ``stream`` (default: torch's current stream)."""
        if self.ffi:
            call_on_stream(self.k[kind], args, stream)
        else:
            self.k[kind](*args, _stream(stream))

    def _cv(self, role: str, t: torch.Tensor, align: int, dynamic_rows: bool):
        """Convert with a one-entry cache per argument role: a call with the same tensor
        (pointer, shape, dtype) as the previous call of that role reuses the converted object
        (~20 us saved per tensor). The cache keeps the LAST tensor of each role alive (the
        DLPack capsule holds a reference), so a cached address can never be recycled."""
        if not t.is_contiguous():
            raise ValueError(f"{role} must be contiguous")
        if self.ffi:  # the call takes torch tensors (and checks them)
            return t
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        hit = self._conv.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        ct = _real(t, align, dynamic_rows)
        self._conv[role] = (key, ct)
        return ct

    def release(self) -> None:
        """Drop the conversion cache (classic path): it keeps each role's last tensor alive, e.g.
        a warm-up's throw-away tokens, for as long as this launcher lives (drop v113)."""
        self._conv.clear()

    def _int32(self, v: int):
        if self.ffi:
            return int(v)
        c = self._i32.get(v)
        if c is None:
            if len(self._i32) > 4096:
                self._i32.clear()
            c = self._i32[v] = cutlass.Int32(v)
        return c

    def _timeout_arg(self, timeout_ns: Optional[int]):
        if timeout_ns is None:
            timeout_ns = self.timeout_ns
        if self.ffi:
            return int(timeout_ns)
        if self._timeout_key != timeout_ns:
            self._timeout_key, self._timeout = timeout_ns, cutlass.Int64(timeout_ns)
        return self._timeout

    # -- forward ------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                 stream=None, num_ctas: Optional[int] = None):
        """x [T, H] bf16, topk_ids [T, K] int32 or int64 (global ids; a choice whose id is outside
        [0, E) or whose weight is not finite is dropped and recorded in verr), topk_w [T, K] f32."""
        T = check_routing_inputs(self.cfg.hidden, self.cfg.topk, self.cfg.max_tokens, x, topk_ids, topk_w)
        wide = topk_ids.dtype == torch.int64
        if T == 0:  # the kernel still publishes T = 0 and the epoch flag
            mX, mI, mW, wide = self._dummy_x, self._dummy_ids, self._dummy_w, False
        else:
            mX = self._cv("x", x, 16, True)
            mI = self._cv("topk_ids", topk_ids, 8 if wide else 4, True)
            mW = self._cv("topk_w", topk_w, 4, True)
        self._launch("dispatch_i64" if wide else "dispatch",
                     mX, mI, mW, self._peers, self._ctrl, self._err, self._verr, self._dmask, self._rank,
                     self._int32(T), self._int32(num_ctas or self.num_ctas), stream=stream)

    def wait(self, stream=None, timeout_ns: Optional[int] = None):
        """Block the stream (not the host) until all W dispatches of this epoch arrived."""
        self._launch("wait", self._flags, self._ctrl, self._err, self._timeout_arg(timeout_ns),
                     stream=stream)

    def gather(self, src: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
               out: torch.Tensor, stream=None, num_ctas: Optional[int] = None):
        """out[i] = src[idx[i]] for i < min(count[0], len(idx)); count: int32 device tensor with
        one element (a view is fine). src [R, H], out [cap, H] bf16; idx [cap] int32."""
        if idx.dtype != torch.int32 or count.dtype != torch.int32 or count.numel() != 1:
            raise ValueError("gather: idx and count must be int32, count one element")
        if out.shape[0] < idx.shape[0] or not src.shape[1] == out.shape[1] == self.cfg.hidden:
            raise ValueError("gather: out must have >= len(idx) rows of H")
        if idx.shape[0] == 0 or src.shape[0] == 0:
            return
        self._launch("gather", self._cv("g_src", src, 16, True), self._cv("g_idx", idx, 4, True),
                     self._cv("g_count", count.view(1), 4, False),
                     self._cv("g_out", out, 16, True),
                     self._int32(num_ctas or self.num_ctas), stream=stream)

    def _check_combine_rows(self, y: torch.Tensor, pos: torch.Tensor, local: bool = False) -> None:
        """The combine's inputs: ``y [R >= 1, H]`` bf16 expert rows, ``pos [W*T_max, K]`` int32;
        ``local``: the one-launch combine, which needs W = 1 and ``local_combine=True``."""
        cfg = self.cfg
        if local and "combine_local" not in self.k:
            raise ValueError(f"combine_local needs W = 1 (this rank's W = {cfg.world}) and an EpRank made "
                             "with local_combine=True")
        if pos.dtype != torch.int32 or tuple(pos.shape) != (cfg.slots, cfg.topk):
            raise ValueError(f"pos must be int32 [{cfg.slots}, {cfg.topk}]")
        if y.dtype != torch.bfloat16 or y.dim() != 2 or y.shape[1] != cfg.hidden or y.shape[0] < 1:
            raise ValueError(f"y must be bf16 [R >= 1, {cfg.hidden}]")

    def _check_combine_out(self, out: torch.Tensor) -> int:
        """The combine's output ``out [T <= T_max, H]`` bf16; returns T."""
        cfg, T = self.cfg, out.shape[0]
        if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[1] != cfg.hidden or T > cfg.max_tokens:
            raise ValueError(f"out must be bf16 [T <= {cfg.max_tokens}, {cfg.hidden}]")
        return T

    def combine_send(self, y: torch.Tensor, pos: torch.Tensor, stream=None,
                     num_ctas: Optional[int] = None, weighted: bool = False):
        """y [R, H] bf16 expert outputs, grouped; pos [W*T_max, K] int32 (-1 = none).
        ``weighted=False``: y already carries the router weights (FC2 epilogue);
        ``weighted=True``: row k of slot s is multiplied by recv_w[s, k] here (fp32)."""
        self._check_combine_rows(y, pos)
        self._launch("combine_send_weighted" if weighted else "combine_send",
                     self._cv("y", y, 16, True), self._cv("pos", pos, 4, False), self._recv_count,
                     self._recv_w, self._peers, self._ctrl, self._err, self._rank,
                     self._int32(num_ctas or self.num_ctas), stream=stream)

    def combine_reduce(self, out: torch.Tensor, stream=None, num_ctas: Optional[int] = None,
                       timeout_ns: Optional[int] = None):
        """out [T, H] bf16 = sum over the destinations of each token (dmask, written by this
        rank's dispatch of the same forward) of the returned partial rows."""
        T = self._check_combine_out(out)
        mO = self._dummy_out if T == 0 else self._cv("c_out", out, 16, True)
        self._launch("combine_reduce", self._dmask, self._comb, self._flags, self._ctrl, self._err, mO,
                     self._int32(T), self._timeout_arg(timeout_ns),
                     self._int32(num_ctas or self.num_ctas), stream=stream)

    def combine_local(self, y: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, stream=None,
                      num_ctas: Optional[int] = None):
        """W = 1 only: ``combine_send`` + ``combine_reduce`` in one launch, bit for bit (see
        :class:`.ep_kernels.CombineLocal`). y [R, H] bf16 with the router weights applied, pos
        [T_max, K] int32, out [T, H] bf16."""
        self._check_combine_rows(y, pos, local=True)
        T = self._check_combine_out(out)
        mO = self._dummy_out if T == 0 else self._cv("c_out", out, 16, True)
        self._launch("combine_local", self._cv("y", y, 16, True), self._cv("pos", pos, 4, False),
                     self._recv_count, self._err, mO, self._int32(T),
                     self._int32(num_ctas or self.num_ctas), stream=stream)

    def prepare_combine_local(self, y: torch.Tensor, pos: torch.Tensor):
        """:meth:`combine_local` with ``y`` and ``pos`` fixed (drop v58): ``run(out, num_ctas=None)``
        is ``self.combine_local(y, pos, out, num_ctas=num_ctas)`` -- the same kernel and arguments --
        with the fixed ones checked and packed once here; a call checks only ``out``. ``y`` and
        ``pos`` are held and must keep their shapes while ``run`` is used."""
        self._check_combine_rows(y, pos, local=True)
        if not self.ffi:
            def run_unpacked(out, num_ctas=None):
                self.combine_local(y, pos, out, num_ctas=num_ctas)
            return run_unpacked
        # the fixed tensors as TVM-FFI objects once (drop v61); out (or, with no tokens, the
        # placeholder) stays a torch tensor: TVM-FFI takes the stream from it
        head = ffi_fixed(self._cv("y", y, 16, True), self._cv("pos", pos, 4, False), self._recv_count, self._err)
        fn, dummy, grid, check_out = self.k["combine_local"], self._dummy_out, self.num_ctas, self._check_combine_out

        def run(out, num_ctas=None):
            T = check_out(out)
            if T and not out.is_contiguous():
                raise ValueError("c_out must be contiguous")
            fn(*head, out if T else dummy, T, num_ctas or grid)
        return run

    # -- diagnostics / recovery (host-synchronizing) --------------------------------------------

    def read_err(self):
        """(code, peer, where, aux) -- synchronizes the host."""
        return tuple(int(v) for v in self.bufs.err.cpu())

    def read_verr(self):
        """The first bad input values recorded by dispatch (synchronizes the host):
        ``{"topk_ids": (epoch, token, k, id) or None, "topk_weights": (epoch, token, k,
        float value) or None}``."""
        v = [int(x) for x in self.bufs.verr.cpu()]
        K = self.cfg.topk
        out = {"topk_ids": None, "topk_weights": None}
        if v[VERR_ID_EPOCH] and v[VERR_ID_KEY] != VERR_NO_KEY:
            t, k = divmod(v[VERR_ID_KEY], K)
            out["topk_ids"] = (v[VERR_ID_EPOCH], t, k, v[VERR_ID_VALUE])
        if v[VERR_W_EPOCH] and v[VERR_W_KEY] != VERR_NO_KEY:
            t, k = divmod(v[VERR_W_KEY], K)
            value = struct.unpack("<f", struct.pack("<I", v[VERR_W_VALUE] & 0xFFFFFFFF))[0]
            out["topk_weights"] = (v[VERR_W_EPOCH], t, k, value)
        return out

    def reset_verr(self):
        """Forget the recorded bad inputs (stream-ordered, no sync)."""
        self.bufs.verr.copy_(torch.tensor(VERR_RESET, dtype=torch.int64), non_blocking=False)

    def epoch(self) -> int:
        return int(self.bufs.ctrl[0].item())

    def reset_state(self):
        """Zero flags, recv_count, ctrl and err of THIS rank. After an error, every rank must
        reset, with a global barrier before and after (no kernel of any rank in flight)."""
        self.bufs.flags.zero_()
        self.bufs.recv_count.zero_()
        self.bufs.ctrl.zero_()
        self.bufs.err.zero_()
