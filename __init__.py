"""moe_ep: expert-parallel Mixture-of-Experts kernels for NVIDIA GPUs.

Layers (each imports only the one below it)::

    moe_ep.api  ->  moe_ep.backends  ->  moe_ep.shim  ->  moe_ep.kernel_src (vendored drops)

Downstream code imports only :mod:`moe_ep.api` and :mod:`moe_ep.backends`.
"""

__version__ = "0.1.0"
