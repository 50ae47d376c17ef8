"""SM120 MXFP8 CuTeDSL backend (drop sm120/mxfp8)."""

from .backend import Sm120Mxfp8Backend, check, check_config, prebuild

__all__ = ["Sm120Mxfp8Backend", "check", "check_config", "prebuild"]
