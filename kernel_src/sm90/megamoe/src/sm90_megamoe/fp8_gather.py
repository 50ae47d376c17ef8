"""FP8 grouped GEMM that gathers its A rows by index (drop v22, producer coalesced in v23; SM90).

:class:`Fp8GatherGroupedGemmSm90` computes what :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`
computes for the grouped rows ``A[r] = mA[mIdx[r]]`` (scales ``mAScale[mIdx[r]]``) without those
rows ever being written: the MoE layer quantises each token once (T rows) instead of once per
expert choice (T * top_k grouped rows), and FC1 reads the E4M3 tokens where they are.

Tensors (torch view)::

    mA        [T_src, K]          float8_e4m3fn (or uint8 bits)   the source rows (tokens)
    mAScale   [T_src, K / 128]    float32                         their scales
    mIdx      [M_total]           int32      grouped row r reads source row mIdx[r] (< T_src)
    mB, mBScale, mC, mOffsets, mRowScale: as in the base class (mC [M_total, N_out] grouped rows)

Producer: :class:`.gather_producer.GatherAProducer` (the whole producer warpgroup loads A with
16-byte cp.async, B by TMA; full barriers of 1 + 128 arrivals). The consumers are the base class's (any schedule: overlapped promotion, ``wide_gated``); only
their A-scale rows go through ``mIdx``. Same bits as the base kernel on ``mA[mIdx]``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .fp8_gemm import Fp8BlockScaledGroupedGemmSm90
from .gather_producer import GatherAProducer


class Fp8GatherGroupedGemmSm90(GatherAProducer, Fp8BlockScaledGroupedGemmSm90):
    """The FP8 block-scaled grouped GEMM with A rows gathered by ``mIdx`` (module docstring)."""

    gather_a = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mAScale: cute.Tensor,
        mIdx: cute.Tensor,
        mB: cute.Tensor,
        mBScale: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        mA, mB = self._check_inputs(mA, mAScale, mB, mBScale, mOffsets)
        if cutlass.const_expr(mC.element_type != cutlass.BFloat16):
            raise TypeError("C must be bfloat16")
        if cutlass.const_expr(mIdx.element_type != cutlass.Int32):
            raise TypeError("idx must be int32")
        setup = self._setup(mA, mAScale, mB, mBScale, mOffsets)
        self._launch(self.kernel_gather(setup[0], setup[1], setup[2], setup[3], mA, mIdx, mAScale, mBScale, mC,
                                        mOffsets, mRowScale, *setup[4:]), max_active_ctas, stream)

    @cute.kernel
    def kernel_gather(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mA: cute.Tensor,
        mIdx: cute.Tensor,
        mAScale: cute.Tensor,
        mBScale: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_mma: cute.ComposedLayout,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mC,), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma, gather=(mA, mIdx))
