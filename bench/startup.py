"""``python -m moe_ep.bench startup`` — how long a layer takes to become ready: ``warmup()`` in a
fresh process with an empty compile cache (cold: every kernel compiled) and again in a second fresh
process on the same cache (warm: every kernel loaded), plus the host time of one eager ``forward``.
CUDA context creation and ``MoELayer(...)`` construction are timed apart from ``warmup()``.

Each measurement is a separate Python process (as a serving engine's start is), so nothing of the
first run stays in memory; the cache lives in a temporary folder unless ``--cache-dir`` is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time
t_import = time.perf_counter()
import torch
from moe_ep.api import EPGroup, MoELayer
from moe_ep.bench.models import gpu_layer_inputs, model_config
t_import = time.perf_counter() - t_import
T = int(sys.argv[2])
cfg = model_config(sys.argv[1], T)
events = []
t_cuda = time.perf_counter()
torch.zeros(1, device="cuda")  # CUDA context: an engine has one before it builds layers
torch.cuda.synchronize()
t_cuda = time.perf_counter() - t_cuda
t0 = time.perf_counter()
layer = MoELayer(cfg, EPGroup.single(), backend=sys.argv[3])
t_layer = time.perf_counter() - t0
t1 = time.perf_counter()
layer.warmup(progress=lambda m: events.append(f"{m.strip()} (+{time.perf_counter() - t1:.2f} s)"))
torch.cuda.synchronize()
t_warmup = time.perf_counter() - t1
x, ids, w, w13, w2, out = gpu_layer_inputs(cfg, T)
host = []
for i in range(25):
    torch.cuda.synchronize()
    t = time.perf_counter()
    layer.forward(x, ids, w, w13, w2, out=out)
    host.append(time.perf_counter() - t)
torch.cuda.synchronize()
layer.destroy()
host.sort()
print("RESULT " + json.dumps({"import_s": t_import, "cuda_s": t_cuda, "layer_s": t_layer, "warmup_s": t_warmup, "forward_host_us": host[len(host) // 2] * 1e6,
                              "events": events}))
"""


def _child(model: str, tokens: int, backend: str, cache: str) -> dict:
    env = dict(os.environ, MOE_EP_CACHE_DIR=cache)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _CHILD, model, str(tokens), backend], capture_output=True,
                       text=True, env=env, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"startup child failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    res["process_s"] = wall
    return res


def run_startup(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("moe_ep.bench startup: needs a CUDA GPU (it times warmup() and forward); nothing to do here")
        return 0
    backend = (args.backend or ["auto"])[0]
    T = args.tokens if args.tokens is not None else 8192
    for model in args.model:
        with tempfile.TemporaryDirectory(prefix="moe_ep_startup_") as tmp:
            cache = getattr(args, "cache_dir", None) or tmp
            cold = _child(model, T, backend, cache)
            warm = _child(model, T, backend, cache)
        print(f"\nstart-up, {model} ({T} tokens, backend {backend}), each in a fresh process:")
        print(f"{'':<6}{'import s':>10}{'CUDA init s':>13}{'MoELayer() s':>14}{'warmup() s':>12}{'process s':>11}"
              f"{'forward host us':>17}")
        for name, r in (("cold", cold), ("warm", warm)):
            print(f"{name:<6}{r['import_s']:>10.2f}{r['cuda_s']:>13.2f}{r['layer_s']:>14.2f}{r['warmup_s']:>12.2f}"
                  f"{r['process_s']:>11.2f}{r['forward_host_us']:>17.1f}")
        print("warm warmup(), steps (time since its start): " + "; ".join(warm["events"]))
    return 0
