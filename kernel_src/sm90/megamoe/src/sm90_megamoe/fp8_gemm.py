"""FP8 block-scaled varlen-M grouped GEMM for MoE experts on SM90 (DeepSeek-V3 / Qwen3-FP8 format).

Requirements (checked by :func:`can_implement`, which returns a reason string or None)
-----------------------------------------------------------------------------------
* activation in ("identity", "swiglu", "clamped_swiglu", "softcapped_swiglu") (clamped_swiglu: drop v100;
  softcapped_swiglu: drop v103)
* K % 128 == 0 (one activation scale and one weight scale per 128-wide k-tile), K >= 128
* N % 128 == 0 (whole 128-row weight-scale blocks); gated: N = 2 * I with I % 128 == 0
* tile_n in (64, 128); gated: tile_n == 64 (gate + up accumulators, each with a partial
  accumulator for the promotion: 4 x 32 fp32 registers per thread; tile_n = 128 would need 256)
* E <= MAX_EXPERTS; all tensors contiguous, base pointers 16-byte aligned (scales 4-byte)

Semantics, for every expert ``e`` with rows ``[offsets[e], offsets[e+1])``::

    H[m, n] = sum_kb a_scale[m, kb] * w_scale[e, n // 128, kb] * sum_{k in kb} A[m, k] * B[e, n, k]
    identity  C[m, :]   = H[m, :]              (* row_scale[m] when scale_rows)
    swiglu    C[m, :I]  = silu(H[m, :I]) * H[m, I:]   (* row_scale[m])
    clamped_swiglu  C[m, :I] = (clamp(U, -l, l) + beta) * G' * sigmoid(alpha * G'),  G' = min(G, l),
                    G = H[m, :I], U = H[m, I:] (the BF16 GEMM's form; alpha, l, beta compile-time)
    softcapped_swiglu  C[m, :I] = cg * tanh(G / cg) * sigmoid(G) * cu * tanh(U / cu)  (the BF16 GEMM's form)

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
* ``smem_scales=True`` (drop v34): the producer warp stages each
  k-tile's scales in shared memory beside its operands -- lane l loads the A scales of tile rows
  l + 32 j (clamped as above) and lanes 0 / 1 the gate / up weight block's scale, *before* waiting
  for a free stage (their L2 latency hides behind that wait), stores them into the stage's slot of
  ``SCALE_SLOT`` floats, then a warp barrier and the elected ``arrive.expect_tx`` arm the stage, so
  the consumers, whose wait on the stage acquires that arrive, read their scales from shared memory
  instead of stalling on global loads after the k-tile's WGMMAs. Same values, same promotion: the
  same bits. Without it, every other variant's PTX is byte-identical to drop v33's.
* ``scale_warp=True`` (drop v35; with ``smem_scales``): producer warp 1 stages the scales instead
  (:meth:`_scale_producer`: the TMA warp's units and k-tiles, so the same stages) and each
  stage's full barrier counts two arrivals, the TMA warp's ``arrive.expect_tx`` and the scale
  warp's elected arrive; the TMA warp's loop is the global-scale kernel's again. Why: on the H200
  v34's staged scales slowed the plain schedule down (0.83-0.93x), plausibly because the TMA warp
  stores a stage's scales -- waiting for their loads -- before it may issue the stage's copies.
* ``unit_scales=True`` (drop v69; the overlapped schedule, not with ``smem_scales``, K/128 a
  multiple of UNIT_SCALE_KC = 8, or since drop v106 of 4, whose scales then come 4 k-tiles per copy
  (``unit_kc``; Inkling2's FC1, K 4608); beyond OVERLAP_MAX_K_TILES the chunk is then the largest
  multiple of ``unit_kc`` dividing K/128, up to 16 -- drop v105: DeepSeek-V3's FC1, K 7168, runs
  chunks of 8 with it and of 14 without; where the even divisor is already such a multiple nothing
  changes): the TMA warp loads the scales of 8 k-tiles per copy -- a 128-row x 8 box of ``mAScale``
  and an 8-wide box of ``mBScale`` per weight block -- into one of two shared-memory buffers with their own full /
  empty barriers, and the consumers read each k-tile's scales from there (:mod:`.unit_scales`; kernel entry
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

Drop v84 removed the variants the H200 measured slower or no faster (VENDOR.md, docs/LIMITS.md):
clusters of 4 (v49), the scale warp's look-ahead (v65), FC1 writing FC2's e4m3 input in its
epilogue (v21 / v33 ``Fp8SwigluRequantGroupedGemmSm90``) or by its producer warps (v37-v39, v66
``Fp8SwigluFusedQuantGroupedGemmSm90``). The PTX of every kept variant is byte-identical to v83's.
Drop v87 removed the gathering FP8 GEMM (v22 / v23 ``Fp8GatherGroupedGemmSm90``: FC1 reading E4M3
tokens by index, 0.565 vs 0.455 ms on Qwen3; the scattering quantiser, v25, took its place).
Drop v89 removed v82's ``chunk_k_tiles`` (the overlapped k-loop in chunks shorter than the default
rule's, for less code per tile: the layer 0.98-0.99x on Mixtral, within the spread on Qwen3).
Drop v93 removed v92's quantising placement (the producer's spare warps quantising FC1's or
FC2's A rows: FC1 0.59-0.78x quantiser + plain at the cap, the layer 7-11% slower with FC2's).
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

from .gather_producer import stage_producers
from .pdl import PDL, wait_previous_grid
from .constants import MAX_EXPERTS
from .grouped_gemm import (GroupedGemmSm90, check_activation_constants, clamped_swiglu, get_smem_capacity_in_bytes, silu,
                           softcapped_swiglu)
from .warp_scan import warp_inclusive_scan
from .unit_scales import UNIT_SCALE_BUF, UNIT_SCALE_BUFS, UnitScales, unit_scale_kc, unit_scales_reason

FP8_BLOCK = 128
#: k-tiles up to which ``overlap_promotion`` unrolls the whole k-loop (a WGMMA group still in flight
#: must not cross a loop back-edge, or ptxas serialises every WGMMA, C7514); beyond it (drop v25)
#: the k-loop runs in chunks of :func:`overlap_chunk` k-tiles, each unrolled and drained at its end
OVERLAP_MAX_K_TILES = 32
#: the largest chunk of the chunked overlapped schedule (code size: one chunk is traced)
OVERLAP_MAX_CHUNK = 16
#: float32 slots per stage of ``smem_scales`` (drop v34): the tile's 128 A-row scales, then the
#: B scale of each weight block (gate, up), padded to a multiple of 4 (16-byte aligned slots)
SCALE_SLOT = 132


def overlap_chunk(k_tiles: int, multiple: int = 2) -> int:
    """k-tiles per chunk of the overlapped schedule for a k-loop of ``k_tiles``: 0 when it unrolls
    whole (``k_tiles`` <= OVERLAP_MAX_K_TILES), else the largest divisor <= OVERLAP_MAX_CHUNK that
    is a multiple of ``multiple`` (0 if none: an odd k_tiles cannot run chunked). ``multiple`` is 2
    (the schedule's k-tile pairs) or, with ``unit_scales``, its scale chunk ``unit_kc`` (drop v105:
    its scale chunks must tile the k-loop's chunks)."""
    if k_tiles <= OVERLAP_MAX_K_TILES:
        return 0
    top = OVERLAP_MAX_CHUNK - OVERLAP_MAX_CHUNK % multiple
    return next((c for c in range(top, 1, -multiple) if k_tiles % c == 0), 0)


def guarded_stages(stages: int, loop_k_tiles: int, unit_scales: bool = False) -> int:
    """``stage_guard`` (drop v108): the pipeline depth for a kernel whose unrolled k-loop -- the whole
    loop, or one chunk of the chunked schedule -- is ``loop_k_tiles`` long, on the global- and
    staged-scale paths: where ``stages`` divides that loop and the loop is at least twice as long,
    ``stages`` - 1, or - 2 where that divides it too (never below 3; else ``stages`` unchanged).

    Why: ptxas spills there and nowhere else (51st session, sm_90a, 168 registers): K 1536 / 2304 /
    3072 / 3840 with staged scales (12 / 18 / 24 / 30 k-tiles, 6 stages) spill 16 / 24 / 24 / 52 bytes
    per thread, K 2048 / 2560 / 2816 none; the gated FC1 at K 4608 with global scales (chunks of 12)
    44, at K 3072 56; with 5 stages none of them spill. Scales by TMA (``unit_scales``) never
    spilled: unchanged."""
    def divides(s):
        return loop_k_tiles >= 2 * s and loop_k_tiles % s == 0

    if unit_scales or not divides(stages):
        return stages
    return next((s for s in (stages - 1, stages - 2) if s >= 3 and not divides(s)), stages)


def kernel_overlap_chunk(k_tiles: int, unit_scales: bool = False) -> int:
    """:func:`overlap_chunk` as the kernel asks for it (drop v107: one place for what the kernel, its
    runner and the shim computed each in their own form): in multiples of 2 (the schedule's k-tile
    pairs), or with ``unit_scales`` of its scale chunk :func:`.unit_scales.unit_scale_kc` (drop v105;
    2 where that is 0, so the caller's check names the unusable K/128)."""
    return overlap_chunk(k_tiles, max(unit_scale_kc(k_tiles), 2) if unit_scales else 2)


@dsl_user_op
def _pin(v, *, loc=None, ip=None):
    """``v`` through an empty volatile asm that reads and writes it: the value is tied to this
    program point, so the compiler cannot move reads of a WGMMA accumulator above the
    ``wgmma.wait_group`` that completes it (CUTLASS's ``warpgroup_fence_operand``)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


def _fence_operand(frag, n: int) -> None:
    """:func:`_pin` every element of a register fragment of ``n`` elements."""
    for i in range(n):
        frag[i] = _pin(frag[i])


FP8_ACTIVATIONS = ("identity", "swiglu", "clamped_swiglu", "softcapped_swiglu")
#: the gated ones: gate rows [0, I) and up rows [I, 2I) of the weight, two accumulators
FP8_GATED = ("swiglu", "clamped_swiglu", "softcapped_swiglu")


def default_tile_n(activation: str) -> int:
    return 64 if activation in FP8_GATED else 128


def can_implement(activation: str, n: int, k: int, num_experts: int,
                  tile_n: Optional[int] = None) -> Optional[str]:
    """None if the kernel supports (activation, N, K, E, tile_n), else the reason."""
    if activation not in FP8_ACTIVATIONS:
        return f"activation must be one of {FP8_ACTIVATIONS}, got {activation!r}"
    if tile_n is None:
        tile_n = default_tile_n(activation)
    if tile_n not in (64, 128):
        return f"tile_n must be 64 or 128, got {tile_n}"
    if activation in FP8_GATED and tile_n != 64:
        return f"{activation} needs tile_n == 64 (gate + up + two partial accumulators in registers)"
    if k <= 0 or k % FP8_BLOCK != 0:
        return f"K={k} must be a positive multiple of {FP8_BLOCK}"
    if n <= 0 or n % FP8_BLOCK != 0:
        return f"N={n} must be a positive multiple of {FP8_BLOCK}"
    if activation in FP8_GATED and (n // 2) % FP8_BLOCK != 0:
        return f"{activation} needs I = N/2 = {n // 2} to be a multiple of {FP8_BLOCK}"
    if not (1 <= num_experts <= MAX_EXPERTS):
        return f"num_experts={num_experts} must be in [1, {MAX_EXPERTS}]"
    return None


class Fp8BlockScaledGroupedGemmSm90(GroupedGemmSm90, UnitScales):
    """FP8 block-scaled varlen-M grouped GEMM (see the module docstring).

    :param activation: one of ``FP8_ACTIVATIONS`` (compile time).
    :param scale_rows: multiply output row m by row_scale[m] after the activation.
    :param tile_n: output columns per tile; None = 128 (identity) / 64 (gated).
    :param num_stages: smem pipeline depth; None = as many as fit (at most 8).
    :param raster_m: m-tiles per raster group inside an expert (as in :class:`GroupedGemmSm90`).
    :param swiglu_alpha, swiglu_limit, swiglu_beta: clamped_swiglu's constants (drop v100; gpt-oss:
        1.702, 7.0, 1.0; DeepSeek-V4 / GLM-5: 1.0, the model's limit, 0.0).
    :param swiglu_limit_after_act: the gate clamped after the activation (Step-3.7; drop v102).
    :param gate_softcap, up_softcap: softcapped_swiglu's caps (Inkling2: 4.0, 25.0; drop v103).
    :param stage_guard: one pipeline stage fewer where the stage count divides the unrolled k-loop
        (drop v108, :func:`guarded_stages`: ptxas spills there; the same bits).

    Only :meth:`_locate` and :meth:`_epilogue` are inherited; they read ``tile_m``, ``tile_n``,
    ``n_tiles``, ``raster_m``, ``n_out``, ``n_out_divisible``, ``c_dtype``, ``epi_n``,
    ``epi_pad``, ``tile_threads``, which this class sets itself.
    """

    #: drop v92: the producer's spare warps copy A's rows and scales (:mod:`.fp8_gemm_place`; until
    #: drop v94 this default came from the BF16 base class, whose placing variant v94 removed)
    place_a = False

    def __init__(self, activation: str, scale_rows: bool = False, tile_n: Optional[int] = None,
                 num_stages: Optional[int] = None, raster_m: int = 1, overlap_promotion: bool = False,
                 wide_gated: bool = False, cluster_n: int = 1, smem_scales: bool = False,
                 scale_warp: bool = False, deferred_epilogue: bool = False, tanh_sigmoid: bool = False,
                 unit_scales: bool = False, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 swiglu_beta: float = 1.0, swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
                 up_softcap: float = 25.0, stage_guard: bool = False):
        if tile_n is None:
            tile_n = default_tile_n(activation)
        reason = can_implement(activation, 2 * FP8_BLOCK, FP8_BLOCK, 1, tile_n)
        if reason is not None:
            raise ValueError(reason)
        check_activation_constants(activation, swiglu_alpha, swiglu_limit, swiglu_beta, gate_softcap, up_softcap)
        self.gate_softcap, self.up_softcap = float(gate_softcap), float(up_softcap)
        self.swiglu_alpha, self.swiglu_limit, self.swiglu_beta = float(swiglu_alpha), float(swiglu_limit), float(swiglu_beta)
        self.swiglu_limit_after_act = bool(swiglu_limit_after_act)
        self.activation = activation
        self.gated = activation in FP8_GATED
        self.scale_rows = bool(scale_rows)
        self.has_bias = False
        self.raster_m = int(raster_m)
        self.overlap_promotion = bool(overlap_promotion)
        if wide_gated and not self.gated:
            raise ValueError(f"wide_gated needs a gated activation {FP8_GATED}")
        self.wide_gated = bool(wide_gated)
        if cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
        # drop v28: 2 CTAs of a cluster take the two n-tiles of one m-tile and multicast A's halves
        self.cluster_n = int(cluster_n)
        # drop v34: the producer warp stages each k-tile's scales in shared memory with its operands
        self.smem_scales = bool(smem_scales)
        if scale_warp and not smem_scales:
            raise ValueError("scale_warp needs smem_scales")
        # drop v35: a second producer warp stages them instead, so the TMA warp never waits on them
        self.scale_warp = bool(scale_warp)
        if unit_scales and (smem_scales or not overlap_promotion):
            raise ValueError("unit_scales is a way of loading the scales of the plain overlapped kernel: it needs "
                             "overlap_promotion and refuses smem_scales")
        # drop v69: the TMA warp loads the scales of UNIT_SCALE_KC (v106: or 4) k-tiles per copy (:mod:`.unit_scales`)
        self.unit_scales = bool(unit_scales)
        if deferred_epilogue and not self.overlap_promotion:
            raise ValueError("deferred_epilogue needs overlap_promotion")
        # drop v48: a unit's epilogue runs while the next unit's first k-tile is on the tensor cores
        self.deferred_epilogue = bool(deferred_epilogue)
        if tanh_sigmoid and activation != "swiglu":
            raise ValueError("tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu'")
        # drop v50: sigmoid(g) = 0.5 + 0.5 tanh(g / 2), one MUFU op per output instead of two
        self.tanh_sigmoid = bool(tanh_sigmoid)
        self.tile_m = 128
        self.tile_n = tile_n
        self.tile_k = FP8_BLOCK
        self.num_stages_override = num_stages
        # drop v108: one stage fewer where the stage count divides the unrolled k-loop (:func:`guarded_stages`)
        self.stage_guard = bool(stage_guard)
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
        self.n_tiles = n_tiles
        if cutlass.const_expr(self.cluster_n > 1):  # one unit = the cluster's adjacent n-tiles
            if cutlass.const_expr(n_tiles % self.cluster_n != 0):
                raise ValueError(f"cluster_n={self.cluster_n} needs a multiple of {self.cluster_n} n-tiles, got {n_tiles}")
            self.n_tiles = n_tiles // self.cluster_n
        self.k_tiles = k_size // self.tile_k
        # unit_scales: k-tiles per scale chunk (8, or 4 where 8 does not divide K/128: drop v106)
        self.unit_kc = unit_scale_kc(self.k_tiles) if self.unit_scales else 0
        chunk = kernel_overlap_chunk(self.k_tiles, self.unit_scales)
        if cutlass.const_expr(self.unit_scales):  # first: it decides the chunk's multiple (drop v105)
            reason = unit_scales_reason(self.k_tiles, chunk)
            if cutlass.const_expr(reason is not None):
                raise ValueError(reason)
        self.overlap_chunk = chunk if self.overlap_promotion else 0
        if cutlass.const_expr(self.overlap_promotion and self.k_tiles > OVERLAP_MAX_K_TILES
                              and not self.overlap_chunk):
            raise ValueError(f"overlap_promotion: K={k_size} is unrolled up to {OVERLAP_MAX_K_TILES * FP8_BLOCK}, "
                             f"beyond in chunks of an even number of 128-wide k-tiles (K/128 = {self.k_tiles} is odd)")
        if cutlass.const_expr(self.deferred_epilogue and self.overlap_chunk):
            raise ValueError(f"deferred_epilogue runs on the unrolled overlapped schedule (K <= "
                             f"{OVERLAP_MAX_K_TILES * FP8_BLOCK}), not the chunked one (K={k_size})")
        self.n_out_divisible = True
        self.num_stages = self._num_stages(num_experts)
        if cutlass.const_expr(self.stage_guard):
            self.num_stages = guarded_stages(self.num_stages, self.overlap_chunk or self.k_tiles, self.unit_scales)

        (b_layout, tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, tma_atom_a, tma_tensor_a,
         tma_atom_b, tma_tensor_b) = self._operands(mA, mB, self.wide_gated)

        fields = self._storage_fields(num_experts, a_smem_layout, b_smem_layout)
        if cutlass.const_expr(self.smem_scales):  # last, so the other fields keep their offsets
            fields["sScale"] = cute.struct.Align[cute.struct.MemRange[self.acc_dtype, self.num_stages * SCALE_SLOT], 16]
        if cutlass.const_expr(self.unit_scales):  # last too: the chunk buffers, "full" x 2, "empty" x 2
            fields["sUS"] = cute.struct.Align[cute.struct.MemRange[self.acc_dtype, UNIT_SCALE_BUFS * UNIT_SCALE_BUF], 128]
            fields["usbar"] = cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 2 * UNIT_SCALE_BUFS], 8]
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
              tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_mma, us_tma=None,
              place=None):
        """The kernel (traced inline into each variant's ``@cute.kernel``). ``outs``: ``(mC,)``.
        ``us_tma``: ``unit_scales``' ``(atom_as, tma_as, atom_bs, tma_bs)``. ``place``: ``(mX, mIdx,
        mA, mSync, mXScale)`` for the placing variant (``self.place_a``, drop v92,
        :mod:`.fp8_gemm_place`): the producer's warps 1-3 copy A's rows and their scales from the
        source rows by index while warp 0 loads them."""
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
                cnt = warp_inclusive_scan(cnt, lane) + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)

        us, us_bar = None, None  # unit_scales: (atoms, TMA tensors, chunk buffers); "full" x 2, "empty" x 2
        if cutlass.const_expr(self.unit_scales):
            us_bar = storage.usbar.data_ptr()
            if tidx == 0:  # initialised before the pipeline's fence and cluster sync, which cover them
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
                    if cutlass.const_expr(self.place_a):  # this m-tile's rows and scales are written
                        self._wait_rows_placed(place[3], sOff, sCum, expert, row0, row_end, lane)
                    tAsA_p, tAgA = self._a_views(tma_atom_a, mA_tma, tAsA, row0, cta_rank)
                    # smem_scales: lane l stages the scales of tile rows l + 32 j, clamped to
                    # the expert's last row as the consumers did (clamped rows are never stored)
                    sc_rows = None
                    if cutlass.const_expr(self.smem_scales and not self.scale_warp):
                        sc_rows = [cutlass.min(row0 + lane + 32 * j, row_end - 1)
                                   for j in range(self.tile_m // 32)]
                    n0 = self._n0(n_tile)
                    tBsB_p, tBgBs = self._b_views(tma_atom_b, mB_tma, tBsB, n0, expert, cta_rank)
                    for k_tile in range(k_tiles):
                        if cutlass.const_expr(self.unit_scales):  # a chunk's scales, before its first stage
                            if k_tile % self.unit_kc == 0:
                                self._load_unit_scales(us, us_bar,
                                                       us_unit * (k_tiles // self.unit_kc)
                                                       + k_tile // self.unit_kc, row0, expert, n0, lane)
                        if cutlass.const_expr(self.smem_scales and not self.scale_warp):
                            self._stage_scales(ab_pipeline, prod_state, mAScale, mBScale, sScale, sc_rows,
                                               expert, n0, k_tile, lane)
                        else:
                            ab_pipeline.producer_acquire(prod_state)
                        bar = ab_pipeline.producer_get_barrier(prod_state)
                        self._copy_stage(tma_atom_a, tAgA, tAsA_p, tma_atom_b, tBgBs, tBsB_p, k_tile,
                                         prod_state.index, bar)
                        ab_pipeline.producer_commit(prod_state)
                        prod_state.advance()
                    tile_id = tile_id + unit_step
                    if cutlass.const_expr(self.unit_scales):
                        us_unit = us_unit + 1
                if cutlass.const_expr(self.place_a):  # the grid's last TMA warp resets the counters
                    self._finish_placed(place[3], sCum, lane, gdim)
                ab_pipeline.producer_tail(prod_state)
            if cutlass.const_expr(self.place_a):
                if warp_idx > 0:  # the three copying warps
                    self._place_rows(place[0], place[1], place[2], place[3], sOff, sCum, lane, gdim * 3,
                                     scales=(place[4], mAScale))
            if cutlass.const_expr(self.scale_warp):
                if warp_idx == 1:
                    self._scale_producer(ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles, unit0,
                                         unit_step, cta_rank, lane)

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
            us_unit = cutlass.Int32(0)  # unit_scales: units this CTA has computed
            # deferred_epilogue: the unit whose tile waits in ``accs`` to be stored (none yet: 0 rows)
            prev_row0 = cutlass.Int32(0)
            prev_rows = cutlass.Int32(0)
            prev_n0 = cutlass.Int32(0)
            prev_ra_lo = cutlass.Int32(0)
            prev_ra_hi = cutlass.Int32(0)
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
                n0 = self._n0(n_tile)
                sc = (mAScale, mBScale, ra_lo, ra_hi, expert, n0, sScale, r_lo, r_hi)  # for _scales
                usc = None  # unit_scales: (chunk buffers, barriers, the unit's first chunk)
                if cutlass.const_expr(self.unit_scales):
                    usc = (us[4], us_bar, us_unit * (k_tiles // self.unit_kc))
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
                else:
                    acc0 = self._activate(accs, acc_shape, n_elems, mRowScale, ra_lo, ra_hi)
                    self._epilogue([acc0], tCsC, sC, outs[0], row0, rows_left, n0, mma_tidx, epi_barrier)
                if cutlass.const_expr(self.unit_scales):
                    us_unit = us_unit + 1
                tile_id = tile_id + unit_step
            if cutlass.const_expr(self.deferred_epilogue):
                if prev_rows > 0:  # the last unit's tile (none if this CTA had no unit)
                    self._epilogue([self._activate(accs, acc_shape, n_elems, mRowScale, prev_ra_lo, prev_ra_hi)],
                                   tCsC, sC, outs[0], prev_row0, prev_rows, prev_n0, mma_tidx, epi_barrier)


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
        """The tile's outputs from its finished sums ``accs``: the activation (:meth:`_gate` of gate and
        up; wide gated: a new tensor of the tile's ``n_elems`` outputs, else ``accs[0]`` in place), then
        the row scale of the thread's two rows ``ra_lo`` / ``ra_hi`` when ``scale_rows``."""
        acc0 = accs[0]
        if self.wide_gated:
            # output element i (column block i // 4 < 8) = gate element i, up element i + 32
            acc0 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            for i in range(n_elems):
                acc0[i] = self._gate(accs[0][i], accs[0][i + n_elems])
        elif self.gated:
            for i in range(n_elems):
                acc0[i] = self._gate(acc0[i], accs[1][i])
        if self.scale_rows:
            rs_lo = mRowScale[ra_lo]
            rs_hi = mRowScale[ra_hi]
            for i in range(n_elems):
                if (i // 2) % 2 == 0:
                    acc0[i] = acc0[i] * rs_lo
                else:
                    acc0[i] = acc0[i] * rs_hi
        return acc0

    def _gate(self, g, u):
        """The gated activation of one output: swiglu's ``silu(g) * u``, :func:`.grouped_gemm.softcapped_swiglu`
        or :func:`.grouped_gemm.clamped_swiglu`."""
        if self.activation == "swiglu":
            return self._silu(g) * u
        if self.activation == "softcapped_swiglu":
            return softcapped_swiglu(g, u, self.gate_softcap, self.up_softcap)
        return clamped_swiglu(g, u, self.swiglu_alpha, self.swiglu_limit, self.swiglu_beta,
                              self.swiglu_limit_after_act)

    def _silu(self, g):
        """:func:`.grouped_gemm.silu` in this kernel's form (``tanh_sigmoid``, drop v50: one MUFU op
        per output; the epilogue is MUFU-bound)."""
        return silu(g, self.tanh_sigmoid)

    def _n0(self, n_tile):
        """First output column (of ``n_out``) of scheduled unit ``n_tile``."""
        return n_tile * self.tile_n

    @cute.jit
    def _scale_producer(self, ab_pipeline, mAScale, mBScale, sScale, sOff, sCum, total_tiles, unit0, unit_step,
                        cta_rank, lane):
        """scale_warp (drop v35): producer warp 1 walks the TMA warp's schedule (same units and
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
            n0 = self._n0(n_tile)
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
            c0 = c0 + chunk * (chunk_k_tiles // self.unit_kc)
        return sUS, us_bar, c0 + t // self.unit_kc, t % self.unit_kc

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
