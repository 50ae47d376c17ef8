"""Shim for the FP8 block-scaled kernels of the SM90 drop (``sm90_megamoe.fp8_launch``,
``sm90_megamoe.fp8_quant``): the FP8 grouped GEMM and the BF16 -> FP8 row quantiser (one float32
scale per 128 values of a row). Same drop, contract and mirrored constants as
:mod:`.sm90_megamoe`; kept apart only to keep files short.

Run on the H200: drop v11 (GEMM, quantiser, the ``sm90_fp8_cutedsl`` layer), the gathering
quantiser (drop v12, the backend's default) and the overlapped-promotion GEMM schedule (drop v13,
:func:`use_fp8_overlap`, the default for K <= 4096).

* :func:`check_fp8_gemm` -- the drop's ``can_implement`` reason as ``ValueError``;
* :func:`compiled_fp8_gemm` / :func:`compiled_fp8_quantize_rows` -- compiled code (compile cache +
  disk cache, no GPU needed);
* :func:`fp8_gemm` / :func:`fp8_quantize_rows` -- caller-owned launchers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE
from ..env import check_removed, env_choice, env_flag, env_forced
from ..launch_mode import use_tvm_ffi
from .sm90_megamoe import CONSTANTS, PKG, RASTER_L2_BUDGET, _cutlass_version, _load, cache_namespace

# the drop's, mirrored (clamped_swiglu: drop v100; softcapped_swiglu: drop v103)
FP8_ACTIVATIONS = CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_ACTIVATIONS")
FP8_GATED = CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_GATED")
# the smallest K at which the wide gated FC1 runs the overlapped-promotion schedule (see use_fp8_overlap)
WIDE_OVERLAP_MIN_K = 4096


def check_fp8_gemm(activation: str, n: int, k: int, num_experts: int) -> None:
    """Raise ``ValueError`` with the drop's reason when the FP8 GEMM cannot take these shapes."""
    if activation not in FP8_ACTIVATIONS:
        raise ValueError(f"sm90 FP8 GEMM: activation {activation!r} not in {FP8_ACTIVATIONS}")
    reason = _load("sm90_megamoe.fp8_gemm").can_implement(activation=activation, n=n, k=k, num_experts=num_experts)
    if reason is not None:
        raise ValueError(f"sm90 FP8 GEMM: {reason}")


def use_fp8_overlap(k: int, wide_gated: bool = False) -> bool:
    """The FP8 GEMMs with K <= 32·128 run the overlapped-promotion schedule (drop v13; k-tile t's
    WGMMAs in flight while t-1 is promoted): bit-identical to the default schedule (H200), Qwen3
    FC1 808 -> 859 TFLOP/s, FC2 646 -> 782. ``MOE_EP_FP8_OVERLAP=0`` turns it off (to compare).

    The wide gated FC1 (:func:`use_fp8_wide_gated`) overlaps from K >= WIDE_OVERLAP_MIN_K (4096),
    and below where it stages its scales in shared memory (:func:`use_fp8_smem_scales`): with
    global scales Qwen3's FC1 (K 2048) ran faster plain (drop runner, a2012eb: 0.454 ms vs 0.495),
    with staged ones overlapped (twelfth session: 0.449 / 0.473 vs 0.461 / 0.496 plain, global).
    ``MOE_EP_FP8_WIDE_OVERLAP=1`` / ``0`` force it.

    Beyond 32·128 (Mixtral FC2, K 14336) the schedule runs in chunks of k-tiles (drop v26,
    :func:`fp8_overlap_chunk`; an even K/128): bit-identical on the H200, the default since the
    twelfth session (the Mixtral FP8 layer, CUDA graph, two interleaved rounds: 976.0 / 984.7
    TFLOP/s against 945.4 / 949.1 with FC2 on the plain schedule; the drop runner alone had shown
    no gain). ``MOE_EP_FP8_CHUNKED_OVERLAP=0`` turns it off."""
    if not env_flag("MOE_EP_FP8_OVERLAP", True):
        return False
    k_tiles = k // CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_BLOCK")
    if k_tiles > CONSTANTS.value("sm90_megamoe.fp8_gemm", "OVERLAP_MAX_K_TILES"):
        if not env_flag("MOE_EP_FP8_CHUNKED_OVERLAP", True) or not fp8_overlap_chunk(k):
            return False
    if not wide_gated:
        return True
    forced = env_forced("MOE_EP_FP8_WIDE_OVERLAP")
    return forced if forced is not None else (k >= WIDE_OVERLAP_MIN_K or _smem_scales_wanted(k))


def fp8_unit_scale_kc(k: int) -> int:
    """k-tiles per scale chunk of ``unit_scales`` at reduction size ``k`` (the drop's
    ``unit_scales.unit_scale_kc``): 8 where 8 divides K/128, else 4 where 4 does (drop v106), else 0."""
    return _load("sm90_megamoe.unit_scales").unit_scale_kc(k // CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_BLOCK"))


def fp8_overlap_chunk(k: int, unit_scales: bool = False) -> int:
    """k-tiles per chunk of the chunked overlapped schedule for reduction size ``k``, as the kernel
    computes it (the drop's ``fp8_gemm.kernel_overlap_chunk``, drop v107): 0 up to OVERLAP_MAX_K_TILES
    k-tiles (the whole loop unrolls), else the largest even divisor of K/128 up to OVERLAP_MAX_CHUNK
    (0 if none); with ``unit_scales`` the largest such multiple of the scale chunk
    (:func:`fp8_unit_scale_kc`; drop v105)."""
    return _load("sm90_megamoe.fp8_gemm").kernel_overlap_chunk(
        k // CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_BLOCK"), unit_scales)


#: reduction size from which the FP8 GEMMs run in clusters of 2 by default (use_fp8_cluster)
CLUSTER_MIN_K = 4096


def use_fp8_cluster(activation: str, n: int, k: int) -> int:
    """CTAs per cluster of the plain FP8 GEMM (drop v28, ``cluster_n``): the two CTAs of a cluster
    compute one m-tile's two adjacent n-tiles and multicast A's halves to each other (half of A's
    L2 -> SM traffic); bit-identical to single CTAs (H200). 2 where the n-tiles pair up (FC1
    always; FC2 when N/128 is even) and K >= CLUSTER_MIN_K or the GEMM stages its scales in
    shared memory, else 1. H200, tenth session, the FP8
    layer with the switch off / on / off / on: Mixtral (K 4096 / 14336) 924.7 / 958.6 / 926.7 /
    933.7 TFLOP/s graph, per call 927.7 / 945.1 / 919.6 / 948.1; Qwen3 (K 2048 / 768) no faster
    (drop runner 0.98-1.00x, layer 672.6 / 666.8 / 654.8 / 654.5) -- with global scales; with
    staged scales (the short-K schedule, :func:`use_fp8_smem_scales`) they are: FC2 1.06x in the
    drop runner, so the GEMMs that stage their scales run in clusters too (twelfth session).
    ``MOE_EP_FP8_CLUSTER=1`` / ``0`` force it on (where the n-tiles pair up) / off. (Clusters of 4,
    drop v49, ran ~4% slower: only 120 of 132 SMs take them; removed in drop v84.)"""
    forced = env_choice("MOE_EP_FP8_CLUSTER", ("0", "1"), "")
    short_k = use_fp8_smem_scales(compiled_key_overlap(activation, k), k, activation)  # staged scales
    if forced == "0" or (forced != "1" and k < CLUSTER_MIN_K and not short_k):
        return 1
    tile_n = _load("sm90_megamoe.fp8_gemm").default_tile_n(activation)  # the drop's tile width
    n_tiles = (n // 2 if activation in FP8_GATED else n) // tile_n
    return 2 if n_tiles % 2 == 0 else 1


#: the largest K whose FP8 GEMMs stage their scales in shared memory by default (use_fp8_smem_scales)
SMEM_SCALES_MAX_K = 2048


def _smem_scales_wanted(k: int, activation: str = "swiglu") -> bool:
    """``MOE_EP_FP8_SMEM_SCALES=1`` / ``0``: staged scales at any K / never; unset: K <= SMEM_SCALES_MAX_K,
    or the non-gated GEMM (FC2) at any K (from K = CLUSTER_MIN_K, where it runs in clusters anyway, with
    the scale warp: :func:`use_fp8_scale_warp`; where its scales come by TMA, :func:`use_fp8_unit_scales`,
    those win). The gated GEMM above SMEM_SCALES_MAX_K keeps global scales unless they come by TMA."""
    forced = env_forced("MOE_EP_FP8_SMEM_SCALES")
    if forced is not None:
        return forced
    # fifty-first session: the non-gated GEMM stages them at every K (Inkling2's FC2, K 2304, had
    # global scales and spilled: its FP8 layer 1-8% faster per call, 5-7% back to back with them staged, H100)
    return k <= SMEM_SCALES_MAX_K or activation == "identity"


def use_fp8_smem_scales(overlap_promotion: bool, k: int, activation: str = "swiglu") -> bool:
    """Whether the FP8 GEMM with reduction size ``k`` stages each
    k-tile's scales in shared memory from its producer warp (drop v34, ``smem_scales``) instead of
    every consumer thread loading them from global memory after issuing the k-tile's WGMMAs:
    bit-identical (H200). Only on the overlapped-promotion schedule, and by default for
    K <= SMEM_SCALES_MAX_K, where it comes with the overlapped wide FC1 and clusters of 2
    (:func:`use_fp8_overlap`, :func:`use_fp8_cluster`): the short-K schedule; and for the
    non-gated GEMM (FC2) from CLUSTER_MIN_K, with the scale warp (eighteenth session, below).

    H200, twelfth session, drop runner (staged / global): plain schedule Qwen3 wide FC1 0.89x,
    Mixtral wide FC1 0.91x, Mixtral FC2 in clusters 0.83x; overlapped Qwen3 wide FC1 1.08x, Qwen3
    FC2 in clusters 1.06x, Mixtral FC2 in clusters 1.04x. FP8 layer, two interleaved rounds,
    per call / back to back / CUDA graph TFLOP/s: Qwen3 with the short-K schedule 619.5 / 665.6 /
    689.7 and 665.9 / 660.4 / 691.4 against 595.6 / 633.8 / 656.5 and 609.1 / 638.3 / 650.0 without;
    Mixtral with staged scales 930-934 graph against 974-976 without (so K 4096 and 14336 keep
    global scales). ``MOE_EP_FP8_SMEM_SCALES=1`` / ``0``: on at any K / off.

    Eighteenth session (``python -m moe_ep.bench sustained``: each GEMM 2 s back to back at the 700 W
    cap, cuBLAS beside it in the same run): Mixtral's FC2 (identity, K 14336) with staged scales and
    the scale warp 1.849 ms against 1.916 global (1.036x; staged without the warp 1.896), its FC1
    (K 4096) 3.866 against 3.738 (0.967x). So the non-gated GEMM stages its scales (with the scale
    warp) from CLUSTER_MIN_K and the gated one only up to SMEM_SCALES_MAX_K. The Mixtral FP8
    layer, two interleaved rounds, b2b / graph: 966.3 / 969.5 and 965.7 / 969.8 TFLOP/s against
    943.6 / 947.7 and 949.8 / 959.4 with global scales (``MOE_EP_FP8_SMEM_SCALES=0``)."""
    return bool(overlap_promotion) and _smem_scales_wanted(k, activation)


def use_fp8_scale_warp(activation: str = "swiglu", k: int = 0) -> bool:
    """Where scales are staged (:func:`use_fp8_smem_scales`), a second producer warp stages them
    (drop v35, ``scale_warp``) instead of the TMA warp, whose loop then never waits on a scale
    load before issuing a stage's copies. ``MOE_EP_FP8_SCALE_WARP=1`` / ``0`` force it on / off;
    unset, it is on for the non-gated GEMM (FC2) from CLUSTER_MIN_K. Thirteenth session: the
    Qwen3 FP8 layer with it was within the defaults' spread (653-687 vs 684-692 TFLOP/s under CUDA
    graphs, two interleaved rounds), so short K keeps the TMA warp staging; fourteenth: Mixtral
    with staged scales and the scale warp on both GEMMs slower (936.4-937.9 vs 956.5-958.7 graph):
    its FC1 loses what its FC2 gains (eighteenth session, :func:`use_fp8_smem_scales`)."""
    forced = env_forced("MOE_EP_FP8_SCALE_WARP")
    if forced is not None:
        return forced
    return activation == "identity" and k >= CLUSTER_MIN_K


#: the largest K whose FP8 GEMMs defer their epilogue by default (use_fp8_deferred_epilogue)
DEFERRED_EPILOGUE_MAX_K = 1024


def use_fp8_deferred_epilogue(overlap_promotion: bool, k: int) -> bool:
    """Whether the FP8 GEMM stores each tile while the next tile's first k-tile runs (drop v48,
    ``deferred_epilogue``; bit-identical on the H200): possible on the unrolled overlapped schedule
    (K <= 32·128); by default for K <=
    DEFERRED_EPILOGUE_MAX_K, where a tile's k-loop is short next to its epilogue.

    H200, nineteenth session (``bash bench/h200_session.sh defer``; ``bench sustained``, each GEMM 2 s
    at the 700 W cap, ms, without / with): Qwen3 FC2 (K 768, 6 k-tiles) 0.275 / 0.260 (1.058x);
    Qwen3 FC1 (K 2048) 0.470 / 0.475; Mixtral FC1 (K 4096) 3.766 / 3.922 -- so only short K.
    ``MOE_EP_FP8_DEFERRED_EPILOGUE=1`` / ``0``: on wherever possible / off."""
    k_tiles = k // CONSTANTS.value("sm90_megamoe.fp8_gemm", "FP8_BLOCK")
    possible = (bool(overlap_promotion)
                and k_tiles <= CONSTANTS.value("sm90_megamoe.fp8_gemm", "OVERLAP_MAX_K_TILES"))
    forced = env_forced("MOE_EP_FP8_DEFERRED_EPILOGUE")
    if forced is not None:
        return possible and forced
    return possible and k <= DEFERRED_EPILOGUE_MAX_K


def use_fp8_wide_gated(activation: str) -> bool:
    """The gated FP8 GEMM (FC1) issues one m64n128 WGMMA over its gate and up tiles per k-block
    instead of two m64n64 ones (drop v21, ``wide_gated``): bit-identical (H200, fp8_runner --wide),
    FC1 1.12x (Qwen3) and 1.14x (Mixtral) faster. On by default; ``MOE_EP_FP8_WIDE_GATED=0`` turns
    it off. Every gated activation (clamped_swiglu too, drop v100: the same schedule, another epilogue)."""
    return activation in FP8_GATED and env_flag("MOE_EP_FP8_WIDE_GATED", True)


def compiled_key_overlap(activation: str, k: int) -> bool:
    """Whether the FP8 GEMM of this activation and K runs the overlapped-promotion schedule."""
    return use_fp8_overlap(k, use_fp8_wide_gated(activation))


def _env_int(var: str, default: int, top: int) -> int:
    """The integer switch ``var`` in 1 ... ``top`` (``default`` when unset or empty, as every switch);
    anything else raises naming the variable."""
    raw = os.environ.get(var) or str(default)
    if raw not in tuple(str(d) for d in range(1, top + 1)):
        raise ValueError(f"{var} must be an integer in 1 ... {top}, got {raw!r}")
    return int(raw)


def pick_fp8_raster_m(k: int) -> int:
    """m-tiles per raster group for reduction size ``k``: as for the BF16 GEMM
    (:func:`pick_raster_m`), with FP8 A rows of ``k`` bytes -- the group's A rows stay in L2 while
    the running CTAs sweep one expert's weight panels. Depends on K only (any routing).
    ``MOE_EP_FP8_RASTER_M`` (1 ... MAX_RASTER_M) sets it for every FP8 GEMM, for A/B runs: Mixtral's
    FC2 (K 14336) gets 13 by default, so an expert of 16 m-tiles reads its weights in two groups.
    Twenty-sixth session, H200 (``bench sustained`` at the 700 W cap, two interleaved rounds): that
    FC2 1.825 / 1.825 ms with 16, 1.828 / 1.829 with 13, 1.827 / 1.828 with 8 (within 0.2%); its FC1
    (K 4096) 3.725 / 3.728 with 8 against 3.660-3.672 with 16. So the defaults stay."""
    if os.environ.get("MOE_EP_FP8_RASTER_M", ""):
        return _env_int("MOE_EP_FP8_RASTER_M", 1, CONSTANTS.value("sm90_megamoe.constants", "MAX_RASTER_M"))
    return max(1, min(16, RASTER_L2_BUDGET // (128 * k)))


@dataclass(frozen=True)
class Fp8Key:
    """Every value an FP8 kernel of the drop depends on (``kind``: gemm or quantize)."""

    drop_version: int
    cutlass_version: str
    arch: str
    kind: str
    activation: str
    n: int
    k: int
    num_experts: int
    scale_rows: bool
    tvm_ffi: bool
    raster_m: int
    overlap_promotion: bool = False
    wide_gated: bool = False
    cluster_n: int = 1
    smem_scales: bool = False
    scale_warp: bool = False
    deferred_epilogue: bool = False
    tanh_sigmoid: bool = False
    quant_items: int = 1
    unit_scales: bool = False
    place: str = ""  # drop v92: "" | "copy" (PLACE_KINDS)
    # drop v100: clamped_swiglu's compile-time constants (0.0 for the other activations)
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    swiglu_beta: float = 0.0
    swiglu_limit_after_act: bool = False  # drop v102: the gate clamped after the activation (Step-3.7)
    # drop v103: softcapped_swiglu's caps (0.0 for the other activations)
    gate_softcap: float = 0.0
    up_softcap: float = 0.0
    stage_guard: bool = False  # drop v108: one stage fewer where the stage count divides the k-loop


#: reduction size from which the FP8 GEMMs load their scales by TMA by default (use_fp8_unit_scales)
UNIT_SCALES_MIN_K = 4096
#: ``MOE_EP_FP8_UNIT_SCALES``' values: from UNIT_SCALES_MIN_K (default), wherever the kernel can, never
UNIT_SCALES_MODES = ("auto", "1", "0")
#: the switches of the staged scales (drops v34 / v35): set, "auto" leaves the scales to them
_STAGED_SCALE_SWITCHES = ("MOE_EP_FP8_SMEM_SCALES", "MOE_EP_FP8_SCALE_WARP")


def use_fp8_unit_scales(k: int) -> bool:
    """Whether the plain overlapped FP8 GEMM with reduction size ``k`` has its scales loaded by TMA, 8
    k-tiles per copy into double-buffered shared memory (drop v69, ``unit_scales``; the same bits). It
    replaces the consumers' global scale loads and the staged scales (``smem_scales`` / ``scale_warp``).
    The kernel loads the scales of UNIT_SCALE_KC (8) k-tiles per copy, or of 4 where 8 does not divide
    K/128 (drop v106: Inkling2's FC1, K 4608 = 36 k-tiles), so K/128 must be a multiple of 4; beyond
    OVERLAP_MAX_K_TILES it then runs the k-loop in chunks that are multiples of that (drop v105;
    before, the chunk was the largest even divisor, and K 5120 / 7168 -- chunks of 10 / 14 -- could
    not take it). ``MOE_EP_FP8_UNIT_SCALES``: "auto" (default) wherever the kernel can from K =
    UNIT_SCALES_MIN_K (since the fifty-first session also DeepSeek-V3's / Kimi-K2's FC1, K 7168,
    K 5120's and Inkling2's FC1, K 4608, timed below), unless one of the staged scales' switches
    (``MOE_EP_FP8_SMEM_SCALES``, ``MOE_EP_FP8_SCALE_WARP``) is set, so those still select what they
    did; "1" wherever the kernel can (shorter K too); "0" never; anything else raises ValueError.

    Fifty-first session, H100 (no H200 came), the FP8 layer at 8192 tokens, two interleaved rounds,
    per call / back to back / CUDA graph TFLOP/s with "1" against the v106 defaults (global scales on
    those FC1s): DeepSeek-V3 shard 992.7, 958.7 / 949.2, 957.0 / 933.0, 968.5 against 926.6, 936.0 /
    890.5, 893.5 / 896.6, 908.5; Inkling2 shard 873.2, 900.5 / 877.4, 879.9 / 817.8, 783.8 against
    814.6, 815.7 / 810.9, 814.0 / 788.5, 790.0. K 5120 takes it untimed, by the same schedule.

    Twenty-eighth session, H200, drop runner at the 700 W cap (each GEMM back to back for a second,
    three interleaved rounds, bit-identical): Mixtral's FC1 (K 4096) 3.488 ms against 3.657 with
    global scales (1.049x), its FC2 (K 14336) 1.778 against 1.827 with the scale warp (1.028x);
    Qwen3's FC1 (K 2048) 0.443 against 0.439 staged by the TMA warp (0.993x). The FP8 layer with
    it on wherever it can, three interleaved rounds, per call / back to back / CUDA graph TFLOP/s:
    Mixtral 999-1027 / 1025-1028 / 1024-1027 against 949-978 / 995-997 / 1001-1005; Qwen3 (FC1 only)
    549-569 / 668-673 / 676-701 against 554-562 / 674-684 / 712-728 -- slower, hence "auto"."""
    mode = env_choice("MOE_EP_FP8_UNIT_SCALES", UNIT_SCALES_MODES, "auto")
    possible = fp8_unit_scale_kc(k) > 0  # drop v105 / v106: the chunk follows (fp8_overlap_chunk(k, True))
    staged_asked = any(os.environ.get(v) for v in _STAGED_SCALE_SWITCHES)
    return possible and (mode == "1" or (mode == "auto" and k >= UNIT_SCALES_MIN_K and not staged_asked))


def use_fp8_stage_guard() -> bool:
    """Whether the FP8 GEMMs take one pipeline stage fewer where the stage count divides their unrolled
    k-loop (drop v108, ``stage_guard``; the same bits). ptxas spills exactly there on the global- and
    staged-scale paths (51st session, CPU): Inkling2's FC2 (K 2304, 18 k-tiles, 6 stages) 24 bytes per
    thread, a K 1536 FC2 (Qwen3-235B's, GLM-4.5's) 16, a gated FC1 at K 3072 56; with 5 stages none.
    Fewer stages may cost more than the spills do, so ``MOE_EP_FP8_STAGE_GUARD=1`` turns it on; off
    (``0``) by default. Fifty-second session, H100: bit-identical (its GPU tests) but no faster on the
    Inkling2 shard's FP8 layer -- 959.3 / 924.0 / 808.9 and 957.2 / 942.1 / 827.6 TFLOP/s per call /
    back to back / graph against the defaults' 964.4 / 931.2 / 817.1 and 970.1 / 919.4 / 800.0."""
    return env_flag("MOE_EP_FP8_STAGE_GUARD", False)


def use_fp8_quant_items() -> int:
    """Warp items per loop pass of the FP8 row quantisers (drop v54, ``items``: the pass's loads
    issued together, more bytes in flight; the same bits for every value): ``MOE_EP_FP8_QUANT_ITEMS``
    in 1 ... 4, default 1."""
    return _env_int("MOE_EP_FP8_QUANT_ITEMS", 1, 4)


def use_fp8_tanh_sigmoid(activation: str) -> bool:
    """Whether the swiglu FP8 GEMM (FC1; drop v51: every variant, so switching between them keeps
    the bits) takes its sigmoid from one ``tanh.approx``
    (drop v50, ``tanh_sigmoid``: one MUFU op per output instead of ``ex2`` + ``rcp``; Nsight Compute,
    twentieth session: FC1's SwiGLU epilogue is MUFU-bound, 4.4% of Mixtral's FC1 cycles with the
    tensor pipe waiting). tanh.approx's relative error is ~2^-11, below the e4m3 rounding FC2's input
    gets next (the same float64 error on the H200). On by default since the twenty-first session (the
    whole GPU suite passed with it); ``MOE_EP_FP8_TANH_SIGMOID=0`` takes the exact-form sigmoid
    (``ex2`` + ``rcp``; other bits)."""
    return activation == "swiglu" and env_flag("MOE_EP_FP8_TANH_SIGMOID", True)


#: how a placing FP8 GEMM (drop v92) fills its A rows: "" -- it does not (the plain GEMM); "copy" --
#: copied from e4m3 x[idx[r]] with its scales (FC1 from tokens quantised once each). Drop v93 removed
#: "gather" / "rows" (quantised from bf16 x[idx[r]] / x[r] by the GEMM's warps: measured slower)
PLACE_KINDS = ("", "copy")


def _key(kind: str, activation: str, n: int, k: int, num_experts: int, scale_rows: bool,
         raster_m: int = 0, overlap_promotion: bool = False, place: str = "", swiglu: tuple = ()) -> Fp8Key:
    """``swiglu``: the gated activation's constants (:func:`_swiglu`): clamped_swiglu's (alpha, limit,
    beta[, limit_after_act]), softcapped_swiglu's (gate_softcap, up_softcap); ignored for the others."""
    check_removed()  # a switch of a removed variant, still set, raises here
    if place not in PLACE_KINDS:
        raise ValueError(f"sm90 FP8 GEMM: place must be one of {PLACE_KINDS}, got {place!r}")
    plain = kind == "gemm"
    deferred = kind == "gemm" and use_fp8_deferred_epilogue(overlap_promotion, k)
    # drop v69's TMA-loaded scales; not with the deferred epilogue (the pair has not run on a GPU)
    unit = plain and not deferred and bool(overlap_promotion) and use_fp8_unit_scales(k)
    smem = plain and not unit and use_fp8_smem_scales(overlap_promotion, k, activation)
    scale_warp = smem and use_fp8_scale_warp(activation, k)
    if place and scale_warp:  # the placing kernel's warp 1 copies rows
        raise ValueError("sm90 FP8 GEMM: a placing GEMM (MOE_EP_FP8_PLACE_FC1) has no scale warp; unset "
                         "MOE_EP_FP8_SCALE_WARP (or set it to 0) or the placement")
    return Fp8Key(CONSTANTS.value(PKG, "DROP_VERSION"), _cutlass_version(), "sm_90a", kind, activation, n, k,
                  num_experts, bool(scale_rows), use_tvm_ffi(), int(raster_m), bool(overlap_promotion),
                  kind == "gemm" and use_fp8_wide_gated(activation),
                  use_fp8_cluster(activation, n, k) if plain else 1,
                  smem, scale_warp, deferred,
                  kind == "gemm" and use_fp8_tanh_sigmoid(activation),
                  use_fp8_quant_items() if kind.startswith("quantize") else 1, unit, place,
                  *_key_constants(activation, swiglu), stage_guard=plain and use_fp8_stage_guard())


def _gemm_key(activation: str, n: int, k: int, num_experts: int, scale_rows: bool, place: str = "",
              swiglu: tuple = ()) -> Fp8Key:
    """The GEMM's key: every schedule choice made once, here (compiled code and launcher agree)."""
    return _key("gemm", activation, n, k, num_experts, scale_rows, pick_fp8_raster_m(k),
                compiled_key_overlap(activation, k), place, swiglu)


def _gemm_options(key: Fp8Key) -> dict:
    """``CompiledFp8Gemm``'s arguments (all but ``compiled``) for a GEMM key."""
    return dict(activation=key.activation, n=key.n, k=key.k, num_experts=key.num_experts,
                scale_rows=key.scale_rows, tvm_ffi=key.tvm_ffi, raster_m=key.raster_m,
                overlap_promotion=key.overlap_promotion, wide_gated=key.wide_gated,
                cluster_n=key.cluster_n, smem_scales=key.smem_scales,
                scale_warp=key.scale_warp, deferred_epilogue=key.deferred_epilogue,
                tanh_sigmoid=key.tanh_sigmoid, unit_scales=key.unit_scales,
                **(dict(place_a=True) if key.place else {}),
                **(dict(swiglu_alpha=key.swiglu_alpha, swiglu_limit=key.swiglu_limit, swiglu_beta=key.swiglu_beta)
                   if key.activation == "clamped_swiglu" else {}),
                **(dict(swiglu_limit_after_act=True) if key.swiglu_limit_after_act else {}),
                **(dict(gate_softcap=key.gate_softcap, up_softcap=key.up_softcap)
                   if key.activation == "softcapped_swiglu" else {}),
                **(dict(stage_guard=True) if key.stage_guard else {}))


def _checked_gemm_key(activation: str, n: int, k: int, num_experts: int, scale_rows: bool,
                      place: str = "", swiglu: tuple = ()) -> Fp8Key:
    """:func:`_gemm_key` after the shape checks (ValueError naming what is wrong)."""
    check_fp8_gemm(activation, n, k, num_experts)
    return _gemm_key(activation, n, k, num_experts, scale_rows, place, swiglu)


def _swiglu(activation: str, swiglu_alpha: float, swiglu_limit: float, swiglu_beta: float,
            swiglu_limit_after_act: bool, gate_softcap: float, up_softcap: float) -> tuple:
    """The public functions' activation constants as :func:`_key` takes them (``swiglu``)."""
    if activation == "softcapped_swiglu":
        return (gate_softcap, up_softcap)
    return (swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act)


def _key_constants(activation: str, swiglu: tuple) -> tuple:
    """The key's (alpha, limit, beta, limit_after_act, gate_softcap, up_softcap): each activation's own,
    zero for the others (so an activation's kernels share one key whatever the others' values)."""
    clamped = (0.0, 0.0, 0.0, False)
    if activation == "clamped_swiglu" and swiglu:
        alpha, limit, beta, *after = swiglu
        clamped = (float(alpha), float(limit), float(beta), bool(after and after[0]))
    caps = tuple(float(c) for c in swiglu) if activation == "softcapped_swiglu" and swiglu else (0.0, 0.0)
    return clamped + caps


def compiled_gemm_of_key(key: Fp8Key) -> Any:
    """The compiled GEMM of ``key``: the in-process cache, else the disk cache, else compile."""
    name = f"fp8_gemm_{key.activation}" + (f"_cluster{key.cluster_n}" if key.cluster_n > 1 else "") + \
        ("_defer" if key.deferred_epilogue else "") + ("_tanh" if key.tanh_sigmoid else "") + \
        ("_us" if key.unit_scales else "") + (f"_place{key.place}" if key.place else "") + \
        ("_sg" if key.stage_guard else "")

    def build():
        fl = _load("sm90_megamoe.fp8_launch")
        return disk_cache.get_or_build(
            cache_namespace(), name, key,
            lambda: fl.CompiledFp8Gemm(compiled=None, **_gemm_options(key)).compiled,
            tvm_ffi=key.tvm_ffi)

    return COMPILE_CACHE.get_or_compile(key, build)


def compiled_fp8_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                      place: str = "", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                      swiglu_beta: float = 1.0, swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
                      up_softcap: float = 25.0) -> Any:
    """Compiled code of the FP8 grouped GEMM (no GPU needed). Gated with :func:`use_fp8_wide_gated`:
    the one-WGMMA gate+up schedule. ``place`` (drop v92): see :func:`fp8_gemm`; ``swiglu_*``:
    clamped_swiglu's constants (drop v100; ``swiglu_limit_after_act``: drop v102); ``*_softcap``:
    softcapped_swiglu's (drop v103)."""
    return compiled_gemm_of_key(_checked_gemm_key(activation, n, k, num_experts, scale_rows, place,
                                                  _swiglu(activation, swiglu_alpha, swiglu_limit, swiglu_beta,
                                                          swiglu_limit_after_act, gate_softcap, up_softcap)))


def fp8_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False, place: str = "",
             swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, swiglu_beta: float = 1.0,
             swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0, up_softcap: float = 25.0) -> Any:
    """A caller-owned launcher: ``gemm(a [M, k] e4m3, a_scale [M, k/128] f32, b [E, n, k] e4m3,
    b_scale [E, n/128, k/128] f32, offsets [E+1] i32, out=[M, n_out] bf16, row_scale=[M] f32)``.
    ``place`` (drop v92, opt-in): "copy" -- the GEMM writes its own A rows and scales while it runs,
    ``a`` and ``a_scale`` being written by it: row r copied from e4m3 ``x[idx[r]]`` and its scales (a
    call passes ``x=`` [T, k] e4m3, ``x_scale=`` [T, k/128] f32, ``idx=`` [M] int32 and ``sync=``);
    ``sync``: :func:`~.sm90_megamoe.place_sync_len`
    int32, zero before the first launch. ``swiglu_*``: clamped_swiglu's constants (drop v100;
    ``swiglu_limit_after_act``: drop v102); ``*_softcap``: softcapped_swiglu's (drop v103)."""
    key = _checked_gemm_key(activation, n, k, num_experts, scale_rows, place,
                            _swiglu(activation, swiglu_alpha, swiglu_limit, swiglu_beta, swiglu_limit_after_act,
                                    gate_softcap, up_softcap))
    return _load("sm90_megamoe.fp8_launch").CompiledFp8Gemm(compiled=compiled_gemm_of_key(key), **_gemm_options(key))


def compiled_fp8_quantize_rows(k: int, gather: bool = False, scatter_topk: int = 0) -> Any:
    """Compiled code of the BF16 -> FP8 row quantiser for rows of ``k`` values (no GPU needed);
    ``gather``: the variant that reads row ``idx[r]`` of a source for output row ``r``;
    ``scatter_topk`` (drop v25): the variant that quantises each slot once and writes it to the
    grouped rows ``pos[s, :topk]`` names."""
    if k % 128:
        raise ValueError(f"sm90 FP8 row quantiser: K={k} must be a multiple of 128")
    if scatter_topk and gather:
        raise ValueError("sm90 FP8 row quantiser: gather and scatter_topk do not combine")
    if scatter_topk:  # the top-k is the key's n (unused by the quantisers otherwise)
        key = _key("quantize_scatter", "", int(scatter_topk), k, 0, False)
    else:
        key = _key("quantize_gather" if gather else "quantize_counted", "", 0, k, 0, False)
    return COMPILE_CACHE.get_or_compile(key, lambda: build_fp8_quantizer(key))


#: a quantiser key's kind -> its disk-cache name
QUANTIZER_NAMES = {"quantize_scatter": "fp8_scatter_quantize_rows", "quantize_gather": "fp8_gather_quantize_rows",
                    "quantize_counted": "fp8_quantize_rows"}


def build_fp8_quantizer(key: Fp8Key) -> Any:
    """The compiled row quantiser of ``key`` (a ``quantize_*`` kind) from the disk cache, else
    compiled and stored: the compile step of :func:`compiled_fp8_quantize_rows` and of a cache
    rebuilt from a manifest (``kernel_replay``)."""
    fq = _load("sm90_megamoe.fp8_quant")
    scatter_topk = key.n if key.kind == "quantize_scatter" else 0
    return disk_cache.get_or_build(
        cache_namespace(), QUANTIZER_NAMES[key.kind], key,
        lambda: fq.compile_fp8_quantize_rows(k=key.k, arch="sm_90a", tvm_ffi=key.tvm_ffi, counted=not scatter_topk,
                                             gather=key.kind == "quantize_gather", scatter_topk=scatter_topk,
                                             items=key.quant_items),
        tvm_ffi=key.tvm_ffi)


def fp8_quantize_rows(k: int, gather: bool = False, scatter_topk: int = 0) -> Any:
    """A caller-owned row quantiser: ``q(x [M, k] bf16, values [M, k] e4m3, scale [M, k/128] f32,
    count=[1] int32 device tensor)``: rows at and past ``count[0]`` are not touched (the count is
    read on the device, so padding rows cost nothing and the host never syncs). ``gather=True``:
    ``q(x [S, k], values [M, k], scale, count=, idx=[>= M] int32)`` quantises ``x[idx[r]]`` into
    row ``r`` (a row gather and the quantisation in one pass). ``scatter_topk=K``: ``q(x [S, k],
    values [M, k], scale, pos=[>= S, K] int32, recv_count=[W] int32, t_max=int)`` quantises each
    valid slot s once into rows ``pos[s, k]`` (the layout's inverse of ``idx``: the same rows and bits)."""
    compiled = compiled_fp8_quantize_rows(k, gather, scatter_topk)
    return _load("sm90_megamoe.fp8_quant").CompiledFp8QuantizeRows(
        k=k, compiled=compiled, tvm_ffi=use_tvm_ffi(), counted=not scatter_topk, gather=bool(gather),
        scatter_topk=int(scatter_topk))
