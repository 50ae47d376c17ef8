"""FP8 block-scaled grouped GEMM: compile checks (any machine) and correctness + timing (H200).

    python -m sm90_megamoe.fp8_runner [--model qwen3|mixtral|dsv3_shard|inkling2_shard] [--routing uniform|skewed] [--reps 20]
                                      [--raster-m 1,4,16]   # time each raster (first one checked)
                                      [--overlap]           # + the overlapped-promotion schedule
                                                            #   (K > 4096: in chunks, v25)
                                      [--wide]              # + FC1 with one m64n128 gate+up WGMMA (v21)
                                      [--cluster]           # + clusters of 2 CTAs multicasting A (v28)
                                      [--smem-scales]       # + scales staged in smem by the producer (v34)
                                                            #   or by a second producer warp (v35)
                                      [--unit-scales]       # + scales by TMA, 8 k-tiles per copy (v69)

Per model, FC1 (swiglu, w13 [E, 2I, H]) and FC2 (identity + router row scale, w2 [E, H, I]):
* every machine: compile for sm_90a from fake tensors and check the PTX (FP8 WGMMA
  ``wgmma.mma_async ... e4m3.e4m3``, TMA ``cp.async.bulk.tensor``, no local memory) and, if ptxas
  is installed, registers / spill bytes;
* with an SM90 GPU: random inputs quantised by :mod:`.fp8_reference`, NaN-poisoned outputs, the
  relative error against the float32 reference of the dequantised math, median time (CUDA events)
  and TFLOP/s next to torch's FP8 GEMMs (``torch._scaled_grouped_mm``, row-wise scales, and
  ``torch._scaled_mm`` per expert with block-wise scales, whichever this torch supports);
* ``--wide``: FC1 with ``wide_gated=True`` (one m64n128 WGMMA over the gate and up tiles) must
  match the default FC1 bit for bit; timed beside it;
* ``--smem-scales``: each kernel the MoE layer runs (FC1 wide gated, FC2 on single CTAs and in
  clusters of 2; with ``--overlap`` both schedules) with its scales staged in shared memory by the
  producer warp (drop v34) and by a second producer warp (v35) against the same kernel reading them
  from global memory: the same bits (NaN-poisoned), then the times, interleaved;
* ``--unit-scales``: each layer GEMM whose K/128 is a multiple of 8, with the schedule the layer runs
  (overlapped, clusters of 2, staged scales where the layer stages them), against the same GEMM with
  ``unit_scales`` (drop v69: the scales loaded by TMA, 8 k-tiles per copy): the same bits
  (NaN-poisoned) on uniform and skewed routing and on 1, 37 and 300 rows, then both timed at the
  power cap (each back to back for a second before 60 timed launches), interleaved, 3 rounds
  (``--model dsv3_shard``: DeepSeek-V3's FC1, K 7168, whose layer keeps global scales in chunks of 14
  k-tiles, against unit_scales in chunks of 8 -- drop v105; ``--model inkling2_shard``: its FC1, K
  4608, against unit_scales 4 k-tiles per copy -- drop v106);

Drop v84 removed ``--requant`` and ``--fused-quant`` (their kernels), the scale warp's look-ahead and
clusters of 4, v87 ``--gather`` (the gathering FP8 FC1), v89 ``--chunk-k-tiles`` (v82's shorter
chunks): the H200 measured them slower or no faster.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream

from .fp8_gemm import (FP8_BLOCK, FP8_GATED, OVERLAP_MAX_K_TILES, Fp8BlockScaledGroupedGemmSm90, can_implement,
                       kernel_overlap_chunk, overlap_chunk)
from .unit_scales import unit_scale_kc
from .fp8_reference import (fp8_grouped_gemm_reference, make_offsets, quantize_rows128,
                            quantize_weight_block128)

MODELS = {  # hidden H, intermediate I, experts E, top-k, tokens
    "qwen3": (2048, 768, 128, 8, 8192),
    "mixtral": (4096, 14336, 8, 2, 8192),
    # drop v105: DeepSeek-V3's local shard (32 of 256 experts); its FC1 (K 7168) takes unit_scales in chunks of 8
    "dsv3_shard": (7168, 2048, 32, 8, 8192),
    # drop v106: Inkling2's local shard (48 of 384 experts; timed here with SwiGLU, its mainloop's
    # activation aside); its FC1 (K 4608, 36 k-tiles) takes unit_scales 4 k-tiles per copy
    "inkling2_shard": (4608, 2304, 48, 8, 8192),
}


def layers(model: str):
    """[(name, activation, N, K, scale_rows)] of one MoE layer."""
    h, i, _, _, _ = MODELS[model]
    return [("fc1", "swiglu", 2 * i, h, False), ("fc2", "identity", h, i, True)]


def fake_args(num_experts: int, n: int, k: int, activation: str):
    """Fake (mA, mAScale, mB, mBScale, mC, mOffsets, mRowScale, ctas, stream): M_total dynamic,
    fp8 operands as uint8 views (what :func:`cute_args` passes)."""
    n_out = n // 2 if activation in FP8_GATED else n
    m = cute.sym_int()
    u8, f32 = cutlass.Uint8, cutlass.Float32
    mA = make_fake_compact_tensor(u8, (m, k), stride_order=(1, 0), assumed_align=16)
    mAS = make_fake_compact_tensor(f32, (m, k // FP8_BLOCK), stride_order=(1, 0), assumed_align=4)
    mB = make_fake_compact_tensor(u8, (num_experts, n, k), stride_order=(2, 1, 0), assumed_align=16)
    mBS = make_fake_compact_tensor(f32, (num_experts, n // FP8_BLOCK, k // FP8_BLOCK),
                                   stride_order=(2, 1, 0), assumed_align=4)
    mC = make_fake_compact_tensor(cutlass.BFloat16, (m, n_out), stride_order=(1, 0), assumed_align=16)
    mOff = make_fake_compact_tensor(cutlass.Int32, (num_experts + 1,), assumed_align=4)
    mRS = make_fake_compact_tensor(f32, (cute.sym_int(),), assumed_align=4)
    return (mA, mAS, mB, mBS, mC, mOff, mRS, cutlass.Int32(132), make_fake_stream())


def cute_args(a, a_scale, b, b_scale, c, offsets, row_scale):
    """CuTe views of contiguous torch tensors matching :func:`fake_args`."""
    u8 = lambda t: t.view(torch.uint8) if t.dtype != torch.uint8 else t  # noqa: E731
    dyn = lambda t, al: from_dlpack(t, assumed_align=al).mark_compact_shape_dynamic(  # noqa: E731
        mode=0, stride_order=(0, 1))
    return (dyn(u8(a), 16), dyn(a_scale, 4), from_dlpack(u8(b), assumed_align=16),
            from_dlpack(b_scale, assumed_align=4), dyn(c, 16), from_dlpack(offsets, assumed_align=4),
            from_dlpack(row_scale, assumed_align=4).mark_compact_shape_dynamic(mode=0))


def compile_variant(activation: str, n: int, k: int, num_experts: int, scale_rows: bool,
                    arch: str = "sm_90a", tile_n: Optional[int] = None,
                    num_stages: Optional[int] = None, raster_m: int = 1, overlap_promotion: bool = False,
                    wide_gated: bool = False, cluster_n: int = 1,
                    smem_scales: bool = False, scale_warp: bool = False, deferred_epilogue: bool = False,
                    tanh_sigmoid: bool = False, swiglu: tuple = ()):
    """(kernel, compiled) for one variant, from fake tensors (no GPU needed), compiled once per
    process (the checks, the GPU runs and the tests share it); ``wide_gated``: FC1's one-WGMMA
    gate+up schedule (swiglu only);
    ``cluster_n`` = 2: clusters of 2 CTAs multicasting A;
    ``smem_scales``: scales staged in shared memory by the producer warp (drop v34), ``scale_warp``:
    by a second producer warp (drop v35); ``deferred_epilogue``: a unit's epilogue under the next
    unit's first k-tile (drop v48; the unrolled overlapped schedule); ``tanh_sigmoid``: swiglu's
    sigmoid from one tanh.approx (drop v50); ``swiglu``: clamped_swiglu's (alpha, limit, beta) (drop v100), optionally its
    limit_after_act (drop v102); softcapped_swiglu's (gate_softcap, up_softcap) (drop v103)."""
    return _compile_variant(activation, n, k, num_experts, bool(scale_rows), arch, tile_n, num_stages, int(raster_m),
                            bool(overlap_promotion), bool(wide_gated), int(cluster_n),
                            bool(smem_scales), bool(scale_warp), bool(deferred_epilogue), bool(tanh_sigmoid),
                            tuple(float(v) for v in swiglu))


@functools.lru_cache(maxsize=None)
def _compile_variant(activation, n, k, num_experts, scale_rows, arch, tile_n, num_stages, raster_m,
                     overlap_promotion, wide_gated, cluster_n=1, smem_scales=False,
                     scale_warp=False, deferred_epilogue=False, tanh_sigmoid=False, swiglu=()):
    reason = can_implement(activation, n, k, num_experts, tile_n)
    if reason is not None:
        raise ValueError(reason)
    kernel = Fp8BlockScaledGroupedGemmSm90(activation, scale_rows=scale_rows, tile_n=tile_n, num_stages=num_stages, raster_m=raster_m,
                 overlap_promotion=overlap_promotion, wide_gated=wide_gated,
                 **({"cluster_n": cluster_n} if cluster_n > 1 else {}),
                 **({"smem_scales": True} if smem_scales else {}),
                 **({"scale_warp": True} if scale_warp else {}),
                 **({"deferred_epilogue": True} if deferred_epilogue else {}),
                 **({"tanh_sigmoid": True} if tanh_sigmoid else {}),
                 **(dict(zip(("swiglu_alpha", "swiglu_limit", "swiglu_beta", "swiglu_limit_after_act"), swiglu))
                    if swiglu and activation == "clamped_swiglu" else {}),
                 **(dict(zip(("gate_softcap", "up_softcap"), swiglu)) if swiglu and activation == "softcapped_swiglu"
                    else {}))
    compiled = cute.compile(kernel, *fake_args(num_experts, n, k, activation),
                            options=f"--gpu-arch {arch} --keep-ptx")
    return kernel, compiled


def overlap_buildable(k: int) -> bool:
    """Whether the overlapped-promotion schedule compiles for reduction size ``k``: unrolled up to
    OVERLAP_MAX_K_TILES k-tiles, in chunks beyond (drop v25; an even K/128)."""
    return k // FP8_BLOCK <= OVERLAP_MAX_K_TILES or overlap_chunk(k // FP8_BLOCK) > 0


def smem_bytes(kernel: Fp8BlockScaledGroupedGemmSm90) -> int:
    """Dynamic shared memory of a compiled kernel (its SharedStorage struct)."""
    return int(kernel.shared_storage.size_in_bytes())


def ptx_report(kernel, compiled, arch: str = "sm_90a") -> dict:
    """What the PTX shows: FP8 WGMMA instruction(s), TMA, local memory, ptxas registers/spills."""
    import re

    from .layout_compile_check import ptxas_info
    from .pdl import ptx_problems

    ptx = compiled.__ptx__
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)))
    info = ptxas_info(ptx, arch)
    return {
        "wgmma": wgmma,
        "fp8_wgmma": any("e4m3.e4m3" in w for w in wgmma),
        "tma": "cp.async.bulk.tensor" in ptx,
        "local": ("ld.local" in ptx) or ("st.local" in ptx),
        "pdl": not ptx_problems(ptx),
        "ptxas_regs": None if info is None else info[0],
        "ptxas_spill_bytes": None if info is None else info[1],
        "stages": kernel.num_stages,
        "smem_bytes": smem_bytes(kernel),
    }


# ---------------------------------------------------------------------------- GPU side
def make_inputs(m_total, n, k, num_experts, routing, scale_rows, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m_total, k, generator=dgen, device=device) * 0.5
    w = torch.randn(num_experts, n, k, generator=dgen, device=device) * (1.0 / k ** 0.5)
    a, a_s = quantize_rows128(x)
    del x
    b, b_s = quantize_weight_block128(w)
    del w
    offs = make_offsets(m_total, num_experts, routing, gen).to(device)
    rs = torch.rand(m_total, generator=dgen, device=device) if scale_rows else None
    return a, a_s, b, b_s, offs, rs


class Fp8GroupedGemm:
    """One compiled variant, launched on CUDA tensors (classic path: pre-converted CuTe views)."""

    def __init__(self, activation, n, k, num_experts, scale_rows, tile_n=None, num_stages=None, raster_m=1,
                 overlap_promotion=False, wide_gated=False, cluster_n=1,
                 smem_scales=False, scale_warp=False, deferred_epilogue=False, tanh_sigmoid=False, swiglu=()):
        self.kernel, self.compiled = compile_variant(activation, n, k, num_experts, scale_rows,
                                                     tile_n=tile_n, num_stages=num_stages, raster_m=raster_m,
                                                     overlap_promotion=overlap_promotion,
                                                     wide_gated=wide_gated, cluster_n=cluster_n,
                                                     smem_scales=smem_scales, scale_warp=scale_warp,
                                                     deferred_epilogue=deferred_epilogue,
                                                     tanh_sigmoid=tanh_sigmoid, swiglu=swiglu)
        self.cluster_n = int(cluster_n)
        self.activation, self.n, self.k, self.scale_rows = activation, n, k, scale_rows
        self.n_out = n // 2 if activation in FP8_GATED else n

    def prepare(self, a, a_s, b, b_s, out, offs, rs):
        """CuTe views for :meth:`launch`; None when there are no rows (nothing to launch: TMA
        descriptors cannot describe an empty tensor)."""
        if a.shape[0] == 0:
            return None
        if rs is None:
            rs = torch.zeros(1, dtype=torch.float32, device=a.device)
        return cute_args(a, a_s, b, b_s, out, offs, rs)

    def launch(self, args, ctas=None, stream=None):
        if args is None:
            return
        if ctas is None:
            ctas = max_active_ctas(self.cluster_n)
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        self.compiled(*args, cutlass.Int32(ctas), stream)


def max_active_ctas(cluster_n: int = 1) -> int:
    """Persistent CTAs of one launch: one per SM, or cluster_n times the clusters of cluster_n
    CTAs that fit at once (an SM pair must sit in one GPC; a grid larger than that would run its
    last clusters after the others)."""
    from .fp8_launch import cluster_ctas

    return cluster_ctas(cluster_n, torch.cuda.current_device())


def time_fn(fn, reps: int, before=None) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls (after 3 warm-ups);
    ``before()``, if given, runs untimed ahead of each timed call (stream-ordered before its start
    event), e.g. a large write that evicts L2."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def torch_baselines(a, a_s, b, b_s, offs, reps):
    """{name: ms or error string} for torch's FP8 GEMMs on the same shapes (GEMM only, no
    activation). Row-wise grouped scales are a different (coarser) format: a speed reference."""
    out = {}
    E, N, K = b.shape
    M = a.shape[0]
    if hasattr(torch, "_scaled_grouped_mm"):
        try:
            sa = a_s.amax(dim=1).contiguous()          # [M] row-wise stand-in
            sb = b_s.amax(dim=2).repeat_interleave(FP8_BLOCK, dim=1).contiguous()  # [E, N]
            bt = b.transpose(1, 2)                      # [E, K, N], column-major per expert
            ends = offs[1:].contiguous()
            fn = lambda: torch._scaled_grouped_mm(a, bt, sa, sb, offs=ends,  # noqa: E731
                                                  out_dtype=torch.bfloat16)
            fn()
            out["torch._scaled_grouped_mm (row-wise)"] = time_fn(fn, reps)
        except Exception as ex:  # noqa: BLE001
            out["torch._scaled_grouped_mm (row-wise)"] = f"unavailable: {type(ex).__name__}: {ex}"[:160]
    try:
        o = [int(x) for x in offs.tolist()]
        pairs = []
        for e in range(E):
            lo, hi = o[e], o[e + 1]
            if hi > lo:
                # block-wise: A 1x128 (outer-dim-major scale), B 128x128
                pairs.append((a[lo:hi], a_s[lo:hi].t().contiguous().t(), b[e].t(), b_s[e].t()))

        def per_expert():
            for x, sx, w, sw in pairs:
                torch._scaled_mm(x, w, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)

        per_expert()
        out["torch._scaled_mm per expert (block-wise)"] = time_fn(per_expert, reps)
    except Exception as ex:  # noqa: BLE001
        out["torch._scaled_mm per expert (block-wise)"] = f"unavailable: {type(ex).__name__}: {ex}"[:160]
    return out


def run_gpu(model: str, routing: str, reps: int, rasters=(1,), overlap: bool = False,
            wide: bool = False, cluster: bool = False,
            smem: bool = False) -> bool:
    h, i, E, topk, tokens = MODELS[model]
    m_total = tokens * topk
    ok_all = True
    for name, act, n, k, sr in layers(model):
        fn = Fp8GroupedGemm(act, n, k, E, sr, raster_m=rasters[0])
        a, a_s, b, b_s, offs, rs = make_inputs(m_total, n, k, E, routing, sr)
        out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
        args = fn.prepare(a, a_s, b, b_s, out, offs, rs)
        fn.launch(args)
        torch.cuda.synchronize()
        ref = fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, act, rs)
        nan = bool(torch.isnan(out).any())
        rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
        ok = (not nan) and rel < 1e-2
        ok_all &= ok
        del ref
        ms = time_fn(lambda: fn.launch(args), reps)
        flops = 2.0 * m_total * n * k
        print(f"[{model} {name}] {act:8s} M={m_total} N={n} K={k} E={E} {routing}: rel_err={rel:.3e} "
              f"nan={nan} -> {'PASS' if ok else 'FAIL'}; {ms:.3f} ms = {flops / ms / 1e9:.1f} TFLOP/s "
              f"(stages {fn.kernel.num_stages}, tile 128x{fn.kernel.tile_n}x128, raster_m {rasters[0]})", flush=True)
        for r in rasters[1:]:
            other = Fp8GroupedGemm(act, n, k, E, sr, raster_m=r)
            oargs = other.prepare(a, a_s, b, b_s, out, offs, rs)
            rms = time_fn(lambda: other.launch(oargs), reps)
            print(f"    raster_m {r}: {rms:.3f} ms = {flops / rms / 1e9:.1f} TFLOP/s", flush=True)
        if overlap and not overlap_buildable(k):
            print(f"    overlap_promotion: K={k} > {OVERLAP_MAX_K_TILES * FP8_BLOCK} with an odd K/128, not built",
                  flush=True)
        elif overlap:  # the overlapped-promotion schedule: bit-identical output, then its time
            ov = Fp8GroupedGemm(act, n, k, E, sr, raster_m=rasters[0], overlap_promotion=True)
            out2 = torch.full_like(out, float("nan"))
            oargs = ov.prepare(a, a_s, b, b_s, out2, offs, rs)
            ov.launch(oargs)
            torch.cuda.synchronize()
            same = torch.equal(out2, out)
            ok_all &= same
            oms = time_fn(lambda: ov.launch(oargs), reps)
            chunk = overlap_chunk(k // FP8_BLOCK)
            print(f"    overlap_promotion{f' in chunks of {chunk} k-tiles' if chunk else ''} (raster_m {rasters[0]}): "
                  f"bit-identical={same}; {oms:.3f} ms = "
                  f"{flops / oms / 1e9:.1f} TFLOP/s", flush=True)
        if wide and act == "swiglu":
            ok_all &= check_wide(fn, a, a_s, b, b_s, offs, rs, out, E, n, k, sr, rasters[0], overlap, reps)
        if cluster:
            ok_all &= check_cluster(out, a, a_s, b, b_s, offs, rs, E, n, k, act, sr, rasters[0], overlap, reps)
        if smem:
            ok_all &= check_smem_scales(out, a, a_s, b, b_s, offs, rs, E, n, k, act, sr, rasters[0], overlap, reps)
        for bname, v in torch_baselines(a, a_s, b, b_s, offs, reps).items():
            if isinstance(v, float):
                print(f"    {bname}: {v:.3f} ms = {flops / v / 1e9:.1f} TFLOP/s (GEMM only)")
            else:
                print(f"    {bname}: {v}")
        del a, a_s, b, b_s, out
        torch.cuda.empty_cache()
    return ok_all


def check_wide(fn, a, a_s, b, b_s, offs, rs, out, E, n, k, sr, raster_m, overlap, reps) -> bool:
    """FC1 with ``wide_gated`` against the default FC1 (``fn``, whose ``out`` is computed): the same
    bits (NaN-poisoned output), then both times."""
    ok_all = True
    flops = 2.0 * out.shape[0] * n * k
    for ov in ((False, True) if overlap and overlap_buildable(k) else (False,)):
        base = Fp8GroupedGemm("swiglu", n, k, E, sr, raster_m=raster_m, overlap_promotion=ov)
        bargs = base.prepare(a, a_s, b, b_s, out, offs, rs)
        wd = Fp8GroupedGemm("swiglu", n, k, E, sr, raster_m=raster_m, overlap_promotion=ov, wide_gated=True)
        o2 = torch.full_like(out, float("nan"))
        wargs = wd.prepare(a, a_s, b, b_s, o2, offs, rs)
        base.launch(bargs)
        wd.launch(wargs)
        torch.cuda.synchronize()
        same = torch.equal(o2, out)
        ok_all &= same
        bms, wms = time_fn(lambda: base.launch(bargs), reps), time_fn(lambda: wd.launch(wargs), reps)
        print(f"    wide_gated{' overlap' if ov else ''}: bit-identical={same}; {wms:.3f} ms = {flops / wms / 1e9:.1f} "
              f"TFLOP/s vs {bms:.3f} ms = {flops / bms / 1e9:.1f} ({bms / wms:.2f}x)", flush=True)
    return ok_all


def check_cluster(out, a, a_s, b, b_s, offs, rs, E, n, k, act, sr, raster_m, overlap, reps) -> bool:
    """Clusters of 2 CTAs (drop v28) multicasting A against the same schedule on
    single CTAs (``out`` holds the default kernel's result): the same bits (NaN-poisoned), then both
    times, interleaved over two rounds. FC1 runs the wide gated schedule (the backend's)."""
    ok_all = True
    flops = 2.0 * out.shape[0] * n * k
    wide = act == "swiglu"
    cn = 2
    print(f"    clusters of {cn}: {max_active_ctas(cn)} CTAs of {max_active_ctas(1)} SMs", flush=True)
    for ov in ((False, True) if overlap and overlap_buildable(k) else (False,)):
        base = Fp8GroupedGemm(act, n, k, E, sr, raster_m=raster_m, overlap_promotion=ov, wide_gated=wide)
        cl = Fp8GroupedGemm(act, n, k, E, sr, raster_m=raster_m, overlap_promotion=ov, wide_gated=wide, cluster_n=cn)
        o1, o2 = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
        bargs, cargs = base.prepare(a, a_s, b, b_s, o1, offs, rs), cl.prepare(a, a_s, b, b_s, o2, offs, rs)
        base.launch(bargs)
        cl.launch(cargs)
        torch.cuda.synchronize()
        same = torch.equal(o1, out) and torch.equal(o2, out)
        if not same:
            bad = ((o2 != out) & ~(o2.isnan() & out.isnan())).any(dim=1) | o2.isnan().any(dim=1)
            print(f"    cluster: {int(bad.sum())} of {out.shape[0]} rows differ, first {bad.nonzero().flatten()[:8].tolist()}",
                  flush=True)
        ok_all &= same
        bms, cms = [], []
        for _ in range(2):
            bms.append(time_fn(lambda: base.launch(bargs), reps))
            cms.append(time_fn(lambda: cl.launch(cargs), reps))
        bm, cm = min(bms), min(cms)
        print(f"    cluster_n={cn}{' overlap' if ov else ''}{' wide' if wide else ''}: bit-identical={same}; {cm:.3f} ms = "
              f"{flops / cm / 1e9:.1f} TFLOP/s vs {bm:.3f} ms = {flops / bm / 1e9:.1f} ({bm / cm:.2f}x; rounds "
              f"{' '.join(f'{x:.3f}' for x in cms)} / {' '.join(f'{x:.3f}' for x in bms)})", flush=True)
    return ok_all


def smem_scale_configs(act: str, n: int, k: int, overlap: bool):
    """The ``(overlap_promotion, cluster_n)`` kernels ``--smem-scales`` compares: those the layer runs
    (FC1 wide gated on single CTAs, FC2 on single CTAs and in clusters of 2)."""
    ovs = (False, True) if overlap and overlap_buildable(k) else (False,)
    if act == "swiglu":
        return [(ov, 1) for ov in ovs]
    clusters = (1, 2) if (n // 128) % 2 == 0 else (1,)
    return [(ov, cn) for ov in ovs for cn in clusters]


def check_smem_scales(out, a, a_s, b, b_s, offs, rs, E, n, k, act, sr, raster_m, overlap, reps) -> bool:
    """Scales staged in smem -- by the TMA warp (drop v34) and by a second producer warp (v35) --
    against the same kernel reading them from global memory (``out``: the default kernel's bf16
    result): the same bits (NaN-poisoned), then the times, interleaved over two rounds."""
    ok_all = True
    m_total = out.shape[0]
    flops = 2.0 * m_total * n * k
    wide = act == "swiglu"
    for ov, cn in smem_scale_configs(act, n, k, overlap):
        runs, outs = [], []
        for smem, warp in ((False, False), (True, False), (True, True)):
            fn = Fp8GroupedGemm(act, n, k, E, sr, raster_m=raster_m, overlap_promotion=ov, wide_gated=wide,
                                cluster_n=cn, smem_scales=smem, scale_warp=warp)
            o = torch.full_like(out, float("nan"))
            args = fn.prepare(a, a_s, b, b_s, o, offs, rs)
            fn.launch(args)
            runs.append((fn, args))
            outs.append(o)
        torch.cuda.synchronize()
        same = all(torch.equal(o, out) for o in outs)
        if not same:
            for name, o in zip(("staged", "scale warp"), outs[1:]):
                bad = ((o != outs[0]) & ~(o.isnan() & outs[0].isnan())).any(dim=1)
                print(f"    {name}: {int(bad.sum())} of {m_total} rows differ, first {bad.nonzero().flatten()[:8].tolist()}",
                      flush=True)
        ok_all &= same
        times = [[] for _ in runs]
        for _ in range(2):
            for i, (fn, args) in enumerate(runs):
                times[i].append(time_fn(lambda: fn.launch(args), reps))
        best = [min(t) for t in times]
        gm = best[0]
        tag = (" overlap" if ov else "") + (" wide" if wide else "") + (f" cluster{cn}" if cn > 1 else "")
        others = ", ".join(f"{name} {t:.3f} ms ({gm / t:.2f}x)" for name, t in zip(("staged", "scale warp"), best[1:]))
        print(f"    smem_scales{tag}: bit-identical={same}; {others} vs global {gm:.3f} ms = {flops / gm / 1e9:.1f} "
              f"TFLOP/s (rounds {' / '.join(' '.join(f'{x:.3f}' for x in t) for t in times)})", flush=True)
    return ok_all


def run_compile(model: str, overlap: bool = False, wide: bool = False,
                raster_m: int = 1, cluster: bool = False, smem: bool = False) -> bool:
    _, _, E, _, _ = MODELS[model]
    ok_all = True
    variants = [(spec, ov, False) for spec in layers(model)
                for ov in ((False, True) if overlap and overlap_buildable(spec[3]) else (False,))]
    if wide:
        variants += [(spec, ov, True) for spec, ov, _ in variants if spec[1] == "swiglu"]
    variants = [v + (1, 0) for v in variants]
    if cluster:  # check_cluster's variants: FC1 wide gated, clusters of 2
        variants += [(spec, ov, spec[1] == "swiglu", 2, 0) for spec in layers(model)
                     for ov in ((False, True) if overlap and overlap_buildable(spec[3]) else (False,))]
    if smem:  # check_smem_scales's variants, every way
        variants += [(spec, ov, spec[1] == "swiglu", cn, sm) for spec in layers(model)
                     for ov, cn in smem_scale_configs(spec[1], spec[2], spec[3], overlap)
                     for sm in (0, 1, 2)]
    for (name, act, n, k, sr), ov, w, cn, sm in variants:
        t0 = time.time()
        kernel, compiled = compile_variant(act, n, k, E, sr, raster_m=raster_m, overlap_promotion=ov,
                                           wide_gated=w, cluster_n=cn, smem_scales=sm > 0, scale_warp=sm > 1)
        name = name + (" overlap" if ov else "") + (" wide" if w else "") + \
            (f" cluster{cn}" if cn > 1 else "") + \
            {0: "", 1: " smem_scales", 2: " smem_scales scale_warp"}[sm]
        r = ptx_report(kernel, compiled)
        ok = r["fp8_wgmma"] and r["tma"] and r["pdl"] and not r["local"] and r["ptxas_spill_bytes"] in (0, None)
        ok_all &= ok
        print(f"[{model} {name}] {act} N={n} K={k} E={E} scale_rows={sr}: compile "
              f"{time.time() - t0:.2f}s {r} -> {'OK' if ok else 'FAIL'}", flush=True)
    return ok_all


def check_deferred_epilogue(model: str, routing: str, reps: int) -> bool:
    """Drop v48: each layer GEMM on the unrolled overlapped schedule (FC1 wide gated, FC2 with router
    weights; clusters of 2, staged scales for K <= 2048, as the layer runs them) with
    ``deferred_epilogue`` against the same kernel without: bits (NaN poisoned) and time,
    interleaved, 2 rounds."""
    from .fp8_launch import CompiledFp8Gemm

    h, i, E, topk, tokens = MODELS[model]
    m_total = tokens * topk
    ok = True
    for name, act, n, k in (("fc1", "swiglu", 2 * i, h), ("fc2", "identity", h, i)):
        if k // FP8_BLOCK > OVERLAP_MAX_K_TILES:
            print(f"[{model} {name} deferred_epilogue] K={k}: chunked schedule, not covered", flush=True)
            continue
        sr = act == "identity"
        kw = dict(raster_m=max(1, min(16, (24 << 20) // (128 * k))), overlap_promotion=True,
                  wide_gated=act == "swiglu", cluster_n=2, smem_scales=k <= 2048)
        fns = [CompiledFp8Gemm(act, n, k, E, sr, tvm_ffi=True, **kw),
               CompiledFp8Gemm(act, n, k, E, sr, tvm_ffi=True, deferred_epilogue=True, **kw)]
        a, a_s, b, b_s, offs, rs = make_inputs(m_total, n, k, E, routing, sr, seed=9)
        if rs is None:
            rs = torch.ones(1, device="cuda")
        outs = [torch.full((m_total, fns[0].n_out), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in fns]
        ctas = max_active_ctas(2)
        calls = [lambda f=f, o=o: f(a, a_s, b, b_s, offs, out=o, row_scale=rs, max_active_ctas=ctas)
                 for f, o in zip(fns, outs)]
        for c in calls:
            c()
        torch.cuda.synchronize()
        same = torch.equal(outs[0], outs[1]) and not bool(torch.isnan(outs[1]).any())
        ok &= same
        ms = [[], []]
        for _ in range(2):
            for j, c in enumerate(calls):
                ms[j].append(time_fn(c, reps))
        base, dfr = min(ms[0]), min(ms[1])
        flops = 2.0 * m_total * n * k
        print(f"[{model} {name} deferred_epilogue] {routing}: bit-identical={same}; {dfr:.3f} ms = "
              f"{flops / dfr / 1e9:.1f} TFLOP/s vs {base:.3f} ms ({base / dfr:.3f}x; rounds "
              f"{' '.join(f'{x:.3f}' for x in ms[1])} / {' '.join(f'{x:.3f}' for x in ms[0])})", flush=True)
    return ok


def _layer_kw(act: str, k: int) -> dict:
    """The schedule the layer runs for a GEMM (the shim's defaults; drop v107: those of its fifty-first
    session): wide gated with the tanh sigmoid (FC1); overlapped, except the gated GEMM between K 2048
    and 4096; scales by TMA from K 4096 wherever K/128 is a multiple of 4 (``unit_scales``: DeepSeek-V3's
    FC1, K 7168, and Inkling2's, K 4608, too); else staged in shared memory by the gated GEMM up to
    K 2048 and by the non-gated one at every K (with the scale warp from K 4096), global scales
    otherwise; clusters of 2 from K 4096 or with staged scales; the deferred epilogue for the non-gated
    GEMM up to K 1024. (``tests/test_fp8_runner_schedule.py`` checks this against the shim.)"""
    kt = k // FP8_BLOCK
    gated = act == "swiglu"
    kw = dict(raster_m=max(1, min(16, (24 << 20) // (128 * k))),
              overlap_promotion=not gated or k <= 2048 or k >= 4096, wide_gated=gated, tanh_sigmoid=gated)
    if k >= 4096 and unit_scale_kc(kt):
        kw.update(unit_scales=True)
    elif k <= 2048 or not gated:
        kw.update(smem_scales=True, scale_warp=not gated and k >= 4096, deferred_epilogue=not gated and k <= 1024)
    kw.update(cluster_n=2 if k >= 4096 or kw.get("smem_scales") else 1)
    return kw


def compare_to_layer(model: str, tag: str, pair, reps: int = 60) -> bool:
    """Each of --model's GEMMs (FC1, FC2) as ``pair(act, k)`` gives it -- ``(baseline kwargs, variant
    kwargs)`` of :class:`.fp8_launch.CompiledFp8Gemm`, or a string saying why the variant does not
    apply: the same bits (NaN-poisoned) on uniform and skewed routing and on 1, 37 and 300 rows, then
    both timed at the power cap (each back to back for a second before ``reps`` timed launches),
    interleaved, 3 rounds (``--unit-scales``)."""
    from .fp8_launch import CompiledFp8Gemm

    h, i, E, topk, tokens = MODELS[model]
    m_total = tokens * topk
    ok = True
    for name, act, n, k in (("fc1", "swiglu", 2 * i, h), ("fc2", "identity", h, i)):
        kws = pair(act, k)
        if isinstance(kws, str):
            print(f"[{model} {name} {tag}] K={k}: {kws}; not covered", flush=True)
            continue
        sr = act == "identity"
        fns = [CompiledFp8Gemm(act, n, k, E, sr, **kw) for kw in kws]
        ctas = max_active_ctas(2)
        for routing, m in (("uniform", m_total), ("skewed", m_total), ("uniform", 1), ("skewed", 37), ("uniform", 300)):
            a, a_s, b, b_s, offs, rs = make_inputs(m, n, k, E, routing, sr, seed=11 + m)
            if rs is None:
                rs = torch.ones(1, device="cuda")
            outs = [torch.full((m, fns[0].n_out), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in fns]
            for f, o in zip(fns, outs):
                f(a, a_s, b, b_s, offs, out=o, row_scale=rs, max_active_ctas=ctas)
                f(a, a_s, b, b_s, offs, out=o, row_scale=rs, max_active_ctas=ctas)  # barrier phases carry over
            torch.cuda.synchronize()
            same = torch.equal(outs[0], outs[1]) and not bool(torch.isnan(outs[1]).any())
            ok &= same
            print(f"[{model} {name} {tag}] {routing} M={m}: bit-identical={same}", flush=True)
            if m != m_total or routing != "uniform":
                continue
            calls = [lambda f=f, o=o: f(a, a_s, b, b_s, offs, out=o, row_scale=rs, max_active_ctas=ctas)
                     for f, o in zip(fns, outs)]
            ms = [[], []]
            for r in range(3):
                for j in ((0, 1) if r % 2 == 0 else (1, 0)):
                    ms[j].append(_time_at_cap(calls[j], reps))
            base, var = statistics.median(ms[0]), statistics.median(ms[1])
            flops = 2.0 * m_total * n * k
            print(f"[{model} {name} {tag}] at the cap: {var:.4f} ms = {flops / var / 1e9:.1f} TFLOP/s vs the "
                  f"layer's schedule {base:.4f} ms ({base / var:.3f}x; rounds {' '.join(f'{x:.4f}' for x in ms[1])} / "
                  f"{' '.join(f'{x:.4f}' for x in ms[0])})", flush=True)
    return ok


def check_unit_scales(model: str, reps: int = 60) -> bool:
    """Drop v69: ``unit_scales`` against the schedule the layer ran before it (staged scales where it
    staged them) on each GEMM whose K/128 is a multiple of 8 (of 4 since drop v106; module docstring)."""
    from .unit_scales import unit_scales_reason

    def pair(act, k):
        kt = k // FP8_BLOCK
        why = unit_scales_reason(kt, kernel_overlap_chunk(kt, True))
        if why is not None:
            return why
        kw = {x: v for x, v in _layer_kw(act, k).items()
              if x not in ("unit_scales", "smem_scales", "scale_warp", "deferred_epilogue")}
        sr = act == "identity"
        return dict(kw, smem_scales=k <= 2048 or sr, scale_warp=sr and k >= 4096), dict(kw, unit_scales=True)

    return compare_to_layer(model, "unit_scales", pair, reps)


def _time_at_cap(fn, reps: int, warm_s: float = 1.0) -> float:
    """Milliseconds per call of ``fn`` over ``reps`` back-to-back launches, after ``warm_s`` seconds
    of them (the GPU settles at its power cap), one pair of CUDA events."""
    t0 = time.time()
    while time.time() - t0 < warm_s:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def check_clamped(model: str, routing: str) -> bool:
    """Drop v100: FC1 with clamped_swiglu, gpt-oss's form (alpha 1.702, beta 1) and DeepSeek-V4 / GLM-5's
    (alpha 1, beta 0); drop v102: Step-3.7's (the gate clamped after the activation); drop v103:
    Inkling2's softcapped_swiglu -- plain and with the layer's overlapped wide schedule, against the
    float32 dequantised reference with the same constants, and off from the reference of another
    form (the other beta, the other clamp order, plain swiglu). The limit is 1.5 standard deviations
    of FC1's outputs, so the clamp triggers for ~13% of the gates and of the up values (Step-3.7's
    clamp of silu(g) at that limit: ~7%); the softcaps are that limit and twice it."""
    h, i, E, topk, tokens = MODELS[model]
    m_total, n, k = tokens * topk, 2 * i, h
    a, a_s, b, b_s, offs, _ = make_inputs(m_total, n, k, E, routing, False, seed=5)
    pre = fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, "identity")
    limit = round(1.5 * float(pre.std()), 3)
    clamped = float((pre[:, :i] > limit).float().mean())
    del pre

    def ref_of(activation, **kw):
        return fp8_grouped_gemm_reference(a, a_s, b, b_s, offs, activation, swiglu_limit=limit, **kw)

    def run(activation, swiglu, ref, wrong, label):
        ok_all = True
        for kw in ({}, dict(overlap_promotion=overlap_buildable(k), wide_gated=True)):
            fn = Fp8GroupedGemm(activation, n, k, E, False, swiglu=swiglu, **kw)
            out = torch.full((m_total, fn.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
            fn.launch(fn.prepare(a, a_s, b, b_s, out, offs, None))
            torch.cuda.synchronize()
            nan = bool(torch.isnan(out).any())
            rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            off = float((out.float() - wrong).norm() / wrong.norm().clamp_min(1e-30))
            ok = (not nan) and rel < 1e-2 and off > 0.02
            ok_all &= ok
            print(f"[{model} fc1 {activation} {label} {kw or 'plain'}] {clamped:.1%} of gates past the limit: "
                  f"rel_err={rel:.3e} (vs the other form: {off:.2e}) nan={nan} -> {'PASS' if ok else 'FAIL'}", flush=True)
        return ok_all

    ok_all = True
    # (alpha, beta, after_act) and the form it must differ from
    for alpha, beta, after, other in ((1.702, 1.0, False, (1.702, 0.0, False)), (1.0, 0.0, False, (1.0, 1.0, False)),
                                      (1.0, 0.0, True, (1.0, 0.0, False))):
        def clamped_ref(al, be, af):
            return ref_of("clamped_swiglu", swiglu_alpha=al, swiglu_beta=be, swiglu_limit_after_act=af)
        ok_all &= run("clamped_swiglu", (alpha, limit, beta, after), clamped_ref(alpha, beta, after),
                      clamped_ref(*other), f"alpha {alpha} limit {limit} beta {beta} after_act {after}")
    caps = (limit, 2 * limit)
    ok_all &= run("softcapped_swiglu", caps, ref_of("softcapped_swiglu", gate_softcap=caps[0], up_softcap=caps[1]),
                  ref_of("swiglu"), f"caps {caps[0]}, {caps[1]}")
    return ok_all


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--overlap", action="store_true",
                   help="also run the overlapped-promotion schedule (checked bit-identical, timed)")
    p.add_argument("--wide", action="store_true",
                   help="also FC1 with one m64n128 gate+up WGMMA (checked bit-identical, timed)")
    p.add_argument("--cluster", action="store_true",
                   help="also clusters of 2 CTAs multicasting A (checked bit-identical, timed)")
    p.add_argument("--smem-scales", action="store_true",
                   help="also every layer kernel with its scales staged in smem (checked bit-identical, timed)")
    p.add_argument("--deferred-epilogue", action="store_true",
                   help="also each layer GEMM with its epilogue under the next unit's first k-tile (drop v48; "
                        "checked bit-identical, timed)")
    p.add_argument("--unit-scales", action="store_true",
                   help="also each layer GEMM with its scales loaded by TMA, 8 k-tiles per copy (drop v69; checked "
                        "bit-identical to the layer's schedule, timed at the power cap)")
    p.add_argument("--clamped", action="store_true",
                   help="also FC1 with clamped_swiglu, beta 1 and 0 (drop v100), the gate clamped after "
                        "the activation (drop v102), and softcapped_swiglu (drop v103), checked against the reference")
    p.add_argument("--raster-m", default="1", help="m-tiles per raster group, comma-separated: each is timed, "
                                                  "the first is also checked")
    args = p.parse_args(argv)
    rasters = tuple(int(r) for r in args.raster_m.split(",") if r.strip())
    ok = run_compile(args.model, args.overlap, args.wide, rasters[0], args.cluster, args.smem_scales)  # what the GPU runs
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        torch.backends.cuda.matmul.allow_tf32 = False
        ok &= run_gpu(args.model, args.routing, args.reps, rasters, args.overlap, args.wide, args.cluster,
                      args.smem_scales)
        if args.deferred_epilogue:
            ok &= check_deferred_epilogue(args.model, args.routing, args.reps)
        if args.unit_scales:
            ok &= check_unit_scales(args.model)
        if args.clamped:
            ok &= check_clamped(args.model, args.routing)
    else:
        print("no SM90 GPU: compile checks only")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
