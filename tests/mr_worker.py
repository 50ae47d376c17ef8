"""Multi-rank worker (CPU, gloo), launched by test_multirank.py through torchrun.

Every rank builds the same global problem, runs its slice on the EP=W layer and compares with the
EP=1 layer on the whole problem (computed locally), then checks the split dispatch/combine pair;
then every activation with and without per-expert biases against EP=1 and the float64 oracle.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_oracle import make_problem, oracle_f64, rel_err  # noqa: E402

from moe_ep.api import ACTIVATIONS, EPGroup, MoEConfig, MoELayer, init_distributed  # noqa: E402


def split_tokens(T, W, case):
    if case == "even":
        base = [T // W] * W
        base[-1] += T - sum(base)
    else:  # uneven, rank 0 gets nothing
        base = [0] + [(T * (r + 1)) // (sum(range(2, W + 1))) for r in range(1, W)]
        base[-1] += T - sum(base)
    return base


def main():
    group = init_distributed("gloo")
    W, r = group.world_size, group.rank
    torch.manual_seed(0)
    cases = [  # E, H, I, K, T, act, skew, split
        (8, 64, 32, 2, 48, "swiglu", False, "even"),
        (16, 64, 32, 8, 40, "swiglu", True, "uneven"),
        (8, 32, 16, 1, 30, "squared_relu", True, "uneven"),
        (8, 48, 24, 2, 24, "gelu_glu", False, "even"),
    ]
    for (E, H, I, K, T, act, skew, split) in cases:
        cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, activation=act)
        x, ids, w, w13, w2 = make_problem(E, H, I, K, T, gated=cfg.gated, skew=skew, seed=E + T)
        El = E // W
        sizes = split_tokens(T, W, split)
        lo = sum(sizes[:r])
        sl = slice(lo, lo + sizes[r])
        ep = MoELayer(cfg, group, backend="reference", device="cpu")
        one = MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu")
        full = one.forward(x, ids, w, w13, w2)
        mine = ep.forward(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous(),
                          w13[r * El:(r + 1) * El].contiguous(), w2[r * El:(r + 1) * El].contiguous())
        assert mine.shape == (sizes[r], H)
        if sizes[r]:
            e = rel_err(mine, full[sl])
            assert e < 2e-3, f"rank {r}: EP={W} vs EP=1 rel err {e} ({E=} {K=} {act=} {skew=})"
        # split pair round trip: identity experts -> sum_k w x
        recv_x, offs, h = ep.dispatch(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous())
        assert offs.shape == (El + 1,) and int(offs[-1]) == recv_x.shape[0]
        want_rows = int(((ids // El) == r).sum())
        assert recv_x.shape[0] == want_rows, (recv_x.shape, want_rows)
        y = ep.combine(recv_x, h)
        if sizes[r]:
            ref = x[sl].double() * w[sl].double().sum(1, keepdim=True)
            assert rel_err(y, ref) < 5e-3
        ep.destroy()
        dist.barrier()
    # every activation x biases (none, float32, bf16): EP=W equals EP=1 and the float64 oracle
    for i, act in enumerate(ACTIVATIONS):
        for j, bias_dtype in enumerate((None, torch.float32, torch.bfloat16)):
            E, H, I, K, T = 8, 32, 24, 2, 20
            cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T,
                            activation=act, bias_dtype=bias_dtype)
            x, ids, w, w13, w2 = make_problem(E, H, I, K, T, gated=cfg.gated, seed=1000 + 10 * i + j)
            if act == "clamped_swiglu":
                w13 = (w13.float() * 5).bfloat16()  # |FC1| beyond the limit 7 for some elements
            g = torch.Generator().manual_seed(2000 + 10 * i + j)
            b13 = b2 = None
            if bias_dtype is not None:
                b13 = torch.randn(E, cfg.w13_rows, generator=g).to(bias_dtype)
                b2 = torch.randn(E, H, generator=g).to(bias_dtype)
            El = E // W
            sizes = split_tokens(T, W, "uneven" if j % 2 else "even")
            lo = sum(sizes[:r])
            sl, es = slice(lo, lo + sizes[r]), slice(r * El, (r + 1) * El)
            mine_b = {} if b13 is None else dict(b13=b13[es].contiguous(), b2=b2[es].contiguous())
            all_b = {} if b13 is None else dict(b13=b13, b2=b2)
            with MoELayer(cfg, group, backend="reference", device="cpu") as ep, \
                    MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as one:
                full = one.forward(x, ids, w, w13, w2, **all_b)
                mine = ep.forward(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous(),
                                  w13[es].contiguous(), w2[es].contiguous(), **mine_b)
            if sizes[r]:
                e = rel_err(mine, full[sl])
                assert e < 2e-3, f"rank {r}: EP={W} vs EP=1 rel err {e} ({act=} {bias_dtype=})"
                ref = oracle_f64(x[sl], ids[sl], w[sl], w13, w2, act, I, b13=b13, b2=b2)
                e = rel_err(mine, ref)
                assert e < 6e-3, f"rank {r}: EP={W} vs float64 oracle rel err {e} ({act=} {bias_dtype=})"
            dist.barrier()
    # block-scaled weight formats: each rank quantises its own experts; EP=W equals EP=1
    from moe_ep.api.quant import quantize_fp8_block128, quantize_mxfp8, quantize_nvfp4

    for i, (quant, qf) in enumerate((("nvfp4_w4a16", quantize_nvfp4), ("mxfp8", quantize_mxfp8),
                                     ("fp8_block128", quantize_fp8_block128))):
        E, H, I, K, T = 8, 64, 32, 2, 24
        cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, quant=quant)
        x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=3000 + i)
        El = E // W
        sizes = split_tokens(T, W, "uneven" if i % 2 else "even")
        lo = sum(sizes[:r])
        sl, es = slice(lo, lo + sizes[r]), slice(r * El, (r + 1) * El)
        with MoELayer(cfg, group, backend="reference", device="cpu") as ep, \
                MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as one:
            full = one.forward(x, ids, w, qf(w13), qf(w2))
            mine = ep.forward(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous(),
                              qf(w13[es].contiguous()), qf(w2[es].contiguous()))
        if sizes[r]:  # every scale is per expert or per block: a rank's slice quantises identically
            e = rel_err(mine, full[sl])
            assert e < 2e-3, f"rank {r}: EP={W} vs EP=1 rel err {e} ({quant=})"
        dist.barrier()
    if W == 2:  # torch.compile(fullgraph=True): the collective forward as one operator, the eager bits
        E, H, I, K, T = 8, 64, 32, 2, 32
        cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T)
        x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=4000)
        El, sizes = E // W, split_tokens(T, W, "uneven")
        lo = sum(sizes[:r])
        sl, es = slice(lo, lo + sizes[r]), slice(r * El, (r + 1) * El)
        mine_w13, mine_w2 = w13[es].contiguous(), w2[es].contiguous()
        with MoELayer(cfg, group, backend="reference", device="cpu") as ep:
            compiled = torch.compile(lambda x, ids, w: ep.forward(x, ids, w, mine_w13, mine_w2), backend="eager",
                                     fullgraph=True)
            args = (x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous())
            got = compiled(*args)
            assert torch.equal(got, ep.forward(*args, mine_w13, mine_w2)), f"rank {r}: compiled != eager"
            if sizes[r]:
                assert rel_err(got, oracle_f64(x[sl], ids[sl], w[sl], w13, w2, "swiglu", I)) < 6e-3
        dist.barrier()
    print(f"rank {r}/{W}: OK", flush=True)
    dist.destroy_process_group()
    if W == 2:
        # A process that used torch.compile and a gloo group aborts at interpreter exit now and then
        # ("terminate called without an active exception": 1 in 12 runs of a 9-line script with torch
        # 2.13 and no moe_ep in it; 0 in 12 without the compile). Everything is checked and printed by
        # now, so skip the interpreter's teardown.
        os._exit(0)


if __name__ == "__main__":
    main()
