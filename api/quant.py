"""Block-scaled weight formats for ``MoEConfig.quant``: BF16 -> NVFP4, MXFP8, FP8 block-128, and back.

The formats, their rounding and their round-trip error bounds are documented in
:mod:`moe_ep.backends.quant` (they live there so the backends can implement them); this module is
their public home::

    from moe_ep.api.quant import quantize_nvfp4, quantize_mxfp8
    layer = MoELayer(MoEConfig(..., quant="nvfp4_w4a16"))
    layer.forward(x, ids, w, quantize_nvfp4(w13), quantize_nvfp4(w2))
    w13 = nvfp4_from_mxfp4(gate_up_blocks, gate_up_scales, gate_up_interleaved=True)  # gpt-oss's MXFP4
"""

from ..backends.quant import (FP8_BLOCK, MXFP8_BLOCK, NVFP4_BLOCK, FP8Block128Weight, MXFP8Tensor, NVFP4Weight,
                              dequantize_fp8_block128, dequantize_fp8_rows128, dequantize_mxfp8, dequantize_nvfp4,
                              nvfp4_from_mxfp4, quantize_fp8_block128, quantize_fp8_rows128, quantize_mxfp8,
                              quantize_nvfp4)

__all__ = ["FP8_BLOCK", "MXFP8_BLOCK", "NVFP4_BLOCK", "FP8Block128Weight", "MXFP8Tensor", "NVFP4Weight",
           "dequantize_fp8_block128", "dequantize_fp8_rows128", "dequantize_mxfp8", "dequantize_nvfp4",
           "nvfp4_from_mxfp4", "quantize_fp8_block128", "quantize_fp8_rows128", "quantize_mxfp8", "quantize_nvfp4"]
