"""``python -m moe_ep.bench.host_profile [--model qwen3,mixtral] [--quant bf16,fp8_block128] [--cprofile]``
-- where one eager ``forward`` spends host (CPU) time, and how much of it a per-call forward waits for.

Per model and weight format, on the default backend (8192 tokens, one rank):

1. **exposed**: per-call forwards (a sync, then one forward between two CUDA events) alternating with
   forwards enqueued behind a 300 us spin kernel (``torch.cuda._sleep``), whose host launches are
   thereby hidden; medians of 30 each, and the host time of ``forward`` (``perf_counter``). The
   difference of the first two is what the GPU waited for the host.
2. **timeline**: one forward's host timeline, median of 40 per-call forwards: when (us after
   ``forward()`` is entered) each numbered step of the backend and each launcher it calls starts and
   returns (the launchers are wrapped where the backend looks them up; nothing else changes).
   Each section's first line ends with a host speed probe (:func:`host_speed_us`, a fixed host
   workload): divide by it to compare timelines from different processes.
3. with ``--cprofile``: a cProfile of 100 back-to-back forwards (top functions by own time).

The host's own speed varies between processes (2-3x on the H200 machines), so compare only runs
interleaved in one call. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

_STEPS = ("_step1_dispatch", "_step2_layout", "_step34_experts", "_step5_combine_send", "_step5_combine_reduce")
# the launch callables a backend reaches through attributes of itself (prepared ones from drop v58)
_LAUNCHERS = ("_route_run", "_quant_x_run", "_fc1_run", "_quant_h_run", "_fc2_run", "_combine_run", "fc1", "fc2",
              "_expert_runs")


def host_speed_us(n: int = 7) -> float:
    """A fixed host workload (Python loop + small torch calls), median us: the process's own host
    speed, so timelines from different processes can be compared (the H200 hosts differ 2-3x)."""
    import torch

    t = torch.empty(4)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        acc = 0
        for i in range(2000):
            acc += i & 7
        for _ in range(100):
            t.view(torch.uint8)
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _layer(model: str, quant: str | None):
    import torch

    from moe_ep.api import EPGroup, MoELayer
    from moe_ep.bench.__main__ import make_inputs
    from moe_ep.bench.models import model_config

    T, dev = 8192, torch.device("cuda")
    cfg = model_config(model, T, quant)
    layer = MoELayer(cfg, EPGroup.single(), device=dev)
    layer.warmup(progress=False)
    x, ids, w, w13, w2 = make_inputs(cfg, T, layer.group, dev, seed=0)
    out = torch.empty_like(x)
    return layer, cfg, (lambda: layer.forward(x, ids, w, w13, w2, out=out))


def exposed(fwd, flops: float, n: int = 30) -> str:
    """Per-call us, us with the launches hidden, host us of ``forward`` (medians)."""
    import torch

    plain, hidden, host = [], [], []
    for i in range(2 * n):
        torch.cuda.synchronize()
        a, c, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if i % 2:
            a.record()
            torch.cuda._sleep(600_000)  # ~300 us of spinning: the forward's launches queue behind it
            c.record()
            fwd()
            b.record()
            b.synchronize()
            hidden.append(c.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            a.record()
            fwd()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            plain.append(a.elapsed_time(b) * 1e3)
            host.append((t1 - t0) * 1e6)
    p, h = statistics.median(plain), statistics.median(hidden)
    return (f"per call {p:.1f} us ({flops / p / 1e6:.1f} TFLOP/s), launches hidden {h:.1f} us "
            f"({flops / h / 1e6:.1f}), waited for the host {p - h:.1f} us; host time of forward "
            f"{statistics.median(host):.1f} us")


def timeline(layer, fwd, n: int = 40) -> str:
    """The host timeline of a per-call forward (median of ``n``), steps and launchers wrapped."""
    import torch

    impl, marks = layer._impl, []
    for name in _STEPS + _LAUNCHERS:
        wrap_launcher(impl, name, marks)
    for _ in range(5):
        fwd()
    runs = []
    for _ in range(n):
        torch.cuda.synchronize()
        marks.clear()
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        runs.append([(m, (t - t0) * 1e6) for m, t in marks] + [("forward returns", (t1 - t0) * 1e6)])
    rows = [f"  {statistics.median(r[i][1] for r in runs):8.1f} us  {label}" for i, (label, _) in enumerate(runs[0])]
    return "\n".join(["host timeline of a per-call forward (us after forward() is entered, median of "
                      f"{n}; > enters, < returns)"] + rows)


def wrap_launcher(obj, name: str, marks: list) -> None:
    """Replace ``obj.name`` (a callable, a dict of them, or a dict of callable pairs) by callables
    that append ``(label + " >" / " <", perf_counter())`` to ``marks`` around each call."""
    f = getattr(obj, name, None)
    if f is None:
        return
    if isinstance(f, dict):  # the prepared route per row-gather choice; the BF16 GEMM pair per path
        for key in list(f):
            if isinstance(f[key], tuple):
                f[key] = tuple(g and _marked(g, f"{name}[{key}] {part}", marks)
                               for g, part in zip(f[key], ("fc1", "fc2")))
            else:
                f[key] = _marked(f[key], f"{name}[{key}]", marks)
        return
    setattr(obj, name, _marked(f, name, marks))


def _marked(f, label, marks):
    def run(*a, **k):
        marks.append((label + " >", time.perf_counter()))
        r = f(*a, **k)
        marks.append((label + " <", time.perf_counter()))
        return r
    return run


def cprofile(fwd, n: int = 100) -> str:
    import torch

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fwd()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return s.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3")
    p.add_argument("--quant", default="bf16,fp8_block128", help="comma list of bf16 / fp8_block128")
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    for model in args.model.split(","):
        for q in args.quant.split(","):
            quant = None if q == "bf16" else q
            layer, cfg, fwd = _layer(model, quant)
            print(f"== {model} {q} ({layer.backend_name}): {exposed(fwd, cfg.flops(8192))}; host speed probe "
                  f"{host_speed_us():.1f} us", flush=True)
            if args.cprofile:
                print(cprofile(fwd), flush=True)
            print(timeline(layer, fwd), flush=True)
            layer.destroy()


if __name__ == "__main__":
    main()
