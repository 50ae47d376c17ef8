"""Intranode expert-parallel (EP) communication kernels for SM90, written in CuTeDSL.

W ranks on one host exchange tokens through peer pointers (NVSHMEM symmetric tensors mapped
with ``nvshmem.core.get_peer_tensor`` on real GPUs, or plain buffers of one GPU for "virtual
ranks"). E experts, E_l = E / W local experts per rank (rank r owns global experts
[r*E_l, (r+1)*E_l)); each rank has T <= T_max tokens routed top-K.

Symmetric buffers of every rank (slot s = src_rank * T_max + t):

    recv_x     [W*T_max, H] bf16    dispatched token rows (one copy per destination rank)
    recv_ids   [W*T_max, K] int32   local expert id of choice k if it lives here, else -1
    recv_w     [W*T_max, K] float32 router weights of the slot (all K)
    recv_count [W]          int32   T of each source (slots t >= recv_count[src] are stale)
    comb       [W*T_max, H] bf16    on the SOURCE rank: partial rows returned by destination d
                                    at slot d*T_max + t
    flags      [2*W]        int64   flags[s]: dispatch epoch from source s,
                                    flags[W+d]: combine epoch from destination d

Local (per rank, never touched by peers):

    ctrl       [4]          int64   ctrl[0] epoch, ctrl[1]/ctrl[2] CTA-arrival counters
    err        [4]          int32   (code, peer, where, aux); see ep_constants. Fatal: every
                                    kernel is a no-op while it is set
    verr       [8]          int64   first bad expert id / non-finite weight (ep_constants.VERR_*);
                                    informational: the choice was dropped, nothing stops
    dmask      [T_max]      int32   per token, the destination ranks EpDispatch sent it to

Input values: EpDispatch drops a (token, k) choice whose expert id is outside [0, E) or whose
router weight is not finite (routed nowhere: never wrapped, never read or written out of bounds)
and records the first such choice in verr; CombineReduce sums exactly the ranks in dmask.

Protocol (epoch scheme, nothing is zeroed between forwards):
    * ``EpDispatch`` reads e = ctrl[0] + 1, copies rows / ids / weights to the destinations, and
      the LAST CTA to finish (atom.add.acq_rel.gpu on ctrl[1]) executes fence.acq_rel.sys, stores
      recv_count[my_rank] = T on every peer, release-stores (st.release.sys) flags[my_rank] = e
      on every peer, then stores ctrl[0] = e and resets ctrl[1] = 0.
    * ``EpWait`` (1 warp) acquire-spins (ld.acquire.sys) until flags[s] == ctrl[0] for every
      source s, bounded by %globaltimer; on timeout err = (1, s, WHERE_WAIT, epoch). (The
      expert-layout kernel ``LayoutCount`` performs the same wait itself, saving a launch.)
    * ``CombineSend`` sends partial rows to each source q and its last CTA release-stores
      flags[W + my_rank] = ctrl[0] on every peer, resets ctrl[2] = 0.
    * ``CombineReduce`` acquire-spins until flags[W + d] == ctrl[0] for every d (bounded), then
      reduces. Flags only ever move forward (epoch + 1 per forward), so the buffers are
      tail-clean: no flag or counter region must be zeroed between launches. The only counters
      that return to a value are the local CTA-arrival counters ctrl[1], ctrl[2], which the last
      CTA of the kernel resets to 0 before it exits.
    * Buffer reuse is safe with one forward in flight per rank and the per-rank stream order
      dispatch -> wait -> (gather, experts) -> combine_send -> combine_reduce: rank r writes
      peer d's recv_* for forward i+1 only after its combine_reduce(i) saw d's combine flag of
      forward i, which d set after it had consumed recv_* of forward i; d writes r's comb for
      i+1 only after its wait(i+1) saw r's dispatch flag, set after r's combine_reduce(i).

All kernels are deterministic (no float atomics): fp32 sums in a fixed order (k order in
CombineSend, rank order 0..W-1 in CombineReduce), rounded to bf16 once per stage.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir import ir

from .pdl import PDL, wait_previous_grid
from .ep_constants import (
    CTRL_COMBINE_ARRIVE,
    CTRL_DISPATCH_ARRIVE,
    CTRL_EPOCH,
    EP_MAX_TOPK,
    EP_MAX_WORLD,
    EP_THREADS,
    EP_UNROLL,
    EP_VEC_BYTES,
    EP_WAIT_THREADS,
    F32_EXP_MASK,
    VERR_ID_EPOCH,
    VERR_ID_KEY,
    VERR_ID_VALUE,
    VERR_W_EPOCH,
    VERR_W_KEY,
    VERR_W_VALUE,
    ERR_AUX,
    ERR_CAPACITY,
    ERR_CODE,
    ERR_PEER,
    ERR_TIMEOUT,
    ERR_WHERE,
    PEER_COMB,
    PEER_FLAGS,
    PEER_RECV_COUNT,
    PEER_RECV_IDS,
    PEER_RECV_W,
    PEER_RECV_X,
    WHERE_COMBINE_REDUCE,
    WHERE_DISPATCH,
    WHERE_WAIT,
)

_BF16_PER_VEC = EP_VEC_BYTES // 2  # 8


# =============================================================================================
# Small device helpers (emit IR at trace time)
# =============================================================================================


def _gptr(dtype, addr, align: int):
    """Global-memory pointer from a runtime Int64 byte address (own or peer memory)."""
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def _addr(t: cute.Tensor) -> Int64:
    """Byte address of a tensor's first element."""
    return t.iterator.toint()


def _v4i32():
    return ir.VectorType.get([4], Int32.mlir_type)


def _v8bf16():
    return ir.VectorType.get([_BF16_PER_VEC], BFloat16.mlir_type)


def _ld_vec(addr: Int64):
    """16-byte vector load (ld.global.v4.b32)."""
    return cute.arch.load(_gptr(Int32, addr, 16), _v4i32())


def _st_vec(addr: Int64, v):
    """16-byte vector store (st.global.v4.b32); ``addr`` may be a peer address."""
    cute.arch.store(_gptr(Int32, addr, 16), v)


def _ld_bf16x8_f32(addr: Int64):
    """Load 8 bf16 (16 bytes) and widen to a float32 TensorSSA of shape (8,)."""
    v = cute.arch.load(_gptr(BFloat16, addr, 16), _v8bf16())
    return cute.TensorSSA(v, (_BF16_PER_VEC,), BFloat16).to(Float32)


def _ld_i64(addr: Int64, acquire_sys: bool = False) -> Int64:
    if acquire_sys:
        return cute.arch.load(_gptr(Int64, addr, 8), Int64, sem="acquire", scope="sys")
    return cute.arch.load(_gptr(Int64, addr, 8), Int64)


def _ld_i32_relaxed_gpu(addr: Int64) -> Int32:
    return cute.arch.load(_gptr(Int32, addr, 4), Int32, sem="relaxed", scope="gpu")


def _ld_i64_relaxed_gpu(addr: Int64) -> Int64:
    return cute.arch.load(_gptr(Int64, addr, 8), Int64, sem="relaxed", scope="gpu")


class _RowPlan:
    """Static plan of one warp moving one H-wide bf16 row as 16-byte vectors.

    Lane ``l`` handles vectors ``c*32*U + u*32 + l`` for chunk c and unroll slot u: each chunk
    issues U independent 16-byte loads per lane before any store (U*16 B in flight per lane).
    Drop v80: the kernels' row loops share its chunk helpers -- :meth:`load_chunk` +
    :meth:`store_chunk` (a row copy: dispatch, GatherRows, LayoutPlace) and :meth:`add_chunk` +
    :meth:`store_sum` (a float32 sum of rows: CombineSend, CombineLocal, CombineReduce); their PTX
    is byte-identical to v79's inline loops.
    """

    def __init__(self, hidden: int, unroll: int = EP_UNROLL):
        assert hidden % _BF16_PER_VEC == 0, "H must be a multiple of 8"
        self.nvec = hidden // _BF16_PER_VEC
        self.unroll = max(1, min(unroll, (self.nvec + 31) // 32))
        self.chunks = (self.nvec + 32 * self.unroll - 1) // (32 * self.unroll)
        self.row_bytes = hidden * 2

    def slots(self, c: int):
        """Static (u, vbase, needs_predicate) triples of chunk c (slots beyond H skipped)."""
        out = []
        for u in range(self.unroll):
            vbase = c * 32 * self.unroll + u * 32
            if vbase < self.nvec:
                out.append((u, vbase, vbase + 32 > self.nvec))
        return out

    def vec(self, lane: Int32, vbase: int, pred: bool) -> Int32:
        """Lane ``lane``'s vector of the slot at ``vbase``; in a slot reaching past the row
        (``pred``) the index is clamped to the last vector, so the load stays inside the row (the
        caller masks the store)."""
        vi = lane + vbase
        if pred:
            vi = cutlass.min(vi, Int32(self.nvec - 1))
        return vi

    def load_chunk(self, slots, row: Int64, lane: Int32):
        """Issue chunk ``slots``' 16-byte loads of the row at byte address ``row``, all before any
        store (traced inline): ``(offsets, vectors)``, one per slot."""
        offs, vals = [], []
        for u, vbase, pred in slots:
            off = Int64(self.vec(lane, vbase, pred)) * EP_VEC_BYTES
            offs.append(off)
            vals.append(_ld_vec(row + off))
        return offs, vals

    def add_chunk(self, accs, slots, row: Int64, lane: Int32, weight=None):
        """``accs[j] += (weight *) float32(row's vector of slot j)`` for chunk ``slots`` of the bf16
        row at byte address ``row`` (traced inline; ``weight`` None: unweighted)."""
        for j in range(len(slots)):
            u, vbase, pred = slots[j]
            v = _ld_bf16x8_f32(row + Int64(self.vec(lane, vbase, pred)) * EP_VEC_BYTES)
            if weight is not None:
                v = v * weight
            accs[j].store(accs[j].load() + v)

    @cute.jit
    def store_sum(self, accs, slots, row: Int64, lane: Int32):
        """Chunk ``slots``' float32 sums ``accs`` as bf16 vectors into the row at byte address
        ``row``; lanes past the row store nothing (traced inline)."""
        for j in cutlass.range_constexpr(len(slots)):
            u, vbase, pred = slots[j]
            o = accs[j].load().to(BFloat16)
            off = Int64(lane + vbase) * EP_VEC_BYTES
            if cutlass.const_expr(pred):
                if lane + vbase < self.nvec:
                    cute.arch.store(_gptr(BFloat16, row + off, 16), o.ir_value())
            else:
                cute.arch.store(_gptr(BFloat16, row + off, 16), o.ir_value())

    @cute.jit
    def store_chunk(self, slots, row: Int64, offs, vals, lane: Int32):
        """Chunk ``slots``' vectors ``vals`` (from :meth:`load_chunk`) into the row at byte address
        ``row`` (own or a peer's) at ``offs``; lanes past the row store nothing (traced inline)."""
        for j in cutlass.range_constexpr(len(slots)):
            u, vbase, pred = slots[j]
            if cutlass.const_expr(pred):
                if lane + vbase < self.nvec:
                    _st_vec(row + offs[j], vals[j])
            else:
                _st_vec(row + offs[j], vals[j])


@cute.jit
def _report_error(err_addr: Int64, code: Int32, peer: Int32, where: Int32, aux: Int32):
    """First error wins: CAS err[0] 0 -> code, then fill (peer, where, aux)."""
    old = cute.arch.atomic_cas(_gptr(Int32, err_addr, 4), cmp=Int32(0), val=code,
                               sem="relaxed", scope="gpu")
    if old == Int32(0):
        cute.arch.store(_gptr(Int32, err_addr + 4 * ERR_PEER, 4), peer)
        cute.arch.store(_gptr(Int32, err_addr + 4 * ERR_WHERE, 4), where)
        cute.arch.store(_gptr(Int32, err_addr + 4 * ERR_AUX, 4), aux)


@cute.jit
def _record_bad_value(epoch_addr: Int64, key_addr: Int64, epoch: Int64, key: Int64):
    """Keep the first bad input: the earliest forward claims the record (CAS 0 -> epoch), and
    within it the smallest key wins (atomic min). Later forwards leave it alone."""
    old = cute.arch.atomic_cas(_gptr(Int64, epoch_addr, 8), cmp=Int64(0), val=epoch,
                               sem="relaxed", scope="gpu")
    if (old == Int64(0)) | (old == epoch):
        cute.arch.atomic_min(_gptr(Int64, key_addr, 8), key, sem="relaxed", scope="gpu")


@cute.jit
def _check_choice(gid: Int64, wbits: Int32, key: Int64, active, num_experts: cutlass.Constexpr,
                  verr_addr: Int64, epoch: Int64):
    """The input rule for one (token, k) choice (``active``: this thread holds one): valid iff
    0 <= id < E (``gid`` compared in 64 bits) and the weight (its float32 bits ``wbits``) is
    finite. The first bad choice of each kind, by ``key`` = t*K + k, is recorded in verr for
    forward ``epoch``. Returns (id_ok, valid)."""
    id_ok = (gid >= Int64(0)) & (gid < Int64(num_experts))
    w_bad = (wbits & Int32(F32_EXP_MASK)) == Int32(F32_EXP_MASK)
    if active & ((gid < Int64(0)) | (gid >= Int64(num_experts))):
        _record_bad_value(verr_addr + 8 * VERR_ID_EPOCH, verr_addr + 8 * VERR_ID_KEY, epoch, key)
    if active & id_ok & w_bad:
        _record_bad_value(verr_addr + 8 * VERR_W_EPOCH, verr_addr + 8 * VERR_W_KEY, epoch, key)
    w_ok = (wbits & Int32(F32_EXP_MASK)) != Int32(F32_EXP_MASK)
    return id_ok, active & id_ok & w_ok


@cute.jit
def _store_bad_values(mVerr: cute.Tensor, verr_addr: Int64, mTopkIds: cute.Tensor, w_addr: Int64,
                      K: cutlass.Constexpr, epoch: Int64):
    """Last CTA of a checking kernel (every CTA's verr atomics visible): store the recorded bad
    id / weight bits of forward ``epoch`` beside their keys."""
    if _ld_i64_relaxed_gpu(verr_addr + 8 * VERR_ID_EPOCH) == epoch:
        kid = _ld_i64_relaxed_gpu(verr_addr + 8 * VERR_ID_KEY)
        tk = Int32(kid // Int64(K))
        mVerr[VERR_ID_VALUE] = Int64(mTopkIds[tk, Int32(kid - Int64(tk) * K)])
    if _ld_i64_relaxed_gpu(verr_addr + 8 * VERR_W_EPOCH) == epoch:
        kw = _ld_i64_relaxed_gpu(verr_addr + 8 * VERR_W_KEY)
        bits = cute.arch.load(_gptr(Int32, w_addr + kw * 4, 4), Int32)
        mVerr[VERR_W_VALUE] = Int64(bits)


@cute.jit
def _spin_wait_eq(flag_addr: Int64, expected: Int64, timeout_ns: Int64) -> Int32:
    """Acquire-spin (ld.acquire.sys) until *flag == expected. Returns 1 (arrived) or 2 (timed
    out after ``timeout_ns`` of %globaltimer wall clock)."""
    t0 = cute.arch.globaltimer()
    state = Int32(0)
    while state == Int32(0):
        v = _ld_i64(flag_addr, acquire_sys=True)
        if v == expected:
            state = Int32(1)
        else:
            if cute.arch.globaltimer() - t0 > timeout_ns:
                state = Int32(2)
    return state


# =============================================================================================
# 1. EpDispatch
# =============================================================================================


class EpDispatch:
    """Dispatch: send every token row once to each destination rank that owns >= 1 of its experts,
    dropping (and recording) invalid choices.

    Static (compile time): hidden H, top-K, world W, T_max, num_experts E, threads per CTA.

    Arguments of ``__call__`` (CuTe tensors, L = this rank):
        mX        [T_rows, H] bf16, row-major, 16-B aligned; rows >= num_tokens ignored (T_rows
                  dynamic, >= max(num_tokens, 1))
        mTopkIds  [T_rows, K] int32 or int64 global expert ids (the dtype is compiled in)
        mTopkW    [T_rows, K] float32 router weights
        mPeers    [6, W]      int64 peer address table (ep_constants.PEER_*), column r = rank r
        mCtrl     [4]         int64 local control word (ctrl[0] epoch, ctrl[1] arrival counter)
        mErr      [4]         int32 local error word (fatal errors; kernel is a no-op if set)
        mVerr     [8]         int64 local input-value record (ep_constants.VERR_*)
        mDestMask [T_max]     int32 local: per token, the set of destination ranks it went to
        my_rank   Int32       this rank (0 <= my_rank < W)
        num_tokens Int32      T; T > T_max sets err = (2, my_rank, WHERE_DISPATCH, T) and the
                              kernel writes nothing (peers then time out naming this rank)
        num_ctas  Int32       grid size (virtual ranks: small enough that all ranks co-reside)
        stream    CUstream

    A choice (t, k) is VALID iff 0 <= id < E and its weight is finite. Invalid choices are routed
    nowhere (never wrapped); the first of each kind is recorded in mVerr (earliest forward, then
    smallest t*K + k, then its value), which never stops any kernel.
    Writes on every peer d (addresses from mPeers): for each token t with a valid choice on d,
    recv_x[my_rank*T_max + t] = x[t]; for EVERY d and t: recv_ids[my_rank*T_max + t, k] =
    id_k - d*E_l if choice k is valid and lives on d else -1, recv_w[...] = w_k; then (last CTA)
    recv_count[my_rank] = T, fence.acq_rel.sys, flags[my_rank] = epoch + 1 (st.release.sys).
    Locally: mDestMask[t], ctrl[0] = epoch + 1, ctrl[1] = 0 (tail-clean).
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                 threads: int = EP_THREADS):
        assert 1 <= world <= EP_MAX_WORLD and 1 <= topk <= EP_MAX_TOPK
        assert num_experts % world == 0, "E must be divisible by W"
        assert threads % 32 == 0 and threads >= 32
        self.H, self.K, self.W, self.T_max, self.E = hidden, topk, world, max_tokens, num_experts
        self.E_l = num_experts // world
        self.threads = threads
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTopkIds: cute.Tensor, mTopkW: cute.Tensor,
                 mPeers: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor, mVerr: cute.Tensor,
                 mDestMask: cute.Tensor, my_rank: Int32, num_tokens: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        self.kernel(mX, mTopkIds, mTopkW, mPeers, mCtrl, mErr, mVerr, mDestMask, my_rank,
                    num_tokens).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1),
                                       stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTopkIds: cute.Tensor, mTopkW: cute.Tensor,
               mPeers: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor, mVerr: cute.Tensor,
               mDestMask: cute.Tensor, my_rank: Int32, num_tokens: Int32):
        wait_previous_grid()
        W, K, T_max, E, E_l = self.W, self.K, self.T_max, self.E, self.E_l
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        ctrl_addr = _addr(mCtrl)
        err_addr = _addr(mErr)
        verr_addr = _addr(mVerr)
        x_addr = _addr(mX)
        w_addr = _addr(mTopkW)
        err0 = mErr[ERR_CODE]
        new_epoch = mCtrl[CTRL_EPOCH] + Int64(1)

        if num_tokens > Int32(T_max):
            if (bidx == 0) & (tidx == 0):
                _report_error(err_addr, Int32(ERR_CAPACITY), my_rank, Int32(WHERE_DISPATCH),
                              num_tokens)
        if (num_tokens <= Int32(T_max)) & (err0 == Int32(0)):
            # Peer base addresses (registers, W static).
            px = [mPeers[PEER_RECV_X, d] for d in range(W)]
            pids = [mPeers[PEER_RECV_IDS, d] for d in range(W)]
            pw = [mPeers[PEER_RECV_W, d] for d in range(W)]
            slot0 = my_rank * T_max

            for t in cutlass.range(gwarp, num_tokens, nwarps):
                # Lane k < K holds choice k; ids are compared in 64 bits before any narrowing.
                gid = Int64(-1)
                wk = Float32(0.0)
                wbits = Int32(0)
                if lane < K:
                    gid = Int64(mTopkIds[t, lane])
                    wk = mTopkW[t, lane]
                    wbits = cute.arch.load(
                        _gptr(Int32, w_addr + (Int64(t) * K + Int64(lane)) * 4, 4), Int32)
                key = Int64(t) * K + Int64(lane)
                _, valid = _check_choice(gid, wbits, key, lane < K, E, verr_addr, new_epoch)
                dst = Int32(-1)
                if valid:
                    dst = Int32(gid // Int64(E_l))
                bit = Int32(0)
                if valid:
                    bit = Int32(1) << dst
                mask = cute.arch.warp_redux_sync(bit, "or")
                if lane == 0:
                    mDestMask[t] = mask

                slot = slot0 + t
                # recv_ids / recv_w rows on every destination (-1 where not local to d).
                if lane < K:
                    for d in cutlass.range_constexpr(W):
                        lid = Int32(-1)
                        if dst == Int32(d):
                            lid = Int32(gid) - Int32(d * E_l)
                        eoff = (Int64(slot) * K + Int64(lane)) * 4
                        cute.arch.store(_gptr(Int32, pids[d] + eoff, 4), lid)
                        cute.arch.store(_gptr(Float32, pw[d] + eoff, 4), wk)

                # Row copy: load each chunk once, store it to every destination in the mask.
                src_row = x_addr + Int64(t) * self.plan.row_bytes
                dst_row_off = Int64(slot) * self.plan.row_bytes
                for c in cutlass.range_constexpr(self.plan.chunks):
                    slots = self.plan.slots(c)
                    offs, vals = self.plan.load_chunk(slots, src_row, lane)
                    for d in cutlass.range_constexpr(W):
                        if ((mask >> d) & 1) != 0:
                            self.plan.store_chunk(slots, px[d] + dst_row_off, offs, vals, lane)

            # Grid completion: the last CTA publishes count + flag on every peer.
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.fence_acq_rel_sys()
                arrived = cute.arch.atomic_add(
                    _gptr(Int64, ctrl_addr + 8 * CTRL_DISPATCH_ARRIVE, 8), Int64(1),
                    sem="acq_rel", scope="gpu")
                if arrived == Int64(gdim - 1):
                    cute.arch.fence_acq_rel_sys()
                    # The first bad value of this forward (every CTA's atomics are visible now):
                    # store the value itself beside its key.
                    _store_bad_values(mVerr, verr_addr, mTopkIds, w_addr, K, new_epoch)
                    for d in cutlass.range_constexpr(W):
                        cnt_addr = mPeers[PEER_RECV_COUNT, d] + Int64(my_rank) * 4
                        cute.arch.store(_gptr(Int32, cnt_addr, 4), num_tokens)
                    for d in cutlass.range_constexpr(W):
                        flag_addr = mPeers[PEER_FLAGS, d] + Int64(my_rank) * 8
                        cute.arch.store(_gptr(Int64, flag_addr, 8), new_epoch,
                                        sem="release", scope="sys")
                    cute.arch.store(_gptr(Int64, ctrl_addr + 8 * CTRL_DISPATCH_ARRIVE, 8),
                                    Int64(0))
                    cute.arch.store(_gptr(Int64, ctrl_addr + 8 * CTRL_EPOCH, 8), new_epoch)


# =============================================================================================
# 2. EpWait
# =============================================================================================


class EpWait:
    """Wait until every source's dispatch of the current epoch has arrived (1 CTA, 1 warp).

    Static: world W.

    Arguments of ``__call__``:
        mFlags     [2*W] int64 this rank's flags (flags[s] = dispatch epoch from source s)
        mCtrl      [4]   int64 local control word; expected epoch = ctrl[0] (set by EpDispatch)
        mErr       [4]   int32 local error word; no-op if err[0] != 0 on entry
        timeout_ns Int64 wall-clock bound (%globaltimer) per wait
        stream     CUstream

    Lane s < W acquire-spins (ld.acquire.sys) on flags[s] == ctrl[0]. On timeout:
    err = (1, s, WHERE_WAIT, epoch) and exit. Kernels launched after it on the same stream see
    every source's recv_x / recv_ids / recv_w / recv_count of this epoch.
    """

    def __init__(self, world: int):
        assert 1 <= world <= EP_WAIT_THREADS
        self.W = world

    @cute.jit
    def __call__(self, mFlags: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor,
                 timeout_ns: Int64, stream: cuda.CUstream):
        self.kernel(mFlags, mCtrl, mErr, timeout_ns).launch(
            grid=(1, 1, 1), block=(EP_WAIT_THREADS, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mFlags: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor,
               timeout_ns: Int64):
        wait_previous_grid(trigger=False)  # spins on other ranks' flags: no early trigger
        tidx, _, _ = cute.arch.thread_idx()
        if mErr[ERR_CODE] == Int32(0):
            expected = mCtrl[CTRL_EPOCH]
            if tidx < self.W:
                state = _spin_wait_eq(_addr(mFlags) + Int64(tidx) * 8, expected, timeout_ns)
                if state == Int32(2):
                    _report_error(_addr(mErr), Int32(ERR_TIMEOUT), tidx, Int32(WHERE_WAIT),
                                  Int32(expected))


# =============================================================================================
# 3. GatherRows
# =============================================================================================


class GatherRows:
    """out[i] = src[idx[i]] for i < n, n = min(count[0], cap) read from DEVICE memory.

    Static: hidden H, threads per CTA.

    Arguments of ``__call__``:
        mSrc   [R, H]   bf16 row-major, 16-B aligned (R dynamic), e.g. recv_x [W*T_max, H]
        mIdx   [cap]    int32 source row of each output row (cap dynamic); idx outside [0, R)
                        writes a zero row
        mCount [1]      int32 number of valid output rows n (device memory, e.g. a view of the
                        last element of the expert offsets); n is clamped to cap
        mOut   [cap, H] bf16 row-major, 16-B aligned; rows >= n are not touched
        num_ctas Int32, stream CUstream

    One warp per output row, grid-stride, 16-byte vectors, U vectors in flight per lane.
    """

    def __init__(self, hidden: int, threads: int = EP_THREADS):
        self.H = hidden
        self.threads = threads
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mIdx: cute.Tensor, mCount: cute.Tensor,
                 mOut: cute.Tensor, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mSrc, mIdx, mCount, mOut).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mIdx: cute.Tensor, mCount: cute.Tensor,
               mOut: cute.Tensor):
        wait_previous_grid()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        src_addr = _addr(mSrc)
        out_addr = _addr(mOut)
        n_src = mSrc.shape[0]
        n = cutlass.min(mCount[0], mIdx.shape[0])
        zero = cute.full((4,), 0, Int32)

        for i in cutlass.range(gwarp, n, nwarps):
            r = mIdx[i]
            out_row = out_addr + Int64(i) * self.plan.row_bytes
            if (r >= Int32(0)) & (r < n_src):
                src_row = src_addr + Int64(r) * self.plan.row_bytes
                for c in cutlass.range_constexpr(self.plan.chunks):
                    slots = self.plan.slots(c)
                    offs, vals = self.plan.load_chunk(slots, src_row, lane)
                    self.plan.store_chunk(slots, out_row, offs, vals, lane)
            else:
                for c in cutlass.range_constexpr(self.plan.chunks):
                    for u, vbase, pred in self.plan.slots(c):
                        if lane + vbase < self.plan.nvec:
                            _st_vec(out_row + Int64(lane + vbase) * EP_VEC_BYTES,
                                    zero.ir_value())


# =============================================================================================
# 4. CombineSend
# =============================================================================================


class CombineSend:
    """Expert side of combine: reduce each received slot's K expert rows and send it home.

    Static: hidden H, top-K, world W, T_max, threads per CTA.

    Static ``weighted``: False (the forward) -- y rows are already multiplied by the router
    weights (FC2's epilogue); True (the split dispatch/combine pair) -- row k is multiplied by
    recv_w[s, k] in fp32 before the sum.

    Arguments of ``__call__``:
        mY          [R, H]       bf16 expert outputs grouped by expert (R dynamic)
        mPos        [W*T_max, K] int32 grouped row of choice k of slot s, or -1
        mRecvCount  [W]          int32 this rank's recv_count (written by the sources' dispatch)
        mRecvW      [W*T_max, K] float32 this rank's recv_w (read only when ``weighted``)
        mPeers      [6, W]       int64 peer address table
        mCtrl       [4]          int64 local control word (ctrl[0] = current epoch,
                                 ctrl[2] arrival counter)
        mErr        [4]          int32 local error word; no-op (no flags sent) if err[0] != 0
        my_rank     Int32
        num_ctas    Int32, stream CUstream

    For every slot s = q*T_max + t with t < recv_count[q] and at least one pos[s, k] >= 0:
    acc = sum_k (w_sk *) y[pos[s, k]] in fp32 in k order -> bf16 -> peer q's comb[my_rank*T_max + t].
    Then the last CTA executes fence.acq_rel.sys and release-stores flags[W + my_rank] =
    ctrl[0] on every peer (also peers that received nothing), and resets ctrl[2] = 0.
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int,
                 threads: int = EP_THREADS, weighted: bool = False):
        self.H, self.K, self.W, self.T_max = hidden, topk, world, max_tokens
        self.threads = threads
        self.weighted = bool(weighted)
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mY: cute.Tensor, mPos: cute.Tensor, mRecvCount: cute.Tensor,
                 mRecvW: cute.Tensor, mPeers: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor,
                 my_rank: Int32, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mY, mPos, mRecvCount, mRecvW, mPeers, mCtrl, mErr, my_rank).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mPos: cute.Tensor, mRecvCount: cute.Tensor,
               mRecvW: cute.Tensor, mPeers: cute.Tensor, mCtrl: cute.Tensor, mErr: cute.Tensor,
               my_rank: Int32):
        wait_previous_grid()
        W, K, T_max = self.W, self.K, self.T_max
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        ctrl_addr = _addr(mCtrl)
        y_addr = _addr(mY)
        n_y = mY.shape[0]
        epoch = mCtrl[CTRL_EPOCH]

        if mErr[ERR_CODE] == Int32(0):
            accs = [cute.make_rmem_tensor((_BF16_PER_VEC,), Float32)
                    for _ in range(self.plan.unroll)]
            for s in cutlass.range(gwarp, W * T_max, nwarps):
                q = s // Int32(T_max)
                t = s - q * Int32(T_max)
                if t < mRecvCount[q]:
                    p_lane = Int32(-1)
                    w_lane = Float32(1.0)
                    if lane < K:
                        p_lane = mPos[s, lane]
                        if cutlass.const_expr(self.weighted):
                            w_lane = mRecvW[s, lane]
                    ok_lane = (p_lane >= Int32(0)) & (p_lane < n_y)
                    any_mask = cute.arch.vote_ballot_sync(ok_lane)
                    if any_mask != Int32(0):
                        dst_row = mPeers[PEER_COMB, q] + (
                            Int64(my_rank) * T_max + Int64(t)) * self.plan.row_bytes
                        for c in cutlass.range_constexpr(self.plan.chunks):
                            slots = self.plan.slots(c)
                            for j in cutlass.range_constexpr(len(slots)):
                                accs[j].fill(0.0)
                            for k in cutlass.range_constexpr(K):
                                p = cute.arch.shuffle_sync(p_lane, k)
                                wk = Float32(1.0)
                                if cutlass.const_expr(self.weighted):
                                    wk = cute.arch.shuffle_sync(w_lane, k)
                                if ((any_mask >> k) & 1) != 0:
                                    row = y_addr + Int64(p) * self.plan.row_bytes
                                    self.plan.add_chunk(accs, slots, row, lane, wk if self.weighted else None)
                            self.plan.store_sum(accs, slots, dst_row, lane)

            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.fence_acq_rel_sys()
                arrived = cute.arch.atomic_add(
                    _gptr(Int64, ctrl_addr + 8 * CTRL_COMBINE_ARRIVE, 8), Int64(1),
                    sem="acq_rel", scope="gpu")
                if arrived == Int64(gdim - 1):
                    cute.arch.fence_acq_rel_sys()
                    for d in cutlass.range_constexpr(W):
                        flag_addr = mPeers[PEER_FLAGS, d] + Int64(W + my_rank) * 8
                        cute.arch.store(_gptr(Int64, flag_addr, 8), epoch,
                                        sem="release", scope="sys")
                    cute.arch.store(_gptr(Int64, ctrl_addr + 8 * CTRL_COMBINE_ARRIVE, 8),
                                    Int64(0))


class CombineLocal:
    """Combine of a single rank (W = 1) in one pass: CombineSend's K-row sum written straight
    into the output, no comb buffer, no flags (nothing waits for them at W = 1).

    Static: hidden H, top-K, T_max, threads per CTA.

    Arguments of ``__call__``:
        mY          [R, H]       bf16 expert outputs grouped by expert, router weights applied (R dynamic)
        mPos        [T_max, K]   int32 grouped row of choice k of token t, or -1
        mRecvCount  [1]          int32 T of this forward (written by this rank's dispatch)
        mErr        [4]          int32 local error word; no-op if err[0] != 0
        mOut        [T_rows, H]  bf16 output
        num_tokens  Int32        rows of mOut to write (T, clamped to T_max)
        num_ctas    Int32, stream CUstream

    For t < min(num_tokens, recv_count[0]): out[t] = sum_k y[pos[t, k]] in fp32 in k order ->
    bf16, a zero row when no choice is valid. Bit for bit what CombineSend (rounding the sum to
    bf16 in comb) followed by CombineReduce (one partial row, fp32 -> bf16: exact) produce.
    CTRL_COMBINE_ARRIVE and the flags are not touched (they stay tail-clean for a later
    CombineSend, which always publishes the current epoch).
    """

    def __init__(self, hidden: int, topk: int, max_tokens: int, threads: int = EP_THREADS):
        self.H, self.K, self.T_max = hidden, topk, max_tokens
        self.threads = threads
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mY: cute.Tensor, mPos: cute.Tensor, mRecvCount: cute.Tensor, mErr: cute.Tensor,
                 mOut: cute.Tensor, num_tokens: Int32, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mY, mPos, mRecvCount, mErr, mOut, num_tokens).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mPos: cute.Tensor, mRecvCount: cute.Tensor, mErr: cute.Tensor,
               mOut: cute.Tensor, num_tokens: Int32):
        wait_previous_grid()
        K = self.K
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        y_addr = _addr(mY)
        out_addr = _addr(mOut)
        n_y = mY.shape[0]
        n = cutlass.min(cutlass.min(num_tokens, mRecvCount[0]), Int32(self.T_max))

        if mErr[ERR_CODE] == Int32(0):
            accs = [cute.make_rmem_tensor((_BF16_PER_VEC,), Float32)
                    for _ in range(self.plan.unroll)]
            for t in cutlass.range(gwarp, n, nwarps):
                p_lane = Int32(-1)
                if lane < K:
                    p_lane = mPos[t, lane]
                ok_lane = (p_lane >= Int32(0)) & (p_lane < n_y)
                any_mask = cute.arch.vote_ballot_sync(ok_lane)
                dst_row = out_addr + Int64(t) * self.plan.row_bytes
                for c in cutlass.range_constexpr(self.plan.chunks):
                    slots = self.plan.slots(c)
                    for j in cutlass.range_constexpr(len(slots)):
                        accs[j].fill(0.0)
                    for k in cutlass.range_constexpr(K):
                        p = cute.arch.shuffle_sync(p_lane, k)
                        if ((any_mask >> k) & 1) != 0:
                            row = y_addr + Int64(p) * self.plan.row_bytes
                            self.plan.add_chunk(accs, slots, row, lane)
                    self.plan.store_sum(accs, slots, dst_row, lane)  # zeros when no choice is valid


# =============================================================================================
# 5. CombineReduce
# =============================================================================================


class CombineReduce:
    """Source side of combine: wait for all destinations, then sum their partial rows.

    Static: hidden H, top-K, world W, T_max, num_experts E, threads per CTA.

    Arguments of ``__call__``:
        mDestMask  [T_max]      int32 per token, the destination ranks EpDispatch sent it to
        mComb      [W*T_max, H] bf16 this rank's comb buffer
        mFlags     [2*W]        int64 this rank's flags (flags[W + d] = combine epoch from d)
        mCtrl      [4]          int64 local control word (ctrl[0] = current epoch)
        mErr       [4]          int32 local error word; no-op if err[0] != 0 on entry
        mOut       [T_rows, H]  bf16 output, rows < num_tokens written
        num_tokens Int32        T (clamped to T_max)
        timeout_ns Int64        wall-clock bound of the wait
        num_ctas   Int32, stream CUstream

    Every CTA: warp 0 lane d < W acquire-spins (ld.acquire.sys) on flags[W + d] == ctrl[0];
    on timeout err = (1, d, WHERE_COMBINE_REDUCE, epoch) and the CTA exits. Then
    out[t] = sum over the ranks d = 0..W-1 in mDestMask[t] of comb[d*T_max + t], fp32 in rank
    order -> bf16 (zero row if the token has no valid choice).
    """

    def __init__(self, hidden: int, topk: int, world: int, max_tokens: int, num_experts: int,
                 threads: int = EP_THREADS):
        assert num_experts % world == 0
        self.H, self.K, self.W, self.T_max, self.E = hidden, topk, world, max_tokens, num_experts
        self.E_l = num_experts // world
        self.threads = threads
        self.plan = _RowPlan(hidden)

    @cute.jit
    def __call__(self, mDestMask: cute.Tensor, mComb: cute.Tensor, mFlags: cute.Tensor,
                 mCtrl: cute.Tensor, mErr: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32,
                 timeout_ns: Int64, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(mDestMask, mComb, mFlags, mCtrl, mErr, mOut, num_tokens, timeout_ns).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel(self, mDestMask: cute.Tensor, mComb: cute.Tensor, mFlags: cute.Tensor,
               mCtrl: cute.Tensor, mErr: cute.Tensor, mOut: cute.Tensor, num_tokens: Int32,
               timeout_ns: Int64):
        wait_previous_grid(trigger=False)  # spins on other ranks' flags: no early trigger
        W, T_max = self.W, self.T_max
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        warps_per_cta = self.threads // 32
        gwarp = bidx * warps_per_cta + warp
        nwarps = gdim * warps_per_cta

        err_addr = _addr(mErr)
        comb_addr = _addr(mComb)
        out_addr = _addr(mOut)

        if mErr[ERR_CODE] == Int32(0):
            epoch = mCtrl[CTRL_EPOCH]
            if tidx < W:
                state = _spin_wait_eq(_addr(mFlags) + Int64(W + tidx) * 8, epoch, timeout_ns)
                if state == Int32(2):
                    _report_error(err_addr, Int32(ERR_TIMEOUT), tidx,
                                  Int32(WHERE_COMBINE_REDUCE), Int32(epoch))
            cute.arch.sync_threads()
            if _ld_i32_relaxed_gpu(err_addr) == Int32(0):
                T = cutlass.min(num_tokens, Int32(T_max))
                accs = [cute.make_rmem_tensor((_BF16_PER_VEC,), Float32)
                        for _ in range(self.plan.unroll)]
                for t in cutlass.range(gwarp, T, nwarps):
                    mask = mDestMask[t]
                    out_row = out_addr + Int64(t) * self.plan.row_bytes
                    for c in cutlass.range_constexpr(self.plan.chunks):
                        slots = self.plan.slots(c)
                        for j in cutlass.range_constexpr(len(slots)):
                            accs[j].fill(0.0)
                        for d in cutlass.range_constexpr(W):
                            if ((mask >> d) & 1) != 0:
                                row = comb_addr + (Int64(d) * T_max + Int64(t)) * self.plan.row_bytes
                                self.plan.add_chunk(accs, slots, row, lane)
                        self.plan.store_sum(accs, slots, out_row, lane)
