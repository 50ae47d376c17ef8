"""Drop v79: a pingpong warpgroup skips the other warpgroup's stages in one step (``jump_stages``;
``MOE_EP_JUMP_STAGES``). In the pingpong schedule the producer loads every tile into one stage
ring and the two consumer warpgroups take tiles in turn, so after each tile a warpgroup advances
its read and release states past the other's ``k_tiles`` stages. Without the option that is
``k_tiles`` single advances, unrolled (a compare and a select per stage and state); with it, one
index / phase computation per state.

CPU: the variants compile for sm_90a with the same WGMMAs, no spills and without the per-stage
compares; refusals; the shim's switch, key and kernel name. GPU: the same bits as the pingpong
kernel without it (every tile count per CTA, odd and even, so both warpgroups end on every
phase), a float64 reference, and the layer with the switch off and on (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import require_sm90  # noqa: E402

#: (activation, N, K, tile_n, scale_rows): Qwen3's FC2 (the default pingpong, 12 k-tiles), Nemotron's
#: squared-ReLU FC1 (42 k-tiles) and a gated FC1 on 96-wide tiles (two accumulators; MOE_EP_GATED_PINGPONG)
SHAPES = [("identity", 2048, 768, 192, True), ("squared_relu", 1856, 2688, 192, False),
          ("swiglu", 1536, 2048, 96, False)]


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,tile_n,sr", SHAPES)
def test_jump_stages_drops_the_unrolled_skip(act, n, k, tile_n, sr, tmp_path, monkeypatch):
    """Same WGMMAs (shape and count), no spills; the unrolled skip's per-stage compares
    (``setp.eq.b32`` of the stage index against the ring size: two states x k_tiles) are gone."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch
    from sm90_megamoe.layout_compile_check import ptxas_info

    wgmmas, compares = [], []
    for jump in (False, True):
        ptx = compile_for_arch(act, n, k, sr, tile_n=tile_n, schedule="pingpong", raster_m=16,
                               **({"jump_stages": True} if jump else {})).__ptx__
        shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
        assert shapes == {f"m64n{tile_n}k16"}, shapes
        wgmmas.append(len(re.findall(r"wgmma\.mma_async", ptx)))
        compares.append(len(re.findall(r"setp\.eq\.b32", ptx)))
        info = ptxas_info(ptx, "sm_90a")
        if info is not None:
            assert info[1] == 0, info  # no spills
    k_tiles = k // 64
    assert wgmmas[0] == wgmmas[1], wgmmas
    assert compares[0] - compares[1] >= 2 * k_tiles, (compares, k_tiles)


def test_jump_stages_refusals():
    from recorders import check_pingpong_only_option

    check_pingpong_only_option("jump_stages")


def test_shim_switch_and_key(monkeypatch):
    from recorders import check_pingpong_switch

    from moe_ep.shim.drops import sm90_megamoe as s

    check_pingpong_switch(monkeypatch, "MOE_EP_JUMP_STAGES", s.use_jump_stages, "jump_stages")


def test_shim_builds_the_jumping_launcher(monkeypatch):
    """Under MOE_EP_JUMP_STAGES=1 the shim keys and builds (recorded: no compile) Qwen3's pingpong FC2
    with ``jump_stages`` under its own kernel name, and leaves the cooperative FC1 alone."""
    from recorders import record_pingpong_switch_builds

    from moe_ep.shim import cache

    built, names = record_pingpong_switch_builds(monkeypatch, "MOE_EP_JUMP_STAGES")
    assert [kw.get("schedule") for kw in built[::2]] == ["pingpong", "pingpong", "cooperative"]
    assert [kw.get("jump_stages", False) for kw in built[::2]] == [True, False, False]
    assert ["_js" in n for n in names] == [True, False, False], names
    assert sorted(k.jump_stages for k in cache.COMPILE_CACHE._store) == [False, False, True]


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,tile_n,sr", SHAPES[:2])
@pytest.mark.parametrize("routing,m_total", [("uniform", 5000), ("skewed", 5000), ("skewed", 300),
                                             ("uniform", 40000), ("skewed", 1)])
def test_gpu_jump_stages_is_bit_identical(act, n, k, tile_n, sr, routing, m_total):
    """The same bits as pingpong without it, at 1 to ~26 tiles per CTA (so each warpgroup skips the
    other's stages many times, across ring laps of either phase). NaN-poisoned output with a guard
    band; then a float64 reference. (Kernels from the drop's compile cache: one per variant.)"""
    require_sm90()
    from moe_oracle import pingpong_option_bits

    pingpong_option_bits(act, n, k, tile_n, sr, routing, m_total, 7900 + m_total + n, {"jump_stages": True})


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_gpu_layer_with_jump_stages_is_bit_identical(monkeypatch, T):
    """MOE_EP_JUMP_STAGES=1 (Qwen3's pingpong FC2 skipping in one step) gives the layer's default
    bits, eager and replayed from a poisoned CUDA graph; the cooperative FC1 is untouched."""
    require_sm90()
    from moe_oracle import qwen3_pingpong_switch_outputs

    outs = qwen3_pingpong_switch_outputs(monkeypatch, "MOE_EP_JUMP_STAGES", "jump_stages", T, T + 79)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
