"""Peers benchmarked side by side, each in a process of its own (they own their runtimes).

Each peer's benchmark script is started with ``torchrun --standalone --nproc_per_node=N`` on the
same model and tokens per rank; its environment must be prepared by the caller:

* ``liger``: LigerCute (``liger_bench.py``; ``--peer-script``, ``MOE_EP_LIGER_BENCH``,
  ``shared/peers/liger_bench.py`` beside the checkout, ``.device/liger/liger_bench.py`` or
  ``.device/peers/liger_bench.py``). Environment: ``source .device/liger/env.sh`` (PYTHONPATH
  with ``liger_cute_kernels``, its libcudart 12). Reports per-call and back-to-back (``--b2b``).
* ``flashinfer``: FlashInfer ``moe_ep`` SM90 BF16 (``bench_fi.py``; ``--peer-script-fi``,
  ``MOE_EP_FI_BENCH``, ``shared/peers/flashinfer/bench_fi.py`` beside the checkout or
  ``.device/fi/bench_fi.py``). Environment: ``source .device/fi/pkg/setup.sh``. Reports per-call,
  back-to-back (``--b2b``) and CUDA-graph replay (``--graph``).

Both scripts time like ``moe_ep.bench`` (per call: sync + barrier, CUDA events, median) with the
same FLOP formula; their back-to-back number is ONE run of ``--iters`` forwards (moe_ep's is the
median of several runs). Results are read from the ``--json-out`` file, else from the
``RESULT_JSON`` line, else from the ``SUMMARY`` line of their output. Models other than qwen3 and
mixtral go through the scripts' ``--dims H,I,E,K``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PEERS = ("liger", "flashinfer")
ALIASES = {"liger": "liger", "ligercute": "liger", "flashinfer": "flashinfer", "fi": "flashinfer"}
SCRIPT_MODELS = ("qwen3", "mixtral")     # model names both peer scripts know
LIGER_STAGED_VERSION = "0.8.5"           # pinned by shared/device/stage-liger.sh (its copy has no dist-info)
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC", "GROUP_",
                 "ROLE_")  # a peer started from inside a torchrun worker must not inherit its rank


def _roots() -> list[Path]:
    here = Path(__file__).resolve()
    return [here.parents[1], here.parents[2], Path.cwd(), Path.cwd().parent]


def find_script(peer: str, explicit: str | None = None) -> Path | None:
    """The peer's benchmark script: explicit path, environment variable, then known places."""
    if peer == "liger":
        cands = [explicit, os.environ.get("MOE_EP_LIGER_BENCH")]
        for up in _roots():
            cands += [str(up / "shared" / "peers" / "liger_bench.py"),
                      str(up / ".device" / "liger" / "liger_bench.py"),
                      str(up / ".device" / "peers" / "liger_bench.py")]
    elif peer == "flashinfer":
        cands = [explicit, os.environ.get("MOE_EP_FI_BENCH")]
        for up in _roots():
            cands += [str(up / "shared" / "peers" / "flashinfer" / "bench_fi.py"),
                      str(up / ".device" / "fi" / "bench_fi.py")]
    else:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    for c in cands:
        if c and Path(c).is_file():
            return Path(c)
    return None


def find_liger_script(explicit: str | None) -> Path | None:  # kept for callers of the old name
    return find_script("liger", explicit)


def model_args(model_key: str, dims: dict) -> list[str]:
    """``--model`` for the two models the scripts know, else ``--dims H,I,E,K`` over qwen3."""
    if model_key in SCRIPT_MODELS:
        return ["--model", model_key]
    return ["--model", "qwen3", "--dims", f"{dims['hidden']},{dims['intermediate']},{dims['num_experts']},"
                                          f"{dims['top_k']}"]


# ---- parsing the scripts' output -----------------------------------------------------------
_FLOAT = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|nan|inf)"


def _result_json(stdout: str, json_text: str | None) -> dict | None:
    if json_text:
        try:
            return json.loads(json_text)
        except ValueError:
            pass
    for line in reversed(stdout.splitlines()):
        i = line.find("RESULT_JSON ")
        if i >= 0:
            try:
                return json.loads(line[i + len("RESULT_JSON "):])
            except ValueError:
                continue
    return None


def _max(xs) -> float | None:
    vals = [float(v) for v in (xs or []) if v is not None and float(v) == float(v)]
    return max(vals) if vals else None


def _last(pattern: str, text: str) -> re.Match | None:
    m = None
    for m in re.finditer(pattern, text):
        pass
    return m


def _err_note(errs, tol: float | None = None) -> str:
    e = _max(errs)
    if e is None:
        return "unchecked"
    return f"rel_err {e:.2e}" + (f" ({'PASS' if e <= tol else 'FAIL'} at tol {tol:g})" if tol else "")


def parse_flashinfer(stdout: str, json_text: str | None = None) -> dict:
    """bench_fi.py's result -> ``{label, per_call_ms, b2b_ms, graph_ms, note}`` (None where it did not
    measure), or ``{"error": ...}`` when its output has no result."""
    res = _result_json(stdout, json_text)
    if res is not None and isinstance(res.get("flashinfer_moe_ep"), dict):
        r = res["flashinfer_moe_ep"]
        ver = str(res.get("flashinfer", "")).split(" ")[0]
        kernel = res.get("backend", "")
        out = dict(per_call_ms=r.get("median_ms"), b2b_ms=_max(r.get("b2b_ms_per_rank")),
                   graph_ms=r.get("graph_median_ms"))
        note = [kernel, _err_note(r.get("rel_err_per_rank"))] if kernel else [_err_note(r.get("rel_err_per_rank"))]
    else:
        m = _last(r"SUMMARY FlashInfer-moe_ep\[([^\]]+)\] .*?\| " + _FLOAT + r" ms " + _FLOAT
                  + r" TFLOP/s/GPU([^|\n]*)(?:\| graph " + _FLOAT + r" ms)?", stdout)
        if m is None:
            return {"error": "no RESULT_JSON or SUMMARY line in bench_fi.py's output"}
        kernel = m.group(1)
        b2b = _last(r"FlashInfer moe_ep .*; back-to-back " + _FLOAT + r" ms/iter", stdout)
        out = dict(per_call_ms=float(m.group(2)), b2b_ms=float(b2b.group(1)) if b2b else None,
                   graph_ms=float(m.group(5)) if m.group(5) else None)
        ver_m = _last(r"\] flashinfer (\S+) at ", stdout)
        ver = ver_m.group(1) if ver_m else ""
        note = [kernel, m.group(4).strip(" ,") or "unchecked"]
    ver = ver if re.match(r"^[0-9]", ver or "") else ""
    out["label"] = f"FlashInfer {ver} (peer)" if ver else "FlashInfer (peer)"
    out["note"] = "; ".join(n for n in note if n) + "; b2b = one run of --iters forwards"
    return out


def parse_liger(stdout: str, json_text: str | None = None) -> dict:
    """liger_bench.py's result -> ``{label, per_call_ms, b2b_ms, graph_ms (None), note}`` or
    ``{"error": ...}``."""
    res = _result_json(stdout, json_text)
    ver_m = _last(r"liger_cute_kernels (\S+) at ", stdout)
    ver = ver_m.group(1) if ver_m and re.match(r"^[0-9]", ver_m.group(1)) else LIGER_STAGED_VERSION
    if res is not None and isinstance(res.get("liger"), dict):
        r = res["liger"]
        out = dict(per_call_ms=r.get("median_ms"), b2b_ms=_max(r.get("b2b_ms_per_rank")), graph_ms=None)
        note = _err_note(r.get("rel_err_per_rank"))
    else:
        m = _last(r"SUMMARY .*?\| LigerCute: " + _FLOAT + r" ms " + _FLOAT + r" TFLOP/s/GPU([^|\n]*)", stdout)
        if m is None:
            return {"error": "no RESULT_JSON or SUMMARY line with a LigerCute result in liger_bench.py's output"}
        b2b = _last(r"LigerCute: median .*; back-to-back " + _FLOAT + r" ms/iter", stdout)
        out = dict(per_call_ms=float(m.group(1)), b2b_ms=float(b2b.group(1)) if b2b else None, graph_ms=None)
        note = m.group(3).strip(" ,") or "unchecked"
    out["label"] = f"LigerCute {ver} (peer)"
    out["note"] = f"{note}; no CUDA-graph number; b2b = one run of --iters forwards"
    return out


PARSERS = {"liger": parse_liger, "flashinfer": parse_flashinfer}


# ---- running one ---------------------------------------------------------------------------
def peer_command(peer: str, script: Path, model_key: str, dims: dict, tokens: int, nproc: int, iters: int,
                 json_out: Path, graph: bool = True, extra_args: list[str] | None = None,
                 b2b: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *model_args(model_key, dims), "--tokens", str(tokens), "--iters", str(iters),
           *(["--b2b"] if b2b else []), "--json-out", str(json_out)]
    if peer == "liger":
        cmd.append("--skip-torch")
    elif graph:
        cmd.append("--graph")
    return cmd + list(extra_args or [])


def error_tail(text: str, n: int = 25) -> str:
    """The part of a failed run's output worth printing: the scripts' ``STEP FAILED`` block (step,
    traceback, hint) when there is one -- torchrun's own report after it says little -- else the
    last ``n`` lines."""
    lines = text.rstrip().splitlines()
    idx = [i for i, ln in enumerate(lines) if "STEP FAILED" in ln]
    if idx:
        i = idx[-1]
        block = lines[i:i + n]
        for j, ln in enumerate(block[1:], 1):
            if ln.startswith("=" * 20):  # the block's closing rule
                block = block[:j]
                break
        return "\n".join(block)
    return "\n".join(lines[-n:])


def _run(cmd: list[str], env: dict, timeout: int) -> tuple[str, int | None]:
    """Run ``cmd`` in a session of its own; on timeout kill that whole process group (torchrun's
    workers too, so no orphan keeps the GPU). Returns (stdout + stderr, exit code or None)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return out or "", p.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = p.communicate()
        return out or "", None


def run_peer(peer: str, model_key: str, dims: dict, tokens: int, nproc: int, iters: int,
             script: str | None = None, timeout: int = 900, log_dir: str | None = None, say=print,
             extra_args: list[str] | None = None, log_suffix: str = "", b2b: bool = True) -> dict:
    """Run one peer in its own ``torchrun``; returns the parsed result (see the parsers) or
    ``{"error": ..., "tail": last lines of its output}``. Its whole output goes to
    ``log_dir/peer_<peer>_<model>_ep<N>.log`` when ``log_dir`` is given."""
    path = find_script(peer, script)
    if path is None:
        opt = "--peer-script" if peer == "liger" else "--peer-script-fi"
        return {"error": f"{peer}: benchmark script not found (pass {opt})", "tail": ""}
    with tempfile.TemporaryDirectory() as d:
        jout = Path(d) / f"{peer}.json"
        cmd = peer_command(peer, path, model_key, dims, tokens, nproc, iters, jout, extra_args=extra_args, b2b=b2b)
        say(f"peer {peer}: {' '.join(cmd[2:])}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(_TORCHRUN_ENV)}
        text, rc = _run(cmd, env, timeout)
        if log_dir:
            try:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                tag = "".join("_" + a.lstrip("-") for a in extra_args or []) + log_suffix  # e.g. _backend_fp8
                (Path(log_dir) / f"peer_{peer}_{model_key}_ep{nproc}{tag}.log").write_text(" ".join(cmd) + "\n" + text)
            except OSError:
                pass
        tail = error_tail(text)
        if rc is None:
            return {"error": f"timed out after {timeout}s", "tail": tail}
        json_text = jout.read_text() if jout.is_file() else None
        res = PARSERS[peer](text, json_text)
        if rc != 0:
            res = {"error": f"exit {rc}" + (f" ({res['error']})" if "error" in res else ""), "tail": tail}
        elif "error" in res:
            res["tail"] = tail
        return res


def run_liger(model: str, tokens: int, nproc: int, iters: int, script: str | None, timeout: int = 900) -> dict:
    """Old entry point: LigerCute on ``nproc`` GPUs (qwen3 / mixtral)."""
    return run_peer("liger", model, {}, tokens, nproc, iters, script=script, timeout=timeout)
