"""The producer warpgroup of a grouped GEMM whose A rows are gathered by index (drop v23), shared by
the FP8 (:mod:`.fp8_gather`) and BF16 (:mod:`.grouped_gemm_gather`) gathering GEMMs.

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

``gather_tma`` (drop v41; not yet run on a GPU): the same rows by TMA, one 2-D load per row -- a box
of one row by ``tile_k`` values (128 bytes) with the A tile's 128-byte swizzle, aimed at the row's
place ``base + 128 r`` in the stage -- if the TMA unit swizzles by the shared-memory address, as
:mod:`.tma_rows_probe` checks, these are the bytes the tile load of the gathered rows writes. The
stage's full barrier is then the plain kernel's (one ``arrive.expect_tx`` of A's and B's bytes by
warp 0); each producer warp issues its 32 rows one at a time (CuTeDSL's TMA copy elects one lane,
so the row index is made warp-uniform by a shuffle). K needs no tail (K % tile_k == 0).

``gather_l2`` (drop v75; BF16, cp.async rows; not yet run on a GPU): L2 eviction priorities for the
layer's FC1, where the token rows (33 MB for 8192 Qwen3 tokens, each read by its K experts' tiles)
fall out of the 50 MB L2 between their uses while the weights stream through it (32nd session: the
gathering FC1 ran 106 us longer than the plain one in the layer, 43 us in the runner, whose one
token tensor stays in L2). 1: each gathered row's ``cp.async`` carries an ``evict_last`` policy
(``createpolicy.fractional``, fraction 1.0); 2: also ``evict_first`` on the weight tiles' TMA loads.
CuTeDSL's cp.async atom takes no cache policy, so these copies are inline PTX aimed at the physical
(swizzled) shared address: the A stage is 1024-byte aligned and its rows are 128-byte lines under
the 128-byte swizzle, so byte address ``a`` lands at ``a ^ (((a >> 7) & 7) << 4)``, the address
the atom's copy computes.

The host class provides ``num_stages``, ``ab_dtype``, ``tile_m``, ``tile_n``, ``tile_k``,
``k_tiles``, ``threads_per_wg``, ``num_b``, ``n_out``, ``_locate`` and ``_n0``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

#: ``gather_l2`` levels: 0 none, 1 gathered rows evict_last, 2 and weight tiles evict_first
GATHER_L2_LEVELS = (0, 1, 2)


@dsl_user_op
def _l2_policy(priority: str, *, loc=None, ip=None):
    """A 64-bit L2 cache policy giving every line it touches ``priority`` ("evict_last" or
    "evict_first")."""
    return cutlass.Int64(llvm.inline_asm(T.i64(), [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
                                         has_side_effects=True, is_align_stack=False,
                                         asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _cp_async_16_policy(dst_smem, src_gmem, policy, *, loc=None, ip=None):
    """16 bytes global -> shared (``cp.async.cg``, L2 only) under the L2 cache ``policy``;
    ``dst_smem`` is the physical shared::cta byte address."""
    args = [cutlass.Int32(dst_smem).ir_value(loc=loc, ip=ip), cutlass.Int64(src_gmem).ir_value(loc=loc, ip=ip),
            cutlass.Int64(policy).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args, "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, 16, $2;", "r,l,l",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _swizzle_128b(addr):
    """Physical shared address of byte ``addr`` of a 1024-byte aligned buffer of 128-byte rows
    under the 128-byte swizzle (16-byte chunk c of row r lands in chunk c ^ (r % 8))."""
    return addr ^ (((addr >> 7) & 7) << 4)


def stage_producers(kernel, a_smem_one, b_smem_one):
    """``(tx_bytes, producer group)`` of a stage's full barrier: every operand by TMA, one arrival
    with all bytes (plus the scale warp's with ``kernel.scale_warp``); with ``kernel.gather_a``, B's bytes from warp 0's TMA arrival plus one cp.async
    arrival per producer thread (its A rows). Shared by the BF16 and FP8 kernels' ``_body``."""
    b_bytes = kernel.num_b * cute.size_in_bytes(kernel.ab_dtype, b_smem_one)
    if kernel.gather_a and not getattr(kernel, "gather_tma", False):
        return b_bytes, pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + kernel.threads_per_wg)
    # FP8 drop v35 (``scale_warp``): a second arrival per stage, the scale warp's
    arrivals = 2 if getattr(kernel, "scale_warp", False) else 1
    return (cute.size_in_bytes(kernel.ab_dtype, a_smem_one) + b_bytes,
            pipeline.CooperativeGroup(pipeline.Agent.Thread, arrivals))


def row_layout(a_smem_layout, tile_k: int):
    """One k-tile row of the A tile under the tile's swizzle: ``(1, tile_k)``, 128 bytes."""
    return cute.make_composed_layout(a_smem_layout.inner, 0, cute.make_layout((1, tile_k), stride=(tile_k, 1)))


def row_tma_atom(mA, a_smem_layout, tile_k: int):
    """``(atom, tma tensor)`` loading one row's k-tile of ``mA`` [T_src, K] per copy (``gather_tma``)."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, row_layout(a_smem_layout, tile_k),
                                       (1, tile_k))


class GatherAProducer:
    """Mixin: ``_produce_gathered`` (cp.async) and ``_produce_gathered_tma`` (one TMA per row), the
    producer warpgroup's loops (module docstring)."""

    gather_tma = False
    gather_l2 = 0

    # plain methods, traced inline into the producer loops (their loops are over compile-time values)
    def _b_views(self, tma_atom_b, mB_tma, tBsB, n_tile, expert):
        """``(smem view, [gmem view per weight block])`` of the unit's B tiles for TMA (gated: the
        gate rows, then the up rows ``n_out`` further)."""
        n0 = self._n0(n_tile)
        tBgBs = []
        for h in range(self.num_b):
            gB = cute.local_tile(cute.domain_offset((n0 + h * self.n_out, 0, 0), mB_tma),
                                 (self.tile_n, self.tile_k), (0, None, expert))
            tBsB_p, tBgB = cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(1), tBsB,
                                                 cute.group_modes(gB, 0, 2))
            tBgBs.append(tBgB)
        return tBsB_p, tBgBs

    def _arm_stage_copy_b(self, ab_pipeline, prod_state, tma_atom_b, tBsB_p, tBgBs, k_tile, bar, b_policy=None):
        """Warp 0: the stage's one elected arrive on its full barrier (with the bytes the pipeline
        expects) and B's TMA copies of k-tile ``k_tile`` (under L2 policy ``b_policy`` if given)."""
        ab_pipeline.sync_object_full.arrive(prod_state.index, ab_pipeline.producer_mask)
        hint = {} if b_policy is None else {"cache_policy": b_policy}
        for h in range(self.num_b):
            cute.copy(tma_atom_b, tBgBs[h][(None, k_tile)], tBsB_p[(None, prod_state.index * self.num_b + h)],
                      tma_bar_ptr=bar, **hint)

    @cute.jit
    def _produce_gathered_tma(self, ab_pipeline, mIdx, tma_atom_a, mA_tma, a_smem_layout, tma_atom_b, mB_tma,
                              sA_ptr, sB, sOff, sCum, total_tiles, tidx, warp_idx, lane, bidx, gdim):
        """The producer warpgroup (threads 0-127): row ``r`` of a stage's A tile by one TMA load of
        source row ``mIdx[row0 + r]`` (warp w issues rows 32 w .. 32 w + 31), B by TMA (warp 0)."""
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tBsB = cute.group_modes(sB, 0, 2)
        rows = row_layout(a_smem_layout, self.tile_k)
        a_base = sA_ptr  # A's stages, unswizzled: stage s, row r at element (s * tile_m + r) * tile_k
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            # this lane's row of the tile (past the expert's end: its last row, never stored)
            src = mIdx[cutlass.min(row0 + warp_idx * 32 + lane, row_end - 1)]
            tBsB_p, tBgBs = self._b_views(tma_atom_b, mB_tma, tBsB, n_tile, expert)
            for k_tile in range(self.k_tiles):
                ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
                bar = ab_pipeline.producer_get_barrier(prod_state)
                if warp_idx == 0:  # one arrive.expect_tx of A's and B's bytes, then B's TMA copies
                    self._arm_stage_copy_b(ab_pipeline, prod_state, tma_atom_b, tBsB_p, tBgBs, k_tile, bar)
                stage_rows = a_base + (prod_state.index * self.tile_m + warp_idx * 32) * self.tile_k
                for j in cutlass.range(32, unroll=4):
                    s_j = cute.arch.shuffle_sync(src, j)  # warp-uniform: the copy is issued by one lane
                    sR = cute.make_tensor(stage_rows + j * self.tile_k, rows)
                    gR = cute.local_tile(mA_tma, (1, self.tile_k), (s_j, k_tile))
                    tRs, tRg = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sR, 0, 2),
                                                     cute.group_modes(gR, 0, 2))
                    cute.copy(tma_atom_a, tRg, tRs, tma_bar_ptr=bar)
                prod_state.advance()
            tile_id = tile_id + gdim
        if warp_idx == 0:
            ab_pipeline.producer_tail(prod_state)

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
        # gather_l2 (drop v75): the rows' and (2) the weights' L2 policies, made once per thread
        a_policy = _l2_policy("evict_last") if cutlass.const_expr(self.gather_l2 >= 1) else None
        b_policy = _l2_policy("evict_first") if cutlass.const_expr(self.gather_l2 >= 2) else None
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            # this thread's source rows (a row past the expert's end loads its last row: never stored)
            srcs = [mIdx[cutlass.min(row0 + tAcA[(0, i, 0)][0], row_end - 1)] for i in range(passes)]
            tBsB_p, tBgBs = self._b_views(tma_atom_b, mB_tma, tBsB, n_tile, expert)
            for k_tile in range(self.k_tiles):
                ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
                bar = ab_pipeline.producer_get_barrier(prod_state)
                if warp_idx == 0:  # B: one elected arrive with B's bytes, then its TMA copies
                    self._arm_stage_copy_b(ab_pipeline, prod_state, tma_atom_b, tBsB_p, tBgBs, k_tile, bar,
                                           b_policy)
                for i in cutlass.range_constexpr(passes):
                    dst = tAsA[(None, i, 0, prod_state.index)]
                    offset = cutlass.Int64(srcs[i]) * k_size + k_tile * self.tile_k + col  # in values
                    if cutlass.const_expr(elem_bytes != 1):
                        offset = offset * elem_bytes  # a_base is a byte address
                    if cutlass.const_expr(self.gather_l2 >= 1):
                        _cp_async_16_policy(_swizzle_128b(dst.iterator.toint()), a_base + offset, a_policy)
                    else:
                        p_src = cute.make_ptr(self.ab_dtype, a_base + offset, cute.AddressSpace.gmem,
                                              assumed_align=16)
                        cute.copy(atom, cute.make_tensor(p_src, cute.make_layout(dst.shape)), dst)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                prod_state.advance()
            tile_id = tile_id + gdim
        if warp_idx == 0:
            ab_pipeline.producer_tail(prod_state)
