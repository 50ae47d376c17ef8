"""Peers at decode token counts: each (peer, tokens) in its own ``torchrun`` (see :mod:`.peers`), as
rows of the decode sweep (:class:`.decode.DecodeRow`) beside moe_ep's, in the same run.

``python -m moe_ep.bench --model qwen3 --tokens 128 --peer flashinfer --peer-decode-tokens 1,8,128``.
A peer layer is made for each token count (its ``max_tokens`` = that count); its per-call median
is the sweep's "eager" column, its CUDA-graph replay the "graph" column. The weight-read bandwidth
uses the experts that moe_ep's routing of the same seed hits at that token count (the peers draw
their own uniform routing, so the count is the same in expectation, not exactly).
"""

from __future__ import annotations

from typing import Callable

import torch

from .decode import DecodeRow, make_row
from .models import draw_routing


def routing_ids(cfg, T: int, world: int, rank: int, seed: int) -> torch.Tensor:
    """This rank's ``topk_ids [T, K]`` as :func:`moe_ep.bench.__main__.make_inputs` draws them."""
    return draw_routing(torch.Generator().manual_seed(seed), cfg.num_experts, cfg.top_k, T, world, rank)[1]


def peer_decode_rows(peers, model_name: str, model_key: str, dims: dict, cfg, sizes, nproc: int, seed: int,
                     run: Callable[..., dict], say=print) -> list[DecodeRow]:
    """One :class:`DecodeRow` per (peer, tokens) that ran; ``run(peer, model_key, dims, T, nproc)``
    returns :func:`moe_ep.bench.peers.run_peer`'s dict. A failed run is reported and skipped."""
    rows = []
    for peer in peers:
        for T in sizes:
            res = run(peer, model_key, dims, T, nproc)
            if "error" in res:
                say(f"peer {peer} at {T} tokens on {model_name} FAILED: {res['error']}")
                continue
            per_call, graph = res.get("per_call_ms"), res.get("graph_ms")
            nan = float("nan")
            rows.append(make_row(model_name, res.get("label", peer), nproc, cfg,
                                 routing_ids(cfg, T, nproc, 0, seed + T),
                                 nan if per_call is None else float(per_call), nan if graph is None else float(graph)))
    return rows
