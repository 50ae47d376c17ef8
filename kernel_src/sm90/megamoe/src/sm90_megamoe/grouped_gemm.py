"""Varlen-M grouped GEMM for MoE experts on SM90 (H100/H200), written in CuTeDSL.

One kernel computes, for every expert ``e`` with rows ``[offsets[e], offsets[e+1])`` of A::

    identity        C[rows]      = H                        H = A[rows] @ B[e]^T (+ bias[e])
    squared_relu    C[rows]      = relu(H) ** 2
    swiglu          C[rows, :I]  = silu(G) * U              G = H[:, :I], U = H[:, I:]
    gelu_glu        C[rows, :I]  = gelu(G) * U              (erf form)
    clamped_swiglu  C[rows, :I]  = (clamp(U, -l, l) + beta) * G' * sigmoid(alpha * G'),  G' = min(G, l)
                    (after_act: (clamp(U, -l, l) + beta) * min(G * sigmoid(alpha * G), l))
    softcapped_swiglu  C[rows, :I] = cg * tanh(G / cg) * sigmoid(G) * cu * tanh(U / cu)   (drop v103)
    gelu_tanh_glu   C[rows, :I]  = gelu_tanh(G) * U         (tanh form, Gemma 4; drop v109)
    (scale_rows)    C[m, :]     *= row_scale[m]             (after the activation)

BF16 in, FP32 accumulate, BF16 out. The routing histogram (``offsets``) lives in device memory
and is walked by the tile scheduler inside the kernel, so one compiled kernel serves every
histogram: no host sync, no recompile.

Design
------
* Persistent grid of ``max_active_ctas`` CTAs (normally one per SM). Each CTA reads ``offsets``
  once into shared memory and builds the prefix sum of per-expert m-tile counts (one warp, shuffle
  scan). Expert ``e`` owns the linear tiles ``[cum[e] * n_tiles, cum[e+1] * n_tiles)``; inside it
  the m-tiles go in groups of ``raster_m`` with the m-tile as the fast index, so the CTAs running
  at the same time share a weight N-panel (read from DRAM once per group instead of once per
  m-tile; Mixtral FC1 reads its 235 MB expert weights once, not 16 times) and the group's A rows
  stay in L2 while the n-tiles sweep past. ``raster_m = 1`` is the plain n-fast order.
* A is read through ONE TMA descriptor over the whole ragged ``[M_total, K]`` tensor; a tile starts
  at row ``offsets[e] + m_tile * tile_m`` (``cute.domain_offset``). Rows past ``M_total`` are
  zero-filled by TMA; rows of the next expert that fall in the tile are computed but never stored.
* B is read through a TMA descriptor over ``[E, N, K]`` with the expert as the third coordinate.
* Warp specialization: warpgroup 0 = producer (one warp issues TMA into a ``num_stages`` deep
  ``PipelineTmaAsync``), warpgroups 1 and 2 = consumers with fp32 accumulators in registers;
  setmaxnreg 40 / 232. Two schedules (compile time):
  ``cooperative`` -- both consumers work on one 128-row tile, 64 rows each (WGMMA 64 x tile_n);
  ``pingpong`` -- each consumer owns every other tile of the CTA (all 128 rows, two 64-row
  WGMMAs) and consumes only that tile's pipeline stages. The producer fills stages in tile order,
  so one consumer's mainloop runs while the other's epilogue stores its tile: the tensor cores do
  not idle through epilogues, which pays most when K is short (FC2, K = I). A warpgroup holds the
  whole 128 x (num_b tile_n) accumulator, so num_b tile_n <= 192 (drop v71; was 128): 192 fp32
  registers of the 232 a consumer thread gets, no spills (ptxas). Qwen3's FC2 (K 768) with
  128 x 192 tiles: 0.348-0.351 ms against 0.366-0.368 for cooperative 128 x 256 (H200, topk8
  routing); on Mixtral's FC2 (K 14336) 0.79-0.83x, so the host picks it by K.
  ``wide`` (gated activations, drop v22) -- cooperative, and each consumer issues ONE
  m64 x (2 tile_n) WGMMA per k-block over the stage's gate and up slots (adjacent in smem: the
  same bytes as one 2 tile_n-row tile) instead of two m64 x tile_n ones: the A fragment is read
  from shared memory once per k-block, not twice. The accumulator's first half is the gate, the
  second the up tile (same element order), so the epilogue is the cooperative one.
* Gated mapping (swiglu, gelu_glu, clamped_swiglu, softcapped_swiglu): an output tile covers columns ``[n0, n0+bn)``
  of C. Every pipeline stage holds one A box (tile_m x tile_k) and TWO B boxes: w13 rows
  ``[n0, n0+bn)`` (gate) in B slot ``2*stage`` and rows ``[I+n0, I+n0+bn)`` (up, an element
  coordinate: I need not be a multiple of the tile) in slot ``2*stage+1``. Each consumer keeps two
  accumulators (gate, up) with identical register layouts, so the epilogue pairs element ``i`` of
  one with element ``i`` of the other. In the last tile of a ragged I, gate columns past I hold up
  rows and up columns past 2I are TMA zero fill: computed, never stored.
* Epilogue: bias, activation and row scale in fp32 registers, convert to bf16, stage 64-column chunks
  through a padded smem buffer (conflict-free 32-bit writes), then predicated, coalesced 16-byte
  global stores (row < expert end, col < N_out); a warp writes whole 128-byte row segments.
  (``epilogue="direct"`` stores 32-bit pairs straight from registers: ~25% slower at K=768.)
  The producer warp keeps prefetching the next tile's stages meanwhile.
* ``tanh_sigmoid`` (drop v52; swiglu): silu(g) = h + h tanh(h), h = g / 2, with one ``tanh.approx``
  (one MUFU op per output instead of ``ex2`` + ``rcp``: the SwiGLU epilogue is MUFU-bound while the
  tensor pipe waits). Relative error ~2^-11, below the bf16 rounding of the output; not the same bits.
* ``cluster_m=2`` (drop v29; cooperative / wide): clusters of 2 CTAs. The scheduler counts m-tile
  pairs per expert; CTA r of a cluster computes m-tile ``2 p + r`` of pair p and loads half of
  each stage's weight tile by a multicast TMA into both CTAs, whose consumer warps all release the
  stage. An odd count's last (lone) m-tile pairs with the next expert's lone one (drop v96; until
  v95 it shared a pair with an empty tile): in such a pair each CTA loads its own expert's whole
  weight tile for itself, and the unit comes right after the second expert's pairs, while both
  experts' weights are still in L2 (:meth:`_pair_tile`). The launch clamps its grid to the clusters
  that fit at once. Same WGMMAs per tile: the same bits as single CTAs.
* ``cluster_n=2`` (drop v72; non-gated, cooperative / pingpong): clusters of 2 CTAs along N, as the
  FP8 kernel's (drop v28). A unit is an n-tile pair of one m-tile; CTA r computes n-tile
  ``2 u + r`` (for an odd n-tile count the last pair's second tile lies past N: computed, never
  stored) and loads half of each stage's A tile by a multicast TMA into both CTAs. Pingpong FC2
  with 128 x 208 tiles and A multicast is what SonicMoE's autotuner picks for Qwen3; here with
  the 128 x 192 tiles of drop v71. Same WGMMAs per tile: the same bits as single CTAs.
  (Drop v86 removed v46's ``half_tiles``, the cooperative form of a tile of <= 64 rows split along
  N: bit-identical on the H200 but the layer 4-7% slower, seventeenth session. Drop v89 removed
  v78's ``m64_tails``, its pingpong form, one 64-row WGMMA per k-block for such a tile: the same
  bits, Nemotron's layer 5-9% slower with or without v79's jump, thirty-third / thirty-fifth
  sessions. Drop v94 removed v91's ``place_a``, whose producer's spare warps wrote the grouped rows
  ``xs = x[idx]`` while the kernel ran: the same bits, the layer no faster on the H200 in five
  interleaved rounds and 5% slower on the H100, 39th-41st sessions.)
* ``jump_stages`` (drop v79; pingpong): after each tile a warpgroup skips the other warpgroup's
  tile's ``k_tiles`` stages of the ring. Without it that is ``k_tiles`` single advances of the read
  and release states, unrolled (two compares and selects each: ~300 SASS instructions per tile at
  K = 2688, 16% of Nemotron's FC1 kernel); with it, one index / phase computation per state
  (``PipelineState.advance(k_tiles)``). The same stages, in the same order: the same bits.

Tensors (torch view; all contiguous, 16-byte aligned base pointers)
-------------------------------------------------------------------
    mA        [M_total, K]      bf16   rows grouped by expert, M_total dynamic (>= 0)
    mB        [E, N, K]         bf16   per-expert nn.Linear weight; swiglu: N = 2*I, gate rows first
    mC        [M_total, N_out]  bf16   N_out = N (identity, squared_relu) or I = N // 2 (swiglu)
    mOffsets  [E + 1]           int32  device memory, offsets[0] = 0, offsets[E] = M_total
    mRowScale [M_total]         fp32   read only when scale_rows=True (else any fp32 tensor)
    mBias     [E, N]            fp32 or bf16, read only when has_bias=True (else any such tensor);
                                       added to A @ B[e]^T before the activation (gated: gate
                                       bias in columns [0, I), up bias in [I, 2I))
    max_active_ctas             int32  grid size (persistent CTAs)
Static (compile key): K, N, E, activation (+ alpha, limit), tile sizes, raster_m, scale_rows,
has_bias and the bias dtype. Requirements: K % 8 == 0, N_out % 8 == 0.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

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
from .warp_scan import warp_inclusive_scan
from .constants import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    MAX_RASTER_M,
    DEFAULT_RASTER_M,
    ALIGN_K_ELEMS,
    ALIGN_N_ELEMS,
    DEFAULT_TILE_K,
    DEFAULT_TILE_M,
    DEFAULT_TILE_N,
    MAX_EXPERTS,
)

try:  # newer location; the old one still works but warns
    from cutlass.tensor_utils import LayoutEnum
except Exception:  # pragma: no cover
    from cutlass.utils import LayoutEnum

try:
    from cutlass.memory import get_smem_capacity_in_bytes
except Exception:  # pragma: no cover
    from cutlass.utils import get_smem_capacity_in_bytes

_LOG2E = 1.4426950408889634
_RSQRT2 = 0.7071067811865476


@dsl_user_op
def tanh_approx(v, *, loc=None, ip=None):
    """``tanh.approx.f32`` of ``v``: one MUFU operation (max relative error about 2^-11)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip)],
                                           "tanh.approx.f32 $0, $1;", "=f,f",
                                           has_side_effects=False, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


def silu(g, tanh_sigmoid: bool):
    """silu(g) = g * sigmoid(g) in float32, traced inline: ``ex2`` + ``rcp`` (two MUFU ops), or with
    ``tanh_sigmoid`` (drops v50 / v52) h + h tanh(h) with h = g / 2 (one MUFU op). The one form every
    swiglu epilogue of the drop uses (BF16 128-row and swap-AB, FP8)."""
    if tanh_sigmoid:
        h = g * cutlass.Float32(0.5)
        return h + h * tanh_approx(h)
    den = cutlass.Float32(1.0) + cute.math.exp2(-g * _LOG2E, fastmath=True)
    return g * cute.arch.rcp_approx(den)


#: gelu_tanh(g) = g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3): ex2's argument is
#: -g (GELU_TANH_C1 + GELU_TANH_C3 g^2), i.e. -2 z log2(e)
GELU_TANH_C1 = 2.0 * 0.7978845608028654 * _LOG2E
GELU_TANH_C3 = GELU_TANH_C1 * 0.044715


def gelu_tanh(g):
    """torch's ``gelu(g, approximate="tanh")`` = ``0.5 g (1 + tanh(z))`` in float32, traced inline, as
    the equal ``g * sigmoid(2 z)`` = ``g / (1 + 2^(-2 z log2 e))``: ``ex2`` + ``rcp`` (two MUFU ops,
    relative error ~1e-7) with no cancellation where ``1 + tanh(z)`` is tiny (large negative g: ex2
    overflows to inf and the result is -0). The one form every gelu_tanh_glu epilogue of the drop
    uses (BF16 128-row and swap-AB; drop v109)."""
    t = g * g
    arg = g * (cutlass.Float32(-GELU_TANH_C1) - cutlass.Float32(GELU_TANH_C3) * t)
    den = cutlass.Float32(1.0) + cute.math.exp2(arg, fastmath=True)
    return g * cute.arch.rcp_approx(den)


def clamped_swiglu(g, u, alpha: float, limit: float, beta: float, after_act: bool = False):
    """``(clamp(u, -limit, limit) + beta) * g' * sigmoid(alpha * g')``, ``g' = min(g, limit)``, in
    float32, traced inline: the sigmoid from ``ex2`` + ``rcp`` (two MUFU ops); beta 0 compiles no add.
    ``after_act`` (drop v102; Step-3.7 / Bailing): the gate is clamped after the activation instead,
    ``(clamp(u, -limit, limit) + beta) * min(g * sigmoid(alpha * g), limit)``.
    The one form every clamped_swiglu epilogue of the drop uses (BF16 128-row and swap-AB, FP8);
    ``alpha``, ``limit``, ``beta`` and ``after_act`` are compile-time values."""
    lim = cutlass.Float32(limit)
    if not after_act:
        g = cute.arch.fmin(g, lim)
    u = cute.arch.fmax(cute.arch.fmin(u, lim), -lim)
    # g * sigmoid(alpha * g) = g / (1 + 2^(-alpha*g*log2(e)))
    den = cutlass.Float32(1.0) + cute.math.exp2(g * cutlass.Float32(-alpha * _LOG2E), fastmath=True)
    if beta != 0.0:  # gpt-oss's + 1; DeepSeek-V4 / GLM-5 / Hunyuan-V4 / Step-3.7 add nothing
        u = u + cutlass.Float32(beta)
    if after_act:
        return u * cute.arch.fmin(g * cute.arch.rcp_approx(den), lim)
    return u * g * cute.arch.rcp_approx(den)


def softcapped_swiglu(g, u, gate_softcap: float, up_softcap: float):
    """``gate_softcap * tanh(g / gate_softcap) * sigmoid(g) * up_softcap * tanh(u / up_softcap)`` (drop
    v103; Inkling2: the sigmoid sees the raw gate, the caps bound the linear gate factor and ``up``)
    in float32, traced inline: three ``tanh.approx`` (MUFU) ops, the sigmoid as ``(1 + tanh(g / 2)) / 2``.
    The caps are compile-time values."""
    half = cutlass.Float32(0.5)
    sig = half + half * tanh_approx(g * half)
    tg = tanh_approx(g * cutlass.Float32(1.0 / gate_softcap))
    tu = tanh_approx(u * cutlass.Float32(1.0 / up_softcap))
    return cutlass.Float32(gate_softcap * up_softcap) * tg * tu * sig


def check_activation_constants(activation: str, alpha: float, limit: float, beta: float,
                            gate_softcap: float = 4.0, up_softcap: float = 25.0) -> None:
    """The gated activations' constants (clamped_swiglu's, softcapped_swiglu's caps), checked when a
    kernel is constructed (every GEMM of the drop)."""
    if activation == "clamped_swiglu" and not (float(limit) > 0.0 and math.isfinite(limit)
                                               and math.isfinite(alpha) and math.isfinite(beta)):
        raise ValueError("clamped_swiglu needs a finite swiglu_limit > 0 and a finite swiglu_alpha "
                         "and swiglu_beta")
    if activation == "softcapped_swiglu" and not all(float(c) > 0.0 and math.isfinite(c)
                                                     for c in (gate_softcap, up_softcap)):
        raise ValueError(f"softcapped_swiglu needs finite gate_softcap and up_softcap > 0, got "
                         f"{gate_softcap} and {up_softcap}")


def check_bf16_operands(mA, mB, mC, mOffsets, mBias) -> None:
    """The BF16 GEMMs' operand dtypes, checked at compile time (this kernel and the swap-AB one,
    :mod:`.swapab_gemm`): bf16 A, B and C, int32 offsets, a float32 or bf16 bias tensor."""
    if mA.element_type != cutlass.BFloat16 or mB.element_type != cutlass.BFloat16:
        raise TypeError("A and B must be bfloat16")
    if mC.element_type != cutlass.BFloat16:
        raise TypeError("C must be bfloat16")
    if mOffsets.element_type != cutlass.Int32:
        raise TypeError("offsets must be int32")
    if mBias.element_type not in (cutlass.Float32, cutlass.BFloat16):
        raise TypeError("bias must be float32 or bfloat16")


class GroupedGemmSm90:
    """Varlen-M grouped GEMM (see module docstring for semantics and layouts).

    :param activation: one of ``ACTIVATIONS`` (compile time).
    :param tile_n: output tile width (accumulator width is 2*tile_n when gated). 16..256, %16.
    :param scale_rows: multiply output row m by row_scale[m] (fp32) in the epilogue.
    :param has_bias: add bias[e, col] (fp32 or bf16, from the tensor) before the activation.
    :param raster_m: m-tiles per raster group inside an expert (see the module docstring).
    :param swiglu_alpha, swiglu_limit, swiglu_beta: clamped_swiglu's constants (gpt-oss: 1.702, 7.0,
        1.0; DeepSeek-V4: 1.0, its limit, 0.0). Drop v99 added beta (1.0 before).
    :param swiglu_limit_after_act: clamped_swiglu clamps the gate after the activation (Step-3.7 /
        Bailing: ``min(silu(g), limit)``); drop v102 (False before).
    :param gate_softcap, up_softcap: softcapped_swiglu's caps (Inkling2: 4.0, 25.0); drop v103.
    :param tile_m: 128 (two consumer warpgroups of 64 rows).
    :param tile_k: 64 (one 128-byte swizzle atom of bf16).
    :param num_stages: smem pipeline depth; None = as many as fit.
    :param epilogue: "smem" (default; stage through smem, coalesced 16-byte stores) or "direct"
        (predicated 32-bit stores straight from the accumulator registers, no smem).
    :param tanh_sigmoid: swiglu only (drop v52): the sigmoid from one ``tanh.approx`` (module docstring).
    :param jump_stages: pingpong only (drop v79): skip the other warpgroup's stages in one step.
    """

    gather_a = False  # drop v23: A rows gathered by index (:class:`.grouped_gemm_gather.GroupedGemmGatherSm90`)
    #: CTAs per cluster along M (drop v29: 2 = one m-tile pair per cluster, B multicast; set in __init__)
    cluster_m = 1
    #: CTAs per cluster along N (drop v72: 2 = one n-tile pair per cluster, A multicast; set in __init__)
    cluster_n = 1

    @property
    def ctas_per_cluster(self) -> int:
        """CTAs per cluster: ``cluster_m * cluster_n`` (at most one of them is 2)."""
        return self.cluster_m * self.cluster_n
    #: drop v52: swiglu's sigmoid from one tanh.approx (set in __init__)
    tanh_sigmoid = False
    #: drop v79: pingpong skips the other warpgroup's stages in one step (set in __init__)
    jump_stages = False
    #: drop v112: "publish" (FC1) / "await" (FC2) of :mod:`.grouped_gemm_handoff`; None: the plain kernel
    handoff = None
    #: drop v114: the producer warp claims the CTA's tiles and hands them to the consumers through a
    #: shared-memory ring (the awaiting FC2 in single CTAs); False: every ``gdim``-th tile
    dynamic_tiles = False

    def __init__(
        self,
        activation: str,
        tile_n: Optional[int] = None,
        scale_rows: bool = False,
        has_bias: bool = False,
        raster_m: int = DEFAULT_RASTER_M,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        swiglu_beta: float = 1.0,
        swiglu_limit_after_act: bool = False,
        gate_softcap: float = 4.0,
        up_softcap: float = 25.0,
        tile_m: int = DEFAULT_TILE_M,
        tile_k: int = DEFAULT_TILE_K,
        num_stages: Optional[int] = None,
        epilogue: str = "smem",
        schedule: str = "cooperative",
        cluster_m: int = 1,
        tanh_sigmoid: bool = False,
        cluster_n: int = 1,
        jump_stages: bool = False,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if tanh_sigmoid and activation != "swiglu":
            raise ValueError("tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu'")
        self.tanh_sigmoid = bool(tanh_sigmoid)
        if tile_n is None:
            tile_n = DEFAULT_TILE_N[activation]
        if tile_m != 128:
            raise ValueError("tile_m must be 128 (2 consumer warpgroups x 64 rows)")
        if tile_k != 64:
            raise ValueError("tile_k must be 64")
        # one WGMMA N per accumulator: <= 256 and a multiple of 16 (8 works but wastes issue slots)
        if tile_n % 16 != 0 or not (16 <= tile_n <= 256):
            raise ValueError("tile_n must be a multiple of 16 in [16, 256]")
        if not (1 <= int(raster_m) <= MAX_RASTER_M):
            raise ValueError(f"raster_m must be in [1, {MAX_RASTER_M}], got {raster_m}")
        check_activation_constants(activation, swiglu_alpha, swiglu_limit, swiglu_beta, gate_softcap, up_softcap)
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        self.has_bias = bool(has_bias)
        self.raster_m = int(raster_m)
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.swiglu_beta = float(swiglu_beta)
        self.swiglu_limit_after_act = bool(swiglu_limit_after_act)
        self.gate_softcap, self.up_softcap = float(gate_softcap), float(up_softcap)
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.tile_k = tile_k
        self.scale_rows = bool(scale_rows)
        self.num_stages_override = num_stages
        if epilogue not in ("smem", "direct"):
            raise ValueError("epilogue must be 'smem' (staged, coalesced 16 B stores) or 'direct'")
        self.epilogue = epilogue
        # B boxes (and accumulators) per stage: gated activations keep gate and up side by side
        self.num_b = 2 if self.gated else 1
        if schedule not in ("cooperative", "pingpong", "wide"):
            raise ValueError("schedule must be 'cooperative', 'pingpong' or 'wide'")
        self.pingpong = schedule == "pingpong"
        self.wide = schedule == "wide"
        self.schedule = schedule
        if schedule == "wide" and not (self.gated and 2 * tile_n <= 256 and epilogue == "smem"):
            raise ValueError(f"schedule 'wide' needs a gated activation, tile_n <= 128 (one WGMMA of "
                             f"N = 2 * tile_n <= 256) and the smem epilogue, got {activation!r}, tile_n "
                             f"{tile_n}, epilogue {epilogue!r}")
        if self.pingpong and self.num_b * tile_n > 192:
            # one warpgroup holds the whole 128 x (num_b * tile_n) accumulator: 192 fp32 regs of
            # 232 (256 spill)
            raise ValueError(f"pingpong needs num_b * tile_n <= 192 (accumulator registers), got "
                             f"{self.num_b} x {tile_n}")
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m}")
        if cluster_m > 1 and (self.pingpong or self.gather_a):
            raise ValueError("cluster_m = 2 is for the TMA kernel's cooperative / wide schedules "
                             "(not pingpong, not gather_a)")
        if cluster_m > 1:  # drop v29: the pair's CTAs take B's halves and multicast them
            self.cluster_m = 2

        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.BFloat16
        self.c_dtype = cutlass.BFloat16
        # cooperative: the two consumer warpgroups split a tile's rows; pingpong: one per tile
        self.atom_layout_mnk = (1, 1, 1) if self.pingpong else (2, 1, 1)
        self.num_mma_wg = 2
        self.tile_threads = 128 if self.pingpong else 256  # threads that own one output tile
        self.num_epi_bufs = 2 if self.pingpong else 1
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
        self.num_mma_warps = self.num_mma_wg * 4
        self.stage_consumer_warps = self.tile_threads // 32  # warps that release each stage
        self.load_regs = 40
        self.mma_regs = 232
        self.smem_capacity = get_smem_capacity_in_bytes("sm_90")
        # epilogue staging: the 128 x tile_n output tile goes through smem in column chunks of
        # epi_n so that global stores are full 16-byte vectors covering whole 128-byte lines
        self.epi_n = 64 if tile_n % 64 == 0 else tile_n
        self.epi_pad = 8  # row pitch epi_n + 8 elements: conflict-free 32-bit fragment writes
        self.epi_smem_elems = self.tile_m * (self.epi_n + self.epi_pad)
        if cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
        if cluster_n > 1 and (self.gated or self.wide or self.cluster_m > 1 or self.gather_a):
            raise ValueError("cluster_n = 2 is for the non-gated TMA kernel's cooperative / pingpong schedules "
                             "(not gated, not with cluster_m or gather_a)")
        if cluster_n > 1:  # drop v72: the pair's CTAs take A's halves and multicast them
            self.cluster_n = 2
        if jump_stages and not self.pingpong:
            raise ValueError(f"jump_stages is for the pingpong schedule (a warpgroup skips the other's "
                             f"stages), got schedule {schedule!r}")
        self.jump_stages = bool(jump_stages)

    # ------------------------------------------------------------------ host helpers
    def static_shapes(self, n: int, k: int) -> Tuple[int, int]:
        """(N_out, n_tiles) for a weight with N rows and K columns; validates alignment."""
        if k % ALIGN_K_ELEMS != 0:
            raise ValueError(f"K={k} must be a multiple of {ALIGN_K_ELEMS}")
        if self.gated:
            if n % 2 != 0:
                raise ValueError(f"{self.activation} needs an even N (= 2 * I)")
            n_out = n // 2
        else:
            n_out = n
        n_tiles = (n_out + self.tile_n - 1) // self.tile_n
        if n_out % ALIGN_N_ELEMS != 0:
            raise ValueError(f"N_out={n_out} must be a multiple of {ALIGN_N_ELEMS}")
        return n_out, n_tiles

    def _num_stages(self, num_experts: int) -> int:
        per_stage = (self.tile_m + self.num_b * self.tile_n) * self.tile_k * 2
        reserved = 1024 + 8 * (num_experts + 2) + 1024  # mbarriers, scheduler arrays, slack
        if self.cluster_m > 1:  # drop v96: the lone m-tiles' prefix sums
            reserved += 4 * (num_experts + 1)
        reserved += self.epi_smem_elems * 2 * self.num_epi_bufs
        stages = (self.smem_capacity - reserved) // per_stage
        stages = min(stages, 8)
        if self.num_stages_override is not None:
            stages = min(stages, self.num_stages_override)
        if stages < 2:
            raise ValueError("tile too large: fewer than 2 pipeline stages fit in shared memory")
        return stages

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._check_inputs(mA, mB, mC, mOffsets, mBias)
        setup = self._setup(mA, mB, mOffsets)
        self._launch(self.kernel(setup[0], setup[1], setup[2], setup[3], mC, mOffsets, mRowScale, mBias, *setup[4:]),
                     max_active_ctas, stream)

    def _check_inputs(self, mA, mB, mC, mOffsets, mBias) -> None:
        """The operands' dtypes (compile time; shared by the variants): :func:`check_bf16_operands`."""
        check_bf16_operands(mA, mB, mC, mOffsets, mBias)

    def _launch(self, kernel, max_active_ctas, stream) -> None:
        """One persistent CTA per ``max_active_ctas``, launched with PDL like every kernel of the drop."""
        kernel.launch(
            grid=[max_active_ctas // self.ctas_per_cluster * self.ctas_per_cluster, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=[self.ctas_per_cluster, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=PDL,
        )

    @cute.jit
    def _setup(self, mA: cute.Tensor, mB: cute.Tensor, mOffsets: cute.Tensor):
        """Host-side (traced) set-up shared by the variants: the problem's compile-time sizes, the
        TMA atoms, MMAs and smem layouts. Returns ``(tma_atom_a, tma_tensor_a, tma_atom_b,
        tma_tensor_b, tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, b_smem_layout_main)``."""
        num_experts = cute.size(mOffsets, mode=[0]) - 1
        n_rows_b = cute.size(mB, mode=[1])
        k_size = cute.size(mB, mode=[2])
        if cutlass.const_expr(num_experts > MAX_EXPERTS):
            raise ValueError(f"at most {MAX_EXPERTS} experts")
        n_out, n_tiles = self.static_shapes(n_rows_b, k_size)
        self.num_experts = num_experts
        self.n_out = n_out
        self.n_tiles = n_tiles
        self.k_tiles = (k_size + self.tile_k - 1) // self.tile_k
        self.n_out_divisible = n_out % self.tile_n == 0
        if cutlass.const_expr(self.cluster_n > 1):  # drop v72: one unit = the cluster's adjacent n-tiles
            self.n_out_divisible = self.n_out_divisible and n_tiles % self.cluster_n == 0
            self.n_tiles = (n_tiles + self.cluster_n - 1) // self.cluster_n
        self.num_stages = self._num_stages(num_experts)

        (b_layout, tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, tma_atom_a, tma_tensor_a,
         tma_atom_b, tma_tensor_b) = self._operands(mA, mB, self.wide)
        # wide: slots 2s and 2s + 1 (tile_n rows of 128 bytes each, 8-row swizzle atoms) are the
        # same bytes as one 2 tile_n-row tile of stage s: the mainloop's view of B
        b_smem_layout_main = b_smem_layout
        if cutlass.const_expr(self.wide):
            b_smem_layout_main = sm90_utils.make_smem_layout_b(
                b_layout, (self.tile_m, 2 * self.tile_n, self.tile_k), self.ab_dtype, self.num_stages
            )
        # cute.struct reads a class's annotations: build the class from the field table
        self.shared_storage = cute.struct(type("SharedStorage", (), {
            "__annotations__": self._storage_fields(num_experts, a_smem_layout, b_smem_layout)}))
        return (tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tiled_mma, tiled_mma_epi, a_smem_layout,
                b_smem_layout, b_smem_layout_main)

    def _operands(self, mA: cute.Tensor, mB: cute.Tensor, wide: bool):
        """The operand set-up this kernel and the FP8 one (:mod:`.fp8_gemm`) share (traced inline):
        B viewed as (N, K, E) so the expert is the third TMA coordinate; the tiled MMA (``wide``: one
        WGMMA of N = 2 tile_n over a stage's gate and up slots) and its twin over one epi_n-wide
        chunk (same C layout: it partitions the epilogue's staging buffer); A's and B's smem layouts
        (B: ``num_b`` slots per stage; swiglu: slots 2s gate, 2s + 1 up); their TMA atoms (A
        multicast over a ``cluster_n`` pair, B over a ``cluster_m`` pair). Returns ``(b_layout, tiled_mma, tiled_mma_epi, a_smem_layout,
        b_smem_layout, tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b)``."""
        mB_nke = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 2, 0]))
        a_layout = LayoutEnum.from_tensor(mA)
        b_layout = LayoutEnum.from_tensor(mB_nke)
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.tile_n * (2 if wide else 1)),
        )
        tiled_mma_epi = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.epi_n),
        )
        a_smem_layout = sm90_utils.make_smem_layout_a(a_layout, tile_mnk, self.ab_dtype, self.num_stages)
        b_smem_layout = sm90_utils.make_smem_layout_b(b_layout, tile_mnk, self.ab_dtype, self.num_stages * self.num_b)
        tma_atom_a, tma_tensor_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_n > 1 else cpasync.CopyBulkTensorTileG2SOp(),
            mA, cute.slice_(a_smem_layout, (None, None, 0)), (self.tile_m, self.tile_k),
            **({"num_multicast": self.cluster_n} if self.cluster_n > 1 else {}),
        )
        tma_atom_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1 else cpasync.CopyBulkTensorTileG2SOp(),
            mB_nke, cute.slice_(b_smem_layout, (None, None, 0)), (self.tile_n, self.tile_k),
            **({"num_multicast": self.cluster_m} if self.cluster_m > 1 else {}),
        )
        return (b_layout, tiled_mma, tiled_mma_epi, a_smem_layout, b_smem_layout, tma_atom_a, tma_tensor_a,
                tma_atom_b, tma_tensor_b)

    def _storage_fields(self, num_experts: int, a_smem_layout, b_smem_layout) -> dict:
        """The shared-storage fields this kernel and the FP8 one share, in order (the FP8 variants
        append theirs after them, so these keep their offsets): the stage barriers, the scheduler's
        offsets and m-tile prefix sums, A's and B's stages, the epilogue's staging buffer(s)."""
        fields = {
            "mbar": cute.struct.MemRange[cutlass.Int64, self.num_stages * 2],
            # offsets[0..E] and inclusive prefix sum of m-tiles per expert
            "sched_off": cute.struct.MemRange[cutlass.Int32, num_experts + 1],
            "sched_cum": cute.struct.MemRange[cutlass.Int32, num_experts + 1],
            "sA": cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_layout)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_layout)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[self.c_dtype, self.epi_smem_elems * self.num_epi_bufs], 128],
        }
        if self.cluster_m > 1:  # drop v96: lone m-tiles before each expert, [0..E] (:meth:`_pair_tile`)
            fields["sched_lone"] = cute.struct.MemRange[cutlass.Int32, num_experts + 1]
        return fields

    # ------------------------------------------------------------------ scheduler helper
    @cute.jit
    def _locate(
        self,
        sOff: cute.Tensor,
        sCum: cute.Tensor,
        tile_id: cutlass.Int32,
        expert: cutlass.Int32,
    ):
        """Map linear tile ``tile_id`` to its expert (advancing ``expert``, monotonic per CTA),
        m-tile and n-tile in the grouped raster.

        Returns (expert, first row of the tile, end row of the expert, n-tile). With ``cluster_m``
        = 2 the m-tiles are pairs (256 rows): the row is the pair's first; with ``cluster_n`` = 2
        the "n-tile" is an n-tile pair (``self.n_tiles`` counts pairs then)."""
        n_tiles = self.n_tiles
        m_tile_global = tile_id // n_tiles
        e = expert
        while sCum[e + 1] <= m_tile_global:
            e = e + 1
        m_tiles_e = sCum[e + 1] - sCum[e]
        local = tile_id - sCum[e] * n_tiles
        m_local = m_tile_global - sCum[e]
        n_tile = tile_id % n_tiles
        if cutlass.const_expr(self.raster_m > 1):
            group_tiles = self.raster_m * n_tiles
            g = local // group_tiles
            g_rows = cutlass.min(self.raster_m, m_tiles_e - g * self.raster_m)
            r = local - g * group_tiles
            m_local = g * self.raster_m + r % g_rows
            n_tile = r // g_rows
        row0 = sOff[e] + m_local * (self.tile_m * self.cluster_m)
        return e, row0, sOff[e + 1], n_tile

    @cute.jit
    def _pair_tile(self, sOff: cute.Tensor, sLone: cute.Tensor, expert: cutlass.Int32, row0: cutlass.Int32,
                   row_end: cutlass.Int32, cta_rank: cutlass.Int32):
        """``cluster_m`` = 2 (drop v96): this CTA's tile of the unit :meth:`_locate` mapped to ``(expert,
        row0, row_end)``. Returns ``(shared, tile_expert, tile_row0, tile_row_end)``.

        ``shared``: an m-tile pair of ``expert`` (both tiles hold rows); this CTA's tile is the pair's
        ``cta_rank``-th and the two CTAs load half of the weight tile each, multicast into both. Else a
        lone pair: the lone (last, odd) m-tiles 2q and 2q + 1 of all experts in order, the second (or,
        for the last lone tile of all when it is unpaired, the first) being ``expert``'s; each CTA loads
        its own expert's whole weight tile for itself. A CTA without a tile (that unpaired case)
        repeats its peer's and stores nothing (``tile_row_end`` = ``tile_row0``). Up to drop v95 the
        lone tile shared its expert's last pair with an empty tile, which computed and stored nothing:
        at Qwen3's ~4.5 m-tiles per expert a tenth of the clusters' tiles."""
        shared = row0 + self.tile_m < row_end
        tile_expert = expert
        tile_row0 = row0 + cta_rank * self.tile_m
        tile_row_end = row_end
        if not shared:
            n_lone = sLone[self.num_experts]
            j = (sLone[expert + 1] - 1) // 2 * 2 + cta_rank  # this CTA's lone tile, in expert order
            jj = cutlass.min(j, n_lone - 1)
            e = expert
            while sLone[e] > jj:  # sLone[e] lone tiles lie before expert e
                e = e - 1
            tile_expert = e
            tile_row0 = sOff[e] + (sOff[e + 1] - sOff[e] - 1) // self.tile_m * self.tile_m
            tile_row_end = sOff[e + 1]
            if j != jj:
                tile_row_end = tile_row0
        return shared, tile_expert, tile_row0, tile_row_end

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_main: cute.ComposedLayout,
    ):
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffsets, mRowScale, mBias, tiled_mma, tiled_mma_epi,
                   a_smem_layout, b_smem_layout, b_smem_layout_main)

    @cute.jit
    def _body(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_main: cute.ComposedLayout,
        gather=None,
        tails=None,
        handoff=None,
    ):
        """The kernel (traced inline into each variant's ``@cute.kernel``). ``gather``: ``(mA,
        mIdx)`` for the gathering variant (``self.gather_a``, :mod:`.grouped_gemm_gather`): grouped
        row r is ``mA[mIdx[r]]``, loaded by the producer warpgroup with cp.async. ``tails``: ``(tma_atom,
        mA_tma)`` of the ``box_tails`` variant's small A box (:mod:`.grouped_gemm_box_tails`, drop v111).
        ``handoff``: ``(mSync, publishers)`` of the publishing FC1 / awaiting FC2
        (:mod:`.grouped_gemm_handoff`, drop v112; ``self.handoff`` says which)."""
        if cutlass.const_expr(self.handoff == "await"):  # drop v112: FC1's early_done, not its whole grid
            cute.arch.griddepcontrol_launch_dependents()
            self._await_gate(handoff)
        else:
            wait_previous_grid()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        num_experts = self.num_experts
        sOff = storage.sched_off.get_tensor(cute.make_layout(num_experts + 1))
        sCum = storage.sched_cum.get_tensor(cute.make_layout(num_experts + 1))

        sLone = None
        if cutlass.const_expr(self.cluster_m > 1):
            sLone = storage.sched_lone.get_tensor(cute.make_layout(num_experts + 1))

        # ---- scheduler prologue: warp 1 scans per-expert m-tile counts (warp 0 inits mbarriers)
        if warp_idx == 1:
            carry = cutlass.Int32(0)
            carry_lone = cutlass.Int32(0)
            if lane == 0:
                sCum[0] = cutlass.Int32(0)
                if cutlass.const_expr(self.cluster_m > 1):
                    sLone[0] = cutlass.Int32(0)
            for chunk in cutlass.range_constexpr((num_experts + 31) // 32):
                e = chunk * 32 + lane
                cnt = cutlass.Int32(0)
                if e < num_experts:
                    lo = mOffsets[e]
                    hi = mOffsets[e + 1]
                    sOff[e] = lo
                    cnt = (hi - lo + (self.tile_m - 1)) // self.tile_m  # m-tiles
                    if e == num_experts - 1:
                        sOff[e + 1] = hi
                if cutlass.const_expr(self.cluster_m > 1):
                    # drop v96: units are the expert's m-tile pairs; an odd count's last (lone) m-tile is
                    # paired with the next expert's lone one, a unit of the expert that closes the pair
                    # (the last lone tile of all, if unpaired, is a unit of the last expert)
                    lone = cnt % 2
                    lone_incl = warp_inclusive_scan(lone, lane) + carry_lone
                    if e < num_experts:
                        sLone[e + 1] = lone_incl
                    carry_lone = cute.arch.shuffle_sync(lone_incl, 31)
                    odd = lone_incl % 2
                    cnt = cnt // 2 + lone * (1 - odd)
                    if e == num_experts - 1:
                        cnt = cnt + odd
                cnt = warp_inclusive_scan(cnt, lane) + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)

        # drop v114: the ring of claimed tile ids (initialised here; the CTA barrier below publishes it)
        tile_ring = None
        if cutlass.const_expr(self.dynamic_tiles):
            tile_ring = self._tile_ring(storage)

        # ---- mainloop pipeline (its create() ends with a CTA barrier that also publishes sOff/sCum)
        a_smem_one = cute.slice_(a_smem_layout, (None, None, 0))
        b_smem_one = cute.slice_(b_smem_layout, (None, None, 0))
        tma_bytes, producers = stage_producers(self, a_smem_one, b_smem_one)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=producers,
            # cluster: a stage is free once the consumer warps of both CTAs (B or A multicast into both) are done
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.stage_consumer_warps * self.ctas_per_cluster
            ),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
        )
        cute.arch.sync_threads()
        # the persistent schedule: one unit (tile, or the cluster's m- or n-tile pair) per CTA (cluster);
        # CTA r of a cluster computes m-tile 2 p + r of the pair, or in a lone pair lone tile 2 q + r in
        # expert order (drop v96; the last lone tile of all, if unpaired: CTA 1 repeats CTA 0's and
        # stores nothing), or n-tile 2 u + r (cluster_n; past N: no stores)
        unit0, unit_step, cta_rank = bidx, gdim, 0
        if cutlass.const_expr(self.ctas_per_cluster > 1):
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            unit0, unit_step = bidx // self.ctas_per_cluster, gdim // self.ctas_per_cluster

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)

        n_tiles = self.n_tiles
        total_tiles = sCum[num_experts] * n_tiles
        k_tiles = self.k_tiles
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        # =========================================================== producer warpgroup
        if warp_group_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.load_regs)
            if cutlass.const_expr(self.gather_a):
                self._produce_gathered(ab_pipeline, gather[0], gather[1], tma_atom_b, mB_tma, sA, sB, sOff, sCum,
                                       total_tiles, tidx, warp_idx, bidx, gdim)
            else:
                if warp_idx == 0:
                    prod_state = pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.num_stages
                    )
                    # (TMA, slot) views of the staged smem buffers
                    tAsA = cute.group_modes(sA, 0, 2)
                    tBsB = cute.group_modes(sB, 0, 2)
                    expert = cutlass.Int32(0)
                    tile_id = unit0
                    if cutlass.const_expr(self.dynamic_tiles):  # drop v114: claim one tile ahead
                        ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
                        next_id = cute.arch.shuffle_sync(
                            self._claim_tile(handoff, lane, gdim, tile_id, total_tiles), 0)
                    while tile_id < total_tiles:
                        if cutlass.const_expr(self.dynamic_tiles):
                            ring_state = self._push_tile(tile_ring, ring_state, tile_id, next_id, lane)
                            claimed = self._claim_tile(handoff, lane, gdim, next_id, total_tiles)
                        expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                        tile_expert = expert
                        b_mask = None  # cluster_m: the CTAs that each of this CTA's B-half copies fills
                        if cutlass.const_expr(self.cluster_m > 1):
                            shared, tile_expert, row0, row_end = self._pair_tile(sOff, sLone, expert, row0, row_end,
                                                                                 cta_rank)
                            # a pair's B halves go to both CTAs; a lone pair's CTA loads both halves, for itself
                            b_mask = cutlass.Int32(3)
                            if not shared:
                                b_mask = 1 + cta_rank
                        if cutlass.const_expr(self.cluster_n > 1):
                            n_tile = n_tile * self.cluster_n + cta_rank

                        tAsA_p, tAgA = self._a_views(tma_atom_a, mA_tma, tAsA, row0, cta_rank)
                        tBsB_p, tBgBs = self._b_views(tma_atom_b, mB_tma, tBsB, n_tile * self.tile_n, tile_expert,
                                                      cta_rank)
                        if cutlass.const_expr(self.cluster_m > 1):  # the other half (lone pairs only)
                            tBsB_q, tBgBs_q = self._b_views(tma_atom_b, mB_tma, tBsB, n_tile * self.tile_n,
                                                            tile_expert, 1 - cta_rank)
                        rows_valid = row_end - row0
                        if cutlass.const_expr(self.handoff == "await"):  # drop v112: FC1 stored this m-tile
                            self._await_m_tile(handoff, tile_expert, row0, row_end)
                        for k_tile in range(k_tiles):
                            ab_pipeline.producer_acquire(prod_state)
                            bar = ab_pipeline.producer_get_barrier(prod_state)
                            if cutlass.const_expr(tails is not None):
                                # drop v111: a partial tile's A in row boxes; past the expert: zero fill
                                if rows_valid < self.tile_m:
                                    self._copy_a_boxes(tails, sA, row0, rows_valid, k_tile, prod_state.index, bar)
                                else:
                                    cute.copy(tma_atom_a, tAgA[(None, k_tile)], tAsA_p[(None, prod_state.index)],
                                              tma_bar_ptr=bar)
                                self._copy_b(tma_atom_b, tBgBs, tBsB_p, k_tile, prod_state.index, bar, b_mask)
                            else:
                                self._copy_stage(tma_atom_a, tAgA, tAsA_p, tma_atom_b, tBgBs, tBsB_p, k_tile,
                                                 prod_state.index, bar, b_mask)
                            if cutlass.const_expr(self.cluster_m > 1):
                                if not shared:
                                    self._copy_b(tma_atom_b, tBgBs_q, tBsB_q, k_tile, prod_state.index, bar, b_mask)
                            ab_pipeline.producer_commit(prod_state)
                            prod_state.advance()
                        if cutlass.const_expr(self.dynamic_tiles):  # the atomic's latency hid behind the loads
                            tile_id = next_id
                            next_id = cute.arch.shuffle_sync(claimed, 0)
                        else:
                            tile_id = tile_id + unit_step
                    ab_pipeline.producer_tail(prod_state)
                    if cutlass.const_expr(self.dynamic_tiles):
                        self._close_tile_ring(tile_ring, ring_state, total_tiles, lane)
                    if cutlass.const_expr(self.handoff == "await"):
                        self._finish_await(handoff, lane, gdim)

        # =========================================================== consumer warpgroups
        if warp_group_idx > 0:
            cute.arch.warpgroup_reg_alloc(self.mma_regs)
            # pingpong: consumer ``wg`` owns the CTA's tiles wg, wg + 2, ...; cooperative: wg = 0
            wg = cutlass.Int32(0)
            mma_tidx = tidx - self.threads_per_wg
            if cutlass.const_expr(self.pingpong):
                wg = warp_group_idx - 1
                mma_tidx = tidx % self.threads_per_wg
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            if cutlass.const_expr(self.wide):  # one 2 tile_n-row B tile per stage (gate rows, then up)
                sB_main = storage.sB.get_tensor(b_smem_layout_main.outer, swizzle=b_smem_layout_main.inner)
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB_main))
                # the gate half of the wide accumulator: its first tile_n / 8 n-blocks
                acc_shape_wide = tiled_mma.partition_shape_C((self.tile_m, 2 * self.tile_n))
                assert cute.size(acc_shape_wide[0][2]) == 2 * self.tile_n // 8, acc_shape_wide
                acc_shape = ((2, 2, self.tile_n // 8), 1, 1)
            else:
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
                acc_shape = tiled_mma.partition_shape_C((self.tile_m, self.tile_n))
            num_k_blocks = cute.size(tCrA, mode=[2])

            # the chunked epilogue relies on the WGMMA accumulator layout ((2, 2, N/8), M_rep, 1)
            # with M_rep = 1 (cooperative) or 2 (pingpong: two 64-row WGMMAs per warpgroup)
            assert (
                cute.size(acc_shape[0][2]) == self.tile_n // 8
                and cute.size(acc_shape[1]) == (2 if self.pingpong else 1)
                and cute.size(acc_shape[2]) == 1
            ), f"unexpected accumulator shape {acc_shape}"
            accs = [cute.make_rmem_tensor(acc_shape, self.acc_dtype) for _ in range(self.num_b)]
            # wide: the mainloop's one accumulator ((2, 2, 2 tile_n / 8), 1, 1); its n-blocks
            # < tile_n / 8 are the gate tile, the rest the up tile, each in accs' element order.
            # tCcC: (row, col) of every accumulator element inside the CTA tile (wide: elements
            # < n_elems of the wide partition, the gate half, are the output tile's)
            acc_wide = None
            if cutlass.const_expr(self.wide):
                acc_wide = cute.make_rmem_tensor(acc_shape_wide, self.acc_dtype)
                tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, 2 * self.tile_n)))
            else:
                tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            n_elems = cute.size(accs[0])
            # epilogue staging buffer (tile_m, epi_n), pitch epi_n + pad (one per warpgroup in
            # pingpong), and this thread's slots in it
            sC_all = storage.sC.get_tensor(cute.make_layout(self.epi_smem_elems * self.num_epi_bufs))
            sC = cute.make_tensor(
                sC_all.iterator + wg * self.epi_smem_elems,
                cute.make_layout((self.tile_m, self.epi_n), stride=(self.epi_n + self.epi_pad, 1)),
            )
            tCsC = tiled_mma_epi.get_slice(mma_tidx).partition_C(sC)
            epi_barrier = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=self.tile_threads)
            # pingpong order: the mainloops of the two warpgroups alternate. A warpgroup waits on
            # barrier 3 + wg before its mainloop and, once it has waited for all its stages,
            # arrives on the other's barrier. Besides the overlap this keeps every waiter within
            # one lap of the stage ring (mbarrier parity cannot tell lap n from lap n + 2).
            order_mine = pipeline.NamedBarrier(barrier_id=3 + wg, num_threads=2 * self.threads_per_wg)
            order_next = pipeline.NamedBarrier(barrier_id=4 - wg, num_threads=2 * self.threads_per_wg)

            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_stages
            )
            expert = cutlass.Int32(0)
            tile_id = unit0
            tile_step = unit_step
            if cutlass.const_expr(self.pingpong):
                # skip the stages of the other warpgroup's tiles (the producer loads every tile)
                tile_id = unit0 + wg * unit_step
                tile_step = 2 * unit_step
                if cutlass.const_expr(self.jump_stages):  # drop v79: one index / phase step
                    read_state.advance(wg * k_tiles)
                    release_state.advance(wg * k_tiles)
                else:
                    for _ in range(wg * k_tiles):
                        read_state.advance()
                        release_state.advance()
            # drop v114: tile ids (and the CTA's next: the other warpgroup's in pingpong) from the ring;
            # ``seq``: this tile's place in the CTA's sequence
            next_id = total_tiles
            seq = wg
            if cutlass.const_expr(self.dynamic_tiles):
                ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
                if cutlass.const_expr(self.pingpong):
                    ring_state.advance(wg)
                tile_id, next_id, ring_state = self._pop_tile(tile_ring, ring_state)
            while tile_id < total_tiles:
                expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                tile_expert = expert
                if cutlass.const_expr(self.cluster_m > 1):
                    _, tile_expert, row0, row_end = self._pair_tile(sOff, sLone, expert, row0, row_end, cta_rank)
                if cutlass.const_expr(self.cluster_n > 1):
                    n_tile = n_tile * self.cluster_n + cta_rank
                if cutlass.const_expr(self.handoff == "publish"):  # drop v112: before the CTA's last tile
                    if tile_id + tile_step >= total_tiles:
                        self._publish_last_start(handoff, tile_expert, row0, row_end, mma_tidx, epi_barrier)

                # ---------------- mainloop: keep one WGMMA batch in flight
                if cutlass.const_expr(self.pingpong):
                    if cutlass.const_expr(self.dynamic_tiles):
                        if seq != 0:  # all but the CTA's first tile wait for their turn
                            order_mine.arrive_and_wait()
                    else:
                        if tile_id != unit0:  # all but warpgroup 0's first tile wait for their turn
                            order_mine.arrive_and_wait()
                if cutlass.const_expr(self.wide):
                    acc_wide.fill(0.0)
                else:
                    for h in cutlass.range_constexpr(self.num_b):
                        accs[h].fill(0.0)
                other_has_next = tile_id + unit_step < total_tiles
                if cutlass.const_expr(self.dynamic_tiles):
                    other_has_next = next_id < total_tiles
                read_state, release_state, tiled_mma = self._mainloop(
                    ab_pipeline, read_state, release_state, tiled_mma, accs, acc_wide, tCrA, tCrB,
                    num_k_blocks, k_tiles, order_next, other_has_next,
                )
                if cutlass.const_expr(self.wide):  # split into the gate and up accumulators
                    for i in cutlass.range_constexpr(n_elems):
                        accs[0][i] = acc_wide[i]
                        accs[1][i] = acc_wide[i + n_elems]

                # ---------------- epilogue: bias, activation, row scale, masked bf16 stores
                rows_left = row_end - row0
                col0 = n_tile * self.tile_n
                self._activate(accs, tCcC, mRowScale, mBias, tile_expert, row0, rows_left, col0, n_elems)
                if cutlass.const_expr(self.epilogue == "smem"):
                    self._epilogue(
                        accs, tCsC, sC, mC, row0, rows_left, col0, mma_tidx, epi_barrier,
                    )
                else:
                    gC = cute.local_tile(
                        cute.domain_offset((row0, col0), mC), (self.tile_m, self.tile_n), (0, 0)
                    )
                    self._epilogue_direct(
                        accs, thr_mma.partition_C(gC), tCcC, rows_left, col0, n_elems,
                    )
                if cutlass.const_expr(self.pingpong):  # the other warpgroup's tile's stages
                    if cutlass.const_expr(self.jump_stages):
                        read_state.advance(k_tiles)
                        release_state.advance(k_tiles)
                    else:  # unrolled: two compares and selects per stage and state
                        for _ in range(k_tiles):
                            read_state.advance()
                            release_state.advance()
                if cutlass.const_expr(self.handoff == "publish"):  # drop v112: the last tile is stored
                    if tile_id + tile_step >= total_tiles:
                        self._publish_last_done(handoff, tile_expert, row0, row_end, mma_tidx, epi_barrier)
                if cutlass.const_expr(self.dynamic_tiles):
                    tile_id, next_id, ring_state = self._pop_tile(tile_ring, ring_state)
                    seq = seq + (2 if self.pingpong else 1)
                else:
                    tile_id = tile_id + tile_step
            if cutlass.const_expr(self.handoff == "publish"):
                if unit0 >= total_tiles:
                    self._publish_no_tile(handoff, mma_tidx)
        if cutlass.const_expr(self.handoff == "await"):  # FC2 ends after FC1, as with the wait first
            cute.arch.griddepcontrol_wait()

    # ------------------------------------------------------------------ producer helpers
    # (plain methods, traced inline into the producer loops of this kernel, the gathering one and the
    # FP8 one; their loops are over compile-time values)
    def _a_views(self, tma_atom_a, mA_tma, tAsA, row0, cta_rank):
        """``(smem view, gmem view)`` of the A tile, rows ``[row0, row0 + tile_m)``, for TMA: (bM, bK,
        RestK); ``cluster_n``: this CTA loads its 1/cluster_n of the rows into every CTA of the cluster."""
        gA = cute.local_tile(cute.domain_offset((row0, 0), mA_tma), (self.tile_m, self.tile_k), (0, None))
        return cpasync.tma_partition(tma_atom_a, cta_rank if self.cluster_n > 1 else 0,
                                     cute.make_layout(self.cluster_n), tAsA, cute.group_modes(gA, 0, 2))

    def _b_views(self, tma_atom_b, mB_tma, tBsB, n0, expert, cta_rank):
        """``(smem view, [gmem view per weight block])`` of the expert's B tiles at output column ``n0``
        for TMA: rows ``[n0, n0 + bn)`` (gated: and the up rows ``[I + n0, I + n0 + bn)``, an element
        offset, so I need not be a multiple of the tile); ``cluster_m``: this CTA loads its half into
        both CTAs."""
        tBgBs = []
        for h in range(self.num_b):
            gB = cute.local_tile(cute.domain_offset((n0 + h * self.n_out, 0, 0), mB_tma),
                                 (self.tile_n, self.tile_k), (0, None, expert))
            tBsB_p, tBgB = cpasync.tma_partition(tma_atom_b, cta_rank if self.cluster_m > 1 else 0,
                                                 cute.make_layout(self.cluster_m), tBsB, cute.group_modes(gB, 0, 2))
            tBgBs.append(tBgB)
        return tBsB_p, tBgBs

    def _copy_stage(self, tma_atom_a, tAgA, tAsA_p, tma_atom_b, tBgBs, tBsB_p, k_tile, stage, bar, b_mask=None):
        """The TMA copies of k-tile ``k_tile`` into smem stage ``stage``, completing on ``bar``: A (multicast
        over a ``cluster_n`` pair) and each weight block's B (``cluster_m``: this CTA's half, to the CTAs
        in ``b_mask``)."""
        cute.copy(tma_atom_a, tAgA[(None, k_tile)], tAsA_p[(None, stage)], tma_bar_ptr=bar,
                  **({"mcast_mask": cutlass.Int16((1 << self.cluster_n) - 1)} if self.cluster_n > 1 else {}))
        self._copy_b(tma_atom_b, tBgBs, tBsB_p, k_tile, stage, bar, b_mask)

    def _copy_b(self, tma_atom_b, tBgBs, tBsB_p, k_tile, stage, bar, b_mask):
        """The B tile of each weight block that the views ``(tBgBs, tBsB_p)`` hold; ``cluster_m``: this
        CTA's half, into the CTAs of the bit mask ``b_mask`` (3: both, a pair's multicast; 1 + rank: this
        CTA alone, drop v96's lone pairs); ``b_mask`` None (no cluster along M): a plain copy."""
        mcast = {} if b_mask is None else {"mcast_mask": cutlass.Int16(b_mask)}
        for h in range(self.num_b):
            cute.copy(tma_atom_b, tBgBs[h][(None, k_tile)], tBsB_p[(None, stage * self.num_b + h)], tma_bar_ptr=bar,
                      **mcast)

    def _mma_k_tile(self, tiled_mma, accs, acc_wide, tCrA, tCrB, stage, num_k_blocks: cutlass.Constexpr):
        """The WGMMAs of one k-tile (stage ``stage``): per k-block one over the wide B tile (wide)
        or one per B slot (gate, up) of the stage."""
        for kb in range(num_k_blocks):
            if self.wide:
                cute.gemm(tiled_mma, acc_wide, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)],
                          acc_wide)
            else:
                for h in range(self.num_b):
                    cute.gemm(
                        tiled_mma,
                        accs[h],
                        tCrA[(None, None, kb, stage)],
                        tCrB[(None, None, kb, stage * self.num_b + h)],
                        accs[h],
                    )

    @cute.jit
    def _mainloop(self, ab_pipeline, read_state, release_state, tiled_mma, accs, acc_wide, tCrA, tCrB,
                  num_k_blocks: cutlass.Constexpr, k_tiles: cutlass.Constexpr, order_next, other_has_next):
        """A tile's mainloop, one WGMMA batch in flight; pingpong: ``order_next`` hands the tensor
        cores to the other warpgroup (when ``other_has_next``) once all stages are waited for.
        Returns the two states and ``tiled_mma`` (its accumulate flag is a traced value)."""
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        ab_pipeline.consumer_wait(read_state)
        self._mma_k_tile(tiled_mma, accs, acc_wide, tCrA, tCrB, read_state.index, num_k_blocks)
        warpgroup.commit_group()
        read_state.advance()
        for k_tile in range(1, k_tiles):
            ab_pipeline.consumer_wait(read_state)
            self._mma_k_tile(tiled_mma, accs, acc_wide, tCrA, tCrB, read_state.index, num_k_blocks)
            warpgroup.commit_group()
            # the previous stage's WGMMAs are done -> hand its buffers back to TMA
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        if cutlass.const_expr(self.pingpong):
            if other_has_next:  # the other warpgroup has the next tile
                order_next.arrive()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state, tiled_mma

    @cute.jit
    def _activate(
        self,
        accs,
        tCcC: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        expert: cutlass.Int32,
        row0: cutlass.Int32,
        rows_left: cutlass.Int32,
        col0: cutlass.Int32,
        n_elems: cutlass.Constexpr,
    ):
        """acc0 <- act(acc0 + bias (, acc1 + up bias)) * row_scale, in fp32 registers."""
        acc0 = accs[0]
        if cutlass.const_expr(self.has_bias):
            # clamp the column so the ragged last tile's loads stay in bounds (those columns are
            # never stored); a thread's columns repeat over its rows, so loads merge
            last_col = self.n_out - 1
            for i in cutlass.range_constexpr(n_elems):
                c = cutlass.min(col0 + tCcC[i][1], last_col)
                acc0[i] = acc0[i] + mBias[expert, c].to(cutlass.Float32)
                if cutlass.const_expr(self.gated):
                    accs[1][i] = accs[1][i] + mBias[expert, c + self.n_out].to(cutlass.Float32)
        for i in cutlass.range_constexpr(n_elems):
            x = acc0[i]
            if cutlass.const_expr(self.activation == "swiglu"):
                g = x
                u = accs[1][i]
                x = silu(g, self.tanh_sigmoid) * u
            elif cutlass.const_expr(self.activation == "gelu_glu"):
                u = accs[1][i]
                x = cutlass.Float32(0.5) * x * (cutlass.Float32(1.0) + cute.math.erf(x * _RSQRT2)) * u
            elif cutlass.const_expr(self.activation == "clamped_swiglu"):
                x = clamped_swiglu(x, accs[1][i], self.swiglu_alpha, self.swiglu_limit, self.swiglu_beta,
                                   self.swiglu_limit_after_act)
            elif cutlass.const_expr(self.activation == "softcapped_swiglu"):
                x = softcapped_swiglu(x, accs[1][i], self.gate_softcap, self.up_softcap)
            elif cutlass.const_expr(self.activation == "gelu_tanh_glu"):
                x = gelu_tanh(x) * accs[1][i]
            elif cutlass.const_expr(self.activation == "squared_relu"):
                r = cute.arch.fmax(x, cutlass.Float32(0.0))
                x = r * r
            acc0[i] = x
        if cutlass.const_expr(self.scale_rows):
            # A thread owns only a few distinct rows; clamping keeps every load in bounds and
            # branch free, so the compiler merges the loads of one row (no stores in between).
            for i in cutlass.range_constexpr(n_elems):
                r = cutlass.min(tCcC[i][0], rows_left - 1)
                acc0[i] = acc0[i] * mRowScale[row0 + r]

    @cute.jit
    def _epilogue(
        self,
        accs,
        tCsC: cute.Tensor,
        sC: cute.Tensor,
        mC: cute.Tensor,
        row0: cutlass.Int32,
        rows_left: cutlass.Int32,
        col0: cutlass.Int32,
        mma_tidx: cutlass.Int32,
        epi_barrier,
    ):
        """Stage the tile through smem in epi_n-column chunks and store its rows below
        ``rows_left``."""
        acc0 = accs[0]
        rC = cute.make_rmem_tensor(acc0.shape, self.c_dtype)
        rC.store(acc0.load().to(self.c_dtype))
        # WGMMA accumulators hold column pairs (2j, 2j+1) in elements (2j, 2j+1); in the 32-bit
        # view, pair p of n-block j (8 columns) of 64-row block m is element p + 2 j + 2 (N/8) m,
        # so chunk c of epi_n columns is, per m, the contiguous range of its e8 = epi_n/8 n-blocks.
        rC32 = cute.recast_tensor(rC, cutlass.Int32)
        sC32 = cute.recast_tensor(tCsC, cutlass.Int32)
        p32 = cute.make_ptr(
            cutlass.Int32, sC32.iterator.toint(), cute.AddressSpace.smem, assumed_align=4
        )
        sC32 = cute.make_tensor(p32, sC32.layout)
        n_chunks = self.tile_n // self.epi_n
        m_rep = cute.size(rC32, mode=[1])
        ppc = cute.size(sC32) // m_rep  # 32-bit pairs of one chunk per 64-row block
        n8 = self.tile_n // 8
        pitch = self.epi_n + self.epi_pad
        vec_per_row = self.epi_n // 8
        n_threads = self.tile_threads
        vec_per_thread = self.tile_m * vec_per_row // n_threads
        n_out = self.n_out
        s_base = sC.iterator.toint()
        g_base = mC.iterator.toint()
        for c in cutlass.range_constexpr(n_chunks):
            for m in cutlass.range_constexpr(m_rep):
                for j in cutlass.range_constexpr(ppc):
                    sC32[j + ppc * m] = rC32[c * ppc + j + 2 * n8 * m]
            epi_barrier.arrive_and_wait()
            # each thread moves 16-byte vectors; a warp covers whole 128-byte row segments
            for it in cutlass.range_constexpr(vec_per_thread):
                v = it * n_threads + mma_tidx
                row = v // vec_per_row
                cv = v % vec_per_row
                col = col0 + c * self.epi_n + cv * 8
                pred = row < rows_left
                if cutlass.const_expr(not self.n_out_divisible):
                    pred = pred and col < n_out
                if pred:
                    s_ptr = cute.make_ptr(
                        self.c_dtype,
                        s_base + (row * pitch + cv * 8) * 2,
                        cute.AddressSpace.smem,
                        assumed_align=16,
                    )
                    g_off = (cutlass.Int64(row0 + row) * n_out + col) * 2
                    g_ptr = cute.make_ptr(
                        self.c_dtype, g_base + g_off, cute.AddressSpace.gmem, assumed_align=16
                    )
                    src = cute.make_tensor(s_ptr, cute.make_layout(8))
                    dst = cute.make_tensor(g_ptr, cute.make_layout(8))
                    dst.store(src.load())
            epi_barrier.arrive_and_wait()

    @cute.jit
    def _epilogue_direct(
        self,
        accs,
        tCgC: cute.Tensor,
        tCcC: cute.Tensor,
        rows_left: cutlass.Int32,
        col0: cutlass.Int32,
        n_elems: cutlass.Constexpr,
    ):
        acc0 = accs[0]
        rC = cute.make_rmem_tensor(acc0.shape, self.c_dtype)
        rC.store(acc0.load().to(self.c_dtype))
        # WGMMA accumulators hold column pairs (2j, 2j+1) in elements (2j, 2j+1): store them as
        # one 32-bit word (N_out and col0 are even, so the address is 4-byte aligned).
        rC32 = cute.recast_tensor(rC, cutlass.Int32)
        tCgC32 = cute.recast_tensor(tCgC, cutlass.Int32)
        # re-type the base pointer as 4-byte aligned, else the store is split into two b16
        p32 = cute.make_ptr(
            cutlass.Int32, tCgC32.iterator.toint(), cute.AddressSpace.gmem, assumed_align=4
        )
        tCgC32 = cute.make_tensor(p32, tCgC32.layout)
        cols_left = self.n_out - col0
        for j in cutlass.range_constexpr(n_elems // 2):
            rc = tCcC[2 * j]
            if cutlass.const_expr(self.n_out_divisible):
                if rc[0] < rows_left:
                    tCgC32[j] = rC32[j]
            else:
                if rc[0] < rows_left and rc[1] < cols_left:
                    tCgC32[j] = rC32[j]
