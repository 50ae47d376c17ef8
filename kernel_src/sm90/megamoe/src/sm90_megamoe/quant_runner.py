"""FP8 row quantisers (:mod:`.fp8_quant`): items per pass (drop v54) -- bits and bandwidth.

    python -m sm90_megamoe.quant_runner [--model qwen3,mixtral] [--tokens 8192] [--items 1,2,4]
                                       [--rounds 3] [--reps 30]

Per model, the two quantisers an FP8 MoE layer runs at ``--tokens`` tokens:

* FC2's input: the counted quantiser over ``M = tokens * top_k`` grouped rows of ``I`` values;
* FC1's input: the scattering quantiser, each of the ``tokens`` rows of ``H`` values quantised once
  and stored in its ``top_k`` grouped rows (a random permutation stands in for the layout).

Every machine: compile each ``--items`` variant for sm_90a and check the PTX (``cvt.rn.satfinite.
e4m3x2.f32``, no local memory). With an SM90 GPU: random bf16 inputs, NaN-poisoned outputs; each
variant must write the bits :func:`.fp8_reference.quantize_rows128` gives (values and scales,
every row); then the variants are timed interleaved over ``--rounds`` rounds (CUDA events, median
of ``--reps`` of 10 TVM-FFI launches back to back; needs ``apache-tvm-ffi``; the inputs are larger
than L2) beside torch's plain bf16 -> e4m3 cast of the input rows (a bandwidth baseline from the
same run, no scales: for FC2's input the same bytes read and written; for the scattering
quantiser the source rows only, 1 / top_k of its writes). GB/s counts bf16 read + e4m3 written +
scales written.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from .fp8_quant import FP8_BLOCK, CompiledFp8QuantizeRows, compile_fp8_quantize_rows
from .fp8_reference import quantize_rows128

MODELS = {"qwen3": dict(hidden=2048, inter=768, topk=8), "mixtral": dict(hidden=4096, inter=14336, topk=2)}


@functools.lru_cache(maxsize=None)
def compiled(k: int, items: int, scatter_topk: int = 0, tvm_ffi: bool = False):
    """The counted (or, with ``scatter_topk``, the scattering) quantiser, compiled once per process
    (``tvm_ffi``: for the timed launches; the classic launch converts its tensors on the host each
    call, ~80 us, longer than the kernel)."""
    return compile_fp8_quantize_rows(k, counted=not scatter_topk, scatter_topk=scatter_topk, items=items,
                                     keep_ptx=True, tvm_ffi=tvm_ffi)


def check_ptx(k: int, items: int, scatter_topk: int = 0) -> None:
    ptx = compiled(k, items, scatter_topk).__ptx__
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, "no e4m3 conversion in the PTX"
    assert "ld.local" not in ptx and "st.local" not in ptx, "local memory in the PTX"


def _time(fn, reps: int, launches: int = 10) -> float:
    """Median ms of one launch: ``launches`` back to back between two events (TVM-FFI launches,
    ~4 us of host time each, so the GPU never waits for the host), median of ``reps``."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(launches):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    return statistics.median(times)


def run_model(name: str, tokens: int, items_list, rounds: int, reps: int, gen: torch.Generator) -> None:
    cfg = MODELS[name]
    topk, M = cfg["topk"], tokens * cfg["topk"]
    cases = {}
    # FC2's input: M grouped rows of I (counted; the count is every row)
    x2 = torch.randn(M, cfg["inter"], generator=gen, device="cuda").mul_(3).to(torch.bfloat16)
    count = torch.tensor([M], dtype=torch.int32, device="cuda")
    cases["fc2_in counted"] = (x2, dict(count=count), M, lambda it: CompiledFp8QuantizeRows(
        cfg["inter"], counted=True, tvm_ffi=True, compiled=compiled(cfg["inter"], it, tvm_ffi=True)))
    # FC1's input: tokens rows of H, each stored in top_k grouped rows
    x1 = torch.randn(tokens, cfg["hidden"], generator=gen, device="cuda").mul_(3).to(torch.bfloat16)
    pos = torch.randperm(M, generator=gen, device="cuda").view(tokens, topk).to(torch.int32)
    recv = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    cases["fc1_in scatter"] = (x1, dict(pos=pos, recv_count=recv, t_max=tokens), M,
                               lambda it: CompiledFp8QuantizeRows(cfg["hidden"], scatter_topk=topk, tvm_ffi=True,
                                                                  compiled=compiled(cfg["hidden"], it, topk, True)))
    for case, (x, kw, m_out, make) in cases.items():
        k = x.shape[1]
        kernels = {it: make(it) for it in items_list}
        # the reference bits of every grouped row
        src = x if "pos" not in kw else x[torch.argsort(kw["pos"].flatten().long()) // topk]
        want_q, want_s = quantize_rows128(src)
        outs = {}
        for it, kern in kernels.items():
            q = torch.full((m_out, k), 0xFF, dtype=torch.uint8, device="cuda")  # 0xFF: an e4m3 NaN
            s = torch.full((m_out, k // FP8_BLOCK), float("nan"), dtype=torch.float32, device="cuda")
            kern(x, q, s, **kw)
            outs[it] = (q, s)
        torch.cuda.synchronize()
        for it, (q, s) in outs.items():
            same = torch.equal(q, want_q.view(torch.uint8)) and torch.equal(s, want_s)
            print(f"{name} {case} items={it}: bits {'identical to the reference' if same else 'DIFFER'}")
            assert same, f"{name} {case} items={it}: bits differ from quantize_rows128"
        nbytes = x.numel() * 2 + m_out * k + m_out * (k // FP8_BLOCK) * 4
        cast_out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
        res = {it: [] for it in items_list}
        res["torch cast"] = []
        for _ in range(rounds):
            for it, kern in kernels.items():
                q, s = outs[it]
                res[it].append(_time(lambda: kern(x, q, s, **kw), reps))
            res["torch cast"].append(_time(lambda: cast_out.copy_(x), reps))
        cast_gbs = (x.numel() * 3) / (statistics.median(res["torch cast"]) * 1e-3) / 1e9
        base = statistics.median(res[items_list[0]])
        for it, ts in res.items():
            ms = statistics.median(ts)
            gbs = (x.numel() * 3 if it == "torch cast" else nbytes) / (ms * 1e-3) / 1e9
            tag = f"items={it}" if it != "torch cast" else "torch cast of x (no scales)"
            print(f"{name} {case} M={m_out} K={k}  {tag:24s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  "
                  f"rounds {' '.join(f'{t * 1e3:.1f}' for t in ts)}"
                  + ("" if it == "torch cast" else f"  {base / ms:.3f}x items={items_list[0]}"))
        print(f"{name} {case}: torch cast bandwidth {cast_gbs:.0f} GB/s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3,mixtral")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--items", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    items_list = [int(v) for v in args.items.split(",")]
    models = args.model.split(",")
    for name in models:
        cfg = MODELS[name]
        for it in items_list:
            check_ptx(cfg["inter"], it)
            check_ptx(cfg["hidden"], it, scatter_topk=cfg["topk"])
        print(f"{name}: PTX of items {items_list} checked (e4m3 cvt, no local memory)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("no SM90 GPU: compile checks only")
        return
    try:
        import tvm_ffi  # noqa: F401  (the timed launches)
    except ImportError as e:
        raise SystemExit(f"quant_runner times TVM-FFI launches: install apache-tvm-ffi ({e})")
    gen = torch.Generator(device="cuda").manual_seed(2026)
    for name in models:
        run_model(name, args.tokens, items_list, args.rounds, args.reps, gen)


if __name__ == "__main__":
    main()
