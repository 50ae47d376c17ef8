"""Shim for the SM120 drop ``kernel_src/sm120/mxfp8`` (package ``sm120_mxfp8``), drop version 2.

The drop is an MXFP8 MoE GEMM for Blackwell workstation GPUs (RTX PRO 6000 class): E4M3 values
with an E8M0 scale per 32 along K for weights and activations, the warp-level block-scaled MMA
(``mma.sync ... kind::mxf8f6f4.block_scale``), swap-AB (weight rows on the MMA's M side, an
expert's tokens on N), gated (SwiGLU; drop v2: the GELU gates, clamped and softcapped SwiGLU with
their constants) / router-weight epilogues, plus a BF16 -> MXFP8 row quantiser.
What it verifies here: it compiles for sm_120a and assembles with ptxas; it has **not run on
Blackwell hardware** (none on our machines).

* :func:`check_gemm` / :func:`check_quantize` -- the drop's own ``can_implement`` reasons as ``ValueError``;
* :func:`compiled_mxfp8_gemm` / :func:`compiled_quantize_rows` -- compiled code (compile cache +
  disk cache, no GPU needed);
* :func:`mxfp8_gemm` / :func:`quantize_rows` -- caller-owned launchers;
* :func:`compile_gemm_ptx` -- PTX for tests.

Counter contract: neither kernel keeps state between launches (:data:`GEMM_COUNTERS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE
from ..constants import MirroredConstants
from ..contract import AttributeUse, CallableUse, DropContract, ImportUse
from ..launch_mode import use_tvm_ffi
from ..nvshmem_boot import CounterContract
from . import gate_constants

PKG = "sm120_mxfp8"
ARCH = "sm_120a"

CONSTANTS = MirroredConstants("sm120/mxfp8", {
    "sm120_mxfp8": {"DROP_VERSION": 2},
    "sm120_mxfp8.constants": {
        "ABI_VERSION": 1,
        "MX_BLOCK": 32,
        "EPILOGUES": ("swiglu", "row_scale", "identity", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu",
                      "softcapped_swiglu"),
        "GATED_EPILOGUES": ("swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu"),
        "ACTIVATION_CONSTANT_DEFAULTS": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0,
                                         "swiglu_limit_after_act": False, "gate_softcap": 4.0, "up_softcap": 25.0},
        "TILE_TOKENS": (8, 16, 32, 64, 128),
        "ALIGN_K": 128,
        "ALIGN_N": 8,
        "MAX_EXPERTS": 1024,
    },
})

CONTRACT = DropContract(
    arch="sm120", drop="mxfp8", version=CONSTANTS.value(PKG, "DROP_VERSION"), packages=(PKG,), constants=CONSTANTS,
    callables=(
        CallableUse("sm120_mxfp8.grouped_gemm:can_implement",
                    ("epilogue", "n", "k", "num_experts", "tile_tokens", "num_stages")),
        CallableUse("sm120_mxfp8.launch:activation_constants", ("epilogue",) + gate_constants.NAMES),
        CallableUse("sm120_mxfp8.grouped_gemm:check_activation_constants",
                    ("epilogue",) + gate_constants.NAMES[:3] + gate_constants.NAMES[4:]),
        CallableUse("sm120_mxfp8.quantize:quantize_can_implement", ("k",)),
        CallableUse("sm120_mxfp8.launch:compile_mxfp8_gemm",
                    ("epilogue", "n", "k", "num_experts", "tile_tokens", "num_stages", "arch", "extra_options",
                     "return_kernel", "tvm_ffi") + gate_constants.NAMES),
        CallableUse("sm120_mxfp8.launch:compile_quantize_rows", ("k", "arch", "extra_options", "tvm_ffi")),
        CallableUse("sm120_mxfp8.launch:CompiledMxfp8Gemm.__init__",
                    ("epilogue", "n", "k", "num_experts", "tile_tokens", "num_stages", "arch", "compiled",
                     "tvm_ffi") + gate_constants.NAMES),
        CallableUse("sm120_mxfp8.launch:CompiledMxfp8Gemm.__call__",
                    ("x", "x_scale", "w", "w_scale", "offsets", "out", "row_scale", "max_active_ctas", "stream")),
        CallableUse("sm120_mxfp8.launch:CompiledQuantizeRows.__init__", ("k", "arch", "compiled", "tvm_ffi")),
        CallableUse("sm120_mxfp8.launch:CompiledQuantizeRows.__call__", ("x", "values", "scale", "stream")),
    ),
    imports=(
        ImportUse("sm120_mxfp8.grouped_gemm", "can_implement", "shim/drops/sm120_mxfp8.py"),
        ImportUse("sm120_mxfp8.grouped_gemm", "check_activation_constants", "shim/drops/sm120_mxfp8.py"),
        ImportUse("sm120_mxfp8.quantize", "quantize_can_implement", "shim/drops/sm120_mxfp8.py"),
        ImportUse("sm120_mxfp8.launch", "CompiledMxfp8Gemm", "shim/drops/sm120_mxfp8.py"),
        ImportUse("sm120_mxfp8.launch", "CompiledQuantizeRows", "shim/drops/sm120_mxfp8.py"),
    ),
    attributes=(
        AttributeUse("sm120_mxfp8.grouped_gemm", ("can_implement", "check_activation_constants")),
        AttributeUse("sm120_mxfp8.quantize", ("quantize_can_implement",)),
        AttributeUse("sm120_mxfp8.launch", ("activation_constants", "compile_mxfp8_gemm", "compile_quantize_rows",
                                            "CompiledMxfp8Gemm", "CompiledQuantizeRows")),
        AttributeUse("sm120_mxfp8.launch:CompiledMxfp8Gemm", ("n_out", "compiled", "tvm_ffi", "__call__")),
        AttributeUse("sm120_mxfp8.launch:CompiledQuantizeRows", ("compiled", "tvm_ffi", "__call__")),
    ),
    consumers=("shim/drops/sm120_mxfp8.py",),
)

CONSTANTS.activate = CONTRACT.activate
_C = CONSTANTS.table["sm120_mxfp8.constants"]
EPILOGUES = _C["EPILOGUES"]
TILE_TOKENS = _C["TILE_TOKENS"]
GEMM_COUNTERS = CounterContract("sm120_mxfp8 grouped GEMM and row quantiser", tail_clean=True)


def _load(module: str) -> Any:
    CONTRACT.activate()
    CONSTANTS.ensure_checked()
    return importlib.import_module(module)


_cutlass_version = disk_cache.cutlass_version


def pick_tile_tokens(rows_per_expert: float) -> int:
    """Token tile for a layer expecting ``rows_per_expert`` rows per expert on average at
    capacity: the smallest tile holding twice the mean (most experts then need one tile), at most
    64 (a static choice, never a routing one)."""
    return next((t for t in TILE_TOKENS if t >= 2 * rows_per_expert and t <= 64), 64)


def activation_constants(epilogue: str, **constants: Any) -> dict:
    """The activation constants ``epilogue`` compiles in (drop v2), completed from the drop's defaults:
    clamped_swiglu's four, softcapped_swiglu's two, none for the others. ``TypeError`` names an unknown one."""
    return gate_constants.epilogue_constants(_load("sm120_mxfp8.launch").activation_constants, epilogue,
                                             constants, "sm120 MXFP8 GEMM")


def check_gemm(epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int = 16, **constants: Any) -> None:
    """Raise ``ValueError`` with the drop's reason when the GEMM cannot take these shapes or
    activation constants."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"sm120 MXFP8 GEMM: epilogue {epilogue!r} not in {EPILOGUES}")
    gemm = _load("sm120_mxfp8.grouped_gemm")
    reason = gemm.can_implement(epilogue=epilogue, n=n, k=k, num_experts=num_experts, tile_tokens=tile_tokens,
                                num_stages=None)
    if reason is None:
        consts = activation_constants(epilogue, **constants)
        reason = gemm.check_activation_constants(
            epilogue=epilogue, **gate_constants.check_args(_C["ACTIVATION_CONSTANT_DEFAULTS"], consts))
    if reason is not None:
        raise ValueError(f"sm120 MXFP8 GEMM: {reason}")


def check_quantize(k: int) -> None:
    reason = _load("sm120_mxfp8.quantize").quantize_can_implement(k=k)
    if reason is not None:
        raise ValueError(f"sm120 MXFP8 row quantiser: {reason}")


@dataclass(frozen=True)
class Mxfp8Key:
    """Every value a compiled kernel of this drop depends on (``kind``: gemm or quantize; ``activation``:
    the epilogue's activation constants as sorted (name, value) pairs, empty where it has none)."""

    drop_version: int
    abi_version: int
    cutlass_version: str
    arch: str
    kind: str
    epilogue: str
    n: int
    k: int
    num_experts: int
    tile_tokens: int
    tvm_ffi: bool
    activation: tuple = ()


def cache_namespace() -> str:
    """Disk-cache folder of this drop's kernels (see :func:`disk_cache.drop_namespace`)."""
    return disk_cache.drop_namespace("sm120", "mxfp8", CONSTANTS.value(PKG, "DROP_VERSION"), ARCH)


def _key(kind: str, epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int,
         consts: dict | None = None) -> Mxfp8Key:
    return Mxfp8Key(CONSTANTS.value(PKG, "DROP_VERSION"), _C["ABI_VERSION"], _cutlass_version(), ARCH, kind,
                    epilogue, n, k, num_experts, tile_tokens, use_tvm_ffi(), gate_constants.key_items(consts or {}))


def compiled_mxfp8_gemm(epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int = 16,
                        **constants: Any) -> Any:
    """Compiled code of the MXFP8 grouped GEMM (compile cache + disk cache; no GPU needed);
    ``constants``: the activation constants (:func:`activation_constants`)."""
    check_gemm(epilogue, n, k, num_experts, tile_tokens, **constants)
    consts = activation_constants(epilogue, **constants)
    key = _key("gemm", epilogue, n, k, num_experts, tile_tokens, consts)
    return COMPILE_CACHE.get_or_compile(key, lambda: build_mxfp8_kernel(key))


def build_mxfp8_kernel(key: Mxfp8Key) -> Any:
    """The compiled GEMM or row quantiser (``key.kind``) of ``key`` from the disk cache, else compiled
    and stored: the compile step of :func:`compiled_mxfp8_gemm` / :func:`compiled_quantize_rows` and
    of a cache rebuilt from a manifest (``kernel_replay``)."""
    launch = _load("sm120_mxfp8.launch")
    if key.kind == "quantize":
        return disk_cache.get_or_build(
            cache_namespace(), "mxfp8_quantize_rows", key,
            lambda: launch.compile_quantize_rows(k=key.k, arch=ARCH, extra_options="", tvm_ffi=key.tvm_ffi),
            tvm_ffi=key.tvm_ffi)
    return disk_cache.get_or_build(
        cache_namespace(), f"mxfp8_{key.epilogue}", key,
        lambda: launch.compile_mxfp8_gemm(epilogue=key.epilogue, n=key.n, k=key.k, num_experts=key.num_experts,
                                          tile_tokens=key.tile_tokens, num_stages=None, arch=ARCH,
                                          extra_options="", return_kernel=False, tvm_ffi=key.tvm_ffi,
                                          **dict(key.activation)),
        tvm_ffi=key.tvm_ffi)


def compiled_quantize_rows(k: int) -> Any:
    """Compiled code of the BF16 -> MXFP8 row quantiser for rows of ``k`` values."""
    check_quantize(k)
    key = _key("quantize", "", 0, k, 0, 0)
    return COMPILE_CACHE.get_or_compile(key, lambda: build_mxfp8_kernel(key))


def mxfp8_gemm(epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int = 16, **constants: Any) -> Any:
    """A caller-owned launcher: ``gemm(x [M, k] e4m3, x_scale [M, k/32] e8m0, w [E, n, k] e4m3,
    w_scale [E, n, k/32] e8m0, offsets [E+1] i32, out=[M, n_out] bf16, row_scale=[M] f32)``."""
    compiled = compiled_mxfp8_gemm(epilogue, n, k, num_experts, tile_tokens, **constants)
    return _load("sm120_mxfp8.launch").CompiledMxfp8Gemm(
        epilogue=epilogue, n=n, k=k, num_experts=num_experts, tile_tokens=tile_tokens, num_stages=None,
        arch=ARCH, compiled=compiled, tvm_ffi=use_tvm_ffi(), **activation_constants(epilogue, **constants))


def quantize_rows(k: int) -> Any:
    """A caller-owned row quantiser: ``q(x [M, k] bf16, values=[M, k] e4m3, scale=[M, k/32] e8m0)``."""
    compiled = compiled_quantize_rows(k)
    return _load("sm120_mxfp8.launch").CompiledQuantizeRows(k=k, arch=ARCH, compiled=compiled,
                                                            tvm_ffi=use_tvm_ffi())


def compile_gemm_ptx(epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int = 16,
                     **constants: Any) -> str:
    """Compile for sm_120a without a GPU and return the PTX."""
    check_gemm(epilogue, n, k, num_experts, tile_tokens, **constants)
    launch = _load("sm120_mxfp8.launch")
    compiled = launch.compile_mxfp8_gemm(epilogue=epilogue, n=n, k=k, num_experts=num_experts,
                                         tile_tokens=tile_tokens, num_stages=None, arch=ARCH,
                                         extra_options="--keep-ptx", return_kernel=False, tvm_ffi=False,
                                         **activation_constants(epilogue, **constants))
    return compiled.__ptx__
