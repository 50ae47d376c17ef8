"""EP-specific measurements for ``torchrun --nproc_per_node=N -m moe_ep.bench``:

* dispatch and combine GB/s (bytes that actually cross NVLink: one bf16 row per (token,
  destination rank ≠ source)) next to NCCL ``all_to_all_single`` moving the same rows;
* decode-regime latency of the whole layer for 1–256 tokens per rank (eager and CUDA graph).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def _time(fn, group, iters: int, barrier: bool = True) -> float:
    """Median ms over iters; every iteration starts after a device sync + barrier."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if barrier and group.world_size > 1:
            dist.barrier(group=group.pg)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    t = torch.tensor([statistics.median(ts)], device="cuda")
    if group.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return float(t.item())


def graph_ms(layer, inputs, group, iters: int) -> float:
    """Median ms of the layer's forward replayed from a CUDA graph (captured after warm-up)."""
    x, ids, w, w13, w2 = inputs
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer.forward(x, ids, w, w13, w2, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if group.world_size > 1:
        dist.barrier(group=group.pg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer.forward(x, ids, w, w13, w2, out=out)
    torch.cuda.synchronize()
    ms = _time(g.replay, group, iters)
    del g
    return ms


def remote_rows(ids: torch.Tensor, e_local: int, rank: int, world: int) -> torch.Tensor:
    """[W] rows this rank sends to each rank: tokens with ≥1 expert there (self excluded)."""
    dest = (ids.long() // e_local)
    hit = torch.zeros(ids.shape[0], world, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, dest, True)
    rows = hit.sum(0)
    rows[rank] = 0
    return rows


def comm_table(layer, inputs, group, iters: int):
    """Rows: (name, ms, GB/s per rank) for dispatch, combine and NCCL all_to_all_single."""
    x, ids, w, w13, w2 = inputs
    impl = layer._impl
    if not hasattr(impl, "comm_ops"):
        return []
    layer.forward(x, ids, w, w13, w2)
    dispatch, combine = impl.comm_ops(x, ids, w)
    rows = remote_rows(ids, layer.e_local, group.rank, group.world_size)
    H = x.shape[1]
    sent = int(rows.sum()) * H * 2  # bytes this rank moves across NVLink per direction
    tot = torch.tensor([sent], device="cuda", dtype=torch.float64)
    dist.all_reduce(tot, op=dist.ReduceOp.MIN, group=group.pg)
    ms_d = _time(dispatch, group, iters)
    ms_c = _time(combine, group, iters)
    # NCCL all_to_all_single of the same rows (send buffer: each token once per remote rank)
    send_splits = [int(v) for v in rows.tolist()]
    recv = torch.empty(group.world_size, dtype=torch.int64, device="cuda")
    dist.all_to_all_single(recv, rows.to(torch.int64), group=group.pg)
    recv_splits = [int(v) for v in recv.tolist()]
    sbuf = torch.randn(sum(send_splits), H, device="cuda").to(torch.bfloat16)
    rbuf = torch.empty(sum(recv_splits), H, device="cuda", dtype=torch.bfloat16)
    ms_n = _time(lambda: dist.all_to_all_single(rbuf, sbuf, recv_splits, send_splits, group=group.pg), group, iters)
    gbs = lambda ms: sent / (ms * 1e-3) / 1e9  # noqa: E731
    return [("dispatch (ours)", ms_d, gbs(ms_d)), ("combine (ours)", ms_c, gbs(ms_c)),
            ("NCCL all_to_all_single", ms_n, gbs(ms_n))], sent


def decode_table(make_layer, make_inputs, cfg, group, device, iters: int, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                 graph: bool = True):
    """Rows: (tokens/rank, eager ms, graph ms or NaN without ``graph``, this rank's topk_ids) for
    the fused forward."""
    out_rows = []
    layer = make_layer()
    layer.warmup(progress=False)
    for T in sizes:
        inputs = make_inputs(T)
        x, ids, w, w13, w2 = inputs
        out = torch.empty_like(x)
        eager = _time(lambda: layer.forward(x, ids, w, w13, w2, out=out), group, iters)
        out_rows.append((T, eager, graph_ms(layer, inputs, group, iters) if graph else float("nan"), ids))
    layer.destroy()
    return out_rows
