"""moe_ep as a Hugging Face transformers experts implementation.

transformers (5.x) routes every MoE model's experts through a registry,
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``; a model picks an entry with
``experts_implementation="..."``. :func:`register` adds moe_ep there::

    import moe_ep.integrations.transformers as moe_ep_hf
    moe_ep_hf.register()                                   # name "moe_ep", backend "auto"
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16,
                                                 experts_implementation="moe_ep")
    with torch.no_grad():
        logits = model(input_ids).logits

The experts function is called as ``forward(experts_module, hidden_states [T, H],
top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``. On its first call for a module it builds a
:class:`moe_ep.api.MoELayer` sized from the module's weights (``gate_up_proj [E, 2I, H]`` gate rows
first, ``down_proj [E, H, I]``), the router's top-k and the model config's ``hidden_act``
(``silu`` -> swiglu, ``gelu`` -> gelu_glu), warms it up and keeps it on the module; later calls reuse
it. A batch longer than the layer's token capacity rebuilds it once with twice the capacity (or
more), with a warning. Expert biases (``has_bias``) become the layer's ``b13``/``b2``.

Refused with a clear error (never computed wrongly): autograd (training), weights not in the
layout above (``is_transposed``, interleaved ``is_concatenated=False`` such as gpt-oss), experts
without a gate, other activations, custom gate functions, post-expert norms, dtypes other than
bf16. transformers' expert-parallel sentinel (``top_k_index == num_experts``, a choice owned by
another rank) contributes nothing: it is routed to expert 0 with weight 0.

Host work per call: converting ``top_k_weights`` to float32 when the model gives bf16.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer

ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "gelu_glu"}
_ATTR = "_moe_ep_layer"


class MoEEpTransformersError(ValueError):
    """An experts module or call that this adapter cannot run (the message says why)."""


def _activation(module: Any) -> str:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in ACTIVATIONS:
        raise MoEEpTransformersError(
            f"moe_ep experts: the model's hidden_act {act!r} is not supported (supported: "
            f"{sorted(ACTIVATIONS)} -> {sorted(set(ACTIVATIONS.values()))})")
    return ACTIVATIONS[act]


def _check_module(module: Any) -> None:
    name = type(module).__name__
    if getattr(module, "is_transposed", False):
        raise MoEEpTransformersError(f"moe_ep experts: {name} stores transposed weights (is_transposed=True); "
                                     "moe_ep needs gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    if not getattr(module, "is_concatenated", True):
        raise MoEEpTransformersError(f"moe_ep experts: {name} interleaves gate and up rows (is_concatenated=False); "
                                     "moe_ep needs gate rows first, then up rows")
    if not getattr(module, "has_gate", True):
        raise MoEEpTransformersError(f"moe_ep experts: {name} has no gate projection (has_gate=False)")
    if getattr(module, "has_post_expert_norm", False):
        raise MoEEpTransformersError(f"moe_ep experts: {name} applies a post-expert norm; not supported")
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise MoEEpTransformersError(f"moe_ep experts: {name} has a custom gate function (_apply_gate); "
                                     "moe_ep runs act(gate) * up only")


def _config_for(module: Any, hidden_states: torch.Tensor, top_k: int, capacity: int) -> MoEConfig:
    w13, w2 = module.gate_up_proj, module.down_proj
    E, rows, H = w13.shape
    I = w2.shape[-1]
    if rows != 2 * I or tuple(w2.shape) != (E, H, I):
        raise MoEEpTransformersError(f"moe_ep experts: gate_up_proj {tuple(w13.shape)} and down_proj "
                                     f"{tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    bias_dtype = module.gate_up_proj_bias.dtype if getattr(module, "has_bias", False) else None
    return MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=top_k, max_tokens_per_rank=capacity,
                     dtype=hidden_states.dtype, activation=_activation(module), bias_dtype=bias_dtype)


def _layer_for(module: Any, hidden_states: torch.Tensor, top_k: int, backend: str, min_tokens: int,
               layer_options: dict) -> MoELayer:
    T = hidden_states.shape[0]
    layer = getattr(module, _ATTR, None)
    if layer is not None:
        c = layer.config
        if c.top_k == top_k and c.max_tokens_per_rank >= T and layer.device == hidden_states.device:
            return layer
        grow = max(T, 2 * c.max_tokens_per_rank)
        warnings.warn(f"moe_ep experts: rebuilding the layer of {type(module).__name__} for {T} tokens "
                      f"(capacity {c.max_tokens_per_rank} -> {grow}; top_k {c.top_k} -> {top_k}); it is "
                      "warmed up again", stacklevel=3)
        layer.destroy()
        capacity = grow
    else:
        capacity = max(T, min_tokens)
    capacity = 1 << max(0, math.ceil(math.log2(max(capacity, 1))))  # powers of two: few rebuilds
    cfg = _config_for(module, hidden_states, top_k, capacity)
    layer = MoELayer(cfg, EPGroup.single(), backend=backend, device=hidden_states.device, **layer_options)
    layer.warmup(progress=False)
    object.__setattr__(module, _ATTR, layer)  # not an nn.Module attribute: kept out of state_dict
    return layer


def make_experts_forward(backend: str = "auto", min_tokens: int = 256, **layer_options):
    """The experts function for transformers' registry (see the module docstring).

    ``backend``: a moe_ep backend name or ``"auto"``; ``min_tokens``: smallest token capacity a
    layer is built with; ``layer_options``: more :class:`~moe_ep.api.MoELayer` keyword arguments."""

    def moe_ep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.gate_up_proj.requires_grad
                                        or self.down_proj.requires_grad):
            raise RuntimeError("moe_ep experts: autograd (training) is not supported yet -- run under "
                               "torch.no_grad() / torch.inference_mode(), or pick another "
                               "experts_implementation for training")
        _check_module(self)
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(f"moe_ep experts: hidden_states are {hidden_states.dtype}; moe_ep runs bf16 "
                            "(load the model with dtype=torch.bfloat16)")
        layer = _layer_for(self, hidden_states, top_k_index.shape[-1], backend, min_tokens, layer_options)
        ids, weights = top_k_index, top_k_weights
        if getattr(self, "_is_expert_parallel", False):  # another rank's choice: expert 0, weight 0
            owned_elsewhere = ids >= self.num_experts
            ids = ids.masked_fill(owned_elsewhere, 0)
            weights = weights.masked_fill(owned_elsewhere, 0.0)
        if weights.dtype != torch.float32:
            weights = weights.float()
        biases = {}
        if getattr(self, "has_bias", False):
            biases = dict(b13=self.gate_up_proj_bias, b2=self.down_proj_bias)
        return layer.forward(hidden_states, ids, weights, self.gate_up_proj, self.down_proj, **biases)

    return moe_ep_experts_forward


def register(name: str = "moe_ep", backend: str = "auto", min_tokens: int = 256, **layer_options) -> str:
    """Add moe_ep to transformers' experts registry under ``name``; returns ``name``. Models then
    select it with ``experts_implementation=name`` (or ``model.set_experts_implementation(name)``)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("moe_ep.integrations.transformers needs transformers >= 5 with "
                          "transformers.integrations.moe (pip install 'moe_ep[transformers]')") from e
    ALL_EXPERTS_FUNCTIONS.register(name, make_experts_forward(backend, min_tokens, **layer_options))
    return name


def release(model: torch.nn.Module) -> int:
    """Destroy every moe_ep layer attached to ``model``'s experts modules; returns how many."""
    n = 0
    for mod in model.modules():
        layer = mod.__dict__.pop(_ATTR, None)
        if layer is not None:
            layer.destroy()
            n += 1
    return n
