"""Backend registry: every MoE implementation registers a :class:`BackendSpec` by name.

``get(name)`` raises with the list of registered names for an unknown one; ``select`` checks a
backend's capabilities (arch, dtype, activation, biases, world size, shapes) and raises
:class:`UnsupportedBackendError` with the reason. There is no silent fallback: ``"auto"`` is the
documented choice of the highest-priority backend whose checks pass, and the layer reports which;
when it passes over a higher-priority backend it says why (:class:`BackendWarning`, once per
backend and reason). ``explain`` lists every backend's verdict for a configuration.
"""

from __future__ import annotations

import sys
import threading
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from moe_ep.shim import BackendWarning, RoutingValueError, UnsupportedBackendError  # defined in the lowest layer


def require_cuda_arch(name: str, device: Any, capability: tuple, need: str) -> None:
    """Refuse unless ``device`` is a CUDA GPU whose compute capability starts with ``capability``
    (``(9, 0)``: exactly SM90; ``(10,)``: any 10.x); ``need`` names it for the message."""
    import torch

    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedBackendError(f"{name} needs a CUDA device (got {device})")
    cc = torch.cuda.get_device_capability(device)
    if tuple(cc[:len(capability)]) != tuple(capability):
        raise UnsupportedBackendError(f"{name} needs {need}; this GPU is sm_{cc[0]}{cc[1]} "
                                      f"({torch.cuda.get_device_name(device)})")


class BackendImpl(ABC):
    """One MoE layer instance on one backend (created by :meth:`BackendSpec.factory`).

    Tensor contracts (``T`` tokens on this rank, ``R`` rows received by this rank):
        x ``[T, H]`` dtype; topk_ids ``[T, K]`` int32/int64; topk_weights ``[T, K]`` float32;
        w13 ``[E_local, w13_rows, H]``; w2 ``[E_local, H, I]``; out ``[T, H]`` dtype or None;
        b13 ``[E_local, w13_rows]`` and b2 ``[E_local, H]`` of ``config.bias_dtype`` when that is
        set, both None otherwise.
    Inputs arrive validated (moe_ep.api does that before any launch). A backend sees only the
    configurations its :attr:`BackendSpec.check` accepted: one that cannot run an activation or
    biases (``config.activation``, ``config.bias_dtype``) must refuse them there.
    """

    name: str = "?"

    def warmup(self, progress: Callable[[str], None]) -> None:  # noqa: B027 - optional
        """Collective: compile, allocate and run once."""

    @abstractmethod
    def forward(self, x, topk_ids, topk_weights, w13, w2, out, b13=None, b2=None):
        """``out[t] = sum_k w[t,k] · (act(x[t]·w13[e]ᵀ + b13[e])·w2[e]ᵀ + b2[e])``, ``e = ids[t,k]``
        (the layer passes ``b13``/``b2`` by keyword, None without ``config.bias_dtype``)."""

    @abstractmethod
    def dispatch(self, x, topk_ids, topk_weights) -> tuple[Any, Any, Any]:
        """-> ``(recv_x [R, H], expert_offsets [E_local+1] int32, state)``."""

    @abstractmethod
    def combine(self, expert_out, state, out): ...

    def destroy(self) -> None:  # noqa: B027 - optional
        """Free buffers (collective where they are symmetric)."""

    def check(self) -> None:  # noqa: B027 - optional
        """Raise if the device recorded an error (host sync)."""

    def reset_error_state(self) -> None:  # noqa: B027 - optional
        """Collective: clear device-side error/flag state after an error."""


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    ``check(config, group, device)`` raises :class:`UnsupportedBackendError` (with the reason) when
    the backend cannot run that configuration -- every field counts, including ``activation``,
    ``swiglu_alpha``/``swiglu_limit``/``swiglu_beta``/``swiglu_limit_after_act``, ``gate_softcap``/``up_softcap``
    and ``bias_dtype`` (a backend without biases refuses a
    config whose ``bias_dtype`` is set); ``factory(config, group, device, **options)`` builds the
    impl (options: ``timeout_s``).
    Higher ``priority`` wins under ``"auto"``. ``quant_formats``: the ``MoEConfig.quant`` values
    the backend is built for (None: any); ``"auto"`` only warns about passing over a backend built
    for the config's weight format (a BF16 layer is not told that an NVFP4 backend was skipped).
    """

    name: str
    description: str
    priority: int
    check: Callable[[Any, Any, Any], None]
    factory: Callable[..., BackendImpl]
    quant_formats: tuple | None = None

    def serves(self, config: Any) -> bool:
        """Whether the backend is built for ``config``'s weight format."""
        return self.quant_formats is None or getattr(config, "quant", None) in self.quant_formats


_LOCK = threading.Lock()
_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add a backend; a second registration under one name raises unless ``replace``."""
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"register() takes a BackendSpec, got {type(spec).__name__}")
    with _LOCK:
        if spec.name in _REGISTRY and not replace:
            raise ValueError(f"backend {spec.name!r} is already registered")
        _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    with _LOCK:
        _REGISTRY.pop(name, None)


def available() -> list[str]:
    """Names of all registered backends, best first."""
    return [s.name for s in _specs()]


def get(name: str) -> BackendSpec:
    """The backend called ``name``; ``ValueError`` naming the registered ones if unknown."""
    with _LOCK:
        spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown moe_ep backend {name!r}; available: {available()}")
    return spec


@dataclass(frozen=True)
class Verdict:
    """Whether backend ``name`` can run a configuration (``explain``): ``reason`` is the
    :class:`UnsupportedBackendError` message when ``ok`` is false, ``""`` otherwise."""

    name: str
    priority: int
    ok: bool
    reason: str = ""


def _verdict(spec: BackendSpec, config: Any, group: Any, device: Any) -> Verdict:
    try:
        spec.check(config, group, device)
    except UnsupportedBackendError as e:
        return Verdict(spec.name, spec.priority, False, str(e))
    return Verdict(spec.name, spec.priority, True)


def _specs() -> list[BackendSpec]:
    """Registered backends, best first (ties keep registration order)."""
    with _LOCK:
        return sorted(_REGISTRY.values(), key=lambda s: -s.priority)


def explain(config: Any, group: Any, device: Any) -> list[Verdict]:
    """Every registered backend, best first, with whether it can run ``config`` on ``group`` and
    ``device`` and, if not, why. ``select("auto", ...)`` takes the first ``ok`` one."""
    return [_verdict(spec, config, group, device) for spec in _specs()]


_WARNED: set[tuple[str, str]] = set()  # (passed-over backend, reason) already warned about


def reset_warnings() -> None:
    """Forget which passed-over backends ``select("auto", ...)`` has warned about (for tests)."""
    with _LOCK:
        _WARNED.clear()


def _caller_stacklevel() -> int:
    """``warnings.warn`` stacklevel (seen from the caller of this function) of the first frame
    outside moe_ep, so that the warning points at the user's code (e.g. its ``MoELayer(...)``)."""
    f, level = sys._getframe(1), 1
    while f.f_back is not None and f.f_globals.get("__name__", "").startswith("moe_ep."):
        f, level = f.f_back, level + 1
    return level


def _warn_passed_over(chosen: str, refused: list[Verdict]) -> None:
    stacklevel = _caller_stacklevel()
    for v in refused:
        key = (v.name, v.reason)
        with _LOCK:
            if key in _WARNED:
                continue
            _WARNED.add(key)
        warnings.warn(f'moe_ep backend="auto" chose {chosen!r}, passing over the higher-priority '
                      f'{v.name!r}: {v.reason}', BackendWarning, stacklevel=stacklevel)


def select(name: str, config: Any, group: Any, device: Any) -> BackendSpec:
    """Resolve ``name`` (or ``"auto"``) to a backend that supports this configuration.

    A named backend that cannot run it raises :class:`UnsupportedBackendError` (it never warns);
    ``"auto"`` takes the best backend whose checks pass, warns (:class:`BackendWarning`, once per
    distinct backend and reason in this process) about each higher-priority backend it passed
    over, and raises listing every refusal if none passes.
    """
    if name != "auto":
        spec = get(name)
        spec.check(config, group, device)
        return spec
    refused: list[Verdict] = []
    alternatives: list[Verdict] = []  # refused backends built for this weight format
    for spec in _specs():
        v = _verdict(spec, config, group, device)
        if v.ok:
            _warn_passed_over(spec.name, alternatives)
            return spec
        refused.append(v)
        if spec.serves(config):
            alternatives.append(v)
    if not refused:
        raise UnsupportedBackendError("no moe_ep backend is registered")
    raise UnsupportedBackendError("no registered backend supports this configuration: "
                                  + "; ".join(f"{v.name}: {v.reason}" for v in refused))


def routing_value_error(num_experts: int, bad_id: tuple | None, bad_weight: tuple | None) -> RoutingValueError:
    """The error every backend's ``check()`` raises for dropped choices: ``bad_id`` / ``bad_weight``
    are the first ``(token, k, value)`` of each kind (or None); ``topk_ids`` is named first."""
    parts = []
    if bad_id is not None:
        t, k, v = bad_id
        parts.append(("topk_ids", t, k, v, f"topk_ids[{t}, {k}] = {v} is outside [0, {num_experts})"))
    if bad_weight is not None:
        t, k, v = bad_weight
        parts.append(("topk_weights", t, k, v, f"topk_weights[{t}, {k}] = {v} is not finite"))
    arg, t, k, v, _ = parts[0]
    return RoutingValueError("; ".join(p[4] for p in parts) + ": that choice was dropped (it contributed "
                             "nothing); the first such choice since the last check",
                             argument=arg, token=t, k=k, value=v)
