"""The gated activations' compile-time constants as the Blackwell drops take them (sm100/w4a16 v3,
sm120/mxfp8 v2): clamped_swiglu's four, softcapped_swiglu's two, keyword arguments of each drop's
kernel class and launchers. Which of them an epilogue compiles in is the drop's own answer
(``launch.activation_constants``): the shim asks it rather than keep a copy, so a compile key cannot
miss a constant the kernel uses."""

from __future__ import annotations

from typing import Callable

#: every name, in the drops' order
NAMES = ("swiglu_alpha", "swiglu_limit", "swiglu_beta", "swiglu_limit_after_act", "gate_softcap", "up_softcap")


def epilogue_constants(drop_fn: Callable[..., dict], epilogue: str, constants: dict, where: str) -> dict:
    """The constants ``epilogue`` compiles in: the drop's ``activation_constants`` (``drop_fn``) of
    ``constants``, completed from its defaults. ``TypeError`` names an unknown one (``where``: the kernel)."""
    unknown = sorted(set(constants) - set(NAMES))
    if unknown:
        raise TypeError(f"{where}: unknown activation constant(s) {unknown}; known: {NAMES}")
    return drop_fn(epilogue=epilogue, **constants)


def check_args(defaults: dict, consts: dict) -> dict:
    """Keyword arguments of a drop's ``check_activation_constants`` (every constant but the clamp
    order) for an epilogue's ``consts``, the rest from ``defaults``."""
    full = dict(defaults, **consts)
    return {name: full[name] for name in NAMES if name != "swiglu_limit_after_act"}


def key_items(consts: dict) -> tuple:
    """``consts`` as a hashable, ordered part of a compile key."""
    return tuple(sorted(consts.items()))


__all__ = ["NAMES", "epilogue_constants", "check_args", "key_items"]
