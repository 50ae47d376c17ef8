"""Drop v112: FC2 starts inside FC1's last wave (``handoff``; ``MOE_EP_FC2_EARLY=1``). The publishing
FC1 counts, in a sync buffer, its CTAs past all but their last tile and the pending last tiles per
m-tile; the awaiting FC2 replaces PDL's wait for the whole of FC1 by a wait on that count, then per
m-tile before its A loads, and waits for FC1's grid only at its end.

CPU: both kernels compile for sm_90a with the plain kernel's WGMMAs, the counters' fences, releases
and acquires where they belong, and no spills; the plain kernels keep their wait first; refusals; the
shim's switch, key, kernel names and the backend's specs. GPU: the pair gives the plain pair's bits
(FC1's and FC2's outputs, NaN-poisoned, three runs on one buffer) and leaves the buffer zero; an
awaiting FC2 without a publisher records a timeout instead of hanging; the Qwen3 layer with the switch
gives the default bits eager and under a CUDA graph. Drop v114: an awaiting FC2 alone, its gate preset, claims
every tile once at small grids (the plain FC2's bits, the counter back to zero)."""

import re
import time

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import require_sm90  # noqa: E402

#: (FC1 schedule, FC1 cluster_m, FC2 schedule, FC2 tile_n, FC2 cluster_m): Qwen3's pair as the H200 runs
#: it (FC1 wide... cooperative in clusters of 2, FC2 pingpong 128 x 192), single CTAs, and Mixtral's
#: form (both cooperative in clusters of 2)
PAIRS = [("cooperative", 2, "pingpong", 192, 1), ("cooperative", 1, "pingpong", 192, 1),
         ("wide", 1, "cooperative", None, 2)]


def _compile(act, n, k, sr, handoff="", **kw):
    from sm90_megamoe.compile_check import compile_for_arch

    return compile_for_arch(act, n, k, sr, raster_m=6, handoff=handoff, **kw).__ptx__


def _first(ptx: str, needle: str) -> int:
    i = ptx.find(needle)
    assert i >= 0, needle
    return i


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("schedule,cluster_m", [("cooperative", 2), ("wide", 1)])
def test_publishing_fc1_compiles(schedule, cluster_m, tmp_path, monkeypatch):
    """The plain FC1's WGMMAs; two gpu-scope fences (before the last tile and after it), one relaxed
    add (the pending count) and three releases (early_done after the fence, the pending count's
    decrement, a CTA without a tile); the grid wait still first; no spills."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.layout_compile_check import ptxas_info

    kw = dict(schedule=schedule, cluster_m=cluster_m, tanh_sigmoid=True)
    plain, pub = (_compile("swiglu", 1536, 2048, False, h, **kw) for h in ("", "publish"))
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)"
    assert sorted(re.findall(wgmma, pub)) == sorted(re.findall(wgmma, plain))
    assert pub.count("fence.acq_rel.gpu") == 2 and "fence.acq_rel.gpu" not in plain
    assert len(re.findall(r"red\.release\.gpu\.global\.add\.s32", pub)) == 3
    assert len(re.findall(r"red\.relaxed\.gpu\.global\.add\.s32", pub)) == 1
    for ptx in (plain, pub):
        assert _first(ptx, "griddepcontrol.wait") < _first(ptx, "cp.async.bulk.tensor")
        info = ptxas_info(ptx, "sm_90a")
        if info is not None:
            assert info[1] == 0, info  # no spills


@pytest.mark.parametrize("schedule,tile_n,cluster_m,cluster_n", [("pingpong", 192, 1, 1), ("cooperative", None, 2, 1),
                                                                 ("pingpong", 192, 1, 2), ("cooperative", None, 1, 1)])
def test_awaiting_fc2_compiles(schedule, tile_n, cluster_m, cluster_n, tmp_path, monkeypatch):
    """The plain FC2's WGMMAs; the successor's trigger first, then acquire loads (the gate and the
    m-tile wait) and the async-proxy fence before the first TMA load; the grid wait only after the last
    WGMMA; the finished count as one acq_rel atomic; no spills. Drop v114, single CTAs only: the tile
    counter's two relaxed claims (the first one ahead of the loop, then one per tile) and the ring's
    full and empty barriers (four more mbarrier inits than the plain kernel's)."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.layout_compile_check import ptxas_info

    kw = dict(schedule=schedule, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n)
    plain, aw = (_compile("identity", 2048, 768, True, h, **kw) for h in ("", "await"))
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)"
    assert sorted(re.findall(wgmma, aw)) == sorted(re.findall(wgmma, plain))
    assert len(re.findall(r"ld\.acquire\.gpu", aw)) >= 2 and "ld.acquire.gpu" not in plain
    assert _first(aw, "griddepcontrol.launch_dependents") < _first(aw, "ld.acquire.gpu")
    assert _first(aw, "fence.proxy.async.global") < _first(aw, "cp.async.bulk.tensor")
    assert aw.count("griddepcontrol.wait") == 1 and aw.rfind("griddepcontrol.wait") > aw.rfind("wgmma.mma_async")
    assert re.search(r"atom\.global\.acq_rel(\.gpu)?\.add", aw)
    claims = re.findall(r"atom\.global\.add\.[us]32", aw)  # relaxed: PTX's atom without a .sem
    inits = [ptx.count("mbarrier.init") for ptx in (plain, aw)]
    if cluster_m * cluster_n == 1:
        assert len(claims) == 2 and inits[1] == inits[0] + 4, (claims, inits)
    else:  # a cluster's CTAs keep every gdim-th unit
        assert not claims and inits[1] == inits[0], (claims, inits)
    info = ptxas_info(aw, "sm_90a")
    if info is not None:
        assert info[1] == 0, info


def test_handoff_refusals():
    from sm90_megamoe.grouped_gemm_handoff import GroupedGemmAwaitSm90, GroupedGemmPublishSm90, handoff_class
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="publishing FC1"):
        GroupedGemmPublishSm90("swiglu", tile_n=96, schedule="pingpong")
    with pytest.raises(ValueError, match="publishing FC1"):
        GroupedGemmPublishSm90("identity", cluster_n=2)
    with pytest.raises(ValueError, match="handoff must be"):
        handoff_class("both")
    assert GroupedGemmAwaitSm90("identity", tile_n=192, schedule="pingpong").handoff == "await"
    with pytest.raises(ValueError, match="handoff"):
        CompiledGroupedGemm("identity", 2048, 768, 16, True, schedule="swapab", compiled=object(), handoff="await")
    with pytest.raises(ValueError, match="handoff"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 16, False, compiled=object(), gather_a=True, handoff="publish")
    with pytest.raises(ValueError, match="handoff"):
        CompiledGroupedGemm("identity", 2048, 768, 16, True, compiled=object(), box_rows=8, handoff="await")
    fn = CompiledGroupedGemm("identity", 2048, 768, 16, True, tile_n=192, schedule="pingpong", compiled=object(),
                             handoff="await")
    assert fn.handoff == "await" and fn.kernel.handoff == "await"
    sync = torch.zeros(40, dtype=torch.int32)
    fn._check_handoff_args(sync, 132)
    with pytest.raises(ValueError, match="sync is required"):
        fn._check_handoff_args(None, 132)
    with pytest.raises(ValueError, match="publishers"):
        fn._check_handoff_args(sync, None)
    with pytest.raises(ValueError, match="int32"):
        fn._check_handoff_args(sync.long(), 132)
    assert fn._tail(sync, 132) == (sync, 132)


def test_sync_length_mirrors_the_drop():
    from sm90_megamoe.grouped_gemm_handoff import HANDOFF_SYNC_TAIL, handoff_sync_len

    from moe_ep.shim import sm90_handoff_sync_len

    for rows, e in ((1, 1), (65536, 128), (65537, 128), (300, 7)):
        assert sm90_handoff_sync_len(rows, e) == handoff_sync_len(rows, e) == -(-rows // 128) + e + HANDOFF_SYNC_TAIL


@pytest.mark.parametrize("seed", range(4))
def test_m_tile_slots_are_distinct_and_in_the_buffer(seed):
    """The kernels' slot of an m-tile, ``row0 // 128 + expert`` (both GEMMs compute it from the tile's
    first grouped row): distinct for distinct m-tiles and below ``handoff_sync_len`` minus its tail, for
    experts of any size (empty ones, ones ending anywhere in a tile, 128-row multiples)."""
    from sm90_megamoe.grouped_gemm_handoff import HANDOFF_SYNC_TAIL, handoff_sync_len

    g = torch.Generator().manual_seed(seed)
    E = [1, 7, 128, 300][seed]
    counts = torch.randint(0, 700, (E,), generator=g)
    counts[::5] = 0
    counts[1::6] = 128 * torch.randint(1, 4, (len(counts[1::6]),), generator=g)
    offs = [0] + torch.cumsum(counts, 0).tolist()
    slots = [(offs[e] + 128 * j) // 128 + e for e in range(E) for j in range(-(-int(counts[e]) // 128))]
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < handoff_sync_len(offs[-1], E) - HANDOFF_SYNC_TAIL for s in slots)


def test_shim_switch_key_names_and_specs(monkeypatch):
    """``MOE_EP_FC2_EARLY``: off unset; the shim keys and names (``_hp`` / ``_ha``) the roles and passes
    them to the drop (recorded: no compile); swap-AB takes none; the gathering FC1, the gated pingpong
    FC1 and box tails are refused by name; the backend asks for both roles on the 128-row pair only."""
    from recorders import record_gemm_builds

    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.shim import cache
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_FC2_EARLY", raising=False)
    monkeypatch.delenv("MOE_EP_BOX_TAILS", raising=False)
    monkeypatch.delenv("MOE_EP_GATED_PINGPONG", raising=False)
    monkeypatch.delenv("MOE_EP_GATHER_FC1", raising=False)
    assert not s.use_fc2_early()
    assert s.GemmKey.__dataclass_fields__["handoff"].default == ""
    cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=8192)
    assert "handoff" not in _gemm_specs(cfg, 128)["fc1"]
    monkeypatch.setenv("MOE_EP_FC2_EARLY", "1")
    specs = _gemm_specs(cfg, 128)
    assert (specs["fc1"]["handoff"], specs["fc2"]["handoff"]) == ("publish", "await")
    assert "handoff" not in specs["fc1_decode"] and "handoff" not in specs["fc2_decode"]

    built, names = record_gemm_builds(monkeypatch)
    s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, handoff="publish")
    s.compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True, handoff="await")
    s.compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True)
    s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, rows_per_expert=4.0, handoff="publish")  # swap-AB: none
    assert [kw.get("handoff", "") for kw in built[::2]] == ["publish", "await", "", ""]
    assert [n for n in names if "_hp" in n or "_ha" in n] == [names[0], names[1]]
    assert "_hp" in names[0] and "_ha" in names[1]
    assert sorted(k.handoff for k in cache.COMPILE_CACHE._store) == ["", "", "await", "publish"]
    with pytest.raises(ValueError, match="handoff must be"):
        s.compiled_grouped_gemm("identity", 2048, 768, 128, handoff="late")
    monkeypatch.setenv("MOE_EP_GATED_PINGPONG", "1")
    with pytest.raises(ValueError, match="MOE_EP_FC2_EARLY.*MOE_EP_GATED_PINGPONG"):
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, handoff="publish")
    monkeypatch.delenv("MOE_EP_GATED_PINGPONG")
    with pytest.raises(ValueError, match="MOE_EP_GATHER_FC1"):
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, gather_a=True, handoff="publish")
    monkeypatch.setenv("MOE_EP_BOX_TAILS", "8")
    with pytest.raises(ValueError, match="MOE_EP_BOX_TAILS"):
        s.compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True, handoff="await")


# ---------------------------------------------------------------------------- GPU
def _pair(act_n_k, fc1_sched, fc1_cm, fc2_sched, fc2_tile, fc2_cm, handoff: bool):
    from sm90_megamoe.launch import get_grouped_gemm

    (n1, h, i) = act_n_k
    fc1 = get_grouped_gemm("swiglu", n1, h, 16, schedule=fc1_sched, cluster_m=fc1_cm, raster_m=6, tanh_sigmoid=True,
                           handoff="publish" if handoff else "")
    fc2 = get_grouped_gemm("identity", h, i, 16, scale_rows=True, schedule=fc2_sched, tile_n=fc2_tile,
                           cluster_m=fc2_cm, raster_m=6, handoff="await" if handoff else "")
    return fc1, fc2


def _run_pair(fc1, fc2, x, w13, w2, offs, rs, sync):
    """FC1 then FC2 on one stream into NaN-poisoned outputs (and a guard band): ``(h, y)``."""
    m, i = x.shape[0], w2.shape[2]
    h = torch.full((m * i + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = torch.full((m * w2.shape[1] + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda")
    hv, yv = h[:m * i].view(m, i), y[:m * w2.shape[1]].view(m, w2.shape[1])
    if sync is None:
        fc1(x, w13, offs, out=hv)
        fc2(hv, w2, offs, out=yv, row_scale=rs)
    else:
        fc1(x, w13, offs, out=hv, sync=sync)
        fc2(hv, w2, offs, out=yv, row_scale=rs, sync=sync, publishers=fc1.grid_ctas())
    torch.cuda.synchronize()
    assert torch.isnan(h[m * i:]).all() and torch.isnan(y[m * w2.shape[1]:]).all(), "a store past the output"
    return hv, yv


@pytest.mark.gpu
@pytest.mark.parametrize("fc1_sched,fc1_cm,fc2_sched,fc2_tile,fc2_cm", PAIRS)
@pytest.mark.parametrize("routing,m_total", [("uniform", 40000), ("skewed", 5000), ("skewed", 1)])
def test_gpu_handoff_pair_is_bit_identical(fc1_sched, fc1_cm, fc2_sched, fc2_tile, fc2_cm, routing, m_total):
    """Qwen3's expert shapes over 16 experts: the publishing FC1 and awaiting FC2 give the plain pair's
    bits for h and y, three times on one sync buffer, which each run leaves zero; y against float64."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem
    from sm90_megamoe.grouped_gemm_handoff import handoff_sync_len
    from sm90_megamoe.reference import grouped_gemm_reference

    H, I = 2048, 768
    x, w13, offs, rs, _ = bf16_gemm_problem(m_total, 2 * I, H, 16, routing, 700 + m_total, True)
    w2 = (torch.randn(16, H, I, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m_total))
          / I ** 0.5).to(torch.bfloat16)
    shape = (2 * I, H, I)
    h0, y0 = _run_pair(*_pair(shape, fc1_sched, fc1_cm, fc2_sched, fc2_tile, fc2_cm, False), x, w13, w2, offs, rs,
                       None)
    fc1, fc2 = _pair(shape, fc1_sched, fc1_cm, fc2_sched, fc2_tile, fc2_cm, True)
    sync = torch.zeros(handoff_sync_len(m_total, 16), dtype=torch.int32, device="cuda")
    for _ in range(3):
        h, y = _run_pair(fc1, fc2, x, w13, w2, offs, rs, sync)
        assert not torch.isnan(h).any() and not torch.isnan(y).any(), "elements left unwritten"
        assert torch.equal(h, h0) and torch.equal(y, y0)
        assert not sync.any(), sync.nonzero().flatten().tolist()  # tail-clean, no error word
    want = grouped_gemm_reference(h0.double(), w2.double(), offs, "identity", rs.double())
    assert float((y.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
def test_gpu_awaiting_fc2_without_publisher_records_a_timeout():
    """An awaiting FC2 after a plain FC1 (nothing publishes): its gate gives up after the drop's bound
    (1 s) and records 1 + the gate's slot in the error word; the call returns, nothing hangs."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem
    from sm90_megamoe.grouped_gemm_handoff import HANDOFF_SYNC_TAIL, handoff_sync_len

    H, I = 2048, 768
    x, w13, offs, rs, _ = bf16_gemm_problem(2000, 2 * I, H, 16, "uniform", 77, True)
    w2 = (torch.randn(16, H, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    plain1, _ = _pair((2 * I, H, I), "cooperative", 1, "pingpong", 192, 1, False)
    _, fc2 = _pair((2 * I, H, I), "cooperative", 1, "pingpong", 192, 1, True)
    sync = torch.zeros(handoff_sync_len(2000, 16), dtype=torch.int32, device="cuda")
    h = torch.empty(2000, I, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(2000, H, dtype=torch.bfloat16, device="cuda")
    t0 = time.time()
    plain1(x, w13, offs, out=h)
    fc2(h, w2, offs, out=y, row_scale=rs, sync=sync, publishers=plain1.grid_ctas())
    torch.cuda.synchronize()
    assert time.time() - t0 < 30
    slots = sync.numel() - HANDOFF_SYNC_TAIL
    assert int(sync[-1]) == slots + 1  # the gate's word (early_done, slot S) timed out


@pytest.mark.gpu
@pytest.mark.parametrize("fc2_sched,fc2_tile", [("pingpong", 192), ("cooperative", None)])
@pytest.mark.parametrize("routing,m_total,grid", [("skewed", 9000, 7), ("uniform", 30000, None), ("skewed", 3, 5)])
def test_gpu_awaiting_fc2_claims_every_tile_once(fc2_sched, fc2_tile, routing, m_total, grid):
    """Drop v114 alone: an awaiting FC2 whose gate is open before it starts (``early_done`` preset to
    its publishers, nothing pending) claims its tiles from the counter -- hundreds of claims a CTA
    at a grid of 7 -- and gives the plain FC2's bits at the full grid into a NaN-poisoned output,
    twice on one buffer, which each run leaves zero (the counter included); y against float64."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem
    from sm90_megamoe.grouped_gemm_handoff import HANDOFF_SYNC_TAIL, handoff_sync_len
    from sm90_megamoe.launch import get_grouped_gemm
    from sm90_megamoe.reference import grouped_gemm_reference

    H, I = 2048, 768
    h, _, offs, rs, _ = bf16_gemm_problem(m_total, I, I, 16, routing, 900 + m_total, True)
    w2 = (torch.randn(16, H, I, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m_total))
          / I ** 0.5).to(torch.bfloat16)
    kw = dict(scale_rows=True, schedule=fc2_sched, tile_n=fc2_tile, raster_m=6)
    plain = get_grouped_gemm("identity", H, I, 16, **kw)
    fc2 = get_grouped_gemm("identity", H, I, 16, handoff="await", **kw)
    assert fc2.kernel.dynamic_tiles
    y0 = torch.full((m_total, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    plain(h, w2, offs, out=y0, row_scale=rs)
    assert not torch.isnan(y0).any()
    sync = torch.zeros(handoff_sync_len(m_total, 16), dtype=torch.int32, device="cuda")
    ctas = fc2.grid_ctas(grid, h.device)
    for _ in range(2):
        sync[sync.numel() - HANDOFF_SYNC_TAIL] = ctas  # the gate: every publisher is past its other tiles
        y = torch.full((m_total + 64, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        fc2(h, w2, offs, out=y[:m_total], row_scale=rs, sync=sync, publishers=ctas, max_active_ctas=grid)
        torch.cuda.synchronize()
        assert torch.isnan(y[m_total:]).all(), "a store past the output"
        assert torch.equal(y[:m_total], y0), "not the plain FC2's bits"
        assert not sync.any(), sync.nonzero().flatten().tolist()
    want = grouped_gemm_reference(h.double(), w2.double(), offs, "identity", rs.double())
    assert float((y0.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_gpu_layer_with_fc2_early_is_bit_identical(monkeypatch, T):
    """MOE_EP_FC2_EARLY=1 gives the Qwen3 layer's default bits, eager and replayed from a poisoned CUDA
    graph; its sync buffer is zero after the warm-up's forwards."""
    require_sm90()
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T + 97)

    def check(impl, on):
        assert (impl.fc1.handoff, impl.fc2.handoff) == (("publish", "await") if on else ("", ""))
        if on:
            assert not impl._handoff_sync.any()

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FC2_EARLY", cfg, "sm90_bf16_cutedsl", inputs, check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
