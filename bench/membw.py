"""``python -m moe_ep.bench.membw`` -- what torch's own memory kernels reach at the layer's
row-movement shapes (the grouped row copy of LayoutPlace, the top-k sum of CombineLocal), as a
ceiling for ours. Qwen3 (8192 x 2048 bf16, top-8) and Mixtral (8192 x 4096, top-2): a row gather
into the expert-sorted rows (``index_select``), a plain copy and a fill of the grouped rows, and the
sum over k. Median of 50 CUDA-event-timed calls; needs a CUDA GPU."""

from __future__ import annotations

import torch


def _median_us(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def main() -> None:
    d = "cuda"
    for T, H, K, E in ((8192, 2048, 8, 128), (8192, 4096, 2, 8)):
        x = torch.randn(T, H, device=d, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=d)[:K] for _ in range(T)])
        idx = (torch.argsort(ids.flatten(), stable=True) // K).int()  # token of each grouped row
        xs = torch.empty(T * K, H, device=d, dtype=torch.bfloat16)
        ys = torch.randn_like(xs)
        out = torch.empty(T, H, device=d, dtype=torch.bfloat16)
        cases = (("index_select", lambda: torch.index_select(x, 0, idx, out=xs), xs.numel() + x.numel()),
                 ("copy", lambda: xs.copy_(ys), 2 * xs.numel()),
                 ("fill", lambda: xs.fill_(1.5), xs.numel()),
                 ("sum over k", lambda: torch.sum(ys.view(T, K, H), dim=1, out=out), ys.numel() + out.numel()))
        print(f"T={T} H={H} top-{K}:")
        for name, fn, elems in cases:
            us = _median_us(fn)
            mb = elems * 2 / 1e6
            print(f"  {name:13s} {us:7.1f} us  {mb / us:5.2f} TB/s  ({mb:.0f} MB)")


if __name__ == "__main__":
    main()
