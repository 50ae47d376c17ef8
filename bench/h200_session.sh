#!/usr/bin/env bash
# One H200 benchmark session: moe_ep next to its peers, same shapes, logs and CSVs under ${OUT:-/tmp/out}.
# Run on the GPU host from the repository root, after the environment is set up:
#
#   source .device/b/env.sh && bash bench/h200_session.sh          # moe_ep, then FlashInfer (carry .device/b, .device/fi)
#   source .device/b/env.sh && bash bench/h200_session.sh liger    # LigerCute only (carry .device/liger: it does
#                                                                  #  not fit in one transfer with .device/b)
#   ... bash bench/h200_session.sh moe | fi                        # one part only
#   source .device/b/env.sh && bash bench/h200_session.sh extra    # start-up, transformers block, decode sweep
#   source .device/b/env.sh && bash bench/h200_session.sh verify2  # virtual ranks with PDL, the decode sweeps
#   source .device/b/env.sh && bash bench/h200_session.sh decide   # PDL off/on, interleaved, 3 rounds each
#   source .device/b/env.sh && bash bench/h200_session.sh suite1|suite2|suite3  # the GPU suite in 3 calls
#
# apache-tvm-ffi must be importable there: ../shared/device/stage.sh does not bring it, and without it every
# kernel launch takes CuTeDSL's classic path (~0.1 ms more host time each; the twenty-eighth session's layer
# numbers ran so). env.sh installs every wheel in .device/b, so put its wheel there once:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     apache-tvm-ffi==0.1.15.post2 -d .device/b
# The script stops when it is missing (ALLOW_CLASSIC_LAUNCH=1 runs anyway; the rows then say so).
# Carry .device/aot too (a few MB; see below) to start from kernels compiled here:
#   for t in 128 256; do python -m moe_ep.aot build --arch sm_90a --model qwen3,mixtral --max-tokens $t \
#     --out .device/aot; done        # (the defaults: PDL launches, LocalRoute; SM90_MEGAMOE_PDL=0 for the others)
# The host's copy of .git can be older than the working tree it receives: pass the commit you ship as
# MOE_EP_COMMIT=<sha> on the command line. Every mode ends by packing $OUT into $OUT/session_<mode>.tgz
# and removing the loose files (the device returns a limited number of files; the archive holds them all).
#
# all (default): 1. python -m moe_ep.bench --model $MODELS --tokens $TOKENS --csv $OUT/bench.csv (default layers:
#                   per-call, back-to-back and CUDA-graph ms + TFLOP/s, decode sweep), log $OUT/bench.log;
#                2. FlashInfer moe_ep BF16 on the same models, in its own process (a subshell sources
#                   .device/fi/pkg/setup.sh, so its environment does not leak): $OUT/fi.csv, $OUT/fi.log,
#                   $OUT/peer_flashinfer_*.log;
#                3. the rows of every $OUT/*.csv as one table.
# liger:         [bash .device/liger/stage.sh if /tmp/lsite/.ok is missing], then in a subshell
#                `source .device/liger/env.sh` and LigerCute on the same models: $OUT/liger.csv, $OUT/liger.log;
#                then LigerCute at PEER_DECODE_TOKENS (1,8,32,128,256) -> $OUT/decode_liger.csv.
#                Stage it here first: `bash ../shared/device/stage-liger.sh && cp ../shared/peers/liger_bench.py
#                .device/liger/` (the stage script does not copy the benchmark script; without it every row fails).
# grid:          every layer of MODELS in BF16 then FP8 (model by model), each with FlashInfer (its BF16 / FP8
#                backend) right after it in its own process, then `bench gemm --model GEMM_MODELS` (qwen3,mixtral,
#                dsv3_shard,gemma4); a layer starts only with 100 s of CALL_BUDGET (560 s) left, its FlashInfer run
#                with 30 s, the GEMMs with 60 s, so one device call brings back whatever fits -> $OUT/bench_<model>_<bf16|fp8_block128>.{log,csv},
#                $OUT/fi_*, $OUT/gemm.log; the summary prints a BF16 and an FP8 table. Carry .device/fi and a
#                cache of the layers' kernels (`bash bench/device_aot.sh pair` -> .device/aotp, MOE_EP_CACHE_DIR).
# sonic:         SonicMoE beside ours on one machine (carry .device/sonic only: with .device/b it passes the 64 MiB
#                of one call, so run it right after a call that sourced .device/b/env.sh, whose install in /tmp/site
#                and /tmp/proj this mode reuses; stage .device/sonic here with ../shared/peers/sonicmoe/stage.sh):
#                ours (BF16, MODELS, --no-b2b: per call then graph, SonicMoE's order), SonicMoE (`run_device.sh
#                --skip-tuned` + SONIC_ARGS, e.g. "--shapes qwen3" for its autotuning instead), ours again
#                -> $OUT/sonic_ours_<1|2>.{log,csv}, $OUT/sonic_peer.log, $OUT/sonic_results.json.
# extra:         python -m moe_ep.bench startup (warmup cold/warm, forward host time) -> $OUT/startup.log;
#                python -m moe_ep.bench hf (Qwen3-MoE block via transformers, needs transformers) -> $OUT/hf.log;
#                the decode sweep of $MODELS with --decode-csv $OUT/decode.csv --plot $OUT/decode.png;
#                with .device/fi carried, FlashInfer at PEER_DECODE_TOKENS (1,8,32,128,256) in the same
#                call -> $OUT/decode_fi.csv, both plotted in $OUT/decode_all.png.
# defer:         drop v48's deferred epilogue (FP8): the drop runner per model (VERIFY_RUNNER_MODELS), the
#                steady-state FP8 GEMMs and the FP8 layer (VERIFY_ROUNDS rounds) with it off / on, FlashInfer's
#                FP8 layer beside them (carry .device/fi), then its GPU tests in what is left of CALL_BUDGET (560 s) -> $OUT/defer_*, $OUT/tests_*.log
# ncu:           Nsight Compute on the FP8 GEMMs (ours on Mixtral with and without clusters, Qwen3) and on
#                cuBLAS's block-wise _scaled_mm (Mixtral) -> $OUT/ncu_*.log
# layers:        both layers profiled (kernel table + the last forward's timeline), FlashInfer BF16 + FP8
#                beside (carry .device/fi; QUANT is ignored: each pass sets its own), then the GPU suite's groups in what is left of CALL_BUDGET (500 s)
#                -> $OUT/layers_*, $OUT/tests_*.log.
# verify2:       the virtual-rank tests with PDL
#                once more, then the decode sweep with (PDL, token grid, layout chunks) = (0,0,all) (1,0,all)
#                (0,1,all) (0,1,32) (0,1,8) (1,1,32), and the FP8 layer's decode sweep
#                -> $OUT/decode_p*g*c*.{log,csv} (one 600 s device call).
# power:         the layer (MODELS) in BF16 and FP8, --rounds POWER_ROUNDS (3), with nvidia-smi sampling power,
#                SM clock and temperature every 50 ms; bench/power.py splits the samples by timing mode
#                (per call / b2b / graph) -> $OUT/power_<bf16|fp8>.{csv,log}, phases_*.txt, power_*_summary.log.
# sustained:     `python -m moe_ep.bench sustained` (MODELS, BF16 then FP8): each expert GEMM -- ours,
#                torch._grouped_mm, dense cuBLAS (FP8: block-wise _scaled_mm) -- run SUSTAIN_SECONDS (2) s after
#                1 s of warm-up, nvidia-smi sampling power / SM clock / the power-cap flag; then the power mode
#                with ITERS=${SUSTAIN_ITERS:-600} (long phases) -> $OUT/sustained_*.log, power_*.
# sustab:        `bench sustained` (MODELS, QUANT) under each setting of SUSTAB ('|'-separated lists of
#                VAR=value; an empty one is the defaults, so end SUSTAB with '|' to time them too: "A=1|"),
#                SUSTAIN_ROUNDS (1) rounds within each run; cuBLAS's
#                kernels run beside ours in every run (a same-call baseline) -> $OUT/sustab_s<i>.log.
# newab:         code not yet run on a GPU: NEWAB_TESTS' GPU tests (space-separated files, TEST_BUDGET, 240 s: a
#                wrong barrier count would hang), then -- if they pass -- the drop runner with NEWAB_RUNNER's
#                arguments (e.g. "--gather --model qwen3"), the FP8 runner with NEWAB_FP8_RUNNER's
#                (e.g. "--model qwen3 --unit-scales"; FP8_RUNNER_BUDGET, 300 s), drop v92's placing FP8 GEMMs'
#                runner with NEWAB_FP8_PLACE_RUNNER's (e.g. "--model qwen3,mixtral") and the layer under each
#                ENVAB setting (MODELS, QUANT,
#                interleaved, ENVAB_ROUNDS rounds; as envab) -> $OUT/newab_tests.log, newab_runner.log, envab_s<i>_r<r>.*.
#                (The thirty-second session ran drop v72's clusters along N this way, as mode "clustern".)
# ncuab:         Nsight Compute (speed of light, warp states, schedulers, instruction mix) on one FC1 + one FC2
#                launch of each of MODELS' BF16 GEMMs (bench/ncu_gemm.py) under each ENVAB setting, e.g.
#                ENVAB="|MOE_EP_JUMP_STAGES=1" MODELS=nemotron
#                -> $OUT/ncuab_<model>_s<i>.log.
# gemmab:        the BF16 grouped GEMMs of MODELS against torch._grouped_mm under each ENVAB setting (as envab):
#                `bench gemm` (ours and torch's interleaved run by run; RASTERS="8,16" adds our GEMMs with those
#                L2 raster groups), then Nsight Compute (speed of light, memory workload: DRAM bytes and L2 hit
#                rate) on one FC1 + FC2 launch of ours, of ours at each of RASTERS and of torch's
#                -> $OUT/gemmab_s<i>.log, $OUT/gemmab_ncu_<model>_s<i>_<ours|r<N>|torch>.log
#                (e.g. ENVAB="|MOE_EP_BF16_CLUSTER=1" MODELS=mixtral RASTERS=8,16: the 43rd session's answer to
#                Mixtral's FC2 at 0.81x torch on an H100 -- single CTAs wait on DRAM, clusters 1.01x; docs/LIMITS.md).
# envab:         the layer (MODELS, QUANT) under each setting of ENVAB ('|'-separated, each a list of
#                VAR=value; end it with '|' for the defaults), interleaved, ENVAB_ROUNDS (2) rounds -> $OUT/envab_s<i>_r<r>.{log,csv}.
# timeline:      `python -m moe_ep.bench.graph_timeline` (MODELS, QUANT: per call and graph timed in TIMELINE_ROUNDS
#                (2) interleaved rounds, then each one's kernel timeline) under each ENVAB setting (as envab)
#                -> $OUT/timeline_s<i>.log (named by index: the device returns no file whose name holds a '=').
# dropab:        DROPAB_GROUPS' GPU tests, then the BF16 and FP8 layers with the checkout's drop files and with
#                those in DROPAB_DIR (.device/exp/old) copied over the installed drop, interleaved, DROPAB_ROUNDS
#                (2) rounds -> $OUT/dropab_*.{log,csv}, $OUT/tests_*.log.
# commitab:      this checkout against an older commit installed beside it in .device/old (made here:
#                `git worktree add /tmp/old <sha> && pip install --no-deps --no-build-isolation --target
#                .device/old /tmp/old`; carry .device/old and an AOT cache built by both trees: the old one's with
#                `cd /tmp && PYTHONPATH=$REPO/.device/old python -m moe_ep.aot build ... --out $REPO/.device/aot`), interleaved,
#                COMMITAB_ROUNDS (2) rounds: the decode sweep (1, 8, 128 tokens) of MODELS in BF16 and FP8,
#                the BF16 and FP8 layers at TOKENS and `bench.host_profile` -> $OUT/commitab_<new|old>_*_r<r>.{log,csv}.
# ceiling:       the BF16 and FP8 layers, then `python -m moe_ep.bench ceiling` (the layers' two GEMMs done by
#                dense cuBLAS BF16, torch._grouped_mm, block-wise FP8 torch._scaled_mm: the layer TFLOP/s they
#                alone allow) and `python -m moe_ep.bench gemm` (GEMM_MODELS) in the same call -> $OUT/ceiling_*.
# decide:        (SM90_MEGAMOE_PDL, MOE_EP_LOCAL_ROUTE) in {0,1}x{0,1} interleaved, 3 rounds, Qwen3 + Mixtral
#                decode at 1,8,128 tokens -> $OUT/decide_p<p>l<l>_r<r>.csv and the per-setting median over the rounds (run-to-run spread
#                at 128 tokens is 3-6 us, as large as the effects to decide on).
# decode:        the decode sweep (1,8,32,128,256 tokens) of ours and FlashInfer's (carry .device/fi) in one call,
#                then the virtual-rank GPU file in what is left of CALL_BUDGET (480 s of this script) -> $OUT/decode*.{log,csv}, suite3.log.
# suite:         the whole GPU suite: run_groups, thirteen pytest processes in parallel (compiling dominates;
#                the eighth session ran 91 tests in 220 s this way), cut at CALL_BUDGET (540 s) -> $OUT/tests_*.log;
#                it prints the groups that failed or were cut as the next call's SUITE_GROUPS (since the 69th
#                session the suite takes two 600 s calls on an H100), and returns the kernels it compiled as
#                $OUT/suite_kernels.tgz (<= 15 MiB): copy it to .device/suitecache/kernels.tgz and carry
#                .device/suitecache, and the next suite call loads them instead of compiling (SUITE_CACHE: another path).
#                The archive holds suite_kernels.json, the keys of those kernels: merge it into bench/suite_kernels.json
#                (`python -m moe_ep.aot manifest --merge F --out bench/suite_kernels.json`); a later session builds
#                .device/suitecache/kernels.tgz from that on the CPU (`bash bench/device_aot.sh suite`) before its suite call.
#                SUITE_PICK="9" runs some of the thirteen groups; SUITE_GROUPS="f1.py|f2.py;-k;x" runs your own.
# suite1/2/3:    pytest -m gpu in three parts that each fit one 600 s device call (the whole suite does not):
#                1 = layer, FP8 backend, activations/bias; 2 = the other GPU files; 3 = the virtual-rank file.
# Knobs (environment): MODELS (qwen3,mixtral), TOKENS (8192), ITERS (30), N (GPUs = EP size, 1),
#   BENCH_ROUNDS (moe_ep.bench --rounds: per-call / b2b / graph timed that many times, interleaved; 1),
#   NO_B2B=1 (moe_ep.bench --no-b2b, ours and the peers': per call then graph, no back-to-back phase, whose
#   heat would reach the graph phase under the 700 W cap; docs/LIMITS.md),
#   STEP_TIMEOUT (s per part, 420), PEER_TIMEOUT (s per peer run, 240), BENCH_ARGS (extra moe_ep.bench args),
#   QUANT (fp8_block128: FP8 block-scaled weights, FlashInfer's FP8 backend beside them),
#   MOE_EP_COMMIT (the commit to print: the host's copy of .git can be older than its tree, see above),
#   PIN_CPUS (e.g. 0-3: run each step under `taskset -c` on those cores, so host timings of
#   different processes compare; untried on the H200 as of the twenty-fourth session).
set -uo pipefail
mode=${1:-all}
modes="all|moe|fi|grid|liger|sonic|extra|verify2|ncu|ncuab|gemmab|layers|envab|timeline|newab|power|sustained|sustab|defer|dropab|commitab|ceiling|decide|decode|suite|suite1|suite2|suite3"
case "|$modes|" in *"|$mode|"*) ;; *) echo "usage: bash bench/h200_session.sh [$modes]" >&2; exit 2 ;; esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
MODELS=${MODELS:-qwen3,mixtral} TOKENS=${TOKENS:-8192} ITERS=${ITERS:-30} N=${N:-1}
STEP_TIMEOUT=${STEP_TIMEOUT:-420} PEER_TIMEOUT=${PEER_TIMEOUT:-240}
mkdir -p "$OUT"
rm -f /tmp/suite_kernels.tgz  # mode suite's kernel cache; only a suite call of this run may bring one back
# a compile cache built on a CPU machine and carried along (python -m moe_ep.aot build ... --out .device/aot)
# saves the first compile of each kernel on a fresh host; keys that miss simply compile
if [ -z "${MOE_EP_CACHE_DIR:-}" ] && [ -d .device/aot ]; then export MOE_EP_CACHE_DIR=$PWD/.device/aot; fi
# moe_ep must be importable: .device/b/env.sh installs this checkout into /tmp/proj; without it (a peer-only
# call on a fresh host) import the checkout itself through a link named moe_ep (the repo root is the package)
if ! python3 -c "import moe_ep.bench.report" 2>/dev/null; then
  if [ -d /tmp/proj/moe_ep ]; then
    export PYTHONPATH=/tmp/proj${PYTHONPATH:+:$PYTHONPATH}
  else
    mkdir -p /tmp/moe_ep_src && ln -sfn "$PWD" /tmp/moe_ep_src/moe_ep && export PYTHONPATH=/tmp/moe_ep_src${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
# CuTeDSL from an earlier call's .device/b/env.sh install (a call carrying only a peer's files)
if [ -f /tmp/site/.ok ] && ! python3 -c "import cutlass" 2>/dev/null; then
  export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import moe_ep.bench.report" || { echo "h200_session: moe_ep not importable; source .device/b/env.sh first" >&2; exit 3; }
if [ "$mode" != liger ] && [ "$mode" != fi ] && [ "${ALLOW_CLASSIC_LAUNCH:-0}" != 1 ] && ! python3 -c "import tvm_ffi" 2>/dev/null; then
  echo "h200_session: apache-tvm-ffi is not importable, so moe_ep would launch through CuTeDSL's classic path" \
       "(slower on the host): put its wheel into .device/b (this script's header) or set ALLOW_CLASSIC_LAUNCH=1" >&2
  exit 4
fi
echo "h200_session: mode=$mode models=$MODELS tokens=$TOKENS iters=$ITERS N=$N out=$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | head -n "$N"
timing=(--tokens "$TOKENS" --iters "$ITERS" --rounds "${BENCH_ROUNDS:-1}")  # every layer run's, whatever its models
[ "${NO_B2B:-0}" = 1 ] && timing+=(--no-b2b)
common=(--model "$MODELS" "${timing[@]}")
unquantised=("${common[@]}")  # the layers mode picks BF16 and FP8 itself (QUANT would make both FP8)
# QUANT=fp8_block128: FP8 weights for moe_ep (pass BENCH_ARGS="--backend sm90_fp8_cutedsl ..." to pick
# the experimental backend) and FlashInfer's FP8 backend (--backend fp8) beside it
[ -n "${QUANT:-}" ] && common+=(--quant "$QUANT")
peer_args=(--peers-only --peer-nproc "$N" --peer-timeout "$PEER_TIMEOUT" --peer-log-dir "$OUT")
status=()
split_settings() {  # split_settings "A=1 B=2|C=3|": the array settings, one entry per '|'-separated setting
  IFS='|' read -r -a settings <<< "${1}|"  # the extra "|" keeps a trailing empty setting (read drops one)
}
step() {  # step NAME LOG -- command...: run with a timeout, tee the log, remember the exit code
  local name=$1 log=$2; shift 3
  echo "===== $name ($(date +%T)) -> $log"
  # PIN_CPUS: every step on the same host cores (the host's speed differs 2-3x between processes)
  local pin=(); [ -n "${PIN_CPUS:-}" ] && command -v taskset > /dev/null && pin=(taskset -c "$PIN_CPUS")
  timeout -k 20 "$STEP_TIMEOUT" ${pin[@]+"${pin[@]}"} "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  status+=("$name: exit $rc$([ "$rc" = 124 ] && echo " (timed out after ${STEP_TIMEOUT}s)")")
}
flashinfer_step() {  # flashinfer_step NAME LOG ARGS...: `moe_ep.bench ARGS --peer flashinfer` as a step, in a
  # process whose environment comes from .device/fi/pkg/setup.sh (so FlashInfer's does not leak into ours)
  local name=$1 log=$2; shift 2
  step "$name" "$log" -- bash -c '
    source .device/fi/pkg/setup.sh || { echo "h200_session: .device/fi/pkg/setup.sh failed" >&2; exit 3; }
    exec python3 -m moe_ep.bench "$@"' fi "$@" "${peer_args[@]}" --peer flashinfer --peer-script-fi .device/fi/bench_fi.py
}
run_groups() {  # run_groups SECONDS GROUP...: pytest -m gpu per group, all in parallel (compiling dominates
  # the GPU tests: 16 host cores), each cut at SECONDS; a group is its pytest arguments separated by ';'
  local limit=$1; shift
  local groups=("$@") pids=() g rc rerun=()
  echo "===== GPU tests, ${#groups[@]} groups in parallel ($(date +%T), ${limit}s)"
  for g in "${!groups[@]}"; do
    IFS=';' read -r -a words <<< "${groups[$g]}"
    # -v: one line per test as it ends, so a group cut at the limit shows which of its tests ran
    timeout -k 10 "$limit" python3 -m pytest -m gpu -v -W ignore -p no:cacheprovider -rfE --tb=short "${words[@]}" \
        > "$OUT/tests_$g.log" 2>&1 &
    pids+=($!)
  done
  for g in "${!pids[@]}"; do
    wait "${pids[$g]}"; rc=$?
    status+=("GPU tests [${groups[$g]}]: exit $rc$([ "$rc" = 124 ] && echo " (timed out)")")
    echo "--- ${groups[$g]}: exit $rc"; tail -n 3 "$OUT/tests_$g.log"
    [ "$rc" = 0 ] || rerun+=("${groups[$g]}")
  done
  # the groups that failed or were cut, as the next call's argument (the whole suite no longer fits
  # one 600 s call on an H100: 69th session, 7 of 13 groups in 542 s)
  if [ ${#rerun[@]} -gt 0 ]; then
    echo "not passed: ${#rerun[@]} group(s); next call: SUITE_GROUPS=\"$(IFS='|'; echo "${rerun[*]}")\" bash bench/h200_session.sh suite"
  fi
}
sustained_gemms() {  # sustained_gemms NAME LOG ROUNDS QUANT [VAR=value ...]: `bench sustained` (MODELS,
  # TOKENS, SUSTAIN_SECONDS) with QUANT (empty: BF16) under the given settings
  local name=$1 log=$2 rounds=$3 q=$4; shift 4
  # shellcheck disable=SC2086
  step "$name" "$log" -- env "$@" python3 -m moe_ep.bench sustained --model "$MODELS" --tokens "$TOKENS" \
      --seconds "${SUSTAIN_SECONDS:-2}" --rounds "$rounds" ${q:+--quant $q}
}
fp8_layer_ab() {  # fp8_layer_ab PREFIX MODELS VAR=value: the FP8 layer with the defaults and with VAR=value,
  # interleaved, VERIFY_ROUNDS (2) rounds -> $OUT/PREFIX_<setting>_r<r>.{log,csv}
  local prefix=$1 models=$2 on=$3 r v tag
  for r in $(seq 1 "${VERIFY_ROUNDS:-2}"); do for v in "" "$on"; do
    tag=${v:-defaults}; tag=${tag//[^A-Za-z0-9]/_}
    # shellcheck disable=SC2086
    step "FP8 layer, ${v:-defaults}, round $r" "$OUT/${prefix}_${tag}_r$r.log" -- env $v \
        python3 -m moe_ep.bench --model "$models" --tokens "$TOKENS" --iters "$ITERS" \
        --quant fp8_block128 --no-reference --no-decode --csv "$OUT/${prefix}_${tag}_r$r.csv"
  done; done
}
# the whole GPU suite as thirteen pytest groups (modes suite and layers run them in parallel)
ltop="matches_reference or activations_biases or decode_layer or bad_values or odd_hidden or quantised_configs"
gtop="fc1_fc2_models or m_total_sweep or back_to_back"
suite_groups=(
  "tests/test_layer_gpu.py;-k;$ltop" "tests/test_layer_gpu.py;-k;not ($ltop)"
  "tests/test_sm90_gpu.py;-k;$gtop" "tests/test_sm90_gpu.py;-k;not ($gtop)"
  "tests/test_ep_virtual_gpu.py;-k;matches_reference" "tests/test_ep_virtual_gpu.py;-k;not matches_reference"
  "tests/test_fp8_backend.py;tests/test_activations_bias.py;tests/test_gather_fc1.py;tests/test_fp8_place.py;tests/test_clamped_swiglu_beta.py;tests/test_clamp_after_act.py;tests/test_softcapped_swiglu.py"
  "tests/test_ep_gpu.py;tests/test_disk_cache.py;tests/test_transformers_integration.py;tests/test_transformers_layouts.py;tests/test_blackwell_backends.py"
  "tests/test_sm90_fp8_quant.py;tests/test_fp8_quant_div.py;tests/test_fp8_quant_items.py;tests/test_fp8_scatter_quant.py;tests/test_fp8_cluster.py;tests/test_gelu_tanh_glu.py"
  "tests/test_fp8_plain_schedule.py;tests/test_fp8_smem_scales.py;tests/test_fp8_unit_scales.py"
  "tests/test_fp8_deferred_epilogue.py;tests/test_bf16_cluster.py"
  "tests/test_sm90_fp8_compile.py;tests/test_fp8_stage_guard.py" "tests/test_sm90_swapab_compile.py;tests/test_fp8_tanh_sigmoid.py;tests/test_bf16_tanh_sigmoid.py;tests/test_bf16_cluster_n.py;tests/test_jump_stages.py;tests/test_gated_pingpong.py;tests/test_box_tails.py;tests/test_fc2_early.py;tests/test_torch_compile.py"
)
# SUITE_PICK="i j ...": only those of the groups above (0-based), e.g. the ones a cut call left unrun
if [ -n "${SUITE_PICK:-}" ]; then
  picked=(); for i in $SUITE_PICK; do picked+=("${suite_groups[$i]}"); done; suite_groups=("${picked[@]}")
fi
# SUITE_GROUPS="a|b ...": these groups instead ('|' between groups, ';' between one group's pytest arguments),
# e.g. SUITE_GROUPS="tests/test_x.py|tests/test_y.py;-k;fast" -- run_groups waits on each pytest by its pid
if [ -n "${SUITE_GROUPS:-}" ]; then IFS='|' read -r -a suite_groups <<< "$SUITE_GROUPS"; fi
if [ "$N" -gt 1 ]; then bench=(torchrun --standalone --nproc_per_node="$N" -m moe_ep.bench); else bench=(python3 -m moe_ep.bench); fi

if [ "$mode" = all ] || [ "$mode" = moe ]; then
  # shellcheck disable=SC2086
  step "moe_ep bench" "$OUT/bench.log" -- "${bench[@]}" "${common[@]}" --csv "$OUT/bench.csv" ${BENCH_ARGS:-}
fi
if [ "$mode" = all ] || [ "$mode" = fi ]; then
  flashinfer_step "FlashInfer peer" "$OUT/fi.log" "${common[@]}" --csv "$OUT/fi.csv"
fi
if [ "$mode" = grid ]; then
  for m in ${MODELS//,/ }; do for q in "" fp8_block128; do
    tag=${m}_${q:-bf16} left=$(( ${CALL_BUDGET:-560} - SECONDS ))
    if [ "$left" -lt 100 ]; then status+=("layer $tag: skipped, ${left}s of CALL_BUDGET left"); continue; fi
    layer=(--model "$m" "${timing[@]}" ${q:+--quant "$q"})
    # shellcheck disable=SC2086
    STEP_TIMEOUT=$(( left - 10 )) step "moe_ep $tag" "$OUT/bench_$tag.log" -- "${bench[@]}" "${layer[@]}" --no-decode \
        --csv "$OUT/bench_$tag.csv" ${BENCH_ARGS:-}
    left=$(( ${CALL_BUDGET:-560} - SECONDS ))
    if [ "$left" -lt 30 ]; then status+=("FlashInfer $tag: skipped, ${left}s of CALL_BUDGET left"); continue; fi
    STEP_TIMEOUT=$(( left - 10 )) flashinfer_step "FlashInfer $tag" "$OUT/fi_$tag.log" "${layer[@]}" --csv "$OUT/fi_$tag.csv"
  done; done
  left=$(( ${CALL_BUDGET:-560} - SECONDS ))
  if [ "$left" -lt 60 ]; then status+=("grouped GEMMs: skipped, ${left}s of CALL_BUDGET left")
  else
    STEP_TIMEOUT=$(( left - 10 )) step "grouped GEMMs" "$OUT/gemm.log" -- python3 -m moe_ep.bench gemm \
        --model "${GEMM_MODELS:-qwen3,mixtral,dsv3_shard,gemma4}"
  fi
fi
if [ "$mode" = extra ]; then
  step "moe_ep start-up" "$OUT/startup.log" -- python3 -m moe_ep.bench startup --model "$MODELS"
  step "transformers block" "$OUT/hf.log" -- python3 -m moe_ep.bench hf --iters "$ITERS"
  step "decode sweep" "$OUT/decode.log" -- python3 -m moe_ep.bench --model "$MODELS" --tokens 128 --iters "$ITERS" \
      --no-reference --decode-csv "$OUT/decode.csv" --plot "$OUT/decode.png"
  if [ -f .device/fi/pkg/setup.sh ]; then  # FlashInfer at decode token counts, one run each, its own env
    flashinfer_step "FlashInfer decode" "$OUT/decode_fi.log" --model "$MODELS" --tokens 128 --iters "$ITERS" \
        --peer-decode-tokens "${PEER_DECODE_TOKENS:-1,8,32,128,256}" --decode-csv "$OUT/decode_fi.csv"
    python3 -m moe_ep.bench.decode "$OUT/decode.csv" "$OUT/decode_fi.csv" "$OUT/decode_all.png" || true
  fi
fi
if [ "$mode" = defer ]; then
  # drop v48's deferred epilogue (MOE_EP_FP8_DEFERRED_EPILOGUE=1): the drop runner per model (bits and
  # time, interleaved), the steady-state FP8 GEMMs and the FP8 layer with it off / on (VERIFY_ROUNDS
  # rounds, interleaved), then its GPU tests in what is left of CALL_BUDGET (560 s)
  for m in ${VERIFY_RUNNER_MODELS-qwen3 mixtral}; do
    step "fp8_runner $m --deferred-epilogue" "$OUT/defer_runner_$m.log" -- bash -c \
        "cd kernel_src/sm90/megamoe/src && exec python3 -m sm90_megamoe.fp8_runner --model $m --deferred-epilogue"
  done
  for v in "" "MOE_EP_FP8_DEFERRED_EPILOGUE=1"; do
    tag=${v:-defaults}; tag=${tag//[^A-Za-z0-9]/_}
    # shellcheck disable=SC2086
    sustained_gemms "sustained FP8 GEMMs, ${v:-defaults}" "$OUT/defer_sustained_$tag.log" 1 fp8_block128 $v
  done
  fp8_layer_ab defer_fp8 "$MODELS" MOE_EP_FP8_DEFERRED_EPILOGUE=1
  if [ -f .device/fi/pkg/setup.sh ]; then  # FlashInfer's FP8 layer beside them (carry .device/fi)
    flashinfer_step "FlashInfer peer fp8" "$OUT/defer_fi_fp8.log" "${common[@]}" --quant fp8_block128 \
        --csv "$OUT/defer_fi_fp8.csv"
  fi
  left=$(( ${CALL_BUDGET:-560} - SECONDS ))
  [ "$left" -gt 60 ] && run_groups "$left" "tests/test_fp8_deferred_epilogue.py" \
      "tests/test_fp8_backend.py;-k;DEFERRED or against_reference"
fi
if [ "$mode" = commitab ]; then  # this checkout (new) vs the commit installed in .device/old (old), interleaved
  [ -d .device/old/moe_ep ] || { echo "h200_session: commitab needs .device/old (see the header)" >&2; exit 3; }
  base=${PYTHONPATH:-}
  for r in $(seq 1 "${COMMITAB_ROUNDS:-2}"); do for v in new old; do
    if [ $v = old ]; then pp=$PWD/.device/old${base:+:$base}; else pp=$base; fi
    for q in bf16 fp8_block128; do
      qargs=(--tokens 128); [ $q = bf16 ] || qargs+=(--quant "$q")
      step "decode sweep $q, $v, round $r" "$OUT/commitab_${v}_dec_${q}_r$r.log" -- env PYTHONPATH="$pp" \
          python3 -m moe_ep.bench --model "$MODELS" "${qargs[@]}" --iters 50 --no-reference --quiet \
          --decode-tokens 1,8,128 --decode-csv "$OUT/commitab_${v}_dec_${q}_r$r.csv"
    done
    for q in bf16 fp8_block128; do
      qargs=(); [ $q = bf16 ] || qargs=(--quant "$q")
      step "$q layer, $v, round $r" "$OUT/commitab_${v}_${q}_r$r.log" -- env PYTHONPATH="$pp" python3 -m moe_ep.bench \
          --model "$MODELS" --tokens "$TOKENS" --iters "$ITERS" "${qargs[@]}" --no-reference --no-decode --quiet \
          --csv "$OUT/commitab_${v}_${q}_r$r.csv"
    done
    # this checkout's profiler script on either tree (it wraps the steps and launchers each one has)
    step "host profile, $v, round $r" "$OUT/commitab_${v}_host_r$r.log" -- env PYTHONPATH="$pp" \
        python3 "$PWD/bench/host_profile.py" --model "$MODELS"
  done; done
fi
if [ "$mode" = sustab ]; then
  split_settings "${SUSTAB:-}"
  for i in "${!settings[@]}"; do
    # shellcheck disable=SC2086
    sustained_gemms "sustained GEMMs, setting $i (${settings[$i]:-defaults})" "$OUT/sustab_s$i.log" \
        "${SUSTAIN_ROUNDS:-1}" "${QUANT:-}" ${settings[$i]}
  done
fi
if [ "$mode" = sustained ]; then
  for q in "" fp8_block128; do
    tag=${q:-bf16}; tag=${tag%_block128}
    sustained_gemms "sustained GEMMs $tag" "$OUT/sustained_$tag.log" "${SUSTAIN_ROUNDS:-2}" "$q"
  done
  mode=power ITERS=${SUSTAIN_ITERS:-600} POWER_ROUNDS=1
fi
if [ "$mode" = power ]; then
  # is a mode slower because the GPU sits at its power cap in it? (BF16 Qwen3: b2b / graph 6-8% under
  # per call, FP8 not, seventeenth session)
  for q in "" fp8_block128; do
    tag=${q:-bf16}; tag=${tag%_block128}
    nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv,noheader,nounits -lms 50 \
        > "$OUT/power_$tag.csv" 2>&1 &
    smi=$!
    step "layer $tag, power sampled" "$OUT/power_$tag.log" -- env MOE_EP_BENCH_PHASES="$OUT/phases_$tag.txt" \
        python3 -m moe_ep.bench --model "$MODELS" --tokens "$TOKENS" --iters "$ITERS" --rounds "${POWER_ROUNDS:-3}" \
        ${q:+--quant $q} --no-reference --no-decode --csv "$OUT/power_$tag.bench.csv"
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    python3 -m moe_ep.bench.power "$OUT/power_$tag.csv" "$OUT/phases_$tag.txt" | tee "$OUT/power_${tag}_summary.log"
  done
fi
layer_settings() {  # layer_settings: the layer (QUANT, MODELS) under each ENVAB setting ('|'-separated, each a
  # space-separated list of VAR=value, empty: the defaults), interleaved, ENVAB_ROUNDS (2) rounds
  split_settings "${ENVAB:-}"
  for r in $(seq 1 "${ENVAB_ROUNDS:-2}"); do for i in "${!settings[@]}"; do
    # shellcheck disable=SC2086
    step "layer, setting $i (${settings[$i]:-defaults}), round $r" "$OUT/envab_s${i}_r$r.log" -- env ${settings[$i]} \
        python3 -m moe_ep.bench "${common[@]}" --no-reference --no-decode --csv "$OUT/envab_s${i}_r$r.csv"
  done; done
}
if [ "$mode" = envab ]; then
  layer_settings
fi
if [ "$mode" = timeline ]; then
  split_settings "${ENVAB:-}"
  for i in "${!settings[@]}"; do
    # shellcheck disable=SC2086
    step "timeline, setting $i (${settings[$i]:-defaults})" "$OUT/timeline_s$i.log" -- env ${settings[$i]} \
        python3 -m moe_ep.bench.graph_timeline --model "$MODELS" --tokens "$TOKENS" \
        --rounds "${TIMELINE_ROUNDS:-2}" ${QUANT:+--quant "$QUANT"}
  done
fi
if [ "$mode" = ncuab ]; then
  # Nsight Compute on one FC1 + one FC2 launch of the BF16 GEMMs (bench/ncu_gemm.py, uniform routing) of
  # each of MODELS under each ENVAB setting ('|'-separated as in envab; an empty one: the defaults):
  # speed of light, warp states (e.g. "No Instruction": instruction-cache misses), schedulers, instruction mix
  split_settings "${ENVAB:-}"
  IFS=',' read -r -a ncu_models <<< "$MODELS"
  for mdl in "${ncu_models[@]}"; do for i in "${!settings[@]}"; do
    # shellcheck disable=SC2086
    step "ncu BF16 $mdl, setting $i (${settings[$i]:-defaults})" "$OUT/ncuab_${mdl}_s$i.log" -- env ${settings[$i]} \
        ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section InstructionStats python3 -m moe_ep.bench.ncu_gemm --model "$mdl"
  done; done
fi
if [ "$mode" = gemmab ]; then
  # the BF16 GEMMs against torch's under each ENVAB setting: timed (interleaved), then under Nsight Compute
  split_settings "${ENVAB:-}"
  IFS=',' read -r -a ncu_models <<< "$MODELS"
  IFS=',' read -r -a rasters <<< "${RASTERS:-}"
  for i in "${!settings[@]}"; do
    # shellcheck disable=SC2086
    step "bench gemm, setting $i (${settings[$i]:-defaults})" "$OUT/gemmab_s$i.log" -- env ${settings[$i]} \
        python3 -m moe_ep.bench gemm --model "$MODELS" --tokens "$TOKENS" ${RASTERS:+--raster-m "$RASTERS"}
  done
  for mdl in "${ncu_models[@]}"; do for i in "${!settings[@]}"; do
    for v in ours "${rasters[@]/#/r}" torch; do
      [ "$v" = torch ] && [ "$i" != 0 ] && continue  # torch's kernels do not read our switches
      case $v in ours) extra=() ;; torch) extra=(--torch) ;; *) extra=(--raster-m "${v#r}") ;; esac
      # shellcheck disable=SC2086
      step "ncu BF16 $mdl, setting $i (${settings[$i]:-defaults}), $v" "$OUT/gemmab_ncu_${mdl}_s${i}_$v.log" -- \
          env ${settings[$i]} ncu --profile-from-start off --clock-control none --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats \
          python3 -m moe_ep.bench.ncu_gemm --model "$mdl" "${extra[@]}"
    done
  done; done
fi
if [ "$mode" = newab ]; then
  # shellcheck disable=SC2086
  STEP_TIMEOUT=${TEST_BUDGET:-240} step "GPU tests of ${NEWAB_TESTS:?set NEWAB_TESTS}" "$OUT/newab_tests.log" -- \
      python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider -rfE --tb=short $NEWAB_TESTS
  if grep -q " passed" "$OUT/newab_tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/newab_tests.log"; then
    if [ -n "${NEWAB_RUNNER:-}" ]; then
      STEP_TIMEOUT=240 step "grouped_gemm_runner $NEWAB_RUNNER" "$OUT/newab_runner.log" -- bash -c \
          "cd kernel_src/sm90/megamoe/src && exec python3 -m sm90_megamoe.grouped_gemm_runner $NEWAB_RUNNER"
    fi
    if [ -n "${NEWAB_FP8_RUNNER:-}" ]; then
      STEP_TIMEOUT=${FP8_RUNNER_BUDGET:-300} step "fp8_runner $NEWAB_FP8_RUNNER" "$OUT/newab_fp8_runner.log" -- bash -c \
          "cd kernel_src/sm90/megamoe/src && exec python3 -m sm90_megamoe.fp8_runner $NEWAB_FP8_RUNNER"
    fi
    if [ -n "${NEWAB_FP8_PLACE_RUNNER:-}" ]; then
      STEP_TIMEOUT=${FP8_RUNNER_BUDGET:-300} step "fp8_place_runner $NEWAB_FP8_PLACE_RUNNER" \
          "$OUT/newab_fp8_place_runner.log" -- bash -c \
          "cd kernel_src/sm90/megamoe/src && exec python3 -m sm90_megamoe.fp8_place_runner $NEWAB_FP8_PLACE_RUNNER"
    fi
    layer_settings
  fi
fi
if [ "$mode" = dropab ]; then
  # a drop edit against the drop as it was: DROPAB_GROUPS (pytest groups, ';'-separated words, '|' between
  # groups) first, then the layer (MODELS; BF16 and FP8) with the checkout's drop files ("new") and with the
  # files in DROPAB_DIR (default .device/exp/old; same names, copied over the installed copy in /tmp/proj:
  # "old"), interleaved, DROPAB_ROUNDS (2) rounds -> $OUT/dropab_<new|old>_<bf16|fp8>_r<r>.{log,csv}.
  # Build the carried compile cache for both trees (the old one from a copy of the checkout with those
  # files in, imported through a link named moe_ep on PYTHONPATH: SKILL.md).
  ab=${DROPAB_DIR:-.device/exp/old}
  if ! compgen -G "$ab/*.py" > /dev/null; then echo "dropab: no drop files in $ab (DROPAB_DIR)" >&2; exit 2; fi
  IFS='|' read -r -a groups <<< "${DROPAB_GROUPS:-}"
  [ "${#groups[@]}" -gt 0 ] && run_groups "${TEST_BUDGET:-200}" "${groups[@]}"
  dst=$(python3 -c "import moe_ep, os; print(os.path.dirname(moe_ep.__file__))")/kernel_src/sm90/megamoe/src/sm90_megamoe
  mkdir -p /tmp/dropab_new
  for f in "$ab"/*.py; do cp "$dst/$(basename "$f")" /tmp/dropab_new/; done
  use_files() { if [ "$1" = new ]; then cp /tmp/dropab_new/*.py "$dst/"; else cp "$ab"/*.py "$dst/"; fi; }
  # bits first: the layer's outputs on fixed inputs with each set of files, compared (bench/layer_bits.py)
  for v in new old; do
    use_files $v
    step "layer outputs, drop files $v" "$OUT/dropab_bits_$v.log" -- python3 -m moe_ep.bench.layer_bits dump \
        "/tmp/dropab_$v.pt" --model "$MODELS"
  done
  step "new = old, bit for bit" "$OUT/dropab_bits.log" -- python3 -m moe_ep.bench.layer_bits compare \
      /tmp/dropab_new.pt /tmp/dropab_old.pt
  for r in $(seq 1 "${DROPAB_ROUNDS:-2}"); do for v in new old; do
    use_files $v
    for q in "" fp8_block128; do
      step "layer ${q:-bf16}, drop files $v, round $r" "$OUT/dropab_${v}_${q:-bf16}_r$r.log" -- python3 -m moe_ep.bench \
          "${common[@]}" ${q:+--quant $q} --no-reference --no-decode --csv "$OUT/dropab_${v}_${q:-bf16}_r$r.csv"
    done
  done; done
  use_files new
fi
if [ "$mode" = ceiling ]; then
  # what torch's own GEMM kernels allow, beside our layers in the same call: the BF16 and FP8 layers
  # (MODELS), then the layers' two GEMMs by dense cuBLAS BF16, torch._grouped_mm and block-wise FP8
  # torch._scaled_mm as layer TFLOP/s (bench/ceiling.py), then our BF16 grouped GEMMs against
  # torch._grouped_mm (GEMM_MODELS: issue 10's >= 1.10x) -> $OUT/ceiling_*.{log,csv}
  for q in "" fp8_block128; do
    step "layer ${q:-bf16}" "$OUT/ceiling_layer_${q:-bf16}.log" -- python3 -m moe_ep.bench "${common[@]}" \
        ${q:+--quant $q} --no-reference --no-decode --csv "$OUT/ceiling_layer_${q:-bf16}.csv"
  done
  step "GEMM ceilings" "$OUT/ceiling_torch.log" -- python3 -m moe_ep.bench ceiling --model "$MODELS" \
      --tokens "$TOKENS" --iters "$ITERS"
  gm=${GEMM_MODELS-qwen3,mixtral,dsv3_shard}  # set but empty: no GEMM comparison
  [ -n "$gm" ] && step "grouped GEMMs vs torch" "$OUT/ceiling_gemm.log" -- python3 -m moe_ep.bench gemm \
      --model "$gm" --tokens "$TOKENS"
fi
if [ "$mode" = ncu ]; then
  # Nsight Compute (hardware counters; Firecracker hosts only) on one FC1 + one FC2 launch of the FP8
  # GEMMs: ours on Mixtral (clusters, the default there, and single CTAs) and Qwen3, then cuBLAS's
  # block-wise torch._scaled_mm on Mixtral (first expert's FC1 and FC2: it runs Mixtral's FP8
  # GEMMs ~15% faster than ours). What each kernel is bound by -> $OUT/ncu_*.log
  ncu_args=(ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis
            --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis --section LaunchStats)
  step "ncu FP8 mixtral (clusters)" "$OUT/ncu_fp8_mixtral.log" -- "${ncu_args[@]}" \
      python3 -m moe_ep.bench.ncu_gemm --model mixtral --quant fp8_block128
  step "ncu FP8 mixtral (single CTAs)" "$OUT/ncu_fp8_mixtral_c0.log" -- env MOE_EP_FP8_CLUSTER=0 "${ncu_args[@]}" \
      python3 -m moe_ep.bench.ncu_gemm --model mixtral --quant fp8_block128
  step "ncu FP8 qwen3" "$OUT/ncu_fp8_qwen3.log" -- "${ncu_args[@]}" \
      python3 -m moe_ep.bench.ncu_gemm --model qwen3 --quant fp8_block128
  step "ncu FP8 mixtral cuBLAS" "$OUT/ncu_fp8_mixtral_torch.log" -- "${ncu_args[@]}" --launch-count 4 \
      python3 -m moe_ep.bench.ncu_gemm --model mixtral --quant fp8_block128 --torch
fi
if [ "$mode" = layers ]; then
  # both layers on the default path, profiled (the kernel table and the last forward's timeline:
  # idle gaps between kernels), FlashInfer BF16 + FP8 at the same shapes in the same call (carry
  # .device/fi), then GPU tests in what is left of CALL_BUDGET (500 s)
  for q in "" fp8_block128; do
    step "layer ${q:-bf16}, profiled" "$OUT/layers_${q:-bf16}.log" -- python3 -m moe_ep.bench "${unquantised[@]}" \
        ${q:+--quant $q} --no-reference --no-decode --profile --csv "$OUT/layers_${q:-bf16}.csv"
  done
  if [ -f .device/fi/pkg/setup.sh ]; then
    for q in "" fp8_block128; do
      flashinfer_step "FlashInfer peer ${q:-bf16}" "$OUT/layers_fi_${q:-bf16}.log" "${unquantised[@]}" ${q:+--quant $q} \
          --csv "$OUT/layers_fi_${q:-bf16}.csv"
    done
  fi
  left=$(( ${CALL_BUDGET:-500} - SECONDS ))
  [ "$left" -gt 60 ] && run_groups "$left" "${suite_groups[@]}"  # the whole GPU suite, as far as it gets
fi
if [ "$mode" = verify2 ]; then  # one device call (600 s)
  step "virtual-rank tests, PDL on (2)" "$OUT/verify_pdl2.log" -- env SM90_MEGAMOE_PDL=1 \
      python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider tests/test_ep_virtual_gpu.py --tb=short
  for v in "0 0 " "1 0 " "0 1 " "0 1 32" "0 1 8" "1 1 32"; do  # PDL, token grid, layout chunks
    set -- $v
    tag="p$1g$2c${3:-all}"
    step "decode, PDL $1, token grid $2, layout chunks '${3:-all}'" "$OUT/decode_$tag.log" -- env SM90_MEGAMOE_PDL=$1 \
        MOE_EP_TOKEN_GRID=$2 MOE_EP_LAYOUT_CHUNKS=${3:-} python3 -m moe_ep.bench --model "$MODELS" --tokens 128 \
        --iters 50 --no-reference --quiet --decode-tokens 1,8,128 --decode-csv "$OUT/decode_$tag.csv"
  done
  # the FP8 layer at decode token counts (it has no swap-AB GEMMs yet: never measured)
  step "FP8 decode" "$OUT/decode_fp8.log" -- python3 -m moe_ep.bench --model "$MODELS" --tokens 128 --iters 50 \
      --quant fp8_block128 --no-reference --quiet --decode-tokens 1,8,128 --decode-csv "$OUT/decode_fp8.csv"
fi
if [ "$mode" = decide ]; then
  # ROUNDS (3) rounds; no new run starts after DECIDE_DEADLINE seconds (480), so the archive is always written
  for r in $(seq 1 "${ROUNDS:-3}"); do for p in 0 1; do for lr in 0 1; do
    [ "$SECONDS" -lt "${DECIDE_DEADLINE:-480}" ] || { echo "decide: deadline reached before round $r p$p l$lr"; continue; }
    step "decode, PDL $p, local route $lr, round $r" "$OUT/decide_p${p}l${lr}_r$r.log" -- env SM90_MEGAMOE_PDL=$p \
        MOE_EP_LOCAL_ROUTE=$lr python3 -m moe_ep.bench --model "$MODELS" --tokens 128 --iters 50 --no-reference \
        --quiet --decode-tokens 1,8,128 --decode-csv "$OUT/decide_p${p}l${lr}_r$r.csv"
  done; done; done
  python3 - "$OUT" <<'PY'
import csv, glob, os, statistics, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "decide_p*_r*.csv"))):
    pdl = os.path.basename(path).split("_")[1]
    for r in csv.DictReader(open(path)):
        rows.setdefault((r["model"], int(r["tokens"]), pdl), []).append((float(r["eager_ms"]), float(r["graph_ms"])))
print("model, tokens, p<PDL>l<local route>: median eager / graph ms over rounds (graph of each round)")
for (m, t, p), v in sorted(rows.items()):
    print(f"{m:16s} {t:4d} {p}: {statistics.median(e for e, _ in v):.4f} / {statistics.median(g for _, g in v):.4f}"
          f"   ({', '.join(f'{g:.4f}' for _, g in v)})")
PY
fi
if [ "$mode" = decode ]; then  # issue 11's sweep: ours and FlashInfer (carry .device/fi) in one call, then suite 3
  step "decode sweep" "$OUT/decode.log" -- python3 -m moe_ep.bench --model "$MODELS" --tokens 128 --iters 50 \
      --no-reference --quiet --decode-tokens 1,8,32,128,256 --decode-csv "$OUT/decode.csv"
  if [ -f .device/fi/pkg/setup.sh ]; then
    flashinfer_step "FlashInfer decode" "$OUT/decode_fi.log" --model "$MODELS" --tokens 128 --iters 50 \
        --peer-decode-tokens "${PEER_DECODE_TOKENS:-1,8,32,128,256}" --decode-csv "$OUT/decode_fi.csv"
  fi
  left=$(( ${CALL_BUDGET:-480} - SECONDS ))  # what is left of the device call (less env.sh and the archive) goes to the virtual-rank file
  [ "$left" -gt 60 ] && STEP_TIMEOUT=$left step "GPU suite 3/3 (time left: ${left}s)" "$OUT/suite3.log" -- \
      python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider -rfE --tb=long tests/test_ep_virtual_gpu.py
fi
if [ "$mode" = suite ]; then  # the whole GPU suite in one call: thirteen groups in parallel, cut at CALL_BUDGET (540 s)
  # compiling dominates the suite: seed the disk cache with the kernels an earlier suite call compiled
  # (SUITE_CACHE, default .device/suitecache/kernels.tgz: that call's $OUT/suite_kernels.tgz, carried), and
  # bring this call's cache back the same way (entries of another drop or cutlass-dsl sit in other folders)
  kernel_cache=$(python3 -c "from moe_ep.shim import compile_cache_root as r; print(r() or '')")  # empty: off
  seed=${SUITE_CACHE:-.device/suitecache/kernels.tgz}
  if [ -n "$kernel_cache" ] && [ -f "$seed" ] && mkdir -p "$kernel_cache" && tar xzf "$seed" -C "$kernel_cache"; then
    echo "suite: seeded $kernel_cache from $seed ($(find "$kernel_cache" -name '*.o' | wc -l) kernels)"
  fi
  run_groups $(( ${CALL_BUDGET:-540} - SECONDS )) "${suite_groups[@]}"
  # the keys of every kernel the suite has in its cache, in the archive: merged into bench/suite_kernels.json
  # (SKILL.md), `bash bench/device_aot.sh suite` compiles them on the CPU machine for the next session's suite
  [ -n "$kernel_cache" ] && [ -d "$kernel_cache" ] && python3 -m moe_ep.aot manifest --dir "$kernel_cache" \
      --out "$OUT/suite_kernels.json" || true
  if [ -n "$kernel_cache" ] && [ -d "$kernel_cache" ] && tar czf /tmp/suite_kernels.tgz -C "$kernel_cache" . 2>/dev/null; then
    if [ "$(stat -c %s /tmp/suite_kernels.tgz)" -gt $(( 15 * 1024 * 1024 )) ]; then  # the device returns <= 16 MiB a file
      echo "suite: the kernel cache ($(du -h /tmp/suite_kernels.tgz | cut -f1)) is too large to bring back"; rm -f /tmp/suite_kernels.tgz
    fi
  fi
fi
suite_common=(python3 -m pytest -m gpu -q -W ignore -p no:cacheprovider -rfE --durations=15 --tb=long)
if [ "$mode" = suite1 ]; then
  step "GPU suite 1/3" "$OUT/suite1.log" -- "${suite_common[@]}" tests/test_layer_gpu.py tests/test_fp8_backend.py \
      tests/test_activations_bias.py tests/test_clamped_swiglu_beta.py tests/test_clamp_after_act.py tests/test_softcapped_swiglu.py tests/test_gelu_tanh_glu.py
fi
if [ "$mode" = suite2 ]; then
  step "GPU suite 2/3" "$OUT/suite2.log" -- "${suite_common[@]}" tests/test_sm90_gpu.py tests/test_ep_gpu.py \
      tests/test_disk_cache.py tests/test_transformers_integration.py tests/test_transformers_layouts.py tests/test_sm90_fp8_quant.py \
      tests/test_sm90_fp8_compile.py tests/test_sm90_swapab_compile.py tests/test_blackwell_backends.py \
      tests/test_gather_fc1.py tests/test_fp8_place.py tests/test_fp8_quant_div.py tests/test_fp8_quant_items.py tests/test_fp8_scatter_quant.py tests/test_fp8_cluster.py \
      tests/test_bf16_cluster.py tests/test_fp8_plain_schedule.py tests/test_fp8_smem_scales.py tests/test_fp8_unit_scales.py tests/test_fp8_deferred_epilogue.py tests/test_fp8_tanh_sigmoid.py tests/test_bf16_tanh_sigmoid.py \
      tests/test_fp8_stage_guard.py \
      tests/test_bf16_cluster_n.py tests/test_jump_stages.py tests/test_gated_pingpong.py tests/test_box_tails.py tests/test_fc2_early.py tests/test_torch_compile.py
fi
if [ "$mode" = suite3 ]; then
  step "GPU suite 3/3" "$OUT/suite3.log" -- "${suite_common[@]}" tests/test_ep_virtual_gpu.py
fi
if [ "$mode" = sonic ]; then
  if [ ! -f .device/sonic/run_device.sh ]; then echo "sonic: .device/sonic is missing (carry it)" >&2; exit 2; fi
  ours=(python3 -m moe_ep.bench "${unquantised[@]}" --no-b2b --no-reference --no-decode)
  step "ours, before SonicMoE" "$OUT/sonic_ours_1.log" -- "${ours[@]}" --csv "$OUT/sonic_ours_1.csv"
  # shellcheck disable=SC2086
  step "SonicMoE peer" "$OUT/sonic_peer.log" -- env -u PYTHONPATH OUT="$OUT" bash .device/sonic/run_device.sh \
      ${SONIC_ARGS:---skip-tuned}
  step "ours, after SonicMoE" "$OUT/sonic_ours_2.log" -- "${ours[@]}" --csv "$OUT/sonic_ours_2.csv"
fi
if [ "$mode" = liger ]; then
  lscript=(); [ -f .device/liger/liger_bench.py ] && lscript=(--peer-script .device/liger/liger_bench.py)
  step "LigerCute peer" "$OUT/liger.log" -- bash -c '
    if [ ! -f /tmp/lsite/.ok ]; then bash .device/liger/stage.sh || exit 3; fi
    source .device/liger/env.sh || exit 3
    exec python3 -m moe_ep.bench "$@"' liger "${common[@]}" "${peer_args[@]}" --peer liger "${lscript[@]}" \
      --csv "$OUT/liger.csv"
  # LigerCute at decode token counts (issue 11 wants it beside ours and FlashInfer's), its own env
  step "LigerCute decode" "$OUT/decode_liger.log" -- bash -c '
    source .device/liger/env.sh || exit 3
    exec python3 -m moe_ep.bench "$@"' liger --model "$MODELS" --tokens 128 --iters "$ITERS" "${peer_args[@]}" \
      --peer liger "${lscript[@]}" --peer-decode-tokens "${PEER_DECODE_TOKENS:-1,8,32,128,256}" \
      --decode-csv "$OUT/decode_liger.csv"
fi

echo "===== summary ($(date +%T))"
printf '  %s\n' "${status[@]}"
csvs=$(ls "$OUT"/bench.csv "$OUT"/fi.csv "$OUT"/liger.csv 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$csvs" ] && python3 -m moe_ep.bench.report $csvs
if [ "$mode" = grid ]; then  # one table per precision: FlashInfer's BF16 and FP8 rows carry the same name
  for q in bf16 fp8_block128; do
    csvs=$(ls "$OUT"/bench_*_$q.csv "$OUT"/fi_*_$q.csv 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$csvs" ] && echo "----- $q" && python3 -m moe_ep.bench.report $csvs
  done
fi
# the device returns only a handful of loose files (alphabetical): leave the archive alone in $OUT
if tar czf "/tmp/session_$mode.tgz" -C "$OUT" . 2>/dev/null; then
  find "$OUT" -mindepth 1 -delete && mv "/tmp/session_$mode.tgz" "$OUT/"
fi
# suite: its kernel cache beside the archive, not in it (an archive over 16 MiB would not come back at all)
if [ -f /tmp/suite_kernels.tgz ]; then
  mv /tmp/suite_kernels.tgz "$OUT/suite_kernels.tgz" && echo "suite: kernel cache -> $OUT/suite_kernels.tgz (next call: copy it to .device/suitecache/kernels.tgz and carry .device/suitecache)"
fi
for s in "${status[@]}"; do [[ $s == *": exit 0" ]] || exit 1; done
exit 0
