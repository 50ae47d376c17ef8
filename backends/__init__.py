"""moe_ep.backends: engine-facing MoE implementations behind one registry.

``available()`` lists the registered backends (best first), ``get(name)`` returns one (an unknown
name raises naming the registered ones), ``select(name, config, group, device)`` checks that a
backend can run a configuration and raises :class:`UnsupportedBackendError` with the reason.
"""

from . import reference as _reference
from .registry import (BackendImpl, BackendSpec, UnsupportedBackendError, available, get, register,
                       select, unregister)

register(BackendSpec(
    name="reference",
    description="pure torch: all_to_all_single + per-expert matmul / torch._grouped_mm",
    priority=0,
    check=_reference.check,
    factory=lambda cfg, group, device: _reference.ReferenceBackend(cfg, group, device),
))

__all__ = ["BackendImpl", "BackendSpec", "UnsupportedBackendError", "available", "get", "register",
           "select", "unregister"]
