"""CPU: drop v22's ``wide`` schedule of the BF16 grouped GEMM (gated FC1: one m64n256 WGMMA over
the gate and up tiles of a stage instead of two m64n128) -- it compiles without spills, the shim
picks it only with MOE_EP_WIDE_GATED=1, and what it relies on holds: the two B slots of a stage are the bytes of
one 256-row tile, and the 256-wide accumulator is the gate accumulator followed by the up one."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

from moe_ep.shim import SM90_MEGAMOE_CONSTANTS
from moe_ep.shim import drop_src
from moe_oracle import no_ptxas_result

SRC = drop_src("sm90", "megamoe")


def _compile(**kw):
    SM90_MEGAMOE_CONSTANTS.check()  # puts the drop on the path (and checks the mirror)
    from sm90_megamoe.compile_check import compile_for_arch

    return compile_for_arch(**kw)


@pytest.mark.parametrize("act,n,k,experts,bias,raster", [
    ("swiglu", 1536, 2048, 128, None, 16),               # Qwen3 FC1
    ("clamped_swiglu", 5760, 2880, 128, "bfloat16", 4),  # gpt-oss FC1: I = 22.5 tiles, bf16 bias
])
def test_wide_schedule_compiles_without_spills(act, n, k, experts, bias, raster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ptx = _compile(activation=act, n=n, k=k, scale_rows=False, num_experts=experts, bias_dtype=bias,
                   raster_m=raster, schedule="wide").__ptx__
    from sm90_megamoe.swapab_runner import _ptxas, ptxas_info
    wgmma = set(re.findall(r"wgmma\.mma_async[\w.]*", ptx))
    assert wgmma == {"wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"}, wgmma
    assert "cp.async.bulk.tensor" in ptx and "griddepcontrol.wait" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    info = ptxas_info(ptx)
    if info is None:
        no_ptxas_result()
    assert info[1] == 0, info
    # ptxas does not serialise the WGMMAs (C7510 / C7514 would say so)
    exe = _ptxas()
    src = tmp_path / "k.ptx"
    for ver in (None, "9.0", "8.8", "8.7", "8.5"):
        src.write_text(ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}", ptx, flags=re.M))
        p = subprocess.run([exe, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.o")],
                           capture_output=True, text=True)
        if p.returncode == 0:
            break
    assert p.returncode == 0, p.stderr[-2000:]
    assert "C7510" not in p.stderr and "C7514" not in p.stderr, p.stderr[-2000:]


def test_wide_schedule_refuses():
    SM90_MEGAMOE_CONSTANTS.check()
    from sm90_megamoe.grouped_gemm import GroupedGemmSm90

    for kw in (dict(activation="identity"), dict(activation="swiglu", tile_n=256),
               dict(activation="swiglu", epilogue="direct")):
        with pytest.raises(ValueError, match="schedule 'wide' needs a gated activation"):
            GroupedGemmSm90(schedule="wide", **kw)


def test_shim_picks_wide_only_when_asked(monkeypatch):
    """Opt-in (MOE_EP_WIDE_GATED=1): bit-identical but no faster than cooperative on the H200."""
    from moe_ep.shim import sm90_pick_schedule

    monkeypatch.delenv("MOE_EP_WIDE_GATED", raising=False)
    assert sm90_pick_schedule("swiglu", 2048) == ("cooperative", 128)
    monkeypatch.setenv("MOE_EP_WIDE_GATED", "1")
    for act, k in (("swiglu", 2048), ("gelu_glu", 4096), ("clamped_swiglu", 2880)):
        assert sm90_pick_schedule(act, k) == ("wide", 128)
    assert sm90_pick_schedule("identity", 768)[0] == "pingpong"  # the wide switch leaves FC2 alone
    assert sm90_pick_schedule("identity", 14336)[0] == "cooperative"
    assert sm90_pick_schedule("swiglu", 2048, 4)[0] == "swapab"  # decode keeps swap-AB


_PROBE = """
import sys, json
sys.path.insert(0, {src!r})
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from sm90_megamoe.grouped_gemm import LayoutEnum
out = {{"coords": {{}}, "b": []}}
@cute.jit
def run():
    kmaj = LayoutEnum.ROW_MAJOR
    for n in (128, 256):
        tm = sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, kmaj.sm90_mma_major_mode(),
                                               kmaj.sm90_mma_major_mode(), cutlass.Float32, (2, 1, 1),
                                               tiler_mn=(64, n))
        for t in list(range(0, 256, 5)):  # a Python list: iterated at trace time, not staged
            c = tm.get_slice(t).partition_C(cute.make_identity_tensor((128, n)))
            out["coords"][f"{{n}},{{t}}"] = [[int(c[i][0]), int(c[i][1])] for i in list(range(cute.size(c)))]
    # B: 2 x 3 slots of 128 rows (gate, up per stage) and 3 stages of one 256-row tile
    slots = sm90_utils.make_smem_layout_b(kmaj, (128, 128, 64), cutlass.BFloat16, 6)
    wide = sm90_utils.make_smem_layout_b(kmaj, (128, 256, 64), cutlass.BFloat16, 3)
    out["swizzle"] = [str(slots.inner), str(wide.inner)]
    for s in list(range(3)):
        for n in list(range(256)):
            for k in [0, 1, 17, 63]:
                out["b"].append([int(cute.crd2idx((n % 128, k, 2 * s + n // 128), slots.outer)),
                                 int(cute.crd2idx((n, k, s), wide.outer))])
run()
print(json.dumps(out))
"""


def test_wide_schedule_layout_assumptions(tmp_path):
    """CuTe's own layouts, not a model of them: (1) B slot 2s + h row r, column k sits where the
    256-row tile of stage s has row 128 h + r, same swizzle; (2) in the 256-wide accumulator,
    element i < 64 is the 128-wide one's element i and element i + 64 the same place 128 columns
    on (the up value of that gate value) -- for every 5th thread of both consumer warpgroups."""
    script = tmp_path / "probe.py"  # a file: CuTeDSL compiles a function from its source
    script.write_text(_PROBE.format(src=str(SRC)))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["swizzle"][0] == got["swizzle"][1]
    assert len(got["b"]) == 3 * 256 * 4 and all(a == b for a, b in got["b"])
    for t in range(0, 256, 5):
        c128, c256 = got["coords"][f"128,{t}"], got["coords"][f"256,{t}"]
        assert len(c128) == 64 and len(c256) == 128
        assert c256[:64] == c128
        assert all(c256[i + 64] == [c128[i][0], c128[i][1] + 128] for i in range(64))
