"""Peers benchmarked side by side, each in a process of its own (they own their NVSHMEM runtime).

LigerCute 0.8.5: its benchmark script (``liger_bench.py``, found via ``--peer-script``, the
``MOE_EP_LIGER_BENCH`` variable, or ``shared/peers/liger_bench.py`` beside the checkout) is started
with ``torchrun`` on the same model and token count; its environment (``PYTHONPATH`` with
``liger_cute_kernels``, its libcudart 12) must be set by the caller, e.g. by sourcing
``.device/liger/env.sh`` on the GPU host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def find_liger_script(explicit: str | None) -> Path | None:
    cands = [explicit, os.environ.get("MOE_EP_LIGER_BENCH")]
    here = Path(__file__).resolve()
    for up in (here.parents[1], here.parents[2], Path.cwd(), Path.cwd().parent):
        cands.append(str(up / "shared" / "peers" / "liger_bench.py"))
        cands.append(str(up / ".device" / "peers" / "liger_bench.py"))
    for c in cands:
        if c and Path(c).is_file():
            return Path(c)
    return None


def run_liger(model: str, tokens: int, nproc: int, iters: int, script: str | None, timeout: int = 900) -> dict:
    """Run LigerCute on ``nproc`` GPUs; returns its result dict or ``{"error": ...}``."""
    path = find_liger_script(script)
    if path is None:
        return {"error": "liger_bench.py not found (pass --peer-script)"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "liger.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(path), "--model", model, "--tokens", str(tokens), "--iters", str(iters),
               "--skip-torch", "--json-out", str(out)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                           "MASTER_", "TORCHELASTIC", "GROUP_"))}
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout}s"}
        if p.returncode != 0 or not out.is_file():
            tail = (p.stdout + p.stderr)[-1500:]
            return {"error": f"exit {p.returncode}: {tail}"}
        res = json.loads(out.read_text())
        res["summary"] = [ln for ln in p.stdout.splitlines() if "SUMMARY" in ln][-1:]
        return res
