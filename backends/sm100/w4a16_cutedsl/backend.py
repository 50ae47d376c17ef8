"""SM100 (B200/GB200) W4A16 backend: NVFP4 expert weights, BF16 activations, on the drop
``sm100/w4a16`` -- **compiled and host-tested, not yet run on Blackwell hardware**.

The forward is the SM90 backend's (:mod:`moe_ep.backends.sm90.bf16_cutedsl`), with its EP and
expert-layout kernels built for sm_100a (they are arch-neutral), and steps 3-4 replaced:

1. **dispatch** and 2. **expert layout** -- as on SM90 (BF16 rows, grouped by local expert);
3. **FC1 + activation** -- W4A16 grouped GEMM ``h = act(xs · dequant(w13)ᵀ (+ b13))`` (tcgen05
   UMMA; the NVFP4 weight tile is dequantised to BF16 in shared memory; ``squared_relu`` or a gate
   of :data:`ACTIVATION_MAP`, clamped_swiglu's and softcapped_swiglu's constants from the config);
4. **FC2 + router weight** -- ``y = ws · (h · dequant(w2)ᵀ (+ b2))``;
5. **combine** -- as on SM90.

Weights: ``MoEConfig.quant = "nvfp4_w4a16"`` and :class:`moe_ep.api.quant.NVFP4Weight` for ``w13``
``[E_local, w13_rows, H]`` and ``w2`` ``[E_local, H, I]`` (values ``[E, N, K/2]`` uint8, block scales
``[E, N, K/16]`` e4m3, global scales ``[E]`` float32). Optional per-expert biases (drop v4; gpt-oss's):
``MoEConfig.bias_dtype`` float32 or bfloat16, ``b13 [E_local, w13_rows]`` and ``b2 [E_local, H]`` in
``forward``, added before the activation and before the router weight.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.shim import (sm100_check_w4a16_gemm, sm100_compiled_w4a16_gemm, sm100_w4a16_gemm)

from ...quant import quantize_nvfp4
from ...quantized import check_quantized_config
from ...registry import UnsupportedBackendError, require_cuda_arch
from ...sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend, prebuild_layer, swiglu_constants

NAME = "sm100_w4a16_cutedsl"
ARCH = "sm_100a"
#: MoEConfig.bias_dtype values this backend runs besides None (drop v4)
BIAS_DTYPES = (torch.float32, torch.bfloat16)
#: MoEConfig.activation -> the drop's FC1 epilogue (gelu_glu, gelu_tanh_glu: drop v2; clamped_swiglu,
#: softcapped_swiglu: drop v3)
ACTIVATION_MAP = {"squared_relu": "squared_relu", "swiglu": "swiglu", "gelu_glu": "gelu_glu",
                  "gelu_tanh_glu": "gelu_tanh_glu", "clamped_swiglu": "clamped_swiglu",
                  "softcapped_swiglu": "softcapped_swiglu"}


def _gemm_specs(cfg: Any, e_local: int) -> dict:
    """name -> (shim arguments, activation constants, bias dtype or None) of the layer's two GEMMs."""
    bias = getattr(cfg, "bias_dtype", None)
    return {"fc1": ((ACTIVATION_MAP[cfg.activation], cfg.w13_rows, cfg.hidden, e_local), swiglu_constants(cfg), bias),
            "fc2": (("row_scale", cfg.hidden, cfg.intermediate, e_local), {}, bias)}


def check_config(config: Any, group: Any) -> None:
    """What this backend refuses on any machine (shapes, formats), with the reason."""
    check_quantized_config(NAME, config, group, "nvfp4_w4a16", tuple(ACTIVATION_MAP), BIAS_DTYPES)
    e_local = config.local_experts(group.world_size)
    try:
        for args, consts, _ in _gemm_specs(config, e_local).values():
            sm100_check_w4a16_gemm(*args, **consts)
    except ValueError as e:
        raise UnsupportedBackendError(f"{NAME}: {e}") from e


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here (on an H200: the arch)."""
    require_cuda_arch(NAME, device, (10,), "an SM100 GPU (B200/GB200, compute capability 10.x)")
    check_config(config, group)


def prebuild(config: Any, world_size: int, kernels: tuple = ("fc1", "fc2", "ep", "layout")) -> None:
    """Compile (or load from the disk compile cache) every kernel a layer needs, for sm_100a,
    without a GPU (``python -m moe_ep.aot build --arch sm_100a``)."""
    specs = _gemm_specs(config, config.local_experts(world_size))
    prebuild_layer(config, world_size, kernels,
                   {name: (lambda spec=spec: sm100_compiled_w4a16_gemm(*spec[0], bias_dtype=spec[2], **spec[1]))
                    for name, spec in specs.items()}, ARCH)


class Sm100W4A16Backend(Sm90CuteDSLBackend):
    """The SM90 backend's dispatch/layout/combine (built for sm_100a) around W4A16 GEMMs."""

    name = NAME
    arch = ARCH

    def _bind_gemms(self, views: dict) -> None:
        specs = _gemm_specs(self.cfg, self.E)
        self.fc1, self.fc2 = (sm100_w4a16_gemm(*args, bias_dtype=bias, **consts)
                              for args, consts, bias in (specs["fc1"], specs["fc2"]))
        self.fc1_decode = self.fc2_decode = None
        self._decode_max_tokens = 0
        self._gemms = (self.fc1, self.fc2)

    def _warm_weights(self, g: torch.Generator) -> tuple:
        cfg = self.cfg
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g) * cfg.hidden ** -0.5
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g) * cfg.intermediate ** -0.5
        return quantize_nvfp4(w13), quantize_nvfp4(w2)

    def _prepare_expert_launches(self) -> None:
        """Steps 3-4 call this drop's GEMM launchers plainly (they have no prepared form)."""
        self._expert_runs = {}

    def _step34_experts(self, w13, w2, b13=None, b2=None) -> None:
        fc1, fc2 = self._gemms
        fc1(self.xs, w13.values, w13.block_scale, w13.global_scale, self.offsets, out=self.h,
            max_active_ctas=self.num_ctas, bias=b13)
        fc2(self.h, w2.values, w2.block_scale, w2.global_scale, self.offsets, row_scale=self.ws_rows,
            out=self.y, max_active_ctas=self.num_ctas, bias=b2)
