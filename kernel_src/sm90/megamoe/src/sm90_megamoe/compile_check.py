"""Compile the grouped GEMM without a GPU (fake tensors, dynamic M_total) and inspect the PTX.

    python -m sm90_megamoe.compile_check            # all activations, Qwen3-30B-A3B shapes
"""

from __future__ import annotations

import time

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .grouped_gemm import GroupedGemmSm90


def fake_args(kernel: GroupedGemmSm90, num_experts: int, n: int, k: int, use_tvm_ffi: bool = False):
    """Fake (mA, mB, mC, mOffsets, mRowScale, max_active_ctas, stream) with dynamic M_total.

    Layouts match what ``launch.to_cute_args`` produces from contiguous torch tensors."""
    n_out, _ = kernel.static_shapes(n, k)
    m = cute.sym_int()
    mA = make_fake_compact_tensor(cutlass.BFloat16, (m, k), stride_order=(1, 0), assumed_align=16)
    mB = make_fake_compact_tensor(
        cutlass.BFloat16, (num_experts, n, k), stride_order=(2, 1, 0), assumed_align=16
    )
    mC = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mScale = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    return mA, mB, mC, mOff, mScale, cutlass.Int32(132), stream


def compile_for_arch(
    activation: str,
    n: int,
    k: int,
    scale_rows: bool,
    arch: str = "sm_90a",
    num_experts: int = 128,
    tile_n=None,
    extra_options: str = "",
    epilogue: str = "smem",
):
    kernel = GroupedGemmSm90(activation, tile_n=tile_n, scale_rows=scale_rows, epilogue=epilogue)
    args = fake_args(kernel, num_experts, n, k)
    opts = f"--gpu-arch {arch} --keep-ptx {extra_options}".strip()
    return cute.compile(kernel, *args, options=opts)


def main():
    cases = [
        ("swiglu", 1536, 2048, False),
        ("squared_relu", 1536, 2048, False),
        ("identity", 2048, 768, True),
        ("identity", 2048, 768, False),
    ]
    for act, n, k, sr in cases:
        t0 = time.time()
        c = compile_for_arch(act, n, k, sr)
        dt = time.time() - t0
        ptx = c.__ptx__
        ok = "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        print(f"{act:13s} N={n} K={k} scale_rows={sr}: compile {dt:.2f}s  wgmma+tma in PTX: {ok}")
        assert ok


if __name__ == "__main__":
    main()
