"""Host side: fake-tensor compile (no GPU needed), compile cache, torch -> CuTe conversion, launch.

    compiled = compile_w4a16_gemm("squared_relu", n=1856, k=2688, num_experts=128)   # CPU is fine
    gemm = get_w4a16_gemm("squared_relu", n=1856, k=2688, num_experts=128)          # cached
    out = gemm(a, values, block_scale, global_scale, offsets)                       # SM100 GPU
    gemm = get_w4a16_gemm("row_scale", 2688, 1856, 128, bias_dtype=torch.bfloat16)  # with a bias (v4)

The launch path never syncs the host and never reads ``offsets`` on the host.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Optional, Tuple

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream
import cuda.bindings.driver as cuda

from . import DROP_VERSION
from .constants import ABI_VERSION, ACTIVATION_CONSTANT_DEFAULTS as _ACT, DEFAULT_RASTER_M, GATED_EPILOGUES

#: bias dtypes (constants.BIAS_DTYPES) as torch and CuTe types
_BIAS_TYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16}


def _bias_type(bias_dtype):
    """None, or the CuTe type of a bias dtype (torch.float32 / torch.bfloat16); ValueError otherwise."""
    if bias_dtype is None:
        return None
    if bias_dtype not in _BIAS_TYPES:
        raise ValueError(f"bias_dtype must be None, torch.float32 or torch.bfloat16, got {bias_dtype}")
    return _BIAS_TYPES[bias_dtype]
from .grouped_gemm import W4A16GroupedGemmSm100, can_implement

_CACHE: Dict[tuple, "CompiledW4A16Gemm"] = {}


def fake_args(kernel: W4A16GroupedGemmSm100, num_experts: int, n: int, k: int,
              use_tvm_ffi: bool = False, bias_dtype=None):
    """Fake ``(mA, mWq, mWsf, mGs, mOffsets, mRowScale, mD, max_active_ctas, stream[, mBias])`` for a
    compile without data: M_total and the row_scale length dynamic, everything else static
    (the same structure ``to_cute_args`` builds from contiguous torch tensors). ``bias_dtype``
    (drop v4): a trailing [E, N] bias of that torch dtype."""
    n_out, _ = kernel.static_shapes(n, k, num_experts)
    m = cute.sym_int()
    u8, bf16, f32 = cutlass.Uint8, cutlass.BFloat16, cutlass.Float32
    mA = make_fake_compact_tensor(bf16, (m, k), stride_order=(1, 0), assumed_align=16)
    mWq = make_fake_compact_tensor(u8, (num_experts, n, k // 2), stride_order=(2, 1, 0), assumed_align=16)
    mWsf = make_fake_compact_tensor(u8, (num_experts, n, k // 16), stride_order=(2, 1, 0), assumed_align=16)
    mGs = make_fake_compact_tensor(f32, (num_experts,), assumed_align=4)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mRs = make_fake_compact_tensor(f32, (cute.sym_int(),), assumed_align=4)
    mD = make_fake_compact_tensor(bf16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    args = (mA, mWq, mWsf, mGs, mOff, mRs, mD, cutlass.Int32(148), stream)
    if bias_dtype is not None:
        args += (make_fake_compact_tensor(_bias_type(bias_dtype), (num_experts, n), stride_order=(1, 0),
                                          assumed_align=4),)
    return args


def compile_options(arch: str = "sm_100a", extra: str = "") -> str:
    """cute.compile options: target arch, keep the PTX (``compiled.__ptx__``) but write the
    dumped files to a temp folder, not the working directory."""
    dump = os.path.join(tempfile.gettempdir(), "sm100_w4a16_ptx")
    os.makedirs(dump, exist_ok=True)
    return f"--gpu-arch {arch} --keep-ptx --dump-dir={dump} {extra}".strip()


def activation_constants(epilogue: str, swiglu_alpha: float = _ACT["swiglu_alpha"],
                         swiglu_limit: float = _ACT["swiglu_limit"], swiglu_beta: float = _ACT["swiglu_beta"],
                         swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                         gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]) -> dict:
    """The activation constants ``epilogue`` compiles in (clamped_swiglu's four, softcapped_swiglu's two,
    none for the others), as keyword arguments of the kernel class: one kernel, one cache key, whatever
    the ignored constants were (drop v3)."""
    if epilogue == "clamped_swiglu":
        return dict(swiglu_alpha=float(swiglu_alpha), swiglu_limit=float(swiglu_limit),
                    swiglu_beta=float(swiglu_beta), swiglu_limit_after_act=bool(swiglu_limit_after_act))
    if epilogue == "softcapped_swiglu":
        return dict(gate_softcap=float(gate_softcap), up_softcap=float(up_softcap))
    return {}


def compile_w4a16_gemm(epilogue: str, n: int, k: int, num_experts: int,
                       tile_n: Optional[int] = None, raster_m: int = DEFAULT_RASTER_M,
                       num_stages: Optional[int] = None, arch: str = "sm_100a",
                       extra_options: str = "", return_kernel: bool = False, bias_dtype=None,
                       swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                       swiglu_beta: float = _ACT["swiglu_beta"],
                       swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                       gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]):
    """Compile one variant from fake tensors (works on a machine without a GPU).

    epilogue: one of ``EPILOGUES``; n: rows of W per expert (2 * I for the gated ones); k: reduction
    size; ``bias_dtype``: None, or torch.float32 / torch.bfloat16 for a per-expert [E, N] bias (drop v4);
    ``swiglu_*`` / ``*_softcap``: clamped_swiglu's / softcapped_swiglu's constants (drop v3).
    Returns the compiled object (``.__ptx__`` holds the PTX), or ``(compiled, kernel)``
    with ``return_kernel`` (the kernel object then knows ``smem_size`` and its stage counts)."""
    reason = can_implement(epilogue, n, k, num_experts, tile_n)
    if reason is not None:
        raise ValueError(reason)
    consts = activation_constants(epilogue, swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act,
                                  gate_softcap, up_softcap)
    kernel = W4A16GroupedGemmSm100(epilogue, tile_n=tile_n, raster_m=raster_m, num_stages=num_stages, **consts)
    args = fake_args(kernel, num_experts, n, k, bias_dtype=bias_dtype)
    compiled = cute.compile(kernel, *args, options=compile_options(arch, extra_options))
    return (compiled, kernel) if return_kernel else compiled


def to_cute_args(a, values, block_scale, global_scale, offsets, row_scale, out, bias=None):
    """CuTe views of contiguous torch tensors with ``fake_args``' structure (M_total and the
    row_scale length dynamic). ``block_scale`` may be float8_e4m3fn or its uint8 view. ``bias``
    (drop v4): the [E, N] bias, last (``launch_converted`` puts it after the stream)."""
    if block_scale.dtype != torch.uint8:
        block_scale = block_scale.view(torch.uint8)
    mA = from_dlpack(a, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    mWq = from_dlpack(values, assumed_align=16)
    mWsf = from_dlpack(block_scale, assumed_align=16)
    mGs = from_dlpack(global_scale, assumed_align=4)
    mOff = from_dlpack(offsets, assumed_align=4)
    mRs = from_dlpack(row_scale, assumed_align=4).mark_compact_shape_dynamic(mode=0)
    mD = from_dlpack(out, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    if bias is None:
        return mA, mWq, mWsf, mGs, mOff, mRs, mD
    return mA, mWq, mWsf, mGs, mOff, mRs, mD, from_dlpack(bias, assumed_align=4)


def _num_sms(device=None) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("sm100_w4a16: no CUDA device to size the grid for; pass max_active_ctas")
    dev = device if device is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(dev).multi_processor_count


def require_sm100(device=None) -> None:
    """Raise unless the (current) CUDA device is an SM100-class GPU (tcgen05)."""
    if not torch.cuda.is_available():
        raise RuntimeError("sm100_w4a16 needs a CUDA device")
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        raise RuntimeError(f"sm100_w4a16 needs an SM100 GPU (compute capability 10.x), got {major}.{minor}")


class CompiledW4A16Gemm:
    """One compiled kernel for (epilogue, N, K, E, tile_n, raster_m, stages, activation constants); any
    routing and M_total. ``compiled``: the kernel compiled earlier (e.g. loaded from an exported object)."""

    def __init__(self, epilogue: str, n: int, k: int, num_experts: int,
                 tile_n: Optional[int] = None, raster_m: int = DEFAULT_RASTER_M,
                 num_stages: Optional[int] = None, arch: str = "sm_100a", compiled=None, bias_dtype=None,
                 swiglu_alpha: float = _ACT["swiglu_alpha"], swiglu_limit: float = _ACT["swiglu_limit"],
                 swiglu_beta: float = _ACT["swiglu_beta"],
                 swiglu_limit_after_act: bool = _ACT["swiglu_limit_after_act"],
                 gate_softcap: float = _ACT["gate_softcap"], up_softcap: float = _ACT["up_softcap"]):
        reason = can_implement(epilogue, n, k, num_experts, tile_n)
        if reason is not None:
            raise ValueError(reason)
        self.epilogue = epilogue
        self.n, self.k, self.num_experts = n, k, num_experts
        self.n_out = n // 2 if epilogue in GATED_EPILOGUES else n
        _bias_type(bias_dtype)
        self.bias_dtype = bias_dtype
        self.activation_constants = activation_constants(epilogue, swiglu_alpha, swiglu_limit, swiglu_beta,
                                                         swiglu_limit_after_act, gate_softcap, up_softcap)
        if compiled is None:
            compiled = compile_w4a16_gemm(epilogue, n, k, num_experts, tile_n=tile_n,
                                          raster_m=raster_m, num_stages=num_stages, arch=arch,
                                          bias_dtype=bias_dtype, **self.activation_constants)
        self.compiled = compiled
        self._dummy_scale: Optional[torch.Tensor] = None

    def _placeholder(self, device) -> torch.Tensor:
        if self._dummy_scale is None or self._dummy_scale.device != torch.device(device):
            self._dummy_scale = torch.zeros(1, dtype=torch.float32, device=device)
        return self._dummy_scale

    def __call__(self, a: torch.Tensor, values: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor, offsets: torch.Tensor,
                 row_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 max_active_ctas: Optional[int] = None, stream=None,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        a:            [M_total, K]       bf16, contiguous, CUDA
        values:       [E, N, K/2]        uint8 (two E2M1 codes per byte)
        block_scale:  [E, N, K/16]       float8_e4m3fn (or its uint8 view)
        global_scale: [E]                float32
        offsets:      [E + 1]            int32, device memory (never read by the host)
        row_scale:    [M_total]          float32, required iff epilogue == "row_scale"
        out:          [M_total, N_out]   bf16 or None (allocated)
        bias:         [E, N]             ``bias_dtype``, contiguous; required iff compiled with one (drop v4)
        returns out.
        """
        m_total = a.shape[0]
        if out is None:
            out = torch.empty(m_total, self.n_out, dtype=torch.bfloat16, device=a.device)
        self._validate(a, values, block_scale, global_scale, offsets, out)
        if (bias is None) != (self.bias_dtype is None):
            raise ValueError(f"bias: this kernel was compiled {'without a bias' if self.bias_dtype is None else 'with a ' + str(self.bias_dtype) + ' bias'}, got "
                             f"{'none' if bias is None else 'one'}")
        if bias is not None and (tuple(bias.shape) != (self.num_experts, self.n) or bias.dtype != self.bias_dtype
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias: expected a contiguous ({self.num_experts}, {self.n}) {self.bias_dtype} tensor, "
                             f"got {tuple(bias.shape)} {bias.dtype} (contiguous={bias.is_contiguous()})")
        if m_total == 0:
            return out  # a TMA descriptor cannot describe an empty tensor
        if self.epilogue == "row_scale":
            if row_scale is None or row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (m_total,):
                raise ValueError("row_scale epilogue needs row_scale [M_total] float32")
        else:
            row_scale = self._placeholder(a.device)
        args = to_cute_args(a, values, block_scale, global_scale, offsets, row_scale, out, bias)
        self.launch_converted(args, max_active_ctas, stream)
        return out

    def _validate(self, a, values, block_scale, global_scale, offsets, out) -> None:
        """Shapes / dtypes / contiguity against this variant (metadata only: no device sync)."""
        e, n, k = self.num_experts, self.n, self.k
        want = [
            ("a", a, (a.shape[0], k), (torch.bfloat16,)),
            ("values", values, (e, n, k // 2), (torch.uint8,)),
            ("block_scale", block_scale, (e, n, k // 16), (torch.float8_e4m3fn, torch.uint8)),
            ("global_scale", global_scale, (e,), (torch.float32,)),
            ("offsets", offsets, (e + 1,), (torch.int32,)),
            ("out", out, (a.shape[0], self.n_out), (torch.bfloat16,)),
        ]
        for name, t, shape, dtypes in want:
            if tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous {shape} tensor of {dtypes}, got "
                                 f"{tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()})")

    def launch_converted(self, args: Tuple, max_active_ctas: Optional[int] = None, stream=None):
        """Launch with pre-converted CuTe tensors (``to_cute_args``; a bias comes after the stream)."""
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        ctas = max_active_ctas if max_active_ctas is not None else _num_sms()
        self.compiled(*args[:7], cutlass.Int32(ctas), stream, *args[7:])


def get_w4a16_gemm(epilogue: str, n: int, k: int, num_experts: int, tile_n: Optional[int] = None,
                   raster_m: int = DEFAULT_RASTER_M, num_stages: Optional[int] = None,
                   arch: str = "sm_100a", bias_dtype=None, **constants) -> CompiledW4A16Gemm:
    """Cached compile. Key: everything static (``bias_dtype``; ``constants``: the activation constants,
    as ``compile_w4a16_gemm`` takes them); routing and M_total are runtime."""
    consts = activation_constants(epilogue, **constants)
    key = (ABI_VERSION, DROP_VERSION, getattr(cutlass, "__version__", ""), epilogue, n, k,
           num_experts, tile_n, raster_m, num_stages, arch, str(bias_dtype), tuple(sorted(consts.items())))
    fn = _CACHE.get(key)
    if fn is None:
        fn = CompiledW4A16Gemm(epilogue, n, k, num_experts, tile_n=tile_n, raster_m=raster_m,
                               num_stages=num_stages, arch=arch, bias_dtype=bias_dtype, **consts)
        _CACHE[key] = fn
    return fn


def w4a16_grouped_gemm(a: torch.Tensor, values: torch.Tensor, block_scale: torch.Tensor,
                       global_scale: torch.Tensor, offsets: torch.Tensor, epilogue: str,
                       row_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                       max_active_ctas: Optional[int] = None,
                       tile_n: Optional[int] = None, bias: Optional[torch.Tensor] = None,
                       **constants) -> torch.Tensor:
    """Functional entry point (shapes and dtypes: ``CompiledW4A16Gemm.__call__``; ``constants``: the
    activation constants, as ``compile_w4a16_gemm`` takes them)."""
    e, n, k2 = values.shape
    fn = get_w4a16_gemm(epilogue, n, 2 * k2, e, tile_n=tile_n, bias_dtype=None if bias is None else bias.dtype,
                        **constants)
    return fn(a, values, block_scale, global_scale, offsets, row_scale=row_scale, out=out,
              max_active_ctas=max_active_ctas, bias=bias)
