"""Row quantiser bf16 -> MXFP8 (e4m3 values + E8M0 scale per 32 values), in CuTeDSL.

Used before FC1 (the dispatched tokens) and between FC1 and FC2 (the swiglu output)::

    amax  = max |x| over 32 consecutive values of a row
    e     = ceil(log2(amax / 448))   (-127 for amax < 2^-120, including a block of zeros)
    scale = 2^e            stored as the E8M0 code e + 127
    value = e4m3(x / scale)          round to nearest even; |x / scale| <= 448 by construction

This is exactly the rule of moe_ep's ``quantize_mxfp8`` for bf16 input. The exponent is taken
from the bits of amax, not from a floating-point log2: amax = M * 2^p with M in [1, 2), and
448 = 1.75 * 2^8, so ``e = p - 8 + (M > 1.75)``. For bf16 input this equals torch's
``ceil(log2(amax / 448))`` bit for bit, because amax / 448 is either an exact power of two
(M == 1.75) or at least 0.45 % away from one (M has 7 fraction bits), so the float32 division and
log2 round the same way. ``x / 2^e`` is one exact multiplication by 2^-e (a normal float32 for
every e in [-127, 120]; subnormal inputs are kept: no flush to zero).

Constraints: K % 32 == 0 (and K % 8 == 0 for 16-byte loads); contiguous tensors, 16-byte aligned
base pointers.

Tensors
-------
    mIn    [M, K]       bf16
    mOut   [M, K]       uint8  e4m3 bits (view as torch.float8_e4m3fn)
    mScale [M, K / 32]  uint8  E8M0 codes (view as torch.float8_e8m0fnu)

Design: the tensors are walked as flat arrays (a 32-value block never straddles rows). Thread
``v`` converts values ``8 v .. 8 v + 7`` (one 16-byte load, one 8-byte store); the 4 lanes of a
quad hold one block, reduce its amax with two xor shuffles, and the quad's first lane stores the
scale code.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .constants import MX_BLOCK, QUANT_THREADS, QUANT_VEC

# scale 4 values by 2^-e (exact), round each to e4m3 (RNE, saturating), pack 4 bytes little-endian
_PTX_SCALE_CVT4 = (
    "{ .reg .f32 q0, q1, q2, q3; .reg .b16 lo, hi; "
    "mul.rn.f32 q0, {$r0}, {$r4}; mul.rn.f32 q1, {$r1}, {$r4}; "
    "mul.rn.f32 q2, {$r2}, {$r4}; mul.rn.f32 q3, {$r3}, {$r4}; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, q1, q0; cvt.rn.satfinite.e4m3x2.f32 hi, q3, q2; "
    "mov.b32 {$w0}, {lo, hi}; }"
)


def quantize_can_implement(k: int) -> "str | None":
    """None when the row quantiser supports rows of K values, else the reason."""
    if k <= 0 or k % MX_BLOCK != 0:
        return f"K={k} must be a positive multiple of {MX_BLOCK}"
    return None


class Mxfp8QuantizeRows:
    """bf16 ``[M, K]`` -> (e4m3 ``[M, K]``, E8M0 ``[M, K/32]``), both as uint8 bits.

    :param threads: threads per CTA (a multiple of 32).
    Static (compile key): K. M is dynamic; the host skips M == 0.
    """

    def __init__(self, threads: int = QUANT_THREADS):
        if threads % 32 != 0 or not (32 <= threads <= 1024):
            raise ValueError("threads must be a multiple of 32 in [32, 1024]")
        self.threads = threads

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, mScale: cute.Tensor,
                 stream: cuda.CUstream):
        if cutlass.const_expr(mIn.element_type != cutlass.BFloat16):
            raise TypeError("input must be bfloat16")
        if cutlass.const_expr(mOut.element_type != cutlass.Uint8 or mScale.element_type != cutlass.Uint8):
            raise TypeError("values and scales must be passed as uint8")
        k = cute.size(mIn, mode=[1])
        reason = quantize_can_implement(k)
        if cutlass.const_expr(reason is not None):
            raise ValueError(reason)
        m = cute.size(mIn, mode=[0])
        total_vec = m * (k // QUANT_VEC)  # multiple of 4: a quad of lanes is one block
        grid = (total_vec + (self.threads - 1)) // self.threads
        self.kernel(mIn, mOut, mScale, total_vec).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor, mScale: cute.Tensor,
               total_vec: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = bidx * self.threads + tidx
        # lanes past the end load the last vector (a whole quad is either in or out) so that
        # the shuffles below always see 4 participants; they store nothing
        vc = cutlass.min(v, total_vec - 1)
        src = cute.make_tensor(
            cute.make_ptr(cutlass.BFloat16, mIn.iterator.toint() + cutlass.Int64(vc) * (2 * QUANT_VEC),
                          cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout(QUANT_VEC),
        )
        x = cute.make_rmem_tensor((QUANT_VEC,), cutlass.Float32)
        x.store(src.load().to(cutlass.Float32))  # exact
        amax = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(QUANT_VEC):
            amax = cute.arch.fmax(amax, cute.arch.fmax(x[i], -x[i]))
        for s in cutlass.range_constexpr(2):  # the quad's 32 values
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << s))

        # e = ceil(log2(amax / 448)) from the bits of amax (see the module docstring)
        bits = cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[cutlass.Int32],
                                    read_only_args=[amax])
        e = (bits >> 23) - 135
        if (bits & 0x7FFFFF) > 0x600000:
            e = e + 1
        e = cutlass.max(e, -127)
        inv_scale = cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[cutlass.Float32],
                                         read_only_args=[(127 - e) << 23])  # 2^-e, normal

        packed = cute.make_rmem_tensor((QUANT_VEC // 4,), cutlass.Int32)
        for w in cutlass.range_constexpr(QUANT_VEC // 4):
            packed[w] = cute.arch.inline_ptx(
                _PTX_SCALE_CVT4, write_only_types=[cutlass.Int32],
                read_only_args=[x[4 * w], x[4 * w + 1], x[4 * w + 2], x[4 * w + 3], inv_scale],
            )
        if v < total_vec:
            dst = cute.make_tensor(
                cute.make_ptr(cutlass.Int32, mOut.iterator.toint() + cutlass.Int64(v) * QUANT_VEC,
                              cute.AddressSpace.gmem, assumed_align=QUANT_VEC),
                cute.make_layout(QUANT_VEC // 4),
            )
            dst.store(packed.load())
            if v % (MX_BLOCK // QUANT_VEC) == 0:
                sc = cute.make_tensor(
                    cute.make_ptr(cutlass.Uint8,
                                  mScale.iterator.toint() + cutlass.Int64(v // (MX_BLOCK // QUANT_VEC)),
                                  cute.AddressSpace.gmem, assumed_align=1),
                    cute.make_layout(1),
                )
                sc[0] = cutlass.Uint8(e + 127)
