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
:class:`moe_ep.api.MoELayer` sized from the module's weights, the router's top-k and the module's
activation, warms it up and keeps it on the module; later calls reuse it. A batch longer than the
layer's token capacity rebuilds it once with twice the capacity (or more), with a warning.

The weights, in any layout transformers' flags describe:

* gated experts (``gate_up_proj``; ``is_concatenated``: gate rows then up rows, else interleaved
  gate/up rows as gpt-oss stores them) or non-gated ones (``has_gate=False``: ``up_proj``, as
  Nemotron-H's);
* ``[E, out, in]`` or, with ``is_transposed``, ``[E, in, out]`` (gpt-oss, Aria);
* expert biases (``has_bias``) become the layer's ``b13``/``b2``.

moe_ep's own layout is gate-first ``[E, 2I, H]`` and ``[E, H, I]``: modules already in it are used as
they are; any other layout is repacked once into a copy kept beside the module (a warning gives its
size), and repacked again only when the module's weights change (their version counters).

FP8 checkpoints (a model loaded with ``FineGrainedFP8Config``: DeepSeek-V3, Qwen3-FP8) run their
experts through transformers' FP8 registry, where :func:`register` adds moe_ep too: a
``quant="fp8_block128"`` layer (``sm90_fp8_cutedsl`` on an H100/H200) on the module's own e4m3
weights and 128 x 128 block scales (``*_scale_inv``; UE8M0 scales converted once to float32).
Static activation scales, other block sizes and FP4-packed experts are refused.

The activation is what the module computes, probed once on random input in float32: its gate
function (``_apply_gate``, transformers' default or the model's own) must match one of moe_ep's --
``swiglu`` (silu(g)·u), ``gelu_glu`` (erf gelu(g)·u), ``gelu_tanh_glu`` (tanh-form gelu(g)·u, Gemma 4's
``gelu_pytorch_tanh``) or, with the module's ``limit`` (or
``swiglu_limit``) and ``alpha`` (or ``swiglu_alpha``; 1 when it has none), ``clamped_swiglu``: gpt-oss's
``(u' + 1)·g'·sigmoid(alpha·g')`` or DeepSeek-V4's, GLM-5's and Hunyuan-V4's ``silu(g')·u'``
(``swiglu_beta`` 0), ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``, or Step-3.7's and
Bailing's ``min(silu(g), limit)·u'`` (``swiglu_limit_after_act``), or with the module's ``gate_softcap``
and ``up_softcap`` (its own or its ``act_fn``'s) Inkling2's ``softcapped_swiglu`` -- and a non-gated
module's ``act_fn`` must be relu² (``squared_relu``).

Refused with a clear error (never computed wrongly): autograd (training), a gate or activation
matching none of those (the message names the function), post-expert norms, dtypes other than
bf16. transformers' expert-parallel sentinel (``top_k_index == num_experts``, a choice owned by
another rank) contributes nothing: it is routed to expert 0 with weight 0.

Host work per call: converting ``top_k_weights`` to float32 when the model gives bf16; for a
repacked module, reading its weights' version counters.

``torch.compile(model, fullgraph=True)`` works, before or after any eager call: while Dynamo traces,
an experts call records one operator, ``torch.ops.moe_ep.hf_experts``, whose implementation is this
module's eager experts function, so the first call's set-up (probing the activation, building and
warming up the layer) runs when the compiled graph runs, never in the trace, and the outputs are the
eager bits. With ``mode="reduce-overhead"``, make the first call with the largest batch the model
will see: a layer that must grow later would compile kernels while torch records a CUDA graph, which
raises.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer

_ATTR = "_moe_ep_layer"
_SPEC = "_moe_ep_spec"  # (the flags below, what _describe found), kept on the module
_FLAGS = ("has_gate", "is_transposed", "is_concatenated", "has_bias", "has_post_expert_norm")
_PACKED = "_moe_ep_packed"  # (version key, (w13, w2, b13, b2)) of a repacked module


class MoEEpTransformersError(ValueError):
    """An experts module or call that this adapter cannot run (the message says why)."""


@dataclass(frozen=True)
class _Spec:
    """What moe_ep makes of one transformers experts module (found once, by :func:`_describe`)."""

    activation: str
    constants: tuple  # the activation's MoEConfig fields as (name, value) pairs; () for swiglu etc.
    gated: bool
    transposed: bool
    interleaved: bool
    bias: bool

    @property
    def native(self) -> bool:
        """The module's weights are moe_ep's layout already: used as they are, no copy."""
        return not self.transposed and not self.interleaved


def _split(t: torch.Tensor, interleaved: bool):
    """``(gate, up)`` halves of the last dim of a gated projection's output."""
    return (t[..., 0::2], t[..., 1::2]) if interleaved else t.chunk(2, dim=-1)


def _gate_candidates(module: Any):
    """``(activation, constants, fn)`` moe_ep could run for a gated module: ``constants`` are the
    activation's MoEConfig fields, ``fn(g, u)`` computes it in float32. The clamped forms need the
    module's limit; its alpha is 1 (SiLU) when it names none."""
    silu, gelu = torch.nn.functional.silu, torch.nn.functional.gelu
    yield "swiglu", (), lambda g, u: silu(g) * u
    yield "gelu_glu", (), lambda g, u: gelu(g) * u
    yield "gelu_tanh_glu", (), lambda g, u: gelu(g, approximate="tanh") * u  # Gemma 4 ("gelu_pytorch_tanh")
    alpha = next((getattr(module, a) for a in ("alpha", "swiglu_alpha") if getattr(module, a, None) is not None), 1.0)
    limit = next((getattr(module, a) for a in ("limit", "swiglu_limit") if getattr(module, a, None) is not None), None)
    caps = _softcaps(module)
    if caps is not None:  # Inkling2: cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu)
        cg, cu = caps
        yield "softcapped_swiglu", (("gate_softcap", cg), ("up_softcap", cu)), \
            lambda g, u: cg * torch.tanh(g / cg) * torch.sigmoid(g) * (cu * torch.tanh(u / cu))
    if limit is not None:
        a, lim = float(alpha), float(limit)
        # beta: gpt-oss's +1; DeepSeek-V4 / GLM-5 / Hunyuan-V4 / Step-3.7 add nothing. after_act: the
        # gate clamped after the activation (Step-3.7 / Bailing's limit_after_act) or before it
        for after_act in (False, True):
            for beta in (1.0, 0.0):

                def clamped(g, u, beta=beta, after_act=after_act):
                    u = u.clamp(min=-lim, max=lim) + beta
                    if after_act:
                        return u * (g * torch.sigmoid(a * g)).clamp(max=lim)
                    g = g.clamp(max=lim)
                    return u * g * torch.sigmoid(a * g)

                yield "clamped_swiglu", (("swiglu_alpha", a), ("swiglu_limit", lim), ("swiglu_beta", beta),
                                         ("swiglu_limit_after_act", after_act)), clamped


def _softcaps(module: Any):
    """``(gate_softcap, up_softcap)`` of a softcapped gate, or None: on the module (transformers' FP8
    experts) or on its ``act_fn`` (Inkling2's, whose caps are modules holding ``softcap``)."""
    for holder in (module, getattr(module, "act_fn", None)):
        caps = [getattr(holder, n, None) for n in ("gate_softcap", "up_softcap")]
        caps = [getattr(c, "softcap", c) for c in caps]  # Inkling2's caps are modules holding the value
        if all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in caps):
            return float(caps[0]), float(caps[1])
    return None


def _probe_activation(module: Any, gated: bool, interleaved: bool, width: int):
    """``(activation, constants)`` (:func:`_gate_candidates`): the moe_ep activation that computes what
    the module does (its ``_apply_gate`` or, non-gated, its ``act_fn``), checked on random float32
    input (N(0, 25): past a clamp at +-7 often). Raises naming the function when none does."""
    x = torch.randn(16, 2 * width if gated else width, generator=torch.Generator().manual_seed(0)) * 5
    x = x.to(module.down_proj.device)  # where the module's own functions run (a sync, at the first call only)
    name = type(module).__name__
    with torch.no_grad():
        if not gated:
            got = module.act_fn(x)
            if torch.allclose(got, torch.relu(x) ** 2, rtol=1e-5, atol=1e-5):
                return "squared_relu", ()
            raise MoEEpTransformersError(f"moe_ep experts: {name} has no gate and its act_fn "
                                         f"{type(module.act_fn).__name__} is not relu^2 (squared_relu), the "
                                         "only non-gated activation moe_ep runs")
        got = module._apply_gate(x)
        g, u = _split(x, interleaved)
        for activation, constants, fn in _gate_candidates(module):
            if got.shape == g.shape and torch.allclose(got, fn(g, u), rtol=1e-5, atol=1e-5):
                return activation, constants
    gate_fn = getattr(type(module), "_apply_gate", None)
    raise MoEEpTransformersError(
        f"moe_ep experts: {name}'s gate ({getattr(gate_fn, '__qualname__', gate_fn)}, act_fn "
        f"{type(getattr(module, 'act_fn', None)).__name__}) computes none of moe_ep's gated activations: "
        "silu(g)*u, erf or tanh-form gelu(g)*u, or a clamped swiglu (the module's limit and alpha, with or "
        "without gpt-oss's +1 on the clamped up projection, the gate clamped before or after the activation), "
        "or a softcapped swiglu (the module's gate_softcap and up_softcap)")


def _describe(module: Any) -> _Spec:
    """The module's layout flags and activation (kept on the module after the first call)."""
    flags = tuple(getattr(module, f, None) for f in _FLAGS)
    cached = module.__dict__.get(_SPEC)
    if cached is not None and cached[0] == flags:
        return cached[1]
    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise MoEEpTransformersError(f"moe_ep experts: {name} applies a post-expert norm; not supported")
    gated = getattr(module, "has_gate", True)
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = gated and not getattr(module, "is_concatenated", True)
    w2 = module.down_proj
    width = w2.shape[1] if transposed else w2.shape[2]  # I
    activation, constants = _probe_activation(module, gated, interleaved, width)
    spec = _Spec(activation, constants, gated, transposed, interleaved, bool(getattr(module, "has_bias", False)))
    object.__setattr__(module, _SPEC, (flags, spec))
    return spec


def _sources(module: Any, spec: _Spec) -> tuple:
    """The module's own (w13, w2, b13, b2) parameters, in its layout (biases None without)."""
    w13 = module.gate_up_proj if spec.gated else module.up_proj
    b13 = (module.gate_up_proj_bias if spec.gated else module.up_proj_bias) if spec.bias else None
    return w13, module.down_proj, b13, (module.down_proj_bias if spec.bias else None)


def _repack(spec: _Spec, w13, w2, b13, b2) -> tuple:
    """moe_ep's layout (w13 [E, w13_rows, H] gate rows first, w2 [E, H, I], b13 [E, w13_rows],
    b2 [E, H]) from the module's, copied."""
    with torch.no_grad():
        if spec.transposed:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        if spec.interleaved:
            w13 = torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1)
            if b13 is not None:
                b13 = torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1)
        return tuple(None if t is None else t.detach().contiguous() for t in (w13, w2, b13, b2))


def _weights(module: Any, spec: _Spec) -> tuple:
    """``(w13, w2, b13, b2)`` for the layer: the module's own tensors in moe_ep's layout, else the
    repacked copy, made again when a source tensor changed (data pointer or version counter)."""
    src = _sources(module, spec)
    if spec.native:
        return src
    key = tuple((t.data_ptr(), t._version) for t in src if t is not None)
    packed = module.__dict__.get(_PACKED)
    if packed is None or packed[0] != key:
        tensors = _repack(spec, *src)
        if packed is None:
            mb = sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20
            layout = " and ".join(w for w, on in (("transposed", spec.transposed),
                                                  ("with gate and up rows interleaved", spec.interleaved)) if on)
            warnings.warn(f"moe_ep experts: {type(module).__name__} stores its weights {layout}; moe_ep keeps a "
                          f"copy in its own layout ({mb:.1f} MiB per layer)", stacklevel=4)
        packed = (key, tensors)
        object.__setattr__(module, _PACKED, packed)  # not an nn.Module attribute: kept out of state_dict
    return packed[1]


def _config_for(module: Any, spec: _Spec, w13: torch.Tensor, w2: torch.Tensor, b13, hidden_states: torch.Tensor,
                top_k: int, capacity: int, quant: str | None) -> MoEConfig:
    E, rows, H = w13.shape
    I = w2.shape[-1]
    if rows != (2 * I if spec.gated else I) or tuple(w2.shape) != (E, H, I):
        raise MoEEpTransformersError(f"moe_ep experts: {type(module).__name__}'s weights {tuple(w13.shape)} and "
                                     f"{tuple(w2.shape)} are not [E, {'2I' if spec.gated else 'I'}, H] and "
                                     "[E, H, I] in moe_ep's layout")
    return MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=top_k, max_tokens_per_rank=capacity,
                     dtype=hidden_states.dtype, activation=spec.activation,
                     bias_dtype=None if b13 is None else b13.dtype, quant=quant, **dict(spec.constants))


def _layer_for(module: Any, spec: _Spec, weights: tuple, quant: str | None, hidden_states: torch.Tensor, top_k: int,
               backend: str, min_tokens: int, layer_options: dict) -> MoELayer:
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
    w13, w2, b13, _ = weights
    cfg = _config_for(module, spec, w13, w2, b13, hidden_states, top_k, capacity, quant)
    layer = MoELayer(cfg, EPGroup.single(), backend=backend, device=hidden_states.device, **layer_options)
    layer.warmup(progress=False)
    object.__setattr__(module, _ATTR, layer)  # not an nn.Module attribute: kept out of state_dict
    return layer


def _check_call(module: Any, w_in: torch.Tensor, hidden_states: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (hidden_states.requires_grad or w_in.requires_grad
                                    or module.down_proj.requires_grad):
        raise RuntimeError("moe_ep experts: autograd (training) is not supported yet -- run under "
                           "torch.no_grad() / torch.inference_mode(), or pick another "
                           "experts_implementation for training")
    if hidden_states.dtype != torch.bfloat16:
        raise TypeError(f"moe_ep experts: hidden_states are {hidden_states.dtype}; moe_ep runs bf16 "
                        "(load the model with dtype=torch.bfloat16)")


def _run(module: Any, spec: _Spec, weights: tuple, quant: str | None, hidden_states: torch.Tensor,
         top_k_index: torch.Tensor, top_k_weights: torch.Tensor, backend: str, min_tokens: int,
         layer_options: dict, **scales) -> torch.Tensor:
    """The module's layer (built or grown as needed) on one call; ``weights`` = (w13, w2, b13, b2)."""
    layer = _layer_for(module, spec, weights, quant, hidden_states, top_k_index.shape[-1], backend, min_tokens,
                       layer_options)
    ids, topk_w = top_k_index, top_k_weights
    if getattr(module, "_is_expert_parallel", False):  # another rank's choice: expert 0, weight 0
        owned_elsewhere = ids >= module.num_experts
        ids = ids.masked_fill(owned_elsewhere, 0)
        topk_w = topk_w.masked_fill(owned_elsewhere, 0.0)
    if topk_w.dtype != torch.float32:
        topk_w = topk_w.float()
    w13, w2, b13, b2 = weights
    biases = {} if b13 is None else dict(b13=b13, b2=b2)
    return layer.forward(hidden_states, ids, topk_w, w13, w2, **biases, **scales)


# ---- torch.compile: one experts call, one operator ---------------------------------------------
_OPS = torch.library.Library("moe_ep", "FRAGMENT")  # beside moe_ep.api.compiled's forward
_OPS.define("hf_experts(int module, int function, Tensor hidden_states, Tensor top_k_index, "
            "Tensor top_k_weights) -> Tensor")
_MODULES: dict[int, "weakref.ref[Any]"] = {}  # id(experts module) -> the module, weakly
_FUNCTIONS: list = []  # the eager experts functions, by the index an operator call names


def _hf_experts(module: int, function: int, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    ref = _MODULES.get(module)
    mod = ref() if ref is not None else None
    if mod is None:
        mod = _find_module(module)
    return _FUNCTIONS[function](mod, hidden_states, top_k_index, top_k_weights)


def _find_module(key: int) -> Any:
    """The live object whose ``id`` is ``key`` (the graph that names it guards on that id, so it is the
    module being called), registered weakly with every other instance of its class: a model's experts
    blocks share one, so a model costs one scan of the collector's objects, at its first compiled call."""
    import gc

    objects = gc.get_objects()  # (one list for both passes: each call walks every tracked object)
    found = next((obj for obj in objects if id(obj) == key), None)
    if found is None:
        raise RuntimeError("torch.ops.moe_ep.hf_experts: the experts module this compiled graph calls no longer "
                           "exists")
    for dead in [k for k, ref in _MODULES.items() if ref() is None]:  # modules freed since the last scan
        del _MODULES[dead]
    cls = type(found)
    for obj in objects:
        if type(obj) is cls:
            _MODULES[id(obj)] = weakref.ref(obj)
    return found


_OPS.impl("hf_experts", _hf_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("moe_ep::hf_experts", lib=_OPS)
def _hf_experts_fake(module, function, hidden_states, top_k_index, top_k_weights):
    return hidden_states.new_empty(hidden_states.shape)


def _compile_friendly(eager):
    """The registry's experts function: ``eager`` itself, or while Dynamo traces one
    ``torch.ops.moe_ep.hf_experts`` call that runs ``eager`` when the graph runs. The call names its
    module by ``id(self)``, which Dynamo folds to a constant and guards on (so a graph is never reused
    for another module); the operator finds the module by that id (:func:`_find_module`)."""
    function = len(_FUNCTIONS)
    _FUNCTIONS.append(eager)

    def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return eager(self, hidden_states, top_k_index, top_k_weights)
        _check_call(self, self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj, hidden_states)
        return torch.ops.moe_ep.hf_experts(id(self), function, hidden_states, top_k_index, top_k_weights)

    experts_forward.__name__ = experts_forward.__qualname__ = eager.__name__
    return experts_forward


def make_experts_forward(backend: str = "auto", min_tokens: int = 256, **layer_options):
    """The experts function for transformers' registry (see the module docstring).

    ``backend``: a moe_ep backend name or ``"auto"``; ``min_tokens``: smallest token capacity a
    layer is built with; ``layer_options``: more :class:`~moe_ep.api.MoELayer` keyword arguments."""

    def moe_ep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_call(self, self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj, hidden_states)
        spec = _describe(self)
        return _run(self, spec, _weights(self, spec), None, hidden_states, top_k_index, top_k_weights, backend,
                    min_tokens, layer_options)

    return _compile_friendly(moe_ep_experts_forward)


def _fp8_tensors(module: Any, spec: _Spec) -> tuple:
    """``(w13, w2, w13_scale, w2_scale)`` of transformers' ``FP8Experts`` for ``quant="fp8_block128"``:
    its e4m3 weights as they are, its block scales (``*_scale_inv``: the factor a block's values are
    multiplied by, moe_ep's convention) as float32 -- UE8M0 scales converted once into a kept copy,
    again when they change. Refuses what the format cannot express, naming it."""
    name = type(module).__name__
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise MoEEpTransformersError(f"moe_ep experts: {name} uses static activation scales "
                                     f"(activation_scheme={module.activation_scheme!r}); moe_ep quantises "
                                     "activations per 128 values of a row (dynamic)")
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (128, 128):
        raise MoEEpTransformersError(f"moe_ep experts: {name} has weight blocks {block}; moe_ep's FP8 format "
                                     "has one scale per 128 x 128 block (weight_block_size=[128, 128])")
    w13 = module.gate_up_proj if spec.gated else module.up_proj
    s13 = module.gate_up_proj_scale_inv if spec.gated else module.up_proj_scale_inv
    w2, s2 = module.down_proj, module.down_proj_scale_inv
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise MoEEpTransformersError(f"moe_ep experts: {name}'s weights are {w13.dtype}; moe_ep's FP8 format "
                                     "is float8_e4m3fn (FP4-packed experts are not supported)")
    if s13.dtype == torch.float32 and s2.dtype == torch.float32:
        return w13, w2, s13, s2
    key = tuple((t.data_ptr(), t._version) for t in (s13, s2))
    packed = module.__dict__.get(_PACKED)
    if packed is None or packed[0] != key:
        with torch.no_grad():
            packed = (key, (s13.float().contiguous(), s2.float().contiguous()))
        object.__setattr__(module, _PACKED, packed)
    return (w13, w2) + packed[1]


def make_fp8_experts_forward(backend: str = "auto", min_tokens: int = 256, **layer_options):
    """The experts function for transformers' FP8 registry (``FP8Experts``, the experts of a model
    loaded with ``FineGrainedFP8Config``, e.g. Qwen3-FP8 and DeepSeek-V3 checkpoints): a
    ``quant="fp8_block128"`` layer (``sm90_fp8_cutedsl`` on an H100/H200). Arguments as
    :func:`make_experts_forward`."""

    def moe_ep_fp8_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                   top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_call(self, self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj, hidden_states)
        spec = _describe(self)
        w13, w2, s13, s2 = _fp8_tensors(self, spec)
        return _run(self, spec, (w13, w2, None, None), "fp8_block128", hidden_states, top_k_index, top_k_weights,
                    backend, min_tokens, layer_options, w13_scale=s13, w2_scale=s2)

    return _compile_friendly(moe_ep_fp8_experts_forward)


def register(name: str = "moe_ep", backend: str = "auto", min_tokens: int = 256, **layer_options) -> str:
    """Add moe_ep to transformers' experts registries under ``name`` (the BF16 one and, where
    transformers has it, the FP8 one of ``FineGrainedFP8Config`` models); returns ``name``. Models then
    select it with ``experts_implementation=name`` (or ``model.set_experts_implementation(name)``)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("moe_ep.integrations.transformers needs transformers >= 5 with "
                          "transformers.integrations.moe (pip install 'moe_ep[transformers]')") from e
    ALL_EXPERTS_FUNCTIONS.register(name, make_experts_forward(backend, min_tokens, **layer_options))
    try:  # FP8 checkpoints (FineGrainedFP8Config): their experts dispatch through a registry of their own
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # pragma: no cover - older transformers
        return name
    ALL_FP8_EXPERTS_FUNCTIONS.register(name, make_fp8_experts_forward(backend, min_tokens, **layer_options))
    return name


def release(model: torch.nn.Module) -> int:
    """Destroy every moe_ep layer attached to ``model``'s experts modules, and drop their repacked
    weight copies; returns how many layers."""
    n = 0
    for mod in model.modules():
        mod.__dict__.pop(_PACKED, None)
        mod.__dict__.pop(_SPEC, None)
        layer = mod.__dict__.pop(_ATTR, None)
        if layer is not None:
            layer.destroy()
            n += 1
    return n
