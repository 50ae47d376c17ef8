"""SM90 (H100/H200) BF16 backend on the CuTeDSL drop ``sm90/megamoe`` -- any EP size on one host.

The forward of one rank, all on the device: no host sync, no allocation when ``out`` is given
(buffers come from the shared :mod:`.workspace`), CUDA-graph capturable, bit-deterministic:

1. **dispatch** -- each token row goes once to every rank that owns one of its experts (peer
   stores into that rank's ``recv_x`` at slot ``my_rank·T_max + t``) with its local expert ids
   and router weights; an epoch flag publishes it. A choice whose expert id is outside
   ``[0, E)`` or whose weight is not finite is dropped and recorded (``check()`` raises it);
2. **expert layout** -- wait (bounded) for every source's flag, then group the valid
   (slot, k) pairs by local expert in (slot, k) order: ``offsets``, ``idx``/``ws`` per grouped
   row, ``pos`` per pair, and the rows gathered into ``xs`` (2 launches);
3. **FC1 + activation** -- varlen-M grouped GEMM ``h = act(xs · w13ᵀ (+ b13))``: 128-row tiles, or
   for a call with few tokens (at most ``SM90_DECODE_MAX_ROWS_PER_EXPERT`` rows per expert on
   average, judged from the host-known token count) the swap-AB decode kernel, whose 64-row
   WGMMA side is the weight and whose N side is the expert's few tokens;
4. **FC2 + router weight** -- ``y = ws · (h · w2ᵀ (+ b2))`` (``y`` overwrites ``xs``);
5. **combine** -- per received token, its <= K weighted rows summed in float32 in k order go
   back to the source rank (peer store, then a flag); each source sums its <= W partial rows
   in float32 in rank order (one rank: one launch, the same bits, :func:`local_combine`).

One rank (:func:`local_route`, the default): steps 1 and 2 are drop v19's LocalRoute (the dispatch's
checks and records, fused into the count) and the place kernel gathering ``xs`` straight from
``x``: one launch fewer, no copy into ``recv_x``, the same bits.

Capacity (nothing dropped for load): a source sends each token at most once to each destination,
into its own slot range, so a rank receives at most ``S = W·T_max`` token rows and at most
``P = S·K`` grouped rows. ``T > T_max`` is refused by the API before launch; the dispatch kernel
also flags it instead of writing out of bounds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.shim import (COMPILE_EVENTS, SM90_DECODE_MAX_ROWS_PER_EXPERT, Sm90EpSession, Sm90LayoutSession, StaleHandleError,
                         env_flag, sm90_check_gemm_shapes, sm90_compiled_grouped_gemm, sm90_grouped_gemm,
                         sm90_handoff_sync_len, sm90_new_verr, sm90_prebuild_ep, sm90_prebuild_layout,
                         sm90_use_fc2_early)

from ...registry import BackendImpl, UnsupportedBackendError, require_cuda_arch, routing_value_error
from .workspace import Dims, get_workspace

# MoEConfig.activation -> the drop's FC1 epilogue
ACTIVATION_MAP = {"swiglu": "swiglu", "squared_relu": "squared_relu", "gelu_glu": "gelu_glu",
                  "clamped_swiglu": "clamped_swiglu", "softcapped_swiglu": "softcapped_swiglu",
                  "gelu_tanh_glu": "gelu_tanh_glu"}  # gelu_tanh_glu: drop v109
BIAS_DTYPES = (None, torch.float32, torch.bfloat16)


def local_combine() -> bool:
    """With one rank, step 5 is one launch (drop v14's CombineLocal: the K-row sum written straight
    into ``out``): bit-identical to send + reduce (GPU test), Qwen3 decode on the H200 1 token
    0.058 -> 0.054 ms, 128 tokens 0.311 -> 0.306 ms (CUDA graph). ``MOE_EP_LOCAL_COMBINE=0`` turns
    it off (to compare)."""
    return env_flag("MOE_EP_LOCAL_COMBINE", True)


def local_route() -> bool:
    """With one rank, steps 1-2 skip the dispatch (drop v19's LocalRoute checks the routing as the
    dispatch does and counts; the place kernel gathers ``xs`` from ``x`` itself): 2 launches
    instead of 3, no row copy into ``recv_x``, the same outputs and error records bit for bit
    (GPU tests, BF16 and FP8). On the H200, Qwen3 decode under CUDA graphs 1 / 8 / 128 tokens
    0.0472 / 0.1411 / 0.2944 -> 0.0442 / 0.1393 / 0.2927 ms (docs/PERFORMANCE.md, seventh
    session). ``MOE_EP_LOCAL_ROUTE=0`` turns it off (to compare)."""
    return env_flag("MOE_EP_LOCAL_ROUTE", True)


def gather_fc1() -> bool:
    """``MOE_EP_GATHER_FC1=1`` (one rank with LocalRoute, the 128-row GEMMs, hidden % 64 == 0): step 2
    copies no grouped rows and FC1 reads grouped row r from the caller's token ``idx[r]`` itself
    (drop v23's ``GroupedGemmGatherSm90``; the same bits as FC1 on the gathered rows by
    construction). Saves LayoutPlace's row copy (Qwen3, 8192 tokens: 65536 rows of 4 KB written
    and read back, ~0.1 ms). Off by default: on the H200 (drop v24, which fixed v23's misaligned
    bf16 row offsets; GPU tests bit-identical) the layer gained under CUDA graph on Qwen3 (468.3 vs
    448.1 TFLOP/s) but lost per call (466.4 vs 475.8) and on Mixtral (560.1 vs 589.5 graph): the
    cp.async producer feeds the WGMMAs more slowly than TMA, which eats the saved copy; in the 32nd
    session's profile the gathering FC1 ran 106 us longer than the plain one in the layer, which
    cancels the row copy's saving. (Drop v85 removed the one-TMA-per-row producer, v41, and the L2
    priorities, v75: both slower.) Since drop v91 its launch is prepared at bind like the plain FC1's
    (the call's x passed per call), so the per-call host time no longer counts against it."""
    return env_flag("MOE_EP_GATHER_FC1", False)


def token_grid() -> bool:
    """``MOE_EP_TOKEN_GRID=1``: the per-token kernels (dispatch, combine_local / combine_reduce) run
    on a grid sized from the call's host-known token count (shim ``EpSession.token_ctas``: one warp
    per token) instead of every SM: a decode step's dispatch then pays one CTA's completion fence
    and arrival atomic instead of one per SM. Same bits (GPU test passed); off by default because
    it measured no faster on the H200 (Qwen3 decode 1 / 8 / 128 tokens, docs/PERFORMANCE.md)."""
    return env_flag("MOE_EP_TOKEN_GRID", False)


def layout_chunks(num_ctas: int | None) -> int | None:
    """Fixed chunk count (CTAs) of the two step-2 layout kernels, or None for the default: the
    grid follows each call's token count (shim ``layout_chunks_for``: 4 chunks up to 16 tokens,
    ... one per SM from 257 tokens on), because every layout CTA sums the per-expert counts of
    every chunk (a decode step wants few chunks) while each chunk scans its slots (a prefill
    wants them all). ``MOE_EP_LAYOUT_CHUNKS=n`` (a tuning knob, read at bind) fixes it at ``n``
    (at most ``num_ctas``; ``n`` >= the SM count gives the fixed full grid of before). Any number
    gives the same layout (chunks are contiguous slot ranges)."""
    raw = os.environ.get("MOE_EP_LAYOUT_CHUNKS", "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"MOE_EP_LAYOUT_CHUNKS must be a positive integer, got {raw!r}")
    return int(raw) if num_ctas is None else min(num_ctas, int(raw))


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here."""
    require_cuda_arch("sm90_bf16_cutedsl", device, (9, 0), "an SM90 GPU (H100/H200)")
    if config.dtype != torch.bfloat16:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl runs bf16 only, not {config.dtype}")
    if config.activation not in ACTIVATION_MAP:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl: activation {config.activation!r} is not "
                                      f"supported (supported: {sorted(ACTIVATION_MAP)})")
    quant = getattr(config, "quant", None)
    if quant is not None:
        need = {"nvfp4_w4a16": "an SM100 (B200/GB200) W4A16 backend", "mxfp8": "an SM120 MXFP8 backend",
                "fp8_block128": "backend='sm90_fp8_cutedsl' (what backend='auto' picks for it)"}
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl runs BF16 weights; quant={quant!r} needs "
                                      f"{need.get(quant, 'another backend')}")
    bias_dtype = getattr(config, "bias_dtype", None)
    if bias_dtype not in BIAS_DTYPES:
        raise UnsupportedBackendError(f"sm90_bf16_cutedsl: bias_dtype {bias_dtype} is not supported "
                                      "(None, torch.float32, torch.bfloat16)")
    if group.world_size > 1 and group.dist_backend not in ("nccl", "virtual"):
        raise UnsupportedBackendError("sm90_bf16_cutedsl over several ranks bootstraps NVSHMEM over an "
                                      f"NCCL process group (got {group.dist_backend!r})")
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


def rows_per_expert(cfg: Any, world: int, tokens: int) -> float:
    """Mean rows an expert receives when every rank sends ``tokens`` tokens (uniform routing)."""
    return world * tokens * cfg.top_k / cfg.num_experts


def swiglu_constants(cfg: Any) -> dict:
    """FC1's compile-time activation constants for the shim (MoEConfig's): clamped_swiglu's alpha, limit,
    beta and clamp order, softcapped_swiglu's caps, none for the other activations. Shared with the FP8
    backend."""
    if cfg.activation == "softcapped_swiglu":
        return dict(gate_softcap=cfg.gate_softcap, up_softcap=cfg.up_softcap)
    if cfg.activation != "clamped_swiglu":
        return {}
    return dict(swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, swiglu_beta=cfg.swiglu_beta,
                swiglu_limit_after_act=cfg.swiglu_limit_after_act)


def _gemm_specs(cfg: Any, e_local: int, world: int = 1) -> dict:
    """The grouped GEMMs of a layer: shim arguments (one place, so a prebuild and a layer ask for
    exactly the same kernels). ``fc1``/``fc2`` are picked by the shim for the mean rows per expert
    at capacity (``max_tokens_per_rank``): the decode (swap-AB) kernels when that is small, else
    the 128-row kernels. A layer whose capacity is large also gets ``fc1_decode``/``fc2_decode``
    (swap-AB, sized for :data:`SM90_DECODE_MAX_ROWS_PER_EXPERT`) for calls with few tokens; the
    choice between the two is made per call from the host-known token count, never from routing."""
    bias_dtype = getattr(cfg, "bias_dtype", None)
    rows = rows_per_expert(cfg, world, cfg.max_tokens_per_rank)
    act_consts = swiglu_constants(cfg)
    specs = {
        "fc1": dict(activation=ACTIVATION_MAP[cfg.activation], n=cfg.w13_rows, k=cfg.hidden, num_experts=e_local,
                    bias_dtype=bias_dtype, rows_per_expert=rows, **act_consts),
        # FC2's offsets / row weights come from step 2, two launches back: with PDL launches its
        # swap-AB kernel may start streaming weights before FC1 ends (shim: early_weights)
        "fc2": dict(activation="identity", n=cfg.hidden, k=cfg.intermediate, num_experts=e_local, scale_rows=True,
                    bias_dtype=bias_dtype, rows_per_expert=rows, early_weights=True),
    }
    if rows > SM90_DECODE_MAX_ROWS_PER_EXPERT:
        for name in ("fc1", "fc2"):
            specs[f"{name}_decode"] = dict(specs[name], rows_per_expert=SM90_DECODE_MAX_ROWS_PER_EXPERT)
        if world == 1 and gather_fc1() and local_route() and cfg.hidden % 64 == 0:
            specs["fc1"]["gather_a"] = True  # the 128-row FC1 reads the caller's tokens by idx
    if sm90_use_fc2_early():  # drop v112: the 128-row FC2 starts inside FC1's last wave (not the decode pair)
        specs["fc1"]["handoff"], specs["fc2"]["handoff"] = "publish", "await"
    return specs


def prebuild_layer(config: Any, world_size: int, kernels: tuple, gemms: dict, arch: str = "sm_90a") -> None:
    """Compile (or load from the disk compile cache) the kernel groups ``kernels`` of a layer
    without a GPU: ``gemms[name]()`` builds GEMM group ``name`` (e.g. "fc1"), "ep" and "layout" are
    this drop's EP and expert-layout kernels for ``arch`` (they are arch-neutral)."""
    d = Dims.of(config, world_size)
    for name in kernels:
        if name in gemms:
            gemms[name]()
        elif name == "ep":
            sm90_prebuild_ep(d.hidden, d.topk, world_size, d.max_tokens, config.num_experts, arch,
                             local_combine=local_combine())
        elif name == "layout":
            sm90_prebuild_layout(d.hidden, d.topk, world_size, d.max_tokens, config.local_experts(world_size), arch,
                                 route=world_size == 1 and local_route())
        else:
            raise ValueError(f"unknown kernel group {name!r} ({', '.join((*gemms, 'ep', 'layout'))})")


def prebuild(config: Any, world_size: int, kernels: tuple = ("fc1", "fc2", "ep", "layout"),
             gpu: str | None = None) -> None:
    """Compile (or load from the disk compile cache) every kernel a layer of ``config`` on
    ``world_size`` ranks needs, without a GPU: FC1, FC2, the EP kernels and the layout kernels
    (``kernels`` picks a subset; "fc1"/"fc2" include their decode variants). ``gpu``: the name of
    the GPU the layer will run on (None: the H200's picks; see the shim's ``compiled_grouped_gemm``).
    ``python -m moe_ep.aot build`` calls it."""
    specs = _gemm_specs(config, config.local_experts(world_size), world_size)

    def gemm(name):
        return lambda: [sm90_compiled_grouped_gemm(**specs[n], device_name=gpu) for n in (name, f"{name}_decode")
                        if n in specs]

    prebuild_layer(config, world_size, kernels, {"fc1": gemm("fc1"), "fc2": gemm("fc2")})


@dataclass
class Sm90HandleState:
    """What ``combine`` needs from a ``dispatch``: token count and the workspace sequence
    number of that dispatch (a later dispatch/forward on the workspace overwrote its buffers)."""

    num_tokens: int
    seq: int


class Sm90CuteDSLBackend(BackendImpl):
    name = "sm90_bf16_cutedsl"
    _split_rows = False  # True inside dispatch(): step 2 copies the grouped rows for the caller
    _decode = False  # this call runs the decode (swap-AB) GEMM pair (set by step 1)
    #: target of the EP and layout kernels (arch-neutral; the Blackwell backends subclass this one)
    arch = "sm_90a"
    #: block-scaled subclasses: ``(values per scale, scale dtype)`` of their quantised grouped rows,
    #: which live in the shared workspace (``Dims.quant``); None: BF16 rows only
    quant_rows: tuple | None = None

    @classmethod
    def workspace_dims(cls, config: Any, world_size: int) -> Dims:
        """What a layer of ``config`` on ``world_size`` ranks needs from the shared workspace
        (block-scaled subclasses add the rows their switches use)."""
        return Dims.of(config, world_size, cls.quant_rows)

    def __init__(self, config: Any, group: Any, device: torch.device, *, timeout_s: float = 10.0,
                 num_ctas: int | None = None, virtual: bool = False) -> None:
        """``num_ctas``: grid of every EP and layout kernel (default: all SMs). ``virtual``: one of
        W virtual ranks in this process (see :mod:`.virtual`), for testing EP on one GPU."""
        self.cfg, self.group, self.device = config, group, device
        self.W = group.world_size
        self.E = config.local_experts(self.W)
        self.dims = self.workspace_dims(config, self.W)
        self.timeout_ns = int(timeout_s * 1e9)
        self.num_ctas = num_ctas
        self.virtual = virtual
        self.token_grid = token_grid()
        self._token_ctas = None
        self._tokens = None
        self._routing = None
        self.local_route = False
        self.ws = get_workspace(group, device)
        self.ws.register(self, self.dims)
        self.ep = None
        self.verr = None

    # ---- set-up ------------------------------------------------------------------------------
    def _ensure(self) -> None:
        """Collective on first use: size the shared workspace, then bind this layer to it."""
        if self.ep is not None:
            return
        if self.ws.reserve():
            self.ws.rebind_others(self)
        self._bind()

    def _bind(self) -> None:
        """Views into the workspace, EP + layout sessions and GEMM launchers of this layer."""
        cfg, d, dev = self.cfg, self.dims, self.device
        v = self.ws.views(d)
        if self.verr is None:
            self.verr = sm90_new_verr(dev)
        peers, global_ranks = None, ()
        if self.W > 1 and not self.virtual:
            import torch.distributed as dist

            peers = self.ws.peer_views(d)
            global_ranks = tuple(dist.get_process_group_ranks(self.group.pg))
        self.local_combine = self.W == 1 and local_combine()
        self.local_route = self.W == 1 and local_route()
        self.ep = Sm90EpSession(d.hidden, d.topk, self.W, d.max_tokens, cfg.num_experts, self.group.rank, dev,
                                {**v, "verr": self.verr}, peers=peers, global_ranks=global_ranks,
                                num_ctas=self.num_ctas, timeout_ns=self.timeout_ns, arch=self.arch,
                                local_combine=self.local_combine)
        fixed_chunks = layout_chunks(self.num_ctas)
        self.layout = Sm90LayoutSession(d.hidden, d.topk, self.W, d.max_tokens, self.E, dev, v["counts"],
                                        num_chunks=fixed_chunks or self.num_ctas, timeout_ns=self.timeout_ns,
                                        arch=self.arch, adaptive=fixed_chunks is None, route=self.local_route)
        self._bind_gemms(v)
        self.xs, self.h = v["xs"], v["h"]
        self.y = v["xs"]  # FC2's output overwrites FC1's input, dead by then
        self.offsets, self.idx, self.ws_rows, self.pos = v["offsets"], v["idx"], v["ws"], v["pos"]
        self._prepare_launches()
        if not self.virtual:  # a VirtualEP binds itself instead (it re-connects all its ranks)
            self.ws.bind(self)

    def _bind_gemms(self, views: dict) -> None:
        """FC1/FC2 launchers (and the decode pair when the layer's capacity is large)."""
        cfg, dev = self.cfg, self.device
        specs = _gemm_specs(cfg, self.E, self.W)
        self.fc1 = sm90_grouped_gemm(**specs["fc1"], device=dev)
        self.fc2 = sm90_grouped_gemm(**specs["fc2"], device=dev)
        # decode (swap-AB) GEMMs for calls with few tokens, when fc1/fc2 are the 128-row kernels
        self.fc1_decode = self.fc2_decode = None
        if "fc1_decode" in specs:
            self.fc1_decode = sm90_grouped_gemm(**specs["fc1_decode"], device=dev)
            self.fc2_decode = sm90_grouped_gemm(**specs["fc2_decode"], device=dev)
        self._decode_max_tokens = int(SM90_DECODE_MAX_ROWS_PER_EXPERT * cfg.num_experts / (self.W * cfg.top_k))
        self._gemms = (self.fc1, self.fc2)
        # drop v112: FC1 and FC2 share a sync buffer (zero once here; the kernels leave it so)
        self._handoff_sync = None
        roles = (getattr(self.fc1, "handoff", ""), getattr(self.fc2, "handoff", ""))
        if roles == ("publish", "await"):
            P = views["xs"].shape[0]
            self._handoff_sync = torch.zeros(sm90_handoff_sync_len(P, self.E), dtype=torch.int32, device=dev)
        elif any(roles):  # the shim gives both or neither (the same schedule rules)
            raise RuntimeError(f"{self.name}: FC1's handoff {roles[0]!r} without FC2's {roles[1]!r}")

    def _prepare_launches(self) -> None:
        """The hot path's launches with this layer's buffers fixed, checked and packed once (drop
        v58): on one rank step 2's route (with and without the row gather) and step 5's one-launch
        combine; then steps 3-4's (:meth:`_prepare_expert_launches`). A call then passes only what
        changes: the caller's routing, rows, weights, biases and output."""
        self._route_run = {}
        if self.local_route:
            for gather in (True, False):
                self._route_run[gather] = self.layout.prepare_route(
                    self.ep, self.offsets, self.idx, self.ws_rows, self.pos, self.xs if gather else None)
        self._combine_run = self.ep.prepare_combine_local(self.y, self.pos) if self.local_combine else None
        self._prepare_expert_launches()

    def _prepare_expert_launches(self) -> None:
        """FC1 (from the grouped rows ``xs``) and FC2 per GEMM path (drop v61): ``run(w, bias)``.
        ``_expert_runs[decode]`` is ``(fc1, fc2)``; a gathering FC1 reads the call's own tokens,
        which its run takes per call (drop v91): ``run(w, bias, a=x)``."""
        self._expert_runs = {}
        for decode, (fc1, fc2) in ((False, (self.fc1, self.fc2)), (True, (self.fc1_decode, self.fc2_decode))):
            if fc1 is None:
                continue
            hand1 = hand2 = {}
            if not decode and getattr(self, "_handoff_sync", None) is not None:  # drop v112: FC2 waits per m-tile
                hand1 = {"sync": self._handoff_sync}
                hand2 = {"sync": self._handoff_sync, "publishers": fc1.grid_ctas(self.num_ctas)}
            if fc1.gather_a:  # the grouped rows read from the call's x by idx
                run1 = fc1.prepare(None, self.offsets, self.h, max_active_ctas=self.num_ctas, idx=self.idx)
            else:
                run1 = fc1.prepare(self.xs, self.offsets, self.h, max_active_ctas=self.num_ctas, **hand1)
            self._expert_runs[decode] = (
                run1,
                fc2.prepare(self.h, self.offsets, self.y, row_scale=self.ws_rows, max_active_ctas=self.num_ctas,
                            **hand2))

    def _rebind(self) -> None:
        """The workspace grew: carve the new pools again."""
        self._bind()

    def warmup(self, progress):
        progress(f"FC1 ({self.cfg.activation}), FC2, EP and layout kernels for {self.arch}"
                 + (f"; NVSHMEM over {self.W} ranks" if self.W > 1 and not self.virtual else ""))
        seen = len(COMPILE_EVENTS)
        self._ensure()
        for ev in COMPILE_EVENTS[seen:]:  # what this warm-up compiled or loaded from the disk cache
            progress(f"  {ev.name}: {ev.action} in {ev.seconds:.2f} s")
        cfg = self.cfg
        # one forward per GEMM path (the decode path for few tokens, the 128-row one above), so
        # every kernel has run before a CUDA graph captures it
        sizes = [min(cfg.max_tokens_per_rank, 64)]
        if self.fc1_decode is not None:
            sizes = [min(64, self._decode_max_tokens), self._decode_max_tokens + 1]
        progress("running once" + (" per GEMM path (decode, prefill)" if len(sizes) > 1 else ""))
        for T in sizes:
            self._warm_forward(T)
        # do not keep the throw-away weights and tokens alive (the classic launch path's converted
        # arguments hold the last call's tensors: ~4 MiB per Qwen3 layer, drop v113)
        for launcher in (self.fc1, self.fc2, self.fc1_decode, self.fc2_decode, *self.ep_sessions(),
                         *self.layout_sessions()):
            if launcher is not None and hasattr(launcher, "release"):
                launcher.release()
        self.check()

    def _warm_forward(self, T: int) -> None:
        """One forward of ``T`` random tokens on random weights."""
        cfg = self.cfg
        g = torch.Generator(device=self.device).manual_seed(1234 + self.group.rank)
        x = torch.randn(T, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, cfg.num_experts, (T, cfg.top_k), device=self.device, generator=g, dtype=torch.int32)
        w = torch.rand(T, cfg.top_k, device=self.device, generator=g)
        w13, w2 = self._warm_weights(g)
        b13 = b2 = None
        if getattr(cfg, "bias_dtype", None) is not None:
            b13 = torch.randn(self.E, cfg.w13_rows, device=self.device, generator=g).to(cfg.bias_dtype)
            b2 = torch.randn(self.E, cfg.hidden, device=self.device, generator=g).to(cfg.bias_dtype)
        self.forward(x, ids, w, w13, w2, b13=b13, b2=b2)
        torch.cuda.synchronize(self.device)

    def _warm_weights(self, g: torch.Generator) -> tuple:
        """Random (w13, w2) in the format ``forward`` takes (bf16 here)."""
        cfg = self.cfg
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g).to(torch.bfloat16)
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g).to(torch.bfloat16)
        return w13, w2

    # ---- forward: the numbered steps of the module docstring ----------------------------------
    # (separate methods so that virtual ranks in one process can interleave them by phase)
    def _step1_dispatch(self, x, topk_ids, topk_weights) -> None:
        # the GEMM path of this call, from its (host-known) token count: swap-AB for few tokens
        decode = self.fc1_decode is not None and x.shape[0] <= self._decode_max_tokens
        self._gemms = (self.fc1_decode, self.fc2_decode) if decode else (self.fc1, self.fc2)
        self._decode = decode
        self.ws.seq += 1
        # grid of the per-token kernels of this call, from its host-known token count
        self._token_ctas = self.ep.token_ctas(x.shape[0]) if self.token_grid else None
        self._tokens = x.shape[0]  # steers the layout's grid (step 2); the bits do not depend on it
        if self.local_route:  # one rank: step 2 reads the routing itself (no launch here)
            self._routing = (x, topk_ids, topk_weights)
            return
        self._send_rows(x, topk_ids, topk_weights)

    def _send_rows(self, x, topk_ids, topk_weights) -> None:
        """Step 1's launch(es): the token rows, ids and weights to the ranks of their experts."""
        self.ep.dispatch(x, topk_ids, topk_weights, num_ctas=self._token_ctas)

    def ep_sessions(self) -> tuple:
        """Every EP session of this layer (virtual ranks connect each one across ranks)."""
        return (self.ep,)

    def layout_sessions(self) -> tuple:
        """Every expert-layout session of this layer."""
        return (self.layout,)

    def _step2_layout(self, gather_rows: bool = True) -> None:
        """``gather_rows``: copy the grouped rows into ``self.xs`` (False: step 3 reads them itself;
        so does a gathering FC1, :func:`gather_fc1`, from the caller's x kept in ``_fc1_src``)."""
        fc1_gathers = self._fc1_reads_tokens() and not self._split_rows  # dispatch() returns xs itself
        xs = self.xs if gather_rows and not fc1_gathers else None
        if self.local_route:
            x, topk_ids, topk_weights = self._routing
            self._routing = None  # hold no reference to the caller's tensors past the call
            self._fc1_src = x if fc1_gathers else None
            self._route_run[xs is not None](x, topk_ids, topk_weights, tokens=self._tokens)
        else:
            self.layout(self.ep, self.offsets, self.idx, self.ws_rows, self.pos, xs, tokens=self._tokens)

    def _fc1_reads_tokens(self) -> bool:
        """This call's FC1 reads the caller's tokens itself (:func:`gather_fc1`)."""
        return getattr(self._gemms[0], "gather_a", False)

    def _step34_experts(self, w13, w2, b13=None, b2=None) -> None:
        # 3. FC1 + activation into h; 4. FC2 + router weight into y (prepared at bind, per GEMM path)
        fc1_run, fc2_run = self._expert_runs[self._decode]
        src = getattr(self, "_fc1_src", None)
        if src is not None:  # a gathering FC1: grouped row r = x[idx[r]] of the call's x
            self._fc1_src = None
            fc1_run(w13, b13, a=src)
        else:
            fc1_run(w13, b13)
        fc2_run(w2, b2)

    def _step5_combine_send(self) -> None:
        if self.local_combine:  # one rank: step 5b sums and writes in one launch
            return
        self.ep.combine_send(self.y, self.pos)

    def _step5_combine_reduce(self, out) -> None:
        if self.local_combine:
            # one warp per token on up to 4 CTAs per SM (more loads in flight than one per SM)
            self._combine_run(out, num_ctas=self.ep.local_combine_ctas(self._tokens))
        else:
            self.ep.combine_reduce(out, num_ctas=self._token_ctas)

    def forward(self, x, topk_ids, topk_weights, w13, w2, out=None, b13=None, b2=None):
        self._ensure()
        if out is None:  # the one allocation of a forward without ``out``
            out = torch.empty(x.shape[0], self.cfg.hidden, dtype=x.dtype, device=x.device)
        self._step1_dispatch(x, topk_ids, topk_weights)
        self._step2_layout()
        self._step34_experts(w13, w2, b13, b2)
        self._step5_combine_send()
        self._step5_combine_reduce(out)
        return out

    # ---- the split pair ------------------------------------------------------------------------
    def recv_capacity(self) -> int:
        return self.W * self.cfg.max_tokens_per_rank * self.cfg.top_k

    def dispatch(self, x, topk_ids, topk_weights):
        """Steps 1-2. Returns the workspace's ``xs`` [P, H] (rows < offsets[E_l] valid) and
        ``offsets`` [E_l+1]: both valid until the next dispatch/forward on this workspace."""
        self._ensure()
        self._split_rows = True  # step 2 writes xs even where forward's FC1 would gather the rows
        try:
            self._step1_dispatch(x, topk_ids, topk_weights)
            self._step2_layout()
        finally:
            self._split_rows = False
        return self.xs, self.offsets, Sm90HandleState(x.shape[0], self.ws.seq)

    def combine(self, expert_out, state: Sm90HandleState, out=None):
        """Step 5 with the router weights applied here (fp32): ``expert_out`` [P, H] rows in
        ``xs`` order (rows >= offsets[E_l] are never read)."""
        if state.seq != self.ws.seq:
            raise StaleHandleError(
                f"combine(): this handle's dispatch was followed by {self.ws.seq - state.seq} other "
                "dispatch/forward call(s) on the same workspace (all layers of one group and device "
                "share it), which overwrote its buffers; call combine before the next dispatch/forward")
        if out is None:
            out = torch.empty(state.num_tokens, self.cfg.hidden, dtype=expert_out.dtype, device=expert_out.device)
        self.ep.combine_send(expert_out, self.pos, weighted=True)
        self.ep.combine_reduce(out, num_ctas=self.ep.token_ctas(state.num_tokens) if self.token_grid else None)
        return out

    # ---- benchmark hooks -------------------------------------------------------------------------
    def comm_ops(self, x, topk_ids, topk_weights):
        """For benchmarks: ``(dispatch, combine)`` callables that run only the communication
        kernels of a forward on these inputs (dispatch + wait; combine send + reduce). Run one
        full forward first so the expert layout is valid for ``combine``."""
        self._ensure()
        out = torch.empty(x.shape[0], self.cfg.hidden, dtype=torch.bfloat16, device=self.device)

        def dispatch():
            self.ep.dispatch(x, topk_ids, topk_weights)
            self.ep.wait()

        def combine():
            self.ep.combine_send(self.y, self.pos)
            self.ep.combine_reduce(out)

        return dispatch, combine

    # ---- errors and teardown ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a device-side wait timed out, capacity overflowed (both fatal for every layer
        of the workspace until ``reset_error_state``), or if this layer's kernels dropped a bad
        expert id / router weight (reported once). Synchronises the host."""
        if self.ep is None:
            return
        self.ep.check()
        self._check_placement()
        bad = self.ep.read_input_errors()
        if bad["topk_ids"] is None and bad["topk_weights"] is None:
            return
        self.ep.reset_input_errors()
        raise routing_value_error(self.cfg.num_experts, *(None if bad[n] is None else bad[n][1:]
                                                          for n in ("topk_ids", "topk_weights")))

    def _placement_buffers(self) -> dict:
        """The sync buffers of this layer's GEMMs that wait on one another, by what waits: in BF16 FC2's
        wait for FC1 (drop v112, ``MOE_EP_FC2_EARLY=1``); the FP8 backend's copying FC1 (drop v92)."""
        sync = getattr(self, "_handoff_sync", None)
        return {} if sync is None else {"FC2's wait for FC1 (MOE_EP_FC2_EARLY)": sync}

    def _check_placement(self) -> None:
        """A placing GEMM (the FP8 backend's ``MOE_EP_FP8_PLACE_FC1=copy``)
        records a tile that waited past its bound for its rows in its sync buffer's last word (1 + the
        m-tile); the counters are then unreliable, so they are zeroed here before this raises."""
        for what, sync in self._placement_buffers().items():
            word = int(sync[-1])
            if word:
                sync.zero_()
                raise RuntimeError(f"{self.name}: {what} timed out at m-tile {word - 1}; the outputs of the "
                                   "forwards since the last check are invalid")

    def reset_error_state(self) -> None:
        """Collective: clear every rank's EP flags/counters (shared by the workspace's layers)."""
        if self.ep is None:
            return
        torch.cuda.synchronize(self.device)
        if self.W > 1 and not self.virtual:
            import torch.distributed as dist

            dist.barrier(group=self.group.pg)
        self.ep.reset()
        self.ep.reset_input_errors()
        for sync in self._placement_buffers().values():  # a placing GEMM's counters and error word
            sync.zero_()
        torch.cuda.synchronize(self.device)
        if self.W > 1 and not self.virtual:
            dist.barrier(group=self.group.pg)

    def destroy(self):
        """Collective for W > 1: detach from the workspace (the last layer frees it)."""
        if self.ws is None:
            return
        torch.cuda.synchronize(self.device)
        self.ep = self.layout = self.fc1 = self.fc2 = self._route_run = self._combine_run = None
        self.fc1_decode = self.fc2_decode = None
        self._expert_runs = {}  # the prepared runs hold the layer's buffers
        self.xs = self.h = self.y = self.offsets = self.idx = self.ws_rows = self.pos = self.verr = None
        self.ws.detach(self)
        self.ws = None


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 device: Any = None, bias_dtype: Any = None, raster_m: int | None = None,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, swiglu_beta: float = 1.0,
                 swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0, up_softcap: float = 25.0):
    """A launcher of the SM90 varlen-M grouped GEMM (for benchmarks and engines with their own
    MoE plumbing): ``fn(a [M,k] bf16, b [E,n,k] bf16, offsets [E+1] int32 (device), out=[M,n_out]
    bf16, row_scale=[M] f32, bias=[E,n] bias_dtype)``; ``n_out`` = n/2 for the gated activations.
    ``raster_m`` None: the shim's choice for this K. ``swiglu_*``: clamped_swiglu's constants (as
    :class:`~moe_ep.api.MoEConfig`'s; gpt-oss's by default); ``*_softcap``: softcapped_swiglu's."""
    return sm90_grouped_gemm(activation, n, k, num_experts, scale_rows=scale_rows, device=device,
                             bias_dtype=bias_dtype, raster_m=raster_m, swiglu_alpha=swiglu_alpha,
                             swiglu_limit=swiglu_limit, swiglu_beta=swiglu_beta,
                             swiglu_limit_after_act=swiglu_limit_after_act, gate_softcap=gate_softcap,
                             up_softcap=up_softcap)
