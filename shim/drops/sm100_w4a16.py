"""Shim for the SM100 drop ``kernel_src/sm100/w4a16`` (package ``sm100_w4a16``), drop version 4.

The drop is a W4A16 grouped GEMM for Blackwell datacenter GPUs (B200/GB200): NVFP4 expert weights
(E2M1 values, an E4M3 scale per 16 along K, a float32 scale per expert) dequantised to BF16 in
shared memory, BF16 activations, tcgen05 UMMA with TMEM accumulators, device-side expert offsets.
What it verifies here: it compiles for sm_100a and assembles with ptxas; it has **not run on
Blackwell hardware** (none on our machines).

* :func:`check_gemm` -- the drop's own ``can_implement`` reason, raised as ``ValueError``;
* :func:`compiled_w4a16_gemm` -- the compiled code (compile cache + disk cache, no GPU needed);
* :func:`w4a16_gemm` -- a caller-owned launcher (``CompiledW4A16Gemm``: validates metadata, no sync);
* :func:`compile_gemm_ptx` -- PTX for tests.

Counter contract: the GEMM keeps no state between launches (:data:`GEMM_COUNTERS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE
from ..constants import MirroredConstants
from ..contract import AttributeUse, CallableUse, DropContract, ImportUse
from ..nvshmem_boot import CounterContract
from . import gate_constants

PKG = "sm100_w4a16"
ARCH = "sm_100a"

#: the activation constants the shim passes by keyword (drop v3), in the drop's order
_ACT_NAMES = gate_constants.NAMES

CONSTANTS = MirroredConstants("sm100/w4a16", {
    "sm100_w4a16": {"DROP_VERSION": 4},
    "sm100_w4a16.constants": {
        "ABI_VERSION": 2,
        "BIAS_DTYPES": ("float32", "bfloat16"),
        "EPILOGUES": ("identity", "squared_relu", "row_scale", "swiglu", "gelu_glu", "gelu_tanh_glu",
                      "clamped_swiglu", "softcapped_swiglu"),
        "GATED_EPILOGUES": ("swiglu", "gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu"),
        "ACTIVATION_CONSTANT_DEFAULTS": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0,
                                         "swiglu_limit_after_act": False, "gate_softcap": 4.0, "up_softcap": 25.0},
        "SF_BLOCK": 16,
        "TILE_K": 64,
        "ALIGN_K_ELEMS": 64,
        "ALIGN_N_ELEMS": 8,
        "MAX_EXPERTS": 1024,
    },
})

CONTRACT = DropContract(
    arch="sm100", drop="w4a16", version=CONSTANTS.value(PKG, "DROP_VERSION"), packages=(PKG,), constants=CONSTANTS,
    callables=(
        CallableUse("sm100_w4a16.grouped_gemm:can_implement", ("epilogue", "n", "k", "num_experts", "tile_n")),
        CallableUse("sm100_w4a16.launch:activation_constants", ("epilogue",) + gate_constants.NAMES),
        CallableUse("sm100_w4a16.grouped_gemm:check_activation_constants",
                    ("epilogue",) + _ACT_NAMES[:3] + _ACT_NAMES[4:]),
        CallableUse("sm100_w4a16.launch:compile_w4a16_gemm",
                    ("epilogue", "n", "k", "num_experts", "tile_n", "raster_m", "num_stages", "arch",
                     "extra_options", "bias_dtype") + _ACT_NAMES),
        CallableUse("sm100_w4a16.launch:CompiledW4A16Gemm.__init__",
                    ("epilogue", "n", "k", "num_experts", "tile_n", "raster_m", "num_stages", "arch",
                     "compiled", "bias_dtype") + _ACT_NAMES),
        CallableUse("sm100_w4a16.launch:CompiledW4A16Gemm.__call__",
                    ("a", "values", "block_scale", "global_scale", "offsets", "row_scale", "out",
                     "max_active_ctas", "stream", "bias")),
    ),
    imports=(
        ImportUse("sm100_w4a16.grouped_gemm", "can_implement", "shim/drops/sm100_w4a16.py"),
        ImportUse("sm100_w4a16.grouped_gemm", "check_activation_constants", "shim/drops/sm100_w4a16.py"),
        ImportUse("sm100_w4a16.launch", "CompiledW4A16Gemm", "shim/drops/sm100_w4a16.py"),
        ImportUse("sm100_w4a16.launch", "compile_w4a16_gemm", "shim/drops/sm100_w4a16.py"),
    ),
    attributes=(
        AttributeUse("sm100_w4a16.grouped_gemm", ("can_implement", "check_activation_constants")),
        AttributeUse("sm100_w4a16.launch", ("activation_constants", "compile_w4a16_gemm", "CompiledW4A16Gemm")),
        AttributeUse("sm100_w4a16.launch:CompiledW4A16Gemm", ("n_out", "compiled", "__call__")),
    ),
    consumers=("shim/drops/sm100_w4a16.py",),
)

CONSTANTS.activate = CONTRACT.activate
_C = CONSTANTS.table["sm100_w4a16.constants"]
EPILOGUES = _C["EPILOGUES"]
GEMM_COUNTERS = CounterContract("sm100_w4a16 grouped GEMM", tail_clean=True)


def _load(module: str) -> Any:
    CONTRACT.activate()
    CONSTANTS.ensure_checked()
    return importlib.import_module(module)


_cutlass_version = disk_cache.cutlass_version


def activation_constants(epilogue: str, **constants: Any) -> dict:
    """The activation constants ``epilogue`` compiles in, completed from the drop's defaults: clamped_swiglu's
    four (``swiglu_alpha``, ``swiglu_limit``, ``swiglu_beta``, ``swiglu_limit_after_act``), softcapped_swiglu's
    two (``gate_softcap``, ``up_softcap``), none for the other epilogues (so their keys do not vary).
    ``TypeError`` names an unknown one."""
    return gate_constants.epilogue_constants(_load("sm100_w4a16.launch").activation_constants, epilogue,
                                             constants, "sm100 W4A16 GEMM")


def check_gemm(epilogue: str, n: int, k: int, num_experts: int, **constants: Any) -> None:
    """Raise ``ValueError`` with the drop's reason when the kernel cannot take these shapes or
    activation constants."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"sm100 W4A16 GEMM: epilogue {epilogue!r} not in {EPILOGUES}")
    gemm = _load("sm100_w4a16.grouped_gemm")
    reason = gemm.can_implement(epilogue=epilogue, n=n, k=k, num_experts=num_experts, tile_n=None)
    if reason is None:
        consts = activation_constants(epilogue, **constants)
        reason = gemm.check_activation_constants(
            epilogue=epilogue, **gate_constants.check_args(_C["ACTIVATION_CONSTANT_DEFAULTS"], consts))
    if reason is not None:
        raise ValueError(f"sm100 W4A16 GEMM: {reason}")


@dataclass(frozen=True)
class W4A16Key:
    """Every value the compiled W4A16 GEMM depends on (``activation``: the epilogue's activation
    constants as sorted (name, value) pairs, empty for the epilogues that have none; ``bias_dtype``:
    "" or the per-expert bias's dtype, drop v4)."""

    drop_version: int
    abi_version: int
    cutlass_version: str
    arch: str
    epilogue: str
    n: int
    k: int
    num_experts: int
    activation: tuple = ()
    bias_dtype: str = ""


def cache_namespace() -> str:
    """Disk-cache folder of this drop's kernels (see :func:`disk_cache.drop_namespace`)."""
    return disk_cache.drop_namespace("sm100", "w4a16", CONSTANTS.value(PKG, "DROP_VERSION"), ARCH)


def _bias_name(bias_dtype: Any) -> str:
    """"" for no bias, else the dtype's name (one of the drop's ``BIAS_DTYPES``); ValueError otherwise."""
    if bias_dtype is None:
        return ""
    name = str(bias_dtype).replace("torch.", "")
    if name not in _C["BIAS_DTYPES"]:
        raise ValueError(f"sm100 W4A16 GEMM: bias_dtype must be None or one of {_C['BIAS_DTYPES']}, got {bias_dtype}")
    return name


def _compile(epilogue: str, n: int, k: int, num_experts: int, bias_dtype: Any, consts: dict) -> Any:
    return _load("sm100_w4a16.launch").compile_w4a16_gemm(
        epilogue=epilogue, n=n, k=k, num_experts=num_experts, tile_n=None, raster_m=8, num_stages=None, arch=ARCH,
        extra_options="", bias_dtype=bias_dtype, **consts)


def compiled_w4a16_gemm(epilogue: str, n: int, k: int, num_experts: int, bias_dtype: Any = None,
                        **constants: Any) -> Any:
    """The compiled kernel (code only) for these static values (``bias_dtype``: None or torch.float32 /
    torch.bfloat16 for a per-expert bias; ``constants``: the activation constants,
    :func:`activation_constants`): compiled once per process and exported to / loaded from the disk
    compile cache; no GPU needed."""
    check_gemm(epilogue, n, k, num_experts, **constants)
    consts = activation_constants(epilogue, **constants)
    key = W4A16Key(CONSTANTS.value(PKG, "DROP_VERSION"), _C["ABI_VERSION"], _cutlass_version(), ARCH,
                   epilogue, n, k, num_experts, gate_constants.key_items(consts), _bias_name(bias_dtype))
    return COMPILE_CACHE.get_or_compile(key, lambda: build_w4a16_gemm(key))


def build_w4a16_gemm(key: W4A16Key) -> Any:
    """The compiled GEMM of ``key`` from the disk cache, else compiled and stored: the compile step of
    :func:`compiled_w4a16_gemm` and of a cache rebuilt from a manifest (``kernel_replay``)."""
    import torch

    bias = getattr(torch, key.bias_dtype) if key.bias_dtype else None
    return disk_cache.get_or_build(cache_namespace(), f"w4a16_{key.epilogue}", key,
                                   lambda: _compile(key.epilogue, key.n, key.k, key.num_experts, bias,
                                                    dict(key.activation)))


def w4a16_gemm(epilogue: str, n: int, k: int, num_experts: int, bias_dtype: Any = None, **constants: Any) -> Any:
    """A launcher owned by the caller (the drop's ``CompiledW4A16Gemm`` around the cached code):
    ``gemm(a [M, k] bf16, values [E, n, k/2] u8, block_scale [E, n, k/16] e4m3, global_scale [E]
    f32, offsets [E+1] i32, row_scale=[M] f32 (row_scale epilogue), out=[M, n_out] bf16,
    bias=[E, n] bias_dtype (iff bias_dtype))``."""
    compiled = compiled_w4a16_gemm(epilogue, n, k, num_experts, bias_dtype, **constants)
    return _load("sm100_w4a16.launch").CompiledW4A16Gemm(
        epilogue=epilogue, n=n, k=k, num_experts=num_experts, tile_n=None, raster_m=8, num_stages=None, arch=ARCH,
        compiled=compiled, bias_dtype=bias_dtype, **activation_constants(epilogue, **constants))


def compile_gemm_ptx(epilogue: str, n: int, k: int, num_experts: int, bias_dtype: Any = None,
                     **constants: Any) -> str:
    """Compile for sm_100a without a GPU and return the PTX (the drop keeps its compiler
    artifacts in a temporary folder)."""
    check_gemm(epilogue, n, k, num_experts, **constants)
    _bias_name(bias_dtype)
    return _compile(epilogue, n, k, num_experts, bias_dtype, activation_constants(epilogue, **constants)).__ptx__
