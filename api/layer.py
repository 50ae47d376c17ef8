"""MoELayer and the dispatch/combine split pair."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import backends as _backends
from . import validation as V
from .config import MoEConfig
from .group import EPGroup


@dataclass
class DispatchHandle:
    """What :meth:`MoELayer.combine` needs to send expert outputs back; returned by dispatch.

    Attributes:
        num_tokens: T, tokens this rank dispatched.
        num_recv_rows: R, rows this rank received (``recv_x.shape[0]``); ``expert_out`` given to
            combine must be ``[R, H]`` with rows in ``recv_x``'s order.
        expert_offsets: ``[E_local + 1]`` int32 on the layer device; local expert e owns rows
            ``[expert_offsets[e], expert_offsets[e+1])`` of ``recv_x``.
        backend: name of the backend that made it; ``state`` is that backend's private data.
    """

    num_tokens: int
    num_recv_rows: int
    expert_offsets: torch.Tensor
    backend: str
    state: Any
    layer_id: int


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class MoELayer:
    """An expert-parallel MoE layer (router outside, expert MLP + token exchange inside).

    Args:
        config: :class:`MoEConfig`.
        group: :class:`EPGroup` (default: the torch.distributed default group if initialised,
            else a single process). Rank r owns global experts ``[r·E/W, (r+1)·E/W)``.
        backend: a name from ``moe_ep.backends.available()`` or ``"auto"`` (the best registered
            backend whose capability checks pass here; ``backend_name`` says which).
        device: where inputs live (default: the current CUDA device if CUDA is available, else CPU).
        check_values: check expert ids and router weights on the host before each launch (one
            host sync; skipped automatically during CUDA-graph capture). With it off, kernels
            treat an out-of-range expert id as a dropped choice (nothing is corrupted).
        timeout_s: bound on every device-side wait for a peer rank (kernel backends); a stall
            sets an error that :meth:`check_errors` raises as ``DeviceStallError``.
        deterministic: bit-identical outputs for identical inputs, whatever the timing of the
            ranks (default). ``False`` lets a backend trade that for speed (sm90: expert layout by
            two kernels with atomic row placement instead of a stable sort; experimental, outputs
            are not bit-stable).
    """

    def __init__(self, config: MoEConfig, group: EPGroup | None = None, backend: str = "auto", *,
                 device: torch.device | str | None = None, check_values: bool = True,
                 timeout_s: float = 10.0, deterministic: bool = True) -> None:
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
        self.check_values = check_values
        self.e_local = config.local_experts(group.world_size)
        spec = _backends.select(backend, config, group, device)
        self.backend_name = spec.name
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.deterministic = bool(deterministic)
        self._impl = spec.factory(config, group, device, timeout_s=float(timeout_s),
                                  deterministic=self.deterministic)
        self._warm = False

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
        """Raise if a device-side error was recorded (a peer rank stalled past ``timeout_s``:
        ``moe_ep.shim`` ``DeviceStallError`` naming that rank; receive capacity exceeded:
        ``ValueError``). Synchronises the host; forward itself never does."""
        self._alive()
        self._impl.check()

    def reset_error_state(self) -> None:
        """Collective: after an error, clear every rank's flags and counters so forwards can go on."""
        self._alive()
        self._impl.reset_error_state()

    def destroy(self) -> None:
        """Free the layer's buffers (collective for backends with symmetric memory). Idempotent."""
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
                w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """MoE expert MLP with expert parallelism.

        Args:
            x: ``[T, H]`` config.dtype, this rank's tokens (T <= max_tokens_per_rank; T may be 0).
            topk_ids: ``[T, K]`` int32 or int64, global expert ids in ``[0, E)``.
            topk_weights: ``[T, K]`` float32 router weights.
            w13: ``[E_local, 2·I, H]`` (gated activations; gate rows first) or ``[E_local, I, H]``.
            w2: ``[E_local, H, I]``.
            out: optional ``[T, H]`` config.dtype output buffer.
        Returns:
            ``[T, H]`` config.dtype: ``sum_k w[t,k] · MLP_{ids[t,k]}(x[t])`` (sum in float32).
        """
        self._alive()
        cfg = self.config
        V.check_routing(cfg, x, topk_ids, topk_weights, self.device,
                        check_values=self.check_values and not _is_capturing())
        V.check_weights(cfg, self.e_local, w13, w2, self.device)
        V.check_out(cfg, out, x.shape[0], self.device)
        return self._impl.forward(x, topk_ids, topk_weights, w13, w2, out)

    __call__ = forward

    # ---- the split pair --------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the ranks owning its experts (for engines with their own GEMMs).

        Args: ``x [T, H]``, ``topk_ids [T, K]`` int32/int64, ``topk_weights [T, K]`` float32.
        Returns:
            recv_x: ``[R, H]`` config.dtype, one row per (token, local expert) pair received by
                this rank, grouped by local expert (expert 0's rows first);
            expert_offsets: ``[E_local + 1]`` int32 (device), expert e owns ``[off[e], off[e+1])``;
            handle: :class:`DispatchHandle` for :meth:`combine`.
        """
        self._alive()
        V.check_routing(self.config, x, topk_ids, topk_weights, self.device,
                        check_values=self.check_values and not _is_capturing())
        recv_x, offsets, state = self._impl.dispatch(x, topk_ids, topk_weights)
        handle = DispatchHandle(x.shape[0], recv_x.shape[0], offsets, self.backend_name, state, id(self))
        return recv_x, offsets, handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Return expert outputs to their tokens and reduce them with the router weights.

        Args:
            expert_out: ``[R, H]`` config.dtype, row i is the expert output for ``recv_x[i]``.
            handle: from this layer's :meth:`dispatch`.
            out: optional ``[T, H]`` config.dtype.
        Returns:
            ``[T, H]`` config.dtype, ``sum_k w[t,k] · expert_out[row of (t,k)]`` in float32.
        """
        self._alive()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.layer_id != id(self) or handle.backend != self.backend_name:
            raise ValueError("handle was made by another MoELayer's dispatch")
        V.check_tensor("expert_out", expert_out, dtype=self.config.dtype,
                       shape=(handle.num_recv_rows, self.config.hidden), device=self.device)
        V.check_out(self.config, out, handle.num_tokens, self.device)
        return self._impl.combine(expert_out, handle.state, out)
