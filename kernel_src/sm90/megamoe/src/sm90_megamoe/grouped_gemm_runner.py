"""Correctness + benchmark runner for the varlen-M grouped GEMM (needs an SM90 GPU).

    python -m sm90_megamoe.grouped_gemm_runner --m-total 65536 --n 1536 --k 2048 --experts 128 \
        --activation swiglu --routing uniform --bench
    python -m sm90_megamoe.grouped_gemm_runner --suite          # everything in one process
    python -m sm90_megamoe.grouped_gemm_runner --wide [--model qwen3,mixtral]   # schedule "wide" vs
        # "cooperative" on the models' FC1 shapes: bit identity and time, torch._grouped_mm beside
    python -m sm90_megamoe.grouped_gemm_runner --pingpong --model qwen3,dsv3_shard,gpt_oss,mixtral
        # drop v71: FC2 on pingpong 128 x 192 vs cooperative 128 x 256, bits and time
    python -m sm90_megamoe.grouped_gemm_runner --cluster-n --model qwen3,gpt_oss   # drop v72: FC2 in
        # clusters of 2 along N (A multicast) vs pingpong 128 x 192 alone
    python -m sm90_megamoe.grouped_gemm_runner --jump-stages --model qwen3,nemotron   # drop v79:
        # pingpong skipping the other warpgroup's stages in one step vs unrolled; FC1 also on
        # cooperative 128 (the default) beside pingpong 96
    python -m sm90_megamoe.grouped_gemm_runner --gather --model qwen3   # drop v23: FC1 gathering its
        # rows by index (cp.async) vs the row copy + the plain FC1 on the copied rows
(Drop v85 removed ``--gather-tma`` and ``--gather-l2`` with their kernels, drop v89 ``--m64-tails``
with v78's 64-row tails, drop v94 ``--place`` with v91's placing FC1: all slower or no faster on
the H200.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch

from .constants import GATED_ACTIVATIONS
from .launch import _TORCH_BIAS, CompiledGroupedGemm, get_grouped_gemm, to_cute_args
from .reference import grouped_gemm_reference


def make_offsets(m_total: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """[E+1] int32 CPU offsets. uniform: near-equal counts; skewed: Zipf-like with empty experts;
    topk8: the counts of m_total / 8 tokens' top-8 of random logits (a layer's routing: Qwen3 at
    65536 rows leaves about half of the experts' last m-tiles with <= 64 rows)."""
    if routing == "topk8":
        ids = torch.randn(max(1, m_total // 8), experts, generator=gen).topk(min(8, experts), -1).indices
        counts = ids.flatten().bincount(minlength=experts)[:experts]
        counts[0] += m_total - int(counts.sum())  # m_total not a multiple of 8
    elif routing == "uniform":
        base = torch.full((experts,), m_total // experts, dtype=torch.int64)
        base[: m_total - int(base.sum())] += 1
        counts = base
    elif routing == "skewed":
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(experts, generator=gen)]
        w[torch.randperm(experts, generator=gen)[: max(1, experts // 8)]] = 0.0  # empty experts
        if float(w.sum()) == 0.0:
            w[0] = 1.0
        counts = torch.multinomial(w / w.sum(), m_total, replacement=True, generator=gen).bincount(
            minlength=experts
        ) if m_total > 0 else torch.zeros(experts, dtype=torch.int64)
    else:
        raise ValueError(routing)
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(counts, 0)
    assert int(offs[-1]) == m_total
    return offs.to(torch.int32)


def make_inputs(m_total, n, k, experts, activation, routing, scale_rows, seed=0, device="cuda",
                bias_dtype=None):
    """Fresh random (a, b, offsets, row_scale, bias). clamped_swiglu gets inputs 8x larger so that
    the clamp at the limit (7.0) triggers for a good share of the elements."""
    gen = torch.Generator().manual_seed(seed)  # routing (CPU)
    dgen = torch.Generator(device=device).manual_seed(seed)  # data, drawn where it lives
    amp = 4.0 if activation == "clamped_swiglu" else 0.5
    a = (torch.randn(m_total, k, generator=dgen, device=device) * amp).to(torch.bfloat16)
    b = (torch.randn(experts, n, k, generator=dgen, device=device) * (1.0 / k**0.5)).to(torch.bfloat16)
    offs = make_offsets(m_total, experts, routing, gen).to(device)
    rs = torch.rand(m_total, generator=dgen, device=device) if scale_rows else None
    bias = None
    if bias_dtype is not None:
        bias = (torch.randn(experts, n, generator=dgen, device=device) * amp).to(_TORCH_BIAS[bias_dtype])
    return a, b, offs, rs, bias


def check(fn: CompiledGroupedGemm, m_total, n, k, experts, activation, routing, scale_rows, seed=0):
    a, b, offs, rs, bias = make_inputs(m_total, n, k, experts, activation, routing, scale_rows, seed,
                                       bias_dtype=fn.bias_dtype)
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    out = torch.full((m_total, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(a, b, offs, out=out, row_scale=rs, bias=bias)
    torch.cuda.synchronize()
    kern = fn.kernel  # clamped_swiglu's constants as compiled
    ref = grouped_gemm_reference(a, b, offs, activation, rs, bias=bias, swiglu_alpha=kern.swiglu_alpha,
                                 swiglu_limit=kern.swiglu_limit, swiglu_beta=kern.swiglu_beta,
                                 swiglu_limit_after_act=kern.swiglu_limit_after_act,
                                 gate_softcap=kern.gate_softcap, up_softcap=kern.up_softcap)
    nan = bool(torch.isnan(out).any()) if m_total else False
    denom = ref.norm().item()
    rel = (out.float() - ref).norm().item() / denom if denom > 0 else (out.float().norm().item())
    ok = (not nan) and rel < 1e-2
    print(
        f"[check] {activation:14s} scale={int(scale_rows)} bias={fn.bias_dtype} raster={fn.raster_m} "
        f"M={m_total:6d} N={n} K={k} E={experts} routing={routing:7s} rel_err={rel:.3e} nan={nan} -> {'PASS' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def same_bits(fns, m_total, n, k, experts, activation, routing, scale_rows, seed, bias_dtype=None) -> list[bool]:
    """Run every kernel of ``fns`` (the first the baseline) on one set of fresh inputs, each into its
    own NaN-poisoned output; per later kernel: bit-identical to the first and NaN-free. Shared by
    the variant comparisons (--wide, --cluster, --pingpong / --cluster-n)."""
    a, b, offs, rs, bias = make_inputs(m_total, n, k, experts, activation, routing, scale_rows, seed=seed,
                                       bias_dtype=bias_dtype)
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    outs = []
    for fn in fns:
        out = torch.full((m_total, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs, out=out, row_scale=rs, bias=bias)
        outs.append(out)
    torch.cuda.synchronize()
    return [torch.equal(outs[0], o) and not bool(torch.isnan(o).any()) for o in outs[1:]]


def bench(fn: CompiledGroupedGemm, m_total, n, k, experts, activation, routing, scale_rows,
          iters=20, rotate=3):
    sets = [make_inputs(m_total, n, k, experts, activation, routing, scale_rows, seed=s,
                        bias_dtype=fn.bias_dtype) for s in range(rotate)]
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    outs = [torch.empty(m_total, n_out, dtype=torch.bfloat16, device="cuda") for _ in sets]
    d_scale, d_bias = fn.placeholders("cuda")
    conv = [to_cute_args(a, b, o, offs, rs if rs is not None else d_scale,
                         bias if bias is not None else d_bias)
            for (a, b, offs, rs, bias), o in zip(sets, outs)]
    flops = 2.0 * m_total * n * k

    def timed(run):
        for i in range(3):
            run(i % rotate)
        torch.cuda.synchronize()
        ts = []
        for i in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run(i % rotate)
            e.record()
            ts.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ts) * 1e-3

    t_ours = timed(lambda i: fn.launch_converted(conv[i]))
    bt = [st[1].transpose(1, 2) for st in sets]  # [E, K, N] view, K contiguous
    ends = [st[2][1:].contiguous() for st in sets]
    t_torch = timed(lambda i: torch._grouped_mm(sets[i][0], bt[i], offs=ends[i]))
    print(
        f"[bench] {activation:14s} scale={int(scale_rows)} raster={fn.raster_m} {fn.schedule}"
        f"{' cluster2' if fn.cluster_m > 1 else ''}{' cluster_n2' if fn.cluster_n > 1 else ''}"
        f"{' jump_stages' if fn.jump_stages else ''} tile_n={getattr(fn.kernel, 'tile_n', '-')} M={m_total} N={n} K={k} E={experts} "
        f"routing={routing}: ours {t_ours*1e3:.3f} ms {flops/t_ours/1e12:.1f} TFLOP/s | "
        f"torch._grouped_mm {t_torch*1e3:.3f} ms {flops/t_torch/1e12:.1f} TFLOP/s | "
        f"ratio {t_torch/t_ours:.3f}x",
        flush=True,
    )
    return t_ours, t_torch


def suite(args):
    ok = True
    t0 = time.time()
    fns = {}

    def get(act, n, k, e, sr, tile_n=None, epilogue="smem", bias_dtype=None, raster_m=None,
            schedule="cooperative", **swiglu):
        key = (act, n, k, e, sr, tile_n, epilogue, bias_dtype, raster_m, schedule, tuple(sorted(swiglu.items())))
        if key not in fns:
            t = time.time()
            fns[key] = get_grouped_gemm(act, n, k, e, scale_rows=sr, tile_n=tile_n,
                                        epilogue=epilogue, bias_dtype=bias_dtype, raster_m=raster_m,
                                        schedule=schedule, **swiglu)
            print(f"[compile] {key} {time.time()-t:.2f}s", flush=True)
        return fns[key]

    H, I, E = 2048, 768, 128
    f1 = get("swiglu", 2 * I, H, E, False)
    f2 = get("identity", H, I, E, True)
    f2n = get("identity", H, I, E, False)
    fsq = get("squared_relu", 2 * I, H, E, False)
    small = [
        (f1, 4133, 2 * I, H, E, "swiglu", "uniform", False),
        (f1, 4133, 2 * I, H, E, "swiglu", "skewed", False),
        (f1, 1, 2 * I, H, E, "swiglu", "skewed", False),
        (fsq, 3001, 2 * I, H, E, "squared_relu", "skewed", False),
        (f2, 4133, H, I, E, "identity", "skewed", True),
        (f2, 1, H, I, E, "identity", "uniform", True),
        (f2n, 777, H, I, E, "identity", "uniform", False),
    ]
    for fn, m, n, k, e, act, routing, sr in small:
        ok &= check(fn, m, n, k, e, act, routing, sr)
    # odd shapes: N not a multiple of tile_n, K tail, few experts
    f_odd = get("identity", 1000, 200, 5, False)
    ok &= check(f_odd, 997, 1000, 200, 5, "identity", "skewed", False)
    f_odd2 = get("swiglu", 2 * 256, 520, 3, True)
    ok &= check(f_odd2, 300, 512, 520, 3, "swiglu", "skewed", True)
    # gated with I not a multiple of the tile (gpt-oss I = 2880 = 22.5 tiles), every activation,
    # biases of both dtypes, raster groups that do not divide the m-tiles of an expert
    for act, bias, raster in (("clamped_swiglu", "float32", 3), ("gelu_glu", "bfloat16", 1),
                              ("swiglu", None, 5), ("squared_relu", "float32", 2)):
        n_odd = 2 * 2880 if act in GATED_ACTIVATIONS else 2880
        f = get(act, n_odd, 2880, 8, False, bias_dtype=bias, raster_m=raster)
        ok &= check(f, 5003, n_odd, 2880, 8, act, "skewed", False)
    # drop v99: DeepSeek-V4 / GLM-5's clamped SwiGLU (alpha 1, beta 0: no +1 on the clamped up)
    f_v4 = get("clamped_swiglu", 2 * 2880, 2880, 8, False, swiglu_alpha=1.0, swiglu_limit=7.0, swiglu_beta=0.0)
    ok &= check(f_v4, 5003, 2 * 2880, 2880, 8, "clamped_swiglu", "skewed", False)
    # drop v102: Step-3.7's, the gate clamped after the activation (min(silu(g), limit) * clamp(u))
    f_s37 = get("clamped_swiglu", 2 * 2880, 2880, 8, False, swiglu_alpha=1.0, swiglu_limit=7.0, swiglu_beta=0.0,
                swiglu_limit_after_act=True)
    ok &= check(f_s37, 5003, 2 * 2880, 2880, 8, "clamped_swiglu", "skewed", False)
    # drop v103: Inkling2's softcapped SwiGLU, caps small enough that both bind often
    f_soft = get("softcapped_swiglu", 2 * 2880, 2880, 8, False, gate_softcap=1.0, up_softcap=1.5)
    ok &= check(f_soft, 5003, 2 * 2880, 2880, 8, "softcapped_swiglu", "skewed", False)
    # drop v109: the tanh-form GELU GLU on Gemma 4's expert shape (I 704: the last n-tile half full)
    f_gt = get("gelu_tanh_glu", 2 * 704, 2816, 16, False)
    ok &= check(f_gt, 5003, 2 * 704, 2816, 16, "gelu_tanh_glu", "skewed", False)
    f2b = get("identity", 2880, 2880, 8, True, bias_dtype="bfloat16", raster_m=4)
    ok &= check(f2b, 5003, 2880, 2880, 8, "identity", "skewed", True)
    f_i104 = get("swiglu", 208, 264, 4, False, bias_dtype="float32")
    ok &= check(f_i104, 999, 208, 264, 4, "swiglu", "uniform", False)
    # the pingpong schedule: FC2 (identity, row scale, bias) and a gated FC1 with 64-wide tiles
    fpp2 = get("identity", H, I, E, True, tile_n=128, schedule="pingpong")
    for m_, r_ in ((4133, "skewed"), (1, "uniform"), (65536, "uniform")):
        ok &= check(fpp2, m_, H, I, E, "identity", r_, True)
    fpp1 = get("swiglu", 2 * I, H, E, False, tile_n=64, schedule="pingpong")
    ok &= check(fpp1, 4133, 2 * I, H, E, "swiglu", "skewed", False)
    fppb = get("identity", 2880, 2880, 8, True, tile_n=128, schedule="pingpong", bias_dtype="float32")
    ok &= check(fppb, 5003, 2880, 2880, 8, "identity", "skewed", True)
    # Mixtral FC1 shape with the L2 raster (16 m-tiles per expert)
    fmx = get("swiglu", 28672, 4096, 8, False)
    ok &= check(fmx, 16384, 28672, 4096, 8, "swiglu", "uniform", False)
    # full Qwen3-30B-A3B shape
    ok &= check(f1, 65536, 2 * I, H, E, "swiglu", "uniform", False)
    ok &= check(f2, 65536, H, I, E, "identity", "skewed", True)
    print(f"[suite] correctness {'PASS' if ok else 'FAIL'} ({time.time()-t0:.1f}s)", flush=True)
    if args.bench:
        bench(f1, 65536, 2 * I, H, E, "swiglu", "uniform", False)
        bench(f2n, 65536, H, I, E, "identity", "uniform", False)
        bench(f2, 65536, H, I, E, "identity", "uniform", True)
        bench(f1, 65536, 2 * I, H, E, "swiglu", "skewed", False)
        print("[bench] schedules: cooperative vs pingpong (FC2 of Qwen3, DeepSeek-V3 shard, Mixtral; "
              "Qwen3 FC1 with 64-wide pingpong tiles)", flush=True)
        for (nn, kk, ee, act, sr, mm, tn) in ((2048, 768, 128, "identity", True, 65536, 128),
                                              (7168, 2048, 32, "identity", True, 65536, 128),
                                              (4096, 14336, 8, "identity", True, 16384, 128),
                                              (1536, 2048, 128, "swiglu", False, 65536, 64)):
            bench(get(act, nn, kk, ee, sr), mm, nn, kk, ee, act, "uniform", sr, iters=10)
            fpp = get(act, nn, kk, ee, sr, tile_n=tn, schedule="pingpong")
            ok &= check(fpp, 3001, nn, kk, ee, act, "skewed", sr)
            bench(fpp, mm, nn, kk, ee, act, "uniform", sr, iters=10)
        if args.raster_bench:
            print("[bench] raster: Mixtral FC1/FC2 and DeepSeek-V3 shard, raster_m=1 vs the default",
                  flush=True)
            for (nn, kk, ee, act, sr, mm) in ((28672, 4096, 8, "swiglu", False, 16384),
                                              (4096, 14336, 8, "identity", True, 16384),
                                              (4096, 7168, 32, "swiglu", False, 65536),
                                              (7168, 2048, 32, "identity", True, 65536)):
                for r in (1, None):
                    f = get(act, nn, kk, ee, sr, raster_m=r)
                    bench(f, mm, nn, kk, ee, act, "uniform", sr, iters=10)
        print("[bench] variants: direct-store epilogue, identity tile_n=128", flush=True)
        fd1 = get("swiglu", 2 * I, H, E, False, epilogue="direct")
        ok &= check(fd1, 4133, 2 * I, H, E, "swiglu", "skewed", False)
        bench(fd1, 65536, 2 * I, H, E, "swiglu", "uniform", False)
        fd2 = get("identity", H, I, E, False, epilogue="direct")
        bench(fd2, 65536, H, I, E, "identity", "uniform", False)
        f2t = get("identity", H, I, E, False, tile_n=128)
        ok &= check(f2t, 4133, H, I, E, "identity", "skewed", False)
        bench(f2t, 65536, H, I, E, "identity", "uniform", False)
    return ok


# FC1 shapes for --wide: (N = 2 I, K = H, E, M_total at 8192 tokens, activation, bias dtype)
WIDE_SHAPES = {
    "qwen3": (1536, 2048, 128, 65536, "swiglu", None),
    "mixtral": (28672, 4096, 8, 16384, "swiglu", None),
    "dsv3_shard": (4096, 7168, 32, 65536, "swiglu", None),
    "gpt_oss": (5760, 2880, 128, 32768, "clamped_swiglu", "float32"),
    "nemotron": (1856, 2688, 128, 49152, "squared_relu", None),  # not gated: FC2's K is N
}


def wide(models, iters=20) -> bool:
    """Schedule "wide" (one m64 x 2 tile_n WGMMA over gate + up) against "cooperative" (two):
    the same bits on uniform, skewed and one-row inputs, then both timed, interleaved twice."""
    ok = True
    for name in models:
        n, k, e, m, act, bias = WIDE_SHAPES[name]
        t = time.time()
        fns = {s: get_grouped_gemm(act, n, k, e, bias_dtype=bias, schedule=s) for s in ("cooperative", "wide")}
        print(f"[wide] {name}: compiled both in {time.time() - t:.1f}s (raster_m {fns['wide'].raster_m})", flush=True)
        for m_, routing, seed in ((m, "uniform", 1), (4133, "skewed", 2), (1, "skewed", 3)):
            [same] = same_bits((fns["cooperative"], fns["wide"]), m_, n, k, e, act, routing, False, seed, bias)
            ok &= same
            print(f"[wide] {name} M={m_} {routing}: bit-identical to cooperative={same}", flush=True)
        ok &= check(fns["wide"], 5003, n, k, e, act, "skewed", False)  # and against the fp32 reference
        for r in range(2):
            for s in ("cooperative", "wide"):
                bench(fns[s], m, n, k, e, act, "uniform", False, iters=iters)
    return ok


def cluster(models, iters=20) -> bool:
    """Clusters of 2 CTAs (``cluster_m=2``: an m-tile pair per cluster, the weight tile's halves
    multicast into both) against single CTAs, on --model's FC1 and FC2 shapes (cooperative): the
    same bits on uniform, skewed (odd m-tile counts: the pair's second tile empty), few and one
    rows, then the float reference, then both timed, interleaved twice (torch._grouped_mm beside)."""
    ok = True
    for name in models:
        n1, k1, e, m, act, bias = WIDE_SHAPES[name]
        for n, k, a_, sr, bd in ((n1, k1, act, False, bias), (k1, n1 // 2, "identity", True, None)):
            t = time.time()
            fns = {c: get_grouped_gemm(a_, n, k, e, scale_rows=sr, bias_dtype=bd, cluster_m=c) for c in (1, 2)}
            print(f"[cluster] {name} {a_} N={n} K={k}: compiled both in {time.time() - t:.1f}s (raster_m "
                  f"{fns[2].raster_m}, {fns[2]._grid(None)} CTAs in clusters of 2)", flush=True)
            for m_, routing, seed in ((m, "uniform", 1), (4133, "skewed", 2), (300, "skewed", 4), (1, "skewed", 3)):
                [same] = same_bits((fns[1], fns[2]), m_, n, k, e, a_, routing, sr, seed, bd)
                ok &= same
                print(f"[cluster] {name} {a_} M={m_} {routing}: bit-identical to single CTAs={same}", flush=True)
            ok &= check(fns[2], 5003, n, k, e, a_, "skewed", sr)
            for _ in range(2):
                for c in (1, 2):
                    bench(fns[c], m, n, k, e, a_, "uniform", sr, iters=iters)
    return ok


class Variant(NamedTuple):
    """One compiled variant of a GEMM shape (the :func:`get_grouped_gemm` options it differs by)."""

    schedule: str
    tile_n: int
    cluster_n: int = 1
    jump_stages: bool = False


_PP192, _PP96 = Variant("pingpong", 192), Variant("pingpong", 96)
#: the variants, the first the baseline, that --pingpong (drop v71), --cluster-n (drop v72) and
#: --jump-stages (drop v79) compare, per GEMM (1 = FC1, 2 = FC2)
GEMM_VARIANTS = {
    "pingpong": {2: (Variant("cooperative", 256), _PP192)},
    "cluster_n": {2: (_PP192, _PP192._replace(cluster_n=2), Variant("cooperative", 256, cluster_n=2))},
    # FC1's default is cooperative 128-wide (gated; non-gated FC1 is pingpong 192 as FC2); the gated
    # pingpong tile is 96 (two 96-wide accumulators)
    "jump_stages": {2: (_PP192, _PP192._replace(jump_stages=True)),
                    1: (Variant("cooperative", 128), _PP96, _PP96._replace(jump_stages=True))},
}
#: a non-gated FC1 (squared_relu) runs on FC2's pingpong 192 tile: --jump-stages takes FC2's
#: variants for it
_NON_GATED_FC1 = {"jump_stages"}


def gemm_variants(models, variants, tag, iters=20) -> bool:
    """``variants`` ({1 | 2: (:class:`Variant`, ...)}, the first of each the baseline) on --model's
    FC1 (its activation and bias; swiglu with the tanh sigmoid, as the layer runs it; a non-gated
    FC1 takes FC2's variants) and FC2 (identity, row scale, the model's bias) shapes: the same bits as the baseline
    (NaN-poisoned outputs) on a layer's routing (topk8), an eighth of its rows, skewed and one row,
    then the float reference, then all timed on topk8 at both row counts, interleaved twice."""
    ok = True
    for name in models:
        n1, k1, e, m, act1, bias = WIDE_SHAPES[name]
        gated = act1 in GATED_ACTIVATIONS
        per_fc = dict(variants)
        if not gated and tag in _NON_GATED_FC1 and 2 in per_fc:
            per_fc[1] = per_fc[2]
        for fc, vs in sorted(per_fc.items()):
            n, k, act, sr = (n1, k1, act1, False) if fc == 1 else (k1, n1 // 2 if gated else n1, "identity", True)
            fns = {v: get_grouped_gemm(act, n, k, e, scale_rows=sr, bias_dtype=bias, schedule=v.schedule,
                                       tile_n=v.tile_n, cluster_n=v.cluster_n,
                                       jump_stages=v.jump_stages, tanh_sigmoid=act == "swiglu")
                   for v in vs}
            for m_, routing, seed in ((m, "topk8", 1), (m // 8, "topk8", 2), (4133, "skewed", 3), (1, "skewed", 4)):
                same = same_bits([fns[v] for v in vs], m_, n, k, e, act, routing, sr, seed, bias)
                ok &= all(same)
                print(f"[{tag}] {name} FC{fc} N={n} K={k} M={m_} {routing}: {list(vs[1:])} bit-identical to "
                      f"{vs[0]}: {same}", flush=True)
            for v in vs[1:]:
                ok &= check(fns[v], 5003, n, k, e, act, "skewed", sr)
            for _ in range(2):
                for m_ in (m, m // 8):
                    for v in vs:
                        bench(fns[v], m_, n, k, e, act, "topk8", sr, iters=iters)
    return ok


def tanh_sigmoid(models, iters=20) -> bool:
    """Drop v52: swiglu's sigmoid from one ``tanh.approx`` (``tanh_sigmoid``) against ``ex2`` + ``rcp``
    on --model's FC1 shapes (schedule wide, as the layer runs them): both against the fp32
    reference (rel. error < 1e-2, NaN-poisoned outputs) and against each other on a layer's routing
    (topk8), skewed and one row, then both timed, interleaved twice."""
    ok = True
    for name in models:
        n, k, e, m, act, bias = WIDE_SHAPES[name]
        if act != "swiglu":
            continue
        t = time.time()
        fns = {ts: get_grouped_gemm(act, n, k, e, bias_dtype=bias, schedule="wide", tanh_sigmoid=ts)
               for ts in (False, True)}
        print(f"[tanh] {name}: compiled both in {time.time() - t:.1f}s", flush=True)
        for m_, routing, seed in ((m, "topk8", 1), (4133, "skewed", 2), (1, "skewed", 3)):
            a, b, offs, rs, bs = make_inputs(m_, n, k, e, act, routing, False, seed=seed, bias_dtype=bias)
            ref = grouped_gemm_reference(a, b, offs, act, rs, bias=bs)
            outs = []
            for ts in (False, True):
                out = torch.full((m_, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
                fns[ts](a, b, offs, out=out, bias=bs)
                outs.append(out)
            torch.cuda.synchronize()
            den = max(ref.norm().item(), 1e-30)
            errs = [(o.float() - ref).norm().item() / den for o in outs]
            between = (outs[1].float() - outs[0].float()).norm().item() / den
            good = not bool(torch.isnan(outs[1]).any()) and errs[1] < 1e-2 and between < 1e-2
            ok &= good
            print(f"[tanh] {name} M={m_} {routing}: rel. error exact {errs[0]:.2e}, tanh {errs[1]:.2e}, "
                  f"between {between:.2e} -> {'PASS' if good else 'FAIL'}", flush=True)
        for _ in range(2):
            for ts in (False, True):
                print(f"[tanh] tanh_sigmoid={ts}", flush=True)
                bench(fns[ts], m, n, k, e, act, "topk8", False, iters=iters)
    return ok


#: (rows, routing, seed) the gathering comparisons check bits at: a layer's rows, skewed, few and one
GATHER_CHECKS = ((None, "uniform", 1), (4133, "skewed", 2), (300, "skewed", 4), (1, "skewed", 3))


def gathered_problem(m_total, n, k, experts, activation, routing, seed, bias_dtype=None):
    """``(b, offsets, bias, x, idx)``: fresh weights and routing for ``m_total`` grouped rows, and
    the ``m_total // 8`` (>= 1) source rows ``x`` [T, k] bf16 they gather by ``idx`` [m_total] int32."""
    _, b, offs, _, bias = make_inputs(m_total, n, k, experts, activation, routing, False, seed=seed,
                                      bias_dtype=bias_dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = max(1, m_total // 8)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, tokens, (m_total,), device="cuda", generator=g, dtype=torch.int32)
    return b, offs, bias, x, idx


def gathered_same_bits(plain, gathering, m_total, n, k, experts, activation, routing, seed, bias_dtype=None):
    """The plain FC1 on the rows copied into expert order, then each kernel of ``gathering`` reading
    them by index, each into its own NaN-poisoned output; per gathering kernel: bit-identical to the
    plain one and NaN-free."""
    b, offs, bias, x, idx = gathered_problem(m_total, n, k, experts, activation, routing, seed, bias_dtype)
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    outs = [torch.full((m_total, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
            for _ in range(1 + len(gathering))]
    plain(x.index_select(0, idx.long()), b, offs, out=outs[0], bias=bias)
    for fn, out in zip(gathering, outs[1:]):
        fn(x, b, offs, out=out, bias=bias, idx=idx)
    torch.cuda.synchronize()
    return [torch.equal(outs[0], o) and not bool(torch.isnan(o).any()) for o in outs[1:]]


def gathered_runs(plain, gathering, m_total, n, k, experts, activation, bias_dtype=None) -> dict:
    """``{label: no-argument launch}`` on one uniform problem of ``m_total`` rows: "copy rows" (the
    ``index_select`` into expert order the plain FC1 needs), "plain" (FC1 on the copied rows) and
    each ``gathering[label]`` reading the rows by index."""
    b, offs, bias, x, idx = gathered_problem(m_total, n, k, experts, activation, "uniform", 5, bias_dtype)
    idx64 = idx.long()
    xs = x.index_select(0, idx64)
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    out = torch.empty(m_total, n_out, dtype=torch.bfloat16, device="cuda")
    return {"copy rows": lambda: torch.index_select(x, 0, idx64, out=xs),
            "plain": lambda: plain(xs, b, offs, out=out, bias=bias),
            **{label: (lambda fn=fn: fn(x, b, offs, out=out, bias=bias, idx=idx)) for label, fn in gathering.items()}}


def time_rounds(runs: dict, timers: dict, rounds: int = 2) -> dict:
    """``{(label, timer): best ms}``: every run under every ``timers[timer](run)``, interleaved over
    ``rounds`` rounds; the best round of each."""
    times = {(label, t): [] for label in runs for t in timers}
    for _ in range(rounds):
        for label, run in runs.items():
            for t, timer in timers.items():
                times[(label, t)].append(timer(run))
    return {key: min(v) for key, v in times.items()}


def report_rounds(tag: str, name: str, m: int, runs: dict, flops: float, iters: int) -> None:
    """Time ``runs`` (``{label: launch}``) interleaved over two rounds (:func:`time_rounds`, CUDA-event
    medians of ``iters``) and print each label's best ms, with TFLOP/s at ``flops`` for all but the
    row copy."""
    from .fp8_runner import time_fn  # CUDA-event median after warm-ups, as the FP8 runner times

    best = time_rounds(runs, {"": lambda run: time_fn(run, iters)})
    print(f"[{tag}] {name} M={m}: " + ", ".join(
        f"{label} {best[(label, '')]:.3f} ms"
        + ("" if label == "copy rows" else f" ({flops / best[(label, '')] / 1e9:.1f} TFLOP/s)")
        for label in runs) + f" (best of 2 interleaved rounds, median of {iters})", flush=True)


def gather(models, iters=20) -> bool:
    """Drop v23: FC1 gathering its A rows by index (cp.async) against the plain FC1 on the rows
    copied into expert order, on --model's FC1 shapes: the same bits (NaN-poisoned outputs) on
    uniform, skewed, few and one rows, then the row copy (``index_select``), the plain FC1 and the
    gathering FC1 timed, interleaved twice."""
    ok = True
    for name in models:
        n, k, e, m, act, bias = WIDE_SHAPES[name]
        plain = CompiledGroupedGemm(act, n, k, e, False, bias_dtype=bias)
        gathering = CompiledGroupedGemm(act, n, k, e, False, bias_dtype=bias, gather_a=True)
        for m_, routing, seed in GATHER_CHECKS:
            same = all(gathered_same_bits(plain, (gathering,), m_ or m, n, k, e, act, routing, seed, bias))
            ok &= same
            print(f"[gather] {name} M={m_ or m} {routing}: gathering = plain on copied rows: {same}", flush=True)
        runs = gathered_runs(plain, {"gathering": gathering}, m, n, k, e, act, bias)
        report_rounds("gather", name, m, runs, 2.0 * m * n * k, iters)
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m-total", type=int, default=65536)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed", "topk8"])
    p.add_argument("--scale-rows", action="store_true")
    p.add_argument("--tile-n", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--epilogue", default="smem", choices=["smem", "direct"])
    p.add_argument("--bias", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--raster-m", type=int, default=None)
    p.add_argument("--schedule", default="cooperative", choices=["cooperative", "pingpong", "wide"])
    p.add_argument("--wide", action="store_true", help="schedule wide vs cooperative on --model's FC1 shapes")
    p.add_argument("--model", default="qwen3,mixtral", help=f"--wide, --cluster: comma list of {sorted(WIDE_SHAPES)}")
    p.add_argument("--cluster", action="store_true",
                   help="clusters of 2 (weight multicast) vs single CTAs on --model's FC1 and FC2 shapes")
    p.add_argument("--pingpong", action="store_true",
                   help="pingpong 128 x 192 vs cooperative 128 x 256 on --model's FC2 shapes (drop v71)")
    p.add_argument("--cluster-n", action="store_true",
                   help="FC2 in clusters of 2 along N (A multicast) vs pingpong 128 x 192 alone (drop v72)")
    p.add_argument("--jump-stages", action="store_true",
                   help="pingpong skipping the other warpgroup's stages in one step (drop v79) vs unrolled, "
                        "on --model's FC1 and FC2 shapes (FC1: cooperative 128 beside)")
    p.add_argument("--tanh-sigmoid", action="store_true",
                   help="swiglu's sigmoid by tanh.approx vs ex2 + rcp on --model's FC1 shapes (drop v52)")
    p.add_argument("--gather", action="store_true",
                   help="FC1 gathering rows by index vs the row copy + plain FC1, on --model's FC1 shapes (drop v23)")
    p.add_argument("--raster-bench", action="store_true", help="--suite --bench: also raster_m=1 vs default")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--suite", action="store_true")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    if args.suite:
        raise SystemExit(0 if suite(args) else 1)
    if args.wide:
        raise SystemExit(0 if wide(args.model.split(",")) else 1)
    if args.cluster:
        raise SystemExit(0 if cluster(args.model.split(",")) else 1)
    if args.pingpong or args.cluster_n or args.jump_stages:
        tag = next(t for t in GEMM_VARIANTS if getattr(args, t))
        raise SystemExit(0 if gemm_variants(args.model.split(","), GEMM_VARIANTS[tag], tag) else 1)
    if args.tanh_sigmoid:
        raise SystemExit(0 if tanh_sigmoid(args.model.split(",")) else 1)
    if args.gather:
        raise SystemExit(0 if gather(args.model.split(",")) else 1)
    t = time.time()
    fn = get_grouped_gemm(args.activation, args.n, args.k, args.experts, scale_rows=args.scale_rows,
                          tile_n=args.tile_n, num_stages=args.num_stages, epilogue=args.epilogue,
                          bias_dtype=args.bias, raster_m=args.raster_m, schedule=args.schedule)
    print(f"[compile] {time.time()-t:.2f}s", flush=True)
    ok = check(fn, args.m_total, args.n, args.k, args.experts, args.activation, args.routing,
               args.scale_rows)
    if args.bench:
        bench(fn, args.m_total, args.n, args.k, args.experts, args.activation, args.routing,
              args.scale_rows)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
