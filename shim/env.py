"""Environment switches: one reading rule for every ``MOE_EP_*`` variable the shim and the backends
read (when a kernel is built or a layer bound, never in ``forward``).

Unset or empty means the switch's default. Any other value must be one the switch knows: a typo such
as ``MOE_EP_FP8_OVERLAP=off`` or ``MOE_EP_M64_TAILS=true`` raises a ValueError naming the variable
rather than silently keeping the default (the A/B runs in docs/PERFORMANCE.md rely on a switch
doing what it says).
"""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Environment variable ``name`` (unset or empty: ``default``), refused with a ValueError naming it
    unless it is one of ``choices``."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (or unset), got {raw!r}")
    return raw


def env_flag(name: str, default: bool) -> bool:
    """An on/off switch: ``1`` on, ``0`` off, unset or empty ``default``; anything else raises."""
    return env_choice(name, ("0", "1"), "1" if default else "0") == "1"


def env_forced(name: str) -> bool | None:
    """A switch that overrides an automatic choice: ``1`` forces it on, ``0`` off, unset or empty
    leaves it to the caller (None); anything else raises."""
    raw = env_choice(name, ("0", "1"), "")
    return None if raw == "" else raw == "1"
