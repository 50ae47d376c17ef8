"""Drop v82: the FP8 GEMM's overlapped k-loop in chunks of at most ``chunk_k_tiles`` k-tiles
(``MOE_EP_FP8_OVERLAP_CHUNK``) instead of unrolled whole up to 32 k-tiles. Unrolled, Qwen3's FC1 (16
k-tiles) and Mixtral's (32) trace every k-tile's WGMMAs and promotion into one tile body that
streams through the instruction cache each tile; chunked, one chunk is traced and drained at its
end (as Mixtral's FC2 has run since drop v26).

CPU: the chunked kernels trace a chunk's WGMMAs only, keep them asynchronous (no ptxas C7514) and
spill nothing; refusals; the shim's switch, key and kernel name. GPU: the same bits as the layer's
schedule (uniform / skewed routing, edge row counts, NaN-poisoned outputs, two launches in a row),
and the FP8 layer with the switch on (eager and CUDA graph)."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_oracle import (fp8_gemm_problem, fp8_layer_inputs, fp8_variants_same_bits,  # noqa: E402
                         layer_outputs_with_switch, require_sm90)

# (activation, N, K, E, the layer's schedule): Qwen3's FC1 (16 k-tiles, staged scales), Mixtral's
# FC1 (32, TMA-loaded scales) and a chunked FC2 (48 k-tiles: chunks of 16 by default)
SHAPES = [
    ("swiglu", 1536, 2048, 128, dict(wide_gated=True, cluster_n=2, smem_scales=True, tanh_sigmoid=True)),
    ("swiglu", 28672, 4096, 8, dict(wide_gated=True, cluster_n=2, tanh_sigmoid=True, unit_scales=True)),
    ("identity", 1024, 6144, 8, dict(cluster_n=2, unit_scales=True)),
]


def _compile(act, n, k, experts, kw, chunk):
    import cutlass.cute as cute
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90
    from sm90_megamoe.fp8_runner import fake_args

    kernel = Fp8BlockScaledGroupedGemmSm90(act, scale_rows=act == "identity", raster_m=16, overlap_promotion=True,
                                           **kw, **({"chunk_k_tiles": chunk} if chunk else {}))
    return kernel, cute.compile(kernel, *fake_args(experts, n, k, act), options="--gpu-arch sm_90a --keep-ptx")


# ---------------------------------------------------------------------------- compile (CPU)
@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
def test_chunked_loop_traces_one_chunk(act, n, k, experts, kw, tmp_path, monkeypatch):
    """In chunks of 8: the traced WGMMAs shrink to one chunk's (plus the kernel's other copies of a
    k-tile, the same in both), ptxas keeps them asynchronous (no C7514) and spills nothing."""
    monkeypatch.chdir(tmp_path)
    from sm90_megamoe.fp8_runner import ptx_report
    from sm90_megamoe.layout_compile_check import _ptxas

    counts = {}
    for chunk in (0, 8):
        kernel, compiled = _compile(act, n, k, experts, kw, chunk)
        ptx = compiled.__ptx__
        counts[chunk] = len(re.findall(r"wgmma\.mma_async", ptx))
        assert kernel.overlap_chunk == (8 if chunk else (16 if k // 128 > 32 else 0))
        r = ptx_report(kernel, compiled)
        assert r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"], r
        if r["ptxas_spill_bytes"] is not None:
            assert r["ptxas_spill_bytes"] == 0, r
    per_k_tile = 4  # k-blocks of 32 per 128-wide k-tile, one WGMMA each (wide gated FC1: one accumulator)
    traced = {0: min(k // 128, 32) if k // 128 <= 32 else 16, 8: 8}
    assert counts[0] - counts[8] == per_k_tile * (traced[0] - traced[8]), counts
    ptxas = _ptxas()
    if ptxas is not None:  # WGMMAs kept asynchronous: no serialisation warning
        import subprocess
        import tempfile
        from pathlib import Path

        src = Path(tempfile.mkdtemp()) / "k.ptx"
        src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", compiled.__ptx__, flags=re.M))
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(src.with_suffix(".cubin"))],
                             capture_output=True, text=True)
        assert out.returncode == 0 and "C7514" not in out.stderr and "C7515" not in out.stderr, out.stderr[-800:]


def test_chunk_k_tiles_refusals():
    from sm90_megamoe.fp8_gemm import Fp8BlockScaledGroupedGemmSm90, overlap_chunk
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    for bad in (3, 18, -2):
        with pytest.raises(ValueError, match="chunk_k_tiles must be 0 or an even number"):
            Fp8BlockScaledGroupedGemmSm90("swiglu", overlap_promotion=True, chunk_k_tiles=bad)
    with pytest.raises(ValueError, match="chunk_k_tiles must be 0 or an even number"):  # the plain schedule
        Fp8BlockScaledGroupedGemmSm90("swiglu", chunk_k_tiles=8)
    with pytest.raises(ValueError, match="chunk_k_tiles needs overlap_promotion"):
        CompiledFp8Gemm("swiglu", 1536, 2048, 8, chunk_k_tiles=8)
    # the chunk: the largest even divisor of K/128 up to the limit, 0 when the loop is no longer
    assert [overlap_chunk(kt, 8) for kt in (6, 8, 16, 32, 112, 20)] == [0, 0, 8, 8, 8, 4]
    assert [overlap_chunk(kt, 16) for kt in (16, 32, 112)] == [0, 16, 16]
    assert [overlap_chunk(kt) for kt in (16, 32, 48, 112)] == [0, 0, 16, 16]  # the default rule, unchanged
    with pytest.raises(Exception, match="deferred_epilogue runs on the unrolled"):  # raised while tracing
        _compile("identity", 2048, 2048, 8, dict(cluster_n=2, smem_scales=True, deferred_epilogue=True), 8)


def test_shim_switch_key_and_name(monkeypatch):
    from moe_ep.shim.drops import sm90_megamoe_fp8 as s

    for var in ("MOE_EP_FP8_OVERLAP_CHUNK", "MOE_EP_FP8_UNIT_SCALES", "MOE_EP_FP8_DEFERRED_EPILOGUE") \
            + s._STAGED_SCALE_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    key = lambda act, n, k, e, sr: s._key("gemm", act, n, k, e, sr, overlap_promotion=True)  # noqa: E731
    qwen_fc1, qwen_fc2 = ("swiglu", 1536, 2048, 128, False), ("identity", 2048, 768, 128, True)
    mixtral_fc1, mixtral_fc2 = ("swiglu", 28672, 4096, 8, False), ("identity", 4096, 14336, 8, True)
    assert all(key(*g).chunk_k_tiles == 0 for g in (qwen_fc1, qwen_fc2, mixtral_fc1, mixtral_fc2))  # opt-in
    assert "chunk_k_tiles" not in s._gemm_options(key(*qwen_fc1))
    monkeypatch.setenv("MOE_EP_FP8_OVERLAP_CHUNK", "8")
    assert [key(*g).chunk_k_tiles for g in (qwen_fc1, qwen_fc2, mixtral_fc1, mixtral_fc2)] == [8, 0, 8, 8]
    assert s._gemm_options(key(*mixtral_fc1))["chunk_k_tiles"] == 8
    assert key(*qwen_fc2).deferred_epilogue  # K 768 keeps its deferred epilogue (and its 6 k-tiles unrolled)
    monkeypatch.setenv("MOE_EP_FP8_OVERLAP_CHUNK", "16")
    # Qwen3's 16 k-tiles and Mixtral's FC2 (chunks of 16 already) run as before: no new key
    assert [key(*g).chunk_k_tiles for g in (qwen_fc1, qwen_fc2, mixtral_fc1, mixtral_fc2)] == [0, 0, 16, 0]
    # never on the plain schedule, nor for a quantiser
    assert s._key("gemm", *mixtral_fc1, overlap_promotion=False).chunk_k_tiles == 0
    assert s._key("quantize", "", 0, 4096, 0, False, overlap_promotion=True).chunk_k_tiles == 0
    # under unit_scales a chunk must be a multiple of 8 k-tiles: K/128 = 20 in chunks of <= 8 gives 4
    monkeypatch.setenv("MOE_EP_FP8_OVERLAP_CHUNK", "8")
    monkeypatch.setenv("MOE_EP_FP8_UNIT_SCALES", "1")
    assert s.use_fp8_chunk_k_tiles(20 * 128, True, False, True) == 0
    assert s.use_fp8_chunk_k_tiles(20 * 128, True, False, False) == 8
    for bad in ("4", "0x8", "yes"):
        monkeypatch.setenv("MOE_EP_FP8_OVERLAP_CHUNK", bad)
        with pytest.raises(ValueError, match="MOE_EP_FP8_OVERLAP_CHUNK"):
            key(*mixtral_fc1)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("act,n,k,experts,kw", SHAPES)
@pytest.mark.parametrize("m,routing", [(1, "uniform"), (37, "skewed"), (700, "uniform"), (3000, "skewed")])
def test_chunked_loop_bit_identical(act, n, k, experts, kw, m, routing):
    """The same bits as the layer's schedule; every row written (NaN-poisoned); twice in a row."""
    require_sm90()
    from sm90_megamoe.fp8_launch import CompiledFp8Gemm

    sr = act == "identity"
    base = CompiledFp8Gemm(act, n, k, experts, sr, raster_m=16, overlap_promotion=True, **kw)
    chunked = CompiledFp8Gemm(act, n, k, experts, sr, raster_m=16, overlap_promotion=True, chunk_k_tiles=8, **kw)
    fp8_variants_same_bits([base, chunked], fp8_gemm_problem(m, n, k, experts, routing, 820 + m, sr))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 700])
@pytest.mark.parametrize("shape,fc1_on,fc2_on", [
    # Qwen3's: FC1 (16 k-tiles) chunks, FC2 (6, deferred epilogue) does not
    (dict(num_experts=128, hidden=2048, intermediate=768, top_k=8), True, False),
    # a Mixtral-like layer: FC1 (K 1024: 8 k-tiles) does not, FC2 (K 6144: chunks of 16 -> 8) does
    (dict(num_experts=8, hidden=1024, intermediate=6144, top_k=2), False, True),
])
def test_layer_with_chunked_loops_is_bit_identical(monkeypatch, T, shape, fc1_on, fc2_on):
    """The FP8 layer with MOE_EP_FP8_OVERLAP_CHUNK unset / 8: the same bits, eager and under a CUDA graph."""
    require_sm90()
    from moe_ep.api import MoEConfig

    cfg = MoEConfig(max_tokens_per_rank=1024, quant="fp8_block128", **shape)

    def check(impl, on):
        assert (impl.fc1.chunk_k_tiles == 8) == (on and fc1_on) and (impl.fc2.chunk_k_tiles == 8) == (on and fc2_on)

    inputs = fp8_layer_inputs(shape["num_experts"], shape["hidden"], shape["intermediate"], shape["top_k"], T, 82 + T)
    outs = layer_outputs_with_switch(monkeypatch, "MOE_EP_FP8_OVERLAP_CHUNK", cfg, "sm90_fp8_cutedsl", inputs, check,
                                     values=("", "8"))
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1]).all()
