"""How compiled kernels are launched: through TVM-FFI or CuTeDSL's classic path.

TVM-FFI (``--enable-tvm-ffi``, package apache-tvm-ffi) calls a kernel with torch tensors and Python
ints on torch's current stream: ~4 us per launch on an H200 host, against ~18 us for the classic
path with pre-converted CuTe tensors (and ~60 us more whenever six tensors must be converted).
It is the default whenever apache-tvm-ffi is importable (a core dependency). ``MOE_EP_TVM_FFI``:
``auto`` (default), ``1`` (require it: raise when missing), ``0`` (classic path, e.g. to rule it
out while debugging). The choice is part of every compile key and disk-cache entry.

Under ``auto`` a missing apache-tvm-ffi is not an error, but the classic path is slow enough to
matter, so the first choice made without it warns once (:class:`LaunchPathWarning`). Twenty-ninth
session, H200 host: an FP8 Qwen3 forward spent 126 us of host time with TVM-FFI and 590-810 us
without (each prepared GEMM launch 105-190 us instead of ~10), so a per-call forward waited 270 us
for the host instead of 55 (688 -> 506-554 TFLOP/s). :func:`launch_path` says which path is taken.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

from .errors import LaunchPathWarning

_CHOICES = ("auto", "0", "1")
_MISSING = "classic (apache-tvm-ffi missing)"
_warned_classic = False


def _have_tvm_ffi() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def _choice() -> tuple[bool, str]:
    """``(launch through TVM-FFI, the path's name)`` per ``MOE_EP_TVM_FFI`` and the installation."""
    mode = os.environ.get("MOE_EP_TVM_FFI") or "auto"  # unset or empty: auto; only the listed values (as every switch)
    if mode not in _CHOICES:
        raise ValueError(f"MOE_EP_TVM_FFI={mode!r}: expected one of {_CHOICES}")
    if mode == "0":
        return False, "classic (MOE_EP_TVM_FFI=0)"
    if _have_tvm_ffi():
        return True, "tvm-ffi"
    if mode == "1":
        raise RuntimeError("MOE_EP_TVM_FFI=1 but apache-tvm-ffi is not installed (pip install apache-tvm-ffi)")
    return False, _MISSING


def use_tvm_ffi() -> bool:
    """True when kernels should be compiled for, and launched through, TVM-FFI."""
    global _warned_classic
    use, path = _choice()
    if path == _MISSING and not _warned_classic:
        _warned_classic = True
        warnings.warn("apache-tvm-ffi is not installed (a dependency of moe_ep): kernels launch through "
                      "CuTeDSL's classic path, which costs ~0.1 ms more host time per launch on an H200 host "
                      "(an FP8 forward's host time 126 -> 590-810 us). pip install apache-tvm-ffi; "
                      "MOE_EP_TVM_FFI=0 picks the classic path without this warning.",
                      LaunchPathWarning, stacklevel=2)
    return use


def launch_path() -> str:
    """How kernels compiled now will be launched: ``"tvm-ffi"``, ``"classic (MOE_EP_TVM_FFI=0)"`` or
    ``"classic (apache-tvm-ffi missing)"`` -- :func:`use_tvm_ffi`'s choice, without its warning
    (and the same errors: a bad ``MOE_EP_TVM_FFI``, or ``1`` without apache-tvm-ffi)."""
    return _choice()[1]
