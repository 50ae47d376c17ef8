"""Compile every kernel for sm_120a WITHOUT a GPU (fake tensors), check the PTX, run ptxas.

    python -m sm120_mxfp8.compile_check           # Qwen3-30B-A3B / Mixtral / gpt-oss-like shapes
    python -m sm120_mxfp8.compile_check --quick   # one GEMM per epilogue + the quantiser

Per kernel: the instructions the design relies on are in the PTX (GEMM: the block-scaled MMA
``mma.sync...kind::mxf8f6f4.block_scale``, TMA, ldmatrix, the cp.async -> mbarrier arrival;
quantiser: the saturating e4m3 conversion, the quad shuffles, a non-flushing multiply), no
local-memory traffic, and, if a ptxas is installed, ``ptxas -arch=sm_120a`` assembles it with
0 bytes of spill / stack; registers, barriers and shared memory are printed (the GEMM's shared
memory is dynamic: its size is the kernel's SharedStorage, checked against SM120's 99 KB).
The fake-tensor signature is compared with the one built from real (CPU) torch tensors by
launch's converters.
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
from typing import Optional

import torch

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
import cutlass

from .constants import SMEM_LIMIT
from .grouped_gemm import Mxfp8GroupedGemmSm120, out_features
from .launch import (
    compile_mxfp8_gemm,
    compile_quantize_rows,
    gemm_cute_args,
    quantize_cute_args,
)
from .quantize import Mxfp8QuantizeRows

ARCH = "sm_120a"
GEMM_EXPECT = ["kind::mxf8f6f4.block_scale", "cp.async.bulk.tensor", "ldmatrix.sync.aligned",
               "cp.async.mbarrier.arrive.noinc", "mbarrier.try_wait.parity", "mbarrier.arrive"]
QUANT_EXPECT = ["cvt.rn.satfinite.e4m3x2.f32", "shfl.sync.bfly", "mul.rn.f32", "ld.global.v4"]
FORBID = ["ld.local", "st.local"]
QUANT_FORBID = FORBID + ["mul.ftz", "mul.rn.ftz", "max.ftz"]  # subnormal inputs must survive


# ---------------------------------------------------------------------------- ptxas
def find_ptxas() -> Optional[str]:
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.exists(cand):
            return cand
    return None


def ptxas_info(ptx: str, arch: str = ARCH) -> Optional[dict]:
    """``ptxas -v`` of ``ptx`` if a ptxas is installed, else None: dict with registers,
    spill (spill stores + loads + stack frame bytes), smem (static bytes), barriers, log.
    The PTX ISA version is lowered to what that ptxas accepts (no newer instruction is used)."""
    exe = find_ptxas()
    if exe is None:
        return None
    last = ""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        for ver in (None, "9.0", "8.8", "8.7"):
            txt = ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}", ptx,
                                                 flags=re.M)
            with open(src, "w") as f:
                f.write(txt)
            r = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
            last = r.stderr
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spills = [int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr)]
                stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr)]
                smem = re.search(r"(\d+) bytes smem", r.stderr)
                bars = re.search(r"used (\d+) barriers", r.stderr)
                return {"registers": int(regs.group(1)) if regs else -1,
                        "spill": sum(spills) + sum(stack),
                        "smem": int(smem.group(1)) if smem else 0,
                        "barriers": int(bars.group(1)) if bars else 0,
                        "log": r.stderr}
    raise RuntimeError(f"ptxas failed:\n{last}")


# ---------------------------------------------------------------------------- signatures
def _entry_name(ptx: str) -> str:
    m = re.search(r"\.entry\s+(\S+?)\(", ptx)
    return m.group(1) if m else ""


def _host_signature(compiled) -> str:
    m = re.search(r"llvm\.func @cutlass___call___\S*?\((.*?)\) -> i32", str(compiled.ir_module))
    sig = re.sub(r"%arg\d+: ", "", m.group(1)) if m else "?"
    return sig.replace("ptr<1>", "ptr")


def same_signature(fake_compiled, real_compiled) -> bool:
    """Same host argument structure and same mangled kernel name (static shapes, strides,
    alignment) up to the address space ('generic' for CPU tensors, 'gmem' for fake CUDA ones)."""
    if _host_signature(fake_compiled) != _host_signature(real_compiled):
        return False
    a = _entry_name(fake_compiled.__ptx__)[:-2]
    b = _entry_name(real_compiled.__ptx__).replace("generic", "gmem")[:-2]
    n = min(len(a), len(b))  # the compiler truncates long names
    cut = a[:n].rfind("_tensorptr")  # drop the (possibly truncated) last tensor argument
    if cut > 0:
        n = cut
    return n > 0 and a[:n] == b[:n]


def _real_gemm_args(epilogue: str, n: int, k: int, num_experts: int, m: int = 37):
    u8 = torch.uint8
    x = torch.zeros(m, k, dtype=u8)
    xs = torch.zeros(m, k // 32, dtype=u8)
    w = torch.zeros(num_experts, n, k, dtype=u8)
    ws = torch.zeros(num_experts, n, k // 32, dtype=u8)
    out = torch.zeros(m, out_features(epilogue, n), dtype=torch.bfloat16)
    offs = torch.zeros(num_experts + 1, dtype=torch.int32)
    rs = torch.zeros(m, dtype=torch.float32)
    return (*gemm_cute_args(x, xs, w, ws, out, offs, rs), cutlass.Int32(3), make_fake_stream())


# ---------------------------------------------------------------------------- checks
def _keep_ptx(folder: str) -> str:
    """Compile options that keep the PTX (``compiled.__ptx__``), written into ``folder``."""
    return f"--keep-ptx --dump-dir={folder}"


def _scan(ptx: str, expect, forbid, what: str) -> None:
    missing = [s for s in expect if s not in ptx]
    present = [s for s in forbid if s in ptx]
    if missing or present:
        raise AssertionError(f"{what}: PTX lacks {missing} / has forbidden {present}")


def check_gemm(epilogue: str, n: int, k: int, num_experts: int, tile_tokens: int,
               num_stages: Optional[int] = None, arch: str = ARCH, signature: bool = False) -> dict:
    """Compile one GEMM variant, check its PTX and ptxas output; returns a summary dict."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:  # --keep-ptx writes a file: never into the cwd
        compiled, kernel = compile_mxfp8_gemm(epilogue, n, k, num_experts, tile_tokens,
                                              num_stages, arch=arch, extra_options=_keep_ptx(d),
                                              return_kernel=True)
        ptx = compiled.__ptx__
    dt = time.time() - t0
    what = f"gemm {epilogue} N={n} K={k} E={num_experts} tile_tokens={tile_tokens}"
    _scan(ptx, GEMM_EXPECT, FORBID, what)
    info = {"what": what, "compile_s": dt, "stages": kernel.num_stages,
            "dyn_smem": kernel.smem_bytes, "threads": kernel.threads,
            "mma": ptx.count("kind::mxf8f6f4.block_scale"), "ptx": ptx}
    if kernel.smem_bytes > SMEM_LIMIT:
        raise AssertionError(f"{what}: {kernel.smem_bytes} B of shared memory > {SMEM_LIMIT}")
    pi = ptxas_info(ptx, arch)
    if pi is not None:
        info.update(registers=pi["registers"], spill=pi["spill"], static_smem=pi["smem"],
                    barriers=pi["barriers"])
        if pi["spill"] != 0:
            raise AssertionError(f"{what}: ptxas reports {pi['spill']} bytes of spill/stack")
        if pi["registers"] * kernel.threads > 65536:
            raise AssertionError(f"{what}: {pi['registers']} registers x {kernel.threads} threads")
        if pi["smem"] + kernel.smem_bytes > SMEM_LIMIT:
            raise AssertionError(f"{what}: shared memory over {SMEM_LIMIT} B")
    if signature:
        with tempfile.TemporaryDirectory() as d:
            real = cute.compile(Mxfp8GroupedGemmSm120(epilogue, tile_tokens, num_stages),
                                *_real_gemm_args(epilogue, n, k, num_experts),
                                options=f"--gpu-arch {arch} {_keep_ptx(d)}")
        info["signature_ok"] = same_signature(compiled, real)
        if not info["signature_ok"]:
            raise AssertionError(f"{what}: fake and real-tensor signatures differ")
    return info


def check_quantize(k: int, arch: str = ARCH, signature: bool = False) -> dict:
    """Compile the row quantiser for K, check its PTX and ptxas output."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_quantize_rows(k, arch=arch, extra_options=_keep_ptx(d))
        ptx = compiled.__ptx__
    dt = time.time() - t0
    what = f"quantize_rows K={k}"
    _scan(ptx, QUANT_EXPECT, QUANT_FORBID, what)
    info = {"what": what, "compile_s": dt, "ptx": ptx}
    pi = ptxas_info(ptx, arch)
    if pi is not None:
        info.update(registers=pi["registers"], spill=pi["spill"], static_smem=pi["smem"],
                    barriers=pi["barriers"])
        if pi["spill"] != 0:
            raise AssertionError(f"{what}: ptxas reports {pi['spill']} bytes of spill/stack")
    if signature:
        m = 5
        real_args = quantize_cute_args(torch.zeros(m, k, dtype=torch.bfloat16),
                                       torch.zeros(m, k, dtype=torch.uint8),
                                       torch.zeros(m, k // 32, dtype=torch.uint8))
        with tempfile.TemporaryDirectory() as d:
            real = cute.compile(Mxfp8QuantizeRows(), *real_args, make_fake_stream(),
                                options=f"--gpu-arch {arch} {_keep_ptx(d)}")
        info["signature_ok"] = same_signature(compiled, real)
        if not info["signature_ok"]:
            raise AssertionError(f"{what}: fake and real-tensor signatures differ")
    return info


# (epilogue, N, K, E, tile_tokens): Qwen3-30B-A3B FC1/FC2 (H 2048, I 768, E 128), Mixtral
# FC1/FC2 (H 4096, I 14336, E 8), a gpt-oss-like FC2 with N = 2880 (not a tile multiple)
GEMM_CASES = [
    ("swiglu", 1536, 2048, 128, 16),
    ("swiglu", 1536, 2048, 128, 8),
    ("swiglu", 1536, 2048, 128, 64),
    ("row_scale", 2048, 768, 128, 16),
    ("row_scale", 2048, 768, 128, 128),
    ("swiglu", 28672, 4096, 8, 128),
    ("row_scale", 4096, 14336, 8, 32),
    ("row_scale", 2880, 2816, 32, 16),
    ("identity", 512, 256, 4, 16),
    ("gelu_glu", 1536, 2048, 128, 16),             # drop v2's gated epilogues, Qwen3's FC1 shape
    ("gelu_tanh_glu", 1536, 2048, 128, 16),
    ("clamped_swiglu", 4096, 4096, 32, 64),         # DeepSeek-V4 shard FC1 (H 4096, I 2048)
    ("softcapped_swiglu", 4608, 4608, 48, 32),      # Inkling2 shard FC1 (H 4608, I 2304)
]
QUICK_GEMM_CASES = [("swiglu", 1536, 2048, 128, 16), ("row_scale", 2048, 768, 128, 16),
                    ("identity", 512, 256, 4, 64), ("clamped_swiglu", 4096, 4096, 32, 64),
                    ("softcapped_swiglu", 4608, 4608, 48, 32)]
QUANT_CASES = [2048, 768, 4096, 14336]


def _fmt(info: dict) -> str:
    keys = ["stages", "threads", "dyn_smem", "static_smem", "registers", "spill", "barriers", "mma",
            "signature_ok"]
    parts = [f"{k}={info[k]}" for k in keys if k in info]
    return f"{info['what']:52s} compile {info['compile_s']:.2f}s  " + " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one GEMM per epilogue + the quantiser")
    ap.add_argument("--arch", default=ARCH)
    args = ap.parse_args(argv)
    if find_ptxas() is None:
        print("ptxas not found: PTX checks only (set PTXAS=/path/to/ptxas)")
    gemm_cases = QUICK_GEMM_CASES if args.quick else GEMM_CASES
    quant_cases = QUANT_CASES[:1] if args.quick else QUANT_CASES
    for i, (epi, n, k, e, tt) in enumerate(gemm_cases):
        print(_fmt(check_gemm(epi, n, k, e, tt, arch=args.arch, signature=(i == 0))), flush=True)
    for i, k in enumerate(quant_cases):
        print(_fmt(check_quantize(k, arch=args.arch, signature=(i == 0))), flush=True)
    print("compile_check: all kernels OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
