"""moe_ep.shim: the only code that imports kernel drops.

Public surface (``__all__``) used by :mod:`moe_ep.backends`:

* drop path setup with a collision guard (:func:`register_drop`, :func:`drop_src`);
* the compile cache (:data:`COMPILE_CACHE`, :func:`ensure_not_capturing`);
* mirrored ABI constants (:class:`MirroredConstants`) and per-drop contracts
  (:class:`DropContract`, :func:`drop_contracts`);
* NVSHMEM bootstrap (:func:`nvshmem_acquire`, :func:`parse_size` for ``NVSHMEM_SYMMETRIC_SIZE``)
  and the pre-launch counter contract
  (:class:`CounterContract`, :func:`zero_counter_regions`);
* the disk compile cache (:func:`set_compile_cache_dir`, :data:`COMPILE_EVENTS`, ...; see
  :mod:`moe_ep.shim.disk_cache`) and its manifests, replayed on any machine
  (:func:`cache_manifest`, :func:`replay_cache_manifest`; :mod:`moe_ep.shim.kernel_replay`);
* environment switches read by one rule (:func:`env_flag`; :mod:`moe_ep.shim.env`);
* per-drop wrappers (``sm90_*``).
"""

from .cache import COMPILE_CACHE, CompileCache, ensure_not_capturing, is_capturing
from .constants import MirroredConstants
from .disk_cache import EVENTS as COMPILE_EVENTS
from .disk_cache import CacheEvent, CompileCacheWarning
from .disk_cache import cache_root as compile_cache_root
from .disk_cache import list_entries as list_cache_entries
from .disk_cache import set_cache_dir as set_compile_cache_dir
from .disk_cache import verify_entry as verify_cache_entry
from .kernel_replay import manifest as cache_manifest
from .kernel_replay import merge as merge_cache_manifests
from .kernel_replay import read_manifest as read_cache_manifest
from .kernel_replay import replay as replay_cache_manifest
from .kernel_replay import write_manifest as write_cache_manifest
from .contract import AttributeUse, CallableUse, DropContract, ImportUse
from .drops import drop_contracts
from .drops.sm90_megamoe import CONSTANTS as SM90_MEGAMOE_CONSTANTS
from .drops.sm90_megamoe import EP_COUNTERS as SM90_EP_COUNTERS
from .drops.sm90_megamoe import EpSession as Sm90EpSession
from .drops.sm90_megamoe import LAYOUT_MAX_CHUNKS as SM90_LAYOUT_MAX_CHUNKS
from .drops.sm90_megamoe import BufferSpec
from .drops.sm90_megamoe import GroupedGemm as Sm90GroupedGemm
from .drops.sm90_megamoe import LayoutSession as Sm90LayoutSession
from .drops.sm90_megamoe import ep_buffer_specs as sm90_ep_buffer_specs
from .drops.sm90_megamoe import layout_counts_len as sm90_layout_counts_len
from .drops.sm90_megamoe import new_verr as sm90_new_verr
from .drops.sm90_megamoe import check_gemm_shapes as sm90_check_gemm_shapes
from .drops.sm90_megamoe import compile_ep_ptx as sm90_compile_ep_ptx
from .drops.sm90_megamoe import compile_gemm_ptx as sm90_compile_gemm_ptx
from .drops.sm90_megamoe import grouped_gemm as sm90_grouped_gemm
from .drops.sm90_megamoe import pick_raster_m as sm90_pick_raster_m
from .drops.sm90_megamoe import place_sync_len as sm90_place_sync_len
from .drops.sm90_megamoe import handoff_sync_len as sm90_handoff_sync_len
from .drops.sm90_megamoe import use_fc2_early as sm90_use_fc2_early
from .drops.sm90_megamoe import pick_schedule as sm90_pick_schedule
from .drops.sm90_megamoe import SWAPAB_MAX_ROWS_PER_EXPERT as SM90_DECODE_MAX_ROWS_PER_EXPERT
from .drops.sm90_megamoe import cache_namespace as sm90_cache_namespace
from .drops.sm90_megamoe import compiled_grouped_gemm as sm90_compiled_grouped_gemm
from .drops.sm90_megamoe import prebuild_ep as sm90_prebuild_ep
from .drops.sm90_megamoe import prebuild_layout as sm90_prebuild_layout
from .drops.sm90_megamoe import EP_ARCHS as SM90_EP_ARCHS
from .drops.sm90_megamoe_fp8 import check_fp8_gemm as sm90_check_fp8_gemm
from .drops.sm90_megamoe_fp8 import compiled_fp8_gemm as sm90_compiled_fp8_gemm
from .drops.sm90_megamoe_fp8 import compiled_fp8_quantize_rows as sm90_compiled_fp8_quantize_rows
from .drops.sm90_megamoe_fp8 import fp8_gemm as sm90_fp8_gemm
from .drops.sm90_megamoe_fp8 import fp8_quantize_rows as sm90_fp8_quantize_rows
from .drops.sm100_w4a16 import check_gemm as sm100_check_w4a16_gemm
from .drops.sm100_w4a16 import compile_gemm_ptx as sm100_compile_w4a16_ptx
from .drops.sm100_w4a16 import compiled_w4a16_gemm as sm100_compiled_w4a16_gemm
from .drops.sm100_w4a16 import w4a16_gemm as sm100_w4a16_gemm
from .drops.sm120_mxfp8 import check_gemm as sm120_check_mxfp8_gemm
from .drops.sm120_mxfp8 import check_quantize as sm120_check_mxfp8_quantize
from .drops.sm120_mxfp8 import compile_gemm_ptx as sm120_compile_mxfp8_ptx
from .drops.sm120_mxfp8 import compiled_mxfp8_gemm as sm120_compiled_mxfp8_gemm
from .drops.sm120_mxfp8 import compiled_quantize_rows as sm120_compiled_quantize_rows
from .drops.sm120_mxfp8 import mxfp8_gemm as sm120_mxfp8_gemm
from .drops.sm120_mxfp8 import pick_tile_tokens as sm120_pick_tile_tokens
from .drops.sm120_mxfp8 import quantize_rows as sm120_quantize_rows
from .errors import (BackendWarning, BootstrapError, CapacityError, CaptureError, ConstantDriftError,
                     DeviceStallError, DropCollisionError, LaunchPathWarning, MoEError, NvshmemOwnershipError,
                     RoutingValueError, ShimError, StaleHandleError, SymmetricHeapError, UnsupportedBackendError)
from .nvshmem_boot import CounterContract, NvshmemRuntime, parse_size, zero_counter_regions
from .nvshmem_boot import acquire as nvshmem_acquire
from .nvshmem_boot import current as nvshmem_current
from .env import env_choice, env_flag
from .launch_mode import launch_path
from .paths import drop_src, kernel_src_root, register_drop

__all__ = [
    "BackendWarning", "BootstrapError", "CapacityError", "MoEError", "RoutingValueError", "StaleHandleError",
    "SymmetricHeapError", "UnsupportedBackendError", "LaunchPathWarning", "launch_path", "env_flag", "env_choice",
    "AttributeUse", "COMPILE_CACHE", "CallableUse", "CaptureError", "CompileCache", "ConstantDriftError",
    "CounterContract", "DeviceStallError", "DropCollisionError", "DropContract", "ImportUse",
    "MirroredConstants", "NvshmemOwnershipError", "NvshmemRuntime", "ShimError", "drop_contracts",
    "drop_src", "ensure_not_capturing", "is_capturing", "kernel_src_root", "nvshmem_acquire",
    "nvshmem_current", "parse_size", "register_drop", "zero_counter_regions",
    "BufferSpec", "SM90_EP_COUNTERS", "SM90_LAYOUT_MAX_CHUNKS", "SM90_MEGAMOE_CONSTANTS", "Sm90EpSession",
    "Sm90GroupedGemm", "Sm90LayoutSession", "sm90_check_gemm_shapes", "sm90_compile_ep_ptx",
    "sm90_compile_gemm_ptx", "sm90_ep_buffer_specs", "sm90_grouped_gemm", "sm90_layout_counts_len",
    "sm90_new_verr", "sm90_pick_raster_m", "sm90_place_sync_len", "sm90_handoff_sync_len", "sm90_use_fc2_early",
    "sm90_pick_schedule", "SM90_DECODE_MAX_ROWS_PER_EXPERT",
    "COMPILE_EVENTS", "CacheEvent", "CompileCacheWarning", "compile_cache_root", "list_cache_entries",
    "set_compile_cache_dir", "verify_cache_entry", "cache_manifest", "merge_cache_manifests", "read_cache_manifest",
    "replay_cache_manifest", "write_cache_manifest", "sm90_cache_namespace", "sm90_compiled_grouped_gemm",
    "sm90_prebuild_ep", "sm90_prebuild_layout", "SM90_EP_ARCHS", "sm90_check_fp8_gemm", "sm90_compiled_fp8_gemm",
    "sm90_compiled_fp8_quantize_rows", "sm90_fp8_gemm", "sm90_fp8_quantize_rows",
    "sm100_check_w4a16_gemm", "sm100_compile_w4a16_ptx", "sm100_compiled_w4a16_gemm", "sm100_w4a16_gemm",
    "sm120_check_mxfp8_gemm", "sm120_check_mxfp8_quantize", "sm120_compile_mxfp8_ptx",
    "sm120_compiled_mxfp8_gemm", "sm120_compiled_quantize_rows", "sm120_mxfp8_gemm", "sm120_pick_tile_tokens",
    "sm120_quantize_rows",
]
