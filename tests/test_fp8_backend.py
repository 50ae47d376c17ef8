"""The experimental SM90 FP8 block-scaled backend (``sm90_fp8_cutedsl``): CPU checks (registered
below the reference backend, refusals by name, every kernel compiles without a GPU) and a GPU test
against the reference backend's FP8 semantics (same activation quantisation) and float64."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.api import EPGroup, MoEConfig, MoELayer  # noqa: E402
from moe_ep.backends import UnsupportedBackendError, available, get  # noqa: E402

QWEN = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8)


def test_registered_below_the_reference_backend():
    assert get("sm90_fp8_cutedsl").priority < get("reference").priority
    assert available()[-1] == "sm90_fp8_cutedsl"  # auto never prefers it while unverified
    assert "EXPERIMENTAL" in get("sm90_fp8_cutedsl").description


def test_refusals_name_the_reason():
    from moe_ep.backends.sm90.fp8_cutedsl import check_config

    single = EPGroup.single()
    with pytest.raises(UnsupportedBackendError, match="quant='fp8_block128'"):
        check_config(MoEConfig(max_tokens_per_rank=64, **QWEN), single)
    with pytest.raises(UnsupportedBackendError, match="squared_relu"):
        check_config(MoEConfig(max_tokens_per_rank=64, activation="squared_relu", quant="fp8_block128", **QWEN),
                     single)
    with pytest.raises(UnsupportedBackendError, match="multiple of 128"):
        check_config(MoEConfig(num_experts=8, hidden=2048, intermediate=720, top_k=2, max_tokens_per_rank=64,
                               quant="fp8_block128"), single)
    check_config(MoEConfig(max_tokens_per_rank=64, quant="fp8_block128", **QWEN), single)
    with pytest.raises(UnsupportedBackendError, match="needs a CUDA device"):
        MoELayer(MoEConfig(max_tokens_per_rank=64, quant="fp8_block128", **QWEN), EPGroup.single(),
                 backend="sm90_fp8_cutedsl", device="cpu")


def test_every_kernel_compiles_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
    from moe_ep.backends.sm90.fp8_cutedsl import prebuild
    from moe_ep.shim import COMPILE_EVENTS

    seen = len(COMPILE_EVENTS)
    prebuild(MoEConfig(max_tokens_per_rank=64, quant="fp8_block128", **QWEN), 1, kernels=("fc1", "fc2"))
    names = [e.name for e in COMPILE_EVENTS[seen:]]
    assert names == ["fp8_gemm_swiglu", "fp8_quantize_rows", "fp8_gemm_identity", "fp8_quantize_rows"]


@pytest.mark.gpu
@pytest.mark.parametrize("T,skew", [(1, False), (200, True), (1024, False)])
def test_fp8_layer_against_reference_and_float64(T, skew):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_ep.api.quant import dequantize_fp8_block128, quantize_fp8_block128

    E, H, I, K = QWEN["num_experts"], QWEN["hidden"], QWEN["intermediate"], QWEN["top_k"]
    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **QWEN)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, :4] += 3.0
    ids = logits.topk(K, -1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    w13 = quantize_fp8_block128((torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).cuda())
    w2 = quantize_fp8_block128((torch.randn(E, H, I, generator=g) * I ** -0.5).cuda())
    fast = MoELayer(cfg, EPGroup.single(), backend="sm90_fp8_cutedsl")
    ref = MoELayer(cfg, EPGroup.single(), backend="reference")
    fast.warmup(progress=False)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fast.forward(x, ids, w, w13, w2, out=out)
    want = ref.forward(x, ids, w, w13, w2)
    fast.check_errors()
    assert torch.isfinite(got).all()
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 1e-2, rel
    # and the unquantised model in float64, for scale (FP8 activations cost ~3e-2)
    d13, d2 = dequantize_fp8_block128(w13).double(), dequantize_fp8_block128(w2).double()
    full = torch.zeros(T, H, dtype=torch.float64, device="cuda")
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        h = x[t].double() @ d13[e].T
        full.index_add_(0, t, ((torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ d2[e].T) * w[t, k].double()[:, None])
    assert float((got.double() - full).norm() / full.norm()) < 6e-2
    fast.destroy(), ref.destroy()
