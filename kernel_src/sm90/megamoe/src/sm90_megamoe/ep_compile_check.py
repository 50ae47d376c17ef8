"""Compile every EP kernel for sm_90a WITHOUT a GPU (fake tensors) and check the PTX.

    python -m sm90_megamoe.ep_compile_check                 # W in {1,2,4,8}, Qwen3 shapes
    python -m sm90_megamoe.ep_compile_check --quick         # W = 2 only

Checks per kernel: the memory-ordering / timer / vector instructions the protocol relies on
are present (st.release.sys, ld.acquire.sys, fence.acq_rel.sys, %globaltimer, 16-byte
ld/st.global.v4), no local-memory spills, and that the fake-tensor signature equals the one
produced from real (CPU) torch tensors by ep_launch's converters (same mangled kernel name up
to the address space, which is 'generic' for CPU tensors and 'gmem' for CUDA tensors).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream

from .ep_launch import EpBuffers, EpConfig, _real, fake_args, kinds_for, make_kernel
from .pdl import ptx_problems

EXPECT = {
    "dispatch": ["st.release.sys.global.b64", "fence.acq_rel.sys", "atom.global.acq_rel.add.u64",
                 "ld.global.v4.b32", "st.global.v4.b32", "redux.sync.or.b32", "bar.sync",
                 "atom.global.cas.b64", "atom.global.min.s64"],   # the first-bad-input record
    "wait": ["ld.acquire.sys.global.b64", "%globaltimer", "atom.global.cas.b32"],
    "gather": ["ld.global.v4.b32", "st.global.v4.b32"],
    "combine_send": ["st.release.sys.global.b64", "fence.acq_rel.sys",
                     "atom.global.acq_rel.add.u64", "ld.global.v4.b32", "st.global.v4.b32",
                     "cvt.rn.bf16x2.f32", "vote.sync.ballot.b32"],
    "combine_reduce": ["ld.acquire.sys.global.b64", "%globaltimer", "ld.relaxed.gpu",
                       "ld.global.v4.b32", "st.global.v4.b32", "cvt.rn.bf16x2.f32", "bar.sync"],
}
EXPECT["combine_local"] = ["ld.global.v4.b32", "st.global.v4.b32", "vote.sync.ballot.b32"]  # no flags
EXPECT["dispatch_i64"] = EXPECT["dispatch"]
SPIN_KINDS = ("wait", "combine_reduce")  # spin on other ranks' flags: no early PDL trigger
EXPECT["combine_send_weighted"] = EXPECT["combine_send"] + ["fma.rn.f32"]  # w_k * y + acc
FORBID = ["ld.local", "st.local", "atom.global.add.f", "red.global.add.f"]  # spills / float atomics


def _entry_name(ptx: str) -> str:
    m = re.search(r"\.entry\s+(\S+?)\(", ptx)
    return m.group(1) if m else ""


def _host_signature(compiled) -> str:
    """Argument types of the generated host entry (dynamic shape/stride words per tensor)."""
    m = re.search(r"llvm\.func @cutlass___call___\S*?\((.*?)\) -> i32", str(compiled.ir_module))
    sig = re.sub(r"%arg\d+: ", "", m.group(1)) if m else "?"
    return sig.replace("ptr<1>", "ptr")


def same_signature(fake_compiled, real_compiled) -> bool:
    """Fake (CUDA, gmem) vs real CPU-tensor (generic) compile: same host argument structure and
    same mangled kernel name (static shapes/strides/alignment) up to the address space. The
    mangled names are truncated by the compiler, so compare the common prefix."""
    if _host_signature(fake_compiled) != _host_signature(real_compiled):
        return False
    a = _entry_name(fake_compiled.__ptx__)[:-2]
    b = _entry_name(real_compiled.__ptx__).replace("generic", "gmem")[:-2]
    n = min(len(a), len(b))
    n = a[:n].rfind("_tensorptr")  # drop the (possibly truncated) last argument
    return n > 0 and a[:n] == b[:n]


def real_cpu_args(kind: str, cfg: EpConfig):
    """Arguments as EpRank builds them, from CPU torch tensors (only to compare signatures)."""
    H, K, W, S = cfg.hidden, cfg.topk, cfg.world, cfg.slots
    b = EpBuffers.allocate(cfg, "cpu")
    tab = torch.zeros(6, W, dtype=torch.int64)
    T = 37
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    w = torch.zeros(T, K, dtype=torch.float32)
    st = make_fake_stream()
    i32, i64 = cutlass.Int32, cutlass.Int64
    if kind in ("dispatch", "dispatch_i64"):
        wide = kind == "dispatch_i64"
        ids = torch.zeros(T, K, dtype=torch.int64 if wide else torch.int32)
        return (_real(x, 16, True), _real(ids, 8 if wide else 4, True), _real(w, 4, True),
                _real(tab, 8, False), _real(b.ctrl, 8, False), _real(b.err, 4, False),
                _real(b.verr, 8, False), _real(b.dmask, 4, False), i32(0), i32(T), i32(3), st)
    if kind == "wait":
        return (_real(b.flags, 8, False), _real(b.ctrl, 8, False), _real(b.err, 4, False),
                i64(5), st)
    if kind == "gather":
        return (_real(torch.zeros(50, H, dtype=torch.bfloat16), 16, True),
                _real(torch.zeros(77, dtype=torch.int32), 4, True),
                _real(torch.zeros(9, dtype=torch.int32)[8:].view(1), 4, False),
                _real(torch.zeros(77, H, dtype=torch.bfloat16), 16, True), i32(3), st)
    if kind in ("combine_send", "combine_send_weighted"):
        return (_real(torch.zeros(99, H, dtype=torch.bfloat16), 16, True),
                _real(torch.zeros(S, K, dtype=torch.int32), 4, False),
                _real(b.recv_count, 4, False), _real(b.recv_w, 4, False), _real(tab, 8, False),
                _real(b.ctrl, 8, False), _real(b.err, 4, False), i32(0), i32(3), st)
    if kind == "combine_reduce":
        return (_real(b.dmask, 4, False), _real(b.comb, 16, False), _real(b.flags, 8, False),
                _real(b.ctrl, 8, False), _real(b.err, 4, False), _real(x, 16, True), i32(T),
                i64(5), i32(3), st)
    if kind == "combine_local":
        return (_real(torch.zeros(99, H, dtype=torch.bfloat16), 16, True),
                _real(torch.zeros(S, K, dtype=torch.int32), 4, False), _real(b.recv_count, 4, False),
                _real(b.err, 4, False), _real(x, 16, True), i32(T), i32(3), st)
    raise ValueError(kind)


def check(cfg: EpConfig, arch: str = "sm_90a", signatures: bool = True, verbose: bool = True):
    opts = f"--gpu-arch {arch} --keep-ptx"
    failures = []
    for kind in kinds_for(cfg, local_combine=True):
        kern = make_kernel(kind, cfg)
        t0 = time.time()
        c = cute.compile(kern, *fake_args(kind, cfg), options=opts)
        dt = time.time() - t0
        ptx = c.__ptx__
        forbid_local = ["st.release.sys", "fence.acq_rel.sys", "atom.global"] if kind == "combine_local" else []
        expect = [p for p in EXPECT[kind]
                  if not (kind == "combine_reduce" and cfg.world == 1 and p.startswith("cvt"))]
        missing = [p for p in expect if p not in ptx]  # (W=1: bf16 -> f32 -> bf16 folds away)
        missing += ptx_problems(ptx, trigger=kind not in SPIN_KINDS)  # PDL: wait first, early trigger
        forbidden = [p for p in FORBID + forbid_local if p in ptx]
        sig = ""
        if signatures:
            c2 = cute.compile(kern, *real_cpu_args(kind, cfg), options=opts)
            same = same_signature(c, c2)
            sig = "sig=OK" if same else "sig=MISMATCH"
            if not same:
                failures.append(f"{kind}: fake/real signature mismatch:\n  {_entry_name(ptx)}\n"
                                f"  {_entry_name(c2.__ptx__)}")
        if missing:
            failures.append(f"{kind} (W={cfg.world}, H={cfg.hidden}): missing {missing}")
        if forbidden:
            failures.append(f"{kind} (W={cfg.world}, H={cfg.hidden}): forbidden {forbidden}")
        if verbose:
            print(f"  {kind:15s} W={cfg.world} H={cfg.hidden:5d} K={cfg.topk}: compile {dt:5.2f}s "
                  f"ptx {len(ptx.splitlines()):5d} lines  "
                  f"{'OK' if not (missing or forbidden) else 'FAIL'} {sig}")
    return failures


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--arch", default="sm_90a")
    a = p.parse_args(argv)
    worlds = (2,) if a.quick else (1, 2, 4, 8)
    cases = [EpConfig(2048, 8, W, 4096, 128) for W in worlds]             # Qwen3-30B-A3B
    if not a.quick:
        cases += [EpConfig(4096, 2, 2, 8192, 8),                            # Mixtral-8x7B
                  EpConfig(7168, 8, 8, 4096, 256),                          # DeepSeek-V3 width
                  EpConfig(2056, 6, 4, 1000, 64),                           # H % 256 != 0 path
                  EpConfig(64, 8, 4, 100, 16)]                              # tiny rows
    failures = []
    t0 = time.time()
    for cfg in cases:
        print(f"config {cfg}")
        failures += check(cfg, a.arch, signatures=cfg.world == 2 or cfg.hidden != 2048)
    print(f"total {time.time() - t0:.1f}s")
    for f in failures:
        print("FAIL:", f)
    print("ALL OK" if not failures else "FAILED")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
