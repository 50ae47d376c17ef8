#!/usr/bin/env bash
# Fill .device/aot (git-ignored) with the compiled kernels the next H200 calls need, on this CPU
# machine, so the device's minutes are not spent compiling: the defaults of the BF16 (qwen3,
# mixtral, nemotron) and FP8 (qwen3, mixtral) layers at 8192 tokens, plus the GEMMs of the opt-in
# switches queued for the H200 (docs/PERFORMANCE.md, newest entry). Carry it with
# run(..., carry=[".device/b", ".device/aot"]) and export MOE_EP_CACHE_DIR=$PWD/.device/aot there.
#   bash bench/device_aot.sh          # rebuild from scratch (after a drop version or key change)
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device/aot
rm -rf "$out"
build() { python -m moe_ep.aot build --arch sm_90a --max-tokens 8192 --out "$out" "$@" | grep -v '^  '; }
build --model qwen3,mixtral,nemotron
build --model qwen3,mixtral --quant fp8_block128
# the queued switches (their GEMMs only; everything else is the defaults' above)
MOE_EP_GATHER_FC1=1 build --model qwen3,mixtral --kernels fc1
MOE_EP_FP8_PLACE_FC1=copy build --model qwen3,mixtral --quant fp8_block128 --kernels fc1
du -sh "$out"
