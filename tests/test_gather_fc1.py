"""Drop v23's BF16 grouped GEMM that gathers its A rows by index (sm90_megamoe.grouped_gemm_gather)
and the BF16 backend's MOE_EP_GATHER_FC1=1 path: FC1 reads grouped row r from the caller's token
idx[r], so step 2 copies no rows. CPU: compile (cp.async passes, mbarrier arrivals, no spills),
refusals, which configs gather, the backend's wiring; GPU: bit identity with the plain kernel on
the gathered rows (and float64), and the layer's output with the switch on and off."""

import functools
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass")

from moe_oracle import kernel_once  # noqa: E402
from recorders import rec_gemm, rec_layout  # noqa: E402
from moe_ep.shim import drop_src, register_drop  # noqa: E402

SRC = drop_src("sm90", "megamoe")
register_drop(SRC)


@pytest.mark.parametrize("act,n,k,experts,bias,schedule", [
    ("swiglu", 1536, 2048, 128, None, "cooperative"),            # Qwen3 FC1
    ("clamped_swiglu", 5760, 2880, 128, "bfloat16", "cooperative"),  # gpt-oss FC1 with a bias
    ("swiglu", 28672, 4096, 8, None, "wide"),                     # Mixtral FC1, one-WGMMA schedule
])
def test_bf16_gather_compiles(act, n, k, experts, bias, schedule, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch
    from sm90_megamoe.swapab_runner import ptxas_info

    ptx = compile_for_arch(act, n, k, False, num_experts=experts, bias_dtype=bias, raster_m=16, schedule=schedule,
                           gather_a=True).__ptx__
    assert re.findall(r"wgmma\.mma_async[\w.]*", ptx) and "cp.async.bulk.tensor" in ptx  # B still by TMA
    # eight 16-byte copies per thread and k-tile, 16 rows x 128 bytes apart (eight lanes per row)
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[(%r\d+)(?:\+(\d+))?\], \[[^]]+\], 16, 16;", ptx)
    assert copies and len(copies) % 8 == 0
    assert [int(o or 0) for _, o in copies[:8]] == [2048 * i for i in range(8)], copies[:8]
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx and "ld.local" not in ptx
    info = ptxas_info(ptx)
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0, info


def test_bf16_gather_refusals():
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="not 'pingpong'"):
        GroupedGemmGatherSm90("swiglu", tile_n=64, schedule="pingpong")
    with pytest.raises(ValueError, match="swapab"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, schedule="swapab", gather_a=True, compiled=object())
    fn = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, gather_a=True, compiled=object())
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="idx is required"):
        fn(z, z, z, out=z)
    from moe_ep.shim import sm90_compiled_grouped_gemm

    with pytest.raises(ValueError, match="K % 64"):
        sm90_compiled_grouped_gemm("swiglu", 1536, 2056, 128, gather_a=True)


def test_which_layers_gather(monkeypatch):
    """Only one rank with LocalRoute, the 128-row FC1 (capacity above the decode kernels) and
    hidden % 64 == 0; the decode FC1 never gathers."""
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs

    cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=8192)
    assert "gather_a" not in _gemm_specs(cfg, 128, 1)["fc1"]  # off by default
    monkeypatch.setenv("MOE_EP_GATHER_FC1", "1")
    specs = _gemm_specs(cfg, 128, 1)
    assert specs["fc1"]["gather_a"] and "gather_a" not in specs["fc1_decode"] and "gather_a" not in specs["fc2"]
    assert "gather_a" not in _gemm_specs(cfg, 64, 2)["fc1"]  # two ranks: dispatch, no LocalRoute
    small = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=128)
    assert "gather_a" not in _gemm_specs(small, 128, 1)["fc1"]  # decode-sized layer: swap-AB FC1
    monkeypatch.setenv("MOE_EP_LOCAL_ROUTE", "0")
    assert "gather_a" not in _gemm_specs(cfg, 128, 1)["fc1"]


def test_bf16_gather_wiring_on_cpu():
    """Steps 2-4 with a gathering FC1 (recorded, no kernel runs): LocalRoute writes no grouped rows,
    FC1 gets the caller's x and idx, FC2 as usual; the layer keeps no reference to x afterwards."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    calls = []

    rec = functools.partial(rec_gemm, calls)

    b = object.__new__(Sm90CuteDSLBackend)
    t = {n: torch.zeros(4) for n in ("offsets", "idx", "ws_rows", "pos", "xs", "h", "y")}
    x, ids, w = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    b.local_route, b.token_grid, b._routing = True, False, None
    b.fc1_decode = b.fc2_decode = None
    b.fc1, b.fc2 = rec("fc1", gather_a=True), rec("fc2", gather_a=False)
    b.layout = rec_layout(calls)
    b.ws = SimpleNamespace(seq=0)
    b.ep = SimpleNamespace(dispatch=lambda *a, **k: calls.append(("dispatch", a, k)))
    for n in ("offsets", "idx", "ws_rows", "pos", "xs", "h", "y"):
        setattr(b, n, t[n])
    b.num_ctas, b.local_combine = 7, False
    b._prepare_launches()  # what bind does once the buffers are set
    b._step1_dispatch(x, ids, w)
    b._step2_layout()
    b._step34_experts("w13", "w2")
    assert [c[0] for c in calls] == ["route", "fc1", "fc2"]
    assert calls[0][1][-1] is None  # no grouped rows copied
    (fa, fk) = calls[1][1:]
    assert fa[0] is x and fa[1] == "w13" and fk["idx"] is t["idx"] and fk["out"] is t["h"]
    assert calls[2][1][0] is t["h"] and calls[2][2]["out"] is t["y"]
    assert b._fc1_src is None and b._routing is None


def test_bf16_gather_split_dispatch_copies_rows_on_cpu():
    """dispatch() of the split pair with a gathering FC1 (recorded, no kernel runs): its caller
    reads ``xs``, so LocalRoute copies the grouped rows into it (forward's step 2 copies none)."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    calls = []
    b = object.__new__(Sm90CuteDSLBackend)
    x, ids, w = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)
    b._ensure = lambda: None
    b.local_route, b.token_grid, b._routing, b.fc1_decode, b.fc2_decode = True, False, None, None, None
    b.fc1 = SimpleNamespace(gather_a=True, prepare=lambda *a, **k: None)
    b.fc2 = SimpleNamespace(gather_a=False, prepare=lambda *a, **k: None)
    b.layout = rec_layout(calls)
    b.ws, b.ep = SimpleNamespace(seq=0), SimpleNamespace()
    for n in ("offsets", "idx", "ws_rows", "pos", "xs", "h"):
        setattr(b, n, torch.zeros(4))
    b.local_combine, b.y, b.num_ctas = False, b.xs, 7
    b._prepare_launches()  # what bind does once the buffers are set
    recv, offs, state = b.dispatch(x, ids, w)
    assert recv is b.xs and offs is b.offsets and state.num_tokens == 3
    assert [c[0] for c in calls] == ["route"] and calls[0][1][-1] is b.xs
    assert b._fc1_src is None and not b._split_rows
    b._step1_dispatch(x, ids, w)
    b._step2_layout()  # forward's step 2: FC1 gathers, no rows copied
    assert calls[-1][1][-1] is None and b._fc1_src is x


@pytest.mark.gpu
@pytest.mark.parametrize("schedule,bias", [("cooperative", None), ("wide", None), ("cooperative", "float32")])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_gpu_bf16_gather_is_bit_identical(routing, schedule, bias):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from sm90_megamoe.grouped_gemm_runner import make_inputs
    from sm90_megamoe.launch import get_grouped_gemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E, m_total, t_src, n, k = 16, 5000, 700, 1536, 2048
    a_all, b, offs, _, bs = make_inputs(m_total, n, k, E, "swiglu", routing, False, seed=41, bias_dtype=bias)
    src = a_all[:t_src].contiguous()
    idx = torch.randint(0, t_src, (m_total,), generator=torch.Generator().manual_seed(3), dtype=torch.int32).cuda()
    a = src[idx.long()].contiguous()
    plain = get_grouped_gemm("swiglu", n, k, E, bias_dtype=bias, raster_m=16, schedule=schedule)
    from sm90_megamoe.launch import CompiledGroupedGemm

    gath = kernel_once(CompiledGroupedGemm, "swiglu", n, k, E, False, bias_dtype=bias, raster_m=16,
                       schedule=schedule, gather_a=True)
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    plain(a, b, offs, out=outs[0], bias=bs)
    gath(src, b, offs, out=outs[1], bias=bs, idx=idx)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])
    want = grouped_gemm_reference(a, b, offs, "swiglu", None, bias=bs)
    assert float((outs[1].float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 4096])
def test_gather_fc1_layer_is_bit_identical(monkeypatch, T):
    """MOE_EP_GATHER_FC1=1: the layer's output is the same bits as without, eager and CUDA graph."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T)

    def check(impl, on):
        assert impl.fc1.gather_a == on

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_GATHER_FC1", cfg, "sm90_bf16_cutedsl",
                                     inputs, check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
