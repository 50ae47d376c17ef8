"""Input validation, run before any launch. Each error names the offending argument.

Too many tokens raises :class:`~moe_ep.backends.CapacityError` (a ``ValueError``); bad types raise
``TypeError`` and bad shapes, devices or (with ``check_values``) values a plain ``ValueError``."""

from __future__ import annotations

from typing import Any

import torch

from ..backends import CapacityError
from ..backends.quant import FP8Block128Weight, MXFP8Tensor, NVFP4Weight

# MoEConfig.quant -> (its weight container, the helper that makes one): read on every forward
_QUANT_WEIGHTS = {"nvfp4_w4a16": (NVFP4Weight, "quantize_nvfp4"), "mxfp8": (MXFP8Tensor, "quantize_mxfp8"),
                  "fp8_block128": (FP8Block128Weight, "quantize_fp8_block128")}

INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_tensor(name: str, t: Any, *, dtype=None, dtypes=None, shape=None, device=None) -> torch.Tensor:
    """Type, dtype, rank/shape (``None`` entries are free), device and contiguity of ``t``."""
    t = _tensor(name, t)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have one of dtypes {dtypes}, got {t.dtype}")
    # (forward checks six tensors per call: the common case is one C-level comparison each)
    if shape is not None and (None in shape or t.shape != shape):
        if t.dim() != len(shape):
            raise ValueError(f"{name} must be {len(shape)}-D with shape {_fmt(shape)}, got {tuple(t.shape)}")
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                raise ValueError(f"{name} must have shape {_fmt(shape)}, got {tuple(t.shape)}")
    if device is not None and not _on(t, device):
        raise ValueError(f"{name} is on {t.device}, but the layer runs on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    return t


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t.device == device``; for a CUDA device without building a ``torch.device`` per call."""
    if device.type == "cuda" and device.index is not None:
        return t.is_cuda and t.get_device() == device.index
    return t.device == device


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_routing(cfg, x: torch.Tensor, topk_ids: Any, topk_weights: Any, device: torch.device,
                  *, check_values: bool) -> None:
    """``x [T, H]``, ``topk_ids [T, K]`` int32/int64 in ``[0, E)``, ``topk_weights [T, K]`` float32."""
    check_tensor("x", x, dtype=cfg.dtype, shape=(None, cfg.hidden), device=device)
    T = x.shape[0]
    if T > cfg.max_tokens_per_rank:
        raise CapacityError(f"x has {T} tokens, more than max_tokens_per_rank={cfg.max_tokens_per_rank} "
                            "(the layer's buffers are sized for that many tokens per rank)")
    ids = _tensor("topk_ids", topk_ids)
    if ids.dim() == 2 and ids.shape[0] == T and ids.shape[1] != cfg.top_k:
        raise ValueError(f"topk_ids has {ids.shape[1]} columns but the layer's top_k is {cfg.top_k}")
    check_tensor("topk_ids", ids, dtypes=INDEX_DTYPES, shape=(T, cfg.top_k), device=device)
    w = _tensor("topk_weights", topk_weights)
    if w.dim() == 2 and w.shape[0] == T and w.shape[1] != cfg.top_k:
        raise ValueError(f"topk_weights has {w.shape[1]} columns but the layer's top_k is {cfg.top_k}")
    check_tensor("topk_weights", w, dtype=torch.float32, shape=(T, cfg.top_k), device=device)
    if check_values and T > 0:
        # debugging opt-in: one fused reduction, one host sync; skipped under CUDA-graph capture.
        # Without it the backends drop such choices and check_errors() raises RoutingValueError.
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.num_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(f"topk_ids holds expert id {bad}, outside [0, {cfg.num_experts})")
        if not bool(torch.isfinite(w).all()):
            raise ValueError("topk_weights holds a non-finite value (NaN or inf)")


def _check_quantized(cfg, name: str, w: Any, shape: tuple, device: torch.device) -> None:
    """A block-scaled weight of ``cfg.quant``'s container type, logical ``shape``, on ``device``."""
    want, maker = _QUANT_WEIGHTS[cfg.quant]
    if not isinstance(w, want):
        extra = (f" or a torch.float8_e4m3fn tensor with {name}_scale" if want is FP8Block128Weight else "")
        raise TypeError(f"{name} must be a moe_ep.api.quant.{want.__name__}{extra} (MoEConfig.quant="
                        f"{cfg.quant!r}; make one with {maker}), got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} has logical shape {_fmt(w.shape)}, expected {_fmt(shape)}")
    if want is NVFP4Weight:
        e, n, k = shape
        if (w.values.dtype != torch.uint8 or w.block_scale.dtype != torch.float8_e4m3fn
                or tuple(w.block_scale.shape) != (e, n, k // 16) or tuple(w.global_scale.shape) != (e,)):
            raise TypeError(f"{name}: NVFP4Weight parts must be values uint8 [E, N, K/2], block_scale "
                            "float8_e4m3fn [E, N, K/16], global_scale float32 [E]")
    elif want is MXFP8Tensor:
        if (w.values.dtype != torch.float8_e4m3fn or w.scale.dtype != torch.float8_e8m0fnu
                or tuple(w.scale.shape) != (*shape[:-1], shape[-1] // 32)):
            raise TypeError(f"{name}: MXFP8Tensor parts must be values float8_e4m3fn [..., K], scale "
                            "float8_e8m0fnu [..., K/32]")
    else:
        e, n, k = shape
        sshape = (e, -(-n // 128), -(-k // 128))
        if w.values.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} must be torch.float8_e4m3fn (MoEConfig.quant='fp8_block128'), got "
                            f"{w.values.dtype}")
        if w.scale.dtype != torch.float32:
            raise TypeError(f"{name}_scale must be float32, got {w.scale.dtype}")
        if tuple(w.scale.shape) != sshape:
            raise ValueError(f"{name}_scale has shape {_fmt(w.scale.shape)}, expected {_fmt(sshape)} "
                             "(one float32 per 128x128 block of the weight)")
    parts = ((w.values, w.block_scale, w.global_scale) if want is NVFP4Weight else (w.values, w.scale))
    for p in parts:
        if not _on(p, device):
            raise ValueError(f"{name} is on {p.device}, the layer runs on {device}")
        if not p.is_contiguous():
            raise ValueError(f"{name}: every part of the quantised weight must be contiguous")


def pack_fp8_block128(cfg, w13: Any, w2: Any, w13_scale: Any, w2_scale: Any) -> tuple[Any, Any]:
    """``forward``'s FP8 block-128 weights as :class:`~moe_ep.api.quant.FP8Block128Weight`: raw
    ``float8_e4m3fn`` tensors need their ``*_scale``; containers must come without one. Scales
    given for any other ``cfg.quant`` raise."""
    if getattr(cfg, "quant", None) != "fp8_block128":
        for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if s is not None:
                raise ValueError(f"{name} was given, but MoEConfig.quant is {getattr(cfg, 'quant', None)!r}; "
                                 "weight scales go with quant='fp8_block128'")
        return w13, w2
    out = []
    for name, w, s in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if isinstance(w, FP8Block128Weight):
            if s is not None:
                raise ValueError(f"{name} is an FP8Block128Weight (it carries its scale): do not pass {name}_scale")
            out.append(w)
            continue
        if isinstance(w, torch.Tensor):
            if s is None:
                raise ValueError(f"{name}_scale is required: MoEConfig.quant='fp8_block128' takes {name} as "
                                 f"torch.float8_e4m3fn with {name}_scale [E_local, ceil(rows/128), "
                                 "ceil(cols/128)] float32")
            s = _tensor(f"{name}_scale", s)
            out.append(FP8Block128Weight(w, s))
            continue
        out.append(w)  # _check_quantized names the type
    return out[0], out[1]


def check_weights(cfg, e_local: int, w13: Any, w2: Any, device: torch.device) -> None:
    """``w13 [E_local, w13_rows, H]`` and ``w2 [E_local, H, I]`` in the layer dtype (or, with
    ``cfg.quant``, the matching block-scaled container of that logical shape)."""
    if getattr(cfg, "quant", None) is not None:
        _check_quantized(cfg, "w13", w13, (e_local, cfg.w13_rows, cfg.hidden), device)
        _check_quantized(cfg, "w2", w2, (e_local, cfg.hidden, cfg.intermediate), device)
        return
    for name, t, shape in (("w13", w13, (e_local, cfg.w13_rows, cfg.hidden)),
                           ("w2", w2, (e_local, cfg.hidden, cfg.intermediate))):
        t = _tensor(name, t)
        if t.dim() == 3 and t.shape[0] != e_local:
            raise ValueError(f"{name} holds {t.shape[0]} experts, but this rank owns {e_local} local "
                             f"experts (num_experts / EP world size)")
        check_tensor(name, t, dtype=cfg.dtype, shape=shape, device=device)


def check_out(cfg, out: Any, T: int, device: torch.device) -> None:
    if out is not None:
        check_tensor("out", out, dtype=cfg.dtype, shape=(T, cfg.hidden), device=device)


def check_biases(cfg, e_local: int, b13: Any, b2: Any, device: torch.device) -> None:
    """With ``cfg.bias_dtype`` set: ``b13 [E_local, w13_rows]`` and ``b2 [E_local, H]`` of exactly
    that dtype, contiguous, on the layer's device, both required. Without it: neither may be given."""
    if cfg.bias_dtype is None:
        for name, t in (("b13", b13), ("b2", b2)):
            if t is not None:
                raise ValueError(f"{name} was given, but this layer has no biases (MoEConfig.bias_dtype is "
                                 f"None): set MoEConfig.bias_dtype (torch.float32 or {cfg.dtype}) to use "
                                 "per-expert biases")
        return
    for name, t, shape in (("b13", b13, (e_local, cfg.w13_rows)), ("b2", b2, (e_local, cfg.hidden))):
        if t is None:
            raise ValueError(f"{name} is required: config.bias_dtype is set ({cfg.bias_dtype}), so forward "
                             f"takes per-expert biases b13 [E_local, w13_rows] and b2 [E_local, H] "
                             f"({name} must be {_fmt(shape)} {cfg.bias_dtype})")
        t = _tensor(name, t)
        if t.dim() == 2 and t.shape[0] != e_local:
            raise ValueError(f"{name} holds {t.shape[0]} experts, but this rank owns {e_local} local "
                             f"experts (num_experts / EP world size)")
        check_tensor(name, t, dtype=cfg.bias_dtype, shape=shape, device=device)


class ForwardCheck:
    """``forward``'s checks on the common path as one conjunction of C-level attribute reads.

    :meth:`args` returns the weights as the backend takes them when every argument would pass
    :func:`check_routing` (without ``check_values``), :func:`pack_fp8_block128`,
    :func:`check_weights`, :func:`check_biases` and :func:`check_out`; otherwise None, and forward
    runs those checks, which name what is wrong. Why: they run before the first launch, which a
    per-call forward waits for, and they call helpers per tensor: 8.1 / 9.6 us per BF16 / FP8
    forward on the CPU machine (thirtieth session) against 3.3 / 4.1 for this. It passes exactly
    what they pass (``tests/test_forward_check.py`` mutates every argument and compares)."""

    __slots__ = ("dtype", "hidden", "cap", "top_k", "cuda_index", "device", "supported", "fp8",
                 "w13", "w2", "w13_scale", "w2_scale", "bias_dtype", "b13", "b2")

    def __init__(self, cfg, e_local: int, device: torch.device) -> None:
        self.dtype, self.hidden, self.cap, self.top_k = cfg.dtype, cfg.hidden, cfg.max_tokens_per_rank, cfg.top_k
        self.device = device
        self.cuda_index = device.index if device.type == "cuda" else None
        quant = getattr(cfg, "quant", None)
        self.supported = quant in (None, "fp8_block128")  # other formats: the full checks each call
        self.fp8 = quant == "fp8_block128"
        n13, h, i = cfg.w13_rows, cfg.hidden, cfg.intermediate
        self.w13, self.w2 = torch.Size((e_local, n13, h)), torch.Size((e_local, h, i))
        self.w13_scale = torch.Size((e_local, -(-n13 // 128), -(-h // 128)))
        self.w2_scale = torch.Size((e_local, -(-h // 128), -(-i // 128)))
        self.bias_dtype = cfg.bias_dtype
        self.b13, self.b2 = torch.Size((e_local, n13)), torch.Size((e_local, h))

    def _ok(self, t: Any, dtype: torch.dtype, shape: torch.Size) -> bool:
        if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.is_contiguous()):
            return False
        if self.cuda_index is not None:
            return t.is_cuda and t.get_device() == self.cuda_index
        return t.device == self.device

    def _fp8(self, w: Any, scale: Any, shape: torch.Size, sshape: torch.Size) -> Any:
        """The FP8Block128Weight to pass on, or None where pack/check_weights would refuse."""
        if isinstance(w, FP8Block128Weight):  # passed on as it is (no new container per call)
            ok = scale is None and self._ok(w.values, torch.float8_e4m3fn, shape) and \
                self._ok(w.scale, torch.float32, sshape)
            return w if ok else None
        if scale is not None and self._ok(w, torch.float8_e4m3fn, shape) and self._ok(scale, torch.float32, sshape):
            return FP8Block128Weight(w, scale)
        return None

    def routing(self, x: Any, topk_ids: Any, topk_weights: Any) -> bool:
        """True where :func:`check_routing` (without ``check_values``) would pass."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return False
        T, H = x.shape
        if H != self.hidden or T > self.cap:
            return False
        rows = torch.Size((T, self.top_k))
        return (self._ok(x, self.dtype, x.shape)
                and (self._ok(topk_ids, torch.int32, rows) or self._ok(topk_ids, torch.int64, rows))
                and self._ok(topk_weights, torch.float32, rows))

    def args(self, x, topk_ids, topk_weights, w13, w2, out, b13, b2, w13_scale, w2_scale) -> tuple | None:
        """``(w13, w2)`` as the backend takes them, or None: run the full checks."""
        if not self.supported or not self.routing(x, topk_ids, topk_weights):
            return None
        if out is not None and not self._ok(out, self.dtype, x.shape):
            return None
        if self.bias_dtype is None:
            if b13 is not None or b2 is not None:
                return None
        elif not (self._ok(b13, self.bias_dtype, self.b13) and self._ok(b2, self.bias_dtype, self.b2)):
            return None
        if self.fp8:
            w13 = self._fp8(w13, w13_scale, self.w13, self.w13_scale)
            w2 = self._fp8(w2, w2_scale, self.w2, self.w2_scale)
            return None if w13 is None or w2 is None else (w13, w2)
        if w13_scale is not None or w2_scale is not None:
            return None
        if self._ok(w13, self.dtype, self.w13) and self._ok(w2, self.dtype, self.w2):
            return w13, w2
        return None
