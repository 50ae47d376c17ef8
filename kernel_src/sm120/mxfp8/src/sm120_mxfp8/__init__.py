"""sm120_mxfp8: standalone CuTeDSL SM120 (RTX PRO 6000 / RTX 50xx) MXFP8 MoE kernels.

Never imports moe_ep. Kernels: ``Mxfp8GroupedGemmSm120`` (varlen-M grouped GEMM, block-scaled
warp MMA, swap-AB, gated (swiglu, GELU, clamped / softcapped SwiGLU) / row_scale epilogues) and ``Mxfp8QuantizeRows`` (bf16 -> MXFP8 rows).
Host helpers live in :mod:`sm120_mxfp8.launch`, torch references in :mod:`sm120_mxfp8.reference`.
"""

DROP_VERSION = 2

from .constants import (  # noqa: E402
    ABI_VERSION,
    ACTIVATION_CONSTANT_DEFAULTS,
    ALIGN_K,
    ALIGN_N,
    DEFAULT_TILE_TOKENS,
    EPILOGUES,
    GATED_EPILOGUES,
    MAX_EXPERTS,
    MX_BLOCK,
    SMEM_LIMIT,
    TILE_K,
    TILE_TOKENS,
    TILE_W,
)
from .grouped_gemm import Mxfp8GroupedGemmSm120, can_implement, check_activation_constants, out_features  # noqa: E402
from .quantize import Mxfp8QuantizeRows, quantize_can_implement  # noqa: E402

__all__ = [
    "DROP_VERSION",
    "ABI_VERSION",
    "ACTIVATION_CONSTANT_DEFAULTS",
    "ALIGN_K",
    "ALIGN_N",
    "DEFAULT_TILE_TOKENS",
    "EPILOGUES",
    "GATED_EPILOGUES",
    "MAX_EXPERTS",
    "MX_BLOCK",
    "SMEM_LIMIT",
    "TILE_K",
    "TILE_TOKENS",
    "TILE_W",
    "Mxfp8GroupedGemmSm120",
    "Mxfp8QuantizeRows",
    "can_implement",
    "check_activation_constants",
    "out_features",
    "quantize_can_implement",
]
