"""The SM90 backend's receiver-side expert layout (pure torch) against a plain Python loop."""

import torch

from moe_ep.backends.sm90.bf16_cutedsl.layout import LayoutBuffers, expert_layout


def test_expert_layout_matches_loop():
    g = torch.Generator().manual_seed(0)
    W, Tm, K, El = 3, 7, 4, 5
    S = W * Tm
    recv_ids = torch.randint(-1, El, (S, K), generator=g, dtype=torch.int32)
    recv_w = torch.rand(S, K, generator=g)
    recv_count = torch.tensor([7, 0, 4], dtype=torch.int32)
    lb = LayoutBuffers.allocate(W, Tm, K, El, "cpu")
    lb.pos.fill_(123)
    expert_layout(lb, recv_ids, recv_w, recv_count, El)
    # loop: pairs (expert, slot, k) in order
    pairs = []
    for s in range(S):
        src, t = divmod(s, Tm)
        if t >= recv_count[src]:
            continue
        for k in range(K):
            e = int(recv_ids[s, k])
            if e >= 0:
                pairs.append((e, s, k))
    pairs.sort()
    counts = [sum(1 for p in pairs if p[0] == e) for e in range(El)]
    assert lb.offsets.tolist() == [0] + list(torch.tensor(counts).cumsum(0).tolist())
    R = len(pairs)
    assert lb.idx[:R].tolist() == [s for _, s, _ in pairs]
    assert torch.equal(lb.ws[:R], torch.stack([recv_w[s, k] for _, s, k in pairs]))
    want_pos = torch.full((S, K), -1, dtype=torch.int32)
    for r, (_, s, k) in enumerate(pairs):
        want_pos[s, k] = r
    assert torch.equal(lb.pos, want_pos)
    # a second call with other routing leaves nothing stale behind
    recv_count2 = torch.tensor([1, 7, 0], dtype=torch.int32)
    expert_layout(lb, recv_ids, recv_w, recv_count2, El)
    assert int(lb.offsets[-1]) == int((recv_ids[[0] + list(range(Tm, 2 * Tm))] >= 0).sum())
    assert int((lb.pos >= 0).sum()) == int(lb.offsets[-1])
