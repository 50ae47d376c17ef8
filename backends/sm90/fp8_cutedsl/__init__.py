"""SM90 FP8 block-scaled CuTeDSL backend (drop sm90/megamoe)."""

from .backend import Sm90Fp8Backend, check, check_config, grouped_gemm_fp8, prebuild

__all__ = ["Sm90Fp8Backend", "check", "check_config", "grouped_gemm_fp8", "prebuild"]
