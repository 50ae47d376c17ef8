"""Drop v78: pingpong tiles of <= 64 rows on one 64-row WGMMA per k-block (``m64_tails``;
``MOE_EP_M64_TAILS``). In the pingpong schedule a consumer warpgroup owns a whole 128-row tile and
issues two 64-row WGMMAs per k-block; when all the tile's rows lie in its first 64 (an expert's last
m-tile) the second one multiplies rows past the expert. With ``m64_tails`` such a tile runs only the
first, over rows 0-63 of the stage's A and the first half of the accumulator.

CPU: the variants compile for sm_90a with the extra 64-row mainloop and no spills; refusals; the
shim's switch, key and kernel name. GPU: the same bits as the pingpong kernel without it (tails of
every size, every element written, nothing stored past the output), a float64 reference, and the
layer with the switch off and on (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import require_sm90  # noqa: E402

#: (activation, N, K, tile_n, scale_rows): Qwen3's FC2 (the default pingpong), a gated FC1 on 96-wide
#: pingpong tiles (two accumulators), Nemotron's squared-ReLU FC1 (pingpong by default)
SHAPES = [("identity", 2048, 768, 192, True), ("swiglu", 1536, 2048, 96, False),
          ("squared_relu", 3712, 2688, 192, False)]


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,tile_n,sr", SHAPES)
def test_m64_tails_compiles_a_64_row_mainloop(act, n, k, tile_n, sr, tmp_path, monkeypatch):
    """The tail mainloop adds WGMMAs of the same instruction shape (m64 x tile_n; gated: two per
    k-block), in whole k-tiles (4 k-blocks x accumulators), and no spills."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch
    from sm90_megamoe.layout_compile_check import ptxas_info

    counts = []
    for m64 in (False, True):
        ptx = compile_for_arch(act, n, k, sr, tile_n=tile_n, schedule="pingpong", raster_m=16,
                               **({"m64_tails": True} if m64 else {})).__ptx__
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {f"m64n{tile_n}k16"}, shapes
        counts.append(len(re.findall(r"wgmma\.mma_async", ptx)))
        info = ptxas_info(ptx, "sm_90a")
        if info is not None:
            assert info[1] == 0, info  # no spills
    per_k_tile = 4 * (2 if act == "swiglu" else 1)
    assert counts[1] > counts[0] and (counts[1] - counts[0]) % per_k_tile == 0, counts


def test_m64_tails_refusals():
    from recorders import check_pingpong_only_option

    check_pingpong_only_option("m64_tails")


def test_shim_switch_and_key(monkeypatch):
    from recorders import check_pingpong_switch

    from moe_ep.shim.drops import sm90_megamoe as s

    check_pingpong_switch(monkeypatch, "MOE_EP_M64_TAILS", s.use_m64_tails, "m64_tails")


def test_shim_builds_the_tail_launcher(monkeypatch):
    """Under MOE_EP_M64_TAILS=1 the shim keys and builds (recorded: no compile) Qwen3's pingpong FC2
    with ``m64_tails`` under its own kernel name, and leaves the cooperative FC1 alone."""
    from recorders import record_pingpong_switch_builds

    from moe_ep.shim import cache

    built, names = record_pingpong_switch_builds(monkeypatch, "MOE_EP_M64_TAILS")
    assert [kw.get("schedule") for kw in built[::2]] == ["pingpong", "pingpong", "cooperative"]
    assert [kw.get("m64_tails", False) for kw in built[::2]] == [True, False, False]
    assert ["_m64t" in n for n in names] == [True, False, False], names
    assert sorted(k.m64_tails for k in cache.COMPILE_CACHE._store) == [False, False, True]


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,tile_n,sr", SHAPES[:2])
@pytest.mark.parametrize("routing,m_total", [("uniform", 5000), ("skewed", 5000), ("skewed", 300),
                                             ("uniform", 1024), ("skewed", 1)])
def test_gpu_m64_tails_is_bit_identical(act, n, k, tile_n, sr, routing, m_total):
    """The same bits as pingpong without it: tails of 1-127 rows (5000 / 300 rows over 16 experts),
    exactly 64 rows per expert (1024 uniform: every tile a tail of 64), one row. NaN-poisoned
    output with a guard band; then a float64 reference."""
    require_sm90()
    from moe_oracle import pingpong_option_bits

    pingpong_option_bits(act, n, k, tile_n, sr, routing, m_total, 7800 + m_total + n, {"m64_tails": True})


@pytest.mark.gpu
@pytest.mark.parametrize("T", [333, 4096])
def test_gpu_layer_with_m64_tails_is_bit_identical(monkeypatch, T):
    """MOE_EP_M64_TAILS=1 (Qwen3's pingpong FC2 with 64-row tails) gives the layer's default bits,
    eager and replayed from a poisoned CUDA graph; the cooperative FC1 is untouched."""
    require_sm90()
    from moe_oracle import qwen3_pingpong_switch_outputs

    outs = qwen3_pingpong_switch_outputs(monkeypatch, "MOE_EP_M64_TAILS", "m64_tails", T, T + 78)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
