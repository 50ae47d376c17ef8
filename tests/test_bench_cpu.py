"""`python -m moe_ep.bench` on a CPU machine (reference backend), its table and CSV, and the bench's other
jobs' CPU paths (the peers' parsers: tests/test_bench_peers.py)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from moe_ep.bench.models import MODELS
from moe_ep.bench.report import Row, format_row, make_row, read_csv, write_csv

CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def _bench(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "moe_ep.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=CPU_ENV)


def test_bench_runs_on_cpu():
    p = _bench("--tokens", "16", "--iters", "1", "--warmup", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no CUDA GPU here: running the reference backend" in p.stdout
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("reference")]
    assert lines, p.stdout
    row = lines[0]
    # backend, tokens/rank, EP, per-call ms, TFLOP/s, b2b "n/a", graph "n/a" (no queue, no graph on CPU)
    assert row[-6] == "16" and row[-5] == "1"
    assert float(row[-4]) > 0 and float(row[-3]) > 0
    assert row[-2:] == ["n/a", "n/a"]
    assert "GPU: cpu" in p.stdout and "torch " + __import__("torch").__version__ in p.stdout
    assert "| kernel launches " in p.stdout  # which launch path the timed kernels took


def test_bench_fp8_weights_on_cpu():
    """--quant fp8_block128: the layers get FP8 block-128 weights (quantised from the random bf16
    ones); on CPU the reference backend runs them and the row says the format."""
    p = _bench("--tokens", "4", "--iters", "1", "--warmup", "0", "--quant", "fp8_block128")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith("reference [fp8_block128]")]
    assert rows and float(rows[0][-4]) > 0, p.stdout


def test_bench_two_models_csv_and_peers_on_cpu(tmp_path):
    out = tmp_path / "bench.csv"
    p = _bench("--model", "qwen3,mixtral", "--tokens", "8", "--iters", "2", "--warmup", "0", "--quiet",
               "--csv", str(out), "--peer", "flashinfer", "--peer", "liger")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "need a CUDA GPU: skipped" in p.stdout
    text = p.stdout
    assert text.index("Qwen3-30B-A3B") < text.index("Mixtral-8x7B")
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("reference")]
    assert len(rows) == 2, text
    for r in rows:
        assert r[1:3] == ["8", "1"] and float(r[3]) > 0 and r[-2:] == ["n/a", "n/a"]
    with open(out, newline="") as f:
        recs = list(csv.DictReader(f))
    assert [r["model"] for r in recs] == ["Qwen3-30B-A3B", "Mixtral-8x7B"]
    for r in recs:
        assert r["backend"] == "reference" and r["source"] == "moe_ep" and r["tokens_per_rank"] == "8"
        assert float(r["per_call_ms"]) > 0 and float(r["per_call_tflops"]) > 0
        assert r["b2b_ms"] == r["graph_ms"] == r["b2b_over_graph"] == ""
    back = read_csv(str(out))
    assert [r.model for r in back] == ["Qwen3-30B-A3B", "Mixtral-8x7B"] and back[0].b2b_ms is None
    # the merge of CSV files prints the same rows
    m = subprocess.run([sys.executable, "-m", "moe_ep.bench.report", str(out)], capture_output=True, text=True,
                       timeout=120, env=CPU_ENV)
    assert m.returncode == 0, m.stderr
    assert len([ln for ln in m.stdout.splitlines() if ln.startswith("reference")]) == 2


def test_bench_rounds_report_the_median_of_interleaved_rounds():
    """--rounds 3: the timings three times, interleaved; the row is their median and a note lists
    each round's time (on CPU only per-call exists)."""
    p = _bench("--tokens", "8", "--iters", "1", "--warmup", "0", "--rounds", "3", "--no-decode")
    assert p.returncode == 0, p.stderr[-3000:]
    row = next(line.split() for line in p.stdout.splitlines() if line.startswith("reference"))
    note = next(line for line in p.stdout.splitlines() if "interleaved rounds" in line)
    times = [float(t) for t in note.split("per call ")[1].split(" ms")[0].split()]
    assert len(times) == 3 and "b2b" not in note and "graph" not in note.split("rounds")[1]
    assert abs(float(row[-4]) - sorted(times)[1]) < 1e-3 + 1e-3 * sorted(times)[1], (row, times)


def test_bench_no_b2b_says_so_in_the_note():
    """--no-b2b drops the back-to-back phase (on a GPU; on CPU there is none) and the row says so."""
    p = _bench("--tokens", "8", "--iters", "1", "--warmup", "0", "--no-decode", "--no-b2b")
    assert p.returncode == 0, p.stderr[-3000:]
    assert any("no back-to-back phase (--no-b2b)" in line for line in p.stdout.splitlines())


@pytest.mark.parametrize("args,says", [
    (["--model", "qwen4"], "unknown model 'qwen4'"), (["--peer", "sonic"], "unknown peer 'sonic'"),
    (["--peers-only"], "--peers-only needs --peer"), (["--rounds", "0"], "--rounds: at least 1, got 0"),
    (["gemm", "--raster-m", "8,x"], "--raster-m: comma-separated integers, got '8,x'"),
    (["gemm", "--raster-m", "0"], "--raster-m: each in 1..64, got [0]"),
    (["--raster-m", "8"], "--raster-m: only for the gemm job")])
def test_bench_rejects_bad_arguments(args, says):
    p = _bench(*args, timeout=120)
    assert p.returncode == 2 and f"error: {says}" in p.stderr, p.stderr[-1000:]


# ---- the table and CSV --------------------------------------------------------------------
def test_rows_tflops_ratio_and_na():
    flops = 6 * 8192 * 8 * 2048 * 768
    r = make_row("Qwen3-30B-A3B", "sm90_bf16_cutedsl", "moe_ep", 8192, 1, flops, 1.769, 1.48, 1.388)
    assert r.per_call_tflops == pytest.approx(349.6, abs=0.1) and r.graph_tflops == pytest.approx(445.6, abs=0.1)
    assert r.b2b_over_graph == pytest.approx(1.388 / 1.48)
    tok = format_row(r).split()
    assert tok[1:3] == ["8192", "1"] and len(tok) == 10 and float(tok[-1]) == pytest.approx(0.938, abs=1e-3)
    # no graph: the graph pair and the ratio are one n/a; a NaN time counts as missing
    r2 = make_row("Qwen3-30B-A3B", "reference", "moe_ep", 8192, 1, flops, 5.1, float("nan"), None)
    assert r2.b2b_ms is None and r2.b2b_over_graph is None
    assert format_row(r2).split()[-2:] == ["n/a", "n/a"]
    # a peer with graph but no b2b: the ratio is n/a
    r3 = make_row("Qwen3-30B-A3B", "FlashInfer 0.7.2.post1 (peer)", "peer", 8192, 1, flops, 1.745, None, 1.672)
    assert format_row(r3).split()[-1] == "n/a"


def test_csv_round_trip(tmp_path):
    rows = [make_row("Mixtral-8x7B", "LigerCute 0.8.5 (peer)", "peer", 8192, 2, 1e12, 10.0, 9.5, None,
                     dict(gpu="NVIDIA H200", torch="2.11.0", commit="abc1234"), note="rel_err 3.1e-03"),
            make_row("Mixtral-8x7B", "reference", "moe_ep", 8192, 2, 1e12, None, None, None, note="FAILED: x")]
    path = tmp_path / "r.csv"
    write_csv(str(path), rows)
    back = read_csv(str(path))
    assert isinstance(back[0], Row) and back[0].ep == 2 and back[0].per_call_ms == 10.0
    assert back[0].b2b_tflops == pytest.approx(1e12 / 9.5e-3 / 1e12, rel=1e-5)
    assert back[0].graph_ms is None and back[0].gpu == "NVIDIA H200" and back[0].note == "rel_err 3.1e-03"
    assert back[1].per_call_ms is None and back[1].note == "FAILED: x"


def test_decode_sweep_csv_bandwidth_and_plot(tmp_path):
    """The decode sweep's weight-read bandwidth, CSV round trip and PNG plot (synthetic timings)."""
    import torch

    from moe_ep.api import MoEConfig
    from moe_ep.bench.decode import expert_weight_bytes, make_row, plot, read_csv, write_csv

    cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=256)
    assert expert_weight_bytes(cfg) == (1536 * 2048 + 2048 * 768) * 2
    rows = []
    for T, eager, graph in ((1, 0.5, 0.04), (8, 0.55, 0.1), (128, 0.6, 0.3)):
        ids = torch.stack([torch.randperm(128)[:8] for _ in range(T)])
        r = make_row("Qwen3-30B-A3B", "sm90_bf16_cutedsl", 1, cfg, ids, eager, graph)
        assert r.experts_hit == int(torch.unique(ids).numel()) and (T > 1 or r.experts_hit == 8)
        assert abs(r.graph_weight_gbps - r.weight_bytes / (graph * 1e-3) / 1e9) < 1e-6
        rows.append(r)
    rows.append(make_row("Qwen3-30B-A3B", "reference", 1, cfg, ids, 2.0, float("nan")))
    assert rows[-1].graph_weight_gbps != rows[-1].graph_weight_gbps  # NaN without a graph time
    write_csv(tmp_path / "d.csv", rows)
    back = read_csv(tmp_path / "d.csv")
    assert [(b.tokens, b.experts_hit, b.weight_bytes) for b in back] == [(r.tokens, r.experts_hit, r.weight_bytes)
                                                                          for r in rows]
    assert back[0].graph_ms == rows[0].graph_ms and back[0].backend == rows[0].backend
    pytest.importorskip("matplotlib")
    assert plot(str(tmp_path / "d.png"), rows)
    png = (tmp_path / "d.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    from moe_ep.bench.decode import main as decode_main  # plot a CSV written elsewhere

    assert decode_main([str(tmp_path / "d.csv"), str(tmp_path / "e.png")]) == 0
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def test_peer_decode_rows_from_peer_runs():
    """--peer-decode-tokens: one peer run per token count becomes a decode-sweep row (eager = the
    peer's per-call median, graph = its replay); a failed run is reported and left out."""
    from moe_ep.api import MoEConfig
    from moe_ep.bench.decode import expert_weight_bytes
    from moe_ep.bench.peer_decode import peer_decode_rows, routing_ids

    cfg = MoEConfig(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=128)
    calls, said = [], []

    def run(peer, key, dims, T, nproc):
        calls.append((peer, key, T, nproc))
        if T == 8:
            return {"error": "exit 1", "tail": ""}
        return {"label": "FlashInfer 0.7.2.post1 (peer)", "per_call_ms": 0.1 * T, "b2b_ms": None,
                "graph_ms": 0.05 * T}

    rows = peer_decode_rows(["flashinfer"], "Qwen3-30B-A3B", "qwen3", MODELS["qwen3"], cfg, [1, 8, 128], 1, 0, run,
                            said.append)
    assert calls == [("flashinfer", "qwen3", 1, 1), ("flashinfer", "qwen3", 8, 1), ("flashinfer", "qwen3", 128, 1)]
    assert [r.tokens for r in rows] == [1, 128] and any("8 tokens" in s and "FAILED" in s for s in said)
    r = rows[1]
    assert r.backend == "FlashInfer 0.7.2.post1 (peer)" and (r.eager_ms, r.graph_ms) == (12.8, 6.4)
    hit = int(routing_ids(cfg, 128, 1, 0, 128).unique().numel())
    assert r.experts_hit == hit and r.weight_bytes == hit * expert_weight_bytes(cfg)
    assert abs(r.graph_weight_gbps - r.weight_bytes / 6.4e-3 / 1e9) < 1e-6
    assert rows[0].experts_hit == 8  # one token: its 8 distinct experts


def test_bench_hf_takes_its_own_block_names():
    """`bench hf --model` names transformers blocks (qwen3_fp8 is one; mixtral is not), checked up front."""
    p = _bench("hf", "--model", "qwen3_fp8,mixtral")
    assert p.returncode != 0 and "unknown hf block 'mixtral'" in p.stderr and "qwen3_fp8" in p.stderr


def test_peer_decode_tokens_needs_a_peer():
    p = _bench("--peer-decode-tokens", "1,8")
    assert p.returncode != 0 and "--peer-decode-tokens" in p.stderr


def test_h200_session_suite_parts_cover_every_gpu_test_file():
    """`h200_session.sh suite1|suite2|suite3` together name every test file with GPU tests, once,
    and so does `suite_groups` (`suite`'s parallel groups; a file split by -k may appear twice) -- a new GPU
    test file must be added to both, or it never runs on the H200."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "bench" / "h200_session.sh").read_text()
    named = []
    for part in ("suite1", "suite2", "suite3"):
        block = script[script.index(f'if [ "$mode" = {part} ]; then'):]
        block = block[:block.index("\nfi\n")]
        named += re.findall(r"tests/(test_\w+\.py)", block)
    marker = re.compile(r"^(@|pytestmark = )pytest\.mark\.gpu$", re.M)
    gpu_files = sorted(p.name for p in (root / "tests").glob("test_*.py") if marker.search(p.read_text()))
    assert sorted(named) == gpu_files and len(named) == len(set(named))
    block = script[script.index("suite_groups=("):]
    block = block[:block.index("\n)\n")]
    assert sorted(set(re.findall(r"tests/(test_\w+\.py)", block))) == gpu_files
    assert 'run_groups $(( ${CALL_BUDGET:-540} - SECONDS )) "${suite_groups[@]}"' in script


def test_kernel_timeline_reports_gaps_of_the_last_forward():
    """The profile's timeline: the last forward's kernels with their offsets, durations, own times
    and idle gaps, busy vs span; CPU events ignored; a kernel count that does not split evenly is
    said. A kernel that starts under its predecessor (PDL) owns only the time after that one ended."""
    from types import SimpleNamespace as N

    from moe_ep.bench.timing import kernel_timeline

    ev = [N(time_range=N(start=f * 1000 + s, end=f * 1000 + s + d), name=f"k{i}", device_type="DeviceType.CUDA")
          for f in range(2) for i, (s, d) in enumerate([(0, 100), (112, 50), (170, 20)])]
    ev.append(N(time_range=N(start=5, end=6), name="host op", device_type="DeviceType.CPU"))
    text = kernel_timeline(ev, 2)
    assert "(3 kernels)" in text and "host op" not in text
    assert "own     50.0  gap    12.0  k1" in text and "own     20.0  gap     8.0  k2" in text
    assert "busy 170.0 us of a 190.0 us span (20.0 us idle or overlapped)" in text
    assert "not a whole number" in kernel_timeline(ev[:5], 2)
    # PDL: k1 starts 40 us before k0 ends and ends 30 us after it
    pdl = [N(time_range=N(start=s, end=s + d), name=f"k{i}", device_type="DeviceType.CUDA")
           for i, (s, d) in enumerate([(0, 100), (60, 70), (131, 10)])]
    text = kernel_timeline(pdl, 1)
    assert "70.0 us  own     30.0  gap   -40.0  k1" in text and "own     10.0  gap     1.0  k2" in text


def test_h200_session_accepts_every_mode_it_runs():
    """Every ``if [ "$mode" = X ]`` block of `h200_session.sh` is reachable: X is in the ``modes``
    list the script checks its argument against (mode ``ncu`` was once written but refused)."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "bench" / "h200_session.sh").read_text()
    accepted = set(re.search(r'^modes="([^"]+)"', script, re.M).group(1).split("|"))
    run = set(re.findall(r'"\$mode" = (\w+) \]', script))
    assert run and run <= accepted, f"modes run but refused: {sorted(run - accepted)}"


def test_h200_session_sonic_mode_needs_its_staged_files(tmp_path):
    """`h200_session.sh sonic` without .device/sonic stops before running anything, naming what is missing."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "h200_session.sh"
    p = subprocess.run(["bash", str(script), "sonic"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**CPU_ENV, "OUT": str(tmp_path / "out"), "ALLOW_CLASSIC_LAUNCH": "1"})
    assert p.returncode == 2 and ".device/sonic is missing" in p.stderr, (p.stdout[-2000:], p.stderr[-2000:])


def test_h200_session_grid_runs_each_layer_then_its_peer_then_the_gemms(tmp_path):
    """`h200_session.sh grid`: model by model, BF16 then FP8, ours then FlashInfer with the same
    precision (FP8 -> --quant, FlashInfer's FP8 backend), then the GEMMs; with too little CALL_BUDGET left
    each part is skipped and named, and the run exits 1. `python3 -m ...` is recorded, not run."""
    import shutil
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "h200_session.sh"
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/bash\nif [ "$1" = -m ]; then echo "$*" >> "{calls}"; exit 0; fi\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    fi_pkg = tmp_path / ".device" / "fi" / "pkg"
    fi_pkg.mkdir(parents=True)
    (fi_pkg / "setup.sh").write_text("true\n")
    env = {**CPU_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ALLOW_CLASSIC_LAUNCH": "1", "OUT": str(tmp_path / "out"),
           "MODELS": "qwen3,mixtral", "GEMM_MODELS": "qwen3,gemma4"}
    p = subprocess.run(["bash", str(script), "grid"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    runs = [c for c in calls.read_text().splitlines() if "moe_ep.bench.report" not in c]
    assert len(runs) == 9, runs
    for i, (model, quant) in enumerate([("qwen3", None), ("qwen3", "fp8_block128"), ("mixtral", None),
                                        ("mixtral", "fp8_block128")]):
        ours, peer = runs[2 * i].split(), runs[2 * i + 1].split()
        for argv in (ours, peer):
            assert argv[argv.index("--model") + 1] == model
            assert (argv[argv.index("--quant") + 1] if "--quant" in argv else None) == quant
        assert "--peer" not in ours and "--no-decode" in ours and ours[ours.index("--csv") + 1].endswith(
            f"bench_{model}_{quant or 'bf16'}.csv")
        assert peer[peer.index("--peer") + 1] == "flashinfer"
    assert runs[8].split()[:4] == ["-m", "moe_ep.bench", "gemm", "--model"] and runs[8].endswith("qwen3,gemma4")
    shutil.rmtree(tmp_path / "out")
    p = subprocess.run(["bash", str(script), "grid"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**env, "CALL_BUDGET": "0"})
    assert p.returncode == 1 and p.stdout.count(": skipped, ") == 5 and "grouped GEMMs: skipped" in p.stdout
    # NO_B2B=1 reaches every layer run, ours and FlashInfer's, and not the GEMMs (which have no such phase)
    shutil.rmtree(tmp_path / "out")
    calls.unlink()
    p = subprocess.run(["bash", str(script), "grid"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**env, "NO_B2B": "1"})
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    runs = [c.split() for c in calls.read_text().splitlines() if "moe_ep.bench.report" not in c]
    assert len(runs) == 9 and all("--no-b2b" in argv for argv in runs[:8]) and "--no-b2b" not in runs[8]


def test_ceiling_fp8_operands_are_the_block_wise_scaled_mm_layout():
    """`bench ceiling`'s FP8 operands: what torch._scaled_mm computes from them (emulated here in
    float64: out[m, n] = sum_k a_q[m, k] sa[m, k/128] b_q[k, n] sb[k/128, n/128]) is a @ w.T up to
    e4m3 rounding, and exactly the product of the layer format's dequantised operands."""
    import torch

    from moe_ep.api.quant import dequantize_fp8_block128, dequantize_fp8_rows128, quantize_fp8_block128
    from moe_ep.bench.ceiling import fp8_operands, layer_tflop

    g = torch.Generator().manual_seed(7)
    M, N, K = 192, 256, 384
    a = torch.randn(M, K, generator=g, dtype=torch.float64).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g, dtype=torch.float64) * K ** -0.5).to(torch.bfloat16)
    a_q, sa, b_q, sb = fp8_operands(a, w)
    assert a_q.dtype == b_q.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
    assert sa.shape == (M, K // 128) and sa.stride() == (1, M)  # outer-dim-major, as cuBLAS wants
    assert b_q.shape == (K, N) and b_q.stride() == (1, K)  # column-major B
    assert sb.shape == (K // 128, N // 128) and sb.stride() == (1, K // 128)  # the weight scales, transposed
    k_blk = torch.arange(K) // 128
    A = a_q.double() * sa.double()[:, k_blk]
    B = b_q.double() * sb.double()[k_blk][:, torch.arange(N) // 128]
    out = A @ B
    ref = a.double() @ w.double().t()
    rel = float((out - ref).norm() / ref.norm())
    assert 1e-3 < rel < 6e-2, rel  # e4m3 rounding of both operands, and not zero
    layer_fmt = dequantize_fp8_rows128(a_q, sa.contiguous()).double() @ \
        dequantize_fp8_block128(quantize_fp8_block128(w[None])).double()[0].t()
    torch.testing.assert_close(out, layer_fmt, rtol=1e-5, atol=1e-5)  # dequantised in float32
    # 6 T K H I: Qwen3-30B-A3B at 8192 tokens is 0.6185 TFLOP per forward
    assert abs(layer_tflop(8192, 8, 2048, 768) - 0.618475) < 1e-5


def test_ceiling_job_says_it_needs_a_gpu_on_cpu():
    p = _bench("ceiling", "--model", "qwen3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "needs a CUDA GPU" in p.stdout


def test_graph_timeline_says_it_needs_a_gpu_on_cpu():
    """``python -m moe_ep.bench.graph_timeline`` (eager against CUDA-graph replay, with both kernel
    timelines) imports and refuses cleanly where there is no GPU."""
    p = subprocess.run([sys.executable, "-m", "moe_ep.bench.graph_timeline", "--model", "qwen3"],
                       capture_output=True, text=True, timeout=300, env=CPU_ENV)
    assert p.returncode != 0 and "graph_timeline needs a CUDA GPU" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]


def test_layer_bits_compare_tells_one_flipped_bit(tmp_path, capsys):
    """``bench/layer_bits.py compare``: exit 0 only when every case is bit-identical, and it names
    the case that is not (a flipped low bit, a missing case)."""
    import torch

    from moe_ep.bench.layer_bits import compare

    g = torch.Generator().manual_seed(3)
    a = {"qwen3 bf16 T=8 uniform": torch.randn(8, 16, generator=g).to(torch.bfloat16),
         "qwen3 fp8_block128 T=8 skewed": torch.randn(8, 16, generator=g).to(torch.bfloat16)}
    b = {k: v.clone() for k, v in a.items()}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert compare(str(tmp_path / "a.pt"), str(tmp_path / "b.pt")) == 0
    flipped = b["qwen3 bf16 T=8 uniform"].view(torch.int16).clone()
    flipped[3, 5] ^= 1  # one ulp of one element
    b["qwen3 bf16 T=8 uniform"] = flipped.view(torch.bfloat16)
    del b["qwen3 fp8_block128 T=8 skewed"]
    torch.save(b, tmp_path / "b.pt")
    capsys.readouterr()
    assert compare(str(tmp_path / "a.pt"), str(tmp_path / "b.pt")) == 1
    out = capsys.readouterr().out
    assert "qwen3 bf16 T=8 uniform: bit-identical False" in out
    assert "qwen3 fp8_block128 T=8 skewed: bit-identical False" in out


def test_phase_log_and_power_summary(tmp_path, monkeypatch):
    """`MOE_EP_BENCH_PHASES` makes each timing mode append its wall-clock span, and
    `bench/power.py` averages the nvidia-smi samples that fall inside each span (and none outside)."""
    import datetime as dt
    import time

    from moe_ep.bench import power
    from moe_ep.bench.timing import phase_logged

    log = tmp_path / "phases.txt"
    assert phase_logged("x per_call", lambda a: a + 1, 1) == 2  # no log without the variable
    assert not log.exists()
    monkeypatch.setenv("MOE_EP_BENCH_PHASES", str(log))
    assert phase_logged("qwen3 b2b", lambda: time.sleep(0.05) or 7) == 7
    (t0, t1, name), = power.read_phases(log.read_text().splitlines())
    assert name == "qwen3 b2b" and 0.04 < t1 - t0 < 5

    def stamp(t):
        return dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]

    lines = [f"{stamp(t0 - 1)}, 100.0, 900, 40",     # before the phase: not counted
             f"{stamp(t0 + 0.01)}, 650.0, 1500, 60",
             f"{stamp(t1 - 0.01)}, 700.0, 1300, 62",
             "garbage line", f"{stamp(t1 + 1)}, 50.0, 800, 41"]
    (row,) = power.summarize(power.read_samples(lines), power.read_phases(log.read_text().splitlines()))
    assert row[0] == "qwen3 b2b" and row[1] == 2
    assert abs(row[2] - 675.0) < 1e-9 and abs(row[3] - 1400.0) < 1e-9 and row[4] == 62.0
    csv, ph = tmp_path / "p.csv", tmp_path / "ph.txt"
    csv.write_text("\n".join(lines) + "\n")
    ph.write_text(log.read_text())
    assert power.main([str(csv), str(ph)]) == 0 and power.main([]) == 2


def _torch_bf16_gemm(activation, n, k, num_experts, scale_rows=False, wrong=False):
    """A CPU torch stand-in for our BF16 grouped GEMM launcher (``wrong``: a broken SwiGLU in FC1, the
    row scale left out in FC2)."""
    import torch.nn.functional as F

    def fn(a, w, offs, out, row_scale=None):
        for e in range(num_experts):
            lo, hi = int(offs[e]), int(offs[e + 1])
            y = a[lo:hi].float() @ w[e].float().t()
            if activation == "swiglu":
                g, u = y.chunk(2, dim=-1)
                y = (u if wrong else F.silu(g)) * u
            if scale_rows and not wrong:
                y = y * row_scale[lo:hi, None]
            out[lo:hi] = y.to(out.dtype)
    return fn


def test_sustained_samples_and_checks(monkeypatch):
    """`bench/sustained.py`: nvidia-smi lines parse (with and without the power-cap flag), only the
    samples inside a window count, and each kernel's check accepts a right GEMM and rejects a wrong
    one (torch stand-ins for our kernels on CPU: SwiGLU FC1, row-scaled FC2, FP8 dequantised math)."""
    import datetime as dt

    import torch
    import torch.nn.functional as F

    from moe_ep.api.quant import dequantize_fp8_rows128
    from moe_ep.backends.sm90 import bf16_cutedsl, fp8_cutedsl
    from moe_ep.bench import sustained

    stamp = lambda t: dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]  # noqa: E731
    s = sustained.parse_sample(f"{stamp(100.0)}, 690.5, 1410, 57, Active")
    assert abs(s[0] - 100.0) < 1e-3 and s[1:] == (690.5, 1410.0, 57.0, True)
    assert sustained.parse_sample(f"{stamp(100.0)}, 300.0, 1980, 40, Not Active")[4] is False
    assert sustained.parse_sample(f"{stamp(100.0)}, 300.0, 1980, 40")[4] is None
    assert sustained.parse_sample("garbage") is None and sustained.parse_sample("a, b, c, d") is None
    samples = [(1.0, 100.0, 900.0, 40.0, False), (2.0, 680.0, 1400.0, 55.0, True),
               (3.0, 700.0, 1300.0, 56.0, False), (9.0, 50.0, 800.0, 40.0, False)]
    n, w, mhz, cap = sustained.window_stats(samples, 1.5, 3.5)
    assert n == 2 and abs(w - 690.0) < 1e-9 and abs(mhz - 1350.0) < 1e-9 and abs(cap - 0.5) < 1e-9
    assert sustained.window_stats(samples, 4.0, 5.0)[0] == 0

    def fp8_gemm(activation, n, k, num_experts, scale_rows=False, ignore_b_scale=False):
        def fn(a, a_scale, b, b_scale, offs, out, row_scale):
            x = dequantize_fp8_rows128(a, a_scale)
            for e in range(num_experts):
                lo, hi = int(offs[e]), int(offs[e + 1])
                s = b_scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
                s = torch.ones_like(s) if ignore_b_scale else s
                y = x[lo:hi] @ (b[e].float() * s).t()
                if activation == "swiglu":
                    g, u = y.chunk(2, dim=-1)
                    y = F.silu(g) * u
                if scale_rows:
                    y = y * row_scale[lo:hi, None]
                out[lo:hi] = y.to(out.dtype)
        return fn

    H, I, E, M = 256, 128, 4, 512  # noqa: E741
    for wrong in (False, True):
        monkeypatch.setattr(bf16_cutedsl, "grouped_gemm", lambda *a, **k: _torch_bf16_gemm(*a, **k, wrong=wrong))
        kernels = sustained._kernels(H, I, E, M, None, 0, dev="cpu")
        assert [k[0] for k in kernels] == ["FC1"] * 3 + ["FC2"] * 3
        errs = {}
        for gemm, name, flops, fn, sets, check in kernels:
            fn(*sets[0])
            errs[gemm, name] = check()
        assert flops == 2.0 * M * I * H
        ours = {("FC1", "moe_ep bf16 (grouped, swiglu)"), ("FC2", "moe_ep bf16 (grouped, row scale)")}
        assert ours <= set(errs)
        for key in ours:  # a row scale left out is off by the spread of the scales (~0.25-0.3 here)
            assert (errs[key] > 0.1) if wrong else (errs[key] < 1e-2), (key, errs[key])
        assert all(v < 1e-2 for key, v in errs.items() if key not in ours)
    for wrong in (False, True):  # wrong: the weights' block scales left out
        monkeypatch.setattr(fp8_cutedsl, "grouped_gemm_fp8",
                            lambda *a, **k: fp8_gemm(*a, **k, ignore_b_scale=wrong))
        kernels = sustained._kernels(H, I, E, M, "fp8_block128", 1, dev="cpu")
        checked = 0
        for gemm, name, flops, fn, sets, check in kernels:
            if name.startswith("moe_ep"):  # cuBLAS's block-wise _scaled_mm has no CPU kernel
                fn(*sets[0])
                err = check()
                assert (err > 0.3) if wrong else (err < 1e-2), (gemm, name, err)
                checked += 1
        assert checked == 2


def test_host_profile_wraps_every_launcher_form():
    """host_profile's timeline marks a plain launcher, a dict of them (the prepared route per
    row-gather choice) and a dict of (FC1, FC2) pairs (the BF16 GEMM runs per path, a gathering FC1
    being None); the calls still reach the launchers. Its host speed probe is a positive time."""
    from types import SimpleNamespace

    from moe_ep.bench.host_profile import host_speed_us, wrap_launcher

    calls, marks = [], []
    obj = SimpleNamespace(_combine_run=lambda out: calls.append(("combine", out)),
                          _route_run={True: lambda x: calls.append(("route", x))},
                          _expert_runs={False: (None, lambda w, b=None: calls.append(("fc2", w)))})
    for name in ("_combine_run", "_route_run", "_expert_runs", "missing"):
        wrap_launcher(obj, name, marks)
    obj._combine_run(1), obj._route_run[True](2), obj._expert_runs[False][1](3)
    assert obj._expert_runs[False][0] is None
    assert calls == [("combine", 1), ("route", 2), ("fc2", 3)]
    assert [m for m, _ in marks] == ["_combine_run >", "_combine_run <", "_route_run[True] >", "_route_run[True] <",
                                     "_expert_runs[False] fc2 >", "_expert_runs[False] fc2 <"]
    assert all(a <= b for (_, a), (_, b) in zip(marks, marks[1:])) and host_speed_us(3) > 0


def test_schedule_model_counts_tiles_and_segments_as_the_kernel_runs_them(capsys):
    """`bench/schedule_model.py` on toy cases worked by hand: every tile once, in the drop's
    raster order; a segment is ready when the last of its rows' tiles ends; the combine work left
    after FC2 is what the spare bandwidth could not serve; and the CLI prints both answers."""
    import numpy as np

    from moe_ep.bench import schedule_model as sm

    counts = np.array([5, 0, 3])  # tile_m 2: expert 0 has m-tiles 0, 1, 2; expert 2 has 0, 1
    order = sm.tile_schedule(counts, tile_m=2, n_tiles=2, raster_m=2)
    assert sorted(order) == sorted([(0, m, n) for m in range(3) for n in range(2)]
                                   + [(2, m, n) for m in range(2) for n in range(2)])
    # raster groups of 2 m-tiles, the m-tile fast; expert 0's last group holds one m-tile
    assert order[:6] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (0, 2, 0), (0, 2, 1)]
    assert sm.tile_schedule(counts, 2, 2, raster_m=1)[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]

    # tokens 0-3 with K = 2; grouped rows: expert 0 = tokens 0, 1, 3 (rows 0-2), expert 1 = 0, 2
    ids = np.array([[0, 1], [0, 2], [1, 2], [0, 3]])
    counts = np.array([3, 2, 2, 1])
    order = sm.tile_schedule(counts, tile_m=2, n_tiles=1, raster_m=1)
    assert order == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)]
    ready = sm.segment_ready(ids, counts, order, ctas=1, tile_m=2, n_tiles=1)
    # one CTA: tile i ends at slot i + 1. token 0: expert 0 m-tile 0 (1), expert 1 m-tile 0 (3);
    # token 1: e0 m0 (1), e2 m0 (4); token 2: e1 m0 (3), e2 m0 (4); token 3: e0 m1 (2), e3 m0 (5)
    assert ready[:, 0].tolist() == [3, 4, 4, 5]
    assert sm.segment_ready(ids, counts, order, ctas=2, tile_m=2, n_tiles=1)[:, 0].tolist() == [2, 2, 2, 3]

    # 4 segments of 10 MB; all ready at the end: the whole 40 MB after FC2 at 2 TB/s = 20 us
    assert sm.combine_left_us(np.full(4, 100.0), 40.0, 1.0, 2.0, 100.0) == 20.0
    # all ready at 0, 1 TB/s spare for 100 us: nothing left
    assert sm.combine_left_us(np.zeros(4), 40.0, 1.0, 2.0, 100.0) == 0.0
    # two ready at 90 us, two at 100: 20 MB by 90, 10 served by 100, 30 left -> 15 us
    assert abs(sm.combine_left_us(np.array([90.0, 90.0, 100.0, 100.0]), 40.0, 1.0, 2.0, 100.0) - 15.0) < 1e-12

    # last wave: 10 tiles on 4 CTAs = 3 slots of 30 us each, 2 CTAs idle in the last -> 2 * 30 / 4 = 15 us
    assert sm.last_wave_idle_us(10, 4, 90.0) == 15.0
    assert sm.last_wave_idle_us(12, 4, 90.0) == 0.0

    sm.main(["--model", "qwen3", "--tokens", "1024", "--passes", "1", "2"])
    out = capsys.readouterr().out
    assert "1. m-tiles:" in out and "a separate tail launch re-reads" in out
    assert "1 pass(es): segments ready" in out and "2 pass(es): segments ready" in out
    assert "3. FC1:" in out and "could fill FC1's idle slots" in out


def test_bench_gemm_interleaves_ours_and_torch(monkeypatch):
    """`bench gemm` times ours and torch's run by run, alternating which goes first, so neither loop
    gets the cooler GPU; each median comes from its own function's runs only. A fake event clock
    stands in for CUDA: a call advances it by its function's cost plus a drift that grows with time
    (the GPU heating), and the medians must give each function its own cost."""
    import torch

    from moe_ep.bench import gemm

    clock = [0.0]
    calls = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    def runner(name, cost):
        def fn(x):
            calls.append((name, x))
            clock[0] += cost + 0.001 * len(calls)  # later runs slower: a heating GPU
        return fn

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    iters = 6
    ma, mb = gemm._median_pair_ms(runner("a", 2.0), [(0,), (1,), (2,)], runner("b", 3.0), [(10,), (11,)], iters)
    timed = calls[4:]  # after two warm-up runs of each
    assert [c[0] for c in calls[:4]] == ["a", "a", "b", "b"]
    assert [c[0] for c in timed] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert [x for n, x in timed if n == "a"] == [0, 1, 2, 0, 1, 2]  # input sets rotate per function
    assert [x for n, x in timed if n == "b"] == [10, 11, 10, 11, 10, 11]
    drift = [0.001 * (i + 5) for i in range(2 * iters)]  # the drift each timed run carried
    own = lambda name, cost: sorted(cost + d for (n, _), d in zip(timed, drift) if n == name)  # noqa: E731
    assert ma == pytest.approx(sum(own("a", 2.0)[2:4]) / 2) and mb == pytest.approx(sum(own("b", 3.0)[2:4]) / 2)
    assert 2.0 < ma < 2.02 and 3.0 < mb < 3.02


def test_ncu_gemm_routings():
    """``bench.ncu_gemm --routing``: uniform counts differ by at most one; topk counts each token's K
    distinct experts (compared with a per-token count), leaving m-tile counts of both parities."""
    import torch

    from moe_ep.bench.ncu_gemm import routing_offsets

    T, E, K = 8192, 128, 8
    uni = routing_offsets(T, E, K, "uniform", device="cpu").long()
    assert uni[0] == 0 and uni[-1] == T * K and int((uni[1:] - uni[:-1]).max() - (uni[1:] - uni[:-1]).min()) <= 1
    top = routing_offsets(T, E, K, "topk", device="cpu").long()
    ids = torch.randn(T, E, generator=torch.Generator().manual_seed(0)).argsort(-1, descending=True)[:, :K]
    want = torch.zeros(E, dtype=torch.long)
    for row in ids.tolist():
        for e in row:
            want[e] += 1
    assert torch.equal(top[1:] - top[:-1], want) and top[-1] == T * K
    tiles = (top[1:] - top[:-1] + 127) // 128
    assert 0 < int((tiles % 2).sum()) < E
    with pytest.raises(ValueError, match="routing"):
        routing_offsets(T, E, K, "skewed", device="cpu")


def test_padfill_layout_puts_each_expert_at_a_tile_multiple():
    import numpy as np

    from moe_ep.bench.padfill import padded_layout

    rng = np.random.default_rng(7)
    for counts in ([3, 0, 130, 128, 1], list(rng.integers(0, 700, size=33)), [0, 0]):
        packed, padded, dst = padded_layout(counts, tile_m=128)
        # independent: walk the rows one by one
        want_dst, start = [], 0
        for c in counts:
            want_dst += [start + j for j in range(c)]
            start += ((c + 127) // 128) * 128
        assert dst.tolist() == want_dst
        assert padded[-1] == start and all(p % 128 == 0 for p in padded)
        assert packed.tolist() == [sum(counts[:e]) for e in range(len(counts) + 1)]
        # same m-tiles in both layouts
        assert sum(-(-c // 128) for c in counts) * 128 == padded[-1]


def test_padfill_job_says_it_needs_a_gpu_on_cpu():
    p = _bench("padfill", "--model", "qwen3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "needs a CUDA GPU" in p.stdout


def test_padfill_variants_check_the_real_rows_in_every_layout(monkeypatch):
    """``bench padfill``'s three layouts hold the same real rows (zeros or random numbers between the
    padded experts), and each check compares those rows with float32: a right GEMM passes in every
    layout, a wrong one fails in every layout (a torch stand-in for our kernels on CPU)."""
    import numpy as np

    from moe_ep.backends.sm90 import bf16_cutedsl
    from moe_ep.bench import padfill

    counts = np.array([3, 0, 130, 128, 77, 1])
    H, I, E = 128, 64, len(counts)  # noqa: E741
    for wrong in (False, True):
        monkeypatch.setattr(bf16_cutedsl, "grouped_gemm", lambda *a, **k: _torch_bf16_gemm(*a, **k, wrong=wrong))
        kernels, M, Mp = padfill._variants(H, I, E, counts, None, 0, dev="cpu")
        assert (M, Mp) == (339, 768)
        assert sorted({k[1] for k in kernels}) == ["packed", "padded, random tails", "padded, zero tails"]
        for gemm, name, flops, fn, check in kernels:
            fn()
            err = check()
            assert flops == (2.0 * M * H * 2 * I if gemm == "FC1" else 2.0 * M * I * H)
            assert (err > 0.1) if wrong else (err < 1e-2), (gemm, name, err)  # FC2 without its row scale: ~0.25


def test_h200_session_suite_names_the_groups_to_run_again(tmp_path):
    """`h200_session.sh suite` ends by naming the groups that failed or were cut as the next call's
    ``SUITE_GROUPS``, and that value, passed back, runs exactly those groups (pytest recorded, not run:
    a group whose arguments hold ``tests/b.py`` fails)."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "h200_session.sh"
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/bash\nif [ "$1 $2" = "-m pytest" ]; then echo "$*" >> "{calls}"; '
        f'case "$*" in *tests/b.py*) exit 1;; esac; exit 0; fi\n'
        f'if [ "$1" = -m ]; then exit 0; fi\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**CPU_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ALLOW_CLASSIC_LAUNCH": "1", "OUT": str(tmp_path / "out"),
           "SUITE_GROUPS": "tests/a.py|tests/b.py;-k;not (x or y)|tests/c.py;tests/d.py"}
    p = subprocess.run(["bash", str(script), "suite"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1 and calls.read_text().count("-m pytest") == 3, (p.stdout[-2000:], calls.read_text())
    m = re.search(r'next call: SUITE_GROUPS="([^"]*)" bash bench/h200_session.sh suite', p.stdout)
    assert m and m.group(1) == "tests/b.py;-k;not (x or y)", (p.stdout[-2000:], p.stderr[-2000:])
    calls.unlink()
    p = subprocess.run(["bash", str(script), "suite"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**env, "OUT": str(tmp_path / "out2"), "SUITE_GROUPS": m.group(1)})
    (run,) = calls.read_text().splitlines()
    assert run.endswith("tests/b.py -k not (x or y)"), run
    assert " -v " in run  # a line per test: a group cut at the limit shows which tests ran
    assert "next call: SUITE_GROUPS=\"tests/b.py;-k;not (x or y)\"" in p.stdout


def test_h200_session_suite_brings_its_kernel_cache_back_and_seeds_from_it(tmp_path):
    """`h200_session.sh suite` returns the disk compile cache its groups filled as $OUT/suite_kernels.tgz,
    beside the session archive (not in it), and a later call given that file (SUITE_CACHE) starts with
    those kernels in the cache. pytest is faked: it writes one kernel per group, and with
    NEED=<kernel> fails unless that kernel was already in the cache before it ran."""
    import subprocess
    import tarfile
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "h200_session.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        '#!/bin/bash\nif [ "$1 $2" = "-m pytest" ]; then\n'
        '  if [ -n "${NEED:-}" ] && [ ! -f "$MOE_EP_CACHE_DIR/v1/ns/$NEED.o" ]; then exit 1; fi\n'
        '  mkdir -p "$MOE_EP_CACHE_DIR/v1/ns"; k=$(echo "${@: -1}" | tr -c "a-z0-9\\n" _)\n'
        '  echo "kernel $k" > "$MOE_EP_CACHE_DIR/v1/ns/$k.o"\n'
        '  echo "{\\"namespace\\": \\"ns\\", \\"key\\": \\"Key($k)\\"}" > "$MOE_EP_CACHE_DIR/v1/ns/$k.json"; exit 0\nfi\n'
        f'if [ "$1 $2" = "-m moe_ep.aot" ]; then exec "{sys.executable}" "$@"; fi\n'
        f'if [ "$1" = -m ]; then exit 0; fi\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**CPU_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ALLOW_CLASSIC_LAUNCH": "1",
           "OUT": str(tmp_path / "out"), "MOE_EP_CACHE_DIR": str(tmp_path / "cache1"),
           "SUITE_GROUPS": "tests/a.py|tests/b.py"}
    p = subprocess.run(["bash", str(script), "suite"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    back = tmp_path / "out" / "suite_kernels.tgz"
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == ["session_suite.tgz", "suite_kernels.tgz"]
    with tarfile.open(back) as t:
        assert sorted(Path(n).name for n in t.getnames() if n.endswith(".o")) == ["tests_a_py.o", "tests_b_py.o"]
    with tarfile.open(tmp_path / "out" / "session_suite.tgz") as t:
        assert not any("suite_kernels.tgz" in n for n in t.getnames())
        # the keys of those kernels, for bench/suite_kernels.json (`python -m moe_ep.aot manifest --merge`)
        manifest = json.load(t.extractfile(next(m for m in t.getmembers() if m.name.endswith("suite_kernels.json"))))
    assert manifest == [{"namespace": "ns", "name": f"tests_{g}_py", "key": f"Key(tests_{g}_py)"} for g in "ab"]
    # a fresh cache: without the seed the group that needs b's kernel fails, with it (SUITE_CACHE) it passes
    seed = tmp_path / "seed.tgz"
    back.rename(seed)
    run2 = {**env, "MOE_EP_CACHE_DIR": str(tmp_path / "cache2"), "NEED": "tests_b_py", "SUITE_GROUPS": "tests/c.py"}
    p = subprocess.run(["bash", str(script), "suite"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**run2, "OUT": str(tmp_path / "out2"), "SUITE_CACHE": str(tmp_path / "missing.tgz")})
    assert p.returncode == 1 and "exit 1" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    p = subprocess.run(["bash", str(script), "suite"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**run2, "MOE_EP_CACHE_DIR": str(tmp_path / "cache3"), "OUT": str(tmp_path / "out3"),
                            "SUITE_CACHE": str(seed)})
    assert p.returncode == 0 and "seeded" in p.stdout and "(2 kernels)" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
