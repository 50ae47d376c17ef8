"""moe_ep.backends: engine-facing MoE implementations behind one registry.

``available()`` lists the registered backends (best first), ``get(name)`` returns one (an unknown
name raises naming the registered ones), ``select(name, config, group, device)`` checks that a
backend can run a configuration and raises :class:`UnsupportedBackendError` with the reason
(``"auto"`` warns with :class:`BackendWarning` when it passes over a faster backend), and
``explain(config, group, device)`` returns every backend's :class:`Verdict`, best first.
"""

from moe_ep.shim import (BackendWarning, BootstrapError, CapacityError, CaptureError, CompileCacheWarning,
                         DeviceStallError, MoEError, RoutingValueError, ShimError, StaleHandleError,
                         SymmetricHeapError, COMPILE_EVENTS, compile_cache_root, list_cache_entries,
                         set_compile_cache_dir, verify_cache_entry)

from . import reference as _reference
from .sm90 import bf16_cutedsl as _sm90_bf16
from .registry import (BackendImpl, BackendSpec, UnsupportedBackendError, Verdict, available, explain, get,
                       register, select, unregister)

register(BackendSpec(
    name="reference",
    description="pure torch: all_to_all_single + per-expert matmul / torch._grouped_mm",
    priority=0,
    check=_reference.check,
    factory=lambda cfg, group, device, **opts: _reference.ReferenceBackend(cfg, group, device),
))
register(BackendSpec(
    name="sm90_bf16_cutedsl",
    description="SM90 BF16: NVLink peer-pointer dispatch/combine + CuTeDSL TMA/WGMMA varlen-M grouped GEMMs",
    priority=100,
    check=_sm90_bf16.check,
    factory=lambda cfg, group, device, **opts: _sm90_bf16.Sm90CuteDSLBackend(cfg, group, device, **opts),
))



class _NoRuntime:
    def release(self) -> None:
        pass


def retain_runtime(group, device_index: int | None = None):
    """Hold the process's NVSHMEM runtime for ``group`` (collective; a no-op handle for a single
    rank or a non-NCCL group). Layers share it by reference count and the last release finalises
    it; re-initialising NVSHMEM after a finalize is not supported by every NVSHMEM version, so a
    process that creates and destroys layers repeatedly holds one reference of its own and calls
    ``release()`` at the end."""
    if getattr(group, "world_size", 1) <= 1 or getattr(group, "dist_backend", "") != "nccl":
        return _NoRuntime()
    from moe_ep.shim import nvshmem_acquire

    return nvshmem_acquire(group.pg, device_index=device_index)


ERRORS = ("MoEError", "UnsupportedBackendError", "CapacityError", "RoutingValueError", "StaleHandleError",
          "DeviceStallError", "ShimError", "CaptureError", "SymmetricHeapError", "BootstrapError", "BackendWarning",
          "CompileCacheWarning")

__all__ = [*ERRORS, "retain_runtime", "workspace_bytes", "BackendImpl", "BackendSpec", "UnsupportedBackendError", "Verdict",
           "available", "explain", "get", "register", "select", "unregister", "prebuild", "compile_cache_root",
           "list_cache_entries", "set_compile_cache_dir", "verify_cache_entry", "PREBUILD_ARCHES", "COMPILE_EVENTS"]

#: arch -> backend whose kernels ``prebuild`` compiles for it
PREBUILD_ARCHES = {"sm_90a": "sm90_bf16_cutedsl"}


def prebuild(config, world_size: int = 1, arch: str = "sm_90a", kernels: tuple = ("fc1", "fc2", "ep", "layout")) -> None:
    """Compile every kernel a layer of ``config`` on ``world_size`` ranks needs for ``arch``
    into the disk compile cache (no GPU needed). Unknown arches raise naming the known ones."""
    if arch not in PREBUILD_ARCHES:
        raise ValueError(f"prebuild: arch {arch!r} is not supported; supported: {sorted(PREBUILD_ARCHES)}")
    _sm90_bf16.prebuild(config, world_size, kernels)


def workspace_bytes(name: str, config, world_size: int) -> int:
    """Device bytes per rank of the workspace a layer of ``config`` needs on backend ``name``
    (0 for backends that allocate per call, such as ``reference``)."""
    get(name)  # unknown names raise, naming the registered ones
    if name == "sm90_bf16_cutedsl":
        return _sm90_bf16.workspace_bytes(config, world_size)
    return 0
