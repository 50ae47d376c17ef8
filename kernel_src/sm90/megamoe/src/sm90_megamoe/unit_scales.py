"""Scales by TMA, a chunk of k-tiles at a time (drop v69, ``unit_scales``), for the FP8 block-scaled
grouped GEMM (:class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`).

Why: the default GEMMs read each k-tile's scales one of two ways. The consumer threads load them
from global memory (two A-row scales and one or two weight-block scales per thread per k-tile,
eight rows per warp instruction). Or a producer warp gathers them and stores them into the stage
(``smem_scales`` / ``scale_warp``, drops v34 / v35). Twenty-eighth session, H200, at the 700 W cap: the
same GEMMs with the consumers reading their scales from shared memory that nobody loads took
0.946x (Mixtral FC1), 0.959x (Mixtral FC2) and 0.954x (Qwen3 FC1) of the default's time. With no
scale reads at all: 0.866x / 0.938x / 0.914x. So getting scales into shared memory costs 4-5% of
these GEMMs today.

What it does: the TMA warp loads the scales of UNIT_SCALE_KC consecutive k-tiles at once, with
three TMA copies into one of two shared-memory buffers (double-buffered by chunk):
- the tile's 128 A rows x UNIT_SCALE_KC k-tiles: a box of ``mAScale`` [M, K/128], 4 KB;
- UNIT_SCALE_KC weight-block scales of ``mBScale`` [E, N/128, K/128] per weight block, 32 bytes
  each (gated: the gate block, then the up block).
The copies complete on the buffer's "full" barrier (``arrive.expect_tx`` with their bytes). The
TMA warp issues a chunk's copies at the chunk's first k-tile, before that k-tile's stage, once
the buffer's "empty" barrier says every consumer thread is done with the chunk two back. The
consumers wait on "full" at a chunk's first k-tile and read their scales from shared memory. After
reading the chunk's last k-tile they arrive on "empty" (one arrival per consumer thread).

The operands' layouts stay the same, so every kernel that writes scales writes them as before. Rows
of the box past the expert's end belong to the next expert. Rows past M_total are zero-filled by the
TMA unit. Either way the promotion of those accumulator rows is never stored; the default path
clamps such rows to the expert's last row instead. TMA needs 16-byte global strides: K/128 must be
a multiple of 4. A chunk holds UNIT_SCALE_KC = 8 k-tiles where 8 divides K/128, else (drop v106)
UNIT_SCALE_KC_SMALL = 4 (Inkling2's FC1, K 4608 = 36 k-tiles: 16-byte boxes, the same buffers). So K/128
must be a multiple of 4 (Qwen3's FC2, K 768 = 6 k-tiles, and Inkling2's FC2, 18, cannot).

Why no deadlock: a chunk's copies wait only for consumers to finish k-tiles that are already in the
pipeline (the chunk two back), never for later loads.

The host class provides ``tile_m``, ``k_tiles``, ``num_b``, ``n_out``, ``tile_threads``,
``overlap_chunk`` and ``unit_kc`` (:func:`unit_scale_kc` of ``k_tiles``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

#: k-tiles whose scales one chunk loads (a divisor of K/128; 8 x 128 rows x 4 B = 4 KB of A scales)
UNIT_SCALE_KC = 8
#: drop v106: where K/128 is a multiple of 4 but not of 8 (Inkling2's FC1, K 4608: 36 k-tiles), a chunk
#: loads 4 k-tiles' scales (TMA's 16-byte boxes and global strides still hold); the buffers keep their size
UNIT_SCALE_KC_SMALL = 4
#: float32 slots per buffer: the A box (128 x KC), then one 128-byte-aligned slot of KC weight-block
#: scales per weight block (gate, up)
UNIT_SCALE_B_SLOT = 32
UNIT_SCALE_BUF = 128 * UNIT_SCALE_KC + 2 * UNIT_SCALE_B_SLOT
#: buffers (chunk c uses buffer c % 2)
UNIT_SCALE_BUFS = 2


def unit_scale_kc(k_tiles: int) -> int:
    """k-tiles per scale chunk of a k-loop of ``k_tiles``: UNIT_SCALE_KC where it divides K/128, else
    UNIT_SCALE_KC_SMALL where that does (drop v106), else 0 (``unit_scales`` cannot run)."""
    return next((kc for kc in (UNIT_SCALE_KC, UNIT_SCALE_KC_SMALL) if k_tiles % kc == 0), 0)


def unit_scales_reason(k_tiles: int, overlap_chunk: int) -> "str | None":
    """None if ``unit_scales`` can run a k-loop of ``k_tiles`` (chunked schedule: ``overlap_chunk``
    k-tiles per traced chunk, 0 when unrolled), else why not."""
    kc = unit_scale_kc(k_tiles)
    if not kc:
        return (f"unit_scales loads the scales of {UNIT_SCALE_KC} (or {UNIT_SCALE_KC_SMALL}) k-tiles per TMA "
                f"copy: K/128 = {k_tiles} must be a multiple of {UNIT_SCALE_KC_SMALL}")
    if overlap_chunk and overlap_chunk % kc != 0:
        return f"unit_scales needs the chunked schedule's chunk ({overlap_chunk} k-tiles) to be a multiple of {kc}"
    return None


class UnitScales:
    """Mixin of :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`: the ``unit_scales`` pieces."""

    def _unit_scale_atoms(self, mAScale, mBScale):
        """Host (traced): ``(atom_as, tma_as, atom_bs, tma_bs)``. A scales: boxes of 128 rows x KC
        k-tiles of ``mAScale`` [M, K/128]. Weight-block scales: boxes of 1 x KC of
        ``mBScale`` viewed as [N/128, K/128, E]."""
        kc = self.unit_kc
        atom_as, tma_as = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mAScale,
            cute.make_layout((self.tile_m, kc), stride=(kc, 1)), (self.tile_m, kc))
        mBS_nke = cute.make_tensor(mBScale.iterator, cute.select(mBScale.layout, mode=[1, 2, 0]))
        atom_bs, tma_bs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mBS_nke, cute.make_layout((1, kc), stride=(kc, 1)), (1, kc))
        return atom_as, tma_as, atom_bs, tma_bs

    def _unit_scale_bytes(self) -> int:
        """Bytes one chunk's copies bring (the "full" barrier's transaction count)."""
        return (self.tile_m + self.num_b) * self.unit_kc * 4

    @cute.jit
    def _load_unit_scales(self, us, us_bar, chunk, row0, expert, n0, lane):
        """TMA warp, at the first k-tile of a chunk: wait until every consumer thread is done with
        the buffer (chunk - 2's), arm its "full" barrier with the chunk's bytes and issue the copies.
        ``us`` = ``(atom_as, tma_as, atom_bs, tma_bs, sUS)``; ``chunk`` counts this CTA's chunks."""
        atom_as, tma_as, atom_bs, tma_bs, sUS = us
        kc = self.unit_kc
        buf = chunk % UNIT_SCALE_BUFS
        k_chunk = chunk % (self.k_tiles // kc)  # the chunk's place in its unit
        cute.arch.mbarrier_wait(us_bar + UNIT_SCALE_BUFS + buf, ((chunk // UNIT_SCALE_BUFS) % 2) ^ 1)
        full = us_bar + buf
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full, self._unit_scale_bytes())
        sA = cute.make_tensor(sUS.iterator + buf * UNIT_SCALE_BUF,
                              cute.make_layout((self.tile_m, kc), stride=(kc, 1)))
        gA = cute.local_tile(cute.domain_offset((row0, 0), tma_as), (self.tile_m, kc), (0, None))
        tAs, tAg = cpasync.tma_partition(atom_as, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                         cute.group_modes(gA, 0, 2))
        cute.copy(atom_as, tAg[(None, k_chunk)], tAs, tma_bar_ptr=full)
        for h in cutlass.range_constexpr(self.num_b):
            sB = cute.make_tensor(sUS.iterator + buf * UNIT_SCALE_BUF + self.tile_m * kc + h * UNIT_SCALE_B_SLOT,
                                  cute.make_layout((1, kc), stride=(kc, 1)))
            gB = cute.local_tile(cute.domain_offset(((n0 + h * self.n_out) // 128, 0, 0), tma_bs), (1, kc),
                                 (0, None, expert))
            tBs, tBg = cpasync.tma_partition(atom_bs, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                             cute.group_modes(gB, 0, 2))
            cute.copy(atom_bs, tBg[(None, k_chunk)], tBs, tma_bar_ptr=full)

    @cute.jit
    def _read_unit_scales(self, sUS, us_bar, chunk, j: cutlass.Constexpr, r_lo, r_hi):
        """Consumer thread: ``(a_scale[r_lo], a_scale[r_hi], b_scale gate, b_scale up)`` of k-tile
        ``j`` of chunk ``chunk`` (this CTA's count). Waits for the chunk's copies at j = 0 and
        arrives on the buffer's "empty" barrier after j = KC - 1 (release: the reads come first)."""
        kc = self.unit_kc
        buf = chunk % UNIT_SCALE_BUFS
        if cutlass.const_expr(j == 0):
            cute.arch.mbarrier_wait(us_bar + buf, (chunk // UNIT_SCALE_BUFS) % 2)
        base = buf * UNIT_SCALE_BUF
        sa_lo = sUS[base + r_lo * kc + j]
        sa_hi = sUS[base + r_hi * kc + j]
        sb0 = sUS[base + self.tile_m * kc + j]
        sb1 = sb0
        if cutlass.const_expr(self.num_b > 1):
            sb1 = sUS[base + self.tile_m * kc + UNIT_SCALE_B_SLOT + j]
        if cutlass.const_expr(j == kc - 1):
            cute.arch.mbarrier_arrive(us_bar + UNIT_SCALE_BUFS + buf)
        return sa_lo, sa_hi, sb0, sb1
