"""What the block-scaled-weight backends (``sm90_fp8_cutedsl``, ``sm100_w4a16_cutedsl``,
``sm120_mxfp8_cutedsl``) share: the configuration checks every one of them makes. (Their quantised
activations live in the shared workspace: ``Dims.quant`` in ``sm90/bf16_cutedsl/workspace.py``.)"""

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
