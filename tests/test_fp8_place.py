"""Drop v92's FP8 GEMMs that quantise and place their own A rows (sm90_megamoe.fp8_gemm_place) and
the FP8 backend's MOE_EP_FP8_PLACE_FC1 / _FC2 switches: FC1 quantises grouped row r from token
idx[r] ("quant") or copies it from the tokens quantised once each ("copy"), FC2 quantises row r of
h, in their three spare producer warps while the GEMM runs; each tile's TMA warp waits
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
# (activation, N, K, E, how A is placed, the layer's schedule): Qwen3's FC1 (staged scales) quantising
# and copying, its FC2 (staged scales, deferred epilogue), Mixtral's FC1 copying and FC2 (scales by
# TMA; FC2: the chunked k-loop)
SHAPES = [
    ("swiglu", 1536, 2048, 128, "gather", dict(Q1, smem_scales=True)),
    ("swiglu", 1536, 2048, 128, "copy", dict(Q1, smem_scales=True)),
    ("identity", 2048, 768, 128, "rows", dict(raster_m=16, overlap_promotion=True, cluster_n=2, smem_scales=True,
                                              deferred_epilogue=True)),
    ("swiglu", 28672, 4096, 8, "copy", dict(Q1, unit_scales=True)),
    ("identity", 4096, 14336, 8, "rows", dict(raster_m=13, overlap_promotion=True, cluster_n=2, unit_scales=True)),
]


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _ptx(kernel, fake, tmp_path, monkeypatch) -> str:
    import cutlass.cute as cute

    monkeypatch.chdir(tmp_path)  # --keep-ptx writes into the working directory
    return cute.compile(kernel, *fake, options="--gpu-arch sm_90a --keep-ptx").__ptx__


@pytest.mark.parametrize("act,n,k,experts,place,kw", SHAPES)
def test_fp8_place_compiles(act, n, k, experts, place, kw, tmp_path, monkeypatch):
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_gemm_place import Fp8PlaceGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args, fake_place_args
    from sm90_megamoe.swapab_runner import ptxas_info

    sr = act == "identity"
    plain = _ptx(Fp8BlockScaledGroupedGemmSm90(act, scale_rows=sr, **kw), fake_args(experts, n, k, act), tmp_path,
                 monkeypatch)
    copy = place == "copy"
    ptx = _ptx(Fp8PlaceGroupedGemmSm90(act, scale_rows=sr, place_gather=place == "gather",
                                       place_mode="copy" if copy else "quant", **kw),
               fake_place_args(experts, n, k, act, copy=copy), tmp_path, monkeypatch)
    wgmma = lambda p: re.findall(r"wgmma\.mma_async[\w.]*", p)  # noqa: E731
    assert wgmma(ptx) == wgmma(plain) and "e4m3.e4m3" in wgmma(ptx)[0]
    # the TMA warp: acquire-spin on the m-tile's counter (bounded by %globaltimer), then a proxy fence,
    # then A's TMA loads
    spin = ptx.index("ld.acquire.gpu.global.b32")
    assert spin < ptx.index("fence.proxy.async.global") < ptx.index("cp.async.bulk.tensor.2d")
    assert "%globaltimer" in ptx and "ld.relaxed.gpu.global.b32" in ptx  # the clock, another tile's timeout
    # the placing warps: the quantiser's arithmetic (or 16-byte copies), a fence per lane, the count
    # released by lane 0
    if copy:
        assert "cvt.rn.satfinite.e4m3x2" not in ptx
        assert re.search(r"ld\.global\.v4\.(b32|u32)", ptx) and re.search(r"st\.global\.v4\.(b32|u32)", ptx)
    else:
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
    with pytest.raises(ValueError, match=r"x must be a torch.bfloat16 \[T, 768\] tensor"):
        fc2(z, z, z, z, z, z, z, x=x1, sync=i)
    with pytest.raises(ValueError, match="x_scale is required with place_copy=True and refused otherwise"):
        fc2(z, z, z, z, z, z, z, x=x2, sync=i, x_scale=torch.zeros(3, 6))
    # copying: e4m3 (or uint8) rows with their float32 scales, always by idx
    cp = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=object(), place_a=True, place_copy=True,
                         place_gather=False)
    assert cp.place_gather
    q1, s1 = torch.zeros(3, 2048, dtype=torch.uint8), torch.zeros(3, 16)
    with pytest.raises(ValueError, match="x_scale is required"):
        cp(z, z, z, z, z, z, z, x=q1, idx=i, sync=i)
    with pytest.raises(ValueError, match=r"x must be a torch.float8_e4m3fn or torch.uint8 \[T, 2048\]"):
        cp(z, z, z, z, z, z, z, x=x1, idx=i, sync=i, x_scale=s1)
    with pytest.raises(ValueError, match=r"x_scale must be a float32 \[T, 16\]"):
        cp(z, z, z, z, z, z, z, x=q1, idx=i, sync=i, x_scale=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="place_mode must be 'quant' or 'copy'"):
        Fp8PlaceGroupedGemmSm90("swiglu", place_mode="gather")
    with pytest.raises(ValueError, match=r"place_unroll 1, 2 or 4 \(8 when copying\)"):
        Fp8PlaceGroupedGemmSm90("swiglu", place_unroll=8)
    assert Fp8PlaceGroupedGemmSm90("swiglu", place_mode="copy", place_unroll=8).place_unroll == 8
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

    assert place_gemms(1) == ("", False)  # off by default
    for fc1, fc2, want in (("quant", "0", ("quant", False)), ("copy", "1", ("copy", True)), ("0", "1", ("", True))):
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", fc1)
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC2", fc2)
        assert place_gemms(1) == want and place_gemms(4) == want
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "1")
    with pytest.raises(ValueError, match="MOE_EP_FP8_PLACE_FC1 must be one of 0, quant, copy"):
        place_gemms(1)
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "copy")
    monkeypatch.setenv("MOE_EP_FP8_WIRE", "1")
    assert place_gemms(1) == ("copy", True)  # one rank: no wire
    with pytest.raises(ValueError, match="MOE_EP_FP8_WIRE=1 sends it quantised"):
        place_gemms(2)
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "0")
    assert place_gemms(2) == ("", True)  # FC2's placement does not mind the wire
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "quant")
    monkeypatch.delenv("MOE_EP_FP8_WIRE")
    monkeypatch.setenv("MOE_EP_FP8_FUSED_GATHER", "0")
    with pytest.raises(ValueError, match="needs the fused gather"):
        place_gemms(1)


def test_fp8_prebuild_builds_the_placing_gemms(monkeypatch):
    """prebuild with the placement switches: the placing GEMMs, and for each GEMM the quantiser it still
    needs (none where the GEMM quantises; FC1 copying: the token-order one, top-k 1)."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb

    built = []
    monkeypatch.setattr(fb, "sm90_compiled_fp8_gemm", lambda *a, **k: built.append(("gemm", a[0], k["place"])))
    monkeypatch.setattr(fb, "sm90_compiled_fp8_quantize_rows",
                        lambda k, **kw: built.append(("quant", k, kw["scatter_topk"])))
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    for fc1, fc2, want in (
            ("0", "0", [("gemm", "swiglu", ""), ("quant", 2048, 8), ("gemm", "identity", ""), ("quant", 768, 0)]),
            ("0", "1", [("gemm", "swiglu", ""), ("quant", 2048, 8), ("gemm", "identity", "rows")]),
            ("quant", "1", [("gemm", "swiglu", "gather"), ("gemm", "identity", "rows")]),
            ("copy", "0", [("gemm", "swiglu", "copy"), ("quant", 2048, 1), ("gemm", "identity", ""),
                           ("quant", 768, 0)])):
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", fc1)
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC2", fc2)
        built.clear()
        fb.prebuild(cfg, 1, kernels=("fc1", "fc2"))
        assert built == want, (fc1, fc2)


def _rec_fp8_gemm(calls, name, place_a=False):
    """A recording stand-in for an FP8 GEMM launcher: ``prepare`` returns a run that records what
    the launch would get (its per-call source rows too)."""
    def prepare(self, a, a_scale, offsets, out, row_scale, max_active_ctas=None, x=None, idx=None, sync=None,
                x_scale=None):
        def run(b, b_scale, x_call=None):
            calls.append((name, dict(a=a, b=b, x=x if x_call is None else x_call, idx=idx, sync=sync, out=out,
                                     x_scale=x_scale)))
        return run
    return type(name, (), {"prepare": prepare, "place_a": place_a})()


def _rec_quant(calls, name):
    def prepare(self, q, scale, **kw):
        return lambda x: calls.append((name, dict(x=x, q=q, **kw)))
    return type(name, (), {"prepare": prepare})()


@pytest.mark.parametrize("fc1", ["", "quant", "copy"])
@pytest.mark.parametrize("fc2", [False, True])
def test_fp8_place_wiring_on_cpu(fc1, fc2):
    """Steps 3-4 (recorded, no kernel runs): FC1 quantising ("quant") gets the call's rows, idx and its
    sync buffer, and no quantiser runs before it; FC1 copying ("copy") gets the token-order rows and
    scales the top-1 quantiser writes (slot s into row s) with idx; a placing FC2 gets h and its own
    sync buffer, and no quantiser runs between the GEMMs; otherwise the quantisers and the plain
    GEMMs as before."""
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    calls = []
    b = object.__new__(Sm90Fp8Backend)
    names = ("xq", "xq_scale", "hq", "hq_scale", "offsets", "idx", "ws_rows", "pos", "h", "y", "xs", "_rows",
             "xq_tok", "sx_tok", "_tok_pos")
    t = {n: torch.zeros(4) for n in names}
    for n in names:
        setattr(b, n, t[n])
    b.place_fc1, b.place_fc2, b.fp8_wire, b.fused_gather, b.scatter_quant = fc1, fc2, False, True, not fc1
    b.fc1, b.fc2 = _rec_fp8_gemm(calls, "fc1", bool(fc1)), _rec_fp8_gemm(calls, "fc2", fc2)
    b.quant_x = None if fc1 == "quant" else _rec_quant(calls, "quant_x")
    b.quant_h = None if fc2 else _rec_quant(calls, "quant_h")
    b.ep = SimpleNamespace(bufs=SimpleNamespace(recv_count=torch.zeros(1)))
    b.dims = SimpleNamespace(max_tokens=4)
    b.num_ctas = 7
    b._fp8_place_syncs = {n: torch.zeros(9, dtype=torch.int32) for n, on in (("FC1", fc1), ("FC2", fc2)) if on}
    b._prepare_expert_launches()
    x = torch.zeros(3, 4)
    b._x_rows = x
    w13, w2 = SimpleNamespace(values="v13", scale="s13"), SimpleNamespace(values="v2", scale="s2")
    b._step34_experts(w13, w2)
    order = [c[0] for c in calls]
    assert order == (["fc1"] if fc1 == "quant" else ["quant_x", "fc1"]) + (["fc2"] if fc2 else ["quant_h", "fc2"])
    got = dict(calls)
    assert got["fc1"]["b"] == "v13" and got["fc1"]["out"] is t["h"] and got["fc2"]["out"] is t["y"]
    assert got["fc1"]["a"] is t["xq"] and got["fc2"]["a"] is t["hq"]
    sync1 = b._fp8_place_syncs.get("FC1")
    if fc1 == "quant":
        assert got["fc1"]["x"] is x and got["fc1"]["idx"] is t["idx"] and got["fc1"]["sync"] is sync1
    elif fc1 == "copy":
        assert got["quant_x"]["x"] is x and got["quant_x"]["q"] is t["xq_tok"]
        assert got["quant_x"]["pos"] is t["_tok_pos"]
        assert got["fc1"]["x"] is t["xq_tok"] and got["fc1"]["x_scale"] is t["sx_tok"]
        assert got["fc1"]["idx"] is t["idx"] and got["fc1"]["sync"] is sync1
    else:
        assert got["quant_x"]["x"] is x and got["quant_x"]["q"] is t["xq"] and got["fc1"]["x"] is None
        assert got["fc1"]["sync"] is None
    if fc2:
        assert got["fc2"]["x"] is t["h"] and got["fc2"]["idx"] is None
        assert got["fc2"]["sync"] is b._fp8_place_syncs["FC2"]
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
    with pytest.raises(RuntimeError, match=r"FC2 \(MOE_EP_FP8_PLACE_FC2\) timed out at m-tile 3"):
        b._check_placement()
    assert not bool(b._fp8_place_syncs["FC2"].any())
    b._check_placement()


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_runner_routing_is_a_layout(monkeypatch, kind):
    """The drop runner's routing (what its GPU checks rest on; CPU tensors here): ``idx`` lists each
    expert's (token, choice) rows in token order, expert by expert as ``offsets`` says, ``pos`` is its
    inverse, and each token's choices are distinct experts."""
    from sm90_megamoe import fp8_place_runner as r

    monkeypatch.setattr(torch.Tensor, "cuda", lambda t, *a, **k: t)
    for tokens, topk, experts in ((37, 8, 128), (1, 2, 8), (300, 2, 8)):
        idx, pos, offs = r.routing(tokens, topk, experts, kind, seed=tokens)
        m = tokens * topk
        assert idx.dtype == pos.dtype == offs.dtype == torch.int32
        assert idx.shape == (m,) and pos.shape == (tokens, topk) and int(offs[-1]) == m and int(offs[0]) == 0
        assert torch.equal(idx[pos.flatten().long()], torch.arange(tokens).repeat_interleave(topk).int())
        assert sorted(pos.flatten().tolist()) == list(range(m))
        expert_of_row = torch.repeat_interleave(torch.arange(experts), (offs[1:] - offs[:-1]).long())
        choices = expert_of_row[pos.long()]  # [T, topk]: each token's experts
        assert all(len(set(row)) == topk for row in choices.tolist())
        for e in range(experts):  # token order within an expert
            rows = idx[int(offs[e]):int(offs[e + 1])]
            assert torch.equal(rows, rows.sort().values)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3", "mixtral"])
@pytest.mark.parametrize("fc,copy", [("fc1", False), ("fc1", True), ("fc2", False)])
def test_gpu_fp8_place_is_bit_identical(model, fc, copy):
    """The drop runner's checks: the placing GEMM (quantising, or copying the token-order rows) twice in
    a row into poisoned outputs, A and scales, each bit-identical to the quantiser's rows + the plain
    GEMM, A and scales as the reference quantiser writes them, the sync buffer back to zero; uniform /
    skewed, 4096 / few / one token."""
    _needs_sm90()
    from sm90_megamoe import fp8_place_runner as r
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    h, i, E = r.MODELS[model][:3]
    act, n, k = ("swiglu", 2 * i, h) if fc == "fc1" else ("identity", h, i)
    kw = r._layer_kw(act, k)
    plain = CompiledFp8Gemm(act, n, k, E, fc == "fc2", **kw)
    placing = CompiledFp8Gemm(act, n, k, E, fc == "fc2", **kw, place_a=True, place_gather=fc == "fc1",
                              place_copy=copy)
    ctas = r.max_active_ctas(2)
    for kind, tokens in r.CHECKS:
        p = r.Problem(model, fc, kind, tokens or 4096, seed=5 + tokens)
        assert r.check(p, plain, placing, ctas), (kind, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("switch,value,other,T", [
    ("MOE_EP_FP8_PLACE_FC1", "quant", "0", 1), ("MOE_EP_FP8_PLACE_FC1", "quant", "0", 700),
    ("MOE_EP_FP8_PLACE_FC1", "copy", "0", 0), ("MOE_EP_FP8_PLACE_FC1", "copy", "0", 1),
    ("MOE_EP_FP8_PLACE_FC1", "copy", "0", 700),
    ("MOE_EP_FP8_PLACE_FC2", "1", "0", 1), ("MOE_EP_FP8_PLACE_FC2", "1", "0", 700),
    ("MOE_EP_FP8_PLACE_FC1", "copy", "1", 700),  # both GEMMs placing, against FC2 placing alone
])
def test_fp8_place_layer_is_bit_identical(monkeypatch, switch, value, other, T):
    """The placement switches: the Qwen3 FP8 layer's output is the same bits with ``switch`` at "0" and
    at ``value`` (the other switch at ``other``), eager and CUDA graph, and check_errors() finds no
    placement timeout."""
    _needs_sm90()
    from moe_ep.api import MoEConfig
    from moe_oracle import fp8_layer_inputs, layer_outputs_with_switch

    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    inputs = fp8_layer_inputs(QWEN["num_experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"], T, 90 + T)
    fc1_switch = switch.endswith("FC1")
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC2" if fc1_switch else "MOE_EP_FP8_PLACE_FC1", other)

    def check(impl, on):
        fc1 = (value if on else "") if fc1_switch else ("" if other == "0" else other)
        fc2 = (on if not fc1_switch else other == "1")
        assert (impl.place_fc1, impl.place_fc2) == (fc1, fc2)
        assert set(impl._fp8_place_syncs) == {n for n, p in (("FC1", fc1), ("FC2", fc2)) if p}

    outs = layer_outputs_with_switch(monkeypatch, switch, cfg, "sm90_fp8_cutedsl", inputs, check,
                                     values=("0", value))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
