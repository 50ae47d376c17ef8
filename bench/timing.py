"""How ``python -m moe_ep.bench`` times a layer's forward (CUDA graphs: ``ep.graph_ms``).

* :func:`per_call_ms` -- device sync (+ group barrier when EP > 1) before each call, CUDA events
  around ONE forward, median over ``iters``: the latency of an isolated call;
* :func:`back_to_back_ms` -- ``iters`` forwards enqueued with no sync between them (the way an
  engine loop calls the layer), one event pair around all of them, time / ``iters``; the median
  of ``runs`` such averages: the throughput an eager engine gets, host overheads included.

Both return the slowest rank's value (all-reduce MAX over the group). On CPU, per-call uses the
wall clock; back-to-back returns NaN (no asynchronous queue to measure).
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def sync(group, device) -> None:
    """Device sync, then a group barrier when the group has more than one rank."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    if group.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=group.pg)


def slowest(value: float, group) -> float:
    """The group's maximum of ``value`` (itself for one rank)."""
    if group.world_size <= 1:
        return float(value)
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=group.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return float(t.item())


def per_call_ms(layer, inputs, iters: int, warmup: int) -> float:
    """Median ms of one forward, each call after a sync + barrier; slowest rank."""
    x, ids, w, w13, w2 = inputs
    out = torch.empty_like(x)
    for _ in range(warmup):
        layer.forward(x, ids, w, w13, w2, out=out)
    times = []
    for _ in range(iters):
        sync(layer.group, layer.device)
        if layer.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            layer.forward(x, ids, w, w13, w2, out=out)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            layer.forward(x, ids, w, w13, w2, out=out)
            times.append((time.perf_counter() - t0) * 1e3)
    return slowest(statistics.median(times), layer.group)


def back_to_back_ms(layer, inputs, iters: int, runs: int = 5) -> float:
    """Median over ``runs`` of (time of ``iters`` forwards enqueued back to back) / ``iters``;
    slowest rank. NaN on CPU."""
    if layer.device.type != "cuda":
        return float("nan")
    x, ids, w, w13, w2 = inputs
    out = torch.empty_like(x)
    n = max(1, iters)
    avgs = []
    for _ in range(max(1, runs)):
        sync(layer.group, layer.device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            layer.forward(x, ids, w, w13, w2, out=out)
        b.record()
        b.synchronize()
        avgs.append(a.elapsed_time(b) / n)
    return slowest(statistics.median(avgs), layer.group)


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph, after one warm-up call on a side stream (what capture
    needs: the caching allocator's pools and any lazy set-up outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def kernel_timeline(events, forwards: int) -> str:
    """The last of ``forwards`` profiled forwards as a timeline: each GPU kernel's start (us from
    the forward's first kernel), duration, "own" time (its end minus the later of its start and the
    end of the kernels before it) and the idle gap before it, then the busy / span sum -- what the
    per-kernel table cannot show (the GPU idle between kernels). ``events``: a ``torch.profiler``
    ``prof.events()`` list. Kernels launched with PDL start early and wait for their predecessor,
    so with PDL on read the gaps as 0 and a kernel's own time as what it took (46th session: the
    Qwen3 FC1's 769 us duration held 112 us of waiting for LayoutPlace, 657 us own)."""
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                      if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > 0),
                     key=lambda k: k[0])
    if not kernels or len(kernels) % forwards:
        return f"kernel timeline: {len(kernels)} kernels for {forwards} forwards (not a whole number each)"
    per = len(kernels) // forwards
    last = kernels[-per:]
    t0, prev_end, lines = last[0][0], last[0][0], []
    for start, end, name in last:
        lines.append(f"  {start - t0:9.1f} us  {end - start:8.1f} us  own {end - max(start, prev_end):8.1f}  "
                     f"gap {start - prev_end:7.1f}  {name[:70]}")
        prev_end = max(prev_end, end)
    busy = sum(e - s for s, e, _ in last)
    span = prev_end - t0
    return "\n".join([f"kernel timeline of the last forward ({per} kernels): start, duration, own time, idle gap before"]
                     + lines + [f"  busy {busy:.1f} us of a {span:.1f} us span ({span - busy:.1f} us idle or overlapped)"])


def phase_logged(name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; with ``MOE_EP_BENCH_PHASES=<path>`` also appends ``<start> <end>
    <name>`` (wall-clock epoch seconds) to that file, so a power / clock log sampled meanwhile
    (``bench/power.py``) can be split by timing mode."""
    path = os.environ.get("MOE_EP_BENCH_PHASES")
    if not path:
        return fn(*args, **kwargs)
    t0 = time.time()
    out = fn(*args, **kwargs)
    with open(path, "a") as f:
        f.write(f"{t0:.3f} {time.time():.3f} {name}\n")
    return out
