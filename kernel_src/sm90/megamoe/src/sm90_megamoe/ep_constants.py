"""ABI constants of the sm90_megamoe expert-parallel (EP) communication kernels.

The host integration mirrors these values. Bump ``EP_ABI_VERSION`` whenever the argument list,
buffer layouts, peer-table rows, control-word layout or flag protocol of an EP kernel changes.
"""

EP_ABI_VERSION = 2  # 2: value-checking dispatch (verr word, destination mask), combine by mask

# ---------------------------------------------------------------------------------------------
# Peer address table: int64 tensor [EP_NUM_PEER_BUFS, W], row = buffer kind, column = rank.
# Entry [b, r] is the device address (as seen from THIS rank) of rank r's symmetric buffer b;
# column my_rank is this rank's own buffer. For NVSHMEM buffers the host fills it with
# ``nvshmem.core.get_peer_tensor(buf, r).data_ptr()``; for virtual ranks on one GPU with the
# other virtual ranks' ``tensor.data_ptr()``.
# ---------------------------------------------------------------------------------------------
PEER_RECV_X = 0      # recv_x     [W*T_max, H] bf16
PEER_RECV_IDS = 1    # recv_ids   [W*T_max, K] int32
PEER_RECV_W = 2      # recv_w     [W*T_max, K] float32
PEER_RECV_COUNT = 3  # recv_count [W]          int32
PEER_FLAGS = 4       # flags      [2*W]        int64
PEER_COMB = 5        # comb       [W*T_max, H] bf16
EP_NUM_PEER_BUFS = 6

# Symmetric buffer alignment: every buffer base must be 16-byte aligned (torch / NVSHMEM
# allocations are). Rows of recv_x/comb are H*2 bytes, so H % 8 == 0 keeps every row 16-byte
# aligned for the 16-byte vector loads/stores.
EP_ALIGN_H_ELEMS = 8

# ---------------------------------------------------------------------------------------------
# Local control word: int64 tensor [EP_CTRL_LEN] per rank (NOT symmetric, never read by peers).
# Zero it once at allocation; the kernels keep it tail-clean afterwards.
# ---------------------------------------------------------------------------------------------
CTRL_EPOCH = 0             # forward counter; EpDispatch's last CTA stores epoch+1 here
CTRL_DISPATCH_ARRIVE = 1   # EpDispatch CTA-arrival counter; the last CTA resets it to 0
CTRL_COMBINE_ARRIVE = 2    # CombineSend CTA-arrival counter; the last CTA resets it to 0
EP_CTRL_LEN = 4            # [3] reserved

# Flags (symmetric, int64 [2*W]): flags[s]     = epoch of the last dispatch from source s,
#                                 flags[W + d] = epoch of the last combine from destination d.
FLAG_DISPATCH_BASE = 0
FLAG_COMBINE_BASE_PER_W = 1  # combine flags start at W * FLAG_COMBINE_BASE_PER_W

# ---------------------------------------------------------------------------------------------
# Local error word: int32 tensor [EP_ERR_LEN] per rank. Zero at allocation. First error wins
# (atomic CAS on err[ERR_CODE]); every EP kernel becomes a no-op while err[ERR_CODE] != 0, so
# an error is sticky until the host resets the EP state of ALL ranks (see ep_launch.EpRank.reset).
# ---------------------------------------------------------------------------------------------
ERR_CODE = 0    # ERR_NONE / ERR_TIMEOUT / ERR_CAPACITY
ERR_PEER = 1    # timeout: rank waited for;  capacity: this rank
ERR_WHERE = 2   # WHERE_* of the kernel that set the error
ERR_AUX = 3     # timeout: expected epoch (low 32 bits);  capacity: offending T
EP_ERR_LEN = 4

ERR_NONE = 0
ERR_TIMEOUT = 1
ERR_CAPACITY = 2

WHERE_DISPATCH = 1
WHERE_WAIT = 2
WHERE_COMBINE_SEND = 3
WHERE_COMBINE_REDUCE = 4

# ---------------------------------------------------------------------------------------------
# Local input-value error record: int64 tensor [EP_VERR_LEN] per rank. EpDispatch checks every
# (token, k) choice: an expert id outside [0, E) or a non-finite router weight is DROPPED (routed
# nowhere, never wrapped) and recorded here -- unlike err, this never stops a kernel. Per kind,
# the record holds the FIRST offender: the earliest forward (epoch) with one, and in it the
# smallest key t*K + k (atomic min), plus the offending value (filled by the last CTA).
# Reset value: VERR_RESET. The host reads it when it chooses to (a sync) and resets it.
# ---------------------------------------------------------------------------------------------
VERR_ID_EPOCH = 0    # epoch of the first forward with a bad expert id (0 = none)
VERR_ID_KEY = 1      # min t*K + k in that forward (VERR_NO_KEY = none)
VERR_ID_VALUE = 2    # the id (int64)
VERR_W_EPOCH = 3     # same for non-finite router weights
VERR_W_KEY = 4
VERR_W_VALUE = 5     # the weight's float32 bits (low 32 bits)
EP_VERR_LEN = 8      # [6], [7] reserved
VERR_NO_KEY = 2**63 - 1
VERR_RESET = (0, VERR_NO_KEY, 0, 0, VERR_NO_KEY, 0, 0, 0)

# ---------------------------------------------------------------------------------------------
# Local destination mask: int32 tensor [T_max] per rank. EpDispatch stores, per token t, the
# bit set of destination ranks that received it (after dropping invalid choices); CombineReduce
# sums exactly those ranks' partial rows. Written before read in every forward: no reset.
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Launch shape.
# ---------------------------------------------------------------------------------------------
EP_THREADS = 256            # threads per CTA of the row kernels (8 warps, one row per warp)
EP_WAIT_THREADS = 32        # EpWait: one warp, lane d waits for rank d
EP_MAX_WORLD = 32           # destination masks are 32-bit
EP_MAX_TOPK = 32            # lane k holds choice k
EP_VEC_BYTES = 16           # one vector access = 16 bytes = 8 bf16
EP_UNROLL = 8               # 16-byte vectors in flight per lane (128 B/lane, 4 KiB/warp)
F32_EXP_MASK = 0x7F800000   # a float32 is non-finite iff all exponent bits are set

DEFAULT_TIMEOUT_NS = 5_000_000_000  # 5 s wall clock (%globaltimer) before a wait gives up
