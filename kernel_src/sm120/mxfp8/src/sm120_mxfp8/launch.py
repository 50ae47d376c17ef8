"""Host side: compile without a GPU (fake tensors), compile cache, torch -> CuTe, launch.

    compile_mxfp8_gemm(epilogue, n, k, num_experts, ...)   -> compiled (fake tensors, any machine)
    compile_quantize_rows(k, ...)                          -> compiled
    get_mxfp8_gemm(...) / get_quantize_rows(k)             cached launchers for real CUDA tensors
    mxfp8_grouped_gemm(...) / quantize_rows(x)             functional entry points

The fake arguments are the ABI: M_total (token rows) is the only dynamic size; N, K, E are
static. fp8 tensors travel as their uint8 bit views. No host sync on the launch path (the
routing offsets are never read by the host). Two launch paths per compiled kernel: classic
(CuTe views from ``gemm_cute_args`` / ``quantize_cute_args`` plus a CUstream) and TVM-FFI
(``tvm_ffi=True``: torch tensors in the same order, torch's current stream).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream

from . import DROP_VERSION
from .constants import ABI_VERSION, ACTIVATION_CONSTANT_DEFAULTS as _ACT, DEFAULT_TILE_TOKENS, MX_BLOCK, TILE_TOKENS
from .grouped_gemm import Mxfp8GroupedGemmSm120, can_implement, out_features
from .quantize import Mxfp8QuantizeRows, quantize_can_implement

DEFAULT_ARCH = "sm_120a"
_U8 = cutlass.Uint8
# assumed base alignment (bytes) of each argument; the fake and the real views must agree
ALIGN_VALUES = 16
ALIGN_SCALES = 4
ALIGN_OUT = 16


def _dsl_version() -> str:
    return str(getattr(cutlass, "__version__", ""))


# ---------------------------------------------------------------------------- fake arguments
def fake_gemm_args(kernel: Mxfp8GroupedGemmSm120, n: int, k: int, num_experts: int,
                   use_tvm_ffi: bool = False):
    """Fake (mX, mSFX, mW, mSFW, mOut, mOffsets, mRowScale, max_active_ctas, stream);
    M_total dynamic. Layouts match what :func:`gemm_cute_args` makes of contiguous tensors."""
    m = cute.sym_int()
    kb = k // MX_BLOCK
    n_out = out_features(kernel.epilogue, n)
    mX = make_fake_compact_tensor(_U8, (m, k), stride_order=(1, 0), assumed_align=ALIGN_VALUES)
    mSFX = make_fake_compact_tensor(_U8, (m, kb), stride_order=(1, 0), assumed_align=ALIGN_SCALES)
    mW = make_fake_compact_tensor(_U8, (num_experts, n, k), stride_order=(2, 1, 0),
                                  assumed_align=ALIGN_VALUES)
    mSFW = make_fake_compact_tensor(_U8, (num_experts, n, kb), stride_order=(2, 1, 0),
                                    assumed_align=ALIGN_SCALES)
    mOut = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0),
                                    assumed_align=ALIGN_OUT)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    # row_scale (or an unread placeholder of any length)
    mRS = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    return mX, mSFX, mW, mSFW, mOut, mOff, mRS, cutlass.Int32(188), stream


def fake_quantize_args(k: int, use_tvm_ffi: bool = False):
    """Fake (mIn, mOut, mScale, stream) of the row quantiser; M dynamic."""
    m = cute.sym_int()
    mIn = make_fake_compact_tensor(cutlass.BFloat16, (m, k), stride_order=(1, 0),
                                   assumed_align=ALIGN_VALUES)
    mOut = make_fake_compact_tensor(_U8, (m, k), stride_order=(1, 0), assumed_align=ALIGN_VALUES)
    mSc = make_fake_compact_tensor(_U8, (m, k // MX_BLOCK), stride_order=(1, 0),
                                   assumed_align=ALIGN_SCALES)
    return mIn, mOut, mSc, make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)


def _options(arch: str, extra: str, tvm_ffi: bool = False) -> str:
    # one options string: bracket-style options mixed with a string are dropped by the DSL
    return f"--gpu-arch {arch}{' --enable-tvm-ffi' if tvm_ffi else ''} {extra}".strip()


def activation_constants(epilogue: str, swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                         swiglu_beta: float = _ACT["swiglu_beta"],
                         swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                         gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]) -> dict:
    """The activation constants ``epilogue`` compiles in (clamped_swiglu's four, softcapped_swiglu's two,
    none for the others), as keyword arguments of the GEMM class: one kernel, one cache key, whatever
    the ignored constants were (drop v2)."""
    if epilogue == "clamped_swiglu":
        return dict(swiglu_alpha=float(swiglu_alpha), swiglu_limit=float(swiglu_limit),
                    swiglu_beta=float(swiglu_beta), swiglu_limit_after_act=bool(swiglu_limit_after_act))
    if epilogue == "softcapped_swiglu":
        return dict(gate_softcap=float(gate_softcap), up_softcap=float(up_softcap))
    return {}


def compile_mxfp8_gemm(epilogue: str, n: int, k: int, num_experts: int,
                       tile_tokens: int = DEFAULT_TILE_TOKENS, num_stages: Optional[int] = None,
                       arch: str = DEFAULT_ARCH, extra_options: str = "",
                       return_kernel: bool = False, tvm_ffi: bool = False,
                       swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                       swiglu_beta: float = _ACT["swiglu_beta"],
                       swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                       gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]):
    """Compile one grouped-GEMM variant from fake tensors (no GPU needed) and return the
    compiled function; with ``return_kernel`` ``(compiled, kernel)``, where
    ``kernel.smem_bytes`` / ``kernel.num_stages`` / ``kernel.threads`` describe the plan.
    ``tvm_ffi``: compile for TVM-FFI (called with torch tensors, fp8 as uint8 views, on torch's
    current stream). ``swiglu_*`` / ``*_softcap``: clamped_swiglu's / softcapped_swiglu's constants
    (drop v2). Raises ValueError with ``can_implement``'s reason for unsupported shapes."""
    reason = can_implement(epilogue, n, k, num_experts, tile_tokens, num_stages)
    if reason is not None:
        raise ValueError(reason)
    consts = activation_constants(epilogue, swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act,
                                  gate_softcap, up_softcap)
    kernel = Mxfp8GroupedGemmSm120(epilogue, tile_tokens=tile_tokens, num_stages=num_stages, **consts)
    args = fake_gemm_args(kernel, n, k, num_experts, use_tvm_ffi=tvm_ffi)
    compiled = cute.compile(kernel, *args, options=_options(arch, extra_options, tvm_ffi))
    return (compiled, kernel) if return_kernel else compiled


def compile_quantize_rows(k: int, arch: str = DEFAULT_ARCH, extra_options: str = "",
                          tvm_ffi: bool = False):
    """Compile the row quantiser for rows of K values from fake tensors. Returns the compiled
    function (``tvm_ffi``: see :func:`compile_mxfp8_gemm`)."""
    reason = quantize_can_implement(k)
    if reason is not None:
        raise ValueError(reason)
    return cute.compile(Mxfp8QuantizeRows(), *fake_quantize_args(k, use_tvm_ffi=tvm_ffi),
                        options=_options(arch, extra_options, tvm_ffi))


# ---------------------------------------------------------------------------- real tensors
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _cute(t: torch.Tensor, align: int, dynamic_rows: bool):
    """CuTe view of a contiguous torch tensor; mode 0 dynamic if ``dynamic_rows``. (Row-major
    stride order is passed explicitly, which is cheaper than torch's dim_order().)"""
    ct = from_dlpack(t, assumed_align=align)
    if dynamic_rows:
        ct = ct.mark_compact_shape_dynamic(mode=0, stride_order=tuple(range(t.dim())))
    return ct


def gemm_cute_args(x, x_scale, w, w_scale, out, offsets, row_scale):
    """torch -> CuTe views in the order of ``Mxfp8GroupedGemmSm120.__call__`` (less the grid
    size and the stream). fp8 tensors may be float8 or uint8; all must be contiguous."""
    return (
        _cute(_u8(x), ALIGN_VALUES, True),
        _cute(_u8(x_scale), ALIGN_SCALES, True),
        _cute(_u8(w), ALIGN_VALUES, False),
        _cute(_u8(w_scale), ALIGN_SCALES, False),
        _cute(out, ALIGN_OUT, True),
        _cute(offsets, 4, False),
        _cute(row_scale, 4, True),
    )


def quantize_cute_args(x, values, scale):
    """torch -> CuTe views in the order of ``Mxfp8QuantizeRows.__call__`` (less the stream)."""
    return (_cute(x, ALIGN_VALUES, True), _cute(_u8(values), ALIGN_VALUES, True),
            _cute(_u8(scale), ALIGN_SCALES, True))


def _num_sms(device=None) -> int:
    """SM count of the device (default: current). Raises without CUDA: never guessed."""
    if not torch.cuda.is_available():
        raise RuntimeError("sm120_mxfp8: no CUDA device to size the grid for; pass max_active_ctas")
    dev = device if device is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _stream(stream):
    """CUstream for the classic launch path: None = torch's current stream."""
    if stream is None:
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    if isinstance(stream, torch.cuda.Stream):
        return cuda.CUstream(stream.cuda_stream)
    return stream


def ffi_function(compiled):
    """The fast callable of a TVM-FFI kernel: the ``tvm_ffi.Function`` behind a freshly compiled
    object, or the object itself (e.g. loaded from an exported object file)."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    fn = get() if callable(get) else None
    return fn if fn is not None else compiled


def _ffi_call(fn, args, stream=None):
    """TVM-FFI kernels launch on torch's current stream: switch to ``stream`` if given."""
    if stream is None:
        return fn(*args)
    with torch.cuda.stream(stream):
        return fn(*args)


def pick_tile_tokens(m_total: int, num_experts: int) -> int:
    """Smallest tile (in TILE_TOKENS) holding the mean tokens per expert, at most 64: decode
    gets 8 or 16 (no idle MMA columns), prefill 64 (128 leaves only 2 pipeline stages)."""
    mean = -(-max(m_total, 1) // max(num_experts, 1))
    for t in TILE_TOKENS:
        if t >= mean or t == 64:
            return t
    return 64


_CACHE: Dict[tuple, object] = {}


class CompiledMxfp8Gemm:
    """One compiled grouped GEMM for (epilogue, N, K, E, tile_tokens, num_stages, activation constants);
    any routing and any M_total. ``tvm_ffi`` picks the launch path (TVM-FFI with torch tensors, or classic
    with CuTe views built by :func:`gemm_cute_args`)."""

    def __init__(self, epilogue: str, n: int, k: int, num_experts: int,
                 tile_tokens: int = DEFAULT_TILE_TOKENS, num_stages: Optional[int] = None,
                 arch: str = DEFAULT_ARCH, compiled=None, tvm_ffi: bool = False,
                 swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                 swiglu_beta: float = _ACT["swiglu_beta"],
                 swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                 gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]):
        """``compiled``: this variant compiled earlier (e.g. loaded from an exported object, for
        the same ``tvm_ffi`` and activation constants); None compiles it here from fake tensors."""
        reason = can_implement(epilogue, n, k, num_experts, tile_tokens, num_stages)
        if reason is not None:
            raise ValueError(reason)
        self.epilogue, self.n, self.k, self.num_experts = epilogue, n, k, num_experts
        self.tile_tokens = tile_tokens
        self.n_out = out_features(epilogue, n)
        self.tvm_ffi = bool(tvm_ffi)
        self.activation_constants = activation_constants(epilogue, swiglu_alpha, swiglu_limit, swiglu_beta,
                                                         swiglu_limit_after_act, gate_softcap, up_softcap)
        if compiled is None:
            compiled = compile_mxfp8_gemm(epilogue, n, k, num_experts, tile_tokens, num_stages,
                                          arch, tvm_ffi=self.tvm_ffi, **self.activation_constants)
        self.compiled = compiled
        self._fn = ffi_function(compiled) if self.tvm_ffi else None
        self._placeholder: Optional[torch.Tensor] = None

    def _row_scale_placeholder(self, device) -> torch.Tensor:
        if self._placeholder is None or self._placeholder.device != torch.device(device):
            self._placeholder = torch.zeros(1, dtype=torch.float32, device=device)
        return self._placeholder

    def __call__(self, x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                 w_scale: torch.Tensor, offsets: torch.Tensor, out: Optional[torch.Tensor] = None,
                 row_scale: Optional[torch.Tensor] = None, max_active_ctas: Optional[int] = None,
                 stream=None) -> torch.Tensor:
        """
        x:         [M_total, K]       float8_e4m3fn (or uint8 bits), CUDA, contiguous
        x_scale:   [M_total, K/32]    float8_e8m0fnu (or uint8 codes)
        w:         [E, N, K]          float8_e4m3fn
        w_scale:   [E, N, K/32]       float8_e8m0fnu
        offsets:   [E + 1]            int32, CUDA (device memory, never read by the host)
        out:       [M_total, N_out]   bf16 or None (allocated)
        row_scale: [M_total]          float32, required iff epilogue == "row_scale"
        stream:    torch.cuda.Stream (or a CUstream on the classic path); None = current
        Returns out.
        """
        m_total = x.shape[0]
        if tuple(w.shape) != (self.num_experts, self.n, self.k):
            raise ValueError(f"w must be [{self.num_experts}, {self.n}, {self.k}], got {tuple(w.shape)}")
        if out is None:
            out = torch.empty(m_total, self.n_out, dtype=torch.bfloat16, device=x.device)
        if m_total == 0:
            return out
        if self.epilogue == "row_scale":
            if row_scale is None or row_scale.dtype != torch.float32 or row_scale.shape[0] != m_total:
                raise ValueError("the row_scale epilogue needs a float32 row_scale [M_total]")
        else:
            row_scale = self._row_scale_placeholder(x.device)
        ctas = max_active_ctas if max_active_ctas is not None else _num_sms(x.device)
        if self.tvm_ffi:
            args = (_u8(x), _u8(x_scale), _u8(w), _u8(w_scale), out, offsets, row_scale, ctas)
            _ffi_call(self._fn, args, stream)
        else:
            args = gemm_cute_args(x, x_scale, w, w_scale, out, offsets, row_scale)
            self.compiled(*args, cutlass.Int32(ctas), _stream(stream))
        return out


class CompiledQuantizeRows:
    """One compiled row quantiser for rows of K values; any M."""

    def __init__(self, k: int, arch: str = DEFAULT_ARCH, compiled=None, tvm_ffi: bool = False):
        self.k = k
        self.tvm_ffi = bool(tvm_ffi)
        self.compiled = (compiled if compiled is not None
                         else compile_quantize_rows(k, arch, tvm_ffi=self.tvm_ffi))
        self._fn = ffi_function(self.compiled) if self.tvm_ffi else None

    def __call__(self, x: torch.Tensor, values: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, stream=None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] bf16 contiguous CUDA -> (values [M, K] float8_e4m3fn, scale [M, K/32]
        float8_e8m0fnu); ``values`` / ``scale`` may be given (fp8 or uint8) to write into."""
        m, k = x.shape
        if k != self.k or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if values is None:
            values = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        if scale is None:
            scale = torch.empty(m, k // MX_BLOCK, dtype=torch.float8_e8m0fnu, device=x.device)
        if m > 0:
            if self.tvm_ffi:
                _ffi_call(self._fn, (x, _u8(values), _u8(scale)), stream)
            else:
                self.compiled(*quantize_cute_args(x, values, scale), _stream(stream))
        return values, scale


def get_mxfp8_gemm(epilogue: str, n: int, k: int, num_experts: int,
                   tile_tokens: int = DEFAULT_TILE_TOKENS, num_stages: Optional[int] = None,
                   arch: str = DEFAULT_ARCH, tvm_ffi: bool = False, **constants) -> CompiledMxfp8Gemm:
    """Cached compile. Key: everything static (``constants``: the activation constants, as
    ``compile_mxfp8_gemm`` takes them); routing and M_total are runtime."""
    consts = activation_constants(epilogue, **constants)
    key = ("gemm", ABI_VERSION, DROP_VERSION, _dsl_version(), epilogue, n, k, num_experts,
           tile_tokens, num_stages, arch, bool(tvm_ffi), tuple(sorted(consts.items())))
    fn = _CACHE.get(key)
    if fn is None:
        fn = CompiledMxfp8Gemm(epilogue, n, k, num_experts, tile_tokens, num_stages, arch,
                               tvm_ffi=tvm_ffi, **consts)
        _CACHE[key] = fn
    return fn


def get_quantize_rows(k: int, arch: str = DEFAULT_ARCH, tvm_ffi: bool = False) -> CompiledQuantizeRows:
    """Cached compile of the row quantiser for K."""
    key = ("quant", ABI_VERSION, DROP_VERSION, _dsl_version(), k, arch, bool(tvm_ffi))
    fn = _CACHE.get(key)
    if fn is None:
        fn = CompiledQuantizeRows(k, arch, tvm_ffi=tvm_ffi)
        _CACHE[key] = fn
    return fn


def mxfp8_grouped_gemm(x, x_scale, w, w_scale, offsets, epilogue: str, row_scale=None, out=None,
                       tile_tokens: Optional[int] = None, max_active_ctas: Optional[int] = None,
                       stream=None, tvm_ffi: bool = False, **constants) -> torch.Tensor:
    """Functional entry point (see :class:`CompiledMxfp8Gemm`). ``tile_tokens`` None picks one
    from the mean tokens per expert (host-known sizes only, no sync); ``constants``: the activation
    constants, as ``compile_mxfp8_gemm`` takes them."""
    num_experts, n, k = w.shape
    if tile_tokens is None:
        tile_tokens = pick_tile_tokens(x.shape[0], num_experts)
    fn = get_mxfp8_gemm(epilogue, n, k, num_experts, tile_tokens, tvm_ffi=tvm_ffi, **constants)
    return fn(x, x_scale, w, w_scale, offsets, out=out, row_scale=row_scale,
              max_active_ctas=max_active_ctas, stream=stream)


def quantize_rows(x: torch.Tensor, values=None, scale=None, stream=None, tvm_ffi: bool = False):
    """bf16 [M, K] -> (float8_e4m3fn [M, K], float8_e8m0fnu [M, K/32]) on the GPU."""
    return get_quantize_rows(x.shape[1], tvm_ffi=tvm_ffi)(x, values, scale, stream)
