"""SM90 (H100/H200) FP8 block-scaled backend (DeepSeek-V3 / Qwen3-FP8 weights) on the drop
``sm90/megamoe``: what ``backend="auto"`` picks for ``quant="fp8_block128"`` on an H100/H200. No
host sync and no allocation in ``forward``, CUDA-graph capturable, bit-deterministic (GPU tests).

The forward is the BF16 SM90 backend's, with steps 3-4 replaced:

1. **dispatch** and 2. **expert layout** -- as in :mod:`moe_ep.backends.sm90.bf16_cutedsl` (BF16
   rows on the wire; FP8 on the wire is still to come);
3. **FC1 + SwiGLU** -- the grouped rows are quantised per 128 values of a row (E4M3 + one float32
   scale, ``amax / 448``: :func:`moe_ep.api.quant.quantize_fp8_rows128`), then the FP8 grouped GEMM
   with per-k-block scale promotion ``h = swiglu(xq · wq13ᵀ)``; by default (:func:`fused_gather_quant`)
   step 2 skips the BF16 row gather and this step quantises the received rows straight into grouped
   order (one launch and a BF16 write + read of every grouped row less; same bits);
4. **FC2 + router weight** -- ``h`` quantised the same way, ``y = ws · (hq · wq2ᵀ)``;
5. **combine** -- as on BF16.

Weights: ``MoEConfig.quant = "fp8_block128"``; ``w13``/``w2`` are
:class:`moe_ep.api.quant.FP8Block128Weight` (values ``float8_e4m3fn [E, N, K]``, scales float32
``[E, N/128, K/128]``; or raw e4m3 tensors with ``forward(w13_scale=, w2_scale=)``). H and I must
be multiples of 128. The quantised activations live in buffers of this layer (allocated at bind).
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.shim import (sm90_check_fp8_gemm, sm90_compiled_fp8_gemm, sm90_compiled_fp8_quantize_rows,
                         sm90_fp8_gemm, sm90_fp8_quantize_rows)

from ...quant import FP8_BLOCK, quantize_fp8_block128
from ...quantized import check_quantized_config, quantized_activation_buffers
from ...registry import UnsupportedBackendError, require_cuda_arch
from ..bf16_cutedsl.backend import Sm90CuteDSLBackend, env_switch, prebuild_layer

NAME = "sm90_fp8_cutedsl"


def _gemm_specs(cfg: Any, e_local: int) -> dict:
    return {"fc1": ("swiglu", cfg.w13_rows, cfg.hidden, e_local, False),
            "fc2": ("identity", cfg.hidden, cfg.intermediate, e_local, True)}


def check_config(config: Any, group: Any) -> None:
    """What this backend refuses on any machine (shapes, formats), with the reason."""
    check_quantized_config(NAME, config, group, "fp8_block128", ("swiglu",))
    try:
        for spec in _gemm_specs(config, config.local_experts(group.world_size)).values():
            sm90_check_fp8_gemm(*spec[:4])
    except ValueError as e:
        raise UnsupportedBackendError(f"{NAME}: {e}") from e


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here."""
    require_cuda_arch(NAME, device, (9, 0), "an SM90 GPU (H100/H200)")
    check_config(config, group)


def fused_gather_quant() -> bool:
    """Step 2 writes no BF16 grouped rows and step 3 gathers and quantises the received rows in one
    pass (drop v12's gathering quantiser): bit-identical to gather-then-quantise (GPU test), Qwen3
    8192 tokens 1.21 -> 1.10 ms on the H200. ``MOE_EP_FP8_FUSED_GATHER=0`` turns it off (to compare)."""
    return env_switch("MOE_EP_FP8_FUSED_GATHER", True)


def prebuild(config: Any, world_size: int, kernels: tuple = ("fc1", "fc2", "ep", "layout")) -> None:
    """Compile (or load from the disk compile cache) every kernel a layer needs, without a GPU;
    "fc1"/"fc2" include the row quantiser of their input width."""
    specs = _gemm_specs(config, config.local_experts(world_size))

    def gemm(name):
        gather = name == "fc1" and fused_gather_quant()
        return lambda: (sm90_compiled_fp8_gemm(*specs[name]),
                        sm90_compiled_fp8_quantize_rows(specs[name][2], gather=gather))

    prebuild_layer(config, world_size, kernels, {"fc1": gemm("fc1"), "fc2": gemm("fc2")})


class Sm90Fp8Backend(Sm90CuteDSLBackend):
    """The BF16 SM90 backend's dispatch/layout/combine around FP8 block-scaled GEMMs."""

    name = NAME

    def _bind_gemms(self, views: dict) -> None:
        cfg = self.cfg
        specs = _gemm_specs(cfg, self.E)
        self.fc1, self.fc2 = sm90_fp8_gemm(*specs["fc1"]), sm90_fp8_gemm(*specs["fc2"])
        self.fused_gather = fused_gather_quant()
        self.quant_x = sm90_fp8_quantize_rows(cfg.hidden, gather=self.fused_gather)
        self.quant_h = sm90_fp8_quantize_rows(cfg.intermediate)
        self.fc1_decode = self.fc2_decode = None
        self._decode_max_tokens = 0
        self._gemms = (self.fc1, self.fc2)
        P = views["xs"].shape[0]  # grouped-row capacity
        if getattr(self, "xq", None) is None or self.xq.shape[0] != P:
            bufs = quantized_activation_buffers(P, cfg.hidden, cfg.intermediate, FP8_BLOCK, torch.float32, self.device)
            self.xq, self.xq_scale, self.hq, self.hq_scale = bufs["xq"], bufs["xq_scale"], bufs["hq"], bufs["hq_scale"]
        self._rows = views["offsets"][-1:]  # grouped rows of a call, read on the device (no host sync)

    def _warm_weights(self, g: torch.Generator) -> tuple:
        cfg = self.cfg
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g) * cfg.hidden ** -0.5
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g) * cfg.intermediate ** -0.5
        return quantize_fp8_block128(w13), quantize_fp8_block128(w2)

    def _step2_layout(self) -> None:
        # fused gather: the layout writes no BF16 rows (xs stays free for FC2's output); the
        # quantiser reads the received rows, or the caller's x when one rank skips the dispatch
        x = self._routing[0] if self.local_route else None
        self._x_rows = x if x is not None and x.shape[0] else self.ep.bufs.recv_x
        super()._step2_layout(xs=not self.fused_gather)

    def _step34_experts(self, w13, w2, b13=None, b2=None) -> None:
        fc1, fc2 = self._gemms
        if self.fused_gather:  # grouped row r = received row idx[r], quantised on the way
            self.quant_x(self._x_rows, self.xq, self.xq_scale, count=self._rows, idx=self.idx)
            self._x_rows = None
        else:
            self.quant_x(self.xs, self.xq, self.xq_scale, count=self._rows)
        fc1(self.xq, self.xq_scale, w13.values, w13.scale, self.offsets, out=self.h, row_scale=self.ws_rows,
            max_active_ctas=self.num_ctas)
        self.quant_h(self.h, self.hq, self.hq_scale, count=self._rows)
        fc2(self.hq, self.hq_scale, w2.values, w2.scale, self.offsets, out=self.y, row_scale=self.ws_rows,
            max_active_ctas=self.num_ctas)

    def destroy(self):
        self.xq = self.xq_scale = self.hq = self.hq_scale = None
        super().destroy()
