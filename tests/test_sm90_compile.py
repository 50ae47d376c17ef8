"""CPU: the SM90 drop compiles for sm_90a through the shim, with WGMMA and TMA in the PTX;
mirrored-constant drift is caught."""

import importlib

import pytest

pytest.importorskip("cutlass")

from moe_ep.shim import SM90_MEGAMOE_CONSTANTS, ConstantDriftError, sm90_check_gemm_shapes, sm90_compile_gemm_ptx


def _no_spills(ptx: str) -> None:
    """No ``ld.local``/``st.local`` in the PTX (local arrays) and, where a ptxas is installed, none of
    the spills only ptxas makes (PTX has virtual registers); a ptxas that rejects the PTX fails."""
    assert "ld.local" not in ptx and "st.local" not in ptx, "local memory in the PTX"
    lc = importlib.import_module("sm90_megamoe.layout_compile_check")
    if lc._ptxas() is None:
        return
    info = lc.ptxas_info(ptx, "sm_90a")
    assert info is not None, "ptxas is installed but rejected the PTX"
    assert info[1] == 0, f"ptxas: {info[1]} bytes of spills ({info[0]} registers)"


@pytest.mark.parametrize("act,n,k,scale,bias,needles", [
    ("swiglu", 1536, 2048, False, None, ("ex2.approx",)),        # Qwen3 FC1: w13 [E, 2·768, 2048]
    ("squared_relu", 768, 2048, False, None, ()),                # non-gated FC1
    ("identity", 2048, 768, True, None, ()),                     # Qwen3 FC2, router weights in the epilogue
    ("gelu_glu", 1536, 2048, False, "bfloat16", ()),             # erf gelu, bf16 bias
    ("clamped_swiglu", 5760, 2880, False, "float32", ("min.f32", "max.f32")),  # gpt-oss FC1, I = 22.5 tiles
    ("identity", 2880, 2880, True, "float32", ()),               # gpt-oss FC2 with b2
])
def test_compiles_with_wgmma_and_tma(act, n, k, scale, bias, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the drop may keep PTX files in the working directory
    ptx = sm90_compile_gemm_ptx(act, n, k, scale, arch="sm_90a", bias_dtype=bias)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert ".target sm_90a" in ptx
    _no_spills(ptx)
    # drop v16: launched with PDL, so the kernel waits for the previous grid, then lets the next launch
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    for needle in needles:
        assert needle in ptx, f"{needle!r} missing from the PTX"
    if bias == "bfloat16":
        assert "ld.global.b16" in ptx or "ld.global.u16" in ptx or "ld.global.nc.b16" in ptx or "cvt.f32.bf16" in ptx


@pytest.mark.parametrize("act,n,k,scale,tile_n", [
    ("identity", 2048, 768, True, 128),   # FC2 of Qwen3 on the pingpong schedule
    ("identity", 2048, 768, True, 192),   # ... with the shim's 128 x 192 tiles (drop v71)
    ("swiglu", 1536, 2048, False, 64),    # a gated FC1: 2 x 64-wide accumulators per warpgroup
    ("swiglu", 1536, 2048, False, 96),    # ... 2 x 96: 192 accumulator registers, the limit
])
def test_pingpong_schedule_compiles(act, n, k, scale, tile_n, tmp_path):
    """The pingpong schedule compiles for sm_90a without spills and orders its two consumer
    warpgroups with named barriers (bar.arrive + bar.sync); too-wide accumulators are refused."""
    SM90_MEGAMOE_CONSTANTS.check()  # puts the drop on the path (and checks the mirror)
    cc = importlib.import_module("sm90_megamoe.compile_check")
    gg = importlib.import_module("sm90_megamoe.grouped_gemm")
    compiled = cc.compile_for_arch(act, n, k, scale, tile_n=tile_n, schedule="pingpong",
                                   extra_options=f"--dump-dir={tmp_path}")
    ptx = compiled.__ptx__
    assert "wgmma.mma_async" in ptx and "bar.arrive" in ptx
    _no_spills(ptx)  # 2 x 96 gated: at the 192-register limit
    with pytest.raises(ValueError, match="pingpong needs"):
        gg.GroupedGemmSm90("swiglu", tile_n=128, schedule="pingpong")
    with pytest.raises(ValueError, match="pingpong needs"):
        gg.GroupedGemmSm90("identity", tile_n=208, schedule="pingpong")


def test_raster_choice_by_k():
    """The shim's tile raster: 16 m-tiles per group while 16 A blocks fit the L2 budget, fewer
    for very long K (Mixtral FC2: K = 14336 -> 6), never 0."""
    from moe_ep.shim import sm90_pick_raster_m

    assert sm90_pick_raster_m(2048) == 16 and sm90_pick_raster_m(4096) == 16
    assert sm90_pick_raster_m(14336) == 6
    assert sm90_pick_raster_m(10**7) == 1


def test_schedule_choice(monkeypatch):
    """Measured on the H200 (docs/PERFORMANCE.md, thirty-first session): pingpong with 128 x 192
    tiles beats cooperative 128 x 256 on short-K FC2s (Qwen3, K 768) and loses on long ones
    (Mixtral, K 14336); gated GEMMs stay cooperative; MOE_EP_PINGPONG_MAX_K moves the bound (0 =
    never) and refuses what is not an integer."""
    from moe_ep.shim import sm90_pick_schedule

    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    assert sm90_pick_schedule("identity", 768) == ("pingpong", 192)
    assert sm90_pick_schedule("squared_relu", 768) == ("pingpong", 192)
    assert sm90_pick_schedule("identity", 2880) == ("pingpong", 192)  # gpt-oss's FC2
    for act, k in (("identity", 14336), ("identity", 4096), ("swiglu", 2048), ("swiglu", 768),
                   ("clamped_swiglu", 2880)):
        assert sm90_pick_schedule(act, k)[0] == "cooperative"
    assert sm90_pick_schedule("identity", 768, 4)[0] == "swapab"  # decode keeps swap-AB
    monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", "0")
    assert sm90_pick_schedule("identity", 768) == ("cooperative", 256)
    monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", "20000")
    assert sm90_pick_schedule("identity", 14336) == ("pingpong", 192)
    monkeypatch.setenv("MOE_EP_PINGPONG_MAX_K", "big")
    with pytest.raises(ValueError, match="MOE_EP_PINGPONG_MAX_K must be an integer"):
        sm90_pick_schedule("identity", 768)


def test_constant_drift_detected(monkeypatch):
    SM90_MEGAMOE_CONSTANTS.check()  # in sync now
    consts = importlib.import_module("sm90_megamoe.constants")
    monkeypatch.setattr(consts, "ALIGN_K_ELEMS", 16)
    with pytest.raises(ConstantDriftError, match=r"ALIGN_K_ELEMS: shim mirrors 8, drop has 16"):
        SM90_MEGAMOE_CONSTANTS.check()
    # and the shim asserts them at its first compile (before compiling anything)
    monkeypatch.setattr(SM90_MEGAMOE_CONSTANTS, "_checked", False)
    with pytest.raises(ConstantDriftError, match=r"ALIGN_K_ELEMS: shim mirrors 8, drop has 16"):
        sm90_compile_gemm_ptx("identity", 2048, 768, True, arch="sm_90a")


@pytest.mark.parametrize("act,n,k,e,frag", [
    ("swiglu", 1536, 2044, 8, "K=2044 must be a multiple of 8"),
    ("swiglu", 2 * 100, 2048, 8, "I=100 must be a multiple of 8"),
    ("clamped_swiglu", 1537, 2048, 8, "even w13 row count"),
    ("identity", 2050, 768, 8, "N=2050 must be a multiple of 8"),
    ("identity", 2048, 768, 5000, "num_experts=5000, at most 1024 experts per launch"),
    ("silu", 2048, 768, 8, "activation 'silu'"),
])
def test_shape_validation(act, n, k, e, frag):
    with pytest.raises(ValueError) as ei:
        sm90_check_gemm_shapes(act, n, k, e)
    assert frag in str(ei.value)


@pytest.mark.parametrize("kind,needles", [
    ("dispatch", ("st.release.sys", "fence.acq_rel.sys", "ld.global.v4")),
    ("wait", ("ld.acquire.sys", "globaltimer")),
    ("gather", ("ld.global.v4", "st.global.v4")),
    ("combine_send", ("st.release.sys",)),
    ("combine_reduce", ("ld.acquire.sys", "globaltimer")),
])
def test_ep_kernels_compile(kind, needles, tmp_path, monkeypatch):
    """EP kernels for W=2 (Qwen3 shape): system-scope release/acquire flags, bounded waits,
    16-byte vector copies, no float atomics and no local-memory spills."""
    from moe_ep.shim import sm90_compile_ep_ptx

    monkeypatch.chdir(tmp_path)
    ptx = sm90_compile_ep_ptx(kind, hidden=2048, topk=8, world=2, max_tokens=1024, num_experts=128)
    for n in needles:
        assert n in ptx, f"{kind}: {n!r} missing from the PTX"
    # drop v16 (PDL): every kernel waits for the previous grid first; those that spin on other ranks'
    # flags never let their successor launch early (its parked CTAs could starve a virtual rank)
    assert "griddepcontrol.wait" in ptx, kind
    assert ("griddepcontrol.launch_dependents" in ptx) == (kind not in ("wait", "combine_reduce")), kind
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.slow
def test_layout_kernels_compile(tmp_path):
    """The drop's own CPU compile check of the expert-layout kernels (sm_90a, no spills, no
    float atomics, fake/real signatures agree)."""
    import os
    import subprocess
    import sys

    from moe_ep.shim import drop_src

    env = dict(os.environ, PYTHONPATH=str(drop_src("sm90", "megamoe")) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "sm90_megamoe.layout_compile_check"], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "ALL OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def test_layout_runner_checks_on_cpu(tmp_path):
    """The drop's layout runner in ``--sim`` mode (torch models of the kernels, CPU): its own
    checks -- exact row order, the wait timeout, and LocalRoute's receive words, epoch words and
    first-bad-value record (a token with no valid choice included) -- pass against the models, so
    the GPU run of the same checks tests the kernels, not the checker."""
    import os
    import subprocess
    import sys

    from moe_ep.shim import drop_src

    env = dict(os.environ, PYTHONPATH=str(drop_src("sm90", "megamoe")) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "sm90_megamoe.layout_runner", "--sim"], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "ALL OK" in p.stdout and "route W=1" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


_TRIGGER_SNIPPET = """
import cutlass.cute as cute
from sm90_megamoe.layout_compile_check import LayoutConfig, fake_args, make_kernel
cfg = LayoutConfig(2048, 8, 1, 8192, 128)  # Qwen3, one rank: LocalRoute then LayoutPlace
for kind in ("route", "place"):
    ptx = cute.compile(make_kernel(kind, cfg), *fake_args(kind, cfg), options="--gpu-arch sm_90a --keep-ptx").__ptx__
    w = ptx.index("griddepcontrol.wait")
    t = ptx.index("griddepcontrol.launch_dependents")
    print(kind, "|", " ".join(ptx[w:t].split()[1:]))
"""


def test_local_route_triggers_its_successor_early_only_for_small_grids(tmp_path):
    """Drop v90: LocalRoute lets LayoutPlace launch early only when its grid leaves at least half the
    SMs free (``2 * nctaid <= nsmid``): a full grid's early trigger placed LayoutPlace's CTAs beside
    LocalRoute's, unevenly (H200, CUDA graph: 115-117 us against 88-90). LayoutPlace itself, whose
    successor is a GEMM that needs a whole SM, still triggers right after its wait."""
    import os
    import subprocess
    import sys

    from moe_ep.shim import drop_src

    env = dict(os.environ, PYTHONPATH=str(drop_src("sm90", "megamoe")) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _TRIGGER_SNIPPET], capture_output=True, text=True, timeout=600,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    between = dict(line.split(" | ", 1) for line in p.stdout.splitlines() if " | " in line)
    route = between["route"]
    assert "%nctaid.x" in route and "%nsmid" in route and "bra" in route, route  # a guarded trigger
    assert "bra" not in between["place"] and "%nsmid" not in between["place"], between["place"]
