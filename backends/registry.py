"""Backend registry: every MoE implementation registers a :class:`BackendSpec` by name.

``get(name)`` raises with the list of registered names for an unknown one; ``select`` checks a
backend's capabilities (arch, dtype, activation, world size, shapes) and raises
:class:`UnsupportedBackendError` with the reason. There is no silent fallback: ``"auto"`` is the
documented choice of the highest-priority backend whose checks pass, and the layer reports which.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable


from moe_ep.shim import UnsupportedBackendError  # noqa: E402  (defined in the lowest layer)


class BackendImpl(ABC):
    """One MoE layer instance on one backend (created by :meth:`BackendSpec.factory`).

    Tensor contracts (``T`` tokens on this rank, ``R`` rows received by this rank):
        x ``[T, H]`` dtype; topk_ids ``[T, K]`` int32/int64; topk_weights ``[T, K]`` float32;
        w13 ``[E_local, w13_rows, H]``; w2 ``[E_local, H, I]``; out ``[T, H]`` dtype.
    Inputs arrive validated (moe_ep.api does that before any launch).
    """

    name: str = "?"

    def warmup(self, progress: Callable[[str], None]) -> None:  # noqa: B027 - optional
        """Collective: compile, allocate and run once."""

    @abstractmethod
    def forward(self, x, topk_ids, topk_weights, w13, w2, out): ...

    @abstractmethod
    def dispatch(self, x, topk_ids, topk_weights) -> tuple[Any, Any, Any]:
        """-> ``(recv_x [R, H], expert_offsets [E_local+1] int32, state)``."""

    @abstractmethod
    def combine(self, expert_out, state, out): ...

    def destroy(self) -> None:  # noqa: B027 - optional
        """Free buffers (collective where they are symmetric)."""

    def check(self) -> None:  # noqa: B027 - optional
        """Raise if the device recorded an error (host sync)."""

    def reset_error_state(self) -> None:  # noqa: B027 - optional
        """Collective: clear device-side error/flag state after an error."""


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    ``check(config, group, device)`` raises :class:`UnsupportedBackendError` (with the reason) when
    the backend cannot run that configuration; ``factory(config, group, device, **options)`` builds
    the impl (options: ``timeout_s``).
    Higher ``priority`` wins under ``"auto"``.
    """

    name: str
    description: str
    priority: int
    check: Callable[[Any, Any, Any], None]
    factory: Callable[..., BackendImpl]


_LOCK = threading.Lock()
_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add a backend; a second registration under one name raises unless ``replace``."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"register() takes a BackendSpec, got {type(spec).__name__}")
    with _LOCK:
        if spec.name in _REGISTRY and not replace:
            raise ValueError(f"backend {spec.name!r} is already registered")
        _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)


def available() -> list[str]:
    """Names of all registered backends, best first."""
    with _LOCK:
        return [s.name for s in sorted(_REGISTRY.values(), key=lambda s: -s.priority)]


def get(name: str) -> BackendSpec:
    """The backend called ``name``; ``ValueError`` naming the registered ones if unknown."""
    with _LOCK:
        spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown moe_ep backend {name!r}; available: {available()}")
    return spec


def select(name: str, config: Any, group: Any, device: Any) -> BackendSpec:
    """Resolve ``name`` (or ``"auto"``) to a backend that supports this configuration.

    A named backend that cannot run it raises :class:`UnsupportedBackendError`; ``"auto"``
    takes the best backend whose checks pass and raises listing every refusal if none does.
    """
    if name != "auto":
        spec = get(name)
        spec.check(config, group, device)
        return spec
    reasons = []
    for n in available():
        spec = get(n)
        try:
            spec.check(config, group, device)
            return spec
        except UnsupportedBackendError as e:
            reasons.append(f"{n}: {e}")
    raise UnsupportedBackendError("no registered backend supports this configuration: " + "; ".join(reasons))
