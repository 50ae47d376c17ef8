"""NVSHMEM bootstrap over a torch.distributed process group, symmetric tensors, counter zeroing.

One NVSHMEM runtime exists per process. :func:`acquire` initialises it on first use and hands out
a reference; :meth:`NvshmemRuntime.release` drops one, and the last release frees every symmetric
tensor this runtime allocated and finalises NVSHMEM. moe_ep refuses to share an NVSHMEM runtime
that somebody else initialised (their finalize would pull our symmetric heap away), and refuses a
second group.

Bootstrap protocol (collective on the group; it cannot hang or half-fail on a local error):

1. every rank computes a local verdict without communicating: ownership (NVSHMEM initialised by
   somebody else, or moe_ep's runtime spans another group), CUDA-graph capture, the symmetric heap
   size (below), the device, and the unique id (rank 0 creates it);
2. ONE collective (``all_gather_object`` on the group) exchanges the verdicts;
3. if any rank failed, EVERY rank raises the same error, naming the failing ranks and their
   messages; only then are the uid broadcast and ``nvshmem.core.init(..., "uid")`` run.

Error types after agreement (identical on every rank): when every failure is an ownership failure,
:class:`AgreedOwnershipError` (both a :class:`NvshmemOwnershipError` and a :class:`BootstrapError`);
when every failure is a heap-size failure, :class:`AgreedHeapError` (both a
:class:`SymmetricHeapError` and a :class:`BootstrapError`); otherwise a plain
:class:`BootstrapError`. Catch the base types; ``err.failures`` maps group rank -> message.
``nvshmem.core.init`` itself is the one step that cannot be agreed on beforehand (it IS the
collective): a rank whose init raises reports a :class:`BootstrapError` saying so.

The module lock guards the runtime record only; it is never held across a collective (verdict
exchange, uid broadcast, init, symmetric malloc/free, barrier, finalize). Bootstraps and finalizes
within one process are serialised by a "busy" flag waited on with the lock released.

Symmetric heap: NVSHMEM reserves ``NVSHMEM_SYMMETRIC_SIZE`` bytes (default 1 GiB) at init and
cannot grow it. ``acquire(heap_bytes=n)`` sets it, when the user has not, to
:func:`heap_size_for` ``(n)`` = ``max(1 GiB, n + n/4 + 64 MiB)`` rounded up to 2 MiB (the quarter
and 64 MiB leave room for a somewhat larger later layer and small allocations), agreeing on the
largest value over the ranks; a user value is parsed (:func:`parse_size`, NVSHMEM's syntax) and
must fit ``n`` and be equal on every rank. The runtime counts what :meth:`NvshmemRuntime.tensor`
allocates (:func:`heap_cost`: rounded up, plus a per-allocation overhead) and
:meth:`NvshmemRuntime.ensure_heap` raises :class:`SymmetricHeapError` with the value to set instead
of NVSHMEM failing obscurely.

Re-initialising NVSHMEM after a finalize is not supported by every NVSHMEM version: a process
that creates and destroys layers repeatedly should hold one reference of its own
(``acquire(...)`` at start, ``release()`` at exit) so the runtime is initialised once.

All real NVSHMEM calls go through a small ops object, and the verdict exchange and uid broadcast
are replaceable callables, so this logic is unit-tested on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

from .cache import ensure_not_capturing
from .errors import BootstrapError, NvshmemOwnershipError, SymmetricHeapError

SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"
DEFAULT_HEAP_BYTES = 1 << 30  # NVSHMEM's own default, and our floor
HEAP_SLACK_BYTES = 64 << 20
HEAP_GRANULE = 2 << 20  # NVSHMEM maps its heap in 2 MiB pages; sizes we set are multiples
HEAP_ALLOC_ALIGN = 512  # every allocation is counted rounded up to this ...
HEAP_ALLOC_OVERHEAD = 1024  # ... plus this (allocator metadata / alignment padding; generous)


# ---- sizes ---------------------------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(?:([kKmMgGtT])(?:[iI]?[bB])?)?$")
_SCALE = {"k": 10, "m": 20, "g": 30, "t": 40}


def parse_size(text: str) -> int:
    """Bytes meant by an NVSHMEM size string such as ``NVSHMEM_SYMMETRIC_SIZE``.

    Accepts what NVSHMEM accepts in practice: a non-negative number (decimals and exponents
    allowed) optionally followed by ``k``/``m``/``g``/``t`` (powers of 1024, any case), optionally
    followed by ``B`` or ``iB`` (``512M``, ``2G``, ``1GB``, ``1.5GiB``, ``1073741824``); the
    result is rounded up to whole bytes, as NVSHMEM does. Raises ValueError otherwise (a bare
    ``B`` suffix, a space before the suffix, negative numbers and trailing text are rejected:
    NVSHMEM rejects or misreads them).
    """
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a size: use bytes or a number with a K/M/G/T suffix "
                         "(e.g. 1073741824, 512M, 2G)")
    value = Fraction(m.group(1)) * (1 << _SCALE[m.group(2).lower()] if m.group(2) else 1)
    return math.ceil(value)


def heap_size_for(heap_bytes: int | None) -> int:
    """The ``NVSHMEM_SYMMETRIC_SIZE`` moe_ep sets when the user has not: at least
    :data:`DEFAULT_HEAP_BYTES`, else ``heap_bytes + heap_bytes // 4 + 64 MiB``, rounded up to
    2 MiB. ``heap_bytes``: the symmetric bytes the caller is about to allocate (None: unknown)."""
    need = 0 if heap_bytes is None else heap_bytes + heap_bytes // 4 + HEAP_SLACK_BYTES
    size = max(DEFAULT_HEAP_BYTES, need)
    return -(-size // HEAP_GRANULE) * HEAP_GRANULE


def heap_cost(nbytes: int) -> int:
    """Heap bytes counted for one allocation of ``nbytes``: rounded up to 512 plus 1 KiB."""
    return -(-int(nbytes) // HEAP_ALLOC_ALIGN) * HEAP_ALLOC_ALIGN + HEAP_ALLOC_OVERHEAD


def _fmt(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


def _advice(total: int) -> str:
    return (f"set {SIZE_ENV}={heap_size_for(total) >> 20}M (or more) in the environment of every rank "
            "before the first layer is built")


# ---- real NVSHMEM calls --------------------------------------------------------------------------
class NvshmemOps:
    """The real NVSHMEM calls (nvshmem4py, host side)."""

    def status_initialized(self) -> bool:
        try:
            import nvshmem.core as nvshmem
            from cuda.pathfinder import load_nvidia_dynamic_lib

            load_nvidia_dynamic_lib("nvshmem_host")
            return int(nvshmem.init_status()) >= 2  # STATUS_IS_INITIALIZED or more
        except Exception:  # library not loadable: nobody can have initialised it
            return False

    def check_device(self, device_index: int) -> None:
        """Raise unless ``device_index`` names a usable CUDA device (checked before agreement, so
        a bad device fails every rank instead of stranding the others inside init)."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available in this process; NVSHMEM needs a GPU")
        n = torch.cuda.device_count()
        if not 0 <= device_index < n:
            raise RuntimeError(f"device_index {device_index} is not one of this process's {n} CUDA devices")

    def make_uid(self, root: bool) -> Any:
        import nvshmem.core as nvshmem

        return nvshmem.get_unique_id(empty=not root)

    def uid_to_bytes(self, uid: Any) -> bytes:
        return bytes(memoryview(uid._data).cast("B"))

    def uid_from_bytes(self, raw: bytes) -> Any:
        import numpy as np
        from nvshmem.bindings import nvshmem as nb

        return nb.uniqueid.from_data(np.frombuffer(raw, dtype=nb.uniqueid_dtype))

    def init(self, device_index: int, uid: Any, rank: int, nranks: int) -> None:
        import nvshmem.core as nvshmem
        from cuda.core import Device

        dev = Device(device_index)
        dev.set_current()
        nvshmem.init(device=dev, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")

    def finalize(self) -> None:
        import nvshmem.core as nvshmem

        nvshmem.finalize()

    def tensor(self, shape: Sequence[int], dtype: Any) -> Any:
        import nvshmem.core as nvshmem

        return nvshmem.tensor(tuple(shape), dtype=dtype)

    def free(self, t: Any) -> None:
        import nvshmem.core as nvshmem

        nvshmem.free_tensor(t)

    def peer(self, t: Any, pe: int) -> Any:
        import nvshmem.core as nvshmem

        return nvshmem.get_peer_tensor(t, pe)

    def barrier(self, stream: Any) -> None:
        import nvshmem.core as nvshmem

        nvshmem.barrier_all(stream=stream)


# ---- collectives on the torch.distributed group --------------------------------------------------
def _collective_device(group: Any, device_index: int | None) -> Any:
    """Where a torch.distributed collective on ``group`` needs its tensors: the GPU for NCCL, the
    CPU otherwise (gloo, or a mixed ``cpu:gloo,cuda:nccl`` group)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)
    return torch.device("cpu")


def broadcast_bytes(raw: bytes | None, size: int, group: Any, device: Any) -> bytes:
    """Broadcast ``size`` bytes from group rank 0 to the group (``raw`` is ignored elsewhere);
    ``device``: where the staging tensor lives (CUDA for NCCL, CPU for gloo)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if raw is not None:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


@dataclass(frozen=True)
class BootVerdict:
    """One rank's answer before the NVSHMEM bootstrap (exchanged as a dict over the group).

    rank: group rank; error: None when this rank can go ahead, else why not; kind: "ownership",
    "heap" or "other"; attach: moe_ep's runtime already exists here (no init); global_ranks: the
    group as this rank sees it; heap_bytes: the heap size this rank would initialise with (the
    live heap's size when attaching); heap_user: that size comes from the user's
    ``NVSHMEM_SYMMETRIC_SIZE``.
    """

    rank: int
    error: str | None = None
    kind: str | None = None
    attach: bool = False
    global_ranks: tuple[int, ...] = ()
    heap_bytes: int = 0
    heap_user: bool = False


def gather_verdicts(verdict: BootVerdict, group: Any, device_index: int | None = None) -> list[BootVerdict]:
    """The default verdict exchange: ``all_gather_object`` on ``group`` (gloo or NCCL; for NCCL
    on ``device_index``). Returns every rank's verdict in group-rank order."""
    import contextlib

    import torch
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    ctx = contextlib.nullcontext()
    if dist.get_backend(group) == "nccl" and device_index is not None:
        ctx = torch.cuda.device(device_index)  # NCCL object collectives use the current device
    with ctx:
        dist.all_gather_object(out, dataclasses.asdict(verdict), group=group)
    return [BootVerdict(**{**d, "global_ranks": tuple(d["global_ranks"])}) for d in out]


class AgreedOwnershipError(NvshmemOwnershipError, BootstrapError):
    """Every failing rank failed an ownership check; raised identically on every rank.
    ``failures``: group rank -> message."""

    failures: dict[int, str] = {}


class AgreedHeapError(SymmetricHeapError, BootstrapError):
    """Every failing rank failed a symmetric-heap check; raised identically on every rank.
    ``failures``: group rank -> message."""

    failures: dict[int, str] = {}


def _agreed(cls: type, message: str, failures: dict[int, str]) -> Exception:
    err = cls(message)
    err.failures = dict(failures)
    return err


@dataclass(frozen=True)
class GroupIdentity:
    """Which ranks an NVSHMEM runtime spans: global ranks in NVSHMEM PE order."""

    global_ranks: tuple[int, ...]

    @property
    def nranks(self) -> int:
        return len(self.global_ranks)


# ---- the runtime ---------------------------------------------------------------------------------
def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:  # not a torch dtype (e.g. a numpy one)
        import numpy as np

        itemsize = np.dtype(dtype).itemsize
    return math.prod(int(s) for s in shape) * int(itemsize)


class NvshmemRuntime:
    """Reference-counted handle on the process's NVSHMEM runtime (see module docstring).

    ``heap_bytes``: the symmetric heap size NVSHMEM was initialised with; ``heap_env``: the
    ``NVSHMEM_SYMMETRIC_SIZE`` string it read; ``allocated``: heap bytes counted for the live
    tensors of :meth:`tensor` (see :func:`heap_cost`).
    """

    def __init__(self, ops: NvshmemOps, identity: GroupIdentity, rank: int, *,
                 heap_bytes: int = DEFAULT_HEAP_BYTES, heap_env: str | None = None) -> None:
        self.ops = ops
        self.identity = identity
        self.rank = rank  # PE index = rank within the group
        self.refs = 0
        self.alive = True
        self.heap_bytes = int(heap_bytes)
        self.heap_env = heap_env
        self.allocated = 0
        self._tensors: list[tuple[Any, int]] = []  # (tensor, counted heap bytes)

    @property
    def nranks(self) -> int:
        return self.identity.nranks

    @property
    def heap_free(self) -> int:
        """Heap bytes not counted against a live tensor."""
        return max(0, self.heap_bytes - self.allocated)

    def ensure_heap(self, nbytes: int, what: str = "a symmetric allocation") -> None:
        """Raise :class:`SymmetricHeapError` unless ``nbytes`` more (counted with
        :func:`heap_cost`) fit in the heap. ``what``: named in the message (e.g. "layer 3's
        workspace"). Local check; every rank computes the same sizes."""
        need, free = heap_cost(nbytes), self.heap_free
        if free < need:
            raise SymmetricHeapError(
                f"NVSHMEM symmetric heap too small for {what}: it needs {_fmt(need)}, only {_fmt(free)} "
                f"are free of the {_fmt(self.heap_bytes)} heap ({_fmt(self.allocated)} in use by moe_ep; "
                f"{SIZE_ENV}={self.heap_env}); {_advice(self.allocated + need)}")

    def tensor(self, shape: Sequence[int], dtype: Any) -> Any:
        """Collective: allocate a symmetric tensor (same order and sizes on every rank)."""
        self._check_alive()
        ensure_not_capturing("a symmetric-memory allocation")
        nbytes = _nbytes(shape, dtype)
        with _LOCK:  # check and count in one step; the malloc itself (collective) runs unlocked
            self.ensure_heap(nbytes, f"a symmetric tensor of shape {tuple(shape)} and dtype {dtype}")
            cost = heap_cost(nbytes)
            self.allocated += cost
        try:
            t = self.ops.tensor(shape, dtype)
        except BaseException:
            with _LOCK:
                self.allocated -= cost
            raise
        with _LOCK:
            self._tensors.append((t, cost))
        return t

    def free(self, t: Any) -> None:
        """Collective: free a symmetric tensor allocated by :meth:`tensor`."""
        self._check_alive()
        with _LOCK:
            entry = next((e for e in self._tensors if e[0] is t), None)
            if entry is None:
                raise ValueError("free(): tensor was not allocated by this NVSHMEM runtime")
        self.ops.free(t)  # collective: not under the lock
        with _LOCK:
            self._tensors = [e for e in self._tensors if e is not entry]
            self.allocated -= entry[1]

    def peers(self, t: Any) -> list[Any]:
        """``t`` as seen from this rank on every PE (index = PE); ``peers(t)[self.rank]`` is ``t``."""
        self._check_alive()
        return [t if pe == self.rank else self.ops.peer(t, pe) for pe in range(self.nranks)]

    def barrier(self, stream: Any) -> None:
        self._check_alive()
        self.ops.barrier(stream)

    def release(self) -> None:
        """Drop one reference; the last one frees all symmetric tensors and finalises NVSHMEM
        (collective then; it waits for a bootstrap in flight in this process)."""
        global _RUNTIME, _BUSY
        with _IDLE:
            self._check_releasable()
            while self.refs == 1 and _BUSY:  # an acquire in flight may still add a reference
                _IDLE.wait()
            self._check_releasable()
            self.refs -= 1
            if self.refs > 0:
                return
            tensors = [t for t, _ in reversed(self._tensors)]
            self._tensors.clear()
            self.allocated = 0
            self.alive = False
            if _RUNTIME is self:
                _RUNTIME = None
            _BUSY = True
        try:  # collectives: outside the lock
            for t in tensors:
                self.ops.free(t)
            self.ops.finalize()
        finally:
            with _IDLE:
                _BUSY = False
                _IDLE.notify_all()

    def _check_releasable(self) -> None:
        if not self.alive or self.refs <= 0:
            raise RuntimeError("NVSHMEM runtime released more often than acquired")

    def _check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError("NVSHMEM runtime was finalised (its last reference was released)")


_LOCK = threading.RLock()  # guards _RUNTIME, _BUSY and runtime counters; never held across a collective
_IDLE = threading.Condition(_LOCK)  # notified when a bootstrap or finalize in this process ends
_BUSY = False  # a bootstrap (acquire) or finalize is in flight in this process
_RUNTIME: NvshmemRuntime | None = None


def current() -> NvshmemRuntime | None:
    """The live runtime moe_ep owns in this process, or None."""
    return _RUNTIME


# ---- acquire -------------------------------------------------------------------------------------
def _resolve_group(group: Any, group_info: tuple[int, Sequence[int]] | None) -> tuple[int, tuple[int, ...]]:
    if group_info is not None:
        return int(group_info[0]), tuple(int(r) for r in group_info[1])
    import torch.distributed as dist

    return dist.get_rank(group), tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _plan_heap(heap_bytes: int | None) -> tuple[int, bool]:
    """(heap size to initialise with, whether the user chose it); raises SymmetricHeapError."""
    env = os.environ.get(SIZE_ENV, "")
    if not env.strip():  # unset or blank: ours to choose
        return heap_size_for(heap_bytes), False
    try:
        size = parse_size(env)
    except ValueError as e:
        raise SymmetricHeapError(f"{SIZE_ENV}={env!r} cannot be read: {e}") from None
    if heap_bytes is not None and heap_cost(heap_bytes) > size:
        raise SymmetricHeapError(
            f"{SIZE_ENV}={env} ({_fmt(size)}) is smaller than the {_fmt(heap_cost(heap_bytes))} of symmetric "
            f"memory moe_ep needs; {_advice(heap_bytes)}")
    return size, True


def _local_verdict(rt: NvshmemRuntime | None, ops: Any, ident: GroupIdentity, rank: int,
                   device_index: int | None, heap_bytes: int | None) -> tuple[BootVerdict, bytes | None, int | None]:
    """This rank's verdict, without communicating: (verdict, uid bytes, resolved device)."""
    v = BootVerdict(rank=rank, attach=rt is not None, global_ranks=ident.global_ranks)
    try:
        if heap_bytes is not None and (isinstance(heap_bytes, bool) or not isinstance(heap_bytes, int)
                                       or heap_bytes < 0):
            raise ValueError(f"heap_bytes must be a non-negative int or None, got {heap_bytes!r}")
        if rt is not None:
            if rt.identity != ident:
                raise NvshmemOwnershipError(
                    f"moe_ep's NVSHMEM runtime spans global ranks {rt.identity.global_ranks}; a second group "
                    f"{ident.global_ranks} cannot share it (one NVSHMEM job per process)")
            if heap_bytes is not None:
                rt.ensure_heap(heap_bytes, f"{heap_bytes} more bytes of symmetric memory")
            return dataclasses.replace(v, heap_bytes=rt.heap_bytes), None, device_index
        if ops.status_initialized():
            raise NvshmemOwnershipError(
                "NVSHMEM is already initialised in this process by another library (e.g. a peer "
                "MoE library or the application); moe_ep owns its NVSHMEM runtime and will not "
                "share one it did not create. Run the other library in a separate process.")
        ensure_not_capturing("NVSHMEM initialisation")
        heap, user = _plan_heap(heap_bytes)
        if device_index is None:
            import torch

            device_index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        check = getattr(ops, "check_device", None)  # optional on test fakes
        if check is not None:
            check(device_index)
        raw = ops.uid_to_bytes(ops.make_uid(root=(rank == 0)))
        return dataclasses.replace(v, heap_bytes=heap, heap_user=user), raw, device_index
    except NvshmemOwnershipError as e:
        return dataclasses.replace(v, error=str(e), kind="ownership"), None, device_index
    except SymmetricHeapError as e:
        return dataclasses.replace(v, error=str(e), kind="heap"), None, device_index
    except Exception as e:  # anything else that would strand the other ranks
        return dataclasses.replace(v, error=f"{type(e).__name__}: {e}", kind="other"), None, device_index


def _ranks(rs: Iterable[int], ident: GroupIdentity) -> str:
    rs = sorted(rs)
    glob = [ident.global_ranks[r] if 0 <= r < ident.nranks else "?" for r in rs]
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} (global {', '.join(map(str, glob))})"


def _settle(verdicts: Sequence[BootVerdict], ident: GroupIdentity) -> int:
    """Raise the agreed error if any rank failed or the ranks disagree; else the heap size to
    initialise with. Depends on ``verdicts`` only, so every rank reaches the same outcome."""
    where = f"NVSHMEM bootstrap over global ranks {ident.global_ranks}"
    if sorted(v.rank for v in verdicts) != list(range(ident.nranks)):
        raise BootstrapError(f"{where}: got verdicts from ranks {[v.rank for v in verdicts]}, "
                             f"expected one from each of {ident.nranks} ranks")
    failed = {v.rank: v for v in verdicts if v.error is not None}
    if failed:
        kinds = {v.kind for v in failed.values()}
        cls = (AgreedOwnershipError if kinds == {"ownership"} else
               AgreedHeapError if kinds == {"heap"} else BootstrapError)
        lines = "\n".join(f"  rank {r} (global {ident.global_ranks[r]}): {failed[r].error}" for r in sorted(failed))
        raise _agreed(cls, f"{where} failed on {_ranks(failed, ident)}; every rank raises this error:\n{lines}",
                      {r: failed[r].error for r in failed})
    if len({v.global_ranks for v in verdicts}) > 1:
        seen = "; ".join(f"rank {v.rank}: {v.global_ranks}" for v in verdicts)
        raise _agreed(BootstrapError, f"{where}: the ranks disagree on the group ({seen})", {})
    attach = {v.rank for v in verdicts if v.attach}
    if attach and len(attach) != len(verdicts):
        raise _agreed(BootstrapError, f"{where}: moe_ep's NVSHMEM runtime is live on {_ranks(attach, ident)} "
                      f"but not on the others (an earlier bootstrap or release was not collective)", {})
    if attach:
        return 0
    users = {v.rank for v in verdicts if v.heap_user}
    sizes = {v.heap_bytes for v in verdicts}
    if users and (len(users) != len(verdicts) or len(sizes) > 1):
        seen = "; ".join(f"rank {v.rank}: {v.heap_bytes if v.heap_user else 'unset'}" for v in verdicts)
        raise _agreed(BootstrapError, f"{where}: {SIZE_ENV} must be set to the same size on every rank or "
                      f"on none ({seen})", {})
    return max(sizes)


def acquire(group: Any = None, *, device_index: int | None = None, heap_bytes: int | None = None,
            ops: NvshmemOps | None = None, group_info: tuple[int, Sequence[int]] | None = None,
            uid_exchange: Callable[[bytes | None, int], bytes] | None = None,
            agree: Callable[[BootVerdict], Sequence[BootVerdict]] | None = None) -> NvshmemRuntime:
    """Collective on ``group``: get (initialising on first use) the process's NVSHMEM runtime.

    Every call exchanges one verdict per rank first (see module docstring), so a rank that cannot
    go ahead makes every rank raise instead of leaving them blocked.

    Args:
        group: torch.distributed process group (None = the default group).
        device_index: CUDA device this process drives (default: ``torch.cuda.current_device()``).
        heap_bytes: symmetric bytes the caller will allocate next (None: unknown). Sizes
            ``NVSHMEM_SYMMETRIC_SIZE`` at first init (:func:`heap_size_for`) or checks a user
            value; on a live runtime, checks that this much is still free.
        ops: NVSHMEM calls (test seam: a fake).
        group_info: ``(rank, global_ranks)`` instead of asking torch.distributed (test seam).
        uid_exchange: ``fn(raw_or_None, size) -> bytes`` replacing the torch.distributed uid
            broadcast from rank 0 (test seam).
        agree: ``fn(verdict) -> verdicts of all ranks`` replacing the all-gather on ``group``
            (test seam; by default skipped for a one-rank group).
    Raises:
        NvshmemOwnershipError (:class:`AgreedOwnershipError`): NVSHMEM is already initialised by
            someone else, or moe_ep's runtime spans a different group, on some rank.
        SymmetricHeapError (:class:`AgreedHeapError`): the heap is or would be too small, or
            ``NVSHMEM_SYMMETRIC_SIZE`` cannot be read, on some rank.
        BootstrapError: any other failure on some rank, the ranks disagree, or this rank's
            ``nvshmem.core.init`` raised. All but the last are raised identically on every rank.
    """
    global _RUNTIME, _BUSY
    ops = ops or NvshmemOps()
    rank, global_ranks = _resolve_group(group, group_info)
    ident = GroupIdentity(global_ranks)
    with _IDLE:
        while _BUSY:  # another thread's bootstrap/finalize; waiting releases the lock
            _IDLE.wait()
        _BUSY = True
        rt = _RUNTIME if _RUNTIME is not None and _RUNTIME.alive else None
    try:
        verdict, raw, device_index = _local_verdict(rt, ops, ident, rank, device_index, heap_bytes)
        if agree is None and ident.nranks == 1:
            verdicts: Sequence[BootVerdict] = [verdict]
        else:
            exchange = agree or (lambda v: gather_verdicts(v, group, device_index))
            try:
                verdicts = list(exchange(verdict))
            except Exception as e:
                raise BootstrapError(f"NVSHMEM bootstrap over global ranks {ident.global_ranks}: exchanging "
                                     f"verdicts failed on rank {rank}: {type(e).__name__}: {e}") from e
        heap = _settle(verdicts, ident)
        if rt is not None:
            with _LOCK:
                rt.refs += 1
            return rt
        if not verdict.heap_user:  # NVSHMEM reads it at init
            os.environ[SIZE_ENV] = str(heap)
        if uid_exchange is not None:
            raw = uid_exchange(raw if rank == 0 else None, len(raw))
        else:
            raw = broadcast_bytes(raw if rank == 0 else None, len(raw), group,
                                  _collective_device(group, device_index))
        try:
            ops.init(device_index, ops.uid_from_bytes(raw), rank, ident.nranks)
        except Exception as e:
            raise BootstrapError(f"NVSHMEM init failed on rank {rank} (global {ident.global_ranks[rank]}) after "
                                 f"every rank agreed to start: {type(e).__name__}: {e}; the other ranks may "
                                 f"be blocked in NVSHMEM's own bootstrap") from e
        new = NvshmemRuntime(ops, ident, rank, heap_bytes=heap, heap_env=os.environ.get(SIZE_ENV))
        new.refs = 1
        with _LOCK:
            _RUNTIME = new
        return new
    finally:
        with _IDLE:
            _BUSY = False
            _IDLE.notify_all()


@dataclass(frozen=True)
class CounterContract:
    """How a kernel's counters/flags are made ready for its next launch.

    ``tail_clean=True``: the kernel itself returns every counter to its initial value before it
    exits (proven by a many-consecutive-launches test); nothing is zeroed. Otherwise the named
    ``regions`` (keys of the buffers dict) are zeroed on the launch stream before every launch.
    """

    kernel: str
    tail_clean: bool
    regions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tail_clean and self.regions:
            raise ValueError(f"{self.kernel}: a tail-clean kernel lists no regions to zero")
        if not self.tail_clean and not self.regions:
            raise ValueError(f"{self.kernel}: a kernel that is not tail-clean must list its counter regions")

    def prepare(self, buffers: dict[str, Any]) -> None:
        """Zero the listed regions (stream-ordered ``zero_()``, no host sync, capturable)."""
        if self.tail_clean:
            return
        missing = [r for r in self.regions if r not in buffers]
        if missing:
            raise KeyError(f"{self.kernel}: counter regions {missing} not among buffers {sorted(buffers)}")
        zero_counter_regions(buffers[r] for r in self.regions)


def zero_counter_regions(regions: Iterable[Any]) -> None:
    """Zero each tensor in ``regions`` on the current stream (no sync, graph-capturable)."""
    for t in regions:
        t.zero_()
