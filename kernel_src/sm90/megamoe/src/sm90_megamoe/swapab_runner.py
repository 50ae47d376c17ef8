"""Decode runner for the swap-AB grouped GEMM (``SwapABGroupedGemmSm90``).

    python -m sm90_megamoe.swapab_runner [--model qwen3|mixtral] [--tokens 1,8,128]
                                         [--tile-t N] [--tile-w1 64] [--tile-w2 128] [--num-stages S]
                                         [--no-l2-hints] [--iters 50] [--warm-l2] [--no-baseline]

On an SM90 GPU: random decode inputs per token count (bf16 weights ~ N(0, 0.02), tokens routed
top-k uniformly, rows grouped by expert, offsets on the device), both GEMMs of the expert MLP
(FC1: swiglu, N = 2I, K = H; FC2: identity, N = H, K = I, row_scale = router weights) compiled
for the swap-AB kernel, checked against a float32 torch reference and against the existing
``GroupedGemmSm90`` (NaN-poisoned outputs before every run), then timed: CUDA events, median of
``--iters``, eager and replayed from a CUDA graph, L2 flushed before every timed run unless
``--warm-l2``. Printed per GEMM: microseconds, weight GB/s (bytes of the experts that have
tokens / time) and the ratio to ``GroupedGemmSm90`` (``launch.CompiledGroupedGemm``) on the
same inputs.

Without a GPU it only compiles every variant for sm_90a from fake tensors and prints the PTX
checks (WGMMA with the token-tile N, TMA, no local memory) and ``ptxas -v`` registers/spills.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

import torch

import cutlass
import cutlass.cute as cute

from .compile_check import fake_args
from .pdl import ptx_problems
from .swapab_gemm import SwapABGroupedGemmSm90, pick_tile_t

MODELS = {  # H, I, E, top-k
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
_TORCH_BIAS = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------- compile side
def _ptxas():
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.exists(cand):
            return cand
    return None


def ptxas_info(ptx: str, arch: str = "sm_90a"):
    """(registers, spill + stack bytes) from ``ptxas -v``, or None without a ptxas. The PTX ISA
    version is lowered to what the installed ptxas accepts (no newer instruction is used)."""
    exe = _ptxas()
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        for ver in (None, "9.0", "8.8", "8.7", "8.5"):
            txt = ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}", ptx,
                                                 flags=re.M)
            with open(src, "w") as f:
                f.write(txt)
            r = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spills = [int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr)]
                stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr)]
                return (int(regs.group(1)) if regs else -1, sum(spills) + sum(stack))
    return None


def make_kernel(activation: str, scale_rows: bool, tile_t: int, tile_w: Optional[int] = None,
                bias_dtype: Optional[str] = None, num_stages: Optional[int] = None,
                **kw) -> SwapABGroupedGemmSm90:
    return SwapABGroupedGemmSm90(activation, scale_rows=scale_rows, has_bias=bias_dtype is not None,
                                 tile_w=tile_w, tile_t=tile_t, num_stages=num_stages, **kw)


_DUMP_DIR = None


def _dump_dir() -> str:
    """Where ``--keep-ptx`` writes (never the working directory): $CUTE_DSL_DUMP_DIR if set,
    else one temporary folder per process."""
    global _DUMP_DIR
    if os.environ.get("CUTE_DSL_DUMP_DIR"):
        return os.environ["CUTE_DSL_DUMP_DIR"]
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="swapab_ptx_")
    return _DUMP_DIR


def compile_swapab(activation: str, n: int, k: int, num_experts: int, scale_rows: bool, tile_t: int,
                   tile_w: Optional[int] = None, bias_dtype: Optional[str] = None,
                   arch: str = "sm_90a", num_stages: Optional[int] = None, keep_ptx: bool = True,
                   **kw):
    """Compile one variant from fake tensors (the ``GroupedGemmSm90`` ABI: M_total dynamic).
    Returns (kernel object, compiled function); ``compiled.__ptx__`` only with ``keep_ptx``."""
    kern = make_kernel(activation, scale_rows, tile_t, tile_w, bias_dtype, num_stages, **kw)
    args = fake_args(kern, num_experts, n, k, bias_dtype=bias_dtype or "float32")
    opts = f"--gpu-arch {arch}"
    if keep_ptx:
        opts += f" --keep-ptx --dump-dir={_dump_dir()}"
    return kern, cute.compile(kern, *args, options=opts)


def ptx_checks(ptx: str, tile_t: int) -> Dict[str, bool]:
    """What the design relies on, as found in the PTX."""
    return {
        f"wgmma m64n{tile_t}k16 bf16": f"wgmma.mma_async.sync.aligned.m64n{tile_t}k16.f32.bf16.bf16" in ptx,
        "tma load (cp.async.bulk.tensor)": "cp.async.bulk.tensor" in ptx,
        "L2 cache hint": ".L2::cache_hint" in ptx,
        "paired 32-bit stores": "st.global.b32" in ptx and "shfl.sync.bfly.b32" in ptx,
        "no local memory": "ld.local" not in ptx and "st.local" not in ptx,
        "target sm_90a": ".target sm_90a" in ptx,
        "PDL wait + early trigger": not ptx_problems(ptx),
    }


def describe(kern: SwapABGroupedGemmSm90) -> str:
    return (f"tile_w={kern.tile_w} tile_t={kern.tile_t} wg={kern.num_mma_wg} "
            f"stage={kern.stage_bytes() // 1024}KB x {kern.num_stages}")


def compile_report(model: str, tokens, tile_t: Optional[int] = None, arch: str = "sm_90a") -> bool:
    H, I, E, topk = MODELS[model]
    ok = True
    done = set()
    for T in tokens:
        tt = tile_t or pick_tile_t(T * topk, E)
        for name, act, n, k, sr in (("FC1", "swiglu", 2 * I, H, False), ("FC2", "identity", H, I, True)):
            if (name, tt) in done:
                continue
            done.add((name, tt))
            t0 = time.time()
            kern, c = compile_swapab(act, n, k, E, sr, tt, arch=arch)
            dt = time.time() - t0
            ptx = c.__ptx__
            checks = ptx_checks(ptx, tt)
            info = ptxas_info(ptx, arch)
            sass = "ptxas n/a" if info is None else f"regs {info[0]} spill/stack {info[1]}B"
            good = all(checks.values()) and (info is None or info[1] == 0)
            ok &= good
            bad = [key for key, v in checks.items() if not v]
            print(f"[compile] {model} {name} {act:8s} N={n} K={k} E={E} (T={T}) {describe(kern)}: "
                  f"{dt:.2f}s {sass} {'OK' if good else 'FAIL ' + str(bad)}", flush=True)
    return ok


# ---------------------------------------------------------------------------------- GPU side
def to_cute_args(a, b, c, offsets, row_scale, bias):
    """CuTe views with the structure of ``compile_check.fake_args`` (M_total dynamic, the rest
    static); same conversion as ``launch.to_cute_args``."""
    from cutlass.cute.runtime import from_dlpack

    mA = from_dlpack(a, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    mB = from_dlpack(b, assumed_align=16)
    mC = from_dlpack(c, assumed_align=16).mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
    mOff = from_dlpack(offsets, assumed_align=4)
    mScale = from_dlpack(row_scale, assumed_align=4).mark_compact_shape_dynamic(mode=0)
    mBias = from_dlpack(bias, assumed_align=4)
    if bias.shape[0] == 1:  # the placeholder's length is dynamic
        mBias = mBias.mark_compact_shape_dynamic(mode=1, stride_order=(0, 1))
    return mA, mB, mC, mOff, mScale, mBias


class CompiledSwapAB:
    """One compiled swap-AB kernel (any routing, any M_total) with a torch-facing call."""

    def __init__(self, activation: str, n: int, k: int, num_experts: int, scale_rows: bool,
                 tile_t: int, tile_w: Optional[int] = None, bias_dtype: Optional[str] = None,
                 num_stages: Optional[int] = None, **kw):
        self.kernel, self.compiled = compile_swapab(activation, n, k, num_experts, scale_rows, tile_t,
                                                    tile_w, bias_dtype, num_stages=num_stages,
                                                    keep_ptx=False, **kw)
        self.activation, self.n, self.k, self.num_experts = activation, n, k, num_experts
        self.n_out, _ = self.kernel.static_shapes(n, k)
        self.scale_rows, self.bias_dtype = scale_rows, bias_dtype
        self._dummies = None

    def placeholders(self, device):
        if self._dummies is None:
            self._dummies = (torch.zeros(1, dtype=torch.float32, device=device),
                             torch.zeros(1, 8, dtype=torch.float32, device=device))
        return self._dummies

    def convert(self, a, b, offsets, out, row_scale=None, bias=None):
        d_scale, d_bias = self.placeholders(a.device)
        if self.scale_rows:
            assert row_scale is not None and row_scale.dtype == torch.float32
        if self.bias_dtype is not None:
            assert bias is not None and bias.dtype == _TORCH_BIAS[self.bias_dtype]
        return to_cute_args(a, b, out, offsets, row_scale if self.scale_rows else d_scale,
                            bias if self.bias_dtype is not None else d_bias)

    def launch_converted(self, args, max_active_ctas: Optional[int] = None, stream=None):
        import cuda.bindings.driver as cuda

        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        if max_active_ctas is None:
            max_active_ctas = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.compiled(*args, cutlass.Int32(max_active_ctas), stream)

    def __call__(self, a, b, offsets, out=None, row_scale=None, bias=None, max_active_ctas=None):
        if out is None:
            out = torch.empty(a.shape[0], self.n_out, dtype=torch.bfloat16, device=a.device)
        if a.shape[0] == 0:
            return out
        self.launch_converted(self.convert(a, b, offsets, out, row_scale, bias), max_active_ctas)
        return out


def route(T: int, E: int, topk: int, gen: torch.Generator, routing: str = "uniform"):
    """Row -> token map and [E+1] offsets of T tokens routed top-k. uniform: k distinct experts
    per token, uniformly; 'one': every row to expert 0 (a GEMM stress case, not a real top-k);
    'zero_hole': uniform over all experts but expert E // 2 (which gets no rows)."""
    if routing == "one":
        ids = torch.zeros(T, topk, dtype=torch.long)
    else:
        scores = torch.rand(T, E, generator=gen)
        if routing == "zero_hole":
            scores[:, E // 2] = -1.0
        ids = scores.topk(topk, dim=1).indices
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order // topk
    counts = torch.bincount(flat, minlength=E)
    offs = torch.zeros(E + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return token_of_row, offs


def make_decode_inputs(model: str, T: int, seed: int = 0, routing: str = "uniform", device="cuda"):
    H, I, E, topk = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    token_of_row, offs = route(T, E, topk, gen, routing)
    x = torch.randn(T, H, generator=dgen, device=device).to(torch.bfloat16)
    a1 = x[token_of_row.to(device)].contiguous()
    w13 = (torch.randn(E, 2 * I, H, generator=dgen, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=dgen, device=device) * 0.02).to(torch.bfloat16)
    rs = torch.rand(T * topk, generator=dgen, device=device)  # router weights of the rows
    return a1, w13, w2, offs.to(device), rs, offs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = ref.float().norm().item()
    return (out.float() - ref.float()).norm().item() / (d if d > 0 else 1.0)


class Timer:
    """Median of CUDA-event times; the L2 is flushed (a 256 MB write) before every timed run
    unless warm, so the weights come from DRAM as in a real decode step."""

    def __init__(self, iters: int = 50, warm_l2: bool = False):
        self.iters, self.warm = iters, warm_l2
        self.flush_buf = None if warm_l2 else torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def _time(self, run, before=None) -> float:
        for _ in range(3):
            if before is not None:
                before()
            run()
        torch.cuda.synchronize()
        evs = []
        for _ in range(self.iters):
            if before is not None:
                before()
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            evs.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in evs) * 1e3  # us

    def eager(self, run, before=None) -> float:
        return self._time(run, before)

    def graph(self, run, before=None) -> float:
        """``run`` captured once into a CUDA graph, then replayed."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()  # warm up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        torch.cuda.synchronize()
        return self._time(g.replay, before)


def gpu_run(args) -> bool:
    from .reference import grouped_gemm_reference

    H, I, E, topk = MODELS[args.model]
    print(f"device: {torch.cuda.get_device_name()}  model {args.model}: H={H} I={I} E={E} top-{topk}",
          flush=True)
    timer = Timer(args.iters, args.warm_l2)
    cache = {}
    base = {}

    def swapab(name, act, n, k, sr, tt):
        key = (name, tt)
        if key not in cache:
            t0 = time.time()
            tw = args.tile_w1 if name == "FC1" else args.tile_w2
            cache[key] = CompiledSwapAB(act, n, k, E, sr, tt, tile_w=tw, num_stages=args.num_stages,
                                        l2_hints=args.l2_hints)
            print(f"[compile] swap-AB {name} {describe(cache[key].kernel)}: {time.time() - t0:.2f}s",
                  flush=True)
        return cache[key]

    def baseline(name, act, n, k, sr):
        if args.no_baseline:
            return None
        if name not in base:
            try:
                from .launch import CompiledGroupedGemm

                base[name] = CompiledGroupedGemm(act, n, k, E, sr)
            except Exception as exc:  # the baseline is informative only
                print(f"[baseline] GroupedGemmSm90 {name} unavailable: {exc!r}", flush=True)
                base[name] = None
        return base[name]

    ok = True
    total = {}
    for T in args.tokens:
        M = T * topk
        tt = args.tile_t or pick_tile_t(M, E)
        a1, w13, w2, offs, rs, offs_cpu = make_decode_inputs(args.model, T, seed=T)
        active = int((offs_cpu[1:] > offs_cpu[:-1]).sum())
        h1 = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
        y = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
        print(f"--- T={T} tokens, {M} rows, {active}/{E} experts active, rows/expert max "
              f"{int((offs_cpu[1:] - offs_cpu[:-1]).max())}, tile_t={tt}", flush=True)
        gemms = (("FC1", "swiglu", 2 * I, H, False, a1, w13, h1, None),
                 ("FC2", "identity", H, I, True, None, w2, y, rs))
        for name, act, n, k, sr, a, w, out, scale in gemms:
            if a is None:
                a = h1  # FC2 consumes FC1's output
            fn = swapab(name, act, n, k, sr, tt)
            ref = grouped_gemm_reference(a, w, offs_cpu, act, scale)
            out.fill_(float("nan"))
            fn(a, w, offs, out=out, row_scale=scale)
            torch.cuda.synchronize()
            nan = bool(torch.isnan(out).any())
            err = rel_err(out, ref)
            good = (not nan) and err < 1e-2
            line = f"[check] T={T} {name} swap-AB rel_err {err:.2e} nan={nan}"
            bfn = baseline(name, act, n, k, sr)
            bout = None
            if bfn is not None:
                bout = torch.full_like(out, float("nan"))
                bfn(a, w, offs, out=bout, row_scale=scale)
                torch.cuda.synchronize()
                line += f" | GroupedGemmSm90 rel_err {rel_err(bout, ref):.2e} | swap-AB vs it {rel_err(out, bout):.2e}"
            print(line + (" PASS" if good else " FAIL"), flush=True)
            ok &= good
            if not args.bench:
                continue
            conv = fn.convert(a, w, offs, out, scale)
            poison = lambda o=out: o.fill_(float("nan"))  # noqa: E731
            t_e = timer.eager(lambda: fn.launch_converted(conv), poison)
            t_g = timer.graph(lambda: fn.launch_converted(conv), poison)
            ok &= not bool(torch.isnan(out).any())  # the last timed run wrote every row
            wbytes = active * n * k * 2
            line = (f"[bench] T={T} {name} swap-AB eager {t_e:7.1f} us ({wbytes / t_e / 1e3:6.0f} GB/s)"
                    f"  graph {t_g:7.1f} us ({wbytes / t_g / 1e3:6.0f} GB/s)")
            total.setdefault(T, [0.0, 0.0])
            total[T][0] += t_g
            if bfn is not None:
                bconv = to_cute_args(a, w, bout, offs, scale if sr else bfn.placeholders(a.device)[0],
                                     bfn.placeholders(a.device)[1])
                b_e = timer.eager(lambda: bfn.launch_converted(bconv))
                b_g = timer.graph(lambda: bfn.launch_converted(bconv))
                total[T][1] += b_g
                line += (f" | GroupedGemmSm90 eager {b_e:7.1f} graph {b_g:7.1f} us"
                         f" ({wbytes / b_g / 1e3:6.0f} GB/s) | speedup (graph) {b_g / t_g:.2f}x")
            print(line, flush=True)
    for T, (ours, theirs) in total.items():
        extra = f", GroupedGemmSm90 {theirs:.1f} us" if theirs else ""
        print(f"[total] T={T} FC1+FC2 graph: swap-AB {ours:.1f} us{extra}", flush=True)
    print(f"[runner] {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    p.add_argument("--tokens", default="1,8,128", help="comma-separated token counts")
    p.add_argument("--tile-t", type=int, default=None, help="token tile (default: pick_tile_t)")
    p.add_argument("--tile-w1", type=int, default=None, help="FC1 tile_w (default 64)")
    p.add_argument("--tile-w2", type=int, default=None, help="FC2 tile_w (default 128)")
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--no-l2-hints", dest="l2_hints", action="store_false")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warm-l2", action="store_true", help="do not flush the L2 before timed runs")
    p.add_argument("--no-bench", dest="bench", action="store_false")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.compile_only or not torch.cuda.is_available():
        print("no CUDA device: compile for sm_90a only" if not torch.cuda.is_available()
              else "compile only", flush=True)
        ok = compile_report(args.model, args.tokens, args.tile_t)
    else:
        ok = gpu_run(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
