"""Drop v29: the BF16 grouped GEMM in clusters of 2 CTAs (``cluster_m=2``): the two CTAs of a cluster
compute an m-tile pair of one expert (the second past the expert's rows when its m-tile count is odd:
computed, never stored) and each loads half of the weight tile by a multicast TMA into both. CPU:
the PTX (multicast on B's loads only, the remote stage release, the cluster barrier), no spills, the
refusals, the shim's opt-in switch. GPU: the same bits as single CTAs, the float64 reference, and
the layer with ``MOE_EP_BF16_CLUSTER=1`` against ``0`` (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe.grouped_gemm import GroupedGemmSm90  # noqa: E402
from moe_oracle import kernel_once, require_sm90  # noqa: E402


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,kw", [
    ("swiglu", 1536, 2048, 128, {}),                                   # Qwen3 FC1 (tile 128, gate + up)
    ("identity", 4096, 14336, 8, dict(scale_rows=True, raster_m=16)),  # Mixtral FC2 (tile 256)
    ("swiglu", 1536, 2048, 128, dict(schedule="wide", tile_n=128)),    # the wide schedule
    ("clamped_swiglu", 5760, 2880, 128, dict(has_bias=True)),          # gpt-oss: I = 22.5 tiles, bias
])
def test_cluster_ptx_multicasts_the_weights_only(act, n, k, experts, kw):
    import cutlass.cute as cute
    from sm90_megamoe.compile_check import fake_args
    from sm90_megamoe.layout_compile_check import ptxas_info

    kernel = GroupedGemmSm90(act, cluster_m=2, **kw)
    ptx = cute.compile(kernel, *fake_args(kernel, experts, n, k), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[^;]*;", ptx)
    a_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.2d")]  # A [M, K]
    b_loads = [x for x in loads if x.startswith("cp.async.bulk.tensor.3d")]  # B [E, N, K] as (N, K, E)
    assert b_loads and all("multicast::cluster" in x for x in b_loads), b_loads
    assert a_loads and not any("multicast" in x for x in a_loads), a_loads
    assert re.search(r"mapa\.shared::cluster", ptx) and "mbarrier.arrive.shared::cluster" in ptx
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    info = ptxas_info(ptx, "sm_90a")
    if info is not None:
        assert info[1] == 0, info  # no spills


def test_single_cta_kernel_has_no_cluster_code():
    import cutlass.cute as cute
    from sm90_megamoe.compile_check import fake_args

    kernel = GroupedGemmSm90("swiglu")
    ptx = cute.compile(kernel, *fake_args(kernel, 128, 1536, 2048), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    assert kernel.cluster_m == 1
    assert "multicast" not in ptx and "barrier.cluster" not in ptx and "mapa" not in ptx


def test_cluster_refusals():
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="cluster_m must be 1 or 2"):
        GroupedGemmSm90("swiglu", cluster_m=4)
    with pytest.raises(ValueError, match="not pingpong, not gather_a"):
        GroupedGemmSm90("identity", tile_n=128, schedule="pingpong", cluster_m=2)
    with pytest.raises(ValueError, match="not pingpong, not gather_a"):
        GroupedGemmGatherSm90("swiglu", cluster_m=2)
    with pytest.raises(ValueError, match="does not combine with gather_a"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 8, False, gather_a=True, cluster_m=2)
    with pytest.raises(ValueError, match="not schedule='swapab'"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 8, False, schedule="swapab", cluster_m=2)


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    assert s.use_bf16_cluster("cooperative") == 1  # opt-in
    monkeypatch.setenv("MOE_EP_BF16_CLUSTER", "1")
    assert s.use_bf16_cluster("cooperative") == s.use_bf16_cluster("wide") == 2
    assert s.use_bf16_cluster("pingpong") == s.use_bf16_cluster("swapab") == 1
    assert s.use_bf16_cluster("cooperative", gather_a=True) == 1
    assert s.use_bf16_cluster("cooperative", gated=True) == 2
    monkeypatch.setenv("MOE_EP_BF16_CLUSTER", "fc2")  # FC2 alone (non-gated): FC1 stays single
    assert s.use_bf16_cluster("cooperative") == s.use_bf16_cluster("wide") == 2
    assert s.use_bf16_cluster("cooperative", gated=True) == s.use_bf16_cluster("wide", gated=True) == 1
    assert s.use_bf16_cluster("pingpong") == s.use_bf16_cluster("cooperative", gather_a=True) == 1
    for bad in ("FC2", "fc1", "2", "on"):
        monkeypatch.setenv("MOE_EP_BF16_CLUSTER", bad)
        with pytest.raises(ValueError, match="MOE_EP_BF16_CLUSTER must be one of 0, 1, fc2"):
            s.use_bf16_cluster("cooperative")
    assert s.GemmKey.__dataclass_fields__["cluster_m"].default == 1


def test_clusters_by_default_on_an_h100_or_h200(monkeypatch):
    """Unset, MOE_EP_BF16_CLUSTER clusters the cooperative GEMMs at prefill sizes (>= 512 rows per expert)
    on an H100 or an H200 (GPU names matched by whole word): the gated GEMM (H100, 43rd / 46th sessions:
    Mixtral +4-5% and the DeepSeek-V3 shard +3-8%, Qwen3 level) and the long-K FC2 (53rd: Mixtral +2.5-5%
    per call on an H100; on the H200 both, Mixtral +1-5%, DSv3 and Qwen3 +1-2%); the pingpong FC2 never;
    a CPU prebuild (no name), a GH200 or another GPU none. 0 / 1 / fc2 override it."""
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    mixtral_fc1 = dict(gated=True, rows_per_expert=2048.0)
    mixtral_fc2 = dict(gated=False, rows_per_expert=2048.0)  # K 14336: the cooperative schedule
    qwen3_fc1 = dict(gated=True, rows_per_expert=512.0)  # 128 experts x 8 of 8192 tokens
    for gpu in (h100, h200, "NVIDIA H100 PCIe", "NVIDIA H200 NVL"):
        assert s.clusters_by_default(gpu)
        for gemm in (mixtral_fc1, mixtral_fc2, qwen3_fc1, dict(gated=True, rows_per_expert=None)):  # None: many
            assert s.use_bf16_cluster("cooperative", **gemm, device_name=gpu) == 2
            assert s.use_bf16_cluster("wide", **gemm, device_name=gpu) == 2
            assert s.use_bf16_cluster("cooperative", **{**gemm, "rows_per_expert": 256.0}, device_name=gpu) == 1
        assert s.use_bf16_cluster("pingpong", **mixtral_fc2, device_name=gpu) == 1  # Qwen3's / DSv3's FC2
        assert s.use_bf16_cluster("swapab", **mixtral_fc1, device_name=gpu) == 1
        assert s.use_bf16_cluster("cooperative", **mixtral_fc1, gather_a=True, device_name=gpu) == 1
    for name in (None, "NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA H20"):  # a CPU prebuild knows no GPU
        assert not s.clusters_by_default(name)
        assert s.use_bf16_cluster("cooperative", **mixtral_fc1, device_name=name) == 1
        assert s.use_bf16_cluster("cooperative", **mixtral_fc2, device_name=name) == 1
    for raw, fc1, fc2 in (("0", 1, 1), ("fc2", 1, 2), ("1", 2, 2)):
        monkeypatch.setenv("MOE_EP_BF16_CLUSTER", raw)
        for name in (h100, None):
            assert s.use_bf16_cluster("cooperative", **mixtral_fc1, device_name=name) == fc1
            assert s.use_bf16_cluster("cooperative", **mixtral_fc2, device_name=name) == fc2


def test_the_key_takes_the_device_choice(monkeypatch):
    """compiled_grouped_gemm builds Mixtral's FC1 and FC2 in clusters for an H100 or an H200 and single
    for an unknown GPU (two keys per GEMM); Qwen3's pingpong FC2 is single everywhere."""
    from moe_ep.shim.drops import sm90_megamoe as s
    from recorders import record_gemm_builds

    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    built, names = record_gemm_builds(monkeypatch)
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", None):
        s.compiled_grouped_gemm("swiglu", 28672, 4096, 8, rows_per_expert=2048.0, device_name=name)
        s.compiled_grouped_gemm("identity", 4096, 14336, 8, True, rows_per_expert=2048.0, device_name=name)
        s.compiled_grouped_gemm("identity", 2048, 768, 128, True, rows_per_expert=512.0, device_name=name)
    # one key per kernel: the clustered FC1 and FC2 (H100 and H200 share them), the pingpong FC2 that all
    # share, then the single FC1 and FC2 of the unnamed GPU
    assert names == ["gemm_swiglu_cluster2_tanh", "gemm_identity_cluster2", "gemm_identity",
                     "gemm_swiglu_tanh", "gemm_identity"]
    picks = [(kw["activation"], kw["schedule"], kw.get("cluster_m", 1)) for kw in built]
    assert list(dict.fromkeys(picks)) == [
        ("swiglu", "cooperative", 2), ("identity", "cooperative", 2), ("identity", "pingpong", 1),
        ("swiglu", "cooperative", 1), ("identity", "cooperative", 1)]


def test_prebuild_builds_the_named_gpus_picks(monkeypatch):
    """``prebuild(..., gpu=...)`` (``python -m moe_ep.aot build --gpu``) builds the FC1 the layer will
    load on that GPU: Mixtral's clustered on an H100 or an H200 (also the default, no name: the H200's
    picks), single on a GPU the shim has no cluster choice for."""
    from recorders import record_gemm_builds

    from moe_ep.backends import prebuild
    from moe_ep.bench.models import model_config

    monkeypatch.delenv("MOE_EP_BF16_CLUSTER", raising=False)
    cfg = model_config("mixtral", 8192)
    for gpu, want in (("NVIDIA H100 80GB HBM3", {2}), ("NVIDIA H200", {2}), (None, {2}), ("NVIDIA H800", {1})):
        built, _ = record_gemm_builds(monkeypatch)
        prebuild(cfg, kernels=("fc1", "fc2"), gpu=gpu)
        # the 128-row FC1 and FC2 (cooperative); their decode siblings (swap-AB) never cluster
        assert {kw.get("cluster_m", 1) for kw in built if kw["schedule"] == "cooperative"} == want
        assert {kw.get("cluster_m", 1) for kw in built if kw["schedule"] == "swapab"} == {1}


# ---------------------------------------------------------------------------- GPU
def _problem(m_total, n, k, E, routing, seed, scale_rows, bias_dtype=None, amp=0.5):
    from sm90_megamoe.grouped_gemm_runner import make_offsets

    offs = make_offsets(m_total, E, routing, torch.Generator().manual_seed(seed)).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    a = (torch.randn(m_total, k, device="cuda", generator=g) * amp).to(torch.bfloat16)
    b = (torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    rs = torch.rand(m_total, device="cuda", generator=g) if scale_rows else None
    bias = None if bias_dtype is None else (torch.randn(E, n, device="cuda", generator=g) * amp).to(bias_dtype)
    return a, b, offs, rs, bias


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("act,n,k,kw,m_total", [
    ("swiglu", 1536, 2048, {}, 5000),                          # Qwen3 FC1
    ("identity", 2048, 768, dict(scale_rows=True), 5000),      # Qwen3 FC2, tile 256, router weights
    ("swiglu", 1536, 2048, dict(schedule="wide"), 300),        # wide schedule, few rows: odd m-tile counts
    ("clamped_swiglu", 5760, 2880, dict(bias=torch.float32), 2000),  # I not a multiple of the tile, bias
    ("identity", 1024, 1024, {}, 1),                           # one row
])
def test_gpu_cluster_is_bit_identical(act, n, k, kw, m_total, routing):
    """Clusters of 2 give the single-CTA kernel's bits (each tile's WGMMAs are the same; only
    where B's bytes come from differs), every row written (NaN-poisoned output), and agree with a
    float64 computation."""
    require_sm90()
    E, sr = 16, kw.get("scale_rows", False)
    bias_dtype = kw.get("bias")
    schedule = kw.get("schedule", "cooperative")
    a, b, offs, rs, bias = _problem(m_total, n, k, E, routing, 60 + m_total, sr, bias_dtype,
                                    amp=4.0 if act == "clamped_swiglu" else 0.5)
    _check_cluster_bits(act, n, k, E, a, b, offs, rs, bias, schedule, tile_n=128 if schedule == "wide" else None)


def _check_cluster_bits(act, n, k, E, a, b, offs, rs, bias, schedule, tile_n=None):
    """The GEMM in clusters of 2 against single CTAs on the same inputs: the same bits, every row
    written (NaN-poisoned outputs), within 1e-2 of a float64 computation."""
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.reference import grouped_gemm_reference

    n_out = n // 2 if act != "identity" else n
    outs = []
    for c in (1, 2):
        fn = kernel_once(CompiledGroupedGemm, act, n, k, E, rs is not None, raster_m=16, schedule=schedule,
                         cluster_m=c, tile_n=tile_n, bias_dtype=None if bias is None else "float32")
        out = torch.full((a.shape[0], n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn(a, b, offs, out=out, row_scale=rs, bias=bias)
        outs.append(out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[1]).any()), "rows left unwritten (NaN poison survived)"
    assert torch.equal(outs[0], outs[1])
    want = grouped_gemm_reference(a.double(), b.double(), offs, act, None if rs is None else rs.double(),
                                  bias=None if bias is None else bias.double()).double()
    got = outs[1].double()
    assert float((got - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


# drop v96: an odd m-tile count's last tile pairs with the next such expert's (rows per expert; 128-row
# m-tiles). Both: experts without rows, one-row experts, lone tiles far apart and adjacent.
LONE_COUNTS = {
    # 7 lone tiles, the last expert's own unpaired: its CTA 1 repeats CTA 0's tile, stores nothing
    "odd_last_own": [129, 0, 300, 256, 1, 640, 385, 0, 128, 129, 513, 700, 0, 77, 255, 3],
    # 5 lone tiles, the last expert (2 m-tiles) has none: the unpaired one is an earlier expert's
    "odd_last_other": [129, 0, 300, 256, 1, 640, 385, 0, 128, 129, 513, 700, 0, 200, 255, 256],
    # 8 lone tiles, every pair closed; two adjacent one-row experts
    "even": [1, 1, 300, 0, 640, 385, 128, 0, 513, 77, 255, 3, 0, 0, 129, 256],
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LONE_COUNTS))
@pytest.mark.parametrize("act,n,k,kw", [
    ("swiglu", 1536, 2048, dict(bias=torch.float32)),         # Qwen3 FC1 (gate + up), a bias per expert
    ("identity", 2048, 768, dict(scale_rows=True)),           # Qwen3 FC2 cooperative, router weights
])
def test_gpu_cluster_pairs_lone_m_tiles_across_experts(name, act, n, k, kw):
    """Drop v96: lone m-tiles of different experts share a cluster, each CTA loading its own expert's
    weights (and bias): the single-CTA kernel's bits, every row written, float64 agreement."""
    require_sm90()
    counts = torch.tensor(LONE_COUNTS[name], dtype=torch.int64)
    E, m_total, sr, bias_dtype = len(counts), int(counts.sum()), kw.get("scale_rows", False), kw.get("bias")
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = counts.cumsum(0)
    offs = offs.cuda()
    g = torch.Generator(device="cuda").manual_seed(700 + E)
    a = (torch.randn(m_total, k, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    b = (torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    rs = torch.rand(m_total, device="cuda", generator=g) if sr else None
    bias = None if bias_dtype is None else (torch.randn(E, n, device="cuda", generator=g) * 0.5).to(bias_dtype)
    _check_cluster_bits(act, n, k, E, a, b, offs, rs, bias, "cooperative")


@pytest.mark.gpu
@pytest.mark.parametrize("T,pingpong_max_k", [(513, "0"), (777, "0"), (4096, "0"), (4096, None)])  # > 512: not the decode GEMMs
def test_gpu_layer_with_clusters_is_bit_identical(monkeypatch, T, pingpong_max_k):
    """MOE_EP_BF16_CLUSTER=1 gives the layer's default bits, eager and replayed from a poisoned CUDA
    graph: FC1 and FC2 in clusters of 2 with FC2 kept cooperative (MOE_EP_PINGPONG_MAX_K=0), and
    with the shim's default, where Qwen3's FC2 (K 768) runs pingpong, which has no clusters."""
    require_sm90()
    if pingpong_max_k is None:
        monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    else:
        monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", pingpong_max_k)
    fc2_clustered = pingpong_max_k == "0"
    from moe_oracle import layer_outputs_with_switch

    from moe_ep.api import MoEConfig

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=4096)
    g = torch.Generator().manual_seed(900 + T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    ids, w = ids.to(torch.int32).cuda(), (w / w.sum(-1, keepdim=True)).cuda()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16).cuda()

    def check(impl, on):
        assert impl.fc1.compiled.cluster_m == (2 if on else 1)
        assert impl.fc2.compiled.cluster_m == (2 if on and fc2_clustered else 1)
        assert impl.fc2.compiled.schedule == ("cooperative" if fc2_clustered else "pingpong")

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_BF16_CLUSTER", cfg, "sm90_bf16_cutedsl",
                                     (x, ids, w, w13, w2), check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_gpu_default_clusters_follow_the_gpu(monkeypatch):
    """The layer's default at >= 512 rows per expert (here FC1 N x K = 32768 x 2048, FC2 K 16384, so
    cooperative): FC1 and FC2 in clusters of 2 on an H100 or an H200, single elsewhere; either way the bits of
    ``MOE_EP_BF16_CLUSTER=0``, eager and graph-replayed from poison, within 1e-2 of float64."""
    require_sm90()
    from moe_oracle import layer_outputs_with_switch, make_problem, rel_err, swiglu_moe_f64, worst_row_err

    from moe_ep.api import MoEConfig

    E, H, I, K, T = 4, 2048, 16384, 2, 1500
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=2048)
    x, ids, w, w13, w2 = make_problem(E, H, I, K, T, seed=43)
    inputs = (x.cuda(), ids.to(torch.int32).cuda(), w.cuda(), w13.cuda(), w2.cuda())
    from moe_ep.shim.drops.sm90_megamoe import clusters_by_default
    clustered = clusters_by_default(torch.cuda.get_device_name())  # an H100 or an H200 (53rd session)

    def check(impl, default):
        assert impl.fc1.compiled.cluster_m == (2 if default and clustered else 1)
        assert impl.fc2.compiled.schedule == "cooperative"
        assert impl.fc2.compiled.cluster_m == (2 if default and clustered else 1)

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_BF16_CLUSTER", cfg, "sm90_bf16_cutedsl", inputs,
                                     check, values=("0", ""))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
    S = 96  # float64 on the GPU for the first 96 tokens (the weights are 268 + 134 MB in bf16)
    want = swiglu_moe_f64(inputs[0][:S], inputs[1][:S].long(), inputs[2][:S], inputs[3], inputs[4], I)
    assert rel_err(outs[1][:S], want) < 1e-2 and worst_row_err(outs[1][:S], want) < 3e-2
