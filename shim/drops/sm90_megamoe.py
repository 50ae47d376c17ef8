"""Shim for the SM90 drop ``kernel_src/sm90/megamoe`` (package ``sm90_megamoe``; its version is the
mirrored ``DROP_VERSION``).

What moe_ep relies on, declared as data (:data:`CONTRACT`), plus thin wrappers:

* :func:`check_gemm_shapes` -- validation with clear errors before anything compiles;
* :func:`grouped_gemm` -- a per-caller :class:`GroupedGemm` launcher around the compiled varlen-M
  grouped GEMM (the compiled code comes from :data:`COMPILE_CACHE`, keyed by every
  contract-relevant value, never by routing);
* :class:`EpSession` -- one layer's EP kernels on caller-provided buffers (a workspace);
* :class:`LayoutSession` -- one layer's expert-layout kernels on a caller-provided scratch;
* :func:`compile_gemm_ptx` / :func:`compile_ep_ptx` -- compile for an arch without a GPU;
* :func:`prebuild_ep` / :func:`prebuild_layout` (and :func:`compiled_grouped_gemm`) -- obtain the
  compiled kernels without a GPU, through the disk cache (:mod:`moe_ep.shim.disk_cache`): every
  compiled kernel is exported there and loaded back by later processes.

Launches go through TVM-FFI when apache-tvm-ffi is installed (:func:`moe_ep.shim.launch_mode.use_tvm_ffi`;
``MOE_EP_TVM_FFI=0`` turns it off): kernels are then called with torch tensors on torch's current
stream, ~4 us per launch and nothing converted; otherwise with converted CuTe tensors cached per
argument role (~18 us per launch).

The compile cache holds compiled kernels only. Everything that holds device memory or converted
arguments (launchers, sessions) belongs to its caller and dies with it.

Counter contract (:data:`GEMM_COUNTERS`, :data:`EP_COUNTERS`, :data:`LAYOUT_COUNTERS`): the grouped
GEMM keeps no state between launches (its tile scheduler reads the device-side offsets afresh).
The EP kernels are tail-clean: their flags carry a per-forward epoch that only moves forward (a
receiver waits for ``flag == epoch``, so stale flags never match), and the only counters that
return to a value, the local CTA-arrival counters ``ctrl[1]``/``ctrl[2]``, are reset to 0 by the
last CTA of their kernel. The layout kernels are stateless: LayoutCount rewrites the whole counts
scratch before LayoutPlace reads it. Nothing is zeroed before a launch; the GPU tests prove it
with 100 consecutive forwards on changing routing. After a device-side error (timeout, capacity)
every rank resets its EP state (:meth:`EpSession.reset`) between two barriers.
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass
from typing import Any

from .. import disk_cache
from ..cache import COMPILE_CACHE
from ..constants import MirroredConstants
from ..contract import AttributeUse, CallableUse, DropContract, ImportUse
from ..env import check_removed
from ..launch_mode import use_tvm_ffi
from ..nvshmem_boot import CounterContract
from .sm90_megamoe_switches import (  # noqa: F401  (re-exported: the shim reads them here, tests too)
    clusters_by_default,
    gpu_named,
    pingpong_max_k,
    use_bf16_cluster,
    use_bf16_cluster_n,
    use_bf16_tanh_sigmoid,
    use_box_tails,
    use_fc2_early,
    use_gated_pingpong,
    use_jump_stages,
    use_wide_gated,
)

PKG = "sm90_megamoe"

CONSTANTS = MirroredConstants("sm90/megamoe", {
    "sm90_megamoe": {"DROP_VERSION": 114},
    "sm90_megamoe.placing_producer": {"PLACE_SYNC_TAIL": 4},
    "sm90_megamoe.grouped_gemm_handoff": {"HANDOFF_SYNC_TAIL": 4},
    "sm90_megamoe.fp8_gemm": {"FP8_BLOCK": 128, "OVERLAP_MAX_K_TILES": 32, "OVERLAP_MAX_CHUNK": 16,
                              "FP8_ACTIVATIONS": ("identity", "swiglu", "clamped_swiglu", "softcapped_swiglu"),
                              "FP8_GATED": ("swiglu", "clamped_swiglu", "softcapped_swiglu")},
    "sm90_megamoe.unit_scales": {"UNIT_SCALE_KC": 8},
    "sm90_megamoe.constants": {
        "ABI_VERSION": 2,
        "ACTIVATIONS": ("identity", "swiglu", "squared_relu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu",
                        "gelu_tanh_glu"),
        "GATED_ACTIVATIONS": ("swiglu", "gelu_glu", "clamped_swiglu", "softcapped_swiglu", "gelu_tanh_glu"),
        "ALIGN_K_ELEMS": 8,
        "ALIGN_N_ELEMS": 8,
        "DEFAULT_TILE_N": {"identity": 256, "squared_relu": 256, "swiglu": 128, "gelu_glu": 128,
                           "clamped_swiglu": 128, "softcapped_swiglu": 128, "gelu_tanh_glu": 128},
        "DEFAULT_TILE_K": 64,
        "DEFAULT_TILE_M": 128,
        "MAX_EXPERTS": 1024,
        "MAX_RASTER_M": 64,
    },
    "sm90_megamoe.ep_constants": {
        "EP_ABI_VERSION": 2,
        "EP_NUM_PEER_BUFS": 6,
        "EP_CTRL_LEN": 4,
        "EP_ERR_LEN": 4,
        "EP_VERR_LEN": 8,
        "ERR_CODE": 0, "ERR_PEER": 1, "ERR_WHERE": 2, "ERR_AUX": 3,
        "ERR_NONE": 0, "ERR_TIMEOUT": 1, "ERR_CAPACITY": 2,
        "VERR_RESET": (0, 2**63 - 1, 0, 0, 2**63 - 1, 0, 0, 0),
        "EP_MAX_WORLD": 32,
        "EP_MAX_TOPK": 32,
        "EP_ALIGN_H_ELEMS": 8,
    },
    "sm90_megamoe.layout_kernels": {
        "LAYOUT_ABI_VERSION": 3,
        "LAYOUT_MAX_LOCAL_EXPERTS": 1024,
        "LAYOUT_MAX_WORLD": 32,
    },
})

CONTRACT = DropContract(
    arch="sm90", drop="megamoe", version=CONSTANTS.value(PKG, "DROP_VERSION"), packages=(PKG,), constants=CONSTANTS,
    callables=(
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.__init__",
                    ("activation", "n", "k", "num_experts", "scale_rows", "tile_n", "bias_dtype",
                     "raster_m", "swiglu_alpha", "swiglu_limit", "schedule", "compiled", "tvm_ffi",
                     "early_weights", "gather_a", "cluster_m", "tanh_sigmoid",
                     "cluster_n", "jump_stages", "swiglu_beta", "swiglu_limit_after_act",
                     "gate_softcap", "up_softcap", "box_rows", "handoff")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.launch_converted",
                    ("args", "max_active_ctas", "stream", "publishers")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.launch_tensors",
                    ("a", "b", "c", "offsets", "row_scale", "bias", "max_active_ctas", "stream", "idx", "sync",
                     "publishers")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.prepare",
                    ("a", "out", "offsets", "row_scale", "bias", "max_active_ctas", "idx", "sync", "publishers")),
        CallableUse("sm90_megamoe.launch:CompiledGroupedGemm.grid_ctas", ("max_active_ctas", "device")),
        CallableUse("sm90_megamoe.launch:to_cute_args",
                    ("a", "b", "c", "offsets", "row_scale", "bias", "idx", "sync")),
        CallableUse("sm90_megamoe.compile_check:compile_for_arch",
                    ("activation", "n", "k", "scale_rows", "arch", "num_experts", "tile_n",
                     "extra_options", "bias_dtype", "raster_m", "swiglu_alpha", "swiglu_limit",
                     "schedule", "tanh_sigmoid", "swiglu_beta", "swiglu_limit_after_act", "gate_softcap",
                     "up_softcap")),
        CallableUse("sm90_megamoe.ep_launch:EpConfig.__init__",
                    ("hidden", "topk", "world", "max_tokens", "num_experts")),
        CallableUse("sm90_megamoe.ep_launch:EpBuffers.__init__",
                    ("recv_x", "recv_ids", "recv_w", "recv_count", "flags", "comb", "ctrl", "err",
                     "verr", "dmask")),
        CallableUse("sm90_megamoe.ep_launch:build_peer_table", ("peer_buffers", "device")),
        CallableUse("sm90_megamoe.ep_launch:get_kernel", ("kind", "cfg", "tvm_ffi")),
        CallableUse("sm90_megamoe.ep_launch:compile_kernel", ("kind", "cfg", "options", "tvm_ffi", "arch")),
        CallableUse("sm90_megamoe.ep_launch:put_kernel", ("kind", "cfg", "compiled", "tvm_ffi", "arch")),
        CallableUse("sm90_megamoe.layout_launch:compile_kernel", ("kind", "cfg", "options", "tvm_ffi", "arch")),
        CallableUse("sm90_megamoe.layout_launch:put_kernel", ("kind", "cfg", "compiled", "tvm_ffi", "arch")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.__init__",
                    ("cfg", "rank", "bufs", "peer_table", "num_ctas", "timeout_ns", "tvm_ffi", "arch",
                     "local_combine")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.dispatch", ("x", "topk_ids", "topk_w")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.wait", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.gather", ("src", "idx", "count", "out", "stream", "num_ctas")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.combine_send", ("y", "pos", "stream", "num_ctas",
                                                                   "weighted")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.combine_reduce", ("out",)),
        CallableUse("sm90_megamoe.ep_launch:EpRank.combine_local", ("y", "pos", "out")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.prepare_combine_local", ("y", "pos")),
        CallableUse("sm90_megamoe.ep_launch:EpRank.read_err", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.read_verr", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.reset_verr", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.reset_state", ()),
        CallableUse("sm90_megamoe.ep_launch:EpRank.release", ()),
        CallableUse("sm90_megamoe.layout_launch:LayoutConfig.__init__",
                    ("hidden", "topk", "world", "max_tokens", "local_experts")),
        CallableUse("sm90_megamoe.layout_launch:Layout.__init__",
                    ("cfg", "device", "num_chunks", "counts", "timeout_ns", "tvm_ffi", "arch", "route")),
        CallableUse("sm90_megamoe.layout_launch:Layout.__call__",
                    ("bufs", "offsets", "idx", "ws", "pos", "xs", "stream", "check")),
        CallableUse("sm90_megamoe.layout_launch:Layout.route",
                    ("bufs", "x", "topk_ids", "topk_w", "offsets", "idx", "ws", "pos", "xs", "stream", "check")),
        CallableUse("sm90_megamoe.layout_launch:Layout.prepare_route",
                    ("bufs", "offsets", "idx", "ws", "pos", "xs")),
        CallableUse("sm90_megamoe.layout_launch:Layout.release", ()),
        CallableUse("sm90_megamoe.layout_launch:kinds_for", ("cfg", "route")),
        CallableUse("sm90_megamoe.layout_kernels:counts_len", ("num_chunks", "local_experts")),
        CallableUse("sm90_megamoe.fp8_gemm:can_implement", ("activation", "n", "k", "num_experts")),
        CallableUse("sm90_megamoe.fp8_gemm:default_tile_n", ("activation",)),
        CallableUse("sm90_megamoe.fp8_gemm:kernel_overlap_chunk", ("k_tiles", "unit_scales")),
        CallableUse("sm90_megamoe.unit_scales:unit_scale_kc", ("k_tiles",)),
        CallableUse("sm90_megamoe.fp8_launch:CompiledFp8Gemm.__init__",
                    ("activation", "n", "k", "num_experts", "scale_rows", "compiled", "tvm_ffi", "raster_m",
                     "overlap_promotion", "wide_gated", "cluster_n", "smem_scales",
                     "scale_warp", "deferred_epilogue", "tanh_sigmoid", "unit_scales", "place_a",
                     "swiglu_alpha", "swiglu_limit", "swiglu_beta", "swiglu_limit_after_act",
                     "gate_softcap", "up_softcap", "stage_guard")),
        CallableUse("sm90_megamoe.fp8_launch:CompiledFp8Gemm.__call__",
                    ("a", "a_scale", "b", "b_scale", "offsets", "out", "row_scale", "max_active_ctas", "stream",
                     "x", "idx", "sync", "x_scale")),
        CallableUse("sm90_megamoe.fp8_launch:CompiledFp8Gemm.prepare",
                    ("a", "a_scale", "offsets", "out", "row_scale", "max_active_ctas", "x", "idx", "sync",
                     "x_scale")),
        CallableUse("sm90_megamoe.fp8_quant:compile_fp8_quantize_rows",
                    ("k", "arch", "tvm_ffi", "counted", "gather", "scatter_topk", "items")),
        CallableUse("sm90_megamoe.fp8_quant:CompiledFp8QuantizeRows.__init__",
                    ("k", "compiled", "tvm_ffi", "counted", "gather", "scatter_topk")),
        CallableUse("sm90_megamoe.fp8_quant:CompiledFp8QuantizeRows.__call__",
                    ("x", "q", "scale", "m_rows", "stream", "count", "idx", "pos", "recv_count", "t_max")),
        CallableUse("sm90_megamoe.fp8_quant:CompiledFp8QuantizeRows.prepare",
                    ("q", "scale", "m_rows", "count", "idx", "pos", "recv_count", "t_max")),
    ),
    imports=(
        ImportUse("sm90_megamoe.launch", "CompiledGroupedGemm", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.compile_check", "compile_for_arch", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.ep_launch", "EpRank", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.ep_launch", "KINDS", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.layout_launch", "Layout", "shim/drops/sm90_megamoe.py"),
        ImportUse("sm90_megamoe.layout_launch", "KINDS", "shim/drops/sm90_megamoe.py"),
    ),
    consumers=("shim/drops/sm90_megamoe.py", "shim/drops/sm90_megamoe_ep.py", "shim/drops/sm90_megamoe_layout.py",
               "shim/drops/sm90_megamoe_fp8.py"),
    # every attribute the shim (and, through GroupedGemm.compiled / EpSession.bufs, its callers)
    # reads off drop modules and objects; the audit checks each statically against the drop
    attributes=(
        AttributeUse("sm90_megamoe.launch", ("CompiledGroupedGemm", "to_cute_args")),
        AttributeUse("sm90_megamoe.compile_check", ("compile_for_arch",)),
        AttributeUse("sm90_megamoe.pdl", ("PDL",)),
        AttributeUse("sm90_megamoe.ep_launch", ("EpConfig", "EpBuffers", "EpRank", "KINDS", "build_peer_table",
                                                "compile_kernel", "put_kernel", "kinds_for")),
        AttributeUse("sm90_megamoe.layout_launch", ("LayoutConfig", "Layout", "KINDS", "compile_kernel",
                                                    "put_kernel", "kinds_for")),
        AttributeUse("sm90_megamoe.launch:CompiledGroupedGemm",
                     ("compiled", "scale_rows", "bias_dtype", "n_out", "tvm_ffi", "schedule", "launch_tensors",
                      "launch_converted", "gather_a", "cluster_m", "prepare")),
        AttributeUse("sm90_megamoe.ep_launch:EpRank",
                     ("dispatch", "wait", "gather", "combine_send", "combine_reduce", "combine_local",
                      "prepare_combine_local", "read_err", "read_verr", "reset_verr", "reset_state", "num_ctas",
                      "release")),
        AttributeUse("sm90_megamoe.ep_launch:EpConfig", ("threads",)),
        AttributeUse("sm90_megamoe.ep_launch:EpBuffers",
                     ("recv_x", "recv_ids", "recv_w", "recv_count", "flags", "comb", "ctrl", "err", "verr",
                      "dmask")),
        AttributeUse("sm90_megamoe.layout_launch:Layout", ("__call__", "route", "prepare_route", "release")),
        AttributeUse("sm90_megamoe.fp8_gemm", ("can_implement", "default_tile_n", "kernel_overlap_chunk")),
        AttributeUse("sm90_megamoe.unit_scales", ("unit_scale_kc",)),
        AttributeUse("sm90_megamoe.fp8_launch", ("CompiledFp8Gemm",)),
        AttributeUse("sm90_megamoe.fp8_launch:CompiledFp8Gemm", ("compiled", "n_out", "__call__", "prepare")),
        AttributeUse("sm90_megamoe.fp8_quant", ("compile_fp8_quantize_rows", "CompiledFp8QuantizeRows")),
        AttributeUse("sm90_megamoe.fp8_quant:CompiledFp8QuantizeRows", ("__call__", "prepare")),
    ),
)

CONSTANTS.activate = CONTRACT.activate

# mirrored values the validation below uses (checked against the drop at first compile)
_C = CONSTANTS.table["sm90_megamoe.constants"]
_E = CONSTANTS.table["sm90_megamoe.ep_constants"]
_L = CONSTANTS.table["sm90_megamoe.layout_kernels"]
GEMM_ACTIVATIONS = _C["ACTIVATIONS"]
GEMM_GATED = _C["GATED_ACTIVATIONS"]
#: the grouped GEMM's schedules (``swapab``: the decode kernel, weights on the WGMMA's M side)
SCHEDULES = ("cooperative", "pingpong", "swapab", "wide")
#: bias dtypes the grouped GEMM epilogue reads (torch dtype name -> the drop's name)
GEMM_BIAS_DTYPES = ("float32", "bfloat16")
#: chunk count bound of the layout kernels' counts scratch (one chunk per SM by default)
LAYOUT_MAX_CHUNKS = 1024


def _load(module: str) -> Any:
    CONTRACT.activate()
    CONSTANTS.ensure_checked()
    return importlib.import_module(module)


#: targets the drop's EP and expert-layout kernels build for (loads, stores, atomics, fences,
#: shuffles only): the Blackwell backends reuse them rather than carry copies
EP_ARCHS = ("sm_90a", "sm_100a", "sm_120a")


def pdl_launches() -> bool:
    """Whether the drop launches its kernels with programmatic dependent launch (drop v20: on
    unless ``SM90_MEGAMOE_PDL=0`` when the drop is first imported, see VENDOR.md)."""
    return bool(_load("sm90_megamoe.pdl").PDL)


def cache_namespace(arch: str = "sm_90a") -> str:
    """Disk-cache folder of this drop's kernels for ``arch`` (see :func:`disk_cache.drop_namespace`);
    kernels built with PDL launches live in their own folder (the launch attribute is compiled in)."""
    ns = disk_cache.drop_namespace("sm90", "megamoe", CONSTANTS.value(PKG, "DROP_VERSION"), arch)
    return ns + "-pdl" if pdl_launches() else ns


def _check_ep_arch(arch: str) -> None:
    if arch not in EP_ARCHS:
        raise ValueError(f"sm90_megamoe EP/layout kernels: arch {arch!r} not in {EP_ARCHS}")


_cutlass_version = disk_cache.cutlass_version


def _num_sms(device: Any) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


# =============================================================================================
# Grouped GEMM
# =============================================================================================


def check_gemm_shapes(activation: str, n: int, k: int, num_experts: int, tile_n: int | None = None) -> None:
    """Raise ``ValueError`` when the SM90 grouped GEMM cannot take these static shapes.

    ``n`` = rows of the weight (2·I for swiglu), ``k`` = reduction size.
    """
    if activation not in GEMM_ACTIVATIONS:
        raise ValueError(f"sm90 grouped GEMM: activation {activation!r} not in {GEMM_ACTIVATIONS}")
    if k % _C["ALIGN_K_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: K={k} must be a multiple of {_C['ALIGN_K_ELEMS']} (16-byte TMA rows)")
    if num_experts > _C["MAX_EXPERTS"]:
        raise ValueError(f"sm90 grouped GEMM: num_experts={num_experts}, at most {_C['MAX_EXPERTS']} experts per launch")
    if activation in GEMM_GATED:
        if n % 2:
            raise ValueError(f"sm90 grouped GEMM: {activation} needs an even w13 row count (2·I), got {n}")
        if (n // 2) % _C["ALIGN_N_ELEMS"]:
            raise ValueError(f"sm90 grouped GEMM: intermediate I={n // 2} must be a multiple of "
                             f"{_C['ALIGN_N_ELEMS']} (16-byte output rows)")
    elif n % _C["ALIGN_N_ELEMS"]:
        raise ValueError(f"sm90 grouped GEMM: N={n} must be a multiple of {_C['ALIGN_N_ELEMS']}")


#: L2 bytes the raster's A row groups may take (about half of an H100/H200's 50 MB L2)
RASTER_L2_BUDGET = 24 << 20


def pick_raster_m(k: int) -> int:
    """m-tiles per raster group for reduction size ``k``: as many 128-row A blocks (128·k·2 bytes)
    as fit in :data:`RASTER_L2_BUDGET`, at most 16. The CTAs running at the same time then sweep
    the weight N-panels of one expert with the group's A rows resident in L2, so every weight
    byte comes from DRAM once per group (Mixtral FC1: once instead of once per m-tile). Depends on
    K only: one compiled kernel serves every routing."""
    return max(1, min(16, RASTER_L2_BUDGET // (128 * k * 2)))


#: reduction sizes up to which the non-gated GEMM (FC2) runs the pingpong schedule with
#: :data:`PINGPONG_TILE_N`-wide tiles (drop v71; ``MOE_EP_PINGPONG_MAX_K`` overrides it, 0 = never):
#: short k-loops, where one warpgroup's epilogue under the other's mainloop pays. H200, drop
#: runner ``--pingpong`` (31st session), FC2 on a layer's routing, pingpong / cooperative
#: 128 x 256: Qwen3 (K 768) 1.06x, gpt-oss (K 2880) 1.08x, the DeepSeek-V3 shard (K 2048) 1.03x
#: and 0.93x in two rounds (1.09x at an eighth of the rows); Mixtral (K 14336) 0.79-0.94x: not there.
#: The Qwen3 BF16 layer, three interleaved rounds: per call 513.8-530.8 vs 509.2-515.9 TFLOP/s.
#: With a bias (gpt-oss's FC2) the 128 x 192 pingpong kernel spills 312 bytes per thread (ptxas:
#: the bias of a thread's 48 columns on top of 192 accumulators); that FC2 still ran 1.08x
PINGPONG_MAX_K = 2880
#: that bound on an H100 (by name, :func:`pingpong_bound`): 1920. 53rd session, H100 80GB HBM3 (3.35
#: TB/s against the H200's 4.8), `bench gemm` interleaved with torch's, pingpong 128 x 192 against
#: cooperative 128 x 256 (``MOE_EP_PINGPONG_MAX_K=0``; in clusters of 2 where :func:`use_bf16_cluster`
#: says so), torch / ours uniform / skewed: the DeepSeek-V3 shard's FC2 (K 2048) 0.77 / 0.82 against
#: 1.04 / 1.08, the DeepSeek-V4 shard's (K 2048) 0.86 / 0.77 against 1.06 / 1.13, Inkling2's (K 2304)
#: 0.94 / 0.91 against 1.11 / 1.07, Nemotron's squared-ReLU FC1 (K 2688, 384 rows per expert: single
#: CTAs) 0.96 / 0.93 against 1.14 / 1.10; at short K level or behind: Nemotron's FC2 (K 1856) 1.13 /
#: 1.12 against 1.18 / 1.08, Qwen3's (K 768) 1.12 / 1.27 against 1.17 / 1.15. Layers, two interleaved
#: rounds: the DeepSeek-V3 shard 648.1-648.9 / 637.1-642.4 / 579.5-587.5 TFLOP/s per call / back to
#: back / graph against 631.3-636.0 / 616.2-616.6 / 553.6-560.6; Inkling2's level (621.4-626.5 /
#: 611.2-614.9 / 631.8-635.1 against 603.4-614.7 / 615.9-619.2 / 635.9-642.2); Qwen3's 3-5% slower
#: (so K 768 keeps pingpong). Only where that cooperative kernel runs in clusters (54th session, 3e44df6,
#: H100, `ENVAB="|MOE_EP_PINGPONG_MAX_K=2880" MODELS=gpt_oss,nemotron,dsv4_shard`, two interleaved
#: rounds): with single CTAs (fewer than CLUSTER_MIN_ROWS rows per expert) pingpong won every round
#: and column -- gpt-oss (FC2 K 2880, 256 rows per expert) 459.4-461.2 / 442.4-444.6 / 437.3-450.4
#: TFLOP/s against 436.8-439.9 / 426.9-427.6 / 398.0-407.4 cooperative, Nemotron (FC1 K 2688, 384 rows)
#: 480.6-484.3 / 463.5-466.1 / 473.4-478.8 against 456.9-460.5 / 445.9-447.5 / 455.8-457.5 -- while the
#: clustered DeepSeek-V4 shard's FC2 (K 2048, 1536 rows) was level (per call 598-601 against 609-632,
#: back to back 608-612 against 582-596, graph 513-566 against 491-524). So :func:`pingpong_bound` takes
#: 1920 only when :func:`use_bf16_cluster` would cluster the cooperative kernel.
PINGPONG_MAX_K_H100 = 1920
#: the pingpong tile's width: a warpgroup holds the whole 128 x 192 fp32 accumulator (the drop's
#: limit; 128-wide tiles: Qwen3's FC2 0.386 ms, slower than cooperative 128 x 256)
PINGPONG_TILE_N = 192
#: the gated GEMM's pingpong tile width under ``MOE_EP_GATED_PINGPONG=1`` (two 128 x 96 fp32
#: accumulators per warpgroup: 192 registers, the same budget as FC2's 128 x 192)
GATED_PINGPONG_TILE_N = 96
#: mean rows per expert (at the layer's capacity, uniform routing) up to which a GEMM runs the
#: swap-AB kernel: the weight rows fill the 64-row WGMMA side and the few tokens sit in N, so
#: decode streams weights instead of padding 128-row tiles (H200, both GEMMs of Qwen3 and
#: Mixtral: 1.05-1.8x the 128-row kernel from 1 to 32 rows per expert; at 64 rows per expert
#: (Mixtral, 256 tokens) it is 0.79x, so the 128-row kernel takes over there)
SWAPAB_MAX_ROWS_PER_EXPERT = 32
#: the swap-AB kernel's token tiles (its WGMMA N)
SWAPAB_TILE_T = (8, 16, 32, 64)


def pingpong_bound(device_name: str | None = None, rows_per_expert: float | None = None) -> int:
    """The shim's measured pingpong bound for ``device_name`` (``torch.cuda.get_device_name``; None,
    an unknown GPU, takes the H200's) and ``rows_per_expert`` (the mean rows per expert expected at
    capacity; None = many): :data:`PINGPONG_MAX_K_H100` on an H100 (:func:`gpu_named`) where the
    cooperative kernel that would replace pingpong runs in clusters (:func:`use_bf16_cluster`), else
    :data:`PINGPONG_MAX_K` -- on an H100 the cooperative kernel beat pingpong above K 1920 only in
    clusters (the measurements above :data:`PINGPONG_MAX_K_H100`)."""
    clustered = use_bf16_cluster("cooperative", gated=False, rows_per_expert=rows_per_expert,
                                 device_name=device_name) > 1
    return PINGPONG_MAX_K_H100 if gpu_named(device_name, ("H100",)) and clustered else PINGPONG_MAX_K


def pick_schedule(activation: str, k: int, rows_per_expert: float | None = None,
                  device_name: str | None = None) -> tuple[str, int]:
    """(schedule, tile) for a GEMM, from static values only (never from routing):

    * ``swapab`` when ``rows_per_expert`` (the mean rows per expert at the layer's capacity) is at
      most :data:`SWAPAB_MAX_ROWS_PER_EXPERT`; its token tile is the smallest of
      :data:`SWAPAB_TILE_T` holding twice the mean, so most experts need one tile;
    * ``pingpong`` with :data:`PINGPONG_TILE_N`-wide tiles for the non-gated GEMMs with K <=
      :func:`pingpong_max_k` (short mainloops, where one warpgroup's epilogue overlapping the
      other's mainloop pays; the bound is per GPU and rows, :func:`pingpong_bound`);
    * ``pingpong`` with :data:`GATED_PINGPONG_TILE_N`-wide tiles for the gated GEMMs (FC1) when
      ``MOE_EP_GATED_PINGPONG=1`` (:func:`use_gated_pingpong`; opt-in);
    * ``wide`` for the gated GEMMs (FC1) with the drop's 128-wide tile when
      ``MOE_EP_WIDE_GATED=1`` (:func:`use_wide_gated`; opt-in: no faster on the H200);
    * else ``cooperative`` with the drop's default tile."""
    if rows_per_expert is not None and rows_per_expert <= SWAPAB_MAX_ROWS_PER_EXPERT:
        tile_t = next((t for t in SWAPAB_TILE_T if t >= 2 * rows_per_expert), SWAPAB_TILE_T[-1])
        return "swapab", tile_t
    if activation not in GEMM_GATED and k <= pingpong_max_k(pingpong_bound(device_name, rows_per_expert)):
        return "pingpong", PINGPONG_TILE_N
    if activation in GEMM_GATED and use_gated_pingpong():
        return "pingpong", GATED_PINGPONG_TILE_N
    tile = _C["DEFAULT_TILE_N"][activation]
    if activation in GEMM_GATED and tile <= 128 and use_wide_gated():
        return "wide", tile
    return "cooperative", tile


@dataclass(frozen=True)
class GemmKey:
    """Every value the compiled grouped GEMM depends on."""

    drop_version: int
    abi_version: int
    cutlass_version: str
    arch: str
    dtype: str
    activation: str
    n: int
    k: int
    num_experts: int
    scale_rows: bool
    tile_n: int
    bias_dtype: str | None
    raster_m: int
    swiglu_alpha: float
    swiglu_limit: float
    schedule: str
    tvm_ffi: bool
    early_weights: bool = False
    gather_a: bool = False
    cluster_m: int = 1
    tanh_sigmoid: bool = False
    cluster_n: int = 1
    jump_stages: bool = False
    swiglu_beta: float = 0.0  # clamped_swiglu's beta (drop v99); 0.0 for the other activations
    swiglu_limit_after_act: bool = False  # clamped_swiglu's gate clamped after the activation (drop v102)
    gate_softcap: float = 0.0  # softcapped_swiglu's caps (drop v103); 0.0 for the other activations
    up_softcap: float = 0.0
    box_rows: int = 0  # a partial m-tile's A in boxes of this many rows, the rest zero fill (drop v111)
    handoff: str = ""  # "publish" (FC1) / "await" (FC2): FC2 inside FC1's last wave (drop v112)


class GroupedGemm:
    """A launcher of the compiled grouped GEMM, owned by one caller (a layer).

    ``gemm(a [M, k] bf16, b [E, n, k] bf16, offsets [E+1] int32 (device), out [M, n_out] bf16,
    row_scale [M] f32 (only when compiled with scale_rows), bias [E, n] (only when compiled with
    a bias dtype, of that dtype))``; ``n_out`` = n/2 for the gated activations. A gathering
    (``gather_a``) GEMM takes the source rows as ``a`` and ``idx`` [M] int32. TVM-FFI kernels
    take the torch tensors as they are; on the classic path the converted (CuTe) arguments of
    the last call are kept, so a layer passing the same persistent buffers converts nothing per
    forward (they die with the launcher).
    """

    def __init__(self, compiled: Any, to_cute_args: Any, device: Any) -> None:
        import torch

        self.compiled = compiled
        self.scale_rows = compiled.scale_rows
        self.bias_dtype = compiled.bias_dtype
        self.n_out = compiled.n_out
        self.tvm_ffi = compiled.tvm_ffi
        self.gather_a = compiled.gather_a
        self.handoff = getattr(compiled, "handoff", "")  # drop v112: "publish" / "await" / ""
        self._to = to_cute_args
        self._last: tuple | None = None
        # unread arguments of variants without a row scale / bias (the drop's signature: fp32
        # [L] and fp32 [1, L]); owned here, never by the compile cache
        self._dummy_scale = torch.zeros(1, dtype=torch.float32, device=device)
        self._dummy_bias = torch.zeros(1, 8, dtype=torch.float32, device=device)
        self._ctas = _num_sms(device)

    def grid_ctas(self, max_active_ctas=None) -> int:
        """The CTAs a launch with ``max_active_ctas`` (None: one per SM) runs: an awaiting FC2's
        ``publishers`` (drop v112)."""
        return self.compiled.grid_ctas(max_active_ctas=max_active_ctas or self._ctas)

    def __call__(self, a, b, offsets, out, row_scale=None, max_active_ctas=None, stream=None, bias=None,
                 idx=None, sync=None, publishers=None):
        if self.gather_a != (idx is not None):
            raise ValueError("a gathering grouped GEMM takes idx (grouped row r = a[idx[r]]); any other refuses it")
        if a.shape[0] == 0:
            return out
        if self.scale_rows:
            if row_scale is None:
                raise ValueError("this grouped GEMM was compiled with scale_rows=True: pass row_scale")
        else:
            row_scale = self._dummy_scale
        if self.bias_dtype is not None:
            if bias is None:
                raise ValueError(f"this grouped GEMM was compiled with a {self.bias_dtype} bias: pass bias")
        elif bias is not None:
            raise ValueError("this grouped GEMM was compiled without a bias: bias must be None")
        else:
            bias = self._dummy_bias
        if bool(self.handoff) != (sync is not None) or (self.handoff == "await") != (publishers is not None):
            raise ValueError(f"this grouped GEMM's handoff is {self.handoff or 'none'!r}: sync goes with 'publish' "
                             "and 'await', publishers (FC1's CTAs) with 'await' only")
        hand = {} if sync is None else {"sync": sync}
        if self.tvm_ffi:
            self.compiled.launch_tensors(a=a, b=b, c=out, offsets=offsets, row_scale=row_scale, bias=bias,
                                         max_active_ctas=max_active_ctas or self._ctas, stream=stream, idx=idx,
                                         publishers=publishers, **hand)
            return out
        ts = (a, b, out, offsets, row_scale, bias) + (() if idx is None else (idx,)) + (() if sync is None else (sync,))
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in ts)
        if self._last is None or self._last[0] != key:
            self._last = (key, self._to(a=a, b=b, c=out, offsets=offsets, row_scale=row_scale, bias=bias, idx=idx,
                                        **hand), ts)
        self.compiled.launch_converted(args=self._last[1], max_active_ctas=max_active_ctas or self._ctas,
                                       stream=stream, publishers=publishers)
        return out

    def prepare(self, a, offsets, out, row_scale=None, max_active_ctas=None, idx=None, sync=None, publishers=None):
        """``self(a, b, offsets, out, row_scale, max_active_ctas, bias=bias, idx=idx)``
        with all but the weights (and the bias, when compiled with one) fixed: ``run(b, bias=None)``,
        the same launch. A gathering GEMM may leave its source rows to each call
        (``a=None``: ``run(b, bias=None, a=x)``). TVM-FFI kernels check and pack the fixed tensors
        once (the drop's ``CompiledGroupedGemm.prepare``, with this launcher's placeholders); the
        classic path calls this launcher (its converted arguments are cached anyway). The fixed
        tensors must keep their shapes while ``run`` is used. ``sync`` / ``publishers``: a handoff GEMM's
        (drop v112), fixed too."""
        if self.gather_a != (idx is not None):
            raise ValueError("a gathering grouped GEMM takes idx (grouped row r = a[idx[r]]); any other refuses it")
        if self.scale_rows and row_scale is None:
            raise ValueError("this grouped GEMM was compiled with scale_rows=True: pass row_scale")
        ctas = max_active_ctas or self._ctas
        hand = {} if sync is None else {"sync": sync, "publishers": publishers}
        if a is None:  # the source rows per call
            if not self.tvm_ffi:
                def run_rows_plain(b, bias=None, a=None):
                    self(a, b, offsets, out, row_scale, ctas, bias=bias, idx=idx, **hand)
                return run_rows_plain
        elif not self.tvm_ffi or a.shape[0] == 0:  # (no rows: __call__ launches nothing)
            def run_plain(b, bias=None):
                self(a, b, offsets, out, row_scale, ctas, bias=bias, idx=idx, **hand)
            return run_plain
        return self.compiled.prepare(a=a, out=out, offsets=offsets,
                                     row_scale=row_scale if self.scale_rows else self._dummy_scale,
                                     bias=None if self.bias_dtype is not None else self._dummy_bias,
                                     max_active_ctas=ctas, idx=idx, **hand)

    def release(self) -> None:
        """Drop the cached converted arguments (they keep the last tensors alive, e.g. the
        throw-away weights of a warm-up); the next call converts again."""
        self._last = None


def _bias_name(bias_dtype: Any) -> str | None:
    """None / torch dtype / name -> the drop's bias dtype name (or ValueError)."""
    if bias_dtype is None:
        return None
    name = str(bias_dtype).replace("torch.", "")
    if name not in GEMM_BIAS_DTYPES:
        raise ValueError(f"sm90 grouped GEMM: bias dtype {bias_dtype} not in {GEMM_BIAS_DTYPES}")
    return name


def build_grouped_gemm(key: GemmKey) -> Any:
    """The compiled GEMM of ``key`` from the disk cache, else compiled (and stored): the compile
    step of :func:`compiled_grouped_gemm`, and of a cache rebuilt from a manifest (``kernel_replay``)."""
    launch = _load("sm90_megamoe.launch")
    kw = dict(activation=key.activation, n=key.n, k=key.k, num_experts=key.num_experts, scale_rows=key.scale_rows,
              tile_n=key.tile_n, bias_dtype=key.bias_dtype, raster_m=key.raster_m, schedule=key.schedule,
              tvm_ffi=key.tvm_ffi)
    if key.early_weights:
        kw.update(early_weights=True)
    if key.gather_a:
        kw.update(gather_a=True)
    if key.cluster_m > 1:
        kw.update(cluster_m=key.cluster_m)
    if key.cluster_n > 1:
        kw.update(cluster_n=key.cluster_n)
    if key.tanh_sigmoid:
        kw.update(tanh_sigmoid=True)
    if key.jump_stages:
        kw.update(jump_stages=True)
    if key.box_rows:
        kw.update(box_rows=key.box_rows)
    if key.handoff:
        kw.update(handoff=key.handoff)
    if key.activation == "clamped_swiglu":
        kw.update(swiglu_alpha=key.swiglu_alpha, swiglu_limit=key.swiglu_limit, swiglu_beta=key.swiglu_beta)
        if key.swiglu_limit_after_act:
            kw.update(swiglu_limit_after_act=True)
    if key.activation == "softcapped_swiglu":
        kw.update(gate_softcap=key.gate_softcap, up_softcap=key.up_softcap)
    name = (f"gemm_{key.activation}" + ("_gather" if key.gather_a else "")
            + ("_cluster2" if key.cluster_m > 1 else "") + ("_clustern2" if key.cluster_n > 1 else "")
            + ("_js" if key.jump_stages else "") + (f"_bt{key.box_rows}" if key.box_rows else "")
            + ({"publish": "_hp", "await": "_ha"}.get(key.handoff, ""))
            + ("_tanh" if key.tanh_sigmoid else ""))
    fn = disk_cache.get_or_build(cache_namespace(), name, key,
                                 lambda: launch.CompiledGroupedGemm(**kw).compiled, tvm_ffi=key.tvm_ffi)
    return launch.CompiledGroupedGemm(**kw, compiled=fn)


def compiled_grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                          tile_n: int | None = None, bias_dtype: Any = None, raster_m: int | None = None,
                          swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                          schedule: str | None = None, rows_per_expert: float | None = None,
                          early_weights: bool = False, gather_a: bool = False,
                          device_name: str | None = None, swiglu_beta: float = 1.0,
                          swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
                          up_softcap: float = 25.0, handoff: str = "") -> Any:
    """The compiled grouped GEMM from the compile cache (compiled code only, no buffers).
    ``schedule``/``tile_n`` None: :func:`pick_schedule` (``rows_per_expert``: the mean rows per
    expert the caller expects at capacity; None = many, the prefill kernels). ``early_weights``:
    the caller guarantees ``offsets``/``row_scale`` were written >= 2 launches earlier (FC2), so
    a swap-AB kernel may prefetch its weights before the PDL wait; it takes effect only for the
    swap-AB schedule with PDL launches (:func:`pdl_launches`), else the plain kernel is used.
    ``gather_a`` (drop v23; cooperative / wide, K % 64 == 0): A is the source rows and a call
    passes ``idx`` (grouped row r = ``a[idx[r]]``). (Drop v94 removed v91's ``place_a``.)
    ``device_name``: the GPU it will run on (``torch.cuda.get_device_name``; None = unknown, e.g. a
    CPU prebuild), for choices measured per GPU (:func:`use_bf16_cluster`). ``handoff`` (drop v112,
    :func:`use_fc2_early`): "publish" for a layer's FC1, "await" for its FC2 (FC2 inside FC1's last wave);
    the swap-AB schedule takes neither (no last wave to fill) and returns the plain kernel."""
    check_gemm_shapes(activation, n, k, num_experts, tile_n)
    check_removed()  # a switch of a removed variant, still set, raises here
    if schedule is None:
        schedule, picked_tile = pick_schedule(activation, k, rows_per_expert, device_name)
        tile = tile_n or picked_tile
    elif schedule not in SCHEDULES:
        raise ValueError(f"sm90 grouped GEMM: schedule {schedule!r} not in {SCHEDULES}")
    else:
        tile = tile_n or {"pingpong": 128, "swapab": 32}.get(schedule, _C["DEFAULT_TILE_N"][activation])
    bias = _bias_name(bias_dtype)
    raster = pick_raster_m(k) if raster_m is None else int(raster_m)
    if not 1 <= raster <= _C["MAX_RASTER_M"]:
        raise ValueError(f"sm90 grouped GEMM: raster_m={raster} not in [1, {_C['MAX_RASTER_M']}]")
    clamped = activation == "clamped_swiglu"
    alpha, limit, beta = (float(swiglu_alpha), float(swiglu_limit), float(swiglu_beta)) if clamped else (0.0, 0.0, 0.0)
    after_act = clamped and bool(swiglu_limit_after_act)
    softcaps = (float(gate_softcap), float(up_softcap)) if activation == "softcapped_swiglu" else (0.0, 0.0)
    ffi = use_tvm_ffi()
    early = bool(early_weights) and schedule == "swapab" and pdl_launches()
    if gather_a and schedule == "pingpong" and activation in GEMM_GATED and use_gated_pingpong():
        raise ValueError("sm90 grouped GEMM: MOE_EP_GATED_PINGPONG=1 puts FC1 on the pingpong schedule, which the "
                         "gathering FC1 (MOE_EP_GATHER_FC1=1) cannot run; unset one of the two")
    if gather_a and (schedule not in ("cooperative", "wide") or k % _C["DEFAULT_TILE_K"]):
        raise ValueError(f"sm90 grouped GEMM: gather_a needs the cooperative or wide schedule and K % "
                         f"{_C['DEFAULT_TILE_K']} == 0, got {schedule!r}, K={k}")
    cluster = use_bf16_cluster(schedule, gather_a, gated=activation in GEMM_GATED,
                               rows_per_expert=rows_per_expert, device_name=device_name)
    cluster_n = use_bf16_cluster_n(schedule, activation in GEMM_GATED, gather_a)
    box_rows = use_box_tails(schedule, gather_a, cluster_n)
    handoff = check_handoff(handoff, schedule, gather_a, cluster_n, box_rows)
    key = GemmKey(CONSTANTS.value(PKG, "DROP_VERSION"), _C["ABI_VERSION"], _cutlass_version(), "sm_90a",
                  "bf16", activation, n, k, num_experts, bool(scale_rows), tile, bias, raster, alpha, limit,
                  schedule, ffi, early, bool(gather_a), cluster,
                  use_bf16_tanh_sigmoid(activation),
                  cluster_n, use_jump_stages(schedule), beta, after_act, *softcaps,
                  box_rows=box_rows, handoff=handoff)

    return COMPILE_CACHE.get_or_compile(key, lambda: build_grouped_gemm(key))


def grouped_gemm(activation: str, n: int, k: int, num_experts: int, scale_rows: bool = False,
                 tile_n: int | None = None, device: Any = None, bias_dtype: Any = None,
                 raster_m: int | None = None, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, schedule: str | None = None,
                 rows_per_expert: float | None = None, early_weights: bool = False,
                 gather_a: bool = False, swiglu_beta: float = 1.0,
                 swiglu_limit_after_act: bool = False, gate_softcap: float = 4.0,
                 up_softcap: float = 25.0, handoff: str = "") -> GroupedGemm:
    """A new :class:`GroupedGemm` launcher for ``device`` (default: the current CUDA device).

    ``bias_dtype``: None or torch.float32/bfloat16 (the variant adds ``bias [E, n]``);
    ``raster_m``: None = :func:`pick_raster_m` (k); ``swiglu_*``: clamped_swiglu's constants
    (``swiglu_beta``: drop v99; ``swiglu_limit_after_act``: drop v102); ``*_softcap``:
    softcapped_swiglu's caps (drop v103);
    ``schedule``: "cooperative", "pingpong", "swapab", "wide" or None = :func:`pick_schedule` (with
    ``rows_per_expert``, the mean rows per expert expected at capacity); ``early_weights``,
    ``gather_a``: see :func:`compiled_grouped_gemm`."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    compiled = compiled_grouped_gemm(activation, n, k, num_experts, scale_rows, tile_n, bias_dtype,
                                     raster_m, swiglu_alpha, swiglu_limit, schedule, rows_per_expert,
                                     early_weights, gather_a, device_name=torch.cuda.get_device_name(dev),
                                     swiglu_beta=swiglu_beta, swiglu_limit_after_act=swiglu_limit_after_act,
                                     gate_softcap=gate_softcap, up_softcap=up_softcap, handoff=handoff)
    launch = _load("sm90_megamoe.launch")
    return GroupedGemm(compiled, launch.to_cute_args, dev)


def check_handoff(handoff: str, schedule: str, gather_a: bool, cluster_n: int, box_rows: int) -> str:
    """The handoff role a GEMM of ``schedule`` takes (drop v112): none for swap-AB (no last wave);
    a ValueError naming the switches for what cannot take it."""
    if handoff not in ("", "publish", "await"):
        raise ValueError(f"sm90 grouped GEMM: handoff must be '', 'publish' or 'await', got {handoff!r}")
    if not handoff or schedule == "swapab":
        return ""
    if gather_a or box_rows:
        raise ValueError("sm90 grouped GEMM: MOE_EP_FC2_EARLY=1 does not combine with MOE_EP_GATHER_FC1=1 or "
                         "MOE_EP_BOX_TAILS; unset one of them")
    if handoff == "publish" and (schedule not in ("cooperative", "wide") or cluster_n > 1):
        raise ValueError(f"sm90 grouped GEMM: MOE_EP_FC2_EARLY=1 needs FC1 on the cooperative or wide schedule "
                         f"without MOE_EP_BF16_CLUSTER_N, got {schedule!r} (MOE_EP_GATED_PINGPONG=1?); unset one")
    return handoff


def handoff_sync_len(rows: int, num_experts: int) -> int:
    """Length of the int32 sync buffer that a publishing FC1 and its awaiting FC2 share (drop v112) for
    calls of at most ``rows`` grouped rows over ``num_experts`` experts: one pending count per m-tile
    slot, then the drop's tail (mirrored ``HANDOFF_SYNC_TAIL``; its last word is the error word)."""
    return _m_tile_slots(rows, num_experts) + CONSTANTS.value("sm90_megamoe.grouped_gemm_handoff", "HANDOFF_SYNC_TAIL")


def place_sync_len(rows: int, num_experts: int) -> int:
    """Length of a placing FC1's ``sync`` buffer (int32; the FP8 copying FC1's, drop v92) for calls
    of at most ``rows`` grouped rows over ``num_experts`` experts: one ready counter per m-tile such
    rows can take, then the drop's tail slots (claim, done, finished, error word; mirrored
    ``PLACE_SYNC_TAIL``)."""
    return _m_tile_slots(rows, num_experts) + CONSTANTS.value("sm90_megamoe.placing_producer", "PLACE_SYNC_TAIL")


def _m_tile_slots(rows: int, num_experts: int) -> int:
    """Counters a sync buffer holds per call of at most ``rows`` grouped rows over ``num_experts``
    experts: the m-tiles such rows can take (each expert's last one may be partial)."""
    return (int(rows) + _C["DEFAULT_TILE_M"] - 1) // _C["DEFAULT_TILE_M"] + int(num_experts)


def compile_gemm_ptx(activation: str, n: int, k: int, scale_rows: bool, arch: str = "sm_90a",
                     num_experts: int = 128, bias_dtype: Any = None, raster_m: int | None = None) -> str:
    """Compile without a GPU (fake tensors, dynamic M_total) and return the PTX text (compiler
    artifacts go to a temporary folder, never the working directory)."""
    check_gemm_shapes(activation, n, k, num_experts)
    cc = _load("sm90_megamoe.compile_check")
    raster = pick_raster_m(k) if raster_m is None else int(raster_m)
    with tempfile.TemporaryDirectory(prefix="moe_ep_ptx_") as d:
        compiled = cc.compile_for_arch(activation=activation, n=n, k=k, scale_rows=scale_rows, arch=arch,
                                       num_experts=num_experts, tile_n=None, extra_options=f"--dump-dir={d}",
                                       bias_dtype=_bias_name(bias_dtype), raster_m=raster)
        return compiled.__ptx__


#: tail-clean: the GEMMs keep no state between launches, except the FP8 copying FC1's ``sync``
#: buffer (drop v92, :func:`place_sync_len`), which the grid's last TMA warp and last copy warp zero
#: before the kernel ends (tests/test_fp8_place.py: clean after consecutive launches)
GEMM_COUNTERS = CounterContract("sm90_megamoe grouped GEMM", tail_clean=True)
EP_COUNTERS = CounterContract("sm90_megamoe EP dispatch/combine", tail_clean=True)
LAYOUT_COUNTERS = CounterContract("sm90_megamoe expert layout (stateless)", tail_clean=True)

# the EP and expert-layout wrappers live in sm90_megamoe_ep / sm90_megamoe_layout (file length);
# re-exported here (after the names those modules import from here)
from .sm90_megamoe_ep import (  # noqa: E402,F401
    LOCAL_COMBINE_CTAS_PER_SM,
    SYMMETRIC,
    BufferSpec,
    EpKey,
    EpSession,
    check_ep_shapes,
    compile_ep_ptx,
    ep_buffer_specs,
    new_verr,
    prebuild_ep,
)
from .sm90_megamoe_layout import (  # noqa: E402,F401  (after the names that module imports from here)
    LAYOUT_CHUNK_TIERS,
    LAYOUT_TOKENS_PER_CHUNK,
    LayoutKey,
    LayoutSession,
    layout_chunks_for,
    layout_counts_len,
    prebuild_layout,
)
