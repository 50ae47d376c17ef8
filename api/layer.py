"""MoELayer and the dispatch/combine split pair."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace as dc_replace
from typing import Any, Callable

import torch

from .. import backends as _backends
from . import compiled as _compiled
from . import validation as V
from .config import MoEConfig
from .group import EPGroup


@dataclass
class DispatchHandle:
    """What :meth:`MoELayer.combine` needs to send expert outputs back; returned by dispatch.

    Valid until the next ``dispatch``/``forward`` of ANY layer sharing this layer's workspace
    (kernel backends: all layers of one EP group and device); ``combine`` with an older handle
    raises :class:`~moe_ep.api.StaleHandleError`.

    Attributes:
        num_tokens: T, tokens this rank dispatched.
        num_recv_rows: rows of the ``recv_x`` that dispatch returned (kernel backends: the
            capacity W·T_max·K, of which the first ``expert_offsets[-1]`` are valid); the
            ``expert_out`` given to combine must be ``[num_recv_rows, H]``, rows in ``recv_x``'s
            order.
        expert_offsets: ``[E_local + 1]`` int32 on the layer device; local expert e owns rows
            ``[expert_offsets[e], expert_offsets[e+1])`` of ``recv_x``.
        backend: name of the backend that made it; ``state`` is that backend's private data.
        epoch: the layer's dispatch count when it was made.
    """

    num_tokens: int
    num_recv_rows: int
    expert_offsets: torch.Tensor
    backend: str
    state: Any
    layer_id: int
    epoch: int = 0


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _inference_only(**tensors: Any) -> tuple[Any, ...]:
    """The arguments, detached: the kernels have no backward, so autograd is refused by name (with
    grad enabled) and parameters that merely require grad (``nn.Parameter`` under
    ``torch.no_grad()``) are passed as plain views (DLPack refuses tensors that require grad). A
    quantised weight container (a dataclass of tensors, e.g. ``FP8Block128Weight``) is rebuilt
    from its detached fields."""
    grad_on = torch.is_grad_enabled()

    def plain(name: str, t: torch.Tensor) -> torch.Tensor:
        if grad_on:
            raise RuntimeError(f"MoELayer has no backward: {name} requires grad; call it under "
                               "torch.no_grad() / torch.inference_mode() (training is not supported)")
        return t.detach()

    out = []
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            t = plain(name, t) if t.requires_grad else t
        elif _tracks_grad(t):  # a container: rebuilt with its grad-tracking fields detached
            t = dc_replace(t, **{k: plain(f"{name}.{k}", v) for k, v in _tensor_fields(t).items() if v.requires_grad})
        out.append(t)
    return tuple(out)


def _tracks_grad(*args: Any) -> bool:
    """Whether any argument is a tensor that requires grad, or a weight container (dataclass)
    holding one (then :func:`_inference_only` runs)."""
    for t in args:
        if isinstance(t, torch.Tensor):
            if t.requires_grad:
                return True
        elif t is not None and any(v.requires_grad for v in _tensor_fields(t).values()):
            return True
    return False


def _tensor_fields(obj: Any) -> dict:
    """A dataclass instance's tensor fields by name (a weight container's); {} for anything else."""
    names = getattr(obj, "__dataclass_fields__", None)  # (dataclasses.fields is ~1 us a call here)
    if names is None or isinstance(obj, type):
        return {}
    return {k: v for k in names if isinstance(v := getattr(obj, k), torch.Tensor)}


class MoELayer:
    """An expert-parallel MoE layer (router outside, expert MLP + token exchange inside).

    Args:
        config: :class:`MoEConfig`.
        group: :class:`EPGroup` (default: the torch.distributed default group if initialised,
            else a single process). Rank r owns global experts ``[r·E/W, (r+1)·E/W)``.
        backend: a name from ``moe_ep.backends.available()`` or ``"auto"`` (the best registered
            backend whose capability checks pass here; ``backend_name`` says which).
        device: where inputs live (default: the current CUDA device if CUDA is available, else CPU).
        check_values: debugging aid, off by default: check expert ids and router weights on the
            host before each launch (one host sync per call; skipped during CUDA-graph capture).
            Without it the kernels check them: a choice whose expert id is outside ``[0, E)`` or
            whose router weight is not finite is dropped (it contributes nothing; never wrapped,
            never read or written out of bounds) and :meth:`check_errors` raises
            :class:`~moe_ep.api.RoutingValueError` naming the first one.
        timeout_s: bound on every device-side wait for a peer rank (kernel backends); a stall
            sets an error that :meth:`check_errors` raises as :class:`~moe_ep.api.DeviceStallError`.

    Outputs are bit-identical for identical inputs, whatever the timing of the ranks (no float
    atomics; every sum has a fixed order).
    """

    def __init__(self, config: MoEConfig, group: EPGroup | None = None, backend: str = "auto", *,
                 device: torch.device | str | None = None, check_values: bool = False,
                 timeout_s: float = 10.0) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if group is None:
            group = EPGroup.default()
        if not isinstance(group, EPGroup):
            raise TypeError(f"group must be an EPGroup, got {type(group).__name__}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.group = group
        self.device = device
        self.check_values = bool(check_values)
        self.e_local = config.local_experts(group.world_size)
        self._check = V.ForwardCheck(config, self.e_local, device)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        spec = _backends.select(backend, config, group, device)
        self.backend_name = spec.name
        self._impl = spec.factory(config, group, device, timeout_s=float(timeout_s))
        self._warm = False
        self._epoch = 0  # dispatch/forward calls of this layer (handles remember theirs)
        self._op_key = _compiled.register(self)  # names this layer in torch.compile'd graphs

    # ---- lifecycle -------------------------------------------------------------------------
    def warmup(self, progress: bool | Callable[[str], None] = True) -> "MoELayer":
        """Collective on the group: compile kernels, allocate buffers, run once. Call it before
        capturing a CUDA graph (nothing compiles or allocates during capture)."""
        self._alive()
        if callable(progress):
            say = progress
        elif progress:
            t0 = time.perf_counter()

            def say(msg: str) -> None:
                print(f"[moe_ep rank {self.group.rank}/{self.group.world_size} {self.backend_name} "
                      f"+{time.perf_counter() - t0:.1f}s] {msg}", file=sys.stderr, flush=True)
        else:
            def say(msg: str) -> None:
                pass
        say("warmup: start")
        self._impl.warmup(say)
        self._warm = True
        say("warmup: done")
        return self

    def check_errors(self) -> None:
        """Raise what the device recorded since the last check. Synchronises the host (forward,
        dispatch and combine never do), so call it when it is cheap, e.g. once per step:

        * :class:`~moe_ep.api.DeviceStallError` -- a peer rank did not arrive within
          ``timeout_s`` (``.rank`` names it); every layer of the group stops until
          :meth:`reset_error_state` (collective);
        * :class:`~moe_ep.api.CapacityError` -- more tokens than ``max_tokens_per_rank``;
        * :class:`~moe_ep.api.RoutingValueError` (a ``ValueError``) -- an expert id outside
          ``[0, E)`` or a non-finite router weight was dropped; names ``topk_ids`` or
          ``topk_weights``, the token, k and the value (``.argument``, ``.token``, ``.k``,
          ``.value``). Reported once; the layer keeps working.
        """
        self._alive()
        self._impl.check()

    def reset_error_state(self) -> None:
        """Collective: after an error, clear every rank's flags and counters so forwards can go on."""
        self._alive()
        self._impl.reset_error_state()

    def destroy(self) -> None:
        """Release the layer's buffers (collective for backends with symmetric memory; the last
        layer of a shared workspace frees it). Idempotent."""
        if self._impl is not None:
            self._impl.destroy()
            self._impl = None

    def __enter__(self) -> "MoELayer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _alive(self) -> None:
        if self._impl is None:
            raise RuntimeError("this MoELayer was destroyed")

    # ---- the fused forward -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None, *,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
        """MoE expert MLP with expert parallelism.

        Args:
            x: ``[T, H]`` config.dtype, this rank's tokens (T <= max_tokens_per_rank; T may be 0).
            topk_ids: ``[T, K]`` int32 or int64, global expert ids in ``[0, E)``.
            topk_weights: ``[T, K]`` float32 router weights.
            w13: ``[E_local, 2·I, H]`` (gated activations; gate rows first) or ``[E_local, I, H]``;
                with ``config.quant`` the block-scaled container of that logical shape
                (:mod:`moe_ep.api.quant`; the same for ``w2``).
            w2: ``[E_local, H, I]``.
            out: optional ``[T, H]`` config.dtype output buffer; without it the output is the
                forward's one allocation.
            b13: per-expert FC1 bias ``[E_local, w13_rows]`` (``w13_rows`` = 2·I for the gated
                activations, gate entries first, else I), dtype exactly ``config.bias_dtype``,
                contiguous, on the layer's device. Required when ``config.bias_dtype`` is set,
                refused (``ValueError``) when it is None.
            b2: per-expert FC2 bias ``[E_local, H]``, same rules as ``b13``.
            w13_scale, w2_scale: with ``config.quant="fp8_block128"`` and ``torch.float8_e4m3fn``
                weights: float32 ``[E_local, ceil(w13_rows/128), ceil(H/128)]`` and
                ``[E_local, ceil(H/128), ceil(I/128)]`` (one per 128x128 block); refused otherwise.
        Returns:
            ``[T, H]`` config.dtype: ``sum_k w[t,k] · MLP_{ids[t,k]}(x[t])`` (sum in float32)
            over the valid choices (see ``check_values``), where ``MLP_e(x) =
            act(x·w13[e]ᵀ + b13[e])·w2[e]ᵀ + b2[e]`` (biases only with ``config.bias_dtype``;
            added in float32, FC1's before the activation, FC2's before the router weight).

        Kernel backends neither synchronise the host nor allocate (with ``out``), so forward can
        be called back to back and captured in a CUDA graph after :meth:`warmup`. Under
        ``torch.compile`` (``fullgraph=True`` too) a forward is one opaque operator,
        ``torch.ops.moe_ep.forward`` (:mod:`moe_ep.api.compiled`), which runs this eager forward.
        """
        self._alive()
        if _tracks_grad(x, topk_weights, w13, w2, b13, b2, w13_scale, w2_scale):
            x, topk_weights, w13, w2, b13, b2, w13_scale, w2_scale = _inference_only(
                x=x, topk_weights=topk_weights, w13=w13, w2=w2, b13=b13, b2=b2, w13_scale=w13_scale,
                w2_scale=w2_scale)
        if torch.compiler.is_compiling():  # Dynamo is tracing: record one operator call instead
            return self._traced_forward(x, topk_ids, topk_weights, w13, w2, out, b13, b2, w13_scale, w2_scale)
        cfg = self.config
        # the common case passes one conjunction of checks; anything else (or check_values) runs the
        # checks that name the bad argument
        packed = None if self.check_values else self._check.args(x, topk_ids, topk_weights, w13, w2, out, b13, b2,
                                                                  w13_scale, w2_scale)
        if packed is not None:
            w13, w2 = packed
        else:
            V.check_routing(cfg, x, topk_ids, topk_weights, self.device,
                            check_values=self.check_values and not _is_capturing())
            w13, w2 = V.pack_fp8_block128(cfg, w13, w2, w13_scale, w2_scale)
            V.check_weights(cfg, self.e_local, w13, w2, self.device)
            V.check_biases(cfg, self.e_local, b13, b2, self.device)
            V.check_out(cfg, out, x.shape[0], self.device)
        self._epoch += 1
        return self._impl.forward(x, topk_ids, topk_weights, w13, w2, out, b13=b13, b2=b2)

    __call__ = forward

    def _traced_forward(self, x, topk_ids, topk_weights, w13, w2, out, b13, b2, w13_scale, w2_scale):
        """``forward`` while torch.compile traces it: one call of ``torch.ops.moe_ep.forward`` (or
        ``forward_out``), whose implementation is the eager forward. Arguments it cannot carry
        (not tensors, an unknown weight type) go to the eager forward behind a graph break, which
        raises the same error an eager call does. (``forward`` has checked the layer and detached
        the arguments, as for an eager call.)"""
        f13, f2 = _compiled.flatten_weight(w13), _compiled.flatten_weight(w2)
        tensors = all(isinstance(t, torch.Tensor) for t in (x, topk_ids, topk_weights)) and all(
            t is None or isinstance(t, torch.Tensor) for t in (out, b13, b2, w13_scale, w2_scale))
        if f13 is None or f2 is None or not tensors:
            return _eager("forward", self, x, topk_ids, topk_weights, w13, w2, out, b13=b13, b2=b2,
                          w13_scale=w13_scale, w2_scale=w2_scale)
        args = (self._op_key, x, topk_ids, topk_weights, f13[1] + f2[1], f"{f13[0]},{f2[0]}", b13, b2,
                w13_scale, w2_scale)
        if out is None:
            return torch.ops.moe_ep.forward(*args)
        torch.ops.moe_ep.forward_out(*args, out)
        return out

    # ---- the split pair --------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the ranks owning its experts (for engines with their own GEMMs).

        Args: ``x [T, H]``, ``topk_ids [T, K]`` int32/int64, ``topk_weights [T, K]`` float32.
        Returns:
            recv_x: ``[R, H]`` config.dtype, one row per valid (token, local expert) pair
                received by this rank, grouped by local expert (expert 0's rows first). Kernel
                backends return their fixed-capacity buffer (R = W·T_max·K, no host sync): rows
                at and beyond ``expert_offsets[-1]`` are padding with unspecified content;
            expert_offsets: ``[E_local + 1]`` int32 (device), expert e owns ``[off[e], off[e+1])``;
            handle: :class:`DispatchHandle` for :meth:`combine`.
        ``recv_x`` and ``expert_offsets`` are the layer's (workspace's) buffers: valid until the
        next ``dispatch``/``forward`` on the workspace, like the handle. A quantised layer returns
        the received rows unquantised too (``config.dtype``); ``sm90_fp8_cutedsl`` with
        ``MOE_EP_FP8_WIRE=1`` (rows cross as E4M3) raises :class:`UnsupportedBackendError`.
        """
        if torch.compiler.is_compiling():  # a graph break: the handle is host state
            return _eager("dispatch", self, x, topk_ids, topk_weights)
        self._alive()
        if _tracks_grad(x, topk_weights):
            x, topk_weights = _inference_only(x=x, topk_weights=topk_weights)
        if self.check_values or not self._check.routing(x, topk_ids, topk_weights):
            V.check_routing(self.config, x, topk_ids, topk_weights, self.device,
                            check_values=self.check_values and not _is_capturing())
        self._epoch += 1
        recv_x, offsets, state = self._impl.dispatch(x, topk_ids, topk_weights)
        handle = DispatchHandle(x.shape[0], recv_x.shape[0], offsets, self.backend_name, state, id(self),
                                self._epoch)
        return recv_x, offsets, handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Return expert outputs to their tokens and reduce them with the router weights.

        Args:
            expert_out: ``[handle.num_recv_rows, H]`` config.dtype, row i is the expert output
                for ``recv_x[i]`` (padding rows are never read).
            handle: from this layer's latest :meth:`dispatch` (an older one raises
                :class:`~moe_ep.api.StaleHandleError`).
            out: optional ``[T, H]`` config.dtype.
        Returns:
            ``[T, H]`` config.dtype, ``sum_k w[t,k] · expert_out[row of (t,k)]`` in float32.
        """
        if torch.compiler.is_compiling():  # a graph break, as for dispatch
            return _eager("combine", self, expert_out, handle, out)
        self._alive()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.layer_id != id(self) or handle.backend != self.backend_name:
            raise ValueError("handle was made by another MoELayer's dispatch")
        if handle.epoch != self._epoch:
            raise _backends.StaleHandleError(
                f"handle is stale: it comes from this layer's dispatch #{handle.epoch}, but the layer has "
                f"run {self._epoch - handle.epoch} dispatch/forward call(s) since, which overwrote its "
                "buffers; combine the latest dispatch")
        if _tracks_grad(expert_out):
            (expert_out,) = _inference_only(expert_out=expert_out)
        V.check_tensor("expert_out", expert_out, dtype=self.config.dtype,
                       shape=(handle.num_recv_rows, self.config.hidden), device=self.device)
        V.check_out(self.config, out, handle.num_tokens, self.device)
        return self._impl.combine(expert_out, handle.state, out)

    # ---- sizing ----------------------------------------------------------------------------
    @staticmethod
    def workspace_bytes(config: MoEConfig, world_size: int = 1, backend: str = "sm90_bf16_cutedsl") -> int:
        """Device bytes per rank of the workspace a layer of ``config`` needs on ``backend``
        (layers of one group and device share one workspace sized for the largest of them: 48
        Qwen3 layers need one layer's bytes). The formula is in
        ``moe_ep.backends.sm90.bf16_cutedsl.workspace.workspace_bytes``."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        return _backends.workspace_bytes(backend, config, int(world_size))


_EAGER: dict = {}


def _eager(method: str, layer: MoELayer, *args, **kwargs):
    """Under torch.compile: ``layer.method(*args, **kwargs)`` run eagerly behind a graph break
    (``torch.compiler.disable``). The wrappers are made on first use, inside a trace: making them at
    import would import torch._dynamo (~0.9 s) into every process, compiling or not."""
    fn = _EAGER.get(method)
    if fn is None:
        fn = _EAGER[method] = torch.compiler.disable(getattr(MoELayer, method))
    return fn(layer, *args, **kwargs)
