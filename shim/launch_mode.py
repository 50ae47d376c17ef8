"""How compiled kernels are launched: through TVM-FFI or CuTeDSL's classic path.

TVM-FFI (``--enable-tvm-ffi``, package apache-tvm-ffi) calls a kernel with torch tensors and Python
ints on torch's current stream: ~4 us per launch on an H200 host, against ~18 us for the classic
path with pre-converted CuTe tensors (and ~60 us more whenever six tensors must be converted).
It is the default whenever apache-tvm-ffi is importable (a core dependency). ``MOE_EP_TVM_FFI``:
``auto`` (default), ``1`` (require it: raise when missing), ``0`` (classic path, e.g. to rule it
out while debugging). The choice is part of every compile key and disk-cache entry.
"""

from __future__ import annotations

import importlib.util
import os

_CHOICES = ("auto", "0", "1")


def use_tvm_ffi() -> bool:
    """True when kernels should be compiled for, and launched through, TVM-FFI."""
    mode = os.environ.get("MOE_EP_TVM_FFI", "auto").strip().lower() or "auto"
    if mode not in _CHOICES:
        raise ValueError(f"MOE_EP_TVM_FFI={mode!r}: expected one of {_CHOICES}")
    if mode == "0":
        return False
    have = importlib.util.find_spec("tvm_ffi") is not None
    if mode == "1" and not have:
        raise RuntimeError("MOE_EP_TVM_FFI=1 but apache-tvm-ffi is not installed (pip install apache-tvm-ffi)")
    return have
