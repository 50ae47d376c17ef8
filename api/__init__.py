"""moe_ep.api: the stable public API.

* :class:`MoEConfig` — static layer shape, validated on construction;
* :class:`EPGroup` — the expert-parallel ranks (``EPGroup.single()`` or from a process group);
* :class:`MoELayer` — ``warmup()``, ``forward()``, the ``dispatch()``/``combine()`` pair with
  :class:`DispatchHandle`, ``destroy()``;
* :func:`init_distributed` — torch.distributed bootstrap helper for torchrun launches.
"""

from ..backends import UnsupportedBackendError, available as available_backends
from .config import ACTIVATIONS, MoEConfig
from .group import EPGroup
from .layer import DispatchHandle, MoELayer
from .runtime import init_distributed

__all__ = ["ACTIVATIONS", "DispatchHandle", "EPGroup", "MoEConfig", "MoELayer", "UnsupportedBackendError",
           "available_backends", "init_distributed"]
