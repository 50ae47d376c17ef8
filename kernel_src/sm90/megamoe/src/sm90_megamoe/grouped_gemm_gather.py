"""BF16 grouped GEMM that gathers its A rows by index (drop v23; SM90).

:class:`GroupedGemmGatherSm90` computes what :class:`.grouped_gemm.GroupedGemmSm90` computes for
the grouped rows ``A[r] = mA[mIdx[r]]`` without those rows ever being written: a one-rank MoE layer
feeds FC1 the caller's tokens and the expert layout's ``idx`` instead of copying every (token,
choice) row into expert order first (Qwen3, 8192 tokens: 65536 rows of 4 KB written and read back).

Tensors (torch view)::

    mA        [T_src, K]          bfloat16   the source rows (tokens), K % 64 == 0
    mIdx      [M_total]           int32      grouped row r reads source row mIdx[r] (< T_src)
    mB, mC, mOffsets, mRowScale, mBias: as in the base class (mC [M_total, N_out] grouped rows,
                                  mRowScale indexed by grouped row)

Producer: :class:`.gather_producer.GatherAProducer` (the producer warpgroup loads A with 16-byte
cp.async, eight lanes per 128-byte row line; B by TMA; full barriers of 1 + 128 arrivals). The
consumers and epilogue are the base class's (``cooperative`` or ``wide``; not ``pingpong``).
Same bits as the base kernel on ``mA[mIdx]``. (Drop v85 removed v41's one-TMA-per-row producer and
v75's L2 priorities: both slower on the H200.)
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .gather_producer import GatherAProducer
from .grouped_gemm import GroupedGemmSm90


class GroupedGemmGatherSm90(GatherAProducer, GroupedGemmSm90):
    """The BF16 grouped GEMM with A rows gathered by ``mIdx`` (module docstring)."""

    gather_a = True

    def __init__(self, activation: str, **kw):
        super().__init__(activation, **kw)
        if self.pingpong:
            raise ValueError("the gathering GEMM runs the 'cooperative' or 'wide' schedule, not 'pingpong'")

    def _n0(self, n_tile):
        """First output column of n-tile ``n_tile`` (one unit = one n-tile)."""
        return n_tile * self.tile_n

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mIdx: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._check_inputs(mA, mB, mC, mOffsets, mBias)
        if cutlass.const_expr(mIdx.element_type != cutlass.Int32):
            raise TypeError("idx must be int32")
        if cutlass.const_expr(cute.size(mB, mode=[2]) % self.tile_k != 0):
            raise ValueError(f"the gathering GEMM needs K % {self.tile_k} == 0 (cp.async has no K tail)")
        setup = self._setup(mA, mB, mOffsets)
        self._launch(self.kernel_gather(setup[0], setup[1], setup[2], setup[3], mA, mIdx, mC, mOffsets, mRowScale,
                                        mBias, *setup[4:]), max_active_ctas, stream)

    @cute.kernel
    def kernel_gather(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mA: cute.Tensor,
        mIdx: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_main: cute.ComposedLayout,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffsets, mRowScale, mBias, tiled_mma, tiled_mma_epi,
                   a_smem_layout, b_smem_layout, b_smem_layout_main, gather=(mA, mIdx))
