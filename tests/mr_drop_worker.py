"""Multi-rank worker (CPU, gloo) for dropped choices, launched by test_reference.py through torchrun.

Every rank builds the same global problem with bad expert ids / non-finite weights, runs its slice
on the EP=W reference layer and compares with the EP=1 layer on the same routing with those
choices removed; each rank's check_errors() names its own first offender (local token index).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_oracle import make_problem  # noqa: E402

from moe_ep.api import EPGroup, MoEConfig, MoELayer, RoutingValueError, init_distributed  # noqa: E402


def main():
    group = init_distributed("gloo")
    W, r = group.world_size, group.rank
    E, H, I, K, Tr = 8, 32, 16, 2, 6
    T = Tr * W
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=Tr)
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=77)
    for t in range(W):  # one bad choice per rank, at local token (rank % Tr), k = rank % K
        g = t * Tr + t % Tr
        if t % 2:
            ids[g, t % K] = -1 - t
        else:
            w[g, t % K] = float("nan")
    ids[1, 0] = 1000  # rank 0 also gets a bad id
    dropped = (ids < 0) | (ids >= E) | ~torch.isfinite(w)
    ok_ids, ok_w = torch.where(dropped, 0, ids), torch.where(dropped, 0.0, w)
    El = E // W
    sl = slice(r * Tr, (r + 1) * Tr)
    ep = MoELayer(cfg, group, backend="reference", device="cpu", check_values=False)
    cfg1 = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T)
    full = MoELayer(cfg1, EPGroup.single(), backend="reference", device="cpu").forward(x, ok_ids, ok_w, w13, w2)
    lw = (w13[r * El:(r + 1) * El].contiguous(), w2[r * El:(r + 1) * El].contiguous())
    mine = ep.forward(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous(), *lw)
    assert torch.isfinite(mine).all()
    assert torch.equal(mine, full[sl]), f"rank {r}: EP={W} with drops differs from EP=1 without them"
    try:
        ep.check_errors()
        raise AssertionError("no RoutingValueError")
    except RoutingValueError as e:
        want = ("topk_ids", 1, 0, 1000) if r == 0 else (
            ("topk_ids", r % Tr, r % K, -1 - r) if r % 2 else ("topk_weights", r % Tr, r % K))
        assert (e.argument, e.token, e.k, e.value)[:len(want)] == want, (r, str(e))
    ep.check_errors()
    recv_x, offs, h = ep.dispatch(x[sl].contiguous(), ids[sl].contiguous(), w[sl].contiguous())
    assert int(offs[-1]) == recv_x.shape[0] == int(((ok_ids // El == r) & ~dropped).sum())
    ep.combine(recv_x, h)
    ep.destroy()
    dist.barrier()
    print(f"rank {r}/{W}: OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
