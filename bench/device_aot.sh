#!/usr/bin/env bash
# Fill .device/aot (git-ignored) with the compiled kernels the next H200 calls need, on this CPU
# machine, so the device's minutes are not spent compiling: the defaults of the BF16 (qwen3,
# mixtral, nemotron, dsv3_shard, gpt_oss, dsv4_shard, inkling2_shard, gemma4) and FP8 (qwen3, mixtral, dsv4_shard,
# inkling2_shard, dsv3_shard) layers at
# 8192 tokens, plus the GEMMs of the opt-in switches queued for the H200 (docs/PERFORMANCE.md,
# newest entry). Carry it with run(..., carry=[".device/b", ".device/aot"]) and export
# MOE_EP_CACHE_DIR=$PWD/.device/aot there.
#   bash bench/device_aot.sh          # rebuild from scratch (after a drop version or key change)
#   bash bench/device_aot.sh slim     # .device/aotq instead: Qwen3 and Mixtral only, BF16 and FP8, at 128,
#                                     # 256 and 8192 tokens (~5 MB): fits one carry with .device/b and
#                                     # .device/fi (the full one does not: 43 + 14 + 9 MB > 64 MiB)
#   bash bench/device_aot.sh suite    # .device/suitecache/kernels.tgz: the kernels bench/suite_kernels.json lists (the GPU
#                                     # suite's at its last GPU run), for `h200_session.sh suite` (carry .device/suitecache)
#   bash bench/device_aot.sh pair     # .device/aotp: Qwen3 and Mixtral at 8192 tokens, BF16 and FP8 only (~2.1 MB):
#                                     # the layers `h200_session.sh all` times, with room beside .device/b and
#                                     # .device/fi for the tree (the slim one was refused with them in the 64th session)
set -euo pipefail
cd "$(dirname "$0")/.."
aot() {  # aot OUT TOKENS ARGS...: one `moe_ep.aot build` for sm_90a, its per-kernel lines left out
  local out=$1 tokens=$2; shift 2
  python -m moe_ep.aot build --arch sm_90a --max-tokens "$tokens" --out "$out" "$@" | grep -v '^  '
}
pair_layers() {  # pair_layers OUT: Qwen3's and Mixtral's default BF16 and FP8 layers at 8192 tokens
  aot "$1" 8192 --model qwen3,mixtral
  aot "$1" 8192 --model qwen3,mixtral --quant fp8_block128
}
if [ "${1:-}" = suite ]; then
  # .device/suitecache/kernels.tgz: every kernel bench/suite_kernels.json lists (the GPU suite's cache at its last
  # GPU run, keys only), compiled here with this checkout's drops; `h200_session.sh suite` seeds its cache from it
  [ -f bench/suite_kernels.json ] || { echo "device_aot.sh suite: no bench/suite_kernels.json yet (a GPU suite run writes it)" >&2; exit 2; }
  out=.device/suitecache
  rm -rf "$out" && mkdir -p "$out/kernels"
  rc=0
  python -m moe_ep.aot replay bench/suite_kernels.json --out "$out/kernels" --jobs "${JOBS:-2}" | grep -v '^  ' || rc=$?
  tar czf "$out/kernels.tgz" -C "$out/kernels" . && rm -rf "$out/kernels"
  du -sh "$out/kernels.tgz"
  exit $rc
fi
if [ "${1:-}" = pair ]; then
  out=.device/aotp
  rm -rf "$out"
  pair_layers "$out"
  du -sh "$out"
  exit 0
fi
if [ "${1:-}" = slim ]; then
  out=.device/aotq
  rm -rf "$out"
  pair_layers "$out"
  for t in 128 256; do aot "$out" "$t" --model qwen3,mixtral; done
  # drop v112's FC2 inside FC1's last wave (MOE_EP_FC2_EARLY=1): Qwen3's and Mixtral's pair, the H200's
  # and the H100's picks
  MOE_EP_FC2_EARLY=1 aot "$out" 8192 --model qwen3,mixtral --kernels fc1,fc2
  MOE_EP_FC2_EARLY=1 aot "$out" 8192 --model qwen3,mixtral --kernels fc1,fc2 --gpu "NVIDIA H100 80GB HBM3"
  du -sh "$out"
  exit 0
fi
out=.device/aot
rm -rf "$out"
build() { aot "$out" 8192 "$@"; }
build --model qwen3,mixtral,nemotron,dsv3_shard,gpt_oss,dsv4_shard,inkling2_shard,gemma4
build --model qwen3,mixtral,dsv4_shard,inkling2_shard,dsv3_shard --quant fp8_block128
# the queued switches (their GEMMs only; everything else is the defaults' above)
MOE_EP_GATHER_FC1=1 build --model qwen3,mixtral --kernels fc1
MOE_EP_FP8_PLACE_FC1=copy build --model qwen3,mixtral --quant fp8_block128 --kernels fc1
# the other arm of the cluster A/Bs (`ENVAB="|MOE_EP_BF16_CLUSTER=0"`, h200_session.sh gemmab): single CTAs.
# Since the 53rd session the defaults above (the H200's picks) cluster every cooperative BF16 GEMM, so
# MOE_EP_BF16_CLUSTER=1 would only rebuild them. Mixtral's L2 raster groups of 8 and 16 m-tiles are below.
MOE_EP_BF16_CLUSTER=0 build --model mixtral,qwen3,dsv3_shard --kernels fc1,fc2
# an H100's own picks: clusters as on the H200, and since the 53rd session the clustered non-gated GEMMs
# from K 2048 cooperative instead of pingpong (the DeepSeek and Inkling2 shards' FC2s; since the 54th not
# Nemotron's FC1 or gpt-oss's FC2, whose single-CTA cooperative kernels lost: they stay pingpong)
build --model mixtral,qwen3,nemotron,dsv3_shard,gpt_oss,dsv4_shard,inkling2_shard,gemma4 --kernels fc1,fc2 \
  --gpu "NVIDIA H100 80GB HBM3"
MOE_EP_CACHE_DIR="$out" python - <<'PY'
from moe_ep.shim import sm90_compiled_grouped_gemm as gemm
for raster in (8, 16):
    gemm("swiglu", 28672, 4096, 8, raster_m=raster)  # FC1
    gemm("identity", 4096, 14336, 8, scale_rows=True, raster_m=raster)  # FC2
PY
du -sh "$out"
