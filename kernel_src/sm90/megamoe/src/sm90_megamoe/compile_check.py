"""Compile the grouped GEMM without a GPU (fake tensors, dynamic M_total) and inspect the PTX.

    python -m sm90_megamoe.compile_check            # all activations, Qwen3-30B-A3B shapes
"""

from __future__ import annotations

import time

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .grouped_gemm import GroupedGemmSm90
from .pdl import ptx_problems


_BIAS_DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16}


def fake_args(kernel: GroupedGemmSm90, num_experts: int, n: int, k: int, use_tvm_ffi: bool = False,
              bias_dtype: str = "float32"):
    """Fake (mA, mB, mC, mOffsets, mRowScale, mBias, max_active_ctas, stream), dynamic M_total.

    Layouts match what ``launch.to_cute_args`` produces from contiguous torch tensors. ``bias_dtype``
    ("float32" or "bfloat16") is part of the compiled signature even without ``has_bias``. A
    gathering kernel (``kernel.gather_a``): (mA, mIdx, mB, ...), A with its own row count. A handoff kernel
    (drop v112): ``mSync`` after mBias, and the awaiting one's ``publishers`` after it."""
    n_out, _ = kernel.static_shapes(n, k)
    m = cute.sym_int()
    gather_a = getattr(kernel, "gather_a", False)  # the swap-AB kernel has no gathering form
    mA = make_fake_compact_tensor(cutlass.BFloat16, (cute.sym_int() if gather_a else m, k), stride_order=(1, 0),
                                  assumed_align=16)
    mB = make_fake_compact_tensor(
        cutlass.BFloat16, (num_experts, n, k), stride_order=(2, 1, 0), assumed_align=16
    )
    mC = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mScale = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    if kernel.has_bias:
        mBias = make_fake_compact_tensor(_BIAS_DTYPES[bias_dtype], (num_experts, n), stride_order=(1, 0),
                                         assumed_align=4)
    else:  # an unread placeholder of any length
        mBias = make_fake_compact_tensor(cutlass.Float32, (1, cute.sym_int()), stride_order=(1, 0),
                                         assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=use_tvm_ffi)
    idx = (make_fake_compact_tensor(cutlass.Int32, (m,), assumed_align=4),) if gather_a else ()
    # drop v112: the publishing FC1's / awaiting FC2's sync buffer (and FC2's count of FC1's CTAs)
    role = getattr(kernel, "handoff", None)
    sync = (make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4),) if role else ()
    publishers = (cutlass.Int32(132),) if role == "await" else ()
    return (mA, *idx, mB, mC, mOff, mScale, mBias, *sync, *publishers, cutlass.Int32(132), stream)


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
    bias_dtype=None,
    raster_m: int = 1,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    schedule: str = "cooperative",
    gather_a: bool = False,
    tanh_sigmoid: bool = False,
    cluster_n: int = 1,
    jump_stages: bool = False,
    swiglu_beta: float = 1.0,
    swiglu_limit_after_act: bool = False,
    gate_softcap: float = 4.0,
    up_softcap: float = 25.0,
    cluster_m: int = 1,
    box_rows: int = 0,
    handoff: str = "",
):
    """Compile one variant for ``arch`` from fake tensors. ``bias_dtype``: None (no bias),
    "float32" or "bfloat16"; ``gather_a``: the gathering kernel (:mod:`.grouped_gemm_gather`);
    ``jump_stages``: pingpong's one-step skip of the other warpgroup's stages (drop v79);
    ``box_rows`` > 0: :class:`~.grouped_gemm_box_tails.GroupedGemmBoxTailsSm90` (drop v111);
    ``handoff`` "publish" / "await": :mod:`.grouped_gemm_handoff`'s FC1 / FC2 (drop v112)."""
    cls, box = GroupedGemmSm90, {}
    if handoff:
        from .grouped_gemm_handoff import handoff_class

        cls = handoff_class(handoff)
    if gather_a:
        from .grouped_gemm_gather import GroupedGemmGatherSm90 as cls
    elif box_rows:
        from .grouped_gemm_box_tails import GroupedGemmBoxTailsSm90 as cls
        box = {"box_rows": box_rows}
    kernel = cls(activation, tile_n=tile_n, scale_rows=scale_rows, epilogue=epilogue,
                 has_bias=bias_dtype is not None, raster_m=raster_m,
                 swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, swiglu_beta=swiglu_beta,
                 schedule=schedule,
                 **({"swiglu_limit_after_act": True} if swiglu_limit_after_act else {}),
                 **(dict(gate_softcap=gate_softcap, up_softcap=up_softcap) if activation == "softcapped_swiglu" else {}),
                 **({"tanh_sigmoid": True} if tanh_sigmoid else {}),
                 **({"cluster_n": cluster_n} if cluster_n > 1 else {}),
                 **({"cluster_m": cluster_m} if cluster_m > 1 else {}),
                 **({"jump_stages": True} if jump_stages else {}), **box)
    args = fake_args(kernel, num_experts, n, k, bias_dtype=bias_dtype or "float32")
    opts = f"--gpu-arch {arch} --keep-ptx {extra_options}".strip()
    return cute.compile(kernel, *args, options=opts)


def main():
    # (activation, N, K, scale_rows, bias dtype, raster_m): Qwen3-30B-A3B, Mixtral, gpt-oss shapes
    cases = [
        ("swiglu", 1536, 2048, False, None, 1),
        ("squared_relu", 1536, 2048, False, None, 1),
        ("identity", 2048, 768, True, None, 1),
        ("identity", 2048, 768, False, None, 1),
        ("swiglu", 28672, 4096, False, None, 16),
        ("gelu_glu", 1536, 2048, False, None, 4),
        ("clamped_swiglu", 5760, 2880, False, "float32", 8),
        ("identity", 2880, 2880, True, "bfloat16", 8),
    ]
    for act, n, k, sr, bias, raster in cases:
        t0 = time.time()
        c = compile_for_arch(act, n, k, sr, bias_dtype=bias, raster_m=raster)
        dt = time.time() - t0
        ptx = c.__ptx__
        ok = "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and not ptx_problems(ptx)
        print(f"{act:15s} N={n} K={k} scale_rows={sr} bias={bias} raster_m={raster}: "
              f"compile {dt:.2f}s  wgmma+tma in PTX: {ok}")
        assert ok
    # the gated activations' constants (gpt-oss's FC1 shape; Qwen3's for the softcaps): drop v99's
    # DeepSeek-V4 / GLM-5 clamped SwiGLU (alpha 1, beta 0), drop v102's Step-3.7 form (the gate clamped
    # after the activation), drop v103's Inkling2 softcapped SwiGLU (three tanh.approx per output), drop
    # v109's tanh-form GELU GLU (Gemma 4's expert shape: I 704 = 5.5 tiles)
    for act, n, k, consts, marker in (
            ("clamped_swiglu", 5760, 2880, dict(swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0), "min.f32"),
            ("clamped_swiglu", 5760, 2880, dict(swiglu_alpha=1.0, swiglu_limit=7.0, swiglu_beta=0.0,
                                                swiglu_limit_after_act=True), "min.f32"),
            ("softcapped_swiglu", 3072, 2048, dict(gate_softcap=4.0, up_softcap=25.0), "tanh.approx.f32"),
            ("gelu_tanh_glu", 2 * 704, 2816, {}, "ex2.approx")):
        t0 = time.time()
        ptx = compile_for_arch(act, n, k, False, **consts).__ptx__
        ok = "wgmma.mma_async" in ptx and marker in ptx and not ptx_problems(ptx)
        print(f"{act:17s} N={n} K={k} {consts}: compile {time.time() - t0:.2f}s  wgmma + {marker} in PTX: {ok}")
        assert ok
    # the pingpong schedule: FC2 (identity, tile_n 128 and 192) and gated FC1s with tile_n 64 and 96
    for act, n, k, sr, tn in (("identity", 2048, 768, True, 128), ("identity", 2048, 768, True, 192),
                              ("swiglu", 1536, 2048, False, 64), ("swiglu", 1536, 2048, False, 96)):
        t0 = time.time()
        c = compile_for_arch(act, n, k, sr, tile_n=tn, schedule="pingpong")
        dt = time.time() - t0
        ptx = c.__ptx__
        ok = "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and not ptx_problems(ptx)
        print(f"{act:15s} N={n} K={k} scale_rows={sr} pingpong tile_n={tn}: "
              f"compile {dt:.2f}s  wgmma+tma in PTX: {ok}")
        assert ok
    # drop v72: FC2 in clusters of 2 along N (A multicast), pingpong 128 x 192 (11 n-tiles: the last
    # pair half empty) and cooperative 128 x 256
    for sched, tn in (("pingpong", 192), ("cooperative", 256)):
        t0 = time.time()
        c = compile_for_arch("identity", 2048, 768, True, tile_n=tn, schedule=sched, cluster_n=2)
        ptx = c.__ptx__
        ok = "wgmma.mma_async" in ptx and ".multicast::cluster" in ptx and not ptx_problems(ptx)
        print(f"identity        N=2048 K=768 {sched} tile_n={tn} cluster_n=2: compile {time.time() - t0:.2f}s  "
              f"wgmma+multicast TMA in PTX: {ok}")
        assert ok


if __name__ == "__main__":
    main()
