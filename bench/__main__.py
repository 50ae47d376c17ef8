"""``python -m moe_ep.bench`` — time an MoE layer, as users get it, on the best available backend.

Default job: a Qwen3-30B-A3B-shaped layer (H 2048, I 768, E 128, top-8) with 8192 tokens per rank,
``MoELayer(cfg, group, backend=..., device=...)`` with its default settings, on the best available
backend next to the reference backend. Each backend gets three numbers (see ``bench/report.py``):
per-call eager (sync before each call), back-to-back eager (an engine loop: no sync between calls)
and CUDA-graph replay, each with TFLOP/s per GPU (FLOPs = 6·T·K·H·I with T tokens per rank), and
the ratio of back-to-back to graph throughput. ``--model qwen3,mixtral`` runs several models in
one process; ``--peer flashinfer,liger`` also runs those libraries (each in its own ``torchrun``)
on the same shapes; ``--csv PATH`` writes the rows. Under ``torchrun --nproc_per_node=N`` it runs
expert parallelism over N ranks (then also dispatch/combine GB/s). On GPU a decode-regime sweep
(1–256 tokens per rank) follows. Without a GPU it runs the reference backend on a few tokens and
says so (back-to-back and graph columns are n/a).

Sub-commands: ``layer`` (default), ``gemm`` (SM90 grouped GEMM vs torch._grouped_mm) and
``startup`` (``warmup()`` cold vs warm compile cache, each in a fresh process, and the host time
of one eager forward) and ``hf`` (Qwen3-MoE, gpt-oss and Nemotron-H blocks through transformers'
experts registry: moe_ep vs grouped_mm, eager and CUDA graph) and ``ceiling`` (the layer's two GEMMs done by torch's own
kernels -- dense cuBLAS BF16, ``torch._grouped_mm``, block-wise FP8 ``torch._scaled_mm`` -- as the
layer TFLOP/s they alone would allow: ``bench/ceiling.py``) and ``sustained`` (each expert GEMM,
ours and cuBLAS's, run for seconds in steady state with nvidia-smi sampling power and SM clock:
TFLOP/s, W, MHz, TFLOP/s per GHz, GFLOP per joule: ``bench/sustained.py``) and ``padfill`` (our
GEMMs on the layer's routing with the partial m-tiles' spare rows packed, zero or random: does the
data in rows the kernel throws away cost energy at the power cap? ``bench/padfill.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer, init_distributed
from moe_ep.backends import available, launch_path, retain_runtime

from .models import MODELS, draw_routing, model_config
from .report import LEGEND, Row, env_line, format_tables, make_row, write_csv
from .timing import back_to_back_ms, kernel_timeline, per_call_ms, phase_logged


def make_inputs(cfg: MoEConfig, T: int, group: EPGroup, device, seed: int, skew: bool = False, weights=None):
    """Random tokens, softmax router weights over top-k of random logits, and this rank's expert
    weights: global expert e drawn from its own seed on ``device``, so every EP size sees the same
    global experts (for one device type). ``weights=(w13, w2)`` reuses weights made before."""
    g = torch.Generator().manual_seed(seed)
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate
    El = E // group.world_size
    vals, ids = draw_routing(g, E, K, T, group.world_size, group.rank, skew)
    w = torch.softmax(vals, dim=-1)
    x = torch.randn(T, H, generator=g).to(cfg.dtype)
    if weights is None:
        lo = group.rank * El
        w13 = torch.empty(El, cfg.w13_rows, H, dtype=cfg.dtype, device=device)
        w2 = torch.empty(El, H, I, dtype=cfg.dtype, device=device)
        gw = torch.Generator(device=device)
        for e in range(El):
            gw.manual_seed((seed + 1) * 1_000_003 + lo + e)
            w13[e].copy_(torch.randn(cfg.w13_rows, H, generator=gw, device=device).mul_(H ** -0.5))
            w2[e].copy_(torch.randn(H, I, generator=gw, device=device).mul_(I ** -0.5))
        if cfg.quant == "fp8_block128":  # what an FP8 checkpoint holds: e4m3 + one scale per 128x128 block
            from moe_ep.api.quant import quantize_fp8_block128

            w13, w2 = quantize_fp8_block128(w13), quantize_fp8_block128(w2)
    else:
        w13, w2 = weights
    return (x.to(device), ids.to(torch.int32).to(device), w.float().to(device), w13, w2)


def environment(cuda: bool) -> dict:
    """GPU name, torch version (+ CUDA), moe_ep commit (``MOE_EP_COMMIT`` or ``git rev-parse``), kernel
    launch path (``tvm-ffi`` or why classic: the classic path adds ~0.1 ms of host time per launch)."""
    gpu = torch.cuda.get_device_name() if cuda else "cpu (no CUDA GPU)"
    tv = torch.__version__ + (f" (CUDA {torch.version.cuda})" if cuda and torch.version.cuda else "")
    commit = os.environ.get("MOE_EP_COMMIT", "")
    if not commit:
        for d in (Path(__file__).resolve().parents[1], Path.cwd()):
            try:
                r = subprocess.run(["git", "-C", str(d), "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True, timeout=10)
                if r.returncode == 0 and r.stdout.strip():
                    commit = r.stdout.strip()
                    s = subprocess.run(["git", "-C", str(d), "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=20)
                    if s.returncode == 0 and s.stdout.strip():
                        commit += "-dirty"
                    break
            except (OSError, subprocess.SubprocessError):
                pass
    return dict(gpu=gpu, torch=tv, commit=commit or "n/a", launches=launch_path())


def model_info(key: str, cfg: MoEConfig, T: int) -> str:
    m = MODELS[key]
    return (f"(H {m['hidden']}, I {m['intermediate']}, E {m['num_experts']}, top-{m['top_k']}; "
            f"{cfg.flops(T) / 1e12:.3f} TFLOP per rank per forward)")


def layer_kwargs(args) -> dict:
    """The layer's defaults: the bench measures what users get."""
    return {}


def _and(note: str, more: str) -> str:
    """A row's note with one more clause."""
    return f"{note}; {more}" if note else more


def _barrier(group: EPGroup) -> None:
    if group.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=group.pg)


def bench_backends(args, key: str, cfg: MoEConfig, T: int, group: EPGroup, device, env: dict, say):
    """moe_ep's backends on one model: rows, EP comm-table rows, decode rows, failures."""
    cuda = device.type == "cuda"
    names = args.backend or ["auto"]
    if "reference" not in names and not args.no_reference:
        names = names + ["reference"]
    inputs = make_inputs(cfg, T, group, device, seed=args.seed, skew=args.skew)
    rows: list[Row] = []
    comm, sent, failed = [], 0, 0
    kw = layer_kwargs(args)
    suffix = " deterministic=False" if kw.get("deterministic") is False else ""
    if cfg.quant:
        suffix += f" [{cfg.quant}]"
    for name in names:
        layer = None
        try:
            layer = MoELayer(cfg, group, backend=name, device=device, **kw)
            if name == "auto" and layer.backend_name == "reference" and "reference" in names:
                continue
            layer.warmup(progress=not args.quiet)
            # --rounds R: the three timings R times, interleaved, each the median over the rounds
            # (a drift of the clock or temperature over the run then reaches every mode alike)
            pcs, b2bs, gmss, note = [], [], [], ""
            tag = f"{layer.backend_name} {key}"
            for _ in range(args.rounds):
                pcs.append(phase_logged(f"{tag} per_call", per_call_ms, layer, inputs, args.iters, args.warmup))
                if cuda and not args.no_b2b:
                    b2bs.append(phase_logged(f"{tag} b2b", back_to_back_ms, layer, inputs, args.iters, args.b2b_runs))
                if cuda and layer.backend_name != "reference" and not note:  # the reference backend syncs the host
                    from .ep import graph_ms

                    try:
                        gmss.append(phase_logged(f"{tag} graph", graph_ms, layer, inputs, group, args.iters))
                    except Exception as e:  # noqa: BLE001
                        if group.world_size > 1:
                            raise
                        note = f"CUDA-graph capture/replay failed: {type(e).__name__}: {str(e)[:160]}"
                        say(f"moe_ep.bench: {layer.backend_name} on {MODELS[key]['name']}: {note}")
            pc = statistics.median(pcs)
            b2b = statistics.median(b2bs) if b2bs else None
            gms = statistics.median(gmss) if gmss and not note else None
            if args.rounds > 1:
                note = _and(note, f"median of {args.rounds} interleaved rounds: per call "
                            + " ".join(f"{t:.3f}" for t in pcs)
                            + (" | b2b " + " ".join(f"{t:.3f}" for t in b2bs) if b2bs else "")
                            + (" | graph " + " ".join(f"{t:.3f}" for t in gmss) if gmss else "") + " ms")
            if args.no_b2b:  # the graph phase then follows the per-call one, as in SonicMoE's harness
                note = _and(note, "no back-to-back phase (--no-b2b)")
            if cuda and layer.backend_name != "reference" and env.get("launches", "tvm-ffi") != "tvm-ffi":
                # a row timed on the slow launch path says so
                note = _and(note, f"kernel launches: {env['launches']}")
            rows.append(make_row(MODELS[key]["name"], layer.backend_name + suffix, "moe_ep", T, group.world_size,
                                 cfg.flops(T), pc, b2b, gms, env, note=note))
            if args.profile and cuda and group.rank == 0:
                from torch.profiler import ProfilerActivity, profile

                x, ids, w, w13, w2 = inputs
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        layer.forward(x, ids, w, w13, w2)
                    torch.cuda.synchronize()
                say(f"profile of 5 forwards on {layer.backend_name}, {MODELS[key]['name']}:")
                say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
                try:
                    say(kernel_timeline(prof.events(), 5))
                except Exception as e:  # noqa: BLE001 -- a diagnostic; never fail the bench on it
                    say(f"kernel timeline unavailable: {type(e).__name__}: {e}")
            if (cuda and group.world_size > 1 and not args.no_comm and layer.backend_name != "reference"
                    and hasattr(layer._impl, "comm_ops")):
                from .ep import comm_table

                res = comm_table(layer, inputs, group, args.iters)
                if res:
                    comm, sent = res
        except Exception as e:  # noqa: BLE001
            if group.world_size > 1:
                raise  # the other ranks would wait forever
            failed += 1
            say(f"moe_ep.bench: backend {name!r} on {MODELS[key]['name']} FAILED: {type(e).__name__}: {e}")
            say("".join(traceback.format_exc().splitlines(True)[-15:]))
            rows.append(make_row(MODELS[key]["name"], (layer.backend_name if layer else name) + suffix, "moe_ep",
                                 T, group.world_size, cfg.flops(T), env=env,
                                 note=f"FAILED: {type(e).__name__}: {str(e)[:160]}"))
        finally:
            if layer is not None:
                layer.destroy()
    decode = []
    best = next((r.backend.split(" ")[0] for r in rows if not r.note.startswith("FAILED")), None)
    if cuda and not args.no_decode and best is not None:
        sizes = tuple(args.decode_tokens)
        dcfg = dataclasses.replace(cfg, max_tokens_per_rank=max(sizes))  # the activation's constants too
        from .ep import decode_table

        weights = inputs[3:]
        del inputs
        try:
            decode = [(best, decode_table(lambda: MoELayer(dcfg, group, backend=best, device=device, **kw),
                                          lambda t: make_inputs(dcfg, t, group, device, seed=args.seed + t,
                                                                weights=weights),
                                          dcfg, group, device, args.iters, sizes=sizes,
                                          graph=best != "reference"), dcfg)]
        except Exception as e:  # noqa: BLE001
            if group.world_size > 1:
                raise
            failed += 1
            say(f"moe_ep.bench: decode sweep of {best} on {MODELS[key]['name']} FAILED: {type(e).__name__}: {e}")
    return rows, (comm, sent), decode, failed


def bench_peers(args, key: str, cfg: MoEConfig, T: int, group: EPGroup, device, env: dict, say) -> list[Row]:
    """Each requested peer on one model, in its own torchrun started by rank 0."""
    from .peers import run_peer

    rows: list[Row] = []
    _barrier(group)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if group.rank == 0:
        nproc = args.peer_nproc or group.world_size
        for peer in args.peer:
            opts = peer_options(args, cfg, peer)
            if opts is None:
                say(f"peer {peer}: no {cfg.quant} path to compare with: skipped")
                continue
            script, extra = opts
            res = run_peer(peer, key, MODELS[key], T, nproc, args.iters, script=script, timeout=args.peer_timeout,
                           log_dir=args.peer_log_dir, say=say, extra_args=extra, b2b=not args.no_b2b)
            if "error" in res:
                say(f"peer {peer} on {MODELS[key]['name']} FAILED: {res['error']}")
                if res.get("tail"):
                    say("  | " + res["tail"].replace("\n", "\n  | "))
                rows.append(make_row(MODELS[key]["name"], f"{peer} (peer)", "peer", T, nproc, cfg.flops(T), env=env,
                                     note=f"FAILED: {res['error'][:160]}"))
                continue
            rows.append(make_row(MODELS[key]["name"], res["label"], "peer", T, nproc, cfg.flops(T),
                                 res.get("per_call_ms"), res.get("b2b_ms"), res.get("graph_ms"), env,
                                 note=res.get("note", "")))
            r = rows[-1]
            say(f"peer {peer} on {MODELS[key]['name']}: per-call {r.per_call_ms} ms, b2b {r.b2b_ms} ms, "
                f"graph {r.graph_ms} ms")
    _barrier(group)
    return rows


def peer_options(args, cfg: MoEConfig, peer: str):
    """``(script, extra arguments)`` of a peer run for ``cfg``, or None when the peer has no path
    for its weight format (quantised configs: FlashInfer's SM90 FP8 backend only)."""
    if cfg.quant and peer != "flashinfer":
        return None
    script = args.peer_script if peer == "liger" else args.peer_script_fi
    return script, (["--backend", "fp8"] if cfg.quant == "fp8_block128" else [])


def decode_peers(args, key: str, say) -> list:
    """The --peer libraries at --peer-decode-tokens, as decode-sweep rows (rank 0 only)."""
    from .peer_decode import peer_decode_rows
    from .peers import run_peer

    cfg = model_config(key, max(args.peer_decode_tokens), quant=args.quant)

    def run(peer, model_key, dims, T, nproc):
        script, extra = peer_options(args, cfg, peer)
        return run_peer(peer, model_key, dims, T, nproc, args.iters, script=script, timeout=args.peer_timeout,
                        log_dir=args.peer_log_dir, say=say, extra_args=extra, log_suffix=f"_t{T}")

    peers = [p for p in args.peer if peer_options(args, cfg, p) is not None]
    return peer_decode_rows(peers, MODELS[key]["name"], key, MODELS[key], cfg, args.peer_decode_tokens,
                            args.peer_nproc or 1, args.seed, run, say)


def run_layer(args) -> int:
    group = init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    T = args.tokens if args.tokens is not None else (8192 if cuda else 64)
    say = print if group.rank == 0 else (lambda *a, **k: None)
    if not cuda:
        say(f"moe_ep.bench: no CUDA GPU here: running the reference backend on CPU with {T} tokens/rank "
            "(numbers are for smoke-testing, not performance; back-to-back and graph columns are n/a)")
    env = environment(cuda)
    peers = args.peer if cuda else []
    if args.peer and not cuda:
        say(f"moe_ep.bench: peers {args.peer} need a CUDA GPU: skipped")
    # layers come and go below: keep NVSHMEM initialised once for the whole run
    runtime = None if args.peers_only else retain_runtime(group, device.index if cuda else None)
    rows: list[Row] = []
    infos, comms, decodes, peer_sweeps = {}, [], [], []
    failed = 0
    for key in args.model:
        cfg = model_config(key, T, quant=args.quant)
        infos[MODELS[key]["name"]] = model_info(key, cfg, T)
        if not args.peers_only:
            r, comm, dec, f = bench_backends(args, key, cfg, T, group, device, env, say)
            rows += r
            failed += f
            if comm[0]:
                comms.append((MODELS[key]["name"], comm))
            decodes += [(MODELS[key]["name"], best, d, dcfg) for best, d, dcfg in dec]
            if cuda:
                torch.cuda.empty_cache()
        if peers:
            rows += bench_peers(args, key, cfg, T, group, device, env, say)
        if peers and args.peer_decode_tokens and group.rank == 0:
            peer_sweeps.append((MODELS[key]["name"], decode_peers(args, key, say)))
        if args.csv and group.rank == 0:
            write_csv(args.csv, rows)  # after every model: a later failure keeps the earlier rows
    say(f"\nbackends registered: {available()}")
    for line in format_tables(rows, infos):
        say(line)
    say("")
    say(env_line(env))
    say(LEGEND)
    if args.csv and group.rank == 0:
        write_csv(args.csv, rows)
        say(f"rows written to {args.csv}")
    for name, (comm, sent) in comms:
        say(f"\n{name}: dispatch/combine, {T} tokens/rank: {sent / 1e6:.1f} MB per rank cross NVLink per direction "
            "(one bf16 row per token and remote destination rank); slowest rank's median")
        say(f"{'operation':<26}{'ms':>10}{'GB/s per rank':>15}")
        for op, ms, gbs in comm:
            say(f"{op:<26}{ms:>10.3f}{gbs:>15.1f}")
    from .decode import make_row as decode_row
    from .decode import plot as decode_plot
    from .decode import write_csv as decode_csv

    sweep = []
    for name, best, drows, dcfg in decodes:
        say(f"\n{name}: decode regime, {best}, max_tokens_per_rank={dcfg.max_tokens_per_rank}, "
            f"EP={group.world_size}: per-call median ms; weight GB/s = bytes of the experts hit / time")
        say(f"{'tokens/rank':>12}{'eager ms':>10}{'graph ms':>10}{'experts hit':>13}{'eager GB/s':>12}{'graph GB/s':>12}")
        for t, e, gms, ids in drows:
            r = decode_row(name, best, group.world_size, dcfg, ids, e, gms)
            sweep.append(r)
            say(f"{t:>12}{e:>10.3f}{gms:>10.3f}{r.experts_hit:>13}{r.eager_weight_gbps:>12.0f}"
                f"{r.graph_weight_gbps:>12.0f}")
    for name, prows in peer_sweeps:
        say(f"\n{name}: peers at decode token counts (one run each, layer made for that count): per-call median ms")
        say(f"{'peer':<34}{'tokens/rank':>12}{'eager ms':>10}{'graph ms':>10}{'eager GB/s':>12}{'graph GB/s':>12}")
        for r in prows:
            sweep.append(r)
            say(f"{r.backend[:33]:<34}{r.tokens:>12}{r.eager_ms:>10.3f}{r.graph_ms:>10.3f}{r.eager_weight_gbps:>12.0f}"
                f"{r.graph_weight_gbps:>12.0f}")
    if sweep and group.rank == 0:
        if args.decode_csv:
            decode_csv(args.decode_csv, sweep)
            say(f"decode sweep written to {args.decode_csv}")
        if args.plot:
            say(f"decode plot written to {args.plot}" if decode_plot(args.plot, sweep)
                else "--plot: matplotlib is not installed (pip install 'moe_ep[bench]'); no plot")
    if runtime is not None:
        runtime.release()
    if group.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 1 if failed else 0


def _split_list(values, allowed, aliases=None, what="value"):
    out = []
    for v in values or []:
        for item in v.split(","):
            item = item.strip().lower()
            if not item:
                continue
            item = (aliases or {}).get(item, item)
            if item not in allowed:
                raise ValueError(f"unknown {what} {item!r}; choose from {', '.join(sorted(set(allowed)))}")
            if item not in out:
                out.append(item)
    return out


def main(argv=None) -> int:
    from .peers import ALIASES as PEER_ALIASES, PEERS

    p = argparse.ArgumentParser(prog="python -m moe_ep.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", nargs="?", default="layer", choices=["layer", "gemm", "startup", "hf", "ceiling", "sustained",
                                                           "padfill"])
    p.add_argument("--model", default="qwen3",
                   help=f"model(s), comma-separated, run in turn: {', '.join(sorted(MODELS))} (default qwen3)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192 on GPU, 64 on CPU)")
    p.add_argument("--backend", action="append", help="backend name (repeatable; default: auto)")
    p.add_argument("--no-reference", action="store_true", help="do not also time the reference backend")
    p.add_argument("--skew", action="store_true", help="skewed routing (expert 0 favoured)")
    p.add_argument("--quant", default=None, choices=["fp8_block128"],
                   help="block-scaled weights (MoEConfig.quant): the layers get e4m3 weights quantised from the "
                        "random bf16 ones; FlashInfer runs its FP8 backend")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per-call / forwards per back-to-back run (default 30 on GPU, 3 on CPU)")
    p.add_argument("--b2b-runs", type=int, default=5, help="back-to-back runs (median of their per-forward averages)")
    p.add_argument("--no-b2b", action="store_true",
                   help="skip the back-to-back phase (ours and the --peer runs'): CUDA-graph replays then follow "
                        "the per-call phase, the order of harnesses that time eager then graph (SonicMoE's). Under "
                        "the 700 W cap the phase after the back-to-back one starts on a hotter GPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="time per-call, back-to-back and graph this many times, interleaved; report the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=2.0, help="sustained, padfill: seconds each GEMM is timed (default 2)")
    p.add_argument("--warm-seconds", type=float, default=1.0,
                   help="sustained, padfill: seconds of the same GEMM run untimed first, to reach steady power (default 1)")
    p.add_argument("--raster-m", default="", metavar="N[,N]",
                   help="gemm: also time our GEMMs with N m-tiles per L2 raster group (1-64; default: only the "
                        "shim's choice by K)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--no-comm", action="store_true", help="skip the dispatch/combine GB/s table (EP > 1)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-latency sweep (GPU)")
    p.add_argument("--decode-tokens", default="1,2,4,8,16,32,64,128,256",
                   help="tokens per rank of the decode sweep (comma-separated; default 1,2,4,...,256)")
    p.add_argument("--decode-csv", default=None, metavar="PATH", help="write the decode sweep to PATH as CSV")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot the decode sweep (needs matplotlib)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table per backend")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table's rows to PATH as CSV")
    p.add_argument("--peer", action="append", default=None, metavar="NAME[,NAME]",
                   help=f"also run a peer library in its own process on the same shape: {', '.join(PEERS)} "
                        "(repeatable or comma-separated; its environment must be set up by the caller)")
    p.add_argument("--peers-only", action="store_true", help="run only the --peer libraries, not moe_ep")
    p.add_argument("--peer-script", default=None, help="path to LigerCute's liger_bench.py")
    p.add_argument("--peer-script-fi", default=None, help="path to FlashInfer's bench_fi.py")
    p.add_argument("--peer-nproc", type=int, default=None, help="GPUs per peer run (default: this run's EP size)")
    p.add_argument("--peer-timeout", type=int, default=900, help="seconds per peer run")
    p.add_argument("--peer-log-dir", default=None, help="save each peer run's whole output in this folder")
    p.add_argument("--peer-decode-tokens", default="", metavar="T[,T]",
                   help="also run each --peer at these tokens per rank (one run each) as rows of the decode "
                        "sweep, e.g. 1,8,128")
    args = p.parse_args(argv)
    try:
        if args.job == "hf":  # transformers' block classes: their own list
            from .hf_block import BLOCKS

            args.model = _split_list([args.model], BLOCKS, what="hf block")
        else:
            args.model = _split_list([args.model], MODELS, what="model")
        args.peer = _split_list(args.peer, PEERS, PEER_ALIASES, what="peer")
    except ValueError as e:
        p.error(str(e))
    if not args.model:
        p.error("--model: no model given")
    if args.peers_only and not args.peer:
        p.error("--peers-only needs --peer")
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, got {args.rounds}")
    if args.iters is None:
        args.iters = 30 if torch.cuda.is_available() else 3
    try:
        args.decode_tokens = sorted({int(t) for t in str(args.decode_tokens).split(",") if t.strip()})
    except ValueError:
        p.error(f"--decode-tokens: comma-separated integers, got {args.decode_tokens!r}")
    if not args.decode_tokens or args.decode_tokens[0] < 1:
        p.error("--decode-tokens: at least one token count, each >= 1")
    try:
        args.raster_m = [int(t) for t in str(args.raster_m).split(",") if t.strip()]
    except ValueError:
        p.error(f"--raster-m: comma-separated integers, got {args.raster_m!r}")
    if any(not 1 <= r <= 64 for r in args.raster_m):
        p.error(f"--raster-m: each in 1..64, got {args.raster_m}")
    if args.raster_m and args.job != "gemm":
        p.error("--raster-m: only for the gemm job")
    try:
        args.peer_decode_tokens = sorted({int(t) for t in str(args.peer_decode_tokens).split(",") if t.strip()})
    except ValueError:
        p.error(f"--peer-decode-tokens: comma-separated integers, got {args.peer_decode_tokens!r}")
    if args.peer_decode_tokens and (args.peer_decode_tokens[0] < 1 or not args.peer):
        p.error("--peer-decode-tokens: token counts >= 1, and at least one --peer")
    if args.job == "hf":
        from .hf_block import run_hf

        return run_hf(args)
    if args.job == "padfill":
        from .padfill import run_padfill

        return run_padfill(args)
    if args.job == "sustained":
        from .sustained import run_sustained

        return run_sustained(args)
    if args.job == "ceiling":
        from .ceiling import run_ceiling

        return run_ceiling(args)
    if args.job == "startup":
        from .startup import run_startup

        return run_startup(args)
    if args.job == "gemm":
        from .gemm import run_gemm

        rc = 0
        for key in args.model:
            args_one = argparse.Namespace(**{**vars(args), "model": key})
            rc = run_gemm(args_one) or rc
        return rc
    return run_layer(args)


if __name__ == "__main__":
    sys.exit(main())
