"""Compile the expert-layout kernels for sm_90a WITHOUT a GPU (fake tensors) and check the PTX.

    python -m sm90_megamoe.layout_compile_check            # Qwen3 W=1/2, Mixtral, extras
    python -m sm90_megamoe.layout_compile_check --quick    # Qwen3 W=2 only (+ LocalRoute at W=1)

Per kernel: the instructions the design relies on are present (the bounded acquire wait,
shared-memory histogram atomics, match.any ranking, warp scans, 16-byte vectors in the fused
gather), no global atomic at all (rows are never placed by an atomic),
no local-memory spills (ld.local / st.local in the PTX; and, if a ptxas is installed,
0 bytes of spill / stack in ``ptxas -v``), no float atomics, and the fake-tensor signature
equals the one built from real (CPU) torch tensors by layout_launch's converters.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream

from .ep_compile_check import same_signature
from .ep_launch import _real
from .layout_kernels import counts_len
from .layout_launch import LayoutConfig, fake_args, kinds_for, make_kernel
from .pdl import ptx_problems

EXPECT = {
    "count": ["atom.shared.add", "ld.acquire.sys.global.b64", "%globaltimer", "shfl.sync.up.b32",
              "bar.sync"],
    "place": ["match.any.sync.b32", "popc.b32", "shfl.sync.up.b32", "vote.sync.ballot.b32",
              "shfl.sync.idx.b32", "ld.global.v4.b32", "st.global.v4.b32", "bar.sync"],
    "place_nogather": ["match.any.sync.b32", "popc.b32"],
    # LocalRoute: shared histogram, the dispatch's first-bad-value record (CAS + min), the
    # arrival counter of the last CTA
    # (and the early PDL trigger only for grids of at most half the SMs: %nsmid, drop v90)
    "route": ["%nsmid", "atom.shared.add", "atom.global.cas.b64", "atom.global.min.s64",
              "atom.global.acq_rel.add.u64", "fence.acq_rel.gpu", "ld.global.s32", "bar.sync"],
    "route_i64": ["%nsmid", "atom.shared.add", "atom.global.cas.b64", "atom.global.min.s64",
                  "atom.global.acq_rel.add.u64", "fence.acq_rel.gpu", "ld.global.b64", "bar.sync"],
}
ABSENT = {"place_nogather": ["ld.global.v4.b32", "st.global.v4.b32"],
          # no atomic decides a row: the only atomics are the shared-memory histogram's
          "place": ["atom.global"], "count": ["atom.global.add"],
          # one rank: no wait on a flag, nothing at system scope
          "route": ["ld.acquire.sys", "fence.acq_rel.sys", "%globaltimer"],
          "route_i64": ["ld.acquire.sys", "fence.acq_rel.sys", "%globaltimer"]}
FORBID = ["ld.local", "st.local", "atom.global.add.f", "red.global.add.f"]


def _ptxas():
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.exists(cand):
            return cand
    return None


def ptxas_info(ptx: str, arch: str):
    """(registers, spill bytes) from ``ptxas -v`` if a ptxas is installed, else None. The PTX
    ISA version is lowered to what that ptxas accepts (the kernels use no newer instruction)."""
    exe = _ptxas()
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        for ver in (None, "9.0", "8.8", "8.7", "8.5"):
            txt = ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}",
                                                 ptx, flags=re.M)
            with open(src, "w") as f:
                f.write(txt)
            r = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spills = [int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr)]
                stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr)]
                return (int(regs.group(1)) if regs else -1, sum(spills) + sum(stack))
    return None


def real_cpu_args(kind: str, cfg: LayoutConfig):
    """Arguments as ``Layout`` builds them, from CPU torch tensors (signature comparison)."""
    S, K, H, E_l, W = cfg.slots, cfg.topk, cfg.hidden, cfg.local_experts, cfg.world
    i32, f32, bf = torch.int32, torch.float32, torch.bfloat16
    st = make_fake_stream()
    ids = _real(torch.zeros(S, K, dtype=i32), 4, False)
    cnt = _real(torch.zeros(W, dtype=i32), 4, False)
    err = _real(torch.zeros(4, dtype=i32), 4, False)
    counts = _real(torch.zeros(counts_len(5, E_l), dtype=i32), 4, True)
    n = cutlass.Int32(3)
    if kind in ("route", "route_i64"):
        it, ia = (torch.int64, 8) if kind == "route_i64" else (i32, 4)
        return (_real(torch.zeros(5, K, dtype=it), ia, True), _real(torch.zeros(5, K, dtype=f32), 4, True),
                ids, _real(torch.zeros(S, K, dtype=f32), 4, False), cnt,
                _real(torch.zeros(2 * W, dtype=torch.int64), 8, False),
                _real(torch.zeros(4, dtype=torch.int64), 8, False), err,
                _real(torch.zeros(8, dtype=torch.int64), 8, False),
                _real(torch.zeros(cfg.max_tokens, dtype=i32), 4, False), counts, n, n, st)
    if kind == "count":
        return (ids, cnt, _real(torch.zeros(2 * W, dtype=torch.int64), 8, False),
                _real(torch.zeros(4, dtype=torch.int64), 8, False), err, counts,
                cutlass.Int64(9), n, st)
    R = 37
    return (ids, _real(torch.zeros(S, K, dtype=f32), 4, False), cnt, err, counts,
            _real(torch.zeros(R, H, dtype=bf), 16, True),
            _real(torch.zeros(E_l + 1, dtype=i32), 4, False),
            _real(torch.zeros(R + 5, dtype=i32), 4, True),
            _real(torch.zeros(R + 6, dtype=f32), 4, True),
            _real(torch.zeros(S, K, dtype=i32), 4, False),
            _real(torch.zeros(R + 7, H, dtype=bf), 16, True), n, st)


def check(cfg: LayoutConfig, arch: str = "sm_90a", signatures: bool = True,
          verbose: bool = True):
    opts = f"--gpu-arch {arch} --keep-ptx"
    failures = []
    for kind in kinds_for(cfg, route=cfg.world == 1):
        kern = make_kernel(kind, cfg)
        t0 = time.time()
        c = cute.compile(kern, *fake_args(kind, cfg), options=opts)
        dt = time.time() - t0
        ptx = c.__ptx__
        missing = [p for p in EXPECT[kind] if p not in ptx]
        missing += ptx_problems(ptx, trigger=kind != "count")  # PDL; count spins on the dispatch flags
        absent = [p for p in ABSENT.get(kind, []) if p in ptx]
        forbidden = [p for p in FORBID if p in ptx]
        info = ptxas_info(ptx, arch)
        sass = "ptxas n/a"
        if info is not None:
            sass = f"regs {info[0]:3d} spill/stack {info[1]}B"
            if info[1]:
                forbidden.append(f"SASS spill/stack {info[1]} bytes")
        sig = ""
        if signatures:
            c2 = cute.compile(kern, *real_cpu_args(kind, cfg), options=opts)
            same = same_signature(c, c2)
            sig = "sig=OK" if same else "sig=MISMATCH"
            if not same:
                failures.append(f"{kind} {cfg}: fake/real signature mismatch")
        tag = f"{kind} (W={cfg.world}, H={cfg.hidden}, K={cfg.topk}, E_l={cfg.local_experts})"
        if missing:
            failures.append(f"{tag}: missing {missing}")
        if absent:
            failures.append(f"{tag}: unexpected {absent}")
        if forbidden:
            failures.append(f"{tag}: forbidden {forbidden}")
        if verbose:
            ok = not (missing or absent or forbidden)
            print(f"  {kind:15s} W={cfg.world} H={cfg.hidden:5d} K={cfg.topk:2d} "
                  f"E_l={cfg.local_experts:4d}: compile {dt:5.2f}s ptx {len(ptx.splitlines()):5d} "
                  f"lines  {sass}  {'OK' if ok else 'FAIL'} {sig}")
    return failures


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--arch", default="sm_90a")
    a = p.parse_args(argv)
    cases = [LayoutConfig(2048, 8, 2, 8192, 64),                  # Qwen3-30B-A3B EP=2
             LayoutConfig(2048, 8, 1, 256, 128)]                  # Qwen3 EP=1 decode: LocalRoute
    if not a.quick:
        cases = [LayoutConfig(2048, 8, 1, 8192, 128),             # Qwen3-30B-A3B EP=1
                 LayoutConfig(2048, 8, 2, 8192, 64),              # Qwen3-30B-A3B EP=2
                 LayoutConfig(4096, 2, 2, 8192, 4),               # Mixtral-8x7B EP=2
                 LayoutConfig(4096, 2, 1, 8192, 8),               # Mixtral-8x7B EP=1
                 LayoutConfig(7168, 8, 8, 4096, 32),              # DeepSeek-V3 width, EP=8
                 LayoutConfig(264, 6, 4, 300, 16),                # H % 256 != 0 path
                 LayoutConfig(128, 32, 1, 64, 33),                # K = 32, E_l % 32 != 0
                 LayoutConfig(256, 8, 2, 64, 1024)]               # E_l = 1024: 256 threads
    failures = []
    t0 = time.time()
    for cfg in cases:
        print(f"config {cfg}")
        failures += check(cfg, a.arch, signatures=True)
    print(f"total {time.time() - t0:.1f}s")
    for f in failures:
        print("FAIL:", f)
    print("ALL OK" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
