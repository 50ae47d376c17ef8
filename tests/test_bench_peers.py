"""The parsers of the peers' outputs (FlashInfer's bench_fi.py, LigerCute's liger_bench.py) on text those
scripts print, the peers' command lines, and `run_peer` under torchrun with a stand-in script."""

import json
import textwrap

import pytest

from moe_ep.bench.models import MODELS
from moe_ep.bench.peers import (error_tail, find_script, model_args, parse_flashinfer, parse_liger, peer_command,
                                run_peer)

# ---- peers: what their scripts print ----------------------------------------------------------
# stdout of `BENCH_FI_CPU_TEST=1 torchrun --standalone --nproc_per_node=1 bench_fi.py --model qwen3
#   --dims 256,128,8,2 --tokens 16 --iters 3 --warmup 1 --b2b --graph --json-out fi.json` (its CPU test
#   mode: gloo and a torch stand-in layer; --graph is ignored there), captured verbatim.
FI_CPU_STDOUT = r"""[rank0] >>> import flashinfer.moe_ep
[rank0] <<< import flashinfer.moe_ep: ok (0.0 s)
[rank0] flashinfer n/a (CPU test)
[rank0] >>> init NCCL process group (device_id bound)
[rank0] <<< init NCCL process group (device_id bound): ok (0.0 s)
[rank0] torch 2.13.0+cpu: CPU TEST MODE (gloo, torch stand-in layer) -- not a benchmark
[rank0] note: --iters 3 < 20
[rank0] config Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2]: backend sm90_bf16_bf16_bf16_push_cake, N=1 GPUs, T=16/rank, H=256, I=128, E=8 (E_local=8), K=2; FLOPs/rank/forward = 6*T*K*H*I = 0.000 TFLOP
[rank0] env: CUDA_VISIBLE_DEVICES= NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[rank0] >>> build random inputs, routing and expert weights
[rank0] <<< build random inputs, routing and expert weights: ok (0.1 s)
[rank0] routing: slots per rank's experts min/max = 32/32 (ideal 32); w13 (8, 256, 256) bf16 (gate|up), w2 (8, 256, 128) bf16, topk ids int32, weights fp32
[rank0] >>> fp32 reference (all-gather experts, per-expert loop)
[rank0] <<< fp32 reference (all-gather experts, per-expert loop): ok (0.2 s)
[rank0] reference |Y| rms = 0.0096, max = 0.0383
[rank0] >>> API dry run of the real flashinfer.moe_ep (CPU)
[rank0] <<< API dry run of the real flashinfer.moe_ep (CPU): ok (0.0 s)
[rank0] API dry run: skipped (flashinfer not importable: ModuleNotFoundError: No module named 'flashinfer')
[rank0] >>> build MoEEpLayer (sm90_bf16_bf16_bf16_push_cake: validate, preprocess weights)
[rank0] <<< build MoEEpLayer (sm90_bf16_bf16_bf16_push_cake: validate, preprocess weights): ok (0.0 s)
[rank0] layer: _CpuStandInLayer
[rank0] >>> collective warmup (workspace + JIT/AOT module load + one forward)
[rank0] <<< collective warmup (workspace + JIT/AOT module load + one forward): ok (0.0 s)
[rank0] >>> first forward + check vs fp32 reference + repeat
[rank0] <<< first forward + check vs fp32 reference + repeat: ok (0.0 s)
[rank0] check: rel_err=2.834e-03 max_abs=1.591e-04 (ref max 3.831e-02) cos=0.999996 finite=True; repeat max|dY|=0.000e+00
[rank0] >>> timing (layer.forward, per-iteration sync + barrier)
[rank0] <<< timing (layer.forward, per-iteration sync + barrier): ok (0.1 s)
[rank0] FlashInfer moe_ep sm90_bf16_bf16_bf16_push_cake: median 1.857 ms (per rank [1.857]), min 1.597 ms -> 0.0 TFLOP/s/GPU; back-to-back 15.911 ms/iter
[rank0] SUMMARY FlashInfer-moe_ep[sm90_bf16_bf16_bf16_push_cake] Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2] gpus=1 T/rank=16 H=256 I=128 E=8 K=2 | 1.857 ms 0.0 TFLOP/s/GPU, rel_err 2.83e-03 PASS (tol 0.02)
[rank0] RESULT_JSON {"model": "Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2]", "backend": "sm90_bf16_bf16_bf16_push_cake", "gpus": 1, "T": 16, "H": 256, "I": 128, "E": 8, "K": 2, "flops_per_rank": 6291456.0, "iters": 3, "warmup": 1, "flashinfer": "n/a (CPU test)", "api_dry_run": "skipped (flashinfer not importable: ModuleNotFoundError: No module named 'flashinfer')", "flashinfer_moe_ep": {"median_ms_per_rank": [1.857250999819371], "min_ms_per_rank": [1.5966649998517823], "rel_err_per_rank": [0.00283413240686059], "repeat_max_abs_diff": [0.0], "median_ms": 1.857250999819371, "tflops_per_gpu": 0.00338750981994996, "b2b_ms_per_rank": [15.910841999963546]}}
[rank0] >>> teardown (layer.destroy collective, destroy process group)
[rank0] <<< teardown (layer.destroy collective, destroy process group): ok (0.0 s)
"""

# The lines bench_fi.py prints on a GPU run with --graph --b2b, written from its f-strings (log(),
# the "FlashInfer moe_ep ..." line, the graph line, SUMMARY with the " | graph" part); numbers from
# shared/REFERENCE.md (Qwen3-30B-A3B, 8192 tokens, one H200).
FI_GPU_LINES = r"""[rank0] flashinfer 0.7.2.post1 at /tmp/fisite/flashinfer (4.1 s)
[rank0] check: rel_err=2.912e-03 max_abs=1.221e-04 (ref max 4.102e-02) cos=0.999996 finite=True; repeat max|dY|=0.000e+00
[rank0] FlashInfer moe_ep sm90_bf16_bf16_bf16_push_cake: median 1.745 ms (per rank [1.745]), min 1.731 ms -> 354.4 TFLOP/s/GPU; back-to-back 1.690 ms/iter
[rank0] graph: median 1.672 ms, rel_err 2.912e-03
[rank0] SUMMARY FlashInfer-moe_ep[sm90_bf16_bf16_bf16_push_cake] Qwen3-30B-A3B gpus=1 T/rank=8192 H=2048 I=768 E=128 K=8 | 1.745 ms 354.4 TFLOP/s/GPU, rel_err 2.91e-03 PASS (tol 0.02) | graph 1.672 ms 370.0 TFLOP/s/GPU
"""

# stdout of `BENCH_LIGER_CPU_TEST=1 torchrun --standalone --nproc_per_node=1 liger_bench.py --model qwen3
#   --dims 256,128,8,2 --tokens 16 --iters 3 --warmup 1 --b2b --skip-torch --json-out lig.json`, its CPU
#   test mode with a throwaway stand-in liger_cute_kernels package on PYTHONPATH, captured verbatim.
LIGER_CPU_STDOUT = r"""[rank0] >>> init NCCL process group (device_id bound)
[rank0] <<< init NCCL process group (device_id bound): ok (0.2 s)
[rank0] torch 2.13.0+cpu: CPU TEST MODE (gloo, fake LigerCute) -- not a benchmark
[rank0] note: --iters 3 < 20
[rank0] config Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2]: N=1 GPUs, T=16/rank, H=256, I=128, E=8 (E_local=8), K=2; FLOPs/rank/forward = 6*T*K*H*I = 0.000 TFLOP
[rank0] env: CUDA_VISIBLE_DEVICES= NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[rank0] >>> build random inputs, routing and expert weights
[rank0] <<< build random inputs, routing and expert weights: ok (0.2 s)
[rank0] routing: slots per rank's experts min/max = 32/32 (ideal 32); weights bf16, gate/up [E_local=8, I=128, H=256], down [E_local, H, I]
[rank0] >>> fp32 reference (all-gather experts, per-expert loop)
[rank0] <<< fp32 reference (all-gather experts, per-expert loop): ok (1.4 s)
[rank0] reference |Y| rms = 0.0096, max = 0.0382
[rank0] >>> LigerCute: preload libcudart.so.12
[rank0] <<< LigerCute: preload libcudart.so.12: ok (0.0 s)
[rank0] libcudart.so.12: skipped (CPU test mode)
[rank0] >>> LigerCute: import liger_cute_kernels (+ tvm_ffi, NVSHMEM host lib)
[rank0] <<< LigerCute: import liger_cute_kernels (+ tvm_ffi, NVSHMEM host lib): ok (0.0 s)
[rank0] liger_cute_kernels unknown (not pip-installed) at /tmp/fake_lck/liger_cute_kernels; apache-tvm-ffi import failed: No module named 'tvm_ffi'; NVSHMEM host: /tmp/fake_lck/liger_cute_kernels/libnvshmem_host.so.3 (found by liger_cute_kernels.tvm_ffi)
[rank0] >>> LigerCute: load native core via TVM FFI
[rank0] <<< LigerCute: load native core via TVM FFI: ok (0.0 s)
[rank0] native core: libliger_cute_kernels_sm90a.so
[rank0] >>> LigerCute: configure (NVSHMEM bootstrap from NCCL + MoE EP context)
[rank0] <<< LigerCute: configure (NVSHMEM bootstrap from NCCL + MoE EP context): ok (0.0 s)
[rank0] LigerCute configured: team=0, n_pes=1; symm config [max_total_slots, max_num_experts, hidden, num_pes, experts_per_pe, max_top_k, initialized] = [32, 8, 256, 1, 8, 2, 1]
[rank0] >>> LigerCute: argument check + first forward + check
[rank0] <<< LigerCute: argument check + first forward + check: ok (0.2 s)
[rank0] LigerCute check: rel_err=1.708e-03 max_abs=1.168e-04 cos=0.999999 finite=True; fwd tile_m=128; repeat max|dY|=0.000e+00
[rank0] >>> LigerCute: timing (moe_fused_fwd_bf16 + moe_pop_fwd)
[rank0] <<< LigerCute: timing (moe_fused_fwd_bf16 + moe_pop_fwd): ok (1.2 s)
[rank0] LigerCute: median 59.788 ms (per rank [59.788]), min 58.938 ms -> 0.0 TFLOP/s/GPU; back-to-back 244.613 ms/iter
[rank0] SUMMARY Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2] gpus=1 T/rank=16 H=256 I=128 E=8 K=2 | LigerCute: 59.788 ms 0.0 TFLOP/s/GPU, rel_err 1.71e-03 PASS | torch EP: skipped | speedup n/a
[rank0] RESULT_JSON {"model": "Qwen3-30B-A3B[dims H=256,I=128,E=8,K=2]", "gpus": 1, "T": 16, "H": 256, "I": 128, "E": 8, "K": 2, "flops_per_rank": 6291456.0, "iters": 3, "warmup": 1, "liger": {"median_ms_per_rank": [59.7880130003432], "min_ms_per_rank": [58.93822899997758], "rel_err_per_rank": [0.0017081835540011525], "median_ms": 59.7880130003432, "tile_m": 128, "tflops_per_gpu": 0.00010522938770291439, "b2b_ms_per_rank": [244.6125793333825], "packed_w13": false}}
[rank0] >>> teardown (NVSHMEM finalize, destroy process group)
[rank0] <<< teardown (NVSHMEM finalize, destroy process group): ok (0.0 s)
"""

# `torchrun --standalone --nproc_per_node=1 bench_fi.py --model qwen3 --tokens 8` without flashinfer
# installed (stdout + stderr), captured; torchrun's traceback in the middle left out.
FI_FAILED_OUTPUT = r"""[rank0] >>> import flashinfer.moe_ep
====================================================================================================
[rank0] STEP FAILED: 'import flashinfer.moe_ep' after 0.0 s: ModuleNotFoundError: No module named 'flashinfer'
Traceback (most recent call last):
  File "/work/shared/peers/flashinfer/bench_fi.py", line 646, in main
    import flashinfer
ModuleNotFoundError: No module named 'flashinfer'
[rank0] hint: source .device/fi/pkg/setup.sh first (PYTHONPATH=/tmp/fisite); needs apache-tvm-ffi, requests, nvidia-ml-py, tqdm, cuda-bindings; fp8 also CuTeDSL + nvshmem4py (FI_CUTE=1)
====================================================================================================
E1201 07:29:19.726000 17036 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 0 (pid: 17088) of binary: /root/.pyenv/versions/3.11.7/bin/python3
[... torchrun's traceback ...]
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
/work/shared/peers/flashinfer/bench_fi.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_07:29:19
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 17088) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _no_json(text):
    return "\n".join(ln for ln in text.splitlines() if "RESULT_JSON" not in ln)


def _result_json(text):
    return next(ln.split("RESULT_JSON ", 1)[1] for ln in text.splitlines() if "RESULT_JSON " in ln)


def test_parse_flashinfer_cpu_capture():
    from_line = parse_flashinfer(FI_CPU_STDOUT)                               # the RESULT_JSON line
    from_file = parse_flashinfer("", json.dumps(json.loads(_result_json(FI_CPU_STDOUT)), indent=2))  # --json-out
    from_summary = parse_flashinfer(_no_json(FI_CPU_STDOUT))                  # the SUMMARY line
    for r in (from_line, from_file, from_summary):
        assert "error" not in r, r
        assert r["per_call_ms"] == pytest.approx(1.857, abs=1e-3)
        assert r["b2b_ms"] == pytest.approx(15.911, abs=1e-3)
        assert r["graph_ms"] is None                                     # no graph in its CPU mode
        assert r["label"] == "FlashInfer (peer)"                         # "flashinfer n/a (CPU test)"
        assert "sm90_bf16_bf16_bf16_push_cake" in r["note"] and "rel_err 2.83e-03" in r["note"]
    assert "PASS" in from_summary["note"]


def test_parse_flashinfer_gpu_lines():
    r = parse_flashinfer(FI_GPU_LINES)
    assert "error" not in r, r
    assert r["label"] == "FlashInfer 0.7.2.post1 (peer)"
    assert (r["per_call_ms"], r["b2b_ms"], r["graph_ms"]) == (1.745, 1.690, 1.672)
    res = dict(model="Qwen3-30B-A3B", backend="sm90_bf16_bf16_bf16_push_cake",
               flashinfer="0.7.2.post1 at /tmp/fisite/flashinfer (4.1 s)",
               flashinfer_moe_ep=dict(median_ms=1.745, b2b_ms_per_rank=[1.69, 1.71], graph_median_ms=1.672,
                                      rel_err_per_rank=[2.9e-3, 3.0e-3]))
    j = parse_flashinfer("", json.dumps(res))   # the keys bench_fi.py writes with --json-out
    assert (j["per_call_ms"], j["b2b_ms"], j["graph_ms"]) == (1.745, 1.71, 1.672)  # slowest rank's b2b
    assert j["label"] == "FlashInfer 0.7.2.post1 (peer)" and "rel_err 3.00e-03" in j["note"]


def test_parse_liger_cpu_capture():
    from_line = parse_liger(LIGER_CPU_STDOUT)
    from_summary = parse_liger(_no_json(LIGER_CPU_STDOUT))
    for r in (from_line, from_summary):
        assert "error" not in r, r
        assert r["per_call_ms"] == pytest.approx(59.788, abs=1e-3)
        assert r["b2b_ms"] == pytest.approx(244.613, abs=1e-3)
        assert r["graph_ms"] is None
        # "liger_cute_kernels unknown (not pip-installed) at ...": the staged version is named
        assert r["label"] == "LigerCute 0.8.5 (peer)"
        assert "rel_err 1.71e-03" in r["note"]
    assert parse_liger(LIGER_CPU_STDOUT.replace("unknown (not pip-installed)", "0.9.0"))["label"] == \
        "LigerCute 0.9.0 (peer)"
    skipped = LIGER_CPU_STDOUT.replace('"liger": {', '"lig": {').replace("| LigerCute: 59.788 ms", "| LigerCute: skipped")
    assert "error" in parse_liger(skipped)


def test_failed_peer_output():
    assert "error" in parse_flashinfer(FI_FAILED_OUTPUT) and "error" in parse_liger(FI_FAILED_OUTPUT)
    tail = error_tail(FI_FAILED_OUTPUT)
    assert tail.startswith("[rank0] STEP FAILED: 'import flashinfer.moe_ep'")
    assert "hint: source .device/fi/pkg/setup.sh" in tail and "ChildFailedError" not in tail


def test_peer_commands_and_scripts(tmp_path, monkeypatch):
    assert model_args("mixtral", MODELS["mixtral"]) == ["--model", "mixtral"]
    assert model_args("dsv3_shard", MODELS["dsv3_shard"]) == ["--model", "qwen3", "--dims", "7168,2048,32,8"]
    fi = peer_command("flashinfer", tmp_path / "bench_fi.py", "qwen3", MODELS["qwen3"], 8192, 2, 30, tmp_path / "o")
    assert fi[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert {"--graph", "--b2b", "--json-out"} <= set(fi) and fi[fi.index("--tokens") + 1] == "8192"
    lg = peer_command("liger", tmp_path / "liger_bench.py", "qwen3", MODELS["qwen3"], 8192, 1, 30, tmp_path / "o")
    assert "--skip-torch" in lg and "--b2b" in lg and "--graph" not in lg   # liger_bench.py has no --graph
    no_b2b = peer_command("flashinfer", tmp_path / "bench_fi.py", "qwen3", MODELS["qwen3"], 8192, 2, 30,
                          tmp_path / "o", b2b=False)  # --no-b2b: the peer skips its back-to-back phase too
    assert "--b2b" not in no_b2b and [a for a in fi if a != "--b2b"] == no_b2b
    fp8 = peer_command("flashinfer", tmp_path / "bench_fi.py", "qwen3", MODELS["qwen3"], 8192, 1, 30, tmp_path / "o",
                       extra_args=["--backend", "fp8"])
    assert fp8[-2:] == ["--backend", "fp8"] and fp8[:-2] == peer_command(
        "flashinfer", tmp_path / "bench_fi.py", "qwen3", MODELS["qwen3"], 8192, 1, 30, tmp_path / "o")
    script = tmp_path / "bench_fi.py"
    script.write_text("")
    monkeypatch.setenv("MOE_EP_FI_BENCH", str(script))
    assert find_script("flashinfer") == script
    assert find_script("flashinfer", str(tmp_path / "missing.py")) == script


FAKE_PEER = textwrap.dedent("""
    import os, sys
    args = sys.argv[1:]
    assert os.environ.get("RANK") == "0" and "--b2b" in args, args
    sys.stdout.write(open(os.environ["FAKE_PEER_TEXT"]).read())
    if os.environ.get("FAKE_PEER_RC", "0") != "0":
        sys.exit(int(os.environ["FAKE_PEER_RC"]))
""")


@pytest.mark.parametrize("fail", [False, True])
def test_run_peer_in_its_own_torchrun(tmp_path, monkeypatch, fail):
    """run_peer starts the script under torchrun, keeps its log, parses it; a failure gives the tail."""
    script = tmp_path / "bench_fi.py"
    script.write_text(FAKE_PEER)
    sample = tmp_path / "sample.txt"
    sample.write_text(FI_FAILED_OUTPUT if fail else FI_GPU_LINES)
    monkeypatch.setenv("FAKE_PEER_TEXT", str(sample))
    monkeypatch.setenv("FAKE_PEER_RC", "3" if fail else "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    logs = tmp_path / "logs"
    res = run_peer("flashinfer", "qwen3", MODELS["qwen3"], 8192, 1, 2, script=str(script), timeout=300,
                   log_dir=str(logs), say=lambda *a: None)
    assert (logs / "peer_flashinfer_qwen3_ep1.log").is_file()
    if fail:
        assert res["error"].startswith("exit ") and "STEP FAILED" in res["tail"]
    else:
        assert "error" not in res, res
        assert (res["per_call_ms"], res["b2b_ms"], res["graph_ms"]) == (1.745, 1.690, 1.672)
