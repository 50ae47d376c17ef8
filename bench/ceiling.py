"""``python -m moe_ep.bench ceiling`` -- what a layer's GEMMs alone allow on this GPU, in layer TFLOP/s.

A MoE layer's FLOPs (6·T·K·H·I for a gated activation) are all in its two expert GEMMs, FC1
``[T·K, H] x [H, 2I]`` and FC2 ``[T·K, I] x [I, H]``. This job times the same two GEMMs done by
torch's own kernels, on random data, and converts the time into the layer speed it would give if
the layer were nothing else (no routing, no activation, no row copies, no combine):

* ``dense bf16``: two plain ``torch.mm`` over all T·K rows with one weight (cuBLAS). Not a MoE --
  one weight for every row, no expert boundaries -- so an upper bound for any grouped kernel;
* ``grouped bf16``: ``torch._grouped_mm`` over E experts with uniform routing (what a torch MoE runs);
* ``dense fp8 block-wise``: ``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales
  (the layer's FP8 format, cuBLAS's block-scaled kernel), both GEMMs over all rows, one weight.

Each GEMM alone and the pair (FC1 then FC2) are captured in CUDA graphs and timed like the
layer's graph number (``ep.graph_ms``: a sync before each replay, median of ``--iters``); the pair
also back to back (``--iters`` replays with no sync, time / iters: the sustained speed under the
power cap). Before timing, each
result is checked against a float32 matmul of the same (dequantised) operands; a wrong one
(rel. error > 5e-2) is reported as ``wrong`` and not timed.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import torch

from moe_ep.api.quant import dequantize_fp8_rows128, quantize_fp8_block128, quantize_fp8_rows128

from .ep import _time
from .models import MODELS
from .timing import capture_graph

#: ``ep._time``'s group argument for one process (no barrier, no all-reduce)
_ONE_RANK = SimpleNamespace(world_size=1)


def layer_tflop(T: int, K: int, H: int, I: int) -> float:  # noqa: E741
    """The layer's FLOPs per forward (6·T·K·H·I: FC1 2·M·2I·H + FC2 2·M·H·I, M = T·K), in TFLOP."""
    return 6.0 * T * K * H * I / 1e12


def fp8_operands(a: torch.Tensor, w: torch.Tensor):
    """``(a_q, scale_a, b_q, scale_b)`` for ``torch._scaled_mm(a_q, b_q, scale_a, scale_b)`` = a @ w.T
    in the block-wise FP8 format: ``a [M, K]`` per 1x128 (scale_a ``[M, K/128]``, outer-dim-major,
    i.e. stride ``(1, M)``), ``w [N, K]`` per 128x128 (``b_q = w_q.T [K, N]`` column-major, scale_b
    ``[K/128, N/128]`` = the weight's ``[N/128, K/128]`` scales transposed, stride ``(1, K/128)``).
    torch 2.11 on the H200 accepts only these compact strides, and with K/128 = 6 (Qwen3's FC2)
    cuBLAS returns a wrong product (rel. error 0.5; a leading dimension padded to 8 is refused):
    :func:`run_ceiling` checks every result and does not time a wrong one."""
    a_q, a_s = quantize_fp8_rows128(a)
    wq = quantize_fp8_block128(w[None])
    return a_q, a_s.t().contiguous().t(), wq.values[0].t(), wq.scale[0].t()


def _sustained_ms(fn, iters: int) -> float:
    """``iters`` calls enqueued back to back, time / iters (median of 3 such runs)."""
    avgs = []
    for _ in range(3):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        avgs.append(a.elapsed_time(b) / iters)
    return statistics.median(avgs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _variants(H: int, I: int, E: int, M: int, gen: torch.Generator):  # noqa: E741
    """``{name: (fc1, fc2, err)}``: ``fc1()`` / ``fc2()`` run the GEMM into a fixed output; ``err()``
    returns (FC1, FC2) relative errors against float32 matmuls of the operands they multiply."""
    dev = "cuda"
    x1 = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
    x2 = torch.randn(M, I, generator=gen).to(torch.bfloat16).to(dev)
    w1 = (torch.randn(2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(H, I, generator=gen) * I ** -0.5).to(torch.bfloat16).to(dev)
    o1 = torch.empty(M, 2 * I, dtype=torch.bfloat16, device=dev)
    o2 = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    out = {"dense bf16 (torch.mm)": (
        lambda: torch.mm(x1, w1.t(), out=o1), lambda: torch.mm(x2, w2.t(), out=o2),
        lambda: (_rel_err(o1, x1.float() @ w1.float().t()), _rel_err(o2, x2.float() @ w2.float().t())))}

    if hasattr(torch, "_grouped_mm"):
        g1 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16).to(dev)
        g2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16).to(dev)
        ends = torch.tensor([(e + 1) * M // E for e in range(E)], dtype=torch.int32, device=dev)
        gout = {}

        def grouped_err():
            e1, e2 = [], []
            for e in (0, E - 1):  # the first and the last expert's rows
                lo, hi = e * M // E, (e + 1) * M // E
                e1.append(_rel_err(gout[1][lo:hi], x1[lo:hi].float() @ g1[e].float().t()))
                e2.append(_rel_err(gout[2][lo:hi], x2[lo:hi].float() @ g2[e].float().t()))
            return max(e1), max(e2)

        out["grouped bf16 (torch._grouped_mm)"] = (
            lambda: gout.__setitem__(1, torch._grouped_mm(x1, g1.transpose(-2, -1), offs=ends)),
            lambda: gout.__setitem__(2, torch._grouped_mm(x2, g2.transpose(-2, -1), offs=ends)), grouped_err)

    ops1, ops2 = fp8_operands(x1, w1), fp8_operands(x2, w2)
    fout = {}

    def fp8_ref(a_q, sa, b_q, sb):
        w = b_q.t().float() * sb.t().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :b_q.shape[0]]
        return dequantize_fp8_rows128(a_q, sa.contiguous()) @ w.t()

    out["dense fp8 block-wise (torch._scaled_mm)"] = (
        lambda: fout.__setitem__(1, _scaled(*ops1)), lambda: fout.__setitem__(2, _scaled(*ops2)),
        lambda: (_rel_err(fout[1], fp8_ref(*ops1)), _rel_err(fout[2], fp8_ref(*ops2))))
    return out


def _scaled(a_q, sa, b_q, sb):
    return torch._scaled_mm(a_q, b_q, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def run_ceiling(args) -> int:
    if not torch.cuda.is_available():
        print("moe_ep.bench ceiling: needs a CUDA GPU; nothing to do here")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(args.seed)
    for key in args.model:
        m = MODELS[key]
        H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]  # noqa: E741
        T = args.tokens if args.tokens is not None else 8192
        M = T * K
        tflop = layer_tflop(T, K, H, I)
        print(f"{m['name']}  (H {H}, I {I}, E {E}, top-{K}; {T} tokens: FC1 [{M}, {H}] x [{H}, {2 * I}], "
              f"FC2 [{M}, {I}] x [{I}, {H}]; {tflop:.3f} TFLOP per forward)")
        print(f"  {'GEMMs':40s} {'FC1 ms':>7s} {'FC2 ms':>7s} {'pair: graph ms':>14s} {'TFLOP/s':>8s} "
              f"{'b2b ms':>7s} {'TFLOP/s':>8s}  rel.err FC1 / FC2")
        for name, (fc1, fc2, err) in _variants(H, I, E, M, gen).items():
            try:
                fc1()
                fc2()
                torch.cuda.synchronize()
                errs = err()
                ok = [e <= 5e-2 for e in errs]  # a wrong product is reported, never timed
                ms1, ms2 = (_time(capture_graph(f).replay, _ONE_RANK, args.iters) if good else None
                            for f, good in zip((fc1, fc2), ok))
                cols = [f"{v:7.3f}" if v is not None else f"{'wrong':>7s}" for v in (ms1, ms2)]
                if all(ok):
                    g = capture_graph(lambda: (fc1(), fc2()))
                    ms = _time(g.replay, _ONE_RANK, args.iters)
                    b2b = _sustained_ms(g.replay, args.iters)
                    del g
                    cols += [f"{ms:14.3f}", f"{tflop / ms * 1e3:8.1f}", f"{b2b:7.3f}", f"{tflop / b2b * 1e3:8.1f}"]
                else:
                    cols += [f"{'n/a':>14s}", f"{'n/a':>8s}", f"{'n/a':>7s}", f"{'n/a':>8s}"]
                print(f"  {name:40s} {' '.join(cols)}  {errs[0]:.2e} / {errs[1]:.2e}")
            except Exception as ex:  # noqa: BLE001  (a torch without this kernel: say so, go on)
                print(f"  {name:40s} unavailable: {type(ex).__name__}: {str(ex)[:100]}")
            torch.cuda.empty_cache()
    print("(layer TFLOP/s the GEMMs alone would allow: 6·T·K·H·I / their time; the layer adds routing, "
          "the activation, row copies and the combine. FC1 / FC2 ms: each GEMM alone, graph replay)")
    return 0

