"""moe_ep's exceptions. Users catch them from :mod:`moe_ep.api` (re-exported there through
:mod:`moe_ep.backends`); they are defined here, in the lowest layer, so every layer can raise them.

Hierarchy::

    MoEError                              every moe_ep error
    ├── UnsupportedBackendError (ValueError)   a backend cannot run this configuration here
    ├── CapacityError (ValueError)             more tokens than the layer was sized for
    ├── RoutingValueError (ValueError)         bad expert id / router weight seen by the kernels
    ├── StaleHandleError (ValueError)          combine() with a handle of an older dispatch
    ├── DeviceStallError (RuntimeError)        a peer rank did not arrive within timeout_s
    └── ShimError (RuntimeError)               kernel plumbing: collisions, drift, capture, NVSHMEM
        ├── DropCollisionError, ConstantDriftError, CaptureError
        └── NvshmemOwnershipError, SymmetricHeapError, BootstrapError
"""

from __future__ import annotations


class MoEError(Exception):
    """Base class of every error moe_ep raises on purpose."""


class UnsupportedBackendError(MoEError, ValueError):
    """The requested backend cannot run this configuration here (the message says why)."""


class CapacityError(MoEError, ValueError):
    """More tokens than ``max_tokens_per_rank`` (raised before launch, or by ``check_errors()``
    when only the device saw it); nothing was written out of bounds."""


class RoutingValueError(MoEError, ValueError):
    """An expert id outside ``[0, num_experts)`` or a non-finite router weight reached the kernels.

    The kernels dropped that choice (it contributed nothing) and recorded the first offender:
    ``argument`` (``"topk_ids"`` or ``"topk_weights"``), ``token``, ``k`` and ``value``.
    """

    def __init__(self, message: str, argument: str = "", token: int = -1, k: int = -1, value=None):
        super().__init__(message)
        self.argument, self.token, self.k, self.value = argument, token, k, value


class StaleHandleError(MoEError, ValueError):
    """``combine()`` got a handle whose dispatch was followed by another dispatch/forward on the
    same workspace (its receive buffers have been overwritten)."""


class ShimError(MoEError, RuntimeError):
    """Base class for failures of the kernel plumbing (moe_ep.shim)."""


class DeviceStallError(ShimError):
    """A device-side wait for a peer rank ran past its time bound; the kernel set an error word
    and exited. ``rank`` is the peer waited for (group rank), ``global_rank`` its global rank."""

    def __init__(self, message: str, rank: int = -1, global_rank: int = -1, where: str = ""):
        super().__init__(message)
        self.rank, self.global_rank, self.where = rank, global_rank, where


class DropCollisionError(ShimError):
    """Two kernel trees would provide the same top-level module name."""


class ConstantDriftError(ShimError):
    """A constant the shim mirrors differs from the drop's value."""


class CaptureError(ShimError):
    """A compile or an allocation was attempted during CUDA-graph capture."""


class NvshmemOwnershipError(ShimError):
    """NVSHMEM was initialised by somebody other than moe_ep (or with another group)."""


class SymmetricHeapError(ShimError):
    """The NVSHMEM symmetric heap is too small for what a layer needs (raise
    ``NVSHMEM_SYMMETRIC_SIZE`` before the first layer is built)."""


class BootstrapError(ShimError):
    """A collective set-up step failed on at least one rank (every rank raises the same error)."""


class BackendWarning(UserWarning):
    """``backend="auto"`` passed over a faster backend (the message says why)."""


class LaunchPathWarning(UserWarning):
    """Kernels launch through CuTeDSL's classic path because apache-tvm-ffi is missing (slower on the
    host; :func:`moe_ep.backends.launch_path` says which path is taken)."""
