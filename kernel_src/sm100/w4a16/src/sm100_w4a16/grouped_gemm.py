"""W4A16 varlen-M grouped GEMM for MoE experts on SM100 (B200/GB200), written in CuTeDSL.

For every expert ``e`` with rows ``[offsets[e], offsets[e+1])`` of A::

    acc[m, n] = sum_k A[m, k] * Wq[e, n, k]          Wq = e2m1(values) * e4m3(block_scale)
    D[m, :]   = epilogue(acc[m, :] * global_scale[e] (+ bias[e, :]))      bias: optional (drop v4)

BF16 activations, NVFP4 weights (moe_ep's ``NVFP4Weight`` bytes, unchanged), FP32 accumulation in
tensor memory, BF16 output. The routing histogram (``offsets``) lives in device memory and is
walked by the tile scheduler inside the kernel: one compiled kernel serves every histogram (no
host sync, no recompile).

Constraints (``can_implement(epilogue, n, k, num_experts, tile_n)`` returns the first one violated)
------------------------------------------------------------------------------------
* K % 64 == 0 (TILE_K; one 128-byte swizzle row of bf16 per k-tile), K >= 64.
* N_out % 8 == 0 (16-byte output vectors; N_out = N, or I = N / 2 for the gated epilogues). N need
  not be a multiple of the tile: weight rows past N are TMA zero fill and their columns are never stored.
* gated epilogues (swiglu, gelu_glu, gelu_tanh_glu, clamped_swiglu, softcapped_swiglu): N = 2 * I
  even, tile_n <= 128. clamped_swiglu: a finite limit > 0 and a finite alpha and beta;
  softcapped_swiglu: finite caps > 0 (``check_activation_constants``).
* 1 <= E <= 1024 experts; M_total >= 0 (M_total == 0 launches nothing).
* Tensors contiguous, 16-byte aligned base pointers (torch allocations are).

Design
------
* Persistent grid of ``max_active_ctas`` CTAs (normally one per SM). Each CTA reads ``offsets``
  once into shared memory and builds the prefix sum of per-expert m-tile counts (one warp,
  shuffle scan). Expert ``e`` owns the linear tiles ``[cum[e] * n_tiles, cum[e+1] * n_tiles)``;
  inside it the m-tiles go in groups of ``raster_m`` with the m-tile as the fast index, so CTAs
  running at the same time share one weight N-panel. Every role walks the same tile sequence.
* A: ONE TMA descriptor over the ragged ``[M_total, K]`` tensor; a tile starts at row
  ``offsets[e] + m_tile * 128`` (``cute.domain_offset``). Rows past M_total are zero filled; rows
  of the next expert that fall in the tile are computed but never stored.
* W: TMA of the packed bytes ``[E, N, K/2]`` (expert = third coordinate), a (tile_n x 32 B) box
  per k-tile; the e4m3 block scales (rows of K/16 bytes: not TMA-able for K % 256 != 0) are read
  by the dequant warps with 2-byte loads (L1 cached; each 32-byte sector serves 8 k-tiles).
* Warp roles (320 threads): warps 0-3 epilogue (TMEM lanes 0-127), warp 4 MMA, warp 5 TMA,
  warps 6-9 dequant. Pipelines (mbarrier rings)::

      TMA --a_pipe (A bf16, PipelineTmaUmma)-------------------------------> MMA
      TMA --w_pipe (packed fp4, PipelineTmaAsync)--> dequant --b_pipe (bf16, PipelineAsyncUmma)--> MMA
      MMA --acc_pipe (TMEM accumulators x2, PipelineUmmaAsync)--> epilogue

* Dequant: a thread owns (row, half) units of a k-tile: 16 packed bytes = 32 K elements = 2 scale
  blocks. ``cvt.rn.f16x2.e2m1x2`` decodes two codes, ``mul.rn.f16x2`` applies the block scale
  (exact: a product of a 2-bit and a 4-bit significand, |x| in [2^-10, 2688], so f16 holds it),
  and the f16 -> f32 -> bf16x2 conversion is exact too. The bf16 values go to the UMMA's
  K-major 128B-swizzled B buffer: byte ``n * 128 + ((chunk ^ (n % 8)) * 16)`` for the 16-byte
  chunk ``chunk`` (8 K elements) of row n (checked against the MMA's smem layout at trace time).
  Each thread fences (``fence.proxy.async.shared::cta``) before arriving on b_pipe.
* MMA: ``tcgen05.mma`` kind::f16 (bf16 x bf16 -> f32), 128 x tile_n x 16, 4 per k-tile (x2 for
  swiglu: gate and up accumulators side by side in TMEM). ``tcgen05.commit`` releases the A and
  B stages and signals a finished accumulator.
* Epilogue: ``tcgen05.ld.32x32b`` (thread = one row, 32 columns per load), fp32 math (global
  scale, activation, row scale), bf16, predicated 16-byte stores (row < expert end, col < N_out).
  Two TMEM accumulator stages let the next tile's MMAs run during this epilogue. TMEM hand-offs
  between warps use ``tcgen05.wait::ld`` + ``tcgen05.fence::{before,after}_thread_sync`` around
  the mbarrier / named-barrier handshakes; TMEM (2 x num_b x tile_n columns) is allocated by
  epilogue warp 0 and freed after the epilogue warps' last loads.

Tensors (torch view; all contiguous)
------------------------------------
    mA        [M_total, K]      bf16     rows grouped by expert, M_total dynamic
    mWq       [E, N, K/2]       uint8    two E2M1 codes per byte (element 2j = low nibble)
    mWsf      [E, N, K/16]      uint8    float8_e4m3fn block scales viewed as bytes
    mGs       [E]               fp32     per-expert global scale
    mOffsets  [E + 1]           int32    device memory, offsets[0] = 0, offsets[E] = M_total
    mRowScale [M_total]         fp32     read by ``row_scale`` only (else any fp32 tensor)
    mD        [M_total, N_out]  bf16     N_out = N, or I = N / 2 for the gated epilogues
    max_active_ctas             int32    grid size (persistent CTAs)
    mBias     [E, N]            fp32 / bf16, optional (None: no bias; compile time), after the stream
Static (compile key): N, K, E, epilogue, tile_n, raster_m, stage counts, and the activation constants
(clamped_swiglu's alpha / limit / beta / clamp order, softcapped_swiglu's caps; drop v3).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T

try:  # cutlass-dsl >= 4.8; the cutlass.utils aliases still work but warn
    from cutlass.memory import SmemAllocator, TmemAllocator
except ImportError:  # pragma: no cover
    from cutlass.utils import SmemAllocator, TmemAllocator

from .constants import (
    ACTIVATION_CONSTANT_DEFAULTS,
    ALIGN_K_ELEMS,
    ALIGN_N_ELEMS,
    DEFAULT_RASTER_M,
    DEFAULT_TILE_N,
    EPILOGUES,
    GATED_EPILOGUES,
    MAX_EXPERTS,
    MAX_GATED_TILE_N,
    MAX_RASTER_M,
    NUM_DEQUANT_WARPS,
    NUM_EPILOGUE_WARPS,
    SF_BLOCK,
    SMEM_CAPACITY_BYTES,
    TILE_K,
    TILE_M,
    TILE_N_CHOICES,
)

_LOG2E = 1.4426950408889634
_RSQRT2 = 0.7071067811865476
# gelu_tanh(g) = g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3): ex2's argument is
# -g (_GELU_TANH_C1 + _GELU_TANH_C3 g^2) = -2 z log2(e)
_GELU_TANH_C1 = 2.0 * 0.7978845608028654 * _LOG2E
_GELU_TANH_C3 = _GELU_TANH_C1 * 0.044715

# warp roles
_EPI_WARP0 = 0
_MMA_WARP = NUM_EPILOGUE_WARPS
_TMA_WARP = NUM_EPILOGUE_WARPS + 1
_DQ_WARP0 = NUM_EPILOGUE_WARPS + 2
_DQ_THREADS = 32 * NUM_DEQUANT_WARPS
_EPI_THREADS = 32 * NUM_EPILOGUE_WARPS
# named barriers (0 is sync_threads)
_BAR_TMEM_ALLOC = 1
_BAR_EPI = 2

_ACC_STAGES = 2
_EPI_COLS = 32  # accumulator columns per tcgen05.ld (32x32b.x32)
_PACKED_ROW_BYTES = TILE_K // 2  # 32 bytes of e2m1 codes per row and k-tile


def _e2m1x8_to_bf16x8(word: cutlass.Int32, scale: cutlass.Int32):
    """8 E2M1 codes (one 32-bit word, element 2j in the low nibble of byte j) times an f16x2 block
    scale (the same scale in both halves) -> 4 bf16x2 words (element 2j in the low half)."""
    return cute.arch.inline_ptx(
        "{\n"
        ".reg .b8 q0, q1, q2, q3;\n"
        ".reg .b32 h0, h1, h2, h3;\n"
        ".reg .b16 l0, l1, l2, l3, u0, u1, u2, u3;\n"
        ".reg .f32 fl0, fl1, fl2, fl3, fu0, fu1, fu2, fu3;\n"
        "mov.b32 {q0, q1, q2, q3}, {$r0};\n"
        "cvt.rn.f16x2.e2m1x2 h0, q0;\n"
        "cvt.rn.f16x2.e2m1x2 h1, q1;\n"
        "cvt.rn.f16x2.e2m1x2 h2, q2;\n"
        "cvt.rn.f16x2.e2m1x2 h3, q3;\n"
        "mul.rn.f16x2 h0, h0, {$r1};\n"
        "mul.rn.f16x2 h1, h1, {$r1};\n"
        "mul.rn.f16x2 h2, h2, {$r1};\n"
        "mul.rn.f16x2 h3, h3, {$r1};\n"
        "mov.b32 {l0, u0}, h0;\n"
        "mov.b32 {l1, u1}, h1;\n"
        "mov.b32 {l2, u2}, h2;\n"
        "mov.b32 {l3, u3}, h3;\n"
        "cvt.f32.f16 fl0, l0;\n"
        "cvt.f32.f16 fu0, u0;\n"
        "cvt.f32.f16 fl1, l1;\n"
        "cvt.f32.f16 fu1, u1;\n"
        "cvt.f32.f16 fl2, l2;\n"
        "cvt.f32.f16 fu2, u2;\n"
        "cvt.f32.f16 fl3, l3;\n"
        "cvt.f32.f16 fu3, u3;\n"
        "cvt.rn.bf16x2.f32 {$w0}, fu0, fl0;\n"
        "cvt.rn.bf16x2.f32 {$w1}, fu1, fl1;\n"
        "cvt.rn.bf16x2.f32 {$w2}, fu2, fl2;\n"
        "cvt.rn.bf16x2.f32 {$w3}, fu3, fl3;\n"
        "}\n",
        write_only_types=[cutlass.Int32] * 4,
        read_only_args=[word, scale],
    )


def _e4m3x2_to_f16x2_pair(two_scales: cutlass.Int32):
    """Two e4m3 block scales (bytes 0 and 1 of a 32-bit value) -> (s0 s0, s1 s1) as f16x2."""
    return cute.arch.inline_ptx(
        "{\n"
        ".reg .b16 in16, a, b;\n"
        ".reg .b32 s;\n"
        "cvt.u16.u32 in16, {$r0};\n"
        "cvt.rn.f16x2.e4m3x2 s, in16;\n"
        "mov.b32 {a, b}, s;\n"
        "mov.b32 {$w0}, {a, a};\n"
        "mov.b32 {$w1}, {b, b};\n"
        "}\n",
        write_only_types=[cutlass.Int32] * 2,
        read_only_args=[two_scales],
    )


def _tanh_approx(v):
    """``tanh.approx.f32``: one MUFU op, max relative error ~2^-11 (softcapped_swiglu's three tanh)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value()], "tanh.approx.f32 $0, $1;",
                                           "=f,f", has_side_effects=False, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


def _clamped_swiglu(g, u, alpha: float, limit: float, beta: float, after_act: bool):
    """clamped_swiglu of scaled fp32 gate / up values (constants.py), traced inline: the sigmoid as
    ``1 / (1 + 2^(-alpha g log2 e))`` (ex2 + rcp); beta 0 adds nothing. Compile-time constants."""
    lim = cutlass.Float32(limit)
    if not after_act:
        g = cute.arch.fmin(g, lim)
    u = cute.arch.fmax(cute.arch.fmin(u, lim), -lim)
    if beta != 0.0:
        u = u + cutlass.Float32(beta)
    den = cutlass.Float32(1.0) + cute.math.exp2(g * cutlass.Float32(-alpha * _LOG2E), fastmath=True)
    act = g * cute.arch.rcp_approx(den)
    if after_act:  # Step-3.7: clamp the activated gate
        act = cute.arch.fmin(act, lim)
    return u * act


def _softcapped_swiglu(g, u, gate_softcap: float, up_softcap: float):
    """softcapped_swiglu of scaled fp32 gate / up values (constants.py), traced inline: three
    ``tanh.approx``, the sigmoid of the raw gate as ``(1 + tanh(g / 2)) / 2``. Compile-time caps."""
    half = cutlass.Float32(0.5)
    sig = half + half * _tanh_approx(g * half)
    tg = _tanh_approx(g * cutlass.Float32(1.0 / gate_softcap))
    tu = _tanh_approx(u * cutlass.Float32(1.0 / up_softcap))
    return cutlass.Float32(gate_softcap * up_softcap) * tg * tu * sig


def check_activation_constants(epilogue: str, swiglu_alpha: float, swiglu_limit: float, swiglu_beta: float,
                               gate_softcap: float, up_softcap: float) -> Optional[str]:
    """None if the epilogue's activation constants are usable, else the reason (one sentence)."""
    if epilogue == "clamped_swiglu" and not (math.isfinite(swiglu_limit) and swiglu_limit > 0.0
                                             and math.isfinite(swiglu_alpha) and math.isfinite(swiglu_beta)):
        return (f"clamped_swiglu needs a finite swiglu_limit > 0 and finite swiglu_alpha / swiglu_beta, got "
                f"{swiglu_limit}, {swiglu_alpha}, {swiglu_beta}")
    if epilogue == "softcapped_swiglu" and not all(math.isfinite(c) and c > 0.0 for c in (gate_softcap, up_softcap)):
        return f"softcapped_swiglu needs finite gate_softcap and up_softcap > 0, got {gate_softcap} and {up_softcap}"
    return None


def _tcgen05_fence(after: bool) -> None:
    """``tcgen05.fence::{before,after}_thread_sync``: orders this thread's tcgen05 ops (TMEM loads,
    MMAs) against an mbarrier / named-barrier handshake with another warp."""
    kind = nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC
    nvvm.tcgen05_fence(kind)


def can_implement(epilogue: str, n: int, k: int, num_experts: int,
                  tile_n: Optional[int] = None) -> Optional[str]:
    """None if the kernel supports this problem, else the reason it does not (one sentence).

    n: rows of W per expert (N; 2 * I for the gated epilogues), k: reduction size (logical K, not K/2)."""
    if epilogue not in EPILOGUES:
        return f"epilogue must be one of {EPILOGUES}, got {epilogue!r}"
    if tile_n is None:
        tile_n = DEFAULT_TILE_N[epilogue]
    if tile_n not in TILE_N_CHOICES:
        return f"tile_n must be one of {TILE_N_CHOICES}, got {tile_n}"
    if epilogue in GATED_EPILOGUES and tile_n > MAX_GATED_TILE_N:
        return f"{epilogue} needs tile_n <= {MAX_GATED_TILE_N} (two accumulators in TMEM), got {tile_n}"
    if k < TILE_K or k % ALIGN_K_ELEMS != 0:
        return f"K={k} must be a positive multiple of {ALIGN_K_ELEMS} (the k-tile)"
    if k % SF_BLOCK != 0:
        return f"K={k} must be a multiple of the scale block {SF_BLOCK}"
    if n <= 0:
        return f"N={n} must be positive"
    if epilogue in GATED_EPILOGUES and n % 2 != 0:
        return f"{epilogue} needs an even N (= 2 * I), got {n}"
    n_out = n // 2 if epilogue in GATED_EPILOGUES else n
    if n_out % ALIGN_N_ELEMS != 0:
        return f"N_out={n_out} must be a multiple of {ALIGN_N_ELEMS} (16-byte output vectors)"
    if not (1 <= num_experts <= MAX_EXPERTS):
        return f"number of experts must be in [1, {MAX_EXPERTS}], got {num_experts}"
    return None


class W4A16GroupedGemmSm100:
    """Varlen-M W4A16 grouped GEMM (see the module docstring for semantics and layouts).

    :param epilogue: one of ``EPILOGUES`` (compile time); ``NotImplementedError`` otherwise.
    :param tile_n: output tile width, one of (64, 128, 256) (gated epilogues: <= 128).
    :param raster_m: m-tiles per raster group inside an expert.
    :param num_stages: depth of the A / bf16-B rings (None = as many as fit); the packed-W ring
        is two deeper (it is 4x smaller).
    :param swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act: clamped_swiglu's constants;
    :param gate_softcap, up_softcap: softcapped_swiglu's (defaults: ``ACTIVATION_CONSTANT_DEFAULTS``;
        ignored by the other epilogues; drop v3). ``ValueError`` if unusable.
    """

    def __init__(self, epilogue: str, tile_n: Optional[int] = None,
                 raster_m: int = DEFAULT_RASTER_M, num_stages: Optional[int] = None,
                 swiglu_alpha: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_alpha"],
                 swiglu_limit: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_limit"],
                 swiglu_beta: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_beta"],
                 swiglu_limit_after_act: bool = ACTIVATION_CONSTANT_DEFAULTS["swiglu_limit_after_act"],
                 gate_softcap: float = ACTIVATION_CONSTANT_DEFAULTS["gate_softcap"],
                 up_softcap: float = ACTIVATION_CONSTANT_DEFAULTS["up_softcap"]):
        if epilogue not in EPILOGUES:
            raise NotImplementedError(f"epilogue {epilogue!r} is not implemented; one of {EPILOGUES}")
        if tile_n is None:
            tile_n = DEFAULT_TILE_N[epilogue]
        reason = can_implement(epilogue, 2 * ALIGN_N_ELEMS, TILE_K, 1, tile_n)
        if reason is not None:
            raise ValueError(reason)
        if not (1 <= int(raster_m) <= MAX_RASTER_M):
            raise ValueError(f"raster_m must be in [1, {MAX_RASTER_M}], got {raster_m}")
        reason = check_activation_constants(epilogue, float(swiglu_alpha), float(swiglu_limit), float(swiglu_beta),
                                            float(gate_softcap), float(up_softcap))
        if reason is not None:
            raise ValueError(reason)
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.swiglu_beta, self.swiglu_limit_after_act = float(swiglu_beta), bool(swiglu_limit_after_act)
        self.gate_softcap, self.up_softcap = float(gate_softcap), float(up_softcap)
        self.epilogue = epilogue
        self.gated = epilogue in GATED_EPILOGUES
        self.num_b = 2 if self.gated else 1  # B tiles / accumulators per output tile
        self.tile_m, self.tile_n, self.tile_k = TILE_M, tile_n, TILE_K
        self.raster_m = int(raster_m)
        self.num_stages_override = num_stages
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cutlass.BFloat16
        self.d_dtype = cutlass.BFloat16
        self.threads_per_cta = 32 * (NUM_EPILOGUE_WARPS + 2 + NUM_DEQUANT_WARPS)
        # dequant work split: unit = (row, half of the 32 packed bytes); 2 units per row
        self.units_per_thread = 2 * tile_n // _DQ_THREADS
        assert self.units_per_thread * _DQ_THREADS == 2 * tile_n
        self.tmem_cols = _ACC_STAGES * self.num_b * tile_n
        assert self.tmem_cols <= 512

    # ------------------------------------------------------------------ host helpers
    def static_shapes(self, n: int, k: int, num_experts: int = 1) -> Tuple[int, int]:
        """(N_out, n_tiles) for weights with N rows and K columns; raises ValueError with the
        ``can_implement`` reason if unsupported."""
        reason = can_implement(self.epilogue, n, k, num_experts, self.tile_n)
        if reason is not None:
            raise ValueError(reason)
        n_out = n // 2 if self.gated else n
        return n_out, (n_out + self.tile_n - 1) // self.tile_n

    def stage_counts(self, num_experts: int) -> Tuple[int, int]:
        """(stages of the A / bf16-B rings, stages of the packed-W ring) that fit in smem."""
        a_bytes = self.tile_m * self.tile_k * 2
        b_bytes = self.num_b * self.tile_n * self.tile_k * 2
        w_bytes = self.num_b * self.tile_n * _PACKED_ROW_BYTES
        reserved = 2048 + 8 * (num_experts + 1)  # mbarriers, tmem slot, scheduler arrays, align
        stages = 2
        while (stages < 6 and reserved + (stages + 1) * (a_bytes + b_bytes)
               + (stages + 3) * w_bytes <= SMEM_CAPACITY_BYTES):
            stages += 1
        if self.num_stages_override is not None:
            stages = max(2, min(stages, int(self.num_stages_override)))
        if reserved + stages * (a_bytes + b_bytes) + (stages + 2) * w_bytes > SMEM_CAPACITY_BYTES:
            raise ValueError("tile too large: two pipeline stages do not fit in shared memory")
        return stages, stages + 2

    def smem_bytes(self, num_experts: int) -> int:
        """Estimate of the shared memory the kernel asks for (bytes); after a compile,
        ``self.smem_size`` holds the exact SharedStorage size."""
        s, sw = self.stage_counts(num_experts)
        return (2048 + 8 * (num_experts + 1) + s * (self.tile_m + self.num_b * self.tile_n)
                * self.tile_k * 2 + sw * self.num_b * self.tile_n * _PACKED_ROW_BYTES)

    def _check_b_layout(self, b_smem_layout) -> None:
        """The dequant warps write B with the closed form ``n * 64 + k`` elements (then the 128B
        swizzle on the byte address); make sure the MMA's smem layout is exactly that."""
        outer = b_smem_layout.outer
        for n in range(self.tile_n):
            for k in (0, 1, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63):
                got = outer(((n, k % 16), 0, k // 16, 1))
                want = n * self.tile_k + k + self.tile_n * self.tile_k
                assert got == want, f"unexpected B smem layout {outer}: ({n},{k}) -> {got} != {want}"
        assert str(b_smem_layout.inner) == "S<3,4,3>", f"unexpected B swizzle {b_smem_layout.inner}"

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mWq: cute.Tensor,
        mWsf: cute.Tensor,
        mGs: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mD: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
        mBias: Optional[cute.Tensor] = None,
    ):
        if cutlass.const_expr(mA.element_type != cutlass.BFloat16 or mD.element_type != cutlass.BFloat16):
            raise TypeError("A and D must be bfloat16")
        if cutlass.const_expr(mWq.element_type != cutlass.Uint8 or mWsf.element_type != cutlass.Uint8):
            raise TypeError("packed values and block scales must be uint8 (scales: e4m3 bytes)")
        if cutlass.const_expr(mGs.element_type != cutlass.Float32 or mRowScale.element_type != cutlass.Float32):
            raise TypeError("global_scale and row_scale must be float32")
        if cutlass.const_expr(mOffsets.element_type != cutlass.Int32):
            raise TypeError("offsets must be int32")
        if cutlass.const_expr(mBias is not None and mBias.element_type not in (cutlass.Float32, cutlass.BFloat16)):
            raise TypeError("bias must be float32 or bfloat16")
        num_experts = cute.size(mOffsets, mode=[0]) - 1
        n_rows = cute.size(mWq, mode=[1])
        k_size = 2 * cute.size(mWq, mode=[2])
        n_out, n_tiles = self.static_shapes(n_rows, k_size, num_experts)
        self.num_experts = num_experts
        self.n_rows = n_rows
        self.k_size = k_size
        self.n_out = n_out
        self.n_tiles = n_tiles
        self.k_tiles = k_size // self.tile_k
        self.num_stages, self.num_w_stages = self.stage_counts(num_experts)
        if cutlass.const_expr(mBias is not None and (cute.size(mBias, mode=[0]) != num_experts
                                                     or cute.size(mBias, mode=[1]) != n_rows)):
            raise ValueError("bias must be [E, N]")

        mma_op = tcgen05.MmaF16BF16Op(
            self.ab_dtype, self.acc_dtype, (self.tile_m, self.tile_n, 16), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM, OperandMajorMode.K, OperandMajorMode.K,
        )
        tiled_mma = cute.make_tiled_mma(mma_op)
        mma_tiler = (self.tile_m, self.tile_n, self.tile_k)
        a_smem_layout = sm100_utils.make_smem_layout_a(tiled_mma, mma_tiler, self.ab_dtype, self.num_stages)
        # B slots: slot s * num_b + h holds stage s of B half h (swiglu: h=0 gate, h=1 up)
        b_smem_layout = sm100_utils.make_smem_layout_b(
            tiled_mma, mma_tiler, self.ab_dtype, self.num_stages * self.num_b
        )
        self._check_b_layout(b_smem_layout)
        # packed weights: plain row-major (tile_n, 32 B) boxes, one per slot
        w_slots = self.num_w_stages * self.num_b
        w_smem_layout = cute.make_layout(
            (self.tile_n, _PACKED_ROW_BYTES, w_slots),
            stride=(_PACKED_ROW_BYTES, 1, self.tile_n * _PACKED_ROW_BYTES),
        )

        tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE),
            mA,
            cute.slice_(a_smem_layout, (None, None, None, 0)),
            mma_tiler,
            tiled_mma,
        )
        # packed W as (N, K/2, E): the expert is the third TMA coordinate
        mWq_nke = cute.make_tensor(mWq.iterator, cute.select(mWq.layout, mode=[1, 2, 0]))
        tma_atom_w, tma_tensor_w = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mWq_nke,
            cute.slice_(w_smem_layout, (None, None, 0)),
            (self.tile_n, _PACKED_ROW_BYTES),
        )
        self.a_tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, None, 0)))
        self.w_tx_bytes = self.num_b * self.tile_n * _PACKED_ROW_BYTES
        self.b_slot_bytes = self.tile_n * self.tile_k * 2
        self.w_slot_bytes = self.tile_n * _PACKED_ROW_BYTES

        @cute.struct
        class SharedStorage:
            a_mbar: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            w_mbar: cute.struct.MemRange[cutlass.Int64, self.num_w_stages * 2]
            b_mbar: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, _ACC_STAGES * 2]
            tmem_holding: cutlass.Int32
            # offsets[0..E] and inclusive prefix sum of m-tiles per expert
            sched_off: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            sched_cum: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_smem_layout)], 128]

        self.shared_storage = SharedStorage
        self.smem_size = SharedStorage.size_in_bytes()  # what the launch asks for (bytes)
        if cutlass.const_expr(self.smem_size > SMEM_CAPACITY_BYTES):
            raise ValueError(f"shared storage {self.smem_size} B exceeds {SMEM_CAPACITY_BYTES} B")

        self.kernel(
            tiled_mma, tma_atom_a, tma_tensor_a, tma_atom_w, tma_tensor_w,
            mWsf, mGs, mOffsets, mRowScale, mD,
            a_smem_layout, b_smem_layout, w_smem_layout, mBias,
        ).launch(
            grid=[max_active_ctas, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=[1, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ scheduler helper
    @cute.jit
    def _locate(self, sOff: cute.Tensor, sCum: cute.Tensor, tile_id: cutlass.Int32,
                expert: cutlass.Int32):
        """Linear tile -> (expert, first row of the tile, end row of the expert, n-tile).
        ``expert`` only grows along a CTA's tile sequence, so the search resumes from it."""
        n_tiles = self.n_tiles
        m_tile_global = tile_id // n_tiles
        e = expert
        while sCum[e + 1] <= m_tile_global:
            e = e + 1
        m_tiles_e = sCum[e + 1] - sCum[e]
        local = tile_id - sCum[e] * n_tiles
        group_tiles = self.raster_m * n_tiles
        g = local // group_tiles
        g_rows = cutlass.min(self.raster_m, m_tiles_e - g * self.raster_m)
        r = local - g * group_tiles
        m_local = g * self.raster_m + r % g_rows
        n_tile = r // g_rows
        row0 = sOff[e] + m_local * self.tile_m
        return e, row0, sOff[e + 1], n_tile

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_w: cute.CopyAtom,
        mW_tma: cute.Tensor,
        mWsf: cute.Tensor,
        mGs: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mD: cute.Tensor,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        w_smem_layout: cute.Layout,
        mBias: Optional[cute.Tensor],
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        if warp_idx == _TMA_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_w)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        num_experts = self.num_experts
        sOff = storage.sched_off.get_tensor(cute.make_layout(num_experts + 1))
        sCum = storage.sched_cum.get_tensor(cute.make_layout(num_experts + 1))

        # ---- scheduler prologue: the MMA warp scans per-expert m-tile counts (warp 0 inits
        # the mbarriers meanwhile); the CTA barrier below publishes sOff / sCum
        if warp_idx == _MMA_WARP:
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
                for s in cutlass.range_constexpr(5):  # inclusive warp scan
                    v = cute.arch.shuffle_sync_up(cnt, 1 << s)
                    if lane >= (1 << s):
                        cnt = cnt + v
                cnt = cnt + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)

        # ---- pipelines (barrier init by warp 0; one fence + CTA barrier for all of them)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        a_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.a_mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=one_thread, consumer_group=one_thread,
            tx_count=self.a_tx_bytes, defer_sync=True,
        )
        # dequant consumers: lane 0 of each warp releases a stage (after a warp sync)
        w_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.w_mbar.data_ptr(), num_stages=self.num_w_stages,
            producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_DEQUANT_WARPS),
            tx_count=self.w_tx_bytes, defer_sync=True,
        )
        # every dequant thread arrives (after its own async-proxy fence)
        b_pipe = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.b_mbar.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _DQ_THREADS),
            consumer_group=one_thread, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(), num_stages=_ACC_STAGES,
            producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _EPI_THREADS),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True,
        )
        tmem = TmemAllocator(
            storage.tmem_holding.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=_BAR_TMEM_ALLOC, num_threads=_EPI_THREADS + 32
            ),
            allocator_warp_id=_EPI_WARP0,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sW = storage.sW.get_tensor(w_smem_layout)

        total_tiles = sCum[num_experts] * self.n_tiles
        k_tiles = self.k_tiles

        # =========================================================== TMA warp
        if warp_idx == _TMA_WARP:
            a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_w_stages)
            thr_mma = tiled_mma.get_slice(0)
            expert = cutlass.Int32(0)
            tile_id = bidx
            while tile_id < total_tiles:
                expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                # A rows [row0, row0 + 128) of the ragged tensor: (bM, bK, RestK)
                gA = cute.local_tile(cute.domain_offset((row0, 0), mA_tma),
                                     (self.tile_m, self.tile_k), (0, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1),
                    cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3),
                )
                # packed W rows [n0, n0 + tile_n) (+ up rows at I + n0 for swiglu: an element
                # offset, so I need not be a multiple of the tile): (bN, 32 B, RestK)
                n0 = n_tile * self.tile_n
                tWgWs = []
                tWsW = None
                for h in cutlass.range_constexpr(self.num_b):
                    gW = cute.local_tile(cute.domain_offset((n0 + h * self.n_out, 0, 0), mW_tma),
                                         (self.tile_n, _PACKED_ROW_BYTES), (0, None, expert))
                    tWsW, tWgW = cpasync.tma_partition(
                        tma_atom_w, 0, cute.make_layout(1),
                        cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2),
                    )
                    tWgWs.append(tWgW)
                for kt in range(k_tiles):
                    a_pipe.producer_acquire(a_state)
                    cute.copy(tma_atom_a, tAgA[(None, kt)], tAsA[(None, a_state.index)],
                              tma_bar_ptr=a_pipe.producer_get_barrier(a_state))
                    a_state.advance()
                    w_pipe.producer_acquire(w_state)
                    for h in cutlass.range_constexpr(self.num_b):
                        cute.copy(tma_atom_w, tWgWs[h][(None, kt)],
                                  tWsW[(None, w_state.index * self.num_b + h)],
                                  tma_bar_ptr=w_pipe.producer_get_barrier(w_state))
                    w_state.advance()
                tile_id = tile_id + gdim
            a_pipe.producer_tail(a_state)
            w_pipe.producer_tail(w_state)

        # =========================================================== dequant warps
        if warp_idx >= _DQ_WARP0:
            self._dequant_loop(w_pipe, b_pipe, sW, sB, mWsf, sOff, sCum, total_tiles,
                               tidx - 32 * _DQ_WARP0, bidx, gdim)

        # =========================================================== MMA warp
        acc_shape = tiled_mma.partition_shape_C((self.tile_m, self.tile_n))
        # (MMA, MMA_M, MMA_N, slot): slot = acc stage * num_b + h
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, _ACC_STAGES * self.num_b))
        if warp_idx == _MMA_WARP:
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), tCtAcc_fake.layout)
            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            num_k_blocks = cute.size(tCrA, mode=[2])
            a_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, _ACC_STAGES)
            tile_id = bidx
            while tile_id < total_tiles:
                acc_pipe.producer_acquire(acc_state)  # the epilogue has drained this stage
                _tcgen05_fence(after=True)  # ... and its TMEM loads are ordered before our MMAs
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kt in range(k_tiles):
                    a_pipe.consumer_wait(a_state)
                    b_pipe.consumer_wait(b_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        for h in cutlass.range_constexpr(self.num_b):
                            acc = tCtAcc[(None, None, None, acc_state.index * self.num_b + h)]
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, a_state.index)],
                                      tCrB[(None, None, kb, b_state.index * self.num_b + h)], acc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    # tcgen05.commit: the stages are released once these MMAs have read them
                    a_pipe.consumer_release(a_state)
                    b_pipe.consumer_release(b_state)
                    a_state.advance()
                    b_state.advance()
                acc_pipe.producer_commit(acc_state)  # accumulator ready once the MMAs finish
                acc_state.advance()
                tile_id = tile_id + gdim
            acc_pipe.producer_tail(acc_state)

        # =========================================================== epilogue warps
        if warp_idx < NUM_EPILOGUE_WARPS:
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tmem.relinquish_alloc_permit()
            tCtAcc = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            self._epilogue_loop(tiled_mma, acc_pipe, tCtAcc, mGs, mRowScale, mD, sOff, sCum,
                                total_tiles, tidx, bidx, gdim, mBias)
            # every TMEM load of this CTA is done (the MMAs finished before the last commit)
            _tcgen05_fence(after=False)
            pipeline.NamedBarrier(barrier_id=_BAR_EPI, num_threads=_EPI_THREADS).arrive_and_wait()
            _tcgen05_fence(after=True)
            tmem.free(tmem_ptr)

    # ------------------------------------------------------------------ dequant role
    @cute.jit
    def _load_u16(self, addr: cutlass.Int64) -> cutlass.Uint16:
        """One 2-byte global load (two e4m3 block scales)."""
        p = cute.make_ptr(cutlass.Uint16, addr, cute.AddressSpace.gmem, assumed_align=2)
        return cute.make_tensor(p, cute.make_layout(1))[0]

    @cute.jit
    def _dequant_loop(self, w_pipe, b_pipe, sW: cute.Tensor, sB: cute.Tensor, mWsf: cute.Tensor,
                      sOff: cute.Tensor, sCum: cute.Tensor, total_tiles: cutlass.Int32,
                      dq_tidx: cutlass.Int32, bidx: cutlass.Int32, gdim: cutlass.Int32):
        """packed e2m1 (sW) x e4m3 block scales (global) -> bf16 in the UMMA B layout (sB).

        Thread ``t`` owns units ``t + 128 * u`` (u < units_per_thread); unit = (row, half):
        row = unit // 2 of the tile, half = which 16 packed bytes (32 K elements, 2 scale blocks)
        of the k-tile. A warp covers 16 whole rows per unit: its 16-byte smem reads are one
        contiguous 512-byte span, and its swizzled 16-byte writes hit every bank 4 times (the
        minimum for 512 bytes)."""
        upt = self.units_per_thread
        nb = self.num_b
        sf_row_bytes = self.k_size // SF_BLOCK
        w_base = sW.iterator.toint()
        b_base = sB.iterator.toint()
        sf_base = mWsf.iterator.toint()
        w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_w_stages)
        b_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # per-unit constants: smem byte offsets inside a slot
        rows = []
        r_off = []  # packed bytes: row * 32 + half * 16
        b_off = []  # bf16 chunks: row * 128, chunk = half * 4 + j, XOR row % 8 (128B swizzle)
        halves = []
        for u in cutlass.range_constexpr(upt):
            unit = dq_tidx + _DQ_THREADS * u
            row = unit // 2
            half = unit % 2
            rows.append(row)
            halves.append(half)
            r_off.append(row * _PACKED_ROW_BYTES + half * 16)
            b_off.append(row * (self.tile_k * 2))
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, _row0, _row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            # byte offset of this unit's 2 scales of k-tile 0 (rows past N read row N - 1: those
            # columns are TMA zero fill and never stored)
            sf_off = []
            for u in cutlass.range_constexpr(upt):
                for h in cutlass.range_constexpr(nb):
                    g_row = cutlass.min(n_tile * self.tile_n + h * self.n_out + rows[u], self.n_rows - 1)
                    sf_off.append((cutlass.Int64(expert) * self.n_rows + g_row) * sf_row_bytes
                                  + halves[u] * 2)
            # scale registers, one k-tile ahead: the 2-byte loads of k-tile kt + 1 are issued
            # before the waits of k-tile kt (a clamped re-read at the last k-tile is harmless)
            sc = cute.make_rmem_tensor((upt * nb,), cutlass.Int32)
            for i in cutlass.range_constexpr(upt * nb):
                sc[i] = cutlass.Int32(self._load_u16(sf_base + sf_off[i]))
            for kt in range(self.k_tiles):
                kt_next = cutlass.min(kt + 1, self.k_tiles - 1)
                sc_next = cute.make_rmem_tensor((upt * nb,), cutlass.Int32)
                for i in cutlass.range_constexpr(upt * nb):
                    sc_next[i] = cutlass.Int32(self._load_u16(sf_base + sf_off[i] + kt_next * 4))
                w_pipe.consumer_wait(w_state)
                b_pipe.producer_acquire(b_state)
                # one unit at a time (load 16 B, convert, store 64 B): few live registers
                for u in cutlass.range_constexpr(upt):
                    for h in cutlass.range_constexpr(nb):
                        p = cute.make_ptr(cutlass.Int32,
                                          w_base + (w_state.index * nb + h) * self.w_slot_bytes + r_off[u],
                                          cute.AddressSpace.smem, assumed_align=16)
                        packed = cute.make_rmem_tensor((4,), cutlass.Int32)
                        packed.store(cute.make_tensor(p, cute.make_layout(4)).load())
                        s_lo, s_hi = _e4m3x2_to_f16x2_pair(sc[u * nb + h])
                        row_base = b_base + (b_state.index * nb + h) * self.b_slot_bytes + b_off[u]
                        for j in cutlass.range_constexpr(4):
                            # words 0-1: elements 0-15 (scale block 0), words 2-3: block 1
                            o = cute.make_rmem_tensor((4,), cutlass.Int32)
                            o[0], o[1], o[2], o[3] = _e2m1x8_to_bf16x8(packed[j], s_lo if j < 2 else s_hi)
                            chunk = (halves[u] * 4 + j) ^ (rows[u] % 8)  # 128B swizzle
                            q = cute.make_ptr(cutlass.Int32, row_base + chunk * 16,
                                              cute.AddressSpace.smem, assumed_align=16)
                            cute.make_tensor(q, cute.make_layout(4)).store(o.load())
                cute.arch.sync_warp()  # every lane has read the stage before lane 0 releases it
                w_pipe.consumer_release(w_state)
                w_state.advance()
                # generic-proxy writes -> visible to the tensor core (async proxy), then arrive
                cute.arch.fence_proxy("async.shared", space="cta")
                b_pipe.producer_commit(b_state)
                b_state.advance()
                for i in cutlass.range_constexpr(upt * nb):
                    sc[i] = sc_next[i]
            tile_id = tile_id + gdim
        b_pipe.producer_tail(b_state)

    # ------------------------------------------------------------------ epilogue role
    def _up(self, acc_up, gs, mBias: Optional[cute.Tensor], expert, bcol):
        """A gated epilogue's up value: acc * gs, plus its bias (row I + j of the expert's bias; drop v4)."""
        u = acc_up * gs
        if cutlass.const_expr(mBias is not None):
            u = u + mBias[expert, self.n_out + bcol].to(self.acc_dtype)
        return u

    @cute.jit
    def _epilogue_loop(self, tiled_mma: cute.TiledMma, acc_pipe, tCtAcc: cute.Tensor,
                       mGs: cute.Tensor, mRowScale: cute.Tensor, mD: cute.Tensor,
                       sOff: cute.Tensor, sCum: cute.Tensor, total_tiles: cutlass.Int32,
                       tidx: cutlass.Int32, bidx: cutlass.Int32, gdim: cutlass.Int32,
                       mBias: Optional[cute.Tensor]):
        """TMEM -> registers (thread = one row, 32 columns per load; 16 for a gated one with a bias) ->
        fp32 epilogue (with the bias, drop v4) -> bf16 -> predicated 16-byte global stores."""
        nb = self.num_b
        # (row, col) of every accumulator element in the CTA tile, partitioned like the acc
        tCcAcc = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        # a gated epilogue with a bias holds two accumulators and two bias rows per column: 16 columns per
        # load keeps it in registers (32 spill 24 bytes at ptxas's 168 for 320 threads); else 32
        epi_cols = _EPI_COLS
        if cutlass.const_expr(self.gated and mBias is not None):
            epi_cols = _EPI_COLS // 2
        epi_tiler = ((self.tile_m, epi_cols),)
        tAcc_epi0 = cute.zipped_divide(tCtAcc[(None, None, None, 0)], epi_tiler)
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(
                tcgen05.Ld32x32bOp(tcgen05.Repetition.x32 if epi_cols == 32 else tcgen05.Repetition.x16),
                self.acc_dtype),
            tAcc_epi0[(None, 0)],
        )
        thr_t2r = t2r.get_slice(tidx)
        # (T2R, T2R_M, n_chunks) coordinates
        tDcC = thr_t2r.partition_D(cute.zipped_divide(tCcAcc, epi_tiler))
        n_chunks = self.tile_n // epi_cols
        frag_shape = tDcC[(None, None, 0)].shape
        r_acc = [cute.make_rmem_tensor(frag_shape, self.acc_dtype) for _ in range(nb)]
        r_out = cute.make_rmem_tensor((8, epi_cols // 8), self.d_dtype)
        n_frag = cute.size(r_acc[0])
        d_base = mD.iterator.toint()
        n_out = self.n_out

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, _ACC_STAGES)
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            rows_left = row_end - row0
            col0 = n_tile * self.tile_n
            gs = mGs[expert]
            row = tDcC[(0, 0, 0)][0]  # this thread's row in the tile (one TMEM lane)
            rs = cutlass.Float32(1.0)
            if cutlass.const_expr(self.epilogue == "row_scale"):
                rs = mRowScale[row0 + cutlass.min(row, rows_left - 1)]
            acc_pipe.consumer_wait(acc_state)
            _tcgen05_fence(after=True)  # the MMAs' TMEM writes before our loads
            tAcc = [cute.zipped_divide(tCtAcc[(None, None, None, acc_state.index * nb + h)], epi_tiler)
                    for h in range(nb)]
            for c in cutlass.range_constexpr(n_chunks):
                for h in cutlass.range_constexpr(nb):
                    cute.copy(t2r, thr_t2r.partition_S(tAcc[h])[(None, None, c)], r_acc[h])
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before reading them
                for i in cutlass.range_constexpr(n_frag):
                    x = r_acc[0][i] * gs
                    bcol = None
                    if cutlass.const_expr(mBias is not None):
                        # the same address in every thread of the warp (one row per thread): a
                        # broadcast load; columns past N_out read the last one and are never stored
                        bcol = cutlass.min(col0 + tDcC[(i, 0, c)][1], n_out - 1)
                        x = x + mBias[expert, bcol].to(self.acc_dtype)
                    if cutlass.const_expr(self.epilogue == "squared_relu"):
                        x = cute.arch.fmax(x, cutlass.Float32(0.0))
                        x = x * x
                    elif cutlass.const_expr(self.epilogue == "row_scale"):
                        x = x * rs
                    elif cutlass.const_expr(self.epilogue == "swiglu"):
                        u = self._up(r_acc[1][i], gs, mBias, expert, bcol)
                        # silu(g) = g / (1 + 2^(-g * log2(e)))
                        den = cutlass.Float32(1.0) + cute.math.exp2(-x * _LOG2E, fastmath=True)
                        x = x * cute.arch.rcp_approx(den) * u
                    elif cutlass.const_expr(self.epilogue == "gelu_glu"):
                        u = self._up(r_acc[1][i], gs, mBias, expert, bcol)
                        x = cutlass.Float32(0.5) * x * (cutlass.Float32(1.0) + cute.math.erf(x * _RSQRT2)) * u
                    elif cutlass.const_expr(self.epilogue == "gelu_tanh_glu"):
                        u = self._up(r_acc[1][i], gs, mBias, expert, bcol)
                        # g * sigmoid(2 z): no cancellation where 1 + tanh(z) is tiny (ex2 -> inf, -0)
                        arg = x * (cutlass.Float32(-_GELU_TANH_C1) - cutlass.Float32(_GELU_TANH_C3) * (x * x))
                        den = cutlass.Float32(1.0) + cute.math.exp2(arg, fastmath=True)
                        x = x * cute.arch.rcp_approx(den) * u
                    elif cutlass.const_expr(self.epilogue == "clamped_swiglu"):
                        u = self._up(r_acc[1][i], gs, mBias, expert, bcol)
                        x = _clamped_swiglu(x, u, self.swiglu_alpha, self.swiglu_limit, self.swiglu_beta,
                                            self.swiglu_limit_after_act)
                    elif cutlass.const_expr(self.epilogue == "softcapped_swiglu"):
                        u = self._up(r_acc[1][i], gs, mBias, expert, bcol)
                        x = _softcapped_swiglu(x, u, self.gate_softcap, self.up_softcap)
                    r_out[(i % 8, i // 8)] = x.to(self.d_dtype)
                # the 32 columns of a tcgen05.ld.32x32b.x32 are consecutive: 4 vectors of 8
                for v in cutlass.range_constexpr(epi_cols // 8):
                    col = col0 + tDcC[(8 * v, 0, c)][1]
                    if row < rows_left and col < n_out:
                        off = (cutlass.Int64(row0 + row) * n_out + col) * 2
                        p = cute.make_ptr(self.d_dtype, d_base + off, cute.AddressSpace.gmem,
                                          assumed_align=16)
                        cute.make_tensor(p, cute.make_layout(8)).store(r_out[(None, v)].load())
            # all loads of this stage have completed (wait::ld above): hand it back to the MMA warp
            _tcgen05_fence(after=False)
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            tile_id = tile_id + gdim
