"""W virtual EP ranks of the SM90 backend in one process on one GPU (testing and development).

Each virtual rank is a full :class:`Sm90CuteDSLBackend` with its own buffers and CUDA stream;
peer pointers are the other virtual ranks' plain device buffers, so the same dispatch / combine
kernels run as on W GPUs, with all traffic on one GPU's memory. Every kernel's grid is limited to
``#SMs / (2·W)`` CTAs so that all ranks' CTAs co-reside and flag waits cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import Sm90CuteDSLBackend


@dataclass(frozen=True)
class VirtualGroup:
    rank: int
    world_size: int
    pg: object = None
    dist_backend: str = "virtual"


class VirtualEP:
    """``forward(xs, ids, ws, w13s, w2s)`` with one list entry per virtual rank.

    Shapes per rank r: x ``[T_r, H]`` bf16, ids ``[T_r, K]`` int32, w ``[T_r, K]`` float32,
    w13 ``[E/W, w13_rows, H]``, w2 ``[E/W, H, I]``; returns the W outputs ``[T_r, H]`` bf16.
    """

    def __init__(self, config, world: int, device=None, timeout_s: float = 10.0, num_ctas: int | None = None):
        self.device = torch.device(device or "cuda")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_ctas = num_ctas or max(1, sms // (2 * world))
        self.world = world
        self.ranks = [Sm90CuteDSLBackend(config, VirtualGroup(r, world), self.device, timeout_s=timeout_s,
                                         num_ctas=self.num_ctas, virtual=True) for r in range(world)]
        for b in self.ranks:
            b._ensure()
        sessions = [b.ep for b in self.ranks]
        for s in sessions:
            s.connect(sessions)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]

    def forward(self, xs, ids, ws, w13s, w2s, outs=None, delay_rank: int | None = None):
        """Launch every rank's forward on its own stream (no host sync inside); returns outputs."""
        outs = outs or [None] * self.world
        res = []
        cur = torch.cuda.current_stream(self.device)
        for r, b in enumerate(self.ranks):
            s = self.streams[r]
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                if delay_rank == r:
                    torch.cuda._sleep(100_000_000)
                res.append(b.forward(xs[r], ids[r], ws[r], w13s[r], w2s[r], outs[r]))
        for s in self.streams:
            cur.wait_stream(s)
        return res

    def check(self) -> None:
        for b in self.ranks:
            b.check()

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        for b in self.ranks:
            b.ep.reset()
        torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        for b in self.ranks:
            b.destroy()
