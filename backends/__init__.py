"""moe_ep.backends: engine-facing MoE implementations behind one registry.

``available()`` lists the registered backends (best first), ``get(name)`` returns one (an unknown
name raises naming the registered ones), ``select(name, config, group, device)`` checks that a
backend can run a configuration and raises :class:`UnsupportedBackendError` with the reason
(``"auto"`` warns with :class:`BackendWarning` when it passes over a faster backend), and
``explain(config, group, device)`` returns every backend's :class:`Verdict`, best first.
"""

from moe_ep.shim import (BackendWarning, BootstrapError, CapacityError, CaptureError, CompileCacheWarning,
                         DeviceStallError, LaunchPathWarning, MoEError, RoutingValueError, ShimError,
                         StaleHandleError, SymmetricHeapError, COMPILE_EVENTS, compile_cache_root, launch_path,
                         list_cache_entries, set_compile_cache_dir, verify_cache_entry, cache_manifest,
                         merge_cache_manifests, read_cache_manifest, replay_cache_manifest, write_cache_manifest)

from . import reference as _reference
from .sm90 import bf16_cutedsl as _sm90_bf16
from .sm90 import fp8_cutedsl as _sm90_fp8
from .sm100 import w4a16_cutedsl as _sm100_w4a16
from .sm120 import mxfp8_cutedsl as _sm120_mxfp8
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
    quant_formats=(None,),
))
register(BackendSpec(
    name="sm90_fp8_cutedsl",
    description="SM90 FP8 block-scaled (DeepSeek-V3 format) grouped GEMMs with the BF16 backend's "
                "dispatch/combine (BF16 on the wire; FP8 with MOE_EP_FP8_WIRE=1)",
    priority=100,
    check=_sm90_fp8.check,
    factory=lambda cfg, group, device, **opts: _sm90_fp8.Sm90Fp8Backend(cfg, group, device, **opts),
    quant_formats=("fp8_block128",),
))
register(BackendSpec(
    name="sm100_w4a16_cutedsl",
    description="SM100 W4A16 (NVFP4 weights): tcgen05 grouped GEMMs, weights dequantised in shared memory; "
                "compiled and host-tested, not yet run on Blackwell hardware",
    priority=100,
    check=_sm100_w4a16.check,
    factory=lambda cfg, group, device, **opts: _sm100_w4a16.Sm100W4A16Backend(cfg, group, device, **opts),
    quant_formats=("nvfp4_w4a16",),
))
register(BackendSpec(
    name="sm120_mxfp8_cutedsl",
    description="SM120 MXFP8: swap-AB block-scaled mma.sync grouped GEMMs; compiled and host-tested, "
                "not yet run on Blackwell hardware",
    priority=100,
    check=_sm120_mxfp8.check,
    factory=lambda cfg, group, device, **opts: _sm120_mxfp8.Sm120Mxfp8Backend(cfg, group, device, **opts),
    quant_formats=("mxfp8",),
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
          "CompileCacheWarning", "LaunchPathWarning")

__all__ = [*ERRORS, "launch_path", "retain_runtime", "workspace_bytes", "BackendImpl", "BackendSpec",
           "UnsupportedBackendError", "Verdict",
           "available", "explain", "get", "register", "select", "unregister", "prebuild", "compile_cache_root",
           "list_cache_entries", "set_compile_cache_dir", "verify_cache_entry", "PREBUILD_ARCHES", "COMPILE_EVENTS",
           "cache_manifest", "merge_cache_manifests", "read_cache_manifest", "replay_cache_manifest",
           "write_cache_manifest"]

#: the GPU whose per-GPU picks ``prebuild(..., gpu=None)`` builds (``python -m moe_ep.aot build``
#: without ``--gpu``)
DEFAULT_PREBUILD_GPU = "NVIDIA H200"

#: arch -> backend whose kernels ``prebuild`` compiles for it
PREBUILD_ARCHES = {"sm_90a": "sm90_bf16_cutedsl", "sm_100a": "sm100_w4a16_cutedsl", "sm_120a": "sm120_mxfp8_cutedsl"}


def prebuild(config, world_size: int = 1, arch: str = "sm_90a", kernels: tuple = ("fc1", "fc2", "ep", "layout"),
             gpu: str | None = None) -> None:
    """Compile every kernel a layer of ``config`` on ``world_size`` ranks needs for ``arch``
    into the disk compile cache (no GPU needed), with the backend :data:`PREBUILD_ARCHES` names for
    that arch (``sm_100a``: NVFP4 W4A16 layers, ``sm_120a``: MXFP8 layers; ``sm_90a`` with
    ``config.quant="fp8_block128"``: ``sm90_fp8_cutedsl``). ``gpu``: the name of the GPU the layers
    will run on, as ``torch.cuda.get_device_name`` gives it (e.g. "NVIDIA H100 80GB HBM3"), for the
    kernels the shim picks per GPU (``sm90_bf16_cutedsl``'s clusters, its pingpong bound); None:
    :data:`DEFAULT_PREBUILD_GPU`'s picks. Unknown arches, and configurations that backend refuses,
    raise naming the reason."""
    if arch not in PREBUILD_ARCHES:
        raise ValueError(f"prebuild: arch {arch!r} is not supported; supported: {sorted(PREBUILD_ARCHES)}")
    if arch == "sm_90a" and getattr(config, "quant", None) is not None:  # FP8 block-scaled layers
        _sm90_fp8.check_config(config, _PrebuildGroup(world_size))
        _sm90_fp8.prebuild(config, world_size, kernels)
        return
    if arch == "sm_90a":
        _sm90_bf16.prebuild(config, world_size, kernels, gpu=DEFAULT_PREBUILD_GPU if gpu is None else gpu)
        return
    from .registry import get as _get_spec

    backend = {"sm_100a": _sm100_w4a16, "sm_120a": _sm120_mxfp8}[arch]
    _get_spec(PREBUILD_ARCHES[arch])  # registered
    backend.check_config(config, _PrebuildGroup(world_size))
    backend.prebuild(config, world_size, kernels)


class _PrebuildGroup:
    """The group facts a backend's config check reads, for a prebuild without processes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.dist_backend = "nccl" if world_size > 1 else "none"


def workspace_bytes(name: str, config, world_size: int) -> int:
    """Device bytes per rank of the workspace a layer of ``config`` needs on backend ``name``
    (0 for backends that allocate per call, such as ``reference``)."""
    get(name)  # unknown names raise, naming the registered ones
    # every SM90-protocol backend shares the BF16 backend's workspace; the block-scaled ones add
    # their quantised rows to it (``workspace_dims``: ``quant_rows`` and the rows their switches use)
    impls = {"sm90_bf16_cutedsl": _sm90_bf16.Sm90CuteDSLBackend, "sm90_fp8_cutedsl": _sm90_fp8.Sm90Fp8Backend,
             "sm100_w4a16_cutedsl": _sm100_w4a16.Sm100W4A16Backend, "sm120_mxfp8_cutedsl": _sm120_mxfp8.Sm120Mxfp8Backend}
    if name in impls:
        return _sm90_bf16.dims_bytes(impls[name].workspace_dims(config, world_size))
    return 0
