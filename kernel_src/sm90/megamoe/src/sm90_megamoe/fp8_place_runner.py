"""Drop v92's placing FP8 GEMMs on the H200: correctness and timing against quantiser + plain GEMM.

    python -m sm90_megamoe.fp8_place_runner [--model qwen3,mixtral] [--reps 60]

Per model, the layer's two FP8 GEMMs on the schedule the layer runs (:func:`.fp8_runner._layer_kw`):

* FC1 (``place_gather``): grouped row r of A is token ``idx[r]``, quantised by the GEMM's own
  producer warps, against the scattering quantiser (the layer's step 3) + the plain FC1; and
  FC1 copying (``place_copy``) row ``idx[r]`` of the tokens quantised once each in token order,
  after the token-order quantiser (the scattering one with top-k 1), against the same;
* FC2: row r of A is row r of FC1's bf16 output ``h``, against the counted row quantiser + the plain
  FC2 (router row scale).

Checks (uniform and skewed routing, 8192 tokens and 1, 5 and 37 tokens; NaN-poisoned outputs and
A, A's scales poisoned): the placing GEMM, run twice in a row, gives the plain GEMM's output bit
for bit, writes A and its scales bit for bit as :func:`.fp8_reference.quantize_rows128` (the
quantiser kernels' rule), and leaves its sync buffer zero. Then, at the 700 W cap (each launch
back to back for half a second before ``--reps`` timed launches), interleaved over 3 rounds: the
quantiser, the plain GEMM, both, and the placing GEMM with each copy setting of
:data:`PLACE_SETTINGS` (chunk rows, unroll, values per lane).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .fp8_launch import CompiledFp8Gemm
from .fp8_quant import CompiledFp8QuantizeRows
from .fp8_reference import quantize_rows128, quantize_weight_block128
from .fp8_runner import MODELS, _layer_kw, _time_at_cap, max_active_ctas
from .placing_quantiser import default_chunk_rows

#: copy settings timed: (``place_chunk_rows`` as a multiple of the kernel's default for K,
#: ``place_unroll``, ``place_vals``); the first is the default. More than 16 values in flight per
#: lane take the wider register split (56 / 224).
PLACE_SETTINGS = ((1, 1, 16), (2, 1, 16), (1, 2, 16), (1, 2, 8))
#: FC1's copy settings timed: (``place_chunk_rows`` as a multiple of the default, ``place_unroll``)
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
    """One GEMM of the layer on one routing: the inputs, the plain GEMM's output on the reference
    quantiser's rows (``want``), and the launches to time."""

    def __init__(self, model: str, fc: str, kind: str, tokens: int, seed: int):
        h, i, E, topk, _ = MODELS[model]
        self.fc, self.act = fc, ("swiglu" if fc == "fc1" else "identity")
        self.n, self.k = (2 * i, h) if fc == "fc1" else (h, i)
        self.E, self.topk, self.tokens = E, topk, tokens
        self.idx, self.pos, self.offs = routing(tokens, topk, E, kind, seed)
        self.m = tokens * topk
        d = torch.Generator(device="cuda").manual_seed(seed)
        # FC1's source: the tokens; FC2's: h, one row per grouped row
        self.x = (torch.randn(tokens if fc == "fc1" else self.m, self.k, generator=d, device="cuda") * 0.5).bfloat16()
        self.b, self.b_s = quantize_weight_block128(
            torch.randn(E, self.n, self.k, generator=d, device="cuda") * self.k ** -0.5)
        self.rs = torch.rand(self.m, generator=d, device="cuda") if fc == "fc2" else torch.ones(1, device="cuda")
        self.rows = self.x.index_select(0, self.idx.long()) if fc == "fc1" else self.x
        self.a_ref, self.as_ref = quantize_rows128(self.rows)
        self.n_out = self.n // 2 if fc == "fc1" else self.n
        if fc == "fc1":  # the tokens quantised once each, in token order (what a copying FC1 reads)
            self.xq_tok, self.sx_tok = quantize_rows128(self.x)

    def out(self) -> torch.Tensor:
        return torch.full((self.m, self.n_out), float("nan"), dtype=torch.bfloat16, device="cuda")

    def poisoned_a(self):
        a = torch.full((self.m, self.k), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        return a, torch.full((self.m, self.k // 128), float("nan"), device="cuda")

    def place_args(self, sync, copy: bool = False) -> dict:
        if copy:
            return dict(x=self.xq_tok, x_scale=self.sx_tok, idx=self.idx, sync=sync)
        return dict(x=self.x, sync=sync, **({"idx": self.idx} if self.fc == "fc1" else {}))


def check(p: Problem, plain: CompiledFp8Gemm, placing: CompiledFp8Gemm, ctas: int) -> bool:
    """The placing GEMM, twice into poisoned buffers, against the plain GEMM on the reference rows."""
    want = p.out()
    plain(p.a_ref, p.as_ref, p.b, p.b_s, p.offs, out=want, row_scale=p.rs, max_active_ctas=ctas)
    sync = sync_buffer(p.m, p.E)
    ok = True
    for _ in range(2):
        out = p.out()
        a, a_s = p.poisoned_a()
        placing(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas,
                **p.place_args(sync, placing.place_copy))
        torch.cuda.synchronize()
        ok &= torch.equal(out, want) and not bool(torch.isnan(out).any())
        ok &= torch.equal(a.view(torch.uint8), p.a_ref.view(torch.uint8)) and torch.equal(a_s, p.as_ref)
        ok &= not bool(sync.any())
    return ok


def quantiser(p: Problem, token_order: bool = False):
    """The layer's quantiser of ``p``'s A as a launch: FC1 the scattering one (each token once into its
    grouped rows; ``token_order``: into its own row, top-k 1 -- what a copying FC1 reads), FC2 the
    counted row quantiser."""
    a, a_s = p.poisoned_a()
    if p.fc == "fc1":
        count = torch.full((1,), p.tokens, dtype=torch.int32, device="cuda")
        if token_order:
            q = CompiledFp8QuantizeRows(p.k, scatter_topk=1)
            pos = torch.arange(p.tokens, dtype=torch.int32, device="cuda").view(-1, 1)
            return lambda: q(p.x, p.xq_tok, p.sx_tok, pos=pos, recv_count=count, t_max=p.tokens)
        q = CompiledFp8QuantizeRows(p.k, scatter_topk=p.topk)
        return lambda: q(p.x, a, a_s, pos=p.pos, recv_count=count, t_max=p.tokens)
    q = CompiledFp8QuantizeRows(p.k, counted=True)
    return lambda: q(p.x, a, a_s, count=p.offs[-1:])


def run_model(model: str, reps: int) -> bool:
    ok = True
    ctas = max_active_ctas(2)
    for fc in ("fc1", "fc2"):
        act = "swiglu" if fc == "fc1" else "identity"
        k = MODELS[model][0] if fc == "fc1" else MODELS[model][1]
        h, i, E = MODELS[model][:3]
        n = 2 * i if fc == "fc1" else h
        kw = {x: v for x, v in _layer_kw(act, k).items() if x != "scale_warp"}
        plain = CompiledFp8Gemm(act, n, k, E, fc == "fc2", **kw)
        placings = {}  # label: launcher
        for factor, unroll, vals in PLACE_SETTINGS:
            rows = min(32, default_chunk_rows(k) * factor)
            placings[f"quantising {rows}/{unroll}/{vals}"] = CompiledFp8Gemm(
                act, n, k, E, fc == "fc2", **kw, place_a=True, place_gather=fc == "fc1",
                place_opts=dict(place_chunk_rows=rows, place_unroll=unroll, place_vals=vals))
        for factor, unroll in COPY_SETTINGS if fc == "fc1" else ():
            rows = min(32, default_chunk_rows(k // 2) * factor)
            placings[f"copying {rows}/{unroll}"] = CompiledFp8Gemm(
                act, n, k, E, False, **kw, place_a=True, place_copy=True,
                place_opts=dict(place_chunk_rows=rows, place_unroll=unroll))
        # the first setting of each way (quantising, copying) on every check, the others on one
        ways = [label.split()[0] for label in placings]
        firsts = {label for j, label in enumerate(placings) if ways[j] not in ways[:j]}
        for label, placing in placings.items():
            for kind, tokens in CHECKS if label in firsts else CHECKS[1:2]:
                p = Problem(model, fc, kind, tokens or MODELS[model][4], seed=7 + tokens)
                same = check(p, plain, placing, ctas)
                ok &= same
                print(f"[place {model} {fc}] {label} (chunk rows/unroll/vals) {kind} M={p.m}: placing = quantiser "
                      f"+ plain, rows and scales placed, sync clean: {same}", flush=True)
        p = Problem(model, fc, "uniform", MODELS[model][4], seed=3)
        quant = quantiser(p)
        out = p.out()
        sync = sync_buffer(p.m, p.E)
        a, a_s = p.poisoned_a()
        quant()

        def gemm():
            plain(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas)

        runs = {"quantiser": quant, "plain GEMM": gemm, "quantiser + plain": lambda: (quant(), gemm())}
        token_quant = quantiser(p, token_order=True) if fc == "fc1" else None
        if token_quant is not None:
            runs["token-order quantiser"] = token_quant
        for label, placing in placings.items():
            place = p.place_args(sync, placing.place_copy)

            def run(placing=placing, place=place, pre=token_quant if placing.place_copy else None):
                if pre is not None:  # a copying FC1 reads the tokens the token-order quantiser wrote
                    pre()
                placing(a, a_s, p.b, p.b_s, p.offs, out=out, row_scale=p.rs, max_active_ctas=ctas, **place)
            runs[("token-order quantiser + " if placing.place_copy else "") + label] = run
        ms = {label: [] for label in runs}
        for r in range(3):
            for label in (runs if r % 2 == 0 else reversed(list(runs))):
                ms[label].append(_time_at_cap(runs[label], reps, warm_s=0.5))
        flops = 2.0 * p.m * n * k
        base = statistics.median(ms["quantiser + plain"])
        for label, t in ms.items():
            med = statistics.median(t)
            print(f"[place {model} {fc}] at the cap: {label} {med:.4f} ms"
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
