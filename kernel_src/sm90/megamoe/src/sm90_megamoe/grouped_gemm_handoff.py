"""FC2 that starts inside FC1's last wave (drop v112; SM90 BF16; opt-in).

Both GEMMs of a layer are persistent (one CTA per SM, every ``gdim``-th tile). FC2 launches under
PDL while FC1 runs, but each of its CTAs waits (``griddepcontrol.wait``) for the whole of FC1, so
the SMs whose FC1 CTA has no tile in FC1's last wave sit idle until the wave ends (Qwen3 at 8192
tokens: FC1's 3474 tiles are 26.3 waves, ~16.5 us of the whole GPU, ``bench.schedule_model``).
Here FC2 waits only for the FC1 tiles of the m-tile it reads:

* :class:`GroupedGemmPublishSm90` (FC1; cooperative / wide, ``cluster_m`` 1 or 2). At the top of its
  last tile a CTA's consumer warps fence their earlier stores (``fence.acq_rel.gpu``, then a named
  barrier), and one thread adds 1 to the pending count of that last tile's m-tile and then 1,
  with release, to ``early_done``; a CTA without a tile adds only the latter. After the last tile's
  stores the same fence and barrier, and the thread takes 1 off the pending count (release). So
  once ``early_done`` equals the FC1 grid, every FC1 tile but the CTAs' last ones is stored and
  those last ones are counted in ``pending``. Two fences per CTA, not one per tile (a gpu-scope
  fence per tile stalls the consumers: drop v37).
* :class:`GroupedGemmAwaitSm90` (FC2; any TMA schedule). Its first statement triggers its
  successor's launch and, instead of ``griddepcontrol.wait``, spins (``ld.acquire.gpu``) until
  ``early_done`` equals ``publishers`` (FC1's grid). Before a tile's first A load the TMA warp
  spins until its m-tile's pending count is 0, then issues ``fence.proxy.async.global`` (its TMA
  reads what FC1 stored through the generic proxy). Its last statement is ``griddepcontrol.wait``,
  so FC2 still ends after FC1: the next kernel's wait on FC2 still covers every kernel before.
* Drop v114, the awaiting FC2 in single CTAs: tiles are claimed, not dealt. A CTA's first tile is its
  block index; its TMA warp claims each later one from a tile counter in the sync buffer (``gdim`` +
  the counter's old value) and passes it to the consumer warps through a 2-entry shared-memory ring.
  With every ``gdim``-th tile (v112; clusters still) the CTAs that start early still did only their
  own share, and FC2 ended when it did (an H100, 61st session); claimed, the early CTAs take more.

Why the early gate is correct without the grid wait: FC2's CTAs are placed only after every FC1
CTA has passed its own ``griddepcontrol.wait`` (FC1 triggers right after it), so the layout
kernel's offsets and row weights are complete; the acquire of ``early_done`` (after FC1's release)
orders FC2's reads of them, and its A rows are ordered by the per-m-tile acquire. FC2 writes its
output over FC1's input in the layer (``y`` = ``xs``): an m-tile is written only after FC1 has read
it, and a partial tile of the expert before may still read its rows past that expert's end, which
it computes and never stores.

A tile's m-tile slot is ``row0 // tile_m + expert`` (``row0``: the tile's first grouped row): the
same in both GEMMs whatever their scheduler's numbering (pairs in clusters), distinct for distinct
m-tiles and below ``ceil(M_total / tile_m) + E``.

The sync buffer ``mSync`` [S + 4] int32 (:func:`handoff_sync_len`, zero before the first launch):
pending counts [0, S), then ``early_done``, ``finished``, the tile counter (drop v114; unused by clusters)
and an error word (the last). It is tail-clean: every pending count returns to 0 (FC2 waits for each),
and the last FC2 CTA to finish (``finished``) zeroes ``early_done``, ``finished`` and the tile counter
-- each FC2 CTA passed the gate first, so no FC1 increment is left, and made its last claim before its
``finished`` increment. The error word is 1 + the slot of a wait that timed out (``S + 1`` for the
gate), 0 otherwise; the kernels never clear it. After a timeout the buffer must be zeroed.

Same WGMMAs, stages and epilogue as :class:`.grouped_gemm.GroupedGemmSm90`: the same bits.

Tensors: as :class:`.grouped_gemm.GroupedGemmSm90`, then ``mSync`` [S + 4] int32 (both), then for
FC2 ``publishers`` (Int32: the CTAs FC1 was launched with).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64

from .grouped_gemm import GroupedGemmSm90

#: slots after the S pending counts: early_done, finished, the tile counter (drop v114), error word (the last)
HANDOFF_SYNC_TAIL = 4
#: entries of the awaiting FC2's tile ring (drop v114): pingpong's warpgroups each read one of the two
TILE_RING = 2
#: how long a wait spins before it records an error and goes on (a legitimate wait is at most one
#: FC1 tile: microseconds); once the error word is set every other wait stops at its next poll
HANDOFF_TIMEOUT_NS = 1_000_000_000


def handoff_sync_len(rows: int, num_experts: int, tile_m: int = 128) -> int:
    """Length of ``mSync`` for calls of at most ``rows`` grouped rows over ``num_experts`` experts."""
    return (int(rows) + tile_m - 1) // tile_m + int(num_experts) + HANDOFF_SYNC_TAIL


def handoff_class(role: str):
    """The kernel class of ``role``: "publish" (FC1) or "await" (FC2)."""
    classes = {"publish": GroupedGemmPublishSm90, "await": GroupedGemmAwaitSm90}
    if role not in classes:
        raise ValueError(f"handoff must be 'publish' or 'await', got {role!r}")
    return classes[role]


def _gptr(addr: Int64):
    return cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)


class _HandoffSlots:
    """The sync buffer's addresses (module docstring)."""

    @staticmethod
    def _sync(mSync: cute.Tensor):
        """``(byte address of mSync, S)``: pending [0, S), early_done S, finished S + 1, the tile counter
        S + 2, error S + 3."""
        return mSync.iterator.toint(), mSync.shape[0] - HANDOFF_SYNC_TAIL

    @staticmethod
    def _word(base, i):
        return _gptr(base + Int64(i) * 4)


class GroupedGemmPublishSm90(_HandoffSlots, GroupedGemmSm90):
    """FC1 that publishes its CTAs' progress for :class:`GroupedGemmAwaitSm90` (module docstring).
    Cooperative or wide schedule, ``cluster_m`` 1 or 2; not pingpong (a CTA's last two tiles belong to
    different warpgroups), gathering or ``cluster_n``."""

    handoff = "publish"

    def __init__(self, activation: str, **kw):
        super().__init__(activation, **kw)
        if self.pingpong or self.gather_a or self.cluster_n > 1:
            raise ValueError("the publishing FC1 runs the cooperative or wide schedule (not pingpong, "
                             "gather_a or cluster_n)")

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mOffsets: cute.Tensor,
                 mRowScale: cute.Tensor, mBias: cute.Tensor, mSync: cute.Tensor, max_active_ctas: cutlass.Int32,
                 stream: cuda.CUstream):
        self._check_inputs(mA, mB, mC, mOffsets, mBias)
        setup = self._setup(mA, mB, mOffsets)
        self._launch(self.kernel_publish(setup[0], setup[1], setup[2], setup[3], mC, mOffsets, mRowScale, mBias,
                                         *setup[4:], mSync), max_active_ctas, stream)

    @cute.kernel
    def kernel_publish(self, tma_atom_a: cute.CopyAtom, mA_tma: cute.Tensor, tma_atom_b: cute.CopyAtom,
                       mB_tma: cute.Tensor, mC: cute.Tensor, mOffsets: cute.Tensor, mRowScale: cute.Tensor,
                       mBias: cute.Tensor, tiled_mma: cute.TiledMma, tiled_mma_epi: cute.TiledMma,
                       a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
                       b_smem_layout_main: cute.ComposedLayout, mSync: cute.Tensor):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffsets, mRowScale, mBias, tiled_mma, tiled_mma_epi,
                   a_smem_layout, b_smem_layout, b_smem_layout_main, handoff=(mSync, None))

    @cute.jit
    def _publish_last_start(self, handoff, expert: Int32, row0: Int32, row_end: Int32, mma_tidx: Int32,
                            barrier):
        """Consumer warps, at the top of the CTA's last tile: count that tile as pending, then this CTA
        as past its other tiles (release, after every consumer thread's fence of its earlier stores)."""
        base, slots = self._sync(handoff[0])
        cute.arch.fence_acq_rel_gpu()
        barrier.arrive_and_wait()
        if mma_tidx == 0:
            if row_end > row0:
                cute.arch.red(self._word(base, row0 // self.tile_m + expert), Int32(1), op="add", dtype="s32",
                              sem="relaxed", scope="gpu")
            cute.arch.red(self._word(base, slots), Int32(1), op="add", dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def _publish_no_tile(self, handoff, mma_tidx: Int32):
        """A CTA without a tile: past its (no) other tiles at once."""
        base, slots = self._sync(handoff[0])
        if mma_tidx == 0:
            cute.arch.red(self._word(base, slots), Int32(1), op="add", dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def _publish_last_done(self, handoff, expert: Int32, row0: Int32, row_end: Int32, mma_tidx: Int32, barrier):
        """Consumer warps, after the last tile's stores: its m-tile's pending count down by one (release)."""
        base, _ = self._sync(handoff[0])
        cute.arch.fence_acq_rel_gpu()
        barrier.arrive_and_wait()
        if mma_tidx == 0:
            if row_end > row0:
                cute.arch.red(self._word(base, row0 // self.tile_m + expert), Int32(-1), op="add", dtype="s32",
                              sem="release", scope="gpu")


class GroupedGemmAwaitSm90(_HandoffSlots, GroupedGemmSm90):
    """FC2 that starts before FC1 has ended and waits per m-tile (module docstring). Every TMA
    schedule (cooperative, wide, pingpong; ``cluster_m`` or ``cluster_n`` 2); not gathering."""

    handoff = "await"

    def __init__(self, activation: str, **kw):
        super().__init__(activation, **kw)
        if self.gather_a:
            raise ValueError("the awaiting GEMM loads A by TMA (not gather_a)")
        # drop v114: single CTAs claim their tiles (a cluster's CTAs would have to claim theirs together)
        self.dynamic_tiles = self.ctas_per_cluster == 1

    def _storage_fields(self, num_experts: int, a_smem_layout, b_smem_layout) -> dict:
        """The plain kernel's fields, then (dynamic tiles) the ring's full and empty barriers and its
        entries: ``(tile id, the CTA's next tile id)`` each."""
        fields = super()._storage_fields(num_experts, a_smem_layout, b_smem_layout)
        if self.dynamic_tiles:
            fields["tile_mbar"] = cute.struct.MemRange[cutlass.Int64, 2 * TILE_RING]
            fields["tile_ids"] = cute.struct.MemRange[cutlass.Int32, 2 * TILE_RING]
        return fields

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mOffsets: cute.Tensor,
                 mRowScale: cute.Tensor, mBias: cute.Tensor, mSync: cute.Tensor, publishers: cutlass.Int32,
                 max_active_ctas: cutlass.Int32, stream: cuda.CUstream):
        self._check_inputs(mA, mB, mC, mOffsets, mBias)
        setup = self._setup(mA, mB, mOffsets)
        self._launch(self.kernel_await(setup[0], setup[1], setup[2], setup[3], mC, mOffsets, mRowScale, mBias,
                                       *setup[4:], mSync, publishers), max_active_ctas, stream)

    @cute.kernel
    def kernel_await(self, tma_atom_a: cute.CopyAtom, mA_tma: cute.Tensor, tma_atom_b: cute.CopyAtom,
                     mB_tma: cute.Tensor, mC: cute.Tensor, mOffsets: cute.Tensor, mRowScale: cute.Tensor,
                     mBias: cute.Tensor, tiled_mma: cute.TiledMma, tiled_mma_epi: cute.TiledMma,
                     a_smem_layout: cute.ComposedLayout, b_smem_layout: cute.ComposedLayout,
                     b_smem_layout_main: cute.ComposedLayout, mSync: cute.Tensor, publishers: Int32):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffsets, mRowScale, mBias, tiled_mma, tiled_mma_epi,
                   a_smem_layout, b_smem_layout, b_smem_layout_main, handoff=(mSync, publishers))

    @cute.jit
    def _spin(self, base, slots, word: Int32, want: Int32, err: Int32):
        """Spin (acquire) until ``mSync[word] == want``; a timeout records ``err`` in the error word and
        a recorded error ends every wait."""
        t0 = cute.arch.globaltimer()
        state = Int32(0)  # 1: reached; 2: this wait timed out; 3: another one did
        while state == Int32(0):
            if cute.arch.load(self._word(base, word), Int32, sem="acquire", scope="gpu") == want:
                state = Int32(1)
            else:  # only a wait that does not succeed at once polls the error word and the clock
                if cute.arch.load(self._word(base, slots + 3), Int32, sem="relaxed", scope="gpu") != Int32(0):
                    state = Int32(3)
                if cute.arch.globaltimer() - t0 > Int64(HANDOFF_TIMEOUT_NS):
                    state = Int32(2)
        if state == Int32(2):
            cute.arch.store(self._word(base, slots + 3), err)

    @cute.jit
    def _await_gate(self, handoff):
        """Every thread, first: FC1's CTAs are all past their other tiles (``early_done``)."""
        base, slots = self._sync(handoff[0])
        self._spin(base, slots, slots, handoff[1], slots + 1)

    @cute.jit
    def _await_m_tile(self, handoff, expert: Int32, row0: Int32, row_end: Int32):
        """The TMA warp, before a tile's first A load: FC1 has stored the tile's m-tile."""
        if row_end > row0:
            base, slots = self._sync(handoff[0])
            slot = row0 // self.tile_m + expert
            self._spin(base, slots, slot, Int32(0), slot + 1)
        # the TMA loads that follow (async proxy) must see what FC1 stored through the generic proxy
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def _finish_await(self, handoff, lane: Int32, ctas: Int32):
        """The TMA warp, after its last tile: the grid's last CTA zeroes ``early_done``, ``finished`` and
        the tile counter (every CTA passed the gate, so FC1 adds nothing more, and every CTA's claims came
        before its ``finished`` increment)."""
        base, slots = self._sync(handoff[0])
        if lane == 0:
            if cute.arch.atomic_add(self._word(base, slots + 1), Int32(1), sem="acq_rel", scope="gpu") == ctas - 1:
                cute.arch.store(self._word(base, slots), Int32(0))
                cute.arch.store(self._word(base, slots + 1), Int32(0))
                if cutlass.const_expr(self.dynamic_tiles):
                    cute.arch.store(self._word(base, slots + 2), Int32(0))

    # ---------------------------------------------------------------- drop v114: dynamic tiles
    # Why: with every gdim-th tile per CTA, the CTAs that start early (on the SMs FC1's last wave left
    # idle) still do only their own share, so FC2 ends when it did (drop v112 on an H100: no gain). Here
    # a CTA's first tile is its block index and each later one is claimed from the tile counter, so the
    # early CTAs take more tiles. A tile's arithmetic does not depend on the CTA: the bits stay the same.
    # The producer warp claims one tile ahead (the atomic's latency hides behind the current tile's
    # loads) and passes ``(tile, next)`` through a 2-entry ring; pingpong's warpgroup w reads entry w
    # of each pair, so ``next`` tells it whether the other warpgroup has a tile (the turn hand-off). A
    # tile id >= the tile count ends a consumer's loop: two such entries in pingpong, one otherwise.

    @cute.jit
    def _tile_ring(self, storage):
        """``(ring, sIds)``: the ring's pipeline (producer: the TMA warp's 32 threads; consumer: the
        threads that own a tile) and its entries ``sIds`` [2 * TILE_RING] Int32."""
        ring = pipeline.PipelineAsync.create(
            barrier_storage=storage.tile_mbar.data_ptr(),
            num_stages=TILE_RING,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
            defer_sync=True,  # the mainloop pipeline's create() fences and syncs the CTA after it
        )
        return ring, storage.tile_ids.get_tensor(cute.make_layout(2 * TILE_RING))

    @cute.jit
    def _claim_tile(self, handoff, lane: Int32, gdim: Int32, tile_id: Int32, total: Int32):
        """Lane 0 of the TMA warp: the CTA's tile after ``tile_id`` (``gdim`` + the counter's old value:
        tiles below ``gdim`` are the CTAs' first); ``total`` once ``tile_id`` is past the end and on the
        other lanes (the caller broadcasts lane 0's value)."""
        claimed = total
        if tile_id < total:
            if lane == 0:
                base, slots = self._sync(handoff[0])
                claimed = gdim + cute.arch.atomic_add(self._word(base, slots + 2), Int32(1), sem="relaxed",
                                                      scope="gpu")
        return claimed

    @cute.jit
    def _push_tile(self, tile_ring, state, tile_id: Int32, next_id: Int32, lane: Int32):
        """The TMA warp: ``(tile_id, next_id)`` into the ring's next entry."""
        ring, sIds = tile_ring
        ring.producer_acquire(state)
        if lane == 0:
            sIds[2 * state.index] = tile_id
            sIds[2 * state.index + 1] = next_id
        ring.producer_commit(state)  # every lane arrives (release): lane 0's stores are ordered before
        state.advance()
        return state

    @cute.jit
    def _close_tile_ring(self, tile_ring, state, total: Int32, lane: Int32):
        """The TMA warp, after its last tile: the end marker for each consumer, then wait until they
        have read them (no barrier arrive left pending at exit)."""
        for _ in cutlass.range_constexpr(2 if self.pingpong else 1):
            state = self._push_tile(tile_ring, state, total, total, lane)
        tile_ring[0].producer_tail(state)

    @cute.jit
    def _pop_tile(self, tile_ring, state):
        """The threads that own a tile: ``(tile id, next tile id, state)`` from the ring; pingpong skips
        the other warpgroup's entry."""
        ring, sIds = tile_ring
        ring.consumer_wait(state)
        tile_id = sIds[2 * state.index]
        next_id = sIds[2 * state.index + 1]
        ring.consumer_release(state)
        state.advance(2 if self.pingpong else 1)
        return tile_id, next_id, state
