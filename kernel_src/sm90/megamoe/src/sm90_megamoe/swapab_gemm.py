"""Swap-AB varlen-M grouped GEMM for MoE decode on SM90 (H100/H200), written in CuTeDSL.

Same math, argument list, dtypes and layouts as ``GroupedGemmSm90`` (see grouped_gemm.py): for
every expert ``e`` with rows ``[offsets[e], offsets[e+1])`` of A::

    C[rows] = act(A[rows] @ B[e]^T (+ bias[e])) (* row_scale[rows])

but the WGMMA operands are swapped. With 1..16 rows per expert (decode: 1..256 tokens x top-k),
a 128-row token tile is almost all padding; here the WEIGHT is the MMA's M side (64 weight rows
per warpgroup WGMMA) and the expert's tokens are the N side (``tile_t`` in 8..128)::

    C^T[n, m] = B[e][n, :] . A[m, :]^T          n: weight row (output column), m: token row

The kernel is a weight streamer: each CTA tile reads ``tile_w`` (gated: 2 x ``tile_w``) weight rows
over the whole K exactly once, through a deep TMA pipeline (the token tile is small, so the shared
memory goes to weight stages), and never touches an expert without tokens.

Design
------
* Persistent grid of ``max_active_ctas`` CTAs. Each CTA reads ``offsets`` into shared memory and
  builds the prefix sum of per-expert token-tile counts ``t_e = ceil(rows_e / tile_t)`` (one
  warp, shuffle scan). Expert ``e`` owns the linear tiles ``[cum[e] * W, cum[e+1] * W)``
  (``W`` = weight-row tiles of N_out); inside it the token tile is the FAST index, so the CTAs
  that work on one weight tile with several token tiles run at the same time and share its DRAM
  read through L2. CTA ``b`` takes tiles ``b, b + grid, ...``: at any moment the whole grid
  streams consecutive (mostly different) weight tiles; all tiles cost the same (K, tile_w fixed).
* Weights: one TMA descriptor over ``B`` viewed as ``(N, K, E)`` (expert = third coordinate), box
  ``(tile_w, 64)``, L2 hint evict-first (streamed once). Tokens: one TMA descriptor over the
  ragged ``A [M_total, K]``, box ``(tile_t, 64)`` at row ``offsets[e] + t * tile_t``, hint
  evict-last (every weight tile of the expert re-reads them). Rows past ``M_total`` are TMA
  zero-filled; rows of the next expert in a token tile are computed but never stored.
* Gated activations (swiglu, gelu_glu, clamped_swiglu, softcapped_swiglu, gelu_tanh_glu): a tile covers output columns
  ``[n0, n0 + tile_w)``; every stage holds TWO weight boxes, w13 rows ``[n0, n0 + tile_w)``
  (gate, slot ``2s``) and ``[I + n0, I + n0 + tile_w)`` (up, slot ``2s + 1``; an element
  coordinate, so I need not be a multiple of tile_w), and each consumer keeps two accumulators
  with identical register layouts: element ``i`` of the gate accumulator pairs with element
  ``i`` of the up accumulator. In the last tile of a ragged I, gate rows past I hold up rows and
  up rows past 2I are TMA zero fill: computed, never stored.
* Warp specialization: warpgroup 0 = producer (one warp issues TMA into a ``num_stages`` deep
  ``PipelineTmaAsync``), warpgroups 1..``num_mma_wg`` = consumers (64 weight rows each, or
  ``tile_w / 64 / num_mma_wg`` 64-row blocks each). Consumers keep one WGMMA batch in flight and
  release a stage as soon as its WGMMAs retire. The producer runs ahead into the next tile while
  the consumers run the epilogue.
* Epilogue straight from the accumulators: bias (per weight row: 1-2 loads per thread and
  64-row block), activation and row scale (per token) in fp32 registers, then predicated stores
  into row-major ``C[m, n]`` (``m < expert end``, ``n < N_out``). The transposed write pairs two
  adjacent weight rows (lanes ``l`` and ``l ^ 4`` of the WGMMA C layout) with one shuffle so that
  every store is a 32-bit ``(n, n+1)`` pair. Output bytes are ~0.1-1% of the weight bytes in
  decode, so no smem staging.

Tensors: exactly ``GroupedGemmSm90.__call__``'s (mA [M_total, K] bf16, mB [E, N, K] bf16,
mC [M_total, N_out] bf16, mOffsets [E+1] int32 device, mRowScale [M_total] fp32, mBias [E, N]
fp32/bf16 or a placeholder, max_active_ctas int32, stream). Static (compile key): K, N, E,
activation (+ alpha, limit), tile_w, tile_t, num_stages, scale_rows, has_bias and bias dtype.
Requirements: K % 8 == 0, N_out % 8 == 0 (TMA strides), as for GroupedGemmSm90.
"""

from __future__ import annotations

from typing import Optional, Tuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from .grouped_gemm import (check_activation_constants, check_bf16_operands, clamped_swiglu, gelu_tanh, silu,
                           softcapped_swiglu)
from .warp_scan import warp_inclusive_scan
from .pdl import PDL, wait_previous_grid
from .constants import ACTIVATIONS, ALIGN_K_ELEMS, ALIGN_N_ELEMS, GATED_ACTIVATIONS, MAX_EXPERTS

try:  # newer location; the old one still works but warns
    from cutlass.tensor_utils import LayoutEnum
except Exception:  # pragma: no cover
    from cutlass.utils import LayoutEnum

try:
    from cutlass.memory import get_smem_capacity_in_bytes
except Exception:  # pragma: no cover
    from cutlass.utils import get_smem_capacity_in_bytes

_RSQRT2 = 0.7071067811865476

# L2 eviction-priority operands of cp.async.bulk.tensor's .L2::cache_hint (the createpolicy
# "fractional, 100%" encodings CUTLASS uses for TMA::CacheHintSm90).
_L2_EVICT_FIRST = 0x12F0000000000000
_L2_EVICT_LAST = 0x14F0000000000000

TILE_T_CHOICES = (8, 16, 32, 64, 128)
DEFAULT_TILE_W = {"identity": 128, "squared_relu": 128, "swiglu": 64, "gelu_glu": 64,
                  "clamped_swiglu": 64, "softcapped_swiglu": 64, "gelu_tanh_glu": 64}
MAX_STAGES = 16
# early_weights: weight bytes each CTA prefetches into L2 before the PDL wait (132 CTAs: 17 MB of L2)
EARLY_WEIGHT_BYTES = 128 * 1024


def pick_tile_t(m_total: int, num_experts: int) -> int:
    """Token tile for ``m_total`` rows over ``num_experts`` experts: the smallest choice that
    holds about twice the mean rows per expert (so most experts need one token tile; a second
    one re-reads its weight tile from L2, not DRAM), at most 64."""
    mean = m_total / max(1, num_experts)
    for t in TILE_T_CHOICES:
        if t >= 2.0 * mean or t == 64:
            return t
    return 64


class SwapABGroupedGemmSm90:
    """Swap-AB varlen-M grouped GEMM for decode (semantics and layouts: module docstring).

    :param activation: one of ``ACTIVATIONS`` (compile time).
    :param scale_rows: multiply output row m by row_scale[m] (fp32) after the activation.
    :param has_bias: add bias[e, n] (fp32 or bf16, from the tensor) before the activation.
    :param tile_w: weight rows (= output columns) per tile; 64, 128 or 256. Gated activations read
        2 x tile_w rows (gate + up). Default 64 gated, 128 otherwise (128 weight rows per tile).
    :param tile_t: token rows per tile (the WGMMA N): a multiple of 8 in [8, 128].
    :param num_stages: TMA pipeline depth; None = as many as fit (at most ``MAX_STAGES``).
    :param num_mma_wg: consumer warpgroups (1 or 2); None = 1 for tile_w 64, else 2.
    :param l2_hints: weights evict-first, tokens evict-last in L2.
    :param swiglu_alpha, swiglu_limit, swiglu_beta: clamped_swiglu's constants (gpt-oss: 1.702, 7.0,
        1.0; DeepSeek-V4: 1.0, its limit, 0.0). Drop v99 added beta (1.0 before).
    :param swiglu_limit_after_act: the gate clamped after the activation (Step-3.7; drop v102).
    :param gate_softcap, up_softcap: softcapped_swiglu's caps (Inkling2: 4.0, 25.0; drop v103).
    :param early_weights: with PDL launches (:data:`~.pdl.PDL`), prefetch this CTA's first weight
        k-blocks (at most ``EARLY_WEIGHT_BYTES``) into L2 *before* waiting for the previous grid, so
        the weight stream starts while that grid finishes. The scheduler then also reads
        ``offsets`` before the wait: only for a caller that guarantees ``offsets`` (and
        ``row_scale``) were written at least two launches earlier in the stream (e.g. FC2 after
        FC1 after the layout); tokens and outputs are touched only after the wait. No effect without PDL.
    :param tanh_sigmoid: swiglu only (drop v52): silu(g) = h + h tanh(h), h = g / 2, one
        ``tanh.approx`` (the same activation form as :class:`~.grouped_gemm.GroupedGemmSm90`'s).
    """

    def __init__(
        self,
        activation: str,
        scale_rows: bool = False,
        has_bias: bool = False,
        tile_w: Optional[int] = None,
        tile_t: int = 32,
        num_stages: Optional[int] = None,
        num_mma_wg: Optional[int] = None,
        l2_hints: bool = True,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        swiglu_beta: float = 1.0,
        swiglu_limit_after_act: bool = False,
        gate_softcap: float = 4.0,
        up_softcap: float = 25.0,
        early_weights: bool = False,
        tanh_sigmoid: bool = False,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if tanh_sigmoid and activation != "swiglu":
            raise ValueError("tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu'")
        self.tanh_sigmoid = bool(tanh_sigmoid)
        if tile_w is None:
            tile_w = DEFAULT_TILE_W[activation]
        if tile_w not in (64, 128, 256):
            raise ValueError(f"tile_w must be 64, 128 or 256, got {tile_w}")
        if tile_t % 8 != 0 or not (8 <= tile_t <= 128):
            raise ValueError(f"tile_t must be a multiple of 8 in [8, 128], got {tile_t}")
        if num_mma_wg is None:
            num_mma_wg = 1 if tile_w == 64 else 2
        if num_mma_wg not in (1, 2) or tile_w % (64 * num_mma_wg) != 0:
            raise ValueError(f"num_mma_wg must be 1 or 2 and divide tile_w / 64, got {num_mma_wg}")
        check_activation_constants(activation, swiglu_alpha, swiglu_limit, swiglu_beta, gate_softcap, up_softcap)
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        self.num_b = 2 if self.gated else 1  # weight boxes (and accumulators) per stage
        self.scale_rows = bool(scale_rows)
        self.has_bias = bool(has_bias)
        self.tile_w = tile_w
        self.tile_t = tile_t
        self.tile_k = 64  # one 128-byte swizzle atom of bf16 (the widest TMA box with SW128)
        self.num_mma_wg = num_mma_wg
        self.m_rep = tile_w // (64 * num_mma_wg)  # 64-row WGMMA blocks per consumer warpgroup
        acc_regs = self.num_b * self.m_rep * tile_t // 2
        if acc_regs > 128:
            raise ValueError(f"accumulators need {acc_regs} fp32 registers per thread (> 128): "
                             f"lower tile_t or tile_w")
        self.num_stages_override = num_stages
        self.l2_hints = bool(l2_hints)
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.swiglu_beta = float(swiglu_beta)
        self.swiglu_limit_after_act = bool(swiglu_limit_after_act)
        self.gate_softcap, self.up_softcap = float(gate_softcap), float(up_softcap)
        self.early_weights = bool(early_weights)

        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.BFloat16
        self.c_dtype = cutlass.BFloat16
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + num_mma_wg) * self.threads_per_wg
        self.consumer_warps = 4 * num_mma_wg
        # setmaxnreg only with two consumer warpgroups (384 threads: 168 at launch, 40 / 232);
        # with one, 256 threads get up to 255 registers each without it
        self.load_regs = 40
        self.mma_regs = 232
        self.smem_capacity = get_smem_capacity_in_bytes("sm_90")

    # ------------------------------------------------------------------ host helpers
    def static_shapes(self, n: int, k: int) -> Tuple[int, int]:
        """(N_out, weight-row tiles) for a weight with N rows and K columns; validates alignment."""
        if k % ALIGN_K_ELEMS != 0:
            raise ValueError(f"K={k} must be a multiple of {ALIGN_K_ELEMS}")
        if self.gated:
            if n % 2 != 0:
                raise ValueError(f"{self.activation} needs an even N (= 2 * I)")
            n_out = n // 2
        else:
            n_out = n
        if n_out % ALIGN_N_ELEMS != 0:
            raise ValueError(f"N_out={n_out} must be a multiple of {ALIGN_N_ELEMS}")
        return n_out, (n_out + self.tile_w - 1) // self.tile_w

    def stage_bytes(self) -> int:
        """Shared memory of one pipeline stage: the weight box(es) plus the token box."""
        return (self.num_b * self.tile_w + self.tile_t) * self.tile_k * 2

    def early_k_tiles(self) -> int:
        """Weight k-blocks prefetched before the PDL wait (``early_weights``): as many as fit in
        ``EARLY_WEIGHT_BYTES`` per CTA (the whole GPU's then fit in L2 beside the running grid)."""
        kblock = self.num_b * self.tile_w * self.tile_k * 2
        return max(1, min(self.k_tiles, EARLY_WEIGHT_BYTES // kblock))

    def num_stages_for(self, num_experts: int) -> int:
        reserved = 16 * MAX_STAGES + 8 * (num_experts + 2) + 2048  # mbarriers, scheduler, slack
        stages = min((self.smem_capacity - reserved) // self.stage_bytes(), MAX_STAGES)
        if self.num_stages_override is not None:
            stages = min(stages, self.num_stages_override)
        if stages < 2:
            raise ValueError("tile too large: fewer than 2 pipeline stages fit in shared memory")
        return int(stages)

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
        check_bf16_operands(mA, mB, mC, mOffsets, mBias)
        num_experts = cute.size(mOffsets, mode=[0]) - 1
        n_rows_b = cute.size(mB, mode=[1])
        k_size = cute.size(mB, mode=[2])
        if cutlass.const_expr(num_experts > MAX_EXPERTS):
            raise ValueError(f"at most {MAX_EXPERTS} experts")
        n_out, w_tiles = self.static_shapes(n_rows_b, k_size)
        self.num_experts = num_experts
        self.n_out = n_out
        self.w_tiles = w_tiles
        self.k_tiles = (k_size + self.tile_k - 1) // self.tile_k
        self.n_out_divisible = n_out % self.tile_w == 0
        self.num_stages = self.num_stages_for(num_experts)

        # weights as (N, K, E): the expert is the third TMA coordinate
        mB_nke = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 2, 0]))
        w_layout = LayoutEnum.from_tensor(mB_nke)
        x_layout = LayoutEnum.from_tensor(mA)
        tile_wtk = (self.tile_w, self.tile_t, self.tile_k)
        # MMA A = weights (M = weight rows), MMA B = tokens (N = token rows); both K-major
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            w_layout.sm90_mma_major_mode(),
            x_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_t),
        )
        # gated: slots 2s (gate) and 2s+1 (up) belong to stage s
        w_smem_layout = sm90_utils.make_smem_layout_a(
            w_layout, tile_wtk, self.ab_dtype, self.num_stages * self.num_b
        )
        x_smem_layout = sm90_utils.make_smem_layout_b(x_layout, tile_wtk, self.ab_dtype, self.num_stages)
        tma_atom_w, tma_tensor_w = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mB_nke,
            cute.slice_(w_smem_layout, (None, None, 0)),
            (self.tile_w, self.tile_k),
        )
        tma_atom_x, tma_tensor_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(x_smem_layout, (None, None, 0)),
            (self.tile_t, self.tile_k),
        )

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            # offsets[0..E] and inclusive prefix sum of token tiles per expert
            sched_off: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            sched_cum: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            sW: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(w_smem_layout)], 1024
            ]
            sX: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(x_smem_layout)], 1024
            ]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_atom_w,
            tma_tensor_w,
            tma_atom_x,
            tma_tensor_x,
            mC,
            mOffsets,
            mRowScale,
            mBias,
            tiled_mma,
            w_smem_layout,
            x_smem_layout,
        ).launch(
            grid=[max_active_ctas, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=[1, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=PDL,
        )

    # ------------------------------------------------------------------ scheduler helper
    @cute.jit
    def _locate(self, sOff: cute.Tensor, sCum: cute.Tensor, tile_id: cutlass.Int32,
                expert: cutlass.Int32):
        """Linear tile -> (expert, first token row, expert end row, weight tile). ``expert`` only
        grows along a CTA's tiles. Inside an expert the token tile is the fast index."""
        w_tiles = self.w_tiles
        t_global = tile_id // w_tiles  # cum[e] * W <= tile_id  <=>  cum[e] <= tile_id // W
        e = expert
        while sCum[e + 1] <= t_global:
            e = e + 1
        c0 = sCum[e]
        t_e = sCum[e + 1] - c0
        local = tile_id - c0 * w_tiles
        w_tile = local // t_e
        t_tile = local - w_tile * t_e
        row0 = sOff[e] + t_tile * self.tile_t
        return e, row0, sOff[e + 1], w_tile

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_w: cute.CopyAtom,
        mW_tma: cute.Tensor,
        tma_atom_x: cute.CopyAtom,
        mX_tma: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_smem_layout: cute.ComposedLayout,
        x_smem_layout: cute.ComposedLayout,
    ):
        if cutlass.const_expr(not (PDL and self.early_weights)):
            wait_previous_grid()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_w)
            cpasync.prefetch_descriptor(tma_atom_x)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        num_experts = self.num_experts
        sOff = storage.sched_off.get_tensor(cute.make_layout(num_experts + 1))
        sCum = storage.sched_cum.get_tensor(cute.make_layout(num_experts + 1))

        # ---- scheduler prologue: warp 1 scans per-expert token-tile counts (warp 0: mbarriers)
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
                    cnt = (hi - lo + (self.tile_t - 1)) // self.tile_t
                    if e == num_experts - 1:
                        sOff[e + 1] = hi
                cnt = warp_inclusive_scan(cnt, lane) + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)

        # ---- pipeline (its create() ends with a CTA barrier that also publishes sOff/sCum)
        w_smem_one = cute.slice_(w_smem_layout, (None, None, 0))
        x_smem_one = cute.slice_(x_smem_layout, (None, None, 0))
        tma_bytes = self.num_b * cute.size_in_bytes(self.ab_dtype, w_smem_one) + cute.size_in_bytes(
            self.ab_dtype, x_smem_one
        )
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        cute.arch.sync_threads()

        sW = storage.sW.get_tensor(w_smem_layout.outer, swizzle=w_smem_layout.inner)
        sX = storage.sX.get_tensor(x_smem_layout.outer, swizzle=x_smem_layout.inner)

        w_tiles = self.w_tiles
        total_tiles = sCum[num_experts] * w_tiles
        k_tiles = self.k_tiles
        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

        if cutlass.const_expr(PDL and self.early_weights):
            # The weights never depend on the previous grid (and offsets were settled two
            # launches back): pull this CTA's first weight k-blocks into L2 while it finishes.
            if warp_idx == 0:
                if bidx < total_tiles:
                    e0, _r0, _re, w_tile0 = self._locate(sOff, sCum, bidx, cutlass.Int32(0))
                    tWsW0 = cute.group_modes(sW, 0, 2)
                    for h in cutlass.range_constexpr(self.num_b):
                        gW0 = cute.local_tile(
                            cute.domain_offset((w_tile0 * self.tile_w + h * self.n_out, 0, 0), mW_tma),
                            (self.tile_w, self.tile_k),
                            (0, None, e0),
                        )
                        _sW0, tWgW0 = cpasync.tma_partition(
                            tma_atom_w, 0, cute.make_layout(1), tWsW0, cute.group_modes(gW0, 0, 2)
                        )
                        for k_tile in cutlass.range_constexpr(self.early_k_tiles()):
                            cute.prefetch(tma_atom_w, tWgW0[(None, k_tile)])
            wait_previous_grid()  # tokens, outputs and everything below come after the previous grid

        # =========================================================== producer warpgroup
        if warp_group_idx == 0:
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.warpgroup_reg_dealloc(self.load_regs)
            if warp_idx == 0:
                prod_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_stages
                )
                tWsW = cute.group_modes(sW, 0, 2)  # (TMA, slot)
                tXsX = cute.group_modes(sX, 0, 2)  # (TMA, stage)
                expert = cutlass.Int32(0)
                tile_id = bidx
                while tile_id < total_tiles:
                    expert, row0, row_end, w_tile = self._locate(sOff, sCum, tile_id, expert)
                    # tokens: rows [row0, row0 + tile_t) of the ragged A  -> (bT, bK, RestK)
                    gX = cute.local_tile(
                        cute.domain_offset((row0, 0), mX_tma), (self.tile_t, self.tile_k), (0, None)
                    )
                    tXsX_p, tXgX = cpasync.tma_partition(
                        tma_atom_x, 0, cute.make_layout(1), tXsX, cute.group_modes(gX, 0, 2)
                    )
                    # weights of this expert: rows [n0, n0 + tile_w) (gated: + [I + n0, ...))
                    n0 = w_tile * self.tile_w
                    tWgWs = []
                    for h in cutlass.range_constexpr(self.num_b):
                        gW = cute.local_tile(
                            cute.domain_offset((n0 + h * self.n_out, 0, 0), mW_tma),
                            (self.tile_w, self.tile_k),
                            (0, None, expert),
                        )
                        tWsW_p, tWgW = cpasync.tma_partition(
                            tma_atom_w, 0, cute.make_layout(1), tWsW, cute.group_modes(gW, 0, 2)
                        )
                        tWgWs.append(tWgW)
                    for k_tile in range(k_tiles):
                        pipe.producer_acquire(prod_state)
                        bar = pipe.producer_get_barrier(prod_state)
                        for h in cutlass.range_constexpr(self.num_b):
                            if cutlass.const_expr(self.l2_hints):
                                cute.copy(
                                    tma_atom_w,
                                    tWgWs[h][(None, k_tile)],
                                    tWsW_p[(None, prod_state.index * self.num_b + h)],
                                    tma_bar_ptr=bar,
                                    cache_policy=cutlass.Int64(_L2_EVICT_FIRST),
                                )
                            else:
                                cute.copy(
                                    tma_atom_w,
                                    tWgWs[h][(None, k_tile)],
                                    tWsW_p[(None, prod_state.index * self.num_b + h)],
                                    tma_bar_ptr=bar,
                                )
                        if cutlass.const_expr(self.l2_hints):
                            cute.copy(
                                tma_atom_x,
                                tXgX[(None, k_tile)],
                                tXsX_p[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                                cache_policy=cutlass.Int64(_L2_EVICT_LAST),
                            )
                        else:
                            cute.copy(
                                tma_atom_x,
                                tXgX[(None, k_tile)],
                                tXsX_p[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                        pipe.producer_commit(prod_state)
                        prod_state.advance()
                    tile_id = tile_id + gdim
                pipe.producer_tail(prod_state)

        # =========================================================== consumer warpgroups
        if warp_group_idx > 0:
            if cutlass.const_expr(self.num_mma_wg == 2):
                cute.arch.warpgroup_reg_alloc(self.mma_regs)
            mma_tidx = tidx - self.threads_per_wg
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
            tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
            num_k_blocks = cute.size(tCrW, mode=[2])

            acc_shape = tiled_mma.partition_shape_C((self.tile_w, self.tile_t))
            # WGMMA C layout ((2, 2, tile_t/8), m_rep, 1) (the tile_t/8 mode vanishes for
            # tile_t = 8): the pairing in _store relies on it
            assert (
                cute.size(acc_shape[0]) == self.tile_t // 2
                and cute.size(acc_shape[1]) == self.m_rep
                and cute.size(acc_shape[2]) == 1
            ), f"unexpected accumulator shape {acc_shape}"
            accs = [cute.make_rmem_tensor(acc_shape, self.acc_dtype) for _ in range(self.num_b)]
            # (weight row, token) of every accumulator element inside the tile
            tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_w, self.tile_t)))
            n_elems = cute.size(accs[0])

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            expert = cutlass.Int32(0)
            tile_id = bidx
            while tile_id < total_tiles:
                expert, row0, row_end, w_tile = self._locate(sOff, sCum, tile_id, expert)

                # ---------------- mainloop: one WGMMA batch in flight
                for h in cutlass.range_constexpr(self.num_b):
                    accs[h].fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                pipe.consumer_wait(read_state)
                for kb in cutlass.range_constexpr(num_k_blocks):
                    for h in cutlass.range_constexpr(self.num_b):
                        cute.gemm(
                            tiled_mma,
                            accs[h],
                            tCrW[(None, None, kb, read_state.index * self.num_b + h)],
                            tCrX[(None, None, kb, read_state.index)],
                            accs[h],
                        )
                warpgroup.commit_group()
                read_state.advance()
                for k_tile in range(1, k_tiles):
                    pipe.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        for h in cutlass.range_constexpr(self.num_b):
                            cute.gemm(
                                tiled_mma,
                                accs[h],
                                tCrW[(None, None, kb, read_state.index * self.num_b + h)],
                                tCrX[(None, None, kb, read_state.index)],
                                accs[h],
                            )
                    warpgroup.commit_group()
                    # the previous stage's WGMMAs have retired -> hand its buffers back to TMA
                    warpgroup.wait_group(1)
                    pipe.consumer_release(release_state)
                    release_state.advance()
                    read_state.advance()
                warpgroup.wait_group(0)
                pipe.consumer_release(release_state)
                release_state.advance()

                # ---------------- epilogue
                n0 = w_tile * self.tile_w
                rows_left = row_end - row0
                self._activate(accs, tCcC, mRowScale, mBias, expert, row0, rows_left, n0, n_elems)
                self._store(accs[0], tCcC, mC, row0, rows_left, n0, lane)
                tile_id = tile_id + gdim

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
        n0: cutlass.Int32,
        n_elems: cutlass.Constexpr,
    ):
        """acc0 <- act(acc0 + bias (, acc1 + up bias)) * row_scale, in fp32 registers. Element i
        holds weight row (output column) n0 + tCcC[i][0] of token row0 + tCcC[i][1]."""
        acc0 = accs[0]
        if cutlass.const_expr(self.has_bias):
            # a thread owns 2 weight rows per 64-row block: the loads merge; the column is
            # clamped so the ragged last tile stays in bounds (those columns are never stored)
            last_col = self.n_out - 1
            for i in cutlass.range_constexpr(n_elems):
                c = cutlass.min(n0 + tCcC[i][0], last_col)
                acc0[i] = acc0[i] + mBias[expert, c].to(cutlass.Float32)
                if cutlass.const_expr(self.gated):
                    accs[1][i] = accs[1][i] + mBias[expert, c + self.n_out].to(cutlass.Float32)
        for i in cutlass.range_constexpr(n_elems):
            x = acc0[i]
            if cutlass.const_expr(self.activation == "swiglu"):
                u = accs[1][i]
                x = silu(x, self.tanh_sigmoid) * u
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
            # tile_t / 4 distinct tokens per thread; clamped so every load is in bounds
            for i in cutlass.range_constexpr(n_elems):
                t = cutlass.min(tCcC[i][1], rows_left - 1)
                acc0[i] = acc0[i] * mRowScale[row0 + t]

    @cute.jit
    def _store(
        self,
        acc: cute.Tensor,
        tCcC: cute.Tensor,
        mC: cute.Tensor,
        row0: cutlass.Int32,
        rows_left: cutlass.Int32,
        n0: cutlass.Int32,
        lane: cutlass.Int32,
    ):
        """Transposed store C[row0 + t, n0 + w] = acc(w, t) as 32-bit (w, w+1) pairs.

        WGMMA C layout per 64-row block: lane l of warp q holds weight rows r = 16 q + l / 4 and
        r + 8, tokens 8 j + 2 (l % 4) + {0, 1}. Lanes l and l ^ 4 hold rows r and r + 1 for the
        same tokens: the lane with even l / 4 keeps token 2c and receives its partner's value
        of token 2c, the other keeps token 2c + 1 and receives its partner's; each then owns the
        pair (rows 2p, 2p+1) of one token: 1 shuffle and 1 store per 2 outputs."""
        n_elems = cute.size(acc)
        odd = (lane & 4) != 0  # this lane holds the odd weight row of the pair
        n_out = self.n_out
        g_base = mC.iterator.toint()
        for j in cutlass.range_constexpr(n_elems // 2):
            # elements 2j, 2j+1: same weight row, tokens (2c, 2c + 1)
            v0 = acc[2 * j]
            v1 = acc[2 * j + 1]
            give = v1
            if odd:
                give = v0
            got = cute.arch.shuffle_sync_bfly(give, 4)
            keep = v0
            if odd:
                keep = v1
            lo = keep
            hi = got
            if odd:
                lo = got
                hi = keep
            wt = tCcC[2 * j]
            w = wt[0]  # even lane: row r (even pair base); odd lane: row r (odd) -> base r - 1
            t = wt[1]
            if odd:
                w = w - 1
                t = t + 1
            col = n0 + w
            pred = t < rows_left
            if cutlass.const_expr(not self.n_out_divisible):
                pred = pred and col < n_out
            if pred:
                pair = cute.make_rmem_tensor(cute.make_layout(2), self.c_dtype)
                pair[0] = lo.to(self.c_dtype)
                pair[1] = hi.to(self.c_dtype)
                g_off = (cutlass.Int64(row0 + t) * n_out + col) * 2
                g_ptr = cute.make_ptr(self.c_dtype, g_base + g_off, cute.AddressSpace.gmem,
                                      assumed_align=4)
                dst = cute.make_tensor(g_ptr, cute.make_layout(2))
                dst.store(pair.load())
