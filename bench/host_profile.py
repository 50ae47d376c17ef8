"""``python -m moe_ep.bench.host_profile [model]`` — where one eager ``forward`` spends host (CPU) time.

Prints the host time of one forward (median of 200 calls, GPU work queued behind it, no sync in
between), and a cProfile of 100 calls (top functions by own time). Needs a CUDA GPU.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def _median_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def profile_forward(model: str) -> None:
    import torch

    from moe_ep.api import EPGroup, MoELayer
    from moe_ep.bench.models import gpu_layer_inputs, model_config

    T = 8192
    cfg = model_config(model, T)
    layer = MoELayer(cfg, EPGroup.single(), check_values=False)
    layer.warmup()
    x, ids, w, w13, w2, out = gpu_layer_inputs(cfg, T)

    def fwd():
        layer.forward(x, ids, w, w13, w2, out=out)

    for _ in range(10):
        fwd()
    torch.cuda.synchronize()
    print(f"{model}: forward host time {_median_us(fwd, 200):.1f} us (median of 200, no sync between calls)")
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        fwd()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    layer.destroy()


if __name__ == "__main__":
    profile_forward(sys.argv[1] if len(sys.argv) > 1 else "qwen3")
