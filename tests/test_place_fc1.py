"""Drop v91's BF16 FC1 that places its own A rows (sm90_megamoe.grouped_gemm_place) and the BF16
backend's MOE_EP_PLACE_FC1=1 path: step 2 copies no rows; FC1's three spare producer warps write
xs[r] = x[idx[r]] while it runs, and each tile's TMA warp waits (acquire, then a proxy fence) for
its own m-tile's rows. CPU: the PTX (the wait before A's first TMA load, the release after the
copies, the same WGMMAs as the plain kernel), no spills, refusals, the sync buffer's size, which
layers place, the backend's wiring and its error check. GPU (not yet run when written): the same
bits as the plain kernel on x[idx], every row placed, the sync buffer clean after each launch, and
the layer's output with the switch on and off (eager and CUDA graph)."""

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass")

from placing_ptx import check_placing_ptx  # noqa: E402
from recorders import rec_gemm, rec_layout  # noqa: E402
from moe_ep.shim import drop_src, register_drop  # noqa: E402

SRC = drop_src("sm90", "megamoe")
register_drop(SRC)


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


@pytest.mark.parametrize("act,n,k,experts,kw", [
    ("swiglu", 1536, 2048, 128, dict(tanh_sigmoid=True)),                 # Qwen3 FC1, the layer's
    ("clamped_swiglu", 5760, 2880, 128, dict(bias_dtype="float32")),      # gpt-oss FC1 with a bias
    ("swiglu", 28672, 4096, 8, dict(schedule="wide", tile_n=128)),       # Mixtral FC1, one-WGMMA schedule
])
def test_bf16_place_compiles(act, n, k, experts, kw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch

    plain = compile_for_arch(act, n, k, False, num_experts=experts, raster_m=16, **kw).__ptx__
    ptx = compile_for_arch(act, n, k, False, num_experts=experts, raster_m=16, place_a=True, **kw).__ptx__
    check_placing_ptx(ptx, plain, regs=(56, 216))  # the copy warps' register split


def test_bf16_place_refusals():
    from sm90_megamoe.grouped_gemm_place import GroupedGemmPlaceSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="'cooperative' or 'wide'"):
        GroupedGemmPlaceSm90("identity", tile_n=192, schedule="pingpong")
    with pytest.raises(ValueError, match="'cooperative' or 'wide'"):
        GroupedGemmPlaceSm90("swiglu", cluster_m=2)
    with pytest.raises(ValueError, match="place_chunk_rows must be"):
        GroupedGemmPlaceSm90("swiglu", place_chunk_rows=3)
    with pytest.raises(ValueError, match="place_unroll 1, 2, 4 or 8"):
        GroupedGemmPlaceSm90("swiglu", place_unroll=16)
    with pytest.raises(ValueError, match="place_a does not combine"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, gather_a=True, place_a=True, compiled=object())
    with pytest.raises(ValueError, match="swapab"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, schedule="swapab", place_a=True, compiled=object())
    fn = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, place_a=True, compiled=object())
    z, i = torch.zeros(1), torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="xs and sync are required"):
        fn(z, z, z, out=z, idx=i)
    with pytest.raises(ValueError, match="idx is required"):
        fn(z, z, z, out=z, xs=z, sync=i)
    with pytest.raises(ValueError, match="sync must be a 1-d int32 tensor of S \\+ 4"):
        fn(z, z, z, out=z, idx=i, xs=z, sync=torch.zeros(5))
    plain = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, compiled=object())
    with pytest.raises(ValueError, match="xs and sync are required with place_a=True and refused without it"):
        plain(z, z, z, out=z, xs=z, sync=i)
    # prepared launches: only a gathering / placing kernel leaves its rows to each call, and then
    # each call must pass them
    launched = []
    plain_ffi = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, compiled=launched.append, tvm_ffi=True)
    out, off, rs, ph = torch.zeros(8, 768), torch.zeros(129, dtype=torch.int32), torch.zeros(1), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="only for a gathering or placing kernel"):
        plain_ffi.prepare(None, out, off, rs, ph, 7)
    place_ffi = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, place_a=True,
                                    compiled=lambda *a: launched.append(a), tvm_ffi=True)
    run = place_ffi.prepare(None, out, off, rs, ph, 7, idx=i, xs=torch.zeros(8, 2048), sync=i)
    with pytest.raises(ValueError, match="pass a="):
        run(z)
    run(z, a=torch.zeros(0, 2048))  # no source rows: no launch
    assert launched == []
    from moe_ep.shim import sm90_compiled_grouped_gemm

    with pytest.raises(ValueError, match="place_a needs the cooperative or wide schedule"):
        sm90_compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True, schedule="pingpong", place_a=True)
    with pytest.raises(ValueError, match="place_a needs"):
        sm90_compiled_grouped_gemm("swiglu", 1536, 2048, 128, gather_a=True, place_a=True)


def test_place_sync_len_holds_every_routing():
    """S (the ready counters) is at least the m-tiles of any split of ``rows`` over the experts:
    all in one expert, one row each, and random splits; the buffer is S + the drop's 4 tail slots."""
    from moe_ep.shim import sm90_place_sync_len

    g = torch.Generator().manual_seed(7)
    for rows, experts in ((1, 1), (128, 1), (129, 4), (65536, 128), (5000, 16), (3, 64)):
        n = sm90_place_sync_len(rows, experts)
        slots = n - 4
        assert slots >= 1
        splits = [torch.tensor([rows] + [0] * (experts - 1)), torch.bincount(torch.arange(rows) % experts,
                                                                             minlength=experts)]
        for _ in range(20):
            splits.append(torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts))
        for counts in splits:
            assert int(counts.sum()) == rows
            assert int(((counts + 127) // 128).sum()) <= slots, (rows, experts, counts)


def test_which_layers_place(monkeypatch):
    """One rank with LocalRoute and the 128-row FC1 on its cooperative schedule; never the decode
    FC1 or FC2, never with the gathering FC1 (that raises), never a pingpong FC1 (Nemotron's)."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs

    cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=8192)
    assert "place_a" not in _gemm_specs(cfg, 128, 1)["fc1"]  # off by default
    monkeypatch.setenv("MOE_EP_PLACE_FC1", "1")
    specs = _gemm_specs(cfg, 128, 1)
    assert specs["fc1"]["place_a"] and "place_a" not in specs["fc1_decode"] and "place_a" not in specs["fc2"]
    assert "place_a" not in _gemm_specs(cfg, 64, 2)["fc1"]  # two ranks: dispatch, no LocalRoute
    small = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=128)
    assert "place_a" not in _gemm_specs(small, 128, 1)["fc1"]  # decode-sized layer: swap-AB FC1
    nemotron = MoEConfig(num_experts=128, hidden=2688, intermediate=1856, top_k=6, max_tokens_per_rank=8192,
                         activation="squared_relu")
    assert "place_a" not in _gemm_specs(nemotron, 128, 1)["fc1"]  # FC1 on pingpong (K <= 2880)
    monkeypatch.setenv("MOE_EP_GATHER_FC1", "1")
    with pytest.raises(ValueError, match="MOE_EP_GATHER_FC1=1 and MOE_EP_PLACE_FC1=1"):
        _gemm_specs(cfg, 128, 1)
    monkeypatch.setenv("MOE_EP_GATHER_FC1", "0")
    monkeypatch.setenv("MOE_EP_LOCAL_ROUTE", "0")
    assert "place_a" not in _gemm_specs(cfg, 128, 1)["fc1"]


def test_bf16_place_wiring_on_cpu():
    """Steps 2-4 with a placing FC1 (recorded, no kernel runs): LocalRoute writes no grouped rows,
    FC1 gets the caller's x, idx, the layer's xs and its sync buffer, FC2 reads h as usual."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    calls = []

    rec = functools.partial(rec_gemm, calls)

    b = object.__new__(Sm90CuteDSLBackend)
    names = ("offsets", "idx", "ws_rows", "pos", "xs", "h", "y")
    t = {n: torch.zeros(4) for n in names}
    x, ids, w = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    b.local_route, b.token_grid, b._routing = True, False, None
    b.fc1_decode = b.fc2_decode = None
    b.fc1, b.fc2 = rec("fc1", gather_a=False, place_a=True), rec("fc2", gather_a=False, place_a=False)
    b.layout = rec_layout(calls)
    b.ws = SimpleNamespace(seq=0)
    b.ep = SimpleNamespace(dispatch=lambda *a, **k: calls.append(("dispatch", a, k)))
    for n in names:
        setattr(b, n, t[n])
    b._place_sync = torch.zeros(9, dtype=torch.int32)
    b.num_ctas, b.local_combine = 7, False
    b._prepare_launches()  # the placing FC1's launch is prepared too, its source rows per call
    b._step1_dispatch(x, ids, w)
    b._step2_layout()
    b._step34_experts("w13", "w2")
    assert [c[0] for c in calls] == ["route", "fc1", "fc2"]
    assert calls[0][1][-1] is None  # no grouped rows copied by step 2
    fa, fk = calls[1][1:]
    assert fa[0] is x and fa[1] == "w13" and fk["idx"] is t["idx"] and fk["out"] is t["h"]
    assert fk["xs"] is t["xs"] and fk["sync"] is b._place_sync
    assert calls[2][1][0] is t["h"] and calls[2][2]["out"] is t["y"]
    assert b._fc1_src is None and b._routing is None


def test_placement_timeout_is_raised_by_check_and_clears_the_counters():
    """check(): the sync buffer's error word (1 + the m-tile) raises once, naming the switch, and
    the counters are zeroed; a clean buffer passes; a layer without a placing FC1 skips it."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    b = object.__new__(Sm90CuteDSLBackend)
    b._place_sync = torch.zeros(9, dtype=torch.int32)
    b._check_placement()
    b._place_sync[0], b._place_sync[-1] = 3, 6
    with pytest.raises(RuntimeError, match=r"MOE_EP_PLACE_FC1=1\) timed out at m-tile 5"):
        b._check_placement()
    assert not bool(b._place_sync.any())
    b._place_sync = None
    b._check_placement()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3", "gpt_oss"])
def test_gpu_place_is_bit_identical(model):
    """The drop runner's checks: the placing FC1 twice in a row into NaN-poisoned outputs and xs,
    each bit-identical to the plain FC1 on x[idx], xs == x[idx], the sync buffer back to zero; at a
    layer's rows, skewed, few and one row."""
    _needs_sm90()
    from sm90_megamoe.grouped_gemm_runner import GATHER_CHECKS, WIDE_SHAPES, placed_same_bits
    from sm90_megamoe.launch import CompiledGroupedGemm

    n, k, e, m, act, bias = WIDE_SHAPES[model]
    tanh = {"tanh_sigmoid": True} if act == "swiglu" else {}
    plain = CompiledGroupedGemm(act, n, k, e, False, bias_dtype=bias, **tanh)
    placing = CompiledGroupedGemm(act, n, k, e, False, bias_dtype=bias, place_a=True, **tanh)
    for m_, routing, seed in GATHER_CHECKS:
        m_ = min(m_ or m, 16384)
        assert placed_same_bits(plain, placing, m_, n, k, e, act, routing, seed, bias), (m_, routing)


@pytest.mark.gpu
def test_gpu_place_matches_float64():
    """The placing FC1 against a float64 computation of the same layer rows."""
    _needs_sm90()
    from sm90_megamoe.grouped_gemm_runner import gathered_problem, place_sync
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.reference import grouped_gemm_reference

    n, k, e, m = 1536, 2048, 16, 5000
    b, offs, _, x, idx = gathered_problem(m, n, k, e, "swiglu", "skewed", 11)
    fn = CompiledGroupedGemm("swiglu", n, k, e, False, place_a=True)
    out = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    xs = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn(x, b, offs, out=out, idx=idx, xs=xs, sync=place_sync(m, e))
    want = grouped_gemm_reference(x[idx.long()].double(), b.double(), offs, "swiglu", None).double()
    assert torch.isfinite(out.float()).all()
    assert float((out.double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 4096])
def test_place_fc1_layer_is_bit_identical(monkeypatch, T):
    """MOE_EP_PLACE_FC1=1: the layer's output is the same bits as without, eager and CUDA graph, and
    check_errors() finds no placement timeout."""
    _needs_sm90()
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T + 1)

    def check(impl, on):
        assert getattr(impl.fc1, "place_a", False) == on and (impl._place_sync is not None) == on

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_PLACE_FC1", cfg, "sm90_bf16_cutedsl", inputs, check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
