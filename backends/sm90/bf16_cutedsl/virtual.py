"""W virtual EP ranks of the SM90 backend in one process on one GPU (testing and development).

Each virtual rank is a full :class:`Sm90CuteDSLBackend` with its own workspace (shared by every
``VirtualEP`` of the same W on that device, as real ranks share theirs) and its own CUDA stream;
peer pointers are the other virtual ranks' plain device buffers, so the same dispatch / combine
kernels run as on W GPUs, with all traffic on one GPU's memory. Every kernel's grid is limited
to ``#SMs / (2·W)`` CTAs so that all ranks' CTAs co-reside and flag waits cannot deadlock.
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

    Shapes per rank r: x ``[T_r, H]`` bf16, ids ``[T_r, K]`` int32/int64, w ``[T_r, K]`` float32,
    w13 ``[E/W, w13_rows, H]``, w2 ``[E/W, H, I]``; returns the W outputs ``[T_r, H]`` bf16.
    Several VirtualEPs (layers) of one W share the per-rank workspaces; run them one after
    another (each forward joins its rank streams back into the current stream).
    """

    def __init__(self, config, world: int, device=None, timeout_s: float = 10.0, num_ctas: int | None = None,
                 backend_cls: type = Sm90CuteDSLBackend):
        self.device = torch.device(device or "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_ctas = num_ctas or max(1, sms // (2 * world))
        self.world = world
        # backend_cls: this backend or one built on its steps (the FP8 backend), one per virtual rank
        self.ranks = [backend_cls(config, VirtualGroup(r, world), self.device, timeout_s=timeout_s,
                                  num_ctas=self.num_ctas, virtual=True)
                      for r in range(world)]
        grew = [b.ws.reserve() for b in self.ranks]  # every rank's pools first, then bind
        if any(grew):
            for b in self.ranks:
                b.ws.rebind_others(b)
        self._connect()
        self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]

    def _connect(self) -> None:
        for b in self.ranks:
            b._bind()
            b.ws.bind(self)  # a growth by another VirtualEP re-binds this one (see _rebind)
        # each of a layer's EP sessions (one, or the FP8 wire's extra widths) joins its peers'
        for sessions in zip(*(b.ep_sessions() for b in self.ranks)):
            for s in sessions:
                s.connect(list(sessions))

    def _rebind(self) -> None:
        self._connect()

    @property
    def layers(self):
        return self.ranks

    def forward(self, xs, ids, ws, w13s, w2s, outs=None, delay_rank: int | None = None, ranks=None,
                b13s=None, b2s=None):
        """Enqueue every rank's forward on its own stream, phase by phase across ranks (all
        dispatches, then all layouts, ...), no host sync; returns the outputs.

        Phase order matters in one process: CUDA loads a kernel's module lazily at its first
        launch and that load waits for the device, so a rank must never spin on a peer whose
        step has not been enqueued yet. ``ranks``: which ranks take part (default all). ``b13s``/``b2s``:
        per-rank biases when the config has a ``bias_dtype``."""
        W = self.world
        live = list(range(W)) if ranks is None else list(ranks)
        outs = list(outs) if outs is not None else [None] * W
        for r in live:
            if outs[r] is None:
                outs[r] = torch.empty(xs[r].shape[0], xs[r].shape[1], dtype=xs[r].dtype, device=self.device)
        cur = torch.cuda.current_stream(self.device)
        for r in live:
            self.streams[r].wait_stream(cur)

        def on(r, fn):
            with torch.cuda.stream(self.streams[r]):
                return fn()

        for r in live:
            if delay_rank == r:
                on(r, lambda: torch.cuda._sleep(100_000_000))
            on(r, lambda r=r: self.ranks[r]._step1_dispatch(xs[r], ids[r], ws[r]))
        for r in live:
            on(r, self.ranks[r]._step2_layout)
        for r in live:
            on(r, lambda r=r: self.ranks[r]._step34_experts(w13s[r], w2s[r], None if b13s is None else b13s[r],
                                                             None if b2s is None else b2s[r]))
        for r in live:
            on(r, self.ranks[r]._step5_combine_send)
        for r in live:
            on(r, lambda r=r: self.ranks[r]._step5_combine_reduce(outs[r]))
        for r in live:
            cur.wait_stream(self.streams[r])
        return outs

    def check(self) -> None:
        for b in self.ranks:
            b.check()

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        for b in self.ranks:
            b.ep.reset()
            b.ep.reset_input_errors()
        torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        for b in self.ranks:
            if b.ws is not None:
                b.ws.detach(self)
            b.destroy()
