"""``python -m moe_ep.bench sustained`` -- the expert GEMMs in steady state under the power cap:
speed, board power and SM clock, ours beside cuBLAS's.

Why: on the H200 the layers' GEMMs run at the 700 W cap (eighteenth session: Mixtral's layer drew
690-695 W at 1.38-1.46 GHz in every timing mode), so a kernel's speed there is its energy per FLOP
as much as its cycles. A short timing (a few ms) mixes in the clock the GPU had before it; this job
runs each GEMM back to back for ``--seconds`` after ``--warm-seconds`` of the same work, while
``nvidia-smi`` samples power, SM clock and the software power-cap flag every 100 ms, and reports
per kernel:

* ms per call and TFLOP/s (CUDA events over the whole window, GEMM FLOPs only);
* mean W and SM MHz over the window, and the share of samples with the power cap active;
* TFLOP/s per GHz (work per clock: a schedule's quality at equal clocks) and GFLOP per joule
  (energy per FLOP: what decides the clock at the cap).

Kernels, on the layer's shapes with uniform routing (every expert T·K/E rows): FC1 (gated, 2I
columns) and FC2 (router weights in the epilogue) of ours, ``torch._grouped_mm`` (plain GEMMs, no
activation) and one dense cuBLAS ``torch.mm`` over all rows (one weight: an upper bound for any
grouped kernel); ``--quant fp8_block128``: ours FP8 and cuBLAS's dense block-wise ``torch._scaled_mm``
instead. Each result is first checked against a float32 matmul of its operands on a sample of rows
(the first and last expert's); a wrong one (rel. error > 5e-2) is reported and not timed. Kernels
run interleaved for ``--rounds`` rounds.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

from moe_ep.api.quant import dequantize_fp8_rows128, quantize_fp8_block128, quantize_fp8_rows128

from .ceiling import fp8_operands
from .power import parse_sample, read_samples  # noqa: F401  (parse_sample: re-exported, reads SMI_FIELDS)
from .models import MODELS

#: nvidia-smi fields, with and without the power-cap flag (older drivers name it differently)
SMI_FIELDS = ("timestamp,power.draw,clocks.sm,temperature.gpu,clocks_event_reasons.sw_power_cap",
              "timestamp,power.draw,clocks.sm,temperature.gpu")


def window_stats(samples, t0: float, t1: float):
    """``(samples, mean W, mean SM MHz, share of samples capped or None)`` inside ``[t0, t1]``."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return 0, float("nan"), float("nan"), None
    caps = [s[4] for s in inside if s[4] is not None]
    return (len(inside), sum(s[1] for s in inside) / len(inside), sum(s[2] for s in inside) / len(inside),
            (sum(caps) / len(caps)) if caps else None)


class Sampler:
    """``nvidia-smi`` sampling every ``period_ms`` into a temporary file while the context is open;
    :meth:`samples` parses it. Without ``nvidia-smi`` (or if it refuses both field lists) there
    are no samples and the power columns read n/a."""

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self.proc = None
        self.path = None

    def __enter__(self):
        fd, self.path = tempfile.mkstemp(prefix="moe_ep_smi_", suffix=".csv")
        os.close(fd)
        for fields in SMI_FIELDS:
            try:
                out = open(self.path, "w")
                self.proc = subprocess.Popen(
                    ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                    stdout=out, stderr=subprocess.STDOUT)
                out.close()
            except OSError:
                self.proc = None
                break
            time.sleep(0.5)
            if self.proc.poll() is None:  # still sampling: these fields are known
                break
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        return False

    def samples(self):
        if self.path is None or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            rows = read_samples(f)
        os.unlink(self.path)
        return rows


def sustain(fn, sets, seconds: float, warm_seconds: float):
    """``fn(*sets[i % len(sets)])`` back to back: ``warm_seconds`` untimed, then ``seconds`` timed.
    The host stays at most ``2 * depth`` calls ahead of the GPU (it waits on the event recorded
    ``depth`` calls earlier), so the wall-clock window is the GPU's busy window. Returns
    ``(ms per call, calls, wall start, wall end)``."""
    depth = 8

    def run(duration: float):
        marks, n = [], 0
        start = time.time()
        while time.time() - start < duration:
            fn(*sets[n % len(sets)])
            n += 1
            if n % depth == 0:
                ev = torch.cuda.Event()
                ev.record()
                marks.append(ev)
                if len(marks) > 2:
                    marks.pop(0).synchronize()
        return n

    run(warm_seconds)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    a.record()
    n = run(seconds)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n, n, t0, time.time()


#: the relative error above which a kernel's check calls it wrong, so it is not timed
CHECK_LIMIT = 5e-2


def timed_rounds(kernels, rounds: int, seconds: float, warm_seconds: float, limit: float = CHECK_LIMIT):
    """Check, then time in steady state, a list of ``(gemm, name, flops, fn, sets, check)``: each
    ``fn(*sets[0])`` once and its ``check()`` (relative error); then, with ``nvidia-smi`` sampling,
    every kernel whose error is at most ``limit`` under :func:`sustain`, interleaved for ``rounds``
    rounds. Returns ``(errors {(gemm, name): err}, spans [(gemm, name, flops, round, ms, calls,
    t0, t1)], samples)``."""
    errors = {}
    for gemm, name, flops, fn, sets, check in kernels:
        fn(*sets[0])
        torch.cuda.synchronize()
        errors[gemm, name] = check()
    with Sampler() as smi:
        spans = []
        for r in range(rounds):
            for gemm, name, flops, fn, sets, check in kernels:
                if errors[gemm, name] <= limit:
                    spans.append((gemm, name, flops, r) + sustain(fn, sets, seconds, warm_seconds))
    return errors, spans, smi.samples()


def print_untimed(errors: dict, width: int) -> None:
    """One line per ``(gemm, name)`` of ``errors`` over :data:`CHECK_LIMIT` (checked wrong,
    so not timed), the name in a ``width``-wide column as the timing rows print it."""
    for (gemm, name), err in errors.items():
        if err > CHECK_LIMIT:
            print(f"{gemm:<5}{name[:width - 1]:<{width}}  wrong (rel. error {err:.2e} > 5e-2): not timed")


def power_columns(samples, t0: float, t1: float) -> tuple:
    """``(mean W, mean SM MHz, "capped" column text)`` of the samples inside ``[t0, t1]``."""
    _, w, mhz, cap = window_stats(samples, t0, t1)
    return w, mhz, (f"{100 * cap:7.0f}%" if cap is not None else f"{'n/a':>8}")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _scaled(a_q, sa, b_q, sb):
    return torch._scaled_mm(a_q, b_q, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _dense_fp8_err(out: torch.Tensor, ops, rows: int = 256) -> float:
    """Relative error of the first ``rows`` rows of a block-wise ``_scaled_mm`` against float32 on
    its dequantised operands (:func:`.ceiling.fp8_operands`' layout)."""
    a_q, sa, b_q, sb = ops
    a = dequantize_fp8_rows128(a_q[:rows], sa[:rows].contiguous())
    n, k = b_q.shape[1], b_q.shape[0]
    w = b_q.t().float() * sb.t().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return _rel_err(out[:rows], a @ w.t())


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _kernels(H: int, I: int, E: int, M: int, quant, seed: int, dev: str = "cuda"):  # noqa: E741
    """``[(gemm, kernel, flops, fn, sets, check)]``: ``fn(*sets[i])`` runs the GEMM; ``check()`` its
    relative error against float32 on the first and last expert's rows (after a call on set 0)."""
    from moe_ep.backends.sm90.bf16_cutedsl import grouped_gemm
    from moe_ep.backends.sm90.fp8_cutedsl import grouped_gemm_fp8

    nsets = 2
    gen = torch.Generator(device=dev).manual_seed(seed)  # drawn where they live: Mixtral's weights are GBs

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    lo_hi = [(e * M // E, (e + 1) * M // E) for e in (0, E - 1)]
    offs = torch.tensor([e * M // E for e in range(E + 1)], dtype=torch.int32, device=dev)
    ends = offs[1:].contiguous()
    fl1, fl2 = 2.0 * M * H * 2 * I, 2.0 * M * I * H
    x = [randn(M, H).to(torch.bfloat16) for _ in range(nsets)]
    h = [randn(M, I).to(torch.bfloat16) for _ in range(nsets)]
    w13 = [(randn(E, 2 * I, H) * H ** -0.5).to(torch.bfloat16) for _ in range(nsets)]
    w2 = [(randn(E, H, I) * I ** -0.5).to(torch.bfloat16) for _ in range(nsets)]
    rs = torch.rand(M, generator=gen, device=dev) + 0.5
    o1 = torch.empty(M, I, dtype=torch.bfloat16, device=dev)
    o1g = torch.empty(M, 2 * I, dtype=torch.bfloat16, device=dev)
    o2 = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    out = []

    def grouped_check(o, a, w, post):
        return lambda: max(_rel_err(o[lo:hi], post(a[lo:hi].float() @ w[e].float().t(), lo, hi))
                           for e, (lo, hi) in zip((0, E - 1), lo_hi))

    swiglu = lambda y, lo, hi: _swiglu(y)  # noqa: E731
    scaled = lambda y, lo, hi: y * rs[lo:hi, None]  # noqa: E731
    plain = lambda y, lo, hi: y  # noqa: E731

    def torch_bf16(gemm, flops, acts, weights, dense_out):
        """torch's kernels for one BF16 GEMM: ``_grouped_mm`` (per expert, plain) and one dense mm."""
        got = {}
        wt = [w.transpose(1, 2) for w in weights]
        return [(gemm, "torch._grouped_mm bf16", flops,
                 lambda a, w: got.__setitem__(0, torch._grouped_mm(a, w, offs=ends)), list(zip(acts, wt)),
                 lambda: grouped_check(got[0], acts[0], weights[0], plain)()),
                (gemm, "cuBLAS dense bf16 (torch.mm)", flops, lambda a, w: torch.mm(a, w[0].t(), out=dense_out),
                 list(zip(acts, weights)),
                 lambda: _rel_err(dense_out[:256], acts[0][:256].float() @ weights[0][0].float().t()))]

    def dense_fp8(gemm, flops, acts, weights):
        """cuBLAS's block-wise FP8 ``_scaled_mm`` for one GEMM, one weight for all rows."""
        got, ops = {}, [fp8_operands(a, w[0]) for a, w in zip(acts, weights)]
        return (gemm, "cuBLAS dense fp8 block-wise", flops, lambda *o: got.__setitem__(0, _scaled(*o)), ops,
                lambda: _dense_fp8_err(got[0], ops[0]))

    if quant is None:
        fc1, fc2 = grouped_gemm("swiglu", 2 * I, H, E), grouped_gemm("identity", H, I, E, scale_rows=True)
        out.append(("FC1", "moe_ep bf16 (grouped, swiglu)", fl1, lambda a, w: fc1(a, w, offs, out=o1),
                    list(zip(x, w13)), grouped_check(o1, x[0], w13[0], swiglu)))
        out += torch_bf16("FC1", fl1, x, w13, o1g)
        out.append(("FC2", "moe_ep bf16 (grouped, row scale)", fl2,
                    lambda a, w: fc2(a, w, offs, out=o2, row_scale=rs), list(zip(h, w2)),
                    grouped_check(o2, h[0], w2[0], scaled)))
        out += torch_bf16("FC2", fl2, h, w2, o2)
        return out
    # FP8 block-scaled: activations per 1 x 128, weights per 128 x 128 (the layer's format)
    fc1, fc2 = grouped_gemm_fp8("swiglu", 2 * I, H, E), grouped_gemm_fp8("identity", H, I, E, scale_rows=True)
    xq = [quantize_fp8_rows128(a) for a in x]
    hq = [quantize_fp8_rows128(a) for a in h]
    w13q = [quantize_fp8_block128(w) for w in w13]
    w2q = [quantize_fp8_block128(w) for w in w2]

    def deq_w(wq, e):
        s = wq.scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return wq.values[e].float() * s[: wq.values.shape[1], : wq.values.shape[2]]

    def fp8_check(o, aq, wq, post):
        a = dequantize_fp8_rows128(*aq)
        return lambda: max(_rel_err(o[lo:hi], post(a[lo:hi] @ deq_w(wq, e).t(), lo, hi))
                           for e, (lo, hi) in zip((0, E - 1), lo_hi))

    out.append(("FC1", "moe_ep fp8 (grouped, swiglu)", fl1,
                lambda a, w: fc1(a[0], a[1], w.values, w.scale, offs, out=o1, row_scale=rs[:1]),
                list(zip(xq, w13q)), fp8_check(o1, xq[0], w13q[0], swiglu)))
    out.append(dense_fp8("FC1", fl1, x, w13))
    out.append(("FC2", "moe_ep fp8 (grouped, row scale)", fl2,
                lambda a, w: fc2(a[0], a[1], w.values, w.scale, offs, out=o2, row_scale=rs),
                list(zip(hq, w2q)), fp8_check(o2, hq[0], w2q[0], scaled)))
    out.append(dense_fp8("FC2", fl2, h, w2))
    return out


def run_sustained(args) -> int:
    if not torch.cuda.is_available():
        print("moe_ep.bench sustained: needs a CUDA GPU (SM90); nothing to do here")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    for key in args.model:
        m = MODELS[key]
        H, I, E, K = m["hidden"], m["intermediate"], m["num_experts"], m["top_k"]  # noqa: E741
        M = (args.tokens if args.tokens is not None else 8192) * K
        kernels = _kernels(H, I, E, M, args.quant, args.seed)
        print(f"\n{m['name']} {args.quant or 'bf16'}: sustained GEMMs, {M} rows (uniform over {E} experts), "
              f"{args.seconds:.1f} s each after {args.warm_seconds:.1f} s of warm-up, {args.rounds} round(s), "
              f"GPU {torch.cuda.get_device_name()}")
        print(f"{'GEMM':<5}{'kernel':<34}{'ms':>8}{'TFLOP/s':>9}{'W':>7}{'SM MHz':>8}{'capped':>8}"
              f"{'TFLOP/s/GHz':>12}{'GFLOP/J':>9}{'rel.err':>9}")
        ok, spans, samples = timed_rounds(kernels, args.rounds, args.seconds, args.warm_seconds)
        for gemm, name, flops, r, ms, n, t0, t1 in spans:
            tf = flops / ms / 1e9
            w, mhz, cap_s = power_columns(samples, t0, t1)
            print(f"{gemm:<5}{name[:33]:<34}{ms:8.3f}{tf:9.1f}{w:7.0f}{mhz:8.0f}{cap_s}"
                  f"{tf / (mhz / 1e3):12.1f}{tf / w * 1e3:9.0f}{ok[gemm, name]:9.1e}")
        print_untimed(ok, 34)
        del kernels
        torch.cuda.empty_cache()
    print("(TFLOP/s/GHz: work per clock; GFLOP/J: work per joule of board power -- at the power cap the clock "
          "follows it. Dense cuBLAS: one weight for all rows, an upper bound for a grouped kernel.)")
    return 0
