"""Host side of the FP8 block-scaled grouped GEMM (:mod:`.fp8_gemm`): compile from fake tensors
(no GPU needed) and launch with torch tensors, through TVM-FFI or CuTeDSL's classic path (see
:mod:`.launch`). No host sync on the launch path."""

from __future__ import annotations

from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .fp8_gather import Fp8GatherGroupedGemmSm90
from .fp8_gemm import (FP8_BLOCK, Fp8BlockScaledGroupedGemmSm90, Fp8SwigluFusedQuantGroupedGemmSm90,
                       Fp8SwigluRequantGroupedGemmSm90, MAX_SCALE_LOOKAHEAD, can_implement)
from .launch import _num_sms, call_on_stream, cluster_ctas, ffi_fixed, ffi_function


def fake_args(num_experts: int, n: int, k: int, activation: str, use_tvm_ffi: bool = False, requant: bool = False,
              gather_a: bool = False, fused_quant: bool = False):
    """Fake ``(mA, mAScale, mB, mBScale, mC, mOffsets, mRowScale, ctas, stream)``: M_total
    dynamic, the FP8 operands as uint8 views; ``requant``: ``mC`` is ``(mQ, mQScale)``, the
    e4m3 rows (uint8) and their float32 scales (``fused_quant`` too); ``gather_a``: ``(mA, mAScale, mIdx, mB, ...)``,
    A and its scales with their own dynamic row count (the source rows)."""
    n_out = n // 2 if activation == "swiglu" else n
    m = cute.sym_int()
    m_a = cute.sym_int() if gather_a else m
    u8, f32 = cutlass.Uint8, cutlass.Float32
    mA = make_fake_compact_tensor(u8, (m_a, k), stride_order=(1, 0), assumed_align=16)
    mAS = make_fake_compact_tensor(f32, (m_a, k // FP8_BLOCK), stride_order=(1, 0), assumed_align=4)
    mB = make_fake_compact_tensor(u8, (num_experts, n, k), stride_order=(2, 1, 0), assumed_align=16)
    mBS = make_fake_compact_tensor(f32, (num_experts, n // FP8_BLOCK, k // FP8_BLOCK), stride_order=(2, 1, 0),
                                   assumed_align=4)
    mC = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mRS = make_fake_compact_tensor(f32, (cute.sym_int(),), assumed_align=4)
    out = (mC,)
    q_out = (make_fake_compact_tensor(u8, (m, n_out), stride_order=(1, 0), assumed_align=16),
             make_fake_compact_tensor(f32, (m, n_out // FP8_BLOCK), stride_order=(1, 0), assumed_align=4))
    if requant or fused_quant:
        out = q_out
    idx = (make_fake_compact_tensor(cutlass.Int32, (m,), assumed_align=4),) if gather_a else ()
    return (mA, mAS, *idx, mB, mBS, *out, mOff, mRS, cutlass.Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi))


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class CompiledFp8Gemm:
    """One compiled FP8 grouped GEMM for (activation, N, K, E, scale_rows, raster_m); any routing,
    any M_total.

    ``compiled``: the kernel compiled earlier (e.g. loaded from an exported object, for the same
    ``tvm_ffi``, ``raster_m`` and ``overlap_promotion``); None compiles it here (sm_90a).
    ``raster_m``: m-tiles per raster group inside an expert; ``overlap_promotion``: the schedule
    that promotes k-tile t-1 while t's WGMMAs run (see :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`);
    ``requant`` (swiglu only): the output is FC2's input, e4m3 rows plus per-128 scales
    (:class:`.fp8_gemm.Fp8SwigluRequantGroupedGemmSm90`), and a call passes ``out_scale``;
    ``wide_gated`` (swiglu only): one m64n128 WGMMA over gate and up per k-block instead of two
    m64n64 ones; ``gather_a`` (not with requant): A is the source rows and a call passes ``idx``,
    grouped row r = ``a[idx[r]]`` (:class:`.fp8_gather.Fp8GatherGroupedGemmSm90`); ``cluster_n`` = 2
    (drop v28; not with requant or gather_a; N_out / tile_n even): clusters of 2 CTAs, each pair
    computing one m-tile's two adjacent n-tiles and multicasting A's halves to each other (``cluster_n``
    = 4, drop v49: four CTAs, four n-tiles, A's quarters; N_out / tile_n a multiple of 4) -- a
    call then launches at most :func:`cluster_ctas` CTAs (worked out when constructed with a GPU);
    ``smem_scales`` (drop v34; not with gather_a): the producer warp stages each k-tile's scales in
    shared memory beside its operands, so the consumers never wait on a global scale load;
    ``scale_warp`` (drop v35; with smem_scales): a second producer warp stages them instead;
    ``scale_lookahead`` (drop v65; with scale_warp, the plain kernel; 1 ... 4): k-tiles of scale loads
    that warp keeps in flight (1: v35's one at a time; same bits);
    ``fused_quant`` (drop v38; swiglu, wide_gated, cluster_n = 2): like ``requant``, the output is
    FC2's input (:class:`.fp8_gemm.Fp8SwigluFusedQuantGroupedGemmSm90`) and a call passes ``out_scale``;
    ``pair_amax`` (drop v66; with fused_quant): that input quantised by the consumers in the epilogue,
    the cluster's two CTAs swapping each row's |max| (same bits as the quantising warps');
    ``gather_tma`` (drop v41, with gather_a; not yet run on a GPU): one TMA load per gathered A row;
    ``deferred_epilogue`` (drop v48; overlap_promotion with K <= 4096, the plain bf16 output): each unit's
    epilogue runs while the next unit's first k-tile is on the tensor cores (same bits);
    ``tanh_sigmoid`` (drop v50; swiglu; v51: every variant, so they keep one another's bits): sigmoid as
    0.5 + 0.5 tanh.approx(g / 2), one MUFU op per output instead of two (not the same bits as without:
    tanh.approx's relative error is ~2^-11);
    ``unit_scales`` (drop v69; overlap_promotion, the plain kernel, K/128 a multiple of 8): the TMA warp
    loads the scales of 8 k-tiles per TMA copy into double-buffered shared memory
    (:mod:`.unit_scales`; same bits);
    ``chunk_k_tiles`` (drop v82; overlap_promotion, the plain or gathering kernel, not with
    deferred_epilogue; 0 or even, <= 16): the overlapped k-loop in chunks of at most that many k-tiles
    whenever it is longer (less code per tile; same bits)."""

    def __init__(self, activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 compiled=None, tvm_ffi: bool = False, raster_m: int = 1, overlap_promotion: bool = False,
                 requant: bool = False, wide_gated: bool = False, gather_a: bool = False, cluster_n: int = 1,
                 smem_scales: bool = False, scale_warp: bool = False, fused_quant: bool = False,
                 gather_tma: bool = False, deferred_epilogue: bool = False, tanh_sigmoid: bool = False,
                 scale_lookahead: int = 1, pair_amax: bool = False, unit_scales: bool = False,
                 chunk_k_tiles: int = 0):
        reason = can_implement(activation, n, k, num_experts)
        if reason is None and gather_tma and not gather_a:
            reason = "gather_tma is a way of gathering: it needs gather_a=True"
        if reason is None and cluster_n not in (1, 2, 4):
            reason = f"cluster_n must be 1, 2 or 4, got {cluster_n}"
        if reason is None and cluster_n > 1 and (requant or gather_a):
            reason = "cluster_n > 1 does not combine with requant or gather_a"
        if reason is None and gather_a and requant:
            reason = "gather_a and requant do not combine"
        if reason is None and gather_a and smem_scales:
            reason = "smem_scales does not combine with gather_a"
        if reason is None and scale_warp and not smem_scales:
            reason = "scale_warp needs smem_scales"
        if reason is None and not 1 <= int(scale_lookahead) <= MAX_SCALE_LOOKAHEAD:
            reason = f"scale_lookahead must be in 1 ... {MAX_SCALE_LOOKAHEAD}, got {scale_lookahead}"
        if reason is None and scale_lookahead > 1 and (not scale_warp or requant or fused_quant):
            reason = "scale_lookahead > 1 needs scale_warp and the plain kernel (not requant, not fused_quant)"
        if reason is None and fused_quant and not (wide_gated and cluster_n == 2 and not requant and not gather_a):
            reason = "fused_quant needs wide_gated and cluster_n = 2 (not requant, not gather_a)"
        if reason is None and unit_scales and (smem_scales or not overlap_promotion or requant or fused_quant
                                               or gather_a):
            reason = ("unit_scales needs overlap_promotion and the plain kernel (not smem_scales, requant, "
                      "fused_quant or gather_a)")
        if reason is None and pair_amax and not fused_quant:
            reason = "pair_amax is a way of fusing the quantiser: it needs fused_quant=True"
        if reason is None and deferred_epilogue and (not overlap_promotion or requant or fused_quant):
            reason = "deferred_epilogue needs overlap_promotion and the bf16 output (not requant, not fused_quant)"
        if reason is None and chunk_k_tiles and (not overlap_promotion or requant or fused_quant):
            reason = "chunk_k_tiles needs overlap_promotion and the plain or gathering kernel (not requant, not fused_quant)"
        if reason is None and tanh_sigmoid and activation != "swiglu":
            reason = f"tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu', got {activation!r}"
        for flag, on in (("requant", requant), ("wide_gated", wide_gated)):
            if reason is None and on and activation != "swiglu":
                reason = f"{flag} needs activation 'swiglu', got {activation!r}"
        if reason is not None:
            raise ValueError(reason)
        self.requant = bool(requant)
        self.fused_quant = bool(fused_quant)
        self.pair_amax = bool(pair_amax)
        self.wide_gated = bool(wide_gated)
        self.gather_a = bool(gather_a)
        self.gather_tma = bool(gather_tma)
        self.activation, self.n, self.k, self.num_experts = activation, n, k, num_experts
        self.scale_rows = bool(scale_rows)
        self.n_out = n // 2 if activation == "swiglu" else n
        self.tvm_ffi = bool(tvm_ffi)
        self.raster_m = int(raster_m)
        self.overlap_promotion = bool(overlap_promotion)
        self.cluster_n = int(cluster_n)
        self.smem_scales = bool(smem_scales)
        self.scale_warp = bool(scale_warp)
        self.deferred_epilogue = bool(deferred_epilogue)
        self.tanh_sigmoid = bool(tanh_sigmoid)
        self.scale_lookahead = int(scale_lookahead)
        self.unit_scales = bool(unit_scales)
        self.chunk_k_tiles = int(chunk_k_tiles)
        # the grid of a clustered launch, worked out here (not while a CUDA graph is captured)
        self._max_ctas = cluster_ctas(self.cluster_n) if self.cluster_n > 1 and torch.cuda.is_available() else None
        if compiled is None:
            if self.fused_quant:
                kernel = Fp8SwigluFusedQuantGroupedGemmSm90(scale_rows=self.scale_rows, raster_m=self.raster_m,
                                                            overlap_promotion=self.overlap_promotion,
                                                            smem_scales=self.smem_scales, scale_warp=self.scale_warp,
                                                            tanh_sigmoid=self.tanh_sigmoid, pair_amax=self.pair_amax)
            elif self.requant:
                kernel = Fp8SwigluRequantGroupedGemmSm90(scale_rows=self.scale_rows, raster_m=self.raster_m,
                                                         overlap_promotion=self.overlap_promotion,
                                                         wide_gated=self.wide_gated, smem_scales=self.smem_scales,
                                                         scale_warp=self.scale_warp, tanh_sigmoid=self.tanh_sigmoid)
            else:
                cls = Fp8GatherGroupedGemmSm90 if self.gather_a else Fp8BlockScaledGroupedGemmSm90
                kernel = cls(activation, **({"tma_rows": True} if self.gather_tma else {}), scale_rows=self.scale_rows,
                                                       raster_m=self.raster_m,
                                                       overlap_promotion=self.overlap_promotion,
                                                       wide_gated=self.wide_gated,
                                                       **({"cluster_n": self.cluster_n} if self.cluster_n > 1 else {}),
                                                       **({"smem_scales": True} if self.smem_scales else {}),
                                                       **({"scale_warp": True} if self.scale_warp else {}),
                                                       **({"deferred_epilogue": True} if self.deferred_epilogue else {}),
                                                       **({"tanh_sigmoid": True} if self.tanh_sigmoid else {}),
                                                       **({"scale_lookahead": self.scale_lookahead}
                                                          if self.scale_lookahead > 1 else {}),
                                                       **({"unit_scales": True} if self.unit_scales else {}),
                                                       **({"chunk_k_tiles": self.chunk_k_tiles}
                                                          if self.chunk_k_tiles else {}))
            opts = "--gpu-arch sm_90a" + (" --enable-tvm-ffi" if self.tvm_ffi else "")
            compiled = cute.compile(kernel, *fake_args(num_experts, n, k, activation, self.tvm_ffi, self.requant,
                                                       self.gather_a, self.fused_quant), options=opts)
        self.compiled = compiled
        self._fn = ffi_function(compiled) if self.tvm_ffi else None

    def _check_optional(self, out_scale: Optional[torch.Tensor], idx: Optional[torch.Tensor]) -> None:
        """``out_scale`` and ``idx`` are given exactly where this variant reads them."""
        if (self.requant or self.fused_quant) != (out_scale is not None):
            raise ValueError("out_scale is required with requant=True or fused_quant=True and refused without it")
        if self.gather_a != (idx is not None):
            raise ValueError("idx is required with gather_a=True and refused without it")

    def _grid(self, max_active_ctas: Optional[int], device) -> int:
        """CTAs of a launch: ``max_active_ctas`` (None: one per SM); with clusters, no more than fit
        at once (worked out once) and at least one cluster."""
        ctas = max_active_ctas if max_active_ctas is not None else _num_sms(device)
        if self.cluster_n > 1:
            if self._max_ctas is None:
                self._max_ctas = cluster_ctas(self.cluster_n, device)
            ctas = max(min(ctas, self._max_ctas), self.cluster_n)
        return ctas

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 offsets: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor,
                 max_active_ctas: Optional[int] = None, stream=None,
                 out_scale: Optional[torch.Tensor] = None, idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        a:         [M_total, K]        float8_e4m3fn (or uint8 bits), contiguous, CUDA
                   (``gather_a``: [T_src, K], the source rows)
        a_scale:   [M_total, K/128]    float32 (``gather_a``: [T_src, K/128])
        idx:       [M_total]           int32, ``gather_a`` only (required there): source row of each grouped row
        b:         [E, N, K]           float8_e4m3fn (or uint8 bits)
        b_scale:   [E, N/128, K/128]   float32
        offsets:   [E + 1]             int32 (device memory, never read by the host)
        out:       [M_total, N_out]    bfloat16; ``requant`` / ``fused_quant``: float8_e4m3fn (or uint8 bits)
        row_scale: [>= 1]              float32 ([M_total] read when scale_rows, else a placeholder)
        stream:    torch.cuda.Stream or None (current); a CUstream on the classic path
        out_scale: [M_total, N_out/128] float32, ``requant`` / ``fused_quant`` only (required there)
        """
        self._check_optional(out_scale, idx)
        ins = (_u8(a), a_scale) + ((idx,) if self.gather_a else ())
        if a.shape[0] == 0:
            return out
        ctas = self._grid(max_active_ctas, a.device)
        outs = (_u8(out), out_scale) if self.requant or self.fused_quant else (out,)
        if self.tvm_ffi:
            call_on_stream(self._fn, (*ins, _u8(b), b_scale, *outs, offsets, row_scale, ctas), stream)
            return out
        from cutlass.cute.runtime import from_dlpack

        def rows(t, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))

        outs = (rows(outs[0], 16), rows(outs[1], 4)) if self.requant or self.fused_quant else (rows(out, 16),)
        idx_args = (from_dlpack(idx, assumed_align=4).mark_compact_shape_dynamic(mode=0),) if self.gather_a else ()
        args = (rows(_u8(a), 16), rows(a_scale, 4), *idx_args, from_dlpack(_u8(b), assumed_align=16),
                from_dlpack(b_scale, assumed_align=4), *outs, from_dlpack(offsets, assumed_align=4),
                from_dlpack(row_scale, assumed_align=4).mark_compact_shape_dynamic(mode=0))
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        self.compiled(*args, cutlass.Int32(ctas), stream)
        return out

    def prepare(self, a: torch.Tensor, a_scale: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                row_scale: torch.Tensor, max_active_ctas: Optional[int] = None,
                out_scale: Optional[torch.Tensor] = None, idx: Optional[torch.Tensor] = None):
        """A launch with every argument but the weights fixed (drop v58): ``run(b, b_scale)`` is
        ``self(a, a_scale, b, b_scale, offsets, out, row_scale, max_active_ctas, out_scale=out_scale,
        idx=idx)`` -- same kernel, same arguments -- with the fixed arguments checked, viewed and
        packed once here (a layer's own buffers), so a call costs the launch and little else.
        The fixed tensors are held (kept alive) and must keep their shapes while ``run`` is used."""
        self._check_optional(out_scale, idx)
        if not self.tvm_ffi or a.shape[0] == 0:
            def run_unpacked(b, b_scale):
                self(a, a_scale, b, b_scale, offsets, out, row_scale, max_active_ctas, out_scale=out_scale, idx=idx)
            return run_unpacked
        ctas = self._grid(max_active_ctas, a.device)
        # the fixed tensors as TVM-FFI objects once (drop v61); b and b_scale stay torch tensors
        head = ffi_fixed(_u8(a), a_scale, *((idx,) if self.gather_a else ()))
        outs = (_u8(out), out_scale) if self.requant or self.fused_quant else (out,)
        tail = ffi_fixed(*outs, offsets, row_scale, ctas)
        fn = self._fn

        def run(b, b_scale):
            fn(*head, _u8(b), b_scale, *tail)
        return run
