#!/usr/bin/env bash
# Everything the multi-GPU issue needs from one H200 host with N GPUs, in one command, logs under
# ${OUT:-./multi_gpu_logs}. Run from the repository root on the GPU host, after the environment is
# set up (on this workplace's device machines: `source .device/b/env.sh && bash bench/multi_gpu_run.sh`).
# LigerCute runs separately (it owns its NVSHMEM runtime and needs its own staged environment):
#   source .device/liger/env.sh && torchrun --nproc_per_node=$N liger_bench.py --model qwen3 --tokens 8192
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
N=${N:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
LOG=${OUT:-./multi_gpu_logs}
mkdir -p "$LOG"
echo "GPUs: $N; logs in $LOG"
run() { local name=$1; shift; echo "== $name: $*"; timeout "${STEP_TIMEOUT:-900}" "$@" > "$LOG/$name.log" 2>&1; echo "   exit $? ($(tail -n 1 "$LOG/$name.log"))"; }
run tests_multi python3 -m pytest -q -m "gpu_$N" tests/test_ep_gpu.py
for model in qwen3 mixtral; do
  for T in 8192 128; do
    run "bench_${model}_${T}" torchrun --standalone --nproc_per_node="$N" -m moe_ep.bench --model "$model" \
        --tokens "$T" --quiet $([ "$T" = 128 ] && echo --no-decode)
  done
done
grep -h -A12 "^backend" "$LOG"/bench_*.log | head -120
