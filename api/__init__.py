"""moe_ep.api: the stable public API.

* :class:`MoEConfig` — static layer shape, validated on construction;
* :class:`EPGroup` — the expert-parallel ranks (``EPGroup.single()`` or from a process group);
* :class:`MoELayer` — ``warmup()``, ``forward()``, the ``dispatch()``/``combine()`` pair with
  :class:`DispatchHandle`, ``destroy()``;
* :func:`init_distributed` — torch.distributed bootstrap helper for torchrun launches;
* :func:`set_compile_cache_dir` — where compiled kernels are kept between processes (default
  ``MOE_EP_CACHE_DIR`` or ``~/.cache/moe_ep``; ``python -m moe_ep.aot build`` fills one ahead);
* :func:`launch_path` — ``"tvm-ffi"`` or why kernels take CuTeDSL's slower classic launch path
  (then :class:`LaunchPathWarning` is issued once);
* the errors, all subclasses of :class:`MoEError` (see ``moe_ep.shim.errors`` for the tree).
"""

from ..backends import (BackendWarning, BootstrapError, CapacityError, CaptureError, DeviceStallError, MoEError,
                        RoutingValueError, ShimError, StaleHandleError, SymmetricHeapError, UnsupportedBackendError)
from ..backends import CompileCacheWarning, compile_cache_root, set_compile_cache_dir
from ..backends import LaunchPathWarning, launch_path
from ..backends import available as available_backends
from .config import ACTIVATIONS, MoEConfig
from .group import EPGroup
from .layer import DispatchHandle, MoELayer
from .runtime import init_distributed

__all__ = ["ACTIVATIONS", "DispatchHandle", "EPGroup", "MoEConfig", "MoELayer", "available_backends",
           "init_distributed", "set_compile_cache_dir", "compile_cache_root", "CompileCacheWarning",
           "launch_path", "LaunchPathWarning",
           # errors (one hierarchy, base MoEError)
           "MoEError", "UnsupportedBackendError", "CapacityError", "RoutingValueError", "StaleHandleError",
           "DeviceStallError", "ShimError", "CaptureError", "SymmetricHeapError", "BootstrapError", "BackendWarning"]
