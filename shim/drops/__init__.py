"""Per-drop shim modules. Each declares a :class:`~moe_ep.shim.contract.DropContract`."""

from __future__ import annotations

from ..contract import DropContract
from . import sm90_megamoe, sm100_w4a16, sm120_mxfp8


def drop_contracts() -> list[DropContract]:
    """Every drop contract the shim declares (one per vendored drop)."""
    return [sm90_megamoe.CONTRACT, sm100_w4a16.CONTRACT, sm120_mxfp8.CONTRACT]
