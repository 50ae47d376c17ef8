"""The swap-AB (decode) grouped GEMM of the SM90 drop, ``sm90_megamoe.swapab_gemm``.

CPU: every variant compiles for sm_90a from fake tensors; the PTX has the small-N WGMMA
(m64n{tile_t}k16), TMA loads, no local memory; ``ptxas -v`` reports no spills.
GPU (``pytest -m gpu``, SM90): FC1 (swiglu) and FC2 (identity + row scale) of Qwen3-30B-A3B for
T in (1, 3, 8, 128, 256) tokens x top-8, uniform and skewed routing, against a float64 reference
with NaN-poisoned outputs; plus ragged shapes, bias and the other activations.
"""

import zlib

import pytest
import torch

pytest.importorskip("cutlass")

# the drop tree the installed moe_ep uses (an installed copy, not this checkout, on the GPU host),
# registered through the shim so later shim imports in this process find the same modules
from moe_ep.shim import drop_src, register_drop  # noqa: E402

_DROP_SRC = drop_src("sm90", "megamoe")
register_drop(_DROP_SRC)

from sm90_megamoe import swapab_runner as sr  # noqa: E402
from sm90_megamoe.swapab_gemm import SwapABGroupedGemmSm90, pick_tile_t  # noqa: E402
from moe_oracle import no_ptxas_result  # noqa: E402

H, I, E, TOPK = sr.MODELS["qwen3"]


# ------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("act,n,k,e,scale,tile_t,tile_w,bias", [
    ("swiglu", 2 * I, H, E, False, 8, None, None),          # Qwen3 FC1, 1..8 tokens
    ("swiglu", 2 * I, H, E, False, 16, None, None),         # Qwen3 FC1, 128 tokens
    ("identity", H, I, E, True, 16, None, None),            # Qwen3 FC2 with router weights
    ("identity", H, I, E, True, 8, None, None),
    ("swiglu", 2 * 14336, 4096, 8, False, 64, None, None),  # Mixtral FC1, 128 tokens
    ("identity", 4096, 14336, 8, True, 64, None, None),     # Mixtral FC2
    ("swiglu", 2 * I, H, E, False, 32, 128, "float32"),     # two consumer warpgroups, gated, bias
    ("squared_relu", I, H, E, False, 32, 256, "bfloat16"),  # m_rep = 2, bf16 bias
])
def test_swapab_compiles(act, n, k, e, scale, tile_t, tile_w, bias, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kern, compiled = sr.compile_swapab(act, n, k, e, scale, tile_t, tile_w=tile_w, bias_dtype=bias)
    ptx = compiled.__ptx__
    assert f"wgmma.mma_async.sync.aligned.m64n{tile_t}k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor" in ptx
    checks = sr.ptx_checks(ptx, tile_t)
    assert all(checks.values()), checks
    assert kern.num_stages >= 4, "the weight pipeline should be deep"
    info = sr.ptxas_info(ptx, "sm_90a")
    if info is None:
        no_ptxas_result()
    regs, spill = info
    assert spill == 0, f"ptxas reports {spill} bytes of spill/stack ({regs} registers)"
    # 1 consumer warpgroup: 256 threads; 2: 384 threads under setmaxnreg (168 at launch)
    assert regs <= (168 if kern.num_mma_wg == 2 else 255)



_EARLY_CHECK = """
import re
from moe_ep.shim import drop_src, register_drop
register_drop(drop_src("sm90", "megamoe"))
from sm90_megamoe.swapab_runner import compile_swapab
out = []
for early in (False, True):
    kern, c = compile_swapab("identity", 2048, 768, 128, True, 16, early_weights=early)
    body = c.__ptx__[c.__ptx__.index(".entry"):]
    out.append(re.sub(r"^\s*//.*$|\.loc.*$", "", body, flags=re.M))
pf, wt = out[1].find("cp.async.bulk.prefetch.tensor"), out[1].find("griddepcontrol.wait")
print("RESULT", out[0] == out[1], pf >= 0, 0 <= pf < wt, out[1].count("cp.async.bulk.prefetch.tensor"))
"""


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_early_weights_prefetch_only_with_pdl(pdl, tmp_path):
    """Drop v18: FC2's swap-AB kernel with ``early_weights`` prefetches its first 8 weight k-blocks
    (128 KB) into L2 before the PDL wait when the drop launches with PDL (SM90_MEGAMOE_PDL=1);
    without PDL its PTX is that of the plain kernel."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SM90_MEGAMOE_PDL=pdl, CUTE_DSL_DUMP_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", _EARLY_CHECK], capture_output=True, text=True, timeout=600,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    same, has_prefetch, before_wait, count = p.stdout.split("RESULT")[1].split()
    if pdl == "0":
        assert (same, has_prefetch) == ("True", "False")
    else:
        assert (same, has_prefetch, before_wait) == ("False", "True", "True") and int(count) >= 1


def test_swapab_parameter_checks():
    k = SwapABGroupedGemmSm90("swiglu", tile_t=16)
    assert k.static_shapes(2 * I, H) == (I, I // 64)
    assert SwapABGroupedGemmSm90("identity", scale_rows=True).static_shapes(H, I) == (H, H // 128)
    with pytest.raises(ValueError, match=r"tile_t must be a multiple of 8 in \[8, 128\], got 12"):
        SwapABGroupedGemmSm90("swiglu", tile_t=12)
    with pytest.raises(ValueError, match="tile_w must be 64, 128 or 256, got 96"):
        SwapABGroupedGemmSm90("swiglu", tile_w=96)
    with pytest.raises(ValueError, match="accumulators need 256 fp32 registers"):  # 2 x 2 x 128 / 2
        SwapABGroupedGemmSm90("swiglu", tile_w=256, tile_t=128)
    with pytest.raises(ValueError, match="activation must be one of .*got 'nope'"):
        SwapABGroupedGemmSm90("nope")
    assert pick_tile_t(8, 128) == 8 and pick_tile_t(1024, 128) == 16
    assert pick_tile_t(2048, 128) == 32 and pick_tile_t(256, 8) == 64


def test_swapab_runner_compile_only(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sr.main(["--model", "qwen3", "--tokens", "1", "--compile-only"]) == 0
    out = capsys.readouterr().out
    assert "FC1" in out and "FC2" in out and "FAIL" not in out


# ------------------------------------------------------------------------------------------ GPU
_FNS = {}


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False


def _fn(act, n, k, e, scale, tile_t, tile_w=None, bias=None):
    key = (act, n, k, e, scale, tile_t, tile_w, bias)
    if key not in _FNS:
        _FNS[key] = sr.CompiledSwapAB(act, n, k, e, scale, tile_t, tile_w=tile_w, bias_dtype=bias)
    return _FNS[key]


def ref64(a, b, offs, act, row_scale=None, bias=None):
    """float64 reference: act(A_e B_e^T + bias_e) * row_scale, per expert."""
    o = [int(x) for x in offs.tolist()]
    n = b.shape[1]
    gated = act in ("swiglu", "gelu_glu", "clamped_swiglu")
    out = torch.zeros(a.shape[0], n // 2 if gated else n, dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):
        if o[e + 1] <= o[e]:
            continue
        h = a[o[e]:o[e + 1]].double() @ b[e].double().t()
        if bias is not None:
            h = h + bias[e].double()
        if gated:
            g, u = h[:, : n // 2], h[:, n // 2:]
        if act == "swiglu":
            h = torch.nn.functional.silu(g) * u
        elif act == "gelu_glu":
            h = 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u
        elif act == "clamped_swiglu":
            g = g.clamp(max=7.0)
            h = (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
        elif act == "squared_relu":
            h = torch.relu(h).square()
        out[o[e]:o[e + 1]] = h
    if row_scale is not None:
        out = out * row_scale.double()[:, None]
    return out


def run_case(act, n, k, e, offs_cpu, gen, scale=False, tile_t=None, tile_w=None, bias=None,
             amp=1.0, w_std=0.02):
    m = int(offs_cpu[-1])
    tile_t = tile_t or pick_tile_t(m, e)
    fn = _fn(act, n, k, e, scale, tile_t, tile_w, bias)
    dgen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    a = (torch.randn(m, k, generator=dgen, device="cuda") * amp).to(torch.bfloat16)
    b = (torch.randn(e, n, k, generator=dgen, device="cuda") * w_std).to(torch.bfloat16)
    rs = torch.rand(m, generator=dgen, device="cuda") if scale else None
    bt = None
    if bias is not None:
        bt = (torch.randn(e, n, generator=dgen, device="cuda") * 0.5).to(getattr(torch, bias))
    out = torch.full((m, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
    fn(a, b, offs_cpu.cuda(), out=out, row_scale=rs, bias=bt)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), f"{act} T-rows={m}: unwritten (NaN) output rows"
    ref = ref64(a, b, offs_cpu, act, rs, bt)
    err = (out.double() - ref).norm().item() / max(ref.norm().item(), 1e-30)
    assert err < 1e-2, f"{act} n={n} k={k} rows={m} tile_t={tile_t}: rel err {err:.3e}"
    tol = 1.6e-2 * ref.abs() + 2e-3 * ref.abs().max()
    bad = ((out.double() - ref).abs() > tol).sum().item()
    assert bad == 0, f"{act} n={n} k={k} rows={m} tile_t={tile_t}: {bad} elements off"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 8, 128, 256])
@pytest.mark.parametrize("routing", ["uniform", "one", "zero_hole"])
def test_swapab_decode_qwen3(T, routing):
    """FC1 (swiglu) and FC2 (identity x router weight) at decode sizes. 'one': every row to
    expert 0 (256 x 8 = 2048 rows: many token tiles of one weight tile); 'zero_hole': top-8
    uniform over all experts but one, which gets no rows."""
    _sm90()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{T}/{routing}".encode()))
    _, offs = sr.route(T, E, TOPK, gen, routing)
    if routing == "zero_hole":
        assert int(offs[E // 2 + 1] - offs[E // 2]) == 0
    run_case("swiglu", 2 * I, H, E, offs, gen)
    run_case("identity", H, I, E, offs, gen, scale=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_t", [8, 64])
def test_swapab_token_tiles(tile_t):
    """Several token tiles per expert (tile_t = 8 at 128 tokens) and a wide one (64)."""
    _sm90()
    gen = torch.Generator().manual_seed(tile_t)
    _, offs = sr.route(128, E, TOPK, gen)
    run_case("swiglu", 2 * I, H, E, offs, gen, tile_t=tile_t)
    run_case("identity", H, I, E, offs, gen, scale=True, tile_t=tile_t)


@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,e,scale,tile_w,tile_t,bias", [
    ("swiglu", 2 * 200, 264, 5, False, None, 16, "float32"),    # I % 64 != 0, K % 64 != 0
    ("identity", 1000, 200, 5, True, None, 32, "bfloat16"),     # N % 128 != 0
    ("swiglu", 2 * 104, 520, 3, True, 128, 8, None),           # two warpgroups, gated
    ("gelu_glu", 2 * 256, 256, 4, False, None, 16, None),
    ("clamped_swiglu", 2 * 192, 512, 4, False, None, 16, "float32"),
    ("squared_relu", 768, 512, 4, False, 256, 32, None),       # m_rep = 2
])
def test_swapab_ragged_shapes(act, n, k, e, scale, tile_w, tile_t, bias):
    _sm90()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{act}/{n}/{k}".encode()))
    counts = torch.tensor([37, 0, 1, 70, 9][:e])
    offs = torch.zeros(e + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(counts, 0).to(torch.int32)
    amp = 4.0 if act == "clamped_swiglu" else 1.0
    run_case(act, n, k, e, offs, gen, scale=scale, tile_t=tile_t, tile_w=tile_w, bias=bias,
             amp=amp, w_std=k ** -0.5)
