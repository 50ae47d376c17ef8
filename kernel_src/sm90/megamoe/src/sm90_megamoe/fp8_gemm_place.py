"""FP8 block-scaled grouped GEMM that places its own A rows while it runs (drop v92; SM90; opt-in).

:class:`Fp8PlaceGroupedGemmSm90` computes what :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`
computes, and writes its A rows and their scales itself: the producer warpgroup's three spare warps
fill them in the order the tiles need them, while its TMA warp loads each tile once that tile's
rows are in (:mod:`.placing_producer`'s counters). Two ways to fill a row:

* ``place_mode="quant"`` (:mod:`.placing_quantiser`): quantise it from bf16 source rows --
  ``place_gather``: row r from ``x[idx[r]]`` (FC1 from the tokens), else from ``x[r]`` (FC2 from
  FC1's output). The layer then launches no quantiser before that GEMM.
* ``place_mode="copy"``: copy e4m3 row ``x[idx[r]]`` and its scales ``x_scale[idx[r]]`` (FC1 from
  tokens quantised once each, in token order). The quantiser before FC1 then writes one row per
  token instead of one per (token, choice): an eighth of the bytes at top-8.

Tensors (torch view)::

    mX        [T_src, K]        bfloat16 ("quant") or e4m3 / uint8 ("copy")   the source rows
    mIdx      [M_total]         int32      gathering: grouped row r is source row mIdx[r] (< T_src);
                                           otherwise any int32 [>= 1] (never read)
    mA        [M_total, K]      e4m3       written here for r < offsets[E], then read by TMA
    mAScale   [M_total, K/128]  float32    written here with A, then read as the scales of A
    mSync     [S + 4]           int32      zero before the first launch, tail-clean (S >= the
                                           m-tiles of a call; see :mod:`.placing_producer`)
    mXScale   [T_src, K/128]    float32    "copy": the source rows' scales; otherwise any float32
                                           [>= 1, >= 1] (never read)
    mB, mBScale, mC, mOffsets, mRowScale: as in the base class

Every schedule of the base class but ``scale_warp`` (warp 1 is a placing warp here): clusters of
2 (both CTAs wait for their m-tile), staged or TMA-loaded scales (read after the wait), the
deferred epilogue. Registers: the base kernel's (producer 40, consumers 232 per thread) by
default; 56 / 224 when a quantising lane keeps more than 16 values in flight. Same A bytes and
scales, same WGMMAs and promotion: the same bits as the quantiser kernel followed by the base
kernel.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from .fp8_gemm import Fp8BlockScaledGroupedGemmSm90
from .placing_producer import PLACE_UNROLL
from .placing_quantiser import (PLACE_QUANT_LEAN_VALUES, PLACE_QUANT_REGS_LEAN, PLACE_QUANT_REGS_WIDE,
                                PLACE_QUANT_UNROLL, PLACE_VALS, PlaceQuantAProducer, default_chunk_rows)


class Fp8PlaceGroupedGemmSm90(PlaceQuantAProducer, Fp8BlockScaledGroupedGemmSm90):
    """The FP8 grouped GEMM whose producer warps quantise and place its A rows (module docstring).

    :param place_mode: "quant" (quantise bf16 source rows) or "copy" (copy e4m3 rows and their
        scales; always gathering).
    :param place_gather: "quant": row r of A is source row ``idx[r]`` (FC1); False: source row r (FC2).
    :param place_chunk_rows: rows per claimed chunk (a divisor of 128, at most 32); None: by K
        (:func:`.placing_quantiser.default_chunk_rows`).
    :param place_unroll: "quant": groups' loads each lane keeps in flight (1, 2 or 4; default 1);
        "copy": 16-byte vectors (default 4).
    :param place_vals: "quant": values per lane of a 128-value group (8 or 16; default 16).
    Other parameters: :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`'s."""

    def __init__(self, activation: str, place_mode: str = "quant", place_gather: bool = True,
                 place_chunk_rows: Optional[int] = None, place_unroll: Optional[int] = None,
                 place_vals: int = PLACE_VALS, **kw):
        super().__init__(activation, **kw)
        if self.scale_warp:
            raise ValueError("the placing FP8 GEMM uses producer warp 1 to place rows: no scale_warp")
        if place_mode not in ("quant", "copy"):
            raise ValueError(f"place_mode must be 'quant' or 'copy', got {place_mode!r}")
        self.place_copy = place_mode == "copy"
        if place_unroll is None:
            place_unroll = PLACE_UNROLL if self.place_copy else PLACE_QUANT_UNROLL
        if place_chunk_rows not in (None, 1, 2, 4, 8, 16, 32) or place_unroll not in (1, 2, 4, 8) \
                or place_vals not in (8, 16) or (place_unroll == 8 and not self.place_copy):
            raise ValueError(f"place_chunk_rows must be 1, 2, 4, 8, 16 or 32 (or None), place_unroll 1, 2 or 4 (8 "
                             f"when copying) and place_vals 8 or 16, got {place_chunk_rows}, {place_unroll}, "
                             f"{place_vals}")
        self.place_gather = bool(place_gather) or self.place_copy
        self.chunk_rows_asked = place_chunk_rows  # None: set from K when traced (__call__)
        self.place_unroll, self.place_vals = int(place_unroll), int(place_vals)
        lean = self.place_copy or self.place_vals * self.place_unroll <= PLACE_QUANT_LEAN_VALUES
        self.load_regs, self.mma_regs = PLACE_QUANT_REGS_LEAN if lean else PLACE_QUANT_REGS_WIDE

    def _chunk_rows(self, k: int) -> int:
        """Rows per claimed chunk: as asked, else by K (trace time): quantising, at most
        PLACE_QUANT_CHUNK_GROUPS groups (:func:`.placing_quantiser.default_chunk_rows`); copying, as
        many rows as v91's BF16 chunks hold bytes (4 rows of 4 KB)."""
        if self.chunk_rows_asked is not None:
            return self.chunk_rows_asked
        return default_chunk_rows(k // 2) if self.place_copy else default_chunk_rows(k)

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
        if cutlass.const_expr(self.place_copy):  # e4m3 rows (or their uint8 bits) and float32 scales
            if cutlass.const_expr(mX.element_type not in (cutlass.Float8E4M3FN, cutlass.Uint8)
                                  or mXScale.element_type != cutlass.Float32):
                raise TypeError("place_mode='copy': x must be float8_e4m3fn (or uint8) and x_scale float32")
        elif cutlass.const_expr(mX.element_type != cutlass.BFloat16):
            raise TypeError("place_mode='quant': the source rows x must be bfloat16")
        if cutlass.const_expr(mIdx.element_type != cutlass.Int32 or mSync.element_type != cutlass.Int32):
            raise TypeError("idx and sync must be int32")
        if cutlass.const_expr(cute.size(mX, mode=[1]) != cute.size(mA, mode=[1])):
            raise ValueError("the source rows x must have A's K columns")
        self.place_chunk_rows = self._chunk_rows(cute.size(mA, mode=[1]))
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
