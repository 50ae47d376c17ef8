"""Drop v52: the BF16 swiglu GEMM (FC1) takes its sigmoid from one ``tanh.approx``
(``tanh_sigmoid=True``: silu(g) = h + h tanh(h), h = g / 2; one MUFU op per output instead of
``ex2`` + ``rcp``) in every schedule -- cooperative, wide, gathering, swap-AB -- the shim's
default since the twenty-second session (``MOE_EP_BF16_TANH_SIGMOID=0``: the opt-out).
CPU: the PTX of each schedule (tanh.approx, no ex2 / rcp) and without the flag (ex2, no tanh), the
refusals, the shim's switch, key and kernel name. GPU: each schedule against float64 with the exact
SiLU and against the ``ex2`` + ``rcp`` kernel (NaN-poisoned outputs); the gathering FC1 keeps the
plain one's bits with the flag; the layer with the opt-out against float64 (prefill and decode
shapes) -- the default layer is what test_layer_gpu checks."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import kernel_once  # noqa: E402

QWEN_FC1 = (1536, 2048, 128)  # n = 2 I, k = H, E


def _kernel(**kw):
    """A compiled BF16 swiglu GEMM at Qwen3's FC1 shape with 16 experts, compiled once per variant."""
    from sm90_megamoe.launch import CompiledGroupedGemm

    return kernel_once(CompiledGroupedGemm, "swiglu", 1536, 2048, 16, False, raster_m=16, **kw)


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


# ---------------------------------------------------------------------------- compile (CPU)
def _ptx(schedule: str, tanh: bool) -> str:
    n, k, e = QWEN_FC1
    if schedule == "swapab":
        from sm90_megamoe.swapab_runner import compile_swapab

        return compile_swapab("swiglu", n, k, e, False, 32, tanh_sigmoid=tanh)[1].__ptx__
    from sm90_megamoe.compile_check import compile_for_arch

    return compile_for_arch("swiglu", n, k, False, num_experts=e, raster_m=16, tanh_sigmoid=tanh,
                            schedule="wide" if schedule == "gather" else schedule,
                            gather_a=schedule == "gather").__ptx__


@pytest.mark.parametrize("schedule", ["cooperative", "wide", "gather", "swapab"])
def test_tanh_sigmoid_ptx(schedule):
    ptx, base = _ptx(schedule, True), _ptx(schedule, False)
    assert "tanh.approx.f32" in ptx and "ex2.approx" not in ptx and "rcp.approx" not in ptx
    assert "tanh.approx" not in base and "ex2.approx" in base and "rcp.approx" in base
    # one tanh where there was one ex2: the same outputs per thread
    assert ptx.count("tanh.approx.f32") == base.count("ex2.approx")
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_tanh_sigmoid_refusals():
    from sm90_megamoe.grouped_gemm import GroupedGemmSm90
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.swapab_gemm import SwapABGroupedGemmSm90

    for act in ("identity", "gelu_glu", "clamped_swiglu", "squared_relu"):
        with pytest.raises(ValueError, match="needs activation 'swiglu'"):
            GroupedGemmSm90(act, tanh_sigmoid=True)
        with pytest.raises(ValueError, match="needs activation 'swiglu'"):
            SwapABGroupedGemmSm90(act, tanh_sigmoid=True)
    with pytest.raises(ValueError, match="needs activation 'swiglu'"):  # before compiling anything
        CompiledGroupedGemm("identity", 2048, 768, 8, True, tanh_sigmoid=True)


def test_shim_switch_key_and_name(monkeypatch, tmp_path):
    from moe_ep.shim import COMPILE_EVENTS
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOE_EP_BF16_TANH_SIGMOID", raising=False)
    assert s.use_bf16_tanh_sigmoid("swiglu")  # on by default (twenty-second session)
    monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", "0")
    assert not s.use_bf16_tanh_sigmoid("swiglu")  # the opt-out
    monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", "1")
    assert s.use_bf16_tanh_sigmoid("swiglu")
    monkeypatch.delenv("MOE_EP_BF16_TANH_SIGMOID", raising=False)
    assert not any(s.use_bf16_tanh_sigmoid(a) for a in ("identity", "gelu_glu", "clamped_swiglu", "squared_relu"))
    seen = len(COMPILE_EVENTS)
    on = s.compiled_grouped_gemm("swiglu", 512, 256, 8, schedule="wide")
    assert on.tanh_sigmoid and on.kernel.tanh_sigmoid
    assert [e.name for e in COMPILE_EVENTS[seen:]] == ["gemm_swiglu_tanh"]
    fc2 = s.compiled_grouped_gemm("identity", 256, 256, 8, True)  # FC2 has no sigmoid
    assert not fc2.tanh_sigmoid
    monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", "0")
    off = s.compiled_grouped_gemm("swiglu", 512, 256, 8, schedule="wide")
    assert off is not on and not off.tanh_sigmoid  # another key, another kernel


@pytest.mark.parametrize("switch", [None, "0"])
@pytest.mark.parametrize("gather", ["0", "1"])
def test_every_fc1_a_layer_builds_takes_the_switch(monkeypatch, tmp_path, gather, switch):
    """By default each swiglu GEMM a BF16 layer builds -- the 128-row FC1 (plain or gathering), the
    swap-AB decode FC1 -- takes the tanh, and FC2 does not (no sigmoid); with the opt-out
    (MOE_EP_BF16_TANH_SIGMOID=0) none does: so the layer's kernels that compare bits with one another
    always agree on the form."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.shim import sm90_compiled_grouped_gemm

    monkeypatch.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MOE_EP_GATHER_FC1", gather)
    if switch is None:
        monkeypatch.delenv("MOE_EP_BF16_TANH_SIGMOID", raising=False)
    else:
        monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", switch)
    cfg = MoEConfig(num_experts=16, hidden=256, intermediate=256, top_k=4, max_tokens_per_rank=4096)
    specs = _gemm_specs(cfg, 16, 1)
    assert sorted(specs) == ["fc1", "fc1_decode", "fc2", "fc2_decode"]
    assert specs["fc1"].get("gather_a", False) == (gather == "1")
    built = {name: sm90_compiled_grouped_gemm(**spec) for name, spec in specs.items()}
    assert built["fc1_decode"].schedule == "swapab" and built["fc1"].gather_a == (gather == "1")
    on = switch is None
    assert {name: g.tanh_sigmoid for name, g in built.items()} == {
        "fc1": on, "fc1_decode": on, "fc2": False, "fc2_decode": False}
    assert all(g.kernel.tanh_sigmoid == g.tanh_sigmoid for g in built.values())


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["cooperative", "wide", "swapab"])
@pytest.mark.parametrize("m_total,routing", [(5000, "uniform"), (3001, "skewed"), (1, "skewed")])
def test_gpu_tanh_sigmoid_against_float64(schedule, m_total, routing):
    """Every row written (NaN poison), within 1e-2 of float64 with the exact SiLU, and close to the
    ex2 + rcp kernel (tanh.approx: ~2^-11 relative, under bf16's 2^-8 rounding of the output)."""
    _sm90()
    from sm90_megamoe.grouped_gemm_runner import make_inputs

    n, k, E = 1536, 2048, 16
    a, b, offs, _, _ = make_inputs(m_total, n, k, E, "swiglu", routing, False, seed=m_total)
    outs = []
    for tanh in (False, True):
        fn = _kernel(schedule=schedule, tile_n=32 if schedule == "swapab" else None, tanh_sigmoid=tanh)
        out = torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs, out=out)
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[1]).any()), "rows left unwritten (NaN poison survived)"
    # float64 with the exact SiLU (a different algorithm: dense per-expert matmuls, torch's sigmoid)
    o = offs.cpu().tolist()
    want = torch.empty(m_total, n // 2, dtype=torch.float64)
    for e in range(E):
        h = a[o[e]:o[e + 1]].cpu().double() @ b[e].cpu().double().T
        g, u = h[:, : n // 2], h[:, n // 2:]
        want[o[e]:o[e + 1]] = g * torch.sigmoid(g) * u

    def rel(x, y):
        return float((x.double().cpu() - y).norm() / y.norm().clamp_min(1e-30))

    errs = dict(tanh=rel(outs[1], want), exact=rel(outs[0], want),
                between=rel(outs[1], outs[0].double().cpu()))
    print(f"bf16 tanh_sigmoid {schedule} m={m_total} {routing}: " + ", ".join(f"{a} {v:.2e}" for a, v in errs.items()))
    assert errs["tanh"] < 1e-2 and errs["between"] < 5e-3, errs


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_gpu_gather_keeps_bits_with_tanh_sigmoid(routing):
    """The gathering FC1 (MOE_EP_GATHER_FC1) gives the plain FC1's bits with the flag too."""
    _sm90()
    from sm90_megamoe.grouped_gemm_runner import make_inputs

    E, m_total, t_src, n, k = 16, 5000, 700, 1536, 2048
    a_all, b, offs, _, _ = make_inputs(m_total, n, k, E, "swiglu", routing, False, seed=43)
    src = a_all[:t_src].contiguous()
    idx = torch.randint(0, t_src, (m_total,), generator=torch.Generator().manual_seed(5), dtype=torch.int32).cuda()
    plain = _kernel(schedule="wide", tile_n=None, tanh_sigmoid=True)
    gath = _kernel(schedule="wide", tile_n=None, tanh_sigmoid=True, gather_a=True)
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    plain(src[idx.long()].contiguous(), b, offs, out=outs[0])
    gath(src, b, offs, out=outs[1], idx=idx)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["qwen3", "mixtral"])
def test_gpu_decode_layer_with_exact_sigmoid(monkeypatch, model):
    """MOE_EP_BF16_TANH_SIGMOID=0 (the opt-out; test_layer_gpu checks the default, the tanh): the
    decode layer's float64 test (swap-AB and 128-row kernels, T 0 ... 256, NaN-poisoned outputs)
    holds."""
    _sm90()
    from test_layer_gpu import test_decode_layer_against_float64 as decode_test

    monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", "0")
    decode_test(model)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the prefill FC1 runs
@pytest.mark.parametrize("switch", [None, "0"])
def test_gpu_prefill_layer_tanh_and_exact(monkeypatch, T, switch):
    """The Qwen3 layer (skewed routing) at the default (FC1 takes the tanh) and with the opt-out
    (MOE_EP_BF16_TANH_SIGMOID=0: ex2 + rcp): the output is within 1e-2 of the reference backend, the
    same bits under a CUDA graph, every row written."""
    _sm90()
    from moe_oracle import capture_graph, replay_poisoned
    from test_layer_gpu import QWEN, layers, problem, rel, seed_of

    from moe_ep.api import MoEConfig

    if switch is None:
        monkeypatch.delenv("MOE_EP_BF16_TANH_SIGMOID", raising=False)
    else:
        monkeypatch.setenv("MOE_EP_BF16_TANH_SIGMOID", switch)
    cfg = MoEConfig(max_tokens_per_rank=4096, **QWEN)
    x, ids, w, w13, w2 = problem(T, seed_of("tanh", T), skew=True)
    fast, ref = layers(cfg, "auto", "reference")
    fast.warmup(progress=False)
    assert fast._impl.fc1.compiled.tanh_sigmoid == (switch is None) and not fast._impl.fc2.compiled.tanh_sigmoid
    out = torch.full((T, cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fast.forward(x, ids, w, w13, w2, out=out)
    fast.check_errors()
    assert not fast._impl._decode  # the FC1 checked above is the one that ran
    assert torch.isfinite(got).all() and rel(got, ref.forward(x, ids, w, w13, w2)) < 1e-2
    graph_out = torch.empty_like(out)
    graph = capture_graph(lambda: fast.forward(x, ids, w, w13, w2, out=graph_out), warmup=True)
    replay_poisoned(graph, graph_out, layer=fast)
    assert torch.equal(graph_out, got)
    del graph
    fast.destroy(), ref.destroy()
