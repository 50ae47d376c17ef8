"""``python -m moe_ep.bench gemm`` — SM90 grouped GEMMs vs ``torch._grouped_mm`` on the same inputs.

For each model shape and routing (uniform / skewed: expert 0 takes half of the rows), FC1
(w13, fused activation) and FC2 (w2, router weights in the epilogue) are timed with CUDA events:
median over ``--iters`` runs, ours and torch's interleaved run by run (neither gets the cooler GPU),
inputs rotated over several sets so that L2 does not hold them.
torch._grouped_mm runs the same GEMMs without the fused epilogue work (no activation, no row
scaling), which favours the baseline.
"""

from __future__ import annotations

import statistics

import torch

from .models import MODELS, model_config


def _median_pair_ms(fa, sets_a, fb, sets_b, iters: int) -> tuple[float, float]:
    """Median ms of ``fa`` and of ``fb`` over ``iters`` runs each, interleaved (a b, b a, a b, ...):
    under the 700 W cap the clock falls as the GPU heats, so timing one loop after the other would
    hand the first the cooler GPU (LIMITS.md)."""
    for s in sets_a[:2]:
        fa(*s)
    for s in sets_b[:2]:
        fb(*s)
    torch.cuda.synchronize()

    def events():
        return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]

    ev_a, ev_b = events(), events()
    for i in range(iters):
        order = ((fa, sets_a, ev_a), (fb, sets_b, ev_b))
        for fn, sets, ev in (order if i % 2 == 0 else order[::-1]):
            ev[i][0].record()
            fn(*sets[i % len(sets)])
            ev[i][1].record()
    torch.cuda.synchronize()
    return tuple(statistics.median(a.elapsed_time(b) for a, b in ev) for ev in (ev_a, ev_b))


def _offsets(M: int, E: int, skew: bool, gen) -> torch.Tensor:
    p = torch.ones(E)
    fixed = torch.zeros(E, dtype=torch.long)
    if skew:
        fixed[0] = M // 2
    draws = torch.multinomial(p, M - int(fixed.sum()), replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=E) + fixed
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(counts, 0)
    return offs


def run_gemm(args) -> int:
    if not torch.cuda.is_available():
        print("moe_ep.bench gemm: needs a CUDA GPU (SM90); nothing to do here")
        return 0
    from moe_ep.backends.sm90.bf16_cutedsl import grouped_gemm
    from moe_ep.backends.sm90.bf16_cutedsl.backend import swiglu_constants

    torch.backends.cuda.matmul.allow_tf32 = False
    m = MODELS[args.model]
    H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]
    T = args.tokens if args.tokens is not None else 8192
    M = T * K
    iters = max(args.iters, 20)
    gen = torch.Generator().manual_seed(args.seed)
    dev = "cuda"
    nsets = 3
    cfg = model_config(args.model, T)
    act = cfg.activation
    n1 = cfg.w13_rows  # FC1's columns: gate + up (2 I), or up alone (squared_relu: I)
    # clamped_swiglu's constants, as the layer compiles them (the model's, e.g. DeepSeek-V4's beta 0)
    swiglu = swiglu_constants(cfg)
    w13 = [(torch.randn(E, n1, H, generator=gen) * H ** -0.5).to(torch.bfloat16).to(dev) for _ in range(nsets)]
    w2 = [(torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16).to(dev) for _ in range(nsets)]
    xs = [torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev) for _ in range(nsets)]
    hs = [torch.randn(M, I, generator=gen).to(torch.bfloat16).to(dev) for _ in range(nsets)]
    rs = [torch.rand(M, generator=gen).to(dev) for _ in range(nsets)]
    # the shim's kernels, then (--raster-m) the same GEMMs with other L2 raster groups: label, FC1, FC2
    variants = [("", grouped_gemm(act, n1, H, E, **swiglu), grouped_gemm("identity", H, I, E, scale_rows=True))]
    for rm in args.raster_m:
        variants.append((f"r{rm}", grouped_gemm(act, n1, H, E, raster_m=rm, **swiglu),
                         grouped_gemm("identity", H, I, E, scale_rows=True, raster_m=rm)))
    out1 = torch.empty(M, I, dtype=torch.bfloat16, device=dev)
    out2 = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    w13t = [w.transpose(1, 2) for w in w13]
    w2t = [w.transpose(1, 2) for w in w2]
    print(f"\ngrouped GEMM, {m['name']}: E={E} H={H} I={I}, {T} tokens x top-{K} = {M} rows; "
          f"GPU {torch.cuda.get_device_name()}; median of {iters}, {nsets} rotated input sets")
    print(f"{'GEMM':<9}{'routing':<9}{'moe_ep ms':>10}{'TFLOP/s':>9}{'torch ms':>10}{'TFLOP/s':>9}{'ratio':>7}")
    for skew in (False, True):
        offs = _offsets(M, E, skew, gen).to(dev)
        ends = offs[1:].contiguous()
        f1 = 2 * M * H * n1
        f2 = 2 * M * I * H
        routing = "skewed" if skew else "uniform"
        for label, fc1, fc2 in variants:
            ours1, theirs1 = _median_pair_ms(
                lambda a, b: fc1(a, b, offs, out=out1), list(zip(xs, w13)),
                lambda a, b: torch._grouped_mm(a, b, offs=ends), list(zip(xs, w13t)), iters)
            ours2, theirs2 = _median_pair_ms(
                lambda a, b, w: fc2(a, b, offs, out=out2, row_scale=w), list(zip(hs, w2, rs)),
                lambda a, b: torch._grouped_mm(a, b, offs=ends), list(zip(hs, w2t)), iters)
            for name, o, t, f in (("FC1", ours1, theirs1, f1), ("FC2", ours2, theirs2, f2)):
                name = f"{name} {label}".strip()
                print(f"{name:<9}{routing:<9}{o:>10.3f}{f / o / 1e9:>9.1f}{t:>10.3f}{f / t / 1e9:>9.1f}{t / o:>7.2f}")
    print(f"(FC1 = grouped GEMM with the {act} epilogue vs torch's plain [M, {n1}] GEMM; FC2 = with "
          "router-weight row scaling vs torch's plain GEMM. FLOPs count the GEMM only. rN: with N m-tiles per L2 "
          "raster group instead of the shim's choice, --raster-m.)")
    return 0
