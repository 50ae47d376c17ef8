"""In-memory compile cache and the CUDA-graph-capture guard.

``cute.compile`` never caches (each call re-traces, ~0.5 s for a GEMM), so every compiled kernel
goes through :class:`CompileCache`, keyed by a frozen dataclass that holds every value the
compiled code depends on (kernel, drop version, arch, dtypes, static shapes, tiles, activation,
cutlass-dsl version). Compiling or allocating symmetric memory while a CUDA graph is being
captured would either fail obscurely or bake a one-off allocation into the graph:
:func:`ensure_not_capturing` turns that into a clear error.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Hashable

from .errors import CaptureError


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False without CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def ensure_not_capturing(what: str) -> None:
    """Raise :class:`CaptureError` if a CUDA graph is being captured on the current stream."""
    if is_capturing():
        raise CaptureError(
            f"{what} was requested during CUDA-graph capture; call the layer's warmup() "
            "(which compiles and allocates) before capturing")


class CompileCache:
    """Thread-safe ``key -> compiled object`` map with hit/miss counters.

    Keys must be instances of frozen dataclasses, so that adding a contract-relevant field
    cannot be forgotten at one call site and remembered at another.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: dict[Hashable, Any] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _check_key(key: Any) -> None:
        if not (dataclasses.is_dataclass(key) and not isinstance(key, type)):
            raise TypeError(f"compile-cache keys must be frozen dataclass instances, got {type(key)!r}")
        params = getattr(type(key), "__dataclass_params__", None)
        if params is None or not params.frozen:
            raise TypeError(f"compile-cache key {type(key).__name__} must be a frozen dataclass")

    def get_or_compile(self, key: Any, compile_fn: Callable[[], Any]) -> Any:
        """Return the cached object for ``key``, compiling it (outside any capture) on a miss."""
        self._check_key(key)
        with self._lock:
            if key in self._store:
                self.hits += 1
                return self._store[key]
        ensure_not_capturing(f"compiling {type(key).__name__}")
        obj = compile_fn()
        with self._lock:
            # another thread may have compiled meanwhile: keep the first
            obj = self._store.setdefault(key, obj)
            self.misses += 1
        return obj

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._store

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    def clear(self) -> None:
        with self._lock:
            self._store.clear()
            self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._store), "hits": self.hits, "misses": self.misses}


#: The process-wide cache every drop wrapper uses.
COMPILE_CACHE = CompileCache()
