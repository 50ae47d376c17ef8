"""The producer warpgroup of a grouped GEMM that places its own A rows (drop v91):
:class:`PlaceAProducer`, mixed into :class:`.fp8_gemm_place.Fp8PlaceGroupedGemmSm90` (drop v92's
copying FP8 FC1). Drop v94 removed the BF16 kernel it was written for (v91's
``grouped_gemm_place.GroupedGemmPlaceSm90``): the same bits, the layer no faster on the H200 and
5% slower on the H100 (39th-41st sessions).

Why. A one-rank layer first copies every (token, choice) row into expert order (LayoutPlace: BF16
Qwen3 at 8192 tokens writes 65536 rows of 4 KB, ~88 us at the H200's write bandwidth), and only then
does FC1 start. FC1 is bound by its tensor pipe and leaves most of the memory bandwidth idle, and
its producer warpgroup has three warps that do nothing. Here those three warps do the row copy
while the GEMM runs. FC1 reads A by TMA as before; its first tiles wait only for their own rows,
not for all of them.

The work is split in chunks of ``chunk_rows`` rows of one m-tile (default
:data:`PLACE_CHUNK_ROWS`; chunk ``c``: m-tile ``c // chunks_per_tile`` in the scheduler's numbering,
rows ``chunk_rows * (c % chunks_per_tile)`` onward). A copy warp claims the next chunk with one atomic add, so the chunks
are copied in the order the tiles need them, and any running CTA finishes every chunk: a CTA that
is not resident yet never holds rows another one waits for. A warp copies row ``r`` from
``x[idx[r]]`` to ``xs[r]`` with 16-byte loads and stores, then every lane fences (``fence.acq_rel.gpu``),
the warp syncs, and lane 0 adds the chunk's row count to the m-tile's ready counter
(``red.release.gpu``). Before a tile's first TMA load of A, the TMA warp spins
(``ld.acquire.gpu``, bounded by ``%globaltimer``; it gives up at once if another tile's wait has
timed out) until its m-tile's counter holds all the tile's rows, then issues
``fence.proxy.async.global`` so that its TMA (the async proxy) reads what the copy warps wrote
through the generic proxy. (Drop v92: the copy takes any element width and an optional scale
row, for the FP8 GEMM's placing warps, :mod:`.fp8_gemm_place`; the claim, chunk, publish and
retire steps are separate helpers, which v92's quantising warps shared until drop v93 removed them.)

The sync buffer ``mSync`` [S + 4] int32 (S >= the m-tiles of any call; zero before the first
launch): ready counters [0, S), then claim, done, finished and an error word. It is tail-clean:
the last copy warp of the grid zeroes claim and done, and the last TMA warp of the grid (the
``finished`` count) zeroes the ready counters of the launch's m-tiles -- every wait has passed
by then, so no reader is left, and a TMA warp's per-tile wait is one acquire load, with no atomic
on the path to its loads. The error word is 1 + the m-tile when a wait timed out (the tile then
computes on whatever its rows held; nothing hangs), 0 otherwise; the kernel never clears it.

The GEMM itself (stages, WGMMAs, epilogue) is the host class's: the same bits as its plain kernel
on ``xs = x[idx]``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir import ir

#: the sync buffer's slots after its S ready counters (claim, done, finished, error word): ``mSync`` [S + 4]
PLACE_SYNC_TAIL = 4
#: rows per copy chunk: small, so the first tiles wait for little (a warp moves ~16 KB per chunk);
#: a divisor of the tile's 128 rows, at most 32 (one lane reads each row's index)
PLACE_CHUNK_ROWS = 4
#: 16-byte vectors each lane keeps in flight while copying a row
PLACE_UNROLL = 4
#: how long the TMA warp waits for an m-tile's rows before it records an error and goes on (a
#: legitimate wait is the copy of a few chunks: microseconds); once the error word is set, every
#: other wait of the launch stops at its next poll, so a broken placement costs about this once
PLACE_TIMEOUT_NS = 1_000_000_000


def _gptr(dtype, addr: Int64, align: int):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


class PlaceAProducer:
    """Mixin: the TMA warp's wait for an m-tile's rows and the copy warps' loop (module docstring).
    The host class provides ``tile_m``, ``n_tiles``, ``num_experts`` and ``_locate``'s tables."""

    place_a = True
    #: the copy's chunk rows and per-lane vectors in flight (the host class may set its own)
    place_chunk_rows = PLACE_CHUNK_ROWS
    place_unroll = PLACE_UNROLL

    @staticmethod
    def _sync_slots(mSync: cute.Tensor):
        """``(byte address of mSync, S)``: ready counters at [0, S), claim S, done S + 1, finished
        S + 2, error S + 3."""
        return mSync.iterator.toint(), mSync.shape[0] - PLACE_SYNC_TAIL

    @cute.jit
    def _wait_rows_placed(self, mSync: cute.Tensor, sOff: cute.Tensor, sCum: cute.Tensor,
                          expert: Int32, row0: Int32, row_end: Int32, lane: Int32):
        """The TMA warp, before a tile's first A load: wait until the copy warps have placed every
        row of the tile's m-tile (all lanes spin on the same word)."""
        base, slots = self._sync_slots(mSync)
        mt = sCum[expert] + (row0 - sOff[expert]) // self.tile_m
        want = cutlass.min(Int32(self.tile_m), row_end - row0)
        ready = base + Int64(mt) * 4
        t0 = cute.arch.globaltimer()
        state = Int32(0)  # 1: the rows are in; 2: this wait timed out; 3: another one did
        while state == Int32(0):
            if cute.arch.load(_gptr(Int32, ready, 4), Int32, sem="acquire", scope="gpu") == want:
                state = Int32(1)
            else:  # only a wait that does not succeed at once polls the error word and the clock
                if cute.arch.load(_gptr(Int32, base + Int64(slots + 3) * 4, 4), Int32, sem="relaxed",
                                  scope="gpu") != Int32(0):
                    state = Int32(3)
                if cute.arch.globaltimer() - t0 > Int64(PLACE_TIMEOUT_NS):
                    state = Int32(2)
        # the TMA loads that follow (async proxy) must see the rows written by generic stores
        cute.arch.fence_proxy("async.global")
        if lane == 0:
            if state == Int32(2):
                cute.arch.store(_gptr(Int32, base + Int64(slots + 3) * 4, 4), mt + 1)

    @cute.jit
    def _finish_placed(self, mSync: cute.Tensor, sCum: cute.Tensor, lane: Int32, ctas: Int32):
        """The TMA warp, after its last tile: count this CTA as finished; the grid's last one zeroes
        the ready counters of this launch's m-tiles (every wait of the grid has passed)."""
        base, slots = self._sync_slots(mSync)
        finished = _gptr(Int32, base + Int64(slots + 2) * 4, 4)
        last = Int32(0)
        if lane == 0:
            last = cute.arch.atomic_add(finished, Int32(1), sem="acq_rel", scope="gpu")
        last = cute.arch.shuffle_sync(last, 0)
        if last == ctas - 1:
            for mt in cutlass.range(lane, sCum[self.num_experts], 32):
                cute.arch.store(_gptr(Int32, base + Int64(mt) * 4, 4), Int32(0))
            if lane == 0:
                cute.arch.store(finished, Int32(0))

    @cute.jit
    def _claim(self, mSync: cute.Tensor, lane: Int32):
        """A copy warp's next chunk (lane 0 takes it with one atomic; every lane gets it)."""
        base, slots = self._sync_slots(mSync)
        c = Int32(0)
        if lane == 0:
            c = cute.arch.atomic_add(_gptr(Int32, base + Int64(slots) * 4, 4), Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(c, 0)

    @cute.jit
    def _chunk(self, c: Int32, expert: Int32, sOff: cute.Tensor, sCum: cute.Tensor):
        """Chunk ``c``: ``(m-tile, first grouped row, rows (0 past its expert's rows), expert)``;
        ``expert``: the previous chunk's (chunks come in order)."""
        per_tile = self.tile_m // self.place_chunk_rows
        mt = c // per_tile
        while sCum[expert + 1] <= mt:
            expert = expert + 1
        row0 = sOff[expert] + (mt - sCum[expert]) * self.tile_m + (c % per_tile) * self.place_chunk_rows
        rows = cutlass.max(cutlass.min(Int32(self.place_chunk_rows), sOff[expert + 1] - row0), Int32(0))
        return mt, row0, rows, expert

    @cute.jit
    def _publish(self, mSync: cute.Tensor, mt: Int32, rows: Int32, lane: Int32):
        """The chunk's rows are written: each lane's stores before lane 0's release of the count."""
        base, _ = self._sync_slots(mSync)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            if rows > 0:
                cute.arch.red(_gptr(Int32, base + Int64(mt) * 4, 4), rows, op="add", dtype="s32",
                              sem="release", scope="gpu")

    @cute.jit
    def _retire(self, mSync: cute.Tensor, lane: Int32, copy_warps: Int32):
        """A copy warp is done: the last one of the grid zeroes the claim and done counters."""
        base, slots = self._sync_slots(mSync)
        if lane == 0:
            done_ptr = _gptr(Int32, base + Int64(slots + 1) * 4, 4)
            if cute.arch.atomic_add(done_ptr, Int32(1), sem="acq_rel", scope="gpu") == copy_warps - 1:
                cute.arch.store(_gptr(Int32, base + Int64(slots) * 4, 4), Int32(0))
                cute.arch.store(done_ptr, Int32(0))

    @cute.jit
    def _place_rows(self, mX: cute.Tensor, mIdx: cute.Tensor, mXs: cute.Tensor, mSync: cute.Tensor,
                    sOff: cute.Tensor, sCum: cute.Tensor, lane: Int32, copy_warps: Int32, scales=None):
        """A copy warp: claim chunks in order and copy their rows ``xs[r] = x[idx[r]]`` (any element
        width; rows of a multiple of 16 bytes). ``scales``: ``(mXScale [T, G], mXsScale [M, G])``
        float32, copied with the rows (drop v92: an FP8 GEMM's A scales, ``G = K / 128``)."""
        total = sCum[self.num_experts] * (self.tile_m // self.place_chunk_rows)
        k_size = cute.size(mXs, mode=[1])
        row_size = k_size * (mXs.element_type.width // 8)
        nvec = row_size // 16  # 16-byte vectors per row
        row_bytes = Int64(row_size)
        passes = (nvec + 32 * self.place_unroll - 1) // (32 * self.place_unroll)
        x_base, xs_base = mX.iterator.toint(), mXs.iterator.toint()
        n_src = mX.shape[0]
        v4 = ir.VectorType.get([4], Int32.mlir_type)
        expert = Int32(0)
        c = self._claim(mSync, lane)
        while c < total:
            mt, row0, rows, expert = self._chunk(c, expert, sOff, sCum)
            src_lane = Int32(0)
            if lane < rows:  # clamped to x's rows, so a stale index (an error state) reads in bounds
                src_lane = cutlass.min(cutlass.max(mIdx[row0 + lane], Int32(0)), n_src - 1)
            for r in cutlass.range_constexpr(self.place_chunk_rows):
                if r < rows:
                    src_row = cute.arch.shuffle_sync(src_lane, r)
                    src = x_base + Int64(src_row) * row_bytes
                    dst = xs_base + Int64(row0 + r) * row_bytes
                    for p in cutlass.range_constexpr(passes):
                        vals, offs = [], []
                        for u in cutlass.range_constexpr(self.place_unroll):
                            v = lane + (p * self.place_unroll + u) * 32
                            off = Int64(cutlass.min(v, Int32(nvec - 1))) * 16
                            offs.append(off)
                            vals.append(cute.arch.load(_gptr(Int32, src + off, 16), v4))
                        for u in cutlass.range_constexpr(self.place_unroll):
                            if lane + (p * self.place_unroll + u) * 32 < nvec:
                                cute.arch.store(_gptr(Int32, dst + offs[u], 16), vals[u])
                    if cutlass.const_expr(scales is not None):  # the row's scales, one float per lane
                        groups = cute.size(scales[1], mode=[1])
                        for p in cutlass.range_constexpr((groups + 31) // 32):
                            if lane + 32 * p < groups:
                                scales[1][row0 + r, lane + 32 * p] = scales[0][src_row, lane + 32 * p]
            self._publish(mSync, mt, rows, lane)
            c = self._claim(mSync, lane)
        self._retire(mSync, lane, copy_warps)
