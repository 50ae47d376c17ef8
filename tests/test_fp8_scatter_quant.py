"""The scattering FP8 row quantiser (drop v25, ``Fp8ScatterQuantizeRows128``): each valid slot's
row quantised once and stored in the grouped rows ``pos[s, :]`` names -- the gathering quantiser's
rows and bits with ``idx`` the inverse of ``pos``. CPU: the compiled kernel (one quantisation, top_k
stores), its fake signature against real tensors, the launcher's argument checks. GPU: bit for bit
against ``fp8_reference.quantize_rows128`` and the gathering quantiser, over two sources with
stale ``pos`` rows in their invalid slots, -1 choices and rows nobody names (left poisoned)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe import fp8_reference as ref  # noqa: E402
from sm90_megamoe.fp8_quant import (  # noqa: E402
    CompiledFp8QuantizeRows,
    Fp8ScatterQuantizeRows128,
    compile_fp8_quantize_rows,
)


@pytest.mark.parametrize("k,topk", [(2048, 8), (4096, 2), (7168, 8)])
def test_compiles_one_quantisation_and_topk_stores(k, topk):
    from sm90_megamoe.layout_compile_check import ptxas_info

    ptx = compile_fp8_quantize_rows(k, scatter_topk=topk, keep_ptx=True).__ptx__
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 8          # 16 values per lane, converted once
    assert ptx.count("ld.global.v4.b32") == 2                      # the row's 32 bytes per lane, read once
    assert ptx.count("st.global.v4.b32") == topk                   # ... stored once per choice
    assert ptx.count("rcp.rn.f32") == 1 and "rcp.approx" not in ptx and ".ftz" not in ptx
    assert re.search(r"\.entry \w*kernel_scatter", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    info = ptxas_info(ptx, "sm_90a")
    if info is None:
        pytest.skip("no ptxas installed: spill check skipped")
    assert info[1] == 0 and info[0] <= 64, info  # 4 CTAs of 256 threads per SM


def test_fake_signature_matches_real_tensors():
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from sm90_megamoe.ep_compile_check import same_signature

    k, topk, S, M = 768, 4, 13, 41
    fake = compile_fp8_quantize_rows(k, scatter_topk=topk, keep_ptx=True)
    args = CompiledFp8QuantizeRows.cute_args(
        torch.zeros(S, k, dtype=torch.bfloat16), torch.zeros(M, k, dtype=torch.float8_e4m3fn),
        torch.zeros(M, k // 128, dtype=torch.float32), torch.zeros(3, dtype=torch.int32),
        torch.zeros(S + 2, topk, dtype=torch.int32))
    args = args[:3] + [args[4], args[3]]  # pos, then recv_count
    real = cute.compile(Fp8ScatterQuantizeRows128(k, topk), *args, cutlass.Int32(1), make_fake_stream(),
                        options="--gpu-arch sm_90a --keep-ptx")
    assert same_signature(fake, real)


def test_launcher_refuses_bad_arguments_before_launch():
    kern = CompiledFp8QuantizeRows(256, compiled=object(), scatter_topk=2)  # never launched
    x = torch.zeros(6, 256, dtype=torch.bfloat16)
    q, s = torch.zeros(10, 256, dtype=torch.uint8), torch.zeros(10, 2)
    pos, cnt = torch.zeros(6, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="pos, recv_count and t_max"):
        kern(x, q, s, pos=pos, recv_count=cnt)
    with pytest.raises(ValueError, match=r"pos must be .*\[>= 6, 2\]"):
        kern(x, q, s, pos=torch.zeros(5, 2, dtype=torch.int32), recv_count=cnt, t_max=3)
    with pytest.raises(ValueError, match="pos must be"):
        kern(x, q, s, pos=pos.long(), recv_count=cnt, t_max=3)
    with pytest.raises(ValueError, match="t_max must be >= 1"):
        kern(x, q, s, pos=pos, recv_count=cnt, t_max=0)
    with pytest.raises(ValueError, match="recv_count must be .* >= 3"):
        kern(x, q, s, pos=pos, recv_count=cnt, t_max=2)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        kern(x.float(), q, s, pos=pos, recv_count=cnt, t_max=3)
    with pytest.raises(ValueError, match="scatter_topk excludes"):
        CompiledFp8QuantizeRows(256, compiled=object(), scatter_topk=2, gather=True)
    with pytest.raises(ValueError, match="topk"):
        Fp8ScatterQuantizeRows128(256, 0)


def _scatter_case(gen, k, topk, t_max, counts, M_extra=37):
    """Rows of two (or more) sources, their routing as a layout would place it: every valid (slot,
    choice) gets a distinct grouped row in stable expert order, some choices -1, invalid slots
    keep stale rows. Returns x, pos, recv_count, idx (the inverse, for the gathering quantiser), n."""
    W = len(counts)
    S = W * t_max
    x = (torch.randn(S, k, generator=gen) * torch.logspace(-3, 3, S).unsqueeze(1)).to(torch.bfloat16)
    x[1, :128] = 0.0                                                # an all-zero group
    experts = torch.randint(0, 5, (S, topk), generator=gen)
    experts[torch.rand(S, topk, generator=gen) < 0.1] = -1          # dropped choices
    valid = torch.tensor([s % t_max < counts[s // t_max] for s in range(S)])
    pairs = [(int(experts[s, kk]), s, kk) for s in range(S) if valid[s] for kk in range(topk) if experts[s, kk] >= 0]
    pairs.sort()                                                    # by expert, then (slot, k)
    pos = torch.randint(0, len(pairs) + M_extra, (S, topk), generator=gen, dtype=torch.int32)  # stale
    pos[valid] = -1
    idx = torch.full((len(pairs) + M_extra,), -1, dtype=torch.int32)
    for r, (_, s, kk) in enumerate(pairs):
        pos[s, kk] = r
        idx[r] = s
    return x, pos, torch.tensor(counts, dtype=torch.int32), idx, len(pairs)


@pytest.mark.gpu
@pytest.mark.parametrize("k,topk,t_max,counts", [(2048, 8, 64, [64]), (2048, 8, 40, [33, 0, 40]),
                                                 (4096, 2, 50, [17, 50]), (768, 4, 30, [0])])
def test_gpu_scatter_matches_reference_and_the_gathering_quantiser(k, topk, t_max, counts):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    gen = torch.Generator().manual_seed(k + topk + t_max)
    x, pos, cnt, idx, n = _scatter_case(gen, k, topk, t_max, counts)
    M = idx.shape[0]
    q = torch.full((M, k), 0x5A, dtype=torch.uint8, device="cuda")          # poison
    s = torch.full((M, k // 128), float("nan"), device="cuda")
    CompiledFp8QuantizeRows(k, scatter_topk=topk)(x.cuda(), q, s, pos=pos.cuda(), recv_count=cnt.cuda(), t_max=t_max)
    torch.cuda.synchronize()
    eq, es = ref.quantize_rows128(x[idx[:n].long()].float())
    assert torch.equal(q[:n].cpu(), eq.view(torch.uint8)) and torch.equal(s[:n].cpu(), es)
    assert bool((q[n:] == 0x5A).all()) and bool(s[n:].isnan().all())      # rows nobody names
    # the gathering quantiser on the same layout: the same bytes
    gq = torch.full_like(q, 0x5A)
    gs = torch.full_like(s, float("nan"))
    CompiledFp8QuantizeRows(k, gather=True)(x.cuda(), gq, gs, count=torch.tensor([n], dtype=torch.int32, device="cuda"),
                                            idx=idx.clamp(min=0).cuda())
    torch.cuda.synchronize()
    assert torch.equal(gq, q) and torch.equal(gs[:n], s[:n])
