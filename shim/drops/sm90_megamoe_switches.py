"""Environment switches of the SM90 BF16 grouped GEMM (drop ``sm90_megamoe``): which kernel
variants the shim compiles (opt-in, but for the tanh sigmoid, the pingpong FC2 bound and the H100's and H200's
clusters: defaults one can turn off). Each is read when a GEMM
is built (its key), never in ``forward``; each says what the H200 measured. Same drop and contract as :mod:`.sm90_megamoe` (which re-exports these
names); kept apart only to keep files short."""

from __future__ import annotations

import os

from ..env import env_choice, env_flag


def use_wide_gated() -> bool:
    """``MOE_EP_WIDE_GATED=1``: the gated GEMM (FC1) issues one m64n256 WGMMA over its gate and up
    tiles per k-block instead of two m64n128 ones (drop v22, schedule ``wide``). Bit-identical to
    ``cooperative`` on the H200 (e82f1e5, drop runner: Qwen3 and Mixtral FC1, uniform, skewed, one
    row) but no faster (Qwen3 FC1 0.590 / 0.646 ms vs 0.592 / 0.593 cooperative in two rounds,
    Mixtral 5.625 / 6.061 vs 5.555 / 5.717; the layer 477 vs 473 TFLOP/s), so it stays opt-in."""
    return env_flag("MOE_EP_WIDE_GATED", False)


def use_gated_pingpong() -> bool:
    """``MOE_EP_GATED_PINGPONG=1``: the gated GEMM (FC1) runs the pingpong schedule on 96-wide tiles
    (:data:`.sm90_megamoe.GATED_PINGPONG_TILE_N`: each warpgroup holds a 128 x 96 gate and a 128 x 96
    up accumulator, the drop's register limit) instead of cooperative 128 x 128, so one warpgroup's
    SwiGLU epilogue runs under the other's mainloop. Same k order per element: the same bits.
    31st session (drop runner, Qwen3's FC1, before drop v79): 0.654 ms against 0.641 cooperative, so
    opt-in; its per-tile stage skip was then an unrolled chain of 32 advances, which drop v79's
    ``MOE_EP_JUMP_STAGES=1`` replaces by one step (not yet timed together on the H200)."""
    return env_flag("MOE_EP_GATED_PINGPONG", False)


def pingpong_max_k(default: int) -> int:
    """The largest K at which the non-gated GEMM (FC2) takes the pingpong schedule (drop v71,
    128 x 192 tiles): ``MOE_EP_PINGPONG_MAX_K`` (an integer; 0 = never, the cooperative 128 x 256
    tiles of drop v70's default) or ``default`` (the shim's measured choice)."""
    raw = os.environ.get("MOE_EP_PINGPONG_MAX_K")
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"MOE_EP_PINGPONG_MAX_K must be an integer (0 = never), got {raw!r}") from None


#: GPUs (by name) on which the cooperative BF16 GEMMs run in clusters of 2 along M by default. H100 80GB
#: HBM3 (SXM), BF16 layers with the FC1 clustered against single CTAs, interleaved in one call:
#: Mixtral (43rd session) per call 676.8-681.6 vs 644.5-656.4 TFLOP/s, graph 586.2-595.7 vs
#: 567.9-581.3; the DeepSeek-V3 shard (46th, drop v96) per call 613.0 / 626.7 vs 593.1 / 593.8, back
#: to back 597.5 / 603.8 vs 554.4 / 566.2, graph 552.2 / 552.0 vs 558.5 / 558.8; Qwen3 (46th, v96)
#: level: 486.0 / 483.6 vs 484.7 / 485.7 per call. The FC1 alone (`bench gemm`, 46th): Qwen3 0.657 vs
#: 0.737 ms, the DeepSeek-V3 shard 5.456 vs 6.619. FC2 clustered gained nothing (43rd), but does
#: since (53rd: below). On the H200
#: (4.8 TB/s against the H100's 3.35) clusters were slower before drop v96: Mixtral 635.5-639.0 vs
#: 645.2-655.9 per call, Qwen3 490 vs 520. Only the H100 80GB HBM3 was timed; the PCIe and NVL H100s
#: match the name untimed; other SM90 parts keep single CTAs.
#: 53rd session, H200 (drop v108; v96 paired the lone m-tiles since those H200 losses), BF16 layers
#: with every cooperative GEMM clustered (``MOE_EP_BF16_CLUSTER=1``) against single CTAs,
#: interleaved (Mixtral and Qwen3 two rounds, the DeepSeek-V3 shard four over two calls): Mixtral 668.6-670.0 / 666.6-667.3 / 635.5-640.1 per call / back
#: to back / graph against 661.4-662.5 / 650.0-652.2 / 604.3-609.2; the DeepSeek-V3 shard
#: 632.6-635.0 / 629.0-631.0 / 588.2-593.2 against 627.4-628.7 / 619.9-621.3 / 585.1-594.1; Qwen3
#: 536.3-537.3 / 491.0-491.3 / 506.9-507.7 against 527.0-532.0 / 483.3-485.7 / 494.4-522.2; the
#: DeepSeek-V4 shard level. So the H200 clusters too. Names match by word: "GH200" (other memory,
#: untimed) does not match "H200".
CLUSTER_GPUS = ("H100", "H200")
#: the least mean rows per expert at capacity for that default: a cluster computes an m-tile pair of
#: one expert, so an expert with one m-tile idles half of it (Mixtral at 8192 tokens: 2048 rows, Qwen3:
#: 512)
CLUSTER_MIN_ROWS = 512
# Why the H100 clusters the long-K FC2 too (53rd session, 1941e20, H100 80GB HBM3, the Mixtral BF16
# layer at 8192 tokens, `ENVAB="|MOE_EP_BF16_CLUSTER=1"`, five rounds interleaved over two calls; the
# only kernel the setting changes there is FC2, K 14336, cooperative 128 x 256): per call / back to
# back / graph 702.8-725.4 / 686.6-689.8 / 632.0-674.3 TFLOP/s clustered against 678.8-706.7 /
# 670.2-684.4 / 611.0-636.3 with FC1 alone clustered (every round: per call +2.5-5%, graph
# +2.5-9%). `bench gemm` (52nd): that FC2 single 0.66-0.77x `torch._grouped_mm`, clustered ~1.0x
# (43rd). The 43rd session's "FC2 clustered gained nothing" was measured with FC1 single and before
# drop v96. The DeepSeek-V3 shard (FC2 K 2048, then pingpong) and Qwen3 (K 768) did not change;
# since 569ea72 the H100 runs the K-2048 FC2s cooperative, and so clustered (PINGPONG_MAX_K_H100).


def gpu_named(device_name: str | None, names: tuple) -> bool:
    """Whether the GPU named ``device_name`` (``torch.cuda.get_device_name``; None: unknown, e.g. a
    CPU build) has one of ``names`` as a whole word ("NVIDIA H200 NVL" has "H200", "NVIDIA GH200
    480GB" does not): how the shim's per-GPU choices match a GPU."""
    return device_name is not None and any(g in device_name.split() for g in names)


def clusters_by_default(device_name: str | None) -> bool:
    """Whether the GPU named ``device_name`` is one of :data:`CLUSTER_GPUS` (:func:`gpu_named`)."""
    return gpu_named(device_name, CLUSTER_GPUS)


def use_bf16_cluster(schedule: str, gather_a: bool = False, gated: bool = False,
                     rows_per_expert: float | None = None, device_name: str | None = None) -> int:
    """CTAs per cluster of the BF16 grouped GEMM (drop v29, ``cluster_m``): 2 or 1. The two CTAs of a
    cluster compute an m-tile pair of one expert and each loads half of the weight tile, multicast
    into both. Only the cooperative and wide schedules cluster (not pingpong, swap-AB or the
    gathering kernel). ``MOE_EP_BF16_CLUSTER``:

    * ``1``: every such GEMM; ``fc2``: the non-gated GEMM (FC2) only; ``0``: none;
    * unset: on a GPU named in :data:`CLUSTER_GPUS`, when the caller expects at least
      :data:`CLUSTER_MIN_ROWS` rows per expert (``rows_per_expert``; None = many), every GEMM
      that reaches here: the gated GEMM (FC1) and, since the 53rd session, the non-gated one (FC2)
      where it runs cooperative, i.e. above the pingpong bound (``pingpong_bound`` in
      :mod:`.sm90_megamoe`: K > 2880; on an H100 K > 1920 where this kernel clusters; see the comment after
      :data:`CLUSTER_MIN_ROWS`); else none. ``device_name`` None (an unknown GPU): none.

    Bit-identical to single CTAs (drop v29's tests). Measured: the constants above."""
    mode = env_choice("MOE_EP_BF16_CLUSTER", ("0", "1", "fc2"), "")
    if gather_a or schedule not in ("cooperative", "wide"):
        return 1
    if mode == "":
        # FC1 at every K, FC2 only as the cooperative kernel (K above the pingpong bound): the
        # schedule test above already sent the pingpong FC2 away.
        on = (clusters_by_default(device_name)
              and (rows_per_expert is None or rows_per_expert >= CLUSTER_MIN_ROWS))
    else:
        on = mode == "1" or (mode == "fc2" and not gated)
    return 2 if on else 1


def use_bf16_cluster_n(schedule: str, gated: bool, gather_a: bool = False) -> int:
    """CTAs per cluster along N of the BF16 grouped GEMM (drop v72, ``cluster_n``): 2 with
    ``MOE_EP_BF16_CLUSTER_N=1`` for the non-gated GEMMs (FC2) on the cooperative and pingpong
    schedules -- the two CTAs of a cluster compute an n-tile pair of one m-tile and each loads half
    of the A tile, multicast into both (SonicMoE's FC2 choice for Qwen3) -- else 1. Opt-in: on the
    H200 bit-identical but slower (32nd session: Qwen3's FC2 0.367 vs 0.350 ms, the layer within
    its spread)."""
    if not env_flag("MOE_EP_BF16_CLUSTER_N", False) or gather_a or gated:
        return 1
    return 2 if schedule in ("cooperative", "pingpong") else 1


def use_jump_stages(schedule: str) -> bool:
    """Drop v79 ``jump_stages``: after each tile a pingpong warpgroup skips the other warpgroup's
    stages in one index / phase step instead of ``k_tiles`` unrolled single advances (same stages,
    same bits; Nemotron's FC1 kernel 2032 -> 1696 SASS instructions, Qwen3's FC2 1728 -> 1624).
    ``MOE_EP_JUMP_STAGES=1``. Opt-in until it has run on the H200: drop v78's slowdown with an
    unused branch (docs/LIMITS.md) says code size alone can cost the busy path, so it is timed
    against the unrolled skip before it becomes the default."""
    return env_flag("MOE_EP_JUMP_STAGES", False) and schedule == "pingpong"


def use_box_tails(schedule: str, gather_a: bool = False, cluster_n: int = 1) -> int:
    """Drop v111 ``box_rows``: rows per TMA box in which a tile holding fewer than 128 rows of its
    expert loads A (0 = off, one 128-row box as every tile). The boxes past the expert's rows are
    issued past the end of A, so TMA fills them with zeros and reads nothing, where the plain kernel
    reads, multiplies and masks the next expert's tokens (Qwen3 at 8192 tokens: 11.6% of the rows its
    GEMMs compute; ``bench padfill``, H100: the same tiles 0.3-2.3% faster with zero spare rows).
    Unlike drop v110's experiment (a per-tile rewritten descriptor, 4-7% slower) nothing is written:
    the box's descriptor is a kernel parameter. Same bits, but slower (57th session, H100, the layer
    per call: Qwen3 3-7%, gpt-oss 10-17%; the GEMMs alone 12-27% slower with the spare boxes zero-filled
    and within -3..+5% with the same boxes read: TMA's fill of a wholly out-of-bounds box is the cost,
    docs/LIMITS.md). ``MOE_EP_BOX_TAILS``: 0 (default), 8, 16 or 32. The TMA kernels whose CTAs load
    their own A rows only (cooperative, wide, pingpong; not swap-AB, gathering or ``cluster_n``)."""
    raw = env_choice("MOE_EP_BOX_TAILS", ("0", "8", "16", "32"), "0")
    if schedule not in ("cooperative", "wide", "pingpong") or gather_a or cluster_n > 1:
        return 0
    return int(raw)


def use_bf16_tanh_sigmoid(activation: str) -> bool:
    """Drop v52 ``tanh_sigmoid``: the BF16 swiglu GEMM (FC1; every schedule -- cooperative, wide,
    gathering, swap-AB -- so the kernels that give one another's bits without it, e.g. the gathering
    and the plain FC1, still do with it) takes its sigmoid from one
    ``tanh.approx`` instead of ``ex2`` + ``rcp`` (the SwiGLU epilogue is MUFU-bound; relative error
    ~2^-11, below the bf16 rounding of FC1's output). On by default since the twenty-second session
    (the whole GPU suite passed with it); ``MOE_EP_BF16_TANH_SIGMOID=0`` takes the exact-form
    sigmoid (``ex2`` + ``rcp``; other bits)."""
    return activation == "swiglu" and env_flag("MOE_EP_BF16_TANH_SIGMOID", True)


def use_fc2_early() -> bool:
    """``MOE_EP_FC2_EARLY=1`` (drop v112): a BF16 layer's 128-row FC2 starts inside FC1's last wave. FC1
    (cooperative or wide) publishes its CTAs' progress in a sync buffer and FC2 waits per m-tile for
    the FC1 tiles it reads, instead of PDL's wait for the whole of FC1
    (``sm90_megamoe.grouped_gemm_handoff``). Same bits. Priced at up to ~17 us of a Qwen3 forward at
    8192 tokens (FC1's last wave leaves 16.5 us of the GPU idle, ``bench.schedule_model``), before the
    two fences per FC1 CTA; not yet timed on a GPU, so off. Refused beside ``MOE_EP_GATHER_FC1=1``,
    ``MOE_EP_GATED_PINGPONG=1`` and ``MOE_EP_BOX_TAILS``; the decode (swap-AB) GEMMs never take it."""
    return env_flag("MOE_EP_FC2_EARLY", False)
