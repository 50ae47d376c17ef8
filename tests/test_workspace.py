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


def test_quantised_rows_are_workspace_regions():
    """The block-scaled backends' quantised grouped rows (xq [P, H], hq [P, I] e4m3, one scale per
    block) are regions of the shared local pool, sized by the formula, so N FP8 layers hold one
    layer's bytes: two layers' views are the same memory, and a BF16 layer's views have none."""
    r = lambda n: (n + 255) // 256 * 256  # noqa: E731
    c = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=8192,
                  quant="fp8_block128")
    P, H, I = 8192 * 8, 2048, 768
    fp8_extra = r(P * H) + r(P * H // 128 * 4) + r(P * I) + r(P * I // 128 * 4)
    mx_extra = r(P * H) + r(P * H // 32) + r(P * I) + r(P * I // 32)
    bf16 = MoELayer.workspace_bytes(c, 1)
    assert MoELayer.workspace_bytes(c, 1, backend="sm90_fp8_cutedsl") == bf16 + fp8_extra
    assert MoELayer.workspace_bytes(c, 1, backend="sm120_mxfp8_cutedsl") == bf16 + mx_extra
    assert MoELayer.workspace_bytes(c, 1, backend="sm100_w4a16_cutedsl") == bf16
    assert MoELayer.workspace_bytes(c, 1, backend="reference") == 0

    small = cfg(T=64)
    ws = W.Workspace(("q",), torch.device("cpu"), 0, 1, Group(), nvshmem=False)
    q1, q2 = W.Dims.of(small, 1, (128, torch.float32)), W.Dims.of(small, 1, (128, torch.float32))
    plain = W.Dims.of(small, 1)
    clients = [Client() for _ in range(3)]
    for cl, dims in zip(clients, (q1, q2, plain)):
        ws.register(cl, dims)
    assert ws.reserve()
    assert ws.local_bytes == W.workspace_bytes(small, 1, (128, torch.float32)) - ws.sym_bytes
    v1, v2, vb = ws.views(q1), ws.views(q2), ws.views(plain)
    Pq = 64 * 8
    want = {"xq": ((Pq, 2048), torch.float8_e4m3fn), "xq_scale": ((Pq, 16), torch.float32),
            "hq": ((Pq, 768), torch.float8_e4m3fn), "hq_scale": ((Pq, 6), torch.float32)}
    lo, hi = ws.local_pool.data_ptr(), ws.local_pool.data_ptr() + ws.local_bytes
    for name, (shape, dtype) in want.items():
        t = v1[name]
        assert (tuple(t.shape), t.dtype) == (shape, dtype), name
        assert t.data_ptr() == v2[name].data_ptr() and lo <= t.data_ptr() < hi, name
        assert name not in vb
    # no region overlaps another of the same layer
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for k, t in v1.items()
                   if t.data_ptr() >= lo and t.data_ptr() < hi)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for cl in clients:
        ws.detach(cl)
    assert ws.local_pool is None


def test_views_fixed_regions_and_alignment(monkeypatch):
    real_empty = torch.empty

    def poisoned_empty(*a, **kw):  # new pools hold 0xA5, not the zeros the OS hands out on the CPU
        return real_empty(*a, **kw).fill_(0xA5) if kw.get("dtype") is torch.uint8 else real_empty(*a, **kw)

    monkeypatch.setattr(W.torch, "empty", poisoned_empty)
    ws = W.Workspace(("t",), torch.device("cpu"), 0, 2, Group(0, 2, "virtual"), nvshmem=False)
    a, b = W.Dims.of(cfg(T=100, K=2), 2), W.Dims.of(cfg(T=700), 2)
    ca, cb = Client(), Client()
    ws.register(ca, a)
    assert ws.reserve()
    va = ws.views(a)
    assert all(int(va[name].abs().sum()) == 0 for name in ("flags", "recv_count", "ctrl", "err"))
    assert int(va["h"].view(torch.uint8).min()) == 0xA5  # the poison reached the pools (h: local pool)
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


def test_block_scaled_backends_bind_their_quantised_rows_to_the_workspace(monkeypatch):
    """The FP8 (SM90) and MXFP8 (SM120) backends' ``_bind_gemms`` take ``xq``/``hq`` and their scales
    from the workspace views they are given (stand-in launchers; no kernel is built), so two layers
    bound to one workspace read and write the same quantised rows."""
    import importlib

    from types import SimpleNamespace

    cases = [("moe_ep.backends.sm90.fp8_cutedsl.backend", "Sm90Fp8Backend", "fp8_block128",
              ("sm90_fp8_gemm", "sm90_fp8_quantize_rows")),
             ("moe_ep.backends.sm120.mxfp8_cutedsl.backend", "Sm120Mxfp8Backend", "mxfp8",
              ("sm120_mxfp8_gemm", "sm120_quantize_rows"))]
    for module, cls_name, quant, launchers in cases:
        mod = importlib.import_module(module)
        for name in launchers:  # a launcher stand-in: any arguments, no compile
            monkeypatch.setattr(mod, name, lambda *a, **k: SimpleNamespace(args=a, kw=k))
        cls = getattr(mod, cls_name)
        c = MoEConfig(num_experts=8, hidden=256, intermediate=128, top_k=2, max_tokens_per_rank=16, quant=quant)
        dims = W.Dims.of(c, 1, cls.quant_rows)
        ws = W.Workspace((cls_name,), torch.device("cpu"), 0, 1, Group(), nvshmem=False)
        layers = []
        for _ in range(2):
            b = object.__new__(cls)
            b.cfg, b.E, b.W, b.device, b.dims = c, 8, 1, torch.device("cpu"), dims
            ws.register(b, dims)
            layers.append(b)
        ws.reserve()
        for b in layers:
            b._bind_gemms(ws.views(dims))
        a, b = layers
        block, scale_dtype = cls.quant_rows
        assert a.xq.shape == (32, 256) and a.xq.dtype == torch.float8_e4m3fn
        assert a.hq_scale.shape == (32, 128 // block) and a.hq_scale.dtype == scale_dtype
        for n in ("xq", "xq_scale", "hq", "hq_scale"):
            assert getattr(a, n).data_ptr() == getattr(b, n).data_ptr(), (cls_name, n)
        for b in layers:
            ws.detach(b)


def test_fp8_switch_rows_are_workspace_regions(monkeypatch):
    """The FP8 backend's opt-in rows are workspace regions too, counted by ``workspace_bytes`` and
    shared by its layers: ``MOE_EP_FP8_PLACE_FC1=copy`` adds the token-order copy ``xq_tok [S, H]``
    e4m3 + ``sx_tok [S, H/128]`` f32, ``MOE_EP_FP8_WIRE=1`` (W > 1 only) the sender's copy
    ``xq_send [T_max, H]`` + ``sx_send [T_max, H/128]``. The switches are read once, when the
    layer's needs are taken (``workspace_dims``), so bind cannot disagree with the plan."""
    from types import SimpleNamespace

    import pytest

    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb

    r = lambda n: (n + 255) // 256 * 256  # noqa: E731
    T, H = 1024, 2048
    c = MoEConfig(num_experts=128, hidden=H, intermediate=768, top_k=8, max_tokens_per_rank=T, quant="fp8_block128")
    rows = lambda n: r(n * H) + r(n * H // 128 * 4)  # noqa: E731
    base = {w: MoELayer.workspace_bytes(c, w, backend="sm90_fp8_cutedsl") for w in (1, 2)}
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "copy")
    assert fb.Sm90Fp8Backend.workspace_dims(c, 1).token_rows
    assert MoELayer.workspace_bytes(c, 1, backend="sm90_fp8_cutedsl") == base[1] + rows(T)
    assert MoELayer.workspace_bytes(c, 2, backend="sm90_fp8_cutedsl") == base[2] + rows(2 * T)
    assert MoELayer.workspace_bytes(c, 1) < base[1]  # the BF16 backend has none of them
    monkeypatch.setenv("MOE_EP_FP8_WIRE", "1")  # with copy on more than one rank: refused when the needs are taken
    with pytest.raises(ValueError, match="MOE_EP_FP8_WIRE=1 sends it quantised"):
        fb.Sm90Fp8Backend.workspace_dims(c, 2)
    monkeypatch.delenv("MOE_EP_FP8_PLACE_FC1")
    assert MoELayer.workspace_bytes(c, 1, backend="sm90_fp8_cutedsl") == base[1]  # one rank: nothing on a wire
    assert MoELayer.workspace_bytes(c, 2, backend="sm90_fp8_cutedsl") == base[2] + rows(T)
    with pytest.raises(ValueError, match="need quant"):
        W.Dims.of(c, 2, send_rows=True)

    # two layers' binds with both rows (the wire's views, then the copying FC1's): the same memory
    for name in ("sm90_fp8_gemm", "sm90_fp8_quantize_rows", "Sm90EpSession", "Sm90LayoutSession"):
        monkeypatch.setattr(fb, name, lambda *a, **k: SimpleNamespace(args=a, kw=k))
    small = MoEConfig(num_experts=8, hidden=512, intermediate=128, top_k=2, max_tokens_per_rank=16,
                      quant="fp8_block128")
    dims = W.Dims.of(small, 2, fb.Sm90Fp8Backend.quant_rows, token_rows=True, send_rows=True)
    ws = W.Workspace(("fp8rows",), torch.device("cpu"), 0, 2, Group(0, 2, "virtual"), nvshmem=False)
    layers = []
    for _ in range(2):
        b = object.__new__(fb.Sm90Fp8Backend)
        b.cfg, b.E, b.W, b.device, b.dims, b.ws, b.virtual = small, 4, 2, torch.device("cpu"), dims, ws, True
        b.group, b.verr, b.num_ctas, b.timeout_ns, b.arch = Group(0, 2, "virtual"), None, 4, 1, "sm_90a"
        b.ep, b.layout = SimpleNamespace(global_ranks=()), SimpleNamespace(num_chunks=4, adaptive=True)
        ws.register(b, dims)
        layers.append(b)
    assert ws.reserve()
    for b in layers:
        b._bind_wire()
        b._bind_gemms(ws.views(dims))
    a, b = layers
    lo, hi = ws.local_pool.data_ptr(), ws.local_pool.data_ptr() + ws.local_bytes
    want = {"xq_tok": ((32, 512), torch.float8_e4m3fn), "sx_tok": ((32, 4), torch.float32),
            "xq_send": ((16, 512), torch.float8_e4m3fn), "sx_send": ((16, 4), torch.float32)}
    for n, (shape, dtype) in want.items():
        t = getattr(a, n)
        assert (tuple(t.shape), t.dtype) == (shape, dtype), n
        assert t.data_ptr() == getattr(b, n).data_ptr() and lo <= t.data_ptr() < hi, n
    assert a.place_fc1 and a._tok_pos.flatten().tolist() == list(range(32))
    assert int(a._send_count) == 16
    for b in layers:
        ws.detach(b)
    assert ws.local_pool is None
