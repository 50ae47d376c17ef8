"""FP8 block-scaled grouped GEMM that places its own A rows while it runs (drop v92; SM90; opt-in).

:class:`Fp8PlaceGroupedGemmSm90` computes what :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`
computes, and writes its A rows and their scales itself: the producer warpgroup's three spare warps
copy e4m3 row ``x[idx[r]]`` and its scales ``x_scale[idx[r]]`` into row r of A and of A's scales,
in the order the tiles need them, while its TMA warp loads each tile once that tile's rows are in
(:mod:`.placing_producer`'s counters). FC1 of the FP8 layer then reads tokens quantised once each,
in token order: the quantiser before it writes one row per token instead of one per (token,
choice), an eighth of the bytes at top-8.

(Drop v93 removed v92's second mode, ``place_mode="quant"``: the warps quantised bf16 rows
themselves, FC1 from the tokens and FC2 from FC1's output. FC1 so took 0.59-0.78x the time of
the quantiser + plain FC1 at the power cap (H100), and the FP8 layer with FC2 so was 7-11% slower
on the H200 and the H100: ~430 instructions per 4 groups is more issue than the GEMM leaves.)

Tensors (torch view)::

    mX        [T_src, K]        e4m3 / uint8   the source rows (the tokens, quantised)
    mIdx      [M_total]         int32      grouped row r is source row mIdx[r] (< T_src)
    mA        [M_total, K]      e4m3       written here for r < offsets[E], then read by TMA
    mAScale   [M_total, K/128]  float32    written here with A, then read as the scales of A
    mSync     [S + 4]           int32      zero before the first launch, tail-clean (S >= the
                                           m-tiles of a call; see :mod:`.placing_producer`)
    mXScale   [T_src, K/128]    float32    the source rows' scales
    mB, mBScale, mC, mOffsets, mRowScale: as in the base class

Every schedule of the base class but ``scale_warp`` (warp 1 is a placing warp here): clusters of
2 (both CTAs wait for their m-tile), staged or TMA-loaded scales (read after the wait), the
deferred epilogue. Registers: the base kernel's (producer 40, consumers 232 per thread). Same A
bytes and scales, same WGMMAs and promotion: the same bits as the base kernel on ``x[idx]``.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .fp8_gemm import Fp8BlockScaledGroupedGemmSm90
from .placing_producer import PLACE_UNROLL, PlaceAProducer

#: a chunk's bytes, in 256-byte units, by default: the largest power of 2 of rows (at most 32)
#: within 64 units (16 KB: drop v91's BF16 chunk of 4 rows of 4 KB), so a claim's round trip is
#: spread over the same bytes for any K (Qwen3 FC1 8 rows of 2 KB, Mixtral FC1 4 of 4 KB)
PLACE_COPY_CHUNK_UNITS = 64


def default_chunk_rows(k: int) -> int:
    """Rows per claimed chunk for e4m3 rows of ``k`` values (:data:`PLACE_COPY_CHUNK_UNITS`)."""
    rows = max(1, PLACE_COPY_CHUNK_UNITS // (k // 256))
    return min(32, 1 << (rows.bit_length() - 1))


class Fp8PlaceGroupedGemmSm90(PlaceAProducer, Fp8BlockScaledGroupedGemmSm90):
    """The FP8 grouped GEMM whose producer warps copy its A rows and scales in place (module docstring).

    :param place_chunk_rows: rows per claimed chunk (a divisor of 128, at most 32); None: by K
        (:func:`default_chunk_rows`).
    :param place_unroll: 16-byte vectors each lane keeps in flight (1, 2, 4 or 8; default 4).
    Other parameters: :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`'s."""

    def __init__(self, activation: str, place_chunk_rows: Optional[int] = None,
                 place_unroll: int = PLACE_UNROLL, **kw):
        super().__init__(activation, **kw)
        if self.scale_warp:
            raise ValueError("the placing FP8 GEMM uses producer warp 1 to place rows: no scale_warp")
        if place_chunk_rows not in (None, 1, 2, 4, 8, 16, 32) or place_unroll not in (1, 2, 4, 8):
            raise ValueError(f"place_chunk_rows must be 1, 2, 4, 8, 16 or 32 (or None) and place_unroll 1, 2, 4 "
                             f"or 8, got {place_chunk_rows}, {place_unroll}")
        self.chunk_rows_asked = place_chunk_rows  # None: set from K when traced (__call__)
        self.place_unroll = int(place_unroll)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mIdx: cute.Tensor,
        mA: cute.Tensor,
        mAScale: cute.Tensor,
        mSync: cute.Tensor,
        mXScale: cute.Tensor,
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
        if cutlass.const_expr(mX.element_type not in (cutlass.Float8E4M3FN, cutlass.Uint8)
                              or mXScale.element_type != cutlass.Float32):  # e4m3 rows (or their bits)
            raise TypeError("x must be float8_e4m3fn (or uint8) and x_scale float32")
        if cutlass.const_expr(mIdx.element_type != cutlass.Int32 or mSync.element_type != cutlass.Int32):
            raise TypeError("idx and sync must be int32")
        if cutlass.const_expr(cute.size(mX, mode=[1]) != cute.size(mA, mode=[1])):
            raise ValueError("the source rows x must have A's K columns")
        self.place_chunk_rows = self.chunk_rows_asked if self.chunk_rows_asked is not None \
            else default_chunk_rows(cute.size(mA, mode=[1]))
        setup = self._setup(mA, mAScale, mB, mBScale, mOffsets)
        place = (mX, mIdx, mA, mSync, mXScale)
        if cutlass.const_expr(self.unit_scales):
            self._launch(self.kernel_place_us(setup[0], setup[1], setup[2], setup[3], mAScale, mBScale, mC, mOffsets,
                                              mRowScale, *setup[4:], *place,
                                              *self._unit_scale_atoms(mAScale, mBScale)), max_active_ctas, stream)
        else:
            self._launch(self.kernel_place(setup[0], setup[1], setup[2], setup[3], mAScale, mBScale, mC, mOffsets,
                                           mRowScale, *setup[4:], *place), max_active_ctas, stream)

    @cute.kernel
    def kernel_place(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
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
        mX: cute.Tensor,
        mIdx: cute.Tensor,
        mA: cute.Tensor,
        mSync: cute.Tensor,
        mXScale: cute.Tensor,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mC,), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma,
                   place=(mX, mIdx, mA, mSync, mXScale))

    @cute.kernel
    def kernel_place_us(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
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
        mX: cute.Tensor,
        mIdx: cute.Tensor,
        mA: cute.Tensor,
        mSync: cute.Tensor,
        mXScale: cute.Tensor,
        tma_atom_as: cute.CopyAtom,
        mAS_tma: cute.Tensor,
        tma_atom_bs: cute.CopyAtom,
        mBS_tma: cute.Tensor,
    ):
        """``unit_scales``: the placing kernel with the scales' TMA atoms."""
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mC,), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma,
                   us_tma=(tma_atom_as, mAS_tma, tma_atom_bs, mBS_tma), place=(mX, mIdx, mA, mSync, mXScale))
