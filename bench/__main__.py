"""``python -m moe_ep.bench`` — time an MoE layer on the best available backend.

Default job: a Qwen3-30B-A3B-shaped layer (H 2048, I 768, E 128, top-8) with 8192 tokens per rank
on the best available backend, next to the reference backend. Without a GPU it runs the reference
backend on a small token count and says so. Under ``torchrun --nproc_per_node=N`` it runs expert
parallelism over N ranks (FLOPs per GPU = 6·T·K·H·I with T tokens per rank).

Sub-commands: ``layer`` (default) and ``gemm`` (SM90 grouped GEMM vs torch._grouped_mm).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer, init_distributed
from moe_ep.backends import available, retain_runtime

from .models import MODELS


def make_inputs(cfg: MoEConfig, T: int, group: EPGroup, device, seed: int, skew: bool = False):
    """Random tokens, softmax router weights over top-k of random logits, per-rank weights drawn
    from one global generator (so every EP size sees the same global experts)."""
    g = torch.Generator().manual_seed(seed)
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate
    El = E // group.world_size
    logits = torch.randn(group.world_size, T, E, generator=g)[group.rank]
    if skew:
        logits[:, 0] += 4.0
    vals, ids = logits.topk(K, dim=-1)
    w = torch.softmax(vals, dim=-1)
    x = torch.randn(T, H, generator=g).to(cfg.dtype)
    lo = group.rank * El
    gw = torch.Generator().manual_seed(seed + 1)
    w13 = torch.empty(El, cfg.w13_rows, H)
    w2 = torch.empty(El, H, I)
    for e in range(E):  # global expert e's weights are the same for every EP size
        a = torch.randn(cfg.w13_rows, H, generator=gw) * H ** -0.5
        b = torch.randn(H, I, generator=gw) * I ** -0.5
        if lo <= e < lo + El:
            w13[e - lo], w2[e - lo] = a, b
    return (x.to(device), ids.to(torch.int32).to(device), w.float().to(device),
            w13.to(cfg.dtype).to(device), w2.to(cfg.dtype).to(device))


def _sync(group: EPGroup, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if group.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=group.pg)


def time_layer(layer: MoELayer, inputs, iters: int, warmup: int) -> float:
    """Median milliseconds of one forward (per-iteration barrier; CUDA events on GPU)."""
    x, ids, w, w13, w2 = inputs
    out = torch.empty_like(x)
    for _ in range(warmup):
        layer.forward(x, ids, w, w13, w2, out=out)
    times = []
    for _ in range(iters):
        _sync(layer.group, layer.device)
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
    return statistics.median(times)


def run_layer(args) -> int:
    group = init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    m = MODELS[args.model]
    T = args.tokens if args.tokens is not None else (8192 if cuda else 64)
    cfg = MoEConfig(num_experts=m["num_experts"], hidden=m["hidden"], intermediate=m["intermediate"],
                    top_k=m["top_k"], max_tokens_per_rank=max(T, 1), activation="swiglu")
    names = args.backend or ["auto"]
    if "reference" not in names and not args.no_reference:
        names = names + ["reference"]
    say = print if group.rank == 0 else (lambda *a, **k: None)
    if not cuda:
        say(f"moe_ep.bench: no CUDA GPU here: running the reference backend on CPU with {T} tokens/rank "
            "(numbers are for smoke-testing, not performance)")
    inputs = make_inputs(cfg, T, group, device, seed=args.seed, skew=args.skew)
    # layers come and go below: keep NVSHMEM initialised once for the whole run
    runtime = retain_runtime(group, device.index if device.type == "cuda" else None)
    rows = []
    comm = []
    for name in names:
        # value checks cost a host sync per forward; benchmark inputs are valid by construction
        layer = MoELayer(cfg, group, backend=name, device=device, check_values=False,
                         deterministic=not args.nondeterministic)
        if name == "auto" and layer.backend_name == "reference" and "reference" in names:
            layer.destroy()
            continue
        layer.warmup(progress=not args.quiet)
        ms = time_layer(layer, inputs, args.iters, args.warmup)
        if group.world_size > 1:  # the slowest rank's median
            import torch.distributed as dist

            t = torch.tensor([ms], device=group.comm_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
            ms = float(t.item())
        if args.profile and device.type == "cuda" and group.rank == 0:
            from torch.profiler import ProfilerActivity, profile

            x, ids, w, w13, w2 = inputs
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    layer.forward(x, ids, w, w13, w2)
                torch.cuda.synchronize()
            say(f"profile of 5 forwards on {layer.backend_name}:")
            say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        tflops = cfg.flops(T) / (ms * 1e-3) / 1e12
        gms = float("nan")
        if device.type == "cuda" and layer.backend_name != "reference":
            from .ep import graph_ms

            gms = graph_ms(layer, inputs, group, args.iters)
        rows.append((layer.backend_name, m["name"], T, group.world_size, ms, tflops, gms))
        if device.type == "cuda" and group.world_size > 1 and not args.no_comm and hasattr(layer._impl, "comm_ops"):
            from .ep import comm_table

            comm, sent = comm_table(layer, inputs, group, args.iters)
        layer.destroy()
    if args.peer == "liger":
        from .peers import run_liger

        if group.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=group.pg)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if group.rank == 0:
            res = run_liger(args.model, T, group.world_size, args.iters, args.peer_script)
            if "error" in res:
                say(f"LigerCute peer failed: {res['error']}")
            else:
                say(f"LigerCute raw result: {res}")
                lig = res.get("liger") or {}
                ms = lig.get("median_ms") or lig.get("ms")
                if ms:
                    rows.append(("LigerCute 0.8.5 (peer)", m["name"], T, group.world_size, ms,
                                 cfg.flops(T) / (ms * 1e-3) / 1e12, float("nan")))
        if group.world_size > 1:
            dist.barrier(group=group.pg)
    say(f"\nbackends registered: {available()}; device: {torch.cuda.get_device_name() if cuda else 'cpu'}")
    say(f"{'backend':<24}{'shape':<16}{'tokens/rank':>12}{'EP':>4}{'ms':>9}{'TFLOP/s':>9}"
        f"{'graph ms':>10}{'TFLOP/s':>9}")
    for b, shape, t, ep, ms, tf, gms in rows:
        gtf = cfg.flops(t) / (gms * 1e-3) / 1e12 if gms == gms else float("nan")
        say(f"{b:<24}{shape:<16}{t:>12}{ep:>4}{ms:>9.3f}{tf:>9.4g}{gms:>10.3f}{gtf:>9.4g}")
    say("(ms: eager forward, median, slowest rank; graph ms: the same forward replayed from a CUDA graph)")
    if comm:
        say(f"\ndispatch/combine, {T} tokens/rank: {sent / 1e6:.1f} MB per rank cross NVLink per direction "
            "(one bf16 row per token and remote destination rank); slowest rank's median")
        say(f"{'operation':<26}{'ms':>10}{'GB/s per rank':>15}")
        for op, ms, gbs in comm:
            say(f"{op:<26}{ms:>10.3f}{gbs:>15.1f}")
    if device.type == "cuda" and not args.no_decode:
        from .ep import decode_table

        dcfg = MoEConfig(num_experts=cfg.num_experts, hidden=cfg.hidden, intermediate=cfg.intermediate,
                         top_k=cfg.top_k, max_tokens_per_rank=256, activation=cfg.activation)
        best = rows[0][0]
        drows = decode_table(lambda: MoELayer(dcfg, group, backend=best, device=device, check_values=False),
                             lambda t: make_inputs(dcfg, t, group, device, seed=args.seed + t),
                             dcfg, group, device, args.iters)
        say(f"\ndecode regime, {best}, max_tokens_per_rank=256, EP={group.world_size}: median ms")
        say(f"{'tokens/rank':>12}{'eager ms':>10}{'graph ms':>10}")
        for t, e, gms in drows:
            say(f"{t:>12}{e:>10.3f}{gms:>10.3f}")
    runtime.release()
    if group.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", nargs="?", default="layer", choices=["layer", "gemm"])
    p.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192 on GPU, 64 on CPU)")
    p.add_argument("--backend", action="append", help="backend name (repeatable; default: auto)")
    p.add_argument("--no-reference", action="store_true", help="do not also time the reference backend")
    p.add_argument("--skew", action="store_true", help="skewed routing (expert 0 favoured)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--nondeterministic", action="store_true",
                   help="MoELayer(deterministic=False): faster layout, outputs not bit-stable")
    p.add_argument("--no-comm", action="store_true", help="skip the dispatch/combine GB/s table (EP > 1)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-latency sweep (GPU)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table per backend")
    p.add_argument("--peer", choices=["liger"], default=None,
                   help="also run a peer library in its own process on the same shape")
    p.add_argument("--peer-script", default=None, help="path to shared/peers/liger_bench.py")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 30 if torch.cuda.is_available() else 3
    if args.job == "gemm":
        from .gemm import run_gemm

        return run_gemm(args)
    return run_layer(args)


if __name__ == "__main__":
    sys.exit(main())
