"""``python -m moe_ep.bench.graph_timeline [--model qwen3] [--quant fp8_block128] [--rounds 3]``
-- why a forward replayed from a CUDA graph can take longer than the same forward launched eagerly.

Both modes are timed the same way (a sync, then one forward between two CUDA events; median of
``--iters``), interleaved ``--rounds`` times on one layer, so the GPU's clock and temperature
reach both alike. Then each mode's last forward of five (a sync before each) under
``torch.profiler``: every kernel's start, duration, own time and the idle gap before it. With PDL
launches a kernel starts under its predecessor's tail, so its duration includes the wait and its own
time (from the predecessor's end) is what it took; compare where each kernel ends. A kernel that runs longer in the graph than eagerly is the one to read: in a graph
every launch comes at once, so an early PDL trigger can place a successor beside its predecessor's
CTAs (drop v90: LayoutPlace after LocalRoute, 115-120 us against 88-93 on Qwen3; LIMITS.md).
Each round also times a graph captured afresh after the eager runs, as ``bench``'s graph column does
(``fresh``; its timeline is printed last): when that one alone is slow, the capture is the cause; when
slow rounds hit every mode, it is the clock (52nd session: Inkling2's FP8 layer at the power cap).
Default backend, 8192 tokens, one rank. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _profiled(fn, n: int = 5):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    return prof.events()


def main(argv=None) -> None:
    from moe_ep.api import EPGroup, MoELayer

    from .__main__ import make_inputs
    from .ep import _time, graph_ms
    from .models import model_config
    from .timing import capture_graph, kernel_timeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="qwen3")
    p.add_argument("--quant", default=None)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_timeline needs a CUDA GPU")
    device = torch.device("cuda")
    group = EPGroup.single()
    for key in args.model.split(","):
        cfg = model_config(key, args.tokens, quant=args.quant)
        x, ids, w, w13, w2 = make_inputs(cfg, args.tokens, group, device, seed=0)
        layer = MoELayer(cfg, group, device=device)
        layer.warmup(progress=False)
        out = torch.empty_like(x)

        def eager():
            layer.forward(x, ids, w, w13, w2, out=out)

        g = capture_graph(eager)
        flops = cfg.flops(args.tokens)
        e_ms, g_ms, f_ms = [], [], []
        for _ in range(args.rounds):
            e_ms.append(_time(eager, group, args.iters))
            g_ms.append(_time(g.replay, group, args.iters))
            # the bench's own graph timing: a graph captured afresh after the eager runs
            f_ms.append(graph_ms(layer, (x, ids, w, w13, w2), group, args.iters))
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        print(f"\n{key} ({layer.backend_name}, {args.quant or 'bf16'}, {args.tokens} tokens), per call ms "
              f"(TFLOP/s), {args.rounds} interleaved rounds:")
        print("  eager " + "  ".join(f"{t:.4f} ({tf(t):.1f})" for t in e_ms)
              + f" | median {statistics.median(e_ms):.4f}")
        print("  graph " + "  ".join(f"{t:.4f} ({tf(t):.1f})" for t in g_ms)
              + f" | median {statistics.median(g_ms):.4f}")
        print("  fresh " + "  ".join(f"{t:.4f} ({tf(t):.1f})" for t in f_ms)
              + f" | median {statistics.median(f_ms):.4f}  (bench.ep.graph_ms: captured after eager runs)")
        g2 = capture_graph(eager)
        for name, fn in (("eager", eager), ("graph", g.replay), ("fresh graph", g2.replay)):
            print(f"  [{name}] " + kernel_timeline(_profiled(fn), 5).replace("\n", "\n  "))
        del g, g2
        layer.destroy()


if __name__ == "__main__":
    main()
