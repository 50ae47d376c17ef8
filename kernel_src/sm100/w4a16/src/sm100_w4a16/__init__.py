"""sm100_w4a16: standalone CuTeDSL SM100 (Blackwell, tcgen05) W4A16 grouped GEMM for MoE experts.

BF16 activations x NVFP4 weights (moe_ep's ``NVFP4Weight`` bytes) -> BF16, varlen-M over a
device-side ``expert_offsets`` array. Never imports moe_ep.

    from sm100_w4a16 import W4A16GroupedGemmSm100, can_implement     # kernel class, checks
    from sm100_w4a16.launch import compile_w4a16_gemm, get_w4a16_gemm  # compile / launch (torch)
    from sm100_w4a16.reference import w4a16_grouped_gemm_reference    # torch reference
"""

DROP_VERSION = 4

from .constants import (  # noqa: E402
    ABI_VERSION,
    ACTIVATION_CONSTANT_DEFAULTS,
    ALIGN_K_ELEMS,
    ALIGN_N_ELEMS,
    BIAS_DTYPES,
    DEFAULT_RASTER_M,
    DEFAULT_TILE_N,
    EPILOGUES,
    GATED_EPILOGUES,
    MAX_EXPERTS,
    SF_BLOCK,
    THREADS_PER_CTA,
    TILE_K,
    TILE_M,
    TILE_N_CHOICES,
)
from .grouped_gemm import W4A16GroupedGemmSm100, can_implement, check_activation_constants  # noqa: E402

__all__ = [
    "DROP_VERSION",
    "ABI_VERSION",
    "ACTIVATION_CONSTANT_DEFAULTS",
    "ALIGN_K_ELEMS",
    "ALIGN_N_ELEMS",
    "BIAS_DTYPES",
    "DEFAULT_RASTER_M",
    "DEFAULT_TILE_N",
    "EPILOGUES",
    "GATED_EPILOGUES",
    "MAX_EXPERTS",
    "SF_BLOCK",
    "THREADS_PER_CTA",
    "TILE_K",
    "TILE_M",
    "TILE_N_CHOICES",
    "W4A16GroupedGemmSm100",
    "can_implement",
    "check_activation_constants",
]
