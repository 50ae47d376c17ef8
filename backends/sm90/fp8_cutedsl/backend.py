"""SM90 (H100/H200) FP8 block-scaled backend (DeepSeek-V3 / Qwen3-FP8 weights) on the drop
``sm90/megamoe``: what ``backend="auto"`` picks for ``quant="fp8_block128"`` on an H100/H200. No
host sync and no allocation in ``forward``, CUDA-graph capturable, bit-deterministic (GPU tests).

The forward is the BF16 SM90 backend's, with steps 3-4 replaced:

1. **dispatch** and 2. **expert layout** -- as in :mod:`moe_ep.backends.sm90.bf16_cutedsl`, BF16
   rows on the wire; or, with :func:`fp8_wire` and W > 1, FP8 on the wire: each token is quantised
   on its own rank (the same per-128-value rule as step 3, so the same bits) and its E4M3 bytes and
   float32 scales travel as two dispatches of narrower rows (``H/2`` and ``H/64`` bf16 words: 0.52x
   the bytes of BF16); step 2 then gathers the grouped E4M3 rows and their scales (no quantiser);
3. **FC1 + activation** -- the grouped rows are quantised per 128 values of a row (E4M3 + one float32
   scale, ``amax / 448``: :func:`moe_ep.api.quant.quantize_fp8_rows128`), then the FP8 grouped GEMM
   with per-k-block scale promotion ``h = act(xq · wq13ᵀ)`` (``swiglu`` or, drop v100,
   ``clamped_swiglu``: gpt-oss's or DeepSeek-V4 / GLM-5's clamped form; drop v103: Inkling2's
   ``softcapped_swiglu``); by default (:func:`fused_gather_quant`)
   step 2 skips the BF16 row gather and this step quantises each received token once straight
   into the grouped rows its choices took (:func:`scatter_quant`; one launch and a BF16 write +
   read of every grouped row less; same bits);
4. **FC2 + router weight** -- ``h`` quantised the same way, ``y = ws · (hq · wq2ᵀ)``;
5. **combine** -- as on BF16.

With ``MOE_EP_FP8_PLACE_FC1=copy`` (opt-in, :func:`place_fc1`) step 3 quantises each received
token once, in token order, and FC1's spare producer warps copy its grouped rows and scales from
there while it runs, so the quantiser before FC1 writes an eighth of the bytes at top-8 (the same
bits).

Weights: ``MoEConfig.quant = "fp8_block128"``; ``w13``/``w2`` are
:class:`moe_ep.api.quant.FP8Block128Weight` (values ``float8_e4m3fn [E, N, K]``, scales float32
``[E, N/128, K/128]``; or raw e4m3 tensors with ``forward(w13_scale=, w2_scale=)``). H and I must
be multiples of 128. The quantised activations live in buffers of this layer (allocated at bind).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from moe_ep.shim import (Sm90EpSession, Sm90LayoutSession, env_choice, env_flag, sm90_check_fp8_gemm,
                         sm90_compiled_fp8_gemm, sm90_compiled_fp8_quantize_rows, sm90_fp8_gemm,
                         sm90_fp8_quantize_rows, sm90_place_sync_len, sm90_prebuild_ep, sm90_prebuild_layout)

from ...quant import FP8_BLOCK, quantize_fp8_block128
from ...quantized import check_quantized_config
from ...registry import UnsupportedBackendError, require_cuda_arch
from ..bf16_cutedsl.backend import Sm90CuteDSLBackend, prebuild_layer, swiglu_constants
from ..bf16_cutedsl.workspace import Dims

NAME = "sm90_fp8_cutedsl"


#: MoEConfig.activation values this backend runs (clamped_swiglu: drop v100; softcapped_swiglu: v103)
ACTIVATIONS = ("swiglu", "clamped_swiglu", "softcapped_swiglu")


def _gemm_specs(cfg: Any, e_local: int) -> dict:
    return {"fc1": (cfg.activation, cfg.w13_rows, cfg.hidden, e_local, False),
            "fc2": ("identity", cfg.hidden, cfg.intermediate, e_local, True)}



def fp8_wire() -> bool:
    """``MOE_EP_FP8_WIRE=1`` (W > 1): tokens cross NVLink in FP8 (E4M3 + one float32 scale per 128
    values, quantised on the sending rank by step 3's own quantiser, so the layer's bits do not
    change), 0.52x the bytes of BF16 rows. Needs ``hidden % 512 == 0`` (the scales of a row travel
    as ``hidden/64`` bf16 words, a multiple of 8). Bit-identical to BF16 rows on virtual ranks (W = 2
    and 4, H200); off by default until it has been timed on two GPUs. The split ``dispatch`` refuses
    it (its rows are BF16)."""
    return env_flag("MOE_EP_FP8_WIRE", False)


def wire_views(bufs: dict, slots: int, hidden: int) -> tuple[dict, dict]:
    """The FP8 wire's two row widths over one rank's EP buffers: ``recv_x [S, H]`` bf16 split into
    the E4M3 rows ``[S, H/2]`` and, right after them, the scale rows ``[S, H/64]`` (bf16 words);
    ``comb`` split the same way (never used by these widths, but every EP session has one). The
    other buffers (ids, weights, counts, flags, control words) are shared: one epoch protocol."""
    q_w, s_w = hidden // 2, hidden // 64
    out = []
    for off, width in ((0, q_w), (slots * q_w, s_w)):
        v = dict(bufs)
        for name in ("recv_x", "comb"):
            v[name] = bufs[name].view(-1)[off:off + slots * width].view(slots, width)
        out.append(v)
    return out[0], out[1]


def check_config(config: Any, group: Any) -> None:
    """What this backend refuses on any machine (shapes, formats), with the reason."""
    check_quantized_config(NAME, config, group, "fp8_block128", ACTIVATIONS)
    if group.world_size > 1 and fp8_wire() and config.hidden % 512:
        raise UnsupportedBackendError(f"{NAME}: MOE_EP_FP8_WIRE=1 needs hidden % 512 == 0 (the float32 scales "
                                      f"of a row travel as hidden/64 bf16 words), got hidden={config.hidden}")
    try:
        for spec in _gemm_specs(config, config.local_experts(group.world_size)).values():
            sm90_check_fp8_gemm(*spec[:4])
    except ValueError as e:
        raise UnsupportedBackendError(f"{NAME}: {e}") from e


def check(config: Any, group: Any, device: torch.device) -> None:
    """Refuse, with the reason, anything this backend cannot run here."""
    require_cuda_arch(NAME, device, (9, 0), "an SM90 GPU (H100/H200)")
    check_config(config, group)


def fused_gather_quant() -> bool:
    """Step 2 writes no BF16 grouped rows and step 3 gathers and quantises the received rows in one
    pass (drop v12's gathering quantiser): bit-identical to gather-then-quantise (GPU test), Qwen3
    8192 tokens 1.21 -> 1.10 ms on the H200. ``MOE_EP_FP8_FUSED_GATHER=0`` turns it off (to compare)."""
    return env_flag("MOE_EP_FP8_FUSED_GATHER", True)


def scatter_quant() -> bool:
    """Step 3 (with the fused gather, the default step 2/3) quantises each received token once and
    writes it to the grouped rows its choices took (``pos``; drop v25's scattering quantiser)
    instead of quantising every grouped row from its token (``idx``, the gathering quantiser): the
    same rows and bits (GPU tests), 1/top_k of the reads and of the arithmetic. H200 (tenth
    session, PDL off, Qwen3 8192 tokens): 46.5 us against the gathering quantiser's 80.8.
    ``MOE_EP_FP8_SCATTER_QUANT=0`` turns it off (to compare)."""
    return env_flag("MOE_EP_FP8_SCATTER_QUANT", True)


def place_fc1(world_size: int) -> bool:
    """``MOE_EP_FP8_PLACE_FC1=copy`` (drop v92, opt-in; ``Fp8PlaceGroupedGemmSm90``): step 3 quantises
    each received token once, in token order (an eighth of the scattering quantiser's writes at
    top-8), and FC1's three spare producer warps copy grouped row r -- token ``idx[r]``'s E4M3 row
    and its scales -- in the order its tiles need them while it runs: the same bits. "0" or unset:
    off. Needs the fused gather (the default) and BF16 rows on the wire: with
    ``MOE_EP_FP8_FUSED_GATHER=0`` or ``MOE_EP_FP8_WIRE=1`` (W > 1) it raises ValueError naming both
    switches.

    Why: Qwen3 at 8192 tokens spends ~58 us in the scattering quantiser, during which no GEMM runs.
    Bit-identical on the H100 (39th session) and the H200 (40th), and not faster overall: FC1 with
    its quantiser 0.97-0.99x at the power cap (H100); the Qwen3 layer on the H200 +5.9% per call,
    -3.1% back to back, +0.1% under graphs (medians of three interleaved rounds, 41st). Opt-in. (Drop
    v93 removed v92's quantising placements, ``MOE_EP_FP8_PLACE_FC1=quant`` and
    ``MOE_EP_FP8_PLACE_FC2``: FC1 0.59-0.78x, the layer 7-11% slower with FC2's.)"""
    on = env_choice("MOE_EP_FP8_PLACE_FC1", ("0", "copy"), "0") == "copy"
    if on and not fused_gather_quant():
        raise ValueError("MOE_EP_FP8_PLACE_FC1=copy places FC1's rows from the received tokens, which needs the "
                         "fused gather: unset MOE_EP_FP8_FUSED_GATHER (or set it to 1), or MOE_EP_FP8_PLACE_FC1")
    if on and world_size > 1 and fp8_wire():
        raise ValueError("MOE_EP_FP8_PLACE_FC1=copy quantises FC1's BF16 input, but MOE_EP_FP8_WIRE=1 sends it "
                         "quantised already: unset one of them")
    return on


def prebuild(config: Any, world_size: int, kernels: tuple = ("fc1", "fc2", "ep", "layout")) -> None:
    """Compile (or load from the disk compile cache) every kernel a layer needs, without a GPU;
    "fc1"/"fc2" include the row quantiser of their input width (:func:`place_fc1`: FC1's in token
    order)."""
    specs = _gemm_specs(config, config.local_experts(world_size))
    place = {"fc1": "copy" if place_fc1(world_size) else "", "fc2": ""}

    def gemm(name):
        gather = name == "fc1" and fused_gather_quant()
        scatter = config.top_k if gather and scatter_quant() else 0
        if place[name]:  # the tokens quantised once each, in token order
            scatter = 1

        def build():
            sm90_compiled_fp8_gemm(*specs[name], place=place[name], **(swiglu_constants(config) if name == "fc1" else {}))
            sm90_compiled_fp8_quantize_rows(specs[name][2], gather=gather and not scatter, scatter_topk=scatter)
        return build

    prebuild_layer(config, world_size, kernels, {"fc1": gemm("fc1"), "fc2": gemm("fc2")})
    if world_size > 1 and fp8_wire():  # the wire's sender quantiser, row widths and E4M3 row layout
        H, K, T, E = config.hidden, config.top_k, config.max_tokens_per_rank, config.num_experts
        if "fc1" in kernels:
            sm90_compiled_fp8_quantize_rows(H)
        if "ep" in kernels:
            for width in (H // 2, H // 64):
                sm90_prebuild_ep(width, K, world_size, T, E)
        if "layout" in kernels:
            sm90_prebuild_layout(H // 2, K, world_size, T, config.local_experts(world_size))


class Sm90Fp8Backend(Sm90CuteDSLBackend):
    """The BF16 SM90 backend's dispatch/layout/combine around FP8 block-scaled GEMMs."""

    name = NAME
    quant_rows = (FP8_BLOCK, torch.float32)  # xq / hq and their scales: in the shared workspace
    fp8_wire = False  # set at bind from self.dims (W > 1 and MOE_EP_FP8_WIRE=1)
    scatter_quant = False  # set at bind (the default with the fused gather; MOE_EP_FP8_SCATTER_QUANT=0: off)
    place_fc1 = False  # set at bind from self.dims (MOE_EP_FP8_PLACE_FC1=copy): FC1 copies its own input rows
    _fp8_place_syncs = MappingProxyType({})  # set at bind: the placing FC1's sync buffer
    _send_count = None  # set at bind (FP8 wire): the sender quantiser's row bound

    @classmethod
    def workspace_dims(cls, config: Any, world_size: int) -> Dims:
        """The quantised grouped rows, plus the rows the opt-in switches use: the token-order copy
        (``MOE_EP_FP8_PLACE_FC1=copy``) and the sender's copy (``MOE_EP_FP8_WIRE=1``, W > 1). Both are
        rewritten by every forward before they are read, so the layers share them too. The switches
        are read here, when the layer is built; bind follows ``self.dims``."""
        return Dims.of(config, world_size, cls.quant_rows, token_rows=place_fc1(world_size),
                       send_rows=world_size > 1 and fp8_wire())

    def _bind_gemms(self, views: dict) -> None:
        cfg = self.cfg
        specs = _gemm_specs(cfg, self.E)
        self.place_fc1 = self.dims.token_rows  # FC1 copies its own input rows (drop v92)
        self.fc1 = sm90_fp8_gemm(*specs["fc1"], place="copy" if self.place_fc1 else "", **swiglu_constants(cfg))
        self.fc2 = sm90_fp8_gemm(*specs["fc2"])
        self.fused_gather = fused_gather_quant()  # no BF16 grouped rows: step 3 quantises the received ones
        self.scatter_quant = self.fused_gather and scatter_quant() and not self.place_fc1
        if self.place_fc1:  # each received token once, in token order (its own row)
            self.quant_x = sm90_fp8_quantize_rows(cfg.hidden, scatter_topk=1)
        else:
            self.quant_x = sm90_fp8_quantize_rows(cfg.hidden, gather=self.fused_gather and not self.scatter_quant,
                                                  scatter_topk=cfg.top_k if self.scatter_quant else 0)
        self.quant_h = sm90_fp8_quantize_rows(cfg.intermediate)
        self.fc1_decode = self.fc2_decode = None
        self._decode_max_tokens = 0
        self._gemms = (self.fc1, self.fc2)
        P = views["xs"].shape[0]  # grouped-row capacity
        # FC1's and FC2's quantised inputs: every forward rewrites them, so the layers share them
        self.xq, self.xq_scale, self.hq, self.hq_scale = (views[k] for k in ("xq", "xq_scale", "hq", "hq_scale"))
        self._rows = views["offsets"][-1:]  # grouped rows of a call, read on the device (no host sync)
        # the placing FC1's counters: zero once here, and the kernel leaves them so (tail-clean)
        self._fp8_place_syncs = {"FC1": torch.zeros(sm90_place_sync_len(P, self.E), dtype=torch.int32,
                                                    device=self.device)} if self.place_fc1 else {}
        self.xq_tok = self.sx_tok = self._tok_pos = None
        if self.place_fc1:  # the received tokens quantised in token order (workspace): slot s -> row s
            S = self.W * self.dims.max_tokens
            self.xq_tok, self.sx_tok = views["xq_tok"], views["sx_tok"]
            self._tok_pos = torch.arange(S, dtype=torch.int32, device=self.device).view(S, 1)

    def _prepare_expert_launches(self) -> None:
        """Steps 3-4's launches with this layer's buffers fixed, checked and packed once (drop
        v58; the BF16 backend prepares the route and combine): a call passes only the rows to
        quantise (step 3) and the weights (FC1, FC2)."""
        if self.place_fc1:  # each valid slot s once into row s (FC1 then copies row idx[r])
            self._quant_x_run = self.quant_x.prepare(self.xq_tok, self.sx_tok, pos=self._tok_pos,
                                                     recv_count=self.ep.bufs.recv_count, t_max=self.dims.max_tokens)
        elif self.scatter_quant:  # each received row once, into the grouped rows pos[s, :]
            self._quant_x_run = self.quant_x.prepare(self.xq, self.xq_scale, pos=self.pos,
                                                     recv_count=self.ep.bufs.recv_count, t_max=self.dims.max_tokens)
        elif self.fused_gather:  # grouped row r = received row idx[r]
            self._quant_x_run = self.quant_x.prepare(self.xq, self.xq_scale, count=self._rows, idx=self.idx)
        else:  # the grouped BF16 rows step 2 wrote into xs
            self._quant_x_run = self.quant_x.prepare(self.xq, self.xq_scale, count=self._rows)
        fc1_place = {}  # copying: the token-order rows, their scales, idx and the counters, all fixed
        if self.place_fc1:
            fc1_place = dict(x=self.xq_tok, x_scale=self.sx_tok, idx=self.idx, sync=self._fp8_place_syncs["FC1"])
        self._fc1_run = self.fc1.prepare(self.xq, self.xq_scale, self.offsets, self.h, self.ws_rows, self.num_ctas,
                                         **fc1_place)
        self._quant_h_run = self.quant_h.prepare(self.hq, self.hq_scale, count=self._rows)
        self._fc2_run = self.fc2.prepare(self.hq, self.hq_scale, self.offsets, self.y, self.ws_rows, self.num_ctas)

    def _warm_weights(self, g: torch.Generator) -> tuple:
        cfg = self.cfg
        w13 = torch.randn(self.E, cfg.w13_rows, cfg.hidden, device=self.device, generator=g) * cfg.hidden ** -0.5
        w2 = torch.randn(self.E, cfg.hidden, cfg.intermediate, device=self.device, generator=g) * cfg.intermediate ** -0.5
        return quantize_fp8_block128(w13), quantize_fp8_block128(w2)

    def _bind(self) -> None:
        super()._bind()
        self.fp8_wire = self.dims.send_rows
        self.ep_q = self.ep_s = self.layout_q = None
        if self.fp8_wire:
            self._bind_wire()

    def _bind_wire(self) -> None:
        """Two more EP sessions over the same buffers (E4M3 rows, scale rows), the layout of the
        E4M3 rows, and the sender's quantised copy of its tokens (a workspace region)."""
        cfg, d, dev = self.cfg, self.dims, self.device
        H, S = d.hidden, self.W * d.max_tokens
        v = {**self.ws.views(d), "verr": self.verr}
        peers = None
        if not self.virtual:
            peers = [wire_views(p, S, H) for p in self.ws.peer_views(d)]
        kw = dict(global_ranks=self.ep.global_ranks, num_ctas=self.num_ctas, timeout_ns=self.timeout_ns,
                  arch=self.arch)
        sessions = []
        mine = wire_views(v, S, H)
        for i, (width, views) in enumerate(zip((H // 2, H // 64), mine)):
            sessions.append(Sm90EpSession(width, d.topk, self.W, d.max_tokens, cfg.num_experts, self.group.rank,
                                          dev, views, peers=None if peers is None else [p[i] for p in peers], **kw))
        self.ep_q, self.ep_s = sessions
        self._recv_scales = mine[1]["recv_x"]  # [S, H/64] bf16 words = [S, H/128] f32
        self.layout_q = Sm90LayoutSession(H // 2, d.topk, self.W, d.max_tokens, self.E, dev, v["counts"],
                                          num_chunks=self.layout.num_chunks, timeout_ns=self.timeout_ns,
                                          arch=self.arch, adaptive=self.layout.adaptive)
        self.quant_send = sm90_fp8_quantize_rows(H)
        self.xq_send, self.sx_send = v["xq_send"], v["sx_send"]
        if self._send_count is None:  # the sender quantises rows < min(T, count[0]): T bounds it (a view)
            self._send_count = torch.full((1,), d.max_tokens, dtype=torch.int32, device=dev)

    def ep_sessions(self) -> tuple:
        return (self.ep, self.ep_q, self.ep_s) if self.fp8_wire else (self.ep,)

    def layout_sessions(self) -> tuple:
        return (self.layout, self.layout_q) if self.fp8_wire else (self.layout,)

    def _fc1_reads_tokens(self) -> bool:
        return False  # step 3 below feeds FC1 itself (the quantised rows)

    # ---- the split pair ------------------------------------------------------------------------
    def dispatch(self, x, topk_ids, topk_weights):
        """Steps 1-2 for an engine's own GEMMs: the received rows in BF16, as the BF16 backend
        returns them (``xs`` [P, H] bf16, rows < offsets[E_l] valid; ``offsets`` [E_l+1] int32).
        forward's FP8 step 2 writes no BF16 rows (the quantiser reads the received ones), so this
        call runs the BF16 layout that copies them. Rows that crossed the wire as E4M3
        (``MOE_EP_FP8_WIRE=1``) have no BF16 form: refused before any launch."""
        if self.fp8_wire:
            raise UnsupportedBackendError(
                f"{NAME}: dispatch() returns BF16 rows, but MOE_EP_FP8_WIRE=1 sends them as E4M3; "
                "unset MOE_EP_FP8_WIRE (or set it to 0) for the split dispatch/combine pair")
        return super().dispatch(x, topk_ids, topk_weights)  # (it sets _split_rows for step 2)

    def _send_rows(self, x, topk_ids, topk_weights) -> None:
        if not self.fp8_wire:
            return super()._send_rows(x, topk_ids, topk_weights)
        # 1a. quantise this rank's tokens (step 3's rule); 1b/1c. E4M3 rows, then scale rows
        T = x.shape[0]
        q, sc = self.xq_send[:T], self.sx_send[:T]
        if T:
            self.quant_send(x, q, sc, count=self._send_count)
        self.ep_q.dispatch(q.view(torch.bfloat16), topk_ids, topk_weights, num_ctas=self._token_ctas)
        self.ep_s.dispatch(sc.view(torch.bfloat16), topk_ids, topk_weights, num_ctas=self._token_ctas)

    def _step2_layout(self) -> None:
        if self._split_rows:  # dispatch(): the BF16 grouped rows into xs, nothing quantised
            return super()._step2_layout(gather_rows=True)
        if self.fp8_wire:  # the grouped E4M3 rows straight into xq, then their scale rows
            self.layout_q(self.ep_q, self.offsets, self.idx, self.ws_rows, self.pos, self.xq.view(torch.bfloat16),
                          tokens=self._tokens)
            self.ep_s.gather(self._recv_scales, self.idx, self._rows, self.xq_scale.view(torch.bfloat16))
            return
        # fused gather: the layout writes no BF16 rows (xs stays free for FC2's output); the
        # quantiser reads the received rows, or the caller's x when one rank skips the dispatch
        x = self._routing[0] if self.local_route else None
        self._x_rows = x if x is not None and x.shape[0] else self.ep.bufs.recv_x
        super()._step2_layout(gather_rows=not self.fused_gather)

    def _step34_experts(self, w13, w2, b13=None, b2=None) -> None:
        # 3a. FC1's E4M3 input: arrived quantised (FP8 wire), or quantised here from the received
        # rows (scattered into their grouped rows by default; the launch was prepared at bind) --
        # or into token order, for FC1's producer warps to copy (MOE_EP_FP8_PLACE_FC1=copy)
        if not self.fp8_wire:
            self._quant_x_run(self._x_rows if self.fused_gather else self.xs)
            self._x_rows = None
        # 3b. FC1 + SwiGLU into h
        self._fc1_run(w13.values, w13.scale)
        # 4a. FC2's E4M3 input from h; 4b. FC2 + router weight
        self._quant_h_run(self.h)
        self._fc2_run(w2.values, w2.scale)

    def _placement_buffers(self) -> dict:
        return {f"{name} (MOE_EP_FP8_PLACE_{name})": buf for name, buf in self._fp8_place_syncs.items()}

    def destroy(self):
        self.xq = self.xq_scale = self.hq = self.hq_scale = self.xq_tok = self.sx_tok = self._tok_pos = None
        self.ep_q = self.ep_s = self.layout_q = self.xq_send = self.sx_send = self._send_count = None
        self._quant_x_run = self._fc1_run = self._quant_h_run = self._fc2_run = None  # they hold the buffers
        self._fp8_place_syncs = MappingProxyType({})
        super().destroy()


def grouped_gemm_fp8(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False, **swiglu):
    """A launcher of the SM90 FP8 block-scaled grouped GEMM (for benchmarks and engines with their
    own MoE plumbing), on the schedule the backend picks for this shape: ``fn(a [M,k] e4m3,
    a_scale [M,k/128] f32, b [E,n,k] e4m3, b_scale [E,n/128,k/128] f32, offsets [E+1] int32
    (device), out=[M,n_out] bf16, row_scale=[M] f32 (any [1] f32 when not scale_rows))``; ``n_out``
    = n/2 for the gated activations; ``swiglu``: clamped_swiglu's ``swiglu_alpha`` / ``swiglu_limit`` /
    ``swiglu_beta`` / ``swiglu_limit_after_act``, or softcapped_swiglu's ``gate_softcap`` / ``up_softcap``."""
    sm90_check_fp8_gemm(activation, n, k, num_experts)
    return sm90_fp8_gemm(activation, n, k, num_experts, scale_rows, **swiglu)
