"""``python -m moe_ep.bench.compile_host [--iters 20000]`` -- the host cost of a forward under
torch.compile. CPU only (any machine): a small reference-backend layer whose expert math is
stubbed out, so that only the host path is timed, in microseconds a call:

* ``eager``: ``layer.forward`` as an engine calls it;
* ``operator``: ``torch.ops.moe_ep.forward`` called directly (what a compiled graph runs per layer
  when it replays without CUDA graphs: the eager forward plus the operator's dispatch);
* ``compiled``: a ``torch.compile(fullgraph=True)`` function around one forward (adds torch's
  guards and wrapper, paid once per compiled function, not per layer).

With ``mode="reduce-overhead"`` torch replays the whole graph as a CUDA graph and none of these is
paid per step.
"""

from __future__ import annotations

import argparse
import time

import torch


def _per_call_us(fn, iters: int) -> float:
    for _ in range(min(200, iters)):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def measure(iters: int = 20000) -> dict:
    """``{"eager": us, "operator": us, "compiled": us}`` per call (see the module docstring)."""
    from moe_ep.api import EPGroup, MoEConfig, MoELayer

    E, H, I, K, T = 8, 256, 128, 2, 16
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=64)
    layer = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    y = torch.empty_like(x)
    layer._impl.forward = lambda *a, **k: y  # the host path only: no expert math
    compiled = torch.compile(lambda x: layer.forward(x, ids, w, w13, w2), fullgraph=True)
    compiled(x)
    out = {
        "eager": _per_call_us(lambda: layer.forward(x, ids, w, w13, w2), iters),
        "operator": _per_call_us(lambda: torch.ops.moe_ep.forward(layer._op_key, x, ids, w, [w13, w2],
                                                                  "tensor,tensor", None, None, None, None), iters),
        "compiled": _per_call_us(lambda: compiled(x), max(1, iters // 4)),
    }
    layer.destroy()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args(argv)
    for name, us in measure(args.iters).items():
        print(f"{name:>9}: {us:6.1f} us a call")


if __name__ == "__main__":
    main()
