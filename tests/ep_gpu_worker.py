"""Multi-GPU worker (one process per GPU, NCCL + NVSHMEM), launched by test_ep_gpu.py via torchrun.

Checks, on the sm90_bf16_cutedsl backend against the reference backend (same global inputs):
oracle for several shapes/routings/top_k/uneven T (incl. 0); CUDA-graph capture + lockstep
replay bit-identical to eager, then new inputs; 100 consecutive forwards with changing routing;
bit-determinism (repeat, and with one rank delayed); bad input rejected on every rank, bad values
dropped and reported by the rank that sent them; layers of two shapes sharing one workspace,
interleaved; a forced stall raising DeviceStallError naming the stalled rank, then recovery.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from moe_ep.api import MoEConfig, MoELayer, init_distributed
from moe_ep.shim import DeviceStallError  # noqa: F401 (test code may name shim errors)

G = None


def log(msg):
    print(f"[rank {G.rank}] {msg}", flush=True)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def problem(cfg, T_per_rank, seed, skew=False):
    """This rank's slice of a global problem (same global experts for every EP size)."""
    W, r = G.world_size, G.rank
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, H, generator=g) for t in T_per_rank]
    logits = [torch.randn(t, E, generator=g) for t in T_per_rank]
    if skew:
        for lg in logits:
            lg[:, 0] += 5.0
            lg[:, E // 2:E // 2 + E // 8] -= 50.0  # some experts get nothing
    ids = [lg.topk(K, -1).indices.to(torch.int32) for lg in logits]
    ws = [torch.softmax(torch.randn(t, K, generator=g), -1) for t in T_per_rank]
    El = E // W
    gw = torch.Generator().manual_seed(seed + 7)
    w13 = (torch.randn(E, cfg.w13_rows, H, generator=gw) * H ** -0.5)[r * El:(r + 1) * El]
    w2 = (torch.randn(E, H, I, generator=gw) * I ** -0.5)[r * El:(r + 1) * El]
    dev = torch.device("cuda", torch.cuda.current_device())
    bf = torch.bfloat16
    return (xs[r].to(bf).to(dev), ids[r].to(dev), ws[r].float().to(dev),
            w13.contiguous().to(bf).to(dev), w2.contiguous().to(bf).to(dev))


def check_oracle(cfg, T_per_rank, seed, skew, tol=1e-2):
    x, ids, w, w13, w2 = problem(cfg, T_per_rank, seed, skew)
    with MoELayer(cfg, G, backend="sm90_bf16_cutedsl") as fast, MoELayer(cfg, G, backend="reference") as ref:
        fast.warmup(progress=False)
        out = torch.full_like(x, float("nan"))
        got = fast.forward(x, ids, w, w13, w2, out=out)
        want = ref.forward(x, ids, w, w13, w2)
        fast.check_errors()
        assert torch.isfinite(got).all(), "NaN left in the output (unwritten rows)"
        if x.shape[0]:
            e = rel(got, want)
            assert e < tol, f"rel err {e:.3e} vs reference ({cfg}, T={T_per_rank}, skew={skew})"
        # split pair
        recv, offs, h = fast.dispatch(x, ids, w)
        from moe_ep.backends.reference import expert_mlp

        y = expert_mlp(recv, offs, w13, w2, cfg.activation, cfg.intermediate)
        got2 = fast.combine(y, h)
        if x.shape[0]:
            assert rel(got2, want) < tol
        fast.check_errors()
    return True


def main():
    global G
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(2 << 30))
    G = init_distributed()
    W, r = G.world_size, G.rank
    # Layers come and go below; one reference held for the whole run keeps NVSHMEM initialised
    # once (re-initialising after finalize is not supported by every NVSHMEM version).
    from moe_ep.shim import nvshmem_acquire

    keepalive = nvshmem_acquire(G.pg, device_index=torch.cuda.current_device())
    which = sys.argv[1:] or ["oracle", "graph", "many", "determinism", "bad", "layers", "stall"]
    qwen = dict(num_experts=128, hidden=2048, intermediate=768)
    if "oracle" in which:
        for K, Ts, skew in ((8, [512] * W, False), (8, [0] + [700] * (W - 1), True), (2, [300 + 17 * i for i in range(W)], False),
                            (1, [129] * W, True)):
            cfg = MoEConfig(top_k=K, max_tokens_per_rank=1024, **qwen)
            check_oracle(cfg, Ts, seed=K * 100 + sum(Ts), skew=skew)
            log(f"oracle qwen3 K={K} T={Ts} skew={skew}: OK")
        cfg = MoEConfig(num_experts=8, hidden=4096, intermediate=14336, top_k=2, max_tokens_per_rank=512)
        check_oracle(cfg, [256 + 32 * i for i in range(W)], seed=5, skew=False)  # <= 480 tokens at W = 8
        check_oracle(cfg, [300] * W, seed=6, skew=True)
        log("oracle mixtral: OK")
    cfg = MoEConfig(top_k=8, max_tokens_per_rank=1024, **qwen)
    if "graph" in which:
        T = 768
        x, ids, w, w13, w2 = problem(cfg, [T] * W, seed=11)
        with MoELayer(cfg, G, backend="sm90_bf16_cutedsl") as layer:
            layer.warmup(progress=False)
            eager = layer.forward(x, ids, w, w13, w2).clone()
            out = torch.empty_like(x)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                layer.forward(x, ids, w, w13, w2, out=out)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            dist.barrier()
            with torch.cuda.graph(graph):
                layer.forward(x, ids, w, w13, w2, out=out)
            torch.cuda.synchronize()
            dist.barrier()
            for _ in range(5):
                out.fill_(float("nan"))
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, eager), "graph replay differs from eager"
            x2, ids2, w_2, _, _ = problem(cfg, [T] * W, seed=12)
            x.copy_(x2), ids.copy_(ids2), w.copy_(w_2)
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            want = layer.forward(x2, ids2, w_2, w13, w2)
            torch.cuda.synchronize()
            assert torch.equal(out, want) and not torch.equal(out, eager)
            layer.check_errors()
            del graph
        log("cuda graph: OK")
    if "many" in which:
        with MoELayer(cfg, G, backend="sm90_bf16_cutedsl") as fast, MoELayer(cfg, G, backend="reference") as ref:
            fast.warmup(progress=False)
            _, _, _, w13, w2 = problem(cfg, [1] * W, seed=21)
            for i in range(100):
                Ts = [(97 * i + 311 * q) % 1025 for q in range(W)]
                x, ids, w, _, _ = problem(cfg, Ts, seed=1000 + i, skew=(i % 3 == 0))
                got = fast.forward(x, ids, w, w13, w2)
                want = ref.forward(x, ids, w, w13, w2)
                if x.shape[0]:
                    assert rel(got, want) < 1e-2, f"forward {i}: rel {rel(got, want)}"
            fast.check_errors()
        log("100 consecutive forwards: OK")
    if "determinism" in which:
        x, ids, w, w13, w2 = problem(cfg, [900] * W, seed=31, skew=True)
        with MoELayer(cfg, G, backend="sm90_bf16_cutedsl") as layer:
            layer.warmup(progress=False)
            a = layer.forward(x, ids, w, w13, w2).clone()
            b = layer.forward(x, ids, w, w13, w2).clone()
            for delayed in range(W):
                dist.barrier()
                if r == delayed:
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin before this rank's forward
                c = layer.forward(x, ids, w, w13, w2, out=torch.full_like(x, float("nan"))).clone()
                torch.cuda.synchronize()
                assert torch.equal(a, c), f"not bit-identical with rank {delayed} delayed"
            assert torch.equal(a, b)
            layer.check_errors()
        log("determinism: OK")
    if "bad" in which:
        x, ids, w, w13, w2 = problem(cfg, [64] * W, seed=41)
        with MoELayer(cfg, G, backend="sm90_bf16_cutedsl") as layer, MoELayer(cfg, G, backend="reference") as ref:
            layer.warmup(progress=False)
            for args, exc in (((x.float(), ids, w, w13, w2), TypeError),
                              ((x, ids, w, w13[:-1].contiguous(), w2), ValueError)):
                try:
                    layer.forward(*args)
                except exc:
                    pass
                else:
                    raise AssertionError(f"bad input not rejected: {exc}")
            # bad values only the GPU sees: dropped, reported by check_errors on the rank that sent them
            bad, bw = ids.clone(), w.clone()
            if r == 0:
                bad[3, 1] = cfg.num_experts + 5
            bw[7, 2] = float("nan")
            got = layer.forward(x, bad, bw, w13, w2)
            want = ref.forward(x, bad, bw, w13, w2)
            assert torch.isfinite(got).all() and rel(got, want) < 1e-2
            from moe_ep.api import RoutingValueError

            try:
                layer.check_errors()
            except RoutingValueError as e:
                assert (e.argument, e.token, e.k) == (("topk_ids", 3, 1) if r == 0 else ("topk_weights", 7, 2)), str(e)
            else:
                raise AssertionError("bad values not reported")
            layer.check_errors()
            # the layer still works afterwards on every rank
            layer.forward(x, ids, w, w13, w2)
            torch.cuda.synchronize()
            layer.check_errors()
        log("bad inputs: OK")
    if "layers" in which:
        small = MoEConfig(top_k=8, max_tokens_per_rank=256, **qwen)
        ls = [MoELayer(c, G, backend="sm90_bf16_cutedsl") for c in (small, cfg, cfg, small)]
        for layer in ls:
            layer.warmup(progress=False)
        with MoELayer(cfg, G, backend="reference") as ref:
            probs = [problem(c, [200 + 7 * q for q in range(W)], seed=61 + i)  # <= small's 256 at W = 8
                     for i, c in enumerate((small, cfg))]
            for li, pi in ((0, 0), (1, 1), (3, 0), (2, 1), (0, 0)):
                x, ids, w, w13, w2 = probs[pi]
                got = ls[li].forward(x, ids, w, w13, w2, out=torch.full_like(x, float("nan")))
                assert rel(got, ref.forward(x, ids, w, w13, w2)) < 1e-2
        for layer in ls:
            layer.check_errors()
            layer.destroy()
        log("layers sharing one workspace: OK")
    if "stall" in which:
        x, ids, w, w13, w2 = problem(cfg, [128] * W, seed=51)
        with MoELayer(cfg, G, backend="sm90_bf16_cutedsl", timeout_s=0.5) as layer:
            layer.warmup(progress=False)
            good = layer.forward(x, ids, w, w13, w2).clone()  # every rank, before the stall
            torch.cuda.synchronize()
            stalled = W - 1
            dist.barrier()
            t0 = time.time()
            if r != stalled:
                layer.forward(x, ids, w, w13, w2)
                torch.cuda.synchronize()
                try:
                    layer.check_errors()
                except DeviceStallError as e:
                    assert f"rank {stalled}" in str(e), str(e)
                    log(f"stall detected after {time.time() - t0:.2f}s: {e}")
                else:
                    raise AssertionError("no timeout error although a rank never sent")
            dist.barrier()
            layer.reset_error_state()
            out = layer.forward(x, ids, w, w13, w2, out=torch.full_like(x, float("nan")))
            torch.cuda.synchronize()
            layer.check_errors()
            assert torch.equal(out, good)  # recovered: every row written, the bits of before
        log("stall -> DeviceStallError, recovery: OK")
    dist.barrier()
    keepalive.release()  # the last reference: frees leftovers, finalises NVSHMEM
    log("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
