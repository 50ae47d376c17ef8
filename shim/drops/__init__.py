"""Per-drop shim modules. Each declares a :class:`~moe_ep.shim.contract.DropContract`."""

from __future__ import annotations

from ..contract import DropContract


def drop_contracts() -> list[DropContract]:
    """Every drop contract the shim declares (one per vendored drop)."""
    return []
