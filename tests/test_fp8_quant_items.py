"""Drop v54: the FP8 row quantisers take ``items`` warp items per loop pass and issue all their loads
before quantising any (more bytes in flight per warp; the same groups, rows and bits for every
``items``). CPU: the PTX of items 2 and 4 (plain, counted, gathering, scattering) has items times the
loads, conversions and stores of items 1 and no local memory; bad ``items`` are refused. GPU: each
variant bit for bit against ``fp8_reference.quantize_rows128`` (poisoned outputs; device counts,
``m_rows``, clamped gather indices, scattered rows, grids capped to force many passes)."""

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe import fp8_reference as ref  # noqa: E402
from sm90_megamoe.fp8_quant import (  # noqa: E402
    CompiledFp8QuantizeRows,
    Fp8QuantizeRows128,
    Fp8ScatterQuantizeRows128,
    compile_fp8_quantize_rows,
)

_COMPILED = {}


def _compiled(k, items, **kw):
    key = (k, items, tuple(sorted(kw.items())))
    if key not in _COMPILED:
        _COMPILED[key] = compile_fp8_quantize_rows(k, items=items, keep_ptx=True, **kw)
    return _COMPILED[key]


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("items", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "counted", "gather", "scatter"])
def test_ptx_has_items_times_the_work(kind, items):
    kw = {"plain": {}, "counted": dict(counted=True), "gather": dict(gather=True),
          "scatter": dict(scatter_topk=4)}[kind]
    ptx, base = _compiled(768, items, **kw).__ptx__, _compiled(768, 1, **kw).__ptx__
    for op in ("ld.global.v4.b32", "st.global.v4.b32", "cvt.rn.satfinite.e4m3x2.f32", "rcp.rn.f32"):
        assert ptx.count(op) == items * base.count(op), (op, ptx.count(op), base.count(op))
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_bad_items_are_refused():
    for bad in (0, 5):
        with pytest.raises(ValueError, match="items"):
            Fp8QuantizeRows128(768, items=bad)
        with pytest.raises(ValueError, match="items"):
            Fp8ScatterQuantizeRows128(768, 8, items=bad)


# ---------------------------------------------------------------------------- GPU
# the quantiser tests' rows (zero, huge, tiny, subnormal and mixed-scale groups) and GPU check
from test_sm90_fp8_quant import _rows, _sm90  # noqa: E402


def _poisoned(m, k):
    return (torch.full((m, k), 0x5A, dtype=torch.uint8, device="cuda"),
            torch.full((m, k // 128), float("nan"), dtype=torch.float32, device="cuda"))


def _assert_rows(q, s, x_rows, rows):
    eq, es = ref.quantize_rows128(x_rows[:rows].float())
    assert torch.equal(q[:rows].cpu(), eq.view(torch.uint8)) and torch.equal(s[:rows].cpu(), es)
    assert bool((q[rows:] == 0x5A).all()) and bool(s[rows:].isnan().all()), "rows past the count written"


@pytest.mark.gpu
@pytest.mark.parametrize("items", [2, 4])
@pytest.mark.parametrize("max_ctas", [None, 3])
def test_gpu_counted_and_gather(items, max_ctas):
    """Counted: rows < min(count, m_rows, M) bit for bit, the rest untouched; gathering: row r from
    source idx[r] (bad indices clamped). ``max_ctas=3`` forces many passes and a partial last one."""
    _sm90()
    k, m, S = 768, 1003, 301
    gen = torch.Generator().manual_seed(items * 10 + (max_ctas or 0))
    x = _rows(m, k, gen)
    extra = {} if max_ctas is None else dict(max_ctas=max_ctas)
    kern = CompiledFp8QuantizeRows(k, counted=True, compiled=compile_fp8_quantize_rows(
        k, counted=True, items=items, **extra))
    for cnt, m_rows in [(0, m), (1, m), (517, m), (m, m), (900, 301)]:
        q, s = _poisoned(m, k)
        kern(x.cuda(), q, s, m_rows=m_rows, count=torch.tensor([cnt], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        _assert_rows(q, s, x, min(cnt, m_rows, m))
    src = x[:S].contiguous()
    idx = torch.randint(0, S, (m,), generator=gen, dtype=torch.int32)
    idx[3], idx[4] = -7, S + 5
    gkern = CompiledFp8QuantizeRows(k, gather=True, compiled=compile_fp8_quantize_rows(
        k, gather=True, items=items, **extra))
    for cnt in (m, 613):
        q, s = _poisoned(m, k)
        gkern(src.cuda(), q, s, count=torch.tensor([cnt], dtype=torch.int32, device="cuda"), idx=idx.cuda())
        torch.cuda.synchronize()
        _assert_rows(q, s, src[idx.clamp(0, S - 1).long()], cnt)


@pytest.mark.gpu
@pytest.mark.parametrize("items", [2, 4])
@pytest.mark.parametrize("k,topk,t_max,counts", [(2048, 8, 64, [64, 13]), (768, 2, 50, [0, 50, 9])])
def test_gpu_scatter(items, k, topk, t_max, counts):
    """Each valid slot's row in every grouped row pos[s, :] names (some choices -1, invalid slots'
    stale pos rows never read), bit for bit; rows nobody names stay poisoned."""
    _sm90()
    gen = torch.Generator().manual_seed(k + topk + items)
    S = len(counts) * t_max
    x = _rows(S, k, gen)
    valid = [s % t_max < counts[s // t_max] for s in range(S)]
    choices = [(s, kk) for s in range(S) if valid[s] for kk in range(topk)]
    keep = torch.rand(len(choices), generator=gen) >= 0.1                 # some choices dropped (-1)
    choices = [c for c, kp in zip(choices, keep.tolist()) if kp]
    n, M = len(choices), len(choices) + 29
    perm = torch.randperm(n, generator=gen).tolist()
    pos = torch.randint(0, M, (S, topk), generator=gen, dtype=torch.int32)  # stale in invalid slots
    pos[torch.tensor(valid)] = -1
    idx = torch.full((M,), -1, dtype=torch.long)
    for r, (s, kk) in zip(perm, choices):
        pos[s, kk] = r
        idx[r] = s
    q, sc = _poisoned(M, k)
    kern = CompiledFp8QuantizeRows(k, scatter_topk=topk, compiled=compile_fp8_quantize_rows(
        k, scatter_topk=topk, items=items, max_ctas=5))
    kern(x.cuda(), q, sc, pos=pos.cuda(), recv_count=torch.tensor(counts, dtype=torch.int32, device="cuda"),
         t_max=t_max)
    torch.cuda.synchronize()
    named = idx >= 0
    eq, es = ref.quantize_rows128(x[idx[named]].float())
    assert torch.equal(q[named.cuda()].cpu(), eq.view(torch.uint8)) and torch.equal(sc[named.cuda()].cpu(), es)
    assert bool((q[~named.cuda()] == 0x5A).all()) and bool(sc[~named.cuda()].isnan().all())


def test_shim_switch_and_key(monkeypatch):
    """MOE_EP_FP8_QUANT_ITEMS picks the quantisers' items (in their key; GEMM keys keep 1); a bad
    value raises a ValueError naming the variable."""
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    monkeypatch.delenv("MOE_EP_FP8_QUANT_ITEMS", raising=False)
    assert s._key("quantize_counted", "", 0, 768, 0, False).quant_items == 1
    monkeypatch.setenv("MOE_EP_FP8_QUANT_ITEMS", "2")
    assert s._key("quantize_counted", "", 0, 768, 0, False).quant_items == 2
    assert s._key("quantize_scatter", "", 8, 2048, 0, False).quant_items == 2
    assert s._key("gemm", "identity", 2048, 768, 128, True).quant_items == 1
    for bad in ("0", "5", "two"):
        monkeypatch.setenv("MOE_EP_FP8_QUANT_ITEMS", bad)
        with pytest.raises(ValueError, match="MOE_EP_FP8_QUANT_ITEMS"):
            s._key("quantize_counted", "", 0, 768, 0, False)
