"""BF16 grouped GEMM that places its own A rows while it runs (drop v91; SM90; opt-in).

:class:`GroupedGemmPlaceSm90` computes what :class:`.grouped_gemm.GroupedGemmSm90` computes on the
grouped rows ``xs[r] = x[idx[r]]``, and writes those rows itself: the producer warpgroup's three
spare warps copy them in the order the tiles need them, while its TMA warp loads each tile's A
from ``xs`` once that tile's rows are in (:mod:`.placing_producer`). A one-rank layer then runs
its expert layout without the row copy and FC1 with this kernel, so the copy (Qwen3 at 8192
tokens: 65536 rows of 4 KB) runs under FC1's tensor work instead of before it.

Tensors (torch view)::

    mX        [T_src, K]          bfloat16   the source rows (tokens), K % 8 == 0
    mIdx      [M_total]           int32      grouped row r is source row mIdx[r] (< T_src)
    mXs       [M_total, K]        bfloat16   written here: xs[r] = x[idx[r]] for r < offsets[E];
                                             then read back by TMA as A
    mSync     [S + 4]             int32      zero before the first launch, tail-clean (S >= the
                                             m-tiles of a call; slot S + 3: error word, see
                                             :mod:`.placing_producer`)
    mB, mC, mOffsets, mRowScale, mBias: as in the base class

Schedules: ``cooperative`` and ``wide`` (FC1's). Registers: producer 56, consumers 216 per thread
(the base kernel's 40 / 232; the copy warps need more than the TMA warp, and a cooperative
warpgroup's gated accumulators take 128). Same WGMMAs on the same rows: the same bits as the base
kernel on ``x[idx]``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .grouped_gemm import GroupedGemmSm90
from .placing_producer import PLACE_CHUNK_ROWS, PLACE_LOAD_REGS, PLACE_MMA_REGS, PLACE_UNROLL, PlaceAProducer


class GroupedGemmPlaceSm90(PlaceAProducer, GroupedGemmSm90):
    """The BF16 grouped GEMM whose producer warps place its A rows (module docstring)."""

    def __init__(self, activation: str, place_chunk_rows: int = PLACE_CHUNK_ROWS, place_unroll: int = PLACE_UNROLL,
                 **kw):
        super().__init__(activation, **kw)
        if self.pingpong or self.cluster_m > 1 or self.cluster_n > 1:
            raise ValueError("the placing GEMM runs the 'cooperative' or 'wide' schedule, without clusters")
        if place_chunk_rows not in (1, 2, 4, 8, 16, 32) or place_unroll not in (1, 2, 4, 8):
            raise ValueError(f"place_chunk_rows must be 1, 2, 4, 8, 16 or 32 and place_unroll 1, 2, 4 or 8, got "
                             f"{place_chunk_rows}, {place_unroll}")
        self.place_chunk_rows, self.place_unroll = int(place_chunk_rows), int(place_unroll)
        self.load_regs = PLACE_LOAD_REGS
        self.mma_regs = PLACE_MMA_REGS

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mIdx: cute.Tensor,
        mXs: cute.Tensor,
        mSync: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._check_inputs(mXs, mB, mC, mOffsets, mBias)
        if cutlass.const_expr(mX.element_type != cutlass.BFloat16):
            raise TypeError("x must be bfloat16")
        if cutlass.const_expr(mIdx.element_type != cutlass.Int32 or mSync.element_type != cutlass.Int32):
            raise TypeError("idx and sync must be int32")
        setup = self._setup(mXs, mB, mOffsets)
        self._launch(self.kernel_place(setup[0], setup[1], setup[2], setup[3], mX, mIdx, mXs, mSync, mC, mOffsets,
                                       mRowScale, mBias, *setup[4:]), max_active_ctas, stream)

    @cute.kernel
    def kernel_place(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mX: cute.Tensor,
        mIdx: cute.Tensor,
        mXs: cute.Tensor,
        mSync: cute.Tensor,
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
                   a_smem_layout, b_smem_layout, b_smem_layout_main, place=(mX, mIdx, mXs, mSync))
