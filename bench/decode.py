"""The decode-regime sweep's outputs: achieved weight-read bandwidth, a CSV and an optional plot.

A decode step reads every weight of each expert that at least one of its tokens picked; the sweep
reports that traffic over the measured time (GB/s), the number a decode kernel should push toward
the HBM bandwidth (H200: ~4.8 TB/s). ``python -m moe_ep.bench --decode-tokens 1,2,4,...,256
--decode-csv sweep.csv --plot sweep.png`` (matplotlib is optional: ``pip install "moe_ep[bench]"``).
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields

import torch


@dataclass
class DecodeRow:
    model: str
    backend: str
    ep: int
    tokens: int
    eager_ms: float
    graph_ms: float
    experts_hit: int  # distinct experts picked by this rank's tokens (all ranks: their union)
    weight_bytes: int  # bytes of expert weights those experts hold
    eager_weight_gbps: float
    graph_weight_gbps: float


def expert_weight_bytes(cfg) -> int:
    """Bytes of one expert's w13 + w2 in the layer dtype."""
    return (cfg.w13_rows * cfg.hidden + cfg.hidden * cfg.intermediate) * torch.finfo(cfg.dtype).bits // 8


def make_row(model: str, backend: str, ep: int, cfg, topk_ids: torch.Tensor, eager_ms: float,
             graph_ms: float) -> DecodeRow:
    hit = int(torch.unique(topk_ids).numel()) if topk_ids.numel() else 0
    nbytes = hit * expert_weight_bytes(cfg)

    def gbps(ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9 if ms == ms and ms > 0 else float("nan")

    return DecodeRow(model, backend, ep, int(topk_ids.shape[0]), eager_ms, graph_ms, hit, nbytes, gbps(eager_ms),
                     gbps(graph_ms))


def write_csv(path: str, rows: list[DecodeRow]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(DecodeRow)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def read_csv(path: str) -> list[DecodeRow]:
    out = []
    with open(path, newline="") as f:
        for d in csv.DictReader(f):
            kw = {}
            for fl in fields(DecodeRow):
                v = d[fl.name]
                kw[fl.name] = int(v) if fl.type in ("int", int) else float(v) if fl.type in ("float", float) else v
            out.append(DecodeRow(**kw))
    return out


def plot(path: str, rows: list[DecodeRow]) -> bool:
    """Latency (ms) against tokens per rank, log-log, one line per (model, backend, mode); returns
    False (and draws nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(r.model, r.backend) for r in rows})
    for model, backend in series:
        rs = sorted((r for r in rows if (r.model, r.backend) == (model, backend)), key=lambda r: r.tokens)
        for mode, style in (("eager", "--"), ("graph", "-")):
            ys = [getattr(r, f"{mode}_ms") for r in rs]
            if all(y != y for y in ys):  # all NaN (no graph for this backend)
                continue
            ax.plot([r.tokens for r in rs], ys, style, marker="o", ms=3, label=f"{model} {backend} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("ms per MoE layer forward")
    ax.set_title("MoE decode latency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    """``python -m moe_ep.bench.decode SWEEP.csv [MORE.csv ...] OUT.png``: plot sweeps written on a
    host without matplotlib (e.g. the GPU machine) on one that has it."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m moe_ep.bench.decode SWEEP.csv [MORE.csv ...] OUT.png", file=sys.stderr)
        return 2
    rows = [r for p in args[:-1] for r in read_csv(p)]
    if not plot(args[-1], rows):
        print("matplotlib is not installed (pip install 'moe_ep[bench]')", file=sys.stderr)
        return 1
    print(f"{len(rows)} rows plotted to {args[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
