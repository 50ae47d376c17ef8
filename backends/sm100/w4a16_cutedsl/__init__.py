"""SM100 W4A16 (NVFP4 weights, BF16 activations) CuTeDSL backend (drop sm100/w4a16)."""

from .backend import Sm100W4A16Backend, check, check_config, prebuild

__all__ = ["Sm100W4A16Backend", "check", "check_config", "prebuild"]
