"""Drop v111: a partial m-tile loads its A rows in small TMA boxes, the boxes past its expert's end as
zero fill (``box_rows``; ``MOE_EP_BOX_TAILS``). The grouped rows are packed, so the last m-tile of an
expert holds up to 127 rows of the next expert's tokens; the plain kernel reads them, multiplies them
and masks them at the store. With the option such a tile's A comes as ``128 / box_rows`` boxes through
a second descriptor (a kernel parameter, never rewritten): a box holding a row of the expert reads its
rows, every other box is issued past the end of ``mA`` and arrives as zeros, reading nothing.

CPU: the variants compile for sm_90a with the plain kernel's WGMMAs, the box copies and no spills;
refusals; the shim's switch, key and kernel name. GPU: the same bits as the plain kernel (routings whose
experts end anywhere in a tile, empty experts, one row), a float64 reference, and the layer with the
switch off and on (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import require_sm90  # noqa: E402

#: (activation, N, K, schedule, tile_n, cluster_m, scale_rows): Qwen3's FC1 (cooperative, clusters of
#: 2 as on the H100 / H200) and FC2 (pingpong 128 x 192), and a single-CTA cooperative FC2
SHAPES = [("swiglu", 1536, 2048, "cooperative", None, 2, False),
          ("identity", 2048, 768, "pingpong", 192, 1, True),
          ("identity", 2048, 768, "cooperative", None, 1, True)]


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,schedule,tile_n,cluster_m,sr", SHAPES)
@pytest.mark.parametrize("box", [8, 16])
def test_box_tails_compile_with_the_box_copies(act, n, k, schedule, tile_n, cluster_m, sr, box, tmp_path,
                                               monkeypatch):
    """The plain kernel's WGMMAs (shape and count); 128 / box more 2-D TMA copies of A (the boxes, one
    after another in a stage, 1024-byte apart or more); the same stage transaction count; no spills."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch
    from sm90_megamoe.layout_compile_check import ptxas_info

    wgmmas, tx, copies = [], [], []
    for rows in (0, box):
        ptx = compile_for_arch(act, n, k, sr, tile_n=tile_n, schedule=schedule, raster_m=8, cluster_m=cluster_m,
                               tanh_sigmoid=act == "swiglu", box_rows=rows).__ptx__
        wgmmas.append(sorted(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
        tx.append(sorted(set(re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[%r\d+\], (%r\d+|\d+);",
                                        ptx))))
        copies.append(ptx)
        info = ptxas_info(ptx, "sm_90a")
        if info is not None:
            assert info[1] == 0, info  # no spills
    assert wgmmas[0] == wgmmas[1]
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", copies[1])) == \
        len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", copies[0])) + 1  # the box's descriptor
    # the boxes: 128 / box copies in a row, box * 128 bytes apart in the stage (none in the plain kernel)
    assert _longest_box_run(copies[1], box) == 128 // box and _longest_box_run(copies[0], box) <= 1


def _longest_box_run(ptx: str, box: int) -> int:
    """The most 2-D TMA copies in a row (in PTX order) whose shared-memory offsets step by ``box`` rows."""
    offs = [int(o) for o in re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\S*\s+"
                                       r"\[%r\d+\+(\d+)\]", ptx)]
    best = run = 1 if offs else 0
    for a, b in zip(offs, offs[1:]):
        run = run + 1 if b - a == box * 128 else 1
        best = max(best, run)
    return best


def test_box_tails_refusals():
    from sm90_megamoe.grouped_gemm_box_tails import GroupedGemmBoxTailsSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="box tails"):
        GroupedGemmBoxTailsSm90("identity", cluster_n=2)
    with pytest.raises(ValueError, match="box_rows must be one of"):
        GroupedGemmBoxTailsSm90("identity", box_rows=12)
    with pytest.raises(ValueError, match="box_rows"):
        CompiledGroupedGemm("identity", 2048, 768, 16, True, schedule="swapab", compiled=object(), box_rows=8)
    with pytest.raises(ValueError, match="box_rows"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 16, False, compiled=object(), gather_a=True, box_rows=8)
    fn = CompiledGroupedGemm("identity", 2048, 768, 16, True, tile_n=192, schedule="pingpong", compiled=object(),
                             box_rows=16)
    assert fn.box_rows == 16 and fn.kernel.box_rows == 16


def test_shim_switch_key_and_name(monkeypatch):
    """``MOE_EP_BOX_TAILS``: 0 unset and under 0; under 8 / 16 / 32 the TMA kernels whose CTAs load their
    own A (cooperative, wide, pingpong) take it, not swap-AB, the gathering kernel or ``cluster_n``; the
    shim keys and names (``_bt8``) the variant and passes it to the drop (recorded: no compile)."""
    from recorders import record_gemm_builds

    from moe_ep.shim import cache
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_BOX_TAILS", raising=False)
    assert s.use_box_tails("cooperative") == 0
    monkeypatch.setenv("MOE_EP_BOX_TAILS", "8")
    assert all(s.use_box_tails(x) == 8 for x in ("cooperative", "wide", "pingpong"))
    assert s.use_box_tails("swapab") == 0 and s.use_box_tails("cooperative", gather_a=True) == 0
    assert s.use_box_tails("pingpong", cluster_n=2) == 0
    monkeypatch.setenv("MOE_EP_BOX_TAILS", "1")
    with pytest.raises(ValueError, match="MOE_EP_BOX_TAILS"):
        s.use_box_tails("cooperative")
    assert s.GemmKey.__dataclass_fields__["box_rows"].default == 0

    built, names = record_gemm_builds(monkeypatch)
    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    for flag in ("8", "0"):
        monkeypatch.setenv("MOE_EP_BOX_TAILS", flag)
        s.compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True)
    monkeypatch.setenv("MOE_EP_BOX_TAILS", "16")
    s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, rows_per_expert=4.0)  # swap-AB: not taken
    assert [kw.get("box_rows", 0) for kw in built[::2]] == [8, 0, 0]
    assert ["_bt8" in n for n in names] == [True, False, False], names
    assert sorted(k.box_rows for k in cache.COMPILE_CACHE._store) == [0, 0, 8]


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,schedule,tile_n,cluster_m,sr", SHAPES)
@pytest.mark.parametrize("routing,m_total,E", [("skewed", 5000, 16), ("uniform", 40000, 128),
                                               ("ragged", 9000, 64), ("skewed", 1, 16)])
def test_gpu_box_tails_is_bit_identical(act, n, k, schedule, tile_n, cluster_m, sr, routing, m_total, E):
    """The same bits as the plain kernel with 8- and 16-row boxes, into NaN-poisoned outputs with a
    guard band; then against float64. ``ragged``: experts of 0 to 300 rows, every remainder mod 128
    present, so most experts end inside a tile."""
    require_sm90()
    from moe_oracle import bf16_gemm_problem, variants_same_bits
    from sm90_megamoe.launch import get_grouped_gemm
    from sm90_megamoe.reference import grouped_gemm_reference

    if routing == "ragged":
        g = torch.Generator().manual_seed(m_total + n)
        counts = torch.randint(0, 301, (E,), generator=g)
        counts[::7] = 0
        counts[1::9] = 128
        m_total = int(counts.sum())
        a, b, _, rs, _ = bf16_gemm_problem(m_total, n, k, E, "uniform", 8100 + n, sr)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).cuda()
    else:
        a, b, offs, rs, _ = bf16_gemm_problem(m_total, n, k, E, routing, 8100 + m_total + n, sr)
    kw = dict(scale_rows=sr, tile_n=tile_n, schedule=schedule, raster_m=8, cluster_m=cluster_m,
              tanh_sigmoid=act == "swiglu")
    variants = [get_grouped_gemm(act, n, k, E, box_rows=r, **kw) for r in (0, 8, 16)]
    n_out = n // 2 if act == "swiglu" else n
    got = variants_same_bits(variants, a, b, offs, n_out, row_scale=rs)
    want = grouped_gemm_reference(a.double(), b.double(), offs, act, None if rs is None else rs.double()).double()
    assert float((got.double() - want).norm() / want.norm().clamp_min(1e-30)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [777, 4096])  # above the decode path's 512 tokens: the 128-row pair
def test_gpu_layer_with_box_tails_is_bit_identical(monkeypatch, T):
    """MOE_EP_BOX_TAILS=8 gives the Qwen3 layer's default bits, eager and replayed from a poisoned CUDA
    graph."""
    require_sm90()
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T + 89)

    def check(impl, on):
        assert (impl.fc1.compiled.box_rows == 8) == on and (impl.fc2.compiled.box_rows == 8) == on

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_BOX_TAILS", cfg, "sm90_bf16_cutedsl", inputs, check,
                                     values=("0", "8"))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
