"""A warp's inclusive prefix sum, shared by the GEMMs' m-tile scans and the layout kernels' counts
(one module, so the layout kernels need not import a GEMM)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def warp_inclusive_scan(v: cutlass.Int32, lane: cutlass.Int32) -> cutlass.Int32:
    """Inclusive prefix sum of ``v`` over the warp's lanes (Hillis-Steele over shuffles)."""
    for s in cutlass.range_constexpr(5):
        w = cute.arch.shuffle_sync_up(v, 1 << s)
        if lane >= (1 << s):
            v = v + w
    return v
