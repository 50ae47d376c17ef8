"""Correctness (+ optional benchmark) runner for the sm120_mxfp8 kernels.

On an SM120 GPU (RTX PRO 6000 / RTX 50xx) the kernels run on random inputs and are compared
with the torch references (quantiser: bit for bit; GEMM: relative error of the bf16 output).
Without one, the references run on CPU, every variant is compiled for sm_120a, and small
shapes go through the CPU emulation of the GEMM's index maps (emulate.py).

    python -m sm120_mxfp8.grouped_gemm_runner --suite
    python -m sm120_mxfp8.grouped_gemm_runner --m-total 1024 --n 1536 --k 2048 --experts 128 \\
        --epilogue swiglu --tile-tokens 16 --routing skewed --bench
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch

from .constants import DEFAULT_TILE_TOKENS, EPILOGUES
from .grouped_gemm import Mxfp8GroupedGemmSm120, out_features
from .reference import grouped_gemm_reference, quantize_rows_reference


def have_sm120() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 12


def make_offsets(m_total: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """[E+1] int32 CPU offsets. uniform: near-equal counts; skewed: Zipf-like with ~1/8 of the
    experts empty; edge: an empty expert, a 1-token expert, the rest uniform."""
    if routing == "uniform":
        counts = torch.full((experts,), m_total // experts, dtype=torch.int64)
        counts[: m_total - int(counts.sum())] += 1
    elif routing == "skewed":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        p = p[torch.randperm(experts, generator=gen)]
        p[torch.randperm(experts, generator=gen)[: max(1, experts // 8)]] = 0.0
        if float(p.sum()) == 0.0:
            p[0] = 1.0
        counts = (torch.multinomial(p / p.sum(), m_total, replacement=True, generator=gen)
                  .bincount(minlength=experts) if m_total else torch.zeros(experts, dtype=torch.int64))
    elif routing == "edge":
        if experts < 3 or m_total < 1:
            raise ValueError("edge routing needs >= 3 experts and >= 1 token")
        counts = torch.zeros(experts, dtype=torch.int64)
        counts[1] = 1
        rest = m_total - 1
        counts[2:] = rest // (experts - 2)
        counts[2: 2 + rest - int(counts[2:].sum())] += 1
    else:
        raise ValueError(routing)
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(counts, 0)
    assert int(offs[-1]) == m_total
    return offs.to(torch.int32)


def make_inputs(m_total: int, n: int, k: int, experts: int, routing: str, seed: int = 0,
                device: str = "cpu"):
    """Random bf16 activations / weights quantised with the reference rule. Returns
    (x_bf16, x, x_scale, w, w_scale, offsets, row_scale), all on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x_bf16 = torch.randn(m_total, k, generator=gen).to(torch.bfloat16)
    w_bf16 = (torch.randn(experts * n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    x, xs = quantize_rows_reference(x_bf16)
    w, ws = quantize_rows_reference(w_bf16)
    w, ws = w.reshape(experts, n, k), ws.reshape(experts, n, k // 32)
    offs = make_offsets(m_total, experts, routing, gen)
    rs = torch.rand(m_total, generator=gen)
    return tuple(t.to(device) for t in (x_bf16, x, xs, w, ws, offs, rs))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = ref.norm().item()
    return (out.float() - ref).norm().item() / d if d > 0 else out.float().norm().item()


def check_gemm_gpu(epilogue: str, m_total: int, n: int, k: int, experts: int, routing: str,
                   tile_tokens: int, consts: Optional[dict] = None, seed: int = 0, bench: bool = False) -> bool:
    """``consts``: the activation constants (clamped_swiglu's, softcapped_swiglu's; drop v2)."""
    from .launch import get_mxfp8_gemm

    consts = consts or {}
    _, x, xs, w, ws, offs, rs = make_inputs(m_total, n, k, experts, routing, seed, "cuda")
    fn = get_mxfp8_gemm(epilogue, n, k, experts, tile_tokens, **consts)
    out = torch.full((m_total, out_features(epilogue, n)), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    row_scale = rs if epilogue == "row_scale" else None
    fn(x, xs, w, ws, offs, out=out, row_scale=row_scale)
    torch.cuda.synchronize()
    ref = grouped_gemm_reference(x, xs, w, ws, offs, epilogue, row_scale, **consts)
    nan = bool(torch.isnan(out).any()) if m_total else False
    rel = _rel(out, ref)
    ok = not nan and rel < 1e-2
    msg = (f"[gemm] {epilogue:9s} M={m_total:6d} N={n} K={k} E={experts} {routing:7s} "
           f"tile_tokens={tile_tokens:3d}{' ' + str(consts) if consts else ''} rel_err={rel:.2e} nan={nan} "
           f"-> {'PASS' if ok else 'FAIL'}")
    if bench and ok:
        for _ in range(3):
            fn(x, xs, w, ws, offs, out=out, row_scale=row_scale)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 20
        ev0.record()
        for _ in range(iters):
            fn(x, xs, w, ws, offs, out=out, row_scale=row_scale)
        ev1.record()
        torch.cuda.synchronize()
        ms = ev0.elapsed_time(ev1) / iters
        active = int((offs[1:] - offs[:-1] > 0).sum())
        wbytes = active * n * k * (1 + 1 / 32)
        msg += (f"  {ms * 1e3:.1f} us  {2 * m_total * n * k / ms / 1e9:.1f} TFLOP/s  "
                f"weights {wbytes / ms / 1e6:.0f} GB/s")
    print(msg, flush=True)
    return ok


def check_quantize_gpu(m: int, k: int, seed: int = 0) -> bool:
    from .launch import quantize_rows

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=gen)))
    x = x.to(torch.bfloat16)
    x[0, :32] = 0  # a zero block
    x = x.cuda()
    v, s = quantize_rows(x)
    torch.cuda.synchronize()
    rv, rsc = quantize_rows_reference(x)
    ok = torch.equal(v.view(torch.uint8), rv.view(torch.uint8)) and torch.equal(
        s.view(torch.uint8), rsc.view(torch.uint8))
    print(f"[quant] M={m} K={k} bit-identical={ok} -> {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def check_cpu(epilogue: str, m_total: int, n: int, k: int, experts: int, routing: str,
              tile_tokens: int, consts: Optional[dict] = None, emulate: bool = False, seed: int = 0) -> bool:
    """No SM120 GPU: reference on CPU, compile for sm_120a, optionally emulate (small shapes)."""
    from .launch import activation_constants, compile_mxfp8_gemm

    consts = activation_constants(epilogue, **(consts or {}))
    _, x, xs, w, ws, offs, rs = make_inputs(m_total, n, k, experts, routing, seed)
    row_scale = rs if epilogue == "row_scale" else None
    t0 = time.time()
    ref = grouped_gemm_reference(x, xs, w, ws, offs, epilogue, row_scale, **consts)
    t_ref = time.time() - t0
    t0 = time.time()
    _, kern = compile_mxfp8_gemm(epilogue, n, k, experts, tile_tokens, return_kernel=True, **consts)
    t_compile = time.time() - t0
    msg = (f"[cpu] {epilogue:9s} M={m_total} N={n} K={k} E={experts} {routing} "
           f"tile_tokens={tile_tokens}: reference {t_ref:.2f}s, sm_120a compile {t_compile:.2f}s "
           f"({kern.num_stages} stages, {kern.smem_bytes} B smem)")
    ok = bool(torch.isfinite(ref).all())
    if emulate:
        from .emulate import emulate_grouped_gemm

        em = emulate_grouped_gemm(Mxfp8GroupedGemmSm120(epilogue, tile_tokens, **consts), x, xs, w, ws, offs,
                                  row_scale)
        err = (em - ref.double()).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        ok = ok and err < 1e-5
        msg += f", emulation max rel err {err:.1e}"
    print(msg + (" -> PASS" if ok else " -> FAIL"), flush=True)
    return ok


_V2_CLAMP = {"swiglu_alpha": 1.0, "swiglu_limit": 10.0, "swiglu_beta": 0.0}  # DeepSeek-V4's constants

SUITE = [  # (epilogue, M_total, N, K, E, routing, tile_tokens[, activation constants])
    ("swiglu", 1024, 1536, 2048, 128, "uniform", 8),       # Qwen3-30B-A3B decode, 128 tokens x 8
    ("swiglu", 1024, 1536, 2048, 128, "skewed", 16),
    ("row_scale", 1024, 2048, 768, 128, "skewed", 16),
    ("swiglu", 8192, 1536, 2048, 128, "uniform", 64),      # prefill
    ("row_scale", 8192, 2048, 768, 128, "uniform", 128),
    ("identity", 300, 136, 256, 5, "edge", 16),            # ragged N, empty + 1-token experts
    ("swiglu", 300, 144, 256, 5, "edge", 32),
    ("gelu_glu", 1024, 1536, 2048, 128, "skewed", 16),          # drop v2's gated epilogues
    ("gelu_tanh_glu", 1024, 1536, 2048, 128, "skewed", 16),
    ("clamped_swiglu", 1024, 4096, 4096, 32, "skewed", 32, _V2_CLAMP),  # DeepSeek-V4 shard FC1
    ("clamped_swiglu", 1024, 1536, 2048, 128, "skewed", 16),    # gpt-oss's constants
    ("softcapped_swiglu", 1024, 4608, 4608, 48, "skewed", 32),  # Inkling2 shard FC1
]
CPU_SUITE = [  # small enough for the emulation
    ("swiglu", 40, 144, 256, 5, "edge", 8),
    ("gelu_tanh_glu", 40, 144, 256, 5, "edge", 16),
    ("clamped_swiglu", 40, 144, 256, 5, "edge", 8, {"swiglu_limit": 0.5, "swiglu_limit_after_act": True}),
    ("softcapped_swiglu", 40, 144, 256, 5, "edge", 8, {"gate_softcap": 0.5, "up_softcap": 0.25}),
    ("row_scale", 40, 136, 256, 5, "edge", 16),
    ("identity", 140, 136, 256, 4, "skewed", 128),
]


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="store_true")
    ap.add_argument("--epilogue", choices=EPILOGUES, default="swiglu")
    ap.add_argument("--m-total", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--routing", choices=("uniform", "skewed", "edge"), default="uniform")
    ap.add_argument("--tile-tokens", type=int, default=DEFAULT_TILE_TOKENS)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--emulate", action="store_true", help="CPU: also run the emulation")
    args = ap.parse_args(argv)
    ok = True
    if have_sm120():
        cases = SUITE if args.suite else [(args.epilogue, args.m_total, args.n, args.k,
                                           args.experts, args.routing, args.tile_tokens)]
        for c in cases:
            ok &= check_gemm_gpu(*c[:7], consts=c[7] if len(c) > 7 else None, bench=args.bench)
        for m, k in ((1, 2048), (1000, 2048), (4096, 768)):
            ok &= check_quantize_gpu(m, k)
    else:
        print("no SM120 GPU: CPU references, sm_120a compiles and the emulation")
        if args.suite:
            for c in CPU_SUITE:
                ok &= check_cpu(*c[:7], consts=c[7] if len(c) > 7 else None, emulate=True)
        else:
            ok &= check_cpu(args.epilogue, args.m_total, args.n, args.k, args.experts,
                            args.routing, args.tile_tokens, emulate=args.emulate)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
