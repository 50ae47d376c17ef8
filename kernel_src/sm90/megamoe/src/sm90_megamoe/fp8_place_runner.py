"""Drop v92's placing FP8 FC1 on the H200: correctness and timing against quantiser + plain GEMM.

    python -m sm90_megamoe.fp8_place_runner [--model qwen3,mixtral] [--reps 60]

Per model, the layer's FC1 on the schedule the layer runs (:func:`.fp8_runner._layer_kw`): the
copying FC1 (row r of A is row ``idx[r]`` of the tokens quantised once each in token order, its
scales with it), after the token-order quantiser (the scattering one with top-k 1), against the
scattering quantiser (the layer's step 3) + the plain FC1. (Drop v93 removed v92's quantising
placement, FC1's and FC2's: measured slower.)

Checks (uniform and skewed routing, 8192 tokens and 1, 5 and 37 tokens; NaN-poisoned outputs and
A, A's scales poisoned): the placing GEMM, run twice in a row, gives the plain GEMM's output bit
for bit, writes A and its scales bit for bit as :func:`.fp8_reference.quantize_rows128` (the
quantiser kernels' rule), and leaves its sync buffer zero. Then, at the 700 W cap (each launch
back to back for half a second before ``--reps`` timed launches), interleaved over 3 rounds: the
quantisers, the plain GEMM, scattering quantiser + plain, and token-order quantiser + the placing
GEMM with each setting of :data:`COPY_SETTINGS`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .fp8_gemm_place import default_chunk_rows
from .fp8_launch import CompiledFp8Gemm
from .fp8_quant import CompiledFp8QuantizeRows
from .fp8_reference import quantize_rows128, quantize_weight_block128
from .fp8_runner import MODELS, _layer_kw, _time_at_cap, max_active_ctas

#: FC1's copy settings timed: (``place_chunk_rows`` as a multiple of the default, ``place_unroll``);
#: the first is the default
COPY_SETTINGS = ((1, 4), (2, 4))
#: (routing, tokens) of the bit checks; 0 = the model's bench tokens
CHECKS = (("uniform", 0), ("skewed", 0), ("uniform", 1), ("skewed", 5), ("uniform", 37))


def routing(tokens: int, topk: int, experts: int, kind: str, seed: int):
    """A layer's grouped rows for ``tokens`` tokens with ``topk`` distinct experts each: ``(idx [M]
    int32 token of each grouped row, pos [T, topk] int32 grouped row of each choice, offsets [E + 1]
    int32)``, rows grouped by expert and in token order within one (the layout kernels' order)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.ones(experts) if kind == "uniform" else 1.0 / torch.arange(1, experts + 1) ** 1.2
    ids = torch.multinomial(w.expand(tokens, experts), topk, replacement=False, generator=g)
    order = torch.argsort(ids.flatten(), stable=True)
    pos = torch.empty(tokens * topk, dtype=torch.int64)
    pos[order] = torch.arange(tokens * topk)
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.bincount(ids.flatten(), minlength=experts), 0)
    cuda = lambda t: t.to(torch.int32).cuda().contiguous()  # noqa: E731
    return cuda(order // topk), cuda(pos.view(tokens, topk)), cuda(offs)


def sync_buffer(m_total: int, experts: int) -> torch.Tensor:
    """A placing GEMM's sync buffer: zeros, S = the most m-tiles ``m_total`` rows can take."""
    return torch.zeros((m_total + 127) // 128 + experts + 4, dtype=torch.int32, device="cuda")


class Problem:
    """The layer's FC1 on one routing: the inputs, the plain GEMM's output on the reference
    quantiser's rows (``want``), and the launches to time."""

    def __init__(self, model: str, kind: str, tokens: int, seed: int):
        h, i, E, topk, _ = MODELS[model]
        self.n, self.k = 2 * i, h
        self.E, self.topk, self.tokens = E, topk, tokens
        self.idx, self.pos, self.offs = routing(tokens, topk, E, kind, seed)
        self.m = tokens * topk
        d = torch.Generator(device="cuda").manual_seed(seed)
        self.x = (torch.randn(tokens, self.k, generator=d, device="cuda") * 0.5).bfloat16()
        self.b, self.b_s = quantize_weight_block128(
            torch.randn(E, self.n, self.k, generator=d, device="cuda") * self.k ** -0.5)
        self.rs = torch.ones(1, device="cuda")
        self.a_ref, self.as_ref = quantize_rows128(self.x.index_select(0, self.idx.long()))
        self.n_out = self.n // 2
        # the tokens quantised once each, in token order (what a copying FC1 reads)
        self.xq_tok, self.sx_tok = quantize_rows128(self.x)

    def out(self) -> torch.Tensor:
        return torch.full((self.m, self.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")

    def poisoned_a(self):
        a = torch.full((self.m, self.k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        return a, torch.full((self.m, self.k // 128), float("nan"), device="cuda")

    def place_args(self, sync) -> dict:
        return dict(x=self.xq_tok, x_scale=self.sx_tok, idx=self.idx, sync=sync)


def check(p: Problem, plain: CompiledFp8Gemm, placing: CompiledFp8Gemm, ctas: int) -> bool:
    """The placing GEMM, twice into poisoned buffers, against the plain GEMM on the reference rows."""
    want = p.out()
    plain(p.a_ref, p.as_ref, p.b, p.b_s, p.offs, out=want, row_scale=p.rs, max_active_ctas=ctas)
    sync = sync_buffer(p.m, p.E)
    ok = True
    for _ in range(2):
        out = p.out()
        a, a_s = p.poisoned_a()
        placing(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas, **p.place_args(sync))
        torch.cuda.synchronize()
        ok &= torch.equal(out, want) and not bool(torch.isnan(out).any())
        ok &= torch.equal(a.view(torch.uint8), p.a_ref.view(torch.uint8)) and torch.equal(a_s, p.as_ref)
        ok &= not bool(sync.any())
    return ok


def quantiser(p: Problem, token_order: bool = False):
    """The layer's quantiser of FC1's A as a launch: the scattering one (each token once into its
    grouped rows; ``token_order``: into its own row, top-k 1 -- what a copying FC1 reads)."""
    count = torch.full((1,), p.tokens, dtype=torch.int32, device="cuda")
    if token_order:
        q = CompiledFp8QuantizeRows(p.k, scatter_topk=1)
        pos = torch.arange(p.tokens, dtype=torch.int32, device="cuda").view(-1, 1)
        return lambda: q(p.x, p.xq_tok, p.sx_tok, pos=pos, recv_count=count, t_max=p.tokens)
    a, a_s = p.poisoned_a()
    q = CompiledFp8QuantizeRows(p.k, scatter_topk=p.topk)
    return lambda: q(p.x, a, a_s, pos=p.pos, recv_count=count, t_max=p.tokens)


def run_model(model: str, reps: int) -> bool:
    ok = True
    ctas = max_active_ctas(2)
    h, i, E = MODELS[model][:3]
    act, n, k = "swiglu", 2 * i, h
    kw = {x: v for x, v in _layer_kw(act, k).items() if x != "scale_warp"}
    plain = CompiledFp8Gemm(act, n, k, E, False, **kw)
    placings = {}  # label: launcher
    for factor, unroll in COPY_SETTINGS:
        rows = min(32, default_chunk_rows(k) * factor)
        placings[f"copying {rows}/{unroll}"] = CompiledFp8Gemm(
            act, n, k, E, False, **kw, place_a=True, place_opts=dict(place_chunk_rows=rows, place_unroll=unroll))
    first = next(iter(placings))
    for label, placing in placings.items():  # the default on every check, the others on one
        for kind, tokens in CHECKS if label == first else CHECKS[1:2]:
            p = Problem(model, kind, tokens or MODELS[model][4], seed=7 + tokens)
            same = check(p, plain, placing, ctas)
            ok &= same
            print(f"[place {model} fc1] {label} (chunk rows/unroll) {kind} M={p.m}: placing = quantiser + plain, "
                  f"rows and scales placed, sync clean: {same}", flush=True)
    p = Problem(model, "uniform", MODELS[model][4], seed=3)
    quant, token_quant = quantiser(p), quantiser(p, token_order=True)
    out = p.out()
    sync = sync_buffer(p.m, p.E)
    a, a_s = p.poisoned_a()
    quant()

    def gemm():
        plain(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas)

    runs = {"quantiser": quant, "plain GEMM": gemm, "quantiser + plain": lambda: (quant(), gemm()),
            "token-order quantiser": token_quant}
    for label, placing in placings.items():
        def run(placing=placing):  # a copying FC1 reads the tokens the token-order quantiser wrote
            token_quant()
            placing(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas, **p.place_args(sync))
        runs["token-order quantiser + " + label] = run
    ms = {label: [] for label in runs}
    for r in range(3):
        for label in (runs if r % 2 == 0 else reversed(list(runs))):
            ms[label].append(_time_at_cap(runs[label], reps, warm_s=0.5))
    flops = 2.0 * p.m * n * k
    base = statistics.median(ms["quantiser + plain"])
    for label, t in ms.items():
        med = statistics.median(t)
        print(f"[place {model} fc1] at the cap: {label} {med:.4f} ms"
              + ("" if label.endswith("quantiser") else f" ({flops / med / 1e9:.1f} TFLOP/s, {base / med:.3f}x "
                                                        "quantiser + plain)")
              + f"; rounds {' '.join(f'{x:.4f}' for x in t)}", flush=True)
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3,mixtral", help="comma-separated: " + ", ".join(sorted(MODELS)))
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("no SM90 GPU: nothing to run (the compile checks are fp8_runner's and moe_ep's CPU tests)")
        raise SystemExit(0)
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    ok = True
    for model in args.model.split(","):
        ok &= run_model(model, args.reps)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
