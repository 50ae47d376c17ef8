"""``MoELayer.forward`` as one opaque operator while ``torch.compile`` traces it.

Dynamo traces Python. A kernel backend's forward launches CuTeDSL kernels and keeps host state
(the workspace's sequence numbers, prepared launches), which Dynamo cannot trace: it would break
the graph there, and with ``fullgraph=True`` fail. The reference backend synchronises the host to
skip invalid choices, which breaks the graph too. So while Dynamo traces, ``MoELayer.forward``
records one call of a custom operator instead:

* ``torch.ops.moe_ep.forward(layer, x, topk_ids, topk_weights, weights, kinds, b13, b2, w13_scale,
  w2_scale) -> [T, H]`` -- a new output tensor;
* ``torch.ops.moe_ep.forward_out(..., out) -> ()`` -- the same into ``out`` (declared mutated).

``layer`` is an integer naming the ``MoELayer`` (:func:`register`); ``weights`` are the tensors of
``w13`` and then ``w2`` -- a plain tensor, or the fields of a block-scaled container in its
dataclass order -- and ``kinds`` says which (``"tensor"`` or the container's class name, one per
weight, comma-separated). The operator's implementation rebuilds the arguments and runs the layer's
own eager ``forward``, so compiled and eager calls give the same bits and the same errors. Its fake
(meta) implementation only says the output is ``[T, H]`` in ``x``'s dtype.

Eager calls never reach this module: ``forward`` pays one ``torch.compiler.is_compiling()`` check
(~70 ns on the host).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from ..backends.quant import FP8Block128Weight, MXFP8Tensor, NVFP4Weight

#: the weight containers a compiled forward can carry, by class name
CONTAINERS = {c.__name__: c for c in (FP8Block128Weight, MXFP8Tensor, NVFP4Weight)}

_LAYERS: dict[int, "weakref.ref[Any]"] = {}
_KEYS = itertools.count(1)


def register(layer: Any) -> int:
    """A key naming ``layer`` in compiled graphs (held weakly: a graph does not keep a layer alive)."""
    key = next(_KEYS)
    _LAYERS[key] = weakref.ref(layer, lambda _ref, k=key: _LAYERS.pop(k, None))
    return key


def _layer(key: int) -> Any:
    ref = _LAYERS.get(key)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"torch.ops.moe_ep.forward: MoELayer #{key}, which this compiled graph calls, no "
                           "longer exists (it was garbage-collected: keep a layer alive as long as a compiled "
                           "function that calls it)")
    return layer


def flatten_weight(w: Any) -> tuple[str, list] | None:
    """``(kind, tensors)`` of a weight argument, or None for anything else (the eager forward then
    names the bad argument)."""
    if isinstance(w, torch.Tensor):
        return "tensor", [w]
    cls = CONTAINERS.get(type(w).__name__)
    if cls is None or type(w) is not cls:
        return None
    return cls.__name__, [getattr(w, f) for f in cls.__dataclass_fields__]


def _unflatten(kinds: str, flat: list) -> list:
    out, i = [], 0
    for kind in kinds.split(","):
        if kind == "tensor":
            out.append(flat[i])
            i += 1
            continue
        cls = CONTAINERS[kind]
        n = len(cls.__dataclass_fields__)
        out.append(cls(*flat[i:i + n]))
        i += n
    return out


# A torch.library.Library operator, not torch.library.custom_op: its dispatch costs ~5 us a call on
# the host against ~14 us (`python -m moe_ep.bench.compile_host`), and a compiled graph without CUDA
# graphs pays it per layer and step.
_LIB = torch.library.Library("moe_ep", "DEF")
_ARGS = ("int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] weights, str kinds, Tensor? b13, "
         "Tensor? b2, Tensor? w13_scale, Tensor? w2_scale")
_LIB.define(f"forward({_ARGS}) -> Tensor")
_LIB.define(f"forward_out({_ARGS}, Tensor(a!) out) -> ()")


def _forward(layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: list,
             kinds: str, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor], w13_scale: Optional[torch.Tensor],
             w2_scale: Optional[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    w13, w2 = _unflatten(kinds, weights)
    return _layer(layer).forward(x, topk_ids, topk_weights, w13, w2, out, b13=b13, b2=b2, w13_scale=w13_scale,
                                 w2_scale=w2_scale)


def _forward_new(*args) -> torch.Tensor:
    y = _forward(*args)
    # an operator's output must not alias an input: an empty result is copied (free) so it cannot
    return y.clone() if y.numel() == 0 else y


def _forward_out(*args) -> None:
    _forward(*args)


_LIB.impl("forward", _forward_new, "CompositeExplicitAutograd")
_LIB.impl("forward_out", _forward_out, "CompositeExplicitAutograd")


@torch.library.register_fake("moe_ep::forward", lib=_LIB)
def _forward_fake(layer, x, topk_ids, topk_weights, weights, kinds, b13, b2, w13_scale, w2_scale):
    return x.new_empty(x.shape)  # [T, H] in x's dtype (the eager forward checks it is config.dtype)


@torch.library.register_fake("moe_ep::forward_out", lib=_LIB)
def _forward_out_fake(layer, x, topk_ids, topk_weights, weights, kinds, b13, b2, w13_scale, w2_scale, out):
    return None
