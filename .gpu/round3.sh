#!/usr/bin/env bash
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r3; mkdir -p $O $R
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*" | tee -a $R/times.txt; }
fin() { tar czf $O/r3.tgz -C /tmp r3; }
trap fin EXIT
el "commit $(cat .gpu/COMMIT)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout -k 10 120 python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider tests/test_layer_gpu.py -k "layout_chunks" --tb=long > $R/bits.log 2>&1; el "bits rc=$?"; tail -2 $R/bits.log
timeout -k 10 120 python3 -m moe_ep.bench --model qwen3,mixtral --tokens 128 --iters 50 --no-reference --quiet \
  --decode-csv $R/decode.csv --plot $R/decode.png > $R/decode.log 2>&1; el "decode rc=$?"; cut -d, -f1,4-6 $R/decode.csv
SM90_MEGAMOE_PDL=1 timeout -k 10 100 python3 -m moe_ep.bench --model qwen3 --tokens 128 --iters 50 --no-reference --quiet \
  --decode-tokens 1,8,128 --decode-csv $R/decode_pdl.csv > $R/decode_pdl.log 2>&1; el "decode pdl rc=$?"; cut -d, -f4-6 $R/decode_pdl.csv
timeout -k 10 100 python3 -m moe_ep.bench --model qwen3,mixtral --tokens 128 --iters 50 --quant fp8_block128 --no-reference --quiet \
  --decode-tokens 1,8,128 --decode-csv $R/decode_fp8.csv > $R/decode_fp8.log 2>&1; el "decode fp8 rc=$?"; cut -d, -f1,4-6 $R/decode_fp8.csv
left=$(( 575 - ($(date +%s) - t0) ))
el "gpu suite, ${left}s"
timeout -k 5 $left python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider -rfE --durations=20 --tb=long \
  tests/test_layer_gpu.py tests/test_fp8_backend.py tests/test_activations_bias.py tests/test_sm90_gpu.py tests/test_ep_gpu.py \
  tests/test_disk_cache.py tests/test_transformers_integration.py tests/test_sm90_fp8_quant.py tests/test_sm90_fp8_compile.py \
  tests/test_sm90_swapab_compile.py tests/test_blackwell_backends.py tests/test_ep_virtual_gpu.py > $R/suite.log 2>&1; el "suite rc=$?"
tail -30 $R/suite.log
