#!/usr/bin/env bash
# session-6 GPU round 1: decode sweep (decision data) first, then the bit tests, then PDL virtual-rank tests
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*" | tee -a $O/times.txt; }
git_commit=$(cat .gpu/COMMIT 2>/dev/null); echo "commit $git_commit" > $O/times.txt
for v in "0 0 " "0 1 " "0 1 32" "1 1 32" "1 0 "; do
  set -- $v; tag="p$1g$2c${3:-all}"
  el "start $tag"
  SM90_MEGAMOE_PDL=$1 MOE_EP_TOKEN_GRID=$2 MOE_EP_LAYOUT_CHUNKS=${3:-} timeout -k 10 150 python3 -m moe_ep.bench \
    --model qwen3,mixtral --tokens 128 --iters 50 --no-reference --quiet --decode-tokens 1,8,128 \
    --decode-csv $O/decode_$tag.csv > $O/decode_$tag.log 2>&1; el "end $tag rc=$?"
  grep -E "graph|eager" $O/decode_$tag.log | tail -8
done
el "bit tests"
timeout -k 10 150 python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider tests/test_layer_gpu.py -k "layout_chunks or token_grid" --tb=long > $O/bits.log 2>&1; el "bits rc=$?"; tail -3 $O/bits.log
el "virtual PDL"
SM90_MEGAMOE_PDL=1 timeout -k 10 $(( 570 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider tests/test_ep_virtual_gpu.py --tb=long -x > $O/virt_pdl.log 2>&1; el "virt rc=$?"; tail -5 $O/virt_pdl.log
