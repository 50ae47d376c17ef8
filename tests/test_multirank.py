"""EP over 2, 4 and 8 CPU ranks (gloo, torchrun in a subprocess) equals EP=1 (every activation, with
and without per-expert biases); at 2 ranks also under torch.compile(fullgraph=True)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def torchrun(n: int, script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.multirank
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ep_matches_ep1(n):
    p = torchrun(n, HERE / "mr_worker.py")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for r in range(n):
        assert f"rank {r}/{n}: OK" in p.stdout


@pytest.mark.multirank
def test_torchrun_bench_on_cpu():
    """`torchrun --nproc_per_node=2 -m moe_ep.bench` runs (reference backend, gloo) and reports EP=2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "moe_ep.bench",
           "--tokens", "8", "--iters", "1", "--warmup", "0", "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("reference")]
    assert len(rows) == 1 and rows[0][-6:-4] == ["8", "2"], p.stdout
    assert float(rows[0][-4]) > 0
