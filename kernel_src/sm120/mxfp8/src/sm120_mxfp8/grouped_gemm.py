"""Varlen-M MXFP8 grouped GEMM for MoE experts on SM120 (RTX PRO 6000 / RTX 50xx), in CuTeDSL.

For every expert ``e`` with token rows ``[offsets[e], offsets[e+1])`` of the activations::

    H[m, n] = sum_k  X[m, k] * 2^(sfx[m, k/32] - 127)  *  W[e, n, k] * 2^(sfw[e, n, k/32] - 127)
    swiglu     out[m, j] = silu(H[m, j]) * H[m, I + j]        j < I = N / 2        (FC1)
    row_scale  out[m, n] = H[m, n] * row_scale[m]                                  (FC2)
    identity   out[m, n] = H[m, n]
    gelu_glu, gelu_tanh_glu, clamped_swiglu, softcapped_swiglu: act(H[m, j], H[m, I + j]) as
               constants.py defines them (drop v2; FC1)

e4m3 values with one E8M0 (power of two) scale per 32 consecutive K values (OCP MX; the layout of
moe_ep's ``MXFP8Tensor``), fp32 accumulation, bf16 output. The routing histogram (``offsets``)
lives in device memory and is walked by the tile scheduler inside the kernel: one compiled kernel
serves every histogram (no host sync, no recompile).

Constraints (``can_implement`` returns the reason when one fails)
-----------------------------------------------------------------
* ``K % 128 == 0``: a pipeline stage is 128 K values (one 128-byte swizzled smem row per weight
  row / token) and carries 4 scale bytes per row, loaded with one 4-byte cp.async (so the scale
  row stride K/32 must be a multiple of 4 bytes).
* ``N_out % 8 == 0`` (N_out = I for the gated epilogues, else N): vector stores of the bf16 output.
  The gated ones need an even N = 2 I; clamped_swiglu a finite limit > 0 and finite alpha / beta,
  softcapped_swiglu finite caps > 0 (``check_activation_constants``). N need not be a multiple of
  the tile: weight rows past N are TMA zero fill and their outputs are never stored.
* ``tile_tokens`` in (8, 16, 32, 64, 128): tokens per CTA tile (compile time). An expert with more
  tokens gets several token tiles; a tile never mixes experts (rows of the next expert that fall
  into a tile are computed and masked at the store).
* ``num_experts <= 1024``; shared memory <= 99 KB (SM120's per-block limit), >= 2 stages.
* All tensors contiguous, 16-byte aligned base pointers (torch allocations are).

Design
------
* Swap-AB: the block-scaled warp MMA ``mma.sync.m16n8k32.kind::mxf8f6f4.block_scale`` takes
  **weight rows as its M side** (A operand, 16 rows per atom) and **tokens as its N side** (B
  operand, 8 per atom); hence the names W (MMA A) and X (MMA B) below. Decode (a few tokens per expert) then wastes no MMA rows: 8 tokens fill an
  n8 atom, while 128 weight rows per CTA tile stream through. Every weight byte is read once per
  token tile, i.e. once per expert when the expert has <= tile_tokens tokens.
* Persistent grid (one CTA per SM). Each CTA reads ``offsets`` into smem and builds the prefix sum
  of per-expert token tiles (one warp, shuffle scan). Linear tile ``t`` is (token tile ``t // n_tiles``
  of the expert owning it, weight-row tile ``t % n_tiles``): the CTAs running at the same time work
  on one expert's weight panel. Experts without tokens own no tiles and cost nothing.
* Warp specialization: MMA warps ``0 .. 4*warps_n - 1`` and one producer warp. The producer
  issues TMA (128-byte swizzle; one elected lane) for the weight tile (two 64-row boxes) and the
  token tile after lane 0's ``arrive.expect_tx``; all 32 lanes load the scale bytes with 4-byte
  ``cp.async`` into the same stage and arrive on the stage's "full" mbarrier with
  ``cp.async.mbarrier.arrive.noinc`` (barrier count 1 + 32: the expect_tx arrival plus one per
  lane). Each MMA thread arrives on the stage's "empty" mbarrier when it has read the stage
  (count = MMA threads; a ``fence.proxy.async`` first orders its ldmatrix reads before the TMA
  refill). Phases are tracked explicitly: the consumer waits ``full[s]`` with parity ``phase``,
  the producer waits ``empty[s]`` with ``phase ^ 1`` (so its first lap passes), and both flip
  ``phase`` when ``s`` wraps. At the end the producer drains (waits until every stage it filled
  has been released) so no cp.async of an exited warp is still in flight.
* MMA warps: warp ``(wm, wn)`` owns weight rows ``32 wm .. 32 wm + 31`` of the tile (two m16 atoms)
  and tokens ``wn * tile_tokens / warps_n ..`` of it. Fragments come from smem with ``ldmatrix``
  (addresses computed against the 128-byte swizzle, conflict free); the scales of a row for the
  4 k-steps of a stage are one 32-bit smem word, and each k-step hands the MMA its byte.
  Scale-operand fragments (scale_vec::1X, thread-id 0): lane ``l`` supplies the A scale of MMA row
  ``8 (l % 2) + l / 4`` and the B scale of token ``l / 4`` (CUTLASS ``SM120_16x8x32_TN_VS``).
* gated: a tile covers output features ``[j0, j0 + 64)``; smem rows 0..63 hold gate rows
  ``j0 ..`` and rows 64..127 up rows ``I + j0 ..`` (two TMA boxes). MMA atom ``a`` takes rows
  0-7 from gate rows ``8a ..`` and rows 8-15 from up rows ``8a ..``, so in the m16n8 C fragment a
  thread holds gate (row g) and the matching up (row g + 8) for the same feature and tokens.
* Epilogue per warp, 8 tokens at a time: fp32 math (act(gate, up), or * row_scale[m]), bf16, a small
  per-warp smem transpose (token-major), then 16-byte (8-byte for the gated ones) coalesced stores of
  whole row segments, masked by ``token < expert end`` and ``feature < N_out``.

Tensors (torch view; all contiguous)
------------------------------------
    mX        [M_total, K]        uint8  e4m3 bits of the activations, rows grouped by expert
    mSFX      [M_total, K / 32]   uint8  E8M0 scale codes of mX
    mW        [E, N, K]           uint8  e4m3 bits of the weights (gated: N = 2 I, gate rows first)
    mSFW      [E, N, K / 32]      uint8  E8M0 scale codes of mW
    mOut      [M_total, N_out]    bf16   N_out = I (gated) or N
    mOffsets  [E + 1]             int32  device memory, offsets[0] = 0, offsets[E] = M_total
    mRowScale [M_total]           fp32   read only by row_scale (else any fp32 tensor)
    max_active_ctas               int32  grid size (persistent CTAs, normally the SM count)
Static (compile key): N, K, E, epilogue, tile_tokens, num_stages, the activation constants (drop v2).
M_total is dynamic.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cutlass_dsl import T

try:  # newer location; the old one still works but warns
    from cutlass.memory import SmemAllocator
except Exception:  # pragma: no cover
    from cutlass.utils import SmemAllocator

from .constants import (
    ACTIVATION_CONSTANT_DEFAULTS,
    ALIGN_K,
    ALIGN_N,
    DEFAULT_TILE_TOKENS,
    EPILOGUES,
    GATED_EPILOGUES,
    MAX_EXPERTS,
    MAX_STAGES,
    MMA_WARPS_M,
    MX_BLOCK,
    OUT_FEATURES_PER_TILE,
    SMEM_LIMIT,
    TILE_K,
    TILE_TOKENS,
    TILE_W,
)

_LOG2E = 1.4426950408889634
_RSQRT2 = 0.7071067811865476
# gelu_tanh(g) = g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3): ex2's argument is
# -g (_GELU_TANH_C1 + _GELU_TANH_C3 g^2) = -2 z log2(e)
_GELU_TANH_C1 = 2.0 * 0.7978845608028654 * _LOG2E
_GELU_TANH_C3 = _GELU_TANH_C1 * 0.044715
_BOX_W = TILE_W // 2  # weight rows per TMA box (two boxes per stage)


def out_features(epilogue: str, n: int) -> int:
    """Width of the output for a weight with N rows: I = N // 2 for the gated epilogues, else N."""
    return n // 2 if epilogue in GATED_EPILOGUES else n


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


def _tanh_approx(v):
    """``tanh.approx.f32``: one MUFU op, max relative error ~2^-11."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(v).ir_value()], "tanh.approx.f32 $0, $1;",
                                           "=f,f", has_side_effects=False, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


def _sigmoid_times(g, scale: float):
    """g * sigmoid(scale * g) = g / (1 + 2^(-scale g log2 e)): one ex2 + one rcp."""
    den = cutlass.Float32(1.0) + cute.math.exp2(g * cutlass.Float32(-scale * _LOG2E), fastmath=True)
    return g * cute.arch.rcp_approx(den)


def gated_activation(epilogue: str, gate, up, consts: dict):
    """act(gate, up) of a gated epilogue in fp32, traced inline (constants.py defines each one;
    ``consts``: the kernel's activation constants, compile-time values)."""
    if epilogue == "swiglu":  # silu(g) = g / (1 + 2^(-g log2 e))
        den = cutlass.Float32(1.0) + cute.math.exp2(-gate * _LOG2E, fastmath=True)
        return gate * cute.arch.rcp_approx(den) * up
    if epilogue == "gelu_glu":
        return cutlass.Float32(0.5) * gate * (cutlass.Float32(1.0) + cute.math.erf(gate * _RSQRT2)) * up
    if epilogue == "gelu_tanh_glu":  # g * sigmoid(2 z): no cancellation where 1 + tanh(z) is tiny
        arg = gate * (cutlass.Float32(-_GELU_TANH_C1) - cutlass.Float32(_GELU_TANH_C3) * (gate * gate))
        den = cutlass.Float32(1.0) + cute.math.exp2(arg, fastmath=True)
        return gate * cute.arch.rcp_approx(den) * up
    if epilogue == "clamped_swiglu":
        lim = cutlass.Float32(consts["swiglu_limit"])
        after = consts["swiglu_limit_after_act"]
        if not after:
            gate = cute.arch.fmin(gate, lim)
        up = cute.arch.fmax(cute.arch.fmin(up, lim), -lim)
        if consts["swiglu_beta"] != 0.0:
            up = up + cutlass.Float32(consts["swiglu_beta"])
        act = _sigmoid_times(gate, consts["swiglu_alpha"])
        if after:  # Step-3.7: clamp the activated gate
            act = cute.arch.fmin(act, lim)
        return up * act
    if epilogue == "softcapped_swiglu":  # the sigmoid sees the raw gate: (1 + tanh(g / 2)) / 2
        cg, cu = consts["gate_softcap"], consts["up_softcap"]
        half = cutlass.Float32(0.5)
        sig = half + half * _tanh_approx(gate * half)
        return (cutlass.Float32(cg * cu) * _tanh_approx(gate * cutlass.Float32(1.0 / cg))
                * _tanh_approx(up * cutlass.Float32(1.0 / cu)) * sig)
    raise NotImplementedError(epilogue)


def can_implement(epilogue: str, n: int, k: int, num_experts: int,
                  tile_tokens: int = DEFAULT_TILE_TOKENS,
                  num_stages: Optional[int] = None) -> Optional[str]:
    """None when the kernel supports the problem, else a sentence saying why not."""
    if epilogue not in EPILOGUES:
        return f"epilogue must be one of {EPILOGUES}, got {epilogue!r}"
    if tile_tokens not in TILE_TOKENS:
        return f"tile_tokens must be one of {TILE_TOKENS}, got {tile_tokens}"
    if not (1 <= num_experts <= MAX_EXPERTS):
        return f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}"
    if k <= 0 or k % ALIGN_K != 0:
        return f"K={k} must be a positive multiple of {ALIGN_K} (one 128-value stage, 4-byte scale loads)"
    if n <= 0:
        return f"N={n} must be positive"
    if epilogue in GATED_EPILOGUES and n % 2 != 0:
        return f"{epilogue} needs an even N = 2 * I (gate rows then up rows), got N={n}"
    n_out = out_features(epilogue, n)
    if n_out % ALIGN_N != 0:
        return f"N_out={n_out} must be a multiple of {ALIGN_N} (vector stores of the output)"
    if num_stages is not None and not (2 <= num_stages <= MAX_STAGES):
        return f"num_stages must be in [2, {MAX_STAGES}], got {num_stages}"
    if Mxfp8GroupedGemmSm120.plan_stages(tile_tokens, num_experts, epilogue, num_stages) < 2:
        return "fewer than 2 pipeline stages fit in SM120's 99 KB of shared memory"
    return None


def _check_sw128(layout, rows: int, slots: int) -> None:
    """Assert (at trace time, static layouts) that byte (r, c) of smem slot s is at
    s * rows * 128 + r * 128 + ((c / 16) ^ (r % 8)) * 16 + c % 16, the rule the ldmatrix
    address math of the MMA warps relies on."""
    for s in (0, slots - 1):
        for r in range(min(rows, 16)):
            for c in (0, 5, 16, 47, 127):
                want = s * rows * TILE_K + r * TILE_K + (((c // 16) ^ (r % 8)) * 16) + c % 16
                got = layout((r, c, s))
                if got != want:
                    raise AssertionError(f"unexpected smem swizzle: ({r},{c},{s}) -> {got}, want {want}")


class Mxfp8GroupedGemmSm120:
    """MXFP8 varlen-M grouped GEMM, swap-AB (see the module docstring).

    :param epilogue: one of ``EPILOGUES`` (compile time).
    :param tile_tokens: tokens per CTA tile, one of ``TILE_TOKENS``; 128 uses 8 MMA warps
        (2 along the tokens), the others 4.
    :param num_stages: smem pipeline depth; None = as many as fit (at most ``MAX_STAGES``).
    :param swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act: clamped_swiglu's constants;
    :param gate_softcap, up_softcap: softcapped_swiglu's (defaults: ``ACTIVATION_CONSTANT_DEFAULTS``;
        ignored by the other epilogues; drop v2). ``ValueError`` if unusable.
    """

    def __init__(self, epilogue: str, tile_tokens: int = DEFAULT_TILE_TOKENS,
                 num_stages: Optional[int] = None,
                 swiglu_alpha: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_alpha"],
                 swiglu_limit: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_limit"],
                 swiglu_beta: float = ACTIVATION_CONSTANT_DEFAULTS["swiglu_beta"],
                 swiglu_limit_after_act: bool = ACTIVATION_CONSTANT_DEFAULTS["swiglu_limit_after_act"],
                 gate_softcap: float = ACTIVATION_CONSTANT_DEFAULTS["gate_softcap"],
                 up_softcap: float = ACTIVATION_CONSTANT_DEFAULTS["up_softcap"]):
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if tile_tokens not in TILE_TOKENS:
            raise ValueError(f"tile_tokens must be one of {TILE_TOKENS}, got {tile_tokens}")
        reason = check_activation_constants(epilogue, float(swiglu_alpha), float(swiglu_limit), float(swiglu_beta),
                                            float(gate_softcap), float(up_softcap))
        if reason is not None:
            raise ValueError(reason)
        self.act_consts = dict(swiglu_alpha=float(swiglu_alpha), swiglu_limit=float(swiglu_limit),
                               swiglu_beta=float(swiglu_beta), swiglu_limit_after_act=bool(swiglu_limit_after_act),
                               gate_softcap=float(gate_softcap), up_softcap=float(up_softcap))
        self.epilogue = epilogue
        self.gated = epilogue in GATED_EPILOGUES
        self.scale_rows = epilogue == "row_scale"
        self.tile_tokens = tile_tokens
        self.num_stages_override = num_stages
        self.warps_n = 2 if tile_tokens == 128 else 1
        self.num_mma_warps = MMA_WARPS_M * self.warps_n
        self.warp_tokens = tile_tokens // self.warps_n
        self.n_atoms = self.warp_tokens // 8  # n8 MMA atoms per warp
        self.threads = (self.num_mma_warps + 1) * 32
        self.feats_per_tile = OUT_FEATURES_PER_TILE[epilogue]
        # epilogue staging: 8 tokens x (features of one warp) bf16, row pitch padded by 16 bytes
        self.epi_feats = 16 if self.gated else 32
        self.epi_vec = self.epi_feats // 4  # bf16 per lane store: 4 lanes cover one token row
        self.epi_pitch = self.epi_feats * 2 + 16
        self.acc_dtype = cutlass.Float32
        self.out_dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host helpers
    @staticmethod
    def stage_bytes(tile_tokens: int) -> int:
        """Shared memory of one pipeline stage: weight tile, token tile and their scales."""
        return TILE_W * TILE_K + tile_tokens * TILE_K + 4 * (TILE_W + tile_tokens)

    @staticmethod
    def fixed_bytes(tile_tokens: int, num_experts: int, epilogue: str) -> int:
        """Shared memory besides the stages (scheduler arrays, epilogue staging, alignment)."""
        warps = MMA_WARPS_M * (2 if tile_tokens == 128 else 1)
        pitch = (16 if epilogue in GATED_EPILOGUES else 32) * 2 + 16
        return 8 * (num_experts + 1) + warps * 8 * pitch + 2 * 1024 + 256

    @classmethod
    def plan_stages(cls, tile_tokens: int, num_experts: int, epilogue: str,
                    num_stages: Optional[int] = None) -> int:
        """Pipeline depth that fits SM120's shared memory (16 bytes of mbarriers per stage)."""
        room = SMEM_LIMIT - cls.fixed_bytes(tile_tokens, num_experts, epilogue)
        stages = min(MAX_STAGES, room // (cls.stage_bytes(tile_tokens) + 16))
        if num_stages is not None:
            stages = min(stages, num_stages)
        return stages

    def static_shapes(self, n: int, k: int) -> Tuple[int, int, int]:
        """(N_out, weight-row tiles, k tiles) for a weight with N rows and K columns."""
        n_out = out_features(self.epilogue, n)
        n_tiles = (n_out + self.feats_per_tile - 1) // self.feats_per_tile
        return n_out, n_tiles, k // TILE_K

    # ------------------------------------------------------------------ host (jit) side
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mSFX: cute.Tensor,
        mW: cute.Tensor,
        mSFW: cute.Tensor,
        mOut: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """Launch on ``stream`` (argument shapes and dtypes: the module docstring). Host side:
        checks the static shapes, plans the stages, builds the TMA atoms, launches
        ``max_active_ctas`` persistent CTAs."""
        for name, t in (("X", mX), ("SFX", mSFX), ("W", mW), ("SFW", mSFW)):
            if cutlass.const_expr(t.element_type != cutlass.Uint8):
                raise TypeError(f"{name} must be passed as uint8 (e4m3 / e8m0 bits)")
        if cutlass.const_expr(mOut.element_type != cutlass.BFloat16):
            raise TypeError("out must be bfloat16")
        if cutlass.const_expr(mOffsets.element_type != cutlass.Int32):
            raise TypeError("offsets must be int32")
        if cutlass.const_expr(mRowScale.element_type != cutlass.Float32):
            raise TypeError("row_scale must be float32")
        num_experts = cute.size(mOffsets, mode=[0]) - 1
        n = cute.size(mW, mode=[1])
        k = cute.size(mW, mode=[2])
        if cutlass.const_expr(cute.size(mW, mode=[0]) != num_experts):
            raise ValueError("W has a different expert count than offsets")
        reason = can_implement(self.epilogue, n, k, num_experts, self.tile_tokens,
                               self.num_stages_override)
        if cutlass.const_expr(reason is not None):
            raise ValueError(reason)
        self.num_experts = num_experts
        self.n = n
        self.k_blocks = k // MX_BLOCK
        self.n_out, self.n_tiles, self.k_tiles = self.static_shapes(n, k)
        self.num_stages = self.plan_stages(self.tile_tokens, num_experts, self.epilogue,
                                           self.num_stages_override)
        bn = self.tile_tokens
        stages = self.num_stages
        # TMA bytes per stage (full boxes: out-of-bounds parts are zero filled and still counted)
        self.tx_bytes = TILE_W * TILE_K + bn * TILE_K

        # K-major 128-byte swizzle (the canonical TMA/SW128 atom of 8 rows x 128 bytes): 16-byte
        # chunk c of row r sits at chunk c ^ (r % 8). The MMA warps compute their ldmatrix
        # addresses with this rule; _check_sw128 verifies it against the layouts at compile time.
        sw128 = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cutlass.Uint8)
        w_staged = cute.tile_to_shape(sw128, (_BOX_W, TILE_K, 2 * stages), order=(0, 1, 2))
        x_staged = cute.tile_to_shape(sw128, (bn, TILE_K, stages), order=(0, 1, 2))
        _check_sw128(w_staged, _BOX_W, 2 * stages)
        _check_sw128(x_staged, bn, stages)
        # W as (N, K, E): the expert is the third TMA coordinate
        mW_nke = cute.make_tensor(mW.iterator, cute.select(mW.layout, mode=[1, 2, 0]))
        tma_atom_w, mW_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW_nke,
            cute.slice_(w_staged, (None, None, 0)), (_BOX_W, TILE_K),
        )
        tma_atom_x, mX_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mX,
            cute.slice_(x_staged, (None, None, 0)), (bn, TILE_K),
        )

        @cute.struct
        class SharedStorage:
            full_bar: cute.struct.MemRange[cutlass.Int64, stages]
            empty_bar: cute.struct.MemRange[cutlass.Int64, stages]
            # offsets[0..E] and inclusive prefix sum of token tiles per expert
            sched_off: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            sched_cum: cute.struct.MemRange[cutlass.Int32, num_experts + 1]
            # scale codes: one 32-bit word (4 k-blocks) per weight row / token per stage
            sSFW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint32, stages * TILE_W], 16]
            sSFX: cute.struct.Align[cute.struct.MemRange[cutlass.Uint32, stages * bn], 16]
            sEpi: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, self.num_mma_warps * 8 * self.epi_pitch], 16
            ]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_staged)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(x_staged)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        if cutlass.const_expr(self.smem_bytes > SMEM_LIMIT):
            raise ValueError(f"shared memory {self.smem_bytes} B exceeds SM120's {SMEM_LIMIT} B")

        self.kernel(
            tma_atom_w, mW_tma, tma_atom_x, mX_tma, mSFW, mSFX, mOut, mOffsets, mRowScale,
            w_staged, x_staged,
        ).launch(
            grid=[max_active_ctas, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[1, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _locate(self, sOff: cute.Tensor, sCum: cute.Tensor, tile_id: cutlass.Int32,
                expert: cutlass.Int32):
        """Linear tile -> (expert, first token row, expert's end row, weight-row tile).

        ``expert`` only moves forward (a CTA's tile ids increase), so the walk is amortised."""
        t_tile = tile_id // self.n_tiles
        n_tile = tile_id - t_tile * self.n_tiles
        e = expert
        while sCum[e + 1] <= t_tile:
            e = e + 1
        row0 = sOff[e] + (t_tile - sCum[e]) * self.tile_tokens
        return e, row0, sOff[e + 1], n_tile

    def _w_base(self, n_tile, h: int):
        """First weight row of TMA box ``h`` (smem rows 64 h .. 64 h + 63) of weight tile n_tile."""
        if cutlass.const_expr(self.gated):
            return n_tile * _BOX_W + h * self.n_out  # gate rows j0.., up rows I + j0..
        return n_tile * TILE_W + h * _BOX_W

    def _srow(self, atom: int, r16):
        """smem row (0..127) feeding row ``r16`` (0..15) of m16 atom ``atom`` (0..7)."""
        if cutlass.const_expr(self.gated):
            # rows 0-7: gate rows 8 atom.., rows 8-15: the matching up rows (smem 64 + 8 atom..)
            return (r16 // 8) * _BOX_W + atom * 8 + r16 % 8
        return atom * 16 + r16

    # ---- per-lane index maps: plain integer arithmetic on DSL integers (kernel) or Python ints
    #      (emulate.py runs them against a model of the TMA swizzle, ldmatrix and the m16n8k32
    #      fragments; tests/test_sm120_mxfp8_drop.py compares that with the reference)
    def w_ldsm_row(self, wm, a: int, lane):
        """smem row (of the stage's 128) whose 16 bytes ``lane`` addresses in the ldmatrix.x4 of
        m16 atom ``a`` of warp row ``wm``: matrix i = lane / 8 is (rows 8 (i % 2).., k-half i / 2),
        so the lane's atom row is lane % 16."""
        return self._srow(2 * wm + a, lane % 16)

    def w_ldsm_chunk(self, kk: int, lane):
        """Swizzled 16-byte chunk of that row for k-step ``kk`` (bytes 32 kk .. 32 kk + 31):
        chunk 2 kk + lane / 16, XOR row % 8 (= lane % 8: atom row groups start at multiples of 8)."""
        return (2 * kk + lane // 16) ^ (lane % 8)

    def w_sf_row(self, wm, a: int, lane):
        """smem row whose scale ``lane`` supplies as the MMA's A scale (scale_vec::1X, thread-id
        0): atom row 8 (lane % 2) + lane / 4."""
        return self._srow(2 * wm + a, 8 * (lane % 2) + lane // 4)

    def x_ldsm_row(self, wn, j: int, lane):
        """Tile token whose 16 bytes ``lane`` addresses in the ldmatrix.x4 of n8 atom ``j``."""
        return wn * self.warp_tokens + 8 * j + lane % 8

    def x_ldsm_chunk(self, kh: int, lane):
        """Swizzled chunk for k-steps 2 kh, 2 kh + 1: matrix i = lane / 8 is chunk 4 kh + i, so
        registers (d0, d1) are (b0, b1) of k-step 2 kh and (d2, d3) those of 2 kh + 1."""
        return (4 * kh + lane // 8) ^ (lane % 8)

    def x_sf_token(self, wn, j: int, lane):
        """Tile token whose scale ``lane`` supplies as the MMA's B scale: n = lane / 4."""
        return wn * self.warp_tokens + 8 * j + lane // 4

    def epi_slot(self, a: int, hh: int, t: int, lane):
        """(token in the 8-token chunk, feature in the warp's staging row) of accumulator element
        2 hh + t of atom ``a`` (C fragment: row g + 8 hh, column 2 q + t). gated: the gate
        (hh = 0) and up (hh = 1) elements share one output slot."""
        g = lane // 4
        q = lane % 4
        if cutlass.const_expr(self.gated):
            return 2 * q + t, 8 * a + g
        return 2 * q + t, 16 * a + 8 * hh + g

    def epi_store(self, n_tile, wm, lane):
        """(token in the chunk, first output feature) of the ``epi_vec`` values ``lane`` stores."""
        return lane // 4, n_tile * self.feats_per_tile + wm * self.epi_feats + (lane % 4) * self.epi_vec

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_w: cute.CopyAtom,
        mW_tma: cute.Tensor,
        tma_atom_x: cute.CopyAtom,
        mX_tma: cute.Tensor,
        mSFW: cute.Tensor,
        mSFX: cute.Tensor,
        mOut: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        w_staged: cute.ComposedLayout,
        x_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        nw = self.num_mma_warps
        stages = self.num_stages
        num_experts = self.num_experts

        if warp_idx == nw:
            cpasync.prefetch_descriptor(tma_atom_w)
            cpasync.prefetch_descriptor(tma_atom_x)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sOff = storage.sched_off.get_tensor(cute.make_layout(num_experts + 1))
        sCum = storage.sched_cum.get_tensor(cute.make_layout(num_experts + 1))
        full_bar = storage.full_bar.data_ptr()
        empty_bar = storage.empty_bar.data_ptr()

        # ---- barriers: full = TMA arrive.expect_tx + 32 producer lanes' cp.async arrivals;
        #      empty = every MMA thread once it has read the stage
        if tidx == 0:
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(full_bar + s, 1 + 32)
                cute.arch.mbarrier_init(empty_bar + s, nw * 32)
            cute.arch.mbarrier_init_fence()

        # ---- scheduler prologue: the producer warp scans the per-expert token-tile counts
        if warp_idx == nw:
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
                    if e == num_experts - 1:
                        sOff[e + 1] = hi
                    cnt = (cutlass.max(hi - lo, 0) + (self.tile_tokens - 1)) // self.tile_tokens
                for s in cutlass.range_constexpr(5):  # inclusive warp scan
                    v = cute.arch.shuffle_sync_up(cnt, 1 << s)
                    if lane >= (1 << s):
                        cnt = cnt + v
                cnt = cnt + carry
                if e < num_experts:
                    sCum[e + 1] = cnt
                carry = cute.arch.shuffle_sync(cnt, 31)
        cute.arch.sync_threads()

        total_tiles = sCum[num_experts] * self.n_tiles
        k_tiles = self.k_tiles
        bn = self.tile_tokens

        # =========================================================== producer warp
        if warp_idx == nw:
            sW = storage.sW.get_tensor(w_staged.outer, swizzle=w_staged.inner)
            sX = storage.sX.get_tensor(x_staged.outer, swizzle=x_staged.inner)
            m_total = cute.size(mSFX, mode=[0])
            n_rows = self.n
            k_blocks = self.k_blocks
            sfw_gaddr = mSFW.iterator.toint()
            sfx_gaddr = mSFX.iterator.toint()
            ssfw_addr = storage.sSFW.data_ptr().toint()
            ssfx_addr = storage.sSFX.data_ptr().toint()
            cp4 = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Uint32, num_bits_per_copy=32)
            stage = cutlass.Int32(0)
            phase = cutlass.Int32(0)
            expert = cutlass.Int32(0)
            tile_id = bidx
            while tile_id < total_tiles:
                expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
                # token rows [row0, row0 + bn): (TMA, k_tiles); rows past M_total are zero fill
                gX = cute.local_tile(cute.domain_offset((row0, 0), mX_tma), (bn, TILE_K), (0, None))
                tXsX, tXgX = cpasync.tma_partition(
                    tma_atom_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                    cute.group_modes(gX, 0, 2),
                )
                tWgW = []
                w_base = []
                tWsW = None
                for h in cutlass.range_constexpr(2):
                    base = self._w_base(n_tile, h)
                    w_base.append(base)
                    gW = cute.local_tile(
                        cute.domain_offset((base, 0, 0), mW_tma), (_BOX_W, TILE_K), (0, None, expert)
                    )
                    tWsW, tWgW_h = cpasync.tma_partition(
                        tma_atom_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                        cute.group_modes(gW, 0, 2),
                    )
                    tWgW.append(tWgW_h)
                # scale source rows of this lane (clamped: rows past the end feed only outputs
                # that are never stored, and must not be read out of bounds)
                w_src = []
                for i in cutlass.range_constexpr(TILE_W // 32):
                    wrow = cutlass.min(w_base[i // 2] + lane + 32 * (i % 2), n_rows - 1)
                    w_src.append(sfw_gaddr + (cutlass.Int64(expert) * n_rows + wrow) * k_blocks)
                x_src = []
                for i in cutlass.range_constexpr((bn + 31) // 32):
                    xrow = cutlass.min(row0 + lane + 32 * i, m_total - 1)
                    x_src.append(sfx_gaddr + cutlass.Int64(xrow) * k_blocks)

                for kt in range(k_tiles):
                    cute.arch.mbarrier_wait(empty_bar + stage, phase ^ 1)
                    bar = full_bar + stage
                    if lane == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.tx_bytes)
                    # the whole warp calls the TMA copies: they elect one lane (elect.sync) inside
                    cute.copy(tma_atom_x, tXgX[(None, kt)], tXsX[(None, stage)], tma_bar_ptr=bar)
                    for h in cutlass.range_constexpr(2):
                        cute.copy(tma_atom_w, tWgW[h][(None, kt)], tWsW[(None, 2 * stage + h)],
                                  tma_bar_ptr=bar)
                    # scale words (4 k-blocks of this stage) of 128 weight rows and bn tokens
                    for i in cutlass.range_constexpr(TILE_W // 32):
                        self._cp_async4(cp4, w_src[i] + kt * 4,
                                        ssfw_addr + (stage * TILE_W + lane + 32 * i) * 4)
                    for i in cutlass.range_constexpr((bn + 31) // 32):
                        if cutlass.const_expr(bn >= 32 * (i + 1)):
                            self._cp_async4(cp4, x_src[i] + kt * 4,
                                            ssfx_addr + (stage * bn + lane + 32 * i) * 4)
                        else:
                            if lane + 32 * i < bn:
                                self._cp_async4(cp4, x_src[i] + kt * 4,
                                                ssfx_addr + (stage * bn + lane + 32 * i) * 4)
                    cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                    stage = stage + 1
                    if stage == stages:
                        stage = cutlass.Int32(0)
                        phase = phase ^ 1
                tile_id = tile_id + gdim
            # drain: every issued stage has been consumed before this warp's copies may retire
            for _ in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_wait(empty_bar + stage, phase ^ 1)
                stage = stage + 1
                if stage == stages:
                    stage = cutlass.Int32(0)
                    phase = phase ^ 1

        # =========================================================== MMA warps
        if warp_idx < nw:
            self._mma_warp(storage, full_bar, empty_bar, sOff, sCum, total_tiles, mOut, mRowScale,
                           warp_idx, lane, bidx, gdim)

    @cute.jit
    def _cp_async4(self, atom, src_addr, dst_addr):
        """One 4-byte cp.async global -> shared."""
        src = cute.make_ptr(cutlass.Uint32, src_addr, cute.AddressSpace.gmem, assumed_align=4)
        dst = cute.make_ptr(cutlass.Uint32, dst_addr, cute.AddressSpace.smem, assumed_align=4)
        cute.copy(atom, cute.make_tensor(src, cute.make_layout(1)),
                  cute.make_tensor(dst, cute.make_layout(1)))

    @cute.jit
    def _mma_warp(self, storage, full_bar, empty_bar, sOff, sCum, total_tiles, mOut, mRowScale,
                  warp_idx, lane, bidx, gdim):
        stages = self.num_stages
        bn = self.tile_tokens
        wm = warp_idx % MMA_WARPS_M
        wn = warp_idx // MMA_WARPS_M
        sw_addr = storage.sW.data_ptr().toint()
        sx_addr = storage.sX.data_ptr().toint()
        sSFW = storage.sSFW.get_tensor(cute.make_layout(stages * TILE_W))
        sSFX = storage.sSFX.get_tensor(cute.make_layout(stages * bn))
        m_total = cute.size(mOut, mode=[0])

        # ---- per-lane smem offsets (constant over the kernel; see the index maps above)
        w_row_ld = [self.w_ldsm_row(wm, a, lane) * TILE_K for a in range(2)]
        w_row_sf = [self.w_sf_row(wm, a, lane) for a in range(2)]
        w_chunk = [self.w_ldsm_chunk(kk, lane) * 16 for kk in range(TILE_K // 32)]
        # tokens: one ldmatrix.x4 per n8 atom covers two k-steps
        tok0 = wn * self.warp_tokens
        x_row_ld = [self.x_ldsm_row(wn, j, lane) * TILE_K for j in range(self.n_atoms)]
        x_row_sf = [self.x_sf_token(wn, j, lane) for j in range(self.n_atoms)]
        x_chunk = [self.x_ldsm_chunk(kh, lane) * 16 for kh in range(2)]

        mma_atom = cute.make_mma_atom(
            warp.MmaMXF8Op(cutlass.Float8E4M3FN, cutlass.Float32, cutlass.Float8E8M0FNU)
        )
        # register fragments of one m16n8k32 MMA (shapes of the atom's thread-value layouts)
        sf_layout = cute.make_layout(((32, 1), 1, 1), stride=((0, 0), 0, 0))  # one byte, broadcast
        rW = [cute.make_rmem_tensor(((4, 2, 2), 1, 1), cutlass.Float8E4M3FN) for _ in range(2)]
        rX = [[cute.make_rmem_tensor(((4, 2), 1, 1), cutlass.Float8E4M3FN) for _ in range(2)]
              for _ in range(self.n_atoms)]
        rSW = [cute.make_rmem_tensor(sf_layout, cutlass.Float8E8M0FNU) for _ in range(2)]
        rSX = [cute.make_rmem_tensor(sf_layout, cutlass.Float8E8M0FNU) for _ in range(self.n_atoms)]
        acc = [[cute.make_rmem_tensor(((2, 2), 1, 1), self.acc_dtype) for _ in range(self.n_atoms)]
               for _ in range(2)]

        stage = cutlass.Int32(0)
        phase = cutlass.Int32(0)
        expert = cutlass.Int32(0)
        tile_id = bidx
        while tile_id < total_tiles:
            expert, row0, row_end, n_tile = self._locate(sOff, sCum, tile_id, expert)
            for a in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(self.n_atoms):
                    acc[a][j].fill(0.0)
            for kt in range(self.k_tiles):
                cute.arch.mbarrier_wait(full_bar + stage, phase)
                w_stage = sw_addr + stage * (TILE_W * TILE_K)
                x_stage = sx_addr + stage * (bn * TILE_K)
                sfw = [cutlass.Uint32(sSFW[stage * TILE_W + w_row_sf[a]]) for a in range(2)]
                sfx = [cutlass.Uint32(sSFX[stage * bn + x_row_sf[j]]) for j in range(self.n_atoms)]
                for kk in cutlass.range_constexpr(TILE_K // 32):
                    for a in cutlass.range_constexpr(2):
                        self._ldsm_x4(rW[a], w_stage + w_row_ld[a] + w_chunk[kk], 0)
                    if cutlass.const_expr(kk % 2 == 0):
                        for j in cutlass.range_constexpr(self.n_atoms):
                            self._ldsm_x4_pair(rX[j], x_stage + x_row_ld[j] + x_chunk[kk // 2])
                    for a in cutlass.range_constexpr(2):
                        cute.recast_tensor(rSW[a], cutlass.Uint8)[0] = cutlass.Uint8(
                            (sfw[a] >> (8 * kk)) & 0xFF)
                    for j in cutlass.range_constexpr(self.n_atoms):
                        cute.recast_tensor(rSX[j], cutlass.Uint8)[0] = cutlass.Uint8(
                            (sfx[j] >> (8 * kk)) & 0xFF)
                    for a in cutlass.range_constexpr(2):
                        for j in cutlass.range_constexpr(self.n_atoms):
                            cute.gemm(mma_atom, acc[a][j], [rW[a], rSW[a]],
                                      [rX[j][kk % 2], rSX[j]], acc[a][j])
                # this thread has read the stage (ldmatrix / ld.shared issued before the arrive,
                # which releases them); the proxy fence orders these generic-proxy reads before
                # the TMA (async proxy) writes that refill the stage
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.mbarrier_arrive(empty_bar + stage)
                stage = stage + 1
                if stage == stages:
                    stage = cutlass.Int32(0)
                    phase = phase ^ 1
            # rows_left >= 1 for well-formed offsets; clamping the end to M_total keeps malformed
            # offsets (offsets[E] > M_total) from writing out of bounds
            rows_left = cutlass.min(row_end, m_total) - row0
            self._epilogue(storage, acc, mOut, mRowScale, row0, rows_left, n_tile, wm, tok0,
                           warp_idx, lane)
            tile_id = tile_id + gdim

    @cute.jit
    def _ldsm_x4(self, frag: cute.Tensor, addr: cutlass.Int32, first: cutlass.Constexpr):
        """ldmatrix.x4 (four 8x16-byte matrices) into 32-bit words first..first+3 of ``frag``."""
        d0, d1, d2, d3 = cute.arch.inline_ptx(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
            write_only_types=[cutlass.Int32] * 4,
            read_only_args=[cutlass.Int32(addr)],
        )
        f32 = cute.recast_tensor(frag, cutlass.Int32)
        f32[first + 0] = d0
        f32[first + 1] = d1
        f32[first + 2] = d2
        f32[first + 3] = d3

    @cute.jit
    def _ldsm_x4_pair(self, frags, addr: cutlass.Int32):
        """ldmatrix.x4 of one n8 token atom over two k-steps: (b0, b1) of each."""
        d0, d1, d2, d3 = cute.arch.inline_ptx(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
            write_only_types=[cutlass.Int32] * 4,
            read_only_args=[cutlass.Int32(addr)],
        )
        f0 = cute.recast_tensor(frags[0], cutlass.Int32)
        f1 = cute.recast_tensor(frags[1], cutlass.Int32)
        f0[0] = d0
        f0[1] = d1
        f1[0] = d2
        f1[1] = d3

    @cute.jit
    def _epilogue(self, storage, acc, mOut: cute.Tensor, mRowScale: cute.Tensor,
                  row0: cutlass.Int32, rows_left: cutlass.Int32, n_tile: cutlass.Int32,
                  wm: cutlass.Int32, tok0: cutlass.Int32, warp_idx: cutlass.Int32,
                  lane: cutlass.Int32):
        """acc (features x tokens) -> epilogue math -> bf16 -> per-warp smem transpose ->
        token-major vector stores, one chunk of 8 tokens (one n8 atom) at a time.

        Rows past the expert's end (``tok >= rows_left``) and features past N_out are not
        stored. ``rows_left`` >= 1 for well-formed offsets."""
        pitch_e = self.epi_pitch // 2  # bf16 elements
        epi_base = storage.sEpi.data_ptr().toint() + warp_idx * (8 * self.epi_pitch)
        sE = cute.make_tensor(
            cute.make_ptr(self.out_dtype, epi_base, cute.AddressSpace.smem, assumed_align=16),
            cute.make_layout((8, pitch_e), stride=(pitch_e, 1)),
        )
        n_out = self.n_out
        vec = self.epi_vec
        st_tok, col = self.epi_store(n_tile, wm, lane)
        st_src = epi_base + st_tok * self.epi_pitch + (lane % 4) * vec * 2
        out_base = mOut.iterator.toint()
        for j in cutlass.range_constexpr(self.n_atoms):
            t_base = tok0 + 8 * j  # first token (tile-local) of this chunk
            if cutlass.const_expr(self.gated):
                for a in cutlass.range_constexpr(2):
                    for t in cutlass.range_constexpr(2):
                        gate = acc[a][j][t]       # row g: gate row of the feature
                        up = acc[a][j][2 + t]     # row g + 8: its up row
                        v = gated_activation(self.epilogue, gate, up, self.act_consts)
                        tt, ff = self.epi_slot(a, 0, t, lane)
                        sE[tt, ff] = v.to(self.out_dtype)
            else:
                rs = [cutlass.Float32(1.0), cutlass.Float32(1.0)]
                if cutlass.const_expr(self.scale_rows):
                    for t in cutlass.range_constexpr(2):
                        # clamped into the expert's rows (and M_total): loads stay in bounds and
                        # branch free; rows past the end are never stored
                        tt, _ = self.epi_slot(0, 0, t, lane)
                        ridx = cutlass.min(row0 + t_base + tt, row0 + rows_left - 1)
                        rs[t] = mRowScale[cutlass.max(ridx, 0)]
                for a in cutlass.range_constexpr(2):
                    for hh in cutlass.range_constexpr(2):
                        for t in cutlass.range_constexpr(2):
                            v = acc[a][j][2 * hh + t]
                            if cutlass.const_expr(self.scale_rows):
                                v = v * rs[t]
                            tt, ff = self.epi_slot(a, hh, t, lane)
                            sE[tt, ff] = v.to(self.out_dtype)
            cute.arch.sync_warp()
            tok = t_base + st_tok
            if tok < rows_left and col < n_out:
                src = cute.make_tensor(
                    cute.make_ptr(self.out_dtype, st_src, cute.AddressSpace.smem,
                                  assumed_align=2 * vec),
                    cute.make_layout(vec),
                )
                g_off = (cutlass.Int64(row0 + tok) * n_out + col) * 2
                dst = cute.make_tensor(
                    cute.make_ptr(self.out_dtype, out_base + g_off, cute.AddressSpace.gmem,
                                  assumed_align=2 * vec),
                    cute.make_layout(vec),
                )
                dst.store(src.load())
            cute.arch.sync_warp()  # the next chunk overwrites the staging rows
