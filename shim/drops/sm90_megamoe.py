"""Shim for the SM90 drop ``kernel_src/sm90/megamoe`` (package ``sm90_megamoe``).

What moe_ep relies on, declared as data (:data:`CONTRACT`), plus thin wrappers:

* :func:`check_gemm_shapes` — validation with clear errors before anything compiles;
* :func:`grouped_gemm` — the compiled varlen-M grouped GEMM from :data:`COMPILE_CACHE`, keyed by
  every contract-relevant value (never by routing: M_total and expert offsets are runtime);
* :func:`compile_gemm_ptx` — compile for an arch without a GPU (CPU tests inspect the PTX).

Counter contract: the grouped GEMM keeps no state between launches (its tile scheduler reads the
device-side offsets afresh every launch), so there is nothing to zero.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..cache import COMPILE_CACHE
from ..constants import MirroredConstants
from ..contract import CallableUse, DropContract, ImportUse

PKG = "sm90_megamoe"

CONSTANTS = MirroredConstants("sm90/megamoe", {
    "sm90_megamoe": {"DROP_VERSION": 1},
    "sm90_megamoe.constants": {
        "ABI_VERSION": 1,
        "ACTIVATIONS": ("identity", "swiglu", "squared_relu"),
        "ALIGN_K_ELEMS": 8,
        "ALIGN_N_ELEMS": 8,
        "DEFAULT_TILE_N": {"identity": 256, "squared_relu": 256, "swiglu": 128},
        "MAX_EXPERTS": 1024,
    },
})

CONTRACT = DropContract(
    arch="sm90", drop="megamoe", version=1, packages=(PKG,), constants=CONSTANTS,
    callables=(
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.__init__",
                    ("activation", "n", "k", "num_experts", "scale_rows", "tile_n")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.__call__",
                    ("a", "b", "offsets", "out", "row_scale")),
        CallableUse("sm90_megamoe.compile_check:compile_for_arch",
                    ("activation", "n", "k", "scale_rows", "arch", "num_experts", "tile_n")),
    ),
    imports=(
        ImportUse("sm90_megamoe.launch", "CompiledGroupedGemm", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.compile_check", "compile_for_arch", "shim/drops/sm90_megamoe.py"),
    ),
    consumers=("shim/drops/sm90_megamoe.py",),
)

CONSTANTS.activate = CONTRACT.activate

# mirrored values the validation below uses (checked against the drop at first compile)
_C = CONSTANTS.table["sm90_megamoe.constants"]
GEMM_ACTIVATIONS = _C["ACTIVATIONS"]


def _load(module: str) -> Any:
    CONTRACT.activate()
    CONSTANTS.ensure_checked()
    return importlib.import_module(module)


def check_gemm_shapes(activation: str, n: int, k: int, num_experts: int, tile_n: int | None = None) -> None:
    """Raise ``ValueError`` when the SM90 grouped GEMM cannot take these static shapes.

    ``n`` = rows of the weight (2·I for swiglu), ``k`` = reduction size.
    """
    if activation not in GEMM_ACTIVATIONS:
        raise ValueError(f"sm90 grouped GEMM: activation {activation!r} not in {GEMM_ACTIVATIONS}")
    if k % _C["ALIGN_K_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: K={k} must be a multiple of {_C['ALIGN_K_ELEMS']} (16-byte TMA rows)")
    if num_experts > _C["MAX_EXPERTS"]:
        raise ValueError(f"sm90 grouped GEMM: {num_experts} experts per launch, at most {_C['MAX_EXPERTS']}")
    tile = tile_n or _C["DEFAULT_TILE_N"][activation]
    if activation == "swiglu":
        if n % 2:
            raise ValueError(f"sm90 grouped GEMM: swiglu needs an even w13 row count (2·I), got {n}")
        if (n // 2) % tile:
            raise ValueError(f"sm90 grouped GEMM: swiglu needs intermediate I={n // 2} to be a multiple of "
                             f"the output tile {tile} (gate and up tiles meet in one CTA)")
    elif n % _C["ALIGN_N_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: N={n} must be a multiple of {_C['ALIGN_N_ELEMS']}")


@dataclass(frozen=True)
class GemmKey:
    """Every value the compiled grouped GEMM depends on."""

    drop_version: int
    abi_version: int
    cutlass_version: str
    arch: str
    dtype: str
    activation: str
    n: int
    k: int
    num_experts: int
    scale_rows: bool
    tile_n: int


def _cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover
        return "unknown"


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 tile_n: int | None = None) -> Any:
    """The compiled grouped GEMM (cached). Call it as ``fn(a, b, offsets, out=..., row_scale=...)``:

    a ``[M_total, k]`` bf16, b ``[num_experts, n, k]`` bf16, offsets ``[num_experts+1]`` int32
    (device), out ``[M_total, n_out]`` bf16 (``n_out`` = n/2 for swiglu), row_scale ``[M_total]``
    float32 when ``scale_rows``.
    """
    check_gemm_shapes(activation, n, k, num_experts, tile_n)
    tile = tile_n or _C["DEFAULT_TILE_N"][activation]
    key = GemmKey(CONSTANTS.value(PKG, "DROP_VERSION"), _C["ABI_VERSION"], _cutlass_version(), "sm_90a",
                  "bf16", activation, n, k, num_experts, bool(scale_rows), tile)

    def build():
        launch = _load("sm90_megamoe.launch")
        return launch.CompiledGroupedGemm(activation=activation, n=n, k=k, num_experts=num_experts,
                                          scale_rows=bool(scale_rows), tile_n=tile)

    return COMPILE_CACHE.get_or_compile(key, build)


def compile_gemm_ptx(activation: str, n: int, k: int, scale_rows: bool, arch: str = "sm_90a",
                     num_experts: int = 128) -> str:
    """Compile without a GPU (fake tensors, dynamic M_total) and return the PTX text."""
    check_gemm_shapes(activation, n, k, num_experts)
    cc = _load("sm90_megamoe.compile_check")
    compiled = cc.compile_for_arch(activation=activation, n=n, k=k, scale_rows=scale_rows, arch=arch,
                                   num_experts=num_experts, tile_n=None)
    return compiled.__ptx__
