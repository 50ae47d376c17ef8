"""Shim for the SM90 drop ``kernel_src/sm90/megamoe`` (package ``sm90_megamoe``).

What moe_ep relies on, declared as data (:data:`CONTRACT`), plus thin wrappers:

* :func:`check_gemm_shapes` — validation with clear errors before anything compiles;
* :func:`grouped_gemm` — the compiled varlen-M grouped GEMM from :data:`COMPILE_CACHE`, keyed by
  every contract-relevant value (never by routing: M_total and expert offsets are runtime);
* :func:`compile_gemm_ptx` — compile for an arch without a GPU (CPU tests inspect the PTX).

Counter contract (:data:`GEMM_COUNTERS`, :data:`EP_COUNTERS`): the grouped GEMM keeps no state
between launches (its tile scheduler reads the device-side offsets afresh every launch). The EP
kernels are tail-clean: their flags carry a per-forward epoch that only moves forward (a receiver
waits for ``flag == epoch``, so stale flags never match), and the only counters that return to a
value, the local CTA-arrival counters ``ctrl[1]``/``ctrl[2]``, are reset to 0 by the last CTA of
their kernel. Nothing is zeroed before a launch; ``tests/test_ep_gpu*.py`` prove it with 100
consecutive forwards on changing routing. After a device-side error (timeout, capacity) every
rank resets its EP state (:meth:`EpSession.reset`) between two barriers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..cache import COMPILE_CACHE, ensure_not_capturing
from ..constants import MirroredConstants
from ..contract import CallableUse, DropContract, ImportUse
from ..errors import DeviceStallError
from ..nvshmem_boot import CounterContract

PKG = "sm90_megamoe"

CONSTANTS = MirroredConstants("sm90/megamoe", {
    "sm90_megamoe": {"DROP_VERSION": 3},
    "sm90_megamoe.constants": {
        "ABI_VERSION": 1,
        "ACTIVATIONS": ("identity", "swiglu", "squared_relu"),
        "ALIGN_K_ELEMS": 8,
        "ALIGN_N_ELEMS": 8,
        "DEFAULT_TILE_N": {"identity": 256, "squared_relu": 256, "swiglu": 128},
        "MAX_EXPERTS": 1024,
    },
    "sm90_megamoe.ep_constants": {
        "EP_ABI_VERSION": 1,
        "EP_NUM_PEER_BUFS": 6,
        "EP_CTRL_LEN": 4,
        "EP_ERR_LEN": 4,
        "ERR_CODE": 0, "ERR_PEER": 1, "ERR_WHERE": 2, "ERR_AUX": 3,
        "ERR_NONE": 0, "ERR_TIMEOUT": 1, "ERR_CAPACITY": 2,
        "EP_MAX_WORLD": 32,
        "EP_MAX_TOPK": 32,
        "EP_ALIGN_H_ELEMS": 8,
    },
})

CONTRACT = DropContract(
    arch="sm90", drop="megamoe", version=3, packages=(PKG,), constants=CONSTANTS,
    callables=(
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.__init__",
                    ("activation", "n", "k", "num_experts", "scale_rows", "tile_n")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.__call__",
                    ("a", "b", "offsets", "out", "row_scale", "max_active_ctas")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.launch_converted", ("args", "max_active_ctas")),
        CallableUse("sm90_megamoe.launch:to_cute_args", ("a", "b", "c", "offsets", "row_scale")),
        CallableUse("sm90_megamoe.compile_check:compile_for_arch",
                    ("activation", "n", "k", "scale_rows", "arch", "num_experts", "tile_n")),
        CallableUse("sm90_megamoe.ep_launch:EpConfig.__init__",
                    ("hidden", "topk", "world", "max_tokens", "num_experts")),
        CallableUse("sm90_megamoe.ep_launch:EpBuffers.allocate", ("cfg", "device", "symmetric_alloc")),
        CallableUse("sm90_megamoe.ep_launch:build_peer_table", ("peer_buffers", "device")),
        CallableUse("sm90_megamoe.ep_launch:get_kernel", ("kind", "cfg")),
        CallableUse("sm90_megamoe.ep_launch:make_kernel", ("kind", "cfg")),
        CallableUse("sm90_megamoe.ep_launch:fake_args", ("kind", "cfg")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.__init__",
                    ("cfg", "rank", "bufs", "peer_table", "num_ctas", "timeout_ns")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.dispatch", ("x", "topk_ids", "topk_w")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.wait", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.gather", ("src", "idx", "count", "out")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.combine_send", ("y", "pos")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.combine_reduce", ("topk_ids", "out")),
        CallableUse("sm90_megamoe.layout_launch:LayoutConfig.__init__",
                    ("hidden", "topk", "world", "max_tokens", "local_experts")),
        CallableUse("sm90_megamoe.layout_launch:Layout.__init__", ("cfg", "device", "num_ctas", "count_ctas")),
        CallableUse("sm90_megamoe.layout_launch:Layout.__call__",
                    ("recv_ids", "recv_w", "recv_count", "recv_x", "offsets", "idx", "ws", "pos", "xs", "check")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.read_err", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.reset_state", ()),
    ),
    imports=(
        ImportUse("sm90_megamoe.ep_launch", "EpRank", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.ep_launch", "KINDS", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.launch", "CompiledGroupedGemm", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.compile_check", "compile_for_arch", "shim/drops/sm90_megamoe.py"),
    ),
    consumers=("shim/drops/sm90_megamoe.py",),
)

CONSTANTS.activate = CONTRACT.activate

# mirrored values the validation below uses (checked against the drop at first compile)
_C = CONSTANTS.table["sm90_megamoe.constants"]
GEMM_ACTIVATIONS = _C["ACTIVATIONS"]


def _load(module: str) -> Any:
    CONTRACT.activate()
    CONSTANTS.ensure_checked()
    return importlib.import_module(module)


def check_gemm_shapes(activation: str, n: int, k: int, num_experts: int, tile_n: int | None = None) -> None:
    """Raise ``ValueError`` when the SM90 grouped GEMM cannot take these static shapes.

    ``n`` = rows of the weight (2·I for swiglu), ``k`` = reduction size.
    """
    if activation not in GEMM_ACTIVATIONS:
        raise ValueError(f"sm90 grouped GEMM: activation {activation!r} not in {GEMM_ACTIVATIONS}")
    if k % _C["ALIGN_K_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: K={k} must be a multiple of {_C['ALIGN_K_ELEMS']} (16-byte TMA rows)")
    if num_experts > _C["MAX_EXPERTS"]:
        raise ValueError(f"sm90 grouped GEMM: {num_experts} experts per launch, at most {_C['MAX_EXPERTS']}")
    tile = tile_n or _C["DEFAULT_TILE_N"][activation]
    if activation == "swiglu":
        if n % 2:
            raise ValueError(f"sm90 grouped GEMM: swiglu needs an even w13 row count (2·I), got {n}")
        if (n // 2) % tile:
            raise ValueError(f"sm90 grouped GEMM: swiglu needs intermediate I={n // 2} to be a multiple of "
                             f"the output tile {tile} (gate and up tiles meet in one CTA)")
    elif n % _C["ALIGN_N_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: N={n} must be a multiple of {_C['ALIGN_N_ELEMS']}")


@dataclass(frozen=True)
class GemmKey:
    """Every value the compiled grouped GEMM depends on."""

    drop_version: int
    abi_version: int
    cutlass_version: str
    arch: str
    dtype: str
    activation: str
    n: int
    k: int
    num_experts: int
    scale_rows: bool
    tile_n: int


def _cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover
        return "unknown"


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 tile_n: int | None = None) -> Any:
    """The compiled grouped GEMM (cached). Call it as ``fn(a, b, offsets, out=..., row_scale=...)``:

    a ``[M_total, k]`` bf16, b ``[num_experts, n, k]`` bf16, offsets ``[num_experts+1]`` int32
    (device), out ``[M_total, n_out]`` bf16 (``n_out`` = n/2 for swiglu), row_scale ``[M_total]``
    float32 when ``scale_rows``.
    """
    check_gemm_shapes(activation, n, k, num_experts, tile_n)
    tile = tile_n or _C["DEFAULT_TILE_N"][activation]
    key = GemmKey(CONSTANTS.value(PKG, "DROP_VERSION"), _C["ABI_VERSION"], _cutlass_version(), "sm_90a",
                  "bf16", activation, n, k, num_experts, bool(scale_rows), tile)

    def build():
        launch = _load("sm90_megamoe.launch")
        return GemmRunner(launch.CompiledGroupedGemm(activation=activation, n=n, k=k, num_experts=num_experts,
                                                     scale_rows=bool(scale_rows), tile_n=tile), launch.to_cute_args)

    return COMPILE_CACHE.get_or_compile(key, build)


class GemmRunner:
    """A compiled grouped GEMM plus a small cache of converted (CuTe) arguments.

    Converting five torch tensors costs ~100 µs of host time per launch; layers pass the same
    persistent buffers every forward, so the conversion is looked up by (pointer, shape) instead.
    The cache keeps the last few argument sets alive (the DLPack capsules hold references), so a
    cached address cannot be recycled while it is cached.
    """

    _MAX = 16

    def __init__(self, compiled: Any, to_cute_args: Any) -> None:
        self.compiled = compiled
        self.scale_rows = compiled.scale_rows
        self._to = to_cute_args
        self._args: dict = {}
        self._dummy = None

    def __call__(self, a, b, offsets, out=None, row_scale=None, max_active_ctas=None):
        if out is None or a.shape[0] == 0:
            return self.compiled(a, b, offsets, out=out, row_scale=row_scale, max_active_ctas=max_active_ctas)
        if self.scale_rows:
            if row_scale is None:
                raise ValueError("this grouped GEMM was compiled with scale_rows=True: pass row_scale")
        else:
            if self._dummy is None or self._dummy.device != a.device:
                import torch

                self._dummy = torch.zeros(1, dtype=torch.float32, device=a.device)
            row_scale = self._dummy
        ts = (a, b, out, offsets, row_scale)
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in ts)
        args = self._args.get(key)
        if args is None:
            if len(self._args) >= self._MAX:
                self._args.pop(next(iter(self._args)))
            args = self._args[key] = self._to(a=a, b=b, c=out, offsets=offsets, row_scale=row_scale)
        self.compiled.launch_converted(args=args, max_active_ctas=max_active_ctas)
        return out


def compile_gemm_ptx(activation: str, n: int, k: int, scale_rows: bool, arch: str = "sm_90a",
                     num_experts: int = 128) -> str:
    """Compile without a GPU (fake tensors, dynamic M_total) and return the PTX text."""
    check_gemm_shapes(activation, n, k, num_experts)
    cc = _load("sm90_megamoe.compile_check")
    compiled = cc.compile_for_arch(activation=activation, n=n, k=k, scale_rows=scale_rows, arch=arch,
                                   num_experts=num_experts, tile_n=None)
    return compiled.__ptx__


GEMM_COUNTERS = CounterContract("sm90_megamoe grouped GEMM", tail_clean=True)
EP_COUNTERS = CounterContract("sm90_megamoe EP dispatch/combine", tail_clean=True)
_E = CONSTANTS.table["sm90_megamoe.ep_constants"]
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


def check_ep_shapes(hidden: int, topk: int, world: int, num_experts: int) -> None:
    if hidden % _E["EP_ALIGN_H_ELEMS"]:
        raise ValueError(f"sm90 EP: hidden={hidden} must be a multiple of {_E['EP_ALIGN_H_ELEMS']}")
    if not 1 <= topk <= _E["EP_MAX_TOPK"]:
        raise ValueError(f"sm90 EP: top_k={topk} must be in [1, {_E['EP_MAX_TOPK']}]")
    if not 1 <= world <= _E["EP_MAX_WORLD"]:
        raise ValueError(f"sm90 EP: world size {world} must be in [1, {_E['EP_MAX_WORLD']}]")
    if num_experts % world:
        raise ValueError(f"sm90 EP: num_experts={num_experts} must be a multiple of the world size {world}")


class EpSession:
    """One rank's EP state on the SM90 drop: symmetric buffers, peer table, compiled kernels.

    Buffers (S = W·T_max slots): ``recv_x [S, H]`` bf16, ``recv_ids [S, K]`` int32, ``recv_w
    [S, K]`` f32, ``recv_count [W]`` int32, ``flags [2W]`` int64, ``comb [S, H]`` bf16 — symmetric
    (NVSHMEM for W > 1, plain device memory for W == 1); ``ctrl``/``err`` local.
    Launch methods (``dispatch``, ``wait``, ``gather``, ``combine_send``, ``combine_reduce``) never
    synchronise the host; :meth:`check` does (it reads the error word).
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                 rank: int, device: Any, runtime: Any = None, global_ranks: tuple = (),
                 num_ctas: int | None = None, timeout_ns: int | None = None, virtual: bool = False) -> None:
        """``runtime``: the NVSHMEM runtime (W > 1 on real GPUs). ``virtual=True``: one of W
        virtual ranks in this process (plain device buffers); call :meth:`connect` with every
        virtual rank's session once all are built."""
        check_ep_shapes(hidden, topk, world, num_experts)
        if world > 1 and runtime is None and not virtual:
            raise ValueError("sm90 EP over more than one rank needs an NVSHMEM runtime (or virtual=True)")
        ensure_not_capturing("EP buffer allocation")
        el = self._el = _load("sm90_megamoe.ep_launch")
        cfg = self.cfg = el.EpConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                                     num_experts=num_experts)
        key = EpKey(CONSTANTS.value(PKG, "DROP_VERSION"), _E["EP_ABI_VERSION"], _cutlass_version(), "sm_90a",
                    hidden, topk, world, max_tokens, num_experts)
        COMPILE_CACHE.get_or_compile(key, lambda: {k: el.get_kernel(kind=k, cfg=cfg) for k in el.KINDS})
        self.world, self.rank, self.runtime, self.device = world, rank, runtime, device
        self.global_ranks = tuple(global_ranks) or tuple(range(world))
        self._num_ctas, self._timeout_ns = num_ctas, timeout_ns
        alloc = None if runtime is None else (lambda shape, dtype: runtime.tensor(shape, dtype))
        self.bufs = el.EpBuffers.allocate(cfg=cfg, device=device, symmetric_alloc=alloc)
        self.ep = None
        if runtime is not None:
            sym = self.bufs.symmetric()
            self._connect([{n: (t if r == rank else runtime.ops.peer(t, r)) for n, t in sym.items()}
                           for r in range(world)])
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
        kw = {}
        if self._timeout_ns is not None:
            kw["timeout_ns"] = int(self._timeout_ns)
        self.ep = el.EpRank(cfg=self.cfg, rank=self.rank, bufs=self.bufs, peer_table=self.peer_table,
                            num_ctas=self._num_ctas, **kw)
        self.dispatch = self.ep.dispatch
        self.wait = self.ep.wait
        self.gather = self.ep.gather
        self.combine_send = self.ep.combine_send
        self.combine_reduce = self.ep.combine_reduce

    def check(self) -> None:
        """Raise :class:`DeviceStallError` (timeout) or ``ValueError`` (capacity) if a kernel of
        this rank set its error word. Synchronises the host."""
        code, peer, where, aux = self.ep.read_err()
        if code == _E["ERR_TIMEOUT"]:
            g = self.global_ranks[peer] if 0 <= peer < len(self.global_ranks) else peer
            raise DeviceStallError(
                f"EP rank {self.rank}: timed out in {_WHERE.get(where, where)} waiting for rank {peer} "
                f"(global rank {g}) at forward {aux}; that rank stalled or did not call forward. "
                "Every rank must call reset_error_state() (collective) before the next forward")
        if code == _E["ERR_CAPACITY"]:
            raise ValueError(f"EP rank {self.rank}: {aux} tokens exceed the receive capacity "
                             f"(max_tokens_per_rank); nothing was written")
        if code:
            raise RuntimeError(f"EP rank {self.rank}: device error word {(code, peer, where, aux)}")

    def reset(self) -> None:
        """Zero this rank's flags, counters and error word (collective: barrier before and after)."""
        self.ep.reset_state()

    def free(self) -> None:
        if self.runtime is not None and self.runtime.alive:
            for t in reversed(list(self.bufs.symmetric().values())):
                self.runtime.free(t)
        self.bufs = self.ep = None


def compile_ep_ptx(kind: str, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                   arch: str = "sm_90a") -> str:
    """Compile one EP kernel (``dispatch``, ``wait``, ``gather``, ``combine_send``,
    ``combine_reduce``) without a GPU and return its PTX (writes PTX files into the cwd)."""
    check_ep_shapes(hidden, topk, world, num_experts)
    el = _load("sm90_megamoe.ep_launch")
    import cutlass.cute as cute

    cfg = el.EpConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens, num_experts=num_experts)
    compiled = cute.compile(el.make_kernel(kind, cfg), *el.fake_args(kind, cfg),
                            options=f"--gpu-arch {arch} --keep-ptx")
    return compiled.__ptx__


@dataclass(frozen=True)
class LayoutKey:
    """Every value the compiled expert-layout kernels depend on."""

    drop_version: int
    cutlass_version: str
    arch: str
    hidden: int
    topk: int
    world: int
    max_tokens: int
    local_experts: int


class LayoutSession:
    """Receiver-side expert layout in two launches (count+scan, place+gather), owning its
    scratch. Tail-clean: the count kernel's last CTA returns counts and its arrival counter to 0;
    cursors are rewritten every call before use. Calls must be ordered on one stream.

    ``__call__(recv_ids [S,K] i32, recv_w [S,K] f32, recv_count [W] i32, recv_x [S,H] bf16,
    offsets [E_l+1] i32, idx [S·K] i32, ws [S·K] f32, pos [S,K] i32, xs [S·K,H] bf16)``.
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, local_experts: int, device: Any,
                 num_ctas: int | None = None) -> None:
        ensure_not_capturing("layout scratch allocation")
        ll = _load("sm90_megamoe.layout_launch")
        cfg = ll.LayoutConfig(hidden=hidden, topk=topk, world=world, max_tokens=max_tokens,
                              local_experts=local_experts)
        key = LayoutKey(CONSTANTS.value(PKG, "DROP_VERSION"), _cutlass_version(), "sm_90a", hidden, topk, world,
                        max_tokens, local_experts)
        self._layout = COMPILE_CACHE.get_or_compile(
            key, lambda: ll.Layout(cfg=cfg, device=device, num_ctas=num_ctas, count_ctas=num_ctas))
        self._checked = False

    def __call__(self, recv_ids, recv_w, recv_count, recv_x, offsets, idx, ws, pos, xs) -> None:
        # argument checks on the first call only (they cost host time)
        self._layout(recv_ids=recv_ids, recv_w=recv_w, recv_count=recv_count, recv_x=recv_x, offsets=offsets,
                     idx=idx, ws=ws, pos=pos, xs=xs, check=not self._checked)
        self._checked = True
