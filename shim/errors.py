"""Exceptions raised by the shim (re-exported by :mod:`moe_ep.shim`)."""


class ShimError(RuntimeError):
    """Base class for shim failures."""


class DropCollisionError(ShimError):
    """Two kernel trees would provide the same top-level module name."""


class ConstantDriftError(ShimError):
    """A constant the shim mirrors differs from the drop's value."""


class CaptureError(ShimError):
    """A compile or a symmetric allocation was attempted during CUDA-graph capture."""


class NvshmemOwnershipError(ShimError):
    """NVSHMEM was initialised by somebody other than moe_ep (or with another group)."""


class DeviceStallError(ShimError):
    """A device-side wait ran past its time bound (the kernel set an error code and exited)."""
