"""SM90 (H100/H200) BF16 backend on the CuTeDSL varlen-M grouped GEMM (drop ``sm90/megamoe``).

EP=1 forward (T tokens, K choices, M = T·K routed rows), all on the device, no host sync:

1. sort the M (token, k) pairs by expert (stable) -> ``perm``; per-expert counts by an integer
   scatter-add and a cumulative sum -> ``expert_offsets [E+1]`` int32 in device memory;
2. gather token rows into expert order: ``xs [M, H] = x[perm // K]``;
3. FC1 + activation in the GEMM epilogue: ``h [M, I]``;
4. FC2 with the router weight of each row applied in the epilogue: ``y [M, H]``;
5. combine: ``out[t] = sum_k y[inv[t·K + k]]`` summed in float32 in k order, cast to bf16.

Large intermediates live in buffers allocated at warmup for ``max_tokens_per_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.shim import sm90_check_gemm_shapes, sm90_grouped_gemm

from ...registry import BackendImpl, UnsupportedBackendError

ACTIVATION_MAP = {"swiglu": "swiglu", "squared_relu": "squared_relu"}


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedBackendError("sm90_bf16_cutedsl needs a CUDA device (got %s)" % device)
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl needs an SM90 GPU (H100/H200); this GPU is "
                                      f"sm_{cc[0]}{cc[1]} ({torch.cuda.get_device_name(device)})")
    if config.dtype != torch.bfloat16:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl runs bf16 only, not {config.dtype}")
    if config.activation not in ACTIVATION_MAP:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl: activation {config.activation!r} is not "
                                      f"supported (supported: {sorted(ACTIVATION_MAP)})")
    if group.world_size != 1:
        raise UnsupportedBackendError("sm90_bf16_cutedsl: expert parallelism over >1 rank is not "
                                      "available in this version (EP=1 only)")
    try:
        import cutlass  # noqa: F401
    except ImportError as e:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl needs nvidia-cutlass-dsl: {e}") from e
    e_local = config.local_experts(group.world_size)
    try:
        sm90_check_gemm_shapes(ACTIVATION_MAP[config.activation], config.w13_rows, config.hidden, e_local)
        sm90_check_gemm_shapes("identity", config.hidden, config.intermediate, e_local)
    except ValueError as e:
        raise UnsupportedBackendError(str(e)) from e


@dataclass
class Sm90HandleState:
    num_tokens: int
    top_k: int
    inv: torch.Tensor  # [T·K] int64: grouped row of pair t·K + k
    topk_weights: torch.Tensor  # [T, K] float32


class Sm90CuteDSLBackend(BackendImpl):
    name = "sm90_bf16_cutedsl"

    def __init__(self, config: Any, group: Any, device: torch.device) -> None:
        self.cfg = config
        self.group = group
        self.device = device
        self.E = config.local_experts(group.world_size)
        self._fc1 = self._fc2 = None
        self._bufs: dict[str, torch.Tensor] = {}

    # ---- set-up ------------------------------------------------------------------------------
    def _ensure(self) -> None:
        if self._fc1 is not None:
            return
        cfg, E = self.cfg, self.E
        self._fc1 = sm90_grouped_gemm(ACTIVATION_MAP[cfg.activation], cfg.w13_rows, cfg.hidden, E)
        self._fc2 = sm90_grouped_gemm("identity", cfg.hidden, cfg.intermediate, E, scale_rows=True)
        M = cfg.max_tokens_per_rank * cfg.top_k
        dev, bf = self.device, torch.bfloat16
        self._bufs = {
            "xs": torch.empty(M, cfg.hidden, dtype=bf, device=dev),
            "h": torch.empty(M, cfg.intermediate, dtype=bf, device=dev),
            "y": torch.empty(M, cfg.hidden, dtype=bf, device=dev),
            "yg": torch.empty(M, cfg.hidden, dtype=bf, device=dev),
            "ws": torch.empty(M, dtype=torch.float32, device=dev),
            "counts": torch.empty(E, dtype=torch.int32, device=dev),
            "offsets": torch.zeros(E + 1, dtype=torch.int32, device=dev),
            "ones": torch.ones(M, dtype=torch.int32, device=dev),
            "arange": torch.arange(M, dtype=torch.int64, device=dev),
            "inv": torch.empty(M, dtype=torch.int64, device=dev),
        }

    def warmup(self, progress):
        progress("compiling FC1 (%s) and FC2 grouped GEMMs for sm_90a" % self.cfg.activation)
        self._ensure()
        progress("running once")
        cfg = self.cfg
        T = min(cfg.max_tokens_per_rank, 64)
        g = torch.Generator(device=self.device).manual_seed(0)
        x = torch.randn(T, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, self.E, (T, cfg.top_k), device=self.device, generator=g, dtype=torch.int32)
        w = torch.rand(T, cfg.top_k, device=self.device, generator=g)
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g).to(torch.bfloat16)
        self.forward(x, ids, w, w13, w2)
        torch.cuda.synchronize(self.device)

    # ---- the pieces --------------------------------------------------------------------------
    def _route(self, topk_ids: torch.Tensor):
        """-> (perm [M] int64 pairs in expert order, offsets [E+1] int32, inv [M] int64)."""
        b = self._bufs
        M = topk_ids.numel()
        flat = topk_ids.reshape(-1)
        perm = torch.sort(flat, stable=True).indices
        counts = b["counts"].zero_()
        counts.scatter_add_(0, flat.long(), b["ones"][:M])
        offsets = b["offsets"]  # offsets[0] was zeroed at allocation and is never written
        torch.cumsum(counts, 0, out=offsets[1:])
        inv = b["inv"][:M]
        inv.scatter_(0, perm, b["arange"][:M])
        return perm, offsets, inv

    def dispatch(self, x, topk_ids, topk_weights):
        self._ensure()
        T, K = topk_ids.shape
        M = T * K
        perm, offsets, inv = self._route(topk_ids)
        xs = torch.index_select(x, 0, perm // K, out=self._bufs["xs"][:M])
        # the handle owns its copies: the caller may dispatch again before combining
        state = Sm90HandleState(T, K, inv.clone(), topk_weights)
        return xs, offsets.clone(), state

    def combine(self, expert_out, state: Sm90HandleState, out=None):
        T, K = state.num_tokens, state.top_k
        H = expert_out.shape[1]
        g = expert_out.index_select(0, state.inv).view(T, K, H).float()
        res = (g * state.topk_weights.unsqueeze(-1)).sum(1)
        res = res.to(torch.bfloat16)
        if out is not None:
            return out.copy_(res)
        return res

    def forward(self, x, topk_ids, topk_weights, w13, w2, out=None):
        self._ensure()
        b = self._bufs
        T, K = topk_ids.shape
        H = x.shape[1]
        M = T * K
        if out is None:
            out = torch.empty(T, H, dtype=x.dtype, device=x.device)
        if T == 0:
            return out
        perm, offsets, inv = self._route(topk_ids)
        xs = torch.index_select(x, 0, perm // K, out=b["xs"][:M])
        ws = torch.index_select(topk_weights.reshape(-1), 0, perm, out=b["ws"][:M])
        h = self._fc1(xs, w13, offsets, out=b["h"][:M])
        y = self._fc2(h, w2, offsets, out=b["y"][:M], row_scale=ws)
        yg = torch.index_select(y, 0, inv, out=b["yg"][:M])
        out.copy_(torch.sum(yg.view(T, K, H), dim=1, dtype=torch.float32))
        return out

    def destroy(self):
        self._bufs = {}
        self._fc1 = self._fc2 = None


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False):
    """The compiled SM90 varlen-M grouped GEMM (for benchmarks and engines with their own MoE
    plumbing): ``fn(a [M,k] bf16, b [E,n,k] bf16, offsets [E+1] int32 (device), out=[M,n_out]
    bf16, row_scale=[M] f32)``; ``n_out`` = n/2 for swiglu."""
    return sm90_grouped_gemm(activation, n, k, num_experts, scale_rows=scale_rows)
