"""Drop v75 (not yet run on a GPU): L2 eviction priorities in the BF16 gathering FC1's producer
(``gather_l2``; ``MOE_EP_GATHER_L2``). Level 1 gives every gathered token row's cp.async an
``evict_last`` policy, so the rows stay in L2 between their K uses while the weights stream past.
Level 2 also gives the weight tiles' TMA loads ``evict_first``. The copies are inline PTX aimed at
the swizzled shared address the atom's copy would compute.

CPU: levels 1 and 2 compile for sm_90a to the same eight 16-byte copies per thread and k-tile as
level 0, now with ``L2::cache_hint`` and ``createpolicy``, and without spills. Each copy's
destination is XOR-swizzled as CuTeDSL's own copy does. Refusals, the shim's switch and key.
GPU: the bits equal level 0's and the plain FC1's on the copied rows, and the layer's output is the
same with the switch off and on, eager and under a CUDA graph."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

HINTED = r"cp\.async\.cg\.shared\.global\.L2::cache_hint \[(%r\d+)\], \[%rd\d+\], 16, 16, (%rd\d+);"


def _ptx(level: int, tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.compile_check import compile_for_arch

    return compile_for_arch("swiglu", 1536, 2048, False, raster_m=16, gather_a=True, gather_l2=level).__ptx__


def _def_of(reg: str, ptx: str) -> str:
    """The PTX line that writes ``reg`` (its last definition before the first use)."""
    lines = [ln.strip() for ln in ptx.splitlines() if re.match(rf"\s*\S+\s+{re.escape(reg)},", ln)]
    assert lines, reg
    return lines[-1]


@pytest.mark.parametrize("level", [1, 2])
def test_gather_l2_compiles(level, tmp_path, monkeypatch):
    plain = _ptx(0, tmp_path, monkeypatch)
    ptx = _ptx(level, tmp_path, monkeypatch)
    assert "L2::cache_hint" not in plain.replace("bytes.L2::cache_hint", "")  # level 0: the atom's copies
    hinted = re.findall(HINTED, ptx)
    assert hinted and len(hinted) % 8 == 0, len(hinted)  # eight 16-byte copies per thread and k-tile
    assert not re.findall(r"cp\.async\.cg\.shared\.global \[", ptx)  # every row copy carries the policy
    # one evict_last policy, made once and used by every row copy
    policies = {p for _, p in hinted}
    assert len(policies) == 1
    assert "createpolicy.fractional.L2::evict_last.b64" in _def_of(policies.pop(), ptx)
    # each destination is the 128-byte swizzle of its address: a ^ ((a >> 3) & 112)
    xor = _def_of(hinted[0][0], ptx)
    assert xor.startswith("xor.b32"), xor
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx and "ld.local" not in ptx
    # the weights: by TMA, evict_first at level 2 (a createpolicy register), else CuTeDSL's 0 policy
    b_policy = re.findall(r"cp\.async\.bulk\.tensor\.3d\S*L2::cache_hint \[[^]]+\], \[[^]]+\], \[[^]]+\], (%rd\d+);", ptx)
    assert b_policy
    defs = {_def_of(r, ptx) for r in b_policy}
    if level == 2:
        assert all("createpolicy.fractional.L2::evict_first.b64" in d for d in defs), defs
    else:
        assert all(d.startswith("mov.b64") and d.endswith(", 0;") for d in defs), defs
    from sm90_megamoe.swapab_runner import ptxas_info

    info = ptxas_info(ptx)
    if info is not None:
        assert info[1] == 0, info


def test_gather_l2_swizzle_matches_the_atom():
    """The hand swizzle is the 128-byte one of a 1024-byte aligned stage: chunk c of row r at c ^ (r % 8)."""
    from sm90_megamoe.gather_producer import _swizzle_128b

    for base in (0, 1024, 7 * 16384 + 2048):
        for r in range(16):
            for c in range(8):
                a = base + 128 * r + 16 * c
                assert _swizzle_128b(a) == base + 128 * r + 16 * (c ^ (r % 8))


def test_gather_l2_refusals():
    from sm90_megamoe.compile_check import compile_for_arch
    from sm90_megamoe.grouped_gemm_gather import GroupedGemmGatherSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    with pytest.raises(ValueError, match="needs gather_a"):
        CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, gather_l2=1, compiled=object())
    with pytest.raises(ValueError, match="l2_hints must be one of"):
        GroupedGemmGatherSm90("swiglu", l2_hints=3)
    with pytest.raises(ValueError, match="not tma_rows"):
        GroupedGemmGatherSm90("swiglu", tma_rows=True, l2_hints=1)
    with pytest.raises(ValueError, match="needs gather_a"):
        compile_for_arch("swiglu", 1536, 2048, False, gather_l2=1)
    fn = CompiledGroupedGemm("swiglu", 1536, 2048, 128, False, gather_a=True, gather_l2=2, compiled=object())
    assert fn.gather_l2 == 2 and fn.kernel.gather_l2 == 2


def test_shim_switch_and_key(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv("MOE_EP_GATHER_L2", raising=False)
    assert s.use_gather_l2(True, False) == 0  # opt-in
    for raw, want in (("0", 0), ("1", 1), ("2", 2)):
        monkeypatch.setenv("MOE_EP_GATHER_L2", raw)
        assert s.use_gather_l2(True, False) == want
    assert s.use_gather_l2(False, False) == 0 and s.use_gather_l2(True, True) == 0  # cp.async rows only
    for bad in ("3", "yes", "-1"):
        monkeypatch.setenv("MOE_EP_GATHER_L2", bad)
        with pytest.raises(ValueError, match="MOE_EP_GATHER_L2"):
            s.use_gather_l2(True, False)
    assert s.GemmKey.__dataclass_fields__["gather_l2"].default == 0


def test_shim_builds_the_hinted_launcher(monkeypatch):
    """compiled_grouped_gemm(gather_a=True) under MOE_EP_GATHER_L2=2 keys and builds the hinted
    launcher (recorded: no compile) under its own kernel name; without the switch the plain one."""
    from recorders import record_gemm_builds

    from moe_ep.shim import cache
    from moe_ep.shim.drops import sm90_megamoe as s

    built, names = record_gemm_builds(monkeypatch)
    monkeypatch.delenv("MOE_EP_GATHER_TMA", raising=False)
    for flag in ("2", "0"):
        monkeypatch.setenv("MOE_EP_GATHER_L2", flag)
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, schedule="cooperative", gather_a=True)
    assert [kw.get("gather_l2", 0) for kw in built[::2]] == [2, 0]
    assert [n.startswith("gemm_swiglu_gather_l2h2") for n in names] == [True, False], names
    assert "_l2h" not in names[1]
    assert sorted(k.gather_l2 for k in cache.COMPILE_CACHE._store) == [0, 2]


@pytest.mark.gpu
@pytest.mark.parametrize("routing,m_total", [("uniform", 5000), ("skewed", 5000), ("skewed", 300), ("skewed", 1)])
def test_gpu_gather_l2_is_bit_identical(routing, m_total):
    from moe_oracle import require_sm90

    require_sm90()
    from moe_oracle import gathered_bf16_problem
    from sm90_megamoe.launch import CompiledGroupedGemm
    from sm90_megamoe.reference import grouped_gemm_reference

    E, n, k = 16, 1536, 2048
    src, idx, a, b, offs = gathered_bf16_problem(m_total, routing, b_seed=47, src_seed=11, idx_seed=7)
    plain = CompiledGroupedGemm("swiglu", n, k, E, False)
    gathers = [CompiledGroupedGemm("swiglu", n, k, E, False, gather_a=True, gather_l2=lvl) for lvl in (0, 1, 2)]
    outs = [torch.full((m_total, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    plain(a, b, offs, out=outs[0])
    for fn, out in zip(gathers, outs[1:]):
        fn(src, b, offs, out=out, idx=idx)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0].float()).all()
    for lvl, out in zip((0, 1, 2), outs[1:]):
        assert torch.equal(outs[0], out), f"gather_l2={lvl}"
    want = grouped_gemm_reference(a, b, offs, "swiglu", None)
    assert float((outs[3].float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [700, 4096])
def test_gpu_gather_l2_layer_is_bit_identical(monkeypatch, T):
    """MOE_EP_GATHER_FC1=1 with MOE_EP_GATHER_L2 0 / 2: the BF16 layer's output is the same bits,
    eager and CUDA graph."""
    from moe_oracle import require_sm90

    require_sm90()
    from moe_oracle import layer_outputs_with_switch, qwen3_gather_layer

    cfg, inputs = qwen3_gather_layer(T, seed=T + 3)
    monkeypatch.setenv("MOE_EP_GATHER_FC1", "1")
    monkeypatch.delenv("MOE_EP_GATHER_TMA", raising=False)

    def check(impl, on):
        assert impl.fc1.gather_a and impl.fc1.compiled.gather_l2 == (2 if on else 0)

    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_GATHER_L2", cfg, "sm90_bf16_cutedsl",
                                     inputs, check, values=("0", "2"))
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[0], outs[1])
