"""Per-drop shim modules. Each declares a :class:`~moe_ep.shim.contract.DropContract`."""

from __future__ import annotations

from ..contract import DropContract
from . import sm90_megamoe


def drop_contracts() -> list[DropContract]:
    """Every drop contract the shim declares (one per vendored drop)."""
    return [sm90_megamoe.CONTRACT]
