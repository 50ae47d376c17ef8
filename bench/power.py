"""Power and SM clock per timing mode: joins an ``nvidia-smi`` sample log with the phase log that
``python -m moe_ep.bench`` writes under ``MOE_EP_BENCH_PHASES`` (``bench/timing.py``).

    nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv,noheader,nounits \\
        -lms 50 > power.csv &
    MOE_EP_BENCH_PHASES=phases.txt python -m moe_ep.bench --rounds 3 ...
    python -m moe_ep.bench.power power.csv phases.txt

Question it answers (seventeenth session): back to back and under CUDA graphs the BF16 Qwen3 layer
runs 6-8% below its per-call speed while the FP8 one does not -- is BF16 at the 700 W cap only
when forwards follow each other?
"""

from __future__ import annotations

import statistics
import sys
from datetime import datetime


def parse_sample(line: str):
    """``(epoch s, W, SM MHz, deg C, power cap active: bool | None)`` from one ``nvidia-smi
    --format=csv,noheader,nounits`` line of ``timestamp,power.draw,clocks.sm,temperature.gpu``
    [``,clocks_event_reasons.sw_power_cap``] (timestamp ``YYYY/MM/DD HH:MM:SS.fff``, local time of
    the sampling host); None for a line that is not a sample."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4:
        return None
    try:
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        w, mhz, temp = float(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        return None
    cap = parts[4].lower() in ("active", "1", "0x0000000000000004") if len(parts) > 4 else None
    return t, w, mhz, temp, cap


def read_samples(lines) -> list[tuple]:
    """The samples of :func:`parse_sample` among ``lines`` (bad lines skipped)."""
    return [s for s in map(parse_sample, lines) if s is not None]


def read_phases(lines) -> list[tuple[float, float, str]]:
    """``(start, end, name)`` from ``<start> <end> <name...>`` lines."""
    out = []
    for line in lines:
        parts = line.split(maxsplit=2)
        if len(parts) == 3:
            out.append((float(parts[0]), float(parts[1]), parts[2].strip()))
    return out


def summarize(samples, phases) -> list[tuple[str, int, float, float, float]]:
    """Per phase: ``(name, samples, mean W, mean SM MHz, max deg C)`` over the samples inside it
    (phases with no sample are reported with NaNs)."""
    rows = []
    for t0, t1, name in phases:
        inside = [s for s in samples if t0 <= s[0] <= t1]
        if inside:
            rows.append((name, len(inside), statistics.fmean(s[1] for s in inside),
                         statistics.fmean(s[2] for s in inside), max(s[3] for s in inside)))
        else:
            rows.append((name, 0, float("nan"), float("nan"), float("nan")))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m moe_ep.bench.power POWER_CSV PHASES_TXT", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        samples = read_samples(f)
    with open(argv[1]) as f:
        phases = read_phases(f)
    print(f"{'phase':<48}{'samples':>8}{'W':>8}{'SM MHz':>8}{'max C':>7}")
    for name, n, w, mhz, temp in summarize(samples, phases):
        print(f"{name:<48}{n:>8}{w:>8.1f}{mhz:>8.0f}{temp:>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
