"""Correctness (and timing) runner for the W4A16 grouped GEMM.

    python -m sm100_w4a16.grouped_gemm_runner --suite                    # every epilogue, ragged routing
    python -m sm100_w4a16.grouped_gemm_runner --epilogue squared_relu --n 1856 --k 2688 \
        --experts 128 --m-total 8192 --bench

On an SM100 GPU it launches the kernel and compares with ``reference.py`` (relative Frobenius
error < 1e-2: the output is bf16; W is exact in bf16 after the dequant, so the only other
difference is the summation order). Without one (CPU, or another GPU) it runs the torch reference
and the sm_100a compile only, and says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional

import torch

from .constants import EPILOGUES, GATED_EPILOGUES
from .reference import w4a16_grouped_gemm_reference


def make_offsets(m_total: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """[E+1] int32 CPU offsets. uniform: near-equal counts; skewed: Zipf-like, >= 1 empty expert."""
    if routing == "uniform":
        counts = torch.full((experts,), m_total // experts, dtype=torch.int64)
        counts[: m_total - int(counts.sum())] += 1
    elif routing == "skewed":
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(experts, generator=gen)]
        w[torch.randperm(experts, generator=gen)[: max(1, experts // 8)]] = 0.0  # empty experts
        if float(w.sum()) == 0.0:
            w[0] = 1.0
        counts = (torch.multinomial(w / w.sum(), m_total, replacement=True, generator=gen)
                  .bincount(minlength=experts) if m_total > 0 else torch.zeros(experts, dtype=torch.int64))
    else:
        raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(counts, 0)
    return offs.to(torch.int32)


def make_nvfp4_weights(experts: int, n: int, k: int, gen: torch.Generator):
    """Random NVFP4 weights in moe_ep's layout: (values [E, N, K/2] uint8, block_scale
    [E, N, K/16] float8_e4m3fn, global_scale [E] float32). Scales are finite, positive and span
    e4m3's normal and subnormal range; every E2M1 code (both signs, both zeros) occurs."""
    values = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    exps = torch.randint(-9, 5, (experts, n, k // 16), generator=gen).double()
    mant = 1.0 + torch.rand(experts, n, k // 16, generator=gen, dtype=torch.float64)
    block_scale = (mant * torch.pow(2.0, exps) * (1.0 / k) ** 0.5).float().to(torch.float8_e4m3fn)
    global_scale = (0.5 + torch.rand(experts, generator=gen)).float()
    return values, block_scale, global_scale


def make_inputs(m_total: int, n: int, k: int, experts: int, epilogue: str, routing: str,
                seed: int = 0, device: str = "cpu", bias_dtype=None):
    """(a, values, block_scale, global_scale, offsets, row_scale, bias) on ``device`` (bias: [E, N] of
    ``bias_dtype``, or None)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m_total, k, generator=gen).to(torch.bfloat16)
    values, block_scale, global_scale = make_nvfp4_weights(experts, n, k, gen)
    offs = make_offsets(m_total, experts, routing, gen)
    rs = torch.rand(m_total, generator=gen) if epilogue == "row_scale" else None
    bias = None if bias_dtype is None else (2.0 * torch.randn(experts, n, generator=gen)).to(bias_dtype)
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return mv(a), mv(values), mv(block_scale), mv(global_scale), mv(offs), mv(rs), mv(bias)


def sm100_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def check(epilogue: str, m_total: int, n: int, k: int, experts: int, routing: str,
          seed: int = 0, tile_n: Optional[int] = None, constants: Optional[dict] = None,
          bias_dtype=None) -> bool:
    """Run one case; on a GPU compare kernel vs reference, else reference + compile only.
    ``constants``: the activation constants (clamped_swiglu's, softcapped_swiglu's; drop v3);
    ``bias_dtype``: a per-expert bias of that dtype (drop v4)."""
    from .launch import compile_w4a16_gemm, get_w4a16_gemm

    constants = constants or {}
    gpu = sm100_available()
    dev = "cuda" if gpu else "cpu"
    a, values, bs, gs, offs, rs, bias = make_inputs(m_total, n, k, experts, epilogue, routing, seed, dev,
                                                    bias_dtype)
    ref = w4a16_grouped_gemm_reference(a, values, bs, gs, offs, epilogue, rs, bias, **constants)
    tag = (f"{epilogue:12s} M={m_total:6d} N={n} K={k} E={experts} routing={routing:7s} "
           f"tile_n={tile_n}{' ' + str(constants) if constants else ''}"
           f"{' bias ' + str(bias_dtype) if bias_dtype is not None else ''}")
    if not gpu:
        t0 = time.time()
        compiled = compile_w4a16_gemm(epilogue, n, k, experts, tile_n=tile_n, bias_dtype=bias_dtype, **constants)
        ok = "tcgen05.mma" in compiled.__ptx__ and bool(torch.isfinite(ref).all())
        print(f"[cpu ] {tag}: reference |ref|={ref.norm():.3e}, sm_100a compile {time.time() - t0:.1f}s "
              f"(no SM100 GPU: kernel not run) -> {'OK' if ok else 'FAIL'}", flush=True)
        return ok
    fn = get_w4a16_gemm(epilogue, n, k, experts, tile_n=tile_n, bias_dtype=bias_dtype, **constants)
    n_out = n // 2 if epilogue in GATED_EPILOGUES else n
    out = torch.full((m_total, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(a, values, bs, gs, offs, row_scale=rs, out=out, bias=bias)
    torch.cuda.synchronize()
    nan = bool(torch.isnan(out).any()) if m_total else False
    denom = ref.norm().item()
    rel = (out.float() - ref).norm().item() / denom if denom > 0 else out.float().norm().item()
    ok = (not nan) and rel < 1e-2
    print(f"[gpu ] {tag}: rel_err={rel:.3e} nan={nan} -> {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def bench(epilogue: str, m_total: int, n: int, k: int, experts: int, routing: str,
          iters: int = 20, tile_n: Optional[int] = None, constants: Optional[dict] = None) -> float:
    """Median kernel time (s) over ``iters`` launches; prints TFLOP/s and weight GB/s."""
    from .launch import get_w4a16_gemm, to_cute_args

    a, values, bs, gs, offs, rs, _ = make_inputs(m_total, n, k, experts, epilogue, routing, 0, "cuda")
    fn = get_w4a16_gemm(epilogue, n, k, experts, tile_n=tile_n, **(constants or {}))
    out = torch.empty(m_total, fn.n_out, dtype=torch.bfloat16, device="cuda")
    args = to_cute_args(a, values, bs, gs, offs, rs if rs is not None else fn._placeholder("cuda"), out)
    for _ in range(3):
        fn.launch_converted(args)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn.launch_converted(args)
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    t = statistics.median(s.elapsed_time(e) for s, e in ts) * 1e-3
    wbytes = values.numel() + bs.numel()
    print(f"[bench] {epilogue} M={m_total} N={n} K={k} E={experts}: {t * 1e3:.3f} ms, "
          f"{2.0 * m_total * n * k / t / 1e12:.1f} TFLOP/s, weights {wbytes / t / 1e9:.0f} GB/s", flush=True)
    return t


SUITE = [
    # (epilogue, M_total, N, K, E, routing, tile_n[, activation constants[, bias dtype]])
    ("squared_relu", 3000, 1856, 2688, 16, "skewed", None),      # Nemotron FC1 shape
    ("row_scale", 3000, 2688, 1856, 16, "skewed", None),         # Nemotron FC2 shape
    ("swiglu", 2000, 2 * 512, 1024, 8, "skewed", None),
    ("gelu_glu", 1500, 2 * 704, 2816, 8, "skewed", None),      # drop v2: Gemma 4's FC1 shape
    ("gelu_tanh_glu", 1500, 2 * 704, 2816, 8, "skewed", None),
    ("clamped_swiglu", 1500, 2 * 512, 1024, 8, "skewed", None),   # drop v3: gpt-oss's constants
    ("clamped_swiglu", 1500, 2 * 512, 1024, 8, "skewed", None,    # DeepSeek-V4's (beta 0), Step-3.7's order
     {"swiglu_beta": 0.0, "swiglu_limit": 10.0, "swiglu_alpha": 1.0, "swiglu_limit_after_act": True}),
    ("softcapped_swiglu", 1500, 2 * 512, 1024, 8, "skewed", None),  # Inkling2's caps
    ("clamped_swiglu", 1500, 2 * 512, 1024, 8, "skewed", None, {}, "float32"),  # drop v4: gpt-oss's biases
    ("row_scale", 1500, 1024, 512, 8, "skewed", None, {}, "bfloat16"),
    ("squared_relu", 777, 200, 256, 5, "uniform", 64, {}, "bfloat16"),   # ragged N tile: clamped bias loads
    ("identity", 777, 200, 256, 5, "uniform", 64),                # ragged N tile
    ("squared_relu", 1, 1856, 2688, 16, "skewed", None),          # decode: one row
    ("row_scale", 515, 384, 512, 3, "uniform", 256),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="store_true")
    ap.add_argument("--epilogue", default="squared_relu", choices=EPILOGUES)
    ap.add_argument("--m-total", type=int, default=4096)
    ap.add_argument("--n", type=int, default=1856)
    ap.add_argument("--k", type=int, default=2688)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--routing", default="skewed", choices=("uniform", "skewed"))
    ap.add_argument("--tile-n", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args(argv)
    if not sm100_available():
        print("no SM100 GPU: running the torch reference and the sm_100a compile only")
    cases = SUITE if args.suite else [(args.epilogue, args.m_total, args.n, args.k, args.experts,
                                        args.routing, args.tile_n)]
    ok = True
    for epi, m, n, k, e, routing, tn, *consts in cases:
        bias_dtype = getattr(torch, consts[1]) if len(consts) > 1 else None
        consts = consts[0] if consts else None
        ok &= check(epi, m, n, k, e, routing, seed=args.seed, tile_n=tn, constants=consts, bias_dtype=bias_dtype)
        if args.bench and sm100_available():
            bench(epi, m, n, k, e, routing, tile_n=tn, constants=consts)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
