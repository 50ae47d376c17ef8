#!/usr/bin/env bash
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*" | tee -a $O/times.txt; }
el "commit $(cat .gpu/COMMIT)"
timeout -k 10 120 python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider tests/test_layer_gpu.py -k "layout_chunks" --tb=long > $O/bits.log 2>&1; el "bits rc=$?"; tail -2 $O/bits.log
for c in "" 32 16 8 4 "" 8; do
  tag=c${c:-all}; [ -f $O/decode_$tag.csv ] && tag=${tag}_b
  MOE_EP_LAYOUT_CHUNKS=$c timeout -k 10 100 python3 -m moe_ep.bench --model qwen3 --tokens 128 --iters 50 --no-reference \
    --quiet --decode-tokens 1,8,32,128,256 --decode-csv $O/decode_$tag.csv > $O/decode_$tag.log 2>&1; el "$tag rc=$?"
  cut -d, -f4-6 $O/decode_$tag.csv | tr '\n' ' '; echo
done
for c in "" 8; do for t in 128 1; do
  MOE_EP_LAYOUT_CHUNKS=$c timeout -k 10 100 python3 -m moe_ep.bench --model qwen3 --tokens $t --iters 30 --no-reference \
    --no-decode --profile > $O/profile_c${c:-all}_t$t.log 2>&1; el "profile c${c:-all} t$t rc=$?"
done; done
el "FlashInfer decode"
timeout -k 10 240 bash -c 'source .device/fi/pkg/setup.sh || exit 3; exec python3 -m moe_ep.bench --model qwen3,mixtral --tokens 128 \
  --iters 30 --peers-only --peer-nproc 1 --peer-timeout 200 --peer-log-dir '$O' --peer flashinfer --peer-script-fi .device/fi/bench_fi.py \
  --peer-decode-tokens 1,8,32,128,256 --decode-csv '$O'/decode_fi.csv' > $O/decode_fi.log 2>&1; el "fi rc=$?"
cat $O/decode_fi.csv
