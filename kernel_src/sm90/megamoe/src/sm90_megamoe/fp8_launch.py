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

from .fp8_gemm import FP8_BLOCK, FP8_GATED, Fp8BlockScaledGroupedGemmSm90, can_implement
from .launch import _num_sms, call_on_stream, cluster_ctas, ffi_fixed, ffi_function


def fake_args(num_experts: int, n: int, k: int, activation: str, use_tvm_ffi: bool = False):
    """Fake ``(mA, mAScale, mB, mBScale, mC, mOffsets, mRowScale, ctas, stream)``: M_total
    dynamic, the FP8 operands as uint8 views."""
    n_out = n // 2 if activation in FP8_GATED else n
    m = cute.sym_int()
    u8, f32 = cutlass.Uint8, cutlass.Float32
    mA = make_fake_compact_tensor(u8, (m, k), stride_order=(1, 0), assumed_align=16)
    mAS = make_fake_compact_tensor(f32, (m, k // FP8_BLOCK), stride_order=(1, 0), assumed_align=4)
    mB = make_fake_compact_tensor(u8, (num_experts, n, k), stride_order=(2, 1, 0), assumed_align=16)
    mBS = make_fake_compact_tensor(f32, (num_experts, n // FP8_BLOCK, k // FP8_BLOCK), stride_order=(2, 1, 0),
                                   assumed_align=4)
    mC = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mRS = make_fake_compact_tensor(f32, (cute.sym_int(),), assumed_align=4)
    return (mA, mAS, mB, mBS, mC, mOff, mRS, cutlass.Int32(132),
            make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi))


def fake_place_args(num_experts: int, n: int, k: int, activation: str, use_tvm_ffi: bool = False):
    """Fake arguments of the placing kernel (drop v92): ``(mX, mIdx, mA, mAScale, mSync, mXScale, mB,
    ...)`` -- the source rows (e4m3 as uint8) with their own dynamic count, idx and sync of dynamic
    length, the source rows' scales ``[T, K/128]``."""
    mA, mAS, *rest = fake_args(num_experts, n, k, activation, use_tvm_ffi)
    mX = make_fake_compact_tensor(cutlass.Uint8, (cute.sym_int(), k), stride_order=(1, 0), assumed_align=16)
    mIdx = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    mSync = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    mXS = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), k // FP8_BLOCK), stride_order=(1, 0),
                                   assumed_align=4)
    return (mX, mIdx, mA, mAS, mSync, mXS, *rest)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class CompiledFp8Gemm:
    """One compiled FP8 grouped GEMM for (activation, N, K, E, scale_rows, raster_m); any routing,
    any M_total.

    ``compiled``: the kernel compiled earlier (e.g. loaded from an exported object, for the same
    ``tvm_ffi``, ``raster_m`` and ``overlap_promotion``); None compiles it here (sm_90a).
    ``raster_m``: m-tiles per raster group inside an expert; ``overlap_promotion``: the schedule
    that promotes k-tile t-1 while t's WGMMAs run (see :class:`.fp8_gemm.Fp8BlockScaledGroupedGemmSm90`);
    ``wide_gated`` (gated only): one m64n128 WGMMA over gate and up per k-block instead of two
    m64n64 ones; ``cluster_n`` = 2
    (drop v28; N_out / tile_n even): clusters of 2 CTAs, each pair
    computing one m-tile's two adjacent n-tiles and multicasting A's halves to each other -- a
    call then launches at most :func:`cluster_ctas` CTAs (worked out when constructed with a GPU);
    ``smem_scales`` (drop v34): the producer warp stages each k-tile's scales in
    shared memory beside its operands, so the consumers never wait on a global scale load;
    ``scale_warp`` (drop v35; with smem_scales): a second producer warp stages them instead;
    ``deferred_epilogue`` (drop v48; overlap_promotion with K <= 4096): each unit's
    epilogue runs while the next unit's first k-tile is on the tensor cores (same bits);
    ``tanh_sigmoid`` (drop v50; swiglu; v51: every variant, so they keep one another's bits): sigmoid as
    0.5 + 0.5 tanh.approx(g / 2), one MUFU op per output instead of two (not the same bits as without:
    tanh.approx's relative error is ~2^-11);
    ``unit_scales`` (drop v69; overlap_promotion, the plain kernel, K/128 a multiple of 8, or of 4
    since drop v106): the TMA warp loads the scales of 8 (or 4) k-tiles per TMA copy into
    double-buffered shared memory (:mod:`.unit_scales`; same bits);
    ``place_a`` (drop v92; not with scale_warp): the kernel copies its own A rows and scales while it
    runs (:class:`~.fp8_gemm_place.Fp8PlaceGroupedGemmSm90`) -- row r of A from e4m3 row
    ``x[idx[r]]``, its scales from ``x_scale[idx[r]]``: a call passes ``x``, ``idx``, ``sync`` and
    ``x_scale``; ``place_opts``: the kernel's ``place_chunk_rows`` / ``place_unroll``, for the
    runner's tuning.
    Drop v84 removed ``requant``, ``fused_quant`` / ``pair_amax``, ``scale_lookahead`` and clusters of 4,
    v85 ``gather_tma``, v87 ``gather_a``, v89 ``chunk_k_tiles``, v93 ``place_gather`` / ``place_copy``
    (the quantising placement) (measured slower or no faster on the H200).
    ``swiglu_alpha`` / ``swiglu_limit`` / ``swiglu_beta`` (drop v100), ``swiglu_limit_after_act`` (drop
    v102): clamped_swiglu's constants; ``gate_softcap`` / ``up_softcap`` (drop v103): softcapped_swiglu's;
    ``stage_guard`` (drop v108): one pipeline stage fewer where the stage count divides the unrolled
    k-loop (:func:`.fp8_gemm.guarded_stages`; ptxas spills there; the same bits)."""

    def __init__(self, activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 compiled=None, tvm_ffi: bool = False, raster_m: int = 1, overlap_promotion: bool = False,
                 wide_gated: bool = False, cluster_n: int = 1,
                 smem_scales: bool = False, scale_warp: bool = False,
                 deferred_epilogue: bool = False, tanh_sigmoid: bool = False, unit_scales: bool = False,
                 place_a: bool = False, place_opts: Optional[dict] = None,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, swiglu_beta: float = 1.0,
                 swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0, up_softcap: float = 25.0,
                 stage_guard: bool = False):
        reason = can_implement(activation, n, k, num_experts)
        if reason is None and place_a and scale_warp:
            reason = "place_a does not combine with scale_warp (warp 1 copies rows)"
        if reason is None and cluster_n not in (1, 2):
            reason = f"cluster_n must be 1 or 2, got {cluster_n}"
        if reason is None and scale_warp and not smem_scales:
            reason = "scale_warp needs smem_scales"
        if reason is None and unit_scales and (smem_scales or not overlap_promotion):
            reason = "unit_scales needs overlap_promotion and refuses smem_scales"
        if reason is None and deferred_epilogue and not overlap_promotion:
            reason = "deferred_epilogue needs overlap_promotion"
        if reason is None and tanh_sigmoid and activation != "swiglu":
            reason = f"tanh_sigmoid is swiglu's sigmoid: it needs activation 'swiglu', got {activation!r}"
        if reason is None and wide_gated and activation not in FP8_GATED:
            reason = f"wide_gated needs a gated activation {FP8_GATED}, got {activation!r}"
        if reason is not None:
            raise ValueError(reason)
        self.wide_gated = bool(wide_gated)
        self.activation, self.n, self.k, self.num_experts = activation, n, k, num_experts
        self.scale_rows = bool(scale_rows)
        self.n_out = n // 2 if activation in FP8_GATED else n
        self.tvm_ffi = bool(tvm_ffi)
        self.raster_m = int(raster_m)
        self.overlap_promotion = bool(overlap_promotion)
        self.cluster_n = int(cluster_n)
        self.smem_scales = bool(smem_scales)
        self.scale_warp = bool(scale_warp)
        self.deferred_epilogue = bool(deferred_epilogue)
        self.tanh_sigmoid = bool(tanh_sigmoid)
        self.unit_scales = bool(unit_scales)
        self.place_a = bool(place_a)
        self.stage_guard = bool(stage_guard)
        # the grid of a clustered launch, worked out here (not while a CUDA graph is captured)
        self._max_ctas = cluster_ctas(self.cluster_n) if self.cluster_n > 1 and torch.cuda.is_available() else None
        if compiled is None:
            cls, place_kw = Fp8BlockScaledGroupedGemmSm90, {}
            if self.place_a:
                from .fp8_gemm_place import Fp8PlaceGroupedGemmSm90 as cls
                place_kw = dict(place_opts or {})
            kernel = cls(
                activation, scale_rows=self.scale_rows, raster_m=self.raster_m,
                overlap_promotion=self.overlap_promotion, wide_gated=self.wide_gated,
                **({"cluster_n": self.cluster_n} if self.cluster_n > 1 else {}),
                **({"smem_scales": True} if self.smem_scales else {}),
                **({"scale_warp": True} if self.scale_warp else {}),
                **({"deferred_epilogue": True} if self.deferred_epilogue else {}),
                **({"tanh_sigmoid": True} if self.tanh_sigmoid else {}),
                **({"unit_scales": True} if self.unit_scales else {}),
                **({"stage_guard": True} if self.stage_guard else {}),
                **(dict(swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, swiglu_beta=swiglu_beta,
                        swiglu_limit_after_act=swiglu_limit_after_act)
                   if activation == "clamped_swiglu" else {}),
                **(dict(gate_softcap=gate_softcap, up_softcap=up_softcap) if activation == "softcapped_swiglu" else {}),
                **place_kw)
            opts = "--gpu-arch sm_90a" + (" --enable-tvm-ffi" if self.tvm_ffi else "")
            fake = fake_place_args(num_experts, n, k, activation, self.tvm_ffi) if self.place_a \
                else fake_args(num_experts, n, k, activation, self.tvm_ffi)
            compiled = cute.compile(kernel, *fake, options=opts)
        self.compiled = compiled
        self._fn = ffi_function(compiled) if self.tvm_ffi else None

    def _grid(self, max_active_ctas: Optional[int], device) -> int:
        """CTAs of a launch: ``max_active_ctas`` (None: one per SM); with clusters, no more than fit
        at once (worked out once) and at least one cluster."""
        ctas = max_active_ctas if max_active_ctas is not None else _num_sms(device)
        if self.cluster_n > 1:
            if self._max_ctas is None:
                self._max_ctas = cluster_ctas(self.cluster_n, device)
            ctas = max(min(ctas, self._max_ctas), self.cluster_n)
        return ctas

    def _check_place_args(self, x, idx, sync, x_scale) -> None:
        """``x``, ``idx``, ``sync`` and ``x_scale`` go with place_a, and nothing else."""
        given = (x is not None, idx is not None, sync is not None, x_scale is not None)
        if any(g != self.place_a for g in given):
            raise ValueError("x, idx, sync and x_scale are required with place_a=True and refused without it")
        if not self.place_a:
            return
        if sync.dtype != torch.int32 or sync.dim() != 1 or sync.numel() < 5:
            raise ValueError("sync must be a 1-d int32 tensor of S + 4 >= 5 elements")
        if idx.dtype != torch.int32 or idx.dim() != 1:
            raise ValueError("idx must be a 1-d int32 tensor")
        if x is not None and (x.dtype not in (torch.float8_e4m3fn, torch.uint8) or x.dim() != 2
                              or x.shape[1] != self.k):
            raise ValueError(f"x must be a torch.float8_e4m3fn (or uint8) [T, {self.k}] tensor")
        if x_scale.dtype != torch.float32 or x_scale.dim() != 2 or x_scale.shape[1] != self.k // FP8_BLOCK:
            raise ValueError(f"x_scale must be a float32 [T, {self.k // FP8_BLOCK}] tensor")

    def _place_args(self, x, idx, sync, x_scale) -> tuple:
        """The placing kernel's leading ``(x, idx)`` and its ``(sync, x_scale)``."""
        if not self.place_a:
            return (), ()
        return (None if x is None else _u8(x), idx), (sync, x_scale)

    def __call__(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 offsets: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor,
                 max_active_ctas: Optional[int] = None, stream=None, x: Optional[torch.Tensor] = None,
                 idx: Optional[torch.Tensor] = None, sync: Optional[torch.Tensor] = None,
                 x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        a:         [M_total, K]        float8_e4m3fn (or uint8 bits), contiguous, CUDA (place_a:
                                       written by the kernel, rows < offsets[E])
        a_scale:   [M_total, K/128]    float32 (place_a: written by the kernel)
        b:         [E, N, K]           float8_e4m3fn (or uint8 bits)
        b_scale:   [E, N/128, K/128]   float32
        offsets:   [E + 1]             int32 (device memory, never read by the host)
        out:       [M_total, N_out]    bfloat16
        row_scale: [>= 1]              float32 ([M_total] read when scale_rows, else a placeholder)
        stream:    torch.cuda.Stream or None (current); a CUstream on the classic path
        x:         [T, K] float8_e4m3fn (or uint8 bits), required iff place_a: the rows to copy
        idx:       [M_total] int32, required iff place_a: row r of A is x[idx[r]]
        sync:      [S + 4] int32, required iff place_a (zero before its first launch; the kernel
                   leaves it so)
        x_scale:   [T, K/128] float32, required iff place_a: the scales of x's rows
        """
        self._check_place_args(x, idx, sync, x_scale)
        if a.shape[0] == 0:
            return out
        ctas = self._grid(max_active_ctas, a.device)
        head, mid = self._place_args(x, idx, sync, x_scale)
        if self.tvm_ffi:
            call_on_stream(self._fn, (*head, _u8(a), a_scale, *mid, _u8(b), b_scale, out, offsets, row_scale, ctas),
                           stream)
            return out
        from cutlass.cute.runtime import from_dlpack

        def rows(t, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))

        def vec(t):
            return from_dlpack(t, assumed_align=4).mark_compact_shape_dynamic(mode=0)

        lead = (rows(head[0], 16), vec(head[1])) if self.place_a else ()
        tail = (vec(mid[0]), rows(mid[1], 4)) if self.place_a else ()
        args = (*lead, rows(_u8(a), 16), rows(a_scale, 4), *tail,
                from_dlpack(_u8(b), assumed_align=16), from_dlpack(b_scale, assumed_align=4), rows(out, 16),
                from_dlpack(offsets, assumed_align=4), vec(row_scale))
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        self.compiled(*args, cutlass.Int32(ctas), stream)
        return out

    def prepare(self, a: torch.Tensor, a_scale: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                row_scale: torch.Tensor, max_active_ctas: Optional[int] = None, x: Optional[torch.Tensor] = None,
                idx: Optional[torch.Tensor] = None, sync: Optional[torch.Tensor] = None,
                x_scale: Optional[torch.Tensor] = None):
        """A launch with every argument but the weights fixed (drop v58): ``run(b, b_scale)`` is
        ``self(a, a_scale, b, b_scale, offsets, out, row_scale, max_active_ctas)`` -- same kernel, same
        arguments -- with the fixed arguments checked, viewed and
        packed once here (a layer's own buffers), so a call costs the launch and little else.
        The fixed tensors are held (kept alive) and must keep their shapes while ``run`` is used.
        A placing kernel (place_a) also fixes its source rows ``x`` (a layer buffer: the tokens the
        layer quantised), ``idx``, ``sync`` and ``x_scale`` here (drop v95: no longer ``x`` per call)."""
        self._check_place_args(x, idx, sync, x_scale)
        if not self.tvm_ffi or a.shape[0] == 0:
            place = dict(x=x, idx=idx, sync=sync, x_scale=x_scale) if self.place_a else {}

            def run_unpacked(b, b_scale):
                self(a, a_scale, b, b_scale, offsets, out, row_scale, max_active_ctas, **place)
            return run_unpacked
        ctas = self._grid(max_active_ctas, a.device)
        # the fixed tensors as TVM-FFI objects once (drop v61); b and b_scale stay torch tensors
        lead, mid = self._place_args(x, idx, sync, x_scale)
        # (placing:) x, idx; a, a_scale; (placing:) sync, x_scale
        head = ffi_fixed(*lead, _u8(a), a_scale, *mid)
        tail = ffi_fixed(out, offsets, row_scale, ctas)
        fn = self._fn

        def run(b, b_scale):
            fn(*head, _u8(b), b_scale, *tail)
        return run
