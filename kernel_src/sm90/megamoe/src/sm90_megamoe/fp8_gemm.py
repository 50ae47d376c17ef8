"""FP8 block-scaled varlen-M grouped GEMM for MoE experts on SM90 (DeepSeek-V3 / Qwen3-FP8 format).

Requirements (checked by :func:`can_implement`, which returns a reason string or None)
-----------------------------------------------------------------------------------
* activation in ("identity", "swiglu")
* K % 128 == 0 (one activation scale and one weight scale per 128-wide k-tile), K >= 128
* N % 128 == 0 (whole 128-row weight-scale blocks); swiglu: N = 2 * I with I % 128 == 0
* tile_n in (64, 128); swiglu: tile_n == 64 (gate + up accumulators, each with a partial
  accumulator for the promotion: 4 x 32 fp32 registers per thread; tile_n = 128 would need 256)
* E <= MAX_EXPERTS; all tensors contiguous, base pointers 16-byte aligned (scales 4-byte)

Semantics, for every expert ``e`` with rows ``[offsets[e], offsets[e+1])``::

    H[m, n] = sum_kb a_scale[m, kb] * w_scale[e, n // 128, kb] * sum_{k in kb} A[m, k] * B[e, n, k]
    identity  C[m, :]   = H[m, :]              (* row_scale[m] when scale_rows)
    swiglu    C[m, :I]  = silu(H[m, :I]) * H[m, I:]   (* row_scale[m])

FP8 (e4m3) in, FP32 accumulate, BF16 out.

Tensors (torch view; contiguous)
--------------------------------
    mA        [M_total, K]            float8_e4m3fn  rows grouped by expert, M_total dynamic
                                                     (A and B may be given as uint8 views)
    mAScale   [M_total, K / 128]      float32        one scale per 128 consecutive K of a row
    mB        [E, N, K]               float8_e4m3fn  per-expert weight (swiglu: gate rows first)
    mBScale   [E, N / 128, K / 128]   float32        one scale per 128 x 128 block
    mC        [M_total, N_out]        bfloat16       N_out = N (identity) or N / 2 (swiglu)
    mOffsets  [E + 1]                 int32          device memory
    mRowScale [M_total]               float32        read only when scale_rows (else any fp32)

Design (differences from :mod:`.grouped_gemm`, whose scheduler and smem epilogue are inherited)
-----------------------------------------------------------------------------------------------
* tile 128 x tile_n x 128: a k-tile is exactly one scale block along K, so each k-tile needs one
  A scale per accumulator row and one B scale per accumulator (tile_n <= 128 lies inside one
  128-row weight block; gated: gate rows ``[n0, n0+bn)`` and up rows ``[I+n0, I+n0+bn)`` are
  two blocks with their own scales).
* FP8 WGMMA (``wgmma.mma_async.sync.aligned.m64n{tile_n}k32.f32.e4m3.e4m3``: m64n128k32 for
  identity, m64n64k32 for swiglu; K-major A and B from 128-byte-swizzled smem), four
  instructions per k-tile and accumulator, into a fresh partial accumulator (scale-d = 0 on the
  first). After ``wgmma.wait_group 0`` the stage is released to the producer and the consumer
  promotes in registers (DeepGEMM style): ``main += partial * (a_scale[row, kt] * b_scale)``.
  The WGMMA's own fp32 accumulation over 128 K values is short enough that the tensor core's
  reduced-precision accumulation of FP8 products does not build up over K.
* Scales are read by the consumer threads from global memory (L2): a thread's 64-row half of the
  WGMMA accumulator covers 2 rows (``r`` and ``r + 8``), so 2 A-scale loads and 1 (gated: 2)
  broadcast B-scale load per k-tile, issued right after the WGMMAs so their latency hides
  behind the tensor-core work. Row indices are clamped to the expert's last row (rows of the
  next expert inside the tile are computed with some scale and never stored).
* Both consumer warpgroups (cooperative, 64 rows each) wait for their own WGMMAs every k-tile;
  while one promotes the other's WGMMAs keep the tensor core busy.
* ``overlap_promotion=True`` (drop v13; bit-identical on the H200): two sets of partial accumulators;
  the WGMMAs of k-tile t go into set t % 2 and are committed *before* the consumer waits for
  k-tile t-1 (``wgmma.wait_group 1``), releases its stage and promotes it, so each warpgroup's
  tensor-core work of t overlaps its own promotion of t-1. The k-loop is unrolled completely
  (K <= ``OVERLAP_MAX_K_TILES`` * 128): a group in flight across a loop back-edge makes the
  compiler copy its accumulators there and ptxas then serialises every WGMMA (warning C7514);
  unrolled, ptxas keeps them asynchronous (0 spills). Empty volatile asm "fences" pin each
  partial set after the ``wgmma.wait_group`` that completes it. The promotion order per
  accumulator is unchanged (t = 0, 1, 2, ...), so the results are bit-identical to the default.
  Beyond OVERLAP_MAX_K_TILES (drop v26) the k-loop runs in chunks of :func:`overlap_chunk`
  k-tiles (an even divisor of K/128, <= 16): each chunk is the same unrolled schedule, drained
  (``wait_group 0``) at its end, so no group crosses the chunk loop's back-edge and one chunk's
  code is traced (Mixtral FC2, K 14336: chunks of 16, a 54 KB cubin, no C7514, 0 spills).
* ``wide_gated=True`` (drop v21; swiglu; bit-identical on the H200, FC1 1.12-1.15x): the gate and up tiles of a stage
  sit in adjacent smem slots, which are the bytes of one 128-row tile, so one m64n128k32 WGMMA
  per k-block fills one accumulator (gate columns, then up) instead of two m64n64k32 WGMMAs
  filling two; promotion picks the gate or up block's scale by column.
* ``cluster_n=2`` (drop v28; the plain kernel, an even number of n-tiles): clusters of 2 CTAs.
  One unit of the persistent schedule is an m-tile's two adjacent n-tiles; CTA r of the cluster
  computes n-tile ``2 * unit_n + r`` and loads rows ``[64 r, 64 r + 64)`` of the shared A tile by a
  multicast TMA into both CTAs' stage, so each CTA reads half of A from L2. The empty barrier of
  a stage counts the consumer warps of both CTAs (either producer writes into both). The launch
  clamps its grid to the clusters that fit at once. Same WGMMAs and promotion order per tile:
  the same bits as single CTAs.
* ``cluster_n=4`` (drop v49; N_out / tile_n a multiple of 4): the same with 4 CTAs -- a unit is an
  m-tile's four adjacent n-tiles, CTA r loads rows ``[32 r, 32 r + 32)`` of A into all four, so each
  CTA reads a quarter of A from L2 (per k-tile A 4 KB + B 16 KB instead of 8 + 16); a stage's empty
  barrier counts the consumer warps of all four CTAs (lanes 0-3 of each warp arrive on CTAs 0-3).
  Fewer SMs may be used: the 4 CTAs of a cluster share a GPC (the grid is clamped as above).
* ``smem_scales=True`` (drop v34; the TMA producer, not ``gather_a``): the producer warp stages each
  k-tile's scales in shared memory beside its operands -- lane l loads the A scales of tile rows
  l + 32 j (clamped as above) and lanes 0 / 1 the gate / up weight block's scale, *before* waiting
  for a free stage (their L2 latency hides behind that wait), stores them into the stage's slot of
  ``SCALE_SLOT`` floats, then a warp barrier and the elected ``arrive.expect_tx`` arm the stage, so
  the consumers, whose wait on the stage acquires that arrive, read their scales from shared memory
  instead of stalling on global loads after the k-tile's WGMMAs. Same values, same promotion: the
  same bits. Without it, every other variant's PTX is byte-identical to drop v33's.
* ``scale_warp=True`` (drop v35; with ``smem_scales``): producer warp 1 stages the scales instead
  (:meth:`_scale_producer`: the TMA warp's units, halves and k-tiles, so the same stages) and each
  stage's full barrier counts two arrivals, the TMA warp's ``arrive.expect_tx`` and the scale
  warp's elected arrive; the TMA warp's loop is the global-scale kernel's again. Why: on the H200
  v34's staged scales slowed the plain schedule down (0.83-0.93x), plausibly because the TMA warp
  stores a stage's scales -- waiting for their loads -- before it may issue the stage's copies.
* ``scale_lookahead=D`` (drop v65; with ``scale_warp``; D in 1 ... MAX_SCALE_LOOKAHEAD, 1 = v35):
  the scale warp keeps the loads of the next D k-tiles' scales in flight
  (:meth:`_scale_producer_ahead`) instead of one. Why: v35's warp issues a k-tile's loads only after
  it has stored the one before, so it stages at most one k-tile per L2 round trip (~600-1000
  cycles under load), while the tensor cores finish a 128 x 128 x 128 FP8 k-tile in ~512: the scale
  warp, not the operands, can set the pace. With D loads in flight it stages D per round trip. The
  k-loop steps by the largest divisor of K/128 up to D (the slots are registers named at trace time);
  the loads past a unit's last k-tile are clamped to it (read, never stored). Same values: the same bits.
* ``unit_scales=True`` (drop v69; the overlapped schedule, not with ``smem_scales``, K/128 and the
  chunked schedule's chunk multiples of UNIT_SCALE_KC = 8): the TMA warp loads the scales of 8
  k-tiles per copy -- a 128-row x 8 box of ``mAScale`` and an 8-wide box of ``mBScale`` per weight
  block -- into one of two shared-memory buffers with their own full / empty barriers, and the
  consumers read each k-tile's scales from there (:mod:`.unit_scales`; kernel entry
  ``kernel_unit_scales``). Why: the consumers' global scale loads and the staged scales of v34 / v35
  cost Mixtral's GEMMs 4-6% at the 700 W cap. Same values, same promotion: the same bits.
* ``deferred_epilogue=True`` (drop v48; the unrolled overlapped schedule, K <= OVERLAP_MAX_K_TILES *
  128, the plain bf16 output): a unit's epilogue (activation, row scale, staged bf16 stores) runs
  after the *next* unit's first k-tile has been issued, so the tensor cores work on that k-tile
  while both consumer warpgroups store the previous tile. Why: a cooperative persistent tile
  leaves the tensor pipe idle for its whole epilogue, which is a large share of a short k-loop
  (Qwen3 FC2: 6 k-tiles per tile). No WGMMA group crosses the unit loop's back-edge (only the
  finished sums in ``accs`` wait there, as ordinary registers), so ptxas keeps the WGMMAs
  asynchronous. The first unit stores nothing (its "previous" tile has 0 rows); after the loop
  the last unit's tile is stored. Same sums, same order: the same bits.
* ``chunk_k_tiles=C`` (drop v82; the overlapped schedule, C even, <= OVERLAP_MAX_CHUNK): the k-loop
  runs chunked (as beyond OVERLAP_MAX_K_TILES) whenever it is longer than C, in chunks of the
  largest even divisor of K/128 up to C. Why: unrolled, Qwen3's FC1 (16 k-tiles) is 3152 SASS
  instructions and Mixtral's (32) 4096, most of them the per-tile k-loop, which streams through the
  instruction cache every tile; in chunks of 8 they are 2072 / 2032 (local ptxas, no C7514, no
  spills), at the cost of one more drain per chunk. Same sums, same order: the same bits. Not with
  ``deferred_epilogue`` (it needs the unrolled loop).
* :class:`Fp8SwigluFusedQuantGroupedGemmSm90` (``fused_quant``; clusters of 2, the wide gated FC1):
  FC1 whose output is FC2's e4m3 input, quantised by otherwise idle producer warps. The two CTAs
  of a cluster compute the two 64-column halves of one 128-column group, and CTA r quantises the
  unit's rows ``[64 r, 64 r + 64)`` -- the rows of consumer warpgroup r in both CTAs. Each CTA
  stages its bf16 values in its epilogue tile ``sC`` (what the plain kernel would store); after
  the warpgroups' barrier, warpgroup r of CTA r arms its own CTA's "full" barrier for the peer's
  bytes (``arrive.expect_tx``) and the other warpgroup sends its 64 staged rows to the peer's
  receive tile with one bulk copy (``cp.async.bulk.shared::cluster``, complete_tx on the peer's
  "full"). The quantising warps (1-3; 2-3 with ``scale_warp``) wait on "full", read columns of
  their CTA's half from ``sC`` and the peer's half from the receive tile -- local shared memory
  both --, apply :mod:`.fp8_quant`'s rule (amax, ``amax / 448``, its division: the same bits),
  write e4m3 rows and scales, then arrive on both CTAs' "read" barrier, which the consumers wait
  on before staging their next unit (they run that unit's k-loop meanwhile). Every hand-off is a
  CTA-scope mbarrier operation or the copy's own transaction count, as in the TMA pipeline: no
  memory fence. No bf16 row is written: FC2's quantiser, its launch and ``h``'s write and read
  back disappear. A cluster barrier ends the kernel (no CTA exits while its peer may still copy
  into its shared memory or arrive on its barriers).
  History on the H200: drop v37 stored ``h`` and read it back from L2 behind a gpu-scope fence per
  unit (FP8 layer 0.73x on Qwen3, 0.92x on Mixtral); drop v38 read the peer's ``sC`` over
  distributed shared memory behind cluster-scope release / acquire barriers, which ptxas emits as
  ``MEMBAR.ALL.GPU`` before each arrive (FC1 0.81x / 0.88x of FC1 + the quantiser in the drop
  runner; 0.85x / 0.95x with the fences dropped, as a test only), and its two quantising warps'
  16 dependent remote loads per unit sat on Qwen3's critical path.
* :class:`Fp8SwigluRequantGroupedGemmSm90` (drop v21; the bits of FC1 + the quantiser on the H200): FC1 writing FC2's
  e4m3 input and per-128 scales in the epilogue (its docstring). Both variants trace the same
  ``_body`` as the plain kernel, whose PTX is unchanged by them.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from .fp8_quant import FAST_DIV_MAX_SCALE, FAST_DIV_MIN_SCALE, _div_rn, _divide_by_scale
from .gather_producer import stage_producers
from .pdl import PDL, wait_previous_grid
from .constants import MAX_EXPERTS
from .grouped_gemm import GroupedGemmSm90, get_smem_capacity_in_bytes, silu
from .unit_scales import UNIT_SCALE_BUF, UNIT_SCALE_BUFS, UNIT_SCALE_KC, UnitScales, unit_scales_reason

FP8_BLOCK = 128
#: k-tiles up to which ``overlap_promotion`` unrolls the whole k-loop (a WGMMA group still in flight
#: must not cross a loop back-edge, or ptxas serialises every WGMMA, C7514); beyond it (drop v25)
#: the k-loop runs in chunks of :func:`overlap_chunk` k-tiles, each unrolled and drained at its end
OVERLAP_MAX_K_TILES = 32
#: the largest chunk of the chunked overlapped schedule (code size: one chunk is traced)
OVERLAP_MAX_CHUNK = 16
#: the producer warps that quantise (``fused_quant``): warp 0 issues TMA; warp 1 scans the schedule
#: before the k-loops and then quantises too, unless it stages scales (``scale_warp``)
QUANT_WARPS = (1, 2, 3)
QUANT_WARPS_SCALE_WARP = (2, 3)
#: rows of a unit each CTA quantises (``fused_quant``): one consumer warpgroup's
QUANT_ROWS = 64
#: float32 slots per stage of ``smem_scales`` (drop v34): the tile's 128 A-row scales, then the
#: B scale of each weight block (gate, up), padded to a multiple of 4 (16-byte aligned slots)
SCALE_SLOT = 132
#: the most k-tiles of scale loads the scale warp keeps in flight (``scale_lookahead``, drop v65): its
#: registers (the producer warpgroup runs on ``load_regs`` = 40 per thread) hold 5 floats per k-tile
MAX_SCALE_LOOKAHEAD = 4


def overlap_chunk(k_tiles: int, halves: int = 1, limit: int = 0) -> int:
    """k-tiles per chunk of the overlapped schedule for a k-loop of ``k_tiles`` traced ``halves``
    times per tile (the requantising FC1 runs one per 64-column half): 0 when all of them unroll
    (``k_tiles * halves`` <= OVERLAP_MAX_K_TILES), else the largest even divisor <= OVERLAP_MAX_CHUNK
    (0 if none: an odd k_tiles cannot run chunked, and unrolls whole as before). Drop v33: the
    requantising FC1 of Mixtral (K 4096, 2 x 32 k-tiles) unrolled 256 WGMMAs into a 184 KB cubin,
    twice the plain FC1's; chunked, each half traces 16 k-tiles. ``limit`` (drop v82,
    ``chunk_k_tiles``): chunks of at most ``limit`` k-tiles whenever the loop is longer, in place of
    both bounds."""
    unrolled, largest = (limit, limit) if limit else (OVERLAP_MAX_K_TILES, OVERLAP_MAX_CHUNK)
    if k_tiles * halves <= unrolled:
        return 0
    return next((c for c in range(largest - largest % 2, 1, -2) if k_tiles % c == 0), 0)


@dsl_user_op
def _pin(v, *, loc=None, ip=None):
    """``v`` through an empty volatile asm that reads and writes it: the value is tied to this
    program point, so the compiler cannot move reads of a WGMMA accumulator above the
    ``wgmma.wait_group`` that completes it (CUTLASS's ``warpgroup_fence_operand``)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _bulk_copy_to_peer(dst, src, nbytes, mbar, peer, *, loc=None, ip=None):
    """``nbytes`` (a multiple of 16) from this CTA's shared memory at ``src`` to the same offset as
    ``dst`` in CTA ``peer`` of the cluster, completing ``nbytes`` of transactions on the peer's
    mbarrier at ``mbar``'s offset (all shared::cta addresses, 16-byte aligned; ``mapa`` turns
    ``dst`` and ``mbar`` into the peer's). One thread issues it; the async proxy reads ``src``."""
    args = [cutlass.Int32(v).ir_value(loc=loc, ip=ip) for v in (dst, src, nbytes, mbar, peer)]
    llvm.inline_asm(
        None, args,
        "{\n.reg .b32 d, m;\nmapa.shared::cluster.u32 d, $0, $4;\nmapa.shared::cluster.u32 m, $3, $4;\n"
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [d], [$1], $2, [m];\n}",
        "r,r,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _store_to_peer(dst, value, mbar, peer, *, loc=None, ip=None):
    """``value`` (float32) into CTA ``peer`` of the cluster at ``dst``'s offset, completing 4 bytes of
    transactions on the peer's mbarrier at ``mbar``'s offset (``st.async``; shared::cta addresses,
    ``mapa`` turns them into the peer's). No fence: the peer reads it after that barrier's phase."""
    args = [cutlass.Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Float32(value).ir_value(loc=loc, ip=ip),
            cutlass.Int32(mbar).ir_value(loc=loc, ip=ip), cutlass.Int32(peer).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(
        None, args,
        "{\n.reg .b32 d, m;\nmapa.shared::cluster.u32 d, $0, $3;\nmapa.shared::cluster.u32 m, $2, $3;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [d], $1, [m];\n}",
        "r,f,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _fence_operand(frag, n: int) -> None:
    """:func:`_pin` every element of a register fragment of ``n`` elements."""
    for i in range(n):
        frag[i] = _pin(frag[i])
FP8_ACTIVATIONS = ("identity", "swiglu")
E4M3_MAX = 448.0
#: byte pitch of a row of the requantising epilogue's e4m3 staging tile (128 values + 16 bytes of
#: padding; 144 = 9 x 16, so rows stay 16-byte aligned and a warp's 8 rows hit distinct banks)
QPITCH = FP8_BLOCK + 16
#: the same for ``pair_amax``'s 64-value rows (80 = 5 x 16)
PAIR_QPITCH = FP8_BLOCK // 2 + 16


def default_tile_n(activation: str) -> int:
    return 64 if activation == "swiglu" else 128


def can_implement(activation: str, n: int, k: int, num_experts: int,
                  tile_n: Optional[int] = None) -> Optional[str]:
    """None if the kernel supports (activation, N, K, E, tile_n), else the reason."""
    if activation not in FP8_ACTIVATIONS:
        return f"activation must be one of {FP8_ACTIVATIONS}, got {activation!r}"
    if tile_n is None:
        tile_n = default_tile_n(activation)
    if tile_n not in (64, 128):
        return f"tile_n must be 64 or 128, got {tile_n}"
    if activation == "swiglu" and tile_n != 64:
        return "swiglu needs tile_n == 64 (gate + up + two partial accumulators in registers)"
    if k <= 0 or k % FP8_BLOCK != 0:
        return f"K={k} must be a positive multiple of {FP8_BLOCK}"
    if n <= 0 or n % FP8_BLOCK != 0:
        return f"N={n} must be a positive multiple of {FP8_BLOCK}"
    if activation == "swiglu" and (n // 2) % FP8_BLOCK != 0:
        return f"swiglu needs I = N/2 = {n // 2} to be a multiple of {FP8_BLOCK}"
    if not (1 <= num_experts <= MAX_EXPERTS):
        return f"num_experts={num_experts} must be in [1, {MAX_EXPERTS}]"
    return None


class Fp8BlockScaledGroupedGemmSm90(GroupedGemmSm90, UnitScales):
    """FP8 block-scaled varlen-M grouped GEMM (see the module docstring).

    :param activation: "identity" or "swiglu" (compile time).
    :param scale_rows: multiply output row m by row_scale[m] after the activation.
    :param tile_n: output columns per tile; None = 128 (identity) / 64 (swiglu).
    :param num_stages: smem pipeline depth; None = as many as fit (at most 8).
    :param raster_m: m-tiles per raster group inside an expert (as in :class:`GroupedGemmSm90`).
    :param chunk_k_tiles: drop v82: the overlapped k-loop in chunks of at most this many k-tiles
        (0: unrolled up to OVERLAP_MAX_K_TILES; see the module docstring).

    Only :meth:`_locate` and :meth:`_epilogue` are inherited; they read ``tile_m``, ``tile_n``,
    ``n_tiles``, ``raster_m``, ``n_out``, ``n_out_divisible``, ``c_dtype``, ``epi_n``,
    ``epi_pad``, ``tile_threads``, which this class sets itself.
    """

    #: the requantising variant (:class:`Fp8SwigluRequantGroupedGemmSm90`) sets these
    requant = False
    halves = 1
    #: drop v37 (:class:`Fp8SwigluFusedQuantGroupedGemmSm90`): FC2's e4m3 input written too
    fused_quant = False
    #: drop v66 (``Fp8SwigluFusedQuantGroupedGemmSm90(pair_amax=True)``): the consumers quantise their
    #: own 64 columns in the epilogue; the two CTAs swap only each row's |max| (512 bytes per unit)
    pair_amax = False
    gather_a = False  # drop v22: A rows gathered by index (:class:`.fp8_gather.Fp8GatherGroupedGemmSm90`)
    gather_tma = False  # drop v41: ... by one TMA load per row (``Fp8GatherGroupedGemmSm90(tma_rows=True)``)

    def __init__(self, activation: str, scale_rows: bool = False, tile_n: Optional[int] = None,
                 num_stages: Optional[int] = None, raster_m: int = 1, overlap_promotion: bool = False,
                 wide_gated: bool = False, cluster_n: int = 1, smem_scales: bool = False,
                 scale_warp: bool = False, deferred_epilogue: bool = False, tanh_sigmoid: bool = False,
                 scale_lookahead: int = 1, unit_scales: bool = False, chunk_k_tiles: int = 0):
        if tile_n is None:
            tile_n = default_tile_n(activation)
        reason = can_implement(activation, 2 * FP8_BLOCK, FP8_BLOCK, 1, tile_n)
        if reason is not None:
            raise ValueError(reason)
        self.activation = activation
        self.gated = activation == "swiglu"
        self.scale_rows = bool(scale_rows)
        self.has_bias = False
        self.raster_m = int(raster_m)
        self.overlap_promotion = bool(overlap_promotion)
        if wide_gated and activation != "swiglu":
            raise ValueError("wide_gated needs a gated activation (swiglu)")
        self.wide_gated = bool(wide_gated)
        if cluster_n not in (1, 2, 4):
            raise ValueError(f"cluster_n must be 1, 2 or 4, got {cluster_n}")
        if cluster_n > 1 and (self.requant or self.gather_a):
            raise ValueError("cluster_n > 1 is for the plain TMA kernel (not requant, not gather_a)")
        # drop v28: 2 CTAs of a cluster take the two n-tiles of one m-tile and multicast A's halves;
        # drop v49: 4 CTAs, 4 adjacent n-tiles, each loads a quarter of A's rows into all four
        self.cluster_n = int(cluster_n)
        if smem_scales and self.gather_a:
            raise ValueError("smem_scales is for the TMA producer (not gather_a)")
        # drop v34: the producer warp stages each k-tile's scales in shared memory with its operands
        self.smem_scales = bool(smem_scales)
        if scale_warp and not smem_scales:
            raise ValueError("scale_warp needs smem_scales")
        # drop v35: a second producer warp stages them instead, so the TMA warp never waits on them
        self.scale_warp = bool(scale_warp)
        if not (1 <= int(scale_lookahead) <= MAX_SCALE_LOOKAHEAD):
            raise ValueError(f"scale_lookahead must be in 1 ... {MAX_SCALE_LOOKAHEAD}, got {scale_lookahead}")
        if scale_lookahead > 1 and not scale_warp:
            raise ValueError("scale_lookahead > 1 needs scale_warp (the scale warp keeps the loads in flight)")
        # drop v65: the scale warp keeps the next scale_lookahead k-tiles' scale loads in flight
        self.scale_lookahead = int(scale_lookahead)
        if unit_scales and (smem_scales or not overlap_promotion or self.requant or self.fused_quant
                            or self.gather_a):
            raise ValueError("unit_scales is a way of loading the scales of the plain overlapped kernel: it needs "
                             "overlap_promotion and refuses smem_scales, requant, fused_quant and gather_a")
        # drop v69: the TMA warp loads the scales of UNIT_SCALE_KC k-tiles per copy (:mod:`.unit_scales`)
        self.unit_scales = bool(unit_scales)
        if deferred_epilogue and not (self.overlap_promotion and not self.requant and not self.fused_quant):
            raise ValueError("deferred_epilogue needs overlap_promotion and the plain bf16 epilogue "
                             "(not requant, not fused_quant)")
        # drop v48: a unit's epilogue runs while the next unit's first k-tile is on the tensor cores
        self.deferred_epilogue = bool(deferred_epilogue)
        if chunk_k_tiles and not (overlap_promotion and chunk_k_tiles % 2 == 0
                                  and 2 <= chunk_k_tiles <= OVERLAP_MAX_CHUNK):
            raise ValueError(f"chunk_k_tiles must be 0 or an even number of k-tiles in 2 ... {OVERLAP_MAX_CHUNK}, "
                             f"with overlap_promotion; got {chunk_k_tiles}")
        # drop v82: the overlapped k-loop in chunks of at most chunk_k_tiles (0: the default rule,
        # whole up to OVERLAP_MAX_K_TILES): less code per tile, one more drain per chunk
        self.chunk_k_tiles = int(chunk_k_tiles)
        if tanh_sigmoid and activation != "swiglu":
            raise ValueError("tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu'")
        # drop v50: sigmoid(g) = 0.5 + 0.5 tanh(g / 2), one MUFU op per output instead of two
        self.tanh_sigmoid = bool(tanh_sigmoid)
        if self.fused_quant and not (self.gated and self.wide_gated and self.cluster_n == 2 and not self.requant):
            raise ValueError("fused_quant needs swiglu, wide_gated and cluster_n = 2 (a cluster's two n-tiles "
                             "are one 128-column group)")
        self.tile_m = 128
        self.tile_n = tile_n
        self.tile_k = FP8_BLOCK
        self.num_stages_override = num_stages
        self.num_b = 2 if self.gated else 1
        # wide_gated: one m64n128 WGMMA over the gate and up tiles (adjacent smem slots) into one
        # accumulator, instead of two m64n64 WGMMAs into two
        self.n_mma = 1 if self.wide_gated else self.num_b
        self.pingpong = False
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.Float8E4M3FN
        self.c_dtype = cutlass.BFloat16
        self.atom_layout_mnk = (2, 1, 1)
        self.num_mma_wg = 2
        self.tile_threads = 256
        self.num_epi_bufs = 1
        self.threads_per_wg = 128
        self.threads_per_cta = 3 * 128
        self.stage_consumer_warps = 8
        self.load_regs = 40
        self.mma_regs = 232
        self.smem_capacity = get_smem_capacity_in_bytes("sm_90")
        self.epi_n = 64
        self.epi_pad = 8
        self.epi_smem_elems = self.tile_m * (self.epi_n + self.epi_pad)
        # fused_quant: the peer's 64 staged rows of this CTA's quantised rows (its receive tile)
        self.recv_smem_elems = (QUANT_ROWS * (self.epi_n + self.epi_pad)
                                if self.fused_quant and not self.pair_amax else 0)
        # pair_amax: the peer's row amaxes, two units' worth (double-buffered)
        self.amax_smem_bytes = 2 * self.tile_m * 4 if self.pair_amax else 0
        self.quant_warps = QUANT_WARPS_SCALE_WARP if self.scale_warp else QUANT_WARPS

    # ------------------------------------------------------------------ host helpers
    def static_shapes(self, n: int, k: int):
        reason = can_implement(self.activation, n, k, 1, self.tile_n)
        if reason is not None:
            raise ValueError(reason)
        n_out = n // 2 if self.gated else n
        return n_out, n_out // self.tile_n

    def _num_stages(self, num_experts: int) -> int:
        per_stage = (self.tile_m + self.num_b * self.tile_n) * self.tile_k  # 1 byte per element
        if self.smem_scales:
            per_stage += SCALE_SLOT * 4
        reserved = 1024 + 8 * (num_experts + 2) + 1024
        reserved += self.epi_smem_elems * 2 * self.num_epi_bufs
        reserved += self.recv_smem_elems * 2 + self.amax_smem_bytes
        if self.unit_scales:  # the two chunk buffers and their four barriers
            reserved += UNIT_SCALE_BUFS * UNIT_SCALE_BUF * 4 + 128
        stages = min((self.smem_capacity - reserved) // per_stage, 8)
        if self.num_stages_override is not None:
            stages = min(stages, self.num_stages_override)
        if stages < 2:
            raise ValueError("fewer than 2 pipeline stages fit in shared memory")
        return stages

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mAScale: cute.Tensor,
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
        setup = self._setup(mA, mAScale, mB, mBScale, mOffsets)
        if cutlass.const_expr(self.unit_scales):
            self._launch(self.kernel_unit_scales(setup[0], setup[1], setup[2], setup[3], mAScale, mBScale, mC,
                                                 mOffsets, mRowScale, *setup[4:],
                                                 *self._unit_scale_atoms(mAScale, mBScale)), max_active_ctas, stream)
        else:
            self._launch(self.kernel(setup[0], setup[1], setup[2], setup[3], mAScale, mBScale, mC, mOffsets,
                                     mRowScale, *setup[4:]), max_active_ctas, stream)

    @cute.jit
    def _check_inputs(self, mA, mAScale, mB, mBScale, mOffsets):
        """The operands' dtypes (shared by the variants); returns ``(mA, mB)`` as e4m3 tensors (fp8
        operands may come as their uint8 bit views: torch builds without fp8 DLPack)."""
        if cutlass.const_expr(mA.element_type == cutlass.Uint8):
            mA = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=cutlass.Float8E4M3FN), mA.layout)
        if cutlass.const_expr(mB.element_type == cutlass.Uint8):
            mB = cute.make_tensor(cute.recast_ptr(mB.iterator, dtype=cutlass.Float8E4M3FN), mB.layout)
        if cutlass.const_expr(mA.element_type != cutlass.Float8E4M3FN
                              or mB.element_type != cutlass.Float8E4M3FN):
            raise TypeError("A and B must be float8_e4m3fn (or its uint8 view)")
        if cutlass.const_expr(mAScale.element_type != cutlass.Float32
                              or mBScale.element_type != cutlass.Float32):
            raise TypeError("scales must be float32")
        if cutlass.const_expr(mOffsets.element_type != cutlass.Int32):
            raise TypeError("offsets must be int32")
        return mA, mB

    def _launch(self, kernel, max_active_ctas, stream) -> None:
        """One persistent CTA per ``max_active_ctas``, PDL as the drop launches every kernel."""
        kernel.launch(
            grid=[max_active_ctas // self.cluster_n * self.cluster_n, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=[self.cluster_n, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=PDL,
        )

    @cute.jit
    def _launch_q_output(self, kernel, mA, mAScale, mB, mBScale, mQ, mQScale, mOffsets, mRowScale,
                         max_active_ctas, stream) -> None:
        """``__call__`` of the variants whose output is FC2's e4m3 input (requant, fused_quant):
        the inputs' checks, ``mQ`` [M, I] e4m3 / uint8 and ``mQScale`` [M, I/128] float32, then
        ``kernel`` (the variant's ``@cute.kernel``) launched on the shared set-up. Traced inline."""
        mA, mB = self._check_inputs(mA, mAScale, mB, mBScale, mOffsets)
        if cutlass.const_expr(mQ.element_type not in (cutlass.Uint8, cutlass.Float8E4M3FN)):
            raise TypeError("Q must be float8_e4m3fn or uint8")
        if cutlass.const_expr(mQScale.element_type != cutlass.Float32):
            raise TypeError("scales must be float32")
        if cutlass.const_expr(cute.size(mQ, mode=[1]) != cute.size(mB, mode=[1]) // 2
                              or cute.size(mQScale, mode=[1]) != cute.size(mB, mode=[1]) // 2 // FP8_BLOCK):
            raise ValueError("Q must be [M, I] and QScale [M, I/128] (N = 2 I)")
        setup = self._setup(mA, mAScale, mB, mBScale, mOffsets)
        self._launch(kernel(setup[0], setup[1], setup[2], setup[3], mAScale, mBScale, mQ, mQScale, mOffsets,
                            mRowScale, *setup[4:]), max_active_ctas, stream)

    def _setup(self, mA, mAScale, mB, mBScale, mOffsets):
        """Host-side (traced) set-up shared by the variants: checks the problem, sets the
        compile-time sizes, builds the TMA atoms, MMAs and smem layouts. Returns ``(tma_atom_a,
        tma_tensor_a, tma_atom_b, tma_tensor_b, tiled_mma, tiled_mma_epi, a_smem_layout,
        b_smem_layout)``."""
        num_experts = cute.size(mOffsets, mode=[0]) - 1
        n_rows_b = cute.size(mB, mode=[1])
        k_size = cute.size(mB, mode=[2])
        reason = can_implement(self.activation, n_rows_b, k_size, num_experts, self.tile_n)
        if cutlass.const_expr(reason is not None):
            raise ValueError(reason)
        if cutlass.const_expr(cute.size(mBScale, mode=[1]) != n_rows_b // FP8_BLOCK
                              or cute.size(mBScale, mode=[2]) != k_size // FP8_BLOCK
                              or cute.size(mAScale, mode=[1]) != k_size // FP8_BLOCK):
            raise ValueError("scale shapes must be [M, K/128] and [E, N/128, K/128]")
        n_out, n_tiles = self.static_shapes(n_rows_b, k_size)
        self.num_experts = num_experts
        self.n_out = n_out
        self.n_tiles = n_tiles // self.halves  # requant: one unit = two n-tiles (a 128-group)
        if cutlass.const_expr(self.cluster_n > 1):  # one unit = the cluster's adjacent n-tiles
            if cutlass.const_expr(n_tiles % self.cluster_n != 0):
                raise ValueError(f"cluster_n={self.cluster_n} needs a multiple of {self.cluster_n} n-tiles, got {n_tiles}")
            self.n_tiles = n_tiles // self.cluster_n
        self.k_tiles = k_size // self.tile_k
        self.overlap_chunk = (overlap_chunk(self.k_tiles, self.halves, self.chunk_k_tiles)
                              if self.overlap_promotion else 0)
        if cutlass.const_expr(self.overlap_promotion and self.k_tiles > OVERLAP_MAX_K_TILES
                              and not self.overlap_chunk):
            raise ValueError(f"overlap_promotion: K={k_size} is unrolled up to {OVERLAP_MAX_K_TILES * FP8_BLOCK}, "
                             f"beyond in chunks of an even number of 128-wide k-tiles (K/128 = {self.k_tiles} is odd)")
        if cutlass.const_expr(self.deferred_epilogue and self.overlap_chunk):
            raise ValueError(f"deferred_epilogue runs on the unrolled overlapped schedule (K <= "
                             f"{OVERLAP_MAX_K_TILES * FP8_BLOCK}), not the chunked one (K={k_size})")
        if cutlass.const_expr(self.unit_scales):
            reason = unit_scales_reason(self.k_tiles, self.overlap_chunk)
            if cutlass.const_expr(reason is not None):
                raise ValueError(reason)
        self.n_out_divisible = True
        self.num_stages = self._num_stages(num_experts)
        if cutlass.const_expr(self.pair_amax and self.k_tiles <= self.num_stages):
            raise ValueError(f"pair_amax needs more k-tiles per unit than pipeline stages (K/128 = {self.k_tiles}, "
                             f"{self.num_stages} stages): the pair's amax buffers alternate by unit")

        (b_layout, tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, tma_atom_a, tma_tensor_a,
         tma_atom_b, tma_tensor_b) = self._operands(mA, mB, self.wide_gated)

        fields = self._storage_fields(num_experts, a_smem_layout, b_smem_layout)
        if cutlass.const_expr(self.smem_scales):  # last, so the other fields keep their offsets
            fields["sScale"] = cute.struct.Align[cute.struct.MemRange[self.acc_dtype, self.num_stages * SCALE_SLOT], 16]
        if cutlass.const_expr(self.unit_scales):  # last too: the chunk buffers, "full" x 2, "empty" x 2
            fields["sUS"] = cute.struct.Align[cute.struct.MemRange[self.acc_dtype, UNIT_SCALE_BUFS * UNIT_SCALE_BUF], 128]
            fields["usbar"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * UNIT_SCALE_BUFS], 8]
        if cutlass.const_expr(self.pair_amax):  # after them: the peer's row amaxes of units 0, 1 (mod 2)
            fields["sAmax"] = cute.struct.Align[cute.struct.MemRange[self.acc_dtype, 2 * self.tile_m], 16]
            fields["abar"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2], 8]
        elif cutlass.const_expr(self.fused_quant):  # after them: the receive tile, "full" and "read"
            fields["sRecv"] = cute.struct.Align[cute.struct.MemRange[self.c_dtype, self.recv_smem_elems], 128]
            fields["qbar"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2], 8]
        # cute.struct reads a class's annotations: build the class from the field table
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        # wide_gated: stage s's gate and up slots (2s, 2s + 1: 64 rows of 128 bytes each, 8-row swizzle
        # atoms) are the same bytes as one 128-row tile of stage s
        b_smem_layout_mma = b_smem_layout
        if cutlass.const_expr(self.wide_gated):
            b_smem_layout_mma = sm90_utils.make_smem_layout_b(
                b_layout, (self.tile_m, 2 * self.tile_n, self.tile_k), self.ab_dtype, self.num_stages)
        return (tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tiled_mma, tiled_mma_epi, a_smem_layout,
                b_smem_layout, b_smem_layout_mma)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
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
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma)

    @cute.kernel
    def kernel_unit_scales(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
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
        tma_atom_as: cute.CopyAtom,
        mAS_tma: cute.Tensor,
        tma_atom_bs: cute.CopyAtom,
        mBS_tma: cute.Tensor,
    ):
        """``unit_scales`` (drop v69): the plain kernel with the scales' TMA atoms."""
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mC,), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma,
                   us_tma=(tma_atom_as, mAS_tma, tma_atom_bs, mBS_tma))

    @cute.jit
    def _body(self, tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, outs, mOffsets, mRowScale,
              tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma, gather=None, us_tma=None):
        """The kernel (traced inline into each variant's ``@cute.kernel``). ``outs``: ``(mC,)``, or
        ``(mQ, mQScale)`` for the requantising variant, whose unit of work is the pair of n-tiles
        of one 128-column group (``self.halves`` = 2), one after the other. ``gather``: ``(mA,
        mIdx)`` for the gathering variant (``self.gather_a``): grouped row r is ``mA[mIdx[r]]``,
        loaded by the producer warpgroup with cp.async, and its scales ``mAScale[mIdx[r]]``.
        ``us_tma``: ``unit_scales``' ``(atom_as, tma_as, atom_bs, tma_bs)``."""
        wait_previous_grid()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(self.unit_scales):
                cpasync.prefetch_descriptor(us_tma[0])
                cpasync.prefetch_descriptor(us_tma[2])

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        num_experts = self.num_experts
        sOff = storage.sched_off.get_tensor(cute.make_layout(num_experts + 1))
        sCum = storage.sched_cum.get_tensor(cute.make_layout(num_experts + 1))

        # ---- scheduler prologue: warp 1 scans per-expert m-tile counts (as in grouped_gemm)
        if warp_idx == 1:
            carry = cutlass.Int32(0)
            if lane == 0:
                sCum[0] = cutlass.Int32(0)
            for chunk in cutlass.range_constexpr((num_experts + 31) // 32):
                e = chunk * 32 + lane
                cnt = cutlass.Int32(0)
                if e < num_experts:
                    lo = mOffsets[e]
                    hi = mOffsets[e + 1]
                    sOff[e] = lo
                    cnt = (hi - lo + (self.tile_m - 1)) // self.tile_m
                    if e == num_experts - 1:
                        sOff[e + 1] = hi
                for s in cutlass.range_constexpr(5):
                    v = cute.arch.shuffle_sync_up(cnt, 1 << s)
                    if lane >= (1 << s):
                        cnt = cnt + v
                cnt = cnt + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)

        qbar = None  # fused_quant: "full" (this CTA's quantised rows are staged), "read" (sC is free)
        if cutlass.const_expr(self.pair_amax):
            qbar = storage.abar.data_ptr()  # unit u's peer amaxes have arrived in buffer u % 2
            if tidx == 0:  # as below: covered by the pipeline's fence and cluster sync
                cute.arch.mbarrier_init(qbar, 1)
                cute.arch.mbarrier_init(qbar + 1, 1)
        elif cutlass.const_expr(self.fused_quant):
            qbar = storage.qbar.data_ptr()
            if tidx == 0:  # initialised before the pipeline's fence and cluster sync, which cover them
                cute.arch.mbarrier_init(qbar, 1)  # arrive.expect_tx of the local warpgroup + the peer's bytes
                cute.arch.mbarrier_init(qbar + 1, 2 * len(self.quant_warps))  # each quantising warp of both CTAs
        us, us_bar = None, None  # unit_scales: (atoms, TMA tensors, chunk buffers); "full" x 2, "empty" x 2
        if cutlass.const_expr(self.unit_scales):
            us_bar = storage.usbar.data_ptr()
            if tidx == 0:  # as above: covered by the pipeline's fence and cluster sync
                for b in cutlass.range_constexpr(UNIT_SCALE_BUFS):
                    cute.arch.mbarrier_init(us_bar + b, 1)
                    cute.arch.mbarrier_init(us_bar + UNIT_SCALE_BUFS + b, self.tile_threads)
            us = (*us_tma, storage.sUS.get_tensor(cute.make_layout(UNIT_SCALE_BUFS * UNIT_SCALE_BUF)))
        a_smem_one = cute.slice_(a_smem_layout, (None, None, 0))
        b_smem_one = cute.slice_(b_smem_layout, (None, None, 0))
        tma_bytes, producers = stage_producers(self, a_smem_one, b_smem_one)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=producers,
            # cluster: a stage is free once the consumer warps of every CTA it is multicast to are done
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stage_consumer_warps * self.cluster_n),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cluster_n, 1)),
        )
        cute.arch.sync_threads()
        # the persistent schedule: one unit (tile, or the cluster's pair of n-tiles) per CTA (cluster)
        unit0, unit_step, cta_rank = bidx, gdim, 0
        if cutlass.const_expr(self.cluster_n > 1):
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            unit0, unit_step = bidx // self.cluster_n, gdim // self.cluster_n

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sScale = None  # smem_scales: stage s's scales at [s * SCALE_SLOT, (s + 1) * SCALE_SLOT)
        if cutlass.const_expr(self.smem_scales):
            sScale = storage.sScale.get_tensor(cute.make_layout(self.num_stages * SCALE_SLOT))

        n_tiles = self.n_tiles
        total_tiles = sCum[num_experts] * n_tiles
        k_tiles = self.k_tiles
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        # =========================================================== producer warpgroup
        if warp_group_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.load_regs)
            if cutlass.const_expr(self.gather_a and self.gather_tma):
                self._produce_gathered_tma(ab_pipeline, gather[1], tma_atom_a, mA_tma, a_smem_layout, tma_atom_b,
                                           mB_tma, storage.sA.data_ptr(), sB, sOff, sCum, total_tiles, tidx,
                                           warp_idx, lane, bidx, gdim)
            elif cutlass.const_expr(self.gather_a):
                self._produce_gathered(ab_pipeline, gather[0], gather[1], tma_atom_b, mB_tma, sA, sB, sOff, sCum,
                                       total_tiles, tidx, warp_idx, bidx, gdim)
            else:
                if warp_idx == 0:
                    prod_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.num_stages
                    )
                    tAsA = cute.group_modes(sA, 0, 2)
                    tBsB = cute.group_modes(sB, 0, 2)
                    expert = cutlass.Int32(0)
                    us_unit = cutlass.Int32(0)  # unit_scales: this CTA's units so far (chunk count / unit)
                    tile_id = unit0
                    while tile_id < total_tiles:
                        expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                        if cutlass.const_expr(self.cluster_n > 1):
                            n_tile = n_tile * self.cluster_n + cta_rank
                        gA = cute.local_tile(
                            cute.domain_offset((row0, 0), mA_tma), (self.tile_m, self.tile_k), (0, None)
                        )
                        # cluster: this CTA loads its 1/cluster_n of A's rows into every CTA of the cluster
                        tAsA_p, tAgA = cpasync.tma_partition(
                            tma_atom_a, cta_rank, cute.make_layout(self.cluster_n), tAsA, cute.group_modes(gA, 0, 2)
                        )
                        # smem_scales: lane l stages the scales of tile rows l + 32 j, clamped to
                        # the expert's last row as the consumers did (clamped rows are never stored)
                        sc_rows = None
                        if cutlass.const_expr(self.smem_scales and not self.scale_warp):
                            sc_rows = [cutlass.min(row0 + lane + 32 * j, row_end - 1)
                                       for j in range(self.tile_m // 32)]
                        for half in cutlass.range_constexpr(self.halves):
                            n0 = self._n0(n_tile, half)
                            tBgBs = []
                            for h in cutlass.range_constexpr(self.num_b):
                                gB = cute.local_tile(
                                    cute.domain_offset((n0 + h * self.n_out, 0, 0), mB_tma),
                                    (self.tile_n, self.tile_k),
                                    (0, None, expert),
                                )
                                tBsB_p, tBgB = cpasync.tma_partition(
                                    tma_atom_b, 0, cute.make_layout(1), tBsB, cute.group_modes(gB, 0, 2)
                                )
                                tBgBs.append(tBgB)
                            for k_tile in range(k_tiles):
                                if cutlass.const_expr(self.unit_scales):  # a chunk's scales, before its first stage
                                    if k_tile % UNIT_SCALE_KC == 0:
                                        self._load_unit_scales(us, us_bar,
                                                               us_unit * (k_tiles // UNIT_SCALE_KC)
                                                               + k_tile // UNIT_SCALE_KC, row0, expert, n0, lane)
                                if cutlass.const_expr(self.smem_scales and not self.scale_warp):
                                    self._stage_scales(ab_pipeline, prod_state, mAScale, mBScale, sScale, sc_rows,
                                                       expert, n0, k_tile, lane)
                                else:
                                    ab_pipeline.producer_acquire(prod_state)
                                bar = ab_pipeline.producer_get_barrier(prod_state)
                                cute.copy(tma_atom_a, tAgA[(None, k_tile)], tAsA_p[(None, prod_state.index)],
                                          tma_bar_ptr=bar,
                                          **({"mcast_mask": cutlass.Int16((1 << self.cluster_n) - 1)} if self.cluster_n > 1 else {}))
                                for h in cutlass.range_constexpr(self.num_b):
                                    cute.copy(
                                        tma_atom_b,
                                        tBgBs[h][(None, k_tile)],
                                        tBsB_p[(None, prod_state.index * self.num_b + h)],
                                        tma_bar_ptr=bar,
                                    )
                                ab_pipeline.producer_commit(prod_state)
                                prod_state.advance()
                        tile_id = tile_id + unit_step
                        if cutlass.const_expr(self.unit_scales):
                            us_unit = us_unit + 1
                    ab_pipeline.producer_tail(prod_state)
                if cutlass.const_expr(self.scale_warp and self.scale_lookahead > 1):
                    if warp_idx == 1:
                        self._scale_producer_ahead(ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles,
                                                   unit0, unit_step, cta_rank, lane)
                elif cutlass.const_expr(self.scale_warp):
                    if warp_idx == 1:
                        self._scale_producer(ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles, unit0,
                                             unit_step, cta_rank, lane)
                if cutlass.const_expr(self.fused_quant and not self.pair_amax):
                    if warp_idx >= self.quant_warps[0]:
                        self._fused_quant_warps(outs, qbar, storage.sC.data_ptr().toint(),
                                                storage.sRecv.data_ptr().toint(), sOff, sCum, total_tiles,
                                                unit0, unit_step, cta_rank, warp_idx - self.quant_warps[0], lane)

        # =========================================================== consumer warpgroups
        if warp_group_idx > 0:
            cute.arch.warpgroup_reg_alloc(self.mma_regs)
            mma_tidx = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            if cutlass.const_expr(self.wide_gated):  # one 128-row B tile per stage (gate rows, then up)
                sB_mma = storage.sB.get_tensor(b_smem_layout_mma.outer, swizzle=b_smem_layout_mma.inner)
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB_mma))
            else:
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            num_k_blocks = cute.size(tCrA, mode=[2])  # WGMMAs (K = 32) per k-tile: 4

            if cutlass.const_expr(self.wide_gated):
                acc_shape_mma = tiled_mma.partition_shape_C((self.tile_m, 2 * self.tile_n))
                acc_shape = tiled_mma_epi.partition_shape_C((self.tile_m, self.tile_n))
                assert cute.size(acc_shape_mma[0][2]) == 2 * self.tile_n // 8, acc_shape_mma
            else:
                acc_shape = tiled_mma.partition_shape_C((self.tile_m, self.tile_n))
                acc_shape_mma = acc_shape
            # accumulator layout ((2, 2, N/8), 1, 1): element i sits in row r0 + 8 * ((i // 2) % 2)
            assert (
                cute.size(acc_shape[0][0]) == 2 and cute.size(acc_shape[0][1]) == 2
                and cute.size(acc_shape[0][2]) == self.tile_n // 8
                and cute.size(acc_shape[1]) == 1 and cute.size(acc_shape[2]) == 1
            ), f"unexpected accumulator shape {acc_shape}"
            accs = [cute.make_rmem_tensor(acc_shape_mma, self.acc_dtype) for _ in range(self.n_mma)]
            parts = [cute.make_rmem_tensor(acc_shape_mma, self.acc_dtype) for _ in range(self.n_mma)]
            parts2 = None  # the second partial set of the overlapped schedule
            if cutlass.const_expr(self.overlap_promotion):
                parts2 = [cute.make_rmem_tensor(acc_shape_mma, self.acc_dtype) for _ in range(self.n_mma)]
            if cutlass.const_expr(self.wide_gated):  # the output tile's coordinates (64 columns)
                tCcC = tiled_mma_epi.get_slice(mma_tidx).partition_C(
                    cute.make_identity_tensor((self.tile_m, self.tile_n)))
                n_elems = cute.size(acc_shape)
            else:
                tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                n_elems = cute.size(accs[0])
            n_mma_elems = cute.size(accs[0])
            sC = storage.sC.get_tensor(
                cute.make_layout((self.tile_m, self.epi_n), stride=(self.epi_n + self.epi_pad, 1))
            )
            tCsC = tiled_mma_epi.get_slice(mma_tidx).partition_C(sC)
            epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.tile_threads)

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            # the overlapped schedule releases one k-tile behind its waits: a second cursor
            rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            # this thread's two accumulator rows inside the tile
            r_lo = tCcC[0][0]
            r_hi = tCcC[2][0]
            expert = cutlass.Int32(0)
            q_unit = cutlass.Int32(0)  # fused_quant: units this CTA has stored
            us_unit = cutlass.Int32(0)  # unit_scales: units this CTA has computed
            # deferred_epilogue: the unit whose tile waits in ``accs`` to be stored (none yet: 0 rows)
            prev_row0 = cutlass.Int32(0)
            prev_rows = cutlass.Int32(0)
            prev_n0 = cutlass.Int32(0)
            prev_ra_lo = cutlass.Int32(0)
            prev_ra_hi = cutlass.Int32(0)
            # pair_amax: the previous unit, parked in sC until the peer's amaxes are surely here
            prev_am_lo = cutlass.Float32(0.0)
            prev_am_hi = cutlass.Float32(0.0)
            if cutlass.const_expr(self.deferred_epilogue):
                for h in cutlass.range_constexpr(self.n_mma):
                    accs[h].fill(0.0)  # what the first deferred epilogue reads (it stores no row)
            tile_id = unit0
            while tile_id < total_tiles:
                expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                if cutlass.const_expr(self.cluster_n > 1):
                    n_tile = n_tile * self.cluster_n + cta_rank
                rows_left = row_end - row0
                # clamp to the expert's last row: always in bounds, never stored when clamped
                ra_lo = row0 + cutlass.min(r_lo, rows_left - 1)
                ra_hi = row0 + cutlass.min(r_hi, rows_left - 1)
                sr_lo, sr_hi = ra_lo, ra_hi  # the rows of mAScale (gathering: the source rows)
                if cutlass.const_expr(self.gather_a):
                    sr_lo = gather[1][ra_lo]
                    sr_hi = gather[1][ra_hi]
                kept = None  # requant: half 0's bf16 outputs and row amaxes, for half 1
                for half in cutlass.range_constexpr(self.halves):
                    n0 = self._n0(n_tile, half)
                    sc = (mAScale, mBScale, sr_lo, sr_hi, expert, n0, sScale, r_lo, r_hi)  # for _scales
                    usc = None  # unit_scales: (chunk buffers, barriers, the unit's first chunk)
                    if cutlass.const_expr(self.unit_scales):
                        usc = (us[4], us_bar, us_unit * (k_tiles // UNIT_SCALE_KC))
                    if cutlass.const_expr(not self.deferred_epilogue):
                        for h in cutlass.range_constexpr(self.n_mma):
                            accs[h].fill(0.0)

                    if cutlass.const_expr(self.overlap_promotion and not self.overlap_chunk):
                        # k-tile t's WGMMAs in flight while t-1 is promoted (module docstring);
                        # k-tile 0 -> set A (parts)
                        ab_pipeline.consumer_wait(state)
                        tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts, state.index, num_k_blocks)
                        state.advance()
                        a_lo, a_hi, a_b0, a_b1 = self._scales(sc, state, True, 0, self._us_at(usc, 0))
                        if cutlass.const_expr(self.deferred_epilogue):
                            # drop v48: the previous unit's tile is stored while k-tile 0 runs (no
                            # WGMMA group crosses the unit loop's back-edge: only finished sums wait)
                            self._epilogue([self._activate(accs, acc_shape, n_elems, mRowScale, prev_ra_lo,
                                                           prev_ra_hi)],
                                           tCsC, sC, outs[0], prev_row0, prev_rows, prev_n0, mma_tidx, epi_barrier)
                            for h in cutlass.range_constexpr(self.n_mma):
                                accs[h].fill(0.0)
                        # pairs (t, t + 1) = (1 + 2p, 2 + 2p): t -> set B (parts2), t + 1 -> set A
                        for p in cutlass.range_constexpr((k_tiles - 1) // 2):  # unrolled: see OVERLAP_MAX_K_TILES
                            t = 1 + 2 * p
                            ab_pipeline.consumer_wait(state)
                            tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts2, state.index, num_k_blocks)
                            state.advance()
                            b_lo, b_hi, b_b0, b_b1 = self._scales(sc, state, True, t, self._us_at(usc, t))
                            warpgroup.wait_group(1)  # set A's group (t - 1) is done; B's may run
                            self._fence(parts, n_mma_elems)
                            ab_pipeline.consumer_release(rel)
                            rel.advance()
                            self._promote(accs, parts, a_lo, a_hi, a_b0, a_b1, n_mma_elems)
                            ab_pipeline.consumer_wait(state)
                            tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts, state.index, num_k_blocks)
                            state.advance()
                            a_lo, a_hi, a_b0, a_b1 = self._scales(sc, state, True, t + 1, self._us_at(usc, t + 1))
                            warpgroup.wait_group(1)  # set B's group (t) is done
                            self._fence(parts2, n_mma_elems)
                            ab_pipeline.consumer_release(rel)
                            rel.advance()
                            self._promote(accs, parts2, b_lo, b_hi, b_b0, b_b1, n_mma_elems)
                        if cutlass.const_expr((k_tiles - 1) % 2 == 1):
                            # one k-tile left (k_tiles even): set B, then both sets drain
                            ab_pipeline.consumer_wait(state)
                            tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts2, state.index, num_k_blocks)
                            state.advance()
                            b_lo, b_hi, b_b0, b_b1 = self._scales(sc, state, True, k_tiles - 1,
                                                                  self._us_at(usc, k_tiles - 1))
                            warpgroup.wait_group(1)
                            self._fence(parts, n_mma_elems)
                            ab_pipeline.consumer_release(rel)
                            rel.advance()
                            self._promote(accs, parts, a_lo, a_hi, a_b0, a_b1, n_mma_elems)
                            warpgroup.wait_group(0)
                            self._fence(parts2, n_mma_elems)
                            ab_pipeline.consumer_release(rel)
                            rel.advance()
                            self._promote(accs, parts2, b_lo, b_hi, b_b0, b_b1, n_mma_elems)
                        else:
                            warpgroup.wait_group(0)
                            self._fence(parts, n_mma_elems)
                            ab_pipeline.consumer_release(rel)
                            rel.advance()
                            self._promote(accs, parts, a_lo, a_hi, a_b0, a_b1, n_mma_elems)
                    elif cutlass.const_expr(self.overlap_chunk):
                        # drop v25: the same schedule in chunks of C (even) k-tiles, each traced once
                        # (one copy in the instruction cache) and drained at its end, so no WGMMA
                        # group is in flight across the chunk loop's back-edge. Per chunk at k0:
                        # k0 -> set A; pairs (t, t + 1) -> B, A; k0 + C - 1 -> B; drain.
                        C = self.overlap_chunk
                        for chunk in range(k_tiles // C):
                            k0 = chunk * C
                            ab_pipeline.consumer_wait(state)
                            tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts, state.index, num_k_blocks)
                            state.advance()
                            a_lo, a_hi, a_b0, a_b1 = self._scales(sc, state, True, k0, self._us_at(usc, 0, chunk, C))
                            for p in cutlass.range_constexpr(C // 2):
                                t = k0 + 1 + 2 * p
                                ab_pipeline.consumer_wait(state)
                                tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts2, state.index, num_k_blocks)
                                state.advance()
                                b_lo, b_hi, b_b0, b_b1 = self._scales(sc, state, True, t,
                                                                      self._us_at(usc, 1 + 2 * p, chunk, C))
                                warpgroup.wait_group(1)  # set A's group (t - 1) is done; B's may run
                                self._fence(parts, n_mma_elems)
                                ab_pipeline.consumer_release(rel)
                                rel.advance()
                                self._promote(accs, parts, a_lo, a_hi, a_b0, a_b1, n_mma_elems)
                                if cutlass.const_expr(p < C // 2 - 1):  # t + 1 -> set A
                                    ab_pipeline.consumer_wait(state)
                                    tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts, state.index, num_k_blocks)
                                    state.advance()
                                    a_lo, a_hi, a_b0, a_b1 = self._scales(
                                        sc, state, True, t + 1, self._us_at(usc, 2 + 2 * p, chunk, C))
                                    warpgroup.wait_group(1)  # set B's group (t) is done
                                else:  # t = k0 + C - 1, the chunk's last: drain
                                    warpgroup.wait_group(0)
                                self._fence(parts2, n_mma_elems)
                                ab_pipeline.consumer_release(rel)
                                rel.advance()
                                self._promote(accs, parts2, b_lo, b_hi, b_b0, b_b1, n_mma_elems)
                    else:
                        for k_tile in range(k_tiles):
                            ab_pipeline.consumer_wait(state)
                            tiled_mma = self._issue(tiled_mma, tCrA, tCrB, parts, state.index, num_k_blocks)
                            # scales of this k-tile: loaded while the WGMMAs run
                            sa_lo, sa_hi, sb0, sb1 = self._scales(sc, state, False, k_tile)
                            warpgroup.wait_group(0)
                            ab_pipeline.consumer_release(state)
                            state.advance()
                            self._promote(accs, parts, sa_lo, sa_hi, sb0, sb1, n_mma_elems)

                    # ---------------- epilogue: activation, row scale, masked bf16 stores
                    if cutlass.const_expr(self.deferred_epilogue):  # stored under the next unit's k-tile 0
                        prev_row0, prev_rows, prev_n0, prev_ra_lo, prev_ra_hi = row0, rows_left, n0, ra_lo, ra_hi
                    elif cutlass.const_expr(self.requant):
                        acc0 = self._activate(accs, acc_shape, n_elems, mRowScale, ra_lo, ra_hi)
                        kept = self._requant_epilogue(half, kept, acc0, acc_shape, n_elems, tCcC, sC, outs, row0,
                                                      rows_left, r_lo, r_hi, n_tile, mma_tidx, lane, epi_barrier)
                    elif cutlass.const_expr(self.pair_amax):
                        # this unit's row amaxes to the peer now; the previous unit (whose peer amaxes
                        # were sent a whole unit ago: no wait on the peer) quantised and stored; this
                        # one parked in sC in its place. (Twenty-seventh session, H200: the same work
                        # under the next unit's k-tile 0 instead was slower on Mixtral.)
                        acc0 = self._activate(accs, acc_shape, n_elems, mRowScale, ra_lo, ra_hi)
                        amax_addr = storage.sAmax.data_ptr().toint()
                        rH, am_lo, am_hi = self._pair_send(acc0, acc_shape, n_elems, q_unit, cta_rank, mma_tidx,
                                                           lane, qbar, amax_addr, r_lo, r_hi)
                        if q_unit > 0:
                            self._pair_finish(acc_shape, n_elems, tCcC, sC, outs, prev_row0, prev_rows, r_lo, r_hi,
                                              prev_n0, q_unit - 1, prev_am_lo, prev_am_hi, cta_rank, mma_tidx,
                                              lane, epi_barrier, qbar, amax_addr)
                        self._park(rH, sC, mma_tidx)
                        prev_row0, prev_rows, prev_n0 = row0, rows_left, n_tile // 2
                        prev_am_lo, prev_am_hi = am_lo, am_hi
                    elif cutlass.const_expr(self.fused_quant):  # staged for the quantising warps
                        acc0 = self._activate(accs, acc_shape, n_elems, mRowScale, ra_lo, ra_hi)
                        self._stage_unit(acc0, tCsC, qbar, q_unit, mma_tidx, epi_barrier,
                                         storage.sC.data_ptr().toint(), storage.sRecv.data_ptr().toint(), cta_rank)
                    else:
                        acc0 = self._activate(accs, acc_shape, n_elems, mRowScale, ra_lo, ra_hi)
                        self._epilogue([acc0], tCsC, sC, outs[0], row0, rows_left, n0, mma_tidx, epi_barrier)
                if cutlass.const_expr(self.fused_quant):  # pair_amax too
                    q_unit = q_unit + 1
                if cutlass.const_expr(self.unit_scales):
                    us_unit = us_unit + 1
                tile_id = tile_id + unit_step
            if cutlass.const_expr(self.pair_amax):
                if q_unit > 0:  # the last unit (none if this CTA had no unit)
                    self._pair_finish(acc_shape, n_elems, tCcC, sC, outs, prev_row0, prev_rows, r_lo, r_hi, prev_n0,
                                      q_unit - 1, prev_am_lo, prev_am_hi, cta_rank, mma_tidx, lane, epi_barrier, qbar,
                                      storage.sAmax.data_ptr().toint())
            if cutlass.const_expr(self.deferred_epilogue):
                if prev_rows > 0:  # the last unit's tile (none if this CTA had no unit)
                    self._epilogue([self._activate(accs, acc_shape, n_elems, mRowScale, prev_ra_lo, prev_ra_hi)],
                                   tCsC, sC, outs[0], prev_row0, prev_rows, prev_n0, mma_tidx, epi_barrier)

        if cutlass.const_expr(self.fused_quant):
            if warp_group_idx > 0:  # the sending threads' last bulk copy has read its sC rows
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # every thread of both CTAs: no CTA exits while its peer may still copy into its shared
            # memory or arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    # ------------------------------------------------------------------ consumer helpers
    # (plain methods, traced inline into the kernel, so the tiled MMA's accumulate flag and the
    # pipeline cursors they touch stay visible to the loops around them; their Python loops and
    # branches are over compile-time values and unroll as range_constexpr would)
    def _issue(self, tiled_mma, tCrA, tCrB, parts, stage, num_k_blocks: cutlass.Constexpr):
        """WGMMAs of one k-tile (smem stage ``stage``) into the fresh partial accumulators
        ``parts`` (scale-d = 0 on the first), committed as one group; returns ``tiled_mma``."""
        warpgroup.fence()
        for h in range(self.n_mma):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for kb in range(num_k_blocks):
                cute.gemm(
                    tiled_mma,
                    parts[h],
                    tCrA[(None, None, kb, stage)],
                    tCrB[(None, None, kb, stage * self.n_mma + h)],
                    parts[h],
                )
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return tiled_mma  # rebound by the caller: the accumulate flag is a traced value

    def _activate(self, accs, acc_shape, n_elems: int, mRowScale, ra_lo, ra_hi):
        """The tile's outputs from its finished sums ``accs``: the activation (swiglu: silu(gate) * up;
        wide gated: a new tensor of the tile's ``n_elems`` outputs, else ``accs[0]`` in place), then
        the row scale of the thread's two rows ``ra_lo`` / ``ra_hi`` when ``scale_rows``."""
        acc0 = accs[0]
        if self.wide_gated:
            # output element i (column block i // 4 < 8) = gate element i, up element i + 32
            acc0 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            for i in range(n_elems):
                acc0[i] = self._silu(accs[0][i]) * accs[0][i + n_elems]
        elif self.gated:
            for i in range(n_elems):
                acc0[i] = self._silu(acc0[i]) * accs[1][i]
        if self.scale_rows:
            rs_lo = mRowScale[ra_lo]
            rs_hi = mRowScale[ra_hi]
            for i in range(n_elems):
                if (i // 2) % 2 == 0:
                    acc0[i] = acc0[i] * rs_lo
                else:
                    acc0[i] = acc0[i] * rs_hi
        return acc0

    def _silu(self, g):
        """:func:`.grouped_gemm.silu` in this kernel's form (``tanh_sigmoid``, drop v50: one MUFU op
        per output; the epilogue is MUFU-bound)."""
        return silu(g, self.tanh_sigmoid)

    def _n0(self, n_tile, half: int):
        """First output column (of ``n_out``) of half ``half`` of scheduled unit ``n_tile``."""
        if self.halves == 1:
            return n_tile * self.tile_n
        return (n_tile * self.halves + half) * self.tile_n

    @cute.jit
    def _requant_epilogue(self, half: int, kept, acc0, acc_shape, n_elems: int, tCcC, sC, outs, row0, rows_left,
                          r_lo, r_hi, group, mma_tidx, lane, epi_barrier):
        """The requantising variant's epilogue for half ``half`` of 128-column group ``group``:
        round ``acc0`` (activated, row-scaled) to bf16 -- the values the plain kernel stores --
        and take the |max| of this thread's two rows. Half 0 parks its bf16 values in shared memory
        and returns the two amaxes (``kept``); half 1
        finishes each row's amax over the 4 lanes that share it, then writes what
        :mod:`.fp8_quant` would write for those bf16 values: ``scale = amax / 448`` (1 for an
        all-zero group), ``q = e4m3(h / scale)`` (IEEE division, RN-even, satfinite), the
        128 e4m3 bytes of each row staged in shared memory and stored as 16-byte vectors."""
        mQ, mQScale = outs
        rH = cute.make_rmem_tensor(acc_shape, cutlass.BFloat16)
        rH.store(acc0.load().to(cutlass.BFloat16))
        rF = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        rF.store(rH.load().to(cutlass.Float32))
        am_lo, am_hi = self._row_amaxes(rF, n_elems)
        # half 0's bf16 values wait in shared memory (registers are short in the overlapped schedule)
        q_base = sC.iterator.toint()
        if cutlass.const_expr(half == 0):
            self._park(rH, sC, mma_tidx)
            return am_lo, am_hi
        am_lo0, am_hi0 = kept
        rH0 = self._unpark(acc_shape, sC, mma_tidx)
        epi_barrier.arrive_and_wait()  # every thread has its half 0 back: sC becomes the e4m3 tile
        am_lo = cute.arch.fmax(am_lo, am_lo0, nan=True)
        am_hi = cute.arch.fmax(am_hi, am_hi0, nan=True)
        am_lo, am_hi = self._quad_max(am_lo, am_hi)
        s_lo, s_hi = self._group_scales(am_lo, am_hi)
        # stage the group's e4m3 bytes: row r at byte r * QPITCH of sC (same bytes as the bf16 tile)
        for hh in cutlass.range_constexpr(2):
            src = rH0 if hh == 0 else rH
            rF.store(src.load().to(cutlass.Float32))
            for i in cutlass.range_constexpr(n_elems):
                if cutlass.const_expr((i // 2) % 2 == 0):
                    rF[i] = rF[i] / s_lo
                else:
                    rF[i] = rF[i] / s_hi
            self._stage_e4m3(rF, acc_shape, n_elems, tCcC, q_base, QPITCH, hh * self.tile_n)
        epi_barrier.arrive_and_wait()
        # each row's 128 bytes are 8 vectors; a warp writes 4 whole rows
        self._store_e4m3_rows(mQ, q_base, QPITCH, 2 * self.tile_n // 16, row0, rows_left, group, 0, mma_tidx)
        self._store_row_scales(mQScale, row0, rows_left, r_lo, r_hi, group, s_lo, s_hi, lane)
        epi_barrier.arrive_and_wait()  # the staging buffer is free for the next unit
        return None

    # ------------------------------------------------------------------ e4m3 epilogue helpers
    # (requant and pair_amax: the steps of fp8_quant.Fp8QuantizeRows128 on a tile's rows)
    def _row_amaxes(self, rF, n_elems: int):
        """|max| of this thread's values of its two accumulator rows (element i sits in row r or
        r + 8 by (i // 2) % 2); NaN propagates."""
        am_lo = cutlass.Float32(0.0)
        am_hi = cutlass.Float32(0.0)
        for i in range(n_elems):
            a = cute.arch.fmax(rF[i], -rF[i], nan=True)
            if (i // 2) % 2 == 0:
                am_lo = cute.arch.fmax(am_lo, a, nan=True)
            else:
                am_hi = cute.arch.fmax(am_hi, a, nan=True)
        return am_lo, am_hi

    def _quad_max(self, am_lo, am_hi):
        """Both amaxes over the 4 lanes of a quad, which hold one row's columns."""
        for d in range(2):
            am_lo = cute.arch.fmax(am_lo, cute.arch.shuffle_sync_bfly(am_lo, 1 << d), nan=True)
            am_hi = cute.arch.fmax(am_hi, cute.arch.shuffle_sync_bfly(am_hi, 1 << d), nan=True)
        return am_lo, am_hi

    @cute.jit
    def _group_scales(self, am_lo, am_hi):
        """``scale = amax / 448`` of each row's group (1 for an all-zero group; NaN propagates)."""
        s_lo = cutlass.Float32(1.0)
        if am_lo > cutlass.Float32(0.0):
            s_lo = am_lo / cutlass.Float32(E4M3_MAX)
        s_hi = cutlass.Float32(1.0)
        if am_hi > cutlass.Float32(0.0):
            s_hi = am_hi / cutlass.Float32(E4M3_MAX)
        return s_lo, s_hi

    @cute.jit
    def _stage_e4m3(self, rF, acc_shape, n_elems: cutlass.Constexpr, tCcC, q_base, pitch: cutlass.Constexpr,
                    col_off: cutlass.Constexpr):
        """``rF`` (already divided by the scales) as e4m3 into the staging tile at ``q_base``: row r's
        bytes from ``r * pitch + col_off``, element pair (2p, 2p + 1) (adjacent columns) as one store."""
        rQ = cute.make_rmem_tensor(acc_shape, cutlass.Float8E4M3FN)
        rQ.store(rF.load().to(cutlass.Float8E4M3FN))
        rQ16 = cute.recast_tensor(rQ, cutlass.Int16)
        for p in cutlass.range_constexpr(n_elems // 2):
            row, col = tCcC[2 * p]
            ptr = cute.make_ptr(cutlass.Int16, q_base + row * pitch + col_off + col, cute.AddressSpace.smem,
                                assumed_align=2)
            cute.make_tensor(ptr, cute.make_layout(1))[0] = rQ16[p]

    @cute.jit
    def _store_e4m3_rows(self, mQ, q_base, pitch: cutlass.Constexpr, vec_per_row: cutlass.Constexpr, row0,
                         rows_left, group, col_in, mma_tidx):
        """The staged tile's rows (``vec_per_row`` 16-byte vectors each, ``pitch`` bytes apart) into
        ``mQ`` rows ``row0 + r`` from column ``col_in`` of 128-column group ``group``, rows past
        ``rows_left`` skipped."""
        n_out = self.n_out
        g_base = mQ.iterator.toint()
        for it in cutlass.range_constexpr(self.tile_m * vec_per_row // self.tile_threads):
            v = it * self.tile_threads + mma_tidx
            row = v // vec_per_row
            cv = v % vec_per_row
            if row < rows_left:
                s_ptr = cute.make_ptr(cutlass.Int32, q_base + row * pitch + cv * 16, cute.AddressSpace.smem,
                                      assumed_align=16)
                g_off = cutlass.Int64(row0 + row) * n_out + group * FP8_BLOCK + col_in + cv * 16
                g_ptr = cute.make_ptr(cutlass.Int32, g_base + g_off, cute.AddressSpace.gmem, assumed_align=16)
                cute.make_tensor(g_ptr, cute.make_layout(4)).store(cute.make_tensor(s_ptr, cute.make_layout(4)).load())

    @cute.jit
    def _store_row_scales(self, mQScale, row0, rows_left, r_lo, r_hi, group, s_lo, s_hi, lane):
        """One lane per quad stores the quad's two row scales (rows past ``rows_left`` skipped)."""
        if lane % 4 == 0:
            if r_lo < rows_left:
                mQScale[row0 + r_lo, group] = s_lo
            if r_hi < rows_left:
                mQScale[row0 + r_hi, group] = s_hi

    # ------------------------------------------------------------------ fused_quant (drops v37-v39, v66)
    @cute.jit
    def _pair_send(self, acc0, acc_shape, n_elems: int, q_unit, cta_rank, mma_tidx, lane, abar, amax_addr, r_lo,
                   r_hi):
        """``pair_amax`` (drop v66), unit ``q_unit``'s first half: ``acc0`` (activated, row-scaled)
        rounded to bf16 -- the values the plain kernel stores -- and each of this thread's two rows'
        |max| over this CTA's 64 columns (the 4 lanes of a quad hold a row). One lane per quad
        stores them straight into the peer CTA's receive buffer ``u % 2`` (``st.async``, 4 bytes
        each, completing on the peer's barrier ``abar + u % 2``), and the first consumer thread arms
        this CTA's barrier for the peer's 128. Returns ``(rH, amax_lo, amax_hi)``."""
        rH = cute.make_rmem_tensor(acc_shape, cutlass.BFloat16)
        rH.store(acc0.load().to(cutlass.BFloat16))
        rF = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        rF.store(rH.load().to(cutlass.Float32))
        am_lo, am_hi = self._quad_max(*self._row_amaxes(rF, n_elems))
        buf = q_unit % 2
        received = amax_addr + buf * (self.tile_m * 4)
        mbar = (abar + buf).toint()
        if lane % 4 == 0:
            _store_to_peer(received + r_lo * 4, am_lo, mbar, 1 - cta_rank)
            _store_to_peer(received + r_hi * 4, am_hi, mbar, 1 - cta_rank)
        if mma_tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(abar + buf, self.tile_m * 4)
        return rH, am_lo, am_hi

    @cute.jit
    def _park(self, rH, sC, mma_tidx):
        """This thread's bf16 values (``rH``) wait in ``sC`` (requant: half 0 for half 1; pair_amax:
        unit u for unit u + 1's epilogue): 16-byte slot ``j`` of consumer thread ``t`` at byte
        ``(j * tile_threads + t) * 16``; each thread reads back its own (:meth:`_unpark`)."""
        rH32 = cute.recast_tensor(rH, cutlass.Int32)
        q_base = sC.iterator.toint()
        for j in cutlass.range_constexpr(cute.size(rH32) // 4):
            ptr = cute.make_ptr(cutlass.Int32, q_base + (j * self.tile_threads + mma_tidx) * 16,
                                cute.AddressSpace.smem, assumed_align=16)
            v = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
            for w in cutlass.range_constexpr(4):
                v[w] = rH32[4 * j + w]
            cute.make_tensor(ptr, cute.make_layout(4)).store(v.load())

    @cute.jit
    def _unpark(self, acc_shape, sC, mma_tidx):
        """The bf16 values this thread parked with :meth:`_park`, as a fragment of ``acc_shape``."""
        rH = cute.make_rmem_tensor(acc_shape, cutlass.BFloat16)
        rH32 = cute.recast_tensor(rH, cutlass.Int32)
        q_base = sC.iterator.toint()
        for j in cutlass.range_constexpr(cute.size(rH32) // 4):
            ptr = cute.make_ptr(cutlass.Int32, q_base + (j * self.tile_threads + mma_tidx) * 16,
                                cute.AddressSpace.smem, assumed_align=16)
            v = cute.make_tensor(ptr, cute.make_layout(4)).load()
            for w in cutlass.range_constexpr(4):
                rH32[4 * j + w] = v[w]
        return rH

    @cute.jit
    def _pair_finish(self, acc_shape, n_elems: int, tCcC, sC, outs, row0, rows_left, r_lo, r_hi, group, q_unit,
                     am_lo, am_hi, cta_rank, mma_tidx, lane, epi_barrier, abar, amax_addr):
        """``pair_amax``, unit ``q_unit``'s second half, one unit later: its parked bf16 values and this
        CTA's 64 columns of 128-column group ``group`` written as FC2's e4m3 input, exactly as
        :class:`.fp8_quant.Fp8QuantizeRows128` would write them from the bf16 rows the plain kernel
        stores: with the peer's amaxes (``am_*``: this CTA's), ``scale = amax / 448`` (1 for an
        all-zero group), ``q = e4m3(h / scale)`` (the quantiser's exact division). The receive
        buffers alternate by unit: a CTA cannot be two units ahead of its peer, as the A tiles it
        multicasts wait for the peer's consumers (more k-tiles per unit than pipeline stages)."""
        mQ, mQScale = outs
        rH = self._unpark(acc_shape, sC, mma_tidx)
        q_base = sC.iterator.toint()
        rF = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        rF.store(rH.load().to(cutlass.Float32))
        buf = q_unit % 2
        received = amax_addr + buf * (self.tile_m * 4)
        cute.arch.mbarrier_wait(abar + buf, (q_unit // 2) % 2)
        for hh in cutlass.range_constexpr(2):
            ptr = cute.make_ptr(cutlass.Float32, received + (r_lo if hh == 0 else r_hi) * 4, cute.AddressSpace.smem,
                                assumed_align=4)
            peer = cute.make_tensor(ptr, cute.make_layout(1))[0]
            if cutlass.const_expr(hh == 0):
                am_lo = cute.arch.fmax(am_lo, peer, nan=True)
            else:
                am_hi = cute.arch.fmax(am_hi, peer, nan=True)
        s_lo, s_hi = self._group_scales(am_lo, am_hi)
        # the quantiser's division (fp8_quant._divide_by_scale): one IEEE 1 / scale per row, then
        # three exact-rounding ops a value, where the scales allow it (always, but for NaN / inf /
        # tiny groups, which divide)
        lo_ok = (s_lo >= cutlass.Float32(FAST_DIV_MIN_SCALE)) & (s_lo <= cutlass.Float32(FAST_DIV_MAX_SCALE))
        hi_ok = (s_hi >= cutlass.Float32(FAST_DIV_MIN_SCALE)) & (s_hi <= cutlass.Float32(FAST_DIV_MAX_SCALE))
        if lo_ok & hi_ok:
            rc_lo = cutlass.Float32(1.0) / s_lo
            rc_hi = cutlass.Float32(1.0) / s_hi
            for i in cutlass.range_constexpr(n_elems):
                if cutlass.const_expr((i // 2) % 2 == 0):
                    rF[i] = _div_rn(rF[i], s_lo, rc_lo)
                else:
                    rF[i] = _div_rn(rF[i], s_hi, rc_hi)
        else:
            for i in cutlass.range_constexpr(n_elems):
                if cutlass.const_expr((i // 2) % 2 == 0):
                    rF[i] = rF[i] / s_lo
                else:
                    rF[i] = rF[i] / s_hi
        # every thread has its parked values back (the e4m3 tile overwrites the slots): row r at
        # byte r * PAIR_QPITCH of sC
        epi_barrier.arrive_and_wait()
        self._stage_e4m3(rF, acc_shape, n_elems, tCcC, q_base, PAIR_QPITCH, 0)
        epi_barrier.arrive_and_wait()
        # each row's 64 bytes are 4 vectors
        self._store_e4m3_rows(mQ, q_base, PAIR_QPITCH, self.tile_n // 16, row0, rows_left, group,
                              cta_rank * self.tile_n, mma_tidx)
        if cta_rank == 0:  # one CTA stores the row scales
            self._store_row_scales(mQScale, row0, rows_left, r_lo, r_hi, group, s_lo, s_hi, lane)
        epi_barrier.arrive_and_wait()  # the e4m3 tile is read: sC may hold the next parked unit
        cute.arch.sync_warp()  # the warp reconverges before its next WGMMAs

    @cute.jit
    def _stage_unit(self, acc0, tCsC, qbar, q_unit, mma_tidx, epi_barrier, sC_addr, recv_addr, cta_rank):
        """``fused_quant``'s epilogue: unit ``q_unit``'s bf16 values (what the plain epilogue would
        store) into the staging tile ``sC`` -- once every quantising warp of both CTAs has read the
        previous unit ("read", parity 1 passes on a fresh barrier) -- then, after the warpgroups'
        barrier, warpgroup w's first thread hands its 64 rows to CTA w's quantising warps: its own
        CTA's (w = rank) by arming "full" with the bytes the peer will send, the peer's by one bulk
        copy into the peer's receive tile that completes them on the peer's "full". No global
        store: FC2 reads only the e4m3 rows. The warp reconverges before its next WGMMAs."""
        # "read" of the previous unit also means its bulk copy is done: the peer's quantising warps
        # arrive only after their "full" phase, which needed every byte of that copy delivered
        cute.arch.mbarrier_wait(qbar + 1, (q_unit % 2) ^ 1)
        rC = cute.make_rmem_tensor(acc0.shape, self.c_dtype)
        rC.store(acc0.load().to(self.c_dtype))
        # the plain epilogue's layout of one epi_n-wide chunk (here the whole 64-column tile)
        rC32 = cute.recast_tensor(rC, cutlass.Int32)
        sC32 = cute.recast_tensor(tCsC, cutlass.Int32)
        sC32 = cute.make_tensor(cute.make_ptr(cutlass.Int32, sC32.iterator.toint(), cute.AddressSpace.smem,
                                              assumed_align=4), sC32.layout)
        m_rep = cute.size(rC32, mode=[1])
        ppc = cute.size(sC32) // m_rep
        n8 = self.tile_n // 8
        for m in cutlass.range_constexpr(m_rep):
            for j in cutlass.range_constexpr(ppc):
                sC32[j + ppc * m] = rC32[j + 2 * n8 * m]
        wg = mma_tidx // self.threads_per_wg  # its rows: [64 wg, 64 wg + 64), quantised by CTA wg
        if wg != cta_rank:  # the rows the bulk copy (async proxy) reads
            cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if mma_tidx % self.threads_per_wg == 0:
            nbytes = self.recv_smem_elems * 2
            if wg == cta_rank:
                cute.arch.mbarrier_arrive_and_expect_tx(qbar, nbytes)
            else:
                _bulk_copy_to_peer(recv_addr, sC_addr + wg * nbytes, nbytes, qbar.toint(), 1 - cta_rank)
                cute.arch.cp_async_bulk_commit_group()
        cute.arch.sync_warp()

    @cute.jit
    def _fused_quant_warps(self, outs, qbar, sC_addr, recv_addr, sOff, sCum, total_tiles, unit0, unit_step,
                           cta_rank, qwarp, lane):
        """The quantising producer warps (``fused_quant``): for each unit of this cluster, once "full"
        says both halves are here, quantise rows ``[64 r, 64 r + 64)`` (r: this CTA's rank) of the
        unit's m-tile over its 128-column group -- this CTA's 64 columns from its ``sC``, the peer's
        from the receive tile -- into ``mQ`` / ``mQScale`` exactly as
        :class:`.fp8_quant.Fp8QuantizeRows128` would, then arrive on both CTAs' "read" barrier. A
        warp takes two rows per pass, 16 lanes x 8 values per row, the warps' passes interleaved;
        rows past the expert's end are computed and not stored."""
        mQ, mQScale = outs
        q_base = mQ.iterator.toint()
        n_out = self.n_out
        nq = len(self.quant_warps)
        row_bytes = (self.epi_n + self.epi_pad) * 2  # bf16 staging row
        half = lane // 16   # which of the pass's two rows
        sub = lane % 16     # 8 values: columns 8 sub .. 8 sub + 7 of the group
        # columns 0-63 are CTA 0's, 64-127 CTA 1's: this CTA's in sC (rows 64 r ..), the peer's received
        lane_base = recv_addr + (sub % 8) * 16
        if sub // 8 == cta_rank:
            lane_base = sC_addr + cta_rank * QUANT_ROWS * row_bytes + (sub % 8) * 16
        expert = cutlass.Int32(0)
        q_unit = cutlass.Int32(0)
        tile_id = unit0
        while tile_id < total_tiles:
            expert, row0, row_end, group = self._locate(sOff, sCum, tile_id, expert)
            rows_left = row_end - row0 - cta_rank * QUANT_ROWS
            cute.arch.mbarrier_wait(qbar, q_unit % 2)
            # a run-time loop (the producer warpgroup keeps 40 registers): row pairs qwarp, qwarp + nq, ...
            for p in cutlass.range(qwarp, QUANT_ROWS // 2, nq, unroll=2):
                row = p * 2 + half
                s_ptr = cute.make_ptr(cutlass.BFloat16, lane_base + row * row_bytes, cute.AddressSpace.smem,
                                      assumed_align=16)
                x = cute.make_tensor(s_ptr, cute.make_layout(8)).load().to(cutlass.Float32)
                amax = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(8):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(x[i], -x[i], nan=True), nan=True)
                for d in cutlass.range_constexpr(4):  # the row's 16 lanes
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 1 << (3 - d)), nan=True)
                scale = cutlass.Float32(1.0)
                if amax > cutlass.Float32(0.0):
                    scale = amax / cutlass.Float32(E4M3_MAX)
                q = _divide_by_scale(x, scale, 8).to(cutlass.Float8E4M3FN)
                if row < rows_left:
                    grow = row0 + cta_rank * QUANT_ROWS + row
                    col = group * FP8_BLOCK + sub * 8
                    q_ptr = cute.make_ptr(cutlass.Float8E4M3FN, q_base + cutlass.Int64(grow) * n_out + col,
                                          cute.AddressSpace.gmem, assumed_align=8)
                    cute.make_tensor(q_ptr, cute.make_layout(8)).store(q)
                    if sub == 0:
                        mQScale[grow, group] = scale
            cute.arch.sync_warp()  # every lane's loads are done (their values used above)
            if lane == 0:  # read: both CTAs may stage (and send) their next unit
                for r in range(2):
                    cute.arch.mbarrier_arrive(qbar + 1, peer_cta_rank_in_cluster=r)
            q_unit = q_unit + 1
            tile_id = tile_id + unit_step

    @cute.jit
    def _scale_producer(self, ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles, unit0, unit_step,
                        cta_rank, lane):
        """scale_warp (drop v35): producer warp 1 walks the TMA warp's schedule (same units, halves and
        k-tiles, so the same stages) and stages each k-tile's scales with :meth:`_stage_scales`,
        which then arms nothing: after the stores and a warp barrier, one elected lane arrives on the
        stage's full barrier, which counts two arrivals (the TMA warp's ``arrive.expect_tx`` and this
        one). The TMA warp's loop is then exactly the global-scale kernel's: it never waits on a
        scale load before issuing a stage's copies."""
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        expert = cutlass.Int32(0)
        tile_id = unit0
        while tile_id < total_tiles:
            expert, n_tile, sc_rows = self._scale_unit(sOff, sCum, tile_id, expert, cta_rank, lane)
            for half in cutlass.range_constexpr(self.halves):
                n0 = self._n0(n_tile, half)
                for k_tile in range(self.k_tiles):
                    self._stage_scales(ab_pipeline, prod_state, mAScale, mBScale, sScale, sc_rows, expert, n0,
                                       k_tile, lane)
                    prod_state.advance()
            tile_id = tile_id + unit_step

    def _scale_unit(self, sOff, sCum, tile_id, expert, cta_rank, lane):
        """A scale warp's view of unit ``tile_id`` (traced inline): ``(expert, n_tile, sc_rows)``, the
        n-tile this CTA takes and lane l's tile rows l + 32 j, clamped to the expert's last row as the
        consumers clamp them (clamped rows are never stored)."""
        expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
        if cutlass.const_expr(self.cluster_n > 1):
            n_tile = n_tile * self.cluster_n + cta_rank
        sc_rows = [cutlass.min(row0 + lane + 32 * j, row_end - 1) for j in range(self.tile_m // 32)]
        return expert, n_tile, sc_rows

    def _b_block(self, n0, lane):
        """The 128-row weight-scale block of lane ``lane``'s B scale for the tile at ``n0`` (gated:
        lane 0 the gate rows', lane 1 the up rows'; traced inline)."""
        bsel = 0
        if cutlass.const_expr(self.num_b > 1):
            bsel = cutlass.min(lane, self.num_b - 1)
        return (n0 + bsel * self.n_out) // FP8_BLOCK

    def _lookahead_depth(self) -> int:
        """k-tiles of scale loads in flight (``scale_lookahead``): the largest divisor of K/128 up to it,
        so the scale warp's k-loop steps by whole groups of register slots."""
        return max(d for d in range(1, self.scale_lookahead + 1) if self.k_tiles % d == 0)

    @cute.jit
    def _scale_producer_ahead(self, ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles, unit0,
                              unit_step, cta_rank, lane):
        """scale_lookahead (drop v65): :meth:`_scale_producer` with the loads of the next ``depth``
        k-tiles in flight. Slot d of ``pend`` (5 registers: the lane's 4 A-row scales, its B scale)
        holds k-tile ``k0 + d``; the loop over k0 steps by ``depth`` and traces each slot once, so a
        slot's registers are read (stored to the stage) only where the loop reaches it and are then
        refilled with k-tile ``k0 + d + depth`` (clamped to the unit's last k-tile)."""
        depth = self._lookahead_depth()
        rows = self.tile_m // 32
        width = rows + 1
        pend = cute.make_rmem_tensor(cute.make_layout(depth * width), cutlass.Float32)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        expert = cutlass.Int32(0)
        tile_id = unit0
        while tile_id < total_tiles:
            expert, n_tile, sc_rows = self._scale_unit(sOff, sCum, tile_id, expert, cta_rank, lane)
            for half in cutlass.range_constexpr(self.halves):
                n0 = self._n0(n_tile, half)
                b_blk = self._b_block(n0, lane)
                for d in cutlass.range_constexpr(depth):
                    self._fetch_scales(pend, d * width, mAScale, mBScale, sc_rows, expert, b_blk, d)
                for k0 in range(0, self.k_tiles, depth):
                    for d in cutlass.range_constexpr(depth):
                        self._put_scales(ab_pipeline, prod_state, sScale, pend, d * width, lane)
                        prod_state.advance()
                        k_next = cutlass.min(k0 + (d + depth), self.k_tiles - 1)
                        self._fetch_scales(pend, d * width, mAScale, mBScale, sc_rows, expert, b_blk, k_next)
            tile_id = tile_id + unit_step

    def _fetch_scales(self, pend, off: int, mAScale, mBScale, sc_rows, expert, b_blk, k_tile):
        """Issue the loads of one k-tile's scales into ``pend[off:off + 5]`` (traced inline)."""
        for j in range(len(sc_rows)):
            pend[off + j] = mAScale[sc_rows[j], k_tile]
        pend[off + len(sc_rows)] = mBScale[expert, b_blk, k_tile]

    @cute.jit
    def _put_scales(self, ab_pipeline, prod_state, sScale, pend, off: cutlass.Constexpr, lane):
        """Wait for the stage of ``prod_state`` to be free, store the scales held in ``pend[off:]`` into
        its slot, then one elected arrival on its full barrier (as the v35 scale warp does)."""
        rows = self.tile_m // 32
        ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
        base = prod_state.index * SCALE_SLOT
        for j in cutlass.range_constexpr(rows):
            sScale[base + lane + 32 * j] = pend[off + j]
        if lane < self.num_b:
            sScale[base + self.tile_m + lane] = pend[off + rows]
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(prod_state))

    @cute.jit
    def _stage_scales(self, ab_pipeline, prod_state, mAScale, mBScale, sScale, sc_rows, expert, n0, k_tile, lane):
        """smem_scales (drop v34): the producer warp's ``producer_acquire`` with the k-tile's scales
        written into the stage's slot before the stage's full barrier is armed. The loads are
        issued before the wait for a free stage (their L2 latency hides behind it); after the
        lanes' stores, a warp barrier orders them before the elected ``arrive.expect_tx``, whose
        release the consumers acquire when they wait on the stage (no consumer-side global load).
        With ``scale_warp`` (v35) the scale warp calls it and its arrival carries no bytes."""
        a_sc = [mAScale[r, k_tile] for r in sc_rows]  # a comprehension: traced as plain Python
        b_sc = mBScale[expert, self._b_block(n0, lane), k_tile]
        ab_pipeline.sync_object_empty.wait(prod_state.index, prod_state.phase)
        base = prod_state.index * SCALE_SLOT
        for j in cutlass.range_constexpr(len(sc_rows)):
            sScale[base + lane + 32 * j] = a_sc[j]
        if lane < self.num_b:
            sScale[base + self.tile_m + lane] = b_sc
        cute.arch.sync_warp()
        if cutlass.const_expr(self.scale_warp):  # the scale warp: one plain arrival of the stage's two
            if lane == 0:
                cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(prod_state))
        else:
            ab_pipeline.sync_object_full.arrive(prod_state.index, ab_pipeline.producer_mask)

    def _fence(self, parts, n_elems: int) -> None:
        """Pin every partial accumulator of one set (see :func:`_fence_operand`)."""
        for h in range(self.n_mma):
            _fence_operand(parts[h], n_elems)

    def _us_at(self, usc, t: int, chunk=None, chunk_k_tiles: int = 0):
        """``unit_scales``: ``(buffers, barriers, chunk, j)`` of the k-tile ``t`` k-tiles into its unit
        (chunked schedule: into chunk ``chunk`` of ``chunk_k_tiles``), or None without unit_scales."""
        if not self.unit_scales:
            return None
        sUS, us_bar, c0 = usc
        if chunk is not None:
            c0 = c0 + chunk * (chunk_k_tiles // UNIT_SCALE_KC)
        return sUS, us_bar, c0 + t // UNIT_SCALE_KC, t % UNIT_SCALE_KC

    def _scales(self, sc, state, behind: bool, k_tile, us=None):
        """(a_scale of the thread's two rows, b_scale of each accumulator) of one k-tile. ``sc``:
        ``(mAScale, mBScale, sr_lo, sr_hi, expert, n0, sScale, r_lo, r_hi)``; with smem_scales the
        k-tile's stage slot, the stage of ``state`` (``behind``: the one before it); with unit_scales
        the chunk buffer ``us`` (:meth:`_us_at`)."""
        mAScale, mBScale, ra_lo, ra_hi, expert, n0, sScale, r_lo, r_hi = sc
        if self.unit_scales:
            return self._read_unit_scales(us[0], us[1], us[2], us[3], r_lo, r_hi)
        if self.smem_scales:
            stage = state.index
            if behind:
                stage = (stage + (self.num_stages - 1)) % self.num_stages
            base = stage * SCALE_SLOT
            sb0 = sScale[base + self.tile_m]
            sb1 = sb0
            if self.num_b > 1:
                sb1 = sScale[base + self.tile_m + 1]
            return sScale[base + r_lo], sScale[base + r_hi], sb0, sb1
        sa_lo = mAScale[ra_lo, k_tile]
        sa_hi = mAScale[ra_hi, k_tile]
        sb0 = mBScale[expert, n0 // FP8_BLOCK, k_tile]
        sb1 = sb0
        if self.num_b > 1:
            sb1 = mBScale[expert, (n0 + self.n_out) // FP8_BLOCK, k_tile]
        return sa_lo, sa_hi, sb0, sb1

    def _promote(self, accs, parts, sa_lo, sa_hi, sb0, sb1, n_elems: cutlass.Constexpr):
        """main += partial * a_scale[row] * b_scale, per accumulator (element i sits in row r or
        r + 8 by (i // 2) % 2)."""
        if self.wide_gated:  # one accumulator: gate columns (blocks < tile_n / 8) then up columns
            s = ((sa_lo * sb0, sa_hi * sb0), (sa_lo * sb1, sa_hi * sb1))
            for i in range(n_elems):
                si = s[int((i // 4) >= self.tile_n // 8)][(i // 2) % 2]
                accs[0][i] = accs[0][i] + parts[0][i] * si
            return
        for h in range(self.num_b):
            sb = sb0 if h == 0 else sb1
            s_lo = sa_lo * sb
            s_hi = sa_hi * sb
            for i in range(n_elems):
                if (i // 2) % 2 == 0:
                    accs[h][i] = accs[h][i] + parts[h][i] * s_lo
                else:
                    accs[h][i] = accs[h][i] + parts[h][i] * s_hi


class Fp8SwigluRequantGroupedGemmSm90(Fp8BlockScaledGroupedGemmSm90):
    """FC1 with its output requantised in the epilogue (drop v21): ``swiglu`` as in the base class,
    then, instead of bf16 rows, each row's 128-column groups as e4m3 values and one float32 scale
    -- exactly what :class:`.fp8_quant.Fp8QuantizeRows128` writes for the bf16 rows the base kernel
    would store (same rounding to bf16 first, same amax, same IEEE division), so FC2's input
    never exists in bf16 and one launch and a write + read of the bf16 rows disappear.

    Tensors as in the base class except the output::

        mQ      [M_total, I]        uint8 (e4m3 bits) or float8_e4m3fn   rows < the expert ends
        mQScale [M_total, I / 128]  float32                              only those rows written

    A CTA's unit of work is one 128-row m-tile times one 128-column group of ``h``: the group's two
    64-column n-tiles (the gated tile is 64 wide: gate + up + partial accumulators fill the
    registers) one after the other; half 0's bf16 outputs wait in 16 registers per thread.
    """

    requant = True
    halves = 2

    def __init__(self, scale_rows: bool = False, num_stages: Optional[int] = None, raster_m: int = 1,
                 overlap_promotion: bool = False, wide_gated: bool = False, smem_scales: bool = False,
                 scale_warp: bool = False, tanh_sigmoid: bool = False):
        super().__init__("swiglu", scale_rows=scale_rows, tile_n=64, num_stages=num_stages, raster_m=raster_m,
                         overlap_promotion=overlap_promotion, wide_gated=wide_gated, smem_scales=smem_scales,
                         scale_warp=scale_warp, tanh_sigmoid=tanh_sigmoid)
        assert self.halves * self.tile_n == FP8_BLOCK and QPITCH * self.tile_m <= 2 * self.epi_smem_elems

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mAScale: cute.Tensor,
        mB: cute.Tensor,
        mBScale: cute.Tensor,
        mQ: cute.Tensor,
        mQScale: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch_q_output(self.kernel_requant, mA, mAScale, mB, mBScale, mQ, mQScale, mOffsets, mRowScale,
                              max_active_ctas, stream)

    @cute.kernel
    def kernel_requant(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mAScale: cute.Tensor,
        mBScale: cute.Tensor,
        mQ: cute.Tensor,
        mQScale: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_mma: cute.ComposedLayout,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mQ, mQScale), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma)


class Fp8SwigluFusedQuantGroupedGemmSm90(Fp8BlockScaledGroupedGemmSm90):
    """FC1 (swiglu, wide gated, clusters of 2) whose output is FC2's e4m3 input (drops v37-v39):
    ``mQ`` / ``mQScale`` exactly as :class:`.fp8_quant.Fp8QuantizeRows128Counted` would write them
    from the bf16 rows the base kernel stores -- quantised by producer warps 1-3 (2-3 with
    ``scale_warp``) from the unit's rows staged in their CTA, the peer's half arriving by a bulk copy,
    while the consumers run the next unit (the module docstring, ``fused_quant``).
    The bf16 rows themselves are never written.

    Tensors as in the base class except the output::

        mQ      [M_total, I]        uint8 (e4m3 bits) or float8_e4m3fn   rows < the expert ends
        mQScale [M_total, I / 128]  float32                              only those rows written

    ``pair_amax=True`` (drop v66): no quantising warps; each CTA's consumers quantise their own 64
    columns in the epilogue, the pair swapping only each row's |max| over its half of the group
    (one 512-byte bulk copy per unit; :meth:`_pair_amax_epilogue`). The same bits.
    """

    fused_quant = True

    def __init__(self, scale_rows: bool = False, num_stages: Optional[int] = None, raster_m: int = 1,
                 overlap_promotion: bool = False, smem_scales: bool = False, scale_warp: bool = False,
                 tanh_sigmoid: bool = False, pair_amax: bool = False):
        self.pair_amax = bool(pair_amax)  # read by the base class's __init__ (shared-memory sizes)
        super().__init__("swiglu", scale_rows=scale_rows, tile_n=64, num_stages=num_stages, raster_m=raster_m,
                         overlap_promotion=overlap_promotion, wide_gated=True, cluster_n=2,
                         smem_scales=smem_scales, scale_warp=scale_warp, tanh_sigmoid=tanh_sigmoid)
        # the staging tile holds a whole 64-column half (one epilogue chunk), a pair of them a group
        assert 2 * self.tile_n == FP8_BLOCK and self.epi_n == self.tile_n and self.epi_pad % 8 == 0

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mAScale: cute.Tensor,
        mB: cute.Tensor,
        mBScale: cute.Tensor,
        mQ: cute.Tensor,
        mQScale: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._launch_q_output(self.kernel_fused_quant, mA, mAScale, mB, mBScale, mQ, mQScale, mOffsets,
                              mRowScale, max_active_ctas, stream)

    @cute.kernel
    def kernel_fused_quant(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mAScale: cute.Tensor,
        mBScale: cute.Tensor,
        mQ: cute.Tensor,
        mQScale: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_mma: cute.ComposedLayout,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mAScale, mBScale, (mQ, mQScale), mOffsets, mRowScale,
                   tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma)
