"""BF16 -> FP8 (e4m3) per-row 128-group quantiser on the GPU, no host sync: the activation side of
:class:`~.fp8_gemm.Fp8BlockScaledGroupedGemmSm90` (FC1's input, rows of H; FC2's input, rows of I).
Standalone (no moe_ep import). The rule is :func:`.fp8_reference.quantize_rows128`, bit for bit::

    scale[r, g] = amax(|x[r, 128g : 128g+128]|) / 448      (1.0 for an all-zero group)
    q[r, c]     = e4m3(x[r, c] / scale[r, c // 128])       (f32 math, the IEEE quotient, RN-even)

Inputs / outputs (row-major, compact; K a compile-time multiple of 128):

    mX     [M, K]      bf16     input rows
    mQ     [M, K]      uint8    e4m3 bits (Float8E4M3FN tensors are accepted too)
    mScale [M, K/128]  float32  one scale per group
    m_rows Int32                rows to quantise: rows >= min(m_rows, M) are not touched
    mCount [>= 1]      int32    (``Fp8QuantizeRows128Counted`` only) device row count: rows >=
                                count[0] are not touched either (skips a grouped buffer's padding
                                without reading the count on the host)

The gathering variant ``Fp8GatherQuantizeRows128`` (counted too) quantises row ``idx[r]`` of a
source into row ``r`` -- a row gather and the quantisation in one pass, so grouped rows never
exist in BF16::

    mX     [S, K]      bf16     source rows (e.g. an EP receive buffer)
    mQ     [M, K]      uint8    e4m3 bits of row r = quantised mX[idx[r]]
    mScale [M, K/128]  float32
    mIdx   [>= M]      int32    source row of each output row (clamped to [0, S) so a bad index
                                cannot read out of bounds)
    m_rows, mCount              as above, counting output rows (M, not S)

The scattering variant ``Fp8ScatterQuantizeRows128`` (drop v25) goes the other way: each valid
source slot is quantised once and stored in every grouped row its choices took (``pos[s, k]``,
the layout's inverse of ``idx``) -- the gathering variant's rows and bits with 1/top_k of its
reads and arithmetic (its class docstring has the tensors).

How. Rows are compact, so group ``gid`` (row gid // G, group gid % G, G = K/128) starts at element
``128 * gid`` of both X and Q and its scale is element ``gid`` of mScale: the work is a flat list of
``T = rows * G`` groups. A warp takes 4 consecutive groups, 8 lanes per group, 16 values per lane:
two 16-byte loads (16 bf16), |x| max over the lane's 16 values, then a 3-step butterfly
(``shfl.sync.bfly``) max over the group's 8 lanes, ``scale = amax / 448`` (``div.rn``), the 16
quotients, ``cvt.rn.satfinite.e4m3x2.f32`` pairs, one 16-byte store per lane; lane 0 of each
8-lane group stores the scale.

The quotients (drop v24). 16 IEEE divisions per lane made the kernel ALU-bound on the H200 (the
gathering quantiser of a Qwen3 8192-token layer took 107 us for 134 MB of e4m3). For 2^-60 <=
scale <= 2^100 a lane now takes ``r = 1 / scale`` (``rcp.rn``) once and corrects each ``x * r``
with one FMA residual (Markstein): :func:`_div_rn`. That is the IEEE quotient wherever it can
change an e4m3 byte -- checked for every bf16 amax in that range against every bf16 value of its
group (816.7 million pairs, moe_ep's tests/test_fp8_quant_div.py); only quotients below 1e-16
(e4m3 zeros) may differ in float32. Other scales (NaN, inf, tiny groups) still divide. CTAs of ``NW`` warps walk the list with a grid-stride loop; the grid
is ``min(ceil(M * G / (4 * NW)), max_ctas)`` (>= 1, so M = 0 launches one idle CTA).

Items per pass (drop v54, ``items``): a warp takes ``items`` warp items (stride: the grid's warps)
per loop pass and issues all their loads before quantising any, so more bytes are in flight per
warp (the kernel is a read-quantise-write stream; with one item a warp's next load waited for its
previous item's shuffles, divisions and store). The same groups, rows and bits for every ``items``.

Saturation. e4m3 conversion in PTX exists only as ``.satfinite``; torch's conversion never
saturates but |x / scale| <= 448 * (1 + 2^-23)^2 < 464 (the round-to-nearest midpoint to the
non-existent 480), so both give 448 at the top and agree everywhere. NaN inputs: the amax
propagates NaN (``fmax .NaN``), like torch's ``amax``; inf inputs give NaN groups in both.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .pdl import PDL, wait_previous_grid

FP8_BLOCK = 128
E4M3_MAX = 448.0
#: scales for which :func:`_divide_by_scale` takes the reciprocal path (outside: IEEE division)
FAST_DIV_MIN_SCALE = 2.0 ** -60
FAST_DIV_MAX_SCALE = 2.0 ** 100
LANES_PER_GROUP = 8                       # 8 lanes x 16 values = one 128-value group
VALS_PER_LANE = FP8_BLOCK // LANES_PER_GROUP   # 16: 32 bytes of bf16 in, 16 bytes of e4m3 out
GROUPS_PER_WARP = 32 // LANES_PER_GROUP   # 4
DEFAULT_WARPS = 8                         # 256 threads per CTA
DEFAULT_MAX_CTAS = 132 * 16               # grid cap (grid-stride beyond it)
DEFAULT_ITEMS = 1                         # warp items per loop pass (drop v54: loads issued together)


@dsl_user_op
def _div_rn(x, s, r, *, loc=None, ip=None):
    """``x / s`` rounded to the nearest float32, given ``r = 1 / s`` rounded to nearest
    (Markstein's correction): ``q0 = x * r``, ``e = x - q0 * s`` (exact in one FMA),
    ``q = q0 + e * r``; ``q0`` itself when ``e == 0`` (which keeps the sign of a zero ``x``).
    ``.rn`` on each instruction: nothing is contracted or reassociated."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (x, s, r)]
    return Float32(llvm.inline_asm(
        T.f32(), args,
        "{\n.reg .f32 q0, nq, e, q1;\n.reg .pred z;\nmul.rn.f32 q0, $1, $3;\nneg.f32 nq, q0;\n"
        "fma.rn.f32 e, nq, $2, $1;\nfma.rn.f32 q1, e, $3, q0;\nsetp.eq.f32 z, e, 0f00000000;\n"
        "selp.f32 $0, q0, q1, z;\n}",
        "=f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _divide_by_scale(x: cute.TensorSSA, scale: Float32, n: cutlass.Constexpr):
    """``x / scale`` element-wise (``n`` float32 values), bit for bit the IEEE quotient wherever it
    can change the e4m3 result: one division for ``1 / scale`` and three FP32 operations per value
    (:func:`_div_rn`) instead of ``n`` divisions (the quantiser was bound by them on the H200). With
    2^-60 <= scale <= 2^100 no intermediate overflows or underflows for a quotient >= 2^-11 (smaller
    ones are e4m3 zeros however they round): checked against exact division for every bf16 amax in
    that range and every bf16 value of its group (tests/test_fp8_quant_div.py). Other scales (NaN,
    inf, tiny groups) divide."""
    q = cute.make_rmem_tensor((n,), Float32)
    if (scale >= Float32(FAST_DIV_MIN_SCALE)) & (scale <= Float32(FAST_DIV_MAX_SCALE)):
        r = Float32(1.0) / scale
        for i in cutlass.range_constexpr(n):
            q[i] = _div_rn(x[i], scale, r)
    else:
        for i in cutlass.range_constexpr(n):
            q[i] = x[i] / scale
    return q.load()


@cute.jit
def _quantize_lane(x: cute.TensorSSA, n: cutlass.Constexpr):
    """``(x / scale, scale)`` of a lane's ``n`` float32 values of one 128-value group, whose other
    values the 7 lanes beside it hold (every lane of the warp must call it: the butterfly max).
    ``scale = amax / 448`` over the group (1.0 for an all-zero group; NaN propagates)."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, cute.arch.fmax(x[i], -x[i], nan=True), nan=True)
    for d in cutlass.range_constexpr(3):
        other = cute.arch.shuffle_sync_bfly(amax, 1 << (2 - d))
        amax = cute.arch.fmax(amax, other, nan=True)
    scale = Float32(1.0)                           # torch.where(amax > 0, amax/448, 1)
    if amax > Float32(0.0):
        scale = amax / Float32(E4M3_MAX)
    return _divide_by_scale(x, scale, n), scale


@cute.jit
def _as_e4m3(mQ: cute.Tensor) -> cute.Tensor:
    """``mQ`` viewed as Float8E4M3FN (callers may pass the e4m3 bits as uint8)."""
    if cutlass.const_expr(mQ.element_type != cutlass.Float8E4M3FN):
        mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Float8E4M3FN), mQ.layout)
    return mQ


def can_implement(k: int) -> Optional[str]:
    """None if ``k`` is supported, else the reason."""
    if k <= 0 or k % FP8_BLOCK:
        return f"K={k} must be a positive multiple of {FP8_BLOCK}"
    return None


class Fp8QuantizeRows128:
    """``q, scale = quantize_rows128(x[:rows])`` for ``rows = min(m_rows, M)`` (see the module
    docstring). ``k``: the row length (compile time); ``warps``: warps per CTA; ``max_ctas``: grid
    cap (the grid-stride loop covers any M); ``items``: warp items per loop pass, their loads
    issued together (drop v54; 1 to 4, the same bits)."""

    use_count = False
    gather = False

    def __init__(self, k: int, warps: int = DEFAULT_WARPS, max_ctas: int = DEFAULT_MAX_CTAS,
                 items: int = DEFAULT_ITEMS):
        reason = can_implement(k)
        if reason is not None:
            raise ValueError(reason)
        if not 1 <= int(items) <= 4:
            raise ValueError(f"items={items} must be in [1, 4]")
        self.k = int(k)
        self.groups = self.k // FP8_BLOCK
        self.warps = int(warps)
        self.threads = 32 * self.warps
        self.max_ctas = int(max_ctas)
        self.items = int(items)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, m_rows: Int32,
                 stream: cuda.CUstream):
        self._launch(mX, mQ, mScale, mScale, mScale, m_rows, stream)

    @cute.jit
    def _launch(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mCount: cute.Tensor,
                mIdx: cute.Tensor, m_rows: Int32, stream: cuda.CUstream):
        # mCount / mIdx: placeholders (mScale) in the variants that do not read them
        mQ = _as_e4m3(mQ)
        self.kernel(mX, mQ, mScale, mCount, mIdx, m_rows).launch(  # over mQ's rows (mX's unless gathering)
            grid=(self._grid(mQ.shape[0]), 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.jit
    def _grid(self, rows: Int32):
        """CTAs for ``rows`` rows of groups: one warp item (4 groups) per warp, capped at
        ``max_ctas`` (the grid-stride loop takes the rest), at least 1."""
        per_cta = GROUPS_PER_WARP * self.warps
        need = (rows * self.groups + (per_cta - 1)) // per_cta
        return cutlass.max(cutlass.min(need, Int32(self.max_ctas)), Int32(1))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mCount: cute.Tensor,
               mIdx: cute.Tensor, m_rows: Int32):
        wait_previous_grid()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        G = self.groups
        V = VALS_PER_LANE

        rows = cutlass.min(m_rows, mQ.shape[0])
        if cutlass.const_expr(self.use_count):
            rows = cutlass.min(rows, mCount[0])
        rows = cutlass.max(rows, Int32(0))
        total = rows * G                                   # groups to quantise
        items = (total + (GROUPS_PER_WARP - 1)) // GROUPS_PER_WARP

        # 16-value tiles: ((1, 16), (M, K/16)); tile (r, j) holds x[r, 16j : 16j + 16]
        tX = cute.zipped_divide(mX, (1, V))
        tQ = cute.zipped_divide(mQ, (1, V))
        sub = lane % LANES_PER_GROUP
        slot = lane // LANES_PER_GROUP
        stride = gdim * self.warps                         # warp items between a warp's items
        for it in cutlass.range(bidx * self.warps + warp, items, stride * self.items):
            # all loads of the pass first (the same warp items as ``items`` passes of one, in order)
            held = []
            for u in cutlass.range_constexpr(self.items):
                gid = (it + u * stride) * GROUPS_PER_WARP + slot
                gc = cutlass.min(gid, total - 1)           # clamp: invalid lanes read a real group
                r = gc // G
                j = (gc - r * G) * LANES_PER_GROUP + sub
                src = r
                if cutlass.const_expr(self.gather):
                    src = cutlass.min(cutlass.max(mIdx[r], Int32(0)), mX.shape[0] - 1)
                held.append((gid < total, gc, r, j, tX[(0, None), (src, j)].load()))
            for u in cutlass.range_constexpr(self.items):
                valid, gc, r, j, x = held[u]
                y, scale = _quantize_lane(x.to(Float32), V)
                if valid:
                    tQ[(0, None), (r, j)].store(y.to(cutlass.Float8E4M3FN))
                    if sub == 0:
                        mScale[r, gc - r * G] = scale


class Fp8QuantizeRows128Counted(Fp8QuantizeRows128):
    """The ``mCount`` variant: rows >= min(m_rows, M, mCount[0]) are not touched. ``mCount``: int32
    device tensor, element 0 read by every warp (stream-ordered after whatever wrote it)."""

    use_count = True

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mCount: cute.Tensor,
                 m_rows: Int32, stream: cuda.CUstream):
        self._launch(mX, mQ, mScale, mCount, mScale, m_rows, stream)


class Fp8GatherQuantizeRows128(Fp8QuantizeRows128):
    """The gathering, counted variant: ``q[r], scale[r] = quantize_rows128(x[idx[r]])`` for
    ``r < min(m_rows, M, count[0])``; rows past that are not touched (see the module docstring)."""

    use_count = True
    gather = True

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mCount: cute.Tensor,
                 mIdx: cute.Tensor, m_rows: Int32, stream: cuda.CUstream):
        self._launch(mX, mQ, mScale, mCount, mIdx, m_rows, stream)


class Fp8ScatterQuantizeRows128(Fp8QuantizeRows128):
    """The scattering variant (drop v25): each valid source row is quantised ONCE and its e4m3
    values and scales are stored in every grouped row that takes it::

        for every slot s < S with (s mod t_max) < recv_count[s // t_max], and k < topk:
            r = pos[s, k];  if 0 <= r < M:  q[r], scale[r] = quantize_rows128(x[s])

    the same bits, in the same rows, as the gathering variant with ``idx`` the inverse of ``pos``
    (grouped row r of the layout is choice k of slot s exactly when pos[s, k] = r), but x is read
    and quantised once per token instead of once per choice (top_k = 8: an eighth of the reads and
    of the arithmetic; the writes are the same). Rows no valid choice names are not touched.

        mX         [S, K]      bf16    source rows (slots: the caller's tokens, or an EP receive buffer)
        mQ         [M, K]      uint8   e4m3 bits of the grouped rows
        mScale     [M, K/128]  float32
        mPos       [>= S, topk] int32  grouped row of choice k of slot s, or -1 (read for valid slots)
        mRecvCount [>= S / t_max] int32 valid slots of each source: slot s = src * t_max + t is valid
                               iff t < recv_count[src] (a stale pos row of an invalid slot is never read)
        t_max      Int32       slots per source (>= 1)

    ``topk`` is a compile-time constant. The grid covers the S * K/128 groups of the slots."""

    use_count = False
    gather = False

    def __init__(self, k: int, topk: int, warps: int = DEFAULT_WARPS, max_ctas: int = DEFAULT_MAX_CTAS,
                 items: int = DEFAULT_ITEMS):
        super().__init__(k, warps=warps, max_ctas=max_ctas, items=items)
        if not 1 <= int(topk) <= 32:
            raise ValueError(f"topk={topk} must be in [1, 32]")
        self.topk = int(topk)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mPos: cute.Tensor,
                 mRecvCount: cute.Tensor, t_max: Int32, stream: cuda.CUstream):
        self.kernel_scatter(mX, _as_e4m3(mQ), mScale, mPos, mRecvCount, t_max).launch(  # over the slots (mX)
            grid=(self._grid(mX.shape[0]), 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=PDL)

    @cute.kernel
    def kernel_scatter(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mPos: cute.Tensor,
                       mRecvCount: cute.Tensor, t_max: Int32):
        wait_previous_grid()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        G = self.groups
        V = VALS_PER_LANE
        M = mQ.shape[0]
        total = mX.shape[0] * G                            # groups of every slot
        items = (total + (GROUPS_PER_WARP - 1)) // GROUPS_PER_WARP

        tX = cute.zipped_divide(mX, (1, V))
        tQ = cute.zipped_divide(mQ, (1, V))
        sub = lane % LANES_PER_GROUP
        slot = lane // LANES_PER_GROUP
        stride = gdim * self.warps
        for it in cutlass.range(bidx * self.warps + warp, items, stride * self.items):
            held = []                                      # the pass's loads first (drop v54)
            for u in cutlass.range_constexpr(self.items):
                gid = (it + u * stride) * GROUPS_PER_WARP + slot
                gc = cutlass.min(gid, total - 1)           # clamp: invalid lanes read a real group
                s = gc // G
                g = gc - s * G
                j = g * LANES_PER_GROUP + sub
                src = s // t_max
                valid = (gid < total) & (s - src * t_max < mRecvCount[src])
                rows = cute.make_rmem_tensor((self.topk,), Int32)  # loaded beside the row's values
                for kk in cutlass.range_constexpr(self.topk):
                    rows[kk] = mPos[s, kk]
                held.append((valid, g, j, rows, tX[(0, None), (s, j)].load()))
            for u in cutlass.range_constexpr(self.items):
                valid, g, j, rows, x = held[u]
                y, scale = _quantize_lane(x.to(Float32), V)
                q = cute.make_rmem_tensor((V,), cutlass.Float8E4M3FN)  # converted once, stored topk times
                q.store(y.to(cutlass.Float8E4M3FN))
                if valid:
                    for kk in cutlass.range_constexpr(self.topk):
                        r = rows[kk]
                        if (r >= Int32(0)) & (r < M):
                            tQ[(0, None), (r, j)].store(q.load())
                            if sub == 0:
                                mScale[r, g] = scale


# ---------------------------------------------------------------------------- host side
def fake_args(k: int, counted: bool = False, use_tvm_ffi: bool = False, gather: bool = False,
              scatter_topk: int = 0):
    """Fake (mX, mQ, mScale, [mCount, [mIdx,]] m_rows, stream) with M dynamic (and the source's
    S when gathering); what :meth:`CompiledFp8QuantizeRows.cute_args` builds from contiguous torch
    tensors. ``gather`` implies ``counted``. ``scatter_topk``: the scattering variant's (mX, mQ,
    mScale, mPos [S', topk], mRecvCount [W], t_max, stream)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    m = cute.sym_int()
    if scatter_topk:
        return (make_fake_compact_tensor(cutlass.BFloat16, (cute.sym_int(), k), stride_order=(1, 0), assumed_align=16),
                make_fake_compact_tensor(cutlass.Uint8, (m, k), stride_order=(1, 0), assumed_align=16),
                make_fake_compact_tensor(Float32, (m, k // FP8_BLOCK), stride_order=(1, 0), assumed_align=4),
                make_fake_compact_tensor(Int32, (cute.sym_int(), scatter_topk), stride_order=(1, 0), assumed_align=4),
                make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4),
                Int32(1), make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi))
    mX = make_fake_compact_tensor(cutlass.BFloat16, (cute.sym_int() if gather else m, k), stride_order=(1, 0),
                                  assumed_align=16)
    mQ = make_fake_compact_tensor(cutlass.Uint8, (m, k), stride_order=(1, 0), assumed_align=16)
    mS = make_fake_compact_tensor(Float32, (m, k // FP8_BLOCK), stride_order=(1, 0), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    if gather:
        mC = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
        mI = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
        return mX, mQ, mS, mC, mI, Int32(0), stream
    if counted:
        mC = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
        return mX, mQ, mS, mC, Int32(0), stream
    return mX, mQ, mS, Int32(0), stream


def compile_fp8_quantize_rows(k: int, arch: str = "sm_90a", tvm_ffi: bool = False,
                              counted: bool = False, warps: int = DEFAULT_WARPS,
                              max_ctas: int = DEFAULT_MAX_CTAS, keep_ptx: bool = False,
                              gather: bool = False, scatter_topk: int = 0, items: int = DEFAULT_ITEMS):
    """Compile the quantiser for row length ``k`` from fake tensors (no GPU needed). ``counted``:
    the ``mCount`` variant; ``gather``: the gathering (and counted) variant; ``scatter_topk``: the
    scattering variant for that top-k; ``items``: warp items per loop pass (drop v54). Returns the
    compiled object (``.__ptx__`` with ``keep_ptx``)."""
    if scatter_topk:
        kernel = Fp8ScatterQuantizeRows128(k, scatter_topk, warps=warps, max_ctas=max_ctas, items=items)
    else:
        cls = Fp8GatherQuantizeRows128 if gather else Fp8QuantizeRows128Counted if counted else Fp8QuantizeRows128
        kernel = cls(k, warps=warps, max_ctas=max_ctas, items=items)
    opts = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "") + (" --keep-ptx" if keep_ptx else "")
    return cute.compile(kernel, *fake_args(k, counted=counted, use_tvm_ffi=tvm_ffi, gather=gather,
                                           scatter_topk=scatter_topk), options=opts)


class CompiledFp8QuantizeRows:
    """Launcher. ``x [M, k]`` bf16, ``q [M, k]`` float8_e4m3fn or uint8, ``scale [M, k/128]``
    float32, all contiguous CUDA tensors; ``m_rows`` (int, default M): rows >= m_rows untouched;
    ``count`` (``counted=True`` only): int32 CUDA tensor, rows >= count[0] untouched too.
    ``gather=True`` (implies counted): ``x [S, k]`` is a source and ``idx`` (int32 CUDA vector of
    >= M) names the source row of each output row. ``scatter_topk=K`` (drop v25): ``x [S, k]``
    are slots, ``pos`` (int32 [>= S, K]) their grouped rows, ``recv_count`` (int32 [>= ceil(S /
    t_max)]) the valid slots per source and ``t_max`` (int >= 1) the slots per source
    (:class:`Fp8ScatterQuantizeRows128`; no m_rows / count). ``stream``: a ``torch.cuda.Stream``
    or None (torch's current stream). No host sync."""

    def __init__(self, k: int, compiled=None, tvm_ffi: bool = False, counted: bool = False,
                 gather: bool = False, scatter_topk: int = 0):
        self.k = int(k)
        self.tvm_ffi = bool(tvm_ffi)
        self.scatter_topk = int(scatter_topk)
        if self.scatter_topk and (gather or counted):
            raise ValueError("scatter_topk excludes gather and counted")
        self.gather = bool(gather)
        self.counted = bool(counted) or self.gather
        self.compiled = compiled if compiled is not None else compile_fp8_quantize_rows(
            self.k, tvm_ffi=self.tvm_ffi, counted=self.counted, gather=self.gather, scatter_topk=self.scatter_topk)
        self._fn = None
        if self.tvm_ffi:
            get = getattr(self.compiled, "__tvm_ffi_object__", None)
            fn = get() if callable(get) else None
            self._fn = fn if fn is not None else self.compiled

    @staticmethod
    def cute_args(x, q, scale, count=None, idx=None):
        """CuTe views (classic path) matching :func:`fake_args` (the scattering variant: ``idx`` is
        ``pos`` [S', K] and ``count`` is ``recv_count``)."""
        import torch
        from cutlass.cute.runtime import from_dlpack

        dyn = lambda t, al: from_dlpack(t, assumed_align=al).mark_compact_shape_dynamic(  # noqa: E731
            mode=0, stride_order=(0, 1))
        u8 = q.view(torch.uint8) if q.dtype != torch.uint8 else q
        args = [dyn(x, 16), dyn(u8, 16), dyn(scale, 4)]
        for t in (count, idx):
            if t is not None:
                args.append(dyn(t, 4) if t.dim() == 2 else from_dlpack(t, assumed_align=4).mark_compact_shape_dynamic(mode=0))
        return args

    def _check(self, x, q, scale, count, idx=None):
        import torch

        k = x.shape[1]
        M = q.shape[0] if (self.gather or self.scatter_topk) else x.shape[0]
        if k != self.k:
            raise ValueError(f"x has K={k}, kernel compiled for K={self.k}")
        if x.dtype != torch.bfloat16 or scale.dtype != torch.float32:
            raise TypeError("x must be bfloat16 and scale float32")
        if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise TypeError("q must be float8_e4m3fn or uint8")
        if tuple(q.shape) != (M, k) or tuple(scale.shape) != (M, k // FP8_BLOCK):
            raise ValueError(f"shapes: x {tuple(x.shape)} q {tuple(q.shape)} scale {tuple(scale.shape)}")
        if not (x.is_contiguous() and q.is_contiguous() and scale.is_contiguous()):
            raise ValueError("x, q, scale must be contiguous")
        if self.scatter_topk:
            return
        if self.counted != (count is not None):
            raise ValueError("count is required by (and only by) a counted=True kernel")
        if count is not None and count.dtype != torch.int32:
            raise TypeError("count must be int32")
        if self.gather != (idx is not None):
            raise ValueError("idx is required by (and only by) a gather=True kernel")
        if idx is not None and (idx.dtype != torch.int32 or idx.dim() != 1 or idx.shape[0] < M
                                or not idx.is_contiguous()):
            raise ValueError(f"idx must be a contiguous int32 vector of >= {M} elements")

    def _check_scatter(self, x, pos, recv_count, t_max):
        import torch

        if pos is None or recv_count is None or t_max is None:
            raise ValueError("a scatter_topk kernel needs pos, recv_count and t_max")
        S, K = x.shape[0], self.scatter_topk
        if pos.dtype != torch.int32 or pos.dim() != 2 or pos.shape[1] != K or pos.shape[0] < S \
                or not pos.is_contiguous():
            raise ValueError(f"pos must be a contiguous int32 [>= {S}, {K}] tensor, got {tuple(pos.shape)} {pos.dtype}")
        if int(t_max) < 1:
            raise ValueError(f"t_max must be >= 1, got {t_max}")
        sources = -(-S // int(t_max))
        if recv_count.dtype != torch.int32 or recv_count.dim() != 1 or recv_count.shape[0] < sources \
                or not recv_count.is_contiguous():
            raise ValueError(f"recv_count must be a contiguous int32 vector of >= {sources} elements")

    def __call__(self, x, q, scale, m_rows: Optional[int] = None, stream=None, count=None, idx=None,
                 pos=None, recv_count=None, t_max: Optional[int] = None):
        import torch

        self._check(x, q, scale, count, idx)
        if self.scatter_topk:
            self._check_scatter(x, pos, recv_count, t_max)
            count, idx, last = recv_count, pos, int(t_max)
        else:
            last = int(q.shape[0] if m_rows is None else m_rows)
        if self.tvm_ffi:
            u8 = q.view(torch.uint8) if q.dtype != torch.uint8 else q
            extra = (idx, count) if self.scatter_topk else (count, idx)
            args = (x, u8, scale) + tuple(t for t in extra if t is not None) + (last,)
            if stream is None:
                self._fn(*args)
            else:
                with torch.cuda.stream(stream):
                    self._fn(*args)
            return q, scale
        s = stream if stream is not None else torch.cuda.current_stream()
        if self.scatter_topk:
            cargs = self.cute_args(x, q, scale, idx, count)  # pos, then recv_count
        else:
            cargs = self.cute_args(x, q, scale, count, idx)
        self.compiled(*cargs, Int32(last), cuda.CUstream(s.cuda_stream))
        return q, scale

    def prepare(self, q, scale, m_rows: Optional[int] = None, count=None, idx=None, pos=None,
                recv_count=None, t_max: Optional[int] = None):
        """A launch with every argument but the input rows fixed (drop v58): ``run(x)`` is
        ``self(x, q, scale, m_rows, count=count, idx=idx, pos=pos, recv_count=recv_count,
        t_max=t_max)`` -- same kernel, same arguments -- with the fixed arguments checked and packed
        once here; a call checks only ``x`` (dtype, width, rows, contiguity, alignment). The fixed
        tensors are held (kept alive) and must keep their shapes while ``run`` is used."""
        import torch

        k, M = self.k, q.shape[0]
        if q.dtype not in (torch.float8_e4m3fn, torch.uint8) or scale.dtype != torch.float32:
            raise TypeError("q must be float8_e4m3fn or uint8 and scale float32")
        if tuple(q.shape) != (M, k) or tuple(scale.shape) != (M, k // FP8_BLOCK) \
                or not (q.is_contiguous() and scale.is_contiguous()):
            raise ValueError(f"q must be a contiguous [M, {k}] and scale a contiguous [M, {k // FP8_BLOCK}] tensor")
        u8 = q.view(torch.uint8) if q.dtype != torch.uint8 else q
        if self.scatter_topk:
            if pos is None or recv_count is None or t_max is None:
                raise ValueError("a scatter_topk kernel needs pos, recv_count and t_max")
            self._check_scatter(torch.empty((0, k), dtype=torch.bfloat16, device="meta"), pos, recv_count, t_max)
            # the rows of a call: no more slots than pos names and recv_count counts
            max_rows = min(pos.shape[0], recv_count.shape[0] * int(t_max))
            tail = (u8, scale, pos, recv_count, int(t_max))
        else:
            # the counted / gathering checks of __call__, on a stand-in x of the call's shape
            self._check(torch.empty((0 if self.gather else M, k), dtype=torch.bfloat16, device="meta"),
                        q, scale, count, idx)
            max_rows = None if self.gather else M
            last = int(M if m_rows is None else m_rows)
            tail = (u8, scale) + tuple(t for t in (count, idx) if t is not None) + (last,)
        if not self.tvm_ffi:
            def run_unpacked(x):
                self(x, q, scale, m_rows, count=count, idx=idx, pos=pos, recv_count=recv_count, t_max=t_max)
            return run_unpacked
        from .launch import ffi_fixed

        # the fixed tensors as TVM-FFI objects once (drop v61); x stays a torch tensor
        tail = ffi_fixed(*tail)
        fn, bf16, exact = self._fn, torch.bfloat16, not (self.gather or self.scatter_topk)

        def run(x):
            if x.dtype != bf16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() \
                    or x.data_ptr() % 16:
                raise ValueError(f"x must be a contiguous, 16-byte aligned bf16 [rows, {k}] tensor, got "
                                 f"{x.dtype} {tuple(x.shape)}")
            if (x.shape[0] != max_rows) if exact else (max_rows is not None and x.shape[0] > max_rows):
                raise ValueError(f"x has {x.shape[0]} rows; this launch takes "
                                 f"{'exactly' if exact else 'at most'} {max_rows}")
            fn(x, *tail)
        return run
