"""ABI constants of the sm100_w4a16 drop. The host integration (shim) mirrors these values.

Bump ``ABI_VERSION`` whenever the argument list, tensor layouts or semantics of the kernel change.
"""

ABI_VERSION = 2  # 2 (drop v4): an optional trailing bias argument

# Epilogues (compile-time choice). ``gs`` = global_scale[e] (fp32), applied to the fp32
# accumulator before anything else:
#   identity      D = acc * gs
#   squared_relu  D = relu(acc * gs) ** 2                       (Nemotron FC1)
#   row_scale     D = acc * gs * row_scale[m]                   (FC2, router weights)
#   swiglu        D[:, j] = silu(G * gs) * (U * gs)             G = rows [0, I) of W, U = rows [I, 2I)
#   gelu_glu      D[:, j] = gelu(G * gs) * (U * gs)             erf form (drop v2)
#   gelu_tanh_glu D[:, j] = gelu_tanh(G * gs) * (U * gs)        tanh form, torch's gelu(approximate="tanh")
#                 (Gemma 4's experts; drop v2)
#   clamped_swiglu D[:, j] = (clamp(U', -limit, limit) + beta) * G'' * sigmoid(alpha * G'')
#                 G' = G * gs, U' = U * gs, G'' = min(G', limit); with limit_after_act the gate is
#                 clamped after the activation: (clamp(U') + beta) * min(G' * sigmoid(alpha * G'), limit)
#                 (gpt-oss: alpha 1.702, limit 7, beta 1; DeepSeek-V4 / GLM-5: beta 0; Step-3.7:
#                 after the activation; drop v3)
#   softcapped_swiglu D[:, j] = cg * tanh(G' / cg) * sigmoid(G') * cu * tanh(U' / cu)
#                 (Inkling2: cg 4, cu 25; drop v3)
# Optional per-expert bias (drop v4): bias[e, n] (float32 or bfloat16) added to acc * gs before the
# epilogue (gated: gate bias at column j, up bias at I + j); FC2's row_scale multiplies after it.
BIAS_DTYPES = ("float32", "bfloat16")

EPILOGUES = ("identity", "squared_relu", "row_scale", "swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu",
             "softcapped_swiglu")
GATED_EPILOGUES = ("swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu")

# The activation constants (compile time) and their defaults: clamped_swiglu's (gpt-oss's values)
# and softcapped_swiglu's (Inkling2's). Keyword arguments of the kernel class, compile_w4a16_gemm,
# CompiledW4A16Gemm, get_w4a16_gemm and the reference; ignored by the other epilogues.
ACTIVATION_CONSTANT_DEFAULTS = {
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0, "swiglu_limit_after_act": False,
    "gate_softcap": 4.0, "up_softcap": 25.0,
}

# NVFP4 weight format (moe_ep's NVFP4Weight): two E2M1 codes per byte (element 2j in the low
# nibble), one float8_e4m3fn scale per SF_BLOCK consecutive K elements, one fp32 scale per expert.
SF_BLOCK = 16
E2M1_PER_BYTE = 2

# CTA tile. TILE_M rows of A per tile (one tcgen05.mma M=128, cta_group::1); TILE_K = 64 bf16 =
# one 128-byte swizzle atom row, so K must be a multiple of TILE_K. TILE_N is the width of the
# *output* tile; swiglu keeps two accumulators (gate, up) of TILE_N columns each.
TILE_M = 128
TILE_K = 64
TILE_N_CHOICES = (64, 128, 256)
DEFAULT_TILE_N = {"identity": 128, "squared_relu": 128, "row_scale": 128, "swiglu": 128, "gelu_glu": 128,
                  "gelu_tanh_glu": 128, "clamped_swiglu": 128, "softcapped_swiglu": 128}
MAX_GATED_TILE_N = 128  # 2 accumulators x 2 TMEM stages x TILE_N fp32 columns <= 512

# K multiple of TILE_K (which also gives: packed row stride K/2 bytes a multiple of 32, so TMA's
# 16-byte stride rule holds; scale rows K/16 bytes a multiple of 4, so the 2-byte scale loads are
# aligned). The output width N_out must be a multiple of ALIGN_N_ELEMS (16-byte vector stores).
ALIGN_K_ELEMS = TILE_K
ALIGN_N_ELEMS = 8

# The m-tiles of an expert are walked in groups of RASTER_M (m fast inside a group, then n), so
# CTAs running together share one weight N-panel. Compile-time.
DEFAULT_RASTER_M = 8
MAX_RASTER_M = 64

# Experts per launch: the tile scheduler keeps offsets and a prefix sum in shared memory.
MAX_EXPERTS = 1024

# Warp roles: 4 epilogue warps (TMEM lanes 0..127), 1 MMA warp, 1 TMA warp, 4 dequant warps.
NUM_EPILOGUE_WARPS = 4
NUM_DEQUANT_WARPS = 4
THREADS_PER_CTA = 32 * (NUM_EPILOGUE_WARPS + 2 + NUM_DEQUANT_WARPS)

# Shared memory the kernel may use (sm_100: 227 KB per CTA).
SMEM_CAPACITY_BYTES = 232448
