"""Receiver-side expert layout of the EP drop in CuTeDSL: 2 kernel launches instead of ~16 torch
ops + GatherRows.

Inputs (this rank's symmetric receive buffers, filled by EpDispatch; S = W*T_max slots, slot
s = src*T_max + t is valid iff t < recv_count[src]):

    recv_ids   [S, K]  int32   local expert id of choice k of slot s, or -1 (ids outside
                               [0, E_l) are treated as -1)
    recv_w     [S, K]  float32 router weight of choice k
    recv_count [W]     int32   tokens sent by each source rank
    recv_x     [S, H]  bf16    token rows (only with the fused gather)

Outputs (preallocated, P = S*K):

    offsets [E_l + 1]  int32   offsets[0] = 0; local expert e owns grouped rows
                               [offsets[e], offsets[e+1]); offsets[E_l] = number of valid pairs n
    idx     [>= P]     int32   slot of grouped row r (r < n; rows >= n untouched)
    ws      [>= P]     float32 router weight of grouped row r (r < n)
    pos     [S, K]     int32   grouped row of (slot, k), or -1 -- ALL S*K entries written
    xs      [>= P, H]  bf16    xs[r] = recv_x[idx[r]] (r < n; fused gather, optional)

Row order INSIDE an expert is the order of integer atomic cursor increments (not deterministic);
which rows belong to which expert, and every (idx, ws, pos, xs) association, is. Downstream
results stay bitwise deterministic: the grouped GEMM computes every row independently and
CombineSend sums by pos in k order. No float atomics.

Kernels (same stream, in this order):

    1. LayoutCount (grid-stride, one thread per (slot, k) pair): valid pairs -> shared-memory
       histogram (atom.shared.add) -> one global atom.add per nonzero expert per CTA into
       scratch.counts. Then the CTA arrives on scratch.arrive (atom.acq_rel.gpu); the LAST CTA
       reads every count with atom.exch(count, 0) (which also resets it), computes the
       exclusive prefix with a warp scan, writes offsets[0..E_l] and the same bases into
       scratch.cursor[e], and stores scratch.arrive = 0.
    2. LayoutPlace (grid-stride, one warp per slot; lane k < K = choice k): valid pair ->
       row = atom.add(scratch.cursor[e], 1) (cursor starts at offsets[e], so the old value is
       the absolute grouped row); pos[s, k] = row, idx[row] = s, ws[row] = w; invalid pairs
       (stale slot, id -1 / out of range) write pos[s, k] = -1. With the fused gather the warp
       loads recv_x[s] once (16-byte vectors, U in flight per lane) and stores it to xs[row_k]
       for every valid k (one read, up to K writes; GatherRows would read it K times).

Scratch (int32 [scratch_len(E_l)], owned by the launcher, ZEROED ONCE at allocation):
    [0, E_l)        counts  -- must be 0 when LayoutCount starts
    [E_l, 2E_l)     cursor  -- any value when LayoutCount starts (overwritten by its last CTA)
    [2E_l]          arrive  -- must be 0 when LayoutCount starts

Tail-clean argument (no host memset between calls): LayoutCount is the only kernel that
accumulates into counts/arrive, and its last CTA (the one whose arrival returns gdim - 1, i.e.
every other CTA has already added its counts, made them visible with fence.acq_rel.gpu + the
acq_rel arrival) atomically exchanges every count with 0 and stores arrive = 0 before exiting.
So after every LayoutCount, counts == 0 and arrive == 0 again. The cursors are never reset:
LayoutCount's last CTA overwrites all E_l of them with the bases before LayoutPlace (stream
order) increments them; what LayoutPlace leaves there (offsets[e+1]) is dead. Requirement: the
calls using one scratch are stream-ordered (one Layout object per stream / layer; two
concurrent Count launches on the same scratch would race).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .ep_constants import EP_VEC_BYTES
from .ep_kernels import _RowPlan, _addr, _gptr, _ld_vec, _st_vec

LAYOUT_ABI_VERSION = 1
LAYOUT_THREADS = 256        # threads per CTA of both kernels
LAYOUT_MAX_LOCAL_EXPERTS = 1024
LAYOUT_MAX_TOPK = 32        # lane k holds choice k in LayoutPlace


def scratch_len(local_experts: int) -> int:
    """int32 elements of the launcher-owned scratch: counts[E_l], cursor[E_l], arrive, pad."""
    return 2 * local_experts + 4


def scr_counts(local_experts: int) -> int:
    return 0


def scr_cursor(local_experts: int) -> int:
    return local_experts


def scr_arrive(local_experts: int) -> int:
    return 2 * local_experts


# =============================================================================================
# 1. LayoutCount (+ scan by the last CTA)
# =============================================================================================


class LayoutCount:
    """Count valid pairs per local expert; the last CTA turns the counts into offsets/cursors.

    Static: top-K, world W, T_max, local experts E_l, threads per CTA.

    Arguments of ``__call__``:
        mIds        [S, K]         int32 recv_ids
        mRecvCount  [W]            int32 recv_count
        mScratch    [2*E_l + 4]    int32 counts / cursor / arrive (see module docstring)
        mOffsets    [E_l + 1]      int32 output offsets
        num_ctas    Int32          grid size (>= 1)
        stream      CUstream
    """

    def __init__(self, topk: int, world: int, max_tokens: int, local_experts: int,
                 threads: int = LAYOUT_THREADS):
        assert 1 <= topk <= LAYOUT_MAX_TOPK and world >= 1 and max_tokens >= 1
        assert 1 <= local_experts <= LAYOUT_MAX_LOCAL_EXPERTS
        assert threads % 32 == 0 and threads >= 32
        assert world * max_tokens * topk < 2**31
        self.K, self.W, self.T_max, self.E_l = topk, world, max_tokens, local_experts
        self.threads = threads
        self.C = (local_experts + 31) // 32  # experts per lane in the scan

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mRecvCount: cute.Tensor, mScratch: cute.Tensor,
                 mOffsets: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mIds, mRecvCount, mScratch, mOffsets).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mRecvCount: cute.Tensor, mScratch: cute.Tensor,
               mOffsets: cute.Tensor):
        K, T_max, E_l, C = self.K, self.T_max, self.E_l, self.C
        P = self.W * T_max * K
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        scr = _addr(mScratch)
        cnt_addr = scr + 4 * scr_counts(E_l)
        cur_addr = scr + 4 * scr_cursor(E_l)
        arr_addr = scr + 4 * scr_arrive(E_l)
        off_addr = _addr(mOffsets)
        ids_addr = _addr(mIds)

        sp = cute.arch.alloc_smem(Int32, E_l)
        sH = cute.make_tensor(sp, cute.make_layout(E_l))
        for e in cutlass.range(tidx, E_l, self.threads):
            sH[e] = Int32(0)
        cute.arch.sync_threads()

        for p in cutlass.range(bidx * self.threads + tidx, P, gdim * self.threads):
            s = p // Int32(K)
            q = s // Int32(T_max)
            t = s - q * Int32(T_max)
            # Both loads issue back to back (p < P always: ids in bounds for stale slots too).
            e = cute.arch.load(_gptr(Int32, ids_addr + Int64(p) * 4, 4), Int32)
            if (t < mRecvCount[q]) & (e >= Int32(0)) & (e < Int32(E_l)):
                cute.arch.atomic_add(sp + e, Int32(1))
        cute.arch.sync_threads()

        for e in cutlass.range(tidx, E_l, self.threads):
            h = sH[e]
            if h != Int32(0):
                cute.arch.atomic_add(_gptr(Int32, cnt_addr + Int64(e) * 4, 4), h,
                                     sem="relaxed", scope="gpu")
        # Every thread that added publishes before the CTA arrives.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()

        if warp == 0:
            arrived = Int32(0)
            if lane == 0:
                arrived = cute.arch.atomic_add(_gptr(Int32, arr_addr, 4), Int32(1),
                                               sem="acq_rel", scope="gpu")
            arrived = cute.arch.shuffle_sync(arrived, 0)
            if arrived == gdim - 1:
                # Last CTA: all counts are final. Read-and-reset them (atomics act at L2, so
                # they see every other CTA's adds), scan, write offsets and cursor bases.
                cute.arch.sync_warp()
                cute.arch.fence_acq_rel_gpu()
                vals = []
                local = Int32(0)
                for j in cutlass.range_constexpr(C):
                    e = lane * C + j
                    v = Int32(0)
                    if e < Int32(E_l):
                        v = cute.arch.atomic_exch(_gptr(Int32, cnt_addr + Int64(e) * 4, 4),
                                                  Int32(0), sem="relaxed", scope="gpu")
                    vals.append(v)
                    local = local + v
                incl = local
                for d in cutlass.range_constexpr(5):
                    y = cute.arch.shuffle_sync_up(incl, 1 << d)
                    if lane >= Int32(1 << d):
                        incl = incl + y
                run = incl - local
                for j in cutlass.range_constexpr(C):
                    e = lane * C + j
                    if e < Int32(E_l):
                        cute.arch.store(_gptr(Int32, off_addr + Int64(e) * 4, 4), run)
                        cute.arch.store(_gptr(Int32, cur_addr + Int64(e) * 4, 4), run)
                    run = run + vals[j]
                if lane == 31:
                    cute.arch.store(_gptr(Int32, off_addr + 4 * E_l, 4), incl)
                if lane == 0:
                    cute.arch.store(_gptr(Int32, arr_addr, 4), Int32(0))


# =============================================================================================
# 2. LayoutPlace (+ fused row gather)
# =============================================================================================


class LayoutPlace:
    """Give every valid pair its grouped row; write idx / ws / pos (and xs rows if ``gather``).

    Static: hidden H, top-K, world W, T_max, local experts E_l, threads per CTA, gather.

    Arguments of ``__call__``:
        mIds        [S, K]      int32 recv_ids
        mW          [S, K]      float32 recv_w
        mRecvCount  [W]         int32 recv_count
        mScratch    [2*E_l + 4] int32 (cursor[e] = offsets[e], set by LayoutCount)
        mX          [R, H]      bf16 recv_x (R dynamic; slots >= R are not copied); ignored
                                (any 1-row tensor) when gather is False
        mIdx        [cap]       int32 output (cap dynamic; rows >= cap are dropped)
        mWs         [cap]       float32 output
        mPos        [S, K]      int32 output, fully written
        mXs         [capx, H]   bf16 output rows (capx dynamic); ignored when gather is False
        num_ctas    Int32, stream CUstream
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, local_experts: int,
                 threads: int = LAYOUT_THREADS, gather: bool = True):
        assert 1 <= topk <= LAYOUT_MAX_TOPK and world >= 1 and max_tokens >= 1
        assert 1 <= local_experts <= LAYOUT_MAX_LOCAL_EXPERTS
        assert threads % 32 == 0 and threads >= 32
        assert world * max_tokens * topk < 2**31
        self.H, self.K, self.W, self.T_max, self.E_l = hidden, topk, world, max_tokens, local_experts
        self.threads = threads
        self.gather = bool(gather)
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mW: cute.Tensor, mRecvCount: cute.Tensor,
                 mScratch: cute.Tensor, mX: cute.Tensor, mIdx: cute.Tensor, mWs: cute.Tensor,
                 mPos: cute.Tensor, mXs: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mIds, mW, mRecvCount, mScratch, mX, mIdx, mWs, mPos, mXs).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mW: cute.Tensor, mRecvCount: cute.Tensor,
               mScratch: cute.Tensor, mX: cute.Tensor, mIdx: cute.Tensor, mWs: cute.Tensor,
               mPos: cute.Tensor, mXs: cute.Tensor):
        K, T_max, E_l = self.K, self.T_max, self.E_l
        S = self.W * T_max
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        cur_addr = _addr(mScratch) + 4 * scr_cursor(E_l)
        cap = cutlass.min(mIdx.shape[0], mWs.shape[0])
        x_addr = _addr(mX)
        xs_addr = _addr(mXs)
        n_x = mX.shape[0]
        cap_x = mXs.shape[0]
        rb = self.plan.row_bytes
        # registers holding the first chunk of the row, loaded before the cursor atomic
        bufs0 = [cute.make_rmem_tensor((4,), Int32) for _ in self.plan.slots(0)]

        for s in cutlass.range(gwarp, S, nwarps):
            q = s // Int32(T_max)
            t = s - q * Int32(T_max)
            e = Int32(-1)
            w = Float32(0.0)
            if lane < K:  # loaded also for stale slots (in bounds), so both loads overlap
                e = mIds[s, lane]
                w = mW[s, lane]
            ok = (t < mRecvCount[q]) & (e >= Int32(0)) & (e < Int32(E_l))

            # Fused gather, part 1: issue the loads of the row's first chunk BEFORE the cursor
            # atomic so that their latencies overlap.
            mask = Int32(0)
            if cutlass.const_expr(self.gather):
                mask = cute.arch.vote_ballot_sync(ok & (s < n_x))
                if mask != Int32(0):
                    src_row = x_addr + Int64(s) * rb
                    for j, (u, vbase, pred) in enumerate(self.plan.slots(0)):
                        vi = lane + vbase
                        if cutlass.const_expr(pred):
                            vi = cutlass.min(vi, Int32(self.plan.nvec - 1))
                        bufs0[j].store(cute.TensorSSA(_ld_vec(src_row + Int64(vi) * EP_VEC_BYTES),
                                                      (4,), Int32))

            row = Int32(-1)
            if ok:
                row = cute.arch.atomic_add(_gptr(Int32, cur_addr + Int64(e) * 4, 4), Int32(1),
                                           sem="relaxed", scope="gpu")
            if lane < K:
                mPos[s, lane] = row
            if ok & (row < cap):
                mIdx[row] = s
                mWs[row] = w

            if cutlass.const_expr(self.gather):
                if mask != Int32(0):
                    # rows >= cap_x are dropped (the host guarantees cap_x >= S*K)
                    mask = mask & cute.arch.vote_ballot_sync(ok & (row < cap_x))
                    rows = [cute.arch.shuffle_sync(row, k) for k in range(K)]
                    src_row = x_addr + Int64(s) * rb
                    for c in cutlass.range_constexpr(self.plan.chunks):
                        slots = self.plan.slots(c)
                        offs = []
                        vals = []
                        for j, (u, vbase, pred) in enumerate(slots):
                            vi = lane + vbase
                            if cutlass.const_expr(pred):
                                vi = cutlass.min(vi, Int32(self.plan.nvec - 1))
                            off = Int64(vi) * EP_VEC_BYTES
                            offs.append(off)
                            if cutlass.const_expr(c == 0):
                                vals.append(bufs0[j].load().ir_value())
                            else:
                                vals.append(_ld_vec(src_row + off))
                        for k in cutlass.range_constexpr(K):
                            if ((mask >> k) & 1) != 0:
                                dst_row = xs_addr + Int64(rows[k]) * rb
                                for j in cutlass.range_constexpr(len(slots)):
                                    u, vbase, pred = slots[j]
                                    if cutlass.const_expr(pred):
                                        if lane + vbase < self.plan.nvec:
                                            _st_vec(dst_row + offs[j], vals[j])
                                    else:
                                        _st_vec(dst_row + offs[j], vals[j])
