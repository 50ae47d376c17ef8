"""Receiver-side expert layout of the EP drop in CuTeDSL: 2 launches, bit-deterministic.

Inputs (this rank's receive buffers, filled by EpDispatch; S = W*T_max slots, slot
s = src*T_max + t is valid iff t < recv_count[src]):

    recv_ids   [S, K]  int32   local expert id of choice k of slot s, or -1 (ids outside
                               [0, E_l) are treated as -1)
    recv_w     [S, K]  float32 router weight of choice k
    recv_count [W]     int32   tokens sent by each source rank
    recv_x     [S, H]  bf16    token rows (only with the fused gather)
    flags, ctrl, err           the EP protocol words (ep_kernels): LayoutCount first waits for
                               every source's dispatch of the current epoch, as EpWait does

Outputs (preallocated, P = S*K):

    offsets [E_l + 1]  int32   offsets[0] = 0; local expert e owns grouped rows
                               [offsets[e], offsets[e+1]); offsets[E_l] = number of valid pairs n
    idx     [>= P]     int32   slot of grouped row r (r < n; rows >= n untouched)
    ws      [>= P]     float32 router weight of grouped row r (r < n)
    pos     [S, K]     int32   grouped row of (slot, k), or -1; written for the VALID slots
                               (t < recv_count[src]) only -- readers check recv_count first
    xs      [>= P, H]  bf16    xs[r] = recv_x[idx[r]] (r < n; fused gather, optional)

Row order (the contract): the rows of expert e are its valid (slot, k) pairs in increasing
(slot, k) order -- exactly a stable sort of the valid pairs by expert. No atomic decides a
position, so the layout (and everything computed from it) is bit-deterministic whatever the
timing of the ranks.

How. The V valid slots (sources' token ranges, back to back in slot order) are cut into C
contiguous chunks, one per CTA; C is the grid size of BOTH kernels.

    1. LayoutCount, CTA c: wait (bounded) for every source's dispatch flag of this epoch; count
       chunk c's valid pairs per expert in a shared-memory histogram (integer atomics: the
       counts do not depend on their order); store the row counts[c, 0:E_l] (zeros too).
    2. LayoutPlace, CTA c: from counts[0:C, :] compute tot[e] (all chunks) and pre[e] (chunks
       before c); offsets = exclusive scan of tot (CTA 0 stores them); the CTA's first row of
       expert e is offsets[e] + pre[e]. It then walks its chunk in tiles of TS = threads // K
       slots, one thread per (slot, k) pair in (slot, k) order: match.any groups a warp's lanes
       by expert (rank = number of lower lanes with the same expert), a [warps, E_l] shared
       table scanned per expert in warp order gives each warp its base, and the expert's cursor
       advances by the tile's count. It writes pos / idx / ws, then copies each slot's row once
       from recv_x to its <= K grouped rows.

One rank (W = 1) can skip the dispatch: ``LocalRoute`` (drop v19) reads the caller's
``topk_ids`` / ``topk_weights`` itself, checks them as EpDispatch does (same drops, same verr
record, same epoch and flag words afterwards), writes the sanitised recv_ids / recv_w /
recv_count / dmask and counts like LayoutCount; LayoutPlace then runs unchanged with the
caller's ``x`` as its row source. Same buffers, same rows, same bits as dispatch + layout, one
launch fewer and no row copy into recv_x.

Scratch: counts [>= C * E_l] int32, owned by the caller. LayoutCount rewrites all C*E_l entries
before LayoutPlace reads them, so nothing carries over between calls: no reset, no tail-clean
protocol. Calls sharing one scratch must be stream-ordered (one scratch per stream). No float
atomics, no global atomics at all.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .pdl import PDL, wait_previous_grid, wait_previous_grid_trigger_if_small
from .warp_scan import warp_inclusive_scan
from .ep_constants import (
    CTRL_DISPATCH_ARRIVE,
    CTRL_EPOCH,
    ERR_CAPACITY,
    ERR_CODE,
    ERR_TIMEOUT,
    WHERE_DISPATCH,
    WHERE_WAIT,
)
from .ep_kernels import (
    _RowPlan,
    _addr,
    _check_choice,
    _gptr,
    _ld_i32_relaxed_gpu,
    _report_error,
    _spin_wait_eq,
    _store_bad_values,
)

LAYOUT_ABI_VERSION = 3      # 2: deterministic rows, stateless scratch, wait fused into LayoutCount
                            # 3: LocalRoute (one rank: the dispatch's checks fused into the count)
LAYOUT_MAX_LOCAL_EXPERTS = 1024
LAYOUT_MAX_TOPK = 32        # one warp holds the K choices of one slot in the gather
LAYOUT_MAX_WORLD = 32       # warp 0 scans the W source counts


def layout_threads(local_experts: int) -> int:
    """Threads per CTA of both kernels: 512 (16 warps) while the [warps, E_l] int32 table of
    LayoutPlace fits static shared memory next to the rest (E_l <= 512), else 256."""
    return 512 if local_experts <= 512 else 256


def counts_len(num_chunks: int, local_experts: int) -> int:
    """int32 elements of the caller-owned scratch for ``num_chunks`` chunks."""
    return num_chunks * local_experts


@cute.jit
def _scan_sources(mRecvCount: cute.Tensor, sCum: cute.Tensor, lane: Int32, W: cutlass.Constexpr,
                  T_max: cutlass.Constexpr):
    """Warp 0: sCum[q] = valid slots of sources < q (q = 0..W); recv_count clamped to [0, T_max]."""
    c = Int32(0)
    if lane < W:
        c = cutlass.max(cutlass.min(mRecvCount[lane], Int32(T_max)), Int32(0))
    incl = warp_inclusive_scan(c, lane)
    if lane < W:
        sCum[lane] = incl - c
    if lane == W - 1:
        sCum[W] = incl


@cute.jit
def _slot_of(v: Int32, sCum: cute.Tensor, W: cutlass.Constexpr, T_max: cutlass.Constexpr) -> Int32:
    """Slot of the v-th valid slot: source q = last q with sCum[q] <= v (empty sources skipped)."""
    q = Int32(0)
    for j in cutlass.range_constexpr(1, W):
        if v >= sCum[j]:
            q = Int32(j)
    return q * T_max + (v - sCum[q])


# =============================================================================================
# 1. LayoutCount (+ the dispatch wait)
# =============================================================================================


class LayoutCount:
    """Wait for the sources' dispatch, then count each chunk's valid pairs per local expert.

    Static: top-K, world W, T_max, local experts E_l, threads per CTA.

    Arguments of ``__call__``:
        mIds        [S, K]       int32 recv_ids
        mRecvCount  [W]          int32 recv_count
        mFlags      [2W]         int64 this rank's flags (flags[s] = dispatch epoch of source s)
        mCtrl       [4]          int64 local control word (ctrl[0] = epoch set by EpDispatch)
        mErr        [4]          int32 local error word; on timeout err = (1, s, WHERE_WAIT,
                                 epoch); while set, the kernel only stores zero counts
        mCounts     [>= C*E_l]   int32 output: counts[c*E_l + e] (dynamic length)
        timeout_ns  Int64        wall-clock bound of the wait (%globaltimer)
        num_chunks  Int32        C = grid size (must equal LayoutPlace's)
        stream      CUstream
    """

    def __init__(self, topk: int, world: int, max_tokens: int, local_experts: int, threads: int):
        assert 1 <= topk <= LAYOUT_MAX_TOPK and 1 <= world <= LAYOUT_MAX_WORLD and max_tokens >= 1
        assert 1 <= local_experts <= LAYOUT_MAX_LOCAL_EXPERTS
        assert threads % 32 == 0 and 32 <= threads <= 1024
        assert world * max_tokens * topk < 2**31
        self.K, self.W, self.T_max, self.E_l = topk, world, max_tokens, local_experts
        self.threads = threads

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mRecvCount: cute.Tensor, mFlags: cute.Tensor,
                 mCtrl: cute.Tensor, mErr: cute.Tensor, mCounts: cute.Tensor, timeout_ns: Int64,
                 num_chunks: Int32, stream: cuda.CUstream):
        self.kernel(mIds, mRecvCount, mFlags, mCtrl, mErr, mCounts, timeout_ns).launch(
            grid=(num_chunks, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mRecvCount: cute.Tensor, mFlags: cute.Tensor,
               mCtrl: cute.Tensor, mErr: cute.Tensor, mCounts: cute.Tensor, timeout_ns: Int64):
        wait_previous_grid(trigger=False)  # spins on other ranks' flags: no early trigger
        K, W, T_max, E_l, NT = self.K, self.W, self.T_max, self.E_l, self.threads
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        err_addr = _addr(mErr)
        ids_addr = _addr(mIds)

        sp = cute.arch.alloc_smem(Int32, E_l)
        sH = cute.make_tensor(sp, cute.make_layout(E_l))
        sCum = cute.make_tensor(cute.arch.alloc_smem(Int32, W + 1), cute.make_layout(W + 1))
        for e in cutlass.range(tidx, E_l, NT):
            sH[e] = Int32(0)

        # 1. every CTA waits for all W dispatch flags of this epoch (warp 0, lane s = source s)
        if mErr[ERR_CODE] == Int32(0):
            epoch = mCtrl[CTRL_EPOCH]
            if tidx < W:
                state = _spin_wait_eq(_addr(mFlags) + Int64(tidx) * 8, epoch, timeout_ns)
                if state == Int32(2):
                    _report_error(err_addr, Int32(ERR_TIMEOUT), tidx, Int32(WHERE_WAIT),
                                  Int32(epoch))
        cute.arch.sync_threads()
        if warp == 0:
            _scan_sources(mRecvCount, sCum, lane, W, T_max)
        cute.arch.sync_threads()

        # 2. histogram of chunk c's valid pairs
        if _ld_i32_relaxed_gpu(err_addr) == Int32(0):
            V = sCum[W]
            L = (V + gdim - 1) // gdim
            v0 = cutlass.min(bidx * L, V)
            v1 = cutlass.min(v0 + L, V)
            for p in cutlass.range(v0 * K + tidx, v1 * K, NT):
                v = p // Int32(K)
                k = p - v * Int32(K)
                s = _slot_of(v, sCum, W, T_max)
                e = cute.arch.load(_gptr(Int32, ids_addr + (Int64(s) * K + Int64(k)) * 4, 4), Int32)
                if (e >= Int32(0)) & (e < Int32(E_l)):
                    cute.arch.atomic_add(sp + e, Int32(1))
        cute.arch.sync_threads()
        for e in cutlass.range(tidx, E_l, NT):
            mCounts[bidx * E_l + e] = sH[e]


class LocalRoute:
    """One rank (W = 1), instead of EpDispatch + LayoutCount: check the caller's routing, write
    the sanitised receive words and count each chunk's valid pairs per expert. No row moves
    (LayoutPlace gathers straight from the caller's ``x``).

    Static: top-K, T_max, experts E (= E_l at W = 1), threads per CTA. The ids dtype (int32 or
    int64) is compiled in from ``mTopkIds``.

    Arguments of ``__call__``:
        mTopkIds    [T_rows, K]  int32/int64 expert ids (T_rows dynamic, >= max(num_tokens, 1))
        mTopkW      [T_rows, K]  float32 router weights
        mIds        [T_max, K]   int32 output recv_ids: the id if the choice is valid, else -1
        mW          [T_max, K]   float32 output recv_w (the weight as given)
        mRecvCount  [1]          int32 output recv_count[0] = T (last CTA)
        mFlags      [2]          int64 flags[0] = the new epoch (last CTA), as a dispatch leaves it
        mCtrl       [4]          int64 ctrl[0] epoch (+1 by the last CTA), ctrl[1] arrival counter
                                 (reset by the last CTA: tail-clean)
        mErr        [4]          int32 error word; the kernel only stores zero counts while it is
                                 set; T > T_max sets (ERR_CAPACITY, 0, WHERE_DISPATCH, T)
        mVerr       [8]          int64 first bad id / non-finite weight, EpDispatch's rules
        mDestMask   [T_max]      int32 output: 1 if token t has a valid choice, else 0
        mCounts     [>= C*E]     int32 output counts[c*E + e] (dynamic length)
        num_tokens  Int32        T
        num_chunks  Int32        C = grid size (LayoutPlace must use the same C)
        stream      CUstream

    A choice (t, k) is valid iff 0 <= id < E and its weight is finite; the first invalid one of
    each kind is recorded exactly as EpDispatch records it (key t*K + k, earliest forward), so
    ``check_errors`` reports the same thing on either path.
    """

    def __init__(self, topk: int, max_tokens: int, num_experts: int, threads: int):
        assert 1 <= topk <= LAYOUT_MAX_TOPK and max_tokens >= 1
        assert 1 <= num_experts <= LAYOUT_MAX_LOCAL_EXPERTS
        assert threads % 32 == 0 and 32 <= threads <= 1024
        assert max_tokens * topk < 2**31
        self.K, self.T_max, self.E = topk, max_tokens, num_experts
        self.threads = threads

    @cute.jit
    def __call__(self, mTopkIds: cute.Tensor, mTopkW: cute.Tensor, mIds: cute.Tensor,
                 mW: cute.Tensor, mRecvCount: cute.Tensor, mFlags: cute.Tensor, mCtrl: cute.Tensor,
                 mErr: cute.Tensor, mVerr: cute.Tensor, mDestMask: cute.Tensor,
                 mCounts: cute.Tensor, num_tokens: Int32, num_chunks: Int32,
                 stream: cuda.CUstream):
        self.kernel(mTopkIds, mTopkW, mIds, mW, mRecvCount, mFlags, mCtrl, mErr, mVerr,
                    mDestMask, mCounts, num_tokens).launch(
            grid=(num_chunks, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mTopkIds: cute.Tensor, mTopkW: cute.Tensor, mIds: cute.Tensor,
               mW: cute.Tensor, mRecvCount: cute.Tensor, mFlags: cute.Tensor, mCtrl: cute.Tensor,
               mErr: cute.Tensor, mVerr: cute.Tensor, mDestMask: cute.Tensor,
               mCounts: cute.Tensor, num_tokens: Int32):
        wait_previous_grid_trigger_if_small()  # LayoutPlace next: see pdl.py
        K, T_max, E, NT = self.K, self.T_max, self.E, self.threads
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        err_addr = _addr(mErr)
        verr_addr = _addr(mVerr)
        ctrl_addr = _addr(mCtrl)
        w_addr = _addr(mTopkW)

        sp = cute.arch.alloc_smem(Int32, E)
        sH = cute.make_tensor(sp, cute.make_layout(E))
        for e in cutlass.range(tidx, E, NT):
            sH[e] = Int32(0)
        err0 = mErr[ERR_CODE]
        new_epoch = mCtrl[CTRL_EPOCH] + Int64(1)
        if num_tokens > Int32(T_max):
            if (bidx == 0) & (tidx == 0):
                _report_error(err_addr, Int32(ERR_CAPACITY), Int32(0), Int32(WHERE_DISPATCH),
                              num_tokens)
        ok = (num_tokens <= Int32(T_max)) & (err0 == Int32(0))
        cute.arch.sync_threads()

        if ok:
            # 1. chunk c's tokens, one thread per (t, k) pair: check, record, store, count
            L = (num_tokens + gdim - 1) // gdim
            t0 = cutlass.min(bidx * L, num_tokens)
            t1 = cutlass.min(t0 + L, num_tokens)
            for p in cutlass.range(t0 * K + tidx, t1 * K, NT):
                t = p // Int32(K)
                k = p - t * Int32(K)
                gid = Int64(mTopkIds[t, k])  # compared in 64 bits before any narrowing
                wk = mTopkW[t, k]
                wbits = cute.arch.load(_gptr(Int32, w_addr + Int64(p) * 4, 4), Int32)
                _, valid = _check_choice(gid, wbits, Int64(p), True, E, verr_addr, new_epoch)
                lid = Int32(-1)
                if valid:
                    lid = Int32(gid)
                    cute.arch.atomic_add(sp + lid, Int32(1))
                mIds[t, k] = lid
                mW[t, k] = wk
            cute.arch.sync_threads()  # the chunk's recv_ids rows are visible to the whole CTA
            # 2. destination mask of each token of the chunk (CombineReduce sums by it)
            for t in cutlass.range(t0 + tidx, t1, NT):
                any_ok = Int32(0)
                for k in cutlass.range_constexpr(K):
                    if mIds[t, k] >= Int32(0):
                        any_ok = Int32(1)
                mDestMask[t] = any_ok
        cute.arch.sync_threads()
        for e in cutlass.range(tidx, E, NT):
            mCounts[bidx * E + e] = sH[e]

        # 3. grid completion (ok only, like EpDispatch): the last CTA fills in the recorded
        #    values, publishes T and the epoch, and resets the arrival counter
        if ok & (tidx == 0):
            cute.arch.fence_acq_rel_gpu()
            arrived = cute.arch.atomic_add(
                _gptr(Int64, ctrl_addr + 8 * CTRL_DISPATCH_ARRIVE, 8), Int64(1),
                sem="acq_rel", scope="gpu")
            if arrived == Int64(gdim - 1):
                cute.arch.fence_acq_rel_gpu()
                _store_bad_values(mVerr, verr_addr, mTopkIds, w_addr, K, new_epoch)
                mRecvCount[0] = num_tokens
                mFlags[0] = new_epoch
                mCtrl[CTRL_DISPATCH_ARRIVE] = Int64(0)
                mCtrl[CTRL_EPOCH] = new_epoch


# =============================================================================================
# 2. LayoutPlace (+ fused row gather)
# =============================================================================================


class LayoutPlace:
    """Give every valid pair its grouped row in (expert, slot, k) order; write offsets / idx / ws /
    pos and, if ``gather``, the xs rows.

    Static: hidden H, top-K, world W, T_max, local experts E_l, threads per CTA, gather.

    Arguments of ``__call__``:
        mIds        [S, K]      int32 recv_ids
        mW          [S, K]      float32 recv_w
        mRecvCount  [W]         int32 recv_count
        mErr        [4]         int32 local error word; while set nothing is placed (offsets
                                are still written: all zero, since LayoutCount stored zeros)
        mCounts     [>= C*E_l]  int32 LayoutCount's output (same C)
        mX          [R, H]      bf16 recv_x (R dynamic; slots >= R are not copied); ignored
                                (any 1-row tensor) when gather is False
        mOffsets    [E_l + 1]   int32 output (written by CTA 0)
        mIdx        [cap]       int32 output (cap dynamic; rows >= cap are dropped)
        mWs         [cap]       float32 output
        mPos        [S, K]      int32 output (valid slots)
        mXs         [capx, H]   bf16 output rows (capx dynamic); ignored when gather is False
        num_chunks  Int32       C = grid size (must equal LayoutCount's)
        stream      CUstream
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, local_experts: int,
                 threads: int, gather: bool = True):
        assert 1 <= topk <= LAYOUT_MAX_TOPK and 1 <= world <= LAYOUT_MAX_WORLD and max_tokens >= 1
        assert 1 <= local_experts <= LAYOUT_MAX_LOCAL_EXPERTS
        assert threads % 32 == 0 and 32 <= threads <= 1024 and threads >= topk
        assert world * max_tokens * topk < 2**31
        self.H, self.K, self.W, self.T_max, self.E_l = hidden, topk, world, max_tokens, local_experts
        self.threads = threads
        self.NW = threads // 32
        self.TS = threads // topk                  # slots per tile (one thread per pair)
        self.G = max(1, threads // local_experts)  # thread groups splitting the chunk-count scan
        self.CPL = (local_experts + 31) // 32      # experts per lane in the offsets scan
        self.gather = bool(gather)
        self.plan = _RowPlan(hidden)
        smem = 4 * (2 * self.G * local_experts + local_experts + self.NW * local_experts
                    + self.TS * topk + world + 1)
        assert smem <= 48 * 1024, f"LayoutPlace needs {smem} B of static shared memory"

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mW: cute.Tensor, mRecvCount: cute.Tensor,
                 mErr: cute.Tensor, mCounts: cute.Tensor, mX: cute.Tensor, mOffsets: cute.Tensor,
                 mIdx: cute.Tensor, mWs: cute.Tensor, mPos: cute.Tensor, mXs: cute.Tensor,
                 num_chunks: Int32, stream: cuda.CUstream):
        self.kernel(mIds, mW, mRecvCount, mErr, mCounts, mX, mOffsets, mIdx, mWs, mPos,
                    mXs).launch(grid=(num_chunks, 1, 1), block=(self.threads, 1, 1),
                                stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mW: cute.Tensor, mRecvCount: cute.Tensor,
               mErr: cute.Tensor, mCounts: cute.Tensor, mX: cute.Tensor, mOffsets: cute.Tensor,
               mIdx: cute.Tensor, mWs: cute.Tensor, mPos: cute.Tensor, mXs: cute.Tensor):
        wait_previous_grid()
        K, W, T_max, E_l = self.K, self.W, self.T_max, self.E_l
        NT, NW, TS, G, CPL = self.threads, self.NW, self.TS, self.G, self.CPL
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        def smem(n):
            return cute.make_tensor(cute.arch.alloc_smem(Int32, n), cute.make_layout(n))

        sCum = smem(W + 1)
        sPre = smem(G * E_l)
        sTot = smem(G * E_l)
        sCur = smem(E_l)
        sHist = smem(NW * E_l)
        sRow = smem(TS * K)

        if warp == 0:
            _scan_sources(mRecvCount, sCum, lane, W, T_max)

        # A. per expert: rows of all chunks (tot) and of the chunks before this one (pre)
        for j in cutlass.range(tidx, G * E_l, NT):
            e = j % E_l
            g = j // E_l
            pre = Int32(0)
            tot = Int32(0)
            for cc in cutlass.range(g, gdim, G, unroll=8):
                v = mCounts[cc * E_l + e]
                tot = tot + v
                if cc < bidx:
                    pre = pre + v
            sPre[j] = pre
            sTot[j] = tot
        cute.arch.sync_threads()

        # B. offsets = exclusive scan of tot over experts (warp 0); cursor = offsets + pre
        if warp == 0:
            vals = []
            local = Int32(0)
            for jj in cutlass.range_constexpr(CPL):
                e = lane * CPL + jj
                v = Int32(0)
                if e < Int32(E_l):
                    for g in cutlass.range_constexpr(G):
                        v = v + sTot[g * E_l + e]
                vals.append(v)
                local = local + v
            incl = warp_inclusive_scan(local, lane)
            run = incl - local
            for jj in cutlass.range_constexpr(CPL):
                e = lane * CPL + jj
                if e < Int32(E_l):
                    pre_e = Int32(0)
                    for g in cutlass.range_constexpr(G):
                        pre_e = pre_e + sPre[g * E_l + e]
                    sCur[e] = run + pre_e
                    if bidx == 0:
                        mOffsets[e] = run
                run = run + vals[jj]
            if (lane == 31) & (bidx == 0):
                mOffsets[E_l] = incl
        cute.arch.sync_threads()

        # C. place the chunk's pairs, tile by tile (uniform trip count inside the CTA)
        cap = cutlass.min(mIdx.shape[0], mWs.shape[0])
        cap_x = mXs.shape[0]
        n_x = mX.shape[0]
        x_addr = _addr(mX)
        xs_addr = _addr(mXs)
        rb = self.plan.row_bytes
        lt = cute.arch.lanemask_lt()
        if mErr[ERR_CODE] == Int32(0):
            V = sCum[W]
            L = (V + gdim - 1) // gdim
            v0 = cutlass.min(bidx * L, V)
            v1 = cutlass.min(v0 + L, V)
            for tb in cutlass.range(v0, v1, TS):
                ls = tidx // Int32(K)
                k = tidx - ls * Int32(K)
                v = tb + ls
                inb = (tidx < Int32(TS * K)) & (v < v1)
                s = Int32(0)
                e = Int32(-1)
                w = Float32(0.0)
                if inb:
                    s = _slot_of(v, sCum, W, T_max)
                    e = mIds[s, k]
                    w = mW[s, k]
                valid = inb & (e >= Int32(0)) & (e < Int32(E_l))
                key = Int32(E_l)
                if valid:
                    key = e
                peers = cute.arch.match_sync(cute.arch.FULL_MASK, key, "any")
                below = Int32(cute.arch.popc(peers & lt))
                for j in cutlass.range(tidx, NW * E_l, NT):
                    sHist[j] = Int32(0)
                cute.arch.sync_threads()
                if valid & (below == Int32(0)):  # the lowest lane of each expert group
                    sHist[warp * E_l + e] = Int32(cute.arch.popc(peers))
                cute.arch.sync_threads()
                for e2 in cutlass.range(tidx, E_l, NT):
                    run = sCur[e2]
                    for w2 in cutlass.range_constexpr(NW):
                        h = sHist[w2 * E_l + e2]
                        sHist[w2 * E_l + e2] = run
                        run = run + h
                    sCur[e2] = run
                cute.arch.sync_threads()
                row = Int32(-1)
                if valid:
                    row = sHist[warp * E_l + e] + below
                if tidx < Int32(TS * K):
                    sRow[tidx] = row
                if inb:
                    mPos[s, k] = row
                    if valid & (row < cap):
                        mIdx[row] = s
                        mWs[row] = w
                if cutlass.const_expr(self.gather):
                    cute.arch.sync_threads()
                    self._gather_tile(tb, v1, sRow, sCum, mX, n_x, x_addr, xs_addr, cap_x, rb,
                                      lane, warp)

    @cute.jit
    def _gather_tile(self, tb: Int32, v1: Int32, sRow: cute.Tensor, sCum: cute.Tensor,
                     mX: cute.Tensor, n_x: Int32, x_addr: Int64, xs_addr: Int64, cap_x: Int32,
                     rb: cutlass.Constexpr, lane: Int32, warp: Int32):
        """One warp per slot of the tile: load the slot's row once (16-byte vectors, U in flight
        per lane) and store it to each of its valid grouped rows."""
        K, W, T_max, NW, TS = self.K, self.W, self.T_max, self.NW, self.TS
        for ls in cutlass.range(warp, TS, NW):
            v = tb + ls
            if v < v1:
                s = _slot_of(v, sCum, W, T_max)
                r_lane = Int32(-1)
                if lane < K:
                    r_lane = sRow[ls * K + lane]
                mask = cute.arch.vote_ballot_sync((r_lane >= Int32(0)) & (r_lane < cap_x))
                if (mask != Int32(0)) & (s < n_x):
                    rows = [cute.arch.shuffle_sync(r_lane, k) for k in range(K)]
                    src_row = x_addr + Int64(s) * rb
                    for c in cutlass.range_constexpr(self.plan.chunks):
                        slots = self.plan.slots(c)
                        offs, vals = self.plan.load_chunk(slots, src_row, lane)
                        for k in cutlass.range_constexpr(K):
                            if ((mask >> k) & 1) != 0:
                                dst_row = xs_addr + Int64(rows[k]) * rb
                                self.plan.store_chunk(slots, dst_row, offs, vals, lane)
