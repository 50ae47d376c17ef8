"""One FC1 and one FC2 launch of a model's grouped GEMMs between cudaProfilerStart/Stop, for
Nsight Compute (8192 tokens, uniform routing unless ``--routing topk``, fresh random inputs):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python -m moe_ep.bench.ncu_gemm --model mixtral [--raster-m 1] [--torch] [--routing topk]

``--torch`` profiles ``torch._grouped_mm`` on the same inputs instead. ``--quant fp8_block128``:
the FP8 block-scaled GEMMs (``sm90_fp8_cutedsl``'s, on the schedule the backend picks; with
``--torch``: ``torch._scaled_mm`` per expert with the same block-wise scales, i.e. cuBLAS, one
launch per expert and GEMM).
"""

from __future__ import annotations

import argparse

import torch

from .models import MODELS, draw_routing, model_config


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--raster-m", type=int, default=None)
    p.add_argument("--torch", action="store_true", help="profile torch._grouped_mm instead")
    p.add_argument("--quant", choices=("fp8_block128",), default=None, help="the FP8 block-scaled GEMMs")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="uniform: M / E rows per expert; topk: each token's top-k of random logits, a layer's "
                        "routing (partial last m-tiles, odd m-tile counts)")
    args = p.parse_args()
    if args.quant:
        return fp8_main(args)
    from moe_ep.backends.sm90.bf16_cutedsl import grouped_gemm

    m = MODELS[args.model]
    H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]
    M = args.tokens * K
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
    n1 = model_config(args.model, args.tokens).w13_rows  # gate + up (2 I), or up alone (squared_relu: I)
    w13 = (torch.randn(E, n1, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).to(torch.bfloat16)
    h = torch.randn(M, I, device="cuda", generator=g).to(torch.bfloat16)
    rs = torch.rand(M, device="cuda", generator=g)
    offs = routing_offsets(args.tokens, E, K, args.routing)
    out1 = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    act = m.get("activation", "swiglu")
    fc1 = grouped_gemm(act, n1, H, E, raster_m=args.raster_m)
    fc2 = grouped_gemm("identity", H, I, E, scale_rows=True, raster_m=args.raster_m)
    ends = offs[1:].contiguous()
    for _ in range(2):  # compile, load modules, warm the clocks
        fc1(x, w13, offs, out=out1)
        fc2(h, w2, offs, out=out2, row_scale=rs)
        torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)
        torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    if args.torch:
        torch._grouped_mm(x, w13.transpose(1, 2), offs=ends)
        torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    else:
        fc1(x, w13, offs, out=out1)
        fc2(h, w2, offs, out=out2, row_scale=rs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


ROUTINGS = ("uniform", "topk")


def routing_offsets(tokens: int, E: int, K: int, routing: str = "uniform", device: str = "cuda") -> torch.Tensor:
    """[E + 1] int32 expert offsets of ``tokens * K`` grouped rows: ``uniform`` -- near-equal counts;
    ``topk`` -- the layer bench's routing (:func:`.models.draw_routing`, seed 0)."""
    if routing == "uniform":
        M = tokens * K
        counts = torch.full((E,), M // E, dtype=torch.int64)
        counts[: M - int(counts.sum())] += 1
    elif routing == "topk":
        _, ids = draw_routing(torch.Generator().manual_seed(0), E, K, tokens)
        counts = ids.flatten().bincount(minlength=E)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = counts.cumsum(0)
    return offs.to(device)


def fp8_main(args) -> int:
    """FC1 (swiglu) and FC2 (row-scaled) of the FP8 layer, ours or cuBLAS's block-wise ``_scaled_mm``."""
    from moe_ep.backends.quant import quantize_fp8_block128, quantize_fp8_rows128
    from moe_ep.backends.sm90.fp8_cutedsl import grouped_gemm_fp8

    m = MODELS[args.model]
    H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]
    M = args.tokens * K
    g = torch.Generator(device="cuda").manual_seed(0)
    xq, xs = quantize_fp8_rows128(torch.randn(M, H, device="cuda", generator=g))
    hq, hs = quantize_fp8_rows128(torch.randn(M, I, device="cuda", generator=g))
    w13 = quantize_fp8_block128(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5)
    w2 = quantize_fp8_block128(torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5)
    rs = torch.rand(M, device="cuda", generator=g)
    offs = routing_offsets(args.tokens, E, K, args.routing)
    out1 = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    fc1 = grouped_gemm_fp8("swiglu", 2 * I, H, E)
    fc2 = grouped_gemm_fp8("identity", H, I, E, scale_rows=True)
    o = offs.tolist()
    # cuBLAS block-wise: A scales 1 x 128 (outer-dim-major), B scales 128 x 128
    per_expert = [(lo, hi, e, xs[lo:hi].t().contiguous().t(), hs[lo:hi].t().contiguous().t())
                  for e, (lo, hi) in enumerate(zip(o[:-1], o[1:])) if hi > lo]

    def ours():
        fc1(xq, xs, w13.values, w13.scale, offs, out=out1, row_scale=rs[:1])
        fc2(hq, hs, w2.values, w2.scale, offs, out=out2, row_scale=rs)

    def cublas():
        for lo, hi, e, xs_e, hs_e in per_expert:
            torch._scaled_mm(xq[lo:hi], w13.values[e].t(), scale_a=xs_e, scale_b=w13.scale[e].t(),
                             out_dtype=torch.bfloat16)
            torch._scaled_mm(hq[lo:hi], w2.values[e].t(), scale_a=hs_e, scale_b=w2.scale[e].t(),
                             out_dtype=torch.bfloat16)

    run = cublas if args.torch else ours
    for _ in range(2):  # compile, load modules, warm the clocks
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
