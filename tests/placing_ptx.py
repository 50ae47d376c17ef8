"""PTX checks shared by the compile tests of the GEMMs that place their own A rows (drop v91's BF16
FC1, drop v92's FP8 FC1): what the placement protocol must compile to, against the plain kernel."""

import re

import pytest


def wgmmas(ptx: str) -> list:
    return re.findall(r"wgmma\.mma_async[\w.]*", ptx)


def check_placing_ptx(ptx: str, plain: str, regs: tuple) -> None:
    """``ptx`` (the placing kernel) against ``plain`` (the same GEMM without placement): the same
    WGMMAs; the TMA warp's acquire-spin on the m-tile's counter (bounded by %globaltimer, giving up
    once another tile has timed out), then a proxy fence, then A's TMA loads (2-d); the copy warps'
    16-byte loads and stores, a fence per lane and the count released by lane 0; ``regs`` = (producer,
    consumers) per thread by setmaxnreg; no local memory; none of this in the plain kernel; no spills
    (local ptxas; skips without it)."""
    from sm90_megamoe.swapab_runner import ptxas_info

    assert wgmmas(ptx) == wgmmas(plain) and wgmmas(ptx)
    spin = ptx.index("ld.acquire.gpu.global.b32")
    assert spin < ptx.index("fence.proxy.async.global") < ptx.index("cp.async.bulk.tensor.2d")
    assert "%globaltimer" in ptx and "ld.relaxed.gpu.global.b32" in ptx
    assert "fence.acq_rel.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx
    assert re.search(r"ld\.global\.v4\.(b32|u32)", ptx) and re.search(r"st\.global\.v4\.(b32|u32)", ptx)
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{regs[0]};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{regs[1]};" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "fence.proxy.async.global" not in plain and "red.release.gpu" not in plain
    info = ptxas_info(ptx)
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0, info
