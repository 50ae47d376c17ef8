"""Rows of ``python -m moe_ep.bench``: the printed table, the CSV file, and a merge of CSV files.

One row = one backend (or peer library) on one model: tokens per rank, EP size and three times
with their TFLOP/s (FLOPs per rank per forward = ``MoEConfig.flops(T)`` = 6·T·K·H·I, swiglu):

* per-call: device sync (+ group barrier when EP > 1) before each call, CUDA events around one
  forward, median over iterations;
* back-to-back (b2b): N forwards enqueued without a sync between them (an engine loop), one
  event pair around all N, time / N; the median over a few such runs;
* graph: one forward captured in a CUDA graph, replayed like a per-call forward.

``b2b/graph`` = back-to-back throughput / graph throughput (= graph ms / b2b ms): how much of the
graph-replay speed an eager engine loop gets. A missing measurement prints ``n/a`` (one ``n/a``
for an ms / TFLOP/s pair) and is an empty CSV field.

``python -m moe_ep.bench.report A.csv [B.csv ...]`` prints the rows of several runs (e.g. moe_ep
and the peers measured in processes of their own) as one table.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import asdict, dataclass

CSV_FIELDS = ("model", "backend", "source", "tokens_per_rank", "ep", "per_call_ms", "per_call_tflops",
              "b2b_ms", "b2b_tflops", "graph_ms", "graph_tflops", "b2b_over_graph", "gpu", "torch",
              "commit", "note")


@dataclass
class Row:
    model: str                       # display name, e.g. "Qwen3-30B-A3B"
    backend: str                     # backend name or peer label
    source: str                      # "moe_ep" or "peer"
    tokens_per_rank: int
    ep: int
    per_call_ms: float | None = None
    per_call_tflops: float | None = None
    b2b_ms: float | None = None
    b2b_tflops: float | None = None
    graph_ms: float | None = None
    graph_tflops: float | None = None
    b2b_over_graph: float | None = None
    gpu: str = ""
    torch: str = ""
    commit: str = ""
    note: str = ""


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def make_row(model: str, backend: str, source: str, tokens: int, ep: int, flops: float,
             per_call_ms=None, b2b_ms=None, graph_ms=None, env: dict | None = None, note: str = "") -> Row:
    """A row with TFLOP/s (from ``flops`` per rank per forward) and the b2b/graph ratio filled in;
    missing or non-finite times become None."""
    tf = lambda ms: flops / (ms * 1e-3) / 1e12 if _ok(ms) else None  # noqa: E731
    pc, bb, gr = (float(v) if _ok(v) else None for v in (per_call_ms, b2b_ms, graph_ms))
    env = env or {}
    return Row(model=model, backend=backend, source=source, tokens_per_rank=int(tokens), ep=int(ep),
               per_call_ms=pc, per_call_tflops=tf(pc), b2b_ms=bb, b2b_tflops=tf(bb),
               graph_ms=gr, graph_tflops=tf(gr), b2b_over_graph=(gr / bb if bb and gr else None),
               gpu=env.get("gpu", ""), torch=env.get("torch", ""), commit=env.get("commit", ""), note=note)


# ---- the printed table ------------------------------------------------------------------
W_BACKEND, W_MS, W_TF = 32, 10, 9
HEADER = (f"{'backend':<{W_BACKEND}}{'tokens/rank':>12}{'EP':>4}"
          f"{'per-call ms':>{W_MS + 2}}{'TFLOP/s':>{W_TF}}"
          f"{'b2b ms':>{W_MS}}{'TFLOP/s':>{W_TF}}"
          f"{'graph ms':>{W_MS}}{'TFLOP/s':>{W_TF}}{'b2b/graph':>11}")
LEGEND = ("per-call: sync (+barrier) before each forward, median; b2b: forwards back to back, no sync, "
          "time/N, median of runs; graph: CUDA-graph replay per call; TFLOP/s per GPU = 6·T·K·H·I / time; "
          "b2b/graph = b2b throughput / graph throughput; slowest rank")


def _pair(ms, tf, width_ms: int) -> str:
    if ms is None:  # one n/a under the ms column for the pair
        return f"{'n/a':>{width_ms}}{'':{W_TF}}"
    return f"{ms:>{width_ms}.3f}{_tf(tf):>{W_TF}}"


def _tf(tf) -> str:
    if tf is None:
        return "nan"
    return f"{tf:.1f}" if tf >= 1 else f"{tf:.3g}"  # CPU smoke runs: keep tiny values nonzero


def format_row(r: Row) -> str:
    """Without a graph time, the graph pair and the ratio print as ONE n/a (the ratio needs it)."""
    if r.graph_ms is None:
        graph = f"{'n/a':>{W_MS}}"
    else:
        ratio = f"{r.b2b_over_graph:>11.3f}" if r.b2b_over_graph is not None else f"{'n/a':>11}"
        graph = _pair(r.graph_ms, r.graph_tflops, W_MS) + ratio
    return (f"{r.backend:<{W_BACKEND}}{r.tokens_per_rank:>12}{r.ep:>4}"
            f"{_pair(r.per_call_ms, r.per_call_tflops, W_MS + 2)}{_pair(r.b2b_ms, r.b2b_tflops, W_MS)}"
            f"{graph}").rstrip()


def format_tables(rows: list[Row], model_info: dict[str, str] | None = None) -> list[str]:
    """One block per model (in first-seen order): a title line, the header, one line per row,
    then the notes of rows that have one."""
    out: list[str] = []
    models: list[str] = []
    for r in rows:
        if r.model not in models:
            models.append(r.model)
    for m in models:
        mine = [r for r in rows if r.model == m]
        info = (model_info or {}).get(m, "")
        out.append(f"\n{m}{'  ' + info if info else ''}")
        out.append(HEADER)
        out += [format_row(r) for r in mine]
        out += [f"  note, {r.backend}: {r.note}" for r in mine if r.note]
    return out


def env_line(env: dict) -> str:
    launches = f" | kernel launches {env['launches']}" if env.get("launches") else ""
    return (f"GPU: {env.get('gpu') or 'n/a'} | torch {env.get('torch') or 'n/a'} | "
            f"moe_ep commit {env.get('commit') or 'n/a'}{launches}")


def env_lines(rows: list[Row]) -> list[str]:
    """One :func:`env_line` per distinct (GPU, torch, commit) among ``rows``."""
    seen = []
    for r in rows:
        key = dict(gpu=r.gpu, torch=r.torch, commit=r.commit)
        if key not in seen:
            seen.append(key)
    return [env_line(e) for e in seen]


# ---- CSV ----------------------------------------------------------------------------------
def _csv_value(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_csv(path: str, rows: list[Row]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            d = asdict(r)
            w.writerow([_csv_value(d[k]) for k in CSV_FIELDS])


_INT_FIELDS = ("tokens_per_rank", "ep")
_FLOAT_FIELDS = ("per_call_ms", "per_call_tflops", "b2b_ms", "b2b_tflops", "graph_ms", "graph_tflops",
                 "b2b_over_graph")


def read_csv(path: str) -> list[Row]:
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            kw = {}
            for k in CSV_FIELDS:
                v = rec.get(k) or ""
                if k in _INT_FIELDS:
                    kw[k] = int(v)
                elif k in _FLOAT_FIELDS:
                    kw[k] = float(v) if v else None
                else:
                    kw[k] = v
            rows.append(Row(**kw))
    return rows


def main(argv=None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m moe_ep.bench.report A.csv [B.csv ...]", file=sys.stderr)
        return 2
    rows: list[Row] = []
    for p in paths:
        try:
            rows += read_csv(p)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"report: skipping {p}: {type(e).__name__}: {e}")
    if not rows:
        print("report: no rows")
        return 1
    for line in format_tables(rows) + [""] + env_lines(rows) + [LEGEND]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
