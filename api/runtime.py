"""Process bootstrap for torchrun launches."""

from __future__ import annotations

import os

import torch

from .group import EPGroup


def init_distributed(backend: str | None = None) -> EPGroup:
    """Initialise torch.distributed from torchrun's environment (idempotent) and return the
    world as an :class:`EPGroup`. ``backend`` defaults to ``nccl`` with CUDA, else ``gloo``.
    Without torchrun's variables (``WORLD_SIZE`` unset) it returns ``EPGroup.single()``.
    NVLink multicast is kept off (shared hosts)."""
    import torch.distributed as dist

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    if dist.is_initialized():
        return EPGroup.from_process_group(None)
    if "WORLD_SIZE" not in os.environ:
        return EPGroup.single()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend)
    return EPGroup.from_process_group(None)
