"""sm90_megamoe: standalone CuTeDSL SM90 kernels for the moe_ep project (never imports moe_ep)."""

DROP_VERSION = 114

from .constants import (  # noqa: E402
    ABI_VERSION,
    ACTIVATIONS,
    ALIGN_K_ELEMS,
    ALIGN_N_ELEMS,
    DEFAULT_TILE_K,
    DEFAULT_TILE_M,
    DEFAULT_TILE_N,
    MAX_EXPERTS,
    THREADS_PER_CTA,
)
from .grouped_gemm import GroupedGemmSm90  # noqa: E402

__all__ = [
    "DROP_VERSION",
    "ABI_VERSION",
    "ACTIVATIONS",
    "ALIGN_K_ELEMS",
    "ALIGN_N_ELEMS",
    "DEFAULT_TILE_K",
    "DEFAULT_TILE_M",
    "DEFAULT_TILE_N",
    "MAX_EXPERTS",
    "THREADS_PER_CTA",
    "GroupedGemmSm90",
]
