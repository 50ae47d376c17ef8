"""ABI constants of the sm120_mxfp8 drop. The host integration (shim) mirrors these values.

Bump ``ABI_VERSION`` whenever the argument list, tensor layouts or semantics of a kernel change.
"""

ABI_VERSION = 1

# MXFP8 (OCP Microscaling): one power-of-two E8M0 scale per MX_BLOCK consecutive K values.
MX_BLOCK = 32
E4M3_MAX = 448.0
# E8M0 code of the scale 2**e is e + 127; a block of zeros gets exponent -127 (code 0).
E8M0_BIAS = 127
E8M0_ZERO_BLOCK_CODE = 0

# Epilogues of the grouped GEMM (compile-time choice):
#   swiglu     out[m, j] = silu(H[m, j]) * H[m, I + j],  j < I = N // 2     (FC1)
#   row_scale  out[m, n] = H[m, n] * row_scale[m]                          (FC2, router weights)
#   identity   out[m, n] = H[m, n]                                          (debugging)
# where H[m, :] = dequant(A[m]) @ dequant(W[e(m)])^T in float32. Drop v2's gated ones (FC1, with
# g = H[m, j], u = H[m, I + j]):
#   gelu_glu           gelu(g) * u                          erf form
#   gelu_tanh_glu      gelu_tanh(g) * u                     torch's gelu(approximate="tanh")
#   clamped_swiglu     (clamp(u, -limit, limit) + beta) * g' * sigmoid(alpha * g'), g' = min(g, limit);
#                      with limit_after_act: (clamp(u) + beta) * min(g * sigmoid(alpha * g), limit)
#   softcapped_swiglu  cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu)
EPILOGUES = ("swiglu", "row_scale", "identity", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu")
GATED_EPILOGUES = ("swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu")

# The activation constants (compile time) and their defaults: clamped_swiglu's (gpt-oss's values)
# and softcapped_swiglu's (Inkling2's). Keyword arguments of the GEMM class, compile_mxfp8_gemm,
# CompiledMxfp8Gemm, get_mxfp8_gemm and the reference; ignored by the other epilogues (drop v2).
ACTIVATION_CONSTANT_DEFAULTS = {
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0, "swiglu_limit_after_act": False,
    "gate_softcap": 4.0, "up_softcap": 25.0,
}

# CTA tile. Swap-AB: the MMA's M side is weight rows, its N side is tokens.
TILE_W = 128           # weight rows per CTA tile (4 MMA warps x 32 rows = 2 m16 atoms each)
TILE_K = 128           # K values (bytes of e4m3) per pipeline stage: one 128-byte swizzle row
TILE_TOKENS = (8, 16, 32, 64, 128)   # tokens per CTA tile (compile time)
DEFAULT_TILE_TOKENS = 16             # decode-friendly; prefill wants 64 or 128
# Output features per tile: 128 (row_scale, identity) or 64 (the gated ones: 64 gate + 64 up rows).
OUT_FEATURES_PER_TILE = {"row_scale": 128, "identity": 128, **{e: 64 for e in GATED_EPILOGUES}}

# Shape constraints (checked by ``grouped_gemm.can_implement``):
#   K % ALIGN_K == 0      one whole stage per 128 K values; the 4 scale bytes of a row per stage
#                         are one 4-byte cp.async (row stride K/32 bytes must be 4-byte aligned)
#   N_out % ALIGN_N == 0  16-byte (row_scale) / 8-byte (gated) vector stores of bf16 output
#   gated: N = 2 * I (gate rows [0, I), up rows [I, 2I)); I % ALIGN_N == 0
ALIGN_K = 128
ALIGN_N = 8

# Experts per launch: the tile scheduler keeps offsets and a prefix sum in shared memory.
MAX_EXPERTS = 1024

# SM120 (RTX PRO 6000 / RTX 50xx): shared memory per block (opt-in), bytes.
SMEM_LIMIT = 101376
MAX_STAGES = 8

# Threads: 4 (tile_tokens <= 64) or 8 (tile_tokens == 128) MMA warps + 1 producer warp.
MMA_WARPS_M = 4
PRODUCER_WARPS = 1

# Row quantiser: threads per CTA; each thread converts 8 consecutive values (one 16-byte load).
QUANT_THREADS = 128
QUANT_VEC = 8
