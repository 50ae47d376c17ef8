"""SM90 BF16 CuTeDSL backend (drop sm90/megamoe)."""

from .backend import Sm90CuteDSLBackend, check, grouped_gemm, prebuild
from .workspace import dims_bytes, workspace_bytes

__all__ = ["Sm90CuteDSLBackend", "check", "grouped_gemm", "dims_bytes", "prebuild", "workspace_bytes"]
