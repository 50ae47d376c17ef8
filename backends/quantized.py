"""What the block-scaled-weight backends (``sm90_fp8_cutedsl``, ``sm100_w4a16_cutedsl``,
``sm120_mxfp8_cutedsl``) share: the configuration checks every one of them makes, and the buffers
of the quantised activations a layer owns."""

from __future__ import annotations

from typing import Any

import torch

from .registry import UnsupportedBackendError


def check_quantized_config(name: str, config: Any, group: Any, quant: str, activations: tuple,
                           bias_dtypes: tuple = ()) -> None:
    """Refuse (naming ``name`` and the reason) a config that is not ``quant`` weights, bf16 layer
    inputs, one of ``activations``, bias-free or with biases of one of ``bias_dtypes``, over an NCCL
    (or virtual) group."""
    if getattr(config, "quant", None) != quant:
        raise UnsupportedBackendError(f"{name} runs MoEConfig.quant={quant!r} weights, not "
                                      f"quant={getattr(config, 'quant', None)!r}")
    if config.dtype != torch.bfloat16:
        raise UnsupportedBackendError(f"{name} runs bf16 layer inputs only, not {config.dtype}")
    if config.activation not in activations:
        raise UnsupportedBackendError(f"{name}: activation {config.activation!r} is not supported "
                                      f"(supported: {sorted(activations)})")
    bias_dtype = getattr(config, "bias_dtype", None)
    if bias_dtype is not None and bias_dtype not in bias_dtypes:
        raise UnsupportedBackendError(f"{name}: per-expert biases are not supported" if not bias_dtypes else
                                      f"{name}: bias_dtype {bias_dtype} is not supported (supported: "
                                      f"{', '.join(str(d) for d in bias_dtypes)})")
    if group.world_size > 1 and group.dist_backend not in ("nccl", "virtual"):
        raise UnsupportedBackendError(f"{name} over several ranks bootstraps NVSHMEM over an NCCL process group")


def quantized_rows_bytes(config: Any, world_size: int, block: int, scale_bytes: int) -> int:
    """Device bytes of :func:`quantized_activation_buffers` for a layer: 1-byte values plus one
    ``scale_bytes`` scale per ``block`` values, for every grouped row of the receive capacity."""
    rows = world_size * config.max_tokens_per_rank * config.top_k
    width = config.hidden + config.intermediate
    return rows * width + rows * (width // block) * scale_bytes


def quantized_activation_buffers(rows: int, hidden: int, intermediate: int, block: int, scale_dtype: torch.dtype,
                                 device: torch.device) -> dict:
    """The layer-owned copies of FC1's input (``xq [rows, H]``) and FC2's input (``hq [rows, I]``)
    in ``float8_e4m3fn`` with one ``scale_dtype`` scale per ``block`` values (``*_scale``)."""
    e4m3 = torch.float8_e4m3fn
    return {"xq": torch.empty(rows, hidden, dtype=e4m3, device=device),
            "xq_scale": torch.empty(rows, hidden // block, dtype=scale_dtype, device=device),
            "hq": torch.empty(rows, intermediate, dtype=e4m3, device=device),
            "hq_scale": torch.empty(rows, intermediate // block, dtype=scale_dtype, device=device)}
