"""FP8 grouped GEMM that gathers its A rows by index (drop v22; SM90).

:class:`Fp8GatherGroupedGemmSm90` computes what :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`
computes for the grouped rows ``A[r] = mA[mIdx[r]]`` (scales ``mAScale[mIdx[r]]``) without those
rows ever being written: the MoE layer quantises each token once (T rows) instead of once per
expert choice (T * top_k grouped rows), and FC1 reads the E4M3 tokens where they are.

Tensors (torch view)::

    mA        [T_src, K]          float8_e4m3fn (or uint8 bits)   the source rows (tokens)
    mAScale   [T_src, K / 128]    float32                         their scales
    mIdx      [M_total]           int32      grouped row r reads source row mIdx[r] (< T_src)
    mB, mBScale, mC, mOffsets, mRowScale: as in the base class (mC [M_total, N_out] grouped rows)

Producer: TMA cannot gather rows on SM90, so the whole producer warpgroup loads A: thread t owns
row t of each 128-row tile and moves its 128 bytes of a k-tile as eight 16-byte ``cp.async``
copies into the swizzled stage (the same bytes TMA would write), then ``cp.async.mbarrier.arrive
.noinc`` makes the stage's full barrier count that thread's copies when they land. Warp 0 also
issues B's TMA after its ``arrive.expect_tx`` of B's bytes, so the barrier is initialised for 1 +
128 arrivals. Rows of the tile past the expert's end load the expert's last row (never stored).
The consumers are the base class's (any schedule: overlapped promotion, ``wide_gated``); only
their A-scale rows go through ``mIdx``. Same bits as the base kernel on ``mA[mIdx]``.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from .fp8_gemm import Fp8BlockScaledGroupedGemmSm90


class Fp8GatherGroupedGemmSm90(Fp8BlockScaledGroupedGemmSm90):
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

    @cute.jit
    def _produce_gathered(self, ab_pipeline, mA, mIdx, tma_atom_b, mB_tma, sA, sB, sOff, sCum, total_tiles,
                          tidx, warp_idx, bidx, gdim):
        """The producer warpgroup (threads 0-127): A rows by cp.async, B by TMA (warp 0)."""
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tBsB = cute.group_modes(sB, 0, 2)
        vec = 128 // self.ab_dtype.width  # values per 16-byte copy
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                                   num_bits_per_copy=128)
        # thread t: row t of the tile, tile_k / vec vectors along K
        tiled_copy = cute.make_tiled_copy_tv(atom, cute.make_layout((self.tile_m, 1)), cute.make_layout((1, vec)))
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA = thr_copy.partition_D(sA)  # (CPY, 1, tile_k / vec, stages)
        k_size = self.k_tiles * self.tile_k
        a_base = mA.iterator.toint()
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            src = mIdx[cutlass.min(row0 + tidx, row_end - 1)]
            p_row = cute.make_ptr(self.ab_dtype, a_base + cutlass.Int64(src) * k_size, cute.AddressSpace.gmem,
                                  assumed_align=16)
            # every row of this view is this thread's source row (row stride 0): the copy's
            # partition of a tile of it is that row's vectors
            gA = cute.local_tile(cute.make_tensor(p_row, cute.make_layout((self.tile_m, k_size), stride=(0, 1))),
                                 (self.tile_m, self.tile_k), (0, None))
            tAgA = thr_copy.partition_S(gA)  # (CPY, 1, tile_k / vec, k_tiles)
            n0 = self._n0(n_tile, 0)
            tBgBs = []
            for h in cutlass.range_constexpr(self.num_b):
                gB = cute.local_tile(cute.domain_offset((n0 + h * self.n_out, 0, 0), mB_tma),
                                     (self.tile_n, self.tile_k), (0, None, expert))
                tBsB_p, tBgB = cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(1), tBsB,
                                                     cute.group_modes(gB, 0, 2))
                tBgBs.append(tBgB)
            for k_tile in range(self.k_tiles):
                ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
                bar = ab_pipeline.producer_get_barrier(prod_state)
                if warp_idx == 0:  # B: one elected arrive with B's bytes, then its TMA copies
                    ab_pipeline.sync_object_full.arrive(prod_state.index, ab_pipeline.producer_mask)
                    for h in cutlass.range_constexpr(self.num_b):
                        cute.copy(tma_atom_b, tBgBs[h][(None, k_tile)],
                                  tBsB_p[(None, prod_state.index * self.num_b + h)], tma_bar_ptr=bar)
                cute.copy(tiled_copy, tAgA[(None, None, None, k_tile)], tAsA[(None, None, None, prod_state.index)])
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                prod_state.advance()
            tile_id = tile_id + gdim
        if warp_idx == 0:
            ab_pipeline.producer_tail(prod_state)
