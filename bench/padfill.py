"""``python -m moe_ep.bench padfill`` -- does what the partial m-tiles' spare rows hold cost energy?

Why: at the 700 W cap a GEMM's speed is its energy per FLOP (docs/LIMITS.md). The grouped rows are
packed (expert ``e`` owns rows ``[offsets[e], offsets[e+1])``), so the last m-tile of an expert
multiplies up to 127 rows of the NEXT expert's tokens and masks them at the store: on Qwen3's
routing 579 m-tiles carry 512 tiles' worth of rows, so ~12% of the tensor work is on rows that are
thrown away -- with real, random data, i.e. full switching energy. If those rows held zeros the
multiplier inputs would not toggle there. This job measures whether that matters, with the GEMMs as
they are (no kernel change):

* ``packed``: the layer's layout (tails compute the next expert's rows);
* ``padded, zero tails``: each expert starts at a multiple of the m-tile (128) and the rows between
  its end and the next start are zeros;
* ``padded, random tails``: the same offsets, the spare rows random (what ``packed`` computes on).

The padded variants run the same m-tiles as ``packed`` (an expert needs ceil(rows / 128) tiles
either way) and store the spare rows too (zeros or garbage; FC2's row scale there is 0). So
``zero`` against ``random`` isolates the data's energy; ``random`` against ``packed`` the cost of the
spare rows' stores. Each GEMM runs back to back for ``--seconds`` after ``--warm-seconds`` (the
``sustained`` job's windows, ``nvidia-smi`` beside), on the bench's routing for the model (seed
``--seed``), interleaved for ``--rounds`` rounds; TFLOP/s counts the real rows only, the same work
in every variant. Each output is first checked against float32 on the first and last expert's rows.

Fifty-sixth session (H100): zero spare rows 0.3-2.3% faster than random ones, but the padded layout's
extra bytes take most or all of it back, and TMA zero fill through per-tile descriptors cost more
than it saved (docs/LIMITS.md, "A fourth idea measured").
"""

from __future__ import annotations

import numpy as np
import torch

from .models import MODELS, draw_routing
from .sustained import _rel_err, _swiglu, power_columns, print_untimed, timed_rounds

TILE_M = 128


def padded_layout(counts, tile_m: int = TILE_M):
    """``(packed offsets [E+1], padded offsets [E+1], dst [M])`` for rows per expert ``counts``:
    packed row ``r`` of expert ``e`` goes to padded row ``dst[r]``; every padded expert starts at a
    multiple of ``tile_m``. numpy int64."""
    counts = np.asarray(counts, dtype=np.int64)
    packed = np.concatenate([[0], np.cumsum(counts)])
    padded = np.concatenate([[0], np.cumsum(-(-counts // tile_m) * tile_m)])
    dst = np.concatenate([padded[e] + np.arange(c) for e, c in enumerate(counts)]) if counts.sum() else \
        np.zeros(0, dtype=np.int64)
    return packed, padded, dst.astype(np.int64)


def _variants(H: int, I: int, E: int, counts, quant, seed: int, dev: str = "cuda"):  # noqa: E741
    """``[(gemm, layout, flops, fn, check)]`` for FC1 and FC2 in the three layouts."""
    from moe_ep.api.quant import dequantize_fp8_rows128, quantize_fp8_block128, quantize_fp8_rows128
    from moe_ep.backends.sm90.bf16_cutedsl import grouped_gemm
    from moe_ep.backends.sm90.fp8_cutedsl import grouped_gemm_fp8

    packed, padded, dst = padded_layout(counts)
    M, Mp = int(packed[-1]), int(padded[-1])
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    dst_t = torch.from_numpy(dst).to(dev)
    offs = {"packed": torch.from_numpy(packed).to(dev, torch.int32)}
    offs["padded, zero tails"] = offs["padded, random tails"] = torch.from_numpy(padded).to(dev, torch.int32)
    w13 = (randn(E, 2 * I, H) * H ** -0.5).to(torch.bfloat16)
    w2 = (randn(E, H, I) * I ** -0.5).to(torch.bfloat16)
    rs = torch.rand(M, generator=gen, device=dev) + 0.5

    def layouts(a: torch.Tensor) -> dict:
        """The packed rows ``a [M, k]`` in each layout (the same real rows everywhere)."""
        zero = torch.zeros(Mp, a.shape[1], dtype=a.dtype, device=dev)
        rand = randn(Mp, a.shape[1]).to(a.dtype)
        zero[dst_t], rand[dst_t] = a, a
        return {"packed": a, "padded, zero tails": zero, "padded, random tails": rand}

    x, h = layouts(randn(M, H).to(torch.bfloat16)), layouts(randn(M, I).to(torch.bfloat16))
    rs_l = {"packed": rs}
    rs_l["padded, zero tails"] = rs_l["padded, random tails"] = torch.zeros(Mp, device=dev).index_copy_(0, dst_t, rs)
    lo_hi = [(int(packed[e]), int(packed[e + 1])) for e in (0, E - 1)]
    out = []
    if quant is None:
        fc1, fc2 = grouped_gemm("swiglu", 2 * I, H, E), grouped_gemm("identity", H, I, E, scale_rows=True)
        w13_f, w2_f = w13, w2
    else:
        fc1, fc2 = grouped_gemm_fp8("swiglu", 2 * I, H, E), grouped_gemm_fp8("identity", H, I, E, scale_rows=True)
        w13q, w2q = quantize_fp8_block128(w13), quantize_fp8_block128(w2)

        def deq(wq):
            s = wq.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
            return wq.values.float() * s[:, : wq.values.shape[1], : wq.values.shape[2]]

        w13_f, w2_f = deq(w13q), deq(w2q)
        x = {k: quantize_fp8_rows128(v) for k, v in x.items()}
        h = {k: quantize_fp8_rows128(v) for k, v in h.items()}
    for name in ("packed", "padded, zero tails", "padded, random tails"):
        rows = M if name == "packed" else Mp
        o1 = torch.empty(rows, I, dtype=torch.bfloat16, device=dev)
        o2 = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
        real = (lambda t: t) if name == "packed" else (lambda t: t[dst_t])
        if quant is None:
            run1 = (lambda a=x[name], o=o1, f=offs[name]: fc1(a, w13, f, out=o))
            run2 = (lambda a=h[name], o=o2, f=offs[name], s=rs_l[name]: fc2(a, w2, f, out=o, row_scale=s))
            a1 = real(x[name]).float()
            a2 = real(h[name]).float()
        else:
            run1 = (lambda a=x[name], o=o1, f=offs[name], s=rs_l[name]:
                    fc1(a[0], a[1], w13q.values, w13q.scale, f, out=o, row_scale=s[:1]))
            run2 = (lambda a=h[name], o=o2, f=offs[name], s=rs_l[name]:
                    fc2(a[0], a[1], w2q.values, w2q.scale, f, out=o, row_scale=s))
            a1 = real(dequantize_fp8_rows128(*x[name]))
            a2 = real(dequantize_fp8_rows128(*h[name]))

        def check1(o=o1, a=a1, real=real):
            got = real(o)
            return max(_rel_err(got[lo:hi], _swiglu(a[lo:hi] @ w13_f[e].float().t())) for e, (lo, hi) in
                       zip((0, E - 1), lo_hi))

        def check2(o=o2, a=a2, real=real):
            got = real(o)
            return max(_rel_err(got[lo:hi], (a[lo:hi] @ w2_f[e].float().t()) * rs[lo:hi, None])
                       for e, (lo, hi) in zip((0, E - 1), lo_hi))

        out.append(("FC1", name, 2.0 * M * H * 2 * I, run1, check1))
        out.append(("FC2", name, 2.0 * M * I * H, run2, check2))
    return out, M, Mp


def run_padfill(args) -> int:
    if not torch.cuda.is_available():
        print("moe_ep.bench padfill: needs a CUDA GPU (SM90); nothing to do here")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    for key in args.model:
        m = MODELS[key]
        H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]  # noqa: E741
        T = args.tokens if args.tokens is not None else 8192
        _, ids = draw_routing(torch.Generator().manual_seed(args.seed), E, K, T, skew=args.skew)
        counts = np.bincount(ids.flatten().numpy(), minlength=E)
        kernels, M, Mp = _variants(H, I, E, counts, args.quant, args.seed)
        print(f"\n{m['name']} {args.quant or 'bf16'}: {M} rows, {Mp} padded ({Mp // TILE_M} m-tiles, "
              f"{100 * (Mp - M) / Mp:.1f}% spare rows); {args.seconds:.1f} s each after {args.warm_seconds:.1f} s, "
              f"{args.rounds} round(s), GPU {torch.cuda.get_device_name()}")
        print(f"{'GEMM':<5}{'layout':<22}{'round':>6}{'ms':>8}{'TFLOP/s':>9}{'W':>7}{'SM MHz':>8}{'capped':>8}"
              f"{'GFLOP/J':>9}{'rel.err':>9}")
        ok, spans, samples = timed_rounds([(g, n, f, fn, [()], c) for g, n, f, fn, c in kernels], args.rounds,
                                          args.seconds, args.warm_seconds)
        for gemm, name, flops, r, ms, n, t0, t1 in sorted(spans, key=lambda s: (s[0], s[1], s[3])):
            tf = flops / ms / 1e9
            w, mhz, cap_s = power_columns(samples, t0, t1)
            print(f"{gemm:<5}{name:<22}{r:>6}{ms:8.3f}{tf:9.1f}{w:7.0f}{mhz:8.0f}{cap_s}{tf / w * 1e3:9.0f}"
                  f"{ok[gemm, name]:9.1e}")
        print_untimed(ok, 22)
        del kernels
        torch.cuda.empty_cache()
    return 0
