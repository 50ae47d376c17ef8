"""Drop v92's FP8 GEMM that places its own A rows (sm90_megamoe.fp8_gemm_place) and the FP8 backend's
MOE_EP_FP8_PLACE_FC1=copy: step 3 quantises each received token once, in token order, and FC1's three
spare producer warps copy grouped row r (token idx[r]'s E4M3 row and its scales) while the GEMM
runs; each tile's TMA warp waits (acquire, then a proxy fence) for its m-tile's rows. (Drop v93
removed v92's quantising placements, MOE_EP_FP8_PLACE_FC1=quant and MOE_EP_FP8_PLACE_FC2: both
raise now.) CPU: the PTX of the layer's schedules (the wait before the first TMA load, the release
after the copied stores, the plain kernel's WGMMAs), no spills, refusals, the sync buffer's size, the shim's key, the
switch, the backend's wiring and its error check. GPU: the same bits as the plain GEMM on the
reference quantiser's rows, A and its scales as that quantiser writes them, the sync buffer clean
after each launch, and the layer's output with the switch on and off (eager and CUDA graph)."""

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
# (N, K, E, the layer's FC1 schedule): Qwen3's (staged scales), Mixtral's (scales by TMA)
SHAPES = [
    (1536, 2048, 128, dict(Q1, smem_scales=True)),
    (28672, 4096, 8, dict(Q1, unit_scales=True)),
]


def wgmmas(ptx: str) -> list:
    return re.findall(r"wgmma\.mma_async[\w.]*", ptx)


def check_placing_ptx(ptx: str, plain: str, regs: tuple) -> None:
    """``ptx`` (the placing kernel) against ``plain`` (the same GEMM without placement): the same
    WGMMAs; the TMA warp's acquire-spin on the m-tile's counter (bounded by %globaltimer, giving up
    once another tile has timed out), then a proxy fence, then A's TMA loads (2-d); the copy warps'
    16-byte loads and stores, a fence per lane and the count released by lane 0; ``regs`` = (producer,
    consumers) per thread by setmaxnreg; no local memory; none of this in the plain kernel; no spills
    (local ptxas; skips without it)."""
    from sm90_megamoe.swapab_runner import ptxas_info

    assert wgmmas(ptx) == wgmmas(plain) and wgmmas(ptx)
    spin = ptx.index("ld.acquire.gpu.global.b32")
    assert spin < ptx.index("fence.proxy.async.global") < ptx.index("cp.async.bulk.tensor.2d")
    assert "%globaltimer" in ptx and "ld.relaxed.gpu.global.b32" in ptx
    assert "fence.acq_rel.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx
    assert re.search(r"ld\.global\.v4\.(b32|u32)", ptx) and re.search(r"st\.global\.v4\.(b32|u32)", ptx)
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{regs[0]};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{regs[1]};" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "fence.proxy.async.global" not in plain and "red.release.gpu" not in plain
    info = ptxas_info(ptx)
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0, info


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


def _ptx(kernel, fake, tmp_path, monkeypatch) -> str:
    import cutlass.cute as cute

    monkeypatch.chdir(tmp_path)  # --keep-ptx writes into the working directory
    return cute.compile(kernel, *fake, options="--gpu-arch sm_90a --keep-ptx").__ptx__


@pytest.mark.parametrize("n,k,experts,kw", SHAPES)
def test_fp8_place_compiles(n, k, experts, kw, tmp_path, monkeypatch):
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_gemm_place import Fp8PlaceGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args, fake_place_args

    plain = _ptx(Fp8BlockScaledGroupedGemmSm90("swiglu", **kw), fake_args(experts, n, k, "swiglu"), tmp_path,
                 monkeypatch)
    ptx = _ptx(Fp8PlaceGroupedGemmSm90("swiglu", **kw), fake_place_args(experts, n, k, "swiglu"), tmp_path,
               monkeypatch)
    assert "e4m3.e4m3" in wgmmas(ptx)[0]
    assert "cvt.rn.satfinite.e4m3x2" not in ptx  # copies only: no quantiser arithmetic
    check_placing_ptx(ptx, plain, regs=(40, 232))  # the plain FP8 kernel's register split


def test_fp8_place_chunk_rows():
    """A claimed chunk holds 16 KB of e4m3 rows (a power of 2 of rows, at most 32)."""
    from sm90_megamoe.fp8_gemm_place import default_chunk_rows

    assert [default_chunk_rows(k) for k in (768, 2048, 4096, 7168, 14336, 256)] == [16, 8, 4, 2, 1, 32]


def test_fp8_place_refusals():
    from sm90_megamoe.fp8_gemm_place import Fp8PlaceGroupedGemmSm90
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    with pytest.raises(ValueError, match="no scale_warp"):
        Fp8PlaceGroupedGemmSm90("identity", smem_scales=True, scale_warp=True, overlap_promotion=True)
    for bad in (dict(place_chunk_rows=3), dict(place_unroll=3), dict(place_unroll=16)):
        with pytest.raises(ValueError, match="place_chunk_rows must be"):
            Fp8PlaceGroupedGemmSm90("swiglu", **bad)
    assert Fp8PlaceGroupedGemmSm90("swiglu", place_unroll=8).place_unroll == 8
    for gone in (dict(place_mode="quant"), dict(place_gather=False), dict(place_vals=16)):  # drop v93
        with pytest.raises(TypeError):
            Fp8PlaceGroupedGemmSm90("swiglu", **gone)
    with pytest.raises(TypeError):
        CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=object(), place_a=True, place_copy=True)
    with pytest.raises(ValueError, match="place_a does not combine with scale_warp"):
        CompiledFp8Gemm("identity", 2048, 768, 128, True, compiled=object(), smem_scales=True, scale_warp=True,
                        place_a=True)
    fc1 = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=object(), place_a=True)
    plain = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=object())
    z, i = torch.zeros(1), torch.zeros(5, dtype=torch.int32)
    q1, s1 = torch.zeros(3, 2048, dtype=torch.uint8), torch.zeros(3, 16)
    every = "x, idx, sync and x_scale are required with place_a=True and refused without it"
    for missing in ("x", "idx", "sync", "x_scale"):
        args = {n: v for n, v in dict(x=q1, idx=i, sync=i, x_scale=s1).items() if n != missing}
        with pytest.raises(ValueError, match=every):
            fc1(z, z, z, z, z, z, z, **args)
    with pytest.raises(ValueError, match=every):
        plain(z, z, z, z, z, z, z, x=q1, sync=i)
    with pytest.raises(ValueError, match="sync must be a 1-d int32 tensor of S \\+ 4"):
        fc1(z, z, z, z, z, z, z, x=q1, idx=i, sync=torch.zeros(5), x_scale=s1)
    with pytest.raises(ValueError, match="idx must be a 1-d int32 tensor"):
        fc1(z, z, z, z, z, z, z, x=q1, idx=torch.zeros(5, dtype=torch.int64), sync=i, x_scale=s1)
    with pytest.raises(ValueError, match=r"x must be a torch.float8_e4m3fn \(or uint8\) \[T, 2048\]"):
        fc1(z, z, z, z, z, z, z, x=torch.zeros(3, 2048, dtype=torch.bfloat16), idx=i, sync=i, x_scale=s1)
    with pytest.raises(ValueError, match=r"x_scale must be a float32 \[T, 16\]"):
        fc1(z, z, z, z, z, z, z, x=q1, idx=i, sync=i, x_scale=torch.zeros(3, 8))
    # prepared launches: every placement argument fixed at prepare (drop v95: no source rows per call)
    launched = []
    fc1_ffi = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=lambda *a: launched.append(a), tvm_ffi=True,
                              place_a=True)
    fc1_ffi._max_ctas = 132
    a, a_s = torch.zeros(8, 2048, dtype=torch.uint8), torch.zeros(8, 16)
    off, out, rs = torch.zeros(129, dtype=torch.int32), torch.zeros(8, 768), torch.zeros(1)
    for missing in ("x", "idx", "sync", "x_scale"):
        args = {n: v for n, v in dict(x=q1, idx=i, sync=i, x_scale=s1).items() if n != missing}
        with pytest.raises(ValueError, match=every):
            fc1_ffi.prepare(a, a_s, off, out, rs, 7, **args)
    assert launched == []
    run = fc1_ffi.prepare(a, a_s, off, out, rs, 7, x=q1, idx=i, sync=i, x_scale=s1)
    b, b_s = torch.ones(128, 1536, 2048, dtype=torch.uint8), torch.ones(128, 12, 16)
    run(b, b_s)
    with pytest.raises(TypeError):
        run(b, b_s, q1)  # the source rows are the prepared ones
    # the kernel's argument order: x, idx, a, a_scale, sync, x_scale, b, b_scale, out, offsets, row_scale, CTAs
    (args,) = launched
    assert len(args) == 12 and args[6] is b and args[7] is b_s and args[-1] == 7
    fixed = [torch.from_dlpack(t) for t in args[:6] + args[8:11]]
    for got, want in zip(fixed, (q1.view(torch.uint8), i, a, a_s, i, s1, out, off, rs)):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    # a plain GEMM's prepared launch takes no placement
    plain_ffi = CompiledFp8Gemm("swiglu", 1536, 2048, 128, compiled=lambda *a: launched.append(a), tvm_ffi=True)
    plain_ffi._max_ctas = 132
    with pytest.raises(ValueError, match=every):
        plain_ffi.prepare(a, a_s, off, out, rs, 7, idx=i)


def test_fp8_place_shim_key(monkeypatch):
    """The placement is part of the compile key and the disk-cache name; v93's removed kinds and a scale
    warp asked for beside it raise."""
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    plain = s._gemm_key("swiglu", 1536, 2048, 128, False)
    copy = s._gemm_key("swiglu", 1536, 2048, 128, False, place="copy")
    assert plain.place == "" and copy.place == "copy" and plain != copy
    assert dataclasses.replace(copy, place="") == plain  # nothing else differs
    assert s._gemm_options(copy)["place_a"] and "place_a" not in s._gemm_options(plain)
    for gone in ("gather", "rows", "scatter"):
        with pytest.raises(ValueError, match="place must be one of"):
            s._gemm_key("swiglu", 1536, 2048, 128, False, place=gone)
    monkeypatch.setenv("MOE_EP_FP8_SMEM_SCALES", "1")
    monkeypatch.setenv("MOE_EP_FP8_SCALE_WARP", "1")
    with pytest.raises(ValueError, match="has no scale warp"):
        s._gemm_key("identity", 2048, 768, 128, True, place="copy")


def test_fp8_place_switch(monkeypatch):
    from moe_ep.backends.sm90.fp8_cutedsl.backend import place_fc1
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    assert place_fc1(1) is False  # off by default
    for raw, want in (("0", False), ("copy", True), ("", False)):
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", raw)
        assert place_fc1(1) is want and place_fc1(4) is want
    # drop v93's removals: the quantising FC1 names its drop; FC2's switch raises where GEMMs are built
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "quant")
    with pytest.raises(ValueError, match=r"MOE_EP_FP8_PLACE_FC1='quant': drop v93 removed .*use one of 0, copy"):
        place_fc1(1)
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "1")
    with pytest.raises(ValueError, match="MOE_EP_FP8_PLACE_FC1 must be one of 0, copy"):
        place_fc1(1)
    monkeypatch.delenv("MOE_EP_FP8_PLACE_FC1")
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC2", "1")
    with pytest.raises(ValueError, match=r"MOE_EP_FP8_PLACE_FC2='1': drop v93 removed"):
        s._gemm_key("identity", 2048, 768, 128, True)
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC2", "0")
    s._gemm_key("identity", 2048, 768, 128, True)
    monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", "copy")
    monkeypatch.setenv("MOE_EP_FP8_WIRE", "1")
    assert place_fc1(1) is True  # one rank: no wire
    with pytest.raises(ValueError, match="MOE_EP_FP8_WIRE=1 sends it quantised"):
        place_fc1(2)
    monkeypatch.delenv("MOE_EP_FP8_WIRE")
    monkeypatch.setenv("MOE_EP_FP8_FUSED_GATHER", "0")
    with pytest.raises(ValueError, match="needs the fused gather"):
        place_fc1(1)


def test_fp8_prebuild_builds_the_placing_gemm(monkeypatch):
    """prebuild with the switch: the copying FC1 and the token-order quantiser (top-k 1) before it."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.fp8_cutedsl import backend as fb

    built = []
    monkeypatch.setattr(fb, "sm90_compiled_fp8_gemm", lambda *a, **k: built.append(("gemm", a[0], k["place"])))
    monkeypatch.setattr(fb, "sm90_compiled_fp8_quantize_rows",
                        lambda k, **kw: built.append(("quant", k, kw["scatter_topk"])))
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    for fc1, want in (
            ("0", [("gemm", "swiglu", ""), ("quant", 2048, 8), ("gemm", "identity", ""), ("quant", 768, 0)]),
            ("copy", [("gemm", "swiglu", "copy"), ("quant", 2048, 1), ("gemm", "identity", ""), ("quant", 768, 0)])):
        monkeypatch.setenv("MOE_EP_FP8_PLACE_FC1", fc1)
        built.clear()
        fb.prebuild(cfg, 1, kernels=("fc1", "fc2"))
        assert built == want, fc1


def _rec_fp8_gemm(calls, name, place_a=False):
    """A recording stand-in for an FP8 GEMM launcher: ``prepare`` returns a run that records what
    the launch would get."""
    def prepare(self, a, a_scale, offsets, out, row_scale, max_active_ctas=None, x=None, idx=None, sync=None,
                x_scale=None):
        def run(b, b_scale):
            calls.append((name, dict(a=a, b=b, x=x, idx=idx, sync=sync, out=out, x_scale=x_scale)))
        return run
    return type(name, (), {"prepare": prepare, "place_a": place_a})()


def _rec_quant(calls, name):
    def prepare(self, q, scale, **kw):
        return lambda x: calls.append((name, dict(x=x, q=q, **kw)))
    return type(name, (), {"prepare": prepare})()


@pytest.mark.parametrize("fc1", [False, True])
def test_fp8_place_wiring_on_cpu(fc1):
    """Steps 3-4 (recorded, no kernel runs): FC1 copying gets the token-order rows and scales the top-1
    quantiser writes (slot s into row s), idx and its sync buffer; otherwise the scattering quantiser
    and the plain FC1; FC2 and its quantiser as always."""
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    calls = []
    b = object.__new__(Sm90Fp8Backend)
    names = ("xq", "xq_scale", "hq", "hq_scale", "offsets", "idx", "ws_rows", "pos", "h", "y", "xs", "_rows",
             "xq_tok", "sx_tok", "_tok_pos")
    t = {n: torch.zeros(4) for n in names}
    for n in names:
        setattr(b, n, t[n])
    b.place_fc1, b.fp8_wire, b.fused_gather, b.scatter_quant = fc1, False, True, not fc1
    b.fc1, b.fc2 = _rec_fp8_gemm(calls, "fc1", fc1), _rec_fp8_gemm(calls, "fc2")
    b.quant_x, b.quant_h = _rec_quant(calls, "quant_x"), _rec_quant(calls, "quant_h")
    b.ep = SimpleNamespace(bufs=SimpleNamespace(recv_count=torch.zeros(1)))
    b.dims = SimpleNamespace(max_tokens=4)
    b.num_ctas = 7
    b._fp8_place_syncs = {"FC1": torch.zeros(9, dtype=torch.int32)} if fc1 else {}
    b._prepare_expert_launches()
    x = torch.zeros(3, 4)
    b._x_rows = x
    w13, w2 = SimpleNamespace(values="v13", scale="s13"), SimpleNamespace(values="v2", scale="s2")
    b._step34_experts(w13, w2)
    assert [c[0] for c in calls] == ["quant_x", "fc1", "quant_h", "fc2"]
    got = dict(calls)
    assert got["fc1"]["b"] == "v13" and got["fc1"]["out"] is t["h"] and got["fc2"]["out"] is t["y"]
    assert got["fc1"]["a"] is t["xq"] and got["fc2"]["a"] is t["hq"] and got["quant_x"]["x"] is x
    if fc1:
        assert got["quant_x"]["q"] is t["xq_tok"] and got["quant_x"]["pos"] is t["_tok_pos"]
        assert got["fc1"]["x"] is t["xq_tok"] and got["fc1"]["x_scale"] is t["sx_tok"]
        assert got["fc1"]["idx"] is t["idx"] and got["fc1"]["sync"] is b._fp8_place_syncs["FC1"]
    else:
        assert got["quant_x"]["q"] is t["xq"] and got["quant_x"]["pos"] is t["pos"]
        assert got["fc1"]["x"] is None and got["fc1"]["sync"] is None
    assert got["quant_h"]["x"] is t["h"] and got["fc2"]["x"] is None and got["fc2"]["sync"] is None
    assert b._x_rows is None


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


def test_fp8_placement_timeout_is_raised_by_check():
    """check(): the placing FC1's error word (1 + the m-tile) raises once, naming the GEMM and the switch,
    and its counters are zeroed; a clean buffer passes."""
    from moe_ep.backends.sm90.fp8_cutedsl.backend import Sm90Fp8Backend

    b = object.__new__(Sm90Fp8Backend)
    b._fp8_place_syncs = {"FC1": torch.zeros(9, dtype=torch.int32)}
    b._check_placement()
    b._fp8_place_syncs["FC1"][2], b._fp8_place_syncs["FC1"][-1] = 1, 4
    with pytest.raises(RuntimeError, match=r"FC1 \(MOE_EP_FP8_PLACE_FC1\) timed out at m-tile 3"):
        b._check_placement()
    assert not bool(b._fp8_place_syncs["FC1"].any())
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
def test_gpu_fp8_place_is_bit_identical(model):
    """The drop runner's checks: the copying FC1 twice in a row into poisoned outputs, A and scales,
    each bit-identical to the plain GEMM on the reference quantiser's rows, A and scales as that
    quantiser writes them, the sync buffer back to zero; uniform / skewed, 4096 / few / one token."""
    _needs_sm90()
    from sm90_megamoe import fp8_place_runner as r
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    h, i, E = r.MODELS[model][:3]
    kw = {x: v for x, v in r._layer_kw("swiglu", h).items() if x != "scale_warp"}
    plain = CompiledFp8Gemm("swiglu", 2 * i, h, E, False, **kw)
    placing = CompiledFp8Gemm("swiglu", 2 * i, h, E, False, **kw, place_a=True)
    ctas = r.max_active_ctas(2)
    for kind, tokens in r.CHECKS:
        p = r.Problem(model, kind, tokens or 4096, seed=5 + tokens)
        assert r.check(p, plain, placing, ctas), (kind, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [0, 1, 700])
def test_fp8_place_layer_is_bit_identical(monkeypatch, T):
    """MOE_EP_FP8_PLACE_FC1: the Qwen3 FP8 layer's output is the same bits at "0" and "copy", eager and
    CUDA graph, and check_errors() finds no placement timeout."""
    _needs_sm90()
    from moe_ep.api import MoEConfig
    from moe_oracle import fp8_layer_inputs, layer_outputs_with_switch

    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    inputs = fp8_layer_inputs(QWEN["num_experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"], T, 90 + T)

    def check(impl, on):
        assert impl.place_fc1 is on and set(impl._fp8_place_syncs) == ({"FC1"} if on else set())

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FP8_PLACE_FC1", cfg, "sm90_fp8_cutedsl", inputs, check,
                                     values=("0", "copy"))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
