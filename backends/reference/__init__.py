"""Pure-torch EP MoE backend (CPU with gloo, GPU with NCCL): the oracle and the baseline."""

from .backend import ReferenceBackend, ReferenceHandleState, activate, check, expert_mlp, grouped_mm_fits

__all__ = ["ReferenceBackend", "ReferenceHandleState", "activate", "check", "expert_mlp", "grouped_mm_fits"]
