"""SM90 BF16 CuTeDSL backend (drop sm90/megamoe)."""

from .backend import Sm90CuteDSLBackend, check, grouped_gemm

__all__ = ["Sm90CuteDSLBackend", "check", "grouped_gemm"]
