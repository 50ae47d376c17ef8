"""Drop v46: the BF16 grouped GEMM's half tiles (``half_tiles``): a cooperative tile whose rows all
lie in its first 64 (an expert's last m-tile with <= 64 rows; Qwen3 at 8192 tokens has ~60 of them)
is split along N, each consumer warpgroup taking rows 0-63 and half of the columns, instead of one
warpgroup multiplying rows past the expert. CPU: the PTX holds both WGMMA widths and no spills,
the refusals, the shim's switch and key. GPU: the same bits as whole tiles (NaN-poisoned outputs)
on a layer's routing, skewed, tiny and exactly-64-row experts, a float64 reference, and the layer
with ``MOE_EP_HALF_TILES=0`` against ``1`` (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe.grouped_gemm import GroupedGemmSm90  # noqa: E402
from moe_oracle import require_sm90  # noqa: E402


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,kw,widths", [
    ("swiglu", 1536, 2048, {}, {"64", "128"}),                        # Qwen3 FC1: gate + up, tile 128
    ("identity", 2048, 768, dict(scale_rows=True), {"128", "256"}),   # Qwen3 FC2: tile 256, router weights
    ("clamped_swiglu", 5760, 2880, dict(has_bias=True), {"64", "128"}),  # gpt-oss: ragged I, bias
])
def test_half_tile_ptx_has_both_wgmma_widths(act, n, k, kw, widths):
    import cutlass.cute as cute
    from sm90_megamoe.compile_check import fake_args
    from sm90_megamoe.layout_compile_check import ptxas_info

    kernel = GroupedGemmSm90(act, half_tiles=True, **kw)
    ptx = cute.compile(kernel, *fake_args(kernel, 128, n, k), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    assert set(re.findall(r"wgmma\.mma_async\.[^ ]*\.m64n(\d+)k16", ptx)) == widths
    plain = GroupedGemmSm90(act, **kw)
    ptx0 = cute.compile(plain, *fake_args(plain, 128, n, k), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    assert set(re.findall(r"wgmma\.mma_async\.[^ ]*\.m64n(\d+)k16", ptx0)) == {max(widths, key=int)}
    assert "ld.local" not in ptx and "st.local" not in ptx
    info = ptxas_info(ptx, "sm_90a")
    if info is not None:
        assert info[1] == 0, info  # no spills


def test_half_tile_refusals():
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90

    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmSm90("identity", tile_n=128, schedule="pingpong", half_tiles=True)
    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmSm90("swiglu", tile_n=128, schedule="wide", half_tiles=True)
    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmSm90("swiglu", cluster_m=2, half_tiles=True)
    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmSm90("swiglu", tile_n=64, half_tiles=True)  # halves narrower than an epilogue chunk
    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmSm90("identity", epilogue="direct", half_tiles=True)
    with pytest.raises(ValueError, match="half_tiles needs"):
        GroupedGemmGatherSm90("swiglu", half_tiles=True)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_HALF_TILES", raising=False)
    assert not s.use_half_tiles("cooperative", 128, False, 1)  # opt-in (slower on the H200)
    monkeypatch.setenv("MOE_EP_HALF_TILES", "1")
    assert s.use_half_tiles("cooperative", 128, False, 1) and s.use_half_tiles("cooperative", 256, False, 1)
    assert not s.use_half_tiles("cooperative", 64, False, 1)
    assert not s.use_half_tiles("pingpong", 128, False, 1) and not s.use_half_tiles("wide", 128, False, 1)
    assert not s.use_half_tiles("swapab", 32, False, 1)
    assert not s.use_half_tiles("cooperative", 128, True, 1) and not s.use_half_tiles("cooperative", 128, False, 2)
    monkeypatch.setenv("MOE_EP_HALF_TILES", "0")
    assert not s.use_half_tiles("cooperative", 128, False, 1)
    assert s.GemmKey.__dataclass_fields__["half_tiles"].default is False


def test_runner_topk8_routing_has_half_tails():
    from sm90_megamoe.grouped_gemm_runner import make_offsets

    offs = make_offsets(65536, 128, "topk8", torch.Generator().manual_seed(1))
    counts = offs.diff()
    assert int(offs[-1]) == 65536 and int(counts.min()) >= 0
    tails = counts % 128
    assert int(((tails > 0) & (tails <= 64)).sum()) > 20  # many experts end in a half tile


# ---------------------------------------------------------------------------- GPU
def _offsets(counts):
    offs = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(counts), 0)
    return offs.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["topk8", "skewed", "edges"])
@pytest.mark.parametrize("act,n,k,kw", [
    ("swiglu", 1536, 2048, {}),                                         # Qwen3 FC1
    ("identity", 2048, 768, dict(scale_rows=True)),                     # Qwen3 FC2, router weights
    ("clamped_swiglu", 5760, 2880, dict(bias_dtype="float32")),         # ragged I, bias
    ("identity", 1024, 1024, dict(bias_dtype="bfloat16")),              # non-gated bias
])
def test_gpu_half_tiles_are_bit_identical(act, n, k, kw, routing):
    """Half tiles give the whole-tile kernel's bits (same k order per element), write every row
    (NaN-poisoned outputs) and agree with a float64 computation."""
    require_sm90()
    from sm90_megamoe.grouped_gemm_runner import make_offsets
    from sm90_megamoe.launch import get_grouped_gemm  # cached per variant across the routings
    from sm90_megamoe.reference import grouped_gemm_reference

    E = 16
    if routing == "edges":  # 0, 1, 63, 64, 65, 127, 128, 129, 191, 192 rows and two 64 + 128 k
        counts = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 0, 64 + 128, 64 + 256, 2, 0, 17]
        offs = _offsets(counts)
    else:
        m = {"topk8": 16 * 200, "skewed": 3001}[routing]
        offs = make_offsets(m, E, routing, torch.Generator().manual_seed(7))
    m_total = int(offs[-1])
    g = torch.Generator(device="cuda").manual_seed(11)
    amp = 4.0 if act == "clamped_swiglu" else 0.5
    a = (torch.randn(m_total, k, device="cuda", generator=g) * amp).to(torch.bfloat16)
    b = (torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    rs = torch.rand(m_total, device="cuda", generator=g) if kw.get("scale_rows") else None
    bd = kw.get("bias_dtype")
    bias = None if bd is None else (torch.randn(E, n, device="cuda", generator=g) * amp).to(getattr(torch, bd))
    offs = offs.cuda()
    n_out = n // 2 if act != "identity" else n
    outs = []
    for half in (False, True):
        fn = get_grouped_gemm(act, n, k, E, scale_rows=rs is not None, bias_dtype=bd, half_tiles=half)
        assert fn.half_tiles == half
        out = torch.full((m_total, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs, out=out, row_scale=rs, bias=bias)
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[1]).any()), "rows left unwritten (NaN poison survived)"
    assert torch.equal(outs[0], outs[1])
    want = grouped_gemm_reference(a.double(), b.double(), offs, act, None if rs is None else rs.double(),
                                  bias=None if bias is None else bias.double()).double()
    got = outs[1].double()
    assert float((got - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 333, 4096])
def test_gpu_layer_with_half_tiles_is_bit_identical(monkeypatch, T):
    """MOE_EP_HALF_TILES=1 (opt-in) gives the default's bits (=0), eager and replayed from a poisoned
    CUDA graph."""
    require_sm90()
    from moe_oracle import layer_outputs_with_switch

    from moe_ep.api import MoEConfig

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=4096)
    g = torch.Generator().manual_seed(1900 + T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    ids, w = ids.to(torch.int32).cuda(), (w / w.sum(-1, keepdim=True)).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16).cuda()

    def check(impl, on):
        for gemm in (impl.fc1, impl.fc2):
            if gemm.compiled.schedule == "cooperative":
                assert gemm.compiled.half_tiles == on

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_HALF_TILES", cfg, "sm90_bf16_cutedsl",
                                     (x, ids, w, w13, w2), check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
