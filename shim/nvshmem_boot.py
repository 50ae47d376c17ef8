"""NVSHMEM bootstrap over a torch.distributed process group, symmetric tensors, counter zeroing.

One NVSHMEM runtime exists per process. :func:`acquire` initialises it on first use (rank 0 of
the group creates a unique id, it is broadcast over the group with ``torch.distributed``, every
rank calls ``nvshmem.core.init(..., initializer_method="uid")``) and hands out a reference;
:meth:`NvshmemRuntime.release` drops one, and the last release frees every symmetric tensor this
runtime allocated and finalises NVSHMEM. moe_ep refuses to share an NVSHMEM runtime that somebody
else initialised (their finalize would pull our symmetric heap away), and refuses a second group.

Re-initialising NVSHMEM after a finalize is not supported by every NVSHMEM version: a process
that creates and destroys layers repeatedly should hold one reference of its own
(``acquire(...)`` at start, ``release()`` at exit) so the runtime is initialised once.

All real NVSHMEM calls go through a small ops object, so the ownership and reference-counting
logic is unit-tested on machines without a GPU (tests pass a fake ops object).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .cache import ensure_not_capturing
from .errors import NvshmemOwnershipError


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


def broadcast_bytes(raw: bytes | None, size: int, group: Any, device: Any) -> bytes:
    """Broadcast ``size`` bytes from group rank 0 to the group (``raw`` is ignored elsewhere)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if raw is not None:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


@dataclass(frozen=True)
class GroupIdentity:
    """Which ranks an NVSHMEM runtime spans: global ranks in NVSHMEM PE order."""

    global_ranks: tuple[int, ...]

    @property
    def nranks(self) -> int:
        return len(self.global_ranks)


class NvshmemRuntime:
    """Reference-counted handle on the process's NVSHMEM runtime (see module docstring)."""

    def __init__(self, ops: NvshmemOps, identity: GroupIdentity, rank: int) -> None:
        self.ops = ops
        self.identity = identity
        self.rank = rank  # PE index = rank within the group
        self.refs = 0
        self.alive = True
        self._tensors: list[Any] = []

    @property
    def nranks(self) -> int:
        return self.identity.nranks

    def tensor(self, shape: Sequence[int], dtype: Any) -> Any:
        """Collective: allocate a symmetric tensor (same order and sizes on every rank)."""
        self._check_alive()
        ensure_not_capturing("a symmetric-memory allocation")
        t = self.ops.tensor(shape, dtype)
        self._tensors.append(t)
        return t

    def free(self, t: Any) -> None:
        """Collective: free a symmetric tensor allocated by :meth:`tensor`."""
        self._check_alive()
        for i, u in enumerate(self._tensors):
            if u is t:
                del self._tensors[i]
                self.ops.free(t)
                return
        raise ValueError("free(): tensor was not allocated by this NVSHMEM runtime")

    def peers(self, t: Any) -> list[Any]:
        """``t`` as seen from this rank on every PE (index = PE); ``peers(t)[self.rank]`` is ``t``."""
        self._check_alive()
        return [t if pe == self.rank else self.ops.peer(t, pe) for pe in range(self.nranks)]

    def barrier(self, stream: Any) -> None:
        self._check_alive()
        self.ops.barrier(stream)

    def release(self) -> None:
        """Drop one reference; the last one frees all symmetric tensors and finalises NVSHMEM."""
        with _LOCK:
            if not self.alive or self.refs <= 0:
                raise RuntimeError("NVSHMEM runtime released more often than acquired")
            self.refs -= 1
            if self.refs == 0:
                for t in reversed(self._tensors):
                    self.ops.free(t)
                self._tensors.clear()
                self.ops.finalize()
                self.alive = False
                global _RUNTIME
                _RUNTIME = None

    def _check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError("NVSHMEM runtime was finalised (its last reference was released)")


_LOCK = threading.RLock()
_RUNTIME: NvshmemRuntime | None = None


def current() -> NvshmemRuntime | None:
    """The live runtime moe_ep owns in this process, or None."""
    return _RUNTIME


def acquire(group: Any = None, *, device_index: int | None = None, ops: NvshmemOps | None = None,
            group_info: tuple[int, Sequence[int]] | None = None,
            uid_exchange: Any = None) -> NvshmemRuntime:
    """Collective on ``group``: get (initialising on first use) the process's NVSHMEM runtime.

    Args:
        group: torch.distributed process group (None = the default group).
        device_index: CUDA device this process drives (default: ``torch.cuda.current_device()``).
        ops, group_info, uid_exchange: test seams (fake NVSHMEM ops; ``(rank, global_ranks)``;
            ``fn(raw_or_None, size) -> bytes`` replacing the torch.distributed broadcast).
    Raises:
        NvshmemOwnershipError: NVSHMEM is already initialised by someone else, or moe_ep's
            runtime spans a different group.
    """
    global _RUNTIME
    ops = ops or NvshmemOps()
    if group_info is None:
        import torch.distributed as dist

        rank = dist.get_rank(group)
        global_ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    else:
        rank, global_ranks = group_info[0], tuple(group_info[1])
    ident = GroupIdentity(tuple(global_ranks))
    with _LOCK:
        if _RUNTIME is not None:
            if _RUNTIME.identity != ident:
                raise NvshmemOwnershipError(
                    f"moe_ep's NVSHMEM runtime spans global ranks {_RUNTIME.identity.global_ranks}; "
                    f"a second group {ident.global_ranks} cannot share it (one NVSHMEM job per process)")
            _RUNTIME.refs += 1
            return _RUNTIME
        if ops.status_initialized():
            raise NvshmemOwnershipError(
                "NVSHMEM is already initialised in this process by another library (e.g. a peer "
                "MoE library or the application); moe_ep owns its NVSHMEM runtime and will not "
                "share one it did not create. Run the other library in a separate process.")
        ensure_not_capturing("NVSHMEM initialisation")
        uid = ops.make_uid(root=(rank == 0))
        raw = ops.uid_to_bytes(uid)
        if uid_exchange is not None:
            raw = uid_exchange(raw if rank == 0 else None, len(raw))
        else:
            import torch

            if device_index is None:
                device_index = torch.cuda.current_device()
            raw = broadcast_bytes(raw if rank == 0 else None, len(raw), group,
                                  torch.device("cuda", device_index))
        if device_index is None:
            device_index = 0
        ops.init(device_index, ops.uid_from_bytes(raw), rank, ident.nranks)
        _RUNTIME = NvshmemRuntime(ops, ident, rank)
        _RUNTIME.refs = 1
        return _RUNTIME


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
