"""The gated activations' compile-time constants as the Blackwell drops take them (sm100/w4a16 v3,
sm120/mxfp8 v2): clamped_swiglu's four, softcapped_swiglu's two, keyword arguments of each drop's
kernel class and launchers, with the drop's own defaults (mirrored by its shim)."""

from __future__ import annotations

#: every name, in the drops' order
NAMES = ("swiglu_alpha", "swiglu_limit", "swiglu_beta", "swiglu_limit_after_act", "gate_softcap", "up_softcap")
#: the names each epilogue compiles in (none for the others, so their compile keys do not vary)
BY_EPILOGUE = {"clamped_swiglu": NAMES[:4], "softcapped_swiglu": NAMES[4:]}


def epilogue_constants(epilogue: str, defaults: dict, constants: dict, where: str) -> dict:
    """The constants ``epilogue`` compiles in: ``constants`` completed from ``defaults``, typed, only
    the epilogue's own. ``TypeError`` names an unknown one (``where``: the kernel, for the message)."""
    unknown = sorted(set(constants) - set(NAMES))
    if unknown:
        raise TypeError(f"{where}: unknown activation constant(s) {unknown}; known: {NAMES}")
    full = dict(defaults, **constants)
    return {name: (bool(full[name]) if name == "swiglu_limit_after_act" else float(full[name]))
            for name in BY_EPILOGUE.get(epilogue, ())}


def check_args(defaults: dict, consts: dict) -> dict:
    """Keyword arguments of a drop's ``check_activation_constants`` (every constant but the clamp
    order) for an epilogue's ``consts``, the rest from ``defaults``."""
    full = dict(defaults, **consts)
    return {name: full[name] for name in NAMES if name != "swiglu_limit_after_act"}


def key_items(consts: dict) -> tuple:
    """``consts`` as a hashable, ordered part of a compile key."""
    return tuple(sorted(consts.items()))


__all__ = ["NAMES", "BY_EPILOGUE", "epilogue_constants", "check_args", "key_items"]
