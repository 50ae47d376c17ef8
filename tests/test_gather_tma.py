"""Drop v41 (not yet run on a GPU): the gathering GEMMs' producer loading each A row by one TMA copy
(``gather_tma``: a box of one 128-byte row with the tile's swizzle, aimed at the row's place in the
stage) instead of eight 16-byte cp.async copies. CPU: the BF16 and FP8 gathering FC1s compile to
row TMA loads 128 bytes apart (no cp.async, no per-thread mbarrier arrivals), without spills; the
launchers refuse ``gather_tma`` without ``gather_a``. GPU: bits against the plain FC1 on the copied
rows -- whether they match is also what ``sm90_megamoe.tma_rows_probe`` asks of the hardware."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))


def _row_loads(ptx: str) -> list:
    """(base register, offset) of each 2-D TMA load into shared memory (the A rows; B's are 3-D)."""
    return [(r, int(o or 0)) for r, o in re.findall(r"cp\.async\.bulk\.tensor\.2d\S* \[(%r\d+)(?:\+(-?\d+))?\]", ptx)]


def _check_row_steps(loads: list):
    """The unrolled row loop (4 rows a trip): rows 128 bytes apart from one base register."""
    assert len(loads) >= 3, loads
    (r0, o0), (r1, o1), (r2, o2) = loads[:3]
    assert r0 == r1 == r2 and (o1 - o0, o2 - o1) == (128, 128), loads


def _no_spills(ptx: str):
    from sm90_megamoe.swapab_runner import ptxas_info

    info = ptxas_info(ptx)
    if info is not None:
        assert info[1] == 0, info


def test_bf16_gather_tma_compiles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import cutlass.cute as cute
    from sm90_megamoe.compile_check import fake_args
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90

    kernel = GroupedGemmGatherSm90("swiglu", tma_rows=True)
    ptx = cute.compile(kernel, *fake_args(kernel, 128, 1536, 2048), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    assert "cp.async.cg" not in ptx and "cp.async.mbarrier.arrive.noinc" not in ptx  # no cp.async producer
    _check_row_steps(_row_loads(ptx))
    assert "shfl.sync.idx" in ptx and re.findall(r"wgmma\.mma_async[\w.]*bf16", ptx)
    _no_spills(ptx)


def test_fp8_gather_tma_compiles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import cutlass.cute as cute
    from sm90_megamoe.fp8_gather import Fp8GatherGroupedGemmSm90
    from sm90_megamoe.fp8_launch import fake_args

    kernel = Fp8GatherGroupedGemmSm90("swiglu", tma_rows=True, tile_n=64, overlap_promotion=True, wide_gated=True)
    ptx = cute.compile(kernel, *fake_args(128, 1536, 2048, "swiglu", False, False, True, False),
                       options="--gpu-arch sm_90a --keep-ptx").__ptx__
    assert "cp.async.cg" not in ptx and "e4m3.e4m3" in ptx
    _check_row_steps(_row_loads(ptx))
    _no_spills(ptx)


def test_gather_tma_needs_gather_a():
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="needs gather_a"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, gather_tma=True, compiled=object())
    with pytest.raises(ValueError, match="needs gather_a"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 128, gather_tma=True, compiled=object())


@pytest.mark.gpu
@pytest.mark.parametrize("routing,m_total", [("uniform", 5000), ("skewed", 5000), ("skewed", 1)])
def test_gpu_bf16_gather_tma_is_bit_identical(routing, m_total):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_oracle import gathered_bf16_problem
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E, n, k = 16, 1536, 2048
    src, idx, a, b, offs = gathered_bf16_problem(m_total, routing, b_seed=43, src_seed=9, idx_seed=5)
    plain = CompiledGroupedGemm("swiglu", n, k, E, False)
    rows = CompiledGroupedGemm("swiglu", n, k, E, False, gather_a=True, gather_tma=True)
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    plain(a, b, offs, out=outs[0])
    rows(src, b, offs, out=outs[1], idx=idx)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])
    want = grouped_gemm_reference(a, b, offs, "swiglu", None)
    assert float((outs[1].float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_gpu_fp8_gather_tma_is_bit_identical(routing):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_oracle import fp8_gemm_problem
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    m_total, n, k, E, t_src = 3000, 1536, 2048, 16, 500
    a, a_s, b, b_s, offs, _ = (None if t is None else t.cuda()
                               for t in fp8_gemm_problem(m_total, n, k, E, routing, 77, False))
    idx = torch.randint(0, t_src, (m_total,), generator=torch.Generator().manual_seed(6), dtype=torch.int32).cuda()
    src, src_s = a[:t_src].contiguous(), a_s[:t_src].contiguous()
    kw = dict(overlap_promotion=True, wide_gated=True)
    plain = CompiledFp8Gemm("swiglu", n, k, E, **kw)
    rows = CompiledFp8Gemm("swiglu", n, k, E, gather_a=True, gather_tma=True, **kw)
    rs = torch.ones(1, device="cuda")
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    plain(src[idx.long()].contiguous(), src_s[idx.long()].contiguous(), b, b_s, offs, out=outs[0], row_scale=rs)
    rows(src, src_s, b, b_s, offs, out=outs[1], row_scale=rs, idx=idx)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(outs[0]).any()) and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 4096])
def test_gpu_gather_tma_layer_is_bit_identical(monkeypatch, T):
    """MOE_EP_GATHER_FC1=1 with MOE_EP_GATHER_TMA 0 / 1: the BF16 layer's output is the same bits,
    eager and CUDA graph (the cp.async gather's bits are the plain FC1's: test_gather_fc1)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T + 1)
    monkeypatch.setenv("MOE_EP_GATHER_FC1", "1")

    def check(impl, on):
        assert impl.fc1.gather_a and impl.fc1.gather_tma == on

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_GATHER_TMA", cfg, "sm90_bf16_cutedsl",
                                     inputs, check)
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_GATHER_TMA", raising=False)
    assert not s.use_gather_tma(True)  # opt-in
    monkeypatch.setenv("MOE_EP_GATHER_TMA", "1")
    assert s.use_gather_tma(True) and not s.use_gather_tma(False)  # only a gathering GEMM
    assert s.GemmKey.__dataclass_fields__["gather_tma"].default is False


def test_shim_builds_the_row_tma_launcher(monkeypatch):
    """compiled_grouped_gemm(gather_a=True) under MOE_EP_GATHER_TMA=1 keys and builds the row-TMA
    launcher (recorded: no compile), and without the switch the cp.async one; the two keys differ."""
    from recorders import record_gemm_builds

    from moe_ep.shim import cache
    from moe_ep.shim.drops import sm90_megamoe as s

    built, _ = record_gemm_builds(monkeypatch)
    for flag in ("1", "0"):
        monkeypatch.setenv("MOE_EP_GATHER_TMA", flag)
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, schedule="cooperative", gather_a=True)
    with_tma = [kw for kw in built if kw.get("gather_tma")]
    without = [kw for kw in built if not kw.get("gather_tma")]
    assert with_tma and without and all(kw["gather_a"] for kw in built)
    assert sorted(k.gather_tma for k in cache.COMPILE_CACHE._store) == [False, True]
