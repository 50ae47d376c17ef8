"""Host side: compile cache, torch -> CuTe conversion, launch. No host sync on the launch path.

Two launch paths, chosen per compiled kernel (``tvm_ffi``):
* TVM-FFI (``--enable-tvm-ffi``, needs apache-tvm-ffi): the kernel is called with torch tensors and
  Python ints on torch's current stream (~4 us per launch on an H200 host, nothing to convert or
  cache; shapes, dtypes, alignment and device are checked by the call itself);
* classic: CuTe tensors converted with ``from_dlpack`` (``to_cute_args``, ~60 us for six tensors,
  so callers cache them) and an explicit ``CUstream`` (~18 us per launch).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack
import cuda.bindings.driver as cuda

from . import DROP_VERSION
from .constants import ABI_VERSION
from .grouped_gemm import GroupedGemmSm90

_CACHE: Dict[tuple, "CompiledGroupedGemm"] = {}


def _num_sms(device=None) -> int:
    """SM count of the device (default: current). Raises without CUDA: never guessed."""
    if not torch.cuda.is_available():
        raise RuntimeError("sm90_megamoe: no CUDA device to size the grid for; pass max_active_ctas")
    dev = device if device is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cluster_ctas(cluster: int, device_index: int) -> int:
    from cutlass.utils import HardwareInfo

    # the occupancy query runs in the thread's current context: make it this device's (torch
    # creates a context lazily, at its first allocation; a launcher built before any tensor
    # failed with CUDA_ERROR_INVALID_CONTEXT, drop v30)
    with torch.cuda.device(device_index):
        torch.empty(1, device=torch.device("cuda", device_index))
        return cluster * HardwareInfo(device_index).get_max_active_clusters(cluster)


def cluster_ctas(cluster: int, device=None) -> int:
    """Persistent CTAs of a launch with clusters of ``cluster`` CTAs: one per SM for 1, else
    ``cluster`` times the clusters that fit at once (the SMs of a cluster share a GPC, so some
    SMs may stay idle; a larger grid would run its last clusters after all the others)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if cluster == 1:
        return _num_sms(index)
    return min(_num_sms(index), _cluster_ctas(int(cluster), index))


def to_cute_args(a, b, c, offsets, row_scale, bias, idx=None, sync=None):
    """Convert contiguous torch tensors to CuTe tensors whose static/dynamic structure matches
    ``compile_check.fake_args``: M_total dynamic, everything else static. ``bias``: ``[E, N]``
    (fp32/bf16) for a has_bias kernel, else any ``[1, L]`` fp32 placeholder. ``idx`` ([M_total]
    int32, a gathering kernel only): follows ``a`` (then the source rows, their own count).
    ``sync`` ([S + 4] int32, a handoff kernel only, drop v112): follows ``bias``."""
    mA = from_dlpack(a, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    ix = () if idx is None else (from_dlpack(idx, assumed_align=4).mark_compact_shape_dynamic(mode=0),)
    mB = from_dlpack(b, assumed_align=16)
    mC = from_dlpack(c, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    mOff = from_dlpack(offsets, assumed_align=4)
    mScale = from_dlpack(row_scale, assumed_align=4).mark_compact_shape_dynamic(mode=0)
    mBias = from_dlpack(bias, assumed_align=4)
    if bias.shape[0] == 1:  # the placeholder's length is dynamic
        mBias = mBias.mark_compact_shape_dynamic(mode=1, stride_order=(0, 1))
    sy = () if sync is None else (from_dlpack(sync, assumed_align=4).mark_compact_shape_dynamic(mode=0),)
    return (mA, *ix, mB, mC, mOff, mScale, mBias, *sy)


def ffi_function(compiled):
    """The fast callable of a TVM-FFI kernel: the ``tvm_ffi.Function`` behind a freshly compiled
    object, or the object itself (already a ``tvm_ffi.Function`` when loaded from an exported
    object file with ``cute.runtime.load_module(..., enable_tvm_ffi=True)``)."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    fn = get() if callable(get) else None
    return fn if fn is not None else compiled


def call_on_stream(fn, args, stream=None):
    """Call a TVM-FFI kernel on ``stream`` (a ``torch.cuda.Stream``; None: the current stream,
    which the kernel reads from torch itself)."""
    if stream is None:
        return fn(*args)
    with torch.cuda.stream(stream):
        return fn(*args)


def ffi_fixed(*args):
    """A prepared TVM-FFI launch's fixed arguments with each torch tensor converted once to a
    ``tvm_ffi.Tensor`` (drop v61; withdrawn in v62, back in v64). A call then hands TVM-FFI objects
    it passes through instead of torch tensors it converts (H200, one process, the same layer's
    forwards interleaved: 2.5-5 us less host time per forward, FP8 and BF16, 1-128 tokens).
    Each keeps its torch tensor alive. A call must still pass at least one torch tensor of the
    launch's device: TVM-FFI takes the launch's stream from the first one (torch's current stream
    there); with none it would launch on the default stream."""
    import tvm_ffi

    return tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)


_TORCH_BIAS = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_raster_m(k: int, l2_budget_bytes: int = 24 << 20) -> int:
    """m-tiles per raster group: as many 128-row A blocks of width K as fit in ``l2_budget_bytes``
    (about half of the H200's 50 MB L2), at most 16."""
    return max(1, min(16, l2_budget_bytes // (128 * k * 2)))


class CompiledGroupedGemm:
    """One compiled kernel for (activation, N, K, E, tile_n, scale_rows, bias dtype, raster_m);
    any routing and M_total."""

    def __init__(self, activation: str, n: int, k: int, num_experts: int, scale_rows: bool,
                 tile_n: Optional[int] = None, num_stages: Optional[int] = None,
                 epilogue: str = "smem", example: Optional[Tuple[torch.Tensor, ...]] = None,
                 bias_dtype: Optional[str] = None, raster_m: Optional[int] = None,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 schedule: str = "cooperative", compiled=None, tvm_ffi: bool = False,
                 early_weights: bool = False, gather_a: bool = False, cluster_m: int = 1,
                 tanh_sigmoid: bool = False, cluster_n: int = 1, jump_stages: bool = False,
                 swiglu_beta: float = 1.0, swiglu_limit_after_act: bool = False,
                 gate_softcap: float = 4.0, up_softcap: float = 25.0, box_rows: int = 0,
                 handoff: str = ""):
        """``compiled``: this variant's kernel compiled earlier (e.g. loaded from an exported
        object file, ``cute.runtime.load_module``); None compiles it here (sm_90a).
        ``tvm_ffi``: compile for (and launch through) TVM-FFI: :meth:`launch_tensors`.
        ``schedule``: "cooperative" / "pingpong" / "wide" (:class:`GroupedGemmSm90`, ``tile_n`` = output
        columns per tile) or "swapab" (:class:`~.swapab_gemm.SwapABGroupedGemmSm90`, for a few
        rows per expert; ``tile_n`` is then its token tile ``tile_t``). Same arguments either way.
        ``early_weights``: swap-AB only, see :class:`~.swapab_gemm.SwapABGroupedGemmSm90`.
        ``gather_a`` (cooperative / wide; drop v23): A is the source rows and a call passes
        ``idx``, grouped row r = ``a[idx[r]]`` (:class:`~.grouped_gemm_gather.GroupedGemmGatherSm90`).
        ``cluster_m`` = 2 (cooperative / wide; drop v29): clusters of 2 CTAs computing an m-tile pair
        and multicasting B's halves; a call launches at most :func:`cluster_ctas` CTAs (worked out
        when constructed with a GPU).
        ``tanh_sigmoid`` (swiglu, every schedule; drop v52): the sigmoid from one ``tanh.approx``.
        ``cluster_n`` = 2 (non-gated, cooperative / pingpong; drop v72): clusters of 2 CTAs computing
        an n-tile pair and multicasting A's halves; the grid is clamped as for ``cluster_m``.
        ``jump_stages`` (pingpong; drop v79): a warpgroup skips the other's stages in one index /
        phase step instead of unrolled single advances (:class:`GroupedGemmSm90`; the same bits).
        ``swiglu_beta`` (clamped_swiglu; drop v99): ``(clamp(u) + beta)``, 1.0 (gpt-oss) or 0.0
        (DeepSeek-V4 / GLM-5 / Hunyuan-V4). ``swiglu_limit_after_act`` (clamped_swiglu; drop v102):
        the gate clamped after the activation (Step-3.7 / Bailing). ``gate_softcap`` / ``up_softcap``
        (softcapped_swiglu; drop v103): its caps (Inkling2: 4, 25). (Drop v94 removed v91's ``place_a`` / ``place_opts``.)
        ``box_rows`` > 0 (cooperative / wide / pingpong, not gather_a / cluster_n; drop v111): a partial
        m-tile loads A in boxes of that many rows, the boxes past its expert as TMA zero fill
        (:class:`~.grouped_gemm_box_tails.GroupedGemmBoxTailsSm90`; the same bits and arguments).
        ``handoff`` "publish" (FC1: cooperative / wide) or "await" (FC2: any TMA schedule), drop v112: FC2
        starts inside FC1's last wave and waits per m-tile (:mod:`.grouped_gemm_handoff`); a call passes
        ``sync`` (both) and ``publishers`` (FC2: the CTAs FC1 was launched with)."""
        from .compile_check import fake_args

        if bias_dtype not in _TORCH_BIAS:
            raise ValueError(f"bias_dtype must be None, 'float32' or 'bfloat16', got {bias_dtype!r}")
        if raster_m is None:
            raster_m = pick_raster_m(k)
        if schedule == "swapab":
            from .swapab_gemm import SwapABGroupedGemmSm90

            self.kernel = SwapABGroupedGemmSm90(activation, scale_rows=scale_rows,
                                                has_bias=bias_dtype is not None, tile_t=tile_n or 32,
                                                num_stages=num_stages, swiglu_alpha=swiglu_alpha,
                                                swiglu_limit=swiglu_limit, swiglu_beta=swiglu_beta,
                                                swiglu_limit_after_act=swiglu_limit_after_act,
                                                gate_softcap=gate_softcap, up_softcap=up_softcap,
                                                early_weights=early_weights,
                                                **({"tanh_sigmoid": True} if tanh_sigmoid else {}))
        else:
            if early_weights:
                raise ValueError("early_weights is a swap-AB option (schedule='swapab')")
            if cluster_m > 1 and gather_a:
                raise ValueError("cluster_m = 2 does not combine with gather_a")
            if cluster_n > 1 and gather_a:
                raise ValueError("cluster_n = 2 does not combine with gather_a")
            if box_rows and (gather_a or cluster_n > 1):
                raise ValueError("box_rows does not combine with gather_a or cluster_n")
            if handoff and (gather_a or box_rows):
                raise ValueError("handoff does not combine with gather_a or box_rows")
            cls, box = GroupedGemmSm90, {}
            if handoff:
                from .grouped_gemm_handoff import handoff_class

                cls = handoff_class(handoff)
            if gather_a:
                from .grouped_gemm_gather import GroupedGemmGatherSm90 as cls
            elif box_rows:
                from .grouped_gemm_box_tails import GroupedGemmBoxTailsSm90 as cls
                box = {"box_rows": int(box_rows)}
            self.kernel = cls(activation, tile_n=tile_n, scale_rows=scale_rows,
                                          num_stages=num_stages, epilogue=epilogue,
                                          has_bias=bias_dtype is not None, raster_m=raster_m,
                                          swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                          swiglu_beta=swiglu_beta,
                                          swiglu_limit_after_act=swiglu_limit_after_act, schedule=schedule,
                                          gate_softcap=gate_softcap, up_softcap=up_softcap,
                                          **({"cluster_m": cluster_m} if cluster_m > 1 else {}),
                                          **({"tanh_sigmoid": True} if tanh_sigmoid else {}),
                                          **({"cluster_n": cluster_n} if cluster_n > 1 else {}),
                                          **({"jump_stages": True} if jump_stages else {}), **box)
        if (gather_a or cluster_m > 1 or cluster_n > 1 or box_rows or handoff) and schedule == "swapab":
            raise ValueError("gather_a, cluster_m, cluster_n, box_rows and handoff are 128-row kernel options (not "
                             "schedule='swapab')")
        self.box_rows = int(box_rows)
        self.handoff = handoff or ""
        self.cluster_m = int(cluster_m)
        self.cluster_n = int(cluster_n)
        self.cluster = self.cluster_m * self.cluster_n  # CTAs per cluster
        # the grid of a clustered launch, worked out here (not while a CUDA graph is captured)
        self._max_ctas = cluster_ctas(self.cluster) if self.cluster > 1 and torch.cuda.is_available() else None
        self.gather_a = bool(gather_a)
        self.tanh_sigmoid = bool(tanh_sigmoid)
        self.jump_stages = bool(jump_stages)
        self.activation = activation
        self.schedule = schedule
        self.early_weights = bool(early_weights)
        self.n, self.k, self.num_experts = n, k, num_experts
        self.n_out, self.n_tiles = self.kernel.static_shapes(n, k)
        self.scale_rows = scale_rows
        self.bias_dtype = bias_dtype
        self.raster_m = raster_m
        self.tvm_ffi = bool(tvm_ffi)
        if compiled is not None:
            self.compiled = compiled
        else:
            if example is None:
                args = fake_args(self.kernel, num_experts, n, k, bias_dtype=bias_dtype or "float32",
                                 use_tvm_ffi=self.tvm_ffi)
            elif self.tvm_ffi:
                raise ValueError("compiling from example tensors is for the classic path (tvm_ffi=False)")
            else:  # compile from real tensors (debugging)
                args = (*to_cute_args(*example), cutlass.Int32(_num_sms(example[0].device)),
                        cuda.CUstream(torch.cuda.current_stream().cuda_stream))
            opts = "--gpu-arch sm_90a" + (" --enable-tvm-ffi" if self.tvm_ffi else "")
            self.compiled = cute.compile(self.kernel, *args, options=opts)
        self._fn = ffi_function(self.compiled) if self.tvm_ffi else None
        self._dummy_scale = None
        self._dummy_bias = None

    def placeholders(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(row_scale, bias) placeholders for the arguments this variant never reads."""
        if self._dummy_scale is None or self._dummy_scale.device != torch.device(device):
            self._dummy_scale = torch.zeros(1, dtype=torch.float32, device=device)
            self._dummy_bias = torch.zeros(1, 8, dtype=torch.float32, device=device)
        return self._dummy_scale, self._dummy_bias

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                 out: Optional[torch.Tensor] = None, row_scale: Optional[torch.Tensor] = None,
                 max_active_ctas: Optional[int] = None, stream=None,
                 bias: Optional[torch.Tensor] = None, idx: Optional[torch.Tensor] = None,
                 sync: Optional[torch.Tensor] = None, publishers: Optional[int] = None) -> torch.Tensor:
        """
        a:         [M_total, K]      bf16, contiguous, CUDA
        b:         [E, N, K]         bf16, contiguous
        offsets:   [E + 1]           int32, CUDA (device memory; never read by the host)
        out:       [M_total, N_out]  bf16 or None (allocated)
        row_scale: [M_total]         fp32, required iff scale_rows
        bias:      [E, N]            fp32/bf16 (this variant's bias dtype), required iff bias_dtype
        idx:       [M_total]         int32, required iff gather_a (then a is [T_src, K] and out is required)
        sync:      [S + 4]           int32, required iff handoff (drop v112; zero before the first launch)
        publishers:                  int, FC1's CTAs, required iff handoff == "await"
        """
        self._check_index_args(idx)
        self._check_handoff_args(sync, publishers)
        if self.gather_a and out is None:
            raise ValueError("gather_a: pass out [M_total, N_out] (M_total is idx's length)")
        m_total = a.shape[0]
        if out is None:
            out = torch.empty(m_total, self.n_out, dtype=torch.bfloat16, device=a.device)
        if m_total == 0:
            return out
        dummy_scale, dummy_bias = self.placeholders(a.device)
        if self.scale_rows:
            assert row_scale is not None and row_scale.dtype == torch.float32
        else:
            row_scale = dummy_scale
        if self.bias_dtype is not None:
            assert bias is not None and bias.dtype == _TORCH_BIAS[self.bias_dtype]
            assert tuple(bias.shape) == (self.num_experts, self.n) and bias.is_contiguous()
        else:
            bias = dummy_bias
        if self.tvm_ffi:
            self.launch_tensors(a, b, out, offsets, row_scale, bias, max_active_ctas, stream, idx=idx, sync=sync,
                                publishers=publishers)
        else:
            self.launch_converted(to_cute_args(a, b, out, offsets, row_scale, bias, idx, sync), max_active_ctas,
                                  stream, publishers=publishers)
        return out

    def _check_handoff_args(self, sync, publishers) -> None:
        """``sync`` goes with a handoff kernel and ``publishers`` with the awaiting one (drop v112)."""
        if bool(self.handoff) != (sync is not None):
            raise ValueError("sync is required with handoff ('publish' / 'await') and refused without it")
        if (self.handoff == "await") != (publishers is not None):
            raise ValueError("publishers (FC1's CTAs) is required with handoff='await' and refused otherwise")
        if sync is not None and (sync.dtype != torch.int32 or sync.dim() != 1 or not sync.is_contiguous()):
            raise ValueError("sync must be a contiguous 1-D int32 tensor")

    def _tail(self, sync, publishers) -> tuple:
        """The handoff kernels' arguments after ``bias`` (drop v112): ``(sync[, publishers])``."""
        return (() if sync is None else (sync,)) + (() if publishers is None else (int(publishers),))

    def _check_index_args(self, idx) -> None:
        """``idx`` goes with gather_a, and nothing else."""
        if self.gather_a != (idx is not None):
            raise ValueError("idx is required with gather_a=True and refused without it")

    def prepare(self, a: Optional[torch.Tensor], out: torch.Tensor, offsets: torch.Tensor, row_scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, max_active_ctas: Optional[int] = None,
                idx: Optional[torch.Tensor] = None, sync: Optional[torch.Tensor] = None,
                publishers: Optional[int] = None):
        """:meth:`launch_tensors` with every argument but the weights (and a per-call bias) fixed
        (drop v61; placeholders from the caller since v63): ``run(b, bias=None)`` launches the same
        kernel with the same arguments as ``launch_tensors(a, b, out, offsets, row_scale, bias,
        max_active_ctas, idx=idx)``, the fixed ones checked once here and passed as TVM-FFI tensors
        (v64; :func:`ffi_fixed`). They are a layer's own buffers, held: they must keep their shapes
        while ``run`` is used.

        a:         the fixed A, or None for a gathering kernel whose source rows change per call
                   (drop v91): ``run(b, bias=None, a=x)`` then takes them (no rows: no launch).
        row_scale: [M_total] fp32 with ``scale_rows``, else any fp32 [L] placeholder (never read).
        bias:      the fixed bias argument -- for a kernel without a bias, its fp32 [1, L]
                   placeholder -- or None: each call passes its own (``bias_dtype`` kernels only),
                   checked there ([E, N], that dtype, contiguous)."""
        if not self.tvm_ffi:
            raise RuntimeError("prepare needs a kernel compiled with tvm_ffi=True")
        self._check_index_args(idx)
        self._check_handoff_args(sync, publishers)
        if row_scale is None or row_scale.dtype != torch.float32:
            raise ValueError("row_scale must be a float32 tensor (a placeholder unless scale_rows)")
        if bias is None and self.bias_dtype is None:
            raise ValueError("this grouped GEMM was compiled without a bias: pass its [1, L] float32 placeholder")
        # the fixed tensors as TVM-FFI objects once (drop v64; an empty `a` stays as it is); b,
        # and a per-call bias, stay torch tensors: TVM-FFI takes the stream from b
        if a is None and idx is None:
            raise ValueError("a may be left to each call (a=None) only for a gathering kernel")
        fixed = ffi_fixed if (a is None or a.shape[0]) else (lambda *t: t)
        head = fixed(*(() if a is None else (a,)), *(() if idx is None else (idx,)))
        mid = fixed(out, offsets, row_scale)
        tail = fixed(*self._tail(sync, publishers))  # drop v112: after the bias
        ctas = self._grid(max_active_ctas, out.device)
        fn, (fixed_bias,) = self._fn, fixed(bias)
        want, shape = _TORCH_BIAS[self.bias_dtype], (self.num_experts, self.n)

        def check_bias(bias):
            if bias is None or bias.dtype != want or tuple(bias.shape) != shape or not bias.is_contiguous():
                raise ValueError(f"bias must be a contiguous {want} {list(shape)} tensor")

        if a is None:  # the source rows per call (a gathering kernel)
            def run_rows(b, bias=None, a=None):
                if a is None:
                    raise ValueError("this launch takes its source rows per call: pass a=")
                if fixed_bias is not None:
                    if bias is not None:
                        raise ValueError("this launch's bias was fixed at prepare: pass none per call")
                    bias = fixed_bias
                else:
                    check_bias(bias)
                if a.shape[0]:  # no rows: nothing to launch
                    fn(a, *head, b, *mid, bias, *tail, ctas)
            return run_rows
        if fixed_bias is not None:
            def run(b, bias=None):
                if bias is not None:
                    raise ValueError("this launch's bias was fixed at prepare: pass none per call")
                fn(*head, b, *mid, fixed_bias, *tail, ctas)
            return run

        def run_bias(b, bias=None):
            check_bias(bias)
            fn(*head, b, *mid, bias, *tail, ctas)
        return run_bias

    def launch_tensors(self, a, b, c, offsets, row_scale, bias, max_active_ctas: Optional[int] = None,
                       stream=None, idx=None, sync=None, publishers=None):
        """TVM-FFI launch (``tvm_ffi=True`` only) with torch tensors, in ``to_cute_args`` order:
        a [M, K], b [E, N, K], c [M, N_out] bf16; offsets [E+1] int32; row_scale [>= 1] fp32;
        bias [E, N] (or the [1, L] fp32 placeholder). ``stream``: a torch.cuda.Stream or None
        (current). A tensor that does not match the compiled signature raises."""
        if not self.tvm_ffi:
            raise RuntimeError("launch_tensors needs a kernel compiled with tvm_ffi=True")
        ctas = self._grid(max_active_ctas, a.device)
        ins = (a,) if idx is None else (a, idx)  # a gathering kernel: the source rows, then idx
        call_on_stream(self._fn, (*ins, b, c, offsets, row_scale, bias, *self._tail(sync, publishers), ctas), stream)

    def launch_converted(self, args, max_active_ctas: Optional[int] = None, stream=None, publishers=None):
        """Launch with pre-converted CuTe tensors (classic path). Arguments that do not match the
        fake-compiled signature raise (the fake arguments are the ABI; nothing is silently
        recompiled)."""
        if self.tvm_ffi:
            raise RuntimeError("this kernel was compiled for TVM-FFI: use launch_tensors")
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        ctas = self._grid(max_active_ctas)
        pub = () if publishers is None else (cutlass.Int32(publishers),)  # drop v112: the awaiting FC2's
        self.compiled(*args, *pub, cutlass.Int32(ctas), stream)

    def grid_ctas(self, max_active_ctas: Optional[int] = None, device=None) -> int:
        """The CTAs a launch with ``max_active_ctas`` runs (a multiple of the cluster): what an awaiting
        FC2 takes as ``publishers`` from its publishing FC1 (drop v112)."""
        return self._grid(max_active_ctas, device) // self.cluster * self.cluster

    def _grid(self, max_active_ctas: Optional[int], device=None) -> int:
        """CTAs to launch: ``max_active_ctas`` or one per SM, no more than the clusters that fit."""
        ctas = max_active_ctas if max_active_ctas is not None else _num_sms(device)
        if self.cluster > 1:
            if self._max_ctas is None:
                self._max_ctas = cluster_ctas(self.cluster, device)
            ctas = min(ctas, self._max_ctas)
        return ctas


def get_grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                     tile_n: Optional[int] = None, num_stages: Optional[int] = None,
                     epilogue: str = "smem", bias_dtype: Optional[str] = None,
                     raster_m: Optional[int] = None, swiglu_alpha: float = 1.702,
                     swiglu_limit: float = 7.0, schedule: str = "cooperative",
                     tvm_ffi: bool = False, cluster_m: int = 1,
                     tanh_sigmoid: bool = False, cluster_n: int = 1,
                     jump_stages: bool = False, swiglu_beta: float = 1.0,
                     swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
                     up_softcap: float = 25.0, box_rows: int = 0, handoff: str = "") -> CompiledGroupedGemm:
    """Cached compile. Key: everything static; routing and M_total are runtime."""
    if raster_m is None:
        raster_m = pick_raster_m(k)
    key = (ABI_VERSION, DROP_VERSION, cutlass.__version__ if hasattr(cutlass, "__version__") else "",
           activation, n, k, num_experts, bool(scale_rows), tile_n, num_stages, epilogue, bias_dtype,
           raster_m, float(swiglu_alpha), float(swiglu_limit), schedule, bool(tvm_ffi), "sm_90a", int(cluster_m),
           bool(tanh_sigmoid), int(cluster_n), bool(jump_stages), float(swiglu_beta),
           bool(swiglu_limit_after_act), float(gate_softcap), float(up_softcap), int(box_rows), str(handoff))
    fn = _CACHE.get(key)
    if fn is None:
        fn = CompiledGroupedGemm(activation, n, k, num_experts, scale_rows, tile_n, num_stages,
                                 epilogue, bias_dtype=bias_dtype, raster_m=raster_m,
                                 swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                 schedule=schedule, tvm_ffi=tvm_ffi, cluster_m=cluster_m,
                                 tanh_sigmoid=tanh_sigmoid, cluster_n=cluster_n, jump_stages=jump_stages,
                                 swiglu_beta=swiglu_beta, swiglu_limit_after_act=swiglu_limit_after_act,
                                 gate_softcap=gate_softcap, up_softcap=up_softcap, box_rows=box_rows,
                                 handoff=handoff)
        _CACHE[key] = fn
    return fn


def grouped_gemm(a, b, offsets, activation: str, out=None, row_scale=None,
                 max_active_ctas: Optional[int] = None, tile_n: Optional[int] = None, bias=None):
    """Functional entry point: C = act(A_e @ B_e^T + bias[e]) (* row_scale) per expert segment."""
    bias_dtype = None if bias is None else str(bias.dtype).replace("torch.", "")
    fn = get_grouped_gemm(activation, b.shape[1], b.shape[2], b.shape[0],
                          scale_rows=row_scale is not None, tile_n=tile_n, bias_dtype=bias_dtype)
    return fn(a, b, offsets, out=out, row_scale=row_scale, max_active_ctas=max_active_ctas,
              bias=bias)
