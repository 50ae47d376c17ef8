"""The producer warpgroup of a grouped GEMM whose A rows are gathered by index (drop v23): the BF16
gathering GEMM's (:mod:`.grouped_gemm_gather`; the FP8 one, v22, was removed in v87), and the
stage barrier's producer count every GEMM of the drop shares (:func:`stage_producers`).

TMA cannot gather rows on SM90, so the whole producer warpgroup (128 threads) loads A with 16-byte
``cp.async`` copies into the swizzled stage, the same bytes TMA would write: a k-tile row is one
128-byte line (128 e4m3 or 64 bf16 values), eight consecutive lanes cover it, so each warp
instruction reads four whole lines; thread t owns rows t / 8 + 16 i (i < 8) of the tile at bytes
16 (t % 8) (drop v22 gave each thread a whole row: a warp instruction then read 16 bytes of 32
different lines, half of every 32-byte L2 sector wasted, and FC1 ran 2.2x slower than with TMA on
the H200). ``cp.async.mbarrier.arrive.noinc`` then makes the stage's full barrier count that
thread's copies when they land; warp 0 issues B's TMA after its ``arrive.expect_tx`` of B's bytes,
so the full barriers are initialised for 1 + 128 arrivals (the host kernel's ``_body`` does that
when ``gather_a`` is set). A tile's rows past the expert's end load the expert's last row (never
stored). Needs K % tile_k == 0 (no K tail: a cp.async does not zero-fill past the row).

Drop v85 removed the row-by-row TMA producer (v41 ``gather_tma``: one TMA per 128-byte row cost
~53 cycles of the issuing warp, 13.5x a tile load per byte; FC1 0.892 ms against 0.768 with cp.async
rows, 16th session) and the L2 priorities (v75 ``gather_l2``: the gathering FC1 3% slower, the layer
no faster, 33rd session).

The host class provides ``num_stages``, ``ab_dtype``, ``tile_m``, ``tile_n``, ``tile_k``,
``k_tiles``, ``threads_per_wg``, ``num_b``, ``n_out``, ``_locate``, ``_n0`` and ``_b_views``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync


def stage_producers(kernel, a_smem_one, b_smem_one):
    """``(tx_bytes, producer group)`` of a stage's full barrier: every operand by TMA, one arrival
    with all bytes (plus the scale warp's with ``kernel.scale_warp``); with ``kernel.gather_a``, B's bytes from warp 0's TMA arrival plus one cp.async
    arrival per producer thread (its A rows). Shared by the BF16 and FP8 kernels' ``_body``."""
    b_bytes = kernel.num_b * cute.size_in_bytes(kernel.ab_dtype, b_smem_one)
    if kernel.gather_a:
        return b_bytes, pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + kernel.threads_per_wg)
    # FP8 drop v35 (``scale_warp``): a second arrival per stage, the scale warp's
    arrivals = 2 if getattr(kernel, "scale_warp", False) else 1
    return (cute.size_in_bytes(kernel.ab_dtype, a_smem_one) + b_bytes,
            pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals))


class GatherAProducer:
    """Mixin: ``_produce_gathered`` (cp.async), the producer warpgroup's loop (module docstring)."""

    # plain methods, traced inline into the producer loops (their loops are over compile-time values)
    def _arm_stage_copy_b(self, ab_pipeline, prod_state, tma_atom_b, tBsB_p, tBgBs, k_tile, bar):
        """Warp 0: the stage's one elected arrive on its full barrier (with the bytes the pipeline
        expects) and B's TMA copies of k-tile ``k_tile``."""
        ab_pipeline.sync_object_full.arrive(prod_state.index, ab_pipeline.producer_mask)
        for h in range(self.num_b):
            cute.copy(tma_atom_b, tBgBs[h][(None, k_tile)], tBsB_p[(None, prod_state.index * self.num_b + h)],
                      tma_bar_ptr=bar)

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
        a_base = mA.iterator.toint()  # bytes
        elem_bytes = self.ab_dtype.width // 8
        col = tAcA[(0, 0, 0)][1]
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            # this thread's source rows (a row past the expert's end loads its last row: never stored)
            srcs = [mIdx[cutlass.min(row0 + tAcA[(0, i, 0)][0], row_end - 1)] for i in range(passes)]
            tBsB_p, tBgBs = self._b_views(tma_atom_b, mB_tma, tBsB, self._n0(n_tile), expert, 0)
            for k_tile in range(self.k_tiles):
                ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
                bar = ab_pipeline.producer_get_barrier(prod_state)
                if warp_idx == 0:  # B: one elected arrive with B's bytes, then its TMA copies
                    self._arm_stage_copy_b(ab_pipeline, prod_state, tma_atom_b, tBsB_p, tBgBs, k_tile, bar)
                for i in cutlass.range_constexpr(passes):
                    dst = tAsA[(None, i, 0, prod_state.index)]
                    offset = cutlass.Int64(srcs[i]) * k_size + k_tile * self.tile_k + col  # in values
                    if cutlass.const_expr(elem_bytes != 1):
                        offset = offset * elem_bytes  # a_base is a byte address
                    p_src = cute.make_ptr(self.ab_dtype, a_base + offset, cute.AddressSpace.gmem, assumed_align=16)
                    cute.copy(atom, cute.make_tensor(p_src, cute.make_layout(dst.shape)), dst)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                prod_state.advance()
            tile_id = tile_id + gdim
        if warp_idx == 0:
            ab_pipeline.producer_tail(prod_state)
