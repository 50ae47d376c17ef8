"""ABI constants of the sm90_megamoe drop. The host integration mirrors these values.

Bump ``ABI_VERSION`` whenever the argument list, tensor layouts or semantics of a kernel change.
"""

ABI_VERSION = 1

# Activations the grouped GEMM epilogue can apply (compile-time choice).
ACTIVATIONS = ("identity", "swiglu", "squared_relu")

# Default CTA tiles. TILE_N is the width of the *output* tile; for swiglu the accumulator is
# 2 * TILE_N wide (gate half + up half), so swiglu defaults to 128 and the others to 256.
DEFAULT_TILE_M = 128
DEFAULT_TILE_K = 64
DEFAULT_TILE_N = {"identity": 256, "squared_relu": 256, "swiglu": 128}

# TMA needs 16-byte aligned row strides: K (A and B) and the output width must be multiples of
# 8 bf16 elements. Base pointers of A, B, C must be 16-byte aligned (torch allocations are).
ALIGN_K_ELEMS = 8
ALIGN_N_ELEMS = 8

# swiglu: the intermediate size I = N // 2 (N = rows of w13) must be a multiple of the output
# tile width, because gate rows [n0, n0+bn) and up rows [I+n0, I+n0+bn) are loaded as two whole
# TMA boxes into one stage. With the default tile (128) that means I % 128 == 0.
SWIGLU_I_MULTIPLE_OF_TILE_N = True

# Experts per launch: the tile scheduler keeps offsets and a prefix sum in shared memory.
MAX_EXPERTS = 1024

# Threads per CTA: 1 producer warpgroup (TMA) + 2 consumer warpgroups (WGMMA, 64 rows each).
THREADS_PER_CTA = 384
