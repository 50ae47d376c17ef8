"""EP layer with W virtual ranks on one GPU (dispatch -> grouped GEMMs -> combine, peer pointers
between the virtual ranks' buffers) against the reference backend on the same global inputs."""

import pytest
import torch
from moe_oracle import capture_graph, poison_layer, replay_poisoned, worst_row_err

pytestmark = pytest.mark.gpu


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def nan_like(xs) -> list:
    """A NaN-poisoned output per rank, shaped like its tokens ``xs[r]``: rows a forward leaves unwritten show."""
    return [torch.full_like(t, float("nan")) for t in xs]


def forward_and_check(vep, Ts, want, sl, xs, *args):
    """One forward of every virtual rank into NaN-poisoned outputs; each rank with tokens must
    write every row and match ``want[sl[r]]`` to 1e-2 relative, and each of its tokens to 3e-2."""
    outs = nan_like(xs)
    vep.forward(xs, *args, outs)
    torch.cuda.synchronize()
    vep.check()
    for r in range(len(xs)):
        if Ts[r]:
            assert torch.isfinite(outs[r]).all(), f"rank {r}: unwritten rows"
            assert rel(outs[r], want[sl[r]]) < 1e-2, f"rank {r}: rel {rel(outs[r], want[sl[r]])}"
            worst = worst_row_err(outs[r], want[sl[r]])
            assert worst < 3e-2, f"rank {r}: worst token {worst}"


def global_problem(E, H, I, K, Ts, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(Ts)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, 0] += 5.0
        logits[:, E // 2:E // 2 + max(1, E // 8)] -= 50.0
    ids = logits.topk(K, -1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    return [t.cuda() for t in (x, ids, w, w13, w2)]


def split(Ts, W, E, x, ids, w, w13, w2):
    El = E // W
    offs = [sum(Ts[:r]) for r in range(W + 1)]
    sl = [slice(offs[r], offs[r + 1]) for r in range(W)]
    return ([x[s].contiguous() for s in sl], [ids[s].contiguous() for s in sl], [w[s].contiguous() for s in sl],
            [w13[r * El:(r + 1) * El].contiguous() for r in range(W)],
            [w2[r * El:(r + 1) * El].contiguous() for r in range(W)], sl)


def reference(cfg, x, ids, w, w13, w2):
    from moe_ep.api import EPGroup, MoELayer

    import dataclasses

    big = dataclasses.replace(cfg, max_tokens_per_rank=max(1, x.shape[0]))
    with MoELayer(big, EPGroup.single(), backend="reference") as ref:
        return ref.forward(x, ids, w, w13, w2)


def make(cfg, W, **kw):
    from moe_ep.backends.sm90.bf16_cutedsl.virtual import VirtualEP

    return VirtualEP(cfg, W, **kw)


@pytest.mark.parametrize("W,K,Ts,skew,ids_dtype", [
    (1, 8, [700], True, torch.int32),
    (2, 8, [512, 512], False, torch.int32),
    (4, 8, [256, 0, 100, 333], True, torch.int64),
    (2, 8, [0, 700], True, torch.int32),
    (2, 2, [300, 317], False, torch.int64),
    (2, 1, [129, 64], True, torch.int32),
    (8, 8, [64, 1, 0, 200, 7, 128, 33, 90], False, torch.int32),
])
def test_virtual_ep_matches_reference_qwen3(W, K, Ts, skew, ids_dtype):
    _sm90()
    from moe_ep.api import MoEConfig

    E, H, I = 128, 2048, 768
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=1024)
    x, ids, w, w13, w2 = global_problem(E, H, I, K, Ts, seed=W * 1000 + K + sum(Ts), skew=skew)
    want = reference(cfg, x, ids, w, w13, w2)
    vep = make(cfg, W)
    xs, idss, wss, w13s, w2s, sl = split(Ts, W, E, x, ids.to(ids_dtype), w, w13, w2)
    forward_and_check(vep, Ts, want, sl, xs, idss, wss, w13s, w2s)
    vep.destroy()


@pytest.mark.parametrize("W", [2, 4])
def test_virtual_ep_bit_identical_with_delayed_rank(W):
    """100 repeats of the same input, a different rank delayed every third forward: one output
    per rank, bit for bit (the expert layout places rows in (slot, k) order, no atomics)."""
    _sm90()
    from moe_ep.api import MoEConfig

    E, H, I, K = 128, 2048, 768, 8
    Ts = [400 + 37 * r for r in range(W)]
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=512)
    x, ids, w, w13, w2 = global_problem(E, H, I, K, Ts, seed=77 + W, skew=True)
    vep = make(cfg, W)
    args = split(Ts, W, E, x, ids, w, w13, w2)[:5]
    first = [o.clone() for o in vep.forward(*args)]
    for i in range(100):  # each forward into NaN: rows a delay left unwritten would show
        outs = vep.forward(*args, nan_like(args[0]),
                           delay_rank=(i // 3) % W if i % 3 == 0 else None)
        if i % 10 == 9 or i % 3 == 0:
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(first, outs)), f"repeat {i} differs"
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, outs))
    vep.check()
    vep.destroy()


def test_virtual_ep_layers_share_workspaces():
    """Two virtual-EP layers of different shapes on the same per-rank workspaces, interleaved;
    the bigger one (built second) grows the workspaces and re-binds the first."""
    _sm90()
    from moe_ep.api import MoEConfig

    E, H, I, K, W = 128, 2048, 768, 8, 2
    small = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=256)
    big = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=1024)
    a = make(small, W)
    pa = global_problem(E, H, I, K, [200, 256], seed=301)
    outa = a.forward(*split([200, 256], W, E, *pa)[:5])
    b = make(big, W)
    pb = global_problem(E, H, I, K, [1000, 333], seed=302)
    for _ in range(2):
        for vep, Ts, p, cfg in ((a, [200, 256], pa, small), (b, [1000, 333], pb, big), (a, [200, 256], pa, small)):
            args = split(Ts, W, E, *p)
            outs = vep.forward(*args[:5], nan_like(args[0]))
            torch.cuda.synchronize()
            want = reference(cfg, *p)
            for r in range(W):
                assert rel(outs[r], want[args[5][r]]) < 1e-2 and worst_row_err(outs[r], want[args[5][r]]) < 3e-2
    again = split([200, 256], W, E, *pa)[:5]
    assert all(torch.equal(u, v) for u, v in zip(outa, a.forward(*again, nan_like(again[0]))))
    a.check(), b.check()
    a.destroy(), b.destroy()


def test_virtual_ep_mixtral():
    _sm90()
    from moe_ep.api import MoEConfig

    E, H, I, K, W, Ts = 8, 4096, 14336, 2, 2, [384, 200]
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=512)
    x, ids, w, w13, w2 = global_problem(E, H, I, K, Ts, seed=3)
    want = reference(cfg, x, ids, w, w13, w2)
    vep = make(cfg, W)
    xs, idss, wss, w13s, w2s, sl = split(Ts, W, E, x, ids, w, w13, w2)
    outs = vep.forward(xs, idss, wss, w13s, w2s)
    torch.cuda.synchronize()
    vep.check()
    for r in range(W):
        assert rel(outs[r], want[sl[r]]) < 1e-2 and worst_row_err(outs[r], want[sl[r]]) < 3e-2
    vep.destroy()


def test_virtual_ep_many_forwards_determinism_stall():
    """100 forwards with changing routing and T (stale flags/counters would show), bit-identical
    repeats incl. a delayed rank, a stalled rank -> DeviceStallError naming it, recovery."""
    _sm90()
    from moe_ep.api import MoEConfig
    from moe_ep.shim import DeviceStallError

    E, H, I, K, W = 64, 1024, 512, 4, 2
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=256)
    vep = make(cfg, W, timeout_s=0.5)
    _, _, _, w13, w2 = global_problem(E, H, I, K, [1], seed=99)
    for i in range(100):
        Ts = [(37 * i + 101 * r) % 257 for r in range(W)]
        x, ids, w, _, _ = global_problem(E, H, I, K, Ts, seed=i, skew=(i % 4 == 0))
        want = reference(cfg, x, ids, w, w13, w2)
        xs, idss, wss, w13s, w2s, sl = split(Ts, W, E, x, ids, w, w13, w2)
        outs = vep.forward(xs, idss, wss, w13s, w2s)
        torch.cuda.synchronize()
        for r in range(W):
            if Ts[r]:
                assert rel(outs[r], want[sl[r]]) < 1e-2, f"forward {i} rank {r}"
                assert worst_row_err(outs[r], want[sl[r]]) < 3e-2, f"forward {i} rank {r}: worst token"
    vep.check()
    Ts = [200, 150]
    x, ids, w, _, _ = global_problem(E, H, I, K, Ts, seed=7, skew=True)
    args = split(Ts, W, E, x, ids, w, w13, w2)[:5]
    a = [o.clone() for o in vep.forward(*args)]
    for delayed in range(W):
        b = vep.forward(*args, nan_like(args[0]), delay_rank=delayed)
        torch.cuda.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"not bit-identical with rank {delayed} delayed"
    # stall: rank 1 never runs its forward
    vep.forward(*args, ranks=[0])
    torch.cuda.synchronize()
    with pytest.raises(DeviceStallError, match="waiting for rank 1"):
        vep.ranks[0].check()
    vep.reset()
    c = vep.forward(*args, nan_like(args[0]))  # recovered: writes it all
    torch.cuda.synchronize()
    vep.check()
    assert all(torch.equal(p, q) for p, q in zip(a, c))
    vep.destroy()


def test_virtual_ep_cuda_graph():
    """All W ranks' forwards captured in one graph (forked streams); replays are bit-identical
    to eager, and new inputs copied into the captured buffers give their own correct result."""
    _sm90()
    from moe_ep.api import MoEConfig

    E, H, I, K, W, Ts = 128, 2048, 768, 8, 2, [400, 300]
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=512)
    vep = make(cfg, W)
    x, ids, w, w13, w2 = global_problem(E, H, I, K, Ts, seed=5)
    xs, idss, wss, w13s, w2s, sl = split(Ts, W, E, x, ids, w, w13, w2)
    eager = [o.clone() for o in vep.forward(xs, idss, wss, w13s, w2s)]
    outs = [torch.empty_like(t) for t in xs]
    vep.forward(xs, idss, wss, w13s, w2s, outs)
    torch.cuda.synchronize()
    g = capture_graph(lambda: vep.forward(xs, idss, wss, w13s, w2s, outs))
    for _ in range(5):
        replay_poisoned(g, *outs, layer=vep)
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))
    x2, ids2, w_2, _, _ = global_problem(E, H, I, K, Ts, seed=6)
    n = split(Ts, W, E, x2, ids2, w_2, w13, w2)
    for r in range(W):
        xs[r].copy_(n[0][r]), idss[r].copy_(n[1][r]), wss[r].copy_(n[2][r])
    g.replay()
    torch.cuda.synchronize()
    want = reference(cfg, x2, ids2, w_2, w13, w2)
    for r in range(W):
        assert rel(outs[r], want[sl[r]]) < 1e-2
    vep.check()
    del g
    vep.destroy()


@pytest.mark.parametrize("fused", [False, True, "scatter"])
@pytest.mark.parametrize("W,Ts", [(2, [256, 300]), (4, [256, 0, 100, 333])])
def test_virtual_ep_fp8_block128(W, Ts, fused, monkeypatch):
    """The FP8 backend's ranks (BF16 dispatch/combine around the FP8 GEMMs) against the reference
    backend's FP8 semantics on the same global inputs and quantised weights; ``fused``: FC1's input
    gathered and quantised from the receive buffer in one pass (the default; off: MOE_EP_FP8_FUSED_GATHER=0);
    "scatter": each received row quantised once into its grouped rows (MOE_EP_FP8_SCATTER_QUANT=1,
    drop v25: slots of W sources, receive counts per source)."""
    _sm90()
    monkeypatch.setenv("MOE_EP_FP8_FUSED_GATHER", "1" if fused else "0")
    monkeypatch.setenv("MOE_EP_FP8_SCATTER_QUANT", "1" if fused == "scatter" else "0")
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    cfg, want, sl, xs, idss, wss, w13s, w2s = fp8_problem(W, Ts, seed=77 + W)
    vep = make(cfg, W, backend_cls=Sm90Fp8Backend)
    forward_and_check(vep, Ts, want, sl, xs, idss, wss, w13s, w2s)
    vep.destroy()


def fp8_problem(W, Ts, seed):
    """Qwen3-shaped FP8 block-128 problem (skewed routing) split over W ranks: (cfg, the
    reference's FP8 output, per-rank row slices, xs, ids, weights, w13 and w2 shards)."""
    from moe_ep.api import MoEConfig
    from moe_ep.api.quant import FP8Block128Weight, quantize_fp8_block128

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=512,
                    quant="fp8_block128")
    x, ids, w, w13, w2 = global_problem(E, H, I, K, Ts, seed=seed, skew=True)
    q13, q2 = quantize_fp8_block128(w13), quantize_fp8_block128(w2)
    want = reference(cfg, x, ids, w, q13, q2)
    El = E // W
    part = lambda q, r: FP8Block128Weight(q.values[r * El:(r + 1) * El].contiguous(),  # noqa: E731
                                          q.scale[r * El:(r + 1) * El].contiguous())
    xs, idss, wss, _, _, sl = split(Ts, W, E, x, ids, w, w13, w2)
    return cfg, want, sl, xs, idss, wss, [part(q13, r) for r in range(W)], [part(q2, r) for r in range(W)]


@pytest.mark.parametrize("W,Ts", [(2, [256, 300]), (4, [256, 0, 100, 333])])
def test_virtual_ep_fp8_wire_is_bit_identical(W, Ts, monkeypatch):
    """FP8 on the wire (MOE_EP_FP8_WIRE=1: each rank quantises its tokens and sends E4M3 rows +
    scale rows) gives the bits of BF16 on the wire with the receiver quantising, every rank, twice
    in a row (the epoch protocol of the three sessions stays in step); and the reference's FP8
    semantics to 1e-2."""
    _sm90()
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    cfg, want, sl, xs, idss, wss, w13s, w2s = fp8_problem(W, Ts, seed=91 + W)
    got = {}
    for wire in ("0", "1"):
        monkeypatch.setenv("MOE_EP_FP8_WIRE", wire)
        vep = make(cfg, W, backend_cls=Sm90Fp8Backend)
        assert all(b.fp8_wire == (wire == "1") for b in vep.ranks)
        runs = []
        for _ in range(2):
            outs = nan_like(xs)
            poison_layer(vep)  # the second run must not lean on the first one's buffers
            vep.forward(xs, idss, wss, w13s, w2s, outs)
            torch.cuda.synchronize()
            vep.check()
            runs.append([o.clone() for o in outs])
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        got[wire] = runs[0]
        vep.destroy()
    for r in range(W):
        assert torch.equal(got["0"][r], got["1"][r]), f"rank {r}: FP8 wire changed the bits"
        if Ts[r]:
            assert torch.isfinite(got["1"][r]).all() and rel(got["1"][r], want[sl[r]]) < 1e-2
            assert worst_row_err(got["1"][r], want[sl[r]]) < 6e-2  # FP8: the layer test's per-token bound
