"""Drop v58: prepared launches. ``prepare`` / ``prepare_route`` / ``prepare_combine_local`` check and
pack a layer's fixed buffers once and return ``run(...)`` taking only what changes per call. CPU:
with recording stand-ins for the compiled kernels, ``run`` hands each kernel exactly the arguments
of the plain call (same pointers, shapes, dtypes, strides, scalars, in the same order), for every
variant the backends prepare; bad fixed buffers raise at ``prepare`` and bad per-call tensors at
``run``, before any launch. (GPU: the layer's bit-identity and float64 tests run the backends,
whose hot path now calls these.)"""

import pytest
import torch

pytest.importorskip("cutlass")
tvm_ffi = pytest.importorskip("tvm_ffi")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe import ep_launch, layout_launch  # noqa: E402
from sm90_megamoe.fp8_launch import CompiledFp8Gemm  # noqa: E402
from sm90_megamoe.fp8_quant import CompiledFp8QuantizeRows  # noqa: E402
from sm90_megamoe.launch import CompiledGroupedGemm  # noqa: E402


class Recorder:
    """Stands in for a TVM-FFI kernel: remembers each call's arguments."""

    def __init__(self, name="kernel"):
        self.name, self.calls = name, []

    def __call__(self, *args):
        self.calls.append(args)


def _sig(a):
    """What a kernel sees of an argument: a tensor's address / shape / strides / dtype (a torch
    tensor or, drop v61, a ``tvm_ffi.Tensor`` made from one), or the value."""
    if isinstance(a, tvm_ffi.Tensor):
        a = torch.from_dlpack(a)
    if isinstance(a, torch.Tensor):
        return ("tensor", a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
    return ("value", a)


def _same_calls(rec_plain, rec_prepared):
    """The prepared launches pass the plain calls' arguments; each packs its fixed tensors as
    TVM-FFI tensors (drop v61) and keeps at least one torch tensor, from which TVM-FFI takes the
    stream (without one the kernel would go to the default stream)."""
    assert len(rec_plain.calls) == len(rec_prepared.calls) > 0
    for p, q in zip(rec_plain.calls, rec_prepared.calls):
        assert [_sig(a) for a in p] == [_sig(a) for a in q]
        assert any(isinstance(a, torch.Tensor) for a in q), "a prepared launch must keep a torch tensor"
    assert any(isinstance(a, tvm_ffi.Tensor) for q in rec_prepared.calls for a in q), "fixed tensors not packed"


def _e4m3(*shape):
    return torch.randint(0, 120, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)


# ------------------------------------------------------------------------------ FP8 GEMM
@pytest.mark.parametrize("variant", ["plain", "cluster2", "fc2"])
def test_fp8_gemm_prepared_passes_the_plain_arguments(variant):
    E, n, k, M = 4, 512, 256, 96
    act = "identity" if variant == "fc2" else "swiglu"
    kw = {"cluster2": dict(cluster_n=2)}.get(variant, {})
    recs = [Recorder(), Recorder()]
    gemms = [CompiledFp8Gemm(act, n, k, E, scale_rows=variant == "fc2", compiled=r, tvm_ffi=True, **kw) for r in recs]
    for g in gemms:
        g._max_ctas = 66  # the clustered grid's cap, worked out on a GPU otherwise
    n_out = n // 2 if act == "swiglu" else n
    a, a_scale = _e4m3(M, k), torch.rand(M, k // 128)
    out = torch.empty(M, n_out, dtype=torch.bfloat16)
    offsets, row_scale = torch.tensor([0, 10, 50, 50, 96], dtype=torch.int32), torch.rand(M)
    for ctas in (None, 7, 1):
        if ctas is None and variant != "cluster2":
            continue  # None means one CTA per SM: a GPU question
        b, b_scale = _e4m3(E, n, k), torch.rand(E, n // 128, k // 128)
        gemms[0](a, a_scale, b, b_scale, offsets, out, row_scale, ctas or 132)
        run = gemms[1].prepare(a, a_scale, offsets, out, row_scale, ctas or 132)
        run(b, b_scale)
    _same_calls(*recs)
    if variant == "cluster2":  # at least one cluster, at most the clusters that fit
        assert [c[-1] for c in recs[1].calls] == [66, 7, 2]


# ------------------------------------------------------------------------------ BF16 GEMM (drop v61, v63)
@pytest.mark.parametrize("variant", ["fc1", "fc2", "bias", "cluster2", "swapab", "gather", "gather_per_call"])
def test_bf16_gemm_prepared_passes_the_plain_arguments(variant):
    """``prepare(...)`` then ``run(b, bias)`` hands the kernel what ``launch_tensors`` does; the
    caller's placeholders (unread row scale / bias) are fixed with the rest. A gathering FC1 may be
    prepared with ``a=None`` and take its source rows per call (``run(b, bias, a=x)``; drop v91),
    as the one-rank layer prepares it."""
    E, n, k, M, T = 4, 256, 128, 96, 40
    act = "identity" if variant == "fc2" else "swiglu"
    kw = {"bias": dict(bias_dtype="float32"), "cluster2": dict(cluster_m=2), "swapab": dict(schedule="swapab"),
          "gather": dict(gather_a=True), "gather_per_call": dict(gather_a=True)}
    recs = [Recorder(), Recorder()]
    gemms = [CompiledGroupedGemm(act, n, k, E, scale_rows=variant == "fc2", compiled=r, tvm_ffi=True,
                                 **kw.get(variant, {})) for r in recs]
    for g in gemms:
        g._max_ctas = 66  # the clustered grid's cap, worked out on a GPU otherwise
    dummy_scale, dummy_bias = torch.zeros(1), torch.zeros(1, 8)
    rows_by_index = variant in ("gather", "gather_per_call")
    a = torch.randn(T if rows_by_index else M, k).to(torch.bfloat16)
    idx = torch.randint(0, T, (M,), dtype=torch.int32) if rows_by_index else None
    out = torch.empty(M, gemms[0].n_out, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 10, 50, 50, 96], dtype=torch.int32)
    rs = torch.rand(M) if variant == "fc2" else dummy_scale
    fixed_bias = None if variant == "bias" else dummy_bias
    for ctas in (None, 7, 1):
        if ctas is None and variant != "cluster2":
            continue  # None means one CTA per SM: a GPU question
        b = torch.randn(E, n, k).to(torch.bfloat16)
        bias = torch.randn(E, n) if variant == "bias" else None
        gemms[0].launch_tensors(a, b, out, offsets, rs, dummy_bias if bias is None else bias, ctas or 132, idx=idx)
        if variant == "gather_per_call":  # the source rows per call
            gemms[1].prepare(None, out, offsets, rs, fixed_bias, ctas or 132, idx=idx)(b, bias, a=a)
        else:
            run = gemms[1].prepare(a, out, offsets, rs, fixed_bias, ctas or 132, idx=idx)
            run(b, bias)
    _same_calls(*recs)
    if variant == "cluster2":
        assert [c[-1] for c in recs[1].calls] == [66, 7, 1]


def test_bf16_gemm_prepare_refuses_what_the_call_refuses():
    g = CompiledGroupedGemm("identity", 256, 128, 4, scale_rows=True, compiled=Recorder(), tvm_ffi=True)
    a, out, off = torch.randn(8, 128).to(torch.bfloat16), torch.empty(8, 256, dtype=torch.bfloat16), \
        torch.zeros(5, dtype=torch.int32)
    w = torch.randn(4, 256, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="row_scale"):
        g.prepare(a, out, off, None, torch.zeros(1, 8))          # a row scale (or placeholder) is required
    with pytest.raises(ValueError, match="idx"):
        g.prepare(a, out, off, torch.rand(8), torch.zeros(1, 8), idx=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="placeholder"):
        g.prepare(a, out, off, torch.rand(8), None)               # no bias: its placeholder is fixed here
    run = g.prepare(a, out, off, torch.rand(8), torch.zeros(1, 8), 4)
    with pytest.raises(ValueError, match="bias"):
        run(w, torch.rand(4, 256))                                # fixed at prepare: none per call
    gb = CompiledGroupedGemm("identity", 256, 128, 4, scale_rows=False, compiled=Recorder(), tvm_ffi=True,
                             bias_dtype="bfloat16")
    run = gb.prepare(a, out, off, torch.zeros(1), None, 4)
    for bias in (None, torch.rand(4, 256), torch.rand(4, 128).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="bias"):
            run(w, bias)
    assert gb.compiled.calls == [] and g.compiled.calls == []
    with pytest.raises(RuntimeError, match="tvm_ffi"):
        CompiledGroupedGemm("identity", 256, 128, 4, False, compiled=object()).prepare(a, out, off, torch.zeros(1))


def test_shim_gemm_prepare_fixes_its_own_placeholders():
    """The shim's ``GroupedGemm.prepare`` passes its own placeholders (never the compile cache's
    object's), the real row scale only where compiled with one, and a per-call bias slot only
    for bias kernels; no rows: the plain call, which launches nothing."""
    from moe_ep.shim.drops.sm90_megamoe import GroupedGemm

    seen = []

    class Compiled:
        scale_rows, n_out, tvm_ffi, gather_a = False, 128, True, False

        def __init__(self, bias_dtype):
            self.bias_dtype = bias_dtype

        def prepare(self, **kw):
            seen.append(kw)
            return "run"

    a, off, out = torch.zeros(8, 128), torch.zeros(5, dtype=torch.int32), torch.zeros(8, 128)
    def launcher(bias_dtype):  # GroupedGemm's constructor without its CUDA query (one CTA per SM)
        g = object.__new__(GroupedGemm)
        g.compiled, g.scale_rows, g.bias_dtype = Compiled(bias_dtype), False, bias_dtype
        g.tvm_ffi, g.gather_a = True, False
        g._dummy_scale, g._dummy_bias, g._ctas = torch.zeros(1), torch.zeros(1, 8), 132
        return g

    for bias_dtype in (None, "float32"):
        g = launcher(bias_dtype)
        assert g.prepare(a, off, out, max_active_ctas=9) == "run"
        kw = seen[-1]
        assert kw["row_scale"] is g._dummy_scale and kw["max_active_ctas"] == 9 and kw["idx"] is None
        assert kw["bias"] is (None if bias_dtype else g._dummy_bias)
    empty = launcher(None).prepare(torch.zeros(0, 128), off, out)
    assert empty != "run" and callable(empty) and len(seen) == 2


# ------------------------------------------------------------------------------ FP8 row quantisers
def _quantisers(**kw):
    recs = [Recorder(), Recorder()]
    return recs, [CompiledFp8QuantizeRows(256, compiled=r, tvm_ffi=True, **kw) for r in recs]


@pytest.mark.parametrize("variant", ["counted", "gather", "scatter"])
def test_quantiser_prepared_passes_the_plain_arguments(variant):
    k, M, S, K, t_max = 256, 64, 24, 4, 12
    kw = {"counted": dict(counted=True), "gather": dict(gather=True), "scatter": dict(scatter_topk=K)}[variant]
    recs, (plain, prep) = _quantisers(**kw)
    q, scale = _e4m3(M, k), torch.empty(M, k // 128)
    count = torch.tensor([M - 5], dtype=torch.int32)
    fixed = {"counted": dict(count=count), "gather": dict(count=count, idx=torch.randint(0, S, (M,), dtype=torch.int32)),
             "scatter": dict(pos=torch.randint(0, M, (S, K), dtype=torch.int32),
                             recv_count=torch.tensor([7, 12], dtype=torch.int32), t_max=t_max)}[variant]
    run = prep.prepare(q, scale, **fixed)
    for rows in ((M,) if variant == "counted" else (S, 3, 0)):
        x = torch.randn(rows, k).to(torch.bfloat16)
        plain(x, q, scale, **fixed)
        run(x)
    _same_calls(*recs)
    # per call: only x is checked, before any launch
    n = len(recs[1].calls)
    bad = [torch.randn(M if variant == "counted" else S, 128).to(torch.bfloat16),     # width
           torch.randn(M if variant == "counted" else S, k),                          # dtype
           torch.randn(k, M if variant == "counted" else S).to(torch.bfloat16).t()]    # not contiguous
    if variant != "gather":  # a gather's source rows may be any number
        bad.append(torch.randn((M + 1) if variant == "counted" else S + 1, k).to(torch.bfloat16))
    for x in bad:
        with pytest.raises(ValueError, match="x "):
            run(x)
    assert len(recs[1].calls) == n


def test_quantiser_prepare_checks_the_fixed_buffers():
    _, (_, q_counted) = _quantisers(counted=True)
    with pytest.raises(ValueError, match="count"):
        q_counted.prepare(_e4m3(8, 256), torch.empty(8, 2))                      # the count is required
    with pytest.raises(ValueError, match="scale"):
        q_counted.prepare(_e4m3(8, 256), torch.empty(8, 3), count=torch.zeros(1, dtype=torch.int32))
    _, (_, q_scatter) = _quantisers(scatter_topk=4)
    with pytest.raises(ValueError, match="pos"):
        q_scatter.prepare(_e4m3(8, 256), torch.empty(8, 2), pos=torch.zeros(4, 3, dtype=torch.int32),
                          recv_count=torch.zeros(1, dtype=torch.int32), t_max=4)


# ------------------------------------------------------------------------------ layout route (one rank)
def _layout(H=256, K=4, T_max=32, E_l=8):
    cfg = layout_launch.LayoutConfig(hidden=H, topk=K, world=1, max_tokens=T_max, local_experts=E_l)
    recs = {}
    for kind in ("count", "place", "place_nogather", "route", "route_i64"):
        recs[kind] = Recorder(kind)
        layout_launch.put_kernel(kind, cfg, recs[kind], tvm_ffi=True, arch="sm_90a")
    lay = layout_launch.Layout(cfg, "cpu", num_chunks=4, tvm_ffi=True, route=True)
    ecfg = ep_launch.EpConfig(hidden=H, topk=K, world=1, max_tokens=T_max, num_experts=E_l)
    bufs = ep_launch.EpBuffers.allocate(ecfg, "cpu")
    S, P = T_max, T_max * K
    outs = dict(offsets=torch.empty(E_l + 1, dtype=torch.int32), idx=torch.empty(P, dtype=torch.int32),
                ws=torch.empty(P), pos=torch.empty(S, K, dtype=torch.int32))
    return lay, bufs, outs, recs, torch.empty(P, H, dtype=torch.bfloat16)


@pytest.mark.parametrize("gather", [True, False])
def test_prepared_route_passes_the_plain_arguments(gather):
    lay, bufs, outs, recs, xs = _layout()
    xs = xs if gather else None
    run = lay.prepare_route(bufs, xs=xs, **outs)
    plain, prepared = {k: Recorder() for k in recs}, {k: Recorder() for k in recs}
    for T, ids_dtype in ((20, torch.int32), (32, torch.int64), (0, torch.int32), (1, torch.int64)):
        x = torch.randn(T, 256).to(torch.bfloat16)
        ids, w = torch.randint(0, 8, (T, 4), dtype=ids_dtype), torch.rand(T, 4)
        for call, into in ((lambda: lay.route(bufs, x, ids, w, xs=xs, check=False, **outs), plain),
                           (lambda: run(x, ids, w), prepared)):
            call()
            for k in recs:
                into[k].calls += recs[k].calls
                recs[k].calls.clear()
    for k in ("route", "route_i64", "place" if gather else "place_nogather"):
        _same_calls(plain[k], prepared[k])
    # per call: the routing inputs are checked as route checks them, before any launch
    n = sum(len(r.calls) for r in recs.values())
    for x, ids, w, frag in (
            (torch.randn(33, 256).to(torch.bfloat16), torch.zeros(33, 4, dtype=torch.int32), torch.rand(33, 4),
             r"T=33 > T_max=32"),
            (torch.randn(4, 256).to(torch.bfloat16), torch.zeros(4, 4, dtype=torch.int16), torch.rand(4, 4),
             r"topk_ids must be int32/int64 \[4, 4\]"),
            (torch.randn(4, 256).to(torch.bfloat16), torch.zeros(4, 4, dtype=torch.int32), torch.rand(4, 3),
             r"topk_w must be float32 \[4, 4\]")):
        with pytest.raises(ValueError, match=frag):
            run(x, ids, w)
    assert sum(len(r.calls) for r in recs.values()) == n


def test_prepare_route_checks_the_fixed_buffers():
    lay, bufs, outs, _, xs = _layout()
    with pytest.raises(ValueError, match="offsets"):
        lay.prepare_route(bufs, xs=xs, **dict(outs, offsets=torch.empty(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="xs"):
        lay.prepare_route(bufs, xs=xs[:, :128], **outs)


# ------------------------------------------------------------------------------ one-launch combine
def _ep_rank(H=256, K=4, T_max=32):
    """An EpRank without its constructor (which wants a CUDA peer table): just what
    combine_local and prepare_combine_local read."""
    cfg = ep_launch.EpConfig(hidden=H, topk=K, world=1, max_tokens=T_max, num_experts=8)
    bufs = ep_launch.EpBuffers.allocate(cfg, "cpu")
    ep = ep_launch.EpRank.__new__(ep_launch.EpRank)
    ep.cfg, ep.bufs, ep.ffi, ep.num_ctas = cfg, bufs, True, 9
    ep.k = {"combine_local": Recorder()}
    ep._recv_count, ep._err = bufs.recv_count, bufs.err
    ep._dummy_out, ep._conv, ep._i32 = torch.zeros(1, H, dtype=torch.bfloat16), {}, {}
    return ep


def test_prepared_combine_local_passes_the_plain_arguments():
    ep, prep_ep = _ep_rank(), _ep_rank()
    prep_ep.bufs, prep_ep._recv_count, prep_ep._err, prep_ep._dummy_out = \
        ep.bufs, ep._recv_count, ep._err, ep._dummy_out  # one rank's buffers, two launchers
    y, pos = torch.randn(128, 256).to(torch.bfloat16), torch.randint(-1, 128, (32, 4), dtype=torch.int32)
    run = prep_ep.prepare_combine_local(y, pos)
    for T, ctas in ((32, None), (5, 3), (0, None)):
        out = torch.empty(T, 256, dtype=torch.bfloat16)
        ep.combine_local(y, pos, out, num_ctas=ctas)
        run(out, num_ctas=ctas)
    _same_calls(ep.k["combine_local"], prep_ep.k["combine_local"])
    n = len(prep_ep.k["combine_local"].calls)
    for out in (torch.empty(33, 256, dtype=torch.bfloat16), torch.empty(4, 256), torch.empty(4, 128, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out"):
            run(out)
    assert len(prep_ep.k["combine_local"].calls) == n
    with pytest.raises(ValueError, match="pos"):
        prep_ep.prepare_combine_local(y, pos[:, :3])


# ------------------------------------------------------------------------------ the shim's chunk tiers
def test_session_prepare_route_picks_the_calls_chunk_tier():
    """``LayoutSession.prepare_route`` prepares one route per chunk tier (each tier's ``Layout``) and a
    call runs the tier that ``route`` would pick for its token count (the grid only steers speed)."""
    from moe_ep.shim.drops.sm90_megamoe_layout import LAYOUT_CHUNK_TIERS, LayoutSession, layout_chunks_for

    calls = []

    class TierLayout:
        def __init__(self, c):
            self.c = c

        def prepare_route(self, bufs, offsets, idx, ws, pos, xs):
            return lambda x, ids, w: calls.append((self.c, x, ids, w, offsets, xs))

    s = object.__new__(LayoutSession)
    s.num_chunks, s.adaptive = 132, True
    s._layouts = {c: TierLayout(c) for c in {132} | {c for c in LAYOUT_CHUNK_TIERS if c < 132}}
    ep = type("Ep", (), {"bufs": "bufs"})()
    run = s.prepare_route(ep, "offsets", "idx", "ws", "pos", "xs")
    for tokens in (1, 8, 100, 1000, 8192, None):
        run("x", "ids", "w", tokens=tokens)
    want = [layout_chunks_for(t, 132) if t is not None else 132 for t in (1, 8, 100, 1000, 8192, None)]
    assert [c[0] for c in calls] == want and len(set(want)) > 1
    assert all(c[1:] == ("x", "ids", "w", "offsets", "xs") for c in calls)


# ------------------------------------------------------------------------------ the BF16 backend's wiring
def test_bf16_backend_runs_the_prepared_gemms_of_the_calls_path():
    """Drop v61: the BF16 backend prepares FC1 (xs -> h) and FC2 (h -> y, router-weighted rows) per
    GEMM path at bind; step 1 picks the path from the call's token count (swap-AB pair for few
    tokens) and steps 3-4 pass only the weights and biases."""
    from types import SimpleNamespace

    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    calls, handoffs = [], {}

    def gemm(name, handoff=""):
        def prepare(a, offsets, out, row_scale=None, max_active_ctas=None, idx=None, sync=None, publishers=None):
            handoffs[name] = (sync, publishers)
            return lambda w, bias=None: calls.append((name, a, out, row_scale, max_active_ctas, w, bias))
        return SimpleNamespace(gather_a=False, prepare=prepare, handoff=handoff, grid_ctas=lambda ctas: ctas - 1)

    b = object.__new__(Sm90CuteDSLBackend)
    for n in ("offsets", "idx", "ws_rows", "pos", "xs", "h", "y"):
        setattr(b, n, torch.zeros(4))
    b.local_route = b.local_combine = b.token_grid = False
    b.fc1, b.fc2, b.fc1_decode, b.fc2_decode = gemm("fc1"), gemm("fc2"), gemm("fc1_decode"), gemm("fc2_decode")
    b.num_ctas, b._decode_max_tokens = 7, 16
    b.ws, b.ep = SimpleNamespace(seq=0), SimpleNamespace(dispatch=lambda *a, **k: None)
    b._prepare_launches()
    for T, path in ((16, "_decode"), (17, "")):
        calls.clear()
        x, ids, w = torch.zeros(T, 4), torch.zeros(T, 2, dtype=torch.int32), torch.zeros(T, 2)
        b._step1_dispatch(x, ids, w)
        b._step34_experts("w13", "w2", "b13", "b2")
        assert calls == [(f"fc1{path}", b.xs, b.h, None, 7, "w13", "b13"),
                         (f"fc2{path}", b.h, b.y, b.ws_rows, 7, "w2", "b2")]
    assert all(h == (None, None) for h in handoffs.values())
    # drop v112 (MOE_EP_FC2_EARLY=1): the 128-row pair shares the sync buffer, FC2 gets FC1's launched CTAs
    b.fc1, b.fc2 = gemm("fc1", "publish"), gemm("fc2", "await")
    b._handoff_sync = torch.zeros(9, dtype=torch.int32)
    b._prepare_launches()
    assert handoffs["fc1"] == (b._handoff_sync, None) and handoffs["fc2"] == (b._handoff_sync, 6)
    assert handoffs["fc1_decode"] == handoffs["fc2_decode"] == (None, None)
