"""The producer warpgroup of an FP8 grouped GEMM that quantises and places its own A rows (drop v92;
FC1 / FC2 of the FP8 layer): :class:`PlaceQuantAProducer`, mixed into
:class:`.fp8_gemm_place.Fp8PlaceGroupedGemmSm90`.

Why. Before each FP8 GEMM a quantiser kernel writes its e4m3 rows and scales into grouped order:
FC1's input (Qwen3 at 8192 tokens: 65536 rows of 2 KB, ~58 us; the scattering quantiser) and
FC2's (the same rows of FC1's bf16 output, ~55 us). Neither GEMM starts until its quantiser has
finished, and each GEMM's producer warpgroup has three warps that do nothing. Here those warps
quantise the rows while the GEMM runs, in the order its tiles need them, with the same
synchronisation as drop v91's BF16 row copy (:mod:`.placing_producer`: chunks of rows of one
m-tile claimed by one atomic each, per-lane ``fence.acq_rel.gpu`` then lane 0's
``red.release.gpu`` on the m-tile's ready counter; the TMA warp acquire-waits for its m-tile's
rows and issues ``fence.proxy.async.global`` before it loads A or A's scales).

A chunk's row ``r`` is source row ``idx[r]`` (``place_gather``, FC1: the tokens) or ``r`` itself
(FC2: FC1's output is already in grouped order). A warp quantises ``32 // (128 // V)`` groups of
128 values at a time, ``128 // V`` lanes per group and ``V`` (``place_vals``) values per lane,
with the quantiser's arithmetic (:mod:`.fp8_quant`: ``scale = amax / 448``, 1.0 for an all-zero
group, the IEEE quotient, ``cvt.rn.satfinite``). The maximum does not depend on which lane holds
which value, so for every ``V`` the e4m3 bytes and scales are bit for bit those of the
quantiser kernels, and the GEMM's are those of the plain kernel on them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fp8_quant import E4M3_MAX, FP8_BLOCK, _divide_by_scale
from .placing_producer import PlaceAProducer

#: 128-value groups per claimed chunk by default: the chunk's rows are the largest power of 2 (at
#: most 32) whose groups stay within it (Qwen3 FC1 4 rows of 16 groups, FC2 8 of 6; Mixtral FC1 2
#: of 32, FC2 1 of 112), so each chunk's fence and claim round trip is spread over similar work
PLACE_QUANT_CHUNK_GROUPS = 64
#: values of a 128-value group each lane quantises (8 or 16; the same bits for both). 16 (the
#: quantiser kernels' split, 8 lanes per group): a group's maximum, scale and reciprocal cost a
#: lane once per 16 values instead of per 8 -- ~20% fewer instructions per group than 8 with two
#: groups in flight, for the same 1 KB in flight per warp (SASS, Qwen3 FC2)
PLACE_VALS = 16
#: groups each lane keeps in flight per pass (their loads issued before any is quantised)
PLACE_QUANT_UNROLL = 1
#: registers (producer warpgroup, consumers) per thread: the plain FP8 kernel's while each lane
#: holds at most PLACE_QUANT_LEAN_VALUES values in flight (no spills with local ptxas, Qwen3 and
#: Mixtral FC1 / FC2), else more for the producer. setmaxnreg moves registers between the
#: warpgroups of one CTA: 128 * producer + 256 * consumers stays within the launch's 168 * 384.
PLACE_QUANT_REGS_LEAN = (40, 232)
PLACE_QUANT_REGS_WIDE = (56, 224)
PLACE_QUANT_LEAN_VALUES = 16


@cute.jit
def _quantize_group_lane(x: cute.TensorSSA, n: cutlass.Constexpr, lanes: cutlass.Constexpr):
    """``(x / scale, scale)`` of a lane's ``n`` float32 values of one 128-value group spread over
    ``lanes`` adjacent lanes (a power of 2; every lane of the warp calls it: a butterfly max).
    The rule of :func:`.fp8_quant._quantize_lane`, for any split of the group."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.arch.fmax(x[i], -x[i], nan=True), nan=True)
    steps = lanes.bit_length() - 1
    for d in cutlass.range_constexpr(steps):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << (steps - 1 - d)), nan=True)
    scale = Float32(1.0)                           # torch.where(amax > 0, amax/448, 1)
    if amax > Float32(0.0):
        scale = amax / Float32(E4M3_MAX)
    return _divide_by_scale(x, scale, n), scale


def default_chunk_rows(k: int) -> int:
    """Rows per claimed chunk for rows of ``k`` values (:data:`PLACE_QUANT_CHUNK_GROUPS`)."""
    rows = max(1, PLACE_QUANT_CHUNK_GROUPS // (k // FP8_BLOCK))
    return min(32, 1 << (rows.bit_length() - 1))


class PlaceQuantAProducer(PlaceAProducer):
    """Mixin: the quantising copy warps' loop (module docstring); the TMA warp's wait and the
    counters' reset are :class:`.placing_producer.PlaceAProducer`'s."""

    #: FC1: source row ``idx[r]``; FC2 (False): row ``r`` of the source
    place_gather = True
    place_vals = PLACE_VALS
    place_unroll = PLACE_QUANT_UNROLL

    @cute.jit
    def _place_quant_rows(self, mX: cute.Tensor, mIdx: cute.Tensor, mQ: cute.Tensor, mQScale: cute.Tensor,
                          mSync: cute.Tensor, sOff: cute.Tensor, sCum: cute.Tensor, lane: Int32,
                          copy_warps: Int32):
        """A copy warp: claim chunks in order; quantise their rows into ``mQ`` [M, K] e4m3 and
        ``mQScale`` [M, K / 128] float32; publish each chunk on its m-tile's ready counter."""
        total = sCum[self.num_experts] * (self.tile_m // self.place_chunk_rows)
        V = self.place_vals
        lanes = FP8_BLOCK // V                        # lanes per group
        per_pass = 32 // lanes                        # groups per warp pass
        G = cute.size(mQ, mode=[1]) // FP8_BLOCK      # groups per row
        n_src = mX.shape[0]
        sub, slot = lane % lanes, lane // lanes
        tX = cute.zipped_divide(mX, (1, V))           # tile (r, j): x[r, V j : V j + V]
        tQ = cute.zipped_divide(mQ, (1, V))
        expert = Int32(0)
        c = self._claim(mSync, lane)
        while c < total:
            mt, row0, rows, expert = self._chunk(c, expert, sOff, sCum)
            src_lane = Int32(0)
            if cutlass.const_expr(self.place_gather):  # clamped to x's rows (a stale index stays in bounds)
                if lane < rows:
                    src_lane = cutlass.min(cutlass.max(mIdx[row0 + lane], Int32(0)), n_src - 1)
            groups = rows * G
            step = per_pass * self.place_unroll
            for g0 in cutlass.range(0, groups, step):
                held = []                             # the pass's loads first, then the arithmetic
                for u in cutlass.range_constexpr(self.place_unroll):
                    gid = g0 + u * per_pass + slot
                    gc = cutlass.min(gid, groups - 1)  # lanes past the chunk redo its last group
                    r = gc // G
                    j = (gc - r * G) * lanes + sub
                    src = row0 + r                    # FC2: the grouped row itself
                    if cutlass.const_expr(self.place_gather):
                        src = cute.arch.shuffle_sync(src_lane, r)
                    held.append((gid < groups, r, gc - r * G, j, tX[(0, None), (src, j)].load()))
                for u in cutlass.range_constexpr(self.place_unroll):
                    valid, r, g, j, x = held[u]
                    y, scale = _quantize_group_lane(x.to(Float32), V, lanes)
                    if valid:
                        tQ[(0, None), (row0 + r, j)].store(y.to(cutlass.Float8E4M3FN))
                        if sub == 0:
                            mQScale[row0 + r, g] = scale
            self._publish(mSync, mt, rows, lane)
            c = self._claim(mSync, lane)
        self._retire(mSync, lane, copy_warps)
