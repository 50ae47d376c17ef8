"""``python -m moe_ep.bench.layer_bits dump OUT.pt`` / ``... compare A.pt B.pt``: are two builds of the
layer bit-identical?

``dump`` runs the default layer (``backend="auto"``) of each model in ``--model`` (qwen3,mixtral), BF16
and FP8 (``fp8_block128``), on fixed inputs (seeded; uniform and skewed routing, and a token count
that leaves most experts a last m-tile of fewer than 64 rows) and saves every output to OUT.pt.
``compare`` loads two such files and prints, per case, whether the outputs are bit-identical (exit
1 if one is not). Used by ``bench/h200_session.sh dropab`` to hold a drop edit against the drop it
replaces, each run in its own process.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_ep.api import EPGroup, MoELayer

from .__main__ import make_inputs
from .models import model_config


def dump(path: str, models: list[str], tokens: list[int]) -> None:
    group, device = EPGroup.single(), torch.device("cuda")
    outs = {}
    for key in models:
        for quant in (None, "fp8_block128"):
            cfg = model_config(key, max(tokens), quant)
            layer = MoELayer(cfg, group, backend="auto", device=device)
            for T in tokens:
                for skew in (False, True):
                    x, ids, w, w13, w2 = make_inputs(cfg, T, group, device, seed=11 + T, skew=skew)
                    out = layer.forward(x, ids, w, w13, w2)
                    torch.cuda.synchronize()
                    layer.check_errors()
                    name = f"{key} {quant or 'bf16'} T={T} {'skewed' if skew else 'uniform'}"
                    outs[name] = out.detach().cpu().clone()
                    print(f"[layer_bits] {name}: {layer.backend_name}, finite {bool(out.isfinite().all())}",
                          flush=True)
            del layer
    torch.save(outs, path)


def compare(a: str, b: str) -> int:
    A, B = torch.load(a), torch.load(b)
    bad = 0
    for name in sorted(set(A) | set(B)):
        # bytes, not values: NaN == NaN and -0 != +0, whatever the output dtype
        same = (name in A and name in B and A[name].dtype == B[name].dtype and A[name].shape == B[name].shape
                and torch.equal(A[name].contiguous().view(torch.uint8), B[name].contiguous().view(torch.uint8)))
        bad += not same
        print(f"[layer_bits] {name}: bit-identical {same}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--model", default="qwen3,mixtral")
    d.add_argument("--tokens", default="8192,1000")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b)
    dump(args.out, args.model.split(","), [int(t) for t in args.tokens.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
