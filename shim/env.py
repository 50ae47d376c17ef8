"""Environment switches: one reading rule for every ``MOE_EP_*`` variable the shim and the backends
read (when a kernel is built or a layer bound, never in ``forward``).

Unset or empty means the switch's default. Any other value must be one the switch knows: a typo such
as ``MOE_EP_FP8_OVERLAP=off`` or ``MOE_EP_JUMP_STAGES=true`` raises a ValueError naming the variable
rather than silently keeping the default (the A/B runs in docs/PERFORMANCE.md rely on a switch
doing what it says).
"""

from __future__ import annotations

import os

#: switches (and values) whose variants a drop version removed, with why: set to anything but their
#: old default they raise, so an A/B script that still sets one learns the variant is gone rather
#: than timing the default twice (the measurements stay in docs/PERFORMANCE.md)
REMOVED = {
    "MOE_EP_FP8_FUSED_QUANT": ("0", "drop v84 removed FC1's fused quantisers (drops v39, v66): no faster on the H200"),
    "MOE_EP_FP8_FUSED_REQUANT": ("0", "drop v84 removed the requantising FC1 (drops v21, v33): 0.95x on the layer"),
    "MOE_EP_FP8_SCALE_LOOKAHEAD": ("1", "drop v84 removed the scale warp's look-ahead (drop v65): 0.96x on Mixtral's FC2"),
    "MOE_EP_GATHER_TMA": ("0", "drop v85 removed the one-TMA-per-row gathering FC1 (drop v41): FC1 0.892 vs 0.768 ms"),
    "MOE_EP_GATHER_L2": ("0", "drop v85 removed the gathering FC1's L2 priorities (drop v75): 3% slower, the layer no faster"),
    "MOE_EP_HALF_TILES": ("0", "drop v86 removed the cooperative half tiles (drop v46): the layer 4-7% slower"),
    "MOE_EP_FP8_GATHER_FC1": ("0", "drop v87 removed the gathering FP8 FC1 (drops v22 / v23): FC1 0.565 vs 0.455 ms"),
    "MOE_EP_M64_TAILS": ("0", "drop v89 removed the pingpong 64-row tails (drop v78): the layer 5-9% slower on Nemotron"),
    "MOE_EP_FP8_OVERLAP_CHUNK": ("", "drop v89 removed the FP8 GEMMs' shorter k-loop chunks (drop v82): the layer "
                                     "0.98-0.99x on Mixtral"),
    "MOE_EP_FP8_PLACE_FC2": ("0", "drop v93 removed FC2 quantising its own input rows (drop v92): the FP8 layer "
                                  "7-11% slower on the H200 and the H100"),
    "MOE_EP_PLACE_FC1": ("0", "drop v94 removed the BF16 FC1 placing its own input rows (drop v91): the layer no "
                              "faster on the H200 (five interleaved rounds), 5% slower on the H100"),
}
#: removed values of switches that remain
REMOVED_VALUES = {
    ("MOE_EP_FP8_CLUSTER", "4"): "drop v84 removed clusters of 4 (drop v49): ~4% slower, only 120 of 132 SMs take them",
    ("MOE_EP_FP8_PLACE_FC1", "quant"): "drop v93 removed FC1 quantising its own input rows (drop v92): FC1 0.59-0.78x "
                                       "the quantiser + plain FC1 at the power cap",
}


def check_removed() -> None:
    """Raise a ValueError naming the first removed switch (:data:`REMOVED`) that is set to anything but
    its old default (called where the kernels those switches chose are built)."""
    for name, (default, why) in REMOVED.items():
        raw = os.environ.get(name, "")
        if raw not in ("", default):
            raise ValueError(f"{name}={raw!r}: {why}; unset it")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Environment variable ``name`` (unset or empty: ``default``), refused with a ValueError naming it
    unless it is one of ``choices``."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw not in choices:
        why = REMOVED_VALUES.get((name, raw))
        if why is not None:
            raise ValueError(f"{name}={raw!r}: {why}; use one of {', '.join(choices)} (or unset)")
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
