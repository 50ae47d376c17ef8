"""ABI constants of the sm90_megamoe drop. The host integration mirrors these values.

Bump ``ABI_VERSION`` whenever the argument list, tensor layouts or semantics of a kernel change.
"""

ABI_VERSION = 2  # 2: the bias argument, gated activations with I % tile_n != 0, tile raster

# Activations the grouped GEMM epilogue can apply (compile-time choice). The gated ones (GATED)
# read gate rows [0, I) and up rows [I, 2I) of w13:
#   swiglu          silu(g) * u
#   gelu_glu        gelu(g) * u                               (erf form)
#   clamped_swiglu  (clamp(u, -limit, limit) + beta) * g' * sigmoid(alpha * g'),  g' = min(g, limit)
#                   (gpt-oss: alpha 1.702, limit 7, beta 1; DeepSeek-V4 / GLM-5 / Hunyuan-V4: alpha 1,
#                   beta 0; all three are compile-time values; beta since drop v99, 1 before)
#                   limit_after_act (drop v102; Step-3.7 / Bailing): the gate clamped after the
#                   activation instead, (clamp(u, -limit, limit) + beta) * min(g * sigmoid(alpha * g), limit)
#   softcapped_swiglu  gate_softcap * tanh(g / gate_softcap) * sigmoid(g) * up_softcap * tanh(u / up_softcap)
#                   (Inkling2: caps 4 and 25; both compile-time values; drop v103)
#   gelu_tanh_glu   gelu_tanh(g) * u, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
#                   (torch's gelu(approximate="tanh"), transformers' "gelu_pytorch_tanh": Gemma 4's
#                   experts; drop v109)
ACTIVATIONS = ("identity", "swiglu", "squared_relu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu",
               "gelu_tanh_glu")
GATED_ACTIVATIONS = ("swiglu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu", "gelu_tanh_glu")

# Default CTA tiles. TILE_N is the width of the *output* tile; for swiglu the accumulator is
# 2 * TILE_N wide (gate half + up half), so swiglu defaults to 128 and the others to 256.
DEFAULT_TILE_M = 128
DEFAULT_TILE_K = 64
DEFAULT_TILE_N = {"identity": 256, "squared_relu": 256, "swiglu": 128, "gelu_glu": 128,
                  "clamped_swiglu": 128, "softcapped_swiglu": 128, "gelu_tanh_glu": 128}

# Tile raster inside one expert: the m-tiles of an expert are walked in groups of RASTER_M; inside
# a group the m-tile is the fast index and the n-tile the slow one, so the CTAs running at the same
# time share one weight N-panel (read from DRAM once per group) and the group's A rows (L2 resident).
# RASTER_M = 1 is the plain n-fast order. Compile-time; the host picks it from K.
DEFAULT_RASTER_M = 1
MAX_RASTER_M = 64

# TMA needs 16-byte aligned row strides: K (A and B) and the output width must be multiples of
# 8 bf16 elements. Base pointers of A, B, C must be 16-byte aligned (torch allocations are).
ALIGN_K_ELEMS = 8
ALIGN_N_ELEMS = 8

# Gated activations: I = N // 2 may be any multiple of ALIGN_N_ELEMS. Gate rows [n0, n0+bn) and
# up rows [I+n0, I+n0+bn) are two TMA boxes at element coordinates; the last tile's columns past I
# are computed and never stored (TMA zero-fills rows past 2I).
SWIGLU_I_MULTIPLE_OF_TILE_N = False

# Experts per launch: the tile scheduler keeps offsets and a prefix sum in shared memory.
MAX_EXPERTS = 1024

# Threads per CTA: 1 producer warpgroup (TMA) + 2 consumer warpgroups (WGMMA, 64 rows each).
THREADS_PER_CTA = 384
