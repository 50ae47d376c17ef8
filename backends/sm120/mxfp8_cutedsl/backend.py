"""SM120 (RTX PRO 6000 class) MXFP8 backend on the drop ``sm120/mxfp8`` -- **compiled and
host-tested, not yet run on Blackwell hardware**.

The forward is the SM90 backend's (:mod:`moe_ep.backends.sm90.bf16_cutedsl`), with its EP and
expert-layout kernels built for sm_120a (they are arch-neutral), and steps 3-4 replaced:

1. **dispatch** and 2. **expert layout** -- as on SM90 (BF16 rows, grouped by local expert);
3. **FC1 + gated activation** -- the grouped rows are quantised to MXFP8 (E4M3 + an E8M0 scale per
   32, the rule of :func:`moe_ep.api.quant.quantize_mxfp8`), then the swap-AB block-scaled grouped
   GEMM ``h = act(xq · wq13ᵀ)`` (``mma.sync ... kind::mxf8f6f4.block_scale``; ``act`` one of
   :data:`ACTIVATIONS`, clamped_swiglu's and softcapped_swiglu's constants from the config);
4. **FC2 + router weight** -- ``h`` quantised to MXFP8 the same way, ``y = ws · (hq · wq2ᵀ)``;
5. **combine** -- as on SM90.

Weights: ``MoEConfig.quant = "mxfp8"`` and :class:`moe_ep.api.quant.MXFP8Tensor` for ``w13``
``[E_local, 2I, H]`` and ``w2`` ``[E_local, H, I]`` (values e4m3, scales ``[..., K/32]`` e8m0).
The quantised activations live in buffers of this layer, allocated when it binds (never in
``forward``). No biases.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.shim import (sm120_check_mxfp8_gemm,
                         sm120_check_mxfp8_quantize, sm120_compiled_mxfp8_gemm, sm120_compiled_quantize_rows,
                         sm120_mxfp8_gemm, sm120_pick_tile_tokens, sm120_quantize_rows)

from ...quant import MXFP8_BLOCK, quantize_mxfp8
from ...quantized import check_quantized_config
from ...registry import UnsupportedBackendError, require_cuda_arch
from ...sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend, prebuild_layer, rows_per_expert, swiglu_constants

NAME = "sm120_mxfp8_cutedsl"
ARCH = "sm_120a"
#: MoEConfig.activation values this backend runs: FC1's epilogue of the same name (the GELU gates,
#: clamped_swiglu and softcapped_swiglu: drop sm120/mxfp8 v2)
ACTIVATIONS = ("swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu")


def _gemm_specs(cfg: Any, e_local: int, world: int) -> dict:
    """name -> ((epilogue, n, k, E_local, token tile), activation constants) of FC1 and FC2; the token
    tile from the mean rows per expert at capacity (static)."""
    tile = sm120_pick_tile_tokens(rows_per_expert(cfg, world, cfg.max_tokens_per_rank))
    return {"fc1": ((cfg.activation, cfg.w13_rows, cfg.hidden, e_local, tile), swiglu_constants(cfg)),
            "fc2": (("row_scale", cfg.hidden, cfg.intermediate, e_local, tile), {})}


def check_config(config: Any, group: Any) -> None:
    """What this backend refuses on any machine (shapes, formats), with the reason."""
    check_quantized_config(NAME, config, group, "mxfp8", ACTIVATIONS)
    try:
        for args, consts in _gemm_specs(config, config.local_experts(group.world_size), group.world_size).values():
            sm120_check_mxfp8_gemm(*args, **consts)
        sm120_check_mxfp8_quantize(config.hidden)
        sm120_check_mxfp8_quantize(config.intermediate)
    except ValueError as e:
        raise UnsupportedBackendError(f"{NAME}: {e}") from e


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here (on an H200: the arch)."""
    require_cuda_arch(NAME, device, (12,), "an SM120 GPU (RTX PRO 6000 class, compute capability 12.x)")
    check_config(config, group)


def prebuild(config: Any, world_size: int, kernels: tuple = ("fc1", "fc2", "ep", "layout")) -> None:
    """Compile (or load from the disk compile cache) every kernel a layer needs, for sm_120a,
    without a GPU (``python -m moe_ep.aot build --arch sm_120a``); "fc1"/"fc2" include the
    row quantiser for their input width."""
    specs = _gemm_specs(config, config.local_experts(world_size), world_size)

    def gemm(name):
        args, consts = specs[name]
        return lambda: (sm120_compiled_mxfp8_gemm(*args, **consts), sm120_compiled_quantize_rows(args[2]))

    prebuild_layer(config, world_size, kernels, {"fc1": gemm("fc1"), "fc2": gemm("fc2")}, ARCH)


class Sm120Mxfp8Backend(Sm90CuteDSLBackend):
    """The SM90 backend's dispatch/layout/combine (built for sm_120a) around MXFP8 GEMMs."""

    name = NAME
    arch = ARCH
    quant_rows = (MXFP8_BLOCK, torch.float8_e8m0fnu)  # xq / hq and their scales: in the shared workspace

    def _bind_gemms(self, views: dict) -> None:
        cfg = self.cfg
        specs = _gemm_specs(cfg, self.E, self.W)
        self.fc1 = sm120_mxfp8_gemm(*specs["fc1"][0], **specs["fc1"][1])
        self.fc2 = sm120_mxfp8_gemm(*specs["fc2"][0], **specs["fc2"][1])
        self.quant_x, self.quant_h = sm120_quantize_rows(cfg.hidden), sm120_quantize_rows(cfg.intermediate)
        self.fc1_decode = self.fc2_decode = None
        self._decode_max_tokens = 0
        self._gemms = (self.fc1, self.fc2)
        # FC1's and FC2's quantised inputs: every forward rewrites them, so the layers share them
        self.xq, self.xq_scale, self.hq, self.hq_scale = (views[k] for k in ("xq", "xq_scale", "hq", "hq_scale"))

    def _warm_weights(self, g: torch.Generator) -> tuple:
        cfg = self.cfg
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g) * cfg.hidden ** -0.5
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g) * cfg.intermediate ** -0.5
        return quantize_mxfp8(w13), quantize_mxfp8(w2)

    def _prepare_expert_launches(self) -> None:
        """Steps 3-4 call this drop's GEMM launchers plainly (they have no prepared form)."""
        self._expert_runs = {}

    def _step34_experts(self, w13, w2, b13=None, b2=None) -> None:
        fc1, fc2 = self._gemms
        # every capacity row is quantised (rows past offsets[-1] are never read by the GEMMs):
        # the valid count lives on the device, and reading it would sync the host
        self.quant_x(self.xs, self.xq, self.xq_scale)
        fc1(self.xq, self.xq_scale, w13.values, w13.scale, self.offsets, out=self.h, max_active_ctas=self.num_ctas)
        self.quant_h(self.h, self.hq, self.hq_scale)
        fc2(self.hq, self.hq_scale, w2.values, w2.scale, self.offsets, out=self.y, row_scale=self.ws_rows,
            max_active_ctas=self.num_ctas)

    def destroy(self):
        self.xq = self.xq_scale = self.hq = self.hq_scale = None
        super().destroy()
