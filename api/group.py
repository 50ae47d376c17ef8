"""EPGroup: the ranks that share one MoE layer's experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EPGroup:
    """An expert-parallel group: ``world_size`` ranks, this process being ``rank``.

    Build it with :meth:`single` (one process, all experts local) or :meth:`from_process_group`
    (a ``torch.distributed`` group; ``None`` = the default group). ``pg`` is that group (None for
    a single process) and ``comm_device`` the device its collectives take tensors on.
    """

    rank: int
    world_size: int
    pg: Any = None
    dist_backend: str = "none"

    @staticmethod
    def single() -> "EPGroup":
        return EPGroup(rank=0, world_size=1, pg=None, dist_backend="none")

    @staticmethod
    def from_process_group(pg: Any = None) -> "EPGroup":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("EPGroup.from_process_group: torch.distributed is not initialised "
                             "(call dist.init_process_group first, or use EPGroup.single())")
        pg = pg if pg is not None else dist.group.WORLD
        return EPGroup(rank=dist.get_rank(pg), world_size=dist.get_world_size(pg), pg=pg,
                       dist_backend=str(dist.get_backend(pg)).lower())

    @staticmethod
    def default() -> "EPGroup":
        """The default torch.distributed group if initialised, else a single process."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return EPGroup.from_process_group(None)
        return EPGroup.single()

    @property
    def comm_device(self) -> torch.device:
        if self.dist_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def local_expert_range(self, num_experts: int) -> range:
        """Global ids of this rank's experts: ``[rank·E/W, (rank+1)·E/W)``."""
        e_local = num_experts // self.world_size
        return range(self.rank * e_local, (self.rank + 1) * e_local)
