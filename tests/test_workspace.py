"""CPU: the SM90 backend's shared workspace -- carving, sizes, growth and re-binding, freeing."""

import gc

import torch

from moe_ep.api import MoEConfig, MoELayer
from moe_ep.backends.sm90.bf16_cutedsl import workspace as W


class Group:
    def __init__(self, rank=0, world_size=1, dist_backend="none"):
        self.rank, self.world_size, self.dist_backend, self.pg = rank, world_size, dist_backend, None


class Client:
    def __init__(self):
        self.rebinds = 0

    def _rebind(self):
        self.rebinds += 1


def cfg(T=512, E=128, H=2048, I=768, K=8):
    return MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T)


def test_workspace_bytes_formula():
    """The documented formula, term by term (each rounded to 256 bytes)."""
    r = lambda n: (n + 255) // 256 * 256  # noqa: E731
    c, w = cfg(T=8192), 1
    S, P, H, I, K, El = w * 8192, w * 8192 * 8, 2048, 768, 8, 128
    sym = r(2 * w * 8) + r(w * 4) + 2 * r(S * K * 4) + 2 * r(S * H * 2)
    loc = r(32) + r(16) + r(8192 * 4) + r(P * H * 2) + r(P * I * 2) + 2 * r(P * 4) + r(S * K * 4) \
        + r((El + 1) * 4) + r(1024 * El * 4)
    assert W.workspace_bytes(c, w) == sym + loc == MoELayer.workspace_bytes(c, 1)
    # Qwen3 EP=1 8192 tokens: well under the 1.78 GiB one layer held before
    assert W.workspace_bytes(c, 1) < 0.45 * 2**30
    assert W.workspace_bytes(cfg(T=8192), 8) > W.workspace_bytes(cfg(T=8192), 1)


def test_views_fixed_regions_and_alignment():
    ws = W.Workspace(("t",), torch.device("cpu"), 0, 2, Group(0, 2, "virtual"), nvshmem=False)
    a, b = W.Dims.of(cfg(T=100, K=2), 2), W.Dims.of(cfg(T=700), 2)
    ca, cb = Client(), Client()
    ws.register(ca, a)
    assert ws.reserve()
    va = ws.views(a)
    ws.register(cb, b)
    ws.bind(ca)
    assert ws.reserve()  # grew
    ws.rebind_others(cb)
    assert ca.rebinds == 1 and cb.rebinds == 0
    va, vb = ws.views(a), ws.views(b)
    for name in ("flags", "recv_count", "ctrl", "err"):  # protocol state: same place for every layer
        assert va[name].data_ptr() == vb[name].data_ptr()
        assert int(va[name].abs().sum()) == 0
    assert vb["recv_x"].shape == (2 * 700, 2048) and vb["xs"].shape == (2 * 700 * 8, 2048)
    assert vb["h"].shape == (2 * 700 * 8, 768) and vb["counts"].numel() == 1024 * 64
    bases = (ws.sym_pool.data_ptr(), ws.local_pool.data_ptr())  # (device pools are 512-B aligned)
    for v in (va, vb):
        for t in v.values():
            assert min((t.data_ptr() - b) % 256 for b in bases) == 0 and t.is_contiguous()
    assert not ws.reserve()  # big enough already
    ws.detach(ca)
    assert ws.sym_pool is not None
    ws.detach(cb)
    assert ws.sym_pool is None and ws.local_pool is None


def test_registry_one_workspace_per_group_rank_device():
    g0, g1 = Group(0, 2, "virtual"), Group(1, 2, "virtual")
    d = torch.device("cpu")
    a, b, c = W.get_workspace(g0, d), W.get_workspace(g0, d), W.get_workspace(g1, d)
    assert a is b and a is not c
    cl = Client()
    a.register(cl, W.Dims.of(cfg(T=8), 2))
    a.detach(cl)
    assert all(x is not a for x in W.live_workspaces())
    del a, b, c
    gc.collect()
