"""MoEConfig: the static description of one MoE layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("swiglu", "squared_relu", "gelu_glu")
GATED = ("swiglu", "gelu_glu")
SUPPORTED_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class MoEConfig:
    """Static shape of an expert-parallel MoE layer (validated on construction).

    Args:
        num_experts: E, experts in total over all ranks (a multiple of the EP world size).
        hidden: H, model hidden size.
        intermediate: I, per-expert intermediate size.
        top_k: K, experts chosen per token (1 <= K <= E).
        max_tokens_per_rank: upper bound on T, tokens a rank passes to one forward; sizes buffers.
        dtype: activation and weight dtype (``torch.bfloat16``).
        activation: ``"swiglu"`` (silu(gate)·up), ``"gelu_glu"`` (gelu(gate)·up, erf form) or
            ``"squared_relu"`` (relu(h)²). Weights per rank ``r`` (local experts
            ``[r·E/W, (r+1)·E/W)``):

            * ``w13`` ``[E_local, 2·I, H]`` for the gated activations (gate rows ``[0, I)``
              first, then up rows ``[I, 2I)``), ``[E_local, I, H]`` for ``squared_relu``;
            * ``w2`` ``[E_local, H, I]``.
    """

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype = torch.bfloat16
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden", "intermediate", "top_k", "max_tokens_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {v}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"MoEConfig.dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"MoEConfig.dtype {self.dtype} is not supported; supported: {SUPPORTED_DTYPES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation {self.activation!r} is not one of {ACTIVATIONS}")

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def w13_rows(self) -> int:
        """Rows of one expert's ``w13``: 2·I for gated activations, I otherwise."""
        return 2 * self.intermediate if self.gated else self.intermediate

    def local_experts(self, world_size: int) -> int:
        """E_local = E / W; raises ``ValueError`` when E is not a multiple of W."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if self.num_experts % world_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of the EP world "
                             f"size ({world_size})")
        return self.num_experts // world_size

    def flops(self, tokens: int) -> int:
        """Useful FLOPs of the expert MLP for ``tokens`` tokens: 2·T·K·H·(w13_rows + I)
        (= 6·T·K·H·I for the gated activations)."""
        return 2 * tokens * self.top_k * self.hidden * (self.w13_rows + self.intermediate)
