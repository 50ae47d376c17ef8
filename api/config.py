"""MoEConfig: the static description of one MoE layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ACTIVATIONS = ("swiglu", "squared_relu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu", "gelu_tanh_glu")
GATED = ("swiglu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu", "gelu_tanh_glu")
SUPPORTED_DTYPES = (torch.bfloat16,)
#: weight formats (``MoEConfig.quant``) -> the block size along K (see :mod:`moe_ep.api.quant`)
QUANT_FORMATS = {"nvfp4_w4a16": 16, "mxfp8": 32, "fp8_block128": 1}


@dataclass(frozen=True)
class MoEConfig:
    """Static shape of an expert-parallel MoE layer (validated on construction).

    Args:
        num_experts: E, experts in total over all ranks (a multiple of the EP world size).
        hidden: H, model hidden size.
        intermediate: I, per-expert intermediate size.
        top_k: K, experts chosen per token (1 <= K <= E).
        max_tokens_per_rank: upper bound on T, tokens a rank passes to one forward; sizes buffers.
        dtype: activation and weight dtype (``torch.bfloat16``).
        activation: ``"swiglu"`` (silu(gate)·up), ``"gelu_glu"`` (gelu(gate)·up, erf form),
            ``"gelu_tanh_glu"`` (gelu(gate)·up, tanh form: torch's ``gelu(approximate="tanh")``,
            transformers' ``"gelu_pytorch_tanh"``; Gemma 4's experts),
            ``"clamped_swiglu"`` (``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
            ``(u + beta) · g · sigmoid(alpha · g)``: gpt-oss with the defaults; DeepSeek-V4, GLM-5
            and Hunyuan-V4 with ``swiglu_alpha=1.0, swiglu_beta=0.0`` and their ``swiglu_limit``;
            with ``swiglu_limit_after_act=True`` the gate is clamped after the activation instead,
            ``(u + beta) · min(gate · sigmoid(alpha · gate), limit)``: Step-3.7 and Bailing with
            ``swiglu_alpha=1.0, swiglu_beta=0.0``), ``"softcapped_swiglu"`` (``gate_softcap ·
            tanh(gate / gate_softcap) · sigmoid(gate) · up_softcap · tanh(up / up_softcap)``: Inkling2)
            or ``"squared_relu"`` (relu(h)²).
            Weights per rank ``r`` (local experts ``[r·E/W, (r+1)·E/W)``):

            * ``w13`` ``[E_local, 2·I, H]`` for the gated activations (gate rows ``[0, I)``
              first, then up rows ``[I, 2I)``), ``[E_local, I, H]`` for ``squared_relu``;
            * ``w2`` ``[E_local, H, I]``.
        swiglu_alpha: ``alpha`` of ``"clamped_swiglu"`` (a finite number; default 1.702, gpt-oss).
            Unused by the other activations.
        swiglu_limit: ``limit`` of ``"clamped_swiglu"`` (a finite number > 0; default 7.0,
            gpt-oss). Unused by the other activations.
        swiglu_beta: ``beta`` of ``"clamped_swiglu"``, added to the clamped up projection (a
            finite number; default 1.0, gpt-oss; 0.0 for DeepSeek-V4 / GLM-5 / Hunyuan-V4's
            clamped SwiGLU). Unused by the other activations. After ``quant``, so that positional
            construction of the earlier fields is unchanged.
        swiglu_limit_after_act: ``"clamped_swiglu"`` clamps the gate after the activation
            (``min(silu(gate), limit)``, Step-3.7 / Bailing's ``limit_after_act``) instead of before
            it (a bool; default False). Unused by the other activations.
        gate_softcap, up_softcap: the caps of ``"softcapped_swiglu"`` (finite numbers > 0; defaults
            4.0 and 25.0, Inkling2's ``mlp_gate_softcap`` / ``mlp_up_softcap``). Unused by the other
            activations. The last fields.
        bias_dtype: ``None`` (default): the experts have no biases. ``torch.float32`` or the layer
            dtype (``torch.bfloat16``): every forward takes per-expert biases of that dtype,
            ``b13 [E_local, w13_rows]`` added to FC1's float32 result before the activation and
            ``b2 [E_local, H]`` added to FC2's float32 result before the router weight:
            ``out[t] = sum_k w[t,k] · (act(x[t]·w13[e]ᵀ + b13[e])·w2[e]ᵀ + b2[e])``.
        quant: ``None`` (default): ``w13``/``w2`` are tensors in the layer dtype. Block-scaled
            weight formats (:mod:`moe_ep.api.quant`; H and I must be multiples of the block):

            * ``"nvfp4_w4a16"`` -- ``w13``/``w2`` are :class:`~moe_ep.api.quant.NVFP4Weight`
              (:func:`~moe_ep.api.quant.quantize_nvfp4`); the experts compute with
              ``bf16(dequant(w))`` and BF16 activations (Blackwell W4A16);
            * ``"mxfp8"`` -- ``w13``/``w2`` are :class:`~moe_ep.api.quant.MXFP8Tensor`
              (:func:`~moe_ep.api.quant.quantize_mxfp8`); FC1's input rows and FC2's input (the
              activation, rounded to bf16 first) are MXFP8-quantised the same way before each GEMM;
            * ``"fp8_block128"`` -- ``w13``/``w2`` are ``torch.float8_e4m3fn`` tensors with
              ``w13_scale [E_local, ceil(w13_rows/128), ceil(H/128)]`` and ``w2_scale [E_local,
              ceil(H/128), ceil(I/128)]`` float32 passed to ``forward`` (DeepSeek-V3 / Qwen3-FP8
              checkpoints; or a :class:`~moe_ep.api.quant.FP8Block128Weight` from
              :func:`~moe_ep.api.quant.quantize_fp8_block128`); every row of FC1's input and of
              FC2's input (the activation, rounded to bf16 first) is quantised to E4M3 with one
              float32 scale per 128 values (amax / 448, IEEE division); the GEMMs accumulate
              ``dequant(x) · dequant(w)`` in float32.
    """

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype = torch.bfloat16
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bias_dtype: torch.dtype | None = None
    quant: str | None = None
    swiglu_beta: float = 1.0
    swiglu_limit_after_act: bool = False
    gate_softcap: float = 4.0
    up_softcap: float = 25.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden", "intermediate", "top_k", "max_tokens_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {v}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"MoEConfig.dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"MoEConfig.dtype {self.dtype} is not supported; supported: {SUPPORTED_DTYPES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation {self.activation!r} is not one of {ACTIVATIONS}")
        for name in ("swiglu_alpha", "swiglu_limit", "swiglu_beta", "gate_softcap", "up_softcap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"MoEConfig.{name} must be a float, got {type(v).__name__}")
            if not math.isfinite(v):
                raise ValueError(f"MoEConfig.{name} must be finite, got {v}")
            object.__setattr__(self, name, float(v))  # frozen: normalise ints to float
        for name in ("swiglu_limit", "gate_softcap", "up_softcap"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoEConfig.{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.swiglu_limit_after_act, bool):
            raise TypeError(f"MoEConfig.swiglu_limit_after_act must be a bool, got "
                            f"{type(self.swiglu_limit_after_act).__name__}")
        if self.bias_dtype is not None:
            if not isinstance(self.bias_dtype, torch.dtype):
                raise TypeError(f"MoEConfig.bias_dtype must be None or a torch.dtype, got "
                                f"{type(self.bias_dtype).__name__}")
            allowed = tuple(dict.fromkeys((torch.float32, self.dtype)))
            if self.bias_dtype not in allowed:
                raise ValueError(f"MoEConfig.bias_dtype {self.bias_dtype} is not supported; use None (no "
                                 f"biases), torch.float32 or the layer dtype {self.dtype}")
        if self.quant is not None:
            if self.quant not in QUANT_FORMATS:
                raise ValueError(f"MoEConfig.quant {self.quant!r} is not one of None, {sorted(QUANT_FORMATS)}")
            block = QUANT_FORMATS[self.quant]
            for name in ("hidden", "intermediate"):
                if getattr(self, name) % block:
                    raise ValueError(f"MoEConfig.quant={self.quant!r} quantises along K in blocks of {block}: "
                                     f"MoEConfig.{name} ({getattr(self, name)}) must be a multiple of {block}")

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def has_bias(self) -> bool:
        """Whether forward takes per-expert biases ``b13``/``b2`` (``bias_dtype`` is set)."""
        return self.bias_dtype is not None

    @property
    def w13_rows(self) -> int:
        """Rows of one expert's ``w13``: 2·I for gated activations, I otherwise."""
        return 2 * self.intermediate if self.gated else self.intermediate

    def local_experts(self, world_size: int) -> int:
        """E_local = E / W; raises ``ValueError`` when E is not a multiple of W."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if self.num_experts % world_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of the EP world "
                             f"size ({world_size})")
        return self.num_experts // world_size

    def flops(self, tokens: int) -> int:
        """Useful FLOPs of the expert MLP for ``tokens`` tokens: 2·T·K·H·(w13_rows + I)
        (= 6·T·K·H·I for the gated activations)."""
        return 2 * tokens * self.top_k * self.hidden * (self.w13_rows + self.intermediate)
