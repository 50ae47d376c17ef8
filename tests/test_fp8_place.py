"""Drop v92's FP8 GEMMs that quantise and place their own A rows (sm90_megamoe.fp8_gemm_place) and
the FP8 backend's MOE_EP_FP8_PLACE switch: FC1 quantises grouped row r from token idx[r], FC2 from
row r of h, in their three spare producer warps while the GEMM runs; each tile's TMA warp waits
(acquire, then a proxy fence) for its m-tile's rows. CPU: the PTX of the layer's schedules (the
wait before the first TMA load, the release after the quantised stores, the plain kernel's
WGMMAs), no spills, refusals, the shim's key, which GEMMs place, the backend's wiring and its error
check. GPU (not yet run when written): the same bits as the quantiser + the plain GEMM, A and its
scales as the reference quantiser writes them, the sync buffer clean after each launch, and the
layer's output with the switch on and off (eager and CUDA graph)."""

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

QWEN = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)
Q1 = dict(raster_m=16, overlap_promotion=True, wide_gated=True, cluster_n=2, tanh_sigmoid=True)
# (activation, N, K, E, gather, the layer's schedule): Qwen3's FC1 (staged scales) and FC2 (staged
# scales, deferred epilogue), Mixtral's FC2 (scales by TMA, the chunked k-loop)
SHAPES = [
    ("swiglu", 1536, 2048, 128, True, dict(Q1, smem_scales=True)),
    ("identity", 2048, 768, 128, False, dict(raster_m=16, overlap_promotion=True, cluster_n=2, smem_scales=True,
                                             deferred_epilogue=True)),
    ("identity", 4096, 14336, 8, False, dict(raster_m=13, overlap_promotion=True, cluster_n=2, unit_scales=True)),
]


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _ptx(kernel, fake, tmp_path, monkeypatch) -> str:
    import cutlass.cute as cute

    monkeypatch.chdir(tmp_path)  # --keep-ptx writes into the working directory
    return cute.compile(kernel, *fake, options="--gpu-arch sm_90a --keep-ptx").__ptx__


@pytest.mark.parametrize("act,n,k,experts,gather,kw", SHAPES)
def test_fp8_place_compiles(act, n, k, experts, gather, kw, tmp_path, monkeypatch):
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_gemm_place import Fp8PlaceGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args, fake_place_args
    from sm90_megamoe.swapab_runner import ptxas_info

    sr = act == "identity"
    plain = _ptx(Fp8BlockScaledGroupedGemmSm90(act, scale_rows=sr, **kw), fake_args(experts, n, k, act), tmp_path,
                 monkeypatch)
    ptx = _ptx(Fp8PlaceGroupedGemmSm90(act, scale_rows=sr, place_gather=gather, **kw),
               fake_place_args(experts, n, k, act), tmp_path, monkeypatch)
    wgmma = lambda p: re.findall(r"wgmma\.mma_async[\w.]*", p)  # noqa: E731
    assert wgmma(ptx) == wgmma(plain) and "e4m3.e4m3" in wgmma(ptx)[0]
    # the TMA warp: acquire-spin on the m-tile's counter (bounded by %globaltimer), then a proxy fence,
    # then A's TMA loads
    spin = ptx.index("ld.acquire.gpu.global.b32")
    assert spin < ptx.index("fence.proxy.async.global") < ptx.index("cp.async.bulk.tensor.2d")
    assert "%globaltimer" in ptx
    # the quantising warps: the quantiser's arithmetic, a fence per lane, the count released by lane 0
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "rcp.rn.f32" in ptx
    assert "fence.acq_rel.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx
    # the plain kernel's register split, no local memory; nothing of this in the plain kernel
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232;" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "fence.proxy.async.global" not in plain and "red.release.gpu" not in plain
    assert "cvt.rn.satfinite.e4m3x2" not in plain  # the plain GEMM quantises nothing itself
    info = ptxas_info(ptx)
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0, info


def test_fp8_place_refusals():
    from sm90_megamoe.fp8_gemm_place import Fp8PlaceGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    with pytest.raises(ValueError, match="no scale_warp"):
        Fp8PlaceGroupedGemmSm90("identity", smem_scales=True, scale_warp=True, overlap_promotion=True)
    for bad in (dict(place_chunk_rows=3), dict(place_unroll=8), dict(place_vals=4)):
        with pytest.raises(ValueError, match="place_chunk_rows must be"):
            Fp8PlaceGroupedGemmSm90("swiglu", **bad)
    with pytest.raises(ValueError, match="place_a does not combine with scale_warp"):
        CompiledFp8Gemm("identity", 2048, 768, 128, True, compiled=object(), smem_scales=True, scale_warp=True,
                        place_a=True)
    fc1 = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=object(), place_a=True)
    fc2 = CompiledFp8Gemm("identity", 2048, 768, 128, True, compiled=object(), place_a=True, place_gather=False)
    plain = CompiledFp8Gemm("identity", 2048, 768, 128, True, compiled=object())
    z, i = torch.zeros(1), torch.zeros(5, dtype=torch.int32)
    x1, x2 = torch.zeros(3, 2048, dtype=torch.bfloat16), torch.zeros(3, 768, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x and sync are required"):
        fc1(z, z, z, z, z, z, z, idx=i)
    with pytest.raises(ValueError, match="idx is required with place_a=True, place_gather=True"):
        fc1(z, z, z, z, z, z, z, x=x1, sync=i)
    with pytest.raises(ValueError, match="idx is required .* and refused otherwise"):
        fc2(z, z, z, z, z, z, z, x=x2, idx=i, sync=i)
    with pytest.raises(ValueError, match="sync must be a 1-d int32 tensor of S \\+ 4"):
        fc2(z, z, z, z, z, z, z, x=x2, sync=torch.zeros(5))
    with pytest.raises(ValueError, match=r"x must be a bfloat16 \[T, 768\] tensor"):
        fc2(z, z, z, z, z, z, z, x=x1, sync=i)
    with pytest.raises(ValueError, match="x and sync are required with place_a=True and refused without it"):
        plain(z, z, z, z, z, z, z, x=x2, sync=i)
    # prepared launches: FC1's source rows per call (then required), FC2's fixed at prepare
    launched = []
    fc1_ffi = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=lambda *a: launched.append(a), tvm_ffi=True,
                              place_a=True)
    fc1_ffi._max_ctas = 132
    a, a_s = torch.zeros(8, 2048, dtype=torch.uint8), torch.zeros(8, 16)
    off, out, rs = torch.zeros(129, dtype=torch.int32), torch.zeros(8, 768), torch.zeros(1)
    with pytest.raises(ValueError, match="idx is required"):
        fc1_ffi.prepare(a, a_s, off, out, rs, 7, sync=i)
    run = fc1_ffi.prepare(a, a_s, off, out, rs, 7, idx=i, sync=i)
    with pytest.raises(ValueError, match="takes its source rows per call"):
        run(z, z)
    run(z, z, torch.zeros(0, 2048, dtype=torch.bfloat16))  # no source rows: no launch
    assert launched == []


def test_fp8_place_shim_key(monkeypatch):
    """The placement is part of the compile key and the disk-cache name; a bad kind and a scale warp
    asked for beside it raise."""
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    plain = s._gemm_key("identity", 2048, 768, 128, True)
    rows = s._gemm_key("identity", 2048, 768, 128, True, place="rows")
    gather = s._gemm_key("swiglu", 1536, 2048, 128, False, place="gather")
    assert plain.place == "" and rows.place == "rows" and gather.place == "gather" and plain != rows
    assert dataclasses.replace(rows, place="") == plain  # nothing else differs
    assert s._gemm_options(rows)["place_a"] and not s._gemm_options(rows)["place_gather"]
    assert s._gemm_options(gather)["place_gather"] and "place_a" not in s._gemm_options(plain)
    with pytest.raises(ValueError, match="place must be one of"):
        s._gemm_key("identity", 2048, 768, 128, True, place="scatter")
    monkeypatch.setenv("MOE_EP_FP8_SMEM_SCALES", "1")
    monkeypatch.setenv("MOE_EP_FP8_SCALE_WARP", "1")
    with pytest.raises(ValueError, match="has no scale warp"):
        s._gemm_key("identity", 2048, 768, 128, True, place="rows")


def test_which_fp8_gemms_place(monkeypatch):
    from moe_ep.backends.sm90.fp8_cutedsl.backend import place_gemms

    assert place_gemms(1) == (False, False)  # off by default
    for value, want in (("fc1", (True, False)), ("fc2", (False, True)), ("1", (True, True)), ("0", (False, False))):
        monkeypatch.setenv("MOE_EP_FP8_PLACE", value)
        assert place_gemms(1) == want and place_gemms(4) == want
    monkeypatch.setenv("MOE_EP_FP8_PLACE", "yes")
    with pytest.raises(ValueError, match="MOE_EP_FP8_PLACE must be one of"):
        place_gemms(1)
    monkeypatch.setenv("MOE_EP_FP8_PLACE", "1")
    monkeypatch.setenv("MOE_EP_FP8_WIRE", "1")
    assert place_gemms(1) == (True, True)  # one rank: no wire
    with pytest.raises(ValueError, match="MOE_EP_FP8_WIRE=1 sends it quantised"):
        place_gemms(2)
    monkeypatch.setenv("MOE_EP_FP8_PLACE", "fc2")
    assert place_gemms(2) == (False, True)
    monkeypatch.setenv("MOE_EP_FP8_PLACE", "fc1")
    monkeypatch.delenv("MOE_EP_FP8_WIRE")
    monkeypatch.setenv("MOE_EP_FP8_FUSED_GATHER", "0")
    with pytest.raises(ValueError, match="needs the fused gather"):
        place_gemms(1)


def test_fp8_prebuild_builds_the_placing_gemms(monkeypatch):
    """prebuild with MOE_EP_FP8_PLACE: the placing GEMMs, and no quantiser for a GEMM that places."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb

    built = []
    monkeypatch.setattr(fb, "sm90_compiled_fp8_gemm", lambda *a, **k: built.append(("gemm", a[0], k)))
    monkeypatch.setattr(fb, "sm90_compiled_fp8_quantize_rows", lambda k, **kw: built.append(("quant", k)))
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    for value, want in (("0", [("gemm", "swiglu", {"place": ""}), ("quant", 2048), ("gemm", "identity", {"place": ""}),
                               ("quant", 768)]),
                        ("fc2", [("gemm", "swiglu", {"place": ""}), ("quant", 2048),
                                 ("gemm", "identity", {"place": "rows"})]),
                        ("1", [("gemm", "swiglu", {"place": "gather"}), ("gemm", "identity", {"place": "rows"})])):
        monkeypatch.setenv("MOE_EP_FP8_PLACE", value)
        built.clear()
        fb.prebuild(cfg, 1, kernels=("fc1", "fc2"))
        assert built == want, value


def _rec_fp8_gemm(calls, name, place_a=False):
    """A recording stand-in for an FP8 GEMM launcher: ``prepare`` returns a run that records what
    the launch would get (its per-call source rows too)."""
    def prepare(self, a, a_scale, offsets, out, row_scale, max_active_ctas=None, x=None, idx=None, sync=None):
        def run(b, b_scale, x_call=None):
            calls.append((name, dict(a=a, b=b, x=x if x_call is None else x_call, idx=idx, sync=sync, out=out)))
        return run
    return type(name, (), {"prepare": prepare, "place_a": place_a})()


def _rec_quant(calls, name):
    def prepare(self, q, scale, **kw):
        return lambda x: calls.append((name, dict(x=x, q=q)))
    return type(name, (), {"prepare": prepare})()


@pytest.mark.parametrize("mode", ["0", "fc1", "fc2", "1"])
def test_fp8_place_wiring_on_cpu(mode):
    """Steps 3-4 (recorded, no kernel runs): a placing FC1 gets the call's rows, idx and its sync
    buffer and no quantiser runs before it; a placing FC2 gets h and its own sync buffer and no
    quantiser runs between the GEMMs; otherwise the quantisers and the plain GEMMs as before."""
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    calls = []
    p1, p2 = mode in ("fc1", "1"), mode in ("fc2", "1")
    b = object.__new__(Sm90Fp8Backend)
    names = ("xq", "xq_scale", "hq", "hq_scale", "offsets", "idx", "ws_rows", "pos", "h", "y", "xs", "_rows")
    t = {n: torch.zeros(4) for n in names}
    for n in names:
        setattr(b, n, t[n])
    b.place_fc1, b.place_fc2, b.fp8_wire, b.fused_gather, b.scatter_quant = p1, p2, False, True, not p1
    b.fc1, b.fc2 = _rec_fp8_gemm(calls, "fc1", p1), _rec_fp8_gemm(calls, "fc2", p2)
    b.quant_x = None if p1 else _rec_quant(calls, "quant_x")
    b.quant_h = None if p2 else _rec_quant(calls, "quant_h")
    b.ep = SimpleNamespace(bufs=SimpleNamespace(recv_count=torch.zeros(1)))
    b.dims = SimpleNamespace(max_tokens=4)
    b.num_ctas = 7
    b._fp8_place_syncs = {n: torch.zeros(9, dtype=torch.int32) for n, on in (("FC1", p1), ("FC2", p2)) if on}
    b._prepare_expert_launches()
    x = torch.zeros(3, 4)
    b._x_rows = x
    w13, w2 = SimpleNamespace(values="v13", scale="s13"), SimpleNamespace(values="v2", scale="s2")
    b._step34_experts(w13, w2)
    order = [c[0] for c in calls]
    assert order == (["fc1"] if p1 else ["quant_x", "fc1"]) + (["fc2"] if p2 else ["quant_h", "fc2"])
    got = dict(calls)
    assert got["fc1"]["b"] == "v13" and got["fc1"]["out"] is t["h"] and got["fc2"]["out"] is t["y"]
    if p1:
        assert got["fc1"]["x"] is x and got["fc1"]["idx"] is t["idx"] and got["fc1"]["sync"] is b._fp8_place_syncs["FC1"]
    else:
        assert got["quant_x"]["x"] is x and got["fc1"]["x"] is None and got["fc1"]["sync"] is None
    if p2:
        assert got["fc2"]["x"] is t["h"] and got["fc2"]["idx"] is None and got["fc2"]["sync"] is b._fp8_place_syncs["FC2"]
    else:
        assert got["quant_h"]["x"] is t["h"] and got["fc2"]["x"] is None
    assert b._x_rows is None


def test_fp8_placement_timeout_is_raised_by_check():
    """check(): a placing GEMM's error word (1 + the m-tile) raises once, naming the GEMM and the switch,
    and its counters are zeroed; clean buffers pass."""
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    b = object.__new__(Sm90Fp8Backend)
    b._fp8_place_syncs = {"FC1": torch.zeros(9, dtype=torch.int32), "FC2": torch.zeros(9, dtype=torch.int32)}
    b._check_placement()
    b._fp8_place_syncs["FC2"][2], b._fp8_place_syncs["FC2"][-1] = 1, 4
    with pytest.raises(RuntimeError, match=r"FC2 \(MOE_EP_FP8_PLACE\) timed out at m-tile 3"):
        b._check_placement()
    assert not bool(b._fp8_place_syncs["FC2"].any())
    b._check_placement()


@pytest.mark.gpu
@pytest.mark.parametrize("model,fc", [("qwen3", "fc1"), ("qwen3", "fc2"), ("mixtral", "fc1"), ("mixtral", "fc2")])
def test_gpu_fp8_place_is_bit_identical(model, fc):
    """The drop runner's checks: the placing GEMM twice in a row into poisoned outputs, A and scales,
    each bit-identical to the quantiser's rows + the plain GEMM, A and scales as the reference
    quantiser writes them, the sync buffer back to zero; uniform / skewed, 8192 / few / one token."""
    _needs_sm90()
    from sm90_megamoe import fp8_place_runner as r
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    h, i, E = r.MODELS[model][:3]
    act, n, k = ("swiglu", 2 * i, h) if fc == "fc1" else ("identity", h, i)
    kw = r._layer_kw(act, k)
    plain = CompiledFp8Gemm(act, n, k, E, fc == "fc2", **kw)
    placing = CompiledFp8Gemm(act, n, k, E, fc == "fc2", **kw, place_a=True, place_gather=fc == "fc1")
    ctas = r.max_active_ctas(2)
    for kind, tokens in r.CHECKS:
        p = r.Problem(model, fc, kind, tokens or 4096, seed=5 + tokens)
        assert r.check(p, plain, placing, ctas), (kind, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fc1", "fc2", "1"])
@pytest.mark.parametrize("T", [0, 1, 700])
def test_fp8_place_layer_is_bit_identical(monkeypatch, mode, T):
    """MOE_EP_FP8_PLACE: the Qwen3 FP8 layer's output is the same bits as without, eager and CUDA
    graph, and check_errors() finds no placement timeout."""
    _needs_sm90()
    from moe_ep.api import MoEConfig
    from moe_oracle import fp8_layer_inputs, layer_outputs_with_switch

    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    inputs = fp8_layer_inputs(QWEN["num_experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"], T, 90 + T)

    def check(impl, on):
        want = (on and mode in ("fc1", "1"), on and mode in ("fc2", "1"))
        assert (impl.place_fc1, impl.place_fc2) == want and len(impl._fp8_place_syncs) == sum(want)

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FP8_PLACE", cfg, "sm90_fp8_cutedsl", inputs, check,
                                     values=("0", mode))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
