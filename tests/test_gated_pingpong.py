"""``MOE_EP_GATED_PINGPONG=1``: the BF16 gated GEMM (FC1) on the pingpong schedule with 96-wide tiles
instead of cooperative 128 x 128 (opt-in; the schedule is drop v71's, the switch only picks it for
FC1 so that a layer A/B can time it together with drop v79's ``MOE_EP_JUMP_STAGES``).

CPU: the shim picks it for every gated activation and nothing else, decode keeps swap-AB, and it
builds (recorded, no compile) FC1 on pingpong 96 under the other pingpong switches. GPU: the kernel
is bit-identical to cooperative FC1 (same k order per element) at 1 to ~26 tiles per CTA, agrees
with float64, and the layer with the switch gives the default's bits, eager and under a CUDA graph."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import require_sm90  # noqa: E402


def test_shim_picks_pingpong_96_for_the_gated_gemm_only(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    for var in ("MOE_EP_GATED_PINGPONG", "MOE_EP_WIDE_GATED", "MOE_EP_PINGPONG_MAX_K"):
        monkeypatch.delenv(var, raising=False)
    assert s.pick_schedule("swiglu", 2048) == ("cooperative", 128)  # the default
    monkeypatch.setenv("MOE_EP_GATED_PINGPONG", "1")
    for act in ("swiglu", "gelu_glu", "clamped_swiglu"):
        assert s.pick_schedule(act, 2048) == ("pingpong", s.GATED_PINGPONG_TILE_N) == ("pingpong", 96)
        assert s.pick_schedule(act, 4096) == ("pingpong", 96)
    assert s.pick_schedule("identity", 768) == ("pingpong", s.PINGPONG_TILE_N)  # FC2 as before
    assert s.pick_schedule("identity", 14336) == ("cooperative", 256)
    assert s.pick_schedule("squared_relu", 2688) == ("pingpong", 192)  # not gated: FC2's rule
    assert s.pick_schedule("swiglu", 2048, rows_per_expert=4)[0] == "swapab"  # decode keeps swap-AB
    monkeypatch.setenv("MOE_EP_WIDE_GATED", "1")  # the pingpong switch wins over the wide one
    assert s.pick_schedule("swiglu", 2048) == ("pingpong", 96)
    monkeypatch.setenv("MOE_EP_GATED_PINGPONG", "0")
    assert s.pick_schedule("swiglu", 2048) == ("wide", 128)
    for bad in ("on", "2"):
        monkeypatch.setenv("MOE_EP_GATED_PINGPONG", bad)
        with pytest.raises(ValueError, match="MOE_EP_GATED_PINGPONG"):
            s.pick_schedule("swiglu", 2048)


def test_shim_builds_fc1_on_pingpong_with_the_pingpong_switches(monkeypatch):
    """Recorded builds (no compile): FC1 on pingpong 96 with the tanh sigmoid, with and without
    drop v79's jump_stages; with the gathering FC1 it refuses, naming both switches."""
    from recorders import record_gemm_builds

    from moe_ep.shim.drops import sm90_megamoe as s

    built, names = record_gemm_builds(monkeypatch)
    monkeypatch.setenv("MOE_EP_GATED_PINGPONG", "1")
    for jump in ("0", "1"):
        monkeypatch.setenv("MOE_EP_JUMP_STAGES", jump)
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128)
    kws = built[::2]
    assert [(kw["schedule"], kw["tile_n"]) for kw in kws] == [("pingpong", 96)] * 2
    assert [kw.get("jump_stages", False) for kw in kws] == [False, True]
    assert all(kw.get("tanh_sigmoid") for kw in kws) and ["_js" in n for n in names] == [False, True]
    with pytest.raises(ValueError, match="MOE_EP_GATED_PINGPONG=1 .*MOE_EP_GATHER_FC1=1"):
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, gather_a=True)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("routing,m_total", [("uniform", 5000), ("skewed", 300), ("uniform", 40000), ("skewed", 1)])
def test_gpu_pingpong_fc1_is_bit_identical_to_cooperative(routing, m_total):
    """Qwen3's FC1 shape (swiglu, N 1536, K 2048) on pingpong 96 (with and without jump_stages)
    against cooperative 128: the same bits (NaN poison, guard band), then float64."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem, variants_same_bits

    from sm90_megamoe.launch import get_grouped_gemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E, n, k = 16, 1536, 2048
    a, b, offs, _, _ = bf16_gemm_problem(m_total, n, k, E, routing, 8100 + m_total, False)
    fns = [get_grouped_gemm("swiglu", n, k, E, tile_n=128, raster_m=16, tanh_sigmoid=True)]
    fns += [get_grouped_gemm("swiglu", n, k, E, tile_n=96, schedule="pingpong", raster_m=16, tanh_sigmoid=True,
                             jump_stages=jump) for jump in (False, True)]
    got = variants_same_bits(fns, a, b, offs, n // 2)
    want = grouped_gemm_reference(a.double(), b.double(), offs, "swiglu").double()
    assert float((got.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_gpu_layer_with_gated_pingpong_is_bit_identical(monkeypatch, T):
    """MOE_EP_GATED_PINGPONG=1 gives the Qwen3 layer's default bits (FC1 on pingpong 96 instead of
    cooperative 128), eager and replayed from a poisoned CUDA graph."""
    require_sm90()
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    monkeypatch.delenv("MOE_EP_WIDE_GATED", raising=False)
    cfg, inputs = qwen3_gather_layer(T, seed=T + 83)

    def check(impl, on):
        assert (impl.fc1.compiled.schedule, impl.fc1.compiled.kernel.tile_n) == (
            ("pingpong", 96) if on else ("cooperative", 128))

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_GATED_PINGPONG", cfg, "sm90_bf16_cutedsl", inputs, check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])


def test_the_pingpong_bound_follows_the_gpu(monkeypatch):
    """The non-gated GEMM's pingpong bound is per GPU (53rd session): K <= 2880 on the H200 and for a
    CPU prebuild, K <= 1920 on an H100, where the cooperative (clustered) kernel won from K 2048 --
    but only where that kernel runs in clusters (54th session: with single CTAs, gpt-oss's and
    Nemotron's layers were ~5% faster pingpong); MOE_EP_PINGPONG_MAX_K overrides both."""
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert (s.pingpong_bound(h200), s.pingpong_bound(None), s.pingpong_bound(h100)) == (2880, 2880, 1920)
    # fewer rows per expert than a cluster needs: single-CTA cooperative, so pingpong keeps K <= 2880
    from moe_ep.shim.drops.sm90_megamoe_switches import CLUSTER_MIN_ROWS
    assert CLUSTER_MIN_ROWS == 512
    assert [s.pingpong_bound(h100, r) for r in (256.0, 384.0, 511.9, 512.0, 2048.0, None)] == [
        2880, 2880, 2880, 1920, 1920, 1920]
    for k in (2688, 2880):  # Nemotron's FC1 (384 rows per expert), gpt-oss's FC2 (256)
        assert s.pick_schedule("squared_relu", k, 384.0, h100)[0] == "pingpong"
        assert s.pick_schedule("identity", k, 256.0, h100)[0] == "pingpong"
        assert s.pick_schedule("identity", k, 1536.0, h100)[0] == "cooperative"
    assert s.pick_schedule("identity", 2944, 256.0, h100)[0] == "cooperative"  # above either bound
    # the bound follows the cluster switch: forced off, an H100 keeps 2880; forced on, 1920 at any rows
    monkeypatch.setenv("MOE_EP_BF16_CLUSTER", "0")
    assert (s.pingpong_bound(h100, 2048.0), s.pick_schedule("identity", 2048, 2048.0, h100)[0]) == (2880, "pingpong")
    monkeypatch.setenv("MOE_EP_BF16_CLUSTER", "1")
    assert s.pingpong_bound(h100, 256.0) == 1920 and s.pingpong_bound(h200, 256.0) == 2880
    monkeypatch.delenv("MOE_EP_BF16_CLUSTER")
    for k, on_h100 in ((768, "pingpong"), (1856, "pingpong"), (1920, "pingpong"), (2048, "cooperative"),
                       (2688, "cooperative"), (2880, "cooperative"), (14336, "cooperative")):
        assert s.pick_schedule("identity", k, 512.0, h100)[0] == on_h100
        assert s.pick_schedule("identity", k, 512.0, h200)[0] == ("pingpong" if k <= 2880 else "cooperative")
        assert s.pick_schedule("squared_relu", k, None, h100)[0] == on_h100  # not gated: FC2's rule
    assert s.pick_schedule("swiglu", 2048, 512.0, h100)[0] == "cooperative"  # the gated GEMM: unchanged
    assert s.pick_schedule("identity", 2048, 4.0, h100)[0] == "swapab"  # decode: unchanged
    monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", "2880")
    assert s.pick_schedule("identity", 2048, 512.0, h100)[0] == "pingpong"
    monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", "0")
    assert s.pick_schedule("identity", 768, 512.0, h200)[0] == "cooperative"


def test_the_key_takes_the_gpus_pingpong_bound(monkeypatch):
    """compiled_grouped_gemm builds the DeepSeek-V3 shard's FC2 (K 2048) cooperative in clusters for an
    H100 and pingpong for the H200 or an unnamed GPU."""
    from recorders import record_gemm_builds

    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    built, _ = record_gemm_builds(monkeypatch)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", None):
        s.compiled_grouped_gemm("identity", 7168, 2048, 32, True, rows_per_expert=2048.0, device_name=name)
    picks = [(kw["schedule"], kw.get("cluster_m", 1), kw["tile_n"]) for kw in built]
    assert list(dict.fromkeys(picks)) == [("cooperative", 2, 256), ("pingpong", 1, 192)]
