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

Producer: TMA cannot gather rows on SM90, so the whole producer warpgroup loads A with 16-byte
``cp.async`` copies into the swizzled stage (the same bytes TMA would write): eight consecutive
lanes cover one row's 128 bytes of a k-tile, so each warp instruction reads four whole 128-byte
lines (drop v23; v22 gave each thread one row, and a warp instruction then read 16 bytes of 32
different lines: half of every 32-byte L2 sector wasted, FC1 2.2x slower than with TMA); thread t
owns rows t / 8 + 16 i (i < 8) of the tile at bytes 16 (t % 8). Then ``cp.async.mbarrier.arrive
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
        lanes_per_row = self.tile_k // vec  # 8: a row's bytes of one k-tile, one 128-byte line
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                                   num_bits_per_copy=128)
        # eight consecutive threads per row: thread t -> row t / 8 (+ 16 per pass), bytes 16 (t % 8)
        tiled_copy = cute.make_tiled_copy_tv(
            atom, cute.make_layout((self.threads_per_wg // lanes_per_row, lanes_per_row), stride=(lanes_per_row, 1)),
            cute.make_layout((1, vec)))
        thr_copy = tiled_copy.get_slice(tidx)
        tAsA = thr_copy.partition_D(sA)  # (CPY, passes, 1, stages)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))  # (row, col) of each
        passes = cute.size(tAsA, mode=[1])
        k_size = self.k_tiles * self.tile_k
        a_base = mA.iterator.toint()
        col = tAcA[(0, 0, 0)][1]
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            # this thread's source rows (a row past the expert's end loads its last row: never stored)
            srcs = [mIdx[cutlass.min(row0 + tAcA[(0, i, 0)][0], row_end - 1)] for i in range(passes)]
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
                for i in cutlass.range_constexpr(passes):
                    dst = tAsA[(None, i, 0, prod_state.index)]
                    p_src = cute.make_ptr(self.ab_dtype,
                                          a_base + cutlass.Int64(srcs[i]) * k_size + k_tile * self.tile_k + col,
                                          cute.AddressSpace.gmem, assumed_align=16)
                    cute.copy(atom, cute.make_tensor(p_src, cute.make_layout(dst.shape)), dst)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                prod_state.advance()
            tile_id = tile_id + gdim
        if warp_idx == 0:
            ab_pipeline.producer_tail(prod_state)
