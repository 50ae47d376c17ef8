"""The SM90 drop's FP8 runner times "the layer's schedule" (``fp8_runner._layer_kw``) -- a copy, inside
the drop, of the choices the shim makes. The fifty-first session changed the shim's scale defaults and
the copy went stale (DeepSeek-V3's and Inkling2's FC1 on global scales in the runner, scales by TMA in
the layer). This checks the copy against the shim, GEMM by GEMM, for the runner's models and a few
other K. CPU only."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

#: the kernel options the runner's copy decides (the others -- shape, tvm_ffi, activation constants
#: -- are not schedule choices)
FIELDS = ("raster_m", "overlap_promotion", "wide_gated", "cluster_n", "smem_scales", "scale_warp",
          "deferred_epilogue", "tanh_sigmoid", "unit_scales")


def _gemms():
    from sm90_megamoe.fp8_runner import MODELS

    for model, (h, i, experts, _topk, _tokens) in sorted(MODELS.items()):
        yield model, "swiglu", 2 * i, h, experts   # FC1
        yield model, "identity", h, i, experts     # FC2
    # K the runner's models lack: K 5120 (GLM-4.5, Llama-4; scales by TMA in chunks of 8), a gated
    # K between 2048 and 4096 (global scales, single CTAs), a non-gated one (staged, clusters)
    yield "k5120", "swiglu", 2 * 1536, 5120, 8
    yield "k3072", "swiglu", 2 * 1536, 3072, 8
    yield "k3072", "identity", 3072, 3072, 8


@pytest.mark.parametrize("model,act,n,k,experts", list(_gemms()))
def test_runner_layer_schedule_is_the_shims(monkeypatch, model, act, n, k, experts):
    from sm90_megamoe.fp8_runner import _layer_kw

    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    for var in [v for v in os.environ if v.startswith("MOE_EP_")]:  # the defaults, not a switch
        monkeypatch.delenv(var)
    want = s._gemm_options(s._gemm_key(act, n, k, experts, act == "identity"))
    kw = _layer_kw(act, k)
    got = {f: kw.get(f, 1 if f == "cluster_n" else False) for f in FIELDS}
    assert got == {f: want[f] for f in FIELDS}, (model, act, k)


def test_new_scale_defaults_reach_the_runner():
    """The two GEMM families whose defaults the fifty-first session changed, spelled out."""
    from sm90_megamoe.fp8_runner import _layer_kw

    for k in (7168, 5120, 4608):  # FC1s with scales by TMA (8, 8 and 4 k-tiles per copy)
        assert _layer_kw("swiglu", k)["unit_scales"] and not _layer_kw("swiglu", k).get("smem_scales")
    fc2 = _layer_kw("identity", 2304)  # Inkling2's FC2: staged, in clusters, no scale warp
    assert fc2["smem_scales"] and not fc2["scale_warp"] and fc2["cluster_n"] == 2 and not fc2.get("unit_scales")
