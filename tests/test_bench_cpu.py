"""`python -m moe_ep.bench` runs on a CPU machine (reference backend) and prints its table."""

import os
import subprocess
import sys


def test_bench_runs_on_cpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "moe_ep.bench", "--tokens", "16", "--iters", "1", "--warmup", "0"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no CUDA GPU here: running the reference backend" in p.stdout
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("reference")]
    assert lines, p.stdout
    row = lines[0]
    # backend, shape, tokens/rank, EP, ms, TFLOP/s, graph ms, graph TFLOP/s (nan: no graph on CPU)
    assert row[-6] == "16" and row[-5] == "1"
    assert float(row[-4]) > 0 and float(row[-3]) > 0
